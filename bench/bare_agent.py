"""The floor under the agent: the same uvicorn server doing none of the agent's work.

``bench/scrape.py --baseline`` runs this next to the agent, under the same load. It reads and drops
every push-stream chunk, answers ``/metrics`` with a fixed body as large as the agent's, and nothing
else, on the agent's own server and settings (uvloop, uvicorn's h11 protocol, uvicorn.Server). What
the agent costs above it is the agent's own work; the rest is the HTTP server and the machine's
wake-ups, which change from hour to hour on a VM.

    python bench/bare_agent.py --port 9402 --body-bytes 496890
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import uvicorn

Scope = dict[str, Any]


def bare_app(body: bytes) -> Any:
    streams = {"open": 0}

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        path, method = scope["path"], scope["method"]
        if path == "/v1/push/stream" and method == "POST":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/x-ndjson")]})
            streams["open"] += 1
            more = True
            while more:
                message = await receive()
                more = message["type"] == "http.request" and message.get("more_body", False)
            streams["open"] -= 1
            await send({"type": "http.response.body", "body": b'{"accepted": 0, "refused": 0}\n'})
            return
        if path == "/v1/push" and method == "POST":
            more = True
            while more:
                more = (await receive()).get("more_body", False)
            answer, kind = b'{"commands": []}', b"application/json"
        elif path == "/metrics":
            answer, kind = body, b"text/plain; version=0.0.4; charset=utf-8"
        elif path == "/healthz":
            answer, kind = json.dumps({"status": "ok", "streams": streams["open"]}).encode(), b"application/json"
        else:
            answer, kind = b'{"detail": "Not Found"}', b"application/json"
        status = 200 if path in ("/metrics", "/healthz", "/v1/push") else 404
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", kind), (b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--body-bytes", type=int, required=True)
    args = parser.parse_args()
    line = b"trainpatrol_bare_sample{rank=\"0\",run=\"bench\"} 1.0\n"
    body = (line * (args.body_bytes // len(line) + 1))[: args.body_bytes]
    uvicorn.Server(uvicorn.Config(bare_app(body), host="127.0.0.1", port=args.port, http="h11", ws="none",
                                  log_level="warning", access_log=False, timeout_graceful_shutdown=2)).run()


if __name__ == "__main__":
    main()

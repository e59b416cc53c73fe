"""A CPU training loop that leaks host memory the way the incident did: it keeps each step's output, with
its autograd graph, in a list. Run as a process of its own by tests/probe/test_host_memory.py, which plays
the OOM killer (SIGKILL once the resident set reaches the limit).

    python leaky_loop.py AGENT_URL OUT_DIR HEADROOM_BYTES MIB_PER_SECOND

The limit is this process's resident set once the model is built plus HEADROOM_BYTES, handed to Patrol as
``host_memory_limit_bytes`` and written to OUT_DIR/limit.json for the test. The loop leaks about
MIB_PER_SECOND (one 1 MiB output a step, paced by the clock), so the test's timing does not depend on how
fast this machine runs a step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from trainpatrol import Patrol, PatrolConfig

OUT_FEATURES = 4096
BATCH = 64  # one output: 64 x 4096 float32 = 1 MiB


def main() -> None:
    agent_url, out, headroom, rate = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, OUT_FEATURES))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(3):  # warm up: the allocator's and autograd's first allocations are not the leak
        model(torch.randn(BATCH, 256)).square().mean().backward()
    start = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    limit = start + headroom
    config = PatrolConfig(run="leak", agent_url=agent_url, embedded_agent=False, push_interval_seconds=1.0,
                          checkpoint_dir=str(out / "ckpt"), evidence_dir=str(out / "evidence"),
                          host_memory_limit_bytes=limit)
    kept: list[torch.Tensor] = []
    with Patrol(model=model, optimizer=opt, config=config) as patrol:
        (out / "limit.json").write_text(json.dumps({"pid": os.getpid(), "start": start, "limit": limit}))
        began = time.monotonic()
        while True:
            x = torch.randn(BATCH, 256)
            logits = model(x)
            loss = logits.square().mean()
            opt.zero_grad()
            loss.backward()
            patrol.step(loss)
            opt.step()
            kept.append(logits)  # the leak: every output, and the graph it points to, stays alive
            ahead = len(kept) / rate - (time.monotonic() - began)  # MiB kept vs MiB due by now
            if ahead > 0:
                time.sleep(ahead)


if __name__ == "__main__":
    main()

"""Fuzz the agent's OpenAPI with schemathesis, in process (ASGI), with and without the token.

Every operation gets up to ``MAX_EXAMPLES`` schema-conforming and as many schema-violating requests
(fewer where the schema allows fewer distinct ones).
No request may get a 5xx or crash the app, and each response must pass schemathesis's checks
(status code, content type, headers and body as documented; schema-violating data rejected). Not
checked: that every schema-valid body is accepted, because a push has rules JSON Schema does not
carry (rank < world_size, sample names and labels from the metric catalogue) and answers 422.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import Case, GenerationMode
from schemathesis.checks import positive_data_acceptance
from schemathesis.config import SchemathesisConfig

from trainpatrol.agent.app import Agent
from trainpatrol.agent.config import AgentConfig


@schemathesis.serializer("application/x-ndjson")
def _ndjson_request(ctx: object, value: object) -> bytes:
    """A generated push-stream body: the generated value as one line (negative cases stay malformed)."""
    return json.dumps(value, default=str).encode() + b"\n"


@schemathesis.deserializer("application/x-ndjson")
def _ndjson_answer(ctx: object, response: Any) -> Any:
    """A push stream's answer, as its last line: the summary object the schema documents."""
    return json.loads(response.content.splitlines()[-1])


TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_EXAMPLES = 50


def fuzzed_agent() -> Agent:
    # the Host check and read auth stay on: schemathesis names the app "testserver", one of its names here
    agent = Agent(AgentConfig(token=TOKEN, nvml=False, api_docs=True, allowed_hosts=("testserver",)).load())
    client = TestClient(agent.app, base_url="http://localhost")
    for rank in (0, 1):  # a hosted run, so reads and actions find something
        assert client.post("/v1/push", json={"run": "r1", "rank": rank, "world_size": 2, "step": 3},
                           headers=AUTH).status_code == 200
    return agent


@pytest.mark.parametrize("with_token", [True, False], ids=["token", "no-token"])
def test_openapi_fuzz_no_5xx_and_schema_conformance(with_token: bool) -> None:
    agent = fuzzed_agent()
    # a body over the push limit (the generator writes bodies of a megabyte and more) is rightly a 413
    rejected = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx"]
    config = SchemathesisConfig.from_dict({"checks": {"negative_data_rejection": {"expected-statuses": rejected}}})
    schema = schemathesis.openapi.from_asgi("/openapi.json", agent.app, config=config, headers=AUTH)
    headers = AUTH if with_token else {}
    sent: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) >= 8, [op.label for op in operations]
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(mode))
            def fuzz(case: Case) -> None:  # type: ignore[type-arg]
                sent[case.operation.label] += 1
                response = case.call_and_validate(headers=headers, excluded_checks=[positive_data_acceptance])
                statuses[response.status_code] += 1
                assert response.status_code < 500, (case.operation.label, response.status_code, response.text)

            try:
                fuzz()
            except Unsatisfiable:  # nothing in the schema to violate (no inputs, or only free-form strings)
                assert mode is GenerationMode.NEGATIVE, op.label
    total = sum(sent.values())
    print(f"\nschemathesis ({'with' if with_token else 'without'} token): {total} requests; "
          f"by operation {dict(sent)}; by status {dict(sorted(statuses.items()))}")
    assert total > 0 and all(sent[op.label] > 0 for op in operations)
    assert all(code < 500 for code in statuses)
    # the agent is still whole: it serves metrics and its seeded run
    client = TestClient(agent.app, base_url="http://localhost")
    assert client.get("/metrics").status_code == 200
    assert client.get("/v1/runs/r1", headers=AUTH).status_code == 200
    assert agent.stats.refusals["host"] == 0


def test_chunked_body_over_the_limit_is_413() -> None:
    """No Content-Length (chunked transfer): the limit still holds, counted as the body streams in."""
    agent = Agent(AgentConfig(token=TOKEN, nvml=False, max_push_bytes=1000).load())
    client = TestClient(agent.app, base_url="http://localhost")

    def body() -> Iterator[bytes]:
        for _ in range(100):
            yield b" " * 100

    r = client.post("/v1/push", content=body(), headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and "over the limit of 1000 bytes" in r.json()["detail"]
    assert agent.stats.pushes["ok"] == 0 and agent.store.entries() == ()
    ok = client.post("/v1/push", content=iter([b'{"run": "r1", ', b'"rank": 0}']),
                     headers={**AUTH, "Content-Type": "application/json"})
    assert ok.status_code == 200

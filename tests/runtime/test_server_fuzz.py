"""Schema fuzzing of the server against its own OpenAPI schema (schemathesis, loopback only).

Positive cases (bodies the schema allows) and negative ones (bodies it forbids) go to every
operation; each response must be no 5xx, have a documented status and content type, and match
the documented body. Afterwards the engine must be alive (/health 200, a normal request
answered) with no KV block referenced: ``BlockPool.num_used`` counts referenced blocks only,
so blocks kept free in the prefix cache's LRU do not count as leaked.
The server requires an API key: every fifth case goes without it and must get the documented
401; the others carry it. The schema's optional fields (logprobs, top_logprobs, and the
OpenAI fields accepted only with their no-op value) are fuzzed like the rest.
Bounded: a fixed number of derandomized examples per mode over a 32-token tiny model.
"""

from __future__ import annotations

import httpx
import pytest

from quantpipe.runtime.server import RequestLimits, build_app
from tests.runtime.test_server_failures import serve_app, tiny_engine, wait_idle

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.generation import GenerationMode  # noqa: E402

EXAMPLES = {GenerationMode.POSITIVE: 80, GenerationMode.NEGATIVE: 60}
KEY = "fuzz-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
WITHOUT_KEY_EVERY = 5  # every fifth case is sent without the key
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


def rejected(ctx, response, case):
    """negative_data_rejection, with 413 (body over --max-request-bytes) as a rejection too."""
    if response.status_code == 413:
        return None
    return negative_data_rejection(ctx, response, case)


@pytest.fixture(scope="module")
def server():
    # 32 positions keep every generated request short; 8 KiB bodies and 200-character prompts
    # let the fuzzer reach the limits (413, 400) as well as the engine.
    engine = tiny_engine(max_position_embeddings=32)
    limits = RequestLimits(max_request_bytes=8192, max_prompt_chars=200, request_timeout=5.0)
    with serve_app(build_app(engine, "tiny", max_queue=2, limits=limits, api_key=KEY)) as url:
        yield url, engine


def test_schema_states_the_real_bodies_and_errors(server):
    url, _ = server
    spec = httpx.get(f"{url}/openapi.json", headers=AUTH).json()
    op = spec["paths"]["/v1/completions"]["post"]
    assert {"200", "400", "401", "404", "408", "413", "429", "500", "503"} <= set(
        op["responses"])
    assert "422" not in op["responses"]
    assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert op["security"] == [{"bearer": []}]
    assert "401" not in spec["paths"]["/health"]["get"]["responses"]
    req = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert req["model"]["anyOf"][0]["enum"] == ["tiny"]
    assert req["max_tokens"]["anyOf"][0]["maximum"] == 31
    assert req["logprobs"]["anyOf"][0]["maximum"] == 5
    assert req["echo"]["anyOf"][0]["const"] is False
    assert req["temperature"]["maximum"] == 2
    chat = spec["components"]["schemas"]["ChatRequest"]["properties"]
    assert chat["top_logprobs"]["anyOf"][0]["maximum"] == 20
    assert chat["tools"]["anyOf"][0]["maxItems"] == 0


@pytest.mark.parametrize("mode", list(EXAMPLES), ids=str)
def test_fuzz_no_server_errors_and_no_leaks(server, mode):
    url, engine = server
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=AUTH)
    checks = CHECKS + ([rejected] if mode == GenerationMode.NEGATIVE else [])
    statuses: dict[int, int] = {}
    sent = [0]

    @given(case=schema.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES[mode], deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        sent[0] += 1
        keyless = sent[0] % WITHOUT_KEY_EVERY == 0 and case.path != "/health"
        if keyless:
            (case.headers or {}).pop("Authorization", None)
        response = case.call_and_validate(checks=checks, timeout=30,
                                          headers=None if keyless else AUTH)
        if keyless:
            assert response.status_code == 401, response.text
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    fuzz()
    assert statuses, "the fuzzer sent nothing"
    if mode == GenerationMode.POSITIVE:
        assert statuses.get(200, 0) >= 20, statuses  # the engine itself was exercised
    assert statuses.get(401, 0) >= EXAMPLES[mode] // WITHOUT_KEY_EVERY // 2, statuses
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 3},
                   headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    wait_idle(url, engine, headers=AUTH)
    assert engine.pool.num_used == 0 and not engine.has_work()

"""A request that fails gets an HTTP error, only it fails, and the server goes on (issue #13).

uvicorn on 127.0.0.1 (random free port) over a tiny random model, driven by httpx.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

import quantpipe.runtime.engine.engine as engine_mod
from quantpipe.runtime.engine import EngineConfig, LLMEngine
from quantpipe.runtime.server import RequestLimits, build_app
from tests.tiny_models import make_model

FAIL_SEED = 4242  # sampling fails at once for requests with this seed
FAIL_LATE_SEED = 4243  # ... at the third token


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_app(app, **config) -> Iterator[str]:
    """Run ``app`` with uvicorn on a free loopback port; yields the base URL."""
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                        **config))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.time() + 20
    while not srv.started:
        assert time.time() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        th.join(timeout=10)


def tiny_engine(**over) -> LLMEngine:
    model, tok = make_model("llama", **over)
    return LLMEngine(model, tok, EngineConfig(block_size=4, max_num_seqs=2,
                                              max_num_batched_tokens=64, num_kv_blocks=200))


def wait_idle(url: str, engine: LLMEngine, headers: dict[str, str] | None = None) -> None:
    """In-flight requests drained and no KV block referenced (cached free blocks may stay)."""
    deadline = time.time() + 10
    while engine.pool.num_used or engine.has_work() or "quantpipe_in_flight_requests 0.0" not in \
            httpx.get(f"{url}/metrics", headers=headers).text:
        assert time.time() < deadline, "server did not go idle"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server():
    real = engine_mod.sample_token
    calls: dict[int, int] = {}

    def faulty(logits, params, gen):
        calls[id(params)] = calls.get(id(params), 0) + 1
        if params.seed == FAIL_SEED or (params.seed == FAIL_LATE_SEED and calls[id(params)] == 3):
            raise RuntimeError("injected sampling fault")
        return real(logits, params, gen)

    mp = pytest.MonkeyPatch()
    mp.setattr(engine_mod, "sample_token", faulty)
    engine = tiny_engine()
    try:
        with serve_app(build_app(engine, "tiny", max_queue=2, limits=RequestLimits())) as url:
            yield url, engine
    finally:
        mp.undo()


def _ok(url: str, **extra) -> httpx.Response:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4, **extra},
                   timeout=30)
    assert r.status_code == 200, r.text
    return r


def test_tiny_temperature_is_served_and_the_engine_stays_up(server):
    """The issue's reproducer: it used to crash the engine loop (200 + empty text, then 503)."""
    url, engine = server
    for t in (1e-40, 1e-300, 5e-324):
        r = _ok(url, temperature=t, ignore_eos=True)
        greedy = _ok(url, temperature=0, ignore_eos=True)
        assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
        assert r.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(f"{url}/health").status_code == 200
    wait_idle(url, engine)


def test_engine_failure_is_a_500_for_that_request_only(server):
    url, engine = server
    r = httpx.post(f"{url}/v1/completions", json={
        "prompt": "Hello", "max_tokens": 4, "temperature": 1.0, "seed": FAIL_SEED}, timeout=30)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and "injected sampling fault" in err["message"]
    chat = httpx.post(f"{url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 1.0,
        "seed": FAIL_SEED}, timeout=30)
    assert chat.status_code == 500 and "injected" in chat.json()["error"]["message"]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    _ok(url)  # the next request is served
    wait_idle(url, engine)
    m = httpx.get(f"{url}/metrics").text
    assert 'quantpipe_requests_total{outcome="error"} 2.0' in m


def test_failure_before_the_first_token_of_a_stream_is_a_500(server):
    url, _ = server
    with httpx.stream("POST", f"{url}/v1/completions", json={
            "prompt": "Hello", "max_tokens": 4, "temperature": 1.0, "seed": FAIL_SEED,
            "stream": True}, timeout=30) as s:
        assert s.status_code == 500
        assert s.headers["content-type"].startswith("application/json")
        assert "injected" in json.loads(s.read())["error"]["message"]


def test_failure_mid_stream_is_an_error_event_then_the_end(server):
    url, engine = server
    with httpx.stream("POST", f"{url}/v1/completions", json={
            "prompt": "Hello", "max_tokens": 8, "temperature": 1.0, "seed": FAIL_LATE_SEED,
            "ignore_eos": True, "stream": True}, timeout=30) as s:
        assert s.status_code == 200
        events = [line[len("data: "):] for line in s.iter_lines() if line.startswith("data: ")]
    assert "[DONE]" not in events
    chunks = [json.loads(e) for e in events]
    assert [("choices" in c) for c in chunks] == [True, True, False]  # 2 tokens, then the error
    assert chunks[-1]["error"]["type"] == "server_error"
    assert "injected" in chunks[-1]["error"]["message"]
    _ok(url)
    wait_idle(url, engine)


@pytest.mark.parametrize("raw, fragment", [
    # unpaired surrogates: the tokenizer raised TypeError (a 500) before
    ('{"prompt": "\\ud800 hi", "max_tokens": 2}', "unicode"),
    ('{"messages": [{"role": "user", "content": "\\udfff"}]}', "unicode"),
    ('{"prompt": "hi", "seed": 18446744073709551616}', "seed"),  # was 200 + "error: Overflow"
    ('{"prompt": "hi", "temperature": Infinity}', "temperature"),  # was uniform sampling
    ('{"prompt": "hi", "max_tokens": "4"}', "max_tokens"),  # strict: was taken as 4
])
def test_bad_input_is_a_400_never_a_500(server, raw, fragment):
    url, _ = server
    path = "/v1/chat/completions" if '"messages"' in raw else "/v1/completions"
    r = httpx.post(f"{url}{path}", content=raw.encode(),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert fragment.lower() in r.json()["error"]["message"].lower()


def test_chat_template_error_is_a_400():
    engine = tiny_engine()  # its own tokenizer: the template change stays here
    engine.tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with serve_app(build_app(engine, "tiny", max_queue=1)) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert r.status_code == 400, r.text
        assert "roles must alternate" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/health").status_code == 200


def test_model_field_names_the_served_model(server):
    url, _ = server
    for path, body in (("/v1/completions", {"prompt": "Hello"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "hi"}]})):
        for model_field, status in (("tiny", 200), (None, 200), ("gpt-4o", 404), ("", 404)):
            r = httpx.post(f"{url}{path}", json={**body, "max_tokens": 2, "model": model_field},
                           timeout=30)
            assert r.status_code == status, r.text
            if status == 404:
                assert r.json() == {"error": {
                    "message": f"The model `{model_field}` does not exist",
                    "type": "invalid_request_error", "param": None, "code": "model_not_found"}}
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"


def test_engine_loop_death_is_a_503_and_health_says_so():
    """Only an unrecoverable state (here: the scheduler raising) takes /health down; the
    request in flight gets a 500, never 200 with empty text."""
    engine = tiny_engine()
    with serve_app(build_app(engine, "tiny", max_queue=1)) as url:
        _ok(url)
        engine.scheduler.schedule = lambda: 1 / 0
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello"}, timeout=30)
        assert r.status_code == 500 and "ZeroDivisionError" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/health").status_code == 503
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello"}, timeout=30)
        assert r.status_code == 503 and "restart" in r.json()["error"]["message"]

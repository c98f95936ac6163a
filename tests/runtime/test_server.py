"""The OpenAI-compatible server over uvicorn on 127.0.0.1 (random free port), driven by httpx."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import torch

from quantpipe.runtime.engine import EngineConfig, LLMEngine
from quantpipe.runtime.server import build_app
from tests.runtime.test_server_failures import serve_app
from tests.tiny_models import make_model

MAX_NUM_SEQS, MAX_QUEUE = 2, 2


@pytest.fixture(scope="module")
def server():
    model, tok = make_model("llama")
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, max_num_seqs=MAX_NUM_SEQS,
                                                max_num_batched_tokens=64,
                                                kv_cache_memory=200 * 4 * 2048))
    with serve_app(build_app(engine, "tiny", max_queue=MAX_QUEUE)) as url:
        yield url, model, tok, engine


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def _wait_idle(url: str) -> str:
    deadline = time.time() + 10
    while True:
        m = httpx.get(f"{url}/metrics").text
        if (_metric(m, "quantpipe_kv_blocks_used") == 0
                and _metric(m, "quantpipe_running_sequences") == 0
                and _metric(m, "quantpipe_in_flight_requests") == 0):
            return m
        assert time.time() < deadline, f"server did not go idle:\n{m}"
        time.sleep(0.05)


def test_completion_matches_hf_greedy(server):
    url, model, tok, _ = server
    prompt = "The customer reports that the invoice"
    ids = tok.encode(prompt)
    ref = model.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8,
                         do_sample=False)[0, len(ids):]
    r = httpx.post(f"{url}/v1/completions", json={
        "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == tok.decode(ref, skip_special_tokens=True)
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_chat_and_streaming(server):
    url, _, _, _ = server
    req = {"messages": [{"role": "user", "content": "Extract the fields name and date"}],
           "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/chat/completions", json=req, timeout=30)
    assert r.status_code == 200, r.text
    full = r.json()["choices"][0]["message"]["content"]
    events = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**req, "stream": True},
                      timeout=30) as s:
        assert s.status_code == 200
        assert s.headers["content-type"].startswith("text/event-stream")
        for line in s.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 6  # one event per generated token
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == full
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("body, fragment", [
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": [1, 10**6]}, "token ids"),
    ({"prompt": list(range(3, 250)), "max_tokens": 100}, "limit"),
])
def test_bad_requests_get_400(server, body, fragment):
    url, _, _, _ = server
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]


def test_models_health_metrics(server):
    url, _, _, _ = server
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"
    m = httpx.get(f"{url}/metrics").text
    for name in ("quantpipe_time_to_first_token_seconds_bucket",
                 "quantpipe_time_per_output_token_seconds_bucket", "quantpipe_queue_length",
                 "quantpipe_kv_blocks_used", "quantpipe_prefix_cache_hit_rate"):
        assert name in m


def test_overload_gets_429_and_accepted_requests_complete(server):
    url, _, _, _ = server
    n_clients = 4 * (MAX_NUM_SEQS + MAX_QUEUE)

    async def one(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post(f"{url}/v1/completions", json={
            "prompt": [5, 6, 7, 8, 9], "max_tokens": 48, "temperature": 0,
            "ignore_eos": True}, timeout=60)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client) for _ in range(n_clients)))

    res = asyncio.run(burst())
    codes = [r.status_code for r in res]
    assert set(codes) <= {200, 429}, codes
    assert 429 in codes and codes.count(200) >= MAX_NUM_SEQS + MAX_QUEUE, codes
    for r in res:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1"
        else:  # every accepted request ran to completion
            assert r.json()["usage"]["completion_tokens"] == 48
    _wait_idle(url)


def test_disconnect_aborts_and_frees_blocks(server):
    url, _, _, engine = server
    with httpx.stream("POST", f"{url}/v1/completions", json={
            "prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}, timeout=30) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                break  # got the first token; now hang up
    m = _wait_idle(url)
    assert _metric(m, 'quantpipe_requests_total{outcome="disconnected"}') == 1
    assert engine.pool.num_used == 0

"""A request ends in one place however it ends: the client leaving (before any output, while a
non-streamed answer is being generated, or mid-stream) aborts its sequence, frees its KV blocks
and releases its admission slot (issue #14)."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from quantpipe.runtime.engine import EngineLoop, SamplingParams
from quantpipe.runtime.server import build_app
from tests.runtime.test_server_failures import serve_app, tiny_engine, wait_idle

STEP_SECONDS = 0.02  # each forward waits this long, so a 200-token request outlives the test


@pytest.fixture(scope="module")
def slow_server():
    engine = tiny_engine()
    real = engine.runner.forward
    steps = {"n": 0}

    def slow(chunks):
        steps["n"] += 1
        time.sleep(STEP_SECONDS)
        return real(chunks)

    engine.runner.forward = slow
    with serve_app(build_app(engine, "tiny", max_queue=1)) as url:
        yield url, engine, steps


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _disconnected(url: str) -> float:
    return _metric(url, 'quantpipe_requests_total{outcome="disconnected"}')


def _post_and_hang_up(url: str, body: dict, after_s: float) -> None:
    """Send a whole request over a raw socket, wait, close the connection without reading."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head + data)
        time.sleep(after_s)


@pytest.mark.parametrize("stream", [False, True])
def test_hanging_up_aborts_the_request(slow_server, stream):
    url, engine, steps = slow_server
    before, steps_before = _disconnected(url), steps["n"]
    body = {"prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    _post_and_hang_up(url, body, after_s=0.5)  # ~25 steps of 200 generated
    wait_idle(url, engine)
    assert _disconnected(url) == before + 1
    assert engine.pool.num_used == 0
    assert steps["n"] - steps_before < 150, "the request ran on after the client left"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 200  # its slot was released: capacity is 3 here


def test_hanging_up_while_queued_frees_the_slot(slow_server):
    """Requests waiting for a batch slot (max_num_seqs 2) whose clients leave are aborted too."""
    url, engine, _ = slow_server
    before = _disconnected(url)

    async def burst() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            long = {"prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0,
                    "ignore_eos": True}
            tasks = [asyncio.create_task(client.post(f"{url}/v1/completions", json=long))
                     for _ in range(3)]  # 2 running + 1 queued
            await asyncio.sleep(0.5)
            for t in tasks:
                t.cancel()  # closes each connection
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(burst())
    wait_idle(url, engine)
    assert _disconnected(url) == before + 3
    assert engine.pool.num_used == 0 and not engine.has_work()


def test_engine_loop_generate_aborts_when_the_consumer_stops():
    """EngineLoop.generate on its own: all outputs of a finished request, ending with the
    finished one; a consumer that stops early (aclose) aborts the request and frees its blocks."""
    engine = tiny_engine()
    el = EngineLoop(engine)
    el.start()

    async def run() -> tuple[list, int]:
        full = [o async for o in el.generate("a", [5, 6, 7],
                                             SamplingParams(max_tokens=5, ignore_eos=True))]
        gen = el.generate("b", [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
        first = await anext(gen)
        assert not first.finished
        await gen.aclose()
        return full, len(first.new_token_ids)

    try:
        full, n_first = asyncio.run(run())
        assert [o.finished for o in full] == [False] * 4 + [True]
        assert sum(len(o.new_token_ids) for o in full) == 5 and n_first == 1
        deadline = time.time() + 10
        while engine.has_work() or engine.pool.num_used:
            assert time.time() < deadline, "the aborted request kept its blocks"
            time.sleep(0.02)
    finally:
        el.stop()

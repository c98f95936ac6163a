"""Load-generator metrics on synthetic timings, URL safety, and a short run against a server."""

from __future__ import annotations

import math
import socket
import threading
import time

import numpy as np
import pytest
import uvicorn

from quantpipe.runtime.loadgen import (
    BenchSpec,
    RequestRecord,
    RunMetrics,
    format_table,
    latency_stats,
    median_metrics,
    run_bench,
    summarize,
    tpot,
)


def _rec(ttft: float, gaps: list[float]) -> RequestRecord:
    return RequestRecord(True, ttft=ttft, itls=tuple(gaps), e2e=ttft + sum(gaps),
                         output_tokens=len(gaps) + 1)


def test_metrics_math_on_synthetic_timings():
    a = _rec(0.5, [0.05] * 9)  # 10 tokens, e2e 0.95 s, TPOT 50 ms
    b = _rec(3.0, [0.02] * 4)  # 5 tokens, TTFT misses the 2 s SLO
    c = _rec(1.0, [0.1] * 3)  # 4 tokens, TPOT 100 ms misses the 60 ms SLO
    fail = RequestRecord(False, error="HTTP 500")
    assert tpot(a) == pytest.approx(0.05) and tpot(_rec(0.2, [])) is None
    m = summarize([a, b, c, fail], duration_s=4.0, ttft_slo=2.0, tpot_slo=0.060)
    assert (m.completed, m.failed) == (3, 1)
    assert m.request_throughput == pytest.approx(3 / 4)
    assert m.output_throughput == pytest.approx((10 + 5 + 4) / 4)
    assert m.goodput == pytest.approx(1 / 4)  # only a meets both SLOs
    assert m.ttft_ms.mean == pytest.approx(1500.0)
    assert m.ttft_ms.p50 == pytest.approx(1000.0)
    assert m.ttft_ms.p99 == pytest.approx(np.percentile([500, 3000, 1000], 99))
    assert m.tpot_ms.mean == pytest.approx((50 + 20 + 100) / 3)
    itls = [50] * 9 + [20] * 4 + [100] * 3
    assert m.itl_ms.mean == pytest.approx(np.mean(itls))
    assert m.itl_ms.p95 == pytest.approx(np.percentile(itls, 95))
    assert m.e2e_ms.p50 == pytest.approx(1300.0)  # e2e: 950, 3080, 1300 ms
    assert math.isnan(latency_stats([]).mean)


def test_median_over_repeats():
    runs = [summarize([_rec(t, [0.01])], 1.0, 2.0, 0.06) for t in (0.1, 0.3, 0.2)]
    med = median_metrics(runs)
    assert med["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert med["completed"] == 1
    assert isinstance(runs[0], RunMetrics)


@pytest.mark.parametrize("kw, fragment", [
    ({"url": "http://10.0.0.5:8000"}, "loopback"),
    ({"url": "ftp://127.0.0.1"}, "http"),
    ({"concurrency": (0,)}, "concurrency"),
    ({"request_rate": 0.0}, "request-rate"),
    ({"shared_prefix_len": 300}, "shared_prefix_len"),
    ({"prompt_ids": ((1, 2, 3),), "shared_prefix_len": 8}, "either prompt_ids"),
    ({"prompt_ids": ((1, 2), ())}, "non-empty"),
    ({"prompt_ids": ((1, -2),)}, ">= 0"),
    ({"max_requests": 0}, "--max-requests >= 1"),
])
def test_spec_validation(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        BenchSpec(**kw)
    BenchSpec(url="http://10.0.0.5:8000", allow_remote=True)  # explicit opt-in works


def test_short_run_against_tiny_server(tmp_path):
    from quantpipe.runtime.engine import EngineConfig, LLMEngine
    from quantpipe.runtime.server import build_app
    from tests.tiny_models import make_model

    model, tok = make_model("llama")
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, max_num_seqs=4,
                                                max_num_batched_tokens=64,
                                                kv_cache_memory=200 * 4 * 2048))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(build_app(engine, "tiny", 8), host="127.0.0.1",
                                        port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    while not srv.started:
        time.sleep(0.05)
    try:
        out = tmp_path / "bench.json"
        res = run_bench(BenchSpec(url=f"http://127.0.0.1:{port}", concurrency=(1, 4),
                                  prompt_len=16, output_len=8, duration=0.5, repeats=1,
                                  warmup_requests=1, json_out=out))
        for c in ("1", "4"):
            m = res.results[c]["median"]
            assert m["completed"] >= 1 and m["failed"] == 0
            # ignore_eos + max_tokens: exactly output_len tokens per request
            assert m["output_throughput"] == pytest.approx(8 * m["request_throughput"])
        pool = ((5, 6, 7), (8, 9, 10, 11, 12))  # fixed token-id prompts (e.g. a chat set)
        fixed = run_bench(BenchSpec(url=f"http://127.0.0.1:{port}", concurrency=(2,),
                                    output_len=4, duration=0.3, warmup_requests=1,
                                    prompt_ids=pool))
        m = fixed.results["2"]["median"]
        assert m["completed"] >= 1 and m["failed"] == 0
        assert m["output_throughput"] == pytest.approx(4 * m["request_throughput"])
        assert fixed.spec["prompt_ids"] == [3, 5]  # the JSON keeps lengths, not the ids
        res4 = run_bench(BenchSpec(url=f"http://127.0.0.1:{port}", concurrency=(4,),
                                   prompt_len=16, output_len=4, duration=0.5, repeats=1,
                                   request_rate=20.0, warmup_requests=0))
        assert res4.results["4"]["median"]["failed"] == 0
        assert out.is_file() and "conc" in format_table(res)
        assert engine.pool.num_used == 0
    finally:
        srv.should_exit = True
        th.join(timeout=10)


def test_cli_bench_serve_refuses_remote_host():
    from click.testing import CliRunner

    from quantpipe.cli import main

    res = CliRunner().invoke(main, ["bench-serve", "--url", "http://192.168.1.10:8000"])
    assert res.exit_code != 0 and "--allow-remote" in res.output
    res = CliRunner().invoke(main, ["bench-serve", "--concurrency", "1,x"])
    assert res.exit_code != 0 and "--concurrency" in res.output


def test_prompts_share_exactly_the_prefix():
    import random

    from quantpipe.runtime.loadgen import make_prompts, shared_prefix

    spec = BenchSpec(prompt_len=40, shared_prefix_len=30)
    prefix = shared_prefix(spec, vocab_size=500)
    assert prefix == shared_prefix(spec, vocab_size=500) and len(prefix) == 30
    a, b = make_prompts(2, spec, 500, random.Random(0), prefix)
    assert len(a) == len(b) == 40 and a[:30] == b[:30] == prefix and a[30:] != b[30:]
    assert all(100 <= t < 500 for t in a + b)


def test_fixed_prompts_are_drawn_from_the_pool_in_a_seeded_order():
    import random

    from quantpipe.runtime.loadgen import next_prompts

    pool = tuple(tuple(range(i, i + 3 + i)) for i in range(6))
    spec = BenchSpec(prompt_ids=pool)
    a = next_prompts(20, spec, 500, random.Random(0), [])
    assert a == next_prompts(20, spec, 500, random.Random(0), [])  # same seed, same order
    assert all(tuple(p) in pool for p in a) and len({tuple(p) for p in a}) > 1
    assert a != next_prompts(20, spec, 500, random.Random(1), [])
    rand = next_prompts(2, BenchSpec(prompt_len=7), 500, random.Random(0), [])
    assert [len(p) for p in rand] == [7, 7]  # no pool: random prompts of prompt_len


def test_each_run_draws_its_own_prompt_sequence(monkeypatch):
    """A run's prompts do not depend on how many requests the runs before it sent: a slow and a
    fast server get the same prompts in the same order at every level and repeat (by duration
    the fast one only gets further into that order); repeats draw different sequences."""
    import httpx

    from quantpipe.runtime import loadgen

    class Models:  # the server's /v1/models answer
        @staticmethod
        def json():
            return {"data": [{"id": "m", "vocab_size": 100}]}

    monkeypatch.setattr(httpx, "get", lambda url, timeout: Models())
    pool = tuple((i, i + 1) for i in range(50))
    seen = []
    for sent in (3, 11):  # requests the fake server answers in each run
        draws = []

        async def fake_run(spec, c, model, vocab, rng, sent=sent, draws=draws):
            draws.append(loadgen.next_prompts(sent, spec, vocab, rng, []))
            return loadgen.summarize([], 1.0, spec.ttft_slo, spec.tpot_slo)

        monkeypatch.setattr(loadgen, "_run_once", fake_run)
        loadgen.run_bench(BenchSpec(concurrency=(1, 4), repeats=2, prompt_ids=pool))
        seen.append(draws)
    slow, fast = seen
    assert len(slow) == len(fast) == 4  # 2 levels x 2 repeats
    for a, b in zip(slow, fast):
        assert b[:3] == a
    assert slow[0] != slow[1] and slow[0] != slow[2]

"""Load generator for the OpenAI-compatible server, with metrics as ``vllm bench serve`` defines.

Per request (streaming): TTFT = first token arrival - send; ITL = gaps between token arrivals;
E2E = last arrival - send; TPOT = (E2E - TTFT) / (output_tokens - 1). Per run: requests/s and
output tokens/s over the run's wall time (first send -> last completion), mean/p50/p95/p99 of
each latency, goodput = requests/s that met both SLOs (TTFT and TPOT). Warm-up requests are
excluded; each setting is repeated and every scalar reported as the median over repeats.

Prompts: random token ids of ``prompt_len`` (with an optional shared prefix), or a fixed pool
of token-id prompts (``prompt_ids``, e.g. a prompt set rendered with the chat template) drawn in
a seeded order. Each run (a concurrency level, a repeat) draws from its own seeded sequence, so
two servers benchmarked with the same spec get the same prompts in the same order in every run,
however many requests each completed in the runs before. A run ends after ``duration`` seconds
of sending or ``max_requests`` requests, whichever comes first: a faster server completes more
of the sequence in a fixed duration, so its latency percentiles cover more prompts (with a
mixed pool, more long ones); to compare latencies over exactly the same prompts, bound runs by
``max_requests`` and give them a duration they do not reach. Requests go to
``/v1/completions`` with token ids, so the servers' tokenizers play no part.

Safety: only loopback URLs unless ``allow_remote``; each run is bounded by ``duration`` and by
``max_requests``.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from quantpipe.core.io import write_json_atomic
from quantpipe.runtime.config import DEFAULTS

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass(frozen=True)
class BenchSpec:
    url: str = DEFAULTS.bench_url  # server base URL (loopback unless allow_remote)
    concurrency: tuple[int, ...] = DEFAULTS.bench_concurrency  # in-flight caps, one run each
    prompt_len: int = DEFAULTS.bench_prompt_len  # prompt tokens per request (shared prefix too)
    # fixed token-id prompts drawn in a seeded order; empty -> random prompts of prompt_len
    prompt_ids: tuple[tuple[int, ...], ...] = ()
    output_len: int = DEFAULTS.bench_output_len  # output tokens per request (ignore_eos)
    duration: float = DEFAULTS.bench_duration  # seconds of sending per run
    repeats: int = DEFAULTS.bench_repeats  # runs per concurrency; medians reported
    request_rate: float | None = None  # Poisson arrivals (req/s); None -> closed loop
    warmup_requests: int = DEFAULTS.bench_warmup_requests  # per concurrency, not measured
    max_requests: int = DEFAULTS.bench_max_requests  # requests per run at most
    shared_prefix_len: int = 0  # leading tokens common to all prompts (prefix caching)
    ttft_slo: float = DEFAULTS.ttft_slo  # seconds, for goodput
    tpot_slo: float = DEFAULTS.tpot_slo  # seconds, for goodput
    request_timeout: float = 600.0  # seconds per request
    seed: int = 0
    allow_remote: bool = False  # permit a non-loopback host
    json_out: Path | None = None

    def __post_init__(self) -> None:
        host = urlparse(self.url).hostname
        if urlparse(self.url).scheme not in ("http", "https") or not host:
            raise ValueError(f"--url {self.url!r} is not an http(s) URL like "
                             "http://127.0.0.1:8000")
        if host not in LOOPBACK and not self.allow_remote:
            raise ValueError(f"--url host {host!r} is not loopback; bench-serve only targets "
                             "127.0.0.1/localhost unless you pass --allow-remote")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"--concurrency needs positive integers, got {self.concurrency}")
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError("--prompt-len and --output-len must be >= 1")
        if not 0 <= self.shared_prefix_len < self.prompt_len:
            raise ValueError(f"shared_prefix_len must be in [0, prompt_len), got "
                             f"{self.shared_prefix_len}")
        if self.prompt_ids and self.shared_prefix_len:
            raise ValueError("shared_prefix_len applies to random prompts only; give either "
                             "prompt_ids or shared_prefix_len")
        if any(not p or min(p) < 0 for p in self.prompt_ids):
            raise ValueError("prompt_ids must be non-empty lists of token ids >= 0")
        if self.duration <= 0 or self.repeats < 1 or self.max_requests < 1:
            raise ValueError(f"--duration must be > 0, --repeats and --max-requests >= 1; got "
                             f"{self.duration}, {self.repeats}, {self.max_requests}")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"--request-rate must be > 0, got {self.request_rate}")


@dataclass(frozen=True)
class RequestRecord:
    ok: bool
    ttft: float = 0.0  # seconds
    itls: tuple[float, ...] = ()  # seconds between consecutive token arrivals
    e2e: float = 0.0  # seconds
    output_tokens: int = 0
    error: str = ""


@dataclass(frozen=True)
class LatencyStats:
    mean: float
    p50: float
    p95: float
    p99: float


@dataclass(frozen=True)
class RunMetrics:
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    goodput: float  # requests / s meeting both SLOs
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_ms: LatencyStats


def latency_stats(values_s: list[float]) -> LatencyStats:
    """Mean and percentiles (numpy linear interpolation, as vLLM) in milliseconds."""
    if not values_s:
        return LatencyStats(math.nan, math.nan, math.nan, math.nan)
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return LatencyStats(float(ms.mean()), *(float(np.percentile(ms, q)) for q in (50, 95, 99)))


def tpot(rec: RequestRecord) -> float | None:
    """(E2E - TTFT) / (tokens - 1); undefined for single-token outputs."""
    if rec.output_tokens < 2:
        return None
    return (rec.e2e - rec.ttft) / (rec.output_tokens - 1)


def summarize(records: list[RequestRecord], duration_s: float, ttft_slo: float,
              tpot_slo: float) -> RunMetrics:
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    ok = [r for r in records if r.ok]
    tpots = [t for r in ok if (t := tpot(r)) is not None]
    good = sum(1 for r in ok if r.ttft <= ttft_slo and (tpot(r) or 0.0) <= tpot_slo)
    return RunMetrics(
        completed=len(ok), failed=len(records) - len(ok), duration_s=duration_s,
        request_throughput=len(ok) / duration_s,
        output_throughput=sum(r.output_tokens for r in ok) / duration_s,
        goodput=good / duration_s,
        ttft_ms=latency_stats([r.ttft for r in ok]),
        tpot_ms=latency_stats(tpots),
        itl_ms=latency_stats([x for r in ok for x in r.itls]),
        e2e_ms=latency_stats([r.e2e for r in ok]),
    )


def median_metrics(runs: list[RunMetrics]) -> dict:
    """Median over repeats of every scalar (nested stats included)."""
    dicts = [asdict(r) for r in runs]

    def med(key_path: tuple[str, ...]) -> float:
        vals = []
        for d in dicts:
            for k in key_path:
                d = d[k]
            vals.append(d)
        return float(statistics.median(vals))

    out: dict = {}
    for k, v in dicts[0].items():
        out[k] = {s: med((k, s)) for s in v} if isinstance(v, dict) else med((k,))
    return out


# --- the client -------------------------------------------------------------------------------
async def _one_request(client, url: str, model: str | None, prompt: list[int], output_len: int,
                       timeout: float) -> RequestRecord:
    # stream_options: servers that send usage only when asked (vLLM) report the token count
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    arrivals: list[float] = []
    usage_tokens = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body,
                                 timeout=timeout) as resp:
            if resp.status_code != 200:
                return RequestRecord(False, error=f"HTTP {resp.status_code}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                event = json.loads(line[len("data: "):])
                if event.get("choices"):
                    arrivals.append(now)  # the server sends one event per token
                if event.get("usage"):
                    usage_tokens = event["usage"]["completion_tokens"]
    except Exception as exc:  # noqa: BLE001 -- a failed request is data, not a crash
        return RequestRecord(False, error=f"{type(exc).__name__}: {exc}")
    if not arrivals:
        return RequestRecord(False, error="no tokens received")
    n = usage_tokens if usage_tokens is not None else len(arrivals)
    return RequestRecord(True, ttft=arrivals[0] - t0,
                         itls=tuple(b - a for a, b in zip(arrivals, arrivals[1:])),
                         e2e=arrivals[-1] - t0, output_tokens=n)


def _token_range(vocab_size: int) -> tuple[int, int]:
    return min(100, vocab_size // 4), vocab_size  # skip low ids where special tokens live


def shared_prefix(spec: BenchSpec, vocab_size: int) -> list[int]:
    """The ``shared_prefix_len`` tokens every prompt of a benchmark starts with (seeded)."""
    lo, hi = _token_range(vocab_size)
    rng = random.Random(f"prefix-{spec.seed}")
    return [rng.randrange(lo, hi) for _ in range(spec.shared_prefix_len)]


def make_prompts(n: int, spec: BenchSpec, vocab_size: int, rng: random.Random,
                 prefix: list[int]) -> list[list[int]]:
    """Random token-id prompts of exactly prompt_len: ``prefix`` + random tokens."""
    lo, hi = _token_range(vocab_size)
    rest = spec.prompt_len - len(prefix)
    return [prefix + [rng.randrange(lo, hi) for _ in range(rest)] for _ in range(n)]


def next_prompts(n: int, spec: BenchSpec, vocab_size: int, rng: random.Random,
                 prefix: list[int]) -> list[list[int]]:
    """The next ``n`` prompts: drawn from ``spec.prompt_ids`` when given, else random."""
    if spec.prompt_ids:
        return [list(rng.choice(spec.prompt_ids)) for _ in range(n)]
    return make_prompts(n, spec, vocab_size, rng, prefix)


async def _run_once(spec: BenchSpec, concurrency: int, model: str | None, vocab: int,
                    rng: random.Random) -> RunMetrics:
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 1)
    prefix = shared_prefix(spec, vocab)
    async with httpx.AsyncClient(limits=limits) as client:
        warm = next_prompts(spec.warmup_requests, spec, vocab, rng, prefix)
        await asyncio.gather(*(_one_request(client, spec.url, model, p, spec.output_len,
                                            spec.request_timeout) for p in warm))
        records: list[RequestRecord] = []
        sem = asyncio.Semaphore(concurrency)
        start = time.perf_counter()
        stop_at = start + spec.duration
        issued = 0

        async def guarded(prompt: list[int]) -> None:
            async with sem:
                records.append(await _one_request(client, spec.url, model, prompt,
                                                  spec.output_len, spec.request_timeout))

        if spec.request_rate is None:
            async def worker() -> None:
                nonlocal issued
                while time.perf_counter() < stop_at and issued < spec.max_requests:
                    issued += 1
                    await guarded(next_prompts(1, spec, vocab, rng, prefix)[0])

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            tasks = []
            next_t = start
            while issued < spec.max_requests:
                next_t += rng.expovariate(spec.request_rate)  # Poisson process gaps
                if next_t >= stop_at:
                    break
                await asyncio.sleep(max(0.0, next_t - time.perf_counter()))
                issued += 1
                prompt = next_prompts(1, spec, vocab, rng, prefix)[0]
                tasks.append(asyncio.create_task(guarded(prompt)))
            await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return summarize(records, elapsed, spec.ttft_slo, spec.tpot_slo)


@dataclass
class BenchResult:
    spec: dict
    results: dict[str, dict] = field(default_factory=dict)  # concurrency -> {median, runs}


def run_bench(spec: BenchSpec) -> BenchResult:
    import httpx

    try:
        models = httpx.get(f"{spec.url}/v1/models", timeout=10).json()["data"][0]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"cannot reach an OpenAI-compatible server at {spec.url} ({exc}); "
                         "start one with `quantpipe serve MODEL_DIR`") from exc
    vocab = int(models.get("vocab_size", 32000))  # quantpipe reports it; random prompts only
    spec_d = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(spec).items()}
    spec_d["prompt_ids"] = [len(p) for p in spec_d["prompt_ids"]]  # their lengths, not the ids
    res = BenchResult(spec={**spec_d, "model": models.get("id")})
    for c in spec.concurrency:
        # each run its own sequence: the prompts of a run do not depend on the runs before
        runs = [asyncio.run(_run_once(spec, c, models.get("id"), vocab,
                                      random.Random(f"{spec.seed}/{c}/{i}")))
                for i in range(spec.repeats)]
        res.results[str(c)] = {"median": median_metrics(runs), "runs": [asdict(r) for r in runs]}
    if spec.json_out is not None:
        write_json_atomic(spec.json_out, asdict(res))
    return res


def format_table(res: BenchResult) -> str:
    head = (f"{'conc':>5} {'req/s':>7} {'tok/s':>8} {'goodput':>8} {'TTFT p50':>9} "
            f"{'TTFT p99':>9} {'TPOT p50':>9} {'ITL p50':>8} {'E2E p50':>9} {'fail':>5}")
    lines = [head]
    for c, r in res.results.items():
        m = r["median"]
        lines.append(
            f"{c:>5} {m['request_throughput']:7.2f} {m['output_throughput']:8.1f} "
            f"{m['goodput']:8.2f} {m['ttft_ms']['p50']:8.0f}m {m['ttft_ms']['p99']:8.0f}m "
            f"{m['tpot_ms']['p50']:8.1f}m {m['itl_ms']['p50']:7.1f}m {m['e2e_ms']['p50']:8.0f}m "
            f"{m['failed']:5.0f}")
    return "\n".join(lines) + "\n(latencies in ms, medians over repeats)"

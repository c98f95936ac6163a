r"""Soak test of ``quantpipe serve``: mixed good and bad traffic for a long time, then checks.

Starts ``quantpipe serve`` on loopback as a child process (a tiny random model unless --model),
then for --duration seconds runs 4x as many client loops as the server admits
(``max_num_seqs + max_queue``), each picking at random: completions and chats, streamed or
not (a streamed one must end in ``[DONE]``), a tiny temperature, bad JSON, a bad field, an
oversize body, an unknown model, a client that hangs up after the first token, and a body
sent half and then stalled. Every few seconds it samples the server's RSS (psutil) and
/metrics (KV blocks used, requests in flight). At the end it waits for the server to go idle
and reports RSS at start / middle / end and its slope, KV blocks still referenced (must be 0),
the count of each status code per kind of request, and every 5xx or unexpected status.

    python bench/soak.py --duration 600                       # tiny random model
    python bench/soak.py --model /tmp/qp/fp16 --duration 600  # an FP16 export
    python bench/soak.py --duration 60 --api-key KEY          # server started with a key

With --api-key the server gets the key through QUANTPIPE_API_KEY, every request carries it,
and a "wrong_api_key" kind must get 401.

Writes bench/results/soak.json (--out). Exit status 1 if anything failed. Not a test: numbers
depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import server_proc  # noqa: E402  (bench/server_proc.py)
from server_proc import stop_server  # noqa: E402

from quantpipe.core.io import write_json_atomic  # noqa: E402

PROMPTS = ["The customer reports that the invoice", "Summarise the contract in one line:",
           "SELECT customer_id FROM", "Dear team, the quarterly revenue", "def total(items):"]
# kind -> (weight, statuses that are correct for it)
KINDS: dict[str, tuple[int, set[int]]] = {
    "completion": (20, {200, 429}),
    "completion_stream": (15, {200, 429}),
    "completion_logprobs": (6, {200, 429}),
    "wrong_api_key": (4, {401}),  # only with --api-key
    "chat": (10, {200, 429}),
    "chat_stream": (8, {200, 429}),
    "tiny_temperature": (5, {200, 429}),
    "bad_json": (6, {400}),
    "bad_field": (6, {400}),
    "oversize_body": (4, {413}),
    "unknown_model": (6, {404}),
    "disconnect_mid_stream": (8, {200, 429}),
    "half_sent_body": (2, {408}),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model(tmp: Path) -> Path:
    from tests.tiny_models import make_model, save_model

    model, tok = make_model("llama")
    return save_model(model, tok, tmp / "tiny")


def start_server(args, folder: Path, port: int, log: Path) -> subprocess.Popen:
    if args.api_key:  # through the environment: arguments show in `ps`
        os.environ["QUANTPIPE_API_KEY"] = args.api_key
    return server_proc.start_server(
        [str(folder), "--max-num-seqs", str(args.max_num_seqs), "--max-queue",
         str(args.max_queue), "--kv-cache-memory", args.kv_cache_memory,
         "--request-timeout", str(args.request_timeout)], port, args.threads, log)


def auth(args) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


class Sampler(threading.Thread):
    """RSS of the server process and its /metrics gauges every ``every`` seconds."""

    def __init__(self, pid: int, url: str, every: float, headers: dict[str, str]) -> None:
        super().__init__(daemon=True)
        import psutil

        self.proc = psutil.Process(pid)
        self.url, self.every, self.headers = url, every, headers
        self.samples: list[dict] = []
        self.t0 = time.time()
        self.done = threading.Event()

    def sample(self) -> dict:
        import httpx

        s: dict = {"t": round(time.time() - self.t0, 1)}
        try:
            s["rss_mib"] = round(self.proc.memory_info().rss / 2**20, 1)
            m = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10).text
            s["kv_blocks_used"] = metric(m, "quantpipe_kv_blocks_used")
            s["in_flight"] = metric(m, "quantpipe_in_flight_requests")
            s["health_s"] = round(self._health_seconds(), 3)
        except Exception as exc:  # a sample that failed is data too
            s["error"] = f"{type(exc).__name__}: {exc}"
        self.samples.append(s)
        return s

    def _health_seconds(self) -> float:
        import httpx

        t0 = time.perf_counter()
        httpx.get(f"{self.url}/health", timeout=10).raise_for_status()
        return time.perf_counter() - t0

    def run(self) -> None:
        while not self.done.wait(self.every):
            self.sample()


class Tally:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.t0 = proc, time.time()
        self.server_exit: dict | None = None  # set once a failed request finds it gone
        self.codes: dict[str, Counter] = defaultdict(Counter)
        self.unexpected: list[dict] = []
        self.server_errors: list[dict] = []

    def add(self, kind: str, status: int, detail: str = "") -> None:
        self.codes[kind][status] += 1
        if status == 0 and self.proc.poll() is not None and self.server_exit is None:
            self.server_exit = {"returncode": self.proc.returncode,
                                "after_s": round(time.time() - self.t0, 1)}
        if status >= 500 or status == 0:
            self.server_errors.append({"kind": kind, "status": status, "detail": detail[:300]})
        elif status not in KINDS[kind][1] and len(self.unexpected) < 50:
            self.unexpected.append({"kind": kind, "status": status, "detail": detail[:300]})


async def one_request(client, url: str, kind: str, rng: random.Random, args) -> tuple[int, str]:
    """Send one request of ``kind``; (status, detail). Status 0: no HTTP answer at all."""
    if kind == "half_sent_body":
        return await half_sent(url, auth(args))
    chat = kind.startswith("chat")
    prompt = rng.choice(PROMPTS)
    body: dict = ({"messages": [{"role": "user", "content": prompt}]} if chat
                  else {"prompt": prompt})
    body["max_tokens"] = rng.randint(1, args.max_tokens)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if kind == "tiny_temperature":
        body["temperature"] = 1e-40
    elif kind == "bad_field":
        body[rng.choice(["temperature", "top_p", "max_tokens", "n"])] = -1
    elif kind == "unknown_model":
        body["model"] = "gpt-4o"
    elif kind == "completion_logprobs":
        body["logprobs"] = rng.randint(0, 5)
    elif kind == "wrong_api_key":
        r = await client.post(url + path, json=body, headers={"Authorization": "Bearer wrong"})
        return r.status_code, r.text
    if kind in ("bad_json", "oversize_body"):
        raw = (b'{"prompt": "x' + b"a" * (2 * 2**20) + b'"}' if kind == "oversize_body"
               else b'{"prompt": "Hello", "max_tokens": ')
        r = await client.post(url + path, content=raw, headers={"content-type":
                                                                "application/json"})
        return r.status_code, r.text
    if kind.endswith("stream") or kind == "disconnect_mid_stream":
        return await streamed(client, url + path, {**body, "stream": True},
                              hang_up=kind == "disconnect_mid_stream")
    r = await client.post(url + path, json=body)
    if r.status_code == 200 and not r.json()["choices"]:
        return 599, "200 without choices"
    return r.status_code, r.text if r.status_code != 200 else ""


async def streamed(client, url: str, body: dict, hang_up: bool) -> tuple[int, str]:
    async with client.stream("POST", url, json=body) as s:
        if s.status_code != 200:
            return s.status_code, (await s.aread()).decode(errors="replace")
        last = ""
        async for line in s.aiter_lines():
            if line.startswith("data: "):
                last = line[len("data: "):]
                if hang_up:
                    return 200, ""  # leave after the first event: the server must abort
        if last != "[DONE]":
            return 598, f"stream ended without [DONE]: {last[:200]}"
        return 200, ""


async def half_sent(url: str, headers: dict[str, str]) -> tuple[int, str]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode()
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\n" + extra + b"Content-Length: 200\r\n\r\n"
                     b"{\"prompt\": ")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout=120)
        return (int(line.split()[1]), "") if line else (0, "closed without an answer")
    finally:
        writer.close()


async def client_loop(url: str, stop_at: float, seed: int, tally: Tally, args) -> None:
    import httpx

    rng = random.Random(seed)
    kinds = [k for k in KINDS if args.api_key or k != "wrong_api_key"]
    weights = [KINDS[k][0] for k in kinds]
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), headers=auth(args)) as client:
        while time.time() < stop_at:
            kind = rng.choices(kinds, weights)[0]
            try:
                status, detail = await one_request(client, url, kind, rng, args)
            except (httpx.HTTPError, OSError, asyncio.TimeoutError) as exc:
                status, detail = 0, f"{type(exc).__name__}: {exc}"
            tally.add(kind, status, detail)
            if tally.server_exit is not None:
                return
            if status == 429:
                await asyncio.sleep(rng.uniform(0.2, 1.0))  # Retry-After: 1, jittered


async def traffic(url: str, args, tally: Tally, clients: int) -> None:
    stop_at = time.time() + args.duration
    await asyncio.gather(*(client_loop(url, stop_at, 1000 + i, tally, args)
                           for i in range(clients)))


def wait_idle(sampler: Sampler, timeout: float) -> dict:
    deadline = time.time() + timeout
    while True:
        s = sampler.sample()
        if s.get("kv_blocks_used") == 0 and s.get("in_flight") == 0 or time.time() > deadline:
            return s
        time.sleep(1)


def rss_summary(samples: list[dict]) -> dict:
    import numpy as np

    pts = [(s["t"], s["rss_mib"]) for s in samples if "rss_mib" in s]
    t = np.array([p[0] for p in pts]) / 60.0  # minutes
    rss = np.array([p[1] for p in pts])
    half = t >= t[-1] / 2
    slope = lambda m: float(np.polyfit(t[m], rss[m], 1)[0]) if m.sum() >= 3 else None  # noqa: E731
    return {"start_mib": float(rss[0]), "middle_mib": float(rss[len(rss) // 2]),
            "end_mib": float(rss[-1]), "max_mib": float(rss.max()),
            "slope_mib_per_min": slope(np.ones_like(half)),
            "slope_second_half_mib_per_min": slope(half)}


def run(args, folder: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    capacity = args.max_num_seqs + args.max_queue
    clients = args.clients or 4 * capacity
    proc = start_server(args, folder, port, args.server_log)
    tally = Tally(proc)
    try:
        sampler = Sampler(proc.pid, url, args.sample_every, auth(args))
        sampler.sample()
        sampler.start()
        t0 = time.time()
        asyncio.run(traffic(url, args, tally, clients))
        sent_s = time.time() - t0
        sampler.done.set()
        sampler.join()
        if tally.server_exit is not None:
            raise RuntimeError(f"the server exited: {tally.server_exit}; see {args.server_log}")
        idle = wait_idle(sampler, 120)
        import httpx

        health = httpx.get(f"{url}/health", timeout=10).status_code
        after = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4},
                           headers=auth(args), timeout=300).status_code
    finally:
        stop_server(proc)
    codes = {k: dict(sorted(c.items())) for k, c in sorted(tally.codes.items())}
    totals = Counter()
    for c in tally.codes.values():
        totals.update(c)
    return {
        "model": str(folder), "duration_s": round(sent_s, 1), "clients": clients,
        "max_num_seqs": args.max_num_seqs, "max_queue": args.max_queue,
        "max_tokens": args.max_tokens, "server_threads": args.threads,
        "api_key": bool(args.api_key),
        "requests": sum(totals.values()), "status_counts": dict(sorted(totals.items())),
        "status_counts_by_kind": codes, "server_errors": tally.server_errors,
        "unexpected": tally.unexpected, "rss": rss_summary(sampler.samples),
        "kv_blocks_used_when_idle": idle.get("kv_blocks_used"),
        "in_flight_when_idle": idle.get("in_flight"), "health_after": health,
        "request_after": after,
        "health_seconds_max": max((s.get("health_s", 0) for s in sampler.samples), default=None),
        "samples": sampler.samples,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "load_avg_end": os.getloadavg(),
                    "QUANTPIPE_CPU_KERNELS": os.environ.get("QUANTPIPE_CPU_KERNELS", "")},
    }


def verdict(res: dict) -> list[str]:
    problems = []
    if res["server_errors"]:
        problems.append(f"{len(res['server_errors'])} server errors (5xx)")
    if res["unexpected"]:
        problems.append(f"{len(res['unexpected'])} unexpected statuses")
    if res["kv_blocks_used_when_idle"] != 0 or res["in_flight_when_idle"] != 0:
        problems.append(f"not idle at the end: {res['kv_blocks_used_when_idle']} KV blocks, "
                        f"{res['in_flight_when_idle']} in flight")
    if res["health_after"] != 200 or res["request_after"] != 200:
        problems.append(f"after the run: /health {res['health_after']}, a request "
                        f"{res['request_after']}")
    return problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: tiny)")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--max-queue", type=int, default=4)
    ap.add_argument("--clients", type=int, default=0,
                    help="client loops (default: 4 x (max-num-seqs + max-queue))")
    ap.add_argument("--max-tokens", type=int, default=16, help="per request, drawn in 1..N")
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--request-timeout", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=1, help="server OMP_NUM_THREADS")
    ap.add_argument("--api-key", default=None,
                    help="start the server with this key (QUANTPIPE_API_KEY) and send it")
    ap.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak.json")
    ap.add_argument("--server-log", type=Path, default=None,
                    help="where the server's output goes (default: a file in the temp folder, "
                         "kept)")
    args = ap.parse_args()
    if args.server_log is None:
        args.server_log = Path(tempfile.gettempdir()) / f"quantpipe-soak-server-{os.getpid()}.log"
    print(f"server log: {args.server_log}", flush=True)
    with tempfile.TemporaryDirectory(prefix="quantpipe-soak-") as tmp:
        folder = args.model or tiny_model(Path(tmp))
        res = run(args, folder)
    res["problems"] = verdict(res)
    write_json_atomic(args.out, res)
    brief = {k: v for k, v in res.items() if k not in ("samples", "status_counts_by_kind")}
    print(json.dumps(brief, indent=1))
    print(f"wrote {args.out}")
    if res["problems"]:
        print("FAILED: " + "; ".join(res["problems"]))
        raise SystemExit(1)


if __name__ == "__main__":
    main()

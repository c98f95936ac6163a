r"""Serving throughput side by side: concurrency 8 vs 1, and prefix caching on vs off.

For each model folder (and each --threads / --head-dtype setting) this starts ``quantpipe serve``
on loopback as a child process, waits for ``/health``, runs ``quantpipe bench-serve``'s load
generator (``runtime.loadgen.run_bench``) against it, and stops it; then prints the ratios
measured in this one run and writes every run to JSON.

    python bench/serving.py --model int4=/tmp/qp/fmt-native --model fp16=/tmp/qp/fp16 \
        --threads 1,2 --concurrency 1,8 --prompt-len 16 --output-len 64 --duration 20

    python bench/serving.py --model int4=/tmp/qp/fmt-native --prefix   # 1,000-token prefix

Not a test: numbers depend on the machine and its load (say so when you quote them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import server_proc  # noqa: E402  (bench/server_proc.py)
from server_proc import stop_server  # noqa: E402

from quantpipe.core.io import write_json_atomic  # noqa: E402
from quantpipe.runtime.loadgen import BenchSpec, format_table, run_bench  # noqa: E402


def start_server(folder: Path, port: int, threads: int, head: str, prefix: bool,
                 kv: str, log: Path) -> subprocess.Popen:
    args = [str(folder), "--kv-cache-memory", kv, "--head-dtype", head, "--max-num-seqs", "16"]
    if not prefix:
        args.append("--no-prefix-caching")
    return server_proc.start_server(args, port, threads, log)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, metavar="NAME=DIR",
                    help="model folder to serve (repeatable)")
    ap.add_argument("--threads", default="1", help="comma list of OMP_NUM_THREADS for the server")
    ap.add_argument("--head-dtype", default="bf16", help="comma list of serve --head-dtype")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--prefix", action="store_true",
                    help="prefix-caching run instead: 1,024-token prompts sharing 1,000 tokens, "
                         "4 output tokens, concurrency 1, caching off then on")
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "serving.json")
    args = ap.parse_args()
    models = dict(m.split("=", 1) for m in args.model)
    threads = [int(t) for t in args.threads.split(",")]
    heads = args.head_dtype.split(",")
    conc = tuple(int(c) for c in args.concurrency.split(","))
    logdir = Path(tempfile.mkdtemp(prefix="qp-serving-"))  # server logs (named in errors)
    runs = []
    for name, folder in models.items():
        for t in threads:
            for head in heads:
                settings = [("off", False), ("on", True)] if args.prefix else [(None, True)]
                for label, prefix in settings:
                    tag = f"{name} threads={t} head={head}" + (f" prefix={label}" if label else "")
                    log = logdir / f"serve-{name}-t{t}-{head}-{label or 'conc'}.log"
                    proc = start_server(Path(folder), args.port, t, head, prefix,
                                        args.kv_cache_memory, log)
                    try:
                        spec = BenchSpec(
                            url=f"http://127.0.0.1:{args.port}",
                            concurrency=(1,) if args.prefix else conc,
                            prompt_len=1024 if args.prefix else args.prompt_len,
                            output_len=4 if args.prefix else args.output_len,
                            duration=args.duration, repeats=args.repeats,
                            shared_prefix_len=1000 if args.prefix else 0,
                            warmup_requests=1)
                        res = run_bench(spec)
                    finally:
                        stop_server(proc)
                    print(f"\n[{tag}]\n{format_table(res)}", flush=True)
                    runs.append({"model": name, "folder": folder, "threads": t, "head_dtype": head,
                                 "prefix_caching": prefix, "result": asdict(res)})
    print("\nsummary (medians):")
    summary = []
    for r in runs:
        med = {c: v["median"] for c, v in r["result"]["results"].items()}
        row = {"model": r["model"], "threads": r["threads"], "head_dtype": r["head_dtype"],
               "prefix_caching": r["prefix_caching"]}
        if args.prefix:
            row["ttft_p50_ms"] = med["1"]["ttft_ms"]["p50"]
        else:
            row.update({f"tok/s c{c}": med[str(c)]["output_throughput"] for c in conc})
            row[f"c{conc[-1]}/c{conc[0]}"] = (med[str(conc[-1])]["output_throughput"]
                                              / med[str(conc[0])]["output_throughput"])
        summary.append(row)
        print("  " + json.dumps(row))
    if args.prefix:
        for name in models:
            for t in threads:
                for head in heads:
                    on_off = {r["prefix_caching"]: r["ttft_p50_ms"] for r in summary
                              if (r["model"], r["threads"], r["head_dtype"]) == (name, t, head)}
                    print(f"  {name} t={t} {head}: TTFT p50 off/on = "
                          f"{on_off[False] / on_off[True]:.1f}x")
    write_json_atomic(args.json, {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "load_average_at_end": os.getloadavg(), "argv": sys.argv},
        "summary": summary, "runs": runs})
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

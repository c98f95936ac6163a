"""The CPU output-head kernels on large vocabularies, side by side in one run.

    python bench/head.py                      # writes bench/results/head.json

For each head shape (vocab x hidden: Gemma 3's 262,144 x 640 and Qwen2.5-1.5B's 151,936 x 1536
by default), each ISA build this CPU runs, each thread count and each number of rows M, the
median time of ``fp16_mm`` (the fp16 head), ``bf16_mm`` (the bf16 head, ``serve``'s default)
and ``w8a8_mm`` (the int8 head, ``generate``'s default), with the achieved weight-read rate
in GB/s (weight bytes / time; the heads are read once per call) next to a measured copy rate.
Random weights (the kernels' speed does not depend on the values). Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.kernel_speed import timeit as _timeit  # noqa: E402
from bench.vs_llamacpp import lscpu  # noqa: E402
from quantpipe.runtime.fp_head import block_row_pairs, int8_head_blocked  # noqa: E402
from quantpipe.runtime.kernels import cpu_ext  # noqa: E402
from quantpipe.runtime.kernels.cpu import block_rows  # noqa: E402


def timeit(fn, min_s: float) -> float:
    """Median seconds per call over at least ``min_s`` seconds and 5 calls
    (bench/kernel_speed.py)."""
    return _timeit(fn, torch.device("cpu"), min_s)


def copy_rate(min_s: float) -> float:
    """Bytes/s read by a 256 MiB copy (the bytes read, as the heads' rates count them)."""
    a = torch.empty(256 * 2**20, dtype=torch.uint8)
    b = torch.empty_like(a)
    return a.numel() / timeit(lambda: b.copy_(a), min_s)


def heads(n: int, k: int) -> dict:
    """{kernel: (operands, weight bytes)} for a random fp16 head [n, k]."""
    w16 = (torch.randn(n, k) * 0.02).half()
    q8, scales = int8_head_blocked(w16)
    # q8 [n/16, k/4, 64], scales fp16 [n/16, k/32, 16]: w8a8_mm's layout
    return {"fp16_mm": ((block_rows(w16),), n * k * 2),
            "bf16_mm": ((block_row_pairs(w16.bfloat16()),), n * k * 2),
            "w8a8_mm": ((q8, scales), n * k + n * k // 32 * 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="262144x640,151936x1536", help="VOCABxHIDDEN,...")
    ap.add_argument("--rows", default="1,2,4,8,16", help="rows M per call")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--min-s", type=float, default=0.5, help="seconds timed per case")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "head.json")
    args = ap.parse_args()
    isas = [isa for isa in cpu_ext.ISAS if cpu_ext.cpu_can_run(isa) and
            cpu_ext.build_status(isa)[0]]
    if not isas:
        raise SystemExit(f"quantpipe's CPU kernels are not usable here: "
                         f"{cpu_ext.kernel_status()[1]}")
    rows = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        kernels = heads(n, k)
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for isa in isas:
                ops = cpu_ext.ops(isa)
                for m in (int(v) for v in args.rows.split(",")):
                    x = torch.randn(m, k)
                    for name, (operands, nbytes) in kernels.items():
                        op = getattr(ops, name)
                        s = timeit(lambda op=op, operands=operands: op(x, *operands), args.min_s)
                        rows.append({"vocab": n, "hidden": k, "isa": isa, "threads": threads,
                                     "rows": m, "kernel": name, "ms": s * 1e3,
                                     "weight_gb_s": nbytes / s / 1e9})
                        print(f"{n}x{k} {isa} t{threads} M={m:<3d} {name:11s} {s * 1e3:8.2f} ms "
                              f"{nbytes / s / 1e9:6.1f} GB/s", flush=True)
    torch.set_num_threads(1)
    doc = {"host": {**lscpu(), "machine": platform.machine()},
           "copy_read_gb_s_1_thread": copy_rate(args.min_s) / 1e9,
           "torch": torch.__version__, "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{args.out.name}.", dir=args.out.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""An FP16 model's linear layers on CPU: torch's fp32 matmul vs quantpipe's fp16_mm, side by side.

    python bench/fp16_linears.py              # writes bench/results/fp16_linears.json

An FP16 export served on CPU with fp32 activations used to hold an fp32 copy of every linear
layer and run torch's matmul on it; it now keeps the checkpoint's fp16 weights and runs
``fp16_mm`` (``runtime.fp_head.set_half_linears``: exact fp16 -> fp32 weights, fp32 sums).
For each layer shape (SmolLM2-135M's MLP projections and Llama-2-7B's), each thread count and
each number of rows M (decode steps: 1-8, prefill chunks: 32-512), the median time of
``F.linear`` on the fp32 weight and of the fp16 layer, their ratio, and the fp16 layer's
largest error against a float64 product (its sums are fp32, as torch's). Random weights (the
speed does not depend on the values). Not a test.
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
from quantpipe.runtime.fp_head import HalfLinear  # noqa: E402
from quantpipe.runtime.kernels import cpu_ext  # noqa: E402


def timeit(fn, min_s: float) -> float:
    """Median seconds per call over at least ``min_s`` seconds and 5 calls."""
    return _timeit(fn, torch.device("cpu"), min_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1536x576,576x1536,11008x4096,4096x11008",
                    help="OUTxIN,... (SmolLM2-135M's MLP, Llama-2-7B's)")
    ap.add_argument("--rows", default="1,8,32,128,512", help="rows M per call")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--min-s", type=float, default=0.3, help="seconds timed per case")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fp16_linears.json")
    args = ap.parse_args()
    usable, why = cpu_ext.kernel_status()
    if not usable:
        raise SystemExit(f"quantpipe's CPU kernels are not usable here: {why}")
    g = torch.Generator().manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w16 = (torch.randn(n, k, generator=g) * 0.02).half()
        w32 = w16.float()
        layer = HalfLinear(w16, None, "fp16", torch.float32)
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for m in (int(v) for v in args.rows.split(",")):
                x = torch.randn(m, k, generator=g)
                want = x.double() @ w16.double().T
                err = float((layer(x).double() - want).abs().max() / want.abs().max())
                t32 = timeit(lambda: torch.nn.functional.linear(x, w32), args.min_s)
                t16 = timeit(lambda: layer(x), args.min_s)
                row = {"shape": [n, k], "threads": threads, "rows": m,
                       "torch_fp32_ms": t32 * 1e3, "fp16_mm_ms": t16 * 1e3,
                       "speedup": t32 / t16, "fp16_mm_gflops": 2 * m * n * k / t16 / 1e9,
                       "max_rel_error_vs_float64": err}
                rows.append(row)
                print(f"{n}x{k} threads={threads} M={m:4d}: torch fp32 {t32 * 1e3:8.3f} ms  "
                      f"fp16_mm {t16 * 1e3:8.3f} ms  {t32 / t16:5.2f}x  "
                      f"({row['fp16_mm_gflops']:.0f} GFLOP/s, max rel err {err:.1e})",
                      flush=True)
    result = {"isa": cpu_ext.active_isa(), "torch": torch.__version__,
              "machine": platform.machine(), "lscpu": lscpu(), "rows": rows,
              "bytes_per_weight": {"torch_fp32": 4, "fp16_mm": 2}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=args.out.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""The 4-bit prefill matmul on AMX vs the VNNI tiles and oneDNN's bf16 GEMM, side by side.

    python bench/amx_mm.py                    # writes bench/results/amx_mm.json

For each linear shape (out x in: SmolLM2-135M's and Qwen2.5-Coder-1.5B's q/k/v, o, gate/up and
down projections by default), each thread count and each number of activation rows M, the
median time of
- ``amx``: ``w4a8_mm_amx``, the W4A8 layout's weights expanded to bf16 on the AMX tile unit
  (what ``w4a8_mm`` runs from 32 rows on an AMX CPU);
- ``vnni``: ``w4a8_mm`` on the same weights in calls of 16 rows (its VNNI tiles, int8
  activations: what it ran for every row count before the AMX kernel, and still runs below 32);
- ``onednn_bf16``: ``torch.nn.functional.linear`` on bf16 activations and a bf16 weight of the
  same shape (oneDNN's AMX GEMM: what vLLM's CPU build runs on the unquantized model),
with GFLOP/s and the ratios amx / vnni and amx / onednn_bf16 (time of the other over time of
amx: above 1 means amx is faster). Random weights (the kernels' speed does not depend on the
values). Not a test; the CPU must have AMX-BF16.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.kernel_speed import timeit as _timeit  # noqa: E402
from bench.vs_llamacpp import lscpu  # noqa: E402
from quantpipe.core.io import write_json_atomic  # noqa: E402
from quantpipe.runtime.kernels import cpu_ext  # noqa: E402
from quantpipe.runtime.kernels.cpu import pack_w4a8  # noqa: E402

SHAPES = ("smollm2:960x576,576x576,3072x576,576x1536,"
          "qwen2.5-1.5b:2048x1536,1536x1536,17920x1536,1536x8960")
VNNI_ROWS = 16  # rows per w4a8_mm call for the VNNI timing (below the AMX threshold)


def timeit(fn, min_s: float) -> float:
    """Median seconds per call over at least ``min_s`` seconds and 5 calls
    (bench/kernel_speed.py)."""
    return _timeit(fn, torch.device("cpu"), min_s)


def parse_shapes(text: str) -> list[tuple[str, int, int]]:
    """"model:NxK,NxK,model2:NxK" -> [(model, N, K)]."""
    out, model = [], "?"
    for item in text.split(","):
        if ":" in item:
            model, item = item.split(":", 1)
        n, k = (int(v) for v in item.split("x"))
        out.append((model, n, k))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES, help="model:OUTxIN,OUTxIN,model2:OUTxIN,...")
    ap.add_argument("--rows", default="32,64,155,256,512", help="activation rows M per call")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--group-size", type=int, default=128, help="64 where IN is not a multiple")
    ap.add_argument("--min-s", type=float, default=0.3, help="seconds timed per case")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "amx_mm.json")
    args = ap.parse_args()
    usable, why = cpu_ext.build_status("avx512") if cpu_ext.cpu_can_run("avx512") else (
        False, "the CPU cannot run the avx512 build")
    if not usable:
        raise SystemExit(f"quantpipe's AVX-512 kernels are not usable here: {why}")
    ops = cpu_ext.ops("avx512")
    if not ops.amx_supported():
        raise SystemExit("this CPU has no AMX-BF16 (or Linux does not grant it): nothing to time")
    rows = []
    gen = torch.Generator().manual_seed(0)
    for model, n, k in parse_shapes(args.shapes):
        gs = args.group_size if k % args.group_size == 0 else 64
        packed = pack_w4a8(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen))
        scales = (torch.rand(n // 16, k // gs, 16, generator=gen) * 0.02 + 0.001).half()
        w_bf16 = (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for m in (int(v) for v in args.rows.split(",")):
                x = torch.randn(m, k, generator=gen)
                chunks = [x[i:i + VNNI_ROWS].contiguous() for i in range(0, m, VNNI_ROWS)]
                ms = {
                    "amx": timeit(lambda: ops.w4a8_mm_amx(x, packed, scales, None, gs),
                                  args.min_s) * 1e3,
                    "vnni": timeit(lambda: [ops.w4a8_mm(c, packed, scales, None, gs, True)
                                            for c in chunks], args.min_s) * 1e3,
                    "onednn_bf16": timeit(lambda: torch.nn.functional.linear(x.bfloat16(),
                                                                             w_bf16),
                                          args.min_s) * 1e3,
                }
                flop = 2 * m * n * k
                row = {"model": model, "out": n, "in": k, "group_size": gs, "threads": threads,
                       "rows": m, "ms": ms,
                       "gflop_s": {name: flop / t / 1e6 for name, t in ms.items()},
                       "amx_vs_vnni": ms["vnni"] / ms["amx"],
                       "amx_vs_onednn_bf16": ms["onednn_bf16"] / ms["amx"]}
                rows.append(row)
                print(f"{model} {n}x{k} g{gs} t{threads} M={m:<4d} "
                      + "  ".join(f"{name} {t:7.3f} ms ({row['gflop_s'][name]:5.0f} GF/s)"
                                  for name, t in ms.items())
                      + f"  amx/vnni {row['amx_vs_vnni']:.2f}x"
                      f"  amx/onednn {row['amx_vs_onednn_bf16']:.2f}x", flush=True)
    torch.set_num_threads(1)
    doc = {"host": {**lscpu(), "machine": platform.machine(),
                    "load_avg_at_end": os.getloadavg()},
           "torch": torch.__version__, "results": rows}
    write_json_atomic(args.out, doc)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

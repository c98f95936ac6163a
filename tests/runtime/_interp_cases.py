"""Run every Triton kernel under the interpreter; print one JSON result per case.

Invoked by test_kernels.py in a subprocess with TRITON_INTERPRET=1 (it must be set before
triton is imported, and must not leak into other test modules).
"""

from __future__ import annotations

import json
import os
import sys
import zlib

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from quantpipe.core.qformat import QuantSpec  # noqa: E402
from quantpipe.runtime.kernels import autotune  # noqa: E402
from quantpipe.runtime.kernels import triton_kernels as tk  # noqa: E402
from quantpipe.runtime.kernels.layout import (  # noqa: E402
    dequantize_reference,
    repack_for_triton,
    widen_to_int8,
)
from tests.runtime._quant_helpers import random_packed  # noqa: E402

N = 80  # not a multiple of BLOCK_N: exercises the column masks


def layouts() -> list[tuple[QuantSpec, int]]:
    out = []
    for bits in (4, 8):
        for sym in (True, False):
            for gs in (32, 64, 128, -1):
                for act in (False, True):
                    if act and gs == -1:
                        continue
                    out.append((QuantSpec(bits, gs, sym, act), 256))
    out += [(QuantSpec(4, 32, False), 160), (QuantSpec(8, -1, True), 160)]  # K tail masks
    # INT5 / INT6 run as the INT8 layer of the same weights (QuantLinear widens them)
    out += [(QuantSpec(5, 64, False, True), 256), (QuantSpec(6, 32, True), 256)]
    return out


# (kernel, config, M values): every layout runs one case of each row, the M (and the
# activation dtype) rotating across layouts, so all options meet every kernel
PLANS = [
    [("gemv_splitk", {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1}, 1),
     ("gemv_splitk", {"BLOCK_N": 64, "BLOCK_K": 32, "SPLIT_K": 3}, 16),
     ("gemv_splitk", {"BLOCK_N": 64, "BLOCK_K": 32, "SPLIT_K": 2}, 3)],
    [("fused_gemm", {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64}, 3),
     ("fused_gemm", {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64}, 33)],
    [("fused_gemm", {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}, 64),
     ("dequant_matmul", {}, 80),
     ("fused_gemm", {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}, 80)],
    # the unpinned dispatch (first candidate of each M bucket under the interpreter)
    [("autotune", None, 1), ("autotune", None, 33), ("autotune", None, 80)],
]


def run_case(spec: QuantSpec, k: int, kernel: str, cfg: dict | None, m: int,
             dtype: torch.dtype) -> dict:
    case_id = f"{spec.label()}-K{k}-{kernel}-{cfg and '.'.join(map(str, cfg.values()))}-M{m}-" \
              f"{str(dtype)[6:]}"
    seed = zlib.crc32(case_id.encode())
    p = random_packed(N, k, spec, seed)
    tw = repack_for_triton(widen_to_int8(p), "cpu")
    torch.manual_seed(seed)
    x = torch.randn(m, k).to(dtype)  # fresh inputs per case
    out = torch.full((m, N), float("nan"), dtype=dtype)  # poisoned: every element must be set
    if kernel == "autotune":
        got = autotune.run(x, tw, out=out)
    else:
        got = tk.KERNELS[kernel](x, tw, cfg, out)
    want = x.double() @ dequantize_reference(p).T  # float64 reference
    rel = float((got.double() - want).norm() / want.norm())
    # fp32: summation order only; fp16: the output rounding (and fp16 W tile for tl.dot)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    return {"id": case_id, "rel": rel, "tol": tol, "nan": bool(got.isnan().any()),
            "same_buffer": got.data_ptr() == out.data_ptr()}


def main() -> None:
    results = []
    for i, (spec, k) in enumerate(layouts()):
        for j, row in enumerate(PLANS):
            kernel, cfg, m = row[i % len(row)]
            # bf16 tl.dot is wrong in the interpreter: bf16 is covered by the GPU tests
            dtype = (torch.float32, torch.float16)[(i + j) % 2]
            results.append(run_case(spec, k, kernel, cfg, m, dtype))
    pinned = autotune.parse_pin("gemv_splitk:BLOCK_N=32,BLOCK_K=32,SPLIT_K=2")
    results.append({"id": "parse_pin", "ok": pinned == (
        "gemv_splitk", {"BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 2})})
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()

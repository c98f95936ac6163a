"""Choose a Triton kernel + tile config per (M bucket, N, K, group size, bits, dtype), cached.

Candidates by M (the dispatch table):

| M bucket   | candidates                                                              |
|------------|-------------------------------------------------------------------------|
| <= 16      | split-K GEMV configs, tl.dot with BLOCK_M = 16                          |
| 17 .. 64   | tl.dot with BLOCK_M in {16, 32, 64}                                     |
| > 64       | tl.dot with large tiles, dequantize-once + dense matmul                 |

On first use of a key every candidate is timed with ``triton.testing.do_bench`` and the fastest
is cached for the process. Bypass (interpreter tests, reproducible runs): pass ``pin=`` to
:func:`choose`, or set ``QUANTPIPE_TRITON_PIN="kernel:KEY=V,KEY=V"``, e.g.
``gemv_splitk:BLOCK_N=32,BLOCK_K=32,SPLIT_K=2``. Under ``TRITON_INTERPRET=1`` nothing is timed:
the first candidate of the bucket is used.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

Choice = tuple[str, dict]  # (kernel name in triton_kernels.KERNELS, config)

_GEMV = [
    {"BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 4, "num_warps": 4},
    {"BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 8, "num_warps": 4},
    {"BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4},
    {"BLOCK_N": 256, "BLOCK_K": 64, "SPLIT_K": 8, "num_warps": 8},
    {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 16, "num_warps": 4},
    {"BLOCK_N": 128, "BLOCK_K": 32, "SPLIT_K": 1, "num_warps": 4},
]
_DOT_SMALL = [
    {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": s}
    for bm, bn, bk, w, s in [(16, 64, 64, 4, 3), (16, 128, 64, 4, 3), (32, 64, 64, 4, 3),
                             (32, 128, 64, 4, 3), (64, 64, 64, 4, 3), (64, 128, 32, 4, 4)]
]
_DOT_LARGE = [
    {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": s}
    for bm, bn, bk, w, s in [(64, 128, 32, 4, 4), (128, 128, 32, 8, 3), (128, 64, 64, 4, 3),
                             (128, 256, 32, 8, 3)]
]


def m_bucket(m: int) -> int:
    """Next power of two >= m, capped at 512 (prefill shapes share one choice)."""
    b = 1
    while b < m and b < 512:
        b *= 2
    return b


def candidates(m: int) -> list[Choice]:
    if m <= 16:
        return [("gemv_splitk", c) for c in _GEMV] + [("fused_gemm", c) for c in _DOT_SMALL[:2]]
    if m <= 64:
        return [("fused_gemm", c) for c in _DOT_SMALL]
    return [("fused_gemm", c) for c in _DOT_LARGE] + [("dequant_matmul", {})]


def parse_pin(text: str) -> Choice:
    """``"kernel:KEY=V,KEY=V"`` -> (kernel, {KEY: int(V)})."""
    from quantpipe.runtime.kernels.triton_kernels import KERNELS

    name, _, rest = text.partition(":")
    if name not in KERNELS:
        raise ValueError(f"QUANTPIPE_TRITON_PIN kernel {name!r} unknown; use one of "
                         f"{sorted(KERNELS)}")
    cfg = {}
    for item in filter(None, rest.split(",")):
        key, _, val = item.partition("=")
        if not val.strip().lstrip("-").isdigit():
            raise ValueError(f"QUANTPIPE_TRITON_PIN item {item!r} is not KEY=INT")
        cfg[key.strip()] = int(val)
    return name, cfg


_CACHE: dict[tuple, Choice] = {}


def choose(x2d: torch.Tensor, tw, pin: Choice | None = None) -> Choice:
    """The kernel and config for this call (see the module docstring for the order)."""
    if pin is not None:
        return pin
    env = os.environ.get("QUANTPIPE_TRITON_PIN")
    if env:
        return parse_pin(env)
    m = x2d.shape[0]
    key = (m_bucket(m), tw.out_features, tw.in_features, tw.group_size, tw.bits,
           tw.zeros_t is not None, tw.g_idx is not None, x2d.dtype)
    if key in _CACHE:
        return _CACHE[key]
    cands = candidates(m)
    if os.environ.get("TRITON_INTERPRET") == "1":
        _CACHE[key] = cands[0]
        return cands[0]
    _CACHE[key] = _time_candidates(x2d, tw, cands, key)
    return _CACHE[key]


def _time_candidates(x2d: torch.Tensor, tw, cands: list[Choice], key: tuple) -> Choice:
    import triton

    from quantpipe.runtime.kernels.triton_kernels import KERNELS

    best, best_ms = None, float("inf")
    for name, cfg in cands:
        try:
            ms = triton.testing.do_bench(lambda: KERNELS[name](x2d, tw, cfg), warmup=5, rep=20)
        except Exception as exc:  # a config the device cannot run (e.g. shared memory)
            log.warning("autotune %s: %s %s failed, skipped: %s", key, name, cfg, exc)
            continue
        if ms < best_ms:
            best, best_ms = (name, cfg), ms
    if best is None:
        raise RuntimeError(f"no Triton config ran for {key}; set QUANTPIPE_TRITON_PIN")
    log.info("autotune %s -> %s %s (%.4f ms)", key, best[0], best[1], best_ms)
    return best


def run(x2d: torch.Tensor, tw, pin: Choice | None = None,
        out: torch.Tensor | None = None) -> torch.Tensor:
    """x2d [M, K] (contiguous rows) -> [M, N] through the chosen Triton kernel."""
    from quantpipe.runtime.kernels.triton_kernels import KERNELS

    name, cfg = choose(x2d, tw, pin)
    return KERNELS[name](x2d, tw, cfg, out)

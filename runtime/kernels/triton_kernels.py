"""Triton W4A16 / W8A16 kernels reading the packed layout of ``layout.TritonWeights``.

Three kernels, all dequantizing in registers from ``qweight_t`` int32 [K*bits/32, N],
``scales_t`` fp16 [G, N], ``zeros_t`` uint8 [G, N] (asym) and ``g_idx`` int32 [K] (act-order):

- ``_gemv_splitk_kernel`` (decode, M <= 16): one program per (N block, K split, row); fp32
  multiply-reduce without tensor cores, K split across programs and combined with fp32 atomics
  so that a 1 x 4096 x 4096 product still fills the GPU.
- ``_fused_gemm_kernel`` (tl.dot): [BLOCK_M, BLOCK_K] activations x dequantized
  [BLOCK_K, BLOCK_N] tile, fp32 accumulation; small BLOCK_M for M <= 64, big tiles for prefill.
- ``_dequant_kernel``: writes W^T [K, N] once so that prefill can use the dense matmul instead
  (the only path that materialises a dequantized weight; chosen by the autotuner only where it
  measures faster).

Dequantization is ``(q - zero) * scale`` in fp32 as in ``quantpipe.core.qformat.dequantize``.
Launchers take an optional pinned ``config`` (the autotune bypass used by the interpreter tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantpipe.runtime.kernels.layout import TritonWeights


@triton.jit
def _dequant_tile(qw_ptr, s_ptr, z_ptr, g_ptr, offs_k, offs_n, mask_k, mask_n, N,
                  BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                  HAS_GIDX: tl.constexpr):
    """fp32 [BLOCK_K, BLOCK_N] tile of W^T = (q - zero) * scale."""
    PER_WORD: tl.constexpr = 32 // BITS
    QMASK: tl.constexpr = (1 << BITS) - 1
    SYM_ZERO: tl.constexpr = 1 << (BITS - 1)  # 8 for INT4, 128 for INT8
    mask = mask_k[:, None] & mask_n[None, :]
    # each int32 word holds PER_WORD consecutive k of one column n (LSB first)
    words = tl.load(qw_ptr + (offs_k // PER_WORD)[:, None] * N + offs_n[None, :],
                    mask=mask, other=0)  # [BK, BN] int32
    shift = (offs_k % PER_WORD) * BITS  # [BK]
    # arithmetic shift may smear the sign bit in, the mask keeps only the BITS we want
    q = (words >> shift[:, None]) & QMASK  # [BK, BN] int32 in [0, 2**BITS)
    if HAS_GIDX:
        g = tl.load(g_ptr + offs_k, mask=mask_k, other=0)  # [BK] int32
    else:
        g = offs_k // GROUP  # [BK]
    sz_off = g[:, None] * N + offs_n[None, :]  # [BK, BN]
    s = tl.load(s_ptr + sz_off, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(z_ptr + sz_off, mask=mask, other=0).to(tl.float32)
    else:
        z = SYM_ZERO
    return (q.to(tl.float32) - z) * s


@triton.jit
def _gemv_splitk_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, K, stride_xm, stride_om,
                        BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                        HAS_GIDX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, SPLIT_K * BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + m * stride_xm + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        w = _dequant_tile(qw_ptr, s_ptr, z_ptr, g_ptr, offs_k, offs_n, mask_k, mask_n, N,
                          BITS, GROUP, HAS_ZEROS, HAS_GIDX)  # [BK, BN] fp32
        acc += tl.sum(w * x[:, None], axis=0)  # [BN]
    out = out_ptr + m * stride_om + offs_n
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_n)
    else:
        # out is an fp32 workspace zeroed by the launcher; the mask covers the full [BN] shape
        tl.atomic_add(out, acc, mask=mask_n)


@triton.jit
def _fused_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, M, N, K, stride_xm,
                       stride_om, BITS: tl.constexpr, GROUP: tl.constexpr,
                       HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK] x dtype
        w = _dequant_tile(qw_ptr, s_ptr, z_ptr, g_ptr, offs_k, offs_n, mask_k, mask_n, N,
                          BITS, GROUP, HAS_ZEROS, HAS_GIDX)  # [BK, BN] fp32
        # the tile is rounded to the activation dtype, as a dense fp16 layer would hold it;
        # DOT_PREC "ieee" for fp32 activations keeps them out of tf32 (fp16/bf16: the default)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PREC)  # [BM, BN] fp32
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _dequant_kernel(qw_ptr, s_ptr, z_ptr, g_ptr, w_ptr, N, K, BITS: tl.constexpr,
                    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_k = offs_k < K
    mask_n = offs_n < N
    w = _dequant_tile(qw_ptr, s_ptr, z_ptr, g_ptr, offs_k, offs_n, mask_k, mask_n, N,
                      BITS, GROUP, HAS_ZEROS, HAS_GIDX)
    tl.store(w_ptr + offs_k[:, None] * N + offs_n[None, :], w.to(w_ptr.dtype.element_ty),
             mask=mask_k[:, None] & mask_n[None, :])


def _common(tw: TritonWeights) -> tuple:
    # unused pointers get a valid tensor; the constexpr flags keep them from being read
    z = tw.zeros_t if tw.zeros_t is not None else tw.scales_t
    g = tw.g_idx if tw.g_idx is not None else tw.scales_t
    return (tw.qweight_t, tw.scales_t, z, g)


def _flags(tw: TritonWeights) -> dict:
    return dict(BITS=tw.bits, GROUP=tw.group_size, HAS_ZEROS=tw.zeros_t is not None,
                HAS_GIDX=tw.g_idx is not None)


def gemv_splitk(x2d: torch.Tensor, tw: TritonWeights, cfg: dict,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x2d [M, K] fp16/bf16/fp32 -> [M, N] in x's dtype. cfg: BLOCK_N, BLOCK_K, SPLIT_K, warps."""
    M, K = x2d.shape
    N = tw.out_features
    out = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device) if out is None else out
    split_k = cfg["SPLIT_K"]
    dest = out if split_k == 1 else torch.zeros((M, N), dtype=torch.float32, device=x2d.device)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), split_k, M)
    _gemv_splitk_kernel[grid](x2d, *_common(tw), dest, N, K, x2d.stride(0), dest.stride(0),
                              BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], SPLIT_K=split_k,
                              num_warps=cfg.get("num_warps", 4), **_flags(tw))
    if split_k != 1:
        out.copy_(dest)
    return out


def fused_gemm(x2d: torch.Tensor, tw: TritonWeights, cfg: dict,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x2d [M, K] -> [M, N] with the tl.dot kernel. cfg: BLOCK_M, BLOCK_N, BLOCK_K, warps."""
    M, K = x2d.shape
    N = tw.out_features
    out = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device) if out is None else out
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]))
    _fused_gemm_kernel[grid](x2d, *_common(tw), out, M, N, K, x2d.stride(0), out.stride(0),
                             BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                             BLOCK_K=cfg["BLOCK_K"],
                             DOT_PREC="ieee" if x2d.dtype == torch.float32 else "tf32",
                             num_warps=cfg.get("num_warps", 4),
                             num_stages=cfg.get("num_stages", 2), **_flags(tw))
    return out


def dequantize_t(tw: TritonWeights, dtype: torch.dtype, device) -> torch.Tensor:
    """W^T [K, N] in ``dtype`` (the dequantize-once prefill path)."""
    K, N = tw.in_features, tw.out_features
    w = torch.empty((K, N), dtype=dtype, device=device)
    grid = (triton.cdiv(K, 64), triton.cdiv(N, 64))
    _dequant_kernel[grid](*_common(tw), w, N, K, BLOCK_N=64, BLOCK_K=64, **_flags(tw))
    return w


def dequant_matmul(x2d: torch.Tensor, tw: TritonWeights, cfg: dict,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """x2d [M, K] @ W^T [K, N] with W^T dequantized once into a temporary."""
    w_t = dequantize_t(tw, x2d.dtype, x2d.device)  # [K, N]
    if out is None:
        return x2d @ w_t
    return torch.matmul(x2d, w_t, out=out)


KERNELS = {"gemv_splitk": gemv_splitk, "fused_gemm": fused_gemm, "dequant_matmul": dequant_matmul}

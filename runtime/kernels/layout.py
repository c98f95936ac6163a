"""Packed inputs of one quantized linear and the load-time repacks for each kernel family.

The seam between checkpoint formats and kernels: every loader (native, GPTQ and
compressed-tensors, ``runtime.loader``) produces a :class:`PackedLinear` in the *native*
convention of ``quantpipe.core.qformat`` (``w = (q - zero) * scale``, unsigned ``q``, packed
LSB-first along ``in``); the kernels only ever see the repacked layouts built here, once, at
load time.

Repacked layouts
----------------
- Triton (``TritonWeights``): ``qweight_t`` int32 ``[in * bits / 32, out]`` -- packed along
  ``in`` and transposed like GPTQ, so a [BLOCK_K, BLOCK_N] tile is one coalesced row read per
  word -- ``scales_t`` fp16 ``[G, out]``, ``zeros_t`` uint8 ``[G, out]`` (asym only), ``g_idx``
  int32 ``[in]`` (act-order only).
- CPU int4 (``torch.ops.aten._convert_weight_to_int4pack_for_cpu``): see ``kernels/cpu.py``.
- INT5 / INT6 layers (native menu entries) have no kernels of their own: :func:`widen_to_int8`
  rewrites one as the symmetric INT8 layer of the same weights (``q - zero`` fits int8), which
  every INT8 kernel runs exactly; it holds 8 bits per weight in memory (the checkpoint 5 or 6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantpipe.core.qformat import VALID_BITS, QuantSpec, pack_int32, unpack_int32


@dataclass(frozen=True)
class PackedLinear:
    """One quantized linear in the native packed convention (what loaders hand to kernels)."""

    spec: QuantSpec  # bits / group size actually used for this layer, sym, act_order
    qweight: torch.Tensor  # int32 [out, in * bits / 32], unsigned q packed LSB-first along in
    scales: torch.Tensor  # fp16 [out, G]
    qzeros: torch.Tensor | None  # uint8 [out, G]; None = symmetric (zero = 2**(bits-1))
    g_idx: torch.Tensor | None  # int32 [in]; None = sequential groups (i // group_size)
    bias: torch.Tensor | None  # [out] any float dtype
    in_features: int

    def __post_init__(self) -> None:
        out_f, words = self.qweight.shape
        if self.qweight.dtype != torch.int32 or words * 32 // self.spec.bits != self.in_features:
            raise ValueError(
                f"qweight {tuple(self.qweight.shape)} {self.qweight.dtype} does not hold "
                f"{self.in_features} {self.spec.bits}-bit columns; convert the checkpoint to "
                "int32 [out, in*bits/32] packed LSB-first along in"
            )
        n_groups = self.spec.n_groups(self.in_features)
        if self.scales.shape != (out_f, n_groups) or self.scales.dtype != torch.float16:
            raise ValueError(
                f"scales must be fp16 [{out_f}, {n_groups}], got {tuple(self.scales.shape)} "
                f"{self.scales.dtype}"
            )
        if self.qzeros is not None and (
            self.qzeros.shape != self.scales.shape or self.qzeros.dtype != torch.uint8
        ):
            raise ValueError(f"qzeros must be uint8 {tuple(self.scales.shape)}")
        if self.g_idx is not None and (
            self.g_idx.shape != (self.in_features,) or self.g_idx.dtype != torch.int32
        ):
            raise ValueError(f"g_idx must be int32 [{self.in_features}]")

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def group_size(self) -> int:
        return self.spec.group_size_for(self.in_features)

    def unpacked_q(self) -> torch.Tensor:
        """uint8 [out, in] unsigned q."""
        return unpack_int32(self.qweight, self.spec.bits, self.in_features)

    def zeros_u8(self) -> torch.Tensor:
        """uint8 [out, G] integer zeros (the mid-point for sym specs)."""
        if self.qzeros is not None:
            return self.qzeros
        return torch.full(self.scales.shape, self.spec.sym_zero, dtype=torch.uint8,
                          device=self.scales.device)

    def group_index(self) -> torch.Tensor:
        """int64 [in]: the group of every input column."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features, device=self.qweight.device) // self.group_size


def widen_to_int8(p: PackedLinear) -> PackedLinear:
    """``p`` itself when kernels take its width (4, 8), else the symmetric INT8 layer whose
    weights equal ``p``'s exactly: ``q8 = q - zero + 128`` per column's group, same scales,
    same groups (so ``(q8 - 128) * s == (q - zero) * s``; |q - zero| <= 63 at INT6)."""
    if p.spec.bits in VALID_BITS:
        return p
    z = p.zeros_u8().to(torch.int16)[:, p.group_index()]  # [out, in]
    q8 = (p.unpacked_q().to(torch.int16) - z + 128).to(torch.uint8)  # [out, in] in [65, 191]
    spec = QuantSpec(8, p.spec.group_size, True, p.spec.act_order)
    return PackedLinear(spec, pack_int32(q8, 8), p.scales, None, p.g_idx, p.bias, p.in_features)


def dequantize_reference(p: PackedLinear, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """W [out, in] in ``dtype``: the exact reference (q - zero) * scale computed in float64."""
    g = p.group_index()
    q = p.unpacked_q().double()  # [out, in]
    s = p.scales.double()[:, g]  # [out, in]
    z = p.zeros_u8().double()[:, g]  # [out, in]
    return ((q - z) * s).to(dtype)


@dataclass(frozen=True)
class TritonWeights:
    """Kernel-friendly layout for the Triton kernels (see the module docstring)."""

    bits: int
    group_size: int  # actual group size (in_features for per-channel)
    qweight_t: torch.Tensor  # int32 [in * bits / 32, out]
    scales_t: torch.Tensor  # fp16 [G, out]
    zeros_t: torch.Tensor | None  # uint8 [G, out]; None = sym
    g_idx: torch.Tensor | None  # int32 [in]; None = sequential groups
    in_features: int
    out_features: int


def repack_for_triton(p: PackedLinear, device: torch.device | str) -> TritonWeights:
    """Native [out, in*bits/32] -> transposed [in*bits/32, out] (packing along in kept)."""
    # the native words already pack along in: a transpose keeps every word intact
    qweight_t = p.qweight.t().contiguous()  # [out, in*bits/32] -> [in*bits/32, out] int32
    return TritonWeights(
        bits=p.spec.bits,
        group_size=p.group_size,
        qweight_t=qweight_t.to(device),
        scales_t=p.scales.t().contiguous().to(device),  # [G, out] fp16
        zeros_t=None if p.qzeros is None else p.qzeros.t().contiguous().to(device),  # [G, out]
        g_idx=None if p.g_idx is None else p.g_idx.contiguous().to(device),  # [in] int32
        in_features=p.in_features,
        out_features=p.out_features,
    )

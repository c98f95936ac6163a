"""CPU path: quantpipe's kernels (two ISA builds), torch's int4pack / int8pack, and the fallback.

Every layout is repacked once at load time. The backends are :class:`~.backend.Backend`
objects (:data:`CPU_BACKENDS`, registered in ``quant_linear.BACKENDS``); which one a layer gets
(:func:`cpu_backend_for`, table lookups in :data:`OURS` and :data:`TORCH_PEER`;
``kernels/cpu_ext.py`` picks the ISA build):

| backend          | when                                                                   |
|------------------|------------------------------------------------------------------------|
| ``w4a8_<isa>``   | bits 4, group size a multiple of 32 dividing ``in``, ``out % 16 == 0``, |
|                  | our kernels usable (``w4a8_avx512`` / ``w4a8_avx2``); act-order as for  |
|                  | int4pack. W4A8: activations quantized to int8 per 32 columns in the    |
|                  | op, int8 dot products. The default for 4-bit layers                    |
| ``w4a16_avx512`` | bits 4 on the AVX-512 build when the group size is a multiple of 16 but |
|                  | not of 32, or ``QUANTPIPE_CPU_INT4_ACT=bf16``: W4A16, bf16 activations  |
| ``int4pack``     | bits 4 when none of ours is usable: group size 32/64/128/256 dividing   |
|                  | ``in``, ``out % 16 == 0``, ``in % 32 == 0``; act-order only when every |
|                  | group holds ``group_size`` columns (then columns are sorted by group and |
|                  | the input is permuted). For ``M >= PREFILL_ROWS`` (prefill) the layer is |
|                  | dequantized once per call into a bf16 temporary and multiplied densely  |
| ``w8a32_<isa>``  | bits 8, group size a multiple of 16 dividing ``in`` (or per channel),   |
|                  | ``out % 16 == 0``, ours usable; sym or asym, act-order as above. Exact  |
|                  | int8 weights x fp32 activations (``w8a32_mm``)                          |
| ``int8pack``     | bits 8 when ours are not usable: sym, one group per row (per channel)  |
| ``dequant``      | everything else: dequantize (fp32) and matmul on every call            |

W4A8 (``w4a8_mm``, both builds) quantizes each activation row per block of 32 columns to
int8 (d = amax / 127, xq = round-half-even(x * 127 / amax)); the integer dots of unsigned q
with xq are exact; each block's dot is scaled by ``d * scale`` in fp32 and the zero point adds
``-z * scale * sum_blocks(d * sum(xq))`` per group (the same quantized activations, so their
rounding errors cancel with the dots'). Layout: ``packed`` uint8 ``[out / 16, in / 8, 64]``
(:func:`pack_w4a8`), ``scales`` fp16 (the checkpoint's) and ``mz = -z * scale`` fp32
``[out / 16, G, 16]`` (no ``mz`` for a symmetric layer: the kernel forms ``-8 * scale``).

Numerics of the bf16-activation paths (torch's kernels are fast only for bf16 inputs; fp32
inputs are 15-40x slower there):

- w4a16_avx512 computes ``sum_k bf16(x_k) * (q - 8)`` per group in fp32 (``q - 8`` is exact in
  bf16), then ``* scale + zf * sum_k bf16(x_k)`` with the checkpoint's fp16 scale (exact) and
  ``zf = (8 - z) * scale`` in fp32 (exact), so the only roundings are of x to bf16 and fp32 sums.

- int4pack computes ``w = (q - 8) * scale + zero_fp`` with a float zero *point*. Our integer
  zero ``z`` maps exactly to ``zero_fp = (8 - z) * scale`` since
  ``(q - 8) * s + (8 - z) * s = (q - z) * s``. Scales and zero points are stored in bf16, so
  the effective weight differs from the fp16-scale reference by the bf16 rounding of ``scale``
  and ``zero_fp`` (relative 2**-9 each); sym layers have ``zero_fp = 0`` exactly.
- int8pack computes ``x @ (q8 * scale).T`` with ``q8 = q - 128`` as int8 (exact) and bf16
  per-row scales.

w8a32_avx512 computes ``sum_k x_k * (q - 128)`` per group with exact int8 -> fp32 weights and
fp32 activations, then ``* scale + zf * sum_k x_k``, ``zf = (128 - z) * scale``: fp32 sums only.

Repacked layouts: w8a32_avx512 is ``q8`` int8 ``[out / 16, in, 16]`` (q - 128, 16 output rows
side by side), scales / zf as for w4a16_avx512. w4a16_avx512 is ``packed`` uint8
``[out / 16, in / 4, 32]`` (16 output rows x 4 columns per 32-byte chunk, layout in
``csrc/cpu_ops.cpp``; :func:`unpack_w4a16` inverts it),
``scales`` fp16 ``[out / 16, G, 16]``, ``zf`` fp32 ``[out / 16, G, 16]`` (None when every
``z == 8``, sym). int4pack takes unsigned q as int32 [out, in] and returns its own uint8 blob
``[out, in / 2]`` (``_convert_weight_to_int4pack_for_cpu(q, inner_k_tiles=2)``), plus
``scales_and_zeros`` bf16 [G, out, 2] (scale, zero point). int8pack takes int8 [out, in] and
bf16 scales [out].

The blob is undocumented; torch 2.13 lays it out in blocks of ``n`` output rows, ``n`` = 64
with its AVX-512 kernels and 32 with its AVX2 ones: ``[out / n, in, n / 2]`` bytes whose low
nibble is row ``n b + j`` and high nibble row ``n b + n / 2 + j`` (:func:`unpack_int4pack`).
Repacking finds the block that reads the blob back exactly (round trip on every layer) and
only then enables the prefill path, so another torch build with another layout just keeps
int4pack for every M.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from quantpipe.core.qformat import unpack_int32
from quantpipe.runtime.kernels import cpu_ext
from quantpipe.runtime.kernels.backend import Backend
from quantpipe.runtime.kernels.layout import PackedLinear

BLOCK_ROWS = 16  # w4a16_avx512: output rows per block, and the group size's multiple
A8_BLOCK = 32  # W4A8: activations quantized per block of 32 columns (the group size's multiple)
# "int8" (default): 4-bit layers run W4A8; "bf16": W4A16 (w4a16_avx512) on AVX-512 hosts
INT4_ACT_ENV = "QUANTPIPE_CPU_INT4_ACT"
INT4PACK_GROUP_SIZES = (32, 64, 128, 256)
INNER_K_TILES = 2  # int4pack tiling; needs in % (16 * INNER_K_TILES) == 0
# rows from which dequantize-once + bf16 matmul beats int4pack: measured on SmolLM2's shapes,
# one idle core, the crossover is 192-256 rows (int4pack wins at 128 by 3-40%; dequantizing
# wins by 1.3-1.9x at 512-1024 rows); decode (M <= max_num_seqs) always takes int4pack
PREFILL_ROWS = 256


def act_order_permutation(p: PackedLinear) -> torch.Tensor | None:
    """int64 [in] column order that makes groups contiguous, or None if impossible.

    With act-order, ``g_idx`` is a permutation of ``arange(in) // group_size`` when every group
    holds exactly ``group_size`` columns (GPTQ's ``perm // group_size``); sorting the columns by
    group then gives sequential groups and ``x[:, perm] @ W[:, perm].T == x @ W.T``.
    """
    assert p.g_idx is not None
    perm = torch.argsort(p.g_idx.long(), stable=True)  # [in]
    sequential = torch.arange(p.in_features) // p.group_size
    if not torch.equal(p.g_idx.long()[perm], sequential):
        return None
    return perm


@dataclass(frozen=True)
class CpuW4A16:
    """The w4a16_avx512 layout (module docstring); w = (q - 8) * scale + zf."""

    packed: torch.Tensor  # uint8 [out / 16, in / 4, 32]
    scales: torch.Tensor  # fp16 [out / 16, G, 16]
    zf: torch.Tensor | None  # fp32 [out / 16, G, 16] = (8 - z) * scale; None when all z == 8
    perm: torch.Tensor | None  # int64 [in] input column order (act-order), else None
    group_size: int


def pack_int4_blocks(q: torch.Tensor, half: int) -> torch.Tensor:
    """uint8 [out, in] q in [0, 16) -> uint8 [out / 16, in / (2 half), 16 half]: the int4
    layout of both our int4 kernels (``half`` 2: w4a16_avx512, csrc/cpu_ops.cpp; 4: W4A8,
    csrc/common.h).

    Chunk (b, c) covers rows 16 b .. 16 b + 15 and columns 2 half c .. 2 half c + 2 half - 1;
    its byte ``half r + e`` holds q[16 b + r, 2 half c + e] (low nibble) and
    q[16 b + r, 2 half c + half + e] (high nibble).
    """
    out_f, in_f = q.shape
    chunks = in_f // (2 * half)
    v = q.view(out_f // BLOCK_ROWS, BLOCK_ROWS, chunks, 2, half)  # [b, r, c, h, e]
    v = v.permute(0, 2, 1, 4, 3)  # [b, c, r, e, h]
    packed = v[..., 0] | (v[..., 1] << 4)  # [b, c, r, e] uint8
    return packed.reshape(out_f // BLOCK_ROWS, chunks, BLOCK_ROWS * half).contiguous()


def unpack_int4_blocks(packed: torch.Tensor, half: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4_blocks`: uint8 [out / 16, in / (2 half), 16 half] ->
    uint8 [out, in]."""
    nb, chunks, _ = packed.shape
    v = packed.view(nb, chunks, BLOCK_ROWS, half)  # [b, c, r, e]
    q = torch.stack([v & 15, v >> 4], dim=-1)  # [b, c, r, e, h]
    return q.permute(0, 2, 1, 4, 3).reshape(nb * BLOCK_ROWS, chunks * 2 * half)  # [out, in]


def pack_w4a16(q: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in] -> uint8 [out / 16, in / 4, 32], the w4a16_avx512 layout."""
    return pack_int4_blocks(q, 2)


def unpack_w4a16(packed: torch.Tensor) -> torch.Tensor:
    return unpack_int4_blocks(packed, 2)


def _group_ordered_q(p: PackedLinear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(uint8 [out, in] q with the columns in sequential groups, int64 [in] column order or
    None): act-order layers are permuted once here, and the kernels permute x the same way."""
    q = p.unpacked_q()  # [out, in] uint8
    if p.g_idx is None:
        return q, None
    perm = act_order_permutation(p)
    assert perm is not None, "dispatch sends uneven act-order groups to dequant"
    return q[:, perm].contiguous(), perm  # [out, in] columns now in sequential groups


def block_rows(t: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K, 16]: 16 rows side by side per column, the layout of every
    weight, scale and zero-point tensor of quantpipe's CPU kernels (rows zero-padded to 16)."""
    n, k = t.shape
    pad = -n % BLOCK_ROWS
    if pad:
        t = torch.cat([t, t.new_zeros(pad, k)])  # [N + pad, K]
    return t.view(-1, BLOCK_ROWS, k).transpose(1, 2).contiguous()  # [N / 16, K, 16]


def repack_w4a16(p: PackedLinear) -> CpuW4A16:
    q, perm = _group_ordered_q(p)  # uint8 [out, in] in [0, 16)
    zeros = p.zeros_u8()  # [out, G]
    zf = None
    if not bool((zeros == 8).all()):
        # (8 - z) * s: exact in fp32 (an fp16 scale times an integer of magnitude <= 8)
        zf = block_rows((8.0 - zeros.float()) * p.scales.float())  # [out / 16, G, 16] fp32
    return CpuW4A16(pack_w4a16(q.contiguous()), block_rows(p.scales), zf, perm, p.group_size)


def w4a16_matmul(x2d: torch.Tensor, w: CpuW4A16) -> torch.Tensor:
    """x2d [M, in] float -> [M, out] in x's dtype (the kernel rounds x to bf16 itself).

    Called ~200 times per decoded token of a small model: kept to one op call on the fp32 path.
    """
    x = x2d if x2d.dtype in (torch.float32, torch.bfloat16) else x2d.float()
    if w.perm is not None:
        x = x[:, w.perm]  # [M, in] columns in the repacked order
    y = torch.ops.quantpipe_cpu.w4a16_mm.default(x.contiguous(), w.packed, w.scales, w.zf,
                                                w.group_size)  # [M, out] fp32
    return y if x2d.dtype == torch.float32 else y.to(x2d.dtype)


@dataclass(frozen=True)
class CpuW4A8:
    """The W4A8 layout: w = q * scale + mz, activations quantized to int8 per 32 columns."""

    packed: torch.Tensor  # uint8 [out / 16, in / 8, 64] (pack_w4a8)
    scales: torch.Tensor  # fp16 [out / 16, G, 16] (the checkpoint's)
    mz: torch.Tensor | None  # fp32 [out / 16, G, 16] = -z * scale; None: every z is 8
    perm: torch.Tensor | None  # int64 [in] input column order (act-order), else None
    group_size: int
    op: Any  # w4a8_mm of the ISA it was packed for (torch OpOverload)
    vnni: bool  # w4a8_mm's instruction choice (cpu_ext.w4a8_uses_vnni)


def pack_w4a8(q: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in] -> uint8 [out / 16, in / 8, 64], the W4A8 layout."""
    return pack_int4_blocks(q, 4)


def unpack_w4a8(packed: torch.Tensor) -> torch.Tensor:
    return unpack_int4_blocks(packed, 4)


# a load-time repack works on slices of a layer of at most this many elements: its temporaries
# are a few slices, never an unpacked [out, in] copy of the layer (the load's peak is the packed
# model plus these), and each op on a slice below torch's parallel grain (32,768 elements) runs
# on the calling thread, where a parallel op would wait for a second core that may be busy
REPACK_SLICE = 32767


def repack_rows(row_elements: int) -> int:
    """Output rows per repack step: a multiple of 16 of at most REPACK_SLICE elements (16
    rows for layers wider than that)."""
    return max(BLOCK_ROWS, REPACK_SLICE // row_elements // BLOCK_ROWS * BLOCK_ROWS)


def _spread_nibbles_(x: torch.Tensor) -> torch.Tensor:
    """In place: int32 holding nibbles n0..n3 in bits 0..15 -> n0..n3 in nibbles 0, 2, 4, 6
    (bits 0, 8, 16, 24), zeros between."""
    x |= x << 8
    x &= 0x00FF00FF  # n0 n1 in bits 0..7, n2 n3 in bits 16..23
    x |= x << 4
    return x.bitwise_and_(0x0F0F0F0F)  # n0 @ 0, n1 @ 8, n2 @ 16, n3 @ 24


def w4a8_words(qweight: torch.Tensor) -> torch.Tensor:
    """Native words -> W4A8 words, elementwise: int32 [..., in / 8] holding 8 codes each
    (column 8 c + k in bits 4 k .. 4 k + 3, ``qformat.pack_int32``) -> int32 [..., in / 8]
    whose little-endian bytes are pack_w4a8's 4 bytes of those 8 columns: byte e = code e
    (low nibble) | code 4 + e (high nibble)."""
    lo = _spread_nibbles_(qweight & 0xFFFF)  # codes 0..3 -> bytes 0..3, low nibbles
    # codes 4..7 (the arithmetic shift's sign bits masked off) -> high nibbles; the shift into
    # bit 31 wraps to the two's complement pattern of the unsigned word
    hi = _spread_nibbles_((qweight >> 16).bitwise_and_(0xFFFF))
    return lo.bitwise_or_(hi.bitwise_left_shift_(4))


def pack_w4a8_words(qweight: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """int32 [out, in / 8] native 4-bit words -> uint8 [out / 16, in / 8, 64]: bitwise
    ``pack_w4a8(unpack_int32(qweight, 4))``, without an unpacked copy of the layer (``rows``
    output rows at a time, default :func:`repack_rows`).

    Chunk (b, c) of the layout is 16 rows x 4 bytes; read as int32 it is [16], and row r's
    word is ``w4a8_words(qweight[16 b + r, c])``: the layout is the words' shuffle, stacked
    16 rows side by side (block_rows). Little-endian hosts only (x86, arm64)."""
    assert qweight.dtype == torch.int32 and sys.byteorder == "little"
    out_f, words = qweight.shape
    rows = rows or repack_rows(words)
    assert out_f % BLOCK_ROWS == 0 and rows % BLOCK_ROWS == 0, (out_f, rows)
    packed = torch.empty(out_f // BLOCK_ROWS, words, BLOCK_ROWS, dtype=torch.int32)
    for r0 in range(0, out_f, rows):
        w = w4a8_words(qweight[r0:r0 + rows])  # [R, in / 8] int32
        n = w.shape[0] // BLOCK_ROWS
        # [R, in / 8] -> [R / 16, 16, in / 8] -> [R / 16, in / 8, 16]
        packed[r0 // BLOCK_ROWS:r0 // BLOCK_ROWS + n] = w.view(n, BLOCK_ROWS, words).transpose(1, 2)
    return packed.view(torch.uint8)  # [out / 16, in / 8, 64]


def _pack_w4a8_permuted(p: PackedLinear, perm: torch.Tensor) -> torch.Tensor:
    """Act-order: uint8 [out / 16, in / 8, 64] of the codes with columns in ``perm`` order,
    unpacked and packed a slice of output rows at a time (rows of the layout are
    independent)."""
    out_f, in_f = p.out_features, p.in_features
    rows = repack_rows(in_f)  # the unpacked slice: uint8 [rows, in]
    packed = torch.empty(out_f // BLOCK_ROWS, in_f // 8, 64, dtype=torch.uint8)
    for r0 in range(0, out_f, rows):
        q = unpack_int32(p.qweight[r0:r0 + rows], 4, in_f)[:, perm]  # [R, in] uint8
        packed[r0 // BLOCK_ROWS:(r0 + q.shape[0]) // BLOCK_ROWS] = pack_w4a8(q)
    return packed


def repack_w4a8(p: PackedLinear, isa: str | None = None) -> CpuW4A8:
    """``isa``: the build whose ``w4a8_mm`` runs it (default: the active one)."""
    isa = isa or cpu_ext.active_isa()
    perm = None
    if p.g_idx is not None:
        perm = act_order_permutation(p)  # [in] int64: columns in sequential groups
        assert perm is not None, "dispatch sends uneven act-order groups to dequant"
    packed = (pack_w4a8_words(p.qweight) if perm is None  # [out / 16, in / 8, 64] uint8
              else _pack_w4a8_permuted(p, perm))
    scales = p.scales  # [out, G] fp16, the checkpoint's (exact in fp32; half the bytes)
    zeros = p.zeros_u8()
    # -z * s: exact in fp32 (an fp16 scale times an integer of magnitude < 16); a symmetric
    # layer (every z == 8) stores none: the kernel forms -8 * s itself, the same fp32 values
    mz = None if bool((zeros == 8).all()) else block_rows(-zeros.float() * scales.float())
    return CpuW4A8(packed, block_rows(scales), mz, perm,
                   p.group_size, cpu_ext.ops(isa).w4a8_mm.default, cpu_ext.w4a8_uses_vnni(isa))


def w4a8_mz(w: CpuW4A8) -> torch.Tensor:
    """w's fp32 [out / 16, G, 16] -z * scale, formed from the scales when w stores none."""
    return w.mz if w.mz is not None else w.scales.float() * -8.0


def w4a8_matmul(x2d: torch.Tensor, w: CpuW4A8) -> torch.Tensor:
    """x2d [M, in] float -> [M, out] in x's dtype (the kernel quantizes x to int8 itself)."""
    x = x2d if x2d.dtype == torch.float32 else x2d.float()
    if w.perm is not None:
        x = x[:, w.perm]  # [M, in] columns in the repacked order
    y = w.op(x.contiguous(), w.packed, w.scales, w.mz, w.group_size, w.vnni)  # [M, out] fp32
    return y if x2d.dtype == torch.float32 else y.to(x2d.dtype)


def w4a8_stackable(ws: list[CpuW4A8]) -> bool:
    """Whether several W4A8 layers can run as one stacked layer: the same group size, column
    order, ISA and instruction choice."""
    first = ws[0]
    return all(w.group_size == first.group_size and w.op == first.op and w.vnni == first.vnni
               and (w.perm is None) == (first.perm is None)
               and (w.perm is None or torch.equal(w.perm, first.perm)) for w in ws[1:])


def empty_w4a8_stack(ws: list[CpuW4A8]) -> CpuW4A8:
    """Unwritten tensors of the layer stacking ``ws`` (w4a8_stackable): [sum(out) / 16, ...];
    their pages become resident as :func:`copy_w4a8_` writes the parts in."""
    first, nb = ws[0], sum(w.packed.shape[0] for w in ws)
    g = first.scales.shape[1]
    # symmetric parts only: no mz; else each part's, formed where a part stores none
    mz = (None if all(w.mz is None for w in ws)
          else torch.empty(nb, g, BLOCK_ROWS, dtype=torch.float32))  # [sum(out) / 16, G, 16]
    return CpuW4A8(torch.empty(nb, *first.packed.shape[1:], dtype=torch.uint8),  # [.., in/8, 64]
                   torch.empty(nb, g, BLOCK_ROWS, dtype=torch.float16),  # [sum(out) / 16, G, 16]
                   mz, first.perm, first.group_size, first.op, first.vnni)


def w4a8_rows(w: CpuW4A8, start: int, n: int) -> CpuW4A8:
    """Blocks ``start .. start + n`` of w's blocks of 16 output rows, as views into w."""
    mz = None if w.mz is None else w.mz[start:start + n]
    return CpuW4A8(w.packed[start:start + n], w.scales[start:start + n], mz, w.perm,
                   w.group_size, w.op, w.vnni)


def copy_w4a8_(dst: CpuW4A8, src: CpuW4A8) -> None:
    """Write ``src`` into ``dst`` (the same rows' views of a stack; mz formed where src has
    none and dst keeps one)."""
    dst.packed.copy_(src.packed)
    dst.scales.copy_(src.scales)
    if dst.mz is not None:
        dst.mz.copy_(w4a8_mz(src))


def joined_rows(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensor of which ``ts`` are consecutive row slices, in order (views of one storage,
    each starting where the previous one ends), as a view spanning them; else None."""
    first, end = ts[0], ts[0].storage_offset()
    ptr = first.untyped_storage().data_ptr()
    for t in ts:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]
                or t.untyped_storage().data_ptr() != ptr or t.storage_offset() != end):
            return None
        end += t.numel()
    rows = sum(t.shape[0] for t in ts)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def w4a8_joined(ws: list[CpuW4A8]) -> CpuW4A8 | None:
    """The stacked layer when ``ws`` (w4a8_stackable) already are consecutive rows of one
    (a stack made earlier, e.g. by the loader), as views: nothing is copied; else None."""
    packed, scales = joined_rows([w.packed for w in ws]), joined_rows([w.scales for w in ws])
    if packed is None or scales is None:
        return None
    if all(w.mz is None for w in ws):
        mz = None
    elif any(w.mz is None for w in ws) or (mz := joined_rows([w.mz for w in ws])) is None:
        return None
    first = ws[0]
    return CpuW4A8(packed, scales, mz, first.perm, first.group_size, first.op, first.vnni)


def concat_w4a8(ws: list[CpuW4A8]) -> CpuW4A8 | None:
    """One W4A8 layer computing the outputs of several that share their input (q/k/v, or
    gate/up): [out_1 + out_2 + ..., in], blocks of 16 rows stacked; None when they differ in
    group size, column order, ISA or instruction choice."""
    if not w4a8_stackable(ws):
        return None
    fused, start = empty_w4a8_stack(ws), 0
    for w in ws:
        n = w.packed.shape[0]
        copy_w4a8_(w4a8_rows(fused, start, n), w)
        start += n
    return fused


@dataclass(frozen=True)
class CpuInt4Pack:
    packed: torch.Tensor  # uint8 [out, in / 2] int4pack layout
    scales_and_zeros: torch.Tensor  # [G, out, 2] in the activation dtype (bf16)
    perm: torch.Tensor | None  # int64 [in] input column order (act-order), else None
    group_size: int
    out_features: int
    # rows per block of the blob's layout that unpack_int4pack reads exactly (prefill path on);
    # 0: an unknown layout (int4pack at every M)
    block_rows: int = 0

    @property
    def unpackable(self) -> bool:
        return self.block_rows > 0


INT4PACK_BLOCK_ROWS = (64, 32)  # torch's layouts: AVX-512 kernels, AVX2 kernels


def unpack_int4pack(packed: torch.Tensor, out_features: int, block_rows: int) -> torch.Tensor:
    """uint8 [out, in / 2] int4pack blob -> uint8 [out, in] q (layout: module docstring)."""
    n = block_rows
    in_f = packed.numel() * 2 // out_features
    b = packed.view(out_features // n, in_f, n // 2)  # [out / n, in, n / 2]
    q = torch.cat([b & 15, b >> 4], dim=2)  # [out / n, in, n]: rows n b + (0..n-1)
    return q.permute(0, 2, 1).reshape(out_features, in_f)  # [out, in]


def _int4pack_block_rows(packed: torch.Tensor, q_u8: torch.Tensor) -> int:
    """The block of :data:`INT4PACK_BLOCK_ROWS` that reads ``packed`` back as ``q_u8``
    exactly, or 0."""
    out_f, in_f = q_u8.shape
    if tuple(packed.shape) != (out_f, in_f // 2):
        return 0
    return next((n for n in INT4PACK_BLOCK_ROWS
                 if out_f % n == 0 and torch.equal(unpack_int4pack(packed, out_f, n), q_u8)), 0)


def dequantize_int4pack(w: CpuInt4Pack) -> torch.Tensor:
    """bf16 [out, in] = (q - 8) * scale + zero_fp, in the repacked column order."""
    q = unpack_int4pack(w.packed, w.out_features, w.block_rows)  # [out, in] uint8
    out_f, in_f = q.shape
    sz = w.scales_and_zeros.float()  # [G, out, 2]
    scale = sz[..., 0].T.unsqueeze(-1)  # [out, G, 1]
    zero_fp = sz[..., 1].T.unsqueeze(-1)  # [out, G, 1]
    wg = (q.view(out_f, in_f // w.group_size, w.group_size).float() - 8.0) * scale + zero_fp
    return wg.view(out_f, in_f).to(torch.bfloat16)  # [out, in]


def repack_int4pack(p: PackedLinear, act_dtype: torch.dtype = torch.bfloat16) -> CpuInt4Pack:
    """``act_dtype`` (bf16 fast; fp32 exact but slow, used by tests to check the packing)."""
    q, perm = _group_ordered_q(p)
    q = q.to(torch.int32)  # [out, in] int32 in [0, 16), groups sequential
    scales = p.scales.float()  # [out, G]
    zeros = p.zeros_u8().float()  # [out, G]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES)
    # integer zero z -> float zero point (8 - z) * s: exact in fp32 (fp16 s times an int < 16)
    zero_fp = (8.0 - zeros) * scales  # [out, G]
    sz = torch.stack([scales, zero_fp], dim=-1)  # [out, G, 2]
    sz = sz.transpose(0, 1).contiguous().to(act_dtype)  # [G, out, 2] act_dtype
    block_rows = _int4pack_block_rows(packed, q.to(torch.uint8))
    return CpuInt4Pack(packed, sz, perm, p.group_size, p.out_features, block_rows)


def int4pack_matmul(x2d: torch.Tensor, w: CpuInt4Pack) -> torch.Tensor:
    """x2d [M, in] any float -> [M, out] in x's dtype (activations cast to the sz dtype)."""
    xb = x2d.to(w.scales_and_zeros.dtype)
    if w.perm is not None:
        xb = xb[:, w.perm]  # [M, in] columns in the repacked order
    if w.unpackable and xb.shape[0] >= PREFILL_ROWS and xb.dtype == torch.bfloat16:
        # prefill: one dequantized bf16 temporary [out, in], freed on return
        y = torch.nn.functional.linear(xb, dequantize_int4pack(w))  # [M, out]
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb.contiguous(), w.packed, w.group_size,
                                                       w.scales_and_zeros)  # [M, out]
    return y.to(x2d.dtype)


@dataclass(frozen=True)
class CpuW8A32:
    """The w8a32_avx512 layout: w = (q - 128) * scale + zf (module docstring)."""

    q8: torch.Tensor  # int8 [out / 16, in, 16] = q - 128
    scales: torch.Tensor  # fp16 [out / 16, G, 16]
    zf: torch.Tensor | None  # fp32 [out / 16, G, 16] = (128 - z) * scale; None when all z == 128
    perm: torch.Tensor | None  # int64 [in] input column order (act-order), else None
    group_size: int
    op: Any = None  # the w8a32_mm op of the ISA it was packed for (torch OpOverload)


def repack_w8a32(p: PackedLinear, isa: str | None = None) -> CpuW8A32:
    """``isa``: the build whose ``w8a32_mm`` runs it (default: the active one)."""
    q, perm = _group_ordered_q(p)  # uint8 [out, in]
    q8 = (q.to(torch.int16) - 128).to(torch.int8)  # [out, in], exact
    q8 = block_rows(q8)  # [out / 16, in, 16]
    zeros = p.zeros_u8()  # [out, G]
    zf = None
    if not bool((zeros == 128).all()):
        # (128 - z) * s: exact in fp32 (an fp16 scale times an integer of magnitude <= 128)
        zf = block_rows((128.0 - zeros.float()) * p.scales.float())
    op = cpu_ext.ops(isa).w8a32_mm.default
    return CpuW8A32(q8, block_rows(p.scales), zf, perm, p.group_size, op)


def w8a32_matmul(x2d: torch.Tensor, w: CpuW8A32) -> torch.Tensor:
    """x2d [M, in] float -> [M, out] in x's dtype (fp32 activations, exact int8 weights)."""
    x = x2d if x2d.dtype == torch.float32 else x2d.float()
    if w.perm is not None:
        x = x[:, w.perm]  # [M, in] columns in the repacked order
    y = w.op(x.contiguous(), w.q8, w.scales, w.zf, w.group_size)  # [M, out] fp32
    return y if x2d.dtype == torch.float32 else y.to(x2d.dtype)


@dataclass(frozen=True)
class CpuInt8Pack:
    q_int8: torch.Tensor  # int8 [out, in] = q - 128
    scales: torch.Tensor  # bf16 [out]


def repack_int8pack(p: PackedLinear) -> CpuInt8Pack:
    q8 = (p.unpacked_q().to(torch.int16) - 128).to(torch.int8)  # [out, in] exact
    return CpuInt8Pack(q8.contiguous(), p.scales[:, 0].to(torch.bfloat16).contiguous())


def int8pack_matmul(x2d: torch.Tensor, w: CpuInt8Pack) -> torch.Tensor:
    """x2d [M, in] -> [M, out] (bf16 activations and scales: int8pack needs them equal)."""
    y = torch.ops.aten._weight_int8pack_mm(x2d.to(torch.bfloat16).contiguous(), w.q_int8,
                                           w.scales)  # [M, out] bf16
    return y.to(x2d.dtype)


@dataclass(frozen=True)
class Unpacked:
    """The fallback keeps q unpacked (uint8, 2 values per byte of int4 wasted) for speed."""

    q: torch.Tensor  # uint8 [out, in]
    scales: torch.Tensor  # fp16 [out, G]
    zeros: torch.Tensor  # uint8 [out, G]
    g_idx: torch.Tensor  # int64 [in]


def repack_unpacked(p: PackedLinear, device) -> Unpacked:
    return Unpacked(p.unpacked_q().to(device), p.scales.to(device), p.zeros_u8().to(device),
                    p.group_index().to(device))


def dequant_matmul(x2d: torch.Tensor, w: Unpacked) -> torch.Tensor:
    """Correct for every layout: W = (q - z) * s in fp32 (as qformat.dequantize), then matmul.

    W is a temporary of this call only; nothing dequantized is kept between calls.
    """
    s = w.scales.float()[:, w.g_idx]  # [out, in]
    z = w.zeros.float()[:, w.g_idx]  # [out, in]
    weight = ((w.q.float() - z) * s).to(x2d.dtype)  # [out, in]
    return x2d @ weight.T  # [M, in] @ [in, out] -> [M, out]


# ---- the CPU backends and the choice between them -------------------------------------------


def _unfit(p: PackedLinear, bits: int, gs_multiple: int, out_multiple: int = BLOCK_ROWS,
           group_sizes: tuple[int, ...] | None = None) -> str | None:
    """Why a kernel for ``bits``-bit layers with the group size a multiple of ``gs_multiple``
    (or one of ``group_sizes``) and ``out % out_multiple == 0`` cannot take ``p``, or None."""
    gs, out_f = p.group_size, p.out_features
    if p.spec.bits != bits:
        return f"{bits}-bit layers only, not {p.spec.bits}-bit"
    if group_sizes is not None and gs not in group_sizes:
        return f"group sizes {group_sizes} only, not {gs}"
    if gs % gs_multiple or out_f % out_multiple:
        return (f"needs out % {out_multiple} == 0 and group size % {gs_multiple} == 0 "
                f"(out {out_f}, group size {gs})")
    if p.g_idx is not None and act_order_permutation(p) is None:
        return "act-order g_idx with unequal groups cannot be made sequential"
    return None


def _build_available(isa: str):
    """Our ``isa`` build: kernels not turned off, the CPU runs it, and it compiles."""
    def available() -> tuple[bool, str]:
        usable, why = cpu_ext.kernel_status()
        if not usable:
            return False, why
        if not cpu_ext.cpu_can_run(isa):
            return False, f"the CPU cannot run the {isa} build"
        return cpu_ext.build_status(isa)
    return available


def _int4pack_unfit(p: PackedLinear) -> str | None:
    unfit = _unfit(p, 4, 1, group_sizes=INT4PACK_GROUP_SIZES)
    if unfit is None and p.in_features % (16 * INNER_K_TILES):
        return f"int4pack needs in % {16 * INNER_K_TILES} == 0, not {p.in_features}"
    return f"int4pack: {unfit}" if unfit else None


def _int8pack_unfit(p: PackedLinear) -> str | None:
    if p.spec.bits != 8:
        return f"int8pack: 8-bit layers only, not {p.spec.bits}-bit"
    if p.qzeros is not None:
        return "int8pack is symmetric only"
    if p.group_size != p.in_features:
        return "int8pack is per-channel only"
    return None


def _ours(kind: str, isa: str, repack, matmul, bits: int, gs_multiple: int) -> Backend:
    return Backend(f"{kind}_{isa}", "cpu", repack, matmul,
                   lambda p: _unfit(p, bits, gs_multiple), _build_available(isa))


def _w4a8_repack(isa: str):
    return lambda p, device: repack_w4a8(p, isa)


def _w8a32_repack(isa: str):
    return lambda p, device: repack_w8a32(p, isa)


# quantpipe's C++ kernels, per (kind, ISA build): the module docstring's table
OURS: dict[tuple[str, str], Backend] = {
    ("w4a8", "avx512"): _ours("w4a8", "avx512", _w4a8_repack("avx512"), w4a8_matmul, 4,
                              A8_BLOCK),
    ("w4a8", "avx2"): _ours("w4a8", "avx2", _w4a8_repack("avx2"), w4a8_matmul, 4, A8_BLOCK),
    ("w4a16", "avx512"): _ours("w4a16", "avx512", lambda p, device: repack_w4a16(p),
                               w4a16_matmul, 4, BLOCK_ROWS),
    ("w8a32", "avx512"): _ours("w8a32", "avx512", _w8a32_repack("avx512"), w8a32_matmul, 8,
                               BLOCK_ROWS),
    ("w8a32", "avx2"): _ours("w8a32", "avx2", _w8a32_repack("avx2"), w8a32_matmul, 8,
                             BLOCK_ROWS),
}
# torch's kernels, the peers of ours when ours cannot run
INT4PACK = Backend("int4pack", "cpu", lambda p, device: repack_int4pack(p), int4pack_matmul,
                   _int4pack_unfit)
INT8PACK = Backend("int8pack", "cpu", lambda p, device: repack_int8pack(p), int8pack_matmul,
                   _int8pack_unfit)
TORCH_PEER = {4: INT4PACK, 8: INT8PACK}
# any layout on any device: dequantize per call
DEQUANT = Backend("dequant", None, repack_unpacked, dequant_matmul, lambda p: None)
CPU_BACKENDS: tuple[Backend, ...] = (*OURS.values(), INT4PACK, INT8PACK, DEQUANT)


def _int4_act() -> str:
    """int8 (W4A8, the default) or bf16 (W4A16: AVX-512 only) activations for 4-bit layers."""
    act = os.environ.get(INT4_ACT_ENV, "int8").strip().lower() or "int8"
    if act not in ("int8", "bf16"):
        raise ValueError(f"{INT4_ACT_ENV}={os.environ[INT4_ACT_ENV]!r}: use int8 (W4A8, "
                         "default) or bf16 (W4A16, AVX-512 hosts)")
    return act


def _quantpipe_backend(p: PackedLinear) -> tuple[Backend | None, str]:
    """(the kernel of ours for this layer or None, reason); groups can be made sequential."""
    bits, gs, out_f = p.spec.bits, p.group_size, p.out_features
    if gs % BLOCK_ROWS or out_f % BLOCK_ROWS:
        return None, f"quantpipe's kernels need out and group size % {BLOCK_ROWS} == 0"
    usable, why = cpu_ext.kernel_status()
    if not usable:
        return None, why
    isa = cpu_ext.active_isa()
    if bits == 8:
        return OURS[("w8a32", isa)], why
    a8_ok, act = gs % A8_BLOCK == 0, _int4_act()  # the setting is checked on every ISA
    if isa == "avx512" and (act == "bf16" or not a8_ok):
        return OURS[("w4a16", isa)], why + ("" if a8_ok else
                                           f" (W4A16: group size {gs} % {A8_BLOCK})")
    if a8_ok:
        vnni = cpu_ext.w4a8_uses_vnni(isa)
        return OURS[("w4a8", isa)], f"{why}, W4A8{' VNNI' if vnni else ''}"
    return None, f"{why}: W4A8 needs group size % {A8_BLOCK} == 0, not {gs}"


def cpu_backend_for(p: PackedLinear) -> tuple[str, str]:
    """(backend name, reason) for one layer on CPU: ours (by ISA build and activation
    setting), else torch's peer for the width, else dequant with the peer's reason."""
    if p.spec.bits not in TORCH_PEER:
        raise ValueError(f"bits={p.spec.bits} has no CPU kernel; use 4 or 8")
    if p.g_idx is not None and act_order_permutation(p) is None:
        return DEQUANT.name, "act-order g_idx with unequal groups cannot be made sequential"
    ours, why = _quantpipe_backend(p)
    if ours is not None:
        return ours.name, why
    peer = TORCH_PEER[p.spec.bits]
    unfit = peer.unfit(p)
    if unfit is not None:
        return DEQUANT.name, f"{unfit} ({why})"
    return peer.name, f"torch {peer.name} ({why})"

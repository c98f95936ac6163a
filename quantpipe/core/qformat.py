"""Quantization specs, integer grids and bit packing shared by every stage.

The one numeric convention used everywhere in quantpipe (calibration, exports, runtime):

    w_hat[o, i] = (q[o, i] - zero[o, g]) * scale[o, g]      with g = g_idx[i]

- ``q`` is an *unsigned* integer in ``[0, 2**bits - 1]``.
- Symmetric specs use the fixed mid-point zero ``2**(bits - 1)`` (8 for INT4, 128 for INT8) and
  ``scale = absmax / ((2**bits - 1) / 2)``: the grid used by GPTQ and compressed-tensors.
- Asymmetric specs store an integer zero per group, ``scale = (max - min) / (2**bits - 1)``.
- ``scale`` is stored in fp16 and ``q`` is always computed against the fp16-rounded scale, so the
  stored tensors dequantize to exactly the weights that calibration evaluated.
- ``g_idx[i]`` is the group of input column ``i``; without act-order it is ``i // group_size``.

Packing (native format and compressed-tensors ``pack-quantized``): ``32 // bits`` values per
int32 along the input dimension, least significant bits first. INT5 and INT6 (menu entries of
the native format only) are stored as bit planes in the same ``[..., in * bits / 32]`` words:
first the low four bits of every value packed as INT4, then the top ``bits - 4`` bits packed
as ``bits - 4``-bit values (32 or 16 per word), so a layer takes exactly ``bits`` per weight
and its low plane is an INT4 layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

VALID_BITS = (4, 8)  # uniform checkpoints (``--bits``) and every format
SPEC_BITS = (4, 5, 6, 8)  # a layer's spec: 5 and 6 are menu entries of the native format
_PLANE_BITS = (5, 6)  # stored as an INT4 plane + a (bits - 4)-bit plane


def check_bits(bits: int, name: str = "bits=", allowed: tuple[int, ...] = VALID_BITS) -> None:
    """Raise the one error every stage gives for an unsupported bit width (``name`` is how the
    user wrote it: ``--bits `` on the command line, ``bits=`` in a spec)."""
    if bits not in allowed:
        raise ValueError(f"{name}{bits} is not supported; use one of {allowed}")


def column_multiple(bits: int) -> int:
    """Input columns one packed int32 word set holds whole: a layer's ``in_features`` must be
    a multiple of it (8 for INT4, 4 for INT8, 32 for INT5's 1-bit plane, 16 for INT6's)."""
    return 32 // (bits - 4) if bits in _PLANE_BITS else 32 // bits


def packed_words(in_features: int, bits: int) -> int:
    """int32 words one row of ``in_features`` ``bits``-bit values packs into."""
    return in_features * bits // 32


@dataclass(frozen=True)
class QuantSpec:
    """How one linear layer's weight is quantized."""

    bits: int  # 4 or 8 (5 and 6: native-format menu entries)
    group_size: int  # input columns sharing one scale; -1 = one group per output row
    sym: bool  # True: fixed mid-point zero; False: a stored zero per group
    act_order: bool = False  # GPTQ columns processed by decreasing Hessian diagonal (uses g_idx)

    def __post_init__(self) -> None:
        check_bits(self.bits, allowed=SPEC_BITS)
        if self.group_size != -1 and not (self.group_size > 0 and self.group_size % 8 == 0):
            raise ValueError(f"group_size={self.group_size} is not supported: a stored group "
                             "spans a multiple of 8 input columns (one packed int32), or -1 "
                             "(per output channel)")

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1

    @property
    def sym_zero(self) -> int:
        return 2 ** (self.bits - 1)

    def group_size_for(self, in_features: int) -> int:
        """The group size actually used for a layer (``in_features`` for -1)."""
        return in_features if self.group_size == -1 else self.group_size

    def n_groups(self, in_features: int) -> int:
        gs = self.group_size_for(in_features)
        assert in_features % gs == 0, (in_features, gs)
        return in_features // gs

    def with_group_size(self, group_size: int) -> "QuantSpec":
        return QuantSpec(self.bits, group_size, self.sym, self.act_order)

    def to_dict(self) -> dict:
        return {
            "bits": self.bits,
            "group_size": self.group_size,
            "sym": self.sym,
            "act_order": self.act_order,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "QuantSpec":
        return cls(int(d["bits"]), int(d["group_size"]), bool(d["sym"]), bool(d.get("act_order")))

    def label(self) -> str:
        g = "pc" if self.group_size == -1 else f"g{self.group_size}"
        return f"w{self.bits}{g}{'' if self.sym else '-asym'}{'-act' if self.act_order else ''}"


INT8_PER_CHANNEL = QuantSpec(bits=8, group_size=-1, sym=True)


def resolve_group_size(requested: int, in_features: int, strict: bool = False) -> int:
    """Largest usable group size <= ``requested`` that divides ``in_features``.

    Fast kernels (ours, vLLM's Marlin) need ``in_features % group_size == 0``; SmolLM2's hidden
    size 576 = 4.5 x 128, so a request for 128 becomes 64 on those layers.
    """
    if requested == -1 or in_features % requested == 0:
        return requested
    if strict:
        raise ValueError(
            f"group_size {requested} does not divide in_features {in_features}; "
            f"use a divisor such as {_divisors_hint(in_features)} or drop --strict-group-size"
        )
    for gs in (64, 32, 16, 8):
        if gs < requested and in_features % gs == 0:
            return gs
    return -1


def _divisors_hint(in_features: int) -> str:
    ok = [str(g) for g in (32, 64, 128) if in_features % g == 0] + ["-1"]
    return ", ".join(ok)


@dataclass
class QuantizedWeight:
    """One quantized linear weight, unpacked (what algorithms return and exports consume)."""

    spec: QuantSpec  # the spec with the group size actually used for this layer
    q: torch.Tensor  # uint8 [out, in], values in [0, 2**bits - 1]
    scales: torch.Tensor  # fp16 [out, n_groups]
    zeros: torch.Tensor  # uint8 [out, n_groups]; sym specs hold the mid-point
    g_idx: torch.Tensor | None = None  # int32 [in]; None = sequential groups (i // group_size)

    def __post_init__(self) -> None:
        out_f, in_f = self.q.shape
        n_groups = self.spec.n_groups(in_f)
        assert self.q.dtype == torch.uint8, self.q.dtype
        assert self.scales.shape == (out_f, n_groups) and self.scales.dtype == torch.float16
        assert self.zeros.shape == (out_f, n_groups) and self.zeros.dtype == torch.uint8
        if self.g_idx is not None:
            assert self.g_idx.shape == (in_f,) and self.g_idx.dtype == torch.int32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def group_index(self) -> torch.Tensor:
        return group_index(self.spec, self.q.shape[1], self.g_idx)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.q, self.scales, self.zeros, self.group_index(), dtype)


class LazyWeights(Mapping):
    """Quantized weights read one at a time by ``load(name)``; each layer's spec and shape are
    known without reading it, so writers plan a checkpoint and then stream it layer by layer."""

    def __init__(self, specs: dict[str, QuantSpec], shapes: dict[str, tuple[int, int]],
                 load: Callable[[str], QuantizedWeight]) -> None:
        assert specs.keys() == shapes.keys()
        self.specs, self.shapes, self._load = specs, shapes, load

    def __getitem__(self, name: str) -> QuantizedWeight:
        if name not in self.specs:
            raise KeyError(name)
        return self._load(name)

    def __contains__(self, name: object) -> bool:
        return name in self.specs  # Mapping's default would read and unpack the layer

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)


def weight_spec(weights: Mapping[str, QuantizedWeight], name: str) -> QuantSpec:
    """``weights[name].spec`` without unpacking the layer when ``weights`` is lazy."""
    return weights.specs[name] if isinstance(weights, LazyWeights) else weights[name].spec


def weight_shape(weights: Mapping[str, QuantizedWeight], name: str) -> tuple[int, int]:
    """``weights[name].shape`` ([out, in]) without unpacking the layer when ``weights`` is lazy."""
    return weights.shapes[name] if isinstance(weights, LazyWeights) else weights[name].shape


def group_index(spec: QuantSpec, in_features: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    """int64 [in]: the group of every input column."""
    if g_idx is not None:
        return g_idx.long()
    return torch.arange(in_features) // spec.group_size_for(in_features)


DEQUANT_ROWS = 512  # output rows dequantized at a time


def dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    g_idx: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Reference dequantization.

    q: [out, in] uint8, scales: [out, G] fp16, zeros: [out, G] uint8, g_idx: [in] -> W [out, in]
    Computed in fp32 then cast, so every consumer that follows the same order agrees exactly.
    Elementwise, a block of ``DEQUANT_ROWS`` rows at a time: the fp32 temporaries (codes,
    expanded scales and zeros) are a block's, not four more copies of the layer (about 0.9 GB
    for a 7B MLP projection, which set the peak of streamed stages).
    """
    g = g_idx.long()
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    for r in range(0, q.shape[0], DEQUANT_ROWS):
        rows = slice(r, r + DEQUANT_ROWS)
        s = scales[rows].float()[:, g]  # [rows, in]
        z = zeros[rows].float()[:, g]  # [rows, in]
        out[rows] = ((q[rows].float() - z) * s).to(dtype)
    return out


def pack_int32(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned values along the last dim, LSB first (INT5 / INT6: two bit planes, see
    the module docstring).

    q: [..., in] uint8 with values < 2**bits -> [..., in * bits // 32] int32
    """
    if bits in _PLANE_BITS:  # each plane's pack checks its values (so q < 2**bits)
        return torch.cat([_pack_words(q & 15, 4), _pack_words(q >> 4, bits - 4)], dim=-1)
    return _pack_words(q, bits)


def _pack_words(q: torch.Tensor, bits: int) -> torch.Tensor:
    """``32 // bits`` values per word (bits divides 32)."""
    per_word = 32 // bits
    assert q.shape[-1] % per_word == 0, f"last dim {q.shape[-1]} not a multiple of {per_word}"
    assert int(q.max()) < 2**bits if q.numel() else True
    v = q.reshape(*q.shape[:-1], q.shape[-1] // per_word, per_word)  # [..., words, per_word]
    # one slot at a time in int32: a shift into the sign bit gives the two's complement
    # pattern of the unsigned word, and the temporaries stay one word array (never int64 of
    # the whole layer)
    words = v[..., 0].to(torch.int32)
    for i in range(1, per_word):
        words |= v[..., i].to(torch.int32) << (i * bits)
    return words


def unpack_int32(packed: torch.Tensor, bits: int, n: int | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: [..., in * bits // 32] int32 -> [..., in] uint8."""
    if bits in _PLANE_BITS:
        low_words = packed.shape[-1] * 4 // bits  # in / 8 words of low nibbles first
        low = _unpack_words(packed[..., :low_words], 4)
        low |= _unpack_words(packed[..., low_words:], bits - 4) << 4
        return low if n is None else low[..., :n]
    return _unpack_words(packed, bits, n)


def _unpack_words(packed: torch.Tensor, bits: int, n: int | None = None) -> torch.Tensor:
    per_word = 32 // bits
    mask = 2**bits - 1
    p = packed.to(torch.int32)
    v = torch.empty(*packed.shape, per_word, dtype=torch.uint8,
                    device=packed.device)  # [..., words, per_word]
    for i in range(per_word):
        # an arithmetic shift fills the top with the sign bit; the mask drops it
        v[..., i] = (p >> (i * bits)) & mask
    v = v.reshape(*packed.shape[:-1], packed.shape[-1] * per_word)
    if n is not None:
        v = v[..., :n]
    return v

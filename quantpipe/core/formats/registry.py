"""The checkpoint formats quantpipe writes and reads: one line per format.

A new format is one module of this package defining ``FORMAT = CheckpointFormat(...)``
(:mod:`quantpipe.core.formats.base`) plus one entry below; the exporter, the verifier, the
loaders and the CLI's ``--format`` choices all read this dict.
"""

from __future__ import annotations

from collections.abc import Mapping

from quantpipe.core.formats import compressed_tensors, gptq, native
from quantpipe.core.formats.base import CheckpointFormat, stored_bits
from quantpipe.core.qformat import QuantSpec

FP16_BITS = 16  # a linear the plan keeps in FP16 (or BF16)

# --format name -> format, in the order the CLI lists them (the first is the default)
FORMATS: dict[str, CheckpointFormat] = {
    native.FORMAT.name: native.FORMAT,
    gptq.FORMAT.name: gptq.FORMAT,
    compressed_tensors.FORMAT.name: compressed_tensors.FORMAT,
}
FORMAT_NAMES: tuple[str, ...] = tuple(FORMATS)
# config.json quantization_config.quant_method -> format
FORMAT_OF_METHOD: dict[str, CheckpointFormat] = {f.quant_method: f for f in FORMATS.values()}
assert len(FORMAT_OF_METHOD) == len(FORMATS), "two formats claim the same quant_method"


def format_named(name: str) -> CheckpointFormat:
    """The format called ``name``; ValueError listing the known names otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"format {name!r} is not supported; use one of {FORMAT_NAMES}") from None


def layer_bits(spec: QuantSpec | None, shape: tuple[int, int], fmt: str) -> int:
    """Bits one linear ``[out, in]`` takes in format ``fmt``: every tensor the format writes
    for it (:attr:`CheckpointFormat.layout`: codes, scales, zeros, g_idx, ...); ``spec`` None
    (kept FP16) counts 16 per weight. docs/formats.md states the convention per format."""
    out_f, in_f = shape
    if spec is None:
        return FP16_BITS * out_f * in_f
    return stored_bits(format_named(fmt).layout("w", spec, (out_f, in_f)))


def bits_per_weight(spec: QuantSpec | None, shape: tuple[int, int], fmt: str) -> float:
    """Stored bits per weight of one linear in format ``fmt`` (:func:`layer_bits`)."""
    return layer_bits(spec, shape, fmt) / (shape[0] * shape[1])


def average_bits(specs: Mapping[str, QuantSpec | None], shapes: Mapping[str, tuple[int, int]],
                 fmt: str) -> float:
    """Bits per weight over the linears of a plan (FP16-kept ones at 16), weighted by size:
    what export, plan, verify and the report print."""
    params = sum(o * i for o, i in shapes.values())
    return sum(layer_bits(specs[n], s, fmt) for n, s in shapes.items()) / max(params, 1)

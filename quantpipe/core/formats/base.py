"""What one checkpoint format provides (:class:`CheckpointFormat`), and the per-layer types its
writer and reader share with the exporter and the verifier.

A format is one module of this package that defines ``FORMAT = CheckpointFormat(...)``, plus one
line in :data:`quantpipe.core.formats.registry.FORMATS`. Everything format-specific goes through
the fields below; nothing else in quantpipe branches on a format's name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantpipe.core.qformat import QuantizedWeight, QuantSpec

# (shape, dtypes allowed) of every tensor a layer must have; shape entries are ints
Expected = dict[str, tuple[tuple[int, ...], tuple[torch.dtype, ...]]]


@dataclass
class UnpackedLayer:
    """One linear's tensors after unpacking, before the value checks of ``verify``.

    Zeros are kept as int32 so that an out-of-range stored zero (e.g. a GPTQ v1 nibble 15,
    i.e. zero 16 for INT4) can be reported instead of silently wrapping in uint8.
    """

    q: torch.Tensor  # uint8 [out, in], values in [0, 2**bits - 1]
    scales: torch.Tensor  # fp16 [out, G]
    zeros: torch.Tensor  # int32 [out, G], unsigned convention (sym: 2**(bits-1))
    g_idx: torch.Tensor | None  # int32 [in] or None (sequential groups)


@dataclass(frozen=True)
class StoredLayer:
    """One quantized linear as its format stores it (what the verifier checks, then unpacks)."""

    name: str  # the linear's module name, e.g. "model.layers.0.self_attn.q_proj"
    spec: QuantSpec  # read from config.json (group size actually used)
    expected: Expected  # stored tensor name -> (shape, dtypes) it must have
    roles: dict[str, str | None]  # "scales" / "zeros" / "g_idx" -> stored tensor name or None


@dataclass(frozen=True)
class FolderToWrite:
    """Everything a format's writer needs; the FP16 source has been checked already."""

    out: Path  # the quantized folder (QDIR), written atomically
    config: dict  # the model's config.json, without quantization_config
    state: Mapping[str, torch.Tensor]  # FP tensors in order; quantized ".weight"s are replaced
    weights: Mapping[str, QuantizedWeight]  # linear name -> quantized weight (may be lazy)
    side_dir: Path  # folder whose tokenizer and generation files are copied
    manifest_fields: dict  # extra quantpipe.json fields (source_fp16, calibration, plan, ...)
    max_shard_size: str = "2GB"
    force: bool = False  # replace a non-empty ``out``
    # input embedding tables stored quantized (``export --vocab-weights``): module name (e.g.
    # "model.embed_tokens") -> [vocab, hidden] weight; only formats whose ``vocab_support``
    # says ``embedding`` get any (a quantized untied head is one more entry of ``weights``)
    embeddings: Mapping[str, QuantizedWeight] = field(default_factory=dict)


@dataclass(frozen=True)
class VocabSupport:
    """Which vocabulary tables (quantpipe.core.vocab) a format stores quantized for a model
    whose head is tied or not, such that the loaders that read the format run them."""

    embedding: bool  # the input embedding table (a tied head with it: stored once)
    head: bool  # the output head: an untied one as a quantized linear named lm_head
    why: str = ""  # one line: why a table stays FP16 here ("" when both are quantized)


def vocab_fp16_only(tied: bool) -> VocabSupport:
    """The default of :attr:`CheckpointFormat.vocab_support`: both tables stay FP16."""
    return VocabSupport(False, False, "this format stores no quantized vocabulary tables")


# quantization_config -> (plan, stored layers), appending every problem found to the list
ReadLayers = Callable[[dict, Mapping[str, torch.Tensor], list[str]],
                      tuple[dict[str, QuantSpec], list[StoredLayer]]]
# (stored layer, tensors, quantization_config) -> the layer in quantpipe's convention
Unpack = Callable[[StoredLayer, Mapping[str, torch.Tensor], dict], UnpackedLayer]
# (layer name, spec, [out, in]) -> every tensor the format writes for that layer
Layout = Callable[[str, QuantSpec, tuple[int, int]], Expected]
# quantization_config -> the quantized embedding tables stored (verified like layers)
ReadEmbeddings = Callable[[dict, Mapping[str, torch.Tensor], list[str]], list[StoredLayer]]


def no_embeddings(qcfg: dict, tensors: Mapping[str, torch.Tensor],
                  problems: list[str]) -> list[StoredLayer]:
    """The default of :attr:`CheckpointFormat.read_embeddings`: none stored."""
    return []


def stored_bits(tensors: Expected) -> int:
    """Bits the tensors take on disk: codes, scales, zeros, g_idx and whatever else a format
    stores per layer. An entry's first dtype is the one quantpipe writes.

    The one count of bits per weight (export, plan, verify and the report all go through it:
    :func:`quantpipe.core.formats.registry.bits_per_weight`)."""
    total = 0
    for shape, dtypes in tensors.values():
        n = 1
        for d in shape:
            n *= d
        total += n * dtypes[0].itemsize * 8
    return total


def no_manifest_checks(manifest: dict, qcfg: dict) -> list[str]:
    """The default of :attr:`CheckpointFormat.manifest_problems`: nothing format-specific."""
    return []


@dataclass(frozen=True)
class CheckpointFormat:
    """One on-disk layout quantpipe writes (``quantpipe export --format``) and reads."""

    name: str  # --format value and quantpipe.json "checkpoint_format"
    quant_method: str  # config.json quantization_config.quant_method that identifies it
    # write the folder (config.json, side files, shards, manifest last); returns the manifest.
    # Keyword options are the format's own (e.g. GPTQ's checkpoint_format="auto").
    write: Callable[..., dict]
    read_layers: ReadLayers  # the plan and each layer's expected tensors (verify, step 2)
    unpack: Unpack  # one verified layer -> UnpackedLayer
    layout: Layout  # what ``write`` stores for one layer (the bits-per-weight count reads it)
    # problems between quantpipe.json and config.json beyond the plan (verify, step 1)
    manifest_problems: Callable[[dict, dict], list[str]] = field(default=no_manifest_checks)
    # tied -> which vocabulary tables ``write`` stores quantized (``export --vocab-weights``)
    vocab_support: Callable[[bool], VocabSupport] = field(default=vocab_fp16_only)
    # the quantized embedding tables of a folder (verify, step 2; loaders)
    read_embeddings: ReadEmbeddings = field(default=no_embeddings)

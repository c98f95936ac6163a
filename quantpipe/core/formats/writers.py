"""Write a quantized checkpoint in any registered format from an FP16 folder and quantized
weights, and convert an existing quantized folder to another format."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from quantpipe.core.formats.base import CheckpointFormat, FolderToWrite
from quantpipe.core.formats.common import load_fp16_source, source_fp16_entry
from quantpipe.core.formats.registry import average_bits, bits_per_weight, format_named
from quantpipe.core.io import check_not_overlapping
from quantpipe.core.qformat import QuantizedWeight, QuantSpec
from quantpipe.core.vocab import vocab_tables

# manifest keys that belong to the folder being written, never copied from a converted source
_OWN_KEYS = {"format", "version", "stage", "checkpoint_format", "native_format_version",
             "gptq_checkpoint_format", "shards", "files", "packages", "layers", "embeddings"}


def write_checkpoint(
    fmt: str,
    out: str | Path,
    fp16_dir: str | Path,
    weights: Mapping[str, QuantizedWeight],
    fp_overrides: Mapping[str, torch.Tensor] | None = None,
    manifest_fields: dict | None = None,
    max_shard_size: str = "2GB",
    force: bool = False,
    fp16_shards: list[dict] | None = None,
    recorded_by: str = "",
    embeddings: Mapping[str, QuantizedWeight] | None = None,
    **options,
) -> dict:
    """Write ``weights`` over the FP16 folder's tensors as a ``fmt`` checkpoint (a name of
    :data:`~quantpipe.core.formats.registry.FORMATS`); returns the manifest.

    ``weights``: linear name (no ``.weight``) -> its quantized weight (a lazy
    :class:`~quantpipe.core.qformat.LazyWeights` is read one layer at a time). ``fp_overrides``:
    FP tensors that replace the FP16 folder's (e.g. AWQ-scaled norms and kept-FP16 linears).
    ``fp16_shards``/``recorded_by``: the FP16 hashes to check
    (:func:`quantpipe.core.formats.common.load_fp16_source`). ``embeddings``: quantized input
    embedding tables (``export --vocab-weights``; a quantized untied head is an entry of
    ``weights``), for formats whose ``vocab_support`` stores them. ``options``: the format's
    own (GPTQ: ``checkpoint_format="auto" | "gptq" | "gptq_v2"``).
    """
    checkpoint_format = format_named(fmt)
    check_not_overlapping(out, {"FP16_DIR": fp16_dir})
    config, state, fp16_manifest, weights = load_fp16_source(fp16_dir, weights, fp_overrides,
                                                             fp16_shards, recorded_by)
    fields = {"source_fp16": source_fp16_entry(fp16_dir, fp16_manifest), **(manifest_fields or {})}
    _check_embeddings(checkpoint_format, config, embeddings or {})
    job = FolderToWrite(Path(out), config, state, weights, Path(fp16_dir), fields,
                        max_shard_size, force, dict(embeddings or {}))
    return checkpoint_format.write(job, **options)


def _check_embeddings(fmt: CheckpointFormat, config: dict,
                      embeddings: Mapping[str, QuantizedWeight]) -> None:
    """Quantized embedding tables only where the format stores them (one-line ValueError)."""
    if not embeddings:
        return
    support = fmt.vocab_support(vocab_tables(config).tied)
    if not support.embedding:
        raise ValueError(f"--format {fmt.name} cannot store the quantized embedding table "
                         f"{sorted(embeddings)[0]}: {support.why}")


def convert_checkpoint(
    qdir: str | Path, out: str | Path, fmt: str, max_shard_size: str = "2GB", force: bool = False,
    **options,
) -> dict:
    """Re-export a verified quantized folder (any format quantpipe reads) as ``fmt``; the
    quantized values are copied bit for bit. ``options``: the format's own, as
    :func:`write_checkpoint`'s."""
    from quantpipe.core.formats.loader import load_quantized

    checkpoint_format = format_named(fmt)
    check_not_overlapping(out, {"QDIR": qdir})
    ckpt = load_quantized(qdir)
    # quantized layers need a placeholder ".weight" so that the tensor order is kept
    state = dict(ckpt.fp_tensors)
    for name, qw in ckpt.layers.items():
        state[f"{name}.weight"] = qw.q
    for name, qw in ckpt.embeddings.items():
        state[f"{name}.weight"] = qw.q
    fields = {k: v for k, v in (ckpt.manifest or {}).items() if k not in _OWN_KEYS}
    if "plan" in fields:
        fields["plan"] = recount_plan_bits(fields["plan"], fmt)
    fields["converted_from"] = {"path": str(Path(qdir).resolve()),
                                "checkpoint_format": ckpt.checkpoint_format}
    _check_embeddings(checkpoint_format, ckpt.config, ckpt.embeddings)
    job = FolderToWrite(Path(out), ckpt.model_config(), state, ckpt.layers, Path(qdir), fields,
                        max_shard_size, force, ckpt.embeddings)
    return checkpoint_format.write(job, **options)


def recount_plan_bits(plan: dict, fmt: str) -> dict:
    """A manifest's ``plan`` (``calibration.mixed_precision.plan.Plan.to_dict``) with its bits
    per weight counted as ``fmt`` stores the layers (a converted folder stores them
    differently)."""
    layers = plan.get("layers") or {}
    specs = {n: None if v.get("spec") is None else QuantSpec.from_dict(v["spec"])
             for n, v in layers.items()}
    shapes = {n: tuple(v["shape"]) for n, v in layers.items()}
    out = dict(plan, checkpoint_format=fmt,
               effective_bits_per_weight=average_bits(specs, shapes, fmt))
    out["layers"] = {n: dict(v, bits_per_weight=bits_per_weight(specs[n], shapes[n], fmt))
                     for n, v in layers.items()}
    return out

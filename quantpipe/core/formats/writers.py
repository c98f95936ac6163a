"""Write GPTQ and compressed-tensors checkpoints (same inputs as ``write_native``), and convert
an existing quantized folder to either format."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from quantpipe.core.formats import compressed_tensors as ct
from quantpipe.core.formats import gptq
from quantpipe.core.formats.common import (
    is_sequential_g_idx,
    kept_fp16_linears,
    replace_quantized,
    write_quantized_folder,
)
from quantpipe.core.io import check_not_overlapping
from quantpipe.core.native import load_fp16_source, source_fp16_entry
from quantpipe.core.qformat import QuantizedWeight, weight_spec

EXPORT_FORMATS = ("gptq", "compressed-tensors")
# manifest keys that belong to the folder being written, never copied from a converted source
_OWN_KEYS = {"format", "version", "stage", "checkpoint_format", "native_format_version",
             "gptq_checkpoint_format", "shards", "packages", "layers"}


def _check_act_order(weights: Mapping[str, QuantizedWeight]) -> None:
    for name in weights:
        if weight_spec(weights, name).act_order:
            continue  # a permutation is allowed: no need to read the layer
        qw = weights[name]
        if not is_sequential_g_idx(qw):
            raise ValueError(f"{name}: g_idx is a permutation but its spec has act_order=False; "
                             "set act_order=True in the plan for this layer")


def _write_gptq(out, config, state, weights, side_dir, fields, max_shard_size, force,
                checkpoint_format) -> dict:
    _check_act_order(weights)
    fmt = gptq.choose_checkpoint_format(weights, checkpoint_format)
    v1 = fmt == "gptq"
    plan = {n: weight_spec(weights, n) for n in weights}
    qcfg = gptq.gptq_quantization_config(plan, kept_fp16_linears(state, set(weights)), fmt)

    def layer_tensors(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        return {f"{name}.{k}": v for k, v in gptq.pack_gptq(qw, v1).items()}

    return write_quantized_folder(
        out, config=config, quantization_config=qcfg,
        tensors=replace_quantized(state, weights, layer_tensors), checkpoint_format="gptq",
        side_dir=side_dir, extra_json={"quantize_config.json": qcfg},
        manifest_fields={"gptq_checkpoint_format": fmt,
                         "layers": {n: s.to_dict() for n, s in plan.items()}, **fields},
        max_shard_size=max_shard_size, force=force,
    )


def _write_ct(out, config, state, weights, side_dir, fields, max_shard_size, force) -> dict:
    _check_act_order(weights)
    plan = {n: weight_spec(weights, n) for n in weights}
    qcfg = ct.ct_quantization_config(plan, kept_fp16_linears(state, set(weights)))

    def layer_tensors(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        try:
            packed = ct.pack_ct(qw)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        return {f"{name}.{k}": v for k, v in packed.items()}

    return write_quantized_folder(
        out, config=config, quantization_config=qcfg,
        tensors=replace_quantized(state, weights, layer_tensors),
        checkpoint_format="compressed-tensors", side_dir=side_dir,
        manifest_fields={"layers": {n: s.to_dict() for n, s in plan.items()}, **fields},
        max_shard_size=max_shard_size, force=force,
    )


def write_gptq(
    out: str | Path,
    fp16_dir: str | Path,
    weights: dict[str, QuantizedWeight],
    fp_overrides: dict[str, torch.Tensor] | None = None,
    manifest_fields: dict | None = None,
    max_shard_size: str = "2GB",
    force: bool = False,
    checkpoint_format: str = "auto",
    fp16_shards: list[dict] | None = None,
    recorded_by: str = "",
) -> dict:
    """GPTQ checkpoint (see :mod:`quantpipe.core.formats.gptq`); returns the manifest.

    ``checkpoint_format``: "auto" (v1 "gptq" unless an asymmetric zero point is 0, then
    "gptq_v2"), "gptq" or "gptq_v2". ``fp16_shards``/``recorded_by``: the FP16 hashes to
    check (see :func:`quantpipe.core.native.load_fp16_source`).
    """
    check_not_overlapping(out, {"FP16_DIR": fp16_dir})
    config, state, fp16_manifest = load_fp16_source(fp16_dir, weights, fp_overrides,
                                                    fp16_shards, recorded_by)
    fields = {"source_fp16": source_fp16_entry(fp16_dir, fp16_manifest), **(manifest_fields or {})}
    return _write_gptq(out, config, state, weights, Path(fp16_dir), fields, max_shard_size,
                       force, checkpoint_format)


def write_compressed_tensors(
    out: str | Path,
    fp16_dir: str | Path,
    weights: dict[str, QuantizedWeight],
    fp_overrides: dict[str, torch.Tensor] | None = None,
    manifest_fields: dict | None = None,
    max_shard_size: str = "2GB",
    force: bool = False,
    fp16_shards: list[dict] | None = None,
    recorded_by: str = "",
) -> dict:
    """compressed-tensors pack-quantized checkpoint (see
    :mod:`quantpipe.core.formats.compressed_tensors`); returns the manifest. ``fp16_shards``/
    ``recorded_by``: as for :func:`write_gptq`."""
    check_not_overlapping(out, {"FP16_DIR": fp16_dir})
    config, state, fp16_manifest = load_fp16_source(fp16_dir, weights, fp_overrides,
                                                    fp16_shards, recorded_by)
    fields = {"source_fp16": source_fp16_entry(fp16_dir, fp16_manifest), **(manifest_fields or {})}
    return _write_ct(out, config, state, weights, Path(fp16_dir), fields, max_shard_size, force)


def convert_native(
    qdir: str | Path, out: str | Path, fmt: str, max_shard_size: str = "2GB", force: bool = False
) -> dict:
    """Re-export a verified quantized folder (native, or any format quantpipe reads) as
    ``fmt`` ("gptq" or "compressed-tensors"); the quantized values are copied bit for bit."""
    from quantpipe.core.formats.loader import load_quantized

    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"format {fmt!r}; convert to one of {EXPORT_FORMATS}")
    check_not_overlapping(out, {"QDIR": qdir})
    ckpt = load_quantized(qdir)
    # quantized layers need a placeholder ".weight" so that the tensor order is kept
    state = dict(ckpt.fp_tensors)
    for name, qw in ckpt.layers.items():
        state[f"{name}.weight"] = qw.q
    fields = {k: v for k, v in (ckpt.manifest or {}).items() if k not in _OWN_KEYS}
    fields["converted_from"] = {"path": str(Path(qdir).resolve()),
                                "checkpoint_format": ckpt.checkpoint_format}
    if fmt == "gptq":
        return _write_gptq(out, ckpt.model_config(), state, ckpt.layers, Path(qdir), fields,
                           max_shard_size, force, "auto")
    return _write_ct(out, ckpt.model_config(), state, ckpt.layers, Path(qdir), fields,
                     max_shard_size, force)

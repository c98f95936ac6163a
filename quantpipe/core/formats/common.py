"""Pieces shared by the GPTQ and compressed-tensors writers and the validating loader.

A quantized folder is written in one place (:func:`write_quantized_folder`): config.json with
the format's ``quantization_config``, the side files (tokenizer, generation config), sharded
safetensors and, last, the ``quantpipe.json`` manifest, all inside
:func:`quantpipe.core.io.atomic_output_dir`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from quantpipe.core.io import (
    atomic_output_dir,
    tensor_shape,
    write_json_atomic,
    write_manifest,
    write_shards,
)
from quantpipe.core.native import copy_side_files, replace_quantized  # noqa: F401  (re-exported)
from quantpipe.core.qformat import QuantizedWeight

# The three on-disk layouts quantpipe writes and reads.
FORMATS = ("native", "gptq", "compressed-tensors")

# 2-D ``.weight`` tensors that are not linears of a decoder block: never quantized, never
# listed as "kept in FP16" (names of the Llama/Qwen/Mistral/Gemma families).
NON_LINEAR_2D = ("embed_tokens", "lm_head", "wte", "wpe", "embed_positions")


def kept_fp16_linears(state: Mapping[str, torch.Tensor], quantized: set[str]) -> list[str]:
    """Linears (2-D ``X.weight``, not embeddings or the head) that the plan keeps in FP16."""
    out = []
    for k in state:
        if not k.endswith(".weight") or len(tensor_shape(state, k)) != 2:
            continue
        name = k[: -len(".weight")]
        if name in quantized or name.rsplit(".", 1)[-1] in NON_LINEAR_2D:
            continue
        out.append(name)
    return out


def is_sequential_g_idx(qw: QuantizedWeight) -> bool:
    """True when the layer's groups are plain ``i // group_size`` (no act-order permutation)."""
    if qw.g_idx is None:
        return True
    in_f = qw.shape[1]
    seq = torch.arange(in_f) // qw.spec.group_size_for(in_f)  # [in] int64
    return torch.equal(qw.g_idx.long(), seq)


def write_quantized_folder(
    out: str | Path,
    *,
    config: dict,
    quantization_config: dict,
    tensors: Iterable[tuple[str, torch.Tensor]],
    checkpoint_format: str,
    side_dir: Path,
    manifest_fields: dict,
    extra_json: dict[str, dict] | None = None,
    max_shard_size: str = "2GB",
    force: bool = False,
) -> dict:
    """Write config.json, side files, shards and the manifest (last) atomically; ``tensors``
    are ``(name, tensor)`` pairs made on demand (one shard in memory at a time)."""
    assert checkpoint_format in FORMATS, checkpoint_format
    config = dict(config)
    config["quantization_config"] = quantization_config
    with atomic_output_dir(out, force) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for fname, obj in (extra_json or {}).items():
            write_json_atomic(tmp / fname, obj)
        copy_side_files(side_dir, tmp)
        shards = write_shards(tensors, tmp, max_shard_size)
        manifest = write_manifest(
            tmp,
            stage="quantized",
            checkpoint_format=checkpoint_format,
            shards=shards,
            **manifest_fields,
        )
    return manifest

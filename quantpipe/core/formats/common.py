"""Pieces every format's writer shares: the FP16 source (checked, read tensor by tensor), the
side files, the FP16-kept linears, and the one place a quantized folder is written.

A quantized folder is written in one place (:func:`write_quantized_folder`): config.json with
the format's ``quantization_config``, the side files (tokenizer, generation config), sharded
safetensors and, last, the ``quantpipe.json`` manifest, all inside
:func:`quantpipe.core.io.atomic_output_dir`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import torch
from tqdm.auto import tqdm

from quantpipe.core.experts import hub_name, split_fused_name
from quantpipe.core.families import FAMILIES, Family
from quantpipe.core.formats.base import FolderToWrite
from quantpipe.core.io import (
    KeyedView,
    LazyTensors,
    Overlay,
    atomic_output_dir,
    read_manifest,
    sha256_file,
    tensor_shape,
    verify_shard_hashes,
    write_json_atomic,
    write_manifest,
    write_shards,
)
from quantpipe.core.qformat import LazyWeights, QuantizedWeight, weight_shape, weight_spec
from quantpipe.core.sources import DTYPES

# Files copied from the FP16 folder into every quantized folder.
SIDE_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
)

# 2-D ``.weight`` tensors that are not linears of a decoder block: never quantized, never
# listed as "kept in FP16" (names of the Llama/Qwen/Mistral/Gemma families).
NON_LINEAR_2D = ("embed_tokens", "lm_head", "wte", "wpe", "embed_positions")


# ---- the FP16 source ----------------------------------------------------------------------


def read_fp_state(folder: str | Path) -> LazyTensors:
    """All tensors of a safetensors folder (index-aware), each read from disk on access."""
    return LazyTensors.of_folder(folder)


def check_fp16_shards(fp16_dir: str | Path, fp16_manifest: dict,
                      recorded: list[dict] | None = None, recorded_by: str = "") -> None:
    """Hash the FP16 shards: against the hashes another stage ``recorded`` (the calibration's
    ``fp16_shards``: the folder must be the one it was made from), else the folder's manifest.

    A mismatch is a ValueError naming the file.
    """
    fp16_dir = Path(fp16_dir)
    if recorded is None:
        verify_shard_hashes(fp16_dir, fp16_manifest["shards"])
        return
    now = sorted(s["file"] for s in fp16_manifest["shards"])
    then = sorted(s["file"] for s in recorded)
    if now != then:
        raise ValueError(
            f"{fp16_dir} holds shards {now}, but {recorded_by} was made from {then}: the FP16 "
            "folder was re-exported since; calibrate again from this folder"
        )
    verify_shard_hashes(fp16_dir, recorded, recorded_by=recorded_by)


def load_fp16_source(
    fp16_dir: str | Path,
    weights: Mapping[str, QuantizedWeight],
    fp_overrides: Mapping[str, torch.Tensor] | None = None,
    fp16_shards: list[dict] | None = None,
    recorded_by: str = "",
) -> tuple[dict, Mapping[str, torch.Tensor], dict, Mapping[str, QuantizedWeight]]:
    """The FP16 folder's ``(config, state, manifest)`` with ``fp_overrides`` applied, and
    ``weights``, both under the hub's names (:func:`hub_layout`: a MoE model's experts one
    ``.weight`` per expert and linear; the identity for dense models).

    First checks the shards' sha256 (:func:`check_fp16_shards`; ``fp16_shards``: the hashes
    the calibration recorded, named by ``recorded_by``), then that every quantized layer has a
    ``.weight`` of the same shape in the folder (from the shard headers). ``state`` reads each
    tensor from disk when it is written, so an export holds one shard, not the model. Shared by
    every export format.
    """
    fp16_dir = Path(fp16_dir)
    fp16_manifest = read_manifest(fp16_dir, "fp16")
    check_fp16_shards(fp16_dir, fp16_manifest, fp16_shards, recorded_by)
    config = json.loads((fp16_dir / "config.json").read_text())
    state = Overlay(read_fp_state(fp16_dir), fp_overrides or {},
                    DTYPES[fp16_manifest.get("dtype", "fp16")])
    state, weights = hub_layout(config, state, weights)
    missing = [n for n in weights if f"{n}.weight" not in state]
    if missing:
        raise ValueError(f"quantized layers not found in {fp16_dir}: {sorted(missing)[:5]}")
    for name in weights:
        shape, want = tensor_shape(state, f"{name}.weight"), weight_shape(weights, name)
        assert shape == tuple(want), (name, shape, want)
    return config, state, fp16_manifest, weights


class HubState(KeyedView):
    """A MoE model's tensors (transformers' names: fused 3-D experts) under the hub's names,
    each expert's gate, up and down ``[out, in]`` a tensor of its own (vLLM's and transformers'
    loaders read these). Read on access; the last fused tensor read is kept, so writing a
    layer's experts one by one reads it once."""

    def __init__(self, base: Mapping[str, torch.Tensor], family: Family) -> None:
        moe = family.moe
        assert moe is not None
        self._base = base
        self._where: dict[str, tuple[str, tuple[int, int, int] | None]] = {}
        g, u, d = moe.linear_names
        for k in base:
            found = split_fused_name(k, family.blocks, moe)
            if found is None:
                self._where[hub_name(k, family.blocks, moe)] = (k, None)
                continue
            prefix, kind = found
            E, rows = tensor_shape(base, k)[:2]  # gate_up [E, 2I, H] / down [E, H, I]
            for e in range(E):
                pre = hub_name(f"{prefix}.{moe.path}.{e}", family.blocks, moe)
                if kind == moe.gate_up:
                    self._where[f"{pre}.{g}.weight"] = (k, (e, 0, rows // 2))
                    self._where[f"{pre}.{u}.weight"] = (k, (e, rows // 2, rows))
                else:
                    self._where[f"{pre}.{d}.weight"] = (k, (e, 0, rows))
        self._cached: tuple[str | None, torch.Tensor | None] = (None, None)
        self._keys_of = self._where

    def __getitem__(self, key: str) -> torch.Tensor:
        base_key, part = self._where[key]
        if part is None:
            return self._base[base_key]
        if self._cached[0] != base_key:
            self._cached = (base_key, self._base[base_key])
        e, lo, hi = part
        return self._cached[1][e, lo:hi].clone()  # [out, in]: its own storage when saved


def hub_layout(config: dict, state: Mapping[str, torch.Tensor],
               weights: Mapping[str, QuantizedWeight]
               ) -> tuple[Mapping[str, torch.Tensor], Mapping[str, QuantizedWeight]]:
    """``state`` and ``weights`` under the hub's names: for a MoE family
    (:data:`quantpipe.core.families.FAMILIES`) the experts are split per expert
    (:class:`HubState`) and calibration's per-expert linears renamed (Mixtral: ``mlp`` ->
    ``block_sparse_moe``); dense families pass as they are."""
    family = FAMILIES.get(config.get("model_type"))
    if family is None or family.moe is None:
        return state, weights
    hub = {hub_name(n, family.blocks, family.moe): n for n in weights}
    renamed = LazyWeights({h: weight_spec(weights, n) for h, n in hub.items()},
                          {h: tuple(weight_shape(weights, n)) for h, n in hub.items()},
                          lambda h: weights[hub[h]])
    return HubState(state, family), renamed


def source_fp16_entry(fp16_dir: str | Path, fp16_manifest: dict) -> dict:
    """The ``source_fp16`` manifest field: where the FP16 weights came from, with hashes."""
    return {
        "path": str(Path(fp16_dir).resolve()),
        "shards": [{"file": s["file"], "sha256": s["sha256"]} for s in fp16_manifest["shards"]],
        "source": fp16_manifest.get("source"),
    }


def copy_side_files(src: str | Path, dst: str | Path) -> None:
    """Copy the tokenizer and generation files (:data:`SIDE_FILES`) that exist in ``src``."""
    src, dst = Path(src), Path(dst)
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def side_file_hashes(folder: Path, names: list[str]) -> list[dict]:
    """``{"file", "sha256", "bytes"}`` of ``names`` and of the :data:`SIDE_FILES` present: the
    manifest's ``files``, which ``verify`` checks like the shards (a corrupt config.json or
    tokenizer is caught before a model is built from it)."""
    present = [*names, *(n for n in SIDE_FILES if (folder / n).is_file())]
    return [{"file": n, "sha256": sha256_file(folder / n), "bytes": (folder / n).stat().st_size}
            for n in dict.fromkeys(present)]


# ---- what the writers share ---------------------------------------------------------------


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


def check_act_order(name: str, qw: QuantizedWeight) -> None:
    """A permuted ``g_idx`` needs ``act_order`` in its spec (the configs say so per layer).
    Checked on each layer as it is written (reading every layer once more up front cost
    more than the export itself); a failure leaves no folder (the write is atomic)."""
    if not qw.spec.act_order and not is_sequential_g_idx(qw):
        raise ValueError(f"{name}: g_idx is a permutation but its spec has act_order=False; "
                         "set act_order=True in the plan for this layer")


def replace_quantized(
    state: Mapping[str, torch.Tensor],
    weights: Mapping[str, QuantizedWeight],
    layer_tensors: Callable[[str, QuantizedWeight], dict[str, torch.Tensor]],
    embeddings: Mapping[str, QuantizedWeight] | None = None,
    skip: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors to save, in ``state``'s order, each quantized ``P.weight`` (a linear of
    ``weights`` or a table of ``embeddings``) replaced by the format's tensors, the names in
    ``skip`` left out; produced one at a time (one layer unpacked and packed at a time)."""
    embeddings = embeddings or {}
    for k in state:
        if k in skip:
            continue
        lin = k[: -len(".weight")] if k.endswith(".weight") else None
        if lin is not None and lin in weights:
            yield from layer_tensors(lin, weights[lin]).items()
        elif lin is not None and lin in embeddings:
            yield from layer_tensors(lin, embeddings[lin]).items()
        else:
            yield k, state[k]


def write_quantized_folder(
    job: FolderToWrite,
    *,
    checkpoint_format: str,
    quantization_config: dict,
    layer_tensors: Callable[[str, QuantizedWeight], dict[str, torch.Tensor]],
    manifest_fields: dict,
    extra_json: dict[str, dict] | None = None,
    skip: frozenset[str] = frozenset(),
) -> dict:
    """Write config.json, side files, shards and the manifest (last) atomically; each quantized
    layer's tensors (and each of ``job.embeddings``) are made by ``layer_tensors`` when its
    shard is written (one layer in memory at a time); state tensors named in ``skip`` are not
    written. ``manifest_fields``: the format's own, before ``job.manifest_fields``."""
    config = dict(job.config)
    config["quantization_config"] = quantization_config
    with atomic_output_dir(job.out, job.force) as tmp:
        write_json_atomic(tmp / "config.json", config)  # OSErrors name the file
        for fname, obj in (extra_json or {}).items():
            write_json_atomic(tmp / fname, obj)
        copy_side_files(job.side_dir, tmp)
        with tqdm(total=len(job.weights) + len(job.embeddings), desc=f"export {checkpoint_format}",
                  unit="layer") as bar:
            def counted(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
                out = layer_tensors(name, qw)
                bar.update()
                return out

            tensors: Iterable[tuple[str, torch.Tensor]] = replace_quantized(
                job.state, job.weights, counted, job.embeddings, skip)
            shards = write_shards(tensors, tmp, job.max_shard_size)
        manifest = write_manifest(
            tmp,
            stage="quantized",
            checkpoint_format=checkpoint_format,
            shards=shards,
            files=side_file_hashes(tmp, ["config.json", *(extra_json or {})]),
            **manifest_fields,
            **job.manifest_fields,
        )
    return manifest

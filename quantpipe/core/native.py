"""quantpipe's native quantized checkpoint: write and read.

Layout of a quantized folder (QDIR), one entry per quantized linear ``P`` (e.g.
``model.layers.0.self_attn.q_proj``), every other tensor under its Hugging Face name and dtype:

| tensor          | dtype | shape                    | meaning                                     |
|-----------------|-------|--------------------------|---------------------------------------------|
| ``P.qweight``   | int32 | [out, in * bits / 32]    | unsigned q, packed along ``in``, LSB first  |
| ``P.scales``    | fp16  | [out, in / group_size]   | one scale per (row, group)                  |
| ``P.qzeros``    | uint8 | [out, in / group_size]   | asymmetric specs only (sym: 2**(bits-1))    |
| ``P.g_idx``     | int32 | [in]                     | act-order specs only: group of each column  |
| ``P.bias``      | any   | [out]                    | when the linear has a bias                  |

``w[o, i] = (q[o, i] - zero[o, g_idx[i]]) * scale[o, g_idx[i]]`` (see ``quantpipe.core.qformat``).
``config.json["quantization_config"]`` = ``{"quant_method": "quantpipe", "format_version": 1,
"layers": {P: spec dict}}`` and ``quantpipe.json`` (stage ``quantized``) holds the whole plan,
shard hashes and the source hashes.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from quantpipe.core.io import (
    MANIFEST_NAME,
    LazyTensors,
    Overlay,
    atomic_output_dir,
    read_manifest,
    tensor_shape,
    verify_shard_hashes,
    write_json_atomic,
    write_manifest,
    write_shards,
)
from quantpipe.core.qformat import (
    QuantizedWeight,
    QuantSpec,
    pack_int32,
    unpack_int32,
    weight_shape,
    weight_spec,
)
from quantpipe.core.sources import DTYPES

log = logging.getLogger(__name__)

NATIVE_FORMAT_VERSION = 1
QUANT_METHOD = "quantpipe"
# Files copied from the FP16 folder into every quantized folder.
SIDE_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
)


def quantized_tensors(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """The native tensors for one quantized linear."""
    out = {
        f"{name}.qweight": pack_int32(qw.q, qw.spec.bits),  # [out, in*bits/32] int32
        f"{name}.scales": qw.scales.contiguous(),  # [out, G] fp16
    }
    if not qw.spec.sym:
        out[f"{name}.qzeros"] = qw.zeros.contiguous()  # [out, G] uint8
    if qw.g_idx is not None:
        out[f"{name}.g_idx"] = qw.g_idx.contiguous()  # [in] int32
    return out


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
) -> tuple[dict, Mapping[str, torch.Tensor], dict]:
    """The FP16 folder's ``(config, state, manifest)`` with ``fp_overrides`` applied.

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
    missing = [n for n in weights if f"{n}.weight" not in state]
    if missing:
        raise ValueError(f"quantized layers not found in {fp16_dir}: {sorted(missing)[:5]}")
    for name in weights:
        shape, want = tensor_shape(state, f"{name}.weight"), weight_shape(weights, name)
        assert shape == tuple(want), (name, shape, want)
    return config, state, fp16_manifest


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


def write_native(
    out: str | Path,
    fp16_dir: str | Path,
    weights: Mapping[str, QuantizedWeight],
    fp_overrides: Mapping[str, torch.Tensor] | None = None,
    manifest_fields: dict | None = None,
    max_shard_size: str = "2GB",
    force: bool = False,
    fp16_shards: list[dict] | None = None,
    recorded_by: str = "",
) -> dict:
    """Write a native quantized checkpoint.

    ``weights``: linear name (no ``.weight``) -> its quantized weight (a lazy
    :class:`~quantpipe.core.qformat.LazyWeights` is read one layer at a time). ``fp_overrides``: FP
    tensors that replace the FP16 folder's (e.g. AWQ-scaled norms and kept-FP16 linears).
    ``fp16_shards``/``recorded_by``: see :func:`load_fp16_source`. Returns the manifest.
    """
    fp16_dir = Path(fp16_dir)
    config, state, fp16_manifest = load_fp16_source(fp16_dir, weights, fp_overrides,
                                                    fp16_shards, recorded_by)
    layers = {name: weight_spec(weights, name).to_dict() for name in weights}
    config["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "format_version": NATIVE_FORMAT_VERSION,
        "layers": layers,
    }
    with atomic_output_dir(out, force, inputs={"FP16_DIR": fp16_dir}) as tmp:
        write_json_atomic(tmp / "config.json", config)  # OSErrors name the file
        copy_side_files(fp16_dir, tmp)
        shards = write_shards(replace_quantized(state, weights, quantized_tensors), tmp,
                              max_shard_size)
        manifest = write_manifest(
            tmp,
            stage="quantized",
            checkpoint_format="native",
            native_format_version=NATIVE_FORMAT_VERSION,
            source_fp16=source_fp16_entry(fp16_dir, fp16_manifest),
            layers=layers,
            shards=shards,
            **(manifest_fields or {}),
        )
    return manifest


def replace_quantized(
    state: Mapping[str, torch.Tensor],
    weights: Mapping[str, QuantizedWeight],
    layer_tensors: Callable[[str, QuantizedWeight], dict[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors to save, in ``state``'s order, each quantized ``P.weight`` replaced by the
    format's tensors; produced one at a time (one layer unpacked and packed at a time)."""
    for k in state:
        lin = k[: -len(".weight")] if k.endswith(".weight") else None
        if lin is not None and lin in weights:
            yield from layer_tensors(lin, weights[lin]).items()
        else:
            yield k, state[k]


@dataclass
class NativeCheckpoint:
    """A native checkpoint's tensors as stored (packed), plus its plan."""

    folder: Path
    config: dict
    manifest: dict
    layers: dict[str, QuantSpec]  # quantized linear name -> spec
    tensors: dict[str, torch.Tensor]  # every stored tensor, packed as on disk

    def quantized_weight(self, name: str) -> QuantizedWeight:
        """Unpack one linear into a :class:`QuantizedWeight`."""
        spec = self.layers[name]
        scales = self.tensors[f"{name}.scales"]  # [out, G] fp16
        qweight = self.tensors[f"{name}.qweight"]  # [out, in*bits/32] int32
        q = unpack_int32(qweight, spec.bits)  # [out, in] uint8
        zeros = self.tensors.get(f"{name}.qzeros")
        if zeros is None:
            zeros = torch.full(scales.shape, spec.sym_zero, dtype=torch.uint8)
        return QuantizedWeight(spec, q, scales, zeros, self.tensors.get(f"{name}.g_idx"))

    def dequantized_state_dict(self, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
        """HF state dict with every quantized linear dequantized (the reference model)."""
        out: dict[str, torch.Tensor] = {}
        suffixes = (".qweight", ".scales", ".qzeros", ".g_idx")
        for k, v in self.tensors.items():
            if any(k.endswith(s) and k[: -len(s)] in self.layers for s in suffixes):
                continue
            out[k] = v
        for name in self.layers:
            out[f"{name}.weight"] = self.quantized_weight(name).dequantize(dtype)
        return out


def read_native(folder: str | Path) -> NativeCheckpoint:
    folder = Path(folder)
    manifest = read_manifest(folder, "quantized")
    if manifest.get("checkpoint_format") != "native":
        raise ValueError(
            f"{folder} is a {manifest.get('checkpoint_format')!r} checkpoint, not native; "
            f"see {MANIFEST_NAME}"
        )
    config = json.loads((folder / "config.json").read_text())
    layers = {k: QuantSpec.from_dict(v) for k, v in manifest["layers"].items()}
    return NativeCheckpoint(folder, config, manifest, layers, read_fp_state(folder))


def model_from_state_dict(config: dict, state: dict[str, torch.Tensor], dtype: torch.dtype,
                          where: str | Path = "checkpoint"):
    """A plain transformers model built from ``config`` (quantization_config dropped) and FP
    tensors, without random initialisation of weights that are overwritten right away."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = {k: v for k, v in config.items() if k != "quantization_config"}
    hf_config = AutoConfig.for_model(**cfg_dict)
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = hf_config.tie_word_embeddings
    missing = [k for k in missing if not (k == "lm_head.weight" and tied)]
    if missing or unexpected:
        raise ValueError(f"{where}: missing tensors {missing[:5]}, unexpected {unexpected[:5]}")
    if tied:
        model.tie_weights()  # no_init_weights() skips the tying done at construction
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return model.to(dtype).eval()


def load_dequantized_model(folder: str | Path, dtype: torch.dtype = torch.float32):
    """Reference loader: a plain transformers model with the dequantized weights."""
    ckpt = read_native(folder)
    return model_from_state_dict(ckpt.config, ckpt.dequantized_state_dict(dtype), dtype, folder)

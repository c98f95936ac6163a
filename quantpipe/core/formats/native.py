"""quantpipe's native quantized checkpoint.

Layout of a quantized folder (QDIR), one entry per quantized linear ``P`` (e.g.
``model.layers.0.self_attn.q_proj``), every other tensor under its Hugging Face name and dtype:

| tensor          | dtype | shape                    | meaning                                     |
|-----------------|-------|--------------------------|---------------------------------------------|
| ``P.qweight``   | int32 | [out, in * bits / 32]    | unsigned q, packed along ``in``, LSB first  |
|                 |       |                          | (INT5/INT6: an INT4 plane, then the top     |
|                 |       |                          | bits' plane: ``qformat.pack_int32``)        |
| ``P.scales``    | fp16  | [out, in / group_size]   | one scale per (row, group)                  |
| ``P.qzeros``    | uint8 | [out, in / group_size]   | asymmetric specs only (sym: 2**(bits-1))    |
| ``P.g_idx``     | int32 | [in]                     | act-order specs only: group of each column  |
| ``P.bias``      | any   | [out]                    | when the linear has a bias                  |

``w[o, i] = (q[o, i] - zero[o, g_idx[i]]) * scale[o, g_idx[i]]`` (see ``quantpipe.core.qformat``).
``config.json["quantization_config"]`` = ``{"quant_method": "quantpipe", "format_version": 1,
"layers": {P: spec dict}}`` and ``quantpipe.json`` (stage ``quantized``) holds the whole plan,
shard hashes and the source hashes.

Vocabulary tables (``export --vocab-weights int8|int4``, :mod:`quantpipe.core.vocab`): the input
embedding table ``E`` (``model.embed_tokens``) is stored in the same layout as a linear
``[vocab, hidden]`` (``E.qweight``, ``E.scales``; symmetric, so no ``E.qzeros``) and listed under
``quantization_config["embeddings"] = {E: spec dict}``; an untied head is one more quantized
linear ``lm_head`` of ``layers``. A tied head is not stored: it is the table (one tensor in the
file, ``tie_word_embeddings`` in config.json), and ``lm_head.weight`` is never written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from quantpipe.core.formats.base import (
    CheckpointFormat,
    Expected,
    FolderToWrite,
    StoredLayer,
    UnpackedLayer,
    VocabSupport,
)
from quantpipe.core.formats.common import read_fp_state, write_quantized_folder
from quantpipe.core.io import MANIFEST_NAME, read_manifest
from quantpipe.core.qformat import (
    QuantizedWeight,
    QuantSpec,
    pack_int32,
    packed_words,
    unpack_int32,
    weight_spec,
)
from quantpipe.core.vocab import HEAD, vocab_tables

NAME = "native"
QUANT_METHOD = "quantpipe"
NATIVE_FORMAT_VERSION = 1


# ---- packing (pure) ------------------------------------------------------------------------


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


def unpack_native(name: str, spec: QuantSpec, tensors: Mapping[str, torch.Tensor]) -> UnpackedLayer:
    """Inverse of :func:`quantized_tensors` (zeros as int32, the verifier's convention)."""
    q = unpack_int32(tensors[f"{name}.qweight"], spec.bits)  # [out, in*bits/32] -> [out, in] uint8
    scales = tensors[f"{name}.scales"]  # [out, G] fp16
    zeros = (tensors[f"{name}.qzeros"].to(torch.int32) if not spec.sym  # [out, G]
             else torch.full(scales.shape, spec.sym_zero, dtype=torch.int32))
    g_idx = tensors[f"{name}.g_idx"] if f"{name}.g_idx" in tensors else None  # [in] int32
    return UnpackedLayer(q, scales, zeros, g_idx)


# ---- writing -------------------------------------------------------------------------------


def write(job: FolderToWrite) -> dict:
    """Write a native folder (see the module docstring); returns the manifest."""
    layers = {name: weight_spec(job.weights, name).to_dict() for name in job.weights}
    qcfg = {"quant_method": QUANT_METHOD, "format_version": NATIVE_FORMAT_VERSION,
            "layers": layers}
    fields = {"native_format_version": NATIVE_FORMAT_VERSION, "layers": layers}
    skip: frozenset[str] = frozenset()
    if job.embeddings:
        embeddings = {name: qw.spec.to_dict() for name, qw in job.embeddings.items()}
        qcfg["embeddings"] = fields["embeddings"] = embeddings
        if vocab_tables(job.config).tied:  # the head is the table: never a second copy
            skip = frozenset({f"{HEAD}.weight"})
    return write_quantized_folder(
        job, checkpoint_format=NAME, quantization_config=qcfg, layer_tensors=quantized_tensors,
        manifest_fields=fields, skip=skip,
    )


def vocab_support(tied: bool) -> VocabSupport:
    """Both tables: the embedding table as ``embeddings``, an untied head as a linear."""
    return VocabSupport(embedding=True, head=True)


# ---- reading (verify) ----------------------------------------------------------------------


def expected_native(name: str, spec: QuantSpec, shape: tuple[int, int],
                    has_g_idx: bool) -> Expected:
    """The tensors of one layer ``[out, in]`` (the module docstring's table)."""
    out_f, in_f = shape
    n_groups = 1 if spec.group_size == -1 else max(in_f // spec.group_size, 1)
    exp: Expected = {
        f"{name}.qweight": ((out_f, packed_words(in_f, spec.bits)), (torch.int32,)),
        f"{name}.scales": ((out_f, n_groups), (torch.float16,)),
    }
    if not spec.sym:
        exp[f"{name}.qzeros"] = ((out_f, n_groups), (torch.uint8,))
    if has_g_idx:
        exp[f"{name}.g_idx"] = ((in_f,), (torch.int32,))
    return exp


def layout(name: str, spec: QuantSpec, shape: tuple[int, int]) -> Expected:
    """What :func:`write` stores: a g_idx only for act-order specs (calibration records
    act_order only where the groups are a permutation; sequential groups store none)."""
    return expected_native(name, spec, shape, spec.act_order)


def read_layers(qcfg: dict, tensors: Mapping[str, torch.Tensor],
                problems: list[str]) -> tuple[dict[str, QuantSpec], list[StoredLayer]]:
    """The plan of ``quantization_config.layers`` and each layer's expected tensors."""
    plan: dict[str, QuantSpec] = {}
    for name, d in (qcfg.get("layers") or {}).items():
        try:
            plan[name] = QuantSpec.from_dict(d)
        except (KeyError, TypeError, ValueError) as exc:
            problems.append(f"config.json quantization_config.layers[{name!r}] = {d}: {exc}")
    layers = []
    for name, spec in plan.items():
        layer = _stored(name, spec, tensors, problems, "out, in", f"{name}.g_idx" in tensors)
        if layer is not None:
            layers.append(layer)
    tables = qcfg.get("embeddings") or {}
    for k in tensors:
        name = k[: -len(".qweight")]
        if k.endswith(".qweight") and name not in plan and name not in tables:
            problems.append(f"{k}: packed weight of a layer that config.json's plan does not list")
    return plan, layers


def read_embeddings(qcfg: dict, tensors: Mapping[str, torch.Tensor],
                    problems: list[str]) -> list[StoredLayer]:
    """The quantized embedding tables of ``quantization_config.embeddings`` (module doc)."""
    tables = qcfg.get("embeddings") or {}
    if not isinstance(tables, dict):
        problems.append(f"config.json quantization_config.embeddings = {tables!r}: expected "
                        "{module name: spec}")
        return []
    stored = []
    for name, d in tables.items():
        try:
            spec = QuantSpec.from_dict(d)
        except (KeyError, TypeError, ValueError) as exc:
            problems.append(f"config.json quantization_config.embeddings[{name!r}] = {d}: {exc}")
            continue
        table = _stored(name, spec, tensors, problems, "vocab, hidden", False)
        if table is not None:
            stored.append(table)
    return stored


def _stored(name: str, spec: QuantSpec, tensors: Mapping[str, torch.Tensor],
            problems: list[str], dims: str, act_order: bool) -> StoredLayer | None:
    """One packed weight (a linear: ``dims`` "out, in"; a table: "vocab, hidden") as stored,
    or None with a problem recorded when its qweight is missing or not 2-D."""
    qweight = tensors.get(f"{name}.qweight")
    if qweight is None or qweight.dim() != 2:
        rows, cols = dims.split(", ")
        problems.append(f"{name}.qweight: missing or not 2-D (expected int32 "
                        f"[{rows}, {cols}*{spec.bits}/32])")
        return None
    shape = (qweight.shape[0], qweight.shape[-1] * 32 // spec.bits)  # [rows, cols] unpacked
    return StoredLayer(name, spec, expected_native(name, spec, shape, act_order), {
        "scales": f"{name}.scales", "zeros": f"{name}.qzeros" if not spec.sym else None,
        "g_idx": f"{name}.g_idx" if act_order else None})


def unpack(lay: StoredLayer, tensors: Mapping[str, torch.Tensor], qcfg: dict) -> UnpackedLayer:
    return unpack_native(lay.name, lay.spec, tensors)


FORMAT = CheckpointFormat(name=NAME, quant_method=QUANT_METHOD, write=write,
                          read_layers=read_layers, unpack=unpack, layout=layout,
                          vocab_support=vocab_support, read_embeddings=read_embeddings)


# ---- the packed view, without the verifier ---------------------------------------------------


@dataclass
class NativeCheckpoint:
    """A native checkpoint's tensors as stored (packed), plus its plan."""

    folder: Path
    config: dict
    manifest: dict
    layers: dict[str, QuantSpec]  # quantized linear name -> spec
    tensors: Mapping[str, torch.Tensor]  # every stored tensor, packed as on disk, read on access

    def quantized_weight(self, name: str) -> QuantizedWeight:
        """Unpack one linear into a :class:`QuantizedWeight`."""
        u = unpack_native(name, self.layers[name], self.tensors)
        return QuantizedWeight(self.layers[name], u.q, u.scales, u.zeros.to(torch.uint8), u.g_idx)


def read_native(folder: str | Path) -> NativeCheckpoint:
    """A native folder's manifest, plan and packed tensors, without the verifier's checks
    (:func:`quantpipe.core.formats.load_quantized` runs them and reads every format)."""
    folder = Path(folder)
    manifest = read_manifest(folder, "quantized")
    if manifest.get("checkpoint_format") != NAME:
        raise ValueError(
            f"{folder} is a {manifest.get('checkpoint_format')!r} checkpoint, not native; "
            f"see {MANIFEST_NAME}"
        )
    config = json.loads((folder / "config.json").read_text())
    layers = {k: QuantSpec.from_dict(v) for k, v in manifest["layers"].items()}
    return NativeCheckpoint(folder, config, manifest, layers, read_fp_state(folder))

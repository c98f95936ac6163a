"""Typed inputs of a report: what the other stages hand to :func:`reports.html.write_report`.

Nothing here computes a metric. Each dataclass validates itself and says how to fix bad input;
``from_*`` helpers adapt the shapes other stages write (``reports.eval.EvalResult`` dicts, the
quantized folder's ``quantpipe.json``, bench JSON records, ``/proc/cpuinfo``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantpipe.calibration.menu import tag_of
from quantpipe.prompts.sets import PromptRecord
from quantpipe.reports.verdict import VerdictThresholds

KLD_KEYS = ("mean", "median", "p90", "p99", "p999", "max")
TOP_PROB_DELTA_KEYS = ("rms", "p1", "p5", "p50", "p95", "p99")
INTERVAL_KEYS = ("kld_mean", "same_top_rate", "ppl_ratio")


def _as_dict(obj: Any, what: str) -> dict:
    if isinstance(obj, dict):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    raise ValueError(f"{what} must be a dict or a dataclass, got {type(obj).__name__}")


@dataclass(frozen=True)
class DistributionMetrics:
    """Token-distribution comparison of a candidate with FP16 (see ``reports.eval``)."""

    tokens: int  # scored tokens
    kld: dict[str, float]  # KL(P_fp16 || P_cand) per token, nats: mean, median, p90, p99, p999, max
    same_top_rate: float  # fraction of tokens whose argmax agrees with FP16's, 0..1
    top_prob_delta: dict[str, float]  # p_cand - p_fp16 of FP16's top token: rms, p1 .. p99
    ppl_reference: float  # FP16 perplexity on the same tokens
    ppl_candidate: float  # candidate perplexity
    ppl_ratio: float  # ppl_candidate / ppl_reference
    windows: int = 0  # evaluation windows scored (the units of the intervals)
    # 95% intervals by window: kld_mean, same_top_rate, ppl_ratio -> (low, high); empty: none
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.intervals) - set(INTERVAL_KEYS)
        if unknown:
            raise ValueError(f"intervals has {sorted(unknown)}; known: {INTERVAL_KEYS}")
        missing = [k for k in KLD_KEYS if k not in self.kld]
        if missing:
            raise ValueError(f"kld lacks {missing}; reports.eval must give {KLD_KEYS}")
        missing = [k for k in TOP_PROB_DELTA_KEYS if k not in self.top_prob_delta]
        if missing:
            raise ValueError(f"top_prob_delta lacks {missing}; give {TOP_PROB_DELTA_KEYS}")
        if not 0.0 <= self.same_top_rate <= 1.0:
            raise ValueError(f"same_top_rate={self.same_top_rate} must lie in [0, 1]")
        if self.tokens <= 0:
            raise ValueError(f"tokens={self.tokens}: the evaluation scored no tokens")

    @classmethod
    def from_eval(cls, result: Any) -> DistributionMetrics:
        """From a ``reports.eval.EvalResult`` (dataclass) or its ``to_dict()``."""
        d = _as_dict(result, "eval result")
        try:
            return cls(
                tokens=int(d["tokens"]),
                kld={k: float(v) for k, v in d["kld"].items()},
                same_top_rate=float(d["same_top_rate"]),
                top_prob_delta={k: float(v) for k, v in d["top_prob_delta"].items()},
                ppl_reference=float(d["ppl_reference"]),
                ppl_candidate=float(d["ppl_candidate"]),
                ppl_ratio=float(d["ppl_ratio"]),
                windows=int(d.get("windows", 0)),
                intervals={k: (float(lo), float(hi))
                           for k, (lo, hi) in (d.get("intervals") or {}).items()},
            )
        except KeyError as e:
            raise ValueError(
                f"eval result lacks field {e}; pass reports.eval's EvalResult") from None
        except (TypeError, AttributeError) as e:  # e.g. "kld": 3 in a hand-edited eval JSON
            raise ValueError(f"eval result has a field of the wrong type ({e}); pass "
                             "quantpipe.reports.eval's EvalResult") from None


@dataclass(frozen=True)
class PlanRow:
    """One layer of the resolved mixed-precision plan."""

    layer: str  # linear name, e.g. model.layers.0.mlp.down_proj
    bits: int | None  # 4 / 8; None = kept in FP16
    group_size: int | None  # -1 = per output channel; None when kept in FP16
    sym: bool | None
    act_order: bool = False


@dataclass(frozen=True)
class Fallback:
    """A numerical fallback taken during calibration (shown in the report, never hidden)."""

    layer: str
    kind: str  # e.g. "gptq_damping", "group_size", "expert_tokens" (MoE)
    detail: str  # e.g. "damp 0.01 -> 0.1 after a failed Cholesky"


@dataclass(frozen=True)
class CalibrationFacts:
    """How a candidate was calibrated, read from its ``quantpipe.json``."""

    algorithm: str  # rtn / gptq / awq
    samples: int | None  # calibration sequences
    seq_len: int | None  # tokens per sequence
    layer_errors: dict[str, float] = field(default_factory=dict)  # layer -> proxy loss
    plan: tuple[PlanRow, ...] = ()
    effective_bits: float | None = None  # weight bits per quantizable weight, incl. scales/zeros
    fallbacks: tuple[Fallback, ...] = ()
    # how the INT4 group sizes were chosen, e.g. "auto: 64 on 180 layers, 128 on 30" ("": not
    # recorded); group-size substitutions of an explicit request are fallbacks of kind
    # "group_size", shown apart from the numerical ones
    group_sizes: str = ""
    # a budget plan's validated upgrade paths (label -> ((bits, held-out KLD), ...)) and the
    # plan's own held-out KLD; empty / None when the plan was not validated
    validation_curves: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    validated_kld: float | None = None

    @classmethod
    def from_manifest(cls, manifest: dict) -> CalibrationFacts:
        """Read the facts from a quantized folder's manifest.

        Expected keys (missing optional ones are shown as "not recorded"):
        ``calibration: {algorithm, samples, seq_len, layer_errors: {layer: float},
        effective_bits, fallbacks: [{layer, kind, detail}]}`` and ``layers: {layer: spec}``
        (layers absent from ``layers`` but listed in ``calibration.kept_fp16`` are FP16).
        """
        if manifest.get("stage") not in (None, "quantized"):
            raise ValueError(
                f"manifest stage is {manifest.get('stage')!r}; pass a quantized folder's manifest"
            )
        cal = manifest.get("calibration") or {}
        if "algorithm" not in cal and "algorithm" not in manifest:
            raise ValueError("manifest has no calibration.algorithm; is this a quantized folder?")
        rows = [
            PlanRow(name, int(s["bits"]), int(s["group_size"]), bool(s["sym"]),
                    bool(s.get("act_order", False)))
            for name, s in (manifest.get("layers") or {}).items()
        ]
        rows += [PlanRow(name, None, None, None) for name in cal.get("kept_fp16", [])]
        fallbacks = tuple(
            Fallback(str(f.get("layer", "?")), str(f.get("kind", "?")), str(f.get("detail", "")))
            for f in cal.get("fallbacks", [])
        )
        eff = cal.get("effective_bits", manifest.get("effective_bits"))
        return cls(
            algorithm=str(cal.get("algorithm", manifest.get("algorithm"))),
            samples=cal.get("samples"),
            seq_len=cal.get("seq_len"),
            layer_errors={k: float(v) for k, v in (cal.get("layer_errors") or {}).items()},
            plan=tuple(rows),
            effective_bits=None if eff is None else float(eff),
            fallbacks=fallbacks,
        )

    @classmethod
    def from_calibration(cls, manifest: dict, layer_infos: dict[str, dict],
                         plan: dict | None = None) -> CalibrationFacts:
        """From a calibration artifact (``calibration.artifact.Calibration``) and its plan.

        ``manifest``: the calibration folder's ``quantpipe.json`` (stage ``calibration``);
        ``layer_infos``: ``Calibration.layer_infos()`` (layer -> {"w4"|"w8": {spec, loss,
        damp, damp_raises}}); ``plan``: ``calibration.mixed_precision.plan.Plan.to_dict()``
        (None: every layer at the artifact's INT4 spec). The proxy loss shown is that of the
        chosen bits.
        """
        if manifest.get("stage") != "calibration":
            raise ValueError(f"manifest stage is {manifest.get('stage')!r}; pass the manifest "
                             "of a `quantpipe calibrate` folder")
        settings = manifest.get("settings") or {}
        if plan is not None:
            chosen = {n: v["bits"] for n, v in plan["layers"].items()}
        else:
            chosen = {n: 4 for n in layer_infos}
        rows, errors, fallbacks = [], {}, []
        for name, bits in chosen.items():
            if bits is None:
                rows.append(PlanRow(name, None, None, None))
                continue
            info = layer_infos.get(name, {}).get(tag_of(bits))
            if info is None:
                raise ValueError(f"plan chooses {tag_of(bits)} for {name} but the calibration "
                                 "has no such result for it; re-plan from this calibration")
            spec = info["spec"]
            # act order is how GPTQ walked the columns: static groups with act-order store
            # no g_idx (their layer spec says False), so the calibration's setting decides
            act_order = bool(spec.get("act_order", False)) or bool(settings.get("act_order"))
            rows.append(PlanRow(name, int(spec["bits"]), int(spec["group_size"]),
                                bool(spec["sym"]), act_order))
            errors[name] = float(info["loss"])
            if info.get("damp_raises"):
                what = f"INT{bits}" if isinstance(bits, int) else bits
                fallbacks.append(Fallback(
                    name, "gptq_damping",
                    f"{what}: damping raised {info['damp_raises']} times to {info['damp']}"))
        requested = settings.get("group_size")
        for name, gs in (manifest.get("group_size_fallbacks") or {}).items():
            if name in chosen and chosen[name] == 4:
                fallbacks.append(Fallback(name, "group_size",
                                          f"--group-size {requested} -> {gs} (does not divide "
                                          "in_features)"))
        floor = manifest.get("min_expert_tokens")
        for name, tokens in (manifest.get("expert_fallbacks") or {}).items():
            if chosen.get(name) is not None:
                fallbacks.append(Fallback(name, "expert_tokens",
                                          f"{tokens} routed calibration tokens (< {floor}): RTN"))
        eff = None if plan is None else plan.get("effective_bits_per_weight")
        curves = {label: tuple((float(b), float(k)) for b, k in pts)
                  for label, pts in ((plan or {}).get("validation_curves") or {}).items()}
        validated = (plan or {}).get("validated_damage")
        return cls(
            algorithm=str(manifest.get("algo", settings.get("algo", "unknown"))),
            samples=settings.get("samples"),
            seq_len=settings.get("seq_len"),
            layer_errors=errors,
            plan=tuple(rows),
            effective_bits=None if eff is None else float(eff),
            fallbacks=tuple(fallbacks),
            group_sizes=_group_sizes_note(requested, manifest.get("int4_group_sizes") or {}),
            validation_curves=curves,
            validated_kld=None if validated is None else float(validated),
        )


def _group_sizes_note(requested: int | None, sizes: dict[str, int]) -> str:
    """"auto: 64 on 180 layers, 128 on 30" for a planned choice, "128 requested" otherwise."""
    if requested is not None:
        return f"{requested} requested"
    if not sizes:
        return ""
    counts: dict[int, int] = {}
    for gs in sizes.values():
        counts[gs] = counts.get(gs, 0) + 1
    return "auto (planned per layer): " + ", ".join(
        f"{'per channel' if gs == -1 else gs} on {n} layer{'s' if n > 1 else ''}"
        for gs, n in sorted(counts.items()))


@dataclass(frozen=True)
class SpeedRecord:
    """One bench measurement: ``{"name", "metric", "value", "unit", ...extra}``."""

    name: str  # what was measured, e.g. "int4-g128 decode bs=1"
    metric: str  # e.g. "tokens_per_s", "ttft_ms", "tpot_ms"
    value: float
    unit: str
    extra: dict[str, Any] = field(default_factory=dict)  # p50/p95/p99, batch, device ...

    def __post_init__(self) -> None:
        if not self.name or not self.metric:
            raise ValueError(f"speed record {self!r} needs a non-empty name and metric")
        if not math.isfinite(self.value):
            raise ValueError(f"speed record {self.name}/{self.metric} has value {self.value}")

    @classmethod
    def from_dict(cls, d: dict) -> SpeedRecord:
        missing = [k for k in ("name", "metric", "value", "unit") if k not in d]
        if missing:
            raise ValueError(f"speed record {d!r} lacks {missing}; bench JSON records need "
                             "name, metric, value and unit")
        extra = {k: v for k, v in d.items() if k not in ("name", "metric", "value", "unit")}
        return cls(str(d["name"]), str(d["metric"]), float(d["value"]), str(d["unit"]), extra)


def load_speed_records(path: str | os.PathLike) -> tuple[SpeedRecord, ...]:
    """Read bench JSON: a list of records, or an object with a ``records`` list."""
    obj = json.loads(Path(path).read_text(encoding="utf-8"))
    if isinstance(obj, dict):
        if "records" not in obj:
            raise ValueError(f"{path}: expected a list of records or {{'records': [...]}}")
        obj = obj["records"]
    if not isinstance(obj, list):
        raise ValueError(f"{path}: expected a JSON list of speed records")
    return tuple(SpeedRecord.from_dict(r) for r in obj)


@dataclass(frozen=True)
class ModelSpeed:
    """Speed and memory of one model (FP16 or a candidate) measured by the report itself while
    it answered the held-out prompts (``reports.answers``)."""

    name: str  # "FP16" or the candidate's name
    weight_bytes: int  # bytes of the folder's *.safetensors
    peak_rss_bytes: int | None  # process high-water mark while this model loaded and answered
    peak_rss_reset: bool  # False: the mark could not be reset (it covers the whole process)
    kv_bytes_per_token: int  # the engine's KV cache bytes per token (every layer's K and V)
    load_s: float  # seconds to load (and verify) the folder
    # concurrency -> {"requests", "output_tokens_per_s", "ttft_ms": {mean, p50, p95, p99},
    # "tpot_ms": {...}} (reports.answers.closed_loop)
    by_concurrency: dict[int, dict[str, Any]]
    activation_dtype: str = "float32"
    head_dtype: str = "fp16"
    kv_dtype: str = ""  # the KV cache's elements ("": the activation dtype; older reports)

    @classmethod
    def from_dict(cls, d: dict) -> ModelSpeed:
        d = dict(d)
        d["by_concurrency"] = {int(k): v for k, v in d["by_concurrency"].items()}
        return cls(**d)

    def kv_tokens(self, budget_bytes: int) -> int:
        """KV cache tokens that fit in ``budget_bytes`` beside the weights (0 if none)."""
        return max(0, budget_bytes - self.weight_bytes) // max(1, self.kv_bytes_per_token)


@dataclass(frozen=True)
class MachineInfo:
    """The machine the speed numbers come from."""

    cpu: str
    cpu_cores: int | None
    gpu: str | None  # None = no GPU
    system: str  # e.g. "Linux 6.1 x86_64"
    isa: str = ""  # the CPU's vector extensions that quantpipe's kernels use, e.g. "avx512_vnni"
    memory_bytes: int | None = None  # total RAM

    @classmethod
    def from_dict(cls, d: dict) -> MachineInfo:
        return cls(str(d.get("cpu", "unknown")), d.get("cpu_cores"), d.get("gpu"),
                   str(d.get("system", "unknown")), str(d.get("isa", "")), d.get("memory_bytes"))


# CPU flags (/proc/cpuinfo names) that decide which of quantpipe's CPU kernels run, and how fast
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_int8", "amx_bf16", "avx_vnni")


def detect_machine() -> MachineInfo:
    """CPU model from /proc/cpuinfo (platform fallback), GPU name from torch when present."""
    cpu = platform.processor() or platform.machine() or "unknown"
    flags: set[str] = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        named = False
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if not named and line.lower().startswith(("model name", "hardware", "cpu model")):
                cpu, named = line.split(":", 1)[1].strip(), True
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:  # torch is a core dependency; this only guards odd installs
        gpu = None
    try:
        import psutil

        memory = int(psutil.virtual_memory().total)
    except ImportError:
        memory = None
    return MachineInfo(cpu, os.cpu_count(), gpu,
                       f"{platform.system()} {platform.release()} {platform.machine()}",
                       " ".join(f for f in ISA_FLAGS if f in flags), memory)


@dataclass(frozen=True)
class CandidateData:
    """Everything known about one quantized candidate."""

    name: str  # short label, e.g. "int4-gptq-g128"
    path: str  # the candidate folder
    distribution: DistributionMetrics | None = None
    outputs: tuple[str, ...] | None = None  # greedy output per held-out prompt, same order
    calibration: CalibrationFacts | None = None
    weight_bytes: int | None = None  # bytes of the folder's *.safetensors (None: not known)

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError("candidate name is empty; give each candidate a short label")


@dataclass(frozen=True)
class Constraint:
    """What the recommendation must respect besides a passing verdict (None: no limit)."""

    max_kld: float | None = None  # mean KLD, nats: the interval's upper end where known
    max_bytes: int | None = None  # weight bytes on disk

    def __post_init__(self) -> None:
        if self.max_kld is not None and not (math.isfinite(self.max_kld) and self.max_kld > 0):
            raise ValueError(f"--max-kld {self.max_kld} must be a positive number of nats")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ValueError(f"--max-size {self.max_bytes} bytes must be positive")


@dataclass(frozen=True)
class ReportData:
    """The input of :func:`reports.html.render_quality_report`."""

    title: str
    reference: str  # FP16 folder
    candidates: tuple[CandidateData, ...]
    reference_bytes: int | None = None  # bytes of the FP16 folder's *.safetensors
    prompts: tuple[PromptRecord, ...] = ()  # held-out prompts (business-eval)
    reference_outputs: tuple[str, ...] | None = None  # FP16 greedy output per prompt
    speed: tuple[SpeedRecord, ...] = ()
    # speed and memory measured in this report's own run: FP16 first, then the candidates
    model_speed: tuple[ModelSpeed, ...] = ()
    memory_budget: int | None = None  # bytes for the "KV tokens that fit" column (None: none)
    machine: MachineInfo | None = None  # required when speed records are given
    thresholds: VerdictThresholds = field(default_factory=VerdictThresholds)
    constraint: Constraint = field(default_factory=Constraint)  # for the recommendation
    created: str = ""  # ISO time stamp shown in the header (empty: none shown)
    notes: tuple[str, ...] = ()  # free lines shown under the header (escaped)

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("a report needs at least one candidate")
        names = [c.name for c in self.candidates]
        if len(set(names)) != len(names):
            raise ValueError(f"candidate names {names} repeat; give each a distinct label")
        n = len(self.prompts)
        if self.reference_outputs is not None and len(self.reference_outputs) != n:
            raise ValueError(f"{len(self.reference_outputs)} FP16 outputs for {n} prompts; "
                             "generate one output per prompt")
        for c in self.candidates:
            if c.outputs is not None:
                if self.reference_outputs is None:
                    raise ValueError(f"candidate {c.name} has outputs but FP16 has none; "
                                     "pass reference_outputs")
                if len(c.outputs) != n:
                    raise ValueError(f"candidate {c.name}: {len(c.outputs)} outputs for {n} "
                                     "prompts; generate one output per prompt")
        if (self.speed or self.model_speed) and self.machine is None:
            raise ValueError("speed records need the machine; pass machine=detect_machine()")

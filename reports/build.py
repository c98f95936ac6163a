"""`quantpipe report`: measure reference and candidates, then write the HTML + JSON report.

Orchestration only: distribution metrics come from ``reports.eval`` (or earlier eval results),
the answers to the held-out prompts with their speed and memory from ``reports.answers`` (one
model resident at a time, through the serving engine), text metrics and the page from
``reports.textmetrics`` / ``reports.html``; this module assembles ``reports.data.ReportData``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantpipe.core.heap import fits_in_memory
from quantpipe.core.io import check_output_file, weights_bytes
from quantpipe.prompts.sets import SHIPPED_SETS, PromptRecord, load_prompt_records
from quantpipe.reports.answers import BATCH_CONCURRENCY, AnswerPrecision, answer_prompts
from quantpipe.reports.data import (
    CalibrationFacts,
    CandidateData,
    Constraint,
    DistributionMetrics,
    ReportData,
    SpeedRecord,
    detect_machine,
)
from quantpipe.reports.eval import (
    EvalSpec,
    check_candidate,
    load_texts,
    model_config,
    read_json_file,
    run_eval,
)
from quantpipe.reports.html import write_report
from quantpipe.reports.speed import read_speed_file

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReportSpec:
    reference: Path  # FP16 folder
    candidates: tuple[Path, ...]  # quantized folders
    out: Path  # report .html path (the .json lands beside it)
    prompts: str = "business-eval"  # held-out prompts: generations (and KLD unless text)
    text: Path | None = None  # score KLD on this text file instead of the prompts
    max_prompts: int = 0  # prompts answered side by side (spread over categories; 0: all)
    max_new_tokens: int = 96  # greedy tokens per generation
    eval_max_tokens: int = 0  # KLD token limit (0 = all)
    speed: tuple[Path, ...] = field(default_factory=tuple)  # speed-record JSON files
    evals: tuple[Path, ...] = field(default_factory=tuple)  # `eval --json` results to reuse
    memory_budget: int | None = None  # bytes for "KV tokens that fit" (None: this host's RAM)
    json_new_tokens: int = 256  # greedy tokens for a prompt expecting JSON (room to close it)
    kv_cache_memory: int | None = None  # answering engine's KV pool bytes at most (None: share
    # of the free memory; the pool never exceeds what 8 requests at once need)
    title: str = ""
    allow_other_source: bool = False  # report candidates made from other FP16 weights too
    constraint: Constraint = field(default_factory=Constraint)  # for the recommendation

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("give at least one --candidate QDIR")
        if self.out.suffix != ".html":
            raise ValueError(f"--out {self.out} must end in .html: the report writes NAME.html "
                             "and NAME.json beside it")
        if self.max_prompts < 0 or self.max_new_tokens < 1 or self.json_new_tokens < 1:
            raise ValueError("--max-prompts must be >= 0 (0: all), --max-new-tokens and "
                             "--json-new-tokens >= 1")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ValueError(f"--memory-budget {self.memory_budget} bytes must be positive")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory {self.kv_cache_memory} bytes must be positive")
        if self.eval_max_tokens < 0:
            raise ValueError(f"--eval-max-tokens {self.eval_max_tokens} must be >= 0 (0: all)")
        names = [c.name for c in self.candidates]
        if len(set(names)) != len(names):
            raise ValueError(f"candidate folders must have distinct names: {names}")


def spread(records: list[PromptRecord], k: int) -> list[PromptRecord]:
    """k records spread evenly over the list (which is grouped by category); 0: all."""
    if k == 0 or k >= len(records):
        return list(records)
    step = len(records) / k
    return [records[int(i * step)] for i in range(k)]


def calibration_facts(qdir: Path) -> CalibrationFacts | None:
    """Calibration facts of a quantized folder made by quantpipe (None for other tools')."""
    manifest_path = Path(qdir) / "quantpipe.json"
    if not manifest_path.is_file():
        return None
    manifest = read_json_file(manifest_path, "the manifest")
    calib = manifest.get("calibration") or {}
    calib_dir = Path(calib.get("path", ""))
    if calib and (calib_dir / "quantpipe.json").is_file():
        from quantpipe.calibration.artifact import read_calibration

        c = read_calibration(calib_dir)
        return CalibrationFacts.from_calibration(c.manifest, c.layer_infos(), manifest.get("plan"))
    log.warning("%s: calibration folder %s is gone; the report shows the manifest only",
                qdir, calib_dir)
    return None


def _model_name(fp16_dir: Path) -> str:
    """The source name recorded by export-fp16 (e.g. smollm2-135m), else the folder name."""
    manifest = Path(fp16_dir) / "quantpipe.json"
    if manifest.is_file():
        name = (read_json_file(manifest, "the manifest").get("source") or {}).get("name")
        if name:
            return Path(name).name
    return Path(fp16_dir).name


# GGUF file types whose weights are stored at full precision: dequantizing them is exact
_FULL_PRECISION_GGUF = ("ALL_F32", "MOSTLY_F16", "MOSTLY_BF16")


def reference_notes(fp16_dir: Path) -> tuple[str, ...]:
    """What a reader must know about the FP16 reference itself: one exported from a GGUF file
    that is quantized (the default model is a Q4_1 file) already carries that file's rounding,
    and every number of the report is measured against it, not against the original
    weights."""
    manifest = Path(fp16_dir) / "quantpipe.json"
    if not manifest.is_file():
        return ()
    source = read_json_file(manifest, "the manifest").get("source") or {}
    if source.get("kind") != "gguf":
        return ()
    path = Path(source.get("path", ""))
    file_type = _gguf_file_type(path)
    if file_type in _FULL_PRECISION_GGUF:
        return ()
    kind = ("a quantized GGUF file" if file_type is None else
            f"a {file_type.removeprefix('MOSTLY_')} GGUF file")
    return (f"The FP16 reference was dequantized from {kind} ({path.name}): it carries that "
            "file's own quantization, and every number here compares the candidate with it, "
            "not with the model's original weights.",)


def _gguf_file_type(path: Path) -> str | None:
    """``general.file_type`` of a GGUF file as gguf's LlamaFileType name, or None where the
    file or the field is missing or unknown."""
    try:
        import gguf

        field = gguf.GGUFReader(path).fields["general.file_type"]
        return gguf.LlamaFileType(int(field.parts[field.data[0]][0])).name
    except (ImportError, OSError, KeyError, ValueError, IndexError):
        return None


def _read_speed(path: Path) -> tuple[SpeedRecord, ...]:
    """One --speed file's records, or ValueError naming the file and what it should be."""
    try:
        return read_speed_file(path)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speed {path}: not valid JSON ({exc}); pass the JSON file a "
                         "benchmark wrote") from None
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        msg = f"a record lacks field {exc}" if isinstance(exc, KeyError) else str(exc)
        if str(path) in msg:
            raise
        raise ValueError(f"--speed {path}: {msg}; pass the unedited JSON of bench/decode.py, "
                         "bench/kernel_speed.py or bench-serve --json") from None


def _read_eval(path: Path) -> tuple[str, dict]:
    """(candidate folder, result) of an earlier `quantpipe eval --json`, checked."""
    d = read_json_file(path, "the eval result")
    try:
        DistributionMetrics.from_eval(d)
        return str(Path(d["candidate"]).resolve()), d
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{path}: not a `quantpipe eval --json` result ({exc}); run eval "
                         "again") from None


@dataclass(frozen=True)
class _Inputs:
    """Everything a report reads besides the models, read and checked before any loads."""

    records: list[PromptRecord]
    speed: tuple[SpeedRecord, ...]
    reuse: dict[str, dict]  # resolved candidate folder -> earlier eval result
    facts: dict[Path, CalibrationFacts | None]
    title: str


def check_report_inputs(spec: ReportSpec) -> _Inputs:
    """Cheap checks first, so that a typo fails at once rather than after the models ran:
    outputs writable, speed and eval JSON readable, prompts readable, candidates made from
    the reference (see :func:`reports.eval.check_candidate`)."""
    reads = {"--reference": spec.reference, "--text": spec.text,
             "--prompts": None if spec.prompts in SHIPPED_SETS else Path(spec.prompts),
             **{f"--candidate {i + 1}": p for i, p in enumerate(spec.candidates)},
             **{f"--speed {i + 1}": p for i, p in enumerate(spec.speed)},
             **{f"eval result {i + 1}": p for i, p in enumerate(spec.evals)}}
    check_output_file(spec.out, "--out", reads)
    check_output_file(spec.out.with_suffix(".json"), "--out (its .json beside it)", reads)
    speed = tuple(r for p in spec.speed for r in _read_speed(Path(p)))
    reuse = dict(_read_eval(Path(p)) for p in spec.evals)
    records = load_prompt_records(spec.prompts)
    for qdir in spec.candidates:
        check_candidate(spec.reference, qdir, spec.allow_other_source)
    facts = {qdir: calibration_facts(qdir) for qdir in spec.candidates}
    title = spec.title or f"{_model_name(spec.reference)}: quantized vs FP16"
    return _Inputs(records, speed, reuse, facts, title)


# prompt tokens assumed per request when the answering engine's KV pool is sized in advance
KV_PROMPT_TOKENS = 512
# prompt tokens per engine step where the reference only just fits: a 2,048-token prefill step
# of a 7B model holds ~0.4 GB of fp32 activations (gate/up alone: 2,048 x 22,016 x 4 bytes)
TIGHT_STEP_TOKENS = 512
# and its KV pool holds at most this (at least the longest request): the weights of a model that
# only just fits leave little beside them, and a pool for 8 long requests is gigabytes (2.5 GiB
# in bf16 for 16 business-eval prompts on a Llama-2-7B shape); fewer requests then run at once
TIGHT_KV_MEMORY = 2**30


def answer_precision(reference: Path, new_tokens: int = 0) -> AnswerPrecision:
    """fp32 activations and KV cache where the reference answering so fits
    (``quantpipe.core.heap.fits_in_memory``): its weights, plus an fp32 KV pool of
    ``BATCH_CONCURRENCY`` requests of ``KV_PROMPT_TOKENS`` + ``new_tokens`` tokens. Where
    quantpipe's CPU kernels run its linear layers on their fp16 weights
    (``runtime.fp_head.set_half_linears``) the weights take the shards' bytes whatever the
    activations, so a reference that does not fit keeps fp32 activations (exact products, the
    kernels' speed) and halves its KV cache to bf16: bf16 activations would hold a bf16 copy of
    the same size and run on torch's slower bf16 matmuls. Without the kernels an fp32 copy
    takes twice the shards: bf16 activations then. Either way such a reference (and every
    candidate) reads prompts ``TIGHT_STEP_TOKENS`` per engine step, not the engine's 2,048,
    into a KV pool of at most ``TIGHT_KV_MEMORY`` unless ``--kv-cache-memory`` says otherwise:
    smaller activations and pool, fewer requests at once, the same answers. Said on the
    page."""
    from quantpipe.runtime.kernels import cpu_ext
    from quantpipe.runtime.memory_plan import ModelDims, kv_bytes_per_token

    kernels = cpu_ext.kernel_status()[0]
    # K and V of every layer in fp32, per token (the serving memory planner's count)
    kv_token = kv_bytes_per_token(ModelDims.from_config(model_config(reference), "float32"))
    kv = BATCH_CONCURRENCY * (KV_PROMPT_TOKENS + new_tokens) * kv_token
    need = (1 if kernels else 2) * weights_bytes(reference) + kv
    fits, have = fits_in_memory(need)
    if fits:
        return AnswerPrecision(torch.float32, "model")
    held = "its fp16 weights" if kernels else "an fp32 copy"
    why = (f"the FP16 reference with fp32 activations ({held}) and an fp32 KV cache for "
           f"{BATCH_CONCURRENCY} requests needs {need / 2**30:.1f} GiB and "
           f"{have / 2**30:.1f} GiB were available.")
    steps = (f" Prompts were read {TIGHT_STEP_TOKENS} tokens per step, and the KV cache held "
             f"at most {TIGHT_KV_MEMORY / 2**30:g} GiB (the longest request at least).")
    if kernels:
        return AnswerPrecision(torch.float32, "bf16",
                               f"Answers were generated with a bf16 KV cache: {why}{steps}",
                               TIGHT_STEP_TOKENS, TIGHT_KV_MEMORY)
    return AnswerPrecision(torch.bfloat16, "model",
                           f"Answers were generated with bf16 activations: {why}{steps}",
                           TIGHT_STEP_TOKENS, TIGHT_KV_MEMORY)


def build_report(spec: ReportSpec) -> tuple[Path, Path]:
    t0 = time.perf_counter()
    inputs = check_report_inputs(spec)
    measure = [q for q in spec.candidates if str(Path(q).resolve()) not in inputs.reuse]
    texts = (load_texts(spec.reference, spec.text, None if spec.text else spec.prompts,
                        spec.eval_max_tokens) if measure else ())
    evals = dict(inputs.reuse)
    for qdir in measure:  # block by block where two whole models would not fit (run_eval)
        ev = run_eval(EvalSpec(spec.reference, qdir, texts, spec.eval_max_tokens,
                               allow_other_source=spec.allow_other_source)).to_dict()
        log.info("%s: KLD mean %.5f", qdir, ev["kld"]["mean"])
        evals[str(Path(qdir).resolve())] = ev
    chosen = spread(inputs.records, spec.max_prompts)
    precision = answer_precision(spec.reference,
                                 max(spec.max_new_tokens, spec.json_new_tokens))
    # one model resident at a time: the reference answers, is released, then each candidate
    ref = answer_prompts(spec.reference, "FP16", chosen, spec.max_new_tokens, precision,
                         spec.json_new_tokens, spec.kv_cache_memory)
    candidates, speeds = [], [ref.speed]
    for qdir in spec.candidates:
        ans = answer_prompts(qdir, Path(qdir).name, chosen, spec.max_new_tokens, precision,
                             spec.json_new_tokens, spec.kv_cache_memory)
        speeds.append(ans.speed)
        candidates.append(CandidateData(
            name=Path(qdir).name, path=str(qdir),
            distribution=DistributionMetrics.from_eval(evals[str(Path(qdir).resolve())]),
            outputs=ans.texts, calibration=inputs.facts[qdir],
            weight_bytes=weights_bytes(qdir)))
    machine = detect_machine()
    data = ReportData(
        title=inputs.title,
        reference=str(spec.reference),
        reference_bytes=weights_bytes(spec.reference),
        prompts=tuple(chosen),
        reference_outputs=ref.texts,
        candidates=tuple(candidates),
        speed=inputs.speed,
        model_speed=tuple(s for s in speeds if s is not None),
        memory_budget=spec.memory_budget or machine.memory_bytes,
        machine=machine,
        created=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        notes=reference_notes(spec.reference) + tuple(
            n for n in (precision.note, ref.note) if n),
        constraint=spec.constraint,
    )
    paths = write_report(data, spec.out)
    log.info("report written in %.1fs", time.perf_counter() - t0)
    return paths

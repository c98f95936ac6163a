"""`quantpipe run`: the whole pipeline, stage by stage, resumable.

WORKDIR/fp16 (export-fp16) -> WORKDIR/calib (calibrate) -> WORKDIR/int{bits} (export)
-> WORKDIR/eval.json (eval on the held-out prompts) -> WORKDIR/report.html (report).

A stage whose output is complete (its manifest exists) is skipped, so re-running after an
interruption continues where it stopped; calibration itself resumes at its last finished block.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from quantpipe.core.io import MANIFEST_NAME, write_json_atomic
from quantpipe.core.qformat import check_bits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSpec:
    source: str  # model folder, .gguf, or smollm2-135m
    out: Path  # WORKDIR
    bits: int = 4
    budget_bits: float | None = None  # mixed precision (runs `sensitivity` first)
    overrides: tuple[str, ...] = field(default_factory=tuple)
    algo: str = "gptq"
    group_size: int | None = None  # None: calibrate's auto (planned per layer)
    sym: bool = True
    samples: int = 32  # calibration sequences (the full `calibrate` default is 128)
    seq_len: int = 512
    prompts: str = "business-calib"
    eval_prompts: str = "business-eval"
    eval_tokens: int = 8192  # held-out tokens scored for KLD (0 = all ~25k)
    report_prompts: int = 16  # side-by-side generations in the report
    max_new_tokens: int = 64
    speed: tuple[Path, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        check_bits(self.bits, "--bits ")


@dataclass(frozen=True)
class RunResult:
    out: Path
    report: Path
    eval: dict
    stages: dict[str, float]  # stage -> seconds (0.0 when reused)


def _done(folder: Path) -> bool:
    return (folder / MANIFEST_NAME).is_file()


def run_pipeline(spec: RunSpec) -> RunResult:
    from quantpipe.calibration.pipeline import CalibrateSpec, calibrate
    from quantpipe.reports.build import ReportSpec, build_report
    from quantpipe.reports.eval import EvalSpec, load_texts, run_eval
    from quantpipe.stages.export import ExportSpec, export_quantized
    from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16

    out = Path(spec.out)
    fp16, calib = out / "fp16", out / "calib"
    qdir = out / (f"int{spec.bits}" if spec.budget_bits is None else f"mixed-{spec.budget_bits}")
    # every stage's spec is built (and its options validated) before the first stage runs
    fp16_spec = Fp16ExportSpec(spec.source, fp16, force=fp16.exists())
    calib_spec = CalibrateSpec(fp16, calib, spec.prompts, algo=spec.algo,
                               group_size=spec.group_size, sym=spec.sym, samples=spec.samples,
                               seq_len=spec.seq_len)
    export_spec = ExportSpec(calib, qdir, bits=spec.bits, budget_bits=spec.budget_bits,
                             overrides=spec.overrides, force=qdir.exists())
    out.mkdir(parents=True, exist_ok=True)
    stages: dict[str, float] = {}

    def stage(name: str, done: bool, fn) -> None:
        if done:
            log.info("stage %s: reusing %s", name, out)
            stages[name] = 0.0
            return
        t0 = time.perf_counter()
        log.info("stage %s ...", name)  # -v; by default the stage's progress bars show
        fn()
        stages[name] = time.perf_counter() - t0

    stage("export-fp16", _done(fp16), lambda: export_fp16(fp16_spec))
    stage("calibrate", _done(calib), lambda: calibrate(calib_spec))
    if spec.budget_bits is not None:
        from quantpipe.calibration.sensitivity import SensitivitySpec, measure_sensitivity

        stage("sensitivity", (calib / "sensitivity.json").is_file(),
              lambda: measure_sensitivity(SensitivitySpec(calib)))
    stage("export", _done(qdir), lambda: export_quantized(export_spec))
    eval_json = out / "eval.json"

    def do_eval() -> None:
        texts = load_texts(fp16, None, spec.eval_prompts)
        write_json_atomic(eval_json,
                          run_eval(EvalSpec(fp16, qdir, texts, spec.eval_tokens)).to_dict())

    stage("eval", eval_json.is_file(), do_eval)
    report = out / "report.html"
    stage("report", report.is_file(), lambda: build_report(ReportSpec(
        fp16, (qdir,), report, spec.eval_prompts, max_prompts=spec.report_prompts,
        max_new_tokens=spec.max_new_tokens, speed=spec.speed, evals=(eval_json,))))
    return RunResult(out, report, json.loads(eval_json.read_text()), stages)

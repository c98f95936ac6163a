"""`quantpipe run`: the whole pipeline, stage by stage, resumable.

WORKDIR/fp16 (export-fp16) -> WORKDIR/calib (calibrate) -> WORKDIR/int{bits} (export)
-> WORKDIR/eval.json (eval on the held-out prompts) -> WORKDIR/report.html (report).

Several candidates from one calibration (``--bits 4 --bits 8 --budget-bits 4.5``): one
WORKDIR/int{bits} per ``--bits`` and WORKDIR/mixed-{budget} for the budget, each exported and
evaluated (WORKDIR/eval-{candidate}.json), then one report of them all with its
recommendation. ``--budget-bits`` alone makes the mixed candidate only, nothing the uniform one.

A stage whose output is complete (its manifest exists) is skipped, so re-running after an
interruption continues where it stopped; calibration itself resumes at its last finished block.
That reuse is safe only for the same run: WORKDIR/run.json records the sha256 of the source
(and of a prompt or speed file) and every option, written before the first stage; a run into a
WORKDIR whose record differs is refused, listing each difference. A WORKDIR without that record
(a folder of the user's) is used only when empty, a stage output that exists unfinished was not
made by quantpipe (every stage writes atomically) and is refused by name, and no stage is ever
forced: nothing in WORKDIR that quantpipe run did not make is modified.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from quantpipe.calibration.config import DEFAULTS as CALIB
from quantpipe.calibration.menu import DEFAULT_MENU, parse_menu
from quantpipe.calibration.mixed_precision.plan import check_budget_bits
from quantpipe.core.heap import PeakSince
from quantpipe.core.io import MANIFEST_NAME, parse_size, write_json_atomic
from quantpipe.core.qformat import check_bits
from quantpipe.core.sources import resolve_source
from quantpipe.core.verified import file_key

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSpec:
    source: str  # model folder, .gguf, or smollm2-135m
    out: Path  # WORKDIR
    # uniform candidates, one per precision (an int: one); (): INT4, or none with budget_bits
    bits: tuple[int, ...] | int = ()
    budget_bits: float | None = None  # the mixed candidate (runs `sensitivity` first)
    # or the mixed candidate's checkpoint size ("120MB": export --budget-size), checked
    # against the FP16 folder before calibrating and exactly when the plan is made
    budget_size: str | None = None
    overrides: tuple[str, ...] = field(default_factory=tuple)
    algo: str = CALIB.algo
    group_size: int | None = CALIB.group_size  # None: calibrate's auto (planned per layer)
    sym: bool = CALIB.sym
    int8_group_size: int = CALIB.int8_group_size  # -1: one INT8 scale per output row
    samples: int = CALIB.run_samples  # calibration sequences (fewer than calibrate's)
    seq_len: int = CALIB.seq_len
    prompts: str = CALIB.prompts
    eval_prompts: str = CALIB.eval_prompts
    eval_tokens: int = CALIB.eval_tokens  # held-out tokens scored for KLD (0 = all ~25k)
    report_prompts: int = CALIB.report_prompts  # side-by-side generations in the report
    max_new_tokens: int = CALIB.report_new_tokens
    speed: tuple[Path, ...] = field(default_factory=tuple)
    # calibrate --menu; (): the default menu when there is a mixed candidate (budget_bits),
    # else none ("none": none at all)
    menu: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        bits = (self.bits,) if isinstance(self.bits, int) else tuple(self.bits)
        if not bits and not self.mixed:
            bits = (4,)
        object.__setattr__(self, "bits", bits)
        for b in bits:
            check_bits(b, "--bits ")
        if len(set(bits)) != len(bits):
            raise ValueError(f"--bits {list(bits)} repeats a precision; give each once")
        check_budget_bits(self.budget_bits)
        if self.budget_size is not None:
            parse_size(self.budget_size, "--budget-size")
            if self.budget_bits is not None:
                raise ValueError("give --budget-bits or --budget-size, not both")
        parse_menu(self.menu)  # ValueError naming a malformed entry

    @property
    def mixed(self) -> bool:
        """Whether the run has a mixed-precision candidate (--budget-bits or --budget-size)."""
        return self.budget_bits is not None or self.budget_size is not None

    def calibration_menu(self) -> tuple[str, ...]:
        """The menu the run's calibration computes (see ``menu``)."""
        if self.menu:
            return parse_menu(self.menu)
        return DEFAULT_MENU if self.mixed else ()

    def candidates(self) -> tuple[tuple[str, int, float | str | None], ...]:
        """(WORKDIR folder name, bits, budget) of every candidate, uniform ones first; a
        budget is bits per weight (a float) or a size as given ("120MB")."""
        out = tuple((f"int{b}", b, None) for b in self.bits)
        budget = self.budget_bits if self.budget_bits is not None else self.budget_size
        if budget is not None:
            name = str(budget).replace(" ", "")
            out += ((f"mixed-{name}", self.bits[0] if self.bits else 4, budget),)
        return out


@dataclass(frozen=True)
class RunResult:
    out: Path
    report: Path
    eval: dict  # the first candidate's
    stages: dict[str, float]  # stage -> seconds (0.0 when reused)
    evals: dict[str, dict] = field(default_factory=dict)  # candidate folder name -> its eval
    # stage -> the process's resident-memory peak while it ran, in bytes (the high-water mark
    # is reset before each stage); None when reused, or where the mark cannot be reset
    peaks: dict[str, int | None] = field(default_factory=dict)


RUN_FILE = "run.json"  # WORKDIR's record of the run's settings (see the module docstring)
RUN_FILE_VERSION = 1
_CHUNK = 1 << 22  # bytes hashed at a time: a multi-GB source is streamed, never held


def _done(folder: Path) -> bool:
    return (folder / MANIFEST_NAME).is_file()


def _tree_files(path: Path) -> list[Path]:
    """``path`` itself, or a folder's files in name order (hidden ones, such as a hub cache's,
    left out)."""
    return [path] if path.is_file() else sorted(
        f for f in path.rglob("*")
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(path).parts))


def tree_keys(path: Path) -> dict[str, list[int]]:
    """``{file: [size, mtime_ns, inode, ctime_ns]}`` of what :func:`sha256_tree` reads: while
    these are unchanged, so are the bytes (any write moves ctime)."""
    return {str(f): file_key(f) for f in _tree_files(path)}


def sha256_tree(path: Path) -> str:
    """sha256 of a file, or of a folder's files (relative names, sizes and contents, in name
    order; hidden files and folders such as a hub cache's are left out)."""
    h = hashlib.sha256()
    for f in _tree_files(path):
        h.update(f"{f.relative_to(path) if f != path else f.name}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def run_settings(spec: RunSpec, previous: dict | None = None
                 ) -> tuple[dict[str, str], dict[str, list[int]]]:
    """What a run into an existing WORKDIR must match to reuse its stages: every option, the
    source's sha256 (a folder's files, the .gguf file, or the packaged default model's file),
    and the sha256 of a prompt file and of every speed file. Paths are not compared: the same
    bytes moved elsewhere are the same run. Also returns the source files' keys: while they
    equal ``previous`` run record's, its source hash is reused instead of reading a multi-GB
    source again on every re-run."""
    t0 = time.perf_counter()
    src = resolve_source(spec.source)
    settings = {k: json.dumps(v, sort_keys=True) for k, v in asdict(spec).items()
                if k not in ("source", "out", "speed", "menu", "int8_group_size", "budget_size")}
    # (runs without a menu record none, and per-channel INT8 records no group size, as before
    # either option existed)
    if spec.calibration_menu():
        settings["menu"] = json.dumps(list(spec.calibration_menu()))
    if spec.int8_group_size != -1:
        settings["int8_group_size"] = json.dumps(spec.int8_group_size)
    if spec.budget_size is not None:  # (nor does a run without one)
        settings["budget_size"] = json.dumps(parse_size(spec.budget_size))
    # one precision is recorded as the number it was before --bits could repeat (and a
    # budget-only run as the 4 it recorded then), so earlier WORKDIRs are still reused
    bits = spec.bits or (4,)
    settings["bits"] = json.dumps(bits[0] if len(bits) == 1 else list(bits))
    keys = tree_keys(src.path)
    known = (previous or {}).get("settings", {}).get("source_sha256")
    if known and (previous or {}).get("source_keys") == keys:
        settings["source_sha256"] = known
    else:
        settings["source_sha256"] = sha256_tree(src.path)
    for key, name in (("prompts", spec.prompts), ("eval_prompts", spec.eval_prompts)):
        path = Path(name).expanduser()
        if path.exists():  # a file or dataset folder; a shipped set's name stays a name
            settings[key] = json.dumps({"sha256": sha256_tree(path)})
    settings["speed"] = json.dumps([sha256_tree(Path(p)) for p in spec.speed])
    log.info("hashed the run's source %s and inputs in %.1fs", src.path,
             time.perf_counter() - t0)
    return settings, keys


def _read_record(out: Path) -> dict | None:
    """WORKDIR's run record, or None (absent or unreadable: :func:`_check_workdir` says why)."""
    try:
        record = json.loads((out / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _differences(before: dict, now: dict) -> list[str]:
    return [f"{k}: {before.get(k)} before, {now.get(k)} now"
            for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]


def _check_workdir(out: Path, settings: dict[str, str], outputs: tuple[Path, ...]) -> bool:
    """Whether WORKDIR may hold this run (see the module docstring); True when its record
    must be written. Raises, touching nothing, where it may not."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder; choose another --out")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    record = out / RUN_FILE
    if not record.is_file():
        if entries:
            raise ValueError(
                f"{out} holds {', '.join(entries[:8])}{' ...' if len(entries) > 8 else ''} "
                f"but no {RUN_FILE}: not a WORKDIR made by quantpipe run, and nothing in it is "
                "touched; choose a new or empty --out")
        return True
    try:
        before = json.loads(record.read_text(encoding="utf-8"))["settings"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{record}: not a quantpipe run record ({exc}); choose another "
                         "--out") from None
    diffs = _differences(before, settings)
    made = [e for e in entries if e != RUN_FILE and not e.startswith(".")]  # (locks are hidden)
    # with only the record of a run that made nothing yet, start anew; and the FP16 export
    # depends on the source alone, so a run that made only that may change any other option
    # (e.g. a --budget-size refused after export-fp16, before calibrating)
    only_fp16 = set(made) <= {"fp16"} and before.get("source_sha256") == settings.get(
        "source_sha256")
    if diffs and made and not only_fp16:
        raise ValueError(
            f"{out} holds a run with other settings (" + "; ".join(diffs) + "); re-run with "
            "the earlier settings to continue it, or choose another --out")
    foreign = [str(p) for p in outputs if p.exists() and not _done(p)]
    if foreign:
        raise ValueError(
            f"{', '.join(foreign)}: exists without a quantpipe manifest, so quantpipe run did "
            "not make it (its stages write complete folders only) and will not replace it; "
            "move it away or choose another --out")
    return bool(diffs)


def run_pipeline(spec: RunSpec) -> RunResult:
    from quantpipe.calibration.pipeline import CalibrateSpec, calibrate
    from quantpipe.reports.build import ReportSpec, build_report
    from quantpipe.reports.eval import EvalSpec, load_texts, run_eval
    from quantpipe.runtime.kernels import cpu_ext
    from quantpipe.stages.export import (
        ExportSpec,
        check_budget_size_reachable,
        export_quantized,
    )
    from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16

    out = Path(spec.out)
    fp16, calib = out / "fp16", out / "calib"
    many = len(spec.candidates()) > 1
    # every stage's spec is built (and its options validated) before the first stage runs;
    # no stage is forced: an output quantpipe did not make is refused, never replaced
    fp16_spec = Fp16ExportSpec(spec.source, fp16)
    calib_spec = CalibrateSpec(fp16, calib, spec.prompts, algo=spec.algo,
                               group_size=spec.group_size, sym=spec.sym,
                               int8_group_size=spec.int8_group_size, samples=spec.samples,
                               seq_len=spec.seq_len, menu=spec.calibration_menu())
    exports = {name: ExportSpec(calib, out / name, bits=bits, overrides=spec.overrides,
                                budget_bits=None if isinstance(budget, str) else budget,
                                budget_size=budget if isinstance(budget, str) else None)
               for name, bits, budget in spec.candidates()}
    qdirs = [e.out for e in exports.values()]
    previous = _read_record(out)
    settings, source_keys = run_settings(spec, previous)
    if (_check_workdir(out, settings, (fp16, calib, *qdirs))
            or (previous or {}).get("source_keys") != source_keys):
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / RUN_FILE, {"version": RUN_FILE_VERSION, "source": spec.source,
                                           "settings": settings, "source_keys": source_keys})
    stages: dict[str, float] = {}
    peaks: dict[str, int | None] = {}

    def stage(name: str, done: bool, fn) -> None:
        if done:
            log.info("stage %s: reusing %s", name, out)
            stages[name], peaks[name] = 0.0, None
            return
        gc.collect()  # what the previous stage left unreferenced is not counted as this one's
        peak = PeakSince()
        t0 = time.perf_counter()
        log.info("stage %s ...", name)  # -v; by default the stage's progress bars show
        fn()
        stages[name] = time.perf_counter() - t0
        peaks[name] = peak.bytes()

    if not (out / "report.html").is_file():
        # the report answers on quantpipe's CPU kernels; a first build takes 15-30 s of one
        # core, which the FP16 export (mostly one thread) leaves idle
        cpu_ext.build_in_background()
    stage("export-fp16", _done(fp16), lambda: export_fp16(fp16_spec))
    if spec.budget_size is not None and not _done(calib):  # before hours of calibration
        check_budget_size_reachable(fp16, parse_size(spec.budget_size))
    stage("calibrate", _done(calib), lambda: calibrate(calib_spec))
    if spec.mixed:
        from quantpipe.calibration.mixed_precision.sensitivity import (
            SensitivitySpec,
            measure_sensitivity,
        )

        stage("sensitivity", (calib / "sensitivity.json").is_file(),
              lambda: measure_sensitivity(SensitivitySpec(calib)))
    eval_files = {}
    for name, export_spec in exports.items():
        suffix = f" {name}" if many else ""
        stage("export" + suffix, _done(export_spec.out),
              lambda e=export_spec: export_quantized(e))
        eval_json = out / (f"eval-{name}.json" if many else "eval.json")

        def do_eval(qdir=export_spec.out, path=eval_json) -> None:
            texts = load_texts(fp16, None, spec.eval_prompts)
            write_json_atomic(path,
                              run_eval(EvalSpec(fp16, qdir, texts, spec.eval_tokens)).to_dict())

        stage("eval" + suffix, eval_json.is_file(), do_eval)
        eval_files[name] = eval_json
    report = out / "report.html"
    stage("report", report.is_file(), lambda: build_report(ReportSpec(
        fp16, tuple(qdirs), report, spec.eval_prompts, max_prompts=spec.report_prompts,
        max_new_tokens=spec.max_new_tokens, speed=spec.speed,
        evals=tuple(eval_files.values()))))
    evals = {name: json.loads(path.read_text()) for name, path in eval_files.items()}
    return RunResult(out, report, next(iter(evals.values())), stages, evals, peaks)

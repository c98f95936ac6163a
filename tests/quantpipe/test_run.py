"""`quantpipe run` on a tiny model: every stage, then a resumed run that reuses them all; a
run with another source or other options, or into folders quantpipe did not make, is refused."""

import json
import logging
import re
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from quantpipe.cli import main
from tests.quantpipe.test_cli_errors import assert_one_line_error
from tests.tiny_models import make_model, save_model


def _snapshot(folder):
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*"))
            if f.is_file()}


def test_run_end_to_end_and_resume(tiny_llama_dir, tmp_path, caplog):
    out = tmp_path / "work"
    args = ["run", str(tiny_llama_dir), "--out", str(out), "--samples", "4", "--seq-len", "64"]
    with caplog.at_level(logging.INFO):
        r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    # stage starts are INFO (-v); a default run of a model the defaults fit warns of nothing
    # (--group-size auto plans the tiny model's 64- and 128-wide layers)
    starts = [r for r in caplog.records if r.getMessage().startswith("stage ")]
    assert len(starts) == 5 and {r.levelno for r in starts} == {logging.INFO}
    warned = [r.getMessage() for r in caplog.records
              if r.levelno >= logging.WARNING and r.name.startswith("quantpipe")]
    assert warned == []
    for stage in ("fp16", "calib", "int4"):
        assert (out / stage / "quantpipe.json").is_file()
    ev = json.loads((out / "eval.json").read_text())
    assert ev["tokens"] > 1000 and ev["kld"]["mean"] > 0
    report = json.loads((out / "report.json").read_text())
    # the report reuses the eval numbers instead of measuring again
    assert report["candidates"][0]["distribution"]["kld"]["mean"] == ev["kld"]["mean"]
    page = (out / "report.html").read_text()
    assert "<svg" in page
    # every shipped held-out prompt answered; the tiny model's 256-token context is too short
    # for the longer ones with their answers, and the page says so
    assert len(report["prompts"]) == 80 and len(report["outputs"]["reference"]) == 80
    assert "do not fit the model&#x27;s 256-token context" in page
    assert "speed (output tokens/s at concurrency 8, this host): FP16 " in r.output
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0, again.output
    assert "export-fp16 0s, calibrate 0s, export 0s, eval 0s, report 0s" in again.output

    # another source (same layout, other weights) or other options: refused, naming each
    # difference, before anything is touched (it used to return the first model's report)
    before = _snapshot(out)
    model, tok = make_model("llama", seed=1)
    other = save_model(model, tok, tmp_path / "other")
    r = CliRunner().invoke(main, ["run", str(other), *args[2:]])
    assert_one_line_error(r, f"{out} holds a run with other settings (source_sha256: ")
    r = CliRunner().invoke(main, [*args, "--samples", "8", "--bits", "8"])
    assert_one_line_error(r, "other settings (bits: 4 before, 8 now; samples: 4 before, 8 now)")
    assert _snapshot(out) == before

    # a stage folder quantpipe did not make (no manifest) is never replaced
    shutil.rmtree(out / "int4")
    (out / "int4").mkdir()
    (out / "int4" / "mine.txt").write_text("keep")
    r = CliRunner().invoke(main, args)
    assert_one_line_error(r, f"{out / 'int4'}: exists without a quantpipe manifest")
    assert (out / "int4" / "mine.txt").read_text() == "keep"
    assert json.loads((out / "run.json").read_text())["settings"]["samples"] == "4"


def test_run_touches_nothing_in_a_folder_it_did_not_make(tiny_llama_dir, tmp_path):
    """A WORKDIR holding the user's own fp16/ (no run record) is refused, not overwritten."""
    out = tmp_path / "work"
    (out / "fp16").mkdir(parents=True)
    (out / "fp16" / "config.json").write_text("{}")
    before = _snapshot(out)
    r = CliRunner().invoke(main, ["run", str(tiny_llama_dir), "--out", str(out), "--samples",
                                  "4", "--seq-len", "64", "--group-size", "32"])
    assert_one_line_error(r, f"{out} holds fp16 but no run.json: not a WORKDIR made by "
                          "quantpipe run")
    assert _snapshot(out) == before


def test_run_refuses_an_unreachable_budget_before_any_stage(tiny_llama_dir, tmp_path):
    """INT4 alone is 4 bits per weight: a budget of 1 used to calibrate and measure
    sensitivity before export refused it."""
    from quantpipe.stages.export import ExportSpec

    r = CliRunner().invoke(main, ["run", str(tiny_llama_dir), "--out", str(tmp_path / "w"),
                                  "--group-size", "32", "--budget-bits", "1"])
    assert_one_line_error(r, "--budget-bits 1.0 is outside the range a plan can reach, (4, 16]")
    assert not (tmp_path / "w").exists()
    with pytest.raises(ValueError, match="outside the range"):  # before CALIB_DIR is read
        ExportSpec(tmp_path / "missing", tmp_path / "q", budget_bits=1)


def test_run_with_budget_measures_sensitivity(tiny_llama_dir, tmp_path):
    out = tmp_path / "work"
    r = CliRunner().invoke(main, ["run", str(tiny_llama_dir), "--out", str(out), "--samples", "4",
                                  "--seq-len", "64", "--group-size", "32", "--budget-bits", "6",
                                  "--eval-tokens", "512"])
    assert r.exit_code == 0, r.output
    assert (out / "calib" / "sensitivity.json").is_file()
    assert not (out / "int4").exists()  # --budget-bits alone: the mixed candidate only
    plan = json.loads((out / "mixed-6.0" / "quantpipe.json").read_text())["plan"]
    assert 4.5 < plan["effective_bits_per_weight"] <= 6.0
    assert plan["counts"]["int8"] + plan["counts"]["fp16"] > 0


def test_run_with_a_budget_size(tiny_llama_dir, tmp_path):
    """--budget-size out of reach is refused after export-fp16, before calibrating; the same
    WORKDIR then takes a reachable size (only the FP16 export exists, which depends on the
    source alone), and the mixed candidate's tensors fit it."""
    from quantpipe.core.io import LazyTensors

    out = tmp_path / "work"
    args = ["run", str(tiny_llama_dir), "--out", str(out), "--samples", "4", "--seq-len", "64",
            "--group-size", "32", "--eval-tokens", "512", "--budget-size"]
    r = CliRunner().invoke(main, [*args, "1kB"])
    assert_one_line_error(r, "--budget-size 1 kB is outside what any plan of")
    assert (out / "fp16" / "quantpipe.json").is_file() and not (out / "calib").exists()
    fp16 = LazyTensors.of_folder(out / "fp16")
    matrices = sum(fp16.nbytes(k) for k in fp16 if k.startswith("model.layers.")
                   and len(fp16.shape(k)) == 2)
    total = sum(fp16.nbytes(k) for k in fp16)
    size = total - matrices + int(0.6 * matrices)  # the linears at ~9.6 bits per weight
    r = CliRunner().invoke(main, [*args, f"{size}B"])
    assert r.exit_code == 0, r.output
    qdir = out / f"mixed-{size}B"
    written = LazyTensors.of_folder(qdir)
    # above uniform INT4 g32 (4.5 bits: 0.28 of the FP16 matrices), within the size
    assert total - 0.7 * matrices < sum(written.nbytes(k) for k in written) <= size
    plan = json.loads((qdir / "quantpipe.json").read_text())["plan"]
    assert plan["counts"]["int8"] + plan["counts"]["fp16"] > 0
    assert json.loads((out / "run.json").read_text())["settings"]["budget_size"] == str(size)
    with pytest.raises(ValueError, match="not both"):
        from quantpipe.stages.run import RunSpec

        RunSpec("s", out, budget_bits=5.0, budget_size="1GB")


def test_default_logging_shows_warnings_and_v_shows_info():
    code = ("import logging; from quantpipe.cli import configure_logging; "
            "configure_logging({v}); log = logging.getLogger('quantpipe.x'); "
            "log.info('an info'); log.warning('a warning')")
    for v, want in ((0, ["WARNING quantpipe.x: a warning"]),
                    (1, ["INFO quantpipe.x: an info", "WARNING quantpipe.x: a warning"])):
        err = subprocess.run([sys.executable, "-c", code.format(v=v)], capture_output=True,
                             text=True, check=True).stderr
        assert [line.split(" ", 2)[2] for line in err.splitlines()] == want


def test_group_size_default_is_the_same_auto_on_the_command_line_and_in_the_library():
    import click
    import pytest

    from quantpipe.calibration.pipeline import CalibrateSpec
    from quantpipe.stages.run import RunSpec

    for command, spec in (("calibrate", CalibrateSpec), ("run", RunSpec)):
        option = next(p for p in main.commands[command].params if p.name == "group_size")
        ctx = click.Context(main.commands[command])
        assert option.process_value(ctx, option.default) is None
        assert spec.__dataclass_fields__["group_size"].default is None
        assert option.process_value(ctx, "64") == 64
        with pytest.raises(click.BadParameter, match="auto or an integer"):
            option.process_value(ctx, "big")


def test_a_rerun_reuses_the_source_hash_while_the_files_are_untouched(tiny_llama_dir, tmp_path,
                                                                      monkeypatch):
    from quantpipe.stages import run as run_mod

    src = tmp_path / "src"
    shutil.copytree(tiny_llama_dir, src)
    spec = run_mod.RunSpec(str(src), tmp_path / "work")
    settings, keys = run_mod.run_settings(spec)
    record = {"settings": settings, "source_keys": keys}
    hashed = []
    real = run_mod.sha256_tree
    monkeypatch.setattr(run_mod, "sha256_tree", lambda p: hashed.append(p) or real(p))
    again, _ = run_mod.run_settings(spec, record)
    assert again == settings and src not in hashed  # untouched: the recorded hash, no read
    cfg = src / "config.json"
    cfg.write_bytes(cfg.read_bytes())  # same bytes, new ctime: read again
    again, new_keys = run_mod.run_settings(spec, record)
    assert src in hashed and again == settings and new_keys != keys
    cfg.write_text(cfg.read_text().replace("}", ', "x": 1}', 1))  # other bytes: another hash
    changed, _ = run_mod.run_settings(spec, {"settings": settings, "source_keys": new_keys})
    assert changed["source_sha256"] != settings["source_sha256"]


def test_run_with_several_candidates_reports_them_together(tiny_llama_dir, tmp_path):
    """--bits 4 --bits 8: two exports of one calibration, each evaluated, one report of both
    with its recommendation; the printed lines name each candidate."""
    from quantpipe.stages.run import RunSpec

    out = tmp_path / "work"
    r = CliRunner().invoke(main, ["run", str(tiny_llama_dir), "--out", str(out), "--samples", "4",
                                  "--seq-len", "64", "--bits", "4", "--bits", "8",
                                  "--eval-tokens", "512"])
    assert r.exit_code == 0, r.output
    assert "stages: export-fp16" in r.output and "export int8" in r.output
    from quantpipe.core.heap import reset_peak_rss

    if reset_peak_rss():  # Linux: every stage's own peak, from its own reset high-water mark
        line = next(x for x in r.output.splitlines() if x.startswith("stages: "))
        peaks = re.findall(r"(\S+(?: int\d)?) \d+s \(peak RSS ([\d,]+) MiB\)", line)
        assert [n for n, _ in peaks] == ["export-fp16", "calibrate", "export int4", "eval int4",
                                         "export int8", "eval int8", "report"]
        assert all(int(mb.replace(",", "")) > 50 for _, mb in peaks)  # python + torch alone
    assert "int4: KLD mean" in r.output and "int8: KLD mean" in r.output
    assert "verdict int4: " in r.output and "verdict int8: " in r.output
    doc = json.loads((out / "report.json").read_text())
    assert [c["name"] for c in doc["candidates"]] == ["int4", "int8"]
    assert doc["recommendation"] in r.output
    e4, e8 = (json.loads((out / f"eval-int{b}.json").read_text()) for b in (4, 8))
    assert e8["kld"]["mean"] < e4["kld"]["mean"]  # the same calibration, more bits
    assert doc["candidates"][1]["distribution"]["kld"]["mean"] == e8["kld"]["mean"]
    assert json.loads((out / "run.json").read_text())["settings"]["bits"] == "[4, 8]"
    assert RunSpec("s", out, bits=8).bits == (8,) and RunSpec("s", out).bits == (4,)
    assert RunSpec("s", out, budget_bits=4.5).candidates() == (("mixed-4.5", 4, 4.5),)
    with pytest.raises(ValueError, match="repeats a precision"):
        RunSpec("s", out, bits=(4, 4))

"""Every command ends a failure in one `Error: ...` line naming the path (exit code 1), and the
eval / report / sensitivity options are checked before any model loads."""

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from quantpipe.cli import main
from tests.calibration.test_pipeline import PROMPTS

SHARD = "model-00001-of-00001.safetensors"


class ModelLoaded(Exception):
    """Raised by a monkeypatched loader: reaching it means the checks let the input pass."""


def make_folders(root: Path) -> dict[str, Path]:
    """fp16 (tiny llama), its calibration and INT4 export, and an unrelated fp16 folder."""
    from quantpipe.calibration.pipeline import CalibrateSpec, calibrate
    from quantpipe.stages.export import ExportSpec, export_quantized
    from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16
    from tests.tiny_models import make_model, save_model

    dirs = {}
    for name, seed in (("fp16", 0), ("other", 1)):
        model, tok = make_model("llama", seed=seed)
        src = save_model(model, tok, root / f"src-{name}")
        dirs[name] = root / name
        export_fp16(Fp16ExportSpec(str(src), dirs[name]))
    dirs["prompts"] = root / "p.jsonl"
    dirs["prompts"].write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS * 3) + "\n")
    dirs["calib"] = calibrate(CalibrateSpec(dirs["fp16"], root / "calib", str(dirs["prompts"]),
                                            algo="rtn", group_size=32, samples=4, seq_len=32,
                                            min_tokens=4)).out
    dirs["int4"] = root / "int4"
    export_quantized(ExportSpec(dirs["calib"], dirs["int4"], bits=4))
    return dirs


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_folders(tmp_path_factory.mktemp("cli-errors"))


def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_line_error(r, *needles: str) -> str:
    """Exit code 1, a single `Error: ...` line containing every needle, no traceback."""
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, r.output
    for needle in needles:
        assert needle in errors[0], r.output
    return errors[0]


def copy_of(folder: Path, tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    shutil.copytree(folder, out)
    return out


# ---- corrupt inputs ------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_truncated_fp16_shard(dirs, tmp_path, command):
    fp16 = copy_of(dirs["fp16"], tmp_path, "fp16-cut")
    shard = fp16 / SHARD
    os.truncate(shard, shard.stat().st_size // 2)
    if command == "generate":
        r = invoke("generate", fp16, "--prompt", "hello", "--max-new-tokens", "2")
    else:
        r = invoke("eval", "--reference", fp16, "--candidate", dirs["int4"], "--text",
                   dirs["prompts"])
    assert_one_line_error(r, str(shard), "truncated or corrupt")


def test_verbose_verify_prints_the_traceback_too(dirs, tmp_path):
    qdir = copy_of(dirs["int4"], tmp_path, "int4-cut")
    shard = qdir / SHARD
    os.truncate(shard, shard.stat().st_size // 2)
    r = invoke("-vv", "verify", qdir)
    assert r.exit_code == 1
    assert "Traceback" in r.output and f"Error: {qdir}" in r.output
    quiet = invoke("verify", qdir)
    assert quiet.exit_code == 1 and "Traceback" not in quiet.output


def test_corrupt_config_json_is_named(dirs, tmp_path):
    qdir = copy_of(dirs["int4"], tmp_path, "int4-badcfg")
    (qdir / "config.json").write_text('{"model_type": "lla')
    for args in (("verify", qdir), ("generate", qdir, "--prompt", "hi")):
        assert_one_line_error(invoke(*args), str(qdir / "config.json"), "not valid JSON")


def test_corrupt_manifest_is_named(dirs, tmp_path):
    calib = copy_of(dirs["calib"], tmp_path, "calib-badjson")
    (calib / "quantpipe.json").write_text('{"format": "quantpipe", "vers')
    assert_one_line_error(invoke("plan", calib), str(calib / "quantpipe.json"), "not valid JSON")
    qdir = copy_of(dirs["int4"], tmp_path, "int4-badjson")
    (qdir / "quantpipe.json").write_text("{")
    r = invoke("eval", "--reference", dirs["fp16"], "--candidate", qdir, "--text",
               dirs["prompts"])
    assert_one_line_error(r, str(qdir / "quantpipe.json"), "not valid JSON")


# ---- write failures ------------------------------------------------------------------------


def test_disk_full_while_writing_json(dirs, tmp_path, monkeypatch):
    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    out = tmp_path / "plans" / "plan.json"
    r = invoke("plan", dirs["calib"], "--json", out)
    assert_one_line_error(r, str(out), "no space left", "run the same command again")
    assert list(out.parent.iterdir()) == []  # neither the file nor its temp file is left


def test_output_path_through_a_file(dirs, tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    r = invoke("plan", dirs["calib"], "--json", blocker / "plan.json")
    assert_one_line_error(r, str(blocker))


# ---- eval: checks before any model loads ---------------------------------------------------


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*_a, **_k):
        raise ModelLoaded

    monkeypatch.setattr("quantpipe.reports.eval.load_eval_model", refuse)


def eval_args(reference, candidate, text, *extra):
    return ("eval", "--reference", reference, "--candidate", candidate, "--text", text, *extra)


def test_eval_refuses_a_candidate_of_another_model(dirs, no_model_load, caplog):
    r = invoke(*eval_args(dirs["other"], dirs["int4"], dirs["prompts"]))
    line = assert_one_line_error(r, str(dirs["other"]), str(dirs["int4"]), str(dirs["fp16"]),
                                 "--allow-other-source")
    assert "not from --reference" in line
    r = invoke(*eval_args(dirs["other"], dirs["int4"], dirs["prompts"], "--allow-other-source"))
    assert isinstance(r.exception, ModelLoaded)  # the check let it through
    assert "comparing anyway" in caplog.text


def test_eval_warns_once_for_a_candidate_without_manifest(dirs, tmp_path, no_model_load, caplog):
    qdir = copy_of(dirs["int4"], tmp_path, "int4-nomanifest")
    (qdir / "quantpipe.json").unlink()
    r = invoke(*eval_args(dirs["fp16"], qdir, dirs["prompts"]))
    assert isinstance(r.exception, ModelLoaded)
    warnings = [m for m in caplog.messages if "cannot check" in m]
    assert len(warnings) == 1 and str(qdir) in warnings[0]


def test_eval_ctx_beyond_the_model_context(dirs, no_model_load):
    r = invoke(*eval_args(dirs["fp16"], dirs["int4"], dirs["prompts"], "--ctx", "1024"))
    assert_one_line_error(r, "--ctx 1024", "256")


def test_eval_json_out_is_a_folder(dirs, tmp_path, no_model_load):
    r = invoke(*eval_args(dirs["fp16"], dirs["int4"], dirs["prompts"], "--json", tmp_path))
    assert_one_line_error(r, "--json", str(tmp_path), "existing folder")


def test_eval_vocabulary_mismatch_before_loading(dirs, tmp_path, no_model_load):
    cand = copy_of(dirs["fp16"], tmp_path, "fp16-vocab")
    cfg = json.loads((cand / "config.json").read_text())
    cfg["vocab_size"] += 7
    (cand / "config.json").write_text(json.dumps(cfg))
    r = invoke(*eval_args(dirs["fp16"], cand, dirs["prompts"]))
    assert_one_line_error(r, "vocabularies differ", str(cfg["vocab_size"]))


# ---- sensitivity: checks before the model loads --------------------------------------------


@pytest.fixture
def no_sensitivity_load(monkeypatch):
    def refuse(*_a, **_k):
        raise ModelLoaded

    monkeypatch.setattr("quantpipe.calibration.mixed_precision.sensitivity._load_model", refuse)


def test_sensitivity_seq_len_beyond_context(dirs, tmp_path, no_sensitivity_load):
    calib = copy_of(dirs["calib"], tmp_path, "calib-seq")
    r = invoke("sensitivity", calib, "--seq-len", "512", "--tokens", "512")
    assert_one_line_error(r, "--seq-len 512", "256")


def test_sensitivity_fp16_folder_gone(dirs, tmp_path, no_sensitivity_load):
    calib = copy_of(dirs["calib"], tmp_path, "calib-moved")
    manifest = json.loads((calib / "quantpipe.json").read_text())
    manifest["fp16_dir"] = str(tmp_path / "deleted-fp16")
    (calib / "quantpipe.json").write_text(json.dumps(manifest))
    r = invoke("sensitivity", calib, "--tokens", "128", "--seq-len", "64")
    assert_one_line_error(r, str(tmp_path / "deleted-fp16"), "restore")


def test_sensitivity_corrupt_previous_result(dirs, tmp_path, no_sensitivity_load):
    calib = copy_of(dirs["calib"], tmp_path, "calib-badsens")
    (calib / "sensitivity.json").write_text('{"settings": ')
    r = invoke("sensitivity", calib, "--tokens", "128", "--seq-len", "64")
    assert_one_line_error(r, str(calib / "sensitivity.json"), "--force")
    r = invoke("sensitivity", calib, "--tokens", "128", "--seq-len", "64", "--force")
    assert isinstance(r.exception, ModelLoaded)  # --force measures again without reading it


def test_safetensors_write_error_is_a_disk_error(tmp_path):
    from safetensors import SafetensorError

    from quantpipe.cli import _describe_failure

    exc = SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                          'message: "No space left on device" })')
    msg = _describe_failure(exc, {"out": tmp_path / "q"})
    assert msg.startswith("no space left on the device while writing") and str(tmp_path) in msg


def test_calibrate_passes_min_expert_tokens_to_the_spec(tmp_path, monkeypatch):
    import quantpipe.calibration.pipeline as pipeline

    seen = {}

    def fake_calibrate(spec):  # only the option plumbing is under test here
        seen["spec"] = spec
        raise ValueError("stop here")

    monkeypatch.setattr(pipeline, "calibrate", fake_calibrate)
    r = invoke("calibrate", tmp_path, "--out", tmp_path / "c", "--min-expert-tokens", "7")
    assert r.exit_code == 1 and "stop here" in r.output
    assert seen["spec"].min_expert_tokens == 7


@pytest.mark.parametrize("command", ["plan", "export"])
def test_budget_without_sensitivity_gives_a_remedy_this_command_takes(dirs, tmp_path, command):
    """The error names --damage proxy for the command at hand, and that command takes it."""
    out = ["--out", tmp_path / "q"] if command == "export" else []
    r = invoke(command, dirs["calib"], "--budget-bits", "6", *out)
    assert_one_line_error(r, "no sensitivity.json", "--damage proxy to this command")
    r = invoke(command, dirs["calib"], "--budget-bits", "6", "--damage", "proxy", *out)
    assert r.exit_code == 0, r.output


def test_generate_chat_without_template(dirs, tmp_path, monkeypatch):
    """A base model's tokenizer has no chat template: --chat is refused before the model
    loads, naming the remedy."""
    import json

    from quantpipe.runtime import engine

    qdir = copy_of(dirs["int4"], tmp_path, "no-template")
    cfg_path = qdir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    (qdir / "chat_template.jinja").unlink(missing_ok=True)

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the chat template was checked")

    monkeypatch.setattr(engine, "load_model_for_serving", no_load)
    r = invoke("generate", qdir, "--chat", "--prompt", "hi", "--no-verify")
    assert_one_line_error(r, "no chat template", "drop --chat")

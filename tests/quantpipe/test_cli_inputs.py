"""Inputs that used to end in a traceback, a prompt on stdin, an unbounded read, an output
written over an input, or a model-sized temp folder left behind (issue #29, round 3): each is
now a one-line error naming the file or option, raised before any slow work."""

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from tests.quantpipe.test_cli_errors import (
    ModelLoaded,
    assert_one_line_error,
    copy_of,
    invoke,
    make_folders,
)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-inputs")
    out = make_folders(root)
    out["src"] = root / "src-fp16"  # the Hugging Face folder fp16 was exported from
    return out


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*_a, **_k):
        raise ModelLoaded

    # build binds eval's function at import: import it before either is patched, or undoing
    # the patch would restore `refuse` there for every later test
    import quantpipe.reports.build  # noqa: F401

    monkeypatch.setattr("quantpipe.reports.eval.load_eval_model", refuse)
    # the report's answers load each model through the serving engine's loader
    monkeypatch.setattr("quantpipe.reports.build.answer_prompts", refuse)


def leftovers(folder: Path) -> list[str]:
    """Hidden temp folders (``.NAME.partial-*``) or anything else a failed command left."""
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


# ---- item 3: model code runs only with --trust-remote-code ---------------------------------


def test_auto_map_folder_is_refused_even_when_stdin_says_yes(dirs, tmp_path):
    """transformers asks "run the custom code? [y/N]" on stdin for a model type it does not
    know; answering y used to import the folder's code. Now nothing is asked or imported."""
    src = copy_of(dirs["src"], tmp_path, "custom")
    marker = tmp_path / "code-ran"
    code = (f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
            "from transformers import LlamaConfig\n"
            "class CustomConfig(LlamaConfig):\n    model_type = 'custom_llama'\n")
    (src / "configuration_custom.py").write_text(code)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(model_type="custom_llama",
               auto_map={"AutoConfig": "configuration_custom.CustomConfig"})
    (src / "config.json").write_text(json.dumps(cfg))
    r = invoke_input("y\ny\n", "export-fp16", src, "--out", tmp_path / "out")
    assert_one_line_error(r, str(src / "config.json"), "--trust-remote-code")
    assert "[y/N]" not in r.output
    assert not marker.exists()
    assert leftovers(tmp_path) == ["custom"]


def invoke_input(stdin: str, *args):
    from click.testing import CliRunner

    from quantpipe.cli import main

    return CliRunner().invoke(main, [str(a) for a in args], input=stdin)


# ---- item 4: outputs never overwrite inputs ------------------------------------------------


def test_eval_json_onto_its_inputs_is_refused(dirs, tmp_path, no_model_load):
    qdir = copy_of(dirs["int4"], tmp_path, "int4")
    text = tmp_path / "text.txt"
    text.write_text("some text to score " * 20)
    manifest = (qdir / "quantpipe.json").read_bytes()
    for target, label in ((qdir / "quantpipe.json", "--candidate"),
                          (dirs["fp16"] / "config.json", "--reference"), (text, "--text")):
        before = target.read_bytes()
        r = invoke("eval", "--reference", dirs["fp16"], "--candidate", qdir, "--text", text,
                   "--json", target)
        assert_one_line_error(r, f"--json {target}", f"the input {label}")
        assert target.read_bytes() == before
    assert (qdir / "quantpipe.json").read_bytes() == manifest


def test_report_out_and_its_json_beside_it_never_overwrite_inputs(dirs, tmp_path,
                                                                  no_model_load):
    qdir = copy_of(dirs["int4"], tmp_path, "int4")
    speed = tmp_path / "speed.json"
    speed.write_text("[]")
    base = ("report", "--reference", dirs["fp16"], "--candidate", qdir)
    manifest = (qdir / "quantpipe.json").read_bytes()
    r = invoke(*base, "--out", qdir / "quantpipe.html")  # its .json: the candidate's manifest
    assert_one_line_error(r, f"--out {qdir / 'quantpipe.html'}", "the input --candidate 1")
    assert (qdir / "quantpipe.json").read_bytes() == manifest
    # the .json beside speed.html is a --speed input
    r = invoke(*base, "--speed", speed, "--out", tmp_path / "speed.html")
    assert_one_line_error(r, "--out (its .json beside it)", str(speed), "the input --speed 1")
    assert speed.read_text() == "[]"


def test_plan_json_onto_the_calibration_is_refused(dirs, tmp_path):
    calib = copy_of(dirs["calib"], tmp_path, "calib")
    before = (calib / "quantpipe.json").read_bytes()
    r = invoke("plan", calib, "--json", calib / "quantpipe.json")
    assert_one_line_error(r, "--json", "the input CALIB_DIR")
    assert (calib / "quantpipe.json").read_bytes() == before


# ---- item 8: bounded reads -----------------------------------------------------------------


def test_prompt_file_and_line_caps(dirs, tmp_path, monkeypatch, no_model_load):
    import quantpipe.prompts.sets as prompts

    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"prompt": f"prompt {i} " * 20}) + "\n"
                           for i in range(50)))
    monkeypatch.setattr(prompts, "MAX_PROMPT_FILE_BYTES", 1000)
    r = invoke("eval", "--reference", dirs["fp16"], "--candidate", dirs["int4"], "--prompts",
               big)
    assert_one_line_error(r, str(big), "above the 1,000 bytes")
    monkeypatch.setattr(prompts, "MAX_PROMPT_FILE_BYTES", 10**6)
    monkeypatch.setattr(prompts, "MAX_PROMPT_LINE_BYTES", 100)
    r = invoke("eval", "--reference", dirs["fp16"], "--candidate", dirs["int4"], "--prompts",
               big)
    assert_one_line_error(r, str(big), "line 1 is longer than 100 bytes")


def test_non_regular_inputs_are_refused(dirs, tmp_path, no_model_load):
    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)  # reading it would block forever
    r = invoke("eval", "--reference", dirs["fp16"], "--candidate", dirs["int4"], "--prompts",
               fifo)
    assert_one_line_error(r, str(fifo), "not a regular file")
    r = invoke("eval", "--reference", dirs["fp16"], "--candidate", dirs["int4"], "--text",
               "/dev/zero", "--max-tokens", "64")
    assert_one_line_error(r, "--text /dev/zero", "not a regular file")


def test_text_is_read_only_as_far_as_max_tokens_needs(dirs, tmp_path, monkeypatch,
                                                      no_model_load):
    import quantpipe.reports.eval as ev

    sparse = tmp_path / "huge.txt"
    with open(sparse, "wb") as f:  # 1 GiB of zero bytes on disk as a hole: valid UTF-8
        f.truncate(2**30)
    text = ev.read_text_file(sparse, max_tokens=100, ctx=64)
    assert 100 * ev.TEXT_CHARS_PER_TOKEN <= len(text) <= 110 * ev.TEXT_CHARS_PER_TOKEN
    # whole, it is above the cap: refused with the cap and the remedy in the message
    r = invoke("eval", "--reference", dirs["fp16"], "--candidate", dirs["int4"], "--text",
               sparse)
    assert_one_line_error(r, str(sparse), f"{ev.MAX_TEXT_BYTES:,} bytes", "--max-tokens")
    small = tmp_path / "small.txt"
    small.write_text("x" * 500)
    monkeypatch.setattr(ev, "MAX_TEXT_BYTES", 100)
    r = invoke("eval", "--reference", dirs["fp16"], "--candidate", dirs["int4"], "--text", small)
    assert_one_line_error(r, str(small), "above the 100 bytes")


# ---- item 10: failures named in one line ---------------------------------------------------


@pytest.mark.parametrize("size", ["inf", "nan", "-inf", "1e400GB"])
def test_max_shard_size_not_finite(dirs, tmp_path, size):
    r = invoke("export-fp16", dirs["src"], "--out", tmp_path / "fp16", "--max-shard-size", size)
    assert_one_line_error(r, "--max-shard-size", repr(size))
    r = invoke("export", dirs["calib"], "--out", tmp_path / "q", "--max-shard-size", size)
    assert_one_line_error(r, "--max-shard-size", repr(size))
    assert leftovers(tmp_path) == []


def test_other_sizes_not_finite_name_their_option(dirs, tmp_path):
    r = invoke("calibrate", dirs["fp16"], "--out", tmp_path / "c", "--max-memory", "inf")
    assert_one_line_error(r, "--max-memory", "'inf'", "not a finite number")
    r = invoke("plan-memory", dirs["fp16"], "--device-memory", "nan")
    assert_one_line_error(r, "--device-memory", "'nan'")


def test_manifest_with_an_invalid_utf8_byte_is_named(dirs, tmp_path):
    calib = copy_of(dirs["calib"], tmp_path, "calib")
    (calib / "quantpipe.json").write_bytes(b'{"format": "quantpipe", "x": "\xff"}')
    r = invoke("plan", calib)
    assert_one_line_error(r, str(calib / "quantpipe.json"), "not UTF-8")


def test_pickle_checkpoint_with_python_objects(dirs, tmp_path):
    from safetensors.torch import load_file

    src = copy_of(dirs["src"], tmp_path, "pickled")
    state = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()

    class Payload:
        def __reduce__(self):
            return (print, ("this must never run",))

    torch.save({**state, "extra": Payload()}, src / "pytorch_model.bin", pickle_module=pickle)
    r = invoke("export-fp16", src, "--out", tmp_path / "out")
    line = assert_one_line_error(r, str(src / "pytorch_model.bin"), "never runs pickled code")
    assert "weights_only=False" not in line and "this must never run" not in r.output
    assert len(r.output.splitlines()) <= 2  # the error, perhaps a progress bar; no traceback
    assert leftovers(tmp_path) == ["pickled"]


def test_generate_prompt_with_an_invalid_utf8_byte(dirs):
    # a byte that is not UTF-8 reaches Python's argv as a lone surrogate (PEP 383)
    r = invoke("generate", dirs["fp16"], "--prompt", "caf\udce9 au lait")
    assert_one_line_error(r, "--prompt", "not UTF-8")


def test_truncated_gguf_is_named(tmp_path):
    from quantpipe.core.sources import find_smollm2_gguf

    cut = tmp_path / "cut.gguf"
    with open(find_smollm2_gguf(), "rb") as f:
        cut.write_bytes(f.read(100_000))  # the header and part of the metadata
    r = invoke("export-fp16", cut, "--out", tmp_path / "out")
    assert_one_line_error(r, str(cut), "cannot be read as a GGUF")
    assert leftovers(tmp_path) == ["cut.gguf"]


@pytest.mark.parametrize("content", [b'{"version": "1.0", "model": {"type": "BPE"}}',
                                     b'{"version": "1.0", "model": "\xff"}'])
def test_undecodable_tokenizer_is_named(dirs, tmp_path, content):
    src = copy_of(dirs["src"], tmp_path, "src")
    (src / "tokenizer.json").write_bytes(content)
    r = invoke("export-fp16", src, "--out", tmp_path / "out")
    assert_one_line_error(r, str(src / "tokenizer.json"), "cannot be read as a tokenizer")
    fp16 = copy_of(dirs["fp16"], tmp_path, "fp16")
    (fp16 / "tokenizer.json").write_bytes(content)
    r = invoke("eval", "--reference", fp16, "--candidate", fp16, "--prompts", "business-eval")
    assert_one_line_error(r, str(fp16 / "tokenizer.json"), "cannot be read as a tokenizer")


def test_lone_surrogate_in_a_prompt_file_is_named(dirs, tmp_path, no_model_load):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": "broken \\ud800 escape"}\n')
    r = invoke("eval", "--reference", dirs["fp16"], "--candidate", dirs["int4"], "--prompts",
               bad)
    assert_one_line_error(r, str(bad), "line 2", "lone surrogate")


def test_bom_is_dropped(dirs, tmp_path):
    from quantpipe.prompts.sets import load_prompt_records
    from quantpipe.reports.eval import read_text_file

    bom = "\ufeff"
    files = {"p.txt": "first prompt\n\nsecond prompt\n", "p.csv": "prompt\nfirst prompt\n",
             "p.jsonl": json.dumps({"prompt": "first prompt"}) + "\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(bom + text, encoding="utf-8")
        assert load_prompt_records(tmp_path / name)[0].prompt == "first prompt", name
    (tmp_path / "t.txt").write_text(bom + "some text", encoding="utf-8")
    assert read_text_file(tmp_path / "t.txt") == "some text"


# ---- item 11: outputs that name the working folder -----------------------------------------


@pytest.mark.parametrize("out", ["", ".", "..", "/"])
def test_out_naming_the_working_folder_is_refused_early(dirs, tmp_path, monkeypatch, out):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)

    def no_work(*_a, **_k):
        raise AssertionError("the check came too late")

    monkeypatch.setattr("quantpipe.stages.fp16_export.load_tokenizer", no_work)
    for args in (("export-fp16", dirs["src"]), ("export", dirs["calib"], "--force"),
                 ("calibrate", dirs["fp16"], "--algo", "rtn"), ("run", dirs["src"])):
        r = invoke(*args, "--out", out)
        assert_one_line_error(r, "--out")
    for args in (("plan", dirs["calib"], "--json", out),
                 ("eval", "--reference", dirs["fp16"], "--candidate", dirs["int4"], "--text",
                  dirs["prompts"], "--json", out),
                 ("bench-serve", "--duration", "0.1", "--json", out)):
        assert_one_line_error(invoke(*args), "--json")
    assert leftovers(work) == [] and leftovers(tmp_path) == ["work"]


def test_failed_rename_leaves_no_partial_folder(tmp_path, monkeypatch):
    import quantpipe.core.io as qio

    def fail(_tmp, _out):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(qio, "replace_dir", fail)
    with pytest.raises(OSError):
        with qio.atomic_output_dir(tmp_path / "out") as tmp:
            (tmp / "weights").write_bytes(b"x" * 1000)
    assert leftovers(tmp_path) == []


# ---- item 13: swapped --reference / --candidate --------------------------------------------


def test_swapped_reference_and_candidate(dirs, no_model_load):
    for cmd in (("eval", "--text", dirs["prompts"]), ("report",)):
        r = invoke(*cmd, "--reference", dirs["int4"], "--candidate", dirs["fp16"],
                   *(("--out", dirs["prompts"].parent / "r.html") if cmd == ("report",) else ()))
        assert_one_line_error(r, "look swapped", f"--reference {dirs['fp16']}",
                              f"--candidate {dirs['int4']}")
    # the right way round passes the checks (and reaches the model load)
    r = invoke("eval", "--text", dirs["prompts"], "--reference", dirs["fp16"], "--candidate",
               dirs["int4"])
    assert isinstance(r.exception, ModelLoaded)


def test_quantized_reference_is_refused(dirs, tmp_path, no_model_load):
    r = invoke("eval", "--text", dirs["prompts"], "--reference", dirs["int4"], "--candidate",
               copy_of(dirs["int4"], tmp_path, "int4-copy"))
    assert_one_line_error(r, f"--reference {dirs['int4']}", "FP16 folder")


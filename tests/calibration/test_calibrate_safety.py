"""calibrate / export never lose data: checks before --out is touched, a finished CALIB_DIR is
replaced only by a complete one, inputs are protected, FP16 hashes are checked, one writer at
a time, and failed writes leave nothing that looks valid."""

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import SafetensorError

import quantpipe.calibration.resume as resume
import quantpipe.core.io as qio
from quantpipe.calibration.artifact import read_calibration, work_dir
from quantpipe.calibration.pipeline import CalibrateSpec, calibrate
from quantpipe.core.io import OutputLockedError, read_manifest, verify_shard_hashes
from quantpipe.stages.export import ExportSpec, export_quantized
from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16
from tests.tiny_models import CORPUS

KW = dict(algo="rtn", group_size=32, samples=8, seq_len=32, min_tokens=4, batch_size=4)


@pytest.fixture(scope="module")
def fp16_dir(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp16") / "fp16"
    export_fp16(Fp16ExportSpec(str(tiny_llama_dir), out))
    return out


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{t} Request {i}."}) + "\n"
                            for i in range(6) for t in CORPUS[:8]))
    return path


@pytest.fixture(scope="module")
def finished(fp16_dir, prompt_file, tmp_path_factory):
    """A finished RTN calibration, copied by tests that replace it."""
    out = tmp_path_factory.mktemp("calib") / "calib"
    calibrate(CalibrateSpec(fp16_dir, out, str(prompt_file), **KW))
    return out


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*"))
            if f.is_file()}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # inside the last tensor's data: the file still parses
    path.write_bytes(bytes(data))


def _kill_after_block_0(monkeypatch):
    """Make calibrate die after block 0 is saved; returns the original save_progress."""
    orig = resume.save_progress

    def die(run, nxt, extra):
        orig(run, nxt, extra)
        if nxt == 1:
            raise KeyboardInterrupt  # the run dies after block 0 is saved

    monkeypatch.setattr(resume, "save_progress", die)
    return orig


@pytest.mark.parametrize("where", ["same", "inside", "contains"])
def test_calibrate_refuses_out_overlapping_fp16_dir(fp16_dir, prompt_file, where):
    before = _snapshot(fp16_dir)
    out = {"same": fp16_dir, "inside": fp16_dir / "calib", "contains": fp16_dir.parent}[where]
    with pytest.raises(ValueError, match=r"the input FP16_DIR .*choose another --out$"):
        calibrate(CalibrateSpec(fp16_dir, out, str(prompt_file), force=True, **KW))
    assert _snapshot(fp16_dir) == before


def test_calibrate_refuses_out_containing_the_prompt_file(fp16_dir, tmp_path):
    prompts = tmp_path / "calib" / "p.jsonl"
    prompts.parent.mkdir()
    prompts.write_text(json.dumps({"prompt": "keep me"}) + "\n")
    with pytest.raises(ValueError, match="contains the input --prompts"):
        calibrate(CalibrateSpec(fp16_dir, tmp_path / "calib", str(prompts), force=True, **KW))
    assert prompts.read_text() == json.dumps({"prompt": "keep me"}) + "\n"


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("kind", ["user folder", "input folder", "file", "link"])
def test_calibrate_never_removes_a_work_folder_it_did_not_make(fp16_dir, prompt_file, tmp_path,
                                                               kind, force):
    """``.NAME.work`` beside --out NAME is removed or resumed only when quantpipe marked it as
    its own: a user's folder (even one holding a progress.json), an input folder, a file or a
    link of that name is refused, naming it, and left as it was (issue #29)."""
    work = work_dir(tmp_path / "calib")
    if kind == "link":
        (tmp_path / "elsewhere").mkdir()
        work.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    elif kind == "file":
        work.write_text("mine")
    else:
        shutil.copytree(fp16_dir, work) if kind == "input folder" else work.mkdir()
        (work / "progress.json").write_text('{"next_block": 1}')
    prompts = str(work / "p.jsonl") if kind == "input folder" else str(prompt_file)
    if kind == "input folder":
        shutil.copy(prompt_file, prompts)
    before = _snapshot(work) if work.is_dir() else work.read_text()
    match = (rf"^{re.escape(str(work))}: in the way of the work folder .*left untouched; move "
             "or rename it, or choose another --out$")
    if kind == "input folder":  # the overlap check names the input first
        match = rf"the work folder of --out .*{re.escape(str(work))} contains the input --prompts"
    with pytest.raises(ValueError, match=match):
        calibrate(CalibrateSpec(fp16_dir, tmp_path / "calib", prompts, force=force, **KW))
    assert (_snapshot(work) if work.is_dir() else work.read_text()) == before
    assert not (tmp_path / "calib").exists()


def test_calibrate_refuses_an_fp16_dir_inside_its_work_folder(fp16_dir, prompt_file, tmp_path):
    """The work folder is part of the overlap check: its inputs may not lie in it."""
    work = work_dir(tmp_path / "calib")
    inside = _copy(fp16_dir, work / "fp16")
    (work / "quantpipe-work.json").write_text("{}")  # even one that looks like quantpipe's
    before = _snapshot(work)
    with pytest.raises(ValueError, match=r"the work folder of --out .* contains the input "
                       "FP16_DIR"):
        calibrate(CalibrateSpec(inside, tmp_path / "calib", str(prompt_file), force=True,
                                **KW))
    assert _snapshot(work) == before


@pytest.mark.parametrize("bad,match", [
    (dict(seq_len=1), "--seq-len must be >= 2"),
    (dict(seq_len=4096), "above the model's max_position_embeddings 256"),
    (dict(group_size=100000), "--group-size 100000 is not supported; use one of -1, 16, 32"),
    (dict(group_size=48), "--group-size 48 is not supported"),
    (dict(group_size=128), "larger than in_features 64 of model.layers.0.self_attn.q_proj"),
    (dict(min_tokens=10_000), "all 48 records were dropped"),
    (dict(min_expert_tokens=0), "--min-expert-tokens must be >= 1"),
])
def test_bad_option_with_force_keeps_the_finished_calibration(finished, fp16_dir, prompt_file,
                                                              tmp_path, bad, match):
    out = _copy(finished, tmp_path / "calib")
    before = _snapshot(out)
    with pytest.raises(ValueError, match=match) as info:
        calibrate(CalibrateSpec(fp16_dir, out, str(prompt_file), force=True,
                                **{**KW, **bad}))
    assert "\n" not in str(info.value)
    assert _snapshot(out) == before
    assert sorted(q.name for q in tmp_path.iterdir()) == ["calib"]  # no work folder, no lock


def test_force_replaces_calib_dir_only_when_the_new_one_is_complete(finished, fp16_dir,
                                                                    prompt_file, tmp_path,
                                                                    monkeypatch):
    out = _copy(finished, tmp_path / "calib")
    before = _snapshot(out)
    spec = CalibrateSpec(fp16_dir, out, str(prompt_file), force=True, **{**KW, "algo": "gptq"})
    _kill_after_block_0(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        calibrate(spec)
    monkeypatch.undo()
    assert _snapshot(out) == before  # the finished RTN calibration is still whole
    assert read_calibration(out).manifest["algo"] == "rtn"
    assert (work_dir(out) / "progress.json").is_file()
    res = calibrate(spec)  # the same command (with --force) resumes the unfinished run
    assert res.resumed_from == 1
    assert read_calibration(out).manifest["algo"] == "gptq"
    assert not work_dir(out).exists()
    assert sorted(q.name for q in tmp_path.iterdir()) == ["calib"]


def test_resume_with_relative_paths_and_a_clear_refusal(fp16_dir, prompt_file, tmp_path,
                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)
    rel_fp16 = Path(os.path.relpath(fp16_dir, tmp_path))
    rel_prompts = os.path.relpath(prompt_file, tmp_path)
    orig = _kill_after_block_0(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        calibrate(CalibrateSpec(rel_fp16, Path("calib"), rel_prompts, **KW))
    monkeypatch.setattr(resume, "save_progress", orig)
    # the same run spelled with absolute paths: other settings are refused, naming them
    with pytest.raises(ValueError) as info:
        calibrate(CalibrateSpec(fp16_dir, tmp_path / "calib", str(prompt_file),
                                **{**KW, "sym": False}))
    msg = str(info.value)
    assert "other settings (sym: 'True' before, 'False' now)" in msg and "\n" not in msg
    res = calibrate(CalibrateSpec(fp16_dir, tmp_path / "calib", str(prompt_file), **KW))
    assert res.resumed_from == 1


def test_resume_with_a_smaller_batch_size_is_recorded(fp16_dir, prompt_file, tmp_path,
                                                     monkeypatch):
    # a run killed for memory is resumed with a smaller --batch-size: kept, and recorded
    orig = _kill_after_block_0(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        calibrate(CalibrateSpec(fp16_dir, tmp_path / "calib", str(prompt_file), **KW))
    monkeypatch.setattr(resume, "save_progress", orig)
    res = calibrate(CalibrateSpec(fp16_dir, tmp_path / "calib", str(prompt_file),
                                  **{**KW, "batch_size": 2}))
    assert res.resumed_from == 1
    manifest = read_manifest(tmp_path / "calib", "calibration")
    blocks = manifest["num_blocks"]
    assert manifest["batch_sizes"] == {"2": blocks - 1, "4": 1}


def test_calibrate_refuses_a_byte_flipped_fp16_folder(fp16_dir, prompt_file, tmp_path):
    bad = _copy(fp16_dir, tmp_path / "fp16")
    shard = read_manifest(bad, "fp16")["shards"][0]["file"]
    _flip_last_byte(bad / shard)
    with pytest.raises(ValueError, match=rf"{shard}: sha256 .* does not match"):
        calibrate(CalibrateSpec(bad, tmp_path / "calib", str(prompt_file), **KW))
    assert not (tmp_path / "calib").exists() and not work_dir(tmp_path / "calib").exists()


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 100000), ("hidden_size", 0)])
def test_calibrate_refuses_an_absurd_config_before_building(fp16_dir, prompt_file, tmp_path,
                                                            field, value):
    bad = _copy(fp16_dir, tmp_path / "fp16")
    cfg = json.loads((bad / "config.json").read_text())
    cfg[field] = value
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"config.json: .*{field} is {value}"):
        calibrate(CalibrateSpec(bad, tmp_path / "calib", str(prompt_file), **KW))
    assert not (tmp_path / "calib").exists() and not work_dir(tmp_path / "calib").exists()


def test_export_refuses_fp16_changed_since_calibration(fp16_dir, prompt_file, tmp_path):
    fp16 = _copy(fp16_dir, tmp_path / "fp16")
    calib = calibrate(CalibrateSpec(fp16, tmp_path / "calib", str(prompt_file), **KW)).out
    export_quantized(ExportSpec(calib, tmp_path / "ok"))  # unchanged: fine
    shard = read_manifest(fp16, "fp16")["shards"][0]["file"]
    _flip_last_byte(fp16 / shard)
    for fmt in ("native", "gptq"):
        with pytest.raises(ValueError, match=rf"{shard}: sha256 .* in the calibration "):
            export_quantized(ExportSpec(calib, tmp_path / f"q-{fmt}", fmt=fmt))
        assert not (tmp_path / f"q-{fmt}").exists()
    # re-exported consistently (manifest and files agree): still not what was calibrated
    manifest = json.loads((fp16 / "quantpipe.json").read_text())
    manifest["shards"][0]["sha256"] = qio.sha256_file(fp16 / shard)
    manifest["shards"][0]["bytes"] = (fp16 / shard).stat().st_size
    (fp16 / "quantpipe.json").write_text(json.dumps(manifest))
    verify_shard_hashes(fp16, manifest["shards"])
    with pytest.raises(ValueError, match="in the calibration"):
        export_quantized(ExportSpec(calib, tmp_path / "q"))


@pytest.mark.parametrize("target", ["calib", "fp16"])
def test_export_refuses_out_overlapping_its_inputs(finished, fp16_dir, tmp_path, target):
    calib = _copy(finished, tmp_path / "calib")
    out = calib if target == "calib" else fp16_dir
    before = _snapshot(out)
    with pytest.raises(ValueError, match="is the input"):
        export_quantized(ExportSpec(calib, out, force=True))
    assert _snapshot(out) == before


def test_export_fp16_refuses_its_source_as_out(tiny_llama_dir, tmp_path):
    src = _copy(tiny_llama_dir, tmp_path / "src")
    before = _snapshot(src)
    for out in (src, src / "fp16"):
        with pytest.raises(ValueError, match="the input SOURCE"):
            export_fp16(Fp16ExportSpec(str(src), out, force=True))
    assert _snapshot(src) == before


WAIT_AFTER_BLOCK_0 = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "import quantpipe.calibration.pipeline as p\n"
    "import quantpipe.calibration.resume as r\n"
    "orig = r.save_progress\n"
    "def wait(run, nxt, extra):\n"
    "    orig(run, nxt, extra)\n"
    "    if nxt == 1:\n"
    "        Path(sys.argv[4]).write_text('block 0 done')\n"
    "        while not Path(sys.argv[5]).exists():\n"
    "            time.sleep(0.05)\n"
    "r.save_progress = wait\n"
    "p.calibrate(p.CalibrateSpec(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], "
    "algo='rtn', group_size=64, samples=8, seq_len=32, min_tokens=4, batch_size=4))\n"
)


def test_two_calibrate_processes_never_interleave(fp16_dir, prompt_file, tmp_path):
    out, started, go = tmp_path / "calib", tmp_path / "started", tmp_path / "go"
    proc = subprocess.Popen([sys.executable, "-c", WAIT_AFTER_BLOCK_0, str(fp16_dir), str(out),
                             str(prompt_file), str(started), str(go)], env=dict(os.environ))
    try:
        deadline = time.time() + 300
        while not started.exists():
            assert proc.poll() is None and time.time() < deadline, "the first run failed"
            time.sleep(0.1)
        # a second calibrate with other settings, export and export-fp16 into the same folder
        with pytest.raises(OutputLockedError,
                           match=rf"calib is being written by another quantpipe process "
                                 rf"\(pid {proc.pid}\)"):
            calibrate(CalibrateSpec(fp16_dir, out, str(prompt_file), force=True,
                                    **{**KW, "sym": False}))
        with pytest.raises(OutputLockedError, match=f"pid {proc.pid}"):
            export_fp16(Fp16ExportSpec(str(fp16_dir), out, force=True))
        go.write_text("go")
        assert proc.wait(timeout=300) == 0
    finally:
        go.write_text("go")
        proc.wait(timeout=300)
    calib = read_calibration(out)
    assert calib.manifest["int4"]["group_size"] == 64 and calib.manifest["int4"]["sym"]
    specs = {layer["w4"]["spec"]["group_size"] for layer in calib.layer_infos().values()}
    assert specs == {64}


def test_disk_full_during_calibrate_leaves_nothing_valid_and_resumes(fp16_dir, prompt_file,
                                                                    tmp_path, monkeypatch):
    out = tmp_path / "calib"
    orig = qio.save_file
    calls = []

    def full_on_block_1(tensors, filename, metadata=None):
        calls.append(filename)
        if "block-0001" in filename:
            Path(filename).write_bytes(b"\0" * 64)
            raise SafetensorError("Error while serializing: I/O error: No space left on "
                                  "device (os error 28)")
        return orig(tensors, filename, metadata=metadata)

    monkeypatch.setattr(qio, "save_file", full_on_block_1)
    with pytest.raises(OSError) as info:
        calibrate(CalibrateSpec(fp16_dir, out, str(prompt_file), **KW))
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename.endswith("blocks/block-0001.safetensors")
    monkeypatch.undo()
    assert not out.exists()
    work = work_dir(out)
    assert not list(work.rglob("*.tmp")) and not (work / "quantpipe.json").exists()
    res = calibrate(CalibrateSpec(fp16_dir, out, str(prompt_file), **KW))
    assert res.resumed_from == 1
    read_calibration(out)


def test_layer_group_size_rules():
    spec = CalibrateSpec(Path("f"), Path("o"), group_size=128, algo="rtn")
    assert spec.layer_group_size("x", 576) == 64  # the documented fallback
    assert spec.layer_group_size("x", 1536) == 128
    with pytest.raises(ValueError, match="x: group_size 128 does not divide in_features 576"):
        CalibrateSpec(Path("f"), Path("o"), group_size=128, algo="rtn",
                      strict_group_size=True).layer_group_size("x", 576)
    big = CalibrateSpec(Path("f"), Path("o"), group_size=1024, algo="rtn")
    with pytest.raises(ValueError, match="larger than in_features 576 of x; use 16, 32, 64, "
                                         r"-1 \(per channel\), or --per-channel-if-larger"):
        big.layer_group_size("x", 576)
    wide = CalibrateSpec(Path("f"), Path("o"), group_size=1024, algo="rtn",
                         per_channel_if_larger=True)
    assert wide.layer_group_size("x", 576) == -1
    assert wide.layer_group_size("x", 2048) == 1024


def test_sensitivity_refuses_a_calib_dir_being_written(finished, tmp_path):
    """sensitivity.json is written under CALIB_DIR's lock: a second writer fails at once."""
    from quantpipe.calibration.mixed_precision.sensitivity import (
        SensitivitySpec,
        measure_sensitivity,
    )
    from tests.quantpipe.test_io import _lock_holder

    calib = _copy(finished, tmp_path / "calib")
    holder = _lock_holder(calib)
    try:
        t0 = time.perf_counter()
        with pytest.raises(OutputLockedError, match=f"pid {holder.pid}"):
            measure_sensitivity(SensitivitySpec(calib, tokens=64, seq_len=32))
        assert time.perf_counter() - t0 < 10  # at once: no model was loaded
    finally:
        holder.communicate("\n", timeout=60)
    assert not (calib / "sensitivity.json").exists()

"""calibrate --max-memory: block activations spilled to files in the work folder give the
results of the in-RAM run bit for bit, and a run stopped in either layout resumes in either."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import quantpipe.calibration.pipeline as p
import quantpipe.calibration.resume as resume
from quantpipe.blocks.activations import IDS_FILE, STATE_FILE
from quantpipe.calibration.pipeline import calibrate
from tests.calibration.test_pipeline import (  # noqa: F401 (fixtures)
    _spec,
    fp16_dir,
    prompt_file,
    stop_after_block_0,
)

SPILL, RAM = 0, 2**40  # --max-memory in bytes: everything spills / nothing does


def _blocks(out) -> dict[str, torch.Tensor]:
    """Every tensor of a finished calibration's block files."""
    tensors = {}
    for f in sorted((out / "blocks").glob("*.safetensors")):
        tensors.update({f"{f.name}:{k}": v for k, v in load_file(str(f)).items()})
    assert tensors
    return tensors


def _same(a, b) -> None:
    ta, tb = _blocks(a), _blocks(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


@pytest.mark.parametrize("algo", ["rtn", "gptq", "gptaq", "awq"])
def test_spilled_run_equals_the_in_memory_run(fp16_dir, prompt_file, tmp_path,  # noqa: F811
                                              algo, monkeypatch):
    seen = []
    orig = resume.save_progress

    def watch(run, nxt, extra):  # what the state folder holds after each block
        seen.append(sorted(f.name for f in (run.work / "state").iterdir()))
        orig(run, nxt, extra)

    monkeypatch.setattr(resume, "save_progress", watch)
    spilled = calibrate(_spec(fp16_dir, prompt_file, tmp_path / "spill", algo=algo,
                              max_memory=SPILL)).out
    keys = ["hidden", "hidden_fp"] if algo == "gptaq" else ["hidden"]
    # after block i: the inputs of block i + 1 as files (no other block's), the token ids
    for i, names in enumerate(seen):
        assert names == sorted([IDS_FILE] + [f"{k}-{i}.f32" for k in keys]), names
    monkeypatch.setattr(resume, "save_progress", orig)
    in_ram = calibrate(_spec(fp16_dir, prompt_file, tmp_path / "ram", algo=algo,
                             max_memory=RAM)).out
    _same(spilled, in_ram)
    assert not (spilled / "state").exists()  # the resume state goes with the finished run


@pytest.mark.parametrize("first,second", [(SPILL, RAM), (RAM, SPILL)])
def test_a_stopped_run_resumes_in_the_other_layout(fp16_dir, prompt_file, tmp_path,  # noqa: F811
                                                   first, second):
    """--max-memory is not a resume setting: a run stopped after block 0 resumes with another
    budget (the saved inputs are read from either layout) and gives the uninterrupted result."""
    out = tmp_path / "calib"
    stop_after_block_0(_spec(fp16_dir, prompt_file, out, algo="gptaq", max_memory=first))
    saved = {f.name for f in (p.work_dir(out) / "state").iterdir()}
    assert (STATE_FILE in saved) == (first == RAM)
    assert calibrate(_spec(fp16_dir, prompt_file, out, algo="gptaq",
                           max_memory=second)).resumed_from == 1
    fresh = calibrate(_spec(fp16_dir, prompt_file, tmp_path / "fresh", algo="gptaq")).out
    _same(out, fresh)


def test_max_memory_is_checked(fp16_dir, prompt_file, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="--max-memory"):
        _spec(fp16_dir, prompt_file, tmp_path / "c", max_memory=-1)


def test_calibrate_command_takes_max_memory(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from quantpipe.cli import main

    seen = {}

    def fake_calibrate(spec):
        seen["spec"] = spec
        raise ValueError("stop here")

    monkeypatch.setattr(p, "calibrate", fake_calibrate)
    # an explicit --algo: "auto" is resolved from FP16_DIR's config, which tmp_path lacks
    args = ["calibrate", str(tmp_path), "--out", str(tmp_path / "c"), "--algo", "gptq"]
    r = CliRunner().invoke(main, [*args, "--max-memory", "1.5GiB"])
    assert r.exit_code == 1 and "stop here" in r.output
    assert seen["spec"].max_memory == int(1.5 * 2**30)
    assert "max_memory" not in seen["spec"].resume_settings()
    r = CliRunner().invoke(main, [*args, "--max-memory", "lots"])
    assert r.exit_code == 1 and "lots" in r.output and "stop here" not in r.output


def test_gptq_frees_each_quantized_weight_until_the_quantized_forward(
        fp16_dir, prompt_file, tmp_path, monkeypatch):  # noqa: F811
    """When a block's linears are quantized, none of them holds its fp32 weight any more (the
    largest Hessian is factored without the rest of the block in fp32 beside it); the
    dequantized weights are back for the quantized forward, whose outputs feed the next
    block exactly as before (test_resume_after_kill and the spill tests compare runs)."""
    sizes, forward_sizes = [], []
    orig_quantize_block, orig_set = p.quantize_block, p.set_quantized_weights

    def spy(spec, algo, work):
        out = orig_quantize_block(spec, algo, work)
        sizes.append([m.weight.numel() for m in work.block.modules()
                      if isinstance(m, torch.nn.Linear)])
        return out

    def spy_set(block, name, results):
        orig_set(block, name, results)
        forward_sizes.append([m.weight.numel() == m.in_features * m.out_features
                              for m in block.modules() if isinstance(m, torch.nn.Linear)])

    monkeypatch.setattr(p, "quantize_block", spy)
    monkeypatch.setattr(p, "set_quantized_weights", spy_set)
    calibrate(_spec(fp16_dir, prompt_file, tmp_path / "c", algo="gptq"))
    assert sizes and all(n == 0 for block in sizes for n in block)
    assert forward_sizes and all(all(block) for block in forward_sizes)

"""A calibration SIGKILLed at any step boundary resumes to the uninterrupted run's results, bit
for bit (issue #29: a run killed after a block's next inputs were saved but before its progress
file moved on used to resume on the wrong block's inputs, silently).

The boundaries are the points where calibrate has just written something a resume reads: the
work folder's marker and progress file, a block's results, the next inputs (the resume state),
the manifest, and the finished folder's rename. A helper process imports quantpipe once and
forks one child per run (a kill, then the resume), so the ~30 runs per algorithm pay for no
interpreter start or import each.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16
from tests.tiny_models import CORPUS, make_model, save_model

ALGOS = ("rtn", "gptq", "gptaq", "awq")
BLOCKS = 3
# per block: its results, the next inputs, the progress file; before: the marker, block 0's
# inputs and the progress file; after: the manifest and the rename into CALIB_DIR
BOUNDARIES = 3 * BLOCKS + 3 + 2


def _spec(fp16_dir: Path, prompts: Path, out: Path, algo: str, spill: bool):
    from quantpipe.calibration.pipeline import CalibrateSpec

    # group size 32: the tiny model's layers are 64 and 128 wide; max_memory 0 spills every
    # set; GPTQ's clip search off: it is most of a run's time and no part of the resume
    return CalibrateSpec(fp16_dir, out, str(prompts), algo=algo, samples=4, seq_len=16,
                         min_tokens=4, batch_size=2, awq_samples=2, group_size=32,
                         mse_clip=False if algo in ("gptq", "gptaq") else None,
                         max_memory=0 if spill else None)


def _run_child(spec, kill_at: int) -> int:
    """Fork a child that calibrates ``spec`` and SIGKILLs itself right after the
    ``kill_at``-th step boundary (0: never); returns its wait status."""
    pid = os.fork()
    if pid:
        return os.waitpid(pid, 0)[1]
    code = 1
    try:
        _install_kill_hooks(kill_at)
        from quantpipe.calibration.pipeline import calibrate

        calibrate(spec)
        code = 0
    except BaseException as exc:  # reported by the helper as a failed run
        print(f"child failed: {exc!r}", file=sys.stderr, flush=True)
    finally:
        os._exit(code)


def _install_kill_hooks(kill_at: int) -> None:
    import quantpipe.calibration.finish as finish
    import quantpipe.calibration.pipeline as p
    import quantpipe.calibration.resume as resume
    from quantpipe.blocks.activations import ActivationSpace

    count = 0

    def after(fn):
        def wrapped(*args, **kwargs):
            nonlocal count
            out = fn(*args, **kwargs)
            count += 1
            if count == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        return wrapped

    for module in (p, resume, finish):  # each calls some of them (its own reference)
        for name in ("save_block", "write_json_atomic", "write_manifest", "replace_dir"):
            if hasattr(module, name):
                setattr(module, name, after(getattr(module, name)))
    ActivationSpace.save = after(ActivationSpace.save)


def _same_results(out: Path, ref: Path) -> list[str]:
    """What differs between two finished calibrations' block files (empty: bitwise equal)."""
    from safetensors.torch import load_file

    problems = []
    for j in range(BLOCKS):
        a = load_file(str(out / "blocks" / f"block-{j:04d}.safetensors"))
        b = load_file(str(ref / "blocks" / f"block-{j:04d}.safetensors"))
        if a.keys() != b.keys():
            problems.append(f"block {j}: other tensors")
            continue
        problems += [f"block {j}: {k}" for k in a if not torch.equal(a[k], b[k])]
        layers = [json.loads((d / "blocks" / f"block-{j:04d}.json").read_text())["layers"]
                  for d in (out, ref)]
        if layers[0] != layers[1]:
            problems.append(f"block {j}: other losses or specs")
    if not (out / "quantpipe.json").is_file() or (out.parent / f".{out.name}.work").exists():
        problems.append("not finished")
    return problems


def kill_at_every_boundary(fp16_dir: Path, prompts: Path, root: Path, algo: str,
                           spill: bool) -> dict:
    """For N = 1, 2, ...: a run killed after its N-th step boundary, then resumed to the end
    and compared with an uninterrupted run; stops at the first N the run finishes before."""
    from quantpipe.calibration.pipeline import calibrate

    tag = f"{algo}{'-spilled' if spill else ''}"
    ref = root / f"{tag}-ref"
    calibrate(_spec(fp16_dir, prompts, ref, algo, spill))  # (also imports what a run needs)
    killed, failures = 0, {}
    for n in range(1, 100):
        out = root / f"{tag}-{n}"
        spec = _spec(fp16_dir, prompts, out, algo, spill)
        status = _run_child(spec, n)
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            break  # fewer than n boundaries
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
        killed += 1
        # killed after the rename into CALIB_DIR: finished (a re-run would refuse the full
        # CALIB_DIR without --force); killed before: the same command resumes
        finished = (out / "quantpipe.json").is_file()
        if not finished and _run_child(spec, 0) != 0:
            failures[n] = ["the resume failed"]
        elif problems := _same_results(out, ref):
            failures[n] = problems[:3]
    return {"killed": killed, "failures": failures}


@pytest.fixture(scope="module")
def fp16_3_blocks(tmp_path_factory):
    root = tmp_path_factory.mktemp("three-blocks")
    model, tok = make_model("llama", num_hidden_layers=BLOCKS)
    fp16 = root / "fp16"
    export_fp16(Fp16ExportSpec(str(save_model(model, tok, root / "src")), fp16))
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{p} Request {i}."}) + "\n"
                               for i in range(3) for p in CORPUS[:8]))
    return fp16, prompts


def test_kill_at_every_step_boundary_resumes_bitwise(fp16_3_blocks, tmp_path):
    """Every algorithm with its activations in RAM, and GPTAQ (both its input sets) spilled."""
    fp16, prompts = fp16_3_blocks
    runs = [(algo, False) for algo in ALGOS] + [("gptaq", True)]
    args = json.dumps([str(fp16), str(prompts), str(tmp_path), runs])
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run([sys.executable, __file__, args], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    for algo, spill in runs:
        name = f"{algo}{'-spilled' if spill else ''}"
        assert report[name]["killed"] == BOUNDARIES, (name, report[name])
        assert report[name]["failures"] == {}, (name, report[name])


if __name__ == "__main__":
    # one OpenMP thread: the children are forked after the helper ran torch, and GNU OpenMP's
    # thread pool does not survive a fork (every run, the reference too, uses this setting)
    torch.set_num_threads(1)
    fp16_arg, prompts_arg, root_arg, runs_arg = json.loads(sys.argv[1])
    print(json.dumps({f"{a}{'-spilled' if s else ''}": kill_at_every_boundary(
        Path(fp16_arg), Path(prompts_arg), Path(root_arg), a, s) for a, s in runs_arg}))

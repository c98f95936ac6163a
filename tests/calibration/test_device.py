"""`calibrate --device`: the block work runs on one device, the rest on the CPU, by construction.

No GPU is needed to check the structure. A GPU run differs from a CPU run only in the device
string (quantpipe.blocks.device), so the CPU runs below exercise its code; what they must show is
that nothing would land on the wrong device once that string is "cuda". Two bug classes cover
every way a tensor can: (1) a tensor *made* inside the block work on torch's default device
(a factory such as ``torch.zeros`` without ``device=``), which is the CPU even when the block
is on the GPU; (2) a tensor *read* on the CPU side (shard weights, activation batches, the
positions and mask) that reaches the block's maths without being moved, or a result that is
saved without coming back. :class:`_DeviceCheck` finds both while a real calibration runs
(bitwise the results of a plain run: the check only observes):

- every tensor constructor called without ``device=`` inside the block work is recorded with
  its source line (on a GPU that tensor would be on the CPU);
- the CPU side is simulated as a second device: tensors it hands over are marked
  (:class:`_Host`, a subclass that every op propagates, as a device does), the move functions
  of quantpipe.blocks.device strip the mark (to the device) and put it back (to the CPU), and any
  op that mixes marked and unmarked tensors is recorded: CUDA's "Expected all tensors to be
  on the same device". Saved results must carry the mark (they came back through to_host).
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._pytree import tree_flatten, tree_map

import quantpipe.blocks.activations as activations
import quantpipe.blocks.device as device
import quantpipe.blocks.execute as execute
import quantpipe.blocks.stream as stream
import quantpipe.calibration.block_step as block_step
import quantpipe.calibration.capture as capture
import quantpipe.calibration.pipeline as pipeline
import quantpipe.calibration.result as result
import quantpipe.calibration.resume as resume
import quantpipe.calibration.two_stream as two_stream
from quantpipe.calibration.artifact import work_dir
from quantpipe.calibration.pipeline import CalibrateSpec, calibrate
from quantpipe.calibration.result import QuantResult
from quantpipe.core.qformat import QuantizedWeight
from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16
from tests.calibration.test_pipeline import stop_after_block_0
from tests.tiny_models import CORPUS, make_family_model, make_model, save_model

REPO = Path(__file__).resolve().parents[2]
# Tensor constructors without device= that the block work reaches in files this task does not
# own, each with why it is harmless on a GPU; an entry no longer seen fails the test (remove
# it). quantpipe/core/qformat.py group_index: torch.arange(in_features) on the CPU, used as an
# index into the device's scales (CUDA accepts a CPU index tensor: one small copy per call).
KNOWN_DEFAULT_DEVICE = {"quantpipe/core/qformat.py:group_index"}


class _Host(torch.Tensor):
    """A tensor on the simulated CPU side (what the real CPU is when the block is on a GPU)."""


def _site() -> str:
    """``file:function`` of the innermost frame outside torch and this test."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = Path(frame.filename)
        if "torch" in path.parts or path.name == Path(__file__).name:
            continue
        try:
            path = path.resolve().relative_to(REPO)
            if path.parts[0] in ("calibration", "runtime", "reports"):
                path = Path("quantpipe", *path.parts)
        except ValueError:
            pass
        return f"{path}:{frame.name}"
    return "?"


_COPIES = {torch.Tensor.__setitem__, torch.Tensor.copy_}  # cross-device copies are allowed


def _host(t) -> bool:
    """On the simulated CPU side, and not a 0-dim tensor (CUDA ops accept CPU scalars)."""
    return isinstance(t, _Host) and t.dim() > 0


def _cuda_accepts(func, args) -> bool:
    """What CUDA allows across devices: copies, and a CPU index into a device tensor."""
    if func in _COPIES:
        return True
    return func is torch.Tensor.__getitem__ and not _host(args[0])


class _DeviceCheck(TorchFunctionMode):
    """Records, while active, default-device constructors and host/device mixing. A tensor
    made on the default device is on the CPU side (on a GPU run it would be on the CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.default_device: set[str] = set()
        self.mixed: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _device_constructors() and kwargs.get("device") is None:
            self.default_device.add(_site())
            return _mark(func(*args, **kwargs))
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_host = {_host(t) for t in tensors if not isinstance(t, _Host) or t.dim() > 0}
        if len(on_host) == 2:
            if not _cuda_accepts(func, args):
                self.mixed.add(f"{_site()} ({getattr(func, '__name__', func)})")
            elif func is torch.Tensor.__getitem__:  # the result is on the indexed tensor's
                args = (args[0], tree_map(_plain, args[1]))
        return func(*args, **kwargs)


def _mark(t):
    return t.as_subclass(_Host) if isinstance(t, torch.Tensor) else t


def _plain(t):
    return t.as_subclass(torch.Tensor) if isinstance(t, _Host) else t


def _install_check(monkeypatch) -> tuple[_DeviceCheck, list[str]]:
    """Patch the CPU side's sources to mark their tensors, the moves to strip/restore the
    mark, and the block work to run under the check; -> (the check, unmarked saved tensors)."""
    check = _DeviceCheck()
    unmoved: list[str] = []

    def to_device(t, dev, dtype=None):
        return _plain(t).to(device=dev, dtype=dtype)

    def to_host(t):
        return _mark(_plain(t).to(device.HOST))

    for mod in (device, stream, execute, capture, activations, result, pipeline, block_step,
                two_stream):
        for name, fn in (("to_device", to_device), ("to_host", to_host)):
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, fn)
    real_tensor, real_read = stream.ModelStream._tensor, activations.Activations.read
    monkeypatch.setattr(stream.ModelStream, "_tensor", lambda self, n: _mark(real_tensor(self, n)))
    monkeypatch.setattr(activations.Activations, "read",
                        lambda self, a, b: _mark(real_read(self, a, b)))
    real_embed = pipeline.embed_inputs

    def embed(model, ids):  # the shared context is made on the CPU
        hidden, ctx = real_embed(model, ids)
        ctx.by_type = {k: ((_mark(c), _mark(s)), _mark(m)) for k, ((c, s), m) in
                       ctx.by_type.items()}
        return hidden, ctx

    monkeypatch.setattr(pipeline, "embed_inputs", embed)
    real_save = pipeline.save_block

    def save_block(work, i, results, fp_tensors, info):
        for name, by_bits in results.items():
            for r in by_bits.values():
                w = r.weight
                tensors = (w.q, w.scales, w.zeros) + (() if w.g_idx is None else (w.g_idx,))
                unmoved.extend(name for t in tensors if not isinstance(t, _Host))
        unmoved.extend(k for k, t in fp_tensors.items() if not isinstance(t, _Host))
        real_save(work, i, {n: {b: QuantResult(_plain_weight(r.weight), r.loss, r.damp,
                                               r.damp_raises) for b, r in by.items()}
                            for n, by in results.items()},
                  {k: _plain(t) for k, t in fp_tensors.items()}, info)

    monkeypatch.setattr(pipeline, "save_block", save_block)
    real_block = pipeline.calibrate_block

    def calibrate_block(*args, **kwargs):
        with check:
            return real_block(*args, **kwargs)

    monkeypatch.setattr(pipeline, "calibrate_block", calibrate_block)
    return check, unmoved


def _plain_weight(w):
    return QuantizedWeight(w.spec, _plain(w.q), _plain(w.scales), _plain(w.zeros),
                                  None if w.g_idx is None else _plain(w.g_idx))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A dense and a MoE tiny model as FP16 folders, and a prompt file."""
    tmp = tmp_path_factory.mktemp("device")
    out = {}
    for family, (model, tok) in (("llama", make_model("llama", tie=False)),
                                 ("mixtral", make_family_model("mixtral"))):
        src = save_model(model, tok, tmp / f"src-{family}")
        export_fp16(Fp16ExportSpec(str(src), tmp / family))
        out[family] = tmp / family
    prompts = tmp / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{p} Request {i}."}) + "\n"
                               for i in range(4) for p in CORPUS[:8]))
    out["prompts"] = prompts
    return out


def _spec(models, family, out, **kw):
    base = dict(samples=8, seq_len=24, min_tokens=4, batch_size=4, awq_samples=4, group_size=32)
    return CalibrateSpec(models[family], out, str(models["prompts"]), **{**base, **kw})


def _blocks(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted((folder / "blocks").glob("block-*.safetensors")):
        out.update({f"{f.name}:{k}": v for k, v in load_file(str(f)).items()})
    return out


def _losses(folder: Path) -> list:
    return [json.loads(f.read_text())["layers"]
            for f in sorted((folder / "blocks").glob("block-*.json"))]


@pytest.mark.parametrize("family,algo,extra", [
    ("llama", "rtn", {"mse_clip": True}),
    ("llama", "gptq", {}),
    ("llama", "awq", {}),
    ("llama", "gptaq", {"max_memory": 0}),  # spilled activations: read and written by batch
    ("llama", "awq+gptq", {}),
    ("mixtral", "gptq", {"min_expert_tokens": 30}),  # split experts, some RTN fallbacks
])
def test_block_work_stays_on_the_spec_device(models, tmp_path, monkeypatch, family, algo,
                                             extra):
    """Under :class:`_DeviceCheck`, with device "cpu" given explicitly: no tensor of the block
    work is made on the default device (beyond KNOWN_DEFAULT_DEVICE), none of the CPU side
    meets the block's maths unmoved, every saved result came back through to_host; and the
    results are bitwise those of a plain run with the default spec."""
    plain = calibrate(_spec(models, family, tmp_path / "plain", algo=algo, **extra)).out
    check, unmoved = _install_check(monkeypatch)
    checked = calibrate(_spec(models, family, tmp_path / "checked", algo=algo, device="cpu",
                              **extra)).out
    monkeypatch.undo()
    assert not check.mixed, f"CPU-side tensors reached the block's maths: {sorted(check.mixed)}"
    made = check.default_device - KNOWN_DEFAULT_DEVICE
    assert not made, f"tensors made on the default device in the block work: {sorted(made)}"
    assert KNOWN_DEFAULT_DEVICE <= check.default_device, "stale KNOWN_DEFAULT_DEVICE entry"
    assert not unmoved, f"results saved without to_host: {sorted(set(unmoved))}"
    a, b = _blocks(plain), _blocks(checked)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _losses(plain) == _losses(checked)


def test_the_check_finds_a_default_device_tensor_and_an_unmoved_batch(models, tmp_path,
                                                                      monkeypatch):
    """The check itself: a run whose statistics are made on the default device and whose
    block inputs skip to_device is caught on both counts (so a clean run means something)."""
    real_zeros = torch.zeros

    def zeros(*args, **kwargs):  # GroupStats' buffers made as if device= were forgotten
        kwargs.pop("device", None)
        return real_zeros(*args, **kwargs)

    check, _ = _install_check(monkeypatch)
    monkeypatch.setattr(capture.torch, "zeros", zeros)
    real_to_device = capture.to_device
    monkeypatch.setattr(capture, "to_device",  # batches forwarded as read (ctx still moved)
                        lambda t, dev, dtype=None: t if t.dim() == 3 else real_to_device(t, dev))
    calibrate(_spec(models, "llama", tmp_path / "c", algo="rtn", device="cpu"))
    monkeypatch.undo()
    assert any("capture.py:_new_strips" in s for s in check.default_device), check.default_device
    assert check.mixed  # the unmoved batches meet the weights on the device


def test_stream_loads_a_block_onto_the_requested_device(models):
    """ModelStream.load(name, device) materialises on that device (meta stands in for a
    second device: the skeleton's parameters are meta, so this checks the buffers' round trip
    and that every parameter was replaced and released)."""
    s = stream.ModelStream(models["llama"])
    block = s.model.model.layers[0]
    block.register_buffer("probe", torch.arange(3.0))
    with s.load("model.layers.0", device="cpu") as b:
        assert all(p.device.type == "cpu" for p in b.parameters())
        assert s.materialised_parameters() == sum(p.numel() for p in b.parameters())
    with s.load("model.layers.0", device="meta") as b:
        assert b.probe.is_meta and all(p.is_meta for p in b.parameters())
    assert torch.equal(block.probe, torch.arange(3.0)) and s.materialised_parameters() == 0


def test_results_record_the_device_and_resume_ignores_it(models, tmp_path, monkeypatch):
    """Block JSONs and the manifest say where blocks ran; a run killed on one device resumes
    on another (the device is not a resume setting), but another --device value is still
    checked when the spec is made."""
    res = calibrate(_spec(models, "llama", tmp_path / "c", algo="rtn"))
    manifest = json.loads((res.out / "quantpipe.json").read_text())
    n = manifest["num_blocks"]
    assert manifest["devices"] == {"cpu": n} and manifest["settings"]["device"] == "cpu"
    assert all(json.loads(f.read_text())["device"] == "cpu"
               for f in (res.out / "blocks").glob("block-*.json"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cpu = _spec(models, "llama", tmp_path / "x")
    for dev in ("cuda", "cuda:1"):
        assert _spec(models, "llama", tmp_path / "x", device=dev).fingerprint() == \
            cpu.fingerprint()
    stop_after_block_0(_spec(models, "llama", tmp_path / "k", algo="rtn"))
    spec = _spec(models, "llama", tmp_path / "k", algo="rtn", device="cuda").resolved()
    manifest = json.loads((models["llama"] / "quantpipe.json").read_text())
    run = resume.Run(spec, work_dir(spec.out), resume.resume_settings(spec, manifest))
    assert resume.prepare_work(run, n) == 1  # resumes at block 1 on the other device
    with pytest.raises(ValueError, match="only 2 CUDA device"):
        _spec(models, "llama", tmp_path / "x", device="cuda:2")


@pytest.mark.parametrize("dev,message", [
    ("cuda", "--device cuda: torch sees no CUDA device"),
    ("cuda:0", "--device cuda:0: torch sees no CUDA device"),
    ("gpu", "--device 'gpu' is not supported; use cpu, cuda or cuda:N"),
])
def test_cli_device_errors(models, tmp_path, monkeypatch, dev, message):
    """`quantpipe calibrate --device` without a GPU (or a bad name): one line saying what to
    do, before CALIB_DIR is touched."""
    from click.testing import CliRunner

    from quantpipe.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = CliRunner().invoke(main, ["calibrate", str(models["llama"]), "--out",
                                  str(tmp_path / "c"), "--device", dev])
    assert r.exit_code == 1 and message in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "c").exists()


def test_cli_device_reaches_the_spec(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from quantpipe.cli import main

    seen = {}

    def fake_calibrate(spec):
        seen["spec"] = spec
        raise ValueError("stop here")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(pipeline, "calibrate", fake_calibrate)
    r = CliRunner().invoke(main, ["calibrate", str(tmp_path), "--out", str(tmp_path / "c"),
                                  "--device", "cuda:0"])
    assert "stop here" in r.output and seen["spec"].device == "cuda:0"
    r = CliRunner().invoke(main, ["calibrate", str(tmp_path), "--out", str(tmp_path / "c")])
    assert seen["spec"].device == "cpu"

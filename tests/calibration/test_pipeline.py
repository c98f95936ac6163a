"""End-to-end calibration on tiny models: calibrate -> export -> load, resume, errors."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from quantpipe.calibration.artifact import read_calibration
from quantpipe.calibration.pipeline import CalibrateSpec, calibrate
from quantpipe.core.formats.loader import load_dequantized_model
from quantpipe.core.formats.native import read_native
from quantpipe.reports.eval import EvalSpec, evaluate_models
from quantpipe.stages.export import ExportSpec, export_quantized
from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16
from tests.calibration.test_moe import mixtral_fp16  # noqa: F401 (a fixture)
from tests.tiny_models import CORPUS

PROMPTS = CORPUS[:8]  # eight distinct business sentences


@pytest.fixture(scope="module")
def fp16_dir(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp16") / "fp16"
    export_fp16(Fp16ExportSpec(str(tiny_model_dir), out))
    return out


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    lines = [json.dumps({"prompt": f"{p} Request {i}."}) for i in range(6) for p in PROMPTS]
    path.write_text("\n".join(lines) + "\n")
    return path


def stop_after_block_0(spec) -> None:
    """Run ``calibrate(spec)`` until block 0's results and the next inputs are saved, then
    interrupt it (KeyboardInterrupt right after that progress is written)."""
    import quantpipe.calibration.resume as r

    orig = r.save_progress

    def stop_after_first(run, nxt, extra):
        orig(run, nxt, extra)
        if nxt == 1:
            raise KeyboardInterrupt  # the run dies after block 0 is saved

    r.save_progress = stop_after_first
    try:
        with pytest.raises(KeyboardInterrupt):
            calibrate(spec)
    finally:
        r.save_progress = orig


def _spec(fp16_dir, prompt_file, out, **kw):
    # group size 32: the tiny models' layers are 64 and 128 wide
    base = dict(samples=8, seq_len=32, min_tokens=4, batch_size=4, awq_samples=4, group_size=32)
    base.update(kw)
    return CalibrateSpec(fp16_dir, out, str(prompt_file), **base)


@pytest.mark.parametrize("algo", ["rtn", "gptq", "awq", "gptaq", "awq+gptq"])
def test_calibrate_export_eval(fp16_dir, prompt_file, tmp_path, algo):
    res = calibrate(_spec(fp16_dir, prompt_file, tmp_path / "calib", algo=algo, group_size=32))
    calib = read_calibration(res.out)
    infos = calib.layer_infos()
    assert len(infos) == 2 * 7  # 2 blocks x (q, k, v, o, gate, up, down)
    assert not (res.out / "state").exists()
    for bits in (4, 8):
        q = tmp_path / f"q{bits}"
        export_quantized(ExportSpec(res.out, q, bits=bits))
        ckpt = read_native(q)
        assert {s.bits for s in ckpt.layers.values()} == {bits}
    # the same calibration exports to the other formats, with identical weights
    from quantpipe.core.formats.loader import load_quantized

    native = load_quantized(tmp_path / "q4")
    for fmt in ("gptq", "compressed-tensors"):
        export_quantized(ExportSpec(res.out, tmp_path / fmt, bits=4, fmt=fmt))
        other = load_quantized(tmp_path / fmt)
        assert other.checkpoint_format == fmt
        for name, qw in native.layers.items():
            assert torch.equal(other.layers[name].dequantize(), qw.dequantize())
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = AutoModelForCausalLM.from_pretrained(fp16_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(fp16_dir)
    text = " ".join(PROMPTS) * 3
    kld = {}
    for bits in (4, 8):
        cand = load_dequantized_model(tmp_path / f"q{bits}")
        kld[bits] = evaluate_models(ref, cand, tok, EvalSpec(fp16_dir, fp16_dir, (text,),
                                                            ctx=64)).kld["mean"]
    assert kld[8] < kld[4]
    assert kld[8] < 1e-3


def test_awq_fold_keeps_fp_model(fp16_dir, prompt_file, tmp_path):
    """AWQ's folded FP tensors + scaled weights compute the same function as the original."""
    res = calibrate(_spec(fp16_dir, prompt_file, tmp_path / "calib", algo="awq"))
    calib = read_calibration(res.out)
    fp = calib.fp_tensors()
    assert any("layernorm" in k for k in fp)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(fp16_dir, dtype=torch.float32)
    folded = AutoModelForCausalLM.from_pretrained(fp16_dir, dtype=torch.float32)
    state = folded.state_dict()
    with torch.no_grad():
        for k, v in fp.items():
            state[k].copy_(v.float())
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        a, b = ref(ids).logits, folded(ids).logits
    # fp16 storage of the folded tensors: relative rounding ~1e-3
    assert (a - b).abs().max() < 2e-2 * a.abs().max()


def test_resume_after_kill(fp16_dir, prompt_file, tmp_path):
    out = tmp_path / "calib"
    code = (
        "import os, signal\n"
        "from pathlib import Path\n"
        "import quantpipe.calibration.pipeline as p\n"
        "import quantpipe.calibration.resume as r\n"
        "orig = r.save_progress\n"
        "def prog(spec, nxt, extra):\n"
        "    orig(spec, nxt, extra)\n"
        "    if nxt == 1:  # block 0 saved: die before block 1\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "r.save_progress = prog\n"
        f"p.calibrate(p.CalibrateSpec(Path({str(fp16_dir)!r}), Path({str(out)!r}), "
        f"{str(prompt_file)!r}, algo='gptq', samples=8, seq_len=32, min_tokens=4, "
        "batch_size=4, awq_samples=4, group_size=32))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "quantpipe.json").exists()
    with pytest.raises(ValueError, match="unfinished calibration"):
        read_calibration(out)
    with pytest.raises(ValueError, match="other settings"):
        calibrate(_spec(fp16_dir, prompt_file, out, algo="rtn"))
    res = calibrate(_spec(fp16_dir, prompt_file, out, algo="gptq"))
    assert res.resumed_from == 1
    resumed = read_calibration(out).layer_infos()
    fresh = calibrate(_spec(fp16_dir, prompt_file, tmp_path / "fresh", algo="gptq"))
    full = read_calibration(fresh.out).layer_infos()
    for name in full:  # resuming gives the same result as an uninterrupted run
        assert resumed[name]["w4"]["loss"] == pytest.approx(full[name]["w4"]["loss"], rel=1e-5)


def test_resume_refuses_another_clip_search(fp16_dir, prompt_file, tmp_path, monkeypatch):
    """The clip search's settings are library constants, not spec fields: a run stopped under
    one search must not resume under another (its blocks would mix both); the finished
    manifest records the search."""
    from quantpipe.calibration import grid

    spec = _spec(fp16_dir, prompt_file, tmp_path / "calib", algo="gptq")
    stop_after_block_0(spec)
    monkeypatch.setattr(grid, "CLIP_GRID", 20)
    with pytest.raises(ValueError, match="other settings.*clip_search"):
        calibrate(spec)
    monkeypatch.setattr(grid, "CLIP_GRID", 100)
    res = calibrate(spec)
    assert res.resumed_from == 1
    assert read_calibration(res.out).manifest["clip_search"] == {
        "grid": 100, "max_shrink": grid.CLIP_MAX_SHRINK, "sym_top_code": True}


def test_errors(fp16_dir, prompt_file, tmp_path):
    with pytest.raises(ValueError, match="use one of"):
        _spec(fp16_dir, prompt_file, tmp_path / "c", algo="smoothquant")
    with pytest.raises(ValueError, match="act-order"):
        _spec(fp16_dir, prompt_file, tmp_path / "c", algo="rtn", act_order=True)
    # the tiny model's layers are 64 and 128 wide: 128 does not fit the 64-wide ones
    with pytest.raises(ValueError, match="larger than in_features 64"):
        calibrate(_spec(fp16_dir, prompt_file, tmp_path / "c", algo="rtn", group_size=128,
                        strict_group_size=True))
    assert not (tmp_path / "c").exists()


def test_resumed_manifest_counts_every_block(fp16_dir, prompt_file, tmp_path):
    """Group-size fallbacks and timings of blocks computed before a kill are kept."""

    out = tmp_path / "calib"
    # 64-wide layers: per-channel fallback
    spec = _spec(fp16_dir, prompt_file, out, algo="rtn", group_size=128,
                 per_channel_if_larger=True)
    stop_after_block_0(spec)
    res = calibrate(spec)
    assert res.resumed_from == 1
    manifest = read_calibration(out).manifest
    # both blocks: every linear reading the 64-wide hidden state (down_proj reads 128)
    assert len(manifest["group_size_fallbacks"]) == 2 * 6
    assert manifest["seconds"] >= res.seconds > 0


def test_bad_prompt_file_creates_nothing(fp16_dir, tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        calibrate(CalibrateSpec(fp16_dir, tmp_path / "calib", str(tmp_path / "nope.jsonl")))
    assert not (tmp_path / "calib").exists()


def test_algorithm_table_resolves_the_documented_defaults():
    """ALGO_OPTIONS drives CalibrateSpec's defaults and option checks; the resolved values
    are part of the resume fingerprint, so they must not drift (docs/algorithms.md's table)."""
    from pathlib import Path

    from quantpipe.calibration.algorithms import ALGORITHMS
    from quantpipe.calibration.config import ALGOS

    assert ALGOS == ("auto", "gptq", "gptaq", "awq", "awq+gptq", "rtn")
    want = {"gptq": (True, True, True), "gptaq": (True, True, True),
            "awq": (False, None, False), "awq+gptq": (True, True, True),
            "rtn": (False, None, False)}
    for algo, (act_order, static, mse) in want.items():
        r = CalibrateSpec(Path("f"), Path("o"), algo=algo).resolved()
        assert (r.act_order, r.static_groups, r.mse_clip) == (act_order, static, mse)
    r = CalibrateSpec(Path("f"), Path("o"), algo="gptq", act_order=False).resolved()
    assert (r.act_order, r.static_groups) == (False, False)  # dynamic groups without act-order
    assert CalibrateSpec(Path("f"), Path("o"), algo="rtn", mse_clip=True).resolved().mse_clip
    for algo, bad in (("awq", dict(mse_clip=True)), ("rtn", dict(static_groups=False)),
                      ("awq", dict(act_order=True)), ("rtn", dict(damp=0.1)),
                      ("awq", dict(damp=0.1))):
        with pytest.raises(ValueError, match="applies to|apply to"):
            CalibrateSpec(Path("f"), Path("o"), algo=algo, **bad)
    for bad in (0.0, -0.01, 11.0):
        with pytest.raises(ValueError, match="--damp must be"):
            CalibrateSpec(Path("f"), Path("o"), algo="gptq", damp=bad)
    # the dampening resolves to the default for the GPTQ family, to nothing where no Hessian
    # is inverted; runs started before --damp existed (0.01 implied) resume with --damp 0.01
    # (their fingerprint), not with today's default
    assert [CalibrateSpec(Path("f"), Path("o"), algo=a).resolved().damp
            for a in ("gptq", "gptaq", "awq+gptq", "awq", "rtn")] == [0.1, 0.1, 0.1, None, None]
    fp = {d: CalibrateSpec(Path("f"), Path("o"), algo="gptq", damp=d).fingerprint()
          for d in (None, 0.01, 0.1)}
    assert fp[None] == fp[0.1] != fp[0.01]
    spec = CalibrateSpec(Path("f"), Path("o"), algo="gptq", damp=0.01)
    assert "damp" not in spec.resume_settings()
    assert CalibrateSpec(Path("f"), Path("o"), algo="gptq").resume_settings()["damp"] == "0.1"
    assert [a.quantized_forward for a in ALGORITHMS.values()] == [True, True, False, True, False]
    assert [a.asymmetric for a in ALGORITHMS.values()] == [False, True, False, False, False]


def test_damp_reaches_every_gptq_solve_and_the_manifest(fp16_dir, prompt_file, tmp_path):
    """--damp is the percdamp of every linear's GPTQ solve (each block file records the
    dampening used), the manifest's settings name it, and it changes the codes."""
    from safetensors.torch import load_file

    from quantpipe.calibration.artifact import block_file

    outs = {d: calibrate(_spec(fp16_dir, prompt_file, tmp_path / str(d), algo="gptaq",
                               damp=d)).out for d in (0.01, 0.5)}
    for d, out in outs.items():
        manifest = json.loads((out / "quantpipe.json").read_text())
        assert manifest["settings"]["damp"] == d
        for block in (0, 1):
            layers = json.loads(block_file(out, block, "json").read_text())["layers"]
            assert {r["damp"] for by_tag in layers.values() for r in by_tag.values()} == {d}
    a, b = (load_file(str(block_file(outs[d], 1, "safetensors"))) for d in (0.01, 0.5))
    assert any(not torch.equal(a[k], b[k]) for k in a if k.endswith(".qweight"))


def test_gptaq_is_gptq_where_the_inputs_agree(fp16_dir, prompt_file, tmp_path):
    """Block 0's q/k/v read the same inputs in the FP and the quantized model (dXXT = 0), so
    GPTAQ gives GPTQ's codes there; every later input group sees quantized linears before
    it, and GPTAQ's correction changes its codes."""
    from safetensors.torch import load_file

    from quantpipe.calibration.artifact import block_file

    gptq_out = calibrate(_spec(fp16_dir, prompt_file, tmp_path / "gptq", algo="gptq")).out
    gptaq_out = calibrate(_spec(fp16_dir, prompt_file, tmp_path / "gptaq", algo="gptaq")).out
    for block in (0, 1):
        a = load_file(str(block_file(gptq_out, block, "safetensors")))
        b = load_file(str(block_file(gptaq_out, block, "safetensors")))
        assert a.keys() == b.keys()
        for key in a:
            if not key.endswith(".qweight"):  # P.w4.qweight, P.w8.qweight: the codes
                continue
            same = torch.equal(a[key], b[key])
            first_group = block == 0 and any(f".{p}_proj." in key for p in "qkv")
            assert same == first_group, key


def test_gptaq_next_inputs_are_the_quantized_blocks_outputs(fp16_dir, prompt_file, tmp_path,
                                                           monkeypatch):
    """GPTAQ computes the next block's inputs (and its MLP groups' inputs) from the inputs it
    kept of o_proj and down_proj, not by running the block again: they must be exactly what
    the block, its linears at their INT4 weights, gives (a ragged last batch included)."""
    from dataclasses import replace

    from quantpipe.blocks.execute import run_block
    from quantpipe.calibration.algorithms import ALGORITHMS

    orig, checked = ALGORITHMS["gptaq"].whole_block, []

    def checking(spec, algo, block, name, model_type, family, hiddens, ctx, seed, out):
        results, raises, nxt = orig(spec, algo, block, name, model_type, family, hiddens, ctx,
                                    seed, out)
        # the block's linears hold their dequantized INT4 weights now
        want = run_block(block, hiddens["hidden"], ctx, spec.batch_size)  # [n, L, d]
        assert torch.equal(nxt["hidden"].read(0, want.shape[0]), want), name
        checked.append(name)
        return results, raises, nxt

    monkeypatch.setitem(ALGORITHMS, "gptaq", replace(ALGORITHMS["gptaq"], whole_block=checking))
    calibrate(_spec(fp16_dir, prompt_file, tmp_path / "c", algo="gptaq", batch_size=3))
    assert checked == ["model.layers.0", "model.layers.1"]


def test_gptaq_resumes_with_both_inputs(fp16_dir, prompt_file, tmp_path):
    """GPTAQ's resume state holds the FP model's block inputs too: a run stopped after block 0
    and resumed gives the uninterrupted run's results."""

    out = tmp_path / "calib"
    spec = _spec(fp16_dir, prompt_file, out, algo="gptaq")
    stop_after_block_0(spec)
    assert calibrate(spec).resumed_from == 1
    fresh = calibrate(_spec(fp16_dir, prompt_file, tmp_path / "fresh", algo="gptaq")).out
    resumed, full = read_calibration(out).layer_infos(), read_calibration(fresh).layer_infos()
    for name in full:
        assert resumed[name]["w4"]["loss"] == pytest.approx(full[name]["w4"]["loss"], rel=1e-5)


@pytest.mark.parametrize("algo", ["gptaq", "awq+gptq"])
def test_calibrate_command_takes_the_new_algorithms(tmp_path, monkeypatch, algo):
    """`quantpipe calibrate --algo gptaq|awq+gptq` reaches CalibrateSpec with GPTQ's
    defaults (the option plumbing only)."""
    from click.testing import CliRunner

    import quantpipe.calibration.pipeline as pipeline
    from quantpipe.cli import main

    seen = {}

    def fake_calibrate(spec):
        seen["spec"] = spec
        raise ValueError("stop here")

    monkeypatch.setattr(pipeline, "calibrate", fake_calibrate)
    r = CliRunner().invoke(main, ["calibrate", str(tmp_path), "--out", str(tmp_path / "c"),
                                  "--algo", algo, "--asym", "--no-act-order"])
    assert r.exit_code == 1 and "stop here" in r.output
    spec = seen["spec"].resolved()
    assert (spec.algo, spec.sym, spec.act_order, spec.mse_clip) == (algo, False, False, True)


def test_gptaq_refuses_moe_before_writing(mixtral_fp16, tmp_path):  # noqa: F811
    """GPTAQ pairs each linear's inputs in the FP and the quantized model token by token; an
    expert's routed tokens differ between the two, so MoE models are refused up front."""
    from quantpipe.calibration.pipeline import CalibrateSpec, calibrate

    fp16, prompts = mixtral_fp16
    with pytest.raises(ValueError, match="mixture-of-experts.*--algo gptq"):
        calibrate(CalibrateSpec(fp16, tmp_path / "c", str(prompts), algo="gptaq", samples=4,
                                seq_len=24, min_tokens=4, group_size=32))
    assert not (tmp_path / "c").exists()


def test_auto_is_gptaq_for_dense_models_and_gptq_for_moe(fp16_dir, prompt_file, mixtral_fp16,  # noqa: F811
                                                         tmp_path, monkeypatch):
    """The CLI's default `--algo auto` runs GPTAQ where it applies and GPTQ on MoE models; the
    spec resolves it before anything is recorded (the manifest names the algorithm run)."""
    from click.testing import CliRunner

    import quantpipe.calibration.pipeline as pipeline
    from quantpipe.cli import main

    moe_fp16, _ = mixtral_fp16
    assert CalibrateSpec(fp16_dir, tmp_path / "a", algo="auto").resolved().algo == "gptaq"
    assert CalibrateSpec(moe_fp16, tmp_path / "b", algo="auto").resolved().algo == "gptq"
    res = calibrate(_spec(fp16_dir, prompt_file, tmp_path / "calib", algo="auto"))
    assert json.loads((res.out / "quantpipe.json").read_text())["algo"] == "gptaq"
    seen = {}

    def fake_calibrate(spec):
        seen["spec"] = spec
        raise ValueError("stop here")

    monkeypatch.setattr(pipeline, "calibrate", fake_calibrate)
    r = CliRunner().invoke(main, ["calibrate", str(fp16_dir), "--out", str(tmp_path / "c")])
    assert r.exit_code == 1 and seen["spec"].algo == "auto"
    with pytest.raises(ValueError, match="config.json: missing"):
        CalibrateSpec(tmp_path / "nowhere", tmp_path / "d", algo="auto").resolved()


def test_gptaq_corrects_the_int4_pass_only():
    """GPTAQ's correction is for the INT4 model's input error: its INT8 result is GPTQ's on
    the same H (corrected, INT8 layers came out several times worse than GPTQ's), its INT4
    result is not."""
    from pathlib import Path

    from quantpipe.calibration import block_step as p
    from quantpipe.core.qformat import INT8_PER_CHANNEL, QuantSpec
    from tests.calibration.test_gptq import correlated_hessian, weight

    spec = CalibrateSpec(Path("f"), Path("o"), algo="gptaq").resolved()
    H, W = correlated_hessian(40), weight(41)
    dXXT = 0.05 * correlated_hessian(42)  # [in, in] a nonzero input mismatch
    x = torch.zeros(0, W.shape[1])
    for qspec, same in ((INT8_PER_CHANNEL, True), (QuantSpec(8, 32, True), True),
                        (QuantSpec(4, 32, True, True), False)):
        asym = p.AsymInputs(dXXT)
        got = p.quantize_gptaq(spec, "l", W, H, qspec, x, asym)
        want = p.quantize_gptq(spec, "l", W, H, qspec, x)
        assert torch.equal(got.weight.q, want.weight.q) == same, qspec


def test_default_group_size_is_planned_per_layer(prompt_file, tmp_path, caplog):
    """The default (group_size None, --group-size auto) gives every layer the group size a
    request for 128 falls back to (192 -> 64), bit for bit, recorded as a plan: no fallback,
    no warning. An explicit 128 gets the same numbers, reported as substitutions."""
    import logging

    from safetensors.torch import load_file

    from tests.tiny_models import make_model, save_model

    model, tok = make_model("llama", hidden_size=192, intermediate_size=256)
    fp16 = tmp_path / "fp16"
    export_fp16(Fp16ExportSpec(str(save_model(model, tok, tmp_path / "src")), fp16))
    with caplog.at_level(logging.INFO, logger="quantpipe.calibration"):
        auto = calibrate(_spec(fp16, prompt_file, tmp_path / "auto", algo="rtn",
                               group_size=None))
    assert auto.group_size_fallbacks == {}
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not warned and "planned per layer" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="quantpipe.calibration"):
        asked = calibrate(_spec(fp16, prompt_file, tmp_path / "asked", algo="rtn",
                                group_size=128))
    assert "--group-size 128 does not divide the in_features of 12 layer(s)" in caplog.text
    m_auto = read_calibration(auto.out).manifest
    m_asked = read_calibration(asked.out).manifest
    assert m_auto["group_size_fallbacks"] == {} and len(m_asked["group_size_fallbacks"]) == 12
    # q/k/v/o/gate/up read the 192-wide hidden state (64), down_proj the 256-wide one (128)
    assert m_auto["int4_group_sizes"] == m_asked["int4_group_sizes"]
    assert sorted(set(m_auto["int4_group_sizes"].values())) == [64, 128]
    for j in range(2):
        a = load_file(auto.out / "blocks" / f"block-{j:04d}.safetensors")
        b = load_file(asked.out / "blocks" / f"block-{j:04d}.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_int8_is_grouped_by_default_and_per_channel_on_request(prompt_file, tmp_path):
    """Every linear's INT8 result (export --bits 8, a plan's INT8 layers) is symmetric at
    --int8-group-size, 128 by default and falling back per layer as --group-size auto does
    (192 -> 64); -1 is one scale per output row. Groups fit each row closer: every layer's
    squared error to the FP16 weight is below the per-channel result's."""
    from safetensors.torch import load_file

    from tests.tiny_models import make_model, save_model

    model, tok = make_model("llama", hidden_size=192, intermediate_size=256)
    fp16 = tmp_path / "fp16"
    export_fp16(Fp16ExportSpec(str(save_model(model, tok, tmp_path / "src")), fp16))
    grouped = read_calibration(calibrate(_spec(fp16, prompt_file, tmp_path / "g",
                                               algo="rtn")).out)
    per_row = read_calibration(calibrate(_spec(fp16, prompt_file, tmp_path / "pc", algo="rtn",
                                               int8_group_size=-1)).out)
    assert grouped.manifest["int8"]["group_size"] == 128
    assert per_row.manifest["int8"]["group_size"] == -1
    infos = grouped.layer_infos()
    want = {n: 128 if n.endswith("down_proj") else 64 for n in infos}
    assert {n: i["w8"]["spec"]["group_size"] for n, i in infos.items()} == want
    assert {i["w8"]["spec"]["group_size"] for i in per_row.layer_infos().values()} == {-1}
    fp = load_file(next(fp16.glob("*.safetensors")))
    w_g = grouped.weights(dict.fromkeys(infos, 8))
    w_pc = per_row.weights(dict.fromkeys(infos, 8))
    for name in infos:
        ref = fp[f"{name}.weight"].double()
        err_g = (w_g[name].dequantize(torch.float64) - ref).square().sum()
        err_pc = (w_pc[name].dequantize(torch.float64) - ref).square().sum()
        assert err_g < err_pc, name


def test_per_channel_int8_resumes_runs_from_before_the_option():
    """A partial run from before --int8-group-size existed (per-channel INT8, no such key in
    its fingerprint) resumes with --int8-group-size -1; the grouped default does not."""
    from pathlib import Path

    old = CalibrateSpec(Path("f"), Path("o"), algo="rtn", int8_group_size=-1)
    assert "int8_group_size" not in old.resume_settings()
    assert CalibrateSpec(Path("f"), Path("o"), algo="rtn").resume_settings()[
        "int8_group_size"] == "128"
    with pytest.raises(ValueError, match="--int8-group-size 48 is not supported"):
        CalibrateSpec(Path("f"), Path("o"), int8_group_size=48)

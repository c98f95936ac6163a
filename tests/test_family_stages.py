"""Every registry family through the pipeline's stages on its tiny random model.

calibrate (rtn, gptq, awq; gptaq for dense families) -> export (native, gptq,
compressed-tensors) -> verify -> runtime (the engine over the loaded QuantLinear model). A
stage that a family cannot pass yet because of code outside the registry is a strict xfail
naming the cause (docs/families.md): it fails the suite the day the cause is fixed, so that
the table there is updated.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from quantpipe.core.families import FAMILIES, block_linear_names, family_for, get_path
from tests.tiny_models import CORPUS, FAMILY_CONFIGS, hf_greedy, make_family_model, save_model

# (family, algo) -> (reason, the exception expected) for a stage a family cannot pass yet;
# block 0's inputs likewise per family. Empty: every family passes every stage.
CALIBRATE_XFAIL: dict = {}
BLOCK_INPUT_XFAIL: dict = {}

FAMS = sorted(FAMILY_CONFIGS)


def _xfail(key, table: dict) -> list:
    if key not in table:
        return []
    reason, error = table[key]
    return [pytest.mark.xfail(reason=reason, raises=error, strict=True)]


def _param(family: str, algo: str, table: dict):
    return pytest.param(family, algo, marks=_xfail((family, algo), table), id=f"{family}-{algo}")


@pytest.fixture(scope="session")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"{p} Request {i}."})
                              for i in range(2) for p in CORPUS[:8]) + "\n")
    return path


_FP16: dict = {}


def _fp16_dir(family: str, tmp_path_factory):
    """The family's tiny model exported to FP16 once per session."""
    from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16

    if family not in _FP16:
        model, tok = make_family_model(family)
        tmp = tmp_path_factory.mktemp(f"stage-{family}")
        src = save_model(model, tok, tmp / "src")
        export_fp16(Fp16ExportSpec(str(src), tmp / "fp16"))
        _FP16[family] = tmp / "fp16"
    return _FP16[family]


_CALIB: dict = {}


def _calibrated(family: str, algo: str, prompt_file, tmp_path_factory):
    """The family's calibration with ``algo``, run once per session (later stages reuse it)."""
    from quantpipe.calibration.pipeline import CalibrateSpec, calibrate

    if (family, algo) not in _CALIB:
        out = tmp_path_factory.mktemp(f"calib-{family}-{algo}") / "calib"
        # group size 32: the tiny layers are 32, 64 and 128 wide. MoE: 96 tokens x top-2 over
        # 4 experts, about 48 rows each: every expert above the minimum of 8
        spec = CalibrateSpec(_fp16_dir(family, tmp_path_factory), out, str(prompt_file),
                             algo=algo, samples=4, seq_len=24, min_tokens=4, batch_size=4,
                             awq_samples=2, group_size=32, min_expert_tokens=8)
        _CALIB[family, algo] = calibrate(spec).out
    return _CALIB[family, algo]


_NAMES: dict = {}


def _names(family: str) -> set[str]:
    """Every linear of the tiny model's blocks (MoE: each expert's, in the split form)."""
    from quantpipe.core.families import get_blocks

    if family not in _NAMES:
        model, _ = make_family_model(family)
        _NAMES[family] = {f"model.layers.{i}.{n}"
                          for i, block in enumerate(get_blocks(model, family_for(family)))
                          for n in block_linear_names(family_for(family), block)}
    return _NAMES[family]


def _hub_names(family: str) -> set[str]:
    """:func:`_names` as checkpoints name them (MoE experts per expert under the hub's names)."""
    from quantpipe.core.experts import hub_name

    fam = family_for(family)
    if fam.moe is None:
        return _names(family)
    return {hub_name(n, fam.blocks, fam.moe) for n in _names(family)}


@pytest.mark.parametrize("family", [pytest.param(f, marks=_xfail(f, BLOCK_INPUT_XFAIL), id=f)
                                    for f in FAMS])
def test_calibration_block_inputs_equal_hf(family):
    """What calibration feeds block 0 is what the HF model feeds it."""
    from quantpipe.blocks.execute import embed_inputs

    model, _ = make_family_model(family)
    ids = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(0))
    hidden, _ = embed_inputs(model, ids)
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True).hidden_states[0]
    torch.testing.assert_close(hidden, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", FAMS)
def test_calibration_blocks_compute_what_hf_computes(family):
    """Each block run with calibration's context for its layer (positions, full or
    sliding-window mask) gives the HF model's next hidden state; the tiny configs' windows are
    shorter than the sequence, so a wrong mask shows."""
    from quantpipe.blocks.execute import embed_inputs, run_block
    from quantpipe.core.families import get_blocks

    model, _ = make_family_model(family)
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    hidden, ctx = embed_inputs(model, ids)
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True).hidden_states
    blocks = get_blocks(model, family_for(family))
    for i in range(len(blocks) - 1):  # the last entry is after the final norm
        hidden = run_block(blocks[i], hidden, ctx.for_layer(i), batch_size=2)
        torch.testing.assert_close(hidden, ref[i + 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,algo", [_param(f, a, CALIBRATE_XFAIL) for f in FAMS
                                         for a in ("rtn", "gptq", "awq")]
                         # GPTAQ (the default for dense models) refuses MoE families
                         + [_param(f, "gptaq", CALIBRATE_XFAIL) for f in FAMS
                            if family_for(f).moe is None])
def test_calibrate(family, algo, prompt_file, tmp_path_factory):
    from quantpipe.calibration.artifact import read_calibration

    calib = read_calibration(_calibrated(family, algo, prompt_file, tmp_path_factory))
    assert set(calib.layer_infos()) == _names(family)
    moe = family_for(family).moe
    if moe is not None:  # every expert got enough tokens: no fallback
        assert calib.manifest["expert_fallbacks"] == {}
    if moe is not None and algo == "awq":
        # every expert's gate/up scaled at once into the norm, the router compensated; each
        # down folds into its own up
        awq = calib.block_info(0)["awq"]
        gate, _, down = moe.expert_linears(0)
        joint = awq[f"{moe.path} (all experts' gate/up)"]
        assert "scaled with them" in awq[gate]["skipped"] and "ratio" in awq[down], awq
        assert moe.router in joint["compensated"] and joint["linears"] >= 8, joint
        if joint["ratio"] > 0:  # the folded norm and the compensated router are FP overrides
            fp = calib.fp_tensors()
            assert {f"model.layers.0.{moe.router}.weight",
                    "model.layers.0.post_attention_layernorm.weight"} <= set(fp)


@pytest.mark.parametrize("family,algo", [_param(f, "gptq", CALIBRATE_XFAIL) for f in FAMS])
def test_sensitivity_and_plan(family, algo, prompt_file, tmp_path_factory):
    """Measured KL sensitivity of every linear (whole model and block by block), then a 6-bit
    budget plan over all of them."""
    from quantpipe.calibration.artifact import read_calibration
    from quantpipe.calibration.mixed_precision.plan import PlanSpec, make_plan
    from quantpipe.calibration.mixed_precision.sensitivity import (
        SensitivitySpec,
        measure_sensitivity,
    )

    out = _calibrated(family, algo, prompt_file, tmp_path_factory)
    sens = measure_sensitivity(SensitivitySpec(out, tokens=64, seq_len=32, batch_size=4))
    assert set(sens.data["layers"]) == _names(family)
    # block by block (what a model too large for memory gets): every layer, every block's gain
    streamed = measure_sensitivity(SensitivitySpec(out, tokens=64, seq_len=32, batch_size=4,
                                                   stream=True, out=out.parent / "stream.json"))
    assert set(streamed.data["layers"]) == _names(family)
    assert len(streamed.data["gains"]) == read_calibration(out).num_blocks
    assert all(math.isfinite(v[f"kld_w{b}"]) and v[f"kld_w{b}"] >= 0
               for v in streamed.data["layers"].values() for b in (4, 8))
    plan = make_plan(read_calibration(out), PlanSpec(budget_bits=6.0))
    assert set(plan.bits) == _names(family) and "measured KL" in plan.damage_source
    assert plan.effective_bits() <= 6.0 and set(plan.bits.values()) <= {4, 8, None}


_NATIVE: dict = {}


def _native_dir(family: str, prompt_file, tmp_path_factory):
    """An INT4 native folder of the family: exported from its GPTQ calibration, or, where
    calibration cannot run yet, written by the tests' RTN stand-in (runtime stages still run)."""
    from quantpipe.core.qformat import QuantSpec
    from quantpipe.stages.export import ExportSpec, export_quantized
    from tests.runtime._quant_helpers import quantize_folder

    if family not in _NATIVE:
        out = tmp_path_factory.mktemp(f"native-{family}") / "q"
        if (family, "gptq") in CALIBRATE_XFAIL:
            quantize_folder(_fp16_dir(family, tmp_path_factory), out, [QuantSpec(4, 32, True)])
        else:
            calib = _calibrated(family, "gptq", prompt_file, tmp_path_factory)
            export_quantized(ExportSpec(calib, out, bits=4))
        _NATIVE[family] = out
    return _NATIVE[family]


@pytest.mark.parametrize("family,algo", [_param(f, "gptq", CALIBRATE_XFAIL) for f in FAMS])
def test_export_and_verify(family, algo, prompt_file, tmp_path, tmp_path_factory):
    """GPTQ calibration -> native, gptq and compressed-tensors folders: each verifies, all hold
    every block linear under its HF name, with the same weights."""
    from quantpipe.core.formats.loader import load_quantized
    from quantpipe.core.formats.verify import verify_checkpoint
    from quantpipe.stages.export import ExportSpec, export_quantized

    calib = _calibrated(family, algo, prompt_file, tmp_path_factory)
    native = _native_dir(family, prompt_file, tmp_path_factory)
    assert verify_checkpoint(native).quantized_layers == len(_names(family))
    ref_layers = load_quantized(native).layers
    assert set(ref_layers) == _hub_names(family)
    for fmt in ("gptq", "compressed-tensors"):
        export_quantized(ExportSpec(calib, tmp_path / fmt, bits=4, fmt=fmt))
        assert verify_checkpoint(tmp_path / fmt).checkpoint_format == fmt
        other = load_quantized(tmp_path / fmt).layers
        assert set(other) == _hub_names(family)
        for name, qw in ref_layers.items():
            assert torch.equal(other[name].dequantize(), qw.dequantize()), (fmt, name)


def _serving(family: str, prompt_file, tmp_path_factory):
    from quantpipe.runtime.engine import EngineConfig, LLMEngine, load_model_for_serving
    from quantpipe.runtime.quant_linear import QuantLinear

    native = _native_dir(family, prompt_file, tmp_path_factory)
    model, tok = load_model_for_serving(native, "cpu", torch.float32)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == len(_names(family))
    eng = LLMEngine(model, tok, EngineConfig(block_size=4, max_num_seqs=2,
                                             max_num_batched_tokens=16, kv_cache_memory=2**20))
    return native, model, tok, eng


@pytest.mark.parametrize("family", FAMS)
def test_runtime_generate(family, prompt_file, tmp_path_factory):
    """The loaded QuantLinear model's logits near the dequantized reference; the engine's greedy
    tokens equal HF greedy on that model (the second prompt runs past the sliding windows)."""
    from quantpipe.core.formats.loader import load_dequantized_model
    from quantpipe.runtime.engine import SamplingParams

    native, model, tok, eng = _serving(family, prompt_file, tmp_path_factory)
    ids = torch.arange(3, 30)[None]
    with torch.no_grad():
        got = model(ids).logits.double()
        want = load_dequantized_model(native, dtype=torch.float32)(ids).logits.double()
    # int8 / bf16 activations in the CPU kernels: relative error ~2**-8 per layer. MoE: such
    # an error can flip a near-tied routing choice, a step change in the logits; the fp32
    # comparison is test_moe_runtime_matches_the_dequantized_hf_model
    if family_for(family).moe is None:
        assert (got - want).norm() / want.norm() < 2e-2
    prompts = [[5, 9, 23], list(range(40, 50))]
    ref = [hf_greedy(model, p, 5) for p in prompts]
    assert eng.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True)) == ref


@pytest.mark.parametrize("family", FAMS)
def test_serve_one_request(family, prompt_file, tmp_path_factory):
    """The OpenAI-compatible server over the quantized folder: one greedy completion."""
    import httpx

    from quantpipe.runtime.server import build_app
    from tests.runtime.test_server_failures import serve_app

    _, model, tok, eng = _serving(family, prompt_file, tmp_path_factory)
    prompt = "The customer reports"
    ref = tok.decode(hf_greedy(model, tok.encode(prompt), 4), skip_special_tokens=True)
    with serve_app(build_app(eng, "tiny")) as url:
        r = httpx.post(f"{url}/v1/completions", json={
            "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
            timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref


def test_stage_tables_name_registry_families():
    for key in list(CALIBRATE_XFAIL) + list(BLOCK_INPUT_XFAIL):
        assert (key[0] if isinstance(key, tuple) else key) in FAMILIES


# the names vLLM's and transformers' loaders read (their Mixtral / Qwen MoE weight loaders)
HUB_EXPERT_NAMES = {
    "mixtral": ("model.layers.{i}.block_sparse_moe.experts.{e}.{n}", ("w1", "w2", "w3"),
                "model.layers.{i}.block_sparse_moe.gate.weight"),
    "qwen2_moe": ("model.layers.{i}.mlp.experts.{e}.{n}", ("gate_proj", "up_proj", "down_proj"),
                  "model.layers.{i}.mlp.gate.weight"),
    "qwen3_moe": ("model.layers.{i}.mlp.experts.{e}.{n}", ("gate_proj", "up_proj", "down_proj"),
                  "model.layers.{i}.mlp.gate.weight"),
}


@pytest.mark.parametrize("family", sorted(HUB_EXPERT_NAMES))
def test_moe_export_names_experts_as_the_hub(family, prompt_file, tmp_path_factory):
    """Every expert of every block is written per expert under the hub's names, split from the
    fused gate_up_proj (gate rows first), bit-identical to the calibration's result; the router
    (and Qwen2-MoE's shared_expert_gate) stay FP16, equal to the FP16 folder's."""
    from safetensors.torch import load_file

    from quantpipe.calibration.artifact import read_calibration
    from quantpipe.core.formats.loader import load_quantized

    pattern, leaves, router = HUB_EXPERT_NAMES[family]
    ckpt = load_quantized(_native_dir(family, prompt_file, tmp_path_factory))
    want = {pattern.format(i=i, e=e, n=n) for i in range(2) for e in range(4) for n in leaves}
    assert want <= set(ckpt.layers)
    fp16 = load_file(str(next(_fp16_dir(family, tmp_path_factory).glob("*.safetensors"))))
    calib = read_calibration(_calibrated(family, "gptq", prompt_file, tmp_path_factory))
    gate, up, _ = family_for(family).moe.linear_names
    for i in range(2):
        assert torch.equal(ckpt.fp_tensors[router.format(i=i)],
                           fp16[f"model.layers.{i}.mlp.gate.weight"])
        split = f"model.layers.{i}.mlp.experts.2"
        hub = pattern.format(i=i, e=2, n="").rstrip(".")
        w = calib.weights({f"{split}.{gate}": 4, f"{split}.{up}": 4})
        assert torch.equal(ckpt.layers[f"{hub}.{gate}"].q, w[f"{split}.{gate}"].q)
        assert torch.equal(ckpt.layers[f"{hub}.{up}"].q, w[f"{split}.{up}"].q)
        # the calibrated gate is the [0, I) rows of expert 2's gate_up_proj (not up's)
        W = fp16[f"model.layers.{i}.mlp.experts.gate_up_proj"][2].float()  # [2I, H]
        deq = ckpt.layers[f"{hub}.{gate}"].dequantize(torch.float32)
        assert (deq - W[:32]).norm() < 0.5 * (deq - W[32:]).norm()
    if family == "qwen2_moe":
        assert "model.layers.0.mlp.shared_expert_gate.weight" in ckpt.fp_tensors
        assert "model.layers.0.mlp.shared_expert.down_proj" in ckpt.layers


# fp32 end to end (dequantizing backend): only the summation order differs from HF's
MOE_LOGITS_ATOL = 1e-4


@pytest.mark.parametrize("family", sorted(HUB_EXPERT_NAMES))
def test_moe_runtime_matches_the_dequantized_hf_model(family, prompt_file, tmp_path_factory):
    """The loaded MoE model (experts as QuantLinears in SplitExperts, transformers' router)
    with the fp32 dequantizing backend: logits equal the dequantized HF model's within
    MOE_LOGITS_ATOL, and the engine's greedy tokens equal HF greedy on the dequantized model."""
    from quantpipe.core.experts import SplitExperts
    from quantpipe.core.formats.loader import load_dequantized_model
    from quantpipe.runtime.engine import EngineConfig, LLMEngine, SamplingParams
    from quantpipe.runtime.loader import load_quantized_model
    from quantpipe.runtime.quant_linear import QuantLinear

    native = _native_dir(family, prompt_file, tmp_path_factory)
    model = load_quantized_model(native, "cpu", torch.float32, backend="dequant")
    split = [m for m in model.modules() if isinstance(m, SplitExperts)]
    names = family_for(family).moe.linear_names
    assert len(split) == 2 and all(isinstance(getattr(s[e], n), QuantLinear) for s in split
                                   for e in range(4) for n in names)
    ref = load_dequantized_model(native, dtype=torch.float32)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0,
                                   atol=MOE_LOGITS_ATOL)
    _, tok = make_family_model(family)
    eng = LLMEngine(model, tok, EngineConfig(block_size=4, max_num_seqs=2,
                                             max_num_batched_tokens=16, kv_cache_memory=2**20))
    prompts = [[5, 9, 23], list(range(40, 50))]
    want = [hf_greedy(ref, p, 6) for p in prompts]
    assert eng.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True)) == want


@pytest.mark.parametrize("family", FAMS)
def test_streamed_eval_equals_whole_model_eval(family, prompt_file, tmp_path_factory):
    """`quantpipe eval` run block by block (both models streamed) gives the whole-model path's
    numbers: same tokens and top-token agreement, KLD and perplexities to fp32 summation order.
    And at most one module's weights of a model are materialised at any time."""
    import contextlib

    from quantpipe.blocks.stream import ModelStream
    from quantpipe.reports.eval import EvalSpec, run_eval

    native = _native_dir(family, prompt_file, tmp_path_factory)
    fp16 = _fp16_dir(family, tmp_path_factory)
    texts = (" ".join(CORPUS[:6]), " ".join(CORPUS[2:8]))
    spec = dict(reference=fp16, candidate=native, texts=texts, max_tokens=150, ctx=40)
    whole = run_eval(EvalSpec(**spec, stream=False))
    largest = {"n": 0}
    real_load = ModelStream.load

    @contextlib.contextmanager
    def counting(self, name):
        with real_load(self, name) as module:
            largest["n"] = max(largest["n"], self.materialised_parameters())
            yield module

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ModelStream, "load", counting)
        streamed = run_eval(EvalSpec(**spec, stream=True))
    assert streamed.tokens == whole.tokens == 150 and streamed.windows == whole.windows
    assert streamed.same_top_rate == whole.same_top_rate
    for key in ("mean", "median", "max"):
        assert math.isclose(streamed.kld[key], whole.kld[key], rel_tol=1e-4, abs_tol=1e-7), key
    assert math.isclose(streamed.ppl_reference, whole.ppl_reference, rel_tol=1e-5)
    assert math.isclose(streamed.ppl_candidate, whole.ppl_candidate, rel_tol=1e-5)
    assert streamed.notes and "block by block" in streamed.notes[0]
    # one module at a time: never more than the largest of a block, the table, norm + head
    model = make_family_model(family)[0]
    blocks = [sum(p.numel() for p in b.parameters())
              for b in get_path(model, family_for(family).blocks)]
    table = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight.numel()
    assert 0 < largest["n"] <= max(max(blocks), table, head) + model.config.hidden_size

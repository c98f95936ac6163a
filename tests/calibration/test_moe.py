"""MoE calibration (Mixtral, Qwen2-MoE, Qwen3-MoE): per-expert statistics from the routed rows
only, the expert-token minimum and its reported RTN fallback, the router kept FP16."""

from __future__ import annotations

import json

import pytest
import torch

from quantpipe.blocks.execute import embed_inputs, run_block
from quantpipe.calibration.capture import StatsCollector
from quantpipe.core.families import block_groups, family_for, get_blocks
from tests.tiny_models import CORPUS, MOE_FAMILIES, make_family_model, save_model


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_statistics_come_from_the_rows_routed_to_it(family):
    """Each expert's (gate, up) X^T X is the sum over the MLP-input rows the HF router sent to
    it (top-k), down's over that expert's act(gate) * up of those rows; float64 reference."""
    model, _ = make_family_model(family)
    fam = family_for(family)
    block = get_blocks(model, fam)[0]
    ids = torch.randint(3, 300, (4, 24), generator=torch.Generator().manual_seed(0))
    hidden, ctx = embed_inputs(model, ids)
    mlp_in: list[torch.Tensor] = []
    hook = block.mlp.register_forward_pre_hook(
        lambda _m, args: mlp_in.append(args[0].detach().reshape(-1, args[0].shape[-1])))
    groups = block_groups(fam, block)
    collector = StatsCollector(block, groups, sample_rows=0)
    run_block(block, hidden, ctx.for_layer(0), batch_size=2)
    collector.remove()
    hook.remove()
    x = torch.cat(mlp_in).double()  # [T, H]
    with torch.no_grad():
        _, _, top_k_index = block.mlp.gate(x.float())  # [T, k]: the HF router's choice
    by_first = {g.linears[0]: g for g in groups}
    counts = []
    for e in range(4):
        gate, up, down = fam.moe.expert_linears(e)
        rows = (top_k_index == e).any(-1)  # [T]
        counts.append(int(rows.sum()))
        xe = x[rows]  # [t, H]
        st = collector.stats[by_first[gate]]
        assert st.tokens == counts[-1]
        torch.testing.assert_close(st.xtx, xe.T @ xe, rtol=1e-5, atol=1e-5)
        expert = block.get_submodule(fam.moe.path)[e]
        Wg, Wu = (block.get_submodule(n).weight.double() for n in (gate, up))
        a = expert.act_fn(xe @ Wg.T) * (xe @ Wu.T)  # [t, I]
        st_down = collector.stats[by_first[down]]
        assert st_down.tokens == counts[-1]
        torch.testing.assert_close(st_down.xtx, a.T @ a, rtol=1e-5, atol=1e-5)
    assert sum(counts) == x.shape[0] * top_k_index.shape[1] and min(counts) > 0, counts


@pytest.fixture(scope="module")
def mixtral_fp16(tmp_path_factory):
    from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16

    model, tok = make_family_model("mixtral")
    tmp = tmp_path_factory.mktemp("moe")
    src = save_model(model, tok, tmp / "src")
    export_fp16(Fp16ExportSpec(str(src), tmp / "fp16"))
    prompts = tmp / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"{p} Request {i}."})
                                 for i in range(2) for p in CORPUS[:8]) + "\n")
    return tmp / "fp16", prompts


def _calibrate(fp16, prompts, out, min_expert_tokens: int):
    from quantpipe.calibration.pipeline import CalibrateSpec, calibrate

    return calibrate(CalibrateSpec(fp16, out, str(prompts), algo="gptq", samples=4, seq_len=24,
                                   min_tokens=4, batch_size=4, group_size=32,
                                   min_expert_tokens=min_expert_tokens))


def test_expert_below_the_token_minimum_falls_back_to_rtn_and_is_reported(mixtral_fp16,
                                                                          tmp_path):
    """With the minimum just above the least-routed expert's count, exactly the experts below
    it are quantized with plain RTN and listed (block JSON, manifest, result); the others keep
    their GPTQ results; the router is in no result (FP16)."""
    from safetensors.torch import load_file

    from quantpipe.calibration.artifact import read_calibration
    from quantpipe.calibration.rtn import rtn

    fp16, prompts = mixtral_fp16
    first = read_calibration(_calibrate(fp16, prompts, tmp_path / "a", 1).out)
    tokens = first.block_info(0)["expert_tokens"]
    assert first.block_info(0)["expert_fallbacks"] == {}
    assert sum(tokens[f"model.layers.0.mlp.experts.{e}.w1"] for e in range(4)) == 4 * 24 * 2
    least = min(tokens.values())
    res = _calibrate(fp16, prompts, tmp_path / "b", least + 1)
    second = read_calibration(res.out)
    below = {n: t for i in range(2) for n, t in second.block_info(i)["expert_tokens"].items()
             if t < least + 1}
    assert below and len(below) < len(tokens) * 2
    assert res.expert_fallbacks == below == second.manifest["expert_fallbacks"]
    assert second.manifest["min_expert_tokens"] == least + 1
    assert not any(".gate" in n for n in second.layer_infos())  # the router: FP16
    W = load_file(str(next(fp16.glob("*.safetensors"))))
    infos = second.layer_infos()
    for name in [n for n in below if n.startswith("model.layers.0.")]:
        e, leaf = int(name.split(".")[5]), name.rsplit(".", 1)[1]
        fused = W[f"model.layers.0.mlp.experts.{'down_proj' if leaf == 'w2' else 'gate_up_proj'}"]
        w = {"w1": fused[e, :32], "w3": fused[e, 32:], "w2": fused[e]}[leaf].float()
        spec = second.weights({name: 4}).specs[name]
        assert torch.equal(second.weights({name: 4})[name].q, rtn(w, spec).weight.q), name
        assert infos[name]["w4"]["damp"] == 0.0  # not GPTQ
    kept = [n for n in tokens if n not in below]
    for name in kept:  # block 0's inputs are the same in both runs
        assert torch.equal(second.weights({name: 4})[name].q, first.weights({name: 4})[name].q)


def test_qwen2_moe_dense_layer_calibrates_exports_and_loads(tmp_path):
    """A Qwen2-MoE layer in ``mlp_only_layers`` has a dense MLP: it gets Llama's MLP groups,
    is exported as plain linears beside the other layer's experts, and the loaded model (fp32
    dequantizing backend) matches the dequantized HF model."""
    from quantpipe.calibration.pipeline import CalibrateSpec, calibrate
    from quantpipe.core.formats.loader import load_dequantized_model
    from quantpipe.runtime.loader import load_quantized_model
    from quantpipe.stages.export import ExportSpec, export_quantized
    from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16

    model, tok = make_family_model("qwen2_moe", mlp_only_layers=[1])
    fam = family_for("qwen2_moe")
    blocks = get_blocks(model, fam)
    assert [g.linears for g in block_groups(fam, blocks[1])][2:] == [
        ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)]
    save_model(model, tok, tmp_path / "src")
    export_fp16(Fp16ExportSpec(str(tmp_path / "src"), tmp_path / "fp16"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in CORPUS[:8]) + "\n")
    calib = calibrate(CalibrateSpec(tmp_path / "fp16", tmp_path / "c", str(prompts), algo="rtn",
                                    samples=4, seq_len=24, min_tokens=4, group_size=32,
                                    min_expert_tokens=1)).out
    export_quantized(ExportSpec(calib, tmp_path / "q", bits=4))
    loaded = load_quantized_model(tmp_path / "q", "cpu", torch.float32, backend="dequant")
    assert not hasattr(loaded.model.layers[1].mlp, "experts")
    ids = torch.arange(3, 30)[None]
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(ids).logits, load_dequantized_model(tmp_path / "q")(ids).logits,
            rtol=0, atol=1e-4)

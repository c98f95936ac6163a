"""AWQ: exact scale folding on real transformers modules, scale search, clip search."""

from __future__ import annotations

import pytest
import torch

from quantpipe.calibration.awq import (
    awq_clip_search,
    awq_quantize,
    awq_search_scales,
    fold_scales,
    quantize_with_clip,
    scale_block,
)
from quantpipe.calibration.rtn import rtn
from quantpipe.core.qformat import QuantSpec


def tiny_llama_layer(n_kv_heads: int):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=n_kv_heads, num_hidden_layers=1, vocab_size=32,
        max_position_embeddings=64,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, layer_idx=0).double().eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            noise = 0.1 * torch.randn_like(p)
            p.copy_(1.0 + noise if "norm" in name else noise)
    rope = LlamaRotaryEmbedding(cfg)
    return layer, rope


def run_layer(layer, rope, x):
    pos = torch.arange(x.shape[1]).unsqueeze(0)
    cos, sin = rope(x, pos)
    with torch.no_grad():
        out = layer(x, position_embeddings=(cos.double(), sin.double()), position_ids=pos)
    return out[0] if isinstance(out, tuple) else out


def random_scales(n: int, seed: int) -> torch.Tensor:
    return torch.exp(0.7 * torch.randn(n, generator=torch.Generator().manual_seed(seed)))


def test_fold_leaves_llama_block_output_unchanged():
    layer, rope = tiny_llama_layer(n_kv_heads=4)  # MHA: v_proj -> o_proj can be folded
    x = torch.randn(2, 9, 64, dtype=torch.float64)
    before = run_layer(layer, rope, x)
    attn, mlp = layer.self_attn, layer.mlp
    folds = [  # (previous op, kind, linears reading its output), as quantpipe/core/families.py
        (layer.input_layernorm, "norm", [attn.q_proj, attn.k_proj, attn.v_proj]),
        (attn.v_proj, "linear", [attn.o_proj]),
        (layer.post_attention_layernorm, "norm", [mlp.gate_proj, mlp.up_proj]),
        (mlp.up_proj, "linear", [mlp.down_proj]),
    ]
    with torch.no_grad():
        for k, (prev, kind, linears) in enumerate(folds):
            s = random_scales(linears[0].in_features, k)
            res = fold_scales(prev.weight, kind, [lin.weight for lin in linears], s)
            prev.weight.copy_(res.prev_weight)
            for lin, w in zip(linears, res.weights):
                lin.weight.copy_(w)
    after = run_layer(layer, rope, x)
    assert not torch.equal(layer.input_layernorm.weight, torch.ones(64))
    torch.testing.assert_close(after, before, rtol=0, atol=1e-10)


def test_fold_rejects_gqa_v_to_o():
    layer, _ = tiny_llama_layer(n_kv_heads=2)  # v_proj: [32, 64], o_proj: [64, 64]
    attn = layer.self_attn
    with pytest.raises(ValueError, match="GQA"):
        fold_scales(attn.v_proj.weight, "linear", [attn.o_proj.weight], torch.ones(64))
    with pytest.raises(ValueError, match="prev_kind"):
        fold_scales(torch.ones(64), "layernorm", [attn.o_proj.weight], torch.ones(64))


def test_fold_linear_with_bias_and_layernorm_with_bias():
    torch.manual_seed(1)
    x = torch.randn(10, 16, dtype=torch.float64)
    prev = torch.nn.Linear(16, 24).double()
    nxt = torch.nn.Linear(24, 8).double()
    s = random_scales(24, 2)
    before = nxt(torch.relu(prev(x)))  # relu(z / s) * s = relu(z) for s > 0
    res = fold_scales(prev.weight, "linear", [nxt.weight], s, prev_bias=prev.bias)
    with torch.no_grad():
        prev.weight.copy_(res.prev_weight)
        prev.bias.copy_(res.prev_bias)
        nxt.weight.copy_(res.weights[0])
    torch.testing.assert_close(nxt(torch.relu(prev(x))), before, rtol=0, atol=1e-10)

    ln = torch.nn.LayerNorm(24).double()
    with torch.no_grad():
        ln.weight.normal_(1.0, 0.1)
        ln.bias.normal_(0.0, 0.1)
    lin = torch.nn.Linear(24, 8, bias=False).double()
    h = torch.randn(10, 24, dtype=torch.float64)
    before = lin(ln(h))
    res = fold_scales(ln.weight, "norm", [lin.weight], s, prev_bias=ln.bias)
    with torch.no_grad():
        ln.weight.copy_(res.prev_weight)
        ln.bias.copy_(res.prev_bias)
        lin.weight.copy_(res.weights[0])
    torch.testing.assert_close(lin(ln(h)), before, rtol=0, atol=1e-10)


def test_fold_gemma_one_plus_norm():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    norm = GemmaRMSNorm(32).double()
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.2)
    lin = torch.nn.Linear(32, 16, bias=False).double()
    x = torch.randn(5, 32, dtype=torch.float64)
    before = lin(norm(x))
    s = random_scales(32, 3)
    res = fold_scales(norm.weight, "one_plus_norm", [lin.weight], s)
    with torch.no_grad():
        norm.weight.copy_(res.prev_weight)
        lin.weight.copy_(res.weights[0])
    # GemmaRMSNorm computes in float32 internally, so only fp32 precision is reachable here
    torch.testing.assert_close(lin(norm(x)), before, rtol=1e-5, atol=1e-6)


def outlier_inputs(seed: int = 4, tokens: int = 256, n: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, n, generator=g)
    x[:, [3, 17, 40, 41]] *= 30.0  # a few large-magnitude activation channels
    return x


@pytest.mark.parametrize("duo_scaling", [False, True])
def test_search_scales_prefers_scaling_salient_channels(duo_scaling):
    spec = QuantSpec(4, 32, True)
    x = outlier_inputs()
    g = torch.Generator().manual_seed(5)
    Ws = [torch.randn(32, 64, generator=g) * 0.05, torch.randn(48, 64, generator=g) * 0.05]

    def loss_fn(effective):  # output error of the two linears sharing x, float64
        return sum(float(((x.double() @ (W - E).double().T) ** 2).mean())
                   for W, E in zip(Ws, effective))

    res = awq_search_scales(x.abs().mean(0), Ws, spec, loss_fn, n_grid=10,
                            duo_scaling=duo_scaling)
    assert len(res.losses) == 10 and res.scales.shape == (64,)
    assert res.losses[0] == pytest.approx(loss_fn([rtn(W, spec).weight.dequantize() for W in Ws]))
    assert res.ratio > 0
    best = res.losses[round(res.ratio * 10)]
    assert best == min(res.losses) and best < res.losses[0]
    # the returned scales reproduce the chosen loss once folded and quantized
    eff = [rtn(W * res.scales, spec).weight.dequantize() / res.scales for W in Ws]
    assert loss_fn(eff) == pytest.approx(best, rel=1e-9)
    assert res.scales[[3, 17, 40, 41]].min() > res.scales.median()


def test_search_scales_keeps_s_one_when_nothing_helps():
    spec = QuantSpec(4, 32, True)
    Ws = [torch.randn(16, 64) * 0.05]
    res = awq_search_scales(torch.rand(64) + 0.5, Ws, spec, lambda eff: 1.0, n_grid=5)
    assert res.ratio == 0.0 and torch.equal(res.scales, torch.ones(64))


def test_clip_search_lowers_output_error():
    spec = QuantSpec(4, 32, False)
    x = outlier_inputs(6, tokens=512)
    W = torch.distributions.StudentT(2.5).sample((48, 64)) * 0.03  # heavy tails: clip helps
    max_val = awq_clip_search(W, x, spec, n_grid=20, max_shrink=0.5, n_sample_tokens=256)
    absmax = W.reshape(48, 2, 32).abs().amax(-1)
    assert max_val.shape == (48, 2)
    assert (max_val <= absmax).all() and (max_val >= 0.5 * absmax - 1e-6).all()
    assert (max_val < absmax).any()

    def out_err(res):
        return float(((x.double() @ (W - res.weight.dequantize()).double().T) ** 2).sum())

    clipped, plain = quantize_with_clip(W, spec, max_val), rtn(W, spec)
    assert out_err(clipped) < out_err(plain)
    assert torch.equal(quantize_with_clip(W, spec, absmax).weight.q, plain.weight.q)


def _captured_layer(n_kv_heads: int):
    """A tiny float64 Llama layer run once with the pipeline's capture hooks."""
    from quantpipe.calibration.capture import InputRecorder, StatsCollector
    from quantpipe.core.families import family_for

    layer, rope = tiny_llama_layer(n_kv_heads)
    groups = family_for("llama").groups
    x = torch.randn(4, 16, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x[..., [5, 20]] *= 20.0  # salient channels, so that scaling pays off
    pos = torch.arange(16)[None]  # [1, L]
    cos, sin = rope(x, pos)
    kwargs = {"position_embeddings": (cos.double(), sin.double()), "position_ids": pos,
              "attention_mask": None}
    collector = StatsCollector(layer, groups, seed=0)
    recorder = InputRecorder(layer, [g.inspect for g in groups if g.inspect], max_samples=4)
    out = run_layer(layer, rope, x)  # [n, L, d]
    collector.remove()
    recorder.remove()
    return layer, rope, groups, x, kwargs, collector, recorder, out


@pytest.mark.parametrize("n_kv_heads", [2, 4])
def test_scale_block_keeps_the_function_and_rescales_the_statistics(n_kv_heads):
    """scale_block folds scales without changing the block's output, and the statistics it
    rescales equal those captured again on the folded block."""
    from quantpipe.calibration.capture import StatsCollector

    layer, rope, groups, x, kwargs, collector, recorder, out = _captured_layer(n_kv_heads)
    spec = QuantSpec(4, 32, True)
    info = scale_block(layer, groups, collector.stats, recorder.inputs, kwargs,
                       lambda in_f: spec, "norm")
    assert list(info) == [g.linears[0] for g in groups]
    if n_kv_heads == 2:  # v_proj [32 out] cannot carry o_proj's [64 in] scales
        assert "grouped-query" in info["self_attn.o_proj"]["skipped"]
    else:
        assert "ratio" in info["self_attn.o_proj"]
    searched = [v for v in info.values() if "ratio" in v]
    assert all(v["loss_best"] <= v["loss_s1"] for v in searched)
    assert any(v["ratio"] > 0 for v in searched)
    # the fold is exact in float64, but calibration's weights are float32 (scale_block reads
    # them as such): the float64 layer's output moves by float32 rounding of its weights
    torch.testing.assert_close(run_layer(layer, rope, x), out, rtol=1e-5, atol=1e-6)
    again = StatsCollector(layer, groups, seed=0)
    run_layer(layer, rope, x)
    again.remove()
    for g in groups:  # x / s seen by each group: float32 activations in the hooks
        torch.testing.assert_close(collector.stats[g].H, again.stats[g].H, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(collector.stats[g].x_absmean, again.stats[g].x_absmean,
                                   rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(collector.stats[g].x_sample(), again.stats[g].x_sample(),
                                   rtol=1e-5, atol=1e-6)


def test_awq_quantize_clips_all_but_q_k_at_int4():
    torch.manual_seed(4)
    x = outlier_inputs(7, tokens=256)
    W = torch.distributions.StudentT(2.5).sample((48, 64)) * 0.03
    spec4, spec8 = QuantSpec(4, 32, False), QuantSpec(8, -1, True)
    clipped = quantize_with_clip(W, spec4, awq_clip_search(W, x, spec4))
    assert torch.equal(awq_quantize("mlp.up_proj", W, spec4, x).weight.q, clipped.weight.q)
    assert not torch.equal(clipped.weight.q, rtn(W, spec4).weight.q)  # the clip did something
    for name, spec in (("self_attn.q_proj", spec4), ("self_attn.k_proj", spec4),
                       ("mlp.up_proj", spec8)):
        assert torch.equal(awq_quantize(name, W, spec, x).weight.q, rtn(W, spec).weight.q)
    H = x.T @ x / x.shape[0]  # [in, in]: the loss is tr(dW H dW^T) when H is given
    assert awq_quantize("mlp.up_proj", W, spec4, x, H=H).loss == pytest.approx(
        rtn(W, spec4, H=H, clip=awq_clip_search(W, x, spec4)).loss, rel=1e-12)

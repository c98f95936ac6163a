"""Every family in quantpipe/core/families.py: AWQ's folds leave the FP model's function unchanged.

For each input group the table names the op that produces the group's input; folding random
per-channel scales into that op (and their inverse into the group's linears) must not change
the model's logits. A wrong table entry (a norm that does not feed the group) changes them.
"""

import pytest
import torch

from quantpipe.calibration.awq import fold_scales
from quantpipe.core.families import (
    FAMILIES,
    NO_FOLD,
    ONE_PLUS_NORM_FAMILIES,
    block_groups,
    family_for,
    get_blocks,
)
from tests.tiny_models import FAMILY_CONFIGS, MOE_FAMILIES

# float64 end to end: any change well above rounding is a wrong fold, not noise
MAX_REL_ERR = 1e-5


def _tiny_model(model_type: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    # MHA (kv heads = heads) so that v_proj -> o_proj can be folded too; MoE: the tiny
    # configs' experts (4, top-2, 32 wide)
    moe = FAMILY_CONFIGS[model_type] if model_type in MOE_FAMILIES else {}
    kw = dict(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=64,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    cfg = AutoConfig.for_model(model_type, **{**kw, **moe})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float64,
                                             attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() in (2, 3):  # 3-D: MoE experts [E, out, in]
                p.normal_(0.0, 0.1)
            elif "norm" in name:  # distinct gains, so a fold into the wrong norm shows
                p.copy_(0.5 + torch.rand_like(p))
            else:
                p.normal_(0.0, 0.05)
    return model


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_awq_folds_keep_logits(model_type):
    model = _tiny_model(model_type)
    family = family_for(model_type)
    block = get_blocks(model, family)[0]  # MoE: experts split into per-expert linears
    ids = torch.randint(0, 96, (2, 12))  # [batch, seq]
    with torch.no_grad():
        ref = model(ids).logits  # [2, 12, vocab] fp64
    gen = torch.Generator().manual_seed(1)
    norm_kind = "one_plus_norm" if model_type in ONE_PLUS_NORM_FAMILIES else "norm"
    groups = block_groups(family, block)
    joint = [n for g in groups if g.prev_op == NO_FOLD for n in g.linears]
    if joint:
        # MoE: every expert's (and the shared expert's) gate/up share one scale folded into
        # the MLP-input norm; the router and shared_expert_gate read that norm too and get
        # their columns multiplied by it (calibration.awq.scale_shared_input)
        moe = family.moe
        readers = joint + [n for n in (moe.router, moe.shared_expert_gate) if n]
        mods = [block.get_submodule(n) for n in readers]
        norm = block.get_submodule(family.mlp_in_norm)
        s = 0.5 + 1.5 * torch.rand(norm.weight.numel(), generator=gen, dtype=torch.float64)
        res = fold_scales(norm.weight.data, norm_kind, [m.weight.data for m in mods], s)
        norm.weight.data = res.prev_weight
        for m, w in zip(mods, res.weights):
            m.weight.data = w
    for group in groups:
        if group.prev_op == NO_FOLD:
            continue  # folded above
        prev = block.get_submodule(group.prev_op)
        linears = [block.get_submodule(n) for n in group.linears]
        if isinstance(prev, torch.nn.Linear):
            if prev.out_features != linears[0].in_features:
                # a fused producer (Phi-3 qkv_proj -> o_proj): calibration skips and reports
                assert family.qkv_proj or family.gate_up_proj, group
                continue
            kind = "linear"
        else:
            kind = norm_kind
        s = 0.5 + 1.5 * torch.rand(linears[0].in_features, generator=gen, dtype=torch.float64)
        bias = getattr(prev, "bias", None)
        res = fold_scales(prev.weight.data, kind, [lin.weight.data for lin in linears], s,
                          bias.data if bias is not None else None)
        prev.weight.data = res.prev_weight
        if bias is not None:
            prev.bias.data = res.prev_bias
        for lin, w in zip(linears, res.weights):
            lin.weight.data = w
    with torch.no_grad():
        out = model(ids).logits
    rel = float((out - ref).abs().max() / ref.abs().max())
    assert rel <= MAX_REL_ERR, f"{model_type}: folding changed the logits (max rel err {rel:.2e})"


def test_unsupported_model_type_names_the_supported_ones():
    with pytest.raises(ValueError, match="not supported.*gemma2.*llama.*mixtral.*phi3.*"
                       "qwen2_moe.*qwen3.*qwen3_moe"):
        family_for("gpt2")


@pytest.mark.parametrize("model_type", sorted(set(FAMILIES) - set(MOE_FAMILIES)))
def test_block_from_its_last_linears_inputs(model_type):
    """GPTAQ computes its later passes and the quantized block's outputs from o_proj's and
    down_proj's inputs (calibration.capture.attention_residual / mlp_residual): with the
    family's norms and MLP module those give exactly the decoder layer's own outputs, and the
    MLP run from the first residual add gives down_proj exactly the inputs it had."""
    from quantpipe.blocks.execute import attention_residual, embed_inputs, mlp_residual

    model = _tiny_model(model_type)
    family = family_for(model_type)
    block = get_blocks(model, family)[0]
    _, attn_o, _, mlp_down = block_groups(family, block)
    o_proj, down_proj = (block.get_submodule(g.linears[0]) for g in (attn_o, mlp_down))
    seen = {}
    hooks = [lin.register_forward_pre_hook(lambda m, args, key=key: seen.update({key: args[0]}))
             for key, lin in (("o", o_proj), ("down", down_proj))]
    x, ctx = embed_inputs(model, torch.randint(0, 96, (2, 12)))
    x = x.double()  # [2, 12, 64] fp64, as the model
    with torch.no_grad():
        want = block(x, **ctx.for_layer(0).kwargs())
        want = want[0] if isinstance(want, tuple) else want  # [2, 12, 64]
        h1 = attention_residual(block, family, x, o_proj(seen["o"]))  # [2, 12, 64]
        x_down = seen.pop("down")
        block.get_submodule(family.mlp)(block.get_submodule(family.mlp_in_norm)(h1))
        assert torch.equal(seen["down"], x_down)  # the MLP reached down_proj with them
        for h in hooks:
            h.remove()
        assert torch.equal(mlp_residual(block, family, h1, down_proj(x_down)), want)

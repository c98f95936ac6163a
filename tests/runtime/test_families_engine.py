"""The serving engine on every family of the registry: logits and greedy tokens vs HF.

Each family's tiny model (tests/tiny_models.FAMILY_CONFIGS) turns on what the family adds over
Llama: Llama 3.x RoPE scaling, Mistral's sliding window on every layer, Qwen2's q/k/v biases,
Qwen3's q/k norms, Gemma's (1 + w) norms and embedding scale, Gemma 2's sandwich norms, score
and final-logit soft-caps, query_pre_attn_scalar and alternating sliding layers, Gemma 3's
per-layer-type RoPE and q/k norms, Phi-3's fused qkv_proj / gate_up_proj and partial RoPE;
Mixtral, Qwen2-MoE (shared expert, no top-k renormalisation) and Qwen3-MoE (top-k renormalised)
run transformers' router and experts through the engine's ``layer.mlp`` call.
"""

from __future__ import annotations

import pytest
import torch

from quantpipe.core.families import FAMILIES
from quantpipe.runtime.engine import EngineConfig, LLMEngine, SamplingParams, model_runner
from quantpipe.runtime.engine.model_runner import ModelRunner, SeqChunk
from tests.tiny_models import FAMILY_CONFIGS, hf_greedy, make_family_model

# fp32 end to end; the engine sums in another order than HF (paged blocks, GQA folding)
LOGITS_ATOL = 2e-4
NEW = 6
FAMS = sorted(FAMILY_CONFIGS)


@pytest.fixture(scope="module", params=FAMS)
def tiny(request):
    return request.param, *make_family_model(request.param)


def _steps(prompt: list[int], extra: list[int]) -> list[tuple[list[SeqChunk], list[int]]]:
    """Chunked prefill of ``prompt`` (3 chunks, block size 4), then one decode step per token of
    ``extra``: (chunks, positions whose logits the step returns)."""
    table = list(range(1, 1 + -(-(len(prompt) + len(extra)) // 4)))
    cuts = [0, 7, 19, len(prompt)]
    steps = [([SeqChunk(prompt[a:b], a, table)], [b - 1]) for a, b in zip(cuts, cuts[1:])]
    for j, t in enumerate(extra):
        pos = len(prompt) + j
        steps.append(([SeqChunk([t], pos, table)], [pos]))
    return steps


def _check_runner_logits(model, runner: ModelRunner, ids: list[int]) -> None:
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]  # [L, vocab] fp32
    for chunks, rows in _steps(ids[:24], ids[24:]):
        got = runner.forward(chunks)  # [1, vocab]
        torch.testing.assert_close(got, ref[rows], rtol=0, atol=LOGITS_ATOL)


def test_runner_logits_match_hf(tiny, monkeypatch):
    """Chunked prefill past the sliding windows, then decode steps: the last position's logits
    equal HF's full-sequence logits, on the fused C++ path (where usable) and the torch path."""
    family, model, tok = tiny
    ids = torch.randint(3, len(tok), (30,), generator=torch.Generator().manual_seed(3)).tolist()
    fused = ModelRunner(model, 4, 16)
    _check_runner_logits(model, fused, ids)
    monkeypatch.setattr(model_runner, "fused_ops_status", lambda *a: (False, "test"))
    plain = ModelRunner(model, 4, 16)
    assert not plain.fused
    _check_runner_logits(model, plain, ids)


def test_engine_greedy_matches_hf(tiny):
    family, model, tok = tiny
    g = torch.Generator().manual_seed(1)
    # the 20-token prompt runs past every tiny config's sliding window (8 or 16)
    prompts = [torch.randint(3, len(tok), (n,), generator=g).tolist() for n in (3, 9, 20)]
    ref = [hf_greedy(model, p, NEW) for p in prompts]
    eng = LLMEngine(model, tok, EngineConfig(block_size=4, max_num_seqs=4,
                                             max_num_batched_tokens=8, kv_cache_memory=2**20))
    assert eng.generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True)) == ref
    assert eng.pool.num_used == 0


def test_every_registry_family_has_a_tiny_config():
    assert set(FAMILY_CONFIGS) == set(FAMILIES)


def test_family_extras_are_on():
    """The tiny configs do exercise the extras (a default config would hide a broken path)."""
    llama, _ = make_family_model("llama")
    assert llama.model.rotary_emb.rope_type == "llama3"
    phi3, _ = make_family_model("phi3")
    runner = ModelRunner(phi3, 4, 4)
    cos, _ = runner._rope_tables(torch.zeros(2, 64), torch.arange(2))[None]
    assert cos.shape[-1] == runner.head_dim // 2  # partial rotary
    gemma2, _ = make_family_model("gemma2")
    runner = ModelRunner(gemma2, 4, 4)
    assert [p.window for p in runner.plans] == [8, None]
    assert runner.attn_softcap == 2.0 and runner.final_softcap == 5.0
    assert runner.scale == 32**-0.5


def test_unsupported_model_type_fails_naming_the_supported_ones():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="'gpt2' is not supported.*llama.*mixtral.*phi3.*"
                       "qwen2_moe.*qwen3.*qwen3_moe"):
        ModelRunner(model, 4, 4)

"""Engine outputs equal Hugging Face greedy generation token for token; blocks never leak."""

from __future__ import annotations

import pytest
import torch

from quantpipe.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from quantpipe.runtime.engine.kv_cache import BlockPool, KVCacheSpec, prefix_block_hashes
from quantpipe.runtime.engine.model_runner import apply_rope, rotate_half
from quantpipe.runtime.engine.sampling import filter_logits, sample_token
from tests.tiny_models import make_model

NEW = 12


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request):
    model, tok = make_model(request.param)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, len(tok), (n,), generator=g).tolist() for n in (3, 17, 30, 41)]
    prompts.append(prompts[3][:36] + [7, 8, 9])  # shares 9 full 4-token blocks with prompt 3
    ref = [model.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW,
                          do_sample=False)[0, len(p):].tolist() for p in prompts]
    return model, tok, prompts, ref


def _engine(model, tok, num_blocks: int, prefix: bool = True, **kw) -> LLMEngine:
    spec = KVCacheSpec(model.config.num_hidden_layers, model.config.num_key_value_heads,
                       model.config.hidden_size // model.config.num_attention_heads,
                       torch.float32, block_size=4)
    cfg = EngineConfig(block_size=4, kv_cache_memory=num_blocks * spec.bytes_per_block,
                       enable_prefix_caching=prefix, **kw)
    return LLMEngine(model, tok, cfg)


GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)


def test_concurrent_requests_match_hf_greedy(tiny):
    model, tok, prompts, ref = tiny
    eng = _engine(model, tok, 400, max_num_seqs=8, max_num_batched_tokens=64)
    assert eng.generate(prompts, GREEDY) == ref
    assert eng.pool.num_used == 0


def test_chunked_prefill_and_small_batches_match(tiny):
    model, tok, prompts, ref = tiny
    # 8 tokens per step: the 41-token prompt is prefilled in chunks alongside decodes.
    eng = _engine(model, tok, 400, max_num_seqs=2, max_num_batched_tokens=8)
    assert eng.generate(prompts, GREEDY) == ref
    assert eng.pool.num_used == 0


def test_preemption_with_tiny_pool_matches(tiny):
    model, tok, prompts, ref = tiny
    eng = _engine(model, tok, 16, max_num_seqs=4, max_num_batched_tokens=64)
    assert eng.generate(prompts, GREEDY) == ref
    assert eng.scheduler.num_preemptions > 0
    assert eng.pool.num_used == 0


def test_prefix_cache_hits_match(tiny):
    model, tok, prompts, ref = tiny
    eng = _engine(model, tok, 400, max_num_seqs=8, max_num_batched_tokens=64)
    assert eng.generate(prompts[3:4], GREEDY) == ref[3:4]
    assert eng.pool.hit_rate == 0.0
    assert eng.generate(prompts[3:], GREEDY) == ref[3:]  # both reuse prompt 3's blocks
    # Prompt 3 again: its first 40 tokens (10 blocks; the last token is always computed);
    # prompt 4: the 9 blocks (36 tokens) it shares with prompt 3.
    assert eng.pool.prefix_hits == 40 + 36
    assert eng.pool.num_used == 0


def test_abort_frees_blocks(tiny):
    model, tok, prompts, _ = tiny
    eng = _engine(model, tok, 64, max_num_seqs=2, max_num_batched_tokens=16)
    rids = [eng.add_request(p, GREEDY) for p in prompts]
    for _ in range(3):
        eng.step()
    assert eng.pool.num_used > 0
    for r in rids:
        eng.abort(r)
    assert eng.pool.num_used == 0 and not eng.has_work()


def test_stop_string_and_eos():
    model, tok = make_model("llama")
    eng = _engine(model, tok, 100, max_num_seqs=2, max_num_batched_tokens=32)
    ids = tok.encode("The customer reports")
    rid = eng.add_request(ids, SamplingParams(max_tokens=20, ignore_eos=True))
    full = ""
    while eng.has_work():
        full += "".join(o.new_text for o in eng.step() if o.request_id == rid)
    stop = full[3:5]
    rid = eng.add_request(ids, SamplingParams(max_tokens=20, ignore_eos=True, stop=(stop,)))
    text, reason = "", None
    while eng.has_work():
        for o in eng.step():
            text += o.new_text
            reason = o.finish_reason
    assert text == full[: full.index(stop)] and reason == "stop"
    # EOS ends a request unless ignore_eos: make EOS the argmax by boosting its lm_head row.
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 0  # tied: also zeroes the embedding row
        model.lm_head.weight[tok.eos_token_id] += model.model.norm.weight.sign() * 5
    out = eng.generate([ids], SamplingParams(max_tokens=5))
    assert out == [[tok.eos_token_id]]
    assert eng.pool.num_used == 0


def test_incremental_detokenization_equals_full_decode():
    """Streamed deltas == tokenizer.decode of all output ids, for random ids (byte-level BPE:
    lone UTF-8 continuation/lead bytes, special tokens) and for sampled engine outputs."""
    from quantpipe.runtime.engine.detokenize import Detokenizer

    _, tok = make_model("llama")
    g = torch.Generator().manual_seed(5)
    for _ in range(200):
        ids = torch.randint(0, len(tok), (int(torch.randint(1, 40, (1,), generator=g)),),
                            generator=g).tolist()
        d, streamed = Detokenizer(), ""
        for n in range(1, len(ids) + 1):
            d.advance(tok, ids[:n], final=n == len(ids))
            assert d.text.startswith(streamed)  # text only grows
            streamed = d.text
        assert d.text == tok.decode(ids, skip_special_tokens=True), ids
    model, tok = make_model("llama")
    eng = _engine(model, tok, 200, max_num_seqs=4, max_num_batched_tokens=64)
    params = [SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.5, seed=s)
              for s in range(4)]
    rids = [eng.add_request([5, 9, 23, 7 + i], sp) for i, sp in enumerate(params)]
    text = dict.fromkeys(rids, "")
    ids = {r: [] for r in rids}
    while eng.has_work():
        for o in eng.step():
            text[o.request_id] += o.new_text
            ids[o.request_id] += o.new_token_ids
    for r in rids:
        assert text[r] == tok.decode(ids[r], skip_special_tokens=True)


def test_validation_errors():
    model, tok = make_model("llama")
    eng = _engine(model, tok, 8, max_num_seqs=2, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], GREEDY)
    with pytest.raises(ValueError, match="KV blocks"):
        eng.add_request(list(range(3, 40)), GREEDY)
    with pytest.raises(ValueError, match="limit"):
        eng.add_request([5] * 250, GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        EngineConfig(num_kv_blocks=4, kv_cache_memory=2**20)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        EngineConfig(num_kv_blocks=0)
    sized = LLMEngine(model, tok, EngineConfig(block_size=4, num_kv_blocks=7))
    assert sized.pool.num_blocks == 7 and sized.runner.k_pools[0].shape[0] == 7


def test_block_pool_lru_eviction():
    pool = BlockPool(3)
    hashes = prefix_block_hashes(list(range(8)), 4)  # two full blocks
    a, b = pool.allocate(), pool.allocate()
    pool.register_full_block(a, hashes[0])
    pool.register_full_block(b, hashes[1])
    pool.free([a, b])
    assert pool.num_used == 0 and pool.num_free == 3
    assert pool.match_prefix(hashes) == [a, b]
    pool.free([a, b])  # freed tail first: b is older in the LRU than a
    c = pool.allocate()  # takes the never-used block
    d = pool.allocate()  # evicts the least recently freed cached block, b
    assert c not in (a, b) and d == b
    assert pool.match_prefix(hashes) == [a]  # chain broken at block 2
    pool.free([a, c, d])
    assert pool.num_used == 0


def test_rope_matches_hf():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from transformers.models.llama.modeling_llama import rotate_half as hf_rotate_half

    x = torch.randn(5, 3, 8, dtype=torch.float64)
    assert torch.equal(rotate_half(x), hf_rotate_half(x))
    cos, sin = torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    q_hf, _ = apply_rotary_pos_emb(x.transpose(0, 1), x.transpose(0, 1), cos, sin,
                                   unsqueeze_dim=0)
    torch.testing.assert_close(apply_rope(x, cos, sin), q_hf.transpose(0, 1), rtol=0, atol=1e-12)


def test_sampling_filters_and_seed():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    assert torch.isinf(filter_logits(logits, 2, 1.0)[:3]).all()
    probs = torch.softmax(logits, 0)  # p(4)=0.636, p(3)=0.234: top_p 0.7 keeps two tokens
    kept = ~torch.isinf(filter_logits(logits, 0, 0.7))
    assert kept.tolist() == [False, False, False, True, True]
    assert probs[3:].sum() >= 0.7
    p = SamplingParams(temperature=1.0, seed=3, max_tokens=1)
    draws = [sample_token(logits, p, torch.Generator().manual_seed(3)) for _ in range(3)]
    assert len(set(draws)) == 1
    assert sample_token(logits, SamplingParams(), None) == 4


def test_paged_attention_matches_float64_reference():
    from quantpipe.runtime.engine.model_runner import (
        SeqChunk,
        group_mask,
        paged_attention,
        prepare_batch,
    )

    g = torch.Generator().manual_seed(0)
    H, KV, D, bs, nb = 4, 2, 8, 4, 12
    k_pool = torch.randn(nb, bs, KV, D, generator=g, dtype=torch.float64)
    v_pool = torch.randn(nb, bs, KV, D, generator=g, dtype=torch.float64)
    # A decode (1 new token at position 9) and a prefill chunk (5 tokens from position 3).
    chunks = [SeqChunk([1], 9, [7, 2, 5]), SeqChunk([1] * 5, 3, [0, 11])]
    meta = prepare_batch(chunks, bs, torch.device("cpu"))
    q = torch.randn(6, H, D, generator=g, dtype=torch.float64)
    out = paged_attention(q, k_pool, v_pool, meta, group_mask(meta.attn_mask, H // KV), 0.3)
    row = 0
    for c in chunks:
        slots = torch.tensor([c.block_table[t // bs] * bs + t % bs
                              for t in range(c.start + len(c.token_ids))])
        k = k_pool.view(-1, KV, D)[slots].repeat_interleave(H // KV, 1)  # [ctx, H, D]
        v = v_pool.view(-1, KV, D)[slots].repeat_interleave(H // KV, 1)
        for i in range(len(c.token_ids)):
            n = c.start + i + 1  # causal: keys 0 .. own position
            w = torch.softmax(torch.einsum("hd,thd->ht", q[row], k[:n]) * 0.3, dim=-1)
            ref = torch.einsum("ht,thd->hd", w, v[:n])
            torch.testing.assert_close(out[row], ref, rtol=0, atol=1e-12)
            row += 1


@pytest.mark.slow
def test_smollm2_engine_matches_hf_greedy(smollm2_fp16_dir):
    from quantpipe.runtime.engine import load_model_for_serving

    model, tok = load_model_for_serving(smollm2_fp16_dir, "cpu")
    prompts = [tok.encode("The capital of France is"),
               tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.")]
    ref = [model.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8,
                          do_sample=False)[0, len(p):].tolist() for p in prompts]
    eng = LLMEngine(model, tok, EngineConfig(kv_cache_memory=2**26, max_num_seqs=4))
    assert eng.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True)) == ref
    assert eng.pool.num_used == 0


def test_fused_cpu_path_equals_torch_path(tiny, monkeypatch):
    """The C++ norms / RoPE / paged attention (decode tokens and short chunks) give the torch
    path's logits on mixed steps, including a chunk longer than the kernel attention's limit;
    and the engine on the torch path still matches HF greedy."""
    from quantpipe.runtime.engine import model_runner
    from quantpipe.runtime.engine.model_runner import KERNEL_ATTENTION_MAX_Q, ModelRunner, SeqChunk

    model, tok, prompts, ref = tiny
    fused = ModelRunner(model, 4, 64)
    if not fused.fused:
        pytest.skip(f"fused ops not usable here: {fused.fused_reason}")
    monkeypatch.setattr(model_runner, "fused_ops_status", lambda *a: (False, "test"))
    plain = ModelRunner(model, 4, 64)
    assert not plain.fused
    long = list(range(3, 3 + KERNEL_ATTENTION_MAX_Q + 5))  # > the kernel's chunk limit
    steps = [  # (chunks) run in order on both runners: prefills, then a mixed step, decodes
        [SeqChunk(prompts[1], 0, list(range(0, 5))), SeqChunk(prompts[0], 0, [5])],
        [SeqChunk([9], 17, list(range(0, 5))), SeqChunk(long[:6], 3, [5, 6, 7])],
        [SeqChunk([4], 18, list(range(0, 5))), SeqChunk([5], 9, [5, 6, 7])],
        [SeqChunk(long, 0, list(range(20, 31)))],
    ]
    for chunks in steps:
        torch.testing.assert_close(fused.forward(chunks), plain.forward(chunks),
                                   rtol=1e-4, atol=1e-4)
    eng = _engine(model, tok, 400, max_num_seqs=8, max_num_batched_tokens=64)
    assert not eng.runner.fused
    assert eng.generate(prompts, GREEDY) == ref


def test_a_mixed_step_gives_each_sequence_what_it_gets_alone(tiny, monkeypatch):
    """A step holding decode tokens and chunks longer than the kernel attention's limit: each
    sequence attends on its own (no query padded to another's length), so its logits are what
    the same chunk gets in a step of its own (writing the same K/V again is a no-op), on the
    fused path and on the torch path."""
    from quantpipe.runtime.engine import model_runner
    from quantpipe.runtime.engine.model_runner import KERNEL_ATTENTION_MAX_Q, ModelRunner, SeqChunk

    model, tok, prompts, ref = tiny
    long = list(range(3, 3 + KERNEL_ATTENTION_MAX_Q + 8))  # 40 tokens, 10 blocks of 4
    runners = [ModelRunner(model, 4, 64)]
    monkeypatch.setattr(model_runner, "fused_ops_status", lambda *a: (False, "test"))
    runners.append(ModelRunner(model, 4, 64))
    for runner in runners:
        runner.forward([SeqChunk(prompts[1], 0, list(range(0, 5)))])  # 17 tokens in blocks 0-4
        runner.forward([SeqChunk(prompts[2], 0, list(range(5, 13)))])  # 30 tokens in 5-12
        mixed = [SeqChunk([9], 17, list(range(0, 5))),  # decode, long prefill, decode, prefill
                 SeqChunk(long, 0, list(range(20, 30))),
                 SeqChunk([4], 30, list(range(5, 13))),
                 SeqChunk(long[:36], 0, list(range(30, 39)))]
        together = runner.forward(mixed)
        alone = torch.cat([runner.forward([c]) for c in mixed])
        torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


# bf16 cache: SDPA runs a whole prompt in bf16 (queries rounded too), the kernel in fp32
@pytest.mark.parametrize("kv_dtype,tol", [(None, 1e-4), (torch.bfloat16, 2e-2)])
def test_long_chunks_in_the_kernel_equal_sdpa(tiny, kv_dtype, tol, monkeypatch):
    """QUANTPIPE_CPU_PREFILL_ATTENTION: long chunks attend in the C++ kernel's tiles ("kernel")
    or with torch's SDPA ("sdpa"): whole prompts, a chunk after a cached prefix and a step that
    mixes them with decode tokens give the same logits (fp32 sums in another order); an unknown
    value is refused."""
    from quantpipe.runtime.engine.model_runner import (
        KERNEL_ATTENTION_MAX_Q, PREFILL_ATTENTION_ENV, ModelRunner, SeqChunk)

    model, tok, prompts, ref = tiny
    runners = {}
    for choice in ("kernel", "sdpa"):
        monkeypatch.setenv(PREFILL_ATTENTION_ENV, choice)
        runners[choice] = ModelRunner(model, 4, 64, kv_dtype)
    if not runners["kernel"].fused:
        pytest.skip(f"fused ops not usable here: {runners['kernel'].fused_reason}")
    assert runners["kernel"].long_kernel and not runners["sdpa"].long_kernel
    long = list(range(3, 3 + KERNEL_ATTENTION_MAX_Q + 8))  # 40 tokens, 10 blocks of 4
    steps = [[SeqChunk(long, 0, list(range(0, 10)))],  # a whole prompt
             [SeqChunk(prompts[1], 0, list(range(10, 15)))],  # 17 tokens (kernel tiles: 16+)
             [SeqChunk([9], 17, list(range(10, 15))),  # a decode beside a whole prompt
              SeqChunk(long[:36], 0, list(range(20, 29)))],
             # 34 tokens after 36 cached ones, beside a decode
             [SeqChunk(long[36:] + long[:30], 36, list(range(20, 38))),
              SeqChunk([4], 18, list(range(10, 15)))]]
    for chunks in steps:
        torch.testing.assert_close(runners["kernel"].forward(chunks),
                                   runners["sdpa"].forward(chunks), rtol=tol, atol=tol)
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "flash")
    with pytest.raises(ValueError, match="expected auto, kernel or sdpa"):
        ModelRunner(model, 4, 64, kv_dtype)


@pytest.mark.parametrize("kv_dtype,tol", [(None, 1e-4), (torch.bfloat16, 2e-2)])
def test_a_prompt_attends_causally_to_its_own_keys_as_over_the_cache(tiny, kv_dtype, tol):
    """A long chunk that starts its sequence (the C++ kernel's tiles; where SDPA runs it, causal
    SDPA on the step's own keys, in bf16 with a bf16 cache): its last logits are what the same
    prompt gets when its first token is already cached and the other 36 go through the cache
    (fp32 rounding; bf16 rounding of the queries too where SDPA runs with a bf16 cache)."""
    from quantpipe.runtime.engine.model_runner import ModelRunner, SeqChunk

    model, tok, prompts, ref = tiny
    long = list(range(3, 40))  # 37 tokens, blocks of 4
    blocks = list(range(10))
    fresh = ModelRunner(model, 4, 64, kv_dtype).forward([SeqChunk(long, 0, blocks)])
    runner = ModelRunner(model, 4, 64, kv_dtype)
    runner.forward([SeqChunk(long[:1], 0, blocks[:1])])
    cached = runner.forward([SeqChunk(long[1:], 1, blocks)])
    assert float((fresh - cached).norm() / cached.norm()) < tol


def test_bf16_kv_cache_halves_the_pool_and_stays_close(tiny):
    """kv_dtype="bf16": half the bytes per block; on short chunks (the kernel attention where
    usable) and a long one (SDPA) the logits stay within bf16 rounding of the fp32 cache's, and
    the engine runs to completion and frees its blocks."""
    from quantpipe.runtime.engine.model_runner import ModelRunner, SeqChunk

    model, tok, prompts, ref = tiny
    fp32 = ModelRunner(model, 4, 64)
    bf16 = ModelRunner(model, 4, 64, torch.bfloat16)
    assert bf16.k_pools[0].dtype == torch.bfloat16
    assert bf16.kv_spec.bytes_per_block * 2 == fp32.kv_spec.bytes_per_block
    long = list(range(3, 40))  # 37 tokens: the SDPA path
    steps = [[SeqChunk(prompts[1], 0, list(range(0, 5)))], [SeqChunk([9], 17, list(range(0, 5)))],
             [SeqChunk(long, 0, list(range(20, 30)))]]
    for chunks in steps:
        want, got = fp32.forward(chunks), bf16.forward(chunks)
        assert float((got - want).norm() / want.norm()) < 2e-2
    eng = _engine(model, tok, 400, max_num_seqs=8, max_num_batched_tokens=64, kv_dtype="bf16")
    outs = eng.generate(prompts, GREEDY)
    assert [len(o) for o in outs] == [NEW] * len(prompts) and eng.pool.num_used == 0
    with pytest.raises(ValueError, match="kv_dtype"):
        EngineConfig(kv_dtype="int8")


# --- failures stay with the requests they hit (issue #13) -------------------------------------
@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324, 1e-8, 0.3, 1.0, 7.0, 1e30])
def test_sampling_distribution_matches_float64_for_any_temperature(temperature):
    """token_probs against softmax(logits / T) in float64 (subtracting the max there too, as
    float64 itself overflows at T = 1e-300); tiny temperatures give the argmax one-hot."""
    from quantpipe.runtime.engine.sampling import token_probs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(384, generator=g) * 4  # [vocab] fp32
    for top_k, top_p in ((0, 1.0), (20, 1.0), (0, 0.8), (0, 5e-324), (3, 1e-45)):
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        got = token_probs(logits, params)  # [vocab] fp32
        l64 = logits.double()
        ref = torch.softmax(filter_logits((l64 - l64.max()) / temperature, top_k, top_p), -1)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-6)
        tok = sample_token(logits, params, torch.Generator().manual_seed(1))
        assert 0 <= tok < 384
    if temperature <= 1e-8:  # the greedy limit: all mass on the argmax
        assert sample_token(logits, SamplingParams(temperature=temperature), None) == int(
            logits.argmax())


def test_sampling_params_reject_non_finite_temperature_and_huge_seed():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("inf"))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(temperature=1.0, seed=2**64)


def _hf_greedy(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    return [model.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False)[0, len(p):].tolist() for p in prompts]


def _run_all(eng: LLMEngine, prompts, params) -> dict:
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    got = {r: {"ids": [], "reason": None, "error": None} for r in rids}
    while eng.has_work():
        for out in eng.step():
            got[out.request_id]["ids"] += out.new_token_ids
            if out.finished:
                got[out.request_id].update(reason=out.finish_reason, error=out.error)
    return [got[r] for r in rids]


def test_sampling_failure_fails_only_that_request(monkeypatch):
    import quantpipe.runtime.engine.engine as engine_mod

    model, tok = make_model("llama")
    prompts = [[5, 6, 7, 8, 9], list(range(10, 27)), [40, 41, 42]]
    ref = _hf_greedy(model, prompts, 6)
    real = engine_mod.sample_token

    def failing(logits, params, gen):
        if params.seed == 99:
            raise RuntimeError("injected sampling fault")
        return real(logits, params, gen)

    monkeypatch.setattr(engine_mod, "sample_token", failing)
    eng = _engine(model, tok, 64, max_num_seqs=4, max_num_batched_tokens=64)
    bad = SamplingParams(max_tokens=6, temperature=1.0, seed=99, ignore_eos=True)
    good = SamplingParams(max_tokens=6, ignore_eos=True)
    res = _run_all(eng, prompts, [good, bad, good])
    assert res[1]["reason"] == "error" and "injected sampling fault" in res[1]["error"]
    assert [res[0]["ids"], res[2]["ids"]] == [ref[0], ref[2]]
    assert res[0]["reason"] == res[2]["reason"] == "length"
    assert eng.pool.num_used == 0 and eng.num_failed == 1
    assert eng.generate(prompts, good) == ref  # the engine goes on


def test_forward_failure_fails_the_step_frees_blocks_and_engine_goes_on():
    model, tok = make_model("llama")
    prompts = [[5, 6, 7, 8, 9], list(range(10, 27))]
    ref = _hf_greedy(model, prompts, 6)
    eng = _engine(model, tok, 64, max_num_seqs=4, max_num_batched_tokens=64)
    real = eng.runner.forward
    calls = {"n": 0}

    def flaky(chunks):
        calls["n"] += 1
        if calls["n"] == 3:  # a decode step with both sequences holding blocks
            raise RuntimeError("injected device fault")
        return real(chunks)

    eng.runner.forward = flaky
    res = _run_all(eng, prompts, [SamplingParams(max_tokens=6, ignore_eos=True)] * 2)
    assert [r["reason"] for r in res] == ["error", "error"]
    assert all("injected device fault" in r["error"] for r in res)
    assert eng.pool.num_used == 0 and not eng.has_work()
    assert eng.consecutive_step_failures == 1
    assert eng.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True)) == ref
    assert eng.consecutive_step_failures == 0


def test_engine_loop_survives_failures_and_fails_every_request_when_it_dies():
    import queue as queue_mod

    from quantpipe.runtime.engine import EngineLoop

    model, tok = make_model("llama")
    eng = _engine(model, tok, 64, max_num_seqs=4, max_num_batched_tokens=64)
    el = EngineLoop(eng)
    el.start()
    outs: queue_mod.Queue = queue_mod.Queue()

    def run(rid: str, params: SamplingParams):
        el.submit(rid, [5, 6, 7], params, outs.put)
        while True:
            out = outs.get(timeout=30)
            if out.finished:
                return out

    try:
        # seed out of torch's range slipped past validation: only this request fails
        bad = SamplingParams(temperature=1.0)
        object.__setattr__(bad, "seed", 2**64)
        assert run("a", bad).finish_reason == "error"
        assert run("b", SamplingParams(max_tokens=3, ignore_eos=True)).finish_reason == "length"
        assert el.error is None
        # a scheduler bug is unrecoverable: the loop dies, every request gets an error
        eng.scheduler.schedule = lambda: 1 / 0
        died = run("c", SamplingParams(max_tokens=3))
        assert died.finish_reason == "error" and "ZeroDivisionError" in died.error
        assert isinstance(el.error, ZeroDivisionError)
        late = run("d", SamplingParams(max_tokens=3))  # answered at once, never hangs
        assert late.finish_reason == "error" and "engine stopped" in late.error
    finally:
        el.stop()


def test_engine_loop_stops_after_forward_failures_in_a_row():
    """A forward that always fails is a broken device, not a bad request: after
    MAX_CONSECUTIVE_STEP_FAILURES the loop reports itself dead instead of failing forever."""
    import queue as queue_mod

    from quantpipe.runtime.engine import EngineLoop
    from quantpipe.runtime.engine.engine_loop import MAX_CONSECUTIVE_STEP_FAILURES

    model, tok = make_model("llama")
    eng = _engine(model, tok, 64, max_num_seqs=1, max_num_batched_tokens=64)

    def broken(chunks):
        raise RuntimeError("device lost")

    eng.runner.forward = broken
    el = EngineLoop(eng)
    el.start()
    outs: queue_mod.Queue = queue_mod.Queue()
    try:
        for i in range(MAX_CONSECUTIVE_STEP_FAILURES):
            assert el.error is None
            el.submit(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=2), outs.put)
            out = outs.get(timeout=30)
            assert out.finish_reason == "error" and "device lost" in out.error
        el._thread.join(timeout=30)
        assert isinstance(el.error, RuntimeError) and "in a row" in str(el.error)
        assert eng.pool.num_used == 0
    finally:
        el.stop()

"""The report's answers through the serving engine: the same tokens as Hugging Face greedy, each
prompt's own budget, timings a serving benchmark would report, per-model peak RSS; and what
the page makes of them (per-category table, candidates side by side, speed and memory)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from quantpipe.prompts.sets import PromptRecord
from quantpipe.reports import answers as answers_module
from quantpipe.reports import charts
from quantpipe.reports.answers import (
    _hf_answers,
    answer_prompts,
    closed_loop,
    fit_context,
    render_prompts,
)
from quantpipe.reports.html import render_quality_report
from quantpipe.reports.summary import report_json, summarize
from quantpipe.reports.textmetrics import is_refusal
from quantpipe.runtime.engine import EngineConfig, LLMEngine
from quantpipe.runtime.engine.detokenize import eos_ids
from quantpipe.runtime.generate import greedy_decode
from tests.reports.sample_data import sample_report
from tests.tiny_models import make_model

RECORDS = [
    PromptRecord(id=f"p{i}", source=f"t:{i}", prompt=text, category=cat, lang=lang,
                 expect_json=js, json_keys=("a",) if js else ())
    for i, (text, cat, lang, js) in enumerate([
        ("Reply to the customer about the late parcel.", "support", "en", False),
        ("Return JSON with key a for: a is 3.", "extraction", "en", True),
        ("总结：收入增长百分之十二。", "summary", "zh", False),
        ("Write one SQL query that counts orders.", "sql", "en", False),
        ("Extract the fields as JSON: a=1.", "extraction", "en", True),
    ])
]


@pytest.fixture(scope="module")
def tiny():
    model, tok = make_model("llama")
    return model.eval(), tok


def _hf_greedy(model, tok, ids: list[int], budget: int) -> list[int]:
    new, _, _ = greedy_decode(model, torch.tensor([ids]), budget, eos_ids(model, tok))
    return new


@pytest.mark.parametrize("concurrency", [1, 3])
def test_closed_loop_answers_equal_hf_greedy_within_each_budget(tiny, concurrency):
    model, tok = tiny
    prompts = render_prompts(tok, RECORDS)
    budgets = [5, 17, 9, 1, 12]
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, max_num_seqs=concurrency,
                                                num_kv_blocks=64, enable_prefix_caching=False))
    toks, stats = closed_loop(engine, prompts, budgets, concurrency)
    assert toks == [_hf_greedy(model, tok, p, b) for p, b in zip(prompts, budgets)]
    assert all(len(t) <= b for t, b in zip(toks, budgets))
    assert stats["requests"] == 5 and stats["concurrency"] == concurrency
    assert stats["output_tokens_per_s"] > 0
    ttft, tpot = stats["ttft_ms"], stats["tpot_ms"]
    assert 0 < ttft["p50"] <= ttft["p95"] <= ttft["p99"]
    assert 0 < tpot["p50"] <= tpot["p99"]
    assert engine.pool.num_used == 0  # every request finished and freed its blocks


def test_answer_prompts_loads_one_folder_and_gives_json_prompts_their_budget(
        tiny_llama_dir):
    from quantpipe.runtime.engine import load_model_for_serving

    ans = answer_prompts(tiny_llama_dir, "FP16", RECORDS, 6, json_new_tokens=20)
    model, tok = load_model_for_serving(tiny_llama_dir, head_dtype="fp16")
    prompts = render_prompts(tok, RECORDS)
    want = [_hf_greedy(model, tok, p, 20 if r.expect_json else 6)
            for p, r in zip(prompts, RECORDS)]
    assert list(ans.tokens) == [len(w) for w in want]
    assert list(ans.texts) == [tok.decode(w, skip_special_tokens=True) for w in want]
    sp = ans.speed
    assert sp.name == "FP16" and set(sp.by_concurrency) == {1, 8}
    assert sp.by_concurrency[8]["requests"] == 5 and sp.by_concurrency[1]["requests"] == 3
    assert sp.weight_bytes == sum(f.stat().st_size for f in tiny_llama_dir.glob("*.safetensors"))
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    # K and V of every layer, fp32 (the engine's cache holds the activation dtype)
    assert sp.kv_bytes_per_token == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * \
        head_dim * 4
    assert sp.kv_tokens(sp.weight_bytes + 10 * sp.kv_bytes_per_token) == 10
    assert sp.kv_tokens(sp.weight_bytes // 2) == 0


def test_answering_kv_pool_holds_the_largest_requests_or_what_memory_allows(tiny,
                                                                           tiny_llama_dir):
    """The pool is as large as the 8 largest requests at once, no larger; a memory cap gives a
    smaller pool whose answers are the same tokens (requests wait or are recomputed), and a
    cap below the longest request is a clear error before anything is answered."""
    from quantpipe.reports.answers import _engine_for

    model, tok = tiny
    prompts = [[5] * n for n in (3, 40, 17, 70, 9, 30, 25, 60, 12, 50)]
    budgets = [8] * len(prompts)
    blocks = sorted(-(-(len(p) + 8) // 16) for p in prompts)[::-1]  # block size 16
    engine = _engine_for(model, tok, prompts, budgets)
    assert engine.pool.num_blocks == sum(blocks[:8]) + 1
    per_block = engine.runner.kv_spec.bytes_per_block
    small = _engine_for(model, tok, prompts, budgets, kv_cache_memory=(blocks[0] + 1) * per_block)
    assert small.pool.num_blocks == blocks[0] + 1
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        _engine_for(model, tok, prompts, budgets, kv_cache_memory=(blocks[0] - 1) * per_block)

    full = answer_prompts(tiny_llama_dir, "FP16", RECORDS, 12, json_new_tokens=20)
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4 * 16
    longest = max(-(-(len(p) + (20 if r.expect_json else 12)) // 16)
                  for p, r in zip(render_prompts(tok, RECORDS), RECORDS))
    tight = answer_prompts(tiny_llama_dir, "FP16", RECORDS, 12, json_new_tokens=20,
                           kv_cache_memory=(longest + 1) * per_block)
    assert tight.texts == full.texts and tight.tokens == full.tokens
    batch = tight.speed.by_concurrency[8]
    assert batch["kv_pool_tokens"] == (longest + 1) * 16 < full.speed.by_concurrency[8][
        "kv_pool_tokens"]
    # the loop sends no more than the pool holds at their longest: nothing is recomputed
    assert batch["preemptions"] == 0 and full.speed.by_concurrency[8]["preemptions"] == 0
    assert batch["most_in_flight"] < full.speed.by_concurrency[8]["most_in_flight"] == len(RECORDS)
    assert batch["kv_pool_limited"] and not full.speed.by_concurrency[8]["kv_pool_limited"]


def test_closed_loop_sends_only_what_the_pool_holds_so_nothing_is_recomputed(tiny):
    """In a pool of about two requests at their longest, 8 in flight would make the engine
    preempt (and recompute) requests; the loop keeps to what fits, answers unchanged."""
    from quantpipe.reports.answers import _engine_for
    from quantpipe.runtime.engine import SamplingParams

    model, tok = tiny
    prompts = [[5 + i] * n for i, n in enumerate((40, 33, 47, 38, 45, 36))]
    budgets = [24] * len(prompts)
    need = [-(-(len(p) + 24) // 16) for p in prompts]  # 4-5 blocks each
    per_block = _engine_for(model, tok, prompts, budgets).runner.kv_spec.bytes_per_block
    memory = (max(need) * 2 + 1) * per_block
    engine = _engine_for(model, tok, prompts, budgets, kv_cache_memory=memory)
    toks, stats = closed_loop(engine, prompts, budgets, 8)
    assert stats["preemptions"] == 0 and 1 < stats["most_in_flight"] <= 2
    ref = _engine_for(model, tok, prompts, budgets)
    want, full = closed_loop(ref, prompts, budgets, 8)
    assert toks == want and full["most_in_flight"] == 6
    # the same pool, every request sent at once: the engine preempts (what the loop avoids)
    raw = _engine_for(model, tok, prompts, budgets, kv_cache_memory=memory)
    for p in prompts:
        raw.add_request(p, SamplingParams(max_tokens=24, ignore_eos=True))
    while raw.has_work():
        raw.step()
    assert raw.scheduler.num_preemptions > 0


def test_page_says_when_a_capped_kv_pool_ran_fewer_requests_at_once():
    data = sample_report()
    fp16 = data.model_speed[0]
    loop = dict(fp16.by_concurrency[8], kv_pool_tokens=1_024, preemptions=3,
                kv_pool_limited=True)
    capped = dataclasses.replace(fp16, by_concurrency={**fp16.by_concurrency, 8: loop})
    page = render_quality_report(dataclasses.replace(
        data, model_speed=(capped, *data.model_speed[1:])))
    speed = page[page.index('id="speed"'):page.index('id="thresholds"')]
    assert "KV pool smaller than the largest requests at once" in speed
    assert "FP16: 1,024 tokens, 3 recomputed" in speed
    assert "KV pool smaller" not in render_quality_report(data)


def test_hf_fallback_cuts_each_answer_to_its_budget(tiny):
    model, tok = tiny
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, len(tok), (7,), generator=g).tolist() for _ in range(3)]
    budgets = [3, 11, 6]  # one batch (equal lengths: no padding), run to 11, each cut
    got = _hf_answers(model, tok, prompts, budgets, "tiny")
    want = [_hf_greedy(model, tok, p, b) for p, b in zip(prompts, budgets)]
    assert [n for _, n in got] == [len(w) for w in want]
    assert [t for t, _ in got] == [tok.decode(w, skip_special_tokens=True) for w in want]


def test_fit_context_keeps_the_prompt_end_and_room_to_answer():
    p = list(range(100))
    assert fit_context(p, 20, 256) == (p, 20)  # fits: unchanged
    assert fit_context(p, 200, 256) == (p, 156)  # the budget shrinks to what is left
    # too long for the context: half of it for the answer, the prompt's last tokens kept
    assert fit_context(p, 50, 120) == (p[30:], 50)
    assert fit_context(p, 90, 120) == (p[40:], 60)
    assert fit_context(list(range(300)), 64, 256) == (list(range(108, 300)), 64)


def test_refusals():
    assert is_refusal("I'm sorry, but I can't help with that.")
    assert is_refusal("  **I cannot** share that.")
    assert is_refusal("I\u2019m unable to access the file.")
    assert is_refusal("抱歉，我无法回答。")
    assert not is_refusal("Sure. I'm sorry to hear the parcel was late; here is a refund.")
    assert not is_refusal("")


def test_groups_by_category_then_language():
    data = sample_report()
    good, bad = (c.generation for c in summarize(data).candidates)
    gen = good
    groups = {g.group: g for g in gen.groups}
    cats = [p.category for p in data.prompts]
    assert list(groups) == list(dict.fromkeys(cats)) + ["language: en", "language: zh"]
    ex = groups["extraction"]
    assert ex.prompts == 1 and ex.json_prompts == 1 and ex.json_agreement == 1.0
    # the bad candidate's JSON is cut off: no agreement, and its garbage shows per group
    bad_groups = {g.group: g for g in bad.groups}
    assert bad_groups["extraction"].json_agreement == 0.0
    assert bad_groups["language: zh"].garbage_rate == 1.0
    en, zh = groups["language: en"], groups["language: zh"]
    assert en.prompts + zh.prompts == len(data.prompts)
    # by hand: the mean of the per-prompt ROUGE-L of the group's prompts
    idx = [i for i, p in enumerate(data.prompts) if p.lang == "en"]
    assert en.rouge_l_mean == pytest.approx(np.mean([gen.per_prompt[i].rouge_l for i in idx]))
    # FP16's first answer opens with "I'm sorry": a refusal by the detector's rule, and the
    # good candidate's too
    support = groups["customer_support"]
    assert support.reference_refusals == 1 and support.refusals == 1
    # one language only: no language rows
    one = dataclasses.replace(data, prompts=tuple(dataclasses.replace(p, lang="en")
                                                   for p in data.prompts))
    assert not any(g.group.startswith("language")
                   for g in summarize(one).candidates[0].generation.groups)


def test_page_compares_candidates_and_shows_speed_and_memory():
    data = sample_report()
    page = render_quality_report(data)
    section = page[page.index('id="candidates"'):page.index('id="distribution"')]
    assert "0.419x FP16" not in section and "0.42x FP16" in section  # 112.7 / 269.1 MB
    assert "3.00x FP16" in section  # int4-gptq output tok/s over FP16's at c=8
    assert section.count("<svg") == 1  # size against KLD
    speed = page[page.index('id="speed"'):page.index('id="thresholds"')]
    assert "avx512_vnni" in speed and "TPOT p95 ms" in speed and "KV tokens in budget" in speed
    assert speed.count("3.00x") == 2 and speed.count("3.20x") == 2  # c=1 and c=8 rows
    # (16 GB - 269,060,272 B) / 46,080 B per token
    assert f"{(16 * 10**9 - 269_060_272) // 46_080:,}" in speed
    assert "by category and language" in page
    doc = json.loads(json.dumps(report_json(data, summarize(data))))
    assert [m["name"] for m in doc["model_speed"]] == ["FP16", "int4-gptq-g128", "int4-rtn-pc"]
    assert doc["model_speed"][0]["kv_tokens_in_budget"] == (16 * 10**9 - 269_060_272) // 46_080
    assert doc["reference_bytes"] == 269_060_272


def test_size_quality_chart_marks_every_candidate():
    svg = charts.size_quality_chart({"int4": (0.11, 0.09, 0.08, 0.1),
                                     "int8": (0.15, 0.002, None, None)}, 0.27)
    assert svg.startswith("<svg") and 'aria-label="Weight size against mean KL' in svg


def test_a_gptq_candidate_is_answered_dequantized_and_not_timed(tmp_path_factory):
    """quantpipe's runtime serves its native format; a GPTQ (or compressed-tensors) folder is
    verified and dequantized: its answers are its weights', and no speed is claimed for it."""
    from quantpipe.core.formats.loader import load_dequantized_model
    from quantpipe.core.sources import load_folder_tokenizer
    from quantpipe.stages.export import ExportSpec, export_quantized
    from tests.quantpipe.test_cli_errors import make_folders

    dirs = make_folders(tmp_path_factory.mktemp("answers-gptq"))
    gptq = dirs["calib"].parent / "gptq"
    export_quantized(ExportSpec(dirs["calib"], gptq, bits=4, fmt="gptq"))
    ans = answer_prompts(gptq, "gptq", RECORDS, 5, json_new_tokens=7)
    assert ans.speed is None
    model, tok = load_dequantized_model(gptq), load_folder_tokenizer(gptq)
    want = [_hf_greedy(model, tok, p, 7 if r.expect_json else 5)
            for p, r in zip(render_prompts(tok, RECORDS), RECORDS)]
    assert list(ans.texts) == [tok.decode(w, skip_special_tokens=True) for w in want]
    native = answer_prompts(dirs["int4"], "int4", RECORDS, 5, json_new_tokens=7)
    assert native.speed is not None and native.speed.weight_bytes > 0


def test_answer_precision_when_the_reference_in_fp32_would_not_fit(tiny_llama_dir, monkeypatch):
    """The reference answering with fp32 activations holds its fp16 weights where quantpipe's
    kernels run them (an fp32 copy, twice the bytes, without them) and an fp32 KV pool for 8
    requests. Where that would not fit:
    with the kernels, fp32 activations on the same fp16 weights and a bf16 KV cache (bf16
    activations would hold a copy of the same size); without them (a 7B model on a 24 GB host:
    27 GB in fp32) bf16 activations. The page says which and why."""
    import psutil

    from quantpipe.reports.answers import AnswerPrecision
    from quantpipe.reports.build import answer_precision
    from quantpipe.runtime.kernels import cpu_ext

    shards = sum(f.stat().st_size for f in tiny_llama_dir.glob("*.safetensors"))
    real = psutil.virtual_memory

    def available(n):
        monkeypatch.setattr(psutil, "virtual_memory",
                            lambda: real()._replace(available=n))

    from quantpipe.reports.build import (
        BATCH_CONCURRENCY,
        KV_PROMPT_TOKENS,
        TIGHT_KV_MEMORY,
        TIGHT_STEP_TOKENS,
    )

    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token_bf16 = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2
    # the fp32 KV pool of 8 requests of 512 prompt + 64 new tokens counts beside the weights
    kv32 = BATCH_CONCURRENCY * (KV_PROMPT_TOKENS + 64) * 2 * per_token_bf16
    kernels = cpu_ext.kernel_status()[0]
    available(2 * (shards + kv32))
    assert answer_precision(tiny_llama_dir, 64) == AnswerPrecision(torch.float32, "model")
    available(shards + kv32)  # the weights alone would fit in 60% of it; with the pool not
    assert 0.6 * (shards + kv32) >= shards
    tight = answer_precision(tiny_llama_dir, 64)
    assert tight.step_tokens == TIGHT_STEP_TOKENS and "512 tokens per step" in tight.note
    assert tight.kv_cache_memory == TIGHT_KV_MEMORY and "at most 1 GiB" in tight.note
    if kernels:
        assert (tight.activations, tight.kv_dtype) == (torch.float32, "bf16")
        assert "bf16 KV cache" in tight.note and "its fp16 weights" in tight.note
    with monkeypatch.context() as mp:  # no kernels: an fp32 copy would take twice the shards
        mp.setattr(cpu_ext, "kernel_status", lambda: (False, "test says no"))
        available(3 * shards)
        slow = answer_precision(tiny_llama_dir, 64)
    assert (slow.activations, slow.kv_dtype, slow.step_tokens) == (torch.bfloat16, "model",
                                                                    TIGHT_STEP_TOKENS)
    assert "bf16 activations" in slow.note and "an fp32 copy" in slow.note
    monkeypatch.undo()
    full = answer_prompts(tiny_llama_dir, "FP16", RECORDS[:2], 4)
    for precision in (slow, AnswerPrecision(torch.float32, "bf16")):
        ans = answer_prompts(tiny_llama_dir, "FP16", RECORDS[:2], 4, precision)
        assert len(ans.texts) == 2 and all(0 < n <= 4 for n in ans.tokens)
        if precision.step_tokens:  # prompts read a few tokens per step: the same answers
            steps = []
            with monkeypatch.context() as mp:
                real = answers_module._engine_for
                mp.setattr(answers_module, "_engine_for", lambda *a: steps.append(
                    (e := real(*a)).config.max_num_batched_tokens) or e)
                # and a cap of 2 blocks, under the longest request's: the pool grows to it
                two_blocks = 2 * 16 * ans.speed.kv_bytes_per_token
                short = answer_prompts(tiny_llama_dir, "FP16", RECORDS[:2], 4, AnswerPrecision(
                    slow.activations, slow.kv_dtype, "", 8, two_blocks))
            assert steps == [8] and short.texts == ans.texts and short.tokens == ans.tokens
            pool = short.speed.by_concurrency[BATCH_CONCURRENCY]
            assert pool["kv_pool_limited"] and pool["kv_pool_tokens"] < ans.speed.by_concurrency[
                BATCH_CONCURRENCY]["kv_pool_tokens"]
            with pytest.raises(ValueError, match="raise --kv-cache-memory"):  # a user's cap holds
                answer_prompts(tiny_llama_dir, "FP16", RECORDS[:2], 4, slow,
                               kv_cache_memory=two_blocks)
        assert ans.speed.activation_dtype == str(precision.activations).removeprefix("torch.")
        # K and V of every layer in bf16: half of the fp32 cache's bytes
        assert ans.speed.kv_bytes_per_token == per_token_bf16
        assert ans.speed.kv_dtype == "bfloat16"
    assert full.speed.kv_bytes_per_token == 2 * per_token_bf16
    assert full.speed.kv_dtype == "float32"

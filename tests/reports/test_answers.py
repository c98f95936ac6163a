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


def test_bf16_answers_when_the_reference_in_fp32_would_not_fit(tiny_llama_dir, monkeypatch):
    """The reference answering with fp32 activations holds its fp16 weights where quantpipe's
    kernels run them (an fp32 copy, twice the bytes, without them); where that would not fit
    (a 7B model without the kernels on a 24 GB host: 27 GB) every model answers with bf16
    activations, and the page says why."""
    import psutil

    from quantpipe.reports.build import answer_dtype
    from quantpipe.runtime.kernels import cpu_ext

    copies = 1 if cpu_ext.kernel_status()[0] else 2
    fp32 = copies * sum(f.stat().st_size for f in tiny_llama_dir.glob("*.safetensors"))
    real = psutil.virtual_memory

    def available(n):
        monkeypatch.setattr(psutil, "virtual_memory",
                            lambda: real()._replace(available=n))

    available(2 * fp32)
    assert answer_dtype(tiny_llama_dir) == (torch.float32, "")
    available(fp32)
    dtype, note = answer_dtype(tiny_llama_dir)
    assert dtype == torch.bfloat16 and "bf16 activations" in note
    monkeypatch.undo()
    ans = answer_prompts(tiny_llama_dir, "FP16", RECORDS[:2], 4, torch.bfloat16)
    assert len(ans.texts) == 2 and all(0 < n <= 4 for n in ans.tokens)
    assert ans.speed.activation_dtype == "bfloat16"
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    # K and V of every layer in bf16: half of the fp32 cache's bytes
    assert ans.speed.kv_bytes_per_token == 2 * cfg["num_hidden_layers"] * \
        cfg["num_key_value_heads"] * head_dim * 2

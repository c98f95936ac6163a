"""Prompt loading, chat rendering, calibration packing and the shipped business prompt set."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from quantpipe.prompts.sets import (
    CalibDataSpec,
    PromptRecord,
    build_calibration_set,
    load_prompt_records,
    render_eval_texts,
)
from tests.tiny_models import make_tokenizer

CATEGORIES = {
    "customer_support", "contract_summary", "policy_summary", "finance_review", "hr",
    "product_description", "extraction", "sql", "code", "email", "multi_turn",
}
PROMPTS = [
    "Please summarise the attached contract and list the termination clauses.",
    "The customer reports that the invoice total does not match the purchase order.",
    "请总结以下合同的主要条款，并列出付款条件。",
]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def shipped():
    return load_prompt_records("business-calib"), load_prompt_records("business-eval")


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------
# loading: every format


def test_jsonl_prompts_and_messages(tmp_path):
    rows = [
        {"id": "a", "category": "hr", "lang": "en", "prompt": PROMPTS[0]},
        {"id": "b", "messages": [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "hello"},
                                 {"role": "user", "content": PROMPTS[1]}]},
        {"prompt": PROMPTS[2], "expect_json": True, "json_keys": ["name", "date"]},
    ]
    recs = load_prompt_records(_write_jsonl(tmp_path / "p.jsonl", rows))
    assert [r.id for r in recs] == ["a", "b", "p-2"]
    assert recs[0].prompt == PROMPTS[0] and recs[0].category == "hr" and recs[0].lang == "en"
    assert recs[1].messages == (("user", "hi"), ("assistant", "hello"), ("user", PROMPTS[1]))
    assert recs[1].chat()[-1] == {"role": "user", "content": PROMPTS[1]}
    assert recs[2].expect_json and recs[2].json_keys == ("name", "date")
    assert recs[2].source.endswith("p.jsonl:line 3")


def test_csv_tsv_column_choice(tmp_path):
    csv = tmp_path / "p.csv"
    csv.write_text('id,question\n1,"first, with comma"\n2,second\n', encoding="utf-8")
    assert [r.prompt for r in load_prompt_records(csv, column="question")] == [
        "first, with comma", "second"]
    with pytest.raises(ValueError, match=r"no 'prompt' or 'messages' column.*\['id', 'question'\]"):
        load_prompt_records(csv)
    with pytest.raises(ValueError, match=r"column 'text' not found.*\['id', 'question'\]"):
        load_prompt_records(csv, column="text")
    tsv = tmp_path / "p.tsv"
    tsv.write_text("prompt\tlang\nalpha, beta\ten\ngamma\tzh\n", encoding="utf-8")
    recs = load_prompt_records(tsv)
    assert [(r.prompt, r.lang) for r in recs] == [("alpha, beta", "en"), ("gamma", "zh")]


def test_txt_blank_line_blocks(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text(f"{PROMPTS[0]}\nsecond line of block one\n\n{PROMPTS[1]}\n\n\n\n{PROMPTS[2]}\n",
                   encoding="utf-8")
    recs = load_prompt_records(txt)
    assert [r.prompt for r in recs] == [f"{PROMPTS[0]}\nsecond line of block one", PROMPTS[1],
                                        PROMPTS[2]]
    with pytest.raises(ValueError, match="a .txt file has no columns"):
        load_prompt_records(txt, column="text")


def test_parquet_and_save_to_disk(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"prompt": PROMPTS, "category": ["a", "b", "c"]})
    ds.to_parquet(str(tmp_path / "p.parquet"))
    assert [r.prompt for r in load_prompt_records(tmp_path / "p.parquet")] == PROMPTS
    ds.save_to_disk(str(tmp_path / "saved"))
    recs = load_prompt_records(tmp_path / "saved")
    assert [r.category for r in recs] == ["a", "b", "c"]
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"splits \['train', 'test'\]"):
        load_prompt_records(tmp_path / "dd")


# ---------------------------------------------------------------------------------------
# loading: errors


def test_load_errors(tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="e.jsonl: file is empty"):
        load_prompt_records(empty)
    with pytest.raises(ValueError, match="unknown extension '.docx'"):
        (tmp_path / "a.docx").write_text("x")
        load_prompt_records(tmp_path / "a.docx")
    with pytest.raises(ValueError, match="no such file"):
        load_prompt_records(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": "broken\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.jsonl: cannot be read as json: line 2 is not valid"):
        load_prompt_records(bad)
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.jsonl: cannot be read: line 1 is not UTF-8"):
        load_prompt_records(latin1)
    neither = _write_jsonl(tmp_path / "n.jsonl", [{"prompt": "fine"}, {"text": "wrong key"}])
    with pytest.raises(ValueError, match=r"n.jsonl:line 2: record has neither .*expected"):
        load_prompt_records(neither)
    keys = _write_jsonl(tmp_path / "k.jsonl", [{"prompt": "x", "json_keys": "name"}])
    with pytest.raises(ValueError, match=r"k.jsonl:line 1: json_keys must be a list"):
        load_prompt_records(keys)
    role = _write_jsonl(tmp_path / "r.jsonl", [{"messages": [{"role": "bot", "content": "x"}]}])
    with pytest.raises(ValueError, match=r"r.jsonl:line 1: message role 'bot'"):
        load_prompt_records(role)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read files without permission")
def test_unreadable_file(tmp_path):
    p = _write_jsonl(tmp_path / "locked.jsonl", [{"prompt": "x"}])
    p.chmod(0)
    try:
        with pytest.raises(ValueError, match="not readable"):
            load_prompt_records(p)
    finally:
        p.chmod(0o644)


def test_record_and_spec_validation():
    with pytest.raises(ValueError, match="exactly one of prompt / messages"):
        PromptRecord(id="x", source="s")
    with pytest.raises(ValueError, match="prompt is empty"):
        PromptRecord(id="x", source="s", prompt="   ")
    with pytest.raises(ValueError, match="mode must be"):
        CalibDataSpec(mode="chunk")
    with pytest.raises(ValueError, match="n_samples must be >= 1"):
        CalibDataSpec(n_samples=0)
    with pytest.raises(ValueError, match="min_tokens must be >= 1"):
        CalibDataSpec(min_tokens=0)


# ---------------------------------------------------------------------------------------
# calibration set


def _records(texts: list[str]) -> list[PromptRecord]:
    return [PromptRecord(id=str(i), source=f"t:{i}", prompt=t) for i, t in enumerate(texts)]


def _many_texts(n: int) -> list[str]:
    return [f"{PROMPTS[i % 3]} Order {i} total {i * 37} units." for i in range(n)]


def test_chat_template_rendering(tok):
    recs = _records([PROMPTS[0]]) + [PromptRecord(
        id="m", source="m", messages=(("user", "hi"), ("assistant", "hello")))]
    texts = render_eval_texts(tok, recs)
    # a prompt ends with the assistant header (the model answers next) ...
    assert texts[0] == f"<|im_start|>user\n{PROMPTS[0]}<|im_end|>\n<|im_start|>assistant\n"
    # ... a chat that ends with the assistant's turn does not
    assert texts[1] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    # the calibration tokens are exactly the tokens of the rendered text (no extra BOS)
    cs = build_calibration_set(tok, recs[:1], CalibDataSpec(min_tokens=1, mode="truncate"))
    want = tok(texts[0], add_special_tokens=False)["input_ids"]
    assert cs.input_ids[0].tolist() == want


def test_pack_fills_exact_shapes(tok):
    spec = CalibDataSpec(n_samples=6, seq_len=32, min_tokens=4, seed=1)
    cs = build_calibration_set(tok, _records(_many_texts(40)), spec)
    assert cs.input_ids.dtype == torch.int64 and tuple(cs.input_ids.shape) == (6, 32)
    assert cs.summary.n_sequences == 6 and cs.summary.tokens_used == 6 * 32
    # samples are separated by EOS in the packed stream
    assert (cs.input_ids == tok.eos_token_id).any()


def test_truncate_mode_shapes(tok):
    spec = CalibDataSpec(n_samples=5, seq_len=20, min_tokens=4, mode="truncate")
    cs = build_calibration_set(tok, _records(_many_texts(12)), spec)
    assert isinstance(cs.input_ids, list) and len(cs.input_ids) == 5
    assert all(t.dtype == torch.int64 and t.dim() == 1 and 4 <= t.numel() <= 20
               for t in cs.input_ids)


def test_seed_determinism(tok):
    recs = _records(_many_texts(30))
    a = build_calibration_set(tok, recs, CalibDataSpec(n_samples=4, seq_len=24, seed=3))
    b = build_calibration_set(tok, recs, CalibDataSpec(n_samples=4, seq_len=24, seed=3))
    c = build_calibration_set(tok, recs, CalibDataSpec(n_samples=4, seq_len=24, seed=4))
    assert torch.equal(a.input_ids, b.input_ids)
    assert not torch.equal(a.input_ids, c.input_ids)


def test_dedupe_and_min_tokens(tok):
    texts = _many_texts(6) + _many_texts(6)[:2] + ["hi", "ok"]
    # the chat template wraps "hi" in role tokens: measure its rendered length first
    n_short = len(tok(render_eval_texts(tok, _records(["hi"]))[0],
                      add_special_tokens=False)["input_ids"])
    spec = CalibDataSpec(n_samples=8, seq_len=256, min_tokens=n_short + 2, mode="truncate")
    cs = build_calibration_set(tok, _records(texts), spec)
    s = cs.summary
    assert (s.records_read, s.kept, s.duplicates, s.dropped_short) == (10, 6, 2, 2)
    assert len({tuple(t.tolist()) for t in cs.input_ids}) == 6
    assert s.len_p5 <= s.len_p50 <= s.len_p95 <= s.len_max
    assert s.total_tokens >= 6 * spec.min_tokens


def test_too_few_tokens_warns_then_errors(tok, caplog):
    recs = _records(_many_texts(4))
    with caplog.at_level(logging.INFO, logger="quantpipe.prompts.sets"):
        cs = build_calibration_set(tok, recs, CalibDataSpec(n_samples=50, seq_len=16))
    assert 0 < cs.input_ids.shape[0] < 50
    assert "ran short" in caplog.text and "of 50 requested" in caplog.text
    assert "records read" in caplog.text  # the summary is logged at INFO
    with pytest.raises(ValueError, match="not enough for one 100000-token window"):
        build_calibration_set(tok, recs, CalibDataSpec(seq_len=100_000))
    with pytest.raises(ValueError, match="all 2 records were dropped"):
        build_calibration_set(tok, _records(["hi", "ok"]), CalibDataSpec(min_tokens=50))


# ---------------------------------------------------------------------------------------
# the shipped business set


def test_shipped_set_coverage(shipped):
    calib, evals = shipped
    allr = calib + evals
    assert len(allr) >= 320
    assert {r.category for r in calib} == CATEGORIES == {r.category for r in evals}
    langs = [r.lang for r in allr]
    assert set(langs) == {"en", "zh"} and langs.count("zh") >= 0.25 * len(allr)
    assert 0.2 <= len(evals) / len(allr) <= 0.3
    # every (category, language) stratum is represented in both parts
    assert {(r.category, r.lang) for r in calib} == {(r.category, r.lang) for r in evals}
    assert sum(r.messages is not None for r in allr) >= 20
    ext = [r for r in allr if r.expect_json]
    assert ext and all(r.category == "extraction" and len(r.json_keys) >= 3 for r in ext)
    assert len({r.id for r in allr}) == len(allr)


def test_shipped_parts_disjoint(shipped):
    calib, evals = shipped

    def text(r: PromptRecord) -> str:
        return r.prompt if r.prompt is not None else "\n".join(c for _, c in r.messages)

    assert not {text(r) for r in calib} & {text(r) for r in evals}
    assert not {r.id for r in calib} & {r.id for r in evals}


def test_shipped_set_packs_with_tiny_tokenizer(tok, shipped):
    cs = build_calibration_set(tok, shipped[0], CalibDataSpec(n_samples=16, seq_len=128))
    assert tuple(cs.input_ids.shape) == (16, 128)
    assert cs.summary.records_read == len(shipped[0])


def test_generator_reproduces_shipped_files(shipped):
    import importlib.util

    root = Path(__file__).resolve().parents[3]
    spec = importlib.util.spec_from_file_location("make_prompts", root / "tools" /
                                                  "make_prompts.py")
    make_prompts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_prompts)
    calib, evals = make_prompts.split(make_prompts.generate())
    data = make_prompts.HERE
    assert data == root / "quantpipe" / "prompts" / "data"
    for name, recs in (("business_calib.jsonl", calib), ("business_eval.jsonl", evals)):
        want = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs)
        assert (data / name).read_text(encoding="utf-8") == want, f"regenerate {name}"


@pytest.mark.slow
def test_shipped_long_prompts_with_smollm2(shipped, smollm2_fp16_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_fp16_dir)
    allr = shipped[0] + shipped[1]
    lengths = [len(tok(t, add_special_tokens=False)["input_ids"])
               for t in render_eval_texts(tok, allr)]
    assert sum(n >= 600 for n in lengths) >= 30  # a few dozen full documents
    assert sum(n >= 1000 for n in lengths) >= 10
    assert max(lengths) <= 1600
    assert min(lengths) >= 16  # chat template makes even one-liners calibration-usable
    cs = build_calibration_set(tok, shipped[0], CalibDataSpec())  # default 128 x 512
    assert tuple(cs.input_ids.shape) == (128, 512)

import os
import statistics

import numpy as np
import pytest

from quantpipe.reports import textmetrics as tm


def test_metric_modules_load_from_the_package_offline():
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # set by tests/conftest.py
    rouge = tm.load_metric("rouge")
    assert type(rouge).__name__ == "Rouge"
    assert type(tm.load_metric("exact_match")).__name__ == "ExactMatch"
    with pytest.raises(ValueError, match="no shipped metric"):
        tm.load_metric("bleu")


def test_rouge_l_by_hand():
    # LCS("the cat sat on the mat", "the cat lay on the mat") = the cat on the mat = 5 words;
    # P = R = 5/6 -> F1 = 5/6.
    # "a b c d" vs "a x c": LCS = a c = 2; P = 2/3, R = 2/4 -> F1 = 2PR/(P+R) = 4/7.
    got = tm.rouge_l(["the cat lay on the mat", "a x c", "same text"],
                     ["the cat sat on the mat", "a b c d", "Same text!"])
    assert got == pytest.approx([5 / 6, 4 / 7, 1.0], abs=1e-12)


def test_rouge_l_chinese_is_scored_per_character():
    # 6 characters each, LCS = 今天天气好 minus one = 今天天气 + 好 = 5 -> F1 = 5/6.
    assert tm.rouge_l(["今天天气很好"], ["今天天气不好"]) == pytest.approx([5 / 6])
    # rouge_score's own tokenizer drops every non-latin character: Chinese scores 0.
    assert tm.rouge_l(["今天天气很好"], ["今天天气不好"], tokenizer="rouge_score") == [0.0]
    # mixed text: latin words stay words, CJK splits per character
    assert tm.words("GPU 显存 8GB") == ["gpu", "显", "存", "8gb"]


def test_rouge_l_rejects_bad_input():
    with pytest.raises(ValueError, match="predictions for"):
        tm.rouge_l(["a"], ["a", "b"])
    with pytest.raises(ValueError, match="tokenizer"):
        tm.rouge_l(["a"], ["a"], tokenizer="spaces")


def test_exact_match():
    assert tm.exact_match([" yes\n", "Yes", "no"], ["yes", "yes", "no"]) == [True, False, True]


def test_word_diff_escapes_and_marks_changes():
    left, right = tm.word_diff_html("say <b>hi</b> now", 'say <i onclick="x">hi</i> now')
    assert "<b>" not in left and "<i " not in right
    assert "&lt;b&gt;" in left.replace("<del>", "").replace("</del>", "")
    assert "&quot;x&quot;" in right
    assert "<del>" in left and "<ins>" in right
    same_l, same_r = tm.word_diff_html("a & b", "a & b")
    assert same_l == same_r == "a &amp; b"


@pytest.mark.parametrize("text,expected", [
    ('```json\n{"a": 1}\n```', {"a": 1}),
    ('Here you go: {"a": {"b": "}"}} thanks', {"a": {"b": "}"}}),
    ("list: [1, 2, 3] end", [1, 2, 3]),
    ('{broken {"ok": true}', {"ok": True}),
    ("```\n[\"x\"]\n```", ["x"]),
])
def test_extract_json(text, expected):
    assert tm.extract_json(text) == (True, expected)


def test_extract_json_none():
    assert tm.extract_json("no json here {not: valid") == (False, None)


def test_json_check_agreement():
    ref = '```json\n{"label": "Billing", "n": 2, "meta": {"lang": "en"}}\n```'
    c = tm.json_check(ref, '{"label": "billing ", "n": 2.0, "meta": {"lang": "en"}}',
                      ("label", "n", "meta.lang"))
    assert c.reference_parses and c.candidate_parses and c.key_agrees == (True, True, True)
    assert c.agrees
    c = tm.json_check(ref, '{"label": "technical", "n": 2}', ("label", "n", "meta.lang"))
    assert c.key_agrees == (False, True, False) and not c.agrees
    c = tm.json_check(ref, '{"label": "billing"', ("label",))
    assert not c.candidate_parses and not c.agrees
    c = tm.json_check("no json", '{"label": "x"}', ("label",))
    assert not c.reference_parses and not c.agrees


def test_length_stats_match_numpy():
    texts = ["one two three", "", "a b c d e f g", "一二三", "x"]
    s = tm.length_stats(texts)
    lengths = [3, 0, 7, 3, 1]
    assert s.lengths == tuple(lengths) and s.unit == "words"
    assert s.mean == pytest.approx(np.mean(lengths))
    assert s.median == statistics.median(lengths)
    assert s.p90 == pytest.approx(np.percentile(lengths, 90))
    assert (s.min, s.max, s.empty) == (0, 7, 1)
    t = tm.length_stats(["a", "b"], token_counts=[4, 6])
    assert t.unit == "tokens" and t.mean == 5
    with pytest.raises(ValueError, match="token counts"):
        tm.length_stats(["a"], token_counts=[1, 2])


def test_garbage_detector():
    normal = ("Thank you for reaching out. We have issued a refund to your card; it should "
              "appear within five business days. Let us know if anything else comes up.")
    g = tm.garbage_score(normal)
    assert not g.is_garbage and g.repeated_ngram_rate < 0.05
    loop = "I am sorry. " * 10
    g = tm.garbage_score(loop)
    # 30 words, 28 trigrams, 3 distinct -> 1 - 3/28
    assert g.repeated_ngram_rate == pytest.approx(1 - 3 / 28)
    assert g.is_garbage and "repeated 3-gram" in g.reasons[0]
    g = tm.garbage_score("ok\x00\x01\x02\ufffd fine text here")
    assert g.non_printable_ratio == pytest.approx(4 / 21) and g.is_garbage  # 21 characters
    g = tm.garbage_score("wow" + "!" * 30)
    assert g.longest_char_run == 30 and g.is_garbage
    g = tm.garbage_score("no no no no no no no no")
    assert g.longest_word_run == 8 and g.is_garbage
    assert tm.garbage_score(" \n").reasons == ("empty output",)
    assert not tm.garbage_score("", tm.GarbageThresholds(flag_empty=False)).is_garbage
    # short answers and indentation are never garbage
    assert not tm.garbage_score("Yes.").is_garbage
    assert not tm.garbage_score("def f():\n" + " " * 40 + "return 1").is_garbage


def test_garbage_thresholds_validate():
    with pytest.raises(ValueError, match="max_repeated_ngram_rate"):
        tm.GarbageThresholds(max_repeated_ngram_rate=0)
    with pytest.raises(ValueError, match="max_char_run"):
        tm.GarbageThresholds(max_char_run=1)

"""Generation regression metrics: a candidate's greedy outputs against FP16's.

Pure functions over strings. ROUGE-L and exact match come from the ``evaluate`` metric modules
shipped in ``reports/metrics/`` (loaded from the local folder: no Hub access). Everything else
(word diff, JSON checks, length statistics, garbage detection) is plain Python.
"""

from __future__ import annotations

import difflib
import functools
import html
import json
import re
import statistics
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METRICS_DIR = Path(__file__).resolve().parent / "metrics"

# Same word rule as the shipped rouge module's "unicode" tokenizer: CJK one token per character.
_CJK = "[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af]"
WORD = re.compile(f"{_CJK}|[^\\W_]+")
# Diff tokens keep punctuation and whitespace so the rendered text reads like the original.
DIFF_TOKEN = re.compile(f"{_CJK}|[^\\W_]+|\\s+|[^\\w\\s]|_")


@functools.lru_cache(maxsize=None)
def load_metric(name: str):
    """Load a shipped metric module (``rouge`` or ``exact_match``) from its local folder."""
    import evaluate

    folder = METRICS_DIR / name
    if not (folder / f"{name}.py").is_file():
        raise ValueError(f"no shipped metric {name!r} in {METRICS_DIR}; reinstall quantpipe")
    return evaluate.load(str(folder), keep_in_memory=True)


def rouge_l(predictions: list[str], references: list[str],
            tokenizer: str = "unicode") -> list[float]:
    """Per-example ROUGE-L F1 of each prediction against its reference (0..1). Texts equal
    after stripping surrounding whitespace score 1.0, two empty answers included (the metric
    itself gives those 0: no tokens to match)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    if not predictions:
        return []
    out = load_metric("rouge").compute(predictions=predictions, references=references,
                                       rouge_types=["rougeL"], tokenizer=tokenizer,
                                       use_aggregator=False)
    return [1.0 if p.strip() == r.strip() else float(v)
            for p, r, v in zip(predictions, references, out["rougeL"])]


def exact_match(predictions: list[str], references: list[str]) -> list[bool]:
    """Per-example exact match after stripping surrounding whitespace."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    if not predictions:
        return []
    out = load_metric("exact_match").compute(predictions=predictions, references=references,
                                             use_aggregator=False)
    return [bool(v) for v in out["exact_match"]]


# ---------------------------------------------------------------------------- word diff


def word_diff_html(reference: str, candidate: str) -> tuple[str, str]:
    """Word-level diff rendered as two escaped HTML fragments (reference side, candidate side).

    Tokens only in the reference are wrapped in ``<del>``, tokens only in the candidate in
    ``<ins>``; every token goes through :func:`html.escape`, so model text can never become
    markup.
    """
    a = DIFF_TOKEN.findall(reference)
    b = DIFF_TOKEN.findall(candidate)
    # autojunk off: with it, tokens frequent in long outputs (spaces, "the") would be ignored.
    sm = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    left: list[str] = []
    right: list[str] = []
    for op, i1, i2, j1, j2 in sm.get_opcodes():
        ref_part = html.escape("".join(a[i1:i2]))
        cand_part = html.escape("".join(b[j1:j2]))
        if op == "equal":
            left.append(ref_part)
            right.append(cand_part)
            continue
        if ref_part:
            left.append(f"<del>{ref_part}</del>")
        if cand_part:
            right.append(f"<ins>{cand_part}</ins>")
    return "".join(left), "".join(right)


# ---------------------------------------------------------------------------- JSON checks

_FENCE = re.compile(r"```(?:json|JSON)?[ \t]*\n?(.*?)```", re.DOTALL)


def extract_json(text: str) -> tuple[bool, Any]:
    """The first JSON object or array in ``text`` -> (found, value).

    Fenced blocks (```json ... ```) are tried first, then the first ``{``/``[`` from which a
    complete JSON value decodes (so prose before or after the JSON is allowed).
    """
    decoder = json.JSONDecoder()
    for block in _FENCE.findall(text):
        found, value = _first_json_value(block, decoder)
        if found:
            return True, value
    return _first_json_value(text, decoder)


def _first_json_value(text: str, decoder: json.JSONDecoder) -> tuple[bool, Any]:
    for m in re.finditer(r"[\[{]", text):
        try:
            value, _ = decoder.raw_decode(text, m.start())
        except json.JSONDecodeError:
            continue
        return True, value
    return False, None


def _lookup(value: Any, key: str) -> tuple[bool, Any]:
    """``a.b`` -> value["a"]["b"] (dots walk nested objects)."""
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _same_value(a: Any, b: Any) -> bool:
    # Strings: case and surrounding whitespace do not change the meaning of a field value.
    if isinstance(a, str) and isinstance(b, str):
        return a.strip().casefold() == b.strip().casefold()
    return a == b


@dataclass(frozen=True)
class JsonCheck:
    """JSON validity of one expect_json prompt, and field agreement with FP16."""

    reference_parses: bool
    candidate_parses: bool
    keys: tuple[str, ...]
    reference_values: tuple[Any, ...]  # None where the key is missing
    candidate_values: tuple[Any, ...]
    key_agrees: tuple[bool, ...]  # candidate value equals FP16's (both present)

    @property
    def agrees(self) -> bool:
        """Candidate parses and every json_key agrees with FP16 (FP16 must parse too)."""
        return self.reference_parses and self.candidate_parses and all(self.key_agrees)


def json_check(reference: str, candidate: str, keys: tuple[str, ...]) -> JsonCheck:
    ref_ok, ref_val = extract_json(reference)
    cand_ok, cand_val = extract_json(candidate)
    ref_vals, cand_vals, agree = [], [], []
    for k in keys:
        r_has, r = _lookup(ref_val, k) if ref_ok else (False, None)
        c_has, c = _lookup(cand_val, k) if cand_ok else (False, None)
        ref_vals.append(r)
        cand_vals.append(c)
        agree.append(r_has and c_has and _same_value(r, c))
    return JsonCheck(ref_ok, cand_ok, tuple(keys), tuple(ref_vals), tuple(cand_vals),
                     tuple(agree))


# ---------------------------------------------------------------------------- lengths


def words(text: str) -> list[str]:
    """Words as ROUGE sees them: Unicode letter/digit runs, CJK one per character."""
    return WORD.findall(text.lower())


@dataclass(frozen=True)
class LengthStats:
    unit: str  # "words" or "tokens"
    lengths: tuple[int, ...]
    mean: float
    median: float
    p90: float
    min: int
    max: int
    empty: int  # outputs of length 0


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    if not sorted_values:
        return float("nan")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def length_stats(texts: list[str], token_counts: list[int] | None = None) -> LengthStats:
    """Answer lengths in words, or in tokens when the caller gives ``token_counts``."""
    if token_counts is not None and len(token_counts) != len(texts):
        raise ValueError(f"{len(token_counts)} token counts for {len(texts)} texts")
    lengths = list(token_counts) if token_counts is not None else [len(words(t)) for t in texts]
    unit = "tokens" if token_counts is not None else "words"
    if not lengths:
        nan = float("nan")
        return LengthStats(unit, (), nan, nan, nan, 0, 0, 0)
    s = sorted(lengths)
    return LengthStats(unit, tuple(lengths), statistics.fmean(s), statistics.median(s),
                       _percentile(s, 90), s[0], s[-1], sum(1 for x in s if x == 0))


# ---------------------------------------------------------------------------- garbage


@dataclass(frozen=True)
class GarbageThresholds:
    """When an output counts as garbage (degenerate loops, broken bytes, endless runs)."""

    ngram: int = 3  # n of the repeated-n-gram rate
    min_ngrams: int = 8  # shorter outputs are never flagged by the n-gram rate (too noisy)
    max_repeated_ngram_rate: float = 0.5  # > half of all word n-grams are repeats
    max_non_printable_ratio: float = 0.02  # control / private-use / U+FFFD characters
    max_char_run: int = 24  # same character repeated (e.g. "!!!!!!...")
    max_word_run: int = 6  # same word repeated back to back
    flag_empty: bool = True  # an empty / whitespace-only answer counts as garbage

    def __post_init__(self) -> None:
        if self.ngram < 1 or self.min_ngrams < 1:
            raise ValueError("ngram and min_ngrams must be >= 1")
        if not 0.0 < self.max_repeated_ngram_rate <= 1.0:
            raise ValueError("max_repeated_ngram_rate must lie in (0, 1]")
        if not 0.0 <= self.max_non_printable_ratio <= 1.0:
            raise ValueError("max_non_printable_ratio must lie in [0, 1]")
        if self.max_char_run < 2 or self.max_word_run < 2:
            raise ValueError("max_char_run and max_word_run must be >= 2")


@dataclass(frozen=True)
class GarbageScore:
    repeated_ngram_rate: float  # 1 - unique/total word n-grams (0 when too short)
    non_printable_ratio: float
    longest_char_run: int
    longest_word_run: int
    is_garbage: bool
    reasons: tuple[str, ...]


def _non_printable(ch: str) -> bool:
    if ch in "\n\t\r":
        return False
    # Cc control, Cs surrogate, Co private use, Cn unassigned; U+FFFD = undecodable bytes.
    return ch == "\ufffd" or unicodedata.category(ch) in ("Cc", "Cs", "Co", "Cn")


def _longest_run(items: list) -> int:
    best = run = 0
    prev = object()
    for x in items:
        run = run + 1 if x == prev else 1
        prev = x
        best = max(best, run)
    return best


def garbage_score(text: str, th: GarbageThresholds = GarbageThresholds()) -> GarbageScore:
    ws = words(text)
    grams = [tuple(ws[i:i + th.ngram]) for i in range(len(ws) - th.ngram + 1)]
    rep = 1.0 - len(set(grams)) / len(grams) if len(grams) >= th.min_ngrams else 0.0
    nonp = sum(map(_non_printable, text)) / len(text) if text else 0.0
    # whitespace runs (indentation, blank lines) are formatting, not garbage
    char_run = _longest_run([c if not c.isspace() else object() for c in text])
    word_run = _longest_run(ws)
    reasons = []
    if th.flag_empty and not text.strip():
        reasons.append("empty output")
    if rep > th.max_repeated_ngram_rate:
        reasons.append(f"repeated {th.ngram}-gram rate {rep:.2f} > {th.max_repeated_ngram_rate}")
    if nonp > th.max_non_printable_ratio:
        reasons.append(f"non-printable ratio {nonp:.3f} > {th.max_non_printable_ratio}")
    if char_run > th.max_char_run:
        reasons.append(f"a character repeated {char_run} times > {th.max_char_run}")
    if word_run > th.max_word_run:
        reasons.append(f"a word repeated {word_run} times in a row > {th.max_word_run}")
    return GarbageScore(rep, nonp, char_run, word_run, bool(reasons), tuple(reasons))



# ---------------------------------------------------------------------------- refusals

# How instruct models decline, English and Chinese, matched at the start of an answer (after
# whitespace and markdown emphasis): a refusal in the middle of a long answer is quoted text
# more often than a refusal. Lower case; Chinese as written.
REFUSAL_OPENINGS = (
    "i'm sorry", "i am sorry", "sorry, i", "i apologize", "i apologise", "i can't", "i cannot",
    "i can not", "i won't", "i will not", "i'm not able", "i am not able", "i'm unable",
    "i am unable", "as an ai", "as a language model", "unfortunately, i",
    "抱歉", "对不起", "很抱歉", "我无法", "我不能", "作为一个ai", "作为ai", "作为一个人工智能",
)


def is_refusal(text: str) -> bool:
    """Whether the answer opens by declining the task (``REFUSAL_OPENINGS``)."""
    head = text.lstrip().lstrip("*_#> ").lower().replace("\u2019", "'")
    return head.startswith(REFUSAL_OPENINGS)

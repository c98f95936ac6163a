"""ROUGE (F1) as an ``evaluate`` metric module shipped inside quantpipe.

Loaded with ``evaluate.load("<quantpipe>/reports/metrics/rouge")``: a local folder whose script
has the folder's name, so ``evaluate`` never contacts the Hugging Face Hub (works with
``HF_HUB_OFFLINE=1``). The scoring itself is Google's ``rouge_score`` package.

Why a tokenizer option: ``rouge_score``'s default tokenizer lowercases, then replaces every
character outside ``[a-z0-9]`` with a space, so Chinese (or any non-latin) text becomes an
empty token list and scores 0 against anything. ``tokenizer="unicode"`` (the default here)
keeps every Unicode letter/digit run as a word and splits CJK ideographs, kana and hangul
into one token per character (Chinese has no spaces; a character is the usual ROUGE unit for
it, as in the CLUE / LCSTS benchmarks). ``tokenizer="rouge_score"`` is the original behaviour.
"""

from __future__ import annotations

import re

import datasets
import evaluate
from rouge_score import rouge_scorer, tokenizers

_CITATION = """\
@inproceedings{lin-2004-rouge,
    title = "{ROUGE}: A Package for Automatic Evaluation of Summaries",
    author = "Lin, Chin-Yew",
    booktitle = "Text Summarization Branches Out",
    year = "2004",
    publisher = "Association for Computational Linguistics",
    pages = "74--81",
}
"""

_DESCRIPTION = """\
ROUGE-N / ROUGE-L F1 between each prediction and its reference, computed with rouge_score.
Per-example scores are returned (use_aggregator=False) or their plain mean (True); no
bootstrap resampling, so the result is deterministic.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of strings (candidate outputs).
    references: list of strings (reference outputs), same length.
    rouge_types: list of "rouge1", "rouge2", "rougeL" (default: all three).
    tokenizer: "unicode" (default; CJK one token per character, other scripts by word) or
        "rouge_score" (the package default: latin letters and digits only).
    use_stemmer: Porter-stem English words (default False).
    use_aggregator: True -> mean over examples; False -> list of per-example F1.
Returns:
    dict rouge_type -> float (mean) or list[float] (per example), each in [0, 1].
Examples:
    >>> rouge = evaluate.load("reports/metrics/rouge")
    >>> rouge.compute(predictions=["a b c"], references=["a c"], rouge_types=["rougeL"])
    {'rougeL': 0.8}
"""

# One token per CJK ideograph / kana / hangul syllable; otherwise runs of letters and digits.
CJK_CHAR = (
    "[\u3040-\u30ff"  # hiragana, katakana
    "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"  # CJK ideographs (ext. A, unified, compat.)
    "\uac00-\ud7af]"  # hangul syllables
)
UNICODE_TOKEN = re.compile(f"{CJK_CHAR}|[^\\W_]+")
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


class UnicodeTokenizer(tokenizers.Tokenizer):
    """rouge_score tokenizer: lowercased Unicode words, CJK split per character."""

    def tokenize(self, text: str) -> list[str]:
        return UNICODE_TOKEN.findall(text.lower())


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Rouge(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
            codebase_urls=["https://github.com/google-research/google-research/tree/master/rouge"],
            reference_urls=["https://aclanthology.org/W04-1013/"],
        )

    def _compute(
        self,
        predictions: list[str],
        references: list[str],
        rouge_types: list[str] | None = None,
        tokenizer: str = "unicode",
        use_stemmer: bool = False,
        use_aggregator: bool = True,
    ) -> dict:
        rouge_types = list(rouge_types or ROUGE_TYPES)
        bad = [t for t in rouge_types if t not in ROUGE_TYPES]
        if bad:
            raise ValueError(f"rouge_types {bad} are not supported; use some of {ROUGE_TYPES}")
        if tokenizer == "unicode":
            tok = UnicodeTokenizer()
        elif tokenizer == "rouge_score":
            tok = None  # rouge_score's DefaultTokenizer (latin only)
        else:
            raise ValueError(f"tokenizer={tokenizer!r} is unknown; use 'unicode' or 'rouge_score'")
        scorer = rouge_scorer.RougeScorer(rouge_types, use_stemmer=use_stemmer, tokenizer=tok)
        per_type: dict[str, list[float]] = {t: [] for t in rouge_types}
        for pred, ref in zip(predictions, references):
            # score(target, prediction): the reference is the target.
            scores = scorer.score(ref, pred)
            for t in rouge_types:
                per_type[t].append(float(scores[t].fmeasure))
        if use_aggregator:
            n = len(predictions)
            return {t: (sum(v) / n if n else float("nan")) for t, v in per_type.items()}
        return per_type

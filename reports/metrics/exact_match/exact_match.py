"""Exact match as an ``evaluate`` metric module shipped inside quantpipe.

Loaded with ``evaluate.load("<quantpipe>/reports/metrics/exact_match")`` (a local folder, so the
Hugging Face Hub is never contacted). A prediction matches when it equals its reference after
the optional normalisations: surrounding whitespace stripped, inner whitespace runs collapsed
(``normalize_whitespace``), and case folded (``ignore_case``). Greedy FP16 vs quantized outputs
are compared, so the defaults only strip surrounding whitespace.
"""

from __future__ import annotations

import re

import datasets
import evaluate

_DESCRIPTION = "Exact string match between each prediction and its reference (0 or 1)."

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of strings.
    references: list of strings, same length.
    normalize_whitespace: collapse runs of whitespace to one space (default False).
    ignore_case: compare casefolded strings (default False).
    use_aggregator: True -> {"exact_match": mean}; False -> {"exact_match": [0/1 per example]}.
Examples:
    >>> em = evaluate.load("reports/metrics/exact_match")
    >>> em.compute(predictions=["a ", "b"], references=["a", "c"])
    {'exact_match': 0.5}
"""

_WS = re.compile(r"\s+")


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class ExactMatch(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(
        self,
        predictions: list[str],
        references: list[str],
        normalize_whitespace: bool = False,
        ignore_case: bool = False,
        use_aggregator: bool = True,
    ) -> dict:
        def norm(s: str) -> str:
            s = s.strip()
            if normalize_whitespace:
                s = _WS.sub(" ", s)
            if ignore_case:
                s = s.casefold()
            return s

        matches = [int(norm(p) == norm(r)) for p, r in zip(predictions, references)]
        if use_aggregator:
            return {"exact_match": sum(matches) / len(matches) if matches else float("nan")}
        return {"exact_match": matches}

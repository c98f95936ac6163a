"""Every number of a report, computed once from :class:`reports.data.ReportData`.

The HTML page and the JSON file beside it are both rendered from the :class:`ReportSummary`
returned by :func:`summarize`, so the two can never disagree.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass

from quantpipe.reports.data import CandidateData, Constraint, DistributionMetrics, ReportData
from quantpipe.reports.intervals import Interval, bootstrap_mean, paired_difference, wilson
from quantpipe.reports.textmetrics import (
    GarbageScore,
    GarbageThresholds,
    JsonCheck,
    LengthStats,
    exact_match,
    extract_json,
    garbage_score,
    is_refusal,
    json_check,
    length_stats,
    rouge_l,
)
from quantpipe.reports.verdict import QualityNumbers, Verdict, judge

# 2: verdict status "inconclusive", reasons' interval / could_be, advice, recommendation,
# constraint, weight_bytes, the metrics' intervals; 3: model_speed, memory_budget,
# generation groups (by category and language), refusals, machine isa / memory_bytes
REPORT_JSON_VERSION = 3


@dataclass(frozen=True)
class PromptResult:
    """One held-out prompt: the candidate's output against FP16's."""

    prompt_id: str
    rouge_l: float
    exact_match: bool
    json: JsonCheck | None  # only for expect_json prompts
    garbage: GarbageScore
    refusal: bool = False  # the candidate declined (textmetrics.is_refusal)


@dataclass(frozen=True)
class GroupStats:
    """One category or language of the held-out prompts: the candidate against FP16."""

    group: str  # "email", or "language: zh"
    prompts: int
    rouge_l_mean: float
    exact_match_rate: float
    json_prompts: int  # expect_json prompts where FP16's output parsed
    json_agreement: float | None
    garbage_rate: float
    reference_garbage_rate: float | None
    length_ratio: float | None  # candidate's mean answer length / FP16's (None: FP16's is 0)
    refusals: int
    reference_refusals: int


@dataclass(frozen=True)
class GenerationSummary:
    rouge_l_mean: float
    rouge_l_median: float
    exact_match_rate: float
    json_prompts: int  # expect_json prompts where FP16's output parsed
    json_parse_rate: float | None  # candidate outputs that parse, over all expect_json prompts
    json_agreement: float | None  # parse + keys agree, over json_prompts
    garbage_rate: float  # outputs flagged by the garbage detector
    lengths: LengthStats
    per_prompt: tuple[PromptResult, ...]
    json_expected: int = 0  # expect_json prompts (FP16's output parsed or not)
    # 95% intervals by prompt (reports.intervals): rouge_l_mean, json_agreement
    intervals: dict[str, Interval] = dataclasses.field(default_factory=dict)
    groups: tuple[GroupStats, ...] = ()  # by category, then by language (when known)


@dataclass(frozen=True)
class ReferenceSummary:
    """FP16's own outputs: the baseline for lengths, JSON validity and garbage."""

    lengths: LengthStats | None
    garbage: tuple[GarbageScore, ...]
    garbage_rate: float | None
    json_parse_rate: float | None
    refusals: tuple[bool, ...] = ()  # FP16 declined, per prompt


@dataclass(frozen=True)
class CandidateSummary:
    name: str
    path: str
    distribution: DistributionMetrics | None
    generation: GenerationSummary | None
    verdict: Verdict


@dataclass(frozen=True)
class ReportSummary:
    reference: ReferenceSummary
    candidates: tuple[CandidateSummary, ...]
    recommendation: str = ""  # which candidate ships under the constraint, or why none does


def _rate(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def summarize_reference(data: ReportData, gth: GarbageThresholds) -> ReferenceSummary:
    outs = data.reference_outputs
    if outs is None:
        return ReferenceSummary(None, (), None, None)
    garbage = tuple(garbage_score(t, gth) for t in outs)
    parses = [extract_json(t)[0] for p, t in zip(data.prompts, outs) if p.expect_json]
    return ReferenceSummary(length_stats(list(outs)), garbage,
                            _rate([g.is_garbage for g in garbage]), _rate(parses),
                            tuple(map(is_refusal, outs)))


def group_stats(data: ReportData, ref: ReferenceSummary, results: list[PromptResult],
                lengths: tuple[int, ...]) -> tuple[GroupStats, ...]:
    """The candidate's per-prompt results summed by category, then by language (the latter
    only when the prompts carry more than one)."""
    members: dict[str, list[int]] = {}
    for i, p in enumerate(data.prompts):
        members.setdefault(p.category, []).append(i)
    if len({p.lang for p in data.prompts}) > 1:
        for i, p in enumerate(data.prompts):
            members.setdefault(f"language: {p.lang or 'unknown'}", []).append(i)
    ref_len = ref.lengths.lengths if ref.lengths else ()
    out = []
    for group, idx in members.items():
        rs = [results[i] for i in idx]
        comparable = [r.json for r in rs if r.json is not None and r.json.reference_parses]
        ref_mean = statistics.fmean(ref_len[i] for i in idx) if ref_len else 0.0
        ref_garbage = [ref.garbage[i].is_garbage for i in idx] if ref.garbage else []
        out.append(GroupStats(
            group=group, prompts=len(idx),
            rouge_l_mean=statistics.fmean(r.rouge_l for r in rs),
            exact_match_rate=_rate([r.exact_match for r in rs]),
            json_prompts=len(comparable),
            json_agreement=_rate([c.agrees for c in comparable]),
            garbage_rate=_rate([r.garbage.is_garbage for r in rs]),
            reference_garbage_rate=_rate(ref_garbage),
            length_ratio=(statistics.fmean(lengths[i] for i in idx) / ref_mean
                          if ref_mean > 0 else None),
            refusals=sum(r.refusal for r in rs),
            reference_refusals=sum(ref.refusals[i] for i in idx) if ref.refusals else 0))
    return tuple(out)


def summarize_generations(data: ReportData, cand: CandidateData, gth: GarbageThresholds,
                          reference: ReferenceSummary) -> GenerationSummary | None:
    if cand.outputs is None or data.reference_outputs is None or not data.prompts:
        return None
    refs = list(data.reference_outputs)
    outs = list(cand.outputs)
    rl = rouge_l(outs, refs)
    em = exact_match(outs, refs)
    results = []
    for p, ref, out, r, e in zip(data.prompts, refs, outs, rl, em):
        jc = json_check(ref, out, p.json_keys) if p.expect_json else None
        results.append(PromptResult(p.id, r, e, jc, garbage_score(out, gth), is_refusal(out)))
    checks = [x.json for x in results if x.json is not None]
    comparable = [c for c in checks if c.reference_parses]
    intervals = {"rouge_l_mean": bootstrap_mean(rl, "prompt"),
                 "json_agreement": wilson(sum(c.agrees for c in comparable), len(comparable),
                                          "prompt")}
    lengths = length_stats(outs)
    return GenerationSummary(
        rouge_l_mean=statistics.fmean(rl),
        rouge_l_median=statistics.median(rl),
        exact_match_rate=sum(em) / len(em),
        json_prompts=len(comparable),
        json_parse_rate=_rate([c.candidate_parses for c in checks]),
        json_agreement=_rate([c.agrees for c in comparable]),
        garbage_rate=sum(x.garbage.is_garbage for x in results) / len(results),
        lengths=lengths,
        per_prompt=tuple(results),
        json_expected=len(checks),
        intervals={k: v for k, v in intervals.items() if v is not None},
        groups=group_stats(data, reference, results, lengths.lengths),
    )


def quality_intervals(ref: ReferenceSummary, d: DistributionMetrics | None,
                      gen: GenerationSummary | None) -> dict[str, Interval]:
    """The verdict rules' 95% intervals (rule name -> interval) of one candidate: by window
    for the distribution metrics, by prompt for the generation ones (the garbage rate above
    FP16's pairs each prompt's two answers)."""
    out: dict[str, Interval] = {}
    if d is not None:
        for rule, key in (("kld_mean", "kld_mean"), ("same_top", "same_top_rate"),
                          ("ppl_ratio", "ppl_ratio")):
            if key in d.intervals:
                out[rule] = Interval(*d.intervals[key], d.windows, "window")
    if gen is not None:
        for rule, key in (("rouge_l", "rouge_l_mean"), ("json_agreement", "json_agreement")):
            if key in gen.intervals:
                out[rule] = gen.intervals[key]
        if len(ref.garbage) == len(gen.per_prompt):
            excess = paired_difference([x.garbage.is_garbage for x in gen.per_prompt],
                                       [g.is_garbage for g in ref.garbage], "prompt")
            if excess is not None:
                out["garbage_excess"] = excess
    return out


def summarize(data: ReportData, gth: GarbageThresholds = GarbageThresholds()) -> ReportSummary:
    ref = summarize_reference(data, gth)
    cands = []
    for c in data.candidates:
        gen = summarize_generations(data, c, gth, ref)
        d = c.distribution
        numbers = QualityNumbers(
            kld_mean=d.kld["mean"] if d else None,
            same_top_rate=d.same_top_rate if d else None,
            ppl_ratio=d.ppl_ratio if d else None,
            rouge_l_mean=gen.rouge_l_mean if gen else None,
            json_agreement=gen.json_agreement if gen else None,
            json_prompts=gen.json_prompts if gen else 0,
            garbage_rate=gen.garbage_rate if gen else None,
            reference_garbage_rate=ref.garbage_rate,
            json_expected=gen.json_expected if gen else 0,
            intervals=quality_intervals(ref, d, gen),
            tokens_per_window=d.tokens / d.windows if d and d.windows else None,
        )
        cands.append(CandidateSummary(c.name, c.path, d, gen, judge(numbers, data.thresholds)))
    return ReportSummary(ref, tuple(cands), recommend(data, cands))


def _size(n: int | None) -> str:
    return "size not known" if n is None else f"{n / 1e6:,.1f} MB"


def _blocker(data_c: CandidateData, c: CandidateSummary, limit: Constraint) -> str | None:
    """Why candidate ``c`` cannot be recommended under ``limit`` (None: it can)."""
    if c.verdict.status != "pass":
        return f"verdict {c.verdict.status}"
    if limit.max_kld is not None:
        if c.distribution is None:
            return "KLD not measured"
        iv = c.distribution.intervals.get("kld_mean")
        kld = iv[1] if iv else c.distribution.kld["mean"]
        if kld > limit.max_kld:
            what = "KLD 95% upper end" if iv else "KLD"
            return f"{what} {kld:.4f} > {limit.max_kld:g}"
    if limit.max_bytes is not None:
        if data_c.weight_bytes is None:
            return "size not known"
        if data_c.weight_bytes > limit.max_bytes:
            return f"{_size(data_c.weight_bytes)} > {_size(limit.max_bytes)}"
    return None


def recommend(data: ReportData, cands: list[CandidateSummary]) -> str:
    """The smallest candidate whose verdict passes and that meets ``data.constraint``, or why
    none does (each candidate's first obstacle)."""
    limit = data.constraint
    blockers = [(dc, c, _blocker(dc, c, limit)) for dc, c in zip(data.candidates, cands)]
    ok = [(dc, c) for dc, c, why in blockers if why is None]
    terms = ["its verdict passes"]
    if limit.max_kld is not None:
        terms.append(f"mean KLD <= {limit.max_kld:g} (95% upper end where known)")
    if limit.max_bytes is not None:
        terms.append(f"weights <= {_size(limit.max_bytes)}")
    rule = ", ".join(terms)
    if ok:
        dc, c = min(ok, key=lambda x: (x[0].weight_bytes is None, x[0].weight_bytes or 0))
        return (f"Recommended: {c.name} ({_size(dc.weight_bytes)}), the smallest of "
                f"{len(ok)} candidate{'s' if len(ok) > 1 else ''} where {rule}.")
    why = "; ".join(f"{c.name}: {w}" for _, c, w in blockers)
    return f"No candidate can be recommended (needed: {rule}). {why}."


def _jsonable(obj):
    """Dataclasses -> dicts, tuples -> lists, NaN/inf -> None (strict JSON has no NaN)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def report_json(data: ReportData, summary: ReportSummary) -> dict:
    """The JSON document written beside the HTML (schema in docs/reports.md)."""
    return {
        "format": "quantpipe-report",
        "version": REPORT_JSON_VERSION,
        "title": data.title,
        "created": data.created,
        "reference": data.reference,
        "reference_bytes": data.reference_bytes,
        "thresholds": data.thresholds.to_dict(),
        "constraint": _jsonable(data.constraint),
        "recommendation": summary.recommendation,
        "prompts": [
            {"id": p.id, "category": p.category, "lang": p.lang,
             "expect_json": p.expect_json, "json_keys": list(p.json_keys)}
            for p in data.prompts
        ],
        "reference_summary": _jsonable(summary.reference),
        "candidates": [
            {
                "name": c.name,
                "path": c.path,
                "weight_bytes": cd.weight_bytes,
                "verdict": c.verdict.to_dict(),
                "distribution": _jsonable(c.distribution),
                "generation": _jsonable(c.generation),
                "calibration": _jsonable(cd.calibration),
            }
            for c, cd in zip(summary.candidates, data.candidates)
        ],
        "outputs": {
            "reference": list(data.reference_outputs or []),
            **{c.name: list(c.outputs) for c in data.candidates if c.outputs is not None},
        },
        "speed": [
            {"name": r.name, "metric": r.metric, "value": r.value, "unit": r.unit, **r.extra}
            for r in data.speed
        ],
        "model_speed": [
            _jsonable(m) | ({"kv_tokens_in_budget": m.kv_tokens(data.memory_budget)}
                            if data.memory_budget else {})
            for m in data.model_speed
        ],
        "memory_budget": data.memory_budget,
        "machine": _jsonable(data.machine),
    }

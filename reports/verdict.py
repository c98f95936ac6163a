"""Pass / warn / fail per candidate from documented, configurable thresholds.

Each rule compares one number with a warn level and a fail level (see docs/reports.md). A
rule whose number was not measured is reported as "not measured" and does not affect the
verdict; a rule whose levels are ``None`` is switched off.

Where the number has a 95% interval (``reports.intervals``), the rule decides only when the
whole interval lies on one side of each level: an interval that straddles a level is
**inconclusive**, with the number of units (evaluation windows or prompts) that would decide it
at the same spread. A number without an interval is judged on its value alone, as before.
Verdict = the worst level reached; "inconclusive" where an undecided rule could still reach a
worse level than every decided one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from quantpipe.reports.intervals import Interval

LEVELS = ("pass", "warn", "fail")
_RANK = {level: i for i, level in enumerate(LEVELS)}


@dataclass(frozen=True)
class Rule:
    """One verdict rule: the number it reads, its default levels, and which way is worse."""

    name: str  # "kld_mean"; thresholds are given as ``<name>_warn`` / ``<name>_fail``
    label: str
    higher_is_worse: bool
    warn: float | None
    fail: float | None
    fmt: str = ".3f"


# Defaults suit 4-bit small models.
RULES = (
    # mean KL(P_fp16 || P_cand) per token, nats
    Rule("kld_mean", "mean KLD (nats)", True, 0.10, 0.50, ".4f"),
    # fraction of tokens whose argmax equals FP16's
    Rule("same_top", "same-top-token rate", False, 0.90, 0.80),
    # perplexity ratio candidate / FP16
    Rule("ppl_ratio", "perplexity ratio", True, 1.10, 1.50, ".4f"),
    # mean ROUGE-L F1 of greedy outputs vs FP16's (greedy outputs diverge after one different
    # token, so even good 4-bit models rarely exceed ~0.7 here)
    Rule("rouge_l", "mean ROUGE-L vs FP16", False, 0.50, 0.25),
    # fraction of expect_json prompts (where FP16 gave valid JSON) whose candidate output parses
    # and whose json_keys agree with FP16's
    Rule("json_agreement", "JSON agreement", False, 0.90, 0.70),
    # garbage rate of the candidate minus FP16's garbage rate
    Rule("garbage_excess", "garbage rate above FP16's", True, 0.05, 0.20),
)


class VerdictThresholds:
    """Warn / fail levels per rule, ``RULES``' defaults unless given as keywords
    (``VerdictThresholds(kld_mean_warn=0.05)``). ``None`` switches a level off."""

    def __init__(self, **levels: float | None) -> None:
        known = {f"{r.name}_{k}" for r in RULES for k in ("warn", "fail")}
        unknown = sorted(set(levels) - known)
        if unknown:
            raise TypeError(f"unknown threshold(s) {unknown}; known: {sorted(known)}")
        self._levels = {r.name: (levels.get(f"{r.name}_warn", r.warn),
                                 levels.get(f"{r.name}_fail", r.fail)) for r in RULES}
        for rule in RULES:
            _check_levels(rule, *self._levels[rule.name])

    def levels(self, rule: str) -> tuple[float | None, float | None]:
        """(warn, fail) of ``rule``."""
        return self._levels[rule]

    def to_dict(self) -> dict:
        return {f"{name}_{k}": v for name, pair in self._levels.items()
                for k, v in zip(("warn", "fail"), pair)}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VerdictThresholds) and self._levels == other._levels

    def __repr__(self) -> str:
        return f"VerdictThresholds({self.to_dict()})"


def _check_levels(rule: Rule, warn: float | None, fail: float | None) -> None:
    name = rule.name
    for v in (warn, fail):
        if v is not None and not math.isfinite(v):
            raise ValueError(f"{name} threshold {v} is not finite; give a number or None")
    if warn is None or fail is None:
        return
    if rule.higher_is_worse and warn > fail:
        raise ValueError(f"{name}_warn={warn} > {name}_fail={fail}; higher is worse, "
                         "so the warn level must not exceed the fail level")
    if not rule.higher_is_worse and warn < fail:
        raise ValueError(f"{name}_warn={warn} < {name}_fail={fail}; lower is worse, "
                         "so the warn level must not be below the fail level")


@dataclass(frozen=True)
class QualityNumbers:
    """The numbers a verdict looks at; ``None`` = not measured."""

    kld_mean: float | None = None
    same_top_rate: float | None = None
    ppl_ratio: float | None = None
    rouge_l_mean: float | None = None
    json_agreement: float | None = None
    json_prompts: int = 0  # expect_json prompts where FP16 produced valid JSON
    garbage_rate: float | None = None
    reference_garbage_rate: float | None = None
    json_expected: int = 0  # expect_json prompts scored (FP16's output parsed or not)
    # rule name (RULES) -> its 95% interval; a rule without one is judged on its value
    intervals: dict[str, Interval] = field(default_factory=dict)
    tokens_per_window: float | None = None  # to say how many tokens more windows are


@dataclass(frozen=True)
class Reason:
    level: str  # "pass" | "warn" | "fail" | "inconclusive" | "info"
    rule: str  # e.g. "kld_mean"
    value: float | None
    message: str
    interval: tuple[float, float] | None = None
    # inconclusive: the best and worst level the interval reaches; otherwise both = level
    could_be: tuple[str, str] | None = None


@dataclass(frozen=True)
class Verdict:
    status: str  # "pass" | "warn" | "fail" | "inconclusive"
    reasons: tuple[Reason, ...]
    advice: tuple[str, ...] = ()  # what to do next (a ship decision, or how to reach one)

    def to_dict(self) -> dict:
        return {"status": self.status, "reasons": [asdict(r) for r in self.reasons],
                "advice": list(self.advice)}


def _level(rule: Rule, value: float, warn: float | None, fail: float | None) -> str:
    def worse(limit: float | None) -> bool:
        if limit is None:
            return False
        return value > limit if rule.higher_is_worse else value < limit

    return "fail" if worse(fail) else "warn" if worse(warn) else "pass"


def _rule(rule: Rule, value: float | None, th: VerdictThresholds, label: str,
          interval: Interval | None = None, tokens_per_window: float | None = None) -> Reason:
    warn, fail = th.levels(rule.name)
    fmt = rule.fmt
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return Reason("info", rule.name, None, f"{label}: not measured")
    if warn is None and fail is None:
        return Reason("info", rule.name, value, f"{label} {value:{fmt}} (rule off)")
    if interval is not None:
        return _rule_with_interval(rule, value, warn, fail, label, interval, tokens_per_window)
    level = _level(rule, value, warn, fail)
    return Reason(level, rule.name, value,
                  f"{label} {value:{fmt}} {_against(rule, level, warn, fail)}")


def _against(rule: Rule, level: str, warn: float | None, fail: float | None) -> str:
    """The comparison that puts a value at ``level``: "> fail level 0.50", "<= 0.10"."""
    fmt = rule.fmt
    if level == "pass":
        limit = warn if warn is not None else fail
        return f"{'<=' if rule.higher_is_worse else '>='} {limit:{fmt}}"
    limit = fail if level == "fail" else warn
    return f"{'>' if rule.higher_is_worse else '<'} {level} level {limit:{fmt}}"


def _rule_with_interval(rule: Rule, value: float, warn: float | None, fail: float | None,
                        label: str, iv: Interval, tokens_per_window: float | None) -> Reason:
    fmt = rule.fmt
    best, worst = (iv.low, iv.high) if rule.higher_is_worse else (iv.high, iv.low)
    could_be = (_level(rule, best, warn, fail), _level(rule, worst, warn, fail))
    shown = f"{label} {value:{fmt}} (95% {iv.label(fmt)}, {iv.n} {iv.unit}s)"
    bounds = (iv.low, iv.high)
    if could_be[0] == could_be[1]:
        level = could_be[0]
        text = f"{shown}: all {_against(rule, level, warn, fail)}"
        return Reason(level, rule.name, value, text, bounds, could_be)
    straddled = [t for t in (warn, fail) if t is not None and iv.low <= t <= iv.high]
    t = min(straddled, key=lambda x: abs(x - value))
    more = iv.more_units(value, t)
    if more is None:
        need = f"the estimate sits on the level {t:{fmt}}"
    else:
        need = f"about {more:,} more {iv.unit}{'' if more == 1 else 's'}"
        if iv.unit == "window" and tokens_per_window:
            need += f" (~{more * tokens_per_window:,.0f} scored tokens)"
        need += " would decide it"
    text = (f"{shown}: inconclusive, {could_be[0]} or {could_be[1]} (the interval holds the "
            f"level {t:{fmt}}); {need}")
    return Reason("inconclusive", rule.name, value, text, bounds, could_be)


_ADVICE_QUALITY = ("keep more precision where it matters: `quantpipe sensitivity CALIB_DIR`, "
                   "then `quantpipe export CALIB_DIR --budget-bits 4.5` (mixed precision), or "
                   "`--bits 8` for every layer")
_ADVICE_MORE = ("measure more before deciding: more held-out tokens (`quantpipe run "
                "--eval-tokens 0` or `quantpipe report --eval-max-tokens 0`: every token) and "
                "more prompts (`quantpipe report --max-prompts 0` answers every prompt of the "
                "set, `--prompts FILE` a larger set of your own); the inconclusive rules say how "
                "many")


def judge(n: QualityNumbers, th: VerdictThresholds | None = None) -> Verdict:
    """The verdict of one candidate; the reasons at its status first, then fail, warn,
    inconclusive, pass, info."""
    th = th or VerdictThresholds()
    excess = None
    if n.garbage_rate is not None:
        excess = n.garbage_rate - (n.reference_garbage_rate or 0.0)
    values = {
        "kld_mean": n.kld_mean,
        "same_top": n.same_top_rate,
        "ppl_ratio": n.ppl_ratio,
        "rouge_l": n.rouge_l_mean,
        "json_agreement": n.json_agreement if n.json_prompts > 0 else None,
        "garbage_excess": excess,
    }
    # the interval names its prompt count; a bare number needs it in the label
    labels = {} if "json_agreement" in n.intervals else {
        "json_agreement": f"JSON agreement ({n.json_prompts} prompts)"}
    reasons = [_rule(r, values[r.name], th, labels.get(r.name, r.label),
                     n.intervals.get(r.name), n.tokens_per_window) for r in RULES]
    if n.json_prompts == 0 and n.json_expected > 0:
        i = next(k for k, r in enumerate(reasons) if r.rule == "json_agreement")
        reasons[i] = Reason("info", "json_agreement", None,
                            f"JSON agreement: not measured (FP16's own answer was not valid "
                            f"JSON on any of the {n.json_expected} JSON prompts)")
    decided = [r.level for r in reasons if r.level in _RANK]
    undecided = [r.could_be[1] for r in reasons if r.level == "inconclusive"]
    if not decided and not undecided:
        # nothing measured: never call that a pass
        reasons.insert(0, Reason("warn", "nothing_measured", None,
                                 "no quality number was measured for this candidate"))
        return Verdict("warn", tuple(reasons), (_ADVICE_MORE,))
    floor = max(decided, key=_RANK.__getitem__, default="pass")
    if undecided and max(_RANK[u] for u in undecided) > _RANK[floor]:
        status = "inconclusive"
    else:
        status = floor
    # the reasons that decided the status first, then the undecided ones, then the rest
    order = {"fail": 0, "warn": 2, "inconclusive": 3, "pass": 4, "info": 5, status: -1}
    reasons.sort(key=lambda r: order[r.level])
    advice = []
    if status in ("warn", "fail") or (status == "inconclusive" and floor != "pass"):
        advice.append(_ADVICE_QUALITY)
    if status == "inconclusive":
        advice.append(_ADVICE_MORE)
    return Verdict(status, tuple(reasons), tuple(advice))

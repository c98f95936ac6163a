"""Pass / warn / fail per candidate from documented, configurable thresholds.

Each rule compares one number with a warn level and a fail level (see docs/reports.md). A
rule whose number was not measured is reported as "not measured" and does not affect the
verdict; a rule whose levels are ``None`` is switched off. Verdict = the worst level reached.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

LEVELS = ("pass", "warn", "fail")


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


@dataclass(frozen=True)
class Reason:
    level: str  # "pass" | "warn" | "fail" | "info"
    rule: str  # e.g. "kld_mean"
    value: float | None
    message: str


@dataclass(frozen=True)
class Verdict:
    status: str  # "pass" | "warn" | "fail"
    reasons: tuple[Reason, ...]

    def to_dict(self) -> dict:
        return {"status": self.status, "reasons": [asdict(r) for r in self.reasons]}


def _rule(rule: Rule, value: float | None, th: VerdictThresholds, label: str) -> Reason:
    warn, fail = th.levels(rule.name)
    fmt = rule.fmt
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return Reason("info", rule.name, None, f"{label}: not measured")
    if warn is None and fail is None:
        return Reason("info", rule.name, value, f"{label} {value:{fmt}} (rule off)")

    def worse(limit: float | None) -> bool:
        if limit is None:
            return False
        return value > limit if rule.higher_is_worse else value < limit

    op = ">" if rule.higher_is_worse else "<"
    ok_op = "<=" if rule.higher_is_worse else ">="
    if worse(fail):
        return Reason("fail", rule.name, value,
                      f"{label} {value:{fmt}} {op} fail level {fail:{fmt}}")
    if worse(warn):
        return Reason("warn", rule.name, value,
                      f"{label} {value:{fmt}} {op} warn level {warn:{fmt}}")
    limit = warn if warn is not None else fail
    return Reason("pass", rule.name, value, f"{label} {value:{fmt}} {ok_op} {limit:{fmt}}")


def judge(n: QualityNumbers, th: VerdictThresholds | None = None) -> Verdict:
    """The verdict of one candidate; reasons ordered fail, warn, pass, info."""
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
    labels = {"json_agreement": f"JSON agreement ({n.json_prompts} prompts)"}
    reasons = [_rule(r, values[r.name], th, labels.get(r.name, r.label)) for r in RULES]
    order = {"fail": 0, "warn": 1, "pass": 2, "info": 3}
    reasons.sort(key=lambda r: order[r.level])
    levels = {r.level for r in reasons}
    status = "fail" if "fail" in levels else "warn" if "warn" in levels else "pass"
    if levels <= {"info"}:
        # nothing measured: never call that a pass
        status = "warn"
        reasons.insert(0, Reason("warn", "nothing_measured", None,
                                 "no quality number was measured for this candidate"))
    return Verdict(status, tuple(reasons))

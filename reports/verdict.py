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
class VerdictThresholds:
    """Warn / fail levels. ``None`` switches a rule off. Defaults suit 4-bit small models."""

    # mean KL(P_fp16 || P_cand) per token, nats: higher is worse
    kld_mean_warn: float | None = 0.10
    kld_mean_fail: float | None = 0.50
    # fraction of tokens whose argmax equals FP16's: lower is worse
    same_top_warn: float | None = 0.90
    same_top_fail: float | None = 0.80
    # perplexity ratio candidate / FP16: higher is worse
    ppl_ratio_warn: float | None = 1.10
    ppl_ratio_fail: float | None = 1.50
    # mean ROUGE-L F1 of greedy outputs vs FP16's: lower is worse (greedy outputs diverge
    # after one different token, so even good 4-bit models rarely exceed ~0.7 here)
    rouge_l_warn: float | None = 0.50
    rouge_l_fail: float | None = 0.25
    # fraction of expect_json prompts (where FP16 gave valid JSON) whose candidate output parses
    # and whose json_keys agree with FP16's: lower is worse
    json_agreement_warn: float | None = 0.90
    json_agreement_fail: float | None = 0.70
    # garbage rate of the candidate minus FP16's garbage rate: higher is worse
    garbage_excess_warn: float | None = 0.05
    garbage_excess_fail: float | None = 0.20

    def __post_init__(self) -> None:
        pairs = {
            "kld_mean": (self.kld_mean_warn, self.kld_mean_fail, "higher"),
            "same_top": (self.same_top_warn, self.same_top_fail, "lower"),
            "ppl_ratio": (self.ppl_ratio_warn, self.ppl_ratio_fail, "higher"),
            "rouge_l": (self.rouge_l_warn, self.rouge_l_fail, "lower"),
            "json_agreement": (self.json_agreement_warn, self.json_agreement_fail, "lower"),
            "garbage_excess": (self.garbage_excess_warn, self.garbage_excess_fail, "higher"),
        }
        for name, (warn, fail, worse) in pairs.items():
            for v in (warn, fail):
                if v is not None and not math.isfinite(v):
                    raise ValueError(f"{name} threshold {v} is not finite; give a number or None")
            if warn is None or fail is None:
                continue
            if worse == "higher" and warn > fail:
                raise ValueError(f"{name}_warn={warn} > {name}_fail={fail}; higher is worse, "
                                 "so the warn level must not exceed the fail level")
            if worse == "lower" and warn < fail:
                raise ValueError(f"{name}_warn={warn} < {name}_fail={fail}; lower is worse, "
                                 "so the warn level must not be below the fail level")

    def to_dict(self) -> dict:
        return asdict(self)


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


def _rule(rule: str, label: str, value: float | None, warn: float | None, fail: float | None,
          higher_is_worse: bool, fmt: str) -> Reason:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return Reason("info", rule, None, f"{label}: not measured")
    if warn is None and fail is None:
        return Reason("info", rule, value, f"{label} {value:{fmt}} (rule off)")

    def worse(limit: float | None) -> bool:
        if limit is None:
            return False
        return value > limit if higher_is_worse else value < limit

    op = ">" if higher_is_worse else "<"
    ok_op = "<=" if higher_is_worse else ">="
    if worse(fail):
        return Reason("fail", rule, value, f"{label} {value:{fmt}} {op} fail level {fail:{fmt}}")
    if worse(warn):
        return Reason("warn", rule, value, f"{label} {value:{fmt}} {op} warn level {warn:{fmt}}")
    limit = warn if warn is not None else fail
    return Reason("pass", rule, value, f"{label} {value:{fmt}} {ok_op} {limit:{fmt}}")


def judge(n: QualityNumbers, th: VerdictThresholds = VerdictThresholds()) -> Verdict:
    """The verdict of one candidate; reasons ordered fail, warn, pass, info."""
    excess = None
    if n.garbage_rate is not None:
        excess = n.garbage_rate - (n.reference_garbage_rate or 0.0)
    json_value = n.json_agreement if n.json_prompts > 0 else None
    reasons = [
        _rule("kld_mean", "mean KLD (nats)", n.kld_mean, th.kld_mean_warn, th.kld_mean_fail,
              True, ".4f"),
        _rule("same_top", "same-top-token rate", n.same_top_rate, th.same_top_warn,
              th.same_top_fail, False, ".3f"),
        _rule("ppl_ratio", "perplexity ratio", n.ppl_ratio, th.ppl_ratio_warn,
              th.ppl_ratio_fail, True, ".4f"),
        _rule("rouge_l", "mean ROUGE-L vs FP16", n.rouge_l_mean, th.rouge_l_warn,
              th.rouge_l_fail, False, ".3f"),
        _rule("json_agreement", f"JSON agreement ({n.json_prompts} prompts)", json_value,
              th.json_agreement_warn, th.json_agreement_fail, False, ".3f"),
        _rule("garbage_excess", "garbage rate above FP16's", excess, th.garbage_excess_warn,
              th.garbage_excess_fail, True, ".3f"),
    ]
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

"""95% intervals (reports.intervals) and the verdict that reads them."""

import math

import numpy as np
import pytest
import torch

from quantpipe.reports.eval import _Accumulator, summarize
from quantpipe.reports.intervals import Interval, bootstrap_mean, bootstrap_ratio, wilson
from quantpipe.reports.verdict import QualityNumbers, judge

Z = 1.959963984540054


def test_bootstrap_covers_the_mean_at_about_the_stated_rate():
    """Over 300 samples of 30 draws from a known distribution, the 95% interval of the mean
    holds the true mean in 88-99% of them (percentile bootstrap is a little narrow at n = 30)."""
    rng = np.random.default_rng(123)
    hits = 0
    for _ in range(300):
        x = rng.exponential(0.1, size=30)  # skewed, like per-window KLDs; true mean 0.1
        iv = bootstrap_mean(x, "window")
        assert iv.low <= x.mean() <= iv.high and iv.n == 30
        hits += iv.low <= 0.1 <= iv.high
    assert 0.88 <= hits / 300 <= 0.99, hits


def test_bootstrap_width_shrinks_as_one_over_sqrt_n():
    rng = np.random.default_rng(7)
    x = rng.normal(1.0, 0.5, size=1600)
    wide, narrow = bootstrap_mean(x[:100], "prompt"), bootstrap_mean(x, "prompt")
    ratio = (narrow.high - narrow.low) / (wide.high - wide.low)
    assert ratio == pytest.approx(0.25, abs=0.06)  # sqrt(100 / 1600)


def test_ratio_of_sums_weights_units_by_their_denominator():
    # two windows: 10 tokens with KLD sum 1.0, 30 tokens with KLD sum 0.3 -> point 1.3 / 40
    iv = bootstrap_ratio([1.0, 0.3], [10, 30], "window")
    assert iv.low == pytest.approx(0.01) and iv.high == pytest.approx(0.1)  # all-one-window
    assert iv.contains(1.3 / 40)
    assert bootstrap_ratio([1.0], [10], "window") is None  # one unit: no interval
    ppl = bootstrap_ratio([0.5, 0.1], [10, 10], "window", transform=np.exp)
    assert ppl.low == pytest.approx(math.exp(0.01)) and ppl.high == pytest.approx(math.exp(0.05))


def test_wilson_by_hand():
    one = wilson(1, 1, "prompt")  # 1 of 1: low = 1 / (1 + z^2)
    assert one.low == pytest.approx(1 / (1 + Z * Z), abs=1e-12) and one.high == 1.0
    none = wilson(0, 10, "prompt")  # 0 of 10: high = z^2 / (n + z^2)
    assert none.low == 0.0 and none.high == pytest.approx(Z * Z / (10 + Z * Z), abs=1e-12)
    half = wilson(40, 80, "prompt")
    assert (half.low + half.high) / 2 == pytest.approx(0.5) and half.high - half.low < 0.23
    assert wilson(0, 0, "prompt") is None


def test_more_units_to_decide():
    iv = Interval(0.05, 0.15, 16, "window")
    # half-width 0.05 must shrink to the gap 0.02: n * (0.05 / 0.02)^2 = 100 windows, 84 more
    assert iv.more_units(0.10, 0.12) == 84
    assert iv.more_units(0.10, 0.10) is None


GOOD = dict(kld_mean=0.03, same_top_rate=0.95, ppl_ratio=1.02, rouge_l_mean=0.8,
            garbage_rate=0.0, reference_garbage_rate=0.0)


def test_an_interval_inside_one_level_decides_the_rule():
    n = QualityNumbers(**GOOD, intervals={"kld_mean": Interval(0.02, 0.05, 16, "window")})
    v = judge(n)
    assert v.status == "pass" and not v.advice
    kld = next(r for r in v.reasons if r.rule == "kld_mean")
    assert kld.level == "pass" and kld.interval == (0.02, 0.05) and "16 windows" in kld.message


def test_an_interval_across_a_level_is_inconclusive_with_the_data_that_would_decide_it():
    iv = Interval(0.06, 0.14, 16, "window")
    v = judge(QualityNumbers(**dict(GOOD, kld_mean=0.09), intervals={"kld_mean": iv},
                             tokens_per_window=511.0))
    kld = next(r for r in v.reasons if r.rule == "kld_mean")
    assert kld.level == "inconclusive" and kld.could_be == ("pass", "warn")
    more = iv.more_units(0.09, 0.10)
    assert f"about {more:,} more windows (~{more * 511:,.0f} scored tokens)" in kld.message
    assert v.status == "inconclusive" and v.reasons[0] is kld
    assert any("--eval-tokens 0" in a for a in v.advice)
    assert any("--budget-bits" in a for a in v.advice) is False  # nothing says worse than pass


def test_an_undecided_rule_only_matters_if_it_could_be_worse_than_the_decided_ones():
    across_warn = {"rouge_l": Interval(0.40, 0.60, 16, "prompt")}  # pass or warn
    warned = QualityNumbers(**dict(GOOD, kld_mean=0.2, rouge_l_mean=0.5), intervals=across_warn)
    assert judge(warned).status == "warn"  # KLD warns on its value: the rest cannot be worse
    assert [r.level for r in judge(warned).reasons][:2] == ["warn", "inconclusive"]
    failed = QualityNumbers(**dict(GOOD, kld_mean=0.9, rouge_l_mean=0.5), intervals=across_warn)
    assert judge(failed).status == "fail"
    across_fail = {"rouge_l": Interval(0.15, 0.45, 16, "prompt")}  # warn or fail
    v = judge(QualityNumbers(**dict(GOOD, kld_mean=0.2, rouge_l_mean=0.3),
                             intervals=across_fail))
    assert v.status == "inconclusive"
    assert any("--budget-bits 4.5" in a for a in v.advice)  # at least a warn: keep precision


def test_json_rule_on_prompts_the_reference_failed_says_so():
    v = judge(QualityNumbers(**GOOD, json_prompts=0, json_expected=2))
    reason = next(r for r in v.reasons if r.rule == "json_agreement")
    assert reason.level == "info" and "any of the 2 JSON prompts" in reason.message
    one = judge(QualityNumbers(**GOOD, json_agreement=0.0, json_prompts=1, json_expected=1,
                               intervals={"json_agreement": wilson(0, 1, "prompt")}))
    assert one.status == "inconclusive"  # one failed JSON prompt no longer fails a model


def test_eval_intervals_by_window_hold_the_point_values():
    g = torch.Generator().manual_seed(0)
    acc = _Accumulator()
    for _ in range(12):
        ref = torch.randn(40, 50, generator=g)
        acc.add(ref, ref + 0.3 * torch.randn(40, 50, generator=g),
                torch.randint(0, 50, (40,), generator=g))
    s = summarize(acc)
    for key, point in (("kld_mean", s["kld"]["mean"]), ("same_top_rate", s["same_top_rate"]),
                       ("ppl_ratio", s["ppl_ratio"])):
        low, high = s["intervals"][key]
        assert low <= point <= high and low < high, key
    one = _Accumulator()
    one.add(ref, ref, torch.zeros(40, dtype=torch.long))
    assert summarize(one)["intervals"] == {}


def test_identical_answers_score_rouge_one_even_when_empty():
    from quantpipe.reports.textmetrics import rouge_l

    assert rouge_l(["", "  ", "same words"], ["", "", "same words "]) == [1.0, 1.0, 1.0]


def test_paired_difference_is_honest_at_zero_events():
    from quantpipe.reports.intervals import paired_difference, wilson

    none = [False] * 80
    iv = paired_difference(none, none, "prompt")
    u = wilson(0, 80, "prompt").high  # z^2 / (n + z^2) = 0.0458
    assert iv.low == pytest.approx(-u) and iv.high == pytest.approx(u)
    assert 0.045 < u < 0.047  # below the 5% warn level at 80 prompts ...
    short = paired_difference(none[:16], none[:16], "prompt")
    assert short.high > 0.15  # ... far from it at 16: no decision from silence
    # one candidate-only flag in 16 and the interval holds both 0 and the 5% level
    one = paired_difference([True] + [False] * 15, [False] * 16, "prompt")
    assert one.low < 0 < 1 / 16 < one.high and one.contains(0.05)


def test_paired_difference_covers_95_percent():
    """Monte Carlo coverage of Newcombe's interval for correlated pairs (FP16 and the
    candidate often fail together): within [0.93, 0.985] of 2,000 trials of 80 prompts."""
    from quantpipe.reports.intervals import paired_difference

    rng = np.random.default_rng(7)
    # joint law of (candidate flagged, FP16 flagged): both, candidate only, FP16 only, neither
    probs = np.array([0.04, 0.06, 0.02, 0.88])
    truth = (probs[0] + probs[1]) - (probs[0] + probs[2])
    hits = 0
    for _ in range(2000):
        cells = rng.choice(4, size=80, p=probs)
        cand, ref = np.isin(cells, (0, 1)), np.isin(cells, (0, 2))
        hits += paired_difference(cand.tolist(), ref.tolist(), "prompt").contains(truth)
    assert 0.93 <= hits / 2000 <= 0.985

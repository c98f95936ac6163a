import pytest

from quantpipe.reports.verdict import QualityNumbers, VerdictThresholds, judge

GOOD = QualityNumbers(kld_mean=0.02, same_top_rate=0.97, ppl_ratio=1.01, rouge_l_mean=0.8,
                      json_agreement=1.0, json_prompts=4, garbage_rate=0.0,
                      reference_garbage_rate=0.0)


def _levels(v):
    return {r.rule: r.level for r in v.reasons}


def test_all_good_passes():
    v = judge(GOOD)
    assert v.status == "pass"
    assert set(_levels(v).values()) == {"pass"}


@pytest.mark.parametrize("field,value,rule,level", [
    ("kld_mean", 0.10, "kld_mean", "pass"),  # at the warn level: still a pass
    ("kld_mean", 0.1001, "kld_mean", "warn"),
    ("kld_mean", 0.51, "kld_mean", "fail"),
    ("same_top_rate", 0.90, "same_top", "pass"),
    ("same_top_rate", 0.85, "same_top", "warn"),
    ("same_top_rate", 0.79, "same_top", "fail"),
    ("ppl_ratio", 1.2, "ppl_ratio", "warn"),
    ("rouge_l_mean", 0.3, "rouge_l", "warn"),
    ("rouge_l_mean", 0.2, "rouge_l", "fail"),
    ("json_agreement", 0.75, "json_agreement", "warn"),
    ("json_agreement", 0.5, "json_agreement", "fail"),
    ("garbage_rate", 0.1, "garbage_excess", "warn"),
    ("garbage_rate", 0.3, "garbage_excess", "fail"),
])
def test_each_rule(field, value, rule, level):
    import dataclasses

    v = judge(dataclasses.replace(GOOD, **{field: value}))
    assert _levels(v)[rule] == level
    assert v.status == level
    if level != "pass":
        assert v.reasons[0].rule == rule  # the decisive reason comes first


def test_garbage_is_relative_to_fp16():
    import dataclasses

    n = dataclasses.replace(GOOD, garbage_rate=0.3, reference_garbage_rate=0.28)
    assert _levels(judge(n))["garbage_excess"] == "pass"


def test_unmeasured_and_disabled_rules_do_not_decide():
    v = judge(QualityNumbers(kld_mean=0.01))
    assert v.status == "pass"
    assert _levels(v)["rouge_l"] == "info"
    assert _levels(judge(QualityNumbers(kld_mean=0.01, json_agreement=0.0)))["json_agreement"] \
        == "info"  # no JSON prompt where FP16 parsed: nothing to compare
    off = VerdictThresholds(kld_mean_warn=None, kld_mean_fail=None)
    assert judge(QualityNumbers(kld_mean=9.0), off).reasons[-1].level == "info"
    empty = judge(QualityNumbers())
    assert empty.status == "warn" and empty.reasons[0].rule == "nothing_measured"


def test_custom_thresholds():
    strict = VerdictThresholds(kld_mean_warn=0.01, kld_mean_fail=0.015)
    assert judge(GOOD, strict).status == "fail"


def test_threshold_validation():
    with pytest.raises(ValueError, match="kld_mean_warn=0.6 > kld_mean_fail=0.5"):
        VerdictThresholds(kld_mean_warn=0.6)
    with pytest.raises(ValueError, match="lower is worse"):
        VerdictThresholds(rouge_l_warn=0.1, rouge_l_fail=0.2)
    with pytest.raises(ValueError, match="not finite"):
        VerdictThresholds(ppl_ratio_fail=float("nan"))


def test_thresholds_round_trip_and_reject_unknown_names():
    th = VerdictThresholds(kld_mean_warn=0.05, rouge_l_fail=None)
    d = th.to_dict()
    assert d["kld_mean_warn"] == 0.05 and d["kld_mean_fail"] == 0.50 and d["rouge_l_fail"] is None
    assert VerdictThresholds(**d) == th
    assert len(d) == 12  # six rules, a warn and a fail level each
    with pytest.raises(TypeError, match="kld_warn"):
        VerdictThresholds(kld_warn=0.1)

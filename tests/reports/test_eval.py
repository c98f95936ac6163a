import math

import torch

from reports.eval import EvalSpec, _Accumulator, evaluate_models, summarize, windows
from tests.tiny_models import make_model


def test_accumulator_matches_float64_reference():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(40, 50, generator=g)
    b = a + 0.3 * torch.randn(40, 50, generator=g)
    t = torch.randint(0, 50, (40,), generator=g)
    acc = _Accumulator()
    acc.add(a[:25], b[:25], t[:25])
    acc.add(a[25:], b[25:], t[25:])
    s = summarize(acc)
    pa, pb = a.double().softmax(-1), b.double().softmax(-1)
    kl = [float((pa[i] * (pa[i].log() - pb[i].log())).sum()) for i in range(40)]
    assert math.isclose(s["kld"]["mean"], sum(kl) / 40, rel_tol=1e-6)
    assert math.isclose(s["kld"]["max"], max(kl), rel_tol=1e-6)
    assert math.isclose(s["kld"]["median"], sorted(kl)[19], rel_tol=1e-6)
    same = sum(int(pa[i].argmax() == pb[i].argmax()) for i in range(40))
    assert s["same_top_rate"] == same / 40
    nll = -sum(math.log(pa[i, t[i]]) for i in range(40)) / 40
    assert math.isclose(s["ppl_reference"], math.exp(nll), rel_tol=1e-6)  # fp32 log-softmax
    dp = [float(pb[i, t[i]] - pa[i, t[i]]) for i in range(40)]
    rms = math.sqrt(sum(x * x for x in dp) / 40)
    assert math.isclose(s["top_prob_delta"]["rms"], rms, rel_tol=1e-5)


def test_windows_cover_documents():
    w = windows([list(range(10)), [1], list(range(5))], ctx=4)
    assert w == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], [0, 1, 2, 3]]


def test_identical_models_have_zero_kld(tmp_path):
    model, tok = make_model("llama")
    other, _ = make_model("llama", seed=1)
    text = "Please summarise the attached contract. " * 20
    spec = EvalSpec(tmp_path, tmp_path, (text,), ctx=32)
    same = evaluate_models(model, model, tok, spec)
    assert same.kld["max"] < 1e-6 and same.same_top_rate == 1.0
    assert same.ppl_ratio == 1.0
    diff = evaluate_models(model, other, tok, spec)
    assert diff.kld["mean"] > 1e-3
    limited = evaluate_models(model, other, tok, EvalSpec(tmp_path, tmp_path, (text,), 10, 32))
    assert limited.tokens == 10

import json
import math

import pytest
import torch

from quantpipe.reports.eval import (
    EvalSpec,
    _Accumulator,
    check_output_file,
    check_same_source,
    eval_context,
    evaluate_models,
    summarize,
    windows,
)
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


def test_accumulator_kld_resolves_tiny_differences():
    """INT8-size logit changes: the KLD follows quantpipe.core.metrics (1e-3 relative to a
    float64 reference); the former float32 log-softmax difference was 14% off here."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(6, 4000, generator=g) * 4 + 10  # [T, V]
    b = a + 1e-3 * torch.randn(6, 4000, generator=g)
    acc = _Accumulator()
    acc.add(a, b, torch.zeros(6, dtype=torch.int64))
    lp, lq = a.double().log_softmax(-1), b.double().log_softmax(-1)
    want = (lp.exp() * (lp - lq)).sum(-1)  # [T] fp64, ~4e-7 nats
    assert math.isclose(summarize(acc)["kld"]["mean"], float(want.mean()), rel_tol=1e-3)


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


# ---- input checks (no model is loaded) -----------------------------------------------------


def _manifest(folder, **fields):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "quantpipe.json").write_text(json.dumps({"format": "quantpipe", "version": 1,
                                                       **fields}))
    return folder


def _shards(sha: str) -> list[dict]:
    return [{"file": "model-00001-of-00001.safetensors", "sha256": sha * 64, "bytes": 1}]


@pytest.fixture
def fp16_pair(tmp_path):
    """Two export-fp16 manifests with different shard hashes."""
    return (_manifest(tmp_path / "fp16-a", stage="fp16", shards=_shards("a")),
            _manifest(tmp_path / "fp16-b", stage="fp16", shards=_shards("b")))


def test_same_source_passes_and_other_source_is_refused(fp16_pair, tmp_path, caplog):
    a, b = fp16_pair
    q = _manifest(tmp_path / "q", stage="quantized",
                  source_fp16={"path": str(a), "shards": _shards("a")})
    check_same_source(a, q)
    assert not caplog.messages
    with pytest.raises(ValueError) as err:
        check_same_source(b, q)
    msg = str(err.value)
    assert str(q) in msg and str(a) in msg and str(b) in msg and "--allow-other-source" in msg
    assert "\n" not in msg
    check_same_source(b, q, allow_other=True)
    assert len(caplog.messages) == 1 and "comparing anyway" in caplog.messages[0]


def test_source_from_the_calibration_manifest(fp16_pair, tmp_path):
    """A quantized manifest without source_fp16: the calibration it names records the hashes."""
    a, b = fp16_pair
    calib = _manifest(tmp_path / "calib", stage="calibration", fp16_dir=str(b),
                      fp16_shards=_shards("b"))
    q = _manifest(tmp_path / "q", stage="quantized", calibration={"path": str(calib)})
    check_same_source(b, q)
    with pytest.raises(ValueError, match=f"made from {b}"):
        check_same_source(a, q)


def test_unrecorded_source_warns_once(fp16_pair, tmp_path, caplog):
    a, _ = fp16_pair
    other_tool = tmp_path / "gptq-from-elsewhere"
    other_tool.mkdir()
    check_same_source(a, other_tool)
    gone = _manifest(tmp_path / "q", stage="quantized",
                     calibration={"path": str(tmp_path / "deleted")})
    check_same_source(a, gone)
    assert len(caplog.messages) == 2
    assert "cannot check" in caplog.messages[0] and str(other_tool) in caplog.messages[0]
    assert "records no FP16 shard hashes" in caplog.messages[1]


def test_corrupt_manifest_names_the_file(fp16_pair, tmp_path):
    a, _ = fp16_pair
    q = tmp_path / "q"
    q.mkdir()
    (q / "quantpipe.json").write_text('{"stage": "quant')
    with pytest.raises(ValueError, match=f"{q / 'quantpipe.json'}: the manifest is not valid"):
        check_same_source(a, q)


def test_eval_context(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    assert eval_context(tmp_path, None) == 256  # default 512, capped by the model
    assert eval_context(tmp_path, 128) == 128
    with pytest.raises(ValueError, match=r"--ctx 300 exceeds .*\(256 tokens\)"):
        eval_context(tmp_path, 300)
    (tmp_path / "config.json").write_text(json.dumps({"n_positions": 4096}))
    assert eval_context(tmp_path, None) == 512


def test_check_output_file(tmp_path):
    check_output_file(tmp_path / "new" / "deeper" / "eval.json", "--json")  # folders get made
    with pytest.raises(ValueError, match="existing folder"):
        check_output_file(tmp_path, "--json")
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        check_output_file(tmp_path / "f" / "eval.json", "--json")

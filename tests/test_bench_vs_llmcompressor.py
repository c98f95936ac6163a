"""bench/vs_llmcompressor.py: options, folder names, reuse checks and the table (no model run).

The comparison itself needs llm-compressor's own virtualenv and a real model
(docs/bench-llmcompressor.md); these tests cover the script's own logic.
"""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import quantpipe.reports.eval as reports_eval

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
vs = pytest.importorskip("vs_llmcompressor")


def test_qp_algos_option():
    assert vs.parse_args([]).algo_list == ["gptq"]  # the bench's behaviour before the option
    args = vs.parse_args(["--qp-algos", "gptq,gptaq,gptq", "--schemes", "asym"])
    assert args.algo_list == ["gptq", "gptaq"] and args.scheme_list == ["asym"]
    assert set(vs.QP_ALGOS) >= {"gptq", "gptaq"} and "rtn" not in vs.QP_ALGOS
    for bad in ("awq", "rtn", "", "gptq,foo"):
        with pytest.raises(SystemExit):
            vs.parse_args(["--qp-algos", bad])


def test_folder_names_keep_gptq_and_separate_algos():
    args = vs.parse_args([])
    assert vs.tag("asym", args, "qp") == vs.tag("asym", args, "qp", "gptq") == "asym-ao"
    assert vs.tag("asym", args, "qp", "gptaq") == "asym-ao-gptaq"
    assert vs.tag("sym", args, "qp", "awq+gptq") == "sym-ao-awq-gptq"
    assert vs.tag("sym", args, "llmc", "gptaq") == "sym-ao"  # one llm-compressor run per scheme
    args = vs.parse_args(["--no-act-order", "--qp-mse-clip", "off"])
    assert vs.tag("sym", args, "qp", "gptaq") == "sym-mseoff-gptaq"
    args = vs.parse_args(["--qp-damp", "0.1"])
    assert vs.tag("sym", args, "qp", "gptaq") == "sym-ao-damp0.1-gptaq"
    assert vs.qp_spec(Path("f"), Path("c"), "sym", "gptaq", args).resolved().damp == 0.1


def _manifest(algo: str, args, sym: bool, data: dict) -> dict:
    resolved = vs.qp_spec(Path("/tmp/fp16"), Path("/tmp/c"), "sym" if sym else "asym", algo,
                          args).resolved()
    settings = {"algo": algo, "group_size": args.group_size, "sym": sym,
                "act_order": resolved.act_order, "static_groups": resolved.static_groups,
                "mse_clip": resolved.mse_clip, "damp": resolved.damp, "samples": args.samples,
                "seq_len": args.seq_len, "seed": args.seed, "prompts": args.calib_prompts,
                "min_tokens": vs.MIN_TOKENS}
    return {"settings": settings, "data": data, "fp16_dir": "/tmp/fp16", "int4": {"sym": sym}}


def test_reused_calibration_must_have_the_algo_asked_for(monkeypatch):
    args = vs.parse_args(["--samples", "64", "--seq-len", "256"])
    data = {"sequences": 64}
    manifests = {Path("/x/a"): _manifest("gptaq", args, False, data),
                 Path("/x/b"): _manifest("gptq", args, True, data)}
    monkeypatch.setattr(vs, "read_calibration",
                        lambda d: SimpleNamespace(manifest=manifests[Path(d)]))
    assert vs.reused_calibrations([Path("/x/a"), Path("/x/b")]) == {
        ("asym", "gptaq"): Path("/x/a"), ("sym", "gptq"): Path("/x/b")}
    vs.check_calibration(Path("/x/a"), "asym", "gptaq", args, data)
    with pytest.raises(ValueError, match="'algo': \\('gptaq', 'gptq'\\)"):
        vs.check_calibration(Path("/x/a"), "asym", "gptq", args, data)
    with pytest.raises(ValueError, match="other calibration data"):
        vs.check_calibration(Path("/x/b"), "sym", "gptq", args, {"sequences": 32})
    other = vs.parse_args(["--samples", "128", "--seq-len", "256"])
    with pytest.raises(ValueError, match="samples"):
        vs.check_calibration(Path("/x/b"), "sym", "gptq", other, data)
    damped = vs.parse_args(["--samples", "64", "--seq-len", "256", "--qp-damp", "0.5"])
    with pytest.raises(ValueError, match="'damp': \\(0.1, 0.5\\)"):
        vs.check_calibration(Path("/x/b"), "sym", "gptq", damped, data)
    # a calibration from before --damp (no "damp" in its settings) used 0.01
    del manifests[Path("/x/b")]["settings"]["damp"]
    with pytest.raises(ValueError, match="'damp': \\(0.01, 0.1\\)"):
        vs.check_calibration(Path("/x/b"), "sym", "gptq", args, data)
    old = vs.parse_args(["--samples", "64", "--seq-len", "256", "--qp-damp", "0.01"])
    vs.check_calibration(Path("/x/b"), "sym", "gptq", old, data)


def _ev(kld: float) -> dict:
    return {"kld": {"mean": kld, "median": kld / 2, "p99": kld * 8}, "same_top_rate": 0.8,
            "ppl_candidate": 22.0, "ppl_reference": 21.2, "tokens": 4088, "windows": 8}


def test_table_has_a_row_and_a_ratio_per_algo():
    results = [{
        "scheme": "asym",
        "quantpipe": {"gptq": {"calibrate_seconds": 100.0, "eval": {"sotu": _ev(0.14)}},
                      "gptaq": {"calibrate_seconds": 190.0, "eval": {"sotu": _ev(0.12)}}},
        "llmcompressor": {"seconds": {"load": 2.0, "oneshot": 98.0}, "eval": {"sotu": _ev(0.2)}},
        "kld_mean_ratio_quantpipe_over_llmc": {"gptq": {"sotu": 0.7}, "gptaq": {"sotu": 0.6}},
        "calibrate_seconds_over_gptq": {"gptq": 1.0, "gptaq": 1.9},
    }]
    text = vs.table(results, ["sotu"])
    rows = [line for line in text.splitlines() if line.startswith("sotu ")]
    assert [r.split()[1:3] for r in rows] == [["quantpipe", "gptq"], ["quantpipe", "gptaq"],
                                              ["llm-compressor", "asym"]]
    assert rows[1].split()[4] == "0.12000" and rows[2].split()[-1] == "100"
    assert "sotu: asym: mean KLD quantpipe gptaq / llm-compressor = 0.600" in text
    assert "asym: calibration seconds gptaq / gptq = 1.90" in text
    assert "gptq / gptq" not in text


@pytest.mark.parametrize("groups", [[range(0, 3)], [range(0, 1), range(1, 3)]])
def test_run_scheme_scores_all_candidates_against_one_reference_pass(monkeypatch, tmp_path,
                                                                     groups):
    """Plumbing of one scheme: the candidates that fit in memory together in one evaluate_many
    call per corpus, the results and ratios filed under the right algorithm (calibration and
    models faked)."""
    args = vs.parse_args(["--qp-algos", "gptq,gptaq", "--max-tokens", "4096",
                          "--work", str(tmp_path)])
    kld = {"llmc": 0.2, "gptq": 0.14, "gptaq": 0.1}
    monkeypatch.setattr(vs, "llmc_side", lambda *a: (tmp_path / "llmc", {"seconds": {}}))
    monkeypatch.setattr(vs, "quantpipe_side", lambda fp16, work, scheme, algo, *a: (
        tmp_path / algo, {"calibrate_seconds": {"gptq": 10.0, "gptaq": 19.0}[algo]}))
    monkeypatch.setattr(vs, "load_llmc_model", lambda d, loader: "llmc")
    monkeypatch.setattr(vs, "loader_agreement", lambda m, d: {"max_rel_diff": 0.0})
    monkeypatch.setattr(vs, "load_eval_model", lambda d: Path(d).name)
    monkeypatch.setattr(reports_eval, "load_eval_model", lambda d: Path(d).name)
    monkeypatch.setattr(reports_eval, "candidate_batches",
                        lambda ref, n: groups if n == 3 else None)
    calls = []

    def fake_many(ref, models, tok, spec, names):
        assert ref == Path(args.fp16).name  # the reference, loaded once the candidates exist
        calls.append((models, spec.max_tokens, names))
        scale = 1.0 if spec.texts == ("b",) else 2.0
        return [SimpleNamespace(to_dict=lambda m=m: {"kld": {"mean": scale * kld[m]}})
                for m in models]

    monkeypatch.setattr(reports_eval, "evaluate_many", fake_many)
    out = vs.run_scheme("asym", args, {}, {"business-eval": ("b",), "sotu": ("s",)}, None, {})
    every = ["llmc", "gptq", "gptaq"]
    assert [(m, t) for m, t, _ in calls] == [([every[i] for i in g], t)
                                             for g in groups for t in (4096, 0)]
    assert [n for _, _, n in calls[::2]] == [[str(tmp_path / every[i]) for i in g]
                                             for g in groups]
    assert out["quantpipe"]["gptaq"]["eval"]["sotu"]["kld"]["mean"] == pytest.approx(0.2)
    assert out["llmcompressor"]["eval"]["business-eval"]["kld"]["mean"] == pytest.approx(0.2)
    assert out["kld_mean_ratio_quantpipe_over_llmc"] == {
        "gptq": {"business-eval": pytest.approx(0.7), "sotu": pytest.approx(0.7)},
        "gptaq": {"business-eval": pytest.approx(0.5), "sotu": pytest.approx(0.5)}}
    assert out["calibrate_seconds_over_gptq"] == {"gptq": 1.0, "gptaq": 1.9}

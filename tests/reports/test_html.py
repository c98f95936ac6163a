import dataclasses
import json
import re
from html.parser import HTMLParser

import numpy as np
import pytest

from quantpipe.prompts.sets import PromptRecord
from quantpipe.reports import charts
from quantpipe.reports.data import (
    CalibrationFacts,
    CandidateData,
    DistributionMetrics,
    MachineInfo,
    ReportData,
    SpeedRecord,
    detect_machine,
)
from quantpipe.reports.html import render_quality_report, speed_family, write_report
from quantpipe.reports.summary import summarize
from tests.reports.sample_data import BAD_OUTPUTS, GOOD_OUTPUTS, XSS_OUTPUT, sample_report


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "quality.html"
    html_path, json_path = write_report(sample_report(), out)
    return html_path, json_path, html_path.read_text(encoding="utf-8")


def _without_svg(page: str) -> str:
    return re.sub(r"<svg\b.*?</svg>", "", page, flags=re.DOTALL)


class TagCollector(HTMLParser):
    """Every start tag the browser would build, with its attributes (text is ignored)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, attrs))

    handle_startendtag = handle_starttag


def _tags(page: str):
    parser = TagCollector()
    parser.feed(page)
    return parser.tags


def _text_only(page: str) -> str:
    """The page with the diff markers removed, so escaped model text reads contiguously."""
    return re.sub(r"</?(ins|del)>", "", page)


def test_model_text_is_escaped(written):
    _, _, page = written
    flat = _text_only(page)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in flat
    assert "&quot;&gt;&lt;img src=x onerror=alert(2)&gt;" in flat
    tags = _tags(page)
    names = {t for t, _ in tags}
    # no element that runs code or loads anything exists in the page, model text included
    assert not names & {"script", "img", "iframe", "object", "embed", "link", "image", "video"}
    for tag, attrs in tags:
        for name, _ in attrs:
            assert not name.startswith("on"), f"event handler {name} on <{tag}>"
    # the notes line is also escaped
    assert "&lt;b&gt;not&lt;/b&gt;" in page


def test_no_network_references(written):
    _, _, page = written
    refs = [(tag, name, value) for tag, attrs in _tags(page) for name, value in attrs
            if name in ("src", "href", "xlink:href", "action", "poster", "data", "srcset")]
    assert refs, "expected in-page links (table of contents, SVG glyph uses)"
    for tag, name, value in refs:
        assert value.startswith("#"), f"<{tag} {name}={value!r}> is not an in-page reference"
    assert not re.search(r"url\(\s*['\"]?(?!#)", page), "CSS url() would fetch"
    assert "@import" not in page
    # the only http strings in markup are SVG namespace identifiers (never fetched)
    urls = {v for _, attrs in _tags(page) for _, v in attrs if v and re.match(r"https?:", v)}
    assert urls <= {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}
    assert "Content-Security-Policy" in page and "default-src 'none'" in page


def test_page_sections_and_print_css(written):
    _, _, page = written
    for section in ("verdict", "distribution", "generations", "lengths", "garbage",
                    "calibration", "speed", "thresholds"):
        assert f'id="{section}"' in page
    assert "@media print" in page
    assert page.count("<svg") >= 1 + 1 + 2 + 4  # KLD, lengths, 2 layer-error, 4 speed
    assert '<?xml' not in page and "<!DOCTYPE svg" not in page
    # the good sample has 2 JSON prompts: too few to pass that rule (its interval holds 0.9)
    assert 'data-verdict="inconclusive"' in page and 'data-verdict="fail"' in page
    assert "Next step" in page and "--budget-bits 4.5" in page and "more prompts" in page
    assert 'class="ci">95% ' in page  # intervals beside the numbers
    assert "Intel(R) Xeon(R) Platinum 8480+" in page and "NVIDIA H200" in page
    assert "gptq_damping" in page


def test_json_beside_holds_the_numbers(written):
    html_path, json_path, page = written
    assert json_path == html_path.with_suffix(".json")
    doc = json.loads(json_path.read_text(encoding="utf-8"))
    assert doc["format"] == "quantpipe-report" and doc["version"] == 3
    good, bad = doc["candidates"]
    assert good["verdict"]["status"] == "inconclusive" and bad["verdict"]["status"] == "fail"
    json_reason = next(r for r in good["verdict"]["reasons"] if r["rule"] == "json_agreement")
    assert json_reason["level"] == "inconclusive" and json_reason["could_be"] == ["pass", "fail"]
    assert good["generation"]["intervals"]["json_agreement"]["n"] == 2
    assert good["distribution"]["kld"]["mean"] == 0.031
    assert good["generation"]["json_agreement"] == 1.0
    assert bad["generation"]["garbage_rate"] == pytest.approx(3 / 5)
    assert len(good["generation"]["per_prompt"]) == 5
    assert doc["outputs"]["int4-gptq-g128"][3] == XSS_OUTPUT
    assert good["calibration"]["fallbacks"][0]["kind"] == "gptq_damping"
    assert {r["metric"] for r in doc["speed"]} >= {"tokens_per_s", "ttft_ms", "tpot_ms"}
    assert doc["speed"][2]["p99"] == 301.9
    assert doc["thresholds"]["kld_mean_warn"] == 0.10
    # the page shows the same numbers
    rl = good["generation"]["rouge_l_mean"]
    assert f"{rl:.3f}" in page
    # no temp files left behind by the atomic writes
    assert sorted(p.name for p in html_path.parent.iterdir()) == ["quality.html", "quality.json"]


def test_summary_numbers_by_hand():
    data = sample_report(with_speed=False)
    s = summarize(data)
    good, bad = s.candidates
    # extract-invoice and classify-ticket are the expect_json prompts; both FP16 parse
    assert good.generation.json_prompts == 2
    assert good.generation.json_parse_rate == 1.0 and bad.generation.json_parse_rate == 0.5
    assert bad.generation.json_agreement == 0.0
    assert good.generation.exact_match_rate == pytest.approx(1 / 5)  # classify-ticket only
    assert s.reference.garbage_rate == 0.0
    assert [p.garbage.is_garbage for p in bad.generation.per_prompt] == [
        True, False, True, True, False]


def test_report_without_generations_or_speed():
    d = sample_report(with_speed=False)
    only_dist = dataclasses.replace(
        d, prompts=(), reference_outputs=None,
        candidates=tuple(dataclasses.replace(c, outputs=None, calibration=None)
                         for c in d.candidates))
    page = render_quality_report(only_dist)
    assert 'id="speed"' not in page and 'id="calibration"' not in page
    assert "Not measured (no greedy outputs given)" in page


def test_input_validation():
    d = sample_report(with_speed=False)
    with pytest.raises(ValueError, match="outputs for 5 prompts"):
        dataclasses.replace(d, candidates=(dataclasses.replace(
            d.candidates[0], outputs=GOOD_OUTPUTS[:2]),))
    with pytest.raises(ValueError, match="distinct label"):
        dataclasses.replace(d, candidates=(d.candidates[0], d.candidates[0]))
    with pytest.raises(ValueError, match="machine"):
        dataclasses.replace(d, speed=(SpeedRecord("a", "tokens_per_s", 1.0, "tok/s"),))
    with pytest.raises(ValueError, match=r"\.html"):
        write_report(d, "/tmp/report.txt")
    with pytest.raises(ValueError, match="lacks"):
        SpeedRecord.from_dict({"name": "x", "value": 1})
    with pytest.raises(ValueError, match="kld lacks"):
        DistributionMetrics.from_eval({"tokens": 1, "kld": {"mean": 1.0}, "same_top_rate": 1,
                                       "top_prob_delta": {}, "ppl_reference": 1,
                                       "ppl_candidate": 1, "ppl_ratio": 1})
    assert len(BAD_OUTPUTS) == len(d.prompts)


def test_distribution_from_eval_dataclass():
    from quantpipe.reports.eval import EvalResult

    r = EvalResult(reference="a", candidate="b", tokens=10, windows=1,
                   kld={k: 0.1 for k in ("mean", "median", "p90", "p99", "p999", "max")},
                   same_top_rate=0.9,
                   top_prob_delta={k: 0.0 for k in ("rms", "p1", "p5", "p50", "p95", "p99")},
                   ppl_reference=10.0, ppl_candidate=11.0, ppl_ratio=1.1, seconds=1.0)
    d = DistributionMetrics.from_eval(r)
    assert d.kld["mean"] == 0.1 and d.ppl_ratio == 1.1
    assert DistributionMetrics.from_eval(r.to_dict()) == d


def test_calibration_facts_from_manifest():
    manifest = {
        "stage": "quantized",
        "layers": {"model.layers.0.mlp.down_proj": {"bits": 4, "group_size": 64, "sym": True}},
        "calibration": {"algorithm": "gptq", "samples": 64, "seq_len": 256,
                        "layer_errors": {"model.layers.0.mlp.down_proj": 0.01},
                        "kept_fp16": ["lm_head"], "effective_bits": 4.5,
                        "fallbacks": [{"layer": "model.layers.0.mlp.down_proj",
                                       "kind": "group_size", "detail": "128 -> 64"}]},
    }
    f = CalibrationFacts.from_manifest(manifest)
    assert f.algorithm == "gptq" and f.samples == 64 and f.effective_bits == 4.5
    assert [(r.layer, r.bits) for r in f.plan] == [("model.layers.0.mlp.down_proj", 4),
                                                   ("lm_head", None)]
    assert f.fallbacks[0].detail == "128 -> 64"
    with pytest.raises(ValueError, match="calibration.algorithm"):
        CalibrationFacts.from_manifest({"stage": "quantized"})
    with pytest.raises(ValueError, match="stage"):
        CalibrationFacts.from_manifest({"stage": "fp16"})


def test_speed_family_and_machine():
    assert speed_family(SpeedRecord("a", "ttft_ms", 1.0, "ms")) == "TTFT"
    assert speed_family(SpeedRecord("a", "itl_p50", 1.0, "ms")) == "TPOT"
    assert speed_family(SpeedRecord("a", "decode", 1.0, "tok/s")) == "throughput"
    assert speed_family(SpeedRecord("a", "gemv", 1.0, "us")) == "other"
    m = detect_machine()
    assert isinstance(m, MachineInfo) and m.cpu and m.cpu != ""


def test_prompt_with_markup_is_escaped():
    p = PromptRecord(id='<x id="1">', source="t:1", category="<cat>", prompt="</div><script>")
    d = ReportData(title="<title>", reference="/r", prompts=(p,), reference_outputs=("a",),
                   candidates=(CandidateData("c<1>", "/c", outputs=("b",)),))
    page = render_quality_report(d)
    body = _without_svg(page)
    assert "<script" not in body and "<x " not in body and "<cat>" not in body
    assert "&lt;/div&gt;&lt;script&gt;" in body and "c&lt;1&gt;" in body


def test_svg_charts_are_inline_ready():
    svg = charts.speed_chart({"a": 1.0, "b": 2.5}, "tokens_per_s", "tok/s")
    assert svg.startswith("<svg ") and svg.rstrip().endswith("</svg>")
    assert "<metadata" not in svg and "http://purl.org" not in svg
    assert 'role="img"' in svg and 'width="' not in svg.split(">", 1)[0]


def test_calibration_facts_from_calibration_artifact():
    spec4 = {"bits": 4, "group_size": 64, "sym": True, "act_order": False}
    spec8 = {"bits": 8, "group_size": -1, "sym": True, "act_order": False}
    infos = {
        "a.q_proj": {"w4": {"spec": spec4, "loss": 2.0, "damp": 0.01, "damp_raises": 0},
                     "w8": {"spec": spec8, "loss": 0.1, "damp": 0.01, "damp_raises": 0}},
        "a.down_proj": {"w4": {"spec": spec4, "loss": 9.0, "damp": 0.1, "damp_raises": 2},
                        "w8": {"spec": spec8, "loss": 0.3, "damp": 0.04, "damp_raises": 1}},
        "a.up_proj": {"w4": {"spec": spec4, "loss": 1.0, "damp": 0.01, "damp_raises": 0},
                      "w8": {"spec": spec8, "loss": 0.05, "damp": 0.01, "damp_raises": 0}},
    }
    manifest = {"stage": "calibration", "algo": "gptq",
                "settings": {"samples": 16, "seq_len": 256, "group_size": 128},
                "group_size_fallbacks": {"a.q_proj": 64, "a.down_proj": 64}}
    plan = {"effective_bits_per_weight": 5.1,
            "layers": {"a.q_proj": {"bits": 4}, "a.down_proj": {"bits": 8},
                       "a.up_proj": {"bits": None}}}
    f = CalibrationFacts.from_calibration(manifest, infos, plan)
    assert f.algorithm == "gptq" and (f.samples, f.seq_len, f.effective_bits) == (16, 256, 5.1)
    assert [(r.layer, r.bits, r.group_size) for r in f.plan] == [
        ("a.q_proj", 4, 64), ("a.down_proj", 8, -1), ("a.up_proj", None, None)]
    assert f.layer_errors == {"a.q_proj": 2.0, "a.down_proj": 0.3}  # loss of the chosen bits
    # down_proj went INT8: its INT8 damping raise counts, its INT4 group fallback does not
    assert [(x.layer, x.kind) for x in f.fallbacks] == [("a.down_proj", "gptq_damping"),
                                                        ("a.q_proj", "group_size")]
    assert "raised 1 times to 0.04" in f.fallbacks[0].detail
    default = CalibrationFacts.from_calibration(manifest, infos)
    assert {r.bits for r in default.plan} == {4} and default.layer_errors["a.down_proj"] == 9.0
    with pytest.raises(ValueError, match="quantpipe calibrate"):
        CalibrationFacts.from_calibration({"stage": "quantized"}, infos)
    page = render_quality_report(dataclasses.replace(
        sample_report(with_speed=False),
        candidates=(CandidateData("c", "/c", calibration=f),), prompts=(),
        reference_outputs=None))
    # an explicit --group-size that did not divide is shown, apart from the numerical ones
    assert "Numerical fallbacks (gptq_damping: 1)</h3>" in page
    assert "Group-size substitutions (1)</h3>" in page and "<dd>128 requested</dd>" in page
    # the default (--group-size auto) plans each layer's size: no substitution, no fallback
    auto = {**manifest, "settings": {**manifest["settings"], "group_size": None},
            "group_size_fallbacks": {}, "int4_group_sizes": {"a.q_proj": 64,
                                                             "a.down_proj": 64,
                                                             "a.up_proj": 128}}
    h = CalibrationFacts.from_calibration(auto, infos)
    assert [x.kind for x in h.fallbacks] == ["gptq_damping"]
    assert h.group_sizes == "auto (planned per layer): 64 on 2 layers, 128 on 1 layer"
    page = render_quality_report(dataclasses.replace(
        sample_report(with_speed=False),
        candidates=(CandidateData("c", "/c", calibration=h),), prompts=(),
        reference_outputs=None))
    assert "Group-size substitutions" not in page and "planned per layer" in page
    assert "<dt>numerical fallbacks</dt><dd>1</dd>" in page
    # MoE: an expert linear routed too few tokens (RTN) is listed unless the plan keeps it FP16
    moe = {**manifest, "expert_fallbacks": {"a.q_proj": 12, "a.up_proj": 3},
           "min_expert_tokens": 64}
    g = CalibrationFacts.from_calibration(moe, infos, plan)
    experts = [x for x in g.fallbacks if x.kind == "expert_tokens"]
    assert [x.layer for x in experts] == ["a.q_proj"]
    assert experts[0].detail == "12 routed calibration tokens (< 64): RTN"


def test_empty_output_is_shown_and_flagged():
    p = PromptRecord(id="p", source="t:1", prompt="hi")
    d = ReportData(title="t", reference="/r", prompts=(p,), reference_outputs=("hello",),
                   candidates=(CandidateData("c", "/c", outputs=("  ",)),))
    s = summarize(d)
    assert s.candidates[0].generation.garbage_rate == 1.0
    assert s.candidates[0].verdict.status == "fail"
    assert "(empty output)" in render_quality_report(d, s)


def test_act_order_is_the_calibration_setting_and_uniform_plans_have_no_per_layer_table():
    """Static act-order groups store no g_idx (the layer spec says act_order False): the
    report reads how GPTQ walked the columns from the calibration's settings. A uniform model
    gets its format table only, not one row per layer."""
    from quantpipe.reports.html import _calibration_block

    spec4 = {"bits": 4, "group_size": 64, "sym": True, "act_order": False}
    infos = {f"l{i}.proj": {"w4": {"spec": spec4, "loss": 1.0, "damp": 0.01, "damp_raises": 0}}
             for i in range(3)}
    manifest = {"stage": "calibration", "algo": "gptq",
                "settings": {"samples": 16, "seq_len": 256, "act_order": True}}
    facts = CalibrationFacts.from_calibration(manifest, infos)
    assert all(r.act_order for r in facts.plan)
    rtn = dict(manifest, algo="rtn", settings={"samples": 16, "seq_len": 256,
                                                "act_order": False})
    assert not any(r.act_order for r in CalibrationFacts.from_calibration(rtn, infos).plan)
    block = _calibration_block("w4", facts)
    assert "INT4 g64 sym act-order" in block and "Mixed-precision plan" not in block
    mixed = CalibrationFacts.from_calibration(
        manifest, {**infos, "l3.proj": {"w8": {"spec": dict(spec4, bits=8, group_size=-1),
                                               "loss": 0.1, "damp": 0.01, "damp_raises": 0}}},
        {"layers": {"l0.proj": {"bits": 4}, "l1.proj": {"bits": 4}, "l2.proj": {"bits": 4},
                    "l3.proj": {"bits": 8}}})
    assert "Mixed-precision plan" in _calibration_block("mixed", mixed)


def test_a_validated_budget_plan_charts_its_upgrade_paths():
    """A budget plan's validated paths (plan.to_dict()'s validation_curves) become a chart of
    held-out KLD against bits in the candidate's calibration block, the plan marked on it;
    a plan without validation gets no such chart."""
    from quantpipe.reports.html import _calibration_block

    spec4 = {"bits": 4, "group_size": 64, "sym": True, "act_order": False}
    infos = {f"l{i}.proj": {"w4": {"spec": spec4, "loss": 1.0, "damp": 0.01, "damp_raises": 0}}
             for i in range(2)}
    manifest = {"stage": "calibration", "algo": "gptq", "settings": {"samples": 16}}
    plan = {"effective_bits_per_weight": 4.4, "validated_damage": 0.07,
            "layers": {"l0.proj": {"bits": 4}, "l1.proj": {"bits": 4}},
            "validation_curves": {"menu's path": [[4.0, 0.25], [4.2, 0.12], [4.5, 0.08]],
                                  "INT4 -> INT8 -> FP16 path": [[4.2, 0.084], [4.4, 0.07]]}}
    facts = CalibrationFacts.from_calibration(manifest, infos, plan)
    assert facts.validation_curves["INT4 -> INT8 -> FP16 path"] == ((4.2, 0.084), (4.4, 0.07))
    assert facts.validated_kld == 0.07
    block = _calibration_block("mixed-4.5", facts)
    bare = _calibration_block("mixed-4.5", CalibrationFacts.from_calibration(
        manifest, infos, {**plan, "validation_curves": {}}))
    assert "upgrade paths, scored on held-out prompts" in block
    assert "upgrade paths" not in bare
    assert block.count("<svg") == bare.count("<svg") + 1  # (the other: per-layer error)


def test_a_reference_dequantized_from_a_quantized_gguf_is_named(tmp_path):
    import gguf

    from quantpipe.reports.build import reference_notes

    def fp16_from(file_type):
        path = tmp_path / f"m-{file_type.name}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_file_type(file_type)
        w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        folder = tmp_path / f"fp16-{file_type.name}"
        folder.mkdir()
        (folder / "quantpipe.json").write_text(json.dumps(
            {"stage": "fp16", "source": {"kind": "gguf", "path": str(path)}}))
        return folder

    (note,) = reference_notes(fp16_from(gguf.LlamaFileType.MOSTLY_Q4_1))
    assert "dequantized from a Q4_1 GGUF file (m-MOSTLY_Q4_1.gguf)" in note
    assert reference_notes(fp16_from(gguf.LlamaFileType.MOSTLY_F16)) == ()  # exact
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "quantpipe.json").write_text(json.dumps({"stage": "fp16",
                                                       "source": {"kind": "folder"}}))
    assert reference_notes(folder) == ()


def test_recommendation_is_the_smallest_passing_candidate_within_the_constraint():
    from quantpipe.reports.data import CandidateData, Constraint, ReportData
    from tests.reports.sample_data import _dist

    def cand(name, kld, mb, windows_ci=None):
        d = _dist(kld, 0.95, 1.02)
        if windows_ci:
            d = dataclasses.replace(d, windows=16, intervals={"kld_mean": windows_ci})
        return CandidateData(name, f"/q/{name}", d, weight_bytes=int(mb * 1e6))

    cands = (cand("w8", 0.004, 150), cand("w4.5", 0.04, 95, (0.03, 0.06)),
             cand("w4", 0.08, 80), cand("w3", 0.7, 60))  # w3 fails on KLD
    data = ReportData("t", "/fp16", cands)
    assert summarize(data).recommendation.startswith("Recommended: w4 (80.0 MB)")
    strict = dataclasses.replace(data, constraint=Constraint(max_kld=0.05))
    # w4.5's mean 0.04 is below 0.05, its interval's upper end 0.06 is not: w8 it is
    assert summarize(strict).recommendation.startswith("Recommended: w8 (150.0 MB)")
    small = dataclasses.replace(data, constraint=Constraint(max_bytes=70_000_000))
    text = summarize(small).recommendation
    assert text.startswith("No candidate can be recommended") and "w3: verdict fail" in text
    assert "w4: 80.0 MB > 70.0 MB" in text
    page = render_quality_report(small)
    assert "No candidate can be recommended" in page
    with pytest.raises(ValueError, match="--max-kld"):
        Constraint(max_kld=0.0)

"""Synthetic report inputs (no model): used by the tests and for docs/report-sample.png."""

from __future__ import annotations

import math
import random

from quantpipe.prompts.sets import PromptRecord
from quantpipe.reports.data import (
    CalibrationFacts,
    CandidateData,
    DistributionMetrics,
    Fallback,
    MachineInfo,
    ModelSpeed,
    PlanRow,
    ReportData,
    SpeedRecord,
)

XSS_OUTPUT = 'Sure! <script>alert(1)</script> and "><img src=x onerror=alert(2)> done.'

PROMPTS = (
    PromptRecord(id="support-refund", source="sample:1", category="customer_support", lang="en",
                 prompt="A customer asks how to get a refund for a damaged blender. "
                        "Reply politely."),
    PromptRecord(id="extract-invoice", source="sample:2", category="extraction", lang="en",
                 prompt="Return JSON with keys vendor, total, currency for: ACME Corp invoice, "
                        "total 1,250.00 EUR.",
                 expect_json=True, json_keys=("vendor", "total", "currency")),
    PromptRecord(id="zh-summary", source="sample:3", category="summarization", lang="zh",
                 prompt="用一句话总结：公司第三季度收入增长百分之十二，主要来自云服务。"),
    PromptRecord(id="html-question", source="sample:4", category="coding", lang="en",
                 messages=(("system", "You are a helpful assistant."),
                           ("user", "How do I show an alert in a web page?"))),
    PromptRecord(id="classify-ticket", source="sample:5", category="classification", lang="en",
                 prompt="Classify this ticket as billing, technical or other and answer in JSON "
                        "with keys label and urgency: 'My card was charged twice.'",
                 expect_json=True, json_keys=("label", "urgency")),
)

FP16_OUTPUTS = (
    "I'm sorry your blender arrived damaged. Please reply with your order number and a photo, "
    "and we will send a prepaid return label and refund you within five business days.",
    '```json\n{"vendor": "ACME Corp", "total": 1250.00, "currency": "EUR"}\n```',
    "公司第三季度收入增长百分之十二，主要得益于云服务。",
    "Use <script>alert('hi')</script> inside the HTML body.",
    'The ticket is about billing. {"label": "billing", "urgency": "high"}',
)

GOOD_OUTPUTS = (
    "I'm sorry your blender arrived damaged. Please send your order number and a photo, "
    "and we will send a prepaid return label and refund you within five business days.",
    '{"vendor": "ACME Corp", "total": 1250, "currency": "eur"}',
    "公司第三季度收入增长百分之十二，主要来自云服务。",
    XSS_OUTPUT,
    'The ticket is about billing. {"label": "billing", "urgency": "high"}',
)

BAD_OUTPUTS = (
    "Refund refund refund refund refund refund refund refund refund refund refund refund.",
    '{"vendor": "ACME", "total": 125',
    "公司公司公司公司公司公司公司公司公司公司公司公司公司公司公司公司",
    "\x00\x01\ufffd\ufffd!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!",
    '{"label": "technical", "urgency": "low"}',
)


def _kld(mean: float) -> dict[str, float]:
    return {"mean": mean, "median": mean * 0.4, "p90": mean * 2.2, "p99": mean * 9.0,
            "p999": mean * 25.0, "max": mean * 60.0}


def _dist(kld_mean: float, same_top: float, ppl_ratio: float) -> DistributionMetrics:
    return DistributionMetrics(
        tokens=4096, kld=_kld(kld_mean), same_top_rate=same_top,
        top_prob_delta={"rms": 0.04 + kld_mean / 5, "p1": -0.2 - kld_mean, "p5": -0.08,
                        "p50": 0.0, "p95": 0.05, "p99": 0.12},
        ppl_reference=14.2, ppl_candidate=14.2 * ppl_ratio, ppl_ratio=ppl_ratio, windows=8,
        intervals={"kld_mean": (kld_mean * 0.8, kld_mean * 1.25),
                   "same_top_rate": (same_top - 0.012, min(1.0, same_top + 0.01)),
                   "ppl_ratio": (ppl_ratio * 0.99, ppl_ratio * 1.012)})


def _calibration(algorithm: str, seed: int, int8_down: bool) -> CalibrationFacts:
    rng = random.Random(seed)
    kinds = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    plan, errors = [], {}
    for layer in range(6):
        for k in kinds:
            part = "self_attn" if k.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            name = f"model.layers.{layer}.{part}.{k}"
            bits = 8 if (int8_down and k == "down_proj") else 4
            plan.append(PlanRow(name, bits, -1 if bits == 8 else 128, True, algorithm == "gptq"))
            base = 3.0 if k == "down_proj" else 1.0
            errors[name] = base * (1 + layer) * 1e-3 * math.exp(rng.gauss(0, 0.3)) / (
                8 if bits == 8 else 1)
    fallbacks = (Fallback("model.layers.3.mlp.down_proj", "gptq_damping",
                          "damp 0.01 -> 0.1 after a failed Cholesky"),) if seed == 1 else ()
    return CalibrationFacts(algorithm=algorithm, samples=128, seq_len=512, layer_errors=errors,
                            plan=tuple(plan), effective_bits=4.26 if not int8_down else 4.9,
                            fallbacks=fallbacks)


def _loop(requests: int, concurrency: int, tok_s: float, ttft: float, tpot: float) -> dict:
    def stats(v: float) -> dict[str, float]:
        return {"mean": v * 1.1, "p50": v, "p95": v * 1.8, "p99": v * 2.5}

    return {"requests": requests, "concurrency": concurrency, "output_tokens_per_s": tok_s,
            "ttft_ms": stats(ttft), "tpot_ms": stats(tpot)}


def model_speed(name: str, weight_bytes: int, scale: float) -> ModelSpeed:
    """A model's speed numbers as reports.answers measures them (synthetic)."""
    return ModelSpeed(name, weight_bytes, 600_000_000 + 2 * weight_bytes, True, 46_080, 1.5,
                      {1: _loop(3, 1, 35.0 * scale, 110 / scale, 27 / scale),
                       8: _loop(5, 8, 69.0 * scale, 340 / scale, 80 / scale)})


def sample_report(with_speed: bool = True) -> ReportData:
    good = CandidateData("int4-gptq-g128", "/runs/smollm2/int4-gptq", _dist(0.031, 0.955, 1.021),
                         GOOD_OUTPUTS, _calibration("gptq", 1, int8_down=True),
                         weight_bytes=112_733_208)
    bad = CandidateData("int4-rtn-pc", "/runs/smollm2/int4-rtn", _dist(0.62, 0.71, 1.83),
                        BAD_OUTPUTS, _calibration("rtn", 2, int8_down=False),
                        weight_bytes=101_000_000)
    speed = ()
    if with_speed:
        speed = (
            SpeedRecord("fp16 decode bs=1", "tokens_per_s", 41.8, "tok/s"),
            SpeedRecord("int4-gptq decode bs=1", "tokens_per_s", 63.5, "tok/s"),
            SpeedRecord("int4-gptq serve c=8", "ttft_ms", 182.0, "ms",
                        {"p50": 170.1, "p95": 240.3, "p99": 301.9}),
            SpeedRecord("int4-gptq serve c=8", "tpot_ms", 21.4, "ms",
                        {"p50": 20.9, "p95": 25.2, "p99": 31.0}),
            SpeedRecord("w4 gemv 576x1536", "latency_us", 38.2, "us", {"kernel": "triton"}),
        )
    return ReportData(
        title="SmolLM2-135M-Instruct: quantization report",
        reference="/runs/smollm2/fp16",
        candidates=(good, bad),
        prompts=PROMPTS,
        reference_outputs=FP16_OUTPUTS,
        speed=speed,
        reference_bytes=269_060_272,
        model_speed=((model_speed("FP16", 269_060_272, 1.0),
                      model_speed("int4-gptq-g128", 112_733_208, 3.0),
                      model_speed("int4-rtn-pc", 101_000_000, 3.2)) if with_speed else ()),
        memory_budget=16 * 10**9 if with_speed else None,
        machine=(MachineInfo("Intel(R) Xeon(R) Platinum 8480+", 16, "NVIDIA H200",
                             "Linux 6.1 x86_64", "avx2 fma avx512f avx512_vnni amx_int8",
                             64 * 2**30) if with_speed else None),
        created="2026-11-30 12:00 UTC",
        notes=("Synthetic sample data: <b>not</b> a measurement.",),
    )

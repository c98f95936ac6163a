"""The export refuses what vLLM cannot load (quantpipe/core/formats/vllm_support.py), before
anything is written, naming what vLLM lacks; tests/test_vllm.py shows vLLM refusing the same
checkpoints when they are written anyway (``for_vllm=False``)."""

from __future__ import annotations

import json
import re

import pytest

from quantpipe.core.formats import load_quantized, write_checkpoint
from quantpipe.core.formats.gptq import layer_pattern
from quantpipe.core.formats.vllm_support import (
    CT_ASYM_INT4_GROUP_SIZES,
    GPTQ_GROUP_SIZES,
    ct_spec_problem,
    fused_group,
    fused_problems,
    gptq_spec_problem,
)
from quantpipe.core.qformat import QuantSpec
from tests.quantpipe.test_formats_common import export_tiny, quantize_plan

QKV = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
       "model.layers.0.self_attn.v_proj")


@pytest.fixture(scope="module")
def fp16(tiny_llama_dir, tmp_path_factory):
    return export_tiny(tiny_llama_dir, tmp_path_factory.mktemp("vllm-support") / "fp16")


def _refused(fmt, fp16, out, weights, match):
    with pytest.raises(ValueError, match=match) as err:
        write_checkpoint(fmt, out, fp16, weights)
    assert not out.exists()
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("vLLM 0.32.0 could not load this")
    return msg


@pytest.mark.parametrize("spec,match", [
    (QuantSpec(4, 32, False), "asymmetric: vLLM's GPTQ"),
    (QuantSpec(8, 64, False), "asymmetric: vLLM's GPTQ"),
    (QuantSpec(4, 16, True), r"group size 16: vLLM's GPTQ takes group sizes \(-1, 32, 64, 128\)"),
])
def test_gptq_refuses_specs_vllm_lacks(fp16, tmp_path, spec, match):
    _refused("gptq", fp16, tmp_path / "q", quantize_plan(fp16, [spec]), match)


@pytest.mark.parametrize("spec,match", [
    (QuantSpec(8, -1, False), "8-bit asymmetric: vLLM has a kernel"),
    (QuantSpec(4, 16, False), "4-bit asymmetric with group size 16"),
])
def test_compressed_tensors_refuses_specs_vllm_lacks(fp16, tmp_path, spec, match):
    _refused("compressed-tensors", fp16, tmp_path / "q", quantize_plan(fp16, [spec]), match)


def test_spec_rules_are_the_tables():
    for g in (16, 32, 64, 128, 256, 512, 1024, -1):
        for sym in (True, False):
            for bits in (4, 8):
                spec = QuantSpec(bits, g, sym)
                assert (gptq_spec_problem(spec) is None) == (sym and g in GPTQ_GROUP_SIZES)
                loads_ct = sym or (bits == 4 and g in CT_ASYM_INT4_GROUP_SIZES)
                assert (ct_spec_problem(spec) is None) == loads_ct, spec
    for bits in (5, 6):  # native-format menu entries: neither format has a packing for them
        for spec in (QuantSpec(bits, 128, True), QuantSpec(bits, 32, False)):
            assert f"{bits}-bit: gptq checkpoints store (4, 8)" in gptq_spec_problem(spec)
            assert f"{bits}-bit: compressed-tensors" in ct_spec_problem(spec)


def test_gptq_refuses_an_act_order_permutation(fp16, tmp_path):
    weights = quantize_plan(fp16, [QuantSpec(4, 32, True, act_order=True)], act_order_seed=5)
    with pytest.raises(ValueError, match="act-order g_idx is a permutation.*--static-groups"):
        write_checkpoint("gptq", tmp_path / "q", fp16, weights)
    assert not (tmp_path / "q").exists()


def test_gptq_static_act_order_is_written_as_vllm_reads_it(fp16, tmp_path):
    """Act-order with sequential groups (static groups): desc_act false (vLLM refuses it with
    groups) and static_groups true, read back as act-order; per-layer rules the same."""
    act32, act64 = QuantSpec(4, 32, True, act_order=True), QuantSpec(4, 64, True, act_order=True)
    weights = quantize_plan(fp16, [act32])
    for name, qw in quantize_plan(fp16, [act64]).items():
        if name.endswith("o_proj"):  # a per-layer rule
            weights[name] = qw
    write_checkpoint("gptq", tmp_path / "q", fp16, weights)
    qcfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qcfg["desc_act"] is False and qcfg["static_groups"] is True
    rules = [r for k, r in qcfg["dynamic"].items() if k.startswith("+:")]
    assert rules and all(r["desc_act"] is False and r["static_groups"] for r in rules)
    ckpt = load_quantized(tmp_path / "q")
    assert {n: s for n, s in ckpt.plan.items()} == {n: qw.spec for n, qw in weights.items()}


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_fused_modules_need_one_spec(fp16, tmp_path, fmt):
    """vLLM loads q/k/v as qkv_proj and gate/up as gate_up_proj: one spec each, or FP16 as a
    whole."""
    weights = quantize_plan(fp16, [QuantSpec(4, 32, True)])
    weights[QKV[1]] = quantize_plan(fp16, [QuantSpec(4, 64, True)])[QKV[1]]
    del weights["model.layers.1.mlp.up_proj"]  # kept FP16, its gate_proj quantized
    msg = _refused(fmt, fp16, tmp_path / "q", weights, "qkv_proj")
    assert "model.layers.1.mlp.gate_up_proj" in msg and "'fp16'" in msg
    assert "model.layers.0.self_attn.qkv_proj" in msg and "w4g64" in msg
    for name in [*QKV, "model.layers.1.mlp.gate_proj"]:  # the whole groups FP16: fine
        del weights[name]
    write_checkpoint(fmt, tmp_path / "ok", fp16, weights)


def test_fused_groups_of_every_layout():
    assert fused_group("model.layers.3.self_attn.v_proj") == "model.layers.3.self_attn.qkv_proj"
    assert fused_group("model.layers.3.mlp.up_proj") == "model.layers.3.mlp.gate_up_proj"
    assert fused_group("model.layers.3.self_attn.o_proj") is None
    assert fused_group("model.layers.3.mlp.down_proj") is None
    # Mixtral's hub names, Qwen's experts, Qwen2-MoE's shared expert (a dense MLP)
    assert (fused_group("model.layers.1.block_sparse_moe.experts.3.w2")
            == "model.layers.1.block_sparse_moe.experts")
    assert fused_group("model.layers.1.mlp.experts.0.down_proj") == "model.layers.1.mlp.experts"
    assert (fused_group("model.layers.1.mlp.shared_expert.gate_proj")
            == "model.layers.1.mlp.shared_expert.gate_up_proj")
    w4, w8 = QuantSpec(4, 32, True), QuantSpec(8, -1, True)
    experts = {f"model.layers.0.mlp.experts.{e}.{p}": w4 for e in range(4)
               for p in ("gate_proj", "up_proj", "down_proj")}
    assert fused_problems(experts, []) == []
    assert fused_problems({**experts, "model.layers.0.mlp.experts.2.down_proj": w8}, [])
    assert fused_problems(experts, ["model.layers.0.mlp.experts.4.gate_proj"])


def test_gptq_expert_rules_match_vllms_fused_moe_prefix():
    """vLLM looks an expert block's GPTQ rule up by its FusedMoE prefix; quantpipe's own reader
    by each expert's name: the pattern matches both, and no other expert."""
    pat = layer_pattern("model.layers.0.mlp.experts.3.gate_proj")
    assert re.match(pat, "model.layers.0.mlp.experts")
    assert re.match(pat, "model.layers.0.mlp.experts.3.gate_proj")
    for other in ("model.layers.0.mlp.experts.30.gate_proj", "model.layers.0.mlp.experts.3.up_proj",
                  "model.layers.10.mlp.experts", "model.layers.0.mlp.experts.3"):
        assert not re.match(pat, other), other


def test_export_stage_refuses_before_writing(tmp_path, tiny_llama_dir):
    """`quantpipe export --format gptq` of an asymmetric calibration, and an override that
    splits q/k/v, fail at export time, naming what vLLM lacks; nothing is written."""
    from quantpipe.calibration.pipeline import CalibrateSpec, calibrate
    from quantpipe.stages.export import ExportSpec, export_quantized
    from tests.tiny_models import CORPUS

    fp16 = export_tiny(tiny_llama_dir, tmp_path / "fp16")
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n\n".join(f"{p} Request {i}." for i in range(4) for p in CORPUS[:8]))
    calib = calibrate(CalibrateSpec(fp16, tmp_path / "calib", str(prompts), algo="rtn",
                                    group_size=32, sym=False, samples=4, seq_len=32,
                                    min_tokens=4, batch_size=4)).out
    with pytest.raises(ValueError, match="asymmetric: vLLM's GPTQ"):
        export_quantized(ExportSpec(calib, tmp_path / "g", 4, "gptq"))
    with pytest.raises(ValueError, match="self_attn.qkv_proj: vLLM loads 3 linears"):
        export_quantized(ExportSpec(calib, tmp_path / "c", 4, "compressed-tensors",
                                    overrides=("model.layers.0.self_attn.q_proj=8",)))
    assert not (tmp_path / "g").exists() and not (tmp_path / "c").exists()
    export_quantized(ExportSpec(calib, tmp_path / "ok", 4, "compressed-tensors",
                                overrides=(r"re:model\.layers\.0\.self_attn\.[qkv]_proj=8",)))

"""GPTQ and compressed-tensors exports: round trips and proof that real loaders read them."""

from __future__ import annotations

import json

import pytest
import torch

from quantpipe.core.formats import convert_checkpoint, load_quantized, write_checkpoint
from quantpipe.core.formats.common import read_fp_state
from quantpipe.core.qformat import QuantSpec
from tests.quantpipe.test_formats_common import export_tiny, quantize_plan, ref_decode_gptq

MIXED = [QuantSpec(4, 32, True), QuantSpec(4, 64, False), QuantSpec(8, -1, True),
         QuantSpec(8, 128, False), QuantSpec(4, 128, True)]
KEEP = ("model.layers.1.mlp.down_proj",)


@pytest.fixture(scope="module")
def fp16(tiny_llama_dir, tmp_path_factory):
    return export_tiny(tiny_llama_dir, tmp_path_factory.mktemp("fmt") / "fp16")


def _same_layers(got, weights):
    assert set(got.layers) == set(weights)
    for name, qw in weights.items():
        g = got.layers[name]
        assert g.spec == qw.spec, name
        assert torch.equal(g.q, qw.q) and torch.equal(g.scales, qw.scales), name
        assert torch.equal(g.zeros, qw.zeros), name
        assert torch.equal(g.dequantize(), qw.dequantize()), name


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_mixed_plan_round_trip(fp16, tmp_path, fmt):
    weights = quantize_plan(fp16, MIXED, skip=KEEP)
    # for_vllm=False: the plan mixes what vLLM refuses (asymmetric GPTQ, mixed q/k/v)
    manifest = write_checkpoint(fmt, tmp_path / "q", fp16, weights,
                                manifest_fields={"algorithm": "rtn"}, for_vllm=False)
    assert manifest["checkpoint_format"] == fmt and manifest["algorithm"] == "rtn"
    ckpt = load_quantized(tmp_path / "q")
    assert ckpt.checkpoint_format == fmt and ckpt.report.hashes_checked
    _same_layers(ckpt, weights)
    # the FP16-kept linear and every other tensor come back untouched
    src = read_fp_state(fp16)
    assert torch.equal(ckpt.fp_tensors[f"{KEEP[0]}.weight"], src[f"{KEEP[0]}.weight"])
    deq = ckpt.dequantized_state_dict(torch.float16)
    assert set(deq) == set(src)
    qcfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    if fmt == "gptq":
        assert qcfg == json.loads((tmp_path / "q" / "quantize_config.json").read_text())
        assert any(k.startswith("-:") and "down_proj" in k for k in qcfg["dynamic"])
        assert sum(k.startswith("+:") for k in qcfg["dynamic"]) > 0
    else:
        assert KEEP[0] in qcfg["ignore"] and "lm_head" in qcfg["ignore"]
        assert len(qcfg["config_groups"]) == len({qw.spec for qw in weights.values()})


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_bits_exact_against_reference_decoder(fp16, tmp_path, bits, group_size, sym):
    weights = quantize_plan(fp16, [QuantSpec(bits, group_size, sym)])
    write_checkpoint("gptq", tmp_path / "q", fp16, weights, for_vllm=sym)
    qcfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    state = read_fp_state(tmp_path / "q")
    for name, qw in weights.items():
        q, z, w = ref_decode_gptq(state[f"{name}.qweight"], state[f"{name}.qzeros"],
                                  state[f"{name}.scales"], state[f"{name}.g_idx"], bits,
                                  qcfg["checkpoint_format"] == "gptq")
        assert torch.equal(q, qw.q.long()) and torch.equal(z, qw.zeros.long()), name
        assert torch.equal(w.float(), qw.dequantize(torch.float32)), name


def test_gptq_act_order_and_v2(fp16, tmp_path):
    weights = quantize_plan(fp16, [QuantSpec(4, 32, False, act_order=True)], act_order_seed=7)
    name = next(iter(weights))
    weights[name].zeros[0, 0] = 0  # v1 cannot store zero 0 -> "auto" writes gptq_v2
    weights[name].q[0] = torch.where(weights[name].group_index() == 0, 0, weights[name].q[0])
    # GPTQModel's layout (desc_act, v2 zeros); vLLM refuses both (test_vllm_support.py)
    write_checkpoint("gptq", tmp_path / "q", fp16, weights, for_vllm=False)
    qcfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qcfg["checkpoint_format"] == "gptq_v2" and qcfg["desc_act"] is True
    state = read_fp_state(tmp_path / "q")
    for n, qw in weights.items():
        assert torch.equal(state[f"{n}.g_idx"], qw.g_idx)
        _, _, w = ref_decode_gptq(state[f"{n}.qweight"], state[f"{n}.qzeros"],
                                  state[f"{n}.scales"], state[f"{n}.g_idx"], 4, v1=False)
        assert torch.equal(w.float(), qw.dequantize(torch.float32))
    _same_layers(load_quantized(tmp_path / "q"), weights)
    with pytest.raises(ValueError, match="gptq_v2"):
        write_checkpoint("gptq", tmp_path / "q1", fp16, weights, checkpoint_format="gptq",
                         for_vllm=False)


def test_ct_refuses_act_order_permutation(fp16, tmp_path):
    weights = quantize_plan(fp16, [QuantSpec(4, 32, True, act_order=True)], act_order_seed=3)
    with pytest.raises(ValueError, match="--format native"):
        write_checkpoint("compressed-tensors", tmp_path / "q", fp16, weights)
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("src,dst", [("native", "gptq"), ("native", "compressed-tensors"),
                                     ("gptq", "native")])
def test_convert_checkpoint(fp16, tmp_path, src, dst):
    weights = quantize_plan(fp16, MIXED, skip=KEEP)
    # MIXED holds what vLLM refuses; the conversion itself is what is tested
    write_checkpoint(src, tmp_path / "src", fp16, weights, manifest_fields={"algorithm": "rtn"},
                     **({} if src == "native" else {"for_vllm": False}))
    manifest = convert_checkpoint(tmp_path / "src", tmp_path / "out", dst,
                                  **({} if dst == "native" else {"for_vllm": False}))
    assert manifest["checkpoint_format"] == dst
    assert manifest["converted_from"]["checkpoint_format"] == src
    assert manifest["algorithm"] == "rtn" and "source_fp16" in manifest
    original = load_quantized(tmp_path / "src")
    conv = load_quantized(tmp_path / "out")
    assert conv.checkpoint_format == dst
    _same_layers(conv, weights)
    a, b = original.dequantized_state_dict(), conv.dequantized_state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="use one of"):
        convert_checkpoint(tmp_path / "src", tmp_path / "bad", "marlin")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("sym", [True, False])
def test_compressed_tensors_library_decompresses_export(fp16, tmp_path, bits, group_size, sym):
    """The real compressed-tensors (0.20) reads config.json and decompresses every layer."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer,
    )

    spec = QuantSpec(bits, group_size, sym, act_order=group_size == 64)  # actorder "weight"
    weights = quantize_plan(fp16, [spec], skip=KEEP)
    # 8-bit asymmetric: the library reads it, vLLM does not (for_vllm=False)
    write_checkpoint("compressed-tensors", tmp_path / "q", fp16, weights,
                     for_vllm=not (bits == 8 and not sym))
    deq = CompressedTensorsDequantizer(tmp_path / "q", dtype=torch.float16)
    # validate(): decompress + fail on any quantization param left behind (untargeted layer)
    out = deq.validate(dict(read_fp_state(tmp_path / "q")))  # the library wants a dict
    for name, qw in weights.items():
        # CT computes (q - zp) * scale in the fp16 scale dtype; quantpipe in fp32 then casts.
        # (q - z) is a small integer and the product needs <= 19 significant bits, so both
        # round the same exact value once: equal in fp16.
        assert torch.equal(out[f"{name}.weight"], qw.dequantize(torch.float16)), name
    src = read_fp_state(fp16)
    assert torch.equal(out[f"{KEEP[0]}.weight"], src[f"{KEEP[0]}.weight"])


@pytest.mark.parametrize("spec", [QuantSpec(4, 32, True), QuantSpec(8, -1, False)])
def test_transformers_loads_compressed_tensors_export(fp16, tmp_path, spec):
    """transformers' compressed-tensors quantizer builds the model and decompresses it.

    transformers 5.24 decompresses every dense layer with ONE config group
    (``get_dense_scheme``), so this path is proven for uniform plans (plus FP16-kept layers);
    mixed plans are read by the compressed-tensors library itself (test above) and vLLM.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    weights = quantize_plan(fp16, [spec], skip=KEEP)
    write_checkpoint("compressed-tensors", tmp_path / "q", fp16, weights, for_vllm=spec.sym)
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "q", dtype=torch.float16,
        quantization_config=CompressedTensorsConfig(run_compressed=False),
    )
    for name, qw in weights.items():
        w = model.get_submodule(name).weight
        assert torch.equal(w.to(torch.float16), qw.dequantize(torch.float16)), name
    src = read_fp_state(fp16)
    assert torch.equal(model.get_submodule(KEEP[0]).weight.data, src[f"{KEEP[0]}.weight"])

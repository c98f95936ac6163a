"""verify_checkpoint / load_quantized: corruption is caught with clear messages, and folders made
by other tools (no quantpipe.json) are read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from quantpipe.core.formats import load_quantized, verify_checkpoint, write_checkpoint
from quantpipe.core.formats.common import read_fp_state
from quantpipe.core.qformat import QuantSpec
from tests.quantpipe.test_formats_common import export_tiny, quantize_plan, track_unpacked

LAYER = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def fp16(tiny_llama_dir, tmp_path_factory):
    return export_tiny(tiny_llama_dir, tmp_path_factory.mktemp("ver") / "fp16")


@pytest.fixture(scope="module")
def weights(fp16):
    return quantize_plan(fp16, [QuantSpec(4, 32, True), QuantSpec(8, 64, False)])


@pytest.fixture(scope="module")
def gptq_dir(fp16, weights, tmp_path_factory):
    out = tmp_path_factory.mktemp("ver") / "gptq"
    write_checkpoint("gptq", out, fp16, weights, for_vllm=False)  # w8g64-asym: GPTQModel's
    return out


def _copy(src, tmp_path):
    dst = tmp_path / "q"
    shutil.copytree(src, dst)
    return dst


def _shard_of(folder, tensor):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder / index["weight_map"][tensor]


def _edit(folder, tensor, fn):
    """Rewrite the shard holding ``tensor`` with ``fn(state)`` applied (manifest untouched)."""
    path = _shard_of(folder, tensor)
    state = load_file(path)
    fn(state)
    save_file(state, path, metadata={"format": "pt"})
    return path.name


def test_verify_ok_and_cli(gptq_dir, weights):
    from quantpipe.cli import main

    report = verify_checkpoint(gptq_dir)
    assert report.checkpoint_format == "gptq" and report.hashes_checked
    assert report.quantized_layers == len(weights)
    assert 4 < report.bits_per_weight < 9
    res = CliRunner().invoke(main, ["verify", str(gptq_dir)])
    assert res.exit_code == 0 and res.output.startswith("OK ") and "gptq" in res.output


def test_flipped_byte_is_caught(gptq_dir, tmp_path):
    q = _copy(gptq_dir, tmp_path)
    shard = _shard_of(q, f"{LAYER}.qweight")
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0x01  # inside the tensor data: the header stays readable
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError) as err:
        load_quantized(q)
    msg = str(err.value)
    assert "sha256" in msg and shard.name in msg and "nothing was loaded" in msg
    from quantpipe.cli import main

    res = CliRunner().invoke(main, ["verify", str(q)])
    assert res.exit_code == 1 and "sha256" in res.output


def test_missing_tensor_is_caught(gptq_dir, tmp_path):
    q = _copy(gptq_dir, tmp_path)
    shard = _edit(q, f"{LAYER}.scales", lambda s: s.pop(f"{LAYER}.scales"))
    with pytest.raises(ValueError) as err:
        verify_checkpoint(q)
    msg = str(err.value)
    assert f"missing tensor {LAYER}.scales (expected float16 [1, 64], spec w8g64-asym)" in msg
    # every problem is listed, not just the first: the rewritten shard's size changed too
    assert f"{shard}: " in msg and "manifest says" in msg and "2 problem(s)" in msg


def test_wrong_shape_is_caught(gptq_dir, tmp_path):
    q = _copy(gptq_dir, tmp_path)

    def cut(s):
        s[f"{LAYER}.scales"] = s[f"{LAYER}.scales"][:, :32].clone()

    shard = _edit(q, f"{LAYER}.scales", cut)
    with pytest.raises(ValueError) as err:
        verify_checkpoint(q)
    assert (f"{shard}: {LAYER}.scales is float16 [1, 32], expected float16 [1, 64] "
            "(spec w8g64-asym)") in str(err.value)


def test_nan_scale_is_caught(gptq_dir, tmp_path):
    q = _copy(gptq_dir, tmp_path)

    def nan(s):
        s[f"{LAYER}.scales"][0, 3] = float("nan")
        s[f"{LAYER}.scales"][0, 5] = -1.0

    shard = _edit(q, f"{LAYER}.scales", nan)
    with pytest.raises(ValueError) as err:
        verify_checkpoint(q)
    assert (f"{shard}: {LAYER}.scales: 1 non-finite and 1 non-positive scale(s) "
            "(expected finite values > 0)") in str(err.value)


def test_manifest_plan_must_match_config(fp16, weights, tmp_path):
    write_checkpoint("native", tmp_path / "n", fp16, weights)
    cfg_path = tmp_path / "n" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"]["layers"][LAYER]["group_size"] = 32
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="plan differs from config.json for 1 layer"):
        verify_checkpoint(tmp_path / "n")


# ---- folders made by other tools: tensors written by hand from the format description ------


def _pack_rows(v: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack along dim 0, LSB first (hand-written for the fixtures): [n, m] -> [n*bits/32, m]."""
    pf = 32 // bits
    v = v.to(torch.int64)
    words = torch.zeros(v.shape[0] // pf, v.shape[1], dtype=torch.int64)
    for j in range(pf):
        words |= v[j::pf] << (bits * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _fp_state_without(fp16, weights):
    state = read_fp_state(fp16)
    return {k: v for k, v in state.items() if k[:-7] not in weights}


def test_reads_autogptq_style_folder(fp16, tmp_path):
    """AutoGPTQ layout: no quantpipe.json, no checkpoint_format key (v1), single file."""
    weights = quantize_plan(fp16, [QuantSpec(4, 32, True), QuantSpec(4, 32, False)])
    state = _fp_state_without(fp16, weights)
    for name, qw in weights.items():
        state[f"{name}.qweight"] = _pack_rows(qw.q.t(), 4)  # [in/8, out]
        state[f"{name}.qzeros"] = _pack_rows(qw.zeros.long() - 1, 4).t().contiguous()  # [G, out/8]
        state[f"{name}.scales"] = qw.scales.t().contiguous()  # [G, out]
        state[f"{name}.g_idx"] = (torch.arange(qw.shape[1]) // 32).to(torch.int32)
    folder = tmp_path / "autogptq"
    folder.mkdir()
    save_file(state, folder / "model.safetensors")
    cfg = json.loads((fp16 / "config.json").read_text())
    # asymmetric default; the sym layers are declared with a "+:" dynamic override
    sym = [n for n, qw in weights.items() if qw.spec.sym]
    cfg["quantization_config"] = {
        "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False,
        "dynamic": {f"+:^{n.replace('.', '[.]')}$": {"sym": True} for n in sym},
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    ckpt = load_quantized(folder)
    assert ckpt.manifest is None and not ckpt.report.hashes_checked
    for name, qw in weights.items():
        assert ckpt.plan[name] == qw.spec
        assert torch.equal(ckpt.layers[name].dequantize(), qw.dequantize()), name
    # still validated without a manifest: a wrong-dtype scale is reported
    state[f"{LAYER}.scales"] = state[f"{LAYER}.scales"].float()
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors: .*q_proj.scales is float32"):
        load_quantized(folder)


def test_reads_llm_compressor_style_folder(fp16, tmp_path):
    """compressed-tensors layout packed with the library's own packer, targets ["Linear"]."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    weights = quantize_plan(fp16, [QuantSpec(4, 64, False)])
    state = _fp_state_without(fp16, weights)
    for name, qw in weights.items():
        signed = (qw.q.to(torch.int16) - 8).to(torch.int8)
        state[f"{name}.weight_packed"] = pack_to_int32(signed, 4)
        state[f"{name}.weight_scale"] = qw.scales
        state[f"{name}.weight_shape"] = torch.tensor(qw.shape)
        state[f"{name}.weight_zero_point"] = pack_to_int32(
            (qw.zeros.to(torch.int16) - 8).to(torch.int8), 4, packed_dim=0)
    folder = tmp_path / "llmc"
    folder.mkdir()
    save_file(state, folder / "model.safetensors")
    cfg = json.loads((fp16 / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
            "group_size": 64}}},
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    ckpt = load_quantized(folder)
    assert ckpt.checkpoint_format == "compressed-tensors"
    for name, qw in weights.items():
        assert torch.equal(ckpt.layers[name].dequantize(), qw.dequantize()), name
    # a missing tensor in a foreign folder names the layer and what was expected
    state.pop(f"{LAYER}.weight_zero_point")
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ValueError, match=f"missing tensor {LAYER}.weight_zero_point"):
        load_quantized(folder)


def test_verify_and_load_hold_one_unpacked_layer_at_a_time(gptq_dir, weights, monkeypatch):
    """A 7B model's unpacked weights do not fit beside its packed ones: layers stream."""
    peak = track_unpacked(monkeypatch)
    verify_checkpoint(gptq_dir)
    assert peak[0] == 1, f"verify held {peak[0]} unpacked layers at once"
    ckpt = load_quantized(gptq_dir)
    for name in ckpt.layers:  # the consumer converts and drops each layer
        assert ckpt.layers[name].shape == weights[name].shape
    assert peak[0] <= 2, f"loading held {peak[0]} unpacked layers at once"


def test_truncated_shard_is_one_problem_not_one_per_tensor(gptq_dir, tmp_path):
    q = _copy(gptq_dir, tmp_path)
    shard = _shard_of(q, f"{LAYER}.qweight")
    shard.write_bytes(shard.read_bytes()[:100])  # the header itself is cut
    with pytest.raises(ValueError) as err:
        verify_checkpoint(q)
    msg = str(err.value)
    assert f"{shard}: not a readable safetensors file" in msg
    assert "missing tensor" not in msg and "per-layer checks skipped" in msg
    assert "3 problem(s)" in msg  # size differs from the manifest, unreadable, checks skipped

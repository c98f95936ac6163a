"""An FP16 export served on CPU keeps its linear layers' fp16 weights (runtime.fp_head.
set_half_linears, via runtime.engine.loading): against a float64 model of the same weights."""

from __future__ import annotations

import pytest
import torch

from quantpipe.core.families import FAMILIES
from quantpipe.runtime import fp_head
from quantpipe.runtime.engine import load_model_for_serving, loading
from quantpipe.runtime.fp_head import HalfLinear
from quantpipe.runtime.kernels import cpu_ext
from tests.tiny_models import make_family_model, save_model

KERNEL = cpu_ext.kernel_status()[0]
IDS = torch.arange(3, 40)[None]  # [1, 37]


def _fp16_folder(family: str, tmp_path):
    """(FP16 folder, the float64 model of its weights)."""
    model, tok = make_family_model(family)
    folder = save_model(model, tok, tmp_path / family, dtype=torch.float16)
    ref = model.double()  # save_model cast it to fp16 in place: the stored weights, widened
    return folder, ref


def _linears(model):
    return {n: m for n, m in model.named_modules()
            if isinstance(m, (torch.nn.Linear, HalfLinear))
            and m is not model.get_output_embeddings()}


@pytest.mark.skipif(not KERNEL, reason="quantpipe's CPU kernels are not usable here")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp16_folder_runs_its_linears_on_the_fp16_weights(family, tmp_path):
    folder, ref = _fp16_folder(family, tmp_path)
    model, _ = load_model_for_serving(folder, "cpu", torch.float32, head_dtype="fp16")
    layers = _linears(model)
    # every q/k/v/o and MLP projection, none left in fp32
    assert layers and all(isinstance(m, HalfLinear) and m.kernel and m.mode == "fp16"
                          for m in layers.values()), layers
    ref_layers = _linears(ref)
    assert layers.keys() == ref_layers.keys()
    for name, m in layers.items():  # the stored weights exactly, blocked for fp16_mm
        w = m.w16.transpose(1, 2).reshape(-1, m.in_features)[:m.out_features]
        assert w.dtype == torch.float16
        assert torch.equal(w.double(), ref_layers[name].weight), name
        if ref_layers[name].bias is not None:  # Qwen2's q/k/v biases
            assert torch.equal(m.bias.double(), ref_layers[name].bias), name
    fp32, _ = load_model_for_serving(folder, "cpu", torch.float32, head_dtype="fp32")
    # torch's grouped matmul of the MoE experts takes no float64: those compare with fp32 only
    _check_logits(model, None if FAMILIES[family].moe else ref, fp32)


def _check_logits(model, ref, fp32=None):
    """model's logits against the float64 model of its weights (the tiny llama in fp32 is
    1.4e-4 from it: its RoPE tables), and against ``fp32``, the same folder loaded in fp32."""
    with torch.no_grad():
        got = model(IDS).logits.double()
        want = None if ref is None else ref(IDS).logits
        want32 = None if fp32 is None else fp32(IDS).logits.double()
    if want is not None:
        assert (got - want).norm() / want.norm() < 1e-3
    if want32 is not None:  # only the order of fp32 sums differs: ~1e-6 relative
        rel = (got - want32).norm() / want32.norm()
        assert rel < 1e-5, float(rel)


def test_without_the_kernels_or_with_an_fp32_head_the_linears_are_fp32(tmp_path, monkeypatch):
    folder, ref = _fp16_folder("llama", tmp_path)
    monkeypatch.setattr(loading.cpu_ext, "kernel_status", lambda: (False, "test says no"))
    monkeypatch.setattr(fp_head.cpu_ext, "kernel_status", lambda: (False, "test says no"))
    model, _ = load_model_for_serving(folder, "cpu", torch.float32, head_dtype="fp16")
    assert all(type(m) is torch.nn.Linear and m.weight.dtype == torch.float32
               for m in _linears(model).values())
    monkeypatch.undo()
    model, _ = load_model_for_serving(folder, "cpu", torch.float32, head_dtype="fp32")
    assert all(type(m) is torch.nn.Linear and m.weight.dtype == torch.float32
               for m in _linears(model).values())
    _check_logits(model, ref)


def test_set_half_linears_refuses_without_the_kernels(monkeypatch):
    monkeypatch.setattr(fp_head.cpu_ext, "kernel_status", lambda: (False, "test says no"))
    model, _ = make_family_model("llama")
    with pytest.raises(RuntimeError, match="test says no"):
        fp_head.set_half_linears(model.half())

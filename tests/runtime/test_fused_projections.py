"""The engine's fused W4A8 projections (q/k/v and gate/up as one matmul each, silu(gate) * up as
one op) against the same model run layer by layer, on each ISA build this CPU runs."""

from __future__ import annotations

import pytest
import torch

from quantpipe.core.qformat import QuantSpec
from quantpipe.runtime.engine import load_model_for_serving
from quantpipe.runtime.engine.model_runner import FusedProjections, ModelRunner, SeqChunk
from quantpipe.runtime.kernels import cpu_ext
from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16
from tests.runtime._quant_helpers import quantize_folder

ISAS = [pytest.param(isa, marks=pytest.mark.skipif(not cpu_ext.cpu_can_run(isa),
                                                   reason=f"the CPU cannot run the {isa} build"))
        for isa in cpu_ext.ISAS]


@pytest.fixture(scope="module")
def qdir(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fused")
    export_fp16(Fp16ExportSpec(str(tiny_llama_dir), tmp / "fp16"))
    quantize_folder(tmp / "fp16", tmp / "q", [QuantSpec(4, 32, False)])
    return tmp / "q"


@pytest.mark.parametrize("isa", ISAS)
def test_fused_projections_match_the_layer_by_layer_run(isa, qdir, monkeypatch):
    for name in (cpu_ext.ENV, "QUANTPIPE_CPU_INT4_ACT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(cpu_ext.ISA_ENV, isa)
    cpu_ext.reset()
    try:
        model, tok = load_model_for_serving(qdir, "cpu", torch.float32)
        fused = ModelRunner(model, block_size=4, num_blocks=16)
        assert fused.fused, fused.fused_reason
        assert all(p.qkv is not None and p.gate_up is not None for p in fused.projections)
        # the parts now run from views into the fused tensors: the weights are held once
        layer0 = fused.layers[0]
        assert (layer0.self_attn.k_proj._w.packed.untyped_storage().data_ptr()
                == fused.projections[0].qkv.packed.untyped_storage().data_ptr())
        plain = ModelRunner(model, block_size=4, num_blocks=16)
        plain.projections = [FusedProjections(None, None) for _ in plain.layers]
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(3, len(tok), (7,), generator=g).tolist()
        # a 7-token prefill (T > 1: column slices copied) then a decode step (T == 1)
        steps = [[SeqChunk(prompt, 0, [0, 1])], [SeqChunk([prompt[-1]], 7, [0, 1])]]
        for chunks in steps:
            got, want = fused.forward(chunks), plain.forward(chunks)  # [1, vocab] fp32
            # identical matmuls (activations quantized per row and 32 columns either way);
            # only silu(gate) * up differs in rounding
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    finally:
        monkeypatch.undo()
        cpu_ext.reset()


@pytest.mark.parametrize("isa", ISAS)
def test_layers_that_differ_are_not_fused(isa):
    from quantpipe.runtime.kernels import cpu as cpu_kernels
    from tests.runtime._quant_helpers import random_packed

    assert cpu_ext.build_status(isa)[0]
    a = cpu_kernels.repack_w4a8(random_packed(32, 128, QuantSpec(4, 32, True), 1), isa)
    b = cpu_kernels.repack_w4a8(random_packed(16, 128, QuantSpec(4, 64, True), 2), isa)
    c = cpu_kernels.repack_w4a8(random_packed(16, 128, QuantSpec(4, 32, False), 3), isa)
    assert cpu_kernels.concat_w4a8([a, b]) is None  # group sizes differ
    both = cpu_kernels.concat_w4a8([a, c])
    assert both.packed.shape == (3, 16, 64)
    x = torch.randn(3, 128)
    torch.testing.assert_close(cpu_kernels.w4a8_matmul(x, both),
                               torch.cat([cpu_kernels.w4a8_matmul(x, a),
                                          cpu_kernels.w4a8_matmul(x, c)], 1), rtol=0, atol=0)

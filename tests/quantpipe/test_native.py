import torch
from transformers import AutoModelForCausalLM

from quantpipe.core.formats.loader import load_dequantized_model
from quantpipe.core.formats.native import read_native
from quantpipe.core.formats.writers import write_checkpoint
from quantpipe.core.qformat import QuantSpec
from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16
from tests.runtime._quant_helpers import rtn


def test_native_round_trip(tiny_llama_dir, tmp_path):
    fp16 = tmp_path / "fp16"
    export_fp16(Fp16ExportSpec(str(tiny_llama_dir), fp16))
    ref = AutoModelForCausalLM.from_pretrained(fp16, dtype=torch.float32)
    specs = [QuantSpec(4, 32, True), QuantSpec(4, 64, False), QuantSpec(8, -1, True)]
    weights = {}
    for i, (name, mod) in enumerate(ref.named_modules()):
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            weights[name] = rtn(mod.weight.data, specs[i % len(specs)])
    write_checkpoint("native", tmp_path / "q", fp16, weights)
    ckpt = read_native(tmp_path / "q")
    for name, qw in weights.items():
        got = ckpt.quantized_weight(name)
        assert torch.equal(got.q, qw.q) and torch.equal(got.scales, qw.scales)
        assert torch.equal(got.dequantize(), qw.dequantize())
    model = load_dequantized_model(tmp_path / "q")
    for name, qw in weights.items():
        w = model.get_submodule(name).weight
        assert torch.equal(w, qw.dequantize(torch.float32))
    # the reference model with the same dequantized weights computes the same logits
    with torch.no_grad():
        for name, qw in weights.items():
            ref.get_submodule(name).weight.copy_(qw.dequantize(torch.float32))
        ids = torch.arange(10)[None]
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=1e-5)

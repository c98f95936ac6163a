"""The engine over a quantized (QuantLinear) model from runtime.loader: same tokens as HF greedy."""

from __future__ import annotations

import pytest
import torch

from quantpipe.core.qformat import QuantSpec
from quantpipe.runtime.engine import EngineConfig, LLMEngine, SamplingParams, load_model_for_serving
from quantpipe.runtime.quant_linear import QuantLinear
from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16
from tests.runtime._quant_helpers import quantize_folder


@pytest.mark.parametrize("specs", [
    [QuantSpec(4, 32, True)],
    # a mixed plan with INT5 / INT6 layers (run as INT8) beside INT4 ones
    [QuantSpec(4, 32, True), QuantSpec(5, 64, False), QuantSpec(6, 32, True)],
], ids=["int4", "int4-5-6"])
def test_quantized_folder_serves_and_matches_hf_greedy(tiny_llama_dir, tmp_path, monkeypatch,
                                                       specs):
    # token for token needs the same arithmetic for every row: on an AMX CPU a step of 32 rows
    # or more runs the 4-bit layers in bf16 (runtime/kernels/csrc/cpu_ops.cpp), and the engine
    # batches and chunks these prompts differently from HF's one-prompt-at-a-time generate
    monkeypatch.setenv("QUANTPIPE_CPU_AMX", "0")
    fp16 = tmp_path / "fp16"
    export_fp16(Fp16ExportSpec(str(tiny_llama_dir), fp16))
    quantize_folder(fp16, tmp_path / "q", specs)
    model, tok = load_model_for_serving(tmp_path / "q", "cpu", torch.float32)
    stored = {m.spec.bits for m in model.modules() if isinstance(m, QuantLinear)}
    assert stored == {s.bits for s in specs}
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, len(tok), (n,), generator=g).tolist() for n in (4, 19, 33)]
    ref = [model.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8,
                          do_sample=False)[0, len(p):].tolist() for p in prompts]
    eng = LLMEngine(model, tok, EngineConfig(block_size=4, max_num_seqs=4,
                                             max_num_batched_tokens=64, kv_cache_memory=2**20))
    assert eng.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True)) == ref
    assert eng.pool.num_used == 0

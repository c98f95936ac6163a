"""build_causal_lm: the one state-dict -> transformers model path (dequantized reference and
runtime loader)."""

import pytest
import torch

from quantpipe.core.hf_model import build_causal_lm
from tests.tiny_models import make_model


@pytest.mark.parametrize("tie", [True, False])
def test_same_logits_and_the_tensors_become_the_parameters(tie):
    ref, _ = make_model("llama", tie=tie)
    config = ref.config.to_dict()
    state = {k: v.clone() for k, v in ref.state_dict().items()
             if not (tie and k == "lm_head.weight")}  # tied: stored once
    embed = state["model.embed_tokens.weight"]
    model = build_causal_lm(config, state.items(), torch.float32, where="tiny")
    assert model.get_input_embeddings().weight.data_ptr() == embed.data_ptr()  # no copy
    if tie:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    ids = torch.arange(12)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_missing_tensor_and_non_linear_replacement_are_errors():
    ref, _ = make_model("llama")
    config = {**ref.config.to_dict(), "quantization_config": {"quant_method": "x"}}
    state = dict(ref.state_dict())
    del state["model.norm.weight"]
    with pytest.raises(ValueError, match=r"tiny: missing tensors \['model.norm.weight'\]"):
        build_causal_lm(config, state.items(), torch.float32, where="tiny")
    with pytest.raises(ValueError, match="model.norm is not an nn.Linear"):
        build_causal_lm(config, ref.state_dict().items(), torch.float32, where="tiny",
                        modules=[("model.norm", torch.nn.Identity())])

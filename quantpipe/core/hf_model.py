"""Build a transformers causal LM from a config.json and tensors: the one place quantpipe turns
a state dict into a model (the dequantized reference of ``eval``/``report`` and the runtime's
QuantLinear model alike)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from quantpipe.core.heap import release_freed_memory


def build_causal_lm(
    config: dict,
    tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    *,
    device: str | torch.device = "cpu",
    modules: Iterable[tuple[str, torch.nn.Module]] = (),
    where: str | Path = "checkpoint",
    keep_fp16_embeddings: bool = False,
    keep_fp16_linears: bool = False,
):
    """A transformers causal LM (eval mode) on ``device`` holding ``tensors`` and ``modules``.

    The model is built with its parameters on the meta device (buffers such as rotary
    ``inv_freq`` stay real), so no weight is allocated before its tensor arrives:
    ``modules`` (``(name, module)`` pairs, e.g. QuantLinear layers made one at a time) replace
    ``nn.Linear`` layers as they are produced; ``tensors`` (``(name, tensor)`` pairs under HF
    names; floating ones are cast to ``dtype``) become the parameters themselves
    (``assign=True``: the model never holds a weight twice). ``config``'s
    ``quantization_config`` is dropped. Tied embeddings are tied again; a missing, unexpected
    or never-loaded tensor is a ValueError naming ``where``. ``keep_fp16_embeddings``: an
    fp16 input embedding table or output head stays fp16 (the CPU runtime's fp16 head computes
    in fp32 from them: no fp32 copy of the largest tensors is ever made).
    ``keep_fp16_linears``: the fp16 weights of every ``nn.Linear`` stay fp16 too (the CPU
    runtime's ``set_half_linears`` runs them as stored, fp32 sums).
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device(device)
    hf_config = AutoConfig.for_model(
        **{k: v for k, v in config.items() if k != "quantization_config"})
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, trust_remote_code=False)
    for name, module in modules:  # consumed one at a time: the caller may build them lazily
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if not isinstance(getattr(parent, child, None), torch.nn.Linear):
            raise ValueError(f"{where}: quantized layer {name} is not an nn.Linear of "
                             f"{type(model).__name__}")
        setattr(parent, child, module)
        # the layer's unpacking temporaries are freed by now: return them to the OS before
        # the next layer is built, or the freed heap grows with the model (glibc keeps it)
        release_freed_memory()
    keep = _embedding_names(model) if keep_fp16_embeddings else set()
    if keep_fp16_linears:
        keep |= {f"{n}.weight" for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear)}

    def cast(name: str, v: torch.Tensor) -> torch.Tensor:
        if not v.is_floating_point() or (name in keep and v.dtype == torch.float16):
            return v.to(device)
        return v.to(device=device, dtype=dtype)

    state = {k: cast(k, v) for k, v in tensors}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    del state
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    missing = [k for k in missing if not (k == "lm_head.weight" and tied)]
    if missing or unexpected:
        raise ValueError(f"{where}: missing tensors {missing[:5]}, unexpected {unexpected[:5]}")
    # a head given in ``modules`` (a quantized head made from a quantized table) is tied by
    # the caller; an nn.Linear head is tied here
    if tied and isinstance(model.get_output_embeddings(), torch.nn.Linear):
        model.tie_weights()  # the meta skeleton's head is not tied to the loaded embeddings
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.to(device)  # non-persistent buffers (rotary inv_freq) were built on the CPU
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{where}: tensors never loaded: {left[:5]}")
    return model.eval()


def _embedding_names(model: torch.nn.Module) -> set[str]:
    """State-dict names of the input embedding table and the output head's weight."""
    tables = [m.weight for m in (model.get_input_embeddings(), model.get_output_embeddings())
              if m is not None and getattr(m, "weight", None) is not None]
    return {n for n, p in model.named_parameters(remove_duplicate=False)
            if any(p is t for t in tables)}

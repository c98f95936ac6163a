"""Tiny GGUF files written from tiny HF models as llama.cpp's converter lays them out (tensor
names, MoE experts as 3-D ``ffn_*_exps`` tensors, Llama's q/k row permutation, a GPT-2 style
tokenizer in the metadata), for tests of quantpipe's GGUF reading (no llama.cpp needed)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

# model_type -> the GGUF architecture llama.cpp writes (Mixtral is a Llama with experts there)
GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
             "llama": "llama", "qwen2": "qwen2"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``LlamaModel.permute`` of q/k rows (transformers'
    LlamaTensorProcessor undoes it)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _gguf_tensors(model, arch: str) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, fp32 array) of every tensor of ``model``, in its state-dict order."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    cfg = model.config
    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    name_map = get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    out = []
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = t.detach().float().numpy()
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", name)
        if m:  # [E, 2I, H] -> ffn_gate_exps [E, I, H] + ffn_up_exps; [E, H, I] -> ffn_down_exps
            blk = f"blk.{m.group(1)}"
            if m.group(2) == "down_proj":
                out.append((f"{blk}.ffn_down_exps.weight", w))
            else:
                inter = w.shape[1] // 2
                out += [(f"{blk}.ffn_gate_exps.weight", w[:, :inter]),
                        (f"{blk}.ffn_up_exps.weight", w[:, inter:])]
            continue
        base, _, suffix = name.rpartition(".")
        gguf_name = name_map.get_name(base)
        assert gguf_name is not None, name
        if arch == "llama" and gguf_name.endswith((".attn_q", ".attn_k")):
            heads = cfg.num_attention_heads if gguf_name.endswith("q") else cfg.num_key_value_heads
            w = _permute(w, heads)
        if gguf_name.endswith("ffn_gate_inp_shexp"):
            w = w.reshape(-1)  # [1, H] is stored as [H]
        out.append((f"{gguf_name}.{suffix}", w))
    return out


def _write_config(writer, cfg, arch: str) -> None:
    a = arch
    writer.add_uint32(f"{a}.context_length", cfg.max_position_embeddings)
    writer.add_uint32(f"{a}.block_count", cfg.num_hidden_layers)
    writer.add_uint32(f"{a}.embedding_length", cfg.hidden_size)
    writer.add_uint32(f"{a}.feed_forward_length", cfg.intermediate_size)
    writer.add_uint32(f"{a}.attention.head_count", cfg.num_attention_heads)
    writer.add_uint32(f"{a}.attention.head_count_kv", cfg.num_key_value_heads)
    writer.add_uint32(f"{a}.attention.key_length", cfg.head_dim)
    writer.add_uint32(f"{a}.attention.value_length", cfg.head_dim)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    writer.add_float32(f"{a}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    if arch == "llama":
        writer.add_uint32(f"{a}.rope.dimension_count", cfg.head_dim)
    writer.add_uint32(f"{a}.vocab_size", cfg.vocab_size)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        writer.add_uint32(f"{a}.expert_count", experts)
        writer.add_uint32(f"{a}.expert_used_count", cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        writer.add_uint32(f"{a}.expert_feed_forward_length", cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        writer.add_uint32(f"{a}.expert_shared_feed_forward_length",
                          cfg.shared_expert_intermediate_size)


def _write_tokenizer(writer, tok) -> None:
    """A GPT-2 style BPE vocabulary (tokens, merges, special ids) from a fast tokenizer."""
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    special = {a["content"] for a in spec["added_tokens"]}
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "default")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [3 if t in special else 1 for t in tokens])
    writer.add_array("tokenizer.ggml.merges", merges)
    writer.add_uint32("tokenizer.ggml.bos_token_id", tok.bos_token_id)
    writer.add_uint32("tokenizer.ggml.eos_token_id", tok.eos_token_id)
    writer.add_uint32("tokenizer.ggml.padding_token_id", tok.pad_token_id)


def save_gguf(model, tok, path: Path, expert_qtype: str = "F32", name: str = "tiny") -> Path:
    """Write ``model`` (a tiny HF causal LM) as a GGUF file at ``path``: every tensor F32,
    except 3-D expert tensors in ``expert_qtype`` (e.g. "Q8_0", "F16")."""
    from gguf import GGMLQuantizationType, GGUFWriter, quantize

    arch = GGUF_ARCH[model.config.model_type]
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(path), arch)
    writer.add_name(name)
    _write_config(writer, model.config, arch)
    _write_tokenizer(writer, tok)
    qtype = GGMLQuantizationType[expert_qtype]
    for gguf_name, w in _gguf_tensors(model, arch):
        w = np.ascontiguousarray(w, dtype=np.float32)
        if w.ndim == 3 and qtype != GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_moe_for_gguf(model_type: str, seed: int = 0):
    """A tiny random MoE model whose expert widths are the ones transformers' GGUF loader
    assumes (it reads no ``expert_feed_forward_length``: the config class defaults)."""
    from tests.tiny_models import make_family_model

    over = {"qwen2_moe": dict(moe_intermediate_size=1408, shared_expert_intermediate_size=5632),
            "qwen3_moe": dict(moe_intermediate_size=768)}.get(model_type, {})
    model, tok = make_family_model(model_type, seed=seed, **over)
    with torch.no_grad():  # wide experts: smaller weights keep the activations in range
        for name, p in model.named_parameters():
            if p.dim() == 3 or "shared_expert." in name:
                p.mul_(0.25)
    return model, tok

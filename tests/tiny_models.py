"""Tiny random causal LMs and a tiny tokenizer, built from configs (no hub access)."""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "Please summarise the attached contract and list the termination clauses.",
    "The customer reports that the invoice total does not match the purchase order.",
    "Extract the fields name, date and amount from the following receipt as JSON.",
    "SELECT customer_id, SUM(amount) FROM orders GROUP BY customer_id;",
    "Dear team, the quarterly revenue grew by 12 percent compared with last year.",
    "请总结以下合同的主要条款，并列出付款条件。",
    "def total(items): return sum(item.price for item in items)",
    "Our refund policy allows returns within 30 days of delivery.",
] * 4


def make_tokenizer(vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "<|im_end|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="<|im_end|>",
        pad_token="<|im_end|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_config(family: str, vocab_size: int, tie: bool = True, **over):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    common.update(over)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(family)


def make_model(family: str = "llama", seed: int = 0, tie: bool = True, **over):
    """A tiny random model whose weights are scaled so that outputs are not degenerate."""
    from transformers import AutoModelForCausalLM

    tok = make_tokenizer()
    cfg = make_config(family, len(tok), tie=tie, **over)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.02)
    model.eval()
    return model, tok


def save_model(model, tok, folder: Path, dtype: torch.dtype = torch.float32) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


# Per-family extras of the tiny configs in FAMILY_CONFIGS: each exercises what the family adds
# over Llama (small sliding windows and soft-caps so that they change the result).
FAMILY_CONFIGS: dict[str, dict] = {
    # Llama 3.x RoPE scaling (rope_type llama3): frequencies below the original context rescaled
    "llama": dict(rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                       low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=16)),
    "mistral": dict(sliding_window=16),  # every layer sliding
    "qwen2": {},  # q/k/v biases
    "qwen3": {},  # q_norm / k_norm per head
    "gemma": {},  # (1 + w) norms, scaled embeddings
    "gemma2": dict(sliding_window=8, query_pre_attn_scalar=32, attn_logit_softcapping=2.0,
                   final_logit_softcapping=5.0),
    "gemma3_text": dict(sliding_window=8, query_pre_attn_scalar=32,
                        layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(partial_rotary_factor=0.5),  # fused qkv_proj / gate_up_proj, partial RoPE
    # MoE: 4 experts, top-2, experts 32 wide. Mixtral renormalises the top-k weights always,
    # Qwen only with norm_topk_prob (off for qwen2_moe, on for qwen3_moe: both paths run)
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True),
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def make_family_model(model_type: str, seed: int = 0, **over):
    """A tiny random model of any registry family (config class via AutoConfig.for_model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = make_tokenizer()
    kw = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    kw.update(FAMILY_CONFIGS.get(model_type, {}))
    kw.update(over)
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    one_plus = model_type.startswith("gemma")  # gain (1 + w): keep it near 1 as well
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() in (2, 3):  # 3-D: a MoE block's experts [E, out, in]
                p.normal_(0.0, 0.08)
            elif "norm" in name:
                p.copy_((0.0 if one_plus else 1.0) + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.02)
    model.eval()
    return model, tok


@torch.no_grad()
def hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    """Greedy tokens from full forwards (argmax of the last logits): no generation-config
    processors (``min_new_tokens`` would mask EOS, which the engine's ignore_eos does not)."""
    ids = list(prompt)
    for _ in range(new):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]

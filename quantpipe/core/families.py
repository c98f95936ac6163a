"""Model families as data: the one table calibration, the formats and the runtime engine read.

A family is keyed by the Hugging Face ``model_type``. Its entry says where the decoder blocks
are, which linears share an input (one Hessian / one AWQ scale per group) and the op producing
that input (where AWQ folds its scales), and what the engine must do differently from Llama:
the norm's gain ((1 + w) or w), norms around the attention and MLP outputs, per-head q/k norms,
fused projections, and attention extras (query scale, logit soft-capping, sliding windows,
embedding scale). Module names inside a block are relative to that block; every family here
names its block parts ``input_layernorm``, ``self_attn`` (``o_proj``) and ``mlp``
(``down_proj``), the Llama layout.

Adding a family is one ``Family(...)`` line in ``FAMILIES`` plus its tests (docs/families.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class InputGroup:
    linears: tuple[str, ...]  # linears reading the same input, e.g. q/k/v
    prev_op: str  # module producing that input: a norm (scale its weight) or a linear (its rows)
    inspect: str  # module whose output AWQ compares ("" = the linears themselves)


@dataclass(frozen=True)
class Family:
    """Per-family facts; the defaults are Llama's."""

    groups: tuple[InputGroup, ...]  # input groups of one block, in execution order
    blocks: str = "model.layers"  # attribute path of the decoder block list
    decoder: str = "model"  # attribute path of the decoder (embed_tokens, rotary_emb, norm)
    final_norm: str = "norm"  # the decoder's last norm, relative to the decoder
    one_plus_norm: bool = False  # RMSNorm gain is (1 + weight) (Gemma), not weight
    norm_eps: str = "variance_epsilon"  # attribute of a norm module holding its epsilon
    attn_out_norm: str | None = None  # norm of the attention output before the residual add
    mlp_in_norm: str = "post_attention_layernorm"  # norm feeding the MLP
    mlp_out_norm: str | None = None  # norm of the MLP output before the residual add
    qk_norm: bool = False  # self_attn.q_norm / k_norm: RMSNorm per head before RoPE (Qwen3)
    qkv_proj: str | None = None  # one fused q/k/v linear (rows q, k, v), relative to the block
    gate_up_proj: str | None = None  # one fused gate/up linear (rows gate, up)
    query_scale: str | None = None  # config field s: attention scale s**-0.5, not head_dim**-0.5
    attn_softcap: str | None = None  # config field c: scores -> c * tanh(scores / c)
    final_softcap: str | None = None  # config field c: logits -> c * tanh(logits / c)
    rope_per_layer_type: bool = False  # rotary_emb(x, pos, layer_type): one RoPE per layer type

    def __post_init__(self) -> None:
        for g in self.groups:
            if not g.linears:
                raise ValueError(f"{self.blocks}: an input group needs at least one linear")


_LLAMA_GROUPS = (
    InputGroup(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "input_layernorm", "self_attn"),
    InputGroup(("self_attn.o_proj",), "self_attn.v_proj", ""),
    InputGroup(("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm", "mlp"),
    InputGroup(("mlp.down_proj",), "mlp.up_proj", ""),
)

# Gemma 2 / 3: the MLP reads pre_feedforward_layernorm's output; post_attention_layernorm scales
# the attention output before the residual add, so AWQ must not fold MLP scales into it
_GEMMA2_GROUPS = (
    _LLAMA_GROUPS[0],
    _LLAMA_GROUPS[1],
    InputGroup(("mlp.gate_proj", "mlp.up_proj"), "pre_feedforward_layernorm", "mlp"),
    _LLAMA_GROUPS[3],
)

# Phi-3: q/k/v and gate/up are single linears. o_proj reads only the v rows of qkv_proj and
# down_proj only the up half of gate_up_proj, so those two groups cannot fold into their
# producer as a whole (its out_features differ from their in_features: calibration skips and
# reports the fold)
_PHI3_GROUPS = (
    InputGroup(("self_attn.qkv_proj",), "input_layernorm", "self_attn"),
    InputGroup(("self_attn.o_proj",), "self_attn.qkv_proj", ""),
    InputGroup(("mlp.gate_up_proj",), "post_attention_layernorm", "mlp"),
    InputGroup(("mlp.down_proj",), "mlp.gate_up_proj", ""),
)

_GEMMA_COMMON = dict(one_plus_norm=True, norm_eps="eps",
                     query_scale="query_pre_attn_scalar")
_GEMMA2_COMMON = dict(_GEMMA_COMMON, attn_out_norm="post_attention_layernorm",
                      mlp_in_norm="pre_feedforward_layernorm",
                      mlp_out_norm="post_feedforward_layernorm",
                      attn_softcap="attn_logit_softcapping",
                      final_softcap="final_logit_softcapping")

FAMILIES: dict[str, Family] = {
    "llama": Family(_LLAMA_GROUPS),
    "mistral": Family(_LLAMA_GROUPS),
    "qwen2": Family(_LLAMA_GROUPS),
    "qwen3": Family(_LLAMA_GROUPS, qk_norm=True),
    "gemma": Family(_LLAMA_GROUPS, **_GEMMA_COMMON),
    "gemma2": Family(_GEMMA2_GROUPS, **_GEMMA2_COMMON),
    "gemma3_text": Family(_GEMMA2_GROUPS, qk_norm=True, rope_per_layer_type=True,
                          **_GEMMA2_COMMON),
    "phi3": Family(_PHI3_GROUPS, qkv_proj="self_attn.qkv_proj", gate_up_proj="mlp.gate_up_proj"),
}

# Norms whose effective gain is (1 + weight) rather than weight (AWQ scales (1 + w)).
ONE_PLUS_NORM_FAMILIES = frozenset(k for k, f in FAMILIES.items() if f.one_plus_norm)


def family_for(model_type: str | None) -> Family:
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(
            f"model_type {model_type!r} is not supported yet; supported: {sorted(FAMILIES)}"
        ) from None


def attn_implementation(model_type: str | None) -> str:
    """The transformers attention to run a family's FP model with: SDPA, or eager where
    attention scores are soft-capped (Gemma 2; transformers refuses SDPA there)."""
    family = FAMILIES.get(model_type)
    return "eager" if family is not None and family.attn_softcap else "sdpa"


def get_path(model: torch.nn.Module, path: str) -> torch.nn.Module:
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def get_blocks(model: torch.nn.Module, family: Family) -> torch.nn.ModuleList:
    return get_path(model, family.blocks)


def block_linear_names(family: Family) -> list[str]:
    return [name for g in family.groups for name in g.linears]


def config_value(cfg, field: str | None) -> float | None:
    """A family's optional config number (a soft-cap, a query scalar); None when unset."""
    return None if field is None else getattr(cfg, field, None)


def layer_types(cfg) -> tuple[str, ...]:
    """Each decoder layer's attention type, as the HF model's forward picks its mask: the
    config's ``layer_types`` (Gemma 2/3, Qwen2/3), else every layer ``sliding_attention`` when
    the config sets ``sliding_window`` (Mistral, Phi-3), else every layer ``full_attention``."""
    n = cfg.num_hidden_layers
    if getattr(cfg, "layer_types", None):
        return tuple(cfg.layer_types[:n])
    if getattr(cfg, "sliding_window", None) is not None:
        return ("sliding_attention",) * n
    return ("full_attention",) * n


def layer_windows(cfg) -> list[int | None]:
    """The sliding window of each decoder layer (None: full attention); a query at position p
    sees keys at positions > p - window (transformers' rule)."""
    window = getattr(cfg, "sliding_window", None)
    return [window if t == "sliding_attention" else None for t in layer_types(cfg)]

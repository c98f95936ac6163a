"""Model families as data: the one table calibration, the formats and the runtime engine read.

A family is keyed by the Hugging Face ``model_type``. Its entry says where the decoder blocks
are, which linears share an input (one Hessian / one AWQ scale per group) and the op producing
that input (where AWQ folds its scales), and what the engine must do differently from Llama:
the norm's gain ((1 + w) or w), norms around the attention and MLP outputs, per-head q/k norms,
fused projections, and attention extras (query scale, logit soft-capping, sliding windows,
embedding scale). Module names inside a block are relative to that block; every family here
names its block parts ``input_layernorm``, ``self_attn`` (``o_proj``) and ``mlp``
(``down_proj``), the Llama layout.

Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) add an :class:`ExpertGroup`
(``moe``): where the experts are, how checkpoints name them, the router and the shared expert.
Their experts are addressed per expert once a block is split (quantpipe.core.experts);
:func:`block_groups` gives a block's input groups, experts included.

Adding a family is one ``Family(...)`` line in ``FAMILIES`` plus its tests (docs/families.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantpipe.core.experts import ExpertGroup, split_experts


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
    mlp: str = "mlp"  # the MLP module: its input is mlp_in_norm's output, its output down_proj's
    mlp_out_norm: str | None = None  # norm of the MLP output before the residual add
    qk_norm: bool = False  # self_attn.q_norm / k_norm: RMSNorm per head before RoPE (Qwen3)
    qkv_proj: str | None = None  # one fused q/k/v linear (rows q, k, v), relative to the block
    gate_up_proj: str | None = None  # one fused gate/up linear (rows gate, up)
    query_scale: str | None = None  # config field s: attention scale s**-0.5, not head_dim**-0.5
    attn_softcap: str | None = None  # config field c: scores -> c * tanh(scores / c)
    final_softcap: str | None = None  # config field c: logits -> c * tanh(logits / c)
    rope_per_layer_type: bool = False  # rotary_emb(x, pos, layer_type): one RoPE per layer type
    # mixture of experts: the MLP is a router + experts (+ a shared expert); ``groups`` then
    # holds the attention groups only and block_groups() adds each block's MLP groups
    moe: ExpertGroup | None = None

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

# MoE: every expert's (gate, up) reads post_attention_layernorm's output, but each sees only
# the rows routed to it, so each is its own Hessian group (prev_op NO_FOLD: no fold of its
# own). AWQ scales all of them at once (awq.scale_shared_input, inspecting the MoE block
# "mlp"), folded into that norm with the router's (and Qwen2-MoE's shared_expert_gate's)
# columns multiplied by the scale, so routing is unchanged. down_proj reads only its own
# expert's act(gate) * up and folds into that expert's up_proj as in a dense MLP.
_ATTN_GROUPS = _LLAMA_GROUPS[:2]
_DENSE_MLP_GROUPS = _LLAMA_GROUPS[2:]  # a dense layer of a MoE model (mlp_only_layers)
NO_FOLD = ""  # InputGroup.prev_op of a group scaled together with others (MoE experts)
MOE_BLOCK = "mlp"  # the MoE module of a block (router, experts, shared expert)


def _mlp_groups(gate: str, up: str, down: str) -> tuple[InputGroup, ...]:
    return (InputGroup((gate, up), NO_FOLD, MOE_BLOCK), InputGroup((down,), up, ""))


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
    # hub names: block_sparse_moe.experts.E.w1 (gate), w3 (up), w2 (down); router
    # block_sparse_moe.gate
    "mixtral": Family(_ATTN_GROUPS, moe=ExpertGroup(
        num_experts="num_local_experts", intermediate="intermediate_size",
        linear_names=("w1", "w3", "w2"),
        hub_mlp="block_sparse_moe")),
    "qwen2_moe": Family(_ATTN_GROUPS, moe=ExpertGroup(
        shared_expert="mlp.shared_expert", shared_expert_gate="mlp.shared_expert_gate")),
    "qwen3_moe": Family(_ATTN_GROUPS, qk_norm=True, moe=ExpertGroup()),
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
    """The decoder blocks; a MoE family's experts are split into per-expert linears first
    (:func:`quantpipe.core.experts.split_experts`, in place, the same function): the form in
    which calibration, sensitivity and plans address an expert's linears."""
    blocks = get_path(model, family.blocks)
    if family.moe is not None:
        for block in blocks:
            split_experts(block, family.moe)
    return blocks


def block_groups(family: Family, block: torch.nn.Module, num_experts: int | None = None
                 ) -> tuple[InputGroup, ...]:
    """The input groups of one block in execution order. MoE: the attention groups, then per
    expert (gate, up) and (down), then the shared expert's; a block without experts (a dense
    layer of a MoE model) has the Llama MLP groups; the block's experts are split first
    (:func:`get_blocks`). ``num_experts``: the config's count (read from the block when None)."""
    moe = family.moe
    if moe is None:
        return family.groups
    if not split_experts(block, moe):
        return family.groups + _DENSE_MLP_GROUPS
    if num_experts is None:
        num_experts = len(block.get_submodule(moe.path))
    groups = list(family.groups)
    for e in range(num_experts):
        groups += _mlp_groups(*moe.expert_linears(e))
    if moe.shared_expert:
        groups += _mlp_groups(*(f"{moe.shared_expert}.{n}"
                                for n in ("gate_proj", "up_proj", "down_proj")))
    return tuple(groups)


def family_linear_names(family: Family) -> list[str]:
    """Every non-expert linear a block of the family may hold (a MoE family's blocks add a
    shared expert, or a dense MLP in its dense layers); experts are per block (block_groups)."""
    names = [name for g in family.groups for name in g.linears]
    if family.moe is not None:
        names += [n for g in _DENSE_MLP_GROUPS for n in g.linears]
        if family.moe.shared_expert:
            names += [f"{family.moe.shared_expert}.{n}"
                      for n in ("gate_proj", "up_proj", "down_proj")]
    return names


def block_linear_names(family: Family, block: torch.nn.Module | None = None) -> list[str]:
    """The linears of one block, in group order (``block``: needed for MoE families)."""
    groups = family.groups if block is None else block_groups(family, block)
    return [name for g in groups for name in g.linears]


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

"""Model families as data: where the decoder blocks are and which linears share an input.

Each ``InputGroup`` lists linears that read the same activation (one Hessian / one AWQ scale
for the group) and the op that produces that activation (where AWQ folds its scales).
Names are relative to one decoder block.
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
    blocks: str  # attribute path of the decoder block list
    groups: tuple[InputGroup, ...]  # in execution order


_LLAMA_GROUPS = (
    InputGroup(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "input_layernorm", "self_attn"),
    InputGroup(("self_attn.o_proj",), "self_attn.v_proj", ""),
    InputGroup(("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm", "mlp"),
    InputGroup(("mlp.down_proj",), "mlp.up_proj", ""),
)

# Gemma 2: the MLP reads pre_feedforward_layernorm's output; post_attention_layernorm scales
# the attention output before the residual add, so AWQ must not fold MLP scales into it
_GEMMA2_GROUPS = (
    _LLAMA_GROUPS[0],
    _LLAMA_GROUPS[1],
    InputGroup(("mlp.gate_proj", "mlp.up_proj"), "pre_feedforward_layernorm", "mlp"),
    _LLAMA_GROUPS[3],
)

FAMILIES: dict[str, Family] = {
    "llama": Family("model.layers", _LLAMA_GROUPS),
    "mistral": Family("model.layers", _LLAMA_GROUPS),
    "qwen2": Family("model.layers", _LLAMA_GROUPS),
    "qwen3": Family("model.layers", _LLAMA_GROUPS),
    # Gemma's RMSNorm multiplies by (1 + weight): AWQ folding must scale (1 + w), see awq.py
    "gemma": Family("model.layers", _LLAMA_GROUPS),
    "gemma2": Family("model.layers", _GEMMA2_GROUPS),
}

# Norms whose effective gain is (1 + weight) rather than weight.
ONE_PLUS_NORM_FAMILIES = frozenset({"gemma", "gemma2"})


def family_for(model_type: str) -> Family:
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(
            f"model_type {model_type!r} is not supported yet; supported: {sorted(FAMILIES)}"
        ) from None


def get_blocks(model: torch.nn.Module, family: Family) -> torch.nn.ModuleList:
    obj = model
    for part in family.blocks.split("."):
        obj = getattr(obj, part)
    return obj


def block_linear_names(family: Family) -> list[str]:
    return [name for g in family.groups for name in g.linears]

"""Calibration of mixture-of-experts blocks (Mixtral, Qwen2-MoE, Qwen3-MoE).

A block's experts are split into per-expert linears before capture
(:func:`quantpipe.core.families.block_groups`), so each expert's input groups are ordinary
groups whose hooks see only the rows the router sent to that expert: (gate, up) share the
Hessian of the routed MLP inputs, down's is made from that expert's ``act(gate) * up`` on the
same rows. The router (and Qwen2-MoE's ``shared_expert_gate``) belong to no group: they stay
FP16 (AWQ multiplies their columns by the scale it folds into the norm feeding them, which
leaves their outputs unchanged: :func:`moe_shared_input`).

An expert that received fewer than ``CalibrateSpec.min_expert_tokens`` rows has a Hessian too
poor to trust (rank below its in_features, dominated by dampening): its linears are quantized
with plain RTN (min-max, no Hessian) instead, and the block's JSON lists each such linear with
its token count (``expert_fallbacks``, beside every expert's ``expert_tokens``); the manifest
and ``CalibrateResult`` list them all and calibrate logs a warning per block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from quantpipe.calibration.result import QuantResult, proxy_loss
from quantpipe.calibration.rtn import rtn
from quantpipe.core.experts import SplitExperts, split_fused_name
from quantpipe.core.families import NO_FOLD, Family, InputGroup
from quantpipe.core.qformat import QuantSpec

FALLBACK = "rtn"  # what an expert below the token minimum is quantized with


@dataclass(frozen=True)
class SharedInput:
    """The MoE block's input groups AWQ scales at once (awq.scale_shared_input)."""

    key: str  # where the block's JSON records the result under "awq"
    groups: list[InputGroup]  # each expert's (and the shared expert's) (gate, up) group
    linears: list[str]  # their linears
    prev_op: str  # the norm producing the input (the scale is folded into it)
    compensate: list[str]  # unquantized readers of the input: router, shared_expert_gate
    inspect: str  # the MoE block, whose output the scale search compares


def moe_shared_input(family: Family, groups: tuple[InputGroup, ...]) -> SharedInput | None:
    """The groups of a MoE block that read its input, or None (dense block or family)."""
    joint = [g for g in groups if g.prev_op == NO_FOLD]
    if not joint:
        return None
    moe = family.moe
    assert moe is not None and len({g.inspect for g in joint}) == 1, joint
    return SharedInput(f"{moe.path} (all experts' gate/up)", joint,
                       [n for g in joint for n in g.linears], family.mlp_in_norm,
                       [n for n in (moe.router, moe.shared_expert_gate) if n], joint[0].inspect)


def is_expert_group(family: Family, group: InputGroup) -> bool:
    """True for the groups of a routed expert (not the shared expert, not attention)."""
    moe = family.moe
    return moe is not None and re.match(rf"{re.escape(moe.path)}\.\d+\.",
                                        group.linears[0]) is not None


def expert_linears_in(family: Family, key: str, shape: list[int]) -> dict[str, int]:
    """A fused experts tensor of the FP16 shards -> {per-expert linear name: in_features}
    (gate_up [E, 2I, H]: gate and up read H; down [E, H, I]: reads I); {} for other tensors."""
    moe = family.moe
    found = None if moe is None else split_fused_name(key, family.blocks, moe)
    if found is None:
        return {}
    prefix, kind = found
    g, u, d = moe.linear_names
    names = (g, u) if kind == moe.gate_up else (d,)
    return {f"{prefix}.{moe.path}.{e}.{n}": int(shape[2])
            for e in range(int(shape[0])) for n in names}


def fused_block_state(block: torch.nn.Module, family: Family) -> dict[str, torch.Tensor]:
    """``block.state_dict()`` under the FP16 folder's names: a split block's per-expert weights
    stacked back into transformers' ``gate_up_proj`` / ``down_proj`` (what the export and
    sensitivity overlay on the FP16 tensors)."""
    state = block.state_dict()
    moe = family.moe
    if moe is None:
        return state
    try:
        split = block.get_submodule(moe.path)
    except AttributeError:  # a dense layer of a MoE model
        return state
    if not isinstance(split, SplitExperts):
        return state
    out = {k: v for k, v in state.items() if not k.startswith(f"{moe.path}.")}
    out.update({f"{moe.path}.{k}": v for k, v in split.fused(moe).items()})
    return out


def fallback_quantize(W: torch.Tensor, qspec: QuantSpec, H: torch.Tensor) -> QuantResult:
    """An expert below the token minimum: plain RTN (no Hessian); the loss reported is still
    tr(dW H dW^T) on the few rows it did see, so it compares with the other layers'."""
    res = rtn(W, qspec)
    res.loss = proxy_loss(W, res.weight.dequantize(), H)
    return res

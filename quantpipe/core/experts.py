"""Mixture-of-experts blocks: the experts as per-expert linears, and their checkpoint names.

transformers 5 keeps a MoE block's experts as two 3-D parameters (``experts.gate_up_proj``
[E, 2I, H], rows gate then up, and ``experts.down_proj`` [E, H, I]) and routes with its own
router module (``mlp.gate``: softmax over the expert logits, top-k, optional renormalisation of
the k weights). Hub checkpoints, vLLM and every quantized format name each expert instead
(Mixtral ``block_sparse_moe.experts.E.w1/w3/w2``, Qwen MoE ``mlp.experts.E.gate_proj/up_proj/
down_proj``).

Every stage addresses an expert's linears as ordinary ``nn.Linear`` modules: :func:`split_experts`
replaces the 3-D experts module of a block by :class:`SplitExperts` (one :class:`ExpertMLP` per
expert, linears named as the hub names them) with the same forward, so that capture hooks see
exactly the rows routed to each expert, GPTQ/AWQ/sensitivity swap one expert's weight, and the
runtime puts QuantLinears in their place. The router is untouched (it stays FP16 everywhere).
:func:`hub_name` / :func:`model_name` map between the two naming schemes of the tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertGroup:
    """Where a family keeps its experts, and how checkpoints name them (paths relative to a
    decoder block)."""

    path: str = "mlp.experts"  # the experts module (3-D gate_up_proj / down_proj parameters)
    gate_up: str = "gate_up_proj"  # [E, 2I, H]: rows [0, I) gate, [I, 2I) up
    down: str = "down_proj"  # [E, H, I]
    router: str = "mlp.gate"  # router weight [E, H] (kept FP16, in no input group)
    num_experts: str = "num_experts"  # config field: the number of experts
    intermediate: str = "moe_intermediate_size"  # config field: an expert's width I
    # the hub's names of one expert's gate, up and down linears (vLLM and transformers read them)
    linear_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    hub_mlp: str = "mlp"  # the hub's name of the block's MoE module (Mixtral: block_sparse_moe)
    shared_expert: str | None = None  # an always-on dense MLP beside the experts (Qwen2-MoE)
    shared_expert_gate: str | None = None  # its sigmoid gate [1, H] (kept FP16)

    def expert_linears(self, e: int) -> tuple[str, str, str]:
        """Expert ``e``'s gate, up and down linears inside a split block."""
        return tuple(f"{self.path}.{e}.{n}" for n in self.linear_names)


def config_ints(config: dict, *fields: str) -> tuple[int, ...]:
    """Config numbers of a config.json dict, read through transformers' config class (whose
    ``attribute_map`` aliases names: Qwen3-MoE's ``num_experts`` is stored as
    ``num_local_experts``)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(**{k: v for k, v in config.items()
                                  if k != "quantization_config"})
    return tuple(int(getattr(cfg, f)) for f in fields)


class ExpertMLP(torch.nn.Module):
    """One expert: down(act(gate(x)) * up(x)), with the hub's names for the three linears."""

    def __init__(self, names: tuple[str, str, str], gate: torch.nn.Module, up: torch.nn.Module,
                 down: torch.nn.Module, act_fn) -> None:
        super().__init__()
        self.names = names
        for name, lin in zip(names, (gate, up, down)):
            self.add_module(name, lin)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act_fn(gate(x)) * up(x))  # [T, H] -> [T, I] -> [T, H]


class SplitExperts(torch.nn.ModuleList):
    """A drop-in for transformers' 3-D experts module: ``forward(x [T, H], top_k_index [T, k],
    top_k_weights [T, k]) -> [T, H]``, each expert run on the rows routed to it and its output
    weighted and summed as transformers does (``MixtralExperts.forward``). A ModuleList, so
    expert ``e``'s linears are named ``{path}.{e}.{linear}`` as on the hub."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)  # [T, H]
        for e, expert in enumerate(self):
            # rows routed to e and their slot, in transformers' order (slot-major)
            k_pos, token_idx = torch.where(top_k_index.T == e)
            if token_idx.numel() == 0:
                continue
            y = expert(hidden_states[token_idx])  # [t, H]
            y = y * top_k_weights[token_idx, k_pos, None]
            # each row appears once per expert: a plain indexed add is transformers' index_add_
            # (the same one addition per element), without index_add_'s threaded CPU path,
            # which stalls on a loaded machine
            out[token_idx] += y.to(out.dtype)
        return out

    def fused(self, group: ExpertGroup) -> dict[str, torch.Tensor]:
        """The transformers parameters back: {gate_up: [E, 2I, H], down: [E, H, I]}."""
        g, u, d = group.linear_names
        rows = [torch.cat([getattr(x, g).weight, getattr(x, u).weight]) for x in self]
        return {group.gate_up: torch.stack(rows),
                group.down: torch.stack([getattr(x, d).weight for x in self])}


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    out_f, in_f = weight.shape
    lin = torch.nn.Linear(in_f, out_f, bias=False, device="meta", dtype=weight.dtype)
    lin.weight = torch.nn.Parameter(weight, requires_grad=False)
    return lin


def split_experts(block: torch.nn.Module, group: ExpertGroup) -> bool:
    """Replace ``block``'s 3-D experts module by :class:`SplitExperts` (the same function, per
    expert linears holding views of the slices); idempotent. False: this block has no experts
    (a dense layer of a MoE model, e.g. Qwen2-MoE's ``mlp_only_layers``)."""
    parent_name, _, child = group.path.rpartition(".")
    parent = block.get_submodule(parent_name)
    experts = getattr(parent, child, None)
    if isinstance(experts, SplitExperts):
        return True
    if experts is None or not hasattr(experts, group.gate_up):
        return False
    gate_up = getattr(experts, group.gate_up).data  # [E, 2I, H]
    down = getattr(experts, group.down).data  # [E, H, I]
    inter = down.shape[-1]
    names = group.linear_names
    split = SplitExperts(
        # views of the fused parameters (contiguous row blocks): no second copy of the
        # experts while a block is split; every stage replaces a weight, never writes into it
        ExpertMLP(names, _linear(gate_up[e, :inter]), _linear(gate_up[e, inter:]),
                  _linear(down[e]), experts.act_fn)
        for e in range(gate_up.shape[0]))
    setattr(parent, child, split)
    return True


# ---- checkpoint names ------------------------------------------------------------------------


def _split_pattern(blocks: str, group: ExpertGroup) -> re.Pattern:
    """``{blocks}.N.{path}.(gate_up_proj|down_proj)``: a fused experts tensor."""
    return re.compile(rf"({re.escape(blocks)}\.\d+)\.{re.escape(group.path)}\."
                      rf"({re.escape(group.gate_up)}|{re.escape(group.down)})")


def _mlp_prefix(group: ExpertGroup) -> str:
    return group.path.split(".", 1)[0]  # "mlp"


def hub_name(name: str, blocks: str, group: ExpertGroup) -> str:
    """A model (or split-model) tensor or module name -> the hub's: Mixtral's MoE module is
    ``block_sparse_moe`` there (experts and router), ``mlp`` in transformers 5."""
    m = re.fullmatch(rf"({re.escape(blocks)}\.\d+)\.{re.escape(_mlp_prefix(group))}\.(.+)", name)
    if m is None or group.hub_mlp == _mlp_prefix(group):
        return name
    return f"{m.group(1)}.{group.hub_mlp}.{m.group(2)}"


def model_name(name: str, blocks: str, group: ExpertGroup) -> str:
    """Inverse of :func:`hub_name` (per-expert names stay per expert)."""
    m = re.fullmatch(rf"({re.escape(blocks)}\.\d+)\.{re.escape(group.hub_mlp)}\.(.+)", name)
    if m is None or group.hub_mlp == _mlp_prefix(group):
        return name
    return f"{m.group(1)}.{_mlp_prefix(group)}.{m.group(2)}"


def split_fused_name(name: str, blocks: str, group: ExpertGroup) -> tuple[str, str] | None:
    """``(block prefix, gate_up | down)`` when ``name`` is a fused experts tensor, else None."""
    m = _split_pattern(blocks, group).fullmatch(name)
    return None if m is None else (m.group(1), m.group(2))


def fused_tensors(tensors: Iterable[tuple[str, torch.Tensor]], blocks: str, group: ExpertGroup,
                  num_experts: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert ``.weight`` tensors (hub or split names) -> transformers' fused parameters
    under the model's names; every other tensor is renamed to the model's name and passes as it
    is. The experts of one block are held until the block's last one arrives."""
    pat = re.compile(rf"({re.escape(blocks)}\.\d+)\.{re.escape(group.path)}\.(\d+)\."
                     rf"({'|'.join(map(re.escape, group.linear_names))})\.weight")
    g, u, d = group.linear_names
    pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, t in tensors:
        name = model_name(name, blocks, group)
        m = pat.fullmatch(name)
        if m is None:
            yield name, t
            continue
        got = pending.setdefault(m.group(1), {})
        got[int(m.group(2)), m.group(3)] = t
        if len(got) == 3 * num_experts:
            del pending[m.group(1)]
            E = range(num_experts)
            # [E, 2I, H] from gate [I, H] and up [I, H] of each expert; [E, H, I] from down
            yield (f"{m.group(1)}.{group.path}.{group.gate_up}",
                   torch.stack([torch.cat([got[e, g], got[e, u]]) for e in E]))
            yield f"{m.group(1)}.{group.path}.{group.down}", torch.stack([got[e, d] for e in E])
    if pending:
        raise ValueError(f"experts incomplete in {sorted(pending)}: each needs "
                         f"{num_experts} x ({', '.join(group.linear_names)})")

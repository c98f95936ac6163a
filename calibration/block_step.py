"""One block's calibration step: stages 4a-4d of ``calibration.pipeline``.

An :class:`Algorithm` says, as data, what each stage does (4a what :func:`capture` records, 4b
the FP block's step, 4c the per-linear quantizer that :func:`quantize_block` runs, 4d whether
the next inputs go through the quantized block), or names a function that replaces 4a-4d
(GPTAQ's two streams, ``calibration.two_stream``). The rows are ``calibration.algorithms``."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from quantpipe.blocks.activations import Activations
from quantpipe.blocks.device import is_cpu, to_device, to_host
from quantpipe.blocks.execute import BlockContext, run_block
from quantpipe.calibration.awq import awq_quantize, scale_block, scale_shared_input
from quantpipe.calibration.capture import GroupStats, InputRecorder, StatsCollector
from quantpipe.calibration.gptq import GPTAQ_ALPHA, gptaq, gptq
from quantpipe.calibration.moe import (
    FALLBACK,
    fallback_quantize,
    fused_block_state,
    is_expert_group,
    moe_shared_input,
)
from quantpipe.calibration.result import QuantResult, result_to_host
from quantpipe.calibration.rtn import rtn
from quantpipe.core.families import (
    ONE_PLUS_NORM_FAMILIES,
    Family,
    InputGroup,
    block_groups,
)
from quantpipe.core.qformat import QuantizedWeight, QuantSpec

if TYPE_CHECKING:
    from quantpipe.calibration.spec import CalibrateSpec

log = logging.getLogger(__name__)


@dataclass
class BlockWork:
    """What the stages of one block share: the block, its context and what 4a captured."""

    block: torch.nn.Module  # materialised by the stream for the duration of the block
    name: str  # its model name, e.g. "model.layers.3"
    model_type: str  # config.json's model_type (how its norms apply their gain)
    family: Family
    groups: tuple[InputGroup, ...]  # the block's input groups, in execution order
    ctx: BlockContext  # positions and mask shared by every sample
    stats: dict[InputGroup, GroupStats]  # per input group: X^T X, mean |x|, a token sample
    recorded: dict[str, list[torch.Tensor]]  # inspected module -> its inputs [n, L, d] each
    fp_out: Activations | None  # [n, L, d] the FP block's outputs (None: not kept)


@dataclass(frozen=True)
class StepResult:
    """What an algorithm step (4b) changed in the FP block."""

    info: dict  # recorded in the block's JSON under "awq" (per input group)
    fp_changed: dict[str, torch.Tensor]  # model name -> the changed FP tensor, fp16


NO_STEP = StepResult({}, {})


@dataclass(frozen=True)
class Algorithm:
    """How calibrate runs one algorithm, stage by stage (module docstring, stage 4)."""

    # 4a: also record the inputs of the family's inspected modules (AWQ's block-output loss)
    records_inputs: bool
    # 4a: keep a sample of each input group's rows (AWQ's clip search); the others need only
    # X^T X, and a 7B block's samples are hundreds of MB
    samples_rows: bool
    # 4b: changes the FP block before it is quantized (AWQ's scales); None: no step
    block_step: Callable[[CalibrateSpec, BlockWork], StepResult] | None
    # 4c: one linear -> its result: (spec, model name, W [out, in] fp32, H [in, in] fp32,
    # the layer's QuantSpec, a sample of its inputs [rows, in] fp32)
    quantize: Callable[..., QuantResult]
    # 4c: run with one thread. GPTQ runs many small column operations: with several OpenMP
    # threads each pays thread wake-ups (and spins when cores are shared), which costs far
    # more than the work itself (docs/algorithms.md); large matmuls keep all threads
    one_thread: bool
    # 4c-4d: leave the block's weights quantized, so that the next block's inputs go through
    # the quantized block (the original GPTQ ``llama_sequential``)
    quantized_forward: bool
    # 4a-4d GPTAQ: carry the FP model's block inputs beside the quantized model's; capture
    # each input group in the partly quantized block, paired with the FP inputs (dXXT)
    asymmetric: bool
    # 4a-4d as one function of another data flow (GPTAQ: two_stream.asymmetric_block), called
    # as (spec, algo, block, name, model_type, family, hiddens, ctx, seed, out) ->
    # (results, damping raises, next inputs); None: capture -> block_step -> quantize_block ->
    # the next inputs, in calibration.pipeline.calibrate_block
    whole_block: Callable[..., tuple[dict, int, dict[str, Activations]]] | None = None


def quantize_gptq(spec: CalibrateSpec, name: str, W: torch.Tensor, H: torch.Tensor,
                   qspec: QuantSpec, x: torch.Tensor, solve=gptq) -> QuantResult:
    if qspec.group_size == -1 and not qspec.act_order:
        # One group per row: act-order only changes the order in which GPTQ walks the
        # columns (decreasing Hessian diagonal, so errors go to the columns that matter
        # least); every column keeps group 0, so no g_idx is stored and kernels and
        # formats see a plain per-channel layer, with a lower proxy loss (docs/algorithms.md)
        res = solve(W, H, QuantSpec(qspec.bits, -1, qspec.sym, act_order=True),
                    mse_clip=spec.mse_clip, percdamp=spec.percdamp)
        w = res.weight
        assert w.g_idx is None
        res.weight = QuantizedWeight(qspec, w.q, w.scales, w.zeros, None)
        return res
    return solve(W, H, qspec, mse_clip=spec.mse_clip, static_groups=spec.static_groups,
                 percdamp=spec.percdamp)


@dataclass
class AsymInputs:
    """GPTAQ's pairing of one input group: dXXT, and its correction per act_order (shared by
    the group's linears and both bit widths)."""

    dXXT: torch.Tensor  # [in, in] fp32: 2 (X_fp - X_q)^T X_q / tokens
    corrections: dict = field(default_factory=dict)  # calibration.gptq.gptaq's cache


def quantize_gptaq(spec: CalibrateSpec, name: str, W: torch.Tensor, H: torch.Tensor,
                    qspec: QuantSpec, x: torch.Tensor, asym: AsymInputs,
                    alpha: float = GPTAQ_ALPHA) -> QuantResult:
    if qspec.bits != 4:
        # the correction is for the INT4 model's input error (its blocks run the INT4 weights),
        # which an INT8 model does not have: corrected, its INT8 layers were several times
        # worse than GPTQ's (docs/algorithms.md); the INT8 result is GPTQ's on the same H
        return quantize_gptq(spec, name, W, H, qspec, x)
    solve = functools.partial(gptaq, dXXT=asym.dXXT, corrections=asym.corrections,
                              alpha=alpha)
    return quantize_gptq(spec, name, W, H, qspec, x, solve=solve)


def quantize_rtn(spec: CalibrateSpec, name: str, W: torch.Tensor, H: torch.Tensor,
                  qspec: QuantSpec, x: torch.Tensor) -> QuantResult:
    return rtn(W, qspec, mse_clip=spec.mse_clip, H=H)


def quantize_awq(spec: CalibrateSpec, name: str, W: torch.Tensor, H: torch.Tensor,
                  qspec: QuantSpec, x: torch.Tensor) -> QuantResult:
    return awq_quantize(name, W, qspec, x, H=H)


def awq_step(spec: CalibrateSpec, work: BlockWork) -> StepResult:
    """AWQ's scales, searched and folded into the block; the changed tensors in fp16."""
    # compared under the FP16 folder's names (a MoE block's experts stacked back)
    before = {k: v.detach().clone() for k, v in fused_block_state(work.block,
                                                                    work.family).items()}
    norm_kind = "one_plus_norm" if work.model_type in ONE_PLUS_NORM_FAMILIES else "norm"
    info = scale_block(work.block, work.groups, work.stats, work.recorded, work.ctx.kwargs(),
                       lambda in_f: spec.layer_spec(work.name, in_f), norm_kind)
    shared = moe_shared_input(work.family, work.groups)
    if shared is not None:  # MoE: every expert's (gate, up) scaled at once
        in_f = work.block.get_submodule(shared.linears[0]).in_features
        info[shared.key] = scale_shared_input(
            work.block, shared.linears, shared.prev_op, shared.compensate, shared.inspect,
            [work.stats[g] for g in shared.groups], work.recorded, work.ctx.kwargs(),
            spec.layer_spec(work.name, in_f), norm_kind)
    changed = {f"{work.name}.{k}": to_host(v.detach().to(torch.float16)).clone()
               for k, v in fused_block_state(work.block, work.family).items()
               if not torch.equal(v, before[k])}
    return StepResult(info, changed)






def set_quantized_weights(block, name: str, results: dict[str, dict[int, QuantResult]]
                           ) -> None:
    """Every quantized linear of ``block`` gets its dequantized INT4 weight back for the
    quantized forward (4d): quantize_block freed each fp32 weight once quantized, so a 7B
    block does not hold all its linears in fp32 while GPTQ factors the largest Hessian.
    The results are on the CPU already (4c): each weight is dequantized there and moved to
    the block's device (the emptied weight kept its device)."""
    for full, by_tag in results.items():
        lin = block.get_submodule(full[len(name) + 1:])
        lin.weight.data = to_device(by_tag["w4"].weight.dequantize(lin.weight.dtype),
                                    lin.weight.device)


def capture(spec: CalibrateSpec, algo: Algorithm, block, name: str, model_type: str,
             family: Family, hidden: Activations, ctx: BlockContext, seed: int,
             out: Activations | None) -> BlockWork:
    """Run the FP block over its inputs hidden [n, L, d] with the capture hooks; its outputs
    go to ``out`` (None: not kept)."""
    groups = block_groups(family, block)  # MoE: splits the experts (hooks see routed rows)
    collector = StatsCollector(block, groups, seed=seed,
                               **({} if algo.samples_rows else {"sample_rows": 0}))
    recorder = None
    if algo.records_inputs:
        inspect_names = list(dict.fromkeys(g.inspect for g in groups if g.inspect))
        recorder = InputRecorder(block, inspect_names, spec.awq_samples)
    try:
        fp_out = run_block(block, hidden, ctx, spec.batch_size, out=out,
                           keep=out is not None)  # [n, L, d]
    finally:
        collector.remove()
        if recorder is not None:
            recorder.remove()
    return BlockWork(block, name, model_type, family, groups, ctx, collector.stats,
                      recorder.inputs if recorder is not None else {}, fp_out)


def quantize_block(spec: CalibrateSpec, algo: Algorithm, work: BlockWork):
    """INT4 and INT8 results for every linear of the block (on the CPU: each comes back from
    the block's device once made), the damping raises, and (MoE) the tokens routed to each
    expert with the experts that fell back to RTN."""
    threads = torch.get_num_threads()
    if algo.one_thread and is_cpu(spec.device):  # OpenMP threads: a CPU matter only
        torch.set_num_threads(1)
    results: dict[str, dict[str, QuantResult]] = {}  # linear -> tag (w4, w8, menu) -> result
    raises = 0
    tokens: dict[str, int] = {}  # expert linear -> rows routed to it
    fallbacks: dict[str, int] = {}  # the same, for experts below spec.min_expert_tokens
    try:
        for group in work.groups:
            stats = work.stats.pop(group)  # freed with H once the group is quantized
            H = stats.take_hessian()  # [in, in] fp32
            x = stats.x_sample()  # [rows, in] fp32 ([0, in] unless algo.samples_rows)
            extra = {"asym": AsymInputs(stats.take_dxxt())} if algo.asymmetric else {}
            quantize = algo.quantize
            if is_expert_group(work.family, group):
                tokens.update({f"{work.name}.{n}": stats.tokens for n in group.linears})
                if stats.tokens < spec.min_expert_tokens:
                    fallbacks.update({f"{work.name}.{n}": stats.tokens for n in group.linears})
                    quantize = quantize_fallback
            for lin_name in group.linears:
                full = f"{work.name}.{lin_name}"
                lin = work.block.get_submodule(lin_name)
                W = lin.weight.data.float()  # [out, in]
                q4 = spec.layer_spec(full, lin.in_features)
                r4 = quantize(spec, full, W, H, q4, x, **extra)
                r8 = quantize(spec, full, W, H, spec.layer_int8(lin.in_features), x, **extra)
                menu = {tag: quantize(spec, full, W, H, qs, x, **extra)
                        for tag, qs in spec.layer_menu(q4, lin.in_features).items()}
                raises += r4.damp_raises + r8.damp_raises + sum(
                    r.damp_raises for r in menu.values())
                del W
                if algo.asymmetric:  # GPTAQ's next groups run the block with it quantized
                    lin.weight.data = r4.weight.dequantize(lin.weight.dtype)
                elif algo.quantized_forward:  # not needed again until the quantized forward
                    lin.weight.data = lin.weight.data.new_empty(0)  # (4d): its fp32 freed
                results[full] = {"w4": result_to_host(r4), "w8": result_to_host(r8),
                                 **{t: result_to_host(r) for t, r in menu.items()}}
    finally:
        torch.set_num_threads(threads)
    if fallbacks:
        log.warning("%s: %d expert linear(s) got fewer than %d calibration tokens; quantized "
                    "with %s (recorded in the block's expert_fallbacks)", work.name,
                    len(fallbacks), spec.min_expert_tokens, FALLBACK)
    expert_info = {"expert_tokens": tokens, "expert_fallbacks": fallbacks} if tokens else {}
    return results, raises, expert_info


def quantize_fallback(spec: CalibrateSpec, name: str, W: torch.Tensor, H: torch.Tensor,
                       qspec: QuantSpec, x: torch.Tensor) -> QuantResult:
    return fallback_quantize(W, qspec, H)

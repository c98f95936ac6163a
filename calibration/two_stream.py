"""GPTAQ's block step (stages 4a-4d of ``calibration.pipeline``): two streams of block inputs,
the FP model's and the quantized model's, paired group by group (calibration.gptq.gptaq)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from quantpipe.blocks.activations import Activations
from quantpipe.blocks.device import module_device
from quantpipe.blocks.execute import (
    BlockContext,
    attention_residual,
    batches,
    mlp_residual,
    run_block,
    run_until_stopped,
)
from quantpipe.calibration.block_step import Algorithm, BlockWork, quantize_block
from quantpipe.calibration.capture import GroupInputRecorder, StatsCollector
from quantpipe.calibration.result import QuantResult
from quantpipe.core.families import (
    Family,
    InputGroup,
    block_groups,
)

if TYPE_CHECKING:
    from quantpipe.calibration.spec import CalibrateSpec


def asymmetric_block(spec: CalibrateSpec, algo: Algorithm, block, name: str, model_type: str,
                      family: Family, hiddens: dict[str, Activations], ctx: BlockContext,
                      seed: int, out: Callable[[str], Activations]
                      ) -> tuple[dict, int, dict[str, Activations]]:
    """GPTAQ's stages 4a-4d: the FP block over the FP model's inputs records every group's
    inputs (and gives the next FP inputs); then, per input group in execution order, its
    inputs in the block with the earlier groups quantized, over the quantized model's inputs,
    are paired with the FP ones (H and dXXT) and the group is quantized; last, the quantized
    block gives the next inputs.

    Only q/k/v's and o_proj's inputs need a pass through the block (each ends at its group,
    StopForward). o_proj's and down_proj's inputs are kept: with the linears before them
    quantized they are those of every later pass, so the later passes start from them (the
    decoder layer's residual adds, :func:`attention_residual` / :func:`mlp_residual`) instead
    of running the attention again, and the next inputs are computed from down_proj's."""
    groups = block_groups(family, block)
    # a dense block's input groups, in execution order (GPTAQ refuses MoE families)
    attn_in, attn_o, mlp_in, mlp_down = groups
    recorder = GroupInputRecorder(block, groups)  # the FP inputs: [tokens, in] per call
    try:
        fp_out = run_block(block, hiddens["hidden_fp"], ctx, spec.batch_size,
                           out=out("hidden_fp"))  # [n, L, d]
    finally:
        recorder.remove()
    hidden = hiddens["hidden"]  # the quantized model's block inputs [n, L, d]
    device = module_device(block)
    results: dict[str, dict[str, QuantResult]] = {}
    raises = 0

    def quantize_group(group: InputGroup, passes: Callable[[], None], keep: bool = False
                       ) -> list[torch.Tensor] | None:
        """Run ``passes`` with the statistics hooks of ``group`` and quantize it; with
        ``keep``, the group's inputs of every call ([..., in] each, in call order)."""
        nonlocal raises
        collector = StatsCollector(block, (group,), sample_rows=0, seed=seed,
                                   fp_inputs=recorder.inputs, stop=True, keep_inputs=keep)
        try:
            passes()
        finally:
            collector.remove()
        assert not recorder.inputs[group], "every FP input must be paired"
        work = BlockWork(block, name, model_type, family, (group,), ctx, collector.stats, {},
                          fp_out)
        group_results, group_raises, _ = quantize_block(spec, algo, work)  # 4c
        results.update(group_results)
        raises += group_raises
        return collector.kept[group] if keep else None

    def block_pass() -> None:  # ends at the group's hook
        run_block(block, hidden, ctx, spec.batch_size, keep=False)

    quantize_group(attn_in, block_pass)
    # per batch [b, L, attn] (q/k/v quantized)
    x_o = quantize_group(attn_o, block_pass, keep=True)
    o_proj = block.get_submodule(attn_o.linears[0])  # quantized from here on
    mlp, mlp_norm = block.get_submodule(family.mlp), block.get_submodule(family.mlp_in_norm)

    def after_attention() -> Iterator[tuple[int, int, torch.Tensor]]:
        """(batch index, first sample, the first residual add [b, L, d]) per batch."""
        for k, (a, h) in enumerate(batches(hidden, spec.batch_size, device)):
            yield k, a, attention_residual(block, family, h, o_proj(x_o[k]))

    def mlp_pass() -> None:  # ends at the group's hook inside the MLP
        with torch.no_grad():
            for _, _, h in after_attention():
                run_until_stopped(mlp, mlp_norm(h))

    quantize_group(mlp_in, mlp_pass)
    # per batch [b, L, mlp] (gate/up quantized)
    x_down = quantize_group(mlp_down, mlp_pass, keep=True)
    down_proj = block.get_submodule(mlp_down.linears[0])
    nxt = out("hidden")  # 4d: the quantized block's outputs, from down_proj's inputs
    with torch.no_grad():
        for k, a, h in after_attention():
            nxt.write(a, mlp_residual(block, family, h, down_proj(x_down[k])))
    nxt.commit()
    return results, raises, {"hidden": nxt, "hidden_fp": fp_out}

"""Test-only helpers: random packed layers and a tiny RTN quantizer (uses calibration.grid)."""

from __future__ import annotations

from pathlib import Path

import torch

from quantpipe.calibration.grid import quantize_to_grid, scale_zero_from_range
from quantpipe.core.formats.writers import write_checkpoint
from quantpipe.core.qformat import QuantizedWeight, QuantSpec, pack_int32
from quantpipe.runtime.kernels.layout import PackedLinear


def random_packed(out_f: int, in_f: int, spec: QuantSpec, seed: int, bias: bool = False,
                  act_group_sizes_equal: bool = True) -> PackedLinear:
    """A random packed layer; act-order g_idx = a random permutation of arange(in)//gs."""
    gen = torch.Generator().manual_seed(seed)
    gs = spec.group_size_for(in_f)
    n_groups = in_f // gs
    q = torch.randint(0, 2**spec.bits, (out_f, in_f), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(out_f, n_groups, generator=gen) * 0.05 + 0.005).half()
    zeros = None if spec.sym else torch.randint(0, 2**spec.bits, (out_f, n_groups),
                                                generator=gen, dtype=torch.uint8)
    g_idx = None
    if spec.act_order:
        g = torch.arange(in_f) // gs
        if not act_group_sizes_equal:  # unequal groups: move one column to another group
            g[0] = (g[0] + 1) % n_groups
        g_idx = g[torch.randperm(in_f, generator=gen)].to(torch.int32)
    b = torch.randn(out_f, generator=gen) * 0.1 if bias else None
    return PackedLinear(spec, pack_int32(q, spec.bits), scales, zeros, g_idx, b, in_f)


def rtn(w: torch.Tensor, spec: QuantSpec) -> QuantizedWeight:
    """Round-to-nearest with min/max ranges (the test stand-in for calibration)."""
    out_f, in_f = w.shape
    gs = spec.group_size_for(in_f)
    wg = w.float().reshape(out_f, in_f // gs, gs)  # [out, G, gs]
    scale, zero = scale_zero_from_range(wg.amin(-1), wg.amax(-1), spec)  # [out, G]
    q = quantize_to_grid(wg, scale[..., None], zero[..., None], spec.maxq)
    return QuantizedWeight(spec, q.reshape(out_f, in_f).to(torch.uint8), scale.half(),
                           zero.to(torch.uint8))


def quantize_folder(fp16_dir: Path, out: Path, specs: list[QuantSpec]) -> dict:
    """RTN-quantize every linear but lm_head, cycling through ``specs``; write native."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(fp16_dir, dtype=torch.float32)
    weights = {}
    linears = [(n, m) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    for i, (name, mod) in enumerate(linears):
        weights[name] = rtn(mod.weight.data, specs[i % len(specs)])
    return write_checkpoint("native", out, fp16_dir, weights)

"""Helpers shared by the format tests (tiny FP16 export, RTN) and tests of the pure packers."""

from __future__ import annotations

from pathlib import Path

import torch

from quantpipe.calibration.grid import quantize_to_grid, scale_zero_from_range
from quantpipe.core.formats.common import read_fp_state
from quantpipe.core.qformat import QuantizedWeight, QuantSpec, resolve_group_size
from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16


def export_tiny(model_dir: Path, out: Path) -> Path:
    export_fp16(Fp16ExportSpec(str(model_dir), out))
    return out


def rtn(w: torch.Tensor, spec: QuantSpec, g_idx: torch.Tensor | None = None) -> QuantizedWeight:
    """Round-to-nearest; with ``g_idx`` each column uses the group it names (act-order)."""
    out_f, in_f = w.shape
    spec = spec.with_group_size(resolve_group_size(spec.group_size, in_f))
    gs = spec.group_size_for(in_f)
    gi = torch.arange(in_f) // gs if g_idx is None else g_idx.long()  # [in]
    order = torch.argsort(gi, stable=True)  # columns sorted by group
    wg = w.float()[:, order].reshape(out_f, in_f // gs, gs)  # [out, G, gs]
    scale, zero = scale_zero_from_range(wg.amin(-1), wg.amax(-1), spec)  # [out, G]
    q = quantize_to_grid(w.float(), scale[:, gi], zero[:, gi], spec.maxq)  # [out, in]
    return QuantizedWeight(spec, q.to(torch.uint8), scale.half(), zero.to(torch.uint8),
                           None if g_idx is None else g_idx.to(torch.int32))


def linear_names(fp16_dir: Path) -> list[str]:
    state = read_fp_state(fp16_dir)
    return [k[:-7] for k, v in state.items()
            if k.endswith(".weight") and v.dim() == 2 and ".layers." in k]


def act_order_g_idx(in_f: int, gs: int, seed: int) -> torch.Tensor:
    """A permuted group map like GPTQ act-order produces: column perm[j] is in group j // gs."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(in_f, generator=gen)
    g_idx = torch.empty(in_f, dtype=torch.int32)
    g_idx[perm] = (torch.arange(in_f) // gs).to(torch.int32)
    return g_idx


def quantize_plan(fp16_dir: Path, specs: list[QuantSpec], skip: tuple[str, ...] = (),
                  act_order_seed: int | None = None) -> dict[str, QuantizedWeight]:
    """RTN every block linear, cycling through ``specs``; names in ``skip`` stay FP16."""
    state = read_fp_state(fp16_dir)
    weights = {}
    for i, name in enumerate(linear_names(fp16_dir)):
        if name in skip:
            continue
        w = state[f"{name}.weight"]
        spec = specs[i % len(specs)]
        spec = spec.with_group_size(resolve_group_size(spec.group_size, w.shape[1]))
        g_idx = None
        if spec.act_order and act_order_seed is not None:
            gs = spec.group_size_for(w.shape[1])
            g_idx = act_order_g_idx(w.shape[1], gs, act_order_seed + i)
        weights[name] = rtn(w, spec, g_idx)
    return weights


# ---- pure packers ---------------------------------------------------------------------------


def ref_decode_gptq(qweight, qzeros, scales, g_idx, bits: int, v1: bool):
    """Independent GPTQ decoder written from the format description, not from quantpipe's
    packer: qweight word ``r`` of column ``o`` holds rows ``r*pf .. r*pf+pf-1`` of W^T at bit
    offsets ``bits*j``; qzeros packs output channels the same way; v1 stores ``zero - 1``.
    Returns (q [out, in] int64, zeros [out, G] int64, W [out, in] float64)."""
    pf, mask = 32 // bits, (1 << bits) - 1
    words = qweight.to(torch.int64) & 0xFFFFFFFF  # [in/pf, out], unsigned view
    q_t = torch.empty(words.shape[0] * pf, words.shape[1], dtype=torch.int64)  # [in, out]
    for j in range(pf):
        q_t[j::pf] = (words >> (bits * j)) & mask
    zw = qzeros.to(torch.int64) & 0xFFFFFFFF  # [G, out/pf]
    z_t = torch.empty(zw.shape[0], zw.shape[1] * pf, dtype=torch.int64)  # [G, out]
    for j in range(pf):
        z_t[:, j::pf] = (zw >> (bits * j)) & mask
    if v1:
        z_t = z_t + 1
    g = g_idx.long()
    w_t = (q_t.double() - z_t[g].double()) * scales[g].double()  # [in, out]
    return q_t.t(), z_t.t(), w_t.t()


def test_gptq_pack_matches_independent_decoder():
    from quantpipe.core.formats.gptq import pack_gptq

    torch.manual_seed(0)
    w = torch.randn(48, 128) * 0.05
    cases = [(QuantSpec(4, 32, True), None), (QuantSpec(4, 64, False), None),
             (QuantSpec(8, -1, True), None), (QuantSpec(8, 32, False), None),
             (QuantSpec(4, 32, False, act_order=True), act_order_g_idx(128, 32, 1))]
    for spec, g_idx in cases:
        qw = rtn(w, spec, g_idx)
        for v1 in (True, False):
            t = pack_gptq(qw, v1)
            assert t["qweight"].shape == (128 * spec.bits // 32, 48)
            assert t["qweight"].dtype == torch.int32 and t["scales"].dtype == torch.float16
            q, z, w_ref = ref_decode_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"],
                                          spec.bits, v1)
            assert torch.equal(q, qw.q.long()) and torch.equal(z, qw.zeros.long())
            # (q - z) * fp16 scale is exact in fp32 and fp64 (<= 19 significant bits)
            assert torch.equal(w_ref.float(), qw.dequantize(torch.float32)), (spec, v1)


def test_ct_pack_equals_library_pack():
    """quantpipe's pack-quantized words are bit-identical to compressed-tensors' own packer."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from quantpipe.core.formats.compressed_tensors import pack_ct

    torch.manual_seed(1)
    w = torch.randn(40, 96) * 0.05
    for spec in (QuantSpec(4, 32, True), QuantSpec(4, 32, False), QuantSpec(8, -1, False)):
        qw = rtn(w, spec)
        t = pack_ct(qw)
        offset = 2 ** (spec.bits - 1)
        signed_q = (qw.q.to(torch.int16) - offset).to(torch.int8)  # CT stores signed values
        assert torch.equal(t["weight_packed"], pack_to_int32(signed_q, spec.bits))
        if not spec.sym:
            signed_z = (qw.zeros.to(torch.int16) - offset).to(torch.int8)
            assert torch.equal(t["weight_zero_point"],
                               pack_to_int32(signed_z, spec.bits, packed_dim=0))


def test_dynamic_pattern_matches_fused_vllm_names():
    import re

    from quantpipe.core.formats.gptq import layer_pattern

    p = layer_pattern("model.layers.1.self_attn.k_proj")
    assert re.match(p, "model.layers.1.self_attn.k_proj")
    assert re.match(p, "model.layers.1.self_attn.qkv_proj")
    assert not re.match(p, "model.layers.11.self_attn.k_proj")
    assert not re.match(p, "model.layers.1.self_attn.q_proj")


def track_unpacked(monkeypatch):
    """Wrap the verifier's unpack step; returns the most unpacked layers alive at any one call."""
    import gc
    import weakref

    from quantpipe.core.formats import verify as ver

    alive: list[weakref.ref] = []
    peak = [0]
    real = ver.unpack_layer

    def unpack(*args, **kwargs):
        gc.collect()  # only references that really remain count
        peak[0] = max(peak[0], sum(r() is not None for r in alive) + 1)
        u = real(*args, **kwargs)
        alive.append(weakref.ref(u.q))  # u.q: [out, in] uint8, the unpacked weight
        return u

    monkeypatch.setattr(ver, "unpack_layer", unpack)
    return peak


def track_shard_writes(monkeypatch):
    """Wrap the streaming shard writer: returns {"alive": most tensors handed to it that were
    still referenced at any one add, "shards": bytes of each finished shard}."""
    import gc
    import weakref

    import quantpipe.core.io as qio

    seen: list[weakref.ref] = []
    stats = {"alive": 0, "shards": []}
    real_add, real_finish = qio.StreamingShard.add, qio.StreamingShard.finish

    def add(self, name, t):
        gc.collect()  # only references that really remain count
        stats["alive"] = max(stats["alive"], sum(r() is not None for r in seen) + 1)
        seen.append(weakref.ref(t))
        return real_add(self, name, t)

    def finish(self, metadata):
        stats["shards"].append(self.nbytes)
        return real_finish(self, metadata)

    monkeypatch.setattr(qio.StreamingShard, "add", add)
    monkeypatch.setattr(qio.StreamingShard, "finish", finish)
    return stats

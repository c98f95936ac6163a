"""The int8 head is quantized and laid out a chunk of rows at a time: the same tensors as the
whole-head formulas, at any chunk size (including a last chunk that is not a multiple of 16)."""

import torch

from quantpipe.runtime import fp_head
from quantpipe.runtime.kernels.cpu import block_rows


def _whole(w: torch.Tensor):
    n, k = w.shape
    wb = w.float().view(n, -1, 32)
    scales = (wb.abs().amax(-1) / 127).half()
    s = scales.float().clamp_min(torch.finfo(torch.float16).tiny)[..., None]
    return torch.round(wb / s).clamp(-127, 127).to(torch.int8).view(n, k), scales


def test_chunked_quantization_and_layout_equal_the_whole_head(monkeypatch):
    w = (torch.randn(100, 64, generator=torch.Generator().manual_seed(0)) * 0.05).half()
    w[3, :32] = 0  # an all-zero block: scale 0, codes 0
    want_q, want_s = _whole(w)
    for rows in (32, 48, 4096):
        monkeypatch.setattr(fp_head, "HEAD_CHUNK_ROWS", rows)
        monkeypatch.setattr(fp_head, "INT8_HEAD_CHUNK_ROWS", rows)
        q, s = fp_head.quantize_head_int8(w)
        assert torch.equal(q, want_q) and torch.equal(s, want_s)
        q8, s8 = fp_head.int8_head_blocked(w)
        assert torch.equal(q8, block_rows(want_q)) and torch.equal(s8, block_rows(want_s))

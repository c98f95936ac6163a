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
        assert torch.equal(q8, fp_head.block_row_quads(want_q))
        assert torch.equal(s8, block_rows(want_s))


def test_block_row_quads_places_each_code_where_the_kernel_reads_it():
    """Byte 4r + e of chunk (b, c) holds q[16b + r, 4c + e]; rows past N are zero."""
    q = torch.randint(-127, 128, (37, 64), generator=torch.Generator().manual_seed(1),
                      dtype=torch.int8)
    quads = fp_head.block_row_quads(q)  # [3, 16, 64]
    assert quads.shape == (3, 16, 64)
    back = quads.view(3, 16, 16, 4).permute(0, 2, 1, 3).reshape(48, 64)  # [b, r, c, e] -> rows
    assert torch.equal(back[:37], q) and not back[37:].any()

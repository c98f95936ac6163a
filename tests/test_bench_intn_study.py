"""bench/intn_study.py: the library's quantizers at widths the formats do not store yet."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
intn = pytest.importorskip("intn_study")

from quantpipe.calibration.gptq import gptq  # noqa: E402
from quantpipe.calibration.rtn import rtn  # noqa: E402


def test_any_bits_quantizes_on_the_wider_grid_and_each_bit_quarters_the_error(monkeypatch):
    torch.manual_seed(0)
    W = torch.randn(64, 256, dtype=torch.float32)
    X = torch.randn(512, 256, dtype=torch.float32)
    H = 2 * X.T @ X / X.shape[0]
    err = {}
    for bits in (3, 4, 5, 6):
        spec = intn.AnyBits(bits, 128, True)
        res = rtn(W, spec, mse_clip=False, H=H)
        q = res.weight.q
        assert int(q.max()) <= 2**bits - 1 and res.weight.spec.maxq == 2**bits - 1
        err[bits] = float((res.weight.dequantize() - W).pow(2).mean())
    for bits in (3, 4, 5):  # one more bit: the step halves, the mean squared error quarters
        assert 3.0 < err[bits] / err[bits + 1] < 5.0, err
    with pytest.raises(ValueError, match="2 to 8"):
        intn.AnyBits(9, 128, True)
    # GPTQ with act-order at 5 bits: the library's own exactness check passes, and it beats RTN
    monkeypatch.setattr(intn.gptq_module, "QuantSpec", intn.AnyBits)
    g = gptq(W, H, intn.AnyBits(5, 128, True, act_order=True), mse_clip=True,
             static_groups=True)
    r = rtn(W, intn.AnyBits(5, 128, True), mse_clip=False, H=H)
    assert g.loss < r.loss
    assert intn.stored_bits(5, 128) == 5.125 and intn.stored_bits(6, 32) == 6.5

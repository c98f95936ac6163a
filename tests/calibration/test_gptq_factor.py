"""GPTQ's shared Hessian factor, its column loop against the plain IST loop, and the chunked
MSE clip search against the whole-tensor search."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quantpipe.calibration import gptq as gptq_mod
from quantpipe.calibration import grid
from quantpipe.calibration.gptq import gptq, hessian_factor
from quantpipe.calibration.grid import params_for_groups, quantize_to_grid
from quantpipe.core.qformat import QuantSpec

from .test_gptq import correlated_hessian, weight


def test_factor_is_the_damped_inverse_cholesky_in_float64():
    """Hinv^T Hinv = (H_perm + damp I)^-1, Hinv upper with a positive diagonal."""
    H = correlated_hessian(20)
    H[:, 5] = 0.0
    H[5, :] = 0.0  # a dead input
    f = hessian_factor(H, act_order=True, percdamp=0.01)
    Hd = H.double().clone()
    Hd[5, 5] = 1.0
    assert torch.equal(f.perm, torch.argsort(torch.diagonal(Hd), descending=True))
    assert f.dead.nonzero().flatten().tolist() == [5]
    Hp = Hd[f.perm][:, f.perm]
    Hp.diagonal().add_(0.01 * torch.diagonal(Hd).mean())
    ref = torch.linalg.inv(Hp)  # [in, in] f64
    U = f.Hinv.double()
    assert torch.equal(U, U.triu()) and (torch.diagonal(U) > 0).all()
    # the factor is stored in fp32: relative error of fp32 rounding, amplified by cond(H)
    assert torch.allclose(U.T @ U, ref, rtol=1e-4, atol=1e-6 * ref.abs().max())
    assert f.percdamp == 0.01 and f.damp_raises == 0


@pytest.mark.parametrize("n,panel", [(1, 4), (7, 4), (8, 4), (9, 4), (70, 16), (300, 256)])
def test_blocked_triangular_inverse_matches_float64_inv(n, panel):
    """The panel sweep inverts in place; against torch.linalg.inv of the same float64 L."""
    g = torch.Generator().manual_seed(n)
    X = torch.randn(n + 5, n, generator=g, dtype=torch.float64)
    L = torch.linalg.cholesky(X.T @ X / n + 0.1 * torch.eye(n, dtype=torch.float64))
    ref = torch.linalg.inv(L)
    out = L.clone()
    assert gptq_mod.lower_triangular_inverse_(out, panel=panel) is out
    assert torch.equal(out, out.tril())
    # float64 rounding of two solve orders, relative to the largest entry
    assert (out - ref).abs().max() <= 1e-12 * ref.abs().max()


@pytest.mark.parametrize("n,panel", [(1, 2), (5, 2), (6, 2), (33, 8), (64, 256)])
def test_reversed_float32_over_its_own_memory_is_the_flipped_cast(n, panel):
    """Row r's fp32 copy is written over rows < r only after they are read: the result is
    exactly J A J cast to fp32, in the first half of A's memory."""
    A = torch.randn(n, n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    ref = A.float().flip(0, 1)
    out = gptq_mod._reversed_float32_(A, panel=panel)
    assert out.data_ptr() == A.data_ptr() and out.is_contiguous()
    assert torch.equal(out, ref)
    B = torch.ones(n, n, dtype=torch.float64)
    B[n - 1, 0] = float("inf")
    assert gptq_mod._reversed_float32_(B, panel=panel) is None


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc smaps")
def test_factor_keeps_only_its_fp32_half_of_the_float64_workspace():
    """The float64 workspace is a memory map; the factor lives in its first half and the
    second half's pages are handed back (the mapping's resident size is the fp32 matrix)."""
    n = 1024  # 8 MiB float64, 4 MiB fp32
    H = correlated_hessian(31, n=n)
    U, _, _ = gptq_mod.damped_inverse_cholesky(H, torch.arange(n), 0.01, 8)
    start = end = rss_kb = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            start, end = lo, hi
        elif head == "Rss:" and start is not None and start <= U.data_ptr() < end:
            rss_kb = int(line.split()[1])
            break
    assert rss_kb is not None, "the factor's mapping was not found"
    assert end - start >= 8 * n * n  # the workspace
    assert rss_kb * 1024 <= 4 * n * n + 4096  # only the fp32 half (plus its last page)


def test_factor_retries_with_more_damping():
    """A failed Cholesky (indefinite H) raises the damping; the factor is then still exact."""
    H = correlated_hessian(32)
    H[3, 3] = -50.0 * H.diagonal().mean()  # not positive definite at 1% damping
    f = hessian_factor(H, act_order=False, percdamp=0.01)
    assert f.damp_raises > 0
    Hp = H.double().clone()
    Hp.diagonal().add_(f.damp)
    U = f.Hinv.double()
    ref = torch.linalg.inv(Hp)
    assert torch.allclose(U.T @ U, ref, rtol=1e-4, atol=1e-6 * ref.abs().max())


@pytest.mark.parametrize("spec", [QuantSpec(4, 32, True, True), QuantSpec(8, -1, True, True),
                                  QuantSpec(4, 32, False)], ids=lambda s: s.label())
def test_explicit_and_shared_factor_give_the_same_result(spec):
    H, W = correlated_hessian(21), weight(22)
    fresh = gptq(W, H, spec, mse_clip=True, static_groups=True)
    again = gptq(W, H, spec, mse_clip=True, static_groups=True)  # the shared factor
    explicit = gptq(W, H, spec, mse_clip=True, static_groups=True,
                    factor=hessian_factor(H, spec.act_order))
    for res in (again, explicit):
        assert torch.equal(res.weight.q, fresh.weight.q)
        assert torch.equal(res.weight.scales, fresh.weight.scales)
        assert res.loss == fresh.loss


def test_shared_factor_follows_the_h_object_and_its_changes():
    spec = QuantSpec(4, 32, True, True)
    H, W = correlated_hessian(23), weight(24)
    first = gptq_mod._shared_factor(H, True, 0.01, 8)
    assert gptq_mod._shared_factor(H, True, 0.01, 8) is first
    assert gptq_mod._shared_factor(H, False, 0.01, 8) is not first  # other column order
    assert gptq_mod._shared_factor(H, True, 0.1, 8) is not first  # other damping
    same_values = H.clone()
    assert gptq_mod._shared_factor(same_values, True, 0.01, 8) is not first  # other object
    before = gptq(W, H, spec)
    H.mul_(4.0)  # modified in place: the version counter changes
    after = gptq(W, H, spec)
    assert gptq_mod._shared_factor(H, True, 0.01, 8).Hinv.abs().max() < first.Hinv.abs().max()
    assert after.loss == pytest.approx(4 * before.loss, rel=1e-5)
    del H, same_values
    assert True not in gptq_mod._SHARED  # dropped with the H it was made for


def test_factor_for_another_h_or_order_is_refused():
    H, W = correlated_hessian(25), weight(26)
    with pytest.raises(ValueError, match="another H or act_order"):
        gptq(W, H, QuantSpec(4, 32, True, True), factor=hessian_factor(H, act_order=False))
    with pytest.raises(ValueError, match="another H or act_order"):
        gptq(W, H, QuantSpec(4, 32, True), factor=hessian_factor(torch.eye(64), False))


def ist_column_loop(W, Hinv, scales, zeros, col_group, maxq, block_size):
    """IST gptq.py's loop as written there ([out, count] blocks, column slices), fp32."""
    W = W.clone()
    Q = torch.zeros_like(W)
    for i1 in range(0, W.shape[1], block_size):
        i2 = min(i1 + block_size, W.shape[1])
        W1, Q1 = W[:, i1:i2].clone(), torch.zeros(W.shape[0], i2 - i1)
        Err1, Hinv1 = torch.zeros_like(Q1), Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            w, d = W1[:, i], Hinv1[i, i]
            s, z = scales[:, col_group[i1 + i]], zeros[:, col_group[i1 + i]]
            Q1[:, i] = (quantize_to_grid(w, s, z, maxq) - z) * s
            err1 = (w - Q1[:, i]) / d
            W1[:, i:] -= err1.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err1
        Q[:, i1:i2] = Q1
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return Q


@pytest.mark.parametrize("block_size", [128, 24])
def test_transposed_column_loop_equals_the_ist_loop(block_size):
    """The blocks run transposed for contiguous memory: the fp32 ops and values are the same,
    so the result is bit for bit the one of the plain loop."""
    H, W = correlated_hessian(27), weight(28)
    f = hessian_factor(H, act_order=True)
    Wp = W[:, f.perm]
    scales, zeros = params_for_groups(Wp.reshape(64, 4, 32), QuantSpec(4, 32, True))
    col_group = torch.arange(128) // 32
    Q_t, q_t, _ = gptq_mod.gptq_columns(Wp.t().contiguous(), f.Hinv, scales, zeros,
                                        col_group, 15, block_size)
    ref = ist_column_loop(Wp, f.Hinv, scales, zeros, col_group, 15, block_size)
    Q, q = Q_t.t(), q_t.t()  # [out, in]
    assert torch.equal(Q, ref)
    assert torch.equal((q.float() - zeros[:, col_group]) * scales[:, col_group], Q)


@pytest.mark.parametrize("spec", [QuantSpec(4, 32, True), QuantSpec(4, 32, False),
                                  QuantSpec(8, -1, True)], ids=lambda s: s.label())
@pytest.mark.parametrize("chunk", [100, 1])  # several rows, one row
def test_chunked_clip_search_equals_the_whole_tensor_search(spec, chunk, monkeypatch):
    """Row chunks give bit for bit the whole-tensor search (that the search takes the best of
    its candidates is tests/calibration/test_rtn.py's float64 test)."""
    W = weight(29, out=48)
    gs = 128 if spec.group_size == -1 else spec.group_size
    Wg = W.reshape(48, 128 // gs, gs)  # [out, G, gs]
    cw = torch.rand(128 // gs, gs, generator=torch.Generator().manual_seed(30)) + 0.1
    for col_weight in (None, cw):
        whole = params_for_groups(Wg, spec, mse_clip=True, col_weight=col_weight)
        monkeypatch.setattr(grid, "CLIP_CHUNK", chunk)
        s, z = params_for_groups(Wg, spec, mse_clip=True, col_weight=col_weight)
        monkeypatch.undo()
        assert torch.equal(s, whole[0]) and torch.equal(z, whole[1])
        if spec.bits == 4:  # (8 bits: min-max is already best on these Gaussian rows)
            assert not torch.equal(s, params_for_groups(Wg, spec)[0])  # it did shrink

"""runtime.fp_head: half-precision embedding table and output head against float64 references."""

from __future__ import annotations

import logging

import pytest
import torch

from quantpipe.runtime import fp_head
from quantpipe.runtime.fp_head import CastEmbedding, HalfLinear, set_half_head
from quantpipe.runtime.kernels import cpu_ext
from tests.tiny_models import make_model


def _fp16_model(tie: bool = True):
    """A tiny model whose weights are fp16-representable (as loaded from an fp16 checkpoint)."""
    model, tok = make_model("llama", tie=tie)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    return model, tok


KERNEL = cpu_ext.kernel_status()[0]


def _unblock(w: torch.Tensor, n: int) -> torch.Tensor:
    """The kernel's [N / 16, K, 16] blocks back to [N, K]; 2-D tensors pass through."""
    return w if w.dim() == 2 else w.transpose(1, 2).reshape(-1, w.shape[1])[:n]


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("mode", ["fp16", "bf16", "auto"])
def test_half_head_matches_float64_reference_of_its_weights(mode, kernel, monkeypatch):
    if kernel and not KERNEL:
        pytest.skip("quantpipe's CPU kernels are not usable here")
    if not kernel:
        monkeypatch.setattr(fp_head.cpu_ext, "kernel_status", lambda: (False, "test"))
    g = torch.Generator().manual_seed(0)
    w16 = (torch.randn(90, 40, generator=g) * 0.1).half()  # [out, in]; 90: padded to 96
    head = HalfLinear(w16, None, mode, torch.float32)
    assert head.kernel == kernel
    # auto: fp16 up to 2 rows with the AVX-512 kernels (bf16_mm is faster above), every M on
    # AVX2 (no bf16 dot product there), 1 row with torch
    auto_rows = (10**9 if cpu_ext.active_isa() == "avx2" else 2) if kernel else 1
    fp16_rows = {"fp16": 10**9, "bf16": 0, "auto": auto_rows}[mode]
    for rows in (1, 2, 3, 9):
        x = torch.randn(rows, 40, generator=g)
        got = head(x).double()
        assert got.shape == (rows, 90) and head(x).dtype == torch.float32
        # the dtype the mode uses for this many rows; inputs are rounded to it as well, except
        # in the fp16 kernel, which keeps fp32 activations
        use16 = rows <= fp16_rows
        dt = (torch.float32 if kernel else torch.float16) if use16 else torch.bfloat16
        want = x.to(dt).double() @ w16.to(dt if use16 else torch.bfloat16).double().T
        other = torch.bfloat16 if use16 else torch.float16
        want_other = x.to(other).double() @ w16.to(other).double().T
        err = (got - want).abs().max()
        # accumulation in fp32 over 40 products, output rounded to dt: a few ulps of dt
        tol = 4 * torch.finfo(dt).eps * want.abs().max()
        assert err <= tol, (mode, rows, float(err), float(tol))
        # and it is distinguishable from the other dtype's result (the dispatch is real)
        assert (got - want_other).abs().max() > err


@pytest.mark.skipif(not KERNEL, reason="quantpipe's CPU kernels are not usable here")
def test_blocked_layouts_and_table_lookups_are_exact():
    w16 = (torch.randn(37, 24) * 0.1).half()
    blocked = fp_head.block_rows(w16)
    assert blocked.shape == (3, 24, 16) and torch.equal(_unblock(blocked, 37), w16)
    pairs = fp_head.block_row_pairs(w16)  # [3, 12, 16, 2]: pairs[b, j, r, e] = w[16b + r, 2j + e]
    assert pairs.shape == (3, 12, 16, 2) and pairs[2, 5, 3, 1] == w16[35, 11]
    assert torch.equal(pairs.permute(0, 2, 1, 3).reshape(48, 24)[:37], w16)
    emb = CastEmbedding(blocked, torch.float32, 37)
    ids = torch.tensor([[0, 15, 16, 36], [5, 5, 31, 1]])
    assert torch.equal(emb(ids), w16[ids].float())


def test_set_half_head_shares_the_tied_fp16_table_and_keeps_outputs():
    model, _ = _fp16_model(tie=True)
    ids = torch.arange(3, 30)[None]
    with torch.no_grad():
        want = model(ids).logits.double()
    set_half_head(model, "fp16")
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(emb, CastEmbedding) and isinstance(head, HalfLinear)
    assert emb.weight.dtype == torch.float16
    assert head.w16.data_ptr() == emb.weight.data_ptr()  # one fp16 table, shared
    with torch.no_grad():
        out = model(ids)
    assert out.logits.dtype == torch.float32
    # embeddings exact; only the head's inputs are rounded to fp16 (2**-11 relative), or
    # nothing at all with the kernel
    rel = (out.logits.double() - want).norm() / want.norm()
    assert rel < 2e-3, float(rel)


def test_set_half_head_untied_and_auto_keeps_both_copies():
    model, _ = _fp16_model(tie=False)
    head_w = model.lm_head.weight.detach().clone()
    set_half_head(model, "auto")
    head = model.get_output_embeddings()
    assert torch.equal(_unblock(head.w16, head_w.shape[0]).float(), head_w)
    w_bf16 = head.w_bf16
    if w_bf16.dim() == 4:  # the kernel's [N / 16, K / 2, 16, 2] pairs
        w_bf16 = w_bf16.permute(0, 2, 1, 3).reshape(-1, head_w.shape[1])[:head_w.shape[0]]
    assert torch.equal(w_bf16, head_w.to(torch.bfloat16))
    assert head.w16.data_ptr() != model.get_input_embeddings().weight.data_ptr()


def test_set_half_head_leaves_non_fp16_weights_alone(caplog):
    model, _ = make_model("llama")  # random fp32 weights: rounding would change the model
    emb = model.get_input_embeddings()
    with caplog.at_level(logging.WARNING, logger="quantpipe.runtime.fp_head"):
        set_half_head(model, "fp16")
    assert model.get_input_embeddings() is emb
    assert "not fp16-representable" in caplog.text
    with pytest.raises(ValueError, match="head dtype"):
        set_half_head(model, "int4")
    with pytest.raises(ValueError, match="fp16 weight"):
        HalfLinear(torch.zeros(4, 4), None, "fp16", torch.float32)


def test_engine_decode_matches_hf_greedy_with_and_without_half_head():
    """One greedy request through the engine == HF generate on the same model object."""
    from quantpipe.runtime.generate import engine_decode

    for mode in ("fp32", "fp16"):
        model, tok = _fp16_model()
        set_half_head(model, mode)
        ids = [5, 9, 23, 7, 11, 40, 3]  # no special ids: HF would mask a pad-id token
        ref = model.generate(torch.tensor([ids]), max_new_tokens=10, min_new_tokens=10,
                             do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
        new, prefill_s, decode_s = engine_decode(model, tok, ids, 10, stop_at_eos=False)
        assert new == ref, mode
        assert prefill_s > 0 and decode_s > 0


def test_int8_head_quantization_bound_and_kernel_match_float64():
    g = torch.Generator().manual_seed(4)
    w16 = (torch.randn(90, 64, generator=g) * 0.1).half()  # 90: padded to 96 in the kernel
    w16[3, :32] = 0  # an all-zero block: scale 0, q 0
    q, scales = fp_head.quantize_head_int8(w16)
    assert q.dtype == torch.int8 and scales.shape == (90, 2) and int(q.abs().max()) <= 127
    w_q = (q.double().view(90, 2, 32) * scales.double()[..., None]).view(90, 64)
    # round to nearest with the fp16 scale: |w - q s| <= s / 2 (+ fp16 rounding of s: the
    # clamped q of the block maximum moves by at most 127 * 2**-11 s)
    bound = scales.double().repeat_interleave(32, 1) * (0.5 + 127 * 2.0**-11)
    assert ((w_q - w16.double()).abs() <= bound).all()
    assert float(w_q[3, :32].abs().max()) == 0.0
    if not KERNEL:
        pytest.skip("quantpipe's CPU kernels are not usable here")
    head = fp_head.Int8Head(w16, None, torch.float32)
    ops = cpu_ext.ops()
    for rows in (1, 3, 9):
        x = torch.randn(rows, 64, generator=g)
        got = head(x).double()
        assert got.shape == (rows, 90)
        # int8 weights times x quantized to int8 per 32 columns (the kernels' quantize_a8):
        # exact integer dots, fp32 scaling and sums
        xq, dx, _ = ops.quantize_a8(x, 32)
        x_q = (xq.double().view(rows, 2, 32) * dx.double()[..., None]).view(rows, 64)
        want = x_q @ w_q.T
        assert ((got - want).abs() <= 1e-5 * (x_q.abs() @ w_q.abs().T) + 1e-30).all()
        # the activation rounding: |x - x_q| <= dx / 2 per element
        assert ((x.double() - x_q).abs() <= dx.double().repeat_interleave(32, 1) / 2).all()


def test_set_half_head_int8_keeps_the_fp16_table_and_falls_back_without_kernels(
        monkeypatch, caplog):
    model, _ = _fp16_model(tie=True)
    ids = torch.arange(3, 30)[None]
    with torch.no_grad():
        want = model(ids).logits.double()
    table = model.get_input_embeddings().weight.detach().half()
    if KERNEL:
        set_half_head(model, "int8")
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        assert isinstance(head, fp_head.Int8Head) and torch.equal(emb.weight, table)
        with torch.no_grad():
            rel = (model(ids).logits.double() - want).norm() / want.norm()
        assert rel < 2e-2, float(rel)  # int8 weights per 32 columns: ~2**-8 relative
    model, _ = _fp16_model(tie=True)
    monkeypatch.setattr(fp_head.cpu_ext, "kernel_status", lambda: (False, "test says no"))
    with caplog.at_level(logging.WARNING, logger="quantpipe.runtime.fp_head"):
        set_half_head(model, "int8")
    assert isinstance(model.get_output_embeddings(), HalfLinear)
    assert model.get_output_embeddings().mode == "fp16"
    assert "test says no" in caplog.text and "fp16 head instead" in caplog.text


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("mode", ["fp16", "fp32"])
def test_tables_loaded_in_fp16_give_the_fp32_models_logits(tie, mode):
    """build_causal_lm(keep_fp16_embeddings=True) + set_half_head(act_dtype=fp32): the runtime's
    low-memory load (no fp32 copy of the table or head is ever made) computes what the fp32 load
    does."""
    from quantpipe.core.hf_model import build_causal_lm

    ref, _ = _fp16_model(tie=tie)
    state = {k: (v.half() if "embed" in k or "lm_head" in k else v.clone())
             for k, v in ref.state_dict().items() if not (tie and k == "lm_head.weight")}
    table = state["model.embed_tokens.weight"]
    model = build_causal_lm(ref.config.to_dict(), state.items(), torch.float32,
                            keep_fp16_embeddings=True)
    assert model.get_input_embeddings().weight.data_ptr() == table.data_ptr()  # kept, no copy
    assert model.model.norm.weight.dtype == torch.float32
    set_half_head(model, mode, act_dtype=torch.float32)
    emb = model.get_input_embeddings()
    if mode == "fp16":
        assert isinstance(emb, CastEmbedding) and emb.weight.data_ptr() in (
            table.data_ptr(), model.get_output_embeddings().w16.data_ptr())
    else:  # fp32 head: the loader's fp16 tables are cast back to the activation dtype
        assert emb.weight.dtype == torch.float32
        assert (model.get_output_embeddings().weight is emb.weight) == tie
    ids = torch.arange(3, 30)[None]
    with torch.no_grad():
        want, got = ref(ids).logits.double(), model(ids).logits
    assert got.dtype == torch.float32
    rel = (got.double() - want).norm() / want.norm()
    assert rel < (2e-3 if mode == "fp16" else 1e-6), float(rel)


@pytest.mark.parametrize("n", [96, 90, 37, 5])
def test_relayout_in_chunks_is_bitwise_the_whole_layouts(n, monkeypatch):
    """The head's copies made a chunk of rows at a time (zero-padded last block included) are
    exactly block_rows / block_row_pairs / the bf16 cast of the whole weight."""
    monkeypatch.setattr(fp_head, "HEAD_CHUNK_ROWS", 32)
    w = (torch.randn(n, 40, generator=torch.Generator().manual_seed(n)) * 3).half()
    blocked, pairs, cast = fp_head.relayout_rows(w, [
        (fp_head._blocked, 16, torch.float16), (fp_head._blocked_pairs, 16, torch.bfloat16),
        (fp_head._rows, 1, torch.bfloat16)])
    assert torch.equal(blocked, fp_head.block_rows(w))
    assert torch.equal(pairs, fp_head.block_row_pairs(w.to(torch.bfloat16)))
    assert torch.equal(cast, w.to(torch.bfloat16))


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_head_read_from_the_checkpoint_file_is_not_kept_resident(kernel, tmp_path, monkeypatch):
    """A head read from its shard (safetensors returns a view of the file mapped
    copy-on-write) is released chunk by chunk while its copy is made: the copy is exact and
    the source's pages are not resident beside it afterwards."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from tests.runtime.test_mapped_embeddings import _mapping, _resident_kb

    if kernel and not KERNEL:
        pytest.skip("quantpipe's CPU kernels are not usable here")
    if not kernel:
        monkeypatch.setattr(fp_head.cpu_ext, "kernel_status", lambda: (False, "test"))
    w_ref = (torch.randn(8192, 1024, generator=torch.Generator().manual_seed(1)) * 0.1).half()
    save_file({"lm_head.weight": w_ref}, str(tmp_path / "h.safetensors"))
    with safe_open(str(tmp_path / "h.safetensors"), framework="pt") as f:
        w = f.get_tensor("lm_head.weight")  # 16 MiB, a view of the file mapping
    assert _mapping(w)[1].endswith("h.safetensors")
    mode = "fp16" if kernel else "bf16"  # the modes that copy the weight
    head = HalfLinear(w, None, mode, torch.float32)
    got = _unblock(head.w16, 8192) if kernel else head.w_bf16
    assert torch.equal(got, w_ref if kernel else w_ref.to(torch.bfloat16))
    assert _resident_kb(w) <= 16 * 1024 // 4  # released as it was copied (all 16 MiB read)

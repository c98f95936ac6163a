import pytest
import torch

from quantpipe.core.qformat import (
    QuantizedWeight,
    QuantSpec,
    column_multiple,
    dequantize,
    pack_int32,
    packed_words,
    resolve_group_size,
    unpack_int32,
)


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_pack_unpack_exact_round_trip(bits):
    g = torch.Generator().manual_seed(bits)
    q = torch.randint(0, 2**bits, (7, 64), generator=g, dtype=torch.int64).to(torch.uint8)
    q[0, :] = 2**bits - 1  # all-ones words exercise the int32 sign bit
    packed = pack_int32(q, bits)
    assert packed.dtype == torch.int32 and packed.shape == (7, 64 * bits // 32)
    assert torch.equal(unpack_int32(packed, bits), q)


@pytest.mark.parametrize("bits", [5, 6])
def test_int5_int6_pack_as_an_int4_plane_then_the_top_bits(bits):
    q = torch.randint(0, 2**bits, (3, 96), generator=torch.Generator().manual_seed(bits),
                      dtype=torch.int64).to(torch.uint8)
    packed = pack_int32(q, bits)
    assert packed.shape == (3, 96 * bits // 32) and packed_words(96, bits) == packed.shape[1]
    assert torch.equal(packed[:, :12], pack_int32(q & 15, 4))  # in / 8 words of low nibbles
    top = unpack_int32(packed[:, 12:], bits - 4)  # then 32 / (bits - 4) top parts per word
    assert torch.equal(top, q >> 4)
    assert column_multiple(bits) == 32 // (bits - 4) and column_multiple(4) == 8
    with pytest.raises(AssertionError, match="not a multiple of"):
        pack_int32(q[:, :40], bits)  # 40 columns are not whole words of the top plane


def test_pack_is_lsb_first():
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]], dtype=torch.uint8)
    word = int(pack_int32(q, 4)[0, 0]) & 0xFFFFFFFF
    assert word == 0xF7654321


def test_spec_validation_messages():
    with pytest.raises(ValueError, match="use one of"):
        QuantSpec(bits=3, group_size=128, sym=True)
    with pytest.raises(ValueError, match="a multiple of 8 input columns .* or -1"):
        QuantSpec(bits=4, group_size=100, sym=True)
    for accepted in (16, 48, 1024, -1):  # what the message says it takes (the writers' packing)
        assert QuantSpec(bits=4, group_size=accepted, sym=True).group_size == accepted
    with pytest.raises(ValueError, match="multiple of 8"):
        QuantSpec(bits=4, group_size=0, sym=True)


def test_resolve_group_size():
    assert resolve_group_size(128, 576) == 64
    assert resolve_group_size(128, 1536) == 128
    assert resolve_group_size(64, 576) == 64
    assert resolve_group_size(-1, 576) == -1
    with pytest.raises(ValueError, match="does not divide in_features 576"):
        resolve_group_size(128, 576, strict=True)


def test_dequantize_matches_float64_reference():
    spec = QuantSpec(4, 32, sym=False)
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (5, 64), generator=g).to(torch.uint8)
    scales = (torch.rand(5, 2, generator=g) + 0.01).half()
    zeros = torch.randint(0, 16, (5, 2), generator=g).to(torch.uint8)
    qw = QuantizedWeight(spec, q, scales, zeros)
    ref = torch.empty(5, 64, dtype=torch.float64)
    for o in range(5):
        for i in range(64):
            ref[o, i] = (int(q[o, i]) - int(zeros[o, i // 32])) * float(scales[o, i // 32])
    torch.testing.assert_close(qw.dequantize(torch.float64), ref, rtol=1e-6, atol=1e-7)
    assert torch.equal(dequantize(q, scales, zeros, qw.group_index()), qw.dequantize())


def test_dequantize_by_row_blocks_equals_float64_whole_layer():
    """A layer of more rows than DEQUANT_ROWS (and not a multiple), act-order groups: the
    block-by-block dequantization is (q - z) * s of the whole layer in float64, exactly (every
    product of a uint8 difference and an fp16 scale is exact in fp32)."""
    from quantpipe.core import qformat

    g = torch.Generator().manual_seed(0)
    rows, cols, gs = qformat.DEQUANT_ROWS * 2 + 37, 256, 64
    q = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.int64).to(torch.uint8)
    scales = (torch.rand(rows, cols // gs, generator=g) + 0.01).half()
    zeros = torch.randint(0, 16, (rows, cols // gs), generator=g, dtype=torch.int64).to(
        torch.uint8)
    g_idx = (torch.randperm(cols, generator=g) // gs).to(torch.int32)
    want = (q.double() - zeros.double()[:, g_idx.long()]) * scales.double()[:, g_idx.long()]
    got = dequantize(q, scales, zeros, g_idx)
    assert got.dtype == torch.float32 and torch.equal(got.double(), want)
    assert torch.equal(dequantize(q, scales, zeros, g_idx, torch.float16), want.half())

"""The runtime over quantized vocabulary tables (``export --vocab-weights``): lookups from the
packed table equal the dequantized rows, the head runs on the kernels (float64 bounds), the
whole model's logits match a float64 reference of the dequantized checkpoint, and a tied
table is held once (file-mapped) with the head made from it."""

from __future__ import annotations

import pytest
import torch

from quantpipe.calibration.vocab import quantize_table
from quantpipe.core.formats.loader import load_dequantized_model, load_quantized
from quantpipe.core.qformat import QuantSpec, pack_int32
from quantpipe.runtime.kernels import cpu_ext
from quantpipe.runtime.kernels.layout import PackedLinear
from quantpipe.runtime.loader import load_quantized_model
from quantpipe.runtime.quant_embedding import QuantEmbedding
from quantpipe.runtime.quant_linear import QuantLinear
from tests.quantpipe.test_vocab_export import EMB, tied, untied  # noqa: F401 (fixtures)

SPECS = [QuantSpec(8, -1, True), QuantSpec(4, 32, True), QuantSpec(8, 32, True),
         QuantSpec(4, 64, False)]
IDS = torch.tensor([[3, 17, 5, 199, 9, 41, 11, 0], [1, 1, 2, 150, 7, 8, 190, 6]])


def _table(spec: QuantSpec, vocab: int = 200, hidden: int = 128):
    """A random fp16 table, RTN-quantized (asym: random zeros), as packed tensors."""
    gen = torch.Generator().manual_seed(1)
    table = (torch.randn(vocab, hidden, generator=gen) * 0.05).half()  # [vocab, hidden]
    qw = quantize_table(table, QuantSpec(spec.bits, spec.group_size, True))
    if not spec.sym:  # the module reads stored zeros too
        zeros = torch.randint(0, spec.maxq + 1, qw.zeros.shape, generator=gen, dtype=torch.uint8)
        qw = type(qw)(spec, qw.q, qw.scales, zeros)
    return qw, pack_int32(qw.q, spec.bits)  # [vocab, hidden * bits / 32] int32


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label())
def test_lookup_equals_the_dequantized_rows(spec):
    qw, qweight = _table(spec)
    emb = QuantEmbedding(spec, qweight, qw.scales, None if spec.sym else qw.zeros,
                         torch.float32, embed_scale=torch.tensor(8.0))
    ref64 = qw.dequantize(torch.float64)[IDS]  # [2, 8, hidden] float64
    rows = emb.rows(IDS)
    # the same fp32 operations as qformat.dequantize, whose products of an fp16 scale and
    # an integer below 2**8 are exact in fp32: equal to the float64 rows, tolerance 0
    assert rows.dtype == torch.float32 and torch.equal(rows.double(), ref64)
    assert torch.equal(rows, qw.dequantize(torch.float32)[IDS])
    assert torch.equal(emb(IDS).double(), ref64 * 8.0)  # embed_scale 8: exact
    assert emb(IDS).shape == (2, 8, 128)


@pytest.mark.skipif(not cpu_ext.kernel_status()[0], reason="quantpipe's CPU kernels unusable")
@pytest.mark.parametrize("spec", [QuantSpec(8, -1, True), QuantSpec(4, 32, True)],
                         ids=lambda s: s.label())
def test_head_on_the_kernels_within_float64_bounds(spec):
    """The head as a QuantLinear on quantpipe's kernels: int8 (exact int8 weights, fp32
    activations) within fp32 summation error; int4 runs W4A8 (activations quantized to int8
    per 32 columns), within the bound that rounding gives: sum over blocks of half the
    block's step (amax / 127 / 2) times the block's sum of |w|."""
    qw, qweight = _table(spec, vocab=208)  # 13 blocks of 16 rows
    head = QuantLinear(PackedLinear(spec, qweight, qw.scales, None, None, None, 128), "cpu")
    want = ("w8a32", "int8pack") if spec.bits == 8 else "w4a8"
    assert head.backend.startswith(want), head.backend
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    w64 = qw.dequantize(torch.float64)  # [vocab, hidden]
    ref = x.double() @ w64.T  # [3, vocab]
    err = (head(x).double() - ref).abs()
    fp32 = 1e-5 * (x.double().abs() @ w64.abs().T) + 1e-6  # fp32 sums of 128 products
    if spec.bits == 8:
        assert bool((err <= fp32).all()), float((err - fp32).max())
    else:
        xb = x.double().view(3, 4, 32)  # [M, blocks, 32]
        half_step = xb.abs().amax(-1) / 127 / 2  # [M, blocks]
        wb = w64.abs().view(-1, 4, 32).sum(-1)  # [vocab, blocks]
        bound = half_step @ wb.T + fp32  # [M, vocab]
        assert bool((err <= bound).all()), float((err - bound).max())


def test_head_falls_back_to_torch_where_no_kernel_fits():
    """A vocabulary that is not a multiple of 16 rows: the dequant fallback, fp32 exact."""
    spec = QuantSpec(4, 32, True)
    qw, qweight = _table(spec, vocab=201)
    head = QuantLinear(PackedLinear(spec, qweight, qw.scales, None, None, None, 128), "cpu")
    assert head.backend == "dequant"
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(3))
    ref = x.double() @ qw.dequantize(torch.float64).T
    assert torch.allclose(head(x).double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["tied-int4", "tied-int8", "untied-int8"])
def test_runtime_logits_match_a_float64_reference(case, request):
    """Every linear and the head on the torch fallback (dequantize in fp32, matmul): the
    runtime model's logits equal the float64 dequantized model's within fp32 rounding through
    two layers (1e-4 of the largest logit), and its table is a QuantEmbedding."""
    which, weights = case.split("-")
    qdir = request.getfixturevalue(which)[weights]
    ref = load_dequantized_model(qdir, torch.float64)
    model = load_quantized_model(qdir, "cpu", torch.float32, backend="dequant")
    assert isinstance(model.get_input_embeddings(), QuantEmbedding)
    assert isinstance(model.get_output_embeddings(), QuantLinear)
    with torch.no_grad():
        want = ref(IDS).logits
        got = model(IDS).logits.double()
    tol = 1e-4 * float(want.abs().max())
    assert float((got - want).abs().max()) <= tol


def test_tied_table_held_once_from_the_file(tied):  # noqa: F811
    """The embedding reads the shard through a read-only map (only rows looked up become
    resident); the head is a QuantLinear made from the same stored tensors; no model
    parameter holds a dense table."""
    model = load_quantized_model(tied["int8"], "cpu", torch.float32)
    emb = model.get_input_embeddings()
    with open("/proc/self/maps") as f:
        regions = [line.split() for line in f]
    addr = emb.qweight.data_ptr()
    region = next(r for r in regions if int(r[0].split("-")[0], 16) <= addr
                  < int(r[0].split("-")[1], 16))
    assert region[1].startswith("r") and "w" not in region[1]  # read-only
    assert region[-1].endswith(".safetensors")  # a map of the checkpoint's shard
    head = model.get_output_embeddings()
    ckpt = load_quantized(tied["int8"])
    x = torch.randn(1, 64)
    w = ckpt.embeddings[EMB].dequantize(torch.float64)
    assert torch.allclose(head(x).double(), x.double() @ w.T, rtol=1e-5, atol=1e-5)
    big = [n for n, p in [*model.named_parameters(), *model.named_buffers()]
           if p.is_floating_point() and p.numel() >= emb.num_embeddings * emb.embedding_dim]
    assert not big, big


def test_engine_serves_a_quantized_table(tied):  # noqa: F811
    """load_model_for_serving keeps the checkpoint's tables whatever the head dtype, and
    the engine decodes greedily what full forwards of the same model pick."""
    from quantpipe.runtime.engine import (
        EngineConfig,
        LLMEngine,
        SamplingParams,
        load_model_for_serving,
    )
    from tests.tiny_models import hf_greedy

    model, tok = load_model_for_serving(tied["int4"], "cpu", torch.float32, head_dtype="int8")
    assert isinstance(model.get_input_embeddings(), QuantEmbedding)
    assert isinstance(model.get_output_embeddings(), QuantLinear)
    prompts = [[3, 17, 5, 199, 9], [40, 2, 77]]
    want = [hf_greedy(model, p, 6) for p in prompts]
    eng = LLMEngine(model, tok, EngineConfig(block_size=4, max_num_seqs=4,
                                             max_num_batched_tokens=64, kv_cache_memory=2**20))
    assert eng.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True)) == want

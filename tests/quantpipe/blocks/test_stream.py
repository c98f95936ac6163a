"""Calibration streams the model: one decoder block's weights in memory at a time."""

import json

import pytest
import torch
from safetensors import safe_open

from quantpipe.blocks.stream import ModelStream
from quantpipe.calibration import block_step, pipeline, two_stream
from quantpipe.calibration.pipeline import CalibrateSpec, calibrate
from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16
from tests.tiny_models import CORPUS, make_model, save_model


@pytest.fixture(scope="module")
def deep_fp16(tmp_path_factory):
    """A 4-block tiny Llama: depth must not change what calibration holds at once."""
    tmp = tmp_path_factory.mktemp("deep")
    model, tok = make_model("llama", num_hidden_layers=4, tie=False)
    src = save_model(model, tok, tmp / "src")
    export_fp16(Fp16ExportSpec(str(src), tmp / "fp16"))
    return tmp / "fp16"


def _block_params(fp16_dir, block: int) -> int:
    """Parameters of one decoder block, counted in the FP16 shards."""
    index = json.loads((fp16_dir / "model.safetensors.index.json").read_text())
    total = 0
    for name, fname in index["weight_map"].items():
        if name.startswith(f"model.layers.{block}."):
            with safe_open(str(fp16_dir / fname), framework="pt") as f:
                total += torch.Size(f.get_slice(name).get_shape()).numel()
    return total


@pytest.mark.parametrize("algo", ["rtn", "gptq", "awq"])
def test_one_block_materialised_at_a_time(deep_fp16, tmp_path, monkeypatch, algo):
    streams: list[ModelStream] = []
    real_init = ModelStream.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        streams.append(self)

    seen: list[int] = []
    real_run_block = pipeline.run_block

    def counting_run_block(block, hidden, ctx, batch_size, **kw):
        seen.append(streams[-1].materialised_parameters())  # every forward of a block
        return real_run_block(block, hidden, ctx, batch_size, **kw)

    monkeypatch.setattr(ModelStream, "__init__", init)
    for module in (pipeline, block_step, two_stream):  # every caller of run_block
        monkeypatch.setattr(module, "run_block", counting_run_block)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{p} {i}"}) + "\n"
                               for i in range(6) for p in CORPUS[:8]))
    calibrate(CalibrateSpec(deep_fp16, tmp_path / "calib", str(prompts), algo=algo,
                            group_size=32, samples=4, seq_len=32, min_tokens=4, batch_size=4,
                            awq_samples=2))
    assert len(streams) == 1 and len(seen) >= 4
    assert max(seen) == _block_params(deep_fp16, 0)  # one block, never two, never the embeddings
    assert streams[0].materialised_parameters() == 0  # all released at the end


def test_stream_load_releases_on_error(deep_fp16):
    stream = ModelStream(deep_fp16)
    with pytest.raises(RuntimeError, match="boom"):
        with stream.load("model.layers.1") as block:
            assert not block.self_attn.q_proj.weight.is_meta
            raise RuntimeError("boom")
    assert stream.materialised_parameters() == 0


def test_stream_block_equals_the_full_model(deep_fp16):
    """A streamed block computes what the same block of the eagerly loaded model computes."""
    from transformers import AutoModelForCausalLM

    from quantpipe.blocks.execute import embed_inputs

    full = AutoModelForCausalLM.from_pretrained(deep_fp16, dtype=torch.float32).eval()
    stream = ModelStream(deep_fp16)
    ids = torch.randint(0, 300, (2, 16))  # [batch, seq]
    with torch.no_grad():
        h_full, ctx = embed_inputs(full, ids)
        with stream.load("model.embed_tokens"):
            h_stream, _ = embed_inputs(stream.model, ids)
        torch.testing.assert_close(h_stream, h_full, rtol=0, atol=0)
        with stream.load("model.layers.2") as block:
            got = block(h_full, **ctx.kwargs())
        want = full.model.layers[2](h_full, **ctx.kwargs())
    got = got[0] if isinstance(got, tuple) else got
    want = want[0] if isinstance(want, tuple) else want
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["native", "gptq", "compressed-tensors"])
def test_export_streams_one_layer_at_a_time(deep_fp16, tmp_path, monkeypatch, fmt):
    """export holds one unpacked layer and one output shard, never the model."""
    import gc
    import weakref

    from quantpipe.core.formats import load_quantized
    from quantpipe.core.qformat import LazyWeights
    from quantpipe.stages.export import ExportSpec, export_quantized
    from tests.quantpipe.test_formats_common import track_shard_writes

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{p} {i}"}) + "\n"
                               for i in range(6) for p in CORPUS[:8]))
    calib = tmp_path / "calib"
    calibrate(CalibrateSpec(deep_fp16, calib, str(prompts), algo="rtn", group_size=32,
                            samples=4, seq_len=32, min_tokens=4, batch_size=4))
    alive: list[weakref.ref] = []
    peak = [0]
    real_getitem = LazyWeights.__getitem__

    def tracking_getitem(self, name):
        gc.collect()  # only references that really remain count
        peak[0] = max(peak[0], sum(r() is not None for r in alive) + 1)
        qw = real_getitem(self, name)
        alive.append(weakref.ref(qw.q))  # q: [out, in] uint8, the unpacked weight
        return qw

    monkeypatch.setattr(LazyWeights, "__getitem__", tracking_getitem)
    stats = track_shard_writes(monkeypatch)
    export_quantized(ExportSpec(calib, tmp_path / "q", 4, fmt, max_shard_size="60000B"))
    # a loop's previous layer is released when the next one is bound: 2 at most
    assert peak[0] <= 2, f"export held {peak[0]} unpacked layers at once"
    assert len(stats["shards"]) > 2
    # the tensors of one packed layer (qweight, scales, zeros, g_idx), never a shard's worth
    assert stats["alive"] <= 4, f"{stats['alive']} tensors alive at once"
    assert len(load_quantized(tmp_path / "q").layers) == 4 * 7

"""export-fp16 of MoE checkpoints as the hub and llama.cpp lay them out (experts per expert, or
3-D GGUF tensors): streamed a tensor (an expert's part) at a time, bit for bit the whole-model
load's output."""

import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import quantpipe.core.io as qio
import quantpipe.stages.fp16_export as fe
from quantpipe.core.io import read_manifest
from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16
from tests.tiny_gguf import save_gguf, tiny_moe_for_gguf
from tests.tiny_models import MOE_FAMILIES, make_family_model, save_model

ROOT = Path(__file__).resolve().parents[2]


def _no_whole_load(*args, **kwargs):
    raise AssertionError("the streamed export loaded the whole model")


def _whole_export(monkeypatch, source: str, out: Path, **kw):
    with monkeypatch.context() as m:
        m.setattr(fe, "stream_plan", lambda *a, **k: None)  # the whole-model path
        return export_fp16(Fp16ExportSpec(source, out, **kw))


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in read_manifest(folder, "fp16")["shards"]:
        out.update(load_file(folder / shard["file"]))
    return out


def _same_export(a: Path, b: Path, ignore_config: tuple[str, ...] = ()) -> None:
    """Two FP16 folders hold the same shards (bytes), manifest entries and config."""
    ma, mb = read_manifest(a, "fp16"), read_manifest(b, "fp16")
    assert ma["shards"] == mb["shards"]  # names, sha256, sizes, tensor counts
    assert ma["num_parameters"] == mb["num_parameters"]
    ta, tb = _tensors(a), _tensors(b)
    assert list(ta) == list(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    ca, cb = (json.loads((f / "config.json").read_text()) for f in (a, b))
    for key in ignore_config:
        ca.pop(key, None), cb.pop(key, None)
    assert ca == cb


def _logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits.double()


def _track_adds(monkeypatch) -> dict:
    """{"alive": most tensors handed to the shard writer still referenced at one add,
    "shards": shards finished}. Nothing here makes reference cycles, so a tensor dropped is
    freed at once: no gc.collect() per tensor (slow in a large test process)."""
    seen: list[weakref.ref] = []
    stats = {"alive": 0, "shards": 0}
    real_add, real_finish = qio.StreamingShard.add, qio.StreamingShard.finish

    def add(self, name, t):
        stats["alive"] = max(stats["alive"], sum(r() is not None for r in seen) + 1)
        seen.append(weakref.ref(t))
        return real_add(self, name, t)

    def finish(self, metadata):
        stats["shards"] += 1
        return real_finish(self, metadata)

    monkeypatch.setattr(qio.StreamingShard, "add", add)
    monkeypatch.setattr(qio.StreamingShard, "finish", finish)
    return stats


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_hub_layout_moe_streams_bit_for_bit(family, tmp_path, monkeypatch):
    """Mixtral's block_sparse_moe.experts.E.w1/w2/w3 and Qwen-MoE's mlp.experts.E.* (a bf16
    source: every tensor cast) are renamed and fused per tensor: never the model, never a
    fused [E, 2I, H] tensor in memory; the output equals the whole-model load's byte for byte
    and gives the source model's logits."""
    model, tok = make_family_model(family)
    src = save_model(model, tok, tmp_path / "src", dtype=torch.bfloat16)
    stored = set(qio.LazyTensors.of_folder(src))
    assert any(".experts.0." in k for k in stored) and not any("gate_up" in k for k in stored)
    reads: dict[str, int] = {}
    real_get = qio.LazyTensors.__getitem__

    def counted_get(self, key):
        t = real_get(self, key)
        assert key not in reads, f"{key} read twice"
        reads[key] = t.numel()
        return t

    kinds: dict[str, type] = {}
    real_converted = fe.StreamPlan.converted

    def converted(self, name):
        t = real_converted(self, name)
        kinds[name] = type(t)
        return t

    with monkeypatch.context() as m:
        stats = _track_adds(m)
        m.setattr(fe, "load_model", _no_whole_load)
        m.setattr(qio.LazyTensors, "__getitem__", counted_get)
        m.setattr(fe.StreamPlan, "converted", converted)
        export_fp16(Fp16ExportSpec(str(src), tmp_path / "streamed", max_shard_size="150KB"))
    assert stats["alive"] == 1 and stats["shards"] > 1
    assert set(reads) == stored  # each stored tensor read once
    experts = model.model.layers[0].mlp.experts
    part = experts.down_proj[0].numel()  # one expert's gate, up or down: [32, 64] / [64, 32]
    assert {n for k, n in reads.items() if ".experts." in k} == {part}
    fused = [k for k in kinds if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(fused) == 4 and all(kinds[k] is qio.ChunkedTensor for k in fused)  # by parts
    _whole_export(monkeypatch, str(src), tmp_path / "whole", max_shard_size="150KB")
    _same_export(tmp_path / "streamed", tmp_path / "whole")

    ids = torch.randint(0, model.config.vocab_size, (2, 12),
                        generator=torch.Generator().manual_seed(1))
    got = _logits(tmp_path / "streamed", ids)
    assert torch.equal(got, _logits(tmp_path / "whole", ids))
    # transformers' own load of the hub checkpoint (its rename and fuse), the same ops: bf16
    # -> fp16 is exact but for the few weights below fp16's normal range (|w| < 6.1e-5, fp16
    # subnormals), so the logits agree to ~1e-6
    torch.testing.assert_close(got, _logits(src, ids), rtol=1e-5, atol=1e-5)


def test_expert_part_of_the_wrong_shape_is_refused_naming_it(tmp_path):
    model, tok = make_family_model("mixtral")
    src = save_model(model, tok, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 16  # the experts are 32 wide
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"block_sparse_moe\.experts\.0\.w1\.weight has shape "
                                         r"\[32, 64\].*\[16, 64\].*config\.json"):
        export_fp16(Fp16ExportSpec(str(src), tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_fp16_overflow_in_an_expert_is_refused_naming_its_hub_tensor(tmp_path):
    model, tok = make_family_model("mixtral")
    with torch.no_grad():
        model.model.layers[1].mlp.experts.gate_up_proj[2, 40, 3] = 7e4  # expert 2's up (w3)
    src = save_model(model, tok, tmp_path / "src")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.block_sparse_moe\.experts\.2\.w3"
                                         r"\.weight has \|value\| up to 7e\+04.*--dtype bf16"):
        export_fp16(Fp16ExportSpec(str(src), tmp_path / "out"))
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "src"]


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_gguf_moe_streams_bit_for_bit(family, tmp_path, monkeypatch):
    """A Qwen MoE GGUF's 3-D ffn_{gate,up,down}_exps (Q8_0) are read and dequantized one
    expert at a time; the output equals transformers' whole-model load byte for byte."""
    model, tok = tiny_moe_for_gguf(family)
    gguf = save_gguf(model, tok, tmp_path / f"{family}.gguf", expert_qtype="Q8_0")
    reads: dict[str, int] = {}
    real_get = fe.GGUFTensors.__getitem__

    def counted_get(self, key):
        t = real_get(self, key)
        reads[key] = t.numel()
        return t

    with monkeypatch.context() as m:
        m.setattr(fe, "load_model", _no_whole_load)
        m.setattr(fe.GGUFTensors, "__getitem__", counted_get)
        export_fp16(Fp16ExportSpec(str(gguf), tmp_path / "streamed", max_shard_size="300KB"))
    experts = model.model.layers[0].mlp.experts.down_proj  # [E, H, I]
    # each expert's gate, up and down read alone: [I, H] / [H, I]
    assert {n for k, n in reads.items() if ".experts." in k} == {experts[0].numel()}
    assert len([k for k in reads if ".experts." in k]) == 2 * 3 * experts.shape[0]
    _whole_export(monkeypatch, str(gguf), tmp_path / "whole", max_shard_size="300KB")
    # the streamed config names its architecture, as a loaded model's saved config does
    _same_export(tmp_path / "streamed", tmp_path / "whole", ignore_config=("architectures",))


def test_mixtral_gguf_is_read_as_mixtral(tmp_path, monkeypatch):
    """llama.cpp writes Mixtral as a "llama" GGUF with experts, which transformers loads as a
    dense Llama with random MLPs: quantpipe reads it as Mixtral, tensor for tensor the model
    the file was written from (F16 experts: exact in fp16)."""
    model, tok = make_family_model("mixtral")
    gguf = save_gguf(model, tok, tmp_path / "mixtral.gguf", expert_qtype="F16")
    with monkeypatch.context() as m:
        m.setattr(fe, "load_model", _no_whole_load)
        export_fp16(Fp16ExportSpec(str(gguf), tmp_path / "fp16"))
    cfg = json.loads((tmp_path / "fp16" / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["architectures"] == ["MixtralForCausalLM"]
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (4, 2)
    got = _tensors(tmp_path / "fp16")
    want = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    assert list(got) == list(want)
    for k, v in want.items():
        assert torch.equal(got[k], v.to(torch.float16)), k
    ids = torch.randint(0, model.config.vocab_size, (2, 12),
                        generator=torch.Generator().manual_seed(1))
    # the same fp16 weights saved as a hub folder and loaded by transformers (fp16 rounding
    # alone can flip a route against the fp32 model); rms_norm_eps went through the file's
    # float32 (1e-5 -> 9.99...e-6), so equal to rounding
    ref = _logits(save_model(model, tok, tmp_path / "ref", dtype=torch.float16), ids)
    torch.testing.assert_close(_logits(tmp_path / "fp16", ids), ref, rtol=1e-5, atol=1e-5)


# runs `quantpipe export-fp16`; once the stream plan is made (imports done, config, tokenizer
# and meta skeleton built) it records VmRSS and resets the peak (clear_refs 5), and at exit
# writes both: the peak of the conversion itself, whatever the interpreter's fixed cost
_RSS_WRAPPER = """
import atexit, json, re, runpy, sys
import quantpipe.stages.fp16_export as fe
out = sys.argv.pop(1)
rec = {}
def kb(field):
    return int(re.search(field + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))
real = fe.stream_plan
def plan(*a, **k):
    p = real(*a, **k)
    rec["rss_at_plan_kb"] = kb("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")
    return p
fe.stream_plan = plan
atexit.register(lambda: open(out, "w").write(json.dumps(dict(rec, hwm_kb=kb("VmHWM")))))
sys.argv[0] = "quantpipe"
runpy.run_module("quantpipe.cli", run_name="__main__")
"""


def test_moe_export_memory_is_bounded_by_an_expert_not_the_model(tmp_path):
    """bench/scale.py's mixtral-smoke (8 experts of 2048 x 1024, 2 layers, 220 MB of fp16,
    hub names): `quantpipe export-fp16` peaks less than a quarter of the model above its
    memory once the plan is made (a whole load needs the model; a fused experts tensor alone
    is 67 MB, 30% of it). The Mixtral-8x7B-shaped number is bench/scale.py's
    (bench/results/scale-mixtral-8x7b-2-export-fp16.json)."""
    sys.path.insert(0, str(ROOT / "bench"))
    scale = pytest.importorskip("scale")
    src = tmp_path / "source"
    model_bytes = scale.make_source("mixtral-smoke", src)
    rec_path = tmp_path / "rss.json"
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_WRAPPER, str(rec_path), "export-fp16", str(src),
         "--out", str(tmp_path / "fp16")],
        capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = json.loads(rec_path.read_text())
    conversion = (rec["hwm_kb"] - rec["rss_at_plan_kb"]) * 1024
    assert conversion < model_bytes / 4, (conversion / 2**20, model_bytes / 2**20)
    index = json.loads((tmp_path / "fp16" / "model.safetensors.index.json").read_text())
    assert "model.layers.1.mlp.experts.gate_up_proj" in index["weight_map"]
    assert index["metadata"]["total_size"] == model_bytes

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from quantpipe.cli import main
from quantpipe.core.io import read_manifest, sha256_file
from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16
from tests.tiny_models import make_model, save_model


def test_export_loads_and_matches_logits(tiny_model_dir, tmp_path):
    out = tmp_path / "fp16"
    res = export_fp16(Fp16ExportSpec(str(tiny_model_dir), out))
    manifest = read_manifest(out, "fp16")
    assert manifest["num_parameters"] == res.num_parameters
    for shard in manifest["shards"]:
        assert sha256_file(out / shard["file"]) == shard["sha256"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert (out / "tokenizer.json").is_file()

    src = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    dst = AutoModelForCausalLM.from_pretrained(out)
    assert dst.dtype == torch.float16
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, src.config.vocab_size, (2, 12), generator=gen)
    with torch.no_grad():
        ref = src(ids).logits.double()
        got = dst.float()(ids).logits.double()
    # fp16 weight rounding: relative error ~2^-11 per weight, accumulated over 2 tiny blocks
    assert (got - ref).abs().max() < 2e-2 * ref.abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_sharding_and_untied(tmp_path):
    model, tok = make_model("llama", tie=False)
    src = save_model(model, tok, tmp_path / "src")
    out = tmp_path / "fp16"
    res = export_fp16(Fp16ExportSpec(str(src), out, dtype="bf16", max_shard_size="40KB"))
    assert len(res.shards) > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" in index["weight_map"]
    names = set()
    for shard in res.shards:
        t = load_file(out / shard["file"])
        assert all(v.dtype == torch.bfloat16 for v in t.values())
        names |= set(t)
    assert names == set(index["weight_map"])


def test_refuses_fp16_overflow(tmp_path):
    model, tok = make_model("llama")
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = 1e6
    src = save_model(model, tok, tmp_path / "src")
    with pytest.raises(ValueError, match="--dtype bf16"):
        export_fp16(Fp16ExportSpec(str(src), tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    export_fp16(Fp16ExportSpec(str(src), tmp_path / "out", dtype="bf16"))


def test_cli_errors(tmp_path, tiny_llama_dir):
    runner = CliRunner()
    r = runner.invoke(main, ["export-fp16", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert r.exit_code != 0 and "unknown model source" in r.output
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("precious")
    r = runner.invoke(main, ["export-fp16", str(tiny_llama_dir), "--out", str(tmp_path / "busy")])
    assert r.exit_code != 0 and "--force" in r.output
    assert (tmp_path / "busy" / "keep.txt").read_text() == "precious"
    r = runner.invoke(main, ["export-fp16", str(tmp_path), "--out", str(tmp_path / "o2")])
    assert r.exit_code != 0 and "without config.json" in r.output
    r = runner.invoke(main, ["export-fp16", str(tiny_llama_dir), "--out", str(tmp_path / "busy"),
                             "--force"])
    assert r.exit_code == 0, r.output
    assert not (tmp_path / "busy" / "keep.txt").exists()
    read_manifest(tmp_path / "busy", "fp16")


def test_killed_export_leaves_nothing_valid(tmp_path, tiny_llama_dir):
    """SIGKILL the export while it writes: the target folder must not exist afterwards."""
    out = tmp_path / "fp16"
    code = (
        "import os, signal, quantpipe.core.io as io\n"
        "orig = io.StreamingShard.finish\n"
        "def boom(*a, **k):\n"  # killed right after the first shard is written
        "    orig(*a, **k)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "io.StreamingShard.finish = boom\n"
        "import quantpipe.stages.fp16_export as fe\n"
        "from pathlib import Path\n"
        f"fe.export_fp16(fe.Fp16ExportSpec({str(tiny_llama_dir)!r}, Path({str(out)!r})))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    # the lock file stays behind, unlocked: the OS released the lock with the process
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != ".fp16.lock"]
    assert all(name.startswith(".fp16.partial-") for name in leftovers)
    with pytest.raises(ValueError, match="no quantpipe.json"):
        read_manifest(leftovers and tmp_path / leftovers[0])


def test_disk_full_leaves_nothing_and_names_the_file(tmp_path, tiny_llama_dir, monkeypatch):
    """ENOSPC on the second shard: OSError naming it; no DIR, no temp folder, no lock left."""
    import errno

    import quantpipe.core.io as qio

    orig = qio.write_bytes

    def full_on_second(f, data):
        if "model-00002" in f.name:  # the second shard's first write: the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return orig(f, data)

    monkeypatch.setattr(qio, "write_bytes", full_on_second)
    out = tmp_path / "fp16"
    with pytest.raises(OSError) as info:
        export_fp16(Fp16ExportSpec(str(tiny_llama_dir), out, max_shard_size="40KB"))
    assert info.value.errno == errno.ENOSPC
    assert "/.fp16.partial-" in info.value.filename  # the hidden folder, never DIR
    assert Path(info.value.filename).name.startswith("model-00002")  # the second shard
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tie", [True, False])
def test_streamed_export_equals_whole_model_export(tmp_path, monkeypatch, tie):
    """A safetensors folder is converted tensor by tensor, never loaded whole, one tensor in
    memory at a time; the result is the whole-model path's, tensor for tensor."""
    import quantpipe.stages.fp16_export as fe
    from tests.quantpipe.test_formats_common import track_shard_writes

    model, tok = make_model("qwen2", tie=tie)  # qkv biases too
    src = save_model(model, tok, tmp_path / "src")
    limit = 40_000

    def no_whole_load(*args, **kwargs):
        raise AssertionError("the streamed export loaded the whole model")

    with monkeypatch.context() as m:
        stats = track_shard_writes(m)
        m.setattr(fe, "load_model", no_whole_load)
        streamed = export_fp16(Fp16ExportSpec(str(src), tmp_path / "streamed",
                                              max_shard_size=f"{limit}B"))
    assert len(stats["shards"]) > 1
    biggest_tensor = max(t.numel() * 2 for t in model.state_dict().values())
    assert max(stats["shards"]) <= max(limit, biggest_tensor)
    assert stats["alive"] == 1  # each tensor is on disk before the next is read
    with monkeypatch.context() as m:
        m.setattr(fe, "stream_plan", lambda *a, **k: None)  # the whole-model path
        whole = export_fp16(Fp16ExportSpec(str(src), tmp_path / "whole",
                                           max_shard_size=f"{limit}B"))
    assert streamed.num_parameters == whole.num_parameters

    def tensors(folder):
        out = {}
        for shard in read_manifest(folder, "fp16")["shards"]:
            out.update(load_file(folder / shard["file"]))
        return out

    a, b = tensors(tmp_path / "streamed"), tensors(tmp_path / "whole")
    assert list(a) == list(b)  # same names in the same order
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    ca = json.loads((tmp_path / "streamed" / "config.json").read_text())
    cb = json.loads((tmp_path / "whole" / "config.json").read_text())
    assert ca == cb
    assert ("lm_head.weight" in a) is (not tie)


def test_streamed_export_refuses_fp16_overflow(tmp_path):
    model, tok = make_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = 7e4
    src = save_model(model, tok, tmp_path / "src")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight .*--dtype bf16"):
        export_fp16(Fp16ExportSpec(str(src), tmp_path / "out"))
    assert not (tmp_path / "out").exists()

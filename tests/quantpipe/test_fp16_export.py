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
from quantpipe.fp16_export import Fp16ExportSpec, export_fp16
from quantpipe.io import read_manifest, sha256_file
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
        "import os, signal, quantpipe.io as io\n"
        "orig = io.save_sharded\n"
        "def boom(*a, **k):\n"
        "    orig(*a, **k)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "io.save_sharded = boom\n"
        "import quantpipe.fp16_export as fe\n"
        "fe.save_sharded = boom\n"
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

    from safetensors import SafetensorError

    import quantpipe.io as qio

    orig, calls = qio.save_file, []

    def full_on_second(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise SafetensorError("Error while serializing: I/O error: No space left on "
                                  "device (os error 28)")
        return orig(tensors, filename, metadata=metadata)

    monkeypatch.setattr(qio, "save_file", full_on_second)
    out = tmp_path / "fp16"
    with pytest.raises(OSError) as info:
        export_fp16(Fp16ExportSpec(str(tiny_llama_dir), out, max_shard_size="40KB"))
    assert info.value.errno == errno.ENOSPC
    assert "/.fp16.partial-" in info.value.filename  # the hidden folder, never DIR
    assert Path(info.value.filename).name.startswith("model-00002-of-")
    assert not out.exists() and list(tmp_path.iterdir()) == []

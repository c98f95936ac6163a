"""Loading a verified checkpoint again skips the hashes (a stamp keyed by each file's size,
mtime, inode and ctime), never for a changed file; config.json and tokenizer files are hashed
and checked; absurd config sizes are refused from the headers before a model is built."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from quantpipe.core import io as qio
from quantpipe.core.formats import load_quantized, verify_checkpoint, write_checkpoint
from quantpipe.core.qformat import QuantSpec
from quantpipe.core.verified import STAMP_NAME
from tests.quantpipe.test_formats_common import export_tiny, quantize_plan


@pytest.fixture(scope="module")
def native_dir(tiny_llama_dir, tmp_path_factory):
    fp16 = export_tiny(tiny_llama_dir, tmp_path_factory.mktemp("stamp") / "fp16")
    out = tmp_path_factory.mktemp("stamp") / "native"
    write_checkpoint("native", out, fp16, quantize_plan(fp16, [QuantSpec(4, 32, True)]))
    return out


@pytest.fixture
def qdir(native_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no stamp outside tmp_path
    dst = tmp_path / "q"
    shutil.copytree(native_dir, dst)
    (dst / STAMP_NAME).unlink(missing_ok=True)
    return dst


@pytest.fixture
def hashed(monkeypatch):
    """The files sha256_file reads, in order."""
    seen: list[str] = []
    real = qio.sha256_file

    def spy(path, *args, **kwargs):
        seen.append(os.path.basename(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(qio, "sha256_file", spy)
    return seen


def _shard(folder):
    return sorted(folder.glob("*.safetensors"))[0]


def _manifest(folder):
    return json.loads((folder / qio.MANIFEST_NAME).read_text())


def test_second_load_uses_the_stamp_and_verify_always_hashes(qdir, hashed):
    assert load_quantized(qdir).report.checked == "full"
    assert (qdir / STAMP_NAME).is_file() and _shard(qdir).name in hashed
    hashed.clear()
    assert load_quantized(qdir).report.checked == "stamp" and hashed == []
    report = verify_checkpoint(qdir)  # the command: every byte, whatever the stamp says
    assert report.checked == "full" and _shard(qdir).name in hashed and "config.json" in hashed


def test_changed_byte_with_mtime_restored_is_caught(qdir):
    load_quantized(qdir)  # stamps the folder
    shard = _shard(qdir)
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0x01  # tensor data: the header stays readable, the size is the same
    with open(shard, "r+b") as f:  # in place: same inode
        f.write(data)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime as it was; ctime moves
    assert shard.stat().st_mtime_ns == st.st_mtime_ns and shard.stat().st_ino == st.st_ino
    with pytest.raises(ValueError, match="sha256"):
        load_quantized(qdir)


def test_copied_folder_is_hashed_again(qdir, tmp_path):
    load_quantized(qdir)
    copy = tmp_path / "copy"
    shutil.copytree(qdir, copy)  # the stamp comes along; the inodes do not
    assert load_quantized(copy).report.checked == "full"


def test_stamp_goes_to_the_cache_when_the_folder_takes_no_file(qdir, tmp_path):
    (qdir / STAMP_NAME).mkdir()  # a write beside the checkpoint fails (as read-only, for root)
    assert load_quantized(qdir).report.checked == "full"
    assert list((tmp_path / "cache" / "quantpipe" / "verified").glob("*.json"))
    assert load_quantized(qdir).report.checked == "stamp"


def test_no_verify_skips_hashes_but_not_shapes(qdir, hashed):
    assert load_quantized(qdir, "skip").report.checked == "headers"
    assert hashed == [] and not (qdir / STAMP_NAME).exists()


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 100000), ("hidden_size", 0)])
def test_absurd_config_is_refused_from_the_headers(qdir, field, value):
    cfg = json.loads((qdir / "config.json").read_text())
    cfg[field] = value
    (qdir / "config.json").write_text(json.dumps(cfg))
    for hashes in ("skip", "full"):  # --no-verify too: the sizes are checked before building
        with pytest.raises(ValueError, match=field):
            load_quantized(qdir, hashes)
    with pytest.raises(ValueError, match=r"config\.json: \d+ bytes, manifest says"):
        verify_checkpoint(qdir)  # and the manifest's record of config.json no longer matches


def test_random_tokenizer_fails_verify(qdir):
    from quantpipe.cli import main

    (qdir / "tokenizer.json").write_bytes(os.urandom(4096))
    res = CliRunner().invoke(main, ["verify", str(qdir)])
    assert res.exit_code == 1 and "tokenizer.json: 4096 bytes, manifest says" in res.output
    m = _manifest(qdir)  # a manifest from before the files were hashed: the load says it
    del m["files"]
    (qdir / qio.MANIFEST_NAME).write_text(json.dumps(m))
    res = CliRunner().invoke(main, ["verify", str(qdir)])
    assert res.exit_code == 1 and "the tokenizer does not load" in res.output


def test_old_manifest_loads_and_verify_says_what_it_did_not_check(qdir):
    m = _manifest(qdir)
    del m["files"]
    (qdir / qio.MANIFEST_NAME).write_text(json.dumps(m))
    assert load_quantized(qdir).layers
    summary = verify_checkpoint(qdir).summary()
    assert summary.startswith("OK ") and "config.json and tokenizer files not checked" in summary


def test_generate_refuses_absurd_fp16_config(tiny_llama_dir, tmp_path):
    from quantpipe.runtime.engine import load_model_for_serving

    folder = tmp_path / "fp"
    shutil.copytree(tiny_llama_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] = 100000
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_hidden_layers is 100000"):
        load_model_for_serving(folder)


def test_file_written_during_the_check_is_not_stamped(qdir, monkeypatch):
    from quantpipe.core.formats import verify

    real = verify._hash_with_progress

    def hash_then_touch(folder, entries, problems):
        real(folder, entries, problems)
        os.utime(_shard(folder))  # a write landing after the bytes were hashed

    monkeypatch.setattr(verify, "_hash_with_progress", hash_then_touch)
    assert load_quantized(qdir).report.checked == "full"
    assert not (qdir / STAMP_NAME).exists()

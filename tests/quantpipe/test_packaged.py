"""Packaged models: chunk packages found without importing them, assembled atomically, verified."""

import hashlib
import sys

import pytest

from quantpipe.core import packaged
from quantpipe.core.sources import resolve_source


def _fake_model(tmp_path, monkeypatch, chunks: list[list[bytes]], name="fake-model"):
    """Chunk packages ``fakechunkN`` on sys.path; package N holds the data files chunks[N]."""
    site = tmp_path / "site"
    for i, files in enumerate(chunks, start=1):
        pkg = site / f"fakechunk{i}"
        (pkg / "data").mkdir(parents=True)
        # importing the package would leave this marker: quantpipe must never run it
        (pkg / "__init__.py").write_text(
            f"open({str(tmp_path / 'imported')!r}, 'w').write('{i}')\n")
        for j, data in enumerate(files):
            (pkg / "data" / f"part{i:02d}.{j}").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(b"".join(files) for files in chunks)
    model = packaged.PackagedModel(
        name=name, file_name="fake.gguf",
        packages=tuple(f"fakechunk{i}" for i in range(1, len(chunks) + 1)),
        distributions=tuple(f"fake-chunk{i}" for i in range(1, len(chunks) + 1)),
        version="1.0", sha256=hashlib.sha256(whole).hexdigest(), size=len(whole),
        description="test")
    monkeypatch.setitem(packaged.PACKAGED_MODELS, name, model)
    monkeypatch.setenv(packaged.MODELS_DIR_ENV, str(tmp_path / "models"))
    return model, whole


def test_assembles_chunks_in_package_then_file_order(tmp_path, monkeypatch):
    # 11 packages: "fakechunk10" sorts before "fakechunk2" as text; the table's order wins
    chunks = [[bytes([i]) * 3, bytes([i + 100]) * 2] for i in range(1, 12)]
    model, whole = _fake_model(tmp_path, monkeypatch, chunks)
    path = packaged.gguf_path(model)
    assert path.read_bytes() == whole
    assert path.parent == tmp_path / "models"
    assert not (tmp_path / "imported").exists()  # found, never imported
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".partial")]


def test_a_resolved_name_is_a_gguf_source(tmp_path, monkeypatch):
    model, whole = _fake_model(tmp_path, monkeypatch, [[b"GGUF", b"abc"], [b"def"]])
    src = resolve_source("FAKE-MODEL")
    assert src.kind == "gguf" and src.path.read_bytes() == whole


def test_wrong_bytes_leave_no_file_and_name_the_reinstall(tmp_path, monkeypatch):
    model, whole = _fake_model(tmp_path, monkeypatch, [[b"aaaa"], [b"bbbb"]])
    bad = packaged.PackagedModel(**{**model.__dict__, "sha256": "0" * 64})
    with pytest.raises(ValueError, match="--force-reinstall") as err:
        packaged.gguf_path(bad)
    assert "fake-chunk1==1.0 fake-chunk2==1.0" in str(err.value)
    assert list((tmp_path / "models").iterdir()) == []  # neither the file nor a temp file


def test_missing_package_names_the_install_command(tmp_path, monkeypatch):
    model, _ = _fake_model(tmp_path, monkeypatch, [[b"a"], [b"b"]])
    gone = packaged.PackagedModel(**{**model.__dict__,
                                     "packages": ("fakechunk1", "no_such_chunk_pkg")})
    with pytest.raises(ValueError, match="no_such_chunk_pkg is not installed.*pip install"):
        packaged.gguf_path(gone)


def test_a_changed_file_is_hashed_again_and_reassembled(tmp_path, monkeypatch):
    model, whole = _fake_model(tmp_path, monkeypatch, [[b"x" * 64], [b"y" * 64]])
    path = packaged.gguf_path(model)
    st = path.stat()
    # same size, same mtime, other bytes: only the stamp's ctime/inode can tell
    with open(path, "r+b") as f:
        f.write(b"z")
    import os
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = packaged.gguf_path(model)
    assert again.read_bytes() == whole


def test_an_untouched_file_is_not_hashed_again(tmp_path, monkeypatch):
    model, _ = _fake_model(tmp_path, monkeypatch, [[b"x" * 64], [b"y" * 64]])
    packaged.gguf_path(model)
    calls = []
    monkeypatch.setattr(packaged, "sha256_file", lambda p: calls.append(p) or "")
    packaged.gguf_path(model)
    assert calls == []


@pytest.mark.parametrize("name", [n for n in packaged.PACKAGED_MODELS if n != "smollm2-135m"])
@pytest.mark.real_models
def test_real_packaged_model_assembles_and_verifies(name, tmp_path, monkeypatch):
    model = packaged.PACKAGED_MODELS[name]
    if not packaged.installed(model):
        pytest.skip(f"{name}'s packages are not installed ({model.install_command})")
    monkeypatch.setenv(packaged.MODELS_DIR_ENV, str(tmp_path))
    path = packaged.gguf_path(model)
    assert path.stat().st_size == model.size
    assert path.read_bytes()[:4] == b"GGUF"
    assert not any(p.startswith(model.packages[0]) for p in sys.modules)

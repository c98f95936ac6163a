"""quantpipe.core.io: output locks, overlap checks, stale temp folders, failed writes."""

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

import quantpipe.core.io as qio
from quantpipe.core.io import (
    OutputExistsError,
    OutputLockedError,
    atomic_output_dir,
    check_not_overlapping,
    lock_file_for,
    output_lock,
    save_safetensors_atomic,
    verify_shard_hashes,
    write_json_atomic,
)

HOLD_LOCK = (
    "import sys, time\n"
    "from quantpipe.core.io import output_lock\n"
    "with output_lock(sys.argv[1]):\n"
    "    print('locked', flush=True)\n"
    "    sys.stdin.readline()  # hold the lock until the parent says so (or kills us)\n"
)


def _lock_holder(out: Path) -> subprocess.Popen:
    """Another process holding the output lock of ``out`` (until killed or fed a line)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_writer_fails_at_once_with_the_holders_pid(tmp_path):
    out = tmp_path / "out"
    holder = _lock_holder(out)
    try:
        with pytest.raises(OutputLockedError,
                           match=rf"out is being written by another quantpipe process "
                                 rf"\(pid {holder.pid}\)"):
            with output_lock(out):
                pass
        with pytest.raises(OutputLockedError):
            with atomic_output_dir(out) as tmp:
                (tmp / "x").write_text("never")
        assert not out.exists()
        assert [p.name for p in tmp_path.iterdir()] == [".out.lock"]  # no temp folder left
    finally:
        holder.communicate("\n", timeout=60)
    assert holder.returncode == 0
    assert not lock_file_for(out).exists()  # a released lock removes its file
    with output_lock(out):  # free again
        assert lock_file_for(out).read_text().strip() == str(os.getpid())


def test_sigkill_never_leaves_a_stale_lock(tmp_path):
    out = tmp_path / "out"
    holder = _lock_holder(out)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
    assert lock_file_for(out).exists()  # the file stays, but the OS dropped the lock
    with atomic_output_dir(out) as tmp:
        (tmp / "x").write_text("ok")
    assert (out / "x").read_text() == "ok"


def test_lock_is_reentrant_within_one_process(tmp_path):
    out = tmp_path / "out"
    with output_lock(out):
        with atomic_output_dir(out) as tmp:  # a stage that locks, calling a writer that locks
            (tmp / "x").write_text("ok")
        assert lock_file_for(out).exists()
    assert not lock_file_for(out).exists()
    # the same folder spelled through a symlinked parent shares the lock file
    (tmp_path / "link").symlink_to(tmp_path)
    assert lock_file_for(tmp_path / "link" / "out") == lock_file_for(out)


def test_stale_temp_folders_of_killed_runs_are_removed(tmp_path):
    out = tmp_path / "q"
    out.mkdir()
    (out / "quantpipe.json").write_text("{}")
    stale = [tmp_path / ".q.partial-ab12cd_9", tmp_path / ".q.old-4242"]
    kept = [tmp_path / ".q.partial-x", tmp_path / ".qq.partial-ab12cd_9",
            tmp_path / ".q.work", tmp_path / "q.partial-ab12cd_9"]
    for p in stale + kept:
        p.mkdir()
        (p / "f").write_text("x")
    with atomic_output_dir(out, force=True) as tmp:
        (tmp / "new").write_text("new")
    assert (out / "new").is_file() and not (out / "quantpipe.json").exists()
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in kept)
    assert not any(p.name.startswith((".q.partial-", ".q.old-"))
                   for p in tmp_path.iterdir() if p not in kept)


def test_interrupted_swap_puts_the_old_folder_back(tmp_path):
    """A run killed between moving DIR aside and renaming the new one in loses nothing."""
    out = tmp_path / "q"
    old = tmp_path / ".q.old-999"
    old.mkdir()
    (old / "quantpipe.json").write_text('{"previous": true}')
    with pytest.raises(OutputExistsError, match="--force"):
        with atomic_output_dir(out):
            pass
    assert json.loads((out / "quantpipe.json").read_text()) == {"previous": True}
    assert not old.exists()


@pytest.mark.parametrize("where", ["same", "inside", "contains", "symlink"])
def test_out_overlapping_an_input_is_refused(tmp_path, where):
    src = tmp_path / "models" / "src"
    src.mkdir(parents=True)
    (src / "w.safetensors").write_text("weights")
    (tmp_path / "alias").symlink_to(src)
    out = {"same": src, "inside": src / "sub", "contains": tmp_path / "models",
           "symlink": tmp_path / "alias"}[where]
    with pytest.raises(ValueError, match=r"^--out .* the input SOURCE .*choose another --out$"):
        check_not_overlapping(out, {"SOURCE": src})
    with pytest.raises(ValueError, match="the input SOURCE"):
        with atomic_output_dir(out, force=True, inputs={"SOURCE": src}):
            pass
    assert (src / "w.safetensors").read_text() == "weights"
    check_not_overlapping(tmp_path / "models" / "other", {"SOURCE": src, "skipped": None})


def test_disk_full_while_saving_safetensors(tmp_path, monkeypatch):
    """ENOSPC (as safetensors' writer reports it) -> OSError naming the file, no temp left."""

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)  # a partial file, as a full disk leaves it
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")

    monkeypatch.setattr(qio, "save_file", full)
    path = tmp_path / "model.safetensors"
    with pytest.raises(OSError) as info:
        save_safetensors_atomic({"w": torch.zeros(4)}, path)
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    assert "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_permission_denied_while_writing_json(tmp_path, monkeypatch):
    path = tmp_path / "quantpipe.json"
    write_json_atomic(path, {"old": 1})

    def denied(fd):  # the temp file holds the new text, not yet synced
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(qio.os, "fsync", denied)
    with pytest.raises(PermissionError) as info:
        write_json_atomic(path, {"new": 2})
    assert info.value.filename == str(path)
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"old": 1}  # the previous file is untouched
    assert [p.name for p in tmp_path.iterdir()] == ["quantpipe.json"]


def test_shard_hashes_against_recorded_values(tmp_path):
    shard = tmp_path / "model-00001-of-00001.safetensors"
    shard.write_bytes(b"abc")
    good = {"file": shard.name, "sha256": qio.sha256_file(shard)}
    verify_shard_hashes(tmp_path, [good], recorded_by="the calibration C")
    shard.write_bytes(b"abd")  # one byte changed, same size
    with pytest.raises(ValueError, match=rf"{shard.name}: sha256 .* in the calibration C"):
        verify_shard_hashes(tmp_path, [good], recorded_by="the calibration C")

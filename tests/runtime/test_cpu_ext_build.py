"""The CPU kernels' build: one folder per interpreter and torch (two virtualenvs sharing
torch_extensions never rebuild each other's copy), and every path that compiles says so."""

from __future__ import annotations

import logging
import sys
import time

import pytest

from quantpipe.runtime.kernels import cpu_ext


def test_library_name_is_per_interpreter(monkeypatch):
    here = cpu_ext.library_name("avx2")
    monkeypatch.setattr(sys, "prefix", "/some/other/venv")
    assert cpu_ext.library_name("avx2") != here
    monkeypatch.undo()
    assert cpu_ext.library_name("avx2") == here  # stable for one interpreter


def _slow_failing_load(seconds: float):
    def load(**kwargs):
        time.sleep(seconds)  # what a compile looks like from here
        raise RuntimeError("no compiler here (test)")
    return load


@pytest.mark.parametrize("cached", [False, True])
def test_every_build_path_announces_the_compile(cached, tmp_path, monkeypatch, caplog):
    from torch.utils import cpp_extension

    if not cpu_ext.cpu_can_run("avx2"):
        pytest.skip("the CPU cannot run the AVX2 build")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = cpu_ext.library_name("avx2")
    if cached:  # a library on disk that torch rebuilds anyway (its cache is stale)
        (tmp_path / "quantpipe" / name).mkdir(parents=True)
        (tmp_path / "quantpipe" / name / f"{name}.so").write_bytes(b"")
    monkeypatch.setattr(cpu_ext, "STALE_BUILD_NOTICE_S", 0.05)
    monkeypatch.setattr(cpp_extension, "load", _slow_failing_load(0.5))
    cpu_ext._build_status.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_ext.__name__):
            usable, why = cpu_ext.build_status("avx2")
    finally:
        cpu_ext._build_status.cache_clear()
    assert not usable and "no compiler here" in why
    notices = [r for r in caplog.records if "CPU kernels (once, ~30 s)" in r.getMessage()]
    assert len(notices) == 1 and notices[0].levelno >= logging.WARNING
    assert ("stale" in notices[0].getMessage()) == cached


def test_a_background_build_and_the_first_kernel_call_build_once(monkeypatch):
    """run starts the build on a thread during its FP16 export; a kernel call meanwhile waits
    for that build and gets its result instead of compiling a second time."""
    calls = []

    def slow_build(isa):
        calls.append(isa)
        time.sleep(0.5)  # a compile, as the caller sees it
        return False, "no compiler here (test)"

    monkeypatch.delenv(cpu_ext.ENV, raising=False)
    monkeypatch.setenv(cpu_ext.ISA_ENV, "avx2")
    monkeypatch.setattr(cpu_ext, "_build_status", slow_build)
    cpu_ext._status.cache_clear()
    try:
        thread = cpu_ext.build_in_background()
        time.sleep(0.1)  # the thread is inside the build now
        assert thread.is_alive()
        assert cpu_ext.kernel_status() == (False, "no compiler here (test)")
        thread.join(5)
        assert not thread.is_alive() and calls == ["avx2"]
    finally:
        cpu_ext._status.cache_clear()


def test_a_background_build_leaves_an_environment_error_to_the_kernel_call(monkeypatch):
    monkeypatch.setenv(cpu_ext.ENV, "fast")
    cpu_ext._status.cache_clear()
    try:
        cpu_ext.build_in_background().join(5)
        with pytest.raises(ValueError, match="QUANTPIPE_CPU_KERNELS='fast'"):
            cpu_ext.kernel_status()
    finally:
        cpu_ext._status.cache_clear()

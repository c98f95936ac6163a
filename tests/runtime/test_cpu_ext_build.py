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
    cpu_ext.build_status.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_ext.__name__):
            usable, why = cpu_ext.build_status("avx2")
    finally:
        cpu_ext.build_status.cache_clear()
    assert not usable and "no compiler here" in why
    notices = [r for r in caplog.records if "CPU kernels (once, ~30 s)" in r.getMessage()]
    assert len(notices) == 1 and notices[0].levelno >= logging.WARNING
    assert ("stale" in notices[0].getMessage()) == cached

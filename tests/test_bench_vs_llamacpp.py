"""bench/vs_llamacpp.py's model resolution: --source picks the packaged GGUF llama.cpp runs, and
with no --int4 the W4 RTN g128 export is made by the CLI's three stages (once: a complete folder
is not remade); unknown sources and missing folders are errors naming the fix."""

import argparse
import sys
from pathlib import Path

import pytest

from quantpipe.core import packaged

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
bench = pytest.importorskip("vs_llamacpp")


def _args(**kw):
    base = dict(source=None, int4=None, gguf=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_source_makes_the_w4_export_once_with_the_cli(tmp_path, monkeypatch):
    calls = []

    def fake_run(argv, check, cwd):  # the CLI stage: its output folder, completed
        calls.append(argv[3:])
        out = Path(argv[argv.index("--out") + 1])
        out.mkdir(parents=True)
        (out / "quantpipe.json").write_text("{}")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    monkeypatch.setattr(packaged, "installed", lambda model: True)
    monkeypatch.setattr(packaged, "gguf_path", lambda model: tmp_path / model.file_name)
    args = _args(source="gemma-3-270m")
    bench.resolve_models(args)
    w4 = tmp_path / "bench" / ".models" / "gemma-3-270m-w4"
    assert args.int4 == w4 and args.gguf == tmp_path / "gemma-3-270m-q4_k_m.gguf"
    assert [c[0] for c in calls] == ["export-fp16", "calibrate", "export"]
    assert calls[0][1] == "gemma-3-270m"
    assert calls[1][calls[1].index("--algo") + 1] == "rtn"
    assert calls[1][calls[1].index("--group-size") + 1] == "128"
    assert calls[2][calls[2].index("--bits") + 1] == "4"
    calls.clear()
    bench.resolve_models(_args(source="gemma-3-270m"))  # complete folders: nothing remade
    assert calls == []


def test_bad_source_and_missing_folder_are_errors(tmp_path):
    with pytest.raises(SystemExit, match="--source 'gemma-9': use one of"):
        bench.resolve_models(_args(source="gemma-9"))
    with pytest.raises(SystemExit, match="give a quantpipe INT4 folder"):
        bench.resolve_models(_args(int4=tmp_path / "nothing"))

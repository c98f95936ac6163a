"""bench/cpu_kernel_kld.py on a tiny quantized model: the three paths are compared, the
environment is restored, and identical logits give KLD 0 and full agreement."""

import json
import os
import sys
from pathlib import Path

import pytest

from quantpipe.core.formats import write_checkpoint
from quantpipe.core.qformat import QuantSpec
from quantpipe.runtime.kernels import cpu_ext
from tests.quantpipe.test_formats_common import export_tiny, quantize_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
bench = pytest.importorskip("cpu_kernel_kld")


def test_compare_identical_logits_is_zero():
    import torch

    a = [torch.randn(5, 11, generator=torch.Generator().manual_seed(0))]
    out = bench.compare(a, [a[0].clone()])
    assert out["kld_mean"] == pytest.approx(0.0, abs=1e-7) and out["same_top1"] == 1.0


def test_cli_writes_the_three_pairs(tiny_llama_dir, tmp_path, monkeypatch):
    fp16 = export_tiny(tiny_llama_dir, tmp_path / "fp16")
    qdir = tmp_path / "q"
    write_checkpoint("native", qdir, fp16, quantize_plan(fp16, [QuantSpec(4, 32, True)]))
    monkeypatch.delenv(cpu_ext.ENV, raising=False)
    out = tmp_path / "kld.json"
    monkeypatch.setattr(sys, "argv", ["cpu_kernel_kld.py", str(qdir), "--prompts", "2",
                                      "--tokens", "8", "--json", str(out)])
    bench.main()
    res = json.loads(out.read_text())
    assert cpu_ext.ENV not in os.environ  # put back as it was
    for pair in ("reference_vs_torch", "reference_vs_ours", "torch_vs_ours"):
        assert res[pair]["tokens"] == 16 and res[pair]["kld_mean"] >= 0
    assert not any(b.startswith("w4a8") for b in res["backends"]["torch"])

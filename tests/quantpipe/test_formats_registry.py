"""The format registry: every stage finds a format by name or quant_method through it, so a new
format is one module plus one registry line (proven here with a format the test defines)."""

from __future__ import annotations

import pytest
import torch

from quantpipe.core.formats import (
    FORMAT_NAMES,
    FORMATS,
    CheckpointFormat,
    format_named,
    load_quantized,
    native,
    registry,
    verify_checkpoint,
    write_checkpoint,
)
from quantpipe.core.formats.common import write_quantized_folder
from quantpipe.core.qformat import QuantSpec, weight_spec
from quantpipe.stages.export import ExportSpec
from tests.quantpipe.test_formats_common import export_tiny, quantize_plan


def test_registry_names_and_methods():
    assert FORMAT_NAMES == ("native", "gptq", "compressed-tensors")  # the CLI's order
    for name, fmt in FORMATS.items():
        assert fmt.name == name and format_named(name) is fmt
        assert registry.FORMAT_OF_METHOD[fmt.quant_method] is fmt
    assert len({f.quant_method for f in FORMATS.values()}) == len(FORMATS)
    with pytest.raises(ValueError, match=r"'marlin' is not supported; use one of \('native'"):
        format_named("marlin")
    with pytest.raises(ValueError, match="--format 'marlin' is not supported"):
        ExportSpec("calib", "out", fmt="marlin")


def _write_toy(job):
    """A format the package does not know: native tensors under another quant_method."""
    layers = {n: weight_spec(job.weights, n).to_dict() for n in job.weights}
    return write_quantized_folder(
        job, checkpoint_format="toy", quantization_config={"quant_method": "toy-method",
                                                           "layers": layers},
        layer_tensors=native.quantized_tensors, manifest_fields={"layers": layers})


TOY = CheckpointFormat(name="toy", quant_method="toy-method", write=_write_toy,
                       read_layers=native.read_layers, unpack=native.unpack)


def test_a_new_format_is_one_registry_entry(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(registry.FORMATS, "toy", TOY)
    monkeypatch.setitem(registry.FORMAT_OF_METHOD, "toy-method", TOY)
    fp16 = export_tiny(tiny_llama_dir, tmp_path / "fp16")
    weights = quantize_plan(fp16, [QuantSpec(4, 32, False), QuantSpec(8, -1, True)])
    manifest = write_checkpoint("toy", tmp_path / "q", fp16, weights)
    assert manifest["checkpoint_format"] == "toy"
    report = verify_checkpoint(tmp_path / "q")
    assert report.checkpoint_format == "toy" and report.quantized_layers == len(weights)
    ckpt = load_quantized(tmp_path / "q")
    for name, qw in weights.items():
        got = ckpt.layers[name]
        assert got.spec == qw.spec
        assert torch.equal(got.q, qw.q) and torch.equal(got.zeros, qw.zeros)
        assert torch.equal(got.dequantize(), qw.dequantize())


def test_cli_format_choices_are_the_registry():
    # cli.py writes the names literally so that `quantpipe --help` does not import torch
    from quantpipe.cli import main

    option = next(p for p in main.commands["export"].params if p.name == "fmt")
    assert tuple(option.type.choices) == registry.FORMAT_NAMES
    assert option.default == registry.FORMAT_NAMES[0]

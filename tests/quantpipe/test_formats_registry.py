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
                       read_layers=native.read_layers, unpack=native.unpack,
                       layout=native.layout)


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

    for command in ("export", "plan"):
        option = next(p for p in main.commands[command].params if p.name == "fmt")
        assert tuple(option.type.choices) == registry.FORMAT_NAMES
        assert option.default == registry.FORMAT_NAMES[0]


# one layer [out, in] = [96, 256]: the bits per weight each format stores, by hand
# (docs/formats.md): codes + fp16 scales + zeros + g_idx (+ compressed-tensors' int64 shape)
OUT, IN = 96, 256
BY_HAND = [
    (QuantSpec(4, 64, True), "native", 4 + 16 / 64),
    (QuantSpec(4, 64, False), "native", 4 + 16 / 64 + 8 / 64),
    (QuantSpec(4, 64, True, act_order=True), "native", 4 + 16 / 64 + 32 / OUT),
    # GPTQ always stores packed qzeros (bits per group) and g_idx (int32 per input column)
    (QuantSpec(4, 64, True), "gptq", 4 + 16 / 64 + 4 / 64 + 32 / OUT),
    (QuantSpec(8, -1, True), "gptq", 8 + 16 / IN + 8 / IN + 32 / OUT),
    # compressed-tensors: a zero point only when asymmetric, no g_idx, weight_shape int64[2]
    (QuantSpec(4, 64, True), "compressed-tensors", 4 + 16 / 64 + 128 / (OUT * IN)),
    (QuantSpec(4, 64, False), "compressed-tensors", 4 + 16 / 64 + 4 / 64 + 128 / (OUT * IN)),
    (None, "gptq", 16.0),
]


@pytest.mark.parametrize("spec,fmt,expected", BY_HAND)
def test_bits_per_weight_by_hand(spec, fmt, expected):
    assert registry.bits_per_weight(spec, (OUT, IN), fmt) == pytest.approx(expected, rel=1e-14)


def _calibrate(tiny_llama_dir, root, sym: bool):
    from quantpipe.calibration.pipeline import CalibrateSpec, calibrate
    from tests.tiny_models import CORPUS

    fp16 = export_tiny(tiny_llama_dir, root / "fp16")
    prompts = root / "p.txt"
    prompts.write_text("\n\n".join(f"{p} Request {i}." for i in range(4) for p in CORPUS[:8]))
    calibrate(CalibrateSpec(fp16, root / "calib", str(prompts), algo="rtn", group_size=32,
                            sym=sym, samples=4, seq_len=32, min_tokens=4, batch_size=4))
    return root / "calib"


@pytest.fixture(scope="module")
def calibrated(tiny_llama_dir, tmp_path_factory):
    """A tiny asymmetric RTN calibration (zero points stored in every format)."""
    return _calibrate(tiny_llama_dir, tmp_path_factory.mktemp("bpw"), sym=False)


@pytest.fixture(scope="module")
def calibrated_sym(tiny_llama_dir, tmp_path_factory):
    """Symmetric: the GPTQ export refuses asymmetric layers (vLLM has no zero points there;
    GPTQ stores symmetric zero points anyway)."""
    return _calibrate(tiny_llama_dir, tmp_path_factory.mktemp("bpw-sym"), sym=True)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_export_verify_plan_and_report_count_the_same_bits(request, tmp_path, fmt):
    """One number for one checkpoint: what export prints, what verify reads off the disk (every
    byte of the quantized layers, the plan's FP16 layers at 16), what `plan --format` and the
    report show. Before one count, GPTQ's export said 4.219 and its verify 4.319."""
    from quantpipe.calibration.artifact import read_calibration
    from quantpipe.calibration.mixed_precision.plan import PlanSpec, make_plan
    from quantpipe.reports.build import calibration_facts
    from quantpipe.stages.export import export_quantized

    calibrated = request.getfixturevalue("calibrated_sym" if fmt == "gptq" else "calibrated")
    # gate/up kept FP16 together: vLLM loads them as one module
    overrides = ("re:.*down_proj=8", "re:model\\.layers\\.0\\.mlp\\.(gate|up)_proj=fp16")
    res = export_quantized(ExportSpec(calibrated, tmp_path / "q", 4, fmt, overrides=overrides))
    exported = res.plan.effective_bits()
    verified = verify_checkpoint(tmp_path / "q").bits_per_weight
    planned = make_plan(read_calibration(calibrated),
                        PlanSpec(4, overrides=overrides, fmt=fmt)).effective_bits()
    reported = calibration_facts(tmp_path / "q").effective_bits
    assert exported == pytest.approx(verified, rel=1e-12)
    assert exported == planned == reported
    if fmt != "native":  # the formats store different things, and the count says so
        native_bits = make_plan(read_calibration(calibrated),
                                PlanSpec(4, overrides=overrides)).effective_bits()
        assert exported != pytest.approx(native_bits, rel=1e-6)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_export_reads_each_layer_once_and_shows_progress(tiny_llama_dir, tmp_path, fmt, capsys):
    """Every format writes a calibration's layers reading each one once (GPTQ also reads the
    asymmetric ones up front for their zero points), under a progress bar. Up to this test the
    GPTQ and compressed-tensors writers read every layer four times."""
    from quantpipe.core.qformat import LazyWeights

    fp16 = export_tiny(tiny_llama_dir, tmp_path / "fp16")
    weights = quantize_plan(fp16, [QuantSpec(4, 32, True), QuantSpec(8, -1, True),
                                   QuantSpec(4, 64, False)])
    reads: dict[str, int] = {}

    def load(name):
        reads[name] = reads.get(name, 0) + 1
        return weights[name]

    lazy = LazyWeights({n: qw.spec for n, qw in weights.items()},
                       {n: qw.shape for n, qw in weights.items()}, load)
    capsys.readouterr()
    # the specs cycle through q/k/v: for_vllm=False (the reads are what is tested)
    write_checkpoint(fmt, tmp_path / "q", fp16, lazy,
                     **({} if fmt == "native" else {"for_vllm": False}))
    asym = {n for n, qw in weights.items() if not qw.spec.sym}
    assert asym and reads == {n: 2 if fmt == "gptq" and n in asym else 1 for n in weights}
    err = capsys.readouterr().err
    assert f"export {fmt}: 100%" in err and f"{len(weights)}/{len(weights)}" in err


def test_a_converted_folder_counts_its_own_format(calibrated, tmp_path):
    """convert_checkpoint re-counts the copied plan's bits in the new format."""
    from quantpipe.core.formats import convert_checkpoint
    from quantpipe.reports.build import calibration_facts
    from quantpipe.stages.export import export_quantized

    overrides = ("model.layers.0.mlp.up_proj=fp16",)
    export_quantized(ExportSpec(calibrated, tmp_path / "n", 4, "native", overrides=overrides))
    # asymmetric and gate/up split: for GPTQModel, not vLLM (the bit count is what is tested)
    manifest = convert_checkpoint(tmp_path / "n", tmp_path / "g", "gptq", for_vllm=False)
    verified = verify_checkpoint(tmp_path / "g").bits_per_weight
    assert manifest["plan"]["checkpoint_format"] == "gptq"
    assert manifest["plan"]["effective_bits_per_weight"] == pytest.approx(verified, rel=1e-12)
    assert calibration_facts(tmp_path / "g").effective_bits == pytest.approx(verified, rel=1e-12)
    assert verified > verify_checkpoint(tmp_path / "n").bits_per_weight  # qzeros, g_idx

"""``export --vocab-weights``: the embedding table and output head stored quantized.

RTN of a table (calibration.vocab) against its float64 bound, the exact round trip of the
stored packed tables, the table stored once when the head is tied, verify's checks and bits
count (the registry's one count), the formats that refuse the option (with why), and the
options' one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from quantpipe.calibration.vocab import quantize_table
from quantpipe.cli import main
from quantpipe.core.formats.loader import load_dequantized_model, load_quantized
from quantpipe.core.formats.native import quantized_tensors, unpack_native
from quantpipe.core.formats.registry import layer_bits
from quantpipe.core.formats.verify import verify_checkpoint
from quantpipe.core.io import LazyTensors
from quantpipe.core.qformat import QuantSpec
from quantpipe.core.vocab import VOCAB_WEIGHTS, VocabSpec, vocab_tables
from quantpipe.stages.export import ExportSpec, export_quantized
from tests.tiny_models import CORPUS, make_family_model, save_model

EMB = "model.embed_tokens"


def _calibrated(root, family: str, tie: bool):
    """A tiny model's FP16 export and its RTN calibration (W4 g32)."""
    from quantpipe.calibration.pipeline import CalibrateSpec, calibrate
    from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16

    model, tok = make_family_model(family, tie_word_embeddings=tie)
    src = save_model(model, tok, root / "src")
    export_fp16(Fp16ExportSpec(str(src), root / "fp16"))
    prompts = root / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in CORPUS[:8]) + "\n")
    return root / "fp16", calibrate(CalibrateSpec(
        root / "fp16", root / "calib", str(prompts), algo="rtn", group_size=32, samples=4,
        seq_len=24, min_tokens=4, batch_size=4)).out


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """Gemma-3 (tied, scaled embeddings): FP16, calibration, int8 and int4 native exports."""
    root = tmp_path_factory.mktemp("vocab-tied")
    fp16, calib = _calibrated(root, "gemma3_text", tie=True)
    out = {"fp16": fp16, "calib": calib}
    for w in ("int8", "int4"):
        out[w] = root / w
        export_quantized(ExportSpec(calib, out[w], vocab=VocabSpec(w)))
    return out


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """Llama with an untied head: FP16, calibration, an int8 native export."""
    root = tmp_path_factory.mktemp("vocab-untied")
    fp16, calib = _calibrated(root, "llama", tie=False)
    export_quantized(ExportSpec(calib, root / "int8", vocab=VocabSpec("int8")))
    return {"fp16": fp16, "calib": calib, "int8": root / "int8"}


def _keys(qdir) -> set[str]:
    return set(LazyTensors.of_folder(qdir))


# ---- the maths ------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [QuantSpec(8, -1, True), QuantSpec(4, 32, True),
                                  QuantSpec(8, 32, True)], ids=lambda s: s.label())
def test_table_rtn_error_within_half_a_step_and_packed_round_trip_exact(spec, monkeypatch):
    import quantpipe.calibration.vocab as vocab

    monkeypatch.setattr(vocab, "CHUNK_ROWS", 48)  # several chunks, the last one partial
    gen = torch.Generator().manual_seed(0)
    table = (torch.randn(200, 64, generator=gen) * 0.05).half()  # [vocab, hidden] fp16
    table[7, 3] = 0.9  # an outlier: its row's (or group's) scale grows, the others' do not
    qw = quantize_table(table, spec)
    w64 = table.double()
    deq64 = ((qw.q.double() - qw.zeros.double()[:, qw.group_index()])
             * qw.scales.double()[:, qw.group_index()])  # [vocab, hidden] float64
    step = qw.scales.double()[:, qw.group_index()]
    # round to nearest: within half a step, except at the top code: absmax / s is maxq / 2
    # (127.5, 7.5) times up to 1 / (1 - 2**-11) (s rounded down to fp16), rounded and clamped
    # to maxq - zero (127, 7): an error up to s * (maxq / 2 / (1 - 2**-11) - (maxq - zero))
    top = spec.maxq / 2 / (1 - 2**-11) - (spec.maxq - spec.sym_zero)
    assert bool(((deq64 - w64).abs() <= step * max(0.5, top) + 1e-12).all())
    assert torch.equal(qw.dequantize(torch.float64), deq64)
    # stored as native tensors and read back: bit for bit
    stored = quantized_tensors(EMB, qw)
    assert set(stored) == {f"{EMB}.qweight", f"{EMB}.scales"}  # symmetric: no zeros
    back = unpack_native(EMB, spec, stored)
    assert torch.equal(back.q, qw.q) and torch.equal(back.scales, qw.scales)
    assert bool((back.zeros == spec.sym_zero).all())


def test_vocab_spec_checks():
    assert VOCAB_WEIGHTS == ("fp16", "int8", "int4")
    assert VocabSpec("int8").quant_spec(576) == QuantSpec(8, -1, True)
    assert VocabSpec("int4").quant_spec(640) == QuantSpec(4, 32, True)
    assert VocabSpec().quant_spec(640) is None
    with pytest.raises(ValueError, match="--vocab-weights 'int3' is not supported"):
        VocabSpec("int3")
    with pytest.raises(ValueError, match="multiple of 16"):
        VocabSpec("int4", 40)
    with pytest.raises(ValueError, match="needs --vocab-weights int8 or int4"):
        VocabSpec("fp16", 32)
    with pytest.raises(ValueError, match="does not divide the hidden size 576; use 32, 64, -1"):
        VocabSpec("int4", 128).quant_spec(576)


# ---- what is stored -----------------------------------------------------------------------


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_tied_table_stored_once_equal_to_its_rtn(tied, weights):
    qdir = tied[weights]
    keys = _keys(qdir)
    assert {f"{EMB}.qweight", f"{EMB}.scales"} <= keys
    assert f"{EMB}.weight" not in keys
    assert not [k for k in keys if k.startswith("lm_head.")]  # tied: one tensor in the file
    config = json.loads((qdir / "config.json").read_text())
    spec = VocabSpec(weights).quant_spec(64)
    assert config["quantization_config"]["embeddings"] == {EMB: spec.to_dict()}
    assert "lm_head" not in config["quantization_config"]["layers"]
    assert vocab_tables(config).tied
    fp16 = LazyTensors.of_folder(tied["fp16"])[f"{EMB}.weight"]
    want = quantize_table(fp16, spec)
    got = load_quantized(qdir).embeddings[EMB]
    assert torch.equal(got.q, want.q) and torch.equal(got.scales, want.scales)
    record = json.loads((qdir / "quantpipe.json").read_text())["vocab"]
    assert record["weights"] == weights and record["tied"] is True
    assert record["tables"][EMB]["spec"] == spec.to_dict()


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_verify_counts_the_tables_with_the_registry(tied, weights):
    rep = verify_checkpoint(tied[weights])
    spec = VocabSpec(weights).quant_spec(64)
    shape = tuple(LazyTensors.of_folder(tied["fp16"]).shape(f"{EMB}.weight"))
    assert rep.vocab == f"embedding {spec.label()}, head tied"
    assert rep.vocab_weights == shape[0] * shape[1]
    assert rep.vocab_bits == layer_bits(spec, shape, "native")  # the registry's one count
    want = ((8 * rep.quantized_bytes + rep.vocab_bits)
            / (rep.quantized_weights + rep.vocab_weights))
    assert rep.bits_per_weight_with_vocab == pytest.approx(want, rel=1e-12)
    assert "with the embedding table and head" in rep.summary()
    manifest = json.loads((tied[weights] / "quantpipe.json").read_text())
    bpw = manifest["vocab"]["tables"][EMB]["bits_per_weight"]
    assert bpw == pytest.approx(rep.vocab_bits / rep.vocab_weights, rel=1e-12)


def test_fp16_tables_counted_at_16_bits(tied, tmp_path):
    qdir = tmp_path / "fp16-vocab"
    export_quantized(ExportSpec(tied["calib"], qdir))
    rep = verify_checkpoint(qdir)
    assert rep.vocab == "embedding fp16, head tied"
    assert rep.vocab_bits == 16 * rep.vocab_weights
    assert "embeddings" not in json.loads((qdir / "config.json").read_text())[
        "quantization_config"]


def test_untied_head_is_a_quantized_linear(untied):
    qdir = untied["int8"]
    keys = _keys(qdir)
    assert {f"{EMB}.qweight", "lm_head.qweight", "lm_head.scales"} <= keys
    assert not {f"{EMB}.weight", "lm_head.weight"} & keys
    qcfg = json.loads((qdir / "config.json").read_text())["quantization_config"]
    assert qcfg["layers"]["lm_head"] == QuantSpec(8, -1, True).to_dict()
    rep = verify_checkpoint(qdir)
    assert rep.vocab == "embedding w8pc, head w8pc"
    assert rep.quantized_layers == len(qcfg["layers"])  # the head is verified as a layer
    # the linears' bits exclude the head: the plan's count over the calibrated linears
    plan = json.loads((qdir / "quantpipe.json").read_text())["plan"]
    assert rep.bits_per_weight == pytest.approx(plan["effective_bits_per_weight"], rel=1e-12)


def test_reference_model_uses_the_dequantized_tables(tied, untied):
    for qdir, tie in ((tied["int4"], True), (untied["int8"], False)):
        ckpt = load_quantized(qdir)
        model = load_dequantized_model(qdir, torch.float64)
        table = ckpt.embeddings[EMB].dequantize(torch.float64)
        assert torch.equal(model.get_input_embeddings().weight, table)
        head = model.get_output_embeddings().weight
        if tie:
            assert head is model.get_input_embeddings().weight
        else:
            assert torch.equal(head, ckpt.layers["lm_head"].dequantize(torch.float64))


# ---- verify -----------------------------------------------------------------------------------


def test_verify_catches_a_changed_byte_of_the_table(tied, tmp_path):
    qdir = tmp_path / "q"
    shutil.copytree(tied["int8"], qdir)
    (shard,) = qdir.glob("*.safetensors")
    header = int.from_bytes(shard.read_bytes()[:8], "little")
    meta = json.loads(shard.read_bytes()[8:8 + header])
    start, _ = meta[f"{EMB}.qweight"]["data_offsets"]
    data = bytearray(shard.read_bytes())
    data[8 + header + start + 5] ^= 0x10  # one bit of one code of the table
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        verify_checkpoint(qdir)


def test_verify_refuses_a_head_stored_beside_its_tied_table(tied, tmp_path):
    """A tied head must have no tensor of its own (checked without the manifest too: here
    the folder lost it, so the extra file is not refused as a stray shard first)."""
    from safetensors.torch import save_file

    qdir = tmp_path / "q"
    shutil.copytree(tied["int4"], qdir)
    (qdir / "quantpipe.json").unlink()
    save_file({"lm_head.weight": torch.zeros(4, 4, dtype=torch.float16)},
              str(qdir / "extra.safetensors"))
    index = qdir / "model.safetensors.index.json"
    if index.is_file():
        d = json.loads(index.read_text())
        d["weight_map"]["lm_head.weight"] = "extra.safetensors"
        index.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="lm_head.weight stored although config.json ties"):
        load_quantized(qdir, "skip")


# ---- formats and options ----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_vllm_formats_refuse_a_tied_table(tied, tmp_path, fmt):
    with pytest.raises(ValueError, match=f"--vocab-weights int8 with --format {fmt}: vLLM"):
        export_quantized(ExportSpec(tied["calib"], tmp_path / "q", fmt=fmt,
                                    vocab=VocabSpec("int8")))
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_vllm_formats_quantize_an_untied_head_only(untied, tmp_path, fmt):
    qdir = tmp_path / "q"
    export_quantized(ExportSpec(untied["calib"], qdir, fmt=fmt, vocab=VocabSpec("int4")))
    qcfg = json.loads((qdir / "config.json").read_text())["quantization_config"]
    if fmt == "gptq":
        assert qcfg["lm_head"] is True
    else:
        assert "lm_head" not in qcfg["ignore"]
        assert any("lm_head" in g["targets"] for g in qcfg["config_groups"].values())
    ckpt = load_quantized(qdir, "full")
    assert ckpt.plan["lm_head"] == QuantSpec(4, 32, True) and not ckpt.embeddings
    assert f"{EMB}.weight" in ckpt.fp_tensors  # the input table stays FP16
    assert ckpt.report.vocab == "embedding fp16, head w4g32"


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_cli_bad_vocab_options_one_line(tied, tmp_path):
    def one_line(r, needle):
        assert r.exit_code != 0, r.output
        assert "Traceback" not in r.output
        errors = [line for line in r.output.splitlines() if line.startswith("Error: ")]
        assert len(errors) == 1 and needle in errors[0], r.output

    calib, out = tied["calib"], tmp_path / "q"
    one_line(_cli("export", calib, "--out", out, "--vocab-weights", "int3"), "int3")
    one_line(_cli("export", calib, "--out", out, "--vocab-weights", "int4",
                  "--vocab-group-size", "40"), "--vocab-group-size 40 is not supported")
    one_line(_cli("export", calib, "--out", out, "--vocab-weights", "int4",
                  "--vocab-group-size", "128"), "does not divide the hidden size 64")
    one_line(_cli("export", calib, "--out", out, "--vocab-weights", "int8", "--format", "gptq"),
             "vLLM's GPTQ loader quantizes only an untied lm_head")
    assert not out.exists()
    r = _cli("export", calib, "--out", out, "--vocab-weights", "int4")
    assert r.exit_code == 0 and "vocabulary tables int4" in r.output, r.output


def test_convert_carries_the_tables_or_refuses(tied, untied, tmp_path):
    from quantpipe.core.formats.writers import convert_checkpoint

    convert_checkpoint(tied["int4"], tmp_path / "native", "native")
    a, b = load_quantized(tied["int4"]), load_quantized(tmp_path / "native", "full")
    assert torch.equal(a.embeddings[EMB].q, b.embeddings[EMB].q)
    assert torch.equal(a.embeddings[EMB].scales, b.embeddings[EMB].scales)
    assert not [k for k in _keys(tmp_path / "native") if k.startswith("lm_head.")]
    with pytest.raises(ValueError, match="--format gptq cannot store the quantized embedding"):
        convert_checkpoint(untied["int8"], tmp_path / "gptq", "gptq")


def test_streamed_eval_reads_the_quantized_table(tied):
    """`quantpipe eval` block by block over a quantized tied table: the whole-model path's
    KLD (both dequantize the same table)."""
    import math

    from quantpipe.reports.eval import EvalSpec, run_eval

    texts = (" ".join(CORPUS[:6]),)
    spec = dict(reference=tied["fp16"], candidate=tied["int4"], texts=texts, max_tokens=60,
                ctx=30)
    whole, streamed = (run_eval(EvalSpec(**spec, stream=s)) for s in (False, True))
    assert streamed.tokens == whole.tokens == 60
    assert math.isclose(streamed.kld["mean"], whole.kld["mean"], rel_tol=1e-4, abs_tol=1e-7)
    assert whole.kld["mean"] > 0


def test_cli_vocab_choices_are_the_library_ones():
    """export's --vocab-weights choices are written in the CLI (no torch import for --help):
    they must be quantpipe.core.vocab.VOCAB_WEIGHTS, the first the default."""
    option = next(p for p in main.commands["export"].params if p.name == "vocab_weights")
    assert tuple(option.type.choices) == VOCAB_WEIGHTS
    assert option.default == VOCAB_WEIGHTS[0] == VocabSpec().weights

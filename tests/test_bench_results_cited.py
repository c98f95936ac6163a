"""Every measurement kept under bench/results/ is cited by name in the docs, README or a bench
script, so a reader can find what it measured and a stale one is noticed. A citation may name
several files at once with one brace group: ``vs_llmcompressor_64_{asym,sym}_algos.json``."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITING = ["README.md", "CONTRIBUTING.md", "docs/**/*.md", "bench/**/*.py", "bench/**/*.md"]
_NAME = re.compile(r"[\w.{},+-]+\.json")


def _expand(name: str) -> list[str]:
    """``a_{x,y}_b.json`` -> ``a_x_b.json``, ``a_y_b.json`` (one level of braces)."""
    parts = re.split(r"\{([^{}]*)\}", name)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def cited_names() -> set[str]:
    names: set[str] = set()
    for pattern in CITING:
        for path in ROOT.glob(pattern):
            for token in _NAME.findall(path.read_text(encoding="utf-8", errors="replace")):
                names.update(Path(n).name for n in _expand(token))
    return names


def test_expand_braces():
    assert _expand("q_{a,b}_{x,y}.json") == ["q_a_x.json", "q_a_y.json", "q_b_x.json",
                                             "q_b_y.json"]
    assert _expand("plain.json") == ["plain.json"]


def test_every_bench_result_is_cited():
    results = sorted(p.name for p in (ROOT / "bench" / "results").glob("*.json"))
    assert results
    uncited = sorted(set(results) - cited_names())
    assert not uncited, f"cite these in docs/ or README.md (or delete them): {uncited}"

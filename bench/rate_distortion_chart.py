"""The size-vs-KLD curve of bench/mixed_precision_menu.py's results as an SVG chart (issue #30).

    python bench/rate_distortion_chart.py bench/results/mixed_precision_menu_smollm2.json \
        --corpus sotu --out docs/mixed-precision-smollm2-sotu.svg

Curves: the plans over the menu (``menu-*``) and over INT4 / INT8 / FP16 only
(``int4-8-16-*``) at each budget measured, x their stored bits per weight, y their mean KLD
against FP16 on ``--corpus``; markers: the uniform settings (``uniform-*``) within the x range
of ``--max-bits``. Nothing is measured here: the numbers are the JSON's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from quantpipe.core.io import write_text_atomic
from quantpipe.reports.charts import rate_distortion_chart

CURVES = {"menu-": "plans over the menu", "int4-8-16-": "plans over INT4 / INT8 / FP16"}
UNIFORM = {"uniform-w4": "uniform INT4", "uniform-w4g32": "uniform INT4 g32",
           "uniform-w5g64": "uniform INT5 g64", "uniform-w6g64": "uniform INT6 g64",
           "uniform-w8": "uniform INT8"}


def chart_data(results: dict, corpus: str, max_bits: float
               ) -> tuple[dict[str, list[tuple[float, float]]], dict[str, tuple[float, float]]]:
    """(curves, points) of a results mapping (name -> effective_bits_per_weight and
    eval[corpus].kld.mean): plans by their prefix, uniform settings up to ``max_bits``."""
    def point(r):
        return (r["effective_bits_per_weight"], r["eval"][corpus]["kld"]["mean"])

    curves = {label: sorted({point(r) for n, r in results.items() if n.startswith(prefix)
                             and corpus in r["eval"]})
              for prefix, label in CURVES.items()}
    points = {label: point(results[n]) for n, label in UNIFORM.items()
              if n in results and corpus in results[n]["eval"]
              and results[n]["effective_bits_per_weight"] <= max_bits}
    return {k: v for k, v in curves.items() if v}, points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="bench/mixed_precision_menu.py's --json")
    ap.add_argument("--corpus", default="sotu")
    ap.add_argument("--max-bits", type=float, default=6.5,
                    help="Leave out uniform settings above this (INT8 would squash the x axis).")
    ap.add_argument("--title", default=None)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    data = json.loads(args.results.read_text())
    curves, points = chart_data(data["results"], args.corpus, args.max_bits)
    if not curves and not points:
        raise SystemExit(f"{args.results}: no result scored on {args.corpus!r}")
    title = args.title or f"Size against quality on {args.corpus}: lower left is better"
    svg = rate_distortion_chart(curves, points, title)
    write_text_atomic(args.out, svg + "\n")  # a standalone SVG file (it names its namespace)
    print(f"wrote {args.out}: {', '.join(f'{k} ({len(v)})' for k, v in curves.items())}; "
          f"{', '.join(points)}")


if __name__ == "__main__":
    main()

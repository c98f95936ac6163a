"""Inline SVG charts (matplotlib) for the HTML report.

Each function returns an ``<svg>`` string ready to paste into HTML: no XML header, no
DOCTYPE, no metadata block (which holds URLs), glyphs drawn as paths (``svg.fonttype=path``)
so the page needs no font file and no network. Figures are built with ``matplotlib.figure``
directly (no pyplot state, no GUI backend); the SVG canvas is used for output.
"""

from __future__ import annotations

import io
import math
import re

import matplotlib

matplotlib.use("Agg")  # never a GUI backend, even when pyplot is imported elsewhere
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

# Colour-blind-safe palette (Okabe-Ito), FP16 always first / grey.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442")
FP16_COLOUR = "#6b7280"
RC = {
    "svg.fonttype": "path",  # text as outlines: no font lookup in the browser
    "font.family": "DejaVu Sans",  # shipped with matplotlib: no system font needed
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#e5e7eb",
    "grid.linewidth": 0.6,
    "axes.axisbelow": True,
    "axes.edgecolor": "#9ca3af",
    "axes.titlesize": 10,
    "axes.titleweight": "bold",
    "legend.frameon": False,
}
_HEADER = re.compile(r"^.*?(?=<svg\b)", re.DOTALL)
_METADATA = re.compile(r"<metadata>.*?</metadata>\s*", re.DOTALL)
_SIZE = re.compile(r'(<svg\b[^>]*?)\s(width|height)="[^"]*"')


def figure_to_svg(fig: Figure, label: str) -> str:
    """Serialise ``fig`` as an inline ``<svg>`` element with an accessible label."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    svg = _METADATA.sub("", _HEADER.sub("", buf.getvalue(), count=1), count=1)
    # drop fixed width/height (the viewBox stays) so CSS can size the chart
    svg = _SIZE.sub(r"\1", svg, count=1)
    svg = _SIZE.sub(r"\1", svg, count=1)
    safe = label.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;")
    return svg.replace("<svg ", f'<svg role="img" aria-label="{safe}" class="chart" ', 1)


def _new_figure(width: float, height: float) -> Figure:
    with matplotlib.rc_context(RC):
        return Figure(figsize=(width, height), dpi=100, layout="constrained")


def kld_chart(kld_by_candidate: dict[str, dict[str, float]]) -> str:
    """Grouped bars of the KLD summary statistics per candidate (log y axis)."""
    keys = ("mean", "median", "p90", "p99", "p999", "max")
    with matplotlib.rc_context(RC):
        fig = _new_figure(7.0, 2.8)
        ax = fig.add_subplot()
        n = max(len(kld_by_candidate), 1)
        width = 0.8 / n
        for i, (name, kld) in enumerate(kld_by_candidate.items()):
            # log axis: floor at 1e-6 nats so an exact-zero statistic still shows as a stub
            vals = [max(kld[k], 1e-6) for k in keys]
            xs = [j + (i - (n - 1) / 2) * width for j in range(len(keys))]
            ax.bar(xs, vals, width * 0.95, label=name, color=PALETTE[i % len(PALETTE)])
        ax.set_xticks(range(len(keys)), keys)
        ax.set_yscale("log")
        ax.set_ylabel("KL(FP16 ‖ candidate), nats")
        ax.set_title("Per-token KL divergence: summary statistics")
        ax.legend(loc="upper left", ncols=min(n, 4))
        return figure_to_svg(fig, "KL divergence statistics per candidate")


def length_histogram(lengths_by_model: dict[str, list[int]], unit: str = "words") -> str:
    """Overlaid step histograms of answer lengths (FP16 first, grey)."""
    all_vals = [v for vals in lengths_by_model.values() for v in vals]
    top = max(all_vals, default=1)
    bins = min(20, max(top, 1))
    edges = [top * i / bins for i in range(bins + 1)] if top > 0 else [0, 1]
    with matplotlib.rc_context(RC):
        fig = _new_figure(7.0, 2.6)
        ax = fig.add_subplot()
        for i, (name, vals) in enumerate(lengths_by_model.items()):
            colour = FP16_COLOUR if i == 0 else PALETTE[(i - 1) % len(PALETTE)]
            ax.hist(vals, bins=edges, histtype="step", linewidth=1.8, label=name, color=colour)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts of prompts
        ax.set_xlabel(f"answer length ({unit})")
        ax.set_ylabel("prompts")
        ax.set_title("Answer length distribution")
        ax.legend(loc="upper right")
        return figure_to_svg(fig, "Answer length histograms per model")


def layer_error_chart(layer_errors: dict[str, float], title: str) -> str:
    """Per-layer reconstruction error (proxy loss) as bars in model order, log y axis.

    Bars are coloured by the projection kind (the last part of the layer name) so a kind
    that is systematically hard to quantize (often ``down_proj``) stands out.
    """
    names = list(layer_errors)
    kinds = list(dict.fromkeys(n.rsplit(".", 1)[-1] for n in names))
    colour = {k: PALETTE[i % len(PALETTE)] for i, k in enumerate(kinds)}
    with matplotlib.rc_context(RC):
        fig = _new_figure(7.0, 2.8)
        ax = fig.add_subplot()
        vals = [layer_errors[n] for n in names]
        positive = [v for v in vals if v > 0]
        floor = min(positive) / 10 if positive else 1e-12
        for kind in kinds:
            idx = [i for i, n in enumerate(names) if n.rsplit(".", 1)[-1] == kind]
            ax.bar(idx, [max(vals[i], floor) for i in idx], 0.9, color=colour[kind], label=kind)
        ax.set_yscale("log")
        ax.set_xlim(-1, len(names))
        ax.set_xlabel(f"layer index in model order ({len(names)} layers)")
        ax.set_ylabel("proxy loss")
        ax.set_title(title)
        ax.legend(loc="upper left", ncols=min(len(kinds), 7), fontsize=7)
        return figure_to_svg(fig, title)


def size_quality_chart(points: dict[str, tuple[float, float, float | None, float | None]],
                       reference_gb: float | None) -> str:
    """Weight size (GB) against mean KLD (log axis), one point per candidate, its 95% interval
    as an error bar; FP16's size as a dashed line (its KLD is 0, off a log axis)."""
    with matplotlib.rc_context(RC):
        fig = _new_figure(7.0, 2.8)
        ax = fig.add_subplot()
        for i, (name, (gb, kld, low, high)) in enumerate(points.items()):
            colour = PALETTE[i % len(PALETTE)]
            y = max(kld, 1e-6)  # log axis: an exact zero still shows
            err = None
            if low is not None and high is not None:
                err = [[max(y - max(low, 1e-6), 0.0)], [max(high - y, 0.0)]]
            ax.errorbar([gb], [y], yerr=err, fmt="o", color=colour, capsize=4, markersize=6)
            # labels alternate above and below their points: close candidates stay legible
            ax.annotate(name, (gb, y), textcoords="offset points",
                        xytext=(7, 4 if i % 2 == 0 else -12), fontsize=8, color=colour)
        if reference_gb:
            ax.axvline(reference_gb, color=FP16_COLOUR, linestyle="--", linewidth=1)
            ax.annotate("FP16", (reference_gb, 1), xycoords=("data", "axes fraction"),
                        textcoords="offset points", xytext=(-4, -12), ha="right", fontsize=8,
                        color=FP16_COLOUR)
        ax.set_xlim(left=0)
        ax.set_yscale("log")
        ax.set_xlabel("weights on disk (GB)")
        ax.set_ylabel("mean KLD vs FP16 (nats)")
        ax.set_title("Size against quality (95% intervals): lower left is better")
        ax.margins(x=0.12, y=0.2)
        return figure_to_svg(fig, "Weight size against mean KL divergence per candidate")


def rate_distortion_chart(curves: dict[str, list[tuple[float, float]]],
                          points: dict[str, tuple[float, float]], title: str,
                          ylabel: str = "mean KLD vs FP16 (nats)") -> str:
    """Bits per weight against mean KLD (log axis): each curve (plans at several budgets, one
    planner) a line through its points in bits order, each point (a uniform setting) a
    labelled marker."""
    with matplotlib.rc_context(RC):
        fig = _new_figure(7.0, 3.2)
        ax = fig.add_subplot()
        for i, (name, pts) in enumerate(curves.items()):
            xs, ys = zip(*sorted(pts)) if pts else ((), ())
            ax.plot(xs, [max(y, 1e-6) for y in ys], marker="o", markersize=4, linewidth=1.4,
                    color=PALETTE[i % len(PALETTE)], label=name)
        for j, (name, (x, y)) in enumerate(points.items()):
            colour = PALETTE[(len(curves) + j) % len(PALETTE)]
            ax.plot([x], [max(y, 1e-6)], marker="s", markersize=6, linestyle="none",
                    color=colour)
            ax.annotate(name, (x, max(y, 1e-6)), textcoords="offset points",
                        xytext=(7, 4 if j % 2 == 0 else -12), fontsize=8, color=colour)
        ax.set_yscale("log")
        ax.set_xlabel("stored bits per weight (calibrated linears)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.margins(x=0.08, y=0.15)
        if curves:
            ax.legend(loc="upper right")
        return figure_to_svg(fig, title)


def speed_chart(values: dict[str, float], metric: str, unit: str) -> str:
    """Horizontal bars, one per measured configuration, for one speed metric."""
    names = list(values)
    with matplotlib.rc_context(RC):
        fig = _new_figure(7.0, 0.6 + 0.32 * max(len(names), 1))
        ax = fig.add_subplot()
        ys = list(range(len(names)))[::-1]
        bars = ax.barh(ys, [values[n] for n in names], 0.7,
                       color=[PALETTE[i % len(PALETTE)] for i in range(len(names))])
        ax.bar_label(bars, labels=[_fmt(values[n]) for n in names], padding=3, fontsize=8)
        ax.set_yticks(ys, names)
        ax.set_xlabel(f"{metric} ({unit})")
        ax.grid(axis="y", visible=False)
        ax.margins(x=0.15)
        return figure_to_svg(fig, f"{metric} per configuration")


def _fmt(v: float) -> str:
    if v == 0 or not math.isfinite(v):
        return str(v)
    digits = max(0, 2 - int(math.floor(math.log10(abs(v)))))
    return f"{v:,.{digits}f}"

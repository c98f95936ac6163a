"""The self-contained HTML quality / speed report.

:func:`render_quality_report` turns :class:`reports.data.ReportData` into ONE HTML page: inline
CSS (``reports/assets/report.css``), inline SVG charts, no script, no external resource of any
kind. :func:`write_report` writes it with the JSON of every number beside it (same stem).

Escaping rule: every string that did not come from this file (model outputs, prompts, names,
paths, layer names, bench fields) goes through :func:`esc` (``html.escape``) before it is
placed in the page; the only unescaped fragments are this file's markup, the word diff (built
from escaped tokens in :mod:`reports.textmetrics`) and matplotlib's SVG.
"""

from __future__ import annotations

import html
import math
import os
import re
from pathlib import Path

from quantpipe.core.io import write_json_atomic, write_text_atomic
from quantpipe.reports import charts
from quantpipe.reports.data import CalibrationFacts, ReportData, SpeedRecord
from quantpipe.reports.summary import ReportSummary, report_json, summarize
from quantpipe.reports.textmetrics import word_diff_html

CSS_PATH = Path(__file__).resolve().parent / "assets" / "report.css"
PROMPT_PREVIEW_CHARS = 600  # longer prompts are cut in the page (the JSON keeps ids)


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def visible(text: str) -> str:
    """Control characters as their Unicode control pictures (NUL -> U+2400) for display."""
    return "".join(
        chr(0x2400 + ord(ch)) if ord(ch) < 0x20 and ch not in "\n\t"
        else "\u2421" if ch == "\x7f" else ch
        for ch in text
    )


def fmt(v: float | int | None, digits: int = 4) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if not math.isfinite(v):
        return "—"
    if v != 0 and (abs(v) < 10 ** -(digits - 1) or abs(v) >= 1e6):
        return f"{v:.{max(digits - 2, 1)}e}"
    return f"{v:.{digits}f}"


def pct(v: float | None) -> str:
    return "—" if v is None or not math.isfinite(v) else f"{100 * v:.1f}%"


def _table(headers: list[str], rows: list[list[str]], num_cols: set[int] = frozenset(),
           cls: str = "") -> str:
    """``headers`` are escaped here; ``rows`` cells must already be escaped HTML."""
    th = "".join(f'<th class="num">{esc(h)}</th>' if i in num_cols else f"<th>{esc(h)}</th>"
                 for i, h in enumerate(headers))
    body = "".join(
        "<tr>" + "".join(f'<td class="num">{c}</td>' if i in num_cols else f"<td>{c}</td>"
                         for i, c in enumerate(r)) + "</tr>"
        for r in rows
    )
    return f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def _chart(svg: str) -> str:
    return f'<div class="chart-box">{svg}</div>'


# ---------------------------------------------------------------------------- sections


def _verdicts(summary: ReportSummary) -> str:
    cards = []
    for c in summary.candidates:
        v = c.verdict
        items = "".join(
            f'<li class="r-{esc(r.level)}"><span class="badge b-{esc(r.level)}">'
            f"{esc(r.level)}</span><span>{esc(r.message)}</span></li>"
            for r in v.reasons
        )
        advice = "".join(f"<li>{esc(a)}</li>" for a in v.advice)
        advice = f'<div class="advice"><b>Next step</b><ul>{advice}</ul></div>' if advice else ""
        cards.append(
            f'<div class="card v-{esc(v.status)}" data-verdict="{esc(v.status)}">'
            f'<h3>{esc(c.name)} <span class="badge b-{esc(v.status)}">{esc(v.status)}</span></h3>'
            f'<div class="path mono">{esc(c.path)}</div><ul class="reasons">{items}</ul>'
            f"{advice}</div>"
        )
    return ('<section id="verdict"><h2>Verdict</h2><p class="lead">Worst level reached by any '
            "rule. A number with a 95% interval (by evaluation window, or by prompt) decides "
            "its rule only when the whole interval lies on one side of the level; otherwise the "
            "rule is <em>inconclusive</em> and says how much more data would decide it. "
            "Thresholds are listed at the end of the page.</p>"
            f'<p class="recommendation"><b>{esc(summary.recommendation)}</b></p>'
            f'<div class="verdicts">{"".join(cards)}</div></section>')


def _gb(n: int | None) -> str:
    return "—" if n is None else f"{n / 1e9:.3f} GB"


def _c8(data: ReportData, name: str) -> float | None:
    """Output tokens/s of model ``name`` at the report's batch concurrency (None: not run)."""
    for m in data.model_speed:
        if m.name == name and m.by_concurrency:
            return m.by_concurrency[max(m.by_concurrency)].get("output_tokens_per_s")
    return None


def _candidates(data: ReportData, summary: ReportSummary) -> str:
    """One row per candidate (size, the deciding numbers with their intervals, speed, verdict)
    and the size-against-KLD chart."""
    ref_bytes = data.reference_bytes
    ref_rate = _c8(data, "FP16")
    rows, points = [], {}
    for c, cd in zip(summary.candidates, data.candidates):
        d, g = c.distribution, c.generation
        size = _gb(cd.weight_bytes)
        if cd.weight_bytes and ref_bytes:
            size += f'<div class="ci">{cd.weight_bytes / ref_bytes:.2f}x FP16</div>'
        rate = _c8(data, c.name)
        speed = "—" if rate is None else fmt(rate, 1)
        if rate and ref_rate:
            speed += f'<div class="ci">{rate / ref_rate:.2f}x FP16</div>'
        rl = g.intervals.get("rouge_l_mean") if g else None
        rows.append([
            esc(c.name), size,
            _with_interval(fmt(d.kld["mean"]), d.intervals.get("kld_mean")) if d else "—",
            _with_interval(pct(d.same_top_rate), d.intervals.get("same_top_rate"),
                           percent=True) if d else "—",
            _with_interval(fmt(g.rouge_l_mean, 3), rl and (rl.low, rl.high), 3) if g else "—",
            (f"{pct(g.json_agreement)} of {g.json_prompts}" if g and g.json_prompts else "—"),
            speed,
            f'<span class="badge b-{esc(c.verdict.status)}">{esc(c.verdict.status)}</span>'])
        if d is not None and cd.weight_bytes:
            iv = d.intervals.get("kld_mean") or (None, None)
            points[c.name] = (cd.weight_bytes / 1e9, d.kld["mean"], iv[0], iv[1])
    headers = ["candidate", "weights", "KLD mean", "same top", "ROUGE-L", "JSON agrees",
               "output tok/s", "verdict"]
    table = _table(headers, rows, num_cols=set(range(1, len(headers) - 1)))
    chart = (_chart(charts.size_quality_chart(points, ref_bytes / 1e9 if ref_bytes else None))
             if points else "")
    fp16 = f"FP16 weights: {_gb(ref_bytes)}. " if ref_bytes else ""
    return ('<section id="candidates"><h2>Candidates side by side</h2>'
            f'<p class="lead">{fp16}Output tokens/s at the batch concurrency of the speed '
            "section, on this host.</p>"
            f"{table}{chart}</section>")


def _with_interval(text: str, iv, digits: int = 4, percent: bool = False) -> str:
    """``text`` and, where known, its 95% interval (low, high) beneath it, small."""
    if iv is None:
        return text
    low, high = (pct(iv[0]), pct(iv[1])) if percent else (fmt(iv[0], digits), fmt(iv[1], digits))
    return f'{text}<div class="ci">95% {low} – {high}</div>'


def _distribution(summary: ReportSummary) -> str:
    measured = [c for c in summary.candidates if c.distribution is not None]
    if not measured:
        return ('<section id="distribution"><h2>Token distributions vs FP16</h2>'
                '<p class="empty">Not measured (no evaluation results given).</p></section>')
    metric_rows = [
        ("scored tokens", lambda d: fmt(d.tokens)),
        ("KLD mean", lambda d: _with_interval(fmt(d.kld["mean"]), d.intervals.get("kld_mean"))),
        ("KLD median", lambda d: fmt(d.kld["median"])),
        ("KLD p90", lambda d: fmt(d.kld["p90"])),
        ("KLD p99", lambda d: fmt(d.kld["p99"])),
        ("KLD p99.9", lambda d: fmt(d.kld["p999"])),
        ("KLD max", lambda d: fmt(d.kld["max"])),
        ("same top token", lambda d: _with_interval(pct(d.same_top_rate),
                                                    d.intervals.get("same_top_rate"),
                                                    percent=True)),
        ("Δp rms", lambda d: fmt(d.top_prob_delta["rms"])),
        ("Δp p1 / p5", lambda d: f'{fmt(d.top_prob_delta["p1"])} / {fmt(d.top_prob_delta["p5"])}'),
        ("Δp p50", lambda d: fmt(d.top_prob_delta["p50"])),
        ("Δp p95 / p99",
         lambda d: f'{fmt(d.top_prob_delta["p95"])} / {fmt(d.top_prob_delta["p99"])}'),
        ("perplexity FP16", lambda d: fmt(d.ppl_reference, 3)),
        ("perplexity candidate", lambda d: fmt(d.ppl_candidate, 3)),
        ("perplexity ratio", lambda d: _with_interval(fmt(d.ppl_ratio),
                                                      d.intervals.get("ppl_ratio"))),
    ]
    # metrics as rows, candidates as columns: stays readable for any number of metrics
    rows = [[esc(label)] + [get(c.distribution) for c in measured] for label, get in metric_rows]
    headers = ["metric"] + [c.name for c in measured]
    table = _table(headers, rows, num_cols=set(range(1, len(headers))))
    chart = charts.kld_chart({c.name: c.distribution.kld for c in measured})
    return ('<section id="distribution"><h2>Token distributions vs FP16</h2>'
            '<p class="lead">KL(P<sub>FP16</sub> ‖ P<sub>candidate</sub>) per scored token in '
            "nats; <em>same top</em>: tokens whose most likely next token matches FP16's; "
            "Δp: candidate minus FP16 probability of the text's next token (llama.cpp's Δp).</p>"
            f"{_side_by_side(table, _chart(chart), len(measured))}</section>")


def _side_by_side(table: str, chart: str, columns: int) -> str:
    """A table of one or two candidate columns beside its chart; a wider one above it (side
    by side, the chart covered the third column)."""
    return (f'<div class="grid-table-chart">{table}{chart}</div>' if columns <= 2
            else f"{table}{chart}")


def _prompt_text(p) -> str:
    if p.prompt is not None:
        text = p.prompt
    else:
        text = "\n".join(f"[{role}] {content}" for role, content in p.messages)
    if len(text) > PROMPT_PREVIEW_CHARS:
        text = text[:PROMPT_PREVIEW_CHARS] + " …"
    return text


def _generation(data: ReportData, summary: ReportSummary) -> str:
    gens = [c for c in summary.candidates if c.generation is not None]
    if not gens:
        return ('<section id="generations"><h2>Generation regression vs FP16</h2>'
                '<p class="empty">Not measured (no greedy outputs given).</p></section>')
    rows = []
    for c in gens:
        g = c.generation
        rl, ja = g.intervals.get("rouge_l_mean"), g.intervals.get("json_agreement")
        rows.append([esc(c.name),
                     _with_interval(fmt(g.rouge_l_mean, 3), rl and (rl.low, rl.high), 3),
                     fmt(g.rouge_l_median, 3), pct(g.exact_match_rate), pct(g.json_parse_rate),
                     _with_interval(pct(g.json_agreement), ja and (ja.low, ja.high),
                                    percent=True),
                     pct(g.garbage_rate)])
    ref = summary.reference
    rows.insert(0, ["FP16 (reference)", "1.000", "1.000", "100.0%", pct(ref.json_parse_rate),
                    "—", pct(ref.garbage_rate)])
    headers = ["model", "ROUGE-L mean", "ROUGE-L median", "exact match", "JSON parses",
               "JSON agrees", "garbage"]
    parts = ['<section id="generations"><h2>Generation regression vs FP16</h2>',
             '<p class="lead">Greedy outputs on the held-out prompts. ROUGE-L F1 uses a Unicode '
             "tokenizer (Chinese scored per character). <del>Struck red</del>: FP16 words the "
             "candidate lacks; <ins>green</ins>: words only the candidate wrote.</p>",
             _table(headers, rows, num_cols=set(range(1, len(headers))))]
    parts += [_groups(c) for c in gens if c.generation.groups]
    refs = data.reference_outputs or ()
    for i, p in enumerate(data.prompts):
        tags = [f'<span class="tag">{esc(p.category)}</span>']
        if p.lang:
            tags.append(f'<span class="tag">{esc(p.lang)}</span>')
        if p.expect_json:
            keys = ", ".join(p.json_keys) or "any"
            tags.append(f'<span class="tag">JSON: {esc(keys)}</span>')
        block = [f'<div class="prompt" id="prompt-{i}"><div class="phead">'
                 f'<span class="pid">{esc(p.id)}</span>{"".join(tags)}</div>'
                 f'<div class="ptext">{esc(_prompt_text(p))}</div>']
        for c, cd in zip(summary.candidates, data.candidates):
            if c.generation is None:
                continue
            r = c.generation.per_prompt[i]
            left, right = word_diff_html(visible(refs[i]), visible(cd.outputs[i]))
            left = left if refs[i].strip() else '<span class="empty">(empty output)</span>'
            right = right if cd.outputs[i].strip() else '<span class="empty">(empty output)</span>'
            em = '<span class="ok">exact</span>' if r.exact_match else "differs"
            json_note = ""
            if r.json is not None:
                ok = r.json.agrees
                json_note = (f' · JSON <span class="{"ok" if ok else "bad"}">'
                             f'{"agrees" if ok else _json_problem(r.json)}</span>')
            garbage = (' · <span class="bad">garbage: ' + esc("; ".join(r.garbage.reasons))
                       + "</span>") if r.garbage.is_garbage else ""
            block.append(
                '<div class="pair"><div class="col"><div class="lbl"><span>FP16</span></div>'
                f'<div class="out">{left}</div></div><div class="col"><div class="lbl">'
                f'<span>{esc(c.name)}</span><span class="scores">ROUGE-L <b>'
                f"{r.rouge_l:.3f}</b> · {em}{json_note}{garbage}</span></div>"
                f'<div class="out">{right}</div></div></div>')
        block.append("</div>")
        parts.append("".join(block))
    parts.append("</section>")
    return "".join(parts)


def _groups(c) -> str:
    """The candidate's generation numbers by prompt category, then by language."""
    rows = []
    for g in c.generation.groups:
        json_cell = (f"{pct(g.json_agreement)} of {g.json_prompts}" if g.json_prompts
                     else "—")
        rows.append([esc(g.group), fmt(g.prompts), fmt(g.rouge_l_mean, 3),
                     pct(g.exact_match_rate), json_cell,
                     f"{pct(g.garbage_rate)} / {pct(g.reference_garbage_rate)}",
                     "—" if g.length_ratio is None else f"{g.length_ratio:.2f}x",
                     f"{g.refusals} / {g.reference_refusals}"])
    headers = ["category / language", "prompts", "ROUGE-L", "exact match", "JSON agrees",
               "garbage (cand / FP16)", "length vs FP16", "refusals (cand / FP16)"]
    return (f"<h3>{esc(c.name)} by category and language</h3>"
            + _table(headers, rows, num_cols=set(range(1, len(headers)))))


def _json_problem(jc) -> str:
    if not jc.reference_parses:
        return "FP16 gave no JSON"
    if not jc.candidate_parses:
        return "does not parse"
    bad = [k for k, ok in zip(jc.keys, jc.key_agrees) if not ok]
    return "differs on " + esc(", ".join(bad))


def _lengths(data: ReportData, summary: ReportSummary) -> str:
    if summary.reference.lengths is None:
        return ""
    by_model = {"FP16": list(summary.reference.lengths.lengths)}
    stats = [("FP16", summary.reference.lengths)]
    for c in summary.candidates:
        if c.generation is not None:
            by_model[c.name] = list(c.generation.lengths.lengths)
            stats.append((c.name, c.generation.lengths))
    unit = summary.reference.lengths.unit
    rows = [[esc(n), fmt(s.mean, 1), fmt(s.median, 1), fmt(s.p90, 1), fmt(s.min), fmt(s.max),
             fmt(s.empty)] for n, s in stats]
    table = _table(["model", f"mean ({unit})", "median", "p90", "min", "max", "empty"], rows,
                   num_cols={1, 2, 3, 4, 5, 6})
    return ('<section id="lengths"><h2>Answer lengths</h2>'
            f"{table}{_chart(charts.length_histogram(by_model, unit))}</section>")


def _garbage(data: ReportData, summary: ReportSummary) -> str:
    if summary.reference.lengths is None:
        return ""
    flagged = []
    models = [("FP16", summary.reference.garbage, data.reference_outputs)]
    models += [(c.name, [r.garbage for r in c.generation.per_prompt], cd.outputs)
               for c, cd in zip(summary.candidates, data.candidates) if c.generation is not None]
    rows = []
    for name, scores, outs in models:
        n = len(scores)
        bad = sum(g.is_garbage for g in scores)
        worst_rep = max((g.repeated_ngram_rate for g in scores), default=0.0)
        worst_np = max((g.non_printable_ratio for g in scores), default=0.0)
        worst_run = max((g.longest_char_run for g in scores), default=0)
        rows.append([esc(name), f"{bad} / {n}", fmt(worst_rep, 3), fmt(worst_np, 4),
                     fmt(worst_run)])
        for i, g in enumerate(scores):
            if g.is_garbage:
                snippet = visible(outs[i][:200]) + (" …" if len(outs[i]) > 200 else "")
                flagged.append([esc(name), esc(data.prompts[i].id), esc("; ".join(g.reasons)),
                                f'<span class="mono">{esc(snippet)}</span>'])
    table = _table(["model", "flagged", "max repeated 3-gram rate", "max non-printable",
                    "longest char run"], rows, num_cols={1, 2, 3, 4})
    detail = (_table(["model", "prompt", "why", "output (start)"], flagged) if flagged
              else '<p class="empty">No output was flagged.</p>')
    return ('<section id="garbage"><h2>Repetition / garbage detector</h2>'
            '<p class="lead">An output is flagged when its word 3-gram repeat rate, share of '
            "non-printable characters, or longest run of one character or word exceeds the "
            f"detector's limits.</p>{table}{detail}</section>")


def _fallbacks_block(numerical: list, substituted: list) -> str:
    """Numerical fallbacks (each one counted), then group sizes substituted for an explicit
    request that did not divide a layer."""
    def rows(fs: list) -> str:
        return '<div class="scroll">' + _table(
            ["layer", "kind", "detail"],
            [[f'<span class="mono">{esc(f.layer)}</span>', esc(f.kind), esc(f.detail)]
             for f in fs]) + "</div>"

    if numerical:
        kinds: dict[str, int] = {}
        for f in numerical:
            kinds[f.kind] = kinds.get(f.kind, 0) + 1
        counts = ", ".join(f"{esc(k)}: {n}" for k, n in kinds.items())
        out = f"<h3>Numerical fallbacks ({counts})</h3>" + rows(numerical)
    else:
        out = '<p class="lead">Numerical fallbacks: none recorded.</p>'
    if substituted:
        out += (f"<h3>Group-size substitutions ({len(substituted)})</h3>"
                '<p class="lead">The requested --group-size does not divide these layers\' '
                "in_features; the largest size below it that does was used (--group-size auto "
                "plans this per layer; --strict-group-size makes it an error).</p>"
                + rows(substituted))
    return out


def _calibration_block(name: str, cal: CalibrationFacts) -> str:
    quantized = [r for r in cal.plan if r.bits is not None]
    kept = [r for r in cal.plan if r.bits is None]
    # an explicit --group-size that did not divide a layer is the user's to know, but it is
    # no numerical fallback (nothing failed): shown apart
    substituted = [f for f in cal.fallbacks if f.kind == "group_size"]
    numerical = [f for f in cal.fallbacks if f.kind != "group_size"]
    facts = [("algorithm", cal.algorithm), ("calibration samples", fmt(cal.samples)),
             ("sequence length", fmt(cal.seq_len)),
             ("effective bits / weight", fmt(cal.effective_bits, 3)),
             ("quantized layers", fmt(len(quantized))), ("kept in FP16", fmt(len(kept))),
             ("numerical fallbacks", fmt(len(numerical)))]
    if cal.group_sizes:
        facts.insert(3, ("INT4 group size", cal.group_sizes))
    if substituted:
        facts.append(("group-size substitutions", fmt(len(substituted))))
    dl = "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in facts)
    parts = [f'<div class="calib"><h3>{esc(name)}</h3><div class="grid-facts">'
             f'<dl class="facts">{dl}</dl>']
    groups: dict[str, list[str]] = {}
    for r in cal.plan:
        label = ("FP16" if r.bits is None else
                 f"INT{r.bits} " + ("per-channel" if r.group_size == -1 else f"g{r.group_size}")
                 + (" sym" if r.sym else " asym") + (" act-order" if r.act_order else ""))
        groups.setdefault(label, []).append(r.layer)
    if groups:
        rows = [[esc(k), fmt(len(v)), f'<span class="mono">{esc(", ".join(v[:3]))}'
                 f'{" …" if len(v) > 3 else ""}</span>'] for k, v in groups.items()]
        parts.append(_table(["format", "layers", "e.g."], rows, num_cols={1}))
    parts.append("</div>")
    if cal.validation_curves:
        point = ({"this plan": (cal.effective_bits, cal.validated_kld)}
                 if cal.validated_kld is not None and cal.effective_bits is not None else {})
        parts.append(_chart(charts.rate_distortion_chart(
            {k: list(v) for k, v in cal.validation_curves.items()}, point,
            f"{name}: the budget planner's upgrade paths, scored on held-out prompts",
            ylabel="KLD on held-out calibration prompts")))
        parts.append('<p class="lead">Each point: the whole model at that many bits per weight '
                     "along a path the planner can take, scored against FP16 on the half of the "
                     "calibration prompts the per-layer sensitivity never saw (quantpipe "
                     "sensitivity). The plan stops where its path scores lowest within the "
                     "budget, on the path that scores lower.</p>")
    if cal.layer_errors:
        parts.append(_chart(charts.layer_error_chart(
            cal.layer_errors, f"{name}: per-layer reconstruction error")))
        worst = sorted(cal.layer_errors.items(), key=lambda kv: -kv[1])[:10]
        parts.append("<h3>Largest reconstruction errors</h3>" + _table(
            ["layer", "proxy loss"],
            [[f'<span class="mono">{esc(k)}</span>', fmt(v)] for k, v in worst], num_cols={1}))
    else:
        parts.append('<p class="empty">No per-layer reconstruction error recorded.</p>')
    parts.append(_fallbacks_block(numerical, substituted))
    if len(groups) > 1:  # a uniform model's plan is the format table above, row for row
        err = cal.layer_errors
        rows = [[f'<span class="mono">{esc(r.layer)}</span>',
                 "FP16" if r.bits is None else fmt(r.bits),
                 "—" if r.group_size is None else ("channel" if r.group_size == -1
                                                   else fmt(r.group_size)),
                 "—" if r.sym is None else ("sym" if r.sym else "asym"),
                 fmt(r.act_order), fmt(err.get(r.layer))] for r in cal.plan]
        parts.append("<h3>Mixed-precision plan</h3>" + '<div class="scroll">' + _table(
            ["layer", "bits", "group", "zero", "act order", "proxy loss"], rows,
            num_cols={1, 2, 5}) + "</div>")
    parts.append("</div>")
    return "".join(parts)


def _calibration(data: ReportData) -> str:
    blocks = [_calibration_block(c.name, c.calibration) for c in data.candidates
              if c.calibration is not None]
    if not blocks:
        return ""
    return '<section id="calibration"><h2>Calibration</h2>' + "".join(blocks) + "</section>"


# metric family -> words that identify it in a bench record's "metric" field
SPEED_FAMILIES = {
    "TTFT": ("ttft", "time_to_first"),
    "TPOT": ("tpot", "itl", "time_per_output", "inter_token"),
    "throughput": ("tok/s", "tokens/s", "tokens_per_s", "tok_per_s", "throughput"),
}
PERCENTILE_FIELDS = ("p50", "p95", "p99")


def speed_family(r: SpeedRecord) -> str:
    text = f"{r.metric} {r.unit}".lower()
    for fam, words in SPEED_FAMILIES.items():
        if any(w in text for w in words):
            return fam
    return "other"


def _pfield(r: SpeedRecord, p: str) -> str:
    for k, v in r.extra.items():
        if re.fullmatch(rf"{p}(_\w+)?", str(k)) and isinstance(v, (int, float)):
            return fmt(float(v), 3)
    return "—"


def _ms(stats: dict, key: str, p: str) -> str:
    v = (stats.get(key) or {}).get(p)
    return "—" if v is None else fmt(float(v), 1)


def _model_speed(data: ReportData) -> str:
    """The speed and memory measured while the models answered (reports.answers): a memory
    table (one row per model) and a latency table (one row per model and concurrency)."""
    if not data.model_speed:
        return ""
    ref = data.model_speed[0] if data.model_speed[0].name == "FP16" else None
    levels = sorted({c for m in data.model_speed for c in m.by_concurrency})
    budget = data.memory_budget
    memory = [[esc(m.name), _gb(m.weight_bytes),
               "—" if m.peak_rss_bytes is None else _gb(m.peak_rss_bytes),
               fmt(m.kv_tokens(budget)) if budget else "—", fmt(m.load_s, 1)]
              for m in data.model_speed]
    latency = []
    for c in levels:
        ref_rate = ref.by_concurrency.get(c, {}).get("output_tokens_per_s") if ref else None
        for m in data.model_speed:
            st = m.by_concurrency.get(c)
            if st is None:
                continue
            rate = st.get("output_tokens_per_s")
            ratio = (f"{rate / ref_rate:.2f}x" if rate and ref_rate and m is not ref
                     else "—")
            latency.append([esc(m.name), fmt(c), fmt(st.get("requests")),
                            _ms(st, "ttft_ms", "p50"), _ms(st, "ttft_ms", "p95"),
                            _ms(st, "tpot_ms", "p50"), _ms(st, "tpot_ms", "p95"),
                            "—" if rate is None else fmt(float(rate), 1), ratio])
    first = data.model_speed[0]
    kv = (f"KV tokens in budget: ({_gb(budget)} - weights) / KV bytes per token "
          f"({fmt(first.kv_bytes_per_token)} B in the engine's "
          f"{esc(first.kv_dtype or first.activation_dtype)} "
          "cache). " if budget else "")
    reset = all(m.peak_rss_reset for m in data.model_speed)
    # a KV pool capped by memory (--kv-cache-memory) ran fewer than c requests at a time
    small = [f"{esc(m.name)}: {fmt(st['kv_pool_tokens'])} tokens, "
             f"{fmt(st.get('preemptions', 0))} recomputed"
             for m in data.model_speed for c, st in sorted(m.by_concurrency.items())
             if c > 1 and st.get("kv_pool_tokens") and
             (st.get("preemptions") or st.get("kv_pool_limited"))]
    kv += ("KV pool smaller than the largest requests at once (fewer in flight, so tokens/s "
           "is lower than a bigger pool gives; answers unchanged): " + "; ".join(small) + ". "
           if small else "")
    rates = {f"{m.name} (c={c})": float(m.by_concurrency[c]["output_tokens_per_s"])
             for c in levels for m in data.model_speed if c in m.by_concurrency}
    return ('<h3>Measured in this report</h3><p class="lead">Every model answered the held-out '
            "prompts through quantpipe's serving engine on this host, one model loaded at a "
            "time: a closed loop of c requests in flight (greedy, the prompts' own lengths, at "
            f"most the report's new tokens each), {esc(first.activation_dtype)} activations, "
            f"{esc(first.head_dtype)} output head. TTFT = first token - send; TPOT = time per "
            "output token after the first. Peak RSS: the process's high-water mark while that "
            "model loaded and answered"
            + ("" if reset else " (could not be reset: it covers the whole process)")
            + f". {kv}</p>"
            + _table(["model", "weights", "peak RSS", "KV tokens in budget", "load s"], memory,
                     num_cols={1, 2, 3, 4})
            + _table(["model", "concurrency", "requests", "TTFT p50 ms", "TTFT p95 ms",
                      "TPOT p50 ms", "TPOT p95 ms", "output tok/s", "vs FP16"], latency,
                     num_cols=set(range(1, 9)))
            + _chart(charts.speed_chart(rates, "output tokens/s", "tok/s")))


def _speed(data: ReportData) -> str:
    if not data.speed and not data.model_speed:
        return ""
    m = data.machine
    gpu = m.gpu or "none"
    cores = fmt(m.cpu_cores) if m.cpu_cores else "?"
    parts = ['<section id="speed"><h2>Speed and memory</h2>',
             f'<dl class="facts"><dt>CPU</dt><dd>{esc(m.cpu)} ({esc(cores)} logical cores)</dd>'
             f"<dt>vector ISA</dt><dd>{esc(m.isa or 'not known')}</dd>"
             f"<dt>memory</dt><dd>{_gb(m.memory_bytes)}</dd>"
             f"<dt>GPU</dt><dd>{esc(gpu)}</dd><dt>system</dt><dd>{esc(m.system)}</dd></dl>",
             _model_speed(data)]
    if not data.speed:
        return "".join(parts) + "</section>"
    parts.append("<h3>From benchmark files</h3>")
    for fam in ("TTFT", "TPOT", "throughput"):
        recs = [r for r in data.speed if speed_family(r) == fam]
        if not recs:
            continue
        rows = [[esc(r.name), esc(r.metric), fmt(r.value, 3), esc(r.unit)]
                + [_pfield(r, p) for p in PERCENTILE_FIELDS] for r in recs]
        parts.append(f"<h3>{esc(fam)}</h3>" + _table(
            ["configuration", "metric", "value", "unit", "p50", "p95", "p99"], rows,
            num_cols={2, 4, 5, 6}))
    by_metric: dict[tuple[str, str], dict[str, float]] = {}
    for r in data.speed:
        by_metric.setdefault((r.metric, r.unit), {})[r.name] = r.value
    speed_charts = [_chart(charts.speed_chart(values, metric, unit))
                    for (metric, unit), values in by_metric.items()]
    parts.append(f'<div class="grid2">{"".join(speed_charts)}</div>')
    rows = [[esc(r.name), esc(r.metric), fmt(r.value, 3), esc(r.unit),
             f'<span class="mono">{esc(", ".join(f"{k}={v}" for k, v in r.extra.items()))}'
             "</span>"] for r in data.speed]
    parts.append("<h3>All records</h3>" + '<div class="scroll">' + _table(
        ["name", "metric", "value", "unit", "other fields"], rows, num_cols={2}) + "</div>")
    parts.append("</section>")
    return "".join(parts)


def _thresholds(data: ReportData) -> str:
    rows = [[f'<span class="mono">{esc(k)}</span>', esc("off" if v is None else v)]
            for k, v in data.thresholds.to_dict().items()]
    return ('<section id="thresholds"><h2>Verdict thresholds</h2>'
            + _table(["threshold", "value"], rows, num_cols={1}) + "</section>")


def render_quality_report(data: ReportData, summary: ReportSummary | None = None) -> str:
    """The whole page as one string (``summary`` is computed when not given)."""
    summary = summary or summarize(data)
    css = CSS_PATH.read_text(encoding="utf-8")
    meta = [f"reference <code>{esc(data.reference)}</code>",
            f"{len(data.candidates)} candidate(s)", f"{len(data.prompts)} held-out prompt(s)"]
    if data.created:
        meta.append(f"generated {esc(data.created)}")
    notes = "".join(f'<p class="lead">{esc(n)}</p>' for n in data.notes)
    sections = [
        _verdicts(summary), _candidates(data, summary), _distribution(summary),
        _generation(data, summary),
        _lengths(data, summary), _garbage(data, summary), _calibration(data), _speed(data),
        _thresholds(data),
    ]
    toc_ids = [("verdict", "Verdict"), ("candidates", "Candidates"),
               ("distribution", "Distributions"),
               ("generations", "Generations"), ("lengths", "Lengths"), ("garbage", "Garbage"),
               ("calibration", "Calibration"), ("speed", "Speed and memory"),
               ("thresholds", "Thresholds")]
    body = "".join(sections)
    toc = "".join(f'<a href="#{i}">{t}</a>' for i, t in toc_ids if f'id="{i}"' in body)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        # no network at all, even if a future edit slips a URL in
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
        "style-src 'unsafe-inline'; img-src data:\">"
        f"<title>{esc(data.title)}</title><style>{css}</style></head><body><main>"
        f'<header class="top"><h1>{esc(data.title)}</h1>'
        f'<div class="meta">{" · ".join(meta)}</div>{notes}</header>'
        f'<nav class="toc">{toc}</nav>{body}'
        "<footer>Generated by quantpipe. Every number on this page is also in the JSON file "
        "with the same name.</footer></main></body></html>\n"
    )


def write_report(data: ReportData, out_html: str | os.PathLike) -> tuple[Path, Path]:
    """Write ``out_html`` and ``<stem>.json`` beside it, both atomically; return both paths."""
    out_html = Path(out_html)
    if out_html.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"{out_html}: the report path must end in .html")
    summary = summarize(data)
    page = render_quality_report(data, summary)
    json_path = out_html.with_suffix(".json")
    write_json_atomic(json_path, report_json(data, summary))
    write_text_atomic(out_html, page)
    return out_html, json_path

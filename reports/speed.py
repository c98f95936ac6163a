"""Speed numbers for the report: read the JSON of quantpipe's benchmarks, or measure briefly.

Readers turn each benchmark's own JSON into ``reports.data.SpeedRecord`` rows:

- generic: a list of ``{"name", "metric", "value", "unit"}`` (or ``{"records": [...]}``);
- ``bench/decode.py``: ``{"results": {model: {"decode_tokens_per_s", "prefill_s", ...}}}``;
- ``bench/kernel_speed.py``: ``{"rows": [{"kernel", "M", "N", "K", "s", ...}]}``;
- ``quantpipe bench-serve --json``: ``{"spec", "results": {concurrency: {"median": {...}}}}``.

The report's own speed and memory numbers are measured while the models answer
(``reports.answers``); these files add a benchmark's to them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from quantpipe.reports.data import SpeedRecord, load_speed_records


def _decode_records(obj: dict, label: str) -> list[SpeedRecord]:
    out = []
    for model, r in obj["results"].items():
        extra = {"source": label, "device": obj.get("device", "")}
        out.append(SpeedRecord(f"{model} decode", "decode tokens_per_s",
                               float(r["decode_tokens_per_s"]), "tok/s", extra))
        if "prefill_s" in r:
            out.append(SpeedRecord(f"{model} prefill", "prefill_ms",
                                   1e3 * float(r["prefill_s"]), "ms", extra))
        if r.get("peak_memory_bytes"):
            out.append(SpeedRecord(f"{model} peak memory", "peak_memory_mb",
                                   float(r["peak_memory_bytes"]) / 2**20, "MiB", extra))
    return out


def _kernel_records(obj: dict, label: str) -> list[SpeedRecord]:
    out = []
    for row in obj["rows"]:
        name = f"{row['kernel']} {row.get('spec', '')} M={row['M']} {row['N']}x{row['K']}"
        extra = {k: v for k, v in row.items() if k not in ("kernel", "s")}
        extra["source"] = label
        out.append(SpeedRecord(" ".join(name.split()), "kernel latency_us",
                               1e6 * float(row["s"]), "us", extra))
    return out


def _serve_records(obj: dict, label: str) -> list[SpeedRecord]:
    out = []
    model = obj.get("spec", {}).get("model") or label
    for conc, r in obj["results"].items():
        med = r["median"]
        name = f"{model} concurrency {conc}"
        for key, metric in (("ttft_ms", "ttft_ms"), ("tpot_ms", "tpot_ms"),
                            ("itl_ms", "itl_ms"), ("e2e_ms", "e2e_ms")):
            if key in med:
                stats = med[key]
                out.append(SpeedRecord(name, metric, float(stats["mean"]), "ms",
                                       {k: stats[k] for k in ("p50", "p95", "p99") if k in stats}
                                       | {"source": label}))
        out.append(SpeedRecord(name, "output tokens_per_s", float(med["output_throughput"]),
                               "tok/s", {"source": label}))
        out.append(SpeedRecord(name, "requests_per_s", float(med["request_throughput"]),
                               "req/s", {"source": label}))
    return out


def read_speed_file(path: str | os.PathLike) -> tuple[SpeedRecord, ...]:
    """Speed records from any of quantpipe's benchmark JSON files (see module docstring)."""
    path = Path(path)
    obj = json.loads(path.read_text(encoding="utf-8"))
    label = path.stem
    if isinstance(obj, list) or (isinstance(obj, dict) and "records" in obj):
        return load_speed_records(path)
    if isinstance(obj, dict) and "rows" in obj:
        return tuple(_kernel_records(obj, label))
    if isinstance(obj, dict) and isinstance(obj.get("results"), dict):
        first = next(iter(obj["results"].values()), {})
        if "decode_tokens_per_s" in first:
            return tuple(_decode_records(obj, label))
        if "median" in first:
            return tuple(_serve_records(obj, label))
    raise ValueError(
        f"{path}: not a speed result quantpipe knows (bench/decode.py, bench/kernel_speed.py, "
        "bench-serve --json, or a list of {name, metric, value, unit} records)"
    )

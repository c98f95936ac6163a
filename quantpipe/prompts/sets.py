"""Prompt records for calibration and held-out evaluation: loading, chat rendering, packing.

Pure data handling: no model code. Two steps, kept apart:

1. :func:`load_prompt_records` reads prompts from JSONL / CSV / TSV / TXT / parquet / a
   ``datasets.save_to_disk`` folder (all through the ``datasets`` library), or the shipped
   business set by name (``business-calib`` / ``business-eval``).
2. :func:`build_calibration_set` renders every record with the tokenizer's chat template,
   tokenizes, drops short samples, dedupes, shuffles with a seed and truncates or packs
   into ``seq_len`` windows. :func:`render_eval_texts` renders held-out records the same way.

Chat rendering rule (shared by both, so calibration and evaluation see the same text):
a ``prompt`` becomes one user message; ``messages`` are used as given. The assistant header
(``add_generation_prompt``) is appended when the last message is not from the assistant,
because that is exactly what the model sees when it serves the prompt. A tokenizer without
a chat template gets the raw prompt, or ``"{role}: {content}"`` lines for messages.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

logger = logging.getLogger(__name__)

# shipped prompt sets: name -> file inside quantpipe/prompts/data (see docs/prompts.md)
SHIPPED_SETS: dict[str, str] = {
    "business-calib": "business_calib.jsonl",
    "business-eval": "business_eval.jsonl",
}
ROLES = ("system", "user", "assistant")
_EXPECTED = (
    'expected {"prompt": "<text>"} or {"messages": [{"role": "user", "content": "<text>"}, ...]}'
)
# Caps on a prompt file (or a save_to_disk folder's files together) and on one of its lines:
# prompt sets are megabytes, and a wrong file (a dump, a one-line gigabyte) would otherwise
# take several times its size in memory in the readers before any error.
MAX_PROMPT_FILE_BYTES = 256 * 2**20
MAX_PROMPT_LINE_BYTES = 4 * 2**20


@dataclass(frozen=True)
class PromptRecord:
    """One prompt: either a single ``prompt`` string or a chat ``messages`` tuple."""

    id: str  # stable identifier (file stem + row index when the source has no id)
    source: str  # "<file>:<line N | row N | block N>" for error messages
    prompt: str | None = None  # single-turn text (becomes one user message)
    messages: tuple[tuple[str, str], ...] | None = None  # ((role, content), ...) multi-turn
    category: str = "unknown"  # e.g. "customer_support"; free text for user files
    lang: str | None = None  # "en" | "zh" for the shipped set; None when unknown
    expect_json: bool = False  # the answer should be a JSON object ...
    json_keys: tuple[str, ...] = ()  # ... holding these keys (checked by the reports)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError(f"{self.source}: give exactly one of prompt / messages; {_EXPECTED}")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError(f"{self.source}: prompt is empty; {_EXPECTED}")
        if self.messages is not None:
            if not self.messages:
                raise ValueError(f"{self.source}: messages is an empty list; {_EXPECTED}")
            for role, content in self.messages:
                if role not in ROLES:
                    raise ValueError(
                        f"{self.source}: message role {role!r} is not one of {ROLES}; "
                        "rename the role"
                    )
                if not isinstance(content, str) or not content.strip():
                    raise ValueError(
                        f"{self.source}: a {role} message has empty or non-string content"
                    )

    def chat(self) -> list[dict[str, str]]:
        """The record as chat messages (a prompt becomes one user message)."""
        if self.prompt is not None:
            return [{"role": "user", "content": self.prompt}]
        assert self.messages is not None
        return [{"role": r, "content": c} for r, c in self.messages]


# ---------------------------------------------------------------------------------------
# loading


def _read_dataset(path: Path, fmt: str):
    """Read ``path`` with the ``datasets`` library -> ``Dataset`` (or ``DatasetDict``)."""
    import datasets

    if fmt == "disk":
        return datasets.load_from_disk(str(path))  # a Dataset or a DatasetDict
    kwargs: dict[str, Any] = {}
    if fmt == "tsv":
        builder, kwargs = "csv", {"delimiter": "\t"}
    elif fmt == "txt":
        # blocks separated by an empty line ("\n\n") are one prompt each; a BOM is dropped
        builder, kwargs = "text", {"sample_by": "paragraph", "encoding": "utf-8-sig"}
    elif fmt in ("json", "csv", "parquet"):
        builder = fmt
    else:
        raise AssertionError(fmt)
    return datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs)


def _first_bad_jsonl_line(path: Path) -> str:
    """Locate the first line of a JSONL file that is not a JSON object (for error messages)."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                return f"line {n} is not UTF-8 text; re-save the file as UTF-8"
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                return f"line {n} is not valid JSON ({exc.msg})"
            if not isinstance(obj, dict):
                return f"line {n} is a JSON {type(obj).__name__}, not an object"
            try:  # JSON may escape a lone surrogate (an escape such as \ud800), which is no text
                json.dumps(obj, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                return (f"line {n} holds a lone surrogate escape (\\ud800-\\udfff), which is "
                        "not text; fix or remove that escape")
    return "no single bad line found (mixed value types across lines?)"


def _check_utf8(path: Path, max_line: int | None) -> None:
    """Text formats must be UTF-8 (some readers would otherwise silently mangle the text),
    in lines of at most ``max_line`` bytes (None: any), read a bounded line at a time."""
    limit = -1 if max_line is None else max_line + 1
    with open(path, "rb") as f:
        for n, raw in enumerate(iter(lambda: f.readline(limit), b""), start=1):
            if max_line is not None and len(raw) > max_line:
                raise ValueError(f"{path}: line {n} is longer than {max_line:,} bytes, the most "
                                 "a prompt line may hold; split the text into shorter prompts")
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{path}: cannot be read: line {n} is not UTF-8 text ({exc.reason} at byte "
                    f"{exc.start}); re-save the file as UTF-8"
                ) from exc


def _format_of(path: Path) -> str:
    if path.is_dir():
        return "disk"
    ext = path.suffix.lower()
    formats = {".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "tsv",
               ".txt": "txt", ".parquet": "parquet"}
    if ext not in formats:
        raise ValueError(
            f"{path}: unknown extension {ext!r}; use one of {sorted(formats)}, a "
            f"datasets.save_to_disk folder, or a shipped set {sorted(SHIPPED_SETS)}"
        )
    return formats[ext]


def _row_locations(path: Path, fmt: str, n_rows: int) -> list[str]:
    """Human locations of each row: JSONL line numbers (blank lines skipped), else row index."""
    if fmt == "json" and path.suffix.lower() == ".jsonl":
        with open(path, encoding="utf-8") as f:
            lines = [n for n, line in enumerate(f, start=1) if line.strip()]
        if len(lines) == n_rows:
            return [f"{path}:line {n}" for n in lines]
    unit = "block" if fmt == "txt" else "row"
    return [f"{path}:{unit} {i + 1}" for i in range(n_rows)]


def _to_record(row: dict[str, Any], text_col: str, use_messages: bool, loc: str,
               default_id: str) -> PromptRecord:
    prompt = row.get(text_col)
    messages = row.get("messages") if use_messages else None
    json_keys = row.get("json_keys") or []
    if not isinstance(json_keys, list) or not all(isinstance(k, str) for k in json_keys):
        raise ValueError(f"{loc}: json_keys must be a list of strings, e.g. [\"name\", \"date\"]")
    extra = dict(
        id=str(row["id"]) if row.get("id") is not None else default_id,
        source=loc,
        category=str(row.get("category") or "unknown"),
        lang=row.get("lang") or None,
        expect_json=bool(row.get("expect_json") or False),
        json_keys=tuple(json_keys),
    )
    if isinstance(prompt, str) and prompt.strip():
        return PromptRecord(prompt=prompt.strip("\n"), **extra)
    if isinstance(messages, list) and messages:
        pairs = []
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"{loc}: each message needs 'role' and 'content'; {_EXPECTED}")
            pairs.append((m["role"], m["content"]))
        return PromptRecord(messages=tuple(pairs), **extra)
    raise ValueError(
        f"{loc}: record has neither a non-empty {text_col!r} string nor a 'messages' list; "
        f"{_EXPECTED}"
    )


def load_prompt_records(path: str | os.PathLike, column: str | None = None) -> list[PromptRecord]:
    """Read prompt records from a file, a ``save_to_disk`` folder or a shipped set name.

    ``column`` names the text column (CSV/TSV/parquet/JSONL/folders); by default ``prompt``
    (or ``messages`` chat lists). TXT files hold one prompt per blank-line-separated block.
    Raises ValueError naming the file (and line/row) and what is expected.
    """
    name = str(path)
    if name in SHIPPED_SETS:
        ref = resources.files(__package__) / "data" / SHIPPED_SETS[name]
        with resources.as_file(ref) as real:
            if not real.is_file():
                raise ValueError(f"shipped prompt set {name!r} is missing at {real}; "
                                 "reinstall quantpipe (a source checkout regenerates it with "
                                 "tools/make_prompts.py)")
            return load_prompt_records(real, column)
    p = Path(path)
    fmt = _check_readable(p)
    ds = _open_dataset(p, fmt)
    text_col, use_messages = _text_column(p, fmt, list(ds.column_names), column)
    locs = _row_locations(p, fmt, ds.num_rows)
    records = []
    for i, row in enumerate(ds):
        if fmt == "txt" and not row["text"].strip():
            continue  # runs of 3+ newlines leave whitespace-only blocks
        records.append(_to_record(row, text_col, use_messages, locs[i], f"{p.stem}-{i}"))
    if not records:
        raise ValueError(f"{p}: holds only blank blocks; {_EXPECTED}")
    return records


def _check_readable(p: Path) -> str:
    """The prompt file's format, after checking it exists, is readable, non-empty UTF-8."""
    if not p.exists():
        raise ValueError(f"{p}: no such file or folder; give a prompt file or one of "
                         f"{sorted(SHIPPED_SETS)}")
    if not (p.is_dir() or p.is_file()):
        raise ValueError(f"{p}: not a regular file (a pipe, device or socket); save the "
                         "prompts to a file and pass that")
    fmt = _format_of(p)
    if not os.access(p, os.R_OK):
        raise ValueError(f"{p}: not readable (permission denied); fix its permissions")
    size = (sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if fmt == "disk"
            else p.stat().st_size)
    if fmt != "disk" and size == 0:
        raise ValueError(f"{p}: file is empty; {_EXPECTED}")
    if size > MAX_PROMPT_FILE_BYTES:
        raise ValueError(f"{p}: {size:,} bytes, above the {MAX_PROMPT_FILE_BYTES:,} bytes a "
                         "prompt set may hold; pass a sample of it")
    if fmt in ("json", "csv", "tsv", "txt"):
        # a .json file may hold all its records on one line: only the file cap applies there
        _check_utf8(p, None if p.suffix.lower() == ".json" else MAX_PROMPT_LINE_BYTES)
    return fmt


def _open_dataset(p: Path, fmt: str):
    """One non-empty ``datasets.Dataset`` from the file or folder."""
    import datasets

    try:
        ds = _read_dataset(p, fmt)
    except Exception as exc:  # datasets/pyarrow raise many types; re-raise with the remedy
        where = _first_bad_jsonl_line(p) if fmt == "json" else f"{type(exc).__name__}: {exc}"
        raise ValueError(f"{p}: cannot be read as {fmt}: {where}") from exc
    if isinstance(ds, datasets.DatasetDict):
        if len(ds) != 1:
            raise ValueError(
                f"{p}: saved DatasetDict has splits {list(ds)}; save a single split "
                "(ds['train'].save_to_disk(...)) or pass that split's folder"
            )
        ds = next(iter(ds.values()))
    if ds.num_rows == 0:
        raise ValueError(f"{p}: holds no records; {_EXPECTED}")
    return ds


def _text_column(p: Path, fmt: str, columns: list[str], column: str | None) -> tuple[str, bool]:
    """(text column, whether a ``messages`` chat column is used)."""
    if fmt == "txt":
        if column is not None:
            raise ValueError(f"{p}: a .txt file has no columns (one prompt per blank-line-"
                             f"separated block); drop column={column!r}")
        return "text", False
    if column is not None:
        if column not in columns:
            raise ValueError(f"{p}: column {column!r} not found; available columns: {columns}")
        return column, False
    if "prompt" in columns or "messages" in columns:
        return "prompt", "messages" in columns
    raise ValueError(
        f"{p}: no 'prompt' or 'messages' column; available columns: {columns}; "
        "pick the text column with column=... (CLI: --column)"
    )


# ---------------------------------------------------------------------------------------
# rendering


def _generation_prompt(chat: list[dict[str, str]]) -> bool:
    # the served model sees the assistant header after a user turn, not after its own turn
    return chat[-1]["role"] != "assistant"


def _render(tokenizer, record: PromptRecord) -> tuple[str, bool]:
    """Record -> (text, has_template). Template text already holds its special tokens."""
    chat = record.chat()
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=_generation_prompt(chat)
        )
        return text, True
    if record.prompt is not None:
        return record.prompt, False
    return "\n\n".join(f"{m['role']}: {m['content']}" for m in chat), False


def render_eval_texts(tokenizer, records: list[PromptRecord]) -> list[str]:
    """Each record rendered as the model sees it (chat template when the tokenizer has one)."""
    if not records:
        raise ValueError("no records to render; load some with load_prompt_records(...)")
    return [_render(tokenizer, r)[0] for r in records]


# ---------------------------------------------------------------------------------------
# calibration set


@dataclass(frozen=True)
class CalibDataSpec:
    """How to turn prompt records into calibration token windows."""

    n_samples: int = 128  # number of sequences to return (fewer if the data run out)
    seq_len: int = 512  # tokens per sequence (pack: exact; truncate: at most)
    min_tokens: int = 16  # drop rendered samples shorter than this
    seed: int = 0  # shuffle seed (same seed + same records -> same set)
    mode: Literal["truncate", "pack"] = "pack"  # pack: EOS-joined stream cut into full windows

    def __post_init__(self) -> None:
        if self.n_samples < 1:
            raise ValueError(f"n_samples must be >= 1 (got {self.n_samples}); 128 is typical")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (got {self.seq_len}); 512 is typical")
        if self.min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1 (got {self.min_tokens}); use 1 to keep all")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0 (got {self.seed})")
        if self.mode not in ("truncate", "pack"):
            raise ValueError(f"mode must be 'truncate' or 'pack' (got {self.mode!r})")


@dataclass(frozen=True)
class CalibSummary:
    """What happened to the records on the way to the calibration tensors."""

    records_read: int  # records given
    kept: int  # unique samples with >= min_tokens tokens
    dropped_short: int  # samples under min_tokens
    duplicates: int  # samples whose token sequence repeated an earlier one
    len_p5: int  # token-length percentiles of the kept samples (after chat rendering)
    len_p50: int
    len_p95: int
    len_max: int
    total_tokens: int  # tokens in the kept samples
    n_sequences: int  # sequences returned
    tokens_used: int  # tokens in the returned sequences

    def format(self) -> str:
        return (
            f"calibration data: {self.records_read} records read, {self.kept} kept, "
            f"{self.dropped_short} dropped (short), {self.duplicates} duplicates; token length "
            f"p5/p50/p95/max = {self.len_p5}/{self.len_p50}/{self.len_p95}/{self.len_max}; "
            f"{self.total_tokens} tokens available, {self.n_sequences} sequences "
            f"({self.tokens_used} tokens) returned"
        )


@dataclass(frozen=True)
class CalibrationSet:
    # pack: int64 [n, seq_len]; truncate: list of int64 [len_i] with len_i <= seq_len
    input_ids: torch.Tensor | list[torch.Tensor]
    summary: CalibSummary
    spec: CalibDataSpec = field(repr=False)


def _tokenize(tokenizer, records: list[PromptRecord]) -> list[list[int]]:
    rendered = [_render(tokenizer, r) for r in records]
    out = []
    for text, templated in rendered:
        # template text already carries BOS/role tokens; add none twice
        out.append(tokenizer(text, add_special_tokens=not templated)["input_ids"])
    return out


def _pack(samples: list[list[int]], eos_id: int, seq_len: int, n: int) -> torch.Tensor:
    """Concatenate samples with EOS between them and cut into full windows.

    samples: lists of token ids -> int64 [min(n, full windows), seq_len]; the trailing
    partial window is dropped so every row is real text (no padding in calibration).
    """
    stream: list[int] = []
    need = n * seq_len
    for s in samples:
        if stream:
            stream.append(eos_id)
        stream.extend(s)
        if len(stream) >= need:
            break
    n_full = min(n, len(stream) // seq_len)
    flat = torch.tensor(stream[: n_full * seq_len], dtype=torch.int64)  # [n_full*seq_len]
    return flat.view(n_full, seq_len)  # [n_full, seq_len] int64


def build_calibration_set(tokenizer, records: list[PromptRecord],
                          spec: CalibDataSpec) -> CalibrationSet:
    """Render, tokenize, filter, dedupe, shuffle and truncate/pack ``records``."""
    if not records:
        raise ValueError("no prompt records given; load some with load_prompt_records(...)")
    tokenized = _tokenize(tokenizer, records)
    kept: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    dropped_short = duplicates = 0
    for ids in tokenized:
        if len(ids) < spec.min_tokens:
            dropped_short += 1
            continue
        key = tuple(ids)
        if key in seen:
            duplicates += 1
            continue
        seen.add(key)
        kept.append(ids)
    if not kept:
        raise ValueError(
            f"all {len(records)} records were dropped ({dropped_short} shorter than min_tokens="
            f"{spec.min_tokens}, {duplicates} duplicates); lower min_tokens or add longer prompts"
        )
    random.Random(spec.seed).shuffle(kept)

    if spec.mode == "pack":
        eos_id = tokenizer.eos_token_id
        if eos_id is None:
            raise ValueError("tokenizer has no eos_token_id to separate packed samples; "
                             "set tokenizer.eos_token or use mode='truncate'")
        input_ids: torch.Tensor | list[torch.Tensor] = _pack(kept, eos_id, spec.seq_len,
                                                             spec.n_samples)
        n_seq = int(input_ids.shape[0])
        used = int(input_ids.numel())
    elif spec.mode == "truncate":
        input_ids = [torch.tensor(s[: spec.seq_len], dtype=torch.int64)
                     for s in kept[: spec.n_samples]]  # each int64 [<= seq_len]
        n_seq = len(input_ids)
        used = sum(int(t.numel()) for t in input_ids)
    else:
        raise AssertionError(spec.mode)

    lengths = np.array([len(s) for s in kept])
    total = int(lengths.sum())
    p5, p50, p95 = (int(round(v)) for v in np.percentile(lengths, [5, 50, 95]))
    summary = CalibSummary(
        records_read=len(records), kept=len(kept), dropped_short=dropped_short,
        duplicates=duplicates, len_p5=p5, len_p50=p50, len_p95=p95,
        len_max=int(lengths.max()), total_tokens=total, n_sequences=n_seq, tokens_used=used,
    )
    if n_seq == 0:
        raise ValueError(
            f"only {total} tokens in {len(kept)} kept samples: not enough for one "
            f"{spec.seq_len}-token window; lower seq_len, add prompts or use mode='truncate'"
        )
    if n_seq < spec.n_samples:
        logger.warning(
            "calibration data ran short: %d of %d requested sequences (%s mode, seq_len %d) "
            "from %d tokens in %d samples; add prompts or lower n_samples/seq_len",
            n_seq, spec.n_samples, spec.mode, spec.seq_len, total, len(kept),
        )
    logger.info(summary.format())
    return CalibrationSet(input_ids=input_ids, summary=summary, spec=spec)

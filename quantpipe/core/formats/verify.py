"""Validate a quantized folder of any registered format before anything is loaded.

The format is the one whose ``quant_method`` config.json names
(:data:`quantpipe.core.formats.registry.FORMAT_OF_METHOD`); its module reads the plan and the
stored layers, the checks are the same for every format. All are collected before one
``ValueError`` lists them (each names the file, the tensor and what was expected):

1. quantpipe folders (``quantpipe.json`` present): manifest readable, stage ``quantized``, every
   shard's size and sha256 (:func:`quantpipe.core.io.verify_shard_hashes`), no unlisted shards,
   the size and sha256 of config.json and the tokenizer / generation files (manifests written
   before those were recorded: the report says they could not be checked), manifest
   ``checkpoint_format`` and per-layer plan equal to what config.json describes.
   Folders made by other tools (no manifest) skip these and get the checks below.
2. every safetensors file parses; every quantized layer of the plan, and every quantized
   embedding table (``export --vocab-weights``; the format's ``read_embeddings``), has all its
   tensors with the shape and dtype the format and the spec require, and no stray ``.weight``;
   a head tied to a quantized table has no tensor of its own (the table is stored once);
3. group size divides ``in_features``; scales finite and > 0; zero points in ``[0, 2**bits-1]``
   (symmetric layers: exactly ``2**(bits-1)``); ``g_idx`` in ``[0, G)`` and sequential unless
   the layer uses act-order (the same checks on the embedding tables).
4. config.json's sizes agree with the tensors' shapes read from the safetensors headers
   (:func:`quantpipe.core.config_check.config_problems`): an absurd ``num_hidden_layers`` or
   ``hidden_size`` is refused before any model is built.

How much is re-read (``hashes``): ``"full"`` (``quantpipe verify``) hashes every byte and
checks every layer's values; ``"stamp"`` (loading: generate, serve, eval) does the same unless
a verified stamp (:mod:`quantpipe.core.verified`) shows that a full check of these exact files
passed before, and writes one after a full check passes; ``"skip"`` (``--no-verify``) checks
only what the headers say (presence, shapes, dtypes, config sizes). Steps 2 (presence, shapes,
dtypes) and 4 always run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from quantpipe.core.config_check import config_problems
from quantpipe.core.formats.base import CheckpointFormat, StoredLayer, UnpackedLayer
from quantpipe.core.formats.registry import FORMAT_OF_METHOD, layer_bits
from quantpipe.core.io import (
    MANIFEST_NAME,
    ST_TORCH_DTYPES,
    LazyTensors,
    read_manifest,
    verify_shard_hashes,
)
from quantpipe.core.qformat import QuantizedWeight, QuantSpec
from quantpipe.core.verified import file_keys, stamp_matches, write_stamp
from quantpipe.core.vocab import HEAD, vocab_tables

MAX_LISTED = 40  # problems listed in the error message (the count is always exact)
HASH_MODES = ("full", "stamp", "skip")  # see the module docstring
# tokenizer files whose presence means the folder carries a tokenizer (verify loads it)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify_checkpoint`` checked (only returned when everything passed)."""

    folder: str
    checkpoint_format: str  # a name of quantpipe.core.formats.registry.FORMATS
    hashes_checked: bool  # quantpipe.json present: shard sizes + sha256 verified
    files: int  # safetensors files read
    quantized_layers: int
    fp_tensors: int  # tensors kept as they are (embeddings, norms, biases, FP16 linears)
    specs: dict[str, int]  # spec label (e.g. "w4g128") -> number of layers
    quantized_weights: int  # sum of out*in over quantized linears
    quantized_bytes: int  # bytes stored for them (packed q + scales + zeros + g_idx)
    total_bytes: int  # size of all safetensors files
    # linears the manifest's plan keeps in FP16: their out*in and stored bits (0: none, or a
    # folder without a quantpipe plan)
    kept_fp16_weights: int = 0
    kept_fp16_bits: int = 0
    # "full": every byte hashed and every layer's values checked now; "stamp": a full check of
    # these unchanged files passed before (quantpipe.core.verified); "headers": --no-verify
    checked: str = "full"
    unchecked: tuple[str, ...] = ()  # what could not be checked (e.g. files an old manifest
    # does not hash), said in the summary
    # the embedding table and output head (a tied head counted once with the table): their
    # vocab * hidden weights and stored bits, quantized or FP; what they are (e.g. "embedding
    # w8pc, head tied"). A quantized head (lm_head) is counted here, not in quantized_*.
    vocab_weights: int = 0
    vocab_bits: int = 0
    vocab: str = ""

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight over the plan's linears: every byte on disk of the quantized
        ones (codes, scales, zeros, g_idx), the FP16-kept ones at 16. For quantpipe's exports
        this equals the plan's count (:func:`quantpipe.core.formats.registry.average_bits`)."""
        bits = 8 * self.quantized_bytes + self.kept_fp16_bits
        return bits / max(self.quantized_weights + self.kept_fp16_weights, 1)

    @property
    def bits_per_weight_with_vocab(self) -> float:
        """:attr:`bits_per_weight` with the embedding table and the head counted too (as
        stored: quantized or FP16, a tied head once)."""
        bits = 8 * self.quantized_bytes + self.kept_fp16_bits + self.vocab_bits
        return bits / max(self.quantized_weights + self.kept_fp16_weights + self.vocab_weights, 1)

    def summary(self) -> str:
        specs = ", ".join(f"{k} x{v}" for k, v in sorted(self.specs.items()))
        vocab = (f", {self.bits_per_weight_with_vocab:.3f} with the embedding table and head "
                 f"({self.vocab})" if self.vocab_weights else "")
        return (
            f"OK {self.folder}: {self.checkpoint_format}, {self.quantized_layers} quantized "
            f"layers ({specs}), {self.fp_tensors} other tensors, {self.files} file(s), "
            f"{self.total_bytes / 1e6:.2f} MB, {self.bits_per_weight:.3f} bits/weight over "
            f"{'the calibrated' if self.kept_fp16_weights else 'the quantized'} linears"
            f"{vocab}; "
            + ("manifest and sha256 verified" if self.hashes_checked
               else "no quantpipe.json (made by another tool): hashes not checked")
            + "".join(f"; {note}" for note in self.unchecked)
        )


@dataclass
class Inspection:
    """Everything read while verifying; the loader builds on it."""

    report: VerifyReport
    config: dict
    manifest: dict | None
    plan: dict[str, QuantSpec]
    layers: Mapping[str, QuantizedWeight]  # unpacked on access, one at a time
    fp_tensors: Mapping[str, torch.Tensor]  # read from the mmapped files on access
    problems: list[str] = field(default_factory=list)
    # quantized embedding tables [vocab, hidden] by module name, unpacked on access
    embeddings: Mapping[str, QuantizedWeight] = field(default_factory=dict)


def verify_checkpoint(folder: str | Path, hashes: str = "full") -> VerifyReport:
    """Check a quantized folder; ValueError listing every problem found (see module doc)."""
    return inspect_checkpoint(folder, hashes).report


# ---- reading ------------------------------------------------------------------------------


def _safetensors_files(folder: Path, problems: list[str]) -> list[str]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as exc:
            problems.append(f"{index}: unreadable index ({exc}); re-export the folder")
            files = []
        for f in files:
            if not (folder / f).is_file():
                problems.append(f"{folder / f}: listed in {index.name} but missing")
        return [f for f in files if (folder / f).is_file()]
    files = [p.name for p in sorted(folder.glob("*.safetensors"))]
    if not files:
        problems.append(f"{folder}: no *.safetensors files")
    return files


# a tensor's (shape, dtype) as its file's header gives it (dtype None: unknown to torch)
Meta = dict[str, tuple[tuple[int, ...], "torch.dtype | None"]]


def _read_tensors(
    folder: Path, files: list[str], problems: list[str]
) -> tuple[LazyTensors, dict[str, str], Meta]:
    """Parse every file's header (corrupt ones become problems); tensors are read lazily,
    shapes and dtypes are taken from the headers here (no tensor data is read)."""
    where: dict[str, str] = {}
    meta: Meta = {}
    for fname in files:
        try:
            with safe_open(str(folder / fname), framework="pt") as f:
                for k in f.keys():
                    where[k] = fname
                    sl = f.get_slice(k)
                    meta[k] = (tuple(sl.get_shape()), ST_TORCH_DTYPES.get(sl.get_dtype()))
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            problems.append(f"{folder / fname}: not a readable safetensors file ({exc})")
    return LazyTensors(folder, where), where, meta


class LazyLayers(Mapping):
    """Verified quantized layers, unpacked one at a time on access (never all at once)."""

    def __init__(self, fmt: CheckpointFormat, layers: list[StoredLayer], tensors: LazyTensors,
                 qcfg: dict):
        self._fmt, self._qcfg, self._tensors = fmt, qcfg, tensors
        self._layers = {lay.name: lay for lay in layers}

    def __getitem__(self, name: str) -> QuantizedWeight:
        lay = self._layers[name]
        return _quantized_weight(lay.spec, unpack_layer(self._fmt, lay, self._tensors, self._qcfg))

    def __iter__(self) -> Iterator[str]:
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)


def _read_own_manifest(folder: Path, problems: list[str]) -> dict | None:
    if not (folder / MANIFEST_NAME).is_file():
        return None
    try:
        return read_manifest(folder, "quantized")
    except ValueError as exc:
        problems.append(str(exc))
        return None


def _check_manifest(folder: Path, fmt: CheckpointFormat | None, manifest: dict, deep: bool,
                    problems: list[str]) -> list[str]:
    """Manifest checks; with ``deep`` every listed file is hashed. Returns what could not be
    checked (said in the report)."""
    if fmt is not None and manifest.get("checkpoint_format") != fmt.name:
        problems.append(f"{folder / MANIFEST_NAME}: checkpoint_format "
                        f"{manifest.get('checkpoint_format')!r} but config.json describes "
                        f"{fmt.name!r}")
    shards = manifest.get("shards") or []
    # config.json and the tokenizer / generation files (absent from older manifests)
    files = manifest.get("files")
    entries = [*shards, *(files or [])]
    if deep:
        _hash_with_progress(folder, entries, problems)
    else:  # sizes only: a stat per file
        for entry in entries:
            path = folder / entry["file"]
            if not path.is_file() or ("bytes" in entry
                                      and path.stat().st_size != entry["bytes"]):
                _hash_with_progress(folder, [entry], problems)  # says what is wrong with it
    listed = {e["file"] for e in shards}
    for p in sorted(folder.glob("*.safetensors")):
        if p.name not in listed:
            problems.append(f"{p}: not listed in {MANIFEST_NAME} (stray or renamed shard)")
    if files is None:
        return [f"config.json and tokenizer files not checked ({MANIFEST_NAME} predates their "
                "hashes; re-export the folder to record them)"]
    return []


def _hash_with_progress(folder: Path, entries: list[dict], problems: list[str]) -> None:
    """sha256 of every entry's file against the manifest, a progress bar after a second."""
    total = sum((folder / e["file"]).stat().st_size for e in entries
                if (folder / e["file"]).is_file())
    with tqdm(total=total, desc=f"sha256 {folder.name}", unit="B", unit_scale=True,
              delay=1.0, leave=False) as bar:
        for entry in entries:
            try:
                verify_shard_hashes(folder, [entry], progress=bar.update)
            except ValueError as exc:
                problems.append(str(exc))


def _checked_files(folder: Path, files: list[str], manifest: dict | None) -> list[str]:
    """The files a full check reads: what a verified stamp keys."""
    names = ["config.json", *files]
    for extra in (MANIFEST_NAME, "model.safetensors.index.json"):
        if (folder / extra).is_file():
            names.append(extra)
    names += [e["file"] for e in (manifest or {}).get("files") or []]
    return [n for n in names if (folder / n).is_file()]


def _check_tokenizer(folder: Path, problems: list[str]) -> list[str]:
    """Load the folder's tokenizer as generate and serve do (a corrupt file is a problem)."""
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return ["no tokenizer files (generate and serve need one beside the weights)"]
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as exc:  # tokenizers / transformers raise many types for a bad file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        problems.append(f"{folder}: the tokenizer does not load ({first}); copy the tokenizer "
                        "files from the FP16 folder again")
    return []


# ---- per-layer checks ----------------------------------------------------------------------


def unpack_layer(fmt: CheckpointFormat, lay: StoredLayer, tensors, qcfg: dict) -> UnpackedLayer:
    """Every unpack of a stored layer goes through here (checks and lazy loading alike)."""
    return fmt.unpack(lay, tensors, qcfg)


def _check_values(lay: StoredLayer, u: UnpackedLayer, where: dict[str, str]) -> list[str]:
    """Value checks on one unpacked layer; each message names file and tensor."""
    spec, out = lay.spec, []
    in_f = u.q.shape[1]
    n_groups = u.scales.shape[1]

    def loc(role: str) -> str:
        t = lay.roles[role]
        return f"{where.get(t, '?')}: {t}"

    bad_nf = int((~torch.isfinite(u.scales)).sum())
    bad_np = int((u.scales <= 0).sum())
    if bad_nf or bad_np:
        out.append(f"{loc('scales')}: {bad_nf} non-finite and {bad_np} non-positive scale(s) "
                   "(expected finite values > 0)")
    lo, hi = int(u.zeros.min()), int(u.zeros.max())
    if lo < 0 or hi > spec.maxq:
        out.append(f"{loc('zeros')}: zero points span [{lo}, {hi}], outside [0, {spec.maxq}] "
                   f"for {spec.bits}-bit")
    elif spec.sym and (lo != spec.sym_zero or hi != spec.sym_zero):
        out.append(f"{loc('zeros')}: symmetric layer with zero points in [{lo}, {hi}] "
                   f"(expected all {spec.sym_zero})")
    if u.g_idx is not None:
        glo, ghi = int(u.g_idx.min()), int(u.g_idx.max())
        if glo < 0 or ghi >= n_groups:
            out.append(f"{loc('g_idx')}: values in [{glo}, {ghi}], expected [0, {n_groups - 1}]")
        elif not spec.act_order:
            seq = torch.arange(in_f) // spec.group_size_for(in_f)
            if not torch.equal(u.g_idx.long(), seq):
                out.append(f"{loc('g_idx')}: not sequential (i // group_size) but the config "
                           "does not enable act-order (desc_act / actorder)")
    return out


def _quantized_weight(spec: QuantSpec, u: UnpackedLayer) -> QuantizedWeight:
    g_idx = u.g_idx
    if g_idx is not None and not spec.act_order:
        g_idx = None  # checked sequential above: the spec's own i // group_size
    return QuantizedWeight(spec, u.q, u.scales.contiguous(), u.zeros.to(torch.uint8), g_idx)


# ---- the whole check ------------------------------------------------------------------------


def inspect_checkpoint(folder: str | Path, hashes: str = "stamp") -> Inspection:
    """Read and check a folder; ValueError listing every problem (nothing half-loaded).

    ``hashes``: one of :data:`HASH_MODES` (module docstring)."""
    if hashes not in HASH_MODES:
        raise ValueError(f"hashes={hashes!r}: use one of {HASH_MODES}")
    folder = Path(folder)
    problems: list[str] = []
    config = _read_config(folder)
    qcfg = config.get("quantization_config") or {}
    method = qcfg.get("quant_method")
    fmt = FORMAT_OF_METHOD.get(method)  # None: not a format quantpipe reads
    if fmt is None:
        problems.append(f"{folder / 'config.json'}: quantization_config.quant_method={method!r}; "
                        f"quantpipe reads {sorted(FORMAT_OF_METHOD)}")
    manifest = _read_own_manifest(folder, problems)
    files = _safetensors_files(folder, problems)
    checked = _checked_files(folder, files, manifest)
    deep = hashes == "full" or (hashes == "stamp" and not stamp_matches(folder, checked))
    before = file_keys(folder, checked) if deep and hashes != "skip" else None
    unchecked = (_check_manifest(folder, fmt, manifest, deep, problems)
                 if manifest is not None else [])
    n_before = len(problems)
    tensors, where, meta = _read_tensors(folder, files, problems)
    if len(problems) > n_before:
        # an unreadable shard's tensors would each be reported missing: say it once instead
        problems.append("per-layer checks skipped until the unreadable shard(s) above are "
                        "replaced (re-export or re-download them)")
        fmt = None
    else:  # sizes in config.json against the headers' shapes, before any model is built
        problems.extend(f"{folder / 'config.json'}: {p}"
                        for p in config_problems(config, {k: m[0] for k, m in meta.items()}))
    if hashes == "full":
        unchecked += _check_tokenizer(folder, problems)

    plan, lays = fmt.read_layers(qcfg, tensors, problems) if fmt else ({}, [])
    emb_lays = fmt.read_embeddings(qcfg, tensors, problems) if fmt else []
    head = [lay for lay in lays if lay.name == HEAD]  # counted with the vocabulary tables
    good, q_weights, q_bytes = _check_layers(fmt, [lay for lay in lays if lay.name != HEAD],
                                             tensors, where, meta, qcfg, deep, problems)
    vocab_good, _, _ = _check_layers(fmt, head + emb_lays, tensors, where, meta, qcfg, deep,
                                     problems)
    good_emb = [lay for lay in vocab_good if lay.name != HEAD]
    good += [lay for lay in vocab_good if lay.name == HEAD]
    if emb_lays:
        _check_tied_head(config, meta, where, problems)
    if manifest is not None and fmt:  # no plan was read without a format
        _check_manifest_agrees(folder, fmt, manifest, plan, qcfg, problems)
    if problems:
        listed = "\n  - ".join(problems[:MAX_LISTED])
        extra = len(problems) - MAX_LISTED
        more = f"\n  ... and {extra} more" if extra > 0 else ""
        raise ValueError(f"{folder}: {len(problems)} problem(s); nothing was loaded:\n  - "
                         f"{listed}{more}")

    assert fmt is not None  # an unknown format or an unreadable shard is a problem above
    if deep and hashes != "skip":
        # a full check passed: the next load need not repeat it (unless a file changed since
        # the check began: then it is not stamped)
        write_stamp(folder, checked, before)
    fp_tensors = tensors.without({t for lay in good + good_emb for t in lay.expected})
    specs: dict[str, int] = {}
    for s in plan.values():
        specs[s.label()] = specs.get(s.label(), 0) + 1
    kept = _kept_fp16_shapes(manifest)
    report = VerifyReport(
        folder=str(folder), checkpoint_format=fmt.name, hashes_checked=manifest is not None,
        files=len(files), quantized_layers=len(good), fp_tensors=len(fp_tensors),
        specs=specs, quantized_weights=q_weights, quantized_bytes=q_bytes,
        total_bytes=sum((folder / f).stat().st_size for f in files),
        kept_fp16_weights=sum(o * i for o, i in kept),
        kept_fp16_bits=sum(layer_bits(None, shape, fmt.name) for shape in kept),
        checked="full" if deep else ("stamp" if hashes == "stamp" else "headers"),
        unchecked=tuple(unchecked),
        **_vocab_counts(config, meta, vocab_good),
    )
    return Inspection(report, config, manifest, plan, LazyLayers(fmt, good, tensors, qcfg),
                      fp_tensors, embeddings=LazyLayers(fmt, good_emb, tensors, qcfg))


_FP_LABELS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _vocab_counts(config: dict, meta: Meta, quantized: list[StoredLayer]) -> dict:
    """VerifyReport's ``vocab_weights``, ``vocab_bits`` (stored bytes, from the headers) and
    ``vocab`` (``quantized``: the verified quantized tables and head); nothing for a model
    without a family entry (its table names are not known)."""
    try:
        tables = vocab_tables(config)
    except ValueError:
        return {}
    weights = bits = 0
    said = []
    for role, name in (("embedding", tables.embedding), ("head", tables.head)):
        lay = next((q for q in quantized if q.name == name), None)
        if lay is not None:
            stored, label = list(lay.expected), lay.spec.label()
            # the codes: the largest int32 tensor, 32 / bits weights per word
            codes = max((t for t in stored if meta[t][1] == torch.int32),
                        key=lambda t: math.prod(meta[t][0]))
            weights += math.prod(meta[codes][0]) * 32 // lay.spec.bits
        elif f"{name}.weight" in meta:
            stored = [f"{name}.weight"]
            label = _FP_LABELS.get(meta[stored[0]][1], str(meta[stored[0]][1]))
            weights += math.prod(meta[stored[0]][0])
        else:
            said.append(f"{role} tied" if role == "head" and tables.tied else f"{role} absent")
            continue
        bits += sum(8 * math.prod(meta[t][0]) * meta[t][1].itemsize for t in stored)
        said.append(f"{role} {label}")
    return {"vocab_weights": weights, "vocab_bits": bits, "vocab": ", ".join(said)}


def _check_tied_head(config: dict, meta: Meta, where: dict[str, str],
                     problems: list[str]) -> None:
    """A head tied to a quantized embedding table is the table: no tensor of its own."""
    try:
        tables = vocab_tables(config)
    except ValueError as exc:
        problems.append(f"config.json: {exc}")
        return
    if not tables.tied:
        return
    for k in meta:
        if k.startswith(f"{tables.head}."):
            problems.append(f"{where[k]}: {k} stored although config.json ties the head to the "
                            f"quantized table {tables.embedding} (a tied table is stored once)")


def _kept_fp16_shapes(manifest: dict | None) -> list[tuple[int, int]]:
    """[out, in] of every linear the manifest's plan keeps in FP16 (bits per weight count
    them as the plan does)."""
    layers = ((manifest or {}).get("plan") or {}).get("layers") or {}
    return [tuple(v["shape"]) for v in layers.values() if v.get("bits") is None and "shape" in v]


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder}: no config.json; pass the folder written by "
                         "`quantpipe export` (or a GPTQ / compressed-tensors model folder)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); restore it from the FP16 folder or "
                         "re-export") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a JSON object is expected; restore it or re-export")
    return config


def _check_layers(fmt: CheckpointFormat | None, lays: list[StoredLayer], tensors: LazyTensors,
                  where: dict[str, str], meta: Meta, qcfg: dict, deep: bool,
                  problems: list[str]
                  ) -> tuple[list[StoredLayer], int, int]:
    """(layers that passed, their out*in weights, their stored bytes); one layer's tensors
    in memory at a time. Without ``deep``, only the headers are checked (weights count 0)."""
    good: list[StoredLayer] = []
    q_bytes = q_weights = 0
    for lay in lays:
        if not _shapes_ok(lay, meta, where, problems):
            continue
        if deep:
            u = _checked_layer(fmt, lay, tensors, where, qcfg, problems)
            if u is None:
                continue
            q_weights += u.q.numel()
            del u
        good.append(lay)
        q_bytes += sum(math.prod(meta[t][0]) * meta[t][1].itemsize for t in lay.expected)
    return good, q_weights, q_bytes


def _shapes_ok(lay: StoredLayer, meta: Meta, where: dict, problems: list[str]) -> bool:
    """Presence, shape and dtype of the layer's tensors, from the headers alone."""
    ok = True
    for tname, (shape, dtypes) in lay.expected.items():
        got = meta.get(tname)
        if got is None:
            problems.append(f"{lay.name}: missing tensor {tname} (expected "
                            f"{_dt(dtypes)} {list(shape)}, spec {lay.spec.label()})")
            ok = False
        elif got[0] != shape or got[1] not in dtypes:
            problems.append(f"{where[tname]}: {tname} is {str(got[1])[6:]} "
                            f"{list(got[0])}, expected {_dt(dtypes)} {list(shape)} "
                            f"(spec {lay.spec.label()})")
            ok = False
    if f"{lay.name}.weight" in meta:
        problems.append(f"{where[f'{lay.name}.weight']}: {lay.name}.weight present next to "
                        "its quantized tensors (a layer is either quantized or FP)")
    return ok


def _checked_layer(fmt: CheckpointFormat, lay: StoredLayer, tensors, where: dict, qcfg: dict,
                   problems: list[str]):
    """The layer's unpacked tensors, or None after appending what is wrong with its values."""
    u = unpack_layer(fmt, lay, tensors, qcfg)
    in_f = u.q.shape[1]
    gs = lay.spec.group_size
    if gs != -1 and in_f % gs:
        problems.append(f"{lay.name}: group_size {gs} does not divide in_features {in_f}; "
                        "the scales cannot cover the columns")
        return None
    found = _check_values(lay, u, where)
    problems.extend(found)
    return None if found else u


def _check_manifest_agrees(folder: Path, fmt: CheckpointFormat, manifest: dict,
                           plan: dict[str, QuantSpec], qcfg: dict, problems: list[str]) -> None:
    """The manifest's plan (and the format's own fields) must say what config.json says."""
    if "layers" in manifest:
        want = {n: s.to_dict() for n, s in plan.items()}
        if manifest["layers"] != want:
            diff = sorted(n for n in set(want) | set(manifest["layers"])
                          if want.get(n) != manifest["layers"].get(n))
            problems.append(f"{folder / MANIFEST_NAME}: plan differs from config.json for "
                            f"{len(diff)} layer(s), e.g. {diff[:3]}")
    if manifest.get("embeddings") != qcfg.get("embeddings") and (
            "embeddings" in manifest or qcfg.get("embeddings")):
        problems.append(f"{folder / MANIFEST_NAME}: embeddings {manifest.get('embeddings')} "
                        f"but config.json says {qcfg.get('embeddings')}")
    problems.extend(f"{folder / MANIFEST_NAME}: {p}" for p in fmt.manifest_problems(manifest, qcfg))


def _dt(dtypes: tuple[torch.dtype, ...]) -> str:
    return "/".join(str(d)[6:] for d in dtypes)

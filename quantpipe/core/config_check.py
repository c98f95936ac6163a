"""config.json's sizes against the tensors a checkpoint stores, before any model is built.

transformers builds whatever config.json describes: ``num_hidden_layers: 100000`` or
``hidden_size: 0`` makes it build (and fill) a model of that size for minutes before the
load fails. The safetensors headers give every tensor's shape without reading its data, so
the sizes that decide a model's shape are checked against them first:

- ``hidden_size``, ``num_hidden_layers``, ``vocab_size``, ``num_attention_heads`` and
  ``intermediate_size`` (where present) are positive integers;
- the decoder blocks stored are exactly ``0 .. num_hidden_layers - 1``;
- the input embedding table is ``[vocab_size, hidden_size]`` and the final norm and each
  block's input norm are ``[hidden_size]``;
- an FP MLP projection stored as a weight matches ``intermediate_size``.

Names follow :data:`quantpipe.core.families.FAMILIES` (decoder, block list, norms); a model
type quantpipe does not know gets the integer checks only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

from safetensors import safe_open

from quantpipe.core.families import FAMILIES, Family
from quantpipe.core.io import safetensors_files

# fields that must be positive integers wherever config.json has them
POSITIVE_INTS = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
                 "num_key_value_heads", "intermediate_size", "head_dim")


def config_problems(config: dict, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """What in ``config`` disagrees with the stored ``shapes`` (name -> shape), one line each
    naming the field, the tensor and a remedy; empty when all agree."""
    out = [f"{f} is {config[f]!r}, expected a positive integer; restore config.json from the "
           "FP16 folder or re-export" for f in POSITIVE_INTS
           if f in config and config[f] is not None
           and (isinstance(config[f], bool) or not isinstance(config[f], int) or config[f] < 1)]
    family = FAMILIES.get(config.get("model_type"))
    if out or family is None:
        return out
    out += _block_problems(config, shapes, family)
    hidden, vocab = config.get("hidden_size"), config.get("vocab_size")
    want = {f"{family.decoder}.embed_tokens.weight": (vocab, hidden),
            f"{family.decoder}.{family.final_norm}.weight": (hidden,),
            f"{family.blocks}.0.input_layernorm.weight": (hidden,)}
    inter = config.get("intermediate_size")
    if family.moe is None and inter is not None:
        want[f"{family.blocks}.0.mlp.down_proj.weight"] = (hidden, inter)
        want[f"{family.blocks}.0.mlp.up_proj.weight"] = (inter, hidden)
    for name, shape in want.items():
        if None in shape or name not in shapes or tuple(shapes[name]) == shape:
            continue
        out.append(f"{name} is stored as {list(shapes[name])} but the config's sizes make it "
                   f"{list(shape)}; restore config.json from the FP16 folder or re-export")
    return out


def _block_problems(config: dict, shapes: Mapping[str, tuple[int, ...]],
                    family: Family) -> list[str]:
    n_layers = config.get("num_hidden_layers")
    if n_layers is None:
        return []
    pattern = re.compile(rf"{re.escape(family.blocks)}\.(\d+)\.")
    stored = {int(m.group(1)) for m in map(pattern.match, shapes) if m is not None}
    if not stored or stored == set(range(n_layers)):
        return []
    return [f"num_hidden_layers is {n_layers} but the checkpoint stores {len(stored)} blocks "
            f"({min(stored)}..{max(stored)}); restore config.json from the FP16 folder or "
            "re-export"]


def check_folder_config(folder: str | Path) -> None:
    """ValueError listing :func:`config_problems` of a model folder (config.json and its
    safetensors files' headers; no tensor data is read). A folder without safetensors files,
    or with an unreadable one, is left to the loader, which says what is wrong with it."""
    folder = Path(folder)
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable ({exc}); restore it or re-export") from exc
    shapes: dict[str, tuple[int, ...]] = {}
    for fname in safetensors_files(folder):
        try:
            with safe_open(str(folder / fname), framework="pt") as f:
                shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        except Exception:  # safetensors' own error types for a missing file or corrupt header
            return  # partial shapes would misreport the blocks; the loader names the file
    problems = config_problems(config if isinstance(config, dict) else {}, shapes)
    if problems:
        raise ValueError(f"{path}: " + "; ".join(problems))

"""CALIB_DIR: the calibration artifact, written block by block and read by `export`.

While it runs, `calibrate` writes into the hidden work folder ``.CALIB_DIR.work`` beside
CALIB_DIR (:func:`work_dir`), which holds the resume state, and renames it to CALIB_DIR when
it is complete (an existing CALIB_DIR is replaced only then). Layout::

    CALIB_DIR/
      quantpipe-work.json           marks the work folder as quantpipe's (removed at the end)
      progress.json                 settings + finished blocks (while running)
      state/hidden.safetensors      inputs of the next block, named in its metadata: the
                                    resume point (while running; deleted at the end)
      state/hidden-N.f32 + input_ids.safetensors   the same when the activations exceed
                                    --max-memory: raw fp32 [samples, seq_len, hidden] files
                                    (quantpipe.blocks.activations; GPTAQ adds hidden_fp-N.f32)
      blocks/block-0000.safetensors per linear P and tag T (w4, w8, menu entries such as
                                    w4g32; calibration.menu):
                                      P.T.qweight int32 [out, in*bits/32], P.T.scales fp16
                                      [out, G], P.T.qzeros uint8 [out, G], P.T.g_idx int32
                                      [in] (act-order only); fp.NAME: FP tensors that
                                      calibration changed (AWQ-scaled norms and linears)
      blocks/block-0000.json        per-layer specs and losses, fallbacks, timings
      quantpipe.json                manifest (stage "calibration"), written last

One calibration holds both the INT4 and the INT8 result of every linear (and every entry of
``--menu``), so `export --bits 4`, `--bits 8` and mixed plans never read the prompts again.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from quantpipe.calibration.menu import Entry, tag_of
from quantpipe.calibration.result import QuantResult
from quantpipe.core.io import LazyTensors, read_manifest, save_safetensors_atomic, write_json_atomic
from quantpipe.core.qformat import LazyWeights, QuantizedWeight, QuantSpec, pack_int32, unpack_int32


def work_dir(calib_dir: str | Path) -> Path:
    """The hidden folder beside CALIB_DIR where `calibrate` builds (and resumes) it."""
    out = Path(os.path.abspath(calib_dir))
    return out.parent / f".{out.name}.work"


# the file that marks a work folder as quantpipe's own: only such a folder is ever removed
# or resumed (a folder of that name made by someone else is refused, never deleted)
WORK_MARKER = "quantpipe-work.json"


def check_work_dir(work: Path, calib_dir: str | Path) -> None:
    """Refuse a file, link or unmarked folder at the path of CALIB_DIR's work folder."""
    if work.is_symlink() or (work.exists() and not (work / WORK_MARKER).is_file()):
        raise ValueError(
            f"{work}: in the way of the work folder of --out {calib_dir}, and not one that "
            "quantpipe calibrate made (no quantpipe-work.json), so it is left untouched; move "
            "or rename it, or choose another --out"
        )


def block_file(calib_dir: Path, index: int, ext: str) -> Path:
    return Path(calib_dir) / "blocks" / f"block-{index:04d}.{ext}"


def save_block(
    calib_dir: Path,
    index: int,
    results: dict[str, dict[str, QuantResult]],
    fp_tensors: dict[str, torch.Tensor],
    info: dict,
) -> None:
    """Write one block's results (tensors first, then the JSON that marks it complete)."""
    tensors: dict[str, torch.Tensor] = {}
    layers: dict[str, dict] = {}
    for name, by_tag in results.items():
        layers[name] = {}
        for tag, res in by_tag.items():
            w = res.weight
            tensors[f"{name}.{tag}.qweight"] = pack_int32(w.q, w.spec.bits)  # [out, in*b/32]
            tensors[f"{name}.{tag}.scales"] = w.scales  # [out, G] fp16
            tensors[f"{name}.{tag}.qzeros"] = w.zeros  # [out, G] uint8
            if w.g_idx is not None:
                tensors[f"{name}.{tag}.g_idx"] = w.g_idx  # [in] int32
            layers[name][tag] = {
                "spec": w.spec.to_dict(),
                "shape": list(w.shape),
                "loss": res.loss,
                "damp": res.damp,
                "damp_raises": res.damp_raises,
            }
    for k, v in fp_tensors.items():
        tensors[f"fp.{k}"] = v
    (Path(calib_dir) / "blocks").mkdir(parents=True, exist_ok=True)
    save_safetensors_atomic(tensors, block_file(calib_dir, index, "safetensors"))
    write_json_atomic(block_file(calib_dir, index, "json"), {"layers": layers, **info})


@dataclass
class Calibration:
    """A finished calibration, read lazily block by block."""

    folder: Path
    manifest: dict

    @property
    def fp16_dir(self) -> Path:
        return Path(self.manifest["fp16_dir"])

    @property
    def num_blocks(self) -> int:
        return int(self.manifest["num_blocks"])

    def block_info(self, index: int) -> dict:
        return json.loads(block_file(self.folder, index, "json").read_text())

    def layer_infos(self) -> dict[str, dict]:
        """Every calibrated linear -> {"w4": {...}, "w8": {...}, menu tag: {...}} (specs,
        losses)."""
        out: dict[str, dict] = {}
        for i in range(self.num_blocks):
            out.update(self.block_info(i)["layers"])
        return out

    def weights(self, choice: dict[str, Entry]) -> LazyWeights:
        """The quantized weights for ``choice`` (linear name -> entry key: 4, 8 or a menu
        tag; calibration.menu), each read from its block file when it is used: an export
        holds one layer, not the model."""
        infos = self.layer_infos()
        unknown = set(choice) - set(infos)
        if unknown:
            raise ValueError(f"layers not in this calibration: {sorted(unknown)[:5]}")
        missing = [n for n, e in choice.items() if tag_of(e) not in infos[n]]
        if missing:
            raise ValueError(f"{missing[0]} has no {tag_of(choice[missing[0]])} result in this "
                             "calibration (calibrate --menu computes extra entries); re-plan "
                             "from this calibration")
        block_of = {n: i for i in range(self.num_blocks) for n in self.block_info(i)["layers"]}
        names = [n for n in infos if n in choice]  # model order
        specs = {n: QuantSpec.from_dict(infos[n][tag_of(choice[n])]["spec"]) for n in names}
        shapes = {n: tuple(infos[n][tag_of(choice[n])]["shape"]) for n in names}

        def load(name: str) -> QuantizedWeight:
            tag, spec = tag_of(choice[name]), specs[name]
            path = block_file(self.folder, block_of[name], "safetensors")
            with safe_open(str(path), framework="pt") as f:
                g_key = f"{name}.{tag}.g_idx"
                return QuantizedWeight(
                    spec, unpack_int32(f.get_tensor(f"{name}.{tag}.qweight"), spec.bits),
                    f.get_tensor(f"{name}.{tag}.scales"), f.get_tensor(f"{name}.{tag}.qzeros"),
                    f.get_tensor(g_key) if g_key in f.keys() else None,
                )

        return LazyWeights(specs, shapes, load)

    def fp_tensors(self) -> LazyTensors:
        """FP tensors that calibration changed (AWQ folding), by their model name; each read
        from its block file on access."""
        where: dict[str, str] = {}
        for i in range(self.num_blocks):
            path = block_file(self.folder, i, "safetensors")
            with safe_open(str(path), framework="pt") as f:
                where.update({k: path.name for k in f.keys() if k.startswith("fp.")})
        return LazyTensors(self.folder / "blocks", where, prefix="fp.")


def read_calibration(folder: str | Path) -> Calibration:
    folder = Path(folder)
    unfinished = (folder / "progress.json").is_file() or (
        work_dir(folder) / "progress.json").is_file()
    if unfinished and not (folder / "quantpipe.json").is_file():
        raise ValueError(
            f"{folder} holds an unfinished calibration; re-run the same `quantpipe calibrate` "
            "command to resume it"
        )
    return Calibration(folder, read_manifest(folder, "calibration"))

"""Why a mixed-precision plan does or does not carry over to other text: whole-model KLDs of
layer groups and of whole plans, on the sensitivity's held-out prompt split and (diagnosis
only, never to choose a method) on the unrelated sotu corpus.

For a CALIB_DIR with a sensitivity.json (bench/mixed_precision.py), every model scored here is
the FP model with some linears replaced by their dequantized calibrated weights (exactly what
`export` writes); the KLD is the mean over tokens of KL(P_fp || P_cand) on

- ``calib-val``: the sensitivity's held-out split of the business-calib prompts (the same
  packed ids the validation scored: same tokens, seq-len and seed as the measurement);
- ``sotu``: the first ``--sotu-docs`` State of the Union windows of bench/corpora.py.

Scored configurations:
- ``group:TYPE`` (q_proj, ..., down_proj) and ``group:blocks A-B``: only those linears INT4
  (INT8 with ``--group-bits 8``, suffixed ``@int8``), everything else FP: where the damage
  sits, per corpus (the per-layer measurement predicts a group as the sum of its layers');
- ``all-int4`` (``all-int8``); ``int8:TYPE+TYPE`` (``--type-plans``): all INT4 but those
  types INT8; ``plan:NAME``: the plans of an existing mixed_precision JSON (``--plans``);
- ``template`` split: all-INT4's KLD on calib-val tokens that predict the constant chat
  template (system prompt, role markers) vs the prompts' own tokens.

    python bench/mixed_precision_diag.py --calib CALIB_DIR --corpora calib-val,sotu \
        --plans bench/results/mixed_precision_sym64.json --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch
from corpora import sotu_texts  # bench/corpora.py (the script's folder)

from quantpipe.calibration.artifact import read_calibration
from quantpipe.calibration.mixed_precision.sensitivity import (
    SensitivitySpec,
    _calibration_ids,
    _load_model,
)
from quantpipe.core.io import write_json_atomic
from quantpipe.core.metrics import token_kld

TYPES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def corpus_ids(name: str, calib, sens_settings: dict, tok, sotu_docs: int) -> torch.Tensor:
    """Token ids [n, L] of one diagnostic corpus (see the module docstring)."""
    if name == "calib-val":
        val = sens_settings["validation"]
        spec = SensitivitySpec(calib.folder, sens_settings["tokens"], sens_settings["seq_len"],
                               seed=sens_settings["seed"], validate_tokens=val["tokens"])
        return _calibration_ids(calib.fp16_dir, spec, "validate")
    if name == "sotu":
        rows = [tok(t, add_special_tokens=False)["input_ids"][:512]
                for t in sotu_texts(tok)[:sotu_docs]]
        return torch.tensor(rows, dtype=torch.long)
    raise ValueError(f"corpus {name!r}: use calib-val or sotu")


def template_mask(ids: torch.Tensor, tok) -> torch.Tensor:
    """[n, L] bool: positions whose next token belongs to the chat template's constant text
    (the default system prompt and the role headers), found by matching its token runs."""
    texts = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
             "Hugging Face<|im_end|>\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    runs = [tok(text, add_special_tokens=False)["input_ids"] for text in texts]
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for r, row in enumerate(ids.tolist()):
        for run in runs:
            k = len(run)
            for s in range(len(row) - k + 1):
                if row[s : s + k] == run:
                    # position p predicts token p+1: targets s..s+k-1 are predicted at s-1..s+k-2
                    mask[r, max(s - 1, 0) : s + k - 1] = True
    return mask


class Bench:
    """FP model with swappable linears; per-token KLD of a configuration on cached refs."""

    def __init__(self, calib, ids: dict[str, torch.Tensor], batch: int = 4):
        self.calib, self.ids, self.batch = calib, ids, batch
        self.model = _load_model(calib)
        names = list(calib.layer_infos())
        self.orig = {n: self.model.get_submodule(n).weight.data for n in names}
        self.deq = {4: {}, 8: {}}
        for b in (4, 8):
            for n, w in calib.weights(dict.fromkeys(names, b)).items():
                self.deq[b][n] = w.dequantize(torch.float32)
        self.ref = {c: self._logits(x) for c, x in ids.items()}

    @torch.no_grad()
    def _logits(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [self.model(x[s : s + self.batch]).logits.reshape(-1, self.model.config.vocab_size)
                for s in range(0, x.shape[0], self.batch)]

    @torch.no_grad()
    def token_kld(self, corpus: str, state: dict[str, int | None]) -> torch.Tensor:
        """[tokens] KLD of the model with ``state`` (layer -> 4, 8; absent or None: FP)."""
        for n, b in state.items():
            if b is not None:
                self.model.get_submodule(n).weight.data = self.deq[b][n]
        try:
            cand = self._logits(self.ids[corpus])
        finally:
            for n in state:
                self.model.get_submodule(n).weight.data = self.orig[n]
        return torch.cat([token_kld(r, c) for r, c in zip(self.ref[corpus], cand)])


def groups(names: list[str], n_blocks: int, width: int) -> dict[str, list[str]]:
    """Linears by type, then (``width`` > 0) by runs of ``width`` blocks."""
    out = {f"group:{t}": [n for n in names if n.endswith(t)] for t in TYPES}
    for lo in range(0, n_blocks, width) if width > 0 else ():
        hi = min(lo + width, n_blocks) - 1
        out[f"group:blocks {lo}-{hi}"] = [
            n for n in names if lo <= int(re.search(r"\.(\d+)\.", n).group(1)) <= hi]
    return {k: v for k, v in out.items() if v}


def _settings(calib_dir: Path, args) -> tuple[dict, dict]:
    """(the sensitivity's settings, its per-layer entries); without a sensitivity.json the
    defaults of bench/mixed_precision.py (``--sens-tokens``, ``--sens-seq-len``) and no
    per-layer predictions."""
    path = calib_dir / "sensitivity.json"
    if path.is_file():
        sens = json.loads(path.read_text())
        return sens["settings"], sens["layers"]
    return {"tokens": args.sens_tokens, "seq_len": args.sens_seq_len, "seed": 1,
            "validation": {"tokens": args.sens_validate_tokens}}, {}


def _predicted(layers: dict, state: dict[str, int | None]) -> float | None:
    if not layers:
        return None
    return sum(layers[n]["kld_w4"] if b == 4 else layers[n]["kld_w8"] if b == 8 else 0.0
               for n, b in state.items())


def configurations(calib, args) -> dict[str, dict[str, int | None]]:
    """Every scored model as layer -> precision (see the module docstring)."""
    names = list(calib.layer_infos())
    b = args.group_bits
    configs: dict[str, dict[str, int | None]] = {f"all-int{b}": dict.fromkeys(names, b)}
    for spec in args.type_plans.split(",") if args.type_plans else []:
        state = dict.fromkeys(names, 4)
        state.update({n: 8 for n in names if any(n.endswith(t) for t in spec.split("+"))})
        configs[f"int8:{spec}"] = state
    if not args.no_groups:
        for g, members in groups(names, calib.num_blocks, args.block_width).items():
            configs[g if b == 4 else f"{g}@int{b}"] = dict.fromkeys(members, b)
    if args.plans:
        for name, r in json.loads(args.plans.read_text())["results"].items():
            state = dict.fromkeys(names, 4)
            state.update({n: (None if b is None else int(b))
                          for n, b in r["plan_layers"].items()})
            configs[f"plan:{name}"] = state
    return configs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calib", type=Path, required=True)
    ap.add_argument("--corpora", default="calib-val")
    ap.add_argument("--sotu-docs", type=int, default=4)
    ap.add_argument("--plans", type=Path, help="A mixed_precision JSON: score its plans too.")
    ap.add_argument("--type-plans", default="",
                    help="Comma list of TYPE+TYPE: all INT4 but those types INT8.")
    ap.add_argument("--block-width", type=int, default=0,
                    help="Also score runs of this many blocks (0: types only).")
    ap.add_argument("--no-groups", action="store_true")
    ap.add_argument("--group-bits", type=int, choices=(4, 8), default=4,
                    help="Precision of the groups and of the all-layers baseline.")
    ap.add_argument("--sens-tokens", type=int, default=256,
                    help="Without sensitivity.json: the split's settings (as measured).")
    ap.add_argument("--sens-seq-len", type=int, default=128)
    ap.add_argument("--sens-validate-tokens", type=int, default=1024)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    t0 = time.time()
    from transformers import AutoTokenizer

    calib = read_calibration(args.calib)
    settings, layers = _settings(args.calib, args)
    tok = AutoTokenizer.from_pretrained(calib.fp16_dir, trust_remote_code=False)
    corpora = args.corpora.split(",")
    ids = {c: corpus_ids(c, calib, settings, tok, args.sotu_docs) for c in corpora}
    configs = configurations(calib, args)
    bench = Bench(calib, ids)
    predicted = {k: _predicted(layers, v) for k, v in configs.items()}
    out: dict = {"calib": str(args.calib), "corpora": {c: int(x.numel()) for c, x in ids.items()},
                 "sensitivity_settings": settings, "predicted": predicted,
                 "kld": {c: {} for c in corpora}}
    for name, state in configs.items():  # each model on every corpus, most telling first
        for c in corpora:
            kld = bench.token_kld(c, state)
            out["kld"][c][name] = float(kld.double().mean())
            if name == "all-int4" and c == "calib-val":
                out["template_split"] = _template_split(kld, template_mask(ids[c], tok))
            print(f"{c:10s} {name:28s} KLD {out['kld'][c][name]:.5f}", flush=True)
            out["seconds"] = time.time() - t0
            write_json_atomic(args.json, out)  # after every score: partial results survive
    print(json.dumps(out.get("template_split"), indent=1))


def _template_split(kld: torch.Tensor, mask: torch.Tensor) -> dict:
    mask = mask.reshape(-1)
    k = kld.double()
    return {"template_tokens": int(mask.sum()), "other_tokens": int((~mask).sum()),
            "kld_template": float(k[mask].mean()) if mask.any() else None,
            "kld_other": float(k[~mask].mean()),
            "share_of_total_kld_on_template": float(k[mask].sum() / k.sum())}


if __name__ == "__main__":
    main()

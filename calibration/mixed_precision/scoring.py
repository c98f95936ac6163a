"""What both sensitivity measurements score with: the KLD of final hidden states against the
FP reference (through the final norm and LM head, in row chunks), and the proxies stored beside
it (a linear's output energy, its calibration loss relative to that energy)."""

from __future__ import annotations

import torch

from quantpipe.core.metrics import mean_kld, token_kld


def head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """Final norm + LM head: hidden [T, d] -> logits [T, V] fp32."""
    logits = model.lm_head(model.model.norm(hidden)).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:  # Gemma-2 squashes logits with cap * tanh(logits / cap)
        logits = cap * torch.tanh(logits / cap)
    return logits


class Scorer:
    """Mean KLD of a final hidden state against the cached FP reference, chunked by rows.

    ``head``: final hidden [T, d] -> logits [T, V] fp32 (final norm, LM head, soft-cap)."""

    def __init__(self, head, final_fp: torch.Tensor, chunk_rows: int):
        self.head, self.chunk = head, chunk_rows
        h = final_fp.reshape(-1, final_fp.shape[-1])  # [n, L, d] -> [T, d]
        self.logits_ref = [head(h[s : s + chunk_rows])
                           for s in range(0, h.shape[0], chunk_rows)]  # chunks of [rows, V]
        # softmax in float64 then stored in float32: exact to float32 rounding
        self.p_ref = [torch.softmax(z.double(), dim=-1).float() for z in self.logits_ref]
        self.tokens = h.shape[0]

    @torch.no_grad()
    def mean_kld(self, final: torch.Tensor) -> float:
        h = final.reshape(-1, final.shape[-1])  # [T, d]
        per_chunk = []  # [rows] fp32 per chunk
        for k, s in enumerate(range(0, h.shape[0], self.chunk)):
            logits = self.head(h[s : s + self.chunk])  # [rows, V] fp32
            per_chunk.append(token_kld(self.logits_ref[k], logits, self.p_ref[k]))
        return mean_kld(per_chunk)


def output_energy_hooks(block, names: dict[str, str], energy: dict[str, tuple[float, int]]):
    """Forward hooks adding sum_t ||y_t||^2 and the token count of each linear.

    names: name inside the block -> full model name (the key of ``energy``).
    """

    def make(name):
        def hook(_m, _args, out):
            y = out.detach().reshape(-1, out.shape[-1]).double()  # [tokens, out]
            e, t = energy.get(name, (0.0, 0))
            energy[name] = (e + float(y.pow(2).sum()), t + y.shape[0])

        return hook

    return [block.get_submodule(short).register_forward_hook(make(full))
            for short, full in names.items()]


def proxies(info: dict, energy: tuple[float, int]) -> dict:
    e_sum, tokens = energy
    # tr(W H W^T) with H = 2 X^T X / tokens (calibration's convention) = 2 mean_t ||W x_t||^2
    out_energy = 2.0 * e_sum / max(tokens, 1)
    entry = {"out_energy": out_energy}
    for tag in ("w4", "w8"):
        loss = float(info[tag]["loss"])
        entry[f"proxy_{tag}"] = loss
        entry[f"proxy_norm_{tag}"] = loss / out_energy if out_energy > 0 else float("inf")
    return entry

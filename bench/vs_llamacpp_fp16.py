"""quantpipe's FP16 export of a GGUF source vs llama.cpp running that GGUF file: greedy agreement
and next-token KL divergence, in one run.

    python bench/vs_llamacpp_fp16.py gemma-3-270m --fp16 /tmp/qp-real/gemma-3-270m/fp16 \
        --venv /path/to/llamacpp-venv    # writes bench/results/vs_llamacpp_fp16_<source>.json

Why: ``export-fp16`` of a GGUF source is transformers' dequantization of the file (the FP16
reference every other stage is measured against). If that dequantization, the tokenizer or the
architecture mapping were wrong, every KLD downstream would be measured against the wrong model.
llama.cpp reads the same file with its own code, so the two agreeing is the check.

For the first ``--prompts`` held-out prompts (business-eval, rendered with the chat template
when the tokenizer has one, tokenized once by the FP16 export's tokenizer; both systems get the
same token ids):

- greedy continuations of ``--tokens`` tokens from each system (EOS ignored), compared token for
  token; for a prompt that differs, the first differing position and, at that position (same
  prefix in both), each system's top-2 tokens and logit margin: a near tie in either explains a
  flip by rounding (llama.cpp multiplies quantized weights by activations rounded to 8 bits; the
  FP16 export multiplies dequantized weights by fp32 activations);
- teacher-forced on the FP16 side's continuation, the KL divergence KL(P_fp16 || P_llama.cpp) of
  every next-token distribution (the prompt's last position and each continuation position but
  the last) and the top-1 agreement there.

The FP16 side runs in fp32 (transformers, in this process); llama.cpp (llama-cpp-python built
for this CPU, ``--venv``; bench/vs_llamacpp.py builds one) in a worker process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

# the llama.cpp worker runs this file in llama-cpp-python's venv, which has numpy but no torch
try:
    import torch
except ImportError:
    torch = None

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_llamacpp import DEFAULT_VENV, Worker, ensure_llama_venv, lscpu  # noqa: E402

# --- the llama.cpp worker: JSON lines on stdin/stdout ---------------------------------------------


KV_TYPES = {"f16": 1, "f32": 0}  # ggml_type of llama.cpp's KV cache (GGML_TYPE_F16 / _F32)


def llama_worker(gguf: str, threads: int, kv: str) -> None:
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=2048, n_batch=512, n_threads=threads,
                n_threads_batch=threads, logits_all=True, verbose=False,
                type_k=KV_TYPES[kv], type_v=KV_TYPES[kv])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "greedy":
            llm.reset()
            out = []
            for tok in llm.generate(cmd["ids"], top_k=1, temp=0.0, reset=True):
                out.append(int(tok))
                if len(out) == cmd["n"]:
                    break
            print(json.dumps({"ids": out}), flush=True)
        else:  # "logits": the logits of positions start.. of one forward over ids
            llm.reset()
            llm.eval(cmd["ids"])
            scores = np.asarray(llm.scores[cmd.get("start", 0): len(cmd["ids"])],
                                dtype=np.float32)
            path = cmd["out"]
            np.save(path, scores)
            print(json.dumps({"path": path}), flush=True)


class LlamaCpp(Worker):
    """The llama.cpp worker process (bench/vs_llamacpp.py's JSON-lines worker protocol)."""

    def __init__(self, python: Path, gguf: Path, threads: int, kv: str = "f16") -> None:
        super().__init__("llama.cpp", [str(python), __file__, "--worker", str(gguf),
                                       "--threads", str(threads), "--llama-kv", kv],
                         dict(os.environ))

    def _ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def greedy(self, ids: list[int], n: int) -> list[int]:
        return self._ask({"op": "greedy", "ids": ids, "n": n})["ids"]

    def logits(self, ids: list[int], tmp: Path, start: int = 0) -> torch.Tensor:
        """[len(ids) - start, n_vocab] fp32: positions start.. (a long prompt's every position
        times a 262k vocabulary would be a file of gigabytes)."""
        path = self._ask({"op": "logits", "ids": ids, "out": str(tmp), "start": start})["path"]
        return torch.from_numpy(np.load(path))



# --- the FP16 side ----------------------------------------------------------------------------


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    new: list[int] = []
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            new.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([new[-1:]]), past_key_values=out.past_key_values,
                        use_cache=True)
    return new


def hf_logits(model, ids: list[int], keep: int = 0) -> torch.Tensor:
    """[keep, vocab] fp32: the last ``keep`` positions' logits (0: every position)."""
    with torch.no_grad():
        return model(torch.tensor([ids]), logits_to_keep=keep).logits[0].float()


def top2(logits: torch.Tensor) -> dict:
    v, i = logits.float().topk(2)
    return {"top": [int(i[0]), int(i[1])], "margin": round(float(v[0] - v[1]), 4)}


def compare_prompt(model, llama: LlamaCpp, ids: list[int], n: int, tmp: Path,
                   tok) -> dict:
    ours, theirs = hf_greedy(model, ids, n), llama.greedy(ids, n)
    rec: dict = {"prompt_tokens": len(ids), "identical": ours == theirs,
                 "fp16": tok.decode(ours), "llama_cpp": tok.decode(theirs)}
    # teacher-forced on the FP16 side's continuation: positions len(ids)-1 .. len(ids)+n-2
    full = ids + ours
    p_log = torch.log_softmax(hf_logits(model, full, keep=n + 1)[:-1].double(), -1)
    q_all = llama.logits(full, tmp, start=len(ids) - 1)[:-1].double()
    vocab = min(p_log.shape[-1], q_all.shape[-1])  # a padded HF vocab has no extra real tokens
    p_log, q_log = p_log[:, :vocab], torch.log_softmax(q_all[:, :vocab], -1)
    kld = (p_log.exp() * (p_log - q_log)).sum(-1)  # [n] KL(P_fp16 || P_llama)
    rec["kld_mean"] = float(kld.mean())
    rec["kld_max"] = float(kld.max())
    rec["top1_agree"] = float((p_log.argmax(-1) == q_log.argmax(-1)).double().mean())
    if not rec["identical"]:
        k = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        prefix = ids + ours[:k]  # the same prefix in both systems up to position k
        rec["first_difference"] = {
            "position": k,
            "fp16": top2(hf_logits(model, prefix, keep=1)[-1]),
            "llama_cpp": top2(llama.logits(prefix, tmp, start=len(prefix) - 1)[-1]),
        }
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", nargs="?", help="packaged source name or a .gguf path")
    ap.add_argument("--fp16", type=Path, help="quantpipe export-fp16 folder of SOURCE")
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV,
                    help="llama-cpp-python venv (built here when missing)")
    ap.add_argument("--llama-gguf", type=Path, default=None,
                    help="run llama.cpp on this GGUF instead of SOURCE's file: an F32 GGUF written "
                         "from --fp16 by llama.cpp's convert_hf_to_gguf.py --outtype f32 takes "
                         "llama.cpp's weight formats and 8-bit activations out of the comparison")
    ap.add_argument("--llama-kv", choices=sorted(KV_TYPES), default="f16",
                    help="llama.cpp's KV cache type (its default f16; f32 as the FP16 side's)")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return llama_worker(args.worker, args.threads, args.llama_kv)
    if not args.source or args.fp16 is None:
        ap.error("give SOURCE and --fp16 FOLDER")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantpipe.core.sources import resolve_source
    from quantpipe.prompts.sets import load_prompt_records, render_eval_texts

    src = resolve_source(args.source)
    if src.kind != "gguf":
        ap.error(f"{args.source} is not a GGUF source ({src.path})")
    gguf = src.path
    if args.llama_gguf is not None:
        if not args.llama_gguf.is_file():
            ap.error(f"--llama-gguf {args.llama_gguf}: no such file")
        gguf = args.llama_gguf
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.fp16, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(args.fp16, dtype=torch.float32,
                                                 trust_remote_code=False).eval()
    records = load_prompt_records("business-eval")[: args.prompts]
    texts = render_eval_texts(tok, records)
    llama = LlamaCpp(ensure_llama_venv(args.venv), gguf, args.threads, args.llama_kv)
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"qp-llama-logits-{os.getpid()}.npy"
    results = []
    try:
        for rec, text in zip(records, texts):
            ids = tok(text, add_special_tokens=not getattr(tok, "chat_template", None)).input_ids
            r = {"id": rec.id, "category": rec.category, "lang": rec.lang,
                 **compare_prompt(model, llama, ids, args.tokens, tmp, tok)}
            results.append(r)
            print(f"{rec.id:<28} identical={r['identical']!s:<5} KLD {r['kld_mean']:.5f} "
                  f"top1 {r['top1_agree']:.3f}"
                  + (f"  first diff at {r['first_difference']['position']}: fp16 margin "
                     f"{r['first_difference']['fp16']['margin']}, llama.cpp margin "
                     f"{r['first_difference']['llama_cpp']['margin']}"
                     if not r["identical"] else ""), flush=True)
    finally:
        llama.close()
        tmp.unlink(missing_ok=True)
    same = sum(r["identical"] for r in results)
    summary = {"identical": same, "prompts": len(results),
               "kld_mean": float(np.mean([r["kld_mean"] for r in results])),
               "top1_agree": float(np.mean([r["top1_agree"] for r in results]))}
    print(f"{args.source}: identical greedy {same}/{len(results)}, mean KLD "
          f"{summary['kld_mean']:.5f}, top-1 agreement {summary['top1_agree']:.4f}")
    import importlib.metadata as md
    doc = {"source": args.source, "gguf": str(gguf), "gguf_is_source": gguf == src.path,
           "llama_kv": args.llama_kv, "fp16": str(args.fp16),
           "tokens": args.tokens, "cpu": lscpu(), "torch": torch.__version__,
           "transformers": md.version("transformers"), "summary": summary, "prompts": results}
    out = args.json or ROOT / "bench" / "results" / \
        f"vs_llamacpp_fp16_{args.source.replace('/', '_')}" \
        f"{'' if gguf == src.path else '_' + Path(gguf).stem}" \
        f"{'' if args.llama_kv == 'f16' else '_kv-' + args.llama_kv}.json"
    from quantpipe.core.io import write_json_atomic
    write_json_atomic(out, doc)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

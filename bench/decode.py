"""Greedy decode tokens/s side by side: HF FP16 / FP32, dequantized, the INT4 / INT8 runtime.

Rows (same prompts, same number of new tokens, one process, one after the other):
- ``hf_fp16`` / ``hf_fp32``: the Hugging Face model's own forward with a ``DynamicCache``;
- ``dequant_int4`` / ``dequant_int8``: the checkpoint dequantized into an HF fp32 model (the
  numerical reference of the runtime);
- ``engine_fp``: the FP model (fp32 on CPU) through quantpipe's engine (our decoder loop, paged
  KV) with the same fp16 head as the runtime rows, so the gain of the engine alone is visible;
- ``runtime_int4`` / ``runtime_int8``: what ``quantpipe generate`` runs: the engine, QuantLinear
  kernels and the fp16 output head (``--head-dtype``).

Also reports greedy agreement: first --tokens tokens of the INT4 (and INT8) runtime vs the
dequantized reference model of the same checkpoint, per prompt.

    python bench/decode.py --quick                    # CPU, SmolLM2 at /tmp/qp/fp16, RTN ckpts
    python bench/decode.py --device cuda --int4 QDIR   # an existing quantized folder

Without --int4/--int8 the FP16 folder is RTN-quantized here (INT4 g64 sym / INT8 per-channel;
a stand-in for calibrated checkpoints). Not a test: prints a table, writes bench/results/.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quantpipe.core.formats.loader import load_dequantized_model  # noqa: E402
from quantpipe.core.qformat import QuantSpec  # noqa: E402
from quantpipe.runtime.engine import load_model_for_serving  # noqa: E402
from quantpipe.runtime.generate import engine_decode, greedy_decode  # noqa: E402

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that returns the factorial of n.",
    "What are three good habits for staying healthy?",
    "Summarise the plot of Romeo and Juliet.",
    "Translate 'good morning, how are you?' into French.",
    "List the planets of the solar system in order.",
    "Give me a recipe for a simple tomato soup.",
    "What is the difference between a list and a tuple in Python?",
]


def rtn_quantize(fp16_dir: Path, out: Path, spec: QuantSpec) -> Path:
    from transformers import AutoModelForCausalLM

    from quantpipe.calibration.grid import quantize_to_grid, scale_zero_from_range
    from quantpipe.core.formats.writers import write_checkpoint
    from quantpipe.core.qformat import QuantizedWeight, resolve_group_size

    model = AutoModelForCausalLM.from_pretrained(fp16_dir, dtype=torch.float32,
                                                 trust_remote_code=False)
    weights = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or name == "lm_head":
            continue
        w = mod.weight.data.float()
        out_f, in_f = w.shape
        s = spec.with_group_size(resolve_group_size(spec.group_size, in_f))
        gs = s.group_size_for(in_f)
        wg = w.reshape(out_f, in_f // gs, gs)  # [out, G, gs]
        scale, zero = scale_zero_from_range(wg.amin(-1), wg.amax(-1), s)  # [out, G]
        q = quantize_to_grid(wg, scale[..., None], zero[..., None], s.maxq)
        weights[name] = QuantizedWeight(s, q.reshape(out_f, in_f).to(torch.uint8), scale.half(),
                                        zero.to(torch.uint8))
    write_checkpoint("native", out, fp16_dir, weights, force=True)
    return out


def random_smollm2_shaped(out: Path) -> Path:
    """A random-weight Llama with SmolLM2-135M's shapes (for machines without the export)."""
    from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16
    from tests.tiny_models import make_model, save_model

    model, tok = make_model("llama", hidden_size=576, intermediate_size=1536,
                            num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                            max_position_embeddings=2048)
    save_model(model, tok, out / "src")
    export_fp16(Fp16ExportSpec(str(out / "src"), out / "fp16"))
    return out / "fp16"


def chat_ids(tok, prompt: str) -> list[int]:
    return list(tok.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, return_dict=False))


def hf_decode(model, tok, ids: list[int], tokens: int):
    return greedy_decode(model, torch.tensor([ids]), tokens, set())  # no early EOS


def our_decode(model, tok, ids: list[int], tokens: int):
    return engine_decode(model, tok, ids, tokens, stop_at_eos=False)


def run_model(model, tok, decode, prompts: list[str], tokens: int) -> dict:
    outs, prefill, decode_s, decode_n = [], 0.0, 0.0, 0
    decode(model, tok, chat_ids(tok, prompts[0]), 4)  # warm-up (autotune, allocs)
    for p in prompts:
        new, pf, dc = decode(model, tok, chat_ids(tok, p), tokens)
        outs.append(new)
        prefill += pf
        decode_s += dc
        decode_n += len(new) - 1
    return {"tokens": outs, "prefill_s": prefill / len(prompts),
            "decode_tokens_per_s": decode_n / decode_s}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    first_diff = []
    for x, y in zip(a, b):
        d = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
        first_diff.append(d)
    return {"prompts_equal": sum(d is None for d in first_diff), "prompts": len(a),
            "first_divergence": first_diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fp16", type=Path, default=Path("/tmp/qp/fp16"))
    ap.add_argument("--int4", type=Path, help="quantized INT4 folder (default: RTN g64 sym)")
    ap.add_argument("--int8", type=Path, help="quantized INT8 folder (default: RTN per-channel)")
    ap.add_argument("--random-model", action="store_true",
                    help="random weights with SmolLM2-135M shapes instead of --fp16 (timing only)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave default)")
    ap.add_argument("--quick", action="store_true", help="3 prompts, skip the INT8 model")
    ap.add_argument("--head-dtype", default="fp16", choices=["fp32", "fp16", "bf16", "auto"],
                    help="output head of the engine rows on CPU (runtime.fp_head)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="qp-bench-"))
    try:
        run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # RTN checkpoints / random model made here


def run(args: argparse.Namespace, tmp: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = torch.device(args.device)
    prompts = PROMPTS[: 3 if args.quick else args.prompts]
    if args.random_model:
        args.fp16 = random_smollm2_shaped(tmp)
    elif not (args.fp16 / "config.json").is_file():
        raise SystemExit(f"{args.fp16} is not a model folder; pass --fp16 DIR or --random-model")
    int4 = args.int4 or rtn_quantize(args.fp16, tmp / "int4", QuantSpec(4, 64, True))
    int8 = None if args.quick else (
        args.int8 or rtn_quantize(args.fp16, tmp / "int8", QuantSpec(8, -1, True)))
    tok = AutoTokenizer.from_pretrained(args.fp16, trust_remote_code=False)
    fp_dtype = torch.float32 if dev.type == "cpu" else torch.float16
    head = args.head_dtype if dev.type == "cpu" else "fp32"

    def ours(folder):
        return lambda: load_model_for_serving(folder, args.device, head_dtype=head)[0]

    # name -> (build the model, decode function)
    builders = {
        "hf_fp16": (lambda: AutoModelForCausalLM.from_pretrained(
            args.fp16, dtype=torch.float16, trust_remote_code=False).to(dev), hf_decode),
        "dequant_int4": (lambda: load_dequantized_model(int4, dtype=fp_dtype).to(dev), hf_decode),
        "engine_fp": (ours(args.fp16), our_decode),
        "runtime_int4": (ours(int4), our_decode),
    }
    if dev.type == "cpu":
        builders["hf_fp32"] = (lambda: AutoModelForCausalLM.from_pretrained(
            args.fp16, dtype=torch.float32, trust_remote_code=False), hf_decode)
    if int8 is not None:
        builders["dequant_int8"] = (lambda: load_dequantized_model(int8, dtype=fp_dtype).to(dev),
                                    hf_decode)
        builders["runtime_int8"] = (ours(int8), our_decode)
    results = {}
    for name, (build, decode) in builders.items():
        t = time.perf_counter()
        model = build().eval()
        load_s = time.perf_counter() - t
        results[name] = run_model(model, tok, decode, prompts, args.tokens)
        results[name]["load_s"] = load_s
        results[name]["backends"] = getattr(model, "quantpipe_backends", None)
        print(f"{name:14s} prefill {results[name]['prefill_s'] * 1e3:8.1f} ms  decode "
              f"{results[name]['decode_tokens_per_s']:7.1f} tok/s", flush=True)
        del model
    base = results["hf_fp16"]["decode_tokens_per_s"]
    print("\nratio of decode tokens/s vs hf_fp16 (and vs hf_fp32 on CPU):")
    for name, r in results.items():
        extra = ""
        if "hf_fp32" in results:
            fp32 = results["hf_fp32"]["decode_tokens_per_s"]
            extra = f"   vs hf_fp32 {r['decode_tokens_per_s'] / fp32:.2f}x"
        print(f"  {name:14s} {r['decode_tokens_per_s'] / base:6.2f}x{extra}")
    agree = {"int4": agreement(results["runtime_int4"]["tokens"],
                               results["dequant_int4"]["tokens"])}
    if int8 is not None:
        agree["int8"] = agreement(results["runtime_int8"]["tokens"],
                                  results["dequant_int8"]["tokens"])
    for k, a in agree.items():
        print(f"greedy agreement {k} runtime vs dequantized: {a['prompts_equal']}/{a['prompts']} "
              f"prompts equal over {args.tokens} tokens; first divergence {a['first_divergence']}")
    record = {"device": str(dev), "threads": torch.get_num_threads(), "tokens": args.tokens,
              "head_dtype": head,
              "prompts": prompts, "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, "results": results, "agreement": agree,
              "int4": str(args.int4) if args.int4 else "RTN g64 sym (made by the bench)",
              "int8": str(args.int8) if args.int8 else "RTN per-channel sym (made by the bench)",
              "fp16": "random weights, SmolLM2 shapes" if args.random_model else str(args.fp16)}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"decode-{dev.type}{'-quick' if args.quick else ''}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

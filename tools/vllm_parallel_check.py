"""Greedy tokens of a quantized (or FP16) folder in vLLM at a tensor / pipeline parallel size.

Run with the python of vLLM's venv (not quantpipe's), once per setting, and compare the token
lists: a checkpoint that splits correctly gives the same tokens at every size.

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND='0|1' \\
        .venv-vllm/bin/python tools/vllm_parallel_check.py QDIR --tp 2

On vLLM's CPU build each rank needs its own CPU list in ``VLLM_CPU_OMP_THREADS_BIND``
(``0|1`` for two ranks; ``0-1`` for one). Prints one line ``RESULT {json}`` with the settings,
the token ids and the text of three chat prompts (24 tokens each, greedy, EOS ignored).
docs/deploy.md lists what it showed.
"""

from __future__ import annotations

import argparse
import json

PROMPTS = ("Summarise our refund policy in two sentences.",
           "Write a Python function that checks whether a string is a palindrome.",
           "List three risks of migrating a billing database.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="model folder (GPTQ / compressed-tensors export or FP16)")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    ap.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(args.model, trust_remote_code=False)
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                   tokenize=False) for p in PROMPTS]
    ids = [tok.encode(text, add_special_tokens=False) for text in ids]
    llm = LLM(model=args.model, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
              dtype=args.dtype, enforce_eager=True, max_model_len=1024, max_num_seqs=4,
              generation_config="vllm", distributed_executor_backend="mp")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": x} for x in ids], params)
    print("RESULT " + json.dumps({"model": args.model, "tp": args.tp, "pp": args.pp,
                                  "dtype": args.dtype,
                                  "tokens": [list(o.outputs[0].token_ids) for o in outs],
                                  "text": [o.outputs[0].text for o in outs]}))


if __name__ == "__main__":  # vLLM's engine core is a spawned process: the guard is required
    main()

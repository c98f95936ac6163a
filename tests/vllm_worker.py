"""Runs inside the vLLM virtualenv (``.venv-vllm``), never inside quantpipe's: loads each
checkpoint of a job in vLLM's offline ``LLM`` in turn and writes what it generated.

    python tests/vllm_worker.py JOB.json RESULT.json

JOB: ``{"checkpoints": [{"path": DIR, "prompts": [[token ids], ...]}], "max_tokens": 32,
"max_model_len": 128}``. RESULT: ``{"results": [{"path": DIR, "ok": true, "outputs":
[{"tokens": [...], "logprobs": [...]}], "seconds": S} | {"path": DIR, "ok": false, "error":
"..."}]}``: greedy tokens (temperature 0, EOS ignored) and each chosen token's logprob, in
vLLM's own words when a load fails (one failing checkpoint does not stop the others).

quantpipe is not imported here: the vLLM venv pins an older transformers than quantpipe's.
The engine core is a spawned process, hence the ``__main__`` guard.
"""

from __future__ import annotations

import gc
import json
import sys
import time


def run_one(ckpt: dict, max_tokens: int, max_model_len: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(model=ckpt["path"], enforce_eager=True, max_model_len=max_model_len,
              max_num_seqs=len(ckpt["prompts"]), seed=0, dtype=ckpt.get("dtype", "auto"),
              distributed_executor_backend="uni")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                logprobs=0)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ckpt["prompts"]],
                            params, use_tqdm=False)
        outputs = []
        for out in outs:
            comp = out.outputs[0]
            tokens = list(comp.token_ids)
            # logprobs=0: each step's dict holds the chosen token only
            lps = [float(step[t].logprob) for t, step in zip(tokens, comp.logprobs)]
            outputs.append({"tokens": tokens, "logprobs": lps})
    finally:
        del llm
        gc.collect()
    return {"path": ckpt["path"], "ok": True, "outputs": outputs,
            "seconds": time.perf_counter() - start}


def main(job_path: str, result_path: str) -> None:
    job = json.loads(open(job_path).read())
    results = []
    for ckpt in job["checkpoints"]:
        try:
            results.append(run_one(ckpt, job.get("max_tokens", 32),
                                   job.get("max_model_len", 128)))
        except Exception as exc:  # report vLLM's refusal and go on with the next checkpoint
            msg = f"{type(exc).__name__}: {exc}".strip().splitlines()
            results.append({"path": ckpt["path"], "ok": False,
                            "error": " ".join(msg)[:2000]})
        with open(result_path + ".tmp", "w") as f:
            json.dump({"results": results}, f)
    import os

    os.replace(result_path + ".tmp", result_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

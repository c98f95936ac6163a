"""Runs inside the vLLM virtualenv (``.venv-vllm``), never inside quantpipe's: loads each
checkpoint of a job in vLLM's offline ``LLM`` in turn and writes what it generated.

    python tests/vllm_worker.py JOB.json RESULT.json

JOB: ``{"checkpoints": [{"path": DIR, "prompts": [[token ids], ...]}], "max_tokens": 32,
"max_model_len": 64}`` (a checkpoint may name its own ``max_model_len``). RESULT:
``{"results": [{"path": DIR, "ok": true, "outputs":
[{"tokens": [...], "logprobs": [...]}], "dtype": "float16", "seconds": S} | {"path": DIR,
"ok": false, "error": "..."}]}``: greedy tokens (temperature 0, EOS ignored), each chosen
token's logprob and the dtype vLLM computed in (it runs Gemma 3 in bfloat16 whatever the
checkpoint says), or
vLLM's own words (and the file and line that raised them) when a load fails; one failing
checkpoint does not stop the others.

quantpipe is not imported here: the vLLM venv pins an older transformers than quantpipe's.
The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni" executor): one
import of vLLM for every checkpoint, and its exceptions arrive here with their messages.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback


def run_one(ckpt: dict, max_tokens: int, max_model_len: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    # the smallest engine that runs the job: eager mode (no compilation), a 32 MiB KV cache,
    # no tokenizer (token ids in and out), the worker in this process
    llm = LLM(model=ckpt["path"], enforce_eager=True, max_model_len=max_model_len,
              max_num_seqs=len(ckpt["prompts"]), seed=0, skip_tokenizer_init=True,
              kv_cache_memory_bytes=32 * 2**20, enable_prefix_caching=False,
              distributed_executor_backend="uni")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ckpt["prompts"]],
                        params, use_tqdm=False)
    outputs = []
    for out in outs:
        comp = out.outputs[0]
        tokens = list(comp.token_ids)
        # logprobs=0: each step's dict holds the chosen token
        lps = [float(step[t].logprob) for t, step in zip(tokens, comp.logprobs)]
        outputs.append({"tokens": tokens, "logprobs": lps})
    dtype = str(llm.model_config.dtype).removeprefix("torch.")  # what vLLM computed in
    del llm
    return {"path": ckpt["path"], "ok": True, "outputs": outputs, "dtype": dtype,
            "seconds": time.perf_counter() - start}


def reset_vllm() -> None:
    """Tear down what a load set up (also after a failed one, which skips vLLM's own
    teardown): the next LLM then initialises its parallel groups afresh."""
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    destroy_model_parallel()
    destroy_distributed_environment()
    gc.collect()


def refusal(exc: BaseException) -> str:
    """vLLM's message, on one line, with where it was raised."""
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    where = f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno} in {frame.name}"
    msg = " ".join(f"{type(exc).__name__}: {exc}".split())
    return f"{msg} (raised at {where})"[:3000]


def main(job_path: str, result_path: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported
    with open(job_path) as f:
        job = json.load(f)
    results = []
    for ckpt in job["checkpoints"]:
        try:
            results.append(run_one(ckpt, job.get("max_tokens", 32),
                                   ckpt.get("max_model_len", job.get("max_model_len", 64))))
        except Exception as exc:  # vLLM refused this checkpoint: record why, go on
            traceback.print_exc()
            results.append({"path": ckpt["path"], "ok": False, "error": refusal(exc)})
        finally:
            reset_vllm()
        with open(result_path + ".tmp", "w") as f:  # complete after every checkpoint
            json.dump({"results": results}, f)
        os.replace(result_path + ".tmp", result_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

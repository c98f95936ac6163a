"""Every stage on random-weight models of real shapes: peak RSS and seconds per stage.

    python bench/scale.py --shapes tinyllama-4,tinyllama-16 --algos rtn,gptq \
        --work /tmp/qp-scale --json bench/results/scale.json

For each shape a source folder is written shard by shard (random fp16 weights, a small BPE
tokenizer trained on the shipped prompts; never the whole model in memory), then
``export-fp16 -> calibrate (each --algo) -> export --bits 4 -> verify -> generate`` run as
separate ``quantpipe`` processes. Each stage reports its own peak RSS: ``VmHWM`` from
/proc/self/status at exit, which counts everything the stage touched, mmapped shards included
(``ru_maxrss`` of a child would also count the parent's memory at the fork). Calibration's
seconds per block are read from its block records. A stage that fails is recorded with its
last error line and the stages that need its output are skipped.

Shapes (``--shapes``): tinyllama-4 / tinyllama-16 (TinyLlama-1.1B widths, 4 or 16 layers),
llama2-7b (32 layers, 4096 / 11008, MHA), qwen2.5-7b (28 layers, 3584 / 18944, GQA 28/4, qkv
bias), llama3-70b-slice (2 layers of a 70B: 8192 / 28672, GQA 64/8), mixtral-8x7b (32 layers,
4096, 8 experts of 14336, GQA 32/8; stored per expert under the hub's names).

The report on a 7B pair (issue 33: the FP16 reference and a W4 candidate, one resident at a
time; ~31 GB under --work). ``--stages report`` writes the W4 candidate's RTN codes directly
from the FP16 folder (``direct_rtn_checkpoint``: no calibration passes, whose hour on this shape
says nothing about the report), then runs ``quantpipe report`` with ``--report-args``:

    python bench/scale.py --shapes llama2-7b --stages report --keep \
        --report-args "--max-prompts 16 --eval-max-tokens 1024" \
        --json bench/results/scale-llama2-7b-32-report.json

The MoE export-fp16 memory check (issue 27; ~6 GB source, ~6 GB output under --work):

    python bench/scale.py --shapes mixtral-8x7b --layers 2 --stages export-fp16 \
        --json bench/results/scale-mixtral-8x7b-2-export-fp16.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from quantpipe.core.io import write_json_atomic

ROOT = Path(__file__).resolve().parents[1]

# TinyLlama-1.1B's widths (its depth is 22 layers; the bench compares 4 with 16)
_TINYLLAMA = dict(model_type="llama", hidden_size=2048, intermediate_size=5632,
                  num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
SHAPES: dict[str, dict] = {
    "smoke": dict(model_type="llama", hidden_size=256, intermediate_size=512,
                  num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                  vocab_size=2048),  # checks this script in seconds
    "mixtral-smoke": dict(model_type="mixtral", hidden_size=1024, intermediate_size=2048,
                          num_local_experts=8, num_experts_per_tok=2, num_attention_heads=8,
                          num_key_value_heads=2, num_hidden_layers=2, vocab_size=2048),
    "tinyllama-4": dict(_TINYLLAMA, num_hidden_layers=4),
    "tinyllama-16": dict(_TINYLLAMA, num_hidden_layers=16),
    "llama2-7b": dict(model_type="llama", hidden_size=4096, intermediate_size=11008,
                      num_attention_heads=32, num_key_value_heads=32, num_hidden_layers=32,
                      vocab_size=32000),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944,
                       num_attention_heads=28, num_key_value_heads=4, num_hidden_layers=28,
                       vocab_size=152064),
    "llama3-70b-slice": dict(model_type="llama", hidden_size=8192, intermediate_size=28672,
                             num_attention_heads=64, num_key_value_heads=8,
                             num_hidden_layers=2, vocab_size=128256),
    # Mixtral-8x7B: 8 experts of 14336 per layer (46.7B parameters at 32 layers); its source is
    # written with the hub's per-expert names (block_sparse_moe.experts.E.w1/w2/w3)
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336,
                         num_local_experts=8, num_experts_per_tok=2, num_attention_heads=32,
                         num_key_value_heads=8, num_hidden_layers=32, vocab_size=32000),
}
SHARD_BYTES = 2 * 10**9
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer():
    """A 2k-token byte-level BPE trained on the shipped calibration prompts (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from quantpipe.prompts.sets import load_prompt_records

    texts = [r.prompt or " ".join(c for _, c in r.messages)
             for r in load_prompt_records("business-calib")]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048, special_tokens=["<unk>", "<s>", "<|im_end|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="<|im_end|>", pad_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _random_tensor(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    if len(shape) == 2:  # linears and embeddings: small weights keep activations finite
        return (torch.randn(shape, generator=gen) * 0.02).to(torch.float16)
    if "norm" in name:
        return (1.0 + 0.1 * torch.randn(shape, generator=gen)).to(torch.float16)
    return (torch.randn(shape, generator=gen) * 0.02).to(torch.float16)  # biases


def _hub_tensors(skeleton, model_type: str) -> list[tuple[str, torch.Size]]:
    """(name, shape) of every tensor as a hub checkpoint stores it: a MoE family's 3-D experts
    per expert and linear (``block_sparse_moe.experts.E.w1`` for Mixtral), in block order."""
    from quantpipe.core.experts import hub_name, split_fused_name
    from quantpipe.core.families import FAMILIES

    family = FAMILIES.get(model_type)
    moe = None if family is None else family.moe
    out = []
    for name, t in skeleton.state_dict().items():
        found = None if moe is None else split_fused_name(name, family.blocks, moe)
        if found is None:
            out.append((hub_name(name, family.blocks, moe) if moe else name, t.shape))
            continue
        prefix, kind = found
        gate, up, down = moe.linear_names
        if kind == moe.gate_up:  # [E, 2I, H] -> gate [I, H] and up [I, H] per expert
            parts = [(gate, t.shape[1] // 2), (up, t.shape[1] // 2)]
        else:  # [E, H, I] -> down [H, I] per expert
            parts = [(down, t.shape[1])]
        for e in range(t.shape[0]):
            for lin, rows in parts:
                part = f"{prefix}.{moe.path}.{e}.{lin}.weight"
                out.append((hub_name(part, family.blocks, moe), torch.Size([rows, t.shape[2]])))
    return out


def make_source(shape: str, out: Path) -> int:
    """Write a random-weight HF folder of ``shape`` tensor by tensor (hub names; each tensor is
    on disk before the next is made); returns bytes of weights."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantpipe.core.io import write_shards

    if (out / "model.safetensors.index.json").is_file():
        idx = json.loads((out / "model.safetensors.index.json").read_text())
        return int(idx["metadata"]["total_size"])
    kw = dict(SHAPES[shape])
    model_type = kw.pop("model_type")
    cfg = AutoConfig.for_model(model_type, max_position_embeddings=4096,
                               tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                               pad_token_id=2, dtype="float16", **kw)
    with init_empty_weights():  # shapes only: no memory for the weights
        skeleton = AutoModelForCausalLM.from_config(cfg, trust_remote_code=False)
    tensors = _hub_tensors(skeleton, model_type)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    write_shards(((n, _random_tensor(n, shp, gen)) for n, shp in tensors), tmp, SHARD_BYTES)
    cfg.save_pretrained(tmp)
    _tokenizer().save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return sum(shp.numel() * 2 for _, shp in tensors)


# runs the CLI and, at exit, writes the process's own peak RSS (VmHWM, kB) to argv[1]
_PEAK_WRAPPER = """
import atexit, re, runpy, sys
out = sys.argv.pop(1)
def peak():
    text = open("/proc/self/status").read()
    open(out, "w").write(re.search(r"VmHWM:\\s+(\\d+)", text).group(1))
atexit.register(peak)
sys.argv[0] = "quantpipe"
runpy.run_module("quantpipe.cli", run_name="__main__")
"""


def _vmhwm_kb(pid: int) -> int:
    """A live process's peak RSS so far (VmHWM, kB); 0 once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def run_stage(args: list[str], log_path: Path, poll_s: float = 5.0) -> dict:
    """One `quantpipe` command in a child process: seconds, peak RSS (MB), exit code.

    The child writes its VmHWM at exit; the parent also reads it every ``poll_s`` seconds, so a
    stage that is killed (SIGKILL, the OOM killer) still reports the peak it had reached."""
    peak_file = log_path.with_suffix(".peak")
    peak_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-c", _PEAK_WRAPPER, str(peak_file), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    sampled_kb = 0
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=log_path.parent)
        while proc.poll() is None:
            sampled_kb = max(sampled_kb, _vmhwm_kb(proc.pid))
            try:
                proc.wait(timeout=poll_s)
            except subprocess.TimeoutExpired:
                pass
        rc = proc.returncode
    seconds = time.perf_counter() - t0
    lines = log_path.read_text(errors="replace").strip().splitlines()
    # the larger of the two: a stage that resets its high-water mark (report, per model) ends
    # with a lower VmHWM than the polls saw
    peak_kb = max(int(peak_file.read_text()) if peak_file.is_file() else 0, sampled_kb)
    rec = {"cmd": " ".join(["quantpipe", *args]), "rc": rc,
           "seconds": round(seconds, 2), "peak_rss_mb": round(peak_kb / 1024, 1)}
    if rc != 0:
        rec["error"] = lines[-1] if lines else ""
    name = next(a for a in args if not a.startswith("-"))
    print(f"  {name:<12} rc={rec['rc']} {rec['seconds']:8.1f}s  peak RSS "
          f"{rec['peak_rss_mb']:8.0f} MB" + (f"  {rec.get('error', '')}" if rec["rc"] else ""),
          flush=True)
    return rec


def block_seconds(calib_dir: Path) -> list[float]:
    out = []
    for p in sorted((calib_dir / "blocks").glob("block-*.json")):
        out.append(float(json.loads(p.read_text()).get("seconds", 0.0)))
    return out


def _fp16_folder(shape: str, base: Path, reuse: bool,
                 fp16_dir: Path | None = None) -> tuple[dict, Path]:
    """(result record, FP16 folder): the random source exported, or a finished one reused
    (``fp16_dir``, or a --keep run's under ``base``)."""
    fp16 = fp16_dir or base / "fp16"
    if fp16_dir is not None and not (fp16 / "quantpipe.json").is_file():
        raise SystemExit(f"--fp16 {fp16}: not a finished export-fp16 folder")
    if (reuse or fp16_dir is not None) and (fp16 / "quantpipe.json").is_file():
        # a previous run's export (its numbers are in that run's JSON)
        weight_bytes = sum(p.stat().st_size for p in fp16.glob("*.safetensors"))
        return {"shape": SHAPES[shape], "weight_bytes_fp16": weight_bytes,
                "stages": {"export-fp16": {"rc": 0, "reused": str(fp16)}}}, fp16
    print(f"{shape}: writing the random source", flush=True)
    t0 = time.perf_counter()
    weight_bytes = make_source(shape, base / "source")
    res = {"shape": SHAPES[shape], "weight_bytes_fp16": weight_bytes,
           "source_seconds": round(time.perf_counter() - t0, 1), "stages": {}}
    res["stages"]["export-fp16"] = run_stage(
        ["export-fp16", str(base / "source"), "--out", str(fp16), "--force"],
        base / "export-fp16.log")
    return res, fp16


def direct_rtn_checkpoint(fp16_dir: Path, out: Path, group_size: int = 128,
                          fmt: str = "native") -> dict:
    """Write a W4 (sym, ``group_size``) checkpoint in ``fmt`` of every decoder linear by plain
    round-to-nearest straight from the FP16 folder, one layer read at a time (the writer streams
    a :class:`~quantpipe.core.qformat.LazyWeights`). A stand-in for a calibration where only the
    checkpoint's shape and format matter (memory and speed of the later stages, what vLLM loads);
    returns its manifest."""
    from quantpipe.calibration.rtn import rtn
    from quantpipe.core.formats.common import read_fp_state
    from quantpipe.core.formats.writers import write_checkpoint
    from quantpipe.core.qformat import LazyWeights, QuantSpec

    state = read_fp_state(fp16_dir)
    shapes = {k.removesuffix(".weight"): state.shape(k) for k in state
              if k.endswith(".weight") and ".layers." in k and len(state.shape(k)) == 2}
    spec = QuantSpec(4, group_size, True)
    return write_checkpoint(
        fmt, out, fp16_dir,
        LazyWeights({n: spec for n in shapes}, shapes,
                    lambda n: rtn(state[f"{n}.weight"], spec).weight),
        force=True)


def run_report(shape: str, base: Path, fp16: Path, report_args: list[str],
               reuse: bool = False) -> dict:
    """``--stages report``: the RTN W4 candidate written directly (``reuse``: a finished one
    of an earlier run kept), then ``quantpipe report`` of it against the FP16 folder as a
    child process (its peak RSS and seconds)."""
    qdir = base / "int4-direct-rtn"
    stages: dict[str, dict] = {}
    if not (reuse and (qdir / "quantpipe.json").is_file()):
        print(f"{shape}: writing the W4 candidate (direct RTN)", flush=True)
        t0 = time.perf_counter()
        direct_rtn_checkpoint(fp16, qdir)
        stages["write-int4-direct-rtn"] = {
            "seconds": round(time.perf_counter() - t0, 1),
            "bytes": sum(p.stat().st_size for p in qdir.glob("*.safetensors"))}
    stages["report"] = run_stage(["-v", "report", "--reference", str(fp16), "--candidate",
                                  str(qdir), "--out", str(base / "report" / "report.html"),
                                  *report_args], base / "report.log")
    stages["report"]["report_args"] = report_args
    stages["report"].update(report_peaks(base / "report" / "report.json"))
    return stages


def report_peaks(report_json: Path) -> dict:
    """The report's own peak RSS per answering model: it resets the process's high-water mark
    before each model loads (``core.heap.reset_peak_rss``), so VmHWM at exit is the last
    model's, not the stage's; the stage's peak is the largest of them (eval's block-by-block
    step, before the first reset, is far below the FP16 reference's)."""
    if not report_json.is_file():
        return {}
    speeds = json.loads(report_json.read_text()).get("model_speed") or []
    by_model = {m["name"]: round(m["peak_rss_bytes"] / 2**20, 1) for m in speeds
                if m.get("peak_rss_bytes")}
    return {"peak_rss_mib_by_model": by_model,
            "activation_dtype": {m["name"]: m.get("activation_dtype") for m in speeds},
            "kv_dtype": {m["name"]: m.get("kv_dtype") for m in speeds}} if by_model else {}


def run_shape(shape: str, algos: list[str], work: Path, samples: int, seq_len: int,
              keep: bool, reuse: bool = False, stages: str = "all",
              fp16_dir: Path | None = None, report_args: list[str] | None = None) -> dict:
    base = work / shape
    base.mkdir(parents=True, exist_ok=True)
    res, fp16 = _fp16_folder(shape, base, reuse, fp16_dir)
    st = res["stages"]
    if st["export-fp16"]["rc"] != 0 or stages == "export-fp16":
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
        return res
    if stages == "report":
        st.update(run_report(shape, base, fp16, report_args or [], reuse))
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
        return res
    for algo in algos:
        calib, qdir = base / f"calib-{algo}", base / f"int4-{algo}"
        shutil.rmtree(calib, ignore_errors=True)
        key = f"calibrate-{algo}"
        st[key] = run_stage(["calibrate", str(fp16), "--out", str(calib), "--algo", algo,
                             "--samples", str(samples), "--seq-len", str(seq_len),
                             "--group-size", "128", "--batch-size", str(min(8, samples))],
                            base / f"{key}.log")
        if st[key]["rc"] != 0:
            continue
        secs = block_seconds(calib)
        st[key]["seconds_per_block"] = {"mean": round(sum(secs) / len(secs), 2),
                                        "max": round(max(secs), 2), "blocks": len(secs)}
        if stages == "calibrate":
            continue
        st[f"export-{algo}"] = run_stage(["export", str(calib), "--bits", "4", "--out",
                                          str(qdir), "--force"], base / f"export-{algo}.log")
        if st[f"export-{algo}"]["rc"] != 0:
            continue
        st[f"verify-{algo}"] = run_stage(["verify", str(qdir)], base / f"verify-{algo}.log")
        st[f"generate-{algo}"] = run_stage(
            ["generate", str(qdir), "--prompt", "Summarise the contract in one line.",
             "--max-new-tokens", "8"], base / f"generate-{algo}.log")
    if not keep:
        shutil.rmtree(base, ignore_errors=True)
    return res


def cpu_info() -> dict:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        text = ""
    info = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {"model": info.get("Model name", "").strip(), "cpus": os.cpu_count(),
            "flags": info.get("Flags", "").strip(), "machine": platform.machine()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="tinyllama-4,tinyllama-16",
                    help=f"comma-separated, from {sorted(SHAPES)}")
    ap.add_argument("--algos", default="rtn", help="comma-separated: rtn, gptq, awq")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--work", type=Path, default=Path("/tmp/qp-scale"))
    ap.add_argument("--keep", action="store_true", help="keep the model folders")
    ap.add_argument("--reuse-fp16", action="store_true",
                    help="start from a finished FP16 folder of a --keep run under --work")
    ap.add_argument("--fp16", type=Path, default=None,
                    help="a finished export-fp16 folder of the (single) shape to start from, "
                         "anywhere (it is never deleted)")
    ap.add_argument("--layers", type=int, default=0,
                    help="override the depth: a slice of N layers of each shape at its real "
                         "widths (peak RSS is reached within one block; named SHAPE-N)")
    ap.add_argument("--stages", default="all",
                    help="all; calibrate or export-fp16: stop after that stage (memory of "
                         "one stage); report: a directly written RTN W4 candidate, then "
                         "`quantpipe report` against the FP16 folder (no calibration)")
    ap.add_argument("--report-args", default="",
                    help="with --stages report: options for `quantpipe report`, one string")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "scale.json")
    args = ap.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; choose from {sorted(SHAPES)}")
    if args.stages not in ("all", "calibrate", "export-fp16", "report"):
        ap.error("--stages is all, calibrate, export-fp16 or report")
    if args.fp16 is not None and len(shapes) != 1:
        ap.error("--fp16 is the FP16 folder of one shape: pass one --shapes")
    if args.layers:
        for s in list(shapes):
            SHAPES[f"{s}-{args.layers}"] = dict(SHAPES[s], num_hidden_layers=args.layers)
        shapes = [f"{s}-{args.layers}" for s in shapes]
    algos = [a for a in args.algos.split(",") if a]
    out = {"cpu": cpu_info(), "torch": torch.__version__, "samples": args.samples,
           "seq_len": args.seq_len, "loadavg_before": os.getloadavg(),
           "note": "shared machine: other jobs were using the CPUs, so seconds are noisy",
           "results": {}}
    for shape in shapes:
        out["results"][shape] = run_shape(shape, algos, args.work, args.samples, args.seq_len,
                                          args.keep, args.reuse_fp16, args.stages, args.fp16,
                                          shlex.split(args.report_args))
        out["loadavg_after"] = os.getloadavg()
        write_json_atomic(args.json, out)  # after every shape: a long run keeps what it has
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

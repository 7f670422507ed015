#!/usr/bin/env bash
# The GPU check: kernel parity, greedy parity of a tiny Llama (also with half its layers on the CPU),
# decode bandwidth, an end-to-end run of a 0.5B Qwen2-shaped model (scripts/gpu_check.py).
# About 5 minutes on one H100/H200 before the graphs and e2e checks (their time is not yet measured;
# GPU_CHECK_TIMEOUT, default 540 s, bounds the whole run), no network. Prints one [PASS|FAIL|SKIPPED] line per check; on a
# machine without CUDA every check is SKIPPED and it exits 0. Extra arguments go to gpu_check.py
# (e.g. --only kernels/triton).
set -euo pipefail
cd "$(dirname "$0")/.."

# The project's venv where there is one (a developer machine); else the python3 that holds a CUDA
# torch (the GPU machines' image). PYTHON=... overrides both.
if [[ -n "${PYTHON:-}" ]]; then
    py="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
    py=.venv/bin/python
else
    py=python3
fi

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package from this checkout, installed or not
export PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # the tiny model is built locally: never reach a hub
# SIGTERM at the limit makes gpu_check.py report what was running and what never started; -k
# kills it 15 s later if it is stuck inside a CUDA call.
exec timeout -k 15 "${GPU_CHECK_TIMEOUT:-540}" "$py" scripts/gpu_check.py "$@"

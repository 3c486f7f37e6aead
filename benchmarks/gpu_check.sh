#!/usr/bin/env bash
# The one GPU run the kernels wait for: correctness on the device, then the figures.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR [bench_kernels.py options]]
#
# Needs only python3 with torch, triton and pytest (a CUDA image has them; no
# `make setup`): the kernel tests against their PyTorch references, compiled
# for the GPU this time instead of interpreted (the engine tests, which need the
# whole package's dependencies, are left out), then `bench_kernels.py`. Both
# logs go to OUT_DIR (default: gpu-check/).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-check}"
shift || true  # the rest goes to bench_kernels.py (e.g. --quick)
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name(0))" | tee "$out/versions.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
    -k "not engine and not backend and not in_triton_interpreter and not compile" 2>&1 | tee "$out/tests.log"
tests=$?
python3 benchmarks/bench_kernels.py "$@" 2>&1 | tee "$out/bench.log"
bench=$?
echo "tests rc=$tests bench rc=$bench"
exit $(( tests || bench ))

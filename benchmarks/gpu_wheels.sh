#!/usr/bin/env bash
# The wheels the engine needs on a CUDA image that has torch, triton and
# transformers but not tracevllm's own dependencies, for Python 3.12 on
# x86-64, into .whl/ (git-ignored): benchmarks/gpu_check.sh installs them.
# The versions are the project's pins (pyproject.toml).
#
#   bash benchmarks/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
for spec in opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
    opentelemetry-semantic-conventions==0.66b2 msgspec==0.22.0 pyzmq==27.3.0; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$spec"
done
ls -l .whl

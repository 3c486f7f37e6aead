#!/usr/bin/env bash
# The one GPU run the kernels wait for: correctness on the device, then the figures.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR [bench_kernels.py options]]
#
# Needs only python3 with torch, triton and pytest (a CUDA image has them; no
# `make setup`): the kernel tests against their PyTorch references, compiled
# for the GPU this time instead of interpreted, the MoE kernel against its
# reference, then `bench_kernels.py`; then, with the engine's few extra wheels
# in .whl/, the engine's CUDA graphs. The logs go to OUT_DIR (default: gpu-check/).
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
# The MoE grouped GEMM, compiled: fused_moe_kernel against fused_moe_kernel_torch on
# random routings with an idle expert, one every token picks, and (top 1) every token
# on one expert; both GEMMs of a layer, up to Qwen3-30B-A3B's expert shape, bf16 too
# (Triton's interpreter gets bf16 dots wrong, so tests/test_fused_moe.py leaves it out).
# It loads moe_align_block_size.py by path: the tracevllm package wants OpenTelemetry.
python3 - <<'PY' 2>&1 | tee "$out/moe.log"
import importlib.util, torch
from kernels.fused_moe import fused_moe_kernel_torch, get_default_config, invoke_fused_moe_triton_kernel
spec = importlib.util.spec_from_file_location("align", "tracevllm/model_executor/layers/fused_moe/moe_align_block_size.py")
align = importlib.util.module_from_spec(spec); spec.loader.exec_module(align)
gen = torch.Generator(device="cuda").manual_seed(0)
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# (tokens, experts, top_k, hidden, intermediate)
for M, E, topk, H, I in [(1, 128, 8, 2048, 768), (64, 128, 8, 2048, 768), (700, 128, 8, 2048, 768),
                         (300, 8, 2, 512, 256), (264, 2, 1, 160, 80), (40, 4, 1, 72, 24)]:
    for dtype in TOL:
        logits = torch.randn(M, E, device="cuda", generator=gen)
        logits[:, 0] = logits.min(1).values - 1  # idle: no token picks expert 0
        logits[:, -1] = logits.max(1).values + 1  # busy: every token picks the last
        weights, ids = torch.topk(torch.softmax(logits, -1), topk)
        ids = ids.to(torch.int32)
        w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) / H**0.5).to(dtype)
        w2 = (torch.randn(E, H, I, device="cuda", generator=gen) / I**0.5).to(dtype)
        x = torch.randn(M, H, device="cuda", generator=gen).to(dtype)
        a2 = torch.randn(M * topk, I, device="cuda", generator=gen).to(dtype)
        config = get_default_config(M, E, I, H, topk, dtype)
        routing = align.moe_align_block_size(ids, config["BLOCK_SIZE_M"], E)
        for A, B, mul, k in ((x, w13, False, topk), (a2, w2, True, 1)):
            ref = torch.full((M, topk, B.shape[1]), float("nan"), device="cuda", dtype=dtype)
            out = ref.clone()
            fused_moe_kernel_torch(A, B, ref, weights, *routing, mul, k, config)
            invoke_fused_moe_triton_kernel(A, B, out, weights, *routing, mul, k, config)
            assert not out.isnan().any(), ("unwritten rows", M, E, topk, dtype)
            torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
        print(f"fused_moe_kernel ok: M={M} E={E} top_k={topk} H={H} I={I} {dtype}", flush=True)
PY
moe=$?
python3 benchmarks/bench_kernels.py "$@" 2>&1 | tee "$out/bench.log"
bench=$?
# The engine on the GPU: PIECEWISE CUDA graphs lossless against eager, then
# eager / compiled / compiled with graphs (tests/test_cuda_graph.py,
# benchmarks/bench_cuda_graphs.py). These import the whole package: a CUDA
# image lacks OpenTelemetry, msgspec and pyzmq, so bring them as wheels in
# .whl/ (benchmarks/gpu_wheels.sh fetches them where pip can reach PyPI).
engine=0
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/gpu-check-site .whl/*.whl
    export PYTHONPATH="/tmp/gpu-check-site:$PYTHONPATH"
fi
if python3 -c "import tracevllm.entrypoints.llm" 2>/dev/null; then
    python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py -k piecewise 2>&1 | tee "$out/cuda_graph_tests.log"
    engine=$?
    python3 benchmarks/bench_cuda_graphs.py --output-json "$out/cuda_graphs.json" 2>&1 | tee "$out/cuda_graphs.log"
    engine=$(( engine || $? ))
else
    echo "engine checks skipped: tracevllm does not import here (its wheels: benchmarks/gpu_wheels.sh)" | tee "$out/cuda_graph_tests.log"
    python3 -c "import tracevllm.entrypoints.llm" 2>&1 | tail -1 | tee -a "$out/cuda_graph_tests.log"
fi
echo "tests rc=$tests moe rc=$moe bench rc=$bench engine rc=$engine"
exit $(( tests || moe || bench || engine ))

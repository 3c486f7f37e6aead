# The Triton kernels (kernels/). Included by the Makefile.
#   make bench-kernels   on a CUDA GPU: paged decode read GB/s (% of peak) and prefill
#                        TFLOP/s, against torch SDPA; without a GPU it says so and exits 0
#   make kernel-resources  without a GPU: each kernel compiled for sm_80 and sm_90,
#                        its registers, shared memory, spills and programs per SM
#   make test-kernels    the kernels against their PyTorch references in Triton's CPU
#                        interpreter (the MoE layer's too), and the engine on the Triton backend
# Triton comes with the `triton` extra (pyproject.toml); installed here if missing.
.PHONY: bench-kernels test-kernels setup-triton kernel-resources

setup-triton: setup
	@$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q triton==3.9.0

bench-kernels: setup setup-triton
	$(PY) benchmarks/bench_kernels.py $(ARGS)

test-kernels: setup setup-triton
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests/test_kernels.py tests/test_fused_moe.py

# Compiled ahead of time for sm_80 and sm_90 on this machine (no GPU): registers,
# shared memory, spills and programs per SM of every kernel. ARGS="--dtype fp16 bf16"
kernel-resources: setup setup-triton
	$(PY) benchmarks/kernel_resources.py $(ARGS)

# Structured outputs (tracevllm/structured_output/). Included by the Makefile.
#   make bench-structured   tokens/s of the same prompts with and without a JSON
#                           schema, compile time per constraint, bitmask fill time
.PHONY: bench-structured

bench-structured: setup
	$(PY) benchmarks/bench_structured.py

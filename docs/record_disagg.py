"""Record the KV connectors chapter: one chat request prefilled on one server
and decoded on another, in one trace; and the figures of the connectors'
benchmarks.

The run is what ``make trace-disagg`` runs: ``tracevllm trace --disagg`` on the
default model, a prefill server (``kv_role="kv_producer"``) and a decode
server (``kv_consumer``) sharing an ``ExampleConnector`` folder, and
``tracevllm disagg-proxy`` in front of them; one streamed chat request through
the proxy. Six processes (the client, the proxy, each server and its engine
core) write one ``spans.jsonl`` under ``traces/docs/disagg/``. From it this
script draws ``docs/assets/recorded/disagg-waterfall.svg`` and writes
``docs/assets/recorded/facts.disagg.json``: the figures the chapter quotes
(checked at build time by docs/hooks/recorded.py).

The benchmark figures come from committed results, not from a run here:
``benchmarks/results/offload.json`` (``make bench-offload ARGS="--json ..."``)
and ``benchmarks/results/disagg.json`` (``make bench-disagg``), each copied
into the facts when the file is there.

    .venv/bin/python docs/record_disagg.py                 # run, then draw
    .venv/bin/python docs/record_disagg.py --draw-only     # redraw from traces/docs/disagg/
    .venv/bin/python docs/record_disagg.py --measured-only # only the benchmark figures

``make docs-assets`` (docs/record_assets.py) does not run it (minutes of
server start-ups); it keeps what it wrote (``OUTPUTS``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "docs"))

import record_assets as assets  # noqa: E402

from tracevllm.tracing.exporters import SpanRecord  # noqa: E402
from tracevllm.views.waterfall import render_waterfall  # noqa: E402

NAME = "disagg"
PROMPT = "What is the capital of France?"
MAX_TOKENS = 16
FACTS = os.path.join(assets.OUT_DIR, "facts.disagg.json")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
# What this script writes into docs/assets/recorded/ (glob patterns): make
# docs-assets, which does not run it, keeps these when it empties the folder.
OUTPUTS = ("disagg-*.svg", "facts.disagg.json")
SAVE = "ExampleConnector.save_kv_layer"
LOAD = "ExampleConnector.wait_for_layer_load"
PARAMS_KEYS = "tracevllm.disagg.kv_transfer_params"  # on the proxy's prefill call


def run() -> None:
    out = assets.fresh_run_dir(NAME)
    cmd = [os.path.join(ROOT, ".venv", "bin", "tracevllm"), "trace", "--disagg",
           "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--out", out]  # fmt: skip
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)


def _transfer(span: SpanRecord) -> dict[str, Any]:
    a = span.attributes
    return {
        "bytes": int(a["tracevllm.kv_transfer.num_bytes"]),
        "blocks": int(a["tracevllm.kv_transfer.num_blocks"]),
        "tokens": int(a["tracevllm.kv_transfer.num_tokens"]),
        "layers": int(a["tracevllm.kv_transfer.num_layers"]),
        # From the first layer's start to the last layer's end: the layers
        # move one at a time inside the forward, so this spans the forward.
        "span_ms": round(float(a["tracevllm.kv_transfer.ms"])),
        "process": span.process_kind,
    }


def draw() -> dict[str, Any]:
    spans = assets.load(NAME)
    (client,) = [s for s in spans if s.process_kind == "client" and s.parent_span_id is None]
    spans = [s for s in spans if s.trace_id == client.trace_id]
    by_id = {s.span_id: s for s in spans}
    kinds: dict[str, set[int]] = {}
    for s in spans:
        kinds.setdefault(s.process_kind, set()).add(s.pid)
    (save,) = [s for s in spans if s.name == SAVE]
    (load,) = [s for s in spans if s.name == LOAD]
    requests = [s for s in spans if s.name == "llm_request"]
    # The decode server's request continues the prefill server's: its parent
    # is the prefill server's llm_request, in another process.
    (decode_req,) = [
        s for s in requests if (p := by_id.get(s.parent_span_id or "")) and p.pid != s.pid
    ]
    parent = by_id[decode_req.parent_span_id or ""]
    (prefill_req,) = [s for s in requests if s is not decode_req]
    # The decode engine's first step for the request: what it computed itself.
    decode_schedules = sorted(
        (s for s in spans if s.name == "Scheduler.schedule" and s.pid == load.pid
         and s.attributes.get("tracevllm.num_scheduled_tokens")),
        key=lambda s: s.start_ns,
    )  # fmt: skip
    (first_step,) = decode_schedules[0].attributes["tracevllm.num_scheduled_tokens"]
    (prefill_call,) = [s for s in spans if s.name == "DisaggProxy.prefill"]
    save_facts, load_facts = _transfer(save), _transfer(load)
    per_token_layer = load_facts["bytes"] // (load_facts["tokens"] * load_facts["layers"])
    waterfall = render_waterfall(
        spans, max_rows=70, collapse=frozenset({"EngineCore.step"}), max_same_name=4
    )
    assets.save_svg(f"{NAME}-waterfall.svg", waterfall, "trace-disagg", 100)
    return {
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "spans": len(spans),
        "processes": len({s.pid for s in spans}),
        "process_kinds": {kind: len(pids) for kind, pids in sorted(kinds.items())},
        "trace_ids": len({s.trace_id for s in spans}),
        "prompt_tokens": int(decode_req.attributes["gen_ai.usage.input_tokens"]),
        "prefill_output_tokens": int(prefill_req.attributes["gen_ai.usage.output_tokens"]),
        "decode_output_tokens": int(decode_req.attributes["gen_ai.usage.output_tokens"]),
        "decode_cached_tokens": int(decode_req.attributes["tracevllm.num_cached_tokens"]),
        "decode_finish_reason": decode_req.attributes["gen_ai.response.finish_reasons"][0],
        "answer": decode_req.attributes["tracevllm.completion.text"],
        "decode_parent": parent.name,
        "decode_parent_process": parent.process_kind,
        "kv_transfer_params_keys": list(prefill_call.attributes[PARAMS_KEYS]),
        "save": save_facts,
        "load": load_facts,
        "bytes_per_token_per_layer": per_token_layer,
        "decode_first_step_tokens": int(first_step),
    }


def _offload_facts(result: dict[str, Any]) -> dict[str, Any]:
    """benchmarks/results/offload.json's figures, rounded as the chapter quotes them."""
    rows = {}
    for row, key in zip(result["rows"], ("no_tier", "tier"), strict=True):
        rows[key] = {
            "config": row["config"],
            "hit_rate_pct": round(100 * row["prefix_hit_rate"], 1),
            "tier_hit_rate_pct": round(100 * row["tier_hit_rate"], 1),
            "ttft_mean_ms": round(row["ttft_mean_ms"]),
            "ttft_p50_ms": round(row["ttft_p50_ms"]),
            "ttft_p90_ms": round(row["ttft_p90_ms"]),
            "tier_blocks": row["tier"],
        }
    args = result["args"]
    return {
        "args": {k: args[k] for k in ("groups", "prefix_len", "suffix_len", "rounds",
                                      "block_size", "num_gpu_blocks", "async_load")},
        "requests": args["groups"] * args["rounds"],
        "prefix_blocks_needed": args["groups"]
        * -(-(args["prefix_len"] + args["suffix_len"]) // args["block_size"]),
        "same_first_tokens": result["same_first_tokens"],
        "load_average": [round(x, 1) for x in result["load_average"]],
        **rows,
    }  # fmt: skip


def _disagg_facts(result: dict[str, Any]) -> dict[str, Any]:
    """benchmarks/results/disagg.json's figures (its per-request rows left out)."""
    metrics = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "max_itl_ms")
    configs = {}
    for config in result["configs"]:
        key = {"one engine": "one_engine", "P/D split": "pd_split"}[config["config"]]
        decode = config["decode_server_metrics"]
        configs[key] = {
            **{kind: {m: round(config[kind][m]) for m in metrics} for kind in ("short", "long")},
            "completed": sum(config[kind]["completed"] for kind in ("short", "long")),
            "failed": sum(config[kind]["failed"] for kind in ("short", "long")),
            "long_arrivals_during_short_decode": config["long_arrivals_during_short_decode"],
            "load_before": round(config["load_average"]["before"][0], 1),
            "load_after": round(config["load_average"]["after"][0], 1),
            "loaded_prompt_tokens": round(
                decode.get("vllm:prompt_tokens_by_source_total[external_kv_transfer]", 0)
            ),
        }
    prediction = {}
    for model, key in zip(result["prediction"]["models"], ("this", "llama3_8b"), strict=True):
        prediction[key] = {
            "decode_step_ms": round(model["decode_step_ms"], 2),
            "prefill_ms": round(model["prefill_ms"], 1),
            "one_gpu_worst_itl_ms": round(model["one_gpu_worst_itl_ms"], 1),
            "split_worst_itl_ms": round(model["split_worst_itl_ms"], 2),
        }
    return {
        "command": result["command"],
        "date": result["date"],
        "model": result["model"],
        "workload": result["workload"],
        "cpus": result["machine"]["cpus"],
        **configs,
        "prediction": prediction,
    }


def measured() -> dict[str, Any]:
    """The connectors' benchmark figures, from benchmarks/results/ (each only if there)."""
    facts: dict[str, Any] = {}
    for key, name, extract in (
        ("bench_offload", "offload.json", _offload_facts),
        ("bench_disagg", "disagg.json", _disagg_facts),
    ):
        path = os.path.join(RESULTS, name)
        if os.path.exists(path):
            with open(path) as f:
                facts[key] = extract(json.load(f))
    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draw-only", action="store_true", help="redraw from traces/docs/disagg/")
    parser.add_argument(
        "--measured-only", action="store_true", help="only the benchmark figures (no run)"
    )
    args = parser.parse_args()
    facts: dict[str, Any] = {}
    if os.path.exists(FACTS):
        with open(FACTS) as f:
            facts = json.load(f)
    if not args.measured_only:
        if not args.draw_only:
            run()
        facts[NAME] = draw()
    for key in ("bench_offload", "bench_disagg"):
        facts.pop(key, None)
    facts |= measured()
    assets.write_text(os.path.basename(FACTS), json.dumps(facts, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()

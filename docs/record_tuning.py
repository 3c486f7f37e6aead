"""Record the tuning chapter: one ``tracevllm bench sweep`` per knob, charted.

``make docs-tuning`` runs it (minutes on a quiet machine): for each knob of
docs/chapters/tuning.md, a small workload on the default model through
``run_sweep`` of tracevllm/benchmarks/sweep.py (what ``tracevllm bench sweep
--serve-params`` runs), one fresh engine per value. It writes
``docs/assets/recorded/tuning-<knob>.svg`` (mean TTFT, mean ITL or TPOT,
output tokens/s against the knob's values; matplotlib) and
``docs/assets/recorded/facts.tuning.json``, the figures the chapter quotes
(checked at build time by docs/hooks/recorded.py). ``--draw-only`` redraws
the charts from ``traces/docs/tuning.json`` (the last run's results).

The engine runs in this process (``enable_multiprocessing=False``, so that a
config starts in seconds) except for the thread knob, whose engine core runs
in its own process: that is where its threads are set, and the frontend it
reserves a core for is this process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "docs", "assets", "recorded")
RESULTS = os.path.join(ROOT, "traces", "docs", "tuning.json")
FACTS = os.path.join(OUT_DIR, "facts.tuning.json")
# What this script writes into OUT_DIR (glob patterns): make docs-assets,
# which does not run it, keeps these when it starts the folder afresh.
OUTPUTS = ("tuning-*.svg", "facts.tuning.json")

# A shared system prompt (the prefix-caching workload): long enough to fill
# several KV blocks.
SYSTEM = (
    "You are a patient tutor for a class of ten-year-olds. Answer in plain words, "
    "in two or three short sentences, with one example from everyday life. Never use "
    "jargon without explaining it, never talk down to the reader, and end with a question "
    "that makes them think. The class is studying science, history and music this term, "
    "and every answer should connect to one of those subjects where it can. "
) * 2
COPY_TEXT = (
    "The quick brown fox jumps over the lazy dog. The lazy dog sleeps under the old oak "
    "tree. The old oak tree stands in the middle of the green field."
)
LONG_TEXT = " ".join(
    f"Paragraph {i}: the engine schedules requests, allocates blocks of the KV cache, "
    "runs the model over the batch and samples one token for every request."
    for i in range(6)
)


def _workloads(tokenizer: Any) -> dict[str, Any]:
    from tracevllm.benchmarks.datasets import _encode, chat_prompts

    chat = chat_prompts(4)
    return {
        "chat": _encode(tokenizer, chat, [8] * 4, chat=True),
        "mixed": _encode(
            tokenizer, [f"Summarize this text:\n{LONG_TEXT}"] + chat[:3], [8] * 4, chat=True
        ),
        "shared_prefix": _encode(
            tokenizer, [f"{SYSTEM}\nQuestion: {q}" for q in chat], [8] * 4, chat=True
        ),
        "copy": _encode(
            tokenizer, [f"Repeat this text exactly, twice:\n{COPY_TEXT}"] * 2, [24] * 2, chat=True
        ),
    }


# knob -> (its chapter's name for it, workload, the per-token latency metric,
# [(label, config)]).
def _knobs() -> dict[str, tuple[str, str, str, list[tuple[str, dict[str, Any]]]]]:
    ngram = {"method": "ngram", "prompt_lookup_max": 4}
    return {
        "max_num_seqs": ("max_num_seqs", "chat", "itl", [
            (str(n), {"max_num_seqs": n}) for n in (1, 4)
        ]),
        "max_num_batched_tokens": ("max_num_batched_tokens", "mixed", "itl", [
            (str(n), {"max_num_batched_tokens": n}) for n in (32, 512)
        ]),
        "long_prefill_token_threshold": ("long_prefill_token_threshold", "mixed", "itl", [
            (str(n), {"max_num_batched_tokens": 256, "long_prefill_token_threshold": n})
            for n in (0, 32)
        ]),
        "prefix_caching": ("enable_prefix_caching", "shared_prefix", "itl", [
            ("off", {"enable_prefix_caching": False}), ("on", {"enable_prefix_caching": True}),
        ]),
        "block_size": ("block_size", "chat", "itl", [
            (str(n), {"block_size": n}) for n in (16, 64)
        ]),
        "speculative_k": ("num_speculative_tokens", "copy", "tpot", [
            ("0", {}),
            *((str(k), {"speculative_config": ngram | {"num_speculative_tokens": k}})
              for k in (3,)),
        ]),
        "reserved_cpu": ("TRACEVLLM_CPU_NUM_OF_RESERVED_CPU", "chat", "itl", [
            (str(n), {"enable_multiprocessing": True, "TRACEVLLM_CPU_NUM_OF_RESERVED_CPU": n})
            for n in (0, 1)
        ]),
    }  # fmt: skip


def run() -> dict[str, Any]:
    from transformers import AutoTokenizer

    from tracevllm.benchmarks import sweep
    from tracevllm.model_executor.model_loader import resolve_model

    parser = argparse.ArgumentParser()
    sweep.add_cli_args(parser)
    args = parser.parse_args(["--no-progress", "--no-enable-multiprocessing"])
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    workloads = _workloads(tokenizer)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    cpus = os.cpu_count() or 1
    if os.getloadavg()[0] > cpus:
        print(f"warning: load average {load} on {cpus} CPUs: the sweeps will measure the "
              "other work more than the knobs; record on a quiet machine", flush=True)  # fmt: skip
    started = time.time()
    results: dict[str, Any] = {"load_before": load, "knobs": {}}
    for knob, (field, workload, metric, values) in _knobs().items():
        samples = workloads[workload]
        print(f"# {knob}: {len(values)} configs x {len(samples)} requests ({workload})", flush=True)
        configs = [{"_benchmark_name": label, **config} for label, config in values]
        out = sweep.run_sweep(args, configs, samples, [50.0, 99.0])
        results["knobs"][knob] = {
            "field": field,
            "workload": workload,
            "metric": metric,
            "requests": len(samples),
            "prompt_tokens": [s.prompt_len for s in samples],
            "output_tokens": samples[0].expected_output_len,
            "configs": out,
        }
    results["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results["minutes"] = round((time.time() - started) / 60, 1)
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(results, f, indent=1)
    return results


def facts(results: dict[str, Any]) -> dict[str, Any]:
    """What the chapter quotes: per knob and value, the means and tokens/s."""
    knobs = {}
    for knob, r in results["knobs"].items():
        rows = {}
        for c in r["configs"]:
            rows[c["name"]] = {
                "mean_ttft_ms": round(c["mean_ttft_ms"]),
                "p99_ttft_ms": round(c["p99_ttft_ms"]),
                "mean_itl_ms": round(c["mean_itl_ms"], 1),
                "mean_tpot_ms": round(c["mean_tpot_ms"], 1),
                "tok_s": round(c["output_throughput"], 1),
            }
        knobs[knob] = {
            "requests": r["requests"],
            "output_tokens": r["output_tokens"],
            "prompt_tokens_max": max(r["prompt_tokens"]),
            "prompt_tokens_min": min(r["prompt_tokens"]),
            "values": rows,
        }
    return {
        "tuning": {
            "load_before": results["load_before"],
            "load_after": results["load_after"],
            "minutes": results["minutes"],
            "knobs": knobs,
        }
    }


def draw(results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.hashsalt"] = "tracevllm-tuning"
    for knob, r in results["knobs"].items():
        labels = [c["name"] for c in r["configs"]]
        per_token = "mean TPOT" if r["metric"] == "tpot" else "mean ITL"
        panels = [
            ("mean TTFT, ms", [c["mean_ttft_ms"] for c in r["configs"]], "tab:red"),
            (f"{per_token}, ms", [c[f"mean_{r['metric']}_ms"] for c in r["configs"]],
             "tab:green"),
            ("output tokens/s", [c["output_throughput"] for c in r["configs"]], "tab:blue"),
        ]  # fmt: skip
        fig, axes = plt.subplots(1, 3, figsize=(10, 2.6), layout="constrained")
        for ax, (title, values, color) in zip(axes, panels):
            bars = ax.bar(labels, values, color=color, alpha=0.8)
            ax.bar_label(bars, [f"{v:.0f}" if v >= 100 else f"{v:.1f}" for v in values],
                         fontsize=8)  # fmt: skip
            ax.set_title(title, fontsize=9)
            ax.set_xlabel(r["field"], fontsize=8)
            ax.tick_params(labelsize=8)
            ax.set_ylim(0, max(values) * 1.2 or 1)
            ax.grid(True, axis="y", alpha=0.2)
        fig.suptitle(
            f"{knob}: {r['requests']} requests x {r['output_tokens']} tokens ({r['workload']}), "
            "one fresh engine per value",
            fontsize=9,
            x=0.01,
            ha="left",
        )
        path = os.path.join(OUT_DIR, f"tuning-{knob.replace('_', '-')}.svg")
        fig.savefig(path, metadata={"Date": None})
        plt.close(fig)
        print("  wrote", os.path.relpath(path, ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draw-only", action="store_true", help=f"redraw from {RESULTS}")
    options = parser.parse_args()
    if options.draw_only:
        with open(RESULTS) as f:
            results = json.load(f)
    else:
        results = run()
    draw(results)
    with open(FACTS, "w") as f:
        f.write(json.dumps(facts(results), indent=1, sort_keys=True) + "\n")
    print("  wrote", os.path.relpath(FACTS, ROOT))


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()

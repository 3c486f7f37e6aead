"""Record the performance chapter's figures: latency on a real run, the roofline,
and the profile breakdown.

``docs/record_assets.py`` calls ``run()`` and ``draw()`` with the book's other
runs; ``python docs/record_performance.py`` re-records this one alone (and
``--draw-only`` redraws it; ``--measured-only`` redraws only the roofline
and profile from their JSON), updating the ``latency``, ``roofline`` and
``profile`` entries of ``facts.json`` and leaving the other recordings as
they are.

- ``latency``: the same chat prompt, greedy, ``ignore_eos``, 16 tokens, in
  one process with tracing at ``request`` detail, twice: alone, then with 15
  other prompts added before the first step. Each request's ``llm_request``
  span carries its arrival (the span's start), its time to first token and
  the gaps between its tokens: the chapter's timeline and table are drawn
  from them.
- ``roofline``: drawn from ``benchmarks/results/roofline.json``, which
  ``make bench-roofline`` measures (minutes; the book does not re-measure).
- ``profile``: the table of ``benchmarks/results/profile_step.json``, which
  ``python benchmarks/profile_step.py`` measures.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "docs"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import record_assets as assets  # noqa: E402
from bench_throughput import thread_path  # noqa: E402
from recording import external  # noqa: E402

NAME = "latency"
PROMPT = "Explain photosynthesis to a ten-year-old."
OTHERS = [
    "Write a short story about the Roman Empire.",
    "What are three surprising facts about black holes?",
    "Summarize the history of jazz music in a paragraph.",
    "Explain the stock market to a ten-year-old.",
]
MAX_TOKENS = 16
BATCH = 16
RUNS = {"alone": 1, "batched": BATCH}
ROOFLINE_JSON = os.path.join(ROOT, "benchmarks", "results", "roofline.json")
PROFILE_JSON = os.path.join(ROOT, "benchmarks", "results", "profile_step.json")
COMPILE_JSON = os.path.join(ROOT, "benchmarks", "results", "compile.json")
CPU_ATTN_JSON = os.path.join(ROOT, "benchmarks", "results", "cpu_attn.json")


def _prompts(n: int) -> list[str]:
    return [PROMPT] + [f"{OTHERS[i % len(OTHERS)]} ({i})" for i in range(n - 1)]


def run() -> None:
    from tracevllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for run_name, n in RUNS.items():
        out = assets.fresh_run_dir(f"{NAME}-{run_name}")
        print(f"# {NAME}-{run_name}: {n} prompt(s), {MAX_TOKENS} tokens each", flush=True)
        with LLM(enable_multiprocessing=False, trace_detail="request", trace_dir=out) as llm:
            # Warm up untraced work (the first matmuls pay for thread pools).
            llm.chat([[{"role": "user", "content": "Hi"}]], params, use_tqdm=False)
            llm.chat([[{"role": "user", "content": p}] for p in _prompts(n)], params,
                     use_tqdm=False)  # fmt: skip


def _requests(run_name: str) -> dict[str, dict[str, Any]]:
    """req id -> arrival (s), token times (s after arrival), TTFT, ITLs, e2e."""
    spans = assets.load(f"{NAME}-{run_name}")
    out = {}
    for s in spans:
        if s.name != "llm_request":
            continue
        a = s.attributes
        rid = external(a["gen_ai.request.id"])
        if rid == "0":
            continue  # the warm-up
        ttft = a["gen_ai.latency.time_to_first_token"]
        itl = [ms / 1e3 for ms in a["tracevllm.latency.inter_token_ms"]]
        times = [ttft]
        for gap in itl:
            times.append(times[-1] + gap)
        out[rid] = {
            "arrival": s.start_ns / 1e9,
            "times": times,
            "ttft": ttft,
            "itl": itl,
            "e2e": a["gen_ai.latency.e2e"],
            "tpot": (a["gen_ai.latency.e2e"] - ttft) / (MAX_TOKENS - 1),
        }
    return out


def draw_latency() -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.hashsalt"] = "tracevllm-latency"
    runs = {name: _requests(name) for name in RUNS}
    first = {name: min(reqs, key=lambda r: reqs[r]["arrival"]) for name, reqs in runs.items()}
    fig, axes = plt.subplots(2, 1, figsize=(10, 5.2), layout="constrained", sharex=True)
    for ax, (name, reqs) in zip(axes, runs.items()):
        t0 = min(r["arrival"] for r in reqs.values())
        order = sorted(reqs, key=lambda r: reqs[r]["arrival"])
        for row, rid in enumerate(order):
            r = reqs[rid]
            start = (r["arrival"] - t0) * 1e3
            ts = [start + t * 1e3 for t in r["times"]]
            color = "tab:blue" if rid == first[name] else "tab:gray"
            ax.plot([start, ts[-1]], [row, row], color=color, lw=0.6, alpha=0.6)
            ax.plot(ts, [row] * len(ts), "|", color=color, ms=7)
            ax.plot([start], [row], ">", color=color, ms=4)
        r = reqs[first[name]]
        start = (r["arrival"] - t0) * 1e3
        y = -0.9
        ax.annotate("", (start + r["ttft"] * 1e3, y), (start, y),
                    arrowprops={"arrowstyle": "<->", "color": "tab:red"})  # fmt: skip
        ax.text(start + r["ttft"] * 5e2, y - 0.25, f"TTFT {r['ttft'] * 1e3:.0f} ms",
                ha="center", va="top", fontsize=8, color="tab:red")  # fmt: skip
        # The ITL arrow spans every gap, labelled with their mean (one gap
        # alone would say less than the table beside it).
        a, b = r["times"][0], r["times"][-1]
        ax.annotate("", (start + b * 1e3, y), (start + a * 1e3, y),
                    arrowprops={"arrowstyle": "<->", "color": "tab:green"})  # fmt: skip
        ax.text(start + b * 1e3, y - 0.25,
                f" {len(r['itl'])} gaps, mean ITL {statistics.mean(r['itl']) * 1e3:.1f} ms",
                ha="left", va="top", fontsize=8, color="tab:green")  # fmt: skip
        ax.set_ylim(len(order) + 0.2 if len(order) > 1 else 1, -2.2)
        ax.set_yticks(range(len(order)), order if len(order) <= 16 else [""] * len(order),
                      fontsize=6 if len(order) > 4 else 8)  # fmt: skip
        ax.set_ylabel("request")
        total = sum(len(x["times"]) for x in reqs.values())
        span = max((x["arrival"] - t0) + x["e2e"] for x in reqs.values())
        ax.set_title(f"{name}: {len(order)} request(s) x {MAX_TOKENS} tokens, "
                     f"{total / span:.1f} tok/s overall", fontsize=9, loc="left")  # fmt: skip
        ax.grid(True, axis="x", alpha=0.2)
    axes[-1].set_xlabel("ms since the first request arrived  (▸ arrival, | a token reached the "
                        "frontend)")  # fmt: skip
    path = os.path.join(assets.OUT_DIR, "latency-timeline.svg")
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)
    print("  wrote", os.path.relpath(path, ROOT))

    rows = ["| run | requests | TTFT ms | mean ITL ms | TPOT ms | e2e ms | tok/s overall |",
            "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, reqs in runs.items():
        r = reqs[first[name]]
        t0 = min(x["arrival"] for x in reqs.values())
        span = max((x["arrival"] - t0) + x["e2e"] for x in reqs.values())
        total = sum(len(x["times"]) for x in reqs.values())
        rows.append(
            f"| {name} (request {first[name]}) | {len(reqs)} | {r['ttft'] * 1e3:.0f} | "
            f"{statistics.mean(r['itl']) * 1e3:.1f} | {r['tpot'] * 1e3:.1f} | "
            f"{r['e2e'] * 1e3:.0f} | {total / span:.1f} |"
        )
    assets.write_text("latency-table.md", "\n".join(rows) + "\n")
    return {
        "max_tokens": MAX_TOKENS,
        "batch": BATCH,
        "itl_per_request": MAX_TOKENS - 1,
        "prompt": PROMPT,
    }


def draw_roofline() -> dict[str, Any]:
    import roofline  # benchmarks/

    with open(ROOFLINE_JSON) as f:
        res = json.load(f)
    res["analysis"] = roofline.analyse(res)  # from the raw measurements
    roofline.draw(res, [os.path.join(assets.OUT_DIR, "roofline.svg")])
    a = res["analysis"]
    dec = {r["batch"]: r for r in res["engine"]["decode"]}
    pre = res["engine"]["prefill"]
    gpus = a["gpus"]
    return {
        "cpu": res["machine"]["cpu"],
        "threads": res["machine"]["threads"],
        "load": res["machine"]["load_before"],
        "peak_gflops": round(a["peak_gflops"]),
        "square_gflops": round(max(s["gflops"] for s in res["sgemm"]["squares"])),
        "read_gbps": round(a["bw_gbps"], 1),
        "copy_gbps": round(res["bandwidth"]["copy_gbps"], 1),
        "ridge": round(a["ridge"], 1),
        "ridge_batch": a["decode_ridge_batch"],
        "weight_mb": round(res["model"]["weight_bytes"] / 1e6),
        "max_intensity": {
            k.replace(" ", "_"): round(v, 1) for k, v in a["max_decode_intensity"].items()
        },  # fmt: skip
        "kv_kb_per_token": round(res["model"]["kv_bytes_per_token"] / 1e3, 1),
        "decode": {
            str(b): {
                "forward_ms": round(r["forward_s"] * 1e3, 1),
                "bound_ms": round(r["bound_s"] * 1e3, 1),
                "gflops": round(r["gflops"]),
                "gbps": round(r["gbps"], 1),
                "intensity": round(r["intensity"], 1),
                "tok_s": round(r["tok_s"]),
            }
            for b, r in dec.items()
        },
        "prefill_max": {
            "tokens": pre[-1]["tokens"],
            "gflops": round(pre[-1]["gflops"]),
            "forward_ms": round(pre[-1]["forward_s"] * 1e3),
        },
        "gpus": {
            name.replace(" ", "_"): {
                "ridge": round(g["ridge"]),
                "ridge_batch": g["decode_ridge_batch"] or "never",
                "batch1_us": round(g["decode"][0]["bound_s"] * 1e6),
                "batch256_us": round(g["decode"][-1]["bound_s"] * 1e6),
                "batch256_tok_s": round(g["decode"][-1]["tok_s"]),
            }
            for name, g in gpus.items()
        },
    }


def matmul_share(step: dict[str, Any]) -> float:
    """The share of a profiled step's time (profile_step.json's "decode" or
    "prefill") spent in its matmuls."""
    part = next(k for k in step["parts_s"] if k.startswith("matmuls"))
    return step["parts_s"][part] / step["step_s"]


def draw_profile() -> dict[str, Any]:
    with open(PROFILE_JSON) as f:
        res = json.load(f)
    head = f"decode, batch {res['batch']} | % | prefill, {res['prefill_tokens']} tokens"
    rows = [
        f"| part | {head} | % |",
        "|---|---:|---:|---:|---:|",
    ]
    dec, pre = res["decode"], res["prefill"]
    shares = {}
    for part, s in dec["parts_s"].items():
        p = pre["parts_s"][part]
        shares[part] = 100 * s / dec["step_s"]
        rows.append(
            f"| {part} | {s * 1e3:.2f} ms | {100 * s / dec['step_s']:.1f} | "
            f"{p * 1e3:.2f} ms | {100 * p / pre['step_s']:.1f} |"
        )
    rows.append(
        f"| **LLMEngine.step, in process** | **{dec['step_s'] * 1e3:.2f} ms** | 100 | "
        f"**{pre['step_s'] * 1e3:.2f} ms** | 100 |"
    )
    ipc = res["ipc"]
    rows.append(
        f"| + IPC with two processes ({ipc['bytes']} B a step) | {ipc['seconds'] * 1e3:.2f} ms | "
        f"{100 * ipc['seconds'] / dec['step_s']:.2f} | | |"
    )

    def span_cell(d: float, best: float) -> str:
        # A traced step faster than the untraced one: the cost is below the noise.
        if d <= 0:
            return f"below the noise ({d * 1e3:+.1f} ms) | "
        return f"{d * 1e3:+.2f} ms | {100 * d / best:+.1f} of the best"

    # The span rows are best traced step less best untraced step: their share
    # is of the best untraced step, on its own row, not of the mean above.
    rows.append(
        f"| best untraced step (the span rows' 100 %) | {dec['best_step_s'] * 1e3:.2f} ms | "
        f"100 | {pre['best_step_s'] * 1e3:.2f} ms | 100 |"
    )
    for detail in ("request", "full"):
        d, p = res["spans"][detail]["decode"], res["spans"][detail]["prefill"]
        rows.append(
            f"| + spans, `trace_detail={detail}` | {span_cell(d, dec['best_step_s'])} | "
            f"{span_cell(p, pre['best_step_s'])} |"
        )
    assets.write_text("profile-breakdown.md", "\n".join(rows) + "\n")
    ops = ["| operator | calls | self ms | % |", "|---|---:|---:|---:|"]
    for op in res["ops"][:8]:
        ops.append(
            f"| `{op['op']}` | {op['calls']} | {op['self_ms']:.2f} | {100 * op['share']:.1f} |"
        )
    assets.write_text("profile-ops.md", "\n".join(ops) + "\n")
    matmul = next(k for k in shares if k.startswith("matmuls"))
    attn = next(k for k in shares if k.startswith("attention"))
    rest = next(k for k in shares if k.startswith("rest of the forward"))
    return {
        "command": res["command"],
        "threads": res["threads"],
        "load": res["load_before"],
        "batch": res["batch"],
        "prefill_tokens": res["prefill_tokens"],
        "decode_matmul_pct": round(shares[matmul]),
        "decode_attention_pct": round(shares[attn]),
        "decode_outside_forward_pct": round(100 - shares[matmul] - shares[attn] - shares[rest], 1),
        "ipc_us": round(res["ipc"]["seconds"] * 1e6),
        "ipc_bytes": res["ipc"]["bytes"],
        "prefill_matmul_pct": round(100 * matmul_share(pre)),
        "top_op": res["ops"][0]["op"],
        "top_op_pct": round(100 * res["ops"][0]["share"]),
        "op_pct": {op["op"].split("::")[-1]: round(100 * op["share"], 1) for op in res["ops"]},
    }


PERF_FACTS = os.path.join(assets.OUT_DIR, "facts.performance.json")
BENCH_JSON = os.path.join(ROOT, "benchmarks", "results", "bench.json")
TRACING_COST_JSON = os.path.join(ROOT, "benchmarks", "results", "tracing_cost.json")


def bench_facts(res: dict[str, Any]) -> dict[str, Any]:
    """``make bench``'s figures (``res``: benchmarks/results/bench.json), per
    condition: tracevllm's mean tok/s, vLLM's, the ratios, the floor share,
    the cost of tracing; and the run's machine, load and sgemm rate."""
    out: dict[str, Any] = {
        "command": res["command"],
        "cpu": res["machine"]["cpu"],
        "cores": res["machine"]["cores"],
        "load": " ".join(f"{x:.2f}" for x in res["machine"]["load_average_at_start"]),
        "sgemm_gflops": round(res["sgemm"]["gflops"], 1),
        "read_gbps": round(res["bandwidth"]["read_gbps"], 1) if "bandwidth" in res else None,
        "roofline_floor_s": round(res["roofline_floor"]["seconds"], 2)
        if "roofline_floor" in res
        else None,
        "num_prompts": res["workload"]["num_prompts"],
        "requested_tokens": res["workload"]["requested_tokens"],
    }
    if "linears_at_shapes" in res:
        # The matmuls alone at the workload's shapes, and what a 60 % share of
        # the linear floor would leave the rest of an engine: floor / 0.6 - them.
        at_shapes = res["linears_at_shapes"]["seconds"]
        budget = res["floor"]["seconds"] / 0.6
        out["floor_no_cache_s"] = round(res["floor"]["seconds"], 2)
        out["linears_at_shapes_s"] = round(at_shapes, 2)
        out["floor_share_ceiling_pct"] = round(
            100 * res["linears_at_shapes"]["floor_share_ceiling"]
        )
        out["goal3_total_s"] = round(budget, 2)
        out["goal3_rest_s"] = round(budget - at_shapes, 2)
        out["goal3_rest_pct"] = round(100 * (budget - at_shapes) / budget)
    for condition, entry in res["conditions"].items():
        summary = entry["summary"]
        c: dict[str, Any] = {
            "tracevllm_tok_s": round(summary["tracevllm_tok_s"], 1),
            "tracevllm_runs_tok_s": [
                round(r["tok_s"], 1) for r in entry["runs"] if r["key"] == "tracevllm"
            ],
            "floor_share_pct": round(100 * summary["floor_share"]),
            "floor_s": round(summary["floor_s"], 2),
        }
        # Where each tracevllm run's thread count ended ("2 -> 1" when it changed).
        c["tracevllm_runs_threads"] = [
            thread_path(r["threads"])
            for r in entry["runs"]
            if r["key"] == "tracevllm" and r.get("threads")
        ]
        for key in ("vllm_compiled", "vllm_eager", "tracevllm_fixed"):
            if f"{key}_tok_s" in summary:
                c[f"{key}_tok_s"] = round(summary[f"{key}_tok_s"], 1)
                c[f"ratio_vs_{key}"] = round(summary[f"ratio_vs_{key}"], 2)
        if summary.get("roofline_share") is not None:
            c["roofline_share_pct"] = round(100 * summary["roofline_share"])
        compiled = next((r for r in entry["runs"] if r["key"] == "vllm_compiled"), None)
        if compiled is not None:
            c["vllm_compiled_floor_share_pct"] = round(100 * compiled["floor_share"])
            if compiled.get("roofline_s") is not None:
                c["vllm_compiled_roofline_share_pct"] = round(
                    100 * compiled["roofline_s"] / compiled["seconds"]
                )
            c["runs_vs_vllm_compiled"] = [
                round(r["tok_s"] / compiled["tok_s"], 2)
                for r in entry["runs"]
                if r["key"] == "tracevllm"
            ]
        tracing = res.get("tracing", {}).get(condition)
        if tracing:
            # The cost, positive: how much lower than tracing off, in percent.
            rates = tracing["tok_s"]
            c["tracing_cost_pct"] = {d: round(-100 * v, 1) for d, v in tracing["vs_off"].items()}
            c["tracing_cost_rounds_pct"] = {
                d: [round(100 * (1 - r / off), 1) for r, off in zip(rates[d], rates["off"])]
                for d in tracing["vs_off"]
            }
            c["tracing_off_tok_s"] = round(statistics.median(rates["off"]), 1)
        out[condition] = c
    if "tracing" in res:
        out["tracing_rounds"] = res["tracing"]["rounds"]
    return out


def one_thread_lead(
    busy_runs: list[dict[str, Any]], matmuls_share: float, compile_gain: float
) -> dict[str, Any]:
    """What leading vLLM compiled by 1.2x beside a busy process takes.

    Both engines then compute on one thread. Take tracevllm's busy runs'
    mean time, split it as the one-thread profile splits a decode step
    (``matmuls_share`` of it matmuls, an estimate for the whole run), keep
    the matmuls, and see what the rest must shrink to for the run to take
    vLLM compiled's busy time / 1.2. ``busy_runs``: bench.json's busy runs.

    Then a rough estimate of what compiling would add (``compile_gain``:
    compiled over eager beside a busy process, compile.json), taken off the
    whole run."""
    ours = statistics.mean(r["seconds"] for r in busy_runs if r["key"] == "tracevllm")
    vllm = next(r["seconds"] for r in busy_runs if r["key"] == "vllm_compiled")
    target = vllm / 1.2
    matmuls = matmuls_share * ours
    # Rounded first, so that the figures the chapter shows add up as shown.
    ours, vllm, target, matmuls = (round(x, 1) for x in (ours, vllm, target, matmuls))
    compiled = round(ours * (1 - 1 / compile_gain), 1)
    return {
        "tracevllm_s": ours,
        "vllm_compiled_s": vllm,
        "target_s": target,
        "vs_vllm_compiled": round(vllm / ours, 2),
        "matmuls_s": matmuls,
        "rest_s": round(ours - matmuls, 1),
        "rest_target_s": round(target - matmuls, 1),
        "rest_target_pct": round(100 * (target - matmuls) / (ours - matmuls)),
        "compile_gain": round(compile_gain, 2),
        "compile_saves_s": compiled,
        "with_compile_s": round(ours - compiled, 1),
        "with_compile_vs_vllm_compiled": round(vllm / (ours - compiled), 2),
    }


def tracing_cost_facts() -> dict[str, Any]:
    """``make bench-tracing``'s counted shares (benchmarks/results/tracing_cost.json),
    per condition and detail level, in percent of the engine thread's samples."""
    with open(TRACING_COST_JSON) as f:
        res = json.load(f)
    out: dict[str, Any] = {
        "command": res["command"],
        "cpu": res["machine"]["cpu"],
        "load": " ".join(f"{x:.2f}" for x in res["machine"]["load_average_at_start"]),
    }
    for condition in ("quiet", "busy"):
        if condition in res:
            out[condition] = {
                detail: {
                    "tok_s": round(r["tok_s"], 1),
                    "engine_samples": r["samples"].get("engine core", 0),
                    **{
                        f"{key.replace(' ', '_')}_pct": round(100 * r[key], 2)
                        for key in ("engine thread", "all tracing", "frontend", "exporters")
                    },
                }
                for detail, r in res[condition]["results"].items()
            }
    return out


def cpu_attn_facts(res: dict[str, Any]) -> dict[str, Any]:
    """benchmarks/bench_cpu_attn.py's run: the read alone and the engine, by thread count."""
    read = {
        str(r["threads"]): {
            "reference_ms": round(r["reference_ms"], 1),
            "kernel_ms": round(r["kernel_ms"], 1),
            "speedup": round(r["speedup"], 1),
        }
        for r in res["read"]
    }
    engine = {
        str(e["threads"]): {
            "torch_tok_s": round(statistics.mean(e["tok_s"]["torch"]), 1),
            "cpu_attn_tok_s": round(statistics.mean(e["tok_s"]["cpu_attn"]), 1),
            "gain": round(e["gain"], 2),
        }
        for e in res["engine"]
    }
    first = res["read"][0]
    return {
        "machine": res["machine"]["cpu"],
        "batch": first["batch"],
        "mean_len": round(first["mean_len"]),
        "max_abs_diff": f"{max(r['max_abs_diff'] for r in res['read']):.0e}",
        "rounds": res["args"]["rounds"],
        "read": read,
        "engine": engine,
    }


def perf_facts() -> dict[str, Any]:
    """The chapter's comparisons, in facts.performance.json (key ``perf``):
    the latency run's two rows, a step of 16 against a step of 1 in it and in
    the roofline, and the profile's span cost on one basis."""
    # The latency run's rows, as draw_latency wrote them from its spans (so
    # that --measured-only refreshes these without a new run).
    out: dict[str, Any] = {}
    with open(os.path.join(assets.OUT_DIR, "latency-table.md")) as f:
        for line in f.read().splitlines()[2:]:
            cells = [c.strip() for c in line.strip("|").split("|")]
            out[cells[0].split(" ")[0]] = {
                "ttft_ms": int(cells[2]),
                "mean_itl_ms": float(cells[3]),
                "e2e_ms": int(cells[5]),
                "tok_s": float(cells[6]),
            }
    alone, batched = out["alone"], out["batched"]
    out["itl_ratio"] = round(batched["mean_itl_ms"] / alone["mean_itl_ms"], 2)
    out["tok_s_ratio"] = round(batched["tok_s"] / alone["tok_s"], 1)
    with open(ROOFLINE_JSON) as f:
        dec = {r["batch"]: r for r in json.load(f)["engine"]["decode"]}
    out["roofline_16_over_1"] = round(dec[16]["forward_s"] / dec[1]["forward_s"], 2)
    import roofline  # benchmarks/: the published GPU peaks its arithmetic uses

    out["gpu_specs"] = {name.replace(" ", "_"): spec for name, spec in roofline.GPUS.items()}
    with open(PROFILE_JSON) as f:
        prof = json.load(f)
    best = prof["decode"]["best_step_s"]
    out["profile"] = {
        "step_ms": round(prof["decode"]["step_s"] * 1e3, 2),
        "best_step_ms": round(best * 1e3, 2),
        "request_spans_ms": round(prof["spans"]["request"]["decode"] * 1e3, 2),
        "request_spans_pct_of_best": round(100 * prof["spans"]["request"]["decode"] / best, 1),
    }
    if os.path.exists(BENCH_JSON):
        with open(BENCH_JSON) as f:
            bench = json.load(f)
        out["bench"] = bench_facts(bench)
        busy_runs = bench["conditions"]["busy"]["runs"]
        with open(COMPILE_JSON) as f:
            compile_gain = json.load(f)["compiled_over_eager"]["busy"]
        decode_matmuls = matmul_share(prof["decode"])
        out["one_thread_lead"] = one_thread_lead(busy_runs, decode_matmuls, compile_gain)
    if os.path.exists(TRACING_COST_JSON):
        out["tracing_cost"] = tracing_cost_facts()
    if os.path.exists(CPU_ATTN_JSON):
        with open(CPU_ATTN_JSON) as f:
            out["cpu_attn"] = cpu_attn_facts(json.load(f))
    with open(PERF_FACTS, "w") as f:
        f.write(json.dumps({"perf": out}, indent=1, sort_keys=True) + "\n")
    print("  wrote", os.path.relpath(PERF_FACTS, ROOT))
    return out


def draw() -> dict[str, Any]:
    facts = draw_latency()
    perf_facts()
    return facts


def draw_measured() -> dict[str, dict[str, Any]]:
    """The two drawn from committed benchmark results (no run needed)."""
    facts = {"roofline": draw_roofline(), "profile": draw_profile()}
    perf_facts()
    return facts


def main() -> None:
    assets.rerecord_alone(__doc__, NAME, run, draw, draw_measured)


if __name__ == "__main__":
    main()

"""Record the book's terminal views and tables from real runs of the engine.

``make docs-assets`` runs this. It runs three small workloads with tracing on,
then draws the views the book shows from their ``spans.jsonl`` (through the
same renderers as ``tracevllm view``) and writes them to
``docs/assets/recorded/``:

- ``single``: ``tracevllm trace`` on one chat prompt, two processes over
  ZeroMQ (the map and the entry chapters).
- ``batch``: three chat prompts, one process, a 32-token budget: chunked
  prefill, prefix hits on the shared system prompt, and a step where prefill
  and decode share the batch (scheduling, input preparation).
- ``preempt``: two chat prompts in a KV cache of 7 usable blocks: a
  preemption, then the resumed request's prefix hits (the KV cache chapter).

The ``batch`` and ``preempt`` runs are in one process so that every request
is added before the first step: their step composition does not depend on
timing, and each re-recording gives the same block ids and slot mappings.
Only the timings change.

    .venv/bin/python docs/record_assets.py            # run the engine, then draw
    .venv/bin/python docs/record_assets.py --draw-only  # re-draw from traces/docs/
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from rich.console import Console, RenderableType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tracevllm.tracing.exporters import SpanRecord, read_spans_jsonl  # noqa: E402
from tracevllm.views.completion import render_completion  # noqa: E402
from tracevllm.views.step import render_step  # noqa: E402
from tracevllm.views.waterfall import render_waterfall  # noqa: E402

RUNS_DIR = os.path.join(ROOT, "traces", "docs")
OUT_DIR = os.path.join(ROOT, "docs", "assets", "recorded")
SINGLE_PROMPT = "What is the capital of France?"
BATCH_PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Why is the sky blue?",
]


# ----------------------------------------------------------------- the runs
def run_single() -> None:
    """Two processes, exactly what a reader gets from ``make trace``."""
    out = os.path.join(RUNS_DIR, "single")
    cmd = [
        os.path.join(ROOT, ".venv", "bin", "tracevllm"),
        "trace",
        "--prompt",
        SINGLE_PROMPT,
        "--max-tokens",
        "24",
        "--out",
        out,
    ]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)


def _run_in_process(name: str, prompts: list[str], max_tokens: int, **engine_kwargs: Any) -> None:
    from tracevllm import LLM, SamplingParams

    out = os.path.join(RUNS_DIR, name)
    os.makedirs(out, exist_ok=True)
    spans_path = os.path.join(out, "spans.jsonl")
    if os.path.exists(spans_path):
        os.remove(spans_path)
    print(f"# {name}: {len(prompts)} prompts, {engine_kwargs}", flush=True)
    # ignore_eos: every request runs to max_tokens, so the steps are the same each run.
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(
        enable_multiprocessing=False,
        trace_detail="request",
        trace_dir=out,
        **engine_kwargs,
    ) as llm:
        conversations = [[{"role": "user", "content": p}] for p in prompts]
        outputs = llm.chat(conversations, params, use_tqdm=False)
    for o in outputs:
        print(f"  {o.request_id}: {o.outputs[0].text!r}")


def run_batch() -> None:
    _run_in_process("batch", BATCH_PROMPTS, max_tokens=4, max_num_batched_tokens=32)


def run_preempt() -> None:
    _run_in_process(
        "preempt", BATCH_PROMPTS[:2], max_tokens=40, num_gpu_blocks_override=8, block_size=16
    )


# ---------------------------------------------------------------- drawing
_FONT_FACE = re.compile(r"@font-face\s*\{[^}]*\}")


def save_svg(name: str, renderable: RenderableType, title: str, width: int = 120) -> None:
    """Record one renderable as an SVG. Rich's SVG names web fonts on a CDN;
    they are dropped so that the book never reaches outside (a local monospace
    font draws it)."""
    console = Console(record=True, width=width, file=io.StringIO(), color_system="truecolor")
    console.print(renderable)
    svg = console.export_svg(title=title)
    svg = _FONT_FACE.sub("", svg)
    assert not re.search(r"url\(\W*http", svg), "external URL left in SVG"
    with open(os.path.join(OUT_DIR, name), "w") as f:
        f.write(svg)
    print("  wrote", os.path.relpath(os.path.join(OUT_DIR, name), ROOT))


def load(name: str) -> list[SpanRecord]:
    path = os.path.join(RUNS_DIR, name, "spans.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"{path} is missing: run without --draw-only first")
    return read_spans_jsonl(path)


def steps_of(spans: list[SpanRecord]) -> dict[int, dict[str, SpanRecord]]:
    """step id -> {span name: span} for the spans under each EngineCore.step."""
    children: dict[str, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        if s.parent_span_id:
            children[s.parent_span_id].append(s)
    steps: dict[int, dict[str, SpanRecord]] = {}
    for step in (s for s in spans if s.name == "EngineCore.step"):
        found: dict[str, SpanRecord] = {"EngineCore.step": step}
        stack = list(children[step.span_id])
        while stack:
            s = stack.pop()
            found.setdefault(s.name, s)
            stack.extend(children[s.span_id])
        if "Scheduler.schedule" in found:
            steps[int(found["Scheduler.schedule"].attributes["tracevllm.step_id"])] = found
    return steps


def step_view(step: dict[str, SpanRecord]) -> dict[str, Any]:
    return json.loads(step["Scheduler.schedule"].attributes["tracevllm.view.step"])


def prepared_inputs_table(steps: dict[int, dict[str, SpanRecord]], ids: list[int]) -> str:
    """The runner's flat batch for some steps, as a markdown table."""
    fields = [
        ("tracevllm.req_ids", "req_ids (batch rows)"),
        ("tracevllm.num_scheduled_tokens", "num_scheduled_tokens"),
        ("tracevllm.block_table", "block_table rows"),
        ("tracevllm.positions", "positions"),
        ("tracevllm.query_start_loc", "query_start_loc"),
        ("tracevllm.seq_lens", "seq_lens"),
        ("tracevllm.slot_mapping", "slot_mapping"),
        ("tracevllm.logits_indices", "logits_indices"),
    ]
    lines = ["| | " + " | ".join(f"step {i}" for i in ids) + " |"]
    lines.append("|---|" + "---|" * len(ids))
    for key, label in fields:
        cells = []
        for i in ids:
            attrs = steps[i]["ModelRunner._prepare_inputs"].attributes
            if key not in attrs:
                raise SystemExit(f"ModelRunner._prepare_inputs has no {key} any more")
            cells.append(_compact(attrs[key]))
        lines.append(f"| `{label}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _compact(value: Any) -> str:
    """A list as `[a b c]`, runs of four or more consecutive ints folded (`16…52`)."""
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        parts: list[str] = []
        start = prev = value[0]
        for v in [*value[1:], None]:
            if v is not None and v == prev + 1:
                prev = v
                continue
            if prev - start >= 3:
                parts.append(f"{start}…{prev}")
            else:
                parts.extend(str(x) for x in range(start, prev + 1))
            if v is not None:
                start = prev = v
        return "`[" + " ".join(parts) + "]`"
    if isinstance(value, list):
        return "<br>".join(f"`{v}`" for v in value)
    return f"`{value}`"


def schedule_table(steps: dict[int, dict[str, SpanRecord]]) -> str:
    """Every step of a run: which requests, how many tokens each, and why."""
    lines = [
        "| step | request: computed + scheduled / tokens (kind) | budget | "
        "KV blocks used / free | preempted |",
        "|---|---|---|---|---|",
    ]
    for i in sorted(steps):
        view = step_view(steps[i])
        reqs = []
        for r in view["requests"]:
            # A request admitted this step (new or resumed) had computed nothing
            # before: what it starts with is its prefix-cache hit.
            hit = ""
            if r["kind"] != "cached" and r["num_computed_tokens"]:
                hit = f", hit {r['num_computed_tokens']}"
            reqs.append(
                f"{r['req_id']}: {r['num_computed_tokens']} + {r['num_scheduled_tokens']}"
                f" / {r['num_tokens']} ({r['kind']}{hit})"
            )
        kv = view["kv"]
        lines.append(
            f"| {i} | {'<br>'.join(reqs) or '—'} | "
            f"{view['token_budget']['used']}/{view['token_budget']['total']} | "
            f"{kv['used']} / {kv['free']} | {', '.join(view['preempted']) or ''} |"
        )
    return "\n".join(lines) + "\n"


def write_text(name: str, text: str) -> None:
    with open(os.path.join(OUT_DIR, name), "w") as f:
        f.write(text)
    print("  wrote", os.path.relpath(os.path.join(OUT_DIR, name), ROOT))


def _first(steps: dict[int, dict[str, SpanRecord]], pred: Callable[[dict[str, Any]], bool]) -> int:
    for i in sorted(steps):
        if pred(step_view(steps[i])):
            return i
    raise SystemExit("no recorded step matches: did the workload change?")


def draw_single() -> None:
    spans = load("single")
    steps = steps_of(spans)
    save_svg("single-waterfall.svg", render_waterfall(spans, width=40), "one request", 150)
    request = next(s for s in spans if s.name == "llm_request")
    save_svg("single-completion.svg", render_completion(request.attributes), "llm_request", 100)
    pid = steps[1]["Scheduler.schedule"].pid
    save_svg("single-step-1.svg", render_step(step_view(steps[1]), pid), "prefill step", 100)
    save_svg("single-step-2.svg", render_step(step_view(steps[2]), pid), "decode step", 100)
    write_text("single-schedule.md", schedule_table(steps))
    write_text("single-prepare-inputs.md", prepared_inputs_table(steps, [1, 2]))
    # The request's span tree, names and processes only (stable from run to run).
    kinds = {s.span_id: s for s in spans}
    rows = ["| span | process | parent |", "|---|---|---|"]
    for s in spans:
        if s.name in (
            "LLMEngine.step",
            "SyncMPClient.get_output",
            "OutputProcessor.process_outputs",
        ):
            continue  # one per step: the step spans show them
        parent = kinds.get(s.parent_span_id or "")
        per_step = s.name.startswith(("ModelRunner", "Scheduler", "Sampler", "LlamaFor")) or (
            s.name in ("reshape_and_cache_flash", "unified_attention", "EngineCore.step")
        )
        if per_step and steps[1]["EngineCore.step"].span_id not in _ancestors(s, kinds):
            continue  # only the first step's
        rows.append(f"| `{s.name}` | {s.process_kind} | {f'`{parent.name}`' if parent else '—'} |")
    write_text("single-spans.md", "\n".join(rows) + "\n")


def _ancestors(span: SpanRecord, by_id: dict[str, SpanRecord]) -> set[str]:
    out = {span.span_id}
    while span.parent_span_id and span.parent_span_id in by_id:
        span = by_id[span.parent_span_id]
        out.add(span.span_id)
    return out


def draw_batch() -> None:
    spans = load("batch")
    steps = steps_of(spans)
    write_text("batch-schedule.md", schedule_table(steps))
    mixed = _first(
        steps,
        lambda v: (
            {r["num_computed_tokens"] >= r["num_prompt_tokens"] for r in v["requests"]}
            == {True, False}
        ),
    )
    for i in sorted({1, 2, mixed}):
        save_svg(f"batch-step-{i}.svg", render_step(step_view(steps[i])), f"step {i}", 100)
    write_text("batch-prepare-inputs.md", prepared_inputs_table(steps, sorted({2, mixed})))
    write_text("batch-mixed-step.txt", f"{mixed}\n")


def draw_preempt() -> None:
    spans = load("preempt")
    steps = steps_of(spans)
    write_text("preempt-schedule.md", schedule_table(steps))
    pre = _first(steps, lambda v: bool(v["preempted"]))
    resumed = _first(steps, lambda v: any(r["kind"] == "resumed" for r in v["requests"]))
    for i in (pre - 1, pre, resumed):
        save_svg(f"preempt-step-{i}.svg", render_step(step_view(steps[i])), f"step {i}", 100)
    write_text("preempt-steps.txt", f"{pre} {resumed}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draw-only", action="store_true", help="re-draw from traces/docs/")
    args = parser.parse_args()
    # Start empty: a view the book still names but no run drew breaks the build.
    shutil.rmtree(OUT_DIR, ignore_errors=True)
    os.makedirs(OUT_DIR)
    if not args.draw_only:
        run_single()
        run_batch()
        run_preempt()
    draw_single()
    draw_batch()
    draw_preempt()


if __name__ == "__main__":
    main()

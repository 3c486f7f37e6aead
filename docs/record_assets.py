"""Record the book's terminal views and tables from real runs of the engine.

``make docs-assets`` runs this. It runs three small workloads with tracing on,
then draws the views the book shows from their ``spans.jsonl`` (through the
same renderers as ``tracevllm view``) and writes them to
``docs/assets/recorded/``:

- ``single``: ``tracevllm trace`` on one chat prompt, two processes over
  ZeroMQ (the map and the entry chapters).
- ``serve``: ``tracevllm trace --serve``, the same prompt through the
  OpenAI server: client, API server and engine core (the serving chapter).
- ``batch``: three chat prompts, one process, a 32-token budget: chunked
  prefill, prefix hits on the shared system prompt, and a step where prefill
  and decode share the batch (scheduling, input preparation).
- ``preempt``: two chat prompts in a KV cache of 7 usable blocks: a
  preemption, then the resumed request's prefix hits (the KV cache chapter).
- ``structured``: a JSON-schema request beside a plain one, one process
  (the structured-outputs chapter; docs/record_structured.py, which also
  re-records it alone).
- ``spec``: n-gram speculative decoding, a copy prompt beside a question,
  one process (the speculative-decoding chapter; docs/record_spec.py, which
  also re-records it alone).
- ``parallel``: ``tracevllm trace -tp 2 --detail full`` on a tiny Llama: every
  rank's collectives in one trace (the scaling-out chapter;
  docs/record_parallel.py, which also re-records it alone).
- ``moe``: no run, the MoE router's functions on seeded logits (the
  model-families chapter; docs/record_moe.py, which also redraws it alone).

Beside the views it writes ``facts.json``, the figures the prose quotes
(checked at build time by docs/hooks/recorded.py), and the diagrams of
docs/diagrams.py, drawn from the same spans. It empties the folder first,
except for what docs/record_tuning.py (``make docs-tuning``, minutes of
sweeps that this run does not redo) wrote there: its ``OUTPUTS``.

The ``batch`` and ``preempt`` runs are in one process so that every request
is added before the first step: their step composition does not depend on
timing, and each re-recording gives the same block ids and slot mappings.
Only the timings change.

    .venv/bin/python docs/record_assets.py            # run the engine, then draw
    .venv/bin/python docs/record_assets.py --draw-only  # re-draw from traces/docs/
    .venv/bin/python docs/record_assets.py --only serve  # one run (or more) alone
"""

from __future__ import annotations

import argparse
import fnmatch
import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Console, RenderableType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "docs"))

import diagrams  # noqa: E402  (docs/, beside this file)
import diagrams_cache  # noqa: E402
from recording import (  # noqa: E402
    Steps,
    first_step,
    fold_ints,
    prepared_inputs_table,
    request_tokens,
    schedule_table,
    step_facts,
    step_view,
    steps_of,
)

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


def run_serve() -> None:
    """Three processes: what ``make trace-serve`` gives (the serving chapter)."""
    out = os.path.join(RUNS_DIR, "serve")
    cmd = [os.path.join(ROOT, ".venv", "bin", "tracevllm"), "trace", "--serve",
           "--prompt", SINGLE_PROMPT, "--max-tokens", "24", "--out", out]  # fmt: skip
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)


def fresh_run_dir(name: str) -> str:
    """traces/docs/<name>/, made if missing, without the spans of an earlier
    run (the exporter appends, so two runs would mix their steps)."""
    out = os.path.join(RUNS_DIR, name)
    os.makedirs(out, exist_ok=True)
    spans_path = os.path.join(out, "spans.jsonl")
    if os.path.exists(spans_path):
        os.remove(spans_path)
    return out


def _run_in_process(name: str, prompts: list[str], max_tokens: int, **engine_kwargs: Any) -> None:
    """One process, every request added before the first step."""
    from tracevllm import LLM, SamplingParams

    out = fresh_run_dir(name)
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


BATCH = {"max_tokens": 4, "max_num_batched_tokens": 32}
# max_model_len: what 8 blocks of 16 tokens hold (a smaller pool refuses to start).
PREEMPT = {"max_tokens": 40, "num_gpu_blocks_override": 8, "block_size": 16, "max_model_len": 128}


def run_batch() -> None:
    _run_in_process("batch", BATCH_PROMPTS, **BATCH)  # type: ignore[arg-type]


def run_preempt() -> None:
    _run_in_process("preempt", BATCH_PROMPTS[:2], **PREEMPT)  # type: ignore[arg-type]
    # The same pool with the model's own max_model_len: the start-up check
    # refuses it, and says what would fit (the KV cache chapter quotes it).
    from tracevllm import LLM

    kwargs = {k: v for k, v in PREEMPT.items() if k not in ("max_tokens", "max_model_len")}
    try:
        LLM(enable_multiprocessing=False, **kwargs)  # type: ignore[arg-type]
    except ValueError as e:
        message = str(e)
    else:
        raise SystemExit("a pool of 8 blocks started with the model's max_model_len")
    with open(os.path.join(RUNS_DIR, "preempt", "refusal.txt"), "w") as f:
        f.write(message + "\n")


# ---------------------------------------------------------------- drawing
_FONT_FACE = re.compile(r"@font-face\s*\{[^}]*\}")


def save_svg(name: str, renderable: RenderableType, title: str, width: int = 100) -> None:
    """Record one renderable as an SVG, ``width`` terminal columns wide. Rich's
    SVG names web fonts on a CDN; they are dropped so that the book never
    reaches outside (a local monospace font draws it)."""
    console = Console(record=True, width=width, file=io.StringIO(), color_system="truecolor")
    console.print(renderable)
    svg = console.export_svg(title=title)
    svg = _FONT_FACE.sub("", svg)
    assert not re.search(r"url\(\W*http", svg), "external URL left in SVG"
    write_text(name, svg)


def write_text(name: str, text: str) -> None:
    with open(os.path.join(OUT_DIR, name), "w") as f:
        f.write(text)
    print("  wrote", os.path.relpath(os.path.join(OUT_DIR, name), ROOT))


def rerecord_alone(
    doc: str,
    name: str,
    run: Callable[[], None],
    draw: Callable[[], dict[str, Any]],
    measured: Callable[[], dict[str, Any]] | None = None,
) -> None:
    """The main of a docs/record_<name>.py: re-record (or with --draw-only
    redraw) that one run and update its entry of facts.json, leaving the
    other recordings as they are. ``measured`` adds entries drawn from
    committed benchmark results."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--draw-only", action="store_true", help="re-draw from traces/docs/")
    if measured is not None:
        parser.add_argument(
            "--measured-only",
            action="store_true",
            help="only re-draw what comes from benchmarks/results/ (no recorded run needed)",
        )
    args = parser.parse_args()
    measured_only = getattr(args, "measured_only", False)
    if not (args.draw_only or measured_only):
        run()
    with open(os.path.join(OUT_DIR, "facts.json")) as f:
        facts = json.load(f)
    if not measured_only:
        facts[name] = draw()
    if measured is not None:
        facts |= measured()
    write_text("facts.json", json.dumps(facts, indent=1, sort_keys=True) + "\n")


def load(name: str) -> list[SpanRecord]:
    path = os.path.join(RUNS_DIR, name, "spans.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"{path} is missing: run without --draw-only first")
    return read_spans_jsonl(path)


def draw_serve() -> dict[str, Any]:
    spans = load("serve")
    steps = [s for s in spans if s.name == "EngineCore.step"]
    # Every step on its own line, its spans folded (the single-request
    # waterfall opens one): the figure shows each step the prose counts and
    # the output the frontend processed after it.
    waterfall = render_waterfall(
        spans, max_rows=80, max_same_name=len(steps), collapse=frozenset({"EngineCore.step"})
    )
    assert not any(row.name.startswith("… ") and "more" in row.name for row in waterfall.rows)
    save_svg("serve-waterfall.svg", waterfall, "trace-serve", 80)
    by_name: dict[str, SpanRecord] = {}
    for span in spans:
        by_name.setdefault(span.name, span)
    assert {"openai.chat.completions.create", "OpenAIServingChat.create_chat_completion"} <= set(
        by_name
    )
    request = by_name["llm_request"]
    ran = [
        s
        for s in spans
        if s.name == "Scheduler.schedule" and s.attributes["tracevllm.num_scheduled_tokens"]
    ]
    return {
        "processes": len({s.pid for s in spans}),
        "trace_ids": len({s.trace_id for s in spans}),
        "steps": len(steps),
        "model_steps": len(ran),
        "empty_steps": len(steps) - len(ran),
        "outputs": sum(1 for s in spans if s.name == "OutputProcessor.process_outputs"),
        "output_tokens": request.attributes["gen_ai.usage.output_tokens"],
        "finish_reason": request.attributes["gen_ai.response.finish_reasons"][0],
    }


def draw_single() -> dict[str, Any]:
    spans = load("single")
    steps = steps_of(spans)
    # 80 columns: what a reader's terminal shows, and legible in the book.
    save_svg("single-waterfall.svg", render_waterfall(spans), "one request", 80)
    request = next(s for s in spans if s.name == "llm_request")
    save_svg("single-completion.svg", render_completion(request.attributes), "llm_request")
    pid = steps[1]["Scheduler.schedule"].pid
    save_svg("single-step-1.svg", render_step(step_view(steps[1]), pid), "prefill step")
    save_svg("single-step-2.svg", render_step(step_view(steps[2]), pid), "decode step")
    write_text("single-schedule.md", schedule_table(steps))
    write_text("single-prepare-inputs.md", prepared_inputs_table(steps, [1, 2]))
    write_text("single-spans.md", span_table(spans, steps))
    facts = step_facts(steps)
    prefill, decode = facts["1"], facts["2"]
    shape = steps[1]["reshape_and_cache_flash"].attributes["tracevllm.kv_cache_shape"]
    write_text(
        "kv-layout.svg",
        diagrams.kv_layout(
            prefill["requests"]["0"]["blocks"],
            PREEMPT["block_size"],
            decode["requests"]["0"]["after"],
            decode["slot_mapping"][0],
            shape,
        ),
    )
    return {
        "steps": facts,
        "num_steps": len(steps),
        "last_step": max(steps),
        "prompt_tokens": prefill["num_tokens"],
        "output_tokens": request.attributes["gen_ai.usage.output_tokens"],
        "text": request.attributes.get("tracevllm.completion.text", ""),
        "blocks": prefill["requests"]["0"]["blocks"],
        "prefill_slots": fold_ints(prefill["slot_mapping"]),
        "decode_slot": decode["slot_mapping"][0],
        "decode_row": decode["slot_mapping"][0] % PREEMPT["block_size"],
        "prefill_last_rows": prefill["num_tokens"] % PREEMPT["block_size"],
        "kv_cache_shape": shape,
        "usable_blocks": prefill["kv"]["used"] + prefill["kv"]["free"],
    }


def span_table(spans: list[SpanRecord], steps: Steps) -> str:
    """The request's span tree, names and processes only (stable from run to run)."""
    by_id = {s.span_id: s for s in spans}
    rows = ["| span | process | parent |", "|---|---|---|"]
    for s in spans:
        if s.name in (
            "LLMEngine.step",
            "SyncMPClient.get_output",
            "OutputProcessor.process_outputs",
        ):
            continue  # one per step: the step spans show them
        parent = by_id.get(s.parent_span_id or "")
        per_step = s.name.startswith(("ModelRunner", "Scheduler", "Sampler", "LlamaFor")) or (
            s.name in ("reshape_and_cache_flash", "unified_attention", "EngineCore.step")
        )
        if per_step and steps[1]["EngineCore.step"].span_id not in _ancestors(s, by_id):
            continue  # only the first step's
        rows.append(f"| `{s.name}` | {s.process_kind} | {f'`{parent.name}`' if parent else '—'} |")
    return "\n".join(rows) + "\n"


def _ancestors(span: SpanRecord, by_id: dict[str, SpanRecord]) -> set[str]:
    out = {span.span_id}
    while span.parent_span_id and span.parent_span_id in by_id:
        span = by_id[span.parent_span_id]
        out.add(span.span_id)
    return out


def _what(r: dict[str, Any]) -> str:
    if r["computed"] >= r["prompt"]:
        return "decode"
    return "prompt" if r["after"] >= r["prompt"] else "prompt (chunk)"


def draw_batch() -> dict[str, Any]:
    steps = steps_of(load("batch"))
    write_text("batch-schedule.md", schedule_table(steps))
    facts = step_facts(steps)
    mixed = first_step(
        steps,
        lambda v: (
            {r["num_computed_tokens"] >= r["num_prompt_tokens"] for r in v["requests"]}
            == {True, False}
        ),
    )
    for i in sorted({1, 2, mixed}):
        save_svg(f"batch-step-{i}.svg", render_step(step_view(steps[i])), f"step {i}")
    write_text("batch-prepare-inputs.md", prepared_inputs_table(steps, sorted({2, mixed})))
    budget = BATCH["max_num_batched_tokens"]
    timeline = [
        (int(i), [(r, f["scheduled"], _what(f)) for r, f in step["requests"].items()])
        for i, step in facts.items()
    ]
    write_text("batch-timeline.svg", diagrams.budget_timeline(timeline, budget))
    at = facts[str(mixed)]
    tables = [(r, f["blocks"]) for r, f in at["requests"].items()]
    ref_cnt = {int(b): n for b, n in at["ref_cnt"].items()}
    write_text(
        "batch-shared-blocks.svg",
        diagrams.block_sharing(tables, ref_cnt, f"Block tables at step {mixed}"),
    )
    chunk = next(r for r in at["requests"].values() if r["computed"] < r["prompt"])
    write_text("batch-causal-mask.svg", diagrams.causal_mask(chunk["scheduled"], chunk["after"]))
    shared = max(ref_cnt, key=lambda b: ref_cnt[b])
    admitted = facts["2"]["requests"]
    walk = draw_tile_walk(facts, mixed)
    at_mixed = facts[str(mixed)]
    hashes = draw_hash_chain(steps, facts)
    regions = draw_slot_regions(steps, facts)
    return {
        "walk": walk,
        # Request 0's read at the mixed step: its blocks' key positions, the
        # valid rows of its last block, and the positions seq_lens masks.
        "read0": {
            "covered": at_mixed["requests"]["0"]["num_blocks"] * PREEMPT["block_size"],
            "last_rows": at_mixed["requests"]["0"]["after"]
            - (at_mixed["requests"]["0"]["num_blocks"] - 1) * PREEMPT["block_size"],
            "masked": at_mixed["requests"]["0"]["num_blocks"] * PREEMPT["block_size"]
            - at_mixed["requests"]["0"]["after"],
        },
        "hashes": hashes,
        "regions": regions,
        "steps": facts,
        "budget": budget,
        "max_tokens": BATCH["max_tokens"],
        "prompt_tokens": [facts["1"]["requests"]["0"]["prompt"]]
        + [admitted[r]["prompt"] for r in sorted(admitted) if r != "0"],
        "hit": admitted["1"]["computed"],
        "mixed_step": mixed,
        "shared_block": shared,
        "shared_ref_cnt": ref_cnt[shared],
        "last_step": max(steps),
    }


def draw_tile_walk(facts: dict[str, Any], step: int) -> dict[str, Any]:
    """How kernel_unified_attention's programs walk the block table of the
    mixed step: a decode and a prefill chunk, query blocks of BLOCK_Q tokens,
    keys TILE_SIZE at a time (the kernel's own arithmetic:
    kernels/unified_attention.py, BLOCK_M/BLOCK_Q and the 2D launch's tile)."""
    from tracevllm.model_executor.model_loader import resolve_model

    with open(os.path.join(resolve_model(None), "config.json")) as f:
        config = json.load(f)
    per_kv = config["num_attention_heads"] // config["num_key_value_heads"]
    block_m = max(16, 1 << (per_kv - 1).bit_length())
    block_q = block_m // per_kv
    tile_size = 32  # the 2D launch's (a step with a prefill chunk)
    at = facts[str(step)]
    programs, shown = [], []
    # The first request's decode, and the first and last query blocks of the chunk.
    decode = next(r for r, req in at["requests"].items() if req["scheduled"] == 1)
    chunk = next(r for r, req in at["requests"].items() if req["scheduled"] > 1)
    for r in (decode, chunk):
        req = at["requests"][r]
        first_pos, q = req["computed"], req["scheduled"]
        blocks = list(range(-(-q // block_q)))
        for b in sorted({blocks[0], blocks[-1]}):
            lo = first_pos + b * block_q
            hi = min(first_pos + q, lo + block_q) - 1
            kind = "decode" if q == 1 else f"prefill chunk, query block {b} of {len(blocks)}"
            programs.append((f"request {r} ({kind}): queries at {lo}…{hi}", lo, hi, req["blocks"]))
            shown.append({"req": r, "first": lo, "last": hi, "tiles": -(-(hi + 1) // tile_size)})
    write_text(
        "paged-tile-walk.svg", diagrams_cache.tile_walk(programs, PREEMPT["block_size"], tile_size)
    )
    return {"block_q": block_q, "tile_size": tile_size, "programs": shown}


def _prompt(steps: Steps, facts: dict[str, Any], req: str, donor: str) -> list[int]:
    """Request ``req``'s prompt token ids, from the steps that ran it; the
    positions its prefix hit skipped hold the ``donor``'s tokens (that is
    what the hit means)."""
    seq = request_tokens(steps, req)
    donor_seq = request_tokens(steps, donor)
    num = facts["1" if req == "0" else "2"]["requests"][req]["prompt"]
    return [seq[p] if p in seq else donor_seq[p] for p in range(num)]


def _hex(block_hash: bytes) -> str:
    return bytes(block_hash).hex()[:8]


def draw_hash_chain(steps: Steps, facts: dict[str, Any]) -> dict[str, Any]:
    """The batch run's first two requests: each full block's hash, computed
    by the engine's own hash_block_tokens from the recorded token ids."""
    from transformers import AutoTokenizer

    from tracevllm.core import kv_cache_utils
    from tracevllm.model_executor.model_loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    block_size = PREEMPT["block_size"]
    rows, out = [], {}
    for req in ("0", "1"):
        prompt = _prompt(steps, facts, req, "0")
        blocks_of = facts[str(max(steps))]["requests"].get(req) or facts["2"]["requests"][req]
        parent, chain = None, []
        for j in range(len(prompt) // block_size):
            tokens = prompt[j * block_size : (j + 1) * block_size]
            h = kv_cache_utils.hash_block_tokens(kv_cache_utils.sha256, parent, tokens)
            text = json.dumps(tokenizer.decode(tokens), ensure_ascii=False)
            text = text if len(text) <= 30 else text[:29] + "…"
            shown_parent = _hex(parent or kv_cache_utils.NONE_HASH)
            chain.append((text, shown_parent, _hex(h), blocks_of["blocks"][j]))
            parent = h
        rest = len(prompt) % block_size
        rows.append((req, chain, f"+ {rest} tokens in a partial block: no hash"))
        out[req] = {"hashes": [c[2] for c in chain], "partial": rest, "prompt": len(prompt)}
    # The engine found a prefix hit of one block: the hashes must say so.
    hit = facts["2"]["requests"]["1"]["computed"] >= block_size
    assert (out["1"]["hashes"][0] == out["0"]["hashes"][0]) == hit, out
    write_text("kv-hash-chain.svg", diagrams_cache.hash_chain(rows, _hex(kv_cache_utils.NONE_HASH)))
    out["none_hash"] = _hex(kv_cache_utils.NONE_HASH)
    return out


def draw_slot_regions(steps: Steps, facts: dict[str, Any]) -> dict[str, Any]:
    """Two real calls of KVCacheManager.allocate_slots on the batch run's
    token ids, as the scheduler makes them with a draft model of k = 4
    (num_lookahead_tokens = 4): request 1's admission (a prefix hit on
    request 0's first block), then its next step (one token and 4 drafts)."""
    from tracevllm.core.kv_cache_manager import KVCacheManager
    from tracevllm.core.kv_cache_utils import get_request_block_hasher, sha256
    from tracevllm.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from tracevllm.request import Request
    from tracevllm.sampling_params import SamplingParams

    block_size, k = PREEMPT["block_size"], 4
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32")
    config = KVCacheConfig(16, [], [KVCacheGroupSpec(["layer"], spec)])
    manager = KVCacheManager(config, max_model_len=256, hash_block_size=block_size)

    def request(req: str) -> Request:
        params = SamplingParams(max_tokens=4, temperature=0)
        params.update_from_generation_config({}, 2)
        prompt = _prompt(steps, facts, req, "0")
        hasher = get_request_block_hasher(block_size, sha256)
        return Request(req, prompt, params, block_hasher=hasher)

    first, second = request("0"), request("1")
    blocks = manager.allocate_slots(first, first.num_tokens)
    assert blocks is not None
    first.num_computed_tokens = first.num_tokens
    calls, out = [], []
    # The admission: the hit, then the rest of the prompt and k slots ahead.
    hit_blocks, hit = manager.get_computed_blocks(second)
    new = second.num_tokens - hit
    added = manager.allocate_slots(second, new, hit, hit_blocks, num_lookahead_tokens=k)
    assert added is not None
    held = [b.block_id for b in manager.get_blocks(second.request_id).blocks[0]]
    returned = [b.block_id for b in added.blocks[0]]
    calls.append(
        (
            f"allocate_slots(request 1, {new}, {hit}, hits, num_lookahead_tokens={k}): admission",
            [0, hit, new, k],
            held,
            returned,
        )
    )
    out.append({"computed": 0, "hits": hit, "new": new, "lookahead": k, "returned": returned})
    second.num_computed_tokens = hit + new
    # The next step: the sampled token and k drafts, k slots ahead.
    computed = second.num_computed_tokens
    added = manager.allocate_slots(second, 1 + k, num_lookahead_tokens=k)
    assert added is not None
    returned = [b.block_id for b in added.blocks[0]]
    held = [b.block_id for b in manager.get_blocks(second.request_id).blocks[0]]
    calls.append(
        (
            f"allocate_slots(request 1, {1 + k}, num_lookahead_tokens={k}): "
            f"the next step, one token and {k} drafts",
            [computed, 0, 1 + k, k],
            held,
            returned,
        )
    )
    out.append(
        {"computed": computed, "hits": 0, "new": 1 + k, "lookahead": k, "returned": returned}
    )
    write_text("kv-slot-regions.svg", diagrams_cache.slot_regions(calls, block_size))
    return {"calls": out, "held": held, "k": k}


def draw_preempt() -> dict[str, Any]:
    steps = steps_of(load("preempt"))
    write_text("preempt-schedule.md", schedule_table(steps, fold=True))
    write_text("preempt-schedule-full.md", schedule_table(steps))
    facts = step_facts(steps)
    pre = first_step(steps, lambda v: bool(v["preempted"]))
    resumed = first_step(steps, lambda v: any(r["kind"] == "resumed" for r in v["requests"]))
    for i in (pre - 1, pre, resumed):
        save_svg(f"preempt-step-{i}.svg", render_step(step_view(steps[i])), f"step {i}")
    before, at = facts[str(pre - 1)], facts[str(pre)]
    victim_id = at["preempted"][0]
    victim = before["requests"][victim_id]
    runner_id, runner = next((r, f) for r, f in at["requests"].items())
    # The victim's blocks no one else holds go back to the queue, tail first.
    shared = {b for r, f in before["requests"].items() if r != victim_id for b in f["blocks"]}
    freed = [b for b in reversed(victim["blocks"]) if b not in shared]
    taken = [b for b in runner["blocks"] if b not in before["requests"][runner_id]["blocks"]]
    # Its full blocks were hashed; the partial last one was not.
    num_full = victim["after"] // PREEMPT["block_size"]
    hashed = set(victim["blocks"][:num_full])
    queue_after = [(b, b in hashed) for b in freed if b not in taken]
    # Where the step view lists the free queue, it must agree.
    recorded = step_view(steps[pre])["kv"].get("free_queue_head")
    if recorded is not None and recorded != [[b, c] for b, c in queue_after]:
        raise SystemExit(f"after step {pre} the free queue is {recorded}, not {queue_after}")
    write_text(
        "preempt-free-queue.svg",
        diagrams.free_queue(
            [
                (
                    f"end of step {pre - 1}: the pool is full",
                    {r: f["blocks"] for r, f in before["requests"].items()},
                    [],
                    "every block held: nothing to allocate",
                ),
                (
                    f"step {pre}: request {victim_id} is preempted, its blocks freed tail first",
                    {runner_id: before["requests"][runner_id]["blocks"]},
                    [(b, b in hashed) for b in freed],
                    "the shared block stays with request " + f"{runner_id}: ref_cnt 2 → 1",
                ),
                (
                    f"step {pre}: request {runner_id} takes block {taken[0]} from the head",
                    {runner_id: runner["blocks"]},
                    [(b, c) for b, c in queue_after],
                    f"cached: they wait for request {victim_id}",
                ),
            ],
            "The free queue around the preemption",
        ),
    )
    back = facts[str(resumed)]["requests"][victim_id]
    with open(os.path.join(RUNS_DIR, "preempt", "refusal.txt")) as f:
        refusal = f.read().strip()
    numbers = re.search(
        r"max seq len \((\d+)\).*That is (\d+) KV cache blocks; the pool has (\d+)\..*"
        r"maximum model length is (\d+)\.",
        refusal,
    )
    assert numbers is not None, refusal
    fourth = [
        first_step(
            steps,
            lambda v, r=r: any(q["req_id"] == r and len(q["block_ids"]) > 3 for q in v["requests"]),
        )
        for r in sorted(facts["1"]["requests"])
    ]
    return {
        "steps": facts,
        "usable_blocks": facts["1"]["kv"]["used"] + facts["1"]["kv"]["free"],
        "num_gpu_blocks": PREEMPT["num_gpu_blocks_override"],
        "max_tokens": PREEMPT["max_tokens"],
        "prompt_tokens": [f["prompt"] for _, f in sorted(facts["1"]["requests"].items())],
        "fourth_block": fourth,
        "step": pre,
        "victim": {
            "id": victim_id,
            "computed": victim["after"],
            "tokens": victim["tokens"] + 1,  # it sampled one more in step pre - 1
            "full_blocks": num_full,
        },
        "runner": {"id": runner_id, "computed": runner["computed"], "blocks": runner["blocks"]},
        "freed": freed,
        "taken": taken,
        "runner_last_step": max(int(i) for i, f in facts.items() if runner_id in f["requests"]),
        "resume": {
            "step": resumed,
            "hit": back["computed"],
            "recomputed": back["scheduled"],
            "tokens": back["tokens"],
            "blocks": back["blocks"],
        },
        "last_step": max(steps),
        "refusal": {
            "max_model_len": int(numbers[1]),
            "needed_blocks": int(numbers[2]),
            "pool_blocks": int(numbers[3]),
            "estimated_max_model_len": int(numbers[4]),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draw-only", action="store_true", help="re-draw from traces/docs/")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=sorted(ALONE),
        help="re-record (or with --draw-only re-draw) these runs only, updating their "
        "entries of facts.json and leaving the other recordings as they are",
    )
    args = parser.parse_args()
    if args.only:
        with open(os.path.join(OUT_DIR, "facts.json")) as f:
            facts = json.load(f)
        for name in args.only:
            run, draw = ALONE[name]
            if not args.draw_only:
                run()
            facts[name] = draw()
        write_text("facts.json", json.dumps(facts, indent=1, sort_keys=True) + "\n")
        return
    import record_moe  # docs/, beside this file
    import record_parallel  # likewise
    import record_performance  # docs/, beside this file (it imports this module)
    import record_spec  # likewise
    import record_structured  # likewise

    clear_out_dir()
    if not args.draw_only:
        run_single()
        run_serve()
        run_batch()
        run_preempt()
        record_structured.run()
        record_spec.run()
        record_performance.run()
        record_parallel.run()
    facts = {
        "single": draw_single(),
        "serve": draw_serve(),
        "batch": draw_batch(),
        "preempt": draw_preempt(),
    }
    facts[record_structured.NAME] = record_structured.draw()
    facts[record_spec.NAME] = record_spec.draw()
    facts[record_performance.NAME] = record_performance.draw()
    facts[record_parallel.NAME] = record_parallel.draw()
    facts[record_moe.NAME] = record_moe.draw()  # computed, not run: the router on seeded logits
    # The roofline and the profile: from committed benchmark results, not re-measured.
    facts |= record_performance.draw_measured()
    write_text("facts.json", json.dumps(facts, indent=1, sort_keys=True) + "\n")


def clear_out_dir() -> None:
    """Start empty, so that a view the book still names but no run drew
    breaks the build; but keep what a record script that this run does not
    call wrote there (docs/record_tuning.py, ``make docs-tuning``: its charts
    and facts.tuning.json; docs/record_disagg.py: the cross-engine trace and
    facts.disagg.json; docs/record_serve_bench.py: facts.bench_serve.json;
    docs/record_compile.py: the compile's tables, code and facts), which
    nothing here would draw again."""
    import record_compile  # docs/, beside this file (the performance chapter's compile)
    import record_disagg  # likewise (make trace-disagg's recording)
    import record_serve_bench  # likewise (the serving chapter's load figures)
    import record_tuning  # likewise

    kept = (
        *record_tuning.OUTPUTS,
        *record_disagg.OUTPUTS,
        *record_serve_bench.OUTPUTS,
        *record_compile.OUTPUTS,
    )
    os.makedirs(OUT_DIR, exist_ok=True)
    for name in os.listdir(OUT_DIR):
        if any(fnmatch.fnmatch(name, pattern) for pattern in kept):
            continue
        path = os.path.join(OUT_DIR, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


# The runs of this file that --only re-records alone (the others have their
# own docs/record_<name>.py).
ALONE: dict[str, tuple[Callable[[], None], Callable[[], dict[str, Any]]]] = {
    "single": (run_single, draw_single),
    "serve": (run_serve, draw_serve),
    "batch": (run_batch, draw_batch),
    "preempt": (run_preempt, draw_preempt),
}


if __name__ == "__main__":
    main()

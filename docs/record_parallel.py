"""Record the scaling-out chapter's trace: one request at T = 2, detail full.

``docs/record_assets.py`` calls ``run()`` and ``draw()`` with the book's other
runs; ``python docs/record_parallel.py`` re-records this one alone (and
``--draw-only`` redraws it), updating the ``parallel`` entry of
``facts.json`` and leaving the other recordings as they are.

The run: ``tracevllm trace -tp 2 --detail full`` on a tiny random-weight
Llama (seeded: 2 layers, hidden 64, 4 query / 2 KV heads, the default
model's tokenizer), written to ``traces/docs/parallel-model/``: four
processes (the frontend, the engine core, one worker per rank), one trace.
At detail full each all-reduce and all-gather of each rank is a span with its
bytes and milliseconds. The text is noise (random weights); the spans are
what the chapter reads.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "docs"))

import record_assets as assets  # noqa: E402

from tracevllm.tracing.exporters import SpanRecord  # noqa: E402
from tracevllm.views.waterfall import render_waterfall  # noqa: E402

NAME = "parallel"
PROMPT = "What is the capital of France?"
MAX_TOKENS = 3
TP = 2
COMM = "GroupCoordinator."


def model_dir() -> str:
    """The tiny Llama, made once (the same seed gives the same weights)."""
    from tests.utils import make_tiny_llama
    from tracevllm.model_executor.model_loader import resolve_model

    path = os.path.join(assets.RUNS_DIR, "parallel-model")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_llama(path, seed=0, tokenizer_from=resolve_model(None))
    return path


def run() -> None:
    out = assets.fresh_run_dir(NAME)
    cmd = [os.path.join(ROOT, ".venv", "bin", "tracevllm"), "trace", "--model", model_dir(),
           "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "-tp", str(TP),
           "--detail", "full", "--out", out]  # fmt: skip
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)


def _subtree(spans: list[SpanRecord], root: SpanRecord) -> list[SpanRecord]:
    """``root`` and every span below it, whatever process made it."""
    children: dict[str, list[SpanRecord]] = {}
    for s in spans:
        if s.parent_span_id:
            children.setdefault(s.parent_span_id, []).append(s)
    shown, stack = [], [root]
    while stack:
        span = stack.pop()
        shown.append(span)
        stack.extend(children.get(span.span_id, []))
    return sorted(shown, key=lambda s: s.start_ns)


def draw() -> dict[str, Any]:
    spans = assets.load(NAME)
    steps = sorted((s for s in spans if s.name == "EngineCore.step"), key=lambda s: s.start_ns)
    # The last step that ran the model (after it, one that only frees the
    # request): a decode of one token, every rank's forward and collectives under it.
    decode = next(tree for tree in (_subtree(spans, s) for s in reversed(steps))
                  if any(s.name.startswith(COMM) for s in tree))  # fmt: skip
    # 80 columns, as the book's other waterfalls: legible at the page's width.
    assets.save_svg(f"{NAME}-waterfall.svg", render_waterfall(decode, max_rows=60),
                    "a decode step at T = 2", 80)  # fmt: skip
    comms = [s for s in decode if s.name.startswith(COMM)]
    ranks = sorted({int(s.resource["tracevllm.rank"]) for s in comms})
    per_rank = Counter((int(s.resource["tracevllm.rank"]), s.name) for s in comms)
    reduce0 = [s for s in comms if s.name == COMM + "all_reduce"
               and s.resource["tracevllm.rank"] == 0]  # fmt: skip
    gather0 = [s for s in comms if s.name == COMM + "all_gather"
               and s.resource["tracevllm.rank"] == 0]  # fmt: skip
    runner0 = next(s for s in decode if s.name == "ModelRunner.execute_model"
                   and s.resource.get("tracevllm.rank") == 0)  # fmt: skip
    comm_ms0 = sum(float(s.attributes["tracevllm.comm.ms"]) for s in reduce0 + gather0)
    return {
        "tp": TP,
        "processes": len({s.pid for s in spans}),
        "trace_ids": len({s.trace_id for s in spans}),
        "steps": len(steps),
        "ranks": ranks,
        "all_reduces_per_rank": per_rank[(0, COMM + "all_reduce")],
        "all_gathers_per_rank": per_rank[(0, COMM + "all_gather")],
        "same_on_every_rank": len({per_rank[(r, COMM + "all_reduce")] for r in ranks}) == 1,
        "all_reduce_bytes": sorted({int(s.attributes["tracevllm.comm.bytes"]) for s in reduce0}),
        "all_gather_bytes": sorted({int(s.attributes["tracevllm.comm.bytes"]) for s in gather0}),
        "rank0_comm_ms": round(comm_ms0, 2),
        "rank0_execute_ms": round((runner0.end_ns - runner0.start_ns) / 1e6, 2),
    }


def main() -> None:
    assets.rerecord_alone(__doc__, NAME, run, draw)


if __name__ == "__main__":
    main()

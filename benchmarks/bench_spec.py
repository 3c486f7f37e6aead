"""``make bench-spec``: speculative decoding, with and without, where it helps and where not.

Two workloads, each at batch 1 (requests one at a time) and batch 16 (one
``generate`` call), greedy, on the default model, engine core in its own
process:

- copy: "repeat this passage word for word" (the output copies the prompt,
  so n-gram drafts are usually right);
- chat: the ``make bench`` chat prompts (per-request ``max_tokens`` 16-128,
  ``ignore_eos``): drafts are rarely right.

Each cell runs without speculation, then with n-gram drafts (k = 4, lookup
2-4, what vLLM's CPU build was seen to win 2.8x with at batch 1 on a copy
task). It prints generated tokens/s, the speed-up, the mean acceptance
length (1 + accepted / steps with drafts, vLLM's convention) and whether the
tokens match the run without drafts. With ``VLLM_VENV`` naming a venv that
holds the real vLLM CPU build (``bash benchmarks/setup_vllm_venv.sh``), the
same prompt token ids then go through vLLM's own ``LLM`` in the same run
(benchmarks/vllm_spec_offline.py, a separate process).

Run: ``make bench-spec`` or ``python benchmarks/bench_spec.py [--batch1 N]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from tracevllm.benchmarks.datasets import workload

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_common import greedy_requests, run_in_vllm_venv, timed_generate  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}  # fmt: skip
SENTENCES = [
    "The river bends twice before it reaches the old stone bridge.",
    "Every morning the baker opens the shutters at exactly six o'clock.",
    "A small lighthouse stands on the northern edge of the island.",
    "The committee agreed to meet again after the summer holidays.",
    "Her grandfather kept a notebook of every bird he had ever seen.",
    "The train to the coast leaves from platform four on weekdays.",
    "Most of the village still gets its water from a single well.",
    "He painted the fence blue because the shop had run out of green.",
    "The library closes early on Fridays during the winter months.",
    "Two cats sleep on the warm roof of the greenhouse every afternoon.",
    "The mountain path is steep, narrow and covered in loose stones.",
    "She wrote the recipe on the back of an old concert ticket.",
    "The museum moved its collection of clocks to the second floor.",
    "Rain is expected tomorrow, so the market will be held indoors.",
    "The orchestra tuned their instruments while the hall filled up.",
    "A wooden boat was tied to the pier with a frayed yellow rope.",
]


def copy_workload(n: int) -> list[list[dict[str, str]]]:
    """n passages of five sentences each, to be repeated word for word."""
    passages = [" ".join(SENTENCES[(i + j) % 16] for j in range(5)) for i in range(n)]
    return [
        [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{p}"}]
        for p in passages
    ]


def make_cells(tok: Any, batch1: int) -> list[dict[str, Any]]:
    """The four cells as prompt token ids, so that both engines get the same tokens."""

    def ids(conv: list[dict[str, str]]) -> list[int]:
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    chat, chat_max = workload(16)
    cells = []
    for name, convs, max_tokens, ignore_eos in (
        ("copy", copy_workload(16), [160] * 16, False),
        ("chat", chat, chat_max, True),
    ):
        for batch, n in ((1, batch1), (16, 16)):
            cells.append({
                "workload": name, "batch": batch, "prompts": [ids(c) for c in convs[:n]],
                "max_tokens": max_tokens[:n], "ignore_eos": ignore_eos,
            })  # fmt: skip
    return cells


def run_tracevllm(cells: list[dict[str, Any]], spec: dict[str, Any] | None) -> list[dict]:
    from tracevllm import LLM, SamplingParams

    results = []
    with LLM(speculative_config=spec, max_num_seqs=16) as llm:
        for cell in cells:
            prompts, params = greedy_requests(
                SamplingParams, cell["prompts"], cell["max_tokens"], cell["ignore_eos"]
            )
            elapsed, outs = timed_generate(llm, prompts, params, cell["batch"])
            drafts = sum(o.metrics.num_drafts for o in outs if o.metrics)
            accepted = sum(o.metrics.num_accepted_tokens for o in outs if o.metrics)
            results.append({
                "seconds": elapsed, "tokens": [o.outputs[0].token_ids for o in outs],
                "drafts": drafts, "accepted": accepted,
            })  # fmt: skip
    return results


def run_vllm(venv: str, model_dir: str, cells: list[dict[str, Any]]) -> list[list[dict]]:
    """The same cells through vLLM's LLM, without and with drafts (another process)."""
    job = {"model": model_dir, "spec": NGRAM, "cells": cells}
    results: list[list[dict]] = run_in_vllm_venv(venv, "vllm_spec_offline.py", job)
    return results


def add_rows(table: Table, engine: str, cells: list[dict], plain: list[dict], spec: list[dict]):
    for cell, base, drafted in zip(cells, plain, spec):
        n_base = sum(map(len, base["tokens"]))
        n_spec = sum(map(len, drafted["tokens"]))
        tps_base, tps_spec = n_base / base["seconds"], n_spec / drafted["seconds"]
        same = sum(a == b for a, b in zip(base["tokens"], drafted["tokens"]))
        mal = 1 + drafted["accepted"] / drafted["drafts"] if drafted["drafts"] else float("nan")
        table.add_row(
            engine, cell["workload"], str(cell["batch"]), str(len(cell["prompts"])),
            f"{n_base}", f"{tps_base:.1f}", f"{tps_spec:.1f}", f"{tps_spec / tps_base:.2f}x",
            f"{mal:.2f}", f"{same}/{len(base['tokens'])}",
        )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch1", type=int, default=4, help="requests in the batch-1 cells")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from tracevllm.model_executor.model_loader import resolve_model

    model_dir = resolve_model(None)
    cells = make_cells(AutoTokenizer.from_pretrained(model_dir), args.batch1)
    console = Console()
    console.print(f"n-gram drafts: {NGRAM}")
    plain = run_tracevllm(cells, None)
    spec = run_tracevllm(cells, NGRAM)
    table = Table(title="Speculative decoding (greedy, default model)")
    for col in ("engine", "workload", "batch", "requests", "tokens", "tok/s plain",
                "tok/s n-gram", "speed-up", "mean acc. len", "same tokens"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("engine", "workload") else "right")
    add_rows(table, "tracevllm", cells, plain, spec)
    venv = os.environ.get("VLLM_VENV")
    if venv:
        vllm_plain, vllm_spec = run_vllm(venv, model_dir, cells)
        add_rows(table, "vLLM 0.32 CPU", cells, vllm_plain, vllm_spec)
    console.print(table)
    if not venv:
        console.print("(VLLM_VENV not set: vLLM's CPU build not measured)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

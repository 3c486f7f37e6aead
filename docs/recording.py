"""Read a recorded run back from its spans: its steps, the book's tables, and
the figures the prose quotes (``facts.json``, checked by docs/hooks/recorded.py).

Used by ``docs/record_assets.py``; everything here is a pure function of the
spans, so ``record_assets.py --draw-only`` redraws the same book from the same
run.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from typing import Any

from tracevllm.tracing.exporters import SpanRecord

Steps = dict[int, dict[str, SpanRecord]]

# The runner's flat batch, as the ModelRunner._prepare_inputs span carries it.
PREPARED = [
    ("tracevllm.req_ids", "req_ids (batch rows)"),
    ("tracevllm.num_scheduled_tokens", "num_scheduled_tokens"),
    ("tracevllm.block_table", "block_table rows"),
    ("tracevllm.positions", "positions"),
    ("tracevllm.query_start_loc", "query_start_loc"),
    ("tracevllm.seq_lens", "seq_lens"),
    ("tracevllm.slot_mapping", "slot_mapping"),
    ("tracevllm.logits_indices", "logits_indices"),
]


def steps_of(spans: list[SpanRecord]) -> Steps:
    """step id -> {span name: span} for the spans under each EngineCore.step."""
    children: dict[str, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        if s.parent_span_id:
            children[s.parent_span_id].append(s)
    steps: Steps = {}
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


# The engine's request ids are the caller's plus a random suffix (vLLM's
# internal ids, ``0-2044ac59``); the book names requests by the caller's.
_SUFFIX = re.compile(r"(?<=\w)-[0-9a-f]{8}\b")


def external(req_id: str) -> str:
    """``0-2044ac59`` -> ``0``, also inside a string (``0-2044ac59: [1, 2]``)."""
    return _SUFFIX.sub("", req_id)


def _external_ids(key: str, value: Any) -> Any:
    """A runner attribute with request ids in it, with the caller's ids."""
    if key in ("tracevllm.req_ids", "tracevllm.block_table") and isinstance(value, list):
        return [external(str(v)) for v in value]
    return value


def step_view(step: dict[str, SpanRecord]) -> dict[str, Any]:
    """The step's view, with the caller's request ids (stable from run to run)."""
    view: dict[str, Any] = json.loads(step["Scheduler.schedule"].attributes["tracevllm.view.step"])
    for r in view["requests"]:
        r["req_id"] = external(r["req_id"])
    for key in ("preempted", "finished"):
        view[key] = [external(r) for r in view.get(key, [])]
    return view


def compact(value: Any) -> str:
    """A list as `[a b c]`, runs of four or more consecutive ints folded (`16…52`)."""
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return "`[" + fold_ints(value) + "]`"
    if isinstance(value, list):
        return "<br>".join(f"`{v}`" for v in value)
    return f"`{value}`"


def fold_ints(value: list[int]) -> str:
    """``[16, 17, ..., 52, 60]`` -> ``16…52 60``."""
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
    return " ".join(parts)


def prepared_inputs_table(steps: Steps, ids: list[int]) -> str:
    """The runner's flat batch for some steps, as a markdown table."""
    lines = ["| | " + " | ".join(f"step {i}" for i in ids) + " |"]
    lines.append("|---|" + "---|" * len(ids))
    for key, label in PREPARED:
        cells = []
        for i in ids:
            attrs = steps[i]["ModelRunner._prepare_inputs"].attributes
            if key not in attrs:
                raise SystemExit(f"ModelRunner._prepare_inputs has no {key} any more")
            cells.append(compact(_external_ids(key, attrs[key])))
        lines.append(f"| `{label}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


SCHEDULE_HEAD = (
    "| step | request: computed + scheduled / tokens (kind) | budget used | "
    "KV blocks in use / free (cached) | preempted |\n|---|---|---|---|---|\n"
)


def _kv_cell(kv: dict[str, Any]) -> str:
    return f"{kv['used']} / {kv['free']} ({kv['cached_free']})"


def _row(i: int, view: dict[str, Any]) -> str:
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
    budget = view["token_budget"]
    return (
        f"| {i} | {'<br>'.join(reqs) or '—'} | {budget['used']}/{budget['total']} | "
        f"{_kv_cell(view['kv'])} | {', '.join(view['preempted']) or ''} |"
    )


def _plain_decode(view: dict[str, Any]) -> bool:
    return not view["preempted"] and all(
        r["kind"] == "cached" and r["num_scheduled_tokens"] == 1 for r in view["requests"]
    )


def schedule_table(steps: Steps, fold: bool = False) -> str:
    """Every step of a run: which requests, how many tokens each, and why.

    With ``fold``, three or more consecutive steps in which the same requests
    each decode one token, with the pool unchanged, become one row."""
    ids = sorted(steps)
    views = {i: step_view(steps[i]) for i in ids}
    lines, k = [], 0
    while k < len(ids):
        run = k
        while (
            fold
            and run + 1 < len(ids)
            and _plain_decode(views[ids[k]])
            and _plain_decode(views[ids[run + 1]])
            and [r["req_id"] for r in views[ids[run + 1]]["requests"]]
            == [r["req_id"] for r in views[ids[k]]["requests"]]
            and views[ids[run + 1]]["kv"]["used"] == views[ids[k]]["kv"]["used"]
        ):
            run += 1
        if run - k >= 2:
            first, last = views[ids[k]], views[ids[run]]
            each = [
                f"{a['req_id']}: {a['num_computed_tokens']} → {b['num_computed_tokens']} + 1"
                for a, b in zip(first["requests"], last["requests"])
            ]
            lines.append(
                f"| {ids[k]}–{ids[run]} | each step, one decode each:<br>{'<br>'.join(each)} | "
                f"{first['token_budget']['used']}/{first['token_budget']['total']} | "
                f"{_kv_cell(first['kv'])} | |"
            )
            k = run + 1
        else:
            lines.append(_row(ids[k], views[ids[k]]))
            k += 1
    return SCHEDULE_HEAD + "\n".join(lines) + "\n"


# ------------------------------------------------------------------ facts
def step_facts(steps: Steps) -> dict[str, Any]:
    """Every step's figures, by step id: ``steps.3.requests.2.scheduled``."""
    out: dict[str, Any] = {}
    for i in sorted(steps):
        view = step_view(steps[i])
        facts: dict[str, Any] = {
            "used": view["token_budget"]["used"],
            "num_requests": len(view["requests"]),
            "requests": {
                r["req_id"]: {
                    "computed": r["num_computed_tokens"],
                    "scheduled": r["num_scheduled_tokens"],
                    "after": r["num_computed_tokens"] + r["num_scheduled_tokens"],
                    "tokens": r["num_tokens"],
                    "prompt": r["num_prompt_tokens"],
                    "kind": r["kind"],
                    "blocks": r["block_ids"],
                    "num_blocks": len(r["block_ids"]),
                }
                for r in view["requests"]
            },
            "kv": {key: view["kv"][key] for key in ("used", "free", "cached_free")},
            # A block's ref_cnt is the number of requests that hold it.
            "ref_cnt": ref_counts(view),
            "preempted": view["preempted"],
        }
        prep = steps[i].get("ModelRunner._prepare_inputs")
        if prep is not None:
            for key, _ in PREPARED:
                if key in prep.attributes:
                    value = _external_ids(key, prep.attributes[key])
                    facts[key.removeprefix("tracevllm.")] = value
            facts["num_tokens"] = sum(prep.attributes.get("tracevllm.num_scheduled_tokens", []))
        out[str(i)] = facts
    return out


def ref_counts(view: dict[str, Any]) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for r in view["requests"]:
        for block in r["block_ids"]:
            counts[str(block)] += 1
    return dict(sorted(counts.items(), key=lambda kv: int(kv[0])))


def first_step(steps: Steps, pred: Any) -> int:
    for i in sorted(steps):
        if pred(step_view(steps[i])):
            return i
    raise SystemExit("no recorded step matches: did the workload change?")


def request_tokens(steps: Steps, req: str) -> dict[int, int]:
    """position -> token id of request ``req`` (the caller's id), from the
    flat batches of the steps that ran it; a later step's token at a
    position replaces an earlier one's (a rejected draft's). Positions a
    prefix hit skipped are missing."""
    seq: dict[int, int] = {}
    for i in sorted(steps):
        prep = steps[i].get("ModelRunner._prepare_inputs")
        if prep is None:
            continue
        names = [external(str(r)) for r in prep.attributes["tracevllm.req_ids"]]
        if req not in names:
            continue
        row = names.index(req)
        counts = prep.attributes["tracevllm.num_scheduled_tokens"]
        start = sum(counts[:row])
        attrs = prep.attributes
        positions, ids = attrs["tracevllm.positions"], attrs["tracevllm.input_ids"]
        for k in range(start, start + counts[row]):
            seq[positions[k]] = ids[k]
    return seq

"""What a step's spans carry, so its views can be drawn from the spans alone.

OTel attributes are flat (scalars and lists), so the structured step view is
one JSON string (``tracevllm.view.step``); the figures a trace viewer filters
on are plain attributes beside it. The ``record`` of ``Scheduler.schedule``'s
span (tracing/records.py): it runs only when that span records, so tracing off
costs nothing here. It reads the scheduler without importing it (tracing never
imports the core), and the KV cache through the public methods of its
``KVCacheManager`` and ``BlockPool`` only (``get_block_ids``,
``get_num_cached_free_blocks``, ``get_num_skipped_blocks_freed``,
``peek_free_blocks``, the block counts, the ``kv_cache_config``'s groups).
With several KV cache groups (a hybrid model) each request carries a block
list per group; a sliding window's freed blocks show as the null block (id 0).
``Scheduler.get_grammar_bitmask``'s span adds, for each structured request,
how many tokens its mask allowed (``tracevllm.view.grammar``);
``Scheduler.update_from_output``'s, what became of each request's drafts
(``tracevllm.view.spec``); the view draws them together. With a KV
connector, each new request says how much of its prompt the local prefix
cache held and how much the connector brought (vLLM's ``PrefillStats``
names), the view names the connector (``kv_connector``), and the span
carries its name and the step's connector tokens beside the local hits.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import numpy as np
from opentelemetry.trace import Span

from tracevllm.tracing.attributes import SpanAttributes

# How many free blocks, from the head, a step view lists.
FREE_QUEUE_HEAD = 16


def record_schedule(span: Span, so: Any, scheduler: Any) -> None:
    """Attach the step's SchedulerOutput, block tables and KV pool to the span."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    total = pool.get_num_usable_blocks()
    free = pool.get_num_free_blocks()
    # Free blocks that still hold a hash: evictable, but a prefix hit revives them.
    cached_free = kv.get_num_cached_free_blocks()
    groups = kv.kv_cache_config.kv_cache_groups
    freed_by_window = kv.get_num_skipped_blocks_freed()
    new_ids = {r.req_id for r in so.scheduled_new_reqs}
    resumed = so.scheduled_cached_reqs.resumed_req_ids
    connector = getattr(scheduler, "connector", None)
    requests: list[dict[str, Any]] = []
    for req_id, n in so.num_scheduled_tokens.items():
        req = scheduler.requests[req_id]
        kind = "new" if req_id in new_ids else "resumed" if req_id in resumed else "cached"
        block_ids = kv.get_block_ids(req_id)
        requests.append(
            {
                **_token_origin(req, req.num_computed_tokens - n if kind == "new" else None),
                "req_id": req_id,
                "kind": kind,
                # num_computed_tokens was already advanced past this step.
                "num_computed_tokens": req.num_computed_tokens - n,
                "num_scheduled_tokens": n,
                "num_tokens": req.num_tokens,
                "num_prompt_tokens": req.num_prompt_tokens,
                # A new or resumed request starts from its prefix-cache hit.
                "num_cached_tokens": req.num_computed_tokens - n if kind != "cached" else 0,
                "block_ids": block_ids[0],
                # Every group's, when there are several (full and sliding window).
                **({"group_block_ids": list(block_ids)} if len(groups) > 1 else {}),
                # The kind of its constraint (json, regex, ...), or None.
                "structured": _structured_kind(req),
                # Drafts it verifies this step (speculative decoding).
                "spec_token_ids": so.scheduled_spec_decode_tokens.get(req_id, []),
            }
        )
    # The head of the free queue (next to be handed out), with whether each
    # block still holds a hash: the book draws it around a preemption.
    head = [[b.block_id, b.block_hash is not None] for b in pool.peek_free_blocks(FREE_QUEUE_HEAD)]
    prefix = kv.prefix_cache_stats
    view = {
        "step": so.step_id,
        "token_budget": {
            "used": so.total_num_scheduled_tokens,
            "total": scheduler.max_num_scheduled_tokens,
        },
        "block_size": scheduler.block_size,
        "requests": requests,
        "preempted": sorted(so.preempted_req_ids or ()),
        "finished": sorted(so.finished_req_ids),
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting),
        "kv": {
            "total": total,
            "free": free,
            "used": total - free,
            "cached_free": cached_free,
            "free_queue_head": head,
            # One entry per KV cache group: its kind and, for a sliding
            # window, the blocks it has freed so far.
            "groups": [
                {
                    "kind": type(g.kv_cache_spec).__name__,
                    "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None),
                    "num_layers": len(g.layer_names),
                    "freed_by_window": freed,
                }
                for g, freed in zip(groups, freed_by_window, strict=True)
            ],
        },
        "prefix_cache": {"queries": prefix.queries, "hits": prefix.hits} if prefix else {},
        # The KV connector (ExampleConnector, NixlConnector, OffloadingConnector), if any.
        "kv_connector": type(connector).__name__ if connector is not None else None,
    }
    origins = [r for r in requests if "num_local_cached_tokens" in r]
    span.set_attributes(
        {
            SpanAttributes.STEP_ID: so.step_id,
            SpanAttributes.REQUEST_IDS: list(so.num_scheduled_tokens),
            "tracevllm.num_scheduled_tokens": list(so.num_scheduled_tokens.values()),
            "tracevllm.token_budget.used": so.total_num_scheduled_tokens,
            "tracevllm.token_budget.total": scheduler.max_num_scheduled_tokens,
            "tracevllm.scheduled_new_reqs": sorted(new_ids),
            "tracevllm.scheduled_cached_reqs": list(so.scheduled_cached_reqs.req_ids),
            "tracevllm.preempted_req_ids": sorted(so.preempted_req_ids or ()),
            # Local prefix-cache hits (a connector's tokens are counted apart).
            "tracevllm.prefix_cache.hit_tokens": sum(
                r.get("num_local_cached_tokens", r["num_cached_tokens"]) for r in requests
            ),
            "tracevllm.kv_connector.hit_tokens": sum(
                r["num_external_cached_tokens"] for r in origins
            ),
            "tracevllm.kv.blocks_total": total,
            "tracevllm.kv.blocks_free": free,
            "tracevllm.kv.blocks_used": total - free,
            "tracevllm.kv.blocks_cached_free": cached_free,
            "tracevllm.kv.blocks_freed_by_window": sum(freed_by_window),
            SpanAttributes.STEP_VIEW: json.dumps(view),
            **({SpanAttributes.KV_CONNECTOR: view["kv_connector"]} if connector else {}),
        }
    )


def _token_origin(request: Any, num_cached: int | None) -> dict[str, int]:
    """Where a new request's prompt KV came from, as vLLM's ``PrefillStats``
    splits it (``num_local_cached_tokens``: the local prefix cache;
    ``num_external_cached_tokens``: the KV connector, loaded from another
    engine or the offload tier), by what the step starts from
    (``num_cached``): a connector's load whose last token is computed again
    (a full remote prompt) counts that token as computed, and a failed load
    recomputed only what it kept. Nothing for a running request, or for one
    resumed after a preemption (its first prefill's stats are not this
    admission's, and its prefix is not told apart)."""
    stats = getattr(request, "prefill_stats", None)
    if num_cached is None or stats is None or not stats.num_prompt_tokens:
        return {}
    local = min(stats.num_local_cached_tokens, num_cached)
    return {"num_local_cached_tokens": local, "num_external_cached_tokens": num_cached - local}


def _structured_kind(request: Any) -> str | None:
    so_request = request.structured_output_request
    return None if so_request is None else so_request.structured_output_key[0].name.lower()


# --8<-- [start:record_grammar_bitmask]
def record_grammar_bitmask(span: Span, grammar_output: Any, scheduler: Any, so: Any) -> None:
    """How many tokens each row of each structured request's mask allowed.

    A request has one row, or with drafts one per draft position and one
    more (the bonus), in the order of ``structured_output_request_ids``
    (StructuredOutputManager.grammar_bitmask): so its counts are a list.
    """
    allowed: dict[str, list[int]] = {}
    if grammar_output is not None:
        vocab_size = scheduler.vllm_config.model_config.vocab_size
        # int32 words, least significant bit first: token t is bit t of the row.
        bits = np.unpackbits(
            grammar_output.grammar_bitmask.view(np.uint8), axis=1, bitorder="little"
        )
        counts = bits[:, :vocab_size].sum(axis=1).tolist()
        spec_tokens = so.scheduled_spec_decode_tokens
        row = 0
        for req_id in grammar_output.structured_output_request_ids:
            num_rows = 1 + len(spec_tokens.get(req_id, ()))
            allowed[req_id] = counts[row : row + num_rows]
            row += num_rows
        if row != len(counts):
            raise ValueError(f"{len(counts)} bitmask rows for {row} positions")
    span.set_attributes(
        {
            SpanAttributes.STEP_ID: so.step_id,
            "tracevllm.structured_output.req_ids": list(allowed),
            # Rows per request, and the count of each row in that order.
            "tracevllm.structured_output.num_rows": [len(c) for c in allowed.values()],
            "tracevllm.structured_output.num_allowed_tokens": [
                n for c in allowed.values() for n in c
            ],
            SpanAttributes.GRAMMAR_VIEW: json.dumps(allowed),
        }
    )


# --8<-- [end:record_grammar_bitmask]


# Per scheduler: req_id -> [drafts so far, accepted so far] (the running rate).
_spec_totals: weakref.WeakKeyDictionary[Any, dict[str, list[int]]] = weakref.WeakKeyDictionary()


# --8<-- [start:record_spec_decode]
def record_spec_decode(
    span: Span, scheduler: Any, so: Any, model_runner_output: Any, engine_core_outputs: Any = None
) -> None:
    """What became of each request's drafts this step: which the target
    kept, what it emitted after them (vLLM's names: the bonus token after a
    run of kept drafts, the recovered token in place of a rejected one), and
    the request's acceptance so far. Where a stop (EOS, a stop token,
    max_tokens) ended the request inside that run, ``cut`` says how many of
    the emitted tokens the request kept and why it finished: the scheduler
    dropped the rest (``engine_core_outputs``, what it sent back, tells)."""
    if not so.scheduled_spec_decode_tokens:
        return
    sent = {o.request_id: o for outs in (engine_core_outputs or {}).values() for o in outs.outputs}
    totals = _spec_totals.setdefault(scheduler, {})
    spec: dict[str, dict[str, Any]] = {}
    for req_id, drafts in so.scheduled_spec_decode_tokens.items():
        index = model_runner_output.req_id_to_index.get(req_id)
        emitted = model_runner_output.sampled_token_ids[index] if index is not None else []
        if not emitted:
            continue
        accepted = len(emitted) - 1
        total = totals.setdefault(req_id, [0, 0])
        total[0] += len(drafts)
        total[1] += accepted
        spec[req_id] = {
            "drafts": drafts,
            "accepted": accepted,
            # The bonus token if every draft was kept, else the target's own pick.
            "next": emitted[-1],
            "bonus": accepted == len(drafts),
            "rate": total[1] / total[0],
        }
        out = sent.get(req_id)
        if (
            out is not None
            and out.finish_reason is not None
            and len(out.new_token_ids) < len(emitted)
        ):
            spec[req_id]["cut"] = {
                "kept": len(out.new_token_ids),
                "finish_reason": str(out.finish_reason),
            }
    for req_id in list(totals):
        if req_id not in scheduler.requests:
            del totals[req_id]  # finished
    span.set_attributes(
        {
            SpanAttributes.STEP_ID: so.step_id,
            "tracevllm.spec_decode.req_ids": list(spec),
            "tracevllm.spec_decode.num_accepted": [s["accepted"] for s in spec.values()],
            SpanAttributes.SPEC_VIEW: json.dumps(spec),
        }
    )


# --8<-- [end:record_spec_decode]

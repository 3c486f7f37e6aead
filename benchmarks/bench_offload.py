"""KV offloading: prefix hit rate and time to first token with and without the CPU tier.

A workload whose shared prefixes do not fit the device pool: ``--groups``
prefixes of ``--prefix-len`` random token ids, each asked ``--rounds``
times with its own ``--suffix-len`` suffix, the groups taking turns (group
0, 1, ..., G-1, 0, 1, ...). With a device pool of ``--num-gpu-blocks``
blocks, fewer than the prefixes need, the prefix cache's LRU has always
evicted a group's prefix by the time that group comes back; with
``--kv-offloading-size`` (default: room for every prefix and suffix) the
prefix is loaded back from the tier instead of computed.

Requests go one at a time, ``max_tokens=1``, greedy, on the default model
(engine core in this process, so the tier's counters can be read): the
wall time of each ``generate`` is its time to first token. Printed per
configuration: the prefix hit rate (cached prompt tokens / prompt tokens:
the engine's prefix cache and the tier together), the tier's share of it,
TTFT mean and p50/p90 over the requests after each group's first (those
are the ones a tier can help), the first token of each request against the
run without the tier, and the machine's load average (a busy machine
slows both runs alike, the ratio is what to read). The tier loads as vLLM
does, the request waiting a step in ``WAITING_FOR_REMOTE_KVS``;
``--sync-load`` copies the blocks in with the request's first chunk.

Run: ``make bench-offload`` or ``python benchmarks/bench_offload.py [--groups 8 ...]``.
About 20 minutes on 2 busy CPUs with the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from tracevllm import LLM, SamplingParams


def make_workload(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(5, min(vocab_size, 20000), (n,), generator=gen).tolist()

    prefixes = [tokens(args.prefix_len) for _ in range(args.groups)]
    rounds, groups = range(args.rounds), range(args.groups)
    return [prefixes[g] + tokens(args.suffix_len) for _ in rounds for g in groups]


def run(args: argparse.Namespace, prompts: list[list[int]], tier_gib: float | None) -> dict:
    kwargs: dict[str, Any] = {}
    if tier_gib is not None and args.sync_load:
        # Synchronous loads: the connector's config spelled out.
        extra = {"cpu_bytes_to_use": tier_gib * (1 << 30), "async_load": False}
        kwargs["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    elif tier_gib is not None:
        kwargs["kv_offloading_size"] = tier_gib
    params = SamplingParams(temperature=0.0, max_tokens=1)
    with LLM(
        model=args.model,
        block_size=args.block_size,
        num_gpu_blocks_override=args.num_gpu_blocks,
        max_model_len=args.max_model_len,
        enable_multiprocessing=False,
        **kwargs,
    ) as llm:
        # Warm-up: a prompt of its own, untimed.
        llm.generate([{"prompt_token_ids": [7] * args.suffix_len}], params, use_tqdm=False)
        ttfts, cached, first_tokens = [], [], []
        for prompt in prompts:
            start = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            ttfts.append(time.perf_counter() - start)
            cached.append(out.num_cached_tokens)
            first_tokens.append(out.outputs[0].token_ids[0])
        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
        tier = connector.get_kv_connector_stats() if connector is not None else None
    return {"ttft_s": ttfts, "num_cached_tokens": cached, "first_tokens": first_tokens,
            "tier": tier}  # fmt: skip


def summarize(name: str, result: dict, prompts: list[list[int]], groups: int) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    later = result["ttft_s"][groups:]  # each group's second request on
    tier = result["tier"]
    tier_hits = tier["connector_prefix_cache_stats"]["hits"] if tier else 0
    return {
        "config": name,
        "prefix_hit_rate": sum(result["num_cached_tokens"]) / prompt_tokens,
        "tier_hit_rate": tier_hits / prompt_tokens,
        "ttft_mean_ms": 1000 * statistics.mean(later),
        "ttft_p50_ms": 1000 * statistics.median(later),
        "ttft_p90_ms": 1000 * statistics.quantiles(later, n=10)[-1],
        "tier": tier["offload"] if tier else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: tracevllm's default model")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-gpu-blocks", type=int, default=48)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--kv-offloading-size", type=float, default=None, metavar="GiB")
    parser.add_argument(
        "--sync-load",
        action="store_true",
        help="synchronous loads (async_load false; default: vLLM's asynchronous loads)",
    )
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()
    args.async_load = not args.sync_load  # as recorded (docs/record_disagg.py reads it)

    from tracevllm.engine.arg_utils import EngineArgs

    hf_config = EngineArgs(model=args.model).create_engine_config().model_config.hf_config_dict
    prompts = make_workload(args, hf_config["vocab_size"])
    blocks_needed = args.groups * -(-(args.prefix_len + args.suffix_len) // args.block_size)
    print(
        f"{len(prompts)} requests: {args.groups} prefixes of {args.prefix_len} tokens "
        f"(+{args.suffix_len}), {args.rounds} rounds; device pool {args.num_gpu_blocks} "
        f"blocks of {args.block_size}, the prefixes need {blocks_needed}"
    )
    load_before = os.getloadavg()[0]
    base = run(args, prompts, None)
    tier_gib = args.kv_offloading_size
    if tier_gib is None:
        # Room for every request's blocks: bytes per block from the engine's pool.
        tier_gib = _tier_gib_for(args, hf_config, blocks_needed * 2)
    offload = run(args, prompts, tier_gib)
    load_after = os.getloadavg()[0]

    rows = [
        summarize("no tier", base, prompts, args.groups),
        summarize(f"CPU tier {tier_gib * 1024:.0f} MiB", offload, prompts, args.groups),
    ]
    same = sum(a == b for a, b in zip(base["first_tokens"], offload["first_tokens"], strict=True))
    print(f"{'config':<22}{'hit rate':>10}{'tier':>8}{'TTFT mean':>12}{'p50':>10}{'p90':>10}")
    for r in rows:
        print(
            f"{r['config']:<22}{r['prefix_hit_rate']:>10.1%}{r['tier_hit_rate']:>8.1%}"
            f"{r['ttft_mean_ms']:>10.0f}ms{r['ttft_p50_ms']:>8.0f}ms{r['ttft_p90_ms']:>8.0f}ms"
        )
    print(f"tier counters (blocks): {rows[1]['tier']}")
    print(f"first tokens equal: {same}/{len(prompts)}")
    print(
        f"load average (1 min) {load_before:.1f} before, {load_after:.1f} after, "
        f"{os.cpu_count()} CPUs"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": vars(args), "rows": rows, "same_first_tokens": same,
                 "load_average": [load_before, load_after]},
                f, indent=1,
            )  # fmt: skip


def _tier_gib_for(args: argparse.Namespace, hf: dict[str, Any], num_blocks: int) -> float:
    """GiB for ``num_blocks`` blocks of this model's KV cache (all layers, fp32:
    an upper bound for a model run in 16 bits)."""
    num_layers = hf["num_hidden_layers"]
    num_kv_heads = hf.get("num_key_value_heads", hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    bytes_per_block = 2 * num_kv_heads * head_dim * 4 * args.block_size * num_layers
    return num_blocks * bytes_per_block / (1 << 30)


if __name__ == "__main__":
    main()

"""tracevllm on CUDA: eager, compiled, and compiled with PIECEWISE CUDA graphs.

Issue 27's CUDA part, run by ``bash benchmarks/gpu_check.sh`` when a GPU is
lent. The model is random-weight, SmolLM2-135M-Instruct's shape (30 layers,
hidden 576, 9 query / 3 KV heads, MLP 1536) with a small tokenizer made on
the spot (its vocabulary is the tokenizer's, not 49152): nothing is
downloaded, and the speed of a forward does not depend on the weights'
values. Greedy, ``ignore_eos``: every run generates the same number of
tokens. For each batch size (concurrent requests), each mode runs in a fresh
engine; the table gives output tokens per second over the timed
``generate`` and the engine's start-up (load, compile, capture), and the
greedy tokens are compared across the modes (random weights in fp32 give
near-ties, so a mismatch is reported, not fatal).

    python benchmarks/bench_cuda_graphs.py [--batch-sizes 1,8,32] [--output-len 128]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
# Graphs first: each compiled engine starts from a process no eager engine has touched.
MODES = {
    "compiled + CUDA graphs": dict(compilation_config={"mode": 3, "cudagraph_mode": "PIECEWISE"}),
    "compiled": dict(compilation_config={"mode": 3, "cudagraph_mode": "NONE"}),
    "eager": dict(enforce_eager=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-layers", type=int, default=30, help="fewer for a dry run")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()

    import torch

    from tests.utils import make_tiny_llama
    from tracevllm import LLM, SamplingParams
    from tracevllm.compilation.counter import compilation_counter

    work = tempfile.mkdtemp(prefix="bench-cuda-graphs-")
    os.environ.setdefault("TRACEVLLM_CACHE_DIR", os.path.join(work, "cache"))
    shape = {**SMOLLM2_135M, "num_hidden_layers": args.num_layers}
    model = make_tiny_llama(os.path.join(work, "model"), seed=0, **shape)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}; {args.dtype}; SmolLM2-135M's shape, "
          f"random weights; prompts of {args.prompt_len} tokens, {args.output_len} out, greedy",
          flush=True)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    results: list[dict] = []
    for batch in batch_sizes:
        prompts = [
            {"prompt_token_ids": [(7 * i + j) % 200 + 10 for j in range(args.prompt_len)]}
            for i in range(batch)
        ]
        tokens_by_mode: dict[str, list[list[int]]] = {}
        for mode, kwargs in MODES.items():
            if args.device != "cuda" and mode.endswith("graphs"):
                continue
            captured = compilation_counter.num_cudagraph_captured
            start = time.perf_counter()
            llm = LLM(model, device=args.device, dtype=args.dtype, max_num_seqs=max(batch, 1),
                      enable_multiprocessing=False, enable_prefix_caching=False,
                      **kwargs)  # type: ignore[arg-type]  # fmt: skip
            startup = time.perf_counter() - start
            try:
                llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True),
                             use_tqdm=False)  # fmt: skip
                if args.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - t0
            finally:
                llm.shutdown()
            tokens_by_mode[mode] = [list(o.outputs[0].token_ids) for o in outs]
            generated = sum(len(t) for t in tokens_by_mode[mode])
            captured = compilation_counter.num_cudagraph_captured - captured
            row = {"batch": batch, "mode": mode, "tok_s": generated / seconds, "seconds": seconds,
                   "startup_s": startup, "graphs_captured": captured}  # fmt: skip
            results.append(row)
            print(f"batch {batch:>3}  {mode:<24} {row['tok_s']:>9.1f} tok/s  "
                  f"({seconds:.2f} s timed; start-up {startup:.1f} s, "
                  f"{row['graphs_captured']} graphs captured)", flush=True)  # fmt: skip
        eager = tokens_by_mode["eager"]
        for mode, toks in tokens_by_mode.items():
            same = sum(a == b for a, b in zip(toks, eager, strict=True))
            print(f"batch {batch:>3}  {mode:<24} greedy tokens as eager: {same}/{len(eager)}")
    for batch in batch_sizes:
        by = {r["mode"]: r["tok_s"] for r in results if r["batch"] == batch}
        graphs = by.get("compiled + CUDA graphs")
        if graphs:
            print(f"batch {batch:>3}: graphs / eager {graphs / by['eager']:.2f}x, "
                  f"graphs / compiled {graphs / by['compiled']:.2f}x")  # fmt: skip
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "args": vars(args),
                       "runs": results}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()

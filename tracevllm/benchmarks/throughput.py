"""``tracevllm bench throughput``: offline throughput, all requests in one ``generate``.

Mirrors vllm/benchmarks/throughput.py: the requests of a dataset (here by
default the ``make bench`` workload: 64 chat prompts, max_tokens 16-128
seeded; or ``--dataset-name random``, or a JSON file with ``--dataset``, see
datasets.py), greedy with ``ignore_eos`` so each generates exactly the
tokens it asks for, ``--num-warmups`` requests first (untimed), then one
timed ``LLM.generate`` over all of them. Printed as vLLM prints it
(requests/s, total tokens/s, output tokens/s) and written with vLLM's JSON
keys: ``elapsed_time``, ``num_requests``, ``total_num_tokens``,
``requests_per_second``, ``tokens_per_second`` (tracevllm adds the prompt
and output token counts and ``output_tokens_per_second``).

``--backend hf`` runs HF transformers' static batching instead, as vLLM's
``run_hf``: batches of ``--hf-max-batch-size`` in order, left-padded, each
generating to its longest request. Left out: the async engine, ``--n``,
LoRA, multimodal datasets, ``--profile``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from tracevllm.benchmarks.datasets import SampleRequest, add_dataset_args, get_samples
from tracevllm.benchmarks.offline import make_llm, write_json


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from tracevllm.engine.arg_utils import EngineArgs

    parser.add_argument("--backend", choices=("tracevllm", "hf"), default="tracevllm")
    add_dataset_args(parser)
    parser.add_argument("--num-warmups", type=int, default=2, help="untimed requests first")
    parser.add_argument("--hf-max-batch-size", type=int, default=16)
    parser.add_argument("--output-json", default=None, help="write the results here")
    parser.add_argument("--disable-detokenize", action="store_true")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    EngineArgs.add_cli_args(parser)


def sampling_params(samples: list[SampleRequest], detokenize: bool = True) -> list[Any]:
    from tracevllm.sampling_params import SamplingParams

    return [
        SamplingParams(temperature=0.0, max_tokens=s.expected_output_len, ignore_eos=True,
                       detokenize=detokenize)
        for s in samples
    ]  # fmt: skip


def run_tracevllm(
    llm: Any, samples: list[SampleRequest], num_warmups: int = 2, **kwargs: Any
) -> tuple[float, list[Any]]:
    """(seconds, RequestOutputs) of one ``generate`` over every sample, after
    the first ``num_warmups`` untimed."""
    prompts = [{"prompt_token_ids": s.prompt_token_ids} for s in samples]
    params = sampling_params(samples, kwargs.pop("detokenize", True))
    if num_warmups:
        llm.generate(prompts[:num_warmups], params[:num_warmups], use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, **kwargs)
    return time.perf_counter() - start, outputs


def run_hf(model_dir: str, samples: list[SampleRequest], batch_size: int = 16) -> float:
    """Seconds for HF transformers' static batches (fp32, greedy, to the longest)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    def generate(batch: list[SampleRequest], max_new_tokens: int) -> None:
        inputs = tok.pad({"input_ids": [s.prompt_token_ids for s in batch]}, return_tensors="pt")
        model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                       do_sample=False, pad_token_id=tok.pad_token_id)  # fmt: skip

    with torch.inference_mode():
        generate(samples[:2], 4)  # warm-up
        start = time.perf_counter()
        for i in range(0, len(samples), batch_size):
            batch = samples[i : i + batch_size]
            generate(batch, max(s.expected_output_len for s in batch))
        return time.perf_counter() - start


def load_samples(args: argparse.Namespace) -> tuple[str, list[SampleRequest]]:
    """The model's directory and the dataset's samples, before any engine starts
    (so that a bad ``--dataset`` fails fast)."""
    from transformers import AutoTokenizer

    from tracevllm.model_executor.model_loader import resolve_model

    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or model_dir)
    return model_dir, get_samples(args, tokenizer)


def main(args: argparse.Namespace) -> int:
    model_dir, samples = load_samples(args)
    if args.backend == "hf":
        elapsed = run_hf(model_dir, samples, args.hf_max_batch_size)
        prompt_tokens = sum(s.prompt_len for s in samples)
        output_tokens = sum(s.expected_output_len for s in samples)
    else:
        with make_llm(args) as llm:
            elapsed, outputs = run_tracevllm(
                llm, samples, args.num_warmups, use_tqdm=not args.no_progress,
                detokenize=not args.disable_detokenize,
            )  # fmt: skip
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    total = prompt_tokens + output_tokens
    print(
        f"Throughput: {len(samples) / elapsed:.2f} requests/s, "
        f"{total / elapsed:.2f} total tokens/s, {output_tokens / elapsed:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    if args.output_json:
        write_json(args.output_json, {
            "elapsed_time": elapsed,
            "num_requests": len(samples),
            "total_num_tokens": total,
            "requests_per_second": len(samples) / elapsed,
            "tokens_per_second": total / elapsed,
            "total_prompt_tokens": prompt_tokens,
            "total_output_tokens": output_tokens,
            "output_tokens_per_second": output_tokens / elapsed,
            "backend": args.backend,
        })  # fmt: skip
    return 0

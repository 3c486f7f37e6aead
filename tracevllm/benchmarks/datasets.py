"""The benchmarks' workloads: the ``make bench`` chat prompts, random tokens, a JSON file.

Mirrors vllm/benchmarks/datasets/datasets.py in small: ``SampleRequest``
(a prompt, its length and the output length it asks for), vLLM's
``RandomDataset`` (random token ids of ``--input-len``) and ``CustomDataset``
(a file of ``{"prompt": ..., "output_tokens": ...}`` records), and one
workload of tracevllm's own, ``chat``: the ``make bench`` chat prompts
(16 topics x 4 templates, cycled) with per-request output lengths drawn from
16-128 with a fixed seed. Left out: ShareGPT, sonnet, BurstGPT, HF hub and
multimodal datasets (they need downloads).

The custom file (``--dataset-name custom --dataset-path FILE``, or
``--dataset FILE``) is either a JSON list or JSON lines (one record a line),
each record an object::

    {"prompt": "What is the capital of France?", "output_tokens": 32}

``prompt`` (a non-empty string) is required; ``output_tokens`` (an int >= 1)
may be left out when ``--output-len`` is given, which overrides it. A prompt
goes through the model's chat template unless ``--skip-chat-template``.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from typing import Any

TOPICS = ["the French Revolution", "photosynthesis", "black holes", "the stock market",
          "machine learning", "the Roman Empire", "climate change", "the human heart",
          "volcanoes", "jazz music", "the internet", "honey bees", "chess openings",
          "the moon landing", "coffee", "electric cars"]  # fmt: skip
TEMPLATES = ["Explain {} to a ten-year-old.", "Write a short story about {}.",
             "What are three surprising facts about {}?",
             "Summarize the history of {} in a paragraph."]  # fmt: skip
CUSTOM_KEYS = ("prompt", "output_tokens")


def chat_prompts(n: int) -> list[str]:
    """The ``make bench`` chat prompts (user messages), cycled."""
    return [TEMPLATES[i % 4].format(TOPICS[(i // 4) % 16]) for i in range(n)]


def workload(n: int = 64, seed: int = 0) -> tuple[list[list[dict[str, str]]], list[int]]:
    """The ``make bench`` workload: n one-message conversations and their
    max_tokens, drawn from 16-128 with ``seed``."""
    rng = random.Random(seed)
    convs = [[{"role": "user", "content": p}] for p in chat_prompts(n)]
    return convs, [rng.randint(16, 128) for _ in range(n)]


@dataclass
class SampleRequest:
    """One benchmark request, as vLLM's: the prompt's token ids (the text,
    when there is one, for the HF backend) and the output length asked for."""

    prompt_token_ids: list[int]
    expected_output_len: int
    prompt: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def add_dataset_args(parser: argparse.ArgumentParser, num_prompts: int = 64) -> None:
    parser.add_argument(
        "--dataset-name",
        choices=("chat", "random", "custom"),
        default=None,
        help="chat: the `make bench` prompts (default); random: random token ids of "
        "--input-len; custom: a JSON file (--dataset-path)",
    )
    parser.add_argument(
        "--dataset-path",
        "--dataset",
        dest="dataset_path",
        default=None,
        metavar="FILE",
        help='JSON list or JSON lines of {"prompt": str, "output_tokens": int}',
    )
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument(
        "--input-len", type=int, default=None, help="random: prompt tokens (default 32)"
    )
    parser.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="tokens per request, overriding the dataset's (chat: 16-128 seeded)",
    )
    parser.add_argument("--skip-chat-template", action="store_true", help="custom: raw prompts")


def get_samples(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest]:
    """``args.num_prompts`` requests of the chosen dataset (vLLM's ``get_requests``)."""
    name = args.dataset_name or ("custom" if args.dataset_path else "chat")
    for flag in ("num_prompts", "input_len", "output_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}.")
    if name == "custom":
        if not args.dataset_path:
            raise ValueError("--dataset-name custom needs --dataset-path FILE.")
        records = load_custom_dataset(args.dataset_path, args.output_len is not None)
        # Cycled, as vLLM oversamples, to --num-prompts.
        records = [records[i % len(records)] for i in range(args.num_prompts)]
        texts = [r["prompt"] for r in records]
        lens = [args.output_len or r["output_tokens"] for r in records]
        return _encode(tokenizer, texts, lens, chat=not args.skip_chat_template)
    if args.dataset_path:
        raise ValueError(f"--dataset-path is for --dataset-name custom, not {name}.")
    if name == "random":
        rng = random.Random(args.seed)
        input_len, output_len = args.input_len or 32, args.output_len or 128
        vocab = min(10000, tokenizer.vocab_size)
        return [
            SampleRequest([rng.randrange(vocab) for _ in range(input_len)], output_len)
            for _ in range(args.num_prompts)
        ]
    return chat_samples(tokenizer, args.num_prompts, args.output_len)


def chat_samples(
    tokenizer: Any, n: int = 64, output_len: int | None = None, seed: int = 0
) -> list[SampleRequest]:
    """The ``make bench`` workload, through the chat template (``output_len``
    replaces the seeded max_tokens)."""
    convs, max_tokens = workload(n, seed)
    lens = [output_len] * n if output_len else max_tokens
    return _encode(tokenizer, [c[0]["content"] for c in convs], lens, chat=True)


def _encode(tokenizer: Any, texts: list[str], lens: list[int], chat: bool) -> list[SampleRequest]:
    samples = []
    for text, n in zip(texts, lens):
        if chat:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        ids = tokenizer.encode(text, add_special_tokens=not chat)
        samples.append(SampleRequest(ids, n, text))
    return samples


def load_custom_dataset(path: str, output_len_given: bool) -> list[dict[str, Any]]:
    """Read and check a custom dataset file; every error names the file and the record."""
    where = f"dataset file {path}"
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"{where}: cannot read it: {e.strerror}.") from e
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON: {e}.") from e
    else:  # JSON lines
        records = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{where}: line {lineno} is not valid JSON ({e.msg}); the file must be "
                    'a JSON list or JSON lines of {"prompt": ..., "output_tokens": ...}.'
                ) from e
    if not records:
        raise ValueError(f"{where}: no records.")
    for i, record in enumerate(records):
        at = f"{where}: record {i}"
        if not isinstance(record, dict):
            raise ValueError(f'{at} must be an object {{"prompt": ...}}, got {record!r:.60}.')
        unknown = sorted(set(record) - set(CUSTOM_KEYS))
        if unknown:
            raise ValueError(f"{at}: unknown key(s) {unknown}; the keys are {list(CUSTOM_KEYS)}.")
        prompt = record.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f'{at}: "prompt" must be a non-empty string, got {prompt!r:.60}.')
        n = record.get("output_tokens")
        if n is None and not output_len_given:
            raise ValueError(f'{at} has no "output_tokens" (or give --output-len).')
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f'{at}: "output_tokens" must be an int >= 1, got {n!r}.')
    return records

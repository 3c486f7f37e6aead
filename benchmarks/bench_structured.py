"""Structured outputs: what a grammar costs, from one run.

- Throughput: the forty JSON-schema prompts of the tests (four schemas, ten
  prompts each; tests/structured_cases.py), greedy, up to 200 tokens, on one
  engine (its core in its own process, as by default): each with its schema,
  then without, each request generating exactly as many tokens as it did
  under its schema (``ignore_eos``), so both runs do the same model work.
  Two rounds (the first compiles the schemas); the prefix cache is reset
  before each run. Generated tokens per second of each.
- Compilation: each schema (and the tests' regex, choice list and grammar)
  compiled against the default model's vocabulary by a fresh backend, cache
  cold, then again from the cache; and the time to fill one bitmask row.

Run: ``make bench-structured`` (or ``python benchmarks/bench_structured.py``).
It prints figures; it asserts nothing.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import structured_cases as cases  # noqa: E402


def throughput(console: Console) -> list[list[int]]:
    """Each prompt with its schema, then without, each request generating as
    many tokens as it did under its schema: the same work, with and without
    the grammar. Returns the constrained outputs' token ids."""
    from tracevllm import LLM, SamplingParams
    from tracevllm.sampling_params import StructuredOutputsParams

    prompts: list[Any] = []
    constrained: list[SamplingParams] = []
    for schema, template, compact in cases.SCHEMAS.values():
        so = StructuredOutputsParams(json=schema, disable_any_whitespace=compact)
        prompts += cases.chat(template)
        constrained += [SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=so)] * 10
    table = Table(title=f"Throughput: {len(prompts)} chat prompts, greedy, one engine")
    for col in ("run", "generated tokens", "seconds", "tok/s", "valid JSON"):
        table.add_column(col, justify="left" if col == "run" else "right")
    with LLM() as llm:
        llm.generate(["Warm up."], SamplingParams(max_tokens=4), use_tqdm=False)
        # Two rounds, alternating, since a shared machine's load comes and goes.
        for n in (1, 2):
            name = "JSON schema" + (" (compiling)" if n == 1 else " (cached)")
            outputs = _run(llm, prompts, constrained, f"{n}. {name}", table)
            token_ids = [list(o.outputs[0].token_ids) for o in outputs]
            same = [
                SamplingParams(temperature=0.0, max_tokens=len(ids), ignore_eos=True)
                for ids in token_ids
            ]
            _run(llm, prompts, same, f"{n}. no constraint, same token counts", table)
    console.print(table)
    return token_ids


def _run(llm: Any, prompts: list[Any], params: list[Any], name: str, table: Table) -> list[Any]:
    """One timed run from a cold prefix cache, as a row of ``table``."""
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.chat(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    valid = sum(_is_json(o.outputs[0].text) for o in outputs)
    table.add_row(
        name, str(tokens), f"{seconds:.1f}", f"{tokens / seconds:.1f}", f"{valid}/{len(outputs)}"
    )
    return list(outputs)


def _is_json(text: str) -> bool:
    import json

    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def compilation(console: Console, token_ids: list[list[int]]) -> None:
    import torch
    from transformers import AutoTokenizer

    from tracevllm.model_executor.model_loader import resolve_model
    from tracevllm.sampling_params import StructuredOutputsParams
    from tracevllm.structured_output.backend_xgrammar import XgrammarBackend
    from tracevllm.structured_output.request import get_structured_output_key

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    start = time.perf_counter()
    backend = XgrammarBackend(tokenizer, len(tokenizer))
    setup = time.perf_counter() - start
    specs = {
        name: StructuredOutputsParams(json=schema) for name, (schema, _, _) in cases.SCHEMAS.items()
    }
    specs["regex (date)"] = StructuredOutputsParams(regex=cases.DATE_REGEX)
    specs["choice (3)"] = StructuredOutputsParams(choice=cases.SENTIMENTS)
    specs["grammar (arithmetic)"] = StructuredOutputsParams(grammar=cases.ARITHMETIC)
    table = Table(title=f"Compilation against the {len(tokenizer)}-token vocabulary")
    for col in ("constraint", "compile ms (cold)", "from the cache ms"):
        table.add_column(col, justify="left" if col == "constraint" else "right")
    for name, params in specs.items():
        kind, spec = get_structured_output_key(params)
        start = time.perf_counter()
        backend.compile_grammar(kind, spec)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        backend.compile_grammar(kind, spec)
        hit = time.perf_counter() - start
        table.add_row(name, f"{cold * 1e3:.1f}", f"{hit * 1e3:.2f}")
    console.print(table)
    console.print(f"Backend set-up (the vocabulary read once, TokenizerInfo): {setup * 1e3:.0f} ms")

    # The bitmask rows of the throughput run again, replayed off the engine:
    # each output's tokens through a fresh matcher, one fill per token.
    bitmask = backend.allocate_token_bitmask(1)
    fills, filled = 0.0, 0
    for schema_index, (schema, _, compact) in enumerate(cases.SCHEMAS.values()):
        kind, spec = get_structured_output_key(StructuredOutputsParams(json=schema))
        for ids in token_ids[schema_index * 10 : schema_index * 10 + 10]:
            grammar = backend.compile_grammar(kind, spec, any_whitespace=not compact)
            for token in ids:
                start = time.perf_counter()
                grammar.fill_bitmask(bitmask, 0)
                fills += time.perf_counter() - start
                filled += 1
                if not grammar.accept_tokens("replay", [token]):
                    break
    console.print(
        f"Filling one bitmask row ({bitmask.shape[1]} int32 words, {bitmask.shape[1] * 4} "
        f"bytes): {fills / filled * 1e6:.0f} µs on average over the {filled} rows of the "
        f"run above (torch {torch.__version__}, {os.cpu_count()} CPUs)."
    )


def main() -> None:
    console = Console()
    token_ids = throughput(console)
    compilation(console, token_ids)


if __name__ == "__main__":
    main()

"""Where xgrammar crashes or stalls on a user's schema: the measurements
behind tracevllm/structured_output/limits.py.

Each case runs in its own child process (a segfault or a stall ends the
child, not the benchmark), on a thread with the default 8 MiB stack or with
``run_with_large_stack``'s, and reports what ``Grammar.from_json_schema``
(the entry's parse) and, with ``--compile``, a compilation against the
default model's vocabulary (the engine's) took, or how the child died. The
cases: ``$ref`` chains (bare, and objects holding the next), nested objects
and arrays, a pattern's repetition count, a wide object, and the worst
schemas the limits allow.

Run: ``python benchmarks/bench_schema_limits.py [--compile] [--timeout S]``.
It prints figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import structured_cases as cases  # noqa: E402


def _wide(n: int, inner: Callable[[], Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": inner() for i in range(n)}}


# name -> (schema builder, stack: "default" or "large")
CASES: dict[str, tuple[Callable[[], Any], str]] = {
    "8000-link $ref chain": (lambda: cases.flat_ref_chain(8000), "default"),
    "16000-link $ref chain": (lambda: cases.flat_ref_chain(16000), "default"),
    "16000-link $ref chain, large stack": (lambda: cases.flat_ref_chain(16000), "large"),
    "1000 objects chained by $ref": (lambda: cases.object_ref_chain(1000), "default"),
    "4000 objects chained by $ref": (lambda: cases.object_ref_chain(4000), "default"),
    "16000 objects chained by $ref, large stack": (lambda: cases.object_ref_chain(16000), "large"),
    "64 nested objects": (lambda: cases.nested_objects(64), "large"),
    "128 nested objects": (lambda: cases.nested_objects(128), "large"),
    "200 nested objects": (lambda: cases.nested_objects(200), "large"),
    "128 nested arrays": (lambda: cases.nested_arrays(128), "large"),
    "256 nested arrays": (lambda: cases.nested_arrays(256), "large"),
    "pattern [a-z]{1000}": (lambda: {"type": "string", "pattern": "[a-z]{1000}"}, "large"),
    "pattern [a-z]{3000}": (lambda: {"type": "string", "pattern": "[a-z]{3000}"}, "large"),
    "3500 properties": (lambda: _wide(3500, lambda: {"type": "integer"}), "large"),
    # The worst the limits allow: 32 levels, 1000 $refs, 64 KiB.
    "limits: 15 nested objects": (lambda: cases.nested_objects(15), "default"),
    "limits: 31 nested arrays": (lambda: cases.nested_arrays(31), "default"),
    "limits: 999-link $ref chain": (lambda: cases.flat_ref_chain(999), "default"),
    "limits: 690 objects chained by $ref": (lambda: cases.object_ref_chain(690), "default"),
    "limits: 80 chains of 28 nested arrays (64 KiB)": (
        lambda: _wide(80, lambda: cases.nested_arrays(28)),
        "default",
    ),
    "limits: 74 chains of 14 nested objects (64 KiB)": (
        lambda: _wide(74, lambda: cases.nested_objects(14)),
        "default",
    ),
}


def child(name: str, compile_too: bool) -> None:
    """One case, on the stack it names; prints its figures as JSON."""
    import xgrammar as xgr

    from tracevllm.structured_output.large_stack import run_with_large_stack

    build, stack = CASES[name]
    text = json.dumps(build())
    compiler = None
    if compile_too:
        from transformers import AutoTokenizer

        from tracevllm.model_executor.model_loader import resolve_model

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    figures: dict[str, Any] = {"chars": len(text)}

    def run() -> None:
        start = time.perf_counter()
        grammar = xgr.Grammar.from_json_schema(text)
        figures["parse_s"] = time.perf_counter() - start
        if compiler is not None:
            start = time.perf_counter()
            compiler.compile_grammar(grammar)
            figures["compile_s"] = time.perf_counter() - start

    if stack == "large":
        run_with_large_stack(run)
    else:
        thread = threading.Thread(target=run)  # the default stack (8 MiB on Linux)
        thread.start()
        thread.join()
    print(json.dumps(figures))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="also compile (the engine's)")
    parser.add_argument("--timeout", type=float, default=60.0, help="per case (s)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.compile)
        return
    for name in CASES:
        command = [sys.executable, __file__, "--child", name]
        try:
            proc = subprocess.run(
                command + ["--compile"] * args.compile,
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
        except subprocess.TimeoutExpired:
            print(f"{name:52} did not finish in {args.timeout:.0f} s", flush=True)
            continue
        if proc.returncode < 0:
            print(f"{name:52} killed by signal {-proc.returncode}", flush=True)
            continue
        if proc.returncode != 0:
            print(f"{name:52} failed: {proc.stderr.strip().splitlines()[-1]}", flush=True)
            continue
        figures = json.loads(proc.stdout.strip().splitlines()[-1])
        line = f"{name:52} {figures['chars']:>8} chars  parse {figures['parse_s']:7.3f} s"
        if "compile_s" in figures:
            line += f"  compile {figures['compile_s']:7.3f} s"
        print(line, flush=True)


if __name__ == "__main__":
    main()

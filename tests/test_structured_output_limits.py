"""Hostile constraints: refused at the entry, quickly, and never a crash.

xgrammar parses a JSON schema in C++, recursing once per ``$ref`` it follows
and per nesting level: a long chain segfaults the process that parses (the
API server, the user's own), and deep nesting takes minutes. Each case runs
in a child process under a timeout, so that a segfault or a stall fails the
test instead of killing or blocking pytest. Then the same cases offline
(``LLM.generate``) and over HTTP (``tracevllm serve``): a ``ValueError`` / a
400 naming the field, and the next request is served.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests import structured_cases as cases
from tracevllm.structured_output.limits import (
    MAX_CONSTRAINT_CHARS,
    MAX_JSON_SCHEMA_DEPTH,
    MAX_JSON_SCHEMA_REFS,
    MAX_PATTERN_REPETITIONS,
)

pytestmark = pytest.mark.timeout(300)


def _nested_arrays_text(n: int) -> str:
    """``cases.nested_arrays(n)`` as JSON text (json.dumps recurses: ~1000 levels at most)."""
    return '{"type": "array", "items": ' * n + '{"type": "integer"}' + "}" * n


def _nested_objects_text(n: int) -> str:
    head = '{"type": "object", "properties": {"n": '
    return head * n + '{"type": "integer"}' + '}, "required": ["n"]}' * n


# name -> (the schema, words of the refusal)
HOSTILE: dict[str, tuple[Any, str]] = {
    "4000-link $ref chain": (cases.flat_ref_chain(4000), f"more than {MAX_JSON_SCHEMA_REFS} $refs"),
    "16000-link $ref chain": (cases.flat_ref_chain(16000), "$refs"),
    "100000-link $ref chain": (cases.flat_ref_chain(100000), "$refs"),
    "4000 objects chained by $ref": (cases.object_ref_chain(4000), "$refs"),
    "1000 nested objects": (
        cases.nested_objects(1000),
        f"more than {MAX_JSON_SCHEMA_DEPTH} levels",
    ),
    "4000 nested arrays": (cases.nested_arrays(4000), "levels"),
    "2000 nested arrays, as text": (_nested_arrays_text(2000), "levels"),
    "a pattern repeated 10000 times": (
        {"type": "string", "pattern": "^[a-z]{10000}$"},
        f"add up to more than {MAX_PATTERN_REPETITIONS}",
    ),
    "10000 properties": (
        {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10000)}},
        f"at most {MAX_CONSTRAINT_CHARS} are allowed",
    ),
}


def _in_child(code: str, timeout: float) -> Any:
    """Run ``code`` in a fresh interpreter; what it printed last, as JSON.

    A crash (a negative return code: a signal) or a stall fails the test here.
    """
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child did not finish in {timeout} s")
    assert proc.returncode == 0, f"child exited {proc.returncode}: {proc.stderr[-2000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_hostile_schemas_are_refused_at_the_entry_quickly() -> None:
    """What ``SamplingParams.verify`` runs (in the API server's process, or
    the offline user's): each hostile schema a ValueError naming
    ``structured_outputs.json`` and the limit, in well under a second."""
    code = """if True:
        import json, sys, time
        import xgrammar  # its import (~2 s) is not what is timed
        from tests import test_structured_output_limits as t
        from tracevllm import SamplingParams
        from tracevllm.sampling_params import StructuredOutputsParams
        from tracevllm.structured_output.backend_xgrammar import validate_xgrammar_grammar
        results = {}
        for name, (schema, _) in t.HOSTILE.items():
            params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
            start = time.perf_counter()
            try:
                validate_xgrammar_grammar(params)
                outcome = "accepted"
            except ValueError as e:
                outcome = str(e)
            results[name] = (outcome, time.perf_counter() - start)
        print(json.dumps(results))
    """
    results = _in_child(code, timeout=120)
    for name, (_, words) in HOSTILE.items():
        message, seconds = results[name]
        assert message.startswith("structured_outputs.json") and words in message, (name, message)
        assert seconds < 1.0, (name, seconds)


def test_the_worst_schemas_the_limits_allow_parse_quickly() -> None:
    """At each limit (depth, $refs, size), a schema that is just allowed
    passes the entry's checks and xgrammar's parse in well under a second
    (measured: 0.002-0.05 s; the bound leaves room for a loaded machine)."""
    code = """if True:
        import json, time
        import xgrammar
        from tests import structured_cases as cases
        from tracevllm import SamplingParams
        from tracevllm.sampling_params import StructuredOutputsParams
        from tracevllm.structured_output.backend_xgrammar import validate_xgrammar_grammar
        allowed = {
            "15 nested objects": cases.nested_objects(15),
            "31 nested arrays": cases.nested_arrays(31),
            "999-link $ref chain": cases.flat_ref_chain(999),
            "690 objects chained by $ref": cases.object_ref_chain(690),
            "20 chains of 28 nested arrays, 16 KB": {"type": "object", "properties": {
                f"p{i}": cases.nested_arrays(28) for i in range(20)}},
        }
        results = {}
        for name, schema in allowed.items():
            params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
            start = time.perf_counter()
            validate_xgrammar_grammar(params)
            results[name] = time.perf_counter() - start
        print(json.dumps(results))
    """
    results = _in_child(code, timeout=120)
    assert len(results) == 5
    assert all(seconds < 1.0 for seconds in results.values()), results


def test_xgrammar_runs_on_a_large_stack() -> None:
    """A 16000-link chain, which segfaults on the default 8 MiB stack, past
    the entry (the engine compiles what reaches it without the entry's
    checks): parsed by ``run_with_large_stack``, compiled by the engine's
    grammar pool as the engine does (``grammar_init``), and parsed on a pool
    thread by a bare call: the pool's threads have the large stack."""
    code = """if True:
        import json
        import xgrammar as xgr
        from tests import structured_cases as cases
        from tracevllm import SamplingParams
        from tracevllm.engine.arg_utils import EngineArgs
        from tracevllm.model_executor.model_loader import resolve_model
        from tracevllm.request import Request
        from tracevllm.sampling_params import StructuredOutputsParams
        from tracevllm.structured_output import StructuredOutputManager
        from tracevllm.structured_output.large_stack import run_with_large_stack
        text = json.dumps(cases.flat_ref_chain(16000))
        run_with_large_stack(lambda: xgr.Grammar.from_json_schema(text))
        config = EngineArgs(model=resolve_model(None)).create_engine_config()
        manager = StructuredOutputManager(config)
        so = StructuredOutputsParams(json=text)
        request = Request("r", [1], SamplingParams(max_tokens=1, structured_outputs=so))
        manager.grammar_init(request)
        request.structured_output_request._grammar.result()
        manager.executor.submit(xgr.Grammar.from_json_schema, text).result()
        print(json.dumps("compiled"))
    """
    assert _in_child(code, timeout=180) == "compiled"


# A thread's own stack size, as glibc gave it (Linux).
_STACK_BYTES = """
import ctypes, threading
_libc = ctypes.CDLL(None)
def stack_bytes():
    attr = ctypes.create_string_buffer(256)  # a pthread_attr_t (56 bytes on x86-64)
    assert _libc.pthread_getattr_np(ctypes.c_ulong(threading.get_ident()), attr) == 0
    size = ctypes.c_size_t()
    assert _libc.pthread_attr_getstacksize(attr, ctypes.byref(size)) == 0
    _libc.pthread_attr_destroy(attr)
    return size.value
"""


def test_no_other_thread_gets_the_large_stack() -> None:
    """``threading.stack_size`` is process-wide: a thread that other code
    starts while it is set gets the 256 MiB stack too (and under strict
    overcommit may fail to start). It is set once, when the worker starts,
    not on each parse: threads started while parses run get the default."""
    code = f"""if True:
        import json, threading
        {_STACK_BYTES.strip().replace(chr(10), chr(10) + " " * 8)}
        from tracevllm.structured_output.large_stack import run_with_large_stack
        run_with_large_stack(lambda: None)  # the worker, before the other threads
        sizes, stop = [], threading.Event()
        def start_threads():
            while not stop.is_set():
                thread = threading.Thread(target=lambda: sizes.append(stack_bytes()))
                thread.start()
                thread.join()
        starter = threading.Thread(target=start_threads)
        starter.start()
        large = [run_with_large_stack(stack_bytes) for _ in range(300)]
        stop.set()
        starter.join()
        print(json.dumps([min(large), sorted(set(sizes)), len(sizes)]))
    """
    from tracevllm.structured_output.large_stack import GRAMMAR_THREAD_STACK_BYTES

    smallest_large, other_sizes, num_others = _in_child(code, timeout=120)
    assert smallest_large >= GRAMMAR_THREAD_STACK_BYTES
    assert num_others > 0 and max(other_sizes) < GRAMMAR_THREAD_STACK_BYTES, other_sizes


def test_validation_from_several_threads_and_after_a_fork() -> None:
    """An offline user's threads validate at once, half of them constraints
    xgrammar refuses (an exception on the worker): each gets its own answer,
    none waits forever. A process forked after the worker started (which
    the fork left behind) parses on a worker of its own."""
    code = """if True:
        import json, multiprocessing, threading
        from tracevllm import SamplingParams
        from tracevllm.sampling_params import StructuredOutputsParams
        from tracevllm.structured_output.backend_xgrammar import validate_xgrammar_grammar
        def outcome(regex):
            params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=regex))
            try:
                validate_xgrammar_grammar(params)
                return "ok"
            except ValueError as e:
                return "cannot compile" if "cannot compile" in str(e) else str(e)
        results = {}
        def validate(i):
            results[i] = [outcome("(" if (i + j) % 2 else "[a-z]+") for j in range(6)]
        threads = [threading.Thread(target=validate, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        def in_fork(queue):
            queue.put([outcome("[0-9]+"), outcome(")")])
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=in_fork, args=(queue,))
        child.start()
        child.join(timeout=60)
        forked = queue.get(timeout=1) if child.exitcode == 0 else child.exitcode
        if child.is_alive():
            child.kill()
        print(json.dumps([results, forked]))
    """
    results, forked = _in_child(code, timeout=180)
    for i in range(8):
        expected = ["cannot compile" if (i + j) % 2 else "ok" for j in range(6)]
        assert results[str(i)] == expected, (i, results.get(str(i)))
    assert forked == ["ok", "cannot compile"]


def test_unsupported_features_are_found_at_any_depth() -> None:
    """vLLM's recursive walk raised RecursionError past ~180 levels (a 500);
    the loop does not (the depth limit then refuses the schema)."""
    from tracevllm.structured_output.backend_xgrammar import has_xgrammar_unsupported_json_features

    deep = cases.nested_objects(5000)
    assert not has_xgrammar_unsupported_json_features(deep)
    inner = deep
    while "properties" in inner:
        inner = inner["properties"]["n"]
    inner.update(type="integer", multipleOf=3)
    assert has_xgrammar_unsupported_json_features(deep)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"regex": r"[^\s\S]"}, r"structured_outputs\.regex: this regex allows no output at all"),
        ({"json": {"$ref": "#"}}, r"structured_outputs\.json: this JSON schema allows no output"),
        ({"grammar": "root ::= root"}, r"structured_outputs\.grammar: this EBNF grammar allows no"),
        ({"choice": ["a", "b\0"]}, r"structured_outputs\.choice\[1\] holds a NUL character"),
        ({"regex": "a" * (MAX_CONSTRAINT_CHARS + 1)}, r"structured_outputs\.regex is 65537 char"),
        ({"json": {"type": "string", "format": ["email"]}}, "features xgrammar does not support"),
    ],
)
def test_constraints_that_allow_nothing_are_refused_at_the_entry(
    kwargs: dict[str, Any], message: str
) -> None:
    from tracevllm import SamplingParams
    from tracevllm.sampling_params import StructuredOutputsParams
    from tracevllm.structured_output.backend_xgrammar import validate_xgrammar_grammar

    params = SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs))
    with pytest.raises(ValueError, match=message):
        validate_xgrammar_grammar(params)


def test_a_choice_with_control_characters(tiny_model_dir: str) -> None:
    """A newline, a tab, a carriage return, an escape, quotes and backslashes
    in a choice (vLLM 0.22.0 escapes quotes and backslashes only: a newline
    is an EBNF lexer error). The tiny model is random: only the constraint
    makes its output one of the choices."""
    from tracevllm import LLM, SamplingParams
    from tracevllm.sampling_params import StructuredOutputsParams

    choice = ["line one\nline two", 'say "hi"\\', "a\tb\r", "\x1b[1mbold\x1b[0m"]
    so = StructuredOutputsParams(choice=choice)
    with LLM(model=tiny_model_dir, enable_multiprocessing=False) as tiny:
        outputs = tiny.generate(
            ["Pick one:"] * 4,
            [SamplingParams(temperature=1.0, seed=i, max_tokens=24, structured_outputs=so)
             for i in range(4)],
            use_tqdm=False,
        )  # fmt: skip
    texts = [o.outputs[0].text for o in outputs]
    assert all(text in choice for text in texts), texts


def test_offline_generate_refuses_them_and_serves_on(tiny_model_dir: str) -> None:
    """``LLM.generate`` with each hostile schema: a ValueError in the user's
    process (which a segfault used to kill), then the next request served."""
    code = f"""if True:
        import json
        from tests import test_structured_output_limits as t
        from tracevllm import LLM, SamplingParams
        from tracevllm.sampling_params import StructuredOutputsParams
        refused = []
        with LLM(model={tiny_model_dir!r}, enable_multiprocessing=False) as llm:
            for name, (schema, _) in t.HOSTILE.items():
                so = StructuredOutputsParams(json=schema)
                try:
                    llm.generate(["Hi"], SamplingParams(max_tokens=4, structured_outputs=so),
                                 use_tqdm=False)
                except ValueError as e:
                    refused.append(str(e).split(":")[0])
            so = StructuredOutputsParams(choice=["yes", "no"])
            [ok] = llm.generate(["Hi"], SamplingParams(max_tokens=4, structured_outputs=so),
                                use_tqdm=False)
        print(json.dumps([refused, ok.outputs[0].text]))
    """
    refused, text = _in_child(code, timeout=240)
    assert len(refused) == len(HOSTILE) and all(
        r.startswith("structured_outputs.json") for r in refused
    ), refused
    assert text in ("yes", "no")


# --- over HTTP ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_dir: str) -> Iterator[Any]:
    """``tracevllm serve`` with its default request-body limit (16 MiB): the
    100000-link chain (3.4 MB) reaches the entry's checks."""
    from tests.test_serving import Server

    s = Server(tiny_model_dir, "--max-request-body-size", str(16 * 1024 * 1024))
    yield s
    assert s.stop() == 0


def _complete(client: openai.OpenAI, structured_outputs: Any, **kw: Any) -> Any:
    from tests.test_serving import MODEL

    extra_body = {"structured_outputs": structured_outputs, **kw.pop("extra_body", {})}
    kw = {"max_tokens": 4, **kw}
    return client.completions.create(model=MODEL, prompt="Hi", extra_body=extra_body, **kw)


def test_hostile_constraints_over_http(server: Any) -> None:
    """A 400 naming ``structured_outputs`` (through ``structured_outputs`` or
    ``response_format``), quickly, and the server serves the next request."""
    from tests.test_serving import API_KEY, MODEL

    client = server.client(timeout=60)
    for name, (schema, words) in HOSTILE.items():
        if name == "4000 nested arrays":
            continue  # as an object, below; as text, past the size limit
        if name == "1000 nested objects":  # as text: the client's json.dumps would recurse
            schema = _nested_objects_text(1000)
        start = time.monotonic()
        with pytest.raises(openai.BadRequestError) as e:
            _complete(client, {"json": schema})
        body = e.value.body
        assert words in body["message"] and body["param"] == "structured_outputs", (name, body)
        assert time.monotonic() - start < 10, name
    schema = {"name": "x", "schema": HOSTILE["16000-link $ref chain"][0]}
    with pytest.raises(openai.BadRequestError, match=r"structured_outputs\.json.*\$refs"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": schema},
        )  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="allows no output at all"):
        _complete(client, {"regex": r"[^\s\S]"})
    # A body nested 8000 levels deep: the server's JSON parser refuses it
    # (FastAPI's "There was an error parsing the body").
    deep = _nested_arrays_text(4000)
    body = f'{{"model": "{MODEL}", "prompt": "Hi", "structured_outputs": {{"json": {deep}}}}}'
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    response = httpx.post(f"{server.url}/v1/completions", content=body, headers=headers)
    assert response.status_code == 400, response.text
    assert _complete(client, {"choice": ["yes", "no"]}).choices[0].text in ("yes", "no")


def test_a_row_that_allows_no_token_is_a_clear_error_over_http(server: Any) -> None:
    """A one-digit ``regex`` with ``min_tokens`` past it: after the digit, the
    grammar allows the stop token alone and min-tokens forbids it (a
    ``choice`` past its bytes is refused at the entry instead). Was a 500
    "Internal server error"; now a 400 saying why (whole and streamed: an
    error event in the stream), and the server serves on."""
    from tests.test_serving import MODEL

    client = server.client(timeout=60)
    so, min_tokens = {"regex": "[0-9]"}, {"min_tokens": 3}
    with pytest.raises(openai.BadRequestError) as e:
        _complete(client, so, max_tokens=8, extra_body=min_tokens)
    assert "min_tokens=3" in e.value.body["message"], e.value.body
    assert e.value.body["param"] == "structured_outputs"
    with pytest.raises(openai.BadRequestError, match="min_tokens=3"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
            extra_body={"structured_outputs": so, **min_tokens},
        )  # fmt: skip
    stream = _complete(client, so, max_tokens=8, extra_body=min_tokens, stream=True)
    with pytest.raises(openai.APIError, match="min_tokens=3"):  # noqa: PT012
        for _ in stream:
            pass
    assert _complete(client, {"choice": ["yes", "no"]}).choices[0].text in ("yes", "no")

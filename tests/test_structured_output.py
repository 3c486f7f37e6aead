"""Structured outputs through xgrammar's token bitmask.

On the real default model (one batch, two processes, so the constraints cross
the ZeroMQ boundary): JSON schemas of growing difficulty validated with
``jsonschema``, a regex, a choice list and an EBNF grammar, each with five
prompts, each run greedy and sampled; plain requests in the same batch untouched.
On the real model in one process with a small KV cache and a 32-token
budget: preemption, chunked prefill and prefix hits in the middle of
structured requests. Then what the engine does around them (n > 1 compiles
once, a failed compilation, the grammar ending the request), bad input at
the entry, the bitmask operation against xgrammar's, spans and views, CLI.
"""

from __future__ import annotations

import ast
import io
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from rich.console import Console

from tests import structured_cases as cases
from tracevllm import LLM, SamplingParams
from tracevllm.sampling_params import StructuredOutputsParams
from tracevllm.structured_output.utils import apply_grammar_bitmask, apply_token_bitmask_inplace

PLAIN_PROMPTS = ["What is the capital of France?", "Name three primary colors."]


def _params(so: StructuredOutputsParams | None, i: int, sampled: bool, **kw: Any) -> SamplingParams:
    if sampled:
        return SamplingParams(temperature=1.0, seed=i, structured_outputs=so, **kw)
    return SamplingParams(temperature=0.0, structured_outputs=so, **kw)


# Prompts per case, each run greedy and sampled. The batch's time is the
# real model's forwards (not the grammars: their compiling and masking take a
# few percent), so this is what sizes the module's longest fixture.
NUM_SUBJECTS = 5


def _workload() -> dict[str, tuple[list[Any], list[SamplingParams]]]:
    """Case name -> (2 x NUM_SUBJECTS chat prompts, their params): the first
    NUM_SUBJECTS greedy, the others the same prompts sampled."""
    cases_so: dict[str, tuple[str, StructuredOutputsParams, int]] = {
        name: (
            template,
            StructuredOutputsParams(json=schema, disable_any_whitespace=compact),
            200,
        )
        for name, (schema, template, compact) in cases.SCHEMAS.items()
    }
    cases_so["regex"] = (cases.DATE_PROMPT, StructuredOutputsParams(regex=cases.DATE_REGEX), 32)
    cases_so["choice"] = (
        cases.SENTIMENT_PROMPT,
        StructuredOutputsParams(choice=cases.SENTIMENTS),
        16,
    )
    cases_so["grammar"] = (
        cases.ARITHMETIC_PROMPT,
        StructuredOutputsParams(grammar=cases.ARITHMETIC),
        48,
    )
    work = {}
    for name, (template, so, max_tokens) in cases_so.items():
        prompts = cases.chat(template)[:NUM_SUBJECTS] * 2
        n = len(prompts)
        params = [_params(so, i, i >= NUM_SUBJECTS, max_tokens=max_tokens) for i in range(n)]
        work[name] = (prompts, params)
    return work


@pytest.fixture(scope="module")
def llm(default_model_dir: str) -> Any:
    """The real model, engine core in its own process (the default)."""
    with LLM(model=default_model_dir) as llm:
        yield llm


@pytest.fixture(scope="module")
def runs(llm: LLM) -> dict[str, list[Any]]:
    """Every case in one batch, with two plain greedy requests among them."""
    work = _workload()
    prompts = [p for ps, _ in work.values() for p in ps]
    params = [p for _, ps in work.values() for p in ps]
    plain = [[{"role": "user", "content": p}] for p in PLAIN_PROMPTS]
    plain_params = SamplingParams(temperature=0.0, max_tokens=24)
    outputs = llm.chat(prompts + plain, params + [plain_params] * len(plain), use_tqdm=False)
    result, i = {}, 0
    for name, (ps, _) in work.items():
        result[name] = [o.outputs[0] for o in outputs[i : i + len(ps)]]
        i += len(ps)
    result["plain"] = [o.outputs[0] for o in outputs[i:]]
    return result


def _report(bad: list[str]) -> str:
    return f"{len(bad)} invalid:\n" + "\n".join(bad)


# --- the real model: every output obeys its constraint ---------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", list(cases.SCHEMAS))
def test_json_outputs_parse_and_validate(runs: dict[str, list[Any]], name: str) -> None:
    schema = cases.SCHEMAS[name][0]
    bad = []
    for i, completion in enumerate(runs[name]):
        try:
            jsonschema.validate(json.loads(completion.text), schema)
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            kind = "sampled" if i >= NUM_SUBJECTS else "greedy"
            number = i % NUM_SUBJECTS
            bad.append(f"{kind} #{number} ({completion.finish_reason}): {completion.text!r}: {e}")
    assert not bad, _report(bad)
    assert all(c.finish_reason == "stop" for c in runs[name])


@pytest.mark.slow
def test_regex_outputs_fully_match(runs: dict[str, list[Any]]) -> None:
    bad = [c.text for c in runs["regex"] if not re.fullmatch(cases.DATE_REGEX, c.text)]
    assert not bad, _report(bad)


@pytest.mark.slow
def test_choice_outputs_are_one_of_the_choices(runs: dict[str, list[Any]]) -> None:
    texts = [c.text for c in runs["choice"]]
    assert all(t in cases.SENTIMENTS for t in texts), texts
    assert len(set(texts)) > 1  # the model did choose


def _is_arithmetic(text: str) -> bool:
    """Parses as numbers joined by + - * / (and parentheses), nothing else."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div)
    return all(isinstance(node, allowed) for node in ast.walk(tree))


@pytest.mark.slow
def test_grammar_outputs_parse(runs: dict[str, list[Any]]) -> None:
    bad = [c.text for c in runs["grammar"] if not _is_arithmetic(c.text)]
    assert not bad, _report(bad)


@pytest.mark.slow
def test_plain_requests_beside_structured_ones_are_untouched(
    llm: LLM, runs: dict[str, list[Any]]
) -> None:
    """The bitmask touches only the structured rows: two plain greedy
    requests batched with the structured ones give the tokens they give alone."""
    alone = llm.chat(
        [[{"role": "user", "content": p}] for p in PLAIN_PROMPTS],
        SamplingParams(temperature=0.0, max_tokens=24),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in alone] == [c.token_ids for c in runs["plain"]]


@pytest.mark.slow
def test_preemption_chunked_prefill_and_prefix_hits(
    default_model_dir: str, runs: dict[str, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three nested-schema requests in a KV cache too small for all three, a
    32-token budget (chunked prefill) and prefix caching: preempted in the
    middle of their JSON and resumed, their outputs still validate, and equal
    the same greedy requests run in the big batch without preemption."""
    from tracevllm.core.sched.scheduler import Scheduler

    # (request, output tokens, tokens its matcher had accepted) at each preemption.
    preempted: list[tuple[str, int, int]] = []
    preempt = Scheduler._preempt_request

    def recording_preempt(self: Scheduler, request: Any, timestamp: float) -> None:
        grammar = request.structured_output_request.grammar
        preempted.append((request.request_id, request.num_output_tokens,
                          grammar.num_processed_tokens))  # fmt: skip
        preempt(self, request, timestamp)

    monkeypatch.setattr(Scheduler, "_preempt_request", recording_preempt)
    schema, template, compact = cases.SCHEMAS["nested"]
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=compact)
    with LLM(
        model=default_model_dir,
        enable_multiprocessing=False,
        num_gpu_blocks_override=24,
        max_model_len=24 * 16,
        max_num_batched_tokens=32,
    ) as small:
        outputs = small.chat(
            cases.chat(template)[:3],
            SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=so),
            use_tqdm=False,
        )
        num_preemptions = small.llm_engine.num_preemptions
    assert num_preemptions > 0 and len(preempted) > 0
    # Preempted with output already written, its matcher that far into the JSON.
    assert all(n_out > 0 and n_matched == n_out for _, n_out, n_matched in preempted), preempted
    # ... and each went on writing after it was resumed.
    final = {o.request_id: len(o.outputs[0].token_ids) for o in outputs}
    by_internal_id = {req_id: n_out for req_id, n_out, _ in preempted}
    assert len(final) == 3 and len(by_internal_id) > 0
    for req_id, n_out in by_internal_id.items():
        (external,) = [e for e in final if req_id.startswith(e)]
        assert final[external] > n_out, (req_id, n_out, final)
    # The chat template's system prompt, a full block, is shared.
    assert [o.num_cached_tokens > 0 for o in outputs] == [False, True, True]
    for got, want in zip(outputs, runs["nested"][:3]):
        jsonschema.validate(json.loads(got.outputs[0].text), schema)
        assert got.outputs[0].token_ids == want.token_ids


# --- the engine around a grammar: one process ------------------------------------


@pytest.fixture(scope="module")
def inproc(default_model_dir: str) -> Any:
    with LLM(model=default_model_dir, enable_multiprocessing=False) as llm:
        yield llm


def _backend(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.engine_core.structured_output_manager.backend


@pytest.mark.slow
def test_n_children_share_one_compilation(inproc: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """n = 4: four outputs, each valid, from one compilation: the children
    join it while it runs, or find it in the compiler's cache after."""
    backend = _backend(inproc) or _first_backend(inproc)
    compiled: list[str] = []
    compile_fn = backend._compile

    def counting_compile(kind: Any, spec: str, any_whitespace: bool) -> Any:
        before = backend.compiler.get_cache_size_bytes()
        ctx = compile_fn(kind, spec, any_whitespace)
        if backend.compiler.get_cache_size_bytes() != before:  # a miss: compiled
            compiled.append(spec)
        return ctx

    monkeypatch.setattr(backend, "_compile", counting_compile)
    schema = dict(cases.FLAT, title="n children")  # a key no other test compiled
    params = SamplingParams(
        n=4,
        temperature=1.0,
        seed=3,
        max_tokens=200,
        structured_outputs=StructuredOutputsParams(json=schema),
    )
    [output] = inproc.chat(cases.chat(cases.SCHEMAS["flat"][1])[:1], params, use_tqdm=False)
    assert len(output.outputs) == 4
    for completion in output.outputs:
        jsonschema.validate(json.loads(completion.text), schema)
    assert len(compiled) == 1


def test_the_compiled_grammar_cache_is_bounded(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRACEVLLM_XGRAMMAR_CACHE_MB (vLLM's VLLM_XGRAMMAR_CACHE_MB, 512 by
    default) is the limit of xgrammar's compiler cache, and holds."""
    from tracevllm.structured_output.backend_types import StructuredOutputOptions
    from tracevllm.structured_output.backend_xgrammar import XgrammarBackend

    monkeypatch.delenv("TRACEVLLM_XGRAMMAR_CACHE_MB", raising=False)
    assert XgrammarBackend(tokenizer, 49152).compiler.cache_limit_bytes == 512 * 1024 * 1024
    for bad in ("-1", "1.5", "lots", "True"):  # named, and what it takes, before xgrammar
        monkeypatch.setenv("TRACEVLLM_XGRAMMAR_CACHE_MB", bad)
        with pytest.raises(ValueError, match="TRACEVLLM_XGRAMMAR_CACHE_MB must be a whole number"):
            XgrammarBackend(tokenizer, 49152)
    monkeypatch.setenv("TRACEVLLM_XGRAMMAR_CACHE_MB", "1")
    backend = XgrammarBackend(tokenizer, 49152)
    assert backend.compiler.cache_limit_bytes == 1024 * 1024
    sizes = []
    for i in range(80):  # each some 40 KB: three times the limit in all
        schema = json.dumps({"type": "object", "properties": {f"k{i}": {"type": "string"}}})
        backend.compile_grammar(StructuredOutputOptions.JSON, schema)
        sizes.append(backend.compiler.get_cache_size_bytes())
    assert sum(sizes) / len(sizes) > 1024 * 1024 / 20  # the grammars were cached
    assert max(sizes) <= 1024 * 1024 * 1.2, sizes


def _first_backend(llm: LLM) -> Any:
    """Make the backend (it comes with the first structured request)."""
    so = StructuredOutputsParams(choice=["a"])
    llm.generate(["x"], SamplingParams(max_tokens=2, structured_outputs=so), use_tqdm=False)
    return _backend(llm)


@pytest.mark.slow
def test_a_grammar_that_fails_to_compile_fails_its_request_only(
    inproc: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the entry's check, a compilation that raises on the engine's
    thread pool finishes its request with an error; the engine serves on."""
    backend = _backend(inproc) or _first_backend(inproc)
    compile_fn = backend._compile

    def compile_or_fail(kind: Any, spec: str, ws: bool) -> Any:
        if spec == "fail[0-9]":
            raise RuntimeError("the compiler broke")
        return compile_fn(kind, spec, ws)

    monkeypatch.setattr(backend, "_compile", compile_or_fail)
    bad = SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(regex="fail[0-9]")
    )
    good = SamplingParams(temperature=0.0, max_tokens=8)
    outputs = inproc.generate(["Hello", "Hello"], [bad, good], use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "error"
    assert outputs[0].outputs[0].stop_reason == (
        "structured_outputs.regex: the engine could not compile it: the compiler broke"
    )
    assert outputs[0].outputs[0].token_ids == []
    assert outputs[1].outputs[0].finish_reason in ("stop", "length")
    assert len(outputs[1].outputs[0].token_ids) > 0


@pytest.mark.slow
def test_the_request_ends_when_its_grammar_ends(inproc: LLM) -> None:
    """Under ignore_eos the stop token does not stop a request; its grammar
    has ended, though, and so does the request (no token after it)."""
    so = StructuredOutputsParams(choice=cases.SENTIMENTS)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, structured_outputs=so)
    [output] = inproc.chat(cases.chat(cases.SENTIMENT_PROMPT)[:1], params, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.text in cases.SENTIMENTS
    assert completion.finish_reason == "stop"
    eos = inproc.get_tokenizer().eos_token_id
    assert completion.token_ids[-1] == eos and eos not in completion.token_ids[:-1]


# --- bad input at the entry --------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"json": {"type": "object"}, "regex": "a+"}, ValueError, "only one kind.*json and regex"),
        ({}, ValueError, "one kind of constraint must be set"),
        ({"choice": []}, ValueError, r"structured_outputs\.choice cannot be an empty list"),
        ({"choice": ["a", 1]}, TypeError, r"structured_outputs\.choice must be"),
        ({"grammar": "  "}, ValueError, r"structured_outputs\.grammar cannot be an empty string"),
        ({"json_object": True, "whitespace_pattern": " "}, ValueError, "whitespace_pattern"),
    ],
)
def test_bad_constraints_are_refused_when_made(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        StructuredOutputsParams(**kwargs)
    with pytest.raises(TypeError, match="structured_outputs must be StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"json": {"type": "nosuch"}},
            r"structured_outputs\.json: xgrammar cannot compile this JSON schema: "
            r'Unsupported type "nosuch"',
        ),
        ({"json": "{not json"}, r"structured_outputs\.json is not valid JSON"),
        ({"json": {"type": "integer", "multipleOf": 3}}, "features xgrammar does not support"),
        (
            {"regex": "[a-"},
            r"structured_outputs\.regex: xgrammar cannot compile this regex: "
            r"Regex parsing error at position 4: Unclosed '\['",
        ),
        (
            {"grammar": "root ::= expr"},
            r"structured_outputs\.grammar: xgrammar cannot compile this EBNF grammar: .*expr",
        ),
    ],
)
def test_what_xgrammar_cannot_compile_is_refused_and_the_engine_serves_on(
    llm: LLM, kwargs: dict[str, Any], message: str
) -> None:
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**kwargs))
    with pytest.raises(ValueError, match=message):
        llm.generate(["Hello"], params, use_tqdm=False)
    so = StructuredOutputsParams(choice=["yes", "no"])
    [ok] = llm.generate(["Yes or no?"], SamplingParams(max_tokens=4, structured_outputs=so))
    assert ok.outputs[0].text in ("yes", "no")


# --- the bitmask ---------------------------------------------------------------------


@pytest.mark.parametrize("vocab_size", [64, 100])
def test_apply_token_bitmask_matches_xgrammar(vocab_size: int) -> None:
    """tracevllm's PyTorch version of the masking gives xgrammar's result,
    with a vocabulary that is not a multiple of 32 and a subset of rows."""
    import xgrammar as xgr

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, vocab_size, generator=gen)
    words = (vocab_size + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, words), generator=gen, dtype=torch.int32)
    bitmask[2] = -1  # every token allowed
    for indices in (None, [0, 3, 4]):
        want, got = logits.clone(), logits.clone()
        xgr.apply_token_bitmask_inplace(want, bitmask, indices=indices)
        apply_token_bitmask_inplace(got, bitmask, indices=indices)
        assert torch.equal(got, want), indices


class _Batch:
    def __init__(self, req_ids: list[str]) -> None:
        self.req_ids = req_ids
        self.req_id_to_index = {r: i for i, r in enumerate(req_ids)}


def test_bitmask_rows_go_to_their_requests_rows() -> None:
    """The scheduler's rows (scheduling order) land on the runner's rows
    (batch order); the rows of other requests are not touched."""
    from tracevllm.core.sched.output import GrammarOutput, SchedulerOutput

    logits = torch.zeros(4, 64)
    bitmask = torch.zeros(2, 2, dtype=torch.int32).numpy()
    bitmask[0, 0] = 0b1  # request "d": token 0 only
    bitmask[1, 1] = 0b10  # request "b": token 33 only
    grammar_output = GrammarOutput(["d", "b"], bitmask)
    apply_grammar_bitmask(
        SchedulerOutput.make_empty(), grammar_output, _Batch(list("abcd")), logits
    )
    allowed = [torch.nonzero(row > float("-inf")).flatten().tolist() for row in logits]
    assert allowed == [list(range(64)), [33], list(range(64)), [0]]


def test_bitmask_goes_to_the_logits_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bitmask is built on the CPU (numpy) and moved to the logits'
    device before it is applied, as vLLM's. The meta device stands in for
    a GPU: like CUDA, it refuses an operation that mixes it with the CPU."""
    from tracevllm.core.sched.output import GrammarOutput, SchedulerOutput
    from tracevllm.structured_output import utils

    seen: list[torch.device] = []
    apply = utils.apply_token_bitmask_inplace

    def spy(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int] | None) -> None:
        seen.append(bitmask.device)
        apply(logits, bitmask, indices)

    monkeypatch.setattr(utils, "apply_token_bitmask_inplace", spy)
    logits = torch.zeros(4, 64, device="meta")
    grammar_output = GrammarOutput(["d", "b"], torch.zeros(2, 2, dtype=torch.int32).numpy())
    apply_grammar_bitmask(
        SchedulerOutput.make_empty(), grammar_output, _Batch(list("abcd")), logits
    )
    assert seen == [logits.device]


# --- spans, views, command line (the tiny model) -----------------------------------


def test_min_tokens_past_the_grammars_end_is_an_error(tiny_model_dir: str) -> None:
    """The grammar allows the stop token alone, min-tokens forbids it: every
    logit is -inf, token 0 comes out and the grammar refuses it. vLLM ends
    the request with an error and keeps token 0 (a 500 over HTTP); tracevllm
    drops it and says why (stop_reason; a 400 over HTTP). A plain request in
    the same batch carries on, and the KV blocks are all freed."""
    so = StructuredOutputsParams(regex="[0-9]")
    with LLM(model=tiny_model_dir, enable_multiprocessing=False) as tiny:
        scheduler = tiny.llm_engine.engine_core.engine_core.scheduler
        for temperature in (0.0, 1.0):
            params = SamplingParams(
                temperature=temperature, seed=1, max_tokens=8, min_tokens=3, structured_outputs=so
            )
            plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            outs = tiny.generate(["Pick a digit:", "Hello"], [params, plain], use_tqdm=False)
            out = outs[0].outputs[0]
            assert out.finish_reason == "error" and re.fullmatch("[0-9]", out.text), out
            assert len(out.token_ids) == 1, out  # the digit; not token 0
            assert out.stop_reason == (
                "structured_outputs.regex: after 1 output token the constraint allows only a "
                "stop token, which min_tokens=3 forbids before 3 tokens; the request ended there."
            )
            assert len(outs[1].outputs[0].token_ids) == 8
            assert scheduler.kv_cache_manager.usage == 0.0
            assert not scheduler.requests


def test_a_constraint_that_allows_no_token_midway_is_a_clear_error(tiny_model_dir: str) -> None:
    """After "a" nothing can follow, in a grammar too large for the entry's
    check to compile (over 8 KiB: unused rules): the request ends with an
    error at that dead end, saying so, not with the grammar refusing token 0."""
    from tracevllm.structured_output.limits import EMPTINESS_CHECK_MAX_CHARS

    unused = "\n".join(f'pad{i} ::= "x"' for i in range(700))
    grammar = f'root ::= "a" dead\ndead ::= dead\n{unused}'
    assert len(grammar) > EMPTINESS_CHECK_MAX_CHARS
    so = StructuredOutputsParams(grammar=grammar)
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=so)
    with LLM(model=tiny_model_dir, enable_multiprocessing=False) as tiny:
        out = tiny.generate(["a"], params, use_tqdm=False)[0].outputs[0]
    assert out.text == "a" and out.finish_reason == "error", out
    assert out.stop_reason == (
        "structured_outputs.grammar: after 1 output token the constraint allows no token at "
        "all (no text that begins with the output so far matches it); the request ended there."
    )


@pytest.mark.parametrize("drafts", [False, True])
def test_ignore_eos_stops_at_the_grammars_end_with_or_without_drafts(
    tiny_model_dir: str, tokenizer: Any, drafts: bool
) -> None:
    """Under ignore_eos the grammar's stop token does not stop a request; its
    grammar has ended, and tracevllm stops it there. With n-gram drafts the
    stop token can come as an accepted draft, followed by the bonus token,
    drawn from a row that allows everything (vLLM's: a terminated grammar
    masks nothing): that token used to reach the grammar, which refused it
    (finish reason "error"). The prompt makes the drafter propose the stop
    token: "7" then the stop token, twice."""
    seven = tokenizer.convert_tokens_to_ids("7")
    eos = tokenizer.eos_token_id
    prompt = {"prompt_token_ids": tokenizer.encode("Pick:") + [seven, eos] * 2}
    so = StructuredOutputsParams(choice=["7"])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, structured_outputs=so)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    rows: list[list[int]] = []
    with LLM(
        model=tiny_model_dir,
        enable_multiprocessing=False,
        speculative_config=spec if drafts else None,
    ) as tiny:
        scheduler = tiny.llm_engine.engine_core.engine_core.scheduler
        update = scheduler.update_from_output

        def recording_update(scheduler_output: Any, model_runner_output: Any) -> Any:
            rows.extend(model_runner_output.sampled_token_ids)
            return update(scheduler_output, model_runner_output)

        scheduler.update_from_output = recording_update
        out = tiny.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [seven, eos] and out.finish_reason == "stop", out
    if drafts:  # the case: the stop token accepted as a draft, a bonus token after it
        assert any(eos in row[:-1] for row in rows), rows


def test_spans_and_the_step_view(tiny_model_dir: str, tmp_path: Path) -> None:
    """A compilation span in the request's trace (compiled, then from the cache), a
    bitmask span per step with how many tokens the mask allowed (the ten
    digits, then the stop token alone), and the step view showing it."""
    from tracevllm.tracing.exporters import read_spans_jsonl
    from tracevllm.views.report import render_report

    so = StructuredOutputsParams(regex="[0-9]")
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=so)
    with LLM(
        model=tiny_model_dir,
        enable_multiprocessing=False,
        trace_detail="request",
        trace_dir=str(tmp_path),
    ) as tiny:
        first = tiny.generate(["Pick a digit:"], params, use_tqdm=False)[0].outputs[0]
        tiny.generate(["Pick a digit:"], params, use_tqdm=False)
    assert re.fullmatch("[0-9]", first.text)
    spans = read_spans_jsonl(str(tmp_path / "spans.jsonl"))
    compiles = [s for s in spans if s.name == "StructuredOutputManager._create_grammar"]
    # The second finds the grammar in the compiler's cache: it does not grow.
    assert [s.attributes["tracevllm.structured_output.joined"] for s in compiles] == [False] * 2
    cache_bytes = [
        s.attributes["tracevllm.structured_output.compiler_cache_bytes"] for s in compiles
    ]
    assert cache_bytes[0] == cache_bytes[1] > 0
    requests = [s for s in spans if s.name == "llm_request"]
    assert [s.trace_id for s in compiles] == [s.trace_id for s in requests]
    # (A step with no structured request to mask, e.g. while the grammar
    # compiles, records an empty list.)
    masks = [
        allowed
        for s in spans
        if s.name == "Scheduler.get_grammar_bitmask"
        and (allowed := s.attributes["tracevllm.structured_output.num_allowed_tokens"])
    ]
    assert masks == [[10], [1], [10], [1]]
    console = Console(record=True, width=160, file=io.StringIO())
    render_report(spans, console)
    text = console.export_text()
    assert "regex 10" in text and "regex 1 " in text


def test_the_step_view_marks_structured_rows() -> None:
    from tracevllm.views.step import render_step, with_grammar

    row = {"kind": "cached", "num_computed_tokens": 9, "num_scheduled_tokens": 1}
    row |= {"num_tokens": 10, "num_prompt_tokens": 8, "block_ids": [1]}
    view = {
        "step": 3,
        "token_budget": {"used": 3, "total": 32},
        "block_size": 16,
        "requests": [
            dict(row, req_id="a", structured="json"),
            dict(row, req_id="b", structured=None),
            dict(row, req_id="c", structured="choice"),
        ],
        "kv": {"total": 10, "free": 7, "used": 3, "cached_free": 0},
    }
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(render_step(with_grammar(view, {"a": 12})))
    text = console.export_text()
    assert "mask" in text and "json 12" in text
    assert "choice –" in text  # no row this step (mid-prefill)


def test_cli_constraints(
    tiny_model_dir: str, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tracevllm generate --choice / --regex / --json-schema`` (a random
    model, so only the constraint can make these outputs)."""
    from tracevllm.entrypoints.cli import main

    monkeypatch.setenv("TRACEVLLM_ENABLE_MULTIPROCESSING", "0")  # faster: one process

    schema = tmp_path / "schema.json"
    # No object: a random model would fill the whitespace JSON allows between
    # its members until max_tokens.
    schema.write_text(json.dumps({"type": "string", "enum": ["red", "green"]}))
    base = ["generate", "--model", tiny_model_dir, "--prompt", "Hi", "--max-tokens", "24"]
    for flags, check in (
        (["--choice", "yes,no,maybe"], lambda t: t in ("yes", "no", "maybe")),
        (["--regex", "[a-c]{3}"], lambda t: re.fullmatch("[a-c]{3}", t)),
        (["--json-schema", str(schema)], lambda t: json.loads(t) in ("red", "green")),
    ):
        assert main([*base, *flags]) == 0
        # The completion, then a line "(N tokens, finish_reason=...)".
        text = capsys.readouterr().out.rsplit("\n(", 1)[0]
        assert check(text), (flags, text)
    assert main([*base, "--json-schema", str(tmp_path / "missing.json")]) == 2
    assert "--json-schema: cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--choice", "a,b", "--regex", "a"])  # one constraint at a time


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing_behind(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Aborted in WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR, a request leaves the
    scheduler's queues; a plain request beside it is served meanwhile."""
    import threading

    from tracevllm.request import RequestStatus
    from tracevllm.structured_output.backend_xgrammar import XgrammarBackend

    release = threading.Event()
    compile_fn = XgrammarBackend._compile

    def slow_compile(self: Any, kind: Any, spec: str, any_whitespace: bool) -> Any:
        release.wait(timeout=30)
        return compile_fn(self, kind, spec, any_whitespace)

    monkeypatch.setattr(XgrammarBackend, "_compile", slow_compile)
    with LLM(model=tiny_model_dir, enable_multiprocessing=False) as tiny:
        engine = tiny.llm_engine
        scheduler = engine.engine_core.engine_core.scheduler
        so = StructuredOutputsParams(regex="[0-9]+")
        engine.add_request("structured", "Digits:", SamplingParams(structured_outputs=so))
        engine.add_request("plain", "Hello", SamplingParams(temperature=0.0, max_tokens=4))
        [waiting] = scheduler.skipped_waiting
        assert waiting.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        finished = []
        while not finished:
            finished = [o for o in engine.step() if o.finished]
        assert [o.request_id for o in finished] == ["plain"]
        engine.abort_request(["structured"])
        release.set()
        assert not scheduler.skipped_waiting and not scheduler.waiting
        assert scheduler.get_num_unfinished_requests() == 0


def test_the_engine_waits_for_a_grammar_rather_than_spin(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While every request waits for its grammar, EngineCore.step_fn waits
    for a compilation (50 ms at a time) instead of running empty steps."""
    import time

    from tracevllm.structured_output.backend_xgrammar import XgrammarBackend

    compile_fn = XgrammarBackend._compile

    def slow_compile(self: Any, kind: Any, spec: str, any_whitespace: bool) -> Any:
        time.sleep(0.5)
        return compile_fn(self, kind, spec, any_whitespace)

    monkeypatch.setattr(XgrammarBackend, "_compile", slow_compile)
    so = StructuredOutputsParams(choice=["yes", "no"])
    with LLM(model=tiny_model_dir, enable_multiprocessing=False) as tiny:
        [out] = tiny.generate(["Yes?"], SamplingParams(max_tokens=4, structured_outputs=so))
        steps = tiny.llm_engine.engine_core.engine_core.scheduler.step_id
    assert out.outputs[0].text in ("yes", "no")
    # A few output tokens, and about ten 50 ms waits (vLLM would spin: thousands).
    assert steps < 30, steps

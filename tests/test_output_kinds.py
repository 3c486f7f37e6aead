"""``SamplingParams.output_kind``: what each ``LLMEngine.step`` returns per request.

CUMULATIVE outputs carry everything so far, DELTA outputs only what is new
(tokens, text and logprobs), FINAL_ONLY one output at the end. Each is driven
through ``LLMEngine.add_request`` / ``step`` on the tiny random Llama and checked
against ``LLM.generate`` (FINAL_ONLY) with the same prompt and parameters.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator

import pytest

from tracevllm import LLM, SamplingParams
from tracevllm.engine.llm_engine import LLMEngine
from tracevllm.outputs import CompletionOutput, RequestOutput
from tracevllm.sampling_params import RequestOutputKind

PROMPTS = ["Hello there, how", "The capital of France", "1 2 3 4 5 6 7 8 9 10"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llm(tiny_model_dir: str) -> Iterator[LLM]:
    llm = LLM(model=tiny_model_dir, num_gpu_blocks_override=64, enable_multiprocessing=False)
    yield llm
    llm.shutdown()


def _greedy(kind: RequestOutputKind, **kw: object) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind=kind, **kw
    )


def _reference(llm: LLM, prompts: list[str], params: SamplingParams) -> list[RequestOutput]:
    # LLM.generate clones the params and asks for FINAL_ONLY outputs.
    return llm.generate(prompts, params, use_tqdm=False)


def _run(
    engine: LLMEngine,
    requests: list[tuple[str, str, SamplingParams]],
    on_output: Callable[[RequestOutput], None] | None = None,
) -> dict[str, list[RequestOutput]]:
    """Add the requests, step until all finish; every output, by request id.

    ``on_output`` sees each output as the step returns it (a CUMULATIVE
    output's logprobs list is the request's own, which later steps extend).
    """
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, list[RequestOutput]] = defaultdict(list)
    for _ in range(10 * MAX_TOKENS):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if on_output is not None:
                on_output(output)
            outputs[output.request_id].append(output)
    assert not engine.has_unfinished_requests()
    return outputs


def _single(output: RequestOutput) -> CompletionOutput:
    assert len(output.outputs) == 1 and output.outputs[0].index == 0
    return output.outputs[0]


def _only_last_is_finished(outputs: list[RequestOutput]) -> None:
    assert outputs and outputs[-1].finished
    assert not any(o.finished for o in outputs[:-1])
    assert outputs[-1].outputs[0].finish_reason == "length"
    assert all(c.finish_reason is None for o in outputs[:-1] for c in o.outputs)


def test_cumulative_outputs_grow_to_the_reference(llm: LLM) -> None:
    params = _greedy(RequestOutputKind.CUMULATIVE, logprobs=1)
    ref = _single(_reference(llm, PROMPTS[:1], params)[0])
    logprobs_lens: list[tuple[int, int]] = []

    def on_output(output: RequestOutput) -> None:
        c = _single(output)
        assert c.logprobs is not None
        logprobs_lens.append((len(c.logprobs), len(c.token_ids)))

    outputs = _run(llm.llm_engine, [("cum", PROMPTS[0], params)], on_output)["cum"]

    assert len(outputs) > 1, "CUMULATIVE streams an output per step"
    _only_last_is_finished(outputs)
    prev_ids: list[int] = []
    prev_text = ""
    for output in outputs:
        assert output.request_id == "cum" and output.prompt == PROMPTS[0]
        c = _single(output)
        # Each output holds every token so far: the previous ones, plus new ones.
        assert len(c.token_ids) > len(prev_ids) and c.token_ids[: len(prev_ids)] == prev_ids
        assert c.text.startswith(prev_text)
        prev_ids, prev_text = c.token_ids, c.text
    # When returned, each output had one logprobs entry per token so far.
    assert all(n_lp == n_ids for n_lp, n_ids in logprobs_lens)
    assert len(logprobs_lens) == len(outputs)
    last = _single(outputs[-1])
    assert last.logprobs is not None and len(last.logprobs) == MAX_TOKENS
    assert len(ref.token_ids) == MAX_TOKENS
    assert last.token_ids == ref.token_ids and last.text == ref.text
    assert last.cumulative_logprob == pytest.approx(ref.cumulative_logprob)


def test_delta_outputs_concatenate_to_the_reference(llm: LLM) -> None:
    params = _greedy(RequestOutputKind.DELTA, logprobs=1)
    ref = _single(_reference(llm, PROMPTS[:1], params)[0])
    outputs = _run(llm.llm_engine, [("delta", PROMPTS[0], params)])["delta"]

    assert len(outputs) > 1, "DELTA streams an output per step"
    _only_last_is_finished(outputs)
    token_ids: list[int] = []
    text = ""
    logprobs = []
    for output in outputs:
        c = _single(output)
        # Only the new tokens, each with its own logprobs entry (1 requested:
        # the sampled token, which greedy makes the top one too).
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        for token_id, position in zip(c.token_ids, c.logprobs):
            assert position[token_id].rank == 1
        token_ids += c.token_ids
        text += c.text
        logprobs += c.logprobs
    assert token_ids == ref.token_ids and len(token_ids) == MAX_TOKENS
    assert text == ref.text
    assert ref.logprobs is not None
    assert [p[t].logprob for t, p in zip(token_ids, logprobs)] == pytest.approx(
        [p[t].logprob for t, p in zip(ref.token_ids, ref.logprobs)]
    )


def test_delta_without_logprobs_has_none(llm: LLM) -> None:
    outputs = _run(llm.llm_engine, [("delta-nolp", PROMPTS[1], _greedy(RequestOutputKind.DELTA))])
    for output in outputs["delta-nolp"]:
        c = _single(output)
        assert c.logprobs is None and c.cumulative_logprob is None


def test_final_only_returns_one_finished_output(llm: LLM) -> None:
    params = _greedy(RequestOutputKind.FINAL_ONLY, logprobs=1)
    ref = _single(_reference(llm, PROMPTS[:1], params)[0])
    outputs = _run(llm.llm_engine, [("final", PROMPTS[0], params)])["final"]

    assert len(outputs) == 1
    _only_last_is_finished(outputs)
    c = _single(outputs[0])
    assert c.token_ids == ref.token_ids and len(c.token_ids) == MAX_TOKENS
    assert c.text == ref.text
    assert c.logprobs is not None and len(c.logprobs) == MAX_TOKENS


def test_kinds_are_kept_per_request_in_one_batch(llm: LLM) -> None:
    """Three requests sharing every step, one per kind (the reference runs the
    same three prompts as one batch too, so the numerics match)."""
    kinds = [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY]
    refs = [_single(r) for r in _reference(llm, PROMPTS, _greedy(RequestOutputKind.FINAL_ONLY))]
    requests = [(k.name, p, _greedy(k)) for k, p in zip(kinds, PROMPTS)]
    outputs = _run(llm.llm_engine, requests)

    cum, delta, final = (outputs[k.name] for k in kinds)
    assert len(cum) == len(delta) > 1 and len(final) == 1
    assert _single(cum[-1]).token_ids == refs[0].token_ids
    assert _single(cum[-1]).text == refs[0].text
    assert sum((_single(o).token_ids for o in delta), []) == refs[1].token_ids
    assert "".join(_single(o).text for o in delta) == refs[1].text
    assert _single(final[0]).token_ids == refs[2].token_ids
    assert _single(final[0]).text == refs[2].text


def test_n2_delta_streams_each_completion(llm: LLM) -> None:
    """vLLM semantics: with n > 1 and DELTA, each output carries one child's
    new tokens (under the parent's id); per index they add up to the final
    completion that the same seed gives. Only the last output is finished."""
    params = SamplingParams(
        n=2,
        temperature=1.0,
        seed=7,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    ref = _reference(llm, PROMPTS[:1], params)[0]
    assert [c.index for c in ref.outputs] == [0, 1]
    assert ref.outputs[0].token_ids != ref.outputs[1].token_ids
    outputs = _run(llm.llm_engine, [("n2", PROMPTS[0], params)])["n2"]

    assert outputs and outputs[-1].finished
    assert not any(o.finished for o in outputs[:-1])
    assert all(o.request_id == "n2" and len(o.outputs) == 1 for o in outputs)
    token_ids: dict[int, list[int]] = defaultdict(list)
    text: dict[int, str] = defaultdict(str)
    for output in outputs:
        for c in output.outputs:
            token_ids[c.index] += c.token_ids
            text[c.index] += c.text
    for c in ref.outputs:
        assert token_ids[c.index] == c.token_ids
        assert text[c.index] == c.text

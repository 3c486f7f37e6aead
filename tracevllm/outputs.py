"""Outputs: what ``LLM.generate`` returns, and what the model runner returns.

Two vLLM files in one, since dropping ``v1/`` makes their paths meet:
- vllm/outputs.py: ``RequestOutput``, ``CompletionOutput`` (and vllm/logprobs.py's
  ``Logprob``), what the user gets back.
- vllm/v1/outputs.py: ``ModelRunnerOutput``, what ``execute_model`` hands the
  scheduler each step, with its ``KVConnectorOutput``. It holds plain lists so
  that the scheduler never imports torch; the tensor types (``SamplerOutput``, ``LogprobsTensors``)
  live in sample/metadata.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tracevllm.engine import LogprobsLists
from tracevllm.metrics.stats import RequestStateStats


@dataclass(slots=True)
class Logprob:
    """The log probability of one token, its rank, and its text (vllm/logprobs.py)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated position: token id -> Logprob (the sampled id and the top-k ids).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a request (``n`` > 1 gives several)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    # "stop", "length" or "abort"; None while running.
    finish_reason: str | None = None
    # The stop string or stop token id that ended it; None for EOS or length.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Prompt tokens whose KV came from the prefix cache or a KV connector.
    num_cached_tokens: int = 0
    metrics: RequestStateStats | None = None
    # What a KV connector returned when the request finished (vLLM's): a
    # producer's tells a consumer where to find the prompt's KV.
    kv_transfer_params: dict[str, Any] | None = None

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a later output of the same request into this one.

        ``AsyncLLM``'s collector does this when the producer runs ahead of a
        slow reader: DELTA outputs are concatenated (``aggregate``), the
        other kinds replaced, completion by completion (by index, for n > 1).
        """
        self.finished |= next_output.finished
        for next_completion in next_output.outputs:
            for i, completion in enumerate(self.outputs):
                if completion.index != next_completion.index:
                    continue
                if aggregate:
                    completion.text += next_completion.text
                    completion.token_ids.extend(next_completion.token_ids)
                    if next_completion.logprobs:
                        assert completion.logprobs is not None
                        completion.logprobs.extend(next_completion.logprobs)
                    completion.cumulative_logprob = next_completion.cumulative_logprob
                    completion.finish_reason = next_completion.finish_reason
                    completion.stop_reason = next_completion.stop_reason
                else:
                    self.outputs[i] = next_completion
                break
            else:
                self.outputs.append(next_completion)


@dataclass(slots=True)
class ModelRunnerOutput:
    """One step's result from the model runner (vllm/v1/outputs.py)."""

    # Requests in the order of the batch.
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # One list per request: the sampled token (empty for a partial prefill,
    # whose logits are sampled and thrown away); with drafts, the accepted
    # drafts and one more token.
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: LogprobsLists | None = None
    # What the worker's KV connector finished or failed this step.
    kv_connector_output: KVConnectorOutput | None = None


@dataclass(slots=True)
class KVConnectorOutput:
    """The worker-side KV connector's report for one step (vllm/v1/outputs.py).

    Left out: connector stats, KV cache events, worker metadata and the
    expected finished count (for connectors with several workers per request).
    """

    # Requests whose asynchronous save/send finished: their blocks can go.
    finished_sending: set[str] | None = None
    # Requests whose asynchronous load/receive finished: they can run.
    finished_recving: set[str] | None = None
    # Blocks of externally computed tokens that failed to load: the requests
    # that hold them recompute them or fail (kv_load_failure_policy).
    invalid_block_ids: set[int] = field(default_factory=set)

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={})


class AsyncModelRunnerOutput:
    """A step's result whose sampled tokens may still be on their way to the
    host (async scheduling; vllm/v1/outputs.py). ``get_output`` waits for them."""

    def get_output(self) -> ModelRunnerOutput:
        raise NotImplementedError


@dataclass(slots=True)
class DraftTokenIds:
    """The drafts proposed after a step, for the next one (vllm/v1/outputs.py)."""

    # Requests in the order of the batch.
    req_ids: list[str]
    # One list per request (empty: no drafts).
    draft_token_ids: list[list[int]]

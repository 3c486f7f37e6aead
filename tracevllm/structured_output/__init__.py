"""Structured outputs: the engine-side manager of grammars and bitmasks.

Mirrors vllm/v1/structured_output/__init__.py (``StructuredOutputManager``):
``grammar_init`` compiles a request's constraint on a thread pool (the
request waits in ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`` meanwhile),
``grammar_bitmask`` fills one row of the token bitmask per structured request
the scheduler scheduled (with drafts, one row per draft position and one
more), ``should_advance`` says whether a sampled token moves the request's
matcher. Lives in the engine-core process, beside the scheduler. Left out:
reasoning parsers (constraints that start after the model's reasoning), the
parallel bitmask fill for batches over 128 structured requests, backends
other than xgrammar. The backend is
made (and the tokenizer loaded) with the first structured request, as vLLM's;
the pool too (vLLM's: in ``__init__``), as its threads start at once, with a
256 MiB stack (large_stack.py; vLLM's have the default one, and xgrammar
recurses in C++).
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING

from tracevllm import tracing
from tracevllm.structured_output.large_stack import LargeStackExecutor
from tracevllm.tracing import records

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch

    from tracevllm.config import VllmConfig
    from tracevllm.request import Request
    from tracevllm.structured_output.backend_xgrammar import XgrammarBackend, XgrammarGrammar


class StructuredOutputManager:
    """Engine-level manager for structured output requests."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.backend: XgrammarBackend | None = None
        self._grammar_bitmask: torch.Tensor | None = None
        # Made with the backend: its threads start at once (large_stack.py).
        self.executor: LargeStackExecutor | None = None

    # --8<-- [start:grammar_init]
    def grammar_init(self, request: Request) -> None:
        """Start compiling the request's grammar; it waits until the result is in.

        Runs where the request is prepared (vLLM: ``preprocess_add_request``,
        on EngineCoreProc's input thread): the busy loop never waits for a
        compilation. The first structured request also makes the backend,
        which reads the whole vocabulary once.
        """
        if request.structured_output_request is None:
            return
        if self.backend is None:
            from transformers import AutoTokenizer

            from tracevllm.structured_output.backend_xgrammar import XgrammarBackend

            model_config = self.vllm_config.model_config
            tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer)
            self.backend = XgrammarBackend(tokenizer, model_config.vocab_size)
            # Compilation is CPU-bound: half the cores (vLLM's choice). On
            # threads with a large stack (vLLM's ThreadPoolExecutor: the
            # default one), as xgrammar recurses in C++.
            max_workers = max(1, (multiprocessing.cpu_count() + 1) // 2)
            self.executor = LargeStackExecutor(max_workers, thread_name_prefix="grammar")
        assert self.executor is not None
        grammar = self.executor.submit(self._create_grammar, request)
        request.structured_output_request.grammar = grammar

    @tracing.instrument(
        "StructuredOutputManager._create_grammar",
        parent=records.create_grammar_parent,
        record=records.create_grammar,
    )
    def _create_grammar(self, request: Request) -> XgrammarGrammar:
        """On a pool thread: the request's own matcher on its compiled grammar.

        A compilation that fails raises a ``ValueError`` whose text is the
        reason for the client (tracevllm's: the scheduler finishes the
        request with it as an error's ``stop_reason``, knowing no backend).
        """
        so_request = request.structured_output_request
        assert so_request is not None and self.backend is not None
        request_type, grammar_spec = so_request.structured_output_key
        any_whitespace = not so_request.params.disable_any_whitespace
        try:
            return self.backend.compile_grammar(request_type, grammar_spec, any_whitespace)
        except Exception as e:
            # Loaded with the backend above.
            from tracevllm.structured_output.backend_xgrammar import xgrammar_reason

            raise ValueError(
                f"structured_outputs.{so_request.params.kind}: the engine could not compile "
                f"it: {xgrammar_reason(e)}"
            ) from e

    # --8<-- [end:grammar_init]

    # --8<-- [start:grammar_bitmask]
    def grammar_bitmask(
        self,
        requests: dict[str, Request],
        structured_output_request_ids: list[str],
        scheduled_spec_decode_tokens: dict[str, list[int]],
    ) -> npt.NDArray[np.int32] | None:
        """One bitmask row per structured request, in the order given; with
        drafts, one per draft position and one more, each row for the state
        the grammar would be in had the drafts before it been accepted.

        Bit ``t`` of a row is set iff token ``t`` may come next. A request
        whose grammar has terminated gets a full row (-1): nothing to forbid.
        The matcher walks through the drafts and is rolled back after.
        """
        if not structured_output_request_ids:
            return None
        if self._grammar_bitmask is None:
            assert self.backend is not None
            max_batch_size = self.vllm_config.scheduler_config.max_num_seqs
            spec = self.vllm_config.speculative_config
            max_num_spec_tokens = (spec.num_speculative_tokens or 0) if spec is not None else 0
            self._grammar_bitmask = self.backend.allocate_token_bitmask(
                max_batch_size * (1 + max_num_spec_tokens)
            )
        bitmask = self._grammar_bitmask
        index = 0
        for req_id in structured_output_request_ids:
            so_request = requests[req_id].structured_output_request
            assert so_request is not None
            grammar = so_request.grammar
            assert grammar is not None, "scheduled before its grammar was ready"
            advanced = 0
            # -1: the position after the last draft (the bonus, or the only one).
            for token in [*scheduled_spec_decode_tokens.get(req_id, ()), -1]:
                if grammar.is_terminated():
                    bitmask[index].fill_(-1)
                else:
                    grammar.fill_bitmask(bitmask, index)
                    if token != -1:
                        # The drafts passed validate_tokens: the grammar takes them.
                        accepted = grammar.accept_tokens(req_id, [token])
                        assert accepted, (req_id, token)
                        advanced += 1
                index += 1
            if advanced:
                grammar.rollback(advanced)
        # numpy: what vLLM sends to its workers (cheaper to serialize than a tensor).
        return bitmask[:index].numpy()

    # --8<-- [end:grammar_bitmask]

    def no_token_allowed_reason(self, request: Request, num_output_tokens: int) -> str | None:
        """tracevllm: why the grammar refused a sampled token, if its row allowed none.

        The sampler draws a token whose logit is -inf only when every logit of
        its row is -inf (greedy's argmax, the random draw's probabilities all
        NaN: token 0): so a token the grammar refuses comes from a row that
        every mask together emptied. Two masks forbid tokens: the grammar's,
        and min-tokens' (the stop tokens, EOS included, until ``min_tokens``
        tokens are out). Both are recomputed here, from where the grammar
        stands after ``num_output_tokens`` tokens: the reason, for the
        client, if nothing is left; None if a token was allowed (a bug,
        vLLM's "Unexpected: grammar rejected tokens").
        """
        import numpy as np

        so_request = request.structured_output_request
        assert so_request is not None and so_request.grammar is not None
        assert self.backend is not None
        bitmask = self.backend.allocate_token_bitmask(1)
        so_request.grammar.fill_bitmask(bitmask, 0)
        words = bitmask[0].numpy().view(np.uint32).copy()  # bit t % 32 of word t // 32
        params = request.sampling_params
        held_back = num_output_tokens < params.min_tokens
        for token in params.all_stop_token_ids if held_back else ():
            if token < words.size * 32:
                words[token >> 5] &= ~np.uint32(1 << (token & 31))
        if words.any():
            return None
        field = f"structured_outputs.{so_request.params.kind}"
        if held_back and bitmask.any():
            why = (
                f"only a stop token, which min_tokens={params.min_tokens} forbids before "
                f"{params.min_tokens} tokens"
            )
        else:
            why = "no token at all (no text that begins with the output so far matches it)"
        tokens = "token" if num_output_tokens == 1 else "tokens"
        return (
            f"{field}: after {num_output_tokens} output {tokens} the constraint allows {why}; "
            "the request ended there."
        )

    def wait_for_grammars(self, requests: Iterable[Request], timeout: float) -> bool:
        """Block until one of these requests' grammars is compiled, or ``timeout``
        seconds pass (tracevllm's: vLLM's busy loop spins meanwhile). Returns
        whether any grammar was still compiling."""
        pending = [
            grammar
            for r in requests
            if r.structured_output_request is not None
            and isinstance(grammar := r.structured_output_request._grammar, Future)
        ]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
        return bool(pending)

    def should_advance(self, request: Request) -> bool:
        """Does a token sampled for this request move its matcher? (Always,
        without reasoning parsers: vLLM skips the reasoning part.)"""
        return request.use_structured_output

    def clear_backend(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        if self.backend is not None:
            self.backend.destroy()

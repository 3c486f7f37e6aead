"""The built-in logits processors: min-tokens, logit bias, min-p.

Mirrors vllm/v1/sample/logits_processor/builtin.py
(``MinTokensLogitsProcessor``, ``LogitBiasLogitsProcessor``,
``MinPLogitsProcessor``); ``apply`` edits the batch's logits as vLLM's does.
Departures: each processor is made per step from the persistent batch's
rows (see interface.py); and vLLM 0.22 refuses min-p and logit bias with
speculative decoding, while here they apply at every draft position
(``apply_with_spec_decode``) and at the bonus position, so output with drafts
is the output without them. For the same reason min-tokens at the bonus
position counts the drafts before it (``apply_to_bonus``); vLLM's bonus row
sees only the tokens emitted before the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tracevllm.sample.logits_processor.interface import LogitsProcessor


def _starts(num_draft_tokens: list[int]) -> list[int]:
    """Row of each request's first draft: [2, 3, 1] -> [0, 2, 5]."""
    return [0, *np.cumsum(num_draft_tokens)[:-1].tolist()] if num_draft_tokens else []


class MinTokensLogitsProcessor(LogitsProcessor):
    """Stop tokens (EOS included) at -inf for a request still short of
    ``min_tokens``, so not even greedy can end it."""

    def __init__(
        self,
        # row -> (min_tokens, the request's output token ids, its stop token ids)
        min_toks: dict[int, tuple[int, Sequence[int], set[int]]],
        device: torch.device | str = "cpu",
    ) -> None:
        # A row that has its min_tokens, or nothing to hold back, needs nothing.
        self.min_toks = {
            row: state for row, state in min_toks.items() if state[2] and len(state[1]) < state[0]
        }
        self.neg_inf_tensor = torch.tensor(float("-inf"), dtype=torch.float32, device=device)

    def is_argmax_invariant(self) -> bool:
        return False

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return self._mask(logits, {row: [row] for row in self.min_toks})

    def apply_with_spec_decode(
        self, logits: torch.Tensor, num_draft_tokens: list[int]
    ) -> torch.Tensor:
        """Draft j of request i follows len(output) + j tokens: its row is
        masked while that is short of min_tokens."""
        starts = _starts(num_draft_tokens)
        rows = {}
        for req, (min_tokens, output_tok_ids, _) in self.min_toks.items():
            n_mask = min(max(min_tokens - len(output_tok_ids), 0), num_draft_tokens[req])
            rows[req] = list(range(starts[req], starts[req] + n_mask))
        return self._mask(logits, rows)

    def apply_to_bonus(self, logits: torch.Tensor, num_draft_tokens: list[int]) -> torch.Tensor:
        """Row i is request i's bonus position, after its output and its drafts."""
        rows = {
            req: [req]
            for req, (min_tokens, output_tok_ids, _) in self.min_toks.items()
            if len(output_tok_ids) + num_draft_tokens[req] < min_tokens
        }
        return self._mask(logits, rows)

    def _mask(self, logits: torch.Tensor, rows: dict[int, list[int]]) -> torch.Tensor:
        """Each request's stop tokens to -inf on the given rows of ``logits``."""
        row_ids: list[int] = []
        token_ids: list[int] = []
        for req, req_rows in rows.items():
            stop_tok_ids = list(self.min_toks[req][2])
            for row in req_rows:
                row_ids += [row] * len(stop_tok_ids)
                token_ids += stop_tok_ids
        if row_ids:
            index = (
                torch.tensor(row_ids, device=logits.device),
                torch.tensor(token_ids, device=logits.device),
            )
            logits.index_put_(index, self.neg_inf_tensor.to(logits.device))
        return logits


class LogitBiasLogitsProcessor(LogitsProcessor):
    """Add each request's ``logit_bias`` to its tokens' logits (OpenAI's:
    -100 all but bans a token, +100 all but forces it)."""

    def __init__(
        self,
        biases: dict[int, dict[int, float]],  # row -> {token id: bias}
        device: torch.device | str = "cpu",
    ) -> None:
        self.biases = {row: bias for row, bias in biases.items() if bias}
        reqs: list[int] = []
        tok_ids: list[int] = []
        values: list[float] = []
        for req, bias in self.biases.items():
            reqs += [req] * len(bias)
            tok_ids += bias.keys()
            values += bias.values()
        self.bias_tensor = torch.tensor(values, dtype=torch.float32, device=device)
        self.logits_slice = (
            torch.tensor(reqs, dtype=torch.int64, device=device),
            torch.tensor(tok_ids, dtype=torch.int64, device=device),
        )

    def is_argmax_invariant(self) -> bool:
        return False

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.biases:
            # A (row, token) pair appears once, so adding in place is vLLM's ``+=``.
            logits.index_put_(self.logits_slice, self.bias_tensor, accumulate=True)
        return logits

    def apply_with_spec_decode(
        self, logits: torch.Tensor, num_draft_tokens: list[int]
    ) -> torch.Tensor:
        """Every draft row of a request gets the request's bias."""
        starts = _starts(num_draft_tokens)
        rows: list[int] = []
        tok_ids: list[int] = []
        values: list[float] = []
        for req, bias in self.biases.items():
            for row in range(starts[req], starts[req] + num_draft_tokens[req]):
                rows += [row] * len(bias)
                tok_ids += bias.keys()
                values += bias.values()
        if rows:
            index = (
                torch.tensor(rows, device=logits.device),
                torch.tensor(tok_ids, device=logits.device),
            )
            bias_tensor = torch.tensor(values, dtype=torch.float32, device=logits.device)
            logits.index_put_(index, bias_tensor, accumulate=True)
        return logits


class MinPLogitsProcessor(LogitsProcessor):
    """Drop tokens whose probability is below ``min_p`` times the top one's."""

    def __init__(self, min_p: torch.Tensor | None) -> None:
        # [num_reqs, 1]; 0 on rows without min-p. None: no row has it.
        self.min_p = None if min_p is None else min_p.unsqueeze(1)

    def is_argmax_invariant(self) -> bool:
        # The most likely token always survives.
        return True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.min_p is None:
            return logits
        return self._apply(logits, self.min_p)

    def apply_with_spec_decode(
        self, logits: torch.Tensor, num_draft_tokens: list[int]
    ) -> torch.Tensor:
        if self.min_p is None:
            return logits
        counts = torch.tensor(num_draft_tokens, device=self.min_p.device)
        return self._apply(logits, self.min_p.repeat_interleave(counts, dim=0))

    @staticmethod
    def _apply(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
        probs = logits.softmax(dim=-1)  # [num_rows, vocab_size]
        max_probs = probs.amax(dim=-1, keepdim=True)  # [num_rows, 1]
        return logits.masked_fill_(probs < max_probs * min_p, float("-inf"))

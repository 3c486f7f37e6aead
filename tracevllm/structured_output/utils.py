"""Applying the grammar bitmask to the logits, and choice lists as grammars.

Mirrors vllm/v1/structured_output/utils.py (``apply_grammar_bitmask``,
``choice_as_grammar``). vLLM applies the mask with xgrammar's kernel
(``xgr.apply_token_bitmask_inplace``); tracevllm with
``apply_token_bitmask_inplace`` below, the same operation in plain PyTorch,
checked against xgrammar's in the tests and rewritten by lab 11. Left out:
Lark-to-EBNF conversion.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np
import torch

from tracevllm.labs import lab_hook

if TYPE_CHECKING:
    from tracevllm.core.sched.output import GrammarOutput, SchedulerOutput
    from tracevllm.worker.input_batch import InputBatch


# --8<-- [start:apply_token_bitmask_inplace]
@lab_hook("apply_token_bitmask_inplace")  # lab 11: chapters/11-token-bitmask
def apply_token_bitmask_inplace(
    logits: torch.Tensor,  # [num_rows, vocab_size], float32
    bitmask: torch.Tensor,  # [num_rows, ceil(vocab_size / 32)], int32
    indices: list[int] | None = None,  # the rows to mask; None: all
) -> None:
    """Set to -inf every logit whose bit is 0 (xgrammar's operation).

    Token ``t`` is bit ``t % 32`` (least significant first) of word
    ``t // 32``: -1 (all 32 bits set) allows a whole word of tokens.
    """
    device = logits.device  # the bitmask is there too (apply_grammar_bitmask moved it)
    rows = torch.arange(logits.shape[0], device=device)
    if indices is not None:
        rows = torch.tensor(indices, device=device)
    vocab_size = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=device)  # [32]
    # [rows, words, 32] -> [rows, words * 32]: one 0/1 per token.
    bits = (bitmask[rows].unsqueeze(-1) >> shifts) & 1
    allowed = bits.flatten(1)[:, :vocab_size].bool()  # [rows, vocab_size]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


# --8<-- [end:apply_token_bitmask_inplace]


# --8<-- [start:apply_grammar_bitmask]
def apply_grammar_bitmask(
    scheduler_output: SchedulerOutput,
    grammar_output: GrammarOutput,
    input_batch: InputBatch,
    logits: torch.Tensor,  # [num_reqs, vocab_size]
) -> None:
    """Mask the structured requests' rows of ``logits``, in place.

    The scheduler's bitmask has one row per structured request, in its own
    order; the runner's logits have one row per request in the batch. So
    the rows are put in batch order first (-1, all allowed, for the
    others), and only the structured rows are touched. With drafts a
    request has a row per draft position and one more, in both.
    """
    grammar_bitmask = grammar_output.grammar_bitmask  # [num_structured rows, words], int32
    spec_tokens = scheduler_output.scheduled_spec_decode_tokens
    # req_id -> its first row of logits: the rows of the drafts before it shift it.
    logit_index: dict[str, int] = {}
    offset = 0
    for batch_index, req_id in enumerate(input_batch.req_ids):
        logit_index[req_id] = batch_index + offset
        offset += len(spec_tokens.get(req_id, ()))
    sorted_bitmask = np.full((logits.shape[0], grammar_bitmask.shape[1]), -1, dtype=np.int32)
    out_indices: list[int] = []
    row = 0
    for req_id in grammar_output.structured_output_request_ids:
        num_rows = 1 + len(spec_tokens.get(req_id, ()))
        if (first := logit_index.get(req_id)) is not None:
            sorted_bitmask[first : first + num_rows] = grammar_bitmask[row : row + num_rows]
            out_indices += range(first, first + num_rows)
        row += num_rows
    if not out_indices:
        return
    # To the logits' device (vLLM: non_blocking, from pinned memory on a GPU).
    bitmask = torch.from_numpy(sorted_bitmask).to(logits.device, non_blocking=True)
    apply_token_bitmask_inplace(logits, bitmask, indices=out_indices)


# --8<-- [end:apply_grammar_bitmask]


def choice_as_grammar(choice: list[str]) -> str:
    """``["yes", "no"]`` -> ``root ::= "yes" | "no"``.

    vLLM 0.22.0 escapes quotes and backslashes only, so a choice holding a
    newline (or a carriage return, or NUL) breaks xgrammar's EBNF lexer.
    tracevllm also writes every other control character as an escape
    (``\\n``, ``\\r``, ``\\t``, ``\\u001b``; never ``\\x``: xgrammar reads
    hex digits past the two). NUL cannot be written at all (xgrammar ends
    the string there), nor a lone surrogate (no UTF-8): both are refused.
    """
    for i, c in enumerate(choice):
        if "\0" in c or any("\ud800" <= ch <= "\udfff" for ch in c):
            raise ValueError(
                f"structured_outputs.choice[{i}] holds a NUL character or a lone surrogate, "
                "which an xgrammar grammar cannot hold."
            )
    escaped = (_CONTROL_OR_QUOTE.sub(_escape, c) for c in choice)
    return "root ::= " + " | ".join(f'"{c}"' for c in escaped)


_CONTROL_OR_QUOTE = re.compile(r'["\\\x00-\x1f\x7f]')
_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    ch = match.group()
    return _SHORT_ESCAPES.get(ch) or f"\\u{ord(ch):04x}"

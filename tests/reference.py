"""HF transformers as the reference: a plain greedy loop over its forward.

HF's ``generate`` with ``min_new_tokens`` masks EOS, while ``ignore_eos=True``
does not; a plain loop (argmax of the last logits, with HF's own KV cache) is
the like-for-like reference when generating past EOS. It also records the gap
between the top two logits at each step, so a test can tell a true near-tie
from a bug.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class GreedyReference:
    token_ids: list[int]
    # logit(top1) - logit(top2) at each generated position.
    top2_gaps: list[float]


# (prompt ids, generated ids, logits [vocab]) -> the logits greedy picks from
LogitsProcessor = Callable[[list[int], list[int], torch.Tensor], torch.Tensor]


@torch.inference_mode()
def hf_greedy(
    model: Any,
    prompt_ids: list[int],
    max_tokens: int,
    logits_processor: LogitsProcessor | None = None,
) -> GreedyReference:
    input_ids = torch.tensor([prompt_ids])
    out = model(input_ids=input_ids, use_cache=True)
    past = out.past_key_values
    logits = out.logits[0, -1]
    tokens: list[int] = []
    gaps: list[float] = []
    for _ in range(max_tokens):
        if logits_processor is not None:
            logits = logits_processor(prompt_ids, tokens, logits.float().clone())
        top2 = torch.topk(logits.float(), 2)
        gaps.append(float(top2.values[0] - top2.values[1]))
        next_id = int(top2.indices[0])
        tokens.append(next_id)
        out = model(input_ids=torch.tensor([[next_id]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1]
    return GreedyReference(tokens, gaps)


NEAR_TIE = 1e-4


def assert_lossless(ours: list[int], ref: GreedyReference, what: str) -> None:
    """Token-for-token equal, or the first difference sits on a true near-tie
    (top-2 logit gap below 1e-4 in HF), which is then reported, not hidden."""
    if ours == ref.token_ids:
        return
    i = next(
        (k for k, (a, b) in enumerate(zip(ours, ref.token_ids)) if a != b),
        min(len(ours), len(ref.token_ids)),
    )
    gap = ref.top2_gaps[i] if i < len(ref.top2_gaps) else float("inf")
    assert gap < NEAR_TIE, (
        f"{what}: first divergence at generated token {i} "
        f"(ours {ours[i : i + 3]}, HF {ref.token_ids[i : i + 3]}), top-2 gap {gap:.2e}"
    )
    import warnings

    warnings.warn(
        f"{what}: diverged at token {i} on a near-tie (top-2 gap {gap:.2e} < {NEAR_TIE})",
        stacklevel=2,
    )

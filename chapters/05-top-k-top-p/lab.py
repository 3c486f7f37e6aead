"""Lab 05: top-k / top-p filtering. Your version of
``tracevllm.sample.ops.topk_topp_sampler.apply_top_k_top_p``.

Read README.md first. Test it with ``make lab CH=05``; watch it filter real
samples with ``TRACEVLLM_LAB=05 make trace PROMPT="..."`` (with sampling on:
the CLI's --temperature / --top-p / --top-k).
"""

from __future__ import annotations

import torch


def apply_top_k_top_p(
    logits: torch.Tensor,  # [num_reqs, vocab_size]
    k: torch.Tensor | None,  # [num_reqs]; vocab_size = no top-k
    p: torch.Tensor | None,  # [num_reqs]; 1.0 = no top-p
) -> torch.Tensor:
    """Set logits outside the top-k / top-p nucleus to -inf (in place)."""
    # TODO 1: k and p both None: nothing to do, return logits.
    # TODO 2: sort each row ascending (keep the indices to undo the sort).
    # TODO 3: top-k: mask (-inf) every logit below the row's k-th largest value
    #         (values equal to it survive).
    # TODO 4: top-p, on what top-k left: softmax the sorted row, cumulative sum
    #         from the smallest; mask the entries whose cumulative probability is
    #         <= 1 - p. The largest logit always survives.
    # TODO 5: scatter the sorted row back into vocabulary order and return it.
    raise NotImplementedError("Lab 05: apply_top_k_top_p (see chapters/05-top-k-top-p)")

"""The greedy pick over the vocabulary, in two passes that vectorize.

tracevllm's own, for the CPU: vLLM's ``Sampler.greedy_sample`` is
``logits.argmax(dim=-1)``. On the CPU that reduction carries the index
with each value and runs far slower than ``amax``, which does not: at batch
64 over SmolLM2's 49152 logits, 1.4 ms on two threads (2.6 on one), where
the two passes below take 0.18 (0.32) (``python benchmarks/bench_greedy.py``).

So the row is cut into chunks of ``CHUNK`` values: each chunk's max
(``amax``), the first chunk holding the row's max (an argmax over 384
values, not 49152), then the first position of that max inside its chunk.
The result is ``torch.argmax``'s exactly: the first index of the max, since
an argmax picks the first of equal values at both levels; and with a NaN in
the row, the first NaN's index, since ``amax`` and ``argmax`` both treat NaN
as the largest value.
"""

from __future__ import annotations

import torch

CHUNK = 128


def argmax_last_dim(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for a 2-D CPU tensor ``[rows, vocab]``, in two
    passes when the rows split into whole chunks; else that argmax itself."""
    if x.dim() != 2 or not x.is_cpu or not x.is_contiguous():
        return x.argmax(dim=-1)
    rows, vocab = x.shape
    if vocab % CHUNK:
        return x.argmax(dim=-1)
    chunks = x.view(rows, vocab // CHUNK, CHUNK)
    first = chunks.amax(dim=-1).argmax(dim=-1)  # [rows]: the first chunk with the max
    within = chunks[torch.arange(rows), first].argmax(dim=-1)  # [rows]
    return first * CHUNK + within

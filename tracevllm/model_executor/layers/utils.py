"""Penalties on the logits (repetition, frequency, presence) and the CPU GEMM dispatch.

Mirrors vllm/model_executor/layers/utils.py (``get_token_bin_counts_and_mask``,
``apply_penalties``, ``dispatch_cpu_unquantized_gemm``, ``cpu_unquantized_gemm``);
``apply_repetition_penalties`` is the plain-PyTorch version of the op vLLM
reaches through vllm/_custom_ops.py. The CPU GEMM dispatch packs each weight
once for oneDNN, as vLLM's does (vLLM through its own ``onednn_mm`` op,
tracevllm through PyTorch's ``mkldnn._linear_pointwise``, the same library).
Left out: the Zen, SGL and ROCm GEMM paths.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tracevllm import envs

LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _onednn_supports(dtype: torch.dtype) -> bool:
    # Half types need CPU instructions oneDNN checks for (AVX512-BF16,
    # AVX512-FP16 or AVX-NE-CONVERT); without them packing fails.
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


# --8<-- [start:dispatch_cpu_unquantized_gemm]
def dispatch_cpu_unquantized_gemm(layer: Any, remove_weight: bool) -> None:
    """Give ``layer`` its ``cpu_linear``: oneDNN on a weight packed once, at load.

    A matmul reads its weight in the layout the library's kernel wants; a
    plain ``F.linear`` re-lays it out on every call, which at decode batch
    sizes (tens of rows) costs as much as the arithmetic. Packing it once is
    what vLLM's CPU backend does; on this machine it makes the decode-size
    matmuls 1.3-2x faster. The results differ from ``F.linear``'s in the last
    bits (another summation order), which the lossless tests check stays below
    any greedy decision. ``remove_weight``: the layer keeps no plain copy (an
    embedding tied to the LM head must keep its own).
    """
    weight = layer.weight
    if (
        weight.is_meta
        or weight.device.type != "cpu"
        or not envs.TRACEVLLM_CPU_ONEDNN_GEMM
        or not _onednn_supports(weight.dtype)
    ):
        layer.cpu_linear = F.linear
        return
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)

    def onednn_linear(x: torch.Tensor, _w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    layer.cpu_linear = onednn_linear
    if remove_weight:
        layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)


# --8<-- [end:dispatch_cpu_unquantized_gemm]


def cpu_unquantized_gemm(
    layer: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` the way ``layer``'s weights were prepared for."""
    cpu_linear = getattr(layer, "cpu_linear", None)
    if cpu_linear is None:  # never processed: a layer built by hand, in a test
        return F.linear(x, weight, bias)
    return cpu_linear(x, weight, bias)


def get_token_bin_counts_and_mask(
    tokens: torch.Tensor,  # [num_seqs, max_len], int64, padded with vocab_size
    vocab_size: int,
    num_seqs: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """How often each token occurs in each row, and whether it occurs at all.

    The padding id ``vocab_size`` lands in an extra last column, which is
    dropped: padding counts as nothing.
    """
    # [num_seqs, vocab_size + 1]
    bin_counts = torch.zeros((num_seqs, vocab_size + 1), dtype=torch.long, device=tokens.device)
    bin_counts.scatter_add_(1, tokens, torch.ones_like(tokens))
    bin_counts = bin_counts[:, :vocab_size]  # [num_seqs, vocab_size]
    return bin_counts, bin_counts > 0


# --8<-- [start:apply_repetition_penalties]
def apply_repetition_penalties(
    logits: torch.Tensor,  # [num_seqs, vocab_size], modified in place
    prompt_mask: torch.Tensor,  # [num_seqs, vocab_size], bool: in the prompt
    output_mask: torch.Tensor,  # [num_seqs, vocab_size], bool: generated so far
    repetition_penalties: torch.Tensor,  # [num_seqs]
) -> None:
    """Push every token already seen (prompt or output) toward "less likely".

    A penalty p > 1 divides a positive logit by p and multiplies a negative one
    by p (the CTRL paper's rule, HF's ``RepetitionPenaltyLogitsProcessor``):
    either way the token loses ground, whatever its sign.
    """
    seen = prompt_mask | output_mask
    # [num_seqs, vocab_size]: p where seen, 1 elsewhere
    penalties = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0)
    logits *= torch.where(logits > 0, 1.0 / penalties, penalties)


# --8<-- [end:apply_repetition_penalties]


# --8<-- [start:apply_penalties]
def apply_penalties(
    logits: torch.Tensor,  # [num_seqs, vocab_size]
    prompt_tokens_tensor: torch.Tensor,  # [num_seqs, max_prompt_len], padded with vocab_size
    output_tokens_tensor: torch.Tensor,  # [num_seqs, max_output_len], padded with vocab_size
    presence_penalties: torch.Tensor,  # [num_seqs]
    frequency_penalties: torch.Tensor,  # [num_seqs]
    repetition_penalties: torch.Tensor,  # [num_seqs]
) -> torch.Tensor:
    """Repetition, then frequency and presence penalties, in place; returns ``logits``.

    Frequency and presence follow the OpenAI API: ``logit -= frequency *
    count + presence * (count > 0)``, counting generated tokens only (the
    repetition penalty also counts the prompt's).
    """
    num_seqs, vocab_size = logits.shape
    _, prompt_mask = get_token_bin_counts_and_mask(prompt_tokens_tensor, vocab_size, num_seqs)
    output_bin_counts, output_mask = get_token_bin_counts_and_mask(
        output_tokens_tensor, vocab_size, num_seqs
    )
    apply_repetition_penalties(logits, prompt_mask, output_mask, repetition_penalties)
    logits -= frequency_penalties.unsqueeze(1) * output_bin_counts
    logits -= presence_penalties.unsqueeze(1) * output_mask
    return logits


# --8<-- [end:apply_penalties]

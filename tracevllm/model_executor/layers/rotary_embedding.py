"""Rotary position embeddings (RoPE), neox style, with Llama 3 frequency scaling.

Mirrors vllm/model_executor/layers/rotary_embedding/ (``RotaryEmbedding``,
``Llama3RotaryEmbedding``, ``get_rope``) on its native path. Left out: GPT-J
style (interleaved) rotation, partial rotary dims, and the other scaling types
(linear, dynamic NTK, YaRN, LongRoPE, M-RoPE); asking for one is an error.

The cos/sin table is computed once for every position, then each step indexes
it with the flat ``positions`` tensor: no per-request offsets, since every
token carries its own position.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, max_position_embeddings: int, base: float) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = head_size
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        # A plain attribute, not a buffer: computed here on the CPU even when the
        # model is built on the meta device, moved to the model's device on first use.
        self.cos_sin_cache = self._compute_cos_sin_cache()  # [max_position, rotary_dim]

    def _compute_inv_freq(self) -> torch.Tensor:
        # Computed as HF does (int64 arange, then float), so the tables agree bit for bit.
        arange = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device="cpu")
        exponent = arange.float() / self.rotary_dim
        return 1.0 / (self.base**exponent)  # [rotary_dim // 2]

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv_freq = self._compute_inv_freq()  # [rotary_dim // 2]
        t = torch.arange(self.max_position_embeddings, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)  # [max_position, rotary_dim // 2]
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_position, rotary_dim]

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads * head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos_sin_cache.device != positions.device:
            self.cos_sin_cache = self.cos_sin_cache.to(positions.device)
        cos_sin = self.cos_sin_cache[positions]  # [num_tokens, rotary_dim]
        cos, sin = cos_sin.to(query.dtype).chunk(2, dim=-1)  # 2 x [num_tokens, rotary_dim // 2]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [num_tokens, 1, rotary_dim // 2]
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x = x.view(num_tokens, -1, self.head_size)  # [num_tokens, heads, head_size]
        # Neox style: the two halves of the head form the (real, imaginary) pairs.
        x1, x2 = x.chunk(2, dim=-1)  # 2 x [num_tokens, heads, head_size // 2]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.view(num_tokens, -1)  # [num_tokens, heads * head_size]


class Llama3RotaryEmbedding(RotaryEmbedding):
    """Llama 3.1's scaling: slow down low frequencies, keep high ones, blend between."""

    def __init__(
        self,
        head_size: int,
        max_position_embeddings: int,
        base: float,
        scaling_factor: float,
        low_freq_factor: float,
        high_freq_factor: float,
        orig_max_position: int,
    ) -> None:
        self.scaling_factor = scaling_factor
        self.low_freq_factor = low_freq_factor
        self.high_freq_factor = high_freq_factor
        self.orig_max_position = orig_max_position
        super().__init__(head_size, max_position_embeddings, base)

    def _compute_inv_freq(self) -> torch.Tensor:
        inv_freq = super()._compute_inv_freq()  # [rotary_dim // 2]
        low_freq_wavelen = self.orig_max_position / self.low_freq_factor
        high_freq_wavelen = self.orig_max_position / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are stretched by the factor.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.scaling_factor, inv_freq)
        smooth = (self.orig_max_position / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.scaling_factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)


def get_rope(
    head_size: int,
    max_position: int,
    is_neox_style: bool = True,
    rope_parameters: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
) -> RotaryEmbedding:
    """Build the RoPE a model's config asks for (vLLM's signature).

    ``rope_parameters`` is transformers 5's ``config.rope_parameters``
    ({rope_theta, rope_type, ...}; it folds older checkpoints' ``rope_theta``
    and ``rope_scaling`` into it). The cos/sin table is fp32 whatever ``dtype``.
    """
    if not is_neox_style:
        raise ValueError("GPT-J style (interleaved) RoPE is not supported by tracevllm.")
    params = rope_parameters or {}
    base = float(params.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return RotaryEmbedding(head_size, max_position, base)
    if rope_type == "llama3":
        return Llama3RotaryEmbedding(
            head_size,
            max_position,
            base,
            scaling_factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            orig_max_position=int(params["original_max_position_embeddings"]),
        )
    raise ValueError(
        f"RoPE scaling type {rope_type!r} is not supported by tracevllm "
        "(supported: default, llama3)."
    )

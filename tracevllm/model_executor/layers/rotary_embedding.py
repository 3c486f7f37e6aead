"""Rotary position embeddings (RoPE), neox style, with Llama 3 and LongRoPE (Phi-3) scaling.

Mirrors vllm/model_executor/layers/rotary_embedding/ (``RotaryEmbedding``, a
``CustomOp`` registered as "rotary_embedding", ``Llama3RotaryEmbedding``,
``Phi3LongRoPEScaledRotaryEmbedding``, ``get_rope``). ``forward_native`` is
the PyTorch path; ``RotaryEmbedding.forward_cpu`` is vLLM's: the
``rotary_embedding`` kernel (kernels/csrc/cpu_ops.cpp) turns query and key
in place, one pass where the native path takes fifteen ops. Left out: GPT-J
style (interleaved) rotation (the kernel has it, the layers do not), partial
rotary dims outside LongRoPE, and the other scaling types (linear, dynamic
NTK, YaRN, M-RoPE); asking for one is an error. LongRoPE reads the engine's
``max_model_len`` from the current config as vLLM's does; with none current
(a layer built on its own) it takes ``max_position_embeddings``, where vLLM
raises.

The cos/sin table is computed once for every position, then each step indexes
it with the flat ``positions`` tensor: no per-request offsets, since every
token carries its own position.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tracevllm import _custom_ops as ops
from tracevllm.config import get_current_vllm_config
from tracevllm.logger import init_logger
from tracevllm.model_executor.custom_op import CustomOp, cpu_kernel_fits

logger = init_logger(__name__)


@CustomOp.register("rotary_embedding")
class RotaryEmbedding(CustomOp):
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

    def forward_native(
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

    # --8<-- [start:rope_forward_cpu]
    def forward_cpu(
        self,
        positions: torch.Tensor,  # [num_tokens], int64
        query: torch.Tensor,  # [num_tokens, num_heads * head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``forward_native``, but query and key are turned in place (vLLM's op)."""
        if (
            not cpu_kernel_fits(query, key, self.cos_sin_cache)
            or positions.dtype != torch.int64
            or positions.device.type != "cpu"
        ):
            return self.forward_native(positions, query, key)
        ops.rotary_embedding(positions, query, key, self.head_size, self.cos_sin_cache, True)
        return query, key

    # --8<-- [end:rope_forward_cpu]


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


# --8<-- [start:longrope]
class Phi3LongRoPEScaledRotaryEmbedding(nn.Module):
    """LongRoPE (Phi-3): each frequency divided by its own rescale factor, one
    set (``short_factor``) for contexts within ``original_max_position_embeddings``
    and another (``long_factor``) for longer ones; cos and sin multiplied by an
    attention factor (``short_mscale`` / ``long_mscale``, by default
    sqrt(1 + ln(max / original) / ln(original)), 1 when not extended).
    Only the first ``rotary_dim`` dims of a head rotate (Phi-4-mini's 0.75).

    Which set, vLLM's rule: the long factors for every token of every request
    when the engine's ``max_model_len`` exceeds the original length, the short
    ones otherwise, fixed at construction (``use_long_rope``). A token's
    rotation then depends on its position alone, so the keys in the cache stay
    valid when a sequence crosses the original length, and chunked prefill,
    prefix caching and recomputation after preemption see the same keys.

    HF transformers (``longrope_frequency_update``) picks per forward call
    instead: long iff the call's largest position + 1 exceeds the original
    length (in ``generate``, a prompt within it is rotated with the short
    factors and each later token past it with the long ones, keeping the
    short-rotated keys already cached). The two agree when every forward runs
    past the original length (every prompt longer than it, with
    ``max_model_len`` above it) and when ``max_model_len`` is at most the
    original length (short throughout); in between they differ, as vLLM's do.

    As vLLM's, not a ``RotaryEmbedding`` subclass, and one table
    (``long_short_cos_sin_cache``): ``original`` short rows, then
    ``max_position_embeddings`` long ones, indexed at ``position + original``
    when long. It is fp32 and cast to the query's dtype, as HF's.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        original_max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: torch.dtype,
        short_factor: list[float],
        long_factor: list[float],
        short_mscale: float | None = None,
        long_mscale: float | None = None,
    ) -> None:
        super().__init__()
        if not is_neox_style:
            raise ValueError("`Phi3LongRoPEScaledRotaryEmbedding` only supports neox_style.")
        if not 0 < rotary_dim <= head_size or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and in (0, {head_size}], got {rotary_dim}.")
        for name, factors in (("short_factor", short_factor), ("long_factor", long_factor)):
            _check_longrope_factors(name, factors, rotary_dim // 2)
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.original_max_position_embeddings = original_max_position_embeddings
        self.base = base
        self.short_factor = short_factor
        self.long_factor = long_factor
        # One set for the engine's whole life: were it picked per token or per
        # step, a sequence crossing the original length would leave keys in the
        # cache rotated with the other set.
        max_model_len = _current_max_model_len(max_position_embeddings)
        self.use_long_rope = max_model_len > original_max_position_embeddings
        if self.use_long_rope:
            _warn_long_rope_once(max_position_embeddings, original_max_position_embeddings)
        scale = max_position_embeddings / original_max_position_embeddings
        default_mscale = (
            math.sqrt(1 + math.log(scale) / math.log(original_max_position_embeddings))
            if scale > 1.0
            else 1.0
        )
        self.short_mscale = default_mscale if short_mscale is None else short_mscale
        self.long_mscale = default_mscale if long_mscale is None else long_mscale
        # A plain attribute (computed on the CPU even under the meta device), as
        # RotaryEmbedding's cos_sin_cache.
        short = self._compute_cos_sin_cache(
            original_max_position_embeddings, short_factor, self.short_mscale
        )
        long = self._compute_cos_sin_cache(max_position_embeddings, long_factor, self.long_mscale)
        self.long_short_cos_sin_cache = torch.cat((short, long))  # [original + max, rotary_dim]

    def _compute_inv_freq(self, rescale_factors: list[float]) -> torch.Tensor:
        # HF's order of operations (int64 arange, factor times base ** exponent):
        # the tables agree bit for bit.
        arange = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device="cpu")
        exponent = arange.float() / self.rotary_dim
        factors = torch.tensor(rescale_factors, dtype=torch.float32, device="cpu")
        return 1.0 / (factors * self.base**exponent)  # [rotary_dim // 2]

    def _compute_cos_sin_cache(
        self, max_position_embeddings: int, rescale_factors: list[float], mscale: float
    ) -> torch.Tensor:
        inv_freq = self._compute_inv_freq(rescale_factors)
        t = torch.arange(max_position_embeddings, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)  # [max_position, rotary_dim // 2]
        return torch.cat((freqs.cos() * mscale, freqs.sin() * mscale), dim=-1)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads * head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.long_short_cos_sin_cache.device != positions.device:
            self.long_short_cos_sin_cache = self.long_short_cos_sin_cache.to(positions.device)
        # The long rows start after the original length's short ones.
        idx = positions + self.original_max_position_embeddings if self.use_long_rope else positions
        cos_sin = self.long_short_cos_sin_cache[idx]  # [num_tokens, rotary_dim]
        cos, sin = cos_sin.to(query.dtype).chunk(2, dim=-1)  # 2 x [num_tokens, rotary_dim // 2]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [num_tokens, 1, rotary_dim // 2]
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x = x.view(num_tokens, -1, self.head_size)  # [num_tokens, heads, head_size]
        x_rot, x_pass = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = x_rot.chunk(2, dim=-1)  # 2 x [num_tokens, heads, rotary_dim // 2]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x_pass), dim=-1)
        return out.reshape(num_tokens, -1)  # [num_tokens, heads * head_size]


@functools.cache
def _warn_long_rope_once(max_position_embeddings: int, original: int) -> None:
    # Once, not once per layer (vLLM's warning_once).
    logger.warning(
        "Using LongRoPE scaling factors. This enables longer contexts (%d tokens vs "
        "original %d tokens) at the cost of some performance degradation for shorter "
        "sequences. If this is not desired, set `max_model_len` to be at most %d.",
        max_position_embeddings,
        original,
        original,
    )


def _current_max_model_len(max_position_embeddings: int) -> int:
    """The engine's ``max_model_len``, read as vLLM reads it (the config being built).

    Outside an engine (a layer built on its own) no config is current; vLLM
    raises there, tracevllm takes ModelConfig's default, the model's
    ``max_position_embeddings``.
    """
    vllm_config = get_current_vllm_config()
    if vllm_config is None:
        return max_position_embeddings
    return vllm_config.model_config.get_max_model_len()


def _check_longrope_factors(name: str, factors: Any, expected_len: int) -> None:
    if not isinstance(factors, (list, tuple)) or len(factors) != expected_len:
        raise ValueError(
            f"rope_parameters.{name} must be a list of {expected_len} numbers "
            f"(rotary_dim // 2), got {factors!r}."
        )
    for x in factors:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 < x < math.inf:
            raise ValueError(
                f"rope_parameters.{name} must hold positive finite numbers, got {x!r}."
            )


# --8<-- [end:longrope]


def get_rope(
    head_size: int,
    max_position: int,
    is_neox_style: bool = True,
    rope_parameters: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
) -> RotaryEmbedding | Phi3LongRoPEScaledRotaryEmbedding:
    """Build the RoPE a model's config asks for (vLLM's signature).

    ``rope_parameters`` is transformers 5's ``config.rope_parameters``
    ({rope_theta, rope_type, ...}; it folds older checkpoints' ``rope_theta``
    and ``rope_scaling`` into it). The cos/sin table is fp32 whatever ``dtype``.
    """
    if not is_neox_style:
        raise ValueError("GPT-J style (interleaved) RoPE is not supported by tracevllm.")
    params = rope_parameters or {}
    # One module per distinct RoPE, shared by every layer that asks for it, as
    # vLLM's _ROPE_DICT: the default model's 30 layers built 30 equal 2 MB
    # tables (1.2 s of start-up measured here), now one. LongRoPE picks its
    # factors from the engine's max_model_len, so that joins its key: two
    # engines in one process with different lengths get different tables.
    frozen = json.dumps(params, sort_keys=True, default=str)  # hashable, nested lists too
    long_len = _current_max_model_len(max_position) if _is_longrope(params) else None
    # Whether the layer runs its kernel is fixed when it is built
    # (CustomOp.dispatch_forward), so it joins the key too.
    key = (
        head_size,
        max_position,
        is_neox_style,
        frozen,
        dtype,
        long_len,
        RotaryEmbedding.uses_own_kernel(),
    )
    if key not in _ROPE_DICT:
        _ROPE_DICT[key] = _build_rope(head_size, max_position, params, dtype)
    return _ROPE_DICT[key]


_ROPE_DICT: dict[tuple[Any, ...], RotaryEmbedding | Phi3LongRoPEScaledRotaryEmbedding] = {}


def move_rope_tables(modules: Iterable[torch.nn.Module], device: torch.device) -> None:
    """Put the RoPE tables of a model's ``modules()`` on ``device`` now, before any forward.

    The tables are built on the CPU and would move on first use; a compiled
    forward would then make that move part of its graph, a fresh copy every
    call, and a CUDA graph captured on one copy would replay on another.
    Moved here, each is module state at one address.
    """
    for module in modules:
        for name in ("cos_sin_cache", "long_short_cos_sin_cache"):
            table = getattr(module, name, None)
            if isinstance(table, torch.Tensor) and table.device != device:
                setattr(module, name, table.to(device))


def _is_longrope(params: dict[str, Any]) -> bool:
    return params.get("rope_type", params.get("type", "default")) == "longrope"


def _build_rope(
    head_size: int, max_position: int, params: dict[str, Any], dtype: torch.dtype | None
) -> RotaryEmbedding | Phi3LongRoPEScaledRotaryEmbedding:
    base = float(params.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial_rotary_factor = params.get("partial_rotary_factor")
    rotary_dim = int(head_size * (1.0 if partial_rotary_factor is None else partial_rotary_factor))
    if rope_type == "longrope":
        return _get_longrope(head_size, rotary_dim, max_position, base, params, dtype)
    if rotary_dim != head_size:
        raise ValueError(
            f"partial_rotary_factor {partial_rotary_factor} is supported by "
            "tracevllm with rope_type 'longrope' only."
        )
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
        "(supported: default, llama3, longrope)."
    )


def _get_longrope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    params: dict[str, Any],
    dtype: torch.dtype | None,
) -> Phi3LongRoPEScaledRotaryEmbedding:
    original = int(params["original_max_position_embeddings"])
    # HF's attention factor: rope_parameters' attention_factor, else computed
    # from its factor, else (None here) from max / original. vLLM reads only
    # short_mscale / long_mscale, which still win over it.
    mscale = params.get("attention_factor")
    factor = params.get("factor")
    if mscale is None and factor is not None:
        mscale = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return Phi3LongRoPEScaledRotaryEmbedding(
        head_size,
        rotary_dim,
        max_position,
        original,
        base,
        True,
        dtype or torch.float32,
        list(params["short_factor"]),
        list(params["long_factor"]),
        short_mscale=params.get("short_mscale", mscale),
        long_mscale=params.get("long_mscale", mscale),
    )

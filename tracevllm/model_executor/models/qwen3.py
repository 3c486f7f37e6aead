"""Qwen3: Qwen2 without the q/k/v biases, with an RMSNorm on each head of q and k.

Mirrors vllm/model_executor/models/qwen3.py (``Qwen3Attention``,
``Qwen3DecoderLayer``, ``Qwen3Model``, ``Qwen3ForCausalLM``) and, as it does,
takes the MLP (``Qwen2MLP as Qwen3MLP``) and the model (``Qwen3Model`` is
``Qwen2Model`` building ``Qwen3DecoderLayer``s) from qwen2.py. What Qwen3 changes:

- ``q_norm`` and ``k_norm``: after the projection and before RoPE, each head's
  q and k (``head_dim`` wide) is RMS-normalized with one weight shared by all
  heads, which keeps attention logits in range without biases;
- ``head_dim`` comes from the config (Qwen3-0.6B: 128 with a 1024-wide model and
  16 heads), so q is ``num_heads * head_dim`` wide, not ``hidden_size``;
- q/k/v biases only when the config's ``attention_bias`` asks (none by default).

A sliding window per layer, from HF's ``layer_types``, as in qwen2.py.
Spans: ``Qwen3ForCausalLM.forward`` and, at detail ``full``,
``Qwen3DecoderLayer.forward`` per layer.

Left out: quantization, LoRA, Eagle hooks, dual-chunk attention, the
bidirectional (``is_causal: false``) embedding variant.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tracevllm import tracing
from tracevllm.compilation.decorators import support_torch_compile
from tracevllm.distributed.parallel_state import (
    get_pp_group,
    get_tensor_model_parallel_world_size,
)
from tracevllm.model_executor.layers.attention import Attention
from tracevllm.model_executor.layers.layernorm import RMSNorm
from tracevllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from tracevllm.model_executor.layers.logits_processor import LogitsProcessor
from tracevllm.model_executor.layers.rotary_embedding import get_rope
from tracevllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from tracevllm.model_executor.models.qwen2 import Qwen2MLP as Qwen3MLP
from tracevllm.model_executor.models.qwen2 import Qwen2Model, layer_sliding_window
from tracevllm.model_executor.models.utils import AutoWeightsLoader, PPMissingLayer, maybe_prefix
from tracevllm.sequence import IntermediateTensors

if TYPE_CHECKING:
    from tracevllm.config import CacheConfig, VllmConfig


class Qwen3Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        rope_parameters: dict[str, Any] | None,
        max_position: int = 4096 * 32,
        head_dim: int | None = None,
        rms_norm_eps: float = 1e-06,
        qkv_bias: bool = False,
        cache_config: CacheConfig | None = None,
        quant_config: Any = None,
        prefix: str = "",
        per_layer_sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        tp_size = get_tensor_model_parallel_world_size()
        self.total_num_heads = num_heads
        assert self.total_num_heads % tp_size == 0
        self.num_heads = self.total_num_heads // tp_size
        self.total_num_kv_heads = num_kv_heads
        if self.total_num_kv_heads >= tp_size:
            # At least as many KV heads as ranks: each rank gets its share.
            assert self.total_num_kv_heads % tp_size == 0
        else:
            # Fewer KV heads than ranks: each rank holds a copy of one.
            assert tp_size % self.total_num_kv_heads == 0
        self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)
        self.head_dim = head_dim or hidden_size // self.total_num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        # q_proj, k_proj and v_proj stacked, this rank's heads of each:
        # [q_size + 2 * kv_size, hidden_size]
        self.qkv_proj = QKVParallelLinear(
            hidden_size=hidden_size,
            head_size=self.head_dim,
            total_num_heads=self.total_num_heads,
            total_num_kv_heads=self.total_num_kv_heads,
            bias=qkv_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            input_size=self.total_num_heads * self.head_dim,
            output_size=hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=max_position,
            rope_parameters=rope_parameters,
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.scaling,
            num_kv_heads=self.num_kv_heads,
            cache_config=cache_config,
            quant_config=quant_config,
            per_layer_sliding_window=per_layer_sliding_window,
            prefix=f"{prefix}.attn",
        )
        # One weight of head_dim, shared by every head (and so by every rank).
        self.q_norm = RMSNorm(self.head_dim, eps=rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
    ) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)  # [num_tokens, q_size + 2 * kv_size]
        # [num_tokens, q_size], [num_tokens, kv_size], [num_tokens, kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # Each head normalized on its own: [num_tokens, num_heads, head_dim], then back.
        q_by_head = q.view(*q.shape[:-1], q.shape[-1] // self.head_dim, self.head_dim)
        q = self.q_norm(q_by_head).view(q.shape)  # type: ignore[union-attr]
        k_by_head = k.view(*k.shape[:-1], k.shape[-1] // self.head_dim, self.head_dim)
        k = self.k_norm(k_by_head).view(k.shape)  # type: ignore[union-attr]
        q, k = self.rotary_emb(positions, q, k)
        # Writes k/v into the paged cache, then reads this request's whole past back.
        attn_output = self.attn(q, k, v)  # [num_tokens, q_size]
        output, _ = self.o_proj(attn_output)  # [num_tokens, hidden_size], summed over ranks
        return output


class Qwen3DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        cache_config: CacheConfig | None = None,
        quant_config: Any = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = Qwen3Attention(
            hidden_size=self.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            rope_parameters=config.rope_parameters,
            max_position=config.max_position_embeddings,
            head_dim=getattr(config, "head_dim", None),
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=getattr(config, "attention_bias", False),
            cache_config=cache_config,
            quant_config=quant_config,
            prefix=f"{prefix}.self_attn",
            per_layer_sliding_window=layer_sliding_window(config, prefix),
        )
        self.mlp = Qwen3MLP(
            hidden_size=self.hidden_size,
            intermediate_size=config.intermediate_size,
            hidden_act=config.hidden_act,
            quant_config=quant_config,
            prefix=f"{prefix}.mlp",
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is deferred into the next norm (vLLM's fused add + RMSNorm).
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)  # type: ignore[assignment]
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


@support_torch_compile(
    dynamic_arg_dims={
        "input_ids": 0,
        "positions": 0,
        "intermediate_tensors": 0,
        "inputs_embeds": 0,
    }
)
class Qwen3Model(Qwen2Model):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(
            vllm_config=vllm_config, prefix=prefix, decoder_layer_type=Qwen3DecoderLayer
        )


class Qwen3ForCausalLM(nn.Module):
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = Qwen3Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head: nn.Module = ParallelLMHead(
                config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head")
            )
            if config.tie_word_embeddings:
                assert isinstance(self.model.embed_tokens, VocabParallelEmbedding)
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
            self.logits_processor = LogitsProcessor(config.vocab_size)
        else:
            self.lm_head = PPMissingLayer()
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    @tracing.instrument("Qwen3ForCausalLM.forward")
    def forward(
        self,
        input_ids: torch.Tensor | None,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # [num_sampled, hidden_size] -> [num_sampled, vocab_size]
        return self.logits_processor(self.lm_head, hidden_states)  # type: ignore[no-any-return]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # A tied LM head is the embedding: some checkpoints save it twice.
        loader = AutoWeightsLoader(
            self, skip_prefixes=(["lm_head."] if self.config.tie_word_embeddings else None)
        )
        return loader.load_weights(weights)

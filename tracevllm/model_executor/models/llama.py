"""Llama, written against the flat batch.

Mirrors vllm/model_executor/models/llama.py (``LlamaMLP``, ``LlamaAttention``,
``LlamaDecoderLayer``, ``LlamaModel``, ``LlamaForCausalLM``). As in vLLM there
is no batch dimension: every request's tokens of this step are concatenated
into one ``[num_tokens]`` stream, each with its own position, and only the
attention layer knows where one request ends and the next begins. q/k/v and
gate/up are fused into one matmul each, as vLLM does; ``load_weights`` maps
HF's separate tensors onto them.

Left out: tensor and pipeline parallelism (the *ParallelLinear layers are
all ``ReplicatedLinear`` here), quantization, LoRA, Eagle hooks, sliding windows,
the embedding/classification adapters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tracevllm import tracing
from tracevllm.model_executor.layers.activation import SiluAndMul
from tracevllm.model_executor.layers.attention import Attention
from tracevllm.model_executor.layers.layernorm import RMSNorm
from tracevllm.model_executor.layers.linear import ReplicatedLinear
from tracevllm.model_executor.layers.rotary_embedding import get_rope
from tracevllm.model_executor.layers.utils import cpu_unquantized_gemm
from tracevllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)

if TYPE_CHECKING:
    from tracevllm.config import VllmConfig


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"Unsupported activation: {hidden_act}. Only silu is supported.")
        # gate_proj and up_proj stacked: [2 * intermediate_size, hidden_size]
        self.gate_up_proj = ReplicatedLinear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = ReplicatedLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size]
        x = self.act_fn(x)  # [num_tokens, intermediate_size]
        return self.down_proj(x)  # [num_tokens, hidden_size]


class LlamaAttention(nn.Module):
    def __init__(
        self,
        hf_config: dict[str, Any],
        vllm_config: VllmConfig | None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        hidden_size = int(hf_config["hidden_size"])
        self.num_heads = int(hf_config["num_attention_heads"])
        self.num_kv_heads = int(hf_config.get("num_key_value_heads") or self.num_heads)
        self.head_dim = int(hf_config.get("head_dim") or hidden_size // self.num_heads)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        bias = bool(hf_config.get("attention_bias", False))
        # q_proj, k_proj and v_proj stacked: [q_size + 2 * kv_size, hidden_size]
        self.qkv_proj = ReplicatedLinear(hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = ReplicatedLinear(self.q_size, hidden_size, bias=bias)
        max_position = int(hf_config.get("max_position_embeddings", 8192))
        self.rotary_emb = get_rope(self.head_dim, max_position, hf_config)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.scaling,
            num_kv_heads=self.num_kv_heads,
            vllm_config=vllm_config,
            prefix=f"{prefix}.attn",
        )

    # --8<-- [start:llama_attention_forward]
    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [num_tokens, q_size + 2 * kv_size]
        # [num_tokens, q_size], [num_tokens, kv_size], [num_tokens, kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        # Writes k/v into the paged cache, then reads this request's whole past back.
        attn_output = self.attn(q, k, v)  # [num_tokens, q_size]
        return self.o_proj(attn_output)  # [num_tokens, hidden_size]

    # --8<-- [end:llama_attention_forward]


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, hf_config: dict[str, Any], vllm_config: VllmConfig | None, prefix: str = ""
    ) -> None:
        super().__init__()
        hidden_size = int(hf_config["hidden_size"])
        eps = float(hf_config.get("rms_norm_eps", 1e-6))
        self.self_attn = LlamaAttention(hf_config, vllm_config, prefix=f"{prefix}.self_attn")
        self.mlp = LlamaMLP(
            hidden_size,
            int(hf_config["intermediate_size"]),
            str(hf_config.get("hidden_act", "silu")),
            bias=bool(hf_config.get("mlp_bias", False)),
        )
        self.input_layernorm = RMSNorm(hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps=eps)

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
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


class LlamaModel(nn.Module):
    def __init__(self, hf_config: dict[str, Any], vllm_config: VllmConfig | None, prefix: str):
        super().__init__()
        hidden_size = int(hf_config["hidden_size"])
        self.embed_tokens = VocabParallelEmbedding(int(hf_config["vocab_size"]), hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, vllm_config, prefix=f"{prefix}.layers.{i}")
            for i in range(int(hf_config["num_hidden_layers"]))
        )
        self.norm = RMSNorm(hidden_size, eps=float(hf_config.get("rms_norm_eps", 1e-6)))

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        residual = None
        # Spans inside the forward are timed as it runs and made as it ends.
        with tracing.forward_spans():
            if tracing.is_full_detail():
                # One span per decoder layer: only at detail "full" (30 per step).
                for i, layer in enumerate(self.layers):
                    attributes = {**_LAYER_CODE, "tracevllm.layer": i}
                    with tracing.span("LlamaDecoderLayer.forward", attributes):
                        hidden_states, residual = layer(positions, hidden_states, residual)
            else:
                for layer in self.layers:
                    hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states  # [num_tokens, hidden_size]


_LAYER_CODE = tracing.code_attributes(LlamaDecoderLayer.forward)


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name -> (our fused parameter, which shard).
    stacked_params_mapping = (
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )

    def __init__(
        self, vllm_config: VllmConfig | None = None, prefix: str = "", *, hf_config: Any = None
    ) -> None:
        super().__init__()
        if hf_config is None:
            assert vllm_config is not None
            hf_config = vllm_config.model_config.hf_config
        self.config: dict[str, Any] = hf_config
        model_prefix = f"{prefix}.model" if prefix else "model"
        self.model = LlamaModel(hf_config, vllm_config, prefix=model_prefix)
        self.tie_word_embeddings = bool(hf_config.get("tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head: VocabParallelEmbedding = self.model.embed_tokens
        else:
            vocab_size, hidden_size = int(hf_config["vocab_size"]), int(hf_config["hidden_size"])
            self.lm_head = ParallelLMHead(vocab_size, hidden_size)

    @tracing.instrument("LlamaForCausalLM.forward")
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
    ) -> torch.Tensor:
        return self.model(input_ids, positions)  # [num_tokens, hidden_size]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # [num_sampled, hidden_size] -> [num_sampled, vocab_size]
        # vLLM: LogitsProcessor -> UnquantizedEmbeddingMethod.apply.
        return cpu_unquantized_gemm(self.lm_head, hidden_states, self.lm_head.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our parameters; returns the names loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # some checkpoints save the tied copy too
            for fused, shard_name, shard_id in self.stacked_params_mapping:
                if shard_name in name:
                    name = name.replace(shard_name, fused)
                    param = params[name]
                    start, size = self._shard_range(fused, shard_id, param.shape[0])
                    param.data[start : start + size].copy_(tensor)
                    break
            else:
                if name not in params:
                    raise ValueError(f"Unexpected weight {name!r} in the checkpoint.")
                params[name].data.copy_(tensor)
            loaded.add(name)
        if self.tie_word_embeddings:
            loaded.add("lm_head.weight")
        return loaded

    def _shard_range(self, fused: str, shard_id: str | int, rows: int) -> tuple[int, int]:
        """(first row, number of rows) of the fused weight that one HF tensor fills."""
        if fused == ".gate_up_proj":
            half = rows // 2
            return int(shard_id) * half, half
        layer: LlamaDecoderLayer = self.model.layers[0]  # type: ignore[assignment]
        q_size, kv_size = layer.self_attn.q_size, layer.self_attn.kv_size
        offsets = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
        return offsets[str(shard_id)]

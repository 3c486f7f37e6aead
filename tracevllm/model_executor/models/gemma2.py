"""Gemma-2: Llama's flat-batch decoder with soft caps, alternating windows and sandwich norms.

Mirrors vllm/model_executor/models/gemma2.py (``Gemma2MLP``, ``Gemma2Attention``,
``Gemma2DecoderLayer``, ``Gemma2Model``, ``Gemma2ForCausalLM``). What it
changes relative to llama.py:

- attention scores are squashed by ``tanh(s / cap) * cap`` before the softmax
  (``attn_logit_softcapping``, given to ``Attention(logits_soft_cap=...)``), and
  so are the final logits (``final_logit_softcapping``, ``LogitsProcessor(soft_cap=...)``);
- the scale is ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``, and
  ``head_dim`` comes from the config (it need not be hidden_size / num_heads);
- layers alternate between a sliding window and full attention
  (``config.layer_types``): two kinds of KV cache, so two KV cache groups,
  which the hybrid coordinator allocates from one pool;
- four norms a layer (before and after attention, before and after the MLP),
  each a ``GemmaRMSNorm``: ``x * (1 + w)``;
- the MLP is gated by GELU (tanh approximation), not SiLU;
- the embedding is multiplied by ``hidden_size ** 0.5``, a constant rounded to
  the model's dtype (as HF does), and the LM head is the embedding (tied).

Spans are llama.py's, named after this file's classes: ``Gemma2ForCausalLM.forward``
for the step's forward and, at detail ``full``, ``Gemma2DecoderLayer.forward``
per layer; the attention layer's own spans are the same ones.
Left out: quantization (and its KV-cache scales), LoRA.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tracevllm import tracing
from tracevllm.compilation.decorators import support_torch_compile
from tracevllm.distributed.parallel_state import (
    get_pp_group,
    get_tensor_model_parallel_world_size,
)
from tracevllm.model_executor.layers.activation import GeluAndMul
from tracevllm.model_executor.layers.attention import Attention
from tracevllm.model_executor.layers.layernorm import GemmaRMSNorm
from tracevllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tracevllm.model_executor.layers.logits_processor import LogitsProcessor
from tracevllm.model_executor.layers.rotary_embedding import get_rope
from tracevllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from tracevllm.model_executor.model_loader import default_weight_loader
from tracevllm.model_executor.models.utils import (
    AutoWeightsLoader,
    extract_layer_index,
    is_pp_missing_parameter,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)
from tracevllm.sequence import IntermediateTensors

if TYPE_CHECKING:
    from tracevllm.config import CacheConfig, VllmConfig


class Gemma2MLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_activation: str,
        quant_config: Any = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        # gate_proj and up_proj stacked, each split over the ranks:
        # [2 * intermediate_size / T, hidden_size] on each.
        self.gate_up_proj = MergedColumnParallelLinear(
            input_size=hidden_size,
            output_sizes=[intermediate_size] * 2,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            input_size=intermediate_size,
            output_size=hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.down_proj",
        )
        if hidden_activation != "gelu_pytorch_tanh":
            raise ValueError(
                "Gemma2 uses `gelu_pytorch_tanh` as the hidden activation "
                "function. Please set `hidden_activation` to `gelu_pytorch_tanh`."
            )
        self.act_fn = GeluAndMul(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size / T]
        x = self.act_fn(x)  # [num_tokens, intermediate_size / T]
        x, _ = self.down_proj(x)  # [num_tokens, hidden_size], summed over the ranks
        return x


class Gemma2Attention(nn.Module):
    def __init__(
        self,
        config: Any,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_position_embeddings: int,
        cache_config: CacheConfig | None = None,
        quant_config: Any = None,
        attn_logits_soft_cap: float | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        layer_idx = extract_layer_index(prefix)
        self.config = config
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
        # The config's, which need not be hidden_size / num_heads.
        self.head_dim = head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Not head_dim ** -0.5: Gemma-2 scales queries by a constant of its own.
        self.scaling = config.query_pre_attn_scalar**-0.5
        # q_proj, k_proj and v_proj stacked, this rank's heads of each:
        # [q_size + 2 * kv_size, hidden_size]
        self.qkv_proj = QKVParallelLinear(
            hidden_size=hidden_size,
            head_size=self.head_dim,
            total_num_heads=self.total_num_heads,
            total_num_kv_heads=self.total_num_kv_heads,
            bias=config.attention_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            input_size=self.total_num_heads * self.head_dim,
            output_size=hidden_size,
            bias=config.attention_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=max_position_embeddings,
            rope_parameters=getattr(config, "rope_parameters", None),
            is_neox_style=True,
        )
        # Every other layer slides (layer_types, filled in by Gemma2Config when
        # config.json predates it): two kinds of KV cache, two groups.
        is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        sliding_window = config.sliding_window if is_sliding else None
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.scaling,
            num_kv_heads=self.num_kv_heads,
            cache_config=cache_config,
            quant_config=quant_config,
            logits_soft_cap=attn_logits_soft_cap,
            per_layer_sliding_window=sliding_window,
            prefix=f"{prefix}.attn",
        )

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
    ) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)  # [num_tokens, q_size + 2 * kv_size]
        # [num_tokens, q_size], [num_tokens, kv_size], [num_tokens, kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        # Writes k/v into this layer's group's pages; soft-capped scores, maybe windowed.
        attn_output = self.attn(q, k, v)  # [num_tokens, q_size]
        output, _ = self.o_proj(attn_output)  # [num_tokens, hidden_size], summed over ranks
        return output


class Gemma2DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        cache_config: CacheConfig | None = None,
        quant_config: Any = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = Gemma2Attention(
            config=config,
            hidden_size=self.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            max_position_embeddings=config.max_position_embeddings,
            cache_config=cache_config,
            quant_config=quant_config,
            attn_logits_soft_cap=config.attn_logit_softcapping,
            prefix=f"{prefix}.self_attn",
        )
        self.mlp = Gemma2MLP(
            hidden_size=self.hidden_size,
            intermediate_size=config.intermediate_size,
            hidden_activation=config.hidden_activation,
            quant_config=quant_config,
            prefix=f"{prefix}.mlp",
        )
        # A norm before and after each of attention and the MLP ("sandwich").
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is deferred into the next pre-norm, as in llama.py;
        # the post-norms see the sublayer's output alone, before it is added.
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)  # type: ignore[assignment]
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions=positions, hidden_states=hidden_states)
        hidden_states = self.post_attention_layernorm(hidden_states)  # type: ignore[assignment]
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_feedforward_layernorm(hidden_states)  # type: ignore[assignment]
        return hidden_states, residual


@support_torch_compile(
    dynamic_arg_dims={
        "input_ids": 0,
        "positions": 0,
        "intermediate_tensors": 0,
        "inputs_embeds": 0,
    }
)
class Gemma2Model(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        cache_config = vllm_config.cache_config
        self.config = config
        # On every stage, as vLLM's: the first embeds, the last reads it as the LM head.
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: Gemma2DecoderLayer(config, cache_config, prefix=prefix),
            prefix=f"{prefix}.layers",
        )
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # The embedding scaled by sqrt(hidden_size), a constant rounded to the
        # model's dtype (the default dtype while the model is built), as HF's
        # (transformers#29402): in bf16, Gemma-2 9B's sqrt(3584) = 59.87 is 59.75.
        normalizer = torch.tensor(config.hidden_size**0.5)
        self.register_buffer("normalizer", normalizer, persistent=False)
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.normalizer  # type: ignore[no-any-return]

    def forward(
        self,
        input_ids: torch.Tensor | None,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        intermediate_tensors: IntermediateTensors | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if get_pp_group().is_first_rank:
            if inputs_embeds is not None:
                hidden_states = inputs_embeds
            else:
                assert input_ids is not None
                hidden_states = self.embed_input_ids(input_ids)  # [num_tokens, hidden_size]
            residual = None
        else:
            # A later stage starts from what the one before it sent.
            assert intermediate_tensors is not None
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        layers = islice(self.layers, self.start_layer, self.end_layer)
        # Spans inside the forward are timed as it runs and made as it ends.
        with tracing.forward_spans():
            if tracing.is_full_detail():
                # One span per decoder layer: only at detail "full".
                for i, layer in enumerate(layers, start=self.start_layer):
                    attributes = {**_LAYER_CODE, "tracevllm.layer": i}
                    with tracing.span("Gemma2DecoderLayer.forward", attributes):
                        hidden_states, residual = layer(positions, hidden_states, residual)
            else:
                for layer in layers:
                    hidden_states, residual = layer(positions, hidden_states, residual)
        if not get_pp_group().is_last_rank:
            assert residual is not None, "a pipeline stage without layers"
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states  # [num_tokens, hidden_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into this rank's parameters; returns the names loaded."""
        stacked_params_mapping = [
            # (param_name, shard_name, shard_id)
            (".qkv_proj", ".q_proj", "q"),
            (".qkv_proj", ".k_proj", "k"),
            (".qkv_proj", ".v_proj", "v"),
            (".gate_up_proj", ".gate_proj", 0),
            (".gate_up_proj", ".up_proj", 1),
        ]
        params_dict = dict(self.named_parameters())
        loaded_params: set[str] = set()
        for name, loaded_weight in weights:
            for param_name, weight_name, shard_id in stacked_params_mapping:
                if weight_name not in name:
                    continue
                name = name.replace(weight_name, param_name)
                if is_pp_missing_parameter(name, self):
                    break
                param = params_dict[name]
                param.weight_loader(param, loaded_weight, shard_id)  # type: ignore[attr-defined]
                loaded_params.add(name)
                break
            else:
                if is_pp_missing_parameter(name, self):
                    continue
                if name not in params_dict:
                    raise ValueError(f"Unexpected weight {name!r} in the checkpoint.")
                param = params_dict[name]
                weight_loader = getattr(param, "weight_loader", default_weight_loader)
                weight_loader(param, loaded_weight)
                loaded_params.add(name)
        return loaded_params


_LAYER_CODE = tracing.code_attributes(Gemma2DecoderLayer.forward)


class Gemma2ForCausalLM(nn.Module):
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        # Every Gemma-2 checkpoint ties the LM head to the embedding.
        assert config.tie_word_embeddings
        self.model = Gemma2Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        # The final logits squashed into (-cap, cap) by tanh.
        self.logits_processor = LogitsProcessor(
            config.vocab_size, soft_cap=config.final_logit_softcapping
        )
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    @tracing.instrument("Gemma2ForCausalLM.forward")
    def forward(
        self,
        input_ids: torch.Tensor | None,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)  # type: ignore[no-any-return]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # [num_sampled, hidden_size] -> [num_sampled, vocab_size], through the embedding
        return self.logits_processor(self.model.embed_tokens, hidden_states)  # type: ignore[no-any-return]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # The LM head is the embedding: a checkpoint that saves it twice has it skipped.
        loader = AutoWeightsLoader(
            self, skip_prefixes=(["lm_head."] if self.config.tie_word_embeddings else None)
        )
        return loader.load_weights(weights)

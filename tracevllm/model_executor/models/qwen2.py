"""Qwen2: Llama with biases on q, k and v.

Mirrors vllm/model_executor/models/qwen2.py (``Qwen2MLP``, ``Qwen2Attention``,
``Qwen2DecoderLayer``, ``Qwen2Model``, ``Qwen2ForCausalLM``). The decoder is
llama.py's, flat batch and tensor/pipeline split included; what Qwen2 changes:

- ``qkv_proj`` has a bias (``QKVParallelLinear(bias=True)``): HF's q_proj,
  k_proj and v_proj biases load into it through the same ``weight_loader`` as
  the weights, each rank keeping its heads' slice; o_proj and the MLP have none;
- the head size is always ``hidden_size / num_attention_heads``.

Sliding window: ``use_sliding_window`` with ``max_window_layers`` makes HF's
config list each layer in ``layer_types``; a ``sliding_attention`` layer gives
its Attention the window (``per_layer_sliding_window``), and the KV cache
groups follow (one group when every layer slides, two when they mix). vLLM
asserts instead that the layers do not mix.

Spans are llama.py's, named after this file's classes: ``Qwen2ForCausalLM.forward``
for the step's forward and, at detail ``full``, ``Qwen2DecoderLayer.forward``
per layer (``Qwen3DecoderLayer.forward`` when Qwen3Model reuses this model).

Left out: quantization, LoRA, Eagle hooks, dual-chunk attention, the
bidirectional (``is_causal: false``) embedding variant, BAGEL's ``qk_norm``.
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
from tracevllm.model_executor.layers.activation import SiluAndMul
from tracevllm.model_executor.layers.attention import Attention
from tracevllm.model_executor.layers.layernorm import RMSNorm
from tracevllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tracevllm.model_executor.layers.logits_processor import LogitsProcessor
from tracevllm.model_executor.layers.rotary_embedding import get_rope
from tracevllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from tracevllm.model_executor.model_loader import default_weight_loader
from tracevllm.model_executor.models.utils import (
    AutoWeightsLoader,
    PPMissingLayer,
    extract_layer_index,
    is_pp_missing_parameter,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)
from tracevllm.sequence import IntermediateTensors

if TYPE_CHECKING:
    from tracevllm.config import CacheConfig, VllmConfig


class Qwen2MLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
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
        if hidden_act != "silu":
            raise ValueError(
                f"Unsupported activation: {hidden_act}. Only silu is supported for now."
            )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size / T]
        x = self.act_fn(x)  # [num_tokens, intermediate_size / T]
        x, _ = self.down_proj(x)  # [num_tokens, hidden_size], summed over the ranks
        return x


class Qwen2Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        rope_parameters: dict[str, Any] | None,
        max_position: int = 4096 * 32,
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
        self.head_dim = hidden_size // self.total_num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        # q_proj, k_proj and v_proj stacked, this rank's heads of each, and
        # their biases stacked the same way:
        # [q_size + 2 * kv_size, hidden_size] and [q_size + 2 * kv_size]
        self.qkv_proj = QKVParallelLinear(
            hidden_size=hidden_size,
            head_size=self.head_dim,
            total_num_heads=self.total_num_heads,
            total_num_kv_heads=self.total_num_kv_heads,
            bias=True,
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

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
    ) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)  # [num_tokens, q_size + 2 * kv_size], bias added
        # [num_tokens, q_size], [num_tokens, kv_size], [num_tokens, kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        # Writes k/v into the paged cache, then reads this request's whole past back.
        attn_output = self.attn(q, k, v)  # [num_tokens, q_size]
        output, _ = self.o_proj(attn_output)  # [num_tokens, hidden_size], summed over ranks
        return output


def layer_sliding_window(config: Any, prefix: str) -> int | None:
    """The window of the layer ``prefix`` names, if HF's ``layer_types`` has it slide."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types and layer_types[extract_layer_index(prefix)] == "sliding_attention":
        return config.sliding_window  # type: ignore[no-any-return]
    return None


class Qwen2DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        cache_config: CacheConfig | None = None,
        quant_config: Any = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = Qwen2Attention(
            hidden_size=self.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            rope_parameters=config.rope_parameters,
            max_position=config.max_position_embeddings,
            cache_config=cache_config,
            quant_config=quant_config,
            prefix=f"{prefix}.self_attn",
            per_layer_sliding_window=layer_sliding_window(config, prefix),
        )
        self.mlp = Qwen2MLP(
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
class Qwen2Model(nn.Module):
    def __init__(
        self,
        *,
        vllm_config: VllmConfig,
        prefix: str = "",
        decoder_layer_type: type[nn.Module] = Qwen2DecoderLayer,
    ) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.vocab_size = config.vocab_size
        pp_group = get_pp_group()
        # The embedding on the first stage, and on the last when the LM head
        # is tied to it.
        if pp_group.is_first_rank or (config.tie_word_embeddings and pp_group.is_last_rank):
            self.embed_tokens: nn.Module = VocabParallelEmbedding(
                self.vocab_size, config.hidden_size
            )
        else:
            self.embed_tokens = PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: decoder_layer_type(
                config=config,
                cache_config=vllm_config.cache_config,
                quant_config=None,
                prefix=prefix,
            ),
            prefix=f"{prefix}.layers",
        )
        if pp_group.is_last_rank:
            self.norm: nn.Module = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        else:
            self.norm = PPMissingLayer()
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size
        )
        # A layer's span is named after the class it is (Qwen3Model's are Qwen3DecoderLayers).
        self.layer_span_name = f"{decoder_layer_type.__name__}.forward"
        self.layer_code = tracing.code_attributes(decoder_layer_type.forward)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)  # type: ignore[no-any-return]

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
                    attributes = {**self.layer_code, "tracevllm.layer": i}
                    with tracing.span(self.layer_span_name, attributes):
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
        """Copy HF-named tensors into this rank's parameters; returns the names loaded.
        A q/k/v bias goes where its weight goes: ``.q_proj.bias`` to ``.qkv_proj.bias``."""
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
            if "rotary_emb.inv_freq" in name:
                continue
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


class Qwen2ForCausalLM(nn.Module):
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = Qwen2Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
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

    @tracing.instrument("Qwen2ForCausalLM.forward")
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

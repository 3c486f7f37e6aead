"""Qwen3-MoE: Qwen3's attention, and a mixture of experts in place of the MLP.

Mirrors vllm/model_executor/models/qwen3_moe.py (``Qwen3MoeMLP``,
``Qwen3MoeSparseMoeBlock``, ``Qwen3MoeAttention``, ``Qwen3MoeDecoderLayer``,
``Qwen3MoeModel``, ``Qwen3MoeForCausalLM``). Two things differ from Llama:

- The attention normalises q and k per head (an RMSNorm over ``head_dim``,
  weights shared by every head) before RoPE, as Qwen3 does.
- The MLP of a sparse layer is ``Qwen3MoeSparseMoeBlock``: a router
  (``gate``, a ``ReplicatedLinear`` to one logit per expert) and ``FusedMoE``,
  which sends each token to its ``num_experts_per_tok`` best experts and sums
  their outputs weighted by the router's softmax, renormalised over the chosen
  ones when ``norm_topk_prob``. A layer is sparse when ``(i + 1) %
  decoder_sparse_step == 0`` and i is not in ``mlp_only_layers``; the others
  keep a dense MLP (``Qwen3MoeMLP``).

The checkpoint names each expert's gate, up and down projections separately
(``mlp.experts.7.gate_proj.weight``); ``load_weights`` sends them by expert
id into the layer's stacked ``w13_weight`` / ``w2_weight`` through
``FusedMoE.make_expert_params_mapping``. Tensor parallelism splits each
expert's intermediate dimension (every rank holds every expert), as a dense
MLP's is split.

Left out: quantization, LoRA, Eagle hooks, expert parallelism and its load
balancer (``enable_eplb``, redundant experts), sequence-parallel MoE, shared
experts (``shared_expert_intermediate_size``), dual-chunk attention,
``torch.compile``.
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
from tracevllm.model_executor.layers.fused_moe import FusedMoE
from tracevllm.model_executor.layers.layernorm import RMSNorm
from tracevllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
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


class Qwen3MoeMLP(nn.Module):
    """The dense MLP of the layers that have no experts (Llama's)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        quant_config: Any = None,
        reduce_results: bool = True,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            [intermediate_size] * 2,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=False,
            quant_config=quant_config,
            reduce_results=reduce_results,
            prefix=f"{prefix}.down_proj",
        )
        if hidden_act != "silu":
            raise ValueError(
                f"Unsupported activation: {hidden_act}. Only silu is supported for now."
            )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate_size / T]
        x, _ = self.down_proj(self.act_fn(gate_up))  # [num_tokens, hidden_size]
        return x


# --8<-- [start:qwen3_moe_sparse_moe_block]
class Qwen3MoeSparseMoeBlock(nn.Module):
    """The router and the experts: each token through its top-k experts, weighted."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.tp_size = get_tensor_model_parallel_world_size()
        self.n_routed_experts = config.num_experts
        if self.tp_size > config.num_experts:
            raise ValueError(
                f"Tensor parallel size {self.tp_size} is greater than "
                f"the number of experts {config.num_experts}."
            )
        # One logit per expert; every rank routes every token the same way.
        self.gate = ReplicatedLinear(
            config.hidden_size, config.num_experts, bias=False, prefix=f"{prefix}.gate"
        )
        self.experts = FusedMoE(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            # Qwen3-30B-A3B renormalises the kept weights; a config may not.
            renormalize=config.norm_topk_prob,
            prefix=f"{prefix}.experts",
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [num_tokens, hidden_size]
        router_logits, _ = self.gate(hidden_states)  # [num_tokens, num_experts]
        # Summed over the chosen experts, then over the TP ranks.
        return self.experts(hidden_states=hidden_states, router_logits=router_logits)  # type: ignore[no-any-return]


# --8<-- [end:qwen3_moe_sparse_moe_block]


class Qwen3MoeAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        rope_parameters: dict[str, Any] | None,
        max_position_embeddings: int = 8192,
        head_dim: int | None = None,
        rms_norm_eps: float = 1e-06,
        qkv_bias: bool = False,
        cache_config: CacheConfig | None = None,
        quant_config: Any = None,
        prefix: str = "",
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
        # Qwen3 sets head_dim apart from hidden_size / num_heads (128 for 2048 / 32).
        self.head_dim = head_dim or hidden_size // self.total_num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim**-0.5
        self.max_position_embeddings = max_position_embeddings
        self.qkv_proj = QKVParallelLinear(
            hidden_size,
            self.head_dim,
            self.total_num_heads,
            self.total_num_kv_heads,
            bias=qkv_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim,
            hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=max_position_embeddings,
            rope_parameters=rope_parameters,
        )
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.scaling,
            num_kv_heads=self.num_kv_heads,
            cache_config=cache_config,
            quant_config=quant_config,
            prefix=f"{prefix}.attn",
        )
        # One norm over head_dim, shared by every head (so TP needs no split).
        self.q_norm = RMSNorm(self.head_dim, eps=rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=rms_norm_eps)

    # --8<-- [start:qwen3_moe_attention_forward]
    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
    ) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # Per-head RMSNorm: view as [num_tokens, heads, head_dim], normalise the last dim.
        q_by_head = q.view(*q.shape[:-1], q.shape[-1] // self.head_dim, self.head_dim)
        q = self.q_norm(q_by_head).view(q.shape)  # type: ignore[union-attr]
        k_by_head = k.view(*k.shape[:-1], k.shape[-1] // self.head_dim, self.head_dim)
        k = self.k_norm(k_by_head).view(k.shape)  # type: ignore[union-attr]
        q, k = self.rotary_emb(positions, q, k)
        attn_output = self.attn(q, k, v)  # [num_tokens, q_size]
        output, _ = self.o_proj(attn_output)  # [num_tokens, hidden_size], summed over ranks
        return output  # type: ignore[no-any-return]

    # --8<-- [end:qwen3_moe_attention_forward]


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.hidden_size = config.hidden_size
        self.self_attn = Qwen3MoeAttention(
            hidden_size=self.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            rope_parameters=getattr(config, "rope_parameters", None),
            max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=getattr(config, "attention_bias", False),
            head_dim=getattr(config, "head_dim", None),
            cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.self_attn",
        )
        # --8<-- [start:qwen3_moe_sparse_layers]
        # Experts on every decoder_sparse_step-th layer, except mlp_only_layers.
        layer_idx = extract_layer_index(prefix)
        mlp_only_layers = getattr(config, "mlp_only_layers", None) or []
        self.mlp: nn.Module
        if layer_idx not in mlp_only_layers and (
            config.num_experts > 0 and (layer_idx + 1) % config.decoder_sparse_step == 0
        ):
            self.mlp = Qwen3MoeSparseMoeBlock(vllm_config=vllm_config, prefix=f"{prefix}.mlp")
        else:
            self.mlp = Qwen3MoeMLP(
                hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size,
                hidden_act=config.hidden_act,
                prefix=f"{prefix}.mlp",
            )
        # --8<-- [end:qwen3_moe_sparse_layers]
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


_LAYER_CODE = tracing.code_attributes(Qwen3MoeDecoderLayer.forward)


@support_torch_compile(
    dynamic_arg_dims={
        "input_ids": 0,
        "positions": 0,
        "intermediate_tensors": 0,
        "inputs_embeds": 0,
    }
)
class Qwen3MoeModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.vocab_size = config.vocab_size
        # As vLLM's: the embedding and the final norm on every pipeline stage.
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: Qwen3MoeDecoderLayer(vllm_config=vllm_config, prefix=prefix),
            prefix=f"{prefix}.layers",
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)  # type: ignore[no-any-return]

    def forward(
        self,
        input_ids: torch.Tensor | None,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        intermediate_tensors: IntermediateTensors | None = None,
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
            assert intermediate_tensors is not None
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        layers = islice(self.layers, self.start_layer, self.end_layer)
        with tracing.forward_spans():
            if tracing.is_full_detail():
                # One span per decoder layer, each holding its FusedMoE.forward.
                for i, layer in enumerate(layers, start=self.start_layer):
                    attributes = {**_LAYER_CODE, "tracevllm.layer": i}
                    with tracing.span("Qwen3MoeDecoderLayer.forward", attributes):
                        hidden_states, residual = layer(positions, hidden_states, residual)
            else:
                for layer in layers:
                    hidden_states, residual = layer(positions, hidden_states, residual)
        if not get_pp_group().is_last_rank:
            assert residual is not None, "a pipeline stage without layers"
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states  # [num_tokens, hidden_size]

    def get_expert_mapping(self) -> list[tuple[str, str, int, str]]:
        """(param_name, weight_name, expert_id, shard_id) for every expert's three weights."""
        return FusedMoE.make_expert_params_mapping(
            self,
            ckpt_gate_proj_name="gate_proj",
            ckpt_down_proj_name="down_proj",
            ckpt_up_proj_name="up_proj",
            num_experts=self.config.num_experts,
        )

    # --8<-- [start:qwen3_moe_load_weights]
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
        expert_params_mapping = self.get_expert_mapping()
        params_dict = dict(self.named_parameters())
        loaded_params: set[str] = set()
        for name, loaded_weight in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if is_pp_missing_parameter(name, self):
                continue
            for param_name, weight_name, shard_id in stacked_params_mapping:
                if weight_name not in name:
                    continue
                # "mlp.experts.3.gate_proj" holds ".gate_proj" too: experts are
                # mapped below, by id, before the name is touched.
                if "mlp.experts" in name:
                    continue
                # The attention's q/k/v, a dense layer's gate/up: into fused parameters.
                name = name.replace(weight_name, param_name)
                param = params_dict[name]
                param.weight_loader(param, loaded_weight, shard_id)  # type: ignore[attr-defined]
                break
            else:
                for param_name, weight_name, expert_id, shard_id in expert_params_mapping:
                    if weight_name not in name:
                        continue
                    # experts.3.up_proj.weight -> experts.w13_weight, slot 3, second half.
                    name = name.replace(weight_name, param_name)
                    param = params_dict[name]
                    param.weight_loader(  # type: ignore[attr-defined]
                        param, loaded_weight, name, shard_id=shard_id, expert_id=expert_id
                    )
                    break
                else:
                    if name not in params_dict:
                        raise ValueError(f"Unexpected weight {name!r} in the checkpoint.")
                    param = params_dict[name]
                    weight_loader = getattr(param, "weight_loader", default_weight_loader)
                    weight_loader(param, loaded_weight)
            loaded_params.add(name)
        return loaded_params

    # --8<-- [end:qwen3_moe_load_weights]


class Qwen3MoeForCausalLM(nn.Module):
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = Qwen3MoeModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, prefix=maybe_prefix(prefix, "lm_head")
        )
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        # vLLM's MixtureOfExperts facts: the FusedMoE layers this stage holds.
        self.moe_layers: list[FusedMoE] = [
            layer.mlp.experts
            for layer in self.model.layers
            if not isinstance(layer, PPMissingLayer)
            and isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)
        ]
        if not self.moe_layers:
            raise RuntimeError("No Qwen3MoE layer found in the model.layers.")
        self.num_moe_layers = len(self.moe_layers)
        self.num_routed_experts = config.num_experts

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    @tracing.instrument("Qwen3MoeForCausalLM.forward")
    def forward(
        self,
        input_ids: torch.Tensor | None,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)  # type: ignore[no-any-return]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # [num_sampled, hidden_size] -> [num_sampled, vocab_size]
        return self.logits_processor(self.lm_head, hidden_states)  # type: ignore[no-any-return]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # A tied LM head is the embedding: some checkpoints save it twice.
        loader = AutoWeightsLoader(
            self, skip_prefixes=(["lm_head."] if self.config.tie_word_embeddings else None)
        )
        return loader.load_weights(weights)

    def get_expert_mapping(self) -> list[tuple[str, str, int, str]]:
        return self.model.get_expert_mapping()

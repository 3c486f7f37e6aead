"""The mixture-of-experts layer: every expert's weights stacked, loaded by expert id.

Mirrors vllm/model_executor/layers/fused_moe/layer.py (``FusedMoE``: its
constructor, ``weight_loader`` with ``_load_w13`` / ``_load_w2``,
``make_expert_params_mapping``, ``forward``) with
``UnquantizedFusedMoEMethod.create_weights`` and ``apply``
(vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py)
folded in, as linear.py folds in ``UnquantizedLinearMethod``. The experts'
gate and up projections are one parameter, ``w13_weight [num_experts, 2 *
intermediate, hidden]`` (gate rows, then up rows), their down projections
``w2_weight [num_experts, hidden, intermediate]``. Tensor parallelism
splits the intermediate dimension, as a MergedColumnParallelLinear then a
RowParallelLinear would: each rank holds every expert's slice of it, and
the ranks' partial outputs are all-reduced.

Departures: ``reduce_results`` (vLLM before 0.11; 0.22's runner always
all-reduces when TP > 1) lets a model sum a shared expert in first and
reduce once; the router's logits come from the model's own gate (vLLM's
external-router path), and the layer picks the torch reference or the
Triton kernel itself (``moe_backend``; vLLM: ``KernelConfig.moe_backend``).
Left out: quantization, expert parallelism and its load balancer
(redundant experts, expert maps), data- and sequence-parallel MoE, shared
experts fused into the layer, grouped top-k, custom routing functions,
biases, padded hidden sizes, the modular-kernel runner.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tracevllm import tracing
from tracevllm.distributed.communication_op import tensor_model_parallel_all_reduce
from tracevllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from tracevllm.model_executor.layers.fused_moe.fused_moe import fused_experts
from tracevllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk

# The checkpoint dimension a shard is split along across TP ranks (the
# intermediate one): rows of gate (w1) and up (w3), columns of down (w2).
SHARD_ID_TO_SHARDED_DIM = {"w1": 0, "w2": 1, "w3": 0}


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}.")
    return value


def expert_token_counts(topk_ids: torch.Tensor, num_experts: int) -> list[int]:
    """How many tokens each expert received this step (a token counts once per expert)."""
    return torch.bincount(topk_ids.flatten().long(), minlength=num_experts).tolist()


# --8<-- [start:fused_moe]
class FusedMoE(nn.Module):
    """Route each token to its ``top_k`` experts and sum their SiLU-gated MLPs.

    Args: ``num_experts`` (all of them), ``top_k`` (experts per token),
    ``hidden_size``, ``intermediate_size`` (one expert's, before TP),
    ``renormalize`` (divide the kept weights by their sum: Qwen3-MoE's
    ``norm_topk_prob``, Mixtral always), ``scoring_func`` ("softmax" or
    "sigmoid"), ``tp_size`` (None: the TP group's), ``reduce_results``
    (all-reduce the output over TP), ``prefix`` (the layer's name).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        params_dtype: torch.dtype | None = None,
        renormalize: bool = True,
        quant_config: Any = None,
        tp_size: int | None = None,
        prefix: str = "",
        scoring_func: str = "softmax",
        activation: str = "silu",
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        self.global_num_experts = _positive_int("num_experts", num_experts)
        self.top_k = _positive_int("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k ({top_k}) must not exceed num_experts ({num_experts}).")
        hidden_size = _positive_int("hidden_size", hidden_size)
        intermediate_size = _positive_int("intermediate_size", intermediate_size)
        if quant_config is not None:
            raise ValueError("FusedMoE supports no quantization (quant_config must be None).")
        if scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"Unsupported scoring function: {scoring_func}")
        if activation != "silu":
            raise ValueError(f"Unsupported FusedMoe activation: {activation}.")
        self.tp_size = (
            get_tensor_model_parallel_world_size()
            if tp_size is None
            else _positive_int("tp_size", tp_size)
        )
        if intermediate_size % self.tp_size != 0:
            raise ValueError(
                f"intermediate_size ({intermediate_size}) is not divisible by the "
                f"tensor parallel size ({self.tp_size})."
            )
        self.tp_rank = get_tensor_model_parallel_rank() if self.tp_size > 1 else 0
        self.local_num_experts = self.global_num_experts  # no expert parallelism
        self.hidden_size = hidden_size
        self.intermediate_size_per_partition = intermediate_size // self.tp_size
        self.renormalize = renormalize
        self.scoring_func = scoring_func
        self.activation = activation
        self.reduce_results = reduce_results
        self.layer_name = prefix
        parts = prefix.split(".")
        self.layer_index = int(parts[parts.index("layers") + 1]) if "layers" in parts else 0
        # "torch" or "triton"; None: Triton on a GPU, the torch reference elsewhere.
        self.moe_backend: str | None = None

        dtype = params_dtype or torch.get_default_dtype()
        shard = self.intermediate_size_per_partition
        # vLLM's UnquantizedFusedMoEMethod.create_weights: gate_up (column
        # parallel), then down (row parallel).
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * shard, hidden_size, dtype=dtype), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, shard, dtype=dtype), requires_grad=False
        )
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    # --8<-- [end:fused_moe]

    # --8<-- [start:weight_loader]
    def weight_loader(
        self,
        param: nn.Parameter,
        loaded_weight: torch.Tensor,
        weight_name: str,
        shard_id: str,
        expert_id: int,
        return_success: bool = False,
    ) -> bool | None:
        """Copy one expert's checkpoint tensor (``[rows, cols]``) into its slot of ``param``.

        ``shard_id`` says which: "w1" (gate) and "w3" (up) fill the first and
        second half of ``w13_weight[expert_id]``, "w2" (down) fills
        ``w2_weight[expert_id]``; each is cut to this TP rank's slice of the
        intermediate dimension. A 3-D tensor holds every expert at once.
        """
        if shard_id not in ("w1", "w2", "w3"):
            raise ValueError(f"shard_id must be ['w1','w2','w3'] but got {shard_id}.")
        if isinstance(expert_id, bool) or not isinstance(expert_id, int):
            raise ValueError(f"expert_id must be an int, got {expert_id!r}.")
        if not 0 <= expert_id < self.global_num_experts:
            raise ValueError(
                f"expert_id {expert_id} of {weight_name!r} is out of range: "
                f"this layer has {self.global_num_experts} experts."
            )
        if "weight" not in weight_name:
            return False if return_success else None
        shard_dim = SHARD_ID_TO_SHARDED_DIM[shard_id]
        full_load = loaded_weight.ndim == 3  # [num_experts, rows, cols]
        if full_load:
            shard_dim += 1
        expert_data = param.data if full_load else param.data[expert_id]
        if shard_id == "w2":
            self._load_w2(expert_data, shard_dim, loaded_weight, weight_name)
        else:
            self._load_w13(expert_data, shard_dim, shard_id, loaded_weight, weight_name)
        return True if return_success else None

    def _load_w13(
        self,
        expert_data: torch.Tensor,  # [(E,) 2 * shard, hidden]
        shard_dim: int,
        shard_id: str,
        loaded_weight: torch.Tensor,  # [(E,) intermediate, hidden]
        weight_name: str,
    ) -> None:
        # Gate/up are column parallel: this rank's rows of the intermediate dim.
        shard_size = expert_data.shape[shard_dim] // 2
        loaded_weight = self._narrow_to_rank(loaded_weight, shard_dim, shard_size, weight_name)
        # w1 (gate) into the first half of w13, w3 (up) into the second.
        offset = 0 if shard_id == "w1" else shard_size
        self._copy(expert_data.narrow(shard_dim, offset, shard_size), loaded_weight, weight_name)

    def _load_w2(
        self,
        expert_data: torch.Tensor,  # [(E,) hidden, shard]
        shard_dim: int,
        loaded_weight: torch.Tensor,  # [(E,) hidden, intermediate]
        weight_name: str,
    ) -> None:
        # Down is row parallel: this rank's columns of the intermediate dim.
        shard_size = expert_data.shape[shard_dim]
        loaded_weight = self._narrow_to_rank(loaded_weight, shard_dim, shard_size, weight_name)
        self._copy(expert_data, loaded_weight, weight_name)

    # --8<-- [end:weight_loader]

    def _narrow_to_rank(
        self, loaded_weight: torch.Tensor, shard_dim: int, shard_size: int, weight_name: str
    ) -> torch.Tensor:
        full = shard_size * self.tp_size
        if loaded_weight.shape[shard_dim] != full:
            raise ValueError(
                f"{weight_name!r} has {loaded_weight.shape[shard_dim]} along its intermediate "
                f"dimension ({shard_dim}); this layer expects {full}."
            )
        return loaded_weight.narrow(shard_dim, shard_size * self.tp_rank, shard_size)

    @staticmethod
    def _copy(expert_data: torch.Tensor, loaded_weight: torch.Tensor, weight_name: str) -> None:
        # copy_ would broadcast a wrongly shaped tensor into the slot without a word.
        if expert_data.shape != loaded_weight.shape:
            raise ValueError(
                f"{weight_name!r} has shape {tuple(loaded_weight.shape)} for a slot of shape "
                f"{tuple(expert_data.shape)}."
            )
        expert_data.copy_(loaded_weight)

    @classmethod
    def make_expert_params_mapping(
        cls,
        model: nn.Module,
        ckpt_gate_proj_name: str,
        ckpt_down_proj_name: str,
        ckpt_up_proj_name: str,
        num_experts: int,
        num_redundant_experts: int = 0,
    ) -> list[tuple[str, str, int, str]]:
        """``(param_name, weight_name, expert_id, shard_id)`` for every expert's three weights.

        A checkpoint name containing ``weight_name`` (``experts.3.gate_proj.``)
        goes to the parameter named with ``param_name`` in its place
        (``experts.w13_``), through ``weight_loader(..., shard_id, expert_id)``.
        ``model`` is vLLM's (it looks for LoRA's ``base_layer``; unused here).
        """
        if num_redundant_experts != 0:
            raise ValueError("num_redundant_experts must be 0: expert parallelism is left out.")
        return [
            (
                "experts.w13_"
                if weight_name in (ckpt_gate_proj_name, ckpt_up_proj_name)
                else "experts.w2_",
                f"experts.{expert_id}.{weight_name}.",
                expert_id,
                shard_id,
            )
            for expert_id in range(num_experts)
            for shard_id, weight_name in (
                ("w1", ckpt_gate_proj_name),
                ("w2", ckpt_down_proj_name),
                ("w3", ckpt_up_proj_name),
            )
        ]

    # --8<-- [start:fused_moe_forward]
    def forward(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        router_logits: torch.Tensor,  # [num_tokens, num_experts]
    ) -> torch.Tensor:
        if tracing.is_full_detail():
            return self._forward_traced(hidden_states, router_logits)
        return self.forward_impl(hidden_states, router_logits)

    def forward_impl(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor:
        topk_weights, topk_ids = self.select_experts(hidden_states, router_logits)
        return self._apply_experts(hidden_states, topk_weights, topk_ids)

    def select_experts(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights: ``[num_tokens, top_k]`` each."""
        topk_weights, topk_ids, _ = fused_topk(
            hidden_states,
            router_logits,
            self.top_k,
            self.renormalize,
            scoring_func=self.scoring_func,
        )
        return topk_weights, topk_ids

    def _apply_experts(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts' weighted sum, over this rank's slice, then over all ranks.

        vLLM's ``UnquantizedFusedMoEMethod.apply`` (and the runner's all-reduce).
        """
        out = fused_experts(
            hidden_states,
            self.w13_weight,
            self.w2_weight,
            topk_weights,
            topk_ids,
            activation=self.activation,
            global_num_experts=self.global_num_experts,
            backend=self.moe_backend,
        )  # [num_tokens, hidden_size]
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    # --8<-- [end:fused_moe_forward]

    def _forward_traced(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor
    ) -> torch.Tensor:
        """``forward_impl`` in a ``FusedMoE.forward`` span that counts each expert's tokens."""
        attributes = {
            **_FORWARD_CODE,
            "tracevllm.layer": self.layer_index,
            "tracevllm.layer_name": self.layer_name,
            "tracevllm.moe.num_experts": self.global_num_experts,
            "tracevllm.moe.top_k": self.top_k,
        }
        with tracing.span("FusedMoE.forward", attributes) as span:
            topk_weights, topk_ids = self.select_experts(hidden_states, router_logits)
            out = self._apply_experts(hidden_states, topk_weights, topk_ids)
            counts = expert_token_counts(topk_ids, self.global_num_experts)
            span.set_attribute("tracevllm.moe.tokens_per_expert", counts)
        return out

    def extra_repr(self) -> str:
        return (
            f"global_num_experts={self.global_num_experts}, top_k={self.top_k}, "
            f"intermediate_size_per_partition={self.intermediate_size_per_partition}, "
            f"tp_size={self.tp_size}, renormalize={self.renormalize}"
        )


_FORWARD_CODE = tracing.code_attributes(FusedMoE.forward)

"""Linear layers split across tensor-parallel ranks, each rank loading only its shard.

Mirrors vllm/model_executor/layers/linear.py (``LinearBase``,
``ReplicatedLinear``, ``ColumnParallelLinear``, ``MergedColumnParallelLinear``,
``QKVParallelLinear``, ``RowParallelLinear``), with ``UnquantizedLinearMethod``
(``create_weights``, ``process_weights_after_loading``, ``apply``) folded into
``LinearBase``.

``Y = X A`` with ``A`` of shape ``[input_size, output_size]`` (stored, as in
``nn.Linear``, transposed: ``weight`` is ``[output, input]``). T ranks split it
one of two ways:

- column parallel: each rank holds ``output_size / T`` output rows of the
  weight and computes that slice of Y; nothing crosses ranks;
- row parallel: each rank holds ``input_size / T`` input columns, takes that
  slice of X (which a column-parallel layer just produced) and computes a
  partial Y; an all-reduce sums the partials.

So an MLP (gate/up column, down row) or an attention block (q/k/v column by
heads, o row) costs one all-reduce. Each parameter's ``weight_loader`` copies
the rank's shard out of a full checkpoint tensor. ``forward`` returns
``(output, output_bias)`` as vLLM's (the bias when ``skip_bias_add``, else None).

Departures: plain ``nn.Parameter`` with attributes (vLLM's v1 loaders; no
``BasevLLMParameter``); no quantization methods (``quant_config`` must be None);
``MergedColumnParallelLinear``'s loader takes one shard id or None, not a
tuple of them. Left out: GGUF, bitsandbytes and FP8 block shards, ``disable_tp``
on the merged/QKV helpers' callers, LoRA.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import Parameter

from tracevllm.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from tracevllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from tracevllm.distributed.utils import divide, split_tensor_along_last_dim
from tracevllm.model_executor.layers.utils import (
    cpu_unquantized_gemm,
    dispatch_cpu_unquantized_gemm,
)
from tracevllm.model_executor.utils import set_weight_attrs


class LinearBase(nn.Module):
    """What every linear layer shares: sizes, this rank's place, the matmul."""

    weight: Parameter
    bias: Parameter | None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: Any = None,
        prefix: str = "",
        *,
        return_bias: bool = True,
        disable_tp: bool = False,
    ) -> None:
        super().__init__()
        if quant_config is not None:
            raise ValueError("tracevllm runs unquantized weights only (quant_config=None).")
        self.input_size = input_size
        self.output_size = output_size
        self.has_bias = bias
        self.skip_bias_add = skip_bias_add
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.quant_config = quant_config
        self.prefix = prefix
        self.return_bias = return_bias
        self.disable_tp = disable_tp
        self.tp_rank = get_tensor_model_parallel_rank() if not disable_tp else 0
        self.tp_size = get_tensor_model_parallel_world_size() if not disable_tp else 1

    def create_weights(
        self, input_size_per_partition: int, output_partition_sizes: list[int]
    ) -> None:
        """This rank's weight, ``[sum(output_partition_sizes), input_size_per_partition]``
        (vLLM: ``UnquantizedLinearMethod.create_weights``). Empty: the loader fills it."""
        weight = Parameter(
            torch.empty(
                sum(output_partition_sizes), input_size_per_partition, dtype=self.params_dtype
            ),
            requires_grad=False,
        )
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0})
        set_weight_attrs(weight, {"weight_loader": self.weight_loader})
        self.register_parameter("weight", weight)

    def create_bias(self, size: int) -> None:
        if not self.has_bias:
            self.register_parameter("bias", None)
            return
        bias = Parameter(torch.empty(size, dtype=self.params_dtype), requires_grad=False)
        set_weight_attrs(bias, {"output_dim": 0, "weight_loader": self.weight_loader})
        self.register_parameter("bias", bias)

    def weight_loader(self, param: Parameter, loaded_weight: torch.Tensor) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self) -> None:
        # vLLM: UnquantizedLinearMethod.process_weights_after_loading. The
        # packed copy replaces the plain one (no second copy in memory).
        dispatch_cpu_unquantized_gemm(self, remove_weight=True)

    def _output(self, output: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, Parameter | None]:
        if not self.return_bias:
            return output
        return output, self.bias if self.skip_bias_add else None


def _copy_shard(param_data: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    if loaded_weight.dim() == 0:  # a scalar on disk (a scale, say)
        loaded_weight = loaded_weight.reshape(1)
    assert param_data.shape == loaded_weight.shape, (
        f"Tried to load weights of size {tuple(loaded_weight.shape)} "
        f"to a parameter of size {tuple(param_data.shape)}"
    )
    param_data.copy_(loaded_weight)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (a router, say)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: Any = None,
        prefix: str = "",
        *,
        return_bias: bool = True,
        disable_tp: bool = False,
    ) -> None:
        super().__init__(
            input_size, output_size, bias, skip_bias_add, params_dtype, quant_config, prefix,
            return_bias=return_bias, disable_tp=True,
        )  # fmt: skip
        self.output_partition_sizes = [output_size]
        self.create_weights(input_size, self.output_partition_sizes)
        self.create_bias(output_size)

    def weight_loader(self, param: Parameter, loaded_weight: torch.Tensor) -> None:
        _copy_shard(param.data, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, Parameter | None]:
        bias = self.bias if not self.skip_bias_add else None
        return self._output(cpu_unquantized_gemm(self, x, self.weight, bias))


# --8<-- [start:column_parallel_linear]
class ColumnParallelLinear(LinearBase):
    """Each rank holds ``output_size / T`` rows of the weight: its slice of Y.

    ``gather_output``: all-gather the slices so every rank has all of Y
    (off in a model, where a row-parallel layer takes the slices as they are).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: Any = None,
        prefix: str = "",
        *,
        return_bias: bool = True,
        disable_tp: bool = False,
    ) -> None:
        super().__init__(
            input_size, output_size, bias, skip_bias_add, params_dtype, quant_config, prefix,
            return_bias=return_bias, disable_tp=disable_tp,
        )  # fmt: skip
        self.gather_output = gather_output
        self.input_size_per_partition = input_size
        self.output_size_per_partition = divide(output_size, self.tp_size)
        # Merged and QKV layers stack several outputs; each is split on its own.
        output_sizes: list[int] = getattr(self, "output_sizes", [output_size])
        self.output_partition_sizes = [divide(size, self.tp_size) for size in output_sizes]
        self.create_weights(self.input_size_per_partition, self.output_partition_sizes)
        self.create_bias(self.output_size_per_partition)

    def weight_loader(self, param: Parameter, loaded_weight: torch.Tensor) -> None:
        """Rows ``[rank * n, (rank + 1) * n)`` of the full weight (or bias)."""
        output_dim = getattr(param, "output_dim", None)
        if output_dim is not None:
            shard_size = param.data.shape[output_dim]
            loaded_weight = loaded_weight.narrow(output_dim, self.tp_rank * shard_size, shard_size)
        _copy_shard(param.data, loaded_weight)

    def forward(self, input_: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, Parameter | None]:
        bias = self.bias if not self.skip_bias_add else None
        output_parallel = cpu_unquantized_gemm(
            self, input_, self.weight, bias
        )  # [num_tokens, output_size / T]
        if self.gather_output and self.tp_size > 1:
            return self._output(tensor_model_parallel_all_gather(output_parallel))
        return self._output(output_parallel)


# --8<-- [end:column_parallel_linear]


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers with one input, stacked into one matmul
    (Llama's gate_proj and up_proj as ``gate_up_proj``).

    Each stacked output is split across ranks separately, so rank r holds
    gate's r-th slice then up's r-th slice, and ``SiluAndMul`` on the rank's
    output pairs them correctly.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: Any = None,
        prefix: str = "",
        *,
        return_bias: bool = True,
        disable_tp: bool = False,
    ) -> None:
        self.output_sizes = output_sizes
        super().__init__(
            input_size, sum(output_sizes), bias, gather_output, skip_bias_add, params_dtype,
            quant_config, prefix, return_bias=return_bias, disable_tp=disable_tp,
        )  # fmt: skip

    def validate_shard_id(self, loaded_shard_id: int | None) -> None:
        if loaded_shard_id is None:
            return
        if isinstance(loaded_shard_id, bool) or not isinstance(loaded_shard_id, int):
            raise ValueError(f"Shard id should be an int, got {loaded_shard_id!r}.")
        if not 0 <= loaded_shard_id < len(self.output_sizes):
            raise ValueError(
                f"Shard id should be between 0 and {len(self.output_sizes) - 1}. "
                f"Got shard id {loaded_shard_id}."
            )

    def weight_loader(  # type: ignore[override]
        self, param: Parameter, loaded_weight: torch.Tensor, loaded_shard_id: int | None = None
    ) -> None:
        """This rank's slice of stacked output ``loaded_shard_id``; with None, a
        checkpoint that stores them already stacked (Phi-3's gate_up_proj)."""
        self.validate_shard_id(loaded_shard_id)
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            _copy_shard(param.data, loaded_weight)
            return
        if loaded_shard_id is None:
            offset = 0
            for shard_id, size in enumerate(self.output_sizes):
                self.weight_loader(param, loaded_weight.narrow(output_dim, offset, size), shard_id)
                offset += size
            return
        shard_offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp_size
        shard_size = self.output_sizes[loaded_shard_id] // self.tp_size
        param_data = param.data.narrow(output_dim, shard_offset, shard_size)
        loaded_weight = loaded_weight.narrow(output_dim, self.tp_rank * shard_size, shard_size)
        _copy_shard(param_data, loaded_weight)


# --8<-- [start:qkv_parallel_linear]
class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, split across ranks by heads.

    Each rank gets ``total_num_heads / T`` query heads. With at least as many
    KV heads as ranks, each gets ``total_num_kv_heads / T`` of them; with
    fewer (T = 4, 2 KV heads), each rank gets one KV head and
    ``T / total_num_kv_heads`` ranks hold a copy of the same one
    (``num_kv_head_replicas``), so every rank's query heads find theirs.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = True,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: Any = None,
        prefix: str = "",
        *,
        return_bias: bool = True,
        disable_tp: bool = False,
        v_head_size: int | None = None,
    ) -> None:
        self.hidden_size = hidden_size
        self.head_size = head_size
        self.v_head_size = v_head_size if v_head_size is not None else head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        tp_size = get_tensor_model_parallel_world_size() if not disable_tp else 1
        self.num_heads = divide(self.total_num_heads, tp_size)
        if tp_size >= self.total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, self.total_num_kv_heads)
        else:
            self.num_kv_heads = divide(self.total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        # Per-rank sizes times T: a replicated KV head counts once per rank.
        self.output_sizes = [
            self.num_heads * self.head_size * tp_size,  # q_proj
            self.num_kv_heads * self.head_size * tp_size,  # k_proj
            self.num_kv_heads * self.v_head_size * tp_size,  # v_proj
        ]
        super().__init__(
            hidden_size, sum(self.output_sizes), bias, False, skip_bias_add, params_dtype,
            quant_config, prefix, return_bias=return_bias, disable_tp=disable_tp,
        )  # fmt: skip

    def validate_shard_id(self, loaded_shard_id: str | None) -> None:
        if loaded_shard_id is not None and loaded_shard_id not in ("q", "k", "v"):
            raise ValueError(
                "Shard id for QKVParallelLinear should be 'q', 'k', or 'v', "
                f"got shard id {loaded_shard_id}."
            )

    def weight_loader(  # type: ignore[override]
        self, param: Parameter, loaded_weight: torch.Tensor, loaded_shard_id: str | None = None
    ) -> None:
        """This rank's heads of ``q_proj``, ``k_proj`` or ``v_proj``; with None,
        a checkpoint with them already fused (Phi-3's qkv_proj)."""
        self.validate_shard_id(loaded_shard_id)
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            _copy_shard(param.data, loaded_weight)
            return
        q_rows = self.total_num_heads * self.head_size
        k_rows = self.total_num_kv_heads * self.head_size
        if loaded_shard_id is None:
            v_rows = self.total_num_kv_heads * self.v_head_size
            for shard_id, offset, size in (("q", 0, q_rows), ("k", q_rows, k_rows),
                                           ("v", q_rows + k_rows, v_rows)):  # fmt: skip
                self.weight_loader(param, loaded_weight.narrow(output_dim, offset, size), shard_id)
            return
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        # (where in this rank's fused rows, how many, which rank's slice of the checkpoint)
        if loaded_shard_id == "q":
            shard_offset, shard_size, shard_rank = 0, q_size, self.tp_rank
        elif loaded_shard_id == "k":
            shard_offset, shard_size = q_size, kv_size
            shard_rank = self.tp_rank // self.num_kv_head_replicas
        else:
            shard_offset, shard_size = q_size + kv_size, self.num_kv_heads * self.v_head_size
            shard_rank = self.tp_rank // self.num_kv_head_replicas
        param_data = param.data.narrow(output_dim, shard_offset, shard_size)
        loaded_weight = loaded_weight.narrow(output_dim, shard_rank * shard_size, shard_size)
        _copy_shard(param_data, loaded_weight)


# --8<-- [end:qkv_parallel_linear]


# --8<-- [start:row_parallel_linear]
class RowParallelLinear(LinearBase):
    """Each rank holds ``input_size / T`` columns of the weight and multiplies
    its slice of X; ``reduce_results`` sums the partial outputs over the ranks.

    The bias is added once, on rank 0, before the sum.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        params_dtype: torch.dtype | None = None,
        reduce_results: bool = True,
        quant_config: Any = None,
        prefix: str = "",
        *,
        return_bias: bool = True,
        disable_tp: bool = False,
    ) -> None:
        super().__init__(
            input_size, output_size, bias, skip_bias_add, params_dtype, quant_config, prefix,
            return_bias=return_bias, disable_tp=disable_tp,
        )  # fmt: skip
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self.output_size_per_partition = output_size
        self.output_partition_sizes = [output_size]
        self.create_weights(self.input_size_per_partition, self.output_partition_sizes)
        if not reduce_results and (bias and not skip_bias_add):
            raise ValueError(
                "When not reduce the results, adding bias to the "
                "results can lead to incorrect results"
            )
        self.create_bias(output_size)

    def weight_loader(self, param: Parameter, loaded_weight: torch.Tensor) -> None:
        """Columns ``[rank * n, (rank + 1) * n)`` of the weight; the bias whole."""
        input_dim = getattr(param, "input_dim", None)
        if input_dim is not None:
            shard_size = param.data.shape[input_dim]
            loaded_weight = loaded_weight.narrow(input_dim, self.tp_rank * shard_size, shard_size)
        _copy_shard(param.data, loaded_weight)

    def forward(self, input_: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, Parameter | None]:
        if self.input_is_parallel:
            input_parallel = input_  # [num_tokens, input_size / T]
        else:
            input_parallel = split_tensor_along_last_dim(input_, self.tp_size)[
                self.tp_rank
            ].contiguous()
        bias = None if (self.tp_rank > 0 or self.skip_bias_add) else self.bias
        output_parallel = cpu_unquantized_gemm(
            self, input_parallel, self.weight, bias
        )  # [num_tokens, output_size], partial
        if self.reduce_results and self.tp_size > 1:
            return self._output(tensor_model_parallel_all_reduce(output_parallel))
        return self._output(output_parallel)


# --8<-- [end:row_parallel_linear]

"""The process groups every rank belongs to: world, tensor-, pipeline- and data-parallel.

Mirrors vllm/distributed/parallel_state.py (``GroupCoordinator``,
``init_distributed_environment``, ``initialize_model_parallel``,
``ensure_model_parallel_initialized``, ``get_tp_group`` / ``get_pp_group`` /
``get_dp_group`` / ``get_world_group``, ``destroy_model_parallel``,
``destroy_distributed_environment``) and ``init_worker_distributed_environment``
from vllm/v1/worker/gpu_worker.py. Every collective is torch.distributed's:
gloo on CPU, NCCL for the device group on CUDA.

As in vLLM, even one process (``UniProcExecutor``) sets up a world of one, so a
layer always asks its group (``get_tp_group().world_size`` is 1 there, and
every collective returns its input untouched). That world is made once per
process and reused by every later ``LLM`` in it.

At trace detail "full" each collective of more than one rank is a
``GroupCoordinator.<op>`` span (its group, bytes and milliseconds); below
"full" the only cost is one check of the detail.

Departures: collectives go straight to torch.distributed rather than through
a device communicator (no custom all-reduce, no PyNccl, no shared-memory
broadcaster in the group); on gloo the device group *is* the CPU group (vLLM
makes two gloo groups of the same ranks); ``initialize_model_parallel`` takes
``data_parallel_size`` as an argument (vLLM reads it from the current config);
``send_tensor_dict`` sends whole tensors (no all-gather split over the TP
group); a stage that fails a step sends the next a ``PPStageFailure`` in place
of its tensors (``send_pp_stage_failure``), where vLLM's next stage waits until
its collective times out. Left out: expert-, context- and
decode-context-parallel groups, elastic EP, graph capture.
"""

from __future__ import annotations

import contextlib
import pickle
import time
from collections import namedtuple
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tracevllm import tracing
from tracevllm.logger import init_logger
from tracevllm.tracing.attributes import SpanAttributes

if TYPE_CHECKING:
    from tracevllm.config import VllmConfig

logger = init_logger(__name__)

# What crosses ahead of a tensor in broadcast/send_tensor_dict, so the
# receiver can allocate it.
TensorMetadata = namedtuple("TensorMetadata", ["device", "dtype", "size"])


@dataclass(frozen=True)
class PPStageFailure:
    """What a pipeline stage that failed a step sends the next stage in place
    of the step's tensors (tracevllm's): the next stage raises it rather than
    wait for them until gloo's timeout. ``rank``: the global rank that failed."""

    rank: int
    error: str


class PPStageFailedError(RuntimeError):
    """An earlier pipeline stage failed the step this stage waits for."""

    def __init__(self, failure: PPStageFailure) -> None:
        super().__init__(f"Pipeline stage of rank {failure.rank} failed: {failure.error}")
        self.failure = failure


def _split_tensor_dict(
    tensor_dict: dict[str, torch.Tensor | Any],
) -> tuple[list[tuple[str, Any]], list[torch.Tensor]]:
    """(key, metadata-or-value) pairs to pickle, and the tensors to send as is."""
    metadata_list: list[tuple[str, Any]] = []
    tensor_list: list[torch.Tensor] = []
    for key, value in tensor_dict.items():
        if isinstance(value, torch.Tensor):
            metadata = TensorMetadata(value.device.type, value.dtype, value.size())
            metadata_list.append((key, metadata))
            tensor_list.append(value)
        else:
            metadata_list.append((key, value))
    return metadata_list, tensor_list


class GroupCoordinator:
    """One process group and the collectives over it.

    ``rank`` is the global rank, ``ranks`` the global ranks in this group,
    ``rank_in_group`` this process's index among them, ``local_rank`` the
    device index on its machine. ``group_ranks`` lists every group of this
    kind (all TP groups, say): each process builds all of them, as
    torch.distributed requires, and keeps the one it is in.
    """

    rank: int
    ranks: list[int]
    world_size: int
    local_rank: int
    rank_in_group: int
    cpu_group: ProcessGroup
    device_group: ProcessGroup

    def __init__(
        self,
        group_ranks: list[list[int]],
        local_rank: int,
        torch_distributed_backend: str,
        group_name: str | None = None,
    ) -> None:
        self.unique_name = group_name or "anonymous"
        self.rank = dist.get_rank()
        self.local_rank = local_rank
        self.backend = torch_distributed_backend
        cpu_group = device_group = None
        for ranks in group_ranks:
            # gloo for CPU traffic (objects, metadata); the device backend
            # for tensors. On CPU both are gloo: one group serves both.
            group_cpu = dist.new_group(ranks, backend="gloo", timeout=_TIMEOUT)
            if torch_distributed_backend == "gloo":
                group_device = group_cpu
            else:
                group_device = dist.new_group(
                    ranks, backend=torch_distributed_backend, timeout=_TIMEOUT
                )
            if self.rank in ranks:
                self.ranks = list(ranks)
                self.world_size = len(ranks)
                self.rank_in_group = ranks.index(self.rank)
                cpu_group, device_group = group_cpu, group_device
        assert cpu_group is not None and device_group is not None, "rank in no group"
        self.cpu_group, self.device_group = cpu_group, device_group
        if torch_distributed_backend == "nccl":
            self.device = torch.device(f"cuda:{local_rank}")
        else:
            self.device = torch.device("cpu")

    def __repr__(self) -> str:
        return (
            f"GroupCoordinator({self.unique_name!r}, ranks={self.ranks}, "
            f"rank_in_group={self.rank_in_group})"
        )

    # -- who is where ----------------------------------------------------
    @property
    def first_rank(self) -> int:
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        return self.ranks[-1]

    @property
    def is_first_rank(self) -> bool:
        return self.rank == self.first_rank

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.last_rank

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    # -- collectives (a group of one returns its input) -------------------
    # --8<-- [start:group_all_reduce]
    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """Sum ``input_`` over the group; every rank gets the sum.

        In place, as vLLM's CPU communicator: the callers hand over a tensor
        they made for this (a matmul's output) and use only the result.
        """
        if self.world_size == 1:
            return input_
        if tracing.is_full_detail():  # a span per call: only at detail "full"
            with self._comm_span("all_reduce", input_.nbytes):
                dist.all_reduce(input_, group=self.device_group)
            return input_
        dist.all_reduce(input_, group=self.device_group)
        return input_

    # --8<-- [end:group_all_reduce]

    @contextlib.contextmanager
    def _comm_span(self, op: str, nbytes: int | None = None) -> Iterator[Any]:
        """A ``GroupCoordinator.<op>`` span around one collective: its group,
        the bytes of its result and the milliseconds it took.

        Inside a model's forward it is timed and made when the forward ends
        (``tracing.span``). On a CUDA group the device is synchronized on
        both sides, so the milliseconds are the collective's, not its launch
        (detail "full" already trades speed for what it shows).
        """
        attributes: dict[str, Any] = {
            **_COMM_CODE[op],
            SpanAttributes.COMM_GROUP: self.unique_name,
            SpanAttributes.COMM_WORLD_SIZE: self.world_size,
        }
        if nbytes is not None:
            attributes[SpanAttributes.COMM_BYTES] = nbytes
        with tracing.span(f"GroupCoordinator.{op}", attributes) as span:
            self._synchronize()
            start = time.perf_counter()
            yield span
            self._synchronize()
            span.set_attribute(SpanAttributes.COMM_MS, (time.perf_counter() - start) * 1e3)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``input_``, concatenated along ``dim`` in rank order."""
        if self.world_size == 1:
            return input_
        assert -input_.dim() <= dim < input_.dim(), (
            f"Invalid dim ({dim}) for input tensor with shape {input_.size()}"
        )
        input_ = input_.contiguous()
        parts = [torch.empty_like(input_) for _ in range(self.world_size)]
        if tracing.is_full_detail():
            with self._comm_span("all_gather", input_.nbytes * self.world_size):
                dist.all_gather(parts, input_, group=self.device_group)
        else:
            dist.all_gather(parts, input_, group=self.device_group)
        return torch.cat(parts, dim=dim)

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Like ``all_gather``, but only rank ``dst`` (in the group) gets the
        result; the others get None."""
        if self.world_size == 1:
            return input_
        input_ = input_.contiguous()
        parts = (
            [torch.empty_like(input_) for _ in range(self.world_size)]
            if self.rank_in_group == dst
            else None
        )
        if tracing.is_full_detail():
            with self._comm_span("gather", input_.nbytes * self.world_size):
                dist.gather(input_, parts, dst=self.ranks[dst], group=self.device_group)
        else:
            dist.gather(input_, parts, dst=self.ranks[dst], group=self.device_group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s tensor into every rank's ``input_`` (same shape)."""
        assert src < self.world_size, f"Invalid src rank ({src})"
        if self.world_size == 1:
            return input_
        if tracing.is_full_detail():
            with self._comm_span("broadcast", input_.nbytes):
                dist.broadcast(input_, src=self.ranks[src], group=self.device_group)
            return input_
        dist.broadcast(input_, src=self.ranks[src], group=self.device_group)
        return input_

    def broadcast_object(self, obj: Any | None = None, src: int = 0) -> Any:
        """Rank ``src``'s picklable object to every rank (over the CPU group)."""
        assert src < self.world_size, f"Invalid src rank ({src})"
        if self.world_size == 1:
            return obj
        holder = [obj if self.rank_in_group == src else None]
        dist.broadcast_object_list(holder, src=self.ranks[src], group=self.cpu_group)
        return holder[0]

    def send_object(self, obj: Any, dst: int) -> None:
        """Pickle ``obj`` to rank ``dst`` of the group: its size, then its bytes."""
        assert dst < self.world_size, f"Invalid dst rank ({dst})"
        assert dst != self.rank_in_group, "Invalid destination rank: this rank."
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.long)
        dist.send(size, dst=self.ranks[dst], group=self.cpu_group)
        dist.send(payload, dst=self.ranks[dst], group=self.cpu_group)

    def recv_object(self, src: int) -> Any:
        """What ``send_object`` sent from rank ``src`` of the group."""
        assert src < self.world_size, f"Invalid src rank ({src})"
        assert src != self.rank_in_group, "Invalid source rank: this rank."
        size = torch.empty(1, dtype=torch.long)
        dist.recv(size, src=self.ranks[src], group=self.cpu_group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(payload, src=self.ranks[src], group=self.cpu_group)
        return pickle.loads(payload.numpy().tobytes())

    def broadcast_tensor_dict(
        self, tensor_dict: dict[str, torch.Tensor | Any] | None = None, src: int = 0
    ) -> dict[str, torch.Tensor | Any] | None:
        """Rank ``src``'s dict to every rank: the non-tensor values and each
        tensor's shape pickled first, then the tensors themselves."""
        if not dist.is_initialized() or self.world_size == 1:
            return tensor_dict
        assert src < self.world_size, f"Invalid src rank ({src})"
        if tracing.is_full_detail():
            # The bytes are known once the metadata has crossed.
            with self._comm_span("broadcast_tensor_dict") as span:
                result = self._broadcast_tensor_dict(tensor_dict, src)
                nbytes = sum(v.nbytes for v in result.values() if isinstance(v, torch.Tensor))
                span.set_attribute(SpanAttributes.COMM_BYTES, nbytes)
            return result
        return self._broadcast_tensor_dict(tensor_dict, src)

    def _broadcast_tensor_dict(
        self, tensor_dict: dict[str, torch.Tensor | Any] | None, src: int
    ) -> dict[str, torch.Tensor | Any]:
        if self.rank_in_group == src:
            assert isinstance(tensor_dict, dict), f"Expecting a dictionary, got {type(tensor_dict)}"
            metadata_list, tensor_list = _split_tensor_dict(tensor_dict)
            self.broadcast_object(metadata_list, src=src)
            for tensor in tensor_list:
                if tensor.numel() > 0:
                    dist.broadcast(tensor, src=self.ranks[src], group=self._group_for(tensor))
            return tensor_dict
        metadata_list = self.broadcast_object(None, src=src)
        received: dict[str, torch.Tensor | Any] = {}
        for key, value in metadata_list:
            if isinstance(value, TensorMetadata):
                tensor = torch.empty(value.size, dtype=value.dtype, device=self._device(value))
                if tensor.numel() > 0:
                    dist.broadcast(tensor, src=self.ranks[src], group=self._group_for(tensor))
                value = tensor
            received[key] = value
        return received

    def send_tensor_dict(
        self, tensor_dict: dict[str, torch.Tensor | Any], dst: int | None = None
    ) -> None:
        """Send a dict (pipeline stages: ``IntermediateTensors``) to rank
        ``dst`` of the group, by default the next one."""
        if not dist.is_initialized() or self.world_size == 1:
            return
        if dst is None:
            dst = (self.rank_in_group + 1) % self.world_size
        assert dst < self.world_size, f"Invalid dst rank ({dst})"
        if tracing.is_full_detail():
            nbytes = sum(v.nbytes for v in tensor_dict.values() if isinstance(v, torch.Tensor))
            with self._comm_span("send_tensor_dict", nbytes):
                self._send_tensor_dict(tensor_dict, dst)
            return
        self._send_tensor_dict(tensor_dict, dst)

    def _send_tensor_dict(self, tensor_dict: dict[str, torch.Tensor | Any], dst: int) -> None:
        metadata_list, tensor_list = _split_tensor_dict(tensor_dict)
        self.send_object(metadata_list, dst=dst)
        for tensor in tensor_list:
            if tensor.numel() > 0:
                dist.send(tensor.contiguous(), dst=self.ranks[dst], group=self._group_for(tensor))

    def recv_tensor_dict(self, src: int | None = None) -> dict[str, torch.Tensor | Any] | None:
        """What ``send_tensor_dict`` sent from rank ``src`` of the group (by
        default the previous one)."""
        if not dist.is_initialized() or self.world_size == 1:
            return None
        if src is None:
            src = (self.rank_in_group - 1) % self.world_size
        assert src < self.world_size, f"Invalid src rank ({src})"
        if tracing.is_full_detail():
            # The bytes are known once the metadata has crossed; the
            # milliseconds include the wait for the previous stage.
            with self._comm_span("recv_tensor_dict") as span:
                received = self._recv_tensor_dict(src)
                nbytes = sum(v.nbytes for v in received.values() if isinstance(v, torch.Tensor))
                span.set_attribute(SpanAttributes.COMM_BYTES, nbytes)
            return received
        return self._recv_tensor_dict(src)

    def _recv_tensor_dict(self, src: int) -> dict[str, torch.Tensor | Any]:
        received: dict[str, torch.Tensor | Any] = {}
        metadata_list = self.recv_object(src=src)
        if isinstance(metadata_list, PPStageFailure):
            raise PPStageFailedError(metadata_list)
        for key, value in metadata_list:
            if isinstance(value, TensorMetadata):
                tensor = torch.empty(value.size, dtype=value.dtype, device=self._device(value))
                if tensor.numel() > 0:
                    dist.recv(tensor, src=self.ranks[src], group=self._group_for(tensor))
                value = tensor
            received[key] = value
        return received

    def barrier(self) -> None:
        """Wait for every rank of the group (on the CPU group, as vLLM: an
        NCCL barrier would allocate on the device)."""
        dist.barrier(group=self.cpu_group)

    def destroy(self) -> None:
        if self.device_group is not self.cpu_group:
            dist.destroy_process_group(self.device_group)
        dist.destroy_process_group(self.cpu_group)

    def _group_for(self, tensor: torch.Tensor) -> ProcessGroup:
        # CPU tensors over gloo, device tensors over the device backend.
        return self.cpu_group if tensor.is_cpu else self.device_group

    def _device(self, metadata: TensorMetadata) -> torch.device:
        return torch.device("cpu") if metadata.device == "cpu" else self.device


# The code.* attributes of each collective's span (tracing.code_attributes).
_COMM_CODE = {
    op: tracing.code_attributes(getattr(GroupCoordinator, op))
    for op in (
        "all_reduce",
        "all_gather",
        "gather",
        "broadcast",
        "broadcast_tensor_dict",
        "send_tensor_dict",
        "recv_tensor_dict",
    )
}

_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None
_DP: GroupCoordinator | None = None
# The collective timeout every group gets (None: torch's default).
_TIMEOUT: timedelta | None = None


def get_world_group() -> GroupCoordinator:
    assert _WORLD is not None, "world group is not initialized"
    return _WORLD


def get_tp_group() -> GroupCoordinator:
    assert _TP is not None, "tensor model parallel group is not initialized"
    return _TP


def get_pp_group() -> GroupCoordinator:
    assert _PP is not None, "pipeline model parallel group is not initialized"
    return _PP


def get_dp_group() -> GroupCoordinator:
    assert _DP is not None, "data parallel group is not initialized"
    return _DP


def get_tensor_model_parallel_world_size() -> int:
    """How many ranks share each layer's weights."""
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    """This process's rank among them."""
    return get_tp_group().rank_in_group


# --8<-- [start:init_distributed_environment]
def init_distributed_environment(
    world_size: int = -1,
    rank: int = -1,
    distributed_init_method: str = "env://",
    local_rank: int = -1,
    backend: str = "gloo",
    timeout: timedelta | None = None,
) -> None:
    """Join the torch.distributed world (once per process) and make its group.

    Every rank calls this with the same ``distributed_init_method`` (where
    they meet: ``tcp://host:port`` or ``file://path``) and its own ``rank``.
    A second call in the same process (a later ``LLM``) finds the world
    there and keeps it.
    """
    global _WORLD, _TIMEOUT
    if not dist.is_initialized():
        if not dist.is_backend_available(backend):
            logger.warning("Distributed backend %s is not available; using gloo.", backend)
            backend = "gloo"
        _TIMEOUT = timeout
        dist.init_process_group(
            backend=backend,
            init_method=distributed_init_method,
            world_size=world_size,
            rank=rank,
            timeout=timeout,
        )
    if local_rank == -1:
        local_rank = rank  # one machine: the device index is the rank
    if _WORLD is None:
        ranks = list(range(dist.get_world_size()))
        _WORLD = GroupCoordinator([ranks], local_rank, backend, group_name="world")
    elif _WORLD.world_size != dist.get_world_size():
        raise RuntimeError("world group already initialized with a different world size")


# --8<-- [end:init_distributed_environment]


# --8<-- [start:initialize_model_parallel]
def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    backend: str | None = None,
    data_parallel_size: int = 1,
) -> None:
    """Cut the world into TP, PP and DP groups.

    Ranks are laid out DP x PP x TP, TP fastest: with TP = 2 and PP = 2 the
    TP groups are [0, 1] and [2, 3], the PP groups [0, 2] and [1, 3]. So
    the ranks that all-reduce every layer are neighbours, and a pipeline
    stage hands its activations to the rank with the same TP rank in the
    next stage.
    """
    global _TP, _PP, _DP
    assert dist.is_initialized(), "init_distributed_environment() first"
    world_size = dist.get_world_size()
    parallel = data_parallel_size * pipeline_model_parallel_size * tensor_model_parallel_size
    if world_size % parallel != 0:
        raise ValueError(
            f"world size ({world_size}) is not divisible by data_parallel_size x "
            f"pipeline_model_parallel_size x tensor_model_parallel_size ({parallel})."
        )
    backend = backend or get_world_group().backend
    local_rank = get_world_group().local_rank
    # [external DP, DP, PP, TP]; a group is the ranks along one axis.
    all_ranks = torch.arange(world_size).reshape(
        -1, data_parallel_size, pipeline_model_parallel_size, tensor_model_parallel_size
    )

    def groups_along(axis: int, size: int) -> list[list[int]]:
        return [g.tolist() for g in all_ranks.transpose(axis, 3).reshape(-1, size).unbind(0)]

    assert _TP is None, "tensor model parallel group is already initialized"
    _TP = GroupCoordinator(groups_along(3, tensor_model_parallel_size), local_rank, backend, "tp")
    assert _PP is None, "pipeline model parallel group is already initialized"
    _PP = GroupCoordinator(groups_along(2, pipeline_model_parallel_size), local_rank, backend, "pp")
    assert _DP is None, "data parallel group is already initialized"
    _DP = GroupCoordinator(groups_along(1, data_parallel_size), local_rank, backend, "dp")
    logger.info(
        "rank %d in world size %d is assigned as DP rank %d, PP rank %d, TP rank %d",
        dist.get_rank(),
        world_size,
        _DP.rank_in_group,
        _PP.rank_in_group,
        _TP.rank_in_group,
    )


# --8<-- [end:initialize_model_parallel]


def ensure_model_parallel_initialized(
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    backend: str | None = None,
    data_parallel_size: int = 1,
) -> None:
    """Make the groups, or check that the ones there have these sizes."""
    if not model_parallel_is_initialized():
        initialize_model_parallel(
            tensor_model_parallel_size, pipeline_model_parallel_size, backend, data_parallel_size
        )
        return
    tp_size = get_tensor_model_parallel_world_size()
    if tp_size != tensor_model_parallel_size:
        raise RuntimeError(
            "tensor parallel group already initialized, but of unexpected size. "
            f"got: {tp_size} vs. wanted: {tensor_model_parallel_size}"
        )
    pp_size = get_pp_group().world_size
    if pp_size != pipeline_model_parallel_size:
        raise RuntimeError(
            "pipeline parallel group already initialized, but of unexpected size. "
            f"got: {pp_size} vs. wanted: {pipeline_model_parallel_size}"
        )


def send_pp_stage_failure(rank: int, error: BaseException) -> None:
    """This rank failed a step with a forward pass: tell the next pipeline
    stage, which waits for the step's tensors (tracevllm's; in vLLM it waits
    until its collective times out). A failure that came from an earlier
    stage is passed on as it came, so the last stage names the rank that
    failed. Nothing to do on the last stage or without pipeline stages."""
    if not model_parallel_is_initialized():
        return
    pp_group = get_pp_group()
    if pp_group.world_size == 1 or pp_group.is_last_rank:
        return
    if isinstance(error, PPStageFailedError):
        failure = error.failure
    else:
        failure = PPStageFailure(rank, f"{type(error).__name__}: {error}")
    try:
        pp_group.send_object(failure, dst=pp_group.rank_in_group + 1)
    except Exception:  # the next stage is gone too: the executor hears of that
        logger.exception("Could not tell the next pipeline stage about the failure.")


def model_parallel_is_initialized() -> bool:
    return _TP is not None and _PP is not None


def destroy_model_parallel() -> None:
    """Drop the TP, PP and DP groups (the world stays)."""
    global _TP, _PP, _DP
    for group in (_TP, _PP, _DP):
        if group is not None:
            group.destroy()
    _TP = _PP = _DP = None


def destroy_distributed_environment() -> None:
    """Drop the world group and leave torch.distributed."""
    global _WORLD
    if _WORLD is not None:
        _WORLD.destroy()
    _WORLD = None
    if dist.is_initialized():
        dist.destroy_process_group()


def init_worker_distributed_environment(
    vllm_config: VllmConfig,
    rank: int,
    distributed_init_method: str | None = None,
    local_rank: int = -1,
    backend: str | None = None,
) -> None:
    """A worker's part in the world: join it, then make the model-parallel groups.

    vLLM keeps this in vllm/v1/worker/gpu_worker.py. ``backend`` defaults to
    NCCL on a CUDA device and gloo otherwise.
    """
    parallel_config = getattr(vllm_config, "parallel_config", None)
    tp = getattr(parallel_config, "tensor_parallel_size", 1)
    pp = getattr(parallel_config, "pipeline_parallel_size", 1)
    world_size = getattr(parallel_config, "world_size", tp * pp)
    timeout_s = getattr(parallel_config, "distributed_timeout_seconds", None)
    if backend is None:
        backend = "nccl" if vllm_config.device_config.device.startswith("cuda") else "gloo"
    init_distributed_environment(
        world_size,
        rank,
        distributed_init_method or "env://",
        local_rank,
        backend,
        timedelta(seconds=timeout_s) if timeout_s is not None else None,
    )
    ensure_model_parallel_initialized(tp, pp)

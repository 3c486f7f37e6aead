"""The model runner: SchedulerOutput in, one sampled token per request out.

Mirrors vllm/v1/worker/gpu_model_runner.py (``GPUModelRunner``) on the
synchronous path: ``execute_model`` updates the persistent batch
(``_update_states``), flattens it into one token stream (``_prepare_inputs``)
and runs the forward pass; ``sample_tokens`` samples and does the
bookkeeping (``_bookkeeping_sync``), after masking the structured requests'
rows with the scheduler's grammar bitmask. With speculative decoding the
scheduled drafts go into the batch after each request's last token, logits
are computed at every draft position and one past the last
(``_calc_spec_decode_metadata``), the ``RejectionSampler`` decides what each
request emits, and the drafter proposes the next drafts
(``propose_draft_token_ids``), which EngineCore collects with
``take_draft_token_ids``. A pipeline stage runs its own layers: one
before the last returns ``IntermediateTensors`` from ``execute_model``
(the Worker sends them on) and learns the tokens it runs from the
scheduler's ``new_token_ids``, since only the last stage samples. With
async scheduling (``use_async_scheduling``) the sampled tokens stay where
they were sampled (``input_batch.prev_sampled_token_ids``): the persistent
batch gets a placeholder (-1) for each, and the next step's input ids take
them from there (``_prepare_input_ids``), so that step can be prepared
before this one's tokens reach the host; ``sample_tokens`` returns an
``AsyncGPUModelRunnerOutput`` that waits for them. A KV connector gets its
turn around the forward (``KVConnectorModelRunnerMixin``). A compiled model
compiles in ``load_model`` (a dummy run at the widest batch); with PIECEWISE
CUDA graphs ``capture_model`` captures each capture size before the first
request, and ``execute_model`` pads a step to the next captured size and
feeds the model from fixed buffers (``_model_inputs``). Left out: FULL CUDA
graphs, the padded drafter batch, LoRA,
multimodal, pooling, prompt logprobs, cascade attention,
profiling runs (the KV cache size comes from a configured budget).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tracevllm import tracing
from tracevllm.attention.backends.abstract import AttentionMetadata
from tracevllm.attention.selector import get_attn_backend
from tracevllm.compilation.config import CompilationMode, CUDAGraphMode
from tracevllm.core.kv_cache_sizing import (
    _pool_bytes_per_block,
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
)
from tracevllm.cudagraph_dispatcher import CudagraphDispatcher
from tracevllm.distributed.parallel_state import get_pp_group
from tracevllm.forward_context import BatchDescriptor, set_forward_context
from tracevllm.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    UniformTypeKVCacheSpecs,
)
from tracevllm.logger import init_logger
from tracevllm.model_executor.layers.attention import Attention
from tracevllm.model_executor.layers.rotary_embedding import move_rope_tables
from tracevllm.model_executor.model_loader import get_model
from tracevllm.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    AsyncModelRunnerOutput,
    DraftTokenIds,
    ModelRunnerOutput,
)
from tracevllm.sample.rejection_sampler import RejectionSampler
from tracevllm.sample.sampler import Sampler
from tracevllm.sampling_params import SamplingType
from tracevllm.sequence import IntermediateTensors
from tracevllm.spec_decode.draft_model import DraftModelProposer
from tracevllm.spec_decode.metadata import SpecDecodeMetadata
from tracevllm.spec_decode.ngram_proposer import NgramProposer
from tracevllm.structured_output.utils import apply_grammar_bitmask
from tracevllm.tracing import records
from tracevllm.worker.input_batch import CachedRequestState, InputBatch
from tracevllm.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from tracevllm.worker.utils import bind_kv_cache

if TYPE_CHECKING:
    from tracevllm.config import VllmConfig
    from tracevllm.core.sched.output import GrammarOutput, SchedulerOutput
    from tracevllm.engine import LogprobsLists
    from tracevllm.model_executor.models.interfaces_base import VllmModelForTextGeneration
    from tracevllm.sample.metadata import LogprobsTensors, SamplerOutput, SamplingMetadata

logger = init_logger(__name__)


@dataclass(slots=True)
class ExecuteModelState:
    """What execute_model hands sample_tokens (vLLM keeps the same between the two)."""

    scheduler_output: SchedulerOutput
    # [num_reqs, vocab_size]: logits at each request's last scheduled token.
    logits: torch.Tensor
    # Rows whose chunk stops short of their known tokens (partial prefill):
    # sampled with the rest, then thrown away.
    discard_request_indices: np.ndarray
    # With drafts: where they and their logits are (logits then has a row
    # per draft position and one per request).
    spec_decode_metadata: SpecDecodeMetadata | None = None


# --8<-- [start:async_gpu_model_runner_output]
class AsyncGPUModelRunnerOutput(AsyncModelRunnerOutput):
    """A step's output whose sampled tokens are still on the device.

    On a GPU the copy to the host starts at once, on its own stream, and
    ``get_output`` waits for it (the worker meanwhile prepares the next
    step); on CPU the tokens are already on the host.
    """

    def __init__(
        self,
        model_runner_output: ModelRunnerOutput,
        sampled_token_ids: torch.Tensor,  # [num_reqs, 1]
        logprobs_tensors: LogprobsTensors | None,
        invalid_req_indices: list[int],
    ) -> None:
        self._model_runner_output = model_runner_output
        self._invalid_req_indices = invalid_req_indices
        self._logprobs_tensors = logprobs_tensors
        self.async_copy_ready_event: torch.cuda.Event | None = None
        if sampled_token_ids.is_cuda:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.sampled_token_ids_cpu = sampled_token_ids.to("cpu", non_blocking=True)
                self.async_copy_ready_event = torch.cuda.Event()
                self.async_copy_ready_event.record()
        else:
            self.sampled_token_ids_cpu = sampled_token_ids

    def get_output(self) -> ModelRunnerOutput:
        """Wait for the copy, then fill in the tokens (empty for discarded rows)."""
        if self.async_copy_ready_event is not None:
            self.async_copy_ready_event.synchronize()
        valid_sampled_token_ids: list[list[int]] = self.sampled_token_ids_cpu.tolist()
        for i in self._invalid_req_indices:
            valid_sampled_token_ids[i].clear()
        output = self._model_runner_output
        output.sampled_token_ids = valid_sampled_token_ids
        if self._logprobs_tensors is not None:
            output.logprobs = self._logprobs_tensors.tolists()
        return output


# --8<-- [end:async_gpu_model_runner_output]


class ModelRunner(KVConnectorModelRunnerMixin):
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        model_config = vllm_config.model_config
        self.device = torch.device(vllm_config.device_config.device)
        self.dtype: torch.dtype = getattr(torch, model_config.torch_dtype)
        self.max_model_len = model_config.get_max_model_len()
        self.max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.block_size = vllm_config.cache_config.block_size
        self.num_kv_heads = model_config.get_num_kv_heads()
        self.head_size = model_config.get_head_size()
        self.attn_backend = get_attn_backend(vllm_config.attention_config.backend, self.device)

        # Every request the runner knows, scheduled this step or not.
        self.requests: dict[str, CachedRequestState] = {}
        self.vocab_size = model_config.vocab_size
        # One block size per KV cache group; one group until the KV cache
        # config says otherwise (may_reinitialize_input_batch).
        self._init_block_sizes = [self.block_size]
        self.input_batch = self._make_input_batch()
        self.sampler = Sampler()
        self.arange_np = np.arange(
            max(self.max_num_reqs + 1, self.max_model_len, self.max_num_tokens)
        )

        self.model: VllmModelForTextGeneration | None = None
        # layer_name -> Attention layer (vLLM's static_forward_context).
        self.attn_layers: dict[str, Attention] = {}
        self.kv_caches: list[torch.Tensor] = []
        # The KV cache groups (initialize_kv_cache): each layer reads its group's metadata.
        self.kv_cache_config: KVCacheConfig | None = None
        self.execute_model_state: ExecuteModelState | None = None
        # Sampled tokens stay on the device; the next step's inputs take them there.
        self.use_async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)

        # Speculative decoding: who proposes, and the drafts for the next step.
        self.speculative_config = vllm_config.speculative_config
        self.drafter: NgramProposer | DraftModelProposer | None = None
        self.rejection_sampler: RejectionSampler | None = None
        if self.speculative_config is not None:
            if self.speculative_config.method == "ngram":
                self.drafter = NgramProposer(vllm_config)
            else:
                self.drafter = DraftModelProposer(vllm_config, self.device)
            self.rejection_sampler = RejectionSampler(self.sampler)
        self._draft_token_ids: list[list[int]] | None = None
        self.spec_decode_metadata: SpecDecodeMetadata | None = None

        # The last step's prepared inputs, kept for tracing and views.
        self.req_indices = np.zeros(0, dtype=np.int64)
        self.input_ids = torch.zeros(0, dtype=torch.int32)
        self.positions = torch.zeros(0, dtype=torch.int64)
        self.query_start_loc = torch.zeros(1, dtype=torch.int32)
        self.seq_lens = torch.zeros(0, dtype=torch.int32)
        self.slot_mapping = torch.zeros(0, dtype=torch.int64)
        self.logits_indices = torch.zeros(0, dtype=torch.int64)
        # KV cache group 0's metadata (and slot mapping, above); every group's below.
        self.attn_metadata: AttentionMetadata | None = None
        self.attn_metadata_per_group: list[AttentionMetadata] = []

        # CUDA graphs: which graph a step runs, and the fixed buffers the first
        # piece reads (a graph replays on the addresses it was captured with).
        self.cudagraph_dispatcher = CudagraphDispatcher(vllm_config)
        self.input_ids_buffer: torch.Tensor | None = None
        self.positions_buffer: torch.Tensor | None = None
        cc = vllm_config.compilation_config
        if cc.cudagraph_mode is not None and cc.cudagraph_mode.has_piecewise_cudagraphs():
            size = cc.max_cudagraph_capture_size or 0
            self.input_ids_buffer = torch.zeros(size, dtype=torch.int32, device=self.device)
            self.positions_buffer = torch.zeros(size, dtype=torch.int64, device=self.device)

    def _make_input_batch(self) -> InputBatch:
        return InputBatch(
            max_num_reqs=self.max_num_reqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_tokens,
            vocab_size=self.vocab_size,
            block_sizes=self._init_block_sizes,
            device=self.device,
        )

    # ------------------------------------------------------------------ setup
    def load_model(self) -> None:
        self.model = get_model(self.vllm_config)
        move_rope_tables(self.model.modules(), self.device)
        self.attn_layers = {
            m.layer_name: m for m in self.model.modules() if isinstance(m, Attention)
        }
        if self.drafter is not None:
            self.drafter.load_model()
        if self.vllm_config.compilation_config.mode != CompilationMode.NONE:
            # vLLM compiles in its warm-up runs, before the first request.
            self._dummy_run(self.max_num_tokens)

    @torch.inference_mode()
    def _dummy_run(
        self, num_tokens: int, cudagraph_runtime_mode: CUDAGraphMode | None = None
    ) -> None:
        """One forward of ``num_tokens`` dummy tokens (vLLM's ``_dummy_run``).

        A compiled model compiles here, at its widest batch; the adaptive
        thread count times its warm-up probe on it. With no attention
        metadata the attention layers write zeros and touch no KV cache. In
        PIECEWISE mode (``capture_model``) each compiled piece captures its
        graph for ``num_tokens``, reading the fixed input buffers as a real
        step will.
        """
        assert self.model is not None
        mode = cudagraph_runtime_mode or CUDAGraphMode.NONE
        if mode == CUDAGraphMode.NONE:
            input_ids = torch.zeros(num_tokens, dtype=self.input_ids.dtype, device=self.device)
            positions = torch.zeros(num_tokens, dtype=self.positions.dtype, device=self.device)
        else:
            assert self.input_ids_buffer is not None and self.positions_buffer is not None
            input_ids = self.input_ids_buffer[:num_tokens]
            positions = self.positions_buffer[:num_tokens]
        with set_forward_context(
            None,
            self.vllm_config,
            no_compile_layers=dict(self.attn_layers),
            cudagraph_runtime_mode=mode,
            batch_descriptor=BatchDescriptor(num_tokens) if mode != CUDAGraphMode.NONE else None,
        ):
            self.model(input_ids, positions, None)

    # --8<-- [start:capture_model]
    def capture_model(self) -> float:
        """Capture every size's CUDA graphs (vLLM's ``capture_model``); returns seconds.

        Largest first, each after one warm-up run without graphs (cuBLAS and
        Triton set themselves up outside the capture). Nothing to do unless
        the compilation config asks for PIECEWISE graphs (CUDA, VLLM_COMPILE).
        """
        cc = self.vllm_config.compilation_config
        mode = cc.cudagraph_mode or CUDAGraphMode.NONE
        self.cudagraph_dispatcher.initialize_cudagraph_keys(mode)
        if mode == CUDAGraphMode.NONE:
            return 0.0  # no span either: a start-up without graphs traces nothing here
        return self._capture_graphs(mode)

    @tracing.instrument("ModelRunner.capture_model")
    def _capture_graphs(self, mode: CUDAGraphMode) -> float:
        from tracevllm.compilation.cuda_graph import cudagraph_capturing_enabled

        start = time.perf_counter()
        torch.cuda.synchronize()
        memory_before = torch.cuda.mem_get_info()[0]
        with cudagraph_capturing_enabled():
            for runtime_mode, descriptors in self.cudagraph_dispatcher.get_capture_descs():
                for descriptor in descriptors:
                    self._dummy_run(descriptor.num_tokens, CUDAGraphMode.NONE)  # warm-up
                    self._dummy_run(descriptor.num_tokens, runtime_mode)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        # The pieces' kept outputs, one set per size, are most of it.
        taken_gib = (memory_before - torch.cuda.mem_get_info()[0]) / (1 << 30)
        logger.info(
            "Graph capturing finished in %.1f s, %.2f GiB: %d sizes (%s .. %s tokens), mode %s.",
            elapsed,
            taken_gib,
            len(self.cudagraph_dispatcher.capture_sizes),
            self.cudagraph_dispatcher.capture_sizes[0],
            self.cudagraph_dispatcher.capture_sizes[-1],
            mode.name,
        )
        return elapsed

    # --8<-- [end:capture_model]

    def _model_inputs(
        self, num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor, CUDAGraphMode, BatchDescriptor | None]:
        """The step's input ids and positions, and the graph it runs.

        With a captured size >= num_tokens, the step is padded to it: its
        ids and positions go into the fixed buffers, whose tail keeps the
        last values there (valid ids and positions; their rows write no KV,
        since the slot mapping covers the real tokens only, and no logits are
        taken from them).
        """
        mode, descriptor = self.cudagraph_dispatcher.dispatch(num_tokens)
        if mode == CUDAGraphMode.NONE:
            return self.input_ids, self.positions, mode, None
        assert self.input_ids_buffer is not None and self.positions_buffer is not None
        self.input_ids_buffer[:num_tokens].copy_(self.input_ids, non_blocking=True)
        self.positions_buffer[:num_tokens].copy_(self.positions, non_blocking=True)
        padded = descriptor.num_tokens
        return self.input_ids_buffer[:padded], self.positions_buffer[:padded], mode, descriptor

    def _all_attn_layers(self) -> dict[str, Attention]:
        """The model's attention layers and a draft model's (the same block ids page them)."""
        layers = dict(self.attn_layers)
        if isinstance(self.drafter, DraftModelProposer):
            layers.update(self.drafter.attn_layers)
        return layers

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """Each attention layer's KV cache, by layer name: full attention, or a
        sliding window's (vLLM asks each layer: ``Attention.get_kv_cache_spec``)."""
        assert self.attn_layers, "load_model() first"
        return {
            name: layer.get_kv_cache_spec(self.vllm_config)
            for name, layer in self._all_attn_layers().items()
        }

    # --8<-- [start:initialize_kv_cache]
    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig | int) -> None:
        """Allocate the KV cache tensors the config names and bind each layer its view.

        A tensor may be shared by one layer of each KV cache group (a hybrid
        model): the groups draw block ids from one pool, so a page is only
        ever one group's. An int (tracevllm's older call) is a block count;
        the config is then rebuilt from the layers' specs, as the engine did.
        """
        assert self.attn_layers, "load_model() first"
        if isinstance(kv_cache_config, int):
            kv_cache_config = self._kv_cache_config_for(kv_cache_config)
        self.kv_cache_config = kv_cache_config
        self.may_reinitialize_input_batch(kv_cache_config)
        layers = self._all_attn_layers()
        specs: dict[str, KVCacheSpec] = {}
        for group in kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            for name in group.layer_names:
                # One window of several sizes: each layer has its own spec.
                if isinstance(spec, UniformTypeKVCacheSpecs):
                    specs[name] = spec.kv_cache_specs[name]
                else:
                    specs[name] = spec
        kv_caches: dict[str, torch.Tensor] = {}
        for tensor in kv_cache_config.kv_cache_tensors:
            # Zeroed: a never-written slot must not hold NaNs that a masked read could touch.
            raw = torch.zeros(tensor.size, dtype=torch.int8, device=self.device)
            for name in tensor.shared_by:
                spec = specs[name]
                assert isinstance(spec, AttentionSpec)
                shape = layers[name].attn_backend.get_kv_cache_shape(
                    kv_cache_config.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size
                )
                kv_caches[name] = raw.view(spec.dtype).view(shape)
        assert kv_caches.keys() == layers.keys(), "a layer without its KV cache"
        self.kv_caches = []
        bind_kv_cache(kv_caches, layers, self.kv_caches)
        self.initialize_kv_connector(self.vllm_config, kv_cache_config, kv_caches)

    # --8<-- [end:initialize_kv_cache]

    def may_reinitialize_input_batch(self, kv_cache_config: KVCacheConfig) -> None:
        """A fresh persistent batch if the groups' block sizes are not the ones it has."""
        block_sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
        if block_sizes != self._init_block_sizes:
            self._init_block_sizes = block_sizes
            self.input_batch = self._make_input_batch()

    def _kv_cache_config_for(self, num_blocks: int) -> KVCacheConfig:
        """The KV cache config of ``num_blocks`` blocks for this model's layers."""
        groups = get_kv_cache_groups(self.vllm_config, self.get_kv_cache_spec())
        memory = num_blocks * _pool_bytes_per_block(groups)
        config = get_kv_cache_config_from_groups(self.vllm_config, groups, memory)
        for tensor in config.kv_cache_tensors:
            tensor.size = tensor.size // config.num_blocks * num_blocks
        config.num_blocks = num_blocks
        return config

    def drop_all_requests(self) -> None:
        """Forget every request: a fresh persistent batch (tracevllm's own,
        for EngineCore.abort_all_after_failed_step)."""
        self.requests.clear()
        self.input_batch = self._make_input_batch()
        self.execute_model_state = None
        self._draft_token_ids = None

    # ------------------------------------------------------------ the step
    # --8<-- [start:update_states]
    @tracing.instrument("ModelRunner._update_states", record=records.update_states)
    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Bring the persistent batch in line with what the scheduler decided."""
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)

        # Requests not scheduled this step (preempted, or left out for lack of
        # budget) leave the batch but keep their state: they may come back.
        scheduled = scheduler_output.num_scheduled_tokens.keys()
        cached = scheduler_output.scheduled_cached_reqs
        for req_id in batch.req_id_to_index.keys() - (scheduled - cached.resumed_req_ids):
            batch.remove_request(req_id)

        reqs_to_add: list[CachedRequestState] = []
        for new in scheduler_output.scheduled_new_reqs:
            generator = None
            if new.sampling_params.sampling_type == SamplingType.RANDOM_SEED:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(new.sampling_params.seed)  # type: ignore[arg-type]
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                sampling_params=new.sampling_params,
                generator=generator,
                block_ids=tuple(list(ids) for ids in new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                output_token_ids=[],
            )
            self.requests[new.req_id] = state
            reqs_to_add.append(state)

        is_last_rank = get_pp_group().is_last_rank
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_block_ids = cached.new_block_ids[i]
            new_token_ids: list[int] = []
            if not is_last_rank:
                # An earlier pipeline stage never samples: the scheduler sends
                # the tokens this step runs, and the ones it has not seen yet
                # (the last stage's samples) are appended.
                new_token_ids = cached.new_token_ids[i]
                num_new_tokens = state.num_computed_tokens + len(new_token_ids) - state.num_tokens
                if num_new_tokens > 0:
                    state.output_token_ids.extend(new_token_ids[-num_new_tokens:])
            # The runner appended every token it sampled (sample_tokens), so its
            # copy is current; cached.all_token_ids is for KV connectors and
            # async scheduling, which tracevllm leaves out. Only trim tokens the
            # scheduler did not keep, as vLLM does.
            elif cached.num_output_tokens and cached.num_output_tokens[i] < len(
                state.output_token_ids
            ):
                del state.output_token_ids[cached.num_output_tokens[i] :]
                # A KV load failed under the dropped sample: its row ends there too.
                if (row := batch.req_id_to_index.get(req_id)) is not None:
                    num_tokens = batch.num_prompt_tokens[row] + cached.num_output_tokens[i]
                    batch.num_tokens_no_spec[row] = num_tokens
            if req_id in cached.resumed_req_ids:
                # Preempted requests lost their blocks; these replace them.
                assert new_block_ids is not None
                state.block_ids = tuple(list(ids) for ids in new_block_ids)
            elif new_block_ids is not None:
                for ids, new_ids in zip(state.block_ids, new_block_ids):
                    ids.extend(new_ids)

            req_index = batch.req_id_to_index.get(req_id)
            if req_index is None:
                # Resumed, or back after a step without budget: re-add the row.
                num_output_tokens = cached.num_output_tokens[i]
                if self.use_async_scheduling and num_output_tokens > 0:
                    # Its outputs here end in placeholders; the scheduler's
                    # copy of its tokens has them all by now.
                    resumed_token_ids = cached.all_token_ids[req_id]
                    state.output_token_ids = resumed_token_ids[-num_output_tokens:]
                reqs_to_add.append(state)
                continue
            batch.num_computed_tokens_cpu[req_index] = state.num_computed_tokens
            if new_block_ids is not None:
                batch.block_table.append_row(new_block_ids, req_index)
            if not is_last_rank:
                # The last stage caches what it sampled; the others write the
                # tokens they were sent (a prefill chunk may end short of them).
                start = int(batch.num_tokens_no_spec[req_index])
                end = max(start, state.num_computed_tokens + len(new_token_ids))
                if end > start:
                    batch.token_ids_cpu[req_index, start:end] = new_token_ids[start - end :]
                    batch.num_tokens_no_spec[req_index] = end

        for state in reqs_to_add:
            batch.add_request(state)
        batch.condense()
        # The drafts go right after each request's tokens, where the input
        # ids are gathered from (vLLM's update_req_spec_token_ids).
        for req_id, spec_token_ids in scheduler_output.scheduled_spec_decode_tokens.items():
            row = batch.req_id_to_index[req_id]
            start = int(batch.num_tokens_no_spec[row])
            batch.token_ids_cpu[row, start : start + len(spec_token_ids)] = spec_token_ids

    # --8<-- [end:update_states]

    # --8<-- [start:prepare_inputs]
    @tracing.instrument("ModelRunner._prepare_inputs", record=records.prepare_inputs)
    def _prepare_inputs(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[dict[str, AttentionMetadata], torch.Tensor, np.ndarray]:
        """Flatten the batch into one token stream and its attention metadata.

        E.g. three requests scheduled for [2, 5, 3] tokens:
        req_indices [0 0 1 1 1 1 1 2 2 2], query_pos [0 1 0 1 2 3 4 0 1 2],
        query_start_loc [0 2 7 10], logits_indices [1 6 9].
        """
        batch = self.input_batch
        num_reqs = batch.num_reqs
        num_scheduled_tokens = np.array(
            [scheduler_output.num_scheduled_tokens[r] for r in batch.req_ids], dtype=np.int32
        )
        total = int(num_scheduled_tokens.sum())
        assert total == scheduler_output.total_num_scheduled_tokens

        req_indices = np.repeat(self.arange_np[:num_reqs], num_scheduled_tokens)
        cu_num_tokens, query_pos = self._get_cumsum_and_arange(num_scheduled_tokens)
        computed = batch.num_computed_tokens_cpu[:num_reqs]
        positions_np = computed[req_indices] + query_pos  # [total]

        # Row r, position p of token_ids_cpu is element r * max_model_len + p.
        token_indices = torch.from_numpy(positions_np + req_indices * self.max_model_len)
        input_ids = batch.token_ids_cpu_tensor.flatten().index_select(0, token_indices)

        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        query_start_loc[1:] = cu_num_tokens
        seq_lens = computed + num_scheduled_tokens  # [num_reqs]
        # One slot per token per KV cache group: each group has its own blocks.
        slot_mappings = batch.block_table.compute_slot_mapping(req_indices, positions_np)
        # Sample at each request's last scheduled token (and at its drafts).
        logits_indices = torch.from_numpy(query_start_loc[1:] - 1).to(torch.int64)
        self.spec_decode_metadata = None
        if scheduler_output.scheduled_spec_decode_tokens:
            self.spec_decode_metadata = self._calc_spec_decode_metadata(
                scheduler_output, cu_num_tokens
            )
            logits_indices = self.spec_decode_metadata.logits_indices
        # A chunk that stops short of the known tokens samples a token nobody wants.
        discard = np.nonzero(seq_lens < batch.num_tokens_no_spec[:num_reqs])[0]

        max_seq_len = int(seq_lens.max())
        qsl_cpu = torch.from_numpy(query_start_loc)
        seq_lens_cpu = torch.from_numpy(seq_lens.astype(np.int32))
        dev = self.device
        query_start_loc_dev, seq_lens_dev = qsl_cpu.to(dev), seq_lens_cpu.to(dev)
        # A metadata per KV cache group: the same batch, the group's own block
        # table and slots (vLLM builds them with one builder per group).
        self.attn_metadata_per_group = []
        block_tables = batch.block_table.block_tables
        for block_table, slot_mapping in zip(block_tables, slot_mappings, strict=True):
            num_blocks = -(-max_seq_len // block_table.block_size)
            self.attn_metadata_per_group.append(
                AttentionMetadata(
                    num_actual_tokens=total,
                    max_query_len=int(num_scheduled_tokens.max()),
                    query_start_loc=query_start_loc_dev,
                    max_seq_len=max_seq_len,
                    seq_lens=seq_lens_dev,
                    # Only the columns this step can touch; a copy, so the record stays put.
                    block_table=block_table.block_table[:num_reqs, :num_blocks].clone().to(dev),
                    slot_mapping=slot_mapping.clone().to(dev),
                    query_start_loc_cpu=qsl_cpu,
                    seq_lens_cpu=seq_lens_cpu,
                )
            )
        attn_metadata = self.attn_metadata_per_group[0]

        self.req_indices = req_indices
        self.input_ids = self._prepare_input_ids(input_ids.to(dev), cu_num_tokens)
        self.positions = torch.from_numpy(positions_np.astype(np.int64)).to(dev)
        self.query_start_loc = attn_metadata.query_start_loc
        self.seq_lens = attn_metadata.seq_lens
        self.slot_mapping = attn_metadata.slot_mapping
        self.logits_indices = logits_indices.to(dev)
        self.attn_metadata = attn_metadata
        # Each layer reads its KV cache group's metadata.
        if len(self.attn_metadata_per_group) == 1:
            per_layer = dict.fromkeys(self.attn_layers, attn_metadata)
        else:
            assert self.kv_cache_config is not None
            per_layer = {
                name: self.attn_metadata_per_group[i]
                for i, group in enumerate(self.kv_cache_config.kv_cache_groups)
                for name in group.layer_names
                if name in self.attn_layers
            }
        return per_layer, self.logits_indices, discard

    # --8<-- [end:prepare_inputs]

    # --8<-- [start:prepare_input_ids]
    def _prepare_input_ids(
        self, input_ids: torch.Tensor, cu_num_tokens: np.ndarray
    ) -> torch.Tensor:
        """Async scheduling: put last step's sampled tokens in for their placeholders.

        A request that sampled a token last step runs that token now, as its
        last input; the persistent batch holds -1 there (the token never
        came to the host). E.g. rows [a, b, c] scheduled for [4, 1, 1]
        tokens (cu_num_tokens [4 5 6]), b and c sampled last step in rows 1
        and 0: input_ids[4] = prev_sampled_token_ids[1], input_ids[5] =
        prev_sampled_token_ids[0]. A new request, or one re-added with its
        tokens from the scheduler, is not in ``prev_req_id_to_index``.
        """
        batch = self.input_batch
        prev_sampled_token_ids = batch.prev_sampled_token_ids  # [num_prev_reqs, 1]
        if prev_sampled_token_ids is None:
            return input_ids  # the synchronous path: every token id is on the host
        flattened_indices: list[int] = []
        prev_indices: list[int] = []
        for cur_index, req_id in enumerate(batch.req_ids):
            prev_index = batch.prev_req_id_to_index.get(req_id)
            if prev_index is None:
                continue
            flattened_indices.append(int(cu_num_tokens[cur_index]) - 1)
            prev_indices.append(prev_index)
        if flattened_indices:
            dev = input_ids.device
            index = torch.tensor(flattened_indices, dtype=torch.int64, device=dev)
            src = prev_sampled_token_ids[torch.tensor(prev_indices, device=dev), 0]
            input_ids.scatter_(0, index, src.to(input_ids.dtype))  # [num_tokens]
        return input_ids

    # --8<-- [end:prepare_input_ids]

    def _get_cumsum_and_arange(self, num_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[2, 5, 3] -> cumsum [2, 7, 10] and arange [0 1 0 1 2 3 4 0 1 2]."""
        cu_num_tokens = np.cumsum(num_tokens)
        total = int(cu_num_tokens[-1])
        offsets = np.repeat(cu_num_tokens - num_tokens, num_tokens)  # [0 0 2 2 2 2 2 7 7 7]
        return cu_num_tokens, self.arange_np[:total] - offsets

    # --8<-- [start:execute_model]
    @tracing.instrument("ModelRunner.execute_model")
    @torch.inference_mode()
    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> ModelRunnerOutput | IntermediateTensors | None:
        """Run the forward pass; sample_tokens() finishes the step.

        Returns None, or EMPTY_MODEL_RUNNER_OUTPUT when nothing was scheduled
        (then there is nothing to sample). A pipeline stage after the first
        starts from ``intermediate_tensors``; a stage before the last
        returns its own, for the Worker to send on: only the last stage
        computes logits and samples.
        """
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            self.execute_model_state = None
            return self.kv_connector_no_forward(scheduler_output, self.vllm_config)
        assert self.model is not None, "load_model() first"
        attn_metadata, logits_indices, discard = self._prepare_inputs(scheduler_output)
        input_ids, positions, cudagraph_mode, batch_descriptor = self._model_inputs(
            scheduler_output.total_num_scheduled_tokens
        )
        with (
            set_forward_context(
                attn_metadata,
                self.vllm_config,
                no_compile_layers=dict(self.attn_layers),
                slot_mapping={name: md.slot_mapping for name, md in attn_metadata.items()},
                cudagraph_runtime_mode=cudagraph_mode,
                batch_descriptor=batch_descriptor,
            ),
            self.maybe_get_kv_connector_output(scheduler_output) as kv_connector_output,
        ):
            hidden_states = self.model(input_ids, positions, intermediate_tensors)
        self.kv_connector_output = kv_connector_output
        if not get_pp_group().is_last_rank:
            assert isinstance(hidden_states, IntermediateTensors)
            self.execute_model_state = None  # nothing to sample here
            return hidden_states
        assert isinstance(hidden_states, torch.Tensor)  # [num_tokens, hidden]
        # Only the last token of each request needs logits (and each draft position).
        logits = self.model.compute_logits(hidden_states[logits_indices])  # [num_logits, vocab]
        self.execute_model_state = ExecuteModelState(
            scheduler_output, logits, discard, self.spec_decode_metadata
        )
        return None

    # --8<-- [end:execute_model]

    # --8<-- [start:sample_tokens]
    @tracing.instrument("ModelRunner.sample_tokens", record=records.sample_tokens)
    @torch.inference_mode()
    def sample_tokens(
        self, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput | AsyncGPUModelRunnerOutput:
        """Sample one token per request and append it to the persistent batch.

        Structured requests' rows are masked first: a token the grammar
        forbids gets -inf, before penalties, temperature and top-k/top-p.
        """
        state = self.execute_model_state
        if state is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        self.execute_model_state = None
        batch = self.input_batch
        if grammar_output is not None:
            apply_grammar_bitmask(state.scheduler_output, grammar_output, batch, state.logits)
        if self.use_async_scheduling and not batch.no_penalties:
            # The penalties count last step's tokens, which are placeholders here.
            batch.update_async_output_token_ids()
        sampling_metadata = batch.make_sampling_metadata()

        # vLLM rewinds a discarded row's generator (CUDA Philox offset - 4) so
        # the throw-away draw costs the seeded stream nothing. CPU generators
        # have no offset: save and restore their state instead.
        saved = {
            int(i): gen.get_state()
            for i in state.discard_request_indices
            if (gen := sampling_metadata.generators.get(int(i))) is not None
        }
        if self.use_async_scheduling:
            assert state.spec_decode_metadata is None, "no drafts with async scheduling"
            sampler_output = self.sampler(state.logits, sampling_metadata)
            for i, gen_state in saved.items():
                sampling_metadata.generators[i].set_state(gen_state)
            return self._bookkeeping_async(state, sampler_output)
        if state.spec_decode_metadata is None:
            sampler_output = self.sampler(state.logits, sampling_metadata)
            valid_sampled_token_ids: list[list[int]] = sampler_output.sampled_token_ids.tolist()
            for i in state.discard_request_indices:
                valid_sampled_token_ids[int(i)].clear()
            logprobs_lists = None
            if sampler_output.logprobs_tensors is not None:
                logprobs_lists = sampler_output.logprobs_tensors.tolists()
        else:
            valid_sampled_token_ids, logprobs_lists = self._rejection_sample(
                state, sampling_metadata
            )
        for i, gen_state in saved.items():
            sampling_metadata.generators[i].set_state(gen_state)

        # Cache the sampled tokens here, so the scheduler need not send them back.
        for req_idx, sampled_ids in enumerate(valid_sampled_token_ids):
            if not sampled_ids:
                continue
            start = int(batch.num_tokens_no_spec[req_idx])
            end = start + len(sampled_ids)
            assert end <= self.max_model_len, "sampled past max_model_len"
            batch.token_ids_cpu[req_idx, start:end] = sampled_ids
            batch.num_tokens_no_spec[req_idx] = end
            self.requests[batch.req_ids[req_idx]].output_token_ids.extend(sampled_ids)

        if self.drafter is not None:
            self._draft_token_ids = self.propose_draft_token_ids(
                state, valid_sampled_token_ids, sampling_metadata
            )
        return ModelRunnerOutput(
            req_ids=list(batch.req_ids),
            req_id_to_index=dict(batch.req_id_to_index),
            sampled_token_ids=valid_sampled_token_ids,
            logprobs=logprobs_lists,
            kv_connector_output=self.take_kv_connector_output(),
        )

    # --8<-- [end:sample_tokens]

    # --8<-- [start:bookkeeping_async]
    def _bookkeeping_async(
        self, state: ExecuteModelState, sampler_output: SamplerOutput
    ) -> AsyncGPUModelRunnerOutput:
        """Keep the sampled tokens on the device for the next step's inputs;
        the persistent batch and the requests get a placeholder (-1) each.

        (vLLM's ``_bookkeeping_sync`` on its async branch.) A discarded row
        (partial prefill) gets none and is left out of ``prev_req_id_to_index``.
        """
        batch = self.input_batch
        sampled_token_ids = sampler_output.sampled_token_ids  # [num_reqs, 1]
        invalid_req_indices = state.discard_request_indices.tolist()
        invalid = set(invalid_req_indices)
        batch.prev_sampled_token_ids = sampled_token_ids
        batch.prev_req_id_to_index = {
            req_id: i for i, req_id in enumerate(batch.req_ids) if i not in invalid
        }
        for req_idx in batch.prev_req_id_to_index.values():
            end = int(batch.num_tokens_no_spec[req_idx]) + 1
            assert end <= self.max_model_len, "sampled past max_model_len"
            batch.token_ids_cpu[req_idx, end - 1] = -1
            batch.num_tokens_no_spec[req_idx] = end
            self.requests[batch.req_ids[req_idx]].output_token_ids.append(-1)
        return AsyncGPUModelRunnerOutput(
            # Copies: the batch changes before the output is read.
            ModelRunnerOutput(
                req_ids=list(batch.req_ids), req_id_to_index=dict(batch.req_id_to_index)
            ),
            sampled_token_ids,
            sampler_output.logprobs_tensors,
            invalid_req_indices,
        )

    # --8<-- [end:bookkeeping_async]

    # ------------------------------------------------------ speculative decoding
    # --8<-- [start:calc_spec_decode_metadata]
    def _calc_spec_decode_metadata(
        self, scheduler_output: SchedulerOutput, cu_num_scheduled_tokens: np.ndarray
    ) -> SpecDecodeMetadata:
        """Which logits to compute: each draft position, and one past the last.

        E.g. scheduled [4, 100, 3] tokens, of which [3, 0, 2] drafts:
        logits_indices [0 1 2 3 103 104 105 106], target_logits_indices
        [0 1 2 5 6] (rows that verify a draft), bonus_logits_indices [3 4 7].
        """
        batch = self.input_batch
        drafts = scheduler_output.scheduled_spec_decode_tokens
        draft_lists = [drafts.get(req_id, []) for req_id in batch.req_ids]
        num_draft_tokens = np.array([len(d) for d in draft_lists], dtype=np.int32)
        num_sampled_tokens = num_draft_tokens + 1
        cu_num_sampled_tokens, sampled_pos = self._get_cumsum_and_arange(num_sampled_tokens)
        # The last num_sampled tokens of each request: [0 1 2 3 103 104 105 106].
        logits_indices = (
            np.repeat(cu_num_scheduled_tokens - num_sampled_tokens, num_sampled_tokens)
            + sampled_pos
        )
        bonus_logits_indices = cu_num_sampled_tokens - 1
        # Rows of logits: each request's first num_draft of its num_sampled.
        cu_num_draft_tokens = np.cumsum(num_draft_tokens)
        draft_pos = np.concatenate([self.arange_np[:n] for n in num_draft_tokens])
        target_logits_indices = (
            np.repeat(cu_num_sampled_tokens - num_sampled_tokens, num_draft_tokens) + draft_pos
        )
        dev = self.device

        def to_dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.asarray(a, dtype=np.int64)).to(dev)

        return SpecDecodeMetadata(
            draft_token_ids=torch.tensor(
                [t for d in draft_lists for t in d], dtype=torch.int32, device=dev
            ),
            num_draft_tokens=num_draft_tokens.tolist(),
            cu_num_draft_tokens=to_dev(cu_num_draft_tokens),
            cu_num_sampled_tokens=to_dev(cu_num_sampled_tokens),
            target_logits_indices=to_dev(target_logits_indices),
            bonus_logits_indices=to_dev(bonus_logits_indices),
            logits_indices=to_dev(logits_indices),
        )

    # --8<-- [end:calc_spec_decode_metadata]

    def _rejection_sample(
        self, state: ExecuteModelState, sampling_metadata: SamplingMetadata
    ) -> tuple[list[list[int]], LogprobsLists | None]:
        """Each request's emitted tokens (accepted drafts + one), by the rejection sampler."""
        assert self.rejection_sampler is not None and state.spec_decode_metadata is not None
        metadata = state.spec_decode_metadata
        batch = self.input_batch
        drafts = state.scheduler_output.scheduled_spec_decode_tokens
        # Penalties and min-tokens at a draft position count the drafts before it.
        sampling_metadata = dataclasses.replace(
            sampling_metadata,
            output_token_ids=batch.req_output_token_ids[: batch.num_reqs],  # type: ignore[arg-type]
            spec_token_ids=[drafts.get(req_id, []) for req_id in batch.req_ids],
        )
        draft_probs = None
        if isinstance(self.drafter, DraftModelProposer) and self.drafter.last_draft_probs:
            draft_probs = self._get_spec_decode_draft_probs(metadata, drafts)
        sampler_output = self.rejection_sampler(
            metadata, draft_probs, state.logits, sampling_metadata
        )
        return RejectionSampler.parse_output(
            sampler_output.sampled_token_ids,
            self.vocab_size,
            state.discard_request_indices.tolist(),
            sampler_output.logprobs_tensors,
        )

    def _get_spec_decode_draft_probs(
        self, metadata: SpecDecodeMetadata, drafts: dict[str, list[int]]
    ) -> torch.Tensor:
        """[num_draft_tokens, vocab_size]: q for each scheduled draft, from the
        draft model's last proposal (one-hot where it has none: a greedy draft)."""
        assert isinstance(self.drafter, DraftModelProposer)
        rows = []
        for req_id in self.input_batch.req_ids:
            n = len(drafts.get(req_id, ()))
            probs = self.drafter.last_draft_probs.get(req_id)
            if probs is None:
                probs = torch.zeros(n, self.vocab_size, device=self.device)
                ids = torch.tensor(drafts.get(req_id, []), dtype=torch.int64)
                probs[torch.arange(n), ids] = 1.0
            rows.append(probs[:n])
        return torch.cat(rows).contiguous()

    # --8<-- [start:propose_draft_token_ids]
    @tracing.instrument(
        "ModelRunner.propose_draft_token_ids", record=records.propose_draft_token_ids
    )
    def propose_draft_token_ids(
        self,
        state: ExecuteModelState,
        sampled_token_ids: list[list[int]],
        sampling_metadata: SamplingMetadata,
    ) -> list[list[int]]:
        """The drafts for the next step, one list per row (after the bookkeeping,
        so the persistent batch already holds this step's tokens)."""
        if isinstance(self.drafter, NgramProposer):
            return self.drafter.propose(
                sampled_token_ids,
                self.input_batch.num_tokens_no_spec,
                self.input_batch.token_ids_cpu,
            )
        assert isinstance(self.drafter, DraftModelProposer)
        batch = self.input_batch
        so = state.scheduler_output
        num_scheduled = np.array([so.num_scheduled_tokens[r] for r in batch.req_ids])
        num_draft = [len(so.scheduled_spec_decode_tokens.get(r, ())) for r in batch.req_ids]
        return self.drafter.propose(
            sampled_token_ids, batch, num_scheduled, num_draft, sampling_metadata
        )

    # --8<-- [end:propose_draft_token_ids]

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts of the last step, once (EngineCore.post_step hands them to the scheduler)."""
        if self._draft_token_ids is None:
            return None
        draft_token_ids, self._draft_token_ids = self._draft_token_ids, None
        return DraftTokenIds(list(self.input_batch.req_ids), draft_token_ids)

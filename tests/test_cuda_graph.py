"""CUDA graphs (compilation/cuda_graph.py, cudagraph_dispatcher.py): sizes, dispatch, padding.

On CPU: the capture sizes and modes resolve as vLLM's do, the dispatcher
pads a step to the next captured size, and the runner's padded path (fixed
buffers, padding rows that write no KV and give no logits) keeps greedy
output unchanged; no graph can be captured there. On CUDA
(``bash benchmarks/gpu_check.sh``): the compiled engine with PIECEWISE
graphs captures every piece at every size, replays them, and gives the eager
engine's greedy tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tracevllm import LLM, SamplingParams
from tracevllm.compilation.config import (
    ATTENTION_OPS,
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    _resolve_cudagraph_mode,
    set_cudagraph_sizes,
)
from tracevllm.compilation.counter import compilation_counter
from tracevllm.cudagraph_dispatcher import CudagraphDispatcher
from tracevllm.forward_context import BatchDescriptor

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# 33 prompt tokens over a 32-token budget: the first step (32 tokens) runs as
# it is, the second (two decodes and the last prompt token: 3) as 4, then
# the decode steps (3 tokens) as 4; the last request's last decode as 1.
PROMPTS = [list(range(100, 123)), [7], list(range(300, 309))]
SIZES = [1, 2, 4, 8]


def _sizes(**kwargs: Any) -> list[int]:
    cc = CompilationConfig(cudagraph_mode=CUDAGraphMode.PIECEWISE, **kwargs.pop("cc", {}))
    set_cudagraph_sizes(cc, **kwargs)
    assert cc.max_cudagraph_capture_size == (cc.cudagraph_capture_sizes or [0])[-1]
    return list(cc.cudagraph_capture_sizes or [])


def test_default_capture_sizes_are_vllms() -> None:
    # min(max_num_seqs * 2, 512): 1, 2, 4, every 8 below 256, every 16 from 256.
    sizes = _sizes(max_num_seqs=256, max_num_batched_tokens=8192)
    assert sizes == [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    assert _sizes(max_num_seqs=4, max_num_batched_tokens=8192) == [1, 2, 4, 8]
    # Never above max_num_batched_tokens, which is captured when it fits.
    assert _sizes(max_num_seqs=64, max_num_batched_tokens=20) == [1, 2, 4, 8, 16, 20]
    # n-gram drafts: the decode query is 1 + k tokens long.
    assert _sizes(max_num_seqs=4, max_num_batched_tokens=8192, num_speculative_tokens=3)[-1] == 32
    # Given sizes win; those above the token budget go.
    given = _sizes(cc={"cudagraph_capture_sizes": [3, 64, 1000]}, max_num_seqs=4,
                   max_num_batched_tokens=512)  # fmt: skip
    assert given == [3, 64]
    for sizes in ([1000], []):
        with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
            _sizes(
                cc={"cudagraph_capture_sizes": sizes}, max_num_seqs=4, max_num_batched_tokens=512
            )
    # Both given, and they disagree: refused, as vLLM.
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        _sizes(cc={"cudagraph_capture_sizes": [1, 2], "max_cudagraph_capture_size": 8},
               max_num_seqs=4, max_num_batched_tokens=512)  # fmt: skip
    # A max alone, above the token budget: the budget wins.
    capped = _sizes(cc={"max_cudagraph_capture_size": 64}, max_num_seqs=256,
                    max_num_batched_tokens=20)  # fmt: skip
    assert capped == [1, 2, 4, 8, 16, 20]
    none = CompilationConfig(cudagraph_mode=CUDAGraphMode.NONE)
    set_cudagraph_sizes(none, 256, 8192)
    assert none.cudagraph_capture_sizes == [] and none.max_cudagraph_capture_size == 0


def test_cudagraph_mode_resolution() -> None:
    compiled = CompilationMode.VLLM_COMPILE
    split = list(ATTENTION_OPS)
    # Asked for, until a GPU run has checked it (vLLM's default: FULL_AND_PIECEWISE).
    assert _resolve_cudagraph_mode(None, compiled, "cuda", split) == CUDAGraphMode.NONE
    piecewise = CUDAGraphMode.PIECEWISE
    assert _resolve_cudagraph_mode(piecewise, compiled, "cuda", split) == piecewise
    full_and_piecewise = CUDAGraphMode.FULL_AND_PIECEWISE
    assert _resolve_cudagraph_mode(full_and_piecewise, compiled, "cuda", split) == piecewise
    # FULL graphs would capture attention, whose metadata is rebuilt every step.
    for full in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY):
        with pytest.raises(ValueError, match="cudagraph_mode"):
            _resolve_cudagraph_mode(full, compiled, "cuda", split)
    # An attention op inside a captured piece would be skipped at every replay.
    for ops in ([], split[:1], split[1:]):
        assert _resolve_cudagraph_mode(piecewise, compiled, "cuda", ops) == CUDAGraphMode.NONE
    assert _resolve_cudagraph_mode(CUDAGraphMode.NONE, compiled, "cuda", split) == (
        CUDAGraphMode.NONE
    )
    # No graphs without the split graph, nor on CPU.
    assert _resolve_cudagraph_mode(piecewise, CompilationMode.NONE, "cuda", split) == (
        CUDAGraphMode.NONE
    )
    assert _resolve_cudagraph_mode(piecewise, compiled, "cpu", split) == CUDAGraphMode.NONE


@pytest.mark.parametrize("bad", [True, 0, -8, 2.0, "8"])
def test_bad_max_capture_size_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        CompilationConfig(max_cudagraph_capture_size=bad)


def _dispatcher(sizes: list[int], mode: CUDAGraphMode = CUDAGraphMode.PIECEWISE) -> Any:
    class _Config:
        compilation_config = CompilationConfig(cudagraph_capture_sizes=sizes)

    dispatcher = CudagraphDispatcher(_Config())  # type: ignore[arg-type]
    dispatcher.initialize_cudagraph_keys(mode)
    return dispatcher


def test_dispatch_pads_to_the_next_captured_size() -> None:
    dispatcher = _dispatcher([1, 2, 4, 8, 16])
    piecewise = CUDAGraphMode.PIECEWISE
    assert dispatcher.dispatch(1) == (piecewise, BatchDescriptor(1))
    assert dispatcher.dispatch(3) == (piecewise, BatchDescriptor(4))
    assert dispatcher.dispatch(5) == (piecewise, BatchDescriptor(8))
    assert dispatcher.dispatch(16) == (piecewise, BatchDescriptor(16))
    assert dispatcher.dispatch(17) == (CUDAGraphMode.NONE, BatchDescriptor(17))
    descs = dispatcher.get_capture_descs()
    assert descs == [(piecewise, [BatchDescriptor(n) for n in (16, 8, 4, 2, 1)])]
    off = _dispatcher([1, 2], CUDAGraphMode.NONE)
    assert off.dispatch(1) == (CUDAGraphMode.NONE, BatchDescriptor(1))
    assert off.get_capture_descs() == []


def _generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    return [list(o.outputs[0].token_ids) for o in outs]


def _runner(llm: LLM) -> Any:
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    return executor.driver_worker.worker.model_runner


def test_padded_steps_are_lossless_on_cpu(tiny_model_dir: str) -> None:
    """The runner's padded path without graphs: each step of n tokens runs as
    the next size in SIZES, from the fixed buffers; the padding rows must
    write no KV and give no logits."""
    # No prefix caching: the second run must schedule as the first.
    engine = dict(
        max_num_batched_tokens=32,
        num_gpu_blocks_override=64,
        block_size=16,
        enable_prefix_caching=False,
    )
    llm = LLM(tiny_model_dir, enforce_eager=True, enable_multiprocessing=False, **engine)
    try:
        expected = _generate(llm)
        runner = _runner(llm)
        steps: list[tuple[int, int]] = []  # (tokens scheduled, tokens run)
        model_inputs = runner._model_inputs

        def recording_model_inputs(num_tokens: int) -> Any:
            inputs = model_inputs(num_tokens)
            steps.append((num_tokens, inputs[0].shape[0]))
            return inputs

        runner.vllm_config.compilation_config.cudagraph_capture_sizes = SIZES
        runner.cudagraph_dispatcher.initialize_cudagraph_keys(CUDAGraphMode.PIECEWISE)
        # Values in the buffers' tails that no real step has: the padding rows
        # must not matter.
        runner.input_ids_buffer = torch.full((SIZES[-1],), 5, dtype=torch.int32)
        runner.positions_buffer = torch.full((SIZES[-1],), 3, dtype=torch.int64)
        runner._model_inputs = recording_model_inputs
        assert _generate(llm) == expected
        assert steps[0] == (32, 32)  # above the largest size: unpadded
        # Then each step runs as the smallest size that holds it: 3 as 4.
        assert all(run == min(x for x in SIZES if x >= n) for n, run in steps[1:]), steps
        assert (3, 4) in steps, steps
    finally:
        llm.shutdown()


class _ReplayingGraph:
    """A stand-in for ``torch.cuda.CUDAGraph`` on CPU: "capture" remembers the
    piece and the very tensors it was called with; "replay" runs the piece
    again on them and writes the result into the kept output, which is what
    a real replay does to those addresses. It checks the bookkeeping (what
    is captured when, which inputs must stay put), not CUDA."""

    capturing: list[_ReplayingGraph] = []

    def __init__(self) -> None:
        self.recorded: tuple[Any, tuple[Any, ...], Any] | None = None

    def replay(self) -> None:
        assert self.recorded is not None
        fn, args, kept = self.recorded
        new = fn(*args)
        for old, fresh in zip(
            kept if isinstance(kept, (tuple, list)) else (kept,),
            new if isinstance(new, (tuple, list)) else (new,),
            strict=True,
        ):
            if isinstance(old, torch.Tensor):
                old.copy_(fresh)


@contextlib.contextmanager
def _graph_capture(graph: _ReplayingGraph, pool: Any = None) -> Iterator[None]:
    _ReplayingGraph.capturing.append(graph)
    try:
        yield
    finally:
        _ReplayingGraph.capturing.pop()


class _Recording:
    """Around a compiled piece: tells the graph being captured what ran."""

    def __init__(self, piece: Any) -> None:
        self.piece = piece

    def __call__(self, *args: Any) -> Any:
        out = self.piece(*args)
        if _ReplayingGraph.capturing:
            _ReplayingGraph.capturing[-1].recorded = (self.piece, args, out)
        return out


@pytest.fixture
def replaying_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA graphs on CPU, through the stand-in: the config resolves as on CUDA."""
    import tracevllm.compilation.backends as backends
    import tracevllm.compilation.config as config
    import tracevllm.compilation.cuda_graph as cuda_graph

    resolve = config._resolve_cudagraph_mode
    monkeypatch.setattr(
        config,
        "_resolve_cudagraph_mode",
        lambda requested, mode, device, ops=None: resolve(requested, mode, "cuda", ops),
    )
    monkeypatch.setattr(cuda_graph, "get_global_graph_pool", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _ReplayingGraph)
    monkeypatch.setattr(torch.cuda, "graph", _graph_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a, **k: (0, 0))
    wrap = backends.wrap_with_cudagraph_if_needed

    def wrap_recording(piece: Any, vllm_config: Any, is_first_graph: bool) -> Any:
        wrapper = wrap(piece, vllm_config, is_first_graph)
        if isinstance(wrapper, cuda_graph.CUDAGraphWrapper):
            wrapper.runnable = _Recording(piece)
        return wrapper

    monkeypatch.setattr(backends, "wrap_with_cudagraph_if_needed", wrap_recording)


def test_capture_and_replay_bookkeeping_on_cpu(
    replaying_graphs: None, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole path (capture_model, dispatch, padded steps, replays) with the
    stand-in graph: the same greedy tokens as the compiled run without graphs,
    every piece captured once per size at start-up and replayed after."""
    from tests.utils import make_tiny_llama

    model = make_tiny_llama(str(tmp_path / "model"), seed=0)
    monkeypatch.setenv("TRACEVLLM_CACHE_DIR", str(tmp_path / "cache"))
    engine: dict[str, Any] = dict(
        max_num_batched_tokens=32,
        num_gpu_blocks_override=64,
        block_size=16,
        enable_prefix_caching=False,
        enable_multiprocessing=False,
    )
    plain = {"mode": 3, "backend": "eager", "cudagraph_mode": "NONE"}
    llm = LLM(model, compilation_config=plain, **engine)
    try:
        expected = _generate(llm)
    finally:
        llm.shutdown()
    before = compilation_counter.clone()
    graphs = {**plain, "cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": SIZES}
    llm = LLM(model, compilation_config=graphs, **engine)
    try:
        pieces = compilation_counter.num_piecewise_capturable_graphs_seen
        pieces -= before.num_piecewise_capturable_graphs_seen
        captured = compilation_counter.num_cudagraph_captured - before.num_cudagraph_captured
        assert pieces == 3 and captured == pieces * len(SIZES), (pieces, captured)
        assert _generate(llm) == expected
        replayed = compilation_counter.num_cudagraph_replayed - before.num_cudagraph_replayed
        # 13 steps: the first (32 tokens, above the sizes) runs the pieces as
        # they are; the 12 after it (3 tokens, the last 1) replay each piece.
        assert replayed == pieces * 12, replayed
        assert compilation_counter.num_cudagraph_captured - before.num_cudagraph_captured == (
            captured
        )
        # A first piece fed from anywhere but the fixed buffers: refused, not replayed stale.
        runner = _runner(llm)
        runner.input_ids_buffer = runner.input_ids_buffer.clone()
        with pytest.raises(Exception, match="an input moved since the capture"):
            _generate(llm)
    finally:
        llm.shutdown()


def test_no_capture_outside_capture_model() -> None:
    """A capture runs no kernels: a real step that captured would return garbage."""
    from tracevllm.compilation.cuda_graph import CUDAGraphWrapper
    from tracevllm.forward_context import set_forward_context

    wrapper = CUDAGraphWrapper(lambda x: x + 1, CUDAGraphMode.PIECEWISE)
    x = torch.zeros(4)
    with set_forward_context(None):
        assert torch.equal(wrapper(x), x + 1)  # mode NONE: the piece itself
    with (
        set_forward_context(
            None,
            cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE,
            batch_descriptor=BatchDescriptor(4),
        ),
        pytest.raises(RuntimeError, match="capture_model"),
    ):
        wrapper(x)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@needs_cuda
def test_piecewise_cuda_graphs_are_lossless_and_replayed(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.utils import make_tiny_llama

    # Its own tokenizer: a GPU machine need not have the default model.
    tiny_model_dir = make_tiny_llama(str(tmp_path / "model"), seed=0)
    monkeypatch.setenv("TRACEVLLM_CACHE_DIR", str(tmp_path / "cache"))
    engine = dict(
        max_num_batched_tokens=32,
        num_gpu_blocks_override=64,
        block_size=16,
        enable_prefix_caching=False,
        device="cuda",
    )
    before = compilation_counter.clone()
    compilation = {"mode": 3, "cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": SIZES}
    llm = LLM(
        tiny_model_dir, compilation_config=compilation, enable_multiprocessing=False, **engine
    )
    try:
        cc = llm.llm_engine.vllm_config.compilation_config
        assert cc.cudagraph_mode == CUDAGraphMode.PIECEWISE
        pieces = compilation_counter.num_piecewise_capturable_graphs_seen
        pieces -= before.num_piecewise_capturable_graphs_seen
        captured = compilation_counter.num_cudagraph_captured - before.num_cudagraph_captured
        assert captured == pieces * len(SIZES), (captured, pieces)
        replayed_before = compilation_counter.num_cudagraph_replayed
        got = _generate(llm)
        # Every decode step (1-4 tokens) replays each piece's graph.
        replayed = compilation_counter.num_cudagraph_replayed - replayed_before
        assert replayed >= pieces * (PARAMS.max_tokens - 1), replayed
        # No capture after start-up.
        assert (
            compilation_counter.num_cudagraph_captured - before.num_cudagraph_captured == captured
        )
    finally:
        llm.shutdown()
    # The eager engine after: the compiled one must start in a fresh process's
    # state (an earlier engine could have moved shared module state for it).
    eager = LLM(tiny_model_dir, enforce_eager=True, enable_multiprocessing=False, **engine)
    try:
        assert got == _generate(eager)
    finally:
        eager.shutdown()

"""vLLM's compiled path (compilation/): lossless, split at attention, cached, off when eager.

One Inductor compile for the whole module: the in-process compiled engine
compiles the tiny model's pieces into a fresh cache directory, and the
multiprocess engine that follows starts from that cache (a hit, seen in its
spans). Both must give the eager engine's greedy tokens on a workload with a
chunked prefill and a prefix-cache hit.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tracevllm import LLM, SamplingParams
from tracevllm.compilation.counter import CompilationCounter, compilation_counter
from tracevllm.config import CompilationMode
from tracevllm.engine.arg_utils import EngineArgs

NUM_LAYERS = 2  # the tiny model's
COMPILATION = {"mode": 3, "compile_sizes": [1]}
ENGINE = dict(max_num_batched_tokens=32, num_gpu_blocks_override=64, block_size=16)
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# 50 tokens: chunked over two steps by the 32-token budget.
LONG = list(range(100, 150))
# Its first 32 tokens again (two full blocks: a prefix-cache hit), then others.
PREFIX_HIT = LONG[:32] + list(range(300, 310))
SHORT = [7]


def _generate(llm: LLM) -> list[tuple[list[int], int]]:
    """Greedy tokens and cached tokens: LONG and SHORT together, then PREFIX_HIT."""
    first = llm.generate([{"prompt_token_ids": LONG}, {"prompt_token_ids": SHORT}], PARAMS)
    (second,) = llm.generate([{"prompt_token_ids": PREFIX_HIT}], PARAMS)
    return [(list(o.outputs[0].token_ids), o.num_cached_tokens) for o in [*first, second]]


@contextlib.contextmanager
def _cache_root(path: str) -> Iterator[None]:
    """TRACEVLLM_CACHE_DIR while an engine starts (it compiles at start-up)."""
    old = os.environ.get("TRACEVLLM_CACHE_DIR")
    os.environ["TRACEVLLM_CACHE_DIR"] = path
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRACEVLLM_CACHE_DIR"]
        else:
            os.environ["TRACEVLLM_CACHE_DIR"] = old


def _diff(after: CompilationCounter, before: CompilationCounter) -> dict[str, int]:
    return {k: v - getattr(before, k) for k, v in vars(after).items()}


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("compile-cache"))


@pytest.fixture(scope="module")
def eager_run(tiny_model_dir: str) -> tuple[list[tuple[list[int], int]], dict[str, int], Any]:
    before = compilation_counter.clone()
    llm = LLM(tiny_model_dir, enforce_eager=True, enable_multiprocessing=False, **ENGINE)
    try:
        out = _generate(llm)
        executor = llm.llm_engine.engine_core.engine_core.model_executor
        inner = executor.driver_worker.worker.model_runner.model.model  # LlamaModel
        return out, _diff(compilation_counter, before), inner
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def compiled_run(
    tiny_model_dir: str, cache_root: str
) -> tuple[list[tuple[list[int], int]], dict[str, int]]:
    before = compilation_counter.clone()
    with _cache_root(cache_root):
        llm = LLM(
            tiny_model_dir, compilation_config=COMPILATION, enable_multiprocessing=False, **ENGINE
        )
    try:
        return _generate(llm), _diff(compilation_counter, before)
    finally:
        llm.shutdown()


def test_enforce_eager_compiles_nothing(eager_run: Any) -> None:
    out, counted, inner = eager_run
    assert inner.do_not_compile
    assert not any(counted.values()), counted
    # The workload does what it is meant to: a prefix-cache hit on the last prompt.
    assert out[2][1] >= 32, out


def test_compiled_in_process_is_lossless_and_split_at_every_attention(
    eager_run: Any, compiled_run: Any
) -> None:
    eager_out = eager_run[0]
    out, counted = compiled_run
    assert out == eager_out
    assert counted["num_graphs_seen"] == 1
    # Cut before and after each layer's attention ops: L + 1 compiled pieces
    # and L splitting ones (vLLM counts both).
    assert counted["num_piecewise_capturable_graphs_seen"] == NUM_LAYERS + 1
    assert counted["num_piecewise_graphs_seen"] == 2 * NUM_LAYERS + 1
    # A fresh cache: each piece compiled by Inductor, for the general shape and size 1.
    assert counted["num_inductor_compiles"] == 2 * (NUM_LAYERS + 1)
    assert counted["num_compiled_artifacts_saved"] == 2 * (NUM_LAYERS + 1)


def test_second_start_multiprocess_hits_the_cache(
    tiny_model_dir: str, cache_root: str, eager_run: Any, compiled_run: Any, tmp_path: Any
) -> None:
    """A new engine process, same configs: every piece comes from the cache
    (its spans say so; no Inductor), and the tokens are still eager's."""
    from tracevllm.tracing.exporters import read_spans_jsonl

    with _cache_root(cache_root):
        llm = LLM(
            tiny_model_dir,
            compilation_config=COMPILATION,
            enable_multiprocessing=True,
            trace_detail="full",
            trace_dir=str(tmp_path),
            **ENGINE,
        )
    try:
        out = _generate(llm)
    finally:
        llm.shutdown()
    assert out == eager_run[0]
    spans = read_spans_jsonl(str(tmp_path / "spans.jsonl"))
    pieces = [s for s in spans if s.name == "CompilerManager.compile"]
    assert len(pieces) == 2 * (NUM_LAYERS + 1)
    assert all(s.attributes["tracevllm.compile.cache_hit"] for s in pieces)
    (backend,) = [s for s in spans if s.name == "VllmBackend.split_and_compile"]
    assert backend.attributes["tracevllm.compile.cache_hit"] is True
    assert backend.attributes["tracevllm.compile.num_pieces"] == 2 * NUM_LAYERS + 1
    assert [s for s in spans if s.name == "dynamo_capture"]
    # At run time the attention ops, run as Python between the compiled
    # pieces, still trace every layer; the layers' own spans are compiled away.
    layers = {s.attributes["tracevllm.layer"] for s in spans if s.name == "unified_attention"}
    assert layers == set(range(NUM_LAYERS))
    assert not [s for s in spans if s.name == "LlamaDecoderLayer.forward"]


def _config(tiny_model_dir: str, **kwargs: Any) -> Any:
    return EngineArgs(model=tiny_model_dir, **kwargs).create_engine_config()


def test_enforce_eager_resolution(tiny_model_dir: str) -> None:
    def resolved(**kwargs: Any) -> tuple[bool | None, CompilationMode | None]:
        config = _config(tiny_model_dir, **kwargs)
        return config.model_config.enforce_eager, config.compilation_config.mode

    # tracevllm's default: eager until the compiled path is shown faster.
    assert resolved() == (True, CompilationMode.NONE)
    assert resolved(compilation_config={"mode": 3}) == (False, CompilationMode.VLLM_COMPILE)
    assert resolved(enforce_eager=False) == (False, CompilationMode.VLLM_COMPILE)
    # vLLM's rule: enforce_eager forces mode NONE.
    assert resolved(enforce_eager=True, compilation_config={"mode": "VLLM_COMPILE"}) == (
        True,
        CompilationMode.NONE,
    )
    assert resolved(optimization_level=0) == (True, CompilationMode.NONE)
    assert resolved(optimization_level=3) == (False, CompilationMode.VLLM_COMPILE)
    config = _config(tiny_model_dir, compilation_config={"mode": 3})
    assert config.compilation_config.splitting_ops == [
        "tracevllm::unified_attention_with_output",
        "tracevllm::unified_kv_cache_update",
    ]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"compilation_config": {"mode": 7}}, "compilation_config.mode"),
        ({"compilation_config": {"mode": True}}, "compilation_config.mode"),
        ({"compilation_config": {"backend": "tvm"}}, "compilation_config.backend"),
        ({"compilation_config": {"compile_sizes": [0]}}, "compilation_config.compile_sizes"),
        ({"compilation_config": {"compile_sizes": [True]}}, "compilation_config.compile_sizes"),
        ({"compilation_config": {"compile_sizes": 4}}, "compilation_config.compile_sizes"),
        ({"compilation_config": {"splitting_ops": ["attn"]}}, "compilation_config.splitting_ops"),
        (
            {"compilation_config": {"cudagraph_mode": "SOMETIMES"}},
            "compilation_config.cudagraph_mode",
        ),
        ({"compilation_config": {"pass_config": {}}}, "'pass_config'"),
        ({"compilation_config": "[3]"}, "compilation_config"),
        ({"optimization_level": 5}, "optimization_level"),
        ({"enforce_eager": "yes"}, "enforce_eager"),
    ],
)
def test_bad_compilation_values_are_refused_naming_the_field(
    tiny_model_dir: str, kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        _config(tiny_model_dir, **kwargs)


def test_cache_key_covers_what_changes_the_compiled_code(tiny_model_dir: str) -> None:
    """A changed config, compiler or traced source is a miss (another
    directory); the same ones are a hit."""
    from tracevllm.compilation.caching import compute_cache_hash

    def key(code: str = "code", compiler: str = "inductor", **compilation: Any) -> str:
        config = _config(tiny_model_dir, compilation_config={**COMPILATION, **compilation})
        return compute_cache_hash(config, compiler, code)

    base = key()
    assert key() == base
    changed = [
        key(compile_sizes=[1, 8]),
        key(backend="eager"),
        key(splitting_ops=[]),
        key(inductor_compile_config={"epilogue_fusion": False}),
        key(code="other source"),
        key(compiler="another torch"),
    ]
    assert base not in changed and len(set(changed)) == len(changed)
    longer = _config(tiny_model_dir, compilation_config=COMPILATION, max_model_len=256)
    assert compute_cache_hash(longer, "inductor", "code") != base


@pytest.mark.parametrize("mode", [3, 2, 1])
def test_each_mode_with_the_eager_backend_is_lossless(
    tiny_model_dir: str, eager_run: Any, tmp_path: Any, mode: int
) -> None:
    """Dynamo's capture without Inductor, in one process after the other: mode
    3 splits and runs each piece as captured, modes 2 and 1 hand the whole
    graph over (1 keeping Dynamo's guards); each engine captures its own."""
    before = compilation_counter.clone()
    with _cache_root(str(tmp_path)):
        llm = LLM(
            tiny_model_dir,
            compilation_config={"mode": mode, "backend": "eager"},
            enable_multiprocessing=False,
            **ENGINE,
        )
    try:
        out = _generate(llm)
    finally:
        llm.shutdown()
    assert out == eager_run[0]
    counted = _diff(compilation_counter, before)
    assert counted["num_models_seen"] == 1
    assert counted["num_inductor_compiles"] == 0
    assert counted["num_graphs_seen"] == (1 if mode == 3 else 0)
    assert counted["num_eager_compiles"] == (NUM_LAYERS + 1 if mode == 3 else 0)
    assert counted["stock_torch_compile_count"] == (1 if mode == 1 else 0)

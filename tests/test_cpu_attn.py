"""The CPU attention kernel (kernels/csrc/cpu_attn.cpp) and the backend that calls it.

The kernel against the float64 naive attention of test_attention.py, on the
same paged cases; the CPU_ATTN backend's ``forward`` against the reference
backend's on mixed batches; the selector's default and its fallback when the
kernel cannot be built.
"""

from __future__ import annotations

import logging
import types
from pathlib import Path

import pytest
import torch

from kernels import cpu_attn
from tests.test_attention import build_case, naive_attention
from tracevllm import _custom_ops as ops

pytestmark = pytest.mark.skipif(
    not cpu_attn.cpu_kernels_available(), reason="the CPU attention kernel could not be built here"
)

CASES = [
    # (q_lens, seq_lens): decodes crossing pages, a one-token cache, mixed with prefills
    ([1, 1, 1, 1], [1, 16, 17, 40]),
    ([5, 1, 1, 3], [5, 17, 4, 19]),
    ([1, 9, 1, 2], [64, 40, 5, 2]),
]


def causal_pairs(q_len: int, seq_len: int) -> int:
    """The (query token, key) pairs a query attends, counted token by token: its
    i-th token (of q_len, the last at position seq_len - 1) sees seq_len - q_len + i + 1 keys."""
    return sum(seq_len - q_len + i + 1 for i in range(q_len))


def _run_kernel(c: dict, scale: float, small_query_limit: int = 0) -> torch.Tensor:
    out = torch.full_like(c["q"], float("nan"))
    ops.cpu_attention_with_kv_cache(
        c["q"], c["kv_cache"], out, c["qsl"], c["seq_lens"], scale, c["block_table"],
        small_query_limit,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)], ids=["mha", "gqa3", "gqa8"])
# 64 and 128: compiled for their size; 72: dot()'s 8-wide step after the 16-wide;
# 76 and 6: a scalar tail.
@pytest.mark.parametrize("head_size", [64, 128, 72, 76, 6])
@pytest.mark.parametrize("case", range(len(CASES)))
# In pairs (causal_pairs): 0, decodes only; 54, the 5 over 5 (15 pairs), 3 over 19 (54,
# though 3 x 19 = 57) and 2 over 2 (3) but not 9 over 40 (324); 53, all those but 3 over
# 19; 4096, all of them.
@pytest.mark.parametrize("limit", [0, 53, 54, 4096])
def test_kernel_matches_naive_and_leaves_longer_queries(
    block_size: int, heads: tuple[int, int], head_size: int, case: int, limit: int
) -> None:
    num_heads, num_kv_heads = heads
    q_lens, seq_lens = CASES[case]
    c = build_case(q_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, seed=case)
    scale = head_size**-0.5
    out = _run_kernel(c, scale, limit)
    for r, q_len in enumerate(q_lens):
        a, b = int(c["qsl"][r]), int(c["qsl"][r + 1])
        if q_len == 1 or causal_pairs(q_len, seq_lens[r]) <= limit:
            ref = naive_attention(c["q"][a:b], c["ks"][r], c["vs"][r], scale)
            torch.testing.assert_close(out[a:b], ref, atol=1e-5, rtol=1e-5)
        else:  # over the limit: the kernel leaves it to the caller
            assert out[a:b].isnan().all()


def test_kernel_takes_prompts_longer_than_a_tile_and_chunks_over_a_cache() -> None:
    """A prompt cut into several tiles (16 tokens each), a chunk whose first keys are
    cached, an empty query and a decode: each causal row as the naive attention's."""
    q_lens, seq_lens = [40, 17, 0, 1], [40, 50, 3, 9]
    c = build_case(q_lens, seq_lens, 9, 3, 64, 16, seed=8)
    out = _run_kernel(c, 0.125, 4096)
    for r in (0, 1, 3):
        a, b = int(c["qsl"][r]), int(c["qsl"][r + 1])
        ref = naive_attention(c["q"][a:b], c["ks"][r], c["vs"][r], 0.125)
        torch.testing.assert_close(out[a:b], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_size", [64, 128, 72])
def test_a_prompts_token_and_the_same_token_decoded_get_the_same_bits(head_size: int) -> None:
    """The kernel's arithmetic for a token depends only on its keys: the last token
    of a prompt and that token as a decode over the same cache agree bit for bit
    (a speculative verify and plain decoding attend the same)."""
    c = build_case([21], [30], 9, 3, head_size, 16, seed=9)
    prompt = _run_kernel(c, 0.125, 4096)
    for i in (0, 7, 20):  # the tokens at positions 9, 16 and 29
        one = {**c, "q": c["q"][i : i + 1].clone(), "qsl": torch.tensor([0, 1], dtype=torch.int32),
               "seq_lens": torch.tensor([30 - 20 + i], dtype=torch.int32)}  # fmt: skip
        torch.testing.assert_close(_run_kernel(one, 0.125), prompt[i : i + 1], atol=0, rtol=0)


@pytest.mark.parametrize("sharpness", [30.0, 1e3])
def test_kernel_softmax_holds_at_extreme_scores(sharpness: float) -> None:
    """Scores hundreds apart: the vectorized exp's range reduction and its floor
    at e^-87 (what it returns for far smaller weights) change nothing visible."""
    c = build_case([1] * 4, [9, 33, 40, 64], 4, 2, 64, 16, seed=5)
    c["q"] *= sharpness
    out = _run_kernel(c, 0.125)
    for r in range(4):
        ref = naive_attention(c["q"][r : r + 1], c["ks"][r], c["vs"][r], 0.125)
        torch.testing.assert_close(out[r : r + 1], ref, atol=1e-5, rtol=1e-5)


def test_kernel_reads_no_slot_past_seq_len() -> None:
    """Stale keys and values after a request's last token change nothing."""
    c = build_case([1, 1], [6, 7], 4, 2, 64, 4, seed=1)
    outs = []
    for fill in (0.0, 1e4):
        cache = c["kv_cache"].clone()
        for r, s in enumerate([6, 7]):
            last = int(c["block_table"][r, (s - 1) // 4])
            cache[last, :, (s - 1) % 4 + 1 :] = fill
        outs.append(_run_kernel({**c, "kv_cache": cache}, 0.125))
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


def test_kernel_splits_its_work_over_torchs_threads() -> None:
    """Same result on one thread and on two (the requests' tiles and KV heads split
    between them)."""
    c = build_case([1] * 6 + [33], [3, 30, 17, 64, 1, 9, 40], 9, 3, 64, 16, seed=4)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(_run_kernel(c, 0.125, 4096))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


def test_kernel_refuses_what_it_does_not_cover() -> None:
    c = build_case([1], [5], 4, 2, 64, 4, seed=2)
    with pytest.raises(RuntimeError, match="float32 only"):
        ops.cpu_attention_with_kv_cache(
            c["q"].double(), c["kv_cache"].double(), c["q"].double(), c["qsl"],
            c["seq_lens"], 0.125, c["block_table"],
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="int32"):
        ops.cpu_attention_with_kv_cache(
            c["q"], c["kv_cache"], c["q"].clone(), c["qsl"].long(), c["seq_lens"], 0.125,
            c["block_table"],
        )  # fmt: skip


def test_kernel_checks_the_tables_before_reading_the_cache() -> None:
    """A block id outside the cache, a seq_len past the table or a misshapen output:
    an error naming it, not a read of arbitrary memory."""
    c = build_case([1, 1], [20, 5], 4, 2, 64, 4, seed=6)
    num_blocks = c["kv_cache"].shape[0]
    bad_block = c["block_table"].clone()
    bad_block[0, 1] = num_blocks
    with pytest.raises(RuntimeError, match=f"block {num_blocks} of request 0"):
        _run_kernel({**c, "block_table": bad_block}, 0.125)
    too_long = c["seq_lens"].clone()
    too_long[1] = c["block_table"].shape[1] * 4 + 1
    with pytest.raises(RuntimeError, match="seq_len .* of request 1"):
        _run_kernel({**c, "seq_lens": too_long}, 0.125)
    with pytest.raises(RuntimeError, match="output must be query's shape"):
        ops.cpu_attention_with_kv_cache(
            c["q"], c["kv_cache"], c["q"][:1].clone(), c["qsl"], c["seq_lens"], 0.125,
            c["block_table"],
        )  # fmt: skip
    past = c["qsl"].clone()
    past[-1] = c["q"].shape[0] + 1
    with pytest.raises(RuntimeError, match="past the query"):
        _run_kernel({**c, "qsl": past}, 0.125)
    short = build_case([4], [6], 4, 2, 64, 4, seed=6)
    short["seq_lens"][0] = 3  # fewer keys than the query's tokens
    for limit in (4096, 0):  # taken or not, a query longer than its seq_len is refused
        with pytest.raises(RuntimeError, match="seq_len 3 of request 0 needs 4"):
            _run_kernel(short, 0.125, limit)
    no_heads = build_case([1], [5], 4, 2, 64, 4, seed=6)
    with pytest.raises(RuntimeError, match="positive multiple of num_kv_heads"):
        _run_kernel({**no_heads, "q": no_heads["q"][:, :0]}, 0.125)


# --- the backend --------------------------------------------------------------------------


def _forward(
    impl_cls: type, c: dict, q_lens: list[int], cpu_copies: bool = True, **impl_kwargs: object
) -> torch.Tensor:
    """``impl_cls``'s forward on case ``c``; ``cpu_copies=False``: metadata
    without the runner's CPU copies of query_start_loc and seq_lens."""
    from tracevllm.attention.backends.abstract import AttentionMetadata

    num_heads, head_size = c["q"].shape[1:]
    num_kv_heads = c["kv_cache"].shape[3]
    impl = impl_cls(num_heads, head_size, head_size**-0.5, num_kv_heads, **impl_kwargs)
    n = sum(q_lens)
    meta = AttentionMetadata(
        num_actual_tokens=n,
        max_query_len=max(q_lens),
        query_start_loc=c["qsl"],
        max_seq_len=int(c["seq_lens"].max()),
        seq_lens=c["seq_lens"],
        block_table=c["block_table"],
        slot_mapping=torch.full((n,), -1, dtype=torch.long),
        query_start_loc_cpu=c["qsl"] if cpu_copies else None,
        seq_lens_cpu=c["seq_lens"] if cpu_copies else None,
    )
    out = torch.full_like(c["q"], float("nan"))
    impl.forward(None, c["q"], None, None, c["kv_cache"], meta, out)
    return out


# With a prompt past SMALL_QUERY_LIMIT (181 tokens: 181 x 182 / 2 = 16471 pairs > 16384),
# one at it (180: 16290) and a chunk past it (20 over 900: 17790).
BACKEND_CASES = [*CASES, ([1, 181, 5, 180, 1, 20], [30, 181, 20, 180, 8, 900])]


@pytest.mark.parametrize("case", range(len(BACKEND_CASES)))
def test_backend_forward_matches_the_reference_backend(
    case: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decodes and small prefills through the kernel, the longer prompts through SDPA one
    by one: each row as the reference, and SDPA called for the long ones alone."""
    from tracevllm.attention.backends import cpu_attn as backend
    from tracevllm.attention.backends.torch_attn import TorchAttentionImpl

    q_lens, seq_lens = BACKEND_CASES[case]
    c = build_case(q_lens, seq_lens, 9, 3, 64, 16, seed=10 + case)
    sdpa_lens = []
    unified_attention = ops.unified_attention

    def counted(**kwargs: object) -> None:
        sdpa_lens.append(kwargs["max_query_len"])
        unified_attention(**kwargs)

    with monkeypatch.context() as m:
        m.setattr(backend.ops, "unified_attention", counted)
        got = _forward(backend.CPUAttentionImpl, c, q_lens)
    limit = backend.SMALL_QUERY_LIMIT
    assert sdpa_lens == [q for q, s in zip(q_lens, seq_lens) if causal_pairs(q, s) > limit]
    want = _forward(TorchAttentionImpl, c, q_lens)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_backend_reads_the_metadata_without_its_cpu_copies() -> None:
    """Metadata whose CPU copies are not set (another runner's): the same rows,
    the long prompt's route found from query_start_loc and seq_lens."""
    from tracevllm.attention.backends.cpu_attn import CPUAttentionImpl

    q_lens, seq_lens = BACKEND_CASES[-1]
    c = build_case(q_lens, seq_lens, 9, 3, 64, 16, seed=20)
    want = _forward(CPUAttentionImpl, c, q_lens)
    got = _forward(CPUAttentionImpl, c, q_lens, cpu_copies=False)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_backend_hands_what_the_kernel_does_not_cover_to_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sliding window, or a cache that is not fp32: the reference's forward, whole."""
    from tracevllm.attention.backends.cpu_attn import CPUAttentionImpl

    calls = []
    monkeypatch.setattr(ops, "cpu_attention_with_kv_cache", lambda *a: calls.append(a))
    c = build_case([1, 1], [20, 5], 4, 2, 64, 4, seed=3)
    want = naive_attention(c["q"][:1], c["ks"][0], c["vs"][0], 64**-0.5, sliding_window=8)
    got = _forward(CPUAttentionImpl, c, [1, 1], sliding_window=8)
    torch.testing.assert_close(got[:1], want, atol=1e-5, rtol=1e-5)
    half = {**c, "q": c["q"].double(), "kv_cache": c["kv_cache"].double()}
    assert not _forward(CPUAttentionImpl, half, [1, 1]).isnan().any()
    assert calls == []


def test_backend_names_the_launch_it_takes() -> None:
    """The trace's ``tracevllm.attention.launch``: the kernel, or the reference on a fallback."""
    from tracevllm.attention.backends.cpu_attn import CPUAttentionImpl

    c = build_case([1, 3], [20, 5], 4, 2, 64, 4, seed=7)
    impl = CPUAttentionImpl(4, 64, 0.125, 2)

    def meta_of(q_lens: list[int], seq_lens: list[int]) -> types.SimpleNamespace:
        qsl = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return types.SimpleNamespace(
            max_query_len=max(q_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=qsl,
            seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
        )  # fmt: skip

    meta = meta_of([1, 20], [2000, 1500])  # 20 x 1480 + 20 x 21 / 2 pairs > 16384
    assert impl.launch_name(meta).startswith("cpu_attention_with_kv_cache")
    assert "SDPA per long prefill" in impl.launch_name(meta)
    # Small prompts, decodes alone, and the two maxima from different requests.
    for m in (meta_of([20], [200]), meta_of([1, 1], [20000, 3]), meta_of([20, 1], [30, 2000])):
        assert impl.launch_name(m) == "cpu_attention_with_kv_cache (pages read in place)"
    windowed = CPUAttentionImpl(4, 64, 0.125, 2, sliding_window=8)
    assert windowed.launch_name(meta).startswith("unified_attention_torch")
    impl._kernel_covers(c["kv_cache"].double())  # a forward on a float64 cache
    assert impl.launch_name(meta).startswith("unified_attention_torch")


def test_the_maxima_never_hide_a_query_too_long_for_the_kernel() -> None:
    """The forward's cheap gate, from the step's two maxima: whenever it says no
    query can be too long, none is (random steps of queries no longer than their
    seq_lens, counted token by token); and metadata whose longest query outruns
    its longest seq_len still opens it."""
    import random

    from tracevllm.attention.backends import cpu_attn as backend

    rng = random.Random(0)
    for _ in range(2000):
        steps = []
        for _ in range(rng.randint(1, 4)):
            s = rng.randint(1, 1200)
            steps.append((rng.randint(1, min(s, 300)), s))
        meta = types.SimpleNamespace(
            max_query_len=max(q for q, _ in steps), max_seq_len=max(s for _, s in steps)
        )
        too_long = any(q > 1 and causal_pairs(q, s) > backend.SMALL_QUERY_LIMIT for q, s in steps)
        assert backend._may_take_long_prefills(meta) or not too_long, steps
    odd = types.SimpleNamespace(max_query_len=400, max_seq_len=200)
    assert backend._may_take_long_prefills(odd)


def test_selector_defaults_to_the_kernel_on_cpu_and_falls_back_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tracevllm.attention import selector

    assert selector.get_attn_backend(None, "cpu").get_name() == "CPU_ATTN"
    assert selector.get_attn_backend("cpu_attn", "cpu").get_name() == "CPU_ATTN"
    with pytest.raises(ValueError, match="CPU only"):
        selector.get_attn_backend("cpu_attn", "cuda")
    monkeypatch.setattr(selector, "cpu_kernels_available", lambda: False)
    assert selector.get_attn_backend(None, "cpu").get_name() == "TORCH_ATTN"
    with pytest.raises(ValueError, match="could not be built.*'torch'"):
        selector.get_attn_backend("cpu_attn", "cpu")


BUILD_FAILURES = {
    "no compiler": (
        "Error building extension 'x'\ng++: command not found",
        "g++: command not found",
    ),
    "compiler error": (
        "Error building extension 'x': [1/2] c++ -c cpu_attn.cpp\nFAILED: cpu_attn.o\n"
        "cpu_attn.cpp:20:10: fatal error: torch/library.h: No such file or directory\n"
        "compilation terminated.\nninja: build stopped: subcommand failed.",
        "fatal error: torch/library.h",
    ),
}


@pytest.mark.parametrize("failure", BUILD_FAILURES)
def test_a_failed_build_is_said_once_and_reported_unavailable(
    failure: str, monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """A failed build: a warning with the compiler's reason and what to install, and
    False (the reference is taken)."""
    import torch.utils.cpp_extension as cpp_extension

    message, reason = BUILD_FAILURES[failure]

    def failing_build(*args: object, **kwargs: object) -> None:
        raise RuntimeError(message)

    cpu_attn.cpu_kernels_available.cache_clear()
    try:
        with monkeypatch.context() as m:
            m.setattr(cpp_extension, "load", failing_build)
            m.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
            with caplog.at_level(logging.WARNING, logger="tracevllm.kernels.cpu_attn"):
                assert cpu_attn.cpu_kernels_available() is False
                assert cpu_attn.cpu_kernels_available() is False
        warnings = [r for r in caplog.records if "could not be built" in r.getMessage()]
        assert len(warnings) == 1
        assert reason in warnings[0].getMessage()
        assert "ninja" in warnings[0].getMessage()
    finally:
        cpu_attn.cpu_kernels_available.cache_clear()
    assert cpu_attn.cpu_kernels_available() is True  # the real build, from the cache again


def test_a_lock_left_by_a_killed_build_is_removed(
    monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """torch waits forever on a build lock whose build was killed: an old one is removed
    first (a fresh one, a build in progress elsewhere, is left to torch's wait)."""
    import os
    import time

    import torch.utils.cpp_extension as cpp_extension

    name, _ = cpu_attn._build_name_and_flags()
    lock = tmp_path / name / "lock"
    lock.parent.mkdir()
    seen = []
    cpu_attn.cpu_kernels_available.cache_clear()
    try:
        with monkeypatch.context() as m:
            m.setattr(cpp_extension, "load", lambda *a, **k: seen.append(lock.exists()))
            m.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
            lock.touch()
            assert cpu_attn.cpu_kernels_available() is True
            cpu_attn.cpu_kernels_available.cache_clear()
            old = time.time() - cpu_attn.STALE_LOCK_S - 1
            os.utime(lock, (old, old))
            with caplog.at_level(logging.WARNING, logger="tracevllm.kernels.cpu_attn"):
                assert cpu_attn.cpu_kernels_available() is True
        assert seen == [True, False]
        assert any("did not finish" in r.getMessage() for r in caplog.records)
    finally:
        cpu_attn.cpu_kernels_available.cache_clear()


def test_the_pip_installed_ninja_is_on_path_while_torch_builds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch runs ``ninja`` by name on every load: the venv's, not only a system one."""
    import os

    import ninja
    import torch.utils.cpp_extension as cpp_extension

    paths = []
    before = os.environ["PATH"]
    cpu_attn.cpu_kernels_available.cache_clear()
    try:
        with monkeypatch.context() as m:
            m.setattr(cpp_extension, "load", lambda *a, **k: paths.append(os.environ["PATH"]))
            m.setenv("PATH", "/usr/bin:/bin")
            assert cpu_attn.cpu_kernels_available() is True
            assert os.environ["PATH"] == "/usr/bin:/bin"  # put back after
        assert paths[0].split(os.pathsep)[0] == ninja.BIN_DIR
    finally:
        cpu_attn.cpu_kernels_available.cache_clear()
    assert os.environ["PATH"] == before


def test_bench_cpu_attn_times_both_reads_and_checks_they_agree(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """benchmarks/bench_cpu_attn.py, the reads alone, small: both sides timed, their
    outputs compared, the figures in its JSON (decodes, and prefills both ways)."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import bench_cpu_attn

    monkeypatch.setattr(bench_cpu_attn, "PREFILL_SHAPES", [("small", 3, 5, 20)])
    out = tmp_path / "cpu_attn.json"
    bench_cpu_attn.main(["--batch", "4", "--skip-engine", "--output-json", str(out)])
    res = json.loads(out.read_text())
    (read,) = res["read"]
    assert read["threads"] == 1 and read["batch"] == 4
    assert read["reference_ms"] > 0 and read["kernel_ms"] > 0
    assert read["speedup"] == pytest.approx(read["reference_ms"] / read["kernel_ms"])
    assert read["max_abs_diff"] < 1e-5
    (prefill,) = res["prefill"]
    assert (prefill["requests"], prefill["query_tokens"], prefill["seq_len"]) == (3, 5, 20)
    assert prefill["sdpa_ms"] > 0 and prefill["kernel_ms"] > 0
    assert prefill["speedup"] == pytest.approx(prefill["sdpa_ms"] / prefill["kernel_ms"])
    assert prefill["max_abs_diff"] < 1e-5

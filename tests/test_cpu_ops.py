"""The layers' C++ kernels (kernels/csrc/cpu_ops.cpp) and the CustomOp choice that calls them.

Each kernel against its layer's ``forward_native`` (the plain-PyTorch path,
itself held to HF by the model and family tests) on awkward shapes: sizes
with a scalar tail after the 8-wide steps, rows strided as the q/k/v split
leaves them, GQA. Then what the kernels refuse, the ``custom_ops`` flag
that picks a layer's path (vLLM's rule), and one engine both ways.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels import cpu_attn
from kernels.reshape_and_cache_flash import reshape_and_cache_flash_torch
from tracevllm import _custom_ops as ops
from tracevllm.compilation.config import CompilationConfig, CompilationMode
from tracevllm.compilation.config import resolve_compilation_config as resolve
from tracevllm.model_executor.layers.activation import SiluAndMul
from tracevllm.model_executor.layers.layernorm import RMSNorm
from tracevllm.model_executor.layers.rotary_embedding import (
    Llama3RotaryEmbedding,
    RotaryEmbedding,
)

pytestmark = pytest.mark.skipif(
    not cpu_attn.cpu_kernels_available(), reason="the CPU kernels could not be built here"
)

# 8-wide steps only (8, 64, 960), a scalar tail (1, 7, 17, 1000), both after a 16-wide step (23).
WIDTHS = [1, 7, 8, 17, 23, 64, 960, 1000]
ROWS = [1, 3, 64, 130]


def _strided_rows(rows: int, n: int, seed: int) -> torch.Tensor:
    """[rows, n] whose rows sit n + 5 floats apart, as a slice of a wider tensor."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, n + 5, generator=g)[:, :n]


@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_matches_the_native_path(n: int, rows: int) -> None:
    norm = RMSNorm(n, eps=1e-5)
    norm.weight.data = torch.randn(n, generator=torch.Generator().manual_seed(1))
    x = _strided_rows(rows, n, seed=n * rows)
    torch.testing.assert_close(norm.forward_cpu(x), norm.forward_native(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("rows", ROWS)
def test_fused_add_rms_norm_matches_the_native_path_in_place(n: int, rows: int) -> None:
    norm = RMSNorm(n, eps=1e-6)
    norm.weight.data = torch.randn(n, generator=torch.Generator().manual_seed(2))
    x, residual = _strided_rows(rows, n, seed=n), torch.randn(rows, n)
    want_out, want_residual = norm.forward_native(x.clone(), residual.clone())
    out, new_residual = norm.forward_cpu(x, residual)
    # vLLM's op works in place: the residual becomes the sum, x its norm.
    assert out.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(new_residual, want_residual, rtol=0, atol=0)  # one add, exact
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("d", [1, 7, 8, 16, 23, 2560])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_silu_and_mul_matches_the_native_path(d: int, rows: int) -> None:
    x = _strided_rows(rows, 2 * d, seed=d) * 6  # gates out to where silu bends
    x[0, 0] = 90.0  # e^-90 underflows: silu(90) is 90
    x[-1, min(1, d - 1)] = -90.0  # e^90 overflows: silu(-90) is -0
    act = SiluAndMul()
    torch.testing.assert_close(act.forward_cpu(x), act.forward_native(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("head_size", [64, 128, 80, 6])
@pytest.mark.parametrize("rope_cls", [RotaryEmbedding, Llama3RotaryEmbedding])
def test_rotary_embedding_matches_the_native_path_in_place(
    head_size: int, rope_cls: type[RotaryEmbedding]
) -> None:
    if rope_cls is Llama3RotaryEmbedding:
        rope = rope_cls(head_size, 2048, 500000.0, 8.0, 1.0, 4.0, 1024)
    else:
        rope = rope_cls(head_size, 2048, 10000.0)
    num_heads, num_kv_heads, tokens = 6, 2, 37
    g = torch.Generator().manual_seed(head_size)
    # q and k as LlamaAttention has them: column slices of the fused qkv.
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=g)
    q, k, _ = qkv.split([num_heads * head_size] + [num_kv_heads * head_size] * 2, dim=-1)
    positions = torch.randint(0, 2048, (tokens,), generator=g)
    positions[0], positions[-1] = 0, 2047
    want_q, want_k = rope.forward_native(positions, q.clone(), k.clone())
    got_q, got_k = rope.forward_cpu(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)


def test_rotary_embedding_gptj_style_and_a_partial_rotary_dim() -> None:
    """The op's other cases, which no layer of tracevllm asks for yet: GPT-J
    style (neighbours are pairs), a table narrower than the head (the rest of
    each head left as it was), and no key."""
    head_size, rot_dim, tokens = 16, 8, 5
    g = torch.Generator().manual_seed(3)
    table = torch.randn(10, rot_dim, generator=g)  # cosines, then sines: any numbers will do
    positions = torch.tensor([0, 9, 3, 3, 1])
    q = torch.randn(tokens, 2 * head_size, generator=g)
    cos, sin = table[positions, : rot_dim // 2], table[positions, rot_dim // 2 :]
    want = q.clone().view(tokens, 2, head_size)
    x1, x2 = want[..., 0:rot_dim:2].clone(), want[..., 1:rot_dim:2].clone()
    want[..., 0:rot_dim:2] = x1 * cos[:, None] - x2 * sin[:, None]
    want[..., 1:rot_dim:2] = x2 * cos[:, None] + x1 * sin[:, None]
    ops.rotary_embedding(positions, q, None, head_size, table, False)
    torch.testing.assert_close(q.view(tokens, 2, head_size), want, rtol=1e-6, atol=1e-6)


def test_reshape_and_cache_flash_matches_the_reference() -> None:
    num_blocks, block_size, heads, head_size, tokens = 6, 4, 3, 8, 9
    g = torch.Generator().manual_seed(4)
    kv = torch.randn(tokens, 2 * heads * head_size + 3, generator=g)  # strided, as the split
    key = kv[:, : heads * head_size].view(tokens, heads, head_size)
    value = kv[:, heads * head_size : 2 * heads * head_size].view(tokens, heads, head_size)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[2] = -1  # a padded token: not written
    want = torch.randn(num_blocks, 2, block_size, heads, head_size, generator=g)
    got = want.clone()
    reshape_and_cache_flash_torch(key, value, want, slots)
    ops.reshape_and_cache_flash(key, value, got, slots, backend="cpu")
    assert torch.equal(got, want)


def test_kernels_check_indices_before_reading_or_writing() -> None:
    """A position past the table or a slot past the cache raises (the
    reference's indexing does too) instead of touching memory it does not own."""
    table = torch.randn(10, 8)
    q = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="position 10 of token 1"):
        ops.rotary_embedding(torch.tensor([0, 10]), q, None, 8, table, True)
    with pytest.raises(RuntimeError, match="position -1"):
        ops.rotary_embedding(torch.tensor([-1, 0]), q, None, 8, table, True)
    cache = torch.zeros(2, 2, 4, 1, 8)
    kv = torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match="slot 8 of token 1"):
        ops.reshape_and_cache_flash(kv, kv, cache, torch.tensor([0, 8]), backend="cpu")
    assert not cache.any()  # checked before the first copy


def test_kernels_refuse_what_they_do_not_cover() -> None:
    w = torch.ones(8)
    with pytest.raises(RuntimeError, match="float32"):
        ops.rms_norm(torch.empty(2, 8, dtype=torch.float64), torch.randn(2, 8).double(), w, 1e-6)
    with pytest.raises(RuntimeError, match="2-D"):
        ops.rms_norm(torch.empty(2, 2, 8), torch.randn(2, 2, 8), w, 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.empty(2, 8), torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="2 \\* d"):
        ops.silu_and_mul(torch.empty(2, 3), torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="rot_dim"):
        ops.rotary_embedding(
            torch.tensor([0]), torch.randn(1, 8), None, 8, torch.randn(4, 16), True
        )


def test_kernels_refuse_empty_rows_and_overlapping_outputs() -> None:
    """Zero-width rows (a divide by zero in the chunk size, once) and written
    tensors that overlap themselves or an input (threads racing on one float)
    raise instead of crashing or racing."""
    with pytest.raises(RuntimeError, match="n > 0"):
        ops.rms_norm(torch.empty(2, 0), torch.empty(2, 0), torch.ones(0), 1e-6)
    with pytest.raises(RuntimeError, match="n > 0"):
        ops.silu_and_mul(torch.empty(2, 0), torch.empty(2, 0))
    with pytest.raises(RuntimeError, match="rot_dim 0"):
        ops.rotary_embedding(torch.tensor([0]), torch.randn(1, 8), None, 8, torch.randn(4, 0), True)
    with pytest.raises(RuntimeError, match="num_kv_heads"):
        kv = torch.randn(2, 0, 8)
        ops.reshape_and_cache_flash(kv, kv, torch.zeros(2, 2, 4, 0, 8), torch.tensor([0, 1]), "cpu")
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="single memory location"):
        ops.fused_add_rms_norm(x, x, torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="single memory location"):
        ops.rms_norm(torch.empty(1, 8).expand(3, 8), torch.randn(3, 8), torch.ones(8), 1e-6)
    qk = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="single memory location"):
        ops.rotary_embedding(torch.tensor([0, 1]), qk, qk, 8, torch.randn(4, 8), True)


def test_layers_take_the_native_path_for_what_the_kernels_do_not_cover() -> None:
    """bf16, a 3-D input (Qwen3's per-head norm), a column-strided tensor:
    ``forward_cpu`` gives the native result rather than an error."""
    norm = RMSNorm(8)
    x16 = torch.randn(3, 8, dtype=torch.bfloat16)
    norm16 = RMSNorm(8).to(torch.bfloat16)
    assert torch.equal(norm16.forward_cpu(x16), norm16.forward_native(x16))
    x3 = torch.randn(2, 3, 8)
    assert torch.equal(norm.forward_cpu(x3), norm.forward_native(x3))
    xt = torch.randn(8, 3).t()  # rows not contiguous
    assert torch.equal(norm.forward_cpu(xt), norm.forward_native(xt))
    act = SiluAndMul()
    g3 = torch.randn(2, 3, 8)
    assert torch.equal(act.forward_cpu(g3), act.forward_native(g3))


def _with_custom_ops(
    custom_ops: list[str], mode: CompilationMode = CompilationMode.NONE, device: str = "cpu"
) -> Any:
    from types import SimpleNamespace

    from tracevllm import config as config_module

    cfg = CompilationConfig(mode=mode, custom_ops=list(custom_ops))
    resolve(cfg, enforce_eager=mode == CompilationMode.NONE, device=device)
    current = SimpleNamespace(compilation_config=cfg, device_config=SimpleNamespace(device=device))
    return config_module.set_current_vllm_config(current)  # type: ignore[arg-type]


def test_layers_built_for_cuda_take_the_native_path() -> None:
    """The kernels are the CPU's: an engine on CUDA builds its layers with
    ``forward_native`` (and does not build the C++ for them)."""
    with _with_custom_ops([], device="cuda"):
        assert RMSNorm(8)._forward_method.__name__ == "forward_native"


@pytest.mark.parametrize(
    "custom_ops, mode, rms_norm_path, silu_path",
    [
        ([], CompilationMode.NONE, "forward_cpu", "forward_cpu"),  # eager: "all"
        ([], CompilationMode.VLLM_COMPILE, "forward_native", "forward_native"),  # "none"
        (["none"], CompilationMode.NONE, "forward_native", "forward_native"),
        (["-rms_norm"], CompilationMode.NONE, "forward_native", "forward_cpu"),
        (["none", "+silu_and_mul"], CompilationMode.NONE, "forward_native", "forward_cpu"),
    ],
)
def test_custom_ops_picks_each_layers_path_as_vllm_does(
    custom_ops: list[str], mode: CompilationMode, rms_norm_path: str, silu_path: str
) -> None:
    with _with_custom_ops(custom_ops, mode):
        norm, act = RMSNorm(8), SiluAndMul()
    assert norm._forward_method.__name__ == rms_norm_path
    assert act._forward_method.__name__ == silu_path


@pytest.mark.parametrize(
    "custom_ops",
    [["all", "none"], ["rms_norm"], ["+"], "all", [1], ["all", "all"], ["+rms_norm", "-rms_norm"]],
)
def test_custom_ops_is_checked_at_the_entry(custom_ops: Any) -> None:
    with pytest.raises(ValueError, match="custom_ops"):
        CompilationConfig(custom_ops=custom_ops)


def test_an_engine_gives_the_same_tokens_either_way(
    tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny model's greedy tokens and log-probabilities with every layer's
    kernel and with none (``custom_ops=["none"]``): the first engine called
    each kernel, the second none."""
    from collections import Counter

    from tracevllm import LLM, SamplingParams

    names = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding")
    calls: Counter[str] = Counter()
    for name in names:
        real = getattr(ops, name)

        def counted(*args: Any, _real: Any = real, _name: str = name) -> None:
            calls[_name] += 1
            _real(*args)

        monkeypatch.setattr(ops, name, counted)
    prompts = [{"prompt_token_ids": [1, 5, 9, 200, 17, 3] * (i + 1)} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    tokens, logprobs, counts = [], [], []
    for custom_ops in (["all"], ["none"]):
        calls.clear()
        with LLM(
            tiny_model_dir,
            enable_multiprocessing=False,
            compilation_config={"custom_ops": custom_ops},
        ) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
        counts.append({name: calls[name] for name in names})
        tokens.append([o.outputs[0].token_ids for o in outs])
        logprobs.append(
            [
                lp[t].logprob
                for o in outs
                for lp, t in zip(o.outputs[0].logprobs or [], o.outputs[0].token_ids, strict=True)
            ]
        )
    assert all(n > 0 for n in counts[0].values()), counts[0]
    assert not any(counts[1].values()), counts[1]
    assert tokens[0] == tokens[1]
    torch.testing.assert_close(
        torch.tensor(logprobs[0]), torch.tensor(logprobs[1]), atol=1e-4, rtol=0
    )


def test_bench_layer_ops_times_both_paths_of_every_op(tmp_path) -> None:
    """benchmarks/bench_layer_ops.py, the ops alone, small: each op timed both
    ways, the per-step sum from them, the figures in its JSON."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import bench_layer_ops

    out = tmp_path / "layer_ops.json"
    argv = ["--threads", "1", "--batch", "4", "--prefill", "8", "--skip-engine"]
    bench_layer_ops.main([*argv, "--output-json", str(out)])
    runs = json.loads(out.read_text())["ops"]
    assert [(r["threads"], r["rows"]) for r in runs] == [(1, 4), (1, 8)]
    for run in runs:
        for path in ("native", "cpu"):
            us = run["us"][path]
            per_layer = 2 * us["add_rms_norm"] + us["silu_and_mul"] + us["rotary_embedding"]
            per_layer += us["kv_write"]
            assert min(us.values()) > 0
            assert us["step_ms"] == pytest.approx(per_layer * 30 / 1e3)

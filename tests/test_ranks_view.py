"""The Ranks view: which worker holds which heads, layers and KV pages, drawn
from a real run's spans.

``tracevllm trace`` on the tiny Llama (4 query heads, 2 KV heads, 2 layers,
head size 16) in a child process, at the default detail: T = 2 by P = 2 (the
heads split in two, the layers one a stage) and T = 4 (one query head a rank,
each KV head on two ranks, as QKVParallelLinear copies it). Each worker's
resource says what it holds; its KV write span gives its cache's pages (a
stage after the first traces none at this detail, and takes its engine's
count: every rank gets the same KV cache config).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from rich.console import Console

from tests.utils import REPO_ROOT

BLOCK_SIZE = 4
HEAD_SIZE = 16  # hidden 64 / 4 heads


def _trace(model: str, out_dir: str, tp: int, pp: int) -> list[Any]:
    from tracevllm.tracing.exporters import read_spans_jsonl

    proc = subprocess.run(
        [sys.executable, "-m", "tracevllm.entrypoints.cli", "trace", "--prompt", "Hi there",
         "--raw", "--max-tokens", "2", "--model", model, "-tp", str(tp), "-pp", str(pp),
         "--block-size", str(BLOCK_SIZE), "--out", out_dir],
        capture_output=True, text=True, timeout=400, cwd=REPO_ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_spans_jsonl(f"{out_dir}/spans.jsonl")


@pytest.fixture(scope="module")
def tp2_pp2(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    return _trace(tiny_model_dir, str(tmp_path_factory.mktemp("tp2pp2")), 2, 2)


@pytest.fixture(scope="module")
def tp4(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    return _trace(tiny_model_dir, str(tmp_path_factory.mktemp("tp4")), 4, 1)


def _text(spans: list[Any]) -> str:
    from tracevllm.views.ranks import render_ranks

    console = Console(record=True, width=140, color_system=None)
    console.print(render_ranks(spans))
    return console.export_text()


def _kv_bytes(num_blocks: int, kv_heads: int, layers: int) -> int:
    # K and V, a page's slots, the rank's KV heads, head size, fp32, its layers.
    return num_blocks * 2 * BLOCK_SIZE * kv_heads * HEAD_SIZE * 4 * layers


@pytest.mark.timeout(600)
def test_tp2_pp2_each_rank_its_heads_and_stage(tp2_pp2: list[Any]) -> None:
    from tracevllm.views.ranks import rank_rows

    rows = rank_rows(tp2_pp2)
    assert [(r.rank, r.tp_rank, r.pp_rank) for r in rows] == [
        (0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)
    ]  # fmt: skip
    # Rank 0 of each stage: query heads 0-1 and KV head 0; rank 1: 2-3 and 1.
    assert [r.q_heads for r in rows] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert [r.kv_heads for r in rows] == [[0], [1], [0], [1]]
    assert [r.kv_head_replicas for r in rows] == [1] * 4
    assert [r.layer_range for r in rows] == [[0, 1], [0, 1], [1, 2], [1, 2]]
    # Stage 0 traced its layer 0's KV write: its own tensor, one KV head a rank.
    for r in rows[:2]:
        assert r.kv_cache_shape is not None
        assert r.kv_cache_shape[2:] == [BLOCK_SIZE, 1, HEAD_SIZE]
        assert r.pages  # the pages the prompt was written to
    num_blocks = rows[0].kv_cache_shape[0]  # type: ignore[index]
    assert num_blocks > 1
    for r in rows:
        assert r.num_blocks == num_blocks
        assert r.kv_cache_bytes == _kv_bytes(num_blocks, kv_heads=1, layers=1)
    text = _text(tp2_pp2)
    assert "0–1 of 4" in text and "2–3 of 4" in text and "0 of 2" in text and "1 of 2" in text
    assert "copy on" not in text


@pytest.mark.timeout(600)
def test_tp4_kv_heads_copied_to_two_ranks_each(tp4: list[Any]) -> None:
    from tracevllm.views.ranks import rank_rows

    rows = rank_rows(tp4)
    assert [(r.rank, r.tp_rank, r.pp_rank) for r in rows] == [(i, i, 0) for i in range(4)]
    assert [r.q_heads for r in rows] == [[0], [1], [2], [3]]
    # Two KV heads over four ranks: ranks 0-1 hold a copy of head 0, 2-3 of head 1.
    assert [r.kv_heads for r in rows] == [[0], [0], [1], [1]]
    assert [r.kv_head_replicas for r in rows] == [2] * 4
    assert [r.layer_range for r in rows] == [[0, 2]] * 4
    for r in rows:
        assert r.kv_cache_shape is not None and r.kv_cache_shape[3] == 1
        assert r.num_blocks == r.kv_cache_shape[0]
        assert r.kv_cache_bytes == _kv_bytes(r.num_blocks, kv_heads=1, layers=2)
    text = _text(tp4)
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("W")}
    assert "0 of 2, copy on W1" in lines["W0"] and "0 of 2, copy on W0" in lines["W1"]
    assert "1 of 2, copy on W3" in lines["W2"] and "1 of 2, copy on W2" in lines["W3"]

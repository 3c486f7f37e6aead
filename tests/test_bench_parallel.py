"""``make bench-parallel`` (benchmarks/bench_parallel.py) in its smallest mode.

Not a timed test: the smoke run (T = 1 and 2, and P = 2 with and without
the batch queue, on a tiny Llama, 2 prompts x 4 tokens, one all-reduce size)
runs in a child process under a timeout, and its figures are checked to be
what they say: the collectives counted are rank 0's, one per all-reduce and
all-gather of every forward; none at T = 1; the times positive and the
collectives' inside the runner's; without the batch queue one step in flight
and the two stages never inside a forward at once, with it two steps in
flight and the stages overlapping. The cluster arithmetic is checked against
numbers worked by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_parallel.py"


def _bench() -> ModuleType:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_parallel
    finally:
        sys.path.pop(0)
    return bench_parallel


@pytest.mark.timeout(900)
def test_smoke_run_counts_what_it_says(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--output-json", str(out)],
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "160"},
        capture_output=True,
        text=True,
        timeout=840,  # minutes under load: four engines started, each in its own processes
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    t1, t2, pp_off, pp_on = result["layouts"]
    assert (t1["layout"]["tp"], t2["layout"]["tp"]) == (1, 2)
    for r in (t1, t2):
        assert r["error"] is None
        assert r["tokens"] == 2 * 4  # every token asked for (ignore_eos)
        # Both prompts in one batch: a prefill, then three decodes.
        assert r["steps"] == 4 and r["seconds"] > 0 and r["runner_ms"] > 0
    # The tiny model has 4 layers: per forward, rank 0 runs the embedding's
    # all-reduce, two per layer, and the logits' all-gather; T = 1 none.
    assert t1["comm_calls"] == 0 and t1["comm_ms"] == 0
    assert t2["comm_calls"] == t2["steps"] * (1 + 2 * 4 + 1)
    assert 0 < t2["comm_ms"] < t2["runner_ms"]
    # P = 2: the same tokens either way; the batch queue is what lets the
    # stages run at once (EngineCore.step keeps one step in flight).
    assert (pp_off["layout"]["batch_queue"], pp_on["layout"]["batch_queue"]) == (False, True)
    for r in (pp_off, pp_on):
        assert r["error"] is None and r["layout"]["pp"] == 2
        assert r["tokens"] == 2 * 4 and r["steps"] > 0
        assert len(r["stage_busy"]) == 2 and all(0 < b < 1 for b in r["stage_busy"])
    assert pp_off["in_flight"] == 0 and pp_off["overlap_ms"] == 0
    assert pp_on["in_flight"] == 2 and pp_on["overlap_ms"] > 0
    [row] = result["collectives"]
    assert row["bytes"] == 8 << 10
    assert min(row["all_reduce_s"], row["send_recv_s"], row["send_recv_tensor_dict_s"]) > 0
    # The report: the engine's table, the collectives, the cluster arithmetic.
    text = proc.stdout
    shown = ["noisy", "The engine at each layout", "Collectives alone", "Llama-3-70B",
             "TP wins inside a node", "PP wins across slow links", "DP costs memory",
             "P=2, arithmetic", "P=2, here"]  # fmt: skip
    assert [s for s in shown if s not in text] == []


def test_overlap_of_two_stages_by_hand() -> None:
    overlap_ns = _bench().overlap_ns
    assert overlap_ns([(0, 10), (20, 30)], [(10, 20), (30, 40)]) == 0  # taking turns
    assert overlap_ns([(0, 10), (20, 30)], [(5, 25)]) == 5 + 5
    assert overlap_ns([(0, 100)], [(10, 20), (30, 40), (90, 120)]) == 10 + 10 + 10
    assert overlap_ns([], [(0, 1)]) == 0


def test_cluster_arithmetic_by_hand() -> None:
    bench = _bench()
    # Llama-3-8B: two all-reduces of hidden 4096 in bf16 per layer: 16 KiB a token.
    assert bench.allreduce_bytes_per_layer(1, 4096) == 2 * 4096 * 2 == 16384
    assert bench.allreduce_bytes_per_layer(64, 8192) == 64 * 32768
    # A ring all-reduce puts 2 (T - 1) / T of the buffer on each link.
    assert bench.ring_seconds(1e9, 2, 1e9) == pytest.approx(1.0)
    assert bench.ring_seconds(1e9, 8, 1e9) == pytest.approx(1.75)
    # Decode is memory-bound: 8B in bf16 at T = 2 reads 8 GB a GPU at 3.35 TB/s.
    assert bench.forward_seconds(8e9, 1, 2) == pytest.approx(8e9 / 3.35e12)
    # A long prefill is compute-bound: 2 x params x tokens / T FLOPs.
    assert bench.forward_seconds(8e9, 8192, 2) == pytest.approx(2 * 8e9 * 8192 / 2 / 989e12)

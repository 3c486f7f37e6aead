"""``make bench`` / ``make bench-serve``'s pieces: the floor, the conditions, the ratios.

The arithmetic is checked against numbers worked by hand; the condition loop
with engines that only look at the machine (is a busy loop running beside
them?); then benchmarks/bench_throughput.py's ``main`` on the tiny model's
shapes with such an engine, whose JSON must say what it measured. No figure
here is a benchmark: the machine is shared.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_serve  # noqa: E402
import bench_throughput as bt  # noqa: E402
import busy  # noqa: E402
from roofline import model_shapes  # noqa: E402

# A model worked by hand: 1000 weights in its layers' linears, 300 in its LM head.
HAND = {"linear_params": 1000, "lm_head_params": 300, "attn_flops_per_pair": 7,
        "weight_bytes": 0, "kv_bytes_per_token": 0}  # fmt: skip


def test_linear_flops_by_hand() -> None:
    """(10 prompt, 5 generated): 14 tokens through the layers, 5 LM-head rows:
    2 x (1000 x 14 + 300 x 5) = 31000; (3, 1): 2 x (1000 x 3 + 300 x 1) = 6600."""
    assert bt.linear_flops(HAND, [(10, 5)]) == 31000
    assert bt.linear_flops(HAND, [(3, 1)]) == 6600
    assert bt.linear_flops(HAND, [(10, 5), (3, 1)]) == 37600
    # 4 of those prompt tokens from a prefix cache: 2 x 1000 x 4 fewer.
    assert bt.linear_flops(HAND, [(10, 5), (3, 1)], cached_tokens=4) == 29600
    # 37600 FLOP at 0.0376 GFLOP/s: one millisecond.
    assert math.isclose(bt.floor_seconds(37600, 0.0376), 1e-3)


def test_roofline_floor_by_hand() -> None:
    """Two requests, (prompt 3, generate 3) and (2, 1), at 1000 FLOP/s and
    1000 B/s, weights 4000 B, K/V 10 B a token. The prompt step: 2 x (1000 x 5
    + 300 x 2) + 7 x (6 + 3) pairs = 11263 FLOP (11.263 s) against 4050 B;
    decode step 1, the first request alone at context 4: 2628 FLOP against
    4000 + 10 x 5 B (4.05 s, memory-bound); step 2 at context 5: 4.06 s. The
    second request, one token, never decodes. Two cached prompt tokens take
    2 x (1000 x 2 + 0) FLOP off the prompt step. Mutations caught: max
    turned into the compute term alone (the decode steps at 2.6 s)."""
    m = {**HAND, "weight_bytes": 4000, "kv_bytes_per_token": 10}
    reqs = [(3, 3), (2, 1)]
    assert bt.roofline_seconds(m, reqs, 1e-6, 1e-6) == pytest.approx(11.263 + 4.05 + 4.06)
    assert bt.roofline_seconds(m, reqs, 1e-6, 1e-6, 2) == pytest.approx(7.263 + 4.05 + 4.06)
    assert bt.roofline_seconds(m, [], 1e-6, 1e-6) == pytest.approx(4.0)  # an empty step


def test_linears_at_shapes_by_hand() -> None:
    """(3 prompt, 3 generated), (2, 3), (4, 1): the prompt step 9 rows and 3 logits,
    then decode step 1 the first two requests (2, 2), step 2 the same two (2, 2)
    again, timed once; the third request's one token came from the prompt step.
    Timed by their FLOPs, the steps add up to linear_flops, cached prompt tokens
    left out of both. Mutations caught: ``g >= k`` (a third decode step), the
    logits rows of the prompt step as its rows."""
    calls: list[tuple[int, int]] = []

    def time_linears(rows: int, logits: int) -> float:
        calls.append((rows, logits))
        return 10 * rows + logits

    reqs = [(3, 3), (2, 3), (4, 1)]
    assert bt.linears_at_shapes(reqs, time_linears) == 93 + 22 + 22
    assert calls == [(9, 3), (2, 2)]

    def flops(rows: int, logits: int) -> float:  # "seconds" that are a step's FLOPs
        return 2 * (HAND["linear_params"] * rows + HAND["lm_head_params"] * logits)

    assert bt.linears_at_shapes(reqs, flops) == bt.linear_flops(HAND, reqs)
    assert bt.linears_at_shapes(reqs, flops, 2) == bt.linear_flops(HAND, reqs, 2)


def test_linears_seconds_runs_every_linear(tiny_model_dir: str) -> None:
    """One timed forward: every layer's own four linears at ``rows`` rows of their
    input width, then the LM head at ``logits`` rows, each once a repeat (after
    best_of's warm-up call), and every layer's weights its own tensors (so they
    come from memory)."""
    import roofline

    m = model_shapes(tiny_model_dir)
    layers, head = roofline.packed_linears(m)
    assert len(layers) == m["num_layers"] == 2
    assert [(lin.output_size, lin.input_size) for lin in layers[0].values()] == list(
        m["per_layer"].values()
    )
    assert layers[0]["qkv_proj"].weight is not layers[1]["qkv_proj"].weight
    calls: list[tuple[str, tuple[int, ...]]] = []

    class Recorded:
        """A linear that notes each call's name and input shape."""

        def __init__(self, name: str, linear: Any) -> None:
            self.name, self.linear, self.input_size = name, linear, linear.input_size

        def __call__(self, x: Any) -> Any:
            calls.append((self.name, tuple(x.shape)))
            return self.linear(x)

    rec = roofline.PackedLinears(
        [{n: Recorded(n, lin) for n, lin in layer.items()} for layer in layers],
        Recorded("lm_head", head),
    )
    seconds = roofline.linears_seconds(rec, 3, 2, 1)
    assert seconds > 0
    widths = {n: in_f for n, (_, in_f) in m["per_layer"].items()}
    expected = [(n, (3, widths[n])) for _ in range(2) for n in m["per_layer"]]
    assert calls == 2 * (expected + [("lm_head", (2, m["lm_head"][1]))])
    calls.clear()
    roofline.linears_seconds(rec, 3, 0, 1)
    assert calls == 2 * expected  # no logits rows: the LM head is left out


def test_tiny_model_shapes_by_hand(tiny_model_dir: str, tokenizer: Any) -> None:
    """The tiny Llama (hidden 64, intermediate 128, 4 query / 2 KV heads of 16, 2 layers):
    qkv 128 x 64 + o 64 x 64 + gate_up 256 x 64 + down 64 x 128 = 36864 a layer, 73728
    in all; the LM head vocab x 64. (10, 5) then costs 2 x (73728 x 14 + 64 V x 5)."""
    m = model_shapes(tiny_model_dir)
    vocab = len(tokenizer)
    assert m["linear_params"] == 73728
    assert m["lm_head_params"] == 64 * vocab
    assert m["name"] == os.path.basename(tiny_model_dir)
    assert bt.linear_flops(m, [(10, 5)]) == 2 * (73728 * 14 + 64 * vocab * 5)


def test_summary_ratios_by_hand() -> None:
    """tracevllm 100 and 200 tok/s (floor shares 0.5 and 1.0): mean 150, share 0.75;
    against vLLM compiled's 100 tok/s 1.5x, eager's 50 tok/s 3x."""
    runs = [
        bt.Run("first", "tracevllm", 100, 1.0, 0.1, 0.2, 0.5),
        bt.Run("eager", "vllm_eager", 100, 2.0, 0.2, 0.3, 0.25),
        bt.Run("compiled", "vllm_compiled", 100, 1.0, 0.3, 0.4, 0.5),
        bt.Run("second", "tracevllm", 100, 0.5, 0.4, 0.5, 1.0),
    ]
    s = bt.summarize(runs)
    assert s["tracevllm_tok_s"] == 150
    assert s["floor_share"] == 0.75
    assert s["ratio_vs_vllm_compiled"] == 1.5
    assert s["ratio_vs_vllm_eager"] == 3.0
    assert s["vllm_eager_tok_s"] == 50


def test_tracing_cost_by_hand() -> None:
    """Each round against its own off: 0.98, 0.95, 0.99 -> median 0.98 -> -2 %."""
    rates = {"off": [100.0, 200.0, 100.0], "request": [98.0, 190.0, 99.0],
             "full": [50.0, 100.0, 60.0]}  # fmt: skip
    cost = bt.tracing_cost(rates)
    assert set(cost) == {"request", "full"}
    assert math.isclose(cost["request"], -0.02)
    assert math.isclose(cost["full"], -0.5)
    orders = [bt.tracing_order(r) for r in range(3)]
    assert orders == [["off", "request", "full"], ["request", "full", "off"],
                      ["full", "off", "request"]]  # fmt: skip


def test_parse_conditions() -> None:
    assert busy.parse_conditions("quiet,busy") == ["quiet", "busy"]
    assert busy.parse_conditions("busy") == ["busy"]
    for bad in ("", "loud", "quiet,quiet", "quiet,loud"):
        with pytest.raises(ValueError, match="--conditions"):
            busy.parse_conditions(bad)


def test_run_queue_sampler_and_machine() -> None:
    """bench_threads' run-queue mean: samples taken while in the block, none after."""
    import time

    with busy.RunQueueSampler(interval=0.01) as queue:
        time.sleep(0.2)
    n = len(queue.samples)
    time.sleep(0.05)
    assert n >= 3 and len(queue.samples) == n
    assert queue.mean >= 1  # this process was running while it sampled
    m = busy.machine()
    assert m["cores"] == os.cpu_count() and len(m["load_average_at_start"]) == 3


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="no /proc/stat here")
def test_steal_is_read_from_proc_stat_by_hand() -> None:
    """/proc/stat's cpu line: user nice system idle iowait irq softirq steal
    (guest and guest_nice are inside user and nice, not added again); the
    share between two readings; nothing to read is (0, 0) and nan, not an error."""
    before = busy.cpu_jiffies("cpu  100 0 50 800 10 0 5 35 7 0\ncpu0 1 2 3 4 5 6 7 8\n")
    after = busy.cpu_jiffies("cpu  160 0 70 900 10 0 5 55 9 0\n")
    assert before == (35, 1000) and after == (55, 1200)
    assert busy.steal_share(before, after) == pytest.approx(0.1)
    assert busy.cpu_jiffies("intr 5\n") == (0, 0)
    assert math.isnan(busy.steal_share((0, 0), (0, 0)))
    assert busy.fmt_steal(0.1) == ", steal 10%" and busy.fmt_steal(0.001) == ""
    steal, total = busy.cpu_jiffies()  # this machine's
    assert total > 0 and 0 <= steal <= total
    with busy.under("quiet", settle_s=0) as load:
        pass
    assert 0 <= load.steal <= 1 or math.isnan(load.steal)


def _busy_loops() -> int:
    """This process's children running the busy loop."""
    n = 0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            n += busy.BUSY_LOOP in " ".join(child.cmdline())
    return n


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_killed_benchmark_leaves_no_busy_loop_behind() -> None:
    """A benchmark killed inside a busy run (SIGKILL: no finally runs) takes
    its busy loop with it. Mutation caught: the prctl line dropped from the
    loop's script (the loop outlived a killed benchmark and halved the next
    runs' figures)."""
    script = (
        "import sys, time; sys.path.insert(0, 'benchmarks'); import busy\n"
        # settle_s: the loop is past its two lines before the kill (were it
        # not, the parent check alone would end it).
        "with busy.busy_core(True, settle_s=0.5):\n"
        "    print('in', flush=True); time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    loops: list[psutil.Process] = []
    try:
        assert parent.stdout is not None and parent.stdout.readline() == "in\n"
        loops = psutil.Process(parent.pid).children()
        assert len(loops) == 1
        parent.kill()
        parent.wait(timeout=10)
        # Gone, or a zombie where no init reaps orphans (a container's PID 1).
        deadline = time.monotonic() + 10
        while _running(loops[0]):
            assert time.monotonic() < deadline, "the busy loop outlived its benchmark"
            time.sleep(0.05)
    finally:
        parent.kill()
        for loop in loops:
            with contextlib.suppress(psutil.NoSuchProcess):
                loop.kill()


def test_condition_loop_runs_each_engine_beside_its_own_busy_loop() -> None:
    """Conditions outermost, engines in order; a busy loop runs during each busy
    run (and only then), and is gone once the loop ends."""
    seen: list[tuple[str, int]] = []

    def engine(name: str, seconds: float, cached: int | None) -> Any:
        def run() -> tuple[float, int, int | None]:
            seen.append((name, _busy_loops()))
            return seconds, 10, cached

        return run

    # Each run's floor from its own prefix-cache hits: 0.5 s less 0.1 s a hit
    # token; one that does not say (None) gets the whole 0.5 s.
    engines = [("ours", "tracevllm", engine("ours", 1.0, 4)),
               ("theirs", "vllm_compiled", engine("theirs", 2.0, None))]  # fmt: skip
    reported: list[tuple[str, str]] = []
    out = bt.run_conditions(["quiet", "busy"], engines,
                            floor=lambda c: 0.5 if c is None else 0.5 - 0.1 * c,
                            report=lambda c, r: reported.append((c, bt._fmt_run(c, r))),
                            settle_s=0.05)  # fmt: skip
    assert seen == [("ours", 0), ("theirs", 0), ("ours", 1), ("theirs", 1)]
    assert [(c, line.split(":")[0].split()[-1]) for c, line in reported] == [
        ("quiet", "ours"), ("quiet", "theirs"), ("busy", "ours"), ("busy", "theirs")]  # fmt: skip
    assert "of its floor 0.10 s (4 prompt tokens from the prefix cache)" in reported[0][1]
    assert "of its floor 0.50 s (prefix-cache hits not reported" in reported[1][1]
    assert _busy_loops() == 0
    assert [r.cached_tokens for r in out["busy"]] == [4, None]
    assert [r.floor_s for r in out["busy"]] == pytest.approx([0.1, 0.5])
    assert [r.floor_share for r in out["busy"]] == pytest.approx([0.1, 0.25])
    assert all(r.load_start >= 0 and r.load_end >= 0 for rs in out.values() for r in rs)
    assert all(r.steal is not None for rs in out.values() for r in rs)  # busy.Load's, kept
    assert bt.summarize(out["busy"])["ratio_vs_vllm_compiled"] == 2.0


def test_bench_serve_conditions_and_ratios() -> None:
    """bench_serve: each server under each condition, beside its own busy loop;
    tracevllm's output tok/s over each vLLM server's, per condition."""
    rates = {("quiet", "tracevllm"): 120.0, ("quiet", "vllm_compiled"): 100.0,
             ("busy", "tracevllm"): 90.0, ("busy", "vllm_compiled"): 60.0,
             ("busy", "vllm_eager"): 45.0}  # fmt: skip
    loops: list[int] = []

    def job(key: str) -> Any:
        def run() -> dict[str, Any]:
            n = _busy_loops()
            loops.append(n)
            condition = "busy" if n else "quiet"
            return {"label": key, "output_throughput": rates.get((condition, key), 50.0)}

        return run

    jobs = [(k, job(k)) for k in ("tracevllm", "vllm_compiled")]
    results = bench_serve.measure(["quiet", "busy"], jobs, settle_s=0.05)
    assert loops == [0, 0, 1, 1]
    assert [(r["condition"], r["key"]) for r in results] == [
        ("quiet", "tracevllm"), ("quiet", "vllm_compiled"),
        ("busy", "tracevllm"), ("busy", "vllm_compiled")]  # fmt: skip
    summary = bench_serve.summarize(
        results + [{"key": "vllm_eager", "condition": "busy", "output_throughput": 45.0}]
    )
    assert summary["quiet"] == {"tracevllm_tok_s": 120.0, "ratio_vs_vllm_compiled": 1.2}
    assert summary["busy"] == {"tracevllm_tok_s": 90.0, "ratio_vs_vllm_compiled": 1.5,
                               "ratio_vs_vllm_eager": 2.0}  # fmt: skip
    cmds = bench_serve.servers("/m", "/venv", vllm_eager=True)
    assert [k for k, _, _ in cmds] == ["tracevllm", "vllm_compiled", "vllm_eager"]
    assert cmds[2][2][-1] == "--enforce-eager" and "--enforce-eager" not in cmds[1][2]
    assert [k for k, _, _ in bench_serve.servers("/m", None, vllm_eager=True)] == ["tracevllm"]


def test_tracing_cost_under_each_condition(monkeypatch: Any, tokenizer: Any) -> None:
    """Each level in each round under each condition (a busy loop beside each busy
    run), off without a trace directory, the others with one; vs off per condition."""
    import io

    from rich.console import Console

    calls: list[tuple[str, str, bool]] = []

    def fake(samples: list[Any], **kwargs: Any) -> tuple[float, int, int, dict[str, Any]]:
        loops = _busy_loops()
        calls.append((kwargs["trace_detail"], "busy" if loops else "quiet",
                      kwargs["trace_dir"] is not None))  # fmt: skip
        assert kwargs["model"] == "/m" and len(samples) == 2
        # 100 tok/s off; request 2 % slower quiet, 10 % busy; full 20 % slower.
        slow = {"off": 1.0, "request": 0.98 if not loops else 0.9, "full": 0.8}
        # As bench_tracevllm's: the worker's thread report last.
        return 1.0, int(100 * slow[kwargs["trace_detail"]]), 0, REPORT

    monkeypatch.setattr(bt, "bench_tracevllm", fake)
    args = argparse.Namespace(tracing_prompts=2, tracing_rounds=2)
    out = bt.measure_tracing(args, ["quiet", "busy"], tokenizer, {"model": "/m"},
                             Console(file=io.StringIO()), settle_s=0.05)  # fmt: skip
    assert calls == [("off", "quiet", False), ("request", "quiet", True), ("full", "quiet", True),
                     ("request", "quiet", True), ("full", "quiet", True), ("off", "quiet", False),
                     ("off", "busy", False), ("request", "busy", True), ("full", "busy", True),
                     ("request", "busy", True), ("full", "busy", True),
                     ("off", "busy", False)]  # fmt: skip
    assert math.isclose(out["quiet"]["vs_off"]["request"], -0.02)
    assert math.isclose(out["busy"]["vs_off"]["request"], -0.1)
    assert math.isclose(out["busy"]["vs_off"]["full"], -0.2)
    assert out["busy"]["tok_s"]["off"] == [100.0, 100.0]
    assert len(out["busy"]["load_start_end"]["full"]) == 2
    assert out["busy"]["threads"]["request"] == [REPORT, REPORT]  # each run's report kept


@pytest.mark.timeout(120)
def test_bench_throughput_smoke(
    monkeypatch: Any, tiny_model_dir: str, tmp_path: Path, capsys: Any
) -> None:
    """The script's ``main`` end to end on the tiny model's shapes, one busy core,
    2 prompts, with a stand-in engine (the engines' own runs are the tests of
    tracevllm/benchmarks/; on a loaded 2-core machine one start of the tiny
    model has taken a minute): argparse, the floor, the summary and the JSON."""
    loops: list[int] = []
    envs: list[dict[str, str] | None] = []

    def fake(
        samples: list[Any], env: dict[str, str] | None = None, **kwargs: Any
    ) -> tuple[float, int, int, dict[str, Any]]:
        loops.append(_busy_loops())
        envs.append(env)
        assert kwargs == {"model": tiny_model_dir} and len(samples) == 2
        # 2 s, 4 s (threads fixed), then 6 s: tok/s of each run, and the
        # ratios, known by hand; 3 prompt tokens from the prefix cache each time.
        threads = {"threads": 1, "adaptive": env is None, "probes": 4, "changes": [[2, 1]]}
        return 2.0 * len(loops), sum(s.expected_output_len for s in samples), 3, threads

    monkeypatch.setattr(bt, "bench_tracevllm", fake)
    import roofline

    monkeypatch.setattr(roofline, "measure_bandwidth", lambda: {"read_gbps": 10.0})
    # One rate before and after the engines: the lines printed first then
    # hold the final floors (a faster rate after is the next test's).
    monkeypatch.setattr(
        roofline, "measure_sgemm_squares",
        lambda sizes: [{"n": sizes[0], "seconds": 1.0, "gflops": 100.0}],
    )  # fmt: skip
    monkeypatch.delenv("VLLM_VENV", raising=False)
    out = tmp_path / "bench.json"
    argv = ["--model", tiny_model_dir, "--conditions", "busy", "--num-prompts", "2",
            "--skip-hf", "--skip-tracing", "--sgemm-sizes", "128",
            "--output-json", str(out)]  # fmt: skip
    bt.main(argv)
    stdout = capsys.readouterr().out
    assert loops == [1, 1, 1]  # each run beside its own busy loop
    assert envs == [None, {"TRACEVLLM_CPU_ADAPTIVE_THREADS": "0"}, None]
    assert _busy_loops() == 0
    res = json.loads(out.read_text())
    assert set(res["what"]) >= {"sgemm", "floor", "conditions", "summary", "tracing"}
    assert res["machine"]["cores"] == os.cpu_count()
    assert res["args"]["conditions"] == "busy" and res["args"]["sgemm_sizes"] == "128"
    assert res["command"].endswith(" ".join(argv))
    assert [s["n"] for s in res["sgemm"]["squares"]] == [128]
    assert list(res["conditions"]) == ["busy"]
    asked = res["workload"]["requested_tokens"]
    assert res["workload"]["num_prompts"] == 2
    gflops = res["sgemm"]["gflops"]
    floor_s = res["floor"]["seconds"]
    assert math.isclose(floor_s, res["floor"]["linear_flops"] / (gflops * 1e9))
    # Each run's floor: the workload's less the 3 cached prompt tokens' 2 x 73728 FLOP.
    ran_s = floor_s - 2 * 73728 * 3 / (gflops * 1e9)
    runs = res["conditions"]["busy"]["runs"]
    assert [r["key"] for r in runs] == ["tracevllm", "tracevllm_fixed", "tracevllm"]
    assert [r["seconds"] for r in runs] == [2.0, 4.0, 6.0]
    assert [r["threads"]["adaptive"] for r in runs] == [True, False, True]
    for r in runs:
        assert r["tokens"] == asked and r["cached_tokens"] == 3
        assert math.isclose(r["floor_s"], ran_s)
        assert math.isclose(r["floor_share"], ran_s / r["seconds"])
        assert r["load_start"] >= 0 and r["load_end"] >= 0
    # The roofline floor: the workload's, and each run's share of its own.
    requests = [tuple(r) for r in res["workload"]["requests"]]
    roof = bt.roofline_seconds(model_shapes(tiny_model_dir), requests, gflops, 10.0, 3)
    assert res["roofline_floor"]["read_gbps"] == 10.0
    assert [r["roofline_s"] for r in runs] == pytest.approx([roof] * 3)
    summary = res["conditions"]["busy"]["summary"]
    assert summary["roofline_share"] == pytest.approx((roof / 2 + roof / 6) / 2)
    assert math.isclose(summary["tracevllm_tok_s"], (asked / 2 + asked / 6) / 2)
    assert math.isclose(summary["ratio_vs_tracevllm_fixed"], (1 / 2 + 1 / 6) / 2 * 4)
    assert math.isclose(summary["floor_share"], (ran_s / 2 + ran_s / 6) / 2)
    assert math.isclose(summary["floor_s"], ran_s)
    assert "tracing" not in res
    at_shapes = res["linears_at_shapes"]
    assert at_shapes["seconds"] > 0
    assert math.isclose(at_shapes["floor_share_ceiling"], floor_s / at_shapes["seconds"])
    ceiling = f"reaches at most {at_shapes['floor_share_ceiling'] * 100:.0f}% of the linear floor"
    assert ceiling in " ".join(stdout.split())  # rich wraps the line
    assert "one busy core" in stdout and "linear-FLOP floor" in stdout
    assert f"{floor_s:.2f} s with no prefix-cache hits" in stdout
    assert "3 prompt tokens from the prefix cache" in stdout
    assert "threads 2 -> 1 (adaptive, 4 probes)" in stdout and "1 threads (fixed)" in stdout


@pytest.mark.timeout(120)
def test_bench_throughput_floors_only(
    monkeypatch: Any, tiny_model_dir: str, tmp_path: Path, capsys: Any
) -> None:
    """``--floors-only``: the floors and the linears' ceiling, written, and no engine."""

    def no_engine(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("--floors-only started an engine")

    monkeypatch.setattr(bt, "bench_tracevllm", no_engine)
    import roofline

    monkeypatch.setattr(roofline, "measure_bandwidth", lambda: {"read_gbps": 10.0})
    out = tmp_path / "floors.json"
    bt.main(["--model", tiny_model_dir, "--num-prompts", "2", "--sgemm-sizes", "128",
             "--floors-only", "--output-json", str(out)])  # fmt: skip
    res = json.loads(out.read_text())
    assert "conditions" not in res and res["args"]["floors_only"] is True
    assert res["floor"]["seconds"] > 0 and res["linears_at_shapes"]["seconds"] > 0
    assert "no engine ran" in capsys.readouterr().out


def test_bench_throughput_rejects_bad_flags(capsys: Any) -> None:
    """argparse's errors, before anything is measured."""
    for argv, msg in ((["--conditions", "loud"], "--conditions"),
                      (["--num-prompts", "0"], "--num-prompts must be at least 1")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            bt.main(argv)
        assert e.value.code == 2
        assert msg in capsys.readouterr().err


REPORT = {"threads": 2, "adaptive": True, "changes": [], "probes": 1}


def test_engines_count_their_prefix_cache_hits(monkeypatch: Any) -> None:
    """tracevllm's and vLLM's timed outputs' ``num_cached_tokens``, summed; vLLM's
    may be None, and then the count is unknown (None), not 0."""
    import vllm_offline

    import tracevllm
    import tracevllm.benchmarks.throughput as throughput

    class Out:
        def __init__(self, generated: int, cached: int | None) -> None:
            self.outputs = [argparse.Namespace(token_ids=[0] * generated)]
            self.num_cached_tokens = cached

    seen_env: list[str | None] = []

    class FakeLLM:
        def __init__(self, **kwargs: Any) -> None:
            seen_env.append(os.environ.get("TRACEVLLM_CPU_ADAPTIVE_THREADS"))

        def __enter__(self) -> FakeLLM:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def collective_rpc(self, method: str) -> list[dict[str, Any]]:
            assert method == "get_cpu_threads"
            return [REPORT]

    outs = [Out(4, 16), Out(2, 0), Out(3, 5)]
    monkeypatch.setattr(tracevllm, "LLM", FakeLLM)
    monkeypatch.setattr(throughput, "run_tracevllm", lambda llm, samples, **kw: (1.5, outs))
    samples = [argparse.Namespace(expected_output_len=n) for n in (4, 2, 3)]
    assert bt.bench_tracevllm(samples, model="/m") == (1.5, 9, 21, REPORT)
    # The fixed-count run: its variable set while the engine starts, gone after.
    monkeypatch.delenv("TRACEVLLM_CPU_ADAPTIVE_THREADS", raising=False)
    bt.bench_tracevllm(samples, {"TRACEVLLM_CPU_ADAPTIVE_THREADS": "0"}, model="/m")
    assert seen_env[-1] == "0" and "TRACEVLLM_CPU_ADAPTIVE_THREADS" not in os.environ
    assert vllm_offline.cached_tokens(outs) == 21
    assert vllm_offline.cached_tokens([Out(4, 16), Out(2, None)]) is None
    assert vllm_offline.cached_tokens([]) == 0


def test_a_relative_vllm_venv_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """README: ``VLLM_VENV=.vllm-venv make bench``. The venv's Python runs in
    a temporary folder, so a relative VLLM_VENV is taken from the caller's
    folder (mutation caught: the path joined as given -> FileNotFoundError)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from offline_common import run_in_vllm_venv

    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(sys.executable)
    script = tmp_path / "echo_job.py"
    script.write_text("import shutil, sys\nshutil.copy(sys.argv[1], sys.argv[2])\n")
    monkeypatch.chdir(tmp_path)
    assert run_in_vllm_venv("venv", str(script), {"n": 3}) == {"n": 3}


def test_bench_compile_alternates_modes_and_divides_by_hand(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any
) -> None:
    """benchmarks/bench_compile.py's main with a stand-in engine: eager,
    compiled, eager, compiled under each condition, a busy loop beside the
    busy ones; compiled / eager from the means (eager 2 s and 4 s, compiled
    1 s and 2 s: 1.5x the tok/s)."""
    import bench_compile

    calls: list[tuple[bool, int]] = []

    def fake(samples: list[Any], **kwargs: Any) -> tuple[float, int, int, dict[str, Any]]:
        calls.append((kwargs["enforce_eager"], _busy_loops()))
        eager = [c for c, _ in calls].count(kwargs["enforce_eager"])
        seconds = (2.0 if kwargs["enforce_eager"] else 1.0) * (1 if eager % 2 else 2)
        return seconds, 100, 0, REPORT

    monkeypatch.setattr(bt, "bench_tracevllm", fake)
    out = tmp_path / "compile.json"
    argv = ["bench_compile.py", "--num-prompts", "2", "--conditions", "quiet,busy",
            "--output-json", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench_compile.main()
    assert calls == [(True, 0), (False, 0), (True, 0), (False, 0),
                     (True, 1), (False, 1), (True, 1), (False, 1)]  # fmt: skip
    res = json.loads(out.read_text())
    want = ((100 / 1 + 100 / 2) / 2) / ((100 / 2 + 100 / 4) / 2)
    assert res["compiled_over_eager"] == pytest.approx({"quiet": want, "busy": want})
    assert [r["threads"] for r in res["runs"]] == [REPORT] * 8
    assert "one busy core: compiled / eager" in capsys.readouterr().out


@pytest.mark.parametrize("rates", [(100.0, 150.0), (150.0, 100.0)], ids=["faster", "slower"])
def test_floors_take_sgemms_faster_measurement(
    rates: tuple[float, float], monkeypatch: Any, tiny_model_dir: str, tmp_path: Path
) -> None:
    """sgemm measured before and after the engines: every floor, share and the
    ceiling at the faster rate, the earlier one kept beside it (a slow minute on
    a shared machine flattered a run's shares: 79% of a floor at 153 GFLOP/s)."""
    import roofline

    measured = iter(rates)
    monkeypatch.setattr(
        roofline, "measure_sgemm_squares",
        lambda sizes: [{"n": sizes[0], "seconds": 1.0, "gflops": next(measured)}],
    )  # fmt: skip
    monkeypatch.setattr(roofline, "measure_bandwidth", lambda: {"read_gbps": 10.0})
    report = {"threads": 1, "adaptive": False}
    monkeypatch.setattr(bt, "bench_tracevllm", lambda samples, env=None, **kw: (
        2.0, sum(s.expected_output_len for s in samples), 3, report))  # fmt: skip
    monkeypatch.delenv("VLLM_VENV", raising=False)
    out = tmp_path / "bench.json"
    bt.main(["--model", tiny_model_dir, "--conditions", "quiet", "--num-prompts", "2",
             "--skip-hf", "--skip-tracing", "--skip-fixed-threads", "--sgemm-sizes", "128",
             "--output-json", str(out)])  # fmt: skip
    res = json.loads(out.read_text())
    assert res["sgemm"]["gflops_before"] == rates[0]
    assert res["sgemm"]["gflops"] == 150.0
    assert [s["gflops"] for s in res["sgemm"]["squares_after"]] == [rates[1]]
    flops = res["floor"]["linear_flops"]
    assert math.isclose(res["floor"]["seconds"], flops / 150e9)
    at_shapes = res["linears_at_shapes"]
    assert math.isclose(at_shapes["floor_share_ceiling"], flops / 150e9 / at_shapes["seconds"])
    requests = [tuple(r) for r in res["workload"]["requests"]]
    shapes = model_shapes(tiny_model_dir)
    assert math.isclose(
        res["roofline_floor"]["seconds"], bt.roofline_seconds(shapes, requests, 150.0, 10.0)
    )
    ran_s = (flops - 2 * 73728 * 3) / 150e9  # less the 3 cached prompt tokens
    for r in res["conditions"]["quiet"]["runs"]:
        assert math.isclose(r["floor_s"], ran_s)
        assert math.isclose(r["floor_share"], ran_s / 2.0)
        roof = bt.roofline_seconds(shapes, requests, 150.0, 10.0, 3)
        assert math.isclose(r["roofline_s"], roof)
    assert math.isclose(res["conditions"]["quiet"]["summary"]["floor_share"], ran_s / 2.0)

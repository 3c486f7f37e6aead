"""``make bench-disagg`` (benchmarks/bench_disagg.py) at its smallest, on a tiny Llama.

Not a timed test: one run of the script (one engine, then a prefill and a
decode server behind the proxy, NixlConnector between them) with two short
requests and one long prompt, in a child process under a timeout; its JSON
is checked to count what it says: every request answered with the tokens it
asked for, each class's figures from its own requests, and the decode
server's counters showing the split's prompts loaded through the connector
(and the single engine's computed). The H100 arithmetic is checked against
figures worked by hand. Slow for a smoke test, and not by its own doing:
three ``tracevllm serve`` and the proxy start at once (7-12 minutes at a load
average of 15-40 on two CPUs; the requests themselves take seconds).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_disagg.py"
SHORT_OUT, LONG_OUT = 6, 3


def _bench() -> ModuleType:
    """The script as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("bench_disagg", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, str]:
    """The script's JSON, its output, and the servers' log."""
    folder = tmp_path_factory.mktemp("bench-disagg")
    out = folder / "disagg.json"
    args = ["--model", tiny_model_dir, "--num-short", "2", "--short-output-len", str(SHORT_OUT),
            "--num-long", "1", "--long-len", "96", "--long-output-len", str(LONG_OUT),
            "--long-start", "0.2", "--max-model-len", "256", "--output-json", str(out),
            "--log", str(folder / "servers.log")]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "160"},
        capture_output=True,
        text=True,
        timeout=1200,  # seven processes start at once: 8-12 minutes at a load of 15-40
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    servers_log = (folder / "servers.log").read_text(errors="replace")
    return json.loads(out.read_text()), proc.stdout, servers_log


def _warnings(servers_log: str) -> str:
    """The servers' warnings and errors, for an assertion's message: a split
    whose decode server computed prompts it should have loaded says why there
    (once seen in CI, not reproduced: 159 prompt tokens computed)."""
    lines = [line for line in servers_log.splitlines() if "WARNING" in line or "ERROR" in line]
    return "\n".join(lines[-40:]) or "(the servers logged no warning)"


@pytest.mark.timeout(1260)
def test_each_configuration_counts_its_requests(smoke: tuple[dict, str, str]) -> None:
    result, stdout, servers_log = smoke
    one, split = result["configs"]
    assert (one["config"], split["config"]) == ("one engine", "P/D split")
    for config in (one, split):
        rows = config["requests"]
        assert [r["kind"] for r in rows] == ["short", "short", "long"]
        assert all(r["success"] and not r["error"] for r in rows)
        assert [r["output_tokens"] for r in rows] == [SHORT_OUT, SHORT_OUT, LONG_OUT]
        for kind, n, out in (("short", 2, SHORT_OUT), ("long", 1, LONG_OUT)):
            m = config[kind]
            mine = [r for r in rows if r["kind"] == kind]
            assert (m["completed"], m["failed"], m["total_output_tokens"]) == (n, 0, n * out)
            # A gap per streamed chunk after the first, at most one per token.
            assert m["num_itl"] == sum(len(r["itl_ms"]) for r in mine)
            assert all(0 < len(r["itl_ms"]) <= out - 1 for r in mine)
            assert m["max_itl_ms"] == max(t for r in mine for t in r["itl_ms"])
            assert m["p99_ttft_ms"] <= max(r["ttft_ms"] for r in mine) + 1e-6
            assert m["median_ttft_ms"] >= min(r["ttft_ms"] for r in mine) - 1e-6
        long_row = rows[2]
        assert long_row["prompt_tokens"] > 96 > rows[0]["prompt_tokens"]
        assert long_row["sent_s"] >= 0.2
        load = config["load_average"]
        assert len(load["before"]) == len(load["after"]) == 3
    # Where the decode server's prompt tokens came from (its /metrics over the run).
    by = "vllm:prompt_tokens_by_source_total[{}]"
    prompt_tokens = sum(r["prompt_tokens"] for r in one["requests"])
    for config in (one, split):
        metrics = config["decode_server_metrics"]
        sources = sum(metrics[by.format(s)] for s in
                      ("local_compute", "local_cache_hit", "external_kv_transfer"))  # fmt: skip
        assert metrics["vllm:prompt_tokens_total"] == sources == prompt_tokens
    assert one["decode_server_metrics"][by.format("external_kv_transfer")] == 0
    assert one["decode_server_metrics"][by.format("local_compute")] > 0
    # Split, the decode server computed no prompt token: each prompt past its
    # local prefix hit (the chat template's first blocks) was loaded.
    metrics = split["decode_server_metrics"]
    loaded = metrics[by.format("external_kv_transfer")]
    assert metrics[by.format("local_compute")] == 0, _warnings(servers_log)
    assert loaded == prompt_tokens - metrics[by.format("local_cache_hit")] > 96
    # vLLM's external prefix-cache counters: what the connector was asked
    # after the local hit, and what it had (all of it).
    assert metrics["vllm:external_prefix_cache_queries_total"] == loaded
    assert metrics["vllm:external_prefix_cache_hits_total"] == loaded
    # The prefill server computed every prompt (the warm-up's too).
    prefill = split["prefill_server_metrics"]
    assert prefill["vllm:prompt_tokens_total"] > prompt_tokens
    assert prefill[by.format("external_kv_transfer")] == 0
    # Each configuration's engines ran a fixed thread count, recorded: the
    # one engine the split's two together (the default: 2 x --pd-threads 1,
    # at most the CPUs this process may use), each split engine 1.
    one_threads = min(2, len(os.sched_getaffinity(0)))
    assert one["threads"] == {"one": {"TRACEVLLM_NUM_THREADS": one_threads}}
    assert split["threads"] == {
        "prefill": {"TRACEVLLM_NUM_THREADS": 1},
        "decode": {"TRACEVLLM_NUM_THREADS": 1},
    }
    # The self-description the book is written from.
    assert result["machine"]["cpus"] == os.cpu_count() and "shared" in result["machine"]
    assert result["workload"]["connector"] == "NixlConnector"
    assert "model_dir" not in result["workload"] and "what" in result
    assert "load average" in stdout and "P/D split" in stdout


def test_every_engine_gets_a_fixed_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the caller's environment: the one engine --one-threads, each
    split engine --pd-threads, and the proxy no count (mutation caught: the
    one engine started with the caller's environment, i.e. the adaptive
    default -> its recorded setting None)."""
    bench = _bench()
    monkeypatch.delenv("TRACEVLLM_NUM_THREADS", raising=False)
    args = bench.argparse.Namespace(
        model_dir="m", max_model_len=256, connector="NixlConnector", one_threads=2, pd_threads=1
    )
    commands = bench.server_commands(args, "store")
    assert set(commands) == {"one", "prefill", "decode", "proxy"}
    assert bench.thread_settings(commands, bench.ENGINES["one engine"]) == {
        "one": {"TRACEVLLM_NUM_THREADS": 2}
    }
    assert bench.thread_settings(commands, bench.ENGINES["P/D split"]) == {
        "prefill": {"TRACEVLLM_NUM_THREADS": 1},
        "decode": {"TRACEVLLM_NUM_THREADS": 1},
    }
    assert "TRACEVLLM_NUM_THREADS" not in commands["proxy"][1]
    # Each server its own port, in its command.
    ports = [port for _, _, port in commands.values()]
    assert len(set(ports)) == 4
    assert all(str(port) in cmd for cmd, _, port in commands.values())


def test_one_threads_default_is_the_splits_two_engines_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--one-threads defaults to 2 x --pd-threads, capped at the CPUs this
    process may run on (its affinity, not os.cpu_count()); given, it is kept."""
    bench = _bench()
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: set(range(6)))
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 64)
    assert bench.parse_args([]).one_threads == 2
    assert bench.parse_args(["--pd-threads", "2"]).one_threads == 4
    assert bench.parse_args(["--pd-threads", "4"]).one_threads == 6  # the affinity's 6
    assert bench.parse_args(["--pd-threads", "4", "--one-threads", "3"]).one_threads == 3
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: {0})
    assert bench.parse_args([]).one_threads == 1
    for bad in (["--pd-threads", "0"], ["--one-threads", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_h100_arithmetic_by_hand() -> None:
    bench = _bench()
    prediction = bench.predict(
        {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256},
        1024,
        "llama",
    )  # fmt: skip
    mine, llama = prediction["models"]
    assert (mine["model"], llama["model"]) == ("llama", "Llama-3-8B")
    # Llama-3-8B's shapes give its 8.03e9 parameters, within a percent.
    assert abs(bench._params({"hidden_size": 4096, "intermediate_size": 14336,
               "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "vocab_size": 128256}) - 8.03e9) < 0.01 * 8.03e9  # fmt: skip
    # 16-bit weights over 3.35 TB/s: 2 x 8.03e9 / 3.35e12 s = 4.79 ms a step.
    assert llama["decode_step_ms"] == pytest.approx(4.794, rel=1e-3)
    # 2 x 8.03e9 x 1024 FLOP at half of 989 TFLOP/s: 33.25 ms.
    assert llama["prefill_ms"] == pytest.approx(33.25, rel=1e-3)
    assert llama["one_gpu_worst_itl_ms"] == pytest.approx(4.794 + 33.25, rel=1e-3)
    assert llama["split_worst_itl_ms"] == llama["decode_step_ms"]
    # K and V, 32 layers x 8 heads x 128 x 2 bytes: 131072 bytes a token;
    # 1024 tokens over 50 GB/s: 2.68 ms.
    assert llama["kv_bytes_per_token"] == 131072
    assert llama["kv_transfer_ms"]["400 Gb/s RDMA"] == pytest.approx(2.684, rel=1e-3)
    assert mine["kv_bytes_per_token"] == llama["kv_bytes_per_token"]

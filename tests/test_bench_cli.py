"""`tracevllm bench latency | throughput | sweep` on the tiny model, tiny sizes.

Not timed tests: the figures are only checked to be what they say (token
counts exactly as asked, rates equal to counts over time, percentiles in
order), a bad dataset file to fail early with a message naming the fault,
and the sweep to pick only a config meeting its target.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tracevllm.benchmarks.datasets import chat_prompts, workload
from tracevllm.benchmarks.sweep import pick_best
from tracevllm.entrypoints.cli import main

# The engine core in this process (quicker to start and stop), but for the
# first test, which runs it in its own, as by default.
INPROC = "--no-enable-multiprocessing"


def _run(args: list[str], out: Path) -> tuple[int, dict[str, Any] | None]:
    rc = main([*args, "--output-json", str(out)])
    return rc, json.loads(out.read_text()) if out.exists() else None


def _chat_prompt_lens(tokenizer: Any, n: int) -> list[int]:
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )  # fmt: skip
        for p in chat_prompts(n)
    ]
    return [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts]


def test_throughput_counts_exactly_what_was_asked(
    tiny_model_dir: str, tokenizer: Any, tmp_path: Path
) -> None:
    """The default chat workload, its seeded output lengths, vLLM's keys."""
    rc, result = _run(["bench", "throughput", "--model", tiny_model_dir, "--num-prompts", "3",
                       "--num-warmups", "1", "--no-progress"], tmp_path / "t.json")  # fmt: skip
    assert rc == 0 and result is not None
    prompt_tokens = sum(_chat_prompt_lens(tokenizer, 3))
    output_tokens = sum(workload(3)[1])
    assert result["num_requests"] == 3
    assert result["total_prompt_tokens"] == prompt_tokens
    assert result["total_output_tokens"] == output_tokens
    assert result["total_num_tokens"] == prompt_tokens + output_tokens
    elapsed = result["elapsed_time"]
    assert elapsed > 0
    assert math.isclose(result["requests_per_second"], 3 / elapsed)
    assert math.isclose(result["tokens_per_second"], (prompt_tokens + output_tokens) / elapsed)
    assert math.isclose(result["output_tokens_per_second"], output_tokens / elapsed)


def test_throughput_custom_dataset(tiny_model_dir: str, tokenizer: Any, tmp_path: Path) -> None:
    """A JSON-lines file: its per-record output_tokens, cycled to --num-prompts,
    raw prompts with --skip-chat-template."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "Hello there", "output_tokens": 3}\n\n'
                    '{"prompt": "General Kenobi", "output_tokens": 5}\n')  # fmt: skip
    rc, result = _run(["bench", "throughput", "--model", tiny_model_dir, "--dataset", str(data),
                       "--num-prompts", "3", "--skip-chat-template", "--no-progress", INPROC],
                      tmp_path / "t.json")  # fmt: skip
    assert rc == 0 and result is not None
    assert result["num_requests"] == 3
    assert result["total_output_tokens"] == 3 + 5 + 3
    hello, kenobi = (len(tokenizer.encode(t)) for t in ("Hello there", "General Kenobi"))
    assert result["total_prompt_tokens"] == hello + kenobi + hello


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read it"),
        ("[{]", "not valid JSON"),
        ('{"prompt": "a"}\nnot json\n', "line 2 is not valid JSON"),
        ("[]", "no records"),
        ('["just a string"]', 'record 0 must be an object {"prompt": ...}'),
        ('[{"prompt": "a", "output_tokens": 2}, {"output_tokens": 2}]', 'record 1: "prompt" must'),
        ('[{"prompt": "", "output_tokens": 2}]', '"prompt" must be a non-empty string'),
        ('[{"prompt": "a", "output_tokens": 0}]', '"output_tokens" must be an int >= 1'),
        ('[{"prompt": "a", "output_tokens": 2.5}]', '"output_tokens" must be an int >= 1'),
        ('[{"prompt": "a"}]', 'record 0 has no "output_tokens"'),
        ('[{"prompt": "a", "output_token": 2}]', "unknown key(s) ['output_token']"),
    ],
)
def test_bad_dataset_is_refused_with_a_clear_error(
    tiny_model_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    content: str | None, message: str,
) -> None:  # fmt: skip
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    rc = main(["bench", "throughput", "--model", tiny_model_dir, "--dataset", str(path)])
    err = capsys.readouterr().err
    assert rc != 0
    assert message in err and str(path) in err, err


def test_latency_reports_batch_and_step_percentiles(tiny_model_dir: str, tmp_path: Path) -> None:
    batch, output_len, iters = 3, 5, 2
    rc, result = _run(["bench", "latency", "--model", tiny_model_dir, "--input-len", "8",
                       "--output-len", str(output_len), "--batch-size", str(batch),
                       "--num-iters-warmup", "1", "--num-iters", str(iters), INPROC],
                      tmp_path / "l.json")  # fmt: skip
    assert rc == 0 and result is not None
    latencies = result["latencies"]
    assert len(latencies) == iters and min(latencies) > 0
    assert math.isclose(result["avg_latency"], sum(latencies) / iters)
    assert list(result["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    values = list(result["percentiles"].values())
    assert values == sorted(values) and min(latencies) <= values[0] <= values[-1] <= max(latencies)
    # In one process every request is in the first step: one step per token.
    assert result["num_steps"] == output_len
    steps = result["step_latencies"]
    assert len(steps) == iters * output_len and min(steps) > 0
    assert math.isclose(result["avg_step_latency"], sum(steps) / len(steps))
    # The steps cut each batch's time in pieces (the rest: the last step's bookkeeping).
    assert 0.5 * sum(latencies) <= sum(steps) <= sum(latencies)
    percentiles = list(result["step_percentiles"].values())
    assert percentiles == sorted(percentiles) and min(steps) <= percentiles[0]
    assert result["total_output_tokens"] == batch * output_len
    for name in ("ttft", "itl", "tpot", "e2el"):
        assert result[f"mean_{name}_ms"] > 0 and f"p99_{name}_ms" in result
    assert result["mean_e2el_ms"] <= max(latencies) * 1000


def _config(throughput: float, ttft: float, itl: float) -> dict[str, Any]:
    return {"output_throughput": throughput, "p99_ttft_ms": ttft, "p99_itl_ms": itl}


def test_pick_best_takes_the_fastest_config_within_the_target() -> None:
    configs = [_config(100, 50, 10), _config(300, 900, 40), _config(200, 80, 20)]
    assert pick_best(configs, None, None, 99) == 1
    assert pick_best(configs, 100, None, 99) == 2  # the fastest misses the TTFT target
    assert pick_best(configs, None, 30, 99) == 2  # ... and the ITL target
    assert pick_best(configs, 1000, 15, 99) == 0
    assert pick_best(configs, 10, None, 99) is None
    assert pick_best(configs, None, 5, 99) is None


def test_sweep_picks_a_config_meeting_the_target_or_none(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    common = ["bench", "sweep", "--model", tiny_model_dir, "--num-prompts", "3", "--output-len",
              "4", "--max-num-batched-tokens-list", "64", "--no-progress", INPROC]  # fmt: skip
    rc, result = _run([*common, "--max-num-seqs-list", "1,3", "--max-itl-ms", "1e9"],
                      tmp_path / "s.json")  # fmt: skip
    assert rc == 0 and result is not None
    configs = result["configs"]
    assert [(c["max_num_seqs"], c["max_num_batched_tokens"]) for c in configs] == [(1, 64), (3, 64)]
    assert all(c["completed"] == 3 and c["total_output_tokens"] == 12 for c in configs)
    winner = result["winner"]
    assert winner["meets_target"] and winner["p99_itl_ms"] <= 1e9
    assert winner["output_throughput"] == max(c["output_throughput"] for c in configs)

    rc, result = _run([*common, "--max-num-seqs-list", "2", "--max-ttft-ms", "0.001"],
                      tmp_path / "none.json")  # fmt: skip
    assert rc == 1 and result is not None
    assert result["winner"] is None
    assert [c["meets_target"] for c in result["configs"]] == [False]

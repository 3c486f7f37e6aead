"""`tracevllm bench sweep --serve-params` (vLLM's parameter sweep): any engine
knob, one fresh engine per config, on the tiny model at tiny sizes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tracevllm.benchmarks.sweep import _environment, load_serve_params
from tracevllm.entrypoints.cli import main

INPROC = "--no-enable-multiprocessing"


def _sweep(model: str, params: str, out: Path, *more: str) -> tuple[int, dict[str, Any]]:
    argv = ["bench", "sweep", "--model", model, "--num-prompts", "3", "--output-len", "4",
            "--no-progress", INPROC, "--serve-params", params,
            "--output-json", str(out), *more]  # fmt: skip
    rc = main(argv)
    return rc, json.loads(out.read_text())


def test_serve_params_sweep_each_knob_into_its_own_engine(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """Each config of --serve-params builds its engine with its knobs (as the
    engine read them), runs every request, and is reported under its name, in
    order; dashes and underscores both name a field; the file form and the
    inline form agree. (Mutations caught: a config's knobs not passed to its
    engine; --num-runs ignored.)"""
    params = {
        "small": {"max_num_seqs": 1, "enable-prefix-caching": False, "block_size": 8},
        "chunked": {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8},
    }
    path = tmp_path / "params.json"
    path.write_text(json.dumps(params))
    rc, result = _sweep(tiny_model_dir, str(path), tmp_path / "a.json", "--num-runs", "2")
    assert rc == 0
    small, chunked = result["configs"]
    assert [small["name"], chunked["name"]] == ["small", "chunked"]
    assert small["engine"]["max_num_seqs"] == 1
    assert small["engine"]["enable_prefix_caching"] is False
    assert small["engine"]["block_size"] == 8
    assert chunked["engine"]["max_num_batched_tokens"] == 16
    assert chunked["engine"]["long_prefill_token_threshold"] == 8
    assert chunked["engine"]["enable_prefix_caching"] is True  # the default, untouched
    for config in (small, chunked):
        assert config["completed"] == 3 and config["total_output_tokens"] == 12
        assert len(config["output_throughput_runs"]) == 2
    inline = json.dumps([{"max_num_seqs": 2}])
    rc, result = _sweep(tiny_model_dir, inline, tmp_path / "b.json")
    assert rc == 0 and result["configs"][0]["engine"]["max_num_seqs"] == 2
    assert result["configs"][0]["name"] == "max_num_seqs=2"


def test_a_config_environment_is_set_for_its_engine_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A TRACEVLLM_* key is set while its engine runs, and put back after.
    (Mutation caught: the variable left set.)"""
    monkeypatch.setenv("TRACEVLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    monkeypatch.delenv("TRACEVLLM_NUM_THREADS", raising=False)
    config = {"TRACEVLLM_CPU_NUM_OF_RESERVED_CPU": 1, "TRACEVLLM_NUM_THREADS": 2}
    with _environment(config):
        assert os.environ["TRACEVLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
        assert os.environ["TRACEVLLM_NUM_THREADS"] == "2"
    assert os.environ["TRACEVLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert "TRACEVLLM_NUM_THREADS" not in os.environ


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ('[{"max_num_seq": 4}]', "'max_num_seq' is not an engine argument"),
        ('[{"TRACEVLLM_NO_SUCH": 1}]', "TRACEVLLM_NO_SUCH is not a variable of envs.py"),
        ('[{"TRACEVLLM_NUM_THREADS": true}]', "must be a string or a number"),
        ('[{"_benchmark_name": "a"}, {"_benchmark_name": "a"}]', "duplicate _benchmark_name"),
        ("[]", "expected a non-empty JSON list of objects"),
        ("[1, 2]", "expected a non-empty JSON list of objects"),
        ("{not json", "not JSON, nor a file of it"),
    ],
)
def test_bad_serve_params_name_what_is_wrong(params: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_serve_params(params)


def test_bad_serve_params_fail_the_command_before_any_engine(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    rc = main(["bench", "sweep", "--serve-params", '[{"max_num_seq": 4}]',
               "--output-json", str(tmp_path / "x.json")])  # fmt: skip
    assert rc == 2
    assert "'max_num_seq' is not an engine argument" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()

"""The engine end to end on a tiny random Llama: both process modes, aborts,
KV accounting, bad input, a dead engine, and nothing left behind."""

from __future__ import annotations

import glob
import os
import signal
import time

import pytest

from tracevllm import LLM, SamplingParams
from tracevllm.engine.exceptions import EngineDeadError


def _greedy(max_tokens: int = 8, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def mp_llm(tiny_model_dir: str):
    # max_model_len: what 24 blocks of 16 tokens hold (the engine refuses to
    # start with a pool that cannot hold one max_model_len request).
    llm = LLM(
        model=tiny_model_dir,
        num_gpu_blocks_override=24,
        max_model_len=24 * 16,
        enable_multiprocessing=True,
    )
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def inproc_llm(tiny_model_dir: str):
    llm = LLM(model=tiny_model_dir, num_gpu_blocks_override=64, enable_multiprocessing=False)
    yield llm
    llm.shutdown()


PROMPTS = ["Hello there, how", "The capital of France", "1 2 3 4 5 6 7 8 9 10 11 12 13 14"]


def test_modes_agree_and_outputs_are_shaped_like_vllm(mp_llm: LLM, inproc_llm: LLM) -> None:
    a = mp_llm.generate(PROMPTS, _greedy(10), use_tqdm=False)
    b = inproc_llm.generate(PROMPTS, _greedy(10), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    tok = mp_llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, a):
        assert out.finished and out.prompt == prompt
        assert out.prompt_token_ids == tok.encode(prompt)
        c = out.outputs[0]
        assert len(c.token_ids) == 10 and c.finish_reason == "length" and c.stop_reason is None
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    # Request ids count up across calls, as vLLM's counter.
    assert int(a[0].request_id) < int(a[1].request_id) < int(a[2].request_id)


def test_kv_blocks_all_return_after_requests(mp_llm: LLM) -> None:
    core = mp_llm.llm_engine.engine_core
    before = core.get_kv_cache_stats()
    assert before["free"] == before["total"]
    mp_llm.generate(PROMPTS * 3, _greedy(12), use_tqdm=False)
    after = core.get_kv_cache_stats()
    assert after["free"] == after["total"] and after["used"] == 0


def test_abort_frees_blocks(inproc_llm: LLM) -> None:
    engine = inproc_llm.llm_engine
    engine.add_request("abort-me", "a long running request", _greedy(40))
    engine.step()
    stats = engine.engine_core.get_kv_cache_stats()
    assert stats["used"] > 0
    engine.abort_request(["abort-me"])
    assert not engine.has_unfinished_requests()
    engine.step()  # the core drops the aborted request
    stats = engine.engine_core.get_kv_cache_stats()
    assert stats["used"] == 0 and stats["free"] == stats["total"]


def test_stop_string_stops_and_frees(inproc_llm: LLM) -> None:
    base = inproc_llm.generate([PROMPTS[0]], _greedy(12), use_tqdm=False)[0].outputs[0]
    # Stop at the text of the 4th generated token.
    tok = inproc_llm.get_tokenizer()
    stop = tok.decode(base.token_ids[3:4])
    if not stop.strip():
        pytest.skip("the 4th token is whitespace only")
    out = inproc_llm.generate([PROMPTS[0]], _greedy(12, stop=[stop]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert stop not in c.text and len(c.token_ids) < 12
    stats = inproc_llm.llm_engine.engine_core.get_kv_cache_stats()
    assert stats["used"] == 0


def test_stop_token_ids_and_min_tokens(inproc_llm: LLM) -> None:
    base = inproc_llm.generate([PROMPTS[1]], _greedy(8), use_tqdm=False)[0].outputs[0]
    stop_id = base.token_ids[2]
    out = inproc_llm.generate([PROMPTS[1]], _greedy(8, stop_token_ids=[stop_id]), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id
    assert c.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]
    # min_tokens keeps it going past an early stop id.
    first = base.token_ids.index(stop_id)
    out = inproc_llm.generate(
        [PROMPTS[1]], _greedy(8, stop_token_ids=[stop_id], min_tokens=first + 2), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) > first + 1


def test_n_and_seeded_sampling(inproc_llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    a = inproc_llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert len(a.outputs) == 3 and [c.index for c in a.outputs] == [0, 1, 2]
    # Reproducible, and independent of what else shares the batch.
    crowd = [PROMPTS[1], PROMPTS[0], PROMPTS[2]]
    mixed = [_greedy(6), params, SamplingParams(temperature=0.9, max_tokens=9)]
    b = inproc_llm.generate(crowd, mixed, use_tqdm=False)[1]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_logprobs(inproc_llm: LLM) -> None:
    out = inproc_llm.generate([PROMPTS[0]], _greedy(4, logprobs=3), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 4
    for token_id, position in zip(c.token_ids, c.logprobs):
        # Greedy: the sampled token is rank 1 and the most likely.
        assert position[token_id].rank == 1
        assert len(position) == 3
        assert max(p.logprob for p in position.values()) == position[token_id].logprob
    assert c.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs))
    )


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("", _greedy(), "empty"),
        ({"prompt_token_ids": []}, _greedy(), "empty"),
        ("hi", None, "max_tokens"),
        ({"prompt_token_ids": [1, 10**9]}, _greedy(), "out of vocabulary"),
        ({"prompt_token_ids": [-1]}, _greedy(), "out of vocabulary"),
        ({"prompt_token_ids": [5] * 5000}, _greedy(), "maximum model length"),
        # 1 + 500 tokens, capped at max_model_len 384, need 24 blocks: the pool
        # has 24, but block 0 is the null block.
        ("hi", _greedy(max_tokens=500), "KV cache blocks"),
    ],
)
def test_bad_input_is_refused_and_engine_keeps_serving(
    mp_llm: LLM, prompt: object, params: SamplingParams | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        if params is None:
            SamplingParams(max_tokens=0)
        mp_llm.generate([PROMPTS[0], prompt], params, use_tqdm=False)  # type: ignore[list-item]
    assert not mp_llm.llm_engine.has_unfinished_requests()
    assert mp_llm.generate([PROMPTS[0]], _greedy(3), use_tqdm=False)[0].finished


def test_bad_engine_arguments(tiny_model_dir: str, tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="safetensors|config.json"):
        LLM(model=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="block_size"):
        LLM(model=tiny_model_dir, block_size=3)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=tiny_model_dir, max_model_len=10**7)


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_collective_rpc_reaches_the_worker_in_either_mode(mp_llm: LLM, inproc_llm: LLM) -> None:
    """vLLM's ``LLM.collective_rpc``: a Worker method by name, in the engine
    process (over ZeroMQ) or this one, returns each rank's answer; a function
    runs in-process only, and across processes is a TypeError saying why.
    Mutations caught: EngineCore.collective_rpc dropping ``args`` (the
    function gets no 5); the policy not recording its changes (the adaptive
    worker's report stays empty, in test_cpu_threads)."""
    for llm in (mp_llm, inproc_llm):
        (report,) = llm.collective_rpc("get_cpu_threads")
        assert set(report) == {"threads", "adaptive", "changes", "probes", "probe_log"}
        assert report["threads"] >= 1 and isinstance(report["changes"], list)
    # In this process: the very worker (its wrapper, as in vLLM), args passed through.
    wrapper = inproc_llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
    got = inproc_llm.collective_rpc(lambda w, x: (w is wrapper, x), args=(5,))
    assert got == [(True, 5)]
    with pytest.raises(TypeError, match="name a Worker method"):
        mp_llm.collective_rpc(lambda w: w)
    # args and kwargs cross ZeroMQ to the method (which takes neither).
    with pytest.raises(Exception, match="positional argument"):
        mp_llm.collective_rpc("get_cpu_threads", args=(1,))
    with pytest.raises(Exception, match="unexpected keyword argument 'x'"):
        mp_llm.collective_rpc("get_cpu_threads", kwargs={"x": 1})
    # A result that cannot cross back (the model) fails the call, not the engine.
    with pytest.raises(Exception, match="Call to collective_rpc method failed"):
        mp_llm.collective_rpc("get_model")
    # The engine still serves after the refused calls.
    assert mp_llm.generate(["hi"], _greedy(2), use_tqdm=False)[0].outputs[0].token_ids


def test_dead_engine_raises_and_shutdown_leaves_nothing(tiny_model_dir: str) -> None:
    before = _children()
    llm = LLM(model=tiny_model_dir, num_gpu_blocks_override=32, enable_multiprocessing=True)
    client = llm.llm_engine.engine_core
    socket_dir = client.resources.socket_dir
    assert socket_dir and glob.glob(os.path.join(socket_dir, "*"))
    os.kill(client.engine_pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError):
        llm.generate(["still there?"], _greedy(50), use_tqdm=False)
    assert time.monotonic() - t0 < 10
    llm.shutdown()
    assert not os.path.exists(socket_dir)
    assert _children() - before == set()


def test_shutdown_stops_process_and_removes_sockets(tiny_model_dir: str) -> None:
    before = _children()
    with LLM(model=tiny_model_dir, num_gpu_blocks_override=32, enable_multiprocessing=True) as llm:
        client = llm.llm_engine.engine_core
        socket_dir = client.resources.socket_dir
        pid = client.engine_pid
        assert pid in _children()
        llm.generate(["hi"], _greedy(2), use_tqdm=False)
    assert not os.path.exists(socket_dir)
    assert _children() - before == set()


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or os.uname().machine != "x86_64",
    reason="tgkill by its x86_64 syscall number, on Linux",
)
def test_idle_engine_exits_on_sigterm_that_lands_on_another_thread(tiny_model_dir: str) -> None:
    """SIGTERM sent to the process may be delivered to any of its threads; the
    idle engine core must still run its handler and exit (it used to sleep in
    its queue until the frontend killed it)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    sys_tgkill = 234  # x86_64
    with LLM(model=tiny_model_dir, num_gpu_blocks_override=32, enable_multiprocessing=True) as llm:
        client = llm.llm_engine.engine_core
        llm.generate(["hi"], _greedy(2), use_tqdm=False)
        pid = client.engine_pid
        others = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
        assert others, "the engine core runs I/O threads beside its main thread"
        time.sleep(0.5)  # idle: the main thread waits on its input queue
        assert libc.syscall(sys_tgkill, pid, others[0], signal.SIGTERM) == 0
        deadline = time.monotonic() + 5
        while pid in _children() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pid not in _children(), "the engine core ignored SIGTERM while idle"


def test_unsupported_architecture_lists_supported(tmp_path) -> None:
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(model=str(tmp_path))


def test_cli_generate(tiny_model_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    from tracevllm.entrypoints.cli import main

    rc = main(
        [
            "generate",
            "--prompt",
            "Hello",
            "--model",
            tiny_model_dir,
            "--max-tokens",
            "4",
            "--no-enable-multiprocessing",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "4 tokens" in out
    # Bad input: a clear message and exit code 2, not a traceback.
    rc = main(["generate", "--prompt", "Hello", "--model", tiny_model_dir, "--max-tokens", "0"])
    assert rc == 2 and "max_tokens" in capsys.readouterr().err


def test_engine_seed_makes_unseeded_sampling_reproducible(tiny_model_dir: str) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)

    def run(seed: int) -> list[list[int]]:
        with LLM(model=tiny_model_dir, seed=seed, enable_multiprocessing=False) as llm:
            return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_engine_core_freezes_its_startup_heap(tiny_model_dir: str) -> None:
    """EngineCore leaves its startup heap out of the garbage collector's walks
    (vLLM's freeze_gc_heap) and gives it back at shutdown."""
    import gc

    before = gc.get_freeze_count()  # another in-process engine may be alive
    with LLM(model=tiny_model_dir, enable_multiprocessing=False) as llm:
        assert gc.get_freeze_count() > before
        runner = llm.llm_engine.engine_core.engine_core.model_executor.model_runner
        attributes = runner.__dict__
        assert gc.is_tracked(attributes)
        assert not any(o is attributes for o in gc.get_objects())  # frozen: not walked
    assert gc.get_freeze_count() == 0

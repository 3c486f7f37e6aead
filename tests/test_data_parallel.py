"""Data parallelism: D engine cores behind one frontend, on the tiny Llama.

Each scenario runs in a child process (``python -m tests.test_data_parallel
NAME MODEL ...``) under a timeout and prints one JSON line, so a crash or a
hang fails the test instead of pytest. The engines are real processes
(``DPEngineCoreProc``, one ``uni`` executor each) with the real
``DPCoordinator`` process between them and the frontend. Checked: D = 2 gives
D = 1's greedy tokens with chunked prefill, prefix caching and preemption on,
and the requests are spread over both engines (each engine's own count,
asked through a utility call); an engine with nothing to do holds up no one
(a short request finishes while the other engine is still busy; an idle
engine joins a wave with one empty turn and no model step) and the request
wave advances once both are idle; an engine SIGKILLed mid-generate becomes
EngineDeadError naming it within 10 s, and shutdown leaves no process or
socket file; a frontend killed with SIGKILL leaves none either; AsyncLLM (the
serving path) over D = 2 gives the same tokens, and so does ``tracevllm serve
-dp 2`` to the official ``openai`` client.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.utils import REPO_ROOT, run_json_lines

NUM_TOKENS = 24


def say(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def _prompts(model: str) -> list[list[int]]:
    from transformers import AutoConfig

    from tests.family_check import make_prompts

    return make_prompts(AutoConfig.from_pretrained(model).vocab_size)


def _llm(model: str, dp: int, **kw: Any) -> Any:
    from tracevllm import LLM

    return LLM(
        model=model,
        data_parallel_size=dp,
        distributed_executor_backend="uni",
        block_size=4,
        max_num_batched_tokens=16,  # chunked prefill: the longest prompts take 3 steps
        max_num_seqs=8,
        enable_prefix_caching=True,
        num_gpu_blocks_override=24,  # small: the longest requests preempt the others
        max_model_len=96,
        enable_multiprocessing=True,
        **kw,
    )


def _greedy(n: int = NUM_TOKENS) -> Any:
    from tracevllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _dp_states(llm: Any) -> list[dict[str, Any]]:
    return list(llm.llm_engine.engine_core.call_utility_all("get_dp_state"))


def _wait_until(condition: Any, timeout: float = 60.0) -> bool:
    """Poll ``condition()`` until true (True) or ``timeout`` seconds (False):
    a wait on what the coordinator publishes, however slow the machine."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _wave_over(llm: Any, after_wave: int = -1) -> bool:
    """The coordinator has published the wave (past ``after_wave``) ended
    and every engine idle, and every engine says it is not running."""
    balancer = llm.llm_engine.engine_core.balancer
    if balancer.engines_running or balancer.current_wave <= after_wave:
        return False
    if any(list(counts) != [0, 0] for counts in balancer.lb_engines):
        return False
    return all(not s["engines_running"] for s in _dp_states(llm))


# --- scenarios (child processes) ---------------------------------------------------
def offline(model: str, dp: str) -> None:
    """The workload at D = dp; then a prompt alone and one sharing its prefix."""
    prompts = _prompts(model)
    llm = _llm(model, int(dp))
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(), use_tqdm=False)
        preemptions = llm.llm_engine.num_preemptions
        states = _dp_states(llm) if int(dp) > 1 else []
        # vLLM's LLM.collective_rpc: every worker of every engine answers.
        workers = llm.collective_rpc("get_cpu_threads")
        # Both engines idle: the second of these goes where the first went (the
        # least loaded is the first engine again), and finds its prefix cached.
        # (Idle as the balancer sees it: the coordinator has said so.)
        idle = int(dp) == 1 or _wait_until(lambda: _wave_over(llm))
        llm.generate([{"prompt_token_ids": prompts[6]}], _greedy(4), use_tqdm=False)
        idle = idle and (int(dp) == 1 or _wait_until(lambda: _wave_over(llm)))
        (hit,) = llm.generate([{"prompt_token_ids": prompts[7]}], _greedy(4), use_tqdm=False)
        say(
            tokens=[list(o.outputs[0].token_ids) for o in outs],
            texts=[o.outputs[0].text for o in outs],
            preemptions=preemptions,
            states=states,
            cached=hit.num_cached_tokens,
            idle=idle,
            workers=len(workers),
        )
    finally:
        llm.shutdown()


def idle_engine(model: str) -> None:
    """A long and a short request on two engines; then one request alone."""
    llm = _llm(model, 2)
    engine = llm.llm_engine
    client = engine.engine_core
    prompts = _prompts(model)
    try:
        engine.add_request("long", {"prompt_token_ids": prompts[1]}, _greedy(80))
        engine.add_request("short", {"prompt_token_ids": prompts[2]}, _greedy(3))
        engines = dict(client.balancer.reqs_in_flight)
        long_tokens_when_short_done = -1
        done: set[str] = set()
        long_tokens = 0
        # What the coordinator published while they ran: [waiting, running] per engine.
        seen_counts: list[list[list[int]]] = []
        while engine.has_unfinished_requests():
            seen_counts.append([list(c) for c in client.balancer.lb_engines])
            for out in engine.step():
                if out.request_id == "long":
                    long_tokens = len(out.outputs[0].token_ids)
                if out.finished:
                    done.add(out.request_id)
                    if out.request_id == "short":
                        long_tokens_when_short_done = long_tokens
        # Until the coordinator publishes the wave's end (or a minute passes).
        _wait_until(lambda: _wave_over(llm))
        after_pair = _dp_states(llm)
        wave_after_pair = client.balancer.current_wave
        running_after_pair = client.balancer.engines_running
        # One request alone: the other engine only joins the wave.
        engine.add_request("alone", {"prompt_token_ids": prompts[3]}, _greedy(40))
        while engine.has_unfinished_requests():
            engine.step()
        # Until the coordinator publishes that wave's end too, and both
        # engines have moved on to the next one.
        _wait_until(
            lambda: (
                _wave_over(llm, wave_after_pair)
                and len({s["current_wave"] for s in _dp_states(llm)}) == 1
            )
        )
        after_alone = _dp_states(llm)
        say(
            engines=[int.from_bytes(engines[k], "little") for k in sorted(engines)],
            seen_counts=seen_counts,
            long_tokens_when_short_done=long_tokens_when_short_done,
            after_pair=after_pair,
            after_alone=after_alone,
            wave_after_pair=wave_after_pair,
            running_after_pair=running_after_pair,
            wave_after_alone=client.balancer.current_wave,
            running_after_alone=client.balancer.engines_running,
        )
    finally:
        llm.shutdown()


def kill_engine(model: str, victim: str) -> None:
    """SIGKILL one engine mid-generate: EngineDeadError naming it, nothing left."""
    from tests.executor_scenarios import wait_gone
    from tracevllm.engine.exceptions import EngineDeadError

    llm = _llm(model, 2)
    engine = llm.llm_engine
    client = engine.engine_core
    resources = client.resources
    pids = [p.pid for p in resources.engine_procs] + [resources.coordinator_proc.pid]
    socket_dir = resources.socket_dir
    for i, prompt in enumerate(_prompts(model)[:4]):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, _greedy(60))
    engine.step()
    killed_at = time.monotonic()
    os.kill(client.engine_pids[int(victim)], signal.SIGKILL)
    error = None
    try:
        while engine.has_unfinished_requests():
            engine.step()
    except EngineDeadError as e:
        error = str(e)
    waited = time.monotonic() - killed_at
    llm.shutdown()
    say(
        error=error,
        waited=waited,
        left=wait_gone(pids),
        socket_dir=os.path.exists(socket_dir),
    )


def hold(model: str, generate: str) -> None:
    """Start D = 2, print every process and the socket dir, then wait to be
    killed (generating, if asked, until Ctrl-C)."""
    llm = _llm(model, 2)
    resources = llm.llm_engine.engine_core.resources
    pids = [p.pid for p in resources.engine_procs] + [resources.coordinator_proc.pid]
    say(pids=pids, socket_dir=resources.socket_dir)
    if generate == "1":
        engine = llm.llm_engine
        # (40 tokens: the longest prompt and its output fit the 23 blocks.)
        for i, prompt in enumerate(_prompts(model)):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, _greedy(40))
        engine.step()
        say(generating=True)  # the test's Ctrl-C comes now, mid-generate
        while engine.has_unfinished_requests():
            engine.step()
        say(finished=True)  # too soon: the Ctrl-C did not find it generating
    time.sleep(600)


def traced(model: str, out_dir: str) -> None:
    """The workload at D = 2 with tracing on; the spans file is read by the test."""
    llm = _llm(model, 2, trace_detail="request", trace_dir=out_dir)
    try:
        llm.generate([{"prompt_token_ids": p} for p in _prompts(model)], _greedy(4), use_tqdm=False)
    finally:
        llm.shutdown()
    say(ok=True)


def serving(model: str) -> None:
    """The workload through AsyncLLM at D = 2, all requests at once."""
    import asyncio

    from tracevllm.engine.arg_utils import EngineArgs
    from tracevllm.engine.async_llm import AsyncLLM

    prompts = _prompts(model)

    async def main() -> None:
        engine = AsyncLLM.from_engine_args(
            EngineArgs(
                model=model,
                data_parallel_size=2,
                distributed_executor_backend="uni",
                block_size=4,
                max_num_batched_tokens=16,
                enable_prefix_caching=True,
                num_gpu_blocks_override=24,
                max_model_len=96,
            )
        )
        try:

            async def one(i: int, prompt: list[int]) -> list[int]:
                last = None
                async for out in engine.generate({"prompt_token_ids": prompt}, _greedy(), str(i)):
                    last = out
                assert last is not None and last.finished
                return list(last.outputs[0].token_ids)

            tokens = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            states = await engine.engine_core.call_utility_all_async("get_dp_state")  # type: ignore[attr-defined]
            say(tokens=list(tokens), states=states)
        finally:
            engine.shutdown()

    asyncio.run(main())


def _run(*args: str, timeout: float = 300) -> dict[str, Any]:
    return run_json_lines("tests.test_data_parallel", *args, timeout=timeout)[-1]


# --- the tests ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def dp1(tiny_model_dir: str) -> dict[str, Any]:
    return _run("offline", tiny_model_dir, "1")


@pytest.mark.timeout(600)
def test_dp2_greedy_equals_dp1_and_spreads_requests(
    tiny_model_dir: str, dp1: dict[str, Any]
) -> None:
    dp2 = _run("offline", tiny_model_dir, "2")
    assert dp2["tokens"] == dp1["tokens"]
    assert (dp1["workers"], dp2["workers"]) == (1, 2)  # collective_rpc reached both engines
    # The workload had what it should: preemptions, and a prefix hit on its engine.
    assert dp1["preemptions"] > 0 and dp2["preemptions"] > 0
    # (At least the 20 shared tokens; its own earlier blocks too if they are
    # on that engine, which at D = 2 depends on where it went the first time.)
    assert dp2["idle"], "the coordinator never published both engines idle"
    assert dp1["cached"] >= 20 and dp2["cached"] >= 20, (dp1["cached"], dp2["cached"])
    # Spread over both engines, by each engine's own count.
    states = dp2["states"]
    assert [s["dp_rank"] for s in states] == [0, 1]
    assert len({s["pid"] for s in states}) == 2
    added = [s["num_requests_added"] for s in states]
    assert sum(added) == len(dp1["tokens"]) and min(added) >= 2, added


@pytest.mark.timeout(400)
def test_idle_engine_holds_up_no_one(tiny_model_dir: str) -> None:
    out = _run("idle_engine", tiny_model_dir)
    # The two requests went to different engines, the short one finished
    # while the long one still ran on the other.
    assert sorted(out["engines"]) == [0, 1]
    # The coordinator published the long request's engine as running it
    # (engines[0] is "long"'s: the ids sort as long, short).
    long_engine = out["engines"][0]
    assert any(c[long_engine][1] == 1 for c in out["seen_counts"]), out["seen_counts"][-5:]
    assert 0 <= out["long_tokens_when_short_done"] < 40, out
    # Both idle: the wave ended, and the coordinator says so.
    assert out["running_after_pair"] is False and out["wave_after_pair"] >= 1
    assert all(not s["engines_running"] for s in out["after_pair"])
    # One request alone: its engine ran it, the other took at most one empty
    # turn (joining the wave) and never ran the model; then the wave ended.
    before, after = out["after_pair"], out["after_alone"]
    model_steps = [a["num_model_steps"] - b["num_model_steps"] for a, b in zip(after, before)]
    empty_steps = [a["num_empty_steps"] - b["num_empty_steps"] for a, b in zip(after, before)]
    busy = model_steps.index(max(model_steps))
    assert model_steps[busy] >= 40 and model_steps[1 - busy] == 0, model_steps
    assert empty_steps[1 - busy] <= 1, empty_steps
    assert out["running_after_alone"] is False
    assert out["wave_after_alone"] > out["wave_after_pair"]
    assert [s["current_wave"] for s in after] == [out["wave_after_alone"]] * 2


@pytest.mark.timeout(300)
def test_killed_engine_is_named_and_nothing_is_left(tiny_model_dir: str) -> None:
    out = _run("kill_engine", tiny_model_dir, "1", timeout=150)
    assert out["error"] is not None and "EngineCore_DP1" in out["error"], out
    assert "SIGKILL" in out["error"], out
    assert out["waited"] < 10, out
    assert out["left"] == [] and out["socket_dir"] is False, out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["sigkill", "ctrl_c"])
def test_killed_or_interrupted_frontend_leaves_nothing(tiny_model_dir: str, how: str) -> None:
    """SIGKILL to the frontend alone (idle), or a terminal's Ctrl-C (SIGINT to
    the whole group, mid-generate): no engine, coordinator or socket file left."""
    from tests.executor_scenarios import wait_gone

    generate = "1" if how == "ctrl_c" else "0"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.test_data_parallel", "hold", tiny_model_dir, generate],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO_ROOT,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = ""
        while not line.startswith("{"):
            line = proc.stdout.readline()
            assert line, "the child exited before starting its engines"
        info = json.loads(line)
        if how == "sigkill":
            proc.kill()
        else:
            assert json.loads(proc.stdout.readline()) == {"generating": True}
            os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)
        assert "finished" not in proc.stdout.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert len(info["pids"]) == 3
    assert wait_gone(info["pids"], timeout=20) == []
    deadline = time.monotonic() + 10
    while os.path.exists(info["socket_dir"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(info["socket_dir"])


@pytest.mark.timeout(300)
def test_each_engine_traces_as_its_dp_rank(tiny_model_dir: str, tmp_path: Any) -> None:
    from tracevllm.tracing.exporters import read_spans_jsonl

    _run("traced", tiny_model_dir, str(tmp_path))
    spans = read_spans_jsonl(str(tmp_path / "spans.jsonl"))
    adds = [s for s in spans if s.name == "EngineCore.add_request"]
    assert len(adds) == len(_prompts(tiny_model_dir))
    assert {s.resource["tracevllm.dp_rank"] for s in adds} == {0, 1}
    by_rank = {s.resource["tracevllm.dp_rank"]: s.pid for s in adds}
    assert len(set(by_rank.values())) == 2  # two engine processes
    # Each joins its request's trace, started in the frontend.
    requests = {s.trace_id for s in spans if s.name == "llm_request"}
    assert {s.trace_id for s in adds} <= requests


@pytest.mark.timeout(400)
def test_async_llm_dp2_equals_dp1(tiny_model_dir: str, dp1: dict[str, Any]) -> None:
    out = _run("serving", tiny_model_dir)
    assert out["tokens"] == dp1["tokens"]
    added = [s["num_requests_added"] for s in out["states"]]
    assert sum(added) == len(dp1["tokens"]) and min(added) >= 2, added


@pytest.mark.timeout(400)
def test_serve_dp2_with_the_openai_client(tiny_model_dir: str, dp1: dict[str, Any]) -> None:
    """``tracevllm serve -dp 2``: the same completions as D = 1, from
    concurrent clients; stopping the server stops both engines and the
    coordinator."""
    from concurrent.futures import ThreadPoolExecutor

    import psutil

    from tests.executor_scenarios import wait_gone
    from tests.test_serving import Server

    server = Server(
        tiny_model_dir,
        *("-dp", "2", "--distributed-executor-backend", "uni", "--block-size", "4"),
        *("--max-num-batched-tokens", "16", "--max-model-len", "96"),
    )
    try:
        children = psutil.Process(server.proc.pid).children(recursive=True)
        pids = [p.pid for p in children if "resource_tracker" not in " ".join(p.cmdline())]
        # Two engine cores and the coordinator.
        assert len(pids) == 3, [p.cmdline() for p in children]
        client = server.client()
        prompts = _prompts(tiny_model_dir)

        def complete(prompt: list[int]) -> str:
            out = client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=NUM_TOKENS,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            return out.choices[0].text

        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(complete, prompts))
        assert texts == dp1["texts"]
    finally:
        assert server.stop() == 0
    assert wait_gone(pids) == []


def test_dp_needs_engine_processes(tiny_model_dir: str) -> None:
    """D engines cannot share the caller's process: refused before any loads."""
    from tracevllm import LLM

    with pytest.raises(ValueError, match="data_parallel_size > 1 runs each engine core"):
        LLM(model=tiny_model_dir, data_parallel_size=2, enable_multiprocessing=False)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])

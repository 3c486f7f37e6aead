"""The course labs (chapters/): wired to the engine, their tests not hollow,
and pluggable into a running engine with TRACEVLLM_LAB."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tracevllm import labs
from tracevllm.labs import LABS, LabError, lab_override, reference

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = ROOT / "chapters"
BOOK_PAGES = {
    "01": "scheduling.md",
    "02": "kv-cache.md",
    "03": "input-preparation.md",
    "04": "paged-attention.md",
    "05": "sampling.md",
    "06": "output-processing.md",
}


def load_path(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def signature(fn: Any) -> inspect.Signature:
    """The signature, less the annotation of ``self`` (a method's lab is a plain
    function that annotates it)."""
    sig = inspect.signature(fn)
    params = [
        p.replace(annotation=inspect.Parameter.empty) if p.name == "self" else p
        for p in sig.parameters.values()
    ]
    return sig.replace(parameters=params)


@pytest.mark.parametrize("number", sorted(LABS))
def test_lab_folder_matches_the_engine(number: str) -> None:
    """Each lab has its three files, a skeleton with the engine function's exact
    signature, a hook in the engine, and a README linking its book chapter."""
    lab = LABS[number]
    folder = CHAPTERS / f"{number}-{lab.topic}"
    assert sorted(p.name for p in folder.iterdir() if p.suffix in (".py", ".md")) == [
        "README.md",
        "lab.py",
        "test_lab.py",
    ]
    engine_fn = reference(lab.function)  # the hook registered it at import
    assert engine_fn.__name__ == lab.function
    skeleton = getattr(load_path(folder / "lab.py", f"skeleton_{number}"), lab.function)
    assert signature(skeleton) == signature(engine_fn)
    readme = (folder / "README.md").read_text()
    assert f"(../../docs/chapters/{BOOK_PAGES[number]})" in readme
    assert "vLLM 0.22.0" in readme and f"make lab CH={number}" in readme


def test_labs_check_on_one_lab() -> None:
    """chapters/check_labs.py: lab 06's tests pass on the engine's function and
    all fail on the skeleton (the full check is `make labs-check`)."""
    proc = subprocess.run(
        [sys.executable, str(CHAPTERS / "check_labs.py"), "06"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "06-stop-strings" in proc.stdout and "ok" in proc.stdout


def test_labs_check_catches_a_hollow_test() -> None:
    """A skeleton that passes a test is reported (here: a 'skeleton' that is the
    reference itself), and so is a reference that fails one."""
    checker = load_path(CHAPTERS / "check_labs.py", "chapters_check_labs")
    lab = CHAPTERS / "06-stop-strings"
    ref = checker.Outcome(passed=["a", "b"])
    ok, _ = checker.judge(lab, ref, checker.Outcome(failed=["a", "b"]), "lab.py")
    assert ok
    ok, report = checker.judge(lab, ref, checker.Outcome(passed=["a"], failed=["b"]), "lab.py")
    assert not ok and "prove nothing: ['a']" in report
    ok, report = checker.judge(lab, checker.Outcome(passed=["a"], failed=["b"]), ref, "lab.py")
    assert not ok and "against the reference, 1 failed" in report


# --- TRACEVLLM_LAB ---------------------------------------------------------------


def test_no_lab_means_the_engine_function_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRACEVLLM_LAB", raising=False)

    def f() -> None: ...

    assert lab_override("check_stop_strings", f) is f
    monkeypatch.setenv("TRACEVLLM_LAB", "06")  # another hook's lab: untouched too
    assert lab_override("compute_slot_mapping", f) is f


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("99", "TRACEVLLM_LAB=99: there is no lab 99. Labs: 01 (token-budget)"),
        ("7", "there is no lab 07"),
        ("01,abc", "a lab is a number or a lab folder named NN-topic"),
        ("/nonexistent/03-slot-mapping", "/nonexistent/03-slot-mapping/lab.py does not exist"),
    ],
)
def test_bad_lab_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, value: str, message: str
) -> None:
    monkeypatch.setenv("TRACEVLLM_LAB", value)
    with pytest.raises(LabError, match=message.replace("(", r"\(").replace(")", r"\)")):
        lab_override("check_stop_strings", lambda: None)


def test_lab_without_the_function_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    folder = tmp_path / "06-stop-strings"
    folder.mkdir()
    (folder / "lab.py").write_text("def check_stop_string(): ...\n")  # a typo
    monkeypatch.setenv("TRACEVLLM_LAB", str(folder))
    monkeypatch.setattr(labs, "_LOADED", {})  # leave no loaded lab behind
    with pytest.raises(LabError, match=r"does not define a function check_stop_strings\(\)"):
        lab_override("check_stop_strings", lambda: None)
    assert labs.find_lab_file("6")[1] == CHAPTERS / "06-stop-strings" / "lab.py"


# A lab.py for every lab that hands each call to the engine's own function and
# counts the calls: plugged in, the engine must produce exactly the same output.
PASS_THROUGH_LAB = """
from tracevllm.labs import reference

CALLS = 0
_engine = reference({name!r})


def {name}(*args, **kwargs):
    global CALLS
    CALLS += 1
    return _engine(*args, **kwargs)
"""

# Runs requests that reach every hook: chunked prefills and a prefix-cache hit
# (01, 02, 03), attention (04), a seeded top-k/top-p sample (05), and a stop
# string (06) cut from the greedy text.
GENERATE = textwrap.dedent(
    """
    from tracevllm import LLM, SamplingParams


    def run(model_dir):
        llm = LLM(
            model=model_dir,
            enable_multiprocessing=False,
            block_size=4,
            num_gpu_blocks_override=64,
            max_num_batched_tokens=32,
        )
        prompt = "The scheduler decides which requests run in each step of the engine. " * 2
        greedy = SamplingParams(max_tokens=12, temperature=0)
        first = llm.generate([prompt], greedy)[0].outputs[0]
        stop = first.text[len(first.text) // 2 :][:3]
        outs = llm.generate(
            [prompt, prompt + " And then?", "Hello, world!", prompt],
            [
                greedy,
                greedy,
                SamplingParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.8, seed=7),
                SamplingParams(max_tokens=12, temperature=0, stop=[stop]),
            ],
        )
        llm.shutdown()
        result = {
            "tokens": [first.token_ids] + [o.outputs[0].token_ids for o in outs],
            "texts": [first.text] + [o.outputs[0].text for o in outs],
            "stop": stop,
            "finish": [o.outputs[0].finish_reason for o in outs],
        }
        import tracevllm.labs as labs

        result["calls"] = {
            p.parent.name[:2]: m.CALLS for p, m in labs._LOADED.items()
        }
        return result
    """
)


def _run_in_subprocess(model_dir: str, lab_env: str) -> dict[str, Any]:
    """GENERATE in a fresh interpreter: hooks resolve when the engine is imported."""
    env = dict(os.environ, TRACEVLLM_ENABLE_MULTIPROCESSING="0", TRACEVLLM_LAB=lab_env)
    code = GENERATE + "\nimport json, sys\nprint('RESULT=' + json.dumps(run(sys.argv[1])))\n"
    proc = subprocess.run(
        [sys.executable, "-c", code, model_dir],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT="))
    return json.loads(line.removeprefix("RESULT="))  # type: ignore[no-any-return]


def test_plugged_labs_serve_the_same_output(tiny_model_dir: str, tmp_path: Path) -> None:
    """TRACEVLLM_LAB with all six labs (each a pass-through to the engine's own
    function) gives the same tokens as the engine alone, and every lab
    function was called. The engine runs in-process (no engine process), the
    plugged one in a fresh interpreter."""
    folders = []
    for number, lab in sorted(LABS.items()):
        folder = tmp_path / f"{number}-{lab.topic}"
        folder.mkdir()
        (folder / "lab.py").write_text(PASS_THROUGH_LAB.format(name=lab.function))
        folders.append(str(folder))
    namespace: dict[str, Any] = {}
    exec(GENERATE, namespace)  # the baseline, here: no lab is plugged into this process
    baseline = namespace["run"](tiny_model_dir)
    plugged = _run_in_subprocess(tiny_model_dir, ",".join(folders))

    assert baseline["calls"] == {}
    assert plugged["tokens"] == baseline["tokens"]
    assert plugged["texts"] == baseline["texts"]
    assert plugged["finish"] == baseline["finish"]
    assert baseline["finish"][3] == "stop"  # the stop string was found
    assert (
        baseline["texts"][4] == baseline["texts"][0][: baseline["texts"][0].index(plugged["stop"])]
    )
    assert sorted(plugged["calls"]) == sorted(LABS)
    assert all(n > 0 for n in plugged["calls"].values()), plugged["calls"]

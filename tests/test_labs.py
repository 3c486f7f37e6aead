"""The course labs (chapters/): wired to the engine, their tests not hollow,
and pluggable into a running engine with TRACEVLLM_LAB."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
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
BOOK = "http://127.0.0.1:8000/"  # where `make docs-serve` serves the built book
BOOK_PAGES = {
    "01": "scheduling",
    "02": "kv-cache",
    "03": "input-preparation",
    "04": "paged-attention",
    "05": "sampling",
    "06": "sampling",
    "07": "kv-cache",
    "08": "kv-cache",
    "09": "sampling",
    "10": "pytorch-to-triton",
    "11": "structured-outputs",
    "12": "speculative-decoding",
    "13": "model-families",
    "14": "scaling-out",
    "15": "kv-connectors",
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
    # The built page (rendered, with its code), not the markdown source.
    assert f"({BOOK}chapters/{BOOK_PAGES[number]}.html" in readme
    assert (ROOT / "docs" / "chapters" / f"{BOOK_PAGES[number]}.md").is_file()
    assert "../../docs/" not in readme
    assert "vLLM 0.22.0" in readme and f"make lab CH={number}" in readme


def _section(markdown: str, title: str) -> str:
    """The text of the ``## title`` section, up to the next ``## ``."""
    match = re.search(rf"^## {title}\n(.*?)(?=^## |\Z)", markdown, re.S | re.M)
    assert match is not None, f"no ## {title} section"
    return match.group(1)


@pytest.mark.parametrize("number", sorted(LABS))
def test_lab_hints_state_rules_not_code(number: str) -> None:
    """A hint says what must hold, with an example; it does not hand over code:
    no code block, and no inline code that calls, indexes or assigns."""
    lab = LABS[number]
    hints = _section((CHAPTERS / f"{number}-{lab.topic}" / "README.md").read_text(), "Hints")
    assert "```" not in hints, f"lab {number}: a code block in the hints"
    # A call, an index, or an assignment to a name (a one-letter name is an
    # example's variable: `Q = 2`).
    looks_like_code = re.compile(r"\w[(\[]|[A-Za-z_][\w.]{2,}\s*=")
    code = [c for c in re.findall(r"`([^`]+)`", hints) if looks_like_code.search(c)]
    assert not code, f"lab {number}: the hints hand over code: {code}"


# A fence whose only line embeds a source section.
EMBED = re.compile(
    r'^(?P<indent>[ \t]*)```\w+[^\n]*\n[ \t]*--8<-- "(?P<path>[^":]+):(?P<section>[^"]+)"', re.M
)


def _section_source(path: str, section: str) -> str:
    text = (ROOT / path).read_text()
    start = text.index(f"--8<-- [start:{section}]")
    return text[start : text.index(f"--8<-- [end:{section}]")]


def test_the_book_folds_every_lab_solution() -> None:
    """A chapter may show the code a lab asks for only folded away, in a
    collapsed "Solution — after lab NN" admonition, so that a reader doing the
    lab meets the rule first."""
    folded = 0
    for page in sorted((ROOT / "docs").rglob("*.md")):
        lines = page.read_text().splitlines()
        text = "\n".join(lines)
        for m in EMBED.finditer(text):
            source = _section_source(m["path"], m["section"])
            for number, lab in LABS.items():
                if not re.search(rf"def {lab.function}\(", source):
                    continue
                where = f"{page.relative_to(ROOT)}: {m['path']}:{m['section']}"
                # The admonition that holds the embed: the last less-indented
                # line above it must open it.
                line_no = text[: m.start()].count("\n")
                indent = len(m["indent"])
                assert indent > 0, f"{where} shows lab {number}'s solution unfolded"
                opener = next(
                    line
                    for line in reversed(lines[:line_no])
                    if line.strip() and len(line) - len(line.lstrip()) < indent
                )
                assert opener.startswith("??? ") and f"Solution — after lab {number}" in opener, (
                    f"{where}: lab {number}'s solution must sit in a collapsed "
                    f"admonition titled 'Solution — after lab {number}', not under {opener!r}"
                )
                folded += 1
    assert folded >= 8  # labs 01-06, 09 and 10 (07 and 08: the book does not embed them)


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
        ("42", "there is no lab 42"),
        ("10", "the engine never calls blocked_attention() (see chapters/10-online-softmax"),
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
# (01, 02, 03), attention (04), a seeded top-k/top-p sample (05), a stop
# string (06) cut from the greedy text, a choice (11, the grammar bitmask), then
# greedy and sampled requests with drafts (12, the acceptance rule).
GENERATE = textwrap.dedent(
    """
    from tracevllm import LLM, SamplingParams
    from tracevllm.sampling_params import StructuredOutputsParams


    def run(model_dir):
        llm = LLM(
            model=model_dir,
            enable_multiprocessing=False,
            block_size=4,
            num_gpu_blocks_override=64,
            max_model_len=64 * 4,
            max_num_batched_tokens=32,
        )
        prompt = "The scheduler decides which requests run in each step of the engine. " * 2
        greedy = SamplingParams(max_tokens=12, temperature=0)
        first = llm.generate([prompt], greedy)[0].outputs[0]
        stop = first.text[len(first.text) // 2 :][:3]
        outs = llm.generate(
            [prompt, prompt + " And then?", "Hello, world!", prompt, "Yes or no?"],
            [
                greedy,
                greedy,
                SamplingParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.8, seed=7),
                SamplingParams(max_tokens=12, temperature=0, stop=[stop]),
                SamplingParams(
                    max_tokens=4,
                    temperature=0,
                    structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
                ),
            ],
        )
        llm.shutdown()
        # The model drafting for itself: every step has drafts to verify.
        spec = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 2}
        llm = LLM(model=model_dir, enable_multiprocessing=False, speculative_config=spec)
        outs += llm.generate(
            [prompt, "Hello, world!"],
            [greedy, SamplingParams(max_tokens=8, temperature=0.8, seed=3)],
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


def _python(code: str, lab_env: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter, one process, with TRACEVLLM_LAB set:
    hooks resolve when the engine is imported."""
    env = dict(os.environ, TRACEVLLM_ENABLE_MULTIPROCESSING="0", TRACEVLLM_LAB=lab_env)
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _run_in_subprocess(model_dir: str, lab_env: str) -> dict[str, Any]:
    """GENERATE in a fresh interpreter."""
    code = GENERATE + "\nimport json, sys\nprint('RESULT=' + json.dumps(run(sys.argv[1])))\n"
    proc = _python(code, lab_env, model_dir)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT="))
    return json.loads(line.removeprefix("RESULT="))  # type: ignore[no-any-return]


def test_plugged_labs_serve_the_same_output(tiny_model_dir: str, tmp_path: Path) -> None:
    """TRACEVLLM_LAB with every pluggable lab (each a pass-through to the engine's own
    function) gives the same tokens as the engine alone, and every lab
    function was called. The engine runs in-process (no engine process), the
    plugged one in a fresh interpreter."""
    folders = []
    pluggable = {
        number: lab
        for number, lab in LABS.items()
        if lab.span is not None and number not in NEEDS_A_MOE_MODEL | NEEDS_A_CPU_TIER
    }
    for number, lab in sorted(pluggable.items()):
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
    assert baseline["texts"][5] in ("yes", "no")  # the choice was masked
    assert (
        baseline["texts"][4] == baseline["texts"][0][: baseline["texts"][0].index(plugged["stop"])]
    )
    assert sorted(plugged["calls"]) == sorted(pluggable)
    assert all(n > 0 for n in plugged["calls"].values()), plugged["calls"]


# Labs whose function only a mixture-of-experts model calls (a Llama has no
# MoE layer): plugged in below, into a MoE layer.
NEEDS_A_MOE_MODEL = {"13"}
# Labs whose function only an engine with a CPU tier for KV blocks calls
# (--kv-offloading-size): plugged in below, into one.
NEEDS_A_CPU_TIER = {"15"}

# A shared 64-token prefix, evicted from a 20-block pool (8 tokens a block)
# by two long prompts, then asked for again: the tier holds it.
OFFLOAD_GENERATE = textwrap.dedent(
    """
    import random
    from tracevllm import LLM, SamplingParams

    def run(model_dir):
        rng = random.Random(0)
        tokens = lambda n: [rng.randrange(5, 250) for _ in range(n)]
        prefix = tokens(64)
        rounds = [[prefix + tokens(5)], [tokens(100)], [tokens(100)], [prefix + tokens(7)]]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        results = []
        with LLM(model=model_dir, enable_multiprocessing=False, block_size=8,
                 num_gpu_blocks_override=20, max_model_len=160,
                 kv_offloading_size=0.01) as llm:
            for prompts in rounds:
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                    use_tqdm=False)
                results += [(o.outputs[0].token_ids, o.num_cached_tokens) for o in outs]
        import tracevllm.labs as labs

        calls = {p.parent.name[:2]: m.CALLS for p, m in labs._LOADED.items()}
        return {"tokens": [t for t, _ in results], "cached": [c for _, c in results],
                "calls": calls}
    """
)


def test_the_offload_lookup_lab_finds_an_evicted_prefix_in_the_tier(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """TRACEVLLM_LAB=15 (a pass-through lab.py) in an engine with a CPU tier:
    the connector asks the lab's lookup for every request it admits, the
    evicted prefix comes back from the tier (64 cached tokens), and the
    tokens are the engine's own. (Mutation caught: a lab.py whose lookup
    answers 0: cached [0, 0, 0, 0].)"""
    folder = tmp_path / "15-offload-lookup"
    folder.mkdir()
    (folder / "lab.py").write_text(PASS_THROUGH_LAB.format(name="_lookup"))
    namespace: dict[str, Any] = {}
    exec(OFFLOAD_GENERATE, namespace)  # the baseline: no lab plugged into this process
    baseline = namespace["run"](tiny_model_dir)
    code = (
        OFFLOAD_GENERATE + "\nimport json, sys\nprint('RESULT=' + json.dumps(run(sys.argv[1])))\n"
    )
    proc = _python(code, str(folder), tiny_model_dir)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT="))
    plugged = json.loads(line.removeprefix("RESULT="))
    assert baseline["calls"] == {}
    assert plugged["tokens"] == baseline["tokens"]
    assert plugged["cached"] == baseline["cached"] == [0, 0, 0, 64]
    assert plugged["calls"]["15"] >= 4  # once per request admitted, at least
    assert proc.stderr.count(f"lab 15: _lookup from {folder / 'lab.py'}") == 1, proc.stderr


PLUGGED_MOE_LAYER = textwrap.dedent(
    """
    import json, sys
    import torch
    from tracevllm.model_executor.layers.fused_moe import FusedMoE, fused_experts
    from tracevllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk
    import tracevllm.labs as labs

    torch.manual_seed(0)
    layer = FusedMoE(8, 2, 16, 12, tp_size=1)
    with torch.no_grad():
        layer.w13_weight.normal_(0, 0.2)
        layer.w2_weight.normal_(0, 0.2)
    hidden, logits = torch.randn(10, 16), torch.randn(10, 8) * 2
    out = layer(hidden, logits)
    engine = labs.reference("fused_topk")
    weights, ids, _ = engine(hidden, logits, 2, True)
    want = fused_experts(hidden, layer.w13_weight, layer.w2_weight, weights, ids)
    calls = {p.parent.name[:2]: m.CALLS for p, m in labs._LOADED.items()}
    print("RESULT=" + json.dumps({
        "calls": calls,
        "same": bool(torch.equal(out, want)),
        "hooked": fused_topk is not engine,
    }))
    """
)


def test_the_moe_router_lab_routes_the_real_layer(tmp_path: Path) -> None:
    """TRACEVLLM_LAB=13 (a pass-through lab.py): FusedMoE's forward calls the
    lab's fused_topk instead of the engine's, with the same output, and the
    engine says which file it loaded."""
    folder = tmp_path / "13-moe-router"
    folder.mkdir()
    (folder / "lab.py").write_text(PASS_THROUGH_LAB.format(name="fused_topk"))
    proc = _python(PLUGGED_MOE_LAYER, str(folder))
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT="))
    result = json.loads(line.removeprefix("RESULT="))
    assert result == {"calls": {"13": 1}, "same": True, "hooked": True}, result
    assert proc.stderr.count(f"lab 13: fused_topk from {folder / 'lab.py'}") == 1, proc.stderr


MOE_GENERATE = textwrap.dedent(
    """
    import json, sys
    from tracevllm import LLM, SamplingParams

    def run(model_dir, trace_dir):
        with LLM(model=model_dir, enable_multiprocessing=False, trace_detail="full",
                 trace_dir=trace_dir) as llm:
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in ([5, 6, 7, 8, 9], [10, 11, 12, 13])],
                SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                use_tqdm=False,
            )
        import tracevllm.labs as labs

        calls = {p.parent.name[:2]: m.CALLS for p, m in labs._LOADED.items()}
        return {"tokens": [o.outputs[0].token_ids for o in outs], "calls": calls}
    """
)


def test_the_moe_router_lab_serves_a_moe_model(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """TRACEVLLM_LAB=13 (a pass-through lab.py) while a tiny Qwen3-MoE
    generates: the same tokens as the engine's own router, the lab called in
    every MoE layer of every step, and each FusedMoE.forward span names it."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.family_check import new_checkpoint_dir, save_hf_model, tiny_config_kwargs
    from tracevllm.tracing.exporters import read_spans_jsonl

    model_dir, vocab_size = new_checkpoint_dir(tmp_path_factory, "lab13-qwen3-moe")
    config = Qwen3MoeConfig(
        **tiny_config_kwargs(
            vocab_size, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True,
        )
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # HF starts the router at zero: every expert tied
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    save_hf_model(model, model_dir)

    folder = tmp_path / "13-moe-router"
    folder.mkdir()
    (folder / "lab.py").write_text(PASS_THROUGH_LAB.format(name="fused_topk"))
    namespace: dict[str, Any] = {}
    exec(MOE_GENERATE, namespace)  # the baseline, here: no lab is plugged into this process
    baseline = namespace["run"](model_dir, str(tmp_path / "baseline"))
    code = MOE_GENERATE + "\nprint('RESULT=' + json.dumps(run(sys.argv[1], sys.argv[2])))\n"
    proc = _python(code, str(folder), model_dir, str(tmp_path / "plugged"))
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT="))
    plugged = json.loads(line.removeprefix("RESULT="))

    assert baseline["calls"] == {}
    assert plugged["tokens"] == baseline["tokens"]
    spans = read_spans_jsonl(str(tmp_path / "plugged" / "spans.jsonl"))
    moe = [s for s in spans if s.name == "FusedMoE.forward"]
    # Every MoE layer (both) of every step called the lab's router once.
    assert len(moe) == plugged["calls"]["13"] > 0
    named = f"13: fused_topk from {folder / 'lab.py'}"
    assert all(s.attributes.get("tracevllm.labs") == [named] for s in moe)


def test_a_plugged_lab_says_so(tiny_model_dir: str, tmp_path: Path) -> None:
    """TRACEVLLM_LAB=03,04 prints one line naming each lab's file when the
    engine loads it, tags the spans its function ran under (``tracevllm.labs``;
    lab 04's are spans inside the model's forward, made after it), and the live
    view prints the slot mapping lab 03 computed."""
    folders = []
    for folder, function in (
        (tmp_path / "03-slot-mapping", "compute_slot_mapping"),
        (tmp_path / "04-paged-attention", "unified_attention_torch"),
    ):
        folder.mkdir()
        (folder / "lab.py").write_text(PASS_THROUGH_LAB.format(name=function))
        folders.append(str(folder))
    code = textwrap.dedent(
        """
        import sys
        from tracevllm import LLM, SamplingParams

        llm = LLM(model=sys.argv[1], enable_multiprocessing=False, trace_detail="full",
                  trace_dir=sys.argv[2], trace_live_views=True)
        llm.generate(["Hello, world!"], SamplingParams(max_tokens=2, temperature=0))
        llm.shutdown()
        """
    )
    proc = _python(code, ",".join(folders), tiny_model_dir, str(tmp_path / "trace"))
    named = f"03: compute_slot_mapping from {tmp_path / '03-slot-mapping' / 'lab.py'}"
    attention = f"04: unified_attention_torch from {tmp_path / '04-paged-attention' / 'lab.py'}"
    for lab in (named, attention):
        assert proc.stderr.count(f"lab {lab}") == 1, proc.stderr[-2000:]
    from tracevllm.tracing.exporters import read_spans_jsonl

    spans = read_spans_jsonl(str(tmp_path / "trace" / "spans.jsonl"))
    tagged = {s.name for s in spans if s.attributes.get("tracevllm.labs") == [named]}
    assert tagged == {"ModelRunner._prepare_inputs"}
    reads = [s for s in spans if s.name == "unified_attention"]
    assert {s.attributes["tracevllm.layer"] for s in reads} == {0, 1}  # every layer's read
    assert all(s.attributes.get("tracevllm.labs") == [attention] for s in reads)
    assert {s.name for s in spans if "tracevllm.labs" in s.attributes} == {
        "ModelRunner._prepare_inputs",
        "unified_attention",
    }
    prepared = [s for s in spans if s.name == "ModelRunner._prepare_inputs"]
    first = " ".join(str(slot) for slot in prepared[0].attributes["tracevllm.slot_mapping"])
    assert f"slot_mapping [{first}]" in " ".join(proc.stdout.split())


def test_the_engine_core_process_says_which_labs_it_runs(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """With the engine core in its own process (the default), that process
    names the plugged lab too, with its pid: the lab's function runs there."""
    folder = tmp_path / "03-slot-mapping"
    folder.mkdir()
    (folder / "lab.py").write_text(
        PASS_THROUGH_LAB.format(name="compute_slot_mapping")
        + "\nimport os, sys\nprint(f'lab.py loaded in pid {os.getpid()}', file=sys.stderr)\n"
    )
    code = textwrap.dedent(
        """
        import os, sys
        from tracevllm import LLM, SamplingParams

        print(f"frontend pid {os.getpid()}", file=sys.stderr, flush=True)
        llm = LLM(model=sys.argv[1])
        llm.generate(["Hello, world!"], SamplingParams(max_tokens=2, temperature=0))
        llm.shutdown()
        """
    )
    env = dict(os.environ, TRACEVLLM_ENABLE_MULTIPROCESSING="1", TRACEVLLM_LAB=str(folder))
    proc = subprocess.run(
        [sys.executable, "-c", code, tiny_model_dir],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    (frontend,) = re.findall(r"frontend pid (\d+)", proc.stderr)
    named = f"lab 03: compute_slot_mapping from {folder / 'lab.py'}"
    said = re.findall(re.escape(named) + r" \(engine core process, pid (\d+)\)", proc.stderr)
    assert len(said) == 1 and said[0] != frontend, proc.stderr[-2000:]
    # ... and that is where the lab's code was loaded (and ran).
    assert said[0] in re.findall(r"lab.py loaded in pid (\d+)", proc.stderr), proc.stderr[-2000:]

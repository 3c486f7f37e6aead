"""The lab loop: a student runs any lab's function in a traced run with one
command (``TRACEVLLM_LAB=NN make trace ... ARGS=...``), sees it named in the
views, and is told when it never ran and what it needs. Labs are found in the
checkout of the working directory (tracevllm/labs.py)."""

from __future__ import annotations

import html
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.test_labs import PASS_THROUGH_LAB
from tracevllm import labs
from tracevllm.labs import LABS, LabError

ROOT = Path(__file__).resolve().parents[1]

# The `tracevllm trace` flags (past the tiny model) that make the engine call
# each lab's function: what LABS[...].needs says, for a tiny model.
NEEDS_FLAGS: dict[str, list[str]] = {
    "04": ["--attention-backend", "torch"],
    "05": ["--temperature", "0.8", "--top-p", "0.9", "--sampling-seed", "1"],
    "06": ["--stop", "never in this text"],
    "11": ["--choice", "yes,no"],
    "12": ["--speculative-config", "DRAFT"],  # the tiny model drafting for itself
    "13": ["--model", "MOE"],
    "15": ["--kv-offloading-size", "0.01"],
}
ENGINE_LABS = sorted(number for number, lab in LABS.items() if lab.span is not None)


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.test_family_qwen3_moe import _qwen3_moe

    path, _ = _qwen3_moe(tmp_path_factory, "lab-loop-moe", norm_topk_prob=True)
    return str(path)


def _pass_through(tmp_path: Path, numbers: list[str]) -> str:
    """Lab folders whose lab.py hands each call to the engine's own function."""
    folders = []
    for number in numbers:
        folder = tmp_path / f"{number}-{LABS[number].topic}"
        folder.mkdir()
        (folder / "lab.py").write_text(PASS_THROUGH_LAB.format(name=LABS[number].function))
        folders.append(str(folder))
    return ",".join(folders)


def _flags(numbers: list[str], model: str, moe: str) -> list[str]:
    flags = ["--model", model]
    draft = {"method": "draft_model", "model": model, "num_speculative_tokens": 2}
    for number in numbers:
        for flag in NEEDS_FLAGS.get(number, []):
            flags.append({"DRAFT": json.dumps(draft), "MOE": moe}.get(flag, flag))
    return flags


def _trace(
    lab_env: str, out: Path, flags: list[str], **env: str
) -> tuple[subprocess.CompletedProcess[str], str]:
    """`tracevllm trace` (its Python entry, one process) with TRACEVLLM_LAB set;
    returns the run and the text of the views.html it wrote."""
    code = "import sys; from tracevllm.entrypoints.cli import main; sys.exit(main())"
    argv = ["trace", "--prompt", "Hello, world!", "--raw", "--max-tokens", "4"]
    argv += ["--no-mp", "--detail", "full", "--out", str(out), *flags]
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv],
        cwd=ROOT, env=dict(os.environ, TRACEVLLM_LAB=lab_env, COLUMNS="160", **env),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, _html_text(out / "views.html")


def _html_text(path: Path) -> str:
    """The text the views.html shows (tags out, entities back), one space per gap."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", path.read_text())).split())


@pytest.mark.parametrize("number", ENGINE_LABS)
def test_each_lab_runs_in_a_traced_run_and_is_named_in_the_views(
    number: str, tiny_model_dir: str, moe_model_dir: str, tmp_path: Path
) -> None:
    """With the flags its ``needs`` names, the plugged lab's function runs and
    the recorded views (views.html) say where: its lab.py and the span it ran
    under; nothing says it never ran. (Mutations caught: the lab not plugged,
    the run markers never written, the views saved empty.)"""
    lab = LABS[number]
    folder = _pass_through(tmp_path, [number])
    _, views = _trace(folder, tmp_path / "trace", _flags([number], tiny_model_dir, moe_model_dir))
    path = Path(folder) / "lab.py"
    said = f"lab {number}: {lab.function} from {path} ran in pid"
    assert said in views, views[-3000:]
    if lab.span:  # the span the engine calls it under is named
        assert re.search(re.escape(said) + r" \d+, under (\S+, )*" + re.escape(lab.span), views)
    assert "never ran" not in views
    assert "Scheduler.schedule" in views  # the views themselves are there, not only the line


def test_a_plugged_lab_that_never_ran_says_what_it_needs(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """Labs 05, 06, 11 and 12 plugged into a greedy run with none of their
    flags: each is named at the end of the run, in the views and on the
    terminal, with what it needs; no temporary folder is left behind.
    (Mutation caught: the warning never fires.)"""
    numbers = ["05", "06", "11", "12"]
    tmp = tmp_path / "tmp"  # the run's temporary folders, and nothing else's
    tmp.mkdir()
    proc, views = _trace(
        _pass_through(tmp_path, numbers),
        tmp_path / "t",
        ["--model", tiny_model_dir],
        TMPDIR=str(tmp),
    )
    terminal = " ".join(proc.stdout.split())
    for number in numbers:
        lab = LABS[number]
        warning = " ".join(labs.never_ran(lab).split())
        assert warning in views and warning in terminal, views[-3000:]
        assert lab.needs.split(" (")[0] in warning
    assert "--speculative-config" in views and "--choice A,B" in views
    assert "ran in pid" not in views
    assert not list(tmp.glob("tracevllm-labs-*"))


def test_a_lab_that_never_ran_warns_at_exit_outside_trace(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """Any run, not only `tracevllm trace`: LLM.generate with lab 12 plugged
    and no drafts warns on stderr as the process ends, once; the engine core
    in its own process (the default) marks what ran there, so lab 03 does not
    warn. (Mutation caught: markers from the engine core's process not read.)"""
    folders = _pass_through(tmp_path, ["03", "12"])
    code = (
        "import sys\nfrom tracevllm import LLM, SamplingParams\n"
        "llm = LLM(model=sys.argv[1])\n"
        "llm.generate(['Hello'], SamplingParams(max_tokens=2, temperature=0))\n"
        "llm.shutdown()\n"
    )
    env = dict(os.environ, TRACEVLLM_LAB=folders, TRACEVLLM_ENABLE_MULTIPROCESSING="1")
    proc = subprocess.run(
        [sys.executable, "-c", code, tiny_model_dir],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count(f"warning: {labs.never_ran(LABS['12'])}") == 1, proc.stderr[-3000:]
    assert "lab 03 was loaded but never ran" not in proc.stderr


def test_make_trace_passes_engine_flags_to_a_plugged_lab(
    tiny_model_dir: str, tmp_path: Path
) -> None:
    """`TRACEVLLM_LAB=... make trace ARGS="--speculative-config '{...}'"`: the
    flags reach the engine (two processes, the default), lab 12's function
    runs in the engine core and the views name it. (Mutation caught: the
    trace target without $(ARGS).)"""
    folder = _pass_through(tmp_path, ["12"])
    draft = json.dumps(
        {"method": "draft_model", "model": tiny_model_dir, "num_speculative_tokens": 2}
    )
    args = f"--model {shlex.quote(tiny_model_dir)} --raw --speculative-config {shlex.quote(draft)}"
    out = tmp_path / "trace"
    proc = subprocess.run(
        ["make", "--no-print-directory", "trace", "PROMPT=Hello, world!", "MAX_TOKENS=4",
         f"TRACE_DIR={out}", f"ARGS={args}"],
        cwd=ROOT, env=dict(os.environ, TRACEVLLM_LAB=folder), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    views = _html_text(out / "views.html")
    assert re.search(
        rf"lab 12: accept_draft_tokens from {re.escape(folder)}/lab.py ran in pid \d+, "
        r"under RejectionSampler.forward",
        views,
    ), views[-3000:]
    # The engine core said so from its own process.
    assert re.search(r"lab 12: .*\(engine core process, pid \d+\)", proc.stderr)


def test_trace_views_html_holds_the_views(tiny_model_dir: str, tmp_path: Path) -> None:
    """views.html holds what views.svg holds (the step views, the completion,
    the waterfall), not an empty page. (Mutation caught: save_svg clearing the
    recording before save_html.)"""
    _, views = _trace("", tmp_path / "t", ["--model", tiny_model_dir])
    assert (tmp_path / "t" / "views.html").stat().st_size > 10_000
    for shown in ("Scheduler.schedule", "LLM.generate", "EngineCore.step"):
        assert shown in views


# --- which checkout's labs ---------------------------------------------------------


def _checkout(root: Path) -> Path:
    """A folder that looks like a tracevllm checkout, with lab 03's skeleton."""
    (root / "tracevllm").mkdir(parents=True)
    (root / "tracevllm" / "labs.py").write_text("")
    (root / "chapters" / "03-slot-mapping").mkdir(parents=True)
    (root / "chapters" / "check_labs.py").write_text("")
    (root / "chapters" / "03-slot-mapping" / "lab.py").write_text("")
    return root


def test_a_lab_number_is_found_in_the_working_directorys_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A student's clone that shares another checkout's venv runs its own lab:
    from anywhere inside the clone, lab 03 is the clone's lab.py, not the
    lab.py of the checkout tracevllm was imported from. (Mutation caught:
    chapters/ found next to the imported package.)"""
    clone = _checkout(tmp_path / "clone")
    (clone / "chapters" / "03-slot-mapping" / "sub").mkdir()
    monkeypatch.chdir(clone / "chapters" / "03-slot-mapping" / "sub")
    assert labs.find_lab_file("3")[1] == clone / "chapters" / "03-slot-mapping" / "lab.py"
    assert labs.find_lab_file("03")[1] != ROOT / "chapters" / "03-slot-mapping" / "lab.py"


def test_a_lab_number_outside_a_checkout_is_refused_with_the_full_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside any checkout a number is refused, naming the full path of the
    file it would have loaded; a lab's own path still works from there."""
    monkeypatch.chdir(tmp_path)
    meant = labs.package_checkout() / "chapters" / "03-slot-mapping" / "lab.py"
    with pytest.raises(LabError, match=re.escape(f"lab 03 would be {meant}")):
        labs.find_lab_file("3")
    folder = _checkout(tmp_path / "mine") / "chapters" / "03-slot-mapping"
    assert labs.find_lab_file(str(folder)) == (LABS["03"], folder / "lab.py")


def test_run_report_lists_every_plugged_lab(monkeypatch: pytest.MonkeyPatch) -> None:
    """The report says one line per plugged lab, ran or not, in lab order."""
    monkeypatch.setenv("TRACEVLLM_LAB", "12,03")
    monkeypatch.setattr(labs, "_MARKED", {"03"})
    monkeypatch.setattr(labs, "_OWNED_RUNS", None)
    monkeypatch.setattr(labs, "_REPORTED", False)
    lines: list[tuple[bool, Any]] = labs.run_report({"03": ["ModelRunner._prepare_inputs"]})
    assert [ran for ran, _ in lines] == [True, False]
    assert "under ModelRunner._prepare_inputs" in lines[0][1]
    assert lines[1][1] == labs.never_ran(LABS["12"])


# --- the solution stays folded ------------------------------------------------------

OWNED_ELSEWHERE = {"kv-cache.md", "paged-attention.md"}


@pytest.mark.parametrize(
    "page",
    sorted(
        p.name for p in (ROOT / "docs" / "chapters").glob("*.md") if p.name not in OWNED_ELSEWHERE
    ),
)
def test_the_sentence_that_introduces_a_lab_does_not_link_its_solution(page: str) -> None:
    """The paragraph before a collapsed "Solution — after lab NN" links no
    source page (where the engine's function, the lab's solution, sits
    unfolded): the link is inside the collapsed block. The same for the
    labs' READMEs: the link to the engine's file is inside <details>."""
    text = (ROOT / "docs" / "chapters" / page).read_text()
    for m in re.finditer(r"^\?\?\? success \"Solution — after lab (\d\d)", text, re.M):
        before = text[: m.start()].rstrip("\n")
        intro = before[before.rfind("\n\n") + 2 :]
        assert "(src:" not in intro, f"{page}: lab {m[1]}'s intro links its source: {intro!r}"


@pytest.mark.parametrize("number", sorted(LABS))
def test_a_lab_readme_folds_the_link_to_the_engines_file(number: str) -> None:
    readme = (ROOT / "chapters" / f"{number}-{LABS[number].topic}" / "README.md").read_text()
    folded = re.findall(r"<details>.*?</details>", readme, re.S)
    first = re.search(r"\]\((\.\./\.\./[^)]+)\)", readme)
    assert first is not None and folded
    assert any(first[0] in block for block in folded), f"lab {number}: {first[1]} unfolded"

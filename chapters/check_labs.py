"""Run the labs' tests: a student's lab (``make lab CH=NN``), or prove every
lab's tests right (``make labs-check``).

    python chapters/check_labs.py --run 03     # pytest chapters/03-*/test_lab.py on lab.py
    python chapters/check_labs.py              # check every lab
    python chapters/check_labs.py 01 06        # check some

A check runs a lab's tests twice, in two fresh pytest processes (each runs
every lab being checked): against the reference, the engine's own function
(every test must pass), and against the untouched skeleton (every test must
fail, so that no test passes without calling the function). The untouched
skeleton is ``lab.py`` as committed in git (``git show HEAD:...``), so a
student's work in progress does not count; outside a git checkout, or for a
lab.py git does not track yet, it is the file itself.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

CHAPTERS = Path(__file__).resolve().parent
ROOT = CHAPTERS.parent
IMPL_ENV = "TRACEVLLM_LAB_IMPL"  # read by chapters/_labkit.py
PYTEST_ARGS = ["-p", "no:cacheprovider", "--import-mode=importlib", f"--rootdir={ROOT}"]


def lab_dirs() -> list[Path]:
    return sorted(p for p in CHAPTERS.glob("[0-9][0-9]-*") if (p / "test_lab.py").is_file())


def find_lab(ch: str) -> Path:
    """``3``, ``03`` or ``03-slot-mapping`` -> chapters/03-slot-mapping."""
    names = ", ".join(p.name for p in lab_dirs())
    number = ch.strip().split("-")[0]
    if not number.isdigit():
        raise SystemExit(f"No lab {ch!r}: give its number, e.g. CH=03. Labs: {names}")
    for path in lab_dirs():
        if path.name.startswith(f"{int(number):02d}-"):
            return path
    raise SystemExit(f"No lab {ch!r}. Labs: {names}")


def pytest_env(impl: str) -> dict[str, str]:
    env = dict(os.environ, **{IMPL_ENV: impl})
    env.pop("TRACEVLLM_LAB", None)  # the engine's own functions, unless a test plugs one
    return env


def run_student_lab(ch: str, pytest_args: list[str]) -> int:
    """``make lab CH=NN``: the lab's tests against the student's lab.py."""
    lab = find_lab(ch)
    print(f"Lab {lab.name}: testing {lab.relative_to(ROOT)}/lab.py")
    cmd = [sys.executable, "-m", "pytest", *PYTEST_ARGS, str(lab / "test_lab.py"), *pytest_args]
    return subprocess.call(cmd, env=pytest_env("lab"), cwd=ROOT)


def skeleton_source(lab: Path) -> tuple[str, str]:
    """(source, where from) of the lab's untouched lab.py."""
    rel = (lab / "lab.py").relative_to(ROOT).as_posix()
    git = subprocess.run(
        ["git", "show", f"HEAD:{rel}"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if git.returncode == 0:
        return git.stdout, f"git HEAD:{rel}"
    return (lab / "lab.py").read_text(), rel


@dataclass
class Outcome:
    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # failures and errors
    skipped: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.passed) + len(self.failed) + len(self.skipped)


def run_tests(labs: list[Path], impl: str) -> tuple[dict[str, Outcome], str]:
    """Run the labs' tests in one fresh pytest process: each test's outcome,
    by lab folder name, and pytest's output."""
    outcomes = {lab.name: Outcome() for lab in labs}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", *PYTEST_ARGS, "-q", f"--junitxml={report}"]
        cmd += ["--continue-on-collection-errors", *(str(lab / "test_lab.py") for lab in labs)]
        proc = subprocess.run(
            cmd, env=pytest_env(impl), cwd=ROOT, capture_output=True, text=True, check=False
        )
        if report.is_file():
            for case in ET.parse(report).getroot().iter("testcase"):
                where = f"{case.get('classname', '')}.{case.get('name', '')}"
                lab_name = next((name for name in outcomes if name in where), None)
                if lab_name is None:
                    continue
                outcome, name = outcomes[lab_name], case.get("name", "?")
                tags = {child.tag for child in case}
                if tags & {"failure", "error"}:
                    outcome.failed.append(name)
                elif "skipped" in tags:
                    outcome.skipped.append(name)
                else:
                    outcome.passed.append(name)
    return outcomes, proc.stdout + proc.stderr


def judge(lab: Path, ref: Outcome, skel: Outcome, origin: str) -> tuple[bool, str]:
    """(ok, report) for one lab: all pass on the reference, all fail on the skeleton."""
    problems = []
    if ref.total == 0:
        problems.append("no tests ran against the reference")
    elif ref.failed or ref.skipped:
        problems.append(
            f"against the reference, {len(ref.failed)} failed, {len(ref.skipped)} skipped: "
            f"{ref.failed + ref.skipped}"
        )
    if skel.total == 0:
        problems.append(f"no tests ran against the skeleton ({origin})")
    elif skel.passed or skel.skipped:
        problems.append(
            f"against the untouched skeleton ({origin}), these tests do not fail, so they "
            f"prove nothing: {skel.passed + skel.skipped}. (If lab.py holds a solution, "
            "labs-check needs the skeleton back.)"
        )
    elif skel.total != ref.total:
        problems.append(f"{ref.total} tests on the reference but {skel.total} on the skeleton")
    summary = (
        f"{lab.name:<22} reference: {len(ref.passed)}/{ref.total} pass   "
        f"skeleton: {len(skel.failed)}/{skel.total} fail   {'ok' if not problems else 'FAILED'}"
    )
    return not problems, "\n".join([summary, *(f"    {p}" for p in problems)])


def check_labs(labs: list[Path]) -> bool:
    """Two pytest processes, side by side: every lab's tests on the references,
    and on copies of the untouched skeletons."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as skeleton_dir:
        origins = {}
        for lab in labs:
            source, origins[lab.name] = skeleton_source(lab)
            path = Path(skeleton_dir) / lab.name / "lab.py"
            path.parent.mkdir(parents=True)
            path.write_text(source)
        with ThreadPoolExecutor(2) as pool:
            ref_run = pool.submit(run_tests, labs, "reference")
            skel_run = pool.submit(run_tests, labs, skeleton_dir)
            (refs, ref_log), (skels, _) = ref_run.result(), skel_run.result()
    results = [judge(lab, refs[lab.name], skels[lab.name], origins[lab.name]) for lab in labs]
    ok = all(ok for ok, _ in results)
    if not ok:
        print(ref_log[-6000:])  # pytest's report of the reference run
    for _, report in results:
        print(report)
    verdict = "every lab's tests pass on the reference and fail on the skeleton" if ok else "FAILED"
    print(f"labs-check: {len(labs)} labs, {verdict} ({time.monotonic() - start:.1f}s)")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("labs", nargs="*", help="lab numbers to check (default: all)")
    parser.add_argument("--run", metavar="CH", help="run lab CH's tests on the student's lab.py")
    args, extra = parser.parse_known_args(argv)
    if args.run is not None:
        return run_student_lab(args.run, extra)
    if extra:
        parser.error(f"unknown arguments: {extra}")
    labs = [find_lab(ch) for ch in args.labs] if args.labs else lab_dirs()
    if not labs:
        raise SystemExit(f"No labs in {CHAPTERS}")
    return 0 if check_labs(labs) else 1


if __name__ == "__main__":
    sys.exit(main())

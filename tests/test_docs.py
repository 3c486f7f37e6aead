"""The book cannot drift from the code: the module map and the src: links.

The browser test of the built site is ``docs/check_site.py`` (``make docs-check``).
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAP_PAGE = ROOT / "docs" / "reference" / "vllm-map.md"
# A vLLM path in a docstring or the map: vllm/... not preceded by a letter
# (so tracevllm/... is not one).
VLLM_PATH = re.compile(r"(?<![\w/])vllm/[\w/.]*[\w/]")


def _modules() -> list[Path]:
    files = sorted((ROOT / "tracevllm").rglob("*.py")) + sorted((ROOT / "kernels").glob("*.py"))
    return [p for p in files if "__pycache__" not in p.parts]


def _docstring_head(path: Path) -> str:
    """The first two paragraphs of the module docstring, lines joined (a path
    broken after a slash is joined back)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    head = " ".join(doc.split("\n\n")[:2])
    return re.sub(r"/\s+", "/", " ".join(head.split()))


def _map_rows() -> dict[str, str]:
    """module path -> its 'vLLM 0.22.0' cell, from the map page's tables."""
    rows: dict[str, str] = {}
    for line in MAP_PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2:
            continue
        m = re.search(r"`((?:tracevllm|kernels)/[\w/]+\.py)`", cells[0])
        if m:
            rows[m.group(1)] = cells[1]
    return rows


def test_vllm_map_covers_every_module() -> None:
    rows = _map_rows()
    problems: list[str] = []
    for path in _modules():
        rel = path.relative_to(ROOT).as_posix()
        if rel not in rows:
            problems.append(f"{rel}: no row in docs/reference/vllm-map.md")
            continue
        head = _docstring_head(path)
        listed = VLLM_PATH.findall(rows[rel])
        for vllm_path in listed:
            if vllm_path not in head:
                problems.append(
                    f"{rel}: the map says it mirrors {vllm_path}, its docstring does not name it"
                )
        if not listed and re.search(r"\bMirrors\s+vllm/", head):
            problems.append(f"{rel}: the map lists no vLLM file, its docstring mirrors one")
        if head and not listed and "own" not in rows[rel] and "—" not in rows[rel]:
            problems.append(f"{rel}: say which vLLM file it mirrors, or that it is tracevllm's own")
    stale = set(rows) - {p.relative_to(ROOT).as_posix() for p in _modules()}
    problems += [f"{rel}: in the map, but no such module" for rel in sorted(stale)]
    assert not problems, "\n".join(problems)


def test_docstrings_name_real_vllm_files_when_the_wheel_is_here() -> None:
    """With VLLM_SRC naming a folder where the vLLM 0.22.0 wheel is unpacked
    (``pip download --no-deps vllm==0.22.0`` then unzip), every path the map
    names must exist in it (skipped otherwise: the wheel is not a dependency)."""
    wheel = Path(os.environ.get("VLLM_SRC", "/nonexistent"))
    if not (wheel / "vllm" / "v1").is_dir():
        pytest.skip("set VLLM_SRC to an unpacked vLLM 0.22.0 wheel to check the map's paths")
    missing = sorted(
        {p for p in VLLM_PATH.findall(MAP_PAGE.read_text()) if not (wheel / p).exists()}
    )
    assert not missing, f"not in vLLM 0.22.0: {missing}"


def test_src_links_resolve_and_unknown_names_fail() -> None:
    """The hook that turns src:NAME into a source link resolves real names to
    their lines, and refuses a name that is not in the source."""
    pytest.importorskip("griffe")
    pytest.importorskip("mkdocs")
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "source_links", ROOT / "docs" / "hooks" / "source_links.py"
    )
    assert spec and spec.loader
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    hook._load(str(ROOT))

    path, start, end = hook.resolve("tracevllm.core.sched.scheduler.Scheduler.schedule")
    assert path == "tracevllm/core/sched/scheduler.py"
    lines = (ROOT / path).read_text().splitlines()
    assert any("def schedule(" in line for line in lines[start - 1 : end])

    from mkdocs.exceptions import PluginError

    with pytest.raises(PluginError, match="renamed or moved"):
        hook.resolve("tracevllm.core.sched.scheduler.Scheduler.no_such_method")


def test_every_chapter_names_its_vllm_counterpart() -> None:
    """Each chapter names the vLLM 0.22.0 file(s) it mirrors."""
    chapters = sorted((ROOT / "docs" / "chapters").glob("*.md"))
    assert chapters
    for chapter in chapters:
        text = chapter.read_text()
        assert "vLLM 0.22.0" in text and VLLM_PATH.search(text), (
            f"{chapter.name} names no vLLM 0.22.0 file"
        )

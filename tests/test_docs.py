"""The book cannot drift from the code: the module map and the src: links.

The browser test of the built site is ``docs/check_site.py`` (``make docs-check``).
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from typing import Any

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


def _hook(name: str) -> object:
    """A docs/hooks/ module, loaded the way mkdocs loads it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "hooks" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_number_quoted_from_a_recording_must_match_it() -> None:
    """[62](rec:preempt.victim.computed) renders as 62 only while the recording
    says 62; a re-recording that changes it, or a typo, stops the build."""
    pytest.importorskip("mkdocs")
    from mkdocs.exceptions import PluginError

    hook: Any = _hook("recorded")
    hook._facts.clear()
    hook._facts.update({"run": {"steps": {"3": {"slots": [53, 83]}}, "hit": 48, "text": "Hi."}})
    assert hook.check("48", "run.hit", "page.md") == "48"
    assert hook.check("`[53 83]`", "run.steps.3.slots", "page.md") == "`[53 83]`"
    assert hook.check("83", "run.steps.3.slots.1", "page.md") == "83"
    with pytest.raises(
        PluginError, match="quotes '16' for rec:run.hit, but the recording says '48'"
    ):
        hook.check("16", "run.hit", "page.md")
    with pytest.raises(PluginError, match="no such figure"):
        hook.check("48", "run.miss", "page.md")


@pytest.mark.parametrize(
    ("text", "value", "same"),
    [
        ("1, 23", [12, 3], False),  # the same digits, other numbers
        ("12, 3", [1, 23], False),
        ("123", [1, 2, 3], False),
        ("[1, 2]", [1, 2, 3], False),
        ("`[12, 3]`", [12, 3], True),
        ("12 3", [12, 3], True),
        ("1,456", 1456, True),  # a thousands separator
        ("1, 456", 1456, False),
        ("14,56", 1456, False),
        ("[48]", 48, False),
        ("`48`", 48, True),
        ("4.14", 4.14, True),
        ('`{"a": 1,\n"b": 2}`', '{"a": 1, "b": 2}', True),  # a line break in the prose
        ('`{"a": 12}`', '{"a": 1, 2}', False),
    ],
)
def test_a_quoted_figure_is_compared_item_by_item(text: str, value: Any, same: bool) -> None:
    pytest.importorskip("mkdocs")
    from mkdocs.exceptions import PluginError

    hook: Any = _hook("recorded")
    hook._facts.clear()
    hook._facts["v"] = value
    if same:
        assert hook.check(text, "v", "page.md") == text
    else:
        with pytest.raises(PluginError, match="but the recording says"):
            hook.check(text, "v", "page.md")


def test_every_number_the_book_quotes_matches_its_recording() -> None:
    """What the build checks, as a test: every rec: link of every page, against
    docs/assets/recorded/facts.json."""
    pytest.importorskip("mkdocs")
    hook: Any = _hook("recorded")
    hook.load(str(ROOT))
    quoted = 0
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for m in hook.LINK.finditer(page.read_text()):
            hook.check(m["text"], m["key"], str(page.relative_to(ROOT)))
            quoted += 1
    assert quoted > 50  # the chapters quote their recorded runs throughout


def test_every_embed_is_titled_with_its_file() -> None:
    pytest.importorskip("mkdocs")
    hook: Any = _hook("chapters")
    text = '```python\n--8<-- "tracevllm/a.py:x"\n```\n'
    assert hook.title_embeds(text).startswith('```python title="tracevllm/a.py"\n')
    folded = '??? success "S"\n    ```python\n    --8<-- "kernels/b.py:y"\n    ```\n'
    assert '    ```python title="kernels/b.py"\n' in hook.title_embeds(folded)
    titled = '```python title="mine"\n--8<-- "tracevllm/a.py:x"\n```\n'
    assert hook.title_embeds(titled) == titled


def test_each_stage_chapter_opens_with_the_request_path() -> None:
    """Every chapter of the request's path (the nav's section, the map
    excepted) has its stage, so it opens with previous -> this -> next."""
    pytest.importorskip("mkdocs")
    hook: Any = _hook("chapters")
    nav = (ROOT / "mkdocs.yml").read_text()
    section = nav[nav.index("The request's path:") : nav.index("Serving:")]
    pages = [p.removeprefix("chapters/") for p in re.findall(r"(chapters/[\w-]+\.md)", section)]
    assert [s.page for s in hook.STAGES] == [p for p in pages if p != "map.md"]
    strip = hook.path_strip("scheduling.md")
    assert "[EngineCore loop](engine-core.md) → **Scheduling** → [KV cache](kv-cache.md)" in strip
    assert hook.path_strip("tracing.md") == ""


def test_a_file_diff_is_made_from_the_files_and_a_missing_file_stops_the_build(
    tmp_path: Path,
) -> None:
    """`--8<-- diff "a" "b"` becomes a ```diff block of the two files as they
    are (snippet markers left out, an admonition's indentation kept); a file
    that is not there raises PluginError, so the build stops."""
    pytest.importorskip("mkdocs")
    from mkdocs.exceptions import PluginError

    hook: Any = _hook("file_diffs")
    (tmp_path / "a.py").write_text("x = 1\n# --8<-- [start:s]\ny = 2\n# --8<-- [end:s]\n")
    (tmp_path / "b.py").write_text("x = 1\ny = 3\nz = 4\n")
    hook._root = str(tmp_path)
    page = 'Text.\n\n??? note "the diff"\n    --8<-- diff "a.py" "b.py"\n\nMore.\n'
    out = hook.on_page_markdown(page, None, None, None)
    assert '    ```diff title="a.py → b.py: +2 −1 lines"\n' in out
    assert "    --- a.py\n    +++ b.py\n" in out and "    -y = 2\n    +y = 3\n    +z = 4\n" in out
    assert "8<-- [start" not in out and out.endswith("    ```\n\nMore.\n")
    example = '```text\n;--8<-- diff "a.py" "c.py"\n```\n'  # escaped: shown, not diffed
    assert hook.on_page_markdown(example, None, None, None) == example.replace(";", "")
    with pytest.raises(PluginError, match='no file "c.py"'):
        hook.on_page_markdown('--8<-- diff "a.py" "c.py"\n', None, None, None)


def test_the_moe_routing_figure_is_what_the_router_computes() -> None:
    """docs/record_moe.py's figures, recomputed with today's fused_topk and
    moe_align_block_size, equal the recorded ones the chapter quotes."""
    import json
    import sys

    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import record_moe
    finally:
        sys.path.remove(str(ROOT / "docs"))
    facts = json.loads((ROOT / "docs" / "assets" / "recorded" / "facts.json").read_text())
    assert facts[record_moe.NAME] == record_moe.routing()
    assert (ROOT / "docs" / "assets" / "recorded" / "moe-routing.svg").is_file()

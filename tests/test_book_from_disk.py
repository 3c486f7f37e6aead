"""The built book works from disk (file://): docs/check_site.py's check that
every link of every page names a file (not a folder, which file:// opens as a
listing) and lands on an anchor that is there."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _check_site() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "docs_check_site", ROOT / "docs" / "check_site.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_check_site"] = module
    spec.loader.exec_module(module)
    return module


def test_the_book_is_built_with_file_urls() -> None:
    """Page links end in .html (use_directory_urls: false); with folder URLs
    every link opened a directory listing from file://."""
    config = yaml.safe_load(
        "\n".join(
            line
            for line in (ROOT / "mkdocs.yml").read_text().splitlines()
            if "!!python" not in line
        )
    )
    assert config["use_directory_urls"] is False


def test_check_file_urls_flags_folders_missing_files_and_anchors(tmp_path: Path) -> None:
    """A link to a folder, to a missing file, or to an anchor its page lacks is
    reported; a link to a file and an anchor on it is not. (Mutations caught:
    a folder accepted as a link's target, anchors not looked up.)"""
    site = tmp_path / "site"
    (site / "chapters").mkdir(parents=True)
    (site / "reference" / "source").mkdir(parents=True)
    (site / "reference" / "source" / "a.py.html").write_text('<span id="L-3"></span>')
    (site / "chapters" / "good.html").write_text(
        '<a href="../reference/source/a.py.html#L-3">x</a> <a href="#here">y</a>'
        ' <a href="https://example.org/">z</a>'
    )
    (site / "chapters" / "bad.html").write_text(
        '<a href="../reference/source/">a folder</a>'
        ' <a href="../reference/source/b.py.html">missing</a>'
        ' <a href="../reference/source/a.py.html#L-4">no anchor</a>'
    )
    problems = _check_site().check_file_urls(str(site))
    assert problems == [
        "chapters/bad.html: ../reference/source/ is a folder, not a file",
        "chapters/bad.html: ../reference/source/a.py.html#L-4: no such anchor",
        "chapters/bad.html: ../reference/source/b.py.html is missing, not a file",
    ]

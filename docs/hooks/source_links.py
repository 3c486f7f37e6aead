"""mkdocs hook: link a function named in the book to its lines in the source.

A chapter writes ``[Scheduler.schedule](src:tracevllm.core.sched.scheduler.Scheduler.schedule)``;
this hook resolves the dotted name with griffe (static analysis, nothing is
imported) and rewrites the link to the generated source page of that module,
at the first line of the object, e.g.
``../reference/source/tracevllm/core/sched/scheduler.py.md#L-65``. The link's
title gives the line range.

An unknown name raises ``PluginError``: the build stops, so a renamed or moved
function cannot leave a dead link in the book (snippet sections, checked by
``pymdownx.snippets`` with ``check_paths``, do the same for embedded code).

Every ``.py`` file under ``tracevllm/`` and ``kernels/`` gets a generated page
under ``reference/source/``: the file, highlighted, with an anchor per line, so
the links work offline in the built site.
"""

from __future__ import annotations

import html
import logging
import os
import posixpath
import re
from typing import Any

import griffe
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import PythonLexer

log = logging.getLogger("mkdocs.hooks.source_links")

PACKAGES = ("tracevllm", "kernels")
SOURCE_DIR = "reference/source"
# [text](src:dotted.name) -- the text may be empty: the last two parts are used.
LINK = re.compile(r"\[(?P<text>[^\]]*)\]\(src:(?P<name>[A-Za-z_][\w.]*)\)")

_packages: dict[str, griffe.Module] = {}
_root = ""


def _load(root: str) -> None:
    global _root
    _root = root
    _packages.clear()
    for name in PACKAGES:
        if os.path.isdir(os.path.join(root, name)):
            _packages[name] = griffe.load(
                name, search_paths=[root], allow_inspection=False, resolve_aliases=False
            )


def resolve(name: str) -> tuple[str, int, int]:
    """``pkg.module.Class.method`` -> (repo-relative file, first line, last line).

    Raises PluginError for a name that is not in the source.
    """
    package, _, rest = name.partition(".")
    if package not in _packages:
        raise PluginError(f"src:{name}: unknown package {package!r} (known: {PACKAGES})")
    obj: Any = _packages[package]
    try:
        if rest:
            obj = obj[rest]
        if obj.is_alias:
            obj = obj.final_target
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        raise PluginError(
            f"src:{name} names nothing in the source: was it renamed or moved? "
            "Fix the link in the book."
        ) from None
    path = os.path.relpath(str(obj.filepath), _root).replace(os.sep, "/")
    if obj.is_module:
        return path, 0, obj.endlineno or 0  # 0: the page itself, no line anchor
    if obj.lineno is None:
        raise PluginError(f"src:{name}: griffe found no line number")
    return path, obj.lineno, obj.endlineno or obj.lineno


def source_page_uri(path: str) -> str:
    return f"{SOURCE_DIR}/{path}.md"


# ------------------------------------------------------------------- events
def on_config(config: MkDocsConfig) -> MkDocsConfig:
    _load(os.path.dirname(os.path.abspath(config.config_file_path)))
    return config


def _python_files() -> list[str]:
    out: list[str] = []
    for package in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(_root, package)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for filename in sorted(filenames):
                if filename.endswith(".py"):
                    out.append(os.path.relpath(os.path.join(dirpath, filename), _root))
    return [p.replace(os.sep, "/") for p in out]


def _source_page(path: str) -> str:
    with open(os.path.join(_root, path)) as f:
        code = f.read()
    formatter = HtmlFormatter(
        cssclass="highlight source-listing",
        linenos="inline",
        lineanchors="L",
        anchorlinenos=True,
        wrapcode=True,
    )
    body = highlight(code, PythonLexer(), formatter) if code.strip() else "<p>(empty)</p>"
    return (
        f"# {path}\n\n"
        "Generated from the source when the book was built; the book's "
        "`src:` links point at lines of this page.\n\n"
        f"{body}\n"
    )


def on_files(files: Files, config: MkDocsConfig) -> Files:
    paths = _python_files()
    index = ["# Source files", "", "Every module, as the book links it:", ""]
    for path in paths:
        files.append(File.generated(config, source_page_uri(path), content=_source_page(path)))
        index.append(f"- [{path}]({path}.md)")
    files.append(File.generated(config, f"{SOURCE_DIR}/index.md", content="\n".join(index) + "\n"))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    page_dir = posixpath.dirname(page.file.src_uri)

    def replace(match: re.Match[str]) -> str:
        name = match["name"]
        path, start, end = resolve(name)
        target = posixpath.relpath(source_page_uri(path), page_dir or ".")
        text = match["text"] or ".".join(name.split(".")[-2:])
        if start == 0:
            return f'[{text}]({target} "{html.escape(path, quote=True)}")'
        title = html.escape(f"{path}, lines {start}–{end}", quote=True)
        return f'[{text}]({target}#L-{start} "{title}")'

    return LINK.sub(replace, markdown)

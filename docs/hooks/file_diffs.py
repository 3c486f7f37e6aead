"""mkdocs hook: show what one source file changes relative to another, as a diff
made from the files when the book is built.

A chapter writes, on a line of its own (indented inside an admonition if it
likes)::

    --8<-- diff "tracevllm/model_executor/models/llama.py" "tracevllm/.../qwen2.py"

and the hook puts in its place a ```` ```diff ```` block: the unified diff of
the two files (three lines of context), titled with both names and how many
lines each side adds and removes (``;--8<-- diff ...`` shows the line itself,
as an example). The snippet markers (``# --8<-- [start:x]``)
are left out of both sides: they are the book's plumbing, not code.

The diff is made from the files as they are at build time, so it cannot go
stale; a file that does not exist raises ``PluginError`` and the build stops,
as a ``src:`` link to a renamed function does (docs/hooks/source_links.py).
"""

from __future__ import annotations

import difflib
import os
import posixpath
import re

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

# --8<-- diff "old" "new", alone on its line; group "indent" keeps an admonition's.
# A leading ";" (";--8<-- diff ...") escapes it, as pymdownx.snippets' escape:
# the line is shown without the ";", and nothing is diffed.
DIRECTIVE = re.compile(
    r'^(?P<indent>[ \t]*)(?P<escape>;?)--8<-- diff "(?P<old>[^"\n]+)" "(?P<new>[^"\n]+)"[ \t]*$',
    re.MULTILINE,
)
# A snippet section marker line: `# --8<-- [start:name]` / `[end:name]`.
MARKER = re.compile(r"^\s*# --8<-- \[(start|end):[\w-]+\]\s*$")
CONTEXT = 3

_root = ""


def read_source(root: str, path: str) -> list[str]:
    """The file's lines, snippet markers left out; a missing file is a PluginError."""
    full = os.path.join(root, path)
    if not os.path.isfile(full):
        raise PluginError(
            f'--8<-- diff: no file "{path}" (paths are relative to the repository root). '
            "Was it renamed or removed? Fix the diff in the book."
        )
    with open(full) as f:
        return [line for line in f.read().splitlines() if not MARKER.match(line)]


def file_diff(root: str, old: str, new: str) -> tuple[list[str], int, int]:
    """(the unified diff's lines, lines added, lines removed) from ``old`` to ``new``."""
    lines = list(
        difflib.unified_diff(
            read_source(root, old), read_source(root, new), old, new, n=CONTEXT, lineterm=""
        )
    )
    added = sum(1 for line in lines[2:] if line.startswith("+"))
    removed = sum(1 for line in lines[2:] if line.startswith("-"))
    return lines, added, removed


def render(root: str, old: str, new: str, indent: str = "") -> str:
    """The ```` ```diff ```` block that replaces a directive."""
    lines, added, removed = file_diff(root, old, new)
    title = (
        f"{posixpath.basename(old)} → {posixpath.basename(new)}: +{added} −{removed} lines"
        if lines
        else f"{posixpath.basename(old)} → {posixpath.basename(new)}: the same"
    )
    body = lines or [f"  (no difference between {old} and {new})"]
    fence = [f'```diff title="{title}"', *body, "```"]
    return "\n".join(f"{indent}{line}" if line else line for line in fence)


# ------------------------------------------------------------------- events
def on_config(config: MkDocsConfig) -> MkDocsConfig:
    global _root
    _root = os.path.dirname(os.path.abspath(config.config_file_path))
    return config


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    def replace(match: re.Match[str]) -> str:
        if match["escape"]:
            return match[0].replace(";--8<--", "--8<--", 1)
        return render(_root, match["old"], match["new"], match["indent"])

    return DIRECTIVE.sub(replace, markdown)

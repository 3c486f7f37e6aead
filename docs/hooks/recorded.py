"""mkdocs hook: a number quoted from a recorded run must match the recording.

``make docs-assets`` (docs/record_assets.py) writes, beside the recorded
views, ``docs/assets/recorded/facts.json`` (and a record script of its own,
``facts.NAME.json``): the figures the prose quotes
(step numbers, token counts, block ids, slots), read from the same spans. A
chapter quotes one as a link to its key:

    request 1 is preempted at [62](rec:preempt.victim.computed) computed tokens

This hook checks the text against the recording and renders the text alone. A
key the recording lacks, or a text that no longer matches it (the engine
changed, the run was re-recorded), raises ``PluginError``: the build stops, so
the prose cannot silently contradict its own pictures.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

FACTS = "docs/assets/recorded/facts.json"
# [text](rec:key.path) -- the text is what the reader sees.
LINK = re.compile(r"\[(?P<text>[^\]]+)\]\(rec:(?P<key>[\w.-]+)\)")

_facts: dict[str, Any] = {}


def load(root: str) -> None:
    """facts.json, and beside it each ``facts.NAME.json`` that a record script
    of its own writes (docs/record_tuning.py: ``facts.tuning.json``), so that
    one script's re-recording does not rewrite another's file. A top-level key
    in two files is an error."""
    _facts.clear()
    folder = os.path.dirname(os.path.join(root, FACTS))
    paths = [os.path.join(root, FACTS)]
    paths += sorted(glob.glob(os.path.join(folder, "facts.*.json")))
    for path in paths:
        if not os.path.exists(path):
            continue
        with open(path) as f:
            facts = json.load(f)
        if twice := sorted(set(facts) & set(_facts)):
            raise PluginError(
                f"{os.path.relpath(path, root)}: {twice} recorded in another facts file"
            )
        _facts.update(facts)


def lookup(key: str) -> Any:
    """``preempt.victim.computed`` or ``batch.steps.3.slot_mapping.0``."""
    value: Any = _facts
    for part in key.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise PluginError(
                f"rec:{key}: the recording has no such figure ({FACTS}). "
                "Add it to facts() in docs/record_assets.py, or fix the key."
            )
    return value


def _normal(text: str) -> str:
    """What a quoted figure says, less its formatting: `52` -> 52, 1,456 ->
    1456 (a thousands separator), runs of whitespace -> one space."""
    text = text.strip().strip("`").strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    return " ".join(text.split())


def _items(text: str) -> list[str]:
    """A quoted list's items, in order: [1, 2, 3], `1, 2, 3` and [1 2 3] ->
    ["1", "2", "3"]; commas and spaces only separate (1, 23 is not 12, 3)."""
    return [item for item in re.split(r"[\s,]+", re.sub(r"[`\[\]]", " ", text)) if item]


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    return str(value)


def matches(text: str, value: Any) -> bool:
    """Does the quote say the recorded value? A list item by item, the rest as text."""
    if isinstance(value, list):
        return _items(text) == _items(_shown(value))
    return _normal(text) == _normal(_shown(value))


def check(text: str, key: str, where: str) -> str:
    value = lookup(key)
    if not matches(text, value):
        raise PluginError(
            f"{where}: quotes {text!r} for rec:{key}, but the recording says {_shown(value)!r}. "
            "The run was re-recorded or the engine changed: re-read the passage and fix it."
        )
    return text


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    load(os.path.dirname(os.path.abspath(config.config_file_path)))
    return config


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    where = page.file.src_uri
    return LINK.sub(lambda m: check(m["text"], m["key"], where), markdown)

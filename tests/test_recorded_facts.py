"""docs/hooks/recorded.py reads facts.json and each facts.NAME.json beside it
(a record script's own file), and refuses a figure recorded in two."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _recorded() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_recorded", ROOT / "docs/hooks/recorded.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_recorded"] = module
    spec.loader.exec_module(module)
    return module


def test_facts_of_every_record_script_are_checked(tmp_path: Path) -> None:
    """A figure of facts.tuning.json is looked up and checked like one of
    facts.json. (Mutation caught: only facts.json read.)"""
    from mkdocs.exceptions import PluginError

    recorded = _recorded()
    folder = tmp_path / "docs" / "assets" / "recorded"
    folder.mkdir(parents=True)
    (folder / "facts.json").write_text(json.dumps({"single": {"tokens": 7}}))
    (folder / "facts.tuning.json").write_text(json.dumps({"tuning": {"best": [4, 256]}}))
    recorded.load(str(tmp_path))
    assert recorded.check("7", "single.tokens", "x.md") == "7"
    assert recorded.check("[4, 256]", "tuning.best", "x.md") == "[4, 256]"
    with pytest.raises(PluginError, match="recording says"):
        recorded.check("5", "tuning.best.0", "x.md")
    (folder / "facts.other.json").write_text(json.dumps({"single": {"tokens": 8}}))
    with pytest.raises(PluginError, match=r"\['single'\] recorded in another facts file"):
        recorded.load(str(tmp_path))

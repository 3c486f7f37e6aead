"""docs/record_assets.py (``make docs-assets``) starts its folder afresh but
keeps what ``make docs-tuning`` (docs/record_tuning.py, which it does not
run) wrote there."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _record_assets(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """docs/record_assets.py, imported with docs/ on the path (as its scripts run)."""
    monkeypatch.syspath_prepend(str(ROOT / "docs"))
    spec = importlib.util.spec_from_file_location(
        "docs_record_assets", ROOT / "docs" / "record_assets.py"
    )
    assert spec is not None and spec.loader is not None
    ra = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "docs_record_assets", ra)
    spec.loader.exec_module(ra)
    return ra


def test_docs_assets_keeps_the_tuning_recording(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stale views go; the tuning chapter's charts and facts stay. (Mutation
    caught: clear_out_dir removing the whole folder, as it did.)"""
    ra = _record_assets(monkeypatch)
    out = tmp_path / "recorded"
    out.mkdir()
    kept = ["facts.tuning.json", "tuning-max-num-seqs.svg", "tuning-block-size.svg"]
    gone = ["facts.json", "single-waterfall.svg", "stale-view.md"]
    for name in kept + gone:
        (out / name).write_text("x")
    (out / "old-folder").mkdir()
    monkeypatch.setattr(ra, "OUT_DIR", str(out))
    ra.clear_out_dir()
    assert sorted(p.name for p in out.iterdir()) == sorted(kept)
    # Every file record_tuning writes is one it keeps.
    import record_tuning

    monkeypatch.setattr(record_tuning, "OUT_DIR", str(out))
    names = [f"tuning-{knob.replace('_', '-')}.svg" for knob in record_tuning._knobs()]
    names.append(Path(record_tuning.FACTS).name)
    for name in names:
        (out / name).write_text("x")
    ra.clear_out_dir()
    assert sorted(names) == sorted(p.name for p in out.iterdir() if p.name in names)


def test_docs_assets_keeps_every_standalone_recording(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What docs/record_disagg.py, record_serve_bench.py and record_compile.py
    write (their OUTPUTS, which make docs-assets does not redo) survives a
    docs-assets run. (Mutation caught: one script's OUTPUTS left out of
    clear_out_dir's list.)"""
    import fnmatch

    ra = _record_assets(monkeypatch)
    out = tmp_path / "recorded"
    out.mkdir()
    names = []
    for script in ("record_disagg", "record_serve_bench", "record_compile"):
        module = importlib.import_module(script)
        for pattern in module.OUTPUTS:
            name = pattern.replace("*", "x")
            assert fnmatch.fnmatch(name, pattern)
            names.append(name)
    for name in [*names, "facts.json", "stale-view.md"]:
        (out / name).write_text("x")
    monkeypatch.setattr(ra, "OUT_DIR", str(out))
    ra.clear_out_dir()
    assert sorted(p.name for p in out.iterdir()) == sorted(names)

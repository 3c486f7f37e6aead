"""docs/record_tuning.py: from a sweep's results to the charts and the facts
the tuning chapter would quote (no engine: results of the shape run_sweep
returns)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _record_tuning() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "docs_record_tuning", ROOT / "docs/record_tuning.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_record_tuning"] = module
    spec.loader.exec_module(module)
    return module


def _config(name: str, ttft: float, itl: float, tok_s: float) -> dict[str, Any]:
    return {"name": name, "mean_ttft_ms": ttft, "p99_ttft_ms": ttft * 1.5, "mean_itl_ms": itl,
            "mean_tpot_ms": itl, "output_throughput": tok_s}  # fmt: skip


def test_every_knob_is_charted_and_its_figures_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One SVG per knob, naming its field and values; the facts round each
    value's means and tokens/s under its label. (Mutation caught: a knob's
    values keyed by position instead of label.)"""
    rt = _record_tuning()
    monkeypatch.setattr(rt, "OUT_DIR", str(tmp_path))
    results = {
        "load_before": "1.0 1.0 1.0",
        "load_after": "1.1 1.0 1.0",
        "minutes": 2.5,
        "knobs": {},
    }
    for knob, (field, workload, metric, values) in rt._knobs().items():
        results["knobs"][knob] = {
            "field": field, "workload": workload, "metric": metric, "requests": 4,
            "prompt_tokens": [40, 300], "output_tokens": 8,
            "configs": [_config(label, 100.0 + i, 20.0 + i, 50.0 + i)
                        for i, (label, _) in enumerate(values)],
        }  # fmt: skip
    rt.draw(results)
    facts = rt.facts(results)["tuning"]
    assert sorted(p.name for p in tmp_path.glob("tuning-*.svg")) == sorted(
        f"tuning-{knob.replace('_', '-')}.svg" for knob in rt._knobs()
    )
    svg = (tmp_path / "tuning-prefix-caching.svg").read_text()
    assert "enable_prefix_caching" in svg
    assert facts["knobs"]["prefix_caching"]["values"]["on"] == {
        "mean_ttft_ms": 101, "p99_ttft_ms": 152, "mean_itl_ms": 21.0, "mean_tpot_ms": 21.0,
        "tok_s": 51.0,
    }  # fmt: skip
    assert facts["knobs"]["max_num_seqs"]["prompt_tokens_max"] == 300
    assert json.loads(json.dumps(facts)) == facts  # what facts.tuning.json holds

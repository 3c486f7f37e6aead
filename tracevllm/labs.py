"""Plug a course lab (``chapters/NN-topic/lab.py``) into the running engine.

Not in vLLM: this is the course's door into the engine. Each lab asks the
student to rewrite one real function of the engine; the function carries a
hook, ``@lab_hook("name")`` (or ``name = lab_override("name", name)``), which
returns the function itself, unless ``TRACEVLLM_LAB`` selects the lab that
rewrites it: then it returns the student's function from that lab's
``lab.py``, and the engine serves requests with the student's code.

    TRACEVLLM_LAB=03 make trace PROMPT="Hello"        # chapters/03-*/lab.py
    TRACEVLLM_LAB=01,05 tracevllm generate ...        # several labs at once
    TRACEVLLM_LAB=~/mine/03-slot-mapping tracevllm ... # a lab folder elsewhere

A lab is named by its number, or by the path of its folder (or of the
``lab.py`` in it); a folder's name must begin with the lab number (``03-...``).
The hook resolves when the engine module is imported, so with no lab set it
costs nothing per call: the engine calls its own function directly. The
engine's own functions stay reachable as ``reference(name)`` (the labs' tests
run against them to prove the tests right).

A plugged lab says so: one line on stderr when the engine loads it
(``lab 03: compute_slot_mapping from chapters/03-slot-mapping/lab.py``), one
more from the engine core's own process when it runs in one (the default:
``... (engine core process, pid 1234)``, ``announce``), and,
with tracing on, the attribute ``tracevllm.labs`` on the span that is open
when its function runs, so a trace shows whose code served a request.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import multiprocessing
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from tracevllm import envs, tracing

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Lab:
    number: str  # "01"
    topic: str  # the folder is chapters/<number>-<topic>
    function: str  # the name the lab's lab.py defines, and the hook's name
    module: str  # the engine module whose function the lab replaces
    # The span open when the engine calls the function, which names the lab
    # (tracevllm.labs) when it is plugged in; "" for one it calls with no
    # span open (while it builds the model); None for a lab the engine never
    # calls (a kernel only the book runs).
    span: str | None


# The labs: which function each one rewrites, where it lives, and its span.
LABS: dict[str, Lab] = {
    lab.number: lab
    for lab in (
        Lab(
            "01",
            "token-budget",
            "compute_num_new_tokens",
            "tracevllm.core.sched.scheduler",
            "Scheduler.schedule",
        ),
        Lab(
            "02",
            "allocate-slots",
            "allocate_slots",
            "tracevllm.core.kv_cache_manager",
            "Scheduler.schedule",
        ),
        Lab(
            "03",
            "slot-mapping",
            "compute_slot_mapping",
            "tracevllm.worker.block_table",
            "ModelRunner._prepare_inputs",
        ),
        Lab(
            "04",
            "paged-attention",
            "unified_attention_torch",
            "tracevllm._custom_ops",
            "unified_attention",
        ),
        Lab(
            "05",
            "top-k-top-p",
            "apply_top_k_top_p",
            "tracevllm.sample.ops.topk_topp_sampler",
            "Sampler.forward",
        ),
        Lab(
            "06",
            "stop-strings",
            "check_stop_strings",
            "tracevllm.engine.detokenizer",
            "OutputProcessor.process_outputs",
        ),
        Lab(
            "07",
            "block-hash",
            "get_request_block_hasher",
            "tracevllm.core.kv_cache_utils",
            # Its hasher runs there for output tokens; for a prompt, on the
            # engine's input thread, where no span is open.
            "Scheduler.update_from_output",
        ),
        Lab(
            "08",
            "free-block-queue",
            "get_new_blocks",
            "tracevllm.core.block_pool",
            "Scheduler.schedule",
        ),
        Lab(
            "09",
            "detokenizer",
            "update",
            "tracevllm.engine.detokenizer",
            "OutputProcessor.process_outputs",
        ),
        Lab("10", "online-softmax", "blocked_attention", "kernels.flash_attention", None),
        Lab(
            "11",
            "token-bitmask",
            "apply_token_bitmask_inplace",
            "tracevllm.structured_output.utils",
            "ModelRunner.sample_tokens",
        ),
        Lab(
            "12",
            "rejection-sampling",
            "accept_draft_tokens",
            "tracevllm.sample.rejection_sampler",
            "RejectionSampler.forward",
        ),
        Lab(
            "13",
            "moe-router",
            "fused_topk",
            "tracevllm.model_executor.layers.fused_moe.router.fused_topk_router",
            # Runs in every MoE layer's forward: the span is there at detail
            # "full"; otherwise the model's forward span is the open one.
            "FusedMoE.forward",
        ),
        # Called while each worker builds its model (make_layers), before
        # any request: no span is open then.
        Lab("14", "pipeline-stages", "get_pp_indices", "tracevllm.distributed.utils", ""),
    )
}

# The engine's own function behind each hook, whatever TRACEVLLM_LAB says.
_REFERENCES: dict[str, Callable[..., Any]] = {}
# Lab modules loaded so far, by lab.py path: loaded once per process.
_LOADED: dict[Path, ModuleType] = {}


class LabError(RuntimeError):
    """TRACEVLLM_LAB names a lab that cannot be plugged in."""


def chapters_dir() -> Path:
    """``chapters/`` of the source checkout this package was imported from."""
    return Path(__file__).resolve().parents[1] / "chapters"


def _available() -> str:
    return ", ".join(f"{lab.number} ({lab.topic})" for lab in LABS.values())


def find_lab_file(spec: str) -> tuple[Lab, Path]:
    """One entry of TRACEVLLM_LAB (a number or a path) -> (the lab, its lab.py)."""
    spec = spec.strip()
    if re.fullmatch(r"\d{1,2}", spec):
        number = spec.zfill(2)
        if number not in LABS:
            raise LabError(f"TRACEVLLM_LAB={spec}: there is no lab {number}. Labs: {_available()}.")
        lab = LABS[number]
        root = chapters_dir()
        folders = sorted(root.glob(f"{number}-*")) if root.is_dir() else []
        if not folders:
            raise LabError(
                f"TRACEVLLM_LAB={spec}: no folder {root}/{number}-{lab.topic}. Labs are run "
                "from a source checkout of tracevllm (pip install -e .)."
            )
        path = folders[0] / "lab.py"
    else:
        path = Path(spec).expanduser().resolve()
        if path.suffix != ".py":  # a lab folder
            path = path / "lab.py"
        match = re.match(r"(\d{2})-", path.parent.name)
        if match is None or match.group(1) not in LABS:
            raise LabError(
                f"TRACEVLLM_LAB={spec}: a lab is a number or a lab folder named NN-topic "
                f"(NN a lab number); got folder {path.parent.name!r}. Labs: {_available()}."
            )
        lab = LABS[match.group(1)]
    if not path.is_file():
        raise LabError(f"TRACEVLLM_LAB={spec}: {path} does not exist.")
    return lab, path


def selected_labs() -> dict[str, tuple[Lab, Path]]:
    """The labs TRACEVLLM_LAB plugs in, by function name (empty when unset)."""
    value = envs.TRACEVLLM_LAB
    if value is None:
        return {}
    selected: dict[str, tuple[Lab, Path]] = {}
    for spec in value.split(","):
        if spec.strip():
            lab, path = find_lab_file(spec)
            if lab.span is None:
                raise LabError(
                    f"TRACEVLLM_LAB={spec}: the engine never calls {lab.function}() "
                    f"(see chapters/{lab.number}-{lab.topic}/README.md); "
                    f"test it with make lab CH={lab.number}."
                )
            selected[lab.function] = (lab, path)
    return selected


def load_lab_module(path: Path) -> ModuleType:
    """Import a lab.py by its path (folders like ``03-slot-mapping`` are not
    package names), once per process."""
    if path in _LOADED:
        return _LOADED[path]
    name = "tracevllm_lab_" + re.sub(r"\W", "_", path.parent.name)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[name]
        raise
    _LOADED[path] = module
    return module


def describe(lab: Lab, path: Path) -> str:
    """``compute_slot_mapping from chapters/03-slot-mapping/lab.py`` (the path
    relative to the working directory when it is below it)."""
    try:
        shown = path.relative_to(Path.cwd())
    except ValueError:
        shown = path
    return f"{lab.function} from {shown}"


def lab_override(name: str, default: F) -> F:
    """``default``, or the function ``name`` of the lab TRACEVLLM_LAB plugs in."""
    _REFERENCES[name] = default
    selected = selected_labs()  # checks every entry: a bad one fails at import
    if name not in selected:
        return default
    lab, path = selected[name]
    function = getattr(load_lab_module(path), name, None)
    if not callable(function):
        raise LabError(
            f"TRACEVLLM_LAB: {path} (lab {lab.number}) does not define a function {name}()."
        )
    named = f"{lab.number}: {describe(lab, path)}"
    # Once, in the process that loads the engine: a spawned engine process
    # imports the engine again, and would say it twice.
    if multiprocessing.parent_process() is None:
        print(f"lab {named}", file=sys.stderr, flush=True)
    return _tagged(function, named)


def announce(where: str) -> None:
    """One line on stderr per lab TRACEVLLM_LAB plugs in, said by a process
    the engine started (the engine core's): its hooks resolve there too,
    on import, but ``lab_override`` leaves the saying to the first process."""
    for lab, path in selected_labs().values():
        print(f"lab {lab.number}: {describe(lab, path)} ({where})", file=sys.stderr, flush=True)


def _tagged(function: F, named: str) -> F:
    """``function``, naming the lab on the span open when it runs (and so, for
    a function that makes a function, on the span open when that one runs)."""

    @functools.wraps(function)
    def served(*args: Any, **kwargs: Any) -> Any:
        span = tracing.current_span()
        if span.is_recording():
            current = dict(getattr(span, "attributes", None) or {}).get(LABS_ATTRIBUTE, ())
            if named not in current:
                span.set_attribute(LABS_ATTRIBUTE, [*current, named])
        result = function(*args, **kwargs)
        return _tagged(result, named) if inspect.isfunction(result) else result

    return served  # type: ignore[return-value]


LABS_ATTRIBUTE = "tracevllm.labs"


def lab_hook(name: str) -> Callable[[F], F]:
    """Decorator form of ``lab_override``: ``@lab_hook("check_stop_strings")``."""

    def hook(default: F) -> F:
        return lab_override(name, default)

    return hook


def reference(name: str) -> Callable[..., Any]:
    """The engine's own function for hook ``name`` (imports its module)."""
    if name not in _REFERENCES:
        labs = [lab for lab in LABS.values() if lab.function == name]
        if not labs:
            raise LabError(f"no lab hook named {name!r}")
        module = importlib.import_module(labs[0].module)
        if labs[0].span is None:  # no hook: the engine never calls it
            function: Callable[..., Any] = getattr(module, name)
            return function
    return _REFERENCES[name]

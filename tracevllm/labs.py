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

A lab number is looked up in ``chapters/`` of the tracevllm checkout the
working directory is in, not the checkout the package was imported from: a
clone that shares another checkout's virtual environment runs its own labs.
Outside any checkout a number is refused, with the full path of the lab.py it
would have meant (a lab's path is accepted anywhere).

A plugged lab says so: one line on stderr when the engine loads it
(``lab 03: compute_slot_mapping from chapters/03-slot-mapping/lab.py``), one
more from the engine core's own process when it runs in one (the default:
``... (engine core process, pid 1234)``, ``announce``), and,
with tracing on, the attribute ``tracevllm.labs`` on the span that is open
when its function runs, so a trace shows whose code served a request.

And it says so when it never ran: every process of the run (the engine core,
its workers) marks, in a folder the first process made, each lab whose
function it called; at the end of the run (``run_report``, which
``tracevllm trace`` draws into its views, or else at exit) a lab without a
mark is named with what it needs: ``lab 12 was loaded but never ran: it needs
speculative decoding ... (--speculative-config ...)``.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import importlib.util
import inspect
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable
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
    # What a run must have for the engine to call the function, as the
    # `tracevllm trace` flags that give it ("" when every run calls it): said
    # when a plugged lab never ran.
    needs: str = ""


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
            "the torch attention backend (--attention-backend torch, the default on a CPU)",
        ),
        Lab(
            "05",
            "top-k-top-p",
            "apply_top_k_top_p",
            "tracevllm.sample.ops.topk_topp_sampler",
            "Sampler.forward",
            "a random sample with top-k or top-p (--temperature 0.8 --top-p 0.9)",
        ),
        Lab(
            "06",
            "stop-strings",
            "check_stop_strings",
            "tracevllm.engine.detokenizer",
            "OutputProcessor.process_outputs",
            "a stop string (--stop S)",
        ),
        Lab(
            "07",
            "block-hash",
            "get_request_block_hasher",
            "tracevllm.core.kv_cache_utils",
            # Its hasher runs there for output tokens; for a prompt, on the
            # engine's input thread, where no span is open.
            "Scheduler.update_from_output",
            "prefix caching (on unless --no-enable-prefix-caching)",
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
            "a structured output (--choice A,B, --regex R or --json-schema FILE)",
        ),
        Lab(
            "12",
            "rejection-sampling",
            "accept_draft_tokens",
            "tracevllm.sample.rejection_sampler",
            "RejectionSampler.forward",
            "speculative decoding with drafts to verify (--speculative-config "
            '\'{"method": "ngram", "num_speculative_tokens": 3}\' and a prompt whose '
            'text repeats, or a draft model: \'{"method": "draft_model", "model": PATH, '
            '"num_speculative_tokens": 3}\')',
        ),
        Lab(
            "13",
            "moe-router",
            "fused_topk",
            "tracevllm.model_executor.layers.fused_moe.router.fused_topk_router",
            # Runs in every MoE layer's forward: the span is there at detail
            # "full"; otherwise the model's forward span is the open one.
            "FusedMoE.forward",
            "a mixture-of-experts model (--model a Qwen3-MoE checkpoint)",
        ),
        # Called while each worker builds its model (make_layers), before
        # any request: no span is open then.
        Lab("14", "pipeline-stages", "get_pp_indices", "tracevllm.distributed.utils", ""),
        Lab(
            "15",
            "offload-lookup",
            "_lookup",
            "tracevllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
            # Asked by the connector's get_num_new_matched_tokens when the
            # scheduler admits a waiting request.
            "Scheduler.schedule",
            "a CPU tier for KV blocks (--kv-offloading-size GiB)",
        ),
    )
}

# The engine's own function behind each hook, whatever TRACEVLLM_LAB says.
_REFERENCES: dict[str, Callable[..., Any]] = {}
# Lab modules loaded so far, by lab.py path: loaded once per process.
_LOADED: dict[Path, ModuleType] = {}


class LabError(RuntimeError):
    """TRACEVLLM_LAB names a lab that cannot be plugged in."""


def package_checkout() -> Path:
    """The source checkout this package was imported from."""
    return Path(__file__).resolve().parents[1]


def checkout_of(folder: Path) -> Path | None:
    """The tracevllm checkout ``folder`` is in (it or a folder above it holds
    ``chapters/check_labs.py`` and ``tracevllm/labs.py``), or None."""
    folder = folder.resolve()
    for candidate in (folder, *folder.parents):
        if (candidate / "chapters" / "check_labs.py").is_file() and (
            candidate / "tracevllm" / "labs.py"
        ).is_file():
            return candidate
    return None


def chapters_dir(spec: str = "") -> Path:
    """``chapters/`` of the checkout the working directory is in; outside one,
    a LabError that names the lab.py a number would have meant."""
    root = checkout_of(Path.cwd())
    if root is None:
        number = spec.strip().zfill(2)
        meant = package_checkout() / "chapters"
        if number in LABS:
            meant = meant / f"{number}-{LABS[number].topic}" / "lab.py"
        raise LabError(
            f"TRACEVLLM_LAB={spec}: the working directory {Path.cwd()} is not in a tracevllm "
            f"checkout, so lab {number} would be {meant}, the lab of the checkout this "
            "tracevllm was installed from, maybe not yours: run from your checkout "
            "(cd into it), or name the lab by its folder (TRACEVLLM_LAB=path/to/NN-topic)."
        )
    return root / "chapters"


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
        root = chapters_dir(spec)
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


def named(lab: Lab, path: Path) -> str:
    """How the lab is named on spans (``tracevllm.labs``) and in the views."""
    return f"{lab.number}: {describe(lab, path)}"


def lab_override(name: str, default: F) -> F:
    """``default``, or the function ``name`` of the lab TRACEVLLM_LAB plugs in."""
    _REFERENCES[name] = default
    selected = selected_labs()  # checks every entry: a bad one fails at import
    if selected:
        _watch_runs()
    if name not in selected:
        return default
    lab, path = selected[name]
    function = getattr(load_lab_module(path), name, None)
    if not callable(function):
        raise LabError(
            f"TRACEVLLM_LAB: {path} (lab {lab.number}) does not define a function {name}()."
        )
    # Once, in the process that loads the engine: a spawned engine process
    # imports the engine again, and would say it twice.
    if multiprocessing.parent_process() is None:
        print(f"lab {named(lab, path)}", file=sys.stderr, flush=True)
    return _tagged(function, lab, named(lab, path))


def announce(where: str) -> None:
    """One line on stderr per lab TRACEVLLM_LAB plugs in, said by a process
    the engine started (the engine core's): its hooks resolve there too,
    on import, but ``lab_override`` leaves the saying to the first process."""
    for lab, path in selected_labs().values():
        print(f"lab {lab.number}: {describe(lab, path)} ({where})", file=sys.stderr, flush=True)


def _tagged(function: F, lab: Lab, name: str) -> F:
    """``function``, naming the lab on the span open when it runs (and so, for
    a function that makes a function, on the span open when that one runs),
    and marking, the first time in this process, that the lab ran."""

    @functools.wraps(function)
    def served(*args: Any, **kwargs: Any) -> Any:
        if lab.number not in _MARKED:
            _mark_run(lab)
        span = tracing.current_span()
        if span.is_recording():
            current = dict(getattr(span, "attributes", None) or {}).get(LABS_ATTRIBUTE, ())
            if name not in current:
                span.set_attribute(LABS_ATTRIBUTE, [*current, name])
        result = function(*args, **kwargs)
        return _tagged(result, lab, name) if inspect.isfunction(result) else result

    return served  # type: ignore[return-value]


# --- did the plugged labs run? ----------------------------------------------------
# The folder where each process of a run marks the labs it ran (a file
# NN.<pid>), made by the run's first process and handed to the processes it
# starts in the environment: a hand-over inside one run, not a setting, so it
# is not in envs.py. A process started some other way (a fresh interpreter,
# not a multiprocessing child) is a run of its own.
RUNS_ENV = "TRACEVLLM_LAB_RUNS"
_MARKED: set[str] = set()  # labs this process has marked
_OWNED_RUNS: Path | None = None  # the folder, in the process that made it
_REPORTED = False


def _watch_runs() -> None:
    """In a run's first process, once: make the folder, tell the processes it
    will start, and say at exit which plugged labs never ran."""
    global _OWNED_RUNS
    if _OWNED_RUNS is not None or multiprocessing.parent_process() is not None:
        return
    _OWNED_RUNS = Path(tempfile.mkdtemp(prefix="tracevllm-labs-"))
    os.environ[RUNS_ENV] = str(_OWNED_RUNS)
    atexit.register(_at_exit)


def _mark_run(lab: Lab) -> None:
    _MARKED.add(lab.number)
    folder = _OWNED_RUNS if _OWNED_RUNS is not None else os.environ.get(RUNS_ENV)
    if folder is not None and Path(folder).is_dir():
        (Path(folder) / f"{lab.number}.{os.getpid()}").touch()


def runs() -> dict[str, list[int]]:
    """Lab number -> the pids of this run's processes that called its function
    (in the run's first process; elsewhere, this process's own)."""
    if _OWNED_RUNS is None:
        return {number: [os.getpid()] for number in _MARKED}
    ran: dict[str, list[int]] = {}
    for mark in sorted(_OWNED_RUNS.iterdir()):
        number, pid = mark.name.split(".")
        ran.setdefault(number, []).append(int(pid))
    return ran


def never_ran(lab: Lab) -> str:
    """The warning for a plugged lab whose function the run never called."""
    needs = lab.needs or "a request that reaches it"
    return (
        f"lab {lab.number} was loaded but never ran: it needs {needs}; the engine calls "
        f"{lab.function}() under {lab.span or 'no span'}."
    )


def run_report(spans_by_lab: dict[str, list[str]] | None = None) -> list[tuple[bool, str]]:
    """At the end of a run, one line per plugged lab: (ran?, what to say).

    ``spans_by_lab``: lab number -> the names of the spans its function ran
    under, from the run's trace (``tracevllm.labs``). Said once: the warning
    at exit is left out after this."""
    global _REPORTED
    _REPORTED = True
    ran = runs()
    lines = []
    for lab, path in sorted(selected_labs().values(), key=lambda pair: pair[0].number):
        if lab.number not in ran:
            lines.append((False, never_ran(lab)))
            continue
        where = ", ".join(sorted(set((spans_by_lab or {}).get(lab.number, ())))) or (
            "no span (the model was being built)" if lab.span == "" else "no span"
        )
        pids = ", ".join(str(pid) for pid in ran[lab.number])
        lines.append((True, f"lab {named(lab, path)} ran in pid {pids}, under {where}"))
    return lines


def spans_by_lab(spans: Iterable[Any]) -> dict[str, list[str]]:
    """Lab number -> the names of the spans (records with ``.name`` and
    ``.attributes``) that its function ran under."""
    found: dict[str, list[str]] = {}
    for span in spans:
        for name in span.attributes.get(LABS_ATTRIBUTE, ()):
            found.setdefault(str(name)[:2], []).append(span.name)
    return found


def _at_exit() -> None:
    if not _REPORTED:
        for ran, line in run_report():
            if not ran:
                print(f"warning: {line}", file=sys.stderr, flush=True)
    if _OWNED_RUNS is not None:
        shutil.rmtree(_OWNED_RUNS, ignore_errors=True)


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

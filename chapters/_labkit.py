"""What a lab's tests run against: the student's lab.py, the engine's own
function, or another lab.py (``make labs-check`` passes the skeleton's).

Each ``test_lab.py`` gets its function with ``load(__file__, "name")``.
``TRACEVLLM_LAB_IMPL`` chooses the implementation:

- unset or ``lab``: the ``lab.py`` next to the test (``make lab CH=NN``);
- ``reference``: the engine's function (``tracevllm.labs.reference``);
- a folder: its ``NN-topic/lab.py`` (labs-check copies the untouched
  skeletons into one).
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

IMPL_ENV = "TRACEVLLM_LAB_IMPL"


def implementation() -> str:
    return os.environ.get(IMPL_ENV) or "lab"


def load(test_file: str, name: str) -> Callable[..., Any]:
    """The function ``name`` the tests in ``test_file`` should check."""
    impl = implementation()
    if impl == "reference":
        from tracevllm.labs import reference

        return reference(name)
    lab_dir = Path(test_file).resolve().parent
    path = lab_dir / "lab.py" if impl == "lab" else Path(impl) / lab_dir.name / "lab.py"
    module_name = "lab_" + re.sub(r"\W", "_", path.parent.name)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    function = getattr(module, name, None)
    if not callable(function):
        raise AttributeError(f"{path} must define a function {name}()")
    return function

"""tracevllm/logger.py: TRACEVLLM_LOGGING_LEVEL and TRACEVLLM_CONFIGURE_LOGGING.

Each case imports tracevllm in a fresh interpreter (the logger is configured
once, at import) and logs through a module's logger, as the engine does.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SNIPPET = """
import logging, tracevllm
log = logging.getLogger("tracevllm.worker.cpu_threads")
log.info("CPU threads: 2 -> 1")
log.warning("a warning")
print("propagate", logging.getLogger("tracevllm").propagate)
"""


def run(**env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TRACEVLLM_")}
    return subprocess.run(
        [sys.executable, "-c", SNIPPET],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.timeout(120)
def test_the_default_level_shows_warnings_in_vllms_format() -> None:
    proc = run()
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "CPU threads" not in proc.stderr
    # LEVEL mm-dd hh:mm:ss [file:line] message
    level, _, _, where, *message = lines[0].split(" ")
    assert (level, where, " ".join(message)) == ("WARNING", "[<string>:5]", "a warning")
    assert "propagate False" in proc.stdout


@pytest.mark.timeout(120)
def test_info_shows_the_engines_info_lines() -> None:
    proc = run(TRACEVLLM_LOGGING_LEVEL="info")
    assert proc.returncode == 0, proc.stderr
    assert [line.split(" ", 1)[0] for line in proc.stderr.splitlines()] == ["INFO", "WARNING"]
    assert "CPU threads: 2 -> 1" in proc.stderr


@pytest.mark.timeout(120)
def test_a_wrong_level_names_the_variable_and_the_levels() -> None:
    proc = run(TRACEVLLM_LOGGING_LEVEL="LOUD")
    assert proc.returncode != 0
    assert "TRACEVLLM_LOGGING_LEVEL='LOUD' is not a log level" in proc.stderr
    assert "DEBUG" in proc.stderr


@pytest.mark.timeout(120)
def test_configure_logging_0_leaves_logging_to_the_application() -> None:
    proc = run(TRACEVLLM_CONFIGURE_LOGGING="0", TRACEVLLM_LOGGING_LEVEL="INFO")
    assert proc.returncode == 0, proc.stderr
    # No handler of tracevllm's: Python's last-resort handler prints the
    # warning bare, and the records reach the root logger.
    assert proc.stderr.strip() == "a warning"
    assert "propagate True" in proc.stdout

"""Lets every lab's test_lab.py ``from _labkit import load``."""

from __future__ import annotations

import sys
from pathlib import Path

_CHAPTERS = str(Path(__file__).resolve().parent)
if _CHAPTERS not in sys.path:
    sys.path.insert(0, _CHAPTERS)

"""Warnings at the user's line, for warnings raised inside qtensor's and torch's machinery."""
from __future__ import annotations

import os
import sys
import warnings

import torch

__all__ = ["warn", "warn_once"]

_warned: set = set()
_PACKAGE_DIRS = tuple(os.path.dirname(f) + os.sep for f in (__file__, torch.__file__))


def warn(message: str) -> None:
    """Warn at the user's line: the first caller outside qtensor and torch (torch's optimizer
    and module machinery may sit between the user and a hook)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIRS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warn(message)

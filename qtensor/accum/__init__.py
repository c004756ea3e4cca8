"""Accumulation formats (``qt.accum``): AccumFormat and its presets, ``accum_matmul`` (the MMA
datapath of a contraction), its kernel glue and reference (``core``)."""
from .core import *  # noqa: F401,F403
from .core import PRESETS

globals().update(PRESETS)  # qt.accum.hopper_fp8, ...

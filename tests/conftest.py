"""Fixtures: the quantizer implementations under test. Shared helpers are in helpers.py."""
from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels (qtensor/gpu, tests/kernels/test_triton.py) run under Triton's CPU
# interpreter. It must be on before triton is first imported (importing qtensor imports
# torch._dynamo, which imports triton): triton decides at import which functions it interprets.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import qtensor as qt  # noqa: E402
from qtensor.kernels import reference  # noqa: E402

# The quantizers every oracle test runs against: the public entry point (which may use compiled
# kernels) and the pure-PyTorch reference.
QUANTIZERS = {"qt.quantize": qt.quantize, "reference.quantize": reference.quantize}


@pytest.fixture(params=list(QUANTIZERS), ids=list(QUANTIZERS))
def quantize(request):
    """Each implementation of quantize(x, fmt, *, rounding=None, generator=None)."""
    return QUANTIZERS[request.param]


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "opinfo_sweep: the OpInfo op sweep over QTensor inputs (slowest file)")

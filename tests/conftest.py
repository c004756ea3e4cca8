"""Shared test helpers: bit-exact comparison and the quantizer implementations under test.

Import from here (``from conftest import assert_bits_equal``) rather than redefining; keep it small.
"""
from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels (qtensor/gpu, tests/test_triton.py) run under Triton's CPU
# interpreter. It must be on before triton is first imported (importing qtensor imports
# torch._dynamo, which imports triton): triton decides at import which functions it interprets.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import qtensor as qt  # noqa: E402
from qtensor import reference  # noqa: E402

_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a floating tensor as a same-width integer tensor (contiguous copy)."""
    return t.detach().contiguous().view(_INT_VIEW[t.dtype])


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, msg: str = "",
                      inputs: torch.Tensor | None = None) -> None:
    """Equal shape, dtype and bits; NaN matches NaN by position (any payload, any sign).

    On failure, reports the number of mismatches and the first few (with ``inputs`` when given).
    """
    assert actual.shape == expected.shape, f"{msg} shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{msg} dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.detach().cpu().reshape(-1), expected.detach().cpu().reshape(-1)
    a_nan, e_nan = torch.isnan(a), torch.isnan(e)
    bad = (a_nan != e_nan) | (~a_nan & ~e_nan & (as_bits(a) != as_bits(e)))
    if bool(bad.any()):
        where = bad.nonzero().reshape(-1)[:8].tolist()
        x = inputs.detach().cpu().reshape(-1) if inputs is not None else None
        rows = [f"  [{i}]" + (f" x={x[i].item()!r}" if x is not None else "")
                + f" got={a[i].item()!r} expected={e[i].item()!r}" for i in where]
        raise AssertionError(f"{msg}: {int(bad.sum())} of {a.numel()} values differ in bits\n"
                             + "\n".join(rows))


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

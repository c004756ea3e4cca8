"""The one rounding back end (qtensor.kernels.backend.round_payload): the ops of QTensors round
through it without the public entry points' argument checks and derive each output's format
once (that no module outside the kernels package reaches into the package's private helpers:
tests/test_imports.py)."""

import pytest
import torch

import qtensor as qt
from qtensor.kernels import ops
from qtensor.tensor import dispatch
from helpers import assert_bits_equal


@pytest.fixture
def checks_counted(monkeypatch):
    """Counts the calls of qt.quantize's argument checks."""
    calls = []
    for name in ("check_input", "resolve_rounding", "check_axis", "check_generator"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _r=real, _n=name, **k: calls.append(_n)
                            or _r(*a, **k))
    return calls


def test_stochastic_ops_of_qtensors_check_no_arguments(checks_counted):
    """Ops of QTensors in a stochastic format round without qt.quantize's checks (they used to
    go through the public qt.quantize on every op), with the bits of qt.quantize under the same
    seed of torch's default generator."""
    fmt = qt.format("bf16(rounding=stochastic)")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 48, generator=g), torch.randn(48, 16, generator=g)
    a, b = qt.as_qtensor(x, fmt), qt.as_qtensor(y, fmt)
    w = qt.as_qtensor(torch.randn(32, 48, generator=g), fmt)
    del checks_counted[:]
    torch.manual_seed(5)
    got = [(a * 0.3).payload, (a @ b).payload, (a + w).payload]
    assert checks_counted == []
    torch.manual_seed(5)
    want = [qt.quantize(a.payload * 0.3, fmt), qt.quantize(a.payload @ b.payload, fmt),
            qt.quantize(a.payload + w.payload, fmt)]
    for i, (p, q) in enumerate(zip(got, want)):
        assert_bits_equal(p, q, f"op {i}")


def test_an_op_fits_its_output_format_once(monkeypatch):
    """One op of MX-formatted QTensors: its output's format is derived once (fit_format), not
    once per step (rounding, wrapping)."""
    calls = []
    real = dispatch.fit_format
    monkeypatch.setattr(dispatch, "fit_format", lambda *a: calls.append(a) or real(*a))
    a = qt.as_qtensor(torch.randn(16, 64), qt.mxfp8_e4m3)
    b = qt.as_qtensor(torch.randn(16, 64), qt.mxfp8_e4m3)
    c = a + b
    assert len(calls) == 1, calls
    assert_bits_equal(c.payload, qt.quantize(a.payload + b.payload, qt.mxfp8_e4m3), "a + b")

"""Shared test helpers: bit-exact comparison.

Import from here (``from helpers import assert_bits_equal``) rather than redefining; keep it
small. Fixtures live in conftest.py, the exact format oracles in oracles.py.
"""
from __future__ import annotations

import torch

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


def assert_passes_under_isa(test_file: str, isa: str, selection: str) -> None:
    """The tests of test_file matching ``-k selection`` pass in a subprocess under
    QTENSOR_CPU_ISA=isa (the baseline or AVX2 copies of the CPU loops; the test process itself
    takes the best the CPU has), run from the repository root."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        os.path.abspath(test_file), "-k", selection],
                       env=dict(os.environ, QTENSOR_CPU_ISA=isa), cwd=root,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]

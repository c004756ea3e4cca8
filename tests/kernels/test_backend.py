"""The one rounding back end (qtensor.kernels.backend.round_payload): the ops of QTensors round
through it without the public entry points' argument checks, derive each output's format once,
and no module outside the kernels package reaches into the package's private helpers."""
import ast
import pathlib

import pytest
import torch

import qtensor as qt
from qtensor.kernels import ops
from qtensor.tensor import dispatch
from helpers import assert_bits_equal

ROOT = pathlib.Path(qt.__file__).parent


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


def _kernel_modules(tree, package: str) -> dict:
    """Local name -> qtensor.kernels module, for the modules of the kernels package a module
    binds (``from ..kernels import ops as _ops``)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")
            base = ".".join(base[:len(base) - (node.level - 1)]
                            + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full.startswith("qtensor.kernels.") and (
                        (ROOT.parent / (full.replace(".", "/") + ".py")).exists()
                        or (ROOT.parent / full.replace(".", "/")).is_dir()):
                    out[alias.asname or alias.name] = full
    return out


# the rounding back end and its public entry points (the reference is the specification,
# whose float64 helpers analysis.ptq computes with)
BACKEND = ("qtensor.kernels.backend", "qtensor.kernels.ops")


def _private_uses(name: str, package: str, source: str) -> list:
    """The private names (one leading underscore) of the BACKEND modules that the module
    ``name`` imports or reads as attributes."""
    tree = ast.parse(source)
    mods = _kernel_modules(tree, package)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")
            base = ".".join(base[:len(base) - (node.level - 1)]
                            + ([node.module] if node.module else []))
            if base in BACKEND:
                found += [f"{name}:{node.lineno} imports {base}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and mods.get(node.value.id) in BACKEND and node.attr.startswith("_")
              and not node.attr.startswith("__")):
            found.append(f"{name}:{node.lineno} reads {mods[node.value.id]}.{node.attr}")
    return found


def test_no_module_outside_the_kernels_package_uses_the_back_ends_private_helpers():
    # what tensor/dispatch.py did: the check must see both forms
    before = ("from ..kernels import ops as _ops\nfrom ..kernels.ops import _round_scalar32\n"
              "x = _ops._ROUNDING_CODE\n")
    assert _private_uses("qtensor.tensor.dispatch", "qtensor.tensor", before) == [
        "qtensor.tensor.dispatch:2 imports qtensor.kernels.ops._round_scalar32",
        "qtensor.tensor.dispatch:3 reads qtensor.kernels.ops._ROUNDING_CODE"]
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[:2] == ["qtensor", "kernels"]:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found += _private_uses(name, package, path.read_text())
    assert not found, "private helpers of the rounding back end used outside qtensor.kernels:\n" + "\n".join(found)

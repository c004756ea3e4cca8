"""qt.quantize and QTensor under autograd and torch.func: a straight-through gradient for every
format family and rounding mode, never a silently cut graph; torch.func transforms compute or
refuse clearly, never crash."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import qtensor as qt
from helpers import assert_bits_equal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FORMATS = {
    "float": qt.fp8_e4m3,                       # saturating: 1000 -> 448
    "float_inf": qt.fp16,                       # overflows to inf
    "fixed": qt.format("fixed8.4"),
    "block": qt.mxfp4_e2m1,
    "block_fixed": qt.format("mxint8"),
    "block_tensor_scale": qt.nvfp4,
}
ROUNDINGS = ["nearest", "nearest_away", "toward_zero", "stochastic"]


def _input(dtype=torch.float32):
    torch.manual_seed(0)
    x = torch.randn(4, 64) * 4
    x[0, :3] = torch.tensor([1000.0, -1e6, 1e-9])  # saturation/overflow, and a flush to zero
    return x.to(dtype)


# ---------------------------------------------------------------------------------------------
# qt.quantize: a straight-through (identity) gradient

@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("family", list(FORMATS))
def test_quantize_has_straight_through_gradient(family, rounding):
    fmt = FORMATS[family]
    x = _input().requires_grad_()
    torch.manual_seed(1)
    y = qt.quantize(x, fmt, rounding=rounding)
    torch.manual_seed(1)
    expected = qt.quantize(x.detach(), fmt, rounding=rounding)
    assert y.requires_grad and y.grad_fn is not None
    assert_bits_equal(y.detach(), expected)
    w = torch.randn(4, 64)
    (y * w).sum().backward()
    assert_bits_equal(x.grad, w)  # identity, where the format saturates or overflows too


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_quantize_gradient_other_dtypes(dtype):
    """float64 goes to the reference, float16/bfloat16 to the kernels: the same gradient."""
    x = _input(dtype).requires_grad_()
    y = qt.quantize(x, qt.fp8_e5m2)
    assert y.dtype == dtype
    y.sum().backward()
    assert x.grad.dtype == dtype and bool((x.grad == 1).all())


def test_quantize_gradient_through_a_graph_and_generator():
    w = torch.randn(8, requires_grad=True)
    g = torch.Generator().manual_seed(3)
    y = qt.quantize(w * 3, qt.bf16, rounding="stochastic", generator=g)
    (y ** 2).sum().backward()
    assert_bits_equal(w.grad, 3 * 2 * y.detach())  # d/dw (q(3w))^2 = 2 q(3w) * 3
    with torch.no_grad():
        assert not qt.quantize(w, qt.bf16).requires_grad


def test_quantize_out_with_autograd_is_refused_as_torch_does():
    x = torch.randn(6, requires_grad=True)
    with pytest.raises(RuntimeError, match="out=.*automatic differentiation"):
        torch.neg(x, out=torch.empty(6))
    with pytest.raises(RuntimeError, match="out=.*automatic differentiation"):
        qt.quantize(x, qt.bf16, out=torch.empty(6))
    with pytest.raises(RuntimeError, match="out=.*automatic differentiation"):
        qt.quantize(x.detach(), qt.bf16, out=torch.empty(6, requires_grad=True))
    out = torch.empty(6)
    with torch.no_grad():
        qt.quantize(x, qt.bf16, out=out)
    assert_bits_equal(out, qt.quantize(x.detach(), qt.bf16))


def test_quantize_inplace_inside_a_graph():
    """quantize_ of a non-leaf is recorded (straight through); a leaf that requires grad is
    refused as torch refuses w.mul_(2); a saved value that it changes is caught."""
    w = torch.randn(64, requires_grad=True)
    y = w * 2
    qt.quantize_(y, qt.mxfp4_e2m1)
    assert_bits_equal(y.detach(), qt.quantize((w * 2).detach(), qt.mxfp4_e2m1))
    (y * 5).sum().backward()
    assert bool((w.grad == 10).all())
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        qt.quantize_(w, qt.bf16)
    y = w * 2
    s = (y * y).sum()  # saves y
    qt.quantize_(y, qt.fp8_e4m3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        s.backward()
    y = (w * 2).detach()
    v = y._version
    qt.quantize_(y, qt.fp8_e4m3)  # outside autograd too: the version moves
    assert y._version > v


# ---------------------------------------------------------------------------------------------
# torch.func: in a fresh interpreter, so that a crash (it was a segfault) fails the test

_TRANSFORMS = r"""
import warnings
import torch
import qtensor as qt
warnings.simplefilter("ignore")
torch.manual_seed(0)
F = torch.func
t, v = torch.randn(5), torch.randn(5)
xp, w = torch.randn(5, 64), torch.randn(64, 8)

def check(name, fn):
    try:
        r = fn()
    except NotImplementedError as e:
        print(name, "REFUSED" if "torch.func transforms" in str(e) else f"OTHER {e}")
    except Exception as e:
        print(name, f"ERROR {type(e).__name__}: {e}".replace("\n", " ")[:300])
    else:
        print(name, "OK" if r else "WRONG")

# qt.quantize computes under every transform (straight through)
q = lambda t: qt.quantize(t, qt.fp8_e4m3)
check("grad", lambda: torch.equal(F.grad(lambda t: q(t).sum())(t), torch.ones(5)))
check("jacrev", lambda: torch.equal(F.jacrev(q)(t), torch.eye(5)))
check("jacfwd", lambda: torch.equal(F.jacfwd(q)(t), torch.eye(5)))
check("jvp", lambda: torch.equal(F.jvp(q, (t,), (v,))[1], v))
tt = torch.randn(3, 64)
check("vmap", lambda: torch.equal(F.vmap(lambda r: qt.quantize(r, qt.mxfp4_e2m1))(tt),
                                   qt.quantize(tt, qt.mxfp4_e2m1)))
check("vmap_grad", lambda: torch.equal(F.vmap(F.grad(lambda r: q(r).sum()))(tt),
                                        torch.ones(3, 64)))
# QTensors built inside a transform: a clear refusal (the first one was a segfault)
check("grad_mm_fmt", lambda: F.grad(lambda w: (qt.as_qtensor(xp, "bf16", mm_fmt="mxfp4") @ w)
                                   .sum())(w))
check("grad_matmul", lambda: F.grad(lambda w: (qt.as_qtensor(xp, "bf16") @ w).sum())(w))
check("grad_as_qtensor", lambda: F.grad(lambda t: qt.as_qtensor(t, "bf16").sum())(t))
check("jacrev_as_qtensor", lambda: F.jacrev(lambda t: qt.as_qtensor(t, "bf16").dequantize())(t))
check("vmap_as_qtensor", lambda: F.vmap(lambda t: qt.as_qtensor(t, "bf16") * 2)(tt))
m = qt.convert(torch.nn.Linear(4, 2), qt.mxfp6_e3m2)
p = dict(m.named_parameters())
check("grad_model", lambda: F.grad(lambda p: F.functional_call(m, p, (torch.randn(3, 4),))
                                   .sum())(p))
check("vmap_model", lambda: F.vmap(m)(torch.randn(3, 4)))
# QTensors built outside and used inside compute
qx = qt.as_qtensor(torch.randn(5), "bf16")
check("grad_of_qtensor_constant",
      lambda: torch.equal(F.grad(lambda t: (qx * t).sum())(t).dequantize(), qx.dequantize()))
print("END")
"""


def test_torch_func_transforms_compute_or_refuse_never_crash():
    p = subprocess.run([sys.executable, "-c", _TRANSFORMS], capture_output=True, text=True,
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert p.returncode == 0, f"crashed (rc {p.returncode}):\n{p.stdout}\n{p.stderr[-3000:]}"
    got = dict(line.split(" ", 1) for line in p.stdout.strip().splitlines() if " " in line)
    assert p.stdout.strip().endswith("END"), p.stdout
    for name in ["grad", "jacrev", "jacfwd", "jvp", "vmap", "vmap_grad",
                 "grad_of_qtensor_constant"]:
        assert got.get(name) == "OK", f"{name}: {got.get(name)}"
    for name in ["grad_mm_fmt", "grad_matmul", "grad_as_qtensor", "jacrev_as_qtensor",
                 "vmap_as_qtensor", "grad_model", "vmap_model"]:
        assert got.get(name) == "REFUSED", f"{name}: {got.get(name)}"


def test_torch_func_refusal_message():
    with pytest.raises(NotImplementedError, match=textwrap.dedent(
            r"QTensor does not support torch.func transforms .*torch.autograd")):
        torch.func.grad(lambda t: qt.as_qtensor(t, "bf16").sum())(torch.randn(3))


_KERNEL_ON_A_WRAPPER = r"""
import warnings
import torch
import qtensor as qt
import qtensor.tensor.subclass
warnings.simplefilter("ignore")
qtensor.tensor.subclass.refuse_transformed = lambda *a, **k: None  # as before the Python-side refusal
xp, w = torch.randn(5, 64), torch.randn(64, 8)
try:
    torch.func.grad(lambda w: (qt.as_qtensor(xp, "bf16", mm_fmt="mxfp4") @ w).sum())(w)
except RuntimeError as e:
    print("has no storage" in str(e), str(e).splitlines()[0][:200])
"""


@pytest.mark.skipif(not qt.kernels.ops.kernels_available(), reason="needs the compiled kernels")
def test_kernel_refuses_a_tensor_without_storage():
    """The kernels' overlap check dereferenced the storage of a functorch wrapper (a segfault)
    when one reached them from a QTensor's payload: a clear error now, in C++ too."""
    p = subprocess.run([sys.executable, "-c", _KERNEL_ON_A_WRAPPER], capture_output=True,
                       text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert p.returncode == 0, f"crashed (rc {p.returncode}):\n{p.stdout}\n{p.stderr[-3000:]}"
    assert p.stdout.startswith("True"), p.stdout

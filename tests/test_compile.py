"""torch.compile of QTensor code and of converted models, from the user's side.

What README promises: converted models and code calling ``qt.as_qtensor`` compile (default,
``fullgraph=True``, ``dynamic=True``); results are QTensors in the same formats as eager; with
``backend="aot_eager"`` or inductor's ``mode="lite"`` (ATen kernels) they are bit-identical to
eager; with the default inductor each op's values are the format's rounding of inductor's own
float32 result, which for gelu, layer_norm, softmax, ... can differ from ATen's in the last bits.

Compiling is slow on CI's few cores: the models are tiny and the compile calls few.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qtensor as qt
from conftest import assert_bits_equal
from qtensor import ops

needs_kernels = pytest.mark.skipif(
    not ops.kernels_available("cpu"),
    reason="inductor needs the compiled quantize op (it cannot generate code for the reference's "
           "int64 bit manipulations)")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Net(nn.Module):
    """A conv, a linear layer, GELU, LayerNorm and softmax: every kind of op a model has."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x):
        h = self.conv(x).transpose(1, 2)
        return torch.softmax(self.fc2(self.norm(self.act(self.fc1(h)))), -1)


def _converted(spec):
    torch.manual_seed(0)
    return qt.convert(Net(), spec)


def _run(model, x):
    """Forward and backward (the loss computed from the QTensor output, as a user would)."""
    y = model(x)
    y.square().sum().backward()
    return y.detach(), {n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters()}


def _assert_same(got, expected, msg=""):
    assert isinstance(got, qt.QTensor), f"{msg}: got {type(got).__name__}"
    assert (got.fmt, got.mm_fmt) == (expected.fmt, expected.mm_fmt), msg
    assert_bits_equal(got.dequantize(), expected.dequantize(), msg)


def _assert_matches_eager(compiled, model):
    """Forward and every gradient of compiled equal eager model's bit for bit."""
    x = torch.randn(2, 4, 6)
    y, grads = _run(model, x)
    yc, grads_c = _run(compiled, x)
    _assert_same(yc, y, "output")
    for name, g in grads.items():
        _assert_same(grads_c[name], g, f"grad of {name}")


def _in_format(t):
    return torch.equal(t.dequantize(), qt.quantize(t.dequantize(), t.fmt))


# ---------------------------------------------------------------------------------------------
# Item 2: QTensor code and converted models compile

def test_compiled_as_qtensor_fullgraph():
    """as_qtensor inside compiled code builds the QTensor in the graph; its formats can be read
    there (fullgraph: no graph break), and gradients flow straight through."""
    def f(x):
        y = qt.as_qtensor(x, qt.bf16, mm_fmt=qt.mxfp6_e3m2) * 2
        return y if y.fmt == qt.bf16 and y.mm_fmt == qt.mxfp6_e3m2 else None

    torch.manual_seed(0)
    x = torch.randn(4, 32, requires_grad=True)
    xc = x.detach().clone().requires_grad_()
    y = f(x)
    yc = torch.compile(f, fullgraph=True, backend="aot_eager")(xc)
    _assert_same(yc, y, "forward")
    y.sum().backward()
    yc.sum().backward()
    assert type(xc.grad) is torch.Tensor
    assert_bits_equal(xc.grad, x.grad, "straight-through gradient")


# dynamic=True: PyTorch 2.13's dynamo fails (at random, by PYTHONHASHSEED) to build the guards of
# a frame whose input is a tensor subclass that another dynamic compiled frame returned ("sources
# must not be empty for symbol ..."; torch's own TwoTensor does the same). qt.convert therefore
# rounds the root's inputs and outputs inside its forward (no hook frames of their own):
# test_dynamic_compile_under_hash_seeds runs it under the seeds that failed.
@pytest.mark.parametrize("mode", ["default", "fullgraph", "dynamic"])
@pytest.mark.parametrize("spec", ["bf16", "mxfp6"])
def test_compiled_converted_model_is_bit_identical_to_eager(spec, mode):
    """A converted model called on a plain float32 tensor; AOTAutograd runs ATen's kernels, so
    forward and every gradient equal eager's bit for bit."""
    model = _converted({"bf16": qt.bf16, "mxfp6": qt.recipes.mxfp6}[spec])
    compiled = torch.compile(copy.deepcopy(model), backend="aot_eager",
                             fullgraph=mode == "fullgraph", dynamic=mode == "dynamic" or None)
    _assert_matches_eager(compiled, model)


_DYNAMIC_SCRIPT = """
import sys, torch, qtensor as qt
sys.path.insert(0, sys.argv[1])
from test_compile import Net
torch.manual_seed(0)
model = qt.convert(Net(), qt.bf16)
compiled = torch.compile(model, dynamic=True, backend="aot_eager")
for shape in [(2, 4, 6), (3, 4, 7)]:
    y = compiled(torch.randn(shape))
    y.square().sum().backward()
    assert isinstance(y, qt.QTensor) and y.fmt == qt.bf16
print("ok")
"""


@pytest.mark.parametrize("seed", ["1", "6", "10"])
def test_dynamic_compile_under_hash_seeds(seed):
    """Hash seeds under which dynamic=True failed while the root's rounding ran in hooks."""
    env = dict(os.environ, PYTHONHASHSEED=seed)
    r = subprocess.run([sys.executable, "-c", _DYNAMIC_SCRIPT, os.path.dirname(__file__)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_compiled_as_qtensor_dynamic_shapes():
    """dynamic=True: one graph serves several input sizes, each result equal to eager's. The
    format is an argument: dynamo makes the ints of such objects symbolic under dynamic=True."""
    def f(x, fmt):
        return torch.relu(qt.as_qtensor(x, fmt) @ qt.as_qtensor(x, qt.bf16).t())

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for n in (3, 5, 9):
        x = torch.randn(n, 8)
        _assert_same(compiled(x, qt.fp8_e4m3), f(x, qt.fp8_e4m3), f"{n} rows")


# ---------------------------------------------------------------------------------------------
# Item 3: what inductor guarantees

@needs_kernels
def test_inductor_lite_is_bit_identical_to_eager():
    """mode="lite" keeps ATen's kernels for every op: bit-identical, forward and backward."""
    model = _converted(qt.recipes.mxfp6)
    compiled = torch.compile(copy.deepcopy(model), mode="lite", fullgraph=True)
    _assert_matches_eager(compiled, model)


@needs_kernels
def test_inductor_rounds_its_own_float32_results():
    """Default inductor: the rounding is exact (the same opaque op), the float32 math is
    inductor's: each result is the format's rounding of inductor's float32 result, in format
    (not always eager's value: about 3% of gelu's differ on this input)."""
    def ops_(x):
        return F.gelu(x), F.layer_norm(x, (x.shape[-1],)), torch.softmax(x, -1)

    torch.manual_seed(0)
    q = qt.as_qtensor(torch.randn(64, 256) * 3, qt.bf16)
    got = torch.compile(ops_, fullgraph=True)(q)
    float32 = torch.compile(ops_, fullgraph=True)(q.dequantize())
    for name, g, f in zip(("gelu", "layer_norm", "softmax"), got, float32):
        assert isinstance(g, qt.QTensor) and g.fmt == qt.bf16 and _in_format(g), name
        assert_bits_equal(g.dequantize(), qt.quantize(f, qt.bf16), name)

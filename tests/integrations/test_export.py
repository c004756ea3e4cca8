"""torch.export of converted models, from the user's side.

``torch.export.export(qt.convert(model, recipe), (x,))`` with a plain float input: the exported
program (pre-dispatch ATen IR, QTensors in it) computes eager's formats and bits, with or without
an accumulator; ``.run_decompositions()`` lowers it to plain tensors and custom ops (the
roundings, the accumulator's kernel) with the same bits. The program is the forward pass only
(the gradient roundings are custom autograd functions, which export does not keep).
"""
from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import qtensor as qt
from helpers import assert_bits_equal
from qtensor.kernels import ops

_ACCUM_KERNEL = ops.kernels_available("cpu") and hasattr(torch.ops.qtensor, "accum_matmul")


def _model(layer, accum):
    torch.manual_seed(0)
    if layer == "linear":
        m = nn.Sequential(nn.Linear(256, 32), nn.ReLU(), nn.Linear(32, 8))
    else:
        m = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(16 * 4 * 4, 8))
    fp8 = ("bf16", "fp8_e4m3")
    return qt.convert(m, qt.Recipe(weight=fp8, bias="bf16", activation=fp8,
                                   grad=("bf16", "fp8_e5m2"), accumulate=accum))


def _input(layer, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((64, 256) if layer == "linear" else (64, 8, 4, 4), generator=g)


def _assert_same(got, want, msg):
    assert isinstance(got, qt.QTensor), f"{msg}: got {type(got).__name__}"
    assert (got.fmt, got.mm_fmt, got.accum) == (want.fmt, want.mm_fmt, want.accum), msg
    assert_bits_equal(got.dequantize(), want.dequantize(), msg)


@pytest.mark.parametrize("accum", [None, qt.accum.hopper_fp8], ids=["fp32_accum", "hopper_fp8"])
@pytest.mark.parametrize("layer", ["linear", "conv2d"])
def test_exported_converted_model_computes_eagers_bits(layer, accum):
    model = _model(layer, accum)
    x = _input(layer, 1)
    ep = torch.export.export(model, (x,))
    for seed in (1, 2):  # the traced input and another one
        x = _input(layer, seed)
        want = model(x)
        got = ep.module()(x)
        _assert_same(got, want, f"exported, input {seed}")
    assert not got.requires_grad  # the forward pass only (README)
    # lowered to plain tensors: the roundings and the accumulator's kernel are custom ops
    lowered = ep.run_decompositions()
    for node in lowered.graph.nodes:
        assert not isinstance(node.meta.get("val"), qt.QTensor), node.format_node()
    got = lowered.module()(x)
    assert type(got) is torch.Tensor
    assert_bits_equal(got, want.dequantize(), "run_decompositions")
    targets = {str(n.target) for n in lowered.graph.nodes}
    if accum is not None and _ACCUM_KERNEL:
        assert "qtensor.accum_matmul.default" in targets


def test_strict_export():
    """strict=True (dynamo traces the model first) gives the same program."""
    model = _model("linear", qt.accum.hopper_fp8)
    x = _input("linear", 1)
    ep = torch.export.export(model, (x,), strict=True)
    _assert_same(ep.module()(x), model(x), "strict export")



class _Dequantized(nn.Module):
    """The model with a plain output."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).dequantize()


@pytest.mark.parametrize("batch", ["static", "dynamic"])
def test_saving_the_lowered_program(batch):
    """The lowered program saves and loads (torch.export.save), with eager's bits; with a dynamic
    batch too, where the program's output is plain. (torch 2.13 lowers a QTensor output of
    dynamic size to its payload and its size, against an output spec of one tensor; and the
    program with QTensors in it does not serialize: export's node that builds them has no
    serialized form.)"""
    model = _model("linear", qt.accum.hopper_fp8)
    x = _input("linear", 1)
    if batch == "static":
        ep = torch.export.export(model, (x,))
    else:
        ep = torch.export.export(_Dequantized(model), (x,),
                                 dynamic_shapes=({0: torch.export.Dim("batch")},))
    buf = io.BytesIO()
    torch.export.save(ep.run_decompositions(), buf)
    buf.seek(0)
    loaded = torch.export.load(buf).module()
    for rows in ((64,) if batch == "static" else (3, 17)):
        x = _input("linear", rows)[:rows]
        assert_bits_equal(loaded(x), model(x).dequantize(), f"{rows} rows")


def test_dynamic_batch():
    model = _model("conv2d", qt.accum.hopper_fp8)
    ep = torch.export.export(model, (_input("conv2d", 1),),
                             dynamic_shapes=({0: torch.export.Dim("batch")},))
    for rows in (3, 17):
        x = _input("conv2d", rows)[:rows]
        _assert_same(ep.module()(x), model(x), f"{rows} rows")


def test_lowering_a_dynamic_qtensor_output_says_what_to_do():
    """run_decompositions() of a dynamic-batch program whose output is a QTensor refuses with
    the documented way out (torch 2.13 would lower the output to its payload and its size, and
    the lowered program failed when called: "treespec.unflatten: leaves has length 2 ... 1").
    The unlowered program keeps working, and so does the documented plain-output program."""
    model = _model("linear", None)
    ep = torch.export.export(model, (_input("linear", 1),),
                             dynamic_shapes=({0: torch.export.Dim("batch")},))
    x = _input("linear", 3)[:3]
    _assert_same(ep.module()(x), model(x), "unlowered")
    with pytest.raises(NotImplementedError, match=r"output is a QTensor of dynamic size "
                                                  r"(.|\n)*model\(x\)\.dequantize\(\)"):
        ep.run_decompositions()
    ep = torch.export.export(_Dequantized(model), (_input("linear", 1),),
                             dynamic_shapes=({0: torch.export.Dim("batch")},))
    assert_bits_equal(ep.run_decompositions().module()(x), model(x).dequantize(), "plain output")


class _SetsAccum(nn.Module):
    """Its forward gives .accum to its weight, or to a QTensor it builds, and then uses it."""

    def __init__(self, on):
        super().__init__()
        self.on = on
        self.fc = nn.Linear(256, 8)

    def forward(self, x):
        w = self.fc.weight
        h = qt.as_qtensor(x, "bf16")
        (w if self.on == "weight" else h).accum = qt.accum.hopper_fp8
        return torch.relu(h) @ w.t()


@pytest.mark.parametrize("on", ["weight", "built_inside"])
def test_accum_set_in_the_exported_forward(on):
    """A t.accum = ... in the forward torch.export traces is part of the program: eager's bits
    (the accumulator's, not FP32's)."""
    def model():
        torch.manual_seed(0)
        return qt.convert(_SetsAccum(on), qt.Recipe(weight="bf16", activation="bf16"))

    x = _input("linear", 1)
    ep = torch.export.export(model(), (x,))
    want = model()(x)
    got = ep.module()(x)
    assert want.accum is qt.accum.hopper_fp8
    _assert_same(got, want, "exported")
    assert_bits_equal(ep.run_decompositions().module()(x), want.dequantize(), "lowered")
    # strict=True: dynamo traces the forward and cannot put the assignment in the graph
    with pytest.raises(Exception, match=r"QTensor\.accum was set inside code that torch\.compile"):
        torch.export.export(model(), (x,), strict=True)

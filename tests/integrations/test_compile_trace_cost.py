"""What dynamo traces of a converted model's Python (first-step compile time).

The string forms of a traced QTensor's formats and the format comparison in role roundings are
constants that dynamo takes from the real objects (torch.compiler.assume_constant_result in
qtensor/tensor/subclass.py), instead of tracing the string form (which compares a format with every
preset) and dataclass equality field by field. These tests check that those constants are
what the traced code computed before, that a format the traced code builds itself still gets
its own string, that a reconverted model gets a new graph, and that the format Python stays out of
the trace.
"""
from __future__ import annotations

import collections
import warnings

import pytest
import torch
from torch import nn

import qtensor as qt
from helpers import assert_bits_equal
from qtensor.kernels import ops
from qtensor.tensor import subclass as qtensor_mod
from qtensor.formats.float import FloatFormat

needs_kernels = pytest.mark.skipif(not ops.kernels_available("cpu"),
                                   reason="the compiled quantize op")

MX_SPECS_MXFP6 = {"scale_bits": 8, "w_elem_format": "fp6_e3m2", "a_elem_format": "fp6_e3m2",
                  "block_size": 32, "bfloat": 16, "custom_cuda": False,
                  "quantize_backprop": True}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


FORMATS = [qt.fp8_e4m3, qt.format("e4m3(rounding=toward_zero)"), qt.mxfp6_e3m2,
           qt.mxfp6_e3m2.replace(axis=0), qt.format("e3m4(bias=3)"), qt.format("fixed8.4"),
           qt.format("block(elem=fixed8.6(symmetric=True), block_size=16)"), qt.bf16]


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_graph_tokens_are_the_string_forms(fmt):
    accum = qt.accum.AccumFormat(chunk=4, frac_bits=13)
    for mm, acc in ((None, None), (qt.mxfp8_e4m3, None), (None, accum),
                    (qt.mxfp8_e4m3, qt.accum.PRESETS["hopper_fp8"])):
        tokens = qtensor_mod._graph_tokens(fmt, mm, acc)
        assert tokens == (str(fmt), None if mm is None else str(mm),
                          None if acc is None else qtensor_mod._accum_token(acc))
        assert qt.format(tokens[0]) == fmt


def test_objects_without_their_fields_get_no_constant():
    # what dynamo passes for a format the traced code constructs (its fields are side effects)
    shell = object.__new__(FloatFormat)
    assert qtensor_mod._graph_tokens(shell, None, None) is None
    assert qtensor_mod._graph_tokens(qt.fp8_e4m3, shell, None) is None
    assert qtensor_mod._same_formats_constant(qt.fp8_e4m3, None, shell, None) is None
    assert qtensor_mod.same_formats(qt.fp8_e4m3, None, qt.format("fp8_e4m3"), None)
    assert not qtensor_mod.same_formats(qt.fp8_e4m3, None, qt.fp8_e4m3, qt.bf16)


def test_token_cache_stays_bounded():
    qtensor_mod._TOKENS.clear()
    for i in range(qtensor_mod._TOKENS_SIZE + 50):  # formats made anew, as a loop could
        qtensor_mod._token(FloatFormat(4, 3, bias=i % 13 + 1))
    assert len(qtensor_mod._TOKENS) <= qtensor_mod._TOKENS_SIZE + 1
    f = FloatFormat(5, 2, rounding="toward_zero")
    assert qtensor_mod._token(f) == str(f)


@needs_kernels
@pytest.mark.parametrize("spec", ["e4m3(rounding=toward_zero)", "e3m2(bias=2)",
                                  "block(elem=e2m1, block_size=8)"])
def test_format_built_in_compiled_code_gets_its_own_string(spec):
    # the format object is built by the traced code: no constant, its string form is traced
    # (as before; for e3m2(bias=2) that string form is a graph break: types.SimpleNamespace)
    def f(x):
        return qt.as_qtensor(x * 3, spec)

    x = torch.randn(4, 16)
    want = f(x)
    got = torch.compile(f, backend="aot_eager")(x)
    assert isinstance(got, qt.QTensor) and got.fmt == want.fmt == qt.format(spec)
    assert_bits_equal(got.dequantize(), want.dequantize())


@needs_kernels
def test_a_reconverted_model_gets_a_new_graph():
    # the constants must not outlive the formats they were computed from
    torch.manual_seed(0)
    model = qt.convert(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)),
                       qt.fp8_e4m3)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 32)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (unconvert replaces parameters dynamo holds)
        for fmt in (qt.fp8_e4m3, qt.mxfp6_e3m2, qt.fp6_e3m2):
            if fmt is not qt.fp8_e4m3:
                qt.unconvert(model)
                qt.convert(model, fmt)
            got, want = compiled(x), model(x)
            assert got.fmt == want.fmt == fmt
            assert_bits_equal(got.dequantize(), want.dequantize())
    assert len(graphs) == 3


def _traced_instructions(fn, *args):
    """Bytecode instructions dynamo traces while compiling fn(*args), by file name (aot_eager:
    inductor's front end; backend="eager" runs the graph's QTensor(...) calls as frames that
    dynamo compiles too)."""
    from torch._dynamo import symbolic_convert as sc
    if not hasattr(sc.InstructionTranslatorBase, "step"):
        pytest.skip("this torch's dynamo has no InstructionTranslatorBase.step")
    counts = collections.Counter()
    orig = sc.InstructionTranslatorBase.step

    def step(self):
        counts[self.f_code.co_filename.replace("\\", "/").split("/")[-1]] += 1
        return orig(self)

    sc.InstructionTranslatorBase.step = step
    try:
        torch.compile(fn, backend="aot_eager")(*args)
    finally:
        sc.InstructionTranslatorBase.step = orig
    return counts


def _mx_converted(*layers):
    """nn.Sequential(*layers) converted with microxcaling's MXFP6 spec."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recipe = qt.compat.mx.recipe(MX_SPECS_MXFP6)
    return qt.convert(nn.Sequential(*layers), recipe)


@needs_kernels
def test_the_format_python_is_not_traced():
    # before: this MLP under microxcaling's MXFP6 spec made dynamo trace 76,000 bytecode
    # instructions of formats.py and dataclasses.py (the string forms, every preset's replace
    # and ==; 113,000 in all), now about 1,000 (format properties the rounding op's arguments
    # read; 17,000 in all)
    torch.manual_seed(0)
    model = _mx_converted(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.randn(4, 32)

    def step(x):
        return model(x).dequantize().square().sum()

    counts = _traced_instructions(lambda x: step(x).backward(), x)
    assert counts["formats.py"] + counts["dataclasses.py"] < 3000, dict(counts)


@needs_kernels
def test_compiled_converted_model_bits_unchanged():
    # forward and backward of a converted model under microxcaling's spec: aot_eager gives
    # eager's bits (the traced graph computes what it did before the constants)
    torch.manual_seed(0)
    eager = _mx_converted(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8))
    import copy
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager")
    # the loss inside the compiled code (a plain gradient from outside is refused: test_compile)
    loss = torch.compile(lambda x: compiled(x).dequantize().square().sum(), backend="aot_eager")
    x = torch.randn(4, 32)
    out_e, out_c = eager(x), compiled(x)
    assert out_c.fmt == out_e.fmt
    assert_bits_equal(out_c.dequantize(), out_e.dequantize())
    eager(x).dequantize().square().sum().backward()
    loss(x).backward()
    for (n, pe), (_, pc) in zip(eager.named_parameters(), compiled_model.named_parameters()):
        ge, gc = pe.grad, pc.grad
        assert_bits_equal(getattr(gc, "payload", gc), getattr(ge, "payload", ge))

"""``model.to(fmt)``, ``model.to(recipe)`` and ``tensor.to(fmt)`` (qtensor.nn.to_format), through
torch's ``__torch_function__`` protocol: each compared with what qt.convert / qt.as_qtensor give."""
import copy

import pytest
import torch
from torch import nn

import qtensor as qt
from helpers import assert_bits_equal
from qtensor.nn.convert import conversion_of


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _same_model(a, b, x):
    """The same formats on every parameter and buffer, and the same output bits."""
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and type(pa) is type(pb)
        if isinstance(pa, qt.QTensor):
            assert (pa.fmt, pa.mm_fmt) == (pb.fmt, pb.mm_fmt), na
        assert_bits_equal(qt.nn.plans._plain(pa), qt.nn.plans._plain(pb), na)
    ya, yb = a(x), b(x)
    assert (ya.fmt, ya.mm_fmt) == (yb.fmt, yb.mm_fmt)
    assert_bits_equal(ya.dequantize(), yb.dequantize())


@pytest.mark.parametrize("spec", [qt.mxfp8_e4m3, qt.bf16, qt.format("e3m4(bias=3)"),
                                  qt.recipes.mxfp6, qt.Recipe(weight="fp8_e4m3", activation="bf16",
                                                              rules={"2.*": "fp16"})],
                         ids=str)
def test_module_to_is_convert(spec):
    model, ref = _mlp(), _mlp()
    assert model.to(spec) is model
    qt.convert(ref, spec)
    assert conversion_of(model).recipe == conversion_of(ref).recipe
    _same_model(model, ref, torch.randn(4, 16))


class Block(nn.Module):
    """A subclass with its own ``to`` (as Hugging Face's PreTrainedModel) and a nested module."""

    def __init__(self):
        super().__init__()
        self.inner = _mlp(1)
        self.scale = nn.Parameter(torch.ones(8))
        self.register_buffer("offset", torch.full((8,), 0.1))
        self.calls = 0

    def to(self, *args, **kwargs):
        self.calls += 1
        return super().to(*args, **kwargs)

    def forward(self, x):
        return self.inner(x) * self.scale + self.offset


def test_module_subclass_with_its_own_to():
    model, ref = Block(), Block()
    assert model.to(qt.fp8_e4m3) is model and model.calls == 1
    qt.convert(ref, qt.fp8_e4m3)
    assert model.offset.fmt == qt.fp8_e4m3  # buffers too
    _same_model(model, ref, torch.randn(4, 16))


def test_nested_and_device_calls():
    model, ref = _mlp(), qt.convert(_mlp(), qt.bf16)
    assert model.to(qt.bf16).to("cpu") is model
    _same_model(model, ref, torch.randn(2, 16))
    other = _mlp()
    assert other.to("cpu", qt.bf16) is other and other.to(device="cpu", dtype=qt.bf16) is other
    _same_model(other, ref, torch.randn(2, 16))
    with torch.device("cpu"):  # a TorchFunctionMode in between: still reaches the handler
        third = _mlp().to(qt.bf16)
    _same_model(third, ref, torch.randn(2, 16))


def test_to_fmt_again_changes_the_formats_in_place():
    model = _mlp().to(qt.fp8_e4m3)
    weight = model[0].weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.to(qt.bf16)
    assert model[0].weight is weight and weight.fmt == qt.bf16  # the same parameter object
    ref = qt.convert(qt.unconvert(copy.deepcopy(model)), qt.bf16)
    _same_model(model, ref, torch.randn(3, 16))
    model(torch.randn(3, 16)).dequantize().sum().backward()
    assert weight.grad.fmt == qt.bf16
    before = weight.detach().dequantize().clone()
    opt.step()  # the optimizer made before the change steps the same parameters
    assert not torch.equal(weight.dequantize(), before) and weight.fmt == qt.bf16
    assert model.to(qt.bf16) is model  # the same recipe: nothing changes


def test_failed_reconversion_keeps_the_old_one():
    model = _mlp().to(qt.fp8_e4m3)
    with pytest.raises(IndexError, match="0.bias .* axis 1 is out of range"):
        model.to(qt.Recipe(weight="bf16", bias=qt.BlockFormat(qt.fp8_e4m3, 32, axis=1)))
    assert model[0].weight.fmt == qt.fp8_e4m3 and model(torch.randn(1, 16)).fmt == qt.fp8_e4m3


def test_dtype_casts_of_converted_models_are_refused_as_documented():
    model = _mlp().to(qt.bf16)
    with pytest.raises(RuntimeError, match="casting it to float16"):
        model.to(torch.float16)
    with pytest.raises(RuntimeError, match="casting it to float64"):
        model.double()
    with pytest.raises(TypeError, match="dtype torch.float64 and the FloatFormat"):
        _mlp().to(torch.float64, qt.bf16)


def test_strings_are_torch_device_strings():
    # torch parses a string as a device before any Python hook runs: no format string can work
    with pytest.raises(RuntimeError, match="Invalid device string: 'mxfp8_e4m3'"):
        _mlp().to("mxfp8_e4m3")
    with pytest.raises(RuntimeError, match="Invalid device string"):
        torch.ones(2).to("bf16")
    assert isinstance(_mlp().to(qt.format("mxfp8_e4m3"))[0].weight, qt.QTensor)


def test_tensor_to_fmt_rounds_and_is_differentiable():
    torch.manual_seed(0)
    x = torch.randn(4, 64, requires_grad=True)
    y = x.to(qt.mxfp4_e2m1)
    assert isinstance(y, qt.QTensor) and y.fmt == qt.mxfp4_e2m1 and y.grad_fn is not None
    assert_bits_equal(y.dequantize(), qt.quantize(x.detach(), qt.mxfp4_e2m1))
    g = torch.randn(4, 64)
    (y.dequantize() * g).sum().backward()
    assert_bits_equal(x.grad, g)  # straight through, plain gradient for a plain input
    z = y.to(qt.fp4_e2m1)  # a QTensor is rounded again, from its values
    assert_bits_equal(z.dequantize(), qt.quantize(y.detach().dequantize(), qt.fp4_e2m1))
    w = torch.randn(3).to("cpu", qt.bf16)
    assert w.fmt == qt.bf16 and w.device.type == "cpu"


def test_tensor_to_refuses_what_it_cannot_mean():
    with pytest.raises(TypeError, match="a recipe gives formats to the roles of a model"):
        torch.ones(2).to(qt.recipes.mxfp6)
    with pytest.raises(TypeError, match="cannot give format"):
        torch.ones(2, dtype=torch.int64).to(qt.bf16)
    with pytest.raises(TypeError, match="pass one format or recipe, got 2"):
        torch.ones(2).to(qt.bf16, dtype=qt.fp16)
    with pytest.raises(TypeError):  # any other torch function refuses a format
        torch.add(torch.ones(2), qt.bf16)
    assert (torch.ones(2) == qt.bf16) is False


def test_compiled_model_converted_with_to():
    model, ref = _mlp().to(qt.mxfp8_e4m3), qt.convert(_mlp(), qt.mxfp8_e4m3)
    x = torch.randn(4, 16)
    compiled = torch.compile(model, backend="aot_eager")
    assert_bits_equal(compiled(x).dequantize(), ref(x).dequantize())


def test_to_fmt_inside_compiled_code():
    @torch.compile(backend="eager", fullgraph=True)
    def f(x):
        return x.to(qt.fp8_e4m3) * 2

    x = torch.randn(8)
    y = f(x)
    assert y.fmt == qt.fp8_e4m3
    assert_bits_equal(y.dequantize(), (qt.as_qtensor(x, qt.fp8_e4m3) * 2).dequantize())

    @torch.compile(backend="eager")
    def g(model, x):  # model.to(fmt) runs outside the graph (a graph break)
        model.to(qt.bf16)
        return model(x)

    model = _mlp()
    assert g(model, torch.randn(2, 16)).fmt == qt.bf16 and model[0].weight.fmt == qt.bf16


@pytest.mark.parametrize("how", ["convert", "to"])
def test_converting_a_submodule_of_a_converted_model_is_refused(how):
    # it would round the submodule's tensors and hook it a second time (doubled hooks)
    model = _mlp().to(qt.fp8_e4m3)
    ref = copy.deepcopy(model)
    hooks = (len(model[0]._forward_hooks), len(model[0]._forward_pre_hooks))
    with pytest.raises(RuntimeError, match="part of an already converted model .* rule for it"):
        if how == "convert":
            qt.convert(model[0], qt.bf16)
        else:
            model[0].to(qt.bf16)
    assert (len(model[0]._forward_hooks), len(model[0]._forward_pre_hooks)) == hooks
    x = torch.randn(3, 16)
    _same_model(model, ref, x)  # unchanged: the same formats and output bits
    for m in (model, ref):
        m(x).dequantize().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad.fmt == q.grad.fmt
        assert_bits_equal(p.grad.dequantize(), q.grad.dequantize())
    # what the message says: the whole model again, with a rule for the submodule
    model.to(qt.Recipe.uniform(qt.fp8_e4m3, rules={"0": "bf16"}))
    assert model[0].weight.fmt == qt.bf16 and model[2].weight.fmt == qt.fp8_e4m3
    assert len(model[0]._forward_hooks) == hooks[0]
    # and after qt.unconvert, the submodule converts on its own
    qt.unconvert(model)
    assert qt.convert(model[0], qt.bf16).weight.fmt == qt.bf16

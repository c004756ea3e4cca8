"""A two-level QTensor (nvfp4) and its views are one tensor with one tensor scale: an in-place op
through any of them (a slice, a transpose, ``.data``, ``detach()``) is an op on the whole tensor,
whose values and scale every alias then reads alike. The reference for each op is the same op on
a plain float32 copy, rounded as docs/formats.md says (two-level formats: views)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import qtensor as qt


def _bits(t):
    t = t.dequantize() if isinstance(t, qt.QTensor) else t
    return t.detach().float().contiguous().view(torch.int32)


def _base(seed=0):
    g = torch.Generator().manual_seed(seed)
    return qt.as_qtensor(torch.randn(4, 64, generator=g), qt.nvfp4)


VIEWS = {
    "rows": lambda t: t[1:3],
    "cols": lambda t: t[:, :32],
    "cols_cutting_a_block": lambda t: t[:, :24],
    "flat": lambda t: t.view(-1),
    "t": lambda t: t.t(),
    "unsqueeze": lambda t: t.unsqueeze(0),
    "chunk": lambda t: t.chunk(2)[0],
    "detach": lambda t: t.detach(),
    "data": lambda t: t.data,
    "row": lambda t: t[1],
}


def _src(shape, seed=7):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 5


OPS = {
    "mul_": lambda v: v.mul_(3),
    "add_": lambda v: v.add_(1),
    "zero_": lambda v: v.zero_(),
    "copy_": lambda v: v.copy_(_src(v.shape)),
    "clamp_": lambda v: v.clamp_(-1, 1),
}


def _check(q, views, want):
    """q and each (name, view, make) in views read the values of ``want`` (a QTensor rounded
    from the plain reference) and its tensor scale; the scale holds the values (rounding them
    again under it gives them back)."""
    assert torch.equal(_bits(q), _bits(want)), "base values"
    assert torch.equal(q.tensor_scale.view(torch.int32), want.tensor_scale.view(torch.int32)), \
        ("base scale", float(q.tensor_scale), float(want.tensor_scale))
    again = qt.quantize(q.dequantize(), qt.nvfp4, tensor_scale=q.tensor_scale)
    assert torch.equal(_bits(again), _bits(q)), "base values under its own scale"
    for name, v, make in views:
        assert torch.equal(_bits(v), _bits(make(want.dequantize()))), f"values through {name}"
        assert torch.equal(v.tensor_scale.view(torch.int32),
                           q.tensor_scale.view(torch.int32)), f"scale of {name}"


def _all_views(q):
    return [(name, make(q), make) for name, make in VIEWS.items()]


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("view", list(VIEWS))
def test_an_inplace_op_through_a_view_is_one_on_the_whole_tensor(view, op):
    q = _base()
    views = _all_views(q)
    ref = q.dequantize().clone()
    OPS[op](VIEWS[view](ref))
    OPS[op](VIEWS[view](q))
    want = qt.as_qtensor(ref, qt.nvfp4)  # the whole tensor, rounded under a fresh scale
    _check(q, views, want)
    # an op done later on the base alone: every view still reads it
    q.mul_(0.25)
    _check(q, views, qt.as_qtensor(want.dequantize() * 0.25, qt.nvfp4))


@pytest.mark.parametrize("op", list(OPS))
def test_an_inplace_op_on_the_base_is_read_through_its_views(op):
    q = _base(1)
    views = _all_views(q)
    ref = q.dequantize().clone()
    OPS[op](ref)
    OPS[op](q)
    _check(q, views, qt.as_qtensor(ref, qt.nvfp4))
    ref = q.dequantize().clone()
    ref[1:3] *= 2
    views[0][1].mul_(2)  # then through a view, after the base's own op
    _check(q, views, qt.as_qtensor(ref, qt.nvfp4))


def test_setitem_of_plain_values_into_part_rounds_the_whole_tensor():
    q = _base(2)
    views = _all_views(q)
    ref = q.dequantize().clone()
    ref[1:3] = _src((2, 64)) * 10  # the part's values hold the new amax
    q[1:3] = _src((2, 64)) * 10
    _check(q, views, qt.as_qtensor(ref, qt.nvfp4))


def test_copy_into_part_keeps_a_shared_scale_and_rounds_under_another_again():
    q = _base(4)
    views = _all_views(q)
    s = q.tensor_scale.clone()
    ref = q.dequantize().clone()
    ref[0:2] = ref[2:4]
    q[0:2].copy_(q[2:4].clone())  # q's values under q's scale: nothing rounds
    assert torch.equal(_bits(q), _bits(ref)) and torch.equal(q.tensor_scale, s)
    _check(q, views, qt.as_qtensor(ref, qt.nvfp4, tensor_scale=s))
    other = qt.as_qtensor(_src((2, 64)), qt.nvfp4)  # another scale, and the new amax
    assert not torch.equal(other.tensor_scale, q.tensor_scale)
    ref[1:3] = other.dequantize()
    q[1:3].copy_(other)
    _check(q, views, qt.as_qtensor(ref, qt.nvfp4))


def test_copy_into_part_of_zeros_brings_the_scale_to_the_whole_tensor():
    # (FSDP2 makes its shards so: zeros, then a chunk of the parameter copied into a view) zeros
    # are in format under any scale: the whole buffer keeps the copied values and their scale
    w = _base(5)
    part = w[1:3]
    padded = qt.as_qtensor(torch.zeros(4, 64), qt.nvfp4)
    view = padded.narrow(0, 0, 2)
    view.copy_(part)
    assert torch.equal(_bits(view), _bits(part))
    assert torch.equal(view.tensor_scale, w.tensor_scale)
    assert torch.equal(padded.tensor_scale, w.tensor_scale)
    assert not padded.dequantize()[2:].any()


def test_data_copy_and_init_functions_keep_the_scale_with_the_values():
    # what optimizers and nn.init do: p.data.copy_(...), init.normal_(p), in-place under no_grad
    q = _base(6)
    views = _all_views(q)
    new = _src((4, 64)) * 100
    q.data.copy_(new)
    _check(q, views, qt.as_qtensor(new, qt.nvfp4))
    torch.manual_seed(0)
    nn.init.normal_(q[1:3], std=50.0)
    torch.manual_seed(0)
    ref = q.dequantize().clone()
    nn.init.normal_(ref[1:3], std=50.0)
    _check(q, views, qt.as_qtensor(ref, qt.nvfp4))
    torch.manual_seed(1)
    nn.init.normal_(q.data)
    torch.manual_seed(1)
    ref = torch.empty(4, 64).normal_()
    _check(q, views, qt.as_qtensor(ref, qt.nvfp4))
    torch.manual_seed(2)
    nn.init.normal_(q, std=0.01)
    torch.manual_seed(2)
    ref = torch.empty(4, 64).normal_(std=0.01)
    _check(q, views, qt.as_qtensor(ref, qt.nvfp4))


def test_a_converted_models_weight_under_no_grad_and_an_optimizer_step():
    torch.manual_seed(0)
    model = qt.convert(nn.Linear(64, 4), qt.nvfp4)
    w = model.weight
    assert isinstance(w, qt.QTensor) and w.fmt.is_two_level
    views = [("data", w.data, lambda t: t.data), ("rows", w[1:3], lambda t: t[1:3])]
    ref = w.dequantize().clone()
    with torch.no_grad():
        w[1:3].mul_(40)
        ref[1:3] *= 40
    _check(w, views, qt.as_qtensor(ref, qt.nvfp4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    for name, v, _make in views:
        assert torch.equal(v.tensor_scale, w.tensor_scale), name
    again = qt.quantize(w.dequantize(), qt.nvfp4, tensor_scale=w.tensor_scale)
    assert torch.equal(_bits(again), _bits(w))

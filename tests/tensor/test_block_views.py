"""A one-level block-format QTensor (MX, a BlockFormat along any axis, 2D tiles) and its views are
one tensor: an in-place op through a view that cuts blocks (a slice inside a block, a row of
blocks along axis 0, a flat view, a transposed slice) writes part of a block of the whole tensor,
whose block is then rounded as a whole (one scale from all of its elements), as docs/formats.md
says (one-level block formats: views). The reference for each op is the same op on a plain
float32 copy of the whole tensor's values, with the blocks the view touches rounded again (the
rest keep their bits); views that hold whole blocks round as their own, as before."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import qtensor as qt
from qtensor.formats.block import BlockFormat
from qtensor.tensor import payloads
from test_two_level_views import OPS, _bits, _src

SHAPE = (32, 64)

FORMATS = {
    "mxfp4_e2m1": qt.mxfp4_e2m1,
    "mxfp8_e4m3": qt.mxfp8_e4m3,
    "mxint8": qt.mxint8,
    "fp8_b16_axis0": BlockFormat(qt.fp8_e4m3, 16, axis=0),
    "tiles_4x8": BlockFormat(qt.fp8_e4m3, block_shape=(4, 8)),
}


def _block_ids(name):
    """Each element's block in SHAPE, for FORMATS[name]."""
    r = torch.arange(SHAPE[0])[:, None].expand(SHAPE)
    c = torch.arange(SHAPE[1])[None, :].expand(SHAPE)
    if name == "fp8_b16_axis0":
        return (r // 16) * SHAPE[1] + c
    if name == "tiles_4x8":
        return (r // 4) * SHAPE[1] + c // 8
    return r * SHAPE[1] + c // 32


VIEWS = {
    "rows": lambda t: t[4:12],
    "rows_cutting": lambda t: t[3:7],
    "cols": lambda t: t[:, :32],
    "cols_cutting": lambda t: t[:, :24],
    "cols_inside": lambda t: t[:, 5:40],
    "flat": lambda t: t.view(-1),
    "flat_part": lambda t: t.view(-1)[40:100],
    "t": lambda t: t.t(),
    "t_cutting": lambda t: t.t()[:24],
    "chunk": lambda t: t.chunk(2, dim=1)[1],
    "detach": lambda t: t.detach(),
    "data": lambda t: t.data,
    "row": lambda t: t[1],
    "col": lambda t: t[:, 1],
    "step": lambda t: t[:, ::3],
    "diagonal": lambda t: t.diagonal(),
    "unsqueeze_cut": lambda t: t.unsqueeze(0)[:, 2:5, 10:20],
}


def _base(fmt, seed=0):
    g = torch.Generator().manual_seed(seed)
    return qt.as_qtensor(torch.randn(SHAPE, generator=g) * torch.rand(SHAPE, generator=g) * 4,
                         fmt)


def _touched(name, make):
    """The elements of SHAPE in a block that the view make(.) writes into."""
    mask = torch.zeros(SHAPE, dtype=torch.bool)
    make(mask).fill_(True)
    ids = _block_ids(name)
    return torch.isin(ids, ids[mask])


def _want(name, before, ref, make):
    """The rule: the blocks make(.) touches rounded again from ref (the op on a plain copy),
    the others as before."""
    return torch.where(_touched(name, make), qt.quantize(ref, FORMATS[name]), before)


def _write(name, q, views, write, region):
    """write(t) done to q and to a plain copy of its values, where region(t) is what it writes:
    q and its views checked against the rule."""
    before = q.dequantize().clone()
    ref = before.clone()
    write(ref)
    write(q)
    _check(name, q, views, _want(name, before, ref, region))


def _check(name, q, views, want):
    assert torch.equal(_bits(q), _bits(want)), "base values"
    again = qt.quantize(q.dequantize(), FORMATS[name])
    assert torch.equal(_bits(again), _bits(q)), "base values in the format"
    for vname, v, make in views:
        assert torch.equal(_bits(v), _bits(make(want))), f"values through {vname}"


def _all_views(q):
    return [(name, make(q), make) for name, make in VIEWS.items()]


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("name", list(FORMATS))
def test_an_inplace_op_through_a_view_rounds_the_blocks_it_touches(name, view, op):
    q = _base(FORMATS[name])
    views = _all_views(q)
    _write(name, q, views, lambda t: OPS[op](VIEWS[view](t)), VIEWS[view])
    # a later op on the base alone: every view reads it
    want = qt.quantize(q.dequantize() * 0.25, FORMATS[name])
    q.mul_(0.25)
    _check(name, q, views, want)


# (format, view) pairs whose view holds whole blocks of the base, in the blocks' own order
WHOLE = [("mxfp4_e2m1", v) for v in ("rows", "cols", "t", "chunk", "detach", "data", "row")] + [
    ("fp8_b16_axis0", v) for v in ("cols", "cols_cutting", "t", "col", "step", "detach")] + [
    ("tiles_4x8", v) for v in ("rows", "cols", "cols_cutting", "t", "chunk", "data")]


@pytest.mark.parametrize("op", ["mul_", "add_", "copy_"])
@pytest.mark.parametrize("name,view", WHOLE)
def test_views_that_hold_whole_blocks_round_only_themselves(name, view, op, monkeypatch):
    q = _base(FORMATS[name], 3)
    v = VIEWS[view](q)
    ref = VIEWS[view](q.dequantize().clone())
    OPS[op](ref)
    rounded, depth = [], [0]
    real = payloads._backend.round_payload

    def spy(x, fmt, *a, **k):  # (round_payload may call itself on a copy: the outer calls)
        if not depth[0]:
            rounded.append(tuple(x.shape))
        depth[0] += 1
        try:
            return real(x, fmt, *a, **k)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(payloads._backend, "round_payload", spy)
    OPS[op](v)
    monkeypatch.undo()
    assert torch.equal(_bits(v), _bits(qt.quantize(ref, v.fmt))), "the view rounded as its own"
    assert rounded == [tuple(v.shape)], "only the view's own values are rounded"


@pytest.mark.parametrize("name", list(FORMATS))
def test_setitem_of_plain_values_into_part(name):
    q = _base(FORMATS[name], 2)
    views = _all_views(q)
    _write(name, q, views, lambda t: t.__setitem__((slice(3, 7), slice(5, 40)),
                                                   _src((4, 35)) * 10), lambda t: t[3:7, 5:40])


@pytest.mark.parametrize("name", list(FORMATS))
def test_copy_of_a_qtensor_into_part_that_cuts_blocks(name):
    # the source's values are in the format as blocks of their own, not as part of q's blocks
    fmt = FORMATS[name]
    q = _base(fmt, 4)
    views = _all_views(q)
    other = qt.as_qtensor(_src((4, 20)) * 30, fmt)
    part = lambda t: t[3:7, 10:30]  # noqa: E731
    _write(name, q, views,
           lambda t: part(t).copy_(other if isinstance(t, qt.QTensor) else other.dequantize()),
           part)
    # (setitem of a QTensor: copy_ into the view)
    _write(name, q, views, lambda t: t.__setitem__((slice(3, 7), slice(10, 30)),
                                                   t[20:24, 40:60].clone()), part)


@pytest.mark.parametrize("name", list(FORMATS))
def test_data_copy_and_init_functions(name):
    # what optimizers and nn.init do: p.data.copy_(...), init.normal_(part of p)
    fmt = FORMATS[name]
    q = _base(fmt, 6)
    views = _all_views(q)
    new = _src(SHAPE) * 100
    q.data.copy_(new)
    _check(name, q, views, qt.quantize(new, fmt))
    def init(t):
        torch.manual_seed(0)
        nn.init.normal_(t[1:3, 8:20], std=50.0)

    _write(name, q, views, init, lambda t: t[1:3, 8:20])
    torch.manual_seed(1)
    nn.init.normal_(q.data)
    torch.manual_seed(1)
    _check(name, q, views, qt.quantize(torch.empty(SHAPE).normal_(), fmt))


def test_a_converted_models_weight_under_no_grad_and_an_optimizer_step():
    torch.manual_seed(0)
    model = qt.convert(nn.Linear(64, 32), qt.mxfp4_e2m1)
    w = model.weight
    assert isinstance(w, qt.QTensor) and w.fmt.is_block
    views = [("data", w.data, lambda t: t.data), ("cols", w[:, :24], lambda t: t[:, :24])]
    with torch.no_grad():
        _write("mxfp4_e2m1", w, views, lambda t: t[:, :24].mul_(40), lambda t: t[:, :24])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    _check("mxfp4_e2m1", w, views, w.dequantize())


@pytest.mark.parametrize("view", ["cols_cutting", "flat_part", "t_cutting", "diagonal"])
def test_float_formats_round_only_the_views_elements(view):
    q = qt.as_qtensor(torch.randn(SHAPE), qt.fp8_e4m3)
    ref = q.dequantize().clone()
    VIEWS[view](ref).mul_(9.1)
    VIEWS[view](q).mul_(9.1)
    assert torch.equal(_bits(q), _bits(qt.quantize(ref, qt.fp8_e4m3)))

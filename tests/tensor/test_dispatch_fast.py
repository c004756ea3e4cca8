"""dispatch's fast path for moves of one QTensor (views, reshapes, t, detach, clone, ...:
``dispatch._single_move``): the same results as the general path, with the aliasing that
return_and_correct_aliasing gives views (the wrapper shares its base's storage and version
counter, autograd's _base), in eager and under torch.compile; and the Tensor methods it calls on
the payload run the very aten overload they stand for.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import qtensor as qt
from helpers import assert_bits_equal
from qtensor.tensor import dispatch
from qtensor.kernels import backend

aten = torch.ops.aten
MX6 = qt.mxfp6_e3m2

# Sample arguments (after the payload) for each entry of dispatch._PAYLOAD_CALLS, on a (1, 4, 6)
# tensor.
_SAMPLES = {
    "view.default": ([4, 6],), "t.default": None, "transpose.int": (0, 2),
    "permute.default": ([2, 0, 1],), "expand.default": ([3, 1, 4, 6],),
    "detach.default": (), "unsqueeze.default": (1,), "squeeze.dim": (0,),
    "squeeze.dims": ([0],), "squeeze.default": (), "select.int": (1, 2),
    "as_strided.default": ([2, 3], [6, 1], 1), "unfold.default": (2, 3, 1),
    "diagonal.default": (0, 1, 2), "clone.default": (),
}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def _overload(name):
    packet, overload = name.split(".")
    return getattr(getattr(aten, packet), overload)


@pytest.mark.parametrize("name", sorted(dispatch._PAYLOAD_CALLS))
def test_payload_calls_run_their_overload(name):
    assert set(_SAMPLES) == set(dispatch._PAYLOAD_CALLS), "a sample per table entry"
    x = torch.randn(1, 4, 6)
    args = _SAMPLES[name]
    if args is None:  # t: a matrix
        x, args = torch.randn(4, 6), ()
    method, func = dispatch._PAYLOAD_CALLS[name], _overload(name)
    with _Ops() as mode:
        got = method(x, *args)
    assert mode.seen == [func], f"{name} ran {mode.seen}"
    want = func(x, *args)
    assert (got.shape, got.stride(), got.storage_offset()) == (
        want.shape, want.stride(), want.storage_offset())
    assert_bits_equal(got, want, name)
    assert dispatch.rule_of(func).single is method


def _wrapper_storage(t):
    return torch._C.TensorBase.untyped_storage(t)  # the wrapper's own (QTensor's is the payload's)


def _facts(x, out):
    """What a move's output is, and how it relates to its input x."""
    if not isinstance(out, qt.QTensor):
        return ("plain", out.dtype, tuple(out.shape), out.data_ptr() == x.payload.data_ptr())
    same_storage = _wrapper_storage(out)._cdata == _wrapper_storage(x)._cdata
    return (type(out), out.fmt, out.mm_fmt, out.accum, out.dtype, tuple(out.shape),
            out.stride(), out.storage_offset(), out.requires_grad, out._base is x,
            out._is_view(), same_storage, out.payload.untyped_storage().data_ptr()
            == x.payload.untyped_storage().data_ptr(), out.payload.stride(),
            out.payload.storage_offset())


MOVES = {
    "view": lambda x: x.view(-1), "view_3d": lambda x: x.view(2, 4, 8),
    "view_dtype_int": lambda x: x.view(torch.int32),
    "reshape_copy": lambda x: x.t().reshape(-1),  # _unsafe_view of a clone
    "_unsafe_view": lambda x: aten._unsafe_view(x, [4, 16]),
    "t": lambda x: x.t(), "transpose": lambda x: x.transpose(0, 1),
    "permute": lambda x: x.permute(1, 0), "expand": lambda x: x.expand(3, 8, 8),
    "expand_as": lambda x: x.expand_as(torch.empty(2, 8, 8)),
    "detach": lambda x: x.detach(), "alias": lambda x: aten.alias(x),
    "unsqueeze": lambda x: x.unsqueeze(1), "squeeze": lambda x: x.unsqueeze(0).squeeze(0),
    "select": lambda x: x[3], "slice": lambda x: x[1:5:2], "narrow": lambda x: x.narrow(1, 2, 3),
    "as_strided": lambda x: x.as_strided((4, 4), (1, 8), 2), "diagonal": lambda x: x.diagonal(),
    "unfold": lambda x: x.unfold(1, 4, 2), "clone": lambda x: x.clone(),
    "contiguous_of_t": lambda x: x.t().contiguous(), "movedim": lambda x: x.movedim(0, 1),
}

FORMATS = {
    "bf16": dict(fmt="bf16"),
    "fp8_mm_mx": dict(fmt="fp8_e4m3", mm_fmt="mxfp6_e3m2"),
    "mx_axis0": dict(fmt=MX6.replace(block_size=4, axis=0)),
    "mx_axis-1": dict(fmt=MX6.replace(block_size=4)),
    "accum": dict(fmt="bf16", accum="hopper_fp8"),
}


def _qtensor(kind, requires_grad=False):
    torch.manual_seed(0)
    kw = dict(FORMATS[kind])
    accum = kw.pop("accum", None)
    x = qt.as_qtensor(torch.randn(8, 8) * torch.logspace(-3, 3, 8), **kw)
    if accum is not None:
        x.accum = accum
    return x.requires_grad_(requires_grad)


@pytest.mark.parametrize("kind", sorted(FORMATS))
@pytest.mark.parametrize("move", sorted(MOVES))
def test_fast_path_matches_the_general_path(move, kind, monkeypatch):
    """Every fact of the output (formats, the block axis, accumulator, geometry, aliasing of
    wrapper and payload, autograd's _base) and its bits, with and without the fast path."""
    results = []
    for fast in (True, False):
        monkeypatch.setattr(dispatch, "FAST_MOVES", fast)
        x = _qtensor(kind)
        out = MOVES[move](x)
        results.append((_facts(x, out), out))
    (facts, out), (facts_general, out_general) = results
    assert facts == facts_general
    if isinstance(out, qt.QTensor):
        assert_bits_equal(out.payload, out_general.payload, move)
    else:
        assert torch.equal(out, out_general)


def test_fast_path_is_taken(monkeypatch):
    """(The comparison above compares something: the general path is not called.)"""
    calls = []
    general = dispatch._unwrap
    monkeypatch.setattr(dispatch, "_unwrap", lambda *a: calls.append(1) or general(*a))
    x = _qtensor("bf16")
    x.t().unsqueeze(0).detach().clone(memory_format=torch.contiguous_format).view(-1)
    assert calls == []
    x + x
    assert calls == [1]


@pytest.mark.parametrize("view", ["view", "t", "transpose", "permute", "unsqueeze",
                                  "select", "slice", "diagonal", "as_strided", "detach"])
def test_writes_through_a_view_and_into_its_base(view):
    """An in-place op on the view changes the base QTensor (rounded into its format), one on the
    base shows in the view; each bumps the version counter both share."""
    x = _qtensor("fp8_mm_mx")
    v = MOVES[view](x)
    before = x._version
    v.mul_(0).add_(1000.0)  # saturates to E4M3's 448
    assert x._version > before and v._version == x._version
    assert isinstance(x, qt.QTensor) and x.fmt == qt.fp8_e4m3
    touched = (x.dequantize() == 448.0)
    assert touched.any() and bool((v.dequantize() == 448.0).all())
    x.zero_()
    assert v._version == x._version
    assert bool((v.dequantize() == 0).all())


def test_autograd_sees_an_inplace_write_through_a_view():
    """The version counter shared through the fast path's views is what lets autograd refuse a
    backward through a tensor modified after it was saved."""
    x = _qtensor("bf16", requires_grad=True)
    y = x * 1.0
    z = y.sin()  # saves y
    y.t().add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()


def test_views_keep_gradients_flowing():
    x = _qtensor("fp8_mm_mx", requires_grad=True)
    y = (x.t().unsqueeze(0).expand(2, 8, 8).transpose(1, 2) * 2.0).sum()
    y.backward()
    assert isinstance(x.grad, qt.QTensor) and x.grad.fmt == qt.fp8_e4m3
    assert_bits_equal(x.grad.dequantize(), torch.full((8, 8), 4.0))


def test_views_under_torch_compile_match_eager():
    """Views (aliasing outputs, in-place writes through them) in a compiled function: the bits of
    eager, the output a view of the input, and the input written through the view."""
    torch._dynamo.reset()

    def f(x):
        v = x.t().unsqueeze(0).expand(2, 8, 8).transpose(1, 2).reshape(16, 8)
        w = x.view(4, 16).detach()
        x.t()[0].mul_(2.0)  # a write into x through a view
        return v.sum(0) + w.sum(), x.view(-1)

    xe, xc = _qtensor("fp8_mm_mx"), _qtensor("fp8_mm_mx")
    ye, ae = f(xe)
    yc, ac = torch.compile(f, backend="aot_eager", fullgraph=True)(xc)
    for got, want in ((yc, ye), (ac, ae), (xc, xe)):
        assert isinstance(got, qt.QTensor) and got.fmt == want.fmt
        assert_bits_equal(got.dequantize(), want.dequantize())
    ac.zero_()  # the returned view aliases the input
    assert bool((xc.dequantize() == 0).all())


def test_a_dispatch_mode_sees_the_views():
    """leak_check stands on a dispatch mode seeing each op on QTensors: the fast path sits below
    it, so views are seen, with QTensor arguments and QTensor results."""
    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.append((func, type(args[0]).__name__, type(out).__name__))
            return out

    x = _qtensor("bf16")
    with Spy():
        x.view(-1).unsqueeze(0).t().detach()
    assert seen == [(aten.view.default, "QTensor", "QTensor"),
                    (aten.unsqueeze.default, "QTensor", "QTensor"),
                    (aten.t.default, "QTensor", "QTensor"),
                    (aten.detach.default, "QTensor", "QTensor")]


def test_leak_check_reports_a_plain_tensor_met_through_views():
    x = _qtensor("bf16")
    plain = torch.randn(8, 8)
    with qt.leak_check(action="record") as report:
        x.t().unsqueeze(0).view(8, 8) * plain
    assert [f.kind for f in report.findings] == ["mixed"]


def test_format_caches_by_id_stay_bounded_and_equal():
    """with_axis/fit_format cache by the format object's id: formats made anew per call give
    equal results and the caches start again at their bound (no growth without end)."""
    for i in range(backend._CACHE_SIZE + 50):
        f = MX6.replace(block_size=32, axis=-1)  # a new, equal object each time
        assert dispatch.with_axis(f, 0) == MX6.replace(block_size=32, axis=0)
        assert dispatch.fit_format(MX6.replace(axis=3), 2) == MX6.replace(axis=-1)
    assert len(backend._AXIS_CACHE) <= backend._CACHE_SIZE + 1
    assert len(backend._FIT_CACHE) <= backend._CACHE_SIZE + 1


def test_a_contraction_derives_its_accumulator_once(monkeypatch):
    """One contraction of QTensors that carry an accumulator finds it once (dispatch._accum_of):
    the contraction sums with it and its result carries it on, with accum_matmul's bits."""
    calls = []
    real = dispatch._accum_of
    monkeypatch.setattr(dispatch, "_accum_of", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 64, generator=g), torch.randn(64, 16, generator=g)
    acc = qt.accum.hopper_fp8
    a = qt.QTensor(qt.quantize(x, qt.fp8_e4m3), qt.fp8_e4m3, accum=acc)
    b = qt.QTensor(qt.quantize(w, qt.fp8_e4m3), qt.fp8_e4m3, accum=acc)
    y = a @ b
    assert len(calls) == 1, calls
    assert y.accum == acc
    want = qt.quantize(qt.accum.accum_matmul(a.payload, b.payload, acc, a_fmt=qt.fp8_e4m3,
                                             b_fmt=qt.fp8_e4m3), qt.fp8_e4m3)
    assert_bits_equal(y.payload, want, "a @ b")
    del calls[:]
    z = a * 2  # a computing op: its result carries the accumulator on, found once too
    assert len(calls) == 1 and z.accum == acc

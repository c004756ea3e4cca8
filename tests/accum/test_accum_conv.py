"""Convolutions through the accumulator: the im2col GEMM layout, and convolutions of every kind
through converted modules, forward and every gradient."""
import copy
import itertools
import math
import zlib

import pytest
import torch

import qtensor as qt
from qtensor import accum
from qtensor.accum.format import AccumFormat

from accum_cases import bits


CONV_CASES = [(9, 8, 3, 1, 0, 1), (10, 9, 3, 2, 1, 1), (11, 12, 3, 2, 2, 2), (8, 8, 1, 1, 0, 1),
              (12, 11, 5, 3, 2, 1)]


@pytest.mark.parametrize("H, W, k, s, p, d", CONV_CASES)
def test_conv_as_gemm_layout(H, W, k, s, p, d):
    """The conv lowering (forward, grad_input, grad_weight, grad_bias) is the convolution: with a
    nearly exact accumulator it agrees with float64 aten to float32 rounding."""
    f = AccumFormat(chunk=8, frac_bits=45, acc_rounding="nearest")
    g = torch.Generator().manual_seed(H * 100 + k)
    x, w, b = (torch.randn(2, 3, H, W, generator=g), torch.randn(4, 3, k, k, generator=g),
               torch.randn(4, generator=g))
    geo = ([s, s], [p, p], [d, d], False, [0, 0], 1)
    ref = torch.nn.functional.conv2d(x.double(), w.double(), b.double(), stride=s, padding=p,
                                     dilation=d)
    out = accum.contract("convolution", [x, w, b, *geo], {}, f)
    assert out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    go = torch.randn(ref.shape, generator=g)
    want = torch.ops.aten.convolution_backward(go.double(), x.double(), w.double(), [4], *geo,
                                               [True, True, True])
    got = accum.contract("convolution_backward", [go, x, w, [4], *geo, [True, True, True]], {}, f)
    for gt, wt in zip(got, want):
        assert gt.shape == wt.shape
        torch.testing.assert_close(gt.double(), wt, rtol=0, atol=1e-5)


def test_conv_forward_is_the_gemm_of_the_accumulator():
    # channels innermost along K: the output is accum_matmul of the (kh, kw, c)-ordered operands
    f = accum.hopper_fp8_fast
    g = torch.Generator().manual_seed(4)
    x = qt.quantize(torch.randn(1, 40, 5, 5, generator=g), "fp8_e4m3")
    w = qt.quantize(torch.randn(2, 40, 3, 3, generator=g), "fp8_e4m3")
    out = accum.contract("convolution", [x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1],
                         {}, f)
    cols = x.unfold(2, 3, 1).unfold(3, 3, 1)  # (1, C, 3, 3, kh, kw)
    a = w.permute(0, 2, 3, 1).reshape(2, -1)  # (O, kh*kw*C)
    b = cols.permute(0, 4, 5, 1, 2, 3).reshape(9 * 40, 9)  # (kh*kw*C, L)
    assert torch.equal(bits(out.reshape(2, 9)), bits(accum.accum_matmul(a, b, f)))


def test_conv_model_with_accumulator():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    recipe = qt.Recipe(weight=("bf16", "fp8_e4m3"), activation=("bf16", "fp8_e4m3"),
                       grad="bf16", accumulate=accum.hopper_fp8_fast)
    model = qt.convert(conv, recipe)
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    y = model(x)
    y.float().sum().backward()
    assert model.weight.grad is not None and x.grad is not None


def test_bad_convolution_gets_torchs_error():
    """A convolution torch refuses is refused alike under the accumulator (its own checks)."""
    model = qt.convert(torch.nn.Conv2d(4, 4, 3, groups=2),
                       qt.Recipe(weight="bf16", activation="bf16", accumulate=accum.hopper_bf16))
    with pytest.raises(RuntimeError, match=r"to have 4 channels, but got 3 channels instead"):
        model(torch.randn(1, 3, 8, 8))
    with pytest.raises(RuntimeError, match=r"Kernel size can't be greater than actual input"):
        model(torch.randn(1, 4, 2, 8))


# ---------------------------------------------------------------------------------------------
# Convolutions of every kind through converted modules: 1-, 2-, 3-D, grouped, depthwise,
# transposed (output_padding), padding beyond the dilated kernel, string padding; forward and
# every gradient.

_nn = torch.nn
# name: (module class, in channels, out channels, kernel, keyword arguments, input size)
CONV_MODULES = {
    "1d_stride": (_nn.Conv1d, 4, 6, 3, dict(stride=2, padding=1), (11,)),
    "1d_depthwise_dil": (_nn.Conv1d, 4, 4, 3, dict(groups=4, dilation=2, padding=2), (9,)),
    "1d_pad_beyond": (_nn.Conv1d, 2, 3, 2, dict(padding=3, stride=2), (5,)),
    "2d_groups": (_nn.Conv2d, 4, 6, (3, 2), dict(groups=2, stride=(2, 1), padding=(1, 2),
                                                 dilation=(1, 2)), (7, 8)),
    "2d_depthwise_x2_same": (_nn.Conv2d, 3, 6, 3, dict(groups=3, padding="same", dilation=2),
                             (6, 7)),
    "2d_same_even": (_nn.Conv2d, 2, 3, (2, 4), dict(padding="same"), (5, 6)),
    "2d_valid": (_nn.Conv2d, 2, 3, 2, dict(padding="valid"), (4, 5)),
    "2d_pad_beyond": (_nn.Conv2d, 3, 2, 2, dict(padding=(3, 2), stride=2), (5, 4)),
    "3d": (_nn.Conv3d, 2, 4, 2, dict(stride=(1, 2, 1), padding=1), (4, 5, 3)),
    "3d_groups": (_nn.Conv3d, 4, 4, (1, 2, 3), dict(groups=2, dilation=(1, 1, 2),
                                                    padding=(0, 1, 3)), (3, 4, 6)),
    "t1d_out_pad": (_nn.ConvTranspose1d, 3, 4, 3, dict(stride=3, padding=1, output_padding=2),
                    (5,)),
    "t1d_out_pad_beyond_stride": (_nn.ConvTranspose1d, 2, 2, 2, dict(dilation=3,
                                                                      output_padding=2), (4,)),
    "t2d_groups": (_nn.ConvTranspose2d, 4, 6, (3, 2), dict(groups=2, stride=(2, 3),
                                                           padding=(1, 0), output_padding=(1, 2),
                                                           dilation=(1, 2)), (4, 5)),
    "t2d_depthwise": (_nn.ConvTranspose2d, 3, 3, 3, dict(groups=3, stride=2, dilation=2,
                                                         output_padding=1), (4, 4)),
    "t2d_pad_beyond": (_nn.ConvTranspose2d, 2, 3, 2, dict(stride=3, padding=2), (5, 4)),
    "t3d": (_nn.ConvTranspose3d, 2, 2, 2, dict(stride=(1, 2, 1), dilation=(2, 1, 1),
                                               output_padding=(1, 1, 0)), (3, 3, 4)),
}
_FP32 = dict(weight="fp32", bias="fp32", activation="fp32", grad="fp32")


def _conv_run(name, f, values):
    """The module ``name`` run plain and converted with accumulator f (float32 formats, so the
    accumulator is the only difference): (module, x, go, plain results, converted results), the
    results being (y, x.grad, weight.grad, bias.grad)."""
    cls, cin, cout, k, kw, size = CONV_MODULES[name]
    torch.manual_seed(zlib.crc32(name.encode()))
    m = cls(cin, cout, k, **kw)
    with torch.no_grad():
        m.weight.copy_(values(m.weight.shape))
        m.bias.copy_(values(m.bias.shape))
    x = values((2, cin, *size))
    q = qt.convert(copy.deepcopy(m), qt.Recipe(**_FP32, accumulate=f))
    results, go = [], None
    for mod in (m, q):
        xi = x.clone().requires_grad_()
        y = mod(xi)
        go = values(y.shape) if go is None else go
        y.backward(go)
        results.append([t.dequantize() if isinstance(t, qt.QTensor) else t.detach()
                        for t in (y, xi.grad, mod.weight.grad, mod.bias.grad)])
    return m, x, go, results[0], results[1]


def _small_ints(shape):
    return torch.randint(-3, 4, tuple(shape)).float()


@pytest.mark.parametrize("name", list(CONV_MODULES))
def test_conv_exact_on_small_integers(name):
    """With small integer operands and an accumulator that drops no bit, every convolution and
    each of its gradients is the exact sum: torch's float32 result, bit for bit (a wrong window,
    tap, channel or group mapping changes it)."""
    wide = AccumFormat(chunk=4, frac_bits=30, promote=3)
    *_, plain, conv = _conv_run(name, wide, _small_ints)
    for what, want, got in zip(("y", "grad_input", "grad_weight", "grad_bias"), plain, conv):
        assert got.shape == want.shape, what
        assert torch.equal(bits(got), bits(want)), what


def _geometry(m):
    k = m.kernel_size
    pad = m.padding
    if isinstance(pad, str):  # 'same': total d*(k-1), the smaller half on the left; 'valid': 0
        pad = [d * (kk - 1) // 2 if pad == "same" else 0 for d, kk in zip(m.dilation, k)]
    return k, m.stride, pad, m.dilation, m.groups


def _taps(k):
    return itertools.product(*(range(kk) for kk in k))


def _gather_conv(x, w, geo, n, o, pos):
    """The dot product vectors of output (n, o, *pos) of the forward convolution of x with w
    (O, C/groups, *k), in the K order (kernel position, channel of the group)."""
    k, stride, pad, dil, groups = geo
    cg, og = w.shape[1], w.shape[0] // groups
    xs, ws = [], []
    for j in _taps(k):
        q = [p * s - pd + jj * d for p, s, pd, jj, d in zip(pos, stride, pad, j, dil)]
        inside = all(0 <= qq < sz for qq, sz in zip(q, x.shape[2:]))
        for c in range(cg):
            xs.append(x[(n, o // og * cg + c, *q)].item() if inside else 0.0)
            ws.append(w[(o, c, *j)].item())
    return xs, ws


def _gather_conv_transpose(x, w, geo, n, o, pos):
    """The same for the transposed convolution of x with w (C, O/groups, *k): the forward
    convolution over x with (stride - 1) zeros between its elements, the kernel flipped: K =
    (flipped kernel position, channel of the group); the inserted zeros take their slots."""
    k, stride, pad, dil, groups = geo
    og, cg = w.shape[1], w.shape[0] // groups
    xs, ws = [], []
    for jf in _taps(k):
        j = [kk - 1 - a for kk, a in zip(k, jf)]
        num = [p + pd - jj * d for p, pd, jj, d in zip(pos, pad, j, dil)]
        t = [u // s for u, s in zip(num, stride)]
        inside = all(u % s == 0 and 0 <= tt < sz
                     for u, s, tt, sz in zip(num, stride, t, x.shape[2:]))
        for c in range(cg):
            xs.append(x[(n, o // og * cg + c, *t)].item() if inside else 0.0)
            ws.append(w[(o // og * cg + c, o % og, *j)].item())
    return xs, ws


def _gather_weight_grad(x, go, geo, o, c, j):
    """The vectors of weight gradient (o, c, *j) of the forward convolution x -> go: K =
    (batch, output position)."""
    k, stride, pad, dil, groups = geo
    cg, og = x.shape[1] // groups, go.shape[1] // groups
    xs, gs = [], []
    for n in range(x.shape[0]):
        for pos in _taps(go.shape[2:]):
            q = [p * s - pd + jj * d for p, s, pd, jj, d in zip(pos, stride, pad, j, dil)]
            inside = all(0 <= qq < sz for qq, sz in zip(q, x.shape[2:]))
            xs.append(x[(n, o // og * cg + c, *q)].item() if inside else 0.0)
            gs.append(go[(n, o, *pos)].item())
    return xs, gs


def _dot(xs, ws, f):
    return accum.accum_matmul_reference(torch.tensor([xs]), torch.tensor([ws]).t(), f)[0, 0]


@pytest.mark.parametrize("name", list(CONV_MODULES))
def test_conv_and_gradients_are_dots_of_the_accumulator(name):
    """With a truncating accumulator, elements of the output, grad_input and grad_weight are
    accum_matmul_reference of their dot product vectors gathered by hand in the documented K
    order, and the convolution differs from float32."""
    trunc = AccumFormat(chunk=4, frac_bits=7, acc_man=9, promote=3)
    m, x, go, plain, (y, gi, gw, gb) = _conv_run(name, trunc, torch.randn)
    geo, w = _geometry(m), m.weight.detach()
    transposed = isinstance(m, torch.nn.modules.conv._ConvTransposeNd)
    fwd, adj = ((_gather_conv_transpose, _gather_conv) if transposed
                else (_gather_conv, _gather_conv_transpose))
    for what, got, want in zip(("y", "grad_input", "grad_weight"), (y, gi, gw), plain):
        assert not torch.equal(bits(got), bits(want)), f"{what} is float32's"
        n = got.numel()
        for flat in (0, n // 3, n // 2, n - 1):
            idx = [int(i) for i in torch.unravel_index(torch.tensor(flat), got.shape)]
            if what == "y":
                ref = _dot(*fwd(x, w, geo, *idx[:2], idx[2:]), trunc) + m.bias[idx[1]].detach()
            elif what == "grad_input":
                ref = _dot(*adj(go, w, geo, *idx[:2], idx[2:]), trunc)
            else:  # a transposed convolution's weight is that of the forward map go -> x
                a, b = (go, x) if transposed else (x, go)
                ref = _dot(*_gather_weight_grad(a, b, geo, *idx[:2], idx[2:]), trunc)
            assert torch.equal(bits(got[tuple(idx)]), bits(ref)), (what, idx)


def test_conv_model_trains_with_accumulator():
    """A user's model (Conv1d, grouped Conv2d, ConvTranspose2d) trains under an accumulator with
    a real optimizer: losses finite and decreasing, no leak, and not float32's training."""
    def model():
        torch.manual_seed(0)
        return _nn.Sequential(
            _nn.Conv1d(3, 8, 3, padding=1), _nn.ReLU(), _nn.Unflatten(2, (4, 4)),
            _nn.Conv2d(8, 8, 3, padding=1, groups=4), _nn.ReLU(),
            _nn.ConvTranspose2d(8, 2, 2, stride=2), _nn.Flatten(),
            _nn.Linear(128, 3))
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(16, 3, 16, generator=g), torch.randint(0, 3, (16,), generator=g)
    fp8 = ("fp32", "fp8_e4m3")  # float32 values (outputs keep the accumulator's 13 bits)
    recipe = qt.Recipe(weight=fp8, activation=fp8, grad=("fp32", "fp8_e5m2"))
    runs = {}
    for acc in (None, accum.hopper_fp8):
        m = qt.convert(model(), recipe.replace(accumulate=acc))
        opt = torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9)
        losses = []
        with qt.leak_check(action="record", optimizer=opt, check_values=True) as report:
            for _ in range(6):
                loss = torch.nn.functional.cross_entropy(m(x), target)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
        assert len(report) == 0, report.summary()
        assert all(math.isfinite(v) for v in losses), losses
        assert all(b < a for a, b in zip(losses, losses[1:])), losses
        runs[acc] = losses
    assert m[5].weight.grad.accum is accum.hopper_fp8
    assert runs[None] != runs[accum.hopper_fp8]  # the accumulator took part


@pytest.mark.parametrize("name", ["2d_groups", "t2d_groups"])
def test_conv_empty_batch(name):
    """An empty batch gives empty outputs and input gradient, zero weight gradient, as torch."""
    cls, cin, cout, k, kw, size = CONV_MODULES[name]
    m = qt.convert(cls(cin, cout, k, **kw), qt.Recipe(**_FP32, accumulate=accum.hopper_fp8))
    x = torch.randn(0, cin, *size, requires_grad=True)
    y = m(x)
    y.sum().backward()
    plain = cls(cin, cout, k, **kw)(x.detach())
    assert y.shape == plain.shape and x.grad.shape == x.shape
    assert torch.equal(bits(m.weight.grad.dequantize()), bits(torch.zeros(m.weight.shape)))

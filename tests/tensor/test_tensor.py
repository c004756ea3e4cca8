"""QTensor: construction, dispatch rules, aliasing, two formats per tensor, autograd, optimizers,
serialization and torch.compile.

References are computed independently: plain torch ops on dequantized values, rounded with
``qt.quantize`` (whose own correctness is tested against oracles in test_reference.py).
"""
from __future__ import annotations

import copy
import io
import pickle

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qtensor as qt
from helpers import assert_bits_equal
from qtensor.formats.base import FormatError

MX6 = qt.mxfp6_e3m2


def q(x, fmt="bf16", mm_fmt=None):
    return qt.as_qtensor(x, fmt, mm_fmt=mm_fmt)


def mx(fmt, axis):
    return fmt.replace(axis=axis)


def vals(t):
    return t.dequantize() if isinstance(t, qt.QTensor) else t


def assert_q(t, expected_vals, fmt, mm_fmt=None, msg=""):
    assert isinstance(t, qt.QTensor), f"{msg}: got {type(t).__name__}"
    assert t.fmt == fmt, f"{msg}: fmt {t.fmt} != {fmt}"
    assert t.mm_fmt == mm_fmt, f"{msg}: mm_fmt {t.mm_fmt} != {mm_fmt}"
    assert_bits_equal(t.dequantize(), expected_vals, msg)


def in_format(t):
    return torch.equal(t.dequantize(), qt.quantize(t.dequantize(), t.fmt))


# ---------------------------------------------------------------------------------------------
# Construction and repr

class TestRepr(expecttest.TestCase):
    def test_repr(self):
        x = q(torch.tensor([[1.0, 2.0009, -3.3], [0.1, 448.0, 1e-3]]), "fp8_e4m3")
        self.assertExpectedInline(repr(x), """\
QTensor([[ 1.0000e+00,  2.0000e+00, -3.2500e+00],
         [ 1.0156e-01,  4.4800e+02,  1.9531e-03]], fmt=fp8_e4m3)""")
        y = q(torch.tensor([1.5, -0.25]), "bf16", mm_fmt="mxfp6_e3m2").requires_grad_()
        self.assertExpectedInline(
            repr(y), """QTensor([ 1.5000, -0.2500], fmt=bf16, mm_fmt=mxfp6_e3m2, requires_grad=True)""")
        self.assertExpectedInline(repr(y * 2), """QTensor([ 3.0000, -0.5000], fmt=bf16, mm_fmt=mxfp6_e3m2, grad_fn=<MulBackward0>)""")


def test_as_qtensor_rounds_and_keeps_payload_dtype():
    x = torch.randn(64)
    t = q(x, "fp8_e4m3")
    assert t.dtype == torch.float32 and t.fmt == qt.fp8_e4m3 and t.mm_fmt is None
    assert_bits_equal(t.dequantize(), qt.quantize(x, qt.fp8_e4m3))
    assert q(x.double(), "bf16").dtype == torch.float64
    assert q(x.bfloat16(), "bf16").dtype == torch.float32
    # a QTensor is re-rounded from its values
    t2 = qt.as_qtensor(q(x, "bf16"), "fp8_e5m2", mm_fmt=MX6)
    assert_q(t2, qt.quantize(qt.quantize(x, "bf16"), "fp8_e5m2"), qt.fp8_e5m2, MX6)
    # a rounding override applies to this rounding only
    t3 = qt.as_qtensor(torch.full((4,), 1.0 + 2 ** -8 + 2 ** -12), "bf16", rounding="toward_zero")
    assert torch.all(t3.dequantize() == 1.0) and t3.fmt.rounding == "nearest"


def test_as_qtensor_straight_through_gradient():
    x = torch.randn(8, requires_grad=True)
    t = q(x, "fp8_e4m3")
    (t * 3).sum().backward()
    assert type(x.grad) is torch.Tensor
    assert_bits_equal(x.grad, torch.full((8,), 3.0))


def test_bad_input_errors():
    with pytest.raises(TypeError, match="int64.*format fp8_e4m3|format fp8_e4m3.*int64"):
        q(torch.arange(4), "fp8_e4m3")
    with pytest.raises(FormatError, match="unknown format 'fp9'"):
        q(torch.randn(4), "fp9")
    a = q(torch.randn(4), "bf16")
    b = qt.QTensor(torch.zeros(4, device="meta"), "fp8_e4m3")
    with pytest.raises(RuntimeError, match=r"(?s)bf16.*cpu.*fp8_e4m3.*meta|fp8_e4m3.*meta.*bf16.*cpu"):
        torch.add(a, b)


# ---------------------------------------------------------------------------------------------
# Dispatch rules

def test_non_floating_outputs_are_plain():
    x = q(torch.randn(5, 6))
    for r in (x > 0, x.argmax(), torch.isnan(x), x.max(dim=1).indices):
        assert type(r) is torch.Tensor and not r.is_floating_point()
    assert isinstance(x.sum().item(), float)


def test_computing_ops_round_each_output():
    torch.manual_seed(0)
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    x, y = q(a, "fp8_e4m3"), q(b, "fp8_e4m3")
    va, vb = vals(x), vals(y)
    f8 = qt.fp8_e4m3
    assert_q(x + y, qt.quantize(va + vb, f8), f8)
    assert_q(torch.exp(x), qt.quantize(torch.exp(va), f8), f8)
    assert_q(x.sum(1), qt.quantize(va.sum(1), f8), f8)
    # an op nobody listed is computed and rounded too
    assert_q(torch.special.erfcx(x), qt.quantize(torch.special.erfcx(va), f8), f8)
    # each floating output of a multi-output op
    m, s = torch.std_mean(x, dim=0)
    assert_q(m, qt.quantize(torch.std_mean(va, dim=0)[0], f8), f8)
    assert_q(s, qt.quantize(torch.std_mean(va, dim=0)[1], f8), f8)
    # factory-like ops produce QTensors in the same format
    for r in (torch.zeros_like(x), torch.ones_like(x), torch.full_like(x, 1000.0), x.new_zeros(3)):
        assert isinstance(r, qt.QTensor) and r.fmt == f8 and in_format(r)
    assert torch.all(torch.full_like(x, 1000.0).dequantize() == 448.0)


def test_data_movement_keeps_values_and_format():
    torch.manual_seed(0)
    a = torch.randn(4, 64) * torch.logspace(-3, 3, 64)
    x = q(a, "mxfp8_e4m3")  # block format: re-rounding moved values would change them
    v = vals(x)
    mxf = qt.mxfp8_e4m3
    assert_q(x.reshape(8, 32), v.reshape(8, 32), mxf)
    assert_q(x[1:3, ::2], v[1:3, ::2], mxf)
    assert_q(x[torch.tensor([2, 0])], v[torch.tensor([2, 0])], mxf)
    assert_q(torch.cat([x, x]), torch.cat([v, v]), mxf)
    assert_q(torch.stack([x, x]), torch.stack([v, v]), mxf)
    assert_q(x.clone(), v.clone(), mxf)
    assert_q(torch.gather(x, 1, torch.tensor([[3, 1]] * 4)),
             torch.gather(v, 1, torch.tensor([[3, 1]] * 4)), mxf)
    assert_q(x.max(dim=0).values, v.max(dim=0).values, mxf)
    assert_q(torch.flip(x, [1]), torch.flip(v, [1]), mxf)
    # transposes move the block axis with the data
    assert_q(x.t(), v.t(), mxf.replace(axis=0))
    assert in_format(x.t()) and in_format(x.permute(1, 0).contiguous())
    x2 = x.clone()
    x2.t_()  # in place too
    assert_q(x2, v.t(), mxf.replace(axis=0))


def test_dtype_and_device_conversions():
    x = q(torch.randn(3, 4), "bf16", mm_fmt=MX6)
    d = x.to(torch.float64)
    assert_q(d, vals(x).double(), qt.bf16, MX6)
    h = q(torch.tensor([70000.0, 1.0]), "bf16").to(torch.float16)  # the cast computes: rounds
    assert_q(h, qt.quantize(torch.tensor([70000.0, 1.0]).half(), qt.bf16), qt.bf16)
    assert type(x.to(torch.int32)) is torch.Tensor
    assert_q(x.to("cpu"), vals(x), qt.bf16, MX6)


# ---------------------------------------------------------------------------------------------
# Views, in-place ops, out=

def test_inplace_on_view_changes_base_and_rounds():
    x = q(torch.zeros(2, 3), "fp8_e4m3")
    base_payload = x.dequantize()
    x.view(-1)[0].add_(1.1)
    assert x.dequantize()[0, 0].item() == 1.125  # rounded to E4M3, through the view
    assert x.dequantize() is base_payload or torch.equal(x.dequantize(), base_payload)
    x[1].mul_(0).add_(500)  # saturates to 448 in the destination's format
    assert torch.all(x.dequantize()[1] == 448.0)
    assert isinstance(x, qt.QTensor) and x.fmt == qt.fp8_e4m3


def test_inplace_rounds_into_destination_format():
    p = q(torch.randn(10), "bf16")
    g = q(torch.randn(10) * 1e-3, "fp32")
    expected = qt.quantize(vals(p) + vals(g) * -0.1, qt.bf16)
    r = p.add_(g, alpha=-0.1)
    assert r is p
    assert_q(p, expected, qt.bf16)
    # a data-movement op writing other values into p rounds them into p's format
    src = torch.randn(10)
    p.copy_(src)
    assert_q(p, qt.quantize(src, qt.bf16), qt.bf16)


def test_out_argument():
    a, b = q(torch.randn(5)), q(torch.randn(5))
    out = q(torch.zeros(5), "fp8_e5m2")
    r = torch.mul(a, b, out=out)
    assert r is out
    assert_q(out, qt.quantize(vals(a) * vals(b), qt.fp8_e5m2), qt.fp8_e5m2)


def test_mixed_formats_and_plain_tensors():
    a = torch.randn(6)
    x8, x16 = q(a, "fp8_e4m3"), q(a * 3, "bf16")
    assert_q(x8 + x16, qt.quantize(vals(x8) + vals(x16), qt.fp8_e4m3), qt.fp8_e4m3)
    assert_q(x16 + x8, qt.quantize(vals(x16) + vals(x8), qt.bf16), qt.bf16)
    plain = torch.randn(6)
    assert_q(plain * x16, qt.quantize(plain * vals(x16), qt.bf16), qt.bf16)  # stays a QTensor
    assert_q(x16 * 0.1, qt.quantize(vals(x16) * 0.1, qt.bf16), qt.bf16)  # scalars are constants
    # cat of different formats: moved values that are not in the first format get rounded
    c = torch.cat([x8, x16])
    assert_q(c, qt.quantize(torch.cat([vals(x8), vals(x16)]), qt.fp8_e4m3), qt.fp8_e4m3)


# ---------------------------------------------------------------------------------------------
# Two formats per tensor

def test_mm_blocks_operands_along_the_reduction_dim():
    torch.manual_seed(0)
    a = torch.randn(8, 40, dtype=torch.float64)
    b = torch.randn(40, 24, dtype=torch.float64) * torch.logspace(-2, 2, 24, dtype=torch.float64)
    x, y = q(a, "bf16", MX6), q(b, "fp32", MX6)
    expected = qt.quantize(qt.quantize(vals(x), mx(MX6, 1)) @ qt.quantize(vals(y), mx(MX6, 0)), qt.bf16)
    assert_q(x @ y, expected, qt.bf16, MX6)
    assert_q(torch.mm(x, y), expected, qt.bf16, MX6)
    # einsum's contraction reaches bmm: operands blocked along the contracted index
    e = torch.einsum("ik,kj->ij", x, y)
    assert_q(e, expected, qt.bf16, MX6)
    # the values of x are unchanged by their use in a contraction
    assert_bits_equal(vals(x), qt.quantize(a, qt.bf16))
    # bmm
    xb = q(torch.randn(3, 5, 33, dtype=torch.float64), "bf16", MX6)
    yb = q(torch.randn(3, 33, 7, dtype=torch.float64), "bf16", qt.fp8_e4m3)  # scalar mm_fmt
    eb = qt.quantize(torch.bmm(qt.quantize(vals(xb), mx(MX6, 2)), qt.quantize(vals(yb), qt.fp8_e4m3)), qt.bf16)
    assert_q(torch.bmm(xb, yb), eb, qt.bf16, MX6)
    # a QTensor whose fmt is a block format enters as it is
    w = q(torch.randn(40, 6, dtype=torch.float64), qt.mxfp4_e2m1.replace(axis=0))
    assert_q(x @ w, qt.quantize(qt.quantize(vals(x), mx(MX6, 1)) @ vals(w), qt.bf16), qt.bf16, MX6)


def test_mx_linear_forward_and_backward_blockings():
    """The MX linear layer (mm_fmt, README.md): exact blockings forward and backward.

    float64 payloads make every product and sum exact, so the result does not depend on the
    GEMM's summation order and the comparison is bit for bit.
    """
    torch.manual_seed(0)
    B, IN, OUT = 8, 72, 40
    x = q(torch.randn(B, IN, dtype=torch.float64), "bf16", MX6).requires_grad_()
    w = nn.Parameter(q(torch.randn(OUT, IN, dtype=torch.float64) / 8, "fp32", MX6))
    b = nn.Parameter(q(torch.randn(OUT, dtype=torch.float64), "fp32"))
    y = F.linear(x, w, b)
    X, W, G = vals(x).detach(), vals(w).detach(), None
    ref_y = qt.quantize(qt.quantize(X, mx(MX6, 1)) @ qt.quantize(W, mx(MX6, 1)).t() + vals(b).detach(), qt.bf16)
    assert_q(y.detach(), ref_y, qt.bf16, MX6, "forward")
    gy = q(torch.randn(B, OUT, dtype=torch.float64), "bf16", MX6)
    y.backward(gy)
    G = vals(gy)
    # grad_x = grad_y @ W: grad_y along out_features (dim 1), W along out_features (dim 0)
    ref_gx = qt.quantize(qt.quantize(G, mx(MX6, 1)) @ qt.quantize(W, mx(MX6, 0)), qt.bf16)
    assert_q(x.grad, ref_gx, qt.bf16, MX6, "grad_x")
    # grad_W = grad_y.T @ x: both along the batch
    ref_gw = qt.quantize(qt.quantize(G, mx(MX6, 0)).t() @ qt.quantize(X, mx(MX6, 0)), qt.bf16)
    assert_q(w.grad, ref_gw, qt.bf16, MX6, "grad_W")
    assert_q(b.grad, qt.quantize(G.sum(0), qt.bf16), qt.bf16, MX6, "grad_b")


def test_conv2d_blocks_along_channels_forward_and_backward():
    torch.manual_seed(0)
    x = q(torch.randn(2, 40, 5, 5, dtype=torch.float64), "bf16", MX6).requires_grad_()
    w = nn.Parameter(q(torch.randn(36, 40, 3, 3, dtype=torch.float64) / 16, "fp32", MX6))
    y = F.conv2d(x, w, padding=1)
    X, W = vals(x).detach(), vals(w).detach()
    ref = qt.quantize(F.conv2d(qt.quantize(X, mx(MX6, 1)), qt.quantize(W, mx(MX6, 1)), padding=1), qt.bf16)
    assert_q(y.detach(), ref, qt.bf16, MX6, "forward")
    gy = q(torch.randn(2, 36, 5, 5, dtype=torch.float64), "bf16", MX6)
    y.backward(gy)
    G = vals(gy)
    ref_gx = torch.nn.grad.conv2d_input(X.shape, qt.quantize(W, mx(MX6, 0)), qt.quantize(G, mx(MX6, 1)), padding=1)
    ref_gw = torch.nn.grad.conv2d_weight(qt.quantize(X, mx(MX6, 0)), W.shape, qt.quantize(G, mx(MX6, 0)), padding=1)
    assert_q(x.grad, qt.quantize(ref_gx, qt.bf16), qt.bf16, MX6, "grad_input")
    assert_q(w.grad, qt.quantize(ref_gw, qt.bf16), qt.bf16, MX6, "grad_weight")


# ---------------------------------------------------------------------------------------------
# Autograd

def test_backward_gives_qtensor_grads_and_quantize_grad():
    torch.manual_seed(0)
    w = nn.Parameter(q(torch.randn(4, 4), "bf16"))
    x = q(torch.randn(3, 4), "bf16")
    h = qt.quantize_grad(x @ w, "fp8_e5m2", mm_fmt=MX6)
    captured = {}
    h.register_hook(lambda g: captured.setdefault("g", g))
    loss = (h * h).sum()
    loss.backward()
    assert isinstance(w.grad, qt.QTensor)
    # the gradient reaching h is 2h rounded to bf16 (h's format, mul's first operand)...
    assert_q(captured["g"], qt.quantize(2 * vals(h).detach(), qt.bf16), qt.bf16)
    # ...and quantize_grad rounds it to fp8_e5m2 with mm_fmt before it flows on
    g = qt.quantize(2 * vals(h).detach(), qt.bf16)
    gq = qt.quantize(g, qt.fp8_e5m2)
    ref = qt.quantize(vals(x).t() @ gq, qt.bf16)
    assert_q(w.grad, ref, qt.bf16)
    # on a plain tensor: the gradient becomes a QTensor
    p = torch.randn(5, requires_grad=True)
    (qt.quantize_grad(p, "fp8_e4m3") * 0.3).sum().backward()
    assert_q(p.grad, qt.quantize(torch.full((5,), 0.3), qt.fp8_e4m3), qt.fp8_e4m3)



def test_quantize_grad_keeps_the_accumulator():
    """The gradient quantize_grad rounds keeps the accumulator of the gradient it receives, or
    else of the tensor whose gradient it is, so the contractions it then meets in backward sum
    with it: w.grad = x^T @ g (x carries none) equals accum_matmul of the operands, bit for bit,
    and differs from FP32 accumulation."""
    gen = torch.Generator().manual_seed(0)
    x = q(torch.randn(512, 32, generator=gen), "bf16")  # no accumulator: the products' K is 512
    w = nn.Parameter(qt.QTensor(qt.quantize(torch.randn(32, 16, generator=gen), "bf16"), "bf16",
                                accum=qt.accum.hopper_fp8))
    G = torch.randn(512, 16, generator=gen)
    for given in (G, qt.QTensor(qt.quantize(G, "fp32"), "fp32", accum=qt.accum.hopper_fp8_fast)):
        w.grad = None
        h = qt.quantize_grad(x @ w, "fp8_e5m2")
        assert h.accum is qt.accum.hopper_fp8
        h.backward(given)
        acc = getattr(given, "accum", None) or qt.accum.hopper_fp8
        gq = qt.quantize(vals(given), qt.fp8_e5m2)
        want = qt.quantize(qt.accum.accum_matmul(vals(x).t(), gq, acc), qt.bf16)
        assert_q(w.grad, want, qt.bf16, msg=str(acc))
        assert w.grad.accum is acc
        assert not torch.equal(want, qt.quantize(vals(x).t() @ gq, qt.bf16)), "FP32 accumulation"



def test_accum_attribute_takes_a_preset_name_and_checks_its_value():
    t = q(torch.randn(2, 2))
    t.accum = "hopper_fp8"
    assert t.accum is qt.accum.hopper_fp8
    with pytest.raises(TypeError, match=r"QTensor.accum must be an AccumFormat, a preset name"):
        t.accum = 13
    t.accum = None
    assert t.accum is None and q(torch.randn(2)).accum is None


# ---------------------------------------------------------------------------------------------
# Optimizers

def _qmodel(fmt="bf16", mm_fmt=MX6):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    for mod in m.modules():
        for n, p in list(mod._parameters.items()):
            mod._parameters[n] = nn.Parameter(q(p.detach(), fmt, mm_fmt))
    return m


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("opt", ["SGD", "Adam", "AdamW"])
def test_optimizers_keep_everything_in_format(opt, foreach):
    m = _qmodel()
    # mixed formats (one whose range holds Adam's eps: in fp8 the denominator would round to 0)
    m[2].weight = nn.Parameter(q(m[2].weight.dequantize().clone(), "tf32"))
    kw = dict(lr=0.1, momentum=0.9) if opt == "SGD" else dict(lr=1e-2)
    o = getattr(torch.optim, opt)(m.parameters(), foreach=foreach, **kw)
    x = q(torch.randn(8, 16), "bf16", MX6)
    before = [p.dequantize().clone() for p in m.parameters()]
    for _ in range(2):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    for p, p0 in zip(m.parameters(), before):
        assert isinstance(p, qt.QTensor) and isinstance(p, nn.Parameter) and in_format(p)
        assert isinstance(p.grad, qt.QTensor) and in_format(p.grad)
        assert not torch.equal(p.dequantize(), p0)
        for k, s in o.state[p].items():
            if k != "step":
                assert isinstance(s, qt.QTensor) and in_format(s), k
                assert s.fmt == (p.grad.fmt if k == "momentum_buffer" else p.fmt), k
    assert m[2].weight.fmt == qt.tf32


def test_sgd_step_matches_manual_rounding():
    p = nn.Parameter(q(torch.randn(6), "bf16"))
    g = q(torch.randn(6), "fp8_e4m3")
    p.grad = g
    expected = qt.quantize(vals(p).detach() + vals(g) * -0.5, qt.bf16)
    torch.optim.SGD([p], lr=0.5).step()
    assert_q(p.detach(), expected, qt.bf16)


# ---------------------------------------------------------------------------------------------
# Serialization and conversions

def test_save_load_pickle_deepcopy():
    m = _qmodel()
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    for k, v in m.state_dict().items():
        assert_q(sd[k], vals(v), v.fmt, v.mm_fmt, k)
    m2 = _qmodel("fp8_e4m3", None)
    m2.load_state_dict(sd)  # copies into fp8 parameters: rounded into their format
    assert_q(m2[0].weight.detach(), qt.quantize(vals(m[0].weight).detach(), qt.fp8_e4m3), qt.fp8_e4m3)
    for clone in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        w = clone[0].weight
        assert isinstance(w, nn.Parameter) and isinstance(w, qt.QTensor) and w.requires_grad
        assert_q(w.detach(), vals(m[0].weight).detach(), qt.bf16, MX6)
        assert w.dequantize().data_ptr() != m[0].weight.dequantize().data_ptr()


def test_module_to_dtype_keeps_qtensor_params():
    m = _qmodel()
    m.to(torch.float64)
    assert isinstance(m[0].weight, qt.QTensor) and m[0].weight.dtype == torch.float64
    assert m[0].weight.fmt == qt.bf16 and in_format(m[0].weight)


# ---------------------------------------------------------------------------------------------
# torch.compile

def _compile_backend():
    """inductor where the quantize op is opaque to it (the custom op); otherwise aot_eager, since
    inductor cannot yet generate C++ for the reference quantizer's int64 bit manipulations."""
    import qtensor.kernels.ops as ops
    return "inductor" if ops.kernels_available("cpu") else "aot_eager"


def test_compiled_mlp_is_bit_identical_to_eager():
    torch._dynamo.reset()
    m = _qmodel("bf16", MX6)
    mc = copy.deepcopy(m)
    x = q(torch.randn(16, 16), "bf16", MX6)
    y = m(x)
    y.square().mean().backward()
    cm = torch.compile(mc, backend=_compile_backend())
    yc = cm(x)
    yc.square().mean().backward()
    assert_q(yc.detach(), vals(y).detach(), qt.bf16, MX6, "forward")
    for (n, p), pc in zip(m.named_parameters(), mc.parameters()):
        assert_q(pc.grad, vals(p.grad), p.grad.fmt, p.grad.mm_fmt, n)


def test_python_conversions_and_setitem():
    x = q(torch.tensor([0.3, -1.7, 100.0]), "fp8_e4m3")
    assert x.tolist() == vals(x).tolist() == [0.3125, -1.75, 96.0]
    assert x.numpy().tolist() == [0.3125, -1.75, 96.0]
    assert x[1].item() == -1.75 and float(x[2]) == 96.0
    x[0] = 1.3  # a Python value written into a QTensor is rounded into its format
    assert x.tolist() == [1.25, -1.75, 96.0] and isinstance(x, qt.QTensor)


def test_attention_math_backend_emulates_its_contractions():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(0)
    a = torch.randn(1, 2, 4, 40, dtype=torch.float64)
    x = q(a, "bf16", MX6)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(x, x, x)
    v = vals(x)
    sf = (1 / 40 ** 0.5) ** 0.5  # the math backend scales q and k by sqrt(scale) each
    qs, kt = qt.quantize(v * sf, qt.bf16), qt.quantize(v.transpose(-2, -1) * sf, qt.bf16)
    s = qt.quantize(qt.quantize(qs, mx(MX6, -1)) @ qt.quantize(kt, mx(MX6, -2)), qt.bf16)
    p = qt.quantize(torch.softmax(s, -1), qt.bf16)
    ref = qt.quantize(qt.quantize(p, mx(MX6, -1)) @ qt.quantize(v, mx(MX6, -2)), qt.bf16)
    assert_q(out, ref, qt.bf16, MX6)


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2"])
def test_cast_fast_path_matches_quantize(name):
    """dispatch rounds to dtype-shaped formats by a cast down and back: the same bits."""
    from qtensor.kernels import backend
    from qtensor.tensor import dispatch
    torch.manual_seed(0)
    x = torch.cat([
        torch.randn(20000) * torch.logspace(-45, 38, 20000).clamp(max=3e38),
        torch.randint(-2 ** 31, 2 ** 31 - 1, (20000,), dtype=torch.int32).view(torch.float32),
        torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 65504.0, 65520.0,
                      448.0, 464.0, 57344.0, 61440.0, 1e-40, -1e-45])])
    fmt = qt.format(name)
    assert_bits_equal(dispatch.quantize(x, fmt), qt.quantize(x, fmt), name)
    # the cast itself (CUDA, traced graphs; eager CPU float8 takes the kernel: its casts are slow)
    cast = x.to(backend._CAST_DTYPES[id(fmt)]).to(x.dtype)
    assert_bits_equal(cast, qt.quantize(x, fmt), name + " cast")
    y = qt.QTensor(x.clone(), fmt)
    dispatch._round_inplace(y)
    assert_bits_equal(y.dequantize(), qt.quantize(x, fmt), name + " in place")


@pytest.mark.parametrize("fmt", [qt.mxfp8_e4m3, qt.mxfp4_e2m1, qt.nvfp4])
def test_block_rounding_on_a_moved_view_matches_quantize(fmt):
    """dispatch rounds blocks along a non-innermost axis on a view that makes it innermost."""
    from qtensor.tensor import dispatch
    torch.manual_seed(0)
    w = torch.randn(40, 3, 70) * torch.logspace(-4, 4, 70)
    w[0, 0, 5] = float("nan")
    for x in (w, w.transpose(0, 2), w[:, 1]):
        for axis in range(x.dim()):
            f = fmt.replace(axis=axis)
            expected = qt.quantize(x, f)
            for keep in (True, False):
                assert_bits_equal(dispatch.quantize(x, f, keep_layout=keep), expected, f"{f} {keep}")


# ---------------------------------------------------------------------------------------------
# Tensor protocol corners: .data =, shared memory, DLPack, apply_, storages, formatting

def _converted_linear(recipe="bf16"):
    torch.manual_seed(0)
    return qt.convert(nn.Linear(4, 3), qt.Recipe.uniform(recipe))


def _train_step(m, x):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(x).square().sum().backward()
    opt.step()


def test_data_assignment_on_converted_params_takes_effect():
    """``m.weight.data = t`` (weight init, EMA code) replaces the values used from then on."""
    m = _converted_linear()
    w_new, x = torch.randn(3, 4), torch.randn(2, 4)
    m.weight.data = w_new  # plain: rounded into the parameter's format
    w = m.weight
    assert isinstance(w, qt.QTensor) and isinstance(w, nn.Parameter) and w.requires_grad
    assert_q(w.detach(), qt.quantize(w_new, qt.bf16), qt.bf16)
    # the same model built from those weights: same forward, same SGD step, bit for bit
    torch.manual_seed(0)
    ref = nn.Linear(4, 3)
    ref.weight.data = w_new
    ref = qt.convert(ref, qt.Recipe.uniform("bf16"))
    assert_bits_equal(m(x).dequantize(), ref(x).dequantize())
    _train_step(m, x)
    _train_step(ref, x)
    assert_q(m.weight.detach(), ref.weight.dequantize(), qt.bf16)
    # a QTensor brings its payload and formats (as a plain tensor brings its dtype)
    ema = q(torch.randn(3, 4), "fp8_e4m3", mm_fmt=MX6)
    m.weight.data = ema
    assert m.weight.fmt == qt.fp8_e4m3 and m.weight.mm_fmt == MX6
    assert_bits_equal(m.weight.dequantize(), ema.dequantize())
    # EMA written with .data on both sides
    e = _converted_linear()
    e.weight.data = 0.5 * e.weight.data + 0.5 * m.weight.data
    assert e.weight.fmt == qt.bf16 and in_format(e.weight)
    with pytest.raises(TypeError, match="int64"):
        m.weight.data = torch.ones(3, 4, dtype=torch.long)


def test_data_assignment_reaches_fp32_master_weights():
    """With master weights the optimizer steps an FP32 copy: a parameter set from outside
    (``.data =``, or in place) is the new start, not overwritten by the old master."""
    torch.manual_seed(0)
    recipe = qt.Recipe(weight="bf16", bias="bf16", activation="bf16", grad="bf16",
                       optimizer_state=None, master_weights=True)
    m = qt.convert(nn.Linear(4, 3), recipe)
    x = torch.randn(2, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for set_weight in (lambda w: setattr(m.weight, "data", w),
                       lambda w: m.weight.detach().copy_(w)):
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
        set_weight(torch.zeros(3, 4))
        m(x).sum().backward()
        g = m.weight.grad.dequantize().clone()
        opt.step()
        opt.zero_grad()
        assert_q(m.weight.detach(), qt.quantize(-0.1 * g, qt.bf16), qt.bf16)
        assert_bits_equal(qt.master_weight(opt, m.weight), -0.1 * g)


def test_data_assignment_on_block_format_rounds_along_its_axis():
    t = q(torch.randn(4, 64), mx(MX6, 0))
    new = torch.randn(4, 64) * torch.logspace(-3, 3, 64)
    t.data = new
    assert_q(t, qt.quantize(new, mx(MX6, 0)), mx(MX6, 0))


def _run_python(code):
    import subprocess
    import sys
    prelude = "import torch, numpy as np, qtensor as qt\nfrom torch import nn\n"
    r = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"exit {r.returncode} (negative: killed by a signal)\n{r.stderr}"
    return r.stdout


def test_share_memory_shares_the_payload():
    """model.share_memory() and q.share_memory_() put the values in shared memory: a forked
    child's in-place update is seen by the parent (they segfaulted)."""
    out = _run_python("""
m = qt.convert(nn.Linear(4, 3), qt.Recipe.uniform("bf16"))
assert m.share_memory() is m
assert all(p.is_shared() and isinstance(p, qt.QTensor) for p in m.parameters())
q = qt.as_qtensor(torch.arange(4.0), "bf16")
assert not q.is_shared() and q.share_memory_() is q and q.is_shared()
def child(q, w):
    with torch.no_grad():
        q.add_(1.001)
        w.zero_()
p = torch.multiprocessing.get_context("fork").Process(target=child, args=(q, m.weight))
p.start(); p.join()
assert p.exitcode == 0
print(q.dequantize().tolist(), m.weight.abs().sum().item(), q.fmt)
""")
    assert out.split() == ["[1.0,", "2.0,", "3.0,", "4.0]", "0.0", "bf16"]


def test_dlpack_apply_and_storage_do_not_crash():
    out = _run_python("""
q = qt.as_qtensor(torch.tensor([1.0, 2.5, -3.0]), "fp8_e4m3")
# DLPack exports the values (as numpy() does)
print(torch.from_dlpack(q).tolist(), np.from_dlpack(q).tolist())
try:
    q.clone().requires_grad_().__dlpack__()
except RuntimeError as e:
    print("grad:", "detach" in str(e))
# apply_ computes, so it rounds into the format
r = q.clone().apply_(lambda v: v * 1.1)
print(type(r).__name__, r.fmt, r.dequantize().tolist())
try:
    nn.Parameter(q.clone()).apply_(abs)
except RuntimeError as e:
    print("grad:", "detach" in str(e))
# the storage holds the values
s = q.untyped_storage()
print(torch.empty(0).set_(s).tolist(), q.storage().tolist())
""")
    lines = out.splitlines()
    assert lines[0] == "[1.0, 2.5, -3.0] [1.0, 2.5, -3.0]"
    assert lines[1] == "grad: True"
    assert lines[2] == "QTensor fp8_e4m3 [1.125, 2.75, -3.25]"
    assert lines[3] == "grad: True"
    assert lines[4] == "[1.0, 2.5, -3.0] [1.0, 2.5, -3.0]"


def test_sparse_embedding_trains_in_a_converted_model():
    """nn.Embedding(sparse=True): the sparse gradient's values are rounded to the gradient
    format and SGD applies it (backward crashed)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    dense = copy.deepcopy(m)
    dense[0].sparse = False
    m, dense = (qt.convert(k, qt.Recipe.uniform("bf16")) for k in (m, dense))
    idx = torch.tensor([1, 2, 3, 2])
    for k in (m, dense):
        _train_step(k, idx)
    g = m[0].weight.grad
    assert g.is_sparse and torch.equal(g.coalesce().values(), qt.quantize(g.coalesce().values(), qt.bf16))
    assert_bits_equal(g.to_dense(), dense[0].weight.grad.dequantize())
    assert_q(m[0].weight.detach(), dense[0].weight.dequantize(), qt.bf16)


def test_format_of_a_zero_dim_loss():
    m = _converted_linear()
    loss = m(torch.randn(2, 4)).square().mean()
    assert isinstance(loss, qt.QTensor)
    assert f"{loss:.4f}" == f"{loss.item():.4f}" and f"{loss}" == f"{loss.item()}"
    with pytest.raises(TypeError):
        f"{m.weight:.4f}"  # as for a plain tensor with dims


# ---------------------------------------------------------------------------------------------
# Block formats: the block axis follows its dimension through views and reductions

def _assert_blocks_follow(t, expected_axis, expected_vals):
    assert t.fmt.axis == expected_axis or t.fmt.axis % t.dim() == expected_axis % t.dim(), \
        f"axis {t.fmt.axis} != {expected_axis}"
    assert_bits_equal(t.dequantize(), expected_vals)
    assert in_format(t), "values not in format"


@pytest.mark.parametrize("axis", [0, -1])
def test_block_axis_follows_views(axis):
    torch.manual_seed(0)
    x = torch.randn(6, 64) * torch.logspace(-4, 4, 64)
    x = x.t().contiguous() if axis == 0 else x  # blocks of 32 along the 64-long dim
    f = mx(MX6, axis)
    t = q(x, f)
    v = t.dequantize()
    ax = axis % 2
    _assert_blocks_follow(t.unsqueeze(0), ax + 1, v.unsqueeze(0))
    _assert_blocks_follow(t.unsqueeze(-1), ax, v.unsqueeze(-1))
    _assert_blocks_follow(t.unsqueeze(1), 0 if ax == 0 else 2, v.unsqueeze(1))
    _assert_blocks_follow(t.unsqueeze(0).squeeze(0), ax, v)
    _assert_blocks_follow(t.permute(1, 0), 1 - ax, v.permute(1, 0))
    shape = (1,) + tuple(x.shape) + (1,)
    _assert_blocks_follow(t.view(shape), ax + 1, v.view(shape))
    _assert_blocks_follow(t.reshape(shape).squeeze(), ax, v)
    w = t.clone()
    w.unsqueeze_(0)
    _assert_blocks_follow(w, ax + 1, v.unsqueeze(0))
    # the 64-long axis split in two 32-long halves: each block is a row of the inner half
    split = (2, 32, 6) if ax == 0 else (6, 2, 32)
    _assert_blocks_follow(t.reshape(split), 1 if ax == 0 else 2, v.reshape(split))


@pytest.mark.parametrize("axis", [0, 1])
def test_block_axis_through_reductions(axis):
    torch.manual_seed(0)
    x = torch.randn(5, 64, 3) * torch.logspace(-4, 4, 3)
    f = mx(MX6, axis)
    t = q(x, f)
    v = t.dequantize()
    # reduced over another dimension: the blocks stay along the same logical dimension
    s = t.sum(2)
    _assert_blocks_follow(s, axis, qt.quantize(v.sum(2), mx(MX6, axis)))
    if axis == 1:  # a dimension before it goes: the axis number moves down
        s = t.sum(0)
        _assert_blocks_follow(s, 0, qt.quantize(v.sum(0), mx(MX6, 0)))
        s = t.sum((0, 2))
        _assert_blocks_follow(s, 0, qt.quantize(v.sum((0, 2)), mx(MX6, 0)))
    m = t.mean(0, keepdim=True)
    _assert_blocks_follow(m, axis, qt.quantize(v.mean(0, keepdim=True), f))
    # over the block axis: the last dimension of the result (re-rounded, in format)
    r = t.amax(axis)
    assert r.fmt.axis == -1 and in_format(r)
    assert_bits_equal(r.dequantize(), qt.quantize(v.amax(axis), mx(MX6, -1)))


def test_block_axis_through_stack_cat_and_embedding():
    torch.manual_seed(0)
    x = torch.randn(40, 5) * torch.logspace(-4, 4, 5)
    f = mx(MX6, 0)  # blocks of 32 along the 40-long dim: a full block and a short one
    t = q(x, f)
    v = t.dequantize()
    _assert_blocks_follow(torch.stack([t, t], 0), 1, torch.stack([v, v], 0))
    _assert_blocks_follow(torch.stack([t, t], -1), 0, torch.stack([v, v], -1))
    _assert_blocks_follow(t.expand(3, 40, 5), 1, v.expand(3, 40, 5))
    # moved values whose blocks break are re-rounded (a copy, not a view)
    c = torch.cat([t, t], 0)
    assert c.fmt == f and in_format(c)
    assert_bits_equal(c.dequantize(), qt.quantize(torch.cat([v, v], 0), f))
    # an embedding table blocked along the vocabulary: the rows it picks are re-blocked
    e = F.embedding(torch.tensor([[3, 1], [0, 2]]), t)
    assert in_format(e)
    assert_bits_equal(e.dequantize(), qt.quantize(F.embedding(torch.tensor([[3, 1], [0, 2]]), v),
                                                  e.fmt))


@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3", "mxfp8_e4m3", "mxfp6_e3m2", "fp6_e2m3"])
def test_outputs_rounded_in_place_leave_the_inputs_alone(name):
    """dispatch rounds an op's own new outputs in place: the same bits as qt.quantize of the
    FP32 result, and the inputs (whose payloads an op may hand back) keep theirs."""
    fmt = qt.format(name)
    torch.manual_seed(0)
    x = torch.randn(6, 64) * 3
    a = qt.as_qtensor(x, fmt)
    before = a.dequantize().clone()
    v = a.dequantize()
    for what, op in [("mul 1", lambda t: t * 1.0), ("relu", torch.relu), ("exp", torch.exp),
                     ("add", lambda t: t + t), ("sum", lambda t: t.sum(0)),
                     ("transposed", lambda t: t.t() * 2.0), ("max", lambda t: t.max(0).values),
                     ("to fp16", lambda t: t.to(torch.float16))]:
        out = op(a)
        ref = qt.quantize(op(v.clone()).float(), out.fmt)  # (t(): blocked along dim 0)
        assert_bits_equal(out.dequantize().float(), ref, what)
        assert_bits_equal(a.dequantize(), before, what + ": input changed")

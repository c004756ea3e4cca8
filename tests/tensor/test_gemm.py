"""Per-GEMM operand formats (Recipe.gemm, qtensor.tensor.gemm): each operand of the forward,
input-gradient and weight-gradient GEMMs of a converted Linear/Conv in its own format, checked
bit for bit against a manual computation (each operand rounded with qt.quantize along its
reduction dimension, float32 products)."""
import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qtensor as qt
from helpers import assert_bits_equal

torch.set_num_threads(1)

E4M3, E5M2, FP6, FP6B, FP4, INT8 = (qt.mxfp8_e4m3, qt.mxfp8_e5m2, qt.mxfp6_e3m2, qt.mxfp6_e2m3,
                                    qt.mxfp4_e2m1, qt.mxint8)
# six different operand formats, one with another rounding mode
GEMM = {"fprop": (E4M3, FP6), "dgrad": (E5M2, FP4.replace(rounding="toward_zero")),
        "wgrad": (INT8, FP6B)}
# roles whose own operand formats (bf16) differ from every per-GEMM one
ROLES = dict(weight=(None, qt.bf16), bias=None, activation=(None, qt.bf16), grad=(None, qt.bf16))


def plain(t):
    return t.dequantize() if isinstance(t, qt.QTensor) else t


def q(t, fmt, axis):
    return qt.quantize(t, fmt.replace(axis=axis))


def qm(t, fmt, axis):
    """q() in the layout dispatch hands the op (the block axis innermost in memory): the same
    values; convolutions pick their algorithm, hence their last bits, by layout."""
    return qt.quantize(t.movedim(axis, -1).contiguous(), fmt.replace(axis=-1)).movedim(-1, axis)


def linear_run(recipe, x, g, seed=0, in_f=64, out_f=32):
    torch.manual_seed(seed)
    m = nn.Linear(in_f, out_f)
    w0, b0 = m.weight.detach().clone(), m.bias.detach().clone()
    qt.convert(m, recipe)
    xx = x.clone().requires_grad_()
    y = m(xx)
    y.backward(g)
    return m, (w0, b0), y, xx.grad, m.weight.grad, m.bias.grad


def test_linear_three_gemms_bit_for_bit_against_manual():
    torch.manual_seed(1)
    x, g = torch.randn(64, 64), torch.randn(64, 32)
    m, (w, b), y, gx, gw, gb = linear_run(qt.Recipe(**ROLES, gemm=GEMM), x, g)
    (fx, fw), (dy_d, w_d), (x_w, dy_w) = GEMM["fprop"], GEMM["dgrad"], GEMM["wgrad"]
    # forward: x and W along K (in_features)
    assert_bits_equal(plain(y), torch.addmm(b, q(x, fx, 1), q(w, fw, 1).t()), "fprop")
    # input gradient dx = dY W: dY and W along out_features
    assert_bits_equal(plain(gx), q(g, dy_d, 1) @ q(w, w_d, 0), "dgrad")
    # weight gradient dW = (x^T dY)^T: x and dY along the batch
    assert_bits_equal(plain(gw), (q(x, x_w, 0).t() @ q(g, dy_w, 0)).t(), "wgrad")
    assert_bits_equal(plain(gb), g.sum(0), "bias grad")
    # the outputs carry the roles' own formats, no per-GEMM tag
    assert y.mm_fmt == qt.bf16 and m.weight.grad.mm_fmt == qt.bf16
    assert isinstance(m.weight.dequantize(), torch.Tensor)


def test_each_gemm_format_matters():
    """A test that cannot fail is a defect: each per-GEMM format changes its own GEMM only."""
    torch.manual_seed(1)
    x, g = torch.randn(64, 64), torch.randn(64, 32)
    ref = linear_run(qt.Recipe(**ROLES, gemm=GEMM), x, g)
    for gemm, i in (("fprop", 0), ("fprop", 1), ("dgrad", 0), ("dgrad", 1), ("wgrad", 0),
                    ("wgrad", 1)):
        pair = list(GEMM[gemm])
        pair[i] = qt.mxfp8_e4m3 if "fp4" in str(pair[i]) else qt.mxfp4_e2m1
        run = linear_run(qt.Recipe(**ROLES, gemm={**GEMM, gemm: tuple(pair)}), x, g)
        changed = [not torch.equal(plain(a), plain(b)) for a, b in zip(ref[2:5], run[2:5])]
        assert changed == [gemm == "fprop", gemm == "dgrad", gemm == "wgrad"], (gemm, i, changed)
    # the rounding mode of a per-GEMM format is used (dgrad's W rounds toward zero)
    run = linear_run(qt.Recipe(**ROLES, gemm={**GEMM, "dgrad": (E5M2, FP4)}), x, g)
    assert not torch.equal(plain(ref[3]), plain(run[3]))


@pytest.mark.parametrize("shape", [(64,), (4, 16)])
def test_gemm_equal_to_roles_is_todays_bits(shape):
    """Per-GEMM formats equal to the roles' mm_fmt: the bits of a recipe without gemm (2D and
    3D inputs, value formats and accumulation as they are)."""
    base = qt.Recipe(weight=(None, E4M3), activation=(qt.bf16, E4M3), grad=(qt.bf16, E5M2))
    same = base.replace(gemm={"fprop": (E4M3, E4M3), "dgrad": (E5M2, E4M3),
                              "wgrad": (E4M3, E5M2)})
    torch.manual_seed(2)
    x, g = torch.randn(*shape, 64), torch.randn(*shape, 32)
    for a, b in zip(linear_run(base, x, g)[2:], linear_run(same, x, g)[2:]):
        assert_bits_equal(plain(b), plain(a))
        assert type(a) is type(b) and getattr(a, "fmt", None) == getattr(b, "fmt", None)
        assert getattr(a, "mm_fmt", None) == getattr(b, "mm_fmt", None)


def test_gemm_none_entries_keep_the_operands_own_formats():
    torch.manual_seed(3)
    x, g = torch.randn(32, 64), torch.randn(32, 32)
    base = qt.Recipe(weight=(None, E4M3), activation=(None, E4M3), grad=(None, E5M2))
    only = base.replace(gemm={"dgrad": (None, FP4)})
    _m, (w, _b), y, gx, gw, _gb = linear_run(only, x, g)
    ref = linear_run(base, x, g)
    assert_bits_equal(plain(y), plain(ref[2]))
    assert_bits_equal(plain(gw), plain(ref[4]))
    assert_bits_equal(plain(gx), q(g, E5M2, 1) @ q(w, FP4, 0))
    assert base.replace(gemm={}).gemm is None and base.replace(gemm={"fprop": None}).gemm is None


def test_conv2d_three_gemms_against_manual():
    torch.manual_seed(4)
    conv = nn.Conv2d(32, 32, 3, padding=1)
    w, b = conv.weight.detach().clone(), conv.bias.detach().clone()
    qt.convert(conv, qt.Recipe(**ROLES, gemm=GEMM))
    x = torch.randn(2, 32, 6, 6, requires_grad=True)
    y = conv(x)
    g = torch.randn(y.shape)
    y.backward(g)
    (fx, fw), (dy_d, w_d), (x_w, dy_w) = GEMM["fprop"], GEMM["dgrad"], GEMM["wgrad"]
    xd = x.detach()
    assert_bits_equal(plain(y), F.conv2d(qm(xd, fx, 1), qm(w, fw, 1), b, padding=1), "fprop")
    gi, _, _ = torch.ops.aten.convolution_backward(
        qm(g, dy_d, 1), xd, qm(w, w_d, 0), [32], [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
        [True, False, False])
    _, gw, _ = torch.ops.aten.convolution_backward(
        qm(g, dy_w, 0), qm(xd, x_w, 0), w, [32], [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
        [False, True, False])
    assert_bits_equal(plain(x.grad), gi, "dgrad")
    assert_bits_equal(plain(conv.weight.grad), gw, "wgrad")


def test_rules_keep_their_roles_and_unconvert_deepcopy_pickle():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    recipe = qt.Recipe(**ROLES, gemm=GEMM, rules={"2": {"weight": (None, qt.bf16)}})
    qt.convert(model, recipe)
    from qtensor.nn.gemm_forward import GemmForward
    assert isinstance(model[0].__dict__.get("forward"), GemmForward)
    assert "forward" not in model[2].__dict__  # a rule decides its weight: its roles' mm_fmt
    x = torch.randn(8, 64)
    with torch.no_grad():
        y = model(x)
        for other in (copy.deepcopy(model), _pickled(model)):
            assert_bits_equal(plain(other(x)), plain(y))
    qt.unconvert(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert "gemm" in recipe.describe()


def _pickled(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_gemm_spec_errors():
    with pytest.raises(ValueError, match="unknown GEMM"):
        qt.Recipe(gemm={"bprop": (E4M3, E4M3)})
    with pytest.raises(ValueError, match="pair"):
        qt.Recipe(gemm={"fprop": E4M3})
    with pytest.raises(TypeError, match="Recipe.gemm"):
        qt.Recipe(gemm=[E4M3])
    with pytest.raises(qt.FormatError, match="wgrad"):
        qt.Recipe(gemm={"wgrad": ("no_such_format", None)})


def test_gemm_per_layer_kind():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Conv1d(32, 32, 1), nn.Flatten(), nn.Linear(32 * 4, 8))
    r = qt.Recipe(**ROLES, gemm={"linear": GEMM})
    assert r.gemm["conv"] is None and r.gemm["linear"].fprop_w == FP6
    qt.convert(model, r)
    assert "forward" not in model[0].__dict__ and "forward" in model[2].__dict__
    with pytest.raises(ValueError, match="beside layer kinds"):
        qt.Recipe(gemm={"linear": GEMM, "fprop": (E4M3, E4M3)})
    assert "gemm (linear)" in r.describe()


def test_plain_input_warns_and_plain_grad_is_rounded():
    """Activation role None: x stays plain and unrounded (a warning says its per-GEMM formats do
    not apply); W still takes its fprop and dgrad formats, and the plain dY its dgrad one."""
    torch.manual_seed(7)
    m = nn.Linear(64, 32, bias=False)
    w = m.weight.detach().clone()
    qt.convert(m, qt.Recipe(weight=(None, qt.bf16), gemm=GEMM))
    x = torch.randn(16, 64, requires_grad=True)
    with pytest.warns(UserWarning, match="plain input"):
        y = m(x)
    g = torch.randn(16, 32)
    y.backward(g)
    assert_bits_equal(plain(y), x.detach() @ q(w, GEMM["fprop"][1], 1).t())
    assert_bits_equal(plain(x.grad), q(g, GEMM["dgrad"][0], 1) @ q(w, GEMM["dgrad"][1], 0))


@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_gemm_with_an_accumulator_reads_the_per_gemm_formats(layer):
    """Under an emulated accumulator (which reads each operand's format from its mm_fmt: MX block
    scales, subnormal clamps), per-GEMM formats equal to the roles' give the roles' bits."""
    # FP6/FP4 operands: their subnormals align at the formats' emin (read from mm_fmt)
    e4, e5 = qt.format("fp6_e2m3"), qt.format("fp4_e2m1")
    base = qt.Recipe(weight=(None, e4), activation=(None, e4), grad=(None, e5),
                     accumulate="blackwell_f8f6f4")
    same = base.replace(gemm={"fprop": (e4, e4), "dgrad": (e5, e4), "wgrad": (e4, e5)})
    outs = []
    for r in (base, same):
        torch.manual_seed(8)
        m = nn.Linear(64, 32) if layer == "linear" else nn.Conv2d(32, 32, 3, padding=1)
        qt.convert(m, r)
        x = (torch.randn(16, 64) if layer == "linear" else torch.randn(2, 32, 5, 5))
        x.requires_grad_()
        y = m(x)
        y.backward(torch.randn(y.shape))
        outs.append((y, x.grad, m.weight.grad))
    for a, b in zip(*outs):
        assert_bits_equal(plain(b), plain(a))


def test_the_accumulator_is_told_the_per_gemm_formats(monkeypatch):
    """qtensor.accum reads each operand's format from its mm_fmt: it gets the per-GEMM ones."""
    import qtensor.accum.lowering as accum
    from qtensor.tensor.gemm import GemmOperand
    seen = []
    contract = accum.contract

    def spy(packet, uargs, ukwargs, f, qargs=None):
        seen.append((packet, [getattr(a, "mm_fmt", None) for a in qargs or ()]))
        return contract(packet, uargs, ukwargs, f, qargs)
    monkeypatch.setattr(accum, "contract", spy)
    for layer in ("linear", "conv"):
        torch.manual_seed(9)
        m = nn.Linear(64, 32, bias=False) if layer == "linear" else nn.Conv2d(32, 32, 1,
                                                                             bias=False)
        qt.convert(m, qt.Recipe(**ROLES, gemm=GEMM, accumulate="blackwell_mxf8f6f4"))
        x = torch.randn(16, 64) if layer == "linear" else torch.randn(2, 32, 3, 3)
        seen.clear()
        m(x.requires_grad_()).sum().backward()
        norm = lambda f: f.replace(axis=-1) if isinstance(f, qt.BlockFormat) else f
        got = [{norm(f) for f in fs if f is not None} for _p, fs in seen]
        for pair in GEMM.values():  # every product saw its two per-GEMM formats
            assert any({norm(f) for f in pair} <= g for g in got), (layer, pair, got)
        assert not [(p, fs) for p, fs in seen if any(isinstance(f, GemmOperand) for f in fs)], layer


def test_torch_compile_runs_the_layers_eagerly_same_bits():
    torch.manual_seed(10)
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    qt.convert(m, qt.Recipe(**ROLES, gemm=GEMM))
    x = torch.randn(16, 64, requires_grad=True)
    runs = []
    for f in (m, torch.compile(m)):
        x.grad = None
        m.zero_grad()
        y = f(x)
        y.sum().backward()
        runs.append((plain(y).detach(), plain(x.grad), plain(m[0].weight.grad)))
    for a, b in zip(*runs):
        assert_bits_equal(b, a)


def test_a_weight_that_is_no_qtensor_warns():
    torch.manual_seed(11)
    m = nn.Linear(64, 32)
    qt.convert(m, qt.Recipe(**ROLES, gemm=GEMM))
    with torch.no_grad():
        m._parameters["weight"] = nn.Parameter(m.weight.dequantize().clone())
    with pytest.warns(UserWarning, match="not a QTensor"):
        m(torch.randn(4, 64))

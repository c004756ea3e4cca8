"""The Random Hadamard Transform of Recipe.gemm (qtensor.tensor.transforms.Hadamard): TE's
NVFP4 construction, applied to both operands of a GEMM along K before rounding; checked against
an exact model (an orthogonal transform preserves the product) and bit for bit against an
explicit reference computation."""
import pytest
import torch
from torch import nn

import qtensor as qt
from helpers import assert_bits_equal

torch.set_num_threads(1)

# TE's 16x16 matrix as written in transformer_engine/pytorch/tensor/nvfp4_tensor.py (rows 0-3 of
# the +-1 table; the rest follow by Sylvester's doubling) and its wgrad sign vector
TE_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]
ROLES = dict(weight=qt.fp32, bias=None, activation=qt.fp32, grad=qt.fp32)  # no rounding at all
NV = qt.nvfp4


def plain(t):
    return t.dequantize() if isinstance(t, qt.QTensor) else t


def h16():
    h2 = torch.tensor([[1., 1.], [1., -1.]], dtype=torch.float64)
    h = h2
    for _ in range(3):
        h = torch.kron(h2, h)  # Sylvester: H_2n = H_2 (x) H_n
    return h


def reference_rht(t, axis, signs=TE_SIGNS):
    """The transform written out: each run of 16 along axis as a row vector v -> v diag(s) H / 4,
    summed in float64 one term at a time, rounded once to float32; a shorter tail unchanged."""
    t = t.movedim(axis, 0).to(torch.float64)
    out = t.clone()
    h = h16()
    for b in range(t.shape[0] // 16):
        blk = t[16 * b:16 * b + 16]
        for j in range(16):
            acc = torch.zeros_like(blk[0])
            for i in range(16):
                acc = acc + blk[i] * (signs[i] * h[i, j] / 4)
            out[16 * b + j] = acc
    return out.to(torch.float32).movedim(0, axis)


def test_matrix_is_te_construction_and_orthogonal():
    m = qt.Hadamard().matrix()
    expected = torch.diag(torch.tensor(TE_SIGNS, dtype=torch.float64)) @ h16() * 0.25
    assert torch.equal(m, expected)
    # TE's table, rows 1-3 (the +-1 Hadamard before signs and scaling)
    assert h16()[1].tolist() == [1, -1] * 8 and h16()[2].tolist() == [1, 1, -1, -1] * 4
    assert h16()[3].tolist() == [1, -1, -1, 1] * 4
    assert torch.allclose(m @ m.T, torch.eye(16, dtype=torch.float64), atol=1e-15)
    # seeded signs: reproducible, seed-dependent, +-1; no signs: the plain Hadamard
    a, b, c = qt.Hadamard(signs=3), qt.Hadamard(signs=3), qt.Hadamard(signs=4)
    assert torch.equal(a.matrix(), b.matrix()) and not torch.equal(a.matrix(), c.matrix())
    assert set(a.sign_vector().tolist()) <= {-1.0, 1.0}
    assert torch.equal(qt.Hadamard(32, signs=None).matrix() * 32 ** 0.5,
                       torch.kron(torch.tensor([[1., 1.], [1., -1.]], dtype=torch.float64),
                                  h16()))


def test_apply_bits_equal_the_explicit_reference_with_a_tail():
    torch.manual_seed(0)
    x = torch.randn(40, 5) * torch.logspace(-3, 3, 40)[:, None]  # a tail of 8 along axis 0
    got = qt.Hadamard().apply(x, 0)
    assert_bits_equal(got, reference_rht(x, 0), "rht")
    assert torch.equal(got[32:], x[32:])
    assert_bits_equal(qt.Hadamard().apply(x.T, 1), reference_rht(x, 0).T, "rht axis 1")


def test_hadamard_errors():
    with pytest.raises(ValueError, match="power of two"):
        qt.Hadamard(12)
    with pytest.raises(ValueError, match="16-entry"):
        qt.Hadamard(32)
    with pytest.raises(ValueError, match="seed"):
        qt.Hadamard(signs="random")
    with pytest.raises(TypeError, match="qt.Hadamard"):
        qt.Recipe(**ROLES, gemm={"transform": {"wgrad": "rht"}})
    with pytest.raises(ValueError, match="transform"):
        qt.Recipe(**ROLES, gemm={"transform": {"wgrad2": qt.Hadamard()}})


def run(recipe, x, g, seed=0, in_f=32, out_f=48):
    torch.manual_seed(seed)
    m = nn.Linear(in_f, out_f)
    w = m.weight.detach().clone()
    qt.convert(m, recipe)
    xx = x.clone().requires_grad_()
    y = m(xx)
    y.backward(g)
    return w, plain(y), plain(xx.grad), plain(m.weight.grad)


@pytest.mark.parametrize("tokens", [64, 40])
def test_wgrad_rht_without_rounding_is_the_exact_product(tokens):
    """H orthogonal: (H^T x)^T (H^T dY) = x^T dY, to FP32 tolerance (the transformed operands
    are rounded to float32, so the bits differ: the transform ran)."""
    torch.manual_seed(1)
    x, g = torch.randn(tokens, 32), torch.randn(tokens, 48)
    w, y, gx, gw = run(qt.Recipe(**ROLES, gemm={"transform": {"wgrad": qt.Hadamard()}}), x, g)
    exact = (x.double().T @ g.double()).T.float()
    assert torch.allclose(gw, exact, rtol=1e-5, atol=1e-5)
    _, y0, gx0, gw0 = run(qt.Recipe(**ROLES), x, g)
    assert not torch.equal(gw, gw0)
    assert torch.equal(y, y0) and torch.equal(gx, gx0)  # fprop, dgrad untouched


@pytest.mark.parametrize("gemm", ["fprop", "dgrad"])
def test_other_gemms_rht_without_rounding_is_the_exact_product(gemm):
    torch.manual_seed(1)
    x, g = torch.randn(32, 32), torch.randn(32, 48)
    w, y, gx, gw = run(qt.Recipe(**ROLES, gemm={"transform": {gemm: qt.Hadamard(signs=7)}}), x, g)
    _, y0, gx0, gw0 = run(qt.Recipe(**ROLES), x, g)
    got, ref = (y, y0) if gemm == "fprop" else (gx, gx0)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5) and not torch.equal(got, ref)
    assert torch.equal(gw, gw0)


@pytest.mark.parametrize("tokens", [64, 40])
def test_wgrad_rht_then_nvfp4_bits_equal_the_reference(tokens):
    """With rounding: dW = (q(H^T x)^T q(H^T dY))^T, each operand transformed along the tokens by
    the reference above, then rounded to NVFP4 (post-transform tensor scale) along the tokens."""
    torch.manual_seed(2)
    x, g = torch.randn(tokens, 32), torch.randn(tokens, 48)
    x[3, 5] = 40.0  # an outlier the transform spreads over its block
    recipe = qt.Recipe(**ROLES, gemm={"wgrad": (NV, NV), "transform": {"wgrad": qt.Hadamard()}})
    w, y, gx, gw = run(recipe, x, g)
    xt, gt = reference_rht(x, 0), reference_rht(g, 0)
    ref = (qt.quantize(xt, NV.replace(axis=0)).T @ qt.quantize(gt, NV.replace(axis=0))).T
    assert_bits_equal(gw, ref, "wgrad")
    # without the transform the rounded product is another one
    _, _, _, gw0 = run(qt.Recipe(**ROLES, gemm={"wgrad": (NV, NV)}), x, g)
    assert not torch.equal(gw, gw0)


def test_rht_spreads_a_block_outlier():
    """What it is for ("bound block-level outliers", 2509.25149): a run of 16 with one outlier
    becomes a run whose max is near its RMS (an incoherent block). (It need not lower the
    product's NVFP4 error on Gaussian data: the study measures what it does in training.)"""
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(3))
    x[::16, 0] = 50.0
    def peak(t):  # max |v| / rms over each run of 16 tokens of column 0
        b = t[:, 0].reshape(-1, 16)
        return (b.abs().amax(1) / b.square().mean(1).sqrt()).max()
    assert peak(x) > 3.5 and peak(qt.Hadamard().apply(x, 0)) < 2.0


@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
def test_conv_rht_without_rounding_is_the_exact_product(gemm):
    """Convolutions: along the input channels (fprop), the output channels (dgrad), the batch
    (wgrad); 16 of each so that the transform has full runs."""
    torch.manual_seed(4)
    m = nn.Conv2d(16, 16, 3, padding=1)
    m0 = nn.Conv2d(16, 16, 3, padding=1)
    m0.load_state_dict(m.state_dict())
    qt.convert(m, qt.Recipe(**ROLES, gemm={"transform": {gemm: qt.Hadamard()}}))
    x = torch.randn(16, 16, 5, 5)
    xx, x0 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, y0 = plain(m(xx)), m0(x0)
    y.square().sum().backward()
    y0.square().sum().backward()
    pairs = {"fprop": (y, y0), "dgrad": (plain(xx.grad), x0.grad),
             "wgrad": (plain(m.weight.grad), m0.weight.grad)}
    for name, (got, ref) in pairs.items():
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4), name
        # bits change where the transform ran (and downstream of it: fprop feeds the backward)
        if name == gemm:
            assert not torch.equal(got, ref), name


def test_a_plain_input_warns_that_the_wgrad_transform_does_not_apply():
    m = nn.Linear(32, 16)
    qt.convert(m, qt.Recipe(weight=qt.fp32, activation=None, grad=qt.fp32,
                            gemm={"transform": {"wgrad": qt.Hadamard()}}))
    with pytest.warns(UserWarning, match="transform of its wgrad GEMM does not apply"):
        m(torch.randn(16, 32)).sum().backward()


def test_describe_names_the_transform():
    r = qt.Recipe(**ROLES, gemm={"transform": {"wgrad": qt.Hadamard()}})
    assert "wgrad (x own mm_fmt, dy own mm_fmt, transform Hadamard(16, TE signs))" in r.describe()

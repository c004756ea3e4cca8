"""qtensor.compat.mx: microxcaling's MxSpecs vocabulary, its MX rounding, and the recipe mapping.

The oracle below follows microxcaling's published algorithm (mx/mx_ops.py, mx/elemwise_ops.py):
shared exponent floor(log2(amax)) - emax_elem, elements scaled by 2^(mbits-2-private_exp),
rounded by its formulas (nearest = floor(|a| + 0.5), even, floor), clamped to max_norm; computed in
float64 with the exponent either exact (qtensor.kernels.reference) or via float32 log2 (microxcaling's own).
"""
from __future__ import annotations

import argparse
import collections
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import assert_bits_equal
import qtensor as qt
from qtensor.compat import mx

# name -> (ebits, mbits incl. sign and implicit bit, emax, max_norm), as microxcaling's formats.py
_PARAMS = {
    "fp8_e5m2": (5, 4, 15, 57344.0), "fp8_e4m3": (4, 5, 8, 448.0), "fp6_e3m2": (3, 4, 4, 28.0),
    "fp6_e2m3": (2, 5, 2, 7.5), "fp4_e2m1": (2, 3, 2, 6.0), "int8": (0, 8, 0, 127 / 64),
    "int4": (0, 4, 0, 7 / 4),
}


def _exp_exact(a):
    return (torch.frexp(a)[1] - 1).to(torch.float64)


def _exp_log2(a):  # microxcaling: torch.floor(torch.log2(...)) on float32
    return torch.floor(torch.log2(a.to(torch.float32))).to(torch.float64)


def _round(a, mode):
    s, m = torch.sign(a), a.abs()
    if mode == "nearest":
        return s * torch.floor(m + 0.5)
    if mode == "floor":
        return s * torch.floor(m)
    if mode == "even":
        return s * torch.round(m)
    raise ValueError(mode)


def mx_oracle(x, name, block, mode, exponent=_exp_exact):
    ebits, mbits, emax, max_norm = _PARAMS[name]
    rows, n = x.shape
    b = x.to(torch.float64).reshape(rows, n // block, block)
    amax = b.abs().amax(-1, keepdim=True)
    shared = torch.where(amax > 0, exponent(amax.clamp_min(2.0 ** -126)), torch.zeros_like(amax))
    shared = (shared - emax).clamp(min=-127)
    a = b / 2.0 ** shared
    if ebits:
        pe = torch.where(a != 0, _exp_exact(a.abs().clamp_min(2.0 ** -300)), torch.zeros_like(a))
        pe = pe.clamp(min=2 - 2 ** (ebits - 1))
        unit = 2.0 ** (mbits - 2 - pe)
    else:
        unit = torch.full_like(a, 2.0 ** (mbits - 2))
    q = _round(a * unit, mode) / unit
    q = q.clamp(-max_norm, max_norm) * 2.0 ** shared
    if not ebits:  # documented difference: integer elements give +0.0 where microxcaling has -0.0
        q = q + 0.0
    return q.reshape(rows, n).to(x.dtype)


def _values(shape, gen, lo=-20, hi=20):
    n = torch.Size(shape).numel()
    e = torch.randint(lo, hi + 1, (n,), generator=gen).to(torch.float64)
    m = 1 + torch.rand(n, generator=gen, dtype=torch.float64)
    s = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).to(torch.float64)
    x = (s * m * 2.0 ** e).to(torch.float32)
    # a quarter exact ties of every element format (x.5 in units of a power of two)
    k = torch.randint(-64, 64, (n // 4,), generator=gen).to(torch.float64) + 0.5
    x[: n // 4] = (k * 2.0 ** torch.randint(-8, 8, (n // 4,), generator=gen)).to(torch.float32)
    return x[torch.randperm(n, generator=gen)].reshape(shape)


@pytest.mark.parametrize("name", list(_PARAMS))
@pytest.mark.parametrize("round", ["nearest", "even", "floor"])
def test_quantize_mx_matches_microxcaling_algorithm(name, round):
    gen = torch.Generator().manual_seed(len(name) * 7 + len(round))
    x = _values((256, 512), gen)
    ours = mx.quantize_mx(x, name, 32, axis=-1, round=round)
    assert_bits_equal(ours, mx_oracle(x, name, 32, round), f"MX {name} round={round}", inputs=x)
    # the same along another axis, through microxcaling's quantize_mx_op signature
    specs = {"block_size": 16, "a_elem_format": name}
    ours_t = mx.quantize_mx_op(x.T.contiguous(), specs, elem_format=name, axes=[0], round=round)
    assert_bits_equal(ours_t.T, mx_oracle(x, name, 16, round), f"axis 0 {name} round={round}")


def test_shared_exponent_follows_design_not_log2():
    x = torch.tensor([[1048575.9375, 4.0]])  # 2^20 - 2^-4: log2 in float32 rounds up to 20
    ours = mx.quantize_mx(x, "fp8_e4m3", 32)
    assert ours.tolist() == [[917504.0, 4.0]]
    assert mx_oracle(x, "fp8_e4m3", 2, "nearest", _exp_log2).tolist() == [[1048576.0, 8.0]]
    # and agreement with microxcaling's own log2 exponent wherever log2 is exact
    gen = torch.Generator().manual_seed(0)
    x = _values((512, 256), gen)
    amax = x.abs().reshape(512, 8, 32).amax(-1)
    assert torch.equal(_exp_exact(amax.double()), _exp_log2(amax)), "draw without such blocks"
    assert_bits_equal(mx.quantize_mx(x, "fp6_e3m2", 32),
                      mx_oracle(x, "fp6_e3m2", 32, "nearest", _exp_log2), "log2-safe data")


def test_dither_is_unbiased_and_seeded():
    x = torch.tensor([[0.3, -0.71, 1.0 / 3, 2.9, -5.55, 0.01, 4.0, 0.2]]).repeat(20000, 1)
    torch.manual_seed(0)
    q = mx.quantize_mx(x, "fp4_e2m1", 8, round="dither")
    err = (q.double().mean(0) - x[0].double()).abs()
    se = q.double().std(0) / 20000 ** 0.5
    assert bool((err <= 5 * se + 1e-12).all()), (err, se)
    torch.manual_seed(0)
    assert_bits_equal(mx.quantize_mx(x, "fp4_e2m1", 8, round="dither"), q, "seeded")


def test_names_and_errors():
    assert mx.rounding("nearest") == "nearest_away" and mx.rounding("even") == "nearest"
    assert mx.rounding("floor") == "toward_zero" and mx.rounding("dither") == "stochastic"
    assert mx.elem_format("FP4") == qt.fp4_e2m1 and mx.elem_format("int8") == qt.mxint8.elem
    assert mx.mx_format("fp8_e4m3", 32, "even") == qt.mxfp8_e4m3
    assert mx.mx_format("int8", 32, "even") == qt.mxint8
    assert mx.scale_format(0) == qt.e8m0
    assert mx.mx_format("fp6_e2m3", 0).block_size is None  # 0: the whole axis
    assert mx.mx_format("fp6_e2m3", 32, shared_exp_method="none").block_size == 1
    with pytest.raises(ValueError, match="element format"):
        mx.elem_format("fp5")
    with pytest.raises(ValueError, match="dither"):
        mx.rounding("stochastic")
    with pytest.raises(KeyError, match="unknown MX spec"):
        mx.recipe({"w_elem_fmt": "fp8_e4m3"})
    with pytest.raises(ValueError, match="both"):
        mx.vector_format({"bfloat": 16, "fp": 16})


def test_vector_format_and_elemwise():
    assert mx.vector_format({"bfloat": 16}) == qt.FloatFormat(8, 7, rounding="nearest_away")
    assert mx.vector_format({"bfloat": 16, "round": "even"}) == qt.bf16
    assert mx.vector_format({"fp": 16, "round": "even"}) == qt.fp16
    assert mx.vector_format({"bfloat": 12}) == qt.FloatFormat(8, 3, rounding="nearest_away")
    assert mx.vector_format({"bfloat": 0}) is None
    x = torch.randn(1000)
    assert_bits_equal(mx.quantize_elemwise_op(x, {"bfloat": 16, "round": "even"}),
                      x.to(torch.bfloat16).float(), "bf16 ties to even = torch's cast")


def test_finalize_like_microxcaling():
    s = mx.finalize_mx_specs({"w_elem_format": "fp4_e2m1", "a_elem_format": "fp6_e3m2",
                              "a_elem_format_bp_os": "fp8_e5m2", "round": "even",
                              "round_grad_input": "dither"})
    assert s["w_elem_format_bp"] == "fp4_e2m1" and s["a_elem_format_bp"] == "fp6_e3m2"
    assert s["a_elem_format_bp_ex"] == "fp6_e3m2" and s["a_elem_format_bp_os"] == "fp8_e5m2"
    assert s["round_output"] == "even" and s["round_mx_output"] == "even"
    assert s["round_mx_grad_output_grad_input"] == "dither" and s["block_size"] == 0


def _specs():
    """bfloat16 vector ops with ties to even, MX operands with microxcaling's 'nearest' (away)."""
    mx_rounding = ("round_mx_output", "round_mx_input_grad_input", "round_mx_weight_grad_input",
                   "round_mx_grad_output_grad_input", "round_mx_input_grad_weight",
                   "round_mx_grad_output_grad_weight")
    return dict({"w_elem_format": "fp4_e2m1", "a_elem_format": "fp6_e3m2", "block_size": 32,
                 "bfloat": 16, "round": "even", "custom_cuda": False},
                **{k: "nearest" for k in mx_rounding})


def test_recipe_roles():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # this spec needs no approximation
        r = mx.recipe(_specs())
    bf16_even = qt.bf16
    mx_near = lambda f: qt.BlockFormat(f, 32, rounding="nearest_away")
    assert r.weight.fmt == bf16_even and r.weight.mm_fmt == mx_near(qt.fp4_e2m1)
    assert r.bias.fmt == bf16_even and r.bias.mm_fmt is None
    assert r.activation.fmt == bf16_even and r.activation.mm_fmt == mx_near(qt.fp6_e3m2)
    # grad operand: a_elem_format_bp_os (derived from a_elem_format), round_mx_grad_output_grad_input
    assert r.grad.fmt == bf16_even and r.grad.mm_fmt == mx_near(qt.fp6_e3m2)
    assert r.master_weights and r.optimizer_state.full_precision
    # the same from an MxSpecs-like UserDict and from an argparse Namespace
    assert mx.recipe(collections.UserDict(_specs())) == r
    assert mx.recipe(argparse.Namespace(**_specs())) == r
    # no bfloat: FP32 values with MX operands, no master copy
    r32 = mx.recipe({"w_elem_format": "int8", "a_elem_format": "int8", "block_size": 32})
    assert r32.weight.fmt == qt.fp32 and r32.weight.mm_fmt == qt.mxint8.replace(
        rounding="nearest_away") and not r32.master_weights
    dither = mx.recipe({"a_elem_format": "fp8_e4m3", "block_size": 32, "round": "dither"})
    assert dither.activation.mm_fmt == qt.mxfp8_e4m3.replace(rounding="stochastic")
    assert dither.grad.mm_fmt.rounding == "stochastic" and dither.weight.full_precision
    # the _bp formats and per-product roundings: per-GEMM formats, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bp = mx.recipe(dict(_specs(), w_elem_format_bp="fp8_e4m3"))
        rnd = mx.recipe(dict(_specs(), round_mx_weight_grad_input="even"))
    assert bp.gemm["linear"].dgrad_w == mx_near(qt.fp8_e4m3) and bp.gemm["conv"] is None
    assert rnd.gemm["linear"].dgrad_w == qt.BlockFormat(qt.fp4_e2m1, 32, rounding="nearest")
    assert r.gemm is None  # nothing differs from the roles
    with pytest.warns(UserWarning, match="a_elem_format_bp"):  # activation x activation matmul
        mx.recipe(dict(_specs(), a_elem_format_bp="fp8_e4m3"))
    with pytest.warns(UserWarning, match="round_grad_weight"):
        mx.recipe(dict(_specs(), round_grad_weight="dither"))
    with pytest.warns(UserWarning, match="quantize_backprop"):
        assert mx.recipe(dict(_specs(), quantize_backprop=False)).grad.full_precision


def test_recipe_on_a_model():
    """qt.convert with the recipe reproduces microxcaling's MX Linear, forward and both gradients:
    y = bfloat(MX_a(bfloat(x)) @ MX_w(bfloat(W)).T), MX blocks along each product's reduction."""
    if not hasattr(qt, "convert"):
        pytest.skip("qt.convert is not available yet")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32, bias=False))
    w = model[0].weight.detach().clone()
    x = torch.randn(8, 64)
    qt.convert(model, mx.recipe(_specs()))
    weight = model[0].weight
    assert isinstance(weight, qt.QTensor) and weight.fmt == qt.bf16
    assert weight.mm_fmt == qt.BlockFormat(qt.fp4_e2m1, 32, rounding="nearest_away")
    out = model(x)
    y = out.dequantize() if isinstance(out, qt.QTensor) else out
    bf = lambda t: t.to(torch.bfloat16).float()  # round="even": torch's ties-to-even cast
    xa = mx.quantize_mx(bf(x), "fp6_e3m2", 32, axis=-1, round="nearest")
    wa = mx.quantize_mx(bf(w), "fp4_e2m1", 32, axis=-1, round="nearest")
    assert_bits_equal(y, bf(xa @ wa.T), "MX Linear forward")
    out.sum().backward()
    g = model[0].weight.grad
    assert g is not None
    g = g.dequantize() if isinstance(g, qt.QTensor) else g
    # microxcaling: grad_W = bfloat(MX_bp_ex(grad_y along batch).T @ MX_bp(bfloat(x) along batch))
    ones = torch.ones(8, 32)
    xb = mx.quantize_mx(bf(x), "fp6_e3m2", 32, axis=0, round="nearest")
    assert_bits_equal(g, bf(ones.T @ xb), "MX Linear weight gradient")
    # grad_x = bfloat(MX_bp_os(grad_y along out features) @ MX_w_bp(bfloat(W) along dim 0))
    gx = _x_grad(model, x)
    wb = mx.quantize_mx(bf(w), "fp4_e2m1", 32, axis=0, round="nearest")
    assert_bits_equal(gx, bf(ones @ wb), "MX Linear input gradient")


def _x_grad(model, x):
    x = x.clone().requires_grad_(True)
    model(x).sum().backward()
    return x.grad.dequantize() if isinstance(x.grad, qt.QTensor) else x.grad


def _bp_specs():
    """Every operand of the three GEMMs in its own MX format, with its own rounding."""
    return dict(_specs(), w_elem_format="fp6_e3m2", a_elem_format="fp8_e4m3",
                w_elem_format_bp="fp4_e2m1", a_elem_format_bp_os="fp8_e5m2",
                a_elem_format_bp="int8", a_elem_format_bp_ex="fp6_e2m3",
                round_mx_weight_grad_input="floor", round_mx_grad_output_grad_input="even",
                round_mx_input_grad_weight="even", round_mx_grad_output_grad_weight="floor")


def test_recipe_bp_keys_exact_on_a_model():
    """Every *_bp key (and per-product rounding) as mx/linear.py uses it: forward MX_a(x) @
    MX_w(W).T along in_features; grad_input MX_bp_os(dY) @ MX_w_bp(W) along out_features;
    grad_weight MX_bp_ex(dY).T @ MX_bp(x) along the batch; bfloat16 between them."""
    s = _bp_specs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = mx.recipe(s)
    # the only approximation left: a_elem_format_bp in contractions of two activations
    (only,) = [str(w.message) for w in caught]
    assert "contractions of two activations" in only and "_bp_os" not in only
    assert "w_elem_format_bp" not in only and "_bp_ex" not in only
    torch.manual_seed(0)
    model = nn.Linear(64, 32, bias=False)
    w = model.weight.detach().clone()
    qt.convert(model, r)
    x = torch.randn(32, 64, requires_grad=True)
    out = model(x)
    g = torch.randn(32, 32)
    out.backward(g)
    bf = lambda t: t.to(torch.bfloat16).float()
    Q = lambda t, key, axis, rnd: mx.quantize_mx(t, s[key], 32, axis=axis, round=s[rnd])
    xb, wb, gb = bf(x.detach()), bf(w), bf(g)
    y = bf(Q(xb, "a_elem_format", -1, "round_mx_output")
           @ Q(wb, "w_elem_format", -1, "round_mx_output").T)
    gx = bf(Q(gb, "a_elem_format_bp_os", -1, "round_mx_grad_output_grad_input")
            @ Q(wb, "w_elem_format_bp", 0, "round_mx_weight_grad_input"))
    gw = bf((Q(xb, "a_elem_format_bp", 0, "round_mx_input_grad_weight").T
             @ Q(gb, "a_elem_format_bp_ex", 0, "round_mx_grad_output_grad_weight")).T)
    plain = lambda t: t.dequantize() if isinstance(t, qt.QTensor) else t
    assert_bits_equal(plain(out), y, "forward")
    assert_bits_equal(plain(x.grad), gx, "grad_input")
    assert_bits_equal(plain(model.weight.grad), gw, "grad_weight")


def test_recipe_conv_as_mx_convolution():
    """mx/convolution.py quantizes all three products with the forward element formats and
    quantize_mx_op's default 'nearest' rounding, whatever round_mx_* and the _bp keys say."""
    s = dict(_specs(), round_mx_output="even", w_elem_format_bp="fp8_e4m3",
             a_elem_format_bp_os="fp8_e5m2")
    r = mx.recipe(s, warn=False)
    assert r.gemm["conv"] is not None and r.gemm["linear"] is not None
    torch.manual_seed(0)
    conv = nn.Conv2d(32, 32, 3, padding=1, bias=False)
    w = conv.weight.detach().clone()
    qt.convert(conv, r)
    x = torch.randn(2, 32, 5, 5, requires_grad=True)
    y = conv(x)
    g = torch.randn(y.shape)
    y.backward(g)
    bf = lambda t: t.to(torch.bfloat16).float()
    Q = lambda t, key, axis: mx.quantize_mx(t, s[key], 32, axis=axis, round="nearest")
    xb, wb, gb = bf(x.detach()), bf(w), bf(g)
    plain = lambda t: t.dequantize() if isinstance(t, qt.QTensor) else t
    assert_bits_equal(plain(y), bf(F.conv2d(Q(xb, "a_elem_format", 1), Q(wb, "w_elem_format", 1),
                                            padding=1)), "forward")
    gi = torch.nn.grad.conv2d_input(x.shape, Q(wb, "w_elem_format", 0),
                                    Q(gb, "a_elem_format", 1), padding=1)
    assert_bits_equal(plain(x.grad), bf(gi), "grad_input")
    gw = torch.nn.grad.conv2d_weight(Q(xb, "a_elem_format", 0), w.shape,
                                     Q(gb, "a_elem_format", 0), padding=1)
    assert_bits_equal(plain(conv.weight.grad), bf(gw), "grad_weight")

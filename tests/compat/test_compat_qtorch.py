"""qtensor.compat.qtorch against QPyTorch 0.3.0 itself, and against oracles of its arithmetic.

Bit-exact on 2^20 finite values per format with rounding="nearest" (exact ties included), against
bit-level oracles of QPyTorch's CPU kernels that are themselves checked against qtorch where it is
installed (tests that need qtorch itself skip when it is not importable); the
documented deliberate differences are excluded by construction: no NaN inputs, zeros compared
without their sign (QPyTorch drops -0), no man=23. Stochastic rounding: means agree within
standard errors. The wrappers (quantizer, Quantizer, OptimLP) are compared on a tiny model.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from helpers import assert_bits_equal
import qtensor as qt
import qtensor.compat.qtorch as C

N = 1 << 20


@pytest.fixture(scope="module")
def Q_or_none():
    """QPyTorch's qtorch.quant, or None (its first import builds a CPU extension, ~30 s)."""
    try:
        import qtorch.quant as quant
    except Exception:  # not installed, or its extension cannot be built here
        return None
    return quant


@pytest.fixture(scope="module")
def Q(Q_or_none):
    if Q_or_none is None:
        pytest.skip("qtorch 0.3.0 is not importable (pip install qtorch==0.3.0; needs ninja and "
                    "a C++ compiler)")
    return Q_or_none


# ---------------------------------------------------------------------------------------------
# Oracles: QPyTorch 0.3.0's CPU nearest-rounding arithmetic, re-derived on bit patterns, so that
# the bit-exact tests also run where qtorch is not installed (and are checked against it where it
# is). Bits are uint32 values held in int64.

def _bits(x):
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _from_bits(b):
    b = b & 0xFFFFFFFF
    return (b - ((b >> 31) << 32)).to(torch.int32).view(torch.float32)


def _round_bits(b, man):
    """QPyTorch's round_bitwise, nearest: add half a unit of the kept mantissa, truncate."""
    return (b + (1 << (22 - man))) & ~((1 << (23 - man)) - 1) & 0xFFFFFFFF


def oracle_float(x, exp, man):
    b = _bits(x)
    emin = 2 - 2 ** (exp - 1)
    top = 127 + 2 ** (exp - 1)  # biased exponent of the largest binade (no Inf/NaN code)
    n = _round_bits(b, man)
    over = (((n & 0x7FFFFFFF) >> 23) > top) & (n != 0)
    max_bits = (top << 23) | (((1 << man) - 1) << (23 - man))
    n = torch.where(over, (b & 0x80000000) | max_bits, n)
    # below 2^emin: x + sign(x)*2^emin in float32, rounded the same way, shift removed
    shift = torch.where((b >> 31) == 1, -(2.0 ** emin), 2.0 ** emin).to(torch.float32)
    sub = _from_bits(_round_bits(_bits(x + shift), man)) - shift
    return torch.where(((b >> 23) & 0xFF) - 127 < emin, sub, _from_bits(n))


def oracle_fixed(x, wl, fl, clamp, symmetric):
    y = x * 2.0 ** fl
    k = torch.round((y + 0.5).double() - 0.5).float()  # nearbyint((y + 0.5f) - 0.5)
    q = k * 2.0 ** -fl
    if clamp:
        t_min = -(2.0 ** (wl - fl - 1))
        t_max = -t_min - 2.0 ** -fl
        t_min += 2.0 ** -fl if symmetric else 0.0
        q = torch.clamp(q, t_min, t_max)
    return q


def oracle_block(x, wl, dim):
    if dim == -1:
        m = x.abs().max().expand_as(x)
    else:
        other = [d for d in range(x.dim()) if d != dim % x.dim()]
        m = x.abs().amax(dim=other, keepdim=True).expand_as(x) if other else x.abs()
    max_exp = _bits(m) & 0x7F800000  # 2^e of the block's largest magnitude, as bits
    base = _from_bits(max_exp) * 6  # 1.5 * 2^(e+2)
    q = _from_bits(_round_bits(_bits(x + base), wl)) - base
    qb = _bits(q)
    max_man = ((1 << (wl - 2)) - 1) << (25 - wl)
    clipped = _from_bits((qb & 0x80000000) | max_exp | max_man)
    return torch.where((qb & 0x7F800000) > max_exp, clipped, q)


def check(ours, oracle, Q_or_none, theirs_fn, x, msg):
    """ours == oracle; and, where QPyTorch is installed, oracle == QPyTorch."""
    if Q_or_none is not None:
        assert_same(oracle, theirs_fn(Q_or_none), x, msg + " (oracle vs qtorch)")
    assert_same(ours, oracle, x, msg)


def _floats(n, lo, hi, gen):
    """float32 values with exponents uniform in [lo, hi], random mantissas and signs."""
    e = torch.randint(lo, hi + 1, (n,), generator=gen)
    m = torch.randint(0, 1 << 23, (n,), generator=gen)
    s = torch.randint(0, 2, (n,), generator=gen)
    biased = (e + 127).clamp(0, 254)
    return ((s << 31) | (biased << 23) | m).to(torch.int32).view(torch.float32)


def _with_ties(x, keep_bits, gen):
    """Half of x replaced by exact ties: mantissa cut after keep_bits bits, plus half a unit."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    low = 23 - keep_bits
    tie = (bits >> low << low) | (1 << (low - 1))
    pick = torch.rand(x.shape, generator=gen) < 0.5
    return torch.where(pick, tie, bits).to(torch.int32).view(torch.float32)


def _no_signed_zero(t):
    return torch.where(t == 0, torch.zeros_like(t), t)


def assert_same(ours, theirs, x, msg):
    assert_bits_equal(_no_signed_zero(ours), _no_signed_zero(theirs), msg, inputs=x)


# ---------------------------------------------------------------------------------------------
# Bit-exact against QPyTorch, rounding="nearest"

@pytest.mark.parametrize("exp,man", [(8, 7), (5, 10), (4, 3), (5, 2), (3, 2), (2, 1), (6, 9)])
def test_float_quantize_nearest_bit_exact(Q_or_none, exp, man):
    gen = torch.Generator().manual_seed(exp * 100 + man)
    emin, emax = 2 - 2 ** (exp - 1), 2 ** (exp - 1)
    # from below the smallest subnormal to past the largest value (saturation) or float32's max
    x = _floats(N, emin - man - 3, min(emax + 1, 127), gen)
    x = _with_ties(x, man, gen)  # ties in the normal range, and (shifted) in the subnormal one
    ours = C.float_quantize(x, exp, man, rounding="nearest")
    check(ours, oracle_float(x, exp, man), Q_or_none,
          lambda Q: Q.float_quantize(x, exp, man, rounding="nearest"), x, f"e{exp}m{man}")


@pytest.mark.parametrize("wl,fl,clamp,symmetric", [
    (8, 4, True, False), (8, 4, True, True), (16, 8, True, False), (4, 2, False, False),
    (24, 20, True, True), (12, 14, True, False), (30, 10, True, False), (2, 1, True, True)])
def test_fixed_point_quantize_nearest_bit_exact(Q_or_none, wl, fl, clamp, symmetric):
    gen = torch.Generator().manual_seed(wl * 1000 + fl)
    x = _floats(N, -fl - 3, wl - fl + 1, gen)
    # exact ties k + 1/2 (in units of 2^-fl), where QPyTorch's CPU kernel rounds to even
    k = torch.randint(-(1 << min(wl, 22)), 1 << min(wl, 22), (N // 4,), generator=gen)
    x[: N // 4] = ((k.double() + 0.5) * 2.0 ** -fl).float()
    ours = C.fixed_point_quantize(x, wl, fl, clamp, symmetric, rounding="nearest")
    check(ours, oracle_fixed(x, wl, fl, clamp, symmetric), Q_or_none,
          lambda Q: Q.fixed_point_quantize(x, wl, fl, clamp, symmetric, rounding="nearest"), x,
          f"fixed wl={wl} fl={fl} clamp={clamp} symmetric={symmetric}")


@pytest.mark.parametrize("wl,shape,dim", [
    (2, (1024, 1024), -1), (8, (1024, 1024), -1), (16, (1024, 1024), -1), (4, (1024, 1024), 0),
    (22, (1024, 1024), 0), (4, (1024, 1024), 1), (12, (1024, 1024), 1), (4, (1024, 1024), -2),
    (3, (16, 256, 256), 1), (8, (16, 256, 256), 1), (8, (256, 64, 64), 2), (16, (N,), 0)])
def test_block_quantize_nearest_bit_exact(Q_or_none, wl, shape, dim):
    gen = torch.Generator().manual_seed(wl)
    x = _floats(N, -20, 20, gen)
    # exact ties: multiples of half a step of a block whose max exponent is about 10
    k = torch.randint(-(1 << wl), 1 << wl, (N // 4,), generator=gen)
    x[: N // 4] = k.float() * 2.0 ** (10 + 1 - wl)
    x = x[torch.randperm(N, generator=gen)].reshape(shape)
    ours = C.block_quantize(x, wl, dim, rounding="nearest")
    check(ours, oracle_block(x, wl, dim), Q_or_none,
          lambda Q: Q.block_quantize(x, wl, dim, rounding="nearest"), x,
          f"block wl={wl} shape={shape} dim={dim}")


# ---------------------------------------------------------------------------------------------
# Known values and the documented differences (no QPyTorch needed)

def test_known_values():
    x = torch.tensor([500.0, -1e9, 0.3, float("inf")])
    assert C.float_quantize(x, 4, 3, "nearest").tolist() == [480.0, -480.0, 0.3125, 480.0]
    assert C.float_quantize(torch.tensor([2e5]), 5, 2, "nearest").item() == 114688.0
    # ties away from zero in floats, to even in fixed point (QPyTorch's CPU kernels)
    assert C.float_quantize(torch.tensor([1.125, -1.375]), 4, 2, "nearest").tolist() == [1.25, -1.5]
    assert C.fixed_point_quantize(torch.tensor([0.5, 1.5, -2.5]), 8, 0, rounding="nearest").tolist() \
        == [0.0, 2.0, -2.0]
    assert C.fixed_point_quantize(torch.tensor([100.0, -100.0]), 8, 4, rounding="nearest").tolist() \
        == [7.9375, -8.0]
    assert C.fixed_point_quantize(torch.tensor([-100.0]), 8, 4, symmetric=True,
                                  rounding="nearest").item() == -7.9375
    assert C.fixed_point_quantize(torch.tensor([100.3]), 8, 4, clamp=False,
                                  rounding="nearest").item() == 100.3125
    # block: step 2^(e+2-wl); max 100, wl=4 -> 96; negative ties go toward +inf
    assert C.block_quantize(torch.tensor([100.0, 1.0]), 4, rounding="nearest").tolist() == [96.0, 0.0]
    assert C.block_quantize(torch.tensor([-1.5, 4.0, 1.5, -0.5, 0.5]), 4,
                            rounding="nearest").tolist() == [-1.0, 4.0, 2.0, 0.0, 1.0]
    # dim: one shared exponent per index along dim
    y = C.block_quantize(torch.tensor([[100.0, 1.0], [0.75, 0.1]]), 4, 0, "nearest")
    assert y.tolist() == [[96.0, 0.0], [0.75, 0.125]]


def test_documented_differences():
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([nan, -0.0, -1e-30, 1.0000001, -3.0])
    y = C.float_quantize(x, 4, 3, "nearest")
    assert math.isnan(y[0]) and str(y[1].item()) == "-0.0" and str(y[2].item()) == "-0.0"
    # man=23: no sign flip; exp=8 overflows to Inf as QPyTorch's float32 carry does
    assert C.float_quantize(x, 8, 23, "nearest")[3:].tolist() == [1.0000001192092896, -3.0]
    assert C.float_quantize(torch.tensor([3.4e38, -inf]), 8, 7, "nearest").tolist() == [inf, -inf]
    # a block holding Inf or NaN is all NaN
    assert torch.isnan(C.block_quantize(torch.tensor([1.0, inf]), 8, rounding="nearest")).all()


def test_stochastic_reproducible_under_manual_seed():
    x = torch.randn(1000)
    for f in (lambda t: C.float_quantize(t, 5, 2), lambda t: C.fixed_point_quantize(t, 8, 4),
              lambda t: C.block_quantize(t, 6)):
        torch.manual_seed(3)
        a = f(x)
        torch.manual_seed(3)
        assert_bits_equal(f(x), a, "same seed, same result")


def test_submodule_layout():
    from qtensor.compat.qtorch import BlockFloatingPoint, FixedPoint, FloatingPoint
    from qtensor.compat.qtorch.quant import (Quantizer, block_quantize, fixed_point_quantize,
                                             float_quantize, quantizer)
    from qtensor.compat.qtorch.optim import OptimLP
    from qtensor.compat.qtorch.number import FloatingPoint as F2
    from qtensor.compat.qtorch.auto_low import lower, sequential_lower
    import qtensor.compat.qtorch.quant as quant_mod
    assert F2 is FloatingPoint and quant_mod.float_quantize is float_quantize
    assert FloatingPoint(8, 7).format == qt.FloatFormat(8, 7, rounding="nearest_away")
    assert FloatingPoint(4, 3).format == qt.FloatFormat(4, 3, specials="none",
                                                        rounding="nearest_away")
    with pytest.raises(AssertionError):  # QPyTorch reports bad arguments with assert
        FloatingPoint(9, 2)
    with pytest.raises(ValueError, match="rounding"):
        float_quantize(torch.ones(2), 5, 2, rounding="even")


# ---------------------------------------------------------------------------------------------
# Stochastic rounding: the same distribution as QPyTorch's

def _mean_agree(ours, theirs, what):
    n = ours.shape[0]
    mo, mt = ours.double().mean(0), theirs.double().mean(0)
    se = torch.sqrt(ours.double().var(0) / n + theirs.double().var(0) / n)
    z = ((mo - mt).abs() / se.clamp_min(1e-30))
    assert bool((z < 5).all()), f"{what}: means differ by {z.max().item():.1f} standard errors"


@pytest.mark.parametrize("kind", ["float", "fixed", "block"])
def test_stochastic_means_agree(Q, kind):
    torch.manual_seed(0)
    reps = 20000
    base = torch.tensor([0.3, -0.71, 1.0 / 3, 2.9, -5.55, 0.01, 7.0, -0.0625 * 3.3])
    x = base.repeat(reps, 1).contiguous()
    if kind == "float":
        ours, theirs = C.float_quantize(x, 5, 2), Q.float_quantize(x, 5, 2)
    elif kind == "fixed":
        ours, theirs = C.fixed_point_quantize(x, 6, 2), Q.fixed_point_quantize(x, 6, 2)
    else:  # one block per row (dim=0): every row the same block
        ours, theirs = C.block_quantize(x, 4, 0), Q.block_quantize(x, 4, 0)
    _mean_agree(ours, theirs, kind)
    _mean_agree(ours, x, kind + " vs x")  # unbiased: no value here saturates


# ---------------------------------------------------------------------------------------------
# quantizer / Quantizer / OptimLP against QPyTorch's on a tiny model

def _numbers(mod):
    return [mod.FloatingPoint(5, 4), mod.FixedPoint(8, 4), mod.BlockFloatingPoint(6, 0),
            mod.FloatingPoint(8, 3)]


def test_quantizer_forward_backward(Q):
    import qtorch
    torch.manual_seed(1)
    x0 = torch.randn(64, 16) * 4
    w = torch.randn(64, 16)
    ours_n, theirs_n = _numbers(C), _numbers(qtorch)
    for i in range(len(ours_n)):
        j = (i + 1) % len(ours_n)
        for kw in ({}, {"clamping_grad_zero": True}):
            if kw and not isinstance(ours_n[i], C.FixedPoint):
                continue
            grads, outs = [], []
            for quantizer, nums in ((C.quantizer, ours_n), (Q.quantizer, theirs_n)):
                q = quantizer(nums[i], nums[j], "nearest", "nearest", **kw)
                x = x0.clone().requires_grad_(True)
                y = q(x)
                (y * w).sum().backward()
                outs.append(y.detach())
                grads.append(x.grad)
            assert_same(outs[0], outs[1], x0, f"forward {ours_n[i]} {kw}")
            assert_same(grads[0], grads[1], w, f"backward {ours_n[j]} {kw}")
    # QPyTorch's own number objects are accepted too (a script that kept `from qtorch import ...`)
    assert_same(C.quantizer(qtorch.BlockFloatingPoint(5, 0), None, "nearest")(x0),
                Q.block_quantize(x0, 5, 0, "nearest"), x0, "qtorch numbers")
    m = C.Quantizer(C.FloatingPoint(4, 3), C.FloatingPoint(5, 2), "nearest", "nearest")
    assert_same(m(x0), Q.Quantizer(qtorch.FloatingPoint(4, 3), None, "nearest")(x0), x0, "Quantizer")


def _tiny_model(mod, quant_mod):
    act = quant_mod.Quantizer(mod.FixedPoint(8, 4), mod.FloatingPoint(5, 2), "nearest", "nearest")
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(8, 16), act, nn.ReLU(), nn.Linear(16, 3))


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_optimlp_training_matches(Q, opt):
    import qtorch
    import qtorch.optim
    results = []
    gen = torch.Generator().manual_seed(5)
    data, target = torch.randn(32, 8, generator=gen), torch.randint(0, 3, (32,), generator=gen)
    for mod, quant_mod, optim_mod in ((C, C.quant, C.optim), (qtorch, Q, qtorch.optim)):
        model = _tiny_model(mod, quant_mod)
        if opt == "sgd":
            base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
        else:
            base = torch.optim.Adam(model.parameters(), lr=0.01)
        mk = lambda n: quant_mod.quantizer(n, None, "nearest", "nearest")
        optimizer = optim_mod.OptimLP(
            base, weight_quant=mk(mod.FixedPoint(12, 8)), grad_scaling=2.0,
            grad_quant=mk(mod.FloatingPoint(5, 6)), momentum_quant=mk(mod.FloatingPoint(6, 9)),
            acc_quant=mk(mod.FloatingPoint(8, 12)))
        for _ in range(5):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(data), target).backward()
            optimizer.step()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert_same(a, b, None, f"parameters after 5 {opt} steps")


def test_sequential_lower_and_state_dict():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    low = C.sequential_lower(model, ["linear"], C.FloatingPoint(4, 3), None, "nearest")
    assert isinstance(low[0], nn.Sequential) and isinstance(low[0][1], C.Quantizer)
    y = low(torch.randn(3, 4))
    assert torch.equal(y, C.float_quantize(y, 4, 3, "nearest"))
    opt = C.OptimLP(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                    momentum_quant=C.quantizer(C.FloatingPoint(5, 2), None, "nearest"))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert len(sd["state"]) == 4 and "momentum_buffer" in sd["state"][0]


def test_block_ties_at_the_top(Q_or_none):
    # block max 15.5 (e=3), wl=4: step 2, max 14; 15 is the tie between 14 and 16 (clamped)
    x = torch.tensor([15.5, 15.0, -15.0, -13.0, 13.0, -1.0, 1.0, 3.0, -3.0])
    for dim, xx in ((-1, x), (0, x.reshape(1, -1)), (1, x.reshape(1, -1))):
        check(C.block_quantize(xx, 4, dim, "nearest"), oracle_block(xx, 4, dim), Q_or_none,
              lambda Q: Q.block_quantize(xx, 4, dim, "nearest"), xx, f"dim={dim}")


def test_optimlp_other_optimizers_round_their_state():
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    q = C.quantizer(C.FloatingPoint(3, 2), None, "nearest")
    opt = C.OptimLP(torch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.5),
                    momentum_quant=q)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 6)).pow(2).sum().backward()
        opt.step()
    state = opt.optim.state[model.weight]
    for key in ("square_avg", "momentum_buffer"):
        assert torch.equal(state[key], C.float_quantize(state[key], 3, 2, "nearest")), key

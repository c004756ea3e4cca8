"""IEEE P3109 formats, the UE5M3 scale and the block presets that use them, bit for bit against
independent oracles: gfloat's format_info_p3109 / round_float (every code point, every midpoint,
the floats next to each midpoint, out-of-range values), and tests/oracles.py (UE5M3 from its PTX
definition, blocks)."""
import math

import numpy as np
import pytest
import torch

import qtensor as qt
from qtensor.kernels import reference
from qtensor.formats.base import FormatError

from oracles import float_codes, quantize_block, round_float

gfloat = pytest.importorskip("gfloat")
from gfloat.formats import format_info_p3109  # noqa: E402
from gfloat.types import Domain, RoundMode, Signedness  # noqa: E402

_MODES = {"nearest": RoundMode.TiesToEven, "nearest_away": RoundMode.TiesToAway,
          "toward_zero": RoundMode.TowardZero}
P3109_8 = [(p, s, d) for s in (True, False) for p in range(1, 8 if s else 9)
           for d in ("extended", "finite")]


def _gfloat_info(k, p, signed, domain):
    return format_info_p3109(k, p, Signedness.Signed if signed else Signedness.Unsigned,
                             Domain.Extended if domain == "extended" else Domain.Finite)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """float32 bits with every NaN the same (the formats' NaN has no payload to compare)."""
    t = t.to(torch.float32)
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t).view(torch.int32)


def _probes(values):
    """The values, the midpoints between neighbours (ties), the float32s next to each midpoint,
    and past the ends: what every rounding must decide."""
    v = sorted(set(values))
    out = list(v)
    for a, b in zip(v, v[1:]):
        m = np.float32((a + b) / 2)  # exact: neighbours of an 8-bit format are float32s
        out += [float(m), float(np.nextafter(m, np.float32(np.inf))),
                float(np.nextafter(m, np.float32(-np.inf)))]
    top = v[-1]
    out += [top * 1.0625, top * 1.5, top * 2, top * 3, math.inf, -math.inf, 1e-45, 3e38]
    return out


def _check_against(fmt, fi, xs, mode, sat):
    x = torch.tensor(xs, dtype=torch.float32)
    want = torch.tensor([fi_round(fi, v, mode, sat) for v in x.tolist()], dtype=torch.float32)
    f = fmt.replace(saturate=sat)
    for got in (qt.quantize(x, f, rounding=mode),                       # the kernels
                reference.quantize(x.double(), f, rounding=mode)):    # the reference, float64
        bad = _bits(got) != _bits(want)
        assert not bad.any(), (f"{f} {mode}: x={x[bad][:5].tolist()} got "
                               f"{got[bad][:5].tolist()} want {want[bad][:5].tolist()}")


def fi_round(fi, v, mode, sat):
    if not fi.is_signed and (v < 0 or (v == 0 and math.copysign(1, v) < 0)):
        # gfloat 0.5.2 passes negatives through an unsigned format; qtensor's rule: NaN (no
        # such value), -0.0 -> +0.0
        return 0.0 if v == 0 else math.nan
    return gfloat.round_float(fi, v, _MODES[mode], sat)


@pytest.mark.parametrize("p,signed,domain", P3109_8)
def test_binary8_codes_and_limits_match_gfloat(p, signed, domain):
    fi = _gfloat_info(8, p, signed, domain)
    f = qt.p3109(8, p, signed, domain)
    name = f"binary8p{p}{'s' if signed else 'u'}{domain[0]}"
    assert f == getattr(qt, name) and str(f) == name and qt.format(name) == f
    assert qt.format(f"{name}(saturate=True)") == f.replace(saturate=True)
    assert str(f.replace(rounding="stochastic")) == f"{name}(rounding=stochastic)"
    assert qt.format(f"p3109_k8p{p}{'s' if signed else 'u'}{domain[0]}") == f
    assert f.bits == 8 and f.max == fi.max and f.has_inf == (domain == "extended")
    values = [gfloat.decode_float(fi, c).fval for c in range(256)]
    finite = [v for v in values if math.isfinite(v)]
    assert f.min_subnormal == min(v for v in finite if v > 0)
    # every code point is a value of the format: rounding keeps it (the kernels and reference)
    x = torch.tensor(finite, dtype=torch.float32)
    assert torch.equal(_bits(qt.quantize(x, f)), _bits(x))
    assert torch.equal(_bits(reference.quantize(x.double(), f)), _bits(x))
    # no negative zero: -0.0 rounds to +0.0 (gfloat: the code of -0 is the NaN)
    tiny = torch.tensor([-0.0, -1e-30] if signed else [-0.0])
    assert not fi.has_nz and _bits(qt.quantize(tiny, f)).eq(0).all()
    assert sum(math.isnan(v) for v in values) == fi.num_nans


@pytest.mark.parametrize("mode", list(_MODES))
@pytest.mark.parametrize("sat", [False, True])
@pytest.mark.parametrize("p,signed,domain", P3109_8)
def test_binary8_rounding_matches_gfloat(p, signed, domain, mode, sat):
    fi = _gfloat_info(8, p, signed, domain)
    values = [gfloat.decode_float(fi, c).fval for c in range(256)]
    finite = [v for v in values if math.isfinite(v)]
    xs = _probes(finite)
    if signed:
        xs += [-v for v in xs]
    else:
        xs += [-1.0, -1e-30, -0.0, -math.inf]
    _check_against(qt.p3109(8, p, signed, domain), fi, xs, mode, sat)


@pytest.mark.parametrize("k,p,signed", [(4, 2, True), (6, 3, True), (6, 6, False),
                                        (10, 4, True), (12, 5, False), (16, 8, True),
                                        (16, 11, True)])
def test_k_bit_family_matches_gfloat(k, p, signed):
    for domain in ("extended", "finite"):
        fi = _gfloat_info(k, p, signed, domain)
        f = qt.p3109(k, p, signed, domain)
        assert qt.format(str(f)) == f and f.max == fi.max
        if k <= 10:
            finite = [gfloat.decode_float(fi, c).fval for c in range(2 ** k)]
            finite = [v for v in finite if math.isfinite(v)]
        else:  # a sample of codes (the small and the large end, and every 17th)
            codes = list(range(64)) + list(range(0, 2 ** (k - int(signed)), 17)) + list(
                range(2 ** (k - int(signed)) - 64, 2 ** (k - int(signed))))
            finite = [gfloat.decode_float(fi, c).fval for c in codes]
            finite = [v for v in finite if math.isfinite(v)]
        xs = _probes(finite)
        xs += [-v for v in xs] if signed else [-2.0]
        for mode in _MODES:
            _check_against(f, fi, xs, mode, False)


@pytest.mark.parametrize("p,signed,domain", [(3, True, "extended"), (1, True, "finite"),
                                             (4, False, "finite")])
def test_stochastic_rounding_picks_a_neighbour_and_kernels_match_reference(p, signed, domain):
    f = qt.p3109(8, p, signed, domain)
    fi = _gfloat_info(8, p, signed, domain)
    x = torch.randn(2048) * 2.0 ** torch.randint(-12, 12, (2048,)).float()
    x = x.abs() if not signed else x
    lo = torch.tensor([gfloat.round_float(fi, v, RoundMode.TowardZero) for v in x.tolist()])
    hi = torch.tensor([gfloat.round_float(
        fi, v, RoundMode.TowardPositive if v > 0 else RoundMode.TowardNegative)
        for v in x.tolist()])
    for mode in ("stochastic", "stochastic8"):
        got = qt.quantize(x, f, rounding=mode)
        assert ((got == lo) | (got == hi)).all()
        assert torch.equal(_bits(qt.kernels.ops.quantize_with_seed(x, f, mode, 123)),
                           _bits(reference.quantize_with_seed(x, f, mode, 123)))
    assert (qt.quantize(x, f, rounding="stochastic") != lo).any()


def test_bad_p3109_parameters_are_precise_errors():
    with pytest.raises(FormatError, match=r"binary8p8se.*p must be 1\.\.7"):
        qt.p3109(8, 8)
    with pytest.raises(FormatError, match=r"p must be 1\.\.8"):
        qt.p3109(8, 9, signed=False)
    with pytest.raises(FormatError, match=r"p must be"):
        qt.p3109(8, 0)
    with pytest.raises(FormatError, match=r"k >= 2"):
        qt.p3109(1, 1)
    with pytest.raises(FormatError, match=r"domain must be 'extended' or 'finite'"):
        qt.p3109(8, 3, domain="saturating")
    with pytest.raises(FormatError, match=r"binary32p4se is not a format qtensor can hold"):
        qt.p3109(32, 4)  # 28 exponent bits
    with pytest.raises(FormatError, match=r"binary2p1se is not a format.*no normal numbers"):
        qt.format("binary2p1se")  # only 0, Inf, NaN
    with pytest.raises(FormatError, match=r"p must be 1\.\.7"):
        qt.format("binary8p8se")
    with pytest.raises(FormatError, match=r"element format is not supported"):
        qt.BlockFormat(qt.binary8p3se, 32)


def test_ue5m3_every_code_and_rounding_matches_its_definition():
    f = qt.ue5m3
    assert (f.bits, f.max, f.min_subnormal, f.has_inf) == (8, 114688.0, 2.0 ** -17, False)
    codes = float_codes(f)  # the oracle decodes 8-bit codes: no sign bit, bias 15, 0xFF NaN
    assert len(codes) == 256 and math.isnan(dict(codes)[0xFF])
    finite = [v for _, v in codes if math.isfinite(v)]
    assert max(finite) == 114688.0 and finite[0] == 0.0
    xs = _probes(finite) + [-1.0, -0.0, -math.inf, math.nan]
    x = torch.tensor(xs, dtype=torch.float32)
    for mode in _MODES:
        want = torch.tensor([round_float(float(v), f, mode) for v in xs])
        for got in (qt.quantize(x, f, rounding=mode), reference.quantize(x.double(), f,
                                                                         rounding=mode)):
            assert torch.equal(_bits(got), _bits(want)), mode
    # saturating (cvt with __NV_SATFINITE), negatives have no value
    assert qt.quantize(torch.tensor([1e6, math.inf]), f).tolist() == [114688.0, 114688.0]
    assert qt.quantize(torch.tensor([-1.0]), f).isnan().all()


def test_ue5m3_out_of_range_scale_is_a_precise_error():
    with pytest.raises(FormatError, match=r"unsigned formats with zero.*specials='none'"):
        qt.ue5m3.replace(specials="none")
    with pytest.raises(FormatError, match=r"below float32's smallest subnormal"):
        # elements down to 2^-140 under UE5M3's 2^-17 scales: values below float32's range
        qt.BlockFormat(qt.format("e8m3(bias=134)"), 16, scale=qt.ue5m3, scale_rule="amax")


@pytest.mark.parametrize("name", ["nvfp4_ue5m3", "mxfp4_e2m1_b16"])
@pytest.mark.parametrize("mode", ["nearest", "nearest_away", "toward_zero"])
def test_block_presets_match_the_block_oracle(name, mode):
    fmt = qt.format(name)
    assert qt.format(str(fmt)) == fmt and fmt.block_size == 16
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(64, generator=g) * 10.0 ** torch.randint(-8, 8, (1,), generator=g)
            for _ in range(24)]
    rows.append(torch.tensor([0.0] * 15 + [1e-7] + [3e6] * 16 + [-0.0] * 32))  # tiny, huge
    x = torch.stack(rows)
    got = qt.quantize(x, fmt, rounding=mode)
    want = torch.tensor([sum((quantize_block(r[i:i + 16], fmt, mode)
                              for i in range(0, 64, 16)), []) for r in x.tolist()])
    assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(_bits(reference.quantize(x, fmt, rounding=mode)), _bits(want))


def test_nvfp4_ue5m3_stochastic_is_the_reference():
    x = torch.randn(8, 64) * 1e3
    for mode in ("stochastic", "stochastic8"):
        assert torch.equal(_bits(qt.kernels.ops.quantize_with_seed(x, qt.nvfp4_ue5m3, mode, 7)),
                           _bits(reference.quantize_with_seed(x, qt.nvfp4_ue5m3, mode, 7)))


def test_p3109_qtensor_and_a_converted_model_train_one_step():
    torch.manual_seed(0)
    f = qt.binary8p4se
    q = qt.as_qtensor(torch.randn(8, 8), f)
    y = (q * -1e-30)  # rounds to zero: +0.0, no negative zero
    assert _bits(y.dequantize() if hasattr(y, "dequantize") else y).eq(0).all()
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    qmodel = qt.convert(model, f)
    opt = torch.optim.SGD(qmodel.parameters(), lr=0.1)
    loss = qmodel(torch.randn(32, 16)).square().mean()
    loss.backward()
    opt.step()
    for p in qmodel.parameters():
        data = p.data._data if hasattr(p.data, "_data") else p.data
        assert torch.equal(_bits(qt.quantize(data, f)), _bits(data))  # still in format
        assert not (data.eq(0) & data.signbit()).any()  # no -0.0

"""Where the scales of block-scaled operands are applied (AccumFormat.scales): the reference and
the kernel against exact oracles."""
from fractions import Fraction

import pytest
import torch

import qtensor as qt
from qtensor import accum
from qtensor.accum import scaled as accum_scaled
from qtensor.accum.format import AccumFormatError

from accum_cases import _to_grid, bits, oracle, oracle_dot


# ---------------------------------------------------------------------------------------------
# Where the scales of block-scaled operands are applied (AccumFormat.scales): per promotion
# interval (DeepSeek-V3's FP8 GEMM on Hopper), in the epilogue, inside the instruction

def _f32_fma(s: float, p: float, acc: float) -> float:
    """fp32(acc + s * p), one rounding (an FFMA)."""
    return _to_grid(Fraction(acc) + Fraction(s) * Fraction(p), 23, "nearest")


def _f32_mul(x: float, y: float) -> float:
    return _to_grid(Fraction(x) * Fraction(y), 23, "nearest")


def oracle_promotion_scaled(a, b, sa, sb, f, c=None, **kw):
    """Each interval of chunk * promote K-elements: its chain of instructions from 0 (the oracle
    above, no promotion), promoted as acc = fp32(acc + fp32(sa * sb) * p); acc starts at c."""
    blk = f.chunk * f.promote
    inner = f.replace(promote=None, scales="instruction")
    A, B = a.tolist(), b.t().tolist()
    out = []
    for i, row in enumerate(A):
        out.append([])
        for j, col in enumerate(B):
            acc = 0.0 if c is None else float(c[i, j])
            for kb, k0 in enumerate(range(0, len(row), blk)):
                p = oracle_dot(row[k0:k0 + blk], col[k0:k0 + blk], inner, **kw)
                acc = _f32_fma(_f32_mul(float(sa[i, kb]), float(sb[kb, j])), p, acc)
            out[-1].append(acc)
    return torch.tensor(out, dtype=torch.float32)


def _deepseek_operands(g, M, K, N, blk):
    """E4M3 elements (subnormals and zeros included) with float32 scales amax / 448 per 1 x blk
    row block of a and per blk-row block of b (DeepSeek-V3's fine-grained scaling)."""
    def elems(shape):
        x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-9, 9, shape, generator=g)
                                                         .float())
        x = torch.where(torch.rand(shape, generator=g) < 0.1, 0.0, x)
        return qt.quantize(x.clamp(-448, 448), "fp8_e4m3")
    KB = -(-K // blk)
    sa = torch.rand(M, KB, generator=g) * 2.0 ** torch.randint(-12, 4, (M, KB), generator=g)
    sb = torch.rand(KB, N, generator=g) * 2.0 ** torch.randint(-12, 4, (KB, N), generator=g)
    return elems((M, K)), elems((K, N)), sa + 2 ** -14, sb + 2 ** -14


@pytest.mark.parametrize("promote", [1, 4])
@pytest.mark.parametrize("fn", ["reference", "kernel"])
def test_scales_on_promotion_equal_oracle(promote, fn):
    f = accum.hopper_fp8.replace(promote=promote, scales="promotion")
    g = torch.Generator().manual_seed(40 + promote)
    K = 2 * 32 * promote + 44  # two full intervals and a short one
    a, b, sa, sb = _deepseek_operands(g, 4, K, 3, 32 * promote)
    mm = accum.accum_matmul if fn == "kernel" else accum.accum_matmul_reference
    got = mm(a, b, f, a_scale=sa, b_scale=sb, a_emin=-6, b_emin=-6)
    want = oracle_promotion_scaled(a, b, sa, sb, f, a_emin=-6, b_emin=-6)
    assert torch.equal(bits(got), bits(want))
    c = torch.randn(4, 3, generator=g)  # an initial accumulator starts the FP32 accumulator
    got = mm(a, b, f, a_scale=sa, b_scale=sb, a_emin=-6, b_emin=-6, c=c)
    want = oracle_promotion_scaled(a, b, sa, sb, f, c=c, a_emin=-6, b_emin=-6)
    assert torch.equal(bits(got), bits(want))
    # the promotion is one FFMA: a separate float32 multiply and add differs somewhere
    blk = 32 * promote
    inner = f.replace(promote=None, scales="instruction")
    two = torch.zeros(4, 3)
    for kb, k0 in enumerate(range(0, K, blk)):
        p = accum.accum_matmul_reference(a[:, k0:k0 + blk], b[k0:k0 + blk], inner, a_emin=-6,
                                         b_emin=-6)
        two = two + (sa[:, kb, None] * sb[None, kb]) * p
    assert not torch.equal(bits(two), bits(got))


def test_scales_on_promotion_batched_and_broadcast():
    """A batch of GEMMs and DeepSeek's 128 x 128 weight blocks (one scale per K-block and
    128 outputs, expanded along N) give the per-matrix results; unit scales give the unscaled
    datapath (the promotion add is then the plain FP32 add)."""
    f = accum.hopper_fp8.replace(scales="promotion")
    g = torch.Generator().manual_seed(7)
    a = torch.stack([_deepseek_operands(g, 3, 300, 2, 128)[0] for _ in range(2)])
    b, sa = _deepseek_operands(g, 3, 300, 5, 128)[1:3]
    sw = torch.rand(3, 1, generator=g) + 0.5  # one 128x128 block's scale for all N columns
    got = accum.accum_matmul(a, b, f, a_scale=sa, b_scale=sw.expand(3, 5))
    for i in range(2):
        want = accum.accum_matmul_reference(a[i], b, f, a_scale=sa, b_scale=sw.expand(3, 5))
        assert torch.equal(bits(got[i]), bits(want))
    ones = accum.accum_matmul(a, b, f, a_scale=torch.ones(3, 3), b_scale=torch.ones(3, 5))
    assert torch.equal(bits(ones), bits(accum.accum_matmul(a, b, accum.hopper_fp8)))


@pytest.mark.parametrize("fn", ["reference", "kernel"])
def test_scales_in_epilogue_equal_oracle(fn):
    """Per-row scales of a, per-column scales of b (or one per tensor): the whole unscaled sum
    through the datapath, then one multiply by fp32(sa * sb)."""
    f = accum.hopper_fp8.replace(scales="epilogue")
    g = torch.Generator().manual_seed(3)
    a, b, _, _ = _deepseek_operands(g, 4, 200, 3, 128)
    sa, sb = torch.rand(4, 1, generator=g) + 0.3, torch.rand(3, generator=g) + 0.3
    mm = accum.accum_matmul if fn == "kernel" else accum.accum_matmul_reference
    got = mm(a, b, f, a_scale=sa, b_scale=sb, a_emin=-6, b_emin=-6)
    plain = oracle(a, b, accum.hopper_fp8, a_emin=-6, b_emin=-6)
    want = torch.tensor([[_f32_mul(float(plain[i, j]), _f32_mul(float(sa[i, 0]), float(sb[j])))
                          for j in range(3)] for i in range(4)], dtype=torch.float32)
    assert torch.equal(bits(got), bits(want))
    one = mm(a, b, f, a_scale=torch.tensor(2.0), b_scale=torch.tensor(0.5), a_emin=-6, b_emin=-6)
    assert torch.equal(bits(one), bits(plain))


@pytest.mark.parametrize("name", ["blackwell_nvfp4", "blackwell_mxfp4"])
def test_scales_inside_the_instruction_equal_oracle(name):
    """scales='instruction' (the default): FP4 elements with their block scales (NVFP4: E4M3
    per 16 K-elements; MXFP4: E8M0 per 32, a wide spread); each group aligns at the scales'
    exponents (the oracle's ga, gb)."""
    f = accum.PRESETS[name]
    bs = 16 if name == "blackwell_nvfp4" else 32
    g = torch.Generator().manual_seed(5)
    fp4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    a = fp4[torch.randint(0, 8, (3, 128), generator=g)] * (torch.randint(0, 2, (3, 128),
                                                                         generator=g) * 2 - 1)
    b = fp4[torch.randint(0, 8, (128, 2), generator=g)]

    def scales(shape):
        if bs == 16:
            return torch.randint(1, 126, shape, generator=g).to(torch.uint8).view(
                torch.float8_e4m3fn)
        return torch.randint(127 - 40, 127 + 40, shape, generator=g).to(torch.uint8).view(
            torch.float8_e8m0fnu)
    sa, sb = scales((3, 128 // bs)), scales((128 // bs, 2))
    if bs == 32:  # a first block whose groups cancel, at a high scale: it sets the alignment
        a[:, 8:16], b[8:16] = -a[:, :8], b[:8]
        a[:, 24:32], b[24:32] = -a[:, 16:24], b[16:24]
        sa[:, 0] = torch.tensor(2.0 ** 60)
    got = accum.accum_matmul(a, b, f, a_scale=sa, b_scale=sb)
    r = bs // 16
    ea = torch.frexp(sa.float()).exponent.long().sub(1).clamp(min=-6 if bs == 16 else -127)
    eb = torch.frexp(sb.float()).exponent.long().sub(1).clamp(min=-6 if bs == 16 else -127)
    ad, bd = a * sa.float().repeat_interleave(bs, 1), b * sb.float().repeat_interleave(bs, 0)
    want = oracle(ad, bd, f, a_gexp=ea.repeat_interleave(r, 1), b_gexp=eb.repeat_interleave(r, 0))
    assert torch.equal(bits(got), bits(want))
    if bs == 32:  # the scales matter: the groups' own sums' exponents give other bits
        assert not torch.equal(bits(got), bits(oracle(ad, bd, f)))


@pytest.mark.parametrize("kw, msg", [
    (dict(scales="sideways"), "scales must be one of"),
    (dict(scales="promotion", promote=None), "needs a promotion interval"),
])
def test_scales_format_errors(kw, msg):
    with pytest.raises(AccumFormatError, match=msg):
        accum.hopper_fp8.replace(**kw)


def test_scales_field_is_part_of_the_format():
    import pickle
    f = accum.hopper_fp8.replace(scales="promotion")
    assert f != accum.hopper_fp8 and "scales=promotion" in str(f)
    assert pickle.loads(pickle.dumps(f)) == f and accum.hopper_fp8.scales == "instruction"


def test_scales_argument_errors():
    a, b = torch.ones(2, 300), torch.ones(300, 3)
    prom = accum.hopper_fp8.replace(scales="promotion")
    with pytest.raises(ValueError, match="go together"):
        accum.accum_matmul(a, b, prom, a_scale=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"one per 128 K-elements"):
        accum.accum_matmul(a, b, prom, a_scale=torch.ones(2, 10), b_scale=torch.ones(10, 3))
    with pytest.raises(ValueError, match="must broadcast"):
        accum.accum_matmul(a, b, accum.hopper_fp8.replace(scales="epilogue"),
                           a_scale=torch.ones(3), b_scale=torch.ones(3))
    with pytest.raises(ValueError, match="power-of-two"):
        accum.accum_matmul(a, b, accum.blackwell_mxf8f6f4, a_scale=torch.full((2, 10), 0.75),
                           b_scale=torch.ones(10, 3))
    with pytest.raises(TypeError, match="floating-point"):
        accum.accum_matmul(a, b, prom, a_scale=torch.ones(2, 3, dtype=torch.int32),
                           b_scale=torch.ones(3, 3))


def test_fma_f32_is_one_rounding():
    """The promotion's FFMA against Fractions, on sums that land near float32 ties."""
    g = torch.Generator().manual_seed(9)
    s = torch.rand(2000, generator=g) + 0.5
    p = torch.randn(2000, generator=g) * 2.0 ** torch.randint(-30, 30, (2000,), generator=g)
    acc = torch.randn(2000, generator=g)
    acc[:500] = (-(s[:500].double() * p[:500].double())).float()  # near-cancellation
    # 1 + 2^-23 + 2^-24 (1 - 2^-30): just below a float32 tie, but float64 rounds it onto the
    # tie (then to even: 1 + 2^-22, wrong); the rounding to odd keeps 1 + 2^-23
    s[0], p[0], acc[0] = 1 + 2 ** -15, (1 - 2 ** -15) * 2 ** -24, 1 + 2 ** -23
    s[1], p[1], acc[1] = 1 + 2 ** -15, -(1 - 2 ** -15) * 2 ** -24, -1 - 2 ** -23
    naive = (acc.double() + s.double() * p.double()).float()
    assert naive[0] == 1 + 2 ** -22 and naive[1] == -1 - 2 ** -22
    got = accum_scaled._fma_f32(s, p, acc)
    want = torch.tensor([_f32_fma(float(x), float(y), float(z)) for x, y, z in
                         zip(s.tolist(), p.tolist(), acc.tolist())], dtype=torch.float32)
    assert torch.equal(bits(got), bits(want))

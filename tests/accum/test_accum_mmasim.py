"""qt.accum against MMA-Sim (microsoft/MMA-Sim, PyPI ``mmasim``): every preset bit for bit.

MMA-Sim models each instruction bit-accurately (arXiv 2511.10909v2, validated on real GPUs).
Operands are drawn as codes of the instruction's input formats: random codes over the whole
range (subnormals, inf, NaN), moderate values, zeros, explicit subnormals and exactly cancelling
pairs. A chain runs one instruction per ``chunk`` K-elements, each output the next one's
accumulator input, promoted into a float32 add every ``promote`` instructions (CUTLASS,
DeepGEMM). K not a multiple of the chunk: MMA-Sim sees the operands zero-padded (as a kernel
pads K to the instruction's K).
"""
import math
import zlib

import pytest
import torch

from qtensor import accum
from qtensor.accum import blocks as accum_blocks
from qtensor.accum import kernel as accum_kernel

mmasim = pytest.importorskip("mmasim")
from mmasim import nv_ptx  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
F16, BF16 = torch.float16, torch.bfloat16
TF32 = torch.float32  # tf32 values (the low 13 mantissa bits zero) in float32
E4Z, E5Z = torch.float8_e4m3fnuz, torch.float8_e5m2fnuz  # AMD CDNA3's FP8
EMIN = {F16: -14, BF16: -126, E4M3: -6, E5M2: -14, TF32: -126, E4Z: -7, E5Z: -15}
PTX = {F16: "f16", BF16: "bf16", E4M3: "e4m3", E5M2: "e5m2"}


def _nv(arch, kind, shape):
    return lambda: getattr(nv_ptx, kind)(arch, shape)


# preset -> [(a dtype, b dtype, the mmasim instruction of that type)]
def _cases():
    c = {}
    c["volta_fp16"] = [(F16, F16, _nv("Volta", "MMA", "m8n8k4.f32.f16.f16.f32"))]
    for t in (F16, BF16):
        n = PTX[t]
        c.setdefault("ampere_fp16" if t == F16 else "ampere_bf16", []).append(
            (t, t, _nv("Ampere", "MMA", f"m16n8k16.f32.{n}.{n}.f32")))
        c.setdefault("hopper_fp16" if t == F16 else "hopper_bf16", []).append(
            (t, t, _nv("Hopper", "WGMMA", f"m64n8k16.f32.{n}.{n}")))
        c.setdefault("blackwell_fp16" if t == F16 else "blackwell_bf16", []).append(
            (t, t, _nv("Blackwell", "TCGen05MMA", f"m64n8k16.kind::f16.f32.{n}.{n}")))
    for name in ("hopper_fp8", "hopper_fp8_fast"):
        c[name] = [(x, y, _nv("Hopper", "WGMMA", f"m64n8k32.f32.{PTX[x]}.{PTX[y]}"))
                   for x in (E4M3, E5M2) for y in (E4M3, E5M2)]
    c["ada_fp8"] = [(x, y, _nv("Ada Lovelace", "MMA", f"m16n8k32.f32.{PTX[x]}.{PTX[y]}.f32"))
                    for x in (E4M3, E5M2) for y in (E4M3, E5M2)]
    c["blackwell_f8f6f4"] = [
        (x, y, _nv("Blackwell", "TCGen05MMA", f"m64n8k32.kind::f8f6f4.f32.{PTX[x]}.{PTX[y]}"))
        for x in (E4M3, E5M2) for y in (E4M3, E5M2)]
    c["hopper_fp8_f16"] = [(x, y, _nv("Hopper", "WGMMA", f"m64n8k32.f16.{PTX[x]}.{PTX[y]}"))
                           for x in (E4M3, E5M2) for y in (E4M3, E5M2)]
    from mmasim import amd
    c["cdna3_fp16"] = [(F16, F16, lambda: amd.MFMA("CDNA3", "f32_16x16x16_f16"))]
    c["cdna3_bf16"] = [(BF16, BF16, lambda: amd.MFMA("CDNA3", "f32_16x16x16_bf16"))]
    c["cdna3_fp8"] = [(x, y, (lambda nx=nx, ny=ny: amd.MFMA("CDNA3", f"f32_16x16x32_{nx}_{ny}")))
                      for x, nx in ((E4Z, "fp8"), (E5Z, "bf8")) for y, ny in ((E4Z, "fp8"),
                                                                              (E5Z, "bf8"))]
    c["ampere_tf32"] = [(TF32, TF32, _nv("Ampere", "MMA", "m16n8k8.f32.tf32.tf32.f32"))]
    c["hopper_tf32"] = [(TF32, TF32, _nv("Hopper", "WGMMA", "m64n8k8.f32.tf32.tf32"))]
    c["blackwell_tf32"] = [(TF32, TF32, _nv("Blackwell", "TCGen05MMA",
                                            "m64n8k8.kind::tf32.f32.tf32.tf32"))]
    return c


CASES = _cases()


def draw(g, dtype, shape, nonfinite=True):
    """Codes of dtype: a mixture of the whole code range, moderate values, zeros, subnormals."""
    nbits = 8 if dtype in (E4M3, E5M2, E4Z, E5Z) else (32 if dtype == TF32 else 16)
    man = {F16: 10, BF16: 7, E4M3: 3, E5M2: 2, TF32: 23, E4Z: 3, E5Z: 2}[dtype]
    codes = torch.randint(0, 1 << nbits, shape, generator=g, dtype=torch.int64)
    if not nonfinite:  # keep the exponent field below all-ones
        x = _view(codes, dtype)
        codes = torch.where(torch.isfinite(x.float()), codes, codes & ~(1 << (nbits - 2)))
    moderate = (torch.randn(shape, generator=g) * 2.0 ** torch.randint(-3, 4, shape, generator=g))
    moderate = _codes(moderate.to(dtype), nbits)
    sub = torch.randint(1, 1 << man, shape, generator=g) | (
        torch.randint(0, 2, shape, generator=g) << (nbits - 1))
    u = torch.rand(shape, generator=g)
    codes = torch.where(u < 0.45, moderate, codes)
    codes = torch.where((u >= 0.45) & (u < 0.6), sub, codes)
    codes = torch.where((u >= 0.6) & (u < 0.72), 0, codes)
    if dtype == TF32:  # tf32: the low 13 mantissa bits zero
        codes = codes & ~0x1FFF
    if dtype in (E4Z, E5Z) and not nonfinite:  # fnuz: 0x80 is the only NaN
        codes = torch.where(codes == 0x80, 0, codes)
    return _view(codes, dtype)


def _view(codes, dtype):
    if dtype in (E4M3, E5M2, E4Z, E5Z):
        return codes.to(torch.uint8).view(dtype)
    if dtype == TF32:  # wraps to the 32-bit pattern
        signed = (codes + (1 << 31)) % (1 << 32) - (1 << 31)
        return signed.to(torch.int32).view(torch.float32)
    return codes.to(torch.int32).to(torch.int16).view(dtype)  # wraps to the 16-bit pattern


def _codes(x, nbits):
    v = {8: torch.uint8, 16: torch.int16, 32: torch.int32}[nbits]
    return x.view(v).to(torch.int64) & ((1 << nbits) - 1)


def operands(g, ta, tb, M, K, N, nonfinite=True):
    a, b = draw(g, ta, (M, K), nonfinite), draw(g, tb, (K, N), nonfinite)
    # exactly cancelling pairs: a[:, k+1] = -a[:, k], b[k+1] = b[k]
    ks = torch.randperm(K - 1, generator=g)[: K // 6] if K > 1 else torch.tensor([], dtype=int)
    for k in ks.tolist():
        a[:, k + 1] = (-a[:, k].float()).to(ta)
        b[k + 1] = b[k]
    return a, b


def mmasim_chain(make, a, b, f, c=None):
    """MMA-Sim's chain of instructions over K (one per chunk), promotion as qt.accum's."""
    M, K = a.shape
    N = b.shape[1]
    pad = -K % f.chunk
    if pad:  # the instruction always takes a full chunk: zeros in the empty slots
        a = torch.cat([a, torch.zeros(M, pad, dtype=a.dtype)], 1)
        b = torch.cat([b, torch.zeros(pad, N, dtype=b.dtype)], 0)
    op = make()
    av = a[:, None, :].expand(M, N, -1)
    bv = b.t()[None, :, :].expand(M, N, -1)
    out = torch.float16 if f.acc_emax == 15 else torch.float32  # the instruction's D type
    acc = torch.zeros(M, N)
    p = torch.zeros(M, N, dtype=out) if c is None else c.to(out)
    nk = a.shape[1] // f.chunk
    for i in range(nk):
        k0 = i * f.chunk
        p = op.dpa(av[..., k0:k0 + f.chunk], bv[..., k0:k0 + f.chunk], p)
        if f.promote is not None and ((i + 1) % f.promote == 0 or i + 1 == nk):
            acc = acc + p
            p = torch.zeros(M, N)
    return acc if f.promote is not None else p


def same_bits(x, y):
    """Equal as bit patterns, every NaN one NaN."""
    x, y = x.float(), y.float()
    nx, ny = torch.isnan(x), torch.isnan(y)
    return torch.equal(nx, ny) and torch.equal(
        torch.where(nx, 0.0, x).view(torch.int32), torch.where(ny, 0.0, y).view(torch.int32))


def ours(a, b, f, fn=accum.accum_matmul_reference, **kw):
    return fn(a.float(), b.float(), f, a_emin=EMIN[a.dtype], b_emin=EMIN[b.dtype], **kw)


PRESET_CASES = [(n, i) for n in CASES for i in range(len(CASES[n]))]


def _ks(f):
    return [f.chunk, 3 * f.chunk, 8 * f.chunk + 1 + f.chunk // 2]


@pytest.mark.parametrize("name, i", PRESET_CASES)
def test_reference_equals_mmasim(name, i):
    f = accum.PRESETS[name]
    ta, tb, make = CASES[name][i]
    for K in _ks(f):
        for nonfinite in (False, True):
            g = torch.Generator().manual_seed(zlib.crc32(f"{name}{i}{K}{nonfinite}".encode()))
            a, b = operands(g, ta, tb, 6, K, 5, nonfinite)
            want = mmasim_chain(make, a, b, f)
            got = ours(a, b, f)
            assert same_bits(got, want), (name, ta, tb, K, nonfinite)


@pytest.mark.parametrize("fn", ["reference", "kernel"])
def test_cdna3_fp8_one_element_last_chunk_equals_mmasim(fn):
    """K = 1 and 2 * 16 + 1: the last instruction's odd half is all padding (the reference's
    empty half, which failed before)."""
    f = accum.cdna3_fp8
    run = accum.accum_matmul_reference if fn == "reference" else accum.accum_matmul
    for i, (ta, tb, make) in enumerate(CASES["cdna3_fp8"]):
        for K in (1, 33):
            g = torch.Generator().manual_seed(zlib.crc32(f"odd{i}{K}".encode()))
            a, b = operands(g, ta, tb, 5, K, 6)
            assert same_bits(ours(a, b, f, run), mmasim_chain(make, a, b, f)), (ta, tb, K)


@pytest.mark.parametrize("fn", ["reference", "kernel"])
def test_cdna3_fp8_zero_half_beside_exponent_25_equals_mmasim(fn):
    """One half of an instruction all zero, the other's largest product exponent 25: the zero
    half's sum was scaled by 2^(-999 - 25) = 2^-1024, whose float64 bits are -inf, and 0 * -inf
    made the result NaN (reference and kernel) where MMA-Sim gives 2^25."""
    f = accum.cdna3_fp8
    run = accum.accum_matmul_reference if fn == "reference" else accum.accum_matmul
    for ta, tb, make in CASES["cdna3_fp8"]:
        if E5Z not in (ta, tb):
            continue
        x, y = (2.0 ** 13, 2.0 ** 12) if ta == tb else ((2.0 ** 13, 2.0 ** 7) if ta == E5Z
                                                         else (2.0 ** 7, 2.0 ** 13))
        for K in (1, 3, 17):  # the odd half padding; one odd zero product; a second instruction
            a, b = torch.zeros(3, K), torch.zeros(K, 3)
            a[:, 0], b[0] = x, y
            b[0, 1], b[0, 2] = -y, y / 2
            a[1, K - 1] = 1.0 if K > 1 else x
            a[2, 0] = math.nan  # a NaN row: the kernel's double lanes (not its float32 chains)
            a, b = a.to(ta), b.to(tb)
            want = mmasim_chain(make, a, b, f)
            assert torch.isfinite(want[:2]).all()
            assert same_bits(ours(a, b, f, run), want), (ta, tb, K)
            assert same_bits(ours(a[:2], b, f, run), want[:2]), (ta, tb, K)


@pytest.mark.parametrize("name", ["volta_fp16", "ampere_bf16", "hopper_fp16", "hopper_fp8"])
def test_reference_rules_one_by_one(name):
    """Hand-picked cases of the three rules, each of which the old model got wrong."""
    f = accum.PRESETS[name]
    ta, tb, make = CASES[name][0]
    K = f.chunk
    # rule 1: a subnormal operand aligns at the format's minimum normal exponent
    a = torch.zeros(1, K, dtype=ta)
    b = torch.zeros(K, 1, dtype=tb)
    a[0, 0], b[0, 0] = 1.0, 1.0
    a[0, 1] = torch.tensor(2.0 ** (EMIN[ta] - 1)).to(ta)  # subnormal (bf16: -127)
    b[1, 0] = torch.tensor(1.75).to(tb)
    assert same_bits(ours(a, b, f), mmasim_chain(make, a, b, f))


# ---------------------------------------------------------------------------------------------
# Blackwell block-scaled FP4 (tcgen05 kind::mxf4 / kind::mxf4nvf4): groups of 16 products summed
# exactly, each aligned at its block scales' exponent (a_gexp + b_gexp), cancelled groups too

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

BLOCK_CASES = {
    "blackwell_mxfp4": (32, "m128n8k64.kind::mxf4.block32.f32.e2m1.e2m1.ue8m0"),
    "blackwell_nvfp4": (16, "m128n8k64.kind::mxf4nvf4.block16.f32.e2m1.e2m1.ue4m3"),
}


def fp4_values(g, shape):
    v = FP4[torch.randint(0, 8, shape, generator=g)]
    v = torch.where(torch.rand(shape, generator=g) < 0.5, -v, v)
    return torch.where(torch.rand(shape, generator=g) < 0.15, 0.0, v)


def block_scales(g, shape, kind):
    """Scales as (float32 values, their alignment exponents, the mmasim dtype tensor)."""
    if kind == 32:  # ue8m0: 2^(code - 127), codes over a wide range, a few extremes
        codes = torch.randint(127 - 60, 127 + 60, shape, generator=g)
        codes = torch.where(torch.rand(shape, generator=g) < 0.1, 127 - 40, codes)
        x = codes.to(torch.uint8).view(torch.float8_e8m0fnu)
        return x.float(), codes - 127, x
    codes = torch.randint(0, 127, shape, generator=g)  # ue4m3: zero and subnormals included
    x = codes.to(torch.uint8).view(E4M3)
    v = x.float()
    e = torch.frexp(v).exponent.to(torch.int64) - 1
    return v, e.clamp(min=-6), x


def block_operands(g, kind, M, K, N, cancel=True):
    a, b = fp4_values(g, (M, K)), fp4_values(g, (K, N))
    if cancel:  # a few groups whose products cancel exactly
        for gi in range(0, K // 16, 3):
            k = gi * 16
            a[:, k + 8:k + 16] = -a[:, k:k + 8]
            b[k + 8:k + 16] = b[k:k + 8]
    sa, ea, xa = block_scales(g, (M, K // kind), kind)
    sb, eb, xb = block_scales(g, (K // kind, N), kind)
    return a, b, (sa, ea, xa), (sb, eb, xb)


def mmasim_block_chain(shape, kind, a, b, xa, xb, c=None):
    op = nv_ptx.TCGen05MMABlockScale("Blackwell", shape)
    M, K = a.shape
    N = b.shape[1]
    av = a.half()[:, None, :].expand(M, N, K)
    bv = b.half().t()[None, :, :].expand(M, N, K)
    al = xa[:, None, :].expand(M, N, -1)
    be = xb.t()[None, :, :].expand(M, N, -1)
    p = torch.zeros(M, N) if c is None else c.clone()
    for k0 in range(0, K, 64):
        p = op.dpa(av[..., k0:k0 + 64], bv[..., k0:k0 + 64], p,
                   al[..., k0 // kind:(k0 + 64) // kind], be[..., k0 // kind:(k0 + 64) // kind])
    return p


def block_ours(name, kind, a, b, sa, ea, sb, eb, fn=accum.accum_matmul_reference, c=None):
    """qt.accum on the dequantized operands, with the groups' scale exponents."""
    r = kind // 16  # groups per block
    ad = a * sa.repeat_interleave(kind, 1)
    bd = b * sb.repeat_interleave(kind, 0)
    return fn(ad, bd, accum.PRESETS[name], a_gexp=ea.repeat_interleave(r, 1),
              b_gexp=eb.repeat_interleave(r, 0), c=c)


@pytest.mark.parametrize("name", list(BLOCK_CASES))
def test_block_scaled_reference_equals_mmasim(name):
    kind, shape = BLOCK_CASES[name]
    for K in (64, 192, 512):
        g = torch.Generator().manual_seed(zlib.crc32(f"{name}{K}".encode()))
        a, b, (sa, ea, xa), (sb, eb, xb) = block_operands(g, kind, 5, K, 4)
        want = mmasim_block_chain(shape, kind, a, b, xa, xb)
        got = block_ours(name, kind, a, b, sa, ea, sb, eb)
        assert same_bits(got, want), (name, K)
        for fn in (accum.accum_matmul_reference, accum.accum_matmul):  # the scales themselves
            f = accum.PRESETS[name]
            assert f.scales == "instruction"
            assert same_bits(fn(a, b, f, a_scale=xa, b_scale=xb), want), (name, K, fn)


def test_cancelled_group_still_aligns():
    """A group at scale 2^35 whose products cancel still sets emax = 35: with 35 fractional bits
    the other groups truncate at 2^0 (2.0 + 0.25 -> 2.0), where aligning by the group sums' own
    exponents (the old model) kept 2.25. MMA-Sim agrees."""
    f = accum.blackwell_mxfp4
    a, b = torch.zeros(1, 64), torch.zeros(64, 1)
    a[0, 0], a[0, 1], b[0, 0], b[1, 0] = 1.0, -1.0, 1.0, 1.0  # group 0 (block 0) cancels
    a[0, 32], a[0, 33], b[32, 0], b[33, 0] = 1.5, 0.5, 1.0, 1.0  # group 2 (block 1): 2.0
    a[0, 48], b[48, 0] = 0.5, 0.5                              # group 3 (block 1): 0.25
    ea = torch.tensor([[35, 0]])
    eb = torch.zeros(2, 1, dtype=torch.int64)
    sa, sb = torch.exp2(ea.float()), torch.ones(2, 1)
    xa = (ea + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    xb = (eb + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    got = block_ours("blackwell_mxfp4", 32, a, b, sa, ea, sb, eb)
    assert got.item() == 2.0
    assert same_bits(got, mmasim_block_chain(BLOCK_CASES["blackwell_mxfp4"][1], 32, a, b, xa, xb))
    ad = a * sa.repeat_interleave(32, 1)
    assert accum.accum_matmul_reference(ad, b, f).item() == 2.25  # without group exponents


# ---------------------------------------------------------------------------------------------
# The compiled kernel (every CPU path: the float32/int32 fast path takes the FP8 operands, the
# double lanes the wide ones, the scalar path group exponents and c) and the initial accumulator

needs_kernel = pytest.mark.skipif(not accum_kernel._kernel_ready(torch.empty(0)),
                                  reason="the compiled extension is not built")


@needs_kernel
@pytest.mark.parametrize("name, i", PRESET_CASES)
def test_kernel_equals_mmasim(name, i):
    f = accum.PRESETS[name]
    ta, tb, make = CASES[name][i]
    for K in _ks(f):
        for nonfinite in (False, True):
            g = torch.Generator().manual_seed(zlib.crc32(f"k{name}{i}{K}{nonfinite}".encode()))
            a, b = operands(g, ta, tb, 9, K, 11, nonfinite)
            want = mmasim_chain(make, a, b, f)
            assert same_bits(ours(a, b, f, accum.accum_matmul), want), (name, ta, tb, K)


@needs_kernel
@pytest.mark.parametrize("name", ["volta_fp16", "ampere_fp16", "ampere_tf32", "hopper_bf16",
                                  "hopper_fp8", "ada_fp8", "hopper_tf32"])
def test_kernel_lean_tiles_equal_mmasim(name):
    """The fast path's lean tiles (accum_fast.h's lean_tile: full 8-row tiles of finite operands
    whose products are exact in float32) against MMA-Sim: 16 rows, codes of the input formats
    (fp16/fp8: the whole finite range, subnormals and zeros; tf32/bf16: moderate values, as
    their float32-subnormal codes take the double path), exactly cancelling pairs, every K of
    _ks (a short last chunk included)."""
    f = accum.PRESETS[name]
    for i, (ta, tb, make) in enumerate(CASES[name][:2]):
        for K in _ks(f):
            g = torch.Generator().manual_seed(zlib.crc32(f"lean{name}{i}{K}".encode()))
            if ta in (TF32, BF16):
                def moderate(shape):
                    x = torch.randn(shape, generator=g) * 2.0 ** torch.randint(
                        -20, 21, shape, generator=g)
                    x[torch.rand(shape, generator=g) < 0.15] = 0.0
                    if ta == BF16:
                        return x.to(BF16)
                    return (x.view(torch.int32) & ~0x1FFF).view(torch.float32)  # tf32 codes
                a, b = moderate((16, K)), moderate((K, 11))
                a[:, 1:K // 2:2] = -a[:, 0:K // 2 - 1:2]  # exact cancellation
                b[1:K // 2:2] = b[0:K // 2 - 1:2]
            else:
                a, b = operands(g, ta, tb, 16, K, 11, nonfinite=False)
            want = mmasim_chain(make, a, b, f)
            assert same_bits(ours(a, b, f, accum.accum_matmul), want), (name, ta, tb, K)


@needs_kernel
@pytest.mark.parametrize("name", list(BLOCK_CASES))
def test_block_scaled_kernel_equals_mmasim(name):
    kind, shape = BLOCK_CASES[name]
    for K in (64, 320):
        g = torch.Generator().manual_seed(zlib.crc32(f"k{name}{K}".encode()))
        a, b, (sa, ea, xa), (sb, eb, xb) = block_operands(g, kind, 7, K, 9)
        want = mmasim_block_chain(shape, kind, a, b, xa, xb)
        got = block_ours(name, kind, a, b, sa, ea, sb, eb, fn=accum.accum_matmul)
        assert same_bits(got, want), (name, K)


def _acc_init(g, M, N):
    """Initial accumulators: moderate, huge, tiny, subnormal and zero float32 values."""
    c = torch.randn(M, N, generator=g) * 2.0 ** torch.randint(-140, 40, (M, N), generator=g)
    return torch.where(torch.rand(M, N, generator=g) < 0.2, 0.0, c)


@pytest.mark.parametrize("fn", ["reference", "kernel"])
@pytest.mark.parametrize("name", ["volta_fp16", "ampere_bf16", "hopper_fp16", "hopper_fp8",
                                  "blackwell_bf16", "cdna3_fp16", "cdna3_bf16", "cdna3_fp8"])
def test_initial_accumulator_equals_mmasim(name, fn):
    """C fed into the first instruction as its accumulator input (mma's C operand)."""
    if fn == "kernel" and not accum_kernel._kernel_ready(torch.empty(0)):
        pytest.skip("the compiled extension is not built")
    f = accum.PRESETS[name]
    ta, tb, make = CASES[name][0]
    g = torch.Generator().manual_seed(zlib.crc32(f"c{name}".encode()))
    a, b = operands(g, ta, tb, 6, 3 * f.chunk, 5, nonfinite=False)
    c = _acc_init(g, 6, 5)
    want = mmasim_chain(make, a, b, f, c=c)
    run = accum.accum_matmul_reference if fn == "reference" else accum.accum_matmul
    assert same_bits(ours(a, b, f, run, c=c), want)


@pytest.mark.parametrize("fn", ["reference", "kernel"])
@pytest.mark.parametrize("name", list(BLOCK_CASES))
def test_block_scaled_initial_accumulator_equals_mmasim(name, fn):
    if fn == "kernel" and not accum_kernel._kernel_ready(torch.empty(0)):
        pytest.skip("the compiled extension is not built")
    kind, shape = BLOCK_CASES[name]
    g = torch.Generator().manual_seed(zlib.crc32(f"c{name}".encode()))
    a, b, (sa, ea, xa), (sb, eb, xb) = block_operands(g, kind, 4, 128, 3)
    c = _acc_init(g, 4, 3)
    want = mmasim_block_chain(shape, kind, a, b, xa, xb, c=c)
    run = accum.accum_matmul_reference if fn == "reference" else accum.accum_matmul
    assert same_bits(block_ours(name, kind, a, b, sa, ea, sb, eb, fn=run, c=c), want)


# ---------------------------------------------------------------------------------------------
# Blackwell kind::f8f6f4 with FP6/FP4 operands (one code per byte for MMA-Sim)

SMALL = {"e3m2": ("fp6_e3m2", 6), "e2m3": ("fp6_e2m3", 6), "e2m1": ("fp4_e2m1", 4)}


def small_operand(g, t, shape):
    """(uint8 codes as MMA-Sim takes them, float32 values, the format's minimum normal exp)."""
    from oracles import decode_float

    import qtensor as qt
    fmt = qt.formats.format(SMALL[t][0])
    nb = SMALL[t][1]
    codes = torch.randint(0, 1 << nb, shape, generator=g)
    codes = torch.where(torch.rand(shape, generator=g) < 0.15, 0, codes)
    table = torch.tensor([decode_float(c, fmt) for c in range(1 << nb)], dtype=torch.float32)
    vals = table[codes]
    raw = (codes << 2 if nb == 4 else codes).to(torch.uint8)
    return raw, vals, fmt.emin


@pytest.mark.parametrize("ta", ["e4m3", "e3m2", "e2m3", "e2m1"])
@pytest.mark.parametrize("tb", ["e5m2", "e3m2", "e2m1"])
def test_blackwell_f8f6f4_small_types_equal_mmasim(ta, tb):
    f = accum.blackwell_f8f6f4
    g = torch.Generator().manual_seed(zlib.crc32(f"{ta}{tb}".encode()))
    K = 96
    ops = []
    for t, shape in ((ta, (6, K)), (tb, (K, 5))):
        if t in SMALL:
            ops.append(small_operand(g, t, shape))
        else:
            dt = {"e4m3": E4M3, "e5m2": E5M2}[t]
            x = draw(g, dt, shape, nonfinite=False)
            ops.append((x, x.float(), EMIN[dt]))
    (ra, va, ea), (rb, vb, eb) = ops
    make = _nv("Blackwell", "TCGen05MMA", f"m64n8k32.kind::f8f6f4.f32.{ta}.{tb}")
    want = mmasim_chain(make, ra, rb, f)
    for fn in (accum.accum_matmul_reference, accum.accum_matmul):
        assert same_bits(fn(va, vb, f, a_emin=ea, b_emin=eb), want), fn


@needs_kernel
@pytest.mark.parametrize("isa", ["base", "avx2"])
def test_kernel_equals_mmasim_on_other_isas(isa):
    """The baseline and AVX2 copies of the lanes (their e_zero and emin handling) and of the
    CDNA3 loops too."""
    import os
    import subprocess
    import sys
    if os.environ.get("QTENSOR_CPU_ISA"):
        pytest.skip("already under a capped ISA")
    sel = ("kernel_equals_mmasim and (ampere_bf16 or hopper_fp8-0 or volta or f8f6f4-1 or "
           "blackwell_mxfp4 or blackwell_nvfp4 or hopper_fp8_f16-0 or cdna3) or qtensor_mxfp4")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.abspath(__file__), "-k", sel],
                       env=dict(os.environ, QTENSOR_CPU_ISA=isa), capture_output=True,
                       text=True, timeout=900,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                           os.path.abspath(__file__)))))
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


def test_qtensor_mxfp4_contraction_equals_mmasim():
    """torch.mm of QTensors with MXFP4 operand formats and blackwell_mxfp4: the block scales,
    recovered from the rounded operands, align the groups as tcgen05 kind::mxf4 does."""
    import qtensor as qt
    g = torch.Generator().manual_seed(11)
    M, K, N = 5, 256, 4
    a = torch.randn(M, K, generator=g) * 2.0 ** torch.randint(-20, 20, (M, 1), generator=g)
    b = torch.randn(K, N, generator=g)
    b[64:96] *= 2.0 ** 34  # one block of b far above the rest: 35 bits below it, the rest
    a[:, 64:72] = 1.0  # truncate; in it a group whose products cancel exactly
    a[:, 72:80] = -1.0
    b[72:80] = b[64:72]
    a[:, 130:140] = 0.0
    qa = qt.as_qtensor(a, "fp32", mm_fmt="mxfp4")
    qb = qt.as_qtensor(b, "fp32", mm_fmt="mxfp4")
    qa.accum = accum.blackwell_mxfp4
    got = torch.mm(qa, qb)

    def split(x):  # (values rounded to MXFP4 along the last dim, elements, scale exponents)
        xq = qt.quantize(x, "mxfp4")
        amax = x.abs().unflatten(-1, (-1, 32)).amax(-1)
        e = torch.frexp(amax).exponent.to(torch.int64) - 1 - 2  # OCP MX: floor(log2 amax) - 2
        elem = xq / torch.exp2(e.float()).repeat_interleave(32, -1)
        return elem, e
    ea_el, ea = split(a)
    eb_el, eb = split(b.t())
    xa = (ea + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    xb = (eb + 127).to(torch.uint8).view(torch.float8_e8m0fnu).t()
    want = mmasim_block_chain(BLOCK_CASES["blackwell_mxfp4"][1], 32, ea_el, eb_el.t(), xa, xb)
    assert same_bits(got.dequantize() if hasattr(got, "dequantize") else got, want)


# ---------------------------------------------------------------------------------------------
# Blackwell kind::mxf8f6f4 block32 (MXFP8 operands, E8M0 scales): each product at its elements'
# (clamped at the element format's minimum normal exponent) and scales' exponents

@pytest.mark.parametrize("ta", [E4M3, E5M2])
@pytest.mark.parametrize("tb", [E4M3, E5M2])
def test_blackwell_mxf8f6f4_block_scaled_equals_mmasim(ta, tb):
    f = accum.blackwell_mxf8f6f4
    g = torch.Generator().manual_seed(zlib.crc32(f"mx{ta}{tb}".encode()))
    M, K, N = 6, 128, 5
    a, b = operands(g, ta, tb, M, K, N, nonfinite=False)
    sa = torch.randint(-20, 20, (M, K // 32), generator=g)
    sb = torch.randint(-20, 20, (K // 32, N), generator=g)
    op = nv_ptx.TCGen05MMABlockScale(
        "Blackwell", f"m128n8k32.kind::mxf8f6f4.block32.f32.{PTX[ta]}.{PTX[tb]}.ue8m0")
    av = a[:, None, :].expand(M, N, K)
    bv = b.t()[None, :, :].expand(M, N, K)
    al = (sa + 127).to(torch.uint8).view(torch.float8_e8m0fnu)[:, None, :].expand(M, N, -1)
    be = (sb + 127).to(torch.uint8).view(torch.float8_e8m0fnu).t()[None, :, :].expand(M, N, -1)
    want = torch.zeros(M, N)
    for k0 in range(0, K, 32):
        want = op.dpa(av[..., k0:k0 + 32], bv[..., k0:k0 + 32], want,
                      al[..., k0 // 32:k0 // 32 + 1], be[..., k0 // 32:k0 // 32 + 1])
    ea, eb = sa.repeat_interleave(32, 1), sb.repeat_interleave(32, 0)
    ad, bd = a.float() * torch.exp2(ea.float()), b.float() * torch.exp2(eb.float())
    for fn in (accum.accum_matmul_reference, accum.accum_matmul):
        got = fn(ad, bd, f, a_emin=ea + EMIN[ta], b_emin=eb + EMIN[tb])
        assert same_bits(got, want), fn
        # the elements and their E8M0 scales as given to the instruction (scales="instruction")
        got = fn(a, b, f, a_scale=al[:, 0], b_scale=be[0].t())
        assert same_bits(got, want), fn
    if (ta, tb) == (E4M3, E5M2):  # here the scalar clamps (the old model) differ
        assert not same_bits(accum.accum_matmul_reference(ad, bd, f), want)


def test_qtensor_mxfp8_contraction_equals_mmasim():
    """torch.mm of QTensors with MXFP8 operand formats and blackwell_mxf8f6f4 equals
    kind::mxf8f6f4: the per-element clamps (the block's minimum normal exponent) reach the
    kernel. (These operands do not make the clamps change a bit; the test above does.)"""
    import qtensor as qt
    g = torch.Generator().manual_seed(12)
    M, K, N = 5, 128, 4
    a = torch.randn(M, K, generator=g)
    a[:, ::7] *= 2.0 ** -15  # elements far below their block's maximum: E4M3 subnormals
    b = torch.randn(K, N, generator=g)
    keep = torch.zeros(K, 1, dtype=torch.bool)
    keep[::7] = True
    b[:64] = torch.where(keep[:64], b[:64], 0.0)  # two chunks of only subnormal-element products
    qa = qt.as_qtensor(a, "fp32", mm_fmt="mxfp8_e4m3")
    qb = qt.as_qtensor(b, "fp32", mm_fmt="mxfp8_e4m3")
    qa.accum = accum.blackwell_mxf8f6f4
    got = torch.mm(qa, qb)
    assert accum_blocks._mx_emin(qt.quantize(a, "mxfp8_e4m3"), qa, -1) is not None  # subnormals

    def split(x):  # elements (e4m3) and scale exponents of x rounded to MXFP8 along the last dim
        xq = qt.quantize(x, "mxfp8_e4m3")
        amax = x.abs().unflatten(-1, (-1, 32)).amax(-1)
        e = torch.frexp(amax).exponent.to(torch.int64) - 1 - 8  # floor(log2 amax) - emax(e4m3)
        return (xq / torch.exp2(e.float()).repeat_interleave(32, -1)).to(E4M3), e
    ael, ea = split(a)
    bel, eb = split(b.t())
    op = nv_ptx.TCGen05MMABlockScale("Blackwell",
                                     "m128n8k32.kind::mxf8f6f4.block32.f32.e4m3.e4m3.ue8m0")
    av, bv = ael[:, None, :].expand(M, N, K), bel[None, :, :].expand(M, N, K)
    al = (ea + 127).to(torch.uint8).view(torch.float8_e8m0fnu)[:, None, :].expand(M, N, -1)
    be = (eb + 127).to(torch.uint8).view(torch.float8_e8m0fnu)[None, :, :].expand(M, N, -1)
    want = torch.zeros(M, N)
    for k0 in range(0, K, 32):
        want = op.dpa(av[..., k0:k0 + 32], bv[..., k0:k0 + 32], want,
                      al[..., k0 // 32:k0 // 32 + 1], be[..., k0 // 32:k0 // 32 + 1])
    assert same_bits(got, want)


# ---------------------------------------------------------------------------------------------
# Operands as users hold them: float32 carriers need their formats stated (a_fmt/b_fmt, a
# QTensor, a torch dtype); block scales given as tensors (ragged K, NaN, E8M0's extremes)

def _mxf8f6f4_mmasim(ael, bel, xa, xb):
    """kind::mxf8f6f4 block32 on elements ael (M, K), bel (K, N) (float8 dtypes) and E8M0
    scales xa (M, K/32), xb (K/32, N); K a multiple of 32."""
    M, K = ael.shape
    N = bel.shape[1]
    op = nv_ptx.TCGen05MMABlockScale(
        "Blackwell", f"m128n8k32.kind::mxf8f6f4.block32.f32.{PTX[ael.dtype]}.{PTX[bel.dtype]}"
        ".ue8m0")
    av, bv = ael[:, None, :].expand(M, N, K), bel.t()[None, :, :].expand(M, N, K)
    al, be = xa[:, None, :].expand(M, N, -1), xb.t()[None, :, :].expand(M, N, -1)
    want = torch.zeros(M, N)
    for k0 in range(0, K, 32):
        want = op.dpa(av[..., k0:k0 + 32], bv[..., k0:k0 + 32], want,
                      al[..., k0 // 32:k0 // 32 + 1], be[..., k0 // 32:k0 // 32 + 1])
    return want


def _e8m0(e):
    return (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


FNS = [accum.accum_matmul_reference, accum.accum_matmul]


def test_float32_fp8_operands_warn_and_their_formats_give_the_hardware_bits():
    """FP8 values in float32 tensors with hopper_fp8: nothing says they are FP8, so their
    subnormals align at float32's exponent (other bits than wgmma): a warning. Saying it (a_fmt,
    a QTensor, the torch float8 dtype) gives MMA-Sim's bits, without a warning."""
    import warnings
    import qtensor as qt
    f = accum.hopper_fp8
    ta, tb, make = CASES["hopper_fp8"][0]
    g = torch.Generator().manual_seed(0)
    M, K, N = 16, 3 * f.chunk + 5, 16
    # many subnormal values of a, products over many binades (some truncated in alignment)
    a = (torch.randn(M, K, generator=g) * 2.0 ** torch.randint(-12, 0, (M, K), generator=g))
    b = (torch.randn(K, N, generator=g) * 2.0 ** torch.randint(-8, 8, (K, N), generator=g))
    a, b = a.to(ta), b.to(tb)
    want = mmasim_chain(make, a, b, f)
    a32, b32 = a.float(), b.float()
    for fn in FNS:
        with pytest.warns(accum.OperandFormatWarning, match="hopper_fp8.*a_fmt"):
            plain = fn(a32, b32, f)
        assert not same_bits(plain, want)  # what the warning is about
        with warnings.catch_warnings():
            warnings.simplefilter("error", accum.OperandFormatWarning)
            assert same_bits(fn(a32, b32, f, a_fmt=qt.fp8_e4m3, b_fmt="fp8_e4m3"), want), fn
            assert same_bits(fn(qt.QTensor(a32, qt.fp8_e4m3), qt.QTensor(b32, qt.fp8_e4m3), f),
                             want), fn
            assert same_bits(fn(a, b, f), want), fn
            assert same_bits(fn(a32, b32, f, a_emin=-6, b_emin=-6), want), fn
            accum.accum_matmul(a32, b32, accum.hopper_bf16)  # bf16's range is float32's
        with pytest.raises(ValueError, match="not values of fp8_e5m2"):
            fn(a32, b32, f, a_fmt=qt.fp8_e5m2, b_fmt=qt.fp8_e4m3)


def test_dequantized_mx_operands_take_their_block_format():
    """MXFP8 values (elements times E8M0 scales, as qt.quantize gives them) with
    blackwell_mxf8f6f4: a_fmt=qt.mxfp8_e4m3 recovers the scales and aligns each product at its
    elements' and scales' exponents, as kind::mxf8f6f4; without it, a warning."""
    import qtensor as qt
    f = accum.blackwell_mxf8f6f4
    g = torch.Generator().manual_seed(32)
    M, K, N = 8, 128, 6
    ael, bel = operands(g, E4M3, E5M2, M, K, N, nonfinite=False)
    # each block's largest element at its format's top binade (the scale an MX quantizer
    # gives), facing a zero of the other operand
    ael[:, ::32], bel[::32] = torch.tensor(448.0).to(E4M3), 0
    ael[:, 1::32], bel[1::32] = 0, torch.tensor(57344.0).to(E5M2)
    ea = torch.randint(-20, 20, (M, K // 32), generator=g)
    eb = torch.randint(-20, 20, (K // 32, N), generator=g)
    want = _mxf8f6f4_mmasim(ael, bel, _e8m0(ea), _e8m0(eb))
    a = ael.float() * torch.exp2(ea.float()).repeat_interleave(32, 1)
    b = bel.float() * torch.exp2(eb.float()).repeat_interleave(32, 0)
    assert torch.equal(qt.quantize(a, qt.mxfp8_e4m3), a)  # a's values are MXFP8's
    for fn in FNS:
        with pytest.warns(accum.OperandFormatWarning, match="a_fmt=qt.mxfp8_e4m3"):
            fn(a, b, f)
        got = fn(a, b, f, a_fmt=qt.mxfp8_e4m3, b_fmt=qt.mxfp8_e5m2)
        assert same_bits(got, want), fn
        qa, qb = (qt.QTensor(a, qt.fp32, mm_fmt=qt.mxfp8_e4m3),
                  qt.QTensor(b, qt.fp32, mm_fmt=qt.mxfp8_e5m2.replace(axis=0)))
        assert same_bits(fn(qa, qb, f), want), fn


def test_dequantized_mxfp4_operands_take_their_block_format():
    """MXFP4 values with blackwell_mxfp4: a_fmt/b_fmt give the groups their scales' exponents
    (kind::mxf4's bits); without them (or a_gexp/a_scale), a warning."""
    import qtensor as qt
    name = "blackwell_mxfp4"
    f = accum.PRESETS[name]
    kind, shape = BLOCK_CASES[name]
    g = torch.Generator().manual_seed(33)
    a, b, (sa, ea, xa), (sb, eb, xb) = block_operands(g, kind, 6, 192, 5)
    a[:, 2::32], b[2::32] = 6.0, 0.0  # each block's max at e2m1's top binade (the MX scale)
    a[:, 3::32], b[3::32] = 0.0, -4.0
    want = mmasim_block_chain(shape, kind, a, b, xa, xb)
    ad, bd = a * sa.repeat_interleave(kind, 1), b * sb.repeat_interleave(kind, 0)
    for fn in FNS:
        with pytest.warns(accum.OperandFormatWarning, match="a_gexp"):
            fn(ad, bd, f)
        assert same_bits(fn(ad, bd, f, a_fmt=qt.mxfp4_e2m1, b_fmt=qt.mxfp4_e2m1), want), fn
        with pytest.raises(ValueError, match="group"):
            fn(ad, bd, f, a_fmt=qt.mxfp4_e2m1, b_fmt=qt.fp32)
        with pytest.raises(ValueError, match="twice"):
            fn(ad, bd, f, a_fmt=qt.mxfp4_e2m1, b_fmt=qt.mxfp4_e2m1, a_scale=sa, b_scale=sb)


def test_ragged_k_scales_take_the_block_size():
    """K = 144 with 5 scale columns: blocks of 29 to 35 elements all give 5 blocks. Without
    block_size the call is refused; with block_size=32 it is kind::mxf8f6f4 on K padded with
    zeros to 160."""
    f = accum.blackwell_mxf8f6f4
    g = torch.Generator().manual_seed(34)
    M, K, N = 6, 144, 5
    a, b = operands(g, E4M3, E4M3, M, K, N, nonfinite=False)
    xa = _e8m0(torch.randint(-20, 20, (M, 5), generator=g))
    xb = _e8m0(torch.randint(-20, 20, (5, N), generator=g))
    pa = torch.cat([a, torch.zeros(M, 16).to(E4M3)], 1)
    pb = torch.cat([b, torch.zeros(16, N).to(E4M3)], 0)
    want = _mxf8f6f4_mmasim(pa, pb, xa, xb)
    for fn in FNS:
        with pytest.raises(ValueError, match="block_size"):
            fn(a, b, f, a_scale=xa, b_scale=xb)
        assert same_bits(fn(a, b, f, a_scale=xa, b_scale=xb, block_size=32), want), fn
        with pytest.raises(ValueError, match="expected"):
            fn(a, b, f, a_scale=xa, b_scale=xb, block_size=16)  # 9 blocks, not 5


def test_nan_and_extreme_e8m0_scales_equal_mmasim():
    """E8M0's NaN code makes the outputs its block enters NaN (as the hardware's); scales at
    the ends of E8M0's range (2^127 on a, 2^-127 on b) are the hardware's products, though
    a's dequantized values exceed float32."""
    f = accum.blackwell_mxf8f6f4
    g = torch.Generator().manual_seed(35)
    M, K, N = 6, 96, 5
    a, b = operands(g, E4M3, E4M3, M, K, N, nonfinite=False)
    ea = torch.randint(-20, 20, (M, 3), generator=g)
    eb = torch.randint(-20, 20, (3, N), generator=g)
    ea[:, 1], eb[1, :] = 127, -127
    ea[2, 0] = 128  # the NaN code 0xFF
    xa, xb = _e8m0(ea), _e8m0(eb)
    assert torch.isnan(xa[2, 0].float())
    want = _mxf8f6f4_mmasim(a, b, xa, xb)
    assert torch.isnan(want[2]).all() and not torch.isnan(want[:2]).any()
    for fn in FNS:
        assert same_bits(fn(a, b, f, a_scale=xa, b_scale=xb), want), fn


def test_cdna3_bf16_negative_underflow_is_negative_zero():
    """A CDNA3 MFMA result below float32's grid keeps its sign (-0.0), as MMA-Sim's."""
    f = accum.cdna3_bf16
    ta, tb, make = CASES["cdna3_bf16"][0]
    a = torch.tensor([[-1e-30] * 16, [1e-30] * 16, [-1e-30] * 8 + [1e-30] * 8]).to(ta)
    b = torch.full((16, 3), 1e-20).to(tb)
    b[:, 1] = -1e-20
    want = mmasim_chain(make, a, b, f)
    assert (want.view(torch.int32) == -2 ** 31).any()  # -0.0 among MMA-Sim's results
    for fn in FNS:
        assert same_bits(ours(a, b, f, fn), want), fn


# ---------------------------------------------------------------------------------------------
# Signed zeros: NVIDIA's datapaths (MMA-Sim's t_fdpa/st_fdpa/gst_fdpa) return +0 for every zero
# result, a negative sum truncated to zero included; CDNA3's two stages keep the sign of a
# negative value rounded to zero by the final FP32 rounding

def _signed_zero_operands(ta, tb, K):
    """Rows of a against columns of b built to give zero sums: exactly cancelling pairs
    (b's rows come in equal pairs), -0.0 everywhere, a cancelling pair of 1s beside tiny
    products, tiny products of either sign, a first and a last product that cancel (K odd);
    c = +0.0 and -0.0."""
    sub = {F16: 2.0 ** -24, BF16: 2.0 ** -133, E4M3: 2.0 ** -9, E5M2: 2.0 ** -16,
           TF32: 2.0 ** -136, E4Z: 2.0 ** -10, E5Z: 2.0 ** -17}
    sa, sb = sub[ta], sub[tb]
    k = torch.arange(K)
    pair = torch.where(k % 2 == 0, 1.0, -1.0)
    rows = [torch.where(k < K - K % 2, pair * 0.75, -0.0),  # x, -x, x, -x, ...
            torch.full((K,), -0.0),
            torch.full((K,), sa),
            torch.where(k % 8 < 2, pair, 3 * sa),              # 1, -1, then tiny terms
            torch.where(k % 3 == 0, -0.0, pair * 2 * sa),
            # x in the first instruction, -x in the last (after the promotions)
            torch.where(k == 0, 0.75, torch.where(k == K - 1, -0.75, -0.0))]
    b_k = k // 2 * 2  # b's rows in equal pairs (k, k + 1)
    cols = [torch.ones(K), torch.full((K,), -sb), torch.full((K,), -0.0),
            torch.where(b_k % 4 == 0, 1.5, -sb), torch.full((K,), sb)]
    a = torch.stack(rows).to(ta)
    b = torch.stack(cols, 1).to(tb)
    c = torch.tensor([0.0, -0.0]).repeat(len(rows) * len(cols))[: len(rows) * len(cols)]
    return a, b, c.view(len(rows), len(cols))


@pytest.mark.parametrize("fn", ["reference", "kernel"])
@pytest.mark.parametrize("name", list(CASES))
def test_signed_zeros_equal_mmasim(name, fn):
    """Zero results carry MMA-Sim's sign for every preset: exact cancellations in a chunk and
    across chunks and promotions, -0.0 operands, negative products below the alignment's or
    float32's grid, c = +-0.0 (FP16 outputs: hopper_fp8_f16)."""
    if fn == "kernel" and not accum_kernel._kernel_ready(torch.empty(0)):
        pytest.skip("the compiled extension is not built")
    f = accum.PRESETS[name]
    run = accum.accum_matmul_reference if fn == "reference" else accum.accum_matmul
    K = f.chunk * ((f.promote or 1) + 1) + 1  # past a promotion, a short last chunk
    ta, tb, make = CASES[name][0]
    a, b, c = _signed_zero_operands(ta, tb, K)
    zeros = 0
    for cc in (None, c):
        want = mmasim_chain(make, a, b, f, c=cc)
        assert same_bits(ours(a, b, f, run, c=cc), want), (name, cc)
        zeros += int((want == 0).sum())
    assert zeros >= 10  # (the operands do give zero results)


@pytest.mark.parametrize("fn", ["reference", "kernel"])
@pytest.mark.parametrize("name", [*BLOCK_CASES, "blackwell_mxf8f6f4"])
def test_block_scaled_signed_zeros_equal_mmasim(name, fn):
    """The block-scaled presets' zero results (+0, as MMA-Sim's st_fdpa/gst_fdpa): -0.0
    elements, groups of exactly cancelling products, negative products at tiny scales."""
    if fn == "kernel" and not accum_kernel._kernel_ready(torch.empty(0)):
        pytest.skip("the compiled extension is not built")
    run = accum.accum_matmul_reference if fn == "reference" else accum.accum_matmul
    K = 128
    if name == "blackwell_mxf8f6f4":
        a, b, _ = _signed_zero_operands(E4M3, E5M2, K)
        ea = torch.tensor([[-60], [0], [-127], [3], [-100], [-60]]).expand(a.shape[0], K // 32)
        eb = torch.full((K // 32, b.shape[1]), -60)
        xa, xb = _e8m0(ea), _e8m0(eb)
        want = _mxf8f6f4_mmasim(a, b, xa, xb)
        got = run(a, b, accum.blackwell_mxf8f6f4, a_scale=xa, b_scale=xb)
    else:
        kind, shape = BLOCK_CASES[name]
        a, b, _ = _signed_zero_operands(F16, F16, K)
        a = torch.where(a.abs() < 0.5, a * 0.0, torch.sign(a.float()) * 1.5)  # FP4 values
        b = torch.where(b.abs() < 0.5, b * 0.0, torch.sign(b.float()) * 0.5).float()
        a = a.float()
        g = torch.Generator().manual_seed(3)
        sa, ea, xa = block_scales(g, (a.shape[0], K // kind), kind)
        sb, eb, xb = block_scales(g, (K // kind, b.shape[1]), kind)
        want = mmasim_block_chain(shape, kind, a, b, xa, xb)
        got = block_ours(name, kind, a, b, sa, ea, sb, eb, fn=run)
    assert int((want == 0).sum()) >= 5
    assert same_bits(got, want), name


@pytest.mark.parametrize("fn", ["reference", "kernel"])
@pytest.mark.parametrize("name", list(accum.PRESETS))
def test_empty_k_returns_c_bits(name, fn):
    """K = 0: no instruction runs and the output is c itself, -0.0 included (MMA-Sim's dpa
    returns C; the reference and the CDNA3 kernel gave +0.0 for -0.0)."""
    if fn == "kernel" and not accum_kernel._kernel_ready(torch.empty(0)):
        pytest.skip("the compiled extension is not built")
    f = accum.PRESETS[name]
    run = accum.accum_matmul_reference if fn == "reference" else accum.accum_matmul
    c = torch.tensor([[0.0, -0.0, -1.5], [-0.0, 2.0 ** -149, -2.0 ** -149]])
    got = run(torch.zeros(2, 0), torch.zeros(0, 3), f, c=c)
    assert same_bits(got, c), name
    if name in CASES and f.promote is None:  # MMA-Sim's chain (with promotion it restarts at 0)
        ta, tb, make = CASES[name][0]
        want = mmasim_chain(make, torch.zeros(2, 0).to(ta), torch.zeros(0, 3).to(tb), f, c=c)
        if f.acc_emax != 15:
            assert same_bits(got, want), name

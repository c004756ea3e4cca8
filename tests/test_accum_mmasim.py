"""qt.accum against MMA-Sim (microsoft/MMA-Sim, PyPI ``mmasim``): every preset bit for bit.

MMA-Sim models each instruction bit-accurately (arXiv 2511.10909v2, validated on real GPUs).
Operands are drawn as codes of the instruction's input formats: random codes over the whole
range (subnormals, inf, NaN), moderate values, zeros, explicit subnormals and exactly cancelling
pairs. A chain runs one instruction per ``chunk`` K-elements, each output the next one's
accumulator input, promoted into a float32 add every ``promote`` instructions (CUTLASS,
DeepGEMM). K not a multiple of the chunk: MMA-Sim sees the operands zero-padded (as a kernel
pads K to the instruction's K).
"""
import zlib

import pytest
import torch

from qtensor import accum

mmasim = pytest.importorskip("mmasim")
from mmasim import nv_ptx  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
F16, BF16 = torch.float16, torch.bfloat16
EMIN = {F16: -14, BF16: -126, E4M3: -6, E5M2: -14}  # minimum normal exponents
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
    return c


CASES = _cases()


def draw(g, dtype, shape, nonfinite=True):
    """Codes of dtype: a mixture of the whole code range, moderate values, zeros, subnormals."""
    nbits = 8 if dtype in (E4M3, E5M2) else 16
    man = {F16: 10, BF16: 7, E4M3: 3, E5M2: 2}[dtype]
    codes = torch.randint(0, 1 << nbits, shape, generator=g)
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
    return _view(codes, dtype)


def _view(codes, dtype):
    if dtype in (E4M3, E5M2):
        return codes.to(torch.uint8).view(dtype)
    return codes.to(torch.int32).to(torch.int16).view(dtype)  # wraps to the 16-bit pattern


def _codes(x, nbits):
    return (x.view(torch.uint8) if nbits == 8 else x.view(torch.int16)).to(torch.int64) & (
        (1 << nbits) - 1)


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
    acc = torch.zeros(M, N)
    p = torch.zeros(M, N) if c is None else c.clone()
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

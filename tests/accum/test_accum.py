"""qt.accum's compiled kernel against the reference, bit for bit (compared as int32 patterns):
the one-stage datapaths, the float32/int32 fast path, full float32 operands, the lean tiles, AMD
CDNA3's two stages and the group datapaths; the ops' fakes and opcheck, and the other ISAs.
"""
import itertools
import math
import os
import types
import zlib

import pytest
import torch

import qtensor as qt
from qtensor import accum
from qtensor.accum import blocks as accum_blocks
from qtensor.accum import kernel as accum_kernel
from qtensor.accum import reference as accum_reference
from qtensor.accum.format import AccumFormat

from accum_cases import (FORMATS, INPUTS, _bits_eq, _cancelling, _fp4, _random, _spread,
    _subnormal, bits, oracle)


# ---------------------------------------------------------------------------------------------
# The compiled kernel: the reference's bits, the op's fake implementation, opcheck

needs_kernel = pytest.mark.skipif(
    not (qt.kernels.ops.kernels_available() and hasattr(torch.ops.qtensor, "accum_matmul")),
    reason="the compiled qtensor._C extension (with accum_matmul) is not built")


@needs_kernel
@pytest.mark.parametrize("kind", list(INPUTS) + ["fp4", "batched", "nonfinite"])
@pytest.mark.parametrize("f", FORMATS, ids=str)
def test_kernel_equals_reference(f, kind):
    g = torch.Generator().manual_seed(zlib.crc32(f"{f}{kind}kernel".encode()))
    if kind == "fp4":
        a, b = _fp4(g, 5, 256, 70)
    elif kind == "batched":
        a, b = _random(g, 6, 130, 67, "fp8_e5m2")
        a, b = a.reshape(2, 3, 130), b.reshape(1, 130, 67).expand(2, 130, 67)
    elif kind == "nonfinite":
        a, b = _random(g, 4, 100, 3)
        a[0, 7], a[1, 40], b[90, 2], a[3, 3], b[3, 0] = math.inf, math.nan, -math.inf, 0.0, \
            math.inf
        a[2, 64:] = 1e38  # overflow of the accumulator format
        b[64:, 1] = 1e38
    else:
        a, b = INPUTS[kind](g)
    want = accum.accum_matmul_reference(a, b, f)
    got = accum.accum_matmul(a, b, f)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(bits(got), bits(want))


def _c_case(g, f, kind):
    """Operands and an initial accumulator for the vector paths with c: rows in blocks of 4 and
    a remainder, columns past a lane panel, a batch; c with zeros, tiny, huge and opposite
    values (and inf/NaN for "nonfinite")."""
    if kind == "fp4":
        a, b = _fp4(g, 7, 200, 19)
    else:
        a, b = _random(g, 7, 150, 19, "fp8_e4m3" if kind == "fp8" else None)
    a, b = a.reshape(1, 7, -1).expand(2, 7, -1).clone(), b
    a[1] *= -0.75
    c = torch.randn(2, 7, 19, generator=g) * torch.exp2(
        torch.randint(-30, 30, (2, 7, 19), generator=g).float())
    c[:, 0] = 0.0
    c[:, 1, :5] = 2.0 ** -140
    c[:, 2, :5] = 1e30
    c[0, 3] = -accum.accum_matmul_reference(a[0, 3:4], b, f)[0]  # cancels the whole sum
    if kind == "nonfinite":
        c[0, 4, 2], c[1, 5, 3], c[1, 6, 0] = math.inf, math.nan, -math.inf
    return a, b, c


@needs_kernel
@pytest.mark.parametrize("kind", ["random", "fp8", "fp4", "nonfinite"])
@pytest.mark.parametrize("f", FORMATS, ids=str)
def test_kernel_initial_accumulator_equals_reference(f, kind):
    """c runs the double lanes and the group tiles (no longer the scalar path): the same bits
    as the reference, with and without group exponents."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{f}{kind}c".encode()))
    a, b, c = _c_case(g, f, kind)
    want = accum.accum_matmul_reference(a, b, f, c=c)
    assert torch.equal(bits(accum.accum_matmul(a, b, f, c=c)), bits(want))
    if f.group > 1:
        K = a.shape[-1]
        ga = torch.randint(-5, 5, (2, 7, -(-K // f.group)), generator=g)
        gb = torch.randint(-5, 5, (-(-K // f.group), 19), generator=g)
        want = accum.accum_matmul_reference(a, b, f, c=c, a_gexp=ga, b_gexp=gb)
        got = accum.accum_matmul(a, b, f, c=c, a_gexp=ga, b_gexp=gb)
        assert torch.equal(bits(got), bits(want))
    empty = accum.accum_matmul(a[..., :0], b[:0], f, c=c)  # K = 0: c itself
    assert torch.equal(bits(empty), bits(c))


@needs_kernel
@pytest.mark.parametrize("isa", ["base", "avx2"])
def test_kernel_initial_accumulator_on_other_isas(isa):
    _pytest_under_isa(isa, "test_kernel_initial_accumulator_equals_reference and "
                           "(hopper_fp8 or blackwell_mxfp4 or ampere_bf16) and (fp8 or fp4)")


@needs_kernel
def test_kernel_large_and_strided():
    g = torch.Generator().manual_seed(0)
    a, b = _random(g, 37, 1000, 129, "fp8_e4m3")
    for f in (accum.hopper_fp8, accum.ampere_bf16):
        want = accum.accum_matmul_reference(a.t().contiguous().t(), b, f)
        got = accum.accum_matmul(a.t().contiguous().t(), b.t().contiguous().t(), f)
        assert torch.equal(bits(got), bits(want))


@needs_kernel
def test_kernel_opcheck_and_fake():
    a, b = torch.randn(2, 3, 40), torch.randn(2, 40, 5)
    args = (a, b, *accum_kernel.op_args(accum.hopper_fp8), None, None, None)
    torch.library.opcheck(torch.ops.qtensor.accum_matmul.default, args)
    # with group exponents and an initial accumulator (the scalar path)
    ga, gb = torch.zeros(2, 3, 3, dtype=torch.int32), torch.zeros(2, 3, 5, dtype=torch.int32)
    torch.library.opcheck(torch.ops.qtensor.accum_matmul.default,
                          (a, b, *accum_kernel.op_args(accum.blackwell_mxfp4), ga, gb,
                           torch.randn(2, 3, 5)))
    with torch._subclasses.fake_tensor.FakeTensorMode():
        out = torch.ops.qtensor.accum_matmul(torch.empty(2, 3, 40), torch.empty(2, 40, 5),
                                             *args[2:])
        assert out.shape == (2, 3, 5) and out.dtype == torch.float32


@needs_kernel
def test_kernel_argument_errors():
    a, b = torch.randn(1, 3, 8), torch.randn(1, 8, 2)
    good = list(accum_kernel.op_args(accum.hopper_fp16)) + [None, None, None]
    with pytest.raises(RuntimeError, match=r"frac_bits must be in \[0, 46\] for chunk=16, "
                                           r"group=1, got 60"):
        torch.ops.qtensor.accum_matmul(a, b, *good[:1], 60, *good[2:])
    with pytest.raises(RuntimeError, match=r"must be float32, got Double"):
        torch.ops.qtensor.accum_matmul(a.double(), b, *good)
    with pytest.raises(RuntimeError, match=r"do not multiply"):
        torch.ops.qtensor.accum_matmul(a, b[:, :5], *good)


def _check_subnormal_results(a, b, f):
    """a @ b with f has results in float32's subnormal range: the kernel gives the reference's
    bits, with torch.set_flush_denormal(True) too (both flushed)."""
    want = accum.accum_matmul_reference(a, b, f)
    assert (want != 0).any() and (want.abs() < 2.0 ** -126).any()
    assert torch.equal(bits(accum.accum_matmul(a, b, f)), bits(want))
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        got = accum.accum_matmul(a, b, f)
        want = accum.accum_matmul_reference(a, b, f)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(bits(got), bits(want))


def _run_under_isa(isa, code):
    """Run python code in a subprocess whose kernels are capped at QTENSOR_CPU_ISA=isa (the ISA
    is chosen once per process)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, QTENSOR_CPU_ISA=isa),
                       cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]


def _pytest_under_isa(isa, selection):
    """Run this file's tests selected by ``-k selection`` under QTENSOR_CPU_ISA=isa."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.abspath(__file__), "-k", selection],
                       env=dict(os.environ, QTENSOR_CPU_ISA=isa), cwd=root, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


@needs_kernel
def test_kernel_baseline_isa_path():
    # the loops are compiled for the baseline and for AVX2; QTENSOR_CPU_ISA=base forces the first
    code = (
        "import sys, torch; sys.path[:0] = ['tests', 'tests/accum']; import test_accum as T\n"
        "from qtensor import accum\n"
        "for f in T.FORMATS:\n"
        "    for kind in T.INPUTS:\n"
        "        a, b = T.INPUTS[kind](torch.Generator().manual_seed(3))\n"
        "        want = accum.accum_matmul_reference(a, b, f)\n"
        "        got = accum.accum_matmul(a, b, f)\n"
        "        assert torch.equal(T.bits(got), T.bits(want)), (f, kind)\n")
    _run_under_isa("base", code)


@pytest.mark.skipif(not torch.cuda.is_available() or not qt.kernels.ops.kernels_available("cuda"),
                    reason="needs CUDA and the CUDA kernels")
@pytest.mark.parametrize("f", FORMATS, ids=str)
def test_cuda_kernel_equals_reference(f):
    g = torch.Generator().manual_seed(11)
    for kind in INPUTS:
        a, b = INPUTS[kind](g)
        want = accum.accum_matmul_reference(a, b, f)
        assert torch.equal(bits(accum.accum_matmul(a.cuda(), b.cuda(), f).cpu()), bits(want))


# ---------------------------------------------------------------------------------------------
# The kernel's float32/int32 fast path (csrc/cpu/accum_fast.h, AVX-512 CPUs): taken when every
# product is exact and normal in float32 and a chunk's terms sum in int32, with a fallback to the
# double path for a tile whose emax or sums leave that range. The same calls run the double path
# where the fast one is refused (or under QTENSOR_CPU_ISA), so each must give the reference's bits.

FAST_FORMATS = [
    accum.hopper_fp8, accum.hopper_fp8_fast, accum.hopper_bf16, accum.volta_fp16,
    AccumFormat(chunk=32, frac_bits=13, align_rounding="floor", acc_man=13, promote=4),
    AccumFormat(chunk=32, frac_bits=13, align_rounding="nearest", acc_rounding="nearest"),
    AccumFormat(chunk=16, frac_bits=25, align_rounding="nearest", acc_rounding="nearest"),
    AccumFormat(chunk=16, frac_bits=10, align_rounding="floor", acc_in_alignment=False,
                acc_man=10, acc_rounding="nearest", promote=3),
    AccumFormat(chunk=8, frac_bits=3, align_rounding="nearest", acc_man=5),
    AccumFormat(chunk=24, frac_bits=0, align_rounding="floor", acc_man=2, promote=2),
    AccumFormat(chunk=16, frac_bits=28, acc_in_alignment=False),  # the widest terms it takes
    # the other two pairings of p in/out of the alignment and the accumulator rounding (the
    # AVX2 build compiles each pairing apart: accum_fast.h's FIN)
    AccumFormat(chunk=16, frac_bits=20, align_rounding="nearest", acc_man=12,
                acc_rounding="nearest"),
    AccumFormat(chunk=32, frac_bits=16, align_rounding="floor", acc_in_alignment=False,
                acc_rounding="nearest", promote=2),
    # chunks whose sums can pass 2^31 (two int32 halves, the finish in doubles: accum_fast.h's
    # finish_wide), toward zero to 24 or fewer bits or to nearest 24 bits
    accum.blackwell_f8f6f4,
    AccumFormat(chunk=32, frac_bits=26, align_rounding="floor", acc_man=13, promote=2),
    AccumFormat(chunk=24, frac_bits=25, align_rounding="nearest", acc_rounding="nearest",
                acc_in_alignment=False),
    # an FP16 accumulator (its subnormal grid, p's clamp at -14, e_zero -21 checked per chunk)
    accum.hopper_fp8_f16,
    accum.hopper_fp8_f16.replace(align_rounding="floor", promote=2),
    accum.hopper_fp8_f16.replace(acc_in_alignment=False, e_zero=None),
]
FAST_OPERANDS = ["fp8_e4m3", "fp8_e5m2", "bf16", "fp16", "fp6_e2m3", "fp4_e2m1"]


def _fast_case(seed, M, K, N, fmt):
    """Operands of format fmt with zero rows, columns and runs, and mixed signs."""
    g = torch.Generator().manual_seed(seed)
    a, b = _random(g, M, K, N, fmt)
    a[1 % M, 5:30] = 0.0
    b[:, 3 % N] = 0.0
    b[10:20] *= -1.0
    return a, b


@needs_kernel
@pytest.mark.parametrize("fmt", FAST_OPERANDS)
@pytest.mark.parametrize("f", FAST_FORMATS, ids=str)
def test_fast_path_equals_reference(f, fmt):
    # M = 7: an 8-row tile cut short (two 4-row exponent groups, the second partial); K = 77: a
    # partial last chunk for every chunk size; N = 37: two 16-lane panels and a partial one
    a, b = _fast_case(zlib.crc32(f"{f}{fmt}fast".encode()), 7, 77, 37, fmt)
    want = accum.accum_matmul_reference(a, b, f)
    assert torch.equal(bits(accum.accum_matmul(a, b, f)), bits(want))


@needs_kernel
@pytest.mark.parametrize("in_alignment", [True, False])
@pytest.mark.parametrize("rounding", accum.ALIGN_ROUNDINGS)
def test_fast_path_tiny_terms(rounding, in_alignment):
    """Products 2^-40 .. 2^40 apart: most terms are scaled far below 1, where toward_zero and
    nearest give 0 and floor gives -1 for a negative one; the partial p is often the largest."""
    g = torch.Generator().manual_seed(7)
    a, b = _random(g, 9, 200, 21, "fp8_e4m3")
    a = a * 2.0 ** torch.randint(-20, 21, a.shape, generator=g).float()
    b = b * 2.0 ** torch.randint(-20, 21, b.shape, generator=g).float()
    for promote in (None, 2):
        f = AccumFormat(chunk=32, frac_bits=13, align_rounding=rounding, acc_man=13,
                        acc_in_alignment=in_alignment, promote=promote)
        want = accum.accum_matmul_reference(a, b, f)
        assert torch.equal(bits(accum.accum_matmul(a, b, f)), bits(want)), promote


@needs_kernel
@pytest.mark.parametrize("f", [accum.hopper_fp8, accum.hopper_bf16,
                               AccumFormat(chunk=4, frac_bits=2, align_rounding="floor")], ids=str)
def test_fast_path_boundaries(f):
    """Operands at the edges of the fast path's range, and past them (double path or tile
    fallback): each must keep the reference's bits."""
    g = torch.Generator().manual_seed(11)
    cases = {}
    a, b = _random(g, 5, 64, 18, "bf16")
    # the largest significands, all one sign: the int32 sums come closest to 2^31
    cases["full sums"] = (torch.full((5, 64), 2 - 2 ** -7), torch.full((64, 18), 2 - 2 ** -7))
    # a partial just below the largest product's alignment exponent, then a chunk of the largest
    # products: with p's term the sum comes to 2^31 (hopper_bf16: those tiles fall back)
    x = torch.zeros(5, 64)
    y = torch.zeros(64, 18)
    x[:, 0], y[0] = 1.5 * 2.0 ** 6, 2.0 ** 4
    x[:, 16:32], y[16:32] = (2 - 2 ** -7) * 2.0 ** 5, (2 - 2 ** -7) * 2.0 ** 5
    cases["p's term at 2^31"] = (x, y)
    # products above 2^frac_bits (the scale is a multiply) with zero products among them
    z = a.clone()
    z[:, ::3] = 0.0
    cases["large products, zeros"] = (z * 2.0 ** 20, b * 2.0 ** 20)
    # emax growing past the fast path's limit in some rows only (those tiles fall back)
    big = a.clone()
    big[2:4, 40:] *= 2.0 ** 60
    cases["emax limit"] = (big, b * 2.0 ** 50)
    # products at float32's ends: the exponent checks of the glue
    cases["tiny products"] = (a * 2.0 ** -60, b * 2.0 ** -60)
    cases["huge products"] = (a * 2.0 ** 60, b * 2.0 ** 60)
    cases["overflow"] = (a * 2.0 ** 63, b * 2.0 ** 63)
    cases["subnormal operand"] = (torch.where(a == a.max(), 2.0 ** -130, a), b)
    cases["float32 operand"] = (a, torch.randn(64, 18, generator=g))
    cases["fp16 x bf16"] = (qt.quantize(a, "fp16"), b)
    cases["float32 x fp4"] = (torch.randn(5, 64, generator=g), qt.quantize(b, "fp4_e2m1"))
    cases["nonfinite"] = (torch.where(a == a.max(), math.inf, a), b)
    cases["zeros"] = (torch.zeros(5, 64), b)
    cases["K = 0"] = (torch.zeros(5, 0), torch.zeros(0, 18))
    for name, (x, y) in cases.items():
        want = accum.accum_matmul_reference(x, y, f)
        assert torch.equal(bits(accum.accum_matmul(x, y, f)), bits(want)), name


@needs_kernel
@pytest.mark.parametrize("f", [accum.hopper_fp8_f16, accum.hopper_fp8_f16.replace(promote=2),
                               accum.blackwell_f8f6f4], ids=str)
def test_fast_path_narrow_and_split_edges(f):
    """The fast path's FP16 accumulator (hopper_fp8_f16) and split sums (blackwell_f8f6f4) at
    their edges, each with the reference's bits: chunks whose products are all below e_zero
    (2^-21: a zero product or padding slot sets emax there; the tile is redone), FP16 subnormal
    and overflowing partials (inf: redone), partials that cancel to 0 mid-K, sums near 2^32."""
    g = torch.Generator().manual_seed(31)
    a, b = _random(g, 9, 100, 20, "fp8_e4m3")
    cases = {}
    tiny = a.clone()
    tiny[:4] *= 2.0 ** -9  # products down to 2^-36: below e_zero, some chunks only these
    tiny[2, 32:64] = 0.0
    cases["below e_zero"] = (tiny, b * 2.0 ** -6)
    cases["fp16 subnormal results"] = (a * 2.0 ** -7, b * 2.0 ** -6)
    big = a.clone()
    big[3:5] = 448.0
    cases["fp16 overflow"] = (big, b.abs() * 2.0 ** 4)
    x, y = a.clone(), b.clone()
    x[:, 32:64], y[32:64] = 1.0, 0.0
    x[:, 0:32], y[0:16], y[16:32] = 2.0, 3.0, -3.0  # the first chunk cancels: p = 0
    cases["p cancels"] = (x, y)
    cases["full sums"] = (torch.full((9, 100), 448.0), torch.full((100, 20), -448.0))
    for name, (x, y) in cases.items():
        x, y = qt.quantize(x, "fp8_e4m3"), qt.quantize(y, "fp8_e4m3")
        want = accum.accum_matmul_reference(x, y, f)
        assert torch.equal(bits(accum.accum_matmul(x, y, f)), bits(want)), name


@needs_kernel
@pytest.mark.parametrize("f", [accum.blackwell_mxf8f6f4, accum.hopper_fp8,
                               accum.hopper_fp8_f16], ids=str)
def test_fast_path_per_element_clamps(f):
    """Per-element clamps (a_emin/b_emin tensors: MX operands' block minimum normal exponents,
    which QTensor contractions pass where an element is subnormal) in the fast path's int8
    exponents and in the tiles it redoes: the reference's bits, for MXFP8 operands with subnormal
    elements and for random clamps."""
    g = torch.Generator().manual_seed(17)
    a = torch.randn(9, 96, generator=g)
    a[:, ::5] *= 2.0 ** -15  # E4M3 subnormals in their blocks
    b = torch.randn(96, 20, generator=g) * 2.0 ** torch.randint(-4, 4, (96, 1), generator=g)
    fa = qt.formats.format("mxfp8_e4m3")
    qa, qb = qt.quantize(a, fa), qt.quantize(b.t(), fa).t()
    oa, ob = (types.SimpleNamespace(mm_fmt=fa) for _ in range(2))
    ea, eb = accum_blocks._mx_emin(qa, oa, -1), accum_blocks._mx_emin(qb, ob, -2)
    assert ea is not None and eb is not None
    for x, y in ((ea, eb), (ea, None), (torch.randint(-30, 0, (9, 96), generator=g),
                                        torch.randint(-30, 0, (96, 20), generator=g))):
        want = accum.accum_matmul_reference(qa, qb, f, a_emin=x, b_emin=y)
        got = accum.accum_matmul(qa, qb, f, a_emin=x, b_emin=y)
        assert torch.equal(bits(got), bits(want))


@needs_kernel
def test_fast_path_batched_and_strided():
    g = torch.Generator().manual_seed(5)
    a, b = _random(g, 3 * 36, 100, 50, "fp8_e4m3")  # 36 rows: four 8-row tiles and a 4-row one
    a, b = a.reshape(3, 36, 100), b.t().contiguous().t()
    for f in (accum.hopper_fp8, accum.hopper_bf16):
        want = accum.accum_matmul_reference(a, b, f)
        assert torch.equal(bits(accum.accum_matmul(a, b, f)), bits(want))


@needs_kernel
@pytest.mark.parametrize("isa", ["base", "avx2"])
def test_fast_path_cases_on_other_isas(isa):
    """QTENSOR_CPU_ISA caps the instruction set: the same cases through the double lanes (base)
    or the AVX2 fast path (avx2; all of its cases: test_fast_path_avx2)."""
    code = (
        "import sys, torch, zlib; sys.path[:0] = ['tests', 'tests/accum']; import test_accum as T\n"
        "from qtensor import accum\n"
        "for f in T.FAST_FORMATS:\n"
        "    for fmt in T.FAST_OPERANDS[:3]:\n"
        "        a, b = T._fast_case(zlib.crc32(f'{f}{fmt}'.encode()), 5, 40, 19, fmt)\n"
        "        want = accum.accum_matmul_reference(a, b, f)\n"
        "        got = accum.accum_matmul(a, b, f)\n"
        "        assert torch.equal(T.bits(got), T.bits(want)), (f, fmt)\n")
    _run_under_isa(isa, code)


@needs_kernel
def test_fast_path_avx2():
    """The AVX2 fast path (csrc/cpu/accum_fast_avx2.h: 8 lanes, no embedded rounding, exponent
    arithmetic in place of getexp/scalef) on every test_fast_path_* case of this file (all three
    alignment roundings, p in and out of the alignment, promotion, boundary operands, tiles that
    fall back, flush-denormal), bit for bit against the reference: pytest in a subprocess with
    QTENSOR_CPU_ISA=avx2. On an AVX-512 CPU the tests above run the AVX-512 build of the same
    algorithm; on an AVX2-only CPU this repeats them."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU has no AVX2")
    _pytest_under_isa("avx2", "fast_path and not on_other_isas and not avx2")


@needs_kernel
def test_fast_path_with_flush_denormal():
    """Results in float32's subnormal range (the accumulator format's grid goes below 2^-126):
    with torch.set_flush_denormal(True) the kernel still gives the reference's bits."""
    g = torch.Generator().manual_seed(9)
    a, b = _random(g, 6, 96, 20, "fp8_e4m3")
    a, b = a * 2.0 ** -60, b * 2.0 ** -60
    f = AccumFormat(chunk=32, frac_bits=13, acc_man=13, promote=2)
    _check_subnormal_results(a, b, f)


# ---------------------------------------------------------------------------------------------
# Full float32 operands (up to 24 + 24 significant bits): products exact in double, not in
# float32, so no fast path; the double lanes (csrc/cpu/accum_lanes.h's dot_lanes: on AVX-512 one
# zmm per 8 outputs, the terms converted to int64 with the alignment rounding and summed in int64)
# must give the reference's bits over the whole range: exponent spread, cancellation, products at
# float32's and the format's ends, subnormal and non-finite operands.

FP32_FORMATS = FAST_FORMATS + [
    AccumFormat(chunk=8, frac_bits=47, align_rounding="nearest"),  # terms near 2^49 (int64)
    AccumFormat(chunk=2, frac_bits=49, align_rounding="floor", acc_in_alignment=False, promote=3),
]


def _fp32_cases(seed):
    g = torch.Generator().manual_seed(seed)

    def spread(*shape, lo=-60, hi=61):
        return torch.randn(*shape, generator=g) * 2.0 ** torch.randint(lo, hi, shape, generator=g)
    a, b = _random(g, 9, 77, 21)  # a 9-row tile and 3 panels cut short, a partial last chunk
    cases = {"random": (a, b), "spread": (spread(5, 90), spread(90, 11))}
    c = torch.randn(4, 64, generator=g)  # +-pairs of products that cancel, small ones between
    c[:, 1::2] = -c[:, ::2] * (1 + 2.0 ** -23)
    cases["cancelling"] = (c, torch.randn(64, 9, generator=g).repeat_interleave(2, 0)[:64]
                           * torch.where(torch.arange(64) % 4 < 2, 1.0, 2.0 ** -30)[:, None])
    cases["huge products"] = (a * 2.0 ** 100, b * 2.0 ** 27)  # near 2^127: beyond fp32's sums
    cases["tiny products"] = (a * 2.0 ** -100, b * 2.0 ** -40)  # below 2^-126, exact in double
    cases["float32 ends"] = (spread(6, 40, lo=-149, hi=128), spread(40, 10, lo=-149, hi=128))
    x, y = _subnormal(g, 5, 40, 12)
    cases["subnormal"] = (x, y * torch.randn(40, 12, generator=g))
    nf = a.clone()
    nf[0, 3], nf[2, 10], nf[3, 20] = math.inf, -math.inf, math.nan
    zb = b.clone()
    zb[3, :4] = 0.0  # inf * 0: NaN
    cases["nonfinite"] = (nf, zb)
    return cases


@needs_kernel
@pytest.mark.parametrize("f", FP32_FORMATS, ids=str)
def test_fp32_operands_equal_reference(f):
    for name, (a, b) in _fp32_cases(zlib.crc32(f"{f}fp32".encode())).items():
        want = accum.accum_matmul_reference(a, b, f)
        assert torch.equal(bits(accum.accum_matmul(a, b, f)), bits(want)), name


@needs_kernel
def test_fp32_operands_batched_strided_and_every_rounding():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(2, 20, 130, generator=g)
    b = torch.randn(2, 37, 130, generator=g).transpose(1, 2)  # strided
    for rounding, in_alignment, promote in itertools.product(
            accum.ALIGN_ROUNDINGS, (True, False), (None, 2)):
        f = AccumFormat(chunk=32, frac_bits=20, align_rounding=rounding, acc_man=13,
                        acc_in_alignment=in_alignment, promote=promote)
        want = accum.accum_matmul_reference(a, b, f)
        assert torch.equal(bits(accum.accum_matmul(a, b, f)), bits(want)), f


@needs_kernel
@pytest.mark.parametrize("isa", ["base", "avx2"])
def test_fp32_operands_on_other_isas(isa):
    """The tests above under QTENSOR_CPU_ISA=base|avx2 (the baseline and AVX2 double lanes), in a
    subprocess."""
    _pytest_under_isa(isa, "fp32_operands and not other_isas")


@needs_kernel
def test_fp32_operands_recipe_accumulate():
    """A model converted with a float32 weight role and an accumulator: its contractions take
    the unrounded float32 operands (no fast path) and give the reference's bits."""
    recipe = qt.Recipe(weight="fp32", accumulate=accum.hopper_bf16)
    torch.manual_seed(0)
    model = qt.convert(torch.nn.Linear(300, 5, bias=False), recipe)
    assert model.weight.accum is accum.hopper_bf16
    x = torch.randn(33, 300, generator=torch.Generator().manual_seed(4))
    W = model.weight.dequantize().detach()
    assert W.view(torch.int32).bitwise_and(0xFFFF).any()  # wider than bf16: full float32
    y = model(x)
    want = accum.accum_matmul_reference(x, W.t(), accum.hopper_bf16)
    assert _bits_eq(y, want)
    assert not _bits_eq(y, x @ W.t())  # the accumulator took part


@needs_kernel
@pytest.mark.parametrize("flush", [False, True])
def test_fast_path_floor_of_a_subnormal_term(flush):
    """floor aligns a tiny negative partial to -1: here p = -2^-126 (two products of 2^-113
    cancelling under floor) meets products of 2^14, so p's scaled term is -2^-127, subnormal
    (flushed to -0 under torch.set_flush_denormal), whose floor is still -1."""
    a = torch.tensor([[(1 + 2 ** -10) * 2.0 ** -56, 2.0 ** -56, 2.0 ** 7, 2.0 ** 7]])
    b = torch.tensor([[-(1 + 2 ** -10) * 2.0 ** -57], [(1 + 2 ** -9) * 2.0 ** -57], [2.0 ** 7],
                      [2.0 ** 6]]).expand(4, 17).contiguous()
    f = AccumFormat(chunk=2, frac_bits=13, align_rounding="floor")
    want = accum.accum_matmul_reference(a, b, f)
    assert want[0, 0].item() == 2.0 ** 14 + 2.0 ** 13 - 2.0 ** 1  # the -1 at 2^(14 - 13)
    if flush and not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        got = accum.accum_matmul(a, b, f)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(bits(got), bits(want))


# The lean tiles (csrc/cpu/accum_fast.h's lean_tile): full 8-row tiles of the NVIDIA presets'
# datapath (alignment and result toward zero, p in the alignment, a float32 accumulator), the
# chunk a compile-time constant for 4, 8, 16 and 32 (else read at run time), the emax checks once
# per chunk over the 8 rows. The other tests above mostly use 5-7 rows (no full tile).
LEAN_FORMATS = [
    (accum.volta_fp16, "fp16"), (accum.ampere_tf32, "tf32"), (accum.ampere_bf16, "bf16"),
    (accum.hopper_fp16, "fp16"), (accum.hopper_fp8, "fp8_e4m3"), (accum.ada_fp8, "fp8_e5m2"),
    (accum.hopper_fp8_fast, "fp8_e4m3"), (accum.blackwell_tf32, "tf32"),
    (AccumFormat(chunk=5, frac_bits=11, acc_man=7, promote=3), "bf16"),  # chunk at run time
    (AccumFormat(chunk=4, frac_bits=9, acc_man=4, promote=1), "fp8_e4m3"),  # every chunk promotes
]


def _lean_cases(g, fmt, M=17, K=77, N=37):
    """Operands of format fmt (M = 17: two full 8-row tiles and one row; K = 77: a short last
    chunk for every chunk size; N = 37: a partial 16-lane panel), each stressing one step."""
    def q(x):
        return qt.quantize(x, fmt)
    a, b = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g)
    cases = {"random": (q(a), q(b))}
    ea = torch.randint(-10, 11, (M, K), generator=g).float()
    eb = torch.randint(-10, 11, (K, N), generator=g).float()
    cases["exponent spread"] = (q(a * 2.0 ** ea), q(b * 2.0 ** eb))
    # the format's subnormals (normal in float32): their alignment exponents are clamped
    tiny = {"fp16": -16, "tf32": -128, "bf16": -128, "fp8_e4m3": -8, "fp8_e5m2": -16}[fmt]
    sub = a.clone()
    sub[:, ::3] *= 2.0 ** (tiny - 2)
    if fmt in ("tf32", "bf16"):  # float32 subnormals: the double path (not the fast one)
        sub[:, ::3] = torch.where(sub[:, ::3].abs() < 2.0 ** -126, 2.0 ** -126, sub[:, ::3])
    cases["subnormal operands"] = (q(sub), q(b * 2.0 ** (tiny // 2)))
    # zero rows, columns, a whole zero chunk in some rows (p alone sets emax there)
    z, zb = a.clone(), b.clone()
    z[3], z[9:12, 8:40], zb[:, 5], zb[60:] = 0.0, 0.0, 0.0, 0.0
    cases["zeros"] = (q(z), q(zb))
    # exact cancellation: the first chunks' products cancel (p = 0), then small products
    c, cb = a.clone() * 2.0 ** -6, b.clone()
    c[:, 0:16] = 3.0
    cb[0:8], cb[8:16] = 5.0, -5.0
    c[10:, 0:16:2] *= -1.0
    cases["cancellation"] = (q(c), q(cb))
    # a large partial swamping small later products (p sets emax), and the reverse
    d = a.clone()
    d[:, :8] *= 2.0 ** 8
    d[8:, -8:] *= 2.0 ** 9
    cases["partial dominates"] = (q(d), q(b))
    # emax of F or more (the scale a float32 multiply, not an exponent add); fp8: its largest
    big = {"fp8_e4m3": 2.0 ** 7, "fp8_e5m2": 2.0 ** 13}.get(fmt, 2.0 ** 13)
    cases["large products"] = (q(a * big), q(b * big))
    if fmt in ("bf16", "tf32"):  # emax past the fast path's limit in some rows: tiles redone
        e = a.clone()
        e[2:4, 40:] *= 2.0 ** 60
        cases["emax limit"] = (q(e), q(b * 2.0 ** 50))
    n = a.clone()
    n[4, 7] = math.inf
    cases["nonfinite"] = (q(n), q(b))
    cases["K = 3"] = (q(a[:, :3]), q(b[:3]))
    cases["K = 64"] = (q(a[:, :64]), q(b[:64]))
    return cases


@needs_kernel
@pytest.mark.parametrize("f, fmt", LEAN_FORMATS, ids=str)
def test_fast_path_lean_tiles(f, fmt):
    g = torch.Generator().manual_seed(zlib.crc32(f"lean{f}{fmt}".encode()))
    for name, (a, b) in _lean_cases(g, fmt).items():
        want = accum.accum_matmul_reference(a, b, f)
        assert torch.equal(bits(accum.accum_matmul(a, b, f)), bits(want)), name
    # batched, with the tiles at other rows of a
    a, b = _lean_cases(g, fmt, M=24, K=40, N=16)["exponent spread"]
    a, b = a.reshape(3, 8, 40), b.expand(3, 40, 16)
    assert torch.equal(bits(accum.accum_matmul(a, b, f)),
                       bits(accum.accum_matmul_reference(a, b, f)))


# ---------------------------------------------------------------------------------------------
# AMD CDNA3 (stages "cdna3" / "cdna3_fp8"): the kernel (csrc/cpu/accum_cdna3.cpp: the two-stage
# step lane-wise, step_general for a lane with inf/NaN, a nonfinite partial or a product that
# may reach 2^128) against the reference, bit for bit; tests/accum/test_accum_mmasim.py holds both to
# MMA-Sim. Operands are codes of the instructions' input formats.

CDNA3_FORMATS = [
    accum.cdna3_fp16, accum.cdna3_bf16, accum.cdna3_fp8,
    accum.cdna3_bf16.replace(promote=2),             # promotion into FP32 every 2 instructions
    accum.cdna3_fp8.replace(promote=3),
    accum.cdna3_fp16.replace(chunk=4, frac_bits=20),  # other widths of the first stage
    accum.cdna3_fp8.replace(chunk=6, frac_bits=11),
]
_CDNA3_DTYPES = {"cdna3": [torch.float16, torch.bfloat16],
                 "cdna3_fp8": [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]}


def _cdna3_codes(g, dtype, shape, nonfinite):
    """Values of dtype from its codes: the whole code range (subnormals, the largest exponents,
    inf/NaN when nonfinite), moderate values, zeros and subnormals, mixed signs."""
    nbits = 8 if dtype.itemsize == 1 else 16
    codes = torch.randint(0, 1 << nbits, shape, generator=g)
    u = torch.rand(shape, generator=g)
    small = torch.randint(1, 8, shape, generator=g) | (torch.randint(0, 2, shape, generator=g)
                                                       << (nbits - 1))  # subnormal codes
    codes = torch.where(u < 0.15, small, torch.where(u < 0.3, 0, codes))
    view = torch.uint8 if nbits == 8 else torch.int16
    x = codes.to(torch.int32).to(view).view(dtype).float()
    moderate = (torch.randn(shape, generator=g) * 2.0 ** torch.randint(-3, 4, shape, generator=g))
    x = torch.where(u > 0.7, moderate.to(dtype).float(), x)
    if not nonfinite:
        x = torch.where(torch.isfinite(x), x, 0.0)
    return x.to(dtype)


def _cdna3_case(seed, f, M, K, N, nonfinite=False):
    """(a, b) of the format's input types, with exactly cancelling pairs along K."""
    g = torch.Generator().manual_seed(seed)
    ta, tb = _CDNA3_DTYPES[f.stages][seed % 2], _CDNA3_DTYPES[f.stages][seed // 2 % 2]
    a, b = _cdna3_codes(g, ta, (M, K), nonfinite), _cdna3_codes(g, tb, (K, N), nonfinite)
    for k in range(0, K - 1, 5):  # a[:, k + 1] = -a[:, k], b[k + 1] = b[k]
        a[:, k + 1] = (-a[:, k].float()).to(ta)
        b[k + 1] = b[k]
    return a, b


def _same(x, y):
    """Equal as bits, every NaN one NaN."""
    nx, ny = torch.isnan(x), torch.isnan(y)
    return torch.equal(nx, ny) and torch.equal(bits(torch.where(nx, 0.0, x)),
                                               bits(torch.where(ny, 0.0, y)))


def _cdna3_check(a, b, f, **kw):
    want = accum.accum_matmul_reference(a, b, f, **kw)
    got = accum.accum_matmul(a, b, f, **kw)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert _same(got, want), (f, (got != want).nonzero()[:5].tolist())


needs_cdna3 = pytest.mark.skipif(
    not (qt.kernels.ops.kernels_available() and hasattr(torch.ops.qtensor, "accum_matmul_cdna3")),
    reason="the compiled qtensor._C extension (with accum_matmul_cdna3) is not built")


@needs_cdna3
@pytest.mark.parametrize("f", CDNA3_FORMATS, ids=str)
def test_cdna3_kernel_equals_reference(f, monkeypatch):
    """Codes of the input formats on odd shapes: M and N of 1 and odd (a task is 4 rows x 8
    columns), K of one element, of a short last chunk and of several instructions."""
    cases = []
    for i, (M, K, N, nonfinite) in enumerate([(1, 1, 1, False), (1, 37, 5, True),
                                              (7, 3 * f.chunk + 5, 1, False),
                                              (5, 2 * f.chunk, 9, True), (9, 77, 19, False),
                                              (6, 8 * f.chunk + 1, 11, True)]):
        a, b = _cdna3_case(zlib.crc32(f"{f}{i}".encode()), f, M, K, N, nonfinite)
        cases.append((a, b, accum.accum_matmul_reference(a, b, f)))
    # the kernel runs (not the reference)
    monkeypatch.setattr(accum_reference, "_cdna3_chunk", lambda *a: pytest.fail("the reference ran"))
    for a, b, want in cases:
        assert _same(accum.accum_matmul(a, b, f), want), (f, a.shape, b.shape)


@needs_cdna3
@pytest.mark.parametrize("f", CDNA3_FORMATS[:5], ids=str)
def test_cdna3_kernel_hard_cases(f):
    g = torch.Generator().manual_seed(zlib.crc32(f"hard{f}".encode()))
    fp8 = f.stages == "cdna3_fp8"
    K = 4 * f.chunk + 3
    # exponent spread: float32 carriers over float32's whole range, zeros, subnormals
    a, b = _spread(g, 5, K, 9)
    _cdna3_check(a, b, f)
    # products at and past 2^128 (bf16 codes of the largest exponents: cdna3 makes them inf;
    # fp8's halves keep them, the result overflows when rounded to FP32), mixed signs
    x = torch.randn(6, K, generator=g) * 2.0 ** torch.randint(50, 80, (6, K), generator=g)
    y = torch.randn(K, 10, generator=g) * 2.0 ** torch.randint(40, 70, (K, 10), generator=g)
    x, y = qt.quantize(x, "bf16"), qt.quantize(y, "bf16")
    _cdna3_check(x, y, f)
    _cdna3_check(x.bfloat16() if not fp8 else x, y.bfloat16() if not fp8 else y, f)
    # an inf/NaN partial followed by products 25 binades above it (fp8 drops such a partial)
    x = torch.ones(3, 2 * f.chunk)
    y = torch.ones(2 * f.chunk, 4)
    x[0, 0], x[1, 0], x[2, 0] = math.inf, math.nan, -math.inf
    x[:, f.chunk:] = 2.0 ** 20
    y[f.chunk:, 1] = 2.0 ** 10
    y[f.chunk:, 2] = 2.0 ** 2
    y[f.chunk:, 3] = -(2.0 ** 12)
    _cdna3_check(x, y, f)
    # a products' sum exactly cancelled against the partial, then tiny terms
    x = torch.zeros(2, 2 * f.chunk)
    y = torch.zeros(2 * f.chunk, 3)
    x[:, 0], y[0] = 1.5, 2.0 ** torch.arange(3.0)
    x[:, f.chunk], y[f.chunk] = -1.5, 2.0 ** torch.arange(3.0)
    x[:, f.chunk + 1:], y[f.chunk + 1:] = 2.0 ** -30, 2.0 ** -2
    _cdna3_check(x, y, f)
    # the 31-bit floor before the FP32 rounding: a partial of 1 (the first instruction) and
    # products 2^-24 + 2^-32 below it: 1 + 2^-24 after the floor (a tie: 1.0), above the tie
    # without it (1 + 2^-23); the other columns: other signs and a sticky bit further down
    x = torch.zeros(1, 2 * f.chunk)
    y = torch.zeros(2 * f.chunk, 4)
    x[0, 0], x[0, f.chunk], x[0, f.chunk + 1] = 1.0, 2.0 ** -24, 2.0 ** -32
    y[0], y[f.chunk], y[f.chunk + 1] = 1.0, 1.0, torch.tensor([1.0, 0.5, -1.0, 0.25])
    y[0, 2] = -1.0
    y[f.chunk, 2] = -1.0
    _cdna3_check(x, y, f)
    assert accum.accum_matmul(x, y, f)[0, 0] == (1.0 if f.frac_bits == 24 else 1 + 2.0 ** -23)
    # the initial accumulator c (moderate, huge, tiny, subnormal, zero, inf, NaN) and batches
    a, b = _cdna3_case(zlib.crc32(f"c{f}".encode()), f, 6, 3 * f.chunk + 1, 7)
    c = torch.randn(6, 7, generator=g) * 2.0 ** torch.randint(-150, 128, (6, 7), generator=g)
    c[0, 0], c[1, 1], c[2, 2], c[3, 3], c[4, 4] = 0.0, -0.0, math.inf, math.nan, 2.0 ** -140
    _cdna3_check(a, b, f, c=c)
    _cdna3_check(a[:, :0], b[:0], f, c=c)  # K = 0: c itself
    _cdna3_check(a.float().expand(3, 6, -1), b.float().expand(3, -1, -1), f, c=c[:1])
    # per-element clamps (as an MX operand's) and explicit ones
    em = torch.randint(-20, 3, a.shape, generator=g)
    _cdna3_check(a.float(), b.float(), f, a_emin=em, b_emin=-9)


def _cdna3_fast_values(g, shape, lo, hi):
    """Values the kernel's float32 chains take (accum_cdna3.cpp's fast_operand): 11-bit
    significands (FP16's), exponents in [lo, hi] (within [-40, 40]), mixed signs, 15% zeros."""
    m = torch.randint(1 << 10, 1 << 11, shape, generator=g).double() / 2.0 ** 10
    e = torch.randint(lo, hi + 1, shape, generator=g).double()
    s = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    x = (s * m * 2.0 ** e).float()
    return torch.where(torch.rand(shape, generator=g) < 0.15, 0.0, x)


@needs_cdna3
@pytest.mark.parametrize("f", CDNA3_FORMATS, ids=str)
def test_cdna3_kernel_fast_chains_hard_cases(f):
    """The float32/int32 chains (operands of at most 12 significant bits with exponents within
    [-40, 40], c finite): the products' exponent spread across the first alignment's width (the
    truncated terms, fp8's halves 31 and more binades apart), the partial against the products
    across the second alignment (its floors at 32 and frac_bits bits), exact cancellations,
    the 31-bit floor of negative sums, a tiny or subnormal c with zero products (the -126 clamp:
    step_general), c near FLT_MAX (an inf partial mid-chain) and the int32 sums' extremes."""
    g = torch.Generator().manual_seed(zlib.crc32(f"fast{f}".encode()))
    K = 6 * f.chunk + 3
    for lo, hi in ((-3, 3), (-14, 14), (-40, 40)):  # spreads around the alignment widths
        a, b = _cdna3_fast_values(g, (9, K), lo, hi), _cdna3_fast_values(g, (K, 19), lo, hi)
        _cdna3_check(a, b, f)
        # the partial (c) from far below to far above the products, subnormal, zero
        c = torch.randn(9, 19, generator=g) * 2.0 ** torch.randint(-140, 90, (9, 19), generator=g)
        c[0, :4] = torch.tensor([0.0, -0.0, 2.0 ** -149, -(2.0 ** -130)])
        _cdna3_check(a, b, f, c=c)
    # fp8's halves far apart: even products large, odd ones tiny (or the other way round)
    a = _cdna3_fast_values(g, (5, K), -2, 2)
    b = _cdna3_fast_values(g, (K, 11), -2, 2)
    a[:, 0::2] *= 2.0 ** 38
    a[:, 1::2] *= 2.0 ** -38
    _cdna3_check(a, b, f)
    _cdna3_check(b.t().contiguous(), a.t().contiguous(), f)
    # exact cancellations: pairs that cancel within a chunk, and a sum that cancels the partial
    a = _cdna3_fast_values(g, (4, K), -10, 10)
    b = _cdna3_fast_values(g, (K, 9), -10, 10)
    a[:, 1::2] = -a[:, 0::2][:, :a[:, 1::2].shape[1]]
    b[1::2] = b[0::2][:b[1::2].shape[0]]
    _cdna3_check(a, b, f)
    x, y = torch.zeros(2, 2 * f.chunk), torch.zeros(2 * f.chunk, 3)
    x[:, 0], y[0] = 1.5, 2.0 ** torch.arange(3.0)
    x[:, f.chunk], y[f.chunk] = -1.5, 2.0 ** torch.arange(3.0)
    x[:, f.chunk + 1:], y[f.chunk + 1:] = 2.0 ** -30, -(2.0 ** -9)
    _cdna3_check(x, y, f)
    # the 31-bit floor of negative and positive sums: a partial of -1 / 1 and products just
    # below its last bits (2^-24 + 2^-32 and beyond: floor toward -inf, ties, sticky bits)
    for sgn in (1.0, -1.0):
        x, y = torch.zeros(1, 2 * f.chunk), torch.zeros(2 * f.chunk, 6)
        x[0, 0], x[0, f.chunk], x[0, f.chunk + 1], x[0, f.chunk + 2] = sgn, 2.0 ** -24, 2.0 ** -32, 2.0 ** -36
        y[0], y[f.chunk] = 1.0, torch.tensor([1.0, -1.0, 1.0, -1.0, 0.5, -0.5])
        y[f.chunk + 1] = torch.tensor([1.0, -1.0, -1.0, 1.0, 0.25, -0.75])
        y[f.chunk + 2] = torch.tensor([0.0, 1.0, -1.0, -1.0, 1.0, 1.0])
        _cdna3_check(x, y, f)
    # zero products with a tiny or subnormal c (em < -94: the -126 clamp), one zero row
    a = _cdna3_fast_values(g, (4, K), -5, 5)
    a[1] = 0.0
    b = _cdna3_fast_values(g, (K, 5), -5, 5)
    c = torch.tensor([2.0 ** -149, -(2.0 ** -127), 2.0 ** -100, -(2.0 ** -95), 3.0 * 2.0 ** -96])
    _cdna3_check(a, b, f, c=c.expand(4, 5).contiguous())
    # c near FLT_MAX: the partial overflows to inf mid-chain (then a nonfinite partial)
    c = torch.tensor([3.4e38, -3.4e38, 3.0e38, 1.0, -3.4e38])
    b[:, 0], b[:, 1] = 2.0 ** 40, -(2.0 ** 40)
    a[0] = a[0].abs() * 2.0 ** 30
    _cdna3_check(a, b, f, c=c.expand(4, 5).contiguous())
    # the int32 sums' extremes: every product the same sign at the largest significands
    x = torch.full((3, K), (2.0 - 2.0 ** -10) * 2.0 ** 40)
    y = torch.full((K, 4), (2.0 - 2.0 ** -10) * 2.0 ** 40)
    y[:, 1] = -y[:, 1]
    _cdna3_check(x, y, f, c=torch.full((3, 4), -1.0))


def test_cdna3_reference_all_zero_chunk_at_25_bits():
    """frac_bits 25 (past the kernel's 24: the reference runs): an all-zero instruction scaled
    its 0 by 2^(-999 - 25), whose float64 bits are -inf, and 0 * -inf made the result NaN."""
    x, y = torch.zeros(2, 24), torch.ones(24, 3)
    x[0, 8:] = 1.0
    x[1, 16:] = 0.5
    for stages in ("cdna3", "cdna3_fp8"):
        f = accum.AccumFormat(chunk=8, frac_bits=25, stages=stages)
        assert accum.accum_matmul(x, y, f).tolist() == [[16.0] * 3, [4.0] * 3]


@needs_cdna3
def test_cdna3_kernel_with_flush_denormal():
    """Under torch.set_flush_denormal(True) a subnormal operand is a zero term in both."""
    a, b = _cdna3_case(3, accum.cdna3_fp16, 5, 40, 9)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        for f in (accum.cdna3_fp16, accum.cdna3_fp8):
            x, y = a.float() * 2.0 ** -110, b.float()
            _cdna3_check(x, y, f)
    finally:
        torch.set_flush_denormal(False)


@needs_cdna3
def test_cdna3_kernel_opcheck_fake_and_errors():
    a, b = torch.randn(2, 3, 40), torch.randn(2, 40, 5)
    op = torch.ops.qtensor.accum_matmul_cdna3
    torch.library.opcheck(op.default, (a, b, True, 16, 24, 0, -7, -15, None))
    torch.library.opcheck(op.default, (a, b, False, 8, 24, 2, -14, -14, torch.randn(2, 3, 5)))
    with torch._subclasses.fake_tensor.FakeTensorMode():
        out = op(torch.empty(2, 3, 40), torch.empty(2, 40, 5), False, 8, 24, 0, -14, -14, None)
        assert out.shape == (2, 3, 5) and out.dtype == torch.float32
    fn = torch.compile(lambda x, y: accum.accum_matmul(x, y, accum.cdna3_fp8), fullgraph=True)
    assert _same(fn(a[0], b[0]), accum.accum_matmul_reference(a[0], b[0], accum.cdna3_fp8))
    with pytest.raises(RuntimeError, match=r"frac_bits must be in \[0, 24\], got 25"):
        op(a, b, False, 8, 25, 0, -14, -14, None)
    with pytest.raises(RuntimeError, match=r"must be float32, got Double"):
        op(a.double(), b, False, 8, 24, 0, -14, -14, None)
    with pytest.raises(RuntimeError, match=r"a \(batch, M, K\) and b \(batch, K, N\)"):
        op(a, b[:, :5], False, 8, 24, 0, -14, -14, None)
    # frac_bits above 24: the reference (the same result through accum_matmul)
    f = accum.cdna3_bf16.replace(frac_bits=30)
    assert _same(accum.accum_matmul(a, b, f), accum.accum_matmul_reference(a, b, f))


@needs_cdna3
@pytest.mark.parametrize("isa", ["base", "avx2"])
def test_cdna3_kernel_on_other_isas(isa):
    """The baseline and AVX2 copies of the CDNA3 loops (QTENSOR_CPU_ISA caps the ISA)."""
    _pytest_under_isa(isa, "cdna3_kernel and not on_other_isas")


# ---------------------------------------------------------------------------------------------
# Group datapaths (group > 1: blackwell_mxfp4, blackwell_nvfp4): the kernel's tiles of double
# group sums (csrc/cpu/accum_lanes.h, rows_groups) must give the reference's bits, also where a
# group sum is inexact in float64 (then only the same sequential order in k gives the same bits).

GROUP_FORMATS = [
    accum.blackwell_mxfp4, accum.blackwell_nvfp4,
    AccumFormat(chunk=16, frac_bits=20, group=4, promote=1),
    AccumFormat(chunk=12, frac_bits=8, group=3, align_rounding="floor", acc_in_alignment=False,
                acc_man=10, acc_rounding="nearest", promote=2),
    AccumFormat(chunk=8, frac_bits=3, group=8, align_rounding="nearest", acc_man=5),
    AccumFormat(chunk=64, frac_bits=0, group=2, align_rounding="floor", acc_man=2, promote=3),
    AccumFormat(chunk=32, frac_bits=12, group=16, align_rounding="nearest",
                acc_in_alignment=False, promote=None),
]
# the AccumFormat limits: 256 groups per chunk, the widest frac_bits; one group of all of K
GROUP_LIMITS = [AccumFormat(chunk=512, frac_bits=42, group=2, promote=2),
                AccumFormat(chunk=65536, frac_bits=50, group=65536)]


def _group_spread(g, M, K, N):
    """Every 4 K-elements: a big product B (2^40 to 2^80 times the small ones), a small one, -B
    exactly (a negated, b repeated), a small one. Added in order the first small one is absorbed
    by B and lost when -B cancels it; the float64 group sums are inexact and depend on the order
    of the adds."""
    a = torch.randn(M, K, generator=g)
    b = torch.randn(K, N, generator=g)
    big = 2.0 ** torch.randint(20, 41, (K,), generator=g).float()
    big[K - 2:] = 1.0  # no partner to cancel
    a[:, 0::4] *= big[0::4]
    b[0::4] *= big[0::4, None]
    n = a[:, 2::4].shape[1]
    a[:, 2::4] = -a[:, 0::4][:, :n]
    b[2::4] = b[0::4][:n]
    a[:, 1::2][torch.rand(M, K // 2, generator=g) < 0.05] = 0.0  # some small ones zero
    return a, b


def _group_special(g, M, K, N):
    """Zero rows, columns and whole groups, inf, -inf and NaN (inf * 0 too), float32 overflow
    of the accumulator format, subnormal operands."""
    a, b = _random(g, M, K, N, "bf16")
    a[0] = 0.0                        # a zero row
    b[:, 1 % N] = 0.0                 # a zero column
    a[:, 16:32] = 0.0                 # zero groups: p alone in the alignment
    a[1 % M, 40] = math.inf           # inf * b, inf * 0 (b's zero column)
    a[2 % M, 70] = math.nan
    b[5, 2 % N] = -math.inf
    a[3 % M, 3], b[3, 3 % N] = math.inf, -1.0
    a[4 % M, 64:] = 3e38              # products and chunk sums far beyond float32
    b[64:, 4 % N] = 3e38
    a[5 % M, :8] = 2.0 ** -140 * torch.randn(8, generator=g)  # subnormals
    return a, b


GROUP_INPUTS = {
    "random": lambda g: _random(g, 11, 77, 19),          # K not a multiple of 2, 3, 16, 64
    "fp4": lambda g: _fp4(g, 9, 256, 33),
    "spread": lambda g: _group_spread(g, 7, 150, 21),
    "cancelling": lambda g: _cancelling(g, 5, 64, 17),
    "exponents": lambda g: _spread(g, 6, 90, 10),
    "special": lambda g: _group_special(g, 9, 100, 18),
    "subnormal": lambda g: _subnormal(g, 3, 40, 9),
}


def test_group_spread_inputs_are_inexact_in_float64():
    """The adversarial inputs do what they are for: the reference (float64 group sums) differs
    from the exact oracle, so the kernel must reproduce its rounding, not the exact sums."""
    f = AccumFormat(chunk=16, frac_bits=20, group=4, promote=1)
    a, b = _group_spread(torch.Generator().manual_seed(1), 3, 64, 3)
    want = accum.accum_matmul_reference(a, b, f)
    assert not torch.equal(bits(want), bits(oracle(a, b, f)))


@needs_kernel
@pytest.mark.parametrize("kind", list(GROUP_INPUTS))
@pytest.mark.parametrize("f", GROUP_FORMATS, ids=str)
def test_group_kernel_equals_reference(f, kind):
    g = torch.Generator().manual_seed(zlib.crc32(f"{f}{kind}groups".encode()))
    a, b = GROUP_INPUTS[kind](g)
    want = accum.accum_matmul_reference(a, b, f)
    assert torch.equal(bits(accum.accum_matmul(a, b, f)), bits(want))


@needs_kernel
@pytest.mark.parametrize("f", GROUP_LIMITS, ids=str)
def test_group_kernel_at_the_format_limits(f):
    g = torch.Generator().manual_seed(3)
    for a, b in (_random(g, 9, 1100, 17), _group_spread(g, 5, 1100, 9)):
        want = accum.accum_matmul_reference(a, b, f)
        assert torch.equal(bits(accum.accum_matmul(a, b, f)), bits(want))


@needs_kernel
def test_group_kernel_batched_strided_and_empty():
    f = accum.blackwell_mxfp4
    g = torch.Generator().manual_seed(4)
    a, b = _group_spread(g, 3 * 10, 100, 37)
    a, b = a.reshape(3, 10, 100), b.t().contiguous().t()  # b column-major
    want = accum.accum_matmul_reference(a, b, f)
    assert torch.equal(bits(accum.accum_matmul(a, b, f)), bits(want))
    for x, y in ((torch.zeros(4, 0), torch.zeros(0, 5)), (torch.ones(1, 1), torch.ones(1, 1)),
                 (torch.zeros(0, 8), torch.ones(8, 3))):
        want = accum.accum_matmul_reference(x, y, f)
        assert torch.equal(bits(accum.accum_matmul(x, y, f)), bits(want))


@needs_kernel
@pytest.mark.parametrize("isa", ["base", "avx2"])
def test_group_kernel_on_other_isas(isa):
    """QTENSOR_CPU_ISA caps the instruction set: the baseline and AVX2 tiles, the same bits."""
    code = (
        "import sys, torch, zlib; sys.path[:0] = ['tests', 'tests/accum']; import test_accum as T\n"
        "from qtensor import accum\n"
        "for f in T.GROUP_FORMATS:\n"
        "    for kind in T.GROUP_INPUTS:\n"
        "        g = torch.Generator().manual_seed(zlib.crc32(kind.encode()))\n"
        "        a, b = T.GROUP_INPUTS[kind](g)\n"
        "        want = accum.accum_matmul_reference(a, b, f)\n"
        "        got = accum.accum_matmul(a, b, f)\n"
        "        assert torch.equal(T.bits(got), T.bits(want)), (f, kind)\n")
    _run_under_isa(isa, code)


@needs_kernel
@pytest.mark.parametrize("f", GROUP_FORMATS[:1] + GROUP_FORMATS[-1:], ids=str)
def test_group_kernel_with_flush_denormal(f):
    """Results in float32's subnormal range, p in the alignment or added by a float32 add: with
    torch.set_flush_denormal(True) the kernel gives the reference's bits (both flushed)."""
    a, b = _random(torch.Generator().manual_seed(9), 6, 96, 20, "bf16")
    a, b = a * 2.0 ** -60, b * 2.0 ** -70
    _check_subnormal_results(a, b, f)


@needs_kernel
def test_group_recipe_training_matches_the_reference(monkeypatch):
    """A user's model: qt.convert with Recipe(accumulate=blackwell_mxfp4), MXFP4 weights and
    gradients, float32 activations, a few SGD steps; every contraction (forward, grad_input,
    grad_weight) through the kernel gives the same losses and weights, bit for bit, as through
    accum_matmul_reference."""
    mx = ("fp32", "mxfp4")
    recipe = qt.Recipe(weight=mx, bias="fp32", activation="fp32", grad=mx,
                       accumulate=qt.accum.blackwell_mxfp4)

    def train(recipe, reference=False):
        if reference:
            monkeypatch.setattr(accum_kernel, "_kernel_ready", lambda a: False)
        torch.manual_seed(0)
        m = qt.convert(torch.nn.Sequential(torch.nn.Linear(200, 48), torch.nn.ReLU(),
                                           torch.nn.Linear(48, 5)), recipe)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        # blocks of 32 inputs up to 2^24 apart: the 35-bit alignment drops bits of the small ones
        x = torch.randn(40, 7, 32, generator=g) * 2.0 ** torch.randint(-18, 7, (40, 7, 1),
                                                                       generator=g)
        x, y = x.flatten(1)[:, :200], torch.randn(40, 5, generator=g)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = (m(x).float() - y).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        monkeypatch.undo()
        return torch.stack(losses), [bits(p.dequantize() if isinstance(p, qt.QTensor) else p)
                                     for p in m.parameters()]

    loss_k, params_k = train(recipe)
    loss_r, params_r = train(recipe, reference=True)
    assert torch.equal(bits(loss_k), bits(loss_r))
    assert all(torch.equal(pk, pr) for pk, pr in zip(params_k, params_r))
    # the accumulator took part: FP32 accumulation trains to other bits
    loss_fp32, _ = train(recipe.replace(accumulate=None))
    assert not torch.equal(bits(loss_k), bits(loss_fp32))

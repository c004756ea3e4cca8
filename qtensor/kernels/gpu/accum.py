"""Triton kernel of qt.accum's fused datapath (qtensor::accum_matmul, ``stages="fused"``): the
model of csrc/include/qtensor/accum.h's acc_dot per output element, with its bits.

Per chunk of K-elements: the exact products (float32 operands, so a float64 product is exact),
or with groups their sequential float64 group sums; each term's alignment exponent (the
operands' floor(log2), clamped at their formats' emin, per element where given; a group's block
scale exponents or its sum's own); emax over the terms and the partial; each term times
2^(frac_bits - emax) (exact: a power of two) rounded to an integer with bit operations (trunc,
floor or nearest-even, no float rounding instruction); the exact sum (integers below 2^53, any
order); its normalization to the accumulator format with bit operations; promotion into FP32
by a float32 add. Float arithmetic is limited to exact float64 products, exact power-of-two
scalings, exact integer sums and the model's own float32 adds (IEEE-rounded on every device);
the launch turns fp fusion off. One program computes a BM x BN tile of one batch's outputs; a
chunk's terms are a [BM, BN, chunk] tensor (a [BM, BN, groups] one per product of the group)."""
import torch
import triton
import triton.language as tl

from . import _common as C
from ._layout import interpreted, launcher

__all__ = ["accum_matmul"]

ZERO_EXP = -100000  # accum.h kAccZeroExp: a zero term's exponent
BAD_EXP = 1 << 20   # kAccBadExp: an inf/NaN operand's


@triton.jit
def _pow2(e):
    """accum.h acc_pow2: 2^e's float64 bits as (e + 1023) << 52."""
    return ((e.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _exp_f32(u, emin):
    """accum.h acc_exp_f32: floor(log2|x|) of float32 bits u clamped at emin; ZERO_EXP for zero,
    BAD_EXP for inf and NaN (a subnormal's through the exact int -> float conversion of its
    significand)."""
    A = u & 0x7FFFFFFF
    E = (A >> 23).to(tl.int32)
    sub = (A.to(tl.int32).to(tl.float32).to(tl.uint32, bitcast=True) >> 23).to(tl.int32) - 276
    e = tl.maximum(tl.where(E != 0, E - 127, sub), emin)
    return tl.where(A == 0, -100000, tl.where(E == 255, 1 << 20, e))


@triton.jit
def _exp_f64(x):
    """floor(log2|x|) of a finite nonzero float64, subnormals included (0 for zero)."""
    A = x.to(tl.uint64, bitcast=True) & 0x7FFFFFFFFFFFFFFF
    E = (A >> 52).to(tl.int32)
    sub = (A.to(tl.int64).to(tl.float64).to(tl.uint64, bitcast=True) >> 52).to(tl.int32) - 2097
    return tl.where(E != 0, E - 1023, tl.where(A == 0, 0, sub))


@triton.jit
def _round_int(x, MODE: tl.constexpr):
    """accum.h acc_round_int of a finite float64 with bit operations: trunc (0), floor (1) or
    rint, ties to even (2), zero signs included."""
    u = x.to(tl.uint64, bitcast=True)
    sign = u & 0x8000000000000000
    A = u & 0x7FFFFFFFFFFFFFFF
    E = (A >> 52).to(tl.int32)
    fb = tl.minimum(tl.maximum(1075 - E, 1), 52).to(tl.uint64)  # fraction bits, 1 <= |x| < 2^52
    mask = (tl.full(u.shape, 1, tl.uint64) << fb) - 1
    frac = A & mask
    tr = A ^ frac
    if MODE == 0:
        r = tr
        small = tl.zeros(u.shape, tl.uint64)
    elif MODE == 1:
        r = tr + (((sign != 0) & (frac != 0)).to(tl.uint64) << fb)
        small = tl.where((sign != 0) & (A != 0), 0x3FF0000000000000, 0).to(tl.uint64)
    else:
        half = mask ^ (mask >> 1)
        up = (frac > half) | ((frac == half) & (((tr >> fb) & 1) != 0))
        r = tr + (up.to(tl.uint64) << fb)
        small = tl.where(A > 0x3FE0000000000000, 0x3FF0000000000000, 0).to(tl.uint64)
    r = tl.where(E >= 1075, A, tl.where(E < 1023, small, r))
    return (r | sign).to(tl.float64, bitcast=True)


@triton.jit
def _accum_kernel(a_ptr, b_ptr, c_ptr, ga_ptr, gb_ptr, va_ptr, vb_ptr, out_ptr, M, N, K,
                  sab, sam, sak, sbb, sbk, sbn, scb, scm, scn,
                  sgab, sgam, sgag, sgbb, sgbg, sgbn, svab, svam, svak, svbb, svbk, svbn,
                  frac_bits, acc_man, promote, e_zero, a_emin, b_emin, acc_emin, acc_emax,
                  CHUNK: tl.constexpr, CP: tl.constexpr, GROUP: tl.constexpr,
                  NGP: tl.constexpr, ALIGN: tl.constexpr, ACC_ROUND: tl.constexpr,
                  ACC_IN: tl.constexpr, HAS_C: tl.constexpr, HAS_G: tl.constexpr,
                  HAS_VA: tl.constexpr, HAS_VB: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr):
    # (few device-function calls in the loop: under the interpreter each costs ~1.5 ms)
    bi = tl.program_id(2).to(tl.int64)
    rm = tl.program_id(1).to(tl.int64) * BM + tl.arange(0, BM)
    rn = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    mok = rm < M
    nok = rn < N
    if HAS_C:
        p = tl.load(c_ptr + bi * scb + rm[:, None] * scm + rn[None, :] * scn,
                    mask=mok[:, None] & nok[None, :], other=0.0).to(tl.float64)
    else:
        p = tl.zeros([BM, BN], tl.float64)
    acc = tl.zeros([BM, BN], tl.float32)
    INF = tl.full([BM, BN], 0x7FF0000000000000, tl.uint64).to(tl.float64, bitcast=True)
    NAN = tl.full([BM, BN], 0x7FF8000000000000, tl.uint64).to(tl.float64, bitcast=True)
    NG: tl.constexpr = CHUNK // GROUP
    for k0 in range(0, K, CHUNK):
        short = K - k0 < CHUNK  # a last chunk's empty slots are zero terms
        p_ok = tl.abs(p) < INF
        # p as a term of the alignment, its exponent clamped at the accumulator's emin
        if ACC_IN:
            pt = tl.where(p_ok, p, 0.0)
            has_zero = short | (p == 0)
        else:
            pt = tl.zeros([BM, BN], tl.float64)
            has_zero = short | tl.zeros([BM, BN], tl.int1)
        emax = tl.where(pt != 0, tl.maximum(_exp_f64(pt), acc_emin), -100000)
        if GROUP == 1:
            j = tl.arange(0, CP)
            kv = (j < CHUNK) & (k0 + j < K)
            ua = tl.load(a_ptr + bi * sab + rm[:, None] * sam + (k0 + j)[None, :] * sak,
                         mask=mok[:, None] & kv[None, :], other=0.0)
            ub = tl.load(b_ptr + bi * sbb + rn[:, None] * sbn + (k0 + j)[None, :] * sbk,
                         mask=nok[:, None] & kv[None, :], other=0.0)
            if HAS_VA:  # per-element clamps
                emin_a = tl.load(va_ptr + bi * svab + rm[:, None] * svam + (k0 + j)[None, :] * svak,
                                 mask=mok[:, None] & kv[None, :], other=0)
            else:
                emin_a = a_emin
            if HAS_VB:
                emin_b = tl.load(vb_ptr + bi * svbb + rn[:, None] * svbn + (k0 + j)[None, :] * svbk,
                                 mask=nok[:, None] & kv[None, :], other=0)
            else:
                emin_b = b_emin
            ea = _exp_f32(ua.to(tl.uint32, bitcast=True), emin_a)
            eb = _exp_f32(ub.to(tl.uint32, bitcast=True), emin_b)
            em = tl.max(ea[:, None, :] + eb[None, :, :], axis=2)
            zk = ((ea == -100000)[:, None, :] | (eb == -100000)[None, :, :]) & kv[None, None, :]
            has_zero = has_zero | (tl.max(zk.to(tl.int32), axis=2) != 0)
            t = ua.to(tl.float64)[:, None, :] * ub.to(tl.float64)[None, :, :]  # exact
            ok = kv[None, None, :]
        else:
            g = tl.arange(0, NGP)
            ok = (g < NG)[None, None, :]
            k = k0 + g * GROUP
            kv = (g < NG) & (k < K)
            ua = tl.load(a_ptr + bi * sab + rm[:, None] * sam + k[None, :] * sak,
                         mask=mok[:, None] & kv[None, :], other=0.0)
            ub = tl.load(b_ptr + bi * sbb + rn[:, None] * sbn + k[None, :] * sbk,
                         mask=nok[:, None] & kv[None, :], other=0.0)
            t = ua.to(tl.float64)[:, None, :] * ub.to(tl.float64)[None, :, :]
            nz = t != 0
            # the group sums: sequential float64 adds in k order, as the CPU kernel
            for jj in range(1, GROUP):
                kj = k + jj
                kvj = (g < NG) & (kj < K)
                ua = tl.load(a_ptr + bi * sab + rm[:, None] * sam + kj[None, :] * sak,
                             mask=mok[:, None] & kvj[None, :], other=0.0)
                ub = tl.load(b_ptr + bi * sbb + rn[:, None] * sbn + kj[None, :] * sbk,
                             mask=nok[:, None] & kvj[None, :], other=0.0)
                q = ua.to(tl.float64)[:, None, :] * ub.to(tl.float64)[None, :, :]
                nz = nz | (q != 0)
                t = tl.where(kvj[None, None, :], t + q, t)
            if HAS_G:  # the block scales' exponents; e_zero where the products are all zero
                gi = k0 // GROUP + g
                xa = tl.load(ga_ptr + bi * sgab + rm[:, None] * sgam + gi[None, :] * sgag,
                             mask=mok[:, None] & kv[None, :], other=0)
                xb = tl.load(gb_ptr + bi * sgbb + rn[:, None] * sgbn + gi[None, :] * sgbg,
                             mask=nok[:, None] & kv[None, :], other=0)
                eg = tl.where(nz, xa[:, None, :] + xb[None, :, :], -100000)
            else:  # the group sum's own exponent
                eg = tl.where(t == 0, -100000, _exp_f64(t))
            eg = tl.where(ok, eg, -100000)
            em = tl.max(eg, axis=2)
            has_zero = has_zero | (tl.max(((eg == -100000) & ok).to(tl.int32), axis=2) != 0)
        # a non-finite product (a group sum is one where a product is) or partial: the chunk's
        # result is NaN, or the infinity
        nan = (tl.max((t != t).to(tl.int32), axis=2) != 0) | (p != p)
        pos = (tl.max((t == INF[:, :, None]).to(tl.int32), axis=2) != 0) | (p == INF)
        neg = (tl.max((t == -INF[:, :, None]).to(tl.int32), axis=2) != 0) | (p == -INF)
        bad = nan | pos | neg
        # emax over the terms and p; zero terms at e_zero; all zero: any scale
        emax = tl.maximum(emax, em)
        emax = tl.where((emax < e_zero) & has_zero, e_zero, emax)
        emax = tl.where(emax < -50000, 0, emax)
        sc = _pow2(frac_bits - emax)
        tb = tl.where(bad[:, :, None], 0.0, t)
        S = tl.sum(tl.where(ok, _round_int(tb * sc[:, :, None], ALIGN), 0.0), axis=2)
        S = S + _round_int(pt * sc, ALIGN)  # (integers below 2^53: exact in any order)
        # the new partial: S * 2^(emax - frac_bits) rounded to the accumulator format
        v = tl.where(bad, 0.0, S) * _pow2(emax - frac_bits)
        e = tl.maximum(_exp_f64(v), acc_emin)
        r = _round_int(v * _pow2(acc_man - e), ACC_ROUND) * _pow2(e - acc_man)
        r = tl.where(tl.abs(r) >= _pow2(acc_emax + 1 + tl.zeros([BM, BN], tl.int32)),
                     tl.where(r > 0, INF, -INF), r)
        r = tl.where(r == 0, 0.0, r)  # a zero result is +0
        if ACC_IN:
            new = r
        else:  # the chunk's sum added into p by a float32 add
            new = (p.to(tl.float32) + r.to(tl.float32)).to(tl.float64)
        p = tl.where(bad, tl.where(nan | (pos & neg), NAN, tl.where(pos, INF, -INF)), new)
        # promotion into the FP32 accumulator by a float32 add
        last = ((k0 // CHUNK + 1) % tl.maximum(promote, 1) == 0) | (k0 + CHUNK >= K)
        promoted = (promote > 0) & last
        acc = tl.where(promoted, acc + p.to(tl.float32), acc)
        p = tl.where(promoted, 0.0, p)
    out = tl.where((promote > 0) & (K > 0), acc, p.to(tl.float32))
    out = tl.where(out != out, 0x7FC00000, out.to(tl.uint32, bitcast=True)).to(tl.uint32)
    tl.store(out_ptr + bi * M * N + rm[:, None] * N + rn[None, :],
             out.to(tl.float32, bitcast=True), mask=mok[:, None] & nok[None, :])


def _tile(cp: int):
    """(BM, BN) of a program: large programs under the interpreter (~7 ms each), a few thousand
    terms on a GPU."""
    budget = 16384 if interpreted() else 2048
    side = 1
    while side < 64 and (2 * side) * (2 * side) * cp <= budget:
        side *= 2
    return side, side


def _strides(t, n=3):
    return t.stride() if t is not None else (0,) * n


def accum_matmul(a, b, chunk, frac_bits, group, align_rounding, acc_in_alignment, acc_man,
                 acc_rounding, promote, e_zero, a_emin, b_emin, acc_emin, acc_emax, a_gexp=None,
                 b_gexp=None, c=None, a_emins=None, b_emins=None):
    """qtensor::accum_matmul's arguments (a (B, M, K), b (B, K, N) float32; qtensor/accum/kernel.py's
    op_args) with the Triton kernel: float32 (B, M, N)."""
    if a.dim() != 3 or b.dim() != 3 or a.dtype != torch.float32 or b.dtype != torch.float32 \
            or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise RuntimeError(f"qtensor.kernels.gpu.accum_matmul: a and b must be float32 (B, M, K) and "
                           f"(B, K, N), got {a.dtype} {tuple(a.shape)} and {b.dtype} "
                           f"{tuple(b.shape)}")
    if not (1 <= chunk <= 65536 and group >= 1 and chunk % group == 0
            and align_rounding in (0, 1, 2) and acc_rounding in (0, 2)
            and 0 <= acc_man <= 23 and promote >= 0):
        raise RuntimeError(f"qtensor.kernels.gpu.accum_matmul: an invalid datapath (chunk={chunk}, "
                           f"group={group}, align_rounding={align_rounding}, acc_man={acc_man}, "
                           f"acc_rounding={acc_rounding}, promote={promote})")
    if (a_gexp is None) != (b_gexp is None) or (a_gexp is not None and group == 1):
        raise RuntimeError("qtensor.kernels.gpu.accum_matmul: a_gexp and b_gexp go together, with "
                           "group > 1")
    B, M, K = a.shape
    N = b.shape[2]
    out = torch.empty((B, M, N), dtype=torch.float32, device=a.device)
    if out.numel() == 0:
        return out
    G = -(-K // group)
    if a_gexp is not None:
        if tuple(a_gexp.shape) != (B, M, G) or tuple(b_gexp.shape) != (B, G, N):
            raise RuntimeError(f"qtensor.kernels.gpu.accum_matmul: a_gexp must be {(B, M, G)} and b_gexp "
                               f"{(B, G, N)}, got {tuple(a_gexp.shape)} and "
                               f"{tuple(b_gexp.shape)}")
        a_gexp, b_gexp = a_gexp.to(torch.int32), b_gexp.to(torch.int32)
    if c is not None:
        if c.dtype != torch.float32:
            raise RuntimeError(f"qtensor.kernels.gpu.accum_matmul: c must be float32, got {c.dtype}")
        c = c.expand(B, M, N)
    for name, v, x in (("a_emins", a_emins, a), ("b_emins", b_emins, b)):
        if v is not None and (v.shape != x.shape or v.dtype.is_floating_point):
            raise RuntimeError(f"qtensor.kernels.gpu.accum_matmul: {name} must be an integer tensor of "
                               f"shape {tuple(x.shape)}, got {v.dtype} {tuple(v.shape)}")
    a_emins = a_emins.to(torch.int32) if a_emins is not None else None
    b_emins = b_emins.to(torch.int32) if b_emins is not None else None
    cp = triton.next_power_of_2(chunk)
    ngp = triton.next_power_of_2(chunk // group)
    BM, BN = _tile(cp if group == 1 else ngp)
    grid = (triton.cdiv(N, BN), triton.cdiv(M, BM), B)
    dummy = out
    launcher(_accum_kernel)[grid](
        a, b, c if c is not None else dummy, a_gexp if a_gexp is not None else dummy,
        b_gexp if b_gexp is not None else dummy, a_emins if a_emins is not None else dummy,
        b_emins if b_emins is not None else dummy, out, M, N, K,
        *a.stride(), *b.stride(), *_strides(c), *_strides(a_gexp), *_strides(b_gexp),
        *_strides(a_emins), *_strides(b_emins),
        frac_bits, acc_man, promote, e_zero, a_emin, b_emin, acc_emin, acc_emax,
        CHUNK=chunk, CP=cp, GROUP=group, NGP=ngp, ALIGN=align_rounding, ACC_ROUND=acc_rounding,
        ACC_IN=bool(acc_in_alignment), HAS_C=c is not None, HAS_G=a_gexp is not None,
        HAS_VA=a_emins is not None, HAS_VB=b_emins is not None, BM=BM, BN=BN,
        enable_fp_fusion=False)
    return out

"""Convolutions as GEMMs (im2col) for the accumulator: 1-, 2- and 3-D, grouped (a batched GEMM
over the groups), transposed, and the weight gradient, in the K orders of implicit-GEMM kernels;
the block scales of their operands where the datapath applies them."""
from __future__ import annotations

import math

import torch

from . import kernel as _kernel
from .blocks import (_block_scales, _mx_emin, _operand_block_fmt, _per_element, _scale_exps,
                     _unscaled)
from .format import AccumFormat

# Convolutions as GEMMs: 1-, 2- and 3-D, grouped (a batched GEMM over the groups), transposed.
# K orders, as implicit-GEMM kernels run them on channels-last data:
# - forward: (kernel position, input channel of the group), channels innermost (as dispatch
#   blocks MX operands: along channels); padding zeros take their K slots. CUTLASS takes the
#   channels in threadblock-tile blocks outside the kernel-position loop: the same order while
#   C/groups fits one tile.
# - transposed forward and grad_input: the forward convolution over the input with (stride - 1)
#   zeros inserted between its elements, padded by dilation*(kernel-1)-padding (cropped where
#   negative), the kernel flipped and its channel dims swapped: K = (flipped kernel position,
#   channel), as CUTLASS's unity-stride and 3-D strided dgrad iterate it, the inserted zeros
#   loaded as zeros. Zero products move no alignment but take K slots, so they decide which
#   products share an instruction: CUTLASS's 2-D strided dgrad skips them, and ATen's col2im
#   path (a GEMM over channels only, the kernel positions added in float32) sums differently.
# - grad_weight: (batch, output position); (output position, batch) where both operands are
#   block-scaled along the batch (their blocks then are runs of K: _conv_weight_grad).


def _tup(v, nd):
    """A geometry argument (an int, or a list of 1 or nd ints) as nd ints."""
    v = [v] if isinstance(v, int) else list(v)
    return tuple(v * nd) if len(v) == 1 else tuple(v)


def _geometry(stride, padding, dilation, groups, nd):
    """The conv geometry (stride, padding, dilation as nd ints each, groups) of aten's args."""
    return _tup(stride, nd), _tup(padding, nd), _tup(dilation, nd), groups


def _pad(x, pads):
    """x (N, C, *S) zero-padded by (lo, hi) per spatial dim; negative amounts crop."""
    return torch.nn.functional.pad(x, [p for lo_hi in reversed(pads) for p in lo_hi])


def _cols(xp, k, stride, dilation, groups, size):
    """(N, groups, L, P*C/groups): the windows of the padded input xp (N, C, *S) under the
    first ``size`` output positions (L of them), each window in K order (P kernel positions)."""
    for i, (kk, s, d) in enumerate(zip(k, stride, dilation)):
        xp = xp.unfold(2 + i, d * (kk - 1) + 1, s).narrow(2 + i, 0, size[i])
    win = xp[(..., *(slice(None, None, d) for d in dilation))]  # (N, C, *size, *k)
    N, C = win.shape[:2]
    L, P = math.prod(size), math.prod(k)
    win = win.reshape(N, groups, C // groups, L, P).permute(0, 1, 3, 4, 2)
    return win.reshape(N, groups, L, P * (C // groups))


def _conv_operand_scales(f: AccumFormat, n: int, ops):
    """The block scales of a convolution GEMM's operands for the datapath f, each K-group of n
    (f.group, or the promotion interval) inside one block of each operand: ops is two (t, q,
    dim, to) (the a side, then the b side): t the operand's values in their own layout, rounded
    by the block format of the QTensor q along dim (the blocks' own partition: along a conv's
    global channel dim they may cross conv groups), ``to`` maps a t-shaped tensor to the GEMM
    operand (a: (g, M, K), b: (g, K, N)). The caller has checked that the GEMM's K-groups of n
    lie in runs of one block (K = ..., dim innermost in runs of a multiple of n, and the blocks
    a multiple of n). (ts_a, ts_b, per-element X of a, of b, fa, fb) or None."""
    out = []
    for t, q, dim, to in ops:
        fmt = _operand_block_fmt(q)
        if fmt is None or fmt.block_size % n:
            return None
        sc = _block_scales(t, fmt, dim, "exponent" if f.scales == "instruction" else "value",
                           q)
        if sc is None:
            return None
        out.append((sc[1], _per_element(sc[0], fmt.block_size, dim, t.shape[dim]), fmt))
    (ta, Xa, fa), (tb, Xb, fb) = out
    return ta, tb, Xa, Xb, fa, fb


def _conv_scale_plan(f: AccumFormat, n_ok, ops):
    """_scale_plan for a convolution's GEMM; ops: two (t, q, dim, to) as _conv_operand_scales
    takes them; n_ok(n): whether the GEMM's K runs along the blocked dims in runs of a multiple
    of n (K-groups of n inside one kernel position / one output position). Returns the two
    operands' values (their own layouts: unscaled where the scales travel separately), the
    accum_matmul keywords and post (the per-tensor scales' product, or None)."""
    (a, qa, da, to_a), (b, qb, db, to_b) = ops
    kw, post = {}, None
    if f.scales == "instruction" and f.group == 1:  # per-element clamps of MX operands
        ea, eb = _mx_emin(a, qa, da), _mx_emin(b, qb, db)
        if ea is not None:
            kw["a_emin"] = to_a(ea)
        if eb is not None:
            kw["b_emin"] = to_b(eb)
        return a, b, kw, post
    n = f.group if f.scales == "instruction" else (
        f.chunk * f.promote if f.scales == "promotion" else 0)
    if not n or not n_ok(n):
        return a, b, kw, post
    sc = _conv_operand_scales(f, n, ops)
    if sc is None:
        return a, b, kw, post
    ta, tb, Xa, Xb, fa, fb = sc
    if f.scales == "instruction":
        kw["a_gexp"] = to_a(_scale_exps(Xa, fa))[..., ::n]
        kw["b_gexp"] = to_b(_scale_exps(Xb, fb))[..., ::n, :]
        if fa.tensor_scale or fb.tensor_scale:  # the tensor scales in the epilogue (alpha)
            a, b = _unscaled(a, ta, fa), _unscaled(b, tb, fb)
            post = ta.float() * tb.float()
        return a, b, kw, post
    if fa.tensor_scale or fb.tensor_scale:
        post = ta.float() * tb.float()
    # promotion: unscaled elements, a scale per K-block
    kw = dict(a_scale=to_a(Xa)[..., ::n].float(), b_scale=to_b(Xb)[..., ::n, :].float(),
              a_emin=fa.elem.emin, b_emin=fb.elem.emin)
    return (_unscaled(a, ta, fa) / Xa.float(), _unscaled(b, tb, fb) / Xb.float(), kw,
            post)  # (exact)


def _gemm_conv(xp, w, stride, dilation, groups, size, f, em=(None, None), q=(None, None),
               wsrc=None):
    """The forward convolution of the padded xp with w (O, C/groups, *k): (N, O, *size).
    q: the QTensors of (x, w) (their block formats: _conv_scale_plan); wsrc: (w0, dim, wmap)
    where w is wmap(w0) of a weight w0 blocked along its dim (a transposed convolution's
    regrouped, flipped kernel), else w is blocked along its dim 1."""
    (O, Cg, *k), N, L = w.shape, xp.shape[0], math.prod(size)
    K = math.prod(k) * Cg
    w0, wdim, wmap = wsrc if wsrc is not None else (w, 1, lambda t: t)

    def to_b(t):  # (N, C, *S) -> (groups, K, N * L): one GEMM per group
        cols = _cols(t, k, stride, dilation, groups, size)  # (N, g, L, K)
        return cols.permute(1, 3, 0, 2).reshape(groups, K, N * L)

    def to_a(t):  # (O, C/groups, *k) -> (groups, O/groups, K)
        return t.reshape(groups, O // groups, Cg, -1).transpose(2, 3).reshape(
            groups, O // groups, K)

    # K = (kernel position, channel of the group): a K-group of n lies in one position where
    # the group's channels are a multiple of n; the blocks (a multiple of n, from a multiple of
    # n: a group starts at g * Cg) then hold whole K-groups, also where they cross conv groups
    w0, xp, kw, post = _conv_scale_plan(
        f, lambda n: Cg % n == 0,
        ((w0, q[1], wdim, lambda t: to_a(wmap(t))), (xp, q[0], 1, to_b)))
    w = wmap(w0)
    out = _kernel._matmul(to_a(w), to_b(xp), f, **{"a_emin": em[1], "b_emin": em[0], **kw})
    if post is not None:
        out = out * post
    out = out.reshape(groups, O // groups, N, L)
    return out.permute(2, 0, 1, 3).reshape(N, O, *size)


def _conv(x, w, geo, size, f, em=(None, None), q=(None, None)):
    """em: the minimum normal exponents of (x, w); q: their QTensors (block formats)."""
    stride, padding, dilation, groups = geo
    return _gemm_conv(_pad(x, [(p, p) for p in padding]), w, stride, dilation, groups, size, f,
                      em, q)


def _conv_transpose(x, w, geo, size, f, em=(None, None), q=(None, None)):
    """The transposed convolution of x (N, C, *S) with w (C, O/groups, *k) to spatial ``size``,
    as the forward convolution over the zero-inserted x (the section comment). w's blocks run
    along its dim 0 (C, across the groups), as dispatch rounds it."""
    stride, padding, dilation, groups = geo
    N, C, *S = x.shape
    k = w.shape[2:]
    z = x.new_zeros(N, C, *((n - 1) * s + 1 for n, s in zip(S, stride)))
    z[(..., *(slice(None, None, s) for s in stride))] = x
    pads = []
    for i, (kk, d) in enumerate(zip(k, dilation)):
        lo = d * (kk - 1) - padding[i]
        pads.append((lo, size[i] + d * (kk - 1) - z.shape[2 + i] - lo))

    def wmap(t):  # (C, O/groups, *k) -> (O, C/groups, *k), flipped
        t = t.unflatten(0, (groups, -1)).transpose(1, 2).flatten(0, 1)
        return t.flip(list(range(2, t.dim())))
    return _gemm_conv(_pad(z, pads), wmap(w), (1,) * len(k), dilation, groups, size, f, em, q,
                      wsrc=(w, 0, wmap))


def _conv_weight_grad(x, go, k, geo, f, em=(None, None), q=(None, None)):
    """The weight gradient (O, C/groups, *k) of the forward convolution of x (N, C, *S) whose
    output gradient is go (N, O, *So): a contraction over (batch, output position). q: the
    QTensors of (x, go), blocked along the batch (dispatch's axis 0 for grad_weight): where
    both are block-scaled for the datapath's K-group / interval of n (1 for the per-element
    clamps of MX operands; the batch and the blocks a multiple of n), K runs (output position,
    batch) instead, the batch innermost, so that each block is a run of K, as a block-scaled
    instruction takes its scales (in batch-outer order a block's elements lie L apart), and the
    scales go with it."""
    stride, padding, dilation, groups = geo
    (N, O, *size), Cg = go.shape, x.shape[1] // groups
    L, P = math.prod(size), math.prod(k)
    xp = _pad(x, [(p, p) for p in padding])

    def to_b(t, batch_inner):  # (N, C, *S) -> (groups, K, P * Cg)
        cols = _cols(t, k, stride, dilation, groups, size)  # (N, g, L, P * Cg)
        cols = cols.permute(1, 2, 0, 3) if batch_inner else cols.transpose(0, 1)
        return cols.reshape(groups, N * L, P * Cg)

    def to_a(t, batch_inner):  # (N, O, *So) -> (groups, O/groups, K)
        t = t.reshape(N, groups, O // groups, L)
        t = t.permute(1, 2, 3, 0) if batch_inner else t.permute(1, 2, 0, 3)
        return t.reshape(groups, O // groups, N * L)

    def n_ok(n):
        return N % n == 0
    inner = f.scales in ("instruction", "promotion") and _conv_operand_block_fits(
        f, n_ok, (q[1], q[0]))
    go, xp, kw, post = _conv_scale_plan(
        f, n_ok if inner else (lambda n: False),
        ((go, q[1], 0, lambda t: to_a(t, inner)), (xp, q[0], 0, lambda t: to_b(t, inner))))
    out = _kernel._matmul(to_a(go, inner), to_b(xp, inner), f,
                       **{"a_emin": em[1], "b_emin": em[0], **kw})  # em: of (x, go)
    if post is not None:
        out = out * post
    return out.reshape(O, P, Cg).transpose(1, 2).reshape(O, Cg, *k)


def _conv_operand_block_fits(f: AccumFormat, n_ok, qs) -> bool:
    """Whether both operands (QTensors qs) are block-scaled with blocks of a multiple of the
    datapath's K-group / interval n, and n_ok(n)."""
    n = f.group if f.scales == "instruction" else f.chunk * f.promote  # (MX clamps: 1)
    fmts = [_operand_block_fmt(q) for q in qs]
    return n_ok(n) and all(m is not None and m.block_size % n == 0 for m in fmts)



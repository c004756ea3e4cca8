"""Attention as a role: the formats of scaled dot-product attention's GEMMs and intermediates.

:class:`AttentionFormats` names every rounding of one attention ``O = softmax(scale * Q K^T +
mask) V`` (forward and backward). :func:`scaled_dot_product_attention` computes it with those
roundings on the payloads, as one autograd function whose backward runs the four backward GEMMs
with their own operand formats. A converted model whose recipe has ``attention=`` runs every
``F.scaled_dot_product_attention`` (and ``nn.MultiheadAttention``) of its forward through it
(:class:`AttentionMode`, a TorchFunctionMode entered by the root's hooks:
qtensor.nn.attention_hooks), whatever SDPA backend is selected: the fused kernels never run.

The math, with r(x, f, axis) the rounding of x to f along axis (None: not rounded), is the
specification that tests/convert/test_attention.py checks bit for bit (docs/attention.md):

    S  = r(r(Q, qk[0], E) @ r(K, qk[1], E)^T * scale  (+ mask), scores, keys)
    P  = r(softmax_f(S), probs, keys)           softmax_f: its steps rounded to ``softmax``
    Pd = P * keep / (1 - p)                     dropout (keep: Bernoulli(1 - p) draws)
    O  = r(Pd, pv[0], keys) @ r(V, pv[1], keys)
    dV = r(Pd, dv[0], queries)^T @ r(dO, dv[1], queries)
    dPd = r(dO, dp[0], Ev) @ r(V, dp[1], Ev)^T ;  dP = dPd * keep / (1 - p)
    dS = r(P * (dP - rowsum(P * dP)), ds, keys)
    dQ = r(dS, dq[0], keys) @ r(K, dq[1], keys) * scale
    dK = r(dS, dk[0], queries)^T @ r(Q, dk[1], queries) * scale

O is rounded to the value format of the first QTensor among Q, K, V (as any op's output); dQ,
dK, dV (and a float mask's gradient, dS summed to its shape) to dO's (the gradient role's). GEMMs sum in FP32 (torch.matmul on the payloads).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import types
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

from . import dispatch as _dispatch
from ..formats.base import Format, FormatError
from ..formats.parse import format as _parse_format
from .subclass import QTensor

__all__ = ["AttentionFormats", "scaled_dot_product_attention", "AttentionMode", "PAIRS",
           "VALUES"]

F = torch.nn.functional

# The GEMMs of attention and their operands, in the order of AttentionFormats' pairs
PAIRS = {"qk": ("q", "k"), "pv": ("p", "v"), "dq": ("ds", "k"), "dk": ("ds", "q"),
         "dv": ("p", "do"), "dp": ("do", "v")}
# The value formats of its intermediates
VALUES = ("scores", "probs", "softmax", "ds")


def _fmt(value, what: str) -> Optional[Format]:
    if value is None:
        return None
    try:
        f = value if isinstance(value, Format) else _parse_format(value)
    except FormatError as e:
        raise FormatError(f"{what}: {e}") from None
    elem = f.elem if f.is_block else f
    if elem.unsigned_range() is not None:
        raise FormatError(f"{what}: {f} cannot hold attention's signed values (and 0): use a "
                          "signed format")
    return f


@dataclass(frozen=True)
class AttentionFormats:
    """The formats of scaled dot-product attention (None everywhere: FP32, no rounding).

    Operand formats of the six GEMMs, each a pair (first operand, second operand):
    ``qk`` (Q, K) of S = Q K^T; ``pv`` (P, V) of O = P V; backward ``dq`` (dS, K), ``dk``
    (dS, Q), ``dv`` (P, dO), ``dp`` (dO, V). Each operand is rounded along its GEMM's
    reduction dim (1D blocks along it; 2D tiles over its last two dims).
    Value formats: ``scores`` (S, after scale and mask), ``probs`` (P, the softmax output that
    enters PV), ``softmax`` (the precision of the softmax's steps: S - max, exp, the row sum,
    the division), ``ds`` (dS, the scores' gradient).
    """

    qk: Any = (None, None)
    pv: Any = (None, None)
    dq: Any = (None, None)
    dk: Any = (None, None)
    dv: Any = (None, None)
    dp: Any = (None, None)
    scores: Any = None
    probs: Any = None
    softmax: Any = None
    ds: Any = None
    name: Optional[str] = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        for gemm, names in PAIRS.items():
            pair = getattr(self, gemm)
            if pair is None:
                pair = (None, None)
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"AttentionFormats.{gemm} must be a pair ({names[0]}_fmt, "
                                 f"{names[1]}_fmt), got {pair!r}")
            object.__setattr__(self, gemm, tuple(
                _fmt(f, f"AttentionFormats.{gemm} ({n})") for f, n in zip(pair, names)))
        for name in VALUES:
            object.__setattr__(self, name, _fmt(getattr(self, name), f"AttentionFormats.{name}"))

    @classmethod
    def of(cls, spec, what: str = "Recipe.attention") -> Optional["AttentionFormats"]:
        """AttentionFormats from None, an AttentionFormats, a dict of its fields, or one format
        (every operand of the six GEMMs in it; the values in FP32)."""
        if spec is None or isinstance(spec, AttentionFormats):
            return spec
        if isinstance(spec, dict):
            unknown = [k for k in spec if k not in PAIRS and k not in VALUES and k != "name"]
            if unknown:
                raise ValueError(f"{what}: unknown key(s) {', '.join(map(repr, unknown))}; the "
                                 f"keys are the GEMMs {', '.join(PAIRS)} (pairs of operand "
                                 f"formats) and the values {', '.join(VALUES)}")
            return cls(**spec)
        if isinstance(spec, (Format, str)):
            f = _fmt(spec, what)
            return cls(**{g: (f, f) for g in PAIRS})
        raise TypeError(f"{what}: expected None, qt.attention.AttentionFormats, a dict of its "
                        f"fields or a format, got {type(spec).__name__}: {spec!r}")

    def to_dict(self) -> dict:
        """JSON-able: formats as strings (AttentionFormats.of(d) inverts it)."""
        out = {g: [None if f is None else str(f) for f in getattr(self, g)] for g in PAIRS}
        out.update({v: None if getattr(self, v) is None else str(getattr(self, v))
                    for v in VALUES})
        return out

    def __str__(self) -> str:
        def s(f):
            return "fp32" if f is None else str(f)
        gemms = "; ".join(f"{g} ({', '.join(n + ' ' + s(f) for n, f in zip(PAIRS[g], getattr(self, g)))})"
                          for g in PAIRS)
        vals = ", ".join(f"{v} {s(getattr(self, v))}" for v in VALUES)
        return (f"{self.name}: " if self.name else "") + f"{gemms}; {vals}"


# ---------------------------------------------------------------------------------------------
# The math

def _r(x, fmt, axis):
    """x rounded to fmt along axis (None: x)."""
    if fmt is None:
        return x
    return _dispatch.quantize(x, _dispatch.with_axis(fmt, axis), keep_layout=False)


def _softmax(s, fmt):
    """softmax along the last dim, its steps rounded to fmt; rows that are all -inf give 0 (as
    torch's math SDPA)."""
    m = s.amax(-1, keepdim=True)
    dead = m == -math.inf
    x = _r(s - torch.where(dead, 0.0, m), fmt, -1)
    e = _r(torch.exp(x), fmt, -1)
    den = _r(e.sum(-1, keepdim=True), fmt, -1)
    return torch.where(dead, 0.0, _r(e / den, fmt, -1))


def _payload(x):
    return x._data if isinstance(x, QTensor) else x


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, fm, keep_scale, keep, scale, rep, out_fmts):
        q, k, v, mask = _payload(q), _payload(k), _payload(v), _payload(mask)
        ctx.mask_shape = None if mask is None else mask.shape
        if rep > 1:  # GQA: each K/V head serves rep query heads
            k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
        s = torch.matmul(_r(q, fm.qk[0], -1), _r(k, fm.qk[1], -1).transpose(-2, -1)) * scale
        if mask is not None:
            s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask
        s = _r(s, fm.scores, -1)
        p = _r(_softmax(s, fm.softmax), fm.probs, -1)
        pd = p if keep is None else p * (keep * keep_scale)
        o = torch.matmul(_r(pd, fm.pv[0], -1), _r(v, fm.pv[1], -2))
        ctx.save_for_backward(q, k, v, p, keep)
        ctx.fm, ctx.scale, ctx.keep_scale, ctx.rep = fm, scale, keep_scale, rep
        _record(pd)
        fmt, mm = out_fmts
        if fmt is None:
            return o
        o = _dispatch.quantize(o, _dispatch.fit_format(fmt, o.dim()))
        return QTensor._wrap(o, _dispatch.fit_format(fmt, o.dim()), mm)

    @staticmethod
    def backward(ctx, do):
        q, k, v, p, keep = ctx.saved_tensors
        fm, scale = ctx.fm, ctx.scale
        gfmt = (do.fmt, do.mm_fmt) if isinstance(do, QTensor) else None
        do = _payload(do)
        pd = p if keep is None else p * (keep * ctx.keep_scale)
        dv = torch.matmul(_r(pd, fm.dv[0], -2).transpose(-2, -1), _r(do, fm.dv[1], -2))
        dp = torch.matmul(_r(do, fm.dp[0], -1), _r(v, fm.dp[1], -1).transpose(-2, -1))
        if keep is not None:
            dp = dp * (keep * ctx.keep_scale)
        ds = _r(p * (dp - (p * dp).sum(-1, keepdim=True)), fm.ds, -1)
        dq = torch.matmul(_r(ds, fm.dq[0], -1), _r(k, fm.dq[1], -2)) * scale
        dk = torch.matmul(_r(ds, fm.dk[0], -2).transpose(-2, -1), _r(q, fm.dk[1], -2)) * scale
        if ctx.rep > 1:  # the query heads' gradients of each K/V head, summed
            dk = dk.unflatten(-3, (-1, ctx.rep)).sum(-3)
            dv = dv.unflatten(-3, (-1, ctx.rep)).sum(-3)
        # a float mask (a learned position bias) is added to the scores: its gradient is dS,
        # summed over what it was broadcast along
        dmask = ds.sum_to_size(ctx.mask_shape) if ctx.needs_input_grad[3] else None
        grads = []
        for g in (dq, dk, dv, dmask):
            if g is None:
                grads.append(g)
                continue
            if gfmt is not None:
                f = _dispatch.fit_format(gfmt[0], g.dim())
                g = QTensor._wrap(_dispatch.quantize(g, f), f, gfmt[1])
            grads.append(g)
        return (*grads, None, None, None, None, None, None)


_STATE = threading.local()


def _record(pd):
    """Hand P (after dropout) to an nn.MultiheadAttention that asked for its weights."""
    box = getattr(_STATE, "weights", None)
    if box is not None:
        box.append(pd)


@contextlib.contextmanager
def recording(on: bool = True):
    """A list that receives P (after dropout) of each emulated attention inside (None if not
    on)."""
    before = getattr(_STATE, "weights", None)
    _STATE.weights = [] if on else None
    try:
        yield _STATE.weights
    finally:
        _STATE.weights = before


def _first_q(*xs):
    return next((x for x in xs if isinstance(x, QTensor)), None)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 formats: AttentionFormats):
    """``F.scaled_dot_product_attention`` with the roundings of ``formats`` (see the module
    docstring), forward and backward, on QTensors or plain tensors."""
    fm = AttentionFormats.of(formats, "formats")
    if fm is None:
        raise ValueError("scaled_dot_product_attention: formats must be an AttentionFormats")
    if query.dim() < 2 or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError("scaled_dot_product_attention: query, key and value must have the same "
                         f"number of dims (>= 2), got {tuple(query.shape)}, {tuple(key.shape)}, "
                         f"{tuple(value.shape)}")
    if is_causal and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention: give attn_mask or is_causal, not both "
                         "(as torch)")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"scaled_dot_product_attention: dropout_p must be in [0, 1), got "
                         f"{dropout_p}")
    rep = 1
    if query.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        hq, hk = query.shape[-3], key.shape[-3]
        if not enable_gqa or hq % hk:
            raise ValueError(
                f"scaled_dot_product_attention: {hq} query heads and {hk} key/value heads need "
                "enable_gqa=True and a number of query heads divisible by the key/value heads")
        rep = hq // hk
    L, S, E = query.shape[-2], key.shape[-2], query.shape[-1]
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    mask = attn_mask  # (a float mask that requires grad gets its gradient)
    if is_causal:
        mask = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
    keep, keep_scale = None, 1.0
    if dropout_p > 0.0:
        shape = tuple(query.shape[:-1]) + (S,)  # the scores' shape
        keep = torch.empty(shape, dtype=_payload(query).dtype, device=query.device)
        keep.bernoulli_(1.0 - dropout_p)
        keep_scale = 1.0 / (1.0 - dropout_p)
    src = _first_q(query, key, value)
    out_fmts = (None, None) if src is None else (src.fmt, _dispatch._own_mm_fmt(src, QTensor))
    return _Attention.apply(query, key, value, mask, fm, keep_scale, keep, scale, rep, out_fmts)


# ---------------------------------------------------------------------------------------------
# The mode a converted model's forward runs under

def _sdpa_or_torch(formats):
    def sdpa(*args, **kwargs):
        if _first_q(*args[:3]) is None:
            return F.scaled_dot_product_attention(*args, **kwargs)
        return scaled_dot_product_attention(*args, **kwargs, formats=formats)
    return sdpa


def with_globals(fn, **names):
    """fn running the same code objects with some globals of its own (the library's module is not
    changed). Through decorators: a wrapper (``__wrapped__``) whose closure holds the function it
    wraps gets the rebound one; a wrapper that does not hold it is a ValueError."""
    closure = fn.__closure__
    inner = getattr(fn, "__wrapped__", None)
    if inner is not None:
        new = with_globals(inner, **names)
        cells = [c for c in closure or () if _cell_holds(c, inner)]
        if not cells:
            raise ValueError(f"{fn.__qualname__}: a decorator that does not hold the function it "
                             "wraps in its closure")
        closure = tuple(types.CellType(new) if c in cells else c for c in closure)
    env = fn.__globals__
    if any(n in fn.__code__.co_names for n in names):
        env = dict(env, **names)
    out = types.FunctionType(fn.__code__, env, fn.__name__, fn.__defaults__, closure)
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__dict__.update(fn.__dict__)
    if inner is not None:
        out.__wrapped__ = new
    return out


def _cell_holds(cell, obj) -> bool:
    try:
        return cell.cell_contents is obj
    except ValueError:  # an empty cell
        return False


def _mha_function(formats):
    """torch's own F.multi_head_attention_forward code, run with its SDPA call emulated: two
    globals of its own (its torch-function check, which would hand the call back to the mode, and
    scaled_dot_product_attention)."""
    return with_globals(F.multi_head_attention_forward, has_torch_function=lambda *_: False,
                        scaled_dot_product_attention=_sdpa_or_torch(formats))


class AttentionMode(TorchFunctionMode):
    """Every ``F.scaled_dot_product_attention`` (whatever backend is selected) and
    ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``, its fast path included: a mode
    turns it off) called while it is active, with a QTensor among query, key and value, runs
    :func:`scaled_dot_product_attention` with ``formats``."""

    def __init__(self, formats: AttentionFormats):
        super().__init__()
        self.formats = formats
        self._mha_fn = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention or func is F.multi_head_attention_forward:
            return self._emulate(func, args, kwargs)
        return func(*args, **kwargs)

    # (not traced: under torch.compile each attention is a graph break that runs eagerly)
    @torch.compiler.disable
    def _emulate(self, func, args, kwargs):
        if func is F.multi_head_attention_forward:
            return self._mha(func, args, kwargs)
        if _first_q(*args[:3]) is not None:
            return scaled_dot_product_attention(*args, **kwargs, formats=self.formats)
        return func(*args, **kwargs)

    def _mha(self, func, args, kwargs):
        # multi_head_attention_forward(query, key, value, embed_dim_to_check, num_heads, ...,
        # need_weights=True, ..., average_attn_weights=True, is_causal=False): it computes its
        # weights with bmm/softmax when asked for them; here they come from the emulation (P
        # after dropout, detached) and the output from its SDPA call, emulated
        code = func.__code__
        bound = dict(zip(code.co_varnames[:code.co_argcount], args), **kwargs)
        need = bound.get("need_weights", True)
        average = bound.get("average_attn_weights", True)
        bound["need_weights"] = False
        if self._mha_fn is None:
            self._mha_fn = _mha_function(self.formats)
        with recording(need) as got:
            out, _ = self._mha_fn(**bound)
        if not need:
            return out, None
        if not got:  # (no QTensor reached the SDPA call: torch's own path)
            bound["need_weights"] = True
            return func(**bound)
        w = got[-1].detach()
        if w.dim() == 4 and average:
            w = w.mean(dim=1)
        unbatched = bound["query"].dim() == 2
        return out, (w.squeeze(0) if unbatched else w)

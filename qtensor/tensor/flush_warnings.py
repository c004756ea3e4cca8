"""A warning when rounding a model's tensor to its format flushes most of it to zero, saturates it,
or clips it inside its blocks.

A format that is too narrow for a tensor fails silently: single-level NVFP4 (``nvfp4_single``:
E4M3 block scales, no FP32 tensor scale) cannot scale a weight gradient of magnitude 1e-6, so
every value rounds to zero and training stops without an error; a fixed-point activation
format with too few integer bits clamps most activations to its largest value. :func:`check`
looks at each rounding of a converted model's roles (weights at conversion, activations and
gradients as they run: the calls of :func:`qtensor.nn.plans.round_to` that name a role) and warns,
at the user's line, once per role and tensor (module or parameter) when

- more than :data:`FLUSH_LIMIT` (50%) of the tensor's nonzero values rounded to zero. Healthy
  formats flush far less: BF16 and MXFP8 none of a network's tensors, MXFP4 (a 32-value block
  whose scale follows its largest element) about 5-15% of Gaussian-like values; a format that
  flushes most values has lost the tensor (e.g. nvfp4_single: ~100% of a weight gradient);
- or more than :data:`SATURATE_LIMIT` (10%) of its finite nonzero values reached the format's
  largest magnitude (clamped) or overflowed to Inf/NaN. A few clamped outliers are the price of
  a range chosen on purpose (WAGE clips at +-1); when a tenth of the values clamp, the range
  sits inside the bulk of the distribution;
- or (a separate warning) a block format of the role, its value format or its operand format
  (``mm_fmt``, on values that enter contractions), clips more than :data:`CLIP_LIMIT` (3%) of
  the tensor's L1 norm to its blocks' largest values (:func:`clipping`: OCP MX's floor scale
  rule maps a block's amax up to 8 times its scale, E2M1 ends at 6), or more than
  :data:`CLIP_LIMIT_FINE` (8%) for elements that clip a value by at most 1/8 (E4M3, E5M2,
  E3M2: 1/8; E2M3 1/16; INT8: :func:`clip_limit`). Its share of values is no criterion:
  MXFP8's floor rule clips as many values of dL/dlogits as MXFP4's (10%), by at most 1/8 of
  each instead of 1/4, and trains; a language model's dL/dlogits at initialisation (the true
  class's p - 1 just below a power of two: half of each row's L1 norm) loses ~6% in MXFP6/MXFP8
  under floor, which trains as the ceil rule does (docs/analysis.md), and 12-14% in MXFP4.
  Tensors of fewer than :data:`CLIP_MIN_VALUES` values
  are not judged; it is measured on the first :data:`CLIP_CHECK_FIRST` roundings of each role
  and tensor, then on one in :data:`CLIP_CHECK_EVERY`.

Cost: two ``count_nonzero`` and one ``aminmax`` per rounding (the saturation count only when the
largest output reaches the format's range), one host read; when the clipping is measured, one
amax per block and four elementwise passes (docs/analysis.md has the numbers); nothing under
torch.compile or other tracing, nothing for a (role, tensor) that has warned. On by default;
``qt.set_flush_warnings(False)`` or the environment variable ``QTENSOR_FLUSH_WARNINGS=0`` turns it off. ``observe`` lets
:mod:`qtensor.analysis.analyze` see every such rounding (it needs the values, not only the counts).
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Callable, List, Optional

import torch

from ..kernels import reference
from ..formats.block import BlockFormat
from ..formats.base import Format
from ..warn import warn

__all__ = ["check", "set_flush_warnings", "flush_warnings_enabled", "observe", "FLUSH_LIMIT",
           "SATURATE_LIMIT", "CLIP_LIMIT", "CLIP_LIMIT_FINE", "CLIP_MIN_VALUES", "clip_limit",
           "fractions", "clipping", "check_operand", "check_gemm_operand", "watching"]

FLUSH_LIMIT = 0.5      # share of the nonzero values rounded to zero
SATURATE_LIMIT = 0.1   # share of the finite nonzero values clamped to the range or overflowed
CLIP_LIMIT = 0.03      # share of the tensor's L1 norm removed by clipping to the blocks' scales
CLIP_LIMIT_FINE = 0.08  # the same for elements that clip a value by at most 1/8 (see clip_limit)
CLIP_MIN_VALUES = 512  # smaller tensors are not judged: a few blocks' maxima are no statistic
CLIP_CHECK_FIRST = 4   # the clipping of a (role, tensor) is measured on its first 4 roundings,
CLIP_CHECK_EVERY = 16  # then on one in 16 (it costs a block amax and four passes)

_enabled = [os.environ.get("QTENSOR_FLUSH_WARNINGS", "1").strip().lower()
            not in ("0", "false", "no", "off")]
_warned: set = set()   # (role, tensor name) and (role, tensor name, "clip"): once each
_clip_calls: dict = {}  # (role, tensor name): roundings seen, for the clipping's schedule
_gemm_calls: dict = {}  # (role, tensor name): forward-GEMM operands seen, for their schedule
_observers: List[Callable] = []


def set_flush_warnings(enabled: bool) -> None:
    """Turn the flush/saturation warnings on or off for this process (default: on, unless the
    environment variable ``QTENSOR_FLUSH_WARNINGS=0``)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_flush_warnings expects a bool, got {enabled!r}")
    _enabled[0] = enabled


def flush_warnings_enabled() -> bool:
    return _enabled[0]


@contextlib.contextmanager
def observe(callback: Callable):
    """Call ``callback(role, name, formats, before, after)`` (formats: a Role) for every role rounding inside the
    block (plain float tensors, ``after`` the rounded payload), in addition to the warnings."""
    _observers.append(callback)
    try:
        yield
    finally:
        _observers.remove(callback)


def _largest(fmt: Format) -> Optional[float]:
    """The largest finite magnitude of fmt (None: no range to reach, e.g. FP32-wide)."""
    top = fmt.max_magnitude
    return top if top is not None and top < 3.0e38 else None  # FP32's range: the input's


def fractions(before: torch.Tensor, after: torch.Tensor, fmt: Format) -> dict:
    """Counts of one rounding: ``nonzero`` (nonzero inputs), ``flushed`` (of them, rounded to
    zero), ``saturated`` (finite nonzero inputs that reached the format's largest magnitude or
    became Inf/NaN) and ``finite`` (finite nonzero inputs). Rounding keeps zeros zero, so
    flushed = nonzero(before) - nonzero(after)."""
    nz_in = torch.count_nonzero(before)
    nz_out = torch.count_nonzero(after)
    lo, hi = torch.aminmax(after)
    top = _largest(fmt)
    nz_in, nz_out, lo, hi = torch.stack([nz_in.to(torch.float64), nz_out.to(torch.float64),
                                         lo.double(), hi.double()]).tolist()
    out = {"nonzero": int(nz_in), "flushed": int(nz_in - nz_out), "saturated": 0,
           "finite": int(nz_in)}
    peak = max(abs(lo), abs(hi)) if lo == lo and hi == hi else float("nan")
    if (top is not None and not peak < top) or not (peak < float("inf")):
        finite_in = torch.isfinite(before) & (before != 0)
        hit = ~torch.isfinite(after)
        if top is not None:
            hit |= after.abs() >= top
        out["finite"] = int(finite_in.sum())
        out["saturated"] = int((hit & finite_in).sum())
    return out


# ---------------------------------------------------------------------------------------------
# Clipping inside a block: values above the largest value of their block's grid

def _blocks(x: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """x laid out as [..., blocks, block size] (zero-padded at the ends, which clips nothing)
    by fmt's blocking, as the rounding blocks it (reference.py's layout)."""
    if fmt.block_shape is not None:
        return reference.tile_blocks(x, fmt)[0]
    return reference.block_layout(x, fmt)


def clip_limit(fmt: BlockFormat) -> float:
    """The clipped share of the L1 norm above which fmt's clipping is warned about:
    :data:`CLIP_LIMIT`, or :data:`CLIP_LIMIT_FINE` where the element clips a value by at most
    1/8. A clipped value loses at most 1 - max_elem / 2^(emax_elem + 1) of itself (the floor
    rule's worst case, amax just below 2^(emax_elem + 1) times the scale; the other rules clip
    less): 1/4 for E2M1 (6 of 8), 1/8 for E4M3, E5M2 and E3M2, 1/16 for E2M3. Where each value
    loses at most 1/8, dL/dlogits' structural ~6% (half its norm in the true classes' entries)
    stays below the limit: measured harmless (docs/analysis.md)."""
    elem = fmt.elem
    worst = 1.0 - float(elem.max) / 2.0 ** (elem.emax + 1)
    return CLIP_LIMIT_FINE if worst <= 0.125 else CLIP_LIMIT


def _settled(fmt: BlockFormat) -> bool:
    """Whether fmt's rounding may lower a block's scale below the scale of the block's amax
    (the reference's idempotence step: rules amax, even, 4over6, ceil with mantissa bits)."""
    return not (fmt.scale_rule in ("floor", "ceil") and fmt.power_of_two_scales)


def clipping(x: torch.Tensor, fmt: Format, q: Optional[torch.Tensor] = None, *,
             count: bool = True) -> Optional[dict]:
    """How much rounding x to the block format fmt clips inside its blocks (None for other
    formats: a scalar format has no block scale; its range is ``saturated``'s).

    A value is clipped when it lies beyond its block's largest value, ``elem.max * X`` (``X``
    the block's scale, times the tensor scale with ``tensor_scale``; ``elem.min * X`` for a
    negative value), where the saturating element rounds it to that value: |q| < |x|. Returns
    ``clipped`` (the number of such values), ``lost`` (the sum of |x| - |q| over them) and
    ``magnitude`` (the sum of |x| over the finite blocks; both sums in float32, pairwise).
    ``count=False`` leaves ``clipped`` out (None; the watch counts only when it warns). Blocks
    that hold Inf/NaN (rounded to NaN) and blocks of zero scale (flushed) clip nothing.

    X is the block's scale exactly: rules floor and ceil with power-of-two scales derive it
    from the block's amax, as the rounding does; for the others (amax, even, ceil with
    mantissa bits, 4over6) rounding can lower it (the reference's idempotence step), and it is
    the scale of the rounded block's amax, which is the block's scale (each rule maps its
    grid's top back to X, and the step ends when the scale stops falling). That needs ``q``
    (x rounded to fmt; without it x is rounded here). 4over6 blocks take the map-to-6 scale
    when their rounded max is that grid's top, else the map-to-4 one, whose top (1.5 times the
    block's amax) clips nothing: a map-to-4 block whose max happens to equal the map-to-6
    grid's top counts as map-to-6, an upper bound.
    Cost: one amax per block and three elementwise passes (|x|, minus the top, clamp) and two
    sums; x of any float dtype, compared with the tops in float32 (which hold them exactly)."""
    if not fmt.is_block:
        return None
    from .dispatch import fit_format  # (dispatch imports this module's users)
    fmt = fit_format(fmt, x.dim())
    elem = fmt.elem
    hi = float(elem.max)
    lo = float(elem.lowest)
    if x.numel() == 0 or not fmt.clips_in_blocks:
        return {"clipped": 0, "lost": 0.0, "magnitude": float(x.abs().sum().float())}
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        x = x.float()
    b = _blocks(x, fmt)
    a = b.abs()
    amax = a.amax(dim=-1, keepdim=True).double()
    bad = ~torch.isfinite(amax)
    if fmt.tensor_scale:
        # TE's block scales X and decode tensor scale s, as the rounding takes them: a block's
        # top is fl32(max_elem * X * s) (float64 X * s is exact)
        from ..formats.base import is_stochastic
        from ..kernels.backend import two_level as _two_level
        rounding = "nearest" if is_stochastic(fmt.rounding) else fmt.rounding
        _, s, X = _two_level(x, fmt, rounding, 0, block_scales=True)
        scale = X.double() * s.double()
    else:
        candidates = reference.scale_candidates(fmt)
        if _settled(fmt):
            if q is None:
                from .dispatch import quantize
                q = quantize(x.float(), fmt, keep_layout=False)
            rmax = _blocks(q, fmt).abs().amax(dim=-1, keepdim=True).double()
            bad |= ~torch.isfinite(rmax)
            rmax = torch.where(bad, 0.0, rmax)
            scale = candidates[0](rmax)
            if len(candidates) == 2:  # 4over6: map-to-6 where the block's max is its top
                scale = torch.where(rmax == hi * scale, scale, candidates[1](rmax))
        else:
            # (the amax the scale rule reads: a negative power of two can count lower)
            scale = candidates[0](torch.where(bad, 0.0, reference.scale_amax(b, fmt)))
    keep = ~bad & (scale > 0)
    inf = torch.full_like(scale, float("inf"))
    top = torch.where(keep, hi * scale, inf).float()  # (past float32: Inf, clips nothing)
    if lo == -hi:
        over = (a - top).clamp_min_(0)
    else:  # an element range with one more negative code: each sign its own top
        bottom = torch.where(keep, lo * scale, -inf).float()
        over = (b - top).clamp_min_(0) + (bottom - b).clamp_min_(0)
    lost, magnitude = torch.stack([over.sum(), a.sum().float()]).tolist()
    if not (math.isfinite(lost) and math.isfinite(magnitude)):  # Inf/NaN blocks: left out
        over.nan_to_num_(0.0, posinf=0.0)
        lost = float(over.sum())
        magnitude = float(torch.where(keep.expand_as(a), a, 0).nan_to_num(0.0, posinf=0.0)
                          .sum().float())
    return {"clipped": int(torch.count_nonzero(over)) if count else None, "lost": lost,
            "magnitude": magnitude}


def _tracing(t: torch.Tensor) -> bool:
    if torch.compiler.is_compiling() or type(t) is not torch.Tensor:
        return True  # fake or functional tensors: no values
    return t.is_cuda and torch.cuda.is_current_stream_capturing()  # cannot read back


def _an_operand(role: str, name: str) -> bool:
    """Whether a role rounding's value enters contractions, where its operand format rounds
    it: activations, weights, and the gradients of module outputs and inputs ("gradient of the
    output of fc2"); not a parameter's gradient ("gradient of fc2.weight") nor a bias."""
    return role in ("activation", "weight") or (role == "grad"
                                                 and name.startswith("gradient of the "))


def _block_roundings(role, name, formats, before, after):
    """The block-format roundings of a role rounding: (what, input, format, rounded or None):
    the value format's (``before`` to ``after``), and the operand format's (``mm_fmt``: of
    ``after``, blocked along the last axis as qt.analyze's operand rows; not rounded here)."""
    out = []
    fmt, mm = formats.fmt, getattr(formats, "mm_fmt", None)
    if fmt.clips_in_blocks:
        out.append(("", before, fmt, after))
    if mm is not None and mm.clips_in_blocks and mm != fmt and after.dim() > 0 and \
            _an_operand(role, name):
        from .dispatch import with_axis
        out.append(("as an operand ", after, with_axis(mm, -1), None))
    return out


def _clips(role, name, formats) -> bool:
    """Whether this rounding's clipping is checked now: a block format that can clip, and
    the first CLIP_CHECK_FIRST roundings of (role, name), then one in CLIP_CHECK_EVERY."""
    fmt, mm = formats.fmt, getattr(formats, "mm_fmt", None)
    if not (fmt.clips_in_blocks or (
            mm is not None and mm.clips_in_blocks and _an_operand(role, name))):
        return False
    n = _clip_calls[(role, name)] = _clip_calls.get((role, name), 0) + 1
    return n <= CLIP_CHECK_FIRST or n % CLIP_CHECK_EVERY == 0


def check(role: str, name: str, formats, before: torch.Tensor, after: torch.Tensor) -> None:
    """Warn (once per ``(role, name)``) if rounding ``before`` to ``formats`` (a
    :class:`qtensor.nn.plans.Role`: its value format ``fmt``, its operand format ``mm_fmt``) gave
    ``after`` with most nonzero values flushed to zero or saturated, and (once more) if a block
    format of it clips more than :data:`CLIP_LIMIT` of the tensor's L1 norm to its blocks'
    largest values; feed the observers."""
    if torch.compiler.is_compiling():  # no values (and no bookkeeping to trace)
        return
    range_done = (role, name) in _warned
    clip_done = (role, name, "clip") in _warned or not _clips(role, name, formats)
    if not _observers and (not _enabled[0] or (range_done and clip_done)):
        return
    if after.numel() == 0 or not after.is_floating_point() or _tracing(after) or \
            _tracing(before):
        return
    for callback in list(_observers):
        callback(role, name, formats, before, after)
    if not _enabled[0]:
        return
    if not range_done:
        _check_range(role, name, formats, before, after)
    if not clip_done:
        _check_clipping(role, name, formats, before, after)


def check_operand(role: str, name: str, formats, value: torch.Tensor) -> None:
    """For a value that reached its role already in the role's formats (an op rounded it, as
    the dispatch rounds an op's output on QTensors): nothing was rounded here, but its operand
    format (``mm_fmt``) will round it in each contraction; warn once per ``(role, name)`` if
    that clips more than :data:`CLIP_LIMIT` of its L1 norm, and tell the observers that have an
    ``operand`` method (``callback.operand(role, name, formats, value)``)."""
    mm = getattr(formats, "mm_fmt", None)
    if torch.compiler.is_compiling() or mm is None or not mm.is_block or mm == formats.fmt \
            or not _an_operand(role, name):
        return
    hears = [c for c in _observers if hasattr(c, "operand")]
    done = not _enabled[0] or (role, name, "clip") in _warned or not _clips(role, name, formats)
    if (done and not hears) or value.numel() == 0 or not value.is_floating_point() or \
            value.dim() == 0 or _tracing(value):
        return
    for callback in hears:
        callback.operand(role, name, formats, value)
    if not done:
        _check_clipping(role, name, formats, value, value, value_rounded=False)


def watching() -> bool:
    """Whether the warnings are on (a caller skips its own preparation when not)."""
    return _enabled[0]


class _Operand:  # the formats of a GEMM operand's rounding, as a Role gives them
    def __init__(self, fmt):
        self.fmt, self.mm_fmt = fmt, None


def check_gemm_operand(role: str, name: str, fmt, value: torch.Tensor, axis: int,
                       transform=None) -> None:
    """Warn as :func:`check` does if rounding ``value`` (a converted Linear/Conv's input or
    weight, payload) to ``fmt``, the format its forward GEMM gives it under ``Recipe.gemm``
    (after ``transform`` along K, blocked along ``axis``), flushes, saturates or clips it.
    Measured on the first CLIP_CHECK_FIRST forwards of each (role, name), then one in
    CLIP_CHECK_EVERY (one extra rounding each); a stochastic format is measured rounding to
    nearest (its scales, hence its clipping, are the same; torch's generator is not drawn
    from, so the warnings do not change a run's bits)."""
    if fmt is None or not _enabled[0] or torch.compiler.is_compiling():
        return
    name = f"{name} (forward GEMM operand)"
    key = (role, name)
    if key in _warned and (role, name, "clip") in _warned:
        return
    if value.numel() == 0 or not value.is_floating_point() or value.dim() == 0 or \
            _tracing(value):
        return
    n = _gemm_calls[key] = _gemm_calls.get(key, 0) + 1
    if not (n <= CLIP_CHECK_FIRST or n % CLIP_CHECK_EVERY == 0):
        return
    from .dispatch import quantize, with_axis
    from ..formats.base import is_stochastic
    if is_stochastic(getattr(fmt, "rounding", None) or "nearest"):
        fmt = fmt.replace(rounding="nearest")
    x = value if transform is None else transform.apply(value, axis)
    fa = with_axis(fmt, axis)
    q = quantize(x, fa)
    formats = _Operand(fa)
    if key not in _warned:
        _check_range(role, name, formats, x, q)
    if (role, name, "clip") not in _warned and fa.clips_in_blocks:
        _check_clipping(role, name, formats, x, q)


def _check_clipping(role, name, formats, before, after, value_rounded=True) -> None:
    roundings = _block_roundings(role, name, formats, before, after)
    if not value_rounded:  # only the operand rounding happens here
        roundings = [r for r in roundings if r[3] is None]
    for what, x, fmt, q in roundings:
        if x.numel() < CLIP_MIN_VALUES:
            continue
        c = clipping(x, fmt, q, count=False)
        share = c["lost"] / c["magnitude"] if c["magnitude"] > 0 else 0.0
        limit = clip_limit(fmt)
        if share <= limit:
            continue
        c = clipping(x, fmt, q)  # (the count for the message)
        _warned.add((role, name, "clip"))
        n = int(torch.count_nonzero(x))
        warn(f"qtensor: {name} ({role} role, shape {tuple(after.shape)}) {what}in {fmt}: "
             f"{100 * c['clipped'] / max(n, 1):.1f}% of its {n} nonzero values lie beyond their "
             f"block's largest value (the element's max times the block's scale) and were "
             f"clipped to it, removing {100 * share:.1f}% of the tensor's L1 norm (the limit: "
             f"{100 * limit:g}%, qtensor.flush_warnings."
             f"{'CLIP_LIMIT' if limit == CLIP_LIMIT else 'CLIP_LIMIT_FINE'}). "
             f"{_clip_hint(fmt)}; use "
             "scale_rule='ceil' (the smallest scale that holds the "
             "block's amax), or a rule that keeps this tensor in higher precision. (Once per "
             "role and tensor; qt.set_flush_warnings(False) or QTENSOR_FLUSH_WARNINGS=0 turns "
             "these warnings off; qt.analyze measures every tensor.)")
        return


def _clip_hint(fmt: BlockFormat) -> str:
    """Why fmt's scale rule clips: floor (and even) put a block's amax anywhere below
    2^(emax_elem + 1) times the scale, past the element's max."""
    if fmt.scale_rule in ("floor", "even"):
        return (f"The {fmt.scale_rule} scale rule (OCP MX's is floor) maps a block's amax up to "
                f"{2.0 ** (fmt.elem.emax + 1):g} times its scale, past the element's largest "
                f"value {fmt.elem.max:g}")
    return (f"The {fmt.scale_rule} scale rule's scale of a block maps its amax past the "
            f"element's largest value {fmt.elem.max:g} (a scale rounded down, or at the scale "
            "format's range)")


def _check_range(role, name, formats, before, after) -> None:
    fmt = formats.fmt
    c = fractions(before, after, fmt)
    flushed = c["flushed"] / c["nonzero"] if c["nonzero"] else 0.0
    saturated = c["saturated"] / c["finite"] if c["finite"] else 0.0
    if flushed <= FLUSH_LIMIT and saturated <= SATURATE_LIMIT:
        return
    _warned.add((role, name))
    what = []
    if flushed > FLUSH_LIMIT:
        what.append(f"{100 * flushed:.1f}% of its {c['nonzero']} nonzero values rounded to zero")
    if saturated > SATURATE_LIMIT:
        what.append(f"{100 * saturated:.1f}% of its finite nonzero values saturated (clamped to "
                    f"the format's largest magnitude, or overflowed to Inf/NaN)")
    hint = ("a format with a wider range (more exponent bits, a block format with a per-tensor "
            "scale such as nvfp4, or a loss scale for gradients)")
    warn(f"qtensor: {name} ({role} role, shape {tuple(after.shape)}) in {fmt}: "
         f"{' and '.join(what)}; this format is too narrow for this tensor: use {hint}, or a "
         "rule that keeps it in higher precision. (Once per role and tensor; "
         "qt.set_flush_warnings(False) or QTENSOR_FLUSH_WARNINGS=0 turns these warnings off; "
         "qt.analyze measures every tensor.)")

"""QPyTorch 0.3.0's API on qtensor formats: change one import, get the same numbers.

    import qtorch                                ->  import qtensor.compat.qtorch as qtorch
    from qtorch.quant import float_quantize, ... ->  from qtensor.compat.qtorch.quant import ...

(likewise ``qtorch.optim`` and ``qtorch.auto_low``). Signatures and defaults are QPyTorch 0.3.0's
(rounding defaults to "stochastic"). Every rounding goes through ``qt.quantize`` with a qtensor
format (``FloatingPoint(...).format`` gives it), so the compiled kernels are used where built.
``float_quantize``, ``fixed_point_quantize`` and ``block_quantize`` reproduce what QPyTorch's CPU
kernels compute, float32 pre-roundings and tie rules included, bit for bit except where QPyTorch
is wrong or undefined (NaN stays NaN, floats keep -0.0, its undefined shifts are computed
correctly); stochastic rounding is reproducible under ``torch.manual_seed`` and agrees with QPyTorch's
statistically, not bit for bit.

The format that reproduces each function, and every deliberate difference: docs/compat.md.
"""
from __future__ import annotations

import copy
import math
import sys
import types
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..formats.block import BlockFormat
from ..formats.fixed import FixedFormat
from ..formats.float import FloatFormat
from ..formats.base import FormatError
from ..kernels.ops import quantize as _qt_quantize

__all__ = [
    "Number", "FloatingPoint", "FixedPoint", "BlockFloatingPoint",
    "float_quantize", "fixed_point_quantize", "block_quantize", "quantizer", "Quantizer",
    "OptimLP", "lower", "sequential_lower", "float_format", "fixed_format", "block_format",
]

_ROUNDINGS = ("stochastic", "nearest")


class QPyTorchArgumentError(ValueError, AssertionError):
    """Bad arguments. Also an AssertionError because QPyTorch reports these with ``assert``."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise QPyTorchArgumentError(msg)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_rounding(rounding) -> str:
    _check(rounding in _ROUNDINGS,
           f"invalid rounding mode {rounding!r}: QPyTorch's modes are 'stochastic' and 'nearest'")
    return rounding


def _check_tensor(x) -> None:
    _check(isinstance(x, torch.Tensor), f"expected a torch.Tensor, got {type(x).__name__}")


# ---------------------------------------------------------------------------------------------
# Number classes (qtorch.number)

class Number:
    """Base class of QPyTorch's number descriptions."""

    @property
    def format(self):
        """The equivalent qtensor format (nearest rounding of QPyTorch)."""
        raise NotImplementedError


class FloatingPoint(Number):
    """QPyTorch's low-precision float: ``exp`` exponent and ``man`` mantissa bits (1..8, 1..23)."""

    def __init__(self, exp, man):
        _check(_is_int(exp) and 8 >= exp > 0, f"invalid bits for exponent: {exp} (1..8)")
        _check(_is_int(man) and 23 >= man > 0, f"invalid bits for mantissa: {man} (1..23)")
        self.exp, self.man = exp, man

    @property
    def format(self):
        return float_format(self.exp, self.man)

    def __repr__(self):
        return f"FloatingPoint (exponent={self.exp:d}, mantissa={self.man:d})"

    __str__ = __repr__


class FixedPoint(Number):
    """QPyTorch's fixed point: word length ``wl``, fractional length ``fl``."""

    def __init__(self, wl, fl, clamp=True, symmetric=False):
        _check(_is_int(wl) and wl > 0, f"invalid bits for word length: {wl}")
        _check(_is_int(fl) and fl > 0, f"invalid bits for fractional length: {fl}")
        _check(isinstance(clamp, bool), f"invalid type for clamping choice: {type(clamp)}")
        _check(isinstance(symmetric, bool), f"invalid type for symmetric: {type(symmetric)}")
        self.wl, self.fl, self.clamp, self.symmetric = wl, fl, clamp, symmetric

    @property
    def format(self):
        fmt = fixed_format(self.wl, self.fl, self.symmetric) if self.clamp else None
        if fmt is None:
            raise FormatError(f"{self!r} (clamp={self.clamp}) has no qtensor FixedFormat: "
                              "unclamped or wider than 24 bits")
        return fmt

    def __repr__(self):
        return f"FixedPoint (wl={self.wl:d}, fl={self.fl:d})"

    __str__ = __repr__


class BlockFloatingPoint(Number):
    """QPyTorch's block floating point: word length ``wl``; ``dim=-1``: one block per tensor."""

    def __init__(self, wl, dim=-1):
        _check(_is_int(wl) and wl > 0, f"invalid bits for word length: {wl}")
        _check(_is_int(dim) and dim >= -1, f"invalid dimension: {dim}")
        self.wl, self.dim = wl, dim

    @property
    def format(self):
        """The format of the reshaped tensor: (size along dim, everything else) or one block."""
        return block_format(self.wl, None if self.dim == -1 else -1)

    def __repr__(self):
        return f"BlockFloatingPoint (wl={self.wl:d}, dim={self.dim:d})"

    __str__ = __repr__


def _kind(number) -> Optional[str]:
    """'float' / 'fixed' / 'block' for ours and for QPyTorch's own number objects (duck typed)."""
    if number is None:
        return None
    name = type(number).__name__
    if isinstance(number, FloatingPoint) or name == "FloatingPoint":
        return "float"
    if isinstance(number, FixedPoint) or name == "FixedPoint":
        return "fixed"
    if isinstance(number, BlockFloatingPoint) or name == "BlockFloatingPoint":
        return "block"
    raise QPyTorchArgumentError(
        f"expected a FloatingPoint, FixedPoint or BlockFloatingPoint number, got {number!r}")


# ---------------------------------------------------------------------------------------------
# Formats

def float_format(exp: int, man: int) -> FloatFormat:
    """The qtensor format of QPyTorch's ``float_quantize(x, exp, man, "nearest")``."""
    _check(_is_int(exp) and 1 <= exp <= 8, f"float_quantize: exp must be 1..8, got {exp!r}")
    _check(_is_int(man) and 0 <= man <= 23, f"float_quantize: man must be 0..23, got {man!r}")
    if exp == 8:  # the top binade does not fit float32: QPyTorch overflows to Inf there
        return FloatFormat(8, man, rounding="nearest_away")
    return FloatFormat(exp, man, specials="none", saturate=True, rounding="nearest_away")


def fixed_format(wl: int, fl: int, symmetric: bool = False) -> Optional[FixedFormat]:
    """The qtensor format of QPyTorch's clamped fixed point, or None if float32 cannot hold it."""
    try:
        return FixedFormat(wl, fl, symmetric=symmetric, rounding="nearest")
    except FormatError:
        return None


def block_format(wl: int, axis: Optional[int] = None, rounding: str = "nearest_away") -> BlockFormat:
    """QPyTorch's block floating point of word length wl, one block per ``axis`` (None: all)."""
    _check(_is_int(wl) and 2 <= wl <= 24,
           f"block_quantize: wl must be 2..24 (a sign bit, a leading bit, and at most float32's "
           f"precision), got {wl!r}")
    return BlockFormat(FixedFormat(wl, wl - 2, symmetric=True), block_size=None, axis=axis,
                       rounding=rounding)


# ---------------------------------------------------------------------------------------------
# Quantization functions (qtorch.quant)

def float_quantize(x, exp, man, rounding="stochastic"):
    """Round x to QPyTorch's float with ``exp`` exponent and ``man`` mantissa bits."""
    _check_tensor(x)
    rounding = _check_rounding(rounding)
    fmt = float_format(exp, man)
    if rounding == "stochastic":
        return _qt_quantize(x, fmt, rounding="stochastic")
    if exp < 8 and x.dtype == torch.float32:
        # QPyTorch's x + 2^emin for subnormals rounds x to 2^(emin-23) first (ties to even);
        # the same grid as FloatFormat(exp, 23), which leaves normal values unchanged.
        x = _qt_quantize(x, FloatFormat(exp, 23, specials="none"), rounding="nearest")
    return _qt_quantize(x, fmt, rounding="nearest_away")


def _fixed_bounds(wl, fl, symmetric, dtype):
    """QPyTorch's clamp bounds, computed in double and stored in x's dtype as its kernel does."""
    t_min = -(2.0 ** (wl - fl - 1))
    t_max = -t_min - 2.0 ** -fl
    if symmetric:
        t_min += 2.0 ** -fl
    as_dtype = torch.tensor([t_min, t_max], dtype=torch.float64).to(dtype)
    return as_dtype[0].item(), as_dtype[1].item()


def _round_to_grid(x, fl, rounding):
    """x rounded to multiples of 2^-fl with no range limit, as QPyTorch's kernel computes it."""
    work = x.detach()
    if work.dtype in (torch.float16, torch.bfloat16):
        work = work.float()
    y = work * 2.0 ** fl  # exact, or +-Inf on overflow as QPyTorch's float ldexp
    if rounding == "nearest":
        if y.dtype == torch.float32:  # QPyTorch: nearbyint((y + 0.5f) - 0.5), first sum in float
            k = torch.round((y + 0.5).double() - 0.5)
        else:
            k = torch.round(y)  # ties to even, as nearbyint
    else:
        y = y.double()
        k = torch.floor(y + torch.rand_like(y))
    return (k * 2.0 ** -fl).to(x.dtype)


def _fixed_quantize_with_mask(x, wl, fl, symmetric, rounding):
    """Rounded and clamped x, and the mask of the values the clamp changed."""
    q = _round_to_grid(x, fl, rounding)
    t_min, t_max = _fixed_bounds(wl, fl, symmetric, x.dtype)
    mask = (q > t_max) | (q < t_min)
    return torch.clamp(q, t_min, t_max), mask


def fixed_point_quantize(x, wl, fl, clamp=True, symmetric=False, rounding="stochastic"):
    """Round x to QPyTorch's fixed point (word length wl, fractional length fl)."""
    _check_tensor(x)
    rounding = _check_rounding(rounding)
    _check(_is_int(wl) and _is_int(fl), f"fixed_point_quantize: wl, fl must be ints, got {wl!r}, {fl!r}")
    _check(wl >= 1, f"fixed_point_quantize: wl must be >= 1, got {wl}")
    fmt = fixed_format(wl, fl, symmetric) if clamp else None
    if fmt is not None:
        return _qt_quantize(x, fmt, rounding=rounding)
    if clamp:
        return _fixed_quantize_with_mask(x, wl, fl, symmetric, rounding)[0]
    return _round_to_grid(x, fl, rounding)


def _block_ties_up(x1, q, wl, amax_dims):
    """QPyTorch rounds ties toward +inf: move negative ties (rounded away) one step up."""
    if x1.dim() == 0:
        amax = x1.abs()
    else:  # max |x| in one reduction, without an abs() temporary
        amax = torch.linalg.vector_norm(x1, ord=float("inf"), dim=amax_dims, keepdim=True)
    e = torch.clamp(torch.frexp(amax)[1] - 1, -127, 127)  # the E8M0 scale range of the format
    half_step = torch.ldexp(torch.full_like(amax, 0.5), e + 2 - wl)
    # x1 - q is +half_step exactly at negative ties (rounded away, i.e. down), and at the one
    # positive tie above the largest value (rounded up, then clamped): it stays
    tie = (x1 - q) == half_step
    if not bool(tie.any()):
        return q
    return torch.where(tie & (x1 < 0), x1 + half_step, q)


def block_quantize(x, wl, dim=-1, rounding="stochastic"):
    """Round x to QPyTorch's block floating point; ``dim=-1``: one block for the whole tensor."""
    _check_tensor(x)
    rounding = _check_rounding(rounding)
    _check(_is_int(dim), f"block_quantize: dim must be an int, got {dim!r}")
    mode = "stochastic" if rounding == "stochastic" else "nearest_away"
    block_format(wl)  # validates wl
    if x.numel() == 0:
        return x.clone()
    # Lay x out as 2-D (or leave it) so that each block is one whole axis run, copying only if
    # the elements sharing an index of dim are neither rows nor columns of a view.
    if dim == -1 or x.dim() == 0:
        x2, axis, restore = x, None, None
    else:
        _check(-x.dim() <= dim < x.dim(),
               f"block_quantize: dim {dim} out of range for a tensor of shape {tuple(x.shape)}")
        d = dim % x.dim()
        n = x.shape[d]
        if math.prod(x.shape[d + 1:]) == 1:  # blocks are the columns of (everything before, n)
            x2, axis, restore = x.reshape(-1, n), 0, lambda q: q.reshape(x.shape)
        else:  # blocks are the rows of (n, everything else)
            moved = x.movedim(d, 0)
            x2, axis = moved.reshape(n, -1), 1
            restore = lambda q: q.reshape(moved.shape).movedim(0, d).contiguous()  # as QPyTorch
    fmt = block_format(wl, axis, mode)
    if rounding == "nearest" and wl <= 22:
        dtype = x2.dtype
        x1 = x2.float() if dtype in (torch.float16, torch.bfloat16) else x2
        if dtype == torch.float32:  # QPyTorch's float32 sum x + 1.5*2^(e+2) rounds x to 2^(e-21)
            pre = BlockFormat(FixedFormat(23, 21, symmetric=True), block_size=None, axis=axis,
                              rounding="nearest")
            x1 = _qt_quantize(x1, pre)
        q = _qt_quantize(x1, fmt)
        q = _block_ties_up(x1, q, wl, tuple(range(x1.dim())) if axis is None else axis)
        q = q.to(dtype)
    else:
        q = _qt_quantize(x2, fmt)
    return q if restore is None else restore(q)


def _quant_function(number, rounding) -> Optional[Callable]:
    kind = _kind(number)
    if kind == "float":
        return lambda t: float_quantize(t, number.exp, number.man, rounding)
    if kind == "fixed":
        return lambda t: fixed_point_quantize(t, number.wl, number.fl, number.clamp,
                                              number.symmetric, rounding)
    if kind == "block":
        return lambda t: block_quantize(t, number.wl, number.dim, rounding)
    return None


class _Rounding(torch.autograd.Function):
    """Forward rounding, backward rounding of the gradient (optionally masked where clamped)."""

    @staticmethod
    def forward(ctx, x, forward_quant, backward_quant, hooks, mask_fn):
        ctx.backward_quant, ctx.hooks = backward_quant, hooks
        ctx.mask = None
        if mask_fn is not None:
            out, ctx.mask = mask_fn(x)
            return out
        if forward_quant is None:
            return x.view_as(x)
        return forward_quant(x.contiguous())

    @staticmethod
    def backward(ctx, grad_output):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        grad = grad_output
        if ctx.backward_quant is not None:
            for hook in ctx.hooks:
                grad = hook(grad)
            grad = ctx.backward_quant(grad.contiguous())
            if ctx.mask is not None:
                grad = grad.masked_fill(ctx.mask, 0)
        return grad, None, None, None, None


def quantizer(forward_number=None, backward_number=None, forward_rounding="stochastic",
              backward_rounding="stochastic", clamping_grad_zero=False, backward_hooks=[]):
    """A function x -> rounded x whose gradient is rounded to ``backward_number``.

    ``clamping_grad_zero`` zeroes the gradient where the forward fixed-point rounding clamped;
    ``backward_hooks`` are applied to the gradient before it is rounded.
    """
    for r in (forward_rounding, backward_rounding):
        _check_rounding(r)
    forward_quant = _quant_function(forward_number, forward_rounding)
    backward_quant = _quant_function(backward_number, backward_rounding)
    hooks = tuple(backward_hooks)
    mask_fn = None
    if clamping_grad_zero:
        kind = _kind(forward_number)
        _check(kind in (None, "fixed"), "zeroing clamping gradient only support fixed point.")
        if kind == "fixed":
            _check(forward_number.clamp, "must use clamping if zeroing out clamped gradient")
            n = forward_number
            mask_fn = lambda t: _fixed_quantize_with_mask(t, n.wl, n.fl, n.symmetric,
                                                          forward_rounding)
        else:  # nothing is clamped: the gradient passes through (QPyTorch's empty mask)
            mask_fn = lambda t: (t.view_as(t), torch.zeros_like(t, dtype=torch.bool))

    def apply(x):
        return _Rounding.apply(x, forward_quant, backward_quant, hooks, mask_fn)

    return apply


class Quantizer(nn.Module):
    """A module wrapping ``quantizer(forward_number, backward_number, ...)``."""

    def __init__(self, forward_number=None, backward_number=None, forward_rounding="stochastic",
                 backward_rounding="stochastic"):
        super().__init__()
        self.forward_number, self.backward_number = forward_number, backward_number
        self.forward_rounding, self.backward_rounding = forward_rounding, backward_rounding
        self.quantize = quantizer(forward_number, backward_number, forward_rounding,
                                  backward_rounding)

    def forward(self, x):
        return self.quantize(x)

    def extra_repr(self):
        return (f"forward={self.forward_number!r} ({self.forward_rounding}), "
                f"backward={self.backward_number!r} ({self.backward_rounding})")


# ---------------------------------------------------------------------------------------------
# Optimizer (qtorch.optim)

class OptimLP(torch.optim.Optimizer):
    """Wraps an optimizer: rounds gradients before, and accumulators/weights/momenta after, each step.

    Order of one step (as QPyTorch): grad <- grad_quant(grad * grad_scaling) (grad_scaling is
    only applied when grad_quant is given, and never divided back); if acc_quant, the weights are
    swapped for full-precision accumulators, stepped, rounded with acc_quant and kept as the new
    accumulators; weights <- weight_quant(weights); momenta <- momentum_quant(momenta).
    """

    def __init__(self, optim, weight_quant=None, grad_scaling=1.0, grad_quant=None,
                 momentum_quant=None, acc_quant=None):
        _check(isinstance(optim, torch.optim.Optimizer),
               f"OptimLP wraps a torch.optim.Optimizer, got {type(optim).__name__}")
        _check(grad_scaling > 0, "gradient scaling must be positive")
        super().__init__(optim.param_groups, optim.defaults)
        # share the wrapped optimizer's groups and state (so state_dict/zero_grad see them)
        self.param_groups = optim.param_groups
        self.state = optim.state
        self.optim = optim
        self.grad_scaling = grad_scaling
        self.weight_quant, self.grad_quant = weight_quant, grad_quant
        self.momentum_quant, self.acc_quant = momentum_quant, acc_quant
        if isinstance(optim, torch.optim.SGD):
            self.momentum_keys = ["momentum_buffer"]
        elif isinstance(optim, torch.optim.Adam):  # AdamW too
            self.momentum_keys = ["exp_avg", "exp_avg_sq"]
        else:
            self.momentum_keys = None  # every floating state tensor shaped like its parameter
        if acc_quant is not None:
            self.weight_acc = {p: p.detach().clone()
                               for group in self.param_groups for p in group["params"]}

    def _params(self):
        for group in self.param_groups:
            for p in group["params"]:
                yield group, p

    def step(self, closure=None):
        if self.grad_quant is not None:
            for _, p in self._params():
                if p.grad is not None:
                    p.grad.data = self.grad_quant(p.grad.data * self.grad_scaling)
        if self.acc_quant is not None:
            for _, p in self._params():
                p.data = self.weight_acc[p].data
        loss = self.optim.step() if closure is None else self.optim.step(closure)
        if self.acc_quant is not None:
            for _, p in self._params():
                p.data = self.weight_acc[p].data = self.acc_quant(p.data).data
        if self.weight_quant is not None:
            for _, p in self._params():
                p.data = self.weight_quant(p.data).data
        if self.momentum_quant is not None:
            for group, p in self._params():
                if isinstance(self.optim, torch.optim.SGD) and group["momentum"] == 0:
                    continue
                if p.grad is None:
                    continue
                state = self.optim.state[p]
                keys = self.momentum_keys
                if keys is None:
                    keys = [k for k, v in state.items() if isinstance(v, torch.Tensor)
                            and v.is_floating_point() and v.shape == p.shape]
                for key in keys:
                    if state.get(key) is not None:
                        state[key] = self.momentum_quant(state[key])
        return loss

    def zero_grad(self, set_to_none: bool = True):
        self.optim.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict):
        self.optim.load_state_dict(state_dict)
        self.param_groups, self.state = self.optim.param_groups, self.optim.state

    def __repr__(self):
        return f"LP Optimizer: {self.optim!r}"


# ---------------------------------------------------------------------------------------------
# Module rewriting (qtorch.auto_low)

_LAYER_TYPES = {
    "conv": [nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
             nn.ConvTranspose3d, nn.Unfold, nn.Fold],
    "linear": [nn.Linear, nn.Bilinear],
    "pool": [nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.MaxUnpool1d, nn.MaxUnpool2d,
             nn.MaxUnpool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.FractionalMaxPool2d,
             nn.LPPool1d, nn.LPPool2d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
             nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveMaxPool3d,
             nn.AdaptiveAvgPool3d],
    "pad": [nn.ReflectionPad1d, nn.ReflectionPad2d, nn.ReplicationPad1d, nn.ReplicationPad2d,
            nn.ZeroPad2d, nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d],
    "activation": [nn.ELU, nn.Hardshrink, nn.Hardtanh, nn.LeakyReLU, nn.LogSigmoid, nn.PReLU,
                   nn.ReLU, nn.ReLU6, nn.RReLU, nn.SELU, nn.Sigmoid, nn.Softplus, nn.Softshrink,
                   nn.Softsign, nn.Tanh, nn.Tanhshrink, nn.Threshold, nn.Softmin, nn.Softmax,
                   nn.Softmax2d, nn.LogSoftmax],
    "normalization": [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.GroupNorm,
                      nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LayerNorm,
                      nn.LocalResponseNorm],
    "dropout": [nn.Dropout, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout],
    "loss": [nn.L1Loss, nn.MSELoss, nn.CrossEntropyLoss, nn.NLLLoss, nn.PoissonNLLLoss,
             nn.KLDivLoss, nn.BCELoss, nn.BCEWithLogitsLoss, nn.MarginRankingLoss,
             nn.HingeEmbeddingLoss, nn.MultiLabelMarginLoss, nn.SmoothL1Loss, nn.SoftMarginLoss,
             nn.MultiLabelSoftMarginLoss, nn.MultiMarginLoss, nn.TripletMarginLoss],
}


def _layer_types(layer_types: Iterable[str]) -> tuple:
    out = []
    for name in layer_types:
        _check(name in _LAYER_TYPES,
               f"unknown layer type {name!r}; expected one of {', '.join(_LAYER_TYPES)}")
        out += _LAYER_TYPES[name]
    return tuple(out)


def lower(model, layer_types=[], forward_number=None, backward_number=None,
          forward_rounding="stochastic", backward_rounding="stochastic"):
    """In place: round the output of every module of the given layer types."""
    quant = Quantizer(forward_number, backward_number, forward_rounding, backward_rounding)
    types_ = _layer_types(layer_types)

    def patch(module):
        if type(module) in types_:
            old_forward = module.forward
            module.forward = lambda *args, **kw: quant(old_forward(*args, **kw))

    model.apply(patch)


def sequential_lower(model, layer_types=[], forward_number=None, backward_number=None,
                     forward_rounding="stochastic", backward_rounding="stochastic"):
    """A copy of model where each leaf module of the given types is followed by a Quantizer."""
    quant = Quantizer(forward_number, backward_number, forward_rounding, backward_rounding)
    types_ = _layer_types(layer_types)

    def rewrite(module):
        if isinstance(module, (nn.Sequential, nn.ModuleList)):
            for i in range(len(module)):
                module[i] = rewrite(module[i])
            return module
        if isinstance(module, nn.ModuleDict):
            for key in list(module.keys()):
                module[key] = rewrite(module[key])
            return module
        if any(True for _ in module.children()):
            for name, child in list(module.named_children()):
                setattr(module, name, rewrite(child))
            return module
        if type(module) in types_:
            return nn.Sequential(module, quant)
        return module

    return rewrite(copy.deepcopy(model))


# ---------------------------------------------------------------------------------------------
# qtorch's module layout, so that `from qtorch.quant import x` needs only the package renamed

def _submodule(name: str, names: list, doc: str) -> types.ModuleType:
    mod = types.ModuleType(f"{__name__}.{name}", doc)
    for n in names:
        setattr(mod, n, globals()[n])
    mod.__all__ = list(names)
    sys.modules[mod.__name__] = mod
    return mod


number = _submodule("number", ["Number", "FixedPoint", "BlockFloatingPoint", "FloatingPoint"],
                    "qtorch.number: the number classes.")
quant = _submodule("quant", ["fixed_point_quantize", "block_quantize", "float_quantize",
                             "quantizer", "Quantizer"], "qtorch.quant: the rounding functions.")
optim = _submodule("optim", ["OptimLP"], "qtorch.optim: the low-precision optimizer wrapper.")
auto_low = _submodule("auto_low", ["lower", "sequential_lower"],
                      "qtorch.auto_low: module rewriting.")

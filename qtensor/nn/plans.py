"""Roles, recipes and plans: which formats each value of a converted model takes.

A :class:`Role` is the pair of formats of one kind of value (its values, and its operands in
contractions); a :class:`Recipe` gives every role of a model one; :class:`TensorPlan` and
:class:`ModulePlan` are what ``qt.convert`` chose for one parameter, buffer or module (read by the
conversion hooks and by the optimizer hooks of :mod:`qtensor.nn.training`). See
docs/convert.md for what each role means.
"""
from __future__ import annotations

import dataclasses
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..accum.format import as_accum
from ..tensor.attention import AttentionFormats
from ..tensor.kv_cache import cache_format
from ..tensor import block_specials
from ..tensor import flush_warnings
from ..tensor import shards
from ..kernels.backend import fit_format
from ..formats.float import FloatFormat
from ..formats.base import Format, FormatError
from ..formats.parse import format as _parse_format
from ..tensor.subclass import QTensor, as_qtensor, same_formats
from ..tensor.transforms import check_transform
from ..formats.torch_function import TorchFunctionTarget

__all__ = ["Role", "Recipe", "GemmFormats", "TensorPlan", "ModulePlan", "ROLE_NAMES", "GEMMS",
           "round_to", "check_scale"]

ROLE_NAMES = ("weight", "bias", "activation", "grad", "optimizer_state")
# The three GEMMs of a linear layer y = x W^T and their operands, in the order of Recipe.gemm's
# pairs: forward (x, W), input gradient dx = dY W (dY, W), weight gradient dW = dY^T x (x, dY)
GEMMS = {"fprop": ("x", "w"), "dgrad": ("dy", "w"), "wgrad": ("x", "dy")}
_FP32 = FloatFormat(8, 23)


# ---------------------------------------------------------------------------------------------
# Roles and recipes

@dataclass(frozen=True)
class Role:
    """The formats of one role: ``fmt`` for the values, ``mm_fmt`` inside contractions.

    ``Role()`` (both None) is full precision: the tensor is left a plain tensor.
    """

    fmt: Optional[Format] = None
    mm_fmt: Optional[Format] = None

    def __post_init__(self):
        for name in ("fmt", "mm_fmt"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Format):
                object.__setattr__(self, name, _parse_format(value))
        if self.fmt is None and self.mm_fmt is not None:
            # FP32 values with an operand format: the values must still be a QTensor
            object.__setattr__(self, "fmt", _FP32)

    @classmethod
    def of(cls, spec, what: str = "role") -> "Role":
        """A Role from None, a format, a format string, a Role or a pair (value_fmt, mm_fmt)."""
        if isinstance(spec, Role):
            return spec
        if spec is None:
            return cls()
        if isinstance(spec, (Format, str)):
            return cls(_format_or_error(spec, what))
        if isinstance(spec, (tuple, list)):
            if len(spec) != 2:
                raise ValueError(
                    f"{what}: a pair must be (value_fmt, mm_fmt), got {len(spec)} items: {spec!r}")
            value, mm = spec
            return cls(None if value is None else _format_or_error(value, what),
                       None if mm is None else _format_or_error(mm, f"{what} (mm_fmt)"))
        raise TypeError(
            f"{what}: expected None, a format, a format string or a pair (value_fmt, mm_fmt), "
            f"got {type(spec).__name__}: {spec!r}")

    @property
    def full_precision(self) -> bool:
        return self.fmt is None

    def __str__(self) -> str:
        if self.fmt is None:
            return "full precision"
        return str(self.fmt) if self.mm_fmt is None else f"{self.fmt} (mm {self.mm_fmt})"


def _format_or_error(spec, what: str) -> Format:
    try:
        return _parse_format(spec)
    except FormatError as e:
        raise FormatError(f"{what}: {e}") from None


def check_signed(role: "Role", what: str) -> None:
    """A FormatError if ``role`` has a format that cannot hold negative values: every role of a
    model (weights, biases, activations, gradients, optimizer state) holds signed values."""
    for fmt in (role.fmt, role.mm_fmt):
        span = None if fmt is None else fmt.unsigned_range()
        if span is None:
            continue
        hint = (f"{fmt} is a scale format: the scale of block formats (as in mxfp8_e4m3), not a "
                "format for values" if fmt.scale_only else
                "use a signed format (FixedFormat(wl, fl) is signed by default)")
        raise FormatError(
            f"{what}: {fmt} cannot hold a model's signed values: it holds only {span}; {hint}")


@dataclass(frozen=True)
class GemmFormats:
    """The operand format of each operand of each GEMM of a linear layer (or convolution); None:
    the operand's own ``mm_fmt`` (its role's), as without ``Recipe.gemm``. A format's rounding
    mode is the operand's rounding (``fmt.replace(rounding="stochastic")``). ``*_transform``: an
    orthogonal transform (qtensor.tensor.transforms.Hadamard) applied to both operands of that GEMM along
    its reduction dimension before they are rounded (None: none)."""

    fprop_x: Optional[Format] = None
    fprop_w: Optional[Format] = None
    dgrad_dy: Optional[Format] = None
    dgrad_w: Optional[Format] = None
    wgrad_x: Optional[Format] = None
    wgrad_dy: Optional[Format] = None
    fprop_transform: Any = None
    dgrad_transform: Any = None
    wgrad_transform: Any = None

    @classmethod
    def of(cls, spec) -> Optional["GemmFormats"]:
        """GemmFormats from None, a GemmFormats or a dict {"fprop": (x, w), "dgrad": (dy, w),
        "wgrad": (x, dy)} (any of the three; None in a pair: that operand's own mm_fmt), with
        optionally "transform": {gemm: qt.Hadamard(...)}. None when no operand gets a format of
        its own and no GEMM a transform."""
        if spec is None or isinstance(spec, GemmFormats):
            return None if spec is None or spec.is_default else spec
        if isinstance(spec, dict) and spec and all(k in LAYER_KINDS for k in spec):
            raise ValueError("GemmFormats.of: per layer kind, use Recipe(gemm={'linear': ..., "
                             "'conv': ...}) (normalised by gemm_of)")
        if not isinstance(spec, dict):
            raise TypeError(
                "Recipe.gemm must be None or a dict {'fprop': (x_fmt, w_fmt), 'dgrad': (dy_fmt, "
                f"w_fmt), 'wgrad': (x_fmt, dy_fmt)}}, got {type(spec).__name__}: {spec!r}")
        unknown = [k for k in spec if k not in GEMMS and k != "transform"]
        if unknown:
            raise ValueError(f"Recipe.gemm: unknown GEMM(s) {', '.join(map(repr, unknown))}; "
                             f"the GEMMs are {', '.join(GEMMS)} (and 'transform')")
        fields = {}
        transforms = spec.get("transform") or {}
        if not isinstance(transforms, dict) or any(k not in GEMMS for k in transforms):
            raise ValueError("Recipe.gemm['transform'] must be a dict {gemm: transform} with "
                             f"gemm among {', '.join(GEMMS)}, got {transforms!r}")
        for gemm, t in transforms.items():
            fields[f"{gemm}_transform"] = check_transform(t, f"Recipe.gemm['transform'][{gemm!r}]")
        for gemm, pair in spec.items():
            if gemm == "transform":
                continue
            names = GEMMS[gemm]
            if pair is None:
                continue
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"Recipe.gemm[{gemm!r}] must be a pair ({names[0]}_fmt, "
                                 f"{names[1]}_fmt), got {pair!r}")
            for operand, fmt in zip(names, pair):
                if fmt is not None:
                    what = f"Recipe.gemm[{gemm!r}] ({operand})"
                    fields[f"{gemm}_{operand}"] = _format_or_error(fmt, what)
        out = cls(**fields)
        for f in dataclasses.fields(out):
            if not f.name.endswith("_transform"):
                check_signed(Role(getattr(out, f.name)), f"Recipe.gemm ({f.name})")
        return None if out.is_default else out

    @property
    def is_default(self) -> bool:
        return all(getattr(self, f.name) is None for f in dataclasses.fields(self))

    def __str__(self) -> str:
        parts = []
        for gemm, operands in GEMMS.items():
            fmts = [getattr(self, gemm + "_" + o) for o in operands]
            inner = ", ".join(o + " " + ("own mm_fmt" if f is None else str(f))
                              for o, f in zip(operands, fmts))
            t = getattr(self, gemm + "_transform")
            parts.append(f"{gemm} ({inner}" + ("" if t is None else f", transform {t}") + ")")
        return "; ".join(parts)


LAYER_KINDS = ("linear", "conv")


def gemm_of(spec):
    """Recipe.gemm normalised: None, a GemmFormats (every Linear and Conv), or a dict
    {"linear": GemmFormats or None, "conv": GemmFormats or None} (per layer kind)."""
    if isinstance(spec, dict) and spec and any(k in LAYER_KINDS for k in spec):
        unknown = [k for k in spec if k not in LAYER_KINDS]
        if unknown:
            raise ValueError(
                f"Recipe.gemm: {', '.join(map(repr, unknown))} beside layer kinds: give either "
                f"the GEMMs ({', '.join(GEMMS)}) or, per layer kind, "
                f"{{{', '.join(repr(k) + ': {...}' for k in LAYER_KINDS)}}}")
        out = {k: GemmFormats.of(spec.get(k)) for k in LAYER_KINDS}
        return None if all(v is None for v in out.values()) else out
    return GemmFormats.of(spec)


def gemm_for(gemm, kind: str):
    """The GemmFormats a layer of ``kind`` ("linear" or "conv") gets from Recipe.gemm."""
    return gemm.get(kind) if isinstance(gemm, dict) else gemm


def _last_layers_of(spec):
    """Recipe.last_layers normalised: None or (n, fmt), n an int >= 1 or a float in (0, 1)."""
    if spec is None:
        return None
    if not isinstance(spec, (tuple, list)) or len(spec) != 2:
        raise ValueError(f"Recipe.last_layers must be None or a pair (n, fmt), got {spec!r}")
    n, fmt = spec
    ok = (isinstance(n, int) and not isinstance(n, bool) and n >= 1) or (
        isinstance(n, float) and 0 < n < 1)
    if not ok:
        raise ValueError("Recipe.last_layers: n must be an int >= 1 (layers) or a float in "
                         f"(0, 1) (a fraction of the layers), got {n!r}")
    fmt = _format_or_error(fmt, "Recipe.last_layers")
    check_signed(Role(fmt), "Recipe.last_layers")
    return (n, fmt)


def last_layers_count(spec, total: int) -> int:
    """How many of ``total`` layers Recipe.last_layers ``spec`` (normalised) keeps."""
    n = spec[0]
    return min(total, n if isinstance(n, int) else math.ceil(n * total))


def _normalise_rule(pattern, spec):
    """A rule's spec as a Role (value/activation role) or a dict {role name: Role}."""
    if not isinstance(pattern, str) or not pattern:
        raise TypeError(f"rule patterns must be non-empty strings, got {pattern!r}")
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as e:
            raise ValueError(f"rule {pattern!r}: bad regular expression: {e}") from None
    if isinstance(spec, Recipe):
        return {name: getattr(spec, name) for name in ROLE_NAMES}
    if isinstance(spec, dict):
        unknown = [k for k in spec if k not in ROLE_NAMES and k != "gemm"]
        if unknown:
            raise ValueError(
                f"rule {pattern!r}: unknown role(s) {', '.join(map(repr, unknown))}; roles are "
                f"{', '.join(ROLE_NAMES)} (and 'gemm': the matched Linear/Conv's per-GEMM "
                "formats)")
        return {k: gemm_of(v) if k == "gemm" else Role.of(v, f"rule {pattern!r}, role {k}")
                for k, v in spec.items()}
    return Role.of(spec, f"rule {pattern!r}")


@dataclass(frozen=True, eq=True)
class Recipe(TorchFunctionTarget):  # model.to(recipe): qtensor.formats.torch_function
    """Formats for every role of a model (see the module docstring for the meaning of each).

    Each role takes None (full precision), a format, a format string, or a pair
    ``(value_fmt, mm_fmt)``; they are normalised into :class:`Role` values.
    ``rules``: ``{pattern: format | pair | None | dict of roles}``, matched against qualified
    parameter, buffer and module names (glob, or ``re:`` regex); a dict may also give
    ``"gemm"``: the per-GEMM formats of the Linear/Conv modules it matches (as ``gemm``; None:
    none), which a rule otherwise turns off for them.
    ``gemm``: per-GEMM operand formats of converted Linear/Conv layers, ``{"fprop": (x, W),
    "dgrad": (dY, W), "wgrad": (x, dY)}`` (or per layer kind ``{"linear": ..., "conv": ...}``),
    normalised into :class:`GemmFormats` (docs/convert.md, "Per-GEMM operand formats").
    ``last_layers``: ``(n, fmt)``, the last n converted Linear/Conv layers (model order; a float
    n in (0, 1) is that fraction of them, rounded up) run every operand of their three GEMMs in
    ``fmt`` (e.g. "bf16"), whatever ``gemm`` and the roles say: the "last layers in higher
    precision" of the NVFP4 recipe.
    """

    weight: Any = None
    bias: Any = None
    activation: Any = None
    grad: Any = None
    optimizer_state: Any = None
    rules: Any = None
    master_weights: bool = False
    loss_scale: Any = None
    accumulate: Any = None
    gemm: Any = None
    last_layers: Any = None
    attention: Any = None
    kv_cache: Any = None
    name: Optional[str] = field(default=None, compare=False)
    source: Optional[str] = field(default=None, compare=False)

    def __post_init__(self):
        for role in ROLE_NAMES:
            object.__setattr__(self, role, Role.of(getattr(self, role), f"Recipe.{role}"))
        rules = self.rules or {}
        if not isinstance(rules, dict):
            raise TypeError(f"Recipe.rules must be a dict {{pattern: spec}}, got {type(rules).__name__}")
        object.__setattr__(self, "rules", {p: _normalise_rule(p, s) for p, s in rules.items()})
        for role in ROLE_NAMES:
            check_signed(getattr(self, role), f"Recipe.{role}")
        for pattern, spec in self.rules.items():
            for key, role in ([("", spec)] if isinstance(spec, Role) else spec.items()):
                if key == "gemm":  # (GemmFormats.of checked it)
                    continue
                check_signed(role, f"rule {pattern!r}" + (f", role {key}" if key else ""))
        if not isinstance(self.master_weights, bool):
            raise TypeError(f"Recipe.master_weights must be a bool, got {self.master_weights!r}")
        if self.master_weights and not self.optimizer_state.full_precision:
            raise ValueError(
                "master_weights=True runs the optimizer on FP32 copies, so its state is FP32: "
                f"optimizer_state must be None, got {self.optimizer_state}")
        object.__setattr__(self, "accumulate", as_accum(self.accumulate, "Recipe.accumulate"))
        object.__setattr__(self, "gemm", gemm_of(self.gemm))
        object.__setattr__(self, "last_layers", _last_layers_of(self.last_layers))
        object.__setattr__(self, "attention", AttentionFormats.of(self.attention))
        object.__setattr__(self, "kv_cache", cache_format(self.kv_cache, "Recipe.kv_cache"))
        ls = self.loss_scale
        if ls is not None and ls != "dynamic":
            check_scale(ls, "Recipe.loss_scale (None, 'dynamic' or a power of two)")

    __hash__ = None  # rules is a dict

    @classmethod
    def uniform(cls, spec, **kwargs) -> "Recipe":
        """Every role (weights, biases, activations, gradients, optimizer state) in ``spec``."""
        role = Role.of(spec, "format")
        return cls(weight=role, bias=role, activation=role, grad=role, optimizer_state=role,
                   **kwargs)

    def replace(self, **changes) -> "Recipe":
        """A copy with some fields changed (``recipes.mxfp6.replace(rules={...})``)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """A readable summary of the recipe: one line per role and rule."""
        head = self.name or "Recipe"
        lines = [head + (f"  ({self.source})" if self.source else "")]
        for role in ROLE_NAMES:
            lines.append(f"  {role:<16} {getattr(self, role)}")
        lines.append(f"  {'buffers':<16} {Role(self.weight.fmt)}")
        lines.append(f"  {'master_weights':<16} {self.master_weights}")
        lines.append(f"  {'loss_scale':<16} {self.loss_scale}")
        lines.append(f"  {'accumulate':<16} {self.accumulate or 'in the payload precision'}")
        if isinstance(self.gemm, dict):
            for kind, g in self.gemm.items():
                lines.append(f"  {'gemm (' + kind + ')':<16} {g or 'the roles: own mm_fmt'}")
        elif self.gemm is not None:
            lines.append(f"  {'gemm':<16} {self.gemm}")
        if self.last_layers is not None:
            n, fmt = self.last_layers
            what = f"the last {n}" if isinstance(n, int) else f"the last {n:.0%} (rounded up) of"
            lines.append(f"  {'last_layers':<16} {what} Linear/Conv layers: every GEMM operand in "
                         f"{fmt}")
        if self.attention is not None:
            lines.append(f"  {'attention':<16} {self.attention}")
        if self.kv_cache is not None:
            lines.append(f"  {'kv_cache':<16} {self.kv_cache}")
        for pattern, spec in self.rules.items():
            if isinstance(spec, Role):
                lines.append(f"  rule {pattern!r}: {spec}")
            else:
                inner = ", ".join(f"{k}={v}" for k, v in spec.items())
                lines.append(f"  rule {pattern!r}: {{{inner}}}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def check_scale(value, what: str) -> float:
    """``value`` as a float if it is a positive finite power of two, else a ValueError.

    Loss scales are powers of two so that scaling and unscaling only change exponents: exact in
    every float and block format (a scale of 1000 would round every gradient twice)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be a positive finite number, got {value!r}")
    mantissa, exponent = math.frexp(float(value))
    if mantissa != 0.5:
        nearest = 2.0 ** round(math.log2(value))
        raise ValueError(
            f"{what} must be a power of two so that scaling and unscaling are exact in low "
            f"precision, got {value!r}; use {nearest:g} (2**{round(math.log2(value))})")
    return float(value)


# ---------------------------------------------------------------------------------------------
# Plans: what each tensor and module gets

@dataclass(frozen=True)
class TensorPlan:
    """The formats chosen for one parameter or buffer, and the rule that chose them."""

    name: str
    kind: str                    # "weight", "bias" or "buffer"
    value: Role
    grad: Role
    optimizer_state: Role
    master: bool
    rule: Optional[str] = None   # the rule pattern that decided, None for the kind default


@dataclass(frozen=True)
class ModulePlan:
    name: str
    activation: Role
    grad: Role
    rule: Optional[str] = None
    plain: bool = False  # a rule set its activation to None: plain inputs and outputs


# ---------------------------------------------------------------------------------------------
# Rounding into a role

def _is_q(x) -> bool:
    return isinstance(x, QTensor)


def _dtensor_class():
    mod = sys.modules.get("torch.distributed.tensor")  # not imported: there is no DTensor
    return None if mod is None else mod.DTensor


def _plain(x: torch.Tensor) -> torch.Tensor:
    if _is_q(x):
        return x.dequantize()
    dtensor = None if torch.compiler.is_dynamo_compiling() else _dtensor_class()
    if dtensor is not None and type(x) is dtensor and _is_q(x._local_tensor):
        # a DTensor of QTensors (tensor parallelism): the same placements, plain local values
        return dtensor.from_local(x.to_local().dequantize(), x.device_mesh, x.placements,
                                  run_check=False, shape=x.shape, stride=x.stride())
    return x


def round_to(x: torch.Tensor, role: Role, *, name: str = "tensor",
             kind: Optional[str] = None) -> torch.Tensor:
    """x as a QTensor in ``role`` (returned as is when it already has exactly those formats).
    ``kind``: the role's name ("weight", "activation", "grad", ...) when this is one of a
    converted model's role roundings; those are watched for flushing and saturation
    (:mod:`qtensor.tensor.flush_warnings`).
    A DTensor (tensor parallelism) is rounded shard by shard: the same placements, its local
    tensor in ``role`` (a Partial one's partial values each, as a TP device rounds its outputs
    before the reduction; docs/distributed.md). A two-level role whose tensor scale alone the
    shards cut: each shard as a part of the whole tensor (:func:`round_shard_to`)."""
    dtensor = None if torch.compiler.is_dynamo_compiling() else _dtensor_class()
    if dtensor is not None and type(x) is dtensor:
        local = x.to_local()
        shard = None if role.full_precision else shards.sharding_of(role.fmt, x)
        if (shard is not None and not torch.compiler.is_compiling()
                and not (_is_q(local) and same_formats(local.fmt, local.mm_fmt, role.fmt,
                                                       role.mm_fmt))):
            local = round_shard_to(local, role, shard, name=name, kind=kind)
        else:
            local = round_to(local, role, name=name, kind=kind)
            if shard is not None:
                shards.mark(local, x)
        return dtensor.from_local(local, x.device_mesh, x.placements, run_check=False,
                                  shape=x.shape, stride=x.stride())
    if role.full_precision:
        return _plain(x)
    if _is_q(x) and same_formats(x.fmt, x.mm_fmt, role.fmt, role.mm_fmt):
        if kind is not None:  # an op gave it in its formats: its operand format still clips
            flush_warnings.check_operand(kind, name, role, x._data)
        return x
    try:
        y = as_qtensor(x, role.fmt, mm_fmt=role.mm_fmt)  # keeps x's accumulator
    except NotImplementedError:  # not about x (stochastic rounding while tracing): as it is
        raise
    except (FormatError, ValueError, RuntimeError, IndexError) as e:
        raise type(e)(f"{name} (shape {tuple(x.shape)}) to {role}: {e}") from None
    return _checked(x, y, role, name, kind)


def _checked(x, y, role, name, kind):
    src = x._data if _is_q(x) else x.detach()  # the values before this rounding
    if role.fmt.is_block:  # a mask's -inf makes its whole block NaN: say so
        block_specials.check(src, y._data, role.fmt, what=name)
    if kind is not None:  # most of it flushed to zero or saturated: say so
        flush_warnings.check(kind, name, role, src, y._data)
    return y


def round_shard_to(x: torch.Tensor, role: Role, shard, *, name: str = "tensor",
                   kind: Optional[str] = None) -> QTensor:
    """``x``, this rank's part of a whole tensor of ``shard`` (a qtensor.tensor.shards.ShardOf),
    as a QTensor in the two-level ``role``, rounded as the whole tensor is (Transformer
    Engine's one scale of the whole amax: the parts' amaxes all-reduced by max, a collective),
    and marked as that shard."""
    fmt = fit_format(role.fmt, x.dim())
    values, scale = shards.round_shard(_plain(x).detach(), fmt, shard)
    y = QTensor._wrap(values, fmt, role.mm_fmt, accum=x.accum if _is_q(x) else None)
    y._tscale, y._shard = scale, shard
    return _checked(x, y, role, name, kind)

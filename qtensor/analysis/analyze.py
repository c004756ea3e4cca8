"""``qt.analyze(model, inputs, spec)``: where a recipe loses precision in a model.

One batch through an FP32 copy of the model and a converted copy (forward and backward), then
one converted copy per layer in which only that layer takes the recipe's formats:

- every role rounding of the converted copy (weights at conversion, activations and gradients
  as they run: those :mod:`qtensor.tensor.flush_warnings` watches), by role and tensor: relative
  error, SNR (dB), fractions flushed to zero, saturated, clipped by their block's scale
  (:func:`qtensor.tensor.flush_warnings.clipping`; with the share of the L1 norm that clipping
  removed) and turned NaN; for a role with an
  operand format (``mm_fmt``) the operand rounding too, as role ``"<role> operand"`` (blocked
  along the last axis, the reduction axis of a linear layer's operands);
- every contraction module (``nn.Linear``, ``nn.Conv1d/2d/3d``; bias excluded) on the operands
  it received in the converted run: its emulated product against (a) the FP32 product of the
  unrounded operands (the activation as it arrived, the original FP32 weight): the total local
  error, and (b) the exact (float64) product of the rounded operands: the accumulator's share;
  (c) the operands' share: the exact product of the rounded against the unrounded operands;
- per layer (each module that has parameters of its own): the change in loss and the KL
  divergence of the outputs (softmax over the last axis, FP32 against converted) when only that
  layer takes its formats (its parameters, its output, and its inputs rounded to its activation
  role), and the cosine similarity of the whole gradient against FP32's; with ``roles``, the
  same for each role of each layer alone (weight, activation, grad);
- with ``optimizer``: the optimizer state after one step against the same step in FP32;
- per layer: its sizes and the bits per value of each role (``qt.suggest_recipe`` counts them).

Docs and examples: docs/analysis.md.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor import flush_warnings
from ..nn import gemm_forward
from ..kernels import reference
from ..nn.convert import ModulePlan, Recipe, _InputHook, convert, conversion_of, unconvert
from ..kernels.backend import round_payload as _round, with_axis
from ..formats.core import FloatFormat, Format, is_stochastic
from ..nn.plans import GEMMS, GemmFormats, Role, _plain, round_to
from ..nn.spec import as_recipe
from ..tensor.subclass import QTensor

__all__ = ["analyze", "AnalysisReport", "CONTRACTIONS", "convert_one_layer", "gemm_part"]

CONTRACTIONS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_FP32 = FloatFormat(8, 23)


# ---------------------------------------------------------------------------------------------
# Statistics of one rounding

class _TensorStats:
    """Sums over the roundings of one (role, tensor): errors and counts."""

    def __init__(self, role: str, name: str, fmt: str):
        self.role, self.name, self.fmt = role, name, fmt
        self.numel = self.nonzero = self.flushed = self.saturated = self.finite = self.nan = 0
        self.clipped = 0
        self.signal = self.noise = self.clip_lost = self.clip_magnitude = 0.0
        self.calls = 0

    def add(self, before: torch.Tensor, after: torch.Tensor, fmt, source=None,
            clip_fmt=None, rounded=True) -> None:
        """``source``: the tensor rounded to ``after`` (default ``before``; an operand rounding
        rounds the role's rounded value), ``clip_fmt``: fmt as it blocked it; ``rounded=False``:
        ``after`` is no rounding of ``before`` (optimizer state: the clipping is that of
        rounding ``before``)."""
        b, a = before.detach().double(), after.detach().double()
        finite = torch.isfinite(b)
        both = finite & torch.isfinite(a)
        self.signal += float(torch.where(both, b, 0).pow(2).sum())
        self.noise += float(torch.where(both, a - b, 0).pow(2).sum())
        c = flush_warnings.fractions(before, after, fmt)
        self.nonzero += c["nonzero"]
        self.flushed += c["flushed"]
        self.saturated += c["saturated"]
        self.finite += c["finite"]
        self.nan += int((finite & torch.isnan(a)).sum())
        clip = flush_warnings.clipping(before if source is None else source,
                                       fmt if clip_fmt is None else clip_fmt,
                                       after if rounded else None)
        if clip is not None:  # block formats: values beyond their block's largest value
            self.clipped += clip["clipped"]
            self.clip_lost += clip["lost"]
            self.clip_magnitude += clip["magnitude"]
        self.numel += b.numel()
        self.calls += 1

    def row(self) -> dict:
        rel = math.sqrt(self.noise / self.signal) if self.signal > 0 else (
            0.0 if self.noise == 0 else math.inf)
        snr = 10 * math.log10(self.signal / self.noise) if self.noise > 0 else math.inf
        return {"role": self.role, "tensor": self.name, "format": self.fmt, "numel": self.numel,
                "calls": self.calls, "rel_error": rel, "snr_db": snr,
                "flushed": self.flushed / self.nonzero if self.nonzero else 0.0,
                "saturated": self.saturated / self.finite if self.finite else 0.0,
                "clipped": self.clipped / self.finite if self.finite else 0.0,
                "clip_loss": (self.clip_lost / self.clip_magnitude if self.clip_magnitude > 0
                              else 0.0),
                "nan": self.nan / self.numel if self.numel else 0.0}


class _Recorder:
    def __init__(self):
        self.stats: Dict[tuple, _TensorStats] = {}

    def _add(self, role, name, fmt, before, after, source=None, clip_fmt=None, rounded=True):
        key = (role, name)
        if key not in self.stats:
            self.stats[key] = _TensorStats(role, name, str(fmt))
        self.stats[key].add(before, after, fmt, source, clip_fmt, rounded)

    def operand(self, role, name, formats, value):
        """A value that reached its role already in the role's formats (an op rounded it):
        only its operand rounding is measured here."""
        with torch.no_grad():
            mm1 = with_axis(formats.mm_fmt, -1)
            self._add(f"{role} operand", name, formats.mm_fmt, value,
                      _round(value, mm1, keep_layout=False), value, mm1)

    def __call__(self, role, name, formats, before, after):
        with torch.no_grad():
            self._add(role, name, formats.fmt, before, after)
            mm = formats.mm_fmt
            if mm is not None and mm != formats.fmt and after.dim() > 0:
                mm1 = with_axis(mm, -1)
                operand = _round(after, mm1, keep_layout=False)
                self._add(f"{role} operand", name, mm, before, operand, after, mm1)


# ---------------------------------------------------------------------------------------------
# Running a model

def _output_tensor(out) -> torch.Tensor:
    """The tensor to compare and differentiate: the output, its first item, or ``.logits``."""
    if isinstance(out, torch.Tensor):
        return _plain(out)
    if hasattr(out, "logits"):
        return _plain(out.logits)
    if isinstance(out, dict):
        return _output_tensor(next(iter(out.values())))
    if isinstance(out, (tuple, list)):
        return _output_tensor(out[0])
    raise TypeError(f"qt.analyze: cannot find a tensor in the model's output ({type(out)})")


def _default_loss(out: torch.Tensor) -> torch.Tensor:
    return 0.5 * out.float().pow(2).mean()


class _SameRandomness:
    """Every run of one analysis starts from the same random state: torch's generators as the
    call found them (restored after the run, so that the caller's stream is untouched), and
    stochastic rounding drawing its seeds from a generator of its own, seeded alike, so that
    dropout draws the same masks in every run whatever the recipe rounds stochastically."""

    def __init__(self):
        self.cuda = torch.cuda.is_initialized()
        self.seed = 0x5EED  # (any: the same in every run)
        self.cpu = torch.get_rng_state()
        self.gpu = torch.cuda.get_rng_state_all() if self.cuda else None

    @contextlib.contextmanager
    def __call__(self):
        devices = list(range(torch.cuda.device_count())) if self.cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda:
                torch.cuda.set_rng_state_all(self.gpu)
            before = reference.SEED_GENERATOR[0]
            reference.SEED_GENERATOR[0] = torch.Generator().manual_seed(self.seed)
            try:
                yield
            finally:
                reference.SEED_GENERATOR[0] = before


def _run(model: nn.Module, inputs, loss_fn: Callable, same=None) -> dict:
    args = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    model.zero_grad(set_to_none=True)
    with (same() if same is not None else contextlib.nullcontext()):
        out = _output_tensor(model(*args))
        loss = loss_fn(out)
        loss = _plain(loss)
        if loss.requires_grad:  # (a model without parameters, inputs without gradient: none)
            loss.backward()
    grads = {n: (None if p.grad is None else _plain(p.grad).detach().double().flatten())
             for n, p in model.named_parameters()}
    return {"out": out.detach().double(), "loss": float(loss.detach()), "grads": grads}


def _kl(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Mean over rows of KL(softmax(ref) || softmax(out)), softmax over the last axis."""
    if ref.dim() == 0:
        return 0.0
    lp, lq = F.log_softmax(ref, -1), F.log_softmax(out, -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def _cosine(ref: dict, got: dict, names=None) -> float:
    names = [n for n in (names or ref) if ref.get(n) is not None and got.get(n) is not None]
    if not names:
        return float("nan")
    a = torch.cat([ref[n] for n in names])
    b = torch.cat([got[n] for n in names])
    den = float(a.norm() * b.norm())
    return float(a @ b) / den if den > 0 else (1.0 if float(a.norm()) == float(b.norm()) else 0.0)


def _compare(ref: dict, got: dict) -> dict:
    return {"loss": got["loss"], "dloss": got["loss"] - ref["loss"],
            "kl": _kl(ref["out"], got["out"]), "grad_cos": _cosine(ref["grads"], got["grads"])}


# ---------------------------------------------------------------------------------------------
# Contractions

def _product(mod: nn.Module, gemm: str, a: torch.Tensor, b: torch.Tensor, x_shape=None,
             w_shape=None) -> torch.Tensor:
    """The GEMM ``gemm`` of a Linear/Conv on its operands in :data:`GEMMS` order (fprop (x, W),
    dgrad (dY, W), wgrad (x, dY)), as autograd runs it (a Linear's wgrad on 2D operands)."""
    if isinstance(mod, nn.Linear):
        if gemm == "fprop":
            return F.linear(a, b)
        if gemm == "dgrad":
            return a @ b
        return b.T @ a  # dW = dY^T x
    if gemm == "fprop":
        return mod._conv_forward(a, b, None)
    nd = len(mod.kernel_size)
    grad = torch.nn.grad
    kw = dict(stride=mod.stride, padding=mod.padding, dilation=mod.dilation, groups=mod.groups)
    if gemm == "dgrad":
        return getattr(grad, f"conv{nd}d_input")(x_shape, b, a, **kw)
    return getattr(grad, f"conv{nd}d_weight")(a, w_shape, b, **kw)


def _operand(x: torch.Tensor, mm, axis: int, transform=None) -> torch.Tensor:
    """x rounded to the operand format as the contraction rounds it (dispatch's blocking), after
    the GEMM's transform along the same axis."""
    if transform is not None:
        x = transform.apply(x, axis)
    if mm is None:
        return x
    return _round(x, with_axis(mm, axis), keep_layout=False)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    den = float(ref.norm())
    num = float((a - ref).norm())
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def _nearest(fmt):
    """fmt rounding to nearest where it rounds stochastically (re-rounding values already in
    it: the identity, without drawing random bits)."""
    r = getattr(fmt, "rounding", None)
    return fmt.replace(rounding="nearest") if r is not None and is_stochastic(r) else fmt


def _gemm_row(mod, gemm, a, b, ref_a, ref_b, fa, fb, transform, acc, shapes) -> dict:
    """The local errors of one GEMM (see :func:`contraction_errors`): ``a``, ``b`` its operands
    as it received them, ``ref_a``, ``ref_b`` the unrounded ones (FP32 weight), ``fa``, ``fb``
    their formats, ``transform`` the GEMM's."""
    axes = gemm_forward.reduction_axes(mod)[gemm]
    ra = _operand(a, fa, axes[0], transform)
    rb = _operand(b, fb, axes[1], transform)
    # the emulated GEMM with FP32 outputs (no output rounding), on the operands rounded as
    # above: the same formats and accumulator as in the model (dispatch rounds them again,
    # which leaves them as they are)
    ae = QTensor._wrap(ra.float(), _FP32, _nearest(fa), accum=acc) if (fa or acc) else ra.float()
    be = QTensor._wrap(rb.float(), _FP32, _nearest(fb), accum=acc) if (fb or acc) else rb.float()
    emulated = _plain(_product(mod, gemm, ae, be, *shapes)).double()
    ref32 = _product(mod, gemm, ref_a.float(), ref_b.float(), *shapes)
    exact_rounded = _product(mod, gemm, ra.double(), rb.double(), *shapes)
    exact = _product(mod, gemm, ref_a.double(), ref_b.double(), *shapes)
    t = "" if transform is None else f" ({transform})"
    return {"gemm": gemm, "vs_fp32": _rel(emulated, ref32),
            "vs_exact_rounded": _rel(emulated, exact_rounded), "operands": _rel(exact_rounded, exact),
            "operand_formats": f"{fa or '-'} x {fb or '-'}{t}",
            "accumulator": str(getattr(acc, "name", None) or acc or "FP32")}


def contraction_errors(mod: nn.Module, x: torch.Tensor, weight: torch.Tensor,
                       fp32_weight: torch.Tensor, dy: Optional[torch.Tensor] = None,
                       gemms=("fprop",)) -> List[dict]:
    """The local errors of the GEMMs of one contraction module, one row each (``gemms``: some of
    fprop, dgrad and wgrad; the backward ones need ``dy``): ``x`` the input it received (a
    QTensor with its operand format, or plain), ``weight`` its converted weight, ``fp32_weight``
    the weight before conversion, ``dy`` the gradient of its output as it arrived (bias
    excluded). The operand formats and transforms are those each GEMM uses
    (:func:`qtensor.nn.gemm_forward.gemm_formats`: ``Recipe.gemm`` where it applies)."""
    with torch.no_grad():
        xv = _plain(x).detach().float()
        wv = _plain(weight).detach().float()
        w32 = fp32_weight.detach().float()
        acc = getattr(weight, "accum", None) if isinstance(weight, QTensor) else None
        if acc is None and isinstance(x, QTensor):
            acc = x.accum
        formats = gemm_forward.gemm_formats(
            mod, getattr(x, "mm_fmt", None) if isinstance(x, QTensor) else None,
            getattr(dy, "mm_fmt", None) if isinstance(dy, QTensor) else None,
            x_plain=not isinstance(x, QTensor))
        rows = []
        for gemm in gemms:
            fa, fb, t = formats[gemm]
            if gemm == "fprop":
                ops, shapes = (xv, wv, xv, w32), ()
            else:
                if dy is None:
                    continue
                dv = _plain(dy).detach().float()
                shapes = (tuple(xv.shape), tuple(wv.shape))
                if gemm == "dgrad":
                    ops = (dv, wv, dv, w32)
                elif isinstance(mod, nn.Linear):  # tokens flattened, as autograd's mm has them
                    x2, d2 = xv.reshape(-1, xv.shape[-1]), dv.reshape(-1, dv.shape[-1])
                    ops = (x2, d2, x2, d2)
                else:
                    ops = (xv, dv, xv, dv)
            rows.append(_gemm_row(mod, gemm, *ops, fa, fb, t, acc, shapes))
    return rows


# ---------------------------------------------------------------------------------------------
# The analysis

def _layer_names(model: nn.Module) -> List[str]:
    return [n for n, m in model.named_modules()
            if n and any(True for _ in m.parameters(recurse=False))]


ROLES = ("weight", "activation", "grad")  # the roles of one layer that analyze(roles=True) tries


def _aliases(model: nn.Module) -> Dict[int, List[str]]:
    """Every name of each parameter (tied ones have several)."""
    out: Dict[int, List[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(n)
    return out


def _counted_name(model: nn.Module, names: List[str]) -> str:
    """The name under which a (tied) parameter is counted: the weight of a contraction that
    uses it (a language model's head tied to its token embedding: its bits are the head's
    GEMM's), else its first name."""
    for n in names:
        owner, _, attr = n.rpartition(".")
        if attr == "weight" and isinstance(model.get_submodule(owner), CONTRACTIONS):
            return n
    return names[0]


def _layer_plans(conv, layer: str, model: nn.Module, aliases=None) -> dict:
    """What the full conversion gave ``layer``: its output's roles, its own parameters' (a tied
    parameter under the one name it is counted by, :func:`_counted_name`) and the per-GEMM
    formats of its GEMMs (``Recipe.gemm``; None: its roles' operand formats)."""
    mplan = conv.module_plans[layer]
    aliases = _aliases(model) if aliases is None else aliases
    params = {}
    for pname, p in model.get_submodule(layer).named_parameters(recurse=False):
        qual = f"{layer}.{pname}"
        names = aliases.get(id(p), [qual])
        if _counted_name(model, names) != qual:
            continue
        tplan = next((conv.tensor_plans[n] for n in names if n in conv.tensor_plans), None)
        if tplan is not None:
            params[qual] = tplan
    return {"activation": mplan.activation, "grad": mplan.grad, "params": params,
            "gemm": conv.gemms.get(layer)}


# the per-GEMM fields (GemmFormats) of each role of a layer: its weight W, its input x (its
# activation), the gradient dY of its output; and the transforms of the GEMMs they enter
ROLE_GEMM_FIELDS = {"weight": ("fprop_w", "dgrad_w", "fprop_transform", "dgrad_transform"),
                    "activation": ("fprop_x", "wgrad_x", "fprop_transform", "wgrad_transform"),
                    "grad": ("dgrad_dy", "wgrad_dy", "dgrad_transform", "wgrad_transform")}


def gemm_part(g, roles) -> Optional[GemmFormats]:
    """The fields of GemmFormats ``g`` that belong to ``roles`` (:data:`ROLE_GEMM_FIELDS`), the
    others None (their own operand formats); None if none is left."""
    if g is None:
        return None
    keep = {f for r in roles for f in ROLE_GEMM_FIELDS[r]}
    return GemmFormats.of(GemmFormats(**{f.name: getattr(g, f.name)
                                         for f in dataclasses.fields(g) if f.name in keep}))


def _unit_rules(plans: dict, role: str = "all") -> Dict[str, Any]:
    """Rules that give one layer (``plans``: :func:`_layer_plans`) the formats of ``role`` only:
    "all" (its parameters, its output's activation and grad roles), "weight" (its parameters'
    values and optimizer state; FP32 gradients, plain output), "activation" (its output's
    activation role; FP32 gradients, FP32 parameters) or "grad" (the gradients of its output
    and of its parameters; FP32 values, exact)."""
    fp32 = Role(_FP32)
    rules: Dict[str, Any] = {}
    for qual, t in plans["params"].items():
        if role == "all":
            rules[qual] = {t.kind: t.value, "grad": t.grad, "optimizer_state": t.optimizer_state}
        elif role == "weight":
            rules[qual] = {t.kind: t.value, "grad": None, "optimizer_state": t.optimizer_state}
        elif role == "grad" and not t.value.full_precision:
            # an FP32 QTensor (exact): a plain parameter's gradient would not be rounded
            rules[qual] = {t.kind: fp32, "grad": t.grad}
        else:
            rules[qual] = None
    act, grad = plans["activation"], plans["grad"]
    if role == "all":
        rules_m = {"activation": act, "grad": grad}
    elif role == "weight":
        rules_m = {"activation": None, "grad": None}
    elif role == "activation":
        rules_m = {"activation": act, "grad": None}
    else:  # grad: exact FP32 values, so that the output's gradient is rounded
        rules_m = {"activation": fp32 if not grad.full_precision else None, "grad": grad}
    if plans.get("gemm") is not None:  # its GEMMs' formats (those of the role)
        rules_m["gemm"] = gemm_part(plans["gemm"], ROLES if role == "all" else (role,))
    return {"module": rules_m, "params": rules}


def _one_layer_recipe(full: Recipe, conv, layer: str, model: nn.Module,
                      role: str = "all") -> Recipe:
    """A recipe in which only ``layer`` (only its ``role``: :func:`_unit_rules`) takes what the
    full conversion gave it; every other module plain (a rule of None: FP32 parameters, plain
    inputs and outputs, so that the layer's output format does not spread into the modules
    after it)."""
    rules: Dict[str, Any] = {n: None for n, _m in model.named_modules() if n and n != layer}
    unit = _unit_rules(_layer_plans(conv, layer, model), role)
    rules.update(unit["params"])
    rules[layer] = unit["module"]
    return Recipe(rules=rules, accumulate=full.accumulate,
                  name=f"only {layer}" + ("" if role == "all" else f" ({role})"))


def _input_plan(conv, layer: str, role: str) -> Optional[ModulePlan]:
    """The rounding of ``layer``'s inputs in a one-layer run (None: left as they arrive)."""
    mplan = conv.module_plans[layer]
    act, grad = mplan.activation, mplan.grad
    if role == "weight":  # values as they arrive; the gradient that the layer's formats give
        # its input (an op on FP8 weights gives FP8) goes on upstream as a plain FP32 tensor
        return ModulePlan(layer, Role(), Role(_FP32))
    if role == "activation":
        grad = Role()
    elif role == "grad":
        if grad.full_precision:
            return None
        act = Role(_FP32)
    return ModulePlan(layer, act, grad)


def convert_one_layer(model: nn.Module, spec, layer: str, *, role: str = "all",
                      _plans=None) -> nn.Module:
    """Convert ``model`` in place so that only ``layer`` takes ``spec``'s formats: its
    parameters, its outputs and (a forward pre-hook) its inputs, rounded to its activation and
    grad roles as a converted model's preceding module would round them. ``role``: "all", or
    only one role of the layer: "weight" (its parameters), "activation" (its inputs and output)
    or "grad" (the gradients of its inputs, output and parameters). (``_plans``: what
    ``qt.convert(copy, spec)`` planned, when the caller has it.)"""
    if role != "all" and role not in ROLES:
        raise ValueError(f"convert_one_layer: role must be 'all' or one of {ROLES}, got {role!r}")
    recipe = as_recipe(spec)
    conv = _plans if _plans is not None else conversion_of(convert(copy.deepcopy(model), recipe))
    one = _one_layer_recipe(recipe, conv, layer, model, role)
    with warnings.catch_warnings():  # (a tied weight's names meet two of these rules: intended)
        warnings.filterwarnings("ignore", message=".*is tied to .*rules disagree")
        convert(model, one)
    plan = _input_plan(conv, layer, role)
    if plan is not None:
        mod = model.get_submodule(layer)
        handle = mod.register_forward_pre_hook(_InputHook(plan), with_kwargs=True)
        conversion_of(model).handles.append(handle)  # qt.unconvert removes it
    return model


def _progress(items, desc, enabled):
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, leave=False)


def analyze(model: nn.Module, inputs, spec=None, loss_fn: Optional[Callable] = None, *,
            sensitivity: bool = True, roles: bool = False, layers: Optional[List[str]] = None,
            progress: bool = False, optimizer: Optional[Callable] = None) -> "AnalysisReport":
    """Analyse where ``spec`` (anything ``qt.convert`` takes) loses precision in ``model``.

    ``model``: a plain model (left untouched: copies are converted), or a converted one (then
    its recipe is the default ``spec``, and an unconverted copy is the FP32 reference).
    ``inputs``: one batch, a tensor or a tuple of positional arguments. ``loss_fn(output)``: a
    scalar loss of the model's output (a tensor, the first item of a tuple, or ``.logits``);
    default half the mean square. ``sensitivity=False`` skips the per-layer runs; ``roles=True``
    adds one run per role of each layer (weight, activation, grad: only that role of that layer
    in the recipe's formats; a tuple such as ``("weight",)``: those roles); ``layers`` limits
    them to some module names; ``progress`` shows a tqdm bar over them. ``optimizer(params)``:
    an optimizer (``lambda ps: torch.optim.Adam(ps, lr=1e-3)``) that takes one step on the
    converted copy after its backward, so that the report has its optimizer state too (role
    ``"optimizer_state"``: each state tensor against the same step in FP32 on the same
    parameters and gradients).
    """
    loss_fn = loss_fn or _default_loss
    base = copy.deepcopy(model)
    if conversion_of(base) is not None:
        spec = conversion_of(base).recipe if spec is None else spec
        unconvert(base)
    if spec is None:
        raise TypeError("qt.analyze needs a spec (a format, a preset name or a qt.Recipe) for an "
                        "unconverted model")
    was = flush_warnings.flush_warnings_enabled()
    flush_warnings.set_flush_warnings(False)  # the report has the numbers
    try:
        return _analyze(base, inputs, as_recipe(spec), loss_fn, sensitivity, roles, layers,
                        progress, optimizer)
    finally:
        flush_warnings.set_flush_warnings(was)


def _numel(out) -> int:
    """Elements of the floating tensors of a module's output."""
    if isinstance(out, torch.Tensor):
        return out.numel() if out.is_floating_point() else 0
    if isinstance(out, (tuple, list)):
        return sum(_numel(o) for o in out)
    if isinstance(out, dict):
        return sum(_numel(o) for o in out.values())
    return 0


def _computed_format(role: Role, contraction: bool) -> Optional[Format]:
    """The format a value of ``role`` is computed in: its operand format where it enters a
    contraction (a contraction's weight, any activation or gradient), else its value format;
    None: full precision (32 bits)."""
    if role.full_precision:
        return None
    return role.mm_fmt if (contraction and role.mm_fmt is not None) else role.fmt


def _bits(fmt: Optional[Format]) -> float:
    return 32.0 if fmt is None else float(fmt.bits)


def _layer_info(model: nn.Module, conv, layer: str, outputs: int, converted: nn.Module,
                aliases=None) -> dict:
    """Sizes, formats and bits per value of one layer's roles (see :func:`suggestion`); a
    contraction's weight in the format its forward GEMM gives it (``Recipe.gemm`` included:
    :func:`qtensor.nn.gemm_forward.gemm_formats`)."""
    mod = model.get_submodule(layer)
    plans = _layer_plans(conv, layer, model, aliases)
    n_params, weight_bits, weight_fmts = 0, 0.0, set()
    for qual, t in plans["params"].items():
        n = model.get_parameter(qual).numel()
        owner, _, attr = qual.rpartition(".")
        user = converted.get_submodule(owner)
        fmt = _computed_format(t.value, isinstance(user, CONTRACTIONS) and attr == "weight")
        used = gemm_forward.gemm_formats(user) if attr == "weight" else None
        if used is not None and used["fprop"][1] is not None and not t.value.full_precision:
            fmt = used["fprop"][1]
        n_params += n
        weight_bits += n * _bits(fmt)
        weight_fmts.add(str(fmt or "fp32"))
    act = _computed_format(plans["activation"], True)
    grad = _computed_format(plans["grad"], True)
    return {"layer": layer, "type": type(mod).__name__, "params": n_params, "outputs": outputs,
            "weight_bits": weight_bits / n_params if n_params else 32.0,
            "activation_bits": _bits(act), "grad_bits": _bits(grad),
            "weight_format": ", ".join(sorted(weight_fmts)) or "-",
            "activation_format": str(act or "fp32"), "grad_format": str(grad or "fp32")}


COUNTABLE = ("weight", "activation", "grad")


def _check_count(count) -> tuple:
    """``count`` (a role name or a sequence of them) as a tuple of roles that count bits."""
    roles = (count,) if isinstance(count, str) else tuple(count)
    bad = [r for r in roles if r not in COUNTABLE]
    if bad or not roles:
        raise ValueError(f"count must name some of the roles {COUNTABLE}, got {count!r}")
    return roles


def _elements(info: dict, role: str) -> int:
    """Values of one layer that a role's bits count over: its parameters (weight), its output
    values in the analysed batch (activation), the gradient of that output (grad)."""
    return info["params"] if role == "weight" else info["outputs"]


def _is_operand_of_a_contraction(stats: "_TensorStats", model: nn.Module) -> bool:
    """False for a parameter's operand-format row when no contraction module uses it as its
    weight (an embedding table, a norm's scale, a bias: their operand format rounds nothing);
    True for every other row."""
    if stats.role not in ("weight operand", "bias operand"):
        return True
    owner, _, attr = stats.name.rpartition(".")
    try:
        mod = model.get_submodule(owner)
    except AttributeError:
        return True
    return isinstance(mod, CONTRACTIONS) and attr == "weight"


def _lossy(role: Role) -> bool:
    """Whether a role rounds anything (FP32 without an operand format rounds nothing)."""
    return not role.full_precision and role != Role(_FP32)


def _optimizer_step(model: nn.Module, optimizer: Callable, recorder: "_Recorder") -> None:
    """One step of ``optimizer(model.parameters())`` on the converted model, and the same step
    of ``optimizer`` on plain FP32 copies of its parameters and gradients: each state tensor of
    a parameter with a low-precision optimizer_state role against its FP32 counterpart (the
    optimizer rounds its state in each in-place op, so the values before one rounding are not
    there to compare with)."""
    conv = conversion_of(model)
    named = [(n, p) for n, p in model.named_parameters()]
    copies = []
    for _n, p in named:
        c = _plain(p).detach().float().clone().requires_grad_()
        c.grad = None if p.grad is None else _plain(p.grad).detach().float().clone()
        copies.append(c)
    ref = optimizer(copies)
    opt = optimizer(model.parameters())
    with torch.no_grad():
        ref.step()
        opt.step()
    for (n, p), c in zip(named, copies):
        plan = conv.tensor_plans.get(n)
        if plan is None or plan.master or not _lossy(plan.optimizer_state):
            continue
        want = ref.state.get(c, {})
        for key, value in opt.state.get(p, {}).items():
            if (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0
                    and isinstance(want.get(key), torch.Tensor)):
                recorder._add("optimizer_state", f"{key!r} of {n}", plan.optimizer_state.fmt,
                              want[key].detach(), _plain(value).detach().float(),
                              rounded=False)


def _analyze(base, inputs, recipe, loss_fn, sensitivity, roles, layers,
             progress, optimizer=None) -> "AnalysisReport":
    same = _SameRandomness()
    ref = _run(copy.deepcopy(base), inputs, loss_fn, same)

    # the converted copy: every role rounding, and the operands of every contraction
    recorder = _Recorder()
    conv_model = copy.deepcopy(base)
    fp32_weights = {n: m.weight.detach().clone() for n, m in base.named_modules()
                    if isinstance(m, CONTRACTIONS)}
    seen: Dict[str, torch.Tensor] = {}
    seen_dy: Dict[str, torch.Tensor] = {}
    out_numel: Dict[str, int] = {}

    def capture(name):
        def hook(mod, args):  # (returns None: the input is left as it is)
            if name not in seen and args and isinstance(args[0], torch.Tensor):
                seen[name] = args[0].detach()
        return hook

    def capture_dy(name):  # the gradient of the output as the backward GEMMs receive it
        def keep(g):
            seen_dy.setdefault(name, g.detach())

        def hook(mod, args, out):  # (before the converted output hook rounds it)
            if name not in seen_dy and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(keep)
        return hook

    def count(name):
        def hook(mod, args, out):
            out_numel[name] = out_numel.get(name, 0) + _numel(out)
        return hook

    all_layers = _layer_names(base)
    modules = {n for n, _m in base.named_modules() if n}
    unknown = [n for n in (layers or []) if n not in modules]
    if unknown:
        raise ValueError(f"qt.analyze: layers {unknown} are not modules of the model (its "
                         f"layers with parameters: {all_layers})")
    listed = list(dict.fromkeys(all_layers + list(layers or [])))
    handles = [m.register_forward_pre_hook(capture(n)) for n, m in conv_model.named_modules()
               if isinstance(m, CONTRACTIONS)]
    handles += [m.register_forward_hook(capture_dy(n)) for n, m in conv_model.named_modules()
                if isinstance(m, CONTRACTIONS)]
    handles += [conv_model.get_submodule(n).register_forward_hook(count(n)) for n in listed]
    with flush_warnings.observe(recorder):
        convert(conv_model, recipe)
        full = _run(conv_model, inputs, loss_fn, same)
        if optimizer is not None:
            _optimizer_step(conv_model, optimizer, recorder)
    for h in handles:
        h.remove()
    conv = conversion_of(conv_model)
    root_plan = conv.module_plans[""]
    if "" in seen and not root_plan.plain and not root_plan.activation.full_precision:
        # the root's pre-hooks see its inputs before its converted forward rounds them
        seen[""] = round_to(seen[""], root_plan.activation)
    contractions, backward = [], []
    for n, m in conv_model.named_modules():
        if n in seen:
            head = {"layer": n, "type": type(m).__name__,
                    "shape": "x".join(map(str, m.weight.shape))}
            rows = contraction_errors(m, seen[n], m.weight, fp32_weights[n], seen_dy.get(n),
                                      tuple(GEMMS))
            contractions += [{**head, **r} for r in rows if r["gemm"] == "fprop"]
            backward += [{**head, **r} for r in rows if r["gemm"] != "fprop"]
            x = seen[n]
            used = gemm_forward.gemm_formats(m, getattr(x, "mm_fmt", None),
                                             x_plain=not isinstance(x, QTensor))
            axes = gemm_forward.reduction_axes(m)["fprop"]
            mm, wmm, t = used["fprop"]
            if mm is not None:  # the activation operand as this contraction rounds it
                xv = _operand(_plain(x).float(), None, axes[0], t)
                recorder._add("activation operand", f"input of {n}", mm, xv,
                              _operand(xv, mm, axes[0]), clip_fmt=with_axis(mm, axes[0]))
            if n in conv.gemms:  # its weight operand as its forward GEMM rounds it
                recorder.stats.pop(("weight operand", f"{n}.weight"), None)
                if wmm is not None:
                    wv = _operand(_plain(m.weight).detach().float(), None, axes[1], t)
                    recorder._add("weight operand", f"{n}.weight", wmm, wv,
                                  _operand(wv, wmm, axes[1]), clip_fmt=with_axis(wmm, axes[1]))

    grads = [{"parameter": n, "grad_cos": _cosine(ref["grads"], full["grads"], [n])}
             for n in ref["grads"] if ref["grads"][n] is not None]
    aliases = _aliases(base)
    infos = [_layer_info(base, conv, n, out_numel.get(n, 0), conv_model, aliases) for n in listed]
    plans = {n: _layer_plans(conv, n, base, aliases) for n in listed}
    sens = []
    if sensitivity:
        names = layers if layers is not None else all_layers
        runs = [(n, "all") for n in names]
        which = ROLES if roles is True else (() if not roles else tuple(
            [roles] if isinstance(roles, str) else roles))
        bad = [r for r in which if r not in ROLES]
        if bad:
            raise ValueError(f"qt.analyze: roles must be True, False or some of {ROLES}, got "
                             f"{roles!r}")
        if which:
            for n in names:
                p = plans.get(n) or _layer_plans(conv, n, base)
                has = {"weight": any(_lossy(t.value) for t in p["params"].values()),
                       "activation": _lossy(p["activation"]),
                       "grad": _lossy(p["grad"]) or any(
                           _lossy(t.grad) and not t.value.full_precision
                           for t in p["params"].values())}
                runs += [(n, r) for r in which if has[r]]
        for layer, role in _progress(runs, "qt.analyze: layers", progress):
            m = convert_one_layer(copy.deepcopy(base), recipe, layer, role=role, _plans=conv)
            row = {"layer": layer, "role": role, "type": type(m.get_submodule(layer)).__name__}
            row.update(_compare(ref, _run(m, inputs, loss_fn, same)))
            sens.append(row)
    return AnalysisReport(
        spec=recipe.name or recipe.describe().splitlines()[0], loss_fp32=ref["loss"],
        overall=_compare(ref, full), tensors=[s.row() for s in recorder.stats.values()
                                              if _is_operand_of_a_contraction(s, base)],
        contractions=contractions, backward=backward, sensitivity=sens, gradients=grads,
        layers=infos, recipe=recipe, plans=plans)


# ---------------------------------------------------------------------------------------------
# The report

def _num(v) -> str:
    if isinstance(v, float):
        if math.isinf(v) or math.isnan(v):
            return str(v)
        return f"{v:.4g}"
    return str(v)


_PCT = ("flushed", "saturated", "clipped", "clip_loss", "nan")


def _cells(row: dict, keys) -> List[str]:
    return [f"{100 * row[k]:.2f}%" if k in _PCT else _num(row[k]) for k in keys]


_TABLES = (
    ("tensors", "Rounded tensors by role",
     ("role", "tensor", "format", "numel", "rel_error", "snr_db", "flushed", "saturated",
      "clipped", "clip_loss", "nan")),
    ("contractions", "Contractions: local error (relative, Frobenius) against the FP32 product of "
     "the unrounded operands, the exact product of the rounded operands, and the operands' share",
     ("layer", "type", "shape", "operand_formats", "accumulator", "vs_fp32", "vs_exact_rounded",
      "operands")),
    ("backward", "Backward GEMMs (dgrad: dY x W, wgrad: x x dY): the same errors, on the "
     "gradient of each contraction's output as it arrived",
     ("layer", "gemm", "operand_formats", "accumulator", "vs_fp32", "vs_exact_rounded",
      "operands")),
    ("sensitivity", "Sensitivity: only this layer (role \"all\") or only this role of it in "
     "the recipe's formats", ("layer", "role", "type", "dloss", "kl", "grad_cos")),
    ("layers", "Layers: sizes (parameters; output values in this batch) and bits per value as "
     "computed (operand format where a value enters a contraction)",
     ("layer", "type", "params", "outputs", "weight_format", "weight_bits", "activation_format",
      "grad_format")),
    ("gradients", "Gradients of the converted model against FP32", ("parameter", "grad_cos")),
)


@dataclass
class AnalysisReport:
    """What :func:`analyze` measured; ``.table()``, ``.markdown()``, ``.to_json()``,
    ``.plot(path)``, ``.bits(count)``. Rows are dicts (``report.tensors``, ``.contractions``,
    ``.sensitivity``, ``.gradients``, ``.layers``); ``overall``: loss, dloss, kl, grad_cos of
    the whole converted model. ``recipe`` and ``plans`` (what it planned per layer, for
    ``qt.suggest_recipe``) are not in the JSON."""

    spec: str
    loss_fp32: float
    overall: dict
    tensors: List[dict] = field(default_factory=list)
    contractions: List[dict] = field(default_factory=list)
    backward: List[dict] = field(default_factory=list)
    sensitivity: List[dict] = field(default_factory=list)
    gradients: List[dict] = field(default_factory=list)
    layers: List[dict] = field(default_factory=list)
    # not in the JSON: the recipe analysed and what it planned per layer (qt.suggest_recipe)
    recipe: Optional[Recipe] = field(default=None, repr=False, compare=False)
    plans: Optional[dict] = field(default=None, repr=False, compare=False)

    def bits(self, count=("weight",), layers: Optional[List[str]] = None) -> float:
        """Average bits per value of the analysed recipe, counting the roles in ``count``
        (see :func:`qtensor.analysis.suggest.suggestion`), over ``layers`` (default: the layers with
        sensitivity rows, every layer with parameters of its own unless
        ``qt.analyze(layers=...)`` chose some)."""
        total = elements = 0.0
        infos = self.counted_layers() if layers is None else [
            i for i in self.layers if i["layer"] in set(layers)]
        for info in infos:
            for role in _check_count(count):
                n = _elements(info, role)
                total += n * info[f"{role}_bits"]
                elements += n
        return total / elements if elements else 0.0

    def counted_layers(self) -> List[dict]:
        """The rows of ``layers`` whose values bits are counted over: those with sensitivity
        rows (all of them for a report without)."""
        named = {r["layer"] for r in self.sensitivity}
        return [i for i in self.layers if not named or i["layer"] in named]

    def _head(self) -> str:
        o = self.overall
        return (f"qt.analyze: {self.spec}; FP32 loss {self.loss_fp32:.6g}, converted "
                f"{o['loss']:.6g} (change {o['dloss']:+.4g}), KL of the outputs {o['kl']:.4g}, "
                f"gradient cosine {o['grad_cos']:.6f}")

    def table(self) -> str:
        """The report as plain text tables."""
        out = [self._head()]
        for attr, title, keys in _TABLES:
            rows = getattr(self, attr)
            if not rows:
                continue
            cells = [list(keys)] + [_cells(r, keys) for r in rows]
            widths = [max(len(c[i]) for c in cells) for i in range(len(keys))]
            lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
            lines.insert(1, "  ".join("-" * w for w in widths))
            out += ["", title, *lines]
        return "\n".join(out)

    def markdown(self) -> str:
        out = [self._head()]
        for attr, title, keys in _TABLES:
            rows = getattr(self, attr)
            if not rows:
                continue
            out += ["", f"**{title}**", "", "| " + " | ".join(keys) + " |",
                    "|" + "|".join("---" for _ in keys) + "|"]
            out += ["| " + " | ".join(_cells(r, keys)) + " |" for r in rows]
        return "\n".join(out)

    def to_json(self, **kwargs) -> str:
        def clean(v):  # JSON has no Inf/NaN: strings
            if isinstance(v, float) and (math.isinf(v) or math.isnan(v)):
                return str(v)
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            if isinstance(v, list):
                return [clean(x) for x in v]
            return v
        data = {k: getattr(self, k) for k in ("spec", "loss_fp32", "overall", "tensors",
                                             "contractions", "backward", "sensitivity", "gradients",
                                             "layers")}
        return json.dumps(clean(copy.deepcopy(data)), **kwargs)

    def __str__(self) -> str:
        return self.table()

    def plot(self, path) -> None:
        """Save a figure: per-layer sensitivity bars, contraction errors per layer, and SNR by
        role per tensor (matplotlib, imported here)."""
        import matplotlib
        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        whole = [r for r in self.sensitivity if r.get("role", "all") == "all"]
        by_role = [r for r in self.sensitivity if r.get("role", "all") != "all"]
        fig, axes = plt.subplots(5 if by_role else 4, 1, figsize=(10, 17 if by_role else 14))
        ax = axes[0]
        if whole:
            names = [r["layer"] for r in whole]
            xs = range(len(names))
            ax.bar([x - 0.2 for x in xs], [abs(r["dloss"]) for r in whole], 0.4,
                   label="|change in loss|")
            ax.bar([x + 0.2 for x in xs], [r["kl"] for r in whole], 0.4,
                   label="KL of outputs")
            ax.set_xticks(list(xs), names, rotation=45, ha="right", fontsize=7)
            ax.set_yscale("symlog", linthresh=1e-6)
            ax.legend()
        ax.set_title("Sensitivity: only this layer in low precision")
        ax = axes[1]
        if self.contractions:
            names = [r["layer"] for r in self.contractions]
            xs = range(len(names))
            ax.bar([x - 0.2 for x in xs], [r["vs_fp32"] for r in self.contractions], 0.4,
                   label="vs FP32 product of unrounded operands")
            ax.bar([x + 0.2 for x in xs], [r["vs_exact_rounded"] for r in self.contractions],
                   0.4, label="vs exact product of rounded operands")
            ax.set_xticks(list(xs), names, rotation=45, ha="right", fontsize=7)
            ax.set_yscale("symlog", linthresh=1e-8)  # (FP32 sums of rounded operands: ~0)
            ax.legend()
        ax.set_title("Contractions: relative local error")
        ax = axes[2]
        roles = sorted({r["role"] for r in self.tensors})
        for i, role in enumerate(roles):
            rows = [r for r in self.tensors if r["role"] == role]
            ax.scatter([i] * len(rows), [min(r["snr_db"], 200.0) for r in rows], label=role)
        ax.set_xticks(range(len(roles)), roles)
        ax.set_ylabel("SNR (dB)")
        ax.set_title("Rounded tensors: SNR by role (one point per tensor)")
        ax = axes[3]
        for i, role in enumerate(roles):
            rows = [r for r in self.tensors if r["role"] == role]
            ax.scatter([i - 0.1] * len(rows), [100 * r["clipped"] for r in rows], marker="o",
                       label="values clipped" if i == 0 else None, color="C0")
            ax.scatter([i + 0.1] * len(rows), [100 * r["clip_loss"] for r in rows], marker="x",
                       label="L1 norm removed" if i == 0 else None, color="C3")
        ax.axhline(100 * flush_warnings.CLIP_LIMIT, color="C3", lw=0.5, ls="--")
        ax.set_xticks(range(len(roles)), roles)
        ax.set_ylabel("%")
        if roles:
            ax.legend()
        ax.set_title("Rounded tensors: clipped by their block's scale (dashed: the warning's "
                     "limit on the L1 norm removed)")
        if by_role:
            ax = axes[4]
            names = list(dict.fromkeys(r["layer"] for r in by_role))
            kl = {(r["layer"], r["role"]): r["kl"] for r in by_role}
            width = 0.8 / len(ROLES)
            for i, role in enumerate(ROLES):
                ax.bar([x + (i - 1) * width for x in range(len(names))],
                       [kl.get((n, role), 0.0) for n in names], width, label=role)
            ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=7)
            ax.set_yscale("symlog", linthresh=1e-6)
            ax.legend()
            ax.set_title("Sensitivity by role: KL of the outputs with only this role of this "
                         "layer in low precision")
        fig.suptitle(self._head(), fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)

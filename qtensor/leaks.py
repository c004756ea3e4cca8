"""leak_check(): prove that no value escaped the emulated precision, or show where one did.

A converted model keeps every value in its format only as long as every tensor that takes part
in the computation is a QTensor. A value that is silently computed in float32 (an unconverted
buffer, a constant made inside ``forward``, a functional call on a ``.dequantize()``-d tensor,
a gradient or optimizer state left plain) makes the emulation wrong without any error.
``leak_check`` watches every aten op (forward, backward, the optimizer step) with a
``TorchDispatchMode`` and reports each such place::

    with qt.leak_check(action="record", optimizer=opt) as report:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
    print(report.summary())

Kinds of finding (``Finding.kind``):

- ``"mixed"`` (a): a plain floating (or complex) tensor and QTensors in one op. Not reported:
  Python scalars; 0-dim plain tensors (scalars torch wraps, e.g. in backward formulas) unless
  they are a module's parameter, buffer or tensor attribute, or were made by user code inside a
  converted model (``torch.tensor(0.5)`` in ``forward``); plain tensors with no elements (they
  carry no value: a KV cache started as ``torch.empty(b, 0, d)`` and grown with ``torch.cat``;
  a cache that starts with values, ``torch.zeros(b, 1, d)``, is reported); sparse tensors
  whose stored values are in the QTensors' formats (there is no sparse QTensor: the gradient of
  ``nn.Embedding(sparse=True)``; likewise as a result and as a gradient after ``step()``);
  tensors named in
  ``allow``; tensors a recipe keeps in full precision on purpose (a rule ``None``, activations
  of a module whose activation role is ``None``); the target of a loss (an argument named
  ``target``, in forward and in the loss's backward: data, like the model's inputs), and inside
  a ``torch.nn.functional`` loss its target and class weights and what it computes from them
  alone (``cross_entropy`` with ``label_smoothing`` or probability targets multiplies the
  log-probabilities by them); plain values written into a QTensor by a
  data-movement op (``copy_``, indexing assignment: the QTensor rounds them, which is
  quantization); and plain constants that torch's own module code makes inside a converted
  model (the zero initial state of ``nn.LSTM``, the float mask ``nn.MultiheadAttention`` builds
  from a boolean mask) and what torch computes from them.
- ``"plain_result"`` (b): an op on QTensors returned a plain floating tensor: a dispatch rule
  that forgot to wrap, or QTensor values written into a plain destination that only receives
  them (``out=``, ``copy_``; a plain tensor that is also an operand, as ``plain.add_(q)``, is
  reported as mixed). Also a complex result (``torch.fft.rfft``, ``torch.view_as_complex`` of
  a QTensor: RoPE written with complex numbers): no format is complex, so it and what is
  computed from it (reported as plain ops) run in full precision.
- ``"plain_op"`` (c): a computing op on plain floating tensors only, inside the forward of a
  converted model (any module under an outermost module that ``qt.convert`` converted, or that
  holds a QTensor parameter or buffer) or inside the backward of such an op. Data-movement ops
  (views, copies) and factories (``torch.ones``) are not reported by themselves: the constant is
  reported where it meets QTensors or is computed with. A module whose activation role a recipe
  sets to ``None`` is not checked for plain ops.
- ``"unrepresentable"`` (d, ``check_values=True``): a QTensor, input or output of an op, whose
  payload is not exactly representable in its ``fmt``: rounded again with ``qt.quantize``
  (nearest) and compared bit for bit. A block-formatted tensor whose blocks no longer line up
  (a slice or reshape across blocks) is judged element by element instead: each value must be an
  element of the format times a scale (significant bits and quantum).
- ``"optimizer"`` (e): right after ``optimizer.step()`` of an optimizer given as ``optimizer=``
  or to ``report.watch(opt)`` (before qt.convert's own hook rounds the state): a parameter,
  gradient, or per-element state tensor (``exp_avg``, ``momentum_buffer``: state shaped like the
  parameter; the scalar ``step`` is not a value) that is plain, or a QTensor in another format
  than expected. Expected: the plan ``qt.convert`` recorded for the parameter (value, grad and
  optimizer_state roles; the state may also still be in the parameter's or the gradient's
  format, from which the optimizer made it); for a QTensor parameter without a plan, state in
  its own or its gradient's format and a QTensor gradient of any format (by the dispatch rule a
  weight gradient takes the format of the incoming gradient). FP32 master weights (the recipe's
  ``master_weights``) are by design plain, and so is their state. A plain parameter is reported
  when convert planned a format for it or the same optimizer holds QTensor parameters.
- ``"fused"`` (f): a fused kernel that multiplies inside one op (PyTorch's flash/efficient
  attention, ``F.scaled_dot_product_attention``'s CPU kernel, and the inference fast path of
  ``nn.MultiheadAttention``/``nn.TransformerEncoderLayer``) got QTensors with an operand format
  (``mm_fmt``): it cannot be applied there. The finding says how to get the emulated
  decomposition instead: ``with torch.nn.attention.sdpa_kernel(SDPBackend.MATH):`` (plus
  ``torch.backends.mha.set_fastpath_enabled(False)`` for the fast path). Without an operand
  format the fused op is computed and rounded as one op, like any other, and not reported.

Ops issued by qtensor's own code (``as_qtensor``, ``dequantize``, convert's hooks, the quantizer)
are never reported: only ops issued from user code or from torch on its behalf.

Backward findings need the forward to run inside the ``with`` block too: the module path and
source line of a backward op come from tags the forward leaves on autograd nodes. Module paths
are relative to the outermost module called (call the model, not a submodule, to get full
names).

Each finding names the op, the module path (qualified name from ``named_modules()`` of the
outermost module being called, ``"<backward of 'layer1.0.conv'>"`` in backward), the tensors
involved (role, plain or QTensor, shape, format or dtype, parameter/buffer name), and the user's
source line (the first frame outside torch and qtensor; in backward, the line of the forward op
whose backward leaked). ``action="raise"`` raises :class:`LeakError` at the first finding,
``"warn"`` warns once per distinct finding (:class:`LeakWarning`), ``"record"`` only records.

``allow``: tensors (by identity or storage: their views too) that may be plain, and glob
patterns matched against parameter/buffer names, module paths, op names and kinds.

A ``leak_check`` runs one ``with`` block. After it, the report holds text only (names, shapes,
formats): no reference to a tensor, so ``qt.unconvert`` (``torch.utils.swap_tensors``, which
refuses tensors with weak references) works while the report is kept.
"""
from __future__ import annotations

import fnmatch
import os
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook as _register_post_step
from torch.optim.optimizer import register_optimizer_step_pre_hook as _register_pre_step
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.nn.modules.loss import _Loss
from torch.utils.weak import WeakIdKeyDictionary

from . import dispatch as _dispatch
from .formats import BlockFormat, FloatFormat, Format
from .tensor import QTensor
from .convert import ConvertedForward

__all__ = ["leak_check", "LeakReport", "Finding", "TensorInfo", "Location", "LeakError",
           "LeakWarning", "KINDS"]

MIXED = "mixed"
PLAIN_RESULT = "plain_result"
PLAIN_OP = "plain_op"
UNREPRESENTABLE = "unrepresentable"
OPTIMIZER = "optimizer"
FUSED = "fused"
KINDS = (MIXED, PLAIN_RESULT, PLAIN_OP, UNREPRESENTABLE, OPTIMIZER, FUSED)

_HEADLINES = {
    MIXED: "a plain floating tensor met QTensors",
    PLAIN_RESULT: "an op on QTensors returned a plain floating tensor",
    PLAIN_OP: "an op computed on plain floating tensors inside a converted model",
    UNREPRESENTABLE: "a QTensor holds values its format cannot represent",
    OPTIMIZER: "after optimizer.step(): a tensor is not in its expected format",
    FUSED: "a fused kernel multiplied QTensors without their operand format (mm_fmt)",
}

_FLOAT_DTYPES = frozenset((torch.float32, torch.float64, torch.float16, torch.bfloat16))
# values a format could hold: complex ones too (no format is complex, so a complex tensor made
# from QTensors is a value computed in full precision)
_VALUE_DTYPES = _FLOAT_DTYPES | {torch.complex32, torch.complex64, torch.complex128}
_TAG = "qtensor.leak_check"  # key of our entry in autograd nodes' metadata
_TARGET_TAG = "qtensor.leak_check.targets"  # storage keys of a loss node's targets
_COPY_OPS = frozenset(("copy_", "_foreach_copy_"))
_LIFTS = frozenset(("lift_fresh", "lift_fresh_copy"))  # torch.tensor(...): a factory
_LOSS_DATA = frozenset(("target", "weight", "pos_weight"))  # in ops with a target
_MATH_SDPA = ("run it under `with torch.nn.attention.sdpa_kernel("
              "torch.nn.attention.SDPBackend.MATH):`, where attention decomposes into bmm and "
              "softmax, each emulated (forward and backward)")
_FASTPATH = ("this is the inference fast path of nn.MultiheadAttention / "
             "nn.TransformerEncoderLayer: call torch.backends.mha.set_fastpath_enabled(False) "
             "and " + _MATH_SDPA)
# Fused kernels that contain contractions, by op packet: how to get them emulated instead
_FUSED_CONTRACTIONS = {
    **{name: _MATH_SDPA for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
        "_scaled_dot_product_fused_attention_overrideable",
        "_scaled_dot_product_fused_attention_overrideable_backward",
        "_scaled_dot_product_attention_math_for_mps", "_flash_attention_forward",
        "_flash_attention_backward", "_efficient_attention_forward",
        "_efficient_attention_backward")},
    "_native_multi_head_attention": _FASTPATH,
    "_transformer_encoder_layer_fwd": _FASTPATH,
}


class LeakError(RuntimeError):
    """Raised by ``leak_check(action="raise")`` at the first finding."""

    def __init__(self, finding: "Finding"):
        super().__init__(finding.message)
        self.finding = finding


class LeakWarning(UserWarning):
    """Issued by ``leak_check(action="warn")``, once per distinct finding."""


# ---------------------------------------------------------------------------------------------
# Findings and the report

@dataclass(frozen=True)
class Location:
    """A source line: the first user frame (outside torch and qtensor)."""

    filename: str
    lineno: int
    function: str

    def __str__(self) -> str:
        return f"{_short_path(self.filename)}:{self.lineno} in {self.function}"


def _short_path(path: str) -> str:
    """A path relative to the working directory when it lies below it, else as it is."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if rel.startswith("..") else rel


@dataclass(frozen=True)
class TensorInfo:
    """One tensor taking part in a finding."""

    role: str                 # argument name ("self", "other", "out[0]", "grad", ...)
    qtensor: bool
    shape: Tuple[int, ...]
    fmt: Optional[str]        # the QTensor's value format
    dtype: str
    name: Optional[str] = None  # qualified parameter/buffer name, where it is one
    flagged: bool = False     # this tensor is the leak

    def __str__(self) -> str:
        shape = "[" + ", ".join(str(s) for s in self.shape) + "]"
        if self.qtensor:
            s = f"{self.role}: QTensor{shape} {self.fmt}"
        else:
            s = f"{self.role}: plain Tensor{shape} {self.dtype}"
        if self.name:
            s += f" ({self.name})"
        return s + (" <-" if self.flagged else "")


@dataclass(frozen=True)
class Finding:
    """One leak: what, where in the model, which op, which tensors, which source line."""

    kind: str
    op: str
    module: str               # "" outside any module
    phase: str                # "forward", "backward" or "optimizer"
    location: Optional[Location]
    tensors: Tuple[TensorInfo, ...]
    detail: str = ""

    @property
    def where(self) -> str:
        return self.module or "-"

    @property
    def filename(self) -> Optional[str]:
        return self.location.filename if self.location is not None else None

    @property
    def lineno(self) -> Optional[int]:
        return self.location.lineno if self.location is not None else None

    @property
    def message(self) -> str:
        loc = str(self.location) if self.location is not None else "<unknown>"
        lines = [f"leak ({self.kind}): {_HEADLINES[self.kind]}",
                 f"  op: {self.op}", f"  module: {self.where} ({self.phase})",
                 f"  at: {loc}"]
        if self.detail:
            lines.append(f"  {self.detail}")
        for t in self.tensors:
            lines.append(f"    {t}")
        return "\n".join(lines)

    def key(self):
        return (self.kind, self.module, self.op, self.location,
                tuple(t.name or t.role for t in self.tensors if t.flagged))

    def __str__(self) -> str:
        return self.message


class LeakReport:
    """The findings of one ``leak_check`` block, in order; ``summary()`` groups them."""

    def __init__(self, check: "leak_check"):
        self._check = check
        self.findings: List[Finding] = []

    def __len__(self) -> int:
        return len(self.findings)

    def __iter__(self):
        return iter(self.findings)

    def __getitem__(self, i):
        return self.findings[i]

    @property
    def ok(self) -> bool:
        """No findings."""
        return not self.findings

    def of_kind(self, kind: str) -> List[Finding]:
        if kind not in KINDS:
            raise ValueError(f"unknown finding kind {kind!r}; expected one of {', '.join(KINDS)}")
        return [f for f in self.findings if f.kind == kind]

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Check parameters, gradients and state after each ``optimizer.step()``."""
        self._check._watch(optimizer)

    def groups(self):
        """(kind, module, op) -> [count, first finding], in order of first occurrence."""
        out = {}
        for f in self.findings:
            g = out.get((f.kind, f.where, f.op))
            if g is None:
                out[(f.kind, f.where, f.op)] = [1, f]
            else:
                g[0] += 1
        return out

    def summary(self) -> str:
        """A table: kind, module, op, count, first location (one row per distinct leak)."""
        if not self.findings:
            return "leak_check: no leaks"
        groups = self.groups()
        rows = [("kind", "module", "op", "count", "first location")]
        for (kind, where, op), (count, first) in groups.items():
            loc = str(first.location) if first.location is not None else "<unknown>"
            rows.append((kind, where, op, str(count), loc))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [f"leak_check: {len(self.findings)} finding{'s' * (len(self.findings) != 1)}"
                 f" in {len(groups)} place{'s' * (len(groups) != 1)}"]
        for r in rows:
            cells = [r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].ljust(widths[2]),
                     r[3].rjust(widths[3]), r[4]]
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return f"<LeakReport: {len(self.findings)} findings>"


# ---------------------------------------------------------------------------------------------
# Frames: who issued an op, and the user's source line

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_QT_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_THIS_FILE = os.path.abspath(__file__)
_USER, _TORCH, _QT, _ENGINE, _PLUMBING = range(5)
# frames between an op call and a dispatch mode: not the op's issuer
_PLUMBING_FILES = tuple(os.path.join(_TORCH_DIR, p) for p in (
    os.path.join("_dynamo", "eval_frame.py"), "_compile.py",
    os.path.join("utils", "_python_dispatch.py"), "_ops.py"))
_CODE_KIND: dict = {}
# a converted model's forward (convert.ConvertedForward) calls the class's forward: module-call
# machinery, like torch's own, so an op below it is issued by that forward's code
_MODULE_CALL_CODE = frozenset({ConvertedForward.__call__.__code__})


def _code_kind(code) -> int:
    k = _CODE_KIND.get(code)
    if k is None:
        fn = code.co_filename
        if not os.path.isabs(fn):
            fn = os.path.abspath(fn)
        if code in _MODULE_CALL_CODE:
            k = _TORCH
        elif fn.startswith(_QT_DIR):
            # an op that a (nested) leak_check passes on is still its caller's op
            k = _PLUMBING if fn == _THIS_FILE and code.co_name == "__torch_dispatch__" else _QT
        elif fn.startswith(_TORCH_DIR):
            if code.co_name == "_engine_run_backward":
                k = _ENGINE  # the autograd engine runs the graph: ops below are torch's own
            elif fn in _PLUMBING_FILES:
                k = _PLUMBING
            else:
                k = _TORCH
        else:
            k = _USER
        _CODE_KIND[code] = k
    return k


def _walk(frame):
    """(direct issuer kind, issuer kind, user Location) for an op called from ``frame``.

    direct: the first frame that is not dispatch plumbing (torch library code or not);
    issuer: the first frame outside torch (user code or qtensor), or the autograd engine.
    """
    direct = issuer = None
    f = frame
    while f is not None:
        k = _code_kind(f.f_code)
        if k != _PLUMBING:
            if direct is None:
                direct = k
            if issuer is None and k != _TORCH:
                issuer = k
            if k == _USER:
                return direct, issuer, Location(f.f_code.co_filename, f.f_lineno,
                                                f.f_code.co_name)
        f = f.f_back
    return direct, issuer if issuer is not None else _TORCH, None


_FUNCTIONAL_FILE = os.path.join(_TORCH_DIR, "nn", "functional.py")
_LOSS_CODE: dict = {}


def _is_loss_code(code) -> bool:
    """A function of torch.nn.functional with a ``target`` argument: a loss."""
    k = _LOSS_CODE.get(code)
    if k is None:
        fn = code.co_filename if os.path.isabs(code.co_filename) else \
            os.path.abspath(code.co_filename)
        k = _LOSS_CODE[code] = fn == _FUNCTIONAL_FILE and "target" in code.co_varnames[
            :code.co_argcount + code.co_kwonlyargcount]
    return k


def _loss_data(frame) -> Optional[frozenset]:
    """Storage keys of the plain target and class weights of the torch.nn.functional loss that
    issued an op (below the user's frame), None outside a loss. Composite losses compute with
    them in ops that have no ``target`` argument (cross_entropy with label smoothing or
    probability targets: ``log_probs * target``, ``* weight``)."""
    f = frame
    while f is not None:
        k = _code_kind(f.f_code)
        if k in (_USER, _QT):
            break
        if k == _TORCH and _is_loss_code(f.f_code):
            local = f.f_locals
            return frozenset(_storage_key(t) for t in (local.get(n) for n in _LOSS_DATA)
                             if isinstance(t, torch.Tensor) and not isinstance(t, QTensor))
        f = f.f_back
    return None


def _user_location(frame) -> Optional[Location]:
    f = frame
    while f is not None:
        if _code_kind(f.f_code) == _USER:
            return Location(f.f_code.co_filename, f.f_lineno, f.f_code.co_name)
        f = f.f_back
    return None


# ---------------------------------------------------------------------------------------------
# Values: is a payload representable in its format?

_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32,
             torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.contiguous(), b.contiguous()
    same = a.view(_INT_VIEW[a.dtype]) == b.view(_INT_VIEW[b.dtype])
    return same | (torch.isnan(a) & torch.isnan(b))


def _sig_bits_and_quantum(x: torch.Tensor):
    """For float32 x (finite): number of significant bits, and exponent of the lowest set bit."""
    bits = x.view(torch.int32) & 0x7FFFFFFF
    e = bits >> 23
    m = bits & 0x7FFFFF
    sig = torch.where(e > 0, m | 0x800000, m)
    low = sig & (-sig)
    ctz = torch.frexp(low.to(torch.float64)).exponent - 1
    bitlen = torch.frexp(sig.to(torch.float64)).exponent
    nsig = bitlen - ctz
    quantum = torch.where(e > 0, e, torch.ones_like(e)) - 150 + ctz
    return nsig, quantum


def _block_elements_ok(x: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Element-wise necessary condition for a value of a block format, whatever the blocking:
    an element of ``fmt.elem`` times a scale (finite or NaN, within max, few enough
    significant bits, no bit below the smallest quantum)."""
    x32 = x.to(torch.float32)
    ok = x32.to(x.dtype) == x if x.dtype == torch.float64 else torch.ones_like(x32, dtype=torch.bool)
    nan = torch.isnan(x32)
    finite = torch.isfinite(x32)
    ok = ok & (nan | finite)
    if fmt.tensor_scale:  # a float32 per-tensor scale: any float32 significand can occur
        return ok | nan
    ok = ok & (nan | (x32.abs() <= fmt.max))
    elem = fmt.elem
    if isinstance(elem, FloatFormat):
        allowed = elem.man + 1
    else:
        allowed = elem.wl - 1 if elem.signed else elem.wl
    if fmt.scale_rule == "amax":  # the scale has significant bits of its own
        allowed += fmt.scale.man + 1
    nz = finite & (x32 != 0)
    nsig, quantum = _sig_bits_and_quantum(torch.where(nz, x32, torch.ones_like(x32)))
    ok = ok & (~nz | ((nsig <= allowed) & (quantum >= fmt.min_quantum_exp)))
    return ok | nan


def _unrepresentable(payload: torch.Tensor, fmt: Format):
    """None if every value of payload is in fmt, else (count, first index, value, nearest)."""
    if payload.numel() == 0 or payload.dtype not in _FLOAT_DTYPES:
        return None
    from .ops import quantize
    p = payload.detach()
    f = _dispatch.fit_format(fmt, p.dim())
    q = quantize(p, f, rounding="nearest")
    if torch.equal(p, q):  # the common case, one pass (NaN needs the bit comparison below)
        return None
    ok = _same_bits(p, q)
    if bool(ok.all()):
        return None
    if isinstance(fmt, BlockFormat):
        # the blocks may not line up any more (slices, reshapes): judge each element
        ok = _block_elements_ok(p, fmt)
        if bool(ok.all()):
            return None
    bad = (~ok).reshape(-1)
    i = int(bad.nonzero()[0, 0])
    return int(bad.sum()), i, p.reshape(-1)[i].item(), q.reshape(-1)[i].item()


def _sparse_in_format(t: torch.Tensor, fmts) -> bool:
    """A sparse tensor cannot be a QTensor (nn.Embedding(sparse=True)'s gradient): it counts as
    in format when its stored values are representable in each of ``fmts``."""
    if not t.is_sparse or not fmts:
        return False
    values = t._values()
    return all(_unrepresentable(values, f) is None for f in fmts)


def _moves_checked_values(func, args, kwargs, outs, checked) -> bool:
    """A data-movement op whose inputs are all checked QTensors of the outputs' format (no
    plain floating input): its outputs hold those values, they need no second check."""
    rule = _dispatch.rule_of(func)
    if rule.kind != _dispatch.MOVE_KIND or rule.mutated or func._opname in _dispatch._MOVE_IF:
        return False  # (ops that move only under a condition may round: check them)
    fmt = outs[0][1].fmt
    for _, t in _tensors(args, kwargs, None):
        if isinstance(t, QTensor):
            if not _same_format(t.fmt, fmt) or t.is_inference() or \
                    checked.get(t) != (t._version, t._data._version):
                return False
        elif _is_float(t):
            return False
    return all(_same_format(t.fmt, fmt) for _, t in outs)


def _same_format(a: Format, b: Format) -> bool:
    """Equal formats; block formats compare without their axis (it follows transposes)."""
    if a == b:
        return True
    if isinstance(a, BlockFormat) and isinstance(b, BlockFormat):
        return a.replace(axis=None) == b.replace(axis=None)
    return False


# ---------------------------------------------------------------------------------------------
# Module tracking

class _Root:
    """What we know about the outermost module of a forward call."""

    __slots__ = ("names", "converted", "plain_act")

    def __init__(self, names, converted, plain_act):
        self.names = names
        self.converted = converted
        self.plain_act = plain_act  # ids of modules whose activations a recipe leaves plain


def _conversion(m):
    return getattr(m, "_qt_conversion", None)


def _scan_root(root: torch.nn.Module, state_names, deliberate):
    """(converted, plain_act) of a root module; records parameter/buffer names, and the
    storages of plain tensors kept in full precision on purpose: by a recipe (rule None), or
    as a loss module's configuration (class weights)."""
    converted = False
    plain_act = set()
    for name, t in _named_state(root):
        state_names[t] = name
        if isinstance(t, QTensor):
            converted = True
    for mname, m in root.named_modules():
        for k, v in vars(m).items():  # tensors kept as plain attributes: unregistered state
            if isinstance(v, torch.Tensor):
                state_names[v] = f"{mname}.{k}" if mname else k
    for m in root.modules():
        conv = _conversion(m)
        if conv is None:
            if getattr(m, "_qtensor_converted", False):
                converted = True
            continue
        converted = True
        for mname, sub in m.named_modules():
            plan = conv.module_plans.get(mname)
            if plan is not None and plan.activation.full_precision:
                plain_act.add(id(sub))
        for name, t in _named_state(m):
            plan = conv.tensor_plans.get(name)
            if plan is not None and plan.value.full_precision and not isinstance(t, QTensor):
                deliberate.add(_storage_key(t))
    for m in root.modules():
        if isinstance(m, _Loss):
            for t in m.buffers(recurse=False):
                if not isinstance(t, QTensor):
                    deliberate.add(_storage_key(t))
    return converted, plain_act


def _named_state(root):
    yield from root.named_parameters(remove_duplicate=False)
    yield from root.named_buffers(remove_duplicate=False)


class _Frame:
    __slots__ = ("module", "path", "root", "seq")

    def __init__(self, module, path, root, seq):
        self.module, self.path, self.root, self.seq = module, path, root, seq


_TARGET_POS: dict = {}


_DESTS: dict = {}


def _pure_destinations(func) -> frozenset:
    """Names of the arguments an op only writes, never reads: ``out=`` tensors, and the
    destination of ``copy_``."""
    d = _DESTS.get(func)
    if d is None:
        names = {a.name for a in func._schema.arguments
                 if a.alias_info is not None and a.alias_info.is_write and a.kwarg_only}
        if func._opname in _COPY_OPS:
            names.add(func._schema.arguments[0].name)
        d = _DESTS[func] = frozenset(names)
    return d


def _target_position(func):
    """Position of an argument named ``target`` in func's schema (loss ops), else None."""
    pos = _TARGET_POS.get(func, -1)
    if pos == -1:
        pos = None
        for i, a in enumerate(func._schema.arguments):
            if a.name == "target":
                pos = i
                break
        _TARGET_POS[func] = pos
    return pos


_get_sequence_nr = torch._C._autograd._get_sequence_nr
_ACCUMULATE_NR = 2 ** 64 - 1  # AccumulateGrad nodes' sequence number


def _tag_graph(output, path, converted, seq0) -> None:
    """Tag the autograd nodes a module's forward created that no op tag reached (custom
    autograd Functions: their nodes are made after their forward ran, unseen by the mode)."""
    todo = []
    for t in tree_leaves(output):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            todo.append(t.grad_fn)
    seen = {}  # id -> node (kept alive so that ids stay unique)
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        nr = node._sequence_nr()
        if nr < seq0 or nr == _ACCUMULATE_NR:
            continue  # made before this module ran, or a leaf's gradient accumulator
        md = node.metadata
        if _TAG not in md:
            md[_TAG] = (path, None, converted)
        todo.extend(n for n, _ in node.next_functions)


# ---------------------------------------------------------------------------------------------
# The check

def _tensors(args, kwargs, schema):
    """(role, tensor) for every tensor argument, one list level deep (as aten arguments are)."""
    names = [a.name for a in schema.arguments] if schema is not None else []
    out = []
    for i, a in enumerate(args):
        role = names[i] if i < len(names) else f"arg{i}"
        if isinstance(a, torch.Tensor):
            out.append((role, a))
        elif isinstance(a, (list, tuple)):
            for j, t in enumerate(a):
                if isinstance(t, torch.Tensor):
                    out.append((f"{role}[{j}]", t))
    if kwargs:
        for k, a in kwargs.items():
            if isinstance(a, torch.Tensor):
                out.append((k, a))
            elif isinstance(a, (list, tuple)):
                for j, t in enumerate(a):
                    if isinstance(t, torch.Tensor):
                        out.append((f"{k}[{j}]", t))
    return out


def _flat_tensors(args, kwargs):
    """The tensor arguments, one list level deep, without names (the fast path)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, torch.Tensor):
                out.append(a)
            elif isinstance(a, (list, tuple)):
                out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


def _outputs(out):
    if isinstance(out, torch.Tensor):
        return [("result", out)]
    if isinstance(out, (list, tuple)):
        return [(f"result[{i}]", t) for i, t in enumerate(out) if isinstance(t, torch.Tensor)]
    return []


def _is_float(t) -> bool:
    """A floating or complex tensor: one that holds values (not indices, masks)."""
    return t.dtype in _VALUE_DTYPES


class _Mode(TorchDispatchMode):
    def __init__(self, check: "leak_check"):
        super().__init__()
        self.check = check

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        check = self.check
        if check._pending:
            check._flush()
        if not isinstance(func, torch._ops.OpOverload) or func.namespace == "qtensor":
            return func(*args, **kwargs)  # qtensor's own kernels; higher-order operators
        frame = sys._getframe(1)
        if check.check_values:
            check._check_qvalues(func, args, kwargs, None, frame)  # inputs, before they change
        out = func(*args, **kwargs)
        check._inspect(func, args, kwargs, out, frame)
        return out


class leak_check:
    """Context manager: watch every op for values that escaped the emulated precision.

    ``with qt.leak_check(action="raise"|"warn"|"record", check_values=False, optimizer=None,
    allow=()) as report:`` -- see the module docstring for what is reported. Returns a
    :class:`LeakReport`.
    """

    def __init__(self, action: str = "raise", check_values: bool = False, optimizer=None,
                 allow: Iterable = ()):
        if action not in ("raise", "warn", "record"):
            raise ValueError(f"leak_check: action must be 'raise', 'warn' or 'record', "
                             f"got {action!r}")
        self.action = action
        self.check_values = bool(check_values)
        self._optimizers = []
        if optimizer is not None:
            opts = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
            for o in opts:
                if not isinstance(o, torch.optim.Optimizer):
                    raise TypeError(f"leak_check: optimizer must be a torch.optim.Optimizer "
                                    f"(or a list of them), got {type(o).__name__}")
            self._optimizers = list(opts)
        self._allow_tensors = []
        self._allow_patterns = []
        for a in (allow if isinstance(allow, (list, tuple, set, frozenset)) else [allow]):
            if isinstance(a, torch.Tensor):
                self._allow_tensors.append(a)
            elif isinstance(a, str):
                self._allow_patterns.append(a)
            else:
                raise TypeError(f"leak_check: allow takes tensors and name patterns (str), "
                                f"got {type(a).__name__}")
        self.report = LeakReport(self)
        self._tls = threading.local()
        self._handles = []
        self._mode = None
        self._ended = False      # the with-block has ended: the check holds no tensor any more
        self._pending = []
        self._seen = set()
        self._plain_act = False  # the current op runs in a module with full-precision activations
        self._targets = None     # in a loss's backward: its targets' storage keys
        self._user_made = WeakIdKeyDictionary()  # constants made by user code in a converted model
        self._loss_made = WeakIdKeyDictionary()  # values a loss computed from its target only
        self._in_step = 0        # inside optimizer.step()
        self._func = None        # the op being inspected
        self._state_names = WeakIdKeyDictionary()  # param/buffer -> qualified name
        self._blessed = WeakIdKeyDictionary()      # torch-made constants in a converted model
        self._deliberate = WeakIdKeyDictionary()   # values a recipe leaves in full precision
        self._deliberate_storage = set()           # the same for state tensors (and views)
        self._watched = weakref.WeakSet()
        self._checked = WeakIdKeyDictionary()      # QTensor -> version whose values were checked
        self._allow_storages = set()
        for t in self._allow_tensors:
            self._allow_storages.add(_storage_key(t))

    # -- entering and leaving ------------------------------------------------------------------
    def __enter__(self) -> LeakReport:
        if self._ended:
            raise RuntimeError("leak_check: this check has run its block already; make a new "
                               "qt.leak_check(...) for another block")
        mm = torch.nn.modules.module
        self._handles.append(mm.register_module_forward_pre_hook(self._pre_hook))
        self._handles.append(mm.register_module_forward_hook(self._post_hook, always_call=True))
        self._handles.append(_register_pre_step(self._pre_step))
        self._handles.append(_register_post_step(self._post_step))
        for o in self._optimizers:
            self._watch(o)
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self.report

    def __exit__(self, *exc):
        try:
            self._flush()
        finally:
            self._mode.__exit__(*exc)
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self._in_step = 0
            self._tls = threading.local()
            self._forget_tensors()
        return False

    def _forget_tensors(self) -> None:
        """Drop every reference to tensors once the block ends: the report keeps only text
        (findings hold names, shapes, formats), and a weakref left on a parameter would make
        torch.utils.swap_tensors (qt.unconvert, module.to with swapping) fail."""
        self._pending = []
        self._func = None
        self._allow_tensors = []  # (their storages stay in _allow_storages: plain keys)
        self._optimizers = []
        self._ended = True
        for name in ("_user_made", "_loss_made", "_state_names", "_blessed", "_deliberate",
                     "_checked"):
            setattr(self, name, WeakIdKeyDictionary())

    def _watch(self, optimizer) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"watch: expected a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if self._ended:
            raise RuntimeError("watch: the leak_check block has ended; watch the optimizer "
                               "inside the with-block (or pass optimizer= to leak_check)")
        if optimizer in self._watched:
            return
        self._watched.add(optimizer)
        # a per-optimizer hook runs before qt.convert's process-wide one, so it sees what the
        # optimizer itself made (convert then rounds the state into its optimizer_state format)
        self._handles.append(optimizer.register_step_post_hook(self._step_hook))

    # -- modules ---------------------------------------------------------------------------------
    def _stack(self) -> list:
        s = getattr(self._tls, "stack", None)
        if s is None:
            s = self._tls.stack = []
        return s

    def _pre_hook(self, module, args):
        stack = self._stack()
        if stack:
            top = stack[-1]
            root = top.root
            path = root.names.get(id(module))
            if path is None:  # a module outside the root's tree (made in forward, shared)
                path = f"{top.path}.<{type(module).__name__}>" if top.path else \
                    f"<{type(module).__name__}>"
        else:
            names = {id(m): n for n, m in module.named_modules(remove_duplicate=False)}
            root = _Root(names, *_scan_root(module, self._state_names,
                                            self._deliberate_storage))
            path = ""
        stack.append(_Frame(module, path, root, _get_sequence_nr()))

    def _post_hook(self, module, args, output):
        if self._pending:
            self._flush()
        stack = self._stack()
        # pop down to this module (robust to a module whose forward raised)
        for i in range(len(stack) - 1, -1, -1):
            if stack[i].module is module:
                fr = stack[i]
                del stack[i:]
                if fr.root.converted and torch.is_grad_enabled():
                    _tag_graph(output, fr.path, id(module) not in fr.root.plain_act, fr.seq)
                break

    # -- backward attribution --------------------------------------------------------------------
    def _flush(self) -> None:
        """Tag the autograd nodes of the last op's outputs with its module and source line
        (outputs get their grad_fn only after the dispatch mode returned)."""
        pending, self._pending = self._pending, []
        for t, tag, target in pending:
            gf = t.grad_fn
            if gf is not None:
                md = gf.metadata
                if tag is not None and _TAG not in md:
                    md[_TAG] = tag
                if target is not None:
                    md[_TARGET_TAG] = md.get(_TARGET_TAG, frozenset()) | {target}

    # -- exemptions -----------------------------------------------------------------------------
    def _allowed(self, t) -> bool:
        if not self._allow_tensors and not self._allow_patterns:
            return False
        for a in self._allow_tensors:
            if a is t:
                return True
        if self._allow_storages and _storage_key(t) in self._allow_storages:
            return True
        if self._allow_patterns:
            name = self._state_names.get(t)
            if name is not None and self._matches(name):
                return True
        return False

    def _matches(self, text: str) -> bool:
        return any(fnmatch.fnmatchcase(text, p) for p in self._allow_patterns)

    def _exempt_plain(self, t, role) -> bool:
        """A plain floating tensor that may meet QTensors (see the module docstring)."""
        if t.numel() == 0:
            return True  # no values (a KV cache started as torch.empty(b, 0, d)): none leaks
        if t.dim() == 0 and t not in self._state_names and t not in self._user_made:
            return True  # a scalar (a wrapped Python number, a 0-dim constant torch made)
        if role in _LOSS_DATA and _target_position(self._func) is not None:
            return True  # a loss's target (data, like the model's inputs) and class weights
        if self._targets is not None and _storage_key(t) in self._targets:
            return True  # the same, in the loss's backward
        if t in self._blessed or self._is_deliberate(t):
            return True
        if self._plain_act and t not in self._state_names:
            return True  # a recipe leaves this module's activations in full precision
        return self._allowed(t)

    # -- the op check ----------------------------------------------------------------------------
    def _context(self):
        """(module path, phase, converted, forward location tag or None) of the current op."""
        self._plain_act = False
        self._targets = None
        node = torch._C._current_autograd_node()
        if node is not None:
            md = node.metadata
            tag = md.get(_TAG)
            self._targets = md.get(_TARGET_TAG)
            if tag is None:
                return "<backward>", "backward", False, None
            # tag: (module path, forward location, converted: checked for plain ops)
            self._plain_act = not tag[2]
            return f"<backward of '{tag[0] or '<root>'}'>", "backward", tag[2], tag
        stack = self._stack()
        if not stack:
            return "", "forward", False, None
        top = stack[-1]
        converted = top.root.converted and id(top.module) not in top.root.plain_act
        self._plain_act = top.root.converted and not converted
        return top.path or "<root>", "forward", converted, None

    def _inspect(self, func, args, kwargs, out, frame):
        self._func = func
        ins = _flat_tensors(args, kwargs)  # cheap first pass without names
        has_q = False
        plain = False
        for t in ins:
            if isinstance(t, QTensor):
                has_q = True
            elif t.dtype in _VALUE_DTYPES:
                plain = True
        outs = _outputs(out)
        module, phase, converted, tag = self._context()
        if plain and phase == "forward" and torch.is_grad_enabled():
            self._record_targets(func, args, kwargs, outs)
        if not has_q:
            if plain and phase == "forward" and not self._in_step:
                self._propagate_loss_data(ins, outs, frame)
            if plain and (converted or self._in_step):
                self._propagate_deliberate(ins, outs)
            if not converted:
                return
        if converted and phase == "forward" and torch.is_grad_enabled():
            self._record_tags(outs, module, frame)
        if has_q:
            if self.check_values:
                self._check_qvalues(func, args, kwargs, outs, frame)
            packet = func._opname
            if packet in _FUSED_CONTRACTIONS:
                self._check_fused(func, args, kwargs, outs, module, phase, tag, frame)
            if packet.startswith("_foreach_"):
                self._check_foreach(func, args, kwargs, outs, module, phase, tag, frame)
                return
            if plain:
                self._check_mixed(func, args, kwargs, outs, module, phase, tag, frame)
                return
            fmts = [t.fmt for t in ins if isinstance(t, QTensor)]
            bad = [i for i, (_, t) in enumerate(outs)
                   if not isinstance(t, QTensor) and _is_float(t)
                   and not _sparse_in_format(t, fmts)]
            if bad:
                detail = ""
                if any(outs[i][1].is_complex() for i in bad):
                    detail = ("no format is complex: this complex result, and what is computed "
                              "from it, is not emulated (full precision)")
                self._finding(PLAIN_RESULT, func, args, kwargs, outs, module, phase, tag, frame,
                              flag_out=bad, detail=detail)
            return
        # plain tensors only, inside a converted model
        if plain and func._opname not in _LIFTS:
            self._check_plain_op(func, args, kwargs, ins, outs, module, phase, tag, frame)
        elif outs and any(_is_float(t) for _, t in outs):
            # a factory (or a cast from integers): a constant; bless it when torch made it,
            # remember it when the user did (a 0-dim one is then not taken for a scalar)
            direct, _, _ = _walk(frame)
            # scalar_tensor: how torch's C++ code makes a tensor of a number (an SDPA mask)
            torch_made = direct in (_TORCH, _ENGINE) or func._opname == "scalar_tensor"
            made = self._blessed if torch_made else self._user_made
            for _, t in outs:
                if _is_float(t) and not isinstance(t, QTensor):
                    made[t] = True

    def _is_deliberate(self, t) -> bool:
        if t in self._deliberate:
            return True
        return bool(self._deliberate_storage) and _storage_key(t) in self._deliberate_storage

    def _propagate_deliberate(self, ins, outs):
        """Plain values computed only from tensors a recipe keeps plain are deliberate too
        (an optimizer's FP32 state made from an FP32 gradient)."""
        if not self._deliberate and not self._deliberate_storage:
            return
        for t in ins:
            if _is_float(t) and not self._is_deliberate(t):
                return
        for _, t in outs:
            if _is_float(t) and not isinstance(t, QTensor):
                self._deliberate[t] = True

    def _propagate_loss_data(self, ins, outs, frame):
        """Plain values a loss computes from its target and class weights only are its data
        too (cross_entropy's smoothed target: ``target * (1 - ls) + ls / C``)."""
        data = None
        found = False
        for t in ins:
            if not _is_float(t) or t.dim() == 0:
                continue  # scalars
            if t not in self._loss_made:
                if data is None:
                    data = _loss_data(frame) or frozenset()
                if _storage_key(t) not in data:
                    return
            found = True
        if not found:
            return
        for _, t in outs:
            if _is_float(t):
                self._loss_made[t] = True

    def _record_targets(self, func, args, kwargs, outs):
        """A loss's target is data: remember it on the loss's autograd node so that its
        backward formula (``sigmoid(x) - target``) may use it too."""
        pos = _target_position(func)
        if pos is None:
            return
        t = args[pos] if pos < len(args) else kwargs.get("target")
        if isinstance(t, torch.Tensor) and not isinstance(t, QTensor):
            key = _storage_key(t)
            for _, o in outs:
                self._pending.append((o, None, key))

    def _record_tags(self, outs, module, frame):
        if not outs:
            return
        loc = None
        for _, t in outs:
            if _is_float(t):
                if loc is None:
                    loc = _user_location(frame)
                self._pending.append((t, (module if module != "<root>" else "", loc, True),
                                      None))

    def _check_mixed(self, func, args, kwargs, outs, module, phase, tag, frame):
        rule = _dispatch.rule_of(func)
        into_q = False
        if rule.kind == _dispatch.MOVE_KIND and rule.mutated:
            pos, name = rule.mutated[0]
            dst = args[pos] if pos < len(args) else kwargs.get(name)
            into_q = isinstance(dst, QTensor)
        if into_q:
            return  # plain values written into a QTensor are rounded to its format
        named = _tensors(args, kwargs, func._schema)
        fmts = [t.fmt for _, t in named if isinstance(t, QTensor)]
        flagged = [i for i, (role, t) in enumerate(named)
                   if not isinstance(t, QTensor) and _is_float(t)
                   and not self._exempt_plain(t, role) and not _sparse_in_format(t, fmts)]
        if flagged and phase == "forward":
            data = _loss_data(frame)
            if data is not None:  # a loss's target and class weights: data, here and in the
                # backward of this op (tagged on its node, as for ops with a target argument)
                keys = {i: _storage_key(named[i][1]) for i in flagged}
                data_in = [i for i in flagged
                           if keys[i] in data or named[i][1] in self._loss_made]
                if data_in and torch.is_grad_enabled():
                    self._pending.extend((o, None, keys[i]) for _, o in outs for i in data_in)
                flagged = [i for i in flagged if i not in data_in]
        if not flagged:
            return
        dests = _pure_destinations(func)
        operands = [i for i in flagged if named[i][0].split("[")[0] not in dests]
        if operands:
            self._finding(MIXED, func, args, kwargs, outs, module, phase, tag, frame,
                          named=named, flag_in=operands)
        else:  # only a plain destination (out=, copy_): QTensor values came back plain
            plain_out = [i for i, (_, t) in enumerate(outs)
                         if not isinstance(t, QTensor) and _is_float(t)]
            self._finding(PLAIN_RESULT, func, args, kwargs, outs, module, phase, tag, frame,
                          named=named, flag_in=flagged, flag_out=plain_out)

    def _check_fused(self, func, args, kwargs, outs, module, phase, tag, frame):
        """(f): a fused kernel (flash attention, MHA's fast path) multiplies inside one op,
        where no operand can be rounded to its mm_fmt."""
        named = _tensors(args, kwargs, func._schema)
        with_mm = [i for i, (_, t) in enumerate(named)
                   if isinstance(t, QTensor) and t.mm_fmt is not None]
        if not with_mm:
            return  # value formats only: computed and rounded as one op, like any other
        fmts = sorted({str(named[i][1].mm_fmt) for i in with_mm})
        detail = (f"the operand format {' / '.join(fmts)} of "
                  f"{', '.join(named[i][0] for i in with_mm)} is not applied inside this "
                  f"kernel; to emulate it, {_FUSED_CONTRACTIONS[func._opname]}")
        self._finding(FUSED, func, args, kwargs, outs, module, phase, tag, frame, named=named,
                      flag_in=with_mm, detail=detail)

    def _check_foreach(self, func, args, kwargs, outs, module, phase, tag, frame):
        """_foreach_* ops: element i of every list belongs together (per-parameter formats)."""
        lists = [(i, a) for i, a in enumerate(args) if isinstance(a, (list, tuple))]
        if not lists:
            return
        names = [a.name for a in func._schema.arguments]
        n = len(lists[0][1])
        singles = [(names[i] if i < len(names) else f"arg{i}", a) for i, a in enumerate(args)
                   if isinstance(a, torch.Tensor)]
        mutated = func._opname in _COPY_OPS
        for j in range(n):
            group = [(f"{names[i] if i < len(names) else f'arg{i}'}[{j}]", lst[j])
                     for i, lst in lists if j < len(lst) and isinstance(lst[j], torch.Tensor)]
            group += singles
            qs = [t for _, t in group if isinstance(t, QTensor)]
            if not qs:
                continue
            if mutated and isinstance(group[0][1], QTensor):
                continue  # values copied into a QTensor are rounded
            flagged = [k for k, (role, t) in enumerate(group)
                       if not isinstance(t, QTensor) and _is_float(t)
                       and not self._exempt_plain(t, role)]
            if flagged:
                # copied into a plain tensor: QTensor values came back plain
                kind = PLAIN_RESULT if mutated and flagged == [0] else MIXED
                self._finding(kind, func, args, kwargs, [], module, phase, tag, frame,
                              named=group, flag_in=flagged)

    def _check_plain_op(self, func, args, kwargs, ins, outs, module, phase, tag, frame):
        if not any(_is_float(t) and not isinstance(t, QTensor) for _, t in outs):
            return
        direct, issuer, _ = _walk(frame)
        if issuer == _QT:
            return
        rule = _dispatch.rule_of(func)
        if all(t in self._blessed for t in ins if _is_float(t)):
            # computing with torch's own constants (a mask from a boolean one, a zero state)
            for _, t in outs:
                if _is_float(t):
                    self._blessed[t] = True
            return
        if rule.kind == _dispatch.MOVE_KIND or rule.is_view:  # (view_as_real: a view too)
            return  # moving plain values is not computing with them; their use is reported
        named = _tensors(args, kwargs, func._schema)
        flagged = [i for i, (role, t) in enumerate(named)
                   if _is_float(t) and not self._exempt_plain(t, role)]
        if not flagged:
            return
        for _, t in outs:  # a leaked scalar stays a leak downstream
            if _is_float(t) and t.dim() == 0:
                self._user_made[t] = True
        self._finding(PLAIN_OP, func, args, kwargs, outs, module, phase, tag, frame,
                      named=named, flag_in=flagged, issuer=issuer)

    def _check_qvalues(self, func, args, kwargs, outs, frame):
        """(d): the QTensor inputs (outs None; not the destinations an op overwrites) or
        outputs of an op whose payloads are not in their formats."""
        packet = func._opname
        if outs is None:
            rule = _dispatch.rule_of(func)
            mutated = {n for _, n in rule.mutated}
            cands = [(r, t) for r, t in _tensors(args, kwargs, func._schema)
                     if isinstance(t, QTensor) and r.split("[")[0] not in mutated]
        elif packet.startswith("empty") or packet.startswith("new_empty"):
            return  # uninitialised memory
        else:
            cands = [(r, t) for r, t in outs if isinstance(t, QTensor)]
            if cands and _moves_checked_values(func, args, kwargs, cands, self._checked):
                for _, t in cands:  # values moved from checked QTensors of the same format
                    if not t.is_inference():
                        self._checked[t] = (t._version, t._data._version)
                return
        for role, t in cands:
            if t.is_inference():  # no version counter: check every time
                ver = None
            else:
                ver = (t._version, t._data._version)
                if self._checked.get(t) == ver:
                    continue
                self._checked[t] = ver
            bad = _unrepresentable(t._data, t.fmt)
            if bad is not None:
                count, i, v, q = bad
                detail = (f"{count} of {t.numel()} values of {role} are not in {t.fmt}; "
                          f"first at flat index {i}: {v!r} (nearest in format: {q!r})")
                module, phase, _, tag = self._context()
                self._finding(UNREPRESENTABLE, func, args, kwargs, [], module, phase, tag,
                              frame, named=[(role, t)], flag_in=[0], detail=detail)

    # -- the optimizer -------------------------------------------------------------------------
    def _pre_step(self, optimizer, args, kwargs):
        """Every optimizer: the gradients and state a recipe keeps in full precision are
        deliberate (the FP32 state the optimizer computes from them too)."""
        self._in_step += 1
        for group in optimizer.param_groups:
            for p in group["params"]:
                plan = getattr(p, "_qt_plan", None)
                if plan is None:
                    continue
                g = p.grad
                if plan.grad.full_precision and g is not None and not isinstance(g, QTensor):
                    self._deliberate[g] = True
                if plan.optimizer_state.full_precision or plan.master:
                    for v in optimizer.state.get(p, {}).values():
                        if isinstance(v, torch.Tensor) and not isinstance(v, QTensor):
                            self._deliberate[v] = True

    def _post_step(self, optimizer, args, kwargs):
        self._in_step = max(0, self._in_step - 1)

    def _step_hook(self, optimizer, args, kwargs):
        if self._pending:
            self._flush()
        loc = _user_location(sys._getframe(1))
        op = f"{type(optimizer).__name__}.step"
        # qt.convert's FP32 master weights stand in for their parameters until its own hook
        # puts the parameters back: (param list, index, parameter, master)
        masters = {id(m): p for _, _, p, m in getattr(optimizer, "_qt_swapped", ())}
        params = [masters.get(id(p), p) for g in optimizer.param_groups for p in g["params"]]
        any_q = any(isinstance(p, QTensor) for p in params)
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                master = id(p) in masters
                p = masters.get(id(p), p)
                name = self._state_names.get(p) or f"param_groups[{gi}]['params'][{pi}]"
                self._check_param(optimizer, p, name, any_q, op, loc, master)

    def _check_param(self, optimizer, p, name, any_q, op, loc, master=False):
        if self._is_deliberate(p) or self._allowed(p) or self._matches_name(name):
            return
        plan = getattr(p, "_qt_plan", None)  # what qt.convert chose for this parameter
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        problems = []  # (role, tensor, why)
        if not isinstance(p, QTensor):
            want = plan.value.fmt if plan is not None else None
            if _is_float(p) and (want is not None or any_q):
                problems.append((name, p, "parameter is a plain tensor" + (
                    f", expected {want}" if want is not None else
                    " among QTensor parameters")))
            for role, t, why in problems:
                self._opt_finding(op, owner, loc, role, t, why)
            return
        if plan is not None and plan.value.fmt is not None and \
                not _same_format(p.fmt, plan.value.fmt):
            problems.append((name, p, f"parameter in {p.fmt}, expected {plan.value.fmt}"))
        g = p.grad
        want_g = None if plan is None else plan.grad.fmt
        if g is not None and (plan is None or want_g is not None):
            if _sparse_in_format(g, [want_g or p.fmt]):
                pass  # a sparse gradient (there is no sparse QTensor) with its values in format
            elif not isinstance(g, QTensor):
                problems.append((f"{name}.grad", g, "gradient is a plain tensor" + (
                    f", expected {want_g}" if want_g is not None else "")))
            elif want_g is not None and not _same_format(g.fmt, want_g):
                problems.append((f"{name}.grad", g, f"gradient in {g.fmt}, expected {want_g}"))
        state = {} if master else optimizer.state.get(p, {})
        # convert's plan: master weights run the optimizer in FP32 by design; a None
        # optimizer_state leaves the state as the optimizer made it
        check_state = plan is None or (not plan.master and plan.optimizer_state.fmt is not None)
        want_s = p.fmt if plan is None else plan.optimizer_state.fmt
        # the optimizer makes its state like the parameter (zeros_like) or the gradient
        # (momentum = clone(grad)); convert rounds it into want_s right after this hook
        ok_s = [want_s, p.fmt] + ([g.fmt] if isinstance(g, QTensor) else [])
        for k, v in (state.items() if check_state else ()):
            if not isinstance(v, torch.Tensor) or not _is_float(v) or v.dim() == 0:
                continue
            if tuple(v.shape) != tuple(p.shape) or k == "qt_master":
                continue  # not a per-element state of the parameter's values
            role = f"{name} state[{k!r}]"
            if not isinstance(v, QTensor):
                if not self._allowed(v):
                    problems.append((role, v, f"optimizer state {k!r} is a plain tensor, "
                                              f"expected {want_s}"))
            elif not any(_same_format(v.fmt, f) for f in ok_s):
                problems.append((role, v, f"optimizer state {k!r} in {v.fmt}, "
                                          f"expected {want_s}"))
        if self.check_values:
            checks = [(name, p), (f"{name}.grad", g)] + [
                (f"{name} state[{k!r}]", v) for k, v in state.items()]
            for role, t in checks:
                if isinstance(t, QTensor):
                    bad = _unrepresentable(t._data, t.fmt)
                    if bad is not None:
                        problems.append((role, t, f"{bad[0]} of {t.numel()} values not in "
                                                  f"{t.fmt}; first {bad[2]!r}"))
        for role, t, why in problems:
            self._opt_finding(op, owner, loc, role, t, why)

    def _matches_name(self, name) -> bool:
        return bool(self._allow_patterns) and self._matches(name)

    def _opt_finding(self, op, owner, loc, role, t, why):
        info = _info(role, t, flagged=True, name=None)
        f = Finding(OPTIMIZER, op, owner, "optimizer", loc, (info,), why)
        self._emit(f)

    # -- making findings -------------------------------------------------------------------------
    def _finding(self, kind, func, args, kwargs, outs, module, phase, tag, frame, *, named=None,
                 flag_in=(), flag_out=(), detail="", issuer=None):
        if issuer is None:
            _, issuer, loc = _walk(frame)
        else:
            loc = None
        if issuer == _QT:
            return  # qtensor's own code (conversion, dequantize, hooks): deliberate
        if tag is not None and tag[1] is not None:
            loc = tag[1]  # backward: the forward op whose backward this is
        elif loc is None:
            loc = _user_location(frame)
        if named is None:
            named = _tensors(args, kwargs, func._schema)
        infos = [_info(role, t, flagged=(i in flag_in), name=self._state_names.get(t))
                 for i, (role, t) in enumerate(named)]
        infos += [_info(role, t, flagged=(i in flag_out), name=None)
                  for i, (role, t) in enumerate(outs)]
        f = Finding(kind, str(func), module, phase, loc, tuple(infos), detail)
        self._emit(f)

    def _emit(self, f: Finding) -> None:
        if self._allow_patterns and (self._matches(f.module) or self._matches(f.op)
                                     or self._matches(f.kind)):
            return
        self.report.findings.append(f)
        if self.action == "raise":
            raise LeakError(f)
        if self.action == "warn":
            key = f.key()
            if key not in self._seen:
                self._seen.add(key)
                loc = f.location
                if loc is not None:  # attributed to the user's line, not to this module
                    warnings.warn_explicit(f.message, LeakWarning, loc.filename, loc.lineno)
                else:
                    warnings.warn(f.message, LeakWarning, stacklevel=2)


def _storage_key(t):
    try:
        if isinstance(t, QTensor):
            t = t._data
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return (t.device, id(t))


def _info(role, t, *, flagged, name) -> TensorInfo:
    q = isinstance(t, QTensor)
    return TensorInfo(role, q, tuple(t.shape), str(t.fmt) if q else None,
                      str(t.dtype).replace("torch.", ""), name, flagged)

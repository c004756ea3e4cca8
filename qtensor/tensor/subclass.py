"""QTensor: a tensor whose values live in a number format, and stay there through every op.

A QTensor wraps a plain high-precision *payload* (float32; float64 when built from float64) whose
values are all exactly representable in its value format ``fmt``. It may also carry ``mm_fmt``,
the format its values take when they enter a matrix multiply or convolution (rounded per use
along that contraction's reduction dimension; see :mod:`qtensor.tensor.dispatch`).

Build QTensors with :func:`as_qtensor` (rounds, differentiable) rather than the constructor (which
trusts that the payload is already in format). ``t.dequantize()`` gives the values as a plain
tensor. Every aten op on QTensors is handled by :func:`qtensor.tensor.dispatch.dispatch`; autograd sits
above, so gradients are QTensors too, and :func:`quantize_grad` gives a gradient its own format.

Conversions:
- ``t.to(device)`` / ``.cuda()`` / ``.cpu()``: moves the payload, same formats.
- ``t.to(dtype)`` with a floating dtype (float64, float16, bfloat16, float32): a QTensor with a
  payload of that dtype and the same formats, its values rounded again to ``fmt`` (the cast is a
  computation). Any other dtype (integers, float8 dtypes) gives a plain tensor.
- ``torch.save``/``torch.load(weights_only=True)``, ``pickle``, ``copy.deepcopy``: payload and
  formats round-trip exactly (formats travel as their string form).
- ``nn.Parameter(t)`` is a QTensor marked as a parameter (PyTorch's rule for subclasses).
- ``t.data = x``: a QTensor x brings its payload and formats; a plain float tensor is rounded
  into t's formats. ``share_memory_()`` (``model.share_memory()``), ``storage()`` and
  ``__dlpack__`` act on the payload; ``apply_(f)`` rounds f's results into the format.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import re
from typing import Optional

import torch

from . import dispatch as _dispatch
from . import gemm as _gemm
from . import shims as _shims
from ..accum.format import PRESETS as _ACCUM_PRESETS, AccumFormat, AccumFormatError
from ..accum.format import as_accum as _as_accum
from ..kernels import ops as _ops
from ..kernels import reference as _reference
from ..kernels.checks import FLOAT_DTYPES as _PAYLOAD_DTYPES
from ..formats.presets import FORMAT_CLASSES
from ..formats.base import Format
from ..formats.parse import short_repr
from ..formats.parse import format as _parse_format

__all__ = ["QTensor", "as_qtensor", "quantize_grad"]

# torch internals: qtensor.tensor.shims
_TENSOR_DATA = _shims.TENSOR_DATA
_make_wrapper_subclass = _shims.make_wrapper_subclass
_compiler = _shims.compiler
_eval_frame_callback = _shims.eval_frame_callback


def _code_version() -> str:
    """A hash of the modules whose code decides what a traced QTensor graph contains."""
    h = hashlib.blake2b(digest_size=8)
    for path in (_dispatch.__file__, _ops.__file__, __file__, _shims.__file__):
        try:
            with open(path, "rb") as f:
                h.update(f.read())
        except (OSError, TypeError):  # no source file (frozen/zipped): the name only
            h.update(str(path).encode())
    return h.hexdigest()


_CODE_VERSION = _code_version()

def _parse(fmt) -> Optional[Format]:
    if fmt is None:
        return None
    if isinstance(fmt, Format) or type(fmt) is _gemm.GemmOperand:
        return fmt
    if isinstance(fmt, str) and fmt.startswith("gemm("):  # a per-GEMM tag in a traced graph
        return _gemm.of_token(fmt)
    return _parse_format(fmt)  # raises the formats module's FormatError for unknown names


def _check_floating(x: torch.Tensor, fmt) -> None:
    if x.dtype not in _PAYLOAD_DTYPES:
        raise TypeError(
            f"cannot give format {fmt} to a tensor of dtype {x.dtype} (shape {tuple(x.shape)}): "
            "only float32, float64, float16 and bfloat16 tensors can carry a number format")
    # dynamo bans reading .layout where it traces a backward (a grad hook's rounding, fullgraph)
    if not torch.compiler.is_dynamo_compiling() and (x.layout != torch.strided or x.is_nested):
        kind = "nested" if x.is_nested else str(x.layout)
        raise TypeError(f"cannot give format {fmt} to a {kind} tensor: only dense (strided) "
                        "tensors can carry a number format")


_is_functorch_wrapped = _shims.is_functorch_wrapped


def refuse_transformed(x: torch.Tensor, what: str = "the input") -> None:
    """A clear error for a tensor wrapped by a torch.func transform: a QTensor cannot hold one
    (its payload reaches the kernels below the transform, where such a wrapper has no data)."""
    if torch.compiler.is_dynamo_compiling():
        return  # (dynamo cannot call the check; it traces no transform's wrappers)
    if type(x) is torch.Tensor and _is_functorch_wrapped(x):
        raise NotImplementedError(
            f"QTensor does not support torch.func transforms (grad, vmap, jacrev, jvp, "
            f"functional_call under them): {what} is a transform's wrapper tensor. Use "
            "torch.autograd (loss.backward(), torch.autograd.grad) for gradients and a batch "
            "dimension instead of vmap; qt.quantize on plain tensors works under the transforms "
            "(with a straight-through gradient)")


_ACCUM_FIELDS = tuple(f.name for f in dataclasses.fields(AccumFormat) if f.compare)


def _accum_token(accum: AccumFormat) -> str:
    """An accumulator as a string for the QTensor call that dynamo puts in a graph: a preset's
    name, else ``field=value;...`` (the fields of an argument would be symbolic ints)."""
    if _ACCUM_PRESETS.get(accum.name) == accum:
        return accum.name
    parts = []
    for n in _ACCUM_FIELDS:
        v = getattr(accum, n)  # int() makes dynamo specialize a symbolic int (and guard on it)
        parts.append(f"{n}={v if v is None or isinstance(v, (bool, str)) else int(v)}")
    return ";".join(parts)


def _token_value(v: str):
    """A field of an accumulator token: an int, a bool or None; else a mode's name."""
    if v in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[v]
    return int(v) if re.fullmatch(r"[+-]?\d{1,30}", v) else v


def _accum_of_token(token: str) -> AccumFormat:
    """The AccumFormat of ``_accum_token``'s ``field=value;...`` (an AccumFormatError, a
    ValueError, for any other string)."""
    fields = {}
    for kv in token.split(";"):
        key, eq, v = kv.partition("=")
        if not eq or not key.strip() or key.strip() in fields:
            raise AccumFormatError(f"cannot read the accumulator {short_repr(token)}: expected "
                                   "field=value;... with each field once")
        fields[key.strip()] = _token_value(v.strip())
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(AccumFormat)})
    if unknown:
        raise AccumFormatError(f"cannot read the accumulator {short_repr(token)}: unknown fields "
                               f"{', '.join(unknown)}")
    try:
        return AccumFormat(**fields)
    except TypeError as e:  # a field missing (chunk, frac_bits)
        raise AccumFormatError(f"cannot read the accumulator {short_repr(token)}: {e}") from None


def _exported_init(self, *args, **kwargs):
    """Nothing: torch.export's decorator below records ``QTensor(*args, **kwargs)`` in the
    graph it traces (torch.export cannot follow a tensor subclass built in the traced code)."""


# the decorator takes only a function named __init__
_exported_init.__name__, _exported_init.__qualname__ = "__init__", "QTensor.__init__"
_exported_init = _shims.mark_exportable_init(_exported_init)


_FIELD_NAMES: dict = {}  # type -> its dataclass field names (_holds_its_fields)


def _holds_its_fields(obj) -> bool:
    """Whether a format or accumulator object has its field values: dynamo hands the objects
    that the traced code itself constructs to a constant function as empty shells (their
    fields are side effects it applies after the graph)."""
    names = _FIELD_NAMES.get(type(obj))
    if names is None:
        names = _FIELD_NAMES[type(obj)] = tuple(f.name for f in dataclasses.fields(obj))
    d = getattr(obj, "__dict__", None)
    return d is not None and all(n in d for n in names)


_TOKENS: dict = {}  # id(object) -> (object, its string form); see _graph_tokens
_TOKENS_SIZE = 4096  # entries before the cache starts again (objects made anew: bounded)


def _token(obj, to_string=str) -> str:
    """obj's string form by ``to_string`` (a format's: str; an accumulator's: _accum_token), a
    str itself."""
    if type(obj) is str:
        return obj
    hit = _TOKENS.get(id(obj))
    if hit is None:
        if len(_TOKENS) > _TOKENS_SIZE:
            _TOKENS.clear()
        hit = _TOKENS[id(obj)] = (obj, to_string(obj))  # (obj kept alive, so its id stays its own)
    return hit[1]


@torch.compiler.assume_constant_result
def _graph_tokens(fmt, mm_fmt, accum):
    """``(str(fmt), str(mm_fmt), accum token)`` (None for a None) for the QTensor call that
    dynamo puts in a graph, computed on the real objects: dynamo calls this function while it
    traces and takes the result for a constant, where tracing the string form itself (which
    compares the format with every preset) was most of a converted model's tracing time.
    None where one of the objects was built by the traced code (dynamo passes
    those without their fields): the caller then traces the string form."""
    objs = (fmt, mm_fmt, accum)
    if not all(o is None or type(o) is str or _holds_its_fields(o) for o in objs):
        return None
    return (None if fmt is None else _token(fmt), None if mm_fmt is None else _token(mm_fmt),
            None if accum is None else _token(accum, _accum_token))


@torch.compiler.assume_constant_result
def _same_formats_constant(fmt, mm_fmt, fmt2, mm_fmt2):
    """(fmt, mm_fmt) == (fmt2, mm_fmt2) on the real objects (see _graph_tokens), or None."""
    objs = (fmt, mm_fmt, fmt2, mm_fmt2)
    if not all(o is None or _holds_its_fields(o) for o in objs):
        return None
    return fmt == fmt2 and mm_fmt == mm_fmt2


def same_formats(fmt, mm_fmt, fmt2, mm_fmt2) -> bool:
    """Whether two (fmt, mm_fmt) pairs are equal. While dynamo traces, a constant it takes from
    the real objects: a format's == compares every field, recursively, which dynamo would
    trace (and guard) field by field."""
    if torch.compiler.is_dynamo_compiling():
        same = _same_formats_constant(fmt, mm_fmt, fmt2, mm_fmt2)
        if same is not None:
            return same
    return fmt == fmt2 and mm_fmt == mm_fmt2


def _graph_kwargs(mm_fmt, outer_size, outer_stride, requires_grad, accum,
                  tokens=None) -> dict:
    """The keyword arguments of a ``QTensor(data, str(fmt), ...)`` call put in a traced graph:
    the formats and the accumulator as strings (constants in the graph, where a format object
    would be rebuilt from its fields, symbolic ints under dynamic=True), defaults left out
    (torch.export allows no None). ``tokens``: _graph_tokens's, where it had them."""
    kwargs = {}
    if mm_fmt is not None:
        kwargs["mm_fmt"] = str(mm_fmt) if tokens is None else tokens[1]
    if outer_size is not None:
        kwargs["outer_size"], kwargs["outer_stride"] = tuple(outer_size), tuple(outer_stride)
    if requires_grad:
        kwargs["requires_grad"] = True
    if accum is not None:
        kwargs["accum"] = _accum_token(accum) if tokens is None else tokens[2]
    return kwargs


def _record_construction(t, data, fmt, mm_fmt, outer_size, outer_stride, requires_grad, accum):
    """While torch.export traces: put the call that builds t into the graph."""
    _exported_init(t, data, str(fmt),
                   **_graph_kwargs(mm_fmt, outer_size, outer_stride, requires_grad, accum))


_dynamo_taught = False


def _teach_dynamo() -> None:
    """Let torch.compile read ``t.fmt``/``t.mm_fmt`` of a QTensor computed inside the compiled
    code (fullgraph): dynamo takes such attributes for constants but builds trackers, for values
    with no source, only for the types it knows, and a frozen dataclass is not among them. Called
    where dynamo first meets a QTensor (flattening an input, or building one in the graph); a
    torch without this private table only loses that (a graph break, as before). Also lets
    AOTAutograd take zeros for a QTensor output's missing gradient (shims.accept_zero_tangents)."""
    global _dynamo_taught
    if _dynamo_taught or not _shims.dynamo_loaded():
        return
    _dynamo_taught = True
    from .transforms import Hadamard
    _shims.register_dynamo_constants((*FORMAT_CLASSES, AccumFormat, _gemm.GemmOperand, Hadamard))
    # a QTensor output that gets no gradient: see _shims.accept_zero_tangents (zeros are zeros
    # in every format; any other plain tangent is refused by _plain_tangent_error: the backward
    # was traced for a QTensor gradient, which no QTensor made of a plain one matches in general)
    _shims.accept_zero_tangents(
        QTensor, lambda x, fmt, mm_fmt, accum: QTensor._wrap(x, fmt, mm_fmt, accum=accum),
        _plain_tangent_error)


def _plain_tangent_error(fmt, index) -> RuntimeError:
    where = "" if index is None else f" (gradient index {index})"
    return RuntimeError(
        f"torch.compile: a QTensor output (fmt={fmt}) of the compiled code got a plain "
        f"gradient{where}: it was turned into a plain tensor (e.g. .dequantize()) outside the "
        "compiled code, but its backward was compiled for a QTensor gradient, which rounds "
        "differently than eager does with a plain one. Make the plain tensor inside the "
        "compiled code: compile the function that dequantizes, e.g. "
        "torch.compile(lambda x: model(x).dequantize()) or one that computes the loss, or "
        "compute the loss on the QTensor output itself (loss = F.mse_loss(model(x), y) "
        "works on QTensors).")


def _check_not_lowering_a_dynamic_output(t) -> None:
    """Refuse where ``ep.run_decompositions()`` flattens a program output that is a QTensor of
    dynamic size: torch 2.13 lowers it to its payload and its symbolic sizes against an output
    spec of one tensor, and the lowered program fails when called ("treespec.unflatten: leaves
    has length 2 ..."). A torch whose AOTAutograd differs is not checked."""
    if not any(isinstance(s, torch.SymInt) for s in t.shape):
        return
    if not _shims.flattening_program_output(2):  # (1 is __tensor_flatten__)
        return
    raise NotImplementedError(
        f"torch.export: the program's output is a QTensor of dynamic size {tuple(t.shape)} "
        f"(fmt={t.fmt}), which run_decompositions() cannot lower in this torch (the lowered "
        "program would return its payload and its size against an output spec of one tensor, "
        "and fail when called). Export a model whose output is plain, e.g. a wrapper whose "
        "forward returns model(x).dequantize(), or export with static shapes; the unlowered "
        "program (ep.module()) computes QTensors with a dynamic batch.")


def _describe_sizes(sizes) -> str:
    return "(" + ", ".join(f"<tensor of shape {tuple(v.shape)}>" if isinstance(v, torch.Tensor)
                           else str(v) for v in (sizes or ())) + ")"


class ScaleGroup:
    """The one tensor scale of a two-level QTensor and of every view of it (slices, ``.data``,
    ``detach()``, transposes: wrappers of the same values). ``root``: the payload of the whole
    tensor (the QTensor the scale was first given to) and ``fmt`` its format, which an in-place
    op through any view rounds as a whole (qtensor.tensor.payloads.round_inplace). A one-level
    block format's views share one too (``s`` None, from the first view on: views_group): an
    in-place op through a view rounds the root's blocks it touches."""

    __slots__ = ("s", "root", "fmt")

    def __init__(self, s, root, fmt):
        self.s, self.root, self.fmt = s, root, fmt


class QTensor(torch.Tensor):
    """A tensor whose values are in ``fmt``; contractions see them in ``mm_fmt`` (optional).

    ``QTensor(data, fmt, mm_fmt=None, *, requires_grad=False, accum=None)`` wraps ``data`` as
    is: its values must already be representable in fmt (use :func:`as_qtensor` to round).
    ``data`` must be a plain float32/float64/float16/bfloat16 tensor; it becomes the payload (not
    copied). ``accum``: the accumulator (an AccumFormat or a preset name), as ``t.accum = ...``.
    """

    _data: torch.Tensor
    fmt: Format
    mm_fmt: Optional[Format]
    _accum = None  # see accum; internal code sets _accum (no export recording)
    _group = None  # block formats: the ScaleGroup of its payload, shared by views
    _shard = None  # a shard of a whole two-level tensor: its ShardOf (qtensor.tensor.shards)

    @property
    def _tscale(self):
        """The FP32 decode tensor scale (0-dim float32) of a two-level format, or None (not
        derived yet): its group's, so that a QTensor and its views always read one scale."""
        g = self._group
        return None if g is None else g.s

    @_tscale.setter
    def _tscale(self, s):
        g = self._group
        if g is not None:
            g.s = s
        elif s is not None:  # the first scale of these values: a group whose root they are
            self._group = ScaleGroup(s, self._data, self.fmt)

    def _views_group(self):
        """The ScaleGroup that views of self share (made on the first view of a one-level
        block format, whose root self's payload is)."""
        g = self._group
        if g is None:
            g = self._group = ScaleGroup(None, self._data, self.fmt)
        return g

    @property
    def tensor_scale(self) -> Optional[torch.Tensor]:
        """A two-level format's (nvfp4) FP32 decode tensor scale s (a 0-dim float32 tensor):
        the values are element x block scale x s in float32; data movement keeps s (and the
        values), computing ops derive a fresh one by Transformer Engine's rule. None for other
        formats."""
        if self._tscale is None and _two_level(self.fmt):
            # values wrapped without their scale: the one TE's rule gives their amax
            self._tscale = _ops.quantize_with_scale(self._data.detach(), self.fmt)[1]
        return self._tscale

    @property
    def accum(self) -> Optional[AccumFormat]:
        """How contractions with this operand sum their products (a qtensor.accum.AccumFormat);
        None: in the payload precision. Results of ops inherit it from their inputs."""
        return self._accum

    @accum.setter
    def accum(self, value):
        self._accum = _as_accum(value, "QTensor.accum")
        if torch.compiler.is_exporting():  # the exported program builds t again, with it
            _record_construction(self, self._data, self.fmt, self.mm_fmt, None, None, False,
                                 self._accum)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data, fmt, mm_fmt=None, outer_size=None, outer_stride=None, *,
                requires_grad=False, accum=None, tensor_scale=None):
        if isinstance(data, QTensor):
            raise TypeError("QTensor(data, ...): data is already a QTensor; use as_qtensor to "
                            "change its format")
        fmt = _parse(fmt)
        mm_fmt = _parse(mm_fmt)
        if fmt is None:
            raise TypeError("QTensor needs a format (fmt)")
        _check_floating(data, fmt)
        _teach_dynamo()
        if isinstance(accum, str) and "=" in accum:
            accum = _accum_of_token(accum)
        t = cls._wrap(data, fmt, mm_fmt, outer_size, outer_stride, requires_grad,
                      _as_accum(accum, "QTensor(accum=...)"))
        if tensor_scale is not None:
            if not _two_level(fmt):
                raise ValueError(f"QTensor(tensor_scale=...): {fmt} has no tensor scale (only "
                                 "two-level block formats such as nvfp4)")
            t._tscale = _reference.check_tensor_scale(tensor_scale, fmt).to(data.device)
        return t

    @staticmethod
    def _wrap(data, fmt, mm_fmt=None, outer_size=None, outer_stride=None, requires_grad=False,
              accum=None):
        """The fast internal constructor: no checks, no parsing."""
        if torch.compiler.is_dynamo_compiling():
            # dynamo cannot trace _make_wrapper_subclass, but puts a call to the class in the
            # graph as one node. The accumulator goes in the call too (a later t.accum = ...
            # would be a side effect applied after the graph, unseen by the contractions in it).
            tokens = _graph_tokens(fmt, mm_fmt, accum)
            return QTensor(data, str(fmt) if tokens is None else tokens[0],
                           **_graph_kwargs(mm_fmt, outer_size, outer_stride, requires_grad, accum,
                                           tokens))
        if type(data) is torch.Tensor and _is_functorch_wrapped(data):
            refuse_transformed(data, "the payload")
        t = torch.Tensor._make_wrapper_subclass(
            QTensor, data.shape if outer_size is None else outer_size,
            strides=data.stride() if outer_stride is None else outer_stride,
            storage_offset=data.storage_offset(), dtype=data.dtype, device=data.device,
            layout=data.layout, requires_grad=requires_grad)
        t._data = data
        t.fmt = fmt
        t.mm_fmt = mm_fmt
        if accum is not None:
            t._accum = accum
        if torch.compiler.is_exporting():
            _record_construction(t, data, fmt, mm_fmt, outer_size, outer_stride, requires_grad,
                                 accum)
        return t

    @staticmethod
    def _wrap_eager(data, fmt, mm_fmt):
        """_wrap for dispatch's fast path: an eager payload (a plain tensor) while neither dynamo
        (which never traces dispatch) nor torch.export (whose constructions _wrap records) runs."""
        if _is_functorch_wrapped(data):
            refuse_transformed(data, "the payload")
        # (size, strides, storage_offset, memory_format, dtype, layout, device: positional
        # arguments parse faster)
        t = _make_wrapper_subclass(QTensor, data.shape, data.stride(), data.storage_offset(),
                                   None, data.dtype, data.layout, data.device)
        t._data = data
        t.fmt = fmt
        t.mm_fmt = mm_fmt
        return t

    def __init__(self, *args, **kwargs):
        pass

    # -- traceable subclass protocol (torch.compile) ------------------------------------------
    def __tensor_flatten__(self):
        _teach_dynamo()
        if torch.compiler.is_exporting():
            _check_not_lowering_a_dynamic_output(self)
        if self._tscale is not None:
            return ["_data", "_tscale"], (self.fmt, self.mm_fmt, self.accum)
        return ["_data"], (self.fmt, self.mm_fmt, self.accum)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        fmt, mm_fmt, accum = meta
        if any(isinstance(s, torch.Tensor) for s in (*(outer_size or ()), *(outer_stride or ()))):
            # torch 2.13's AOTAutograd subclass wrapper can hand a tensor where a symbolic
            # stride's runtime value belongs (seen after a recompilation with automatic dynamic
            # shapes, benchmarks/RESULTS.md); its other arguments are then shifted too, so no
            # value here can be trusted: refuse precisely instead of building a wrong tensor
            raise RuntimeError(
                "qtensor: torch.compile passed a tensor as a QTensor output's size or stride "
                f"(size {_describe_sizes(outer_size)}, stride {_describe_sizes(outer_stride)}). "
                "This is a torch.compile issue with dynamic shapes after a recompilation; "
                "compile with torch.compile(..., dynamic=False), or call "
                "torch._dynamo.reset() before compiling another model in the same process.")
        t = QTensor._wrap(inner_tensors["_data"], fmt, mm_fmt, outer_size, outer_stride,
                          accum=accum)
        if inner_tensors.get("_tscale") is not None:
            t._tscale = inner_tensors["_tscale"]
        return t

    def _stable_hash_for_caching(self) -> str:
        # AOTAutograd's cache key: metadata only (formats and accumulator included), never the
        # values, plus the version of the dispatch code (a graph traced through older rules must
        # not be reused)
        d = self._data
        return hashlib.blake2b(
            repr((_CODE_VERSION, tuple(self.shape), tuple(d.stride()), str(d.dtype),
                  str(d.device), self.requires_grad, str(self.fmt), str(self.mm_fmt),
                  repr(self.accum))).encode(),
            digest_size=16).hexdigest()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # dynamo never traces the rules themselves (AOTAutograd runs them on fake payloads):
        # dynamo skips this frame (shims.dynamo_skips below) and, where its frame callback is set (a
        # compiled region on the stack), the rules run under torch._disable_dynamo; else they
        # run directly (that wrapper costs several microseconds per op)
        if _eval_frame_callback is None or _eval_frame_callback() is not None:
            return _dispatch_outside_dynamo(func, args, kwargs)
        if _compiler._is_compiling_flag:
            _check_accum_not_set_while_tracing(func, args, kwargs)
        # (the rules sit below this class: they get it here, to unwrap and wrap QTensors)
        return _dispatch.dispatch(func, args, kwargs, QTensor)

    # -- values --------------------------------------------------------------------------------
    @property
    def payload(self) -> torch.Tensor:
        """The plain tensor that holds the values (no copy, outside autograd): for inspection,
        e.g. leak_check's representability check; writing to it bypasses the format."""
        return self._data

    def dequantize(self) -> torch.Tensor:
        """The values as a plain tensor.

        Without autograd (or when self does not require grad) this is the payload itself, not a
        copy: do not modify it in place (that would bypass the format). With autograd it is a
        differentiable alias whose gradient flows back unchanged (straight through).
        """
        if torch.is_grad_enabled() and self.requires_grad:
            return _Dequantize.apply(self)
        return self._data

    def tolist(self):
        """The values as (nested) Python floats."""
        return self._data.tolist()

    def __format__(self, format_spec):
        # as torch.Tensor: a 0-dim tensor formats as its number (f"{loss:.4f}")
        if self.dim() == 0 and not self.is_meta:
            return self._data.item().__format__(format_spec)
        return object.__format__(self, format_spec)

    # -- .data, memory and foreign exports: all act on the payload (the wrapper holds none) -----
    @property
    def data(self):
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, new):
        """``t.data = new`` replaces the values: a QTensor brings its payload and formats (as a
        plain tensor brings its dtype); a plain floating tensor is rounded into t's formats."""
        if not isinstance(new, QTensor):
            if not isinstance(new, torch.Tensor):
                raise TypeError(f"QTensor.data must be a tensor, got {type(new).__name__}")
            new = as_qtensor(new.detach(), _dispatch.fit_format(self.fmt, new.dim()),
                             mm_fmt=self.mm_fmt)
        _TENSOR_DATA.__set__(self, new)  # sizes, strides, dtype, device of the wrapper
        new.tensor_scale  # (a two-level one's group exists: self now aliases new's values)
        self._data, self.fmt, self.mm_fmt = new._data, new.fmt, new.mm_fmt
        self._group = new._group  # (self's old views keep the old values' group)

    def untyped_storage(self):
        """The payload's storage: ``share_memory_()``, ``is_shared()``, ``storage()`` and
        ``set_(q.untyped_storage())`` see the values (the wrapper's own storage has no data).
        While torch.compile traces, the wrapper's own (it describes the outer tensor's aliasing
        to fake tensors, which must not share storage with their payloads), and where fake tensors
        are made of it outside tracing (torch.export's fake parameters)."""
        if (torch.compiler.is_compiling() or type(self._data) is not torch.Tensor
                or _shims.called_by_describe_tensor(1)):
            return super().untyped_storage()
        return self._data.untyped_storage()

    def __dlpack__(self, *args, **kwargs):
        """Exports the payload (the values), as ``numpy()`` does."""
        if self.requires_grad:
            raise RuntimeError("Can't export tensors that require gradient, use tensor.detach()")
        return self._data.__dlpack__(*args, **kwargs)

    def apply_(self, callable):
        """As ``Tensor.apply_`` (CPU); the results are rounded into the format, as any op's."""
        if self.requires_grad:
            raise RuntimeError("Can't call apply_() on Variable that requires grad. Use "
                               "var.detach().apply_() instead.")
        new = self._data.clone()
        new.apply_(callable)
        return self.copy_(new)

    def numpy(self, *, force: bool = False):
        """The values as a NumPy array (sharing the payload's memory, as Tensor.numpy does)."""
        if self.requires_grad and not force:
            raise RuntimeError("Can't call numpy() on a QTensor that requires grad. Use "
                               "t.detach().numpy() instead.")
        return self._data.numpy(force=force)

    def __repr__(self, *, tensor_contents=None):
        try:
            from torch._tensor_str import _tensor_str
            if type(self._data) is not torch.Tensor:
                # a fake or functional payload while torch.compile traces (its debug logs print
                # graph values): reading its values would add data-dependent ops to the trace
                body = f"..., size={tuple(self.shape)}"
            else:
                body = _tensor_str(self._data, len("QTensor("))
        except Exception:  # noqa: BLE001 (printing must never fail)
            body = repr(self._data)
        parts = [body, f"fmt={self.fmt}"]
        if self.mm_fmt is not None:
            parts.append(f"mm_fmt={self.mm_fmt}")
        if self.dtype != torch.float32:
            parts.append(f"dtype={self.dtype}")
        if self.device.type != "cpu":
            parts.append(f"device='{self.device}'")
        if self.grad_fn is not None:
            parts.append(f"grad_fn=<{type(self.grad_fn).__name__}>")
        elif self.requires_grad:
            parts.append("requires_grad=True")
        return "QTensor(" + ", ".join(parts) + ")"

    # -- FSDP2 (torch.distributed.fsdp.fully_shard): its extension points for tensor subclasses --
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """The sharded parameter's all-gather input: its payload (already in format; FSDP2 pads
        an uneven last shard, so this does too); the formats travel as metadata."""
        _check_fsdp_policy(mp_policy, self)
        hook = module.__dict__.get(FSDP_HOOK_ATTR)
        if hook is not None:  # qtensor.nn.distributed's: the sharded parameter's gradient
            hook(self, module)
        data = self._data
        rows = -(-outer_size[0] // mesh.size()) if len(outer_size) else 0
        if data.dim() and data.shape[0] < rows:
            data = torch.cat([data, data.new_zeros((rows - data.shape[0], *data.shape[1:]))])
        # a two-level format's tensor scale: the shard's, which is the whole parameter's
        # (qtensor.nn.distributed keeps it on every shard: at fully_shard and at each step)
        return (data,), (self.fmt, self.mm_fmt, self._accum, self.tensor_scale)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The unsharded parameter: the gathered payloads as they were sent (no rounding: they
        are in format), with the formats and tensor scale. With ``out`` (every all-gather after
        the first) FSDP2 has gathered into the same storage again: out holds the new values
        already, and takes the scale they have now (a step changes it)."""
        fmt, mm_fmt, accum, tscale = metadata
        if out is not None:
            out._tscale = tscale
            return None
        (data,) = all_gather_outputs
        t = QTensor._wrap(data, fmt, mm_fmt, accum=accum)
        t._tscale = tscale
        return t, (data,)

    # -- serialization -------------------------------------------------------------------------
    def __reduce_ex__(self, protocol):
        # the accumulator as a dict of its fields (plain values: loadable with weights_only)
        accum = None if self.accum is None else dataclasses.asdict(self.accum)
        ts = self.tensor_scale
        return (_rebuild_qtensor,
                (self._data, str(self.fmt), None if self.mm_fmt is None else str(self.mm_fmt),
                 self.requires_grad, bool(getattr(self, "_is_param", False)), accum)
                + (() if ts is None else (float(ts),)))

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        if not self.is_leaf:
            raise RuntimeError(
                "Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
                "protocol at the moment")
        with torch.no_grad():
            data = copy.deepcopy(self._data, memo)
        new = QTensor._wrap(data, self.fmt, self.mm_fmt, requires_grad=self.requires_grad,
                            accum=self.accum)
        new._tscale = self._tscale
        new._shard = self._shard  # (a copy of a shard is one of the same sharding)
        if getattr(self, "_is_param", False):
            new._is_param = True
        memo[id(self)] = new
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        return new


@torch._disable_dynamo
def _dispatch_outside_dynamo(func, args, kwargs):
    """QTensor.__torch_dispatch__ where dynamo's frame callback is set."""
    if torch.compiler.is_compiling():
        _check_accum_not_set_while_tracing(func, args, kwargs)
    return _dispatch.dispatch(func, args, kwargs, QTensor)


# dynamo runs this frame as it is (its callees: see the method)
if not _shims.dynamo_skips(QTensor.__torch_dispatch__.__func__.__code__):
    QTensor.__torch_dispatch__ = classmethod(torch._disable_dynamo(
        QTensor.__torch_dispatch__.__func__))


# A module whose QTensor parameters FSDP2 shards may hold, under this attribute, a hook that
# fsdp_pre_all_gather calls with (sharded QTensor, module) before each all-gather: whoever
# converted the module puts it there (qtensor.nn.distributed.remember_plan, which sits above
# this module: it finds the sharded parameter and its plan, and rounds its reduced gradient).
FSDP_HOOK_ATTR = "_qt_on_fsdp_all_gather"


def _check_fsdp_policy(mp_policy, t) -> None:
    if mp_policy is None:
        return
    pd, rd = getattr(mp_policy, "param_dtype", None), getattr(mp_policy, "reduce_dtype", None)
    if pd is not None and pd != t.dtype:
        raise TypeError(
            f"fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype={pd})) on a converted "
            f"model: its parameters carry their number formats (here {t.fmt}); a param_dtype "
            "would cast them. Leave param_dtype=None: the recipe's formats are the precision")
    if rd is not None and rd != torch.float32:
        raise TypeError(
            f"fully_shard(mp_policy=MixedPrecisionPolicy(reduce_dtype={rd})) on a converted "
            "model: gradients are reduced in FP32 and rounded once to their format "
            "(docs/distributed.md); leave reduce_dtype=None or torch.float32")


def _rebuild_qtensor(data, fmt, mm_fmt, requires_grad, is_param=False, accum=None,
                     tensor_scale=None):
    """A QTensor from its pickled form (torch.load, pickle, copy.copy): what a file holds is
    checked, as qt.load_safetensors checks it (a ValueError, never a QTensor whose payload is
    not in its format)."""
    what = f"unpickling a QTensor (torch.load) of format {short_repr(str(fmt))}"
    if not isinstance(data, torch.Tensor):
        raise ValueError(f"{what}: its payload is a {type(data).__name__}, not a tensor")
    if accum is not None:
        if not isinstance(accum, dict):
            raise ValueError(f"{what}: its accumulator is a {type(accum).__name__}, not a dict")
        try:
            accum = AccumFormat(**accum)
        except TypeError as e:  # a field unknown or missing
            raise AccumFormatError(f"{what}: {e}") from None
    try:
        t = QTensor(data, fmt, mm_fmt, requires_grad=requires_grad, accum=accum,
                    tensor_scale=tensor_scale)
    except TypeError as e:  # (a payload dtype that carries no format)
        raise ValueError(f"{what}: {e}") from None
    # (values only: not a fake or meta payload, nor while tracing)
    if (type(data) is torch.Tensor and data.device.type != "meta"
            and not torch.compiler.is_compiling()
            and (off := _ops.count_off_format(data, t.fmt, t._tscale))):
        raise ValueError(f"{what}: {off} of {data.numel()} payload values are not values of "
                         f"{t.fmt} (the file was changed after saving?)")
    if is_param:
        t._is_param = True
    return t


def _check_accum_not_set_while_tracing(func, args, kwargs) -> None:
    """Make dynamo run ``func`` outside the graph (a graph break; an error under fullgraph=True
    or torch.export(strict=True)) when one of its QTensors had ``.accum`` assigned by the code being traced:
    the graph would compute with the accumulator the tensor had before, silently."""
    pending = _shims.attributes_set_while_tracing("accum")
    if not pending:
        return
    for a in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(a, QTensor) and id(a) in pending:
            break
    else:
        return
    before = a.accum or "none, FP32 accumulation"
    msg = (f"QTensor.accum was set inside code that torch.compile is tracing, and the tensor is "
           f"then used there ({func}): the graph cannot see the new accumulator (it would sum "
           f"with the previous one: {before}). Without fullgraph=True this op runs outside the "
           "graph (a graph break); with fullgraph=True or torch.export(strict=True) (the "
           "default, non-strict export records it), set .accum before the compiled call "
           "(Recipe(accumulate=...), or t.accum = ... outside it), or build the tensor with it "
           "inside: qt.QTensor(payload, fmt, mm_fmt, accum=...).")
    _shims.graph_break("QTensor.accum set inside compiled code, then used there", str(func), msg)
    raise NotImplementedError(msg)  # dynamo makes a graph break of it too


# ---------------------------------------------------------------------------------------------
# Differentiable construction

def _two_level(fmt) -> bool:
    return fmt is not None and fmt.is_two_level


def _payload_of(x: torch.Tensor) -> torch.Tensor:
    """x's values as a plain float32 (or float64) tensor."""
    if isinstance(x, QTensor):
        x = x._data
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.to(torch.float32)
    return x


def _accum_of(x: torch.Tensor):
    return x.accum if isinstance(x, QTensor) else None


_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def _grad_values(g: torch.Tensor) -> torch.Tensor:
    """A gradient's values as a plain tensor, in an autograd.Function's backward. Dynamo traces
    that backward for a guessed gradient, a QTensor where forward returned one, which is plain
    when run if the output was dequantized in the compiled code: there the values are taken by
    a view of the bits as integers (plain for a QTensor: its payload's) and back, which replays
    on either (g._data would fail on a plain one)."""
    if not isinstance(g, QTensor):
        return g
    if torch.compiler.is_compiling():
        return g.view(_BITS[g.element_size()]).view(g.dtype)
    return g._data


def grad_with_accum(g, accum):
    """The gradient ``g`` (rounded at a tensor that carries ``accum``) with that accumulator
    where it has none, so the contractions it meets further back sum with it (a plain
    gradient, or one rounded without it, would make them accumulate in FP32 when their other
    operand, e.g. the model's input, carries none either). An alias of g's payload, not g."""
    if accum is None or not isinstance(g, QTensor) or g.accum is not None:
        return g
    return QTensor._wrap(g._data, g.fmt, g.mm_fmt, accum=accum)


class _AsQTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fmt, mm_fmt, rounding, tensor_scale=None):
        ctx.plain = not isinstance(x, QTensor)
        ctx.dtype = x.dtype
        if _two_level(fmt):
            q, s = _ops.quantize_with_scale(_payload_of(x).detach(), fmt, rounding=rounding,
                                            tensor_scale=tensor_scale)
            t = QTensor._wrap(q, fmt, mm_fmt, accum=_accum_of(x))
            t._tscale = s
            return t
        q = _ops.quantize(_payload_of(x).detach(), fmt, rounding=rounding)
        return QTensor._wrap(q, fmt, mm_fmt, accum=_accum_of(x))

    @staticmethod
    def backward(ctx, g):
        # straight through; a plain input gets a plain gradient of its own dtype
        if ctx.plain:
            g = _grad_values(g)
        if g.dtype != ctx.dtype and not isinstance(g, QTensor):
            g = g.to(ctx.dtype)
        return g, None, None, None, None


class _QuantizeGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fmt, mm_fmt, rounding):
        ctx.fmt, ctx.mm_fmt, ctx.rounding = fmt, mm_fmt, rounding
        ctx.accum = _accum_of(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        q = _ops.quantize(_payload_of(_grad_values(g)), ctx.fmt, rounding=ctx.rounding)
        q = QTensor._wrap(q, ctx.fmt, ctx.mm_fmt, accum=_accum_of(g) or ctx.accum)
        return q, None, None, None


class _Dequantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x._data.view_as(x._data)

    @staticmethod
    def backward(ctx, g):
        return g


def as_qtensor(x: torch.Tensor, fmt, *, mm_fmt=None, rounding: Optional[str] = None,
               tensor_scale=None) -> QTensor:
    """x rounded to ``fmt`` (a format or its name) and wrapped as a QTensor.

    Differentiable with a straight-through gradient (the gradient passes unchanged; a plain
    input gets a plain gradient). A QTensor input is re-rounded from its values to the new fmt
    and keeps its accumulator (``.accum``).
    ``mm_fmt``: the operand format for contractions (see :mod:`qtensor.tensor.dispatch`).
    ``rounding`` overrides fmt's rounding mode for this rounding only; later ops round with
    fmt's own mode (put it in the format, e.g. ``"bf16(rounding=stochastic)"``, to change it).
    bfloat16/float16 inputs get a float32 payload; float64 inputs keep float64.
    ``tensor_scale`` (two-level formats such as nvfp4): round under this FP32 decode tensor
    scale instead of the one Transformer Engine's rule derives from x's amax.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"as_qtensor expects a torch.Tensor, got {type(x).__name__}")
    fmt = _parse(fmt)
    if fmt is None:
        raise TypeError("as_qtensor needs a format")
    mm_fmt = _parse(mm_fmt)
    _check_floating(x, fmt)
    refuse_transformed(x)
    if tensor_scale is not None and not _two_level(fmt):
        raise ValueError(f"as_qtensor: {fmt} has no tensor scale (only two-level block formats "
                         "such as nvfp4)")
    if torch.is_grad_enabled() and x.requires_grad:
        return _AsQTensor.apply(x, fmt, mm_fmt, rounding, tensor_scale)
    return _AsQTensor.forward(_NoCtx(), x, fmt, mm_fmt, rounding, tensor_scale)


class _NoCtx:
    """_AsQTensor.forward's ctx outside autograd (it only stores attributes)."""


def quantize_grad(x: torch.Tensor, fmt, *, mm_fmt=None, rounding: Optional[str] = None):
    """Identity in forward; in backward the incoming gradient is rounded to ``fmt`` and becomes
    a QTensor(fmt, mm_fmt). Works on plain tensors and QTensors. The rounded gradient keeps the
    incoming gradient's accumulator (``.accum``), else takes x's: the contractions it meets
    further back sum their products with it."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize_grad expects a torch.Tensor, got {type(x).__name__}")
    fmt = _parse(fmt)
    mm_fmt = _parse(mm_fmt)
    _check_floating(x, fmt)
    refuse_transformed(x)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return x
    return _QuantizeGrad.apply(x, fmt, mm_fmt, rounding)


# torch.load(weights_only=True) may rebuild QTensors.
torch.serialization.add_safe_globals(
    [QTensor, _rebuild_qtensor, *FORMAT_CLASSES,
     # the names checkpoints saved before the package layout give them
     (QTensor, "qtensor.tensor.QTensor"), (_rebuild_qtensor, "qtensor.tensor._rebuild_qtensor"),
     *((cls, f"qtensor.formats.{cls.__name__}") for cls in FORMAT_CLASSES)])

"""Every reach of qtensor into torch internals, in one place: the QTensor subclass's, and the
private torch.distributed functions that qtensor.nn.distributed wraps.

Each shim says which torch version it was written for and what torch code it relies on or
replaces (``TARGETS``: one line per name). ``tests/tensor/test_shims.py`` checks, shim by shim,
that torch still has what the shim relies on (the function it wraps, its signature or source,
the attributes it reads), and fails naming the shim when a torch upgrade changed it. Where an
internal is missing the shims degrade to what torch does without them (noted per shim), so an
unknown torch loses a convenience, never a value.

This module imports no qtensor module: whatever a shim needs of the subclass (the class, its
constructor, an error) is passed in by ``qtensor.tensor.subclass``, and what the distributed
wrappers do with QTensors by ``qtensor.nn.distributed``.
"""
from __future__ import annotations

import functools
import sys
import threading

import torch

__all__ = ["TARGET", "TARGETS", "TENSOR_DATA", "make_wrapper_subclass", "compiler",
           "is_functorch_wrapped", "eval_frame_callback", "dynamo_skips", "called_by_describe_tensor",
           "mark_exportable_init", "dynamo_loaded",
           "register_dynamo_constants", "accept_zero_tangents",
           "flattening_program_output", "attributes_set_while_tracing", "graph_break",
           "RunningSteps",
           "wrap_broadcast_coalesced", "wrap_fsdp_shard_builders", "wrap_dcp_commit_tensor",
           "handle_dtensor_ops"]

TARGET = "2.13"  # the torch version every shim here was written and tested for

# name -> what it relies on in torch (the constants have no docstring of their own)
TARGETS = {
    "TENSOR_DATA": "torch 2.13: torch._C.TensorBase.data, the C getter/setter of Tensor.data "
                   "(QTensor.data overrides the property and calls it for the wrapper)",
    "make_wrapper_subclass": "torch 2.13: torch.Tensor._make_wrapper_subclass's positional order "
                             "(size, strides, storage_offset, memory_format, dtype, layout, "
                             "device), which parses faster than keywords on dispatch's fast path",
    "compiler": "torch 2.13: torch.compiler._is_compiling_flag / _is_exporting_flag, what "
                "is_compiling() / is_exporting() return eagerly (read as attributes: per op)",
    "is_functorch_wrapped": "torch 2.13: torch._C._functorch.is_functorch_wrapped_tensor (a "
                            "torch.func transform's wrapper tensor)",
    "eval_frame_callback": "torch 2.13: torch._C._dynamo.eval_frame.get_eval_frame_callback "
                           "(None: no compiled region on the stack); None where torch lacks it",
    "RunningSteps": "torch 2.13: torch.optim.Optimizer.profile_hook_step's wrapper, the frame "
                    "that runs a step between its pre- and post-step hooks (its code object, "
                    "shared by every optimizer class); else the frame that calls the hooks",
}


TENSOR_DATA = torch._C.TensorBase.data
make_wrapper_subclass = torch.Tensor._make_wrapper_subclass
compiler = torch.compiler
is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor

try:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as eval_frame_callback
    from torch._dynamo.eval_frame import skip_code as _skip_code
except ImportError:  # another torch: every op goes through torch._disable_dynamo
    eval_frame_callback = _skip_code = None


def dynamo_skips(code) -> bool:
    """torch 2.13: ``torch._dynamo.eval_frame.skip_code``. Make dynamo run the frames of
    ``code`` as they are, without tracing them (their callees are traced as usual); replaces
    wrapping the function in ``torch._disable_dynamo`` (several microseconds per call). False
    where torch has no such hook: the caller then wraps."""
    if _skip_code is None or eval_frame_callback is None:
        return False
    _skip_code(code)
    return True


try:  # where torch describes a tensor to make a fake one of it
    from torch._subclasses.meta_utils import MetaTensorDescriber
    _DESCRIBE_TENSOR = MetaTensorDescriber.describe_tensor.__code__
except (ImportError, AttributeError):
    _DESCRIBE_TENSOR = None


def called_by_describe_tensor(levels: int) -> bool:
    """torch 2.13: ``torch._subclasses.meta_utils.MetaTensorDescriber.describe_tensor`` calls
    ``t.untyped_storage()`` itself. Whether the frame ``levels`` above the caller of this
    function is that method (``sys._getframe``): QTensor.untyped_storage then gives the
    wrapper's own storage, which the fake tensor must describe. False on a torch without it."""
    return _DESCRIBE_TENSOR is not None and sys._getframe(levels + 1).f_code is _DESCRIBE_TENSOR


def mark_exportable_init(init):
    """torch 2.13: ``torch._export.wrappers.mark_subclass_constructor_exportable_experimental``.
    ``init`` (a function named ``__init__``) decorated so that torch.export records the
    subclass's construction in the graph it traces (it cannot follow a tensor subclass built in
    the traced code). ``init`` itself on an older torch: export then fails where a QTensor is
    built inside the model."""
    try:
        from torch._export.wrappers import mark_subclass_constructor_exportable_experimental
    except ImportError:
        return init
    return mark_subclass_constructor_exportable_experimental(init)


def dynamo_loaded() -> bool:
    """torch 2.13: ``torch._dynamo.variables.builder``, the module of dynamo's tracker table, is
    imported once dynamo is (nothing to extend before: importing it would load dynamo)."""
    return "torch._dynamo.variables.builder" in sys.modules


def register_dynamo_constants(classes) -> bool:
    """torch 2.13: ``torch._dynamo.variables.builder.SourcelessBuilder._type_handlers`` (a dict
    type -> handler) and ``torch._dynamo.variables.user_defined.FrozenDataClassVariable``. Let
    dynamo build trackers for values of ``classes`` (frozen dataclasses: formats, accumulators)
    that have no source, as constants, so compiled code can read ``t.fmt`` of a QTensor it
    computed and return formats; torch itself knows only its own types there. False (nothing
    done: a graph break where such a value is met) on a torch without them."""
    try:
        from torch._dynamo.variables.builder import SourcelessBuilder
        from torch._dynamo.variables.user_defined import FrozenDataClassVariable
        handlers = SourcelessBuilder._type_handlers
    except (ImportError, AttributeError):
        return False

    class FormatVariable(FrozenDataClassVariable):
        """A format (an immutable value) is its own constant: the compiled code may return
        it (dynamo rebuilds only pytree specs from a frozen dataclass's fields)."""

        def as_python_constant(self):
            return self.value

    for cls in classes:
        handlers.setdefault(cls, lambda tx, value: FormatVariable(value))
    return True


def accept_zero_tangents(cls, wrap, plain_tangent_error) -> bool:
    """torch 2.13: replaces the staticmethod
    ``torch._functorch._aot_autograd.runtime_wrappers.AOTDispatchAutograd.process_runtime_tangent``
    (x, meta, tangent_idx, ...), reading ``SubclassCreationMeta.original_subclass_type`` and
    ``.meta`` (what ``cls.__tensor_flatten__`` returned: (fmt, mm_fmt, accum)).

    A compiled graph's ``cls`` output that gets no gradient gets the plain zeros autograd makes
    for it, which AOTAutograd refuses ("Expected a QTensor tangent but got a plain Tensor"):
    zeros become ``wrap(zeros, fmt, mm_fmt, accum)`` (zeros are zeros in every format); any
    other plain tangent raises ``plain_tangent_error(fmt, tangent index)``. False (torch's
    error stays) on a torch without it."""
    try:
        from torch._functorch._aot_autograd.runtime_wrappers import AOTDispatchAutograd
        from torch._functorch._aot_autograd.schemas import SubclassCreationMeta
        process = AOTDispatchAutograd.process_runtime_tangent
    except (ImportError, AttributeError):
        return False

    def process_runtime_tangent(x, meta, *args, **kwargs):
        if (type(x) is torch.Tensor and isinstance(meta, SubclassCreationMeta)
                and meta.original_subclass_type is cls):
            if x.any():
                raise plain_tangent_error(meta.meta[0], args[0] if args else
                                          kwargs.get("tangent_idx"))
            fmt, mm_fmt, accum = meta.meta
            x = wrap(x, fmt, mm_fmt, accum)
        return process(x, meta, *args, **kwargs)

    AOTDispatchAutograd.process_runtime_tangent = staticmethod(process_runtime_tangent)
    return True


def flattening_program_output(levels: int) -> bool:
    """torch 2.13: ``torch._functorch._aot_autograd.subclass_utils``'s inner
    ``flatten_subclass(t, desc, *, out)`` calls ``t.__tensor_flatten__()`` itself, with ``desc``
    an ``AOTOutput`` for a traced program's outputs. Whether the frame ``levels`` above the
    caller of this function is that one (``sys._getframe``): ``ep.run_decompositions()``
    flattening an output. False on a torch without ``AOTOutput`` (nothing is checked)."""
    try:
        from torch._functorch._aot_autograd.descriptors import AOTOutput
    except ImportError:
        return False
    frame = sys._getframe(levels + 1)
    return frame.f_code.co_name == "flatten_subclass" and isinstance(
        frame.f_locals.get("desc"), AOTOutput)


def attributes_set_while_tracing(name: str) -> set:
    """torch 2.13: ``torch._dynamo.symbolic_convert.InstructionTranslator.current_tx()``, its
    ``output.side_effects.store_attr_mutations`` ({variable: {attribute: value}}) and each
    variable's ``as_proxy().node.meta["example_value"]``. The ids of the example values (what
    dynamo runs ops on while it traces) whose attribute ``name`` the traced code assigned:
    dynamo applies such an assignment after the graph, so ops in the graph see the old value.
    Empty when dynamo is not tracing, or on a torch whose dynamo differs (nothing is checked)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        tx = InstructionTranslator.current_tx()
        mutations = tx.output.side_effects.store_attr_mutations if tx is not None else {}
    except (ImportError, AttributeError):
        return set()
    ids = set()
    for var, attrs in mutations.items():
        if name in attrs:
            try:
                ids.add(id(var.as_proxy().node.meta["example_value"]))
            except (AttributeError, KeyError, NotImplementedError):
                pass
    return ids


def graph_break(gb_type: str, context: str, explanation: str) -> None:
    """torch 2.13: ``torch._dynamo.exc.unimplemented(*, gb_type, context, explanation, hints)``.
    Make dynamo run the current op outside the graph (a graph break; an error under
    fullgraph=True), explaining why. Returns on a torch without it: the caller then raises
    NotImplementedError, which dynamo also turns into a graph break."""
    try:
        from torch._dynamo.exc import unimplemented
    except ImportError:
        return
    unimplemented(gb_type=gb_type, context=context, explanation=explanation, hints=[])


def _step_wrapper_code():
    try:
        return torch.optim.Optimizer.profile_hook_step(lambda: None).__code__
    except (AttributeError, TypeError):
        return None


_STEP_WRAPPER = _step_wrapper_code()


def _step_frame(frame):
    """The frame of the optimizer step that ``frame`` (a step hook's caller) runs in."""
    f = frame
    while f is not None and f.f_code is not _STEP_WRAPPER:
        f = f.f_back
    return frame if f is None else f


class RunningSteps:
    """The optimizer steps running in this thread, as seen from their step hooks: ``enter`` in a
    pre-step hook, ``exit`` in a post-step hook, ``active()`` anywhere. A step that raises
    skips its post-step hooks, so a flag or a counter would stay set; each step is instead
    tied to the frame of torch's step wrapper (``_STEP_WRAPPER``), and a step whose frame has
    left the stack has ended. Nested steps (a wrapper optimizer stepping another) stack."""

    def __init__(self):
        self._tls = threading.local()

    def _frames(self) -> list:
        frames = getattr(self._tls, "frames", None)
        if frames is None:
            frames = self._tls.frames = []
        return frames

    def enter(self, levels: int = 1) -> None:
        """Called by a pre-step hook ``levels`` frames below torch's hook loop."""
        self.active()  # (drops the steps that raised)
        self._frames().append(_step_frame(sys._getframe(levels + 1)))

    def exit(self, levels: int = 1) -> None:
        """Called by a post-step hook: this step ends, and any step it ran that raised."""
        frames, frame = self._frames(), _step_frame(sys._getframe(levels + 1))
        for i in range(len(frames) - 1, -1, -1):
            if frames[i] is frame:
                del frames[i:]
                return

    def active(self) -> bool:
        """Whether an optimizer step is running in this thread."""
        frames = getattr(self._tls, "frames", None)
        while frames:
            top, f = frames[-1], sys._getframe(1)
            while f is not None and f is not top:
                f = f.f_back
            if f is not None:
                return True
            frames.pop()  # a step that raised: its frame has left the stack
        return False


# ---------------------------------------------------------------------------------------------
# torch.distributed's private functions (qtensor.nn.distributed passes in what to do)

def _wrap_once(owner, name, wrap) -> bool:
    """``owner.name`` replaced by ``wrap(owner.name)``, unless it is that already (the wrappers
    carry ``_qtensor_wrapped``). False where owner has no such attribute."""
    method = getattr(owner, name, None)
    if method is None:
        return False
    if not getattr(method, "_qtensor_wrapped", False):
        wrapper = wrap(method)
        wrapper._qtensor_wrapped = True
        setattr(owner, name, wrapper)
    return True


def wrap_broadcast_coalesced(tensors_to_send) -> bool:
    """torch 2.13: ``torch.distributed._broadcast_coalesced(process_group, tensors, buffer_size,
    src)``, which DDP (its start-up broadcast of rank 0's parameters and buffers, the buffers at
    each forward), ``torch.distributed.utils`` and DCP's ``broadcast_from_rank0`` look up on
    ``torch.distributed`` at each call. Replaced by a wrapper that broadcasts
    ``tensors_to_send(tensors)`` instead (None: the tensors as they are). False where torch has
    no distributed package or no such function (the broadcast is torch's own)."""
    dist = torch.distributed
    if not dist.is_available():
        return False

    def wrap(broadcast):
        @functools.wraps(broadcast)
        def wrapper(process_group, tensors, *args, **kwargs):
            send = tensors_to_send(tensors)
            return broadcast(process_group, tensors if send is None else send, *args, **kwargs)
        wrapper._qtensor_payloads = True
        return wrapper
    return _wrap_once(dist, "_broadcast_coalesced", wrap)


def wrap_fsdp_shard_builders(scale_of, give_scale) -> bool:
    """torch 2.13: the private ``torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam``'s
    ``_init_sharded_param(self, param, ...)`` and ``reset_sharded_param(self)``, which (re)build
    the sharded parameter's local tensor (``self.sharded_param._local_tensor``, and FSDP2's flat
    view of it, ``self._sharded_param_data``) from zeros of the padded shard's size, a copy of
    this rank's chunk of the parameter (``param``; for the reset, the module's,
    ``getattr(self._module_info.module, self._module_info.param_name)``) and a view of it. Each
    wrapped: ``scale = scale_of(that parameter)`` before it, then, unless None,
    ``give_scale(t, scale, self.sharded_param)`` for both local tensors. False without FSDP2
    (nothing wrapped)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    except ImportError:  # torch built without distributed
        return False

    def keeping(source):
        def wrap(method):
            @functools.wraps(method)
            def wrapper(self, *args, **kwargs):
                scale = scale_of(source(self, *args, **kwargs))
                out = method(self, *args, **kwargs)
                if scale is not None:
                    for t in (self.sharded_param._local_tensor, self._sharded_param_data):
                        give_scale(t, scale, self.sharded_param)
                return out
            wrapper._qtensor_scales = True
            return wrapper
        return wrap
    found = _wrap_once(FSDPParam, "_init_sharded_param",
                       keeping(lambda self, param, *a, **k: param))
    return _wrap_once(FSDPParam, "reset_sharded_param", keeping(
        lambda self: getattr(self._module_info.module, self._module_info.param_name, None))
    ) and found


def wrap_dcp_commit_tensor(after_commit) -> bool:
    """torch 2.13: ``torch.distributed.checkpoint.default_planner.DefaultLoadPlanner
    .commit_tensor(self, read_item, tensor)``, called when DCP's load has copied the loaded
    values into ``tensor`` (``self.resolve_tensor(read_item).detach()``: a new alias of the state
    dict's tensor). Wrapped: after it, ``after_commit(dest, tensor)``, ``dest`` the state dict's
    own entry ``self.state_dict[read_item.dest_index.fqn]`` (a DTensor's ``_local_tensor``), or
    None. False without DCP (nothing wrapped)."""
    try:
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    except ImportError:
        return False

    def wrap(commit):
        @functools.wraps(commit)
        def wrapper(self, read_item, tensor):
            out = commit(self, read_item, tensor)
            dest = getattr(self, "state_dict", {}).get(read_item.dest_index.fqn)
            after_commit(getattr(dest, "_local_tensor", dest), tensor)
            return out
        wrapper._qtensor_scales = True
        return wrapper
    return _wrap_once(DefaultLoadPlanner, "commit_tensor", wrap)


def handle_dtensor_ops(ops, handle) -> bool:
    """torch 2.13: ``DTensor._op_dispatcher._custom_op_handlers``, the dict (op overload ->
    ``handler(op_call, args, kwargs)``) whose handlers DTensor's dispatch calls instead of its
    sharding propagation (loss_parallel and context parallel put theirs there). Each op of
    ``ops`` gets a handler that returns ``handle(op_call, args, kwargs)``; where that is
    NotImplemented, the op runs as without it (a handler that was there before, or DTensor's
    own propagation, with this handler out of the dict for the call). False without DTensor
    (nothing registered: the ops are DTensor's own)."""
    try:
        from torch.distributed.tensor import DTensor
        handlers = DTensor._op_dispatcher._custom_op_handlers
    except (ImportError, AttributeError):
        return False
    for op in ops:
        before = handlers.get(op)
        if getattr(before, "_qtensor_handler", False):
            continue

        def handler(op_call, args, kwargs, _before=before):
            out = handle(op_call, args, kwargs)
            if out is not NotImplemented:
                return out
            if _before is not None:
                return _before(op_call, args, kwargs)
            table = DTensor._op_dispatcher._custom_op_handlers
            mine = table.pop(op_call)
            try:
                return op_call(*args, **kwargs)
            finally:
                table[op_call] = mine
        handler._qtensor_handler = True
        handlers[op] = handler
    return True

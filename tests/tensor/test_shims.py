"""qtensor.tensor.shims: what each shim relies on in torch is still there.

Each test names the shim and the torch internal it reads; a torch upgrade that changes one fails
here with that name, before the behavioural tests (tests/integrations/test_compile*.py,
test_export.py, tests/tensor) fail somewhere far from the cause.
"""
import ast
import dataclasses
import inspect

import pytest
import torch
import torch._dynamo  # (AOTAutograd's runtime wrappers import dynamo: load it first)

import qtensor as qt
from qtensor.tensor import shims
from qtensor.tensor.subclass import QTensor


def _relies(ok, shim, what):
    assert ok, (f"qtensor.tensor.shims.{shim} (written for torch {shims.TARGET}) relies on {what}; "
                f"torch {torch.__version__} changed that: update the shim and its TARGETS/docstring")


def test_every_shim_names_the_torch_version_it_targets():
    for name in shims.__all__:
        if name in ("TARGET", "TARGETS"):
            continue
        obj = getattr(shims, name)
        doc = shims.TARGETS.get(name) if not inspect.isfunction(obj) else obj.__doc__
        assert doc and doc.startswith(f"torch {shims.TARGET}:"), (
            f"shims.{name} does not say which torch version it targets")
    # the subclass module itself reaches into no torch internal any more (code, not messages)
    tree = ast.parse(inspect.getsource(qt.tensor.subclass))
    used = {ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    used |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    internal = sorted(u for u in used if u.startswith(("sys._getframe", "torch._C", "torch._dynamo",
                                                       "torch._functorch", "torch._subclasses",
                                                       "torch._export"))
                      and u not in ("torch._C", "torch._C._disabled_torch_function_impl"))
    assert not internal, f"torch internals used outside qtensor.tensor.shims: {internal}"


def test_tensor_data_is_the_c_getter_setter():
    d = torch._C.TensorBase.__dict__.get("data")
    _relies(d is shims.TENSOR_DATA and hasattr(d, "__get__") and hasattr(d, "__set__"),
            "TENSOR_DATA", "torch._C.TensorBase.data being a C getter/setter")
    q = qt.as_qtensor(torch.randn(4), "bf16")
    q.data = torch.ones(4)  # QTensor.data's setter goes through it
    assert torch.equal(q.dequantize(), torch.ones(4))


def test_make_wrapper_subclass_positional_order():
    class W(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError
    base = torch.empty(40, dtype=torch.float64)
    data = base.as_strided((3, 4), (1, 5), 2)
    t = shims.make_wrapper_subclass(W, data.shape, data.stride(), data.storage_offset(), None,
                                    data.dtype, data.layout, data.device)
    got = (type(t), tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.layout, t.device)
    _relies(got == (W, (3, 4), (1, 5), 2, torch.float64, torch.strided, torch.device("cpu")),
            "make_wrapper_subclass", "_make_wrapper_subclass's positional order (size, strides, "
            "storage_offset, memory_format, dtype, layout, device)")


def test_compiler_flags_are_what_is_compiling_returns():
    src = inspect.getsource(torch.compiler.is_compiling) + inspect.getsource(
        torch.compiler.is_exporting)
    _relies(isinstance(getattr(shims.compiler, "_is_compiling_flag", None), bool)
            and isinstance(getattr(shims.compiler, "_is_exporting_flag", None), bool)
            and "_is_compiling_flag" in src and "_is_exporting_flag" in src,
            "compiler", "torch.compiler._is_compiling_flag/_is_exporting_flag behind "
            "is_compiling()/is_exporting()")


def test_is_functorch_wrapped_sees_a_transforms_wrapper():
    seen = []
    torch.func.grad(lambda x: (seen.append(shims.is_functorch_wrapped(x)), x.sum())[1])(
        torch.ones(2))
    _relies(seen == [True] and not shims.is_functorch_wrapped(torch.ones(2)),
            "is_functorch_wrapped", "torch._C._functorch.is_functorch_wrapped_tensor")


def test_dynamo_frame_hooks():
    from torch._dynamo import eval_frame
    _relies(shims.eval_frame_callback is not None and shims.eval_frame_callback() is None,
            "eval_frame_callback", "get_eval_frame_callback() (None outside compiled code)")
    _relies(list(inspect.signature(eval_frame.skip_code).parameters) == ["code"],
            "dynamo_skips", "torch._dynamo.eval_frame.skip_code(code)")


def test_describe_tensor_calls_untyped_storage_itself():
    from torch._subclasses.meta_utils import MetaTensorDescriber
    src = inspect.getsource(MetaTensorDescriber.describe_tensor)
    _relies("t.untyped_storage()" in src, "called_by_describe_tensor",
            "MetaTensorDescriber.describe_tensor calling t.untyped_storage() directly")
    q = qt.as_qtensor(torch.randn(3), "bf16")
    describer = MetaTensorDescriber()
    payload = describer.describe_tensor(q.payload)
    wrapper = describer.describe_tensor(q)  # the wrapper's own storage, not the payload's
    assert wrapper.storage.id != payload.storage.id
    assert describer.describe_tensor(q.payload).storage.id == payload.storage.id


def test_export_constructor_marker():
    from torch._export import wrappers
    _relies(hasattr(wrappers, "mark_subclass_constructor_exportable_experimental"),
            "mark_exportable_init", "torch._export.wrappers."
            "mark_subclass_constructor_exportable_experimental")


def test_dynamo_constant_table():
    from torch._dynamo.variables.builder import SourcelessBuilder
    from torch._dynamo.variables.user_defined import FrozenDataClassVariable
    _relies(isinstance(SourcelessBuilder.__dict__.get("_type_handlers"), dict)
            and "as_python_constant" in dir(FrozenDataClassVariable),
            "register_dynamo_constants", "SourcelessBuilder._type_handlers (a dict) and "
            "FrozenDataClassVariable")
    assert shims.dynamo_loaded()
    qt.as_qtensor(torch.ones(1), "bf16").__tensor_flatten__()  # (teaches dynamo)
    assert type(qt.bf16) in SourcelessBuilder._type_handlers


def test_process_runtime_tangent_replacement():
    from torch._functorch._aot_autograd import runtime_wrappers
    from torch._functorch._aot_autograd.schemas import SubclassCreationMeta
    qt.as_qtensor(torch.ones(1), "bf16").__tensor_flatten__()  # (installs the replacement)
    cls = runtime_wrappers.AOTDispatchAutograd
    ours = cls.__dict__["process_runtime_tangent"]
    _relies(isinstance(ours, staticmethod) and ours.__func__.__module__ == shims.__name__,
            "accept_zero_tangents", "AOTDispatchAutograd.process_runtime_tangent, a staticmethod")
    wrapped = inspect.getclosurevars(ours.__func__).nonlocals["process"]
    params = list(inspect.signature(wrapped).parameters)
    _relies(params[:3] == ["x", "meta", "tangent_idx"], "accept_zero_tangents",
            f"process_runtime_tangent(x, meta, tangent_idx, ...) (now {params})")
    fields = {f.name for f in dataclasses.fields(SubclassCreationMeta)}
    _relies({"original_subclass_type", "meta"} <= fields, "accept_zero_tangents",
            "SubclassCreationMeta.original_subclass_type and .meta")


def test_flatten_subclass_calls_tensor_flatten_with_an_output_descriptor():
    from torch._functorch._aot_autograd import subclass_utils
    from torch._functorch._aot_autograd.descriptors import AOTOutput  # noqa: F401
    src = inspect.getsource(subclass_utils)
    _relies("def flatten_subclass(\n        t: FxValue,\n        desc: AOTDescriptor," in src
            and "attrs, _ = t.__tensor_flatten__()" in src, "flattening_program_output",
            "subclass_utils's flatten_subclass(t, desc, ...) calling t.__tensor_flatten__()")


def test_dynamo_side_effects_and_graph_break():
    from torch._dynamo.exc import unimplemented
    from torch._dynamo.side_effects import SideEffects
    from torch._dynamo.symbolic_convert import InstructionTranslator
    from torch._dynamo.variables.base import VariableTracker
    _relies(isinstance(inspect.getattr_static(InstructionTranslator, "current_tx"), staticmethod)
            and hasattr(VariableTracker, "as_proxy")
            and "self.store_attr_mutations" in inspect.getsource(SideEffects.__init__),
            "attributes_set_while_tracing", "InstructionTranslator.current_tx(), "
            "SideEffects.store_attr_mutations and VariableTracker.as_proxy")
    assert shims.attributes_set_while_tracing("accum") == set()  # (not tracing)
    kw = inspect.signature(unimplemented).parameters
    _relies(all(kw[n].kind is inspect.Parameter.KEYWORD_ONLY
                for n in ("gb_type", "context", "explanation", "hints")),
            "graph_break", "torch._dynamo.exc.unimplemented(*, gb_type, context, explanation, "
            "hints)")


def test_cache_key_hook_is_still_called():
    from torch._functorch._aot_autograd import autograd_cache
    _relies("_stable_hash_for_caching" in inspect.getsource(autograd_cache),
            "(QTensor._stable_hash_for_caching)", "AOTAutograd's cache calling a subclass's "
            "_stable_hash_for_caching")
    assert QTensor._stable_hash_for_caching


@pytest.mark.parametrize("levels", [1])
def test_frame_levels_count_from_the_caller(levels):
    # the frame arithmetic of the sys._getframe shims: 0 is the shim, levels + 1 the target
    def inner():
        return shims.called_by_describe_tensor(levels)
    assert inner() is False


def test_optimizer_steps_run_their_hooks_in_the_step_wrapper():
    # RunningSteps ties a step to the frame of torch's step wrapper, the caller of its hooks
    import sys
    found = []
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    handle = opt.register_step_pre_hook(
        lambda *a: found.append(shims._step_frame(sys._getframe(1)).f_code))
    p.grad = torch.ones(2)
    opt.step()
    handle.remove()
    _relies(shims._STEP_WRAPPER is not None and found == [shims._STEP_WRAPPER], "RunningSteps",
            "torch.optim.Optimizer.profile_hook_step's wrapper calling the step hooks")

"""Where an op runs: the module tracker (forward), the tags the forward leaves on autograd nodes
so that backward ops are attributed to their module and source line, and the optimizer step."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn.modules.loss import _Loss
from torch.utils._pytree import tree_leaves

from ..nn.convert import conversion_of
from ..tensor.shims import RunningSteps
from ..tensor.subclass import QTensor
from .frames import LOSS_DATA, user_location
from .tensors import is_float, storage_key, target_position

TAG = "qtensor.leak_check"  # key of our entry in autograd nodes' metadata
TARGET_TAG = "qtensor.leak_check.targets"  # storage keys of a loss node's targets
_get_sequence_nr = torch._C._autograd._get_sequence_nr
_ACCUMULATE_NR = 2 ** 64 - 1  # AccumulateGrad nodes' sequence number


@dataclass(frozen=True)
class Context:
    """Where the current op runs."""

    module: str               # module path, "<backward of '...'>", or "" outside any module
    phase: str                # "forward" or "backward"
    converted: bool           # inside a converted model: checked for plain ops
    tag: Optional[tuple]      # backward: (module path, forward Location, converted)
    plain_act: bool = False   # a recipe leaves this module's activations in full precision
    targets: Optional[frozenset] = None  # in a loss's backward: its targets' storage keys


class _Root:
    """What we know about the outermost module of a forward call."""

    __slots__ = ("names", "converted", "plain_act")

    def __init__(self, names, converted, plain_act):
        self.names = names
        self.converted = converted
        self.plain_act = plain_act  # ids of modules whose activations a recipe leaves plain


class _Frame:
    __slots__ = ("module", "path", "root", "seq")

    def __init__(self, module, path, root, seq):
        self.module, self.path, self.root, self.seq = module, path, root, seq


def _named_state(root):
    yield from root.named_parameters(remove_duplicate=False)
    yield from root.named_buffers(remove_duplicate=False)


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
        conv = conversion_of(m)
        if conv is None:
            continue
        converted = True
        for mname, sub in m.named_modules():
            plan = conv.module_plans.get(mname)
            if plan is not None and plan.activation.full_precision:
                plain_act.add(id(sub))
        for name, t in _named_state(m):
            plan = conv.tensor_plans.get(name)
            if plan is not None and plan.value.full_precision and not isinstance(t, QTensor):
                deliberate.add(storage_key(t))
    for m in root.modules():
        if isinstance(m, _Loss):
            for t in m.buffers(recurse=False):
                if not isinstance(t, QTensor):
                    deliberate.add(storage_key(t))
    return converted, plain_act


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
        if TAG not in md:
            md[TAG] = (path, None, converted)
        todo.extend(n for n, _ in node.next_functions)


class Tracker:
    """The module stack of the forward (per thread), the optimizer step, and the autograd tags
    that carry a forward op's module and source line to its backward."""

    def __init__(self, exemptions):
        self.exemptions = exemptions  # filled with the names and deliberate storages of roots
        self.pending = []             # (output, tag, target key) to tag once it has a grad_fn
        self.steps = RunningSteps()   # the optimizer steps running
        self._tls = threading.local()

    def reset(self) -> None:
        self.pending = []
        self.steps = RunningSteps()
        self._tls = threading.local()

    @property
    def in_step(self) -> bool:
        """Inside optimizer.step() (not after a step that raised: RunningSteps)."""
        return self.steps.active()

    def _stack(self) -> list:
        s = getattr(self._tls, "stack", None)
        if s is None:
            s = self._tls.stack = []
        return s

    # -- modules ---------------------------------------------------------------------------------
    def pre_hook(self, module, args):
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
            ex = self.exemptions
            root = _Root(names, *_scan_root(module, ex.state_names, ex.deliberate_storage))
            path = ""
        stack.append(_Frame(module, path, root, _get_sequence_nr()))

    def post_hook(self, module, args, output):
        if self.pending:
            self.flush()
        stack = self._stack()
        # pop down to this module (robust to a module whose forward raised)
        for i in range(len(stack) - 1, -1, -1):
            if stack[i].module is module:
                fr = stack[i]
                del stack[i:]
                if fr.root.converted and torch.is_grad_enabled():
                    _tag_graph(output, fr.path, id(module) not in fr.root.plain_act, fr.seq)
                break

    def context(self) -> Context:
        """Where the current op runs: the autograd node's tag in backward, else the module."""
        node = torch._C._current_autograd_node()
        if node is not None:
            md = node.metadata
            tag = md.get(TAG)
            targets = md.get(TARGET_TAG)
            if tag is None:
                return Context("<backward>", "backward", False, None, targets=targets)
            # tag: (module path, forward location, converted: checked for plain ops)
            return Context(f"<backward of '{tag[0] or '<root>'}'>", "backward", tag[2], tag,
                           plain_act=not tag[2], targets=targets)
        stack = self._stack()
        if not stack:
            return Context("", "forward", False, None)
        top = stack[-1]
        converted = top.root.converted and id(top.module) not in top.root.plain_act
        return Context(top.path or "<root>", "forward", converted, None,
                       plain_act=top.root.converted and not converted)

    # -- backward attribution --------------------------------------------------------------------
    def flush(self) -> None:
        """Tag the autograd nodes of the last op's outputs with its module and source line
        (outputs get their grad_fn only after the dispatch mode returned)."""
        pending, self.pending = self.pending, []
        for t, tag, target in pending:
            gf = t.grad_fn
            if gf is not None:
                md = gf.metadata
                if tag is not None and TAG not in md:
                    md[TAG] = tag
                if target is not None:
                    md[TARGET_TAG] = md.get(TARGET_TAG, frozenset()) | {target}

    def record_targets(self, func, args, kwargs, outs):
        """A loss's target and class weights are data: remember them on the loss's autograd
        node so that its backward formula (``sigmoid(x) - target``, ``* pos_weight``) may use
        them too."""
        if target_position(func) is None:
            return
        for i, a in enumerate(func._schema.arguments):
            if a.name not in LOSS_DATA:
                continue
            t = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(t, torch.Tensor) and not isinstance(t, QTensor):
                key = storage_key(t)
                for _, o in outs:
                    self.pending.append((o, None, key))

    def record_tags(self, outs, module, frame):
        if not outs:
            return
        loc = None
        for _, t in outs:
            if is_float(t):
                if loc is None:
                    loc = user_location(frame)
                self.pending.append((t, (module if module != "<root>" else "", loc, True),
                                     None))

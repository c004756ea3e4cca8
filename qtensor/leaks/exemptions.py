"""Exemptions: the plain tensors that may meet QTensors (see the package docstring), and the
bookkeeping that finds them (names of state, constants torch or the user made, loss data,
values a recipe keeps in full precision, ``allow=``)."""
from __future__ import annotations

import fnmatch

from torch.utils.weak import WeakIdKeyDictionary

from ..tensor.subclass import QTensor
from .frames import LOSS_DATA, loss_data
from .tensors import is_float, storage_key, target_position


class Exemptions:
    def __init__(self, allow_tensors, allow_patterns):
        self.allow_tensors = list(allow_tensors)
        self.allow_patterns = list(allow_patterns)
        self.allow_storages = {storage_key(t) for t in self.allow_tensors}
        self.deliberate_storage = set()  # storages of state a recipe leaves in full precision
        self._new_tables()

    def forget(self) -> None:
        """Drop every reference to tensors (the allowed ones stay known by storage)."""
        self.allow_tensors = []
        self._new_tables()

    def _new_tables(self) -> None:
        self.user_made = WeakIdKeyDictionary()    # constants user code made in a converted model
        self.loss_made = WeakIdKeyDictionary()    # values a loss computed from its target only
        self.state_names = WeakIdKeyDictionary()  # param/buffer -> qualified name
        self.blessed = WeakIdKeyDictionary()      # torch-made constants in a converted model
        self.deliberate = WeakIdKeyDictionary()   # values a recipe leaves in full precision

    # -- allow= ----------------------------------------------------------------------------------
    def allowed(self, t) -> bool:
        if not self.allow_tensors and not self.allow_patterns:
            return False
        for a in self.allow_tensors:
            if a is t:
                return True
        if self.allow_storages and storage_key(t) in self.allow_storages:
            return True
        if self.allow_patterns:
            name = self.state_names.get(t)
            if name is not None and self.matches(name):
                return True
        return False

    def matches(self, text: str) -> bool:
        return any(fnmatch.fnmatchcase(text, p) for p in self.allow_patterns)

    def matches_name(self, name) -> bool:
        return bool(self.allow_patterns) and self.matches(name)

    # -- plain tensors meeting QTensors ------------------------------------------------------
    def exempt_plain(self, t, role, ev) -> bool:
        """A plain floating tensor that may meet QTensors in the op of event ``ev`` (the list:
        docs/leak_check.md, kind "mixed")."""
        if t.numel() == 0:
            return True  # no values (a KV cache started as torch.empty(b, 0, d)): none leaks
        if t.dim() == 0 and t not in self.state_names and t not in self.user_made:
            return True  # a scalar (a wrapped Python number, a 0-dim constant torch made)
        if role in LOSS_DATA and target_position(ev.func) is not None:
            return True  # a loss's target (data, like the model's inputs) and class weights
        if ev.ctx.targets is not None and (storage_key(t) in ev.ctx.targets
                                           or t in self.loss_made):
            return True  # the same, in the loss's backward (and what it computes from them)
        if t in self.blessed or self.is_deliberate(t):
            return True
        if ev.ctx.plain_act and t not in self.state_names:
            return True  # a recipe leaves this module's activations in full precision
        return self.allowed(t)

    def unbless(self, t) -> bool:
        """t (and every view of its memory) now holds values that are not torch's constant;
        whether it was one."""
        if t not in self.blessed:
            return False
        key = storage_key(t)
        for b in [b for b in self.blessed.keys() if storage_key(b) == key]:
            del self.blessed[b]
        return True

    def is_deliberate(self, t) -> bool:
        if t in self.deliberate:
            return True
        return bool(self.deliberate_storage) and storage_key(t) in self.deliberate_storage

    def propagate_deliberate(self, ins, outs):
        """Plain values computed only from tensors a recipe keeps plain are deliberate too
        (an optimizer's FP32 state made from an FP32 gradient)."""
        if not self.deliberate and not self.deliberate_storage:
            return
        for t in ins:
            if is_float(t) and not self.is_deliberate(t):
                return
        for _, t in outs:
            if is_float(t) and not isinstance(t, QTensor):
                self.deliberate[t] = True

    def propagate_backward_loss_data(self, ins, outs, targets):
        """In a loss's backward, plain values computed from its target and class weights only
        are its data too (binary_cross_entropy_with_logits' ``pos_weight * target``)."""
        found = False
        for t in ins:
            if not is_float(t) or t.dim() == 0:
                continue
            if t not in self.loss_made and storage_key(t) not in targets:
                return
            found = True
        if found:
            for _, t in outs:
                if is_float(t):
                    self.loss_made[t] = True

    def propagate_loss_data(self, ins, outs, frame):
        """Plain values a loss computes from its target and class weights only are its data
        too (cross_entropy's smoothed target: ``target * (1 - ls) + ls / C``)."""
        data = None
        found = False
        for t in ins:
            if not is_float(t) or t.dim() == 0:
                continue  # scalars
            if t not in self.loss_made:
                if data is None:
                    data = loss_data(frame) or frozenset()
                if storage_key(t) not in data:
                    return
            found = True
        if not found:
            return
        for _, t in outs:
            if is_float(t):
                self.loss_made[t] = True

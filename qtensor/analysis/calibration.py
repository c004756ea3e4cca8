"""The calibration data of qt.gptq and qt.error_diffusion: the batches, the inputs given layers
receive over them (as least-squares rows: :func:`qtensor.analysis.least_squares._columns`; as
the contraction rounds them, or as they arrive), and the order in which the layers first run.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch
from torch import nn

from ..nn.conversion import conversion_of, is_converted
from ..nn.plans import _plain, round_to
from ..kernels.backend import round_payload as _round, with_axis
from .least_squares import _columns, _fprop, _input_axis


def _batches(calib_inputs) -> List[tuple]:
    """calib_inputs: a tensor, a tuple of positional arguments, or a list of either."""
    if isinstance(calib_inputs, torch.Tensor):
        return [(calib_inputs,)]
    if isinstance(calib_inputs, tuple):
        return [calib_inputs]
    if isinstance(calib_inputs, list) and calib_inputs:
        return [b if isinstance(b, tuple) else (b,) for b in calib_inputs]
    raise TypeError("calib_inputs: a tensor, a tuple of the model's positional arguments, or a "
                    f"non-empty list of them, got {type(calib_inputs).__name__}")


class _Inputs:
    """Forward pre-hooks that record what given layers receive, over the calibration batches."""

    def __init__(self, model: nn.Module, names: Sequence[str], operand: bool):
        self.model, self.names, self.operand = model, list(names), operand
        self.seen: Dict[str, List[torch.Tensor]] = {n: [] for n in self.names}
        conv = conversion_of(model) if is_converted(model) else None
        self.root_plan = conv.module_plans.get("") if conv is not None else None

    def _hook(self, name, mod):
        def hook(m, args, kwargs):
            if not args or not isinstance(args[0], torch.Tensor):
                raise TypeError(f"qtensor.analysis.ptq: {name} was called without a tensor input")
            x = args[0].detach()
            if name == "" and self.root_plan is not None and not self.root_plan.plain \
                    and not self.root_plan.activation.full_precision:
                # the root's pre-hooks see its inputs before its converted forward rounds them
                x = round_to(x, self.root_plan.activation)
            mm = _fprop(m, x)[0]  # (as the forward GEMM rounds it: Recipe.gemm included)
            xv = _plain(x).float()
            if self.operand and mm is not None:  # the input as this contraction rounds it
                xv = _round(xv, with_axis(mm, _input_axis(m)), keep_layout=False)
            out_size = args[1] if len(args) > 1 else kwargs.get("output_size")  # ConvTranspose
            self.seen[name].append(_columns(m, xv, out_size))
        return hook

    def run(self, batches) -> Dict[str, torch.Tensor]:
        handles = [self.model.get_submodule(n).register_forward_pre_hook(self._hook(n, None),
                                                                         with_kwargs=True)
                   for n in self.names]
        try:
            with torch.no_grad():
                for args in batches:
                    self.model(*args)
        finally:
            for h in handles:
                h.remove()
        out = {}
        for n, xs in self.seen.items():
            if not xs:
                raise ValueError(f"qtensor.analysis.ptq: the layer {n} did not run on the calibration "
                                 "inputs; pass layers=[...] without it")
            out[n] = torch.cat(xs, dim=1)
        return out


def _execution_order(model, names, batches) -> Dict[str, int]:
    """The order in which the layers first run (the flows process a layer after those that
    feed it, on inputs that already carry their rounding)."""
    order: Dict[str, int] = {}

    def hook(name):
        def h(m, args):
            order.setdefault(name, len(order))
        return h

    handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    try:
        with torch.no_grad():
            model(*batches[0])
    finally:
        for h in handles:
            h.remove()
    missing = [n for n in names if n not in order]
    if missing:
        raise ValueError(f"qtensor.analysis.ptq: the layers {', '.join(missing)} did not run on the "
                         "calibration inputs; pass layers=[...] without them")
    return order

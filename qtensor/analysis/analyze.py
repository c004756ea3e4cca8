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

This module runs the analysis; its parts are modules of their own: the recording of the
converted run (:mod:`.recording`), the runs and their comparison (:mod:`.runs`), the GEMMs'
local errors (:mod:`.contractions`), the layers' plans and bits (:mod:`.layers`), the
one-layer runs (:mod:`.sensitivity`) and the report (:mod:`.report`).

Docs and examples: docs/analysis.md.
"""
from __future__ import annotations

import copy
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from ..tensor import flush_warnings
from ..nn.conversion import conversion_of
from ..nn.convert import convert, unconvert
from ..nn.plans import GEMMS, round_to
from ..nn.spec import as_recipe
from .contractions import CONTRACTIONS, contraction_errors
from .layers import _aliases, _layer_info, _layer_names, _layer_plans, _numel
from .recording import _Recorder, _is_operand_of_a_contraction
from .report import AnalysisReport
from .runs import _SameRandomness, _compare, _cosine, _default_loss, _optimizer_step, _run
from .sensitivity import convert_one_layer, gemm_part, sensitivity_rows
# (F401: constants this module had before its parts were modules of their own)
from .layers import COUNTABLE, ROLES  # noqa: F401
from .sensitivity import ROLE_GEMM_FIELDS  # noqa: F401

__all__ = ["analyze", "AnalysisReport", "CONTRACTIONS", "convert_one_layer", "gemm_part"]


def analyze(model: nn.Module, inputs, spec=None, loss_fn: Optional[Callable] = None, *,
            sensitivity: bool = True, roles: bool = False, layers: Optional[List[str]] = None,
            progress: bool = False, optimizer: Optional[Callable] = None) -> AnalysisReport:
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


def _analyze(base, inputs, recipe, loss_fn, sensitivity, roles, layers,
             progress, optimizer=None) -> AnalysisReport:
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
            recorder.contraction_operands(n, m, seen[n], n in conv.gemms)

    grads = [{"parameter": n, "grad_cos": _cosine(ref["grads"], full["grads"], [n])}
             for n in ref["grads"] if ref["grads"][n] is not None]
    aliases = _aliases(base)
    infos = [_layer_info(base, conv, n, out_numel.get(n, 0), conv_model, aliases) for n in listed]
    plans = {n: _layer_plans(conv, n, base, aliases) for n in listed}
    sens = []
    if sensitivity:
        sens = sensitivity_rows(base, recipe, conv, plans, layers if layers is not None
                                else all_layers, roles, ref, inputs, loss_fn, same, progress)
    return AnalysisReport(
        spec=recipe.name or recipe.describe().splitlines()[0], loss_fp32=ref["loss"],
        overall=_compare(ref, full), tensors=[s.row() for s in recorder.stats.values()
                                              if _is_operand_of_a_contraction(s, base)],
        contractions=contractions, backward=backward, sensitivity=sens, gradients=grads,
        layers=infos, recipe=recipe, plans=plans)

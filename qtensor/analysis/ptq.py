"""Post-training quantization of a trained model's weights from a calibration batch.

``qt.gptq(model, calib_inputs, spec)`` and ``qt.error_diffusion(model, calib_inputs, spec)``
convert ``model`` in place with ``spec`` (a format F means ``qt.recipes.direct_cast(F)``: the
weights and activations enter every contraction in F, FP32 elsewhere; a ``qt.Recipe`` is used as
given) and replace the weight of every ``nn.Linear``, ``nn.Conv1d/2d/3d`` and
``nn.ConvTranspose1d/2d/3d`` whose contraction rounds it by values chosen to keep the layer's
output on the calibration data, layer after layer in the order they run. This module is that
flow; its parts are modules of their own:

- :mod:`.gptq`: GPTQ (Frantar et al. 2022, arXiv 2210.17323) on one weight matrix;
- :mod:`.error_diffusion`: error diffusion (after Khodamoradi et al. 2024, arXiv 2410.11203);
- :mod:`.weight_grid`: how a weight rounds one column at a time, block scales included;
- :mod:`.least_squares`: a layer as least-squares problems (a convolution's patches, its
  groups, a transposed convolution as a forward one);
- :mod:`.calibration`: the batches, the layers' inputs over them and the order the layers run.

Block formats (MX, NVFP4, any ``BlockFormat``): the blocks of a weight lie along its reduction
axis as the contraction rounds it (``in_features`` of a Linear; the input channels of a Conv at
each kernel position), and the columns are processed in that order; the result is in the format
(re-rounding it is the identity, checked before it is written). A grouped transposed convolution
whose blocks would span two groups is left in direct cast. ``nn.Embedding`` is not processed:
its lookup is a product with one-hot rows, whose Hessian is diagonal (the token counts), so that
both flows would round each weight to nearest, its direct cast (GPTQ would also zero the rows of
tokens absent from the calibration data).
"""
from __future__ import annotations

import copy
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..nn.conversion import is_converted
from ..nn.convert import convert, unconvert
from ..kernels.backend import round_payload as _round, with_axis
from ..formats.base import Format
from ..nn.plans import Recipe, _plain
from ..nn.recipes import direct_cast
from ..kernels.reference import block_scale, round_with_scale, scale_amax
from ..tensor.subclass import QTensor
from .calibration import _Inputs, _batches, _execution_order
from .error_diffusion import _diffusion_matrix
from .gptq import _gptq_matrix
from .least_squares import (_CONVS, _TRANSPOSED, _flat_weight, _fprop, _unflatten_weight,
                            _weight_axis)
from .weight_grid import _Grid, weight_groups

__all__ = ["gptq", "error_diffusion", "weight_groups", "LAYERS"]


LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
          nn.ConvTranspose3d)


def _check_layer(name: str, mod: nn.Module, fmt: Optional[Format]) -> Optional[str]:
    """Why this layer cannot be processed (None if it can)."""
    t = _fprop(mod)[2]
    if t is not None and fmt is not None:
        return (f"{name}: its forward GEMM rounds W after a transform ({t}, Recipe.gemm): the "
                "values it rounds are not the weight's, and GPTQ and error diffusion round the "
                "weight itself")
    if isinstance(mod, _CONVS + _TRANSPOSED):
        if mod.padding_mode != "zeros":
            return f"{name}: padding_mode={mod.padding_mode!r} (only 'zeros')"
        if isinstance(mod.padding, str) and mod.padding != "valid":
            return f"{name}: padding={mod.padding!r} (give the padding as numbers)"
    if isinstance(mod, _TRANSPOSED) and mod.groups > 1 and fmt is not None \
            and fmt.is_block and fmt.axis is not None:
        # its weight (C, O/groups, *k) is blocked along C across the groups: a block that
        # straddles two groups holds the weights of two independent least-squares problems
        cg, bs = mod.in_channels // mod.groups, fmt.block_size or mod.in_channels
        if cg % bs:
            return (f"{name}: a grouped transposed convolution whose weight blocks of "
                    f"{bs} along its input channels span its groups ({cg} channels "
                    "each)")
    return None


def _recipe(spec) -> Recipe:
    return spec if isinstance(spec, Recipe) else direct_cast(spec)


def _weight_format(mod: nn.Module) -> Optional[Format]:
    """The format the layer's contraction gives its weight (None: FP32, nothing to do)."""
    w = mod.weight
    if not isinstance(w, QTensor):
        return None
    fmt = _fprop(mod)[1]
    fmt = fmt if fmt is not None else w.fmt
    if fmt.is_fp32:
        return None
    if fmt.is_block:
        fmt = with_axis(fmt, _weight_axis(mod) if fmt.axis is not None else None)
    return fmt


def _layers(model: nn.Module, layers, who: str) -> List[Tuple[str, nn.Module, Format]]:
    chosen, skipped = [], []
    names = None if layers is None else list(layers)
    for name, mod in model.named_modules():
        if names is not None and name not in names:
            continue
        if not isinstance(mod, LAYERS):
            if names is not None and isinstance(mod, nn.Embedding):
                raise ValueError(
                    f"{who}: {name} is an nn.Embedding: its lookup is not a contraction (its "
                    "input is one-hot, the Hessian diagonal), so GPTQ and error diffusion reduce "
                    "to rounding each weight to nearest, the direct cast it already has")
            if names is not None:
                raise ValueError(f"{who}: {name} is a {type(mod).__name__}, not one of "
                                 f"{', '.join(t.__name__ for t in LAYERS)}")
            continue
        fmt = _weight_format(mod)
        why = _check_layer(name, mod, fmt)
        if why is not None:
            if names is not None:
                raise ValueError(f"{who}: cannot process {why}")
            if fmt is not None:
                skipped.append(why)
            continue
        if fmt is not None:
            chosen.append((name, mod, fmt))
    if names is not None:
        missing = set(names) - {n for n, _ in model.named_modules()}
        if missing:
            raise ValueError(f"{who}: no layer named {', '.join(sorted(missing))}")
    if skipped:
        warnings.warn(f"{who}: left in direct cast: {'; '.join(skipped)}", stacklevel=3)
    owners: Dict[int, List[str]] = {}
    for n, m in model.named_modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(n)
    for name, mod, _ in chosen:
        others = [n for n in owners.get(id(mod.weight), []) if n != name]
        if others:  # tied weights (a language model's head and its token embedding, say)
            warnings.warn(f"{who}: {name}'s weight is shared with {', '.join(others)}: the "
                          f"values rounded for {name}'s contraction are written into it, and "
                          f"{', '.join(others)} use them too", stacklevel=3)
    return chosen


def _write(mod: nn.Module, name: str, flat: torch.Tensor, fmt: Format, who: str) -> None:
    w = mod.weight
    new = _unflatten_weight(mod, flat, w.shape).float()
    # in the format: the contraction's rounding of the new weight gives it back, bit for bit
    again = _round(new, fmt)
    if not torch.equal(again.view(torch.int32), new.view(torch.int32)):
        raise AssertionError(f"{who}: {name}'s rounded weight is not a fixed point of {fmt}; "
                             "please report this")
    with torch.no_grad():
        w.copy_(new)
    if not torch.equal(_plain(w).view(torch.int32), new.view(torch.int32)):
        raise ValueError(f"{who}: {name}'s weight is stored in {w.fmt}, which does not hold the "
                         f"values rounded to its contraction's format {fmt} (blocked along a "
                         "different axis?); store the weight in FP32 (qt.recipes.direct_cast) "
                         "or in the same blocking")


def _flow(model, calib_inputs, spec, layers, who, quantize_layer, need_fp32_inputs):
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who}: model must be an nn.Module, got {type(model).__name__}")
    if is_converted(model):
        raise ValueError(f"{who} needs the trained model before conversion (it converts it): "
                         "qt.unconvert(model) first")
    batches = _batches(calib_inputs)
    recipe = _recipe(spec)
    # calibration runs in eval mode (no dropout, BatchNorm on its running statistics, which
    # stay as they are); a call that fails leaves the model as it was: unconverted, its values
    saved = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        return _flow_eval(model, batches, recipe, layers, who, quantize_layer, need_fp32_inputs)
    except BaseException:
        if is_converted(model):
            unconvert(model)
        with torch.no_grad():
            for k, v in model.state_dict(keep_vars=True).items():
                if k in saved:
                    v.copy_(saved[k])
        raise
    finally:
        for m, training in modes:
            m.training = training


def _flow_eval(model, batches, recipe, layers, who, quantize_layer, need_fp32_inputs):
    fp32_model = copy.deepcopy(model) if need_fp32_inputs else None
    convert(model, recipe)
    todo = _layers(model, layers, who)
    fp32_inputs = (_Inputs(fp32_model, [n for n, _, _ in todo], operand=False).run(batches)
                   if need_fp32_inputs else None)
    order = _execution_order(model, [n for n, _, _ in todo], batches)
    for name, mod, fmt in sorted(todo, key=lambda t: order[t[0]]):
        xq = _Inputs(model, [name], operand=True).run(batches)[name]
        w0 = _plain(mod.weight).detach().double()
        if not bool(torch.isfinite(w0).all()):
            raise ValueError(f"{who}: {name}'s weight has Inf/NaN values")
        flat, run = _flat_weight(mod, w0)  # one least-squares problem per conv group
        x = fp32_inputs[name] if fp32_inputs is not None else None

        def solve(whole_scale=None):
            grids = [_Grid(fmt, flat[g], run, name, whole=flat, group=g,
                           whole_scale=whole_scale) for g in range(flat.shape[0])]
            q = torch.stack([quantize_layer(flat[g], xq[g], x[g] if x is not None else None,
                                            grids[g]) for g in range(flat.shape[0])])
            return q, grids[0].whole_scale

        q, scale = solve()
        while scale is not None:  # a per-tensor block: the whole weight must be a fixed point
            again = block_scale(scale_amax(q, fmt, None).reshape(1, 1), fmt)
            if not bool((again < scale).all()) or torch.equal(
                    round_with_scale(q, again, fmt, fmt.rounding), q):
                break
            q, scale = solve(again)  # rounding lowered its maximum: again with its own scale
        _write(mod, name, q, fmt, who)
    return model


def gptq(model: nn.Module, calib_inputs, spec, *, damp: float = 0.01, act_order: bool = False,
         layers: Optional[Sequence[str]] = None) -> nn.Module:
    """GPTQ (Frantar et al. 2022) of a trained model in any format, from a calibration batch.

    Converts ``model`` in place with ``spec`` (a format F: ``qt.recipes.direct_cast(F)``; or a
    ``qt.Recipe``) and replaces the weight of each ``nn.Linear``, ``nn.Conv1d/2d/3d`` and
    ``nn.ConvTranspose1d/2d/3d`` (grouped ones too) whose contraction rounds it (or the
    ``layers`` named) by its GPTQ rounding in that format, layer after layer in the order they
    run, each on its inputs in the model quantized so far (as the contraction receives them:
    rounded to the activation operand format). ``calib_inputs``: a
    tensor, a tuple of positional arguments, or a list of them. ``damp``: the fraction of the
    Hessian's mean diagonal added to it. ``act_order``: GPTQ's act-order (``--act-order`` of
    the reference implementation: the columns in decreasing order of the Hessian diagonal);
    with a block format the blocks are taken in decreasing order of their largest diagonal
    entry and the columns of each block in decreasing order within it, so that every block is
    the format's and its scale is decided when its first column is reached (a scalar format:
    GPTQ's own order). Returns ``model``. See the module docstring and
    docs/analysis.md."""
    if not (isinstance(damp, (int, float)) and damp >= 0):
        raise ValueError(f"qt.gptq: damp must be a number >= 0, got {damp!r}")
    if not isinstance(act_order, bool):
        raise TypeError(f"qt.gptq: act_order must be True or False, got {act_order!r}")
    return _flow(model, calib_inputs, spec, layers, "qt.gptq",
                 lambda w, xq, x, grid: _gptq_matrix(w, xq, grid, float(damp), act_order),
                 False)


def error_diffusion(model: nn.Module, calib_inputs, spec, *,
                    layers: Optional[Sequence[str]] = None) -> nn.Module:
    """Error-diffusion post-training quantization (after arXiv 2410.11203) in any format.

    Converts ``model`` in place with ``spec`` (as :func:`gptq`) and replaces each processed
    layer's weight by values rounded column after column (in block order) so that the layer's
    output error on the calibration batch, against the FP32 model's output of that layer (the
    errors of the layers before included), is diffused into the columns not yet rounded; no
    Hessian, no backpropagation, no hyperparameter. Returns ``model``. See the module docstring
    and docs/analysis.md."""
    return _flow(model, calib_inputs, spec, layers, "qt.error_diffusion",
                 lambda w, xq, x, grid: _diffusion_matrix(w, x, xq, grid), True)

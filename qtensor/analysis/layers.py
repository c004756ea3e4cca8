"""The layers of an analysed model: which modules count as layers (those with parameters of
their own), what the full conversion planned for each (tied parameters counted once), and their
sizes and bits per value as computed (``AnalysisReport.layers``, ``AnalysisReport.bits``,
``qt.suggest_recipe``).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn

from ..nn import gemm_forward
from ..formats.base import Format
from ..nn.plans import _FP32, Role
from .contractions import CONTRACTIONS


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


def _lossy(role: Role) -> bool:
    """Whether a role rounds anything (FP32 without an operand format rounds nothing)."""
    return not role.full_precision and role != Role(_FP32)

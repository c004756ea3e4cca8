"""``qt.describe(model)``: the table of a model's parameters and buffers (formats, bits per value,
the total against FP32) and, for a converted model, which rule chose each, the formats of each
module's outputs and the operand formats of each GEMM.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from . import gemm_forward as _gemm
from .conversion import _Conversion
from .plans import GEMMS, Recipe, Role, _is_q

__all__ = ["describe"]


def _total_bits(t: torch.Tensor) -> float:
    """Storage of ``t`` in bits: its format's bits per value, block scales counted per block
    actually present (a short last block still has a whole scale)."""
    n = t.numel()
    if not _is_q(t):
        if t.dtype == torch.bool:
            return 8.0 * n
        info = torch.finfo(t.dtype) if t.is_floating_point() else torch.iinfo(t.dtype)
        return float(info.bits * n)
    return t.fmt.storage_bits(t.shape)


def _rule_of(plan, recipe: Recipe, roles: Tuple[str, ...]) -> str:
    """Which rule chose a plan's formats (per role where a rule gives only some), else the
    recipe's default for the role."""
    if plan is None:
        return "-"
    if plan.rule is None:
        return f"default ({roles[0]})"
    spec = recipe.rules.get(plan.rule)
    if not isinstance(spec, dict):
        return f"rule {plan.rule!r}"
    own = [r for r in roles if r in spec]
    rest = [r for r in roles if r not in spec]
    if not rest:
        return f"rule {plan.rule!r}"
    return (f"rule {plan.rule!r} ({', '.join(own)}); " if own else
            f"rule {plan.rule!r} sets no role of it; ") + f"default ({', '.join(rest)})"


def _table(rows) -> List[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _module_rows(model: nn.Module, conv: _Conversion) -> List[Tuple[str, ...]]:
    """One row per module: its activation (output) and gradient formats and what chose them."""
    rows = [("module", "type", "activation", "gradient", "chosen by")]
    for mname, mod in model.named_modules():
        plan = conv.module_plans.get(mname)
        if plan is None:
            continue
        act = "plain (kept full precision)" if plan.plain else str(plan.activation)
        grad = "plain" if plan.plain else str(plan.grad)
        rows.append((mname or "(model: inputs and outputs)", type(mod).__name__, act, grad,
                     _rule_of(plan, conv.recipe, ("activation", "grad"))))
    return rows


def _gemm_rows(model: nn.Module, conv: _Conversion) -> List[Tuple[str, ...]]:
    """One row per GEMM of each converted Linear/Conv: its operands' formats and bits and its
    transform (qtensor.nn.gemm_forward.gemm_formats: Recipe.gemm, last_layers, rules)."""
    rows = [("gemm", "module", "operands", "bits", "transform")]
    for mname, mod in model.named_modules():
        if not _is_q(mod._parameters.get("weight")):
            continue
        plan = conv.module_plans.get(mname)
        act, grad = (plan.activation, plan.grad) if plan is not None else (Role(), Role())
        used = _gemm.gemm_formats(mod, act.mm_fmt or act.fmt, grad.mm_fmt or grad.fmt)
        if used is None:
            continue
        for gemm, (fa, fb, t) in used.items():
            ops = GEMMS[gemm]
            w = mod.weight
            fmts = [w.fmt if f is None and o == "w" else f for o, f in zip(ops, (fa, fb))]
            bits = ["32" if f is None else f"{f.bits:.4g}" for f in fmts]
            rows.append((gemm, mname or "(model)",
                         " x ".join(f"{o} {f if f is not None else 'fp32'}"
                                    for o, f in zip(ops, fmts)),
                         " x ".join(bits), "-" if t is None else str(t)))
    return rows


def describe(model: nn.Module, *, file=None, print_table: bool = True) -> Optional[str]:
    """Print a table of every parameter and buffer (to ``file``, default stdout; returns None,
    so the REPL shows it once), or return it as a string with ``print_table=False``: name,
    shape, value format, operand (mm) format, bits per value, and the model's total size in
    bits against FP32. For a converted model also: which rule (or the role's default) chose
    each tensor's formats, and a second table, per module, of the activation and gradient
    formats of its outputs and what chose them, and a third, per converted Linear/Conv, of the
    operand formats (and bits) and transform of each of its GEMMs (fprop, dgrad, wgrad), which
    ``Recipe.gemm`` can set apart from the roles; a weight's "mm format" then names its GEMMs'.

    Bits per value are the value format's (the operand format costs no storage), with block
    scales counted per block present; non-floating buffers count at their dtype's width in both
    totals."""
    conv = getattr(model, "_qt_conversion", None)
    head = ("name", "shape", "format", "mm format", "bits") + (("chosen by",) if conv else ())
    rows = [head]
    total = fp32_total = 0.0
    seen = set()
    entries = [(n, t, "param") for n, t in model.named_parameters(remove_duplicate=False)] + \
              [(n, t, "buffer") for n, t in model.named_buffers(remove_duplicate=False)]
    gemm_weights = {}  # weights whose GEMMs do not use their own mm_fmt: (fprop's, dgrad's)
    for mod in model.modules():
        used = _gemm.gemm_formats(mod) if _gemm.installed_gemm(mod) is not None else None
        if used is not None:
            gemm_weights[id(mod.weight)] = (used["fprop"][1] or "-", used["dgrad"][1] or "-")
    names: Dict[int, List[str]] = {}
    for name, t, _what in entries:
        names.setdefault(id(t), []).append(name)
    for name, t, _what in entries:
        if id(t) in seen:
            continue
        seen.add(id(t))
        if len(names[id(t)]) > 1:  # tied: one tensor, counted once, shown with its other names
            name = f"{name} (= {', '.join(names[id(t)][1:])})"
        n = t.numel()
        size = _total_bits(t)
        bits = size / n if n else 0.0
        if _is_q(t):
            fmt, mm = str(t.fmt), str(t.mm_fmt) if getattr(t, "mm_fmt", None) is not None else "-"
            fw = gemm_weights.get(id(t))
            if fw is not None:  # its GEMMs' formats, not its own mm_fmt (Recipe.gemm)
                mm = f"{fw[0]} in fprop, {fw[1]} in dgrad (per-GEMM, below)"
        else:
            fmt, mm = f"plain {str(t.dtype).replace('torch.', '')}", "-"
        total += size
        fp32_total += 32 * n if t.is_floating_point() else size
        row = (name, "x".join(map(str, t.shape)) or "scalar", fmt, mm, f"{bits:.4g}")
        if conv is not None:
            plan = conv.tensor_plans.get(name)
            roles = (("weight",) if plan is None or plan.kind == "buffer"  # (no gradient)
                     else (plan.kind, "grad", "optimizer_state"))
            row += ("not floating: left alone" if plan is None and not t.is_floating_point()
                    else _rule_of(plan, conv.recipe, roles),)
        rows.append(row)
    lines = _table(rows)
    ratio = total / fp32_total if fp32_total else 1.0
    lines.append(f"total: {total:,.0f} bits ({total / 8 / 2**20:.3f} MiB) vs FP32 "
                 f"{fp32_total:,.0f} bits ({fp32_total / 8 / 2**20:.3f} MiB): {ratio:.3f}x")
    if conv is not None:
        root = conv.module_plans.get("")
        if root is not None:
            lines.append(f"activations: {root.activation}; gradients: {conv.recipe.grad}; "
                         f"optimizer state: {conv.recipe.optimizer_state}; "
                         f"master weights: {conv.recipe.master_weights}")
        lines.append("")
        lines.extend(_table(_module_rows(model, conv)))
        gemms = _gemm_rows(model, conv)
        if len(gemms) > 1:
            lines += ["", "GEMMs of each Linear/Conv: the operand formats (bits per value) and "
                      "transform each uses (x and dY, where Recipe.gemm leaves them their own: the operand "
                      "formats of this module's activation and grad roles, as its producer's are "
                      "by default)"]
            lines.extend(_table(gemms))
    text = "\n".join(lines)
    if print_table:
        print(text, file=file)
        return None
    return text

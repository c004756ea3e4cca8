"""``qt.AnalysisReport``: what :func:`qtensor.analysis.analyze.analyze` measured, as rows, and
their renderings: plain text tables, Markdown, JSON and a figure (matplotlib).
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from typing import List, Optional

from ..tensor import flush_warnings
from ..nn.plans import Recipe
from .layers import ROLES, _check_count, _elements

__all__ = ["AnalysisReport"]


def _num(v) -> str:
    if isinstance(v, float):
        if math.isinf(v) or math.isnan(v):
            return str(v)
        return f"{v:.4g}"
    return str(v)


_PCT = ("flushed", "saturated", "clipped", "clip_loss", "nan")


def _cells(row: dict, keys) -> List[str]:
    return [f"{100 * row[k]:.2f}%" if k in _PCT else _num(row[k]) for k in keys]


_TABLES = (
    ("tensors", "Rounded tensors by role",
     ("role", "tensor", "format", "numel", "rel_error", "snr_db", "flushed", "saturated",
      "clipped", "clip_loss", "nan")),
    ("contractions", "Contractions: local error (relative, Frobenius) against the FP32 product of "
     "the unrounded operands, the exact product of the rounded operands, and the operands' share",
     ("layer", "type", "shape", "operand_formats", "accumulator", "vs_fp32", "vs_exact_rounded",
      "operands")),
    ("backward", "Backward GEMMs (dgrad: dY x W, wgrad: x x dY): the same errors, on the "
     "gradient of each contraction's output as it arrived",
     ("layer", "gemm", "operand_formats", "accumulator", "vs_fp32", "vs_exact_rounded",
      "operands")),
    ("sensitivity", "Sensitivity: only this layer (role \"all\") or only this role of it in "
     "the recipe's formats", ("layer", "role", "type", "dloss", "kl", "grad_cos")),
    ("layers", "Layers: sizes (parameters; output values in this batch) and bits per value as "
     "computed (operand format where a value enters a contraction)",
     ("layer", "type", "params", "outputs", "weight_format", "weight_bits", "activation_format",
      "grad_format")),
    ("gradients", "Gradients of the converted model against FP32", ("parameter", "grad_cos")),
)


@dataclass
class AnalysisReport:
    """What :func:`analyze` measured; ``.table()``, ``.markdown()``, ``.to_json()``,
    ``.plot(path)``, ``.bits(count)``. Rows are dicts (``report.tensors``, ``.contractions``,
    ``.sensitivity``, ``.gradients``, ``.layers``); ``overall``: loss, dloss, kl, grad_cos of
    the whole converted model. ``recipe`` and ``plans`` (what it planned per layer, for
    ``qt.suggest_recipe``) are not in the JSON."""

    spec: str
    loss_fp32: float
    overall: dict
    tensors: List[dict] = field(default_factory=list)
    contractions: List[dict] = field(default_factory=list)
    backward: List[dict] = field(default_factory=list)
    sensitivity: List[dict] = field(default_factory=list)
    gradients: List[dict] = field(default_factory=list)
    layers: List[dict] = field(default_factory=list)
    # not in the JSON: the recipe analysed and what it planned per layer (qt.suggest_recipe)
    recipe: Optional[Recipe] = field(default=None, repr=False, compare=False)
    plans: Optional[dict] = field(default=None, repr=False, compare=False)

    def bits(self, count=("weight",), layers: Optional[List[str]] = None) -> float:
        """Average bits per value of the analysed recipe, counting the roles in ``count``
        (see :func:`qtensor.analysis.suggest.suggestion`), over ``layers`` (default: the layers with
        sensitivity rows, every layer with parameters of its own unless
        ``qt.analyze(layers=...)`` chose some)."""
        total = elements = 0.0
        infos = self.counted_layers() if layers is None else [
            i for i in self.layers if i["layer"] in set(layers)]
        for info in infos:
            for role in _check_count(count):
                n = _elements(info, role)
                total += n * info[f"{role}_bits"]
                elements += n
        return total / elements if elements else 0.0

    def counted_layers(self) -> List[dict]:
        """The rows of ``layers`` whose values bits are counted over: those with sensitivity
        rows (all of them for a report without)."""
        named = {r["layer"] for r in self.sensitivity}
        return [i for i in self.layers if not named or i["layer"] in named]

    def _head(self) -> str:
        o = self.overall
        return (f"qt.analyze: {self.spec}; FP32 loss {self.loss_fp32:.6g}, converted "
                f"{o['loss']:.6g} (change {o['dloss']:+.4g}), KL of the outputs {o['kl']:.4g}, "
                f"gradient cosine {o['grad_cos']:.6f}")

    def table(self) -> str:
        """The report as plain text tables."""
        out = [self._head()]
        for attr, title, keys in _TABLES:
            rows = getattr(self, attr)
            if not rows:
                continue
            cells = [list(keys)] + [_cells(r, keys) for r in rows]
            widths = [max(len(c[i]) for c in cells) for i in range(len(keys))]
            lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
            lines.insert(1, "  ".join("-" * w for w in widths))
            out += ["", title, *lines]
        return "\n".join(out)

    def markdown(self) -> str:
        out = [self._head()]
        for attr, title, keys in _TABLES:
            rows = getattr(self, attr)
            if not rows:
                continue
            out += ["", f"**{title}**", "", "| " + " | ".join(keys) + " |",
                    "|" + "|".join("---" for _ in keys) + "|"]
            out += ["| " + " | ".join(_cells(r, keys)) + " |" for r in rows]
        return "\n".join(out)

    def to_json(self, **kwargs) -> str:
        def clean(v):  # JSON has no Inf/NaN: strings
            if isinstance(v, float) and (math.isinf(v) or math.isnan(v)):
                return str(v)
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            if isinstance(v, list):
                return [clean(x) for x in v]
            return v
        data = {k: getattr(self, k) for k in ("spec", "loss_fp32", "overall", "tensors",
                                             "contractions", "backward", "sensitivity", "gradients",
                                             "layers")}
        return json.dumps(clean(copy.deepcopy(data)), **kwargs)

    def __str__(self) -> str:
        return self.table()

    def plot(self, path) -> None:
        """Save a figure: per-layer sensitivity bars, contraction errors per layer, and SNR by
        role per tensor (matplotlib, imported here)."""
        import matplotlib
        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        whole = [r for r in self.sensitivity if r.get("role", "all") == "all"]
        by_role = [r for r in self.sensitivity if r.get("role", "all") != "all"]
        fig, axes = plt.subplots(5 if by_role else 4, 1, figsize=(10, 17 if by_role else 14))
        ax = axes[0]
        if whole:
            names = [r["layer"] for r in whole]
            xs = range(len(names))
            ax.bar([x - 0.2 for x in xs], [abs(r["dloss"]) for r in whole], 0.4,
                   label="|change in loss|")
            ax.bar([x + 0.2 for x in xs], [r["kl"] for r in whole], 0.4,
                   label="KL of outputs")
            ax.set_xticks(list(xs), names, rotation=45, ha="right", fontsize=7)
            ax.set_yscale("symlog", linthresh=1e-6)
            ax.legend()
        ax.set_title("Sensitivity: only this layer in low precision")
        ax = axes[1]
        if self.contractions:
            names = [r["layer"] for r in self.contractions]
            xs = range(len(names))
            ax.bar([x - 0.2 for x in xs], [r["vs_fp32"] for r in self.contractions], 0.4,
                   label="vs FP32 product of unrounded operands")
            ax.bar([x + 0.2 for x in xs], [r["vs_exact_rounded"] for r in self.contractions],
                   0.4, label="vs exact product of rounded operands")
            ax.set_xticks(list(xs), names, rotation=45, ha="right", fontsize=7)
            ax.set_yscale("symlog", linthresh=1e-8)  # (FP32 sums of rounded operands: ~0)
            ax.legend()
        ax.set_title("Contractions: relative local error")
        ax = axes[2]
        roles = sorted({r["role"] for r in self.tensors})
        for i, role in enumerate(roles):
            rows = [r for r in self.tensors if r["role"] == role]
            ax.scatter([i] * len(rows), [min(r["snr_db"], 200.0) for r in rows], label=role)
        ax.set_xticks(range(len(roles)), roles)
        ax.set_ylabel("SNR (dB)")
        ax.set_title("Rounded tensors: SNR by role (one point per tensor)")
        ax = axes[3]
        for i, role in enumerate(roles):
            rows = [r for r in self.tensors if r["role"] == role]
            ax.scatter([i - 0.1] * len(rows), [100 * r["clipped"] for r in rows], marker="o",
                       label="values clipped" if i == 0 else None, color="C0")
            ax.scatter([i + 0.1] * len(rows), [100 * r["clip_loss"] for r in rows], marker="x",
                       label="L1 norm removed" if i == 0 else None, color="C3")
        ax.axhline(100 * flush_warnings.CLIP_LIMIT, color="C3", lw=0.5, ls="--")
        ax.set_xticks(range(len(roles)), roles)
        ax.set_ylabel("%")
        if roles:
            ax.legend()
        ax.set_title("Rounded tensors: clipped by their block's scale (dashed: the warning's "
                     "limit on the L1 norm removed)")
        if by_role:
            ax = axes[4]
            names = list(dict.fromkeys(r["layer"] for r in by_role))
            kl = {(r["layer"], r["role"]): r["kl"] for r in by_role}
            width = 0.8 / len(ROLES)
            for i, role in enumerate(ROLES):
                ax.bar([x + (i - 1) * width for x in range(len(names))],
                       [kl.get((n, role), 0.0) for n in names], width, label=role)
            ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=7)
            ax.set_yscale("symlog", linthresh=1e-6)
            ax.legend()
            ax.set_title("Sensitivity by role: KL of the outputs with only this role of this "
                         "layer in low precision")
        fig.suptitle(self._head(), fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)

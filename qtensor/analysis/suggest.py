"""``qt.suggest_recipe(reports, budget)``: a mixed recipe for a budget of bits per value.

From :func:`qt.analyze` reports of one model on one batch, one report per candidate recipe
(``qt.recipes.direct_cast("mxfp8_e4m3")``, ``..."mxfp4_e2m1"``, ...), choose for each layer
(or each role of each layer, from ``qt.analyze(..., roles=True)``) the candidate whose formats
it takes, so that the average bits per value meet the budget and the layers the reports rank
most sensitive keep the more precise formats: the least total sensitivity within the budget (see
:func:`suggestion`). Docs: docs/analysis.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from .layers import _check_count, _elements
from .report import AnalysisReport
from .sensitivity import ROLE_GEMM_FIELDS, gemm_part
from ..formats.parse import format as _parse_format
from ..nn.plans import GemmFormats, Recipe

__all__ = ["suggest_recipe", "suggestion", "Suggestion", "METRICS"]

# The sensitivity that the choice minimises (summed over units), from a sensitivity row (larger: more sensitive)
METRICS = {
    "kl": lambda r: r["kl"],
    "dloss": lambda r: abs(r["dloss"]),
    "grad_cos": lambda r: 1.0 - r["grad_cos"],
}


@dataclass
class Suggestion:
    """What :func:`suggestion` chose: ``recipe`` (for ``qt.convert``), ``bits`` (its average
    bits per counted value, at most ``budget``), and per decided unit (a layer, or a role of a
    layer) the candidate it takes (``choices``); ``.table()``/``.markdown()`` show them."""

    recipe: Recipe
    bits: float
    budget: float
    count: tuple
    metric: str
    candidates: List[str]
    choices: List[dict] = field(default_factory=list)

    _KEYS = ("layer", "role", "choice", "bits", "sensitivity", "cheapest_sensitivity")

    def _head(self) -> str:
        return (f"qt.suggest_recipe: {self.bits:.4g} bits per value ({'+'.join(self.count)}) "
                f"for a budget of {self.budget:.4g}; candidates {', '.join(self.candidates)}; "
                f"least total {self.metric} (knapsack)")

    def _cells(self, row) -> List[str]:
        return [f"{row[k]:.4g}" if isinstance(row[k], float) else str(row[k])
                for k in self._KEYS]

    def table(self) -> str:
        cells = [list(self._KEYS)] + [self._cells(r) for r in self.choices]
        widths = [max(len(c[i]) for c in cells) for i in range(len(self._KEYS))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join([self._head(), ""] + lines)

    def markdown(self) -> str:
        lines = [self._head(), "", "| " + " | ".join(self._KEYS) + " |",
                 "|" + "|".join("---" for _ in self._KEYS) + "|"]
        lines += ["| " + " | ".join(self._cells(r)) + " |" for r in self.choices]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _unit_formats(info: dict, role: str) -> set:
    roles = ("weight", "activation", "grad") if role == "all" else (role,)
    out = set()
    for r in roles:
        out.update(f.strip() for f in info[f"{r}_format"].split(","))
    return out - {"fp32", "-"}


def _unit_bits(info: dict, role: str, count: tuple) -> float:
    """Total bits of one unit's counted values (0 for a role that does not count)."""
    roles = count if role == "all" else ((role,) if role in count else ())
    return float(sum(_elements(info, r) * info[f"{r}_bits"] for r in roles))


def _check_reports(reports) -> List[AnalysisReport]:
    if isinstance(reports, AnalysisReport):
        reports = [reports]
    reports = list(reports)
    if not reports or not all(isinstance(r, AnalysisReport) for r in reports):
        raise TypeError("qt.suggest_recipe needs qt.analyze reports (one per candidate recipe)")
    for r in reports:
        if r.recipe is None or r.plans is None:
            raise ValueError(f"qt.suggest_recipe: the report of {r.spec} has no recipe and plans "
                             "(a report read back from JSON cannot build a recipe)")
        if not r.sensitivity:
            raise ValueError(f"qt.suggest_recipe: the report of {r.spec} has no sensitivity rows "
                             "(qt.analyze(..., sensitivity=False))")
    sizes = [[(i["layer"], i["params"], i["outputs"]) for i in r.counted_layers()]
             for r in reports]
    if any(s != sizes[0] for s in sizes):
        raise ValueError("qt.suggest_recipe: the reports are not of one model and one batch, or "
                         "not of the same layers (their layers or sizes differ)")
    return reports


def suggestion(reports, budget: float, *, formats: Optional[Sequence] = None,
               count=("weight",), metric: str = "kl", decide=None,
               base: Optional[AnalysisReport] = None) -> Suggestion:
    """A mixed recipe whose average bits per value are at most ``budget``.

    ``reports``: :func:`qt.analyze` reports of one model and one batch, one per candidate
    recipe (with sensitivity rows; ``roles=True`` for per-role choices). ``formats``: if given,
    the allowed formats (names or formats): a candidate is an option for a layer only if every
    format it gives that layer's roles is one of them (FP32 is always allowed). ``decide``:
    ``"layer"`` (one choice per layer: its parameters and output together, from the rows of
    role "all") or a tuple of roles (one choice per role of each layer, from the rows of
    ``roles=True``: ``("weight",)`` mixes the weights only); default: every role with rows if
    the reports have per-role rows, else ``"layer"``. ``base``: the report (one of
    ``reports``) whose recipe gives everything not decided (other roles, modules without
    parameters, the model's inputs); default the candidate with the fewest bits.

    Bits are counted as follows (``count`` names the roles that count; default weights only):

    - a value's bits are those of the format it is computed in: the operand format (``mm_fmt``)
      where it enters a contraction (the weight of a Linear/Conv, any activation or gradient),
      else its value format; a format's bits are its element bits plus its scale bits over its
      block size (``fmt.bits``: MXFP8 8.25, MXFP6 6.25, MXFP4 4.25, NVFP4 4.5; the FP32 tensor
      scale of NVFP4 is not counted); full precision is 32;
    - the layers counted are those with sensitivity rows: every module with parameters of its
      own (weights, biases, norms, embeddings), or those of ``qt.analyze(layers=[...])``;
    - "weight": every parameter of those layers (biases included, each element once);
      "activation": each such layer's output values on the analysed batch; "grad": the
      gradient of that output;
    - the average is the total bits over the total values of the counted roles of those
      layers; other layers, and values that the recipe leaves to modules without parameters
      (an activation function's output, an attention product), are not counted.

    Algorithm: each decided unit (a layer, or with ``decide`` roles a (layer, role) pair with a
    sensitivity row) has one option per candidate: its bits (above) and its sensitivity
    (``metric`` of its row: "kl" the KL of the outputs, "dloss" the absolute change in loss,
    "grad_cos" one minus the gradient cosine). A ValueError if even the cheapest options exceed
    the budget. The choice minimises the sum of the units' sensitivities within the budget (a
    multiple-choice knapsack; it assumes that the sensitivities of units add up), by dynamic
    programming over the bits above the cheapest options in 4096 steps, each option's bits
    rounded up to whole steps so that the budget is met; then, greedily, while an upgrade fits
    in the bits the rounding left, the one with the largest decrease in sensitivity per added
    bit is taken. The recipe is the base's, with rules by exact name for every decided
    layer: its parameters' formats and its output's activation and grad roles, each from the
    candidate chosen for it (the base's ``master_weights``, ``loss_scale`` and ``accumulate``
    hold for every layer; with master weights the optimizer state is FP32). A contraction's input operand takes the format of the module that
    produced it (as in any recipe), not the layer's own: the sensitivity of a whole layer
    ("all") includes its inputs, the rule does not round them; the weight role's sensitivity
    (its parameters only) is what its rule does.
    """
    reports = _check_reports(reports)
    count = _check_count(count)
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget > 0):
        raise ValueError(f"budget must be a positive number of bits per value, got {budget!r}")
    allowed = None if formats is None else {str(_parse_format(f)) for f in formats}
    if decide is None:
        decide = tuple(r for r in ("weight", "activation", "grad")
                       if any(row.get("role") == r for rep in reports for row in rep.sensitivity))
        decide = decide or "layer"
    if decide != "layer":
        decide = _check_count(decide)
    unit_roles = ("all",) if decide == "layer" else decide
    score = METRICS[metric]

    def ok(rep, layer, role):
        return allowed is None or _unit_formats(infos[rep][layer], role) <= allowed

    infos = {i: {info["layer"]: info for info in rep.layers} for i, rep in enumerate(reports)}
    base_candidates = [i for i in range(len(reports))
                       if allowed is None or all(ok(i, l, "all") for l in infos[i])]
    if not base_candidates:
        base_candidates = list(range(len(reports)))
    if base is None:
        base = min(base_candidates, key=lambda i: reports[i].bits(count))
    else:
        found = [i for i, r in enumerate(reports) if r is base]
        if not found:
            raise ValueError("qt.suggest_recipe: base must be one of the reports")
        base = found[0]

    # the options of each unit: {(layer, role): [(bits, sensitivity, candidate index)]}
    options: Dict[tuple, list] = {}
    for i, rep in enumerate(reports):
        for row in rep.sensitivity:
            role = row.get("role", "all")
            if role not in unit_roles or not ok(i, row["layer"], role):
                continue
            s = score(row)
            s = math.inf if s != s else s
            options.setdefault((row["layer"], role), []).append(
                (_unit_bits(infos[i][row["layer"]], role, count), s, i))
    if not options:
        raise ValueError("qt.suggest_recipe: no sensitivity row of the roles to decide "
                         f"({decide}) with an allowed candidate (formats={sorted(allowed or ())})")
    units = list(options)
    layer_units = {}
    for layer, role in units:
        layer_units.setdefault(layer, set()).add(role)

    def fixed_bits() -> float:  # the counted values that no unit decides: the base's
        total = 0.0
        for info in reports[base].counted_layers():
            decided = layer_units.get(info["layer"], set())
            for r in count:
                if "all" not in decided and r not in decided:
                    total += _elements(info, r) * info[f"{r}_bits"]
        return total

    elements = sum(_elements(info, r) for info in reports[base].counted_layers() for r in count)
    if elements == 0:
        raise ValueError("qt.suggest_recipe: the counted roles have no values")
    limit = budget * elements * (1 + 1e-12)
    cheapest = {u: min(options[u], key=lambda o: (o[0], o[1])) for u in units}
    total = fixed_bits() + sum(o[0] for o in cheapest.values())
    if total > limit:
        raise ValueError(
            f"qt.suggest_recipe: even the cheapest candidates need {total / elements:.4g} bits "
            f"per value ({'+'.join(count)}), above the budget of {budget:g}")
    fixed = fixed_bits()
    choice = _knapsack(units, options, cheapest, limit - total, exact=limit - fixed)
    total = fixed + sum(o[0] for o in choice.values())
    # then spend what the rounding of the bits left: the upgrades with the largest decrease in
    # sensitivity per added bit
    while True:
        best, best_key = None, None
        for u in units:
            cur = choice[u]
            for o in options[u]:
                added, gain = o[0] - cur[0], cur[1] - o[1]
                if gain <= 0 or total + added > limit:
                    continue
                key = (math.inf if added <= 0 else gain / added, gain)
                if best_key is None or key > best_key:
                    best, best_key = (u, o), key
        if best is None:
            break
        u, o = best
        total += o[0] - choice[u][0]
        choice[u] = o

    recipe = _build(reports, base, choice)
    names = [r.spec for r in reports]
    bits = total / elements
    recipe = recipe.replace(
        name=f"suggested ({bits:.4g} bits per value, {'+'.join(count)})",
        source=f"qt.suggest_recipe: budget {budget:g} bits per value ({'+'.join(count)}); "
               f"candidates {', '.join(names)}; base {names[base]}; least total {metric} (knapsack)")
    rows = []
    for (layer, role), o in choice.items():
        n = sum(_elements(infos[o[2]][layer], r)
                for r in (count if role == "all" else [role] if role in count else []))
        rows.append({"layer": layer, "role": role, "choice": names[o[2]],
                     "bits": o[0] / n if n else 0.0, "sensitivity": o[1],
                     "cheapest_sensitivity": cheapest[(layer, role)][1]})
    return Suggestion(recipe, bits, float(budget), count, metric, names, rows)


STEPS = 4096  # the resolution of the knapsack over the bits


def _knapsack(units, options, cheapest, room: float, exact: float) -> dict:
    """The option of each unit that minimises the sum of their sensitivities with at most
    ``room`` bits above the cheapest options (``exact``: at most that many bits in all): a
    multiple-choice knapsack, by dynamic programming over ``room`` in STEPS steps. Each option's
    extra bits are rounded to the nearest step, and the result checked exactly; if it does not
    fit, the room shrinks by what it overshot and the search runs again; last, every option's
    bits rounded up (which always fits)."""
    import numpy as np

    if room <= 0:
        return dict(cheapest)
    step = room / STEPS
    big = 1e300  # (an infinite sensitivity: chosen only if nothing else is possible)

    def steps(u, bits, up):
        extra = (bits - cheapest[u][0]) / step
        return max(0, math.ceil(extra - 1e-9) if up else round(extra))

    def solve(width, up):
        best = np.zeros(width + 1)  # least total sensitivity within b steps, units so far
        picks = []
        for u in units:
            new = np.full(width + 1, np.inf)
            arg = np.zeros(width + 1, dtype=np.int32)
            for k, (bits, sens, _i) in enumerate(options[u]):
                c = steps(u, bits, up)
                if c > width:
                    continue
                cand = np.full(width + 1, np.inf)
                cand[c:] = best[:width + 1 - c] + min(sens, big)
                better = cand < new
                new[better] = cand[better]
                arg[better] = k
            best = new
            picks.append(arg)
        b = int(np.argmin(best))
        choice = {}
        for u, arg in zip(reversed(units), reversed(picks)):
            o = options[u][int(arg[b])]
            choice[u] = o
            b -= steps(u, o[0], up)
        return choice

    width = STEPS
    for _try in range(32):
        choice = solve(width, up=False)
        over = sum(o[0] for o in choice.values()) - exact
        if over <= 0:
            return choice
        width -= max(1, math.ceil(over / step))
        if width <= 0:
            break
    return solve(STEPS, up=True)


def _build(reports, base: int, choice: dict) -> Recipe:
    """The base candidate's recipe with exact-name rules for the decided layers."""
    recipe = reports[base].recipe
    rules = dict(recipe.rules)
    any_gemm = any(p.get("gemm") is not None for r in reports for p in r.plans.values())
    per_layer: Dict[str, dict] = {}
    for (layer, role), (_bits, _s, i) in choice.items():
        per_layer.setdefault(layer, {})[role] = reports[i].plans[layer]
    for layer, chosen in per_layer.items():
        start = reports[base].plans[layer]

        def pick(role):
            return chosen.get(role) or chosen.get("all") or start

        w, a, g = pick("weight"), pick("activation"), pick("grad")
        gemm = _gemm_of_choice(w, a, g) if any_gemm else None
        for qual, t in w["params"].items():
            grad_t = g["params"].get(qual, t)
            # (with the base's FP32 master weights the optimizer state is FP32: the base's
            # master_weights, loss_scale and accumulate hold for every layer)
            state = None if (t.master or recipe.master_weights) else t.optimizer_state
            rules[qual] = {t.kind: t.value, "grad": grad_t.grad if not t.value.full_precision
                           else None, "optimizer_state": state}
        rules[layer] = {"activation": a["activation"], "grad": g["grad"]}
        if any_gemm:  # (a rule turns Recipe.gemm off for its module: say what it takes)
            rules[layer]["gemm"] = gemm
    return recipe.replace(rules=rules)


def _gemm_of_choice(w: dict, a: dict, g: dict):
    """The per-GEMM formats of a layer whose weight, input and output gradient take the GEMM
    formats of the candidates chosen for its weight, activation and grad roles."""
    fields = {}
    for role, plans in (("weight", w), ("activation", a), ("grad", g)):
        part = gemm_part(plans.get("gemm"), (role,))
        for f in ROLE_GEMM_FIELDS[role]:
            if f not in fields or fields[f] is None:
                fields[f] = None if part is None else getattr(part, f)
    return GemmFormats.of(GemmFormats(**fields))


def suggest_recipe(reports, budget: float, **kwargs) -> Recipe:
    """``suggestion(reports, budget, ...).recipe``: a Recipe for ``qt.convert`` whose average
    bits per value meet ``budget``; see :func:`suggestion` for the options, how bits are
    counted and the algorithm."""
    return suggestion(reports, budget, **kwargs).recipe

"""qt.suggest_recipe: a mixed recipe that meets a bit budget and keeps the sensitive layers
precise. The bits are checked against the formats of a model converted with the recipe."""
import copy

import pytest
import torch
import torch.nn.functional as F

import qtensor as qt
from qtensor.analysis.suggest import suggestion

CANDIDATES = ("mxfp8_e4m3", "mxfp6_e3m2", "mxfp4_e2m1")


def _model(sensitive=None):
    """Three 64x64 linear layers; ``sensitive`` ("0", "2" or "4"): that layer's weights get a
    large value in every block of 32 inputs, on inputs that are always zero (dead units of the
    layer before), so that its output is the same in FP32 but MXFP4 (E2M1 elements, shared
    power-of-two scale) flushes every other weight of the block to zero; MXFP8 keeps them."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                            torch.nn.ReLU(), torch.nn.Linear(64, 64))
    if sensitive is not None:
        with torch.no_grad():
            layer = m.get_submodule(sensitive)
            layer.weight[:, ::32] = 50.0
            if sensitive != "0":
                before = m.get_submodule(str(int(sensitive) - 2))
                before.weight[::32] = 0.0
                before.bias[::32] = -1.0  # dead after the ReLU
    return m


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(128, 64, generator=g), torch.randint(0, 64, (128,), generator=g)


def _reports(model, roles=False, names=CANDIDATES):
    x, y = _batch()
    return [qt.analyze(model, x, qt.recipes.direct_cast(f), lambda o: F.cross_entropy(o, y),
                       roles=roles) for f in names]


def _converted_bits(model, recipe, count=("weight",)):
    """Average bits per value of ``model`` converted with ``recipe``, read off its tensors: a
    Linear's weight at its operand format, other parameters at their value format, plain 32;
    each Linear's output values at the format the next contraction reads (operand, else
    value)."""
    m = qt.convert(copy.deepcopy(model), recipe)
    total = n = 0.0
    if "weight" in count:
        for name, p in m.named_parameters():
            if isinstance(p, qt.QTensor):
                fmt = p.mm_fmt if name.endswith("weight") and p.mm_fmt is not None else p.fmt
                bits = fmt.bits
            else:
                bits = 32.0
            total += bits * p.numel()
            n += p.numel()
    if "activation" in count:
        outs = []
        hooks = [mod.register_forward_hook(lambda mod, a, o: outs.append(o))
                 for mod in m if isinstance(mod, torch.nn.Linear)]
        m(_batch()[0])
        for h in hooks:
            h.remove()
        for o in outs:
            fmt = (o.mm_fmt or o.fmt) if isinstance(o, qt.QTensor) else None
            total += (32.0 if fmt is None else fmt.bits) * o.numel()
            n += o.numel()
    return total / n


@pytest.mark.parametrize("count", [("weight",), ("weight", "activation")])
def test_the_suggested_recipe_meets_the_budget(count):
    model = _model()
    reports = _reports(model)
    lo, hi = reports[-1].bits(count), reports[0].bits(count)
    assert _converted_bits(model, reports[1].recipe, count) == pytest.approx(
        reports[1].bits(count), rel=1e-12)  # the two countings agree on a uniform recipe
    for budget in (lo, lo + 0.3, 5.5, 6.0, 7.3, hi):
        s = suggestion(reports, budget, count=count)
        got = _converted_bits(model, s.recipe, count)
        assert got <= budget * (1 + 1e-9), (budget, got, s.table())
        assert got == pytest.approx(s.bits, rel=1e-12)
        assert isinstance(qt.suggest_recipe(reports, budget, count=count), qt.Recipe)
    assert suggestion(reports, hi, count=count).bits == pytest.approx(hi)  # all MXFP8
    with pytest.raises(ValueError, match="cheapest candidates need"):
        qt.suggest_recipe(reports, lo - 0.01, count=count)


def test_the_most_sensitive_layer_keeps_the_higher_precision():
    x, y = _batch()
    for sensitive in ("2",):
        model = _model(sensitive)
        reports = _reports(model, roles=True, names=("mxfp8_e4m3", "mxfp4_e2m1"))
        rows = {r["layer"]: r["kl"] for r in reports[1].sensitivity if r["role"] == "all"}
        assert max(rows, key=rows.get) == sensitive, rows  # the report ranks it first
        # room for exactly one of the three (equal) layers in MXFP8
        b8, b4 = reports[0].bits(), reports[1].bits()
        budget = (b8 + 2 * b4) / 3
        for decide in ("layer", ("weight",)):
            s = suggestion(reports, budget, decide=decide)
            upgraded = {c["layer"] for c in s.choices if c["choice"].startswith(
                "direct_cast(mxfp8")}
            assert upgraded == {sensitive}, s.table()
            assert s.bits <= budget
        # and it is the better choice: lower KL than the same budget spent on another layer
        kl = {}
        for layer in ("0", "2", "4"):
            rules = {f"{layer}.weight": (qt.fp32, qt.mxfp8_e4m3)}
            r = qt.recipes.direct_cast("mxfp4_e2m1").replace(rules=rules)
            kl[layer] = qt.analyze(model, x, r, lambda o: F.cross_entropy(o, y),
                                   sensitivity=False).overall["kl"]
        chosen = qt.analyze(model, x, qt.suggest_recipe(reports, budget, decide=("weight",)),
                            lambda o: F.cross_entropy(o, y), sensitivity=False).overall["kl"]
        assert chosen == pytest.approx(kl[sensitive], rel=1e-9)
        assert kl[sensitive] < min(v for k, v in kl.items() if k != sensitive) / 5, kl


def test_allowed_formats_and_the_base():
    model = _model("2")
    reports = _reports(model, roles=True)
    s = suggestion(reports, 100.0, decide="layer", formats=["mxfp6_e3m2", "mxfp4_e2m1"])
    assert {c["choice"] for c in s.choices} <= {"direct_cast(mxfp6_e3m2)",
                                               "direct_cast(mxfp4_e2m1)"}
    m = qt.convert(copy.deepcopy(model), s.recipe)
    used = {str(p.mm_fmt) for n, p in m.named_parameters() if n.endswith("weight")}
    assert used == {"mxfp6_e3m2"}  # the most precise allowed, with bits to spare
    # the base gives what is not decided: with the weights mixed, activations stay MXFP6
    s = suggestion(reports, reports[1].bits(), decide=("weight",), base=reports[1])
    m = qt.convert(copy.deepcopy(model), s.recipe)
    assert str(m(torch.randn(2, 64)).mm_fmt) == "mxfp6_e3m2"
    with pytest.raises(ValueError, match="no sensitivity row"):
        suggestion(reports, 8.0, decide=("grad",))  # direct cast leaves the gradients plain
    with pytest.raises(ValueError, match="count must name"):
        suggestion(reports, 8.0, count=("weights",))


def test_the_choice_is_the_least_total_sensitivity_within_the_budget():
    # the knapsack against a brute force over every combination, on random small problems
    import itertools
    import random

    from qtensor.analysis.suggest import _knapsack
    rng = random.Random(0)
    for _ in range(100):
        units = list(range(rng.randint(2, 5)))
        options = {u: [(0.0 if k == 0 else rng.choice([4.25, 4.5, 6.25, 8.25])
                        * rng.choice([100, 640, 4096, 32768]), rng.random() * (3 - k), k)
                       for k in range(3)] for u in units}
        cheapest = {u: min(options[u], key=lambda o: (o[0], o[1])) for u in units}
        lo = sum(o[0] for o in cheapest.values())
        hi = sum(max(o[0] for o in options[u]) for u in units)
        limit = lo + rng.random() * (hi - lo)
        best = min(sum(o[1] for o in combo)
                   for combo in itertools.product(*(options[u] for u in units))
                   if sum(o[0] for o in combo) <= limit)
        got = _knapsack(units, options, cheapest, limit - lo, exact=limit)
        assert sum(o[0] for o in got.values()) <= limit
        assert sum(o[1] for o in got.values()) == pytest.approx(best, rel=1e-12)


def test_candidates_with_and_without_master_weights():
    # the base's FP32 master weights hold for every layer: a candidate's low-precision optimizer
    # state is not carried into a rule (qt.convert would refuse it)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.randn(16, 32)
    a, b = qt.analyze(m, x, qt.recipes.mxfp6), qt.analyze(m, x, qt.recipes.mx_all_mxfp4)
    budget = (a.bits() + b.bits()) / 2
    s = suggestion([a, b], budget, base=a)
    assert {c["choice"] for c in s.choices} == {a.spec, b.spec}  # a real mix
    conv = qt.convert(copy.deepcopy(m), s.recipe)
    plans = qt.analysis.analyze.conversion_of(conv).tensor_plans
    assert all(p.master for p in plans.values() if p.kind == "weight")
    assert _converted_bits(m, s.recipe) <= budget

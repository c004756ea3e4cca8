"""QPyTorch's low-precision training recipes on the digits CNN, against FP32.

    python examples/qpytorch_recipes.py           # ~1-2 minutes on 2 CPU cores
    python examples/qpytorch_recipes.py --quick   # a few steps (CI)

QPyTorch (Zhang et al., 2019) ships four training recipes and reports that its simulations
reproduce the accuracy the original papers published (within about 0.1% error). Here each recipe
is one ``qt.convert`` line with the preset in ``qt.recipes`` (see their docstrings for the exact
formats of weights, activations, gradients and optimizer state):

- ``fp16``: IEEE half precision everywhere (Micikevicius et al., 2018, without the FP32 tricks
  the preset does not include).
- ``block8``: 8-bit block floating point for weights, activations, gradients and momentum
  (QPyTorch's "Block-8" example).
- ``wage``: WAGE (Wu et al., 2018): 2-bit weights, 8-bit activations, gradients and errors,
  fixed point. Formats alone do not make WAGE: with PyTorch's default initialisation every
  2-bit weight of the linear layers rounds to 0 and nothing trains. So this row also does what
  WAGE's training script does (``wage_setup``): its weight initialisation (uniform in +-0.75 for
  2-bit weights) and its constant per-layer scale alpha (a power of two dividing each layer's
  output). WAGE divides the full-precision accumulator by alpha *before* the 8-bit activation
  rounding, so the activations here keep FP32 values between layers and enter every matrix
  multiply as 8-bit fixed point (``activation=(fp32, <the preset's 8-bit format>)``); with the
  preset's 8-bit activation values, each layer's output would saturate at 1 before alpha.
  The row ``wage_wide`` is a control: the same, with activation operands of the same step
  2^-7 but a 16-bit range, which shows how much WAGE's [-1, 1) activation range costs here.
- ``swalp``: SWALP (Yang et al., 2019): 8-bit block floating point with stochastic rounding for
  everything, plus stochastic weight averaging of the low-precision iterates in high precision;
  the table shows both the last low-precision iterate and the FP32 average.

Same model, initial weights, batches and optimizer (SGD, momentum 0.9) as the FP32 baseline.
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import qtensor as qt  # noqa: E402

RECIPES = ["fp32", "fp16", "block8", "wage", "wage_wide", "swalp"]
# "wage_wide": a control, not a recipe: WAGE with activation operands of the same 2^-7 step
# but 16 bits (range +-256) instead of WAGE's 8 bits ([-1, 1)), to show what saturation costs.
LR, MOMENTUM, BATCH = 0.05, 0.9, 64
SWA_START = 0.5   # SWALP: average the iterates of the second half of training
SWA_EVERY = 5     # ... every 5 steps


def wage_setup(model, activation=None, weight_bits=2, beta=1.5):
    """WAGE's initialisation and layer scales (Wu et al. 2018, sec. 3.2); returns the recipe."""
    w_max = beta / 2 ** (weight_bits - 1)  # 0.75 for 2-bit weights
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            limit = math.sqrt(6 / module.weight[0].numel())       # He-uniform limit of the layer
            alpha = max(2.0 ** round(math.log2(w_max / limit)), 1.0)
            nn.init.uniform_(module.weight, -max(w_max, limit), max(w_max, limit))
            nn.init.zeros_(module.bias)
            # Registered before qt.convert's hooks, so it divides the FP32 output before rounding.
            module.register_forward_hook(lambda m, args, out, alpha=alpha: out / alpha)
    recipe = qt.recipes.wage
    return recipe.replace(activation=(qt.fp32, activation or recipe.activation.fmt))


def run_recipe(name, data, steps, seed):
    x_train, y_train, x_test, y_test = data
    torch.manual_seed(seed)
    model = common.DigitsCNN()
    if name == "wage":
        qt.convert(model, wage_setup(model))
    elif name == "wage_wide":
        qt.convert(model, wage_setup(model, qt.recipes.wage.activation.fmt.replace(wl=16)))
    elif name != "fp32":
        qt.convert(model, getattr(qt.recipes, name))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)

    swa = {"sum": None, "n": 0}
    start = int(steps * SWA_START)

    def average(step):  # SWALP: the running average is kept in FP32
        if name != "swalp" or step < start or (step - start) % SWA_EVERY:
            return
        w = common.plain_state(model)
        if swa["sum"] is None:
            swa["sum"] = {k: v.clone() for k, v in w.items()}
        else:
            for k, v in w.items():
                swa["sum"][k] += v
        swa["n"] += 1

    with common.Timer() as t:
        losses = common.train_classifier(model, opt, x_train, y_train, steps=steps, batch=BATCH,
                                         seed=seed, desc=f"{name:>8}", callback=average)
    result = {"name": name, "losses": losses, "seconds": t.seconds,
              "acc": common.accuracy(model, x_test, y_test)}
    if swa["n"]:
        avg = common.DigitsCNN()
        avg.load_state_dict({k: v / swa["n"] for k, v in swa["sum"].items()})
        result["swa_acc"] = common.accuracy(avg, x_test, y_test)
        result["swa_n"] = swa["n"]
    return result


SUMMARY = {
    "fp32": "plain PyTorch FP32",
    "fp16": "FP16 everywhere (QPyTorch's: no Inf, ties away)",
    "block8": "8-bit block floating point, nearest",
    "wage": "2-bit W, 8-bit fixed A/G/E; WAGE init + scales",
    "wage_wide": "control: wage with 16-bit activation operands",
    "swalp": "8-bit block floating point, stochastic",
}


def recipe_formats(name: str) -> str:
    """Every role the preset sets, with its format, for the list under the table."""
    recipe = getattr(qt.recipes, name)
    parts = []
    for role in ("weight", "bias", "activation", "grad", "optimizer_state", "master_weights"):
        f = getattr(recipe, role, None)
        if f is not None and f is not False:
            parts.append(f"{role}={f}")
    line = f"- `qt.recipes.{name}`: " + ", ".join(parts)
    if name == "wage":
        line += ("; run here with activation=(fp32, the 8-bit format above) and WAGE's "
                 "initialisation and layer scales (see wage_setup)")
    return line


def mean(xs):
    return sum(xs) / len(xs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few steps per recipe (smoke test)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seeds", type=int, default=None,
                   help="training seeds per recipe (initialisation, batch order, stochastic "
                        "rounding); default 3, 1 with --quick")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="output folder (default examples/results/local, git-ignored; nothing "
                        "written with --quick; --out examples/results: the committed results)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="first training seed")
    args = p.parse_args(argv)
    steps = args.steps or (6 if args.quick else 300)
    n_seeds = args.seeds or (1 if args.quick else 3)
    seeds = [args.seed + k for k in range(n_seeds)]
    out = common.output_dir(args.out, args.quick)

    common.setup(args.threads, args.seed)
    data = common.load_digits_split()  # the same train/test split for every seed
    names = [n.strip() for n in args.recipes.split(",") if n.strip()]
    runs = {n: [] for n in names}
    for n, seed in common.progress([(n, s) for n in names for s in seeds], desc="runs",
                                   leave=True):
        runs[n].append(run_recipe(n, data, steps, seed))

    base = mean([r["acc"] for r in runs["fp32"]]) if "fp32" in runs else None
    window = max(1, min(20, steps // 5))

    def acc_cells(accs):
        per_seed = " / ".join(f"{100 * a:.1f}" for a in accs)
        gap = f"{100 * (mean(accs) - base):+.1f}" if base is not None else "-"
        return [f"{100 * mean(accs):.1f}%", per_seed, gap]

    rows = []
    for n in names:
        rs = runs[n]
        final = mean([mean(r["losses"][-window:]) for r in rs])
        rows.append([n] + acc_cells([r["acc"] for r in rs]) +
                    [f"{final:.4f}", f"{mean([r['seconds'] for r in rs]):.1f}",
                     SUMMARY.get(n, n)])
        if all("swa_acc" in r for r in rs):
            rows.append([f"{n} + SWA (FP32 average of {rs[0]['swa_n']} iterates)"] +
                        acc_cells([r["swa_acc"] for r in rs]) + ["", "", "the SWALP result"])
    header = ["recipe", f"test acc (mean of {n_seeds})", "per seed (%)", "vs fp32 (points)",
              f"final loss (last {window})", "train time (s)", "recipe in short"]
    table = common.markdown_table(header, rows, align="lrrrrrl")
    title = (f"QPyTorch's recipes on the digits CNN: {steps} SGD steps (momentum 0.9, lr {LR}, "
             f"batch {BATCH}), 359 test digits, training seeds {', '.join(map(str, seeds))}. "
             f"{common.env_line()}.")
    formats = "\n".join(recipe_formats(n) for n in names if n in SUMMARY and n != "fp32"
                         and "_" not in n)
    common.publish(out, "qpytorch_recipes", [title, table, formats],
                   lambda path: plot([runs[n][0] for n in names], path, steps))
    return runs


def plot(results, path, steps):
    plt = common.plt_module()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    window = max(1, steps // 30)
    for r in results:
        label = f"{r['name']} (test acc {100 * r['acc']:.1f}%)"
        ax.plot(common.smooth(r["losses"], window), label=label, lw=1.6)
    ax.set_yscale("log")
    ax.set_xlabel("training step (batch of 64)")
    ax.set_ylabel(f"training loss (moving average of {window})")
    ax.set_title("Digits CNN under QPyTorch's recipes (first seed)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    common.save_figure(fig, path)


if __name__ == "__main__":
    main()

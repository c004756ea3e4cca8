"""Train the same small CNN on real handwritten digits in eight number formats, side by side.

    python examples/demo.py            # all formats, 3 seeds, ~6 minutes on 2 CPU cores
    python examples/demo.py --quick    # a few steps per format, one seed (CI smoke test)
    python examples/demo.py --out examples/results   # regenerate the committed results

Writes demo.md and demo.png into examples/results/local/ (git-ignored) unless --out says otherwise.

Data: scikit-learn's ``load_digits`` (1,797 real 8x8 handwritten digits; a fixed stratified split
of 1,438 train / 359 test images). Same initial weights, same batches, same optimizer
(SGD, momentum 0.9) for every format; only the arithmetic changes. Each format is trained from
``--seeds`` training seeds (initial weights and batch order; the split stays fixed): the table
gives the mean and each seed's accuracy, since a few test digits (one is 0.28%) separate the
formats and the FP32 GEMMs, hence the runs, differ from one CPU to another.

What "trained in format F" means here (one ``qt.convert`` line per format, see ``recipe_for``):
- scalar formats (bf16, fp8_e4m3, fixed point): weights, biases, activations and gradients are
  all values of F; every op's result is rounded to F. The optimizer updates an FP32 master copy
  of the weights (as mixed-precision training does) and the model computes with F-rounded
  weights. Narrow-range formats (fp8_e4m3, fixed point) use a static loss scale S, because
  unscaled gradients (~1e-4) fall below their smallest value: the loss is multiplied by S
  before backward and SGD's learning rate divided by S, which is exact because the FP32 master
  update is where the two meet. (Dividing the gradients back in their own format, as
  ``qt.LossScaler.unscale_`` does, would flush the small ones to zero again.)
- MX formats: the MX paper's training recipe (Rouhani et al., 2023; ``qt.recipes.mxfp6`` with
  F in place of MXFP6): every matrix multiply and convolution rounds its weight, activation and
  gradient operands to F, blocked along the reduction dimension, and accumulates in FP32;
  values between ops (vector ops) are BF16; weights and biases keep FP32 values.
- ``mxfp4_weights`` (last row): not a format but the MX paper's recipe for 4 bits,
  ``qt.recipes.mxfp4_weights``: MXFP4 weight operands with MXFP6_E3M2 activation and gradient
  operands. (The paper trains MXFP4 only this way; in the mxfp4_e2m1 row the activation and
  gradient operands are MXFP4 too.)
"bits/value" is the bits per value of F (for MX, of the weight operands), the shared scale
included. "leaks": findings of ``qt.leak_check`` (values that escaped the emulated formats, or
were not representable in their format) over one more training step, forward, backward and
optimizer step, after the evaluation (summed over the seeds).
"""
from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402  (also makes a source checkout importable without installing)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import qtensor as qt  # noqa: E402

FORMATS = ["fp32", "bf16", "fp8_e4m3", "fixed16.8",
           "mxfp8_e4m3", "mxfp6_e3m2", "mxfp4_e2m1", "mxint8", "mxfp4_weights"]
# Not a format but the MX paper's fix for MXFP4: MXFP4 weights, MXFP6 activations and gradients.
EXTRA = {"mxfp4_weights": "qt.recipes.mxfp4_weights: MXFP4 W, MXFP6_E3M2 A and G operands"}
# Static loss scales (powers of two, so scaling itself is exact) for narrow-range formats.
LOSS_SCALE = {"fp8_e4m3": 2.0 ** 10, "fixed16.8": 2.0 ** 8}
LR, MOMENTUM, BATCH = 0.05, 0.9, 64


def recipe_for(name: str):
    """The one-line conversion spec for format ``name`` (None: plain FP32)."""
    if name == "fp32":
        return None
    if name in EXTRA:
        return getattr(qt.recipes, name)
    fmt = qt.format(name)
    if isinstance(fmt, qt.BlockFormat):
        # The MX paper's recipe (qt.recipes.mxfp6) with F for every matmul operand.
        return qt.recipes.mxfp6.replace(weight=(qt.fp32, fmt), activation=(qt.bf16, fmt),
                                        grad=(qt.bf16, fmt))
    return qt.Recipe(weight=fmt, bias=fmt, activation=fmt, grad=fmt, master_weights=True)


def describe_recipe(name: str) -> str:
    if name == "fp32":
        return "plain PyTorch FP32"
    if name in EXTRA:
        return EXTRA[name]
    fmt = qt.format(name)
    ls = LOSS_SCALE.get(name)
    if isinstance(fmt, qt.BlockFormat):
        return "matmul operands (W, A, G) in F, BF16 vector ops"
    return ("every value in F, FP32 master" + (f", loss scale 2^{int(ls).bit_length() - 1}"
                                                if ls else ""))


def run_format(name, data, steps, seed):
    # qtensor's warnings (e.g. clipping in MXFP4) are shown short, after the progress bars
    with common.warnings_after_bars(f"{name} (seed {seed})"):
        return _run_format(name, data, steps, seed)


def _run_format(name, data, steps, seed):
    x_train, y_train, x_test, y_test = data
    torch.manual_seed(seed)
    model = common.DigitsCNN()          # identical initial weights for every format
    spec = recipe_for(name)
    if spec is not None:
        qt.convert(model, spec)
    scale = LOSS_SCALE.get(name, 1.0)
    opt = torch.optim.SGD(model.parameters(), lr=LR / scale, momentum=MOMENTUM)
    with common.Timer() as t:
        losses = common.train_classifier(model, opt, x_train, y_train, steps=steps, batch=BATCH,
                                         seed=seed, desc=f"{name:>10}", loss_scale=scale)
    acc = common.accuracy(model, x_test, y_test)
    leaks = None
    if spec is not None:
        # One more training step under qt.leak_check: does any value escape the format?
        with qt.leak_check(action="record", optimizer=opt, check_values=True) as report:
            loss = F.cross_entropy(model(x_train[:BATCH]), y_train[:BATCH])
            opt.zero_grad(set_to_none=True)
            (loss * scale).backward()
            opt.step()
        leaks = len(report)
        if leaks:
            print(report.summary(), file=sys.stderr)
    return {"format": name, "losses": losses, "acc": acc, "seconds": t.seconds,
            "bits": bits_of(name), "leaks": leaks}


def bits_of(name: str) -> float:
    """Bits per value of the format the weights take inside matrix multiplies."""
    if name == "fp32":
        return 32.0
    if name in EXTRA:
        return common.bits_of(recipe_for(name).weight.mm_fmt)
    return common.bits_of(qt.format(name))


def mean(xs):
    return sum(xs) / len(xs)


def make_table(runs, steps) -> str:
    """One row per format: the mean over its seeds' runs, and each seed's test accuracy."""
    base = mean(runs["fp32"]["seconds"]) if "fp32" in runs else None
    window = max(1, min(20, steps // 5))
    rows = []
    for name, r in runs.items():
        final = mean([mean(losses[-window:]) for losses in r["losses"]])
        secs = mean(r["seconds"])
        slow = f"{secs / base:.1f}x" if base else "-"
        rows.append([name, common.fmt_bits(r["bits"]), f"{100 * mean(r['acc']):.1f}%",
                     " / ".join(f"{100 * a:.1f}" for a in r["acc"]), f"{final:.4f}",
                     f"{secs:.1f}", slow, "-" if r["leaks"] is None else str(r["leaks"]),
                     describe_recipe(name)])
    n = len(next(iter(runs.values()))["acc"])
    header = ["format F", "bits/value", f"test acc (mean of {n})", "per seed (%)",
              f"final loss (mean of last {window})", "train time (s)", "vs fp32", "leaks",
              "what is in F"]
    return common.markdown_table(header, rows, align="lrrrrrrrl")


def collect(results):
    """The runs of each format (in order), their per-seed numbers side by side."""
    runs = {}
    for r in results:
        e = runs.setdefault(r["format"], {"bits": r["bits"], "acc": [], "losses": [],
                                          "seconds": [], "leaks": None})
        e["acc"].append(r["acc"])
        e["losses"].append(r["losses"])
        e["seconds"].append(r["seconds"])
        if r["leaks"] is not None:
            e["leaks"] = (e["leaks"] or 0) + r["leaks"]
    return runs


def plot(runs, path, steps):
    plt = common.plt_module()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    colors = plt.get_cmap("tab10").colors
    window = max(1, steps // 30)
    for i, (name, r) in enumerate(runs.items()):
        style = "-" if i < 4 else ("--" if i < 8 else ":")
        losses = [mean(step) for step in zip(*r["losses"])]  # the mean over the seeds
        ax1.plot(common.smooth(losses, window), style, color=colors[i % 10],
                 label=f"{name} ({r['bits']:g} bits)", lw=1.6)
    ax1.set_yscale("log")
    ax1.set_xlabel("training step (batch of 64)")
    n = len(next(iter(runs.values()))["acc"])
    ax1.set_ylabel(f"training loss (mean of {n} seeds, moving average of {window} steps)")
    ax1.set_title("Digits CNN: training loss per format")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=9)
    names = list(runs)
    accs = [100 * mean(r["acc"]) for r in runs.values()]
    spread = [[a - 100 * min(r["acc"]) for a, r in zip(accs, runs.values())],
              [100 * max(r["acc"]) - a for a, r in zip(accs, runs.values())]]
    bars = ax2.barh(range(len(names)), accs, color=[colors[i % 10] for i in range(len(names))],
                    xerr=spread if n > 1 else None, ecolor="black", capsize=3)
    ax2.set_yticks(range(len(names)), names)
    ax2.invert_yaxis()
    # Zoom on the formats that trained; one that failed gets its number written at the left.
    good = [a for a in accs if a >= 50.0] or accs
    lo = max(0.0, min(good) - 3.0)
    ax2.set_xlim(lo, 100)
    for b, a, r in zip(bars, accs, runs.values()):
        y = b.get_y() + b.get_height() / 2
        if a - lo > 1.5:
            ax2.text(lo + 0.2, y, f"{a:.1f}%", va="center", ha="left", color="white",
                     fontsize=9, fontweight="bold")  # clear of the seeds' range at the bar's end
        else:
            seeds = " / ".join(f"{100 * x:.1f}" for x in r["acc"])
            ax2.text(lo + 0.1, y + 0.25, f"{a:.1f}% (seeds: {seeds}%)", va="center", ha="left",
                     color="black", fontsize=9)
    ax2.set_xlabel(f"test accuracy (%), 359 held-out digits: mean and range of {n} seeds"
                   if n > 1 else "test accuracy (%), 359 held-out digits")
    ax2.set_title("Test accuracy after training")
    ax2.grid(True, axis="x", alpha=0.3)
    common.save_figure(fig, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a few steps per format (smoke test)")
    p.add_argument("--steps", type=int, default=None, help="training steps per format")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated format names")
    p.add_argument("--seeds", type=int, default=None,
                   help="training seeds per format (initial weights, batch order); default 3, "
                        "1 with --quick")
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="output folder for demo.md / demo.png (default examples/results/local, "
                        "git-ignored; nothing written with --quick; --out examples/results: the "
                        "committed results)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="first training seed (and the split's)")
    args = p.parse_args(argv)
    steps = args.steps or (6 if args.quick else 300)
    seeds = [args.seed + k for k in range(args.seeds or (1 if args.quick else 3))]
    out = common.output_dir(args.out, args.quick)

    common.setup(args.threads, args.seed)
    data = common.load_digits_split(seed=args.seed)
    names = [n.strip() for n in args.formats.split(",") if n.strip()]
    results = []
    for name, seed in common.progress([(n, s) for n in names for s in seeds], desc="runs",
                                      leave=True):
        results.append(run_format(name, data, steps, seed))

    runs = collect(results)
    table = make_table(runs, steps)
    header = (f"Digits CNN (38k parameters), {steps} SGD steps of 64 images "
              f"(~{steps * BATCH / len(data[0]):.0f} epochs), training seeds "
              f"{', '.join(map(str, seeds))} (each: the same initialisation and batches for "
              f"every format). {common.env_line()}.")
    common.publish(out, "demo", [header, table], lambda path: plot(runs, path, steps))
    return results


if __name__ == "__main__":
    main()

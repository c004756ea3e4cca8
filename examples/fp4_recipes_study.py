"""The FP4 training recipes of 2025 in miniature: a char-GPT and the digits CNN trained in FP32,
naive MXFP4, NVFP4 (with and without its per-tensor scale), the presets ``nvfp4_nvidia``,
``fp4_all_the_way``, ``quartet``, ``mxfp8_pretraining``, ``nvfp4_4over6`` and
``deepseek_v3_fp8``, and the ablations of the NVIDIA recipe (no RHT, no
stochastic gradients, no BF16 last layers); 3 seeds each, mean and spread.

    python examples/fp4_recipes_study.py --threads 1 --out examples/results   # the recorded run
    python examples/fp4_recipes_study.py --quick                             # smoke test (CI)

Every FP4 run keeps values (weights FP32 with FP32 master weights and optimizer, activations
and gradients BF16) and the contractions outside Linear/Conv (attention's batched GEMMs) in
BF16, as the recipes do; they differ only in the operand formats, rounding and transforms of the
three GEMMs (forward, dgrad, wgrad) of each Linear/Conv (``Recipe.gemm``):

- ``mxfp4``: every operand MXFP4 (E2M1, blocks of 32, E8M0 floor scale), round to nearest.
- ``nvfp4``: every operand NVFP4 (E2M1, E4M3 scales of 16, FP32 tensor scale), nearest;
  ``nvfp4_single``: the same without the tensor scale (``qt.nvfp4_single``).
- ``nvfp4_nvidia``, ``fp4_all_the_way``, ``quartet``, ``mxfp8_pretraining``, ``nvfp4_4over6``,
  ``deepseek_v3_fp8``: the presets (``qt.recipes.describe()``).
- ``nvidia-rht``, ``nvidia-sr``, ``nvidia-last``: ``nvfp4_nvidia`` without its wgrad RHT,
  without stochastic rounding of dY, without the BF16 last layers.

Sized for a shared machine (one core, ~3 minutes): a small GPT (2 layers, d=64, context 32)
for 100 AdamW steps of 8x32 characters and the CNN for 60 Adam steps, far shorter than the
papers' runs (billions of tokens): the table says what FP4 costs early in training, at tiny
scale. ``--steps``, ``--batch`` and ``--cnn-steps`` run longer.
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402
import mx_training  # noqa: E402  (its Corpus and mean_loss: the same data pipeline)

import torch  # noqa: E402

import qtensor as qt  # noqa: E402

R = qt.recipes
_ROLES = dict(weight=(qt.fp32, qt.bf16), bias=qt.fp32, activation=qt.bf16, grad=qt.bf16,
              master_weights=True)


def _all_six(fmt):
    return {"fprop": (fmt, fmt), "dgrad": (fmt, fmt), "wgrad": (fmt, fmt)}


def _nvidia(**gemm_changes):
    g = R.nvfp4_nvidia.gemm  # per layer kind (Linear weights in 16x16 blocks, conv 1D)
    return R.nvfp4_nvidia.replace(gemm={k: dataclasses.replace(v, **gemm_changes)
                                        for k, v in g.items()})


RECIPES = {
    "fp32": None,
    "mxfp4": qt.Recipe(**_ROLES, gemm=_all_six(qt.mxfp4_e2m1)),
    "nvfp4": qt.Recipe(**_ROLES, gemm=_all_six(qt.nvfp4)),
    "nvfp4_single": qt.Recipe(**_ROLES, gemm=_all_six(qt.nvfp4_single)),
    "nvfp4_nvidia": R.nvfp4_nvidia,
    "nvidia-rht": _nvidia(wgrad_transform=None),
    "nvidia-sr": _nvidia(dgrad_dy=qt.nvfp4, wgrad_dy=qt.nvfp4),
    "nvidia-last": R.nvfp4_nvidia.replace(last_layers=None),
    "fp4_all_the_way": R.fp4_all_the_way,
    "quartet": R.quartet,
    "mxfp8_pretraining": R.mxfp8_pretraining,
    "nvfp4_4over6": R.nvfp4_4over6,
    "deepseek_v3_fp8": R.deepseek_v3_fp8,
}
LABELS = {
    "fp32": "FP32", "mxfp4": "naive MXFP4 (all operands, nearest)",
    "nvfp4": "naive NVFP4 two-level (all operands, nearest)",
    "nvfp4_single": "naive NVFP4 without tensor scale",
    "nvfp4_nvidia": "qt.recipes.nvfp4_nvidia", "nvidia-rht": "nvfp4_nvidia without wgrad RHT",
    "nvidia-sr": "nvfp4_nvidia without SR on dY",
    "nvidia-last": "nvfp4_nvidia without BF16 last layers",
    "fp4_all_the_way": "qt.recipes.fp4_all_the_way", "quartet": "qt.recipes.quartet",
    "mxfp8_pretraining": "qt.recipes.mxfp8_pretraining", "nvfp4_4over6": "qt.recipes.nvfp4_4over6",
    "deepseek_v3_fp8": "qt.recipes.deepseek_v3_fp8",
}
# What each paper reports for the recipe against its high-precision baseline (at its scale)
PAPER = {
    "nvfp4_nvidia": "12B, 10T tokens: loss within ~1-1.5% of FP8 (2509.25149)",
    "mxfp4": "MXFP4 ~2.5% vs NVFP4 ~1.5% loss gap at 1T tokens (2509.25149)",
    "nvidia-rht": "RHT on wgrad helps at 12B scale (2509.25149)",
    "nvidia-sr": "without SR on gradients: worse, diverges at scale (2509.25149)",
    "nvidia-last": "all layers FP4: diverges at 12B (2509.25149)",
    "fp4_all_the_way": "7B, 200B tokens: downstream on par with BF16 (2505.19115)",
    "quartet": "Llama up to 7B: competitive with FP8/BF16 (2505.14669)",
    "nvfp4_single": "no tensor scale: gradients flush to 0, no training",
    "mxfp8_pretraining": "8B, 15T tokens: MXFP8 matches BF16 (2506.08027)",
    "nvfp4_4over6": "TE's NVFP4 variant: lower block error than 6-only scales",
    "deepseek_v3_fp8": "671B MoE, 14.8T tokens: loss within 0.25% of BF16 (2412.19437)",
}
RUNS = list(RECIPES)
DEFAULTS = dict(d=64, layers=2, heads=4, context=32, batch=8, lr=1e-2, steps=100,
                cnn_steps=60, seeds=3)


def gpt_run(name, corpus, args, seed):
    torch.manual_seed(seed)
    model = common.CharGPT(corpus.vocab, d=args.d, layers=args.layers, heads=args.heads,
                           context=args.context)
    if RECIPES[name] is not None:
        qt.convert(model, RECIPES[name])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.1)
    lr_at = common.warmup_cosine(args.lr, args.steps)

    g = torch.Generator().manual_seed(seed)  # the same batches for every recipe of one seed
    hi = len(corpus.train) - args.context - 1
    losses = []
    for step in range(args.steps):
        losses.append(mx_training.train_step(model, opt, corpus, g, hi, args, lr_at(step)))
    gv = torch.Generator().manual_seed(12345)  # the same validation windows for every run
    starts = torch.randint(0, len(corpus.val) - args.context - 1, (args.eval_windows,),
                           generator=gv)
    val = mx_training.mean_loss(model, corpus.val, starts, args.context, args.batch)
    return losses, val


def cnn_run(name, data, args, seed):
    x_tr, y_tr, x_te, y_te = data
    torch.manual_seed(seed)
    model = common.DigitsCNN()
    if RECIPES[name] is not None:
        qt.convert(model, RECIPES[name])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = common.train_classifier(model, opt, x_tr, y_tr, steps=args.cnn_steps, batch=64,
                                     seed=seed)
    return losses, 100.0 * common.accuracy(model, x_te, y_te)


def summary(values):
    m = statistics.fmean(values)
    spread = (max(values) - min(values)) / 2 if len(values) > 1 else 0.0
    return m, spread


def plot_both(gpt, cnn, path, args):
    plt = common.plt_module()
    fig, axes = plt.subplots(1, 2, figsize=(15, 6))
    cmap = plt.get_cmap("tab10")
    for ax, curves, title, window in (
            (axes[0], gpt, "char-GPT: train loss (mean of seeds, band: min-max)",
             max(1, args.steps // 15)),
            (axes[1], cnn, "digits CNN: train loss", max(1, args.cnn_steps // 15))):
        for i, (name, runs) in enumerate(curves.items()):
            mean = [statistics.fmean(v) for v in zip(*runs)]
            lo, hi = [min(v) for v in zip(*runs)], [max(v) for v in zip(*runs)]
            xs = range(1, len(mean) + 1)
            ax.plot(xs, common.smooth(mean, window), color=cmap(i % 10), lw=1.5,
                    ls="--" if name.startswith("nvidia-") else "-", label=LABELS[name])
            ax.fill_between(xs, common.smooth(lo, window), common.smooth(hi, window),
                            color=cmap(i % 10), alpha=0.12)
        ax.set_title(title)
        ax.set_xlabel("training step")
        ax.set_ylabel("cross-entropy (moving average %d)" % window)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    common.save_figure(fig, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny run (smoke test)")
    p.add_argument("--runs", default=",".join(RUNS), help="comma-separated: " + ",".join(RUNS))
    p.add_argument("--steps", type=int, default=None,
                   help=f"GPT steps per run (default {DEFAULTS['steps']})")
    p.add_argument("--cnn-steps", type=int, default=None,
                   help=f"CNN steps per run (default {DEFAULTS['cnn_steps']}; 0: no CNN)")
    p.add_argument("--seeds", type=int, default=DEFAULTS["seeds"])
    p.add_argument("--d", type=int, default=DEFAULTS["d"])
    p.add_argument("--layers", type=int, default=DEFAULTS["layers"])
    p.add_argument("--heads", type=int, default=DEFAULTS["heads"])
    p.add_argument("--context", type=int, default=DEFAULTS["context"])
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"])
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--eval-windows", type=int, default=256)
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="output folder (default examples/results/local, git-ignored; nothing "
                        "written with --quick; --out examples/results: the committed results)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    command = " ".join(["python examples/fp4_recipes_study.py",
                        *(sys.argv[1:] if argv is None else argv)])
    if args.quick:
        args.steps = args.steps or 3
        args.cnn_steps = 3 if args.cnn_steps is None else args.cnn_steps
        args.seeds, args.d, args.context, args.batch, args.eval_windows = 1, 32, 16, 4, 8
    args.steps = args.steps or DEFAULTS["steps"]
    args.cnn_steps = DEFAULTS["cnn_steps"] if args.cnn_steps is None else args.cnn_steps
    out = common.output_dir(args.out, args.quick)
    common.setup(args.threads, 0)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise SystemExit(f"unknown run(s) {unknown}; known: {', '.join(RECIPES)}")

    corpus = mx_training.Corpus(max_bytes=200_000 if args.quick else 2_000_000)
    data = common.load_digits_split() if args.cnn_steps else None
    gpt_curves, gpt_final, cnn_curves, cnn_final, times = {}, {}, {}, {}, {}
    seeds = list(range(args.seeds))
    for name in common.progress(names, desc="recipes", leave=True):
        with common.Timer() as t:
            runs = [gpt_run(name, corpus, args, s) for s in seeds]
            gpt_curves[name] = [r[0] for r in runs]
            gpt_final[name] = [r[1] for r in runs]
            if data is not None:
                runs = [cnn_run(name, data, args, s) for s in seeds]
                cnn_curves[name] = [r[0] for r in runs]
                cnn_final[name] = [r[1] for r in runs]
        times[name] = t.seconds

    base = statistics.fmean(gpt_final["fp32"]) if "fp32" in gpt_final else None
    rows = []
    for name in names:
        m, s = summary(gpt_final[name])
        last = [statistics.fmean(c[-max(1, args.steps // 10):]) for c in gpt_curves[name]]
        lm, ls = summary(last)
        row = [LABELS[name], f"{m:.3f} ± {s:.3f}",
               "-" if base is None or name == "fp32" else f"{100 * (m - base) / base:+.1f}%",
               f"{lm:.3f} ± {ls:.3f}"]
        if data is not None:
            am, as_ = summary(cnn_final[name])
            row.append(f"{am:.1f} ± {as_:.1f}")
        row += [f"{times[name]:.0f}", PAPER.get(name, "-")]
        rows.append(row)
    header = ["run", "GPT val loss", "vs FP32", "GPT train loss (last 10%)"]
    if data is not None:
        header.append("CNN test acc. (%)")
    header += ["time (s)", "the paper (its scale)"]
    table = common.markdown_table(header, rows)
    title = (f"FP4 training recipes: char-GPT ({args.layers} layers, d={args.d}, context "
             f"{args.context}, batch {args.batch}) for {args.steps} AdamW steps on stdlib source "
             f"(validation: {args.eval_windows} windows); digits CNN for {args.cnn_steps} Adam "
             f"steps (batch 64). {len(seeds)} seeds each (initialisation and batches): mean ± "
             f"half the min-max spread. {common.env_line()}.\n\n"
             f"Command: {command}")
    common.publish(out, "fp4_recipes_study", [title, table],
                   lambda path: plot_both(gpt_curves, cnn_curves, path, args))
    return gpt_final, cnn_final


if __name__ == "__main__":
    main()

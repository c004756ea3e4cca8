"""Post-training quantization: direct cast vs GPTQ vs error diffusion, per format, 3 seeds.

    python examples/ptq_study.py --threads 1 --out examples/results   # ~10 minutes, one core
    python examples/ptq_study.py --quick                              # smoke test, seconds

Two models, each trained in FP32 here once per seed: the digits CNN of examples/demo.py and the
character-level GPT of examples/mx_training.py. Each trained model is then cast without
retraining to each format F in three ways, every one a single call:
- direct cast: ``qt.convert(model, qt.recipes.direct_cast(F))`` (weights and activations enter
  every matrix multiply / convolution rounded to F, FP32 elsewhere: the MX paper's inference);
- GPTQ: ``qt.gptq(model, calib, F)``: the same recipe, with the weights rounded by GPTQ
  (Frantar et al. 2022) from a calibration batch;
- error diffusion: ``qt.error_diffusion(model, calib, F)`` (after arXiv 2410.11203): the same
  recipe, with the weights rounded so that each layer's output error on the calibration batch,
  against the FP32 model's, is diffused into the weights not yet rounded.
The calibration batch comes from the training data (256 digits; 16 windows of 64 characters),
the evaluation from held-out data (359 test digits; 256 validation windows).
"""
from __future__ import annotations

import argparse
import copy
import math
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import qtensor as qt  # noqa: E402

FORMATS = ["mxint8", "mxfp8_e4m3", "mxfp6_e3m2", "mxfp4_e2m1", "nvfp4"]
METHODS = {
    "direct cast": lambda m, calib, f: qt.convert(m, qt.recipes.direct_cast(f)),
    "GPTQ": lambda m, calib, f: qt.gptq(m, calib, f),
    "error diffusion": lambda m, calib, f: qt.error_diffusion(m, calib, f),
}


def mean_sd(values, fmt="{:.4f}", scale=1.0):
    vals = [v * scale for v in values]
    if any(not math.isfinite(v) for v in vals):
        return "NaN"
    if len(vals) == 1:
        return fmt.format(vals[0])
    sd = fmt.replace("+", "").format(statistics.stdev(vals))
    return f"{fmt.format(statistics.mean(vals))} ± {sd}"


# ---------------------------------------------------------------------------------------------
# The digits CNN

@torch.no_grad()
def cnn_eval(model, x, y):
    model.eval()
    logits = common.plain(model(x))
    return float((logits.argmax(1) == y).float().mean()), float(F.cross_entropy(logits, y))


def cnn_runs(args):
    steps = args.steps or (30 if args.quick else 300)
    x_train, y_train, x_test, y_test = common.load_digits_split(seed=0)
    results = {}  # (format, method) -> list of (acc, loss) per seed
    seconds = {}
    for seed in common.progress(args.seed_list, desc="CNN seeds", leave=True):
        torch.manual_seed(seed)
        model = common.DigitsCNN()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        common.train_classifier(model, opt, x_train, y_train, steps=steps, seed=seed,
                                desc="fp32 CNN training")
        results.setdefault(("fp32", ""), []).append(cnn_eval(model, x_test, y_test))
        g = torch.Generator().manual_seed(seed)
        calib = x_train[torch.randperm(len(x_train), generator=g)[:args.calib_digits]]
        for name in args.names:
            for method, run in METHODS.items():
                with common.Timer() as t:
                    m = run(copy.deepcopy(model), calib, name)
                seconds[method] = seconds.get(method, 0.0) + t.seconds
                results.setdefault((name, method), []).append(cnn_eval(m, x_test, y_test))
    acc0 = [a for a, _ in results[("fp32", "")]]
    loss0 = [v for _, v in results[("fp32", "")]]
    header = ["format F", "bits/value"] + [f"{h} ({m})" for m in METHODS
                                           for h in ("acc %", "test loss")]
    rows = [["fp32 (trained)", "32", mean_sd(acc0, "{:.1f}", 100), mean_sd(loss0)]
            + [""] * (len(header) - 4)]
    for name in args.names:
        row = [name, common.fmt_bits(common.bits_of(qt.format(name)))]
        for method in METHODS:
            r = results[(name, method)]
            row += [mean_sd([a for a, _ in r], "{:.1f}", 100), mean_sd([v for _, v in r])]
        rows.append(row)
    title = (f"Digits CNN trained in FP32 ({steps} SGD steps) per seed, cast without retraining; "
             f"359 test digits; mean ± sd over seeds {args.seed_list}; calibration: "
             f"{args.calib_digits} training digits. Time of the casts, all formats and seeds: "
             + ", ".join(f"{m} {s:.1f} s" for m, s in seconds.items()) + ".")
    return title, common.markdown_table(header, rows), results


# ---------------------------------------------------------------------------------------------
# The character-level GPT

def gpt_runs(args):
    import mx_training as mt  # the same model, corpus and evaluation windows
    base = {**mt.DEFAULTS, "evals": 1, "eval_batches": 2 if args.quick else args.eval_batches}
    corpus = mt.Corpus(max_bytes=200_000 if args.quick else None)
    results, seconds = {}, {}
    steps = None
    for seed in common.progress(args.seed_list, desc="GPT seeds", leave=True):
        targs = argparse.Namespace(**{**base, "seed": seed})
        targs.steps = args.gpt_steps or (4 if args.quick else targs.steps)
        if args.quick:
            targs.d, targs.context, targs.batch = 32, 16, 8
        steps = targs.steps
        model = mt.train("fp32", corpus, targs)["model"]
        _, val_eval = mt.eval_windows(corpus, targs)
        g = torch.Generator().manual_seed(seed + 100)
        starts = torch.randint(0, len(corpus.train) - targs.context - 1,
                               (args.calib_windows,), generator=g)
        calib, _ = mt.Corpus.batch(corpus.train, starts, targs.context)

        def val_loss(m):
            return mt.mean_loss(m, corpus.val, val_eval, targs.context, targs.batch)

        results.setdefault(("fp32", ""), []).append(val_loss(model))
        for name in args.names:
            for method, run in METHODS.items():
                with common.Timer() as t:
                    m = run(copy.deepcopy(model), calib, name)
                seconds[method] = seconds.get(method, 0.0) + t.seconds
                results.setdefault((name, method), []).append(val_loss(m))
    loss0 = results[("fp32", "")]
    rows = [["fp32 (trained)", "32", mean_sd(loss0), "", "", "", "", ""]]
    for name in args.names:
        row = [name, common.fmt_bits(common.bits_of(qt.format(name)))]
        for method in METHODS:
            r = results[(name, method)]
            row += [mean_sd(r), mean_sd([a - b for a, b in zip(r, loss0)], "{:+.4f}")]
        rows.append(row)
    header = ["format F", "bits/value"] + [f"{h} ({m})" for m in METHODS
                                           for h in ("val loss", "vs fp32")]
    title = (f"Character-level GPT of examples/mx_training.py trained in FP32 ({steps} AdamW "
             f"steps) per seed, cast without retraining; validation loss in nats/character over "
             f"{base['eval_batches'] * base['batch']} windows; mean ± sd over seeds "
             f"{args.seed_list}; calibration: {args.calib_windows} training windows. Time of the "
             "casts, all formats and seeds: "
             + ", ".join(f"{m} {s:.1f} s" for m, s in seconds.items()) + ".")
    return title, common.markdown_table(header, rows), results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="short FP32 trainings (smoke test)")
    p.add_argument("--steps", type=int, default=None, help="FP32 training steps of the CNN")
    p.add_argument("--gpt-steps", type=int, default=None, help="FP32 training steps of the GPT")
    p.add_argument("--models", default="cnn,gpt", help="cnn, gpt or both")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--seeds", type=int, default=3, help="trainings per model (seeds S, S+1, ...)")
    p.add_argument("--seed", type=int, default=0, help="the first seed S")
    p.add_argument("--calib-digits", type=int, default=256)
    p.add_argument("--calib-windows", type=int, default=16)
    p.add_argument("--eval-batches", type=int, default=8,
                   help="GPT validation batches of 32 windows")
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="output folder (default examples/results/local, git-ignored; nothing "
                        "written with --quick; --out examples/results: the committed results)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    args.names = [n.strip() for n in args.formats.split(",") if n.strip()]
    n_seeds = 1 if args.quick and args.seeds == 3 else args.seeds
    args.seed_list = list(range(args.seed, args.seed + n_seeds))
    out = common.output_dir(args.out, args.quick)

    common.setup(args.threads, 0)
    models = [m.strip() for m in args.models.split(",")]
    sections = []
    start = time.perf_counter()
    if "cnn" in models:
        sections.append(cnn_runs(args)[:2])
    if "gpt" in models:
        sections.append(gpt_runs(args)[:2])
    minutes = (time.perf_counter() - start) / 60
    command = "python examples/ptq_study.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (f"Post-training quantization: direct cast vs GPTQ vs error diffusion. `{command}` "
            f"({minutes:.1f} min). {common.env_line()}.\n\n"
            + "\n\n".join(f"{title}\n\n{table}" for title, table in sections))
    common.publish(out, "ptq_study", [text])
    return sections


if __name__ == "__main__":
    main()

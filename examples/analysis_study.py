"""Where precision is lost, and a mixed recipe for a bit budget: qt.analyze and qt.suggest_recipe
on the digits CNN and the character-level GPT, trained in FP32 and cast without retraining.

    python examples/analysis_study.py --threads 1 --out examples/results   # the recorded run
    python examples/analysis_study.py --quick                               # smoke test (CI)

For each model and each of 3 training seeds: train in FP32; on one calibration batch of training
data, ``qt.analyze`` each candidate direct-cast recipe (``qt.recipes.direct_cast(F)``: the
weights and activations of every contraction rounded to F, FP32 values) with the sensitivity of
every layer and of its weights alone; then ``qt.suggest_recipe`` mixes the weight formats (one
per layer, greedy on the KL of the outputs per bit) within the weight bits of a uniform recipe,
with that recipe's activation formats, and both are evaluated on held-out data:

- budget of uniform MXFP6_E3M2 (6.25 bits per contraction weight): weights from MXFP8_E4M3,
  MXFP6_E3M2 and MXFP4_E2M1, activations MXFP6_E3M2;
- budget of uniform NVFP4 (4.5 bits): weights from those and NVFP4, activations NVFP4;
- "suggested layers": one candidate per layer for its weights and its output together
  (``decide="layer"``), within the uniform recipe's bits per weight and activation (its layers'
  outputs on the calibration batch counted too); modules without parameters keep the uniform
  recipe's formats.

Bits per weight are those of ``qt.suggest_recipe`` (docs/analysis.md) over the parameters of
the contraction layers (Linear and Conv weights at their operand format, their biases at the
32 bits of FP32); the same count for the uniform recipe and the suggestion, so "equal bits" is
exact (embeddings and norms stay FP32 in every recipe and are not counted). Seed 0's analysis report of direct-cast MXFP4_E2M1 is
written with its plot for each model (analysis_study_cnn.md/.png, analysis_study_gpt.md/.png).
"""
from __future__ import annotations

import argparse
import copy
import math
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import qtensor as qt  # noqa: E402
from qtensor.analysis.contractions import CONTRACTIONS  # noqa: E402
from qtensor.analysis.suggest import suggestion  # noqa: E402

CANDIDATES = ["mxfp8_e4m3", "mxfp6_e3m2", "nvfp4", "mxfp4_e2m1"]
# (uniform recipe whose weight bits are the budget and whose activations the suggestion keeps,
#  candidate weight formats)
BUDGETS = [("mxfp6_e3m2", ["mxfp8_e4m3", "mxfp6_e3m2", "mxfp4_e2m1"]),
           ("nvfp4", ["mxfp8_e4m3", "mxfp6_e3m2", "nvfp4", "mxfp4_e2m1"])]
REPORT_FORMAT = "mxfp4_e2m1"  # the analysis report written with its plot (seed 0)


def cast(model, recipe):
    return qt.convert(copy.deepcopy(model), recipe)


def analyse(model, batch, loss_fn, names, progress):
    """One qt.analyze report per candidate format: the sensitivity of every contraction layer
    (Linear, Conv) as a whole and of its weights alone."""
    layers = [n for n, m in model.named_modules() if isinstance(m, CONTRACTIONS)]
    return {n: qt.analyze(model, batch, qt.recipes.direct_cast(n), loss_fn, roles=("weight",),
                          layers=layers, progress=progress) for n in names}


WA = ("weight", "activation")


def suggestions(reports, model, batch, loss_fn):
    """{label: (recipe, bits per weight, bits per weight+activation)} for the uniform recipes
    and, for every budget, the suggested weights (activations of the uniform recipe) and the
    suggested layers (weights and outputs together, within the uniform recipe's bits per
    weight+activation)."""
    out = {}
    for n in CANDIDATES:
        out[f"uniform {n}"] = (reports[n].recipe, reports[n].bits(), reports[n].bits(WA))
    layers = [r["layer"] for r in reports[CANDIDATES[0]].sensitivity if r["role"] == "all"]
    for uniform, names in BUDGETS:
        base = reports[uniform]
        options = [reports[n] for n in names]
        mixed = {
            f"suggested @ {uniform} bits": suggestion(options, base.bits(), decide=("weight",),
                                                      base=base).recipe,
            f"suggested layers @ {uniform} bits": suggestion(
                options, base.bits(WA), decide="layer", count=WA, base=base).recipe}
        for label, recipe in mixed.items():  # both counts, read off the recipe's own plans
            r = qt.analyze(model, batch, recipe, loss_fn, sensitivity=False)
            out[label] = (recipe, r.bits(layers=layers), r.bits(WA, layers=layers))
    return out


# ---------------------------------------------------------------------------------------------
# The digits CNN

def cnn_seed(seed, args):
    x_train, y_train, x_test, y_test = common.load_digits_split(seed=0)
    torch.manual_seed(seed)
    model = common.DigitsCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    common.train_classifier(model, opt, x_train, y_train, steps=args.cnn_steps, seed=seed,
                            desc=f"CNN fp32 seed {seed}")
    g = torch.Generator().manual_seed(100 + seed)
    idx = torch.randperm(len(x_train), generator=g)[:args.cnn_calib]
    xc, yc = x_train[idx], y_train[idx]
    loss_fn = lambda o: F.cross_entropy(o, yc)  # noqa: E731
    reports = analyse(model, xc, loss_fn, CANDIDATES, args.progress)

    @torch.no_grad()
    def evaluate(m):
        m.eval()
        logits = common.plain(m(x_test)).double()
        return {"acc": float((logits.argmax(1) == y_test).double().mean()),
                "loss": float(F.cross_entropy(logits, y_test)), "logits": logits}

    ref = evaluate(model)
    rows = {"fp32": {**ref, "bits": 32.0, "bits_wa": 32.0, "kl": 0.0}}
    for label, (recipe, bits, bits_wa) in suggestions(reports, model, xc, loss_fn).items():
        r = evaluate(cast(model, recipe))
        r["kl"] = _kl(ref["logits"], r["logits"])
        rows[label] = {**r, "bits": bits, "bits_wa": bits_wa}
    return rows, reports


def _kl(ref, out):
    lp, lq = F.log_softmax(ref, -1), F.log_softmax(out, -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


# ---------------------------------------------------------------------------------------------
# The character-level GPT

def gpt_seed(seed, args, corpus):
    import mx_training as mt
    targs = argparse.Namespace(**{**mt.DEFAULTS, "evals": 1, "seed": seed,
                                  "eval_batches": args.gpt_eval_batches})
    targs.steps = args.gpt_steps
    targs.d, targs.context = args.gpt_d, args.gpt_context
    model = mt.train("fp32", corpus, targs)["model"]
    _, val_eval = mt.eval_windows(corpus, targs)
    g = torch.Generator().manual_seed(100 + seed)
    starts = torch.randint(0, len(corpus.train) - targs.context - 1, (args.gpt_calib,),
                           generator=g)
    xc, yc = mt.Corpus.batch(corpus.train, starts, targs.context)

    def loss_fn(out):
        return F.cross_entropy(common.plain(out).reshape(-1, out.shape[-1]), yc.reshape(-1))

    reports = analyse(model, xc, loss_fn, CANDIDATES, args.progress)

    def evaluate(m):
        return {"loss": mt.mean_loss(m, corpus.val, val_eval, targs.context, targs.batch)}

    rows = {"fp32": {**evaluate(model), "bits": 32.0, "bits_wa": 32.0}}
    for label, (recipe, bits, bits_wa) in suggestions(reports, model, xc, loss_fn).items():
        rows[label] = {**evaluate(cast(model, recipe)), "bits": bits, "bits_wa": bits_wa}
    return rows, reports, targs


# ---------------------------------------------------------------------------------------------
# Tables

def mean_spread(values, fmt="{:.4f}", scale=1.0):
    vals = [v * scale for v in values]
    if not all(math.isfinite(v) for v in vals):
        return "NaN"
    m = statistics.fmean(vals)
    s = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return f"{fmt.format(m)} ± {fmt.format(s)}"


def order(labels):
    first = ["fp32"] + [f"uniform {n}" for n in CANDIDATES]
    rest = [l for l in labels if l not in first]
    out = []
    for uniform, _names in BUDGETS:  # each suggestion under its uniform recipe
        out += [f"uniform {uniform}", f"suggested @ {uniform} bits",
                f"suggested layers @ {uniform} bits"]
    return ["fp32"] + [l for l in first[1:] if l not in out] + out + [
        l for l in rest if l not in out]


def cnn_table(per_seed):
    labels = order(per_seed[0])
    rows = []
    for label in labels:
        vals = [r[label] for r in per_seed]
        rows.append([label, f"{vals[0]['bits']:.3f}", f"{vals[0]['bits_wa']:.3f}",
                     mean_spread([v["acc"] for v in vals], "{:.2f}", 100),
                     " / ".join(f"{100 * v['acc']:.1f}" for v in vals),
                     mean_spread([v["loss"] for v in vals]),
                     mean_spread([v["kl"] for v in vals], "{:.5f}")])
    header = ["recipe (direct cast)", "bits per weight (seed 0)", "per weight+activation",
              "test acc % (mean ± sd)",
              "per seed", "test loss", "KL vs fp32"]
    return common.markdown_table(header, rows)


def gpt_table(per_seed):
    labels = order(per_seed[0])
    rows = []
    for label in labels:
        vals = [r[label] for r in per_seed]
        rows.append([label, f"{vals[0]['bits']:.3f}", f"{vals[0]['bits_wa']:.3f}",
                     mean_spread([v["loss"] for v in vals]),
                     " / ".join(f"{v['loss']:.4f}" for v in vals),
                     mean_spread([v["loss"] - r["fp32"]["loss"] for v, r in zip(vals, per_seed)],
                                 "{:+.4f}")])
    header = ["recipe (direct cast)", "bits per weight (seed 0)", "per weight+activation",
              "val loss (mean ± sd)",
              "per seed", "vs fp32 (mean ± sd)"]
    return common.markdown_table(header, rows)


def choices_table(reports):
    """Seed 0: which weight format each layer took, with its weight-only sensitivity."""
    out = []
    for uniform, names in BUDGETS:
        s = suggestion([reports[n] for n in names], reports[uniform].bits(),
                       decide=("weight",), base=reports[uniform])
        sens = {n: {r["layer"]: r["kl"] for r in reports[n].sensitivity if r["role"] == "weight"}
                for n in names}
        rows = [[c["layer"], c["choice"].replace("direct_cast(", "").rstrip(")"),
                 f"{c['bits']:.3f}"] + [f"{sens[n].get(c['layer'], 0.0):.3g}" for n in names]
                for c in s.choices if any(sens[n].get(c["layer"], 0.0) > 0 for n in names)]
        header = ["layer", "weights in", "bits"] + [f"KL, weights in {n}" for n in names]
        out.append(f"Budget of uniform {uniform} ({s.budget:.3f} bits per weight): "
                   f"{s.bits:.3f} bits; activations {uniform}.\n\n"
                   + common.markdown_table(header, rows))
    return "\n\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny trainings and batches (CI)")
    p.add_argument("--models", default="cnn,gpt")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--cnn-steps", type=int, default=None)
    p.add_argument("--cnn-calib", type=int, default=256, help="calibration images")
    p.add_argument("--gpt-steps", type=int, default=None)
    p.add_argument("--gpt-d", type=int, default=None)
    p.add_argument("--gpt-context", type=int, default=None)
    p.add_argument("--gpt-calib", type=int, default=None, help="calibration windows")
    p.add_argument("--gpt-eval-batches", type=int, default=None)
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="output folder (default examples/results/local, git-ignored; nothing "
                        "written with --quick; --out examples/results: the committed results)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--progress", action="store_true", help="tqdm bars over qt.analyze's layers")
    args = p.parse_args(argv)
    q = args.quick
    args.cnn_steps = args.cnn_steps or (20 if q else 300)
    args.gpt_steps = args.gpt_steps or (3 if q else 300)
    args.gpt_d = args.gpt_d or (32 if q else 64)
    args.gpt_context = args.gpt_context or (16 if q else 64)
    args.gpt_calib = args.gpt_calib or (2 if q else 8)
    args.gpt_eval_batches = args.gpt_eval_batches or (1 if q else 8)
    if q:
        args.seeds = min(args.seeds, 2)
        args.cnn_calib = min(args.cnn_calib, 32)
    out = common.output_dir(args.out, args.quick)
    common.setup(args.threads, 0)
    models = [m.strip() for m in args.models.split(",")]
    command = "python examples/analysis_study.py " + " ".join(argv if argv is not None
                                                               else sys.argv[1:])
    sections = [f"Analysis and suggested mixed recipes, no retraining. `{command.strip()}`. "
                f"{common.env_line()}."]
    with common.Timer() as total:
        if "cnn" in models:
            with common.Timer() as t:
                per_seed, first = [], None
                for seed in range(args.seeds):
                    rows, reports = cnn_seed(seed, args)
                    per_seed.append(rows)
                    first = first or reports
            sections += [
                f"## Digits CNN\n\nTrained in FP32 ({args.cnn_steps} SGD steps; seeds "
                f"{', '.join(map(str, range(args.seeds)))}), analysed on {args.cnn_calib} training "
                f"images, evaluated on the 360 test digits ({t.seconds:.0f} s).",
                cnn_table(per_seed), "Seed 0's choices:", choices_table(first)]
            if out is not None:
                write_report(out, "analysis_study_cnn", first[REPORT_FORMAT])
        if "gpt" in models:
            import mx_training as mt
            corpus = mt.Corpus(max_bytes=200_000 if q else None)
            with common.Timer() as t:
                per_seed, first = [], None
                for seed in range(args.seeds):
                    rows, reports, targs = gpt_seed(seed, args, corpus)
                    per_seed.append(rows)
                    first = first or reports
            sections += [
                f"## Character-level GPT\n\n`examples/mx_training.py`'s model (d={targs.d}, "
                f"{targs.layers} blocks, context {targs.context}) trained in FP32 "
                f"({targs.steps} AdamW steps; seeds {', '.join(map(str, range(args.seeds)))}), "
                f"analysed on {args.gpt_calib} training windows, evaluated on "
                f"{targs.eval_batches * targs.batch} validation windows (nats/character; "
                f"{t.seconds:.0f} s).",
                gpt_table(per_seed), "Seed 0's choices:", choices_table(first)]
            if out is not None:
                write_report(out, "analysis_study_gpt", first[REPORT_FORMAT])
    sections.append(f"Total {total.seconds:.0f} s.")
    common.publish(out, "analysis_study", sections)


def write_report(out, name, report):
    common.save_text(out / f"{name}.md", report.markdown())
    report.plot(out / f"{name}.png")
    print(f"wrote {out / name}.md and .png")


if __name__ == "__main__":
    main()

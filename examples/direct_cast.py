"""Direct-cast inference: FP32-trained models evaluated in MX/NVFP4 formats without retraining.

    python examples/direct_cast.py           # ~2 minutes on 2 CPU cores
    python examples/direct_cast.py --quick   # short FP32 trainings, for CI

Two models, each trained in FP32 here first: the digits CNN of examples/demo.py (~1 s) and the
character-level GPT of examples/mx_training.py (500 steps, ~1 min), whose validation loss shows
differences that the 359 test digits are too few and too easy to show.

The MX paper (Rouhani et al., 2023, "direct-cast inference") reports that a pretrained FP32
model cast to MXINT8 keeps its accuracy without any finetuning, MXFP8 nearly so, while MXFP6 and
especially MXFP4 lose accuracy unless the model is finetuned or trained in the format.

Two ways of casting, each one ``qt.convert`` line (see ``cast``):
- "matmul operands": weights keep FP32 values; every matrix multiply / convolution rounds its
  weight and activation operands to F (blocked along the reduction dimension), accumulates in
  FP32 (the MX paper's inference setting; ``qt.recipes.mxint8_inference`` is its MXINT8 case).
- "every value": the weights are stored in F and every activation is rounded to F (stricter: the
  element-wise ops, bias additions and pooling also see F).
Besides accuracy on the 359 test digits (coarse: one image is 0.28%), the table gives the test
cross-entropy and the share of test images whose predicted class equals the FP32 model's,
which show smaller differences.
"""
from __future__ import annotations

import argparse
import copy
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import qtensor as qt  # noqa: E402

FORMATS = ["bf16", "fp8_e4m3", "mxint8", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2",
           "mxfp6_e2m3", "mxfp4_e2m1", "nvfp4"]


def cast(model, name: str, mode: str):
    """A converted copy of ``model``: mode "operands" or "values" (see the module docstring)."""
    m = copy.deepcopy(model)
    fmt = qt.format(name)
    if mode == "operands":
        qt.convert(m, qt.recipes.direct_cast(fmt))  # F at matmul operands, FP32 values
    else:
        qt.convert(m, fmt)
    return m


@torch.no_grad()
def evaluate(model, x, y, ref_pred=None):
    model.eval()
    logits = model(x)
    loss = float(F.cross_entropy(common.plain(logits), y))  # in FP32: the logits' exact loss
    pred = logits.argmax(dim=1)
    acc = float((pred == y).float().mean())
    agree = float((pred == ref_pred).float().mean()) if ref_pred is not None else 1.0
    return acc, loss, agree, pred


def digits_study(args):
    steps = args.steps or (30 if args.quick else 300)
    x_train, y_train, x_test, y_test = common.load_digits_split(seed=args.seed)
    torch.manual_seed(args.seed)
    model = common.DigitsCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    common.train_classifier(model, opt, x_train, y_train, steps=steps, seed=args.seed,
                            desc="fp32 CNN training")
    acc0, loss0, _, ref_pred = evaluate(model, x_test, y_test)

    rows = [["fp32 (trained)", "32", f"{100 * acc0:.1f}%", f"{loss0:.4f}", "100.0%",
             f"{100 * acc0:.1f}%", f"{loss0:.4f}", "100.0%"]]
    for name in common.progress(args.names, desc="CNN formats", leave=True):
        row = [name, common.fmt_bits(common.bits_of(qt.format(name)))]
        for mode in ("operands", "values"):
            acc, loss, agree, _ = evaluate(cast(model, name, mode), x_test, y_test, ref_pred)
            row += [f"{100 * acc:.1f}%", f"{loss:.4f}", f"{100 * agree:.1f}%"]
        rows.append(row)
    m = copy.deepcopy(model)
    qt.convert(m, qt.recipes.mxint8_inference)
    acc, loss, agree, _ = evaluate(m, x_test, y_test, ref_pred)
    rows.append(["qt.recipes.mxint8_inference", "8.25", f"{100 * acc:.1f}%", f"{loss:.4f}",
                 f"{100 * agree:.1f}%", "", "", ""])
    header = ["format F", "bits/value", "acc (matmul operands in F)", "test loss",
              "same as fp32", "acc (every value in F)", "test loss", "same as fp32"]
    title = (f"Digits CNN trained in FP32 ({steps} SGD steps), cast without retraining; 359 test "
             "digits; \"same as fp32\": share of test digits whose predicted class is the FP32 "
             "model's.")
    return title, common.markdown_table(header, rows)


def gpt_study(args):
    import mx_training as mt  # the same model, corpus and evaluation windows
    targs = argparse.Namespace(**{**mt.DEFAULTS, "evals": 1, "seed": args.seed,
                                  "eval_batches": 1 if args.quick else 16})
    targs.steps = args.gpt_steps or (4 if args.quick else targs.steps)
    if args.quick:
        targs.d, targs.context, targs.batch = 32, 16, 8
    corpus = mt.Corpus(max_bytes=200_000 if args.quick else None)
    model = mt.train("fp32", corpus, targs)["model"]
    _, val_eval = mt.eval_windows(corpus, targs)

    def val_loss(m):
        return mt.mean_loss(m, corpus.val, val_eval, targs.context, targs.batch)

    loss0 = val_loss(model)
    rows = [["fp32 (trained)", "32", f"{loss0:.4f}", "+0.0000", f"{loss0:.4f}", "+0.0000"]]
    for name in common.progress(args.names, desc="GPT formats", leave=True):
        row = [name, common.fmt_bits(common.bits_of(qt.format(name)))]
        for mode in ("operands", "values"):
            loss = val_loss(cast(model, name, mode))
            row += ([f"{loss:.4f}", f"{loss - loss0:+.4f}"] if math.isfinite(loss)
                    else ["NaN (note)", ""])
        rows.append(row)
    header = ["format F", "bits/value", "val loss (matmul operands in F)", "vs fp32",
              "val loss (every value in F)", "vs fp32"]
    title = (f"Character-level GPT of examples/mx_training.py trained in FP32 ({targs.steps} AdamW "
             f"steps), cast without retraining; validation loss in nats/character over "
             f"{len(val_eval)} windows of {targs.context} characters.")
    table = common.markdown_table(header, rows)
    if any("NaN" in c for r in rows for c in r):
        table += ("\n\nNaN (note): with every value in an MX format, the attention scores are "
                  "stored in MX too, and the causal mask's -inf makes each 32-value block that "
                  "holds it NaN (OCP MX: a block with an Inf or NaN is all NaN). The MX paper "
                  "keeps such vector ops (softmax and its mask) in BF16/FP32, as the \"matmul "
                  "operands\" columns do.")
    return title, table


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="short FP32 trainings (smoke test)")
    p.add_argument("--steps", type=int, default=None, help="FP32 training steps of the CNN")
    p.add_argument("--gpt-steps", type=int, default=None, help="FP32 training steps of the GPT")
    p.add_argument("--models", default="cnn,gpt", help="cnn, gpt or both")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="output folder (default examples/results/local, git-ignored; nothing "
                        "written with --quick; --out examples/results: the committed results)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.names = [n.strip() for n in args.formats.split(",") if n.strip()]
    out = common.output_dir(args.out, args.quick)

    common.setup(args.threads, args.seed)
    models = [m.strip() for m in args.models.split(",")]
    sections = []
    if "cnn" in models:
        sections.append(digits_study(args))
    if "gpt" in models:
        sections.append(gpt_study(args))
    text = f"Direct-cast inference, no retraining. {common.env_line()}.\n\n" + "\n\n".join(
        f"{title}\n\n{table}" for title, table in sections)
    common.publish(out, "direct_cast", [text])
    return sections


if __name__ == "__main__":
    main()

"""Direct-cast inference: an FP32-trained model evaluated in MX/NVFP4 formats without retraining.

    python examples/direct_cast.py           # trains the FP32 digits CNN (~1 s), then casts it
    python examples/direct_cast.py --quick   # a short FP32 training, for CI

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
        qt.convert(m, qt.Recipe(weight=(qt.fp32, fmt), bias=qt.fp32,
                                activation=(qt.fp32, fmt), grad=None))
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="short FP32 training (smoke test)")
    p.add_argument("--steps", type=int, default=None, help="FP32 training steps")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="output folder (default examples/results; nothing written with --quick)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    steps = args.steps or (30 if args.quick else 300)
    out = args.out if args.out is not None else (None if args.quick else common.RESULTS_DIR)

    common.setup(args.threads, args.seed)
    x_train, y_train, x_test, y_test = common.load_digits_split(seed=args.seed)
    torch.manual_seed(args.seed)
    model = common.DigitsCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    common.train_classifier(model, opt, x_train, y_train, steps=steps, seed=args.seed,
                            desc="fp32 training")
    acc0, loss0, _, ref_pred = evaluate(model, x_test, y_test)

    rows = [["fp32 (trained)", "32", f"{100 * acc0:.1f}%", f"{loss0:.4f}", "100.0%",
             f"{100 * acc0:.1f}%", f"{loss0:.4f}", "100.0%"]]
    names = [n.strip() for n in args.formats.split(",") if n.strip()]
    for name in common.progress(names, desc="formats", leave=True):
        row = [name, common.fmt_bits(common.bits_of(qt.format(name)))]
        for mode in ("operands", "values"):
            acc, loss, agree, _ = evaluate(cast(model, name, mode), x_test, y_test, ref_pred)
            row += [f"{100 * acc:.1f}%", f"{loss:.4f}", f"{100 * agree:.1f}%"]
        rows.append(row)
    if "mxint8" in names and hasattr(qt, "recipes"):
        m = copy.deepcopy(model)
        qt.convert(m, qt.recipes.mxint8_inference)
        acc, loss, agree, _ = evaluate(m, x_test, y_test, ref_pred)
        rows.append(["qt.recipes.mxint8_inference", "8.25", f"{100 * acc:.1f}%", f"{loss:.4f}",
                     f"{100 * agree:.1f}%", "", "", ""])

    header = ["format F", "bits/value", "acc (matmul operands in F)", "loss", "same as fp32",
              "acc (every value in F)", "loss", "same as fp32"]
    table = common.markdown_table(header, rows)
    title = (f"Direct-cast inference of the FP32 digits CNN ({steps} FP32 training steps), "
             f"359 test digits, no retraining. {common.env_line()}.")
    print()
    print(title)
    print()
    print(table)
    if out is not None:
        common.save_text(out / "direct_cast.md", title + "\n\n" + table)
        print(f"\nwrote {out / 'direct_cast.md'}")
    return rows


if __name__ == "__main__":
    main()

"""The MX paper's training study in miniature: a GPT trained in FP32, MXFP6 and MXFP4+MXFP6.

    python examples/mx_training.py               # the recorded run (see examples/RESULTS.md), ~7 min
    python examples/mx_training.py --quick       # a few steps (CI)

Rouhani et al. (2023), "Microscaling Data Formats for Deep Learning", train GPT models with the
same hyperparameters in FP32, in MXFP6_E3M2 (weights, activations and gradients of every matrix
multiply) and with MXFP4 weights plus MXFP6_E3M2 activations and gradients; at 20M parameters
their final training losses are 3.98 / 4.01 / 4.04. Here the same three settings train a small
character-level GPT (2 layers, d=128, context 64, ~0.4M parameters) on Python's own
standard-library source (the top-level ``*.py`` files of ``sysconfig.get_paths()["stdlib"]``,
sorted, as bytes; the last 10% is the validation text). Every run uses the same initial weights,
batches, optimizer (AdamW, cosine schedule) and steps; only the arithmetic differs:

- FP32: plain PyTorch.
- ``qt.recipes.mxfp6``: every matrix multiply (linear layers and both attention products, forward
  and backward) rounds its weight, activation and gradient operands to MXFP6_E3M2, blocked along
  the reduction dimension, accumulating in FP32; vector ops in BF16; FP32 master weights.
- ``qt.recipes.mxfp4_weights``: the same with MXFP4_E2M1 weight operands.

The corpus depends on the Python version (3.11 here), so losses are comparable between runs on
one machine, not across Python versions.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import qtensor as qt  # noqa: E402

# "fp32@1": FP32 again with another training seed (initialisation and batch order): the
# seed-to-seed spread, against which the format gaps are to be read.
RUNS = ["fp32", "mxfp6", "mxfp4_weights", "fp32@1"]
LABELS = {"fp32": "FP32", "mxfp6": "MXFP6_E3M2 (W, A, G)",
          "mxfp4_weights": "MXFP4 weights + MXFP6_E3M2 (A, G)",
          "fp32@1": "FP32, another seed (noise level)"}
# Ablations (not run by default; see examples/RESULTS.md): which part of the MXFP6 recipe costs.
ABLATIONS = {
    "bf16_values": dict(weight=qt.fp32, bias=qt.fp32, activation=qt.bf16, grad=qt.bf16,
                        master_weights=True),
    "mxfp6_fp32_values": dict(weight=(qt.fp32, qt.mxfp6_e3m2), bias=qt.fp32,
                              activation=(qt.fp32, qt.mxfp6_e3m2),
                              grad=(qt.fp32, qt.mxfp6_e3m2), master_weights=True),
    "mxfp6_forward_only": dict(weight=(qt.fp32, qt.mxfp6_e3m2), bias=qt.fp32,
                               activation=(qt.fp32, qt.mxfp6_e3m2), grad=qt.fp32,
                               master_weights=True),
    # the MX recipe with the ceil scale rule on the gradient operands: what OCP's floor rule's
    # clipping of dL/dlogits (~6% of its L1 norm at the start) costs
    "mxfp6_grad_ceil": dict(weight=(qt.fp32, qt.mxfp6_e3m2), bias=qt.fp32,
                            activation=(qt.bf16, qt.mxfp6_e3m2),
                            grad=(qt.bf16, qt.mxfp6_e3m2.replace(scale_rule="ceil")),
                            master_weights=True),
}
LABELS.update({"bf16_values": "ablation: BF16 values, no MX",
               "mxfp6_grad_ceil": "ablation: MXFP6, ceil scale rule on gradient operands",
               "mxfp6_fp32_values": "ablation: MXFP6 operands, FP32 values",
               "mxfp6_forward_only": "ablation: MXFP6 forward operands only"})
# The recorded run: ~7 minutes for the four runs on 2 CPU cores.
DEFAULTS = dict(d=128, layers=2, heads=4, context=64, batch=32, lr=1e-2, steps=500)
PAPER_20M = {"fp32": 3.98, "mxfp6": 4.01, "mxfp4_weights": 4.04}


class Corpus:
    def __init__(self, max_bytes=None, val_fraction=0.1):
        text = common.load_stdlib_text(max_bytes)
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        symbols = torch.unique(data)                     # bytes that occur: the vocabulary
        lookup = torch.zeros(256, dtype=torch.long)
        lookup[symbols] = torch.arange(len(symbols))
        data = lookup[data]
        n_val = int(len(data) * val_fraction)
        self.vocab = len(symbols)
        self.train, self.val = data[:-n_val], data[-n_val:]
        self.n_bytes = len(text)

    @staticmethod
    def batch(data, starts, context):
        idx = starts[:, None] + torch.arange(context + 1)
        chunk = data[idx]
        return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def mean_loss(model, data, starts, context, batch):
    model.eval()
    total = 0.0
    for i in range(0, len(starts), batch):
        x, y = Corpus.batch(data, starts[i:i + batch], context)
        logits = common.plain(model(x))  # the loss of the emulated logits, computed in FP32
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       y.reshape(-1))) * len(x)
    model.train()
    return total / len(starts)


def eval_windows(corpus, args):
    """Start offsets of the fixed train and validation windows every run is evaluated on."""
    g = torch.Generator().manual_seed(args.seed + 1)
    n = args.eval_batches * args.batch
    train_eval = torch.randint(0, len(corpus.train) - args.context - 1, (n,), generator=g)
    val_eval = torch.randint(0, len(corpus.val) - args.context - 1, (n,), generator=g)
    return train_eval, val_eval


def train_step(model, opt, corpus, g, hi, args, lr):
    """One AdamW step of the char-GPT on a batch of training windows drawn with g (starts below
    hi), at learning rate lr, gradients clipped to norm 1; its loss, recorded in FP32 from the
    emulated logits (see common.py)."""
    for group in opt.param_groups:
        group["lr"] = lr
    x, y = Corpus.batch(corpus.train, torch.randint(0, hi, (args.batch,), generator=g),
                        args.context)
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    with torch.no_grad():
        flat = common.plain(logits.detach()).reshape(-1, logits.shape[-1])
        return float(F.cross_entropy(flat, y.reshape(-1)))


def train(name, corpus, args):
    recipe, _, offset = name.partition("@")
    seed = args.seed + int(offset or 0)
    torch.manual_seed(seed)
    model = common.CharGPT(corpus.vocab, d=args.d, layers=args.layers, heads=args.heads,
                           context=args.context)
    if recipe in ABLATIONS:
        qt.convert(model, qt.Recipe(**ABLATIONS[recipe]))
    elif recipe != "fp32":
        qt.convert(model, getattr(qt.recipes, recipe))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    lr_at = common.warmup_cosine(args.lr, args.steps)

    g = torch.Generator().manual_seed(seed)  # the same batches for every run of one seed
    hi = len(corpus.train) - args.context - 1
    train_eval, val_eval = eval_windows(corpus, args)
    losses, val_curve = [], []
    eval_every = max(1, args.steps // args.evals)
    with common.Timer() as t:
        for step in common.progress(range(args.steps), desc=f"{name:>13}"):
            losses.append(train_step(model, opt, corpus, g, hi, args, lr_at(step)))
            if (step + 1) % eval_every == 0 and step + 1 < args.steps:
                val_curve.append((step + 1, mean_loss(model, corpus.val, val_eval[:args.batch * 2],
                                                      args.context, args.batch)))
    train_loss = mean_loss(model, corpus.train, train_eval, args.context, args.batch)
    val_loss = mean_loss(model, corpus.val, val_eval, args.context, args.batch)
    val_curve.append((args.steps, val_loss))
    n_params = sum(p.numel() for p in model.parameters())
    return {"name": name, "losses": losses, "val_curve": val_curve, "train_loss": train_loss,
            "val_loss": val_loss, "seconds": t.seconds, "params": n_params, "model": model}


def plot(results, path, args):
    plt = common.plt_module()
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 8), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 2]})
    colors = {"fp32": "tab:blue", "mxfp6": "tab:orange", "mxfp4_weights": "tab:red",
              "fp32@1": "tab:gray"}
    window = max(1, args.steps // 25)
    base = next((r for r in results if r["name"] == "fp32"), None)
    for r in results:
        c = colors.get(r["name"])
        label = LABELS.get(r["name"], r["name"])
        ax.plot(common.smooth(r["losses"], window), color=c, lw=1.4, alpha=0.85,
                label=f"{label}: train (moving avg {window})")
        xs, ys = zip(*r["val_curve"])
        ax.plot(xs, ys, "o--", color=c, ms=4, lw=1, label=f"{label}: validation")
        if base is not None and r is not base and "@" not in r["name"]:
            # Same batches in every run, so the per-step difference is a paired comparison.
            diff = [a - b for a, b in zip(r["losses"], base["losses"])]
            ax2.plot(common.smooth(diff, 4 * window), color=c, lw=1.6, label=label)
    ax.set_ylabel("cross-entropy (nats per character)")
    lo = min(min(r["val_loss"], r["train_loss"]) for r in results)
    ax.set_ylim(lo - 0.15, min(4.5, max(r["losses"][0] for r in results)))
    ax.set_title("Character-level GPT on Python stdlib source: FP32 vs MX training")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax2.axhline(0.0, color="tab:blue", lw=1)
    ax2.set_ylabel(f"train loss minus FP32's\n(same batches; moving avg {4 * window})")
    ax2.set_xlabel("training step (batch of %d x %d characters)" % (args.batch, args.context))
    ax2.grid(True, alpha=0.3)
    if base is not None and len(results) > 1:
        ax2.legend(fontsize=8)
    common.save_figure(fig, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny run (smoke test)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"training steps per run (default {DEFAULTS['steps']})")
    p.add_argument("--runs", default=",".join(RUNS),
                   help="comma-separated: " + ",".join(RUNS + list(ABLATIONS)))
    p.add_argument("--d", type=int, default=DEFAULTS["d"])
    p.add_argument("--layers", type=int, default=DEFAULTS["layers"])
    p.add_argument("--heads", type=int, default=DEFAULTS["heads"])
    p.add_argument("--context", type=int, default=DEFAULTS["context"])
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"])
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--evals", type=int, default=8, help="validation points on the curve")
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="output folder (default examples/results/local, git-ignored; nothing "
                        "written with --quick; --out examples/results: the committed results)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.steps = args.steps or 4
        args.d, args.context, args.batch, args.eval_batches, args.evals = 32, 16, 8, 1, 1
    args.steps = args.steps or DEFAULTS["steps"]
    out = common.output_dir(args.out, args.quick)

    common.setup(args.threads, args.seed)
    corpus = Corpus(max_bytes=200_000 if args.quick else None)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    results = [train(n, corpus, args) for n in common.progress(names, desc="runs", leave=True)]

    base = next((r for r in results if r["name"] == "fp32"), None)
    rows = []
    for r in results:
        d_tr = f"{r['train_loss'] - base['train_loss']:+.3f}" if base else "-"
        d_va = f"{r['val_loss'] - base['val_loss']:+.3f}" if base else "-"
        paper = PAPER_20M.get(r["name"])
        paper_gap = (f"{paper:.2f} ({paper - PAPER_20M['fp32']:+.2f})" if paper else "-")
        rows.append([LABELS.get(r["name"], r["name"]), f"{r['train_loss']:.3f}", d_tr,
                     f"{r['val_loss']:.3f}", d_va, f"{r['seconds']:.0f}", paper_gap])
    header = ["run", "train loss", "vs FP32", "val loss", "vs FP32", "time (s)",
              "paper, GPT 20M (vs FP32)"]
    table = common.markdown_table(header, rows)
    n_params = results[0]["params"] if results else 0
    title = (f"Character-level GPT ({args.layers} layers, d={args.d}, {args.heads} heads, context "
             f"{args.context}, {n_params / 1e6:.2f}M parameters), vocabulary {corpus.vocab} bytes, "
             f"{corpus.n_bytes / 1e6:.1f} MB of stdlib source; {args.steps} AdamW steps of "
             f"{args.batch}x{args.context} characters; losses in nats/character, mean over "
             f"{args.eval_batches * args.batch} windows. {common.env_line()}.")
    common.publish(out, "mx_training", [title, table], lambda path: plot(results, path, args))
    return results


if __name__ == "__main__":
    main()

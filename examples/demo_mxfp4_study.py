"""Why the demo's "MXFP4 for every operand" row trains on seed 0 and diverges on seeds 1 and 2.

    python examples/demo_mxfp4_study.py                      # every variant, seeds 0-2 (~3 min)
    python examples/demo_mxfp4_study.py --variants base,grad_ceil --seeds 1

The demo's configuration (examples/demo.py: the digits CNN, SGD lr 0.05, momentum 0.9, 300
steps of 64, the MX paper's recipe with MXFP4 E2M1 for the weight, activation and gradient
operands of every matmul/conv) and small changes to it, one at a time:

- ``fp32``: plain FP32 (the demo's fp32 row); ``base``: the demo's mxfp4_e2m1 row;
- ``grad_ceil`` / ``all_ceil``: the ceil scale rule (no saturation: a block's amax maps into
  (3, 6] times the scale instead of OCP's floor rule's [4, 8), whose top clips at 6) for the
  gradient operands only / for every operand;
- ``fwd_ceil``: the ceil rule for the weight and activation operands only;
- ``grad_bf16``: gradient operands left BF16 (weights and activations still MXFP4);
- ``lr_half``: the demo's recipe at half the learning rate (0.025);
- ``fc2_grad_ceil`` / ``not_fc2_grad_ceil``: the ceil rule for the gradient operands of the
  last layer (fc2, whose dY is dL/dlogits) only / of every layer but fc2;
- ``linear_dgrad_ceil`` / ``linear_wgrad_ceil``: the ceil rule for dY in the dgrad / the wgrad
  GEMMs of the Linear layers (fc1, fc2) only (``Recipe.gemm``).

Per run: test accuracy, the training loss (first, minimum, last 20 steps), the step at which
the loss first exceeds 3 (chance is ln 10 = 2.30) and its peak, and, every ``--every``
steps, each layer's output gradient dY's share of values that the floor scale clips (|x| above
6 times its block's scale, blocks of 32 along the reduction axis of the dgrad GEMM: the output
features/channels) and the largest weight-gradient norm.
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402
import demo  # noqa: E402  (its recipe, learning rate, momentum and batch: the same run)

import torch  # noqa: E402

import qtensor as qt  # noqa: E402
from qtensor.tensor import flush_warnings  # noqa: E402

FP4 = qt.format("mxfp4_e2m1")
CEIL = dataclasses.replace(FP4, scale_rule="ceil")


def _recipe(w=FP4, a=FP4, g=FP4):
    return qt.recipes.mxfp6.replace(weight=(qt.fp32, w), activation=(qt.bf16, a),
                                    grad=(qt.bf16, g) if g is not None else qt.bf16)


VARIANTS = {
    "fp32": (None, 1.0),  # plain FP32: the reference
    "base": (_recipe(), 1.0),
    "grad_ceil": (_recipe(g=CEIL), 1.0),
    "all_ceil": (_recipe(CEIL, CEIL, CEIL), 1.0),
    "fwd_ceil": (_recipe(w=CEIL, a=CEIL), 1.0),
    "grad_bf16": (_recipe(g=None), 1.0),
    "lr_half": (_recipe(), 0.5),
    # Where in the network: the ceil rule for the gradient operands of fc2 (the logits' layer)
    # only, and for every layer's but fc2's
    "fc2_grad_ceil": (_recipe().replace(rules={"fc2": {"grad": (qt.bf16, CEIL)}}), 1.0),
    "not_fc2_grad_ceil": (_recipe(g=CEIL).replace(rules={"fc2": {"grad": (qt.bf16, FP4)}}), 1.0),
    # Which GEMM: the ceil rule for dY in the dgrad (dX = dY W) / wgrad (dW = dY^T X) GEMMs of
    # the Linear layers (fc1 and fc2) only
    "linear_dgrad_ceil": (_recipe().replace(gemm={"linear": {"dgrad": (CEIL, None)}}), 1.0),
    "linear_wgrad_ceil": (_recipe().replace(gemm={"linear": {"wgrad": (None, CEIL)}}), 1.0),
}


def clipped_share(x: torch.Tensor, axis: int) -> float:
    """Share of the nonzero values of x that OCP's floor scale clips in MXFP4 (E2M1 max 6,
    emax 2): |x| > 6 * 2^(floor(log2 amax) - 2), blocks of 32 along ``axis``
    (qtensor.tensor.flush_warnings.clipping, the count qt.analyze and the warnings report)."""
    x = x.detach().float()
    c = flush_warnings.clipping(x, dataclasses.replace(FP4, axis=axis))
    return c["clipped"] / max(1, int(torch.count_nonzero(x)))


def row_sum_bias(dy: torch.Tensor, fmt) -> float:
    """Mean over the rows of dL/dlogits (which sum to 0) of sum(q(row)) / sum(|row|), q the
    rounding to ``fmt`` along the classes (the dgrad GEMM's blocks)."""
    q = qt.quantize(dy.float(), fmt)
    return float((q.sum(1) / dy.float().abs().sum(1).clamp_min(1e-30)).mean())


def run(name, data, seed, steps, every, trace=0):
    spec, lr_factor = VARIANTS[name]
    x_tr, y_tr, x_te, y_te = data
    torch.manual_seed(seed)
    model = common.DigitsCNN()
    if spec is not None:
        qt.convert(model, spec)
    opt = torch.optim.SGD(model.parameters(), lr=demo.LR * lr_factor, momentum=demo.MOMENTUM)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear,
                                                                      torch.nn.Conv2d))}
    dy = {}
    for n, m in layers.items():
        m.register_full_backward_hook(
            lambda mod, gin, gout, n=n: dy.__setitem__(n, common.plain(gout[0].detach())))
    clip = {n: [] for n in layers}
    gnorm = {n: 0.0 for n in layers}
    traced = []

    def callback(step):
        if step < trace:  # fc2's |dW| and |W|, conv1's |dW|, the row-sum bias of fc2's dY
            traced.append((step, float(common.plain(model.fc2.weight.grad).norm()),
                           float(common.plain(model.fc2.weight.detach()).norm()),
                           float(common.plain(model.conv1.weight.grad).norm()),
                           row_sum_bias(dy["fc2"], FP4), row_sum_bias(dy["fc2"], CEIL)))
        for n, m in layers.items():
            g = m.weight.grad
            if g is not None:
                gnorm[n] = max(gnorm[n], float(common.plain(g).norm()))
        if step % every == 0:
            for n in layers:
                if n in dy:  # dgrad's reduction axis: output features (Linear), channels (Conv)
                    clip[n].append(clipped_share(dy[n], 1))

    losses = common.train_classifier(model, opt, x_tr, y_tr, steps=steps, batch=demo.BATCH,
                                     seed=seed, callback=callback)
    acc = common.accuracy(model, x_te, y_te)
    spike = next((i for i, v in enumerate(losses) if v > 3.0), None)  # chance: ln 10 = 2.30
    return {"variant": name, "seed": seed, "acc": acc, "first": losses[0],
            "min": min(losses), "last": sum(losses[-20:]) / 20, "spike": spike,
            "peak": max(losses),
            "clip": {n: sum(v) / len(v) for n, v in clip.items() if v},
            "clip_max": {n: max(v) for n, v in clip.items() if v}, "gnorm": gnorm,
            "losses": losses, "trace": traced}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=10, help="dY clipping measured every N steps")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--trace", type=int, default=0,
                   help="also print the first N steps of each run: loss, fc2's |dW| and |W|, "
                   "conv1's |dW|, fc2's dY row sum / L1 rounded with the floor and ceil rules")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    qt.set_flush_warnings(False)
    data = common.load_digits_split(seed=0)
    print("| variant | seed | test acc | loss first / min / last 20 | loss > 3 at step (peak) | "
          "dY clipped by the floor scale, mean (max) per layer | max |dW| per layer |")
    print("|:--|--:|--:|--:|--:|:--|:--|")
    for name in args.variants.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            r = run(name, data, seed, args.steps, args.every, args.trace)
            clip = ", ".join(f"{n} {100 * v:.2f}% ({100 * r['clip_max'][n]:.1f})"
                             for n, v in r["clip"].items())
            gn = ", ".join(f"{n} {v:.3g}" for n, v in r["gnorm"].items())
            print(f"| {name} | {seed} | {100 * r['acc']:.1f}% | {r['first']:.3f} / "
                  f"{r['min']:.4f} / {r['last']:.4f} | {r['spike']} ({r['peak']:.1f}) | "
                  f"{clip} | {gn} |",
                  flush=True)
            for step, g2, w2, g1, bf, bc in r["trace"]:
                print(f"    step {step:3d}: loss {r['losses'][step]:6.2f}, fc2 |dW| {g2:6.2f} "
                      f"|W| {w2:5.2f}, conv1 |dW| {g1:5.2f}, fc2 dY row sum / L1: floor "
                      f"{bf:+.3f}, ceil {bc:+.3f}", flush=True)


if __name__ == "__main__":
    main()

"""QTensor overhead, side by side with plain FP32: per-op dispatch cost and whole training steps.

    python benchmarks/bench_overhead.py            # everything (a few minutes on 2 cores)
    python benchmarks/bench_overhead.py --quick    # fewer repeats, no compile

Prints:
1. per-op time in microseconds on small tensors (16x16), plain vs QTensor(bf16), and the
   difference (the dispatch overhead: unwrap, run, one rounding, re-wrap);
2. one training step (zero_grad, forward, cross-entropy, backward, SGD with momentum) of an MLP
   (1024 -> 3 hidden layers of 1024 -> 10, batch 256) and of a small CNN (2 conv + 2 linear,
   batch 64, 3x32x32), QTensor vs FP32, eager and under torch.compile (the model compiled, the
   optimizer step eager in both), as ratios measured in the same run.
The QTensor runs use bf16 values everywhere (parameters, inputs, hence activations, gradients,
momentum) and, in a second configuration, bf16 values with an mxfp8_e4m3 operand format.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import qtensor as qt  # noqa: E402


def timeit(fn, repeat, number):
    """The best of `repeat` averages over `number` calls, in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t) / number)
    return best


# ---------------------------------------------------------------------------------------------
# Per-op overhead

def bench_ops(repeat, number):
    torch.manual_seed(0)
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    qa, qb = qt.as_qtensor(a, "bf16"), qt.as_qtensor(b, "bf16")
    qma, qmb = (qt.as_qtensor(a, "bf16", mm_fmt="mxfp8_e4m3"),
                qt.as_qtensor(b, "bf16", mm_fmt="mxfp8_e4m3"))
    cases = [
        ("add", lambda x, y: x + y),
        ("mul_scalar", lambda x, y: x * 0.5),
        ("relu", lambda x, y: torch.relu(x)),
        ("exp", lambda x, y: torch.exp(x)),
        ("sum", lambda x, y: x.sum()),
        ("view (move)", lambda x, y: x.view(256)),
        ("t (move)", lambda x, y: x.t()),
        ("clone (move)", lambda x, y: x.clone()),
        ("gt (non-float)", lambda x, y: x > y),
        ("add_ (in-place)", lambda x, y: x.add_(y, alpha=0.0)),
        ("mm", lambda x, y: x @ y),
    ]
    print(f"\n== per-op time on 16x16 float32 tensors (µs), QTensor(bf16) vs plain")
    print(f"{'op':18s} {'plain':>8s} {'QTensor':>9s} {'overhead':>9s}")
    rows = []
    for name, f in cases:
        tp = timeit(lambda: f(a, b), repeat, number) * 1e6
        tq = timeit(lambda: f(qa, qb), repeat, number) * 1e6
        rows.append((name, tp, tq))
        print(f"{name:18s} {tp:8.1f} {tq:9.1f} {tq - tp:9.1f}")
    tq = timeit(lambda: qma @ qmb, repeat, number) * 1e6
    print(f"{'mm (mxfp8 mm_fmt)':18s} {rows[-1][1]:8.1f} {tq:9.1f} {tq - rows[-1][1]:9.1f}")
    tq = timeit(lambda: qt.quantize(a, qt.bf16), repeat, number) * 1e6
    print(f"{'(qt.quantize bf16)':18s} {'':8s} {tq:9.1f}")
    return rows


# ---------------------------------------------------------------------------------------------
# Training steps

def mlp():
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def cnn():
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10))


def to_q(model, fmt, mm_fmt):
    for mod in model.modules():
        for n, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[n] = nn.Parameter(qt.as_qtensor(p.detach(), fmt, mm_fmt=mm_fmt))
    return model


def make_step(model, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return step


def bench_model(name, build, x, y, configs, repeat, number, compile_too):
    print(f"\n== {name}: one training step (fwd + bwd + SGD momentum), ms")
    torch.manual_seed(0)
    base = build()
    variants = [("fp32", None, None)] + [(c, f, m) for c, (f, m) in configs.items()]
    steps = {}
    for label, fmt, mm in variants:
        for compiled in ([False, True] if compile_too else [False]):
            model = copy.deepcopy(base)
            xi = x
            if fmt is not None:
                model = to_q(model, fmt, mm)
                xi = qt.as_qtensor(x, fmt, mm_fmt=mm)
            if compiled:
                model = torch.compile(model)
            step = make_step(model, xi, y)
            step()  # warm up (and compile)
            step()
            steps[(label, compiled)] = step
    # interleaved: each round times every configuration once; the best round counts (the
    # machine is shared, so load changes during the run)
    results = {k: float("inf") for k in steps}
    for _ in range(repeat):
        for k, step in steps.items():
            results[k] = min(results[k], timeit(step, 1, number))
    print(f"{'config':22s} {'eager':>9s} {'ratio':>7s}" + (f" {'compiled':>9s} {'ratio':>7s}"
                                                        if compile_too else ""))
    for label, _, _ in variants:
        te = results[(label, False)]
        line = f"{label:22s} {te * 1e3:9.2f} {te / results[('fp32', False)]:6.2f}x"
        if compile_too:
            tc = results[(label, True)]
            line += f" {tc * 1e3:9.2f} {tc / results[('fp32', True)]:6.2f}x"
        print(line)
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repeats, no torch.compile")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: steadier on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"compiled kernels: {qt.kernels.ops.kernels_available('cpu')}")
    repeat, number = (3, 200) if args.quick else (5, 1000)
    bench_ops(repeat, number)
    compile_too = not (args.quick or args.no_compile)
    srep = 3 if args.quick else 5
    configs = {"qtensor bf16": ("bf16", None), "qtensor bf16+mxfp8 mm": ("bf16", "mxfp8_e4m3")}
    torch.manual_seed(0)
    x, y = torch.randn(256, 1024), torch.randint(0, 10, (256,))
    bench_model("MLP 1024x3, batch 256", mlp, x, y, configs, srep, 2, compile_too)
    x, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    bench_model("CNN, batch 64, 3x32x32", cnn, x, y, configs, srep, 2, compile_too)


if __name__ == "__main__":
    main()

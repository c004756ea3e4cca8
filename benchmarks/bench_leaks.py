"""Overhead of qt.leak_check: the same training step (forward, backward, optimizer step) of a
converted model with and without the check, as ratios from the same run.

    python benchmarks/bench_leaks.py [--steps N] [--threads T]

Prints, per model, the median step time without the check, with ``leak_check()``, and with
``leak_check(check_values=True)`` (every QTensor op input and output re-rounded and compared), and
their ratios, and the same for one small op (per-op cost of the dispatch mode). Models: an MLP (3 hidden layers of 512, batch 128) and a small CNN with BatchNorm
(2 conv blocks, 16x16 inputs, batch 32), both converted to bf16 with SGD (momentum).
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import qtensor as qt


def mlp():
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    return model, torch.randn(128, 256), torch.randint(0, 10, (128,))


def cnn():
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 10))
    return model, torch.randn(32, 3, 16, 16), torch.randint(0, 10, (32,))


def time_steps(model, opt, x, y, steps, check=None):
    """Median seconds per training step; ``check``: kwargs for leak_check, None for none."""
    times = []
    for i in range(steps + 2):  # two warm-up steps
        t0 = time.perf_counter()
        if check is None:
            _step(model, opt, x, y)
        else:
            with qt.leak_check(action="record", optimizer=opt, **check) as report:
                _step(model, opt, x, y)
            assert report.ok, report.summary()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def per_op_us(check=None, n=2000):
    """Microseconds per small QTensor op (a bf16 [16, 16] add) inside a converted module."""
    class Adds(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 16))

        def forward(self, x):
            for _ in range(n):
                x = x + self.w
            return x

    m = qt.convert(Adds(), qt.bf16)
    x = torch.randn(16, 16)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        with torch.no_grad():
            if check is None:
                m(x)
            else:
                with qt.leak_check(action="record", **check):
                    m(x)
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def _step(model, opt, x, y):
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"leak_check overhead: median of {args.steps} training steps, "
          f"torch {torch.__version__}, {args.threads} thread(s), bf16 converted models")
    print(f"{'model':<6} {'no check':>10} {'leak_check':>12} {'ratio':>7} "
          f"{'+check_values':>14} {'ratio':>7}")
    for name, make in (("mlp", mlp), ("cnn", cnn)):
        model, x, y = make()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qt.convert(model, qt.bf16)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        # interleave the three settings so that machine noise hits them alike
        base, chk, val = [], [], []
        for _ in range(3):
            base.append(time_steps(model, opt, x, y, args.steps))
            chk.append(time_steps(model, opt, x, y, args.steps, {}))
            val.append(time_steps(model, opt, x, y, args.steps, {"check_values": True}))
        b, c, v = min(base), min(chk), min(val)
        print(f"{name:<6} {b * 1e3:>8.1f}ms {c * 1e3:>10.1f}ms {c / b:>6.2f}x "
              f"{v * 1e3:>12.1f}ms {v / b:>6.2f}x")
    b, c, v = per_op_us(), per_op_us({}), per_op_us({"check_values": True})
    print(f"{'1 op':<6} {b:>8.1f}us {c:>10.1f}us {c / b:>6.2f}x {v:>12.1f}us {v / b:>6.2f}x"
          "   (a bf16 [16, 16] add inside a converted module, no autograd)")


if __name__ == "__main__":
    main()

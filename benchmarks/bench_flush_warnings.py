"""Cost of the flush/saturation/clipping warnings (qtensor/tensor/flush_warnings.py): a training step
(forward and backward) of a converted MLP with the warnings off and on, in the same run.

    python benchmarks/bench_flush_warnings.py [--reps 12] [--every-rounding]

MLP 256-512-512-10, batch 256, one thread; per recipe 3 warm-up steps, then ``--reps`` times 3
steps with the warnings off and 3 with them on, interleaved; the median step time of each.
Before each timed block the record of warned tensors is cleared, so every role stays watched
(a tensor that warned is not checked again: that block re-warns). ``--every-rounding``
also clears the clipping schedule (checked on every rounding, not the first 4 and then one in
16): the cost of one check per rounding. Recipes: examples/demo.py's MXFP4 row (BF16 values,
MXFP4 operands) with the ceil rule (nothing clips) and with OCP's floor rule (fc2's gradient
clips and warns), every value in MXFP8, every value in NVFP4.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

import qtensor as qt
from qtensor.tensor import flush_warnings as fw


def _demo(rule):
    f = qt.format("mxfp4_e2m1").replace(scale_rule=rule)
    return qt.recipes.mxfp6.replace(weight=(qt.fp32, f), activation=(qt.bf16, f),
                                    grad=(qt.bf16, f))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--every-rounding", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    recipes = {"demo MXFP4 recipe, ceil": _demo("ceil"), "every value MXFP8": qt.mxfp8_e4m3,
               "every value NVFP4": qt.nvfp4, "demo MXFP4 recipe, floor": _demo("floor")}
    for name, spec in recipes.items():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10))
        x, y = torch.randn(256, 256), torch.randint(0, 10, (256,))
        times = {False: [], True: []}
        was = fw.flush_warnings_enabled()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = qt.convert(m, spec)
            for _ in range(3):
                F.cross_entropy(m(x), y).backward()
            for _ in range(args.reps):
                for on in (False, True):
                    fw._warned.clear()
                    if args.every_rounding:
                        fw._clip_calls.clear()
                    qt.set_flush_warnings(on)
                    t0 = time.perf_counter()
                    for _ in range(3):
                        F.cross_entropy(m(x), y).backward()
                    times[on].append((time.perf_counter() - t0) / 3)
        qt.set_flush_warnings(was)
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"{name:26s} off {1e3 * off:6.1f} ms  on {1e3 * on:6.1f} ms  "
              f"{100 * (on / off - 1):+5.1f}%", flush=True)


if __name__ == "__main__":
    main()

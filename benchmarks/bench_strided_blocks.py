"""Blocks along a strided axis: the kernel's tiles against the transposing copy.

    OMP_NUM_THREADS=1 python benchmarks/bench_strided_blocks.py            # the rounding alone
    OMP_NUM_THREADS=1 python benchmarks/bench_strided_blocks.py --training gpt256,chargpt

The first: a 4096x1024 float32 tensor rounded to MXFP8 blocks along axis -2, and a transposed
view of one along its axis -1, by dispatch.quantize with STRIDED_BLOCKS off (movedim +
contiguous + kernel in place [+ copy back for keep_layout]) and on (the kernel on the strided
layout), as ratios to ``out.copy_(x)`` on the same tensor; medians of interleaved repeats.
The second: training steps of bench_training's configurations with the switch off and on,
interleaved with FP32 steps in one run, as ratios to FP32.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import qtensor as qt  # noqa: E402
from qtensor.kernels import backend  # noqa: E402
from qtensor.tensor import dispatch  # noqa: E402


def _time(fn, reps=1):
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def rounding(repeats):
    torch.manual_seed(0)
    fmt = qt.PRESETS["mxfp8_e4m3"]
    cases = [("axis -2 of a contiguous 4096x1024", torch.randn(4096, 1024), -2),
             ("axis -1 of a transposed view (4096x1024 = (1024x4096).mT)",
              torch.randn(1024, 4096).mT, -1)]
    for label, x, axis in cases:
        f = fmt.replace(axis=axis)
        out = torch.empty_like(x)

        def run(strided, keep):
            def go():
                backend.STRIDED_BLOCKS = strided
                dispatch.quantize(x, f, keep_layout=keep)
            return go
        fns = {"copy_": lambda: out.copy_(x),
               "old keep_layout=False": run(False, False), "new keep_layout=False": run(True, False),
               "old keep_layout=True": run(False, True), "new keep_layout=True": run(True, True)}
        for fn in fns.values():
            fn()
        times = {k: [] for k in fns}
        for _ in range(repeats):
            for k, fn in fns.items():
                times[k].append(_time(fn))
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{label}, MXFP8 (median of {repeats} interleaved repeats, 1 call each):")
        for k, v in med.items():
            print(f"  {k:24s} {v * 1e3:8.2f} ms  {v / med['copy_']:5.2f}x copy_")
        backend.STRIDED_BLOCKS = True


def training(names, steps, warmup):
    import bench_training as bt
    for name in names:
        made = bt.make_pair(name, False, False)
        if isinstance(made, str):
            print(f"{name}: {made}")
            continue
        fp32, emu, what = made
        for _ in range(warmup):
            fp32.step()
            for s in (False, True):
                backend.STRIDED_BLOCKS = s
                emu.step()
        tf, toff, ton = [], [], []
        for _ in range(steps):
            tf.append(fp32.timed_step())
            backend.STRIDED_BLOCKS = False
            toff.append(emu.timed_step())
            backend.STRIDED_BLOCKS = True
            ton.append(emu.timed_step())
        f, off, on = (statistics.median(t) for t in (tf, toff, ton))
        print(f"{name} ({what}): medians of {steps} interleaved steps: FP32 {f * 1e3:.1f} ms, "
              f"STRIDED_BLOCKS off {off * 1e3:.1f} ms ({off / f:.2f}x), "
              f"on {on * 1e3:.1f} ms ({on / f:.2f}x)")
    backend.STRIDED_BLOCKS = True


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--training", default=None, help="comma-separated bench_training configs")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.training:
        training(args.training.split(","), args.steps, args.warmup)
    else:
        rounding(args.repeats)


if __name__ == "__main__":
    main()

"""2D block formats against their 1D counterparts: qt.quantize time (the fastest of --repeat runs)
and its ratio to ``out.copy_(x)``, on one thread by default.

    python benchmarks/bench_blocks2d.py                # 2048 x 2048 float32, 1 thread

A 2D format is rounded by laying its tiles out as 1D blocks of r*c for the block kernel and back
(qtensor/kernels/ops.py, _round_tiles): two permuting copies more than the 1D format.
"""
from __future__ import annotations

import argparse
import time

import torch

import qtensor as qt


def _time(fn, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=11)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randn(args.size, args.size)
    out = torch.empty_like(x)
    copy = _time(lambda: out.copy_(x), args.repeat)
    print(f"copy_ {args.size}x{args.size} float32, {args.threads} thread(s): {copy * 1e3:.2f} ms")
    ds = dict(scale="fp32", scale_rule="amax")
    rows = [
        ("nvfp4 (1D 16)", qt.nvfp4, "nvfp4 16x16", qt.nvfp4.replace(block_shape=(16, 16))),
        ("nvfp4_single (1D 16)", qt.nvfp4_single, "16x16",
         qt.nvfp4_single.replace(block_shape=(16, 16))),
        ("e4m3 FP32 scale 1x128", qt.BlockFormat(qt.fp8_e4m3, 128, **ds), "128x128",
         qt.BlockFormat(qt.fp8_e4m3, block_shape=(128, 128), **ds)),
        ("mxfp8_e4m3 (1D 32)", qt.mxfp8_e4m3, "4x8", qt.mxfp8_e4m3.replace(block_shape=(4, 8))),
    ]
    for n1, f1, n2, f2 in rows:
        a = _time(lambda: qt.quantize(x, f1, out=out), args.repeat)
        b = _time(lambda: qt.quantize(x, f2, out=out), args.repeat)
        print(f"{n1:24s} {a * 1e3:8.2f} ms ({a / copy:6.1f}x copy_) | {n2:12s} "
              f"{b * 1e3:8.2f} ms ({b / copy:6.1f}x copy_) | 2D / 1D {b / a:.2f}")


if __name__ == "__main__":
    main()

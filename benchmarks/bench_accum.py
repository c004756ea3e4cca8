"""The cost of emulating the accumulator: qt.accum.accum_matmul vs the plain emulated matmul.

    python benchmarks/bench_accum.py            # a few sizes, a few seconds each
    python benchmarks/bench_accum.py --quick

Both paths take float32 operands, round them to FP8 E4M3 (the operand rounding every emulated
contraction does) and multiply; the plain path accumulates with torch.mm (FP32, BLAS), the accum
path with the fused C++ kernel emulating the datapath (hopper_fp8: 32-product chunks, 13 bits,
promotion every 128; hopper_bf16: 16-product chunks, 25 bits). Prints the time of each and the
ratio accum / plain measured in the same run, with the thread count (the ratio depends on load).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import qtensor as qt  # noqa: E402
from qtensor import accum  # noqa: E402


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    repeat, number = (2, 1) if args.quick else (3, 2)
    sizes = [(128, 512, 128), (256, 1024, 256)] if args.quick else \
        [(128, 512, 128), (256, 1024, 256), (512, 512, 512)]
    torch.manual_seed(0)
    print(f"threads: {torch.get_num_threads()}; operands rounded to fp8_e4m3 in both paths")
    print(f"{'M x K x N':>18} {'accum':>14} {'plain ms':>9} {'accum ms':>9} {'ratio':>6}")
    for M, K, N in sizes:
        a, b = torch.randn(M, K), torch.randn(K, N)

        def plain():
            return qt.quantize(a, "fp8_e4m3") @ qt.quantize(b, "fp8_e4m3")

        t_plain = timeit(plain, repeat, number)
        for f in (accum.hopper_fp8, accum.hopper_bf16):
            def acc(f=f):
                return accum.accum_matmul(qt.quantize(a, "fp8_e4m3"), qt.quantize(b, "fp8_e4m3"),
                                          f)
            t_acc = timeit(acc, repeat, number)
            print(f"{f'{M}x{K}x{N}':>18} {f.name:>14} {t_plain * 1e3:9.2f} {t_acc * 1e3:9.2f} "
                  f"{t_acc / t_plain:6.1f}")


if __name__ == "__main__":
    main()

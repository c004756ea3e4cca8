"""The cost of emulating the accumulator: qt.accum.accum_matmul vs the plain emulated matmul.

    python benchmarks/bench_accum.py            # a few sizes, a few seconds each
    python benchmarks/bench_accum.py --quick

Both paths take float32 operands, round them to FP8 E4M3 (FP4 E2M1 for blackwell_mxfp4: the
operand rounding every emulated contraction does) and multiply; the plain path accumulates with
torch.mm (FP32, BLAS), the accum path with the fused C++ kernel emulating the datapath
(hopper_fp8: 32-product chunks, 13 bits, promotion every 128; hopper_bf16: 16-product chunks, 25
bits; blackwell_mxfp4: 64-product chunks of 16-product groups, 35 bits). FP8 operands take the
kernel's float32/int32 fast path on AVX2/AVX-512 CPUs (csrc/cpu/accum_fast.h); the groups take
the double tiles of csrc/cpu/accum_lanes.h (rows_groups); "mxfp4+blockexp": blackwell_mxfp4 on
MXFP4 operands with the block-scale exponents (the exact mode QTensor contractions use). New
presets: ada_fp8, blackwell_f8f6f4 (FP8 operands, fast path), hopper_tf32 (tf32 operands: the
double lanes), hopper_fp8_f16 (FP16 accumulator: the scalar path). The "fp32 operands" rows: hopper_bf16
on the unrounded float32 operands (products exact in double only: accum_lanes.h's dot_lanes),
against their torch.mm. Prints the time of each, the
ratio accum / plain measured in the same run, and the accum time per product (quantization
included). One thread by default (--threads): on a shared
machine multi-threaded timings of sub-millisecond matmuls are mostly scheduling noise. The two
paths are timed alternately and the best of the repeats is kept.
"""
from __future__ import annotations

import argparse
import os
import sys
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import qtensor as qt  # noqa: E402
from qtensor import accum  # noqa: E402
from bench_overhead import timeit  # noqa: E402  (the same best-of-repeats timer)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    repeat, number = (3, 1) if args.quick else (7, 2)
    sizes = [(128, 512, 128), (256, 1024, 256)] if args.quick else \
        [(128, 512, 128), (256, 1024, 256), (512, 512, 512)]
    torch.manual_seed(0)
    print(f"threads: {torch.get_num_threads()}; operands rounded to fp8_e4m3 (blackwell_mxfp4: "
          f"fp4_e2m1) in both paths")
    print(f"{'M x K x N':>18} {'accum':>15} {'plain ms':>9} {'accum ms':>9} {'ratio':>6} "
          f"{'ns/product':>10}")
    for M, K, N in sizes:
        a, b = torch.randn(M, K), torch.randn(K, N)

        for f, fmt in ((accum.hopper_fp8, "fp8_e4m3"), (accum.hopper_bf16, "fp8_e4m3"),
                       (accum.blackwell_mxfp4, "fp4_e2m1"), (accum.blackwell_mxfp4, "mxfp4"),
                       (accum.ada_fp8, "fp8_e4m3"), (accum.blackwell_f8f6f4, "fp8_e4m3"),
                       (accum.hopper_tf32, "tf32"), (accum.hopper_fp8_f16, "fp8_e4m3"),
                       (accum.hopper_bf16, "fp32")):
            def rounded(fmt):  # MX blocks along K: b's columns
                if fmt == "mxfp4":
                    return qt.quantize(a, fmt), qt.quantize(b.t(), fmt).t()
                return qt.quantize(a, fmt), qt.quantize(b, fmt)

            def plain(fmt=fmt):
                qa, qb = rounded(fmt)
                return qa @ qb

            def acc(f=f, fmt=fmt):
                qa, qb = rounded(fmt)
                if fmt == "mxfp4":  # the block-scale exponents (as QTensor contractions do)
                    o = types.SimpleNamespace(mm_fmt=qt.formats.format(fmt))
                    return accum.accum_matmul(qa, qb, f, **accum._gexps(f, qa, o, qb, o))
                return accum.accum_matmul(qa, qb, f)
            t_plain = t_acc = float("inf")
            for _ in range(repeat):  # alternately, so that both see the same load
                t_plain = min(t_plain, timeit(plain, 1, number))
                t_acc = min(t_acc, timeit(acc, 1, number))
            name = {"fp32": "fp32 operands", "mxfp4": "mxfp4+blockexp"}.get(fmt, f.name)
            print(f"{f'{M}x{K}x{N}':>18} {name:>15} {t_plain * 1e3:9.2f} {t_acc * 1e3:9.2f} "
                  f"{t_acc / t_plain:6.1f} {t_acc / (M * K * N) * 1e9:10.3f}")

if __name__ == "__main__":
    main()

"""The cost of emulating the accumulator: qt.accum.accum_matmul vs the plain emulated matmul.

    python benchmarks/bench_accum.py            # a few sizes, a few seconds each
    python benchmarks/bench_accum.py --quick
    python benchmarks/bench_accum.py --presets hopper_fp8,blackwell_f8f6f4

Every preset of qt.accum.PRESETS, on operands of its instruction's input format: both paths
round float32 operands to that format (the operand rounding every emulated contraction does) and
multiply; the plain path accumulates with torch.mm (FP32, BLAS), the accum path with the fused
C++ kernel emulating the datapath. Operands: FP16/BF16/TF32 for those presets, FP8 E4M3 for the
FP8 ones (blackwell_f8f6f4 included), FP4 E2M1 for blackwell_mxfp4/nvfp4, and the block-scaled
modes QTensor contractions use: "mxfp4+blockexp" (blackwell_mxfp4 on MXFP4 operands with the
block-scale exponents), "nvfp4+scales" (blackwell_nvfp4 on NVFP4 operands with the E4M3 scales'
exponents), "mxfp8+clamps" (blackwell_mxf8f6f4 on MXFP8 operands with per-element clamps where
an element is subnormal); the AMD CDNA3 presets run their own kernel (csrc/cpu/accum_cdna3.cpp;
the reference where the extension lacks it: then only the first size). Which kernel path each
takes: docs/accum.md. The "fp32 operands" rows: hopper_bf16
on the unrounded float32 operands (products exact in double only: accum_lanes.h's dot_lanes),
against their torch.mm. Prints the time of each, the ratio accum / plain measured in the same
run, and the accum time per product (quantization included). One thread by default (--threads):
on a shared machine multi-threaded timings of sub-millisecond matmuls are mostly scheduling
noise. The two paths are timed alternately and the best of the repeats is kept. --clock cpu
times with the process's CPU time (time.process_time) instead of wall time: on a machine loaded
by other jobs, time spent preempted then does not count (one thread only).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import qtensor as qt  # noqa: E402
from qtensor import accum  # noqa: E402
from qtensor.accum import blocks as accum_blocks  # noqa: E402
from bench_overhead import timeit  # noqa: E402  (the same best-of-repeats timer)


# the operand format of each preset's instruction (the rest: by its name)
_OPERANDS = {"blackwell_mxfp4": "fp4_e2m1", "blackwell_nvfp4": "fp4_e2m1",
             "blackwell_mxf8f6f4": "mxfp8", "cdna3_fp8": "fp8_e4m3"}


def cases(names=None):
    """(label, preset, operand format) for every preset (or those named), then the block-scaled
    modes and the float32 operands."""
    out = []
    for name, f in accum.PRESETS.items():
        fmt = _OPERANDS.get(name) or next(
            (x for k, x in (("fp16", "fp16"), ("bf16", "bf16"), ("tf32", "tf32"),
                            ("fp8", "fp8_e4m3"), ("f8f6f4", "fp8_e4m3")) if k in name),
            "fp8_e4m3")
        out.append((name if fmt != "mxfp8" else "mxfp8+clamps", f, fmt))
    out += [("mxfp4+blockexp", accum.blackwell_mxfp4, "mxfp4"),
            ("nvfp4+scales", accum.blackwell_nvfp4, "nvfp4_single"),
            ("fp32 operands", accum.hopper_bf16, "fp32")]
    if names:
        out = [c for c in out if c[0] in names or c[1].name in names]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--presets", default="", help="comma-separated preset or row names")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = ap.parse_args()
    timer = timeit
    if args.clock == "cpu":
        if args.threads != 1:
            ap.error("--clock cpu needs --threads 1")

        def timer(fn, repeat, number):  # bench_overhead.timeit on the process's CPU time
            fn()
            best = float("inf")
            for _ in range(repeat):
                t = time.process_time()
                for _ in range(number):
                    fn()
                best = min(best, (time.process_time() - t) / number)
            return best
    torch.set_num_threads(args.threads)
    repeat, number = (3, 1) if args.quick else (7, 2)
    sizes = [(128, 512, 128), (256, 1024, 256)] if args.quick else \
        [(128, 512, 128), (256, 1024, 256), (512, 512, 512)]
    torch.manual_seed(0)
    print(f"threads: {torch.get_num_threads()}; ISA cap: {os.environ.get('QTENSOR_CPU_ISA', '-')}; "
          f"clock: {args.clock}; operands rounded to each preset's input format in both paths")
    print(f"{'M x K x N':>18} {'accum':>20} {'operands':>12} {'plain ms':>9} {'accum ms':>9} "
          f"{'ratio':>6} {'ns/product':>10}")
    names = [n for n in args.presets.split(",") if n]
    for si, (M, K, N) in enumerate(sizes):
        a, b = torch.randn(M, K), torch.randn(K, N)
        for label, f, fmt in cases(names):
            if (f.stages != "fused" and si  # without its kernel: the reference, the first size only
                    and not hasattr(torch.ops.qtensor, "accum_matmul_cdna3")):
                continue
            block = fmt.startswith(("mx", "nvfp4"))

            def rounded(fmt=fmt, block=block):  # block formats: blocks along K (b's columns)
                if block:
                    return qt.quantize(a, fmt), qt.quantize(b.t(), fmt).t()
                return qt.quantize(a, fmt), qt.quantize(b, fmt)

            def plain(fmt=fmt):
                qa, qb = rounded(fmt)
                return qa @ qb

            def acc(f=f, fmt=fmt, block=block):
                qa, qb = rounded(fmt)
                if block:  # the block scales' exponents / clamps (as QTensor contractions do)
                    o = types.SimpleNamespace(mm_fmt=qt.formats.format(fmt))
                    return accum.accum_matmul(qa, qb, f, **accum_blocks._gexps(f, qa, o, qb, o))
                return accum.accum_matmul(qa, qb, f)
            t_plain = t_acc = float("inf")
            for _ in range(repeat):  # alternately, so that both see the same load
                t_plain = min(t_plain, timer(plain, 1, number))
                t_acc = min(t_acc, timer(acc, 1, number))
            print(f"{f'{M}x{K}x{N}':>18} {label:>20} {fmt:>12} {t_plain * 1e3:9.2f} "
                  f"{t_acc * 1e3:9.2f} {t_acc / t_plain:6.1f} {t_acc / (M * K * N) * 1e9:10.3f}",
                  flush=True)


if __name__ == "__main__":
    main()

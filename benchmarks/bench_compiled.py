"""Compiled training steps against compiled FP32, with and without qtensor's decompositions.

    python benchmarks/bench_compiled.py --only chargpt,mlp_mxfp8                      # default
    python benchmarks/bench_compiled.py --only chargpt,mlp_mxfp8 --with-decompositions
    python benchmarks/bench_compiled.py --rounding     # one rounding: kernel vs fused decomposition
    QTENSOR_INDUCTOR_FUSE_SCALAR=0 python benchmarks/bench_compiled.py --only gpt256  # scalar
        # float roundings as extern kernel calls (default 1: fused, qtensor.kernels.decompositions)

The configurations, the step and the timing are benchmarks/bench_training.py's (its names for
--only; the model compiled, the optimizer step eager): FP32 and emulated steps interleaved,
medians, one thread. --with-decompositions gives inductor the rounding ops as fusable
pointwise torch ops (qtensor/kernels/decompositions.py, off by default); without it they are extern
kernel calls. The first step (compile) is timed with an empty inductor cache (a fresh
TORCHINDUCTOR_CACHE_DIR, FX graph and AOTAutograd caches off), so its time is the full compile
for the first configuration of a run only: later ones reuse the kernels compiled in the process
(and FP32's first step pays inductor's one-time start-up). For compile times, one configuration
per run.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="qt_bench_compiled_")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import qtensor as qt  # noqa: E402
from qtensor.kernels import decompositions  # noqa: E402


def bench_rounding(repeat=15):
    """One rounding of 1.5 * x (x 1024x1024 float32): eager (mul, then the kernel), compiled with
    the decomposition fused, and compiled mul + add (the floor), in CPU time (thread_time, so
    that other processes' load does not count), medians."""
    import statistics
    import time
    from qtensor.kernels import ops
    x = torch.randn(1024, 1024)
    decompositions.set_enabled(True)
    for name in ["fp8_e4m3", "mxfp8_e4m3"]:
        name_op, args = ops.op_args(qt.format(name))
        op = getattr(torch.ops.qtensor, name_op)

        def eager(a):
            return op(a * 1.5, *args, 0, 0)
        comp = torch.compile(eager)
        floor = torch.compile(lambda a: a * 1.5 + 1.0)
        comp(x), floor(x)
        times = [[], [], []]
        for _ in range(repeat):
            for fn, t in zip((eager, comp, floor), times):
                t0 = time.thread_time()
                fn(x)
                t.append(time.thread_time() - t0)
        e, c, f = (statistics.median(t) * 1e3 for t in times)
        print(f"| {name} | {e:.2f} ms | {c:.2f} ms | {f:.2f} ms |", flush=True)
    decompositions.set_enabled(False)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="chargpt,mlp_fp8,mlp_mxfp8")
    p.add_argument("--with-decompositions", action="store_true")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounding", action="store_true", help="only the one-rounding comparison")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    qt.set_flush_warnings(False)
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    if args.rounding:
        print("| format | eager mul + kernel | compiled, fused decomposition | "
              "compiled mul + add |")
        return bench_rounding()
    decompositions.set_enabled(args.with_decompositions)
    label = "with" if args.with_decompositions else "without"
    import bench_training  # (benchmarks/bench_training.py)
    label += f", scalar fusion {'on' if decompositions._fast_enabled else 'off'}"
    print(f"torch {torch.__version__}, 1 thread, decompositions: {label}; medians of "
          f"{args.steps} interleaved steps after {args.warmup}")
    for name in args.only.split(","):
        made = bench_training.make_pair(name, args.quick, True)
        if isinstance(made, str):
            print(f"== {name}: skipped: {made}")
            continue
        fp32, emu, what = made
        first, tf, te = bench_training.measure(fp32, emu, args.warmup, args.steps)
        print(f"| {what} | compiled, decompositions {label} | {tf * 1e3:.1f} ms | "
              f"{te * 1e3:.1f} ms | {te / tf:.2f}x | {first[0]:.1f} s / {first[1]:.1f} s "
              f"({first[1] / first[0]:.2f}x) |", flush=True)


if __name__ == "__main__":
    main()

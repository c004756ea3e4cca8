"""Compiled training steps against compiled FP32, with and without qtensor's decompositions.

    python benchmarks/bench_compiled.py --only chargpt,mlp_mxfp8
    python benchmarks/bench_compiled.py --only chargpt --without-decompositions   # before

The configurations, the step and the timing are benchmarks/bench_training.py's (its names for
--only; the model compiled, the optimizer step eager): FP32 and emulated steps interleaved,
medians, one thread. --without-decompositions keeps the rounding ops as inductor extern kernels
(qtensor/decompositions.py not registered): the state before the decompositions. The first step
(compile) is timed with an empty inductor cache (a fresh TORCHINDUCTOR_CACHE_DIR, FX graph and
AOTAutograd caches off), so its time is the full compile.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="qt_bench_compiled_")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import bench_training  # noqa: E402
import qtensor as qt  # noqa: E402
from qtensor import decompositions  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="chargpt,mlp_fp8,mlp_mxfp8")
    p.add_argument("--without-decompositions", action="store_true")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    qt.set_flush_warnings(False)
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    if args.without_decompositions:
        decompositions.register = lambda: None  # ops.py's fake impls call it through the module
    label = "without" if args.without_decompositions else "with"
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

"""Compiled training steps, emulated / FP32, in CPU time (thread_time: other processes' load
does not count), for one setting of the scalar fusion (qtensor.kernels.decompositions):

    for v in 0 1; do QTENSOR_INDUCTOR_FUSE_SCALAR=$v OMP_NUM_THREADS=1 \\
        python benchmarks/ab_scalar_fusion.py --only gpt256; done

bench_training's configurations, model compiled (dynamic=False), optimizer eager; each setting
gets its own inductor cache dir (TORCHINDUCTOR_CACHE_DIR is set here when unset), so a graph
compiled with the other setting is not reused.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="qt_ab_fusion_"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import bench_training as bt  # noqa: E402
from qtensor.kernels import decompositions  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="gpt256")
    p.add_argument("--steps", type=int, default=9)
    args = p.parse_args()
    torch.set_num_threads(1)
    bt.qt.set_flush_warnings(False)
    for name in args.only.split(","):
        fp32, emu, what = bt.make_pair(name, False, True)
        first = []
        for tr in (fp32, emu):
            t = time.perf_counter()
            tr.step()
            first.append(time.perf_counter() - t)
        fp32.step(), emu.step()
        tf, te = [], []
        for _ in range(args.steps):
            for tr, ts in ((fp32, tf), (emu, te)):
                t = time.thread_time()
                tr.step()
                ts.append(time.thread_time() - t)
        f, e = statistics.median(tf) * 1e3, statistics.median(te) * 1e3
        print(f"| {what} | scalar fusion {'on' if decompositions._fast_enabled else 'off'} | "
              f"{f:.1f} ms | {e:.1f} ms | {e / f:.2f}x | {first[0]:.1f} s / {first[1]:.1f} s |",
              flush=True)


if __name__ == "__main__":
    main()

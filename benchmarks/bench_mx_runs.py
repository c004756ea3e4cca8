"""MX blocks (power-of-two scales) on CPU: two builds of qtensor._C A/B, interleaved, 1 thread.

    OMP_NUM_THREADS=1 python benchmarks/bench_mx_runs.py --old /work/wt/main_C.so

Each build runs in its own worker process (the old .so next to a copy of this checkout's Python
package in a temporary folder, the new one from the checkout); the driver asks them in turn,
round after round, for one timing of each case: the median of a few calls of
``qt.quantize(x, fmt, out=out)`` and of ``out.copy_(x)`` on the same tensor, taken alternately in
that process. Reported: medians over the rounds of the kernel's time and of its ratio to copy_.
Cases: randn 1024x1024 and 4096x4096 (float32, or --dtype bfloat16 / float16), MXFP8 E4M3, MXFP6 E3M2, MXFP4 E2M1, MXINT8, blocks
along axis -1 (contiguous rows) and axis 0 (down the columns: the tiles), rounding nearest.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FORMATS = ["mxfp8_e4m3", "mxfp6_e3m2", "mxfp4_e2m1", "mxint8"]

WORKER = r"""
import json, statistics, sys, time, torch
torch.set_num_threads(1)
import qtensor as qt
from qtensor.kernels import ops
x_by = {}
for line in sys.stdin:
    n, name, axis, rounding, calls, dtype = json.loads(line)
    if (n, dtype) not in x_by:
        torch.manual_seed(0)
        x_by[(n, dtype)] = torch.randn(n, n).to(getattr(torch, dtype))
    x = x_by[(n, dtype)]
    out = torch.empty_like(x)
    fmt = qt.PRESETS[name].replace(axis=axis)
    ops.quantize(x, fmt, rounding=rounding, out=out)
    tk, tc = [], []
    for _ in range(calls):
        t = time.perf_counter(); out.copy_(x); tc.append(time.perf_counter() - t)
        t = time.perf_counter(); ops.quantize(x, fmt, rounding=rounding, out=out)
        tk.append(time.perf_counter() - t)
    print(json.dumps([statistics.median(tk), statistics.median(tc)]), flush=True)
"""


def _worker(pythonpath):
    env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=pythonpath)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="the old build's qtensor/_C*.so")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sizes", default="1024,4096")
    ap.add_argument("--rounding", default="nearest")
    ap.add_argument("--dtype", default="float32", help="the payload: float32, bfloat16, float16")
    ap.add_argument("--formats", default=",".join(FORMATS))
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_mx_runs_")
    try:
        pkg = os.path.join(tmp, "qtensor")
        shutil.copytree(os.path.join(ROOT, "qtensor"), pkg,
                        ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
        so = [f for f in os.listdir(os.path.join(ROOT, "qtensor")) if f.startswith("_C")]
        shutil.copy(args.old, os.path.join(pkg, so[0]))
        workers = {"old": _worker(tmp), "new": _worker(ROOT)}
        cases = [(n, name, axis) for n in map(int, args.sizes.split(","))
                 for name in args.formats.split(",") for axis in (-1, 0)]
        res = {(c, b): [] for c in cases for b in workers}
        for r in range(args.rounds):
            for c in cases:
                calls = 5 if c[0] <= 1024 else 3
                order = ("old", "new") if r % 2 == 0 else ("new", "old")
                for b in order:
                    w = workers[b]
                    w.stdin.write(json.dumps([*c, args.rounding, calls, args.dtype]) + "\n")
                    w.stdin.flush()
                    res[(c, b)].append(json.loads(w.stdout.readline()))
        for w in workers.values():
            w.stdin.close()
            w.wait()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{args.dtype}, rounding {args.rounding}, 1 thread, median of {args.rounds} rounds "
          "(each: median of 3-5 calls, copy_ alternating)")
    print("| case | old ms | old x copy_ | new ms | new x copy_ | speedup |")
    print("|---|---|---|---|---|---|")
    for c in cases:
        n, name, axis = c
        row = []
        for b in ("old", "new"):
            v = res[(c, b)]
            row.append((statistics.median(t[0] for t in v),
                        statistics.median(t[0] / t[1] for t in v)))
        print(f"| {n}x{n} {name} axis {axis} | {row[0][0] * 1e3:.2f} | {row[0][1]:.2f} | "
              f"{row[1][0] * 1e3:.2f} | **{row[1][1]:.2f}** | {row[0][0] / row[1][0]:.2f} |")


if __name__ == "__main__":
    main()

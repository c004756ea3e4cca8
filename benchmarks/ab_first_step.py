"""First compiled training step, A/B between two checkouts, cold compile caches.

    OMP_NUM_THREADS=1 python benchmarks/ab_first_step.py --trees /tmp/main . \
        --only gpt256,chargpt --rounds 3 [--warm]

Each round runs one child process per checkout, alternating (A, B, A, B, ...), each with a fresh
TORCHINDUCTOR_CACHE_DIR (so inductor's FX graph cache and AOTAutograd's cache start empty, as
on a first run; with --warm the timed child runs on the cache that an untimed one filled). A
child builds bench_training's pair of compiled models (FP32 and emulated),
times the first step of each (FP32 first), dynamo's phases of the emulated one
(compile_times), then ``--steps`` interleaved steady steps of both (medians), and a digest of
the emulated model's parameters as bits after those steps: equal digests mean the two checkouts
trained the same bits. Prints one line per child and the medians per checkout.
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

CHILD = r"""
import hashlib, json, os, statistics, sys, time
import torch
torch.set_num_threads(1)
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import bench_training as bt
from torch._dynamo.utils import compile_times
bt.qt.set_flush_warnings(False)
name, steps = sys.argv[1], int(sys.argv[2])
fp32, emu, what = bt.make_pair(name, False, True)
t = time.perf_counter(); fp32.step(); first_fp32 = time.perf_counter() - t
torch._dynamo.utils.compilation_time_metrics.clear()
t = time.perf_counter(); emu.step(); first_emu = time.perf_counter() - t
phases = compile_times(repr="csv", aggregate=True)
phases = dict(zip(phases[0], phases[1]))
keep = {k: float(phases[k]) for k in (
    "bytecode_tracing", "compile_fx.<locals>.fw_compiler_base", "compile_fx.<locals>.bw_compiler",
    "build_guards", "backward._backward_impl") if k in phases}
tf, te = [], []
for _ in range(steps):
    tf.append(fp32.timed_step()); te.append(emu.timed_step())
h = hashlib.sha256()
for n, p in emu.model.named_parameters():
    d = p.payload if hasattr(p, "payload") else p.detach()
    h.update(n.encode()); h.update(d.contiguous().view(torch.int32).numpy().tobytes())
print("RESULT " + json.dumps({"first_fp32": first_fp32, "first_emu": first_emu,
      "step_fp32": statistics.median(tf), "step_emu": statistics.median(te),
      "phases": keep, "bits": h.hexdigest()[:16]}))
"""


def run_child(tree, name, steps, warm=False):
    cache = tempfile.mkdtemp(prefix="qt_ab_inductor_")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS="1",
               PYTHONDONTWRITEBYTECODE="1")
    try:
        for _ in range(2 if warm else 1):  # --warm: a first, untimed run fills the cache
            out = subprocess.run([sys.executable, "-c", CHILD, name, str(steps)], cwd=tree,
                                 env=env, capture_output=True, text=True, timeout=900)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"child failed in {tree}:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", nargs=2, required=True, metavar=("A", "B"))
    p.add_argument("--only", default="gpt256,chargpt")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=7, help="steady steps of each after the first")
    p.add_argument("--warm", action="store_true", help="time a second run on the cache the "
                   "first filled (dynamo traces again; inductor's and AOTAutograd's caches hit)")
    args = p.parse_args()
    trees = [os.path.abspath(t) for t in args.trees]
    for name in args.only.split(","):
        res = {t: [] for t in trees}
        for r in range(args.rounds):
            for t in (trees if r % 2 == 0 else trees[::-1]):
                x = run_child(t, name, args.steps, args.warm)
                res[t].append(x)
                print(f"{name} {os.path.basename(t) or t}: first FP32 {x['first_fp32']:.1f} s, "
                      f"emulated {x['first_emu']:.1f} s ({x['first_emu'] / x['first_fp32']:.2f}x);"
                      f" steady {x['step_fp32'] * 1e3:.1f} / {x['step_emu'] * 1e3:.1f} ms; "
                      f"phases {json.dumps({k: round(v, 1) for k, v in x['phases'].items()})}; "
                      f"bits {x['bits']}", flush=True)
        for t in trees:
            xs = res[t]
            med = {k: statistics.median(x[k] for x in xs)
                   for k in ("first_fp32", "first_emu", "step_fp32", "step_emu")}
            ratio = statistics.median(x["first_emu"] / x["first_fp32"] for x in xs)
            print(f"== {name} {t}: median first step FP32 {med['first_fp32']:.1f} s, emulated "
                  f"{med['first_emu']:.1f} s, ratio {ratio:.2f}x; steady FP32 "
                  f"{med['step_fp32'] * 1e3:.1f} ms, emulated {med['step_emu'] * 1e3:.1f} ms; "
                  f"bits {sorted({x['bits'] for x in xs})}")


if __name__ == "__main__":
    main()

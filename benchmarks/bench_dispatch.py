"""Per-op cost of QTensor's __torch_dispatch__: small tensors, where the Python work is the cost.

    python benchmarks/bench_dispatch.py                       # this tree's qtensor
    python benchmarks/bench_dispatch.py --ab /work/main       # A/B: that tree vs this one

Times each op on a 64x64 QTensor (values bf16(rounding=nearest_away), operand format mxfp6_e3m2,
as the GPT benchmark's MX recipe gives its activations) and on the plain float32 tensor, one
thread, medians of interleaved repeats; the overhead is the difference. ``--ab TREE`` runs the
measurement in child processes alternately with TREE's qtensor and with this tree's (PYTHONPATH),
``--rounds`` times each, and prints both overheads and their ratio (this tree / TREE).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(fmt: str, mm_fmt: str, number: int, repeat: int) -> dict:
    import torch
    import torch.nn.functional as F

    import qtensor as qt
    torch.set_num_threads(1)
    torch.manual_seed(0)
    aten = torch.ops.aten
    p, pb = torch.randn(64, 64), torch.randn(64, 64)
    x, y = qt.as_qtensor(p, fmt, mm_fmt=mm_fmt), qt.as_qtensor(pb, fmt, mm_fmt=mm_fmt)
    cases = {
        "view": lambda a, b: a.view(4096), "t": lambda a, b: a.t(),
        "transpose": lambda a, b: a.transpose(0, 1), "detach": lambda a, b: a.detach(),
        "expand": lambda a, b: a.expand(2, 64, 64), "unsqueeze": lambda a, b: a.unsqueeze(0),
        "_unsafe_view": lambda a, b: aten._unsafe_view(a, [4096]),
        "clone": lambda a, b: a.clone(),
        "add": lambda a, b: a + b, "mul": lambda a, b: a * b, "mul_scalar": lambda a, b: a * 0.5,
        "gelu": lambda a, b: F.gelu(a), "softmax": lambda a, b: a.softmax(-1),
        "layer_norm": lambda a, b: F.layer_norm(a, (64,)), "mm": lambda a, b: a @ b,
        "addmm": lambda a, b: torch.addmm(b, a, b),
    }
    times = {name: {"q": [], "plain": []} for name in cases}
    for name, f in cases.items():
        f(x, y), f(p, pb)
    for _ in range(repeat):  # the ops interleaved, QTensor and plain side by side
        for name, f in cases.items():
            for key, (a, b) in (("q", (x, y)), ("plain", (p, pb))):
                t = time.perf_counter()
                for _ in range(number):
                    f(a, b)
                times[name][key].append((time.perf_counter() - t) / number * 1e6)
    return {name: {k: statistics.median(v) for k, v in r.items()} for name, r in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="bf16(rounding=nearest_away)")
    ap.add_argument("--mm-fmt", default="mxfp6_e3m2(rounding=nearest_away)")
    ap.add_argument("--number", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--ab", metavar="TREE", help="compare with the qtensor of this source tree")
    ap.add_argument("--rounds", type=int, default=3, help="--ab: runs of each tree, alternated")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.json or not args.ab:
        res = measure(args.fmt, args.mm_fmt, args.number, args.repeat)
        if args.json:
            print(json.dumps(res))
            return
        import qtensor
        print(f"qtensor from {os.path.dirname(qtensor.__file__)}; fmt={args.fmt}, "
              f"mm_fmt={args.mm_fmt}, 64x64, µs per op (medians)")
        print(f"{'op':14s} {'plain':>7s} {'QTensor':>8s} {'overhead':>9s}")
        for name, r in res.items():
            print(f"{name:14s} {r['plain']:7.1f} {r['q']:8.1f} {r['q'] - r['plain']:9.1f}")
        return
    trees = {"A": os.path.abspath(args.ab), "B": os.path.abspath(os.path.join(HERE, ".."))}
    runs = {"A": [], "B": []}
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--json", "--fmt", args.fmt, "--mm-fmt",
           args.mm_fmt, "--number", str(args.number), "--repeat", str(args.repeat)]
    for _ in range(args.rounds):
        for key, tree in trees.items():
            out = subprocess.run(cmd, env=dict(env, PYTHONPATH=tree), capture_output=True,
                                 text=True, check=True, cwd=tree).stdout
            runs[key].append(json.loads(out.strip().splitlines()[-1]))
    print(f"A = {trees['A']}, B = {trees['B']}; fmt={args.fmt}, mm_fmt={args.mm_fmt}, 64x64, "
          f"µs per op, medians of {args.rounds} alternated runs")
    print(f"{'op':14s} {'plain':>7s} {'A':>7s} {'B':>7s} {'A over':>7s} {'B over':>7s} "
          f"{'B/A over':>8s}")
    for name in runs["A"][0]:
        med = {k: statistics.median(r[name]["q"] for r in runs[k]) for k in runs}
        plain = statistics.median(r[name]["plain"] for k in runs for r in runs[k])
        oa, ob = med["A"] - plain, med["B"] - plain
        print(f"{name:14s} {plain:7.1f} {med['A']:7.1f} {med['B']:7.1f} {oa:7.1f} {ob:7.1f} "
              f"{ob / oa:8.2f}")


if __name__ == "__main__":
    main()

"""How much of a tensor's L1 norm the block formats' scale rules clip (qtensor.tensor.flush_warnings's
clipping measure, the quantity its warning compares with CLIP_LIMIT), on random data.

    PYTHONPATH=. python benchmarks/bench_clipping.py

Data (seed 0): Gaussian 512x1024; Student-t(3) 512x1024; dL/dlogits of a softmax
cross-entropy at initialisation (softmax(N(0, 0.02^2) logits) - onehot, divided by the rows) for
10 classes (512 rows, the demo's CNN), 162 (2048 rows, examples/mx_training.py's byte
vocabulary) and 50257 (16 rows, GPT-2's), blocked along the classes as a Linear's dgrad
blocks dY. Formats: MXFP8/MXFP6/MXFP4 under OCP's floor rule and under ceil, NVFP4.
"""
from __future__ import annotations

import argparse

import torch

import qtensor as qt
from qtensor.tensor import flush_warnings as fw


def dlogits(rows, classes, g):
    logits = 0.02 * torch.randn(rows, classes, generator=g)
    target = torch.randint(0, classes, (rows,), generator=g)
    p = torch.softmax(logits, -1)
    p[torch.arange(rows), target] -= 1
    return p / rows


def data():
    g = torch.Generator().manual_seed(0)
    t3 = torch.distributions.StudentT(3.0)
    torch.manual_seed(0)
    return {"Gaussian": torch.randn(512, 1024, generator=g),
            "Student-t(3)": t3.sample((512, 1024)),
            "dL/dlogits, 10 classes": dlogits(512, 10, g),
            "dL/dlogits, 162 classes": dlogits(2048, 162, g),
            "dL/dlogits, 50257 classes": dlogits(16, 50257, g)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.parse_args(argv)
    fmts = {}
    for name in ("mxfp8_e4m3", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1"):
        f = qt.format(name)
        fmts[f"{name} floor"] = f
        fmts[f"{name} ceil"] = f.replace(scale_rule="ceil")
    fmts["nvfp4"] = qt.nvfp4
    xs = data()
    print(f"share of the L1 norm clipped (limit {100 * fw.CLIP_LIMIT:g}%), "
          "and of the nonzero values clipped")
    print("| format | " + " | ".join(xs) + " |")
    print("|:--|" + "--:|" * len(xs))
    for label, f in fmts.items():
        cells = []
        for x in xs.values():
            c = fw.clipping(x, f)
            cells.append(f"{100 * c['lost'] / c['magnitude']:.2f}% / "
                         f"{100 * c['clipped'] / int(torch.count_nonzero(x)):.2f}%")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

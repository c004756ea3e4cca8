"""One GPT training step on a device: bf16 (autocast) against an emulated recipe, eager and
compiled, the emulated compiled step with qtensor's inductor decompositions off and on.

    python benchmarks/bench_gpu_training.py --device cuda --json results/training_cuda.json
    python benchmarks/bench_gpu_training.py --device cpu --quick --no-compile   # a smoke run

Model: examples/common.py's CharGPT (d=256, 4 layers, 4 heads, T=128, batch 8; --quick: d=64,
1 layer, T=32, batch 2), AdamW. Each row: the first step's time (compilation included) and the
median of the timed steps (the device synchronized around each). The goal on a GPU: the
emulated compiled step at most 1.1x the bf16 compiled one (the last line says the ratio).
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
import qtensor as qt  # noqa: E402
from qtensor.kernels import decompositions  # noqa: E402
import common  # noqa: E402  (examples/common.py: CharGPT)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(model, batches, device, steps, warmup, autocast):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)

    def step(b):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(b[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                   b[:, 1:].reshape(-1))
        loss.backward()
        opt.step()

    times = []
    for i in range(warmup + steps):
        sync(device)
        t = time.perf_counter()
        step(batches[i % len(batches)])
        sync(device)
        times.append(time.perf_counter() - t)
    return times[0], statistics.median(times[warmup:])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--recipe", default="mxfp8_pretraining", help="a qt.recipes name")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--no-compile", action="store_true", help="eager rows only")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    d, layers, t, batch = (64, 1, 32, 2) if args.quick else (256, 4, 128, 8)
    recipe = getattr(qt.recipes, args.recipe)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (batch, t + 1), generator=g).to(device) for _ in range(4)]
    torch.manual_seed(0)
    base = common.CharGPT(256, d=d, layers=layers, heads=4, context=t).to(device)
    rows = []

    def row(name, model, autocast, compiled, decomp=False):
        decompositions.set_enabled(decomp)
        torch._dynamo.reset()
        m = torch.compile(model, dynamic=False) if compiled else model
        first, med = run(m, batches, device, args.steps, args.warmup, autocast)
        rows.append(dict(name=name, first_s=first, step_ms=med * 1e3))
        print(f"{name:<40} first {first:8.2f} s   step {med * 1e3:9.2f} ms", flush=True)

    print(f"{torch.__version__} on {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}); "
          f"GPT d={d}, {layers} layers, T={t}, batch {batch}; emulated: {args.recipe}")
    row("bf16 eager", copy.deepcopy(base), True, False)
    emu = qt.convert(copy.deepcopy(base), recipe)
    row(f"{args.recipe} eager", emu, False, False)
    if not args.no_compile:
        row("bf16 compiled", copy.deepcopy(base), True, True)
        row(f"{args.recipe} compiled, decompositions off",
            qt.convert(copy.deepcopy(base), recipe), False, True, False)
        row(f"{args.recipe} compiled, decompositions on",
            qt.convert(copy.deepcopy(base), recipe), False, True, True)
        decompositions.set_enabled(False)
        ref = rows[2]["step_ms"]
        for r in rows[3:]:
            print(f"{r['name']}: {r['step_ms'] / ref:.2f}x bf16 compiled (goal: at most 1.1x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(device), recipe=args.recipe, rows=rows,
                           torch=torch.__version__), f, indent=1)


if __name__ == "__main__":
    main()

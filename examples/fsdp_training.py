"""The char-GPT of mx_training.py trained with FSDP2 and the MXFP6 recipe on 2 CPU processes.

    torchrun --standalone --nproc-per-node 2 examples/fsdp_training.py               # 100 steps
    torchrun --standalone --nproc-per-node 2 examples/fsdp_training.py --steps 3 --check

Convert, then shard: ``qt.convert(model, qt.recipes.mxfp6)``, then ``fully_shard`` on every
block and on the root. Each rank trains on its half of every global batch; FSDP2 all-gathers the
QTensor weights (MXFP6_E3M2 operands of every contraction, FP32 values), reduce-scatters the
gradients in FP32 and qtensor rounds each gradient shard once to the grad role (BF16).

``--check``: rank 0 then trains the same model in one process on the same global batches by the
reduction rule (each rank's micro-batch gradient, their FP32 mean rounded once to BF16) and
reports whether every parameter is bit-identical to the sharded run. See docs/distributed.md.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import common  # noqa: E402
from mx_training import Corpus  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import qtensor as qt  # noqa: E402


def build(vocab, args):
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = common.CharGPT(vocab, d=args.d, layers=args.layers, heads=args.heads,
                           context=args.context)
    return qt.convert(model, qt.recipes.mxfp6)  # convert, then shard


def optimizer(model, args):  # made after fully_shard: it must hold the sharded parameters
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)


def loss_of(model, x, y):
    logits = common.plain(model(x))  # the loss of the emulated logits, in FP32
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def batches(corpus, args):
    g = torch.Generator().manual_seed(args.seed)  # the same global batches on every rank
    hi = len(corpus.train) - args.context - 1
    for _ in range(args.steps):
        yield Corpus.batch(corpus.train, torch.randint(0, hi, (args.batch,), generator=g),
                           args.context)


def single_process(corpus, args, world):
    """The same training in one process, by the reduction rule."""
    model = build(corpus.vocab, args)
    opt = optimizer(model, args)
    params = list(model.parameters())
    n = args.batch // world
    for x, y in batches(corpus, args):
        grads = []
        for r in range(world):
            opt.zero_grad()
            loss_of(model, x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]).backward()
            grads.append([common.plain(p.grad).clone() for p in params])
        with torch.no_grad():
            for i, p in enumerate(params):
                p.grad.copy_(sum(g[i] for g in grads) / world)  # rounded once, to BF16
        opt.step()
    return model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=16, help="global batch (split over the ranks)")
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-bytes", type=int, default=2_000_000, help="of the stdlib corpus")
    ap.add_argument("--check", action="store_true",
                    help="compare with the single-process run (rank 0), bit for bit")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = Corpus(max_bytes=args.max_bytes)
    model = build(corpus.vocab, args)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = optimizer(model, args)
    n = args.batch // world
    for step, (x, y) in enumerate(batches(corpus, args)):
        loss = loss_of(model, x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {float(mean) / world:.4f}", flush=True)
    w = model.head.weight
    if rank == 0:
        print(f"head.weight: {type(w).__name__} of {type(w.to_local()).__name__}"
              f"(fmt={w.to_local().fmt}, mm_fmt={w.to_local().mm_fmt}); gradient shard "
              f"fmt={w.grad.to_local().fmt}")
    full = {name: common.plain(p.full_tensor()) for name, p in model.named_parameters()}
    if args.check and rank == 0:
        ref = dict(single_process(corpus, args, world).named_parameters())
        same = [torch.equal(full[k].view(torch.int32), common.plain(ref[k]).view(torch.int32))
                for k in full]
        worst = max(float((full[k] - common.plain(ref[k].detach())).abs().max()) for k in full)
        print(f"single-process check: {sum(same)}/{len(same)} parameters bit-identical "
              f"(max |diff| {worst:.3g})")
        if not all(same):
            raise SystemExit(1)
    # Rank 1 must not tear gloo down while rank 0 still runs the check: a peer leaving early
    # aborts the other's process at exit.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

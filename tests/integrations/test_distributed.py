"""Converted models under torch.distributed: collectives, DDP, FSDP2, DTensor/TP, DCP.

Two gloo processes on the CPU, started once for the module (a pool that runs one scenario per
test: starting Python and torch twice per test would cost most of the file's time). Each scenario
runs on both ranks and returns picklable results; the single-process reference runs in the test
process itself. The reduction rule and wrap orders under test: docs/distributed.md.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import queue
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import qtensor as qt

WORLD = 2

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available")


# ---------------------------------------------------------------------------------------------
# The pool of ranks

def _worker(rank, world, store_path, tasks, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    import sys
    scenarios = sys.modules[__name__]
    while True:
        task = tasks.get()
        if task is None:
            break
        name, args = task
        try:
            torch.manual_seed(0)
            results.put((rank, True, getattr(scenarios, name)(rank, world, *args)))
        except BaseException:  # noqa: BLE001 (reported to the test)
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class _Pool:
    def __init__(self, world):
        self._start(world)

    def _start(self, world):
        ctx = mp.get_context("spawn")
        self.world = world
        self.dir = tempfile.TemporaryDirectory()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        store = os.path.join(self.dir.name, "store")  # a fresh file: no port to collide on
        self.procs = [ctx.Process(target=_worker, args=(r, world, store, self.tasks[r],
                                                        self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, name, *args, timeout=120):
        for q in self.tasks:
            q.put((name, args))
        out, errors = {}, []
        for _ in range(self.world):
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                errors.append(f"no answer within {timeout} s")
                break
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors or len(out) < self.world:
            self.close()  # a rank may be left inside a collective: fresh ranks for the next test
            self._start(self.world)
            raise AssertionError(f"scenario {name} failed\n" + "\n".join(errors))
        return [out[r] for r in range(self.world)]

    def close(self):
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
        self.dir.cleanup()


@pytest.fixture(scope="module")
def ranks():
    pool = _Pool(WORLD)
    yield pool
    pool.close()


def _bits(t):
    t = t.dequantize() if isinstance(t, qt.QTensor) else t
    t = t.detach().contiguous().to(torch.float32)
    return t.view(torch.int32)


def _assert_bits_equal(a, b, what=""):
    assert torch.equal(_bits(a), _bits(b)), (
        f"{what}: differ in {(_bits(a) != _bits(b)).sum().item()} of {a.numel()} elements, "
        f"max |diff| {(qt_plain(a) - qt_plain(b)).abs().max().item()}")


def qt_plain(t):
    return (t.dequantize() if isinstance(t, qt.QTensor) else t).detach().float()


def _fmt(t):
    t = getattr(t, "_local_tensor", t)  # a DTensor's local tensor
    return (str(t.fmt), None if t.mm_fmt is None else str(t.mm_fmt)) if isinstance(
        t, qt.QTensor) else None


# ---------------------------------------------------------------------------------------------
# 1. Collectives

def _sc_functional_collectives(rank, world):
    import torch.distributed._functional_collectives as funcol
    g = dist.group.WORLD
    q = qt.as_qtensor(torch.full((65536,), rank + 1.0), qt.bf16)
    out = {}
    gathered = funcol.all_gather_tensor(q, 0, g)
    out["all_gather"] = (_fmt(gathered), qt_plain(gathered))
    # 1 + 2**-10 is no bf16 value: the sum is rounded once (to 1), on both ranks
    x = qt.as_qtensor(torch.tensor([1.0, 3.0, 2.0 ** -10, 0.5]) if rank == 0
                      else torch.tensor([2.0 ** -10, 5.0, 1.0, 0.25]), qt.bf16)
    r = funcol.all_reduce(x, "sum", g)
    out["all_reduce"] = (_fmt(r), qt_plain(r))
    rs = funcol.reduce_scatter_tensor(x, "sum", 0, g)
    out["reduce_scatter"] = (_fmt(rs), qt_plain(rs))
    return out


def test_functional_collectives_wait_and_keep_the_format(ranks):
    res = ranks.run("_sc_functional_collectives")
    full = torch.cat([torch.full((65536,), 1.0), torch.full((65536,), 2.0)])
    reduced = torch.tensor([1.0, 8.0, 1.0, 0.75])  # 1 + 2**-10 rounds to 1 in bf16
    for rank, out in enumerate(res):
        assert out["all_gather"][0] == ("bf16", None)
        _assert_bits_equal(out["all_gather"][1], full, f"rank {rank} all_gather")
        assert out["all_reduce"][0] == ("bf16", None)
        _assert_bits_equal(out["all_reduce"][1], reduced, f"rank {rank} all_reduce")
        assert out["reduce_scatter"][0] == ("bf16", None)
        _assert_bits_equal(out["reduce_scatter"][1], reduced[2 * rank:2 * rank + 2],
                           f"rank {rank} reduce_scatter")


def _two_level_rows(seed, rows=8, cols=32):
    """Values whose rows span 4 decades: each half of the rows has its own amax."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.logspace(0, 4, rows).view(rows, 1)


def _scale_bits(q):
    return int(q.tensor_scale.view(torch.int32))


def _sc_functional_two_level(rank, world):
    import torch.distributed._functional_collectives as funcol
    g = dist.group.WORLD
    out = {}
    # shards of one tensor rounded whole (both ranks build it), under a given scale (not the one
    # of its amax: a fresh rounding would take another): they carry its scale
    whole = qt.as_qtensor(_two_level_rows(0), qt.nvfp4, tensor_scale=16.0)
    n = whole.shape[0] // world
    ag = funcol.all_gather_tensor(whole[rank * n:(rank + 1) * n], 0, g)
    out["all_gather"] = (_fmt(ag), qt_plain(ag), _scale_bits(ag))
    # tensors of their own scales: as a cat of them, one fresh scale of the gathered amax
    own = qt.as_qtensor(_two_level_rows(1 + rank, rows=4), qt.nvfp4)
    ag2 = funcol.all_gather_tensor(own, 0, g)
    out["all_gather_own"] = (qt_plain(ag2), _scale_bits(ag2))
    # the reduced sum: one scale, of the whole sum's amax, on each rank's part
    x = qt.as_qtensor(_two_level_rows(10 + rank) * (1 + rank), qt.nvfp4)
    rs = funcol.reduce_scatter_tensor(x, "sum", 0, g)
    out["reduce_scatter"] = (_fmt(rs), qt_plain(rs), _scale_bits(rs))
    ar = funcol.all_reduce(x, "sum", g)
    out["all_reduce"] = (qt_plain(ar), _scale_bits(ar))
    return out


def _sc_functional_two_level_compiled(rank, world):
    """The all-gather and reduce-scatter of _sc_functional_two_level in a compiled function."""
    import torch.distributed._functional_collectives as funcol
    g = dist.group.WORLD
    whole = qt.as_qtensor(_two_level_rows(0), qt.nvfp4, tensor_scale=16.0)
    n = whole.shape[0] // world
    x = qt.as_qtensor(_two_level_rows(10 + rank) * (1 + rank), qt.nvfp4)

    def f(part, x):
        return funcol.all_gather_tensor(part, 0, g), funcol.reduce_scatter_tensor(x, "sum", 0, g)
    try:  # aot_eager: the rules traced on fake payloads, no code generation (cheap)
        ag, rs = torch.compile(f, backend="aot_eager")(whole[rank * n:(rank + 1) * n].clone(), x)
    finally:
        torch._dynamo.reset()
    return {"all_gather": (_fmt(ag), qt_plain(ag), _scale_bits(ag)),
            "reduce_scatter": (_fmt(rs), qt_plain(rs), _scale_bits(rs))}


@pytest.mark.parametrize("compiled", [False, True])
def test_functional_collectives_of_two_level_formats_follow_one_process(ranks, compiled):
    # (as torch.compile's graphs and DTensor use them) an all-gather keeps the shards' values
    # and their shared tensor scale; a reduce-scatter rounds each part under the scale of the
    # whole reduced tensor's amax (Transformer Engine's one scale): bit for bit one process's
    # result, then sliced; the same in a compiled function
    if compiled:
        res = ranks.run("_sc_functional_two_level_compiled", timeout=300)
    else:
        res = ranks.run("_sc_functional_two_level")
    whole = qt.as_qtensor(_two_level_rows(0), qt.nvfp4, tensor_scale=16.0)
    own = torch.cat([qt.as_qtensor(_two_level_rows(1 + r, rows=4), qt.nvfp4)
                     for r in range(WORLD)])
    xs = [qt.as_qtensor(_two_level_rows(10 + r) * (1 + r), qt.nvfp4) for r in range(WORLD)]
    total = qt.as_qtensor(_fp32_sum(qt_plain(x) for x in xs), qt.nvfp4)
    n = whole.shape[0] // WORLD
    for rank, out in enumerate(res):
        fmts, values, scale = out["all_gather"]
        assert fmts == ("nvfp4", None)
        _assert_bits_equal(values, whole, f"rank {rank} all_gather")
        assert scale == _scale_bits(whole), (rank, "all_gather scale")
        fmts, values, scale = out["reduce_scatter"]
        assert fmts == ("nvfp4", None)
        _assert_bits_equal(values, total[rank * n:(rank + 1) * n], f"rank {rank} reduce_scatter")
        assert scale == _scale_bits(total), (rank, "reduce_scatter scale")
        if compiled:
            continue
        _assert_bits_equal(out["all_gather_own"][0], own, f"rank {rank} all_gather, own scales")
        assert out["all_gather_own"][1] == _scale_bits(own), (rank, "all_gather own scales")
        _assert_bits_equal(out["all_reduce"][0], total, f"rank {rank} all_reduce")
        assert out["all_reduce"][1] == _scale_bits(total), (rank, "all_reduce scale")


def _sc_c10d_collectives(rank, world):
    vals = (torch.tensor([1.0, 3.0, 2.0 ** -10, 0.5]) if rank == 0
            else torch.tensor([2.0 ** -10, 5.0, 1.0, 0.25]))
    out = {}
    x = qt.as_qtensor(vals, qt.bf16)
    dist.all_reduce(x)
    out["all_reduce"] = (_fmt(x), qt_plain(x))
    x = qt.as_qtensor(vals, qt.bf16)
    work = dist.all_reduce(x, async_op=True)
    work.wait()
    out["all_reduce_async"] = (_fmt(x), qt_plain(x))
    x = qt.as_qtensor(vals, qt.bf16)
    dst = qt.as_qtensor(torch.zeros(8), qt.bf16)
    dist.all_gather_into_tensor(dst, x)
    out["all_gather_into_tensor"] = (_fmt(dst), qt_plain(dst))
    lst = [qt.as_qtensor(torch.zeros(4), qt.bf16) for _ in range(world)]
    dist.all_gather(lst, x)
    out["all_gather"] = ([_fmt(t) for t in lst], torch.cat([qt_plain(t) for t in lst]))
    rs = qt.as_qtensor(torch.zeros(2), qt.bf16)
    dist.reduce_scatter_tensor(rs, x)
    out["reduce_scatter"] = (_fmt(rs), qt_plain(rs))
    b = qt.as_qtensor(vals, qt.bf16)
    dist.broadcast(b, src=1)
    out["broadcast"] = (_fmt(b), qt_plain(b))
    return out


def test_c10d_collectives_sync_and_async_round_once(ranks):
    res = ranks.run("_sc_c10d_collectives")
    v0, v1 = torch.tensor([1.0, 3.0, 2.0 ** -10, 0.5]), torch.tensor([2.0 ** -10, 5.0, 1.0, 0.25])
    reduced = torch.tensor([1.0, 8.0, 1.0, 0.75])
    for rank, out in enumerate(res):
        for key in ("all_reduce", "all_reduce_async"):
            assert out[key][0] == ("bf16", None), key
            _assert_bits_equal(out[key][1], reduced, f"rank {rank} {key}")
        assert out["all_gather_into_tensor"][0] == ("bf16", None)
        _assert_bits_equal(out["all_gather_into_tensor"][1], torch.cat([v0, v1]),
                           f"rank {rank} all_gather_into_tensor")
        assert out["all_gather"][0] == [("bf16", None)] * 2
        _assert_bits_equal(out["all_gather"][1], torch.cat([v0, v1]), f"rank {rank} all_gather")
        assert out["reduce_scatter"][0] == ("bf16", None)
        _assert_bits_equal(out["reduce_scatter"][1], reduced[2 * rank:2 * rank + 2],
                           f"rank {rank} reduce_scatter")
        _assert_bits_equal(out["broadcast"][1], v1, f"rank {rank} broadcast")


# ---------------------------------------------------------------------------------------------
# 2. DDP: the reduction rule

def _mlp(hidden=16, out=4):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, out))


def _data(steps, batch=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 8, generator=g), torch.randn(batch, 4, generator=g))
            for _ in range(steps)]


def _spec(name):
    if name == "mx_cut":  # blocks that FSDP2's dim-0 shards cut, in every role on a shard
        mx = qt.mxfp8_e4m3
        return qt.Recipe(weight=mx.replace(axis=0, block_size=16), bias=mx.replace(axis=None),
                         activation=qt.bf16, grad=qt.mxfp4_e2m1.replace(axis=None), master_weights=True)
    if name == "nvfp4_grad":  # two-level gradients only: the reduce-scatter's output
        return qt.Recipe(weight=qt.bf16, activation=qt.bf16, grad=qt.nvfp4)
    if name == "nvfp4_state":  # two-level optimizer state, no masters: every op of the update
        return qt.Recipe(weight=qt.nvfp4, activation=qt.nvfp4, grad=qt.nvfp4,
                         optimizer_state=qt.nvfp4, master_weights=False)
    return {"bf16": qt.bf16, "mxfp6": qt.recipes.mxfp6, "fp8": qt.fp8_e4m3,
            "mx_all_mxfp8": qt.recipes.mx_all_mxfp8, "nvfp4": qt.nvfp4}[name]


def _state(model):
    """name -> (formats of value and gradient, plain value, plain gradient)."""
    out = {}
    for n, p in model.named_parameters():
        n = n.removeprefix("module.")
        out[n] = (_fmt(p), _fmt(p.grad), qt_plain(p), None if p.grad is None else qt_plain(p.grad))
    return out


def _train_shard(model, opt, rank, world, batches):
    """SGD/Adam steps of this rank on its slice of each global batch."""
    for x, y in batches:
        n = len(x) // world
        loss = F.mse_loss(qt_plain_grad(model(x[rank * n:(rank + 1) * n])),
                          y[rank * n:(rank + 1) * n])
        opt.zero_grad()
        loss.backward()
        opt.step()


def _sc_ddp(rank, world, spec, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(qt.convert(_mlp(), _spec(spec)))
    opt = _optimizer("sgd", model)
    _train_shard(model, opt, rank, world, _data(steps))
    return _state(model)


def qt_plain_grad(t):  # the loss in FP32 of the emulated output (differentiable)
    return t.dequantize() if isinstance(t, qt.QTensor) else t


def _optimizer(name, model):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if name == "adamw":  # (eps: 1e-8 rounds to 0 beside exp_avg_sq in an MXFP8 block)
        return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.1)
    if name == "adamw_eps1":  # (NVFP4 state: E2M1 flushes eps=1e-3 beside sqrt(exp_avg_sq))
        return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1.0, weight_decay=0.1)
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def _reduced_reference(spec, steps, world=WORLD, optim="sgd", hidden=16):
    """One process, the same global batches, by the reduction rule: each rank's gradient (its
    micro-batch's, in the grad format), their mean in FP32, rounded once to the grad format."""
    model = qt.convert(_mlp(hidden), _spec(spec))
    opt = _optimizer(optim, model)
    params = list(model.parameters())
    names = [n for n, _p in model.named_parameters()]
    seen_scales = {n: [] for n in names}
    for x, y in _data(steps):
        n = len(x) // world
        grads = []
        for name, p in zip(names, params):  # the tensor scales forward sees at this step
            seen_scales[name].append(_scale(p))
        for r in range(world):
            opt.zero_grad()
            loss = F.mse_loss(qt_plain_grad(model(x[r * n:(r + 1) * n])), y[r * n:(r + 1) * n])
            loss.backward()
            grads.append([qt_plain(p.grad) for p in params])
        with torch.no_grad():
            for i, p in enumerate(params):
                mean = _fp32_sum(g[i] for g in grads) / world
                p.grad.copy_(mean)  # rounded once, into the gradient's format
        opt.step()
    _REF_OPT_STATE[spec, hidden] = _opt_state(opt)
    _REF_SCALES[spec, hidden] = ({n: (_scale(p), _scale(p.grad)) for n, p in zip(names, params)},
                                 seen_scales)
    return _state(model)


def _fp32_sum(tensors):
    """The FP32 sum of the ranks' gradients as a reduction forms it (sum() would start from +0:
    two -0.0 gradients, which block formats flush tiny values to, would sum to +0.0)."""
    tensors = iter(tensors)
    total = next(tensors)
    for t in tensors:
        total = total + t
    return total


_REF_OPT_STATE = {}  # (spec, hidden) -> the last reference run's optimizer state
_REF_SCALES = {}  # (spec, hidden) -> its two-level tensor scales (as _sc_fsdp's scales=True)


def _accumulated_reference(spec, steps, world=WORLD):
    """One process, the same global batches: gradient accumulation over the ranks' micro-batches
    (each loss divided by the world size): the same as the rule where dividing a gradient by the
    world size is exact in its format (no underflow: bf16 here, not fp8)."""
    model = qt.convert(_mlp(), _spec(spec))
    opt = _optimizer("sgd", model)
    for x, y in _data(steps):
        n = len(x) // world
        opt.zero_grad()
        for r in range(world):
            loss = F.mse_loss(qt_plain_grad(model(x[r * n:(r + 1) * n])), y[r * n:(r + 1) * n])
            (loss / world).backward()
        opt.step()
    return _state(model)


def _assert_states_equal(state, ref, who):
    assert state.keys() == ref.keys()
    for n, (fmts, gfmts, value, grad) in state.items():
        rf, rg, rv, rgrad = ref[n]
        assert fmts == rf and gfmts == rg, (who, n, fmts, gfmts, rf, rg)
        _assert_bits_equal(value, rv, f"{who} {n}")
        _assert_bits_equal(grad, rgrad, f"{who} {n}.grad")


@pytest.mark.parametrize("spec", ["bf16", "mxfp6", "fp8"])
def test_ddp_follows_the_reduction_rule_bit_for_bit(ranks, spec):
    res = ranks.run("_sc_ddp", spec, 3)
    ref = _reduced_reference(spec, 3)
    for rank, state in enumerate(res):
        _assert_states_equal(state, ref, f"rank {rank}")
    if spec == "bf16":  # and so gradient accumulation in one process, where the division is exact
        _assert_states_equal(res[0], _accumulated_reference(spec, 3), "accumulation")


class _Branchy(nn.Module):
    """Three linears; ``c`` only where the caller says (rank 1 leaves it unused below)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x, use_c=True):
        y = self.a(x) + self.b(x)
        return y + self.c(x) if use_c else y


_UNUSED = ("find_unused_parameters", "static_graph")  # options run with c unused on rank 1


def _micro_batches(option, x, y, rank, world):
    n = len(x) // world
    x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    if option == "no_sync":  # two micro-batches: the first accumulated without a reduction
        return [(x[:n // 2], y[:n // 2]), (x[n // 2:], y[n // 2:])]
    return [(x, y)]


def _sc_ddp_option(rank, world, option, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP
    kwargs = {"find_unused_parameters": {"find_unused_parameters": True},
              "static_graph": {"static_graph": True}}.get(option, {})
    model = DDP(qt.convert(_Branchy(), qt.bf16), **kwargs)
    if option == "fp16_compress_hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = _optimizer("sgd", model)
    use_c = rank == 0 or option not in _UNUSED
    for x, y in _data(steps):
        micro = _micro_batches(option, x, y, rank, world)
        opt.zero_grad()
        for i, (xb, yb) in enumerate(micro):
            sync = model.no_sync() if i < len(micro) - 1 else contextlib.nullcontext()
            with sync:
                F.mse_loss(qt_plain_grad(model(xb, use_c)), yb).backward()
        opt.step()
    return _state(model)


def _ddp_option_reference(option, steps, world=WORLD):
    """One process by the rule: each rank's gradient (accumulated over its micro-batches in the
    grad format; zero for c where rank 1 leaves it unused, as DDP's bucket holds), their mean in
    FP32 (or, with fp16_compress_hook, the hook's: each halved in FP16, the FP16 sum), rounded
    once to bf16."""
    model = qt.convert(_Branchy(), qt.bf16)
    opt = _optimizer("sgd", model)
    params = list(model.parameters())
    for x, y in _data(steps):
        grads = []
        for r in range(world):
            opt.zero_grad()
            for xb, yb in _micro_batches(option, x, y, r, world):
                F.mse_loss(qt_plain_grad(model(xb, r == 0 or option not in _UNUSED)),
                           yb).backward()
            grads.append([torch.zeros(p.shape) if p.grad is None else qt_plain(p.grad)
                          for p in params])
        with torch.no_grad():
            for i, p in enumerate(params):
                if option == "fp16_compress_hook":
                    halves = [(g[i].half() / world).float() for g in grads]
                    mean = sum(halves[1:], halves[0]).half().float()  # world 2: one FP16 sum
                else:
                    mean = sum(g[i] for g in grads) / world
                p.grad = qt.as_qtensor(mean, qt.bf16)  # rounded once
        opt.step()
    return _state(model)


@pytest.mark.parametrize("option", ["find_unused_parameters", "static_graph", "no_sync",
                                    "fp16_compress_hook"])
def test_ddp_options_follow_the_reduction_rule(ranks, option):
    # find_unused_parameters/static_graph with c unused on rank 1: DDP gave its gradient there a
    # plain clone of the bucket (the mean unrounded, the format lost: the ranks diverged)
    res = ranks.run("_sc_ddp_option", option, 3)
    ref = _ddp_option_reference(option, 3)
    for rank, state in enumerate(res):
        for n, (fmts, gfmts, _v, _g) in state.items():
            assert gfmts == ("bf16", None), (rank, n, gfmts)
        _assert_states_equal(state, ref, f"rank {rank} {option}")


def _sc_ddp_refused(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.nn.parallel.distributed import _MixedPrecision
    out = {}
    for key, kwargs in (("gradient_as_bucket_view", {"gradient_as_bucket_view": True}),
                        ("mixed_precision",
                         {"mixed_precision": _MixedPrecision(param_dtype=torch.bfloat16)})):
        model = DDP(qt.convert(_mlp(), qt.bf16), **kwargs)
        try:
            qt_plain_grad(model(torch.ones(2, 8))).sum().backward()
            out[key] = ("ran", [_fmt(p.grad) for p in model.parameters()])
        except TypeError as e:
            out[key] = str(e)
    return out


def test_ddp_options_that_lose_the_formats_are_refused(ranks):
    # gradient_as_bucket_view=True made every gradient a plain FP32 view of DDP's bucket: the
    # formats lost and the mean never rounded; refused at the first forward
    for out in ranks.run("_sc_ddp_refused"):
        for key in ("gradient_as_bucket_view", "mixed_precision"):
            assert isinstance(out[key], str), (key, out[key])
            assert f"DDP({key}=" in out[key] and "not supported" in out[key], out[key]
            assert "DDP(model)" in out[key], out[key]


_WRAP_SPECS = {  # the parameters' formats differ (or some are plain): DDP flattens them together
    "weight bf16, bias fp32": qt.Recipe(weight=qt.bf16, bias=qt.fp32),
    "weight fp8, bias bf16": qt.Recipe(weight=qt.fp8_e4m3, bias=qt.bf16),
    "mxfp6": qt.recipes.mxfp6,
    "mx_all_mxfp8": qt.recipes.mx_all_mxfp8,
}


def _wrap_model(spec, rank):
    """A converted block (Linear, BatchNorm) before a plain one, each rank with its own values
    (DDP's start-up broadcast must give every rank rank 0's, exactly)."""
    torch.manual_seed(rank)
    head = nn.Sequential(nn.Linear(8, 40), nn.BatchNorm1d(40))
    model = nn.Sequential(qt.convert(head, spec), nn.Linear(40, 4), nn.BatchNorm1d(4))
    with torch.no_grad():  # values of every magnitude, plain buffers not in any format
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * torch.logspace(-3, 3, p.numel()).view(p.shape))
        for mod in (model[0][1], model[2]):
            mod.running_mean.copy_(torch.randn(mod.running_mean.shape) / 3)
            mod.running_var.uniform_(0.5, 2.0)
    return model


def _values(model):
    """name -> (formats, plain value) of every floating parameter and buffer."""
    return {n.removeprefix("module."): (_fmt(t), qt_plain(t).clone())  # (not a view of t)
            for n, t in model.state_dict().items() if t.is_floating_point()}


def _sc_ddp_wrap(rank, world, name):
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = _wrap_model(_WRAP_SPECS[name], rank)
    before = _values(model)
    ddp = DDP(model)  # broadcasts rank 0's parameters and buffers
    wrapped = _values(model)
    if rank == 1:  # the buffers again at each forward (broadcast_buffers=True)
        with torch.no_grad():
            for mod in (model[0][1], model[2]):
                mod.running_mean.mul_(3.0)
    ddp.eval()
    ddp(torch.randn(4, 8))
    return before, wrapped, _values(model)


@pytest.mark.parametrize("name", list(_WRAP_SPECS))
def test_ddp_wrap_keeps_every_parameter_and_buffer_bit_for_bit(ranks, name):
    # DDP's broadcast flattens all the tensors with one cat: with formats that differ, that cat
    # rounded every value to the first one's format (FP32 biases became BF16 values, BF16 biases
    # went onto the FP8 grid, the plain layer's values too)
    res = ranks.run("_sc_ddp_wrap", name)
    source = res[0][0]  # rank 0's values before wrapping
    assert source.keys() == res[1][0].keys()
    assert any(f is None for f, _v in source.values()), "no plain tensor in the model"
    for rank, (before, wrapped, after_forward) in enumerate(res):
        for what, state in (("wrapped", wrapped), ("after a forward", after_forward)):
            for n, (fmt, value) in state.items():
                assert fmt == before[n][0], (rank, what, n, fmt, before[n][0])
                _assert_bits_equal(value, source[n][1], f"rank {rank} {what} {n}")


def _sc_ddp_two_level(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP
    g = torch.Generator().manual_seed(rank)
    big = qt.as_qtensor(torch.randn(64, 32, generator=g)
                        * torch.logspace(0, 4, 64).view(64, 1), qt.nvfp4)
    lin = nn.Linear(32, 8, bias=False)
    lin.weight = nn.Parameter(big[:8])  # rows of big: big's tensor scale, not their own
    DDP(lin)  # broadcasts rank 0's parameters
    w = lin.weight
    again = qt.quantize(w, qt.nvfp4)  # under its carried scale: the values stay
    return qt_plain(w), w.tensor_scale.clone(), qt_plain(again)


def test_ddp_broadcast_keeps_a_two_level_tensor_scale(ranks):
    # the broadcast sent the payloads only: rank 1 kept its own tensor scale, under which
    # rank 0's values are not in the format (rounding them again moved them)
    (v0, s0, a0), (v1, s1, a1) = ranks.run("_sc_ddp_two_level")
    _assert_bits_equal(v1, v0, "rank 1's values")
    assert torch.equal(s1.view(torch.int32), s0.view(torch.int32))
    _assert_bits_equal(a1, v1, "rank 1's values rounded again under their scale")
    _assert_bits_equal(a0, v0, "rank 0's values rounded again under their scale")


def _sc_c10d_gather_two_level(rank, world):
    g = torch.Generator().manual_seed(rank)
    x = qt.as_qtensor(torch.randn(8, 32, generator=g) * 10 ** rank, qt.nvfp4)
    outs = [qt.as_qtensor(torch.ones(8, 32), qt.nvfp4) for _ in range(world)]
    dist.all_gather(outs, x)
    # each output's values are in the format under the tensor scale it carries
    return [(qt_plain(o), qt_plain(qt.quantize(o, qt.nvfp4))) for o in outs]


def test_c10d_all_gather_outputs_carry_their_values_tensor_scale(ranks):
    # the outputs kept the scales of their old values, under which the gathered ones are not
    # in the format (rounding them again under the carried scale moved them)
    for rank, res in enumerate(ranks.run("_sc_c10d_gather_two_level")):
        for i, (v, again) in enumerate(res):
            _assert_bits_equal(again, v, f"rank {rank} output {i}")


def _two_level_inputs(rank):
    """(whole, own, x, b): a tensor every rank rounds whole under a given scale (not its amax's:
    a fresh rounding would take another), a tensor of this rank's own scale, a rank's summand
    and a rank's tensor under a scale given per rank."""
    whole = qt.as_qtensor(_two_level_rows(0), qt.nvfp4, tensor_scale=16.0)
    own = qt.as_qtensor(_two_level_rows(1 + rank, rows=4), qt.nvfp4)
    x = qt.as_qtensor(_two_level_rows(10 + rank) * (1 + rank), qt.nvfp4)
    b = qt.as_qtensor(_two_level_rows(20 + rank), qt.nvfp4, tensor_scale=8.0 * (1 + rank))
    return whole, own, x, b


def _values_and_scale(q):
    return _fmt(q), qt_plain(q), _scale_bits(q)


def _sc_c10d_two_level(rank, world, async_op):
    whole, own, x, b = _two_level_inputs(rank)
    n = whole.shape[0] // world

    def run(collective, *args, **kwargs):
        work = collective(*args, async_op=async_op, **kwargs)
        if async_op:
            work.wait()

    def zeros(*shape):
        return qt.as_qtensor(torch.zeros(*shape), qt.nvfp4)
    out = {}
    run(dist.broadcast, b, src=1)
    out["broadcast"] = _values_and_scale(b)
    ag = zeros(8, 32)
    run(dist.all_gather_into_tensor, ag, whole[rank * n:(rank + 1) * n])
    out["all_gather_into_tensor"] = _values_and_scale(ag)
    ag_own = zeros(8, 32)
    run(dist.all_gather_into_tensor, ag_own, own)
    out["all_gather_into_tensor_own"] = _values_and_scale(ag_own)
    lst = [zeros(4, 32) for _ in range(world)]
    run(dist.all_gather, lst, own)
    out["all_gather"] = [_values_and_scale(t) for t in lst]
    rs = zeros(4, 32)
    run(dist.reduce_scatter_tensor, rs, x)
    out["reduce_scatter_tensor"] = _values_and_scale(rs)
    ar = x.clone()
    run(dist.all_reduce, ar)
    out["all_reduce"] = _values_and_scale(ar)
    am = x.clone()
    run(dist.all_reduce, am, op=dist.ReduceOp.MAX)
    out["all_reduce_max"] = _values_and_scale(am)
    out["inputs"] = [_values_and_scale(t) for t in (whole, own, x)]  # read, never written
    return out


def _two_level_oracle():
    """What one process holding every rank's tensors gets for _sc_c10d_two_level's collectives."""
    ins = [_two_level_inputs(r) for r in range(WORLD)]
    whole = ins[0][0]
    owns = [i[1] for i in ins]
    xs = [i[2] for i in ins]
    total = qt.as_qtensor(_fp32_sum(qt_plain(x) for x in xs), qt.nvfp4)
    return {"whole": whole, "owns": owns, "own_cat": torch.cat(owns), "xs": xs, "total": total,
            "b": [i[3] for i in ins], "max": torch.maximum(xs[0], xs[1])}


def _assert_values_and_scale(got, want, what):
    fmts, values, scale = got
    assert fmts == _fmt(want), (what, fmts)
    _assert_bits_equal(values, want, what)
    assert scale == _scale_bits(want), (what, "tensor scale", scale, _scale_bits(want))


@pytest.mark.parametrize("async_op", [False, True])
def test_c10d_collectives_of_two_level_formats_follow_one_process(ranks, async_op):
    # c10d's collectives that write into QTensors, as one process holding every rank's tensors:
    # a broadcast brings the source's values and tensor scale; an all-gather of parts of one
    # scale keeps their bits and that scale, of parts of different scales is their cat (one
    # fresh scale); a list all-gather gives each output its rank's bits and scale; a
    # reduce-scatter rounds each part under the scale of the whole sum's amax; an all-reduce is
    # rounded under the scale of its result's amax; the inputs are not touched
    res = ranks.run("_sc_c10d_two_level", async_op)
    o = _two_level_oracle()
    n = o["whole"].shape[0] // WORLD
    for rank, out in enumerate(res):
        who = f"rank {rank}"
        _assert_values_and_scale(out["broadcast"], o["b"][1], f"{who} broadcast")
        _assert_values_and_scale(out["all_gather_into_tensor"], o["whole"],
                                 f"{who} all_gather_into_tensor")
        _assert_values_and_scale(out["all_gather_into_tensor_own"], o["own_cat"],
                                 f"{who} all_gather_into_tensor, own scales")
        for i, got in enumerate(out["all_gather"]):
            _assert_values_and_scale(got, o["owns"][i], f"{who} all_gather output {i}")
        rs = out["reduce_scatter_tensor"]
        _assert_bits_equal(rs[1], o["total"][rank * n:(rank + 1) * n], f"{who} reduce_scatter")
        assert rs[2] == _scale_bits(o["total"]), (who, "reduce_scatter tensor scale")
        _assert_values_and_scale(out["all_reduce"], o["total"], f"{who} all_reduce")
        _assert_values_and_scale(out["all_reduce_max"], o["max"], f"{who} all_reduce max")
        for got, want in zip(out["inputs"], (o["whole"], o["owns"][rank], o["xs"][rank])):
            _assert_values_and_scale(got, want, f"{who} input")


def _sc_functional_coalesced(rank, world):
    import torch.distributed._functional_collectives as funcol
    g = dist.group.WORLD
    whole, own, x, _b = _two_level_inputs(rank)
    n = whole.shape[0] // world
    bf = qt.as_qtensor(torch.tensor([1.0, 3.0, 2.0 ** -10, 0.5]) * (1 + rank), qt.bf16)
    out = {}
    ag = funcol.all_gather_into_tensor_coalesced([whole[rank * n:(rank + 1) * n], own, bf], g)
    out["all_gather"] = [_values_and_scale(t) for t in ag[:2]] + [(_fmt(ag[2]), qt_plain(ag[2]))]
    rs = funcol.reduce_scatter_tensor_coalesced([x, own], "sum", [0, 0], g)
    out["reduce_scatter"] = [_values_and_scale(t) for t in rs]
    ar = funcol.all_reduce_coalesced([x, bf], "sum", g)
    out["all_reduce"] = [_values_and_scale(ar[0]), (_fmt(ar[1]), qt_plain(ar[1]))]
    return out


def test_coalesced_functional_collectives_follow_their_single_forms(ranks):
    # each tensor of a coalesced collective as its single-tensor form has it (one process's
    # bits and tensor scale), each output in the formats of its own input
    res = ranks.run("_sc_functional_coalesced")
    o = _two_level_oracle()
    bfs = [qt.as_qtensor(torch.tensor([1.0, 3.0, 2.0 ** -10, 0.5]) * (1 + r), qt.bf16)
           for r in range(WORLD)]
    own_total = qt.as_qtensor(_fp32_sum(qt_plain(t) for t in o["owns"]), qt.nvfp4)
    for rank, out in enumerate(res):
        who = f"rank {rank}"
        _assert_values_and_scale(out["all_gather"][0], o["whole"], f"{who} all_gather 0")
        _assert_values_and_scale(out["all_gather"][1], o["own_cat"], f"{who} all_gather 1")
        assert out["all_gather"][2][0] == ("bf16", None), (who, out["all_gather"][2][0])
        _assert_bits_equal(out["all_gather"][2][1], torch.cat(bfs), f"{who} all_gather 2")
        for i, total in enumerate((o["total"], own_total)):
            got = out["reduce_scatter"][i]
            m = total.shape[0] // WORLD
            _assert_bits_equal(got[1], total[rank * m:(rank + 1) * m], f"{who} reduce_scatter {i}")
            assert got[2] == _scale_bits(total), (who, "reduce_scatter tensor scale", i)
        _assert_values_and_scale(out["all_reduce"][0], o["total"], f"{who} all_reduce 0")
        assert out["all_reduce"][1][0] == ("bf16", None), (who, out["all_reduce"][1][0])
        _assert_bits_equal(out["all_reduce"][1][1], qt.quantize(_fp32_sum(
            qt_plain(t) for t in bfs), qt.bf16), f"{who} all_reduce 1")


def _sc_functional_in_place(rank, world):
    c10d = torch.ops._c10d_functional
    name = dist.group.WORLD.group_name
    whole, own, x, b = _two_level_inputs(rank)
    n = whole.shape[0] // world
    out = {}
    t = b.clone()
    c10d.wait_tensor(c10d.broadcast_(t, 1, name))
    out["broadcast_"] = _values_and_scale(t)
    ts = [x.clone(), b.clone()]
    c10d.all_reduce_coalesced_(ts, "sum", name)
    out["all_reduce_coalesced_"] = [_values_and_scale(q) for q in ts]
    ag = qt.as_qtensor(torch.zeros(8, 32), qt.nvfp4)
    c10d.wait_tensor(c10d.all_gather_into_tensor_out(whole[rank * n:(rank + 1) * n], world,
                                                     name, out=ag))
    out["all_gather_into_tensor_out"] = _values_and_scale(ag)
    ag = qt.as_qtensor(torch.zeros(8, 32), qt.nvfp4)
    c10d.wait_tensor(c10d.all_gather_into_tensor_out(own, world, name, out=ag))
    out["all_gather_into_tensor_out_own"] = _values_and_scale(ag)
    import torch.distributed._functional_collectives as funcol
    for key, t in (("all_to_all_single", whole), ("all_to_all_single_own", b)):
        out[key] = _values_and_scale(funcol.all_to_all_single(t, None, None, dist.group.WORLD))
    return out


def test_functional_in_place_out_and_all_to_all_collectives_follow_one_process(ranks):
    # the in-place and out= functional forms (torch.ops._c10d_functional) as the single ones:
    # a broadcast_ brings the source's values and scale, all_reduce_coalesced_ rounds each sum
    # under the scale of its amax, all_gather_into_tensor_out keeps a shared scale (a cat's
    # fresh one for parts of their own scales); all_to_all_single (DTensor's Shard(i) to
    # Shard(j)) is the cat of the chunks it receives
    res = ranks.run("_sc_functional_in_place")
    o = _two_level_oracle()
    b_total = qt.as_qtensor(_fp32_sum(qt_plain(t) for t in o["b"]), qt.nvfp4)
    n = o["whole"].shape[0] // WORLD
    for rank, out in enumerate(res):
        who = f"rank {rank}"
        _assert_values_and_scale(out["broadcast_"], o["b"][1], f"{who} broadcast_")
        for got, want, i in zip(out["all_reduce_coalesced_"], (o["total"], b_total), (0, 1)):
            _assert_values_and_scale(got, want, f"{who} all_reduce_coalesced_ {i}")
        _assert_values_and_scale(out["all_gather_into_tensor_out"], o["whole"],
                                 f"{who} all_gather_into_tensor_out")
        _assert_values_and_scale(out["all_gather_into_tensor_out_own"], o["own_cat"],
                                 f"{who} all_gather_into_tensor_out, own scales")
        for key, ts in (("all_to_all_single", [o["whole"]] * WORLD),
                        ("all_to_all_single_own", o["b"])):
            want = torch.cat([t[rank * n:(rank + 1) * n] for t in ts])
            _assert_values_and_scale(out[key], want, f"{who} {key}")


def _rest_inputs(rank):
    """The tensors _sc_c10d_two_level_rest sends from ``rank``: (b, a list of one tensor per
    destination rank under scales given per (rank, destination), a tensor every rank rounds
    whole under a given scale, one whose blocks a chunk along its columns cuts)."""
    _whole, own, x, b = _two_level_inputs(rank)
    per_dst = [qt.as_qtensor(_two_level_rows(40 + 10 * rank + j, rows=4), qt.nvfp4,
                             tensor_scale=4.0 * (1 + rank + 2 * j)) for j in range(WORLD)]
    whole = qt.as_qtensor(_two_level_rows(30), qt.nvfp4, tensor_scale=32.0)
    cut = qt.as_qtensor(_two_level_rows(31, rows=4, cols=48), qt.nvfp4, tensor_scale=64.0)
    return own, x, b, per_dst, whole, cut


def _sc_c10d_two_level_rest(rank, world):
    own, x, b, per_dst, whole, cut = _rest_inputs(rank)
    n = whole.shape[0] // world

    def zeros(*shape):
        return qt.as_qtensor(torch.zeros(*shape), qt.nvfp4)
    out = {}
    t = b.clone()  # the root gets the sum; the others' tensors are only read
    dist.reduce(t, dst=0)
    out["reduce"] = _values_and_scale(t)
    lst = [zeros(8, 32) for _ in range(world)] if rank == 0 else None
    dist.gather(b, lst, dst=0)
    out["gather"] = None if lst is None else [_values_and_scale(q) for q in lst]
    s = zeros(4, 32)
    dist.scatter(s, list(whole.chunk(world)) if rank == 1 else None, src=1)
    out["scatter"] = _values_and_scale(s)
    s = zeros(4, 24)  # chunks along the block axis: 24 columns cut the second block of 16
    dist.scatter(s, [c.contiguous() for c in cut.chunk(world, dim=1)] if rank == 1 else None,
                 src=1)
    out["scatter_cut"] = _values_and_scale(s)
    lst = [zeros(4, 32) for _ in range(world)]
    dist.all_to_all(lst, per_dst)
    out["all_to_all"] = [_values_and_scale(q) for q in lst]
    a = zeros(8, 32)
    dist.all_to_all_single(a, whole)
    out["all_to_all_single"] = _values_and_scale(a)
    a = zeros(8, 32)
    dist.all_to_all_single(a, b)
    out["all_to_all_single_own"] = _values_and_scale(a)
    rs = zeros(4, 32)
    dist.reduce_scatter(rs, list(x.chunk(world)))
    out["reduce_scatter"] = _values_and_scale(rs)
    lists = [[zeros(8, 32), zeros(4, 32)] for _ in range(world)]
    dist.all_gather_coalesced(lists, [b, own])
    out["all_gather_coalesced"] = [[_values_and_scale(q) for q in row] for row in lists]
    r = zeros(8, 32)
    if rank == 0:
        dist.send(b, dst=1)
        dist.recv(r)  # from any source
    else:
        dist.recv(r, src=0)
        dist.send(b, dst=0)
    out["recv"] = _values_and_scale(r)
    r = zeros(8, 32)  # every rank sends first
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, b, 1 - rank),
                                        dist.P2POp(dist.irecv, r, 1 - rank)]):
        work.wait()
    out["batch_isend_irecv"] = _values_and_scale(r)
    out["inputs"] = [_values_and_scale(q) for q in (own, x, b, *per_dst, whole)]
    return out


def test_c10d_other_collectives_of_two_level_formats_follow_one_process(ranks):
    # what a rank receives that is a whole tensor another rank holds (gather's parts, scatter's
    # part, all_to_all's tensors, all_gather_coalesced's, recv's, also in a batch of isend and
    # irecv where every rank sends first) keeps its values and tensor scale, as a copy_ of it
    # in one process (a part that cuts blocks too); a reduction is rounded under the scale of
    # its result's amax (reduce_scatter: the whole sum's); an all_to_all_single is the cat of
    # the chunks it receives; reduce leaves the other ranks' tensors as they were
    res = ranks.run("_sc_c10d_two_level_rest")
    ins = [_rest_inputs(r) for r in range(WORLD)]
    own, x, b, per_dst, whole, cut = (list(z) for z in zip(*ins))
    n = whole[0].shape[0] // WORLD
    want = [{} for _ in range(WORLD)]
    want[0]["reduce"] = qt.as_qtensor(_fp32_sum(qt_plain(t) for t in b), qt.nvfp4)
    want[1]["reduce"] = b[1]
    total = qt.as_qtensor(_fp32_sum(qt_plain(t) for t in x), qt.nvfp4)
    for r in range(WORLD):
        w = want[r]
        w["gather"] = b if r == 0 else None
        w["scatter"] = whole[1].chunk(WORLD)[r]
        w["scatter_cut"] = qt.as_qtensor(torch.zeros(4, 24), qt.nvfp4).copy_(
            cut[1].chunk(WORLD, dim=1)[r])
        w["all_to_all"] = [per_dst[j][r] for j in range(WORLD)]
        w["all_to_all_single"] = torch.cat([whole[j][r * n:(r + 1) * n] for j in range(WORLD)])
        w["all_to_all_single_own"] = torch.cat([b[j][r * n:(r + 1) * n] for j in range(WORLD)])
        w["reduce_scatter"] = total[r * n:(r + 1) * n]
        w["all_gather_coalesced"] = [[b[j], own[j]] for j in range(WORLD)]
        w["recv"] = w["batch_isend_irecv"] = b[1 - r]
        w["inputs"] = [own[r], x[r], b[r], *per_dst[r], whole[r]]
    wrong = []

    def check(got, want, what):
        if isinstance(want, list) or want is None:
            if want is None or got is None:
                if got is not want:
                    wrong.append(f"{what}: {got!r} for {want!r}")
                return
            for i, (g, w) in enumerate(zip(got, want)):
                check(g, w, f"{what}[{i}]")
            return
        try:
            _assert_values_and_scale(got, want, what)
        except AssertionError as e:
            wrong.append(str(e).splitlines()[0])
    for rank, out in enumerate(res):
        for key, w in want[rank].items():
            check(out[key], w, f"rank {rank} {key}")
    assert not wrong, "\n".join(wrong)


def _p2p_inputs():
    return {"nvfp4": qt.as_qtensor(_two_level_rows(50), qt.nvfp4, tensor_scale=8.0),
            "plain": _two_level_rows(51), "bf16": qt.as_qtensor(_two_level_rows(52), qt.bf16)}


def _p2p_empty(kind):
    z = torch.zeros(8, 32)
    return z if kind == "plain" else qt.as_qtensor(z, getattr(qt, kind))


def _p2p_got(t):
    return _fmt(t), qt_plain(t), _scale(t)


# (what rank 0 sends, what rank 1 receives it into): every pairing of a two-level QTensor, a
# QTensor of another format and a plain tensor, but a two-level QTensor into a plain tensor
# (docs/distributed.md: a message longer than the plain rank's buffer)
_P2P_PAIRS = [("nvfp4", "nvfp4"), ("nvfp4", "bf16"), ("plain", "nvfp4"), ("bf16", "nvfp4"),
              ("plain", "bf16"), ("bf16", "plain"), ("nvfp4", "nvfp4")]


def _sc_p2p_mixed(rank, world):
    ins, out = _p2p_inputs(), []
    for sent, into in _P2P_PAIRS + [("plain", "nvfp4 from any source")]:
        if rank == 0:
            dist.send(ins[sent], dst=1)
            continue
        r = _p2p_empty(into.split()[0])
        dist.recv(r, src=None if "any" in into else 0)
        out.append(_p2p_got(r))
    error = None
    if rank == 0:  # 4 values more than the receiver holds
        dist.send(torch.ones(8 * 32 + 4), dst=1)
    else:
        try:
            dist.recv(_p2p_empty("nvfp4"), src=0)
        except ValueError as e:
            error = str(e)
    r = _p2p_empty("nvfp4")  # and the next message is whole
    dist.recv(r, src=1 - rank) if rank == 1 else dist.send(ins["nvfp4"], dst=1)
    return out, error, _p2p_got(r)


def test_send_recv_between_two_level_qtensors_and_other_tensors(ranks):
    # a two-level QTensor is sent as one message (its payload, then its scale): a QTensor of
    # any format receives it as a copy_ of the tensor sent in one process, and a two-level
    # QTensor receives a plain tensor or a QTensor of another format so too (under a fresh
    # scale); no pairing waits for a message that never comes (the timeout fails instead)
    res = ranks.run("_sc_p2p_mixed", timeout=60)
    ins = _p2p_inputs()
    got, error, last = res[1]
    for (sent, into), g in zip(_P2P_PAIRS + [("plain", "nvfp4")], got):
        want = _p2p_empty(into).copy_(ins[sent]) if into != "plain" else qt_plain(ins[sent])
        what = f"{sent} received into {into}"
        assert g[0] == _fmt(want), (what, g[0])
        _assert_bits_equal(g[1], want, what)
        assert g[2] == _scale(want), (what, "tensor scale", g[2], _scale(want))
    assert error is not None and "longer than the tensor" in error, error
    assert last[2] == _scale(ins["nvfp4"])
    _assert_bits_equal(last[1], ins["nvfp4"], "the message after the refused one")


def _sc_convert_wrapped(rank, world):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    out = {}
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    ddp = DDP(model)
    try:
        qt.convert(ddp, qt.bf16)
        out["ddp"] = None
    except TypeError as e:
        out["ddp"] = str(e)
    out["ddp_untouched"] = (all(not isinstance(p, qt.QTensor) for p in model.parameters())
                            and all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
    converted = DDP(qt.convert(_mlp(), qt.bf16))
    try:
        qt.convert(converted, qt.bf16)
        out["ddp_of_converted"] = None
    except TypeError as e:
        out["ddp_of_converted"] = str(e)
    sharded = _mlp()
    fully_shard(sharded)
    try:
        qt.convert(sharded, qt.bf16)
        out["fsdp"] = None
    except TypeError as e:
        out["fsdp"] = str(e)
    # what FSDP2 cannot do with a converted model is refused at the first all-gather
    from torch.distributed.fsdp import MixedPrecisionPolicy
    for key, spec, policy in (
            ("fsdp_param_dtype", qt.recipes.mxfp6, MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
            ("fsdp_reduce_dtype", qt.recipes.mxfp6,
             MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))):
        model = qt.convert(_mlp(), spec)
        fully_shard(model, mp_policy=policy)
        try:
            model(torch.ones(2, 8))
            out[key] = None
        except TypeError as e:
            out[key] = f"{type(e).__name__}: {e}"
    return out


def test_convert_of_a_wrapped_model_is_refused(ranks):
    for out in ranks.run("_sc_convert_wrapped"):
        assert out["ddp"] is not None and "convert, then wrap" in out["ddp"]
        assert "DistributedDataParallel" in out["ddp"]
        assert out["ddp_untouched"]
        assert "converted already" in out["ddp_of_converted"]
        assert out["fsdp"] is not None and "convert, then wrap" in out["fsdp"]
        assert "fully_shard" in out["fsdp"]
        assert out["fsdp_param_dtype"].startswith("TypeError") and "param_dtype" in \
            out["fsdp_param_dtype"]
        assert out["fsdp_reduce_dtype"].startswith("TypeError") and "reduce_dtype" in \
            out["fsdp_reduce_dtype"]


# ---------------------------------------------------------------------------------------------
# 3. FSDP2

def _full_state(model):
    """name -> (formats of the local value and gradient shards, full value, full gradient)."""
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[n] = (_fmt(p), _fmt(g), qt_plain(p.full_tensor()),
                  None if g is None else qt_plain(g.full_tensor()))
    return out


def _scale(t):
    """A two-level QTensor's tensor scale (a DTensor's local tensor's) as float32 bits, or None."""
    t = getattr(t, "_local_tensor", t)
    ts = t.tensor_scale if isinstance(t, qt.QTensor) else None
    return None if ts is None else int(ts.view(torch.int32))


def _sc_fsdp(rank, world, spec, steps, hidden=16, optim="adam", scales=False):
    from torch.distributed.fsdp import fully_shard
    model = qt.convert(_mlp(hidden), _spec(spec))
    seen, seen_scales = {}, {}

    def record(mod, args):  # what forward sees: the unsharded parameters
        for n, p in mod.named_parameters(recurse=False):
            seen[f"{mod._name}.{n}"] = (type(p).__name__, _fmt(p))
            seen_scales.setdefault(f"{mod._name}.{n}", []).append(_scale(p))
    for name in ("0", "2"):
        model[int(name)]._name = name
        model[int(name)].register_forward_pre_hook(record)
        fully_shard(model[int(name)])
    fully_shard(model)
    opt = _optimizer(optim, model)  # after fully_shard: on the sharded parameters
    _train_shard(model, opt, rank, world, _data(steps))
    if scales:  # the local shards' tensor scales, and those forward saw at each step
        local = {n: (_scale(p), _scale(p.grad)) for n, p in model.named_parameters()}
        return _full_state(model), seen, _opt_state(opt), local, seen_scales
    return _full_state(model), seen, _opt_state(opt)


def _opt_state(opt):
    """Every non-scalar optimizer state tensor: (parameter index, key) -> (format, full value)."""
    out = {}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                full = v.full_tensor() if hasattr(v, "full_tensor") else v
                out[i, k] = (_fmt(v), qt_plain(full))
    return out


@pytest.mark.parametrize("spec,hidden", [("mxfp6", 16), ("bf16", 16), ("fp8", 16), ("mxfp6", 15)])
def test_fsdp2_keeps_formats_and_follows_the_reduction_rule(ranks, spec, hidden):
    # hidden=15: uneven shards (8 and 7 rows), which FSDP2 pads
    res = ranks.run("_sc_fsdp", spec, 3, hidden)
    ref = _reduced_reference(spec, 3, optim="adam", hidden=hidden)
    assert ("qt_master" in str(_REF_OPT_STATE[spec, hidden].keys())) == (spec != "bf16")
    for rank, (state, seen, opt_state) in enumerate(res):
        assert state.keys() == ref.keys()
        for n, (fmts, gfmts, value, grad) in state.items():
            rf, rg, rv, rgrad = ref[n]
            assert seen[n] == ("QTensor", rf), (rank, n, seen[n])  # forward's weights
            _assert_bits_equal(value, rv, f"rank {rank} {n}")
            _assert_bits_equal(grad, rgrad, f"rank {rank} {n}.grad")
            assert fmts == rf and gfmts == rg, (rank, n, fmts, gfmts, rf, rg)
        # Adam's state (and the FP32 masters of master_weights recipes): formats and values
        ref_state = _REF_OPT_STATE[spec, hidden]
        assert opt_state.keys() == ref_state.keys(), (opt_state.keys(), ref_state.keys())
        for key, (fmt, value) in opt_state.items():
            assert fmt == ref_state[key][0], (rank, key, fmt, ref_state[key][0])
            _assert_bits_equal(value, ref_state[key][1], f"rank {rank} optimizer state {key}")


@pytest.mark.parametrize("spec,optim", [("mx_all_mxfp8", "sgd"), ("mx_all_mxfp8", "adamw"),
                                        ("mx_cut", "adamw")])
def test_fsdp2_block_value_formats_follow_the_reduction_rule(ranks, spec, optim):
    # Block value formats. mx_all_mxfp8: a contraction blocks the weight gradient along
    # out_features, the gradient role along in_features: each rank's gradient must be in its role
    # before the reduction. FSDP2 shards dim 0 in halves of 40 rows (hidden=80): a bias (MXFP8
    # blocks of 32 along its only dim) has a block cut by the shard boundary, and 2.bias (4
    # values, one block) is cut in two; mx_cut cuts the weights' value blocks (16 along dim 0)
    # and each bias's and each gradient's one whole-tensor block, with FP32 masters. A cut block is rounded as a
    # block of the whole tensor (the reduced gradient, every op of the update), so several steps
    # of SGD with momentum and AdamW with weight decay (optimizer state in MXFP8 blocks of 32)
    # stay bit-identical to one process.
    res = ranks.run("_sc_fsdp", spec, 3, 80, optim)
    ref = _reduced_reference(spec, 3, optim=optim, hidden=80)
    ref_state = _REF_OPT_STATE[spec, 80]
    assert ("qt_master" in str(ref_state.keys())) == (spec == "mx_cut")
    for rank, (state, seen, opt_state) in enumerate(res):
        assert state.keys() == ref.keys()
        for n, (fmts, gfmts, value, grad) in state.items():
            rf, rg, rv, rgrad = ref[n]
            assert seen[n] == ("QTensor", rf), (rank, n, seen[n])
            assert fmts == rf and gfmts == rg, (rank, n, fmts, gfmts, rf, rg)
            assert not value.isnan().any() and not grad.isnan().any(), (rank, n)
            _assert_bits_equal(grad, rgrad, f"rank {rank} {n}.grad")
            _assert_bits_equal(value, rv, f"rank {rank} {n}")
        assert opt_state.keys() == ref_state.keys(), (opt_state.keys(), ref_state.keys())
        for key, (fmt, value) in opt_state.items():
            assert fmt == ref_state[key][0], (rank, key, fmt, ref_state[key][0])
            _assert_bits_equal(value, ref_state[key][1], f"rank {rank} optimizer state {key}")


@pytest.mark.parametrize("spec,hidden", [("nvfp4", 32), ("nvfp4_grad", 32), ("nvfp4", 15)])
def test_fsdp2_two_level_formats_use_the_whole_tensors_scale(ranks, spec, hidden):
    # NVFP4's FP32 tensor scale comes from the amax of the whole tensor (Transformer Engine,
    # one process). Under FSDP2 each rank holds a shard: the reduced gradient shard must be
    # rounded under the scale of the whole reduced gradient, and the parameter (rounded whole
    # before sharding, stepped whole) must keep the whole tensor's scale on every shard and in
    # what forward sees after the all-gather, so that values and scales stay bit-identical to
    # one process. hidden=15: uneven shards (8 and 7 rows), which FSDP2 pads.
    res = ranks.run("_sc_fsdp", spec, 3, hidden, "adam", True)
    ref = _reduced_reference(spec, 3, optim="adam", hidden=hidden)
    ref_local, ref_seen = _REF_SCALES[spec, hidden]
    assert any(g is not None for _v, g in ref_local.values())  # two-level gradients
    for rank, (state, seen, opt_state, local, seen_scales) in enumerate(res):
        for n, (fmts, gfmts, value, grad) in state.items():
            rf, rg, rv, rgrad = ref[n]
            assert fmts == rf and gfmts == rg, (rank, n, fmts, gfmts, rf, rg)
            _assert_bits_equal(grad, rgrad, f"rank {rank} {n}.grad")
            _assert_bits_equal(value, rv, f"rank {rank} {n}")
            assert local[n] == ref_local[n], (rank, n, "local scales", local[n], ref_local[n])
            assert seen_scales[n] == ref_seen[n], (rank, n, "forward's", seen_scales[n],
                                                   ref_seen[n])
        ref_state = _REF_OPT_STATE[spec, hidden]
        assert opt_state.keys() == ref_state.keys(), (opt_state.keys(), ref_state.keys())
        for key, (fmt, value) in opt_state.items():
            assert fmt == ref_state[key][0], (rank, key, fmt, ref_state[key][0])
            _assert_bits_equal(value, ref_state[key][1], f"rank {rank} optimizer state {key}")


def _sc_fsdp_sharded_steps(rank, world, runs):
    """_sc_fsdp's runs (spec, optim), with the shapes of what DTensor all-gathers in training
    (FSDP2's own all-gathers of the parameters for forward are c10d's, not counted)."""
    import sys
    import torch.distributed._functional_collectives as funcol
    out = []
    for spec, optim in runs:
        gathered = []
        gather = funcol.all_gather_single

        def counting(*args, **kwargs):
            gathered.append(tuple(args[0].shape))
            return gather(*args, **kwargs)

        def train(*args, _train=_train_shard):
            with _patched(funcol, "all_gather_single", counting):
                return _train(*args)
        with _patched(sys.modules[__name__], "_train_shard", train):
            res = _sc_fsdp(rank, world, spec, 3, 32, optim, True)
        out.append((res, gathered))
    return out


@contextlib.contextmanager
def _patched(obj, name, value):
    before = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, before)


def test_fsdp2_two_level_weights_step_on_their_shards(ranks):
    # A two-level weight blocked along dim 1 and sharded along dim 0: its shards cut no block,
    # only the tensor scale, so the optimizer step runs on the shards (every op of the update
    # rounds under the whole tensor's scale), gathering neither the weight nor its gradient or
    # state; still bit-identical to one process with FP32 masters (Adam) and with NVFP4
    # optimizer state (AdamW, eps=1). The biases: 0.bias (32, blocks of 16 in whole halves) steps on
    # its shards too; 2.bias (4 values, one block cut in two) is stepped whole.
    runs = [("nvfp4", "adam"), ("nvfp4_state", "adamw_eps1")]
    res = ranks.run("_sc_fsdp_sharded_steps", runs)
    for (spec, optim), per_rank in zip(runs, zip(*res)):
        ref = _reduced_reference(spec, 3, optim=optim, hidden=32)
        ref_local, ref_seen = _REF_SCALES[spec, 32]
        ref_state = _REF_OPT_STATE[spec, 32]
        assert ("qt_master" in str(ref_state.keys())) == (spec == "nvfp4")
        for rank, ((state, _seen, opt_state, local, seen_scales), gathered) in enumerate(
                per_rank):
            who = f"{spec} {optim} rank {rank}"
            for n, (fmts, gfmts, value, grad) in state.items():
                rf, rg, rv, rgrad = ref[n]
                assert fmts == rf and gfmts == rg, (who, n, fmts, gfmts, rf, rg)
                assert value.isfinite().all() and grad.isfinite().all(), (who, n)
                _assert_bits_equal(grad, rgrad, f"{who} {n}.grad")
                _assert_bits_equal(value, rv, f"{who} {n}")
                assert local[n] == ref_local[n], (who, n, "local scales", local[n], ref_local[n])
                assert seen_scales[n] == ref_seen[n], (who, n, "forward's scales")
            assert opt_state.keys() == ref_state.keys(), (opt_state.keys(), ref_state.keys())
            for key, (fmt, value) in opt_state.items():
                assert fmt == ref_state[key][0], (who, key, fmt, ref_state[key][0])
                _assert_bits_equal(value, ref_state[key][1], f"{who} optimizer state {key}")
            # in training, only 2.bias's gradient, parameter and state (shards of 2 values) are
            # gathered, and tensor scales (one value per rank)
            assert set(gathered) <= {(2,), (1,)}, (who, sorted(set(gathered)))
            assert ((2,) in gathered) == (spec == "nvfp4"), who  # (nvfp4_state: plain biases)


def _sc_fsdp_accumulate(rank, world, spec):
    """Two backwards (two global batches) into the same sharded gradients, no step."""
    from torch.distributed.fsdp import fully_shard
    model = qt.convert(_mlp(80), _spec(spec))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    for x, y in _data(2):
        n = len(x) // world
        F.mse_loss(qt_plain_grad(model(x[rank * n:(rank + 1) * n])),
                   y[rank * n:(rank + 1) * n]).backward()
    return _full_state(model), {n: _scale(p.grad) for n, p in model.named_parameters()}


@pytest.mark.parametrize("spec", ["mx_cut", "nvfp4"])
def test_fsdp2_gradient_accumulation_rounds_cut_blocks_whole(ranks, spec):
    # FSDP2 adds each backward's reduced mean into the sharded gradient: as one process adds it
    # into the gradient (rounding the sum once), the blocks that the shards cut (the biases')
    # included; nvfp4: the sum under one tensor scale of the whole sum's amax
    res = ranks.run("_sc_fsdp_accumulate", spec)
    model = qt.convert(_mlp(80), _spec(spec))
    params = list(model.parameters())
    acc = None
    for x, y in _data(2):
        n = len(x) // WORLD
        grads = []
        for r in range(WORLD):
            model.zero_grad()
            F.mse_loss(qt_plain_grad(model(x[r * n:(r + 1) * n])), y[r * n:(r + 1) * n]).backward()
            grads.append([qt_plain(p.grad) for p in params])
        with torch.no_grad():
            for i, p in enumerate(params):
                mean = _fp32_sum(g[i] for g in grads) / WORLD
                if acc is None:
                    p.grad.copy_(mean)  # rounded once
                else:
                    p.grad = acc[i]
                    p.grad.add_(mean)  # the sum rounded once
        acc = [p.grad for p in params]
    ref = _state(model)
    ref_scales = {n: _scale(p.grad) for n, p in model.named_parameters()}
    for rank, (state, scales) in enumerate(res):
        for n, (_fmts, gfmts, _value, grad) in state.items():
            assert gfmts == ref[n][1], (rank, n, gfmts, ref[n][1])
            _assert_bits_equal(grad, ref[n][3], f"rank {rank} {n}.grad")
            assert scales[n] == ref_scales[n], (rank, n, "tensor scale", scales[n])


def _reduced_grads(model, world=WORLD):
    """One process: each parameter's gradient by the reduction rule for _data(1)'s batch."""
    params = dict(model.named_parameters())
    x, y = _data(1)[0]
    n = len(x) // world
    grads = []
    for r in range(world):
        model.zero_grad()
        F.mse_loss(qt_plain_grad(model(x[r * n:(r + 1) * n])), y[r * n:(r + 1) * n]).backward()
        grads.append({k: qt_plain(p.grad) for k, p in params.items()})
    with torch.no_grad():
        for k, p in params.items():
            p.grad.copy_(_fp32_sum(g[k] for g in grads) / world)  # the rule
    return params


def _sc_fsdp_shard_ops(rank, world):
    """Ops on two-level shards outside the optimizer step: an in-place init after fully_shard,
    then clip_grad_norm_ of the reduced gradients."""
    from torch.distributed.fsdp import fully_shard
    model = qt.convert(_mlp(32), qt.nvfp4)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    init = {n: (_scale(p), qt_plain(p.full_tensor())) for n, p in model.named_parameters()}
    x, y = _data(1)[0]
    n = len(x) // world
    F.mse_loss(qt_plain_grad(model(x[rank * n:(rank + 1) * n])),
               y[rank * n:(rank + 1) * n]).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
    total = getattr(total, "_local_tensor", total)
    clipped = {n: (_scale(p.grad), qt_plain(p.grad.full_tensor()))
               for n, p in model.named_parameters()}
    alone = None
    if rank == 0:  # an op of one rank alone outside a step: no collective, which would hang
        with torch.no_grad():
            local = model[0].weight.to_local()
            tripled = local * 3
        alone = (local._shard is not None, tripled._shard is None, qt_plain(local).clone(),
                 qt_plain(tripled), _scale(tripled))
    return init, (total._data.clone(), total.tensor_scale), clipped, alone


def test_fsdp2_ops_on_two_level_shards_use_the_whole_tensors_scale(ranks):
    # An op on a shard of a two-level tensor (nvfp4) rounds under the scale of the whole
    # tensor's amax, as one process rounds the whole tensor: an in-place init of the sharded
    # parameters after fully_shard, and clip_grad_norm_'s p.grad.mul_(clip_coef) on the reduced
    # gradient shards. 2.bias (4 values, one block of 16) is cut by the shards: not checked
    # (such tensors are rounded whole only in the reduced gradient and the optimizer step).
    res = ranks.run("_sc_fsdp_shard_ops")
    model = qt.convert(_mlp(32), qt.nvfp4)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    params = _reduced_grads(model)
    checked = [k for k in params if k != "2.bias"]
    reduced = {k: p.grad for k, p in params.items()}
    for rank, (init, _total, _clipped, _alone) in enumerate(res):
        for k in checked:
            assert init[k][0] == _scale(params[k]), (rank, k, "init's scale")
            _assert_bits_equal(init[k][1], qt_plain(params[k]), f"rank {rank} {k} init")
    for rank, (_init, (total_values, total_scale), clipped, _alone) in enumerate(res):
        # the sharded run's total norm (one process's: the test of clip_grad_norm_ below), so
        # the same clip coefficient: then every clipped shard must be one process's clipped
        # gradient, sliced
        total = qt.QTensor(total_values, qt.nvfp4, tensor_scale=total_scale)
        for k, p in params.items():
            p.grad = reduced[k].clone()
        torch.nn.utils.clip_grads_with_norm_(params.values(), 0.1, total)
        ref = {k: p.grad for k, p in params.items()}
        for k in checked:
            assert clipped[k][0] == _scale(ref[k]), (rank, k, "clipped gradient's scale")
            _assert_bits_equal(clipped[k][1], qt_plain(ref[k]), f"rank {rank} {k}.grad clipped")
    # outside an optimizer step, an out-of-place op on a shard rounds under its own fresh scale
    # (one rank ran it alone and returned) and its result is no shard
    was_marked, unmarked, local, tripled, scale = res[0][3]
    assert was_marked and unmarked
    want = qt.as_qtensor(local * 3, qt.nvfp4)
    assert scale == _scale(want)
    _assert_bits_equal(tripled, qt_plain(want), "rank 0's local weight * 3")


def _sc_fsdp_clip(rank, world, spec, hidden, norm_type, foreach):
    """clip_grad_norm_ of the reduced gradients of a sharded model: its total norm (values and
    tensor scale, as every rank holds it) and the clipped gradients."""
    from torch.distributed.fsdp import fully_shard
    model = qt.convert(_mlp(hidden), _spec(spec))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    x, y = _data(1)[0]
    n = len(x) // world
    F.mse_loss(qt_plain_grad(model(x[rank * n:(rank + 1) * n])),
               y[rank * n:(rank + 1) * n]).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1, norm_type=norm_type,
                                           foreach=foreach)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    clipped = {k: (_scale(p.grad), qt_plain(p.grad.full_tensor()))
               for k, p in model.named_parameters()}
    return (_fmt(total), qt_plain(total), _scale(total)), clipped


@pytest.mark.parametrize("spec,hidden,norm_type,foreach,cut", [
    ("nvfp4", 32, 2.0, None, {"2.bias"}), ("nvfp4", 15, 2.0, None, {"0.bias", "2.bias"}),
    ("nvfp4", 32, 2.0, True, {"2.bias"}), ("nvfp4", 32, 1.0, None, {"2.bias"}),
    ("nvfp4_grad", 32, 2.0, None, set()), ("nvfp4", 32, float("inf"), None, {"2.bias"})])
def test_fsdp2_clip_grad_norm_of_two_level_gradients_is_one_process_norm(
        ranks, spec, hidden, norm_type, foreach, cut):
    # clip_grad_norm_ on the sharded model: the total norm (bits, format, tensor scale) is the
    # one one process computes from the whole gradients (each gradient's norm, rounded to its
    # format; their stack and its norm), on every rank; the gradients are then clipped by it to
    # one process's bits. hidden=15: uneven shards, which FSDP2 pads (the padding must not
    # count). nvfp4_grad: plain biases beside two-level weight gradients, whose norms are
    # stacked in NVFP4. The gradients whose shards cut a block (``cut``: 2.bias, 4 values in
    # one block of 16; with hidden=15, 0.bias too) count in the norm; their clipped values are
    # not checked (a computing op on a shard that cuts blocks: docs/distributed.md).
    res = ranks.run("_sc_fsdp_clip", spec, hidden, norm_type, foreach, timeout=120)
    model = qt.convert(_mlp(hidden), _spec(spec))
    params = _reduced_grads(model)
    want = torch.nn.utils.clip_grad_norm_(params.values(), max_norm=0.1, norm_type=norm_type,
                                          foreach=foreach)
    assert isinstance(want, qt.QTensor) and want.fmt.is_two_level  # a two-level norm
    assert float(qt_plain(want)) > 0.1  # (so the gradients are clipped)
    for rank, ((fmt, total, scale), clipped) in enumerate(res):
        assert fmt == _fmt(want), (rank, fmt, _fmt(want))
        assert scale == _scale(want), (rank, "the total norm's tensor scale", scale, _scale(want))
        _assert_bits_equal(total, qt_plain(want), f"rank {rank} total norm")
        for k, p in params.items():
            if k in cut:
                continue
            assert clipped[k][0] == _scale(p.grad), (rank, k, "clipped gradient's scale")
            _assert_bits_equal(clipped[k][1], qt_plain(p.grad), f"rank {rank} {k}.grad clipped")


def _sc_fsdp_failed_step(rank, world):
    """An optimizer step whose closure raises (on every rank), then an op of rank 0 alone on a
    two-level shard: outside a step, no collective."""
    from torch.distributed.fsdp import fully_shard
    model = qt.convert(_mlp(32), qt.nvfp4)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = _data(1)[0]

    def closure():
        F.mse_loss(qt_plain_grad(model(x)), y).backward()
        raise FloatingPointError("loss is NaN")
    try:
        opt.step(closure)
    except FloatingPointError:
        pass
    alone = None
    if rank == 0:
        with torch.no_grad():
            local = model[0].weight.to_local()
            tripled = local * 3
        alone = (local._shard is not None, tripled._shard is None, qt_plain(local).clone(),
                 qt_plain(tripled), _scale(tripled))
    dist.barrier()
    return alone


def test_fsdp2_op_of_one_rank_after_a_failed_step_is_no_collective(ranks):
    # a step that raises skips the post-step hooks; it must still end the step: rank 0's op on
    # its shard alone then rounds under a fresh scale of its own (inside a step it would be a
    # collective, and wait for rank 1 forever: the short timeout fails the test instead)
    res = ranks.run("_sc_fsdp_failed_step", timeout=30)
    was_marked, unmarked, local, tripled, scale = res[0]
    assert was_marked and unmarked
    want = qt.as_qtensor(local * 3, qt.nvfp4)
    assert scale == _scale(want)
    _assert_bits_equal(tripled, qt_plain(want), "rank 0's local weight * 3")


def _moe(spec):
    """A tiny converted Qwen3-MoE (transformers' grouped_mm experts: stacked 3D expert weights,
    grouped GEMMs, a router), the same weights in every process."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=64, num_experts=4, num_experts_per_tok=2)
    cfg._experts_implementation = "grouped_mm"
    return qt.convert(transformers.Qwen3MoeForCausalLM(cfg), _spec(spec))


def _moe_batches(steps, batch=4):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 64, (batch, 8), generator=g) for _ in range(steps)]


def _moe_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _sc_fsdp_moe(rank, world, spec, steps):
    from torch.distributed.fsdp import fully_shard
    model = _moe(spec)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = _optimizer("adam", model)
    for ids in _moe_batches(steps):
        n = len(ids) // world
        opt.zero_grad()
        _moe_loss(model, ids[rank * n:(rank + 1) * n]).backward()
        opt.step()
    return _full_state(model), _opt_state(opt)


@pytest.mark.parametrize("spec", ["mxfp6", "bf16"])
def test_fsdp2_trains_a_converted_moe_as_one_process(ranks, spec):
    # The experts' stacked 3D weights (E, 2I, H) and (E, H, I) are sharded along the experts;
    # forward gathers them whole, the grouped GEMMs' weight gradients are reduce-scattered: each
    # rank's gradients (its micro-batch's tokens routed to each expert), their FP32 mean rounded
    # once, as one process by the reduction rule
    res = ranks.run("_sc_fsdp_moe", spec, 2, timeout=300)
    model = _moe(spec)
    opt = _optimizer("adam", model)
    params = list(model.parameters())
    for ids in _moe_batches(2):
        n = len(ids) // WORLD
        grads = []
        for r in range(WORLD):
            opt.zero_grad()
            _moe_loss(model, ids[r * n:(r + 1) * n]).backward()
            grads.append([qt_plain(p.grad) for p in params])
        with torch.no_grad():
            for i, p in enumerate(params):
                p.grad.copy_(_fp32_sum(g[i] for g in grads) / WORLD)
        opt.step()
    ref, ref_opt = _state(model), _opt_state(opt)
    experts = [n for n in ref if ".experts." in n]
    assert experts and all(ref[n][0] is not None for n in experts)  # QTensors in the format
    for rank, (state, opt_state) in enumerate(res):
        _assert_states_equal(state, ref, f"rank {rank}")
        assert opt_state.keys() == ref_opt.keys()
        for key, (fmt, value) in opt_state.items():
            assert fmt == ref_opt[key][0], (rank, key, fmt, ref_opt[key][0])
            _assert_bits_equal(value, ref_opt[key][1], f"rank {rank} optimizer state {key}")


# ---------------------------------------------------------------------------------------------
# 4. DTensor and tensor parallelism

def _sc_dtensor(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    mesh = init_device_mesh("cpu", (world,))
    local = qt.as_qtensor(torch.arange(8.0).reshape(4, 2) * (rank + 1) + 0.1, qt.bf16,
                          mm_fmt=qt.mxfp8_e4m3)
    d = DTensor.from_local(local, mesh, [Shard(0)])
    out = {"full": d.full_tensor(),
           "replicate": d.redistribute(mesh, [Replicate()]).to_local(),
           "shard1": d.redistribute(mesh, [Shard(1)]).to_local()}
    return {k: (_fmt(v), qt_plain(v)) for k, v in out.items()}


def test_dtensor_of_qtensors_keeps_the_format(ranks):
    res = ranks.run("_sc_dtensor")
    full = torch.cat([qt_plain(qt.as_qtensor(torch.arange(8.0).reshape(4, 2) * (r + 1) + 0.1,
                                             qt.bf16)) for r in range(WORLD)])
    for rank, out in enumerate(res):
        for key in ("full", "replicate", "shard1"):
            assert out[key][0] == ("bf16", "mxfp8_e4m3"), (rank, key, out[key][0])
        _assert_bits_equal(out["full"][1], full, f"rank {rank} full_tensor")
        _assert_bits_equal(out["replicate"][1], full, f"rank {rank} redistribute(Replicate)")
        _assert_bits_equal(out["shard1"][1], full[:, rank:rank + 1],
                           f"rank {rank} redistribute(Shard(1))")


_TILE_FORMATS = {  # 2D-tile operand formats: NVFP4 weight tiles, DeepSeek-V3's weight blocks
    "nvfp4_16x16": qt.nvfp4.replace(block_shape=(16, 16)),
    "fp8_128x128": qt.BlockFormat(qt.fp8_e4m3, block_shape=(128, 128), scale="fp32",
                                  scale_rule="amax"),
}


def _tile_local(rank, rows):
    """A rank's shard: whole tiles of rows, the same largest value on every rank (so NVFP4's
    tensor scale is the same: the gathered values are the shards' own)."""
    x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rank))
    x[0, 0] = 8.0
    return x


def _sc_dtensor_tiles(rank, world):
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, fmt in _TILE_FORMATS.items():
        rows = fmt.block_shape[0]
        local = qt.as_qtensor(_tile_local(rank, rows), qt.bf16, mm_fmt=fmt)
        tiled = qt.as_qtensor(_tile_local(rank, rows), fmt)
        full = DTensor.from_local(local, mesh, [Shard(0)]).full_tensor()
        gathered = funcol.all_gather_tensor(tiled, 0, dist.group.WORLD)
        out[name] = {"full": (_fmt(full), qt_plain(full)),
                     "gathered": (_fmt(gathered), qt_plain(gathered))}
    return out


def test_dtensor_and_collectives_of_2d_tile_formats(ranks):
    """A QTensor whose mm_fmt or fmt is a 2D-tile format (16x16 NVFP4 weight tiles, 128x128
    DeepSeek-V3 blocks): DTensor.full_tensor() and all_gather_tensor raised "Attempted to access
    the data pointer on an invalid python storage" (the tiles' rounding compared data
    pointers). They keep the formats and the shards' values."""
    res = ranks.run("_sc_dtensor_tiles")
    for name, fmt in _TILE_FORMATS.items():
        rows = fmt.block_shape[0]
        plain = torch.cat([qt_plain(qt.as_qtensor(_tile_local(r, rows), qt.bf16))
                           for r in range(WORLD)])
        tiled = torch.cat([qt_plain(qt.as_qtensor(_tile_local(r, rows), fmt))
                           for r in range(WORLD)])
        for rank, out in enumerate(res):
            assert out[name]["full"][0] == ("bf16", str(fmt)), (rank, name, out[name]["full"][0])
            _assert_bits_equal(out[name]["full"][1], plain, f"rank {rank} {name} full_tensor")
            assert out[name]["gathered"][0] == (str(fmt), None), (rank, name)
            _assert_bits_equal(out[name]["gathered"][1], tiled,
                               f"rank {rank} {name} all_gather_tensor")


def _tp_model(plan_name, spec="mxfp6"):
    torch.manual_seed(0)
    if plan_name == "col":
        return qt.convert(nn.Linear(8, 64), _spec(spec))
    return qt.convert(nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4)), _spec(spec))


def _parallelize(plan_name, spec="mxfp6"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _tp_model(plan_name, spec)
    if plan_name == "col":  # its output all-gathered (Replicate), as a local tensor
        parallelize_module(model, mesh, ColwiseParallel(output_layouts=Replicate()))
    else:
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


def _sc_tensor_parallel(rank, world, plan_name):
    model = _parallelize(plan_name)
    y = model(_data(1)[0][0])
    qt_plain_grad(y).square().sum().backward()
    grads = {n: (_fmt(p.grad), qt_plain(p.grad.full_tensor())) for n, p in model.named_parameters()}
    return _fmt(y), qt_plain(y), {n: _fmt(p) for n, p in model.named_parameters()}, grads


def test_tensor_parallel_linear_gives_the_single_process_result(ranks):
    x = _data(1)[0][0]
    # column parallel: each rank computes whole output columns over the whole reduction: exact
    model = _tp_model("col")
    ref = model(x)
    qt_plain_grad(ref).square().sum().backward()
    for rank, (fmt, y, fmts, grads) in enumerate(ranks.run("_sc_tensor_parallel", "col")):
        assert fmt == _fmt(ref) == ("bf16", "mxfp6_e3m2")
        assert fmts["weight"] == ("fp32", "mxfp6_e3m2"), fmts
        _assert_bits_equal(y, ref, f"rank {rank} column-parallel output")
        # and its backward: each rank's gradient rows are whole: exact, in the grad role
        for n, p in model.named_parameters():
            assert grads[n][0] == _fmt(p.grad), (rank, n, grads[n][0], _fmt(p.grad))
            _assert_bits_equal(grads[n][1], p.grad, f"rank {rank} column-parallel {n}.grad")
    ref = _tp_model("colrow")(x)
    for rank, (fmt, y, fmts, _grads) in enumerate(ranks.run("_sc_tensor_parallel", "colrow")):
        assert fmt == _fmt(ref) == ("bf16", "mxfp6_e3m2")
        assert fmts["2.weight"] == ("fp32", "mxfp6_e3m2"), fmts
        # row parallel: each rank rounds its partial result (bf16) before the all-reduce, as a
        # TP device does: within 2**-6 of the output's largest magnitude, not bit for bit
        err = (y - qt_plain(ref)).abs().max()
        assert err <= 2.0 ** -6 * qt_plain(ref).abs().max(), (rank, err)


def _tp_train(model, steps):
    """Adam on the whole batch (every TP rank sees it): the loss of the output's squares."""
    opt = _optimizer("adam", model)
    for x, _y in _data(steps):
        loss = qt_plain_grad(model(x)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    tp = any(hasattr(p, "full_tensor") for p in model.parameters())
    return (_full_state(model) if tp else _state(model)), _opt_state(opt)


def _sc_tp_adam(rank, world, plan_name, spec, steps):
    return _tp_train(_parallelize(plan_name, spec), steps)


@pytest.mark.parametrize("plan_name,spec", [("col", "mxfp6"), ("col", "bf16"),
                                            ("colrow", "mxfp6")])
def test_tensor_parallel_adam_steps_keep_formats(ranks, plan_name, spec):
    # mxfp6: FP32 masters (DTensors of FP32 shards) in Adam's state; bf16: Adam's state in bf16
    res = ranks.run("_sc_tp_adam", plan_name, spec, 3)
    ref, ref_opt = _tp_train(_tp_model(plan_name, spec), 3)
    assert ("qt_master" in str(ref_opt.keys())) == (spec == "mxfp6")
    for rank, (state, opt_state) in enumerate(res):
        assert state.keys() == ref.keys() and opt_state.keys() == ref_opt.keys()
        for n, (fmts, gfmts, value, grad) in state.items():
            assert (fmts, gfmts) == ref[n][:2], (rank, n, fmts, gfmts, ref[n][:2])
            _assert_bits_equal(value, res[0][0][n][2], f"rank {rank} vs rank 0 {n}")
        for key, (fmt, value) in opt_state.items():
            assert fmt == ref_opt[key][0], (rank, key, fmt, ref_opt[key][0])
        if plan_name == "col":  # each rank updates whole rows: the single-process run, exactly
            for n, (_f, _g, value, grad) in state.items():
                _assert_bits_equal(value, ref[n][2], f"rank {rank} {n}")
                _assert_bits_equal(grad, ref[n][3], f"rank {rank} {n}.grad")
            for key, (_fmt_, value) in opt_state.items():
                _assert_bits_equal(value, ref_opt[key][1], f"rank {rank} optimizer state {key}")
        else:  # row parallel: partial sums rounded before the all-reduce (see above), and an
            # MXFP6 operand near a tie may round the other way (one of its 1/8 steps): measured
            # 2**-8.4 (values) and 2**-4.8 (gradients) of each tensor's largest magnitude
            for n, (_f, _g, value, grad) in state.items():
                err = (value - ref[n][2]).abs().max()
                assert err <= 2.0 ** -7 * ref[n][2].abs().max(), (rank, n, err)
                err = (grad - ref[n][3]).abs().max()
                assert err <= 2.0 ** -4 * ref[n][3].abs().max(), (rank, n, err)


# ---------------------------------------------------------------------------------------------
# 5. Distributed checkpoints

def _sc_dcp(rank, world, spec, ckpt, scales=None):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.fsdp import fully_shard

    def build():
        model = qt.convert(_mlp(), _spec(spec))
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        return model, _optimizer("adam", model)

    def opt_formats(model, opt):
        sd = get_optimizer_state_dict(model, opt)["state"]
        return {k: {s: _fmt(v) for s, v in st.items() if getattr(v, "dim", lambda: 0)()}
                for k, st in sd.items()}

    batches = _data(4)
    model, opt = build()
    _train_shard(model, opt, rank, world, batches[:2])
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=ckpt)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    full = {k: (_fmt(v), qt_plain(v)) for k, v in full.items()}
    saved_formats = opt_formats(model, opt)
    saved_scales = {n: _scale(p) for n, p in model.named_parameters()}
    _train_shard(model, opt, rank, world, batches[2:])
    uninterrupted = {n: qt_plain(p.full_tensor()) for n, p in model.named_parameters()}
    uninterrupted_scales = {n: _scale(p) for n, p in model.named_parameters()}

    model, opt = build()  # a fresh run: initial weights, no optimizer state
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=ckpt)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    loaded = {n: qt_plain(p.full_tensor()) for n, p in model.named_parameters()}
    loaded_formats = ({n: _fmt(p) for n, p in model.named_parameters()}, opt_formats(model, opt))
    loaded_scales = {n: _scale(p) for n, p in model.named_parameters()}
    _train_shard(model, opt, rank, world, batches[2:])
    resumed = {n: qt_plain(p.full_tensor()) for n, p in model.named_parameters()}
    if scales is not None:  # the local shards' tensor scales: saved, loaded, resumed
        scales.update(saved=saved_scales, loaded=loaded_scales,
                      uninterrupted=uninterrupted_scales,
                      resumed={n: _scale(p) for n, p in model.named_parameters()})
    return full, saved_formats, loaded, loaded_formats, uninterrupted, resumed


def _sc_dcp_scales(rank, world, spec, ckpt):
    scales = {}
    return _sc_dcp(rank, world, spec, ckpt, scales), scales


def test_dcp_of_a_two_level_model_keeps_its_tensor_scales(ranks, tmp_path):
    # NVFP4 parameters sharded by FSDP2: each shard carries the whole parameter's FP32 tensor
    # scale, which a save and load must bring back with the values (a shard loaded under
    # the fresh model's scale would hold values that its scale does not give), and training
    # resumed from the checkpoint is bit-identical to uninterrupted training
    res = ranks.run("_sc_dcp_scales", "nvfp4", str(tmp_path / "ckpt"))
    after2 = _reduced_reference("nvfp4", 2, optim="adam")
    ref_scales = _REF_SCALES["nvfp4", 16][0]
    for rank, ((full, _sf, loaded, loaded_formats, uninterrupted, resumed), scales) in \
            enumerate(res):
        for n, (fmts, _g, value, _grad) in after2.items():
            assert full[n][0] == fmts and loaded_formats[0][n] == fmts, (rank, n)
            _assert_bits_equal(loaded[n], value, f"rank {rank} loaded {n}")
            assert scales["saved"][n] == ref_scales[n][0] is not None, (rank, n, "saved")
            assert scales["loaded"][n] == scales["saved"][n], (rank, n, "loaded scale")
            _assert_bits_equal(resumed[n], uninterrupted[n], f"rank {rank} resumed {n}")
            assert scales["resumed"][n] == scales["uninterrupted"][n], (rank, n, "resumed")


@pytest.mark.parametrize("spec", ["mxfp6", "bf16"])
def test_dcp_resumes_bit_identical(ranks, spec, tmp_path):
    res = ranks.run("_sc_dcp", spec, str(tmp_path / "ckpt"))
    after2 = _reduced_reference(spec, 2, optim="adam")
    for rank, (full, saved_formats, loaded, loaded_formats, uninterrupted, resumed) in \
            enumerate(res):
        for n, (fmts, _g, value, _grad) in after2.items():
            assert full[n][0] == fmts, (rank, n, full[n][0], fmts)  # full state dict: QTensors
            _assert_bits_equal(full[n][1], value, f"rank {rank} full state dict {n}")
            _assert_bits_equal(loaded[n], value, f"rank {rank} loaded {n}")
            assert loaded_formats[0][n] == fmts, (rank, n, loaded_formats[0][n])
            _assert_bits_equal(resumed[n], uninterrupted[n], f"rank {rank} resumed {n}")
        assert loaded_formats[1] == saved_formats, (rank, loaded_formats[1], saved_formats)


# ---------------------------------------------------------------------------------------------
# 6. The guide's example, as written (torchrun, 2 processes), a few steps

def test_fsdp_example_runs_and_matches_one_process(tmp_path):
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(root / "examples" / "fsdp_training.py"), "--steps", "2", "--check",
           "--max-bytes", "200000"]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "head.weight: DTensor of QTensor(fmt=fp32, mm_fmt=mxfp6_e3m2)" in run.stdout
    assert "gradient shard fmt=bf16" in run.stdout
    assert "single-process check: 30/30 parameters bit-identical" in run.stdout, run.stdout


# ---------------------------------------------------------------------------------------------
# 4 ranks (cheap enough: one pool, one test)

@pytest.fixture(scope="module")
def four_ranks():
    pool = _Pool(4)
    yield pool
    pool.close()


def _sc_four(rank, world):
    return _sc_ddp(rank, world, "bf16", 2), _sc_fsdp(rank, world, "mxfp6", 2)[0]


def test_four_ranks_agree_and_follow_the_rule(four_ranks):
    res = four_ranks.run("_sc_four")
    for which, ref in ((0, _reduced_reference("bf16", 2, world=4)),
                       (1, _reduced_reference("mxfp6", 2, world=4, optim="adam"))):
        first = res[0][which]
        for rank, both in enumerate(res):
            state = both[which]
            for n, (fmts, gfmts, value, grad) in state.items():  # the ranks agree bit for bit
                assert (fmts, gfmts) == first[n][:2]
                _assert_bits_equal(value, first[n][2], f"rank {rank} vs rank 0 {n}")
                _assert_bits_equal(grad, first[n][3], f"rank {rank} vs rank 0 {n}.grad")
        # with 4 ranks the FP32 sum's order is the backend's; here it still equals the oracle's
        for n, (fmts, gfmts, value, grad) in first.items():
            assert (fmts, gfmts) == ref[n][:2], (which, n, fmts, gfmts, ref[n][:2])
            _assert_bits_equal(value, ref[n][2], f"{['ddp', 'fsdp'][which]} 4 ranks {n}")


# ---------------------------------------------------------------------------------------------
# The private torch functions qtensor.tensor.shims wraps for qtensor.nn.distributed (written for
# torch 2.13): a torch upgrade that changes one fails here by name, not somewhere far away in a
# multi-process run

def _wraps_still(ok, what):
    from qtensor.tensor import shims
    assert ok, (f"qtensor.tensor.shims (written for torch {shims.TARGET}) wraps {what}; torch "
                f"{torch.__version__} changed it: update the wrapper and this test")


def test_the_torch_internals_distributed_wraps_are_still_there():
    import inspect
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.fsdp._fully_shard import _fsdp_param
    from qtensor.tensor import shims
    # each is a shim that names the torch version it targets (tests/tensor/test_shims.py)
    for name in ("wrap_broadcast_coalesced", "wrap_fsdp_shard_builders", "wrap_dcp_commit_tensor",
                 "handle_dtensor_ops"):
        assert name in shims.__all__, name
        assert getattr(shims, name).__doc__.startswith(f"torch {shims.TARGET}:"), name
    bc = dist._broadcast_coalesced
    _wraps_still(getattr(bc, "_qtensor_payloads", False)
                 and (bc.__wrapped__.__doc__ or "").startswith(
                     "_broadcast_coalesced(process_group: torch._C._distributed_c10d.ProcessGroup, "
                     "tensors:"),
                 "dist._broadcast_coalesced(process_group, tensors, ...), which DDP calls")
    init = _fsdp_param.FSDPParam._init_sharded_param
    _wraps_still(getattr(init, "_qtensor_scales", False)
                 and list(inspect.signature(init.__wrapped__).parameters)[:2] == ["self", "param"],
                 "FSDPParam._init_sharded_param(self, param, ...)")
    reset = _fsdp_param.FSDPParam.reset_sharded_param
    _wraps_still(getattr(reset, "_qtensor_scales", False)
                 and list(inspect.signature(reset.__wrapped__).parameters) == ["self"],
                 "FSDPParam.reset_sharded_param(self)")
    source = inspect.getsource(_fsdp_param)
    _wraps_still(all(name in source for name in ("self.sharded_param", "self._sharded_param_data",
                                                 "self._module_info", "param_name")),
                 "FSDPParam's sharded_param, _sharded_param_data and _module_info.param_name")
    commit = DefaultLoadPlanner.commit_tensor
    _wraps_still(getattr(commit, "_qtensor_scales", False)
                 and list(inspect.signature(commit.__wrapped__).parameters)
                 == ["self", "read_item", "tensor"],
                 "DefaultLoadPlanner.commit_tensor(self, read_item, tensor)")
    from torch.distributed.tensor import DTensor
    handlers = DTensor._op_dispatcher._custom_op_handlers
    aten = torch.ops.aten
    _wraps_still(all(getattr(handlers.get(op), "_qtensor_handler", False)
                     for op in (aten.linalg_vector_norm.default, aten._foreach_norm.Scalar,
                                aten.stack.default)),
                 "DTensor._op_dispatcher._custom_op_handlers (the norms of sharded QTensors)")
    from torch.distributed.checkpoint import default_planner
    from torch.distributed.checkpoint.metadata import MetadataIndex
    _wraps_still("self.state_dict" in inspect.getsource(default_planner.DefaultLoadPlanner)
                 and "fqn" in {f.name for f in __import__("dataclasses").fields(MetadataIndex)},
                 "DefaultLoadPlanner.state_dict and ReadItem.dest_index.fqn")

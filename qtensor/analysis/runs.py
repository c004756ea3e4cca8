"""The runs of one analysis: one batch forward and backward through a model (the FP32 reference,
the converted copy, the one-layer copies), all from the same random state, and what is compared
between them (loss, KL of the outputs, gradient cosine); one optimizer step on the converted
copy against the same step in FP32.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import reference
from ..nn.conversion import conversion_of
from ..nn.plans import _plain
from .layers import _lossy


def _output_tensor(out) -> torch.Tensor:
    """The tensor to compare and differentiate: the output, its first item, or ``.logits``."""
    if isinstance(out, torch.Tensor):
        return _plain(out)
    if hasattr(out, "logits"):
        return _plain(out.logits)
    if isinstance(out, dict):
        return _output_tensor(next(iter(out.values())))
    if isinstance(out, (tuple, list)):
        return _output_tensor(out[0])
    raise TypeError(f"qt.analyze: cannot find a tensor in the model's output ({type(out)})")


def _default_loss(out: torch.Tensor) -> torch.Tensor:
    return 0.5 * out.float().pow(2).mean()


class _SameRandomness:
    """Every run of one analysis starts from the same random state: torch's generators as the
    call found them (restored after the run, so that the caller's stream is untouched), and
    stochastic rounding drawing its seeds from a generator of its own, seeded alike, so that
    dropout draws the same masks in every run whatever the recipe rounds stochastically."""

    def __init__(self):
        self.cuda = torch.cuda.is_initialized()
        self.seed = 0x5EED  # (any: the same in every run)
        self.cpu = torch.get_rng_state()
        self.gpu = torch.cuda.get_rng_state_all() if self.cuda else None

    @contextlib.contextmanager
    def __call__(self):
        devices = list(range(torch.cuda.device_count())) if self.cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda:
                torch.cuda.set_rng_state_all(self.gpu)
            before = reference.SEED_GENERATOR[0]
            reference.SEED_GENERATOR[0] = torch.Generator().manual_seed(self.seed)
            try:
                yield
            finally:
                reference.SEED_GENERATOR[0] = before


def _run(model: nn.Module, inputs, loss_fn: Callable, same=None) -> dict:
    args = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    model.zero_grad(set_to_none=True)
    with (same() if same is not None else contextlib.nullcontext()):
        out = _output_tensor(model(*args))
        loss = loss_fn(out)
        loss = _plain(loss)
        if loss.requires_grad:  # (a model without parameters, inputs without gradient: none)
            loss.backward()
    grads = {n: (None if p.grad is None else _plain(p.grad).detach().double().flatten())
             for n, p in model.named_parameters()}
    return {"out": out.detach().double(), "loss": float(loss.detach()), "grads": grads}


def _kl(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Mean over rows of KL(softmax(ref) || softmax(out)), softmax over the last axis."""
    if ref.dim() == 0:
        return 0.0
    lp, lq = F.log_softmax(ref, -1), F.log_softmax(out, -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def _cosine(ref: dict, got: dict, names=None) -> float:
    names = [n for n in (names or ref) if ref.get(n) is not None and got.get(n) is not None]
    if not names:
        return float("nan")
    a = torch.cat([ref[n] for n in names])
    b = torch.cat([got[n] for n in names])
    den = float(a.norm() * b.norm())
    return float(a @ b) / den if den > 0 else (1.0 if float(a.norm()) == float(b.norm()) else 0.0)


def _compare(ref: dict, got: dict) -> dict:
    return {"loss": got["loss"], "dloss": got["loss"] - ref["loss"],
            "kl": _kl(ref["out"], got["out"]), "grad_cos": _cosine(ref["grads"], got["grads"])}


def _optimizer_step(model: nn.Module, optimizer: Callable, recorder) -> None:
    """One step of ``optimizer(model.parameters())`` on the converted model, and the same step
    of ``optimizer`` on plain FP32 copies of its parameters and gradients: each state tensor of
    a parameter with a low-precision optimizer_state role against its FP32 counterpart (the
    optimizer rounds its state in each in-place op, so the values before one rounding are not
    there to compare with). ``recorder``: a :class:`qtensor.analysis.recording._Recorder`."""
    conv = conversion_of(model)
    named = [(n, p) for n, p in model.named_parameters()]
    copies = []
    for _n, p in named:
        c = _plain(p).detach().float().clone().requires_grad_()
        c.grad = None if p.grad is None else _plain(p.grad).detach().float().clone()
        copies.append(c)
    ref = optimizer(copies)
    opt = optimizer(model.parameters())
    with torch.no_grad():
        ref.step()
        opt.step()
    for (n, p), c in zip(named, copies):
        plan = conv.tensor_plans.get(n)
        if plan is None or plan.master or not _lossy(plan.optimizer_state):
            continue
        want = ref.state.get(c, {})
        for key, value in opt.state.get(p, {}).items():
            if (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0
                    and isinstance(want.get(key), torch.Tensor)):
                recorder._add("optimizer_state", f"{key!r} of {n}", plan.optimizer_state.fmt,
                              want[key].detach(), _plain(value).detach().float(),
                              rounded=False)

"""Training a converted model with real torch.optim optimizers: bare formats that
train, FP32 master weights with closures and exceptions, unconvert with optimizers, dtype casts of
a converted model, SGD's first momentum step, LossScaler validation, describe and warnings."""
import io
import warnings
import weakref
from contextlib import redirect_stdout

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qtensor as qt
from qtensor.tensor import shards

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:qt.convert. non-floating tensors")


def bits(t):
    t = t.dequantize() if isinstance(t, qt.QTensor) else t
    t = t.detach().contiguous()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))


def toy(seed=1, n=64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, x @ torch.randn(8, 3, generator=g)


def fp32_loss(model, x, y):
    with torch.no_grad():
        out = model(x)
        return float(F.mse_loss(out.dequantize() if isinstance(out, qt.QTensor) else out, y))


def fit(model, opt, steps, x, y):
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


# ---------------------------------------------------------------------------------------------
# 1. a bare format trains: FP32 optimizer state and master weights

@pytest.mark.parametrize("fmt", ["fp8_e4m3", "mxfp4_e2m1", qt.fp8_e5m2])
@pytest.mark.parametrize("optname", ["adamw", "sgd"])
def test_bare_format_trains(fmt, optname):
    x, y = toy()
    model = qt.convert(mlp(), fmt)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if optname == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9))
    l0 = fp32_loss(model, x, y)
    losses = []
    for _ in range(5):
        fit(model, opt, 6, x, y)
        losses.append(fp32_loss(model, x, y))
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < 0.5 * l0, (l0, losses)
    assert losses[-1] < losses[0], losses
    # the parameters stay in the format; the optimizer works on FP32 masters
    f = qt.format(fmt)
    assert model[0].weight.fmt == f and model[0].weight.grad.fmt == f
    master = qt.master_weight(opt, model[0].weight)
    assert type(master) is torch.Tensor and master.dtype == torch.float32
    assert all(type(v) is torch.Tensor for k, v in opt.state[model[0].weight].items())


def test_bare_format_recipe_rule():
    r = qt.convert(mlp(), "fp8_e4m3")._qt_conversion.recipe
    assert r.weight == qt.Role(qt.fp8_e4m3) and r.activation == qt.Role(qt.fp8_e4m3)
    assert r.grad == qt.Role(qt.fp8_e4m3) and r.master_weights
    assert r.optimizer_state.full_precision
    assert qt.convert(mlp(), qt.fp16)._qt_conversion.recipe.master_weights  # eps underflows
    # formats with FP32's range keep every value in the format, as model.bfloat16() would
    for fmt in (qt.fp32, qt.bf16):
        r = qt.convert(mlp(), fmt)._qt_conversion.recipe
        assert r == qt.Recipe.uniform(fmt) and not r.master_weights
    # Recipe.uniform keeps every value in the format
    u = qt.Recipe.uniform(qt.fp8_e4m3)
    assert u.optimizer_state == qt.Role(qt.fp8_e4m3) and not u.master_weights


@pytest.mark.parametrize("recipe, warns", [
    (qt.Recipe.uniform(qt.fp8_e4m3), True), (qt.recipes.mx_all_mxfp6, True),
    (qt.recipes.block8, True), (qt.Recipe.uniform(qt.bf16), False)])
def test_adam_state_where_eps_underflows_is_said(recipe, warns):
    # every value in the format, Adam's state included, is what the user asked for: it NaNs,
    # so the first step says why, once, at the user's line
    x, y = toy()
    model = qt.convert(mlp(), recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    F.mse_loss(model(x), y).backward()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        opt.step()
        fit(model, opt, 1, x, y)
    w = [x for x in w if "eps" in str(x.message)]
    assert len(w) == int(warns), [str(x.message) for x in w]
    if warns:
        assert w[0].filename == __file__ and "optimizer_state=None" in str(w[0].message)
        assert "0.weight" in str(w[0].message)


def test_recipe_names_as_strings():
    # "mxfp6" names both a format and a recipe: refused, pointing at both
    for name in ("mxfp6", "fp16"):
        with pytest.raises(ValueError, match=f"qt.recipes.{name}") as e:
            qt.convert(mlp(), name)
        assert "qt.convert(model, qt.recipes." in str(e.value)
    # a recipe name that is not a format means that recipe
    m = qt.convert(mlp(), "swalp")
    assert m._qt_conversion.recipe == qt.recipes.swalp
    m = qt.convert(mlp(), "mxfp4_weights")
    assert m._qt_conversion.recipe == qt.recipes.mxfp4_weights


# ---------------------------------------------------------------------------------------------
# 6. master weights: closures and exceptions

def test_lbfgs_with_master_weights_makes_progress():
    x, y = toy()

    def run(model):
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)

        def closure():
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss
        l0 = fp32_loss(model, x, y)
        for _ in range(4):
            opt.step(closure)
        return l0, fp32_loss(model, x, y)

    plain0, plain1 = run(mlp())
    assert plain1 < 0.2 * plain0
    l0, l1 = run(qt.convert(mlp(), qt.recipes.mxfp6))
    assert l1 < 0.2 * l0, (l0, l1, plain1)


def _grads(model):
    return [p.grad for p in model.parameters()]


def test_exception_in_closure_restores_parameters():
    x, y = toy()
    model = qt.convert(mlp(), qt.recipes.mxfp6)
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fit(model, opt, 1, x, y)

    def closure():
        F.mse_loss(model(x), y).backward()
        raise KeyError("boom")
    with pytest.raises(KeyError, match="boom"):
        opt.step(closure)
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], params))
    assert all(g is not None for g in _grads(model))
    opt.zero_grad()
    assert all(g is None for g in _grads(model))
    fit(model, opt, 1, x, y)  # and training goes on from the masters
    assert all(isinstance(p, qt.QTensor) for p in opt.param_groups[0]["params"])


def test_exception_inside_step_then_zero_grad_clears_model_grads():
    x, y = toy()
    model = qt.convert(mlp(), qt.recipes.mxfp6)
    params = list(model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    fit(model, opt, 1, x, y)
    before = [p.dequantize().clone() for p in params]

    def fail(optimizer, args, kwargs):  # runs inside step(), after qtensor's own hook
        raise RuntimeError("user hook failed")
    handle = opt.register_step_pre_hook(fail)
    F.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match="user hook failed"):
        opt.step()
    handle.remove()
    sd = opt.state_dict()  # the model's parameters, with their masters
    assert all("qt_master" in sd["state"][i] for i in range(len(params)))
    opt.zero_grad()
    assert all(g is None for g in _grads(model))
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], params))
    assert all(torch.equal(p.dequantize(), b) for p, b in zip(params, before))
    fit(model, opt, 1, x, y)
    assert not all(torch.equal(p.dequantize(), b) for p, b in zip(params, before))



class _Outer(torch.optim.Optimizer):
    """An optimizer whose step runs another optimizer's step (as a wrapper such as Lookahead
    does), then an update of its own."""

    def __init__(self, params, inner, seen):
        super().__init__(params, {})
        self.inner, self.seen = inner, seen

    def step(self, closure=None):
        self.inner.step()
        self.seen.append(("outer, after the inner step", shards.in_step()))


def test_a_step_that_raises_ends_the_step():
    # Inside a step, ops on two-level shards are collectives; a step that raises skips the
    # post-step hooks, and must not leave the process inside a step (a later op of one rank
    # alone would wait for the others forever)
    x, y = toy()
    model = qt.convert(mlp(), qt.nvfp4)
    seen = []

    def closure():
        seen.append(("closure", shards.in_step()))
        F.mse_loss(model(x), y).backward()
        raise FloatingPointError("loss is NaN")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(FloatingPointError, match="NaN"):
        opt.step(closure)
    assert seen == [("closure", True)]
    assert not shards.in_step()
    # a user hook that raises inside the step; another optimizer's steps after it
    handle = opt.register_step_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("hook")))
    with pytest.raises(RuntimeError, match="hook"):
        opt.step()
    handle.remove()
    assert not shards.in_step()
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    fit(model, other, 1, x, y)
    assert not shards.in_step()
    # nested steps: the outer step is still running after the inner one returns
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = _Outer(model.parameters(), inner, seen)
    F.mse_loss(model(x), y).backward()
    outer.step()
    assert seen[-1] == ("outer, after the inner step", True)
    assert not shards.in_step()
    # a nested step that raises, caught inside the outer step
    def failing_inner():
        with pytest.raises(FloatingPointError):
            inner.step(closure)
    outer.inner = type("I", (), {"step": staticmethod(failing_inner)})()
    outer.step()
    assert seen[-1] == ("outer, after the inner step", True)
    assert not shards.in_step()
    fit(model, opt, 1, x, y)  # and training goes on
    assert not shards.in_step()


# ---------------------------------------------------------------------------------------------
# 8. unconvert with an optimizer, a live leak_check report, weak references

STATEFUL = qt.Recipe(weight="bf16", bias="bf16", activation="bf16", grad="bf16",
                     optimizer_state="bf16")


def _assert_plain_optimizer(opt, model):
    for group in opt.param_groups:
        for p in group["params"]:
            assert type(p) is nn.Parameter
            for k, v in opt.state[p].items():
                assert not isinstance(v, qt.QTensor), k
                if torch.is_tensor(v) and v.dim() > 0:
                    assert v.dtype == p.dtype, k
    assert {id(p) for g in opt.param_groups for p in g["params"]} == \
        {id(p) for p in model.parameters()}


@pytest.mark.parametrize("recipe, dtype", [(STATEFUL, torch.float32),
                                           (qt.recipes.mxfp6, torch.float32),
                                           (qt.recipes.mxfp6, torch.bfloat16)],
                         ids=["bf16_state", "mxfp6", "mxfp6_bf16_model"])
def test_unconvert_gives_plain_optimizer_state(recipe, dtype):
    x, y = toy()
    x, y = x.to(dtype), y.to(dtype)
    model = qt.convert(mlp().to(dtype), recipe)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    fit(model, opt, 2, x, y)
    qt.unconvert(model)
    _assert_plain_optimizer(opt, model)
    assert all("qt_master" not in s for s in opt.state.values())
    before = [p.detach().clone() for p in model.parameters()]
    fit(model, opt, 1, x, y)  # plain training continues, with the same optimizer
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("hold", ["leak_report", "weakref"])
def test_unconvert_with_references_keeps_optimizer_connected(hold):
    x, y = toy()
    model = qt.convert(mlp(), STATEFUL)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    keep = []
    if hold == "leak_report":
        with qt.leak_check() as report:
            fit(model, opt, 1, x, y)
        keep.append(report)
    else:
        fit(model, opt, 1, x, y)
        keep += [weakref.ref(p) for p in model.parameters()]
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        qt.unconvert(model)
    for warning in w:  # a replaced parameter is said once, at the caller's line
        assert "qt.unconvert" in str(warning.message) and "qt.convert:" not in str(warning.message)
        assert warning.filename == __file__
    assert len(w) <= 1
    _assert_plain_optimizer(opt, model)
    before = [p.detach().clone() for p in model.parameters()]
    fit(model, opt, 1, x, y)
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# ---------------------------------------------------------------------------------------------
# 9. dtype casts of a converted model

@pytest.mark.parametrize("cast", ["half", "bfloat16", "double", "to_bf16", "to_dev_fp16"])
def test_dtype_cast_of_converted_model_is_refused_at_the_call(cast):
    model = qt.convert(mlp(), qt.bf16)
    w = model[0].weight
    call = {"half": lambda: model.half(), "bfloat16": lambda: model.bfloat16(),
            "double": lambda: model.double(), "to_bf16": lambda: model.to(torch.bfloat16),
            "to_dev_fp16": lambda: model[0].to("cpu", torch.float16)}[cast]
    with pytest.raises(RuntimeError, match="qt.unconvert") as e:
        call()
    assert "qt.convert(model, qt.fp16)" in str(e.value)
    assert model[0].weight is w and w.dtype == torch.float32  # nothing changed
    model.float().to("cpu").to(torch.float32)  # no dtype change: fine
    assert isinstance(model(toy()[0]), qt.QTensor)
    qt.unconvert(model)
    assert model.half()[0].weight.dtype == torch.float16


# ---------------------------------------------------------------------------------------------
# 16. SGD's first momentum step is torch's: the buffer is a clone of the gradient

def sgd_by_hand(p, g, buf, r, lr, momentum, dampening, nesterov, weight_decay):
    """torch.optim.SGD's single-tensor step, each op computed in FP32 and rounded by ``r``
    (the emulator's arithmetic); ``buf`` None on the first step."""
    d_p = r(g.add(p, alpha=weight_decay))
    if buf is None:
        buf = d_p.clone()  # torch: clone(grad), no dampening
    else:
        buf = r(r(buf.mul(momentum)).add(d_p, alpha=1 - dampening))
    d_p = r(d_p.add(buf, alpha=momentum)) if nesterov else buf
    return r(p.add(d_p, alpha=-lr)), buf


@pytest.mark.parametrize("fmt", [qt.fp32, qt.bf16], ids=["fp32", "bf16"])
# (torch refuses Nesterov momentum with dampening)
@pytest.mark.parametrize("nesterov, dampening", [(False, 0.0), (False, 0.5), (True, 0.0)])
def test_sgd_momentum_steps_match_torch_bit_for_bit(fmt, nesterov, dampening):
    kw = dict(lr=0.1, momentum=0.9, dampening=dampening, nesterov=nesterov, weight_decay=0.01)
    r = (lambda t: t) if fmt == qt.fp32 else (lambda t: qt.quantize(t, fmt))
    torch.manual_seed(0)
    model = qt.convert(nn.Linear(5, 4), qt.Recipe(weight=fmt, bias=fmt, grad=fmt,
                                                  optimizer_state=fmt))
    with torch.no_grad():
        model.weight[0] = -0.0  # -0.0 weights and gradients: the buffer's sign of zero shows
    opt = torch.optim.SGD(model.parameters(), **kw)
    ref = [p.dequantize().detach().clone() for p in model.parameters()]
    ref_bufs = [None, None]
    plain = [p.clone().requires_grad_() for p in ref]  # torch's own SGD, for fp32
    plain_opt = torch.optim.SGD(plain, **kw)
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        grads = [r(torch.randn(p.shape, generator=g)) for p in ref]
        grads[0][0] = -0.0
        for p, q, grad in zip(model.parameters(), plain, grads):
            p.grad = qt.as_qtensor(grad.clone(), fmt)
            q.grad = grad.clone()
        opt.step()
        plain_opt.step()
        for i, (p, grad) in enumerate(zip(model.parameters(), grads)):
            ref[i], ref_bufs[i] = sgd_by_hand(ref[i], grad, ref_bufs[i], r, **kw)
            buf = opt.state[p]["momentum_buffer"]
            assert torch.equal(bits(p), bits(ref[i])), step
            assert torch.equal(bits(buf), bits(ref_bufs[i])), step
            if fmt == qt.fp32:
                assert torch.equal(bits(p), bits(plain[i])), step
                assert torch.equal(bits(buf), bits(plain_opt.state[plain[i]]["momentum_buffer"]))


# ---------------------------------------------------------------------------------------------
# 11. LossScaler and Recipe.loss_scale: positive powers of two

@pytest.mark.parametrize("kwargs, text", [
    (dict(init_scale=-4.0), "init_scale"),
    (dict(init_scale=0), "init_scale"),
    (dict(init_scale=float("nan")), "init_scale"),
    (dict(init_scale=float("inf")), "init_scale"),
    (dict(init_scale=1000.0), "power of two"),
    (dict(init_scale=True), "init_scale"),
    (dict(growth_factor=1.5), "growth_factor"),
    (dict(growth_factor=0.5), "growth_factor"),
    (dict(backoff_factor=0.3), "backoff_factor"),
    (dict(backoff_factor=2.0), "backoff_factor"),
    (dict(growth_interval=True), "growth_interval"),
    (dict(growth_interval=0), "growth_interval"),
    (dict(min_scale=3.0), "min_scale"),
    (dict(min_scale=-1.0), "min_scale"),
])
def test_loss_scaler_refuses_bad_scales(kwargs, text):
    with pytest.raises(ValueError, match=text):
        qt.LossScaler(**kwargs)


def test_loss_scaler_power_of_two_scales_accepted_and_update_checked():
    s = qt.LossScaler(init_scale=2 ** 10, growth_factor=4, backoff_factor=0.25, min_scale=1)
    assert s.get_scale() == 1024.0
    with pytest.raises(ValueError, match="power of two"):
        s.update(new_scale=3.0)
    s.update(new_scale=2.0 ** -3)
    assert s.get_scale() == 0.125
    with pytest.raises(ValueError, match="power of two"):
        qt.Recipe(loss_scale=1000)
    assert qt.LossScaler.from_recipe(qt.Recipe(loss_scale=512)).get_scale() == 512.0


def test_loss_scaler_refuses_a_closure():
    x, y = toy()
    model = qt.convert(mlp(), qt.bf16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = qt.LossScaler(2.0 ** 8)

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        return loss
    closure()
    with pytest.raises(TypeError, match="closure"):
        scaler.step(opt, closure)
    with pytest.raises(TypeError, match="closure"):
        scaler.step(opt, closure=closure)


# ---------------------------------------------------------------------------------------------
# 12. describe prints once; warnings point at the caller, once per conversion

def test_describe_prints_once_and_returns_none():
    model = qt.convert(mlp(), qt.bf16)
    out = io.StringIO()
    with redirect_stdout(out):
        assert qt.describe(model) is None
        assert qt.recipes.describe() is None
    assert "0.weight" in out.getvalue() and "mxfp6" in out.getvalue()
    text = qt.describe(model, print_table=False)
    assert isinstance(text, str) and text in out.getvalue()
    assert isinstance(qt.recipes.describe(print_table=False), str)


def test_warnings_point_at_the_caller_once_per_conversion():
    model = mlp()
    refs = [weakref.ref(p) for p in model.parameters()]  # blocks swap_tensors
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        qt.convert(model, qt.bf16)
    w = [x for x in w if "qt.convert" in str(x.message)]
    assert len(w) == 1, [str(x.message) for x in w]
    assert w[0].filename == __file__
    assert all(name in str(w[0].message) for name in ("0.weight", "0.bias", "2.weight"))
    assert refs
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        # a buffer name of this test's own: the same message is said once per process
        counted = nn.Sequential(nn.Linear(2, 2))
        counted.register_buffer("calls_of_the_warnings_test", torch.zeros((), dtype=torch.long))
        qt.convert(counted, qt.Recipe(weight="bf16", rules={"calls_of_the_warnings_test": "bf16"}))
    assert [x.filename for x in w if "non-floating" in str(x.message)] == [__file__]


# ---------------------------------------------------------------------------------------------
# 13. every torch.optim optimizer: state made in __init__ or lazily, one step

_OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.05),
    "SGD-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "SGD-dampening": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.5),
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=1e-2),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=1e-2),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2, initial_accumulator_value=0.1),
    "Adagrad-0": lambda p: torch.optim.Adagrad(p, lr=1e-2),  # state "sum" made in __init__
    "Adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.9, centered=True),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=1e-2),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=1e-2, t0=0),
    "Adafactor": lambda p: torch.optim.Adafactor(p, lr=1e-2),
    "LBFGS": lambda p: torch.optim.LBFGS(p, lr=0.1, max_iter=1),  # one closure call per step
}
if hasattr(torch.optim, "Muon"):
    _OPTIMIZERS["Muon"] = lambda p: torch.optim.Muon(p, lr=1e-2)  # 2-D parameters only


def _deq(t):
    return t.dequantize() if isinstance(t, qt.QTensor) else t


def _one_step(model, make, x, params=None):
    """One optimizer step on ``model`` (a closure step, as LBFGS needs); the gradients used."""
    params = list(model.parameters()) if params is None else params
    opt = make(params)
    grads = {}

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = (out.dequantize() if isinstance(out, qt.QTensor) else out).square().mean()
        loss.backward()
        grads.update({i: _deq(p.grad).clone() for i, p in enumerate(params)})
        return loss
    opt.step(closure)
    return opt, grads


def _tiny_grads_model(seed=0):
    # small inputs: squared gradients far below FP8's smallest value (Adagrad's sum in FP8
    # flushes to 0 and its update is g/eps rounded to 0 in FP8: NaN)
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3)), torch.randn(5, 6) * 1e-2


@pytest.mark.parametrize("optname", sorted(_OPTIMIZERS))
def test_every_optimizer_one_step_on_fp32_masters(optname):
    """qt.convert(model, fp8): the optimizer runs in FP32 on FP32 master weights (docs/convert.md
    "Training support"), so one step equals torch's optimizer on a plain FP32 copy given the same
    (rounded) gradients, and the model's parameters are the masters rounded to FP8, as bits."""
    make = _OPTIMIZERS[optname]
    model, x = _tiny_grads_model()
    if optname == "Muon":
        model = nn.Sequential(nn.Linear(6, 4, bias=False), nn.Tanh(), nn.Linear(4, 3, bias=False))
    plain = [p.detach().clone() for p in model.parameters()]
    qt.convert(model, qt.fp8_e4m3)
    start = [p.dequantize().detach().clone() for p in model.parameters()]
    opt, grads = _one_step(model, make, x)
    ref = [s.clone().requires_grad_() for s in start]
    ref_opt = make(ref)

    def ref_closure():
        for i, r in enumerate(ref):
            r.grad = grads[i].clone()
        return torch.zeros(())
    ref_opt.step(ref_closure)
    for i, p in enumerate(model.parameters()):
        assert isinstance(p, qt.QTensor) and p.fmt == qt.fp8_e4m3
        master = qt.master_weight(opt, p)
        assert torch.equal(bits(master), bits(ref[i])), f"{optname}: master {i}"
        assert torch.equal(bits(p), bits(qt.quantize(ref[i].detach(), qt.fp8_e4m3)))
        assert torch.isfinite(p.dequantize()).all(), f"{optname}: parameter {i} not finite"
        for key, value in opt.state[p].items():  # FP32 state, none left in FP8
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                assert type(value) is torch.Tensor and value.dtype == torch.float32, (key, value)
    assert any(not torch.equal(a, b) for a, b in zip(plain, ref))  # the step did something


@pytest.mark.parametrize("optname", sorted(_OPTIMIZERS))
@pytest.mark.parametrize("state", [None, "bf16"])
def test_every_optimizer_one_step_with_optimizer_state_role(optname, state):
    """Without master weights every floating, non-scalar state tensor is in the optimizer_state
    role (None: FP32 QTensors) after the step, whether the optimizer made it in __init__
    (Adagrad) or in its first step, and the parameters stay finite in their format."""
    make = _OPTIMIZERS[optname]
    model, x = _tiny_grads_model()
    if optname == "Muon":
        model = nn.Sequential(nn.Linear(6, 4, bias=False), nn.Tanh(), nn.Linear(4, 3, bias=False))
    role = qt.fp32 if state is None else qt.bf16
    qt.convert(model, qt.Recipe(weight="bf16", bias="bf16", activation="bf16", grad="bf16",
                                optimizer_state=state))
    opt, grads = _one_step(model, make, x)
    for p in model.parameters():
        assert isinstance(p, qt.QTensor) and p.fmt == qt.bf16
        assert torch.isfinite(p.dequantize()).all()
        tensors = {k: v for k, v in opt.state[p].items()
                   if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim()}
        for key, value in tensors.items():
            assert isinstance(value, qt.QTensor) and value.fmt == role, (key, value)


def test_adagrad_state_made_in_init_is_in_its_role_from_the_first_step():
    """Adagrad makes "sum" in __init__ from the parameter (a QTensor in the weight format): the
    first step must accumulate in the optimizer_state role (FP32 here), not in BF16."""
    model, x = _tiny_grads_model()
    qt.convert(model, qt.Recipe(weight="bf16", bias="bf16", activation="bf16", grad="bf16"))
    opt, grads = _one_step(model, lambda p: torch.optim.Adagrad(p, lr=1e-2), x)
    for i, p in enumerate(model.parameters()):
        expected = torch.zeros_like(grads[i]).addcmul_(grads[i], grads[i])  # 0 + g*g in FP32
        assert torch.equal(bits(opt.state[p]["sum"]), bits(expected))


@pytest.mark.parametrize("optname", ["SparseAdam", "Adagrad"])
@pytest.mark.parametrize("master", [True, False])
def test_sparse_gradient_optimizers_one_step(optname, master):
    """nn.Embedding(sparse=True): SparseAdam and Adagrad take sparse gradients."""
    torch.manual_seed(0)
    model = nn.Embedding(10, 4, sparse=True)
    qt.convert(model, qt.fp8_e4m3 if master else qt.Recipe(weight="bf16", grad="bf16",
                                                               activation="bf16"))
    opt = getattr(torch.optim, optname)(list(model.parameters()), lr=1e-2)
    ids = torch.tensor([1, 3, 3, 7])
    (_deq(model(ids)) * 1e-3).sum().backward()
    before = model.weight.dequantize().clone()
    opt.step()
    after = model.weight.dequantize()
    assert torch.isfinite(after).all()
    if master:  # (FP8 rounding may hide the update in the parameter itself)
        after = qt.master_weight(opt, model.weight)
    changed = (after != before).any(dim=1)
    assert changed[[1, 3, 7]].all() and not changed[[0, 2, 4, 5, 6, 8, 9]].any()
    for value in opt.state[model.weight].values():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim():
            if master:
                assert type(value) is torch.Tensor and value.dtype == torch.float32
            else:
                assert isinstance(value, qt.QTensor) and value.fmt == qt.fp32


def test_master_gradient_buffer_is_reused_and_holds_each_steps_gradient():
    """FP32 master weights: each step copies the parameter's gradient into the buffer of the
    previous step (no new buffer per step); the masters follow FP32 SGD exactly, and the
    optimizer's state_dict carries no buffer."""
    from qtensor.nn import training
    torch.manual_seed(0)
    lin = qt.convert(torch.nn.Linear(8, 4, bias=False), qt.fp8_e4m3)  # FP32 masters
    opt = torch.optim.SGD(lin.parameters(), lr=0.25)
    master = lin.weight.dequantize().clone()
    buffers = []
    for step in range(3):
        x = torch.randn(5, 8)
        lin(x).dequantize().square().sum().backward()
        g = lin.weight.grad.dequantize().clone()
        opt.step()
        m = training.master_weight(opt, lin.weight)
        buffers.append(training._grad_buffers[id(m)][1])
        master = master - 0.25 * g  # FP32 SGD on the master
        assert torch.equal(m, master), step
        opt.zero_grad()
    assert buffers[0] is buffers[1] is buffers[2]
    state = opt.state_dict()["state"][0]
    assert set(state) == {training.MASTER_KEY, "momentum_buffer"} or \
        set(state) == {training.MASTER_KEY}

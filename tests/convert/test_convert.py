"""qt.convert, recipes, per-parameter rules and training support.

Every training test asserts the format of EVERY parameter, gradient and optimizer state tensor
after forward, backward and step, and that each value is representable in its format
(re-quantizing the values gives the same bits).
"""
import copy
import importlib
import io
import re
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import qtensor as qt
from helpers import assert_bits_equal
from qtensor.nn.convert import plan_of

torch.set_num_threads(1)
pytestmark = pytest.mark.filterwarnings("ignore:qt.convert. non-floating tensors")

BF16, FP32 = qt.bf16, qt.fp32


# ---------------------------------------------------------------------------------------------
# helpers

def bits(t):
    return t.detach().contiguous().view(torch.int32)


def assert_in_format(t, fmt, mm_fmt=None, what="tensor"):
    assert isinstance(t, qt.QTensor), f"{what}: expected a QTensor in {fmt}, got {type(t).__name__}"
    assert t.fmt == fmt, f"{what}: fmt {t.fmt} != {fmt}"
    assert t.mm_fmt == mm_fmt, f"{what}: mm_fmt {t.mm_fmt} != {mm_fmt}"
    v = t.dequantize().detach().float()
    again = qt.quantize(v, fmt)
    assert torch.equal(bits(again), bits(v)), f"{what}: values not representable in {fmt}"


def assert_plain(t, what="tensor"):
    assert type(t) in (torch.Tensor, nn.Parameter), f"{what}: expected plain, got {type(t)}"


def check_all(model, opt, recipe_roles):
    """Every parameter/grad/state has the format its plan says (plans checked against
    ``recipe_roles``: {name: (value Role, grad Role, state Role)} computed independently)."""
    for name, p in model.named_parameters():
        value, grad, state = recipe_roles[name]
        if value.fmt is None:
            assert_plain(p, name)
            if p.grad is not None:
                assert_plain(p.grad, name + ".grad")
            continue
        assert_in_format(p, value.fmt, value.mm_fmt, name)
        if p.requires_grad:
            assert p.grad is not None, f"{name} has no gradient"
            if grad.fmt is None:  # full precision: FP32 values
                assert_in_format(p.grad, FP32, None, name + ".grad")
            else:
                assert_in_format(p.grad, grad.fmt, grad.mm_fmt, name + ".grad")
        if opt is not None:
            st = opt.state[p]
            tensors = {k: v for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0}
            assert tensors, f"{name}: optimizer has no state"
            for k, v in tensors.items():
                if state.fmt is None:  # full precision: FP32 values
                    assert_in_format(v, FP32, None, f"{name} state {k}")
                else:
                    assert_in_format(v, state.fmt, state.mm_fmt, f"{name} state {k}")


def roles_for(model, recipe, overrides=None):
    """The expected roles of each parameter: the recipe's kind default, or ``overrides``."""
    R = qt.Role.of
    out = {}
    for name, _ in model.named_parameters():
        last = name.rsplit(".", 1)[-1]
        kind = "bias" if "bias" in last else "weight"
        out[name] = (getattr(recipe, kind), recipe.grad, recipe.optimizer_state)
        if overrides and name in overrides:
            v = R(overrides[name])
            out[name] = (v, recipe.grad if v.fmt is not None else R(None),
                         recipe.optimizer_state if v.fmt is not None else R(None))
    return out


def train(model, opt, batches, loss_fn, steps):
    losses = []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        out = model(x)
        loss = loss_fn(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach().dequantize() if isinstance(loss, qt.QTensor) else loss))
    return losses


def eval_loss(model, batch, loss_fn):
    """The loss in FP32 from the model's (dequantized) outputs: a loss computed in a narrow
    format is too coarse to see a few steps of progress."""
    with torch.no_grad():
        out = model(batch[0])
        loss = loss_fn(out.dequantize() if isinstance(out, qt.QTensor) else out, batch[1])
    return float(loss)


# ---------------------------------------------------------------------------------------------
# models

class MLP(nn.Module):
    def __init__(self, d=8, h=16, k=3):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, h)
        self.head = nn.Linear(h, k)

    def forward(self, x):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc(x.flatten(1))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + x)


class ResNet(nn.Module):
    def __init__(self, c=4, k=3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
                                  nn.ReLU(inplace=True))
        self.layer1 = nn.Sequential(Block(c), Block(c))
        self.fc = nn.Linear(c, k)

    def forward(self, x):
        x = self.layer1(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class TextModel(nn.Module):
    """Embedding + LayerNorm + TransformerEncoderLayer (nn.MultiheadAttention) + LSTM."""

    def __init__(self, vocab=11, d=8, k=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.enc = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=16, dropout=0.0,
                                              batch_first=True)
        self.lstm = nn.LSTM(d, d, batch_first=True)
        self.head = nn.Linear(d, k)

    def forward(self, idx):
        x = self.enc(self.norm(self.emb(idx)))
        out, (h, c) = self.lstm(x)
        return self.head(out[:, -1])


def data_vec(n=32, d=8, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, k, generator=g)
    return [(x, (x @ w).argmax(1))]


def data_img(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = (x.mean((1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 0).long()
    return [(x, y)]


def data_text(n=16, t=5, vocab=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (n, t), generator=g)
    return [(idx, idx[:, 0] % 3)]


MX_LIKE = qt.Recipe(weight=(FP32, qt.mxfp6_e3m2), bias=FP32, activation=(BF16, qt.mxfp6_e3m2),
                    grad=(BF16, qt.mxfp6_e3m2), optimizer_state=BF16)


# ---------------------------------------------------------------------------------------------
# Recipe and Role

def test_roles_normalise():
    r = qt.Recipe(weight="mxfp4", bias=None, activation=("bf16", "mxfp6"), grad=(None, qt.mxfp8_e4m3),
                  optimizer_state=qt.bf16)
    assert r.weight == qt.Role(qt.mxfp4_e2m1) and r.weight.mm_fmt is None
    assert r.bias.full_precision
    assert r.activation == qt.Role(qt.bf16, qt.mxfp6_e3m2)
    assert r.grad == qt.Role(qt.fp32, qt.mxfp8_e4m3)  # FP32 values with an operand format
    assert r.optimizer_state.fmt == qt.bf16
    assert "mxfp6_e3m2" in r.describe()
    assert qt.Recipe(weight="bf16") == qt.Recipe(weight=qt.bf16)
    u = qt.Recipe.uniform("fp8_e4m3")
    assert all(getattr(u, k).fmt == qt.fp8_e4m3 for k in
               ("weight", "bias", "activation", "grad", "optimizer_state"))


@pytest.mark.parametrize("kwargs, err, text", [
    (dict(weight="fp9"), ValueError, "Recipe.weight"),
    (dict(weight=("bf16", "mxfp6", "fp8")), ValueError, "pair"),
    (dict(weight=3.5), TypeError, "Recipe.weight"),
    (dict(rules={"fc1": {"wieght": "bf16"}}), ValueError, "unknown role"),
    (dict(rules={"re:(": "bf16"}), ValueError, "regular expression"),
    (dict(rules=["fc1"]), TypeError, "dict"),
    (dict(weight="bf16", optimizer_state="bf16", master_weights=True), ValueError, "master"),
    (dict(loss_scale=-1), ValueError, "loss_scale"),
])
def test_recipe_bad_input(kwargs, err, text):
    with pytest.raises(err, match=text):
        qt.Recipe(**kwargs)


def test_convert_bad_spec():
    with pytest.raises(TypeError, match="nn.Module"):
        qt.convert(torch.zeros(3), "bf16")
    with pytest.raises(TypeError, match="Recipe"):
        qt.convert(MLP(), 3)
    with pytest.raises(ValueError):
        qt.convert(MLP(), "not_a_format")


# ---------------------------------------------------------------------------------------------
# rules and precedence

def test_rule_precedence():
    torch.manual_seed(0)
    m = nn.Sequential()
    m.add_module("enc", nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    m.add_module("head", nn.Linear(4, 2))
    rules = {
        "*.weight": "fp8_e5m2",        # pattern on the tensor name
        "enc.1.weight": "fp8_e4m3",    # exact name beats the earlier pattern
        "re:enc\\.\\d\\.bias": "fp6_e3m2",
        "*bias": "fp4_e2m1",           # later pattern: loses to the regex above for enc.*.bias
        "head": None,                  # exact module name: covers head.weight and head.bias
    }
    r = qt.Recipe(weight="bf16", bias="bf16", activation="bf16", rules=rules)
    qt.convert(m, r)
    assert m.enc[0].weight.fmt == qt.fp8_e5m2
    assert m.enc[1].weight.fmt == qt.fp8_e4m3
    assert m.enc[0].bias.fmt == qt.fp6_e3m2 and m.enc[1].bias.fmt == qt.fp6_e3m2
    # "head" is exact (step 1) and beats the patterns "*.weight" / "*bias" (step 2)
    assert_plain(m.head.weight) and assert_plain(m.head.bias)
    assert plan_of(m.enc[1].weight).rule == "enc.1.weight"
    # module rule None: head computes in full precision (plain inputs and outputs); the model's
    # own output is still rounded (the rule names head, not the model)
    seen = {}
    m.head.register_forward_hook(lambda mod, a, out: seen.update(x=a[0], y=out))
    out = m(torch.randn(3, 4))
    assert_plain(seen["x"], "head input") and assert_plain(seen["y"], "head output")
    assert_in_format(out, qt.bf16, None, "model output")
    y = m.enc(torch.randn(3, 4))
    assert_in_format(y, qt.bf16, None, "enc output")


def test_rule_dict_and_enclosing_module_patterns():
    m = MLP()
    r = qt.Recipe(weight="bf16", bias="bf16", activation="bf16", grad="bf16", optimizer_state="bf16",
                  rules={"fc*": {"weight": ("fp32", "mxfp4"), "grad": "fp8_e5m2"},
                         "re:he.d": {"activation": "fp8_e4m3"}})
    qt.convert(m, r)
    assert m.fc1.weight.fmt == qt.fp32 and m.fc1.weight.mm_fmt == qt.mxfp4_e2m1
    assert m.fc1.bias.fmt == qt.bf16  # the dict gives no bias role: recipe default
    assert plan_of(m.fc1.bias).grad.fmt == qt.fp8_e5m2
    assert plan_of(m.head.weight).grad.fmt == qt.bf16
    # a dict rule without an activation role does not change a module's activations
    m2 = qt.convert(MLP(), qt.Recipe(weight="bf16", rules={"fc1*": {"weight": "fp8_e4m3"}}))
    assert not m2._qt_conversion.module_plans["fc1"].plain
    assert m2._qt_conversion.module_plans["fc1"].activation.full_precision
    seen = {}
    m.head.register_forward_hook(lambda mod, a, out: seen.update(y=out))
    out = m(torch.randn(4, 8))
    assert_in_format(seen["y"], qt.fp8_e4m3, None, "head output")
    assert_in_format(out, qt.bf16, None, "model output")
    out.sum().backward()
    assert_in_format(m.fc1.weight.grad, qt.fp8_e5m2, None, "fc1.weight.grad")
    assert_in_format(m.head.weight.grad, qt.bf16, None, "head.weight.grad")


def test_rule_matching_nothing_lists_near_names():
    m = MLP()
    with pytest.raises(ValueError, match=r"fc3\.weight.*nearest names.*fc1\.weight"):
        qt.convert(m, qt.Recipe(weight="bf16", rules={"fc3.weight": "fp8_e4m3"}), strict=True)
    with pytest.raises(ValueError, match="re:conv"):
        qt.convert(m, qt.Recipe(weight="bf16", rules={"re:conv.*": None}), strict=True)
    # the model is untouched by a failed conversion
    assert all(type(p) is nn.Parameter for p in m.parameters())
    assert not hasattr(m, "_qt_conversion")


def test_one_recipe_serves_models_that_lack_some_names():
    """A recipe with rules for names a model lacks is reusable: one warning
    at the caller's line, with the nearest names, and the rules that match still apply."""
    recipe = qt.Recipe(weight="bf16", activation="bf16",
                       rules={"head.*": "fp8_e4m3", "conv*": None, "fc1.weight": "fp8_e5m2"})
    m = MLP()
    with pytest.warns(UserWarning, match=r"rule 'conv\*' matches no parameter.*nearest names"
                      r".*strict=True") as w:
        qt.convert(m, recipe)
    assert [x.filename for x in w if "matches no" in str(x.message)] == [__file__]
    assert m.head.weight.fmt == qt.fp8_e4m3 and m.fc1.weight.fmt == qt.fp8_e5m2
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.warns(UserWarning, match=r"'head\.\*'.*'conv\*'.*'fc1\.weight'"):
        qt.convert(seq, recipe)
    assert seq[0].weight.fmt == qt.bf16 and seq[2].weight.fmt == qt.bf16
    assert isinstance(seq(torch.randn(3, 4)), qt.QTensor)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every rule matches: no warning
        qt.convert(MLP(), recipe.replace(rules={"head.*": "fp8_e4m3"}))


def test_convert_twice():
    m = MLP()
    qt.convert(m, "bf16")
    n_hooks = len(m.fc1._forward_hooks)
    w = m.fc1.weight
    assert qt.convert(m, "bf16") is m  # same spec: nothing happens
    assert m.fc1.weight is w and len(m.fc1._forward_hooks) == n_hooks
    with pytest.raises(RuntimeError, match="unconvert"):
        qt.convert(m, "fp8_e4m3")
    outer = nn.Sequential(m, nn.Linear(3, 3))
    with pytest.raises(RuntimeError, match="submodule '0' is already converted"):
        qt.convert(outer, "bf16")
    qt.unconvert(m)
    qt.convert(m, "fp8_e4m3")
    assert m.fc1.weight.fmt == qt.fp8_e4m3


def test_integer_buffers_left_alone_said_once():
    sys.modules["qtensor.warn"]._warned.clear()  # "once" per process: start afresh
    m = CNN()
    with pytest.warns(UserWarning, match="num_batches_tracked"):
        qt.convert(m, qt.Recipe(weight="bf16", rules={"bn.num_batches_tracked": "bf16"}))
    assert m.bn.num_batches_tracked.dtype == torch.int64
    assert_plain(m.bn.num_batches_tracked)
    m2 = CNN()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qt.convert(m2, qt.Recipe(weight="bf16", rules={"bn.num_batches_tracked": "bf16"}))


@pytest.mark.parametrize("spec", ["bf16", "fp8_e4m3", qt.recipes.mxfp6, "swalp"],
                         ids=["bf16", "fp8_e4m3", "mxfp6", "swalp"])
def test_no_warning_for_integer_and_bool_buffers(spec):
    """BatchNorm's num_batches_tracked and bool mask buffers are left alone without a warning:
    nothing unexpected happened."""
    sys.modules["qtensor.warn"]._warned.clear()
    m = CNN()
    m.register_buffer("mask", torch.ones(4, 4, dtype=torch.bool).tril())
    m.register_buffer("ids", torch.arange(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qt.convert(m, spec)
    assert m.bn.num_batches_tracked.dtype == torch.int64 and m.mask.dtype == torch.bool
    assert_plain(m.bn.num_batches_tracked) and assert_plain(m.mask) and assert_plain(m.ids)
    assert isinstance(m.bn.running_mean, qt.QTensor)


def test_tiny_parameters_and_block_formats():
    m = nn.Linear(40, 3)  # bias of 3 values: a short last MXFP4 block
    qt.convert(m, qt.Recipe(weight="mxfp4", bias="mxfp4", activation="bf16", grad="bf16"))
    assert_in_format(m.bias, qt.mxfp4_e2m1, None, "bias")
    assert_in_format(m.weight, qt.mxfp4_e2m1, None, "weight")
    out = m(torch.randn(2, 40))
    out.sum().backward()
    assert_in_format(m.bias.grad, qt.bf16, None, "bias.grad")
    # a block axis that a tensor does not have: an error that names the tensor
    bad = qt.BlockFormat(qt.fp4_e2m1, 32, axis=1)
    m2 = nn.Linear(4, 3)
    with pytest.raises(Exception, match="bias"):
        qt.convert(m2, qt.Recipe(weight=bad, bias=bad))
    assert type(m2.weight) is nn.Parameter  # untouched


# ---------------------------------------------------------------------------------------------
# conversion mechanics

def test_existing_references_and_optimizer_created_before():
    torch.manual_seed(0)
    m = MLP()
    w = m.fc1.weight
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.randn(2, 8)).sum().backward()  # a gradient exists before conversion
    qt.convert(m, qt.Recipe(weight="bf16", bias="bf16", grad="bf16"))
    assert m.fc1.weight is w and isinstance(w, qt.QTensor) and isinstance(w, nn.Parameter)
    assert_in_format(w.grad, qt.bf16, None, "existing grad")
    assert opt.param_groups[0]["params"][0] is w
    before = w.dequantize().clone()
    opt.step()
    assert not torch.equal(before, w.dequantize())
    assert_in_format(w, qt.bf16, None, "updated weight")


def test_activations_and_their_gradients():
    m = MLP()
    qt.convert(m, MX_LIKE)
    seen = {}
    m.fc1.register_forward_hook(lambda mod, a, out: seen.setdefault("fc1", out))
    x = torch.randn(4, 8)
    out = m(x)
    assert_in_format(out, BF16, qt.mxfp6_e3m2, "model output")
    h = seen["fc1"]
    assert_in_format(h, BF16, qt.mxfp6_e3m2, "fc1 output")
    h.register_hook(lambda g: seen.setdefault("grad", g))
    out = m(x)
    out.sum().backward()
    assert_in_format(seen["grad"], BF16, qt.mxfp6_e3m2, "gradient of fc1 output")


class _QuantizeGradNet(nn.Module):
    """fc1's output goes through the user's own qt.quantize_grad before fc2."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(24, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x):
        a = self.fc1(x)
        a.register_hook(lambda g: self.seen.setdefault("grad", g))
        return self.fc2(torch.relu(qt.quantize_grad(a, "bf16", mm_fmt="fp8_e5m2")))


@pytest.mark.parametrize("model", ["quantize_grad", "loss_from_dequantize"])
def test_accumulator_reaches_the_backward_contractions(model):
    """Recipe(accumulate=...): a weight gradient whose operands are the model's input (which
    carries no accumulator) and the gradient arriving at its layer is summed by the accumulator,
    also when that gradient went through the user's qt.quantize_grad or came plain from a loss on
    the dequantized output: bit for bit qt.accum.accum_matmul of the rounded operands."""
    torch.manual_seed(0)
    acc = qt.accum.hopper_fp8
    fp8 = (BF16, qt.fp8_e4m3)
    recipe = qt.Recipe(weight=fp8, bias=BF16, activation=fp8, grad=(BF16, qt.fp8_e5m2),
                       accumulate=acc)
    x = torch.randn(512, 24)
    if model == "quantize_grad":
        m = qt.convert(_QuantizeGradNet(), recipe)
        m.seen = {}
        m(x).square().sum().backward()
        g = m.seen["grad"].dequantize()
    else:
        m = qt.convert(nn.Sequential(nn.Linear(24, 16)), recipe)
        g = torch.randn(512, 16)
        (m(x).dequantize() * g).sum().backward()
    gq = qt.quantize(qt.quantize(g, BF16), qt.fp8_e5m2)  # the grad role, then its operand format
    xq = qt.quantize(qt.quantize(x, BF16), qt.fp8_e4m3)
    want = qt.quantize(qt.accum.accum_matmul(gq.t(), xq, acc), BF16)
    w = (m.fc1 if model == "quantize_grad" else m[0]).weight
    assert_in_format(w.grad, BF16, qt.fp8_e5m2, "weight gradient")
    assert_bits_equal(w.grad.dequantize(), want, "weight gradient")
    assert not torch.equal(bits(want), bits(qt.quantize(gq.t() @ xq, BF16)))


def test_inputs_rounded():
    # the root rounds its inputs inside its forward: its first child sees them rounded
    m = nn.Sequential(nn.Linear(4, 2, bias=False))
    qt.convert(m, qt.Recipe(activation="fp8_e4m3"))
    got = {}
    m[0].register_forward_pre_hook(lambda mod, args: got.setdefault("x", args[0]))
    x = torch.tensor([[0.3, 1.1, -2.7, 100.0]])
    m(x)
    assert_in_format(got["x"], qt.fp8_e4m3, None, "input")
    assert torch.equal(got["x"].dequantize(), qt.quantize(x, qt.fp8_e4m3))


def test_unconvert_restores():
    torch.manual_seed(0)
    m = CNN()
    ref = copy.deepcopy(m)
    w = m.conv.weight
    qt.convert(m, qt.Recipe(weight="bf16", bias="bf16", activation="bf16", grad="bf16"))
    m(torch.randn(2, 1, 8, 8)).sum().backward()
    qt.unconvert(m)
    assert m.conv.weight is w
    for (n, p), (_, p0) in zip(m.named_parameters(), ref.named_parameters()):
        assert type(p) is nn.Parameter, n
        assert torch.equal(p.data, qt.quantize(p0.data, qt.bf16)), n
        assert type(p.grad) is torch.Tensor, n
    for n, b in m.named_buffers():
        assert type(b) is torch.Tensor, n
    assert not m.conv._forward_hooks and not m._forward_pre_hooks
    out = m(torch.randn(2, 1, 8, 8))
    assert type(out) is torch.Tensor
    with pytest.raises(RuntimeError, match="not converted"):
        qt.unconvert(m)


def test_state_dict_roundtrip():
    torch.manual_seed(0)
    r = qt.Recipe(weight="fp8_e4m3", bias="bf16", activation="bf16", grad="bf16",
                  rules={"bn.*": "bf16"})
    m = qt.convert(CNN(), r)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    train(m, opt, data_img(), F.cross_entropy, 2)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    fresh = qt.convert(CNN(), r)
    fresh.load_state_dict(sd)
    for (n, a), (_, b) in zip(m.state_dict().items(), fresh.state_dict().items()):
        assert type(a) is type(b), n
        if isinstance(a, qt.QTensor):
            assert a.fmt == b.fmt and torch.equal(bits(a.dequantize()), bits(b.dequantize())), n
        else:
            assert torch.equal(a, b), n
    # a plain FP32 checkpoint loads into a converted model, rounded into each format
    plain = CNN().state_dict()
    fresh.load_state_dict(plain)
    assert_in_format(fresh.conv.weight, qt.fp8_e4m3, None, "loaded weight")
    assert torch.equal(fresh.conv.weight.dequantize(), qt.quantize(plain["conv.weight"], qt.fp8_e4m3))


def test_describe():
    m = qt.convert(CNN(), qt.Recipe(weight=(FP32, "mxfp6"), bias="bf16", activation="bf16",
                                    rules={"fc.weight": "mxfp4"}))
    text = qt.describe(m, print_table=False)
    assert "conv.weight" in text and "4x1x3x3" in text and "mxfp6_e3m2" in text
    assert "fc.weight" in text and "4.25" in text  # MXFP4 bits per value with its scale
    assert "bn.num_batches_tracked" in text and "int64" in text
    assert "vs FP32" in text
    # conv.weight, conv.bias, bn.weight, bn.bias, fc.weight (3 rows x 2 blocks), fc.bias,
    # running stats (the weight's value format, fp32), num_batches_tracked (int64)
    got = 36 * 32 + 4 * 16 + 4 * 32 + 4 * 16 + (192 * 4 + 6 * 8) + 3 * 16 + 8 * 32 + 64
    fp32 = (36 + 4 + 4 + 4 + 192 + 3 + 8) * 32 + 64
    assert f"total: {got:,} bits" in text and f"vs FP32 {fp32:,} bits" in text
    # a short block pays a whole scale: a bias of 3 values in MXFP4 is (3*4 + 8)/3 bits a value
    b = qt.convert(nn.Linear(2, 3), qt.Recipe(weight="bf16", bias="mxfp4"))
    assert "6.667" in qt.describe(b, print_table=False)
    plain_text = qt.describe(CNN(), print_table=False)
    assert "plain float32" in plain_text and "1.000x" in plain_text


# ---------------------------------------------------------------------------------------------
# training: every tensor's format after forward, backward and step

CASES = [
    ("mlp", MLP, data_vec, "sgd"),
    ("cnn_bn", CNN, data_img, "adam"),
    ("resnet", ResNet, data_img, "sgd"),
    ("text", TextModel, data_text, "adamw"),
]


def make_opt(kind, params, lr):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr)


@pytest.mark.parametrize("name, make, data, optname", CASES, ids=[c[0] for c in CASES])
def test_train_every_tensor_in_format(name, make, data, optname):
    torch.manual_seed(0)
    model = make()
    rules = {"*.bias": ("fp32", None)}
    if name == "text":
        rules = {"emb.weight": "bf16", "lstm.*": ("bf16", "mxfp8_e4m3"),
                 "re:enc\\..*bias": "bf16"}
    r = MX_LIKE.replace(rules=rules)
    batches = data()
    opt = make_opt(optname, model.parameters(), 0.05 if optname == "sgd" else 0.01)
    qt.convert(model, r)
    l0 = eval_loss(model, batches[0], F.cross_entropy)
    # no plain value enters or leaves the emulation; attention on the math backend (the fused
    # CPU kernel would multiply without the MXFP operand format: leak_check reports it)
    with qt.leak_check(check_values=True), sdpa_kernel(SDPBackend.MATH):
        losses = train(model, opt, batches, F.cross_entropy, 4)
    overrides = {n: ("fp32", None) for n, _ in model.named_parameters() if n.endswith(".bias")}
    if name == "text":
        overrides = {n: (("bf16", "mxfp8_e4m3") if n.startswith("lstm.") else "bf16")
                     for n, _ in model.named_parameters()
                     if n == "emb.weight" or n.startswith("lstm.")
                     or (n.startswith("enc.") and "bias" in n.rsplit(".", 1)[-1])}
    check_all(model, opt, roles_for(model, r, overrides))
    # floating buffers (BatchNorm running stats) stay QTensors in the weight's value format
    for bname, b in model.named_buffers():
        if b.is_floating_point():
            assert_in_format(b, r.weight.fmt, None, bname)
        else:
            assert_plain(b, bname)
    assert eval_loss(model, batches[0], F.cross_entropy) < l0, (name, l0, losses)


def test_batchnorm_running_stats_stay_in_narrow_format():
    torch.manual_seed(0)
    m = CNN()
    qt.convert(m, qt.Recipe(weight="bf16", bias="bf16", activation="bf16", grad="bf16",
                            rules={"bn.running_*": "fp8_e4m3"}))
    before = m.bn.running_mean.dequantize().clone()
    m.train()
    for _ in range(2):
        m(data_img()[0][0])
    assert_in_format(m.bn.running_mean, qt.fp8_e4m3, None, "running_mean")
    assert_in_format(m.bn.running_var, qt.fp8_e4m3, None, "running_var")
    assert not torch.equal(before, m.bn.running_mean.dequantize())
    assert int(m.bn.num_batches_tracked) == 2


def test_mixed_formats_per_parameter():
    torch.manual_seed(0)
    m = MLP()
    r = qt.Recipe(weight="bf16", bias="bf16", activation="bf16", grad="bf16", optimizer_state="bf16",
                  rules={"fc1.weight": "fp8_e4m3", "fc2.*": ("fp32", "mxfp4"), "head.bias": None})
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    qt.convert(m, r)
    train(m, opt, data_vec(), F.cross_entropy, 2)
    check_all(m, opt, roles_for(m, r, {"fc1.weight": "fp8_e4m3", "fc2.weight": ("fp32", "mxfp4"),
                                       "fc2.bias": ("fp32", "mxfp4"), "head.bias": None}))
    assert "head.bias" not in {n for n, p in m.named_parameters() if isinstance(p, qt.QTensor)}
    assert not opt.state[m.head.bias] or all(
        not isinstance(v, qt.QTensor) for v in opt.state[m.head.bias].values())


# ---------------------------------------------------------------------------------------------
# training support

def test_stochastic_rounding_on_update():
    # updates of a quarter quantum: lost with nearest, kept in expectation with stochastic
    q = 2.0 ** -6
    for rounding, expect_change in (("nearest", False), ("stochastic", True)):
        torch.manual_seed(0)
        p = nn.Linear(1, 4096, bias=False)
        fmt = qt.FixedFormat(8, 6, rounding=rounding)
        with torch.no_grad():
            p.weight.fill_(0.5)
        qt.convert(p, qt.Recipe(weight=fmt))
        opt = torch.optim.SGD(p.parameters(), lr=1.0)
        for _ in range(8):
            p.weight.grad = torch.full_like(p.weight.dequantize(), -q / 4)
            opt.step()
        w = p.weight.dequantize()
        assert_in_format(p.weight, fmt, None, "weight")
        if expect_change:
            assert abs(float(w.mean().detach()) - (0.5 + 2 * q)) < 0.1 * q  # unbiased: 8 * q/4
        else:
            assert torch.all(w == 0.5)


def test_master_weights():
    torch.manual_seed(0)
    m = MLP()
    r = qt.Recipe(weight="fp8_e4m3", bias="bf16", activation="bf16", grad="bf16",
                  master_weights=True)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    qt.convert(m, r)
    w0 = m.fc1.weight.dequantize().clone()
    l0 = eval_loss(m, data_vec()[0], F.cross_entropy)
    train(m, opt, data_vec(), F.cross_entropy, 4)
    l1 = eval_loss(m, data_vec()[0], F.cross_entropy)
    master = qt.master_weight(opt, m.fc1.weight)
    assert type(master) is torch.Tensor and master.dtype == torch.float32
    # the model sees the master rounded; the master holds updates smaller than fp8's spacing
    assert torch.equal(m.fc1.weight.dequantize(), qt.quantize(master, qt.fp8_e4m3))
    assert not torch.equal(master, m.fc1.weight.dequantize())
    assert not torch.equal(master, w0)
    assert opt.param_groups[0]["params"][0] is m.fc1.weight
    assert_in_format(m.fc1.weight, qt.fp8_e4m3, None, "weight")
    assert_in_format(m.fc1.weight.grad, qt.bf16, None, "grad")
    assert set(opt.state[m.fc1.weight]) == {"step", "exp_avg", "exp_avg_sq", "qt_master"}
    assert type(opt.state[m.fc1.weight]["exp_avg"]) is torch.Tensor  # FP32 optimizer
    # the optimizer's state_dict carries the masters; reloading resumes identically
    sd = copy.deepcopy(opt.state_dict())
    m2 = qt.convert(copy.deepcopy(m), r)
    opt2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    opt2.load_state_dict(sd)
    train(m, opt, data_vec(), F.cross_entropy, 1)
    train(m2, opt2, data_vec(), F.cross_entropy, 1)
    assert torch.equal(qt.master_weight(opt, m.fc1.weight), qt.master_weight(opt2, m2.fc1.weight))
    assert l1 < l0


def test_loss_scaler_dynamic_skips_overflow_and_unscales():
    torch.manual_seed(0)
    m = nn.Linear(4, 1, bias=False)
    qt.convert(m, qt.Recipe(weight="bf16", grad="bf16", activation="bf16"))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    scaler = qt.LossScaler(init_scale=2.0 ** 8, dynamic=True, growth_interval=2)
    # reference gradient without scaling
    m(x).sum().backward()
    g_ref = m.weight.grad.dequantize().clone()
    opt.zero_grad()
    w0 = m.weight.dequantize().clone()
    scaler.scale(m(x).sum()).backward()
    scaler.unscale_(opt)
    assert torch.equal(m.weight.grad.dequantize(), g_ref)  # power-of-two scale: exact
    assert_in_format(m.weight.grad, qt.bf16, None, "unscaled grad")
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(m.weight.dequantize(), w0)
    # an Inf gradient: step skipped, scale halved
    opt.zero_grad()
    scaler.scale(m(x).sum() * float("inf")).backward()
    w1 = m.weight.dequantize().clone()
    assert scaler.step(opt) is None
    scaler.update()
    assert torch.equal(m.weight.dequantize(), w1) and scaler.get_scale() == 2.0 ** 7
    assert scaler.skipped_steps == 1
    for _ in range(2):  # growth after growth_interval clean steps
        opt.zero_grad()
        scaler.scale(m(x).sum()).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 2.0 ** 8


def test_loss_scaler_static_and_saturation():
    s = qt.LossScaler(1024.0, dynamic=False)
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.tensor([float("nan"), 1.0])
    assert s.step(opt) is None
    s.update()
    assert s.get_scale() == 1024.0 and torch.equal(p.data, torch.zeros(2))
    # a saturating gradient format never overflows to Inf: detect_saturation treats max as overflow
    q = nn.Linear(2, 1, bias=False)
    qt.convert(q, qt.Recipe(weight="bf16", grad="fp8_e4m3"))
    opt = torch.optim.SGD(q.parameters(), lr=1.0)
    s2 = qt.LossScaler(2.0 ** 20, detect_saturation=True)
    s2.scale(q(torch.ones(1, 2)).sum()).backward()
    assert float(q.weight.grad.dequantize().abs().max()) == 448.0
    assert s2.step(opt) is None
    s2.update()
    assert s2.get_scale() == 2.0 ** 19
    assert qt.LossScaler.from_recipe(qt.Recipe(loss_scale="dynamic")).dynamic
    assert qt.LossScaler.from_recipe(qt.Recipe(loss_scale=128)).get_scale() == 128.0
    with pytest.raises(ValueError):
        qt.LossScaler(0)


# ---------------------------------------------------------------------------------------------
# published recipes

def test_recipes_documented():
    text = qt.recipes.describe(print_table=False)
    for name in ("mxfp6", "mxfp4_weights", "mx_all_mxfp8", "mx_all_mxfp6", "mx_all_mxfp4",
                 "mxint8_inference", "fp16", "block8", "swalp", "wage"):
        r = getattr(qt.recipes, name)
        assert isinstance(r, qt.Recipe) and r.source, name
        assert name in text
    m = qt.recipes
    assert m.mxfp6.weight == qt.Role(FP32, qt.mxfp6_e3m2) and m.mxfp6.master_weights
    assert m.mxfp6.activation == qt.Role(BF16, qt.mxfp6_e3m2) == m.mxfp6.grad
    assert m.mxfp4_weights.weight.mm_fmt == qt.mxfp4_e2m1
    assert m.mxfp4_weights.activation.mm_fmt == qt.mxfp6_e3m2
    assert m.mx_all(qt.mxint8).weight.fmt == qt.mxint8
    # QPyTorch's block floating point grid: block max 100 with wl=4 rounds to 96 (as in QPyTorch);
    # with wl=8 (block8): step 2^(6+2-8) = 1, magnitudes up to 127
    b8 = m.block8.weight.fmt
    x = torch.tensor([100.0, 0.3, -37.4, 1000.0])
    assert qt.quantize(x, b8).tolist() == [96.0, 0.0, -40.0, 1000.0]
    b4 = b8.replace(elem=qt.FixedFormat(4, 2, symmetric=True))
    assert qt.quantize(torch.tensor([100.0, 3.0]), b4).tolist() == [96.0, 0.0]
    assert m.fp16.weight.fmt.max == 131008.0
    assert m.wage.weight == qt.Role(qt.FixedFormat(8, 7, symmetric=True, rounding="stochastic"),
                                    qt.FixedFormat(2, 1, symmetric=True))
    assert qt.quantize(torch.tensor([0.3, -0.2, 0.1, 0.9]), m.wage.weight.mm_fmt).tolist() == \
        [0.5, 0.0, 0.0, 0.5]  # ternary {-0.5, 0, 0.5}
    assert m.swalp.weight.fmt.rounding == "stochastic"
    for r in m.PRESETS_BY_NAME.values():  # formats survive str() (QTensor serialization)
        for role in ("weight", "bias", "activation", "grad", "optimizer_state"):
            for f in (getattr(r, role).fmt, getattr(r, role).mm_fmt):
                assert f is None or qt.format(str(f)) == f, (r.name, role)


@pytest.mark.parametrize("name", ["mxfp6", "mxfp4_weights", "mx_all_mxfp6", "fp16", "block8",
                                  "swalp", "wage"])
def test_recipe_trains(name):
    torch.manual_seed(0)
    r = getattr(qt.recipes, name)
    model = CNN() if name in ("block8", "swalp") else MLP()
    batches = data_img() if isinstance(model, CNN) else data_vec()
    # narrow weight formats with nearest rounding lose small updates: larger steps there
    lr = 0.5 if name in ("wage", "mx_all_mxfp6") else 0.05
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    qt.convert(model, r)
    l0 = eval_loss(model, batches[0], F.cross_entropy)
    train(model, opt, batches, F.cross_entropy, 4)
    check_all(model, opt if not r.master_weights else None, roles_for(model, r))
    if r.master_weights:
        for p in model.parameters():
            assert type(qt.master_weight(opt, p)) is torch.Tensor
    assert eval_loss(model, batches[0], F.cross_entropy) < l0 or name == "wage"


def test_mxint8_inference():
    torch.manual_seed(0)
    m = MLP()
    x = torch.randn(4, 8)
    ref = m(x)  # a live graph holds the weights: they cannot be swapped in place
    with pytest.warns(UserWarning, match="replaced by a new Parameter"):
        qt.convert(m, qt.recipes.mxint8_inference)
    assert all(isinstance(p, qt.QTensor) for p in m.parameters())
    with torch.no_grad():
        out = m(x)
    assert_in_format(out, FP32, qt.mxint8, "output")
    assert (out.dequantize() - ref).abs().max() < 0.05


def test_adam_state_created_in_its_format():
    # Adam's moments live in the optimizer_state format from the first step on: with fp8
    # weights and bf16 state, exp_avg after one step is bf16((1-beta1) * g), not a bf16 copy of
    # an fp8 rounding of it
    torch.manual_seed(0)
    m = nn.Linear(16, 8, bias=False)
    qt.convert(m, qt.Recipe(weight="fp8_e4m3", grad="bf16", optimizer_state="bf16"))
    opt = torch.optim.Adam(m.parameters(), lr=1e-3, betas=(0.9, 0.999))
    m(torch.randn(4, 16)).sum().backward()
    g = m.weight.grad.dequantize().clone()
    opt.step()
    st = opt.state[m.weight]
    assert_in_format(st["exp_avg"], qt.bf16, None, "exp_avg")
    want = qt.quantize(torch.lerp(torch.zeros_like(g), g, 0.1), qt.bf16)
    assert torch.equal(bits(st["exp_avg"].dequantize()), bits(want))
    assert type(st["step"]) is torch.Tensor and float(st["step"]) == 1.0
    # None: full precision state, FP32 QTensors, and no leak reported
    m2 = nn.Linear(4, 2)
    qt.convert(m2, qt.Recipe(weight="bf16", bias="bf16", activation="bf16", grad="bf16"))
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        with qt.leak_check():
            m2(torch.randn(3, 4)).sum().backward()
            opt2.step()
    assert_in_format(opt2.state[m2.weight]["momentum_buffer"], FP32, None, "momentum")
    # SGD momentum is created in its format too: after one step it is fp8(grad), not the grad
    m3 = nn.Linear(4, 2, bias=False)
    qt.convert(m3, qt.Recipe(weight="bf16", activation="bf16", grad="bf16",
                             optimizer_state="fp8_e4m3"))
    opt3 = torch.optim.SGD(m3.parameters(), lr=0.1, momentum=0.9)
    m3(torch.randn(3, 4)).sum().backward()
    w0, g = m3.weight.dequantize().clone(), m3.weight.grad.dequantize().clone()
    opt3.step()
    buf = opt3.state[m3.weight]["momentum_buffer"]
    assert_in_format(buf, qt.fp8_e4m3, None, "momentum")
    assert torch.equal(buf.dequantize(), qt.quantize(g, qt.fp8_e4m3))
    assert torch.equal(m3.weight.dequantize(),
                       qt.quantize(w0 - 0.1 * qt.quantize(g, qt.fp8_e4m3), qt.bf16))
    assert_in_format(m2.weight, qt.bf16, None, "weight")


def test_whole_model_pickle_and_deepcopy_keep_conversion():
    torch.manual_seed(0)
    r = qt.Recipe(weight="fp8_e4m3", bias="bf16", activation="bf16", grad="bf16",
                  optimizer_state="bf16")
    m = qt.convert(CNN(), r)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    for copy_ in (torch.load(buf, weights_only=False), copy.deepcopy(m)):
        opt = torch.optim.SGD(copy_.parameters(), lr=0.05, momentum=0.9)
        train(copy_, opt, data_img(), F.cross_entropy, 2)
        check_all(copy_, opt, roles_for(copy_, r))
        assert_in_format(copy_.bn.running_mean, qt.fp8_e4m3, None, "running_mean")
        qt.unconvert(copy_)
        assert all(type(p) is nn.Parameter for p in copy_.parameters())
        assert type(copy_(data_img()[0][0])) is torch.Tensor  # no hooks left


def test_whole_model_pickled_by_the_earlier_module_layout_loads_and_runs_with_its_bits():
    # data/converted_model_before_split.pt: torch.save(model) of a converted model by the flat
    # layout; its pickle names qtensor.convert.{ConvertedForward, _InputHook, _OutputHook,
    # _BufferHook, _GradHook, _Conversion, _NoDtypeCast, _reattach_hook}, qtensor.plans.*,
    # qtensor.gemm_forward.GemmForward, qtensor.formats.FloatFormat
    # (data/make_converted_model_before_split.py)
    import pathlib
    path = pathlib.Path(__file__).parent / "data" / "converted_model_before_split.pt"
    m = torch.load(path, weights_only=False)
    saved = torch.load(str(path) + ".expected", weights_only=True)
    want = saved["want"]
    m.train()
    out = m(saved["x"])
    assert isinstance(out, torch.Tensor)  # the plain-rule last layer
    out.sum().backward()
    assert_bits_equal(qt.nn.plans._plain(out), want["out"])
    for n, p in m.named_parameters():
        assert_bits_equal(qt.nn.plans._plain(p.grad), want["grads"][n], n)
    assert_bits_equal(qt.nn.plans._plain(m[1].running_mean), want["running_mean"])
    qt.unconvert(m)
    assert all(type(p) is nn.Parameter for p in m.parameters())


def test_grad_rounding_without_activation_format():
    # activation None, grad set: values pass unchanged (QTensor or plain), gradients are rounded
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    qt.convert(m, qt.Recipe(weight="bf16", bias="bf16", grad="fp8_e5m2"))
    seen = {}
    m[0].register_forward_hook(lambda mod, a, out: seen.update(h=out))
    x = torch.randn(2, 4)
    m(x).sum().backward()
    h = seen["h"]
    assert isinstance(h, qt.QTensor) and h.fmt == qt.bf16  # dispatch's format, not rounded again
    assert_in_format(m[0].weight.grad, qt.fp8_e5m2, None, "weight grad")


def test_tied_and_frozen_parameters():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied
    m = nn.Sequential(emb, nn.LayerNorm(4), head)
    m[1].weight.requires_grad_(False)  # frozen
    qt.convert(m, qt.Recipe(weight="bf16", bias="bf16", activation="bf16", grad="bf16"))
    assert m[0].weight is m[2].weight and isinstance(m[0].weight, qt.QTensor)
    assert_in_format(m[1].weight, qt.bf16, None, "frozen weight")
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    m(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    assert_in_format(m[0].weight.grad, qt.bf16, None, "tied grad")
    assert m[1].weight.grad is None
    qt.unconvert(m)
    assert m[0].weight is m[2].weight and type(m[0].weight) is nn.Parameter


def test_unconvert_restores_dtype():
    m = nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2)).to(torch.bfloat16)
    qt.convert(m, "fp8_e4m3")
    assert m[0].weight.fmt == qt.fp8_e4m3
    qt.unconvert(m)
    assert all(type(t) in (nn.Parameter, torch.Tensor) and t.dtype == torch.bfloat16
               for t in list(m.parameters()) + [m[1].running_mean])


def test_recipe_as_rule():
    m = MLP()
    inner = qt.Recipe(weight="fp8_e4m3", bias="bf16", activation="fp8_e5m2", grad="fp8_e5m2")
    qt.convert(m, qt.Recipe(weight="bf16", bias="bf16", activation="bf16", grad="bf16",
                            rules={"head": inner}))
    assert m.head.weight.fmt == qt.fp8_e4m3 and m.fc1.weight.fmt == qt.bf16
    seen = {}
    m.head.register_forward_hook(lambda mod, a, out: seen.update(y=out))
    m(torch.randn(2, 8)).sum().backward()
    assert_in_format(seen["y"], qt.fp8_e5m2, None, "head output")
    assert_in_format(m.head.weight.grad, qt.fp8_e5m2, None, "head grad")
    assert_in_format(m.fc1.weight.grad, qt.bf16, None, "fc1 grad")


def test_grad_role_none_gives_fp32_gradients_without_operand_format():
    # A recipe that rounds activations for contractions but leaves gradients in full precision:
    # the gradients must not inherit the activation's operand format (fixed8.7 would flush these
    # 0.001-sized gradients to zero inside the backward matmul).
    m = nn.Linear(8, 4)
    qt.convert(m, qt.Recipe(weight=qt.fp32,
                            activation=(qt.fp32, qt.format("fixed8.7(symmetric=True)"))))
    x = torch.rand(4, 8) * 2
    (m(x) * 0.001).sum().backward()
    g = m.weight.grad
    assert isinstance(g, qt.QTensor) and g.fmt == qt.fp32 and g.mm_fmt is None
    assert g.dequantize().abs().sum() > 0


def test_forward_instance_attribute_refused_before_any_change():
    """A model whose forward is an instance attribute is refused, and left as it was (it was
    half-converted: parameters swapped, no conversion record, so unconvert could not undo it)."""
    m = nn.Linear(4, 2)
    m.forward = lambda x: nn.functional.linear(x, m.weight, m.bias)
    w = m.weight
    with pytest.raises(ValueError, match="forward is an instance attribute"):
        qt.convert(m, qt.bf16)
    assert m.weight is w and type(m.weight) is nn.Parameter
    assert getattr(m, "_qt_conversion", None) is None


def test_describe_shows_module_formats_and_the_rules_that_chose_them():
    recipe = qt.Recipe(weight=("bf16", "mxfp6_e3m2"), activation="bf16", grad="fp8_e5m2",
                       rules={"bn": {"activation": "fp16", "grad": "bf16"}, "fc.bias": "fp16",
                              "re:conv.*": None})
    text = qt.describe(qt.convert(CNN(), recipe), print_table=False)
    rows = {line.split()[0]: line for line in text.splitlines() if line.strip()}
    assert rows["conv.weight"].endswith("rule 're:conv.*'")
    assert rows["fc.bias"].endswith("rule 'fc.bias'")
    assert rows["fc.weight"].endswith("default (weight)")
    assert rows["bn.weight"].endswith("rule 'bn' (grad); default (weight, optimizer_state)")
    assert rows["bn.running_mean"].endswith("rule 'bn' sets no role of it; default (weight)")
    assert rows["bn.num_batches_tracked"].endswith("not floating: left alone")
    # the module table: activation and gradient formats per module, and what chose them
    assert rows["(model:"].split()[-4:] == ["bf16", "fp8_e5m2", "default", "(activation)"]
    assert rows["conv"].split()[1:] == ["Conv2d", "plain", "(kept", "full", "precision)",
                                        "plain", "rule", "'re:conv.*'"]
    assert rows["bn"].split()[1:] == ["BatchNorm2d", "fp16", "bf16", "rule", "'bn'"]
    assert rows["fc"].split()[1:] == ["Linear", "bf16", "fp8_e5m2", "default", "(activation)"]
    assert "chosen by" not in qt.describe(CNN(), print_table=False)  # plain: no plans


# ---------------------------------------------------------------------------------------------
# formats that cannot hold signed values

@pytest.mark.parametrize("spec, range_text", [
    ("e8m0", r"\[2\^-127, 2\^127\]"),
    (qt.e8m0, r"\[2\^-127, 2\^127\]"),
    (qt.FloatFormat(5, 0, subnormals=False, specials="fn", signed=False), r"\[2\^-15, 2\^15\]"),
    (qt.FixedFormat(8, 4, signed=False), r"\[0, 15\.9375\]"),
    (qt.FixedFormat(8, 4, signed=False, saturate=False), r"\[0, 15\.9375\].*wrap"),
    (qt.BlockFormat(qt.FixedFormat(6, 4, signed=False), 5), r"elements in \[0, 3\.9375\]"),
    (("bf16", "e8m0"), r"e8m0.*\[2\^-127, 2\^127\]"),
    (lambda: qt.Recipe(weight="bf16", activation="bf16",
                       grad=qt.FixedFormat(8, 7, signed=False)), r"Recipe\.grad.*\[0, 1\.99219\]"),
    (lambda: qt.Recipe(weight="bf16", optimizer_state="e8m0"), r"Recipe\.optimizer_state"),
    (dict(weight="bf16", rules={"fc1.bias": "e8m0"}), r"rule 'fc1\.bias'"),
    (dict(weight="bf16", rules={"fc1": {"activation": ("bf16", "e8m0")}}),
     r"rule 'fc1', role activation.*e8m0"),
], ids=str)
def test_unsigned_formats_refused_with_their_range(spec, range_text):
    """An unsigned format (E8M0, the MX scale; unsigned fixed point) cannot hold a model's signed
    weights, activations and gradients: qt.convert refuses it, naming the format's range, and
    leaves the model untouched (before: e8m0 made every negative weight and every output NaN)."""
    m = MLP()
    with pytest.raises(qt.FormatError, match="cannot hold a model's signed values") as e:
        qt.convert(m, spec() if callable(spec) and not isinstance(spec, qt.Format) else spec)
    assert re.search(range_text, str(e.value)), str(e.value)
    assert all(type(p) is nn.Parameter for p in m.parameters())
    assert getattr(m, "_qt_conversion", None) is None
    # the same formats still work where they belong: as block scales, and in qt.quantize
    assert qt.convert(MLP(), qt.mxfp8_e4m3).fc1.weight.fmt == qt.mxfp8_e4m3
    assert float(qt.quantize(torch.tensor([4.0]), "e8m0")) == 4.0


# ---------------------------------------------------------------------------------------------
# tied weights named by any of their names

class TinyLM(nn.Module):
    """GPT-2 style: lm_head.weight is the token embedding's weight (tied)."""

    def __init__(self, vocab=11, d=8):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(vocab, d)
        self.transformer.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, ids):
        return self.lm_head(self.transformer.ln_f(self.transformer.wte(ids)))


@pytest.mark.parametrize("rule", ["lm_head", "lm_head.weight", "lm_*", "re:lm_head\\..*",
                                  "transformer.wte", "transformer.wte.weight"])
def test_a_rule_naming_a_tied_weight_by_any_name_applies(rule):
    torch.manual_seed(0)
    m = TinyLM()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "matches no parameter", no disagreement
        qt.convert(m, qt.Recipe(weight="fp8_e4m3", activation="bf16", rules={rule: qt.bf16}))
    assert m.lm_head.weight is m.transformer.wte.weight
    assert_in_format(m.lm_head.weight, qt.bf16, None, "tied weight")
    assert m.transformer.ln_f.weight.fmt == qt.fp8_e4m3  # the default for the others
    assert plan_of(m.lm_head.weight).rule == rule
    m(torch.tensor([[1, 2, 3]])).sum().backward()
    assert isinstance(m.lm_head.weight.grad, qt.QTensor)


def test_tied_weight_rules_that_disagree_most_specific_wins_with_a_warning():
    m = TinyLM()
    rules = {"transformer.*": qt.fp8_e5m2, "lm_head.weight": qt.bf16}
    with pytest.warns(UserWarning, match=r"tied to lm_head\.weight.*'lm_head\.weight'.*applies, "
                                         r"not 'transformer\.\*'"):
        qt.convert(m, qt.Recipe(weight="fp8_e4m3", rules=rules))
    assert m.lm_head.weight.fmt == qt.bf16  # an exact name beats a pattern
    assert m.transformer.ln_f.weight.fmt == qt.fp8_e5m2
    # equally specific (two exact module names): the earlier rule wins
    m2 = TinyLM()
    with pytest.warns(UserWarning, match="'transformer.wte' .*applies"):
        qt.convert(m2, qt.Recipe(weight="fp8_e4m3",
                                 rules={"transformer.wte": qt.fp16, "lm_head": qt.bf16}))
    assert m2.lm_head.weight.fmt == qt.fp16


def test_describe_shows_the_aliases_of_tied_weights():
    m = qt.convert(TinyLM(), qt.Recipe(weight="bf16"))
    text = qt.describe(m, print_table=False)
    row = [line for line in text.splitlines() if "transformer.wte.weight" in line]
    assert len(row) == 1 and "(= lm_head.weight)" in row[0], text
    assert "11x8" in row[0] and text.count("11x8") == 1  # counted once
    plain = qt.describe(TinyLM(), print_table=False)
    assert "transformer.wte.weight (= lm_head.weight)" in plain


# ---------------------------------------------------------------------------------------------
# a mask's -inf in a block format makes its whole block NaN: warned

class CausalAttention(nn.Module):
    """nanoGPT-style attention: scores.masked_fill(~causal, -inf), softmax."""

    def __init__(self, d=32, inplace=False):
        super().__init__()
        self.qkv, self.proj, self.inplace = nn.Linear(d, 3 * d), nn.Linear(d, d), inplace
        self.register_buffer("causal", torch.ones(16, 16, dtype=torch.bool).tril())

    def forward(self, x):
        t = x.shape[1]
        q, k, v = self.qkv(x).chunk(3, -1)
        att = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        if self.inplace:
            att.masked_fill_(~self.causal[:t, :t], float("-inf"))
        else:
            att = att.masked_fill(~self.causal[:t, :t], float("-inf"))
        return self.proj(F.softmax(att, -1) @ v)


class TinyGPT(nn.Module):
    def __init__(self, inplace=False):
        super().__init__()
        self.h = nn.ModuleList([CausalAttention(inplace=inplace), CausalAttention()])
        self.ln_f = nn.LayerNorm(32)

    def forward(self, x):
        for block in self.h:
            x = x + block(x)
        return self.ln_f(x)


@pytest.fixture
def block_nan_warning_armed():
    specials = importlib.import_module("qtensor.tensor.block_specials")
    specials._reset()  # said once per model and op (per op outside a model): arm it for this test
    yield
    specials._reset()


def _nan_warnings(w):
    return [x for x in w if "turned finite values into NaN" in str(x.message)]


@pytest.mark.parametrize("spec", [qt.mxfp8_e4m3, "mxfp4_e2m1", qt.recipes.mx_all_mxfp8],
                         ids=["mxfp8_e4m3", "mxfp4_e2m1", "mx_all_mxfp8"])
@pytest.mark.parametrize("inplace", [False, True], ids=["masked_fill", "masked_fill_"])
def test_mask_inf_in_a_block_format_warns_once_naming_op_and_module(
        spec, inplace, block_nan_warning_armed):
    torch.manual_seed(0)
    m = qt.convert(TinyGPT(inplace), spec)
    x = torch.randn(2, 10, 32)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        y = m(x)
        m(x)  # once per process, not per call
    assert torch.isnan(y.dequantize()).all()  # the MX rule: every block with a -inf is NaN
    said = _nan_warnings(w)
    assert len(said) == 1, [str(x.message) for x in w]
    text = str(said[0].message)
    op = "aten.masked_fill_.Scalar" if inplace else "aten.masked_fill.Scalar"
    assert f"{op} in module 'h.0' (CausalAttention)" in text, text
    assert "qt.recipes.mxfp6" in text and "docs/formats.md" in text
    assert said[0].filename == __file__  # at the user's line


@pytest.mark.parametrize("spec", [qt.mxfp8_e4m3, qt.recipes.mx_all_mxfp8],
                         ids=["mxfp8_e4m3", "mx_all_mxfp8"])
def test_mask_inf_warns_for_each_model(spec, block_nan_warning_armed):
    """A second model (a new seed, a sweep's next run) that goes NaN is said too: once per model
    and op, not once per process. Before: the first model's warning silenced every later one."""
    x = torch.randn(2, 10, 32)
    for seed in (0, 1):
        torch.manual_seed(seed)
        m = qt.convert(TinyGPT(), spec)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            y = m(x)
            m(x)
            m(x).dequantize().sum().backward()
        assert torch.isnan(y.dequantize()).all()
        said = _nan_warnings(w)
        assert len(said) == 1, (seed, [str(x.message)[:90] for x in said])
        assert "aten.masked_fill.Scalar in module 'h.0' (CausalAttention)" in str(said[0].message)
        assert said[0].filename == __file__


def test_mask_inf_given_as_model_input_warns(block_nan_warning_armed):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    m = qt.convert(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), qt.mxfp8_e4m3)
    mask = nn.Transformer.generate_square_subsequent_mask(10)
    with pytest.warns(UserWarning, match=r"input of the model: rounding to the block format "
                                         r"mxfp8_e4m3 turned finite values into NaN") as w:
        m(torch.randn(2, 10, 32), mask=mask)
    assert len(_nan_warnings(w)) == 1 and _nan_warnings(w)[0].filename == __file__


@pytest.mark.parametrize("spec", [qt.recipes.mxfp6, qt.recipes.mxfp4_weights, qt.fp8_e4m3,
                                  qt.bf16], ids=["mxfp6", "mxfp4_weights", "fp8_e4m3", "bf16"])
def test_recipes_that_keep_vector_ops_out_of_blocks_give_no_nan_and_no_warning(
        spec, block_nan_warning_armed):
    torch.manual_seed(0)
    m = qt.convert(TinyGPT(), spec)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = m(torch.randn(2, 10, 32))
        y.sum().backward()
    assert torch.isfinite(y.dequantize()).all()


def test_block_format_without_inf_or_with_nan_kept_gives_no_warning(block_nan_warning_armed):
    q = qt.as_qtensor(torch.randn(4, 64), qt.mxfp8_e4m3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (q * 2).exp()  # finite: no warning
        nan_block = torch.full((1, 32), float("nan"))  # a whole block NaN already: nothing lost
        qt.as_qtensor(nan_block, qt.mxfp8_e4m3) + 1


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("which", ["encoder", "transformer"])
def test_transformer_inference_with_padding_mask(which):
    """eval() + no_grad + src_key_padding_mask is nn.TransformerEncoder's nested-tensor fast
    path; a converted encoder crashed there ("NestedTensorImpl doesn't support sizes"). It runs
    the emulated path: the same bits as the same model with autograd on (where torch takes no
    fast path), the unpadded rows close to FP32. (nn.Transformer's decoder self-attention still
    takes nn.MultiheadAttention's own fused fast path under no_grad, one op rounded once, as
    docs/leak_check.md says: close to the emulated result there, not the same bits.)"""
    torch.manual_seed(0)
    kw = dict(nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    if which == "encoder":
        model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, **kw), 2)
    else:
        model = nn.Transformer(16, num_encoder_layers=2, num_decoder_layers=1, **kw)
    model.eval()
    x, tgt = torch.randn(3, 5, 16), torch.randn(3, 4, 16)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[0, 3:] = mask[1, 4:] = True

    def run():
        if which == "encoder":
            return model(x, src_key_padding_mask=mask)
        return model(x, tgt, src_key_padding_mask=mask, memory_key_padding_mask=mask)

    with torch.no_grad():
        ref = run()
    qt.convert(model, qt.bf16)
    with torch.no_grad():
        out = run()
    emulated = run()  # parameters require grad: no fast path anywhere
    assert isinstance(out, qt.QTensor) and out.fmt == qt.bf16
    if which == "encoder":
        assert_bits_equal(out.dequantize(), emulated.dequantize().detach())
    else:
        torch.testing.assert_close(out.dequantize(), emulated.dequantize().detach(),
                                   atol=0.05, rtol=0.02)
    keep = ~mask if which == "encoder" else slice(None)
    torch.testing.assert_close(out.dequantize()[keep], ref[keep], atol=0.1, rtol=0.05)
    encoders = [m for m in model.modules() if isinstance(m, nn.TransformerEncoder)]
    qt.unconvert(model)
    assert all(m.use_nested_tensor for m in encoders)  # the fast path is back


def test_nested_tensors_refused_clearly():
    n = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(1, 3)])
    with pytest.raises(TypeError, match="nested tensor"):
        qt.as_qtensor(n, qt.bf16)
    q = qt.as_qtensor(torch.randn(2, 3, 4), qt.bf16)
    with pytest.raises(NotImplementedError, match="nested tensor"):
        torch._nested_tensor_from_mask(q, torch.ones(2, 3, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------
# Operand roundings of weights, kept while the weight is unchanged (qtensor.tensor.dispatch)

def _mx_mlp():
    torch.manual_seed(0)
    return qt.convert(nn.Sequential(nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 32)),
                      qt.recipes.mxfp6)


def _count_roundings(monkeypatch):
    from qtensor.tensor import dispatch
    calls = [0]
    quantize = dispatch.quantize

    def counted(*a, **kw):
        calls[0] += 1
        return quantize(*a, **kw)
    monkeypatch.setattr(dispatch, "quantize", counted)
    return calls


def test_cached_weight_operand_roundings_give_the_bits_of_rounding_per_use(monkeypatch):
    """Training with microbatches (each weight's operand rounding reused by the second one),
    AdamW on FP32 masters, and evaluation after each step: the same bits with the cache as
    with rounding per use, and fewer roundings."""
    from qtensor.tensor import dispatch
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(3, 2, 8, 64, generator=g), torch.randint(0, 32, (3, 2, 8), generator=g)

    def train(cache):
        monkeypatch.setattr(dispatch, "CACHE_OPERANDS", cache)
        calls = _count_roundings(monkeypatch)
        m = _mx_mlp()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        out = []
        for step in range(3):
            for micro in range(2):
                loss = F.cross_entropy(m(x[step, micro]).dequantize(), y[step, micro])
                loss.backward()
                out.append(loss.detach())
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                out.append(m(x[step, 0]).dequantize())
        monkeypatch.undo()
        return out + [p.detach().dequantize() for p in m.parameters()], calls[0]

    cached, n_cached = train(True)
    per_use, n_per_use = train(False)
    for i, (a, b) in enumerate(zip(cached, per_use)):
        assert_bits_equal(a, b, f"output {i}")
    assert n_cached < n_per_use


def test_weight_operand_cache_follows_every_change_of_the_weight(monkeypatch):
    """An in-place update of the weight (through the QTensor, or of its payload), ``w.data =``
    and an optimizer step each give the next forward the new weight's rounding."""
    from qtensor.tensor import dispatch
    monkeypatch.setattr(dispatch, "CACHE_OPERANDS", True)  # (off by default)
    m = _mx_mlp()
    w = m[0].weight
    x = torch.randn(8, 64)

    def check(what):  # the forward of m against a copy without cached roundings
        with torch.no_grad():
            got, fresh = m(x).dequantize(), copy.deepcopy(m)(x).dequantize()
        assert_bits_equal(got, fresh, what)
        return got

    before = check("first use")
    assert w.__dict__.get("_qt_operands"), "the weight's operand rounding was not kept"
    with torch.no_grad():
        w.add_(0.25)
    after = check("after w.add_")
    assert not torch.equal(before, after)
    with torch.no_grad():
        w[3:5].mul_(-2.0)  # through a view
    check("after a view's mul_")
    w.payload.mul_(0.5)  # the payload itself
    check("after payload.mul_")
    w.data = qt.as_qtensor(torch.randn(48, 64), w.fmt, mm_fmt=w.mm_fmt)
    check("after w.data =")
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    m(x).dequantize().square().mean().backward()
    opt.step()
    check("after an optimizer step")


def test_describe_shows_the_formats_each_gemm_uses():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    qt.convert(model, qt.recipes.nvfp4_nvidia)
    text = qt.describe(model, print_table=False)
    g = qt.recipes.nvfp4_nvidia.gemm["linear"]
    weight_row = next(line for line in text.splitlines() if line.startswith("0.weight"))
    assert f"{g.fprop_w} in fprop" in weight_row and "bf16" not in weight_row
    rows = [line.split() for line in text.splitlines() if line.split()[1:2] == ["0"]]
    fprop = next(r for r in rows if r[0] == "fprop")
    assert "nvfp4" in fprop and f"{g.fprop_x.bits:.4g}" in fprop
    assert any("wgrad" in r and "Hadamard(16," in " ".join(r) for r in rows)
    model = qt.convert(torch.nn.Sequential(torch.nn.Linear(64, 8)), qt.recipes.mxfp6)
    text = qt.describe(model, print_table=False)
    assert any(line.startswith("fprop ") and "6.25 x 6.25" in line
               for line in text.splitlines())


@pytest.mark.parametrize("dtype, name", [(torch.bfloat16, "qt.bf16"), (torch.float16, "qt.fp16"),
                                         (torch.float8_e4m3fn, "qt.fp8_e4m3")])
def test_convert_to_a_torch_dtype_names_the_format(dtype, name):
    """qt.convert(model, torch.bfloat16) (model.to's habit): a TypeError that names the format
    that is exactly the dtype."""
    with pytest.raises(TypeError, match=rf"got {dtype}; for {dtype} use {name}\b"):
        qt.convert(nn.Linear(4, 4), dtype)

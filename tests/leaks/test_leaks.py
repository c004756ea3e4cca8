"""leak_check: each kind of leak found at the right module and source line; clean models report
nothing (forward, backward, optimizer step)."""
from __future__ import annotations

import inspect
import os
import warnings
import weakref

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import qtensor as qt
from qtensor import leaks


def line_of(obj, text: str) -> int:
    """The line number of the (unique) source line of ``obj`` whose comment contains ``text``."""
    lines, start = inspect.getsourcelines(obj)
    hits = [start + i for i, line in enumerate(lines)
            if "#" in line and text in line.split("#", 1)[1]]
    assert len(hits) == 1, f"{text!r} found {len(hits)} times in {obj}"
    return hits[0]


def at(finding, obj, text: str) -> bool:
    loc = finding.location
    return (loc is not None and os.path.samefile(loc.filename, __file__)
            and loc.lineno == line_of(obj, text))


def step(model, opt, x, y, loss_fn=F.cross_entropy, steps=2):
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()


def assert_clean(report):
    assert report.ok, report.summary() + "\n\n" + "\n\n".join(f.message for f in report)


# ---------------------------------------------------------------------------------------------
# Clean, fully converted models: nothing to report

class MLP(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(),
                                 nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
            nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8 * 4 * 4, 3)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


class LSTMNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(6, 12, num_layers=2, batch_first=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def _quiet_convert(model, spec):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "non-floating tensors are left alone" (BatchNorm)
        return qt.convert(model, spec)


CLEAN = {
    "mlp": lambda: (MLP(), torch.randn(8, 16), torch.randint(0, 4, (8,)), F.cross_entropy,
                    lambda p: torch.optim.SGD(p, lr=0.05)),
    "cnn_batchnorm": lambda: (CNN(), torch.randn(4, 3, 8, 8), torch.randint(0, 3, (4,)),
                              F.cross_entropy,
                              lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    "transformer": lambda: (nn.TransformerEncoderLayer(16, 4, dim_feedforward=32,
                                                       batch_first=True),
                            torch.randn(2, 5, 16), torch.randn(2, 5, 16), F.mse_loss,
                            lambda p: torch.optim.AdamW(p, lr=1e-3)),
    "lstm": lambda: (LSTMNet(), torch.randn(3, 5, 6), torch.randint(0, 3, (3,)),
                     F.cross_entropy, lambda p: torch.optim.Adam(p, lr=1e-3)),
}


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_clean_model_reports_nothing(name):
    torch.manual_seed(0)
    model, x, y, loss_fn, make_opt = CLEAN[name]()
    _quiet_convert(model, qt.bf16)
    opt = make_opt(model.parameters())
    with qt.leak_check(action="record", optimizer=opt, check_values=True) as report:
        step(model, opt, x, y, loss_fn)
    assert_clean(report)


@pytest.mark.parametrize("spec", ["mxfp6", "master_weights", "foreach_adam", "fp32_head"])
def test_clean_recipes_report_nothing(spec):
    """Block formats (values and operands), FP32 master weights, foreach optimizers, and a
    part left in full precision on purpose by a rule."""
    torch.manual_seed(0)
    model = MLP(32)
    recipe = {"mxfp6": qt.recipes.mxfp6,
              "master_weights": qt.Recipe.uniform(qt.bf16).replace(master_weights=True,
                                                                   optimizer_state=None),
              "foreach_adam": qt.Recipe.uniform(qt.mxfp8_e4m3),
              "fp32_head": qt.Recipe.uniform(qt.fp8_e4m3, rules={"net.4": None})}[spec]
    _quiet_convert(model, recipe)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=(spec == "foreach_adam"))
    with qt.leak_check(action="raise", optimizer=opt, check_values=True) as report:
        step(model, opt, torch.randn(8, 32), torch.randint(0, 4, (8,)))
    assert_clean(report)


class Masked(nn.Module):
    """An encoder with a causal float mask and a boolean padding mask, and an attention layer
    with a boolean mask: torch turns the masks into float tensors inside a converted model."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        t = x.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(t)
        pad = torch.zeros(x.shape[0], t, dtype=torch.bool)
        pad[0, -1] = True
        h = self.enc(x, mask=causal, src_key_padding_mask=pad, is_causal=True)
        a, _ = self.mha(h, h, h, attn_mask=torch.ones(t, t, dtype=torch.bool).triu(1))
        return self.out(a[:, 0])


@pytest.mark.filterwarnings("ignore:Support for mismatched")
def test_clean_masks_and_inference():
    torch.manual_seed(0)
    model = _quiet_convert(Masked(), qt.bf16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(2, 5, 16)
    with qt.leak_check(action="raise", optimizer=opt, check_values=True) as report:
        step(model, opt, x, torch.tensor([0, 2]), steps=1)
        model.eval()
        with torch.inference_mode():
            model(x)
    assert_clean(report)


class Functional(nn.Module):
    """Functional calls whose C++ code makes its own constants (SDPA's causal mask with
    dropout), interpolation, einsum, a max_norm embedding, a positional-encoding buffer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 16, max_norm=1.0, padding_idx=0)
        self.qkv = nn.Linear(16, 48)
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.out = nn.Linear(16, 4)
        pos = torch.arange(7.0)[:, None] / (10 ** (torch.arange(16.0) / 16))
        self.register_buffer("pe", torch.sin(pos))

    def forward(self, t):
        h = self.emb(t) + self.pe
        q, k, v = self.qkv(h).view(h.shape[0], h.shape[1], 3, 2, 8).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True, dropout_p=0.1)
        a = a.transpose(1, 2).reshape(h.shape)
        img = F.interpolate(self.conv(a.unsqueeze(1)), scale_factor=2, mode="bilinear")
        img = F.avg_pool2d(img, 2).mean(1)
        z = torch.einsum("btd,bsd->bts", img, img).softmax(-1) @ img
        z = F.layer_norm(z, (16,)) + torch.randn_like(z) * 0.01
        return self.out(z.cumsum(1)[:, -1])


def test_clean_functional_model_and_weighted_loss():
    """Also a loss module's class weights and label smoothing (loss configuration, not a leak)."""
    torch.manual_seed(0)
    model = qt.convert(Functional(), qt.bf16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 1.0, 1.0]), label_smoothing=0.1)
    with qt.leak_check(action="raise", optimizer=opt, check_values=True) as report:
        step(model, opt, torch.randint(0, 10, (3, 7)), torch.tensor([0, 1, 3]), crit)
    assert_clean(report)


def test_clean_weight_only_recipe_and_logits_loss():
    """Activations left in full precision by the recipe are deliberate; a loss's float target
    is data, in forward and in the loss's backward formula (sigmoid(x) - target)."""
    torch.manual_seed(0)
    model = qt.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)),
                       qt.Recipe(weight=qt.fp8_e4m3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with qt.leak_check(action="raise", optimizer=opt) as report:
        step(model, opt, torch.randn(5, 4), torch.rand(5, 1), F.binary_cross_entropy_with_logits)
    assert_clean(report)
    model = qt.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), qt.bf16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with qt.leak_check(action="raise", optimizer=opt) as report:
        step(model, opt, torch.randn(5, 4), torch.rand(5, 1), F.binary_cross_entropy_with_logits)
    assert_clean(report)


def test_scalars_are_not_leaks():
    q = qt.as_qtensor(torch.randn(4, 3), qt.bf16)
    with qt.leak_check(action="raise") as report:
        q + 2.0
        torch.add(q, 2.0, alpha=3)
        q * torch.tensor(0.5)  # a 0-dim tensor is a scalar
        q.clamp(min=-1.0)
        (q > 0).sum()
    assert_clean(report)


def test_qtensor_own_code_is_not_reported():
    """as_qtensor, dequantize for inspection, convert's hooks: deliberate, not leaks."""
    x = torch.randn(4, 3)
    with qt.leak_check(action="raise") as report:
        q = qt.as_qtensor(x, qt.fp8_e4m3)
        q.dequantize()
        qt.quantize(x, qt.bf16)
    assert_clean(report)


def test_what_a_dispatch_mode_sees():
    """The facts leak_check stands on: a mode sees each op once, with QTensor arguments, before
    QTensor's own dispatch (whose inner payload ops it does not see); Python scalars stay
    Python numbers; backward ops go through the mode too, while the autograd engine names
    the node it runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            node = torch._C._current_autograd_node()
            seen.append((str(func), [type(a).__name__ for a in args], node is not None))
            return func(*args, **(kwargs or {}))

    q = qt.as_qtensor(torch.randn(3), qt.bf16).requires_grad_()
    with Spy():
        (q * 2.0).sum().backward()
    fwd = [s for s in seen if not s[2]]
    assert fwd[:2] == [("aten.mul.Tensor", ["QTensor", "float"], False),
                       ("aten.sum.default", ["QTensor"], False)]
    assert any(s[2] and "QTensor" in s[1] for s in seen)  # backward, on QTensors
    assert all("Tensor" not in s[1] for s in seen)  # never a bare payload


# ---------------------------------------------------------------------------------------------
# (a) a plain floating tensor mixed with QTensors

class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return h * self.scale + 1.0  # LEAK: unconverted buffer


class BufferNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.block = WithBuffer()
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.block(self.inp(x)))


def test_mixed_unconverted_buffer():
    torch.manual_seed(0)
    model = qt.convert(BufferNet(), qt.bf16)
    model.block.register_buffer("scale", torch.rand(8) + 0.5)  # added after conversion
    with qt.leak_check(action="record") as report:
        model(torch.randn(3, 4)).sum().backward()
    f = report[0]
    assert f.kind == "mixed" and f.module == "block" and f.op == "aten.mul.Tensor"
    assert f.phase == "forward"
    assert at(f, WithBuffer.forward, "LEAK: unconverted buffer")
    leak = [t for t in f.tensors if t.flagged]
    assert [(t.name, t.qtensor, t.shape, t.dtype) for t in leak] == [
        ("block.scale", False, (8,), "float32")]
    others = [t for t in f.tensors if not t.flagged and t.role == "self"]
    assert others[0].qtensor and others[0].fmt == "bf16" and others[0].shape == (3, 8)
    assert set(report.of_kind("mixed")) == set(report.findings)  # nothing else
    back = [g for g in report if g.phase == "backward"]
    assert back and all(g.module == "<backward of 'block'>" for g in back)


class WithConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return h + torch.ones(h.shape[-1]) * 0.5  # LEAK: constant made in forward


def test_mixed_constant_created_in_forward():
    model = qt.convert(nn.Sequential(nn.Linear(4, 8), WithConstant()), qt.fp8_e4m3)
    with qt.leak_check(action="record") as report:
        model(torch.randn(2, 4))
    kinds = [(f.kind, f.module, f.op) for f in report]
    # the constant is computed with (plain_op: * 0.5), then meets the activation (mixed)
    assert kinds == [("plain_op", "1", "aten.mul.Tensor"), ("mixed", "1", "aten.add.Tensor")]
    assert all(at(f, WithConstant.forward, "LEAK: constant made in forward") for f in report)


def test_mixed_outside_any_module_and_allow():
    q = qt.as_qtensor(torch.randn(4, 3), qt.bf16)
    plain = torch.randn(3)
    with qt.leak_check(action="record") as report:
        q + plain  # LEAK: bare
    assert len(report) == 1 and report[0].kind == "mixed" and report[0].module == ""
    assert at(report[0], test_mixed_outside_any_module_and_allow, "LEAK: bare")
    with qt.leak_check(action="raise", allow=(plain,)) as report:
        q + plain
        q * plain.view(1, 3)  # views of an allowed tensor are allowed too
    assert_clean(report)
    with qt.leak_check(action="raise", allow=("aten.add.*",)) as report:
        q + plain
    assert_clean(report)


def test_foreach_ops_pair_elements():
    """_foreach_* ops: element i of each list together (a plain and a QTensor parameter may
    share one foreach call without meeting)."""
    q, p = qt.as_qtensor(torch.randn(3), qt.bf16), torch.randn(3)
    with qt.leak_check(action="raise") as report:
        torch._foreach_mul_([q, p], 0.5)
        torch._foreach_add_([q, p], [q.clone(), p.clone()])
    assert_clean(report)
    with qt.leak_check(action="record") as report:
        torch._foreach_add_([q, p], [p.clone(), p.clone()])
    assert [(f.kind, f.op) for f in report] == [("mixed", "aten._foreach_add_.List")]
    assert [t.role for t in report[0].tensors if t.flagged] == ["other[0]"]


def test_loss_target_and_writes_into_qtensor_are_not_leaks():
    q = qt.as_qtensor(torch.randn(4, 3), qt.bf16).requires_grad_()
    with qt.leak_check(action="raise") as report:
        F.mse_loss(q, torch.randn(4, 3)).backward()
        with torch.no_grad():
            q.copy_(torch.randn(4, 3))  # rounded into q's format: quantization, not a leak
            q[0] = torch.randn(3)
    assert_clean(report)


def test_label_smoothing_and_probability_targets_are_not_leaks():
    """cross_entropy with label_smoothing or probability targets multiplies the log-probabilities
    by its target and class weights inside the composite op: data, like the target of nll_loss.
    The same product written by the user outside the loss is still a leak."""
    torch.manual_seed(0)
    model = _quiet_convert(MLP(), qt.recipes.mxfp6)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    probs, weight = torch.softmax(torch.randn(8, 4), -1), torch.rand(4) + 0.5
    with qt.leak_check(action="record", optimizer=opt) as report:
        for target, w, smoothing in [(y, None, 0.1), (y, weight, 0.1), (probs, None, 0.0),
                                     (probs, weight, 0.2)]:
            opt.zero_grad()
            F.cross_entropy(model(x), target, weight=w, label_smoothing=smoothing).backward()
            nn.CrossEntropyLoss(weight=w, label_smoothing=smoothing)(model(x), target).backward()
            opt.step()
    assert_clean(report)
    with qt.leak_check(action="record") as report:
        (model(x).log_softmax(-1) * probs).sum()  # LEAK: the product outside the loss
    assert [(f.kind, f.op) for f in report] == [("mixed", "aten.mul.Tensor")]
    assert at(report[0], test_label_smoothing_and_probability_targets_are_not_leaks,
              "LEAK: the product outside")


def test_a_step_that_raises_ends_the_step_for_the_checker():
    """A step whose closure raises skips the post-step hooks: the checker must not stay inside
    the step (where plain values made from deliberate ones count as deliberate too), neither
    after it nor after the next step."""
    torch.manual_seed(0)
    model = _quiet_convert(MLP(), qt.recipes.mxfp6)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    inside = []

    def closure():
        inside.append(bool(check._tracker.in_step))
        F.cross_entropy(model(x), y).backward()
        raise FloatingPointError("loss is NaN")
    check = qt.leak_check(action="record", optimizer=opt)
    with check as report:
        with pytest.raises(FloatingPointError):
            opt.step(closure)
        assert inside == [True] and not check._tracker.in_step
        step(model, opt, x, y, steps=1)
        assert not check._tracker.in_step
    assert_clean(report)

def test_logits_loss_class_weights_are_not_leaks():
    """binary_cross_entropy_with_logits' weight= and pos_weight= (and nn.BCEWithLogitsLoss's)
    are class weights, data: its backward formula (``pos_weight * target``, then with the
    logits) used to be reported as mixed. pos_weight times the logits outside the loss is still
    a leak."""
    torch.manual_seed(0)
    model = _quiet_convert(MLP(), qt.bf16)
    x, y = torch.randn(8, 16), torch.rand(8, 4).round()
    w, pw = torch.rand(4) + 0.5, torch.rand(4) + 0.5
    with qt.leak_check(action="record") as report:
        F.binary_cross_entropy_with_logits(model(x), y, weight=w).backward()
        F.binary_cross_entropy_with_logits(model(x), y, pos_weight=pw).backward()
        F.binary_cross_entropy_with_logits(model(x), y, weight=w[None], pos_weight=pw).backward()
        nn.BCEWithLogitsLoss(pos_weight=pw)(model(x), y).backward()
        nn.BCEWithLogitsLoss(weight=w, pos_weight=pw, reduction="sum")(model(x), y).backward()
    assert_clean(report)
    with qt.leak_check(action="record") as report:
        (model(x) * pw).sum().backward()  # LEAK: the class weights outside the loss
    assert [(f.kind, f.op, f.phase) for f in report] == [
        ("mixed", "aten.mul.Tensor", "forward"), ("mixed", "aten.mul.Tensor", "backward")]


class PackedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(6, 12, batch_first=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                   enforce_sorted=False)
        out, _ = self.lstm(packed)
        padded, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)  # LEAK: torch's buffer
        return self.head(padded * 2.0)  # LEAK: FP32 from here


def test_pad_packed_sequence_buffer_is_reported():
    """pad_packed_sequence copies the (QTensor) LSTM output into a plain buffer that torch's C++
    code makes: that buffer was exempted as a constant torch made, and so was everything
    computed from it (FP32, unreported). The copy and the plain ops after it are reported, in a
    converted model as outside one."""
    torch.manual_seed(0)
    model = _quiet_convert(PackedLSTM(), qt.recipes.mxfp6)
    x, lengths = torch.randn(3, 5, 6), torch.tensor([5, 3, 2])
    with qt.leak_check(action="record") as report:
        model(x, lengths).sum().backward()
    kinds = [(f.kind, f.op) for f in report]
    assert ("plain_result", "aten.copy_.default") in kinds
    assert ("plain_op", "aten.mul.Tensor") in kinds
    first = report[0]
    assert first.kind == "plain_result" and at(first, PackedLSTM.forward, "LEAK: torch's buffer")
    assert "pad_packed_sequence" in first.detail
    mul = next(f for f in report if f.kind == "plain_op")
    assert at(mul, PackedLSTM.forward, "LEAK: FP32 from here")


class KVCache(nn.Module):
    """Incremental decoding: each call appends this step's keys to the cache."""

    def __init__(self, d=16, start=None):
        super().__init__()
        self.k = nn.Linear(d, d)
        self.start = start  # "empty": torch.empty(b, 0, d); "zeros": one zero slot

    def forward(self, x):
        if not hasattr(self, "cache"):
            b, _, d = x.shape
            self.cache = torch.empty(b, 0, d) if self.start == "empty" else torch.zeros(b, 1, d)
        self.cache = torch.cat([self.cache, self.k(x)], dim=1)  # LEAK: a non-empty plain cache
        return self.cache.mean(1)


def test_kv_cache_started_empty_is_not_a_leak():
    """A zero-element plain tensor carries no values: cat with it is not a leak. A cache that
    starts with plain values (zeros) is: those values enter the emulated attention."""
    for start, expected in [("empty", []), ("zeros", [("mixed", "aten.cat.default")])]:
        model = qt.convert(KVCache(start=start), qt.bf16)
        with qt.leak_check(action="record") as report, torch.no_grad():
            for _ in range(3):
                model(torch.randn(2, 1, 16))
        assert [(f.kind, f.op) for f in report] == expected, start
        assert isinstance(model.cache, qt.QTensor)
        assert model.cache.shape == (2, 3 + len(expected), 16)
        if expected:
            assert at(report[0], KVCache.forward, "LEAK: a non-empty plain cache")
            assert [t.shape for t in report[0].tensors if t.flagged] == [(2, 1, 16)]


def test_sparse_gradients_in_format_are_not_leaks():
    """nn.Embedding(sparse=True): a sparse gradient cannot be a QTensor; with its values in the
    gradient format it is not a leak (forward, backward, SGD step). One whose values are not
    in format (planted: full-precision values) is reported where it meets the weight and after
    the step."""
    torch.manual_seed(0)
    model = qt.convert(nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1)),
                       qt.Recipe.uniform("bf16"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.tensor([1, 2, 3, 2])
    with qt.leak_check(action="record", optimizer=opt) as report:
        model(idx).square().mean().backward()
        opt.step()
    assert list(report) == []
    assert model[0].weight.grad.is_sparse
    with qt.leak_check(action="record", optimizer=opt) as report:
        opt.zero_grad()
        model(idx).square().mean().backward()
        g = model[0].weight.grad.coalesce()
        model[0].weight.grad = torch.sparse_coo_tensor(  # LEAK: values not in bf16
            g.indices(), g.values() * (1 + 2 ** -20), g.shape, check_invariants=True)
        opt.step()
    kinds = sorted((f.kind, f.op) for f in report)
    assert kinds == [("mixed", "aten.add_.Tensor"), ("optimizer", "SGD.step")], kinds


class ScalarLeaks(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.temperature = torch.tensor(0.7)  # a tensor attribute, not a registered buffer

    def forward(self, x):
        h = self.fc(x) / self.temperature  # LEAK: 0-dim attribute
        return h * torch.tensor(0.3)  # LEAK: 0-dim constant made in forward


def test_mixed_zero_dim_state_and_user_constants():
    """0-dim tensors count as scalars only when torch made them (wrapped numbers)."""
    model = qt.convert(nn.Sequential(nn.Linear(4, 4), ScalarLeaks()), qt.bf16)
    with qt.leak_check(action="record") as report:
        model(torch.randn(2, 4))
    assert [(f.kind, f.module, f.op) for f in report] == [
        ("mixed", "1", "aten.div.Tensor"), ("mixed", "1", "aten.mul.Tensor")]
    assert at(report[0], ScalarLeaks.forward, "LEAK: 0-dim attribute")
    assert [t.name for t in report[0].tensors if t.flagged] == ["1.temperature"]
    assert at(report[1], ScalarLeaks.forward, "LEAK: 0-dim constant")


# ---------------------------------------------------------------------------------------------
# (b) a result computed from QTensors that came back plain

def test_plain_result(monkeypatch):
    # simulate a dispatch rule that forgets to wrap its output (the bug this kind catches)
    from qtensor.tensor import dispatch as qd
    orig = qd.dispatch

    def leaky_dispatch(func, args, kwargs, cls):
        out = orig(func, args, kwargs, cls)
        if func is torch.ops.aten.gelu.default:
            return out.dequantize()
        return out

    monkeypatch.setattr(qd, "dispatch", leaky_dispatch)
    model = qt.convert(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)), qt.bf16)

    def run(x):
        return model(x)  # LEAK: gelu comes back plain

    with qt.leak_check(action="record") as report:
        run(torch.randn(2, 4))
    f = report[0]
    assert (f.kind, f.module, f.op) == ("plain_result", "1", "aten.gelu.default")
    assert at(f, run, "LEAK: gelu comes back plain")  # nn.GELU: torch code, the user's call
    assert [t.qtensor for t in f.tensors] == [True, False]
    assert f.tensors[1].flagged and f.tensors[1].role == "result"


def test_plain_result_into_plain_destination():
    """out= and copy_ into a plain tensor: the dispatch leaves the destination plain."""
    q = qt.as_qtensor(torch.randn(4), qt.bf16)
    buf = torch.empty(4)
    with qt.leak_check(action="record") as report:
        torch.mul(q, q, out=buf)  # LEAK: out= plain
        buf.copy_(q)  # LEAK: copied out
        buf.add_(q)  # LEAK: a plain operand
    got = [(f.kind, f.op, [t.role for t in f.tensors if t.flagged]) for f in report]
    assert got == [("plain_result", "aten.mul.out", ["out", "result"]),
                   ("plain_result", "aten.copy_.default", ["self", "result"]),
                   ("mixed", "aten.add_.Tensor", ["self"])]
    fn = test_plain_result_into_plain_destination
    assert [at(f, fn, m) for f, m in zip(report, ["out= plain", "copied out", "a plain"])] == \
        [True] * 3


# ---------------------------------------------------------------------------------------------
# ops the emulation does not follow: complex intermediates, fused attention kernels

class SpectralMixing(nn.Module):
    """FNet-style mixing: a real FFT along the features, a learned gain, the inverse FFT."""

    def __init__(self, d=16):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.gain = nn.Parameter(torch.rand(d // 2 + 1) + 0.5)

    def forward(self, x):
        spectrum = torch.fft.rfft(self.proj(x), dim=-1)  # LEAK: complex spectrum
        return torch.fft.irfft(spectrum * self.gain, n=x.shape[-1], dim=-1)  # LEAK: complex math


def test_complex_intermediate_fft_is_reported():
    """No format is complex: rfft of a QTensor comes back as a plain complex tensor, and what
    is computed from it runs in full precision. Each step is reported."""
    torch.manual_seed(0)
    model = _quiet_convert(nn.Sequential(nn.Linear(16, 16), SpectralMixing()), qt.recipes.mxfp6)
    with qt.leak_check(action="record") as report:
        model(torch.randn(2, 5, 16)).sum().backward()
    fwd = [(f.kind, f.module, f.op) for f in report if f.phase == "forward"]
    assert fwd == [("plain_result", "1", "aten._fft_r2c.default"),
                   ("mixed", "1", "aten.mul.Tensor"),
                   ("plain_op", "1", "aten._fft_c2r.default")]
    first = report[0]
    assert at(first, SpectralMixing.forward, "LEAK: complex spectrum")
    assert "complex" in first.detail and "complex64" in first.message
    assert [t.dtype for t in first.tensors if t.flagged] == ["complex64"]
    assert all(at(f, SpectralMixing.forward, "LEAK: complex math") for f in report[1:3])
    assert [t.name for t in report[1].tensors if t.qtensor] == ["1.gain"]
    assert {f.module for f in report if f.phase == "backward"} == {"<backward of '1'>"}


class Rotary(nn.Module):
    """Rotary position embedding through complex numbers (as in LLaMA's reference code)."""

    def __init__(self, d=16, seq=5):
        super().__init__()
        self.qk = nn.Linear(d, d)
        angles = torch.outer(torch.arange(seq).float(),
                             10000.0 ** (-torch.arange(0, d, 2).float() / d))
        self.register_buffer("rot", torch.polar(torch.ones_like(angles), angles))

    def forward(self, x):
        h = self.qk(x)
        hc = torch.view_as_complex(h.reshape(*h.shape[:-1], -1, 2))  # LEAK: complex view
        return torch.view_as_real(hc * self.rot).flatten(-2)  # LEAK: complex rotation


def test_complex_intermediate_rope_is_reported():
    torch.manual_seed(0)
    model = _quiet_convert(nn.Sequential(nn.Linear(16, 16), Rotary()), qt.bf16)
    with qt.leak_check(action="record") as report:
        model(torch.randn(2, 5, 16)).sum().backward()
    fwd = [(f.kind, f.module, f.op) for f in report if f.phase == "forward"]
    assert fwd == [("plain_result", "1", "aten.view_as_complex.default"),
                   ("plain_op", "1", "aten.mul.Tensor")]
    assert at(report[0], Rotary.forward, "LEAK: complex view")
    assert at(report[1], Rotary.forward, "LEAK: complex rotation")
    assert [t.name for t in report[1].tensors if t.flagged] == [None, "1.rot"]


class SelfAttention(nn.Module):
    def __init__(self, d=16, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # LEAK: fused attention
        return self.out(a.transpose(1, 2).reshape(b, s, d))


def test_fused_attention_ignoring_operand_format_is_reported():
    """PyTorch's fused CPU attention kernel computes Q K^T and P V inside one op: the operands'
    mm_fmt (MXFP6 here) is not applied. Under the math backend every step is emulated."""
    torch.manual_seed(0)
    model = _quiet_convert(nn.Sequential(nn.Linear(16, 16), SelfAttention()), qt.recipes.mxfp6)
    x = torch.randn(2, 5, 16)
    with qt.leak_check(action="record") as report:
        model(x).sum().backward()
    got = [(f.kind, f.module, f.op, f.phase) for f in report]
    assert got == [
        ("fused", "1", "aten._scaled_dot_product_flash_attention_for_cpu.default", "forward"),
        ("fused", "<backward of '1'>",
         "aten._scaled_dot_product_flash_attention_for_cpu_backward.default", "backward")]
    assert all(at(f, SelfAttention.forward, "LEAK: fused attention") for f in report)
    assert "mxfp6_e3m2" in report[0].detail and "SDPBackend.MATH" in report[0].detail
    with qt.leak_check(action="record") as report, sdpa_kernel(SDPBackend.MATH):
        model(x).sum().backward()
    assert_clean(report)
    # a value format only (no operand format): the fused op computes and rounds as one op
    model = _quiet_convert(nn.Sequential(nn.Linear(16, 16), SelfAttention()), qt.bf16)
    with qt.leak_check(action="record") as report:
        model(x).sum().backward()
    assert_clean(report)


class Attend(nn.Module):
    def __init__(self, d=16, heads=4):
        super().__init__()
        self.mha = nn.MultiheadAttention(d, heads, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]  # LEAK: fast path


def test_fused_multihead_attention_fast_path_is_reported():
    """nn.MultiheadAttention's inference fast path is one fused op, projections included."""
    torch.manual_seed(0)
    model = _quiet_convert(Attend(), qt.recipes.mxfp6).eval()
    x = torch.randn(2, 5, 16)
    with qt.leak_check(action="record") as report, torch.no_grad():
        model(x)
    assert [(f.kind, f.module, f.op) for f in report] == [
        ("fused", "mha", "aten._native_multi_head_attention.default")]
    assert at(report[0], Attend.forward, "LEAK: fast path")
    assert "set_fastpath_enabled(False)" in report[0].detail
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with qt.leak_check(action="record") as report, torch.no_grad(), \
                sdpa_kernel(SDPBackend.MATH):
            model(x)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    assert_clean(report)


# ---------------------------------------------------------------------------------------------
# (c) plain ops inside a converted model: forward and backward

class Unwrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        w, b = self.fc.weight.dequantize(), self.fc.bias.dequantize()
        return F.linear(x.dequantize(), w, b)  # LEAK: functional call on unwrapped tensors


def test_plain_op_functional_call_on_dequantized():
    model = qt.convert(nn.Sequential(nn.Linear(4, 8), Unwrapped(), nn.Linear(8, 2)), qt.bf16)
    with qt.leak_check(action="record") as report:
        model(torch.randn(3, 4)).sum().backward()
    fwd = [f for f in report if f.phase == "forward"]
    assert [(f.kind, f.module, f.op) for f in fwd] == [("plain_op", "1", "aten.addmm.default")]
    assert at(fwd[0], Unwrapped.forward, "LEAK: functional call")
    assert all(t.flagged and not t.qtensor for t in fwd[0].tensors[:3])
    # backward: the linear's backward meets the (rounded) gradient; it points at the same line
    bwd = [f for f in report if f.phase == "backward"]
    assert bwd and {f.module for f in bwd} == {"<backward of '1'>"}
    assert all(at(f, Unwrapped.forward, "LEAK: functional call") for f in bwd)


class PlainBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return g.dequantize() * 3.0  # LEAK: plain op in a backward


class WithPlainBackward(nn.Module):
    def forward(self, x):
        return PlainBackward.apply(x)  # forward op of the leaky backward


def test_plain_op_in_backward():
    model = qt.convert(nn.Sequential(nn.Linear(4, 8), WithPlainBackward(), nn.Linear(8, 2)),
                       qt.bf16)
    with qt.leak_check(action="record") as report:
        model(torch.randn(3, 4)).sum().backward()
    assert [(f.kind, f.module, f.op, f.phase) for f in report] == [
        ("plain_op", "<backward of '1'>", "aten.mul.Tensor", "backward")]
    # a Python backward is user code: its own line is the location
    assert at(report[0], PlainBackward.backward, "LEAK: plain op in a backward")


class SidePath(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x):
        y = self.fc(x)
        with torch.no_grad():
            m = y.dequantize().mean(0)  # LEAK: no_grad side path
            self.ema.mul_(0.9).add_(m, alpha=0.1)  # LEAK: plain statistic into a QTensor
        return y


def test_plain_op_no_grad_side_path():
    model = qt.convert(nn.Sequential(nn.Linear(4, 8), SidePath()), qt.bf16)
    with qt.leak_check(action="record") as report:
        model(torch.randn(3, 4)).sum().backward()
    got = [(f.kind, f.module, f.op) for f in report]
    assert got == [("plain_op", "1", "aten.mean.dim"), ("mixed", "1", "aten.add_.Tensor")]
    assert at(report[0], SidePath.forward, "LEAK: no_grad side path")
    assert at(report[1], SidePath.forward, "LEAK: plain statistic")
    assert report[1].tensors[0].name == "1.ema" and report[1].tensors[0].qtensor


def test_unconverted_model_is_not_checked_for_plain_ops():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    with qt.leak_check(action="raise") as report:
        model(torch.randn(2, 4)).sum().backward()
    assert_clean(report)


# ---------------------------------------------------------------------------------------------
# (d) values not representable in their format

class Trusting(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) * self.gain  # LEAK: gain's payload is not in its format


def test_unrepresentable_payload():
    model = qt.convert(nn.Sequential(nn.Linear(4, 8), Trusting()), qt.bf16)
    # the trusting constructor wraps float32 values as they are: not bf16 values
    model[1].gain = qt.QTensor(torch.full((8,), 1.0 + 2.0 ** -12), qt.bf16)
    with qt.leak_check(action="record") as report:
        model(torch.randn(2, 4))
    assert_clean(report)  # only checked with check_values
    with qt.leak_check(action="record", check_values=True) as report:
        model(torch.randn(2, 4))
    assert [(f.kind, f.module, f.op) for f in report] == [
        ("unrepresentable", "1", "aten.mul.Tensor")]
    f = report[0]
    assert at(f, Trusting.forward, "LEAK: gain's payload")
    assert "8 of 8 values of other are not in bf16" in f.detail
    assert "1.000244140625" in f.detail and "(nearest in format: 1.0)" in f.detail


def test_unrepresentable_after_writing_through_dequantize():
    """.dequantize() aliases the payload: an in-place write through it leaves the format."""
    model = qt.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), qt.bf16)
    x = torch.randn(2, 4)
    with qt.leak_check(action="raise", check_values=True):
        model(x)
    with torch.no_grad():
        model[2].weight.dequantize().add_(2.0 ** -12)
    with qt.leak_check(action="record", check_values=True) as report:
        model(x)  # LEAK: weight no longer bf16
    assert [(f.kind, f.module) for f in report] == [("unrepresentable", "2")]
    assert report[0].tensors[0].name == "2.weight"
    assert at(report[0], test_unrepresentable_after_writing_through_dequantize,
              "LEAK: weight no longer bf16")


def test_block_format_values():
    """MX values are judged bit-exactly by re-rounding; slices across blocks (which no longer
    line up with the format's blocks) element by element: no false positive either way."""
    x = torch.randn(4, 64) * torch.logspace(-3, 3, 64)
    q = qt.as_qtensor(x, qt.mxfp4_e2m1)
    with qt.leak_check(action="raise", check_values=True) as report:
        q[:, 5:40] * 1.0
        q.reshape(8, 32)[:, 3:] + 0.0
        q.t().contiguous()
    assert_clean(report)
    raw = qt.QTensor(x, qt.mxfp4_e2m1)  # float32 values wrapped as MXFP4: wrong
    with qt.leak_check(action="record", check_values=True) as report:
        raw[:, 5:40] * 1.0
    assert report[0].kind == "unrepresentable" and "not in mxfp4_e2m1" in report[0].detail


def test_block_elementwise_oracle():
    """The element-wise rule for block formats against values built from their definition."""
    fmt = qt.mxfp4_e2m1
    elems = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    good = torch.cat([elems * 2.0 ** k for k in (-20, -3, 0, 5, 40)])
    good = torch.cat([good, -good])
    assert bool(leaks.values.block_elements_ok(good, fmt).all())
    bad = torch.tensor([1.25, 3.5, 5.0, 0.1, float("inf"), 7.0 * 2.0 ** 10])
    assert not bool(leaks.values.block_elements_ok(bad, fmt).any())
    assert bool(leaks.values.block_elements_ok(torch.tensor([float("nan")]), fmt).all())


# ---------------------------------------------------------------------------------------------
# (e) the optimizer step

class PlainMomentum(torch.optim.Optimizer):
    """A hand-written optimizer whose state is made with torch.zeros: plain, not a QTensor."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = torch.zeros(p.shape)
                state["buf"].mul_(0.9).add_(p.grad)  # LEAK: mixed in step
                p.add_(state["buf"], alpha=-group["lr"])  # LEAK: mixed update


def test_optimizer_plain_state():
    model = qt.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), qt.bf16)
    opt = PlainMomentum(model.parameters())

    def train():
        model(torch.randn(3, 4)).sum().backward()
        opt.step()  # LEAK: plain optimizer state

    with qt.leak_check(action="record", optimizer=opt) as report:
        train()
    opt_findings = report.of_kind("optimizer")
    assert [(f.module, f.tensors[0].role) for f in opt_findings] == [
        ("0", "0.weight state['buf']"), ("0", "0.bias state['buf']"),
        ("2", "2.weight state['buf']"), ("2", "2.bias state['buf']")]
    f = opt_findings[0]
    assert f.op == "PlainMomentum.step" and f.phase == "optimizer"
    assert f.detail == "optimizer state 'buf' is a plain tensor, expected bf16"
    assert at(f, train, "LEAK: plain optimizer state")
    # inside step() (user code here) the plain state meets the gradient and the parameter
    mixed = [(f.module, f.op) for f in report.of_kind("mixed")]
    assert mixed == [("", "aten.add_.Tensor")] * 8
    assert all(at(f, PlainMomentum.step, "LEAK: mixed in step") for f in report.of_kind("mixed")[0::2])
    assert all(at(f, PlainMomentum.step, "LEAK: mixed update") for f in report.of_kind("mixed")[1::2])


def test_optimizer_plain_parameter_and_watch():
    model = qt.convert(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), qt.bf16)
    extra = nn.Linear(8, 2)  # forgotten: never converted
    opt = torch.optim.SGD(list(model.parameters()) + list(extra.parameters()), lr=0.1)
    with qt.leak_check(action="record") as report:
        report.watch(opt)
        extra(model(torch.randn(3, 4))).sum().backward()
        opt.step()
    found = [(f.tensors[0].role, f.detail) for f in report.of_kind("optimizer")]
    # named as in the module they were called through
    assert found == [("weight", "parameter is a plain tensor among QTensor parameters"),
                     ("bias", "parameter is a plain tensor among QTensor parameters")]


def test_optimizer_state_in_wrong_format():
    model = qt.convert(nn.Linear(4, 2), qt.Recipe(weight=qt.bf16, bias=qt.bf16, grad=qt.bf16,
                                                  activation=qt.bf16, optimizer_state=qt.fp16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with qt.leak_check(action="raise", optimizer=opt) as report:
        for _ in range(2):  # the first step makes the state from the bf16 gradient: fine
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
    assert_clean(report)
    st = opt.state[model.weight]
    st["momentum_buffer"] = qt.as_qtensor(st["momentum_buffer"].dequantize(), qt.fp8_e4m3)
    with qt.leak_check(action="record", optimizer=opt) as report:
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    assert [(f.kind, f.tensors[0].role, f.detail) for f in report] == [
        ("optimizer", "weight state['momentum_buffer']",
         "optimizer state 'momentum_buffer' in fp8_e4m3, expected fp16")]


# ---------------------------------------------------------------------------------------------
# actions, report, summary

def test_raise_stops_at_first_finding_with_its_message():
    torch.manual_seed(0)
    model = qt.convert(BufferNet(), qt.bf16)
    model.block.register_buffer("scale", torch.rand(8))
    with pytest.raises(qt.LeakError) as err:
        with qt.leak_check():  # action="raise" is the default
            model(torch.randn(3, 4))
    msg = str(err.value)
    line = line_of(WithBuffer.forward, "LEAK: unconverted buffer")
    assert msg.splitlines()[:4] == [
        "leak (mixed): a plain floating tensor met QTensors",
        "  op: aten.mul.Tensor",
        "  module: block (forward)",
        f"  at: {leaks.findings.short_path(__file__)}:{line} in forward"]
    assert "other: plain Tensor[8] float32 (block.scale) <-" in msg
    assert err.value.finding.kind == "mixed"


def test_raise_in_backward():
    model = qt.convert(nn.Sequential(nn.Linear(4, 8), WithPlainBackward()), qt.bf16)
    with pytest.raises(qt.LeakError, match="backward of '1'"):
        with qt.leak_check(action="raise"):  # the forward too: it tags the backward
            model(torch.randn(3, 4)).sum().backward()


def test_warn_once_per_distinct_finding():
    torch.manual_seed(0)
    model = qt.convert(BufferNet(), qt.bf16)
    model.block.register_buffer("scale", torch.rand(8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with qt.leak_check(action="warn") as report:
            for _ in range(3):
                model(torch.randn(3, 4))
    leaks_warned = [w for w in caught if issubclass(w.category, qt.LeakWarning)]
    assert len(report) == 3 and len(leaks_warned) == 1
    assert os.path.samefile(leaks_warned[0].filename, __file__)
    assert leaks_warned[0].lineno == line_of(WithBuffer.forward, "LEAK: unconverted buffer")


def test_summary_table():
    torch.manual_seed(0)
    model = qt.convert(nn.Sequential(nn.Linear(4, 8), SidePath(), WithConstant()), qt.bf16)
    with qt.leak_check(action="record") as report:
        for _ in range(2):
            model(torch.randn(3, 4))
    text = report.summary()
    for obj, marker, name in [(SidePath.forward, "LEAK: no_grad side path", "SIDE"),
                              (SidePath.forward, "LEAK: plain statistic", "STAT"),
                              (WithConstant.forward, "LEAK: constant made", "CONST")]:
        text = text.replace(f"{leaks.findings.short_path(__file__)}:{line_of(obj, marker)}",
                            f"test_leaks.py:{name}")
    expecttest.assert_expected_inline(text, """\
leak_check: 8 findings in 4 places
kind      module  op                count  first location
plain_op  1       aten.mean.dim         2  test_leaks.py:SIDE in forward
mixed     1       aten.add_.Tensor      2  test_leaks.py:STAT in forward
plain_op  2       aten.mul.Tensor       2  test_leaks.py:CONST in forward
mixed     2       aten.add.Tensor       2  test_leaks.py:CONST in forward""")
    assert str(report) == report.summary()
    with qt.leak_check(action="record") as empty:
        pass
    assert empty.summary() == "leak_check: no leaks"


def test_nested_checks_both_report():
    torch.manual_seed(0)
    model = qt.convert(BufferNet(), qt.bf16)
    model.block.register_buffer("scale", torch.rand(8))
    with qt.leak_check(action="record", check_values=True) as outer:
        with qt.leak_check(action="record", check_values=True) as inner:
            model(torch.randn(3, 4))
    assert [(f.kind, f.module) for f in inner] == [("mixed", "block")]
    assert [(f.kind, f.module) for f in outer] == [("mixed", "block")]
    assert outer[0].location == inner[0].location


def test_report_keeps_no_reference_to_tensors():
    """After the block, neither the report nor the check holds the model's tensors (a weakref
    on a parameter makes torch.utils.swap_tensors, hence qt.unconvert, fail)."""
    torch.manual_seed(0)
    model = _quiet_convert(MLP(), qt.bf16)
    model.net[2].register_buffer("scale", torch.rand(32))  # a finding that names a buffer
    model.net[2].register_forward_hook(lambda m, a, out: out * m.scale)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with qt.leak_check(action="record", optimizer=opt, check_values=True,
                       allow=("nothing",)) as report:
        step(model, opt, torch.randn(8, 16), torch.randint(0, 4, (8,)), steps=1)
    assert report.of_kind("mixed")  # the report is alive and has findings
    held = [t for p in model.parameters() for t in (p, p.grad, *opt.state[p].values())]
    held += list(model.buffers())
    assert [t.shape for t in held if weakref.getweakrefs(t)] == []
    qt.unconvert(model)
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert opt.param_groups[0]["params"][0] is model.net[0].weight
    with pytest.raises(RuntimeError, match="block has ended"):
        report.watch(opt)  # would leave a hook (and the check) on the optimizer


def test_bad_arguments():
    with pytest.raises(ValueError, match="action must be"):
        qt.leak_check(action="explode")
    with pytest.raises(TypeError, match="optimizer must be"):
        qt.leak_check(optimizer=object())
    with pytest.raises(TypeError, match="allow takes tensors and name patterns"):
        qt.leak_check(allow=(3,))
    with pytest.raises(ValueError, match="unknown finding kind"):
        qt.leak_check(action="record").report.of_kind("nope")
    check = qt.leak_check(action="record")
    with check:
        pass
    with pytest.raises(RuntimeError, match="has run its block already"):
        with check:
            pass

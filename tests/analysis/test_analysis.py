"""qt.analyze: rounding statistics, two-reference contraction errors, per-layer sensitivity."""
import copy
import json
import pathlib
import sys
import time

import pytest
import torch
import torch.nn.functional as F

import qtensor as qt

MX8 = qt.format("mxfp8_e4m3")


def _rel(a, ref):
    a, ref = a.double(), ref.double()
    return float((a - ref).norm() / ref.norm())


@pytest.mark.parametrize("accumulate", [None, "hopper_fp8"])
def test_contraction_errors_against_an_exact_computation(accumulate):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 8, bias=False)
    x = torch.randn(5, 64)
    recipe = qt.Recipe(weight=(qt.fp32, MX8), activation=(qt.fp32, MX8), grad=None,
                       accumulate=accumulate)
    report = qt.analyze(layer, x, recipe, sensitivity=False)
    (row,) = report.contractions
    # the emulated product: the converted layer's own output (FP32 values: no output rounding)
    emulated = qt.convert(copy.deepcopy(layer), recipe)(x).dequantize().detach()
    w = layer.weight.detach()
    xr = qt.quantize(x, MX8.replace(axis=-1))   # blocks along the reduction axis
    wr = qt.quantize(w, MX8.replace(axis=-1))
    exact_rounded = xr.double() @ wr.double().T
    fp32 = x @ w.T
    exact = x.double() @ w.double().T
    assert row["vs_fp32"] == pytest.approx(_rel(emulated, fp32), rel=1e-9)
    assert row["vs_exact_rounded"] == pytest.approx(_rel(emulated, exact_rounded), rel=1e-9,
                                                    abs=1e-12)
    assert row["operands"] == pytest.approx(_rel(exact_rounded, exact), rel=1e-9)
    assert row["operands"] > 1e-3  # MXFP8 operands lose precision
    if accumulate is None:
        assert row["vs_exact_rounded"] < 1e-6  # FP32 sums: only float32 roundoff
    else:
        assert row["vs_exact_rounded"] > 1e-6  # hopper_fp8's truncating accumulator


def _mlp():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))


FMT = qt.format("fp8_e5m2")
SPEC = qt.Recipe(weight=FMT, bias=FMT, activation=FMT, grad=FMT)


def _manual(model, x, y, layer, role="all"):
    """Loss, logits and gradients with only ``layer`` ("0" or "2") rounded to FMT, by hand:
    ``role`` "all" (its parameters, inputs, outputs and their gradients), "weight" (its
    parameters), "activation" (its inputs and outputs) or "grad" (the gradients of its inputs,
    outputs and parameters)."""
    q = lambda t: qt.quantize(t, FMT)  # noqa: E731  (straight-through gradient)
    values = role in ("all", "weight")
    acts = role in ("all", "activation")
    grads = role in ("all", "grad")

    class RoundGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            return q(g) if grads else g

    class RoundGradToFmt(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            return q(g)

    params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}

    def lin(h, i, rounded):
        w, b = params[f"{i}.weight"], params[f"{i}.bias"]
        if not rounded:
            return F.linear(h, w, b)
        h = RoundGrad.apply(q(h) if acts else h)
        if values and not grads:  # and the gradient of its input, an op on them, in FP8 too
            h = RoundGradToFmt.apply(h)
        out = torch.addmm(q(b), h, q(w).T) if values else torch.addmm(b, h, w.T)
        if values and not acts:  # an op on FP8 weights gives an FP8 output (qtensor's dispatch
            out = q(out)         # rounds an op's output to its inputs' format), then plain
        return RoundGrad.apply(q(out) if acts else out)

    h = torch.relu(lin(x, 0, layer == "0"))
    out = lin(h, 2, layer == "2")
    loss = F.cross_entropy(out, y)
    loss.backward()
    return float(loss.detach()), out.detach().double(), torch.cat(
        [q(p.grad).flatten() if n.startswith(layer + ".") and grads else p.grad.flatten()
         for n, p in params.items()]).double()


def _check_rows(report, x, y, model, roles):
    ref_loss, ref_out, ref_grad = _manual(model, x, y, layer="none")
    assert report.loss_fp32 == pytest.approx(ref_loss, rel=1e-6)
    rows = {(r["layer"], r["role"]): r for r in report.sensitivity}
    assert set(rows) == {(layer, role) for layer in ("0", "2") for role in roles}
    for (layer, role), row in rows.items():
        loss, out, grad = _manual(model, x, y, layer, role)
        assert row["dloss"] == pytest.approx(loss - ref_loss, rel=1e-4, abs=1e-7), (layer, role)
        lp, lq = F.log_softmax(ref_out, -1), F.log_softmax(out, -1)
        kl = float((lp.exp() * (lp - lq)).sum(-1).mean())
        assert row["kl"] == pytest.approx(kl, rel=1e-4, abs=1e-9), (layer, role)
        if role != "grad":
            assert kl > 1e-6  # FP8 E5M2 changes the outputs: the check can fail
        else:
            assert kl == 0.0  # rounding only the gradients leaves the forward exact
        cos = float(grad @ ref_grad / (grad.norm() * ref_grad.norm()))
        assert row["grad_cos"] == pytest.approx(cos, abs=1e-6), (layer, role)
        if role != "activation":
            assert cos < 1 - 1e-6, (layer, role)  # the gradients change: the check can fail


def test_sensitivity_against_a_manual_one_layer_conversion():
    model = _mlp()
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 5, (64,), generator=torch.Generator().manual_seed(3))
    loss_fn = lambda o: F.cross_entropy(o, y)  # noqa: E731
    report = qt.analyze(model, x, SPEC, loss_fn)
    _check_rows(report, x, y, model, ["all"])
    assert list(model.parameters())[0].__class__ is torch.nn.Parameter  # left untouched
    assert not qt.convert.__module__ or not hasattr(model, "_qt_conversion")


def test_sensitivity_per_role_against_a_manual_one_role_conversion():
    model = _mlp()
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 5, (64,), generator=torch.Generator().manual_seed(3))
    report = qt.analyze(model, x, SPEC, lambda o: F.cross_entropy(o, y), roles=True)
    _check_rows(report, x, y, model, ["all", "weight", "activation", "grad"])


def test_tensor_statistics():
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 4)
    x = torch.randn(8, 32)
    # dL/dout = 1e-6 everywhere: below nvfp4_single's smallest value (2^-10: E4M3 scales)
    report = qt.analyze(layer, x, qt.Recipe(weight=qt.nvfp4_single, grad=qt.nvfp4_single),
                        loss_fn=lambda out: 1e-6 * out.sum(), sensitivity=False)
    rows = {(r["role"], r["tensor"]): r for r in report.tensors}
    w = layer.weight.detach()
    wq = qt.quantize(w, qt.nvfp4_single)
    r = rows[("weight", "weight")]
    assert r["rel_error"] == pytest.approx(_rel(wq, w), rel=1e-9)
    assert r["snr_db"] == pytest.approx(-20 * torch.log10(torch.tensor(_rel(wq, w))).item(),
                                        rel=1e-6)
    assert r["flushed"] == pytest.approx(float(((wq == 0) & (w != 0)).sum()) / w.numel())
    g = rows[("grad", "gradient of the output of the model")]
    assert g["flushed"] == 1.0 and g["rel_error"] == 1.0 and g["snr_db"] == 0.0
    assert g["numel"] == 8 * 4 and g["saturated"] == 0.0 and g["nan"] == 0.0


def test_report_outputs(tmp_path):
    torch.manual_seed(0)
    report = qt.analyze(_mlp(), torch.randn(8, 16), qt.recipes.mxfp6, progress=True,
                        roles=("weight",))
    assert [(r["layer"], r["role"]) for r in report.sensitivity] == [
        ("0", "all"), ("2", "all"), ("0", "weight"), ("2", "weight")]
    text = report.table()
    assert "Sensitivity" in text and "weight operand" in text and "vs_exact_rounded" in text
    layers = {r["layer"]: r for r in report.layers}
    assert layers["0"]["params"] == 16 * 32 + 32 and layers["0"]["outputs"] == 8 * 32
    # 0.weight at its MXFP6 operand format (6.25 bits), 0.bias FP32
    assert layers["0"]["weight_bits"] == pytest.approx((512 * 6.25 + 32 * 32) / 544)
    assert layers["0"]["activation_bits"] == 6.25
    with pytest.raises(ValueError, match="roles must be"):
        qt.analyze(_mlp(), torch.randn(8, 16), qt.recipes.mxfp6, roles=("weights",))
    md = report.markdown()
    assert md.count("|---|") >= 3
    data = json.loads(report.to_json())
    assert {"tensors", "contractions", "sensitivity", "gradients", "overall", "layers"} <= set(data)
    path = tmp_path / "analysis.png"
    report.plot(path)
    assert path.stat().st_size > 10_000


def test_char_gpt_finishes_in_seconds():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
    import common
    torch.manual_seed(0)
    model = common.CharGPT(256, d=32, layers=1, heads=2, context=16)
    idx = torch.randint(0, 256, (2, 16))
    tgt = torch.randint(0, 256, (2, 16))
    loss_fn = lambda o: F.cross_entropy(common.plain(o).reshape(-1, 256), tgt.reshape(-1))  # noqa
    t = time.perf_counter()
    report = qt.analyze(model, idx, qt.recipes.mxfp6, loss_fn)
    assert time.perf_counter() - t < 60  # (a few seconds; generous on a loaded machine)
    assert len(report.sensitivity) == 10 and len(report.contractions) == 5
    assert all(0.9 < r["grad_cos"] <= 1.0 + 1e-9 for r in report.sensitivity)


def test_conv_operands_are_blocked_as_the_contraction_blocks_them():
    # vs_exact_rounded ~ 0 with FP32 sums only if the exact reference rounds the operands along
    # the same axes as the emulated convolution (channels), so the check can fail
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
    import common
    torch.manual_seed(0)
    model = common.DigitsCNN()
    x = torch.randn(4, 1, 8, 8)
    report = qt.analyze(model, x, qt.recipes.direct_cast(MX8), sensitivity=False)
    kinds = {r["type"] for r in report.contractions}
    assert "Conv2d" in kinds and "Linear" in kinds
    for r in report.contractions:
        assert r["vs_exact_rounded"] < 1e-5, r
        assert r["operands"] > 1e-3, r


def test_a_converted_model_is_analysed_with_its_own_recipe():
    model = qt.convert(_mlp(), SPEC)
    report = qt.analyze(model, torch.randn(8, 16), sensitivity=False)
    assert report.spec == SPEC.name or "Recipe" in report.spec
    assert {r["format"] for r in report.tensors if r["role"] == "weight"} == {str(FMT)}
    assert qt.convert.__module__ and hasattr(model, "_qt_conversion")  # left converted


def test_optimizer_state_statistics():
    # one SGD step with momentum: the momentum buffer of the first step is the gradient itself,
    # in the optimizer_state format
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 8)
    x = torch.randn(16, 32)
    recipe = qt.Recipe(weight=qt.fp32, bias=qt.fp32, optimizer_state=FMT)
    report = qt.analyze(layer, x, recipe, sensitivity=False,
                        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    rows = {r["tensor"]: r for r in report.tensors if r["role"] == "optimizer_state"}
    assert set(rows) == {"'momentum_buffer' of weight", "'momentum_buffer' of bias"}
    m = copy.deepcopy(layer)
    loss = 0.5 * m(x).pow(2).mean()
    loss.backward()
    g = m.weight.grad
    assert rows["'momentum_buffer' of weight"]["rel_error"] == pytest.approx(
        _rel(qt.quantize(g, FMT), g), rel=1e-6)
    assert rows["'momentum_buffer' of weight"]["rel_error"] > 1e-3
    with pytest.warns(UserWarning, match="eps=1e-08 rounds to 0"):  # (qtensor says so)
        report = qt.analyze(layer, x, recipe, sensitivity=False,
                            optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3))
    rows = {r["tensor"]: r for r in report.tensors if r["role"] == "optimizer_state"}
    assert 0 < rows["'exp_avg' of weight"]["rel_error"] < 0.2
    # 0.001 g^2 is mostly below FP8 E5M2's smallest value: the report shows it flushed
    assert rows["'exp_avg_sq' of weight"]["flushed"] > 0.5


def test_operand_rows_only_for_weights_that_enter_a_contraction():
    # an embedding table and a LayerNorm scale have the weight role's operand format, but no
    # contraction reads them: no "weight operand" row claims a rounding that never happens
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
    import common
    torch.manual_seed(0)
    model = common.CharGPT(64, d=32, layers=1, heads=2, context=8)
    idx = torch.randint(0, 64, (2, 8))
    report = qt.analyze(model, idx, qt.recipes.direct_cast(MX8), sensitivity=False)
    operands = {r["tensor"] for r in report.tensors if r["role"] == "weight operand"}
    linears = {f"{n}.weight" for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)}
    assert operands == linears


def test_layers_limits_the_rows_and_the_counted_bits():
    model = _mlp()
    x = torch.randn(8, 16)
    report = qt.analyze(model, x, qt.recipes.direct_cast(MX8), layers=["2", "1"])
    assert [r["layer"] for r in report.sensitivity] == ["2", "1"]
    info = {r["layer"]: r for r in report.layers}
    assert info["1"]["params"] == 0 and info["1"]["outputs"] == 8 * 32  # the ReLU
    # bits per weight over layer 2 only: its 32x5 weight at MXFP8's 8.25 bits, its bias at 32
    assert report.bits() == pytest.approx((160 * 8.25 + 5 * 32) / 165)
    with pytest.raises(ValueError, match="not modules of the model"):
        qt.analyze(model, x, qt.recipes.direct_cast(MX8), layers=["3"])


@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_clipped_by_the_block_scale_against_a_per_block_oracle(rule):
    from oracles import block_clipping
    fp4 = qt.format("mxfp4_e2m1").replace(scale_rule=rule)
    layer = torch.nn.Linear(64, 10)
    torch.manual_seed(0)
    x = torch.randn(128, 64)
    y = torch.randint(0, 10, (128,))
    seen = {}  # the values the converted copy rounded

    def keep(role, name, formats, before, after):
        seen[(role, name)] = after.clone()
    # the demo's recipe: FP32 weights and BF16 gradients, MXFP4 operands
    with qt.tensor.flush_warnings.observe(keep):
        report = qt.analyze(layer, x, qt.Recipe(weight=(qt.fp32, fp4), grad=(qt.bf16, fp4)),
                            loss_fn=lambda out: F.cross_entropy(out, y), sensitivity=False)
    rows = {(r["role"], r["tensor"]): r for r in report.tensors}
    w = layer.weight.detach()
    n, lost = block_clipping(w.double().tolist(), rule, 6.0, 2, bs=32)
    r = rows[("weight operand", "weight")]
    assert r["clipped"] == pytest.approx(n / w.numel()) and r["clip_loss"] == pytest.approx(
        lost / float(w.abs().double().sum()), rel=1e-5)
    # dL/dlogits in BF16, blocked along the classes as the dgrad GEMM's operand
    g = seen[("grad", "gradient of the output of the model")]
    n, lost = block_clipping(g.double().tolist(), rule, 6.0, 2, bs=32)
    r = rows[("grad operand", "gradient of the output of the model")]
    assert r["clipped"] == pytest.approx(n / g.numel()) and r["clip_loss"] == pytest.approx(
        lost / float(g.abs().double().sum()), rel=1e-5)
    if rule == "floor":  # the true class's p - 1 of most rows: one value of ten
        assert r["clipped"] > 0.05 and r["clip_loss"] > 0.03
    else:
        assert r["clipped"] == 0 and r["clip_loss"] == 0
    assert rows[("grad", "gradient of the output of the model")]["clipped"] == 0  # BF16
    for text in (report.table(), report.markdown()):
        assert "clipped" in text and "clip_loss" in text
    data = {(t["role"], t["tensor"]): t for t in json.loads(report.to_json())["tensors"]}
    assert data[("grad operand", "gradient of the output of the model")]["clipped"] == r["clipped"]


def test_the_demos_mxfp4_gradient_clipping_is_in_the_report():
    # examples/demo.py's MXFP4 recipe: the ops give the module outputs and their gradients
    # in their formats already (BF16 values, MXFP4 operands); their operand rounding is
    # measured all the same
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    rows = {}
    for rule in ("floor", "ceil"):
        f = qt.format("mxfp4_e2m1").replace(scale_rule=rule)
        spec = qt.recipes.mxfp6.replace(weight=(qt.fp32, f), activation=(qt.bf16, f),
                                        grad=(qt.bf16, f))
        report = qt.analyze(model, x, spec, lambda out: F.cross_entropy(out, y),
                            sensitivity=False)
        rows[rule] = {(r["role"], r["tensor"]): r for r in report.tensors}
    key = ("grad operand", "gradient of the output of 2")
    assert rows["floor"][key]["clipped"] == pytest.approx(0.1, abs=0.01)
    assert rows["floor"][key]["clip_loss"] > 0.05
    assert rows["ceil"][key]["clipped"] == 0 and rows["ceil"][key]["rel_error"] > 0


def _gemm_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 8))


def test_analyze_sees_the_formats_each_gemm_uses():
    # nvfp4_nvidia: bf16 roles, NVFP4 operands in every Linear's three GEMMs (Recipe.gemm)
    model, x = _gemm_mlp(), torch.randn(32, 64)
    recipe = qt.recipes.nvfp4_nvidia
    report = qt.analyze(model, x, recipe)
    row = next(r for r in report.contractions if r["layer"] == "0")
    fx, fw = recipe.gemm["linear"].fprop_x, recipe.gemm["linear"].fprop_w
    assert row["operand_formats"] == f"{fx} x {fw}"
    xb = qt.quantize(x, qt.bf16)  # the input as the layer receives it (the activation role)
    xq = qt.quantize(xb, fx.replace(axis=-1))
    w = model[0].weight.detach()
    wq = qt.quantize(w, fw)
    ref = xb.double() @ w.double().T
    assert row["operands"] == pytest.approx(_rel(xq.double() @ wq.double().T, ref), rel=1e-6)
    assert row["operands"] > 0.05  # NVFP4, not the bf16 roles
    gemms = {(r["layer"], r["gemm"]): r for r in report.backward}
    assert "stochastic" in gemms[("0", "dgrad")]["operand_formats"]
    assert "Hadamard" in gemms[("0", "wgrad")]["operand_formats"]
    assert gemms[("0", "wgrad")]["operands"] > 0.05
    # the weight bits are those of its forward GEMM's format (bias: FP32)
    info = {i["layer"]: i for i in report.layers}
    assert info["0"]["weight_bits"] == pytest.approx((4096 * fw.bits + 64 * 32) / 4160)
    assert info["4"]["weight_bits"] == pytest.approx((512 * 16 + 8 * 32) / 520)  # last_layers
    # the one-layer run gives the layer its GEMM formats: its KL is NVFP4's, not bf16's
    sens = {r["layer"]: r for r in report.sensitivity}
    assert sens["0"]["kl"] > 1e-5 and sens["0"]["kl"] > 100 * sens["4"]["kl"]


def test_analyze_in_training_mode_measures_no_dropout_noise():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.5),
                                torch.nn.Linear(32, 8)).train()
    x = torch.randn(8, 16)
    rng = torch.get_rng_state()
    report = qt.analyze(model, x, qt.Recipe.uniform(qt.fp32))
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's stream is untouched
    assert report.overall["kl"] == 0 and report.overall["grad_cos"] == pytest.approx(1, abs=1e-12)
    assert all(r["kl"] == 0 for r in report.sensitivity)
    # stochastic rounding before the dropout draws no dropout mask of its own
    sr = qt.Recipe(activation=qt.bf16.replace(rounding="stochastic"))
    report = qt.analyze(model, x, sr)
    assert report.overall["kl"] < 1e-4 and report.overall["grad_cos"] > 0.999


def test_analyze_a_model_without_parameters():
    report = qt.analyze(torch.nn.Sequential(torch.nn.Softmax(-1)), torch.randn(4, 8), qt.bf16)
    assert report.overall["kl"] > 0 and report.layers == [] and report.sensitivity == []


def test_a_tied_head_weight_counts_as_the_heads_gemm_operand():
    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 64)
            self.head = torch.nn.Linear(64, 32, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, i):
            return self.head(self.emb(i))

    torch.manual_seed(0)
    report = qt.analyze(LM(), torch.randint(0, 32, (4, 8)), qt.recipes.direct_cast(MX8))
    info = {i["layer"]: i for i in report.layers}
    assert info["head"]["params"] == 32 * 64 and info["head"]["weight_bits"] == MX8.bits
    assert info["emb"]["params"] == 0  # counted once, at the head
    assert report.bits() == MX8.bits


def test_the_analysis_modules_keep_the_names_they_had_and_a_pickled_report_loads():
    # qtensor.analysis.analyze and .ptq had these names before their parts became modules of
    # their own (examples and user code import them from there; pickles name the report there)
    import importlib
    import pickle

    from qtensor.analysis import analyze, contractions, layers, ptq, report, sensitivity
    for name in ("analyze", "AnalysisReport", "CONTRACTIONS", "convert_one_layer", "gemm_part",
                 "contraction_errors", "ROLES", "COUNTABLE", "ROLE_GEMM_FIELDS", "conversion_of"):
        assert hasattr(analyze, name), name
    assert analyze.AnalysisReport is report.AnalysisReport and qt.AnalysisReport is report.AnalysisReport
    assert analyze.CONTRACTIONS is contractions.CONTRACTIONS and analyze.ROLES is layers.ROLES
    assert analyze.convert_one_layer is sensitivity.convert_one_layer
    for name in ptq.__all__:
        assert hasattr(ptq, name), name
    assert qt.gptq is ptq.gptq and qt.error_diffusion is ptq.error_diffusion
    r = qt.analyze(_mlp(), torch.randn(8, 16), SPEC, sensitivity=False)
    # a report pickled when AnalysisReport lived in qtensor.analysis.analyze
    data = pickle.dumps(r, protocol=0).replace(b"qtensor.analysis.report\n",
                                               b"qtensor.analysis.analyze\n")
    assert b"qtensor.analysis.analyze\n" in data
    back = pickle.loads(data)
    assert importlib.import_module(type(back).__module__) is report
    assert back.to_json() == r.to_json() and back.table() == r.table()

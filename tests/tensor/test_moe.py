"""Grouped GEMMs (torch._grouped_mm / F.grouped_mm, the experts of mixture-of-experts layers) on
converted models: each expert's GEMMs bit for bit those of a loop over converted nn.Linear layers
with the same formats, forward and backward (docs/moe.md)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qtensor as qt


def _bits(t):
    t = t.dequantize() if isinstance(t, qt.QTensor) else t
    return t.detach().contiguous().view(torch.int32)


def _same(a, b):
    return torch.equal(_bits(a), _bits(b))


class Experts(nn.Module):
    """Experts as transformers stores them: one (E, N, K) weight, tokens sorted by expert."""

    def __init__(self, E, K, N, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(E, N, K, generator=g) / K ** 0.5)

    def forward(self, x, offs):
        return F.grouped_mm(x, self.weight.transpose(-2, -1), offs=offs)


def _linears(experts):
    """One nn.Linear per expert, with the expert's (unconverted) weight."""
    out = []
    for w in experts.weight.detach():
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
        with torch.no_grad():
            lin.weight.copy_(w)
        out.append(lin)
    return out


def _offsets(counts):
    return torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)


_ACC = qt.recipes.mxfp8_pretraining.replace(accumulate="hopper_fp8", name=None)
RECIPES = {
    "mxfp6": qt.recipes.mxfp6,
    "mxfp8_pretraining": qt.recipes.mxfp8_pretraining,
    "nvfp4_tensor_scale": qt.Recipe(weight=("fp32", "nvfp4"), activation=("bf16", "nvfp4"),
                                    grad=("bf16", "nvfp4")),
    "accumulate": _ACC,
    # per-GEMM formats (Recipe.gemm), each GEMM's operands in formats of their own
    "gemm": qt.Recipe(weight=("fp32", "bf16"), activation=("bf16", "bf16"), grad=("bf16", "bf16"),
                      gemm={"fprop": (qt.mxfp8_e4m3, qt.mxfp4_e2m1),
                            "dgrad": (qt.mxfp6_e3m2, qt.mxfp8_e5m2),
                            "wgrad": (qt.mxfp4_e2m1, qt.mxfp6_e2m3),
                            "transform": {"wgrad": qt.Hadamard(16, signs=None)}}),
    "deepseek_v3_fp8": qt.recipes.deepseek_v3_fp8,
}


def _run_grouped_and_loop(recipe, counts, K=64, N=48, seed=0):
    E = len(counts)
    torch.manual_seed(seed)
    experts = Experts(E, K, N, seed)
    lins = _linears(experts)
    qt.convert(experts, recipe)
    for lin in lins:
        qt.convert(lin, recipe)
    M = sum(counts)
    x = torch.randn(M, K)
    gy = torch.randn(M, N)
    offs = _offsets(counts)
    xg = x.clone().requires_grad_(True)
    y = experts(xg, offs)
    (y.dequantize() * gy).sum().backward()
    ys, gxs = [], []
    start = 0
    for lin, n in zip(lins, counts):
        xi = x[start:start + n].clone().requires_grad_(True)
        yi = lin(xi)
        (yi.dequantize() * gy[start:start + n]).sum().backward()
        ys.append(yi)
        gxs.append(xi.grad)
        start += n
    return experts, lins, y, xg.grad, ys, gxs


@pytest.mark.parametrize("name", list(RECIPES))
def test_grouped_mm_is_a_loop_of_linears(name):
    """Forward output, input gradient and each expert's weight gradient: the bits of a loop
    over converted nn.Linear layers with the same formats (an expert without tokens too)."""
    counts = [5, 0, 11, 7]
    experts, lins, y, gx, ys, gxs = _run_grouped_and_loop(RECIPES[name], counts)
    start = 0
    for g, n in enumerate(counts):
        assert _same(y[start:start + n], ys[g]), f"forward of expert {g}"
        assert _same(gx[start:start + n], gxs[g]), f"dgrad of expert {g}"
        if n:
            assert _same(experts.weight.grad[g], lins[g].weight.grad), f"wgrad of expert {g}"
        else:
            assert not experts.weight.grad[g].dequantize().any()
        start += n


def test_grouped_mm_operands_are_rounded():
    """The regression: _grouped_mm on QTensors ran without its operands' rounding."""
    counts = [6, 10]
    x = torch.randn(16, 64)
    w = torch.randn(2, 64, 32)
    offs = _offsets(counts)
    fmt = qt.mxfp4_e2m1
    qx = qt.as_qtensor(x, "fp32", mm_fmt=fmt)
    qw = qt.as_qtensor(w, "fp32", mm_fmt=fmt)
    y = torch._grouped_mm(qx, qw, offs)
    rx = qt.quantize(x, fmt.replace(axis=-1))
    rw = qt.quantize(w, fmt.replace(axis=-2))
    ref = torch.cat([rx[:6] @ rw[0], rx[6:] @ rw[1]])
    assert _same(y, ref)
    assert not _same(y, torch._grouped_mm(x, w, offs))


# ---------------------------------------------------------------------------------------------
# Hugging Face MoE models (tiny configs, random init, no download)

transformers = pytest.importorskip("transformers")
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402


def _tiny(family, impl="grouped_mm", seed=0):
    torch.manual_seed(seed)
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64, num_experts_per_tok=2)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32,
                                          head_dim=16, num_experts=4, **common)
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "olmoe":
        cfg = transformers.OlmoeConfig(intermediate_size=32, num_experts=4, **common)
        cls = transformers.OlmoeForCausalLM
    else:
        cfg = transformers.MixtralConfig(intermediate_size=32, num_local_experts=4, **common)
        cls = transformers.MixtralForCausalLM
    cfg._experts_implementation = impl
    return cls(cfg)


FAMILIES = ["qwen3_moe", "olmoe", "mixtral"]


def _train_step_without_leaks(model):
    """One AdamW step of the converted model under leak_check: no finding."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 8))
    with sdpa_kernel(SDPBackend.MATH), qt.leak_check(action="record", optimizer=opt,
                                                     allow=qt.hf.LEAK_ALLOW) as report:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    assert not report.findings, report.summary()


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_moe_trains_without_leaks(family):
    """A new user's run: a tiny MoE model converted to MXFP6, one training step under
    leak_check: the expert GEMMs are contractions (before: run without their MXFP6 operand
    rounding, and the router's histc reported as a plain op)."""
    model = _tiny(family)
    assert model.config._experts_implementation == "grouped_mm"
    qt.convert(model, qt.recipes.mxfp6)
    _train_step_without_leaks(model)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts.down_proj, qt.QTensor) and experts.down_proj.grad is not None


def _experts_reference(exp, hs, idx, wts, gate_up, down):
    """transformers' grouped_mm_experts_forward with each expert's two GEMMs as converted
    nn.Linear layers (gate_up[g], down[g]) on that expert's tokens."""
    k, T = idx.size(-1), hs.size(0)
    ids, sw = idx.reshape(-1), wts.reshape(-1)
    ids_g, perm = torch.sort(ids)
    x, sw_g = hs[perm // k], sw[perm]
    outs = []
    counts = torch.bincount(ids_g, minlength=len(down)).tolist()
    # (split: one autograd node, whose backward concatenates the experts' input gradients)
    for g, xg in enumerate(x.split(counts)):
        if counts[g]:
            h = gate_up[g](xg)
            gate, up = h.chunk(2, dim=-1)
            outs.append(down[g](exp.act_fn(gate) * up))
    y = torch.cat(outs) * sw_g.unsqueeze(-1)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.size(0))
    return y[inv].view(T, k, -1).sum(dim=1)


def _eager_reference(exp, hs, idx, wts, gate_up, down):
    """transformers' eager experts loop (index, F.linear per expert, index_add_) with each
    F.linear a converted nn.Linear."""
    final = torch.zeros_like(hs)
    mask = F.one_hot(idx, num_classes=len(down) + 1).permute(2, 1, 0)
    for g in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist():
        if g == len(down):
            continue
        pos, tok = torch.where(mask[g])
        gate, up = gate_up[g](hs[tok]).chunk(2, dim=-1)
        cur = down[g](exp.act_fn(gate) * up) * wts[tok, pos, None]
        final.index_add_(0, tok, cur.to(final.dtype))
    return final


def _linear_of(w, recipe):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    return qt.convert(lin, recipe)


def _converted_experts(family, impl, recipe):
    """(model, its first experts module, converted; the same experts as converted nn.Linear
    layers, gate_up and down; a routing of 12 tokens to 2 experts each, idx and plain weights;
    the tokens in the activation role; the generator, to draw more)."""
    model = _tiny(family, impl)
    exp = model.model.layers[0].mlp.experts
    gu0, dn0 = exp.gate_up_proj.detach().clone(), exp.down_proj.detach().clone()
    qt.convert(model, recipe)
    gate_up = [_linear_of(w, recipe) for w in gu0]
    down = [_linear_of(w, recipe) for w in dn0]
    T, E, k = 12, gu0.shape[0], 2
    g = torch.Generator().manual_seed(1)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g)
    act = recipe.activation
    hs = qt.as_qtensor(torch.randn(T, 32, generator=g), act.fmt, mm_fmt=act.mm_fmt)
    return model, exp, gate_up, down, idx, wts, hs, g


@pytest.mark.parametrize("family,impl", [("qwen3_moe", "grouped_mm"), ("olmoe", "grouped_mm"),
                                         ("qwen3_moe", "eager"), ("mixtral", "eager")])
@pytest.mark.parametrize("recipe", ["mxfp6", "nvfp4_tensor_scale", "gemm"])
def test_hf_experts_are_a_loop_of_linears(family, impl, recipe):
    """An HF experts module of a converted model (transformers' grouped_mm implementation, and
    its eager per-expert loop): output, input gradient and each expert's weight gradients bit
    for bit those of the same experts run as converted nn.Linear layers, one per expert and
    GEMM (per-GEMM formats of Recipe.gemm included)."""
    recipe = RECIPES[recipe]
    model, exp, gate_up, down, idx, wts, hs, g = _converted_experts(family, impl, recipe)
    T, E, act = len(idx), len(down), recipe.activation
    h1, h2 = hs.clone().requires_grad_(True), hs.clone().requires_grad_(True)
    # (in the grad role's values already: the module's output hook rounds the gradient it gets)
    gy = torch.randn(T, 32, generator=g).bfloat16().float()
    y = exp(h1, idx, qt.as_qtensor(wts, act.fmt, mm_fmt=act.mm_fmt))
    reference = _experts_reference if impl == "grouped_mm" else _eager_reference
    ref = reference(exp, h2, idx, qt.as_qtensor(wts, act.fmt, mm_fmt=act.mm_fmt), gate_up, down)
    ref = qt.nn.plans.round_to(ref, act)
    assert _same(y, ref)
    (y.dequantize() * gy).sum().backward()
    (ref.dequantize() * gy).sum().backward()
    assert _same(h1.grad, h2.grad)
    for e in range(E):
        assert _same(exp.gate_up_proj.grad[e], gate_up[e].weight.grad), f"expert {e} gate_up"
        assert _same(exp.down_proj.grad[e], down[e].weight.grad), f"expert {e} down"


def _batched_reference(exp, hs, idx, wts, gate_up, down):
    """transformers' batched_mm experts forward (each token repeated per chosen expert, that
    expert's weights gathered, a bmm per token, the weighted top-k sum) with each token's GEMMs
    a converted nn.Linear of its expert."""
    T, k = idx.shape
    outs = []
    for s, e in enumerate(idx.reshape(-1).tolist()):
        x = hs[s // k:s // k + 1]
        gate, up = gate_up[e](x).chunk(2, dim=-1)
        outs.append(down[e](exp.act_fn(gate) * up))
    return (torch.cat(outs) * wts.reshape(-1).unsqueeze(-1)).view(T, k, -1).sum(dim=1)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("recipe", ["mxfp6", "gemm"])
def test_hf_batched_mm_experts_are_linears_per_token(family, recipe):
    """transformers' batched_mm experts (torch.bmm of each token with its expert's gathered
    weights, the weight as the first operand): each GEMM is that expert's linear layer's (the
    output in the activation's value format, not the weight's; Recipe.gemm's per-GEMM formats on
    the gathered weights), bit for bit against converted nn.Linear layers, forward; no leak in a
    training step of the whole model."""
    recipe = RECIPES[recipe]
    model, exp, gate_up, down, idx, wts, hs, _ = _converted_experts(family, "batched_mm", recipe)
    act = recipe.activation
    wts = qt.as_qtensor(wts, act.fmt, mm_fmt=act.mm_fmt)
    with torch.no_grad():
        y = exp(hs, idx, wts)
        ref = qt.nn.plans.round_to(_batched_reference(exp, hs, idx, wts, gate_up, down), act)
    assert _same(y, ref)
    _train_step_without_leaks(model)
    assert exp.gate_up_proj.grad is not None and exp.down_proj.grad is not None


# ---------------------------------------------------------------------------------------------
# leak_check: a contraction that ignores its operands' formats is reported

def _without_rule(monkeypatch, packet, overload):
    """dispatch as it was before grouped GEMMs had their rule: the op computes as one op."""
    from qtensor.tensor import dispatch
    monkeypatch.setitem(dispatch.OPS, packet, dispatch.OpRule())
    monkeypatch.delattr(overload, "_qtensor_rule", raising=False)
    monkeypatch.setitem(dispatch._RULES, overload, dispatch.Rule(overload))
    monkeypatch.setattr(overload, "_qtensor_rule", dispatch._RULES[overload], raising=False)


def _grouped_report(family="qwen3_moe"):
    model = _tiny(family)
    qt.convert(model, qt.recipes.mxfp6)
    ids = torch.randint(0, 64, (2, 8))
    with sdpa_kernel(SDPBackend.MATH), qt.leak_check(action="record",
                                                     allow=qt.hf.LEAK_ALLOW) as report:
        model(input_ids=ids, labels=ids).loss.backward()
    return report


def test_leak_check_reports_a_grouped_gemm_without_its_rule(monkeypatch):
    """The silent leak, made visible: with _grouped_mm computing as a plain op (its
    operands unrounded), leak_check reports each expert GEMM, forward and backward."""
    _without_rule(monkeypatch, "_grouped_mm", torch.ops.aten._grouped_mm.default)
    report = _grouped_report()
    found = [f for f in report.findings if f.op == "aten._grouped_mm.default"]
    assert {f.kind for f in found} == {"fused"}, report.summary()
    assert {f.phase for f in found} == {"forward", "backward"}
    assert "mxfp6_e3m2" in found[0].message and "no contraction rule" in found[0].message


def test_leak_check_reports_bilinear():
    """F.bilinear's _trilinear has no contraction rule: its operand formats are not applied,
    and leak_check says so (forward and backward)."""
    m = qt.convert(nn.Bilinear(8, 8, 4), qt.recipes.mxfp6)
    with qt.leak_check(action="record") as report:
        m(torch.randn(3, 8), torch.randn(3, 8)).sum().backward()
    assert [f.op for f in report.findings] == ["aten._trilinear.default"] * 2, report.summary()
    assert all(f.kind == "fused" for f in report.findings)


# ---------------------------------------------------------------------------------------------
# Layouts and bad input

def _q(x, fmt=qt.mxfp8_e4m3, value="fp32"):
    return qt.as_qtensor(x, value, mm_fmt=fmt)


def test_grouped_mm_layouts_are_loops_of_mm():
    """Every layout torch._grouped_mm takes, on QTensors: each group the mm of that group's
    slices of the operands, rounded along that group's K (2D x 2D: K is split by offs, so each
    group's blocks start at its own first K index)."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: _q(torch.randn(*s, generator=g))  # noqa: E731
    offs = _offsets([40, 0, 56])
    # 3D x 3D
    a, b = r(3, 5, 64), r(3, 64, 8)
    assert _same(torch._grouped_mm(a, b), torch.bmm(a, b))
    # 2D x 2D: A (M, Ktot), B (Ktot, N), K split by offs -> (G, M, N)
    a, b = r(8, 96), r(96, 16)
    out = torch._grouped_mm(a, b, offs)
    assert _same(out[0], a[:, :40] @ b[:40]) and _same(out[2], a[:, 40:] @ b[40:])
    assert not out[1].dequantize().any()
    # (blocks over the whole K would differ: group 0 ends inside a block of 32)
    rq = lambda x, ax: qt.quantize(x.dequantize(), qt.mxfp8_e4m3.replace(axis=ax))  # noqa: E731
    assert not torch.allclose(out[2].dequantize(), rq(a, -1)[:, 40:] @ rq(b, 0)[40:],
                              rtol=0, atol=1e-5)
    # 3D x 2D: A (G, M, K), B (K, Ntot), N split by offs -> (M, Ntot)
    a, b = r(3, 5, 64), r(64, 96)
    out = torch._grouped_mm(a, b, offs)
    assert _same(out[:, :40], a[0] @ b[:, :40]) and _same(out[:, 40:], a[2] @ b[:, 40:])


def test_grouped_mm_rows_past_the_last_offset_are_zero():
    """Tokens past offs[-1] belong to no expert (expert-parallel sentinels): zero rows, where
    torch leaves them uninitialized."""
    x, w = torch.randn(12, 32), torch.randn(2, 32, 8)
    out = torch._grouped_mm(_q(x), _q(w), _offsets([3, 5]))
    assert not out[8:].dequantize().any() and out[:8].dequantize().any()


@pytest.mark.parametrize("counts,match", [
    ([3, 5, 6], "offs do not match the tokens: the last group ends at 14, past the 12 tokens"),
    ([3, 5], "offs has 2 entries for 3 groups"),
])
def test_grouped_mm_offsets_that_do_not_match_the_tokens(counts, match):
    x, w = _q(torch.randn(12, 32)), _q(torch.randn(3, 32, 8))
    with pytest.raises(ValueError, match=match):
        F.grouped_mm(x, w, offs=_offsets(counts))


def test_grouped_mm_bad_offsets():
    x, w = _q(torch.randn(12, 32)), _q(torch.randn(2, 32, 8))
    with pytest.raises(ValueError, match="non-decreasing"):
        F.grouped_mm(x, w, offs=torch.tensor([8, 4], dtype=torch.int32))
    with pytest.raises(TypeError, match="offs must be int32"):
        F.grouped_mm(x, w, offs=torch.tensor([4, 8]))
    with pytest.raises(ValueError, match="pass offs"):
        torch._grouped_mm(x, w)


def test_grouped_mm_2d_tiles_straddling_experts():
    """Tokens whose value format is in 2D tiles across the token dim: a tile of rows that holds
    two experts' tokens had its scale taken across them. An error, naming the boundaries."""
    tiles = qt.BlockFormat(qt.fp8_e4m3, block_shape=(4, 16), scale="fp32", scale_rule="amax")
    x = qt.as_qtensor(torch.randn(12, 32), tiles)
    w = _q(torch.randn(2, 32, 8))
    with pytest.raises(ValueError, match=r"straddle experts: group boundaries \[6\]"):
        torch._grouped_mm(x, w, _offsets([6, 6]))
    torch._grouped_mm(x, w, _offsets([8, 4]))  # boundaries on whole tiles


# ---------------------------------------------------------------------------------------------
# Rules, compile

def test_rules_address_router_and_experts():
    """The router is a module of its own (a rule keeps it in high precision: FP32 values and
    operands), the experts' stacked weights are addressed by "*.experts.*"; leak_check has
    nothing to say."""
    model = _tiny("qwen3_moe")
    recipe = qt.recipes.mxfp6.replace(rules={"*.mlp.gate": "fp32",
                                             "*.experts.*": {"weight": ("fp32", "mxfp4_e2m1")}})
    qt.convert(model, recipe, strict=True)
    mlp = model.model.layers[0].mlp
    assert mlp.gate.weight.mm_fmt is None and mlp.gate.weight.fmt == qt.fp32
    logits = mlp.gate(torch.randn(5, 32))[0]
    assert logits.fmt == qt.fp32 and logits.mm_fmt is None
    assert mlp.experts.gate_up_proj.mm_fmt == qt.mxfp4_e2m1
    assert mlp.experts.down_proj.mm_fmt == qt.mxfp4_e2m1
    ids = torch.randint(0, 64, (2, 8))
    with sdpa_kernel(SDPBackend.MATH), qt.leak_check(action="record",
                                                     allow=qt.hf.LEAK_ALLOW) as report:
        model(input_ids=ids, labels=ids).loss.backward()
    assert not report.findings, report.summary()


@pytest.mark.parametrize("recipe", ["mxfp6", "accumulate"])
def test_grouped_mm_compiles_bit_identical(recipe):
    """torch.compile (aot_eager) of a converted experts module: the same bits as eager, forward
    and backward (the groups are one opaque op: their sizes are data)."""
    counts = [5, 0, 11, 7]
    offs = _offsets(counts)
    x = torch.randn(23, 64)
    gy = torch.randn(23, 48)
    outs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        experts = qt.convert(Experts(4, 64, 48), RECIPES[recipe])

        def run(x):
            return experts(x, offs).dequantize()
        if compiled:
            run = torch.compile(run, backend="aot_eager")
        xi = x.clone().requires_grad_(True)
        y = run(xi)
        (y * gy).sum().backward()
        outs.append((y, xi.grad, experts.weight.grad))
    for a, b in zip(*outs):
        assert _same(a, b)


def test_hf_moe_compiles_bit_identical():
    """A converted Qwen3-MoE under torch.compile (aot_eager): transformers runs its experts through
    its grouped_mm_fallback ops there (non-bf16 weights), also contractions: the loss and the
    expert weights' gradients are eager's bits."""
    ids = torch.randint(0, 64, (2, 8))
    res = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = qt.convert(_tiny("qwen3_moe"), qt.recipes.mxfp6)
        run = torch.compile(model, backend="aot_eager") if compiled else model
        with sdpa_kernel(SDPBackend.MATH):
            loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
        exp = model.model.layers[0].mlp.experts
        res.append((loss, exp.gate_up_proj.grad, exp.down_proj.grad))
    for a, b in zip(*res):
        assert _same(a, b)

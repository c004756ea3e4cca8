"""Attention as a role (Recipe.attention, qt.attention): F.scaled_dot_product_attention under
every SDPA backend, nn.MultiheadAttention and Hugging Face's SDPA attention of a converted model
give, bit for bit, forward and backward, a hand-written attention with explicit roundings:
causal, padding and float masks, GQA, dropout; the presets; bad input."""
import math
import os

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import qtensor as qt
from helpers import assert_bits_equal
from qtensor.tensor.attention import AttentionFormats
from qtensor.formats.block import BlockFormat

F = nn.functional
BACKENDS = {"default": None, "math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}
FORMATS = {
    "fa3_fp8": qt.recipes.fa3_fp8_attention,
    "mx_mxfp8": qt.recipes.mx_attention("mxfp8_e4m3"),
    "every_field": AttentionFormats(
        qk=("mxfp8_e4m3", "mxfp6_e3m2"), pv=("fp8_e4m3", "mxfp8_e5m2"),
        dq=("mxfp8_e5m2", "mxfp8_e4m3"), dk=("mxfp6_e2m3", "bf16"), dv=("fp16", "mxfp8_e5m2"),
        dp=("mxfp8_e5m2", "mxfp4_e2m1"), scores="bf16", probs="fp16", softmax="bf16",
        ds="fp8_e5m2"),
}


# ---------------------------------------------------------------------------------------------
# The hand-written attention: whole tensors, every rounding spelled out. An operand rounded
# along dim -2 is rounded as its transpose along dim -1.

def _r(x, fmt):
    """x rounded to fmt along its last dim (None: not rounded)."""
    if fmt is None:
        return x
    if isinstance(fmt, BlockFormat) and fmt.axis is not None:
        fmt = fmt.replace(axis=-1)
    return qt.quantize(x.contiguous(), fmt)


def _rT(x, fmt):
    """x rounded along dim -2, given transposed (x^T rounded along its last dim)."""
    return _r(x.transpose(-2, -1), fmt)


def reference(q, k, v, fm, *, mask=None, causal=False, scale=None, keep=None, p=0.0, dout=None,
              out_fmt=qt.bf16, grad_fmt=qt.bf16):
    """(O, P after dropout, dQ, dK, dV) of attention with the roundings of fm (plain tensors)."""
    hq, hk = q.shape[-3], k.shape[-3]
    rep = hq // hk
    k_, v_ = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1 / math.sqrt(E) if scale is None else scale
    s = (_r(q, fm.qk[0]) @ _r(k_, fm.qk[1]).transpose(-2, -1)) * scale
    if causal:
        mask = torch.ones(L, S, dtype=torch.bool).tril()
    if mask is not None:
        s = torch.where(mask, s, -math.inf) if mask.dtype == torch.bool else s + mask
    s = _r(s, fm.scores)
    # softmax, each step in fm.softmax; all -inf rows give 0
    m = s.amax(-1, keepdim=True)
    dead = m == -math.inf
    x = _r(s - torch.where(dead, 0.0, m), fm.softmax)
    e = _r(torch.exp(x), fm.softmax)
    P = _r(torch.where(dead, 0.0, _r(e / _r(e.sum(-1, keepdim=True), fm.softmax), fm.softmax)),
           fm.probs)
    ks = 1.0 / (1.0 - p)
    Pd = P if keep is None else P * (keep * ks)
    o = _r(Pd, fm.pv[0]) @ _rT(v_, fm.pv[1]).transpose(-2, -1)
    o = _r(o, out_fmt)
    if dout is None:
        return o, Pd
    dv = _rT(Pd, fm.dv[0]) @ _rT(dout, fm.dv[1]).transpose(-2, -1)
    dPd = _r(dout, fm.dp[0]) @ _r(v_, fm.dp[1]).transpose(-2, -1)
    dP = dPd if keep is None else dPd * (keep * ks)
    ds = _r(P * (dP - (P * dP).sum(-1, keepdim=True)), fm.ds)
    dq = (_r(ds, fm.dq[0]) @ _rT(k_, fm.dq[1]).transpose(-2, -1)) * scale
    dk = (_rT(ds, fm.dk[0]) @ _rT(q, fm.dk[1]).transpose(-2, -1)) * scale
    if rep > 1:
        dk = dk.unflatten(-3, (hk, rep)).sum(-3)
        dv = dv.unflatten(-3, (hk, rep)).sum(-3)
    dmask = None if mask is None or mask.dtype == torch.bool else _r(
        ds.sum_to_size(mask.shape), grad_fmt)
    return o, Pd, _r(dq, grad_fmt), _r(dk, grad_fmt), _r(dv, grad_fmt), dmask


def _keep(shape, p):
    return torch.empty(shape).bernoulli_(1.0 - p)


# ---------------------------------------------------------------------------------------------
# F.scaled_dot_product_attention in a converted model

class _SDPA(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.kw)


def _case(name):
    """(q, k, v, mask, sdpa kwargs, dropout p) of a case: B=2, L=S=48, E=32."""
    torch.manual_seed(0)
    hq, hk = (4, 2) if name == "gqa" else (2, 2)
    q, k, v = (qt.quantize(torch.randn(2, h, 48, 32), qt.bf16) for h in (hq, hk, hk))
    kw, mask, p = {}, None, 0.0
    if name in ("causal", "gqa"):
        kw["is_causal"] = True
    if name == "gqa":
        kw["enable_gqa"] = True
    if name == "padding":  # keys past each sequence's length are padding
        lengths = torch.tensor([48, 30])
        mask = (torch.arange(48)[None, :] < lengths[:, None])[:, None, None, :].expand(2, 1, 48, 48)
    if name == "float_mask":
        mask = qt.quantize(torch.randn(48, 48), qt.bf16)
    if name == "dropout":
        p = kw["dropout_p"] = 0.25
    if name == "scale":
        kw["scale"] = 0.3
    return q, k, v, mask, kw, p


CASES = ["none", "causal", "padding", "float_mask", "gqa", "dropout", "scale"]


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("fname", list(FORMATS))
def test_sdpa_is_the_hand_written_attention(fname, case, backend):
    fm = FORMATS[fname]
    q, k, v, mask, kw, p = _case(case)
    model = qt.convert(_SDPA(**kw), qt.Recipe(activation=qt.bf16, grad=qt.bf16, attention=fm))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if mask is not None and mask.dtype != torch.bool:  # a learned additive bias
        mask = mask.clone().requires_grad_()
    dout = qt.quantize(torch.randn(q.shape[:-1] + (32,)), qt.bf16)
    state = torch.get_rng_state()
    ctx = sdpa_kernel(BACKENDS[backend]) if BACKENDS[backend] is not None else _null()
    with ctx, qt.leak_check():
        out = model(*leaves, mask)
        (out.dequantize() * dout).sum().backward()
    torch.set_rng_state(state)
    keep = _keep(q.shape[:-1] + (48,), p) if p else None
    o, _, dq, dk, dv, dmask = reference(q, k, v, fm, mask=None if mask is None else mask.detach(),
                                        causal=kw.get("is_causal", False), scale=kw.get("scale"),
                                        keep=keep, p=p, dout=dout)
    assert isinstance(out, qt.QTensor) and out.fmt == qt.bf16
    assert_bits_equal(out.dequantize(), o)
    if dmask is not None:
        leaves, want = leaves + [mask], (dq, dk, dv, dmask)
    else:
        want = (dq, dk, dv)
    for leaf, w in zip(leaves, want):
        g = leaf.grad.dequantize() if isinstance(leaf.grad, qt.QTensor) else leaf.grad
        assert_bits_equal(g, w)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_the_formats_are_applied():
    """(The comparison above is not trivially met: the formats change the bits.)"""
    q, k, v, mask, kw, p = _case("causal")
    outs = []
    for fm in (AttentionFormats(), qt.recipes.fa3_fp8_attention):
        o, _ = reference(q, k, v, fm, causal=True)
        outs.append(o)
        model = qt.convert(_SDPA(**kw), qt.Recipe(activation=qt.bf16, attention=fm))
        with torch.no_grad():
            assert_bits_equal(model(q, k, v).dequantize(), o)
    assert not torch.equal(outs[0], outs[1])


def test_fully_masked_rows_give_zero_as_torch_math():
    q, k, v, *_ = _case("none")
    mask = torch.ones(48, 48, dtype=torch.bool)
    mask[3] = False
    model = qt.convert(_SDPA(), qt.Recipe(activation=qt.bf16, attention=qt.recipes.mx_attention()))
    with torch.no_grad():
        out = model(q, k, v, mask).dequantize()
    assert torch.equal(out[..., 3, :], torch.zeros_like(out[..., 3, :]))


def test_without_the_role_a_fused_kernel_is_reported_and_with_it_emulated():
    torch.manual_seed(0)
    x = torch.randn(2, 40, 64)
    for attention in (None, qt.recipes.mx_attention()):
        torch.manual_seed(0)
        model = qt.convert(_MHAModel(False), qt.recipes.mxfp6.replace(attention=attention))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), qt.leak_check(action="record") as report:
            model(x, None)[0].dequantize().sum().backward()
        fused = [f for f in report.findings if f.kind == "fused"]
        assert bool(fused) == (attention is None), report


@pytest.mark.parametrize("case", ["causal", "gqa", "padding"])
def test_compiled_attention_is_eager(case):
    """torch.compile: each attention a graph break that runs the emulation; forward and
    backward (the loss computed on the QTensor output, as compiled qtensor code wants)."""
    q, k, v, mask, kw, p = _case(case)
    model = qt.convert(_SDPA(**kw), qt.Recipe(activation=qt.bf16, grad=qt.bf16,
                                              attention=qt.recipes.fa3_fp8_attention))
    dout = qt.quantize(torch.randn(q.shape[:-1] + (32,)), qt.bf16)
    results = []
    # (static shapes: a recompile with dynamic shapes around the attention's graph break fails in
    # dynamo, "sources must not be empty": docs/attention.md)
    torch._dynamo.reset()
    for run in (model, torch.compile(model, backend="aot_eager", dynamic=False)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = run(*leaves, mask)
        (out * dout).sum().backward()
        results.append([out.dequantize()] + [t.grad.dequantize() for t in leaves])
    for got, want in zip(*results):
        assert_bits_equal(got, want)


# compiled with dynamic shapes, two lengths, forward and backward against eager's bits: "OK", or
# the dynamo error on stderr
_DYNAMIC_SCRIPT = """
import sys, torch
sys.path[:0] = ["tests", "tests/convert"]
import qtensor as qt
from helpers import assert_bits_equal
from test_attention import _SDPA
model = qt.convert(_SDPA(is_causal=True), qt.Recipe(
    activation=qt.bf16, grad=qt.bf16, attention=qt.recipes.fa3_fp8_attention))
run = torch.compile(model, backend="aot_eager", dynamic=True)
torch.manual_seed(0)
for L in (48, 40):
    qkv = [qt.quantize(torch.randn(2, 2, L, 32), qt.bf16) for _ in range(3)]
    results = []
    for f in (model, run):
        leaves = [t.clone().requires_grad_() for t in qkv]
        out = f(*leaves)
        (out * 1.5).sum().backward()
        results.append([out.dequantize()] + [t.grad.dequantize() for t in leaves])
    for got, want in zip(*results):
        assert_bits_equal(got, want, f"L={L}")
print("OK")
"""


@pytest.mark.xfail(raises=AssertionError, strict=True,
                   reason="torch 2.13 dynamo: a QTensor view made in a dynamic-shape graph, "
                          "handed to a frame that starts with a graph break, gets shape symbols "
                          "without a source (docs/attention.md)")
def test_compiled_attention_with_dynamic_shapes():
    """The documented limitation, kept visible: strict, so a torch that fixes it fails here.
    Whether dynamo meets it depends on Python's string hashing (the order of its shape
    guards): each run is a process with a fixed PYTHONHASHSEED, 0 (the error) and 6 (it
    compiles; the bits must then be eager's), so the outcome does not vary from run to run."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    dynamo_error = False
    for seed in ("0", "6"):
        r = subprocess.run([sys.executable, "-c", _DYNAMIC_SCRIPT], capture_output=True,
                           text=True, cwd=root, env=dict(os.environ, PYTHONHASHSEED=seed))
        if "sources must not be empty for symbol" in r.stderr:
            dynamo_error = True
        elif r.returncode != 0 or r.stdout.strip().splitlines()[-1:] != ["OK"]:
            # (not an AssertionError: a failure other than the recorded one fails the xfail)
            pytest.fail(f"PYTHONHASHSEED={seed}: {r.stdout[-2000:]}{r.stderr[-3000:]}")
    assert not dynamo_error, "dynamo: sources must not be empty for symbol ..."


# ---------------------------------------------------------------------------------------------
# nn.MultiheadAttention and Hugging Face attention: the emulation's calls, checked against the
# hand-written attention of what each call received

class _Spy:
    """Records each call of qt.attention.scaled_dot_product_attention: its inputs, the RNG state
    before it, its output, and (after backward) the gradients of its inputs and output."""

    def __init__(self, monkeypatch):
        import qtensor.tensor.attention as A
        self.calls, self.orig = [], A.scaled_dot_product_attention
        monkeypatch.setattr(A, "scaled_dot_product_attention", self)

    def __call__(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False, *, formats):
        call = dict(q=q, k=k, v=v, mask=attn_mask, p=dropout_p, causal=is_causal, scale=scale,
                    fm=formats, rng=torch.get_rng_state(), grads={})
        for name in ("q", "k", "v"):
            if q.requires_grad:
                call[name].register_hook(lambda g, n=name: call["grads"].__setitem__(n, g))
        out = self.orig(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                        formats=formats)
        if out.requires_grad:
            out.register_hook(lambda g: call["grads"].__setitem__("out", g))
        call["out"] = out
        self.calls.append(call)
        return out

    def check(self, backward=True):
        """Each call's output (and gradients) against the reference; the references."""
        assert self.calls
        refs = []
        for c in self.calls:
            deq = [t.dequantize() if isinstance(t, qt.QTensor) else t
                   for t in (c["q"], c["k"], c["v"])]
            mask = c["mask"]
            if isinstance(mask, qt.QTensor):
                mask = mask.dequantize()
            keep = None
            if c["p"]:
                state = torch.get_rng_state()
                torch.set_rng_state(c["rng"])
                keep = _keep(deq[0].shape[:-1] + (deq[1].shape[-2],), c["p"])
                torch.set_rng_state(state)
            dout = None
            if backward:
                dout = c["grads"]["out"]
                dout = dout.dequantize() if isinstance(dout, qt.QTensor) else dout
            got = reference(*[t.detach() for t in deq], c["fm"], mask=mask, causal=c["causal"],
                            scale=c["scale"], keep=keep, p=c["p"], dout=dout,
                            out_fmt=c["q"].fmt, grad_fmt=qt.bf16)
            refs.append(got)
            assert_bits_equal(c["out"].dequantize(), got[0])
            if backward:
                for name, want in zip("qkv", got[2:5]):
                    g = c["grads"][name]
                    assert_bits_equal(g.dequantize() if isinstance(g, qt.QTensor) else g, want)
        return refs


class _MHAModel(nn.Module):
    def __init__(self, need_weights, dropout=0.0):
        super().__init__()
        self.mha = nn.MultiheadAttention(64, 2, dropout=dropout, batch_first=True)
        self.need = need_weights

    def forward(self, x, pad):
        y, w = self.mha(x, x, x, key_padding_mask=pad, need_weights=self.need)
        return y, w


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_multihead_attention_is_the_hand_written_attention(monkeypatch, need_weights, dropout):
    spy = _Spy(monkeypatch)
    torch.manual_seed(0)
    model = qt.convert(_MHAModel(need_weights, dropout),
                       qt.recipes.mxfp6.replace(attention=qt.recipes.mx_attention()))
    x = torch.randn(2, 40, 64)
    pad = torch.zeros(2, 40, dtype=torch.bool)
    pad[1, 33:] = True
    with qt.leak_check():
        y, w = model(x, pad)
        y.dequantize().square().sum().backward()
    refs = spy.check()
    assert (w is not None) == need_weights
    if need_weights:  # P (after dropout) averaged over the heads; the module's output rounding
        assert_bits_equal(w.dequantize(), _r(refs[0][1].mean(dim=1), qt.bf16))


def test_multihead_attention_fast_path_is_emulated(monkeypatch):
    spy = _Spy(monkeypatch)
    torch.manual_seed(0)
    model = qt.convert(_MHAModel(False), qt.recipes.mxfp6.replace(
        attention=qt.recipes.fa3_fp8_attention)).eval()
    x = torch.randn(2, 40, 64)
    with torch.no_grad(), qt.leak_check():
        model(x, None)
    spy.check(backward=False)


@pytest.mark.parametrize("train", [True, False])
def test_transformer_encoder_layer_attention_is_emulated(monkeypatch, train):
    """nn.TransformerEncoderLayer (its eval fast path too) with a padding mask."""
    spy = _Spy(monkeypatch)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 2, dim_feedforward=96, dropout=0.0, batch_first=True)
    model = qt.convert(layer, qt.recipes.mxfp6.replace(attention=qt.recipes.mx_attention()))
    model.train(train)
    x = torch.randn(2, 40, 64)
    pad = torch.zeros(2, 40, dtype=torch.bool)
    pad[0, 30:] = True
    with torch.set_grad_enabled(train), qt.leak_check():
        y = model(x, src_key_padding_mask=pad)
        if train:
            y.dequantize().sum().backward()
    spy.check(backward=train)


transformers = None


def _hf():
    global transformers
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    return transformers


def _llama(attn="sdpa", dropout=0.0):
    tf = _hf()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=64, attention_dropout=dropout,
                         pad_token_id=0, attn_implementation=attn)
    return tf.LlamaForCausalLM(cfg)


def _gpt2(attn="sdpa", dropout=0.0):
    tf = _hf()
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=64, n_positions=32,
                        attn_pdrop=dropout, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_implementation=attn)
    return tf.GPT2LMHeadModel(cfg)


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("backend", ["default", "math"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_hf_attention_is_the_hand_written_attention(monkeypatch, make, backend, dropout):
    spy = _Spy(monkeypatch)
    model = qt.convert(make(dropout=dropout),
                       qt.recipes.mxfp6.replace(attention=qt.recipes.fa3_fp8_attention))
    model.train()
    ids = torch.randint(1, 64, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # padding
    ctx = sdpa_kernel(BACKENDS[backend]) if BACKENDS[backend] is not None else _null()
    with ctx, qt.leak_check(allow=qt.hf.LEAK_ALLOW):
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    assert len(spy.calls) == 2  # one per layer
    spy.check()


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("attention", ["fa3_fp8", "mx_mxfp8"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_hf_eager_attention_is_the_sdpa_emulation(monkeypatch, make, attention, dropout):
    """attn_implementation="eager": its matmuls, softmax and dropout run as the role defines them,
    the bits of the SDPA implementation's emulation (same weights, same dropout draws): logits,
    every parameter's gradient, the returned attention weights (P after dropout, in the output's
    format); each call checked against the hand-written attention; no leak (under LEAK_ALLOW, not
    LEAK_ALLOW_EAGER: the float mask never meets a QTensor op)."""
    recipe = qt.recipes.mxfp6.replace(grad="bf16", attention=FORMATS[attention])
    ids = torch.randint(1, 64, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding (left padding has fully masked query rows, where eager's
    labels = ids.masked_fill(mask == 0, -100)  # additive mask and sdpa's differ)
    runs = {}
    for attn in ("eager", "sdpa"):
        spy = _Spy(monkeypatch)
        model = qt.convert(make(attn=attn, dropout=dropout), recipe).train()
        torch.manual_seed(1)
        with qt.leak_check(allow=qt.hf.LEAK_ALLOW):
            out = model(input_ids=ids, attention_mask=mask, labels=labels,
                        output_attentions=attn == "eager")
            out.loss.backward()
        assert len(spy.calls) == 2  # one per layer
        refs = spy.check()
        grads = {n: p.grad.dequantize() for n, p in model.named_parameters()}
        runs[attn] = out.logits.dequantize(), grads
        if attn == "eager":
            assert len(out.attentions) == 2
            for w, ref, call in zip(out.attentions, refs, spy.calls):
                assert isinstance(w, qt.QTensor)
                assert_bits_equal(w.dequantize(), _r(ref[1], call["q"].fmt))
        monkeypatch.undo()
    assert_bits_equal(runs["eager"][0], runs["sdpa"][0])
    assert runs["eager"][1].keys() == runs["sdpa"][1].keys()
    for name, g in runs["eager"][1].items():
        assert_bits_equal(g, runs["sdpa"][1][name]), name


def test_hf_eager_attention_formats_change_the_bits():
    """(The comparison above is not trivially met: without the role, eager's own ops on QTensors
    give other bits.)"""
    ids = torch.randint(1, 64, (2, 12))
    outs = []
    for attention in (None, qt.recipes.fa3_fp8_attention):
        model = qt.convert(_llama(attn="eager"), qt.recipes.mxfp6.replace(attention=attention))
        with torch.no_grad():
            outs.append(model(input_ids=ids).logits.dequantize())
    assert not torch.equal(outs[0], outs[1])


# ---------------------------------------------------------------------------------------------
# Bad input

def test_attention_formats_on_a_model_without_attention_are_refused():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    with pytest.raises(ValueError, match="the model has no attention"):
        qt.convert(model, qt.recipes.mxfp6.replace(attention=qt.recipes.mx_attention()))
    assert not isinstance(model[0].weight, qt.QTensor)


def _gemma2(attn="eager"):
    tf = _hf()
    torch.manual_seed(0)
    cfg = tf.Gemma2Config(vocab_size=64, hidden_size=64, intermediate_size=96,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=32, attn_logit_softcapping=50.0, attn_implementation=attn)
    return tf.Gemma2ForCausalLM(cfg)


def test_hf_eager_attention_that_is_not_the_role_math_is_refused():
    """Eager attention functions with more than QK^T, the mask, softmax, dropout and PV (Gemma2's
    logit softcapping) and GPT-2's upcast-and-reorder path are refused, at convert and at a
    forward after set_attn_implementation."""
    recipe = qt.recipes.mxfp6.replace(attention=qt.recipes.mx_attention())
    model = _gemma2()
    with pytest.raises(ValueError, match="gemma2.*eager_attention_forward.*softcap"):
        qt.convert(model, recipe)
    assert not isinstance(model.lm_head.weight, qt.QTensor)
    gpt2 = qt.convert(_gpt2("eager"), recipe)
    gpt2(input_ids=torch.randint(1, 64, (1, 4)))
    for block in gpt2.transformer.h:
        block.attn.reorder_and_upcast_attn = True
    with pytest.raises(ValueError, match="reorder_and_upcast_attn"):
        gpt2(input_ids=torch.randint(1, 64, (1, 4)))
    assert all("forward" not in block.attn.__dict__ for block in gpt2.transformer.h)


@pytest.mark.parametrize("spec, err, match", [
    ({"qk": "mxfp8_e4m3"}, ValueError, "must be a pair"),
    ({"qkv": ("bf16", "bf16")}, ValueError, "unknown key"),
    ({"probs": "e8m0"}, qt.FormatError, "signed"),
    ({"scores": "nope"}, qt.FormatError, "scores"),
    (3, TypeError, "expected None"),
])
def test_bad_attention_formats(spec, err, match):
    with pytest.raises(err, match=match):
        qt.Recipe(attention=spec)


def test_attention_recipe_round_trips_and_describes():
    from qtensor.integrations.serialization import recipe_from_dict, recipe_to_dict
    r = qt.recipes.mxfp6.replace(attention=FORMATS["every_field"])
    assert recipe_from_dict(recipe_to_dict(r)) == r
    assert "attention" in r.describe()

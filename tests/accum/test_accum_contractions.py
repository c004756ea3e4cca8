"""QTensor and qt.convert contractions summed by the operands' accumulator (Recipe.accumulate),
and block-scaled operands reaching the datapath with their block scales."""
import copy
import os

import pytest
import torch

import qtensor as qt
from qtensor import accum
from qtensor.accum import blocks as accum_blocks
from qtensor.accum import kernel as accum_kernel
from qtensor.accum.format import AccumFormatError

from accum_cases import _bits_eq, bits, oracle


def test_qtensor_mm_uses_its_accumulator():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 512, generator=g), torch.randn(512, 6, generator=g)
    qa = qt.as_qtensor(a, "bf16", mm_fmt="fp8_e4m3")
    qb = qt.as_qtensor(b, "bf16", mm_fmt="fp8_e4m3")
    plain = torch.mm(qa, qb)
    qb.accum = accum.hopper_fp8_fast
    out = torch.mm(qa, qb)
    # the operands' format is fp8_e4m3: its subnormals align at its minimum normal exponent -6
    want = qt.quantize(accum.accum_matmul(qt.quantize(qa.dequantize(), "fp8_e4m3"),
                                          qt.quantize(qb.dequantize(), "fp8_e4m3"),
                                          accum.hopper_fp8_fast, a_emin=-6, b_emin=-6), "bf16")
    assert _bits_eq(out, want)
    assert not _bits_eq(out, plain)  # the accumulator changed the result
    assert out.accum is accum.hopper_fp8_fast  # results carry it on
    # matmul / einsum / F.linear / addmm decompose into the same contraction
    assert _bits_eq(qa @ qb, want)
    assert _bits_eq(torch.einsum("ik,kj->ij", qa, qb), want)
    assert _bits_eq(torch.nn.functional.linear(qa, qb.t()), want)
    assert (qb.t()).accum is accum.hopper_fp8_fast  # views keep it


def test_addmm_and_baddbmm_feed_c_into_the_datapath():
    """beta * C of the output's shape is the first instruction's accumulator input (a term of
    its alignment), not an FP32 add afterwards; a broadcast bias stays in the epilogue."""
    f = accum.hopper_fp16
    g = torch.Generator().manual_seed(3)
    a = qt.quantize(torch.randn(4, 48, generator=g), "fp16")
    b = qt.quantize(torch.randn(48, 5, generator=g), "fp16")
    c = torch.randn(4, 5, generator=g) * 2.0 ** 20  # large: it truncates the products' sum
    qa, qb = (qt.as_qtensor(x, "fp32", mm_fmt="fp16") for x in (a, b))  # fp32 results
    qa.accum = f
    got = torch.addmm(c, qa, qb)
    fed = accum.accum_matmul(a, b, f, a_emin=-14, b_emin=-14, c=c)
    assert _bits_eq(got, fed)
    assert not _bits_eq(got, accum.accum_matmul(a, b, f, a_emin=-14, b_emin=-14) + c)  # old
    assert torch.equal(bits(fed), bits(oracle(a, b, f, a_emin=-14, b_emin=-14, c=c)))
    got = torch.baddbmm(c[None], qa[None], qb[None], beta=2.0)
    assert _bits_eq(got, accum.accum_matmul(a, b, f, a_emin=-14, b_emin=-14, c=2 * c)[None])
    bias = c[0]  # (N,): a bias, added after the accumulation
    prod = accum.accum_matmul(a, b, f, a_emin=-14, b_emin=-14)
    assert _bits_eq(torch.addmm(bias, qa, qb), prod + bias)
    got = torch.addmm(c, qa, qb, alpha=0.5)  # alpha != 1: the epilogue
    assert _bits_eq(got, prod * 0.5 + c)


def _linear_model(K=300, N=5):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(K, 16), torch.nn.ReLU(), torch.nn.Linear(16, N))


@pytest.mark.parametrize("init_seed", [0, 1573])  # (1573: a subnormal operand's alignment)
def test_recipe_accumulate_forward_and_backward(init_seed):
    """Recipe(accumulate=...): forward and backward contractions of a converted model, by hand."""
    torch.manual_seed(init_seed)
    fp8 = ("bf16", "fp8_e4m3")
    recipe = qt.Recipe(weight=fp8, bias="bf16", activation=fp8, grad=fp8,
                       accumulate=accum.hopper_fp8_fast)
    assert recipe.accumulate is accum.hopper_fp8_fast
    model = qt.convert(torch.nn.Linear(300, 4, bias=False), recipe)
    x = torch.randn(64, 300, generator=torch.Generator().manual_seed(1))
    y = model(x)
    W = model.weight.dequantize()
    xq = qt.quantize(x, "bf16")
    # (the operands are E4M3 values: a subnormal one aligns at E4M3's emin -6, as the converted
    # model's contraction tells the datapath; without a_emin/b_emin 1 in 2,600 inits differed)
    want = qt.quantize(accum.accum_matmul(qt.quantize(xq, "fp8_e4m3"),
                                          qt.quantize(W, "fp8_e4m3").t(),
                                          accum.hopper_fp8_fast, a_emin=-6, b_emin=-6), "bf16")
    assert _bits_eq(y, want)
    # backward: grad_W = grad_y^T @ x, a contraction over the batch (64 terms), same datapath
    y.backward(torch.ones_like(y.dequantize()))
    gw = accum.accum_matmul(torch.ones(4, 64), qt.quantize(xq, "fp8_e4m3"),
                            accum.hopper_fp8_fast, a_emin=-6, b_emin=-6)
    assert _bits_eq(model.weight.grad, qt.quantize(gw, "bf16"))


def test_recipe_accumulate_changes_training_and_optimizer_works():
    recipe = qt.Recipe(weight=("bf16", "fp8_e4m3"), activation=("bf16", "fp8_e4m3"),
                       grad="bf16", accumulate="hopper_fp8_fast")
    assert recipe.accumulate is accum.hopper_fp8_fast
    assert "accumulate" in recipe.describe() and "hopper_fp8_fast" in recipe.describe()
    m1 = qt.convert(_linear_model(), recipe.replace(accumulate=None))
    m2 = qt.convert(_linear_model(), recipe)
    x = torch.randn(32, 300, generator=torch.Generator().manual_seed(2))
    opt = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        m2(x).float().square().mean().backward()
        opt.step()
    assert m2[0].weight.accum is accum.hopper_fp8_fast  # kept through the in-place updates
    assert not _bits_eq(m1(x), m2(x))


def test_accumulator_survives_save_load_and_deepcopy():
    """A converted model's parameters keep their accumulator through torch.save /
    torch.load(weights_only=True) of the state dict, pickling and deepcopy."""
    import copy
    import io
    import pickle
    recipe = qt.Recipe(weight=("bf16", "fp8_e4m3"), activation=("bf16", "fp8_e4m3"),
                       grad="bf16", accumulate="hopper_fp8")
    model = qt.convert(_linear_model(), recipe)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded["0.weight"].accum == accum.hopper_fp8
    assert pickle.loads(pickle.dumps(model))[0].weight.accum == accum.hopper_fp8
    assert copy.deepcopy(model)[0].weight.accum == accum.hopper_fp8


def test_recipe_accumulate_errors():
    with pytest.raises(AccumFormatError, match=r"unknown accumulator preset 'h100'"):
        qt.Recipe(weight="bf16", accumulate="h100")
    with pytest.raises(TypeError, match=r"Recipe.accumulate must be an AccumFormat"):
        qt.Recipe(weight="bf16", accumulate=13)


def test_accumulate_keeps_leak_check_clean():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    qt.convert(m, qt.Recipe(weight=("bf16", "fp8_e4m3"), activation=("bf16", "fp8_e4m3"),
                            grad=("bf16", "fp8_e5m2"), accumulate="hopper_fp8"))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = torch.randn(8, 20), torch.randint(0, 3, (8,))
    with qt.leak_check(action="record", optimizer=opt, check_values=True) as report:
        loss = torch.nn.functional.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert len(report) == 0, report.summary()
    assert m[0].weight.grad.accum is accum.hopper_fp8  # gradients carry it too


def test_accum_study_example_runs(tmp_path):
    """examples/accum_study.py --quick, as a user runs it: both tables, every run, the plots."""
    pytest.importorskip("sklearn", reason="the digits come from scikit-learn")
    pytest.importorskip("matplotlib", reason="the study plots with matplotlib")
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(root, "examples", "accum_study.py"),
                           "--quick", "--out", str(tmp_path)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import re
    kscan_heads = re.findall(r"^\| K +\|.*$", proc.stdout, re.M)  # the error-vs-K tables
    assert len(kscan_heads) == 2 and len(re.findall(r"^\| 512 +\|", proc.stdout, re.M)) == 2
    for run in ("fp32", "promote 1", "promote 4", "promote 16", "never", "wide never"):
        # a row of the digits and GPT tables, a column of each error-vs-K table
        assert len(re.findall(rf"^\| {run} +\|", proc.stdout, re.M)) == 2, run
        assert all(re.search(rf"\| +{run} +\|", h) for h in kscan_heads), run
    # the two-reference study: every accumulator's error vs the exact quantized product (small,
    # 0 for the wide ones) and vs the unquantized FP32 product (the quantization's, much larger)
    for run in ("fp32 adds", "hopper_fp8 promote 4", "hopper_fp8 never", "blackwell_f8f6f4"):
        rows = re.findall(rf"^\| {run} +\|(.*)$", proc.stdout, re.M)
        assert len(rows) == 2, run
        dot = [float(x) for x in rows[0].split("|")[1:-1]]  # datapath, 2 x exact, 2 x fp32
        lg = [float(x) for x in rows[1].split("|")[:-1] if x.strip()]
        assert max(dot[:2]) < min(dot[2:]) / 10 and lg[0] < lg[1] / 10, (run, dot, lg)
    assert {p.name for p in tmp_path.iterdir()} >= {
        "accum_study.md", "accum_study_digits.png", "accum_study_gpt.png", "accum_study_k.md",
        "accum_study_k.png", "accum_study_refs.md", "accum_study_refs.png"}


# ---------------------------------------------------------------------------------------------
# Block scales through QTensor contractions: a converted model's MX/NVFP4 operands reach the
# datapath with their block scales (group exponents, or elements and scales on promotion), as an
# explicit accum_matmul(elements, a_scale=, b_scale=) gives them

def _e4m3_scales(x, bs=16):
    """NVFP4 (single-level) rounding of x along its last dim by hand: (elements, E4M3 scales),
    the scales from the unrounded blocks' amax (an oracle independent of accum's recovery)."""
    X = (x.abs().unflatten(-1, (-1, bs)).amax(-1) / 6).to(torch.float8_e4m3fn)
    X = torch.where(X.float() == 0, torch.ones_like(X.float()), X.float()).to(torch.float8_e4m3fn)
    xq = qt.quantize(x, "nvfp4_single")
    return xq / X.float().repeat_interleave(bs, -1), X


def _nvfp4_operands():
    """x (5, 64), w (3, 64): blocks of 16 from 2^-9 to 448 scales; rows 0-1 and column 0 have a
    group whose products cancel at the largest scale (the 35-bit alignment then drops the
    smallest products, which an alignment at the group sums' exponents keeps)."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(5, 4, 16, generator=g) * 2.0 ** torch.randint(-8, 9, (5, 4, 1), generator=g)
    w = torch.randn(3, 4, 16, generator=g) * 2.0 ** torch.randint(-8, 9, (3, 4, 1), generator=g)
    x[:2, 0], w[0, 0] = 0.0, 6 * 448.0
    x[:2, 0, 0], x[:2, 0, 1] = 6 * 448.0, -6 * 448.0
    x[:2, 1], w[0, 1] = 0.5 * 2.0 ** -9, 0.5 * 2.0 ** -9
    x[:2, 1, 0], w[0, 1, 0] = 6 * 2.0 ** -9, 6 * 2.0 ** -9
    return x.flatten(1), w.flatten(1)


def _spy_on_scale_arguments(monkeypatch):
    """A list that collects, per call of the kernel entry (accum_kernel._matmul, which contractions
    call), the names of its tensor keyword arguments (the scales and clamps it was given)."""
    calls = []
    kernel = accum_kernel._matmul

    def spy(*args, **kw):
        calls.append(sorted(k for k, v in kw.items() if isinstance(v, torch.Tensor)))
        return kernel(*args, **kw)
    monkeypatch.setattr(accum_kernel, "_matmul", spy)
    return calls


def _converted_linear_output(x, w, fmt, f):
    """x through qt.convert(nn.Linear with weight w), fmt at both operands, accumulator f."""
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    m = qt.convert(lin, qt.Recipe(weight=("fp32", fmt), activation=("fp32", fmt),
                                  accumulate=f))
    y = m(x)
    return y.dequantize() if isinstance(y, qt.QTensor) else y


@pytest.mark.parametrize("fmt", ["nvfp4_single", "nvfp4"])
def test_converted_linear_nvfp4_passes_block_scales(fmt):
    """qt.convert(nn.Linear) with NVFP4 weight and activation operand formats and
    Recipe(accumulate=blackwell_nvfp4): the output equals accum_matmul of the FP4 elements with
    their E4M3 block scales (tcgen05 kind::mxf4nvf4's alignment at the scales' exponents), bit
    for bit; NVFP4's per-tensor scales are applied after the sum (cuBLASLt's alpha). Without the
    scales (each group at its own sum's exponent, the previous behaviour) the bits differ."""
    f = accum.blackwell_nvfp4
    x, w = _nvfp4_operands()
    y = _converted_linear_output(x, w, fmt, f)
    if fmt == "nvfp4_single":
        xe, xs = _e4m3_scales(x)
        we, ws = _e4m3_scales(w)
        want = accum.accum_matmul(xe, we.t(), f, a_scale=xs, b_scale=ws.t())
    else:  # the per-tensor scales (TE's, from the tensors' amax) out of the elements, alpha
        def split(t):  # TE's S_enc and E4M3 scales of the unrounded blocks (float32 steps)
            enc = torch.tensor(6 * 448.0) / t.abs().amax()
            ts = 1 / enc
            s = t.abs().unflatten(-1, (-1, 16)).amax(-1) * (enc * torch.tensor(1 / 6.0))
            s = s.to(torch.float8_e4m3fn)
            tq = qt.quantize(t, fmt).double()
            e = tq / (s.double().repeat_interleave(16, -1) * ts.double())
            return e.round(decimals=6).float(), s, ts  # (e * X * s rounded once: e to 1e-6)
        xe, xs, tx = split(x)
        we, ws, tw = split(w)
        assert torch.equal(xe, qt.quantize(xe, "fp4_e2m1"))  # the elements recovered
        want = accum.accum_matmul(xe, we.t(), f, a_scale=xs, b_scale=ws.t()) * (tx * tw)
    assert torch.equal(bits(y), bits(want))
    old = accum.accum_matmul(qt.quantize(x, fmt), qt.quantize(w, fmt).t(), f)
    assert not torch.equal(bits(y), bits(old))


@pytest.mark.parametrize("fmt, f", [("mxfp4", accum.blackwell_mxfp4),
                                    ("mxfp8_e4m3", accum.blackwell_mxf8f6f4)])
def test_converted_conv2d_mxfp4_passes_block_exponents(fmt, f, monkeypatch):
    """qt.convert(nn.Conv2d) with MX operand formats and a Blackwell block-scaled preset: the
    convolution's GEMM (K = kernel position, channel) gets the E8M0 block scales of both operands
    (blocks of 32 channels: MXFP4's group exponents for blackwell_mxfp4, MXFP8's per-element
    clamps for blackwell_mxf8f6f4); equal, bit for bit, to accum_matmul of the im2col elements
    with their scales, and different from the values without them."""
    emax = qt.formats.format(fmt).elem.emax
    g = torch.Generator().manual_seed(5)
    conv = torch.nn.Conv2d(32, 3, 3, bias=False)
    x = torch.randn(2, 32, 5, 5, generator=g)
    x = x * 2.0 ** torch.randint(-24, 24, (2, 2, 1, 5, 5), generator=g).repeat_interleave(
        16, 1).flatten(1, 2)  # every group of 16 channels at its own scale
    x[:, :16, 1, 1] = torch.tensor([2.0 ** 30, -2.0 ** 30] * 8)  # groups that cancel
    with torch.no_grad():
        conv.weight.copy_(torch.randn(3, 32, 3, 3, generator=g))
        conv.weight[:, :16] = 1.0
        if fmt == "mxfp8_e4m3":  # E4M3 subnormal elements in every block
            x[:, 16:] = x[:, :16] * 2.0 ** -15
    m = qt.convert(conv, qt.Recipe(weight=("fp32", fmt), activation=("fp32", fmt),
                                   accumulate=f))
    calls = _spy_on_scale_arguments(monkeypatch)
    y = m(x)
    monkeypatch.undo()
    assert calls[0] == (["a_gexp", "b_gexp"] if f.group > 1 else ["b_emin"])
    y = y.dequantize() if isinstance(y, qt.QTensor) else y

    def split(t, dim):  # MX along dim: elements and E8M0 exponents of the unrounded blocks
        tq = qt.quantize(t, qt.formats.format(fmt).replace(axis=dim))
        amax = t.movedim(dim, -1).abs().unflatten(-1, (-1, 32)).amax(-1)
        e = (torch.frexp(amax).exponent - 1 - emax).clamp(-127, 127).movedim(-1, dim)
        return tq / torch.exp2(e.float()).repeat_interleave(32, dim), e.float()
    xe, xs = split(x, 1)  # (N, C, H, W), (N, 1, H, W)
    we, ws = split(conv.weight.detach(), 1)  # (O, C, 3, 3), (O, 1, 3, 3)
    N, O, L = 2, 3, 9

    def cols(t):  # (N, C, 5, 5) -> (N, K, L), K = (kernel position, channel)
        u = torch.nn.functional.unfold(t, 3)  # (N, C * 9, L), channel-major
        return u.unflatten(1, (t.shape[1], 9)).transpose(1, 2).flatten(1, 2)
    b, bsc = cols(xe), cols(torch.exp2(xs))  # scales: (N, 9, L), one per position
    a = we.permute(0, 2, 3, 1).reshape(O, -1)
    asc = torch.exp2(ws).permute(0, 2, 3, 1).reshape(O, 9)
    want = accum.accum_matmul(a, b, f, a_scale=asc, b_scale=bsc).reshape(N, O, 3, 3)
    assert torch.equal(bits(y), bits(want))
    xq = qt.quantize(x, qt.formats.format(fmt).replace(axis=1))
    wq = qt.quantize(conv.weight.detach(), qt.formats.format(fmt).replace(axis=1))
    old = accum.accum_matmul(wq.permute(0, 2, 3, 1).reshape(O, -1), cols(xq), f)
    if f.group > 1:
        assert not torch.equal(bits(y), bits(old.reshape(N, O, 3, 3)))


@pytest.mark.parametrize("scale", ["e8m0", "bf16", "fp32"])
def test_converted_linear_promotion_scales(scale, monkeypatch):
    """DeepSeek-V3-style FP8 GEMM through a converted nn.Linear: operand formats of E4M3 blocks
    of 128 along K (power-of-two E8M0 scales, or BF16 amax scales) and hopper_fp8 with
    scales="promotion": dispatch passes the elements and their block scales, so each 128-K
    interval's unscaled sum is promoted with its scales (one FFMA), bit for bit as accum_matmul
    with a_scale/b_scale. With BF16 scales summing the scaled values instead gives other bits;
    E8M0 scales are powers of two, which commute with the alignment (the kernel must still get
    them: checked on the call)."""
    f = accum.hopper_fp8.replace(scales="promotion")
    rule = "floor" if scale == "e8m0" else "amax"
    fmt = qt.BlockFormat("fp8_e4m3", 128, scale=scale, scale_rule=rule)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 3, 128, generator=g) * 2.0 ** torch.randint(-3, 3, (6, 3, 1), generator=g)
    w = torch.randn(4, 3, 128, generator=g) * 2.0 ** torch.randint(-3, 3, (4, 3, 1), generator=g)
    x, w = x.flatten(1), w.flatten(1)
    lin = torch.nn.Linear(384, 4, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    m = qt.convert(lin, qt.Recipe(weight=("fp32", fmt), activation=("fp32", fmt), accumulate=f))
    calls = []
    kernel = accum_kernel._matmul  # the kernel entry contractions call

    def spy(*args, **kw):
        calls.append(sorted(k for k, v in kw.items() if v is not None))
        return kernel(*args, **kw)
    monkeypatch.setattr(accum_kernel, "_matmul", spy)
    y = m(x)
    monkeypatch.undo()
    assert "a_scale" in calls[0] and "b_scale" in calls[0]
    y = y.dequantize() if isinstance(y, qt.QTensor) else y

    def split(t):  # the quantizer's scales of the unrounded blocks, and the elements
        amax = t.double().abs().unflatten(-1, (-1, 128)).amax(-1)
        if rule == "floor":
            s = torch.exp2((torch.frexp(amax).exponent - 1 - 8).double())
        elif scale == "bf16":
            s = (amax / 448).float().to(torch.bfloat16).double()
        else:  # DeepSeek-V3's FP32 scales, nearest on the 20-bit grid (E4M3 x scale: float32)
            m, e = torch.frexp(amax / 448)
            s = torch.ldexp(torch.round(m * 2.0 ** 20) / 2.0 ** 20, e)
        e = (qt.quantize(t, fmt).double() / s.repeat_interleave(128, -1)).float()
        assert torch.equal(qt.quantize(e, "fp8_e4m3"), e)
        return e, s.float()
    xe, xs = split(x)
    we, ws = split(w)
    want = accum.accum_matmul(xe, we.t(), f, a_scale=xs, b_scale=ws.t(), a_emin=-6, b_emin=-6)
    assert torch.equal(bits(y), bits(want))
    old = accum.accum_matmul(qt.quantize(x, fmt), qt.quantize(w, fmt).t(), f)
    assert torch.equal(bits(y), bits(old)) == (scale == "e8m0")


def _te_split(t, fmt):
    """_quantizer_split for a two-level format by Transformer Engine's rule, in its float32
    steps written out here (E4M3 casts by torch's float8_e4m3fn, RNE): the encode scale from
    t's amax, each block's E4M3 scale (amax: nearest of amax/6 * enc; ceil: the smallest E4M3
    whose 6 X s covers amax; 4over6: nearest of amax/6 * enc and of that * 1.5, the one of the
    lower float32 error sum, 6 on a tie), the elements of x * 1/(X s), values fl32(e X s)."""
    f32 = torch.float32
    bound = 256.0 if fmt.scale_rule == "4over6" else 448.0
    amax_t = t.abs().amax()
    enc = torch.tensor(6 * bound, dtype=f32) / amax_t
    dec = 1 / enc
    blocks = t.unflatten(-1, (-1, 16))
    bmax = blocks.abs().amax(-1, keepdim=True)

    def e4m3(v):
        return v.clamp(max=448.0).to(torch.float8_e4m3fn)

    def elements(X):
        inv = (1 / (X * dec)).clamp(max=torch.finfo(f32).max)
        return qt.quantize((blocks * inv).clamp(-6, 6), "fp4_e2m1")

    if fmt.scale_rule == "4over6":
        X6 = e4m3((bmax / 6.0) * enc).float()
        X4 = e4m3((bmax / 6.0) * enc * 1.5).float()

        def err(X):
            d = ((((elements(X) * X) * amax_t) / (6 * bound)) - blocks).abs()
            acc = torch.zeros_like(bmax)
            for j in range(16):
                acc = acc + d[..., j:j + 1]
            return acc
        X = torch.where(err(X4) < err(X6), X4, X6)
    elif fmt.scale_rule == "ceil":
        target = bmax * (enc * torch.tensor(1 / 6.0, dtype=f32))
        n = e4m3(target)
        up = torch.where(n.float() < target, (n.view(torch.uint8) + 1).view(torch.float8_e4m3fn),
                         n).float()
        down = torch.where(up > 0, (e4m3(up).view(torch.uint8) - 1).view(torch.float8_e4m3fn)
                           .float(), up)
        X = torch.where((6.0 * down) * dec >= bmax, down, up)
    else:
        X = e4m3(bmax * (enc * torch.tensor(1 / 6.0, dtype=f32))).float()
    e = elements(X)
    q = (e * X) * dec
    assert torch.equal(q.flatten(-2), qt.quantize(t, fmt))  # the quantizer's values
    e = torch.where(X == 0, q, e)  # a block rounded to zeros: zero elements, any scale (1)
    return e.flatten(-2), torch.where(X == 0, 1.0, X)[..., 0], dec.double()


def _quantizer_split(t, fmt):
    """t rounded to the block format fmt (blocks along the last dim) by the quantizer's own
    steps on the unrounded blocks (an oracle independent of accum's scale recovery): (elements,
    block scales X, tensor scale ts); 4over6 picks the candidate of the lower error (6 on a
    tie), as Transformer Engine."""
    if fmt.tensor_scale:
        return _te_split(t, fmt)
    from qtensor.kernels.reference import round_with_scale, scale_candidates
    bs = fmt.block_size
    t64 = t.double()
    blocks = t64.unflatten(-1, (-1, bs))
    amax = blocks.abs().amax(-1, keepdim=True)
    ts = None

    def settled(scale_of):  # a block whose rounded max has a lower scale takes that one
        X = scale_of(amax)
        q = round_with_scale(blocks, X, fmt, "nearest")
        while fmt.scale_rule != "ceil" or not fmt.power_of_two_scales:  # (RCEIL keeps X)
            again = scale_of(q.abs().amax(-1, keepdim=True))
            if not (again < X).any():
                return X, q
            X = torch.minimum(again, X)
            q = round_with_scale(blocks, X, fmt, "nearest")
        return X, q
    cands, qs = zip(*[settled(c) for c in scale_candidates(fmt)])
    X, q = cands[0], qs[0]
    if len(cands) == 2:
        err = [sum((qq[..., j:j + 1] - blocks[..., j:j + 1]).abs() for j in range(bs))
               for qq in qs]  # in element order
        X = torch.where(err[1] < err[0], cands[1], cands[0])
        q = torch.where(err[1] < err[0], qs[1], qs[0])
    assert torch.equal(q.flatten(-2).float(), qt.quantize(t, fmt))  # the quantizer's values
    ts = torch.ones((), dtype=torch.float64) if ts is None else ts
    X = torch.where(X == 0, ts, X) / ts  # a block rounded to zeros: any scale
    e = (q / (X * ts)).flatten(-2).float()
    assert torch.equal(qt.quantize(e, fmt.elem), e)
    return e, X[..., 0].float(), ts


@pytest.mark.parametrize("fmt, f", [
    (qt.BlockFormat("fp4_e2m1", 32, scale="e8m0", scale_rule="even"), accum.blackwell_mxfp4),
    (qt.BlockFormat("fp4_e2m1", 16, scale="fp8_e4m3", scale_rule="4over6"),
     accum.blackwell_nvfp4),
    (qt.BlockFormat("fp4_e2m1", 16, scale="fp8_e4m3", scale_rule="4over6", tensor_scale=True),
     accum.blackwell_nvfp4),
    (qt.BlockFormat("fp4_e2m1", 16, scale="fp8_e4m3", scale_rule="ceil", tensor_scale=True),
     accum.blackwell_nvfp4),
    (qt.BlockFormat("fp4_e2m1", 32, scale="e8m0", scale_rule="rceil"), accum.blackwell_mxfp4)],
    ids=["mxfp4_even", "nvfp4_4over6", "nvfp4_4over6_ts", "nvfp4_ceil", "mxfp4_rceil"])
def test_converted_linear_other_scale_rules_pass_block_scales(fmt, f):
    """Scale rules besides MX floor and NVFP4 amax through a converted nn.Linear with a
    Blackwell block-scaled preset: the scales recovered from the rounded operands are the
    quantizer's (even: the rounded max's binade; 4over6: the one of its two candidates whose
    elements are exact; ceil with E4M3 scales: the upward rounding of the rounded max / 6;
    MX RCEIL, ambiguous in the rounded blocks: the scales of the unrounded payloads the operands
    were rounded from), so the output equals accum_matmul of the elements with those scales
    (per-tensor scales as alpha), bit for bit; the values alone give other bits."""
    x, w = _nvfp4_operands()
    if fmt.block_size == 32:  # MX: a block of x that cancels at 2^60, far above the others
        x[:2, :32] = torch.tensor([2.0 ** 60, -2.0 ** 60] * 16)
        w[:, :32] = 1.0
    y = _converted_linear_output(x, w, fmt, f)
    if fmt.scale_rule == "ceil" and fmt.power_of_two_scales:  # the rounded x alone: ambiguous
        assert accum_blocks._block_scales(qt.quantize(x, fmt), fmt, -1) is None
    xe, xs, tx = _quantizer_split(x, fmt)
    we, ws, tw = _quantizer_split(w, fmt)
    want = accum.accum_matmul(xe, we.t(), f, a_scale=xs, b_scale=ws.t())
    if fmt.tensor_scale:
        want = want * (tx.float() * tw.float())
    assert torch.equal(bits(y), bits(want))
    old = accum.accum_matmul(qt.quantize(x, fmt), qt.quantize(w, fmt).t(), f)
    assert not torch.equal(bits(y), bits(old))


def test_block_scales_ceil_power_of_two_is_ambiguous():
    """MX ceil (RCEIL) scales are not a function of the rounded block: a block whose rounded max
    is max_elem * 2^k rounds from 2^k (max 6) as from 2^(k+1) (max 3): recovery from the rounded
    values alone refuses it, and recovers the scales of a tensor without such blocks."""
    from qtensor.accum.blocks import _block_scales
    fmt = qt.BlockFormat("fp4_e2m1", 32, scale="e8m0", scale_rule="ceil")
    a = torch.full((1, 32), 1.0)
    a[0, 0] = 5.5  # scale 1, max 6 (from 2^0) ...
    b = a.clone()
    b[0, 0] = 6.2  # ... or scale 2, max 3 * 2 = 6: the same rounded block
    qa, qb = qt.quantize(a, fmt), qt.quantize(b, fmt)
    assert torch.equal(qa, qb) and _block_scales(qa, fmt, -1) is None
    c = a.clone()
    c[0, 0] = 4.4  # max 4: scale 1 only
    sc = _block_scales(qt.quantize(c, fmt), fmt, -1)
    assert sc is not None and sc[0].item() == 1.0


def test_addmm_nvfp4_feeds_c_through_the_datapath():
    """addmm(C, A, B) of NVFP4 operands (per-tensor scales) under blackwell_nvfp4: the datapath
    sums the unscaled products with the E4M3 block scales, alpha = ts_a * ts_b scales its
    result, so C (of the output's shape) is its initial accumulator as fp32(C / alpha):
    fp32(alpha * D(C / alpha)), bit for bit; the values with C (the previous behaviour) differ."""
    f = accum.blackwell_nvfp4
    x, w = _nvfp4_operands()
    g = torch.Generator().manual_seed(3)
    c = torch.randn(5, 3, generator=g)
    qa = qt.QTensor(x, "fp32", mm_fmt="nvfp4", accum=f)
    qb = qt.QTensor(w.t().contiguous(), "fp32", mm_fmt="nvfp4", accum=f)
    y = torch.addmm(c, qa, qb)
    y = y.dequantize() if isinstance(y, qt.QTensor) else y
    nv = qt.formats.format("nvfp4")
    xe, xs, tx = _quantizer_split(x, nv)
    we, ws, tw = _quantizer_split(w, nv)
    alpha = tx.float() * tw.float()
    want = accum.accum_matmul(xe, we.t(), f, a_scale=xs, b_scale=ws.t(), c=c / alpha) * alpha
    assert torch.equal(bits(y), bits(want))
    old = accum.accum_matmul(qt.quantize(x, nv), qt.quantize(w, nv).t(), f, c=c)
    assert not torch.equal(bits(y), bits(old))


def _mx_split(t, dim, fmt="mxfp4"):
    """MX rounding of t along dim by hand: elements and E8M0 scales (2^e, one per block of 32,
    the blocks' dim kept at its number of blocks) of the unrounded blocks."""
    f = qt.formats.format(fmt)
    tq = qt.quantize(t, f.replace(axis=dim))
    amax = t.movedim(dim, -1).abs().unflatten(-1, (-1, 32)).amax(-1)
    e = (torch.frexp(amax).exponent - 1 - f.elem.emax).clamp(-127, 127).movedim(-1, dim)
    s = torch.exp2(e.float())
    return tq / s.repeat_interleave(32, dim), s


def test_converted_grouped_conv2d_blocks_across_groups_pass_scales():
    """A grouped nn.Conv2d (2 groups of 16 channels) with MXFP4 operands under
    blackwell_mxfp4: the input's blocks of 32 channels span both groups, but each K-group of 16
    (one kernel position, 16 channels of one group) lies in one block, so the convolution's
    per-group GEMMs get the scales: equal, bit for bit, to accum_matmul per group of the
    elements with their scales; the values alone (the previous fallback) differ."""
    f = accum.blackwell_mxfp4
    g = torch.Generator().manual_seed(7)
    conv = torch.nn.Conv2d(32, 4, 3, groups=2, bias=False)
    x = torch.randn(1, 32, 4, 4, generator=g)
    x = x * 2.0 ** torch.randint(-4, 5, (1, 1, 4, 4), generator=g)
    x[0, :16, 1, 1] = torch.tensor([2.0 ** 60, -2.0 ** 60] * 8)  # a group cancels at 2^58
    with torch.no_grad():
        conv.weight.copy_(torch.randn(4, 16, 3, 3, generator=g))
        conv.weight[:, :, 1, 1] = 1.0
    m = qt.convert(conv, qt.Recipe(weight=("fp32", "mxfp4"), activation=("fp32", "mxfp4"),
                                   accumulate=f))
    y = m(x)
    y = y.dequantize() if isinstance(y, qt.QTensor) else y
    xe, xs = _mx_split(x, 1)  # (1, 32, 4, 4), (1, 1, 4, 4)
    wpad = torch.nn.functional.pad(conv.weight.detach(), (0, 0, 0, 0, 0, 16))  # blocks of 32
    we, ws = _mx_split(wpad, 1)
    we = we[:, :16]  # (4, 16, 3, 3), ws (4, 1, 3, 3)

    def cols(t):  # (1, C, 4, 4) -> (C, 9, L=4)
        return torch.nn.functional.unfold(t, 3)[0].unflatten(0, (t.shape[1], 9))
    want = []
    for grp in range(2):
        a = we[2 * grp:2 * grp + 2].permute(0, 2, 3, 1).reshape(2, 144)  # K = (position, c)
        asc = ws[2 * grp:2 * grp + 2].reshape(2, 9)
        b = cols(xe)[16 * grp:16 * grp + 16].transpose(0, 1).reshape(144, 4)
        bsc = cols(xs)[0]  # (9, L): the one block of the 32 channels at each position
        want.append(accum.accum_matmul(a, b, f, a_scale=asc, b_scale=bsc))
    want = torch.cat(want).reshape(1, 4, 2, 2)
    assert torch.equal(bits(y), bits(want))
    xq = qt.quantize(x, qt.formats.format("mxfp4").replace(axis=1))
    wq = qt.quantize(conv.weight.detach(), qt.formats.format("mxfp4").replace(axis=1))
    old = torch.cat([accum.accum_matmul(
        wq[2 * grp:2 * grp + 2].permute(0, 2, 3, 1).reshape(2, 144),
        cols(xq)[16 * grp:16 * grp + 16].transpose(0, 1).reshape(144, 4), f)
        for grp in range(2)]).reshape(1, 4, 2, 2)
    assert not torch.equal(bits(y), bits(old))


@pytest.mark.parametrize("fmt, f", [("mxfp4", accum.blackwell_mxfp4),
                                    ("mxfp8_e4m3", accum.blackwell_mxf8f6f4)])
def test_converted_conv2d_grad_weight_passes_block_scales(fmt, f, monkeypatch):
    """The weight gradient of a converted nn.Conv2d with MX input and gradient operands
    (blocked along the batch, as dispatch rounds grad_weight's operands) under a Blackwell
    block-scaled preset: K runs (output position, batch), the batch innermost, so each block of
    32 is a run of K and the GEMM gets both operands' scales (MXFP4: group exponents; MXFP8:
    per-element clamps, E4M3 subnormals in some blocks): equal, bit for bit, to accum_matmul of
    the elements with their scales; the values alone (the previous fallback, batch outermost)
    differ."""
    g = torch.Generator().manual_seed(9)
    N, L, P = 32, 4, 4
    conv = torch.nn.Conv2d(1, 2, 2, bias=False)
    x = torch.randn(N, 1, 3, 3, generator=g)
    x[:2] = 1.0
    go = torch.randn(N, 2, 2, 2, generator=g)
    go[:2, 0, 0, 0] = torch.tensor([2.0 ** 60, -2.0 ** 60])  # cancels at 2^58, position 0
    if fmt == "mxfp8_e4m3":
        x[2:4] *= 2.0 ** -12  # E4M3 subnormals of their blocks
        go[4:6] *= 2.0 ** -12
    with torch.no_grad():
        conv.weight.copy_(torch.randn(2, 1, 2, 2, generator=g))
    mx = ("fp32", fmt)
    m = qt.convert(conv, qt.Recipe(weight=mx, activation=mx, grad=mx, accumulate=f))
    y = m(x)
    calls = _spy_on_scale_arguments(monkeypatch)
    y.backward(go)
    monkeypatch.undo()
    assert calls == [["a_gexp", "b_gexp"] if f.group > 1 else ["a_emin", "b_emin"]]
    gw = m.weight.grad
    gw = gw.dequantize() if isinstance(gw, qt.QTensor) else gw
    xe, xs = _mx_split(x, 0, fmt)  # (N, 1, 3, 3), (1, 1, 3, 3)
    ge, gs = _mx_split(go, 0, fmt)  # (N, 2, 2, 2), (1, 2, 2, 2)

    def cols(t):  # (n, 1, 3, 3) -> (n, P, L)
        return torch.nn.functional.unfold(t, 2)
    a = ge.reshape(N, 2, L).permute(1, 2, 0).reshape(2, L * N)  # K = (l, n)
    asc = gs.reshape(2, L)
    b = cols(xe).permute(2, 0, 1).reshape(L * N, P)
    bsc = cols(xs)[0].t()  # (L, P)
    want = accum.accum_matmul(a, b, f, a_scale=asc, b_scale=bsc).reshape(2, 1, 2, 2)
    assert torch.equal(bits(gw), bits(want))
    xq = qt.quantize(x, qt.formats.format(fmt).replace(axis=0))
    gq = qt.quantize(go, qt.formats.format(fmt).replace(axis=0))
    old = accum.accum_matmul(gq.reshape(N, 2, L).permute(1, 0, 2).reshape(2, N * L),
                             cols(xq).permute(0, 2, 1).reshape(N * L, P), f)
    assert not torch.equal(bits(gw), bits(old.reshape(2, 1, 2, 2)))


def test_converted_grouped_conv_transpose2d_weight_blocks_across_groups():
    """A grouped nn.ConvTranspose2d (2 groups) with MXFP4 operands under blackwell_mxfp4: the
    weight (C_in, O/groups, kh, kw) is blocked along C_in, 32 channels across both groups, and
    group 0's weights are 1/4 of group 1's, so the shared block scale is group 1's: the GEMM
    (K = flipped kernel position, C_in of the group) gets that scale for both groups (a block
    partition of the regrouped kernel would give group 0 a smaller one), bit for bit as
    accum_matmul per group of the elements with their scales."""
    f = accum.blackwell_mxfp4
    g = torch.Generator().manual_seed(11)
    conv = torch.nn.ConvTranspose2d(32, 4, 2, groups=2, bias=False)
    x = torch.randn(1, 32, 3, 3, generator=g)
    x[0, :16, 1, 1] = torch.tensor([2.0 ** 36, -2.0 ** 36] * 8)  # the others: ~36 bits below
    with torch.no_grad():
        w = torch.randn(32, 2, 2, 2, generator=g)
        w[:16] *= 0.25
        w[1:16:2] = w[0:16:2]  # x's pairs +-2^36 at (1, 1) cancel in every product group
        conv.weight.copy_(w)
    m = qt.convert(conv, qt.Recipe(weight=("fp32", "mxfp4"), activation=("fp32", "mxfp4"),
                                   accumulate=f))
    y = m(x)
    y = y.dequantize() if isinstance(y, qt.QTensor) else y
    xe, xs = _mx_split(x, 1)  # (1, 32, 3, 3), (1, 1, 3, 3)
    we, ws = _mx_split(w, 0)  # (32, 2, 2, 2), (1, 2, 2, 2)
    we, ws = we.flip(2, 3), ws.flip(2, 3)

    def cols(t):  # (1, C, 3, 3) padded by 1 -> (C, 4 positions, L=16)
        u = torch.nn.functional.unfold(torch.nn.functional.pad(t, (1, 1, 1, 1)), 2)[0]
        return u.unflatten(0, (t.shape[1], 4))
    want = []
    for grp in range(2):
        a = we[16 * grp:16 * grp + 16].permute(1, 2, 3, 0).reshape(2, 64)  # K = (position, c)
        asc = ws[0].reshape(2, 4)
        b = cols(xe)[16 * grp:16 * grp + 16].transpose(0, 1).reshape(64, 16)
        bsc = cols(xs)[0]  # (4, 16)
        want.append(accum.accum_matmul(a, b, f, a_scale=asc, b_scale=bsc))
    want = torch.cat(want).reshape(1, 4, 4, 4)
    assert torch.equal(bits(y), bits(want))
    # group 0's own maxima give other scales (smaller, with valid elements too): other bits
    wrong = ws.clone()
    w0 = we[:16].abs().flatten(1).amax(0).reshape(2, 2, 2) * ws[0]
    wrong = torch.exp2(torch.floor(torch.log2(w0)) - 2)
    a = (we[:16] * ws[0] / wrong).permute(1, 2, 3, 0).reshape(2, 64)
    assert torch.equal(qt.quantize(a, "fp4_e2m1"), a)
    other = accum.accum_matmul(a, cols(xe)[:16].transpose(0, 1).reshape(64, 16), f,
                               a_scale=wrong.reshape(2, 4), b_scale=cols(xs)[0])
    assert not torch.equal(bits(want[0, :2].reshape(2, 16)), bits(other))


def test_converted_conv2d_grad_weight_promotion_scales():
    """DeepSeek-V3-style FP8 weight gradient of a converted nn.Conv2d: E4M3 blocks of 128 along
    the batch with BF16 amax scales and hopper_fp8 with scales="promotion": K runs (output
    position, batch), each 128-K interval is one block of each operand, promoted with its
    scales; bit for bit as accum_matmul with a_scale/b_scale; the values (batch outermost, the
    previous fallback) differ."""
    f = accum.hopper_fp8.replace(scales="promotion")
    fmt = qt.BlockFormat("fp8_e4m3", 128, scale="bf16", scale_rule="amax")
    g = torch.Generator().manual_seed(1)
    N, L, P = 128, 4, 4
    conv = torch.nn.Conv2d(1, 2, 2, bias=False)
    x, go = torch.randn(N, 1, 3, 3, generator=g), torch.randn(N, 2, 2, 2, generator=g)
    r = ("fp32", fmt)
    m = qt.convert(conv, qt.Recipe(weight=r, activation=r, grad=r, accumulate=f))
    m(x).backward(go)
    gw = m.weight.grad
    gw = gw.dequantize() if isinstance(gw, qt.QTensor) else gw

    def split(t):  # the quantizer's BF16 scales of the unrounded batch blocks, the elements
        amax = t.double().abs().amax(0, keepdim=True)
        s = (amax / 448).float().to(torch.bfloat16).double()
        e = (qt.quantize(t, fmt.replace(axis=0)).double() / s).float()
        assert torch.equal(qt.quantize(e, "fp8_e4m3"), e)
        return e, s[0].float()
    xe, xs = split(x)
    ge, gs = split(go)

    def cols(t):  # (n, 1, 3, 3) -> (n, P, L)
        return torch.nn.functional.unfold(t, 2)
    a = ge.reshape(N, 2, L).permute(1, 2, 0).reshape(2, L * N)  # K = (l, n)
    b = cols(xe).permute(2, 0, 1).reshape(L * N, P)
    want = accum.accum_matmul(a, b, f, a_scale=gs.reshape(2, L), b_scale=cols(xs[None])[0].t(),
                              a_emin=-6, b_emin=-6).reshape(2, 1, 2, 2)
    assert torch.equal(bits(gw), bits(want))
    xq, gq = qt.quantize(x, fmt.replace(axis=0)), qt.quantize(go, fmt.replace(axis=0))
    old = accum.accum_matmul(gq.reshape(N, 2, L).permute(1, 0, 2).reshape(2, N * L),
                             cols(xq).permute(0, 2, 1).reshape(N * L, P), f)
    assert not torch.equal(bits(gw), bits(old.reshape(2, 1, 2, 2)))

"""NVFP4 (qt.nvfp4) is Transformer Engine's NVFP4, bit for bit: the FP32 tensor scale from the
tensor's amax, each 16-element block's E4M3 scale and its FP4 elements, in TE's float32 order of
operations (tests/oracles.py nvfp4_te, independent of qtensor.kernels.reference); and a QTensor of it
carries its tensor scale, so that moving its values never changes them."""
from __future__ import annotations

import math
import os

import pytest
import torch

import qtensor as qt
from qtensor.kernels import reference
from qtensor.kernels.reference import draw_seed, random_bits
from oracles import float_codes, nvfp4_te
from helpers import two_level_formats, two_level_inputs


def _bits(t):
    return t.detach().float().contiguous().view(torch.int32)


def _inputs():
    return two_level_inputs()


@pytest.mark.parametrize("name", list(_inputs()))
def test_nvfp4_matches_the_te_rule_bit_for_bit(name):
    x = _inputs()[name]
    want, s = nvfp4_te(x.tolist(), qt.fp8_e4m3, qt.fp4_e2m1)
    got = qt.quantize(x, qt.nvfp4)
    assert torch.equal(_bits(got), _bits(torch.tensor(want))), name
    q = qt.as_qtensor(x, qt.nvfp4)
    assert torch.equal(_bits(q.dequantize()), _bits(torch.tensor(want)))
    assert q.tensor_scale.dtype == torch.float32 and float(q.tensor_scale) == s


def test_nvfp4_bf16_and_half_inputs_follow_the_rule():
    x = torch.randn(4, 48, generator=torch.Generator().manual_seed(1))
    for dt in (torch.bfloat16, torch.float16):
        xd = x.to(dt)
        want, _ = nvfp4_te(xd.float().tolist(), qt.fp8_e4m3, qt.fp4_e2m1)
        got = qt.quantize(xd, qt.nvfp4)
        assert torch.equal(got.float(), torch.tensor(want).to(dt).float())


def test_given_tensor_scale_follows_the_rule():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    s = 0.001
    s32 = float(torch.tensor(s, dtype=torch.float32))
    want, _ = nvfp4_te(x.tolist(), qt.fp8_e4m3, qt.fp4_e2m1, tensor_scale=s32)
    got = qt.quantize(x, qt.nvfp4, tensor_scale=s32)
    assert torch.equal(_bits(got), _bits(torch.tensor(want)))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), 0.1, 1e39])
def test_a_tensor_scale_that_is_no_positive_finite_float32_is_refused(bad):
    with pytest.raises(ValueError, match="tensor_scale"):
        qt.quantize(torch.ones(16), qt.nvfp4, tensor_scale=bad)


# ---------------------------------------------------------------------------------------------
# Data movement keeps the values (and the tensor scale)

def _table(seed=3, rows=64, d=48):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, d, generator=g) * torch.exp2(torch.randint(-8, 8, (rows, 1),
                                                                     generator=g).float())
    return qt.as_qtensor(w, qt.nvfp4)


def _same(a, b):
    return torch.equal(_bits(a.dequantize() if isinstance(a, qt.QTensor) else a),
                       _bits(b.dequantize() if isinstance(b, qt.QTensor) else b))


@pytest.mark.parametrize("settle", [False, True])
def test_indexing_and_embedding_keep_values_bit_for_bit(settle):
    fmt = qt.nvfp4.replace(settle=settle)
    w = qt.as_qtensor(_table().dequantize(), fmt)
    idx = torch.tensor([5, 0, 63, 5, 17])
    for got in (w[idx], w.index_select(0, idx), torch.nn.functional.embedding(idx, w),
                w[2:9], w[idx][1:3]):
        assert isinstance(got, qt.QTensor) and got.fmt == fmt
        assert torch.equal(got.tensor_scale, w.tensor_scale)
    assert _same(w[idx], w.dequantize()[idx])
    assert _same(w.index_select(0, idx), w.dequantize()[idx])
    assert _same(torch.nn.functional.embedding(idx, w), w.dequantize()[idx])


def test_a_converted_embedding_looks_up_its_rows_bit_for_bit():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(100, 32)
    with torch.no_grad():
        emb.weight.mul_(torch.exp2(torch.randint(-10, 10, (100, 1)).float()))
    model = qt.convert(torch.nn.Sequential(emb), qt.nvfp4)
    w = model[0].weight
    idx = torch.tensor([[3, 99, 0], [42, 42, 7]])
    out = model(idx)
    assert _same(out, w.dequantize()[idx])


def test_cat_and_stack_of_tensors_sharing_the_scale_keep_values():
    w = _table()
    parts = torch.chunk(w, 4, dim=0)
    assert all(torch.equal(p.tensor_scale, w.tensor_scale) for p in parts)
    again = torch.cat(parts, dim=0)
    assert _same(again, w) and torch.equal(again.tensor_scale, w.tensor_scale)
    st = torch.stack(parts)
    assert _same(st.reshape(w.shape), w)


def test_cat_of_different_tensor_scales_rounds_again_under_one_fresh_scale():
    a, b = _table(1), _table(2) * 1000
    assert not torch.equal(a.tensor_scale, b.tensor_scale)
    c = torch.cat([a, b])
    want, s = nvfp4_te(torch.cat([a.dequantize(), b.dequantize()]).tolist(), qt.fp8_e4m3,
                       qt.fp4_e2m1)
    assert _same(c, torch.tensor(want)) and float(c.tensor_scale) == s


def test_copy_over_a_whole_destination_brings_values_and_scale():
    # the destination's old values are all overwritten: its old scale has no say (FSDP2 makes
    # its shards so: zeros, then a chunk of the parameter copied into a view of them)
    w = _table()
    part = torch.chunk(w, 4, dim=0)[1]  # rows of w: w's scale, not that of their own amax
    for dst in (torch.zeros_like(part), qt.as_qtensor(torch.randn(part.shape) * 1e3, qt.nvfp4)):
        assert not torch.equal(dst.tensor_scale, w.tensor_scale)
        dst.copy_(part)
        assert _same(dst, part) and torch.equal(dst.tensor_scale, w.tensor_scale)
    padded = torch.zeros_like(torch.cat([part, part]))
    view = padded.narrow(0, 0, part.shape[0])
    view.copy_(part)
    assert _same(view, part) and torch.equal(view.tensor_scale, w.tensor_scale)


def test_zero_padding_at_the_end_keeps_values_and_scale():
    # (DTensor pads an uneven shard so before its all-gather) the blocks keep their elements
    # and their amax, and the tensor its amax: nothing to round again, also where the values
    # are a piece of bigger blocks (rows 8.. of a bias of 15, one block of 16, whose amax is
    # among rows ..7: rounded as a block of their own, they would change)
    g = torch.Generator().manual_seed(0)
    bias = qt.as_qtensor(torch.randn(15, generator=g) * torch.logspace(1, 0, 15), qt.nvfp4)
    piece = bias[8:].clone()
    assert not _same(qt.as_qtensor(piece.dequantize(), qt.nvfp4,
                                   tensor_scale=bias.tensor_scale), piece)
    for pad in ((0, 1), (0, 9)):
        got = torch.nn.functional.pad(piece, pad)
        assert _same(got[:7], piece) and not got[7:].dequantize().any()
        assert torch.equal(got.tensor_scale, bias.tensor_scale)
    rows = _table()[3:5]
    got = torch.nn.functional.pad(rows, (0, 0, 0, 2))  # rows of zeros below
    assert _same(got[:2], rows) and torch.equal(got.tensor_scale, rows.tensor_scale)


def test_serialization_keeps_values_and_scale(tmp_path):
    w = _table()
    torch.save({"w": w}, tmp_path / "w.pt")
    back = torch.load(tmp_path / "w.pt", weights_only=True)["w"]
    assert _same(back, w) and torch.equal(back.tensor_scale, w.tensor_scale)
    import copy
    c = copy.deepcopy(w)
    assert _same(c, w) and torch.equal(c.tensor_scale, w.tensor_scale)


def test_compute_ops_take_a_fresh_te_scale():
    w = _table()
    y = w * 3.0
    want, s = nvfp4_te((w.dequantize() * 3.0).tolist(), qt.fp8_e4m3, qt.fp4_e2m1)
    assert _same(y, torch.tensor(want)) and float(y.tensor_scale) == s


@pytest.mark.parametrize("settle", [False, True])
def test_values_in_format_stay_in_format_under_their_scale(settle):
    """Values of the format, rounded again under their own tensor scale: with settle=True they
    come back bit for bit; TE's single pass (the default) gives them back except in blocks whose
    E4M3 scale is subnormal, where a block max that rounded down to 4 X re-derives a lower X
    (moves never round whole blocks again, so this only matters to an explicit re-rounding)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, 64, generator=g) * torch.exp2(torch.randint(-30, 4, (32, 1),
                                                                    generator=g).float())
    fmt = qt.nvfp4.replace(settle=settle)
    q = qt.as_qtensor(x, fmt)
    again = qt.quantize(q, fmt)  # under q's own tensor scale
    off = int((_bits(again) != _bits(q.dequantize())).sum())
    if settle:
        assert off == 0
    else:
        assert off < q.numel() // 20
    normal = qt.as_qtensor(torch.randn(32, 64, generator=g), qt.nvfp4)
    assert _same(qt.quantize(normal, qt.nvfp4), normal)


_TWO_LEVEL = {
    "nvfp4": qt.nvfp4,
    "4over6": qt.BlockFormat("fp4_e2m1", 16, scale="fp8_e4m3", scale_rule="4over6",
                             tensor_scale=True),
    "ceil": qt.BlockFormat("fp4_e2m1", 16, scale="fp8_e4m3", scale_rule="ceil",
                           tensor_scale=True),
    "settle": qt.nvfp4.replace(settle=True),
    "axis0": qt.nvfp4.replace(axis=0),
    "tiles": qt.nvfp4.replace(block_shape=(16, 16)),
    "ue5m3": qt.BlockFormat("fp4_e2m1", 16, scale="ue5m3", scale_rule="amax",
                            tensor_scale=True),
}


@pytest.mark.parametrize("rounding", ["nearest", "toward_zero", "stochastic"])
@pytest.mark.parametrize("name", list(_TWO_LEVEL))
def test_kernel_path_gives_the_reference_bits(name, rounding):
    """qt.quantize (its scalar roundings by the compiled kernels, into one buffer) and the
    pure-PyTorch reference give the same bits, non-finite values and partial blocks included."""
    fmt = _TWO_LEVEL[name]
    xs = dict(_inputs())
    nonfinite = xs["normal"].clone()
    nonfinite[1, 3], nonfinite[2, 40], nonfinite[5, 17] = float("inf"), float("nan"), -float("inf")
    xs["nonfinite"] = nonfinite
    for key, x in xs.items():
        if name == "tiles" and key == "partial":
            x = x[:, :20]
        got = qt.quantize(x, fmt, rounding=rounding, generator=torch.Generator().manual_seed(3))
        want = qt.reference.quantize(x, fmt, rounding=rounding,
                                     generator=torch.Generator().manual_seed(3))
        assert torch.equal(_bits(got), _bits(want)), (name, rounding, key)


# ---------------------------------------------------------------------------------------------
# Every rounding mode and scale rule against the oracle: the C++ kernel (qt.quantize), the
# reference, and the Triton kernel under its CPU interpreter

_ORACLE_FORMATS = {k: v for k, v in two_level_formats().items()
                   if k in ("nvfp4", "4over6", "ceil", "ue5m3", "settle", "4over6_settle")}
_MODES = ["nearest", "nearest_away", "toward_zero", "stochastic", "stochastic8"]


def _nbits(rounding):
    return int(rounding[len("stochastic"):] or 32) if rounding.startswith("stochastic") else None


def _oracle(x, fmt, rounding, seed=None, tensor_scale=None, index=None):
    """(values like x, decode scale) by the oracle; stochastic rounding with the words the
    documented generator gives each element's flat index in x (``index``: other indices)."""
    rows = x.reshape(-1, x.shape[-1])
    words = None
    if _nbits(rounding) is not None:
        index = torch.arange(x.numel()) if index is None else index
        words = random_bits(seed, index.reshape(-1)).reshape(rows.shape).tolist()
    want, s = nvfp4_te(rows.tolist(), fmt.scale, fmt.elem, tensor_scale=tensor_scale,
                       mode="stochastic" if words is not None else rounding, words=words,
                       nbits=_nbits(rounding) or 32, scale_rule=fmt.scale_rule,
                       settle=fmt.settle)
    return torch.tensor(want, dtype=torch.float32).reshape(x.shape), s


def _ties():
    """Elements exactly halfway between E2M1 values: the first row's amax 10.5 makes the tensor
    scale 2^-8, under which a block of amax 6 (or 6 / 8) has X s = 1 (1 / 8)."""
    ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5,
            -5.0, 0.5]
    return torch.tensor([[10.5] + [0.0] * 15, ties, [v / 8 for v in ties]])


@pytest.mark.parametrize("rounding", _MODES)
@pytest.mark.parametrize("name", list(_ORACLE_FORMATS))
def test_every_mode_and_scale_rule_matches_the_oracle_bit_for_bit(name, rounding):
    fmt = _ORACLE_FORMATS[name]
    for key, x in dict(two_level_inputs(more=True), ties=_ties()).items():
        seed = draw_seed(torch.Generator().manual_seed(len(key)))
        want, s = _oracle(x, fmt, rounding, seed)
        got = qt.quantize(x, fmt, rounding=rounding,
                          generator=torch.Generator().manual_seed(len(key)))
        assert torch.equal(_bits(got), _bits(want)), (key, "qt.quantize")
        ref, ref_s = reference.quantize_two_level(x, fmt, rounding, seed)
        assert torch.equal(_bits(ref), _bits(want)), (key, "reference")
        assert float(ref_s) == s, key


def _scale_boundaries(fmt, stride):
    """Blocks whose amax lies within a float32 ulp of where a scale rule's choice changes, under
    the tensor scale of the first block (amax T): 6 X s (ceil), and the midpoints m of scale
    values X < Y times 6 s and 4 s (the nearest scale of the map-to-6 and map-to-4 targets);
    the other 15 elements are fixed fractions of the amax, or zeros."""
    T = 1.2345677614212036  # (a float32)
    enc = float(torch.tensor(6 * fmt.tensor_scale_bound / T, dtype=torch.float32))
    dec = 1.0 / enc
    xs = sorted(v for _c, v in float_codes(fmt.scale) if v is not None and 0 < v < math.inf)
    amaxes = []
    for X, Y in list(zip(xs, xs[1:]))[::stride]:
        for target in (6 * X, 3 * (X + Y), 2 * (X + Y)):
            a = torch.tensor(target * dec, dtype=torch.float32).view(torch.int32)
            amaxes += [v for v in (a + torch.tensor([-1, 0, 1], dtype=torch.int32))
                       .view(torch.float32).tolist() if 0 < v < T]
    frac = torch.rand(15, generator=torch.Generator().manual_seed(8)) * 2 - 1
    a = torch.tensor(amaxes).unsqueeze(1)
    # every other block holds its amax alone: there 4over6's map-to-6 can win
    frac = frac * (torch.arange(len(amaxes)) % 2).unsqueeze(1)
    blocks = torch.cat([a, a * frac], dim=1)
    return torch.cat([torch.tensor([[T] + [0.0] * 15]), blocks])


@pytest.mark.parametrize("name,rounding", [("nvfp4", "nearest"), ("4over6", "nearest"),
                                           ("ceil", "nearest"), ("ue5m3", "stochastic"),
                                           ("settle", "toward_zero"),
                                           ("4over6_settle", "stochastic")])
def test_blocks_at_the_scale_rules_boundaries_match_the_oracle(name, rounding):
    fmt = _ORACLE_FORMATS[name]
    x = _scale_boundaries(fmt, 1 if name == "4over6" else 4)
    seed = draw_seed(torch.Generator().manual_seed(9))
    want, s = _oracle(x, fmt, rounding, seed)
    got = qt.quantize(x, fmt, rounding=rounding, generator=torch.Generator().manual_seed(9))
    assert torch.equal(_bits(got), _bits(want))
    ref, ref_s = reference.quantize_two_level(x, fmt, rounding, seed)
    assert torch.equal(_bits(ref), _bits(want)) and float(ref_s) == s


@pytest.mark.parametrize("name,rounding", [("4over6", "stochastic"), ("ceil", "toward_zero"),
                                           ("settle", "stochastic5"),
                                           ("4over6_settle", "nearest_away")])
def test_given_tensor_scale_in_every_mode_follows_the_oracle(name, rounding):
    fmt = _ORACLE_FORMATS[name]
    x = two_level_inputs()["one_block_hot"]
    seed = draw_seed(torch.Generator().manual_seed(5))
    for s in (2.0 ** -126, float(torch.tensor(7.5e-6)), 1.0):
        want, _ = _oracle(x, fmt, rounding, seed, tensor_scale=s)
        got = qt.quantize(x, fmt, rounding=rounding, tensor_scale=s,
                          generator=torch.Generator().manual_seed(5))
        assert torch.equal(_bits(got), _bits(want)), s


def test_a_row_major_index_of_blocks_along_dim0_draws_each_elements_own_word():
    # blocks down the columns: element (i, j) keeps the word of its index i * cols + j
    fmt = qt.nvfp4.replace(axis=0)
    x = two_level_inputs()["heavy"].t().contiguous()[:, :40]  # [64, 40]: 4 blocks per column
    seed = draw_seed(torch.Generator().manual_seed(6))
    idx = torch.arange(x.numel()).reshape(x.shape)
    want, _ = _oracle(x.t(), fmt, "stochastic", seed, index=idx.t())
    got = qt.quantize(x, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(6))
    assert torch.equal(_bits(got), _bits(want.t()))


@pytest.mark.parametrize("name,roundings", [("nvfp4", ("stochastic", "toward_zero")),
                                            ("4over6", ("stochastic", "nearest_away")),
                                            ("ceil", ("stochastic",)),
                                            ("ue5m3", ("stochastic",)),
                                            ("4over6_settle", ("stochastic", "toward_zero"))])
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # (the interpreter's casts)
def test_triton_kernel_matches_the_oracle_bit_for_bit(name, roundings, monkeypatch):
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    from qtensor.kernels import backend, gpu
    from helpers import count_calls
    calls = count_calls(monkeypatch, gpu, "quantize_two_level")
    xs = two_level_inputs(more=True)
    x = torch.cat([xs[k][:, :48] for k in ("normal", "heavy", "one_block_hot", "nonfinite",
                                           "tiny")] + [torch.zeros(1, 48), -torch.zeros(1, 48)])
    fmt = _ORACLE_FORMATS[name]
    for rounding in roundings:
        seed = 0x9E3779B97F4A7C15  # above 2^63: a key of the high half too
        want, s = _oracle(x, fmt, rounding, seed)
        with gpu.force():
            got, got_s = backend.two_level(x, fmt, rounding, seed, with_scale=True)
        assert torch.equal(_bits(got), _bits(want)), rounding
        assert float(got_s) == s
    assert len(calls) == len(roundings)


@pytest.mark.parametrize("rounding", ["stochastic", "stochastic3"])
def test_stochastic_rounding_of_a_block_is_unbiased_over_seeds(rounding):
    """One block under a fixed scale (its max 6 X s = 6 stays; the other block sets the tensor
    scale 2^-8, X s = 1): over n seeds the mean of each element lies within Hoeffding's bound
    of its expectation, x itself (stochasticN: x less the part of frac below 2^-N)."""
    vals = [6.0, 0.1, 0.3, 0.7, 1.1, 1.3, 2.2, 2.9, 3.3, 3.7, 4.5, 5.1, 5.9, -0.45, -2.6,
            -5.3]
    x = torch.tensor([vals, [10.5] + [0.0] * 15])
    n = 2000
    total = torch.zeros(16, dtype=torch.float64)
    for k in range(n):
        q = qt.quantize(x, qt.nvfp4, rounding=rounding, generator=torch.Generator().manual_seed(k))
        assert q[0, 0] == 6.0 and q[1, 0] == 10.5
        total += q[0].double()
    mean = total / n
    xs = x[0].double()
    a = xs.abs()
    h = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))  # E2M1's spacing at |x|
    frac = (a - torch.floor(a / h) * h) / h
    nb = _nbits(rounding)
    want = xs - torch.sign(xs) * h * (frac * 2 ** nb - torch.floor(frac * 2 ** nb)) / 2 ** nb
    # Hoeffding: P(|mean - E| >= t) <= 2 exp(-2 n t^2 / h^2), over 16 elements at most 1e-6
    t = h * math.sqrt(math.log(2 * 16 / 1e-6) / (2 * n))
    assert ((mean - want).abs() <= t).all(), (mean - want) / h

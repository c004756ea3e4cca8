"""Warnings when a role's format flushes most of a tensor to zero or saturates it."""
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import qtensor as qt
from qtensor.tensor import flush_warnings as fw


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(fw, "_warned", set())
    monkeypatch.setattr(fw, "_clip_calls", {})
    monkeypatch.setattr(fw, "_gemm_calls", {}, raising=False)
    monkeypatch.setattr(fw, "_enabled", [True])


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _step(model, n=1, batch=512):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(n):
            g = torch.Generator().manual_seed(i)
            x = torch.randn(batch, 64, generator=g)
            y = torch.randint(0, 10, (batch,), generator=g)
            F.cross_entropy(model(x), y).backward()  # the user's line
    return [w for w in caught if "qtensor:" in str(w.message) and "role" in str(w.message)]


def test_nvfp4_single_gradients_warn_once_at_the_users_line():
    model = qt.convert(_mlp(), qt.Recipe(weight=qt.fp32, grad=qt.nvfp4_single))
    found = _step(model, n=3)
    msgs = [str(w.message) for w in found]
    assert msgs, "nvfp4_single gradients were not reported"
    # once per role and tensor over three steps
    assert len(msgs) == len(set(msgs)) and len(msgs) <= 4
    assert any("grad role" in m and "nvfp4_single" in m and "rounded to zero" in m for m in msgs)
    assert all(w.filename == __file__ for w in found)


def test_fraction_in_the_message_is_exact():
    g = torch.tensor([1e-9, 2e-9, 1.0, 0.0, 1e-9, 3e-9])
    role = qt.Role(qt.nvfp4_single)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fw.check("grad", "gradient of w", role, g, qt.quantize(g, qt.nvfp4_single))
    # 4 of the 5 nonzero values are far below the E4M3 scale's reach
    assert len(caught) == 1 and "80.0% of its 5 nonzero values" in str(caught[0].message)


def test_narrow_fixed_point_activation_saturates():
    model = qt.convert(_mlp(), qt.Recipe(weight=qt.fp32, activation=qt.FixedFormat(8, 7)))
    found = _step(model)
    assert any("activation role" in str(w.message) and "saturated" in str(w.message)
               for w in found)


@pytest.mark.parametrize("spec", ["bf16", "mxfp8_e4m3", "mxfp6"])
def test_healthy_formats_do_not_warn(spec):
    spec = qt.recipes.mxfp6 if spec == "mxfp6" else qt.format(spec)
    model = qt.convert(_mlp(), spec)
    assert _step(model, n=2) == []


def test_switch_turns_it_off():
    qt.set_flush_warnings(False)
    model = qt.convert(_mlp(), qt.Recipe(weight=qt.fp32, grad=qt.nvfp4_single))
    assert _step(model) == []
    qt.set_flush_warnings(True)
    assert _step(model) != []
    with pytest.raises(TypeError):
        qt.set_flush_warnings("no")


def test_environment_variable_turns_it_off():
    code = "import qtensor as qt; print(qt.tensor.flush_warnings.flush_warnings_enabled())"
    env = dict(os.environ, QTENSOR_FLUSH_WARNINGS="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                         check=True)
    assert out.stdout.strip() == "False"


def test_not_under_compile():
    calls = []
    model = qt.convert(_mlp(), qt.Recipe(weight=qt.fp32, activation=qt.FixedFormat(8, 7)))
    with fw.observe(lambda *a: calls.append(a[1])):
        compiled = torch.compile(model, backend="eager", fullgraph=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled(torch.randn(4, 64))
    assert calls == []


def test_weights_flushed_at_conversion_warn_at_the_convert_line():
    layer = torch.nn.Linear(64, 64)
    with torch.no_grad():
        layer.weight.mul_(1e-4)  # below fp8_e4m3's smallest subnormal (2^-9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qt.convert(layer, qt.Recipe(weight="fp8_e4m3"))  # the user's line
    found = [w for w in caught if "weight role" in str(w.message)]
    assert len(found) == 1 and found[0].filename == __file__
    assert "weight (weight role, shape (64, 64)) in fp8_e4m3: 100.0%" in str(found[0].message)


# ---------------------------------------------------------------------------------------------
# Clipping inside a block: fw.clipping against a per-block float64 oracle

def _oracle(x, *args, **kwargs):
    from oracles import block_clipping
    return block_clipping(x.double().tolist(), *args, **kwargs)


def _heavy(shape, seed):
    """Values whose blocks' amax spreads over the binade, with a few outliers and zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g))
    x[0, :5] = 0.0
    x[1, 1] = -1.99 * 2 ** 8  # a block max just below its binade's end: even MXINT8 clips it
    return x


@pytest.mark.parametrize("name,elem_max,emax", [("mxfp4_e2m1", 6.0, 2), ("mxfp8_e4m3", 448.0, 8),
                                                 ("mxint8", 127 / 64, 0), ("mxfp6_e3m2", 28.0, 4)])
@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_clipped_against_a_per_block_oracle(name, elem_max, emax, rule):
    x = _heavy((16, 80), 1)  # 80: two full blocks of 32 and a partial one per row
    fmt = qt.format(name).replace(scale_rule=rule)
    want, lost = _oracle(x, rule, elem_max, emax, bs=32)
    got = fw.clipping(x, fmt)
    q = qt.quantize(x, fmt)
    assert got["clipped"] == want and got["lost"] == pytest.approx(lost, rel=1e-5, abs=1e-30)
    assert fw.clipping(x, fmt, q) == got  # the rounded values give the same scales
    if rule == "ceil":
        assert want == 0
    else:
        assert want > 0
        assert want <= int((q.abs() < x.abs()).sum())  # each of them rounded down
    assert got["magnitude"] == pytest.approx(float(x.abs().double().sum()))


def test_clipped_nvfp4_against_a_per_block_oracle():
    x = _heavy((16, 64), 2)
    got = fw.clipping(x, qt.nvfp4, qt.quantize(x, qt.nvfp4))
    want, lost = _oracle(x, "amax", 6.0, 2, bs=16, nvfp4=True)
    assert got["clipped"] == want and got["lost"] == pytest.approx(lost, rel=1e-5)
    # the amax rule clips a block's max only where its scale rounded down: by < 2^-4 of it
    assert 0 < want < x.numel() / 16 and got["lost"] / got["magnitude"] < 0.01
    assert fw.clipping(x, qt.nvfp4) == got  # rounded here: the same


def test_clipped_custom_block_format_with_one_more_negative_code():
    # int8 elements with -128 (min -2, max 127/64), blocks of 8, the floor rule
    fmt = qt.BlockFormat(qt.FixedFormat(8, 6), 8, scale="e8m0")
    x = _heavy((8, 40), 3)
    x[2, 9] = 1.995 * 2 ** 8  # clipped to 127/64 * 2^8
    x[1, 1] = -1.999 * 2 ** 8  # not: -2 * 2^8 is on the grid
    want, lost = _oracle(x, "floor", 127 / 64, 0, bs=8, elem_min=-2.0)
    got = fw.clipping(x, fmt)
    assert got["clipped"] == want > 0 and got["lost"] == pytest.approx(lost, rel=1e-5)
    q = qt.quantize(x, fmt)
    assert q[1, 1] == -512 and q[2, 9] == 127 / 64 * 2 ** 8  # as the rounding has it


@pytest.mark.parametrize("axis", [-1, -2])
def test_clipped_2d_tiles(axis):
    fmt = qt.format("mxfp4_e2m1").replace(block_shape=(4, 8), axis=axis)
    x = _heavy((10, 20), 4)  # partial tiles at both ends
    tile = (4, 8) if axis == -1 else (8, 4)
    want, lost = _oracle(x, "floor", 6.0, 2, tile=tile)
    got = fw.clipping(x, fmt)
    assert got["clipped"] == want > 0 and got["lost"] == pytest.approx(lost, rel=1e-5)


def test_clipped_scalar_and_degenerate_cases():
    x = _heavy((4, 64), 5)
    assert fw.clipping(x, qt.format("fp8_e4m3")) is None  # no block scale
    fmt = qt.format("mxfp4_e2m1")
    y = x.clone()
    y[0, 3] = float("inf")  # its block rounds to NaN: left out, the others counted
    base = fw.clipping(x, fmt)
    got = fw.clipping(y, fmt)
    blk = x[0, :32]
    amax = float(blk.abs().max())
    import math
    top = 6 * 2.0 ** (math.floor(math.log2(amax)) - 2)
    assert got["clipped"] == base["clipped"] - int((blk.abs() > top).sum())
    assert fw.clipping(torch.zeros(0, 32), fmt)["clipped"] == 0
    assert fw.clipping(x.to(torch.bfloat16), fmt)["clipped"] == fw.clipping(
        x.to(torch.bfloat16).float(), fmt)["clipped"]


def _demo_recipe(rule):
    """examples/demo.py's MXFP4 row: BF16 values (FP32 weights), MXFP4 operands."""
    f = qt.format("mxfp4_e2m1").replace(scale_rule=rule)
    return qt.recipes.mxfp6.replace(weight=(qt.fp32, f), activation=(qt.bf16, f),
                                    grad=(qt.bf16, f))


def _clip_warnings(found):
    return [str(w.message) for w in found if "clipped to it" in str(w.message)]


def test_mxfp4_floor_clips_fc2s_gradient_and_the_ceil_rule_does_not():
    # the demo's divergence: OCP's floor scale clips the true class's p - 1 in each row of
    # dL/dlogits (blocks along the 10 classes) from up to 8 down to 6 times the block scale
    # nn.Linear's uniform init: a quarter of each block's values above 6/8 of its max
    with pytest.warns(UserWarning, match=r"0.weight \(weight role.*25.3% .* clipped to it"):
        model = qt.convert(_mlp(), _demo_recipe("floor"))
    found = _step(model, n=3)
    msgs = _clip_warnings(found)
    fc2 = [m for m in msgs if m.startswith("qtensor: gradient of the output of 2 (grad role, "
                                           "shape (512, 10)) as an operand in mxfp4_e2m1")]
    assert len(fc2) == 1, msgs  # once over three steps
    assert "10.0% of its 5120 nonzero values" in fc2[0] and "scale_rule='ceil'" in fc2[0]
    assert all(w.filename == __file__ for w in found)
    assert not any("gradient of 2.bias" in m or "gradient of 2.weight" in m for m in msgs)
    model = qt.convert(_mlp(), _demo_recipe("ceil"))
    assert _clip_warnings(_step(model, n=3)) == []


def test_clipping_is_checked_on_a_schedule():
    role = qt.Role(qt.bf16, mm_fmt=qt.format("mxfp4_e2m1"))
    healthy = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    clipped = torch.full((64, 64), 0.1)
    clipped[:, ::16] = -0.95  # each block's max 0.95: clipped to 0.75, 1 value in 16
    calls = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(1, 40):
            fw.check_operand("grad", "gradient of the output of fc", role,
                             clipped if i >= 6 else healthy)
            if caught and not calls:
                calls.append(i)
    # checked on roundings 1-4, then one in 16: the first clipped one checked is the 16th
    assert calls == [fw.CLIP_CHECK_EVERY] and len(_clip_warnings(caught)) == 1


@pytest.mark.parametrize("fmt", [qt.nvfp4.replace(rounding="toward_zero"), qt.nvfp4_single,
                                 qt.format("mxfp4_e2m1").replace(scale_rule="even"),
                                 qt.nvfp4.replace(scale_rule="4over6")],
                         ids=["nvfp4_toward_zero", "nvfp4_single", "mxfp4_even", "4over6"])
def test_clipped_values_are_rounded_down_to_their_blocks_top(fmt):
    # rules whose rounding may lower a block's scale: X from the rounded block; every value
    # counted lies above |q| at its block's rounded max, and x alone (rounded here) agrees
    x = _heavy((32, 64), 6) * torch.exp(
        3 * torch.randn(32, 1, generator=torch.Generator().manual_seed(7)))
    q = qt.quantize(x, fmt)
    got = fw.clipping(x, fmt, q)
    b, bq = fw._blocks(x, fmt), fw._blocks(q, fmt)
    at_top = (b.abs() > bq.abs()) & (bq.abs() == bq.abs().amax(-1, keepdim=True))
    assert 0 < got["clipped"] <= int(at_top.sum())
    assert got["lost"] <= float(((b.abs() - bq.abs()) * at_top).double().sum()) * (1 + 1e-5)
    assert fw.clipping(x, fmt) == got


def test_recipe_gemm_operands_are_watched():
    # quartet's forward GEMM: MXFP4 with the floor scale rule (after a Hadamard transform) on
    # values whose blocks' amax is 1.9 times a power of two: the largest values clip to 1.5
    mx4 = qt.format("mxfp4_e2m1")
    recipe = qt.Recipe(weight=qt.fp32, activation=qt.fp32, gemm={"fprop": (mx4, None)})
    model = qt.convert(torch.nn.Sequential(torch.nn.Linear(64, 8)), recipe)
    x = torch.full((16, 64), 1.9)
    with pytest.warns(UserWarning, match=r"input of 0 \(forward GEMM operand\).*mxfp4_e2m1.*"
                      "clipped"):
        model(x)
    model(x)  # (once per tensor)


def test_mxfp6_char_lm_first_step_does_not_warn_and_mxfp4_does():
    """qt.recipes.mxfp6 (the MX paper's recipe, OCP's floor rule) on a byte-level LM head (162
    classes, 32x64 tokens): at initialisation each row of dL/dlogits holds the true class's
    p - 1 (half the row's L1 norm), which floor clips by up to 1/8 in E3M2 (28 of 32): ~6% of
    the norm, measured harmless (examples/mx_training.py, docs/analysis.md). Before: a warning
    on every run suggesting scale_rule='ceil'. The same LM with MXFP4 gradient operands (which
    clip a value by up to 1/4, the demo's divergence) still warns."""
    torch.manual_seed(0)

    def lm():
        return torch.nn.Sequential(torch.nn.Embedding(162, 64), torch.nn.Linear(64, 64),
                                   torch.nn.GELU(), torch.nn.Linear(64, 162))
    tokens = torch.randint(0, 162, (32, 65), generator=torch.Generator().manual_seed(1))

    def clip_warnings(spec):
        model = qt.convert(lm(), spec)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.reshape(-1, 162), tokens[:, 1:].reshape(-1)).backward()
        return [str(w.message) for w in caught if "clipped to it" in str(w.message)]
    assert clip_warnings(qt.recipes.mxfp6) == []
    f4 = qt.format("mxfp4_e2m1")
    said = clip_warnings(qt.recipes.mxfp6.replace(grad=(qt.bf16, f4)))
    assert any(m.startswith("qtensor: gradient of the output of 3 (grad role") and
               "scale_rule='ceil'" in m for m in said), said

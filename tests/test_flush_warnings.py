"""Warnings when a role's format flushes most of a tensor to zero or saturates it."""
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import qtensor as qt
from qtensor import flush_warnings as fw


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(fw, "_warned", set())
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
    code = "import qtensor as qt; print(qt.flush_warnings.flush_warnings_enabled())"
    env = dict(os.environ, QTENSOR_FLUSH_WARNINGS="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(__file__)), check=True)
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

"""Converted checkpoints as plain tensors plus formats (qtensor.serialization): torch.load without
qtensor, and safetensors files. Hugging Face checkpoints: tests/test_hf.py."""
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import qtensor as qt
from conftest import assert_bits_equal
from qtensor.serialization import recipe_from_dict, recipe_to_dict

RECIPE = qt.Recipe(weight=("bf16", "mxfp6_e3m2"), bias="fp8_e4m3", activation=("bf16", "mxfp8_e4m3"),
                   grad="bf16", accumulate="hopper_fp8", rules={"1.*": None, "2.bias": "fp16"})


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8),
                         nn.BatchNorm1d(8))


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        x, y = sa[name], sb[name]
        assert type(x) is type(y), name
        if isinstance(x, qt.QTensor):
            assert (x.fmt, x.mm_fmt, x.accum) == (y.fmt, y.mm_fmt, y.accum), name
            x, y = x.dequantize(), y.dequantize()
        if x.is_floating_point():
            assert_bits_equal(x, y, name)
        else:
            assert torch.equal(x, y), name


def _trained():
    model = qt.convert(_model(), RECIPE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(6, 16)).dequantize().sum().backward()
    opt.step()
    return model


@pytest.mark.parametrize("recipe", [RECIPE, qt.recipes.mxfp6, qt.recipes.swalp,
                                    qt.Recipe(weight="fixed8.4", loss_scale="dynamic"),
                                    qt.Recipe(weight="fp8_e4m3", loss_scale=1024.0),
                                    qt.Recipe(weight=("bf16", "fp8_e4m3"), accumulate=(
                                        qt.accum.AccumFormat(chunk=8, frac_bits=20))),
                                    qt.recipes.nvfp4_nvidia, qt.recipes.quartet,
                                    qt.Recipe(weight=(None, "bf16"), gemm={
                                        "linear": {"dgrad": ("nvfp4", None)},
                                        "conv": {"transform": {"fprop": qt.Hadamard(signs=3)}}},
                                        last_layers=(2, "fp32"))],
                         ids=lambda r: r.name or "custom")
def test_recipe_round_trips_through_json(recipe):
    import json
    assert recipe_from_dict(json.loads(json.dumps(recipe_to_dict(recipe)))) == recipe


def test_plain_state_dict_round_trip(tmp_path):
    model = _trained()
    sd = qt.plain_state_dict(model)
    assert all(type(v) is torch.Tensor for v in sd["tensors"].values())
    assert sd["formats"]["0.weight"] == {"fmt": "bf16", "mm_fmt": "mxfp6_e3m2",
                                         "accum": "hopper_fp8"}
    assert "1.weight" not in sd["formats"]  # kept plain by a rule
    path = tmp_path / "plain.pt"
    torch.save(sd, path)
    loaded = torch.load(path, weights_only=True)
    fresh = _model(seed=1)
    qt.load_plain_state_dict(fresh, loaded)  # converts it to the checkpoint's recipe
    _assert_same_state(fresh, model)
    x = torch.randn(4, 16)
    model.eval(), fresh.eval()
    assert_bits_equal(fresh(x).dequantize(), model(x).dequantize())
    plain = _model(seed=2)
    plain.load_state_dict(loaded["tensors"])  # plain tools read the values
    assert_bits_equal(plain[0].weight.detach(), model[0].weight.detach().dequantize())


def test_plain_checkpoint_loads_without_qtensor(tmp_path):
    path = tmp_path / "plain.pt"
    torch.save(qt.plain_state_dict(_trained()), path)
    code = ("import sys, torch; sd = torch.load(sys.argv[1], weights_only=True); "
            "assert 'qtensor' not in sys.modules; print(sd['formats']['0.weight']['fmt'], "
            "type(sd['tensors']['0.weight']).__name__)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["bf16", "Tensor"]


def test_load_plain_state_dict_refuses_other_formats():
    sd = qt.plain_state_dict(_trained())
    other = qt.convert(_model(), qt.bf16)
    with pytest.raises(ValueError, match="converted with another recipe"):
        qt.load_plain_state_dict(other, sd)
    sd["recipe"] = None
    with pytest.raises(ValueError, match="formats differ between the checkpoint and the model: 0.weight: checkpoint bf16, model fp8_e4m3"):
        qt.load_plain_state_dict(qt.convert(_model(), qt.fp8_e4m3), sd)
    plain = qt.plain_state_dict(_model())  # plain values would be rounded into the formats
    with pytest.raises(ValueError, match="0.weight: checkpoint plain, model bf16"):
        qt.load_plain_state_dict(qt.convert(_model(), qt.bf16), plain)
    with pytest.raises(TypeError, match="expected what qt.plain_state_dict returns"):
        qt.load_plain_state_dict(_model(), _model().state_dict())


def test_safetensors_round_trip(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors import safe_open
    model = _trained()
    path = tmp_path / "m.safetensors"
    qt.save_safetensors(model, path)
    with safe_open(str(path), framework="pt") as f:
        assert "qtensor.formats" in f.metadata() and "qtensor.recipe" in f.metadata()
    loaded = qt.load_safetensors(path)
    fresh = _model(seed=3)
    qt.load_plain_state_dict(fresh, loaded)
    _assert_same_state(fresh, model)
    sd = qt.qtensor_state_dict(loaded)  # a state dict of QTensors, without a model
    assert sd["0.weight"].fmt == qt.bf16 and sd["0.weight"].accum == qt.accum.hopper_fp8


def test_safetensors_of_tied_weights(tmp_path):
    pytest.importorskip("safetensors")
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10, bias=False))
    model[1].weight = model[0].weight
    qt.convert(model, qt.fp8_e4m3)
    qt.save_safetensors(model, tmp_path / "t.safetensors")
    fresh = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10, bias=False))
    fresh[1].weight = fresh[0].weight
    qt.load_plain_state_dict(fresh, qt.load_safetensors(tmp_path / "t.safetensors"))
    assert fresh[1].weight is fresh[0].weight
    _assert_same_state(fresh, model)

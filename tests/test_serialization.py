"""Converted checkpoints as plain tensors plus formats (qtensor.serialization): torch.load without
qtensor, safetensors files, and Hugging Face save_pretrained / from_pretrained (qtensor.hf)."""
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
                                    qt.Recipe(weight="fp8_e4m3", loss_scale=1024.0)],
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


# ---------------------------------------------------------------------------------------------
# Hugging Face

def _tiny_gpt2(**kw):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, **kw)
    return transformers.GPT2LMHeadModel(cfg)


def _tiny_llama(**kw):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                   max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                                   pad_token_id=0, **kw)
    return transformers.LlamaForCausalLM(cfg)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("make", [_tiny_gpt2, _tiny_llama], ids=["gpt2", "llama"])
def test_hf_save_pretrained_and_back(tmp_path, make):
    model = make().to(qt.recipes.mxfp6)
    model.eval()
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(Exception, match="invalid shape, data type, or offset"):
        model.save_pretrained(tmp_path / "direct")  # safetensors cannot store QTensors
    qt.hf.save_pretrained(model, tmp_path / "ckpt")
    assert not hasattr(model.config, "qtensor")
    loaded = qt.hf.from_pretrained(type(model), tmp_path / "ckpt")
    _assert_same_state(loaded, model)
    tied = loaded.lm_head.weight is loaded.get_input_embeddings().weight
    assert tied == (model.lm_head.weight is model.get_input_embeddings().weight)  # GPT-2: tied
    assert_bits_equal(loaded(input_ids=ids).logits.dequantize(),
                      model(input_ids=ids).logits.dequantize())
    plain = type(model).from_pretrained(tmp_path / "ckpt")  # plain transformers: plain values
    assert type(plain.lm_head.weight) is nn.Parameter


def test_hf_from_pretrained_plain_then_convert(tmp_path):
    model = _tiny_gpt2()
    model.save_pretrained(tmp_path / "plain")
    loaded = qt.hf.from_pretrained(type(model), tmp_path / "plain")
    assert type(loaded.lm_head.weight) is nn.Parameter
    loaded.to(qt.recipes.mxfp6)
    ref = qt.convert(model, qt.recipes.mxfp6)
    _assert_same_state(loaded, ref)


def test_hf_model_to_fmt_is_convert():
    model, ref = _tiny_llama(), _tiny_llama()
    assert model.to(qt.mxfp8_e4m3) is model
    qt.convert(ref, qt.mxfp8_e4m3)
    _assert_same_state(model, ref)

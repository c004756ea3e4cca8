"""Hugging Face transformers models (tiny configs, random init, no download): model.to(fmt),
save_pretrained / from_pretrained with the formats (qtensor.integrations.hf), attention implementations,
the leak_check allow lists, torch.compile. Skipped without transformers."""
import contextlib
import copy
import os

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import qtensor as qt
from helpers import assert_bits_equal
from test_serialization import _assert_same_state

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no downloads: every model comes from a config
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def _tiny_gpt2(**kw):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, **kw)
    return transformers.GPT2LMHeadModel(cfg)


def _tiny_llama(**kw):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                   max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                                   pad_token_id=0, **kw)
    return transformers.LlamaForCausalLM(cfg)


def _tiny_llama_tied():
    return _tiny_llama(tie_word_embeddings=True)


@pytest.mark.parametrize("save", ["model.save_pretrained", "qt.hf.save_pretrained"])
@pytest.mark.parametrize("make", [_tiny_gpt2, _tiny_llama, _tiny_llama_tied],
                         ids=["gpt2", "llama", "llama-tied"])
def test_hf_save_pretrained_and_back(tmp_path, make, save):
    model = make().to(qt.recipes.mxfp6)
    model.eval()
    ids = torch.randint(0, 64, (2, 8))
    if save == "model.save_pretrained":
        model.save_pretrained(tmp_path / "ckpt")  # the model's own (installed by qt.convert)
    else:
        qt.hf.save_pretrained(model, tmp_path / "ckpt")
    assert not hasattr(model.config, "qtensor")
    loaded = qt.hf.from_pretrained(type(model), tmp_path / "ckpt")
    _assert_same_state(loaded, model)
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    assert tied == (make is not _tiny_llama)  # GPT-2 ties by default, Llama does not
    assert (loaded.lm_head.weight is loaded.get_input_embeddings().weight) == tied
    assert_bits_equal(loaded(input_ids=ids).logits.dequantize(),
                      model(input_ids=ids).logits.dequantize())
    plain = type(model).from_pretrained(tmp_path / "ckpt")  # plain transformers: plain values
    assert type(plain.lm_head.weight) is nn.Parameter
    assert plain.config.qtensor["recipe"]["name"] == qt.recipes.mxfp6.name  # (unused by it)
    assert_bits_equal(plain.lm_head.weight, model.lm_head.weight.dequantize())


def test_hf_save_pretrained_with_a_state_dict_and_after_changes(tmp_path):
    # what the Trainer does: model.save_pretrained(dir, state_dict=model.state_dict()), here
    # with state_dict by position; then a deep copy, a reconversion and qt.unconvert
    model = _tiny_gpt2().to(qt.fp8_e4m3).eval()
    ids = torch.randint(0, 64, (2, 8))
    model.save_pretrained(tmp_path / "a", True, model.state_dict())
    assert_bits_equal(qt.hf.from_pretrained(type(model), tmp_path / "a")(input_ids=ids)
                      .logits.dequantize(), model(input_ids=ids).logits.dequantize())
    twin = copy.deepcopy(model)
    assert twin.save_pretrained.module is twin
    twin.to(qt.bf16)  # converted again: saves its new formats
    twin.save_pretrained(tmp_path / "b")
    assert qt.hf.from_pretrained(type(twin), tmp_path / "b").lm_head.weight.fmt == qt.bf16
    qt.unconvert(twin)  # the class's save_pretrained again: a plain checkpoint
    assert "save_pretrained" not in twin.__dict__
    twin.save_pretrained(tmp_path / "c")
    assert type(qt.hf.from_pretrained(type(twin), tmp_path / "c").lm_head.weight) is nn.Parameter


def test_hf_from_pretrained_refuses_values_out_of_format(tmp_path):
    model = _tiny_gpt2().to(qt.fp8_e4m3)
    qt.hf.save_pretrained(model, tmp_path / "ckpt")
    tampered = type(model).from_pretrained(tmp_path / "ckpt")  # plain, config still has formats
    with torch.no_grad():
        tampered.lm_head.weight.mul_(1.01)  # (tied: the embedding too)
    tampered.save_pretrained(tmp_path / "tampered")
    with pytest.raises(ValueError, match="not in the formats its config names .*: "
                                         "lm_head.weight \\(fp8_e4m3\\), transformer.wte.weight"):
        qt.hf.from_pretrained(type(model), tmp_path / "tampered")
    # FP8 values survive a float16 load exactly: it converts
    assert qt.hf.from_pretrained(type(model), tmp_path / "ckpt",
                                 dtype=torch.float16).lm_head.weight.fmt == qt.fp8_e4m3


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


def _step(model, ids, mask=None):
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    return out


@pytest.mark.parametrize("make", [_tiny_gpt2, _tiny_llama], ids=["gpt2", "llama"])
def test_sdpa_math_has_no_leaks_with_the_allow_list(make):
    # SDPA (HF's default) under the MATH backend decomposes into emulated ops: with padding
    # masks, forward and backward, the only plain values are the rotary tables (LEAK_ALLOW)
    model = make().to(qt.recipes.mxfp6).train()
    ids = torch.randint(1, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    with sdpa_kernel(SDPBackend.MATH), qt.leak_check(allow=qt.hf.LEAK_ALLOW):
        _step(model, ids, mask)
    # without MATH, the fused CPU kernel is reported (its operands have operand formats)
    model.eval()
    with torch.no_grad(), qt.leak_check(action="record", allow=qt.hf.LEAK_ALLOW) as report:
        model(input_ids=ids, attention_mask=mask)
    assert [f.kind for f in report.findings] == ["fused"]


def test_the_leaks_the_allow_lists_stand_for():
    ids = torch.randint(1, 64, (2, 8))
    llama = _tiny_llama().to(qt.recipes.mxfp6)
    with sdpa_kernel(SDPBackend.MATH), qt.leak_check(action="record") as report:
        _step(llama, ids)
    assert [(f.kind, f.module) for f in report.findings] == [("mixed", "model.rotary_emb")]
    eager = _tiny_gpt2(attn_implementation="eager").to(qt.recipes.mxfp6)
    with qt.leak_check(action="record", allow=qt.hf.LEAK_ALLOW) as report:
        _step(eager, ids)
    # the additive float mask of eager attention
    assert [(f.kind, f.module, f.op) for f in report.findings] == [
        ("mixed", "transformer.h.0.attn", "aten.add.Tensor")]
    with qt.leak_check(allow=qt.hf.LEAK_ALLOW_EAGER):
        _step(eager, ids)


def test_rotary_frequencies_in_full_precision_by_a_rule():
    # a bare MX format would round inv_freq (the RoPE frequencies) to MXFP8: a rule keeps the
    # buffer in FP32; cos/sin are still the rotary module's activations (rounded)
    model = _tiny_llama().to(qt.Recipe.uniform(qt.mxfp8_e4m3,
                                               rules={"*rotary_emb": {"weight": None}}))
    inv_freq = model.model.rotary_emb.inv_freq
    assert type(inv_freq) is torch.Tensor
    assert_bits_equal(inv_freq, _tiny_llama().model.rotary_emb.inv_freq)
    with sdpa_kernel(SDPBackend.MATH), qt.leak_check(allow=qt.hf.LEAK_ALLOW):
        _step(model, torch.randint(1, 64, (2, 8)))


def test_compiled_hf_forward_matches_eager():
    model = _tiny_gpt2(use_cache=False).to(qt.recipes.mxfp6).eval()
    ids = torch.randint(0, 64, (2, 8))
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        assert_bits_equal(compiled(input_ids=ids).logits.dequantize(),
                          model(input_ids=ids).logits.dequantize())


@pytest.mark.parametrize("make", [_tiny_gpt2, _tiny_llama], ids=["gpt2", "llama"])
def test_generate_with_the_kv_cache(make):
    model = make().to(qt.recipes.mxfp6).eval()
    ids = torch.randint(1, 64, (1, 5))
    with sdpa_kernel(SDPBackend.MATH), qt.leak_check(allow=qt.hf.LEAK_ALLOW):
        cached = model.generate(ids, max_new_tokens=4, do_sample=False)
    with sdpa_kernel(SDPBackend.MATH):
        uncached = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
    assert cached.shape == (1, 9) and torch.equal(cached, uncached)


def test_sdpa_math_and_eager_attention_agree_on_gpt2():
    sdpa = _tiny_gpt2().to(qt.recipes.mxfp6).eval()
    eager = _tiny_gpt2(attn_implementation="eager").to(qt.recipes.mxfp6).eval()
    _assert_same_state(sdpa, eager)  # the same seed: the same weights
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        assert_bits_equal(sdpa(input_ids=ids).logits.dequantize(),
                          eager(input_ids=ids).logits.dequantize())
    with torch.no_grad():  # the fused kernel (no MATH backend) differs
        assert not torch.equal(sdpa(input_ids=ids).logits.dequantize(),
                               eager(input_ids=ids).logits.dequantize())


def test_compiled_hf_training_step_matches_eager():
    # the default use_cache=True included; the MATH backend entered before
    # the first compiled call (torch.compile does not guard on the SDPA backend)
    model = _tiny_gpt2(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0).to(qt.recipes.mxfp6)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 8))
    compiled = torch.compile(model.train(), backend="aot_eager")
    with sdpa_kernel(SDPBackend.MATH):
        loss = _step(compiled, ids).loss
        expected = _step(ref.train(), ids).loss
    assert_bits_equal(loss.dequantize(), expected.dequantize())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.fmt == q.grad.fmt, name
        assert_bits_equal(p.grad.dequantize(), q.grad.dequantize(), name)


@pytest.mark.parametrize("edit, names", [
    (lambda q: q.pop("recipe"), "'qtensor'"),
    (lambda q: q["recipe"].pop("weight"), "'recipe': recipe field 'weight': missing"),
    (lambda q: q["formats"].update({"lm_head.weight": {"fmt": "block(elem=" * 900 + "e2m1"
                                                               + ")" * 900}}),
     "tensor 'lm_head.weight'"),
    (lambda q: q["formats"].update({"lm_head.weight": {"fmt": "fp8_e4m3", "accum": "a=("}}),
     "tensor 'lm_head.weight'"),
    (lambda q: q["formats"].update({"lm_head.weight": "fp8_e4m3"}), "tensor 'lm_head.weight'"),
], ids=["no recipe", "recipe without weight", "nested format", "accumulator token",
        "a string"])
def test_hf_from_pretrained_malformed_config_is_a_value_error(tmp_path, edit, names):
    """A hand-edited config.json: a ValueError naming the checkpoint, the key and the tensor."""
    import json
    model = _tiny_gpt2().to(qt.fp8_e4m3)
    qt.hf.save_pretrained(model, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    config = json.loads(path.read_text())
    edit(config["qtensor"])
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError) as e:
        qt.hf.from_pretrained(type(model), tmp_path / "ckpt")
    msg = str(e.value)
    assert str(tmp_path / "ckpt") in msg and "config.json's 'qtensor'" in msg and names in msg, msg

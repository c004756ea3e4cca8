"""KV-cache formats (Recipe.kv_cache, qt.kv_cache): generation with a converted Hugging Face model
whose caches store K and V in FP8 / NVFP4 / MXFP4 gives the tokens and logits, bit for bit, of a
hand-written greedy loop whose cache rounds each token by itself; a plain torch.cat cache; the
errors; leak_check on cache updates."""
import os

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import qtensor as qt
from helpers import assert_bits_equal

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, StaticCache  # noqa: E402

FORMATS = {"fp8_per_token": qt.kv_cache.FP8_PER_TOKEN, "fp8_per_block": qt.kv_cache.FP8_PER_BLOCK,
           "nvfp4": qt.kv_cache.NVFP4, "mxfp4": qt.kv_cache.MXFP4}


def _llama(head_dim=32):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=64, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _by_token(x: torch.Tensor, fmt) -> torch.Tensor:
    """The reference rounding of a cache: each token (and head) by itself, along the head dim,
    with qt.quantize."""
    data = x.dequantize() if isinstance(x, qt.QTensor) else x
    rows = [qt.quantize(data[..., t:t + 1, :], fmt) for t in range(data.shape[-2])]
    out = torch.cat(rows, dim=-2)
    return qt.QTensor(out, fmt, mm_fmt=x.mm_fmt) if isinstance(x, qt.QTensor) else out


class _ReferenceCache(DynamicCache):
    """A hand-written quantized cache: DynamicCache storing each token rounded by itself."""

    def __init__(self, config, fmt):
        super().__init__(config=config)
        self.fmt = fmt

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(_by_token(key_states, self.fmt), _by_token(value_states, self.fmt),
                              layer_idx, *args, **kwargs)


def _reference_greedy(model, ids, mask, steps, fmt):
    """Greedy decoding by hand: prefill, then one token at a time through the reference cache."""
    cache = _ReferenceCache(model.config, fmt)
    logits, tokens = [], []
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache,
                use_cache=True)
    for _ in range(steps):
        last = out.logits[:, -1].dequantize()
        logits.append(last)
        nxt = last.argmax(-1, keepdim=True)
        tokens.append(nxt)
        mask = torch.cat([mask, torch.ones_like(nxt)], dim=-1)
        pos = pos[:, -1:] + 1
        out = model(input_ids=nxt, attention_mask=mask, position_ids=pos, cache=cache,
                    use_cache=True)
    return torch.cat(tokens, dim=-1), logits


def _inputs():
    torch.manual_seed(1)
    ids = torch.randint(1, 64, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    return ids, mask


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_generate_with_a_cache_format_is_the_hand_written_loop(name, cache_kind):
    fmt = FORMATS[name]
    model = qt.convert(_llama(), qt.recipes.mxfp6.replace(kv_cache=fmt))
    ids, mask = _inputs()
    steps = 5
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        cache = (DynamicCache(config=model.config) if cache_kind == "dynamic"
                 else StaticCache(config=model.config, max_cache_len=16))
        out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                             cache=cache, output_logits=True, return_dict_in_generate=True)
        want_tokens, want_logits = _reference_greedy(model, ids, mask, steps, fmt)
    assert torch.equal(out.sequences[:, ids.shape[1]:], want_tokens)
    for got, want in zip(out.logits, want_logits):
        assert_bits_equal(got.dequantize() if isinstance(got, qt.QTensor) else got, want)
    keys = cache.layers[0].keys
    assert isinstance(keys, qt.QTensor) and keys.fmt == fmt
    # the stored tokens are their own per-token rounding
    n = ids.shape[1] + steps - 1
    assert_bits_equal(keys.dequantize()[..., :n, :], _by_token(keys.dequantize()[..., :n, :], fmt))


def test_the_cache_format_changes_the_tokens_or_logits():
    """(What the test above compares is not the same without a cache format.)"""
    ids, mask = _inputs()
    outs = []
    for fmt in (None, qt.kv_cache.MXFP4):
        model = qt.convert(_llama(), qt.recipes.mxfp6.replace(kv_cache=fmt))
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
            o = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                               output_logits=True, return_dict_in_generate=True)
        outs.append(torch.stack([x.dequantize() for x in o.logits]))
    assert not torch.equal(outs[0], outs[1])


def test_wrap_a_cache_by_hand_on_a_converted_model():
    fmt = qt.kv_cache.FP8_PER_TOKEN
    model = qt.convert(_llama(), qt.recipes.mxfp6)
    ids, mask = _inputs()
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        cache = qt.kv_cache.wrap(DynamicCache(config=model.config), fmt)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             cache=cache, return_dict_in_generate=True)
        want, _ = _reference_greedy(model, ids, mask, 4, fmt)
    assert torch.equal(out.sequences[:, ids.shape[1]:], want)
    assert qt.kv_cache.format_of(cache) == fmt
    with pytest.raises(ValueError, match="already stores"):
        qt.kv_cache.wrap(cache, qt.kv_cache.MXFP4)


class _CatCacheAttention(nn.Module):
    """A model of one's own with a plain torch.cat KV cache, stored in a cache format."""

    def __init__(self, fmt, d=64, heads=2):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.heads, self.fmt = heads, fmt
        self.k = self.v = None

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2)
                   for z in self.qkv(x).chunk(3, dim=-1))
        k, v = qt.kv_cache.store(k, self.fmt), qt.kv_cache.store(v, self.fmt)
        self.k = k if self.k is None else torch.cat([self.k, k], dim=-2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=-2)
        return nn.functional.scaled_dot_product_attention(q, self.k, self.v)


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_plain_cat_cache_holds_each_token_rounded(name):
    fmt = FORMATS[name]
    torch.manual_seed(0)
    model = qt.convert(_CatCacheAttention(fmt), qt.recipes.mxfp6)
    x = qt.quantize(torch.randn(2, 7, 64), qt.bf16)  # (the root's input rounding: none)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), qt.leak_check():
        model(x[:, :4])
        for t in range(4, 7):
            model(x[:, t:t + 1])
    assert isinstance(model.k, qt.QTensor) and model.k.fmt == fmt
    with torch.no_grad():
        x = qt.QTensor(x, qt.bf16, mm_fmt=qt.mxfp6_e3m2)  # as the root's input rounding gives it
        k_all = model.qkv(x).chunk(3, dim=-1)[1].view(2, 7, 2, -1).transpose(1, 2)
    assert_bits_equal(model.k.dequantize(), _by_token(k_all.dequantize(), fmt))


# ---------------------------------------------------------------------------------------------
# Bad input

@pytest.mark.parametrize("fmt, match", [
    (qt.format("e8m0"), "signed"),
    (qt.nvfp4, "per-tensor scale"),
    (qt.mxfp8_e4m3.replace(axis=-2), "axis -2"),
    (qt.mxfp8_e4m3.replace(axis=None), "one block for the whole tensor"),
    (qt.kv_cache.FP8_PER_BLOCK.replace(block_shape=(32, 32), block_size=None), "2D tiles"),
])
def test_a_cache_format_that_cannot_hold_a_cache_is_refused(fmt, match):
    with pytest.raises(qt.FormatError, match=match):
        qt.Recipe(kv_cache=fmt)
    with pytest.raises(qt.FormatError, match=match):
        qt.kv_cache.store(torch.randn(2, 3, 4, 32), fmt)


def test_cache_values_past_the_format_range_are_refused():
    model = qt.convert(_llama(), qt.recipes.mxfp6.replace(kv_cache="fp8_e4m3"))
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight.mul_(4096)
    ids, mask = _inputs()
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), \
            pytest.raises(ValueError, match="cannot hold these values.*448"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)


def test_a_head_dim_that_is_no_multiple_of_the_block_is_refused():
    model = qt.convert(_llama(head_dim=16), qt.recipes.mxfp6.replace(kv_cache=qt.kv_cache.MXFP4))
    ids, mask = _inputs()
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), \
            pytest.raises(ValueError, match="head dim 16 is not a multiple.*32"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)


def test_a_cache_format_on_a_model_without_a_cache_is_refused():
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(ValueError, match="no module of the model takes a KV cache"):
        qt.convert(model, qt.recipes.mxfp6.replace(kv_cache=qt.kv_cache.MXFP4))
    assert not isinstance(model[0].weight, qt.QTensor)  # left unconverted


# ---------------------------------------------------------------------------------------------
# leak_check and cache updates

def test_leak_check_covers_cache_updates():
    ids, mask = _inputs()
    # a StaticCache of plain buffers: the update writes the QTensor states into plain tensors
    model = qt.convert(_llama(), qt.recipes.mxfp6)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), \
            pytest.raises(qt.LeakError, match="(?s)index_copy_.*cache_utils"):
        with qt.leak_check(allow=qt.hf.LEAK_ALLOW):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                           cache=StaticCache(config=model.config, max_cache_len=16))
    # with a cache format, its buffers are QTensors in the format: no finding
    model = qt.convert(_llama(), qt.recipes.mxfp6.replace(kv_cache=qt.kv_cache.NVFP4))
    for cache in (StaticCache(config=model.config, max_cache_len=16),
                  DynamicCache(config=model.config)):
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), \
                qt.leak_check(allow=qt.hf.LEAK_ALLOW) as report:
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                           cache=cache)
        assert not report.findings


def test_the_recipe_field_round_trips_and_describes():
    from qtensor.integrations.serialization import recipe_from_dict, recipe_to_dict
    r = qt.recipes.mxfp6.replace(kv_cache=qt.kv_cache.FP8_PER_TOKEN)
    assert recipe_from_dict(recipe_to_dict(r)) == r
    assert "kv_cache" in r.describe()


def test_attention_formats_and_a_cache_format_together():
    """K and V stored in the cache format, then rounded to the attention's operand formats: the
    hand-written loop (whose model calls run under the same attention role) gives the tokens."""
    fmt = qt.kv_cache.MXFP4
    recipe = qt.recipes.mxfp6.replace(kv_cache=fmt, attention=qt.recipes.fa3_fp8_attention)
    model = qt.convert(_llama(), recipe)
    ids, mask = _inputs()
    with torch.no_grad(), qt.leak_check(allow=qt.hf.LEAK_ALLOW):  # (no MATH context needed)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             cache=StaticCache(config=model.config, max_cache_len=16),
                             output_logits=True, return_dict_in_generate=True)
        want, want_logits = _reference_greedy(model, ids, mask, 4, fmt)
    assert torch.equal(out.sequences[:, ids.shape[1]:], want)
    for got, w in zip(out.logits, want_logits):
        assert_bits_equal(got.dequantize(), w)

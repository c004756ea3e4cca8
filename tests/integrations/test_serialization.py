"""Converted checkpoints as plain tensors plus formats (qtensor.integrations.serialization): torch.load without
qtensor, and safetensors files. Hugging Face checkpoints: tests/integrations/test_hf.py."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

import qtensor as qt
from helpers import assert_bits_equal
from qtensor.nn.convert import conversion_of
from qtensor.integrations.serialization import recipe_from_dict, recipe_to_dict

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


# ---------------------------------------------------------------------------------------------
# Checkpoints changed after saving, and malformed metadata

def _rewrite(src, dst, tensors=None, **meta):
    """A copy of the safetensors file src with tensors and metadata keys replaced (a value of
    None deletes the key), as a hand edit would leave it."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    with safe_open(str(src), framework="pt") as f:
        metadata = dict(f.metadata())
    for k, v in meta.items():
        if v is None:
            metadata.pop(k, None)
        else:
            metadata[k] = v
    save_file(tensors if tensors is not None else load_file(str(src)), str(dst),
              metadata=metadata)
    return dst


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "mxfp4_e2m1", "nvfp4", "bf16(rounding=stochastic)"])
def test_loaders_refuse_values_not_in_their_formats(tmp_path, fmt):
    """A file whose values were changed after saving (here scaled by 1.01, off the grid of the
    format its metadata names) is refused by every loader, naming the tensor, and a model it
    was to be loaded into stays as it was; the saved file itself loads, and checking it draws
    no random bits."""
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file
    model = qt.convert(_model(), fmt)
    path = tmp_path / "m.safetensors"
    qt.save_safetensors(model, path)
    fresh = _model(seed=1)
    qt.load_plain_state_dict(fresh, qt.load_safetensors(path))  # as saved: loads
    _assert_same_state(fresh, model)
    state = torch.get_rng_state()
    qt.qtensor_state_dict(qt.load_safetensors(path))
    assert torch.equal(torch.get_rng_state(), state)
    tensors = load_file(str(path))
    tensors["0.weight"] = tensors["0.weight"] * 1.01
    bad = _rewrite(path, tmp_path / "changed.safetensors", tensors)
    plain = _model(seed=1)
    with pytest.raises(ValueError, match=f"changed.safetensors: .*values not in the formats .*"
                                         f"0.weight \\({re.escape(str(qt.format(fmt)))}: "):
        qt.load_plain_state_dict(plain, qt.load_safetensors(bad))
    assert conversion_of(plain) is None and type(plain[0].weight) is nn.Parameter
    with pytest.raises(ValueError, match="0.weight"):
        qt.qtensor_state_dict(qt.load_safetensors(bad))
    sd = qt.plain_state_dict(model)  # the same as a plain state dict (torch.save'd)
    sd["tensors"]["0.weight"] = sd["tensors"]["0.weight"] * 1.01
    with pytest.raises(ValueError, match="the checkpoint's 'tensors': values not in the formats"):
        qt.qtensor_state_dict(sd)
    # torch.save of the QTensors themselves, the payload changed in the file
    path = tmp_path / "sd.pt"
    torch.save({"w": qt.QTensor(tensors["0.weight"], fmt)}, path)
    with pytest.raises(ValueError, match="unpickling a QTensor .* payload values are not values"):
        torch.load(path, weights_only=True)
    torch.save(model.state_dict(), path)
    assert torch.load(path, weights_only=True)["0.weight"].fmt == qt.format(fmt)


def _metadata_mutations():
    """(name, {metadata key: new JSON text or None}, what the error must name)."""
    good = {"0.weight": {"fmt": "fp8_e4m3", "mm_fmt": "mxfp8_e4m3", "accum": "hopper_fp8"},
            "0.bias": {"fmt": "fp8_e4m3"}}

    def formats(**changes):
        f = {k: dict(v) for k, v in good.items()}
        for k, v in changes.items():
            if v is None:
                f.pop(k)
            else:
                f[k] = v
        return {"qtensor.formats": json.dumps(f)}

    deep = "block(elem=" * 1000 + "fp4_e2m1" + ")" * 1000
    weight = {"fmt": "fp8_e4m3"}
    return [
        ("truncated JSON", {"qtensor.formats": json.dumps(good)[:30]}, "'qtensor.formats'"),
        ("nested JSON", {"qtensor.formats": "[" * 100000 + "]" * 100000}, "'qtensor.formats'"),
        ("a list", {"qtensor.formats": "[]"}, "'qtensor.formats'"),
        ("a string for a tensor", formats(**{"0.weight": "fp8_e4m3"}), "'0.weight'"),
        ("no fmt", formats(**{"0.weight": {}}), "'0.weight'"),
        ("fmt a number", formats(**{"0.weight": {"fmt": 5}}), "'0.weight'"),
        ("unknown format", formats(**{"0.weight": {"fmt": "fp9"}}), "'0.weight'"),
        ("nested format", formats(**{"0.weight": {"fmt": deep}}), "'0.weight'"),
        ("bad mm_fmt", formats(**{"0.weight": {**weight, "mm_fmt": "mxfp8("}}), "'0.weight'"),
        ("mm_fmt a list", formats(**{"0.weight": {**weight, "mm_fmt": [1]}}), "'0.weight'"),
        ("accumulator token", formats(**{"0.weight": {**weight, "accum": "chunk=("}}),
         "'0.weight'"),
        ("accumulator field", formats(**{"0.weight": {**weight, "accum": "x=1"}}), "'0.weight'"),
        ("accumulator name", formats(**{"0.weight": {**weight, "accum": "hoper"}}), "'0.weight'"),
        ("accumulator a dict", formats(**{"0.weight": {**weight, "accum": {}}}), "'0.weight'"),
        ("unknown key", formats(**{"0.weight": {**weight, "scale": 2}}), "'0.weight'"),
        ("a tensor the file lacks", formats(**{"9.weight": weight}), "'9.weight'"),
        ("format on an int tensor", formats(**{"2.num_batches_tracked": weight}),
         "'2.num_batches_tracked'"),
        ("recipe truncated", {"qtensor.recipe": '{"weight": ["fp8'}, "'qtensor.recipe'"),
        ("recipe a number", {"qtensor.recipe": "5"}, "'qtensor.recipe'"),
        ("recipe without weight", "drop weight", "'weight'"),
        ("recipe role a string", "weight=\"fp8_e4m3\"", "'weight'"),
        ("recipe role a bad format", "weight=[\"fp9\", null]", "'weight'"),
        ("recipe rules a list", "rules=[]", "'rules'"),
        ("recipe accumulate", "accumulate=\"chunk=(\"", "'accumulate'"),
        ("recipe gemm", "gemm={\"fprop\": 3}", "'gemm'"),
        ("recipe loss_scale", "loss_scale=\"big\"", "'qtensor.recipe'"),
    ]


@pytest.mark.parametrize("case", _metadata_mutations(), ids=lambda c: c[0])
def test_malformed_safetensors_metadata_is_a_value_error_naming_it(tmp_path, case):
    """Hand-edited, truncated or hostile metadata: a ValueError that names the file, the
    metadata key and the tensor (or the recipe's field), never a raw TypeError, KeyError,
    RecursionError or SyntaxError."""
    pytest.importorskip("safetensors")
    from safetensors import safe_open
    name, meta, names = case
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.BatchNorm1d(4))
    qt.convert(model, qt.Recipe(weight=("fp8_e4m3", "mxfp8_e4m3"), bias="fp8_e4m3",
                                accumulate="hopper_fp8", rules={"1.*": None, "2.*": None}))
    path = tmp_path / "m.safetensors"
    qt.save_safetensors(model, path)
    if isinstance(meta, str):  # a change of the saved recipe's JSON
        with safe_open(str(path), framework="pt") as f:
            recipe = json.loads(f.metadata()["qtensor.recipe"])
        if meta.startswith("drop "):
            del recipe[meta[5:]]
        else:
            key, value = meta.split("=", 1)
            recipe[key] = json.loads(value)
        meta = {"qtensor.recipe": json.dumps(recipe)}
    bad = _rewrite(path, tmp_path / "bad.safetensors", **meta)
    (key,) = meta
    with pytest.raises(ValueError) as e:
        qt.load_plain_state_dict(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4),
                                               nn.BatchNorm1d(4)), qt.load_safetensors(bad))
    msg = str(e.value)
    assert "bad.safetensors" in msg and f"'{key}'" in msg and names in msg, msg
    assert len(msg) < 2000


def test_random_mutations_of_real_metadata_are_value_errors(tmp_path):
    """Characters inserted, deleted or replaced in a real file's metadata (formats, recipe):
    every load is the checkpoint or a ValueError."""
    pytest.importorskip("safetensors")
    import random
    from safetensors import safe_open
    model = qt.convert(_model(), RECIPE)
    path = tmp_path / "m.safetensors"
    qt.save_safetensors(model, path)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    rng = random.Random(0)
    for i in range(60):
        key = rng.choice(["qtensor.formats", "qtensor.recipe"])
        text = list(meta[key])
        for _ in range(rng.randint(1, 3)):
            j = rng.randrange(len(text))
            c = rng.choice('{}[]",:=;()0123456789 abcdefmx_-nulltrue')
            op = rng.randrange(3)
            if op == 0:
                text.insert(j, c)
            elif op == 1:
                del text[j]
            else:
                text[j] = c
        bad = _rewrite(path, tmp_path / f"bad{i}.safetensors", **{key: "".join(text)})
        try:
            qt.load_plain_state_dict(_model(), qt.load_safetensors(bad))
        except ValueError as e:
            assert f"bad{i}.safetensors" in str(e), str(e)


def test_truncated_safetensors_file_is_a_value_error(tmp_path):
    pytest.importorskip("safetensors")
    path = tmp_path / "m.safetensors"
    qt.save_safetensors(qt.convert(_model(), qt.bf16), path)
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match="cut.safetensors: not a readable safetensors file"):
        qt.load_safetensors(tmp_path / "cut.safetensors")


def test_accumulator_tokens_parse_or_give_a_value_error():
    """The accumulator strings of checkpoints and traced graphs: any other string is an
    AccumFormatError (a ValueError), never a SyntaxError or TypeError."""
    from qtensor.tensor.subclass import _ACCUM_FIELDS, _accum_of_token
    for preset in qt.accum.PRESETS.values():  # (each spelled out as a custom one would be)
        token = ";".join(f"{n}={getattr(preset, n)}" for n in _ACCUM_FIELDS)
        assert _accum_of_token(token) == preset
    for bad in ["chunk=(", "chunk=[1,2", "x=1", "chunk", "", ";", "chunk=4;chunk=4",
                "chunk=4;frac_bits=__import__('os')", "chunk=4", "chunk=1e400;frac_bits=3",
                "chunk=" + "9" * 5000 + ";frac_bits=3"]:
        with pytest.raises(ValueError):
            _accum_of_token(bad)


def test_nvfp4_checkpoint_with_nan_loads(tmp_path):
    """A tensor-scaled NVFP4 tensor with a NaN beside its largest value (a diverged run's
    checkpoint) does not re-round to itself (docs/formats.md), yet was saved in format: it
    loads, through torch.load and safetensors alike."""
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    x = torch.randn(4, 64)
    x.view(-1)[int(x.abs().argmax()) ^ 1] = float("nan")
    t = qt.as_qtensor(x, "nvfp4")
    torch.save({"w": t}, tmp_path / "t.pt")
    assert_bits_equal(torch.load(tmp_path / "t.pt", weights_only=True)["w"].dequantize(),
                      t.dequantize())
    qt.save_safetensors({"w": t}, tmp_path / "t.safetensors")
    back = qt.qtensor_state_dict(qt.load_safetensors(tmp_path / "t.safetensors"))["w"]
    assert_bits_equal(back.dequantize(), t.dequantize())


@pytest.mark.parametrize("weights_only", [True, False])
def test_checkpoint_saved_before_the_package_layout_loads_with_its_bits(weights_only):
    # data/before_subpackages.pt: torch.save'd by the flat layout (qtensor/tensor.py), whose
    # pickles name qtensor.tensor._rebuild_qtensor; its "plain" entries are the payloads as saved
    import pathlib
    path = pathlib.Path(__file__).parent / "data" / "before_subpackages.pt"
    obj = torch.load(path, weights_only=weights_only)
    plain = obj["plain"]
    for key, fmt in [("fp8", "fp8_e4m3"), ("nvfp4", "nvfp4"), ("bf16", "bf16")]:
        q = obj[key]
        assert type(q) is qt.QTensor and str(q.fmt) == fmt
        assert torch.equal(q._data.view(torch.int32), plain[key].view(torch.int32))
    assert torch.equal(obj["nvfp4"].tensor_scale.view(torch.int32),
                       plain["nvfp4_scale"].view(torch.int32))
    model = obj["model"]
    for key in ("weight", "bias"):
        assert type(model[key]) is qt.QTensor and str(model[key].fmt) == "mxfp8_e4m3"
        assert torch.equal(model[key]._data.view(torch.int32), plain[key].view(torch.int32))

"""A quantized checkpoint whose tensors cannot be what their names say is refused at load,
naming the tensor and the file, instead of serving wrong tokens: scales that are not finite,
packed weights stored as floats or in the wrong number of dimensions, a layer's tensors
without its packed weight, options of the wrong type, a quantization_config without a
method.  The checkpoints are test_quantized_checkpoints.py's writer's, edited."""

import json

import pytest
import torch

from cbatch import load_model
from tests.models.test_quantized_checkpoints import _edit, _rewrite, make_checkpoint

LAYER = "model.layers.0.self_attn.k_proj"
SCALES = {"gptq": "scales", "awq": "scales", "w8a8": "weight_scale", "ct": "weight_scale"}
PACKED = {"gptq": "qweight", "awq": "qweight", "w8a8": "weight", "ct": "weight_packed"}


def _refused(path, message):
    with pytest.raises(ValueError, match=message) as info:
        load_model(str(path))
    assert str(path / "config.json") in str(info.value)


@pytest.mark.parametrize("fmt", ["gptq", "awq", "w8a8", "ct"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_scales_that_are_not_finite_are_refused(tmp_path, fmt, bad):
    make_checkpoint(tmp_path, fmt, gs=32)
    name = f"{LAYER}.{SCALES[fmt]}"

    def poison(scales):
        scales = scales.clone()
        scales.view(-1)[3] = bad
        return scales

    _rewrite(tmp_path / fmt, name, poison)
    _refused(tmp_path / fmt, f"{name} holds 1 values that are not finite")


@pytest.mark.parametrize("fmt", ["gptq", "awq", "ct"])
def test_a_packed_weight_stored_as_floats_is_refused(tmp_path, fmt):
    make_checkpoint(tmp_path, fmt, gs=32)
    name = f"{LAYER}.{PACKED[fmt]}"
    _rewrite(tmp_path / fmt, name, lambda t: t.float())
    _refused(tmp_path / fmt, f"{name} is float32; packed quantized weights are integers")


@pytest.mark.parametrize("fmt", ["gptq", "awq", "ct"])
def test_a_packed_weight_of_one_dimension_is_refused(tmp_path, fmt):
    make_checkpoint(tmp_path, fmt, gs=32)
    name = f"{LAYER}.{PACKED[fmt]}"
    _rewrite(tmp_path / fmt, name, lambda t: t.reshape(-1))
    _refused(tmp_path / fmt, f"{name} has 1 dimensions")


@pytest.mark.parametrize("fmt", ["gptq", "awq", "ct"])
def test_a_layer_without_its_packed_weight_is_refused(tmp_path, fmt):
    from safetensors.torch import load_file, save_file

    make_checkpoint(tmp_path, fmt, gs=32)
    path = tmp_path / fmt / "model.safetensors"
    tensors = load_file(str(path))
    del tensors[f"{LAYER}.{PACKED[fmt]}"]
    save_file(tensors, str(path))
    _refused(tmp_path / fmt, f"{LAYER}'s packed weight .* is missing, but {LAYER}\\.")


@pytest.mark.parametrize("fmt,changes,message", [
    ("gptq", {"bits": 4.0}, "GPTQ bits=4.0"),
    ("gptq", {"group_size": 32.0}, "GPTQ group_size=32.0"),
    ("awq", {"bits": "4"}, "AWQ bits='4'"),
])
def test_options_of_the_wrong_type_are_refused_by_name(tmp_path, fmt, changes, message):
    make_checkpoint(tmp_path, fmt, gs=32)
    _edit(tmp_path / fmt, **changes)
    _refused(tmp_path / fmt, message)


def test_a_quantization_config_without_a_method_is_refused(tmp_path):
    make_checkpoint(tmp_path, "gptq", gs=32)
    config_file = tmp_path / "gptq" / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = {}
    config_file.write_text(json.dumps(config))
    _refused(tmp_path / "gptq", "quantization_config names no quant_method")


def test_a_fused_projection_with_a_missing_shard_names_it(tmp_path):
    from safetensors.torch import load_file, save_file

    make_checkpoint(tmp_path, "gptq", gs=32)
    path = tmp_path / "gptq" / "model.safetensors"
    tensors = load_file(str(path))
    for part in ("qweight", "qzeros", "scales", "g_idx"):
        del tensors[f"{LAYER}.{part}"]
    tensors[f"{LAYER}.weight"] = torch.zeros(32, 160)  # a float k_proj beside quantized q, v
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.weight and "
                                         "model.layers.0.self_attn.v_proj.weight are missing "
                                         "\\(its layer's k_proj is there\\)") as info:
        load_model(str(tmp_path / "gptq"))
    assert str(path) in str(info.value)


def test_finite_values_whose_sum_overflows_are_accepted():
    """The check sums in fp32 (one pass); a sum that overflows on finite values falls through
    to the exact check, which accepts them, and a NaN among them is still found."""
    from pathlib import Path

    from cbatch.models.quantized_checkpoint.layer import finite

    big = torch.full((8, 4), 3e38)
    assert not torch.isfinite(big.sum())
    assert finite(big, "w", Path("f")) is big
    big[5, 2] = float("nan")
    with pytest.raises(ValueError, match=r"f: w holds 1 values that are not finite \(the "
                                         r"first at \(5, 2\)"):
        finite(big, "w", Path("f"))

"""cbatch's layers call forward directly (cbatch/layers/module.py)."""

import pytest
import torch

from cbatch.layers.layernorm import LayerNorm
from cbatch.layers.linear import Linear
from cbatch.layers.module import Module
from cbatch.models.loader import load_model


class Double(Module):
    def forward(self, x):
        return 2 * x


def test_a_call_runs_forward_and_an_instance_forward_wins():
    layer = Double()
    assert layer(torch.tensor(3.0)) == 6
    seen = []
    inner = layer.forward
    layer.forward = lambda x: seen.append(x) or inner(x)  # how a user wraps one layer
    assert layer(torch.tensor(4.0)) == 8 and seen == [4.0]
    del layer.forward
    assert layer(torch.tensor(5.0)) == 10 and seen == [4.0]


@pytest.mark.parametrize("make", [Double, lambda: Linear(4, 4), lambda: LayerNorm(4)],
                         ids=["Module", "Linear", "LayerNorm"])
def test_registering_a_hook_says_how_to_wrap_instead(make):
    layer = make()
    with pytest.raises(NotImplementedError, match="wrap the module's forward"):
        layer.register_forward_hook(lambda m, a, o: None)
    with pytest.raises(NotImplementedError, match="wrap the module's forward"):
        layer.register_forward_pre_hook(lambda m, a: None)


def test_the_layers_of_a_model_call_forward_directly():
    """Every submodule a step calls per layer skips nn.Module.__call__ (the top module and
    the embeddings, called once per step, keep it)."""
    model = load_model("random:tiny")
    block = model.transformer.h[0]
    for layer in (block, block.ln_1, block.attn, block.attn.c_attn, block.attn.attn, block.mlp):
        assert type(layer).__call__ is Module.__call__, type(layer)

"""The one decode-or-prefill rule of :class:`cbatch.layers.attention.PagedAttention`, seen
through the kernels each step's attention calls (on the CPU both kernels share one loop, so
only the calls can show that batch-invariant mode keeps a token on one kernel)."""

import dataclasses

import pytest
import torch

from cbatch import LLM, SamplingParams


def _kernel_calls(batch_invariant: bool) -> list[str]:
    """Run two requests (prefill steps, then decode-only steps) and record, per attention
    call, which kernel ran."""
    llm = LLM("random:tiny", batch_invariant=batch_invariant)
    model = llm.engine.model
    bound = model.kernels(torch.device("cpu"))
    calls: list[str] = []

    def recording(name, fn):
        def call(*args):
            calls.append(name)
            return fn(*args)
        return call

    model._kernels = (torch.device("cpu"), dataclasses.replace(
        bound, decode=recording("decode", bound.decode),
        prefill=recording("prefill", bound.prefill)))
    llm.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    return calls


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_decode_steps_run_the_decode_kernel_unless_batch_invariant(batch_invariant):
    calls = _kernel_calls(batch_invariant)
    num_layers = 2
    # one prefill step, then three decode-only steps, each calling one kernel per layer
    assert len(calls) == 4 * num_layers
    expected = ["prefill"] * num_layers + ["prefill" if batch_invariant else "decode"] * 6
    assert calls == expected

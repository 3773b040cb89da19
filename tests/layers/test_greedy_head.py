"""The fp32 lm_head's greedy screen (cbatch.layers.cpu_linear.greedy_tokens, csrc/cpu/
linear.cpp's greedy_head_cpu): the argmax of the fp32 kernel's logits, bit for bit, read
through a bf16 copy of the weight."""

import pytest
import torch

from cbatch import LLM, Engine, SamplingParams
from cbatch.layers import cpu_linear
from cbatch.layers.linear import pack_linears, unpack_linears
from cbatch.models.loader import load_model

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.skipif(not cpu_linear.screen_available(torch.float32),
                       reason="the greedy screen runs on x86 CPUs with AVX2 or AVX-512"),
]


def _fp32_argmax(x, packed, N):
    """What an unscreened greedy step answers: torch's argmax of the kernel's logits."""
    return cpu_linear.linear(x, packed, None, N).argmax(dim=-1)


def _check(x, w):
    packed, screen = cpu_linear.pack(w, "cbatch"), cpu_linear.pack_screen(w)
    got = cpu_linear.greedy_tokens(x, packed, screen, w.shape[0])
    assert got.dtype == torch.int64 and got.shape == (x.shape[0],)
    assert torch.equal(got, _fp32_argmax(x, packed, w.shape[0]))


@pytest.mark.parametrize("M", [1, 3, 8, 17, 70])
@pytest.mark.parametrize("N,K", [(37, 2), (1000, 64), (4099, 768)])
def test_tokens_are_the_fp32_argmax(M, N, K):
    """Fresh random weights and rows of very different scales (1e-3 to 1e3); N not a
    multiple of 16; row counts below, at and past the kernel's tile and packing sizes."""
    gen = torch.Generator().manual_seed(M * N + K)
    w = torch.randn(N, K, generator=gen) * torch.rand(N, 1, generator=gen) * 0.1
    x = torch.randn(M, K, generator=gen) * 10.0 ** torch.randint(-3, 4, (M, 1), generator=gen)
    _check(x, w)


def test_near_ties_are_settled_in_fp32():
    """Columns the bf16 screen cannot tell apart: copies of one column moved by less than a
    bf16 step, where the fp32 sums decide (and the screen's own argmax is wrong for some
    rows), and exact duplicates of each row's winner further on (the first index wins, as
    torch.argmax)."""
    gen = torch.Generator().manual_seed(0)
    K, N = 256, 300
    x = torch.randn(8, K, generator=gen)
    w = torch.randn(N, K, generator=gen) * 0.02
    best = 0.5 * x.sum(0) / x.sum(0).norm()  # a column every row likes
    near = list(range(40, 260, 7))
    for j in near:
        w[j] = best * (1 + 1e-4 * torch.randn(K, generator=gen))
    packed = cpu_linear.pack(w, "cbatch")
    winners = _fp32_argmax(x, packed, N)
    assert set(winners.tolist()) <= set(near)
    screen_argmax = (x.bfloat16().float() @ w.bfloat16().float().T).argmax(dim=-1)
    assert (screen_argmax != winners).any()  # the screen alone would not do
    for i, j in enumerate(winners.tolist()):
        w[261 + i] = w[j]  # a later tie of the winner
    _check(x, w)
    _check(x.flip(0), w)


def test_rows_the_screen_cannot_settle():
    """Rows that tie every column (x = 0: index 0), hold NaN or infinity, or whose sums
    could overflow run the fp32 kernel on the whole row: torch.argmax's answer still (the
    first NaN for NaN logits)."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(500, 64, generator=gen) * 0.05
    x = torch.randn(6, 64, generator=gen)
    x[0] = 0
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3] *= 1e36
    x[4, 7] = float("-inf")
    _check(x, w)
    w[123, 9] = float("nan")  # a NaN column: every row's logit there is NaN
    _check(x[5:], w)


def test_rejects_bad_arguments():
    w = torch.randn(40, 8)
    packed, screen = cpu_linear.pack(w, "cbatch"), cpu_linear.pack_screen(w)
    with pytest.raises(TypeError, match="fp32 x"):
        cpu_linear.greedy_tokens(torch.randn(2, 8).bfloat16(), packed, screen, 40)
    with pytest.raises(ValueError, match="does not hold"):
        cpu_linear.greedy_tokens(torch.randn(2, 8), packed, screen, 50)
    assert cpu_linear.greedy_tokens(torch.randn(0, 8), packed, screen, 40).shape == (0,)


def test_packing_gives_an_fp32_lm_head_a_screen(monkeypatch):
    """pack_linears gives the fp32 lm_head a screen and keeps it on cbatch's kernel (the
    logits the screen is exact for); not a bf16 model's, nor with $CBATCH_GREEDY_SCREEN=0
    (the lm_head then goes back to its route without a screen); unpacking drops it."""
    model = load_model("random:tiny")
    assert pack_linears(model) and model.greedy_screened
    assert not model.lm_head.packed_weight.is_mkldnn
    assert model.lm_head.greedy_screen.weight.dtype == torch.bfloat16
    unpack_linears(model)
    assert not model.greedy_screened
    assert pack_linears(load_model("random:tiny", dtype=torch.bfloat16)) \
        and not load_model("random:tiny", dtype=torch.bfloat16).greedy_screened
    monkeypatch.setenv("CBATCH_GREEDY_SCREEN", "0")
    model = load_model("random:tiny")
    assert pack_linears(model) and not model.greedy_screened


def test_engine_screens_greedy_steps_and_gives_the_same_tokens(monkeypatch):
    """An fp32 engine's greedy steps without logprobs take the screen, and give the tokens
    the unscreened engine gives; a step with a sampled or a logprobs request computes the
    logits (and so does every step with the screen off)."""
    prompts = [[(7 * i + 3 * j) % 500 for j in range(3 + 5 * i)] for i in range(6)]
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    calls = []

    def tokens(llm):
        model = llm.engine.model
        screened = model.greedy_tokens

        def counted(hidden):
            calls.append(hidden.shape[0])
            return screened(hidden)
        model.greedy_tokens = counted
        return [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    on = tokens(LLM("random:tiny", dtype="float32", max_num_seqs=4))
    assert calls and max(calls) <= 4
    monkeypatch.setenv("CBATCH_GREEDY_SCREEN", "0")
    calls.clear()
    off = LLM("random:tiny", dtype="float32", max_num_seqs=4)
    assert not off.engine.model.greedy_screened
    assert tokens(off) == on
    monkeypatch.delenv("CBATCH_GREEDY_SCREEN")
    llm = LLM("random:tiny", dtype="float32", max_num_seqs=4)
    calls.clear()
    tokens(llm)
    n = len(calls)
    mixed = [greedy, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)]
    outs = llm.generate(prompts[:2], mixed, use_tqdm=False)
    assert len(calls) == n  # a logprobs request in every step: logits computed
    assert outs[0].token_ids == on[0] and outs[1].token_ids == on[1]
    assert outs[1].logprobs and outs[1].logprobs[0]
    engine = Engine(load_model("random:tiny"), max_num_seqs=4, batch_invariant=True)
    assert engine.model.greedy_screened  # exact, so batch-invariant too

"""Batch-invariant mode: a request's logits never depend on its batch-mates or its chunking.

The engine-level tests observe the logits through logprobs of the whole vocabulary (the
log-softmax of each step's logits row) and compare them bitwise.
"""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cbatch import Engine, SamplingParams, ops
from cbatch.ops import cpu
from tests.helpers import Arrival, paged_inputs, run_arrivals

VOCAB = 512  # random:tiny
PROBE = [(5 * i + 3) % 500 for i in range(37)]


def _run(requests, model="random:tiny", **engine_kwargs) -> dict:
    """Run ``requests`` (prompt, params, arrival step) to the end; outputs by index."""
    engine_kwargs.setdefault("max_logprobs", VOCAB)  # the probe asks for every logprob
    return run_arrivals(Engine(model, **engine_kwargs),
                        [Arrival(prompt, params, step) for prompt, params, step in requests])


def _probe_params(temperature: float) -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=temperature, seed=7, ignore_eos=True,
                          logprobs=VOCAB)


@functools.lru_cache(maxsize=None)
def _probe_alone(temperature: float):
    """The probe run alone, its prompt in one prefill step (a plain function, not a fixture,
    so that hypothesis does not print its outputs with every failing example).  The block
    size is the one the mixes use: the kernels' summation order follows the cache's blocks."""
    return _run([(PROBE, _probe_params(temperature), 0)], batch_invariant=True, block_size=4)[0]


others = st.lists(st.tuples(st.integers(1, 60),  # prompt length
                            st.integers(1, 10),  # max_tokens
                            st.integers(0, 4)),  # arrival step
                  max_size=6)


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(others=others, probe_arrival=st.integers(0, 3), temperature=st.sampled_from([0.0, 0.8]),
       budget=st.integers(1, 80), max_num_seqs=st.integers(1, 6),
       num_blocks=st.integers(24, 80), policy=st.sampled_from(["fcfs", "priority", "sjf"]))
def test_probe_logits_are_bitwise_independent_of_the_batch(
        others, probe_arrival, temperature, budget, max_num_seqs, num_blocks,
        policy):
    """Random batch-mates, chunk sizes (token budgets), batch widths, pool sizes (so
    preemption and recomputation happen) and policies: every step's logits of the probe are
    the ones it gets alone."""
    requests = [(PROBE, _probe_params(temperature), probe_arrival)]
    requests += [([(11 * i + j) % 500 for j in range(n)],
                  SamplingParams(max_tokens=m, temperature=0.5, ignore_eos=True), arrival)
                 for i, (n, m, arrival) in enumerate(others)]
    done = _run(requests, batch_invariant=True, block_size=4, num_blocks=num_blocks,
                max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                scheduling_policy=policy)
    alone = _probe_alone(temperature)
    assert done[0].token_ids == alone.token_ids
    for step, (got, want) in enumerate(zip(done[0].logprobs, alone.logprobs, strict=True)):
        assert got == want, f"step {step}: logits differ from the probe run alone"


def test_default_mode_is_not_batch_invariant(monkeypatch):
    """Without the mode the same comparison fails (so the test above can fail): the probe's
    decode steps alone run its linear layers on one row, where MKL's sgemm sums differently
    than for a row of a larger batch (cbatch.layers.linear).  The linears run ``F.linear``
    here: oneDNN on packed weights (cbatch.ops.cpu) happens to sum the tiny
    model's short rows alike for every M, though not GPT-2 small's (K = 3072)."""
    monkeypatch.setenv("CBATCH_CPU_LINEAR", "torch")
    mates = [([(13 * i + j) % 500 for j in range(20)],
              SamplingParams(max_tokens=8, ignore_eos=True), 0) for i in range(5)]
    alone = _run([(PROBE, _probe_params(0.0), 0)])[0]
    crowded = _run([(PROBE, _probe_params(0.0), 0)] + mates)[0]
    differing = [s for s, (a, b) in enumerate(zip(alone.logprobs, crowded.logprobs)) if a != b]
    assert differing, "default mode gave bitwise-identical logits in another batch"


def test_logprobs_are_the_log_softmax_of_the_logits_of_transformers(tiny_hf_dir, tiny_hf_model):
    """Greedy: the sampled token is the most likely one; every logprob matches
    transformers' GPT2LMHeadModel on the same weights; k alternatives, most likely first."""
    out = _run([(PROBE, SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3), 0)],
               model=str(tiny_hf_dir), batch_invariant=True)[0]
    with torch.no_grad():
        ids = torch.tensor([PROBE + out.token_ids[:-1]])
        ref = tiny_hf_model(input_ids=ids).logits[0, len(PROBE) - 1:].log_softmax(-1)
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert len(entry) == 3 and next(iter(entry)) == token  # greedy: top-1 is the sample
        values = list(entry.values())
        assert values == sorted(values, reverse=True)
        want = ref[step].topk(3)
        assert list(entry) == want.indices.tolist()
        torch.testing.assert_close(torch.tensor(values), want.values, atol=1e-4, rtol=1e-4)


def test_logprobs_of_a_sampled_token_outside_the_top_k():
    params = SamplingParams(max_tokens=12, temperature=5.0, seed=3, ignore_eos=True, logprobs=1)
    out = _run([(PROBE, params, 0), (PROBE[:5], SamplingParams(max_tokens=3), 0)])
    probe, other = out[0], out[1]
    assert other.logprobs is None  # not asked for
    assert len(probe.logprobs) == len(probe.token_ids)
    for token, entry in zip(probe.token_ids, probe.logprobs):
        assert token in entry and 1 <= len(entry) <= 2
        top_id, top = next(iter(entry.items()))
        assert top >= entry[token] and (len(entry) == 1) == (token == top_id)
    assert any(len(e) == 2 for e in probe.logprobs), "temperature 5 never left the top-1"


# ----------------------------------------------------------------------------- the parts


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_cpu_attention_rows_do_not_depend_on_chunking(backend):
    """A token's attention is bitwise the same in any prefill chunk, alone as a decode step,
    and beside other sequences (the CPU kernel's per-row order is fixed by its position)."""
    if backend == "cpu" and not ops.available_backends()["cpu"].available:
        pytest.skip("no compiled CPU kernels")
    lens = [45, 3, 70]
    q, kc, vc, tables, _, seq_lens = paged_inputs(lens, lens, 4, 32, 16, torch.float32,
                                                  "cpu", 0)
    rows = torch.tensor([0] + lens).cumsum(0).tolist()
    whole = ops.paged_prefill_attention(q, kc, vc, tables, torch.tensor(rows, dtype=torch.int32),
                                        seq_lens, backend=backend)
    # sequence 0 alone, cut into chunks 17 + 1 + 27: each chunk sees the cache before it
    for lo, hi in ((0, 17), (17, 18), (18, 45)):
        part = ops.paged_prefill_attention(
            q[lo:hi], kc, vc, tables[:1], torch.tensor([0, hi - lo], dtype=torch.int32),
            torch.tensor([hi], dtype=torch.int32), backend=backend)
        assert torch.equal(part, whole[lo:hi]), (lo, hi)
    # the last token of every sequence as a decode step of the whole batch
    last = torch.tensor(rows[1:]) - 1
    decode = ops.paged_decode_attention(q[last], kc, vc, tables, seq_lens, backend=backend)
    assert torch.equal(decode, whole[last])


def test_triton_decode_split_is_fixed_in_tokens():
    """A sequence's decode attention is bitwise the same alone (one pass, no merge) and beside
    a long sequence that makes the launch split every context into 256-token partitions."""
    pytest.importorskip("triton")
    from cbatch.kernels import decode_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    lens = [40, 300, 700]
    q, kc, vc, tables, _, seq_lens = paged_inputs(lens, [1] * 3, 2, 64, 16, torch.float32,
                                                  device, 3)
    batch = decode_attention.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125)
    for s in range(2):
        n_blocks = -(-lens[s] // 16)
        alone = decode_attention.paged_decode_attention(
            q[s:s + 1], kc, vc, tables[s:s + 1, :n_blocks].contiguous(), seq_lens[s:s + 1],
            0.125)
        assert torch.equal(alone[0], batch[s]), f"sequence of {lens[s]} tokens"


def test_transformers_backend_attention_rows_do_not_depend_on_the_batch():
    """cbatch.hf (attn_implementation="cbatch"): a row's attention is bitwise the same alone
    and in a left-padded batch, as a prompt and as a decode step.  Only the attention is
    cbatch's there: the model's own matmuls are transformers', outside this guarantee."""
    pytest.importorskip("transformers")
    import cbatch.hf

    gen = torch.Generator().manual_seed(0)
    B, H, Lk, D, n = 3, 4, 20, 32, 13  # the probe (row 0) has n real tokens, left-padded
    q, k, v = (torch.randn(B, H, Lk, D, generator=gen) for _ in range(3))
    mask = torch.ones(B, Lk, dtype=torch.long)
    mask[0, :Lk - n] = 0
    mask[2, :Lk - 5] = 0
    module = torch.nn.Module()
    batched, _ = cbatch.hf.attention_forward(module, q, k, v, mask.bool())
    alone, _ = cbatch.hf.attention_forward(module, q[:1, :, -n:], k[:1, :, -n:], v[:1, :, -n:],
                                           None)
    assert torch.equal(batched[0, -n:], alone[0])
    step, _ = cbatch.hf.attention_forward(module, q[:, :, -1:], k, v, mask.bool())
    step_alone, _ = cbatch.hf.attention_forward(module, q[:1, :, -1:], k[:1, :, -n:],
                                                v[:1, :, -n:], None)
    assert torch.equal(step[0, 0], step_alone[0, 0])
    assert torch.equal(step[0, 0], alone[0, -1])


@pytest.mark.slow
def test_static_baseline_logprobs_and_invariant_mode():
    """Static batching is a scheduling policy of the same engine: logprobs and the
    batch-invariant guarantee hold there too."""
    from cbatch import LLM

    params = [SamplingParams(max_tokens=3, logprobs=2), SamplingParams(max_tokens=3)]
    static = LLM("random:tiny", scheduling_policy="static", max_num_seqs=2,
                 batch_invariant=True)
    outs = static.generate([PROBE, PROBE[:4]], params, use_tqdm=False)
    assert [len(e) for e in outs[0].logprobs] == [2, 2, 2] and outs[1].logprobs is None
    assert all(next(iter(e)) == t for e, t in zip(outs[0].logprobs, outs[0].token_ids))
    alone = LLM("random:tiny", batch_invariant=True).generate([PROBE], params[:1],
                                                              use_tqdm=False)
    assert alone[0].logprobs == outs[0].logprobs


@pytest.mark.skipif(not cpu.has_amx(), reason="oneDNN's bf16 GEMM is padded to invariance here")
def test_bf16_off_cbatchs_kernel_is_refused_on_amx(monkeypatch):
    """On an AMX CPU, oneDNN's bf16 GEMM is not batch-invariant, padded or not: a
    batch-invariant bf16 engine that would run it (the route forced) is refused, naming why."""
    monkeypatch.setenv("CBATCH_CPU_LINEAR", "onednn")
    with pytest.raises(ValueError, match="batch-invariant bf16 needs cbatch's CPU kernel"):
        Engine("random:tiny", dtype="bfloat16", batch_invariant=True, max_num_seqs=2)
    monkeypatch.delenv("CBATCH_CPU_LINEAR")
    Engine("random:tiny", dtype="bfloat16", batch_invariant=True, max_num_seqs=2)

"""The sampler's rules beyond temperature, top-k and top-p, each against transformers' logits
processor for it (or a value computed by hand), and through the engine.  The kernels that
run them are tested in tests/ops/test_sampling.py."""


import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor)

from cbatch.core.sampler import SamplingBatch, TokenCounts, apply_rules, logits_rules, sample
from cbatch.core.sequence import Sequence
from cbatch.ops import cpu
from cbatch.sampling_params import SamplingParams

EOS = 2


def _seq(prompt, output, rid="r", **params):
    seq = Sequence(rid, list(prompt), SamplingParams(max_tokens=64, **params), 0)
    seq.token_ids += list(output)
    return seq


def _processed(logits, seqs, bad_words=None):
    """``logits`` after cbatch's rules for ``seqs`` (one row each)."""
    counts = TokenCounts(logits.shape[-1], logits.device)
    for seq, words in zip(seqs, bad_words or [[]] * len(seqs)):
        seq.bad_words_token_ids = words
    rules = logits_rules(seqs, [True] * len(seqs), frozenset({EOS}), counts)
    out = logits.clone()
    apply_rules(out, rules, None)
    return out


def test_repetition_penalty_is_transformers_rule_over_prompt_and_output():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=gen) * 3
    prompts, outputs = [[1, 5, 5, 9], [3], [7, 8]], [[9, 11], [], [30, 30, 31]]
    penalties = [1.3, 0.7, 2.0]
    seqs = [_seq(p, o, str(i), repetition_penalty=r)
            for i, (p, o, r) in enumerate(zip(prompts, outputs, penalties))]
    got = _processed(logits, seqs)
    for i, (p, o, r) in enumerate(zip(prompts, outputs, penalties)):
        want = RepetitionPenaltyLogitsProcessor(r)(torch.tensor([p + o]), logits[i:i + 1].clone())
        torch.testing.assert_close(got[i:i + 1], want)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 10)
    seq = _seq([4, 4, 4], [1, 1, 1, 2], presence_penalty=0.5, frequency_penalty=0.25)
    got = _processed(logits, [seq])[0]
    want = torch.zeros(10)
    want[1] = -(0.5 + 3 * 0.25)
    want[2] = -(0.5 + 1 * 0.25)  # the prompt's 4 is not penalized
    torch.testing.assert_close(got, want)


def test_logit_bias_and_allowed_token_ids_by_hand():
    logits = torch.arange(8.0).repeat(2, 1)
    seqs = [_seq([1], [], "a", logit_bias={0: 100.0, 3: -2.5}),
            _seq([1], [], "b", allowed_token_ids=[1, 6])]
    got = _processed(logits, seqs)
    torch.testing.assert_close(got[0], torch.tensor([100.0, 1, 2, 0.5, 4, 5, 6, 7]))
    inf = float("-inf")
    assert got[1].tolist() == [inf, 1.0, inf, inf, inf, inf, 6.0, inf]


def test_min_tokens_is_transformers_min_new_tokens():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 20, generator=gen)
    seqs = [_seq([5, 6], [7], "a", min_tokens=3, stop_token_ids=[9]),
            _seq([5, 6], [7, 8, 9], "b", min_tokens=3, stop_token_ids=[9])]  # reached
    got = _processed(logits, seqs)
    for i, seq in enumerate(seqs):
        proc = MinNewTokensLengthLogitsProcessor(2, 3, [EOS, 9])
        want = proc(torch.tensor([seq.token_ids]), logits[i:i + 1].clone())
        torch.testing.assert_close(got[i:i + 1], want)


def test_bad_words_is_transformers_no_bad_words_over_the_output():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 30, generator=gen)
    words = [(4,), (10, 11), (12, 13, 14)]
    outputs = [[1, 10], [12, 13], [3]]  # ends with 10: bans 11; with 12 13: bans 14
    seqs = [_seq([20, 21], o, str(i), bad_words=["x"]) for i, o in enumerate(outputs)]
    got = _processed(logits, seqs, [words] * 3)
    for i, o in enumerate(outputs):
        proc = NoBadWordsLogitsProcessor([list(w) for w in words], eos_token_id=EOS)
        torch.testing.assert_close(got[i:i + 1], proc(torch.tensor([o]), logits[i:i + 1].clone()))


def test_rows_that_ask_nothing_are_untouched_and_counts_grow_with_each_draw():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 16, generator=gen)
    plain = _seq([1], [], "plain")
    penalized = _seq([1], [], "pen", frequency_penalty=1.0)
    counts = TokenCounts(16, logits.device)
    for step in range(5):
        rules = logits_rules([plain, penalized], [True, True], frozenset({EOS}), counts)
        batch = SamplingBatch([0.0, 0.0], [0, 0], [1.0, 1.0], [0, 1], [step, step], rules=rules)
        tokens = sample(logits, batch).tolist()
        assert tokens[0] == logits[0].argmax().item()  # no rule: the raw argmax every time
        penalized.token_ids.append(tokens[1])
    slot = counts.slot(penalized)
    want = torch.bincount(torch.tensor(penalized.output_token_ids), minlength=16)
    assert torch.equal(counts.output[slot], want.int())  # kept incrementally, on the device
    assert len(set(penalized.output_token_ids)) > 1  # the penalty moved its argmax


# ------------------------------------------------------------------ through the engine


@pytest.fixture(scope="module")
def llm():
    from cbatch import LLM

    return LLM("random:tiny", max_num_seqs=4)  # vocab 512, EOS 511, byte tokenizer


def _run(llm, params, prompt="hello there", **kw):
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False, **kw)[0]


def _greedy_head_calls():
    return sum(v for k, v in cpu.kernel_paths().items() if k.startswith("greedy_head.")
               and k != "greedy_head.unsettled_rows")


def test_logit_bias_allowed_ids_and_bad_words_steer_every_token(llm):
    out = _run(llm, dict(max_tokens=8, ignore_eos=True, logit_bias={65: 100}))
    assert out.token_ids == [65] * 8
    out = _run(llm, dict(max_tokens=8, ignore_eos=True, temperature=1.0, seed=3,
                         allowed_token_ids=[97, 98, 99]))
    assert set(out.token_ids) <= {97, 98, 99}
    # "A" (byte 65) pushed up, and banned: never drawn
    out = _run(llm, dict(max_tokens=8, ignore_eos=True, logit_bias={65: 100}, bad_words=["A"]))
    assert 65 not in out.token_ids and len(out.token_ids) == 8
    # a two-token bad word: "AB" never appears, though both bytes are pushed up
    out = _run(llm, dict(max_tokens=8, ignore_eos=True, logit_bias={65: 50, 66: 50},
                         bad_words=["AB"]))
    assert b"AB" not in bytes(out.token_ids)


def test_min_tokens_holds_off_eos_and_stop_strings(llm):
    eos = llm.engine.model.config.eos_token_id
    out = _run(llm, dict(max_tokens=12, logit_bias={eos: 100}, min_tokens=5))
    assert out.finish_reason == "stop" and len(out.token_ids) == 6 and out.token_ids[-1] == eos
    out = _run(llm, dict(max_tokens=12, logit_bias={88: 100}, min_tokens=3, stop=["X"]))
    assert out.finish_reason == "stop" and len(out.token_ids) == 4 and out.text == "XXX"


def test_penalties_change_tokens_and_rows_without_rules_keep_the_greedy_screen(llm):
    if llm.engine.runner.greedy_screen is None:
        pytest.skip("no greedy screen on this CPU")
    params = dict(max_tokens=16, ignore_eos=True)
    calls = _greedy_head_calls()
    plain = _run(llm, params)
    assert _greedy_head_calls() > calls  # plain greedy steps take the screen
    calls = _greedy_head_calls()
    penalized = _run(llm, dict(params, repetition_penalty=1.5, frequency_penalty=1.0))
    assert _greedy_head_calls() == calls  # processed rows need the whole logits
    assert penalized.token_ids != plain.token_ids
    assert len(set(penalized.token_ids)) >= len(set(plain.token_ids))  # fewer repeats
    assert not llm.engine.runner.token_counts._slots  # released when the request finished


def test_a_requests_rules_and_draws_do_not_depend_on_its_batch(llm):
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, top_p=0.9,
                            min_p=0.02, seed=11, presence_penalty=0.5,
                            repetition_penalty=1.2, logit_bias={70: 3.0})
    alone = llm.generate(["abc"], params, use_tqdm=False)[0].token_ids
    crowd = llm.generate(["zz", "abc", "hello", "abc"],
                         [SamplingParams(max_tokens=7, temperature=1.0, seed=1), params,
                          SamplingParams(max_tokens=12, ignore_eos=True), params],
                         use_tqdm=False)
    assert crowd[1].token_ids == alone and crowd[3].token_ids == alone


def test_out_of_vocabulary_ids_are_refused_naming_the_field(llm):
    for field_, value in (("logit_bias", {600: 1.0}), ("allowed_token_ids", [1, 512])):
        with pytest.raises(ValueError, match=field_):
            _run(llm, {field_: value})


# ------------------------------------------------------------------ prompt logprobs


@pytest.mark.parametrize("chunk", [None, 5])
def test_prompt_logprobs_are_transformers_log_softmax_at_every_position(tiny_hf_dir,
                                                                        tiny_hf_model, chunk):
    """Each prompt token's logprob given the ones before it, with k alternatives, through
    chunked prefill (5-token chunks) and prefix caching (the second request's prompt is
    cached, and its logprobs are computed all the same)."""
    from cbatch import LLM

    kw = dict(max_num_batched_tokens=chunk) if chunk else {}
    llm = LLM(str(tiny_hf_dir), max_num_seqs=4, enable_prefix_caching=True, **kw)
    prompt = [5, 17, 300, 42, 42, 9, 100, 7, 64, 65, 66, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    params = SamplingParams(max_tokens=2, prompt_logprobs=3)
    first, second = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    with torch.no_grad():
        want = tiny_hf_model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    for out in (first, second):
        lp = out.prompt_logprobs
        assert len(lp) == len(prompt) and lp[0] is None
        for p in range(1, len(prompt)):
            entry = lp[p]
            assert prompt[p] in entry and 3 <= len(entry) <= 4
            assert entry[prompt[p]] == pytest.approx(want[p - 1, prompt[p]].item(), abs=1e-4)
            top = want[p - 1].topk(3)
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert entry[t] == pytest.approx(v, abs=1e-4)
    assert llm.generate([[3]], params, use_tqdm=False)[0].prompt_logprobs == [None]


def test_min_p_is_the_draws_rule_not_a_logits_rule():
    """min_p acts in the draw (with temperature, top-k and top-p), so a request with it keeps
    the fast paths of requests without logits rules (the greedy screen, speculation)."""
    from cbatch.core.spec_decode.decoder import speculates

    params = SamplingParams(temperature=0.8, min_p=0.1)
    assert not params.processes_logits and speculates(params)
    assert SamplingParams(min_p=0.1, logit_bias={1: 1.0}).processes_logits

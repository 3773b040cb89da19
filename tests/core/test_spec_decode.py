"""Speculative decoding (ngram, draft_model) inside continuous batching: the lookup, the
acceptance rule and its distribution, and the engine end to end against the same engine
without it, on tiny random GPT-2 and Llama checkpoints (their greedy outputs loop, which
prompt lookup catches; a checkpoint drafting for itself is right but for near-ties; each
test asserts that drafts were accepted, so it fails if speculation stops running)."""

import numpy as np
import pytest
import torch

from cbatch import LLM, Engine, SamplingParams
from cbatch.core.block_manager import BlockManager
from cbatch.core.scheduler import Scheduler
from cbatch.core.sequence import Sequence
from cbatch.core.sampler import SamplingBatch, sample
from cbatch.core.spec_decode.adaptive import AdaptiveDraftLength
from cbatch.core.spec_decode.decoder import accepted_tokens
from cbatch.core.spec_decode.draft_model import DraftModelProposer
from cbatch.core.spec_decode.proposer import Proposer, ngram_lookup
from tests.helpers import STRESS_CONFIGS, Arrival, run_arrivals

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
MAX_TOKENS = [30, 17, 25, 12, 28, 9]


# -------------------------------------------------------------- the lookup and the rule


def test_ngram_lookup_takes_the_longest_suffix_then_its_earliest_occurrence():
    t = np.array([1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3])
    # suffix [1, 2, 3] (3 long) occurred at 0: what followed it
    assert ngram_lookup(t, 1, 3, 4).tolist() == [4, 9, 2, 3]
    assert ngram_lookup(t, 1, 3, 2).tolist() == [4, 9]
    # only 2-grams: [2, 3] first at 1
    assert ngram_lookup(t, 1, 2, 3).tolist() == [4, 9, 2]
    # the continuation stops where the tokens do; the suffix itself is never a match
    assert ngram_lookup(np.array([5, 6, 5, 6]), 2, 2, 5).tolist() == [5, 6]
    assert ngram_lookup(np.array([1, 2, 3, 4]), 1, 3, 3).tolist() == []
    assert ngram_lookup(np.array([7]), 1, 3, 3).tolist() == []
    # shorter than prompt_lookup_min: nothing
    assert ngram_lookup(np.array([8, 1, 2, 8]), 2, 3, 3).tolist() == []


def test_accepted_tokens_keep_the_drafts_the_draws_agree_with_then_one_draw():
    assert accepted_tokens([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all, and the bonus
    assert accepted_tokens([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # the first draw that differs
    assert accepted_tokens([4, 5, 6], [1, 5, 6, 7]) == [1]
    assert accepted_tokens([], [3]) == [3]


def _decoding(i: int, num_tokens: int, bm: BlockManager, max_tokens: int = 50) -> Sequence:
    """A running sequence of ``num_tokens`` tokens (one output), all computed but its last."""
    seq = Sequence(str(i), list(range(num_tokens - 1)), SamplingParams(max_tokens=max_tokens),
                   i)
    seq.token_ids.append(7)
    seq.num_computed_tokens = num_tokens - 1
    bm.grow(seq.block_table, num_tokens)
    return seq


def test_the_scheduler_gives_drafts_what_is_left_and_never_preempts_for_them():
    bm = BlockManager(num_blocks=6, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8)
    a, b = _decoding(0, 4, bm), _decoding(1, 8, bm, max_tokens=3)  # 3 blocks held
    for seq in (a, b):
        seq.status = seq.status.RUNNING
        sched.running.append(seq)
    a.spec_token_ids, b.spec_token_ids = [1, 2, 3, 4, 5], [1, 2, 3]
    out = sched.schedule()
    # budget 8: a's and b's own tokens, then a's 5 drafts; b has room for one more output
    # token only (max_tokens 3: one out, one sampled by this step), so 1 draft
    got = {item.seq.request_id: (item.num_new_tokens, item.draft_token_ids)
           for item in out.scheduled}
    assert got == {"0": (6, [1, 2, 3, 4, 5]), "1": (2, [1])}
    assert [item.samples for item in out.scheduled] == [True, True]
    assert len(a.block_table) == 3 and len(b.block_table) == 3 and bm.num_free_blocks == 0
    # every draft rejected: a holds 5 tokens (4 computed), b 9 (8 computed)
    for seq in (a, b):
        seq.token_ids.append(9)
        seq.num_computed_tokens += 1
    a.spec_token_ids, b.spec_token_ids = [1] * 8, []
    sched.max_num_batched_tokens = 20
    out = sched.schedule()
    # a's third block, taken by drafts, went back; now blocks are short: a's drafts stop at
    # what its 2 blocks and the 1 free one hold (positions 5..11 after its last token at
    # 4), and nobody is preempted for them
    assert not out.preempted
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("0", 8), ("1", 1)]
    assert bm.num_free_blocks == 0


def test_adaptive_draft_length_pauses_a_request_whose_drafts_fail_and_probes_again():
    rule, rid = AdaptiveDraftLength(k=4), "0"  # (a request id: its state is the rule's)
    # free drafts (cost 0): drafting 4 pays above a = 0.287 (1 + a + .. + a^4 = 1 + 4 * 0.1)
    assert rule.threshold == pytest.approx(0.2871, abs=1e-3)
    granted = []
    for _ in range(60):  # drafts that never match: k for 4 verifications, then probes
        granted.append(rule.draft_length(rid))
        if granted[-1]:
            rule.observe(rid, granted[-1], 0)
    # (1 -> 0.7 -> 0.49 -> 0.34 -> 0.24); probes of one draft after 16 steps, then 32 (each
    # failed probe doubles the wait, up to 128)
    assert granted[:4] == [4] * 4 and granted[4:] == [0] * 15 + [1] + [0] * 31 + [1] + [0] * 8
    # the engine's prior falls with every failed verification (of any request); once it is
    # below the threshold a new request starts paused: one in 8 of them probes, after 64
    # steps, the rest never
    assert rule.prior == pytest.approx(0.95 ** 6)
    weary = AdaptiveDraftLength(k=4)
    for _ in range(40):
        weary.observe("x", 4, 0)
    late = [str(i) for i in range(9)]
    granted = [[weary.draft_length(rid) for _ in range(300)] for rid in late]
    assert [sum(g) for g in granted] == [2] + [0] * 7 + [2]  # probes at 64 and 192
    assert granted[0][:64] == [0] * 63 + [1]
    # a probe whose draft holds lifts it back to k (0.12 -> 0.38 >= 0.287)
    while not rule.draft_length(rid):
        pass
    rule.observe(rid, 1, 1)
    assert [rule.draft_length(rid) for _ in range(3)] == [4] * 3
    # drafts that hold keep k; half of them holding, too; adaptive off: always k
    kept = "1"
    for accepted in [4, 2] * 20:
        assert rule.draft_length(kept) == 4
        rule.observe(kept, 4, accepted)
    off, stubborn = AdaptiveDraftLength(k=3, adaptive=False), "2"
    for _ in range(30):
        assert off.draft_length(stubborn) == 3
        off.observe(stubborn, 3, 0)
    # a request's state is the rule's until it is released (the engine does, as it ends)
    assert set(rule._requests) == {"0", "1"} and not off._requests
    rule.release("0")
    assert set(rule._requests) == {"1"}


def test_adaptive_draft_length_weighs_what_drafting_costs():
    rule = AdaptiveDraftLength(k=4)
    for _ in range(60):  # drafting takes half a step per draft position (a draft model)
        rule.observe_cost(draft_s=0.02, num_positions=4, rows_per_drafter=1, step_s=0.01)
    assert rule.cost == pytest.approx(0.5, rel=1e-3)
    # 1 + a + ... + a^4 = 1 + 4 * 0.6 at a = 0.806: drafts held 60% of the time do not pay
    assert rule.threshold == pytest.approx(0.806, abs=2e-3)
    rid = "0"
    granted = []
    for accepted in [3, 2, 3, 2, 3]:
        granted.append(rule.draft_length(rid))
        rule.observe(rid, 4, accepted)
    assert granted == [4, 4, 0, 0, 0]  # (1 -> 0.925 -> 0.80: below)
    # the same drafting for one row of eight: it holds up the other seven, and would not
    # pay even if every draft held: probes only
    for _ in range(60):
        rule.observe_cost(draft_s=0.02, num_positions=4, rows_per_drafter=8, step_s=0.01)
    assert rule.threshold == 1.0


class _Replay(Proposer):
    """Drafts from a recorded output (the target's own greedy tokens: always right)."""

    def __init__(self, prompt: list[int], output: list[int], k: int):
        self.full, self.k = prompt + output, k

    def propose(self, token_ids):
        return self.full[len(token_ids):len(token_ids) + self.k]


class _Wrong(Proposer):
    """Drafts that never hold: always the same ``drafts``, tokens the target's output never
    holds."""

    def __init__(self, drafts: list[int]):
        self.drafts = drafts

    def propose(self, token_ids):
        return self.drafts


@pytest.mark.parametrize("adaptive", [True, False])
def test_engine_stops_drafting_for_a_request_whose_drafts_never_hold(adaptive):
    prompt, params = [5, 9, 13, 2], SamplingParams(max_tokens=60, ignore_eos=True)
    plain = LLM("random:tiny").generate([prompt], params, use_tqdm=False)[0].token_ids
    never = [t for t in range(512) if t not in plain][:4]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": adaptive}
    for proposer, name in [(_Wrong(never), "wrong"), (_Replay(prompt, plain, 4), "replay")]:
        llm = LLM("random:tiny", speculative_config=spec)
        llm.engine.spec_decoder.proposer = proposer
        assert llm.generate([prompt], params, use_tqdm=False)[0].token_ids == plain
        assert not llm.engine.spec_decoder.draft_length._requests  # released as it ended
        st = llm.engine.stats()
        if name == "replay":  # always right: k drafts a step (fewer near max_tokens only)
            assert st.spec_decode_acceptance_rate == 1.0
            assert st.spec_decode_num_accepted_tokens_per_pos[3] >= st.spec_decode_num_drafts - 2
            assert st.spec_decode_num_drafts <= 60 // 5 + 1
        elif adaptive:  # 4 verifications, then probes after 16 and 32 more steps
            assert st.spec_decode_num_accepted_tokens == 0
            assert st.spec_decode_num_drafts == 6, st
        else:  # every step but the first (prefill) and the last (max_tokens leaves no room)
            assert st.spec_decode_num_accepted_tokens == 0
            assert st.spec_decode_num_drafts >= 55, st


def _survival_chi2(observed: np.ndarray, expected: np.ndarray) -> float:
    """P(chi-square >= the statistic of ``observed`` counts against ``expected`` counts),
    over the cells where something is expected (a count where nothing is expected fails)."""
    assert observed[expected == 0].sum() == 0, "a token the target never draws was drawn"
    o, e = observed[expected > 0], expected[expected > 0]
    stat = float(((o - e) ** 2 / e).sum())
    df = len(o) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


@pytest.mark.parametrize("case", ["agree", "partly", "disagree"])
def test_verification_draws_are_distributed_as_the_target(case):
    """Rejection sampling with a point-mass draft, through the sampler the engine runs: N
    requests (seeds) verify two drafts [d0, d1] against target distributions p0 (after the
    last token) and p1 (after d0); then the first output token ~ p0, d0 is accepted with
    probability p0(d0), a rejected position's token ~ p0 without d0 (the residual), and the
    token after an accepted d0 ~ p1."""
    V, N = 8, 6000
    gen = torch.Generator().manual_seed(0)
    logits0 = torch.randn(V, generator=gen) * 1.5
    logits1 = torch.randn(V, generator=gen) * 1.5
    top_k = 5
    ranked = logits0.argsort(descending=True).tolist()
    d0 = {"agree": ranked[0], "partly": ranked[2], "disagree": ranked[-1]}[case]  # last: 0
    d1 = logits1.argmax().item()
    # per request 3 rows: positions 0, 1, 2 (after the last token, after d0, after d1)
    logits = torch.stack([logits0, logits1, torch.zeros(V)]).repeat(N, 1)
    rows = 3 * N
    batch = SamplingBatch(temperatures=[0.8] * rows, top_ks=[top_k] * rows,
                          top_ps=[1.0] * rows, seeds=[s for s in range(N) for _ in range(3)],
                          positions=[5, 6, 7] * N)
    draws = sample(logits, batch).view(N, 3).tolist()
    outs = [accepted_tokens([d0, d1], d) for d in draws]

    def target(lg):  # the request's rule: temperature, then the top_k most likely
        w = (lg / 0.8).softmax(-1)
        w[lg.argsort(descending=True)[top_k:]] = 0
        return (w / w.sum()).numpy().astype(np.float64)

    p0, p1 = target(logits0), target(logits1)
    first = np.bincount([o[0] for o in outs], minlength=V)
    assert _survival_chi2(first, N * p0) > 1e-3
    accepted = np.array([o[0] == d0 for o in outs])
    n_acc = int(accepted.sum())
    sd = np.sqrt(N * p0[d0] * (1 - p0[d0])) + 1e-9
    assert abs(n_acc - N * p0[d0]) <= 4.5 * sd  # accepted with probability p0(d0)
    residual = p0.copy()
    residual[d0] = 0
    rejected = np.bincount([o[0] for o in outs if o[0] != d0], minlength=V)
    assert _survival_chi2(rejected, (N - n_acc) * residual / residual.sum()) > 1e-3
    if case != "disagree":
        second = np.bincount([o[1] for o in outs if o[0] == d0], minlength=V)
        assert _survival_chi2(second, n_acc * p1) > 1e-3
    else:
        assert n_acc == 0  # top_k leaves d0 out: never accepted


# -------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def checkpoint(request, tiny_hf_dir, tiny_llama_dir):
    return str(tiny_hf_dir if request.param == "gpt2" else tiny_llama_dir)


@pytest.fixture(scope="module")
def prompts():
    """Prompts that repeat a random unit (what prompt lookup finds), 3 to 20 tokens."""
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() * rep
            for n, rep in [(3, 4), (5, 3), (7, 2), (1, 3), (4, 5), (9, 2)]]


def _greedy():
    return [SamplingParams(max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]


def _assert_speculated(engine: Engine, partly: bool = True) -> None:
    """Drafts were verified and accepted (and, if ``partly``, some rejected)."""
    st = engine.stats()
    assert st.spec_decode_num_accepted_tokens > 0, st
    assert st.spec_decode_num_draft_tokens <= st.spec_decode_num_drafts * 3
    assert sum(st.spec_decode_num_accepted_tokens_per_pos) == st.spec_decode_num_accepted_tokens
    if partly:
        assert st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens, st
    assert 1.0 < st.spec_decode_mean_accepted_length <= 4.0
    assert 0.0 < st.spec_decode_acceptance_rate <= 1.0
    assert st.spec_decode_draft_s > 0 and st.spec_decode_verify_s > 0


@pytest.fixture(scope="module")
def plain_greedy(checkpoint, prompts):
    """Each prompt's greedy output from the engine without speculation."""
    llm = LLM(checkpoint, **STRESS_CONFIGS["roomy"])
    return [o.token_ids for o in llm.generate(prompts, _greedy(), use_tqdm=False)]


@pytest.mark.parametrize("config", ["roomy", "chunked-prefill", "preempting", "few-seqs"])
def test_greedy_outputs_equal_without_speculation(checkpoint, prompts, plain_greedy, config):
    llm = LLM(checkpoint, speculative_config=NGRAM, **STRESS_CONFIGS[config])
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs] == plain_greedy
    assert all(o.finish_reason == "length" for o in outs)
    engine = llm.engine
    _assert_speculated(engine)
    engine.block_manager.check_whole()
    if config == "preempting":
        assert engine.stats().num_preemptions > 0
    # the prefix cache holds verified tokens only: every cached block's tokens are the
    # tokens of a request at that block's place, and the same prompts again hit the cache
    finals = [p + o for p, o in zip(prompts, plain_greedy)]
    bs = engine.block_manager.block_size
    for block, tokens in engine.block_manager._tokens_of.items():
        assert any(list(tokens) == f[i:i + bs] for f in finals
                   for i in range(0, len(f) - bs + 1, bs)), (block, tokens)
    hits = engine.stats().prefix_cache_hit_tokens
    again = llm.generate(prompts, _greedy(), use_tqdm=False)
    assert [o.token_ids for o in again] == plain_greedy
    assert engine.stats().prefix_cache_hit_tokens > hits
    engine.block_manager.check_whole()


def _draft(model) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}


def _assert_drafted_by_model(engine: Engine) -> None:
    """The draft model ran, and its KV pool is whole (every request has finished)."""
    proposer = engine.spec_decoder.proposer
    assert isinstance(proposer, DraftModelProposer) and proposer.num_passes > 0
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks
    proposer.blocks.check_whole()


@pytest.mark.parametrize("config", ["roomy", "chunked-prefill", "preempting", "few-seqs"])
def test_draft_model_greedy_outputs_equal_without_speculation(checkpoint, prompts, plain_greedy,
                                                             config):
    # the target drafting for itself: right but for near-ties, so long runs are accepted
    llm = LLM(checkpoint, speculative_config=_draft(checkpoint), **STRESS_CONFIGS[config])
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs] == plain_greedy
    _assert_speculated(llm.engine, partly=False)
    assert llm.engine.stats().spec_decode_acceptance_rate > 0.5
    if config == "preempting":
        assert llm.engine.stats().num_preemptions > 0
    llm.engine.block_manager.check_whole()
    _assert_drafted_by_model(llm.engine)


def test_a_draft_model_that_disagrees_changes_no_token(checkpoint, prompts, plain_greedy):
    # another random model with the same vocabulary: some of its drafts are rejected
    llm = LLM(checkpoint, speculative_config={**_draft("random:tiny"), "adaptive": False},
              **STRESS_CONFIGS["roomy"])
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs] == plain_greedy
    st = llm.engine.stats()
    assert 0 < st.spec_decode_num_drafts and st.spec_decode_acceptance_rate < 1.0, st
    _assert_drafted_by_model(llm.engine)


def test_seeded_sampling_with_a_draft_model_equals_without(tiny_hf_dir, prompts):
    # (the drafts are the draft's greedy tokens: a low temperature makes draws agree with them)
    params = [SamplingParams(max_tokens=m, temperature=0.1, top_p=0.9, seed=i, ignore_eos=True)
              for i, m in enumerate(MAX_TOKENS)]
    plain = LLM(str(tiny_hf_dir)).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_hf_dir), speculative_config=_draft(tiny_hf_dir))
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.engine.stats().spec_decode_num_accepted_tokens > 0
    _assert_drafted_by_model(llm.engine)


def test_a_draft_model_must_share_the_vocabulary():
    with pytest.raises(ValueError, match="vocabulary of 50257 tokens, the target 512"):
        Engine("random:tiny", speculative_config=_draft("random:distilgpt2"))


def test_batch_invariant_speculation_equals_plain(tiny_llama_dir, prompts):
    plain = LLM(str(tiny_llama_dir), batch_invariant=True)
    spec = LLM(str(tiny_llama_dir), batch_invariant=True, speculative_config=NGRAM)
    a = plain.generate(prompts, _greedy(), use_tqdm=False)
    b = spec.generate(prompts, _greedy(), use_tqdm=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    _assert_speculated(spec.engine)


def test_seeded_sampling_and_n_choices_equal_without_speculation(tiny_hf_dir, prompts):
    """A draft position's token is the draw the request makes there without speculation
    (same uniform, same rule), so seeded outputs are the same token for token; a low
    temperature makes the random model's draws agree with its loops."""
    params = SamplingParams(max_tokens=24, temperature=0.05, top_p=0.95, top_k=50, seed=5,
                            n=2, ignore_eos=True)
    plain = LLM(str(tiny_hf_dir)).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_hf_dir), speculative_config=NGRAM)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert len(spec) == 2 * len(prompts)
    assert [o.token_ids for o in plain] == [o.token_ids for o in spec]
    _assert_speculated(llm.engine, partly=False)


def test_stop_tokens_strings_and_max_tokens_cut_an_accepted_run(tiny_llama_dir, prompts):
    """Each accepted token is checked in turn: a stop token or string inside a step's
    accepted run ends the request there (the rest dropped), as without speculation;
    max_tokens leaves no room for drafts past it."""
    plain = LLM(str(tiny_llama_dir))
    spec = LLM(str(tiny_llama_dir), speculative_config=NGRAM)
    full = plain.generate(prompts, _greedy(), use_tqdm=False)
    params = [SamplingParams(max_tokens=m, stop_token_ids=[o.token_ids[m // 2]],
                             ignore_eos=True) for m, o in zip(MAX_TOKENS, full)]
    a = plain.generate(prompts, params, use_tqdm=False)
    b = spec.generate(prompts, params, use_tqdm=False)
    assert [(o.token_ids, o.finish_reason) for o in a] == \
        [(o.token_ids, o.finish_reason) for o in b]
    assert any(o.finish_reason == "stop" for o in b)
    # stop strings: from the middle of each output's text
    params = [SamplingParams(max_tokens=m, stop=[o.text[len(o.text) // 2:][:3]],
                             ignore_eos=True) for m, o in zip(MAX_TOKENS, full)]
    a = plain.generate(prompts, params, use_tqdm=False)
    b = spec.generate(prompts, params, use_tqdm=False)
    assert [(o.token_ids, o.text, o.finish_reason) for o in a] == \
        [(o.token_ids, o.text, o.finish_reason) for o in b]
    assert sum(o.finish_reason == "stop" for o in b) >= 3
    _assert_speculated(spec.engine, partly=False)
    spec.engine.block_manager.check_whole()


def test_streaming_carries_several_tokens_per_output(tiny_hf_dir, prompts):
    llm = LLM(str(tiny_hf_dir), speculative_config=NGRAM)
    seen: dict[str, list[list[int]]] = {}
    outs = llm.generate(prompts, _greedy(), use_tqdm=False,
                        on_output=lambda o: seen.setdefault(o.request_id, []).append(o.token_ids))
    jumps = []
    for out in outs:
        snaps = seen[out.request_id]
        assert snaps[-1] == out.token_ids
        for before, after in zip(snaps, snaps[1:]):
            assert after[:len(before)] == before  # each snapshot extends the last
            jumps.append(len(after) - len(before))
    assert max(jumps) > 1 and min(jumps) >= 1


def test_requests_with_logits_rules_or_logprobs_decode_one_token_per_step(tiny_hf_dir, prompts):
    """Penalties and logprobs do not speculate (their rules and logprobs are per token);
    they share steps with requests that do, and their outputs are as without speculation."""
    params = [SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=1.3)]
    plain = LLM(str(tiny_hf_dir)).generate(prompts[:2], params, use_tqdm=False)
    llm = LLM(str(tiny_hf_dir), speculative_config=NGRAM)
    spec = llm.generate(prompts[:2], params, use_tqdm=False)
    assert [o.token_ids for o in plain] == [o.token_ids for o in spec]
    assert [list(d) for d in plain[0].logprobs] == [list(d) for d in spec[0].logprobs]
    assert llm.engine.stats().spec_decode_num_drafts == 0
    mixed = llm.generate(prompts[:3], params + [_greedy()[2]], use_tqdm=False)
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in plain]
    _assert_speculated(llm.engine, partly=False)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_the_kv_pool_is_whole_after_aborts_mid_speculation(tiny_llama_dir, prompts, method):
    spec = NGRAM if method == "ngram" else _draft(tiny_llama_dir)
    engine = Engine(str(tiny_llama_dir), speculative_config=spec, block_size=4,
                    num_blocks=40, max_num_seqs=4)
    arrivals = [Arrival(p, SamplingParams(max_tokens=40, ignore_eos=True), step=i,
                        abort_after=3 + 2 * i if i % 2 == 0 else None)
                for i, p in enumerate(prompts)]

    def after_step(engine):
        # a running sequence holds the blocks of its tokens, and no more (rejected drafts'
        # blocks go back at the next schedule, before it drafts again)
        for seq in engine.scheduler.running:
            assert len(seq.block_table) <= engine.block_manager.blocks_for(
                seq.num_tokens + NGRAM["num_speculative_tokens"])

    finished = run_arrivals(engine, arrivals, max_steps=400, after_step=after_step)
    assert [finished[i].finish_reason for i in range(0, len(prompts), 2)] == ["abort"] * 3
    _assert_speculated(engine, partly=False)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    if method == "draft_model":
        _assert_drafted_by_model(engine)


# -------------------------------------------------------------- CUDA graphs' shapes


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("config", ["roomy", "chunked-prefill", "preempting"])
def test_steps_padded_to_the_verify_graph_shape_change_no_token(checkpoint, prompts,
                                                                plain_greedy, method, config):
    """With cuda_graphs=True on the CPU the steps a GPU replays as graphs run eagerly in the
    graphs' padded shapes: verifying steps at k + 1 tokens a row (the target's, and the draft
    model's first pass), one-token steps at their bucket; the tokens are those of the plain
    engine."""
    spec = NGRAM if method == "ngram" else _draft(checkpoint)
    llm = LLM(checkpoint, speculative_config=spec, cuda_graphs=True, **STRESS_CONFIGS[config])
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs] == plain_greedy
    engine = llm.engine
    _assert_speculated(engine, partly=method == "ngram")
    engine.block_manager.check_whole()
    q = 1 + spec["num_speculative_tokens"]
    runners = [engine.runner] + ([engine.spec_decoder.proposer.runner] if method == "draft_model"
                                 else [])
    for runner in runners:
        shapes = runner.steps_by_shape
        assert runner.query_len == q and any(k == q for _, k in shapes), shapes
        assert all((rows, k) in runner.graph_shapes() for rows, k in shapes)
    if method == "draft_model":
        _assert_drafted_by_model(engine)
        assert any(k == 1 for _, k in engine.spec_decoder.proposer.runner.steps_by_shape)


def test_seeded_sampling_in_the_verify_graph_shape_equals_without_speculation(tiny_hf_dir,
                                                                             prompts):
    params = SamplingParams(max_tokens=24, temperature=0.05, top_p=0.95, seed=5, n=2,
                            ignore_eos=True)
    plain = LLM(str(tiny_hf_dir)).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_hf_dir), speculative_config=NGRAM, cuda_graphs=True)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in plain] == [o.token_ids for o in spec]
    _assert_speculated(llm.engine, partly=False)
    assert any(k == 4 for _, k in llm.engine.runner.steps_by_shape)


def test_prompt_logprobs_of_chunks_padded_to_the_verify_graph_shape(tiny_hf_dir, prompts):
    """Prompt chunks of at most k + 1 tokens beside verifying rows run in the padded shape;
    the prompt logprobs they score are the plain engine's."""
    params = [SamplingParams(max_tokens=m, ignore_eos=True, prompt_logprobs=2 * (i % 2))
              for i, m in enumerate(MAX_TOKENS)]
    config = dict(max_num_seqs=2, max_num_batched_tokens=8)
    plain = LLM(str(tiny_hf_dir), **config).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_hf_dir), speculative_config=NGRAM, cuda_graphs=True, **config)
    runner, seen = llm.engine.runner, []
    run = runner.run

    def spy(batch, sampling, num_logprobs, prompt=None, rows=None):
        seen.append((batch.graph_shape, prompt is not None))
        return run(batch, sampling, num_logprobs, prompt, rows)

    runner.run = spy
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for a, b in zip(spec, plain):
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
        for x, y in zip(a.prompt_logprobs or [], b.prompt_logprobs or []):
            assert (x is None) == (y is None)
            if x is not None:
                assert x.keys() == y.keys()
                assert all(abs(x[t] - y[t]) < 1e-4 for t in x)
    assert any(shape and shape[1] == 4 and scored for shape, scored in seen), seen
    _assert_speculated(llm.engine, partly=False)

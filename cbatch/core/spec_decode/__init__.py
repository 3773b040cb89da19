"""Speculative decoding: who drafts, what a draft costs the scheduler, and which drafts a
step's samples accept.

The engine's one handle on it is :class:`~cbatch.core.spec_decode.decoder.SpeculativeDecoder`
(``Engine.spec_decoder``).  A decoding request that speculates
(:func:`~cbatch.core.spec_decode.decoder.speculates`) gets drafts before each step
(:mod:`~cbatch.core.spec_decode.proposer`: the ``Proposer`` interface, prompt lookup and the
registry of methods; :mod:`~cbatch.core.spec_decode.draft_model`: a smaller model; the
decoder's ``proposer`` is any ``Proposer``, which a benchmark may replace), as many as
:class:`~cbatch.core.spec_decode.adaptive.AdaptiveDraftLength` grants it from its recent
acceptance.  The scheduler gives its last token and up to k of its drafts one run of the
step's flat batch, as it gives a prefill chunk several tokens, and the model runner samples
the target at every one of those positions, each draw at the request's own uniform for that
output position (:func:`cbatch.core.sampler.uniforms`).
:func:`~cbatch.core.spec_decode.decoder.accepted_tokens` keeps the drafts while they equal
those draws, then the first draw that differs (or the one after the last draft): 1 to k + 1
tokens per step.  :mod:`~cbatch.core.spec_decode.metrics` counts them as vLLM does.

Why this is exact.  For greedy rows the draw is the argmax: the longest prefix of drafts that
the target itself would have chosen, plus its own next token.  For sampled rows it is
rejection sampling (Leviathan et al. 2023) with the n-gram draft's distribution, a point
mass on the draft d: accept d with probability p(d), else draw from the residual
(p - onehot(d))+ normalised, i.e. from p without d.  Drawing X ~ p and accepting iff X = d
has exactly that law (P(accept) = p(d); given a rejection X is distributed as p restricted
to tokens other than d), so each position's output token is distributed as the target's,
and since X is the draw the request would make without speculation (same uniform, same
rule), a seeded request's tokens do not depend on whether, or how much, it speculated.

Requests whose logits rules carry state from token to token or are per row (penalties,
min_tokens, bad words, logit_bias, allowed ids, min_p, structured outputs) or that ask for
logprobs do not speculate: they decode one token per step, in the same steps.
"""

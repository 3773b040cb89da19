"""Per-request sampling settings (no torch: the scheduler reads them too)."""

from __future__ import annotations

import copy
import math
import numbers
import struct
from dataclasses import dataclass, field

# top_k beyond any vocabulary (the sampler clamps it to the vocabulary it samples from)
MAX_TOP_K = 2**31
# The most prompt-logprob entries one request may ask for: (prompt_logprobs + 1) per prompt
# token, in every choice; about 16 MB of JSON, as the server's request body limit
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 18
# repetition_penalty's range: the sampler divides (or multiplies) float32 logits by it, and
# logits of any model stay finite through that for every value in this range
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-30, 1e30
# the constraints a StructuredOutputsParams takes one of
CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """A constraint on the output's text, enforced token by token by a grammar engine
    (xgrammar): exactly one of these (vLLM's ``StructuredOutputsParams``).

    json         a JSON schema (a dict or its text): the output is a JSON value it validates
    json_object  any JSON object
    regex        the output matches this regular expression, whole
    choice       the output is one of these strings
    grammar      an EBNF grammar (GBNF, as llama.cpp and xgrammar write it)

    and, with any of them, when it begins:

    reasoning_end  token ids that end a reasoning model's thinking (``</think>``'s): the
                 output is free until it has written them, and the constraint applies to what
                 follows them (vLLM's structured outputs with a reasoning parser; the server
                 sets it from its ``--reasoning-parser``).  None: from the first token.
    """

    json: str | dict | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    reasoning_end: list[int] | None = None

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINT_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, json_object, regex, "
                             f"choice, grammar; got {given or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple))
                                        or not self.choice
                                        or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, "
                             f"got {self.choice!r:.80}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema (a dict or its "
                             "text)")
        if self.reasoning_end is not None:
            self.reasoning_end = _token_ids("structured_outputs.reasoning_end",
                                            self.reasoning_end)
            if not self.reasoning_end:
                raise ValueError("structured_outputs.reasoning_end must not be empty (None: "
                                 "the constraint applies from the first token)")

    @property
    def kind(self) -> str:
        """Which constraint: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(n for n in CONSTRAINT_KINDS if getattr(self, n) not in (None, False))


@dataclass
class SamplingParams:
    """How one request is decoded: vLLM's ``SamplingParams``, with its names, ranges and
    meanings.

    max_tokens      new tokens to generate at most (>= 1)
    min_tokens      until this many tokens are out, EOS and ``stop_token_ids`` cannot be
                    sampled and stop strings are not checked (0 <= min_tokens <= max_tokens)
    temperature     0 = greedy; otherwise logits are divided by it before sampling, in
                    float32: a temperature that float32 rounds to 0 (below about 7e-46) is
                    greedy, its limit, and one float32 cannot hold (above 3.4e38) is refused
    top_k           keep the k most likely tokens (0 or -1 = all; at most 2**31); 1 is
                    greedy (the sampler keeps one token by its argmax, not by weights that
                    a huge temperature rounds to ties)
    top_p           keep the smallest set of tokens whose probability reaches top_p (1 = all)
    min_p           drop tokens less likely than min_p times the most likely one (0 = off)
    presence_penalty   in [-2, 2]: subtracted once from the logit of every token already in
                    the output (> 0 favours new tokens)
    frequency_penalty  in [-2, 2]: subtracted from each token's logit once per time it is in
                    the output
    repetition_penalty  in [1e-30, 1e30]: the logit of every token in the prompt or the
                    output is divided by it when positive and multiplied by it when negative
                    (1 = off; transformers' and vLLM's rule)
    logit_bias      {token id: bias in [-100, 100]} added to the logits
    allowed_token_ids  only these tokens can be sampled (None = all)
    bad_words       strings that never appear in the output: the last token of each (of
                    its tokenization with and without a leading space) is banned whenever
                    the output ends with the tokens before it
    seed            per-request seed, an int in [0, 2**64): the same seed gives the same
                    tokens whatever else is in the batch (None: derived from the engine's
                    seed and the request)
    stop_token_ids  tokens that finish the request (with reason "stop"); they are kept
    ignore_eos      keep going past the model's end-of-sequence token
    stop            strings that finish the request (reason "stop"); the text ends before
                    the first one, or after it with ``include_stop_str_in_output``
    logprobs        None: none; k >= 0: the log-probability of each sampled token and the
                    k most likely alternatives at every step (RequestOutput.logprobs); the
                    engine refuses k above its max_logprobs
    prompt_logprobs None: none; k >= 0: for every prompt token after the first, its
                    log-probability and the k most likely alternatives
                    (RequestOutput.prompt_logprobs)
    skip_special_tokens  leave special tokens (EOS, chat markers) out of the text
    spaces_between_special_tokens  put a space between special tokens in the text
    truncate_prompt_tokens  keep only the last k tokens of the prompt (None: all; -1: the
                    model's length less max_tokens)
    structured_outputs  a :class:`StructuredOutputsParams` (or a dict of one) the output
                    must follow
    n               completions per prompt (the server returns n choices; ``LLM.generate``
                    runs n requests with seeds seed, seed + 1, ...)
    best_of         as vLLM v1: only n (None or best_of == n); more is refused
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    min_tokens: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    n: int = 1
    best_of: int | None = None

    def __post_init__(self) -> None:
        # Every value the step cannot run is refused here, naming the field: a bad request is
        # an error for its caller, never a failure inside a step that every request shares.
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if (not _is_real(self.temperature) or not 0 <= self.temperature < math.inf
                or _float32(self.temperature) == math.inf):
            raise ValueError(f"temperature must be a number in [0, 3.4e38] (a float32), got "
                             f"{self.temperature!r}")
        if not _is_int(self.top_k) or not (self.top_k in (-1, 0) or 1 <= self.top_k <= MAX_TOP_K):
            raise ValueError(f"top_k must be -1 or 0 (off) or an int in [1, 2**31], got "
                             f"{self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be None or an int in [0, 2**64), got {self.seed!r}")
        self.top_k = max(self.top_k, 0)  # -1 (vLLM's "off") is 0 here
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        if _float32(self.temperature) == 0.0 or self.top_k == 1:
            # the sampler sees float32: a positive temperature that rounds to 0 there is
            # greedy, its limit; top_k=1 keeps the argmax alone, which greedy is exactly
            self.temperature = 0.0
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids)
        self._stop_token_set = frozenset(self.stop_token_ids)
        if not isinstance(self.stop, (str, list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r:.80}")
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r:.80}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not _is_int(k) or k < 0):
                raise ValueError(f"{name} must be None or an int >= 0, got {k!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
            setattr(self, name, float(value))
        if (not _is_real(self.repetition_penalty) or not MIN_REPETITION_PENALTY
                <= self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise ValueError(f"repetition_penalty must be a number in [{MIN_REPETITION_PENALTY}"
                             f", {MAX_REPETITION_PENALTY}], got {self.repetition_penalty!r}")
        self.min_p, self.repetition_penalty = float(self.min_p), float(self.repetition_penalty)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id to bias, got "
                                 f"{self.logit_bias!r:.80}")
            bias = {}
            for token, value in self.logit_bias.items():
                token = int(token) if isinstance(token, str) and token.isdigit() else token
                if not _is_int(token) or token < 0:
                    raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got "
                                     f"{token!r:.40}")
                if not _is_real(value) or not -100.0 <= value <= 100.0:
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got "
                                     f"{value!r:.40} for token {token}")
                bias[token] = float(value)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every "
                                 "token)")
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not isinstance(self.bad_words, (list, tuple)):
                raise ValueError(f"bad_words must be a list of strings, got "
                                 f"{self.bad_words!r:.80}")
            self.bad_words = list(self.bad_words)
            if any(not isinstance(w, str) or not w for w in self.bad_words):
                raise ValueError(f"bad_words must be non-empty strings, got "
                                 f"{self.bad_words!r:.80}")
        for name in ("include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or not (k == -1 or k >= 1)):
            raise ValueError(f"truncate_prompt_tokens must be None, -1 or an int >= 1, got "
                             f"{k!r}")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams or a dict, got "
                             f"{type(self.structured_outputs).__name__}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of != self.n):
            raise ValueError(f"best_of={self.best_of!r} is not supported: only best_of == n "
                             f"(= {self.n}), as in vLLM v1; ask for n completions instead")

    def choice(self, index: int) -> SamplingParams:
        """Choice ``index`` of a request for ``n`` completions, as one engine request (n = 1):
        with a seed, choice i samples with seed + i (mod 2**64), so the choices differ and
        each is reproducible alone.  A shallow copy: the checks these params passed are not
        run again for every choice (its lists are shared; nothing writes them)."""
        choice = copy.copy(self)
        choice.n, choice.best_of = 1, None
        if self.seed is not None:
            choice.seed = (self.seed + index) % 2**64
        return choice

    def check_logprobs(self, num_prompt_tokens: int, vocab_size: int, max_logprobs: int,
                       max_prompt_logprobs: int) -> None:
        """ValueError naming the field when ``logprobs`` or ``prompt_logprobs`` asks for more
        than an engine gives (its ``max_logprobs`` and ``max_prompt_logprobs``, -1 meaning
        the vocabulary, never more than it), or the prompt logprobs of a prompt of
        ``num_prompt_tokens`` for more than :data:`MAX_PROMPT_LOGPROB_ENTRIES` entries."""
        for name, limit_name, limit in (("logprobs", "max_logprobs", max_logprobs),
                                        ("prompt_logprobs", "max_prompt_logprobs",
                                         max_prompt_logprobs)):
            k = getattr(self, name)
            limit = vocab_size if limit == -1 else min(limit, vocab_size)
            if k is not None and k > limit:
                raise ValueError(f"{name}={k} is more than this engine's {limit_name} "
                                 f"({limit})")
        check_prompt_logprob_entries(self.prompt_logprob_entries(num_prompt_tokens))

    def prompt_logprob_entries(self, num_prompt_tokens: int) -> int:
        """The prompt-logprob entries a prompt of ``num_prompt_tokens`` gets: k + 1 per token
        (k alternatives and its own), 0 without ``prompt_logprobs``."""
        k = self.prompt_logprobs
        return 0 if k is None else (k + 1) * num_prompt_tokens

    @property
    def stop_token_set(self) -> frozenset[int]:
        """``stop_token_ids`` as a set (a stop check per token is O(1), however long the
        list)."""
        return self._stop_token_set

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether a rule other than temperature, top-k, top-p and min-p (the draw's own)
        changes this request's logits (its rows then leave the CPU's greedy screen for the
        full logits)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.min_tokens
                    or self.logit_bias or self.allowed_token_ids is not None
                    or self.bad_words or self.structured_outputs is not None)

    @property
    def needs_output_on_host(self) -> bool:
        """Whether this request's logits rules read its last sampled token on the host (bad
        words, a grammar): with async scheduling, its steps wait for the previous one."""
        return bool(self.bad_words) or self.structured_outputs is not None

    @property
    def penalized(self) -> bool:
        """Whether a penalty needs this request's token counts."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


def _token_ids(name: str, ids) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {ids!r:.80}")
    ids = list(ids)
    if any(not _is_int(t) or t < 0 for t in ids):
        raise ValueError(f"{name} must be ints >= 0, got {ids!r:.80}")
    return ids


def check_prompt_logprob_entries(entries: int) -> None:
    """ValueError when a request (all its prompts and choices) asks for more prompt-logprob
    entries than :data:`MAX_PROMPT_LOGPROB_ENTRIES`."""
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise ValueError(f"prompt_logprobs: this request asks for {entries} prompt-logprob "
                         f"entries ((k + 1) per prompt token, in every choice), more than the "
                         f"{MAX_PROMPT_LOGPROB_ENTRIES} a request may; ask for fewer")


def _float32(x: float) -> float:
    """``x`` rounded to float32, as the sampler's kernels see it (inf past float32's range)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.inf


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)

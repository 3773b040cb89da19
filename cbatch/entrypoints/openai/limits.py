"""What one API request may ask for: the caps on its list-valued fields, so that the work a
request costs the server is bounded and proportional to what it gets back.

vLLM's caps where it has them (its v1 GPU worker's ``MAX_NUM_STOP_TOKEN_IDS``,
``MAX_NUM_LOGIT_BIAS_TOKENS``, ``MAX_NUM_ALLOWED_TOKEN_IDS``); cbatch's own, documented here,
where it has none.  A field beyond its cap is a 400 that names it (:func:`check_length`
raises a ValueError, which a pydantic validator turns into that 400).  The body as a whole
is bounded before it is parsed (:data:`cbatch.entrypoints.openai.guard.MAX_BODY_VALUES`);
these caps bound what each field costs after it.
"""

from __future__ import annotations

from collections.abc import Sized

MAX_PROMPTS = 1024  # prompts in one /v1/completions request (each admitted with its n choices)
# choices of one prompt: n, and completions' best_of candidates (each one a request of the
# engine's, built on the event loop: bounded before any is built)
MAX_CHOICES = 32
MAX_MESSAGES = 2048  # chat messages in one request (the template renders them on the loop)
MAX_STOP = 128  # stop strings (each one is searched for in every new piece of text)
MAX_STOP_TOKEN_IDS = 128  # vLLM's MAX_NUM_STOP_TOKEN_IDS
MAX_LOGIT_BIAS = 1024  # logit_bias entries: vLLM's MAX_NUM_LOGIT_BIAS_TOKENS
MAX_ALLOWED_TOKEN_IDS = 1024  # vLLM's MAX_NUM_ALLOWED_TOKEN_IDS
MAX_BAD_WORDS = 128  # bad_words (each is tokenised and matched at every step)
# bad_words' characters, all words together: each word's tokens are compared with the end of
# the output at every step of every choice
MAX_BAD_WORDS_CHARS = 16384

# field -> its cap, for the checks and the README's table
LIMITS = {
    "prompt": MAX_PROMPTS,
    "messages": MAX_MESSAGES,
    "stop": MAX_STOP,
    "stop_token_ids": MAX_STOP_TOKEN_IDS,
    "logit_bias": MAX_LOGIT_BIAS,
    "allowed_token_ids": MAX_ALLOWED_TOKEN_IDS,
    "bad_words": MAX_BAD_WORDS,
}


def check_length(field: str, values: Sized | None) -> None:
    """ValueError naming ``field`` when ``values`` (a list or dict, or None) holds more items
    than :data:`LIMITS` allows it; a pydantic validator's ValueError becomes a 400 that names
    the field."""
    if values is not None and len(values) > LIMITS[field]:
        raise ValueError(f"{field} has {len(values)} items; this server takes at most "
                         f"{LIMITS[field]} per request")
    if field == "bad_words" and values is not None:
        chars = sum(len(w) for w in values if isinstance(w, str))
        if chars > MAX_BAD_WORDS_CHARS:
            raise ValueError(f"bad_words has {chars} characters in all; this server takes at "
                             f"most {MAX_BAD_WORDS_CHARS} per request")

"""From sampled tokens to what a caller sees: stop conditions and request outputs."""

from __future__ import annotations

from cbatch.core.detokenizer import detokenizer_for
from cbatch.core.sequence import Sequence
from cbatch.outputs import RequestMetrics, RequestOutput
from cbatch.tokenizer import Tokenizer


class OutputProcessor:
    """Decides when a request stops and makes its :class:`RequestOutput` snapshots."""

    def __init__(self, tokenizer: Tokenizer, eos_token_id: int | tuple[int, ...] | None):
        self.tokenizer = tokenizer
        # a config may name several (Llama 3, Qwen2.5 chat models) or none
        self.eos_token_ids = frozenset(eos_token_id if isinstance(eos_token_id, tuple)
                                       else () if eos_token_id is None else (eos_token_id,))

    def stop_reason(self, seq: Sequence, token: int) -> str | None:
        """Why ``seq`` ends now that ``token`` joined it ("stop", "length"), or None."""
        params = seq.params
        num_output = len(seq.token_ids) - seq.num_prompt_tokens
        if num_output < params.min_tokens:  # (EOS and stop ids were banned from its draws)
            return None
        if token in params.stop_token_set or (
                not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if params.stop and detokenizer_for(seq, self.tokenizer).hits_stop():
            return "stop"
        if num_output >= params.max_tokens:
            return "length"
        return None

    def outputs(self, changed: list[Sequence]) -> list[RequestOutput]:
        """Snapshots of the sequences that changed: every streamed one, and the others once
        they finish."""
        return [self.request_output(s) for s in changed if s.stream or s.is_finished]

    def request_output(self, seq: Sequence) -> RequestOutput:
        out = seq.output_token_ids  # a copy: the output is a snapshot
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=out,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            metrics=RequestMetrics(seq.arrival_time, seq.first_scheduled_time,
                                   seq.first_token_time, seq.finished_time, len(out),
                                   seq.num_preemptions),
            logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
            prompt_logprobs=(list(seq.prompt_logprobs or [None])
                             if seq.params.prompt_logprobs is not None else None),
            # a request that failed is not decoded again (its text is empty)
            text_of=None if seq.error else detokenizer_for(seq, self.tokenizer).text_at,
            error=seq.error,
        )

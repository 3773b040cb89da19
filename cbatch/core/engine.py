"""The continuous-batching engine: add requests at any time, step, stream outputs.

A step is launched (scheduled, built, sent to the device) and later resolved (its sampled
tokens read on the host, stop conditions checked, outputs made).  Synchronously, each step
is resolved as soon as it is launched.  With async scheduling (vLLM v1's), step n+1 is
launched before step n is resolved, so the host's scheduling and batch building overlap the
device's work: the tokens step n samples are in flight (``Sequence.num_inflight``) while
step n+1 is planned, and reach step n+1 on the device.  A request that step n ends on a stop
token or string has already been given a row in step n+1; that row's result is dropped (one
that ends on ``max_tokens`` is known to end and gets none).  So the two modes differ only in
which rows share a step: a request's tokens are the same whenever its logits do not depend
on its batch-mates, which ``batch_invariant=True`` guarantees (the tests also find them the
same without it, greedy and seeded, on the CPU).

With ``speculative_config``, ``spec_decoder`` (:mod:`cbatch.core.spec_decode`) drafts for
each decoding request that speculates before the step is scheduled; the step verifies the
drafts, and the request gains 1 to k + 1 tokens when it is resolved, each checked for a stop
condition in turn (the rest dropped).  Such an engine runs synchronously: it drafts from the
tokens the last step accepted, so it resolves each step before it launches the next.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import gc
import itertools
import time
from dataclasses import dataclass

import torch
from torch import nn

from cbatch.logger import init_logger
from cbatch.config import DEFAULT_MODEL, EngineConfig
from cbatch.core.step_outputs import SampledTokens
from cbatch.core.output_processor import OutputProcessor
from cbatch.core.scheduler import ScheduledSequence, Scheduler
from cbatch.core.sequence import Sequence, SequenceStatus
from cbatch.core.spec_decode.decoder import SpeculativeDecoder
from cbatch.core.static import StaticScheduler
from cbatch.core.stats import EngineStats, StepCounters
from cbatch.core.structured_output import ConstraintError, StructuredOutputs
from cbatch.core.worker import build_worker, weight_place
from cbatch.models.loader import load_model_and_tokenizer
from cbatch.outputs import RequestOutput
from cbatch.sampling_params import SamplingParams
from cbatch.tokenizer import ByteTokenizer, prompt_token_ids, tokenize_bad_words

logger = init_logger(__name__)


def freeze_long_lived_objects() -> None:
    """Move every object alive now (the model, the tokenizer, the modules of torch and
    transformers) out of the garbage collector's sight, as vLLM does after start-up: a full
    collection then walks only what the serving loop allocates (benchmarks/NOTES.md, "Host side
    of a step").  At exit they are handed back, so that the last collection (and
    extensions' leak checks) sees them."""
    global _unfreeze_registered
    gc.collect()
    gc.freeze()
    if not _unfreeze_registered:
        atexit.register(gc.unfreeze)
        _unfreeze_registered = True


_unfreeze_registered = False


@dataclass
class LaunchedStep:
    """A step sent to the device whose sampled tokens the host has not read yet."""

    scheduled: list[ScheduledSequence]
    tokens: SampledTokens
    launched_at: float  # when it was sent (perf_counter)
    # a row's rules (a grammar, bad words) need its token on the host before the next step
    needs_output_on_host: bool = False


class Engine:
    """Continuous batching over a paged KV cache.

    >>> engine = Engine("random:tiny", max_num_seqs=4)
    >>> rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    >>> while engine.has_unfinished_requests():
    ...     outs = engine.step()
    >>> outs[-1].finish_reason
    'length'
    """

    def __init__(self, model: str | nn.Module = DEFAULT_MODEL, **kwargs):
        start, built = time.perf_counter(), isinstance(model, nn.Module)
        if built:  # an engine around a model already built
            config = EngineConfig.for_model(model, **kwargs)
            tokenizer = ByteTokenizer(model.config.eos_token_id)
        else:
            config = EngineConfig(model=model, **kwargs)
            torch.manual_seed(config.seed)
            model, tokenizer = load_model_and_tokenizer(config, weight_place(config.device))
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.max_model_len = config.max_model_len or model.config.max_model_len
        if self.max_model_len > model.config.max_model_len:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context "
                             f"length ({model.config.max_model_len})")
        static = config.scheduling_policy == "static"
        max_tokens = (config.max_num_seqs * model.config.max_model_len if static
                      else config.max_num_batched_tokens)
        # the model, its KV pool, block manager and runner (kept under their own names too)
        self.worker = build_worker(model, config, max_tokens, config.enable_prefix_caching)
        self.kv_cache, self.block_manager, self.runner = (
            self.worker.kv_cache, self.worker.block_manager, self.worker.runner)
        if static:
            self.scheduler = StaticScheduler(self.block_manager, config.max_num_seqs,
                                             max_tokens)
        else:
            self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, max_tokens,
                                       config.scheduling_policy)
        self.output_processor = OutputProcessor(tokenizer, model.config.eos_token_id)
        self.structured = StructuredOutputs(tokenizer, model.config.vocab_size,
                                            model.config.eos_token_id, config)
        self.async_scheduling = config.use_async_scheduling
        self.spec_decoder = None if config.speculative_config is None else SpeculativeDecoder(
            config, model.config.vocab_size, self.max_model_len)
        self._in_flight: collections.deque[LaunchedStep] = collections.deque()
        self._requests: dict[str, Sequence] = {}  # unfinished
        self._aborted: list[Sequence] = []  # reported by the next step()
        self._order = itertools.count()
        self._counters = StepCounters()
        # scheduled sequences per step, recorded only once set to a list (LLM does; a
        # long-running server does not)
        self.occupancy_trace: list[int] | None = None
        freeze_long_lived_objects()
        if not built:  # loaded by name: the second of its two log lines
            logger.info("model ready in %.1f s (%s)", time.perf_counter() - start,
                        self.worker.summary())

    # -------------------------------------------------------------- requests

    def validate_request(self, prompt: str | list[int], params: SamplingParams | None = None
                         ) -> list[int]:
        """The prompt's token ids if the request can run here, else a ValueError/TypeError
        naming the problem; queues nothing (``LLM.generate`` checks a whole call first)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        cfg = self.model.config
        ids = prompt_token_ids(prompt, self.tokenizer, cfg.vocab_size, self.max_model_len,
                               params.max_tokens, params.truncate_prompt_tokens)
        params.check_logprobs(len(ids), cfg.vocab_size, self.config.max_logprobs,
                              self.config.max_prompt_logprobs)
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            # (ids the sampler indexes the logits with: one outside them would fail the step)
            bad = [t for t in getattr(params, name) or () if t >= cfg.vocab_size]
            if bad:
                raise ValueError(f"{name} has token ids outside the vocabulary [0, "
                                 f"{cfg.vocab_size}): {bad[:5]}")
        if params.structured_outputs is not None:  # parsed now; compiled in a worker
            self.structured.check(params)
        need = self.block_manager.blocks_for(len(ids) + params.max_tokens)
        if need > self.block_manager.num_blocks:
            raise ValueError(f"request needs {need} KV blocks but the pool has only "
                             f"{self.block_manager.num_blocks}; raise num_blocks or "
                             "kv_cache_memory, or lower max_tokens")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, request_id: str | None = None, stream: bool = True,
                    bad_words_token_ids: list[tuple[int, ...]] | None = None) -> str:
        """Queue a request (a string, or token ids); returns its id.  ``stream=False``: the
        request's output comes only once, when it finishes (no snapshot at every step).
        ``bad_words_token_ids``: ``tokenize_bad_words(params.bad_words)``, when the caller
        tokenised them already (once for all the choices of a request, off this thread)."""
        params = SamplingParams() if params is None else params
        if getattr(params, "n", 1) > 1:  # (a wrong type is validate_request's to name)
            raise ValueError(f"n={params.n}: a request of Engine.add_request is one "
                             "completion; LLM.generate and the server run n (one request "
                             "per choice)")
        ids = self.validate_request(prompt, params)
        order = next(self._order)
        request_id = str(order) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self.config.seed * 7919 + order
        if bad_words_token_ids is None:
            bad_words_token_ids = tokenize_bad_words(params.bad_words, self.tokenizer)
        seq = Sequence(request_id, ids, params, order, priority, seed, stream,
                       bad_words_token_ids=bad_words_token_ids)
        self._requests[request_id] = seq
        if params.structured_outputs is not None:
            self.structured.hold(seq)  # scheduled once its grammar is compiled
        else:
            self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str, report: bool = True) -> None:
        """Stop an unfinished request; its output (reason "abort") comes from the next step
        (``report=False``: no output, e.g. for a caller cleaning up after an error)."""
        seq = self._requests.pop(str(request_id), None)
        if seq is None:
            raise KeyError(f"no unfinished request with id {request_id!r}")
        self.scheduler.remove(seq)
        self.structured.remove(seq)
        self._finish(seq, "abort")
        if report:
            self._aborted.append(seq)

    def fail_output(self, out: RequestOutput, error: Exception) -> RequestOutput:
        """The final output, reason "error", of the request of ``out`` whose processing raised
        ``error`` (reading its text, say): the request alone ends (its blocks are freed now if
        it was running) and the engine serves on."""
        seq = self._requests.pop(out.request_id, None)
        if seq is not None:
            self._fail(seq, error)
        else:
            logger.error("request %s failed: %s", out.request_id, _describe(error),
                         exc_info=error)
        return dataclasses.replace(out, finished=True, finish_reason="error", text_of=None,
                                   error=_describe(error))

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._aborted)

    def is_unfinished(self, request_id: str) -> bool:
        return str(request_id) in self._requests

    # -------------------------------------------------------------- stepping

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.runner.release(seq.request_id)
        if self.spec_decoder is not None:
            self.spec_decoder.release(seq.request_id)
        seq.status = SequenceStatus.FINISHED
        seq.num_inflight = 0  # a later step's sample for it is dropped
        seq.finish_reason = reason
        seq.finished_time = time.perf_counter()
        self._counters.num_finished += 1

    def _fail(self, seq: Sequence, error: Exception) -> None:
        """End an unfinished sequence (already out of ``_requests``) whose own processing
        failed: an error of one request never reaches the step that all of them share."""
        if isinstance(error, ConstraintError):  # the request's own fault: no traceback
            logger.warning("request %s failed: %s", seq.request_id, _describe(error))
        else:
            logger.error("request %s failed: %s", seq.request_id, _describe(error),
                         exc_info=error)
        self.scheduler.remove(seq)
        self._finish(seq, "error")
        seq.error = _describe(error)

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the outputs of the requests that changed (with async
        scheduling: in the step launched before this one)."""
        start = self._counters.start()
        changed, self._aborted = self._aborted, []
        changed += self._admit_compiled()
        while self._in_flight and self._in_flight[-1].needs_output_on_host:
            # a grammar's next bitmask, or bad words, need the token in flight: read it first
            changed += self._resolve(self._in_flight.popleft())
        launched = self._launch()
        if launched is not None:
            self._in_flight.append(launched)
        elif not self._in_flight and not changed:  # idle but for grammars being compiled
            self.structured.wait(timeout=0.05)
        keep = 1 if self.async_scheduling and launched is not None else 0
        # every step older than the newest is resolved, and all of them when nothing is left
        # to run (their rows then belong to finished requests only)
        while self._in_flight and (len(self._in_flight) > keep or not self._requests):
            changed += self._resolve(self._in_flight.popleft())
        outputs = self.output_processor.outputs(changed)
        self._counters.elapsed += self._counters.tick("postprocess") - start
        return outputs

    def _launch(self) -> LaunchedStep | None:
        """Schedule a step and send it to the device; the scheduled sequences advance by
        their new tokens, and those that sample get an in-flight token."""
        if self.spec_decoder is not None:
            self.spec_decoder.propose(self.scheduler.running)
        schedule = self.scheduler.schedule()
        if schedule.is_empty:
            self._counters.tick("schedule")
            return None
        if schedule.block_copies:
            self.kv_cache.copy_blocks(schedule.block_copies)
        t = self._counters.tick("schedule")
        for item in schedule.scheduled:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = t
        batch = self.runner.prepare(schedule.scheduled, pad_to=schedule.pad_to)
        self._counters.tick("prepare")
        launched_at = time.perf_counter()
        tokens = self.runner.execute(batch, schedule.scheduled)
        for item, samples_now in zip(schedule.scheduled, tokens.samples):
            seq = item.seq
            n = item.num_new_tokens - len(item.draft_token_ids)  # drafts count once accepted
            if n > 1 or seq.num_output_tokens == 0:
                self._counters.num_prefill_tokens += n
            seq.num_computed_tokens += n
            seq.num_inflight += samples_now
        self._counters.tick("execute")
        self._counters.num_steps += 1
        self._counters.occupancy_sum += len(schedule.scheduled) / self.config.max_num_seqs
        if self.occupancy_trace is not None:
            self.occupancy_trace.append(len(schedule.scheduled))
        return LaunchedStep(schedule.scheduled, tokens, launched_at, self.async_scheduling and any(
            item.seq.params.needs_output_on_host for item in schedule.scheduled))

    def _admit_compiled(self) -> list[Sequence]:
        """Schedule the requests whose grammar is now compiled; fail those whose grammar
        did not compile (returned: they changed)."""
        failed = []
        for seq, error in self.structured.ready():
            if error is None:
                self.scheduler.add(seq)
            elif self._requests.pop(seq.request_id, None) is not None:
                self._fail(seq, error)
                failed.append(seq)
        return failed

    def _resolve(self, step: LaunchedStep) -> list[Sequence]:
        """Read a launched step's tokens (waiting for the device) and apply them: append,
        check stop conditions, finish.  Returns the sequences that changed."""
        self._counters.tick("postprocess")
        tokens, logprobs = step.tokens.wait()
        prompt_logprobs = step.tokens.prompt_logprobs()
        now = self._counters.tick("execute")
        offsets = step.tokens.offsets  # None: row i's token is tokens[i]
        if offsets is not None:  # it verified drafts
            self.spec_decoder.step_done(now - step.launched_at)
        changed = []
        for i, item in enumerate(step.scheduled):
            seq = item.seq
            if i in step.tokens.failed:  # its own rules or draw raised: it alone ends
                if self._requests.pop(seq.request_id, None) is not None:
                    self._fail(seq, step.tokens.failed[i])
                    changed.append(seq)
                continue
            if prompt_logprobs is not None and prompt_logprobs[i] and not seq.is_finished:
                seq.prompt_logprobs += [None] * (not seq.prompt_logprobs) + prompt_logprobs[i]
            if not step.tokens.samples[i] or seq.is_finished:
                continue  # mid-prefill, or ended (stopped, aborted) since this step began
            first = i if offsets is None else offsets[i]
            new = [tokens[first]]
            if item.draft_token_ids:
                new = self.spec_decoder.accept(seq.request_id, item.draft_token_ids,
                                               tokens[first:offsets[i + 1]])
            seq.num_inflight -= 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            lp = logprobs[first] if logprobs is not None else None  # (none with drafts)
            for j, token in enumerate(new):
                if j:  # the draft before this token was accepted: its K/V stand
                    seq.num_computed_tokens += 1
                if self._append(seq, token, lp):
                    break  # finished: the tokens after the one that ended it are dropped
            changed.append(seq)
        self._counters.tick("postprocess")
        return changed

    def _append(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> bool:
        """Add a sampled token to ``seq`` and check its stop conditions; True when it ended
        ``seq`` (finished, or failed)."""
        seq.token_ids.append(token)
        self._counters.num_output_tokens += 1
        try:  # what can fail for this request alone: its logprobs, its stop strings
            if logprobs is not None:
                seq.output_logprobs.append(logprobs)
            if seq.grammar is not None and seq.grammar.accept(token):
                reason = "stop"  # its grammar is complete (even at max_tokens)
            else:
                reason = self.output_processor.stop_reason(seq, token)
        except Exception as exc:
            del self._requests[seq.request_id]
            self._fail(seq, exc)
            return True
        if reason is not None:
            self.scheduler.remove(seq)
            del self._requests[seq.request_id]
            self._finish(seq, reason)
        return reason is not None

    def stats(self) -> EngineStats:
        """Each part's counters: the steps', the scheduler's, the worker's, speculation's."""
        spec = {} if self.spec_decoder is None else self.spec_decoder.stats()
        return EngineStats(**self._counters.stats(), **self.scheduler.stats(),
                           **self.worker.stats(), **spec)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"

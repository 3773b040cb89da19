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
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import gc
import itertools
import logging
import time
from dataclasses import dataclass

import torch

from cbatch.config import EngineConfig, GPT2Config
from cbatch.core.block_manager import BlockManager
from cbatch.core.model_runner import ModelRunner, SampledTokens
from cbatch.core.scheduler import ScheduledSequence, Scheduler
from cbatch.core.sequence import Sequence, SequenceStatus
from cbatch.core.static import StaticScheduler
from cbatch.detokenizer import detokenizer_for
from cbatch.kv_cache import KVCache, bytes_per_token
from cbatch.metrics import EngineStats, RequestMetrics
from cbatch.models.gpt2 import GPT2LMHeadModel, load_model
from cbatch.outputs import RequestOutput
from cbatch.sampling_params import SamplingParams
from cbatch.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

_CPU_DEFAULT_KV_BYTES = 1 << 30
logger = logging.getLogger(__name__)


def load_model_and_tokenizer(config: EngineConfig) -> tuple[GPT2LMHeadModel, Tokenizer]:
    model = load_model(config.model, config.device, config.torch_dtype, config.seed,
                       config.attention_backend)
    return model, load_tokenizer(config.model, config.tokenizer, model.config.eos_token_id)


def config_for_model(model: GPT2LMHeadModel, **kwargs) -> EngineConfig:
    """The engine config of an engine around an already built model (its device, dtype and
    attention backend)."""
    for name in ("device", "dtype", "attention_backend"):
        if name in kwargs:
            raise ValueError(f"{name} comes from the model given to the engine; got {name}=")
    kwargs.setdefault("batch_invariant", model.batch_invariant)
    return EngineConfig(model="<model object>", device=str(model.device),
                        dtype=str(model.dtype).removeprefix("torch."),
                        attention_backend=model.attention_backend, **kwargs)


def kv_cache_blocks(config: EngineConfig, model: GPT2LMHeadModel) -> int:
    """Blocks for the KV cache: num_blocks, else kv_cache_memory, else a default that holds
    max_num_seqs full-length sequences (capped at 1 GiB on the CPU, half the free memory on a
    GPU)."""
    if config.num_blocks is not None:
        return config.num_blocks
    per_block = bytes_per_token(model.config, config.torch_dtype) * config.block_size
    device = torch.device(config.device)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    mem = config.kv_cache_memory
    if isinstance(mem, float):
        if free is None:
            raise ValueError("a fractional kv_cache_memory needs a CUDA device; give bytes")
        mem = int(mem * free)
    if mem is None:
        want = config.max_num_seqs * model.config.n_positions // config.block_size + 1
        cap = free // 2 if free is not None else _CPU_DEFAULT_KV_BYTES
        return max(1, min(want, cap // per_block))
    if mem < per_block:
        raise ValueError(f"kv_cache_memory={mem} bytes holds no block ({per_block} bytes)")
    return mem // per_block


def model_identity(config: EngineConfig) -> str:
    """What decides the K/V of a token sequence besides its tokens: the weights (a random
    model's depend on the seed) and the dtype.  Prefix-cache hashes start from it."""
    weights = f"{config.model}@seed={config.seed}" if config.model.startswith("random:") \
        else config.model
    return f"{weights}|{config.dtype}"


def freeze_long_lived_objects() -> None:
    """Move every object alive now (the model, the tokenizer, the modules of torch and
    transformers) out of the garbage collector's sight, as vLLM does after start-up: a full
    collection then walks only what the serving loop allocates.  Measured on the 2-core CPU
    with 256 running sequences of a tiny model: 7.7 -> 5.9 ms per step.  At exit they are
    handed back, so that the last collection (and extensions' leak checks) sees them."""
    global _unfreeze_registered
    gc.collect()
    gc.freeze()
    if not _unfreeze_registered:
        atexit.register(gc.unfreeze)
        _unfreeze_registered = True


_unfreeze_registered = False


def prompt_token_ids(prompt: str | list[int], params: SamplingParams, tokenizer: Tokenizer,
                     config: GPT2Config) -> list[int]:
    """A prompt (a string or a list of token ids) as token ids that fit the model with
    ``params.max_tokens`` more; the one check of a prompt that every engine runs."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)):
        ids = list(prompt)
    else:
        raise TypeError("a prompt is a string or a list of token ids, got "
                        f"{type(prompt).__name__} {prompt!r:.40}")
    if not ids:
        raise ValueError("prompt is empty")
    if len(ids) + params.max_tokens > config.n_positions:  # before reading a long list
        raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                         f"= {len(ids) + params.max_tokens} exceeds the model's "
                         f"n_positions ({config.n_positions})")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)
           or not 0 <= t < config.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be ints in [0, {config.vocab_size}), "
                         f"got {bad[:5]}")
    return ids


def request_output(seq: Sequence, tokenizer: Tokenizer) -> RequestOutput:
    out = seq.output_token_ids  # a copy: the output is a snapshot
    failed = seq.finish_reason == "error"  # its text is not decoded again
    return RequestOutput(
        request_id=seq.request_id,
        prompt_token_ids=seq.prompt_token_ids,
        token_ids=out,
        finished=seq.is_finished,
        finish_reason=seq.finish_reason,
        metrics=RequestMetrics(seq.arrival_time, seq.first_scheduled_time,
                               seq.first_token_time, seq.finished_time, len(out),
                               seq.num_preemptions),
        logprobs=list(seq.output_logprobs) if seq.params.logprobs else None,
        detokenizer=None if failed else detokenizer_for(seq, tokenizer),
        error=seq.error,
    )


@dataclass
class LaunchedStep:
    """A step sent to the device whose sampled tokens the host has not read yet."""

    scheduled: list[ScheduledSequence]
    tokens: SampledTokens


class Engine:
    """Continuous batching over a paged KV cache.

    >>> engine = Engine("random:tiny", max_num_seqs=4)
    >>> rid = engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    >>> while engine.has_unfinished_requests():
    ...     outs = engine.step()
    >>> outs[-1].finish_reason
    'length'
    """

    def __init__(self, model: str | GPT2LMHeadModel = "random:gpt2", **kwargs):
        if isinstance(model, GPT2LMHeadModel):  # an engine around a model already built
            self.config = config_for_model(model, **kwargs)
            self.model, self.tokenizer = model, ByteTokenizer(model.config.eos_token_id)
        else:
            self.config = EngineConfig(model=model, **kwargs)
            torch.manual_seed(self.config.seed)
            self.model, self.tokenizer = load_model_and_tokenizer(self.config)
        config = self.config
        self.model.set_batch_invariant(config.batch_invariant)
        num_blocks = kv_cache_blocks(config, self.model)
        self.kv_cache = KVCache(self.model.config, num_blocks, config.block_size,
                                config.torch_dtype, config.device)
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          config.enable_prefix_caching,
                                          cache_salt=model_identity(config))
        max_tokens = config.max_num_batched_tokens
        if config.scheduling_policy == "static":
            max_tokens = config.max_num_seqs * self.model.config.n_positions
            self.scheduler = StaticScheduler(self.block_manager, config.max_num_seqs,
                                             max_tokens)
        else:
            self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, max_tokens,
                                       config.scheduling_policy)
        on_cuda = torch.device(config.device).type == "cuda"  # what None means for a switch
        self.runner = ModelRunner(self.model, self.kv_cache, config.max_num_seqs, max_tokens,
                                  on_cuda if config.cuda_graphs is None else config.cuda_graphs)
        self.async_scheduling = (on_cuda if config.async_scheduling is None
                                 else config.async_scheduling)
        self._in_flight: collections.deque[LaunchedStep] = collections.deque()
        self._requests: dict[str, Sequence] = {}  # unfinished
        self._aborted: list[Sequence] = []  # reported by the next step()
        self._order = itertools.count()
        self._num_steps = self._num_finished = 0
        self._num_prefill_tokens = self._num_output_tokens = 0
        self._elapsed = self._occupancy_sum = 0.0
        self._phase_s = dict.fromkeys(("schedule", "prepare", "execute", "postprocess"), 0.0)
        self._clock = 0.0  # when the phase being timed began (see _tick)
        self.occupancy_trace: list[int] = []  # scheduled sequences per step
        freeze_long_lived_objects()

    # -------------------------------------------------------------- requests

    def validate_request(self, prompt: str | list[int], params: SamplingParams | None = None
                         ) -> list[int]:
        """The prompt's token ids if the request can run here, else a ValueError/TypeError
        naming the problem; queues nothing (``LLM.generate`` checks a whole call first)."""
        params = SamplingParams() if params is None else params
        ids = prompt_token_ids(prompt, params, self.tokenizer, self.model.config)
        max_logprobs = min(self.config.max_logprobs, self.model.config.vocab_size)
        if params.logprobs is not None and params.logprobs > max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} is more than this engine's "
                             f"max_logprobs ({max_logprobs})")
        need = self.block_manager.blocks_for(len(ids) + params.max_tokens)
        if need > self.block_manager.num_blocks:
            raise ValueError(f"request needs {need} KV blocks but the pool has only "
                             f"{self.block_manager.num_blocks}; raise num_blocks or "
                             "kv_cache_memory, or lower max_tokens")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, request_id: str | None = None, stream: bool = True
                    ) -> str:
        """Queue a request (a string, or token ids); returns its id.  ``stream=False``: the
        request's output comes only once, when it finishes (no snapshot at every step)."""
        params = SamplingParams() if params is None else params
        ids = self.validate_request(prompt, params)
        order = next(self._order)
        request_id = str(order) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self.config.seed * 7919 + order
        seq = Sequence(request_id, ids, params, order, priority, seed, stream)
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str, report: bool = True) -> None:
        """Stop an unfinished request; its output (reason "abort") comes from the next step
        (``report=False``: no output, e.g. for a caller cleaning up after an error)."""
        seq = self._requests.pop(str(request_id), None)
        if seq is None:
            raise KeyError(f"no unfinished request with id {request_id!r}")
        self.scheduler.remove(seq)
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
        return dataclasses.replace(out, finished=True, finish_reason="error", detokenizer=None,
                                   error=_describe(error))

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._aborted)

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams],
                 priorities: list[int] | None = None, progress=None, on_output=None
                 ) -> list[RequestOutput]:
        """Run ``prompts`` to completion (the one generation loop: ``LLM.generate`` and
        ``GPT2LMHeadModel.generate`` come here); outputs in prompt order.

        All or nothing: every prompt and parameter is checked before any request is queued,
        and if anything fails mid-way (an error in a step, KeyboardInterrupt), every request
        of this call is aborted and the exception propagates, leaving the engine as it was.
        ``progress(1)`` is called per finished request, ``on_output(output)`` for every
        output of this call's requests as it streams (each step's snapshot).
        """
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        priorities = [0] * len(prompts) if priorities is None else list(priorities)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        token_ids = [self.validate_request(p, sp) for p, sp in zip(prompts, params_list)]
        ids: list[str] = []
        done: dict[str, RequestOutput] = {}
        try:
            for prompt_ids, sp, prio in zip(token_ids, params_list, priorities):
                ids.append(self.add_request(prompt_ids, sp, prio,
                                            stream=on_output is not None))
            mine = set(ids)
            while len(done) < len(ids):
                for out in self.step():
                    if on_output is not None and out.request_id in mine:
                        on_output(out)
                    if out.finished and out.request_id not in done:
                        done[out.request_id] = out
                        if progress is not None:
                            progress(1)
        except BaseException:
            for rid in ids:
                if rid in self._requests:
                    self.abort(rid, report=False)
            raise
        return [done[i] for i in ids]

    # -------------------------------------------------------------- stepping

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.num_inflight = 0  # a later step's sample for it is dropped
        seq.finish_reason = reason
        seq.finished_time = time.perf_counter()
        self._num_finished += 1

    def _fail(self, seq: Sequence, error: Exception) -> None:
        """End an unfinished sequence (already out of ``_requests``) whose own processing
        failed: an error of one request never reaches the step that all of them share."""
        logger.error("request %s failed: %s", seq.request_id, _describe(error), exc_info=error)
        self.scheduler.remove(seq)
        self._finish(seq, "error")
        seq.error = _describe(error)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if token in params.stop_token_ids or (
                not params.ignore_eos and token == self.model.config.eos_token_id):
            return "stop"
        if params.stop and detokenizer_for(seq, self.tokenizer).hits_stop():
            return "stop"
        if len(seq.token_ids) - seq.num_prompt_tokens >= params.max_tokens:
            return "length"
        return None

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the outputs of the requests that changed (with async
        scheduling: in the step launched before this one)."""
        start = self._clock = time.perf_counter()
        changed, self._aborted = self._aborted, []
        launched = self._launch()
        if launched is not None:
            self._in_flight.append(launched)
        keep = 1 if self.async_scheduling and launched is not None else 0
        # every step older than the newest is resolved, and all of them when nothing is left
        # to run (their rows then belong to finished requests only)
        while self._in_flight and (len(self._in_flight) > keep or not self._requests):
            changed += self._resolve(self._in_flight.popleft())
        outputs = [request_output(s, self.tokenizer) for s in changed
                   if s.stream or s.is_finished]
        self._elapsed += self._tick("postprocess") - start
        return outputs

    def _tick(self, phase: str) -> float:
        """Charge the time since the last tick to ``phase``; returns the time now."""
        now = time.perf_counter()
        self._phase_s[phase] += now - self._clock
        self._clock = now
        return now

    def _launch(self) -> LaunchedStep | None:
        """Schedule a step and send it to the device; the scheduled sequences advance by
        their new tokens, and those that sample get an in-flight token."""
        schedule = self.scheduler.schedule()
        if schedule.is_empty:
            self._tick("schedule")
            return None
        if schedule.block_copies:
            self.kv_cache.copy_blocks(schedule.block_copies)
        t = self._tick("schedule")
        for item in schedule.scheduled:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = t
        batch = self.runner.prepare(schedule.scheduled, pad_to=schedule.pad_to)
        self._tick("prepare")
        tokens = self.runner.execute(batch, schedule.scheduled)
        for item, samples_now in zip(schedule.scheduled, tokens.samples):
            seq = item.seq
            if item.num_new_tokens > 1 or seq.num_output_tokens == 0:
                self._num_prefill_tokens += item.num_new_tokens
            seq.num_computed_tokens += item.num_new_tokens
            seq.num_inflight += samples_now
        self._tick("execute")
        self._num_steps += 1
        self._occupancy_sum += len(schedule.scheduled) / self.config.max_num_seqs
        self.occupancy_trace.append(len(schedule.scheduled))
        return LaunchedStep(schedule.scheduled, tokens)

    def _resolve(self, step: LaunchedStep) -> list[Sequence]:
        """Read a launched step's tokens (waiting for the device) and apply them: append,
        check stop conditions, finish.  Returns the sequences that changed."""
        self._tick("postprocess")
        tokens, logprobs = step.tokens.wait()
        now = self._tick("execute")
        changed = []
        for i, (item, token) in enumerate(zip(step.scheduled, tokens)):
            seq = item.seq
            if not step.tokens.samples[i] or seq.is_finished:
                continue  # mid-prefill, or ended (stopped, aborted) since this step began
            seq.num_inflight -= 1
            seq.token_ids.append(token)
            self._num_output_tokens += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            try:  # what can fail for this request alone: its logprobs, its stop strings
                if logprobs is not None and logprobs[i] is not None:
                    seq.output_logprobs.append(logprobs[i])
                reason = self._stop_reason(seq, token)
            except Exception as exc:
                del self._requests[seq.request_id]
                self._fail(seq, exc)
                reason = None
            if reason is not None:
                self.scheduler.remove(seq)
                del self._requests[seq.request_id]
                self._finish(seq, reason)
            changed.append(seq)
        self._tick("postprocess")
        return changed

    def stats(self) -> EngineStats:
        return EngineStats(
            num_steps=self._num_steps,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_finished=self._num_finished,
            num_preemptions=self.scheduler.num_preemptions,
            num_prefill_tokens=self._num_prefill_tokens,
            num_output_tokens=self._num_output_tokens,
            elapsed=self._elapsed,
            phase_s=dict(self._phase_s),
            kv_cache_usage=self.block_manager.usage,
            mean_batch_occupancy=self._occupancy_sum / max(1, self._num_steps),
            graph_capture_s=self.runner.graph_capture_s,
            graph_memory_bytes=self.runner.graph_memory_bytes,
            prefix_cache_queried_tokens=self.scheduler.num_cache_queried_tokens,
            prefix_cache_hit_tokens=self.scheduler.num_cache_hit_tokens,
        )


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"

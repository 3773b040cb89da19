"""``cbatch.LLM``: generate for a list of prompts (vLLM's offline API), and the one generation
loop that drives an :class:`~cbatch.Engine` until a set of requests is done."""

from __future__ import annotations

from typing import Callable

from tqdm.auto import tqdm

from cbatch.config import DEFAULT_MODEL
from cbatch.core.engine import Engine
from cbatch.outputs import RequestOutput
from cbatch.sampling_params import SamplingParams


class LLM:
    """Offline batched generation over an :class:`~cbatch.Engine`.

    ``scheduling_policy`` "fcfs" / "priority" / "sjf" batch continuously; "static" runs the
    static-batching baseline (:mod:`cbatch.core.static`) on the same engine.  ``model`` is a
    name or path (see :func:`cbatch.load_model`) or a model already built (e.g. a
    :class:`~cbatch.GPT2LMHeadModel`; its device, dtype and backend are the engine's); other
    keywords are those of :class:`cbatch.config.EngineConfig`.

    >>> llm = LLM("random:tiny", max_num_seqs=4)
    >>> llm.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True),
    ...              use_tqdm=False)[0].finish_reason
    'length'
    """

    def __init__(self, model=DEFAULT_MODEL, **kwargs):
        self.engine = Engine(model, **kwargs)
        self.engine.occupancy_trace = []  # offline runs are bounded: record every step
        self.tokenizer = self.engine.tokenizer

    @property
    def occupancy_trace(self) -> list[int]:
        """Scheduled sequences per step, over every step this LLM ran."""
        return self.engine.occupancy_trace

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priorities: list[int] | None = None,
                 on_output: Callable[[RequestOutput], None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; ``n`` outputs per prompt (``SamplingParams.n``, 1 by
        default), prompt-major: prompt 0's n outputs, then prompt 1's, ...

        ``prompts`` is one prompt (a string or a list of token ids) or a list of prompts;
        ``params`` one SamplingParams for all or a list, one per prompt.  ``on_output`` sees
        every output of these requests as it streams (each step's snapshot).  All or
        nothing: see :func:`generate`.
        """
        prompts = _prompt_list(prompts)
        params = SamplingParams() if params is None else params
        # requests in all (a wrong params is generate's to name)
        total = sum(getattr(p, "n", 1) for p in (
            params if isinstance(params, list) else [params] * len(prompts)))
        with tqdm(total=total, desc="generate", unit="req", disable=not use_tqdm) as bar:
            return generate(self.engine, prompts, params, priorities, progress=bar.update,
                            on_output=on_output)


def validate_prompts(engine: Engine, prompts: list, params_list: list[SamplingParams]
                     ) -> list[list[int]]:
    """Each prompt's token ids, once every prompt and its parameters are checked
    (:meth:`Engine.validate_request`); an error names the prompt it is about, by its place
    and its start, so that in a batch the user knows which one to fix."""
    token_ids = []
    for i, (prompt, sp) in enumerate(zip(prompts, params_list)):
        try:
            token_ids.append(engine.validate_request(prompt, sp))
        except (ValueError, TypeError) as e:
            which = f"prompt {i + 1} of {len(prompts)}" if len(prompts) > 1 else "prompt"
            start = repr(prompt) if len(repr(prompt)) <= 40 else repr(prompt)[:37] + "..."
            raise type(e)(f"{which} ({start}): {e}") from None
    return token_ids


def generate(engine: Engine, prompts: list, params: SamplingParams | list[SamplingParams],
             priorities: list[int] | None = None, progress: Callable[[int], object] | None = None,
             on_output: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
    """Run ``prompts`` on ``engine`` to completion (the one generation loop); outputs in
    prompt order, each prompt's ``n`` choices together (:meth:`SamplingParams.choice`).

    All or nothing: every prompt and parameter is checked before any request is queued, and
    if anything fails mid-way (an error in a step, KeyboardInterrupt), every request of this
    call is aborted and the exception propagates, leaving the engine as it was.  Requests the
    engine held before the call run on beside this call's, and run on after it (their
    outputs are not this call's: their owner steps the engine for them).
    ``progress(1)`` is called per finished request, ``on_output(output)`` for every output
    of this call's requests as it streams (each step's snapshot).
    """
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    if len(params_list) != len(prompts):
        raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
    priorities = [0] * len(prompts) if priorities is None else list(priorities)
    if len(priorities) != len(prompts):
        raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
    token_ids = validate_prompts(engine, prompts, params_list)
    requests = [(prompt_ids, sp if sp.n == 1 else sp.choice(c), prio)
                for prompt_ids, sp, prio in zip(token_ids, params_list, priorities)
                for c in range(sp.n)]
    ids: list[str] = []
    done: dict[str, RequestOutput] = {}
    try:
        for prompt_ids, sp, prio in requests:
            ids.append(engine.add_request(prompt_ids, sp, prio, stream=on_output is not None))
        mine = set(ids)
        while len(done) < len(ids):
            for out in engine.step():
                if out.request_id not in mine:  # another caller's request on this engine
                    continue
                if on_output is not None:
                    on_output(out)
                if out.finished and out.request_id not in done:
                    done[out.request_id] = out
                    if progress is not None:
                        progress(1)
    except BaseException:
        for rid in ids:
            if engine.is_unfinished(rid):
                engine.abort(rid, report=False)
        raise
    return [done[i] for i in ids]


def _prompt_list(prompts) -> list[str | list[int]]:
    """``prompts`` as a list of prompts: one string or token-id list becomes a list of one."""
    if isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and prompts
            and all(isinstance(t, int) for t in prompts)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        for i, p in enumerate(prompts):
            if not isinstance(p, (str, list, tuple)):
                raise TypeError(f"prompts[{i}] is {type(p).__name__} {p!r:.40}: prompts must "
                                "be a string, a list of token ids, or a list of those")
        return list(prompts)
    raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; "
                    f"got {type(prompts).__name__} {prompts!r:.40}")

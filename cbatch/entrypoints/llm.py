"""``cbatch.LLM``: generate for a list of prompts (vLLM's offline API)."""

from __future__ import annotations

from tqdm.auto import tqdm

from cbatch.core.engine import Engine
from cbatch.outputs import RequestOutput
from cbatch.sampling_params import SamplingParams
from cbatch.core.static import StaticBatchEngine


class LLM:
    """Offline batched generation.

    ``scheduling_policy`` "fcfs" / "priority" / "sjf" run the continuous-batching
    :class:`~cbatch.Engine`; "static" runs the :class:`~cbatch.core.static.StaticBatchEngine`
    baseline.  Other keywords are those of :class:`cbatch.config.EngineConfig`.
    """

    def __init__(self, model: str = "random:gpt2", **kwargs):
        if kwargs.get("scheduling_policy") == "static":
            self.engine = StaticBatchEngine(model, **kwargs)
        else:
            self.engine = Engine(model, **kwargs)
        self.tokenizer = self.engine.tokenizer

    @property
    def occupancy_trace(self) -> list[int]:
        return self.engine.occupancy_trace

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priorities: list[int] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; one output per prompt, in prompt order.

        ``prompts`` is one prompt (a string or a list of token ids) or a list of prompts;
        ``params`` one SamplingParams for all or a list, one per prompt.  All or nothing:
        every prompt and parameter is checked before any request is queued, and when the
        call ends early (an error in a step, KeyboardInterrupt) its requests are aborted,
        leaving the engine empty and its KV blocks free.
        """
        prompts = _prompt_list(prompts)
        params = params if params is not None else SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        priorities = [0] * len(prompts) if priorities is None else list(priorities)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        bar = tqdm(total=len(prompts), desc="generate", unit="req", disable=not use_tqdm)
        try:
            if isinstance(self.engine, StaticBatchEngine):
                return self.engine.generate(prompts, params_list, progress=bar.update)
            return self._generate_continuous(prompts, params_list, priorities, bar)
        finally:
            bar.close()

    def _generate_continuous(self, prompts: list, params_list: list[SamplingParams],
                             priorities: list[int], bar: tqdm) -> list[RequestOutput]:
        engine = self.engine
        token_ids = [engine.validate_request(p, sp) for p, sp in zip(prompts, params_list)]
        ids: list[str] = []
        done: dict[str, RequestOutput] = {}
        try:
            for prompt_ids, sp, prio in zip(token_ids, params_list, priorities):
                ids.append(engine.add_request(prompt_ids, sp, prio))
            while len(done) < len(ids):
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in done:
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

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

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priorities: list[int] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt (a string or token ids); outputs in prompt order."""
        params = params or SamplingParams()
        if isinstance(params, list) and len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        bar = tqdm(total=len(prompts), desc="generate", unit="req", disable=not use_tqdm)
        try:
            if isinstance(self.engine, StaticBatchEngine):
                return self.engine.generate(prompts, params, progress=bar.update)
            params_list = params if isinstance(params, list) else [params] * len(prompts)
            priorities = priorities or [0] * len(prompts)
            ids = [self.engine.add_request(p, sp, prio)
                   for p, sp, prio in zip(prompts, params_list, priorities)]
            done: dict[str, RequestOutput] = {}
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
            return [done[i] for i in ids]
        finally:
            bar.close()

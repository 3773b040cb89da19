"""``cbatch.LLM``: generate for a list of prompts (vLLM's offline API)."""

from __future__ import annotations

from tqdm.auto import tqdm

from cbatch.core.engine import Engine
from cbatch.outputs import RequestOutput
from cbatch.sampling_params import SamplingParams


class LLM:
    """Offline batched generation over an :class:`~cbatch.Engine`.

    ``scheduling_policy`` "fcfs" / "priority" / "sjf" batch continuously; "static" runs the
    static-batching baseline (:mod:`cbatch.core.static`) on the same engine.  ``model`` is a
    name or path (see :func:`cbatch.load_model`) or a :class:`~cbatch.GPT2LMHeadModel`; other
    keywords are those of :class:`cbatch.config.EngineConfig`.
    """

    def __init__(self, model="random:gpt2", **kwargs):
        self.engine = Engine(model, **kwargs)
        self.tokenizer = self.engine.tokenizer

    @property
    def occupancy_trace(self) -> list[int]:
        return self.engine.occupancy_trace

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priorities: list[int] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt (a string or token ids); outputs in prompt order.
        All or nothing: see :meth:`cbatch.Engine.generate`."""
        params = params or SamplingParams()
        with tqdm(total=len(prompts), desc="generate", unit="req",
                  disable=not use_tqdm) as bar:
            return self.engine.generate(prompts, params, priorities, progress=bar.update)

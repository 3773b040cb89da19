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

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priorities: list[int] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; one output per prompt, in prompt order.

        ``prompts`` is one prompt (a string or a list of token ids) or a list of prompts;
        ``params`` one SamplingParams for all or a list, one per prompt.  All or nothing: see
        :meth:`cbatch.Engine.generate`.
        """
        prompts = _prompt_list(prompts)
        params = SamplingParams() if params is None else params
        with tqdm(total=len(prompts), desc="generate", unit="req",
                  disable=not use_tqdm) as bar:
            return self.engine.generate(prompts, params, priorities, progress=bar.update)


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

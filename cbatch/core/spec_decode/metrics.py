"""What speculation did, as vLLM counts it; ``Engine.stats()`` reports these counters
(``EngineStats.spec_decode_*``) and the server's ``/metrics`` serves them as vLLM's
``spec_decode`` counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeCounters:
    """What speculation did, as vLLM counts it (``vllm:spec_decode_*``): drafts (a sequence
    verifying drafts in a step), draft tokens verified, draft tokens accepted, accepted
    tokens by draft position, and the seconds spent drafting and in verifying steps."""

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.k

    def count(self, num_drafts: int, num_accepted: int) -> None:
        """One sequence's verification: ``num_drafts`` drafts, the first ``num_accepted``
        of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    def stats(self) -> dict:
        """The counters as :class:`~cbatch.core.stats.EngineStats`'s ``spec_decode_*``
        fields."""
        return dict(spec_decode_num_drafts=self.num_drafts,
                    spec_decode_num_draft_tokens=self.num_draft_tokens,
                    spec_decode_num_accepted_tokens=self.num_accepted_tokens,
                    spec_decode_num_accepted_tokens_per_pos=tuple(self.accepted_per_pos),
                    spec_decode_draft_s=self.draft_s,
                    spec_decode_verify_s=self.verify_s)

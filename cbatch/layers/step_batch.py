"""The flat, unpadded step batch that one model forward pass consumes (docs/design.md).

The one builder that makes it is :class:`cbatch.core.input_batch.StepBatchBuilder`."""

from __future__ import annotations

from dataclasses import dataclass
import torch


@dataclass
class StepBatch:
    """Tensors of one step: S sequences, T new tokens in total, each sequence's run contiguous.

    input_ids     int64 [T]   the new tokens
    positions     int64 [T]   absolute position of each token in its sequence
    cu_seqlens_q  int32 [S+1] offsets of each sequence's run in the flat batch
    seq_lens      int32 [S]   each sequence's length after this step (cached + new)
    block_tables  int32 [S, max_blocks] physical block ids
    slot_mapping  int64 [T]   cache slot of each new token; -1 writes nothing
    logits_indices int64 [S]  the row of each sequence's last new token (the one to sample from)
    is_decode     every sequence has exactly one new token (host-side flag: picks the kernel)
    max_query_len the longest run of new tokens (host int: sizes the prefill kernel's grid)
    num_padded_seqs  trailing rows that only fill a batch-size bucket: one token each (or
                  the runs' padded length) at position 0, slot -1 (they write nothing), their
                  context in block 0
    graph_shape   (rows, tokens per row) when the batch has the fixed shape of a CUDA graph:
                  rows padded to a bucket, every run padded at its front to the same length
                  with fillers that write nothing, block tables full width; else None
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    is_decode: bool
    max_query_len: int
    num_padded_seqs: int = 0
    graph_shape: tuple[int, int] | None = None

    @property
    def num_seqs(self) -> int:
        """Rows of the batch, padded ones included."""
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

"""Physical KV-cache blocks: reference counts, and a cache of computed blocks by content.
No torch here.

A sequence's ``block_table`` (a list of block ids) is grown as it gets longer and handed
back whole when it finishes, is aborted or is preempted.

Prefix caching (vLLM's scheme): once the K/V of every token of a full block are computed,
the block is registered under a hash that chains its predecessor's hash with its token ids;
the chain starts from the model's identity (``cache_salt``), so equal token ids under other
weights never match.  A new request takes the longest run of cached full blocks of its
prompt by reference and computes only the rest.  When the last holder of a cached block
lets go, the block keeps its K/V and waits in a least-recently-used list; it is evicted
(its hash forgotten) only when an allocation finds no block that was never cached.

A full block is never written again, so sharing it is safe; a request writes only blocks of
its own.  The block after the shared run may still begin with cached tokens (a prompt that
ends mid-block, the same prompt again): those are *copied* from the cached block into the
request's own one (``PrefixMatch.copy_from``), so only the tokens after them are computed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field


@dataclass
class PrefixMatch:
    """The cached part of a token sequence (:meth:`BlockManager.match_prefix`).

    ``blocks`` are cached full blocks holding its first ``len(blocks) * block_size`` tokens,
    ``hashes`` their hashes; the next ``num_copied_tokens`` tokens sit at the start of the
    cached block ``copy_from`` (None when there are none).
    """

    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    copy_from: int | None = None
    num_copied_tokens: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 cache_salt: str = ""):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # unreferenced, content unknown
        # unreferenced but cached, least recently released first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._root = hashlib.sha256(cache_salt.encode()).digest()
        self._block_of: dict[bytes, int] = {}  # hash -> cached block
        self._hash_of: dict[int, tuple[bytes, bytes]] = {}  # cached block -> (hash, parent)
        self._tokens_of: dict[int, tuple[int, ...]] = {}  # cached block -> its token ids
        # (parent hash, first token) -> cached blocks: where a mid-block match is looked for
        self._children: dict[tuple[bytes, int], set[int]] = {}

    # -------------------------------------------------------------- counting

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never-cached ones and unreferenced cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a sequence (cached idle blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def blocks_to_grow(self, block_table: list[int], num_tokens: int) -> int:
        """New blocks ``block_table`` needs to hold ``num_tokens`` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        need = self.blocks_to_grow(block_table, num_tokens)
        return need == 0 or need <= self.num_free_blocks  # a decode mostly needs none

    # -------------------------------------------------------------- allocation

    def _allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)  # least recently used
            self._uncache(block)
        else:
            raise RuntimeError("out of KV blocks")
        self._ref_counts[block] = 1
        return block

    def _take(self, block: int) -> None:
        """One more reference to an existing block."""
        if self._ref_counts[block] == 0:
            del self._evictable[block]
        self._ref_counts[block] += 1

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append free blocks to ``block_table`` (in place) until it holds ``num_tokens``."""
        need = self.blocks_to_grow(block_table, num_tokens)
        if need and need > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {need}, {self.num_free_blocks} free")
        for _ in range(need):
            block_table.append(self._allocate())

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        """Release the blocks of ``block_table`` (in place) past the first that hold
        ``num_tokens`` tokens (what rejected speculative drafts took); such blocks hold no
        computed token, so none is cached."""
        keep = self.blocks_for(num_tokens)
        if len(block_table) > keep:
            tail = block_table[keep:]
            del block_table[keep:]
            self.free(tail)

    def free(self, block_table: list[int]) -> None:
        """Drop the table's references (in place: the table ends empty).  Its blocks are
        released last to first, so a prefix's tail is evicted before its head."""
        for block in reversed(block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
            elif self._ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed more often than it was taken")
        block_table.clear()

    def check_whole(self) -> None:
        """Raise unless no block is referenced (no leak after a run); cached blocks may stay."""
        if self.num_free_blocks != self.num_blocks or any(self._ref_counts):
            held = [b for b, c in enumerate(self._ref_counts) if c]
            raise AssertionError(f"{self.num_blocks - self.num_free_blocks} blocks not "
                                 f"returned: {held[:10]}")

    # -------------------------------------------------------------- prefix caching

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (a benchmark's cold start); no block may be held."""
        if any(self._ref_counts):
            raise RuntimeError("reset_prefix_cache needs every block returned first")
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._block_of.clear()
        self._hash_of.clear()
        self._tokens_of.clear()
        self._children.clear()

    def _hash(self, parent: bytes, token_ids: list[int]) -> bytes:
        return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()

    def _uncache(self, block: int) -> None:
        digest, parent = self._hash_of.pop(block)
        tokens = self._tokens_of.pop(block)
        del self._block_of[digest]
        siblings = self._children[parent, tokens[0]]
        siblings.discard(block)
        if not siblings:
            del self._children[parent, tokens[0]]

    def match_prefix(self, token_ids: list[int]) -> PrefixMatch:
        """The longest cached prefix of ``token_ids``, short of the last token (whose logits
        the request needs, so it is always computed)."""
        match = PrefixMatch()
        if not self.enable_prefix_caching:
            return match
        bs, limit = self.block_size, len(token_ids) - 1
        parent = self._root
        for start in range(0, limit - bs + 1, bs):
            digest = self._hash(parent, token_ids[start:start + bs])
            block = self._block_of.get(digest)
            if block is None:
                break
            match.blocks.append(block)
            match.hashes.append(digest)
            parent = digest
        rest = token_ids[len(match.blocks) * bs:limit][:bs]
        if rest:
            for block in self._children.get((parent, rest[0]), ()):
                n = _common_prefix_len(self._tokens_of[block], rest)
                if n > match.num_copied_tokens:
                    match.copy_from, match.num_copied_tokens = block, n
        return match

    def blocks_to_admit(self, match: PrefixMatch, num_tokens: int) -> int:
        """Free blocks that taking ``match`` and growing to ``num_tokens`` tokens uses up:
        the new blocks, plus the matched blocks that are idle now (and the copy's source,
        held while the new blocks are allocated)."""
        idle = sum(self._ref_counts[b] == 0 for b in match.blocks)
        if match.copy_from is not None and self._ref_counts[match.copy_from] == 0:
            idle += 1
        return self.blocks_for(num_tokens) - len(match.blocks) + idle

    def take_prefix(self, block_table: list[int], match: PrefixMatch,
                    num_tokens: int) -> tuple[int, int] | None:
        """Fill the empty ``block_table`` with the matched blocks (by reference) and new
        ones up to ``num_tokens`` tokens.  Returns ``(source, destination)`` when the cached
        tokens of ``match.copy_from`` must be copied into the table's first new block
        (before anything is written to the KV cache this step), else None."""
        if block_table:
            raise ValueError("take_prefix fills an empty block table")
        for block in match.blocks:
            self._take(block)
        block_table.extend(match.blocks)
        src = match.copy_from
        if src is not None:
            self._take(src)  # not evicted by the allocations below
        try:
            self.grow(block_table, num_tokens)
        finally:
            if src is not None:
                self.free([src])  # released as just used: last in line for eviction
        if src is None:
            return None
        return src, block_table[len(match.blocks)]

    def cache_computed(self, block_table: list[int], block_hashes: list[bytes],
                       token_ids: list[int], num_computed_tokens: int) -> None:
        """Register the table's blocks whose tokens are all computed now.

        ``block_hashes`` holds the hashes of the table's first blocks handled so far and is
        extended in place.  A block whose content another block already holds stays
        private (it is freed, not cached, when released).
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(block_hashes), num_computed_tokens // bs):
            parent = block_hashes[-1] if block_hashes else self._root
            tokens = token_ids[i * bs:(i + 1) * bs]
            digest = self._hash(parent, tokens)
            block_hashes.append(digest)
            block = block_table[i]
            if digest in self._block_of or block in self._hash_of:
                continue
            self._block_of[digest] = block
            self._hash_of[block] = (digest, parent)
            self._tokens_of[block] = tuple(tokens)
            self._children.setdefault((parent, tokens[0]), set()).add(block)


def _common_prefix_len(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

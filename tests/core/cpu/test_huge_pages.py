"""The bytes a CPU step streams on 2 MB transparent huge pages (cbatch/core/cpu/memory.py):
HugePages.copy for the packed weights, huge_page_zeros for the KV cache, the engine using
both, and $CBATCH_HUGE_PAGES=0 turning them off."""

import gc

import pytest
import torch

from cbatch.core.cpu import memory as cpu_memory
from cbatch.core.cpu.memory import CHUNK, HugePages, huge_page_zeros, huge_pages_available
from cbatch.layers.linear import Linear

needs_thp = pytest.mark.skipif(not huge_pages_available(),
                               reason="no transparent huge pages here (Linux, THP not 'never')")


def _mapping_of(t: torch.Tensor) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``t``'s first byte."""
    address = t.data_ptr()
    with open("/proc/self/smaps") as f:
        fields, inside = {}, False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
                start, end = (int(a, 16) for a in head.split("-"))
                inside = start <= address < end
                fields = {"range": head} if inside else fields
            elif inside:
                fields[head.rstrip(":")] = line.split()[1]
    return fields


def _storage(t: torch.Tensor) -> int:
    """Where the memory ``t`` views begins: one per mapping HugePages made (smaps' ranges
    would not tell, the kernel merges adjacent mappings alike)."""
    return t.untyped_storage().data_ptr()


@needs_thp
def test_copies_are_equal_aligned_and_share_a_huge_page_mapping():
    pages = HugePages()
    a = torch.randn(3, 5, 7)
    b = torch.arange(1000, dtype=torch.bfloat16).view(10, 100)
    ca, cb = pages.copy(a), pages.copy(b)
    assert torch.equal(ca, a) and torch.equal(cb, b)
    assert ca.dtype == a.dtype and cb.shape == b.shape and ca.is_contiguous()
    assert ca.data_ptr() != a.data_ptr()
    assert ca.data_ptr() % cpu_memory.HUGE_PAGE == 0  # the first in a chunk: a 2 MB boundary
    assert cb.data_ptr() % cpu_memory.ALIGN == 0
    assert _storage(ca) == _storage(cb)  # one chunk, not a mapping each
    assert _mapping_of(ca).get("THPeligible", "1") == "1"  # the field is new in Linux 5.0
    cb[0, 0] = 7  # a copy, not a view of the original
    assert b[0, 0] == 0


@needs_thp
def test_a_tensor_larger_than_a_chunk_gets_its_own_mapping():
    pages = HugePages()
    small = pages.copy(torch.ones(4))
    big = pages.copy(torch.full((CHUNK // 4 + 1,), 2.0))
    assert bool((big == 2).all()) and big.numel() == CHUNK // 4 + 1
    assert _storage(big) != _storage(small)
    after = pages.copy(torch.zeros(4))  # the small chunk goes on being filled
    assert _storage(after) == _storage(small)


@needs_thp
def test_copies_outlive_the_allocator():
    pages = HugePages()
    kept = pages.copy(torch.arange(50, dtype=torch.float32))
    del pages
    gc.collect()
    assert torch.equal(kept, torch.arange(50, dtype=torch.float32))


@needs_thp
def test_huge_page_zeros_is_zeros_in_its_own_mapping():
    z = huge_page_zeros((2, 1024, 1024), torch.float16)  # 4 MB: two huge pages
    assert z.shape == (2, 1024, 1024) and z.dtype == torch.float16 and not z.any()
    z += 1  # writable
    assert bool((z == 1).all())
    assert z.data_ptr() % cpu_memory.HUGE_PAGE == 0
    assert _mapping_of(z).get("THPeligible", "1") == "1"
    assert huge_page_zeros((0, 4), torch.float32).shape == (0, 4)


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("CBATCH_HUGE_PAGES", "0")
    assert not huge_pages_available()
    t = torch.randn(8)
    assert HugePages().copy(t) is t
    z = huge_page_zeros((3, 2), torch.float32)
    assert z.shape == (3, 2) and not z.any()


@needs_thp
def test_the_engine_streams_weights_and_kv_cache_from_huge_pages(tiny_hf_dir, monkeypatch):
    from cbatch import LLM, SamplingParams

    prompts, params = [[5, 6, 7, 8], [9, 10]], SamplingParams(max_tokens=6, ignore_eos=True)
    kw = dict(max_num_seqs=2, kv_cache_memory=8 << 20)  # a pool of whole huge pages
    llm = LLM(str(tiny_hf_dir), **kw)
    assert llm.engine.runner.describe()["huge pages"] == "on"
    model = llm.engine.model
    streamed = [m.packed_weight for m in model.modules() if isinstance(m, Linear)
                and m.packed_weight is not None and not m.packed_weight.is_mkldnn]
    if not streamed:
        pytest.skip("no linear layer here is packed in cbatch's layout (oneDNN or F.linear)")
    if model.lm_head.greedy_screen is not None:
        streamed.append(model.lm_head.greedy_screen.weight)
    kv = llm.engine.kv_cache.data
    # HugePages' one chunk holds every packed weight of this small model; the pool is a
    # mapping of its own; both start on 2 MB boundaries (malloc's blocks would not)
    assert len({_storage(t) for t in streamed}) == 1
    for t in (kv, streamed[0]):  # streamed[0]: the first layer's, placed first
        assert t.data_ptr() % cpu_memory.HUGE_PAGE == 0
        assert _mapping_of(t).get("THPeligible", "1") == "1"  # the field is new in Linux 5.0
    tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    monkeypatch.setenv("CBATCH_HUGE_PAGES", "0")  # the same tokens on malloc's memory
    llm = LLM(str(tiny_hf_dir), **kw)
    assert llm.engine.runner.describe()["huge pages"] == "off"
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == tokens


def test_touch_faults_in_the_pool_and_a_server_touches_at_start_up():
    """KVCache.touch: the lazily zeroed pool is resident afterwards, and still zeros; the
    AsyncEngine (every server's engine) touches its pool before it serves."""
    from cbatch.core.async_engine import AsyncEngine
    from cbatch.layers.kv_cache import KVCache
    from cbatch.models.gpt2 import GPT2Config

    def resident_kb(t):
        return int(_mapping_of(t).get("Rss", "0"))

    config = GPT2Config.named("tiny")
    kv = KVCache(config, 256, 16, torch.float32, zeros=huge_page_zeros)  # 4 MB
    nbytes_kb = kv.data.numel() * kv.data.element_size() // 1024
    if huge_pages_available():  # (else torch.zeros wrote every page already)
        assert resident_kb(kv.data) < nbytes_kb
    kv.touch()
    assert resident_kb(kv.data) >= nbytes_kb and not kv.data.any()
    engine = AsyncEngine("random:tiny", max_num_seqs=2, kv_cache_memory=4 << 20)
    try:
        pool = engine.engine.kv_cache.data
        assert resident_kb(pool) >= pool.numel() * pool.element_size() // 1024
    finally:
        engine.shutdown()

"""cbatch's GPT-2 against transformers' GPT2LMHeadModel on the same random weights."""

import pytest
import torch

from cbatch import LLM, KVCache, SamplingParams, load_model
from cbatch.core.input_batch import make_step_batch
from tests.helpers import shuffled_block_tables, triton_device, triton_skip_reason

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _hf_logits(hf_model, tokens):
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("backend", [None, "torch",
                                     pytest.param("triton", marks=pytest.mark.slow)])
def test_packed_prefill_then_decode_matches_transformers(tiny_hf_dir, tiny_hf_model,
                                                         block_size, backend):
    device = "cpu"
    if backend == "triton":  # on the GPU, or on CPU tensors in Triton's interpreter
        device = triton_device()
        if device is None:
            pytest.skip(triton_skip_reason())
    model = load_model(str(tiny_hf_dir), device=device,
                                            attention_backend=backend)
    gen = torch.Generator().manual_seed(1)
    prompt_lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]
    decode_steps = 4
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in prompt_lens]
    final_lens = [n + decode_steps for n in prompt_lens]
    num_blocks = sum(-(-n // block_size) for n in final_lens) + 7  # spare blocks: garbage
    cache = KVCache(model.config, num_blocks, block_size, device=device)
    cache.data.fill_(float("nan"))  # any read of an unwritten slot poisons the output
    tables = shuffled_block_tables(final_lens, block_size, num_blocks, gen).tolist()

    # One packed prefill step of all prompts, all-token logits.
    batch = make_step_batch(prompts, [0] * len(prompts), tables, block_size, device)
    with torch.no_grad():
        logits = model.compute_logits(model(batch, cache)).cpu()
    for s, prompt in enumerate(prompts):
        ours = logits[batch.cu_seqlens_q[s]:batch.cu_seqlens_q[s + 1]]
        torch.testing.assert_close(ours, _hf_logits(tiny_hf_model, prompt), atol=1e-4, rtol=1e-4)

    # Decode steps: one random new token per sequence, compared at the last position.
    seqs = [list(p) for p in prompts]
    for _ in range(decode_steps):
        new = [[int(torch.randint(0, 512, (1,), generator=gen))] for _ in seqs]
        batch = make_step_batch(new, [len(s) for s in seqs], tables, block_size, device)
        assert batch.is_decode
        with torch.no_grad():
            logits = model.compute_logits(model(batch, cache)[batch.logits_indices]).cpu()
        for s, tok in enumerate(new):
            seqs[s] += tok
            torch.testing.assert_close(logits[s], _hf_logits(tiny_hf_model, seqs[s])[-1],
                                       atol=1e-4, rtol=1e-4)


def test_mixed_prefill_chunks_and_decode_tokens_in_one_step(tiny_hf_dir, tiny_hf_model):
    """A step mixing a continuing prefill chunk, a fresh prompt and decode tokens."""
    model = load_model(str(tiny_hf_dir))
    gen = torch.Generator().manual_seed(2)
    block_size = 8
    cache = KVCache(model.config, 32, block_size)
    cache.data.fill_(float("nan"))
    full = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (30, 12, 9)]
    tables = shuffled_block_tables([30, 12, 9], block_size, 32, gen).tolist()
    # step 1: first chunk of seq 0 (13 tokens), all of seq 1 but its last token
    step1 = make_step_batch([full[0][:13], full[1][:11]], [0, 0], tables[:2], block_size)
    with torch.no_grad():
        model(step1, cache)
    # step 2: rest of seq 0 (chunk), seq 1's last token (decode), all of seq 2 (fresh)
    step2 = make_step_batch([full[0][13:], full[1][11:], full[2]], [13, 11, 0], tables,
                            block_size)
    with torch.no_grad():
        logits = model.compute_logits(model(step2, cache))
    cu = step2.cu_seqlens_q.tolist()
    torch.testing.assert_close(logits[cu[0]:cu[1]], _hf_logits(tiny_hf_model, full[0])[13:],
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[cu[1]], _hf_logits(tiny_hf_model, full[1])[-1],
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[cu[2]:cu[3]], _hf_logits(tiny_hf_model, full[2]),
                               atol=1e-4, rtol=1e-4)


def test_greedy_generate_matches_transformers(tiny_hf_dir, tiny_hf_model):
    model = load_model(str(tiny_hf_dir))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 511, (n,), generator=gen).tolist() for n in (3, 17, 40, 8)]
    outs = LLM(model).generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True),
                               use_tqdm=False)
    for prompt, got in zip(prompts, (o.token_ids for o in outs)):
        with torch.no_grad():
            ref = tiny_hf_model.generate(torch.tensor([prompt]), max_new_tokens=12,
                                         min_new_tokens=12, do_sample=False,
                                         pad_token_id=511, eos_token_id=None)
        assert got == ref[0, len(prompt):].tolist()


def test_random_weights_are_seeded_and_device_independent():
    a = load_model("random:tiny", seed=5)
    b = load_model("random:tiny", seed=5)
    c = load_model("random:tiny", seed=6)
    wa, wb, wc = (m.transformer.h[0].attn.c_attn.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert a.lm_head.weight is a.transformer.wte.weight


def test_dtype_and_tied_head_after_load(tiny_hf_dir):
    model = load_model(str(tiny_hf_dir), dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight is model.transformer.wte.weight
    assert all(p.device.type == "cpu" for p in model.parameters())

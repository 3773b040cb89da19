"""attn_implementation="cbatch" in transformers against "sdpa" on the same weights."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
import cbatch.hf  # noqa: E402

cbatch.hf.register()

PROMPT_LENS = [5, 1, 12, 8]


def _left_padded(vocab, pad_id, seed=0):
    gen = torch.Generator().manual_seed(seed)
    L = max(PROMPT_LENS)
    ids = torch.full((len(PROMPT_LENS), L), pad_id)
    mask = torch.zeros(len(PROMPT_LENS), L, dtype=torch.long)
    for b, n in enumerate(PROMPT_LENS):
        ids[b, L - n:] = torch.randint(0, vocab - 1, (n,), generator=gen)
        mask[b, L - n:] = 1
    return ids, mask


def _tiny_llama(path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def checkpoint(request, tiny_hf_dir, tmp_path_factory):
    if request.param == "gpt2":
        return tiny_hf_dir, 511
    return _tiny_llama(tmp_path_factory.mktemp("tiny-llama")), 0


def _load(path, impl):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=impl, dtype=torch.float32).eval()


def test_left_padded_logits_match_sdpa(checkpoint, monkeypatch):
    path, pad = checkpoint
    ids, mask = _left_padded(512, pad)
    calls = []
    prefill = cbatch.ops.paged_prefill_attention
    monkeypatch.setattr(cbatch.ops, "paged_prefill_attention",
                        lambda q, *a, **k: calls.append(q.shape[0]) or prefill(q, *a, **k))
    with torch.no_grad():
        ours = _load(path, "cbatch")(input_ids=ids, attention_mask=mask).logits
    assert calls == [sum(PROMPT_LENS)] * 2  # both layers, only the real tokens
    with torch.no_grad():
        ref = _load(path, "sdpa")(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], ref[real], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_left_padded_greedy_generate_matches_sdpa(checkpoint):
    path, pad = checkpoint
    ids, mask = _left_padded(512, pad, seed=1)
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=pad)
    with torch.no_grad():
        ours = _load(path, "cbatch").generate(input_ids=ids, attention_mask=mask, **kw)
        ref = _load(path, "sdpa").generate(input_ids=ids, attention_mask=mask, **kw)
    assert torch.equal(ours, ref)


def test_set_attn_implementation_switches_an_eager_model(tiny_hf_dir):
    model = _load(tiny_hf_dir, "eager")
    model.set_attn_implementation("cbatch")
    assert model.config._attn_implementation == "cbatch"
    ids, mask = _left_padded(512, 511, seed=2)
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask).logits
        ref = _load(tiny_hf_dir, "sdpa")(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(ours[mask.bool()], ref[mask.bool()], atol=1e-4, rtol=1e-4)


def test_no_padding_path():
    module = torch.nn.Module()
    q, k, v = (torch.randn(2, 4, 6, 16) for _ in range(3))
    out, _ = cbatch.hf.attention_forward(module, q, k, v, None, scaling=None)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_refuses_what_it_cannot_do():
    module = torch.nn.Module()
    q = torch.randn(1, 6, 3, 16)
    k = torch.randn(1, 4, 3, 16)
    with pytest.raises(ValueError, match="6 query heads cannot share 4 KV heads"):
        cbatch.hf.attention_forward(module, q, k, k, None)
    module.is_causal = False
    with pytest.raises(NotImplementedError, match="causal only"):
        cbatch.hf.attention_forward(module, q, q, q, None)

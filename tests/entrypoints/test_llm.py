"""``LLM.generate``: what a prompt may be, and all-or-nothing calls (tiny random model, CPU)."""

import pytest

from cbatch import LLM, SamplingParams
from tests.helpers import fail_forward_at

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("random:tiny", max_num_seqs=4, num_blocks=64)


@pytest.fixture(scope="module")
def static_llm():
    return LLM("random:tiny", max_num_seqs=4, scheduling_policy="static")


def assert_empty(llm):
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    engine.block_manager.check_whole()
    assert not engine.scheduler.waiting and not engine.scheduler.running


@pytest.mark.parametrize("prompts,params,exc,match", [
    (["ok", ""], PARAMS, ValueError, "prompt is empty"),
    (["ok", [1, 2, 512]], PARAMS, ValueError, r"token ids must be ints in \[0, 512\)"),
    (["ok", [1] * 300], PARAMS, ValueError, "exceeds the model's maximum length"),
    (["ok", 123], PARAMS, TypeError, r"prompts\[1\] is int 123: prompts must be a string, "
     "a list of token ids, or a list of those"),
    (["ok", "fine"], [PARAMS], ValueError, "got 1 SamplingParams for 2 prompts"),
    (["ok", "a\ud800b"], PARAMS, ValueError, r"prompt 2 of 2 .*'\\ud800' at character 1 "
     "is a lone surrogate"),  # (not a TypeError of UnicodeEncodeError's own arguments)
    ("a\udcffb", PARAMS, ValueError, "lone surrogate .perhaps the byte 0xff, not UTF-8"),
    (["ok", "fine"], [PARAMS, "greedy"], TypeError, "params must be SamplingParams"),
    (["ok", [1] * 40], [PARAMS, SamplingParams(max_tokens=250)], ValueError,
     r"prompt \(40 tokens\) \+ max_tokens \(250\)"),
])
def test_a_bad_prompt_or_parameter_queues_nothing(llm, prompts, params, exc, match):
    with pytest.raises(exc, match=match):
        llm.generate(prompts, params, use_tqdm=False)
    assert_empty(llm)
    outs = llm.generate(["next"], PARAMS, use_tqdm=False)
    assert len(outs) == 1 and outs[0].prompt_token_ids == list(b"next")


def test_the_static_baseline_is_all_or_nothing_too(static_llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        static_llm.generate(["ok", ""], PARAMS, use_tqdm=False)
    outs = static_llm.generate(["next"], PARAMS, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [list(b"next")]


def test_priorities_must_match_the_prompts(llm):
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate(["a", "b"], PARAMS, use_tqdm=False, priorities=[0])
    assert_empty(llm)


@pytest.mark.parametrize("error", [RuntimeError("device lost"), KeyboardInterrupt()])
def test_an_error_in_a_step_aborts_the_calls_requests(llm, monkeypatch, error):
    """A failing forward pass on the third step (some requests running, some waiting)
    leaves the engine empty with every block free, and the next call is unaffected."""
    prompts = [[1, 2, 3], "hello", [7] * 20, "a longer prompt than the others", [9], "x"]
    expected = llm.generate(prompts, PARAMS, use_tqdm=False)
    calls = fail_forward_at(monkeypatch, llm.engine.model, 3, error)
    with pytest.raises(type(error)):
        llm.generate(prompts, PARAMS, use_tqdm=False)
    assert len(calls) == 3
    assert_empty(llm)
    monkeypatch.undo()
    again = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in expected]
    assert_empty(llm)


@pytest.mark.parametrize("other_tokens", [1, 40])  # the other request ends first, or after
def test_generate_beside_another_unfinished_request(llm, other_tokens):
    """A call on an engine that holds another caller's request runs its own to the end (no
    KeyError from the other's output) and leaves the other one running."""
    other = llm.engine.add_request([5, 6], SamplingParams(max_tokens=other_tokens,
                                                          ignore_eos=True))
    [out] = llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False)
    assert out.finished and out.finish_reason == "length" and len(out.token_ids) == 4
    assert not llm.engine.is_unfinished(out.request_id)
    if llm.engine.is_unfinished(other):
        llm.engine.abort(other, report=False)
    while llm.engine.has_unfinished_requests():  # the other's last output, if it ended
        llm.engine.step()
    assert_empty(llm)


def test_one_prompt_or_a_list_of_prompts(llm):
    """A string or a list of token ids is one prompt; a list of those is several."""
    [one] = llm.generate("hi", PARAMS, use_tqdm=False)
    assert one.prompt_token_ids == list(b"hi")
    [ids] = llm.generate([123], PARAMS, use_tqdm=False)
    assert ids.prompt_token_ids == [123]
    mixed = llm.generate(["hi", [104, 105], (5, 6)], PARAMS, use_tqdm=False)
    assert [o.prompt_token_ids for o in mixed] == [[104, 105], [104, 105], [5, 6]]
    assert mixed[0].token_ids == mixed[1].token_ids == one.token_ids
    assert llm.generate([], PARAMS, use_tqdm=False) == []
    for bad in (123, None, {"prompt": "hi"}):
        with pytest.raises(TypeError, match="prompts must be a string, a list of token ids, "
                                            "or a list of those"):
            llm.generate(bad, PARAMS, use_tqdm=False)
    assert_empty(llm)


def test_n_choices_per_prompt_come_prompt_major(llm):
    """n > 1: n requests per prompt, choice i with seed + i (mod 2**64), in prompt order."""
    sampled = dict(max_tokens=6, temperature=1.0, ignore_eos=True)
    outs = llm.generate(["ab", [7, 8]], SamplingParams(n=3, seed=2**64 - 2, **sampled),
                        use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [[97, 98]] * 3 + [[7, 8]] * 3
    for i, out in enumerate(outs):
        seed = (2**64 - 2 + i % 3) % 2**64  # ..., 2**64 - 1, 0
        [ref] = llm.generate([out.prompt_token_ids], SamplingParams(seed=seed, **sampled),
                             use_tqdm=False)
        assert out.token_ids == ref.token_ids
    # a list of params, one per prompt, each with its own n
    outs = llm.generate(["a", "b"], [SamplingParams(n=2, **sampled), PARAMS], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [[97], [97], [98]]
    with pytest.raises(ValueError, match="n=2: a request of Engine.add_request is one "
                                         "completion; LLM.generate and the server run n"):
        llm.engine.add_request("hi", SamplingParams(n=2))
    assert_empty(llm)


def test_choices_share_the_checked_params(llm):
    """Each choice is a copy of the params with its seed, not a new SamplingParams checked
    again (a long stop_token_ids list is checked once per call; issue 41 item 4)."""

    params = SamplingParams(n=4, seed=1, stop_token_ids=list(range(1000)))
    choices = [params.choice(i) for i in range(4)]
    assert [c.seed for c in choices] == [1, 2, 3, 4] and params.seed == 1
    assert all(c.n == 1 and c.stop_token_ids is params.stop_token_ids for c in choices)
    assert SamplingParams(n=2).choice(1).seed is None


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    """One tokenizer trained offline, saved both ways ``tokenizers`` reads it."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50,
                            vocab_size=300, min_frequency=1)
    json_dir = tmp_path_factory.mktemp("tokenizer-json")
    tok.save(str(json_dir / "tokenizer.json"))
    bpe_dir = tmp_path_factory.mktemp("tokenizer-bpe")
    tok.save_model(str(bpe_dir))  # vocab.json + merges.txt
    return json_dir, bpe_dir


def test_a_checkpoint_without_tokenizer_files_warns(tiny_hf_dir):
    with pytest.warns(UserWarning, match="has no tokenizer \\(tokenizer.json, vocab.json, "
                                         "merges.txt missing\\).*pass tokenizer="):
        llm = LLM(str(tiny_hf_dir))
    assert type(llm.tokenizer).__name__ == "ByteTokenizer"


@pytest.mark.parametrize("model", ["random:tiny", "checkpoint"])
@pytest.mark.parametrize("form", ["tokenizer.json", "vocab.json+merges.txt"])
def test_tokenizer_option_picks_the_tokenizer(tiny_hf_dir, tokenizer_dirs, recwarn, model, form):
    tok_dir = tokenizer_dirs[form != "tokenizer.json"]
    model = str(tiny_hf_dir) if model == "checkpoint" else model
    llm = LLM(model, tokenizer=str(tok_dir))
    assert not [w for w in recwarn if "tokenizer" in str(w.message)]
    ids = llm.tokenizer.encode("the quick fox")
    assert llm.tokenizer.decode(ids) == "the quick fox" and len(ids) < len("the quick fox")
    out = llm.generate("the quick fox", PARAMS, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids and out.text == llm.tokenizer.decode(out.token_ids)


def test_a_tokenizer_that_is_not_there_is_one_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing: tokenizer.json, vocab.json, merges.txt"):
        LLM("random:tiny", tokenizer=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        LLM("random:tiny", tokenizer=str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="could not load 'no-such-user/no-such-"
                                                "tokenizer': it is not a local directory"):
        LLM("random:tiny", tokenizer="no-such-user/no-such-tokenizer")  # offline in tests
    with pytest.raises(ValueError, match="tokenizer must be a directory or hub id"):
        LLM("random:tiny", tokenizer="")


def test_the_tokenizer_is_built_beside_the_model_and_given_its_eos(tiny_hf_dir, tokenizer_dirs,
                                                                   monkeypatch):
    """The engine builds the tokenizer on a thread of its own while the model loads (a GGUF
    file's takes seconds), then gives it the model's EOS."""
    import threading

    import cbatch.models.loader as loader

    threads = []

    def recording(*args):
        threads.append(threading.current_thread().name)
        return load(*args)

    load = loader.load_tokenizer
    monkeypatch.setattr(loader, "load_tokenizer", recording)
    llm = LLM(str(tiny_hf_dir), tokenizer=str(tokenizer_dirs[0]))
    assert len(threads) == 1 and threads[0].startswith("cbatch-tokenizer")
    assert llm.tokenizer.eos_token_id == llm.engine.model.config.eos_token_id is not None


def _has_cuda():
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("device,match", [
    ("banana", r"device must be 'cpu', 'cuda' or 'cuda:<index>', got 'banana'; "
               r"available here: cpu"),
    ("mps", r"cbatch runs on 'cpu' or 'cuda', got device='mps'; available here: cpu"),
    pytest.param("cuda", r"device='cuda' but .*; available here: cpu$",
                 marks=pytest.mark.skipif(_has_cuda(), reason="CUDA is available")),
    pytest.param("cuda:64", r"device='cuda:64' but there are only \d+ CUDA devices",
                 marks=pytest.mark.skipif(not _has_cuda(), reason="needs CUDA")),
])
def test_a_device_this_machine_lacks_is_one_clear_error(device, match):
    from cbatch.config import EngineConfig

    with pytest.raises(ValueError, match=match):
        EngineConfig(device=device)
    with pytest.raises(ValueError, match=match):
        LLM("random:tiny", device=device)


def test_a_model_load_says_what_it_loads_and_when_it_is_ready(capsys):
    """Two INFO lines on stderr (vLLM's shape), and none once the cbatch logger is at
    WARNING (what CBATCH_LOGGING_LEVEL=WARNING sets at import)."""
    import logging

    LLM("random:tiny", num_blocks=16)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "cbatch: loading random:tiny (float32, cpu) ...", err
    assert err[1].startswith("cbatch: model ready in "), err
    assert "parameters, GPT2LMHeadModel; KV cache 256 tokens" in err[1], err
    assert len(err) == 2, err
    logger = logging.getLogger("cbatch")
    level = logger.level
    try:
        logger.setLevel(logging.WARNING)
        LLM("random:tiny", num_blocks=16)
        assert capsys.readouterr().err == ""
    finally:
        logger.setLevel(level)


def test_the_logging_level_comes_from_the_environment():
    import os
    import subprocess
    import sys

    # set up by the first module that logs (the engine's, the loader's), not by import cbatch
    code = "import logging, cbatch.core.engine; print(logging.getLogger('cbatch').level)"
    for value, level in (("WARNING", "30"), ("", "20"), ("warning", "30")):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "CBATCH_LOGGING_LEVEL": value})
        assert run.stdout.strip() == level, run.stderr


def test_print_of_an_output_shows_its_text_and_how_it_ended(llm):
    from cbatch.outputs import RequestMetrics, RequestOutput

    (out,) = llm.generate("hi", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert repr(out) == (f"RequestOutput(request_id={out.request_id!r}, text={out.text!r}, "
                         "num_prompt_tokens=2, num_tokens=3, finished=True, "
                         "finish_reason='length')")
    metrics = RequestMetrics(0.0, None, None, None, 0, 0)
    long = RequestOutput("7", [1], [2] * 40, False, None, metrics,
                         text_of=lambda n, finished: "x" * 100)
    assert repr(long) == ("RequestOutput(request_id='7', text='" + "x" * 60 + "'... (100 "
                          "chars), num_prompt_tokens=1, num_tokens=40, finished=False, "
                          "finish_reason=None)")
    failed = RequestOutput("8", [1], [], True, "error", metrics, error="ValueError: boom")
    assert repr(failed).endswith("finish_reason='error', error='ValueError: boom')")
    assert str(out) == repr(out)  # print(out)

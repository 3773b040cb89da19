"""``speculative_config`` as vLLM spells it: EngineConfig's checks, LLM's keyword and the
``--speculative-config '<json>'`` flag of ``cbatch generate`` and ``cbatch serve``."""

import json

import pytest

from cbatch.config import EngineConfig, SpeculativeConfig
from cbatch.entrypoints.cli import generate
from cbatch.entrypoints.cli.engine_args import engine_kwargs
from cbatch.entrypoints.cli.main import build_parser, main

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def test_speculative_config_checks_name_the_key():
    c = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert c.speculative_config == SpeculativeConfig("ngram", 4, 5, 5)  # vLLM's defaults
    assert SpeculativeConfig("ngram", 2, prompt_lookup_max=4).prompt_lookup_min == 4
    assert EngineConfig(speculative_config='{"num_speculative_tokens": 2}') \
        .speculative_config.num_speculative_tokens == 2
    assert EngineConfig().speculative_config is None
    assert c.speculative_config.adaptive  # cbatch's own key, on by default
    for bad, match in [({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({}, "num_speculative_tokens"),
                       ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                       ({"num_speculative_tokens": 2, "prompt_lookup_min": 4,
                         "prompt_lookup_max": 2}, "prompt_lookup_min"),
                       ({"num_speculative_tokens": 2, "prompt_lookup_max": 0},
                        "prompt_lookup_max"),
                       ({"num_speculative_tokens": 2, "draft": 1}, "unknown keys"),
                       ({"num_speculative_tokens": 2, "adaptive": "no"}, "adaptive"),
                       ({"method": "draft_model", "num_speculative_tokens": 2}, "needs"),
                       ({"num_speculative_tokens": 2, "model": "random:tiny"}, "draft_model"),
                       ("{oops", "not JSON"), ([2], "must be a dict")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(speculative_config=bad)
    # a speculative engine drafts from the last step's tokens: it runs synchronously
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(speculative_config=NGRAM, async_scheduling=True)
    assert not EngineConfig(speculative_config=NGRAM).use_async_scheduling


def test_the_flag_is_json_in_generate_and_serve():
    parse = build_parser().parse_args
    assert engine_kwargs(parse(["serve"]))["speculative_config"] is None
    for argv in (["serve"], ["generate", "--prompt", "x"]):
        args = parse(argv + ["--speculative-config", json.dumps(NGRAM)])
        assert engine_kwargs(args)["speculative_config"] == NGRAM


@pytest.mark.parametrize("text", ["{oops", "[1, 2]"])
def test_a_flag_that_is_not_a_json_object_is_a_usage_error(text, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--speculative-config", text])
    assert exit_.value.code == 2
    assert "--speculative-config" in capsys.readouterr().err


def test_generate_speculates(capsys, monkeypatch):
    made = []

    def load_llm(args, **kwargs):
        from cbatch.entrypoints.cli.engine_args import load_llm as load

        made.append(load(args, **kwargs))
        return made[-1]

    monkeypatch.setattr(generate, "load_llm", load_llm)
    main(["generate", "--model", "random:tiny", "--prompt", "abcabcabc", "--prompt", "xyxyxy",
          "--max-tokens", "12", "--ignore-eos", "--speculative-config", json.dumps(NGRAM)])
    assert "(length, 12 tokens" in capsys.readouterr().out
    stats = made[0].engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert stats.num_steps < 12  # fewer steps than tokens


def test_a_speculative_server_streams_the_same_text_and_counts_drafts():
    """``cbatch serve --speculative-config``'s engine behind the HTTP server: a streamed
    greedy completion is the offline non-speculative one, and /metrics has vLLM's
    spec_decode counters (per draft position too)."""
    httpx = pytest.importorskip("httpx")
    from cbatch import LLM, SamplingParams
    from tests.serving_utils import running_server

    prompt = "abcabcabcabc xyzxyz abcabc"
    ref = LLM("random:tiny").generate([prompt], SamplingParams(max_tokens=24,
                                                               ignore_eos=True),
                                      use_tqdm=False)[0]
    with running_server("random:tiny", "tiny", speculative_config=NGRAM) as (url, _):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True, "stream": True}
        text = ""
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert text == ref.text
        metrics = httpx.get(f"{url}/metrics").text

    def value(name):
        return float(next(line for line in metrics.splitlines()
                          if line.startswith(name)).split()[-1])

    accepted = value("cbatch_spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= value("cbatch_spec_decode_num_draft_tokens_total")
    assert value("cbatch_spec_decode_num_drafts_total") > 0
    assert value('cbatch_spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",'
                 'position="0"}') > 0


@pytest.mark.slow
def test_the_server_log_says_speculative_decoding_is_on():
    import subprocess
    import sys

    from tests.serving_utils import free_port, wait_healthy

    assert SpeculativeConfig(num_speculative_tokens=3).describe() == (
        "ngram (prompt lookup 5-5), up to 3 draft tokens a step, adaptive draft length")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cbatch.entrypoints.cli.main", "serve", "--model", "random:tiny",
         "--device", "cpu", "--threads", "1", "--port", str(port), "--speculative-config",
         json.dumps(NGRAM)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout=120)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=60)[0]
    line = next(line for line in out.splitlines() if line.startswith("speculative decoding:"))
    assert line == "speculative decoding: " + SpeculativeConfig.of(NGRAM).describe()

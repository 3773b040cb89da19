"""The command line, on a tiny random model: in-process through ``main``, and as the real
``cbatch`` entry point in a subprocess where start-up and error output matter."""

import os
import subprocess
import sys

import pytest

from cbatch.entrypoints.cli import generate
from cbatch.entrypoints.cli.engine_args import engine_kwargs
from cbatch.entrypoints.cli.main import build_parser, main
from tests.helpers import fail_forward_at


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``cbatch ARGS`` in a fresh interpreter (what a user's shell runs), bounded in time."""
    return subprocess.run([sys.executable, "-m", "cbatch.entrypoints.cli.main", *args],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def imported_modules(importtime_stderr: str) -> set[str]:
    """Top-level package names in the output of ``python -X importtime``."""
    return {line.rsplit("|", 1)[-1].strip().split(".")[0]
            for line in importtime_stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.slow
def test_demo_prints_progress_table_and_writes_plot(tmp_path, capsys):
    plot = tmp_path / "occupancy.png"
    main(["demo", "--model", "random:tiny", "--device", "cpu", "--scale", "0.5",
          "--plot", str(plot)])
    captured = capsys.readouterr()
    out = captured.out
    from cbatch.devices import auto_dtype

    # --dtype defaults to auto: bfloat16 on a CPU with native bf16, else float32
    assert f"cbatch: loading random:tiny ({auto_dtype('cpu')}, cpu) ..." in captured.err
    for stage in ("warming up", "static batching: 2 batches of 8", "static: done in",
                  "continuous batching:", "continuous: done in"):
        assert stage in out, stage
    assert "| static " in out and "| continuous " in out
    assert "greedy outputs identical: True" in out
    assert plot.stat().st_size > 1000


def test_generate_several_prompts(capsys):
    main(["generate", "--model", "random:tiny", "--prompt", "hello", "--prompt", "a b",
          "--max-tokens", "3", "--temperature", "0.8", "--seed", "1", "--ignore-eos"])
    out = capsys.readouterr().out
    assert out.count("---") == 2 and out.count("(length, 3 tokens") == 2


def test_generate_static_policy(capsys):
    main(["generate", "--model", "random:tiny", "--scheduling-policy", "static", "--prompt",
          "hello", "--max-tokens", "3", "--ignore-eos"])
    captured = capsys.readouterr()  # static batching runs on the same engine: it streams too
    assert captured.out.startswith("hello") and "(length, 3 tokens" in captured.err


class Writes:
    """A stdout that keeps each write apart."""

    def __init__(self):
        self.writes = []

    def write(self, text):
        self.writes.append(text)

    def flush(self):
        pass


def test_one_prompt_streams_its_text_without_a_progress_bar(capsys, monkeypatch):
    stdout = Writes()
    monkeypatch.setattr(sys, "stdout", stdout)
    main(["generate", "--model", "random:tiny", "--prompt", "hello", "--max-tokens", "6",
          "--ignore-eos"])
    err = capsys.readouterr().err
    assert "(length, 6 tokens" in err and "req/s" not in err and "generate:" not in err
    text = [w for w in stdout.writes if w]
    assert text[0] == "hello" and text[-1] == "\n"
    assert len(text) >= 4  # the prompt, then the text in pieces as steps produce it
    from cbatch import LLM, SamplingParams

    want = LLM("random:tiny").generate("hello", SamplingParams(max_tokens=6, ignore_eos=True),
                                       use_tqdm=False)[0].text
    assert "".join(text) == "hello" + want + "\n"


def test_stream_writes_each_piece_of_text_once(monkeypatch):
    """The pieces written are the final text, in order, never one to take back (a character
    whose bytes are still arriving is held back by the engine's detokenizer)."""
    from cbatch import LLM, SamplingParams

    stdout = Writes()
    monkeypatch.setattr(sys, "stdout", stdout)
    llm = LLM("random:tiny", num_blocks=32)
    out = generate.stream(llm, "x", SamplingParams(max_tokens=24, temperature=1.0, seed=5,
                                               ignore_eos=True))
    assert stdout.writes[0] == "x" and stdout.writes[-1] == "\n"
    assert "".join(stdout.writes[1:-1]) == out.text and len(out.token_ids) == 24


def test_an_interrupted_stream_leaves_the_engine_empty(monkeypatch):
    from cbatch import LLM, SamplingParams

    llm = LLM("random:tiny", num_blocks=32)
    engine = llm.engine
    monkeypatch.setattr(sys, "stdout", Writes())
    calls = fail_forward_at(monkeypatch, engine.model, 2, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        generate.stream(llm, "x", SamplingParams(max_tokens=5))
    assert len(calls) == 2 and not engine.has_unfinished_requests()
    engine.block_manager.check_whole()


def test_generate_flags_become_sampling_params():
    args = build_parser().parse_args([
        "generate", "--prompt", "p", "--max-tokens", "7", "--temperature", "0.5",
        "--top-p", "0.9", "--top-k", "40", "--seed", "3", "--stop", "\n\n", "--stop", "END",
        "--stop-token-id", "13", "--stop-token-id", "198", "--ignore-eos"])
    p = generate.sampling_params(args)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (7, 0.5, 0.9, 40, 3)
    assert p.stop == ["\n\n", "END"] and p.stop_token_ids == [13, 198] and p.ignore_eos
    args = build_parser().parse_args([
        "generate", "--prompt", "p", "--min-p", "0.1", "--presence-penalty", "0.5",
        "--frequency-penalty", "-0.5", "--repetition-penalty", "1.2", "--min-tokens", "2",
        "--bad-word", "x", "--bad-word", "yz", "--n", "3"])
    p = generate.sampling_params(args)
    assert (p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
            p.min_tokens, p.bad_words, p.n) == (0.1, 0.5, -0.5, 1.2, 2, ["x", "yz"], 3)


def test_generate_n_choices(capsys):
    main(["generate", "--model", "random:tiny", "--prompt", "hello", "--n", "2",
          "--max-tokens", "3", "--temperature", "0.8", "--seed", "1", "--ignore-eos"])
    out = capsys.readouterr().out
    assert "--- 'hello' choice 0 (length, 3 tokens" in out
    assert "--- 'hello' choice 1 (length, 3 tokens" in out


def test_serve_flags_become_engine_keywords():
    parse = build_parser().parse_args
    auto = engine_kwargs(parse(["serve"]))
    assert (auto["cuda_graphs"], auto["async_scheduling"], auto["enable_prefix_caching"]) \
        == (None, None, True)
    off = engine_kwargs(parse(["serve", "--no-cuda-graphs", "--no-async-scheduling",
                               "--no-enable-prefix-caching"]))
    assert (off["cuda_graphs"], off["async_scheduling"], off["enable_prefix_caching"]) \
        == (False, False, False)
    # --threads is EngineConfig.threads (a fixed count per step), in every command
    assert auto["threads"] is None
    assert engine_kwargs(parse(["serve", "--threads", "1"]))["threads"] == 1
    assert engine_kwargs(parse(["generate", "--prompt", "x", "--threads", "2"]))["threads"] == 2


def test_stop_token_id_stops_generation(capsys):
    from cbatch import LLM, SamplingParams

    greedy = LLM("random:tiny").generate("hello", SamplingParams(max_tokens=3),
                                         use_tqdm=False)[0].token_ids
    stop = greedy[-1]
    main(["generate", "--model", "random:tiny", "--prompt", "hello", "--max-tokens", "3",
          "--stop-token-id", str(stop)])
    assert f"(stop, {greedy.index(stop) + 1} tokens" in capsys.readouterr().err


@pytest.mark.slow
def test_help_and_argument_errors_import_no_torch():
    """`cbatch --help` and a bad flag answer without importing torch (what made them slow)."""
    help_ = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "cbatch.entrypoints.cli.main", "generate",
         "--help"], capture_output=True, text=True, timeout=300)
    assert help_.returncode == 0
    for flag in ("--scheduling-policy", "--stop", "--stop-token-id", "--temperature", "--top-p",
                 "--top-k", "--seed", "--device", "--dtype", "--ignore-eos", "--tokenizer"):
        assert flag in help_.stdout, flag
    assert "cbatch" in imported_modules(help_.stderr)
    assert "torch" not in imported_modules(help_.stderr)

    bad = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "cbatch.entrypoints.cli.main", "generate",
         "--prompt", "x", "--max-tokens", "-1"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    lines = [line for line in bad.stderr.splitlines() if not line.startswith("import time:")]
    assert lines == ["cbatch: error: max_tokens must be an int >= 1, got -1"]
    assert "torch" not in imported_modules(bad.stderr)


def test_bare_cbatch_lists_its_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2
    out = capsys.readouterr().out
    assert all(command in out for command in ("demo", "generate", "serve"))


def test_the_demo_says_slower_when_continuous_batching_is_slower():
    from cbatch.entrypoints.cli.demo import speed_phrase

    assert speed_phrase(2.0, 1.0) == "2.00x faster"
    assert speed_phrase(1.0, 2.0) == "2.00x slower"


@pytest.mark.slow
def test_demo_without_matplotlib_runs_to_the_end(tmp_path, capsys, monkeypatch):
    """A plain pip install has no matplotlib: the demo says so in one line and succeeds."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    plot = tmp_path / "occupancy.png"
    main(["demo", "--model", "random:tiny", "--device", "cpu", "--scale", "0.25",
          "--plot", str(plot)])  # no SystemExit: exit status 0
    captured = capsys.readouterr()
    assert "greedy outputs identical: True" in captured.out
    assert ("cbatch demo: matplotlib is not installed, so no plot (pip install "
            "'cbatch[bench]', or pip install matplotlib)") in captured.err.splitlines()
    assert not plot.exists() and "occupancy plot:" not in captured.out


def test_a_user_error_is_one_line_unless_debugging():
    result = run_cli("generate", "--model", "random:tiny", "--device", "banana", "--prompt", "x")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "cbatch: error: device must be 'cpu', 'cuda' or 'cuda:<index>', got 'banana'; "
        "available here: " + ", ".join(__import__("cbatch.devices").devices.available_devices())]
    debug = run_cli("generate", "--model", "random:tiny", "--device", "banana", "--prompt", "x",
                    env={"CBATCH_DEBUG": "1"})
    assert debug.returncode == 1 and "Traceback" in debug.stderr
    with pytest.raises(ValueError, match="device must be"):
        main(["generate", "--model", "random:tiny", "--device", "banana", "--prompt", "x",
              "--debug"])


def test_a_hub_id_that_cannot_be_fetched_is_one_line():
    """What the README promises of every error: one line, here without network."""
    result = run_cli("generate", "--model", "some-org/not-a-model", "--prompt", "hi",
                     env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "cbatch: error: could not load 'some-org/not-a-model': it is not a local directory, "
        "and the Hugging Face hub is off here (HF_HUB_OFFLINE is set) and the local cache "
        "holds no copy of it"]


@pytest.mark.slow
def test_generate_as_a_user_runs_it():
    result = run_cli("generate", "--model", "random:tiny", "--device", "cpu", "--prompt",
                     "hello", "--max-tokens", "4", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("hello") and result.stdout.endswith("\n")
    assert "(length, 4 tokens" in result.stderr and "Traceback" not in result.stderr


# ---------------------------------------------------------------- vLLM's manners

def _subparsers() -> dict:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return dict(sub.choices)


@pytest.mark.slow
def test_version_names_the_version_and_the_live_backends():
    import cbatch
    from cbatch import ops

    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"cbatch {cbatch.__version__} (")
    assert lines[1].startswith("torch ")
    end = lines.index("cpu fast paths:")
    rows = {line.split()[0]: line.split()[1] for line in lines[3:end]}
    assert rows == {name: "live" if status.available else "off"
                    for name, status in ops.available_backends().items()}
    # isa, attention, linear, greedy screen, quantized linear, loading, decoder layers, huge
    # pages, threads
    assert len(lines) == end + 10
    assert lines[end + 5].split()[:2] == ["quantized", "linear"]
    assert lines[end + 6].split()[0] == "loading"
    assert lines[end + 7].split()[:2] == ["decoder", "layers"]


def test_every_flag_has_help_and_its_default_shown():
    for name, parser in _subparsers().items():
        text = parser.format_help()
        for action in parser._actions:
            if action.dest == "help":
                continue
            assert action.help, f"cbatch {name} {action.option_strings or action.dest}: no help"
            assert "default" in action.help or f"(default: {action.default})" in " ".join(
                text.split()), (name, action.option_strings)


def test_serve_help_lists_every_route():
    """Issue 74, finding 9: /v1/responses was served and not listed."""
    text = " ".join(_subparsers()["serve"].format_help().split())
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models",
                  "/tokenize", "/detokenize", "/version", "/health", "/metrics"):
        assert route in text, route


def test_a_setting_has_one_flag_name_in_every_command():
    """The same setting is spelled the same way wherever it appears (vLLM's engine args)."""
    flags: dict[str, set] = {}
    for parser in _subparsers().values():
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                flags.setdefault(action.dest, set()).add(tuple(action.option_strings))
    assert {dest: names for dest, names in flags.items() if len(names) > 1} == {}
    assert "policy" not in flags and "scheduling_policy" in flags


@pytest.mark.parametrize("argv,suggestion", [
    (["genrate", "--prompt", "x"], "did you mean 'generate'?"),
    (["generate", "--prompt", "x", "--mxa-tokens", "3"],
     "--mxa-tokens: did you mean --max-tokens?"),
    (["serve", "--max-num-sqes=4"], "did you mean --max-num-seqs?"),
    (["generate", "--prompt", "x", "--dtype", "flaot16"], "did you mean 'float16'?"),
])
def test_a_typo_gets_a_suggestion(argv, suggestion, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert suggestion in err, err
    if argv[0] == "generate":  # the subcommand's own usage line
        assert "usage: cbatch generate" in err


def test_serve_takes_the_model_as_its_argument():
    from cbatch.entrypoints.cli.serve import resolve_model

    parse = build_parser().parse_args
    for argv in (["serve", "gpt2"], ["serve", "--model", "gpt2"], ["serve", "gpt2", "--model",
                                                                    "gpt2"]):
        args = parse(argv)
        resolve_model(args)
        assert args.model == "gpt2"
    args = parse(["serve", "gpt2", "--model", "distilgpt2"])
    with pytest.raises(ValueError, match="two models given: 'gpt2' \\(positional\\) and "
                                         "--model 'distilgpt2'; give one"):
        resolve_model(args)
    for argv in (["serve"], ["generate", "--prompt", "x"], ["demo"]):
        args = parse(argv)
        resolve_model(args)
        assert args.model == "random:gpt2"  # the default
    args = parse(["serve", "random:gpt2", "--served-model-name", "gpt2", "--port", "8001"])
    resolve_model(args)
    assert (args.model, args.served_model_name, args.port) == ("random:gpt2", ["gpt2"], 8001)


def test_dtype_and_device_auto():
    import torch

    from cbatch.devices import auto_dtype
    from cbatch.entrypoints.cli.engine_args import resolve_device_and_dtype

    args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert (args.device, args.dtype) == ("auto", "auto")
    resolve_device_and_dtype(args)
    cuda = torch.cuda.is_available()
    expected = ("cuda", "float16") if cuda else ("cpu", auto_dtype("cpu"))
    assert (args.device, args.dtype) == expected
    assert auto_dtype("cpu") in ("float32", "bfloat16")  # bfloat16 where the CPU computes in it
    args = build_parser().parse_args(["generate", "--prompt", "x", "--device", "cpu",
                                      "--dtype", "bfloat16"])
    resolve_device_and_dtype(args)
    assert (args.device, args.dtype) == ("cpu", "bfloat16")


def test_a_prompt_too_long_is_refused_before_anything_is_printed(capsys, monkeypatch):
    stdout = Writes()
    monkeypatch.setattr(sys, "stdout", stdout)
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", "random:tiny", "--prompt", "x" * 5500])
    assert exit_.value.code == 2
    assert stdout.writes == []  # the prompt is not echoed, streamed or not
    (line,) = capsys.readouterr().err.splitlines()[-1:]
    assert line.startswith("cbatch: error: prompt ('xxxx") and "exceeds" in line
    assert len(line) < 200  # the prompt is named by its start, not printed whole


def test_an_error_names_the_prompt_of_a_batch(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--model", "random:tiny", "--prompt", "fine", "--prompt", "y" * 300,
              "--prompt", "also fine"])
    err = capsys.readouterr().err
    assert "cbatch: error: prompt 2 of 3 ('yyyy" in err
    assert "generate:" not in err  # no progress bar before the check


def test_max_model_len_caps_requests(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--model", "random:tiny", "--prompt", "hello", "--max-tokens", "8",
              "--max-model-len", "10"])
    assert "maximum length (10)" in capsys.readouterr().err
    main(["generate", "--model", "random:tiny", "--prompt", "hi", "--max-tokens", "4",
          "--max-model-len", "10", "--ignore-eos"])
    assert "(length, 4 tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--model", "random:tiny", "--prompt", "hi", "--max-model-len", "300"])
    assert "exceeds the model's context length (256)" in capsys.readouterr().err


def test_chat_template_is_a_file_or_the_template(tmp_path, capsys):
    from cbatch.entrypoints.openai.chat_utils import read_chat_template

    text = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    path = tmp_path / "chat.jinja"
    path.write_text(text)
    assert read_chat_template(str(path)) == text == read_chat_template(text)
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not parse"):
        read_chat_template("{% for m in messages %}")
    # checked before the model loads: the error comes at once, alone
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "random:tiny", "--chat-template", "{{ unclosed"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("cbatch: error: chat template")


def test_two_different_models_are_refused_not_one_dropped(capsys):
    """``serve gpt2 --model random:gpt2`` used to serve gpt2 (--model equal to its default
    looked like no --model at all)."""
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "gpt2", "--model", "random:gpt2"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "cbatch: error: two models given: 'gpt2' (positional) and --model 'random:gpt2'; "
        "give one"]


@pytest.mark.parametrize("argv, hidden, line", [
    (["serve", "random:tiny"], "fastapi",
     "cbatch serve needs the server's packages: pip install 'cbatch[serve]' (missing: "
     "fastapi)"),
    (["serve", "random:tiny", "--num-replicas", "2"], "ray",
     "cbatch serve --num-replicas needs Ray Serve: pip install 'cbatch[ray]' (missing: ray)"),
])
def test_serve_without_its_extra_names_the_extra(argv, hidden, line, capsys, monkeypatch):
    from cbatch.entrypoints.cli import serve

    monkeypatch.setitem(sys.modules, hidden, None)  # as if not installed
    monkeypatch.setattr(serve, "bind_socket", lambda *a: pytest.fail("bound a port"))
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 1
    assert capsys.readouterr().err.splitlines() == [f"cbatch: error: {line}"]


@pytest.mark.parametrize("replicas", ["1", "2"])
def test_a_busy_port_fails_before_the_model_loads(replicas, capsys, monkeypatch):
    """The port is bound before torch and the model load: a busy one is a one-line error
    at once, and the engine is never built."""
    import importlib.util
    import socket
    import time

    from cbatch.entrypoints.cli.serve import RAY_MODULES, SERVER_MODULES

    needs = RAY_MODULES if replicas == "2" else SERVER_MODULES
    if any(importlib.util.find_spec(m) is None for m in needs):
        pytest.skip(f"needs {', '.join(needs)}")
    from cbatch.entrypoints.openai import api_server

    monkeypatch.setattr(api_server, "build_engine", lambda *a, **k: pytest.fail("loaded"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.perf_counter()
        with pytest.raises(SystemExit) as exit_:
            main(["serve", "random:gpt2", "--host", "127.0.0.1", "--port", str(port),
                  "--num-replicas", replicas])
        elapsed = time.perf_counter() - start
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"cbatch: error: port {port} on 127.0.0.1 is in use (another server?); stop it or "
        "pick another with --port"]
    assert elapsed < 1.0


def test_a_busy_port_is_reported_by_a_real_cbatch_serve_at_once():
    """As a user's shell runs it: well under a second, though random:gpt2 takes seconds to
    build."""
    pytest.importorskip("fastapi")
    import socket
    import time

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.perf_counter()
        result = run_cli("serve", "random:gpt2", "--port", str(port))
        elapsed = time.perf_counter() - start
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"cbatch: error: port {port} on 127.0.0.1 is in use (another "
                             "server?); stop it or pick another with --port\n")
    assert elapsed < 3.0  # a fresh interpreter's start-up included; the model takes ~7 s


def test_a_blank_api_key_from_the_environment_is_refused(monkeypatch):
    """A key of spaces in $CBATCH_API_KEY is refused as --api-key '  ' is, not taken for "no
    key" (which would serve without one); a key is taken as it is, not stripped."""
    from cbatch.entrypoints.openai.cli_args import check_serve_args, guard_settings

    args = build_parser().parse_args(["serve", "random:tiny"])
    monkeypatch.setenv("CBATCH_API_KEY", "   ")
    with pytest.raises(ValueError, match="CBATCH_API_KEY must be a non-empty string"):
        check_serve_args(args)
    monkeypatch.setenv("CBATCH_API_KEY", " k ")
    check_serve_args(args)
    assert guard_settings(args)["api_key"] == " k "
    monkeypatch.delenv("CBATCH_API_KEY")
    assert guard_settings(args)["api_key"] is None

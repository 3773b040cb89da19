"""A vLLM user's ``vllm serve`` command line starts ``cbatch serve`` (issue 74, part 3): each
flag is applied where it means something here (a memory fraction sizes the KV cache on the
CPU as on a GPU, vLLM's dtype names, human-readable lengths, several served names), accepted
with one log line where it is always true, and refused by name where it cannot be."""

import argparse
import signal
import subprocess
import sys

import httpx
import pytest

from cbatch import LLM, EngineConfig
from cbatch.models.gpt2 import GPT2Config
from cbatch.entrypoints.cli.engine_args import engine_kwargs, human_readable_int
from cbatch.entrypoints.cli.main import build_parser, main
from cbatch.entrypoints.openai.cli_args import check_serve_args, vllm_notes
from cbatch.layers import kv_cache
from cbatch.layers.kv_cache import bytes_per_token, num_kv_blocks
from tests.serving_utils import free_port, running_server, wait_healthy

# the flags of a vLLM user's script, every one of them
VLLM_FLAGS = ["--gpu-memory-utilization", "0.9", "--tensor-parallel-size", "1",
              "--trust-remote-code", "--enable-chunked-prefill", "--disable-log-requests",
              "--dtype", "float", "--served-model-name", "tiny", "tiny-alias",
              "--max-model-len", "0.2k", "--enable-auto-tool-choice",
              "--tool-call-parser", "llama3_json"]


def _serve_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "random:tiny", *flags])


def test_a_vllm_command_line_parses_into_cbatchs_settings():
    args = _serve_args(*VLLM_FLAGS)
    check_serve_args(args)
    kwargs = engine_kwargs(args)
    assert kwargs["gpu_memory_utilization"] == 0.9 and kwargs["dtype"] == "float32"
    assert kwargs["max_model_len"] == 200
    assert args.served_model_name == ["tiny", "tiny-alias"]
    assert args.tool_call_parser == "llama3_json"
    assert _serve_args("--dtype", "half").dtype == "float16"
    assert _serve_args("-tp", "1").tensor_parallel_size == 1


@pytest.mark.parametrize("text, value", [
    ("32k", 32_000), ("32K", 32_768), ("25.6k", 25_600), ("1m", 1_000_000),
    ("1M", 1 << 20), ("2g", 2 * 10**9), ("1G", 1 << 30), ("1t", 10**12), ("1T", 1 << 40),
    ("4096", 4096), (" 8k ", 8000), ("-1", -1),
])
def test_human_readable_lengths_as_vllm_reads_them(text, value):
    assert human_readable_int(text) == value
    assert _serve_args("--max-num-batched-tokens", text.strip()).max_num_batched_tokens == value


def test_a_binary_suffix_takes_no_decimals_and_nonsense_is_refused(capsys):
    with pytest.raises(argparse.ArgumentTypeError, match="did you mean 1.5k"):
        human_readable_int("1.5K")
    with pytest.raises(SystemExit):
        _serve_args("--max-model-len", "32kb")
    assert "--max-model-len: invalid int (32k = 32000, 32K = 32768) value: '32kb'" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("flags, match", [
    (["--tensor-parallel-size", "2"], r"--tensor-parallel-size 2: cbatch runs a model on one "
                                      r"device .* --num-replicas 2 \(Ray Serve\)"),
    (["-tp", "4"], r"--tensor-parallel-size 4: .* --num-replicas 4"),
    (["--tensor-parallel-size", "0"], r"--tensor-parallel-size must be >= 1"),
    (["--no-enable-chunked-prefill"], r"--no-enable-chunked-prefill: cbatch always prefills"),
])
def test_what_cannot_be_is_refused_naming_the_flag(flags, match):
    with pytest.raises(ValueError, match=match):
        check_serve_args(_serve_args(*flags))


def test_a_refused_flag_is_a_one_line_error_before_anything_loads(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "random:tiny", "--tensor-parallel-size", "2"])
    assert exit_.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("cbatch: error: --tensor-parallel-size 2: ")


def test_what_is_always_true_is_accepted_with_one_log_line():
    assert vllm_notes(_serve_args()) == []
    notes = vllm_notes(_serve_args("--trust-remote-code", "--enable-chunked-prefill",
                                   "--disable-log-requests"))
    assert len(notes) == 2
    assert notes[0].startswith("--trust-remote-code: cbatch runs its own code")
    assert notes[1].startswith("--enable-chunked-prefill: always on in cbatch")


# ------------------------------------------------ --gpu-memory-utilization on a CPU


def test_a_memory_fraction_sizes_the_kv_cache_on_the_cpu(monkeypatch):
    """The fraction of the machine's memory, less the weights, at most what max_num_seqs
    sequences of max_model_len need."""
    model = GPT2Config.named("tiny")
    config = EngineConfig(gpu_memory_utilization=0.5, max_num_seqs=512)
    per_block = bytes_per_token(model, config.torch_dtype) * config.block_size
    total, weights = 64 * per_block + 1000, 3 * per_block
    monkeypatch.setattr(kv_cache, "device_memory", lambda device: (total, total))
    assert num_kv_blocks(config, model, weights) == (total // 2 - weights) // per_block
    few = EngineConfig(gpu_memory_utilization=0.5, max_num_seqs=1, max_model_len=32)
    assert num_kv_blocks(few, model, weights) == 32 // config.block_size + 1  # all it needs
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.01 leaves the KV cache no "
                                         r"room: .* in use \(the weights\); raise it"):
        num_kv_blocks(EngineConfig(gpu_memory_utilization=0.01), model, weights)
    monkeypatch.setattr(kv_cache, "device_memory", lambda device: (per_block, total))
    with pytest.raises(ValueError, match=r"more than the .* GiB free on cpu now; lower it"):
        num_kv_blocks(config, model, weights)


@pytest.mark.parametrize("value", [0, 1.5, -0.1, True, "0.9"])
def test_a_memory_fraction_is_in_0_1(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be a fraction in"):
        EngineConfig(gpu_memory_utilization=value)


def test_vllms_usual_fraction_runs_a_cpu_engine():
    llm = LLM("random:tiny", gpu_memory_utilization=0.9, max_num_seqs=4)
    assert llm.engine.worker.kv_cache.num_blocks == 4 * 256 // 16 + 1
    assert llm.generate([[1, 2, 3]], use_tqdm=False)[0].token_ids


# ---------------------------------------------------------- several served names


def test_every_served_name_answers_and_is_listed():
    with running_server(app_kwargs=dict(), name=["tiny", "tiny-alias"]) as (url, _):
        models = httpx.get(f"{url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["tiny", "tiny-alias"]
        for name in ("tiny", "tiny-alias"):
            r = httpx.post(f"{url}/v1/completions", timeout=60,
                           json={"model": name, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == name, r.text
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"model": "other", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404
        assert "serves 'tiny', 'tiny-alias'" in r.json()["error"]["message"]


# ------------------------------------------------- the command line, as a shell runs it


def test_a_vllm_users_command_line_starts_cbatch_serve():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cbatch", "serve", "random:tiny",
                             "--port", str(port), *VLLM_FLAGS], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout=120)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny", 200),
                                                                  ("tiny-alias", 200)]
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    assert "--trust-remote-code: cbatch runs its own code" in out, out
    assert "--enable-chunked-prefill: always on in cbatch" in out, out
    assert "(float32, cpu)" in out, out

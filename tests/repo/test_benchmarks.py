"""Each benchmark in --quick mode on tiny shapes: the harness works and checks correctness
(these are not speed tests)."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from cbatch import ops
from cbatch.ops import compiled, cpu

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import (  # noqa: E402
    bench_decode_attention, bench_decode_step, bench_linear, bench_mixed_step,
    bench_prefill_attention, bench_quant_matmul, bench_throughput, common)


# The benchmarks run on the GPU when there is one (their --device default), else the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STATUS = ops.available_backends()


def _expected_kernels(op: str) -> set[str]:
    """The rows of cbatch's own kernels a --quick run on DEVICE must time."""
    if DEVICE == "cpu":
        return {"cbatch-cpu"} if STATUS["cpu"].available else set()
    names = {"cbatch-triton"} if STATUS["triton"].available else set()
    if op == "decode_attention" and STATUS["cuda"].available:
        names.add("cbatch-cuda")
    return names


def _rows(out: Path, name: str) -> list[dict]:
    for ext in ("json", "csv", "md", "png"):
        assert (out / f"{name}.{ext}").stat().st_size > 0, f"{name}.{ext} missing"
    data = json.loads((out / f"{name}.json").read_text())
    assert data["device"] and data["command"] and data["versions"]["torch"]
    return data["rows"]


@pytest.mark.slow
@pytest.mark.parametrize("module,name", [(bench_decode_attention, "decode_attention"),
                                         (bench_prefill_attention, "prefill_attention")])
def test_attention_benchmarks(tmp_path, module, name):
    rows = _rows(module.main(["--quick", "--out", str(tmp_path), "--no-progress"]), name)
    ok = [r for r in rows if r["status"] == "ok"]
    expected = _expected_kernels(name) | {"sdpa-padded", "torch-reference"}
    assert expected <= {r["impl"] for r in ok}
    if name == "decode_attention":  # FlexAttention over the paged cache (torch >= 2.5)
        assert "flex-paged" in {r["impl"] for r in ok}
    assert not [r for r in rows if r["status"].startswith(("WRONG", "error"))]
    assert all(r["us"] > 0 for r in ok)


@pytest.mark.slow
def test_mixed_step_benchmark(tmp_path):
    rows = _rows(bench_mixed_step.main(["--quick", "--out", str(tmp_path), "--no-progress"]),
                 "mixed_step")
    # CPU: the C++ kernels and the reference; CUDA: GPT-2's own choice, Triton, the reference
    backends = ["auto", "triton", "torch"] if DEVICE == "cuda" else ["cpu", "torch"]
    assert {r["impl"] for r in rows} == {f"{b}-{s}" for b in backends
                                         for s in ("unified", "split")}
    assert all(r["status"] == "ok" and r["us"] > 0 for r in rows)
    for r in rows:  # each split row carries unified time / split time for its backend
        assert (r.get("speedup", 0) > 0) == r["impl"].endswith("-split")


@pytest.mark.slow
def test_decode_step_benchmark(tmp_path):
    rows = _rows(bench_decode_step.main(["--quick", "--out", str(tmp_path), "--no-progress"]),
                 "decode_step")
    assert [(r["mode"], r["batch"]) for r in rows] == [
        (mode, batch) for mode in ("eager", "graphs", "async") for batch in (1, 4)]
    assert all(r["floor_ms"] > 0 and 0 <= r["host_ms"] <= r["step_ms"] for r in rows)
    # the weights' read: sampled beside the steps, each run against the sample before it
    assert all(r["read_GBps"] > 0 and r["ratio_to_weight_read"] > 0 for r in rows)
    for r in rows:
        assert r["weight_read_ms"] == pytest.approx(r["weight_MB"] / r["read_GBps"])


@pytest.mark.slow
def test_throughput_benchmark(tmp_path):
    out = bench_throughput.main(["--quick", "--out", str(tmp_path), "--no-progress",
                                 "--workload", "seed", "longtail",
                                 "--engines", "cbatch-continuous", "cbatch-static",
                                 "hf-generate"])
    rows = _rows(out, "throughput")
    assert len(rows) == 6 and all(r["status"] == "ok" for r in rows)
    for r in rows:  # same weights, greedy: every engine produces the same tokens
        assert r["same_tokens_as_continuous"] == f"{r['requests']}/{r['requests']}"
    if DEVICE == "cpu":  # the decode step beside its floor, and the GEMM share
        for r in (r for r in rows if r["engine"] == "cbatch-continuous"):
            assert r["decode_step_ms"] > 0 and r["floor_ms"] > 0 and r["decode_batch"] >= 1
            assert 0 < r["compute_floor_ms"] < float("inf")
            assert r["paired_floor_ms"] > 0 and r["step_over_paired_floor"] > 0
            assert 0 < r["gemm_share"] < 1


@pytest.mark.slow
def test_throughput_benchmark_sampled(tmp_path):
    """--temperature/--top-p/--seed (as benchmarks/peers/ take them): every request sampled
    from its own seed, so the same tokens again with the prefix cache off."""
    out = bench_throughput.main(["--quick", "--out", str(tmp_path), "--no-progress",
                                 "--workload", "seed",
                                 "--engines", "cbatch-continuous", "cbatch-no-prefix-cache",
                                 "--temperature", "0.8", "--top-p", "0.95", "--seed", "7"])
    rows = {r["engine"]: r for r in _rows(out, "throughput-sampled")}
    assert all(r["status"] == "ok" for r in rows.values())
    off = rows["cbatch-no-prefix-cache"]
    assert off["same_tokens_as_continuous"] == f"{off['requests']}/{off['requests']}"
    meta = json.loads((out / "throughput-sampled.json").read_text())
    assert meta["sampling"] == "temperature 0.8, top_p 0.95, top-k off, request i seeded 7 + i"


def test_sampled_workload_seeds_each_request():
    """bench_throughput.sampled: request i at the temperature and top-p given, seed + i, its
    length exact as before; the seed workload's one prompt then gives different tokens."""
    from cbatch import LLM, workloads

    greedy = workloads.seed()
    wl = bench_throughput.sampled(workloads.seed(), 0.8, 0.95, 7)
    assert [(p.temperature, p.top_p, p.seed, p.max_tokens, p.ignore_eos) for p in wl.params] == [
        (0.8, 0.95, 7 + i, g.max_tokens, True) for i, g in enumerate(greedy.params)]
    assert bench_throughput.sampled(greedy, 0.0, 0.95, 7) is greedy
    outs = LLM("random:tiny").generate(wl.prompts[1:5], wl.params[1:5], use_tqdm=False)
    assert len({tuple(o.token_ids) for o in outs}) > 1


@pytest.mark.slow
def test_linear_benchmark(tmp_path):
    rows = _rows(bench_linear.main(["--quick", "--out", str(tmp_path), "--no-progress",
                                    "--reps", "2"]), "linear")
    routes = {"torch"} | ({"onednn", "onednn-packed"} if torch.backends.mkldnn.is_available()
                          else set())
    assert routes <= {r["route"] for r in rows}
    assert all(r["status"] == "ok" and r["min_us"] > 0 and r["floor_us"] > 0 for r in rows)
    assert all(r["max_abs_err"] < (1e-4 if r["dtype"] == "float32" else 0.1) for r in rows)


@pytest.mark.slow
def test_quant_matmul_benchmark(tmp_path):
    """Every route a row, within its quantization's error of the dense product (on CPU
    tensors in Triton's interpreter where there is no GPU)."""
    from tests.helpers import triton_device, triton_skip_reason

    if triton_device() is None:
        pytest.skip(triton_skip_reason())
    rows = _rows(bench_quant_matmul.main(["--quick", "--out", str(tmp_path), "--no-progress",
                                          "--reps", "2", "--device", triton_device()]),
                 "quant_matmul")
    assert {r["route"] for r in rows} == set(bench_quant_matmul.ROUTES)
    assert all(r["status"] == "ok" and r["median_us"] > 0 and r["floor_us"] > 0 for r in rows)
    assert all(r["max_rel_err"] < (1e-5 if r["route"] != "w8a8" else 0.05) for r in rows)


@pytest.mark.slow
def test_throughput_benchmark_sharedprefix(tmp_path):
    out = bench_throughput.main(["--quick", "--out", str(tmp_path), "--no-progress",
                                 "--workload", "sharedprefix",
                                 "--engines", "cbatch-continuous", "cbatch-no-prefix-cache"])
    rows = {r["engine"]: r for r in _rows(out, "throughput")}
    assert all(r["status"] == "ok" for r in rows.values())
    off, on = rows["cbatch-no-prefix-cache"], rows["cbatch-continuous"]
    assert off["same_tokens_as_continuous"] == f"{off['requests']}/{off['requests']}"
    assert off["prefix_cache_hit_rate"] == 0 and on["prefix_cache_hit_rate"] > 0


@pytest.mark.slow
def test_throughput_benchmark_batch_invariant(tmp_path):
    out = bench_throughput.main(["--quick", "--out", str(tmp_path), "--no-progress",
                                 "--workload", "longtail", "--engines", "cbatch-continuous",
                                 "--batch-invariant"])
    rows = _rows(out, "throughput-batch-invariant")
    assert [r["engine"] for r in rows] == ["cbatch-continuous", "cbatch-invariant"]
    assert all(r["status"] == "ok" and r["wall_vs_continuous"] > 0 for r in rows)


@pytest.mark.slow
def test_a_run_without_out_writes_a_new_folder_not_the_committed_results(tmp_path, monkeypatch):
    """Without --out a benchmark writes under benchmarks/runs/<time>-<device>/ (ignored by
    git); the committed benchmarks/results/ change only when --out names them."""
    results = Path(common.__file__).parent / "results"
    before = {p: p.stat().st_mtime_ns for p in results.rglob("*") if p.is_file()}
    monkeypatch.setattr(common, "RUNS", tmp_path / "runs")
    out = bench_mixed_step.main(["--quick", "--no-progress"])
    assert out.parent == tmp_path / "runs"
    assert out.name.endswith("-" + common.device_slug(torch.device(DEVICE)))
    _rows(out, "mixed_step")
    assert {p: p.stat().st_mtime_ns for p in results.rglob("*") if p.is_file()} == before
    gitignore = (Path(common.__file__).parents[1] / ".gitignore").read_text().split()
    assert "benchmarks/runs/" in gitignore


@pytest.mark.slow
def test_serving_burst_quick(tmp_path):
    """The served burst against the same requests offline: every request answered, the
    ratio to offline reported (a real `cbatch serve` on 127.0.0.1, stopped by its PID)."""
    from benchmarks import bench_serving_burst

    rows = _rows(bench_serving_burst.main(["--quick", "--out", str(tmp_path), "--no-progress",
                                           "--log-dir", str(tmp_path), "--device", "cpu"]),
                 "serving_burst")
    served, offline = rows
    assert served["failed"] == 0 and served["requests"] == 4 and served["vs_offline"] > 0
    assert served["output_tok_per_s"] > 0 and offline["output_tok_per_s"] > 0


def test_serving_burst_runs_llama_server_with_room_for_the_burst():
    """llama-server gets a slot per prompt (at most --max-num-seqs), each with room for its
    prompt and output; a binary without its .gguf is refused, and so is vLLM's client."""
    from benchmarks import bench_serving_burst as b

    class Args:
        llama_server, llama_model, served_model_name = "llama-server", "m.gguf", "model"
        llama_args = "--threads-http 1"
        num_prompts, max_num_seqs, input_len, output_len = 32, 64, 1024, 128

    cmd = b.llama_server_command(Args, 8123)
    flag = {k: v for k, v in zip(cmd, cmd[1:]) if k.startswith("--")}
    assert cmd[:3] == ["llama-server", "-m", "m.gguf"] and "--kv-unified" not in cmd
    assert flag["--parallel"] == "32" and flag["--port"] == "8123"
    assert int(flag["--ctx-size"]) >= 32 * (1024 + 128) and cmd[-2:] == ["--threads-http", "1"]
    with pytest.raises(SystemExit):
        b.main(["--llama-server", "llama-server", "--no-progress"])
    with pytest.raises(SystemExit):  # vLLM's client miscounts llama-server's tokens
        b.main(["--llama-server", "llama-server", "--llama-model", "m.gguf", "--client",
                "vllm", "--vllm-python", "python", "--vllm-model", "m", "--no-progress"])


@pytest.mark.slow
def test_spec_decode_quick(tmp_path):
    """Every method's greedy outputs equal the plain engine's; the replay ceiling's drafts
    all hold, drafts that never agree none, and prompt lookup some on the repeat workload."""
    from benchmarks import bench_spec_decode

    rows = _rows(bench_spec_decode.main(["--quick", "--out", str(tmp_path), "--no-progress",
                                         "--device", "cpu"]), "spec_decode")
    assert [(r["method"], r["batch"]) for r in rows] == [
        (m, b) for b in (1, 4) for m in bench_spec_decode.METHODS]
    by = {(r["method"], r["batch"]): r for r in rows}
    for r in rows:
        assert r["outputs_equal_plain"] == 1.0 and r["decode_tok_per_s"] > 0, r
        if r["method"] != "plain":
            assert r["verify_s"] > 0, r
    for b in (1, 4):
        assert by["replay", b]["acceptance_rate"] == 1.0
        assert by["replay", b]["mean_accepted_length"] > 4.0  # k = 4: 5 a step but the end
        assert by["ngram", b]["acceptance_rate"] > 0
        assert by["never", b]["acceptance_rate"] < 0.05
        # the adaptive rule stops the never-agreeing drafts: far fewer verified
        assert by["never-adaptive", b]["drafts"] < by["never", b]["drafts"] / 2


@pytest.mark.skipif("cpu" not in compiled.compiled_backends(), reason="needs cbatch's C++ CPU ops")
def test_throughput_benchmark_quantized(tmp_path):
    """--quantization int8 (as benchmarks/peers/alternate_quant.sh runs it): the quantized
    kernel runs, and the weight bytes a decode step reads count the packed int8 weights (one
    byte a weight, plus scales), not the float weights they replaced."""
    from cbatch import load_model
    from cbatch.layers.quantization import QuantizedLinear
    from cbatch.ops import cpu

    before = cpu.kernel_paths()
    out = bench_throughput.main(["--quick", "--out", str(tmp_path), "--no-progress",
                                 "--device", "cpu", "--model", "random:llama-tiny",
                                 "--workload", "seed", "--engines", "cbatch-continuous",
                                 "--quantization", "int8"])
    rows = _rows(out, "throughput-int8")
    assert [r["status"] for r in rows] == ["ok"]
    after = cpu.kernel_paths()
    assert sum(after[k] - before[k] for k in after if k.startswith("quantized_linear.w8")) > 0
    assert json.loads((out / "throughput-int8.json").read_text())["quantization"] == "int8"
    model = load_model("random:llama-tiny", quantization="int8")
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    weights = sum(m.in_features * m.out_features for m in layers)  # int8: a byte each
    others = sum(p.numel() * 4 for p in model.parameters())  # float32, not quantized
    got = bench_throughput.weight_bytes_of(model)
    assert others + weights < got <= others + weights + sum(16 * m.out_features for m in layers)


def test_quant_accuracy_measures_each_method_against_the_reference(tmp_path):
    """The reference against itself is KL 0 and top-1 1; each method gives every metric; the
    rows are written as JSON lines; the outlier shape's model loads."""
    from benchmarks import quant_accuracy

    out = tmp_path / "acc.jsonl"
    rows = quant_accuracy.main(["--model", "random:llama-tiny-outliers", "--dtype", "float32",
                                "--methods", "float32", "int4", "w8a8", "--prompts", "2",
                                "--prompt-len", "6", "--max-tokens", "4", "--out", str(out)])
    assert [r["method"] for r in rows] == ["float32", "int4", "w8a8"]
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
    same = rows[0]
    assert same["kl_mean"] == same["kl_max"] == 0 and same["top1"] == 1
    assert same["greedy_identical"] == 1 and same["positions"] == 2 * 4
    for row in rows[1:]:
        assert set(quant_accuracy.METRICS) <= set(row) and row["kl_max"] > 0
        assert "layers" in row and row["layers"] != "none"


def test_bench_load_times_a_cold_process_and_reads_its_memory(tmp_path):
    """Each method's row comes from its own process: times that add up, the resident set
    split into anonymous and file pages, and int8's weights smaller than float32's (a tiny
    model's float embedding and lm_head keep the ratio far from 4)."""
    from benchmarks import bench_load

    out = tmp_path / "load.jsonl"
    rows = bench_load.main(["--model", "random:llama-tiny", "--methods", "none", "int8",
                            "--threads", "1", "--kv-tokens", "64", "--out", str(out)])
    assert [(r["engine"], r["method"]) for r in rows] == [("cbatch", "none"), ("cbatch", "int8")]
    assert len(out.read_text().splitlines()) == 2
    for r in rows:
        assert 0 < r["load_s"] and 0 < r["first_token_s"] and 0 < r["import_s"]
        assert r["cold_s"] >= r["import_s"] + r["load_s"] + r["first_token_s"]
        assert r["rss"] >= r["anon"] > 0 and r["peak"] >= r["rss"]
    assert rows[1]["weights"] < 0.7 * rows[0]["weights"]


def test_throughput_linear_layers_include_quantized():
    """compute_floor and gemm_share count every linear layer: the quantized ones too (a
    W4A8 model's GEMM share once counted its lm_head alone)."""
    from cbatch import load_model
    from cbatch.layers.linear import Linear
    from cbatch.layers.quantization import QuantizedLinear

    model = load_model("random:llama-tiny", device="cpu", dtype=torch.float32,
                       quantization="int8")
    layers = bench_throughput.linear_layers(model)
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    dense = [m for m in model.modules() if isinstance(m, Linear)]
    assert quantized and dense  # the lm_head stays dense
    assert len(layers) == len(quantized) + len(dense)
    assert {id(m) for m in layers} == {id(m) for m in quantized + dense}


def test_gemm_share_times_the_loop_of_a_one_call_model():
    """gemm_share wraps the linear layers' forwards, which a Llama-family model's one C++ call
    a step (cbatch.models.cpu_layers) bypasses: its rerun runs the loop, so every decoder layer's
    linears are timed, and the call is bound again after."""
    from cbatch import LLM
    from cbatch.ops import cpu
    from cbatch.workloads import uniform

    llm = LLM("random:llama-tiny", max_num_seqs=4)
    bound = llm.engine.model.cpu_layers
    before = cpu.kernel_paths().get("decoder_layers.cpu", 0)
    share = bench_throughput.gemm_share(llm, uniform(vocab=500, scale=0.02, max_len=24), 4)
    assert 0 < share < 1
    assert cpu.kernel_paths().get("decoder_layers.cpu", 0) == before  # the loop ran
    assert llm.engine.model.cpu_layers is bound


def test_bench_spread_repeats_a_cell_and_counts_its_threads(tmp_path):
    """Every run of the cell is timed on the one engine, with the thread counts its steps
    took (on at most the allowed CPUs), the memory read measured before it and the cores' FMA
    rate before and after it (where a C compiler builds the loop), and written as it ends."""
    from benchmarks import bench_spread
    from cbatch.core.cpu.threads import allowed_cpus

    out = tmp_path / "spread.jsonl"
    rows = bench_spread.main(["--model", "random:llama-tiny", "--dtype", "float32",
                              "--scale", "0.125", "--runs", "2", "--out", str(out)])
    assert [r["run"] for r in rows] == [0, 1] and len(out.read_text().splitlines()) == 2
    for r in rows:
        assert r["wall_s"] > 0 and sum(r["steps_by_threads"].values()) > 0
        assert all(1 <= n <= len(allowed_cpus()) for n in r["steps_by_threads"])
        assert r["read_gb_s"] > 0.1 and (r["steal_share"] is None or r["steal_share"] >= 0)
        if shutil.which("cc") or shutil.which("gcc"):
            assert r["fma_before"] > 1 and r["fma_after"] > 1  # GFLOP/s
    # the same workload, scheduled alike: as many steps each run
    assert len({sum(r["steps_by_threads"].values()) for r in rows}) == 1


def test_bench_ttft_times_each_cells_first_token_per_step_budget(tmp_path, capsys):
    """One row per round, cell and step budget, each a TTFT that the engine measured (its
    requests' first tokens, the slowest no sooner than the median, within the call's wall),
    the prompts new every round; a cell is N or CxN."""
    from benchmarks import bench_ttft

    out = tmp_path / "ttft.jsonl"
    rows = bench_ttft.main(["--model", "random:llama-tiny", "--cells", "24", "3x16",
                            "--reps", "2", "--threads", "1", "--max-num-batched-tokens", "64",
                            "16", "--out", str(out)])
    assert [(r["rep"], r["cell"], r["engine"]) for r in rows] == [
        (rep, cell, f"cbatch (budget {b})") for rep in (0, 1) for cell in ("24", "3x16")
        for b in (64, 16)]
    assert len(out.read_text().splitlines()) == 8
    for r in rows:
        assert 0 < r["ttft_p50"] <= r["ttft_max"] <= r["wall_s"]
    assert bench_ttft.prompts_for("3x16", 0, 512) != bench_ttft.prompts_for("3x16", 1, 512)
    assert [len(p) for p in bench_ttft.prompts_for("3x16", 0, 512)] == [16] * 3
    assert "TTFT p50" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_ttft.main(["--model", "random:llama-tiny", "--cells", "2xa"])


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="no C compiler for the peak loops")
def test_bench_peak_measures_the_instructions_and_each_linear_against_its_own(tmp_path):
    """The peaks are positive rates (an int8 pair's 64 ops outrun an FMA's 16 on any AVX2
    core: at least as many a cycle; AVX-512's loops too where the CPU has VNNI and BF16);
    every linear of layer 0 at every row count has a rate and the kernel path its call ran,
    held to the int8 peak of that path when it takes int8 activations (vpdpbusd's on VNNI),
    else to the FMA's (zmm on AVX-512); so does the prefill attention of each chunk over each
    cached length.  A bf16 x on AVX512-BF16 is held to vdpbf16ps's."""
    from benchmarks import bench_peak

    bf16, fp32 = torch.bfloat16, torch.float32
    assert [bench_peak.route(path, dtype) for path, dtype in [
        ("linear.avx512", bf16), ("linear.avx512", fp32), ("linear.bf16.avx2", bf16),
        ("quantized_linear.w4.avx512bf16", bf16), ("quantized_linear.w8.avx512", bf16),
        ("quantized_linear.w8a8g.avx512vnni", fp32), ("quantized_linear.w8a8.avx2", fp32),
        ("quantized_linear.w4a8.amx", fp32), ("linear.amx", bf16), ("", fp32)]] == [
        "bf16", "fma512", "fma", "bf16", "fma512", "vnni", "int8", None, None, None]

    out = tmp_path / "peak.jsonl"
    result = bench_peak.main(["--model", "random:llama-tiny", "--methods", "none", "w4a8",
                              "--rows", "8", "16", "--threads", "1", "--reps", "1",
                              "--attention", "--cached", "0", "40", "--out", str(out)])
    peaks = result["peaks"]
    avx512 = {"avx512_vnni", "avx512_bf16"} <= bench_peak.cpu_flags()
    assert set(peaks) == {"fma", "int8", "vpmaddubsw"} | (
        {"fma512", "vnni", "bf16"} if avx512 else set()) and min(peaks.values()) > 1e8
    # integer ops a second against the FMA's FLOPs: 1.9x on Zen 3 (NOTES.md, "Prompt GEMMs
    # against the measured peak"), 0.97x on the KVM EPYC of 2026-12-07 (42.7 against 43.9 G
    # on one thread); a count off by 2x a pair would fall below half
    assert peaks["int8"] > 0.5 * peaks["fma"]
    isa = cpu.cpu_isa().split()
    int8 = "vnni" if "avx512vnni" in isa else "int8"
    fma = "fma512" if "avx512" in isa else "fma"
    rows = result["rows"]
    assert [(r["method"], r["M"], r["layer"]) for r in rows] == [
        (m, M, layer) for m in ("none", "w4a8") for M in (8, 16) for layer in bench_peak.LINEARS
    ] + [("attention", M, "attention") for _ in (0, 40) for M in (8, 16)]
    assert [r["cached"] for r in rows if r["layer"] == "attention"] == [0, 0, 40, 40]
    for r in rows:  # each held to the peak of the path its call ran (AMX tiles: none)
        assert r["GFLOPs"] > 0 and r["path"]
        if r["method"] == "w4a8":
            assert r["path"].startswith("quantized_linear.w4a8.")
            assert r["peak"] == (None if r["path"].endswith(".amx") else int8)
        elif r["method"] == "none":
            assert r["path"].startswith("linear.") and r["peak"] == (
                None if r["path"] == "linear.amx" else fma)
        else:
            assert r["path"].startswith("prefill_attention.") and r["peak"] == fma
        assert (r["of_peak"] is None) == (r["peak"] is None)
    assert len(out.read_text().splitlines()) == 1 + len(rows)


def test_bench_load_runs_a_gguf_file_without_and_with_the_file_cache(tmp_path):
    """A .gguf's rows: the cache off, written, then read back (the entry the write left is
    there before the read's load, none before the others'), llama-server's row not asked."""
    from benchmarks import bench_load
    from tests.models.test_gguf_models import make_files

    file, _, _ = make_files("llama", tmp_path, type_of=lambda name: "Q4_0")
    rows = bench_load.main(["--model", str(file), "--threads", "1", "--kv-tokens", "64"])
    assert [(r["cache"], r["entries_before"]) for r in rows] == \
        [("off", 0), ("write", 0), ("read", 1)]
    for r in rows:
        assert 0 < r["load_s"] and r["rss"] >= r["anon"] > 0

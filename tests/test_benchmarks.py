"""Each benchmark in --quick mode on tiny shapes: the harness works and checks correctness
(these are not speed tests)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import (  # noqa: E402
    bench_decode_attention, bench_decode_step, bench_mixed_step, bench_prefill_attention,
    bench_throughput)


def _rows(out: Path, name: str) -> list[dict]:
    for ext in ("json", "csv", "md", "png"):
        assert (out / f"{name}.{ext}").stat().st_size > 0, f"{name}.{ext} missing"
    data = json.loads((out / f"{name}.json").read_text())
    assert data["device"] and data["command"] and data["versions"]["torch"]
    return data["rows"]


@pytest.mark.parametrize("module,name", [(bench_decode_attention, "decode_attention"),
                                         (bench_prefill_attention, "prefill_attention")])
def test_attention_benchmarks(tmp_path, module, name):
    rows = _rows(module.main(["--quick", "--out", str(tmp_path), "--no-progress"]), name)
    ok = [r for r in rows if r["status"] == "ok"]
    assert {"cbatch-cpu", "sdpa-padded", "torch-reference"} <= {r["impl"] for r in ok}
    if name == "decode_attention":  # FlexAttention over the paged cache (torch >= 2.5)
        assert "flex-paged" in {r["impl"] for r in ok}
    assert not [r for r in rows if r["status"].startswith(("WRONG", "error"))]
    assert all(r["us"] > 0 for r in ok)


def test_mixed_step_benchmark(tmp_path):
    rows = _rows(bench_mixed_step.main(["--quick", "--out", str(tmp_path), "--no-progress"]),
                 "mixed_step")
    assert {r["impl"] for r in rows} == {"cpu-unified", "cpu-split", "torch-unified",
                                         "torch-split"}
    assert all(r["status"] == "ok" and r["us"] > 0 for r in rows)
    for r in rows:  # each split row carries unified time / split time for its backend
        assert (r.get("speedup", 0) > 0) == r["impl"].endswith("-split")


def test_decode_step_benchmark(tmp_path):
    rows = _rows(bench_decode_step.main(["--quick", "--out", str(tmp_path), "--no-progress"]),
                 "decode_step")
    assert [r["batch"] for r in rows] == [1, 4]
    assert all(r["step_ms"] > 0 and r["floor_ms"] > 0 for r in rows)


def test_throughput_benchmark(tmp_path):
    out = bench_throughput.main(["--quick", "--out", str(tmp_path), "--no-progress",
                                 "--workload", "seed", "longtail",
                                 "--engines", "cbatch-continuous", "cbatch-static",
                                 "hf-generate"])
    rows = _rows(out, "throughput")
    assert len(rows) == 6 and all(r["status"] == "ok" for r in rows)
    for r in rows:  # same weights, greedy: every engine produces the same tokens
        assert r["same_tokens_as_continuous"] == f"{r['requests']}/{r['requests']}"


def test_throughput_benchmark_batch_invariant(tmp_path):
    out = bench_throughput.main(["--quick", "--out", str(tmp_path), "--no-progress",
                                 "--workload", "longtail", "--engines", "cbatch-continuous",
                                 "--batch-invariant"])
    rows = _rows(out, "throughput-batch-invariant")
    assert [r["engine"] for r in rows] == ["cbatch-continuous", "cbatch-invariant"]
    assert all(r["status"] == "ok" and r["wall_vs_continuous"] > 0 for r in rows)

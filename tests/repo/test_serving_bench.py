"""bench_serving.py --quick: the harness starts a server, drives it at two Poisson rates and
writes its tables and plot (not a speed test)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import bench_serving  # noqa: E402

pytest.importorskip("fastapi")


@pytest.mark.slow
def test_serving_benchmark_quick(tmp_path):
    out = bench_serving.main(["--quick", "--out", str(tmp_path), "--no-progress"])
    for ext in ("json", "csv", "md", "png"):
        assert (out / f"serving.{ext}").stat().st_size > 0
    rows = json.loads((out / "serving.json").read_text())["rows"]
    assert [r["rate"] for r in rows] == [4.0, 16.0]
    for r in rows:
        assert r["requests"] == 6 and 0 < r["ttft_p50"] <= r["e2e_p99"]
        assert r["output_tok_per_s"] > 0 and 0 <= r["goodput"] <= r["req_per_s"]

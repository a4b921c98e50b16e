"""The benchmark suite runs (a small smoke run: the real one is `make bench`)."""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The variants each round times once.
VARIANTS = ("fwd ours", "fwd floor", "fwd jnp", "fwd+bwd ours", "fwd+bwd floor", "fwd+bwd jnp",
            "res fused", "res unfused", "res jnp", "fwd offset", "fwd+bwd offset", "fwd mixed",
            "fwd+bwd mixed", "res grad fused", "res grad unfused", "ln fwd ours", "ln fwd jnp",
            "ln fwd+bwd ours", "ln fwd+bwd jnp")


def test_bench_quick_run(tmp_path):
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "bench.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "fwd ms" in result.stdout
    assert "caches: as the variant before left them" in result.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["evicted_bytes"] == 0 and results["evictions"] == 0
    rows = results["rows"]
    # --quick: two shapes in each of the three dtypes.
    assert sorted((tuple(r["shape"]), r["dtype"]) for r in rows) == sorted(
        (shape, dtype) for shape in ((8, 128), (64, 256)) for dtype in ("float32", "bfloat16", "float16"))
    for row in rows:
        for key in VARIANTS:
            assert row[key] > 0
        lo, hi = row["fwd / floor spread"]
        assert lo <= row["fwd / floor"] <= hi
    assert "residual add + norm" in result.stdout
    assert "LayerNorm with weight and bias" in result.stdout
    # The accuracy sweep (--quick: three float32 shapes), ours and jnp in eps of float32.
    assert "accuracy against a long-double truth" in result.stdout
    assert [(r["dtype"], r["rows"], r["n"]) for r in results["accuracy"]] == [
        ("float32", 8, 4096), ("float32", 2, 1 << 16), ("float32", 1 << 12, 64)]
    for row in results["accuracy"]:
        assert all(0 < e <= 2 for e in row["ours"]) and all(e > 0 for e in row["jnp"]), row
    # The sharded case: 4 host devices, explicit and automatic meshes, ours and jnp.
    assert "sharded fwd+bwd" in result.stdout and "4 host devices" in result.stdout
    sharded = results["sharded"]
    assert sorted((r["mesh"], r["impl"]) for r in sharded) == [
        ("auto", "jnp"), ("auto", "ours"), ("explicit", "jnp"), ("explicit", "ours")]
    for row in sharded:
        assert row["devices"] == 4
        for key in ("wall ms", "one device ms", "replicated ms"):
            assert row[key] > 0
        if row["impl"] == "ours":  # rows run per shard: nothing gathered
            assert row["all_gathers"] == 0, row
    assert len(re.findall(r"all-gathers \d+", result.stdout)) == 4, result.stdout


def test_bench_evict_run(tmp_path):
    """--evict (a diagnosis) writes its buffer before every timed call and says so."""
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "bench.py"), "--evict", "--shapes", "8x128",
         "--dtypes", "float32", "--reps", "1", "--no-accuracy", "--sharded-devices", "0",
         "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert re.search(r"caches: evicted before every timed call \(\d+ MiB written\)", result.stdout), result.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["evicted_bytes"] >= 64 << 20
    (row,) = results["rows"]
    assert row["rounds"] == 10 and row["fwd ours"] > 0 and row["fwd floor"] > 0
    # One eviction before each timed call: every variant, every round.
    assert results["evictions"] == row["rounds"] * len(VARIANTS)

"""The benchmark suite runs (a small smoke run: the real one is `make bench`)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_quick_run(tmp_path):
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "bench.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "fwd ms" in result.stdout
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == 4
    for row in rows:
        for key in ("fwd ours", "fwd floor", "fwd jnp", "fwd+bwd ours", "fwd+bwd floor", "fwd+bwd jnp"):
            assert row[key] > 0

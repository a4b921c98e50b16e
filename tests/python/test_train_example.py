"""`examples/train.py` (what `make demo` runs), with tiny settings: it trains, compares, reports."""

import pathlib
import re
import subprocess
import sys



SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train.py"


def test_train_example_runs_and_reports():
    args = ["--steps", "15", "--width", "16", "--layers", "1", "--heads", "2", "--batch", "4", "--seq-len", "16"]
    result = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "15/15 loss" in out
    assert re.search(r"final loss \(mean of last 10 steps\): rmsnorm_ffi [0-9.]+, jnp [0-9.]+ .*: agree", out), out
    assert re.search(r"speed .*: rmsnorm_ffi [0-9.]+ steps/s, jnp [0-9.]+ steps/s", out), out
    # One block: 3 norm call sites, each with a forward and a backward state; 15 steps run each once.
    assert "states instantiated: 6 " in out, out
    assert "norm executions that reused them: 84 of 90" in out, out
    assert "workspace allocations after warm-up (10 steps): 0 " in out, out


def test_train_example_rejects_bad_flags():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--width", "10", "--heads", "4"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "--width must be a multiple of --heads" in result.stderr

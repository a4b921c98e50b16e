"""`examples/train.py` (what `make demo` runs), with tiny settings: it trains, compares, reports;
and with `--devices 2`, data-parallel under an explicit mesh, it reports the same losses."""

import pathlib
import re
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train.py"
TINY = ["--steps", "15", "--width", "16", "--layers", "1", "--heads", "2", "--batch", "4", "--seq-len", "16"]
FINAL = re.compile(r"final loss \(mean of last 10 steps\): rmsnorm_ffi ([0-9.]+), jnp ([0-9.]+) .*: agree")


def run_train(*extra):
    result = subprocess.run([sys.executable, str(SCRIPT), *TINY, *extra], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def one_device():
    return run_train()


def test_train_example_runs_and_reports(one_device):
    out = one_device
    assert "(1 device)" in out and "data-parallel" not in out
    assert "15/15 loss" in out
    assert FINAL.search(out), out
    assert re.search(r"speed .*: rmsnorm_ffi [0-9.]+ steps/s, jnp [0-9.]+ steps/s", out), out
    # One block: 3 norm call sites, each with a forward and a backward state; 15 steps run each once.
    assert "states instantiated: 6 " in out, out
    assert "norm executions that reused them: 84 of 90" in out, out
    assert "workspace allocations after warm-up (10 steps): 0 " in out, out


def test_train_example_on_two_devices_matches_one(one_device):
    out = run_train("--devices", "2")
    assert "(2 devices)" in out, out
    stated = re.search(r"data-parallel over 2 devices \(explicit mesh.*within ([0-9.e-]+)", out)
    assert stated, out
    tolerance = float(stated.group(1))
    assert tolerance <= 0.02
    for ours, one in zip(FINAL.search(out).groups(), FINAL.search(one_device).groups()):
        assert abs(float(ours) - float(one)) <= tolerance, (ours, one)
    # The same 6 states (one per call site, shared by both devices), each run on both devices.
    assert "states instantiated: 6 " in out, out
    assert "norm executions that reused them: 174 of 180" in out, out
    assert re.search(r"workspace allocations after warm-up \(10 steps\): \d+ \(total \d+, .*: 12\)", out), out


def test_train_example_rejects_bad_flags():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--width", "10", "--heads", "4"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "--width must be a multiple of --heads" in result.stderr
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--devices", "3", "--batch", "4"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "--batch must be a multiple of --devices" in result.stderr

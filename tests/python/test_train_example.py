"""`examples/train.py` (what `make demo` runs), with tiny settings that cannot learn in 15 steps:
it trains, evaluates on held-out problems, compares the norms and the device counts, reports the
state story and the norm's time, exits 1 when the model did not learn, and without matplotlib
still runs and says how to get the plot. (`make demo` itself, a run that learns, is run by
test_readme.py.)"""

import pathlib
import re
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train.py"
TINY = ["--steps", "15", "--width", "16", "--layers", "1", "--heads", "2", "--batch", "4", "--held-out", "8",
        "--eval-every", "5"]
ROW = r"{} +([0-9.]+) +([0-9.]+) +(\d+)/8 \(([0-9.]+)%\) +([0-9.]+) +[0-9.]+s"


def run_train(*extra, expect=0, env=None):
    result = subprocess.run([sys.executable, str(SCRIPT), *TINY, *extra], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == expect, result.stdout + result.stderr
    return result.stdout


def row(out, label):
    found = re.search(ROW.format(re.escape(label)), out)
    assert found, (label, out)
    return [float(v) for v in found.groups()]


@pytest.fixture(scope="module")
def two_devices(tmp_path_factory):
    plot = tmp_path_factory.mktemp("plot") / "train.png"
    return run_train("--devices", "2", "--min-accuracy", "0", "--plot", str(plot)), plot


def test_a_model_that_did_not_learn_fails_and_no_matplotlib_still_runs(tmp_path):
    # matplotlib made unimportable: the script says so and how to get it, and still runs.
    blocked = tmp_path / "blocked" / "matplotlib"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('blocked by the test')\n")
    env = dict(__import__("os").environ, PYTHONPATH=str(blocked.parent))
    plot = tmp_path / "train.png"
    out = run_train("--plot", str(plot), expect=1, env=env)
    assert "(1 device)" in out and "data-parallel" not in out and "2 devices" not in out
    assert re.search(r"--plot: matplotlib is not installed.*pip install matplotlib", out), out
    assert "plot: not written (matplotlib is not installed" in out and not plot.exists()
    assert "15/15 loss" in out and "held-out" in out
    # Held-out problems with both models' answers, then the table.
    assert len(re.findall(r"^  \d{3}\+\d{3}=\d+ +rmsnorm_ffi +\d+ (ok|WRONG) +jnp \(flax\) +\d+ (ok|WRONG)$", out, re.M)) == 8
    assert row(out, "rmsnorm_ffi, 1 device")[3] < 90
    assert "learned: every run at least 90% held-out exact match: NO" in out
    assert re.search(r"rmsnorm_ffi vs jnp, 1 device: loss at each of the first 15 steps within \S+ \(tolerance "
                     r"0.0001\), final loss \S+ \(0.02\), accuracy [0-9.]+ points \(2\): agree", out), out
    # One block: 3 norm call sites, a forward and a backward state each; 3 forward states in the
    # evaluation, which runs 4 times (before training, after steps 5, 10, 15), 4 decoding passes each.
    assert "states instantiated: 9: 6 in the train step (one per norm call site: 3 forward, 3 backward), " \
           "3 in the evaluation" in out, out
    assert "executions per state: train step 15 (15 steps, once per step), evaluation 16 " \
           "(4 evaluations x 4 decoding passes); 129 of 138 norm executions reused a state" in out, out
    assert "workspace allocations after warm-up (10 steps): 0 " in out, out
    assert re.search(r"1 device, 4x11x16: rmsnorm_ffi \d+ us, jnp \d+ us per norm; x 3 norms", out), out
    assert out.rstrip().splitlines()[-1].startswith("FAILED: rmsnorm_ffi, 1 device did not learn: held-out accuracy")


def test_two_devices_side_by_side_with_one(two_devices):
    out, plot = two_devices
    assert "(2 devices)" in out, out
    assert re.search(r"then again data-parallel over 2 devices \(explicit mesh.*within 0.02", out), out
    rows = {label: row(out, label) for label in ("rmsnorm_ffi, 1 device", "jnp (flax), 1 device",
                                                   "rmsnorm_ffi, 2 devices", "jnp (flax), 2 devices")}
    for label in ("rmsnorm_ffi", "jnp (flax)"):
        one, two = rows[f"{label}, 1 device"], rows[f"{label}, 2 devices"]
        assert abs(one[1] - two[1]) <= 0.02, (one, two)
        assert re.search(rf"2 devices vs 1, {re.escape(label)}: final loss .*: agree", out), out
    assert re.search(r"rmsnorm_ffi vs jnp, 2 devices: .*: agree", out), out
    # The same 9 states (one per call site, shared by both devices), each run on both devices;
    # at most one workspace per device per state.
    assert out.count("states instantiated: 9: 6 in the train step") == 2, out
    assert "executions per state: train step 30 (15 steps, once per step on each of 2 devices), evaluation 32 " \
           "(4 evaluations x 4 decoding passes x 2 devices); 267 of 276 norm executions reused a state" in out, out
    assert re.search(r"workspace allocations after warm-up \(10 steps\): \d+ \(total \d+, .*: 18\)", out), out
    assert re.search(r"2 devices, 2x11x16 each: rmsnorm_ffi \d+ us, jnp \d+ us per norm", out), out
    assert "FAILED" not in out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plot: not written" in out
    else:
        assert f"plot: {plot}" in out and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_example_rejects_bad_flags():
    for flags, message in ((["--width", "10", "--heads", "4"], "--width must be a multiple of --heads"),
                           (["--devices", "3", "--batch", "4"], "must be multiples of --devices"),
                           (["--digits", "1", "--held-out", "60"], "--held-out must be at most half")):
        result = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stderr
        assert message in result.stderr

"""The stress harness (`python -m rmsnorm_ffi.stress`), run as users run it: in a fresh
process, reading its JSON summary and exit status. Sized for a 2-core CI machine."""

import dataclasses
import json
import subprocess
import sys

import pytest

from rmsnorm_ffi import stress

# What a churn of 500 compile/run/drop cycles (450 after the warm-up tenth) may add to glibc's
# heap in use (mallinfo2, every arena), as the trend through the harness's settled samples. It
# used to be RSS, bounded at 16 MB: RSS carries the allocator's settling (arenas holding what 16
# threads freed: their held heap rose by 40-60 MB over a churn while the heap in use stayed flat),
# which moved it by several MB from run to run, and clean runs read up to 16.4. Measured with
# bench/churn_memory.py (the same churn at 500, 2000 and 8000 cycles): the heap in use grows by
# 0.5 MB at most over a churn and not with its length; see the README's stress section. A planted
# leak of 10 KB per cycle (1 MB per 100) reads about 4.4 and must fail this bound (tested below).
HEAP_GROWTH_BOUND_MB = 2.0
SPECS = "tests/python/stress_specs.py"


def run_stress(tmp_path, *options, timeout=900):
    out = tmp_path / "summary.json"
    result = subprocess.run(
        [sys.executable, "-m", "rmsnorm_ffi.stress", "--quiet", "--json", str(out), *options],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.exists(), f"no summary (exit {result.returncode}):\n{result.stdout}\n{result.stderr[-3000:]}"
    summary = json.loads(out.read_text())
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-3000:]}"
    assert summary["ok"] and "OK" in result.stdout.splitlines()[-1]
    summary["stdout"] = result.stdout
    return summary


def churn_leak(summary) -> str | None:
    """Why the churn's memory looks leaked, or None."""
    growth = summary["churn_heap_growth_mb"]
    if growth is None:
        return f"no heap figure (glibc's mallinfo2 is missing): {summary['churn_samples'][:1]}"
    if growth >= HEAP_GROWTH_BOUND_MB:
        return f"heap in use grew by {growth} MB over {summary['churn_cycles']} cycles (bound {HEAP_GROWTH_BOUND_MB})"
    return None


def assert_clean(summary):
    assert summary["mismatches"] == 0 and summary["errors"] == 0, summary["examples"]
    assert summary["states_leaked"] == 0
    assert summary["states_created"] == summary["states_destroyed"] > 0


def test_sixteen_threads_four_executables_and_500_churn_cycles(tmp_path):
    summary = run_stress(tmp_path, "-t", "16", "-k", "4", "-n", "200", "--churn-cycles", "500")
    assert_clean(summary)
    assert summary["calls"] >= 16 * 4 * 200 + 500
    assert summary["churn_cycles"] >= 500
    # Every worker executable's states and every churn executable's states were made and freed.
    assert summary["states_created"] >= 4 + 500
    assert churn_leak(summary) is None, summary


def test_one_executable_from_many_threads_shares_one_state_per_call_site(tmp_path):
    # A weighted gradient over 128x4096 bf16: two call sites (forward and backward), and a
    # backward split into chunks whose weight-gradient partials come from the state's pool.
    summary = run_stress(
        tmp_path, "-t", "16", "-k", "1", "-n", "200", "--no-churn",
        "--kinds", "grad+w", "--shapes", "128x4096", "--dtypes", "bfloat16",
    )
    assert_clean(summary)
    # The warm-up call, 200 rounds per thread, and 3 steady rounds per thread after them.
    calls = 1 + 16 * 200 + 16 * 3
    assert summary["calls"] == calls
    assert summary["states_created"] == 2  # one state per call site, for every execution
    assert summary["executions"] == {"rmsnorm_fwd": calls, "rmsnorm_bwd": calls}
    # The pool grows to the number of executions in flight at once, never per call.
    assert summary["workspace_allocations_during_run"] <= 16
    assert summary["workspace_allocations_after_warmup"] <= 16 and summary["steady_calls"] == 16 * 3


def test_four_host_devices_one_state_serves_all(tmp_path):
    summary = run_stress(
        tmp_path, "--devices", "4", "-t", "16", "-k", "4", "-n", "200", "--churn-cycles", "500",
    )
    assert_clean(summary)
    assert summary["devices"] == 4
    assert summary["calls"] >= 16 * 4 * 200 + 500
    assert churn_leak(summary) is None, summary


def test_a_planted_leak_of_1_mb_per_100_cycles_fails_the_churn_check(tmp_path):
    # The churn of test_four_host_devices_one_state_serves_all (fewer worker rounds: the leak is
    # in the churn), with our RMS norm keeping 10 KB per compile.
    summary = run_stress(
        tmp_path, "--spec", f"{SPECS}:LEAKING_RMS_NORM", "--devices", "4", "-t", "16", "-k", "4", "-n", "50",
        "--churn-cycles", "500",
    )
    assert_clean(summary)  # results and states are fine: only the memory check can tell
    problem = churn_leak(summary)
    assert problem is not None and "heap in use grew" in problem, summary["churn_heap_growth_mb"]
    # 450 cycles after the warm-up tenth keep 4.4 MB.
    assert 3.5 <= summary["churn_heap_growth_mb"] <= 6, summary["churn_heap_growth_mb"]


def test_four_host_devices_explicit_mesh(tmp_path):
    # The arrays carry their shardings (rows over an explicit mesh) and the programs are
    # compiled under jax.set_mesh: the primitives partition the calls themselves.
    summary = run_stress(
        tmp_path, "--devices", "4", "--mesh", "explicit", "-t", "4", "-k", "3", "-n", "25", "--churn-cycles", "10",
        "--shapes", "16x1000,32x256,64x512,8x4096",
    )
    assert_clean(summary)
    assert summary["devices"] == 4 and summary["mesh"] == "explicit"
    assert summary["calls"] >= 4 * 3 * 25 + 10
    # Rows run per shard: no gather in any compiled program, and every call ran on 4 devices.
    assert summary["all_gathers"] == 0
    assert all(n % 4 == 0 for n in summary["executions"].values()), summary["executions"]
    assert summary["executions"]["rmsnorm_fwd"] >= 4 * summary["calls"]  # every call runs a forward
    assert "on 4 devices (explicit mesh)" in summary["stdout"]
    assert "all-gathers in the 3 compiled programs: 0" in summary["stdout"]


def test_growth_is_the_trend_through_one_worker_phase():
    # A leak of 10 KB per cycle, under a step: 16 workers hold 4 MB more until cycle 100.
    mb = 2**20

    def sample(cycle, running):
        heap = 30 * mb + 10240 * cycle + (4 * mb if running else 0)
        return {"cycle": cycle, "heap_in_use": heap, "rss": 200 * mb + heap, "workers_running": running}

    samples = [sample(c, 16 if c <= 100 else 0) for c in range(25, 501, 25)] + [sample(500, 0)]
    # From the warm-up tenth (cycle 50) to the last: 450 cycles of 10 KB, the step left out.
    assert stress._growth_mb(samples, "heap_in_use") == round(450 * 10240 / mb, 1) == 4.4
    assert stress._growth_mb(samples, "rss") == 4.4
    # Through all the samples, the step would have read as 1.6 MB: a leak hidden by the workers.
    plain = [{**s, "workers_running": 0} for s in samples]
    assert stress._growth_mb(plain, "heap_in_use") < 2
    # Workers running through the whole churn: the samples with them, not the last alone.
    busy = [sample(c, 16) for c in range(25, 501, 25)] + [sample(500, 0)]
    assert stress._growth_mb(busy, "heap_in_use") == 4.4
    # Too few samples, or no figure: not measured.
    assert stress._growth_mb(samples[-1:], "heap_in_use") is None
    assert stress._growth_mb([{**s, "heap_in_use": None} for s in samples], "heap_in_use") is None


def test_an_rss_trend_through_two_samples_is_reported_not_judged():
    # The samples of the README's 5 s run on CI that read 26.6 MB (workers at cycles 25 and 50,
    # stopped at 55): the trend is the difference of two samples, too few to judge.
    mb = 2**20
    short = [{"cycle": c, "rss": r * mb, "workers_running": w} for c, r, w in ((25, 230.9, 8), (50, 245.4, 8), (55, 243.4, 0))]
    assert stress._growth_mb(short) == 17.4
    assert stress._trend_points(short) == 2 < stress.RSS_TREND_MIN_SAMPLES
    # A control of the same length has no workers: its three samples are one group.
    control = [{**s, "workers_running": 0} for s in short]
    assert stress._trend_points(control) == 3
    # The default 10 s run (~110 cycles) samples at 25, 50, 75 and 100 with the workers.
    longer = [{"cycle": c, "rss": 0, "workers_running": 8} for c in (25, 50, 75, 100)] + [
        {"cycle": 110, "rss": 0, "workers_running": 0}]
    assert stress._trend_points(longer) == 4


def test_help_explains_the_options():
    result = subprocess.run([sys.executable, "-m", "rmsnorm_ffi.stress", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for option in ("--threads", "--executables", "--calls", "--seconds", "--seed", "--devices", "--churn-cycles", "--mesh"):
        assert option in result.stdout


def test_bad_options_are_refused():
    result = subprocess.run(
        [sys.executable, "-m", "rmsnorm_ffi.stress", "--dtypes", "int8"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "expected some of" in result.stderr


def test_a_wrong_result_fails_the_run(capsys):
    # The harness must notice: the RMS norm spec with a reference that is off by one.
    spec = stress.rms_norm_spec(shapes=[(4, 64)])
    wrong = dataclasses.replace(spec, reference=lambda *a, **k: [v + 1.0 for v in stress.numpy_reference(*a, **k)])
    report = wrong.run(threads=2, executables=2, calls=3, churn=False, steady_rounds=0, progress=False)
    out = capsys.readouterr().out
    assert report.exit_status == 1 and not report.ok
    # Every call mismatched: 2 threads x 2 executables x 3 rounds, and the 2 warm-up calls.
    assert report.calls == report.mismatches == 14
    assert "calls: 14 " in out and "mismatches: 14 " in out, out
    assert "differs from the reference" in out and out.strip().endswith("FAILED")


def test_a_leaked_state_fails_the_run(monkeypatch, capsys):
    # Keeping one executable alive past the end is a leak the harness must report.
    kept = []
    real_init = stress.Executable.__init__

    def keep(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        kept.append(self)

    monkeypatch.setattr(stress.Executable, "__init__", keep)
    status = stress.main(["-q", "-t", "1", "-k", "1", "-n", "1", "--no-churn", "--shapes", "4x64", "--kinds", "fwd"])
    out = capsys.readouterr().out
    assert status == 1 and "leaked 1" in out
    kept.clear()


@pytest.mark.parametrize("seconds", ["1"])
def test_time_limited_run(tmp_path, seconds):
    summary = run_stress(tmp_path, "-t", "4", "-k", "2", "-s", seconds, "--shapes", "8x128")
    assert_clean(summary)
    assert summary["seconds"] >= float(seconds)

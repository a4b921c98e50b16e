"""The example crate `examples/counter_bundle`: a stateful bundle written with the crate's FFI
layer in a crate of its own, loaded with ctypes, registered and called from Python."""

import gc
import importlib.util
import os
import pathlib
import shutil
import subprocess
import threading

import jax
import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
CRATE = REPO / "examples" / "counter_bundle"


@pytest.fixture(scope="module")
def counter():
    """The example's Python module, with the library built (a no-op when up to date) and loaded."""
    if shutil.which("cargo"):
        build = subprocess.run(
            ["cargo", "build", "--release", "--quiet", "--manifest-path", str(CRATE / "Cargo.toml")],
            cwd=REPO,
            env={**os.environ, "CARGO_TARGET_DIR": str(REPO / "target" / "counter_bundle")},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert build.returncode == 0, build.stderr
    spec = importlib.util.spec_from_file_location("counter_bundle_example", CRATE / "counter.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.load()
    return module


def _drop_executables():
    jax.clear_caches()
    gc.collect()


def test_one_state_per_call_site_reused_by_every_execution(counter):
    _drop_executables()
    before = counter.stats()

    @jax.jit
    def two_sites():
        return counter.counter(0, 1), counter.counter(100, -10)

    values = [tuple(int(v) for v in two_sites()) for _ in range(4)]
    assert values == [(0, 100), (1, 90), (2, 80), (3, 70)]
    after = counter.stats()
    assert after["created_states"] - before["created_states"] == 2
    assert after["live_states"] - before["live_states"] == 2
    assert np.asarray(two_sites()[0]).dtype == np.int64


def test_states_are_freed_with_the_executable(counter):
    _drop_executables()
    base = counter.stats()["live_states"]
    f = jax.jit(lambda: counter.counter(7, 1))
    assert [int(f()) for _ in range(3)] == [7, 8, 9]
    assert counter.stats()["live_states"] == base + 1
    del f
    _drop_executables()
    assert counter.stats()["live_states"] == base
    # A new executable gets a new state, counting from `start` again.
    g = jax.jit(lambda: counter.counter(7, 1))
    assert int(g()) == 7


def test_concurrent_executions_share_one_state(counter):
    _drop_executables()
    f = jax.jit(lambda: counter.counter(0, 1))
    int(f())  # compile and instantiate once
    seen = []
    lock = threading.Lock()

    def worker():
        got = [int(f()) for _ in range(50)]
        with lock:
            seen.extend(got)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # The atomic count hands every execution its own number: no value lost or repeated.
    assert sorted(seen) == list(range(1, 201))


def test_instantiate_rejects_a_bad_attribute(counter):
    # Bypass the Python check: the Rust instantiate stage validates `step` and fails compilation.
    call = jax.ffi.ffi_call(counter._target, jax.ShapeDtypeStruct((), np.int64), has_side_effect=True)
    with pytest.raises(Exception, match="`step` must be non-zero"):
        jax.jit(lambda: call(start=np.int64(0), step=np.int64(0)))()
    with pytest.raises(ValueError, match="step must be non-zero"):
        counter.counter(0, 0)

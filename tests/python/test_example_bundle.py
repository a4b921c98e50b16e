"""The example crate `examples/counter_bundle`: a stateful bundle written with the crate's FFI
layer in a crate of its own, registered with `rmsnorm_ffi.register_library` and called from
Python; its states and executions count in `rmsnorm_ffi.stats()`."""

import gc
import importlib.util
import threading

import jax
import numpy as np
import pytest

from conftest import REPO, bundle_library, live_states_of

import rmsnorm_ffi

CRATE = REPO / "examples" / "counter_bundle"


@pytest.fixture(scope="module")
def counter():
    """The example's Python module, with the library built (a no-op when up to date) and
    registered."""
    spec = importlib.util.spec_from_file_location("counter_bundle_example", CRATE / "counter.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.load(bundle_library("counter_bundle")) == (module.TARGET,)
    return module


def _drop_executables():
    jax.clear_caches()
    gc.collect()


def test_one_state_per_call_site_reused_by_every_execution(counter):
    _drop_executables()
    before = rmsnorm_ffi.stats()

    @jax.jit
    def two_sites():
        return counter.counter(0, 1), counter.counter(100, -10)

    values = [tuple(int(v) for v in two_sites()) for _ in range(4)]
    assert values == [(0, 100), (1, 90), (2, 80), (3, 70)]
    after = rmsnorm_ffi.stats()
    # The library's states are in the extension's registry: created, live, executed.
    assert after["created_states"] - before["created_states"] == 2
    assert after["live_states"] - before["live_states"] == 2
    assert after["executions"][counter.TARGET] - before["executions"].get(counter.TARGET, 0) == 8
    states = live_states_of(counter.TARGET)
    assert sorted(s["executions"] for s in states) == [4, 4]
    assert {s["type"] for s in states} == {"counter_bundle.CounterState"}
    assert np.asarray(two_sites()[0]).dtype == np.int64


def test_states_are_freed_with_the_executable(counter):
    _drop_executables()
    assert counter.live_states() == 0
    f = jax.jit(lambda: counter.counter(7, 1))
    assert [int(f()) for _ in range(3)] == [7, 8, 9]
    assert counter.live_states() == 1
    del f
    _drop_executables()
    assert counter.live_states() == 0
    s = rmsnorm_ffi.stats()
    assert s["live_states"] == s["created_states"] - s["destroyed_states"]
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
    (state,) = live_states_of(counter.TARGET)
    assert state["executions"] == 201


def test_instantiate_rejects_a_bad_attribute(counter):
    # Bypass the Python check: the Rust instantiate stage validates `step` and fails compilation.
    call = jax.ffi.ffi_call(counter.TARGET, jax.ShapeDtypeStruct((), np.int64), has_side_effect=True)
    with pytest.raises(Exception, match="`step` must be non-zero"):
        jax.jit(lambda: call(start=np.int64(0), step=np.int64(0)))()
    with pytest.raises(ValueError, match="step must be non-zero"):
        counter.counter(0, 0)


def test_registering_again_is_a_no_op(counter):
    path = bundle_library("counter_bundle")
    assert rmsnorm_ffi.register_library(path) == (counter.TARGET,)
    assert rmsnorm_ffi.register_library(str(path)) == (counter.TARGET,)
    assert rmsnorm_ffi.registered_libraries()[str(path.resolve())] == (counter.TARGET,)

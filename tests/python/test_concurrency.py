"""Many Python threads executing the same executable at once share one state."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import live_states_of

import rmsnorm_ffi
from scaled_copy import TARGET, scaled_copy, scaled_copy_reference

pytestmark = pytest.mark.usefixtures("scaled_copy_registered")

THREADS = 8
CALLS = 50


def test_threads_share_one_state_and_get_correct_results(fresh_caches):
    f = jax.jit(lambda x: scaled_copy(x, 1.5))
    inputs = [jax.random.normal(jax.random.key(i), (64, 256)).astype(jnp.bfloat16) for i in range(THREADS)]
    wants = [np.asarray(scaled_copy_reference(x, 1.5), np.float32) for x in inputs]
    f(inputs[0]).block_until_ready()
    allocations_before = rmsnorm_ffi.stats()["workspace_allocations"]
    barrier = threading.Barrier(THREADS)
    failures = []

    def worker(i):
        barrier.wait()
        for _ in range(CALLS):
            got = np.asarray(f(inputs[i]), np.float32)
            if not np.allclose(got, wants[i], rtol=1e-2, atol=1e-2):
                failures.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    (state,) = live_states_of(TARGET)
    assert state["executions"] == 1 + THREADS * CALLS
    # At most one workspace per execution in flight at once (the warm-up call made one).
    assert rmsnorm_ffi.stats()["workspace_allocations"] - allocations_before <= THREADS - 1

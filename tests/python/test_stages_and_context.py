"""Which stages XLA:CPU runs, and what the execution context offers, seen from real XLA through
the test fixtures' library (registered with `rmsnorm_ffi.register_library`)."""

import jax
import numpy as np

import testing_bundles as testing


def test_stage_counts_on_cpu(fresh_caches):
    f = jax.jit(lambda: testing.stage_counts())
    counts = [np.asarray(f()).tolist() for _ in range(3)]
    # Instantiate ran once for the call site; execute once per call. XLA:CPU (jaxlib 0.10.2)
    # does not run the prepare and initialize stages; a runtime that does would count here.
    assert [c[0] for c in counts] == [1, 1, 1]
    assert [c[3] for c in counts] == [1, 2, 3]
    assert counts[-1][1] in (0, 3) and counts[-1][2] in (0, 3)


def test_context_probe():
    num_threads, device_ordinal, run_id, task_ran = np.asarray(jax.jit(testing.context_probe)()).tolist()
    assert num_threads >= 1
    assert device_ordinal == 0
    assert task_ran == 1, "a task scheduled on XLA's thread pool ran"
    assert run_id >= 0

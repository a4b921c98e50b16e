"""The stateful example bundle, end to end: what instantiate builds and execute reuses.

Run with `make stateful-demo`. Compiles a function with two call sites of the Rust `scaled_copy`
bundle, runs it many times (also from several threads at once), checks every result against
jnp, and prints what the live-state registry saw: one state per call site, reused by every
execution, no workspace allocation after warm-up, and every state freed with its executable.
"""

from __future__ import annotations

import argparse
import gc
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import rmsnorm_ffi
from scaled_copy import TARGET, load, scaled_copy, scaled_copy_reference  # next to this file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="calls per thread")
    parser.add_argument("--threads", type=int, default=4, help="Python threads calling at once")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--cols", type=int, default=1024)
    args = parser.parse_args()

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; registered: {load()}")

    @jax.jit
    def step(x):
        # Two call sites: two states, each built once by the instantiate stage.
        return scaled_copy(x, 2.0) - scaled_copy(x.astype(jnp.bfloat16), 0.5).astype(jnp.float32)

    def reference(x):
        return scaled_copy_reference(x, 2.0) - scaled_copy_reference(x.astype(jnp.bfloat16), 0.5).astype(jnp.float32)

    x = jax.random.normal(jax.random.key(0), (args.rows, args.cols), jnp.float32)
    want = np.asarray(reference(x))
    mismatches = []

    def worker(steps):
        for _ in range(steps):
            got = np.asarray(step(x))
            if not np.allclose(got, want, rtol=2e-2, atol=2e-2):
                mismatches.append(float(np.abs(got - want).max()))

    def run_threads(steps):
        threads = [threading.Thread(target=worker, args=(steps,)) for _ in range(args.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    run_threads(5)  # warm-up: compile, and let the pools grow to the concurrency they see
    warm = rmsnorm_ffi.stats()
    start = time.perf_counter()
    run_threads(args.steps)
    elapsed = time.perf_counter() - start
    done = rmsnorm_ffi.stats()
    calls = args.steps * args.threads
    executions = done["executions"][TARGET] - warm["executions"][TARGET]

    print(f"{calls} calls from {args.threads} threads in {elapsed:.2f} s ({calls / elapsed:.0f} calls/s)")
    print(f"mismatches against jnp: {len(mismatches)}")
    print(f"states instantiated: {done['created_states']} (one per call site); "
          f"executions that reused them: {executions}")
    for state in done["states"]:
        print(f"  state {state['id']}: {state['type']}, {state['executions']} executions")
    print(f"workspace allocations after warm-up: {done['workspace_allocations'] - warm['workspace_allocations']}")
    print(f"workspace bytes held: {done['workspace_bytes']}")

    del step
    jax.clear_caches()
    gc.collect()
    end = rmsnorm_ffi.stats()
    print(f"after the executable is gone: live states {end['live_states']}, destroyed {end['destroyed_states']}, "
          f"workspace bytes {end['workspace_bytes']}")
    if mismatches or end["live_states"] != 0:
        raise SystemExit("demo failed: mismatches or leaked states")


if __name__ == "__main__":
    main()

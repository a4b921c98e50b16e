"""Register and call the `counter_bundle` example (a stateful bundle in a crate of its own).

Build the library first (from the repo root): `make bundles` (or `make counter-bundle`). Then
`python examples/counter_bundle/counter.py` runs the demo at the bottom.

The library exports its table of bundles and state types (`rmsnorm_ffi::export_library!`);
`rmsnorm_ffi.register_library(path)` reads it, registers everything in it in XLA's order
(backend, state types, targets) and makes the library's states count in `rmsnorm_ffi.stats()`.
"""

from __future__ import annotations

import gc
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import rmsnorm_ffi

REPO = pathlib.Path(__file__).resolve().parents[2]
# Where `make bundles` puts it; COUNTER_BUNDLE_LIB overrides.
DEFAULT_LIB = REPO / "target" / "bundles" / "libcounter_bundle.so"
TARGET = "counter_bundle_counter"


def load(path: str | os.PathLike | None = None) -> tuple[str, ...]:
    """Registers the library's bundles (once; again is a no-op) and returns their targets."""
    path = pathlib.Path(path or os.environ.get("COUNTER_BUNDLE_LIB") or DEFAULT_LIB)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: build it with `make bundles`")
    return rmsnorm_ffi.register_library(path)


def counter(start: int = 0, step: int = 1):
    """`start + step * k` (an int64 scalar), where `k` counts the earlier executions of this call
    site."""
    load()
    if isinstance(start, bool) or not isinstance(start, int) or isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"counter: start and step must be ints, got {start!r}, {step!r}")
    if step == 0:
        raise ValueError("counter: step must be non-zero")
    # has_side_effect: the call has no operands, and XLA must neither merge two call sites
    # into one nor drop a call whose result is unused.
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((), jnp.int64), has_side_effect=True)
    return call(start=np.int64(start), step=np.int64(step))


def live_states() -> int:
    """This library's states alive now, from the one registry `rmsnorm_ffi.stats()` reads."""
    return sum(1 for s in rmsnorm_ffi.stats()["states"] if s["target"] == TARGET)


def main() -> None:
    @jax.jit
    def two_counters():
        # Two call sites, so two states, each built once by the instantiate stage.
        return counter(0, 1), counter(100, 10)

    for _ in range(3):
        a, b = two_counters()
        print(f"counter(0, 1) -> {int(a)}, counter(100, 10) -> {int(b)}")
    stats = rmsnorm_ffi.stats()
    print(f"after 3 calls: {live_states()} live states, {stats['executions'][TARGET]} executions")
    del two_counters
    jax.clear_caches()
    gc.collect()
    print(f"after jax.clear_caches(): {live_states()} live states")


if __name__ == "__main__":
    main()

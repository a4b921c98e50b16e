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


def stress_spec():
    """The counter as a stress spec (`rmsnorm_ffi.stress`): its result depends on how many
    executions came before, so there is no reference, only a property: every value is
    `start + step * k` with `k >= 0`, and no `k` comes back twice from one call site however
    many threads run it at once (two executions that saw the same count would be a race on
    the state). Each executable gets its own `start` (index x 10^9), so values of different
    call sites never mix. A fresh spec each call: the values seen are the spec's own.

        python -m rmsnorm_ffi.stress --library target/bundles/libcounter_bundle.so \
            --spec examples/counter_bundle/counter.py:stress_spec -t 4 -k 3 -n 100
    """
    import threading

    from rmsnorm_ffi import stress

    seen: set[tuple[int, int]] = set()
    lock = threading.Lock()

    def cases(index, rng):
        return stress.Inputs(start=index * 10**9, step=1 + index % 3)

    def fn(*, start, step):
        return counter(start, step)

    def check(value, *, start, step):
        k, rest = divmod(int(value) - start, step)
        if rest or k < 0:
            return f"{int(value)} is not {start} + {step} * k for any k >= 0"
        with lock:
            if (start, k) in seen:
                return f"count {k} came back twice from one call site: two executions saw the same count"
            seen.add((start, k))
        return None

    return stress.Spec(fn=fn, cases=cases, check=check, name=TARGET)


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

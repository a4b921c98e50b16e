"""Load, register and call the `counter_bundle` example (a stateful bundle in its own crate).

Build the library first (from the repo root): `make counter-bundle`, which runs
`CARGO_TARGET_DIR=target/counter_bundle cargo build --release --manifest-path examples/counter_bundle/Cargo.toml`.
Then `python examples/counter_bundle/counter.py` runs the demo at the bottom.

The library exports one C function per bundle that returns a `BundleExport` (see
`src/ffi/export.rs`): the target name, the stage handlers and the state type's id and info.
Registration wraps each pointer with `jax.ffi.pycapsule` and follows XLA's rules:

1. start the backend first (`jax.devices()`): a state type and stateful bundle registered before
   it exists fail later, when it starts;
2. register the state type, then the target: XLA asks the handler for its state type id when
   the target is registered, and the id exists only once the type is.
"""

from __future__ import annotations

import ctypes
import gc
import os
import pathlib
import threading

import jax
import jax.numpy as jnp
import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
# Where `make counter-bundle` puts it; COUNTER_BUNDLE_LIB overrides.
DEFAULT_LIB = REPO / "target" / "counter_bundle" / "release" / "libcounter_bundle.so"


class BundleExport(ctypes.Structure):
    """Mirror of `rmsnorm_ffi::ffi::export::BundleExport` (`#[repr(C)]`, same field order)."""

    _fields_ = [
        ("target", ctypes.c_char_p),
        ("instantiate", ctypes.c_void_p),
        ("prepare", ctypes.c_void_p),
        ("initialize", ctypes.c_void_p),
        ("execute", ctypes.c_void_p),
        ("state_type_name", ctypes.c_char_p),
        ("type_id", ctypes.c_void_p),
        ("type_info", ctypes.c_void_p),
    ]


_lock = threading.Lock()
_lib = None
_target = None


def load(path: str | os.PathLike | None = None) -> ctypes.CDLL:
    """Loads the library (once) and registers its state type and bundle with XLA for the CPU."""
    global _lib, _target
    with _lock:
        if _lib is not None:
            return _lib
        path = pathlib.Path(path or os.environ.get("COUNTER_BUNDLE_LIB") or DEFAULT_LIB)
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: build it with `make counter-bundle`")
        lib = ctypes.CDLL(str(path))
        lib.counter_bundle.restype = ctypes.POINTER(BundleExport)
        lib.counter_bundle_created_states.restype = ctypes.c_int64
        lib.counter_bundle_live_states.restype = ctypes.c_int64
        export = lib.counter_bundle().contents

        jax.devices("cpu")  # 1. the backend first
        capsule = jax.ffi.pycapsule
        jax.ffi.register_ffi_type(  # 2. the state type ...
            export.state_type_name.decode(),
            {"type_id": capsule(export.type_id), "type_info": capsule(export.type_info)},
            platform="cpu",
        )
        stages = {
            name: capsule(pointer)
            for name in ("instantiate", "prepare", "initialize", "execute")
            if (pointer := getattr(export, name))
        }
        jax.ffi.register_ffi_target(export.target.decode(), stages, platform="cpu")  # ... then the target
        _lib, _target = lib, export.target.decode()
        return lib


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
    call = jax.ffi.ffi_call(_target, jax.ShapeDtypeStruct((), jnp.int64), has_side_effect=True)
    return call(start=np.int64(start), step=np.int64(step))


def stats() -> dict[str, int]:
    """States this library made so far, and those alive now."""
    lib = load()
    return {"created_states": lib.counter_bundle_created_states(), "live_states": lib.counter_bundle_live_states()}


def main() -> None:
    @jax.jit
    def two_counters():
        # Two call sites, so two states, each built once by the instantiate stage.
        return counter(0, 1), counter(100, 10)

    for _ in range(3):
        a, b = two_counters()
        print(f"counter(0, 1) -> {int(a)}, counter(100, 10) -> {int(b)}")
    print(f"after 3 calls: {stats()}")
    del two_counters
    jax.clear_caches()
    gc.collect()
    print(f"after jax.clear_caches(): {stats()}")


if __name__ == "__main__":
    main()

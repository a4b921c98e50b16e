"""Calls of the extension's test targets (see ``src/handlers/testing.rs``).

These exist to prove the FFI layer against real XLA: every stage of a bundle running, panics
and errors in each stage coming back as Python exceptions, and the execution context.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rmsnorm_ffi._registration import register

STAGES_TARGET = "rmsnorm_ffi_testing_stages"
CONTEXT_TARGET = "rmsnorm_ffi_testing_context"
ATTRS_TARGET = "rmsnorm_ffi_testing_attrs"
STAGES = ("instantiate", "prepare", "initialize", "execute")


def stage_counts(panic_in: str = "none", fail_in: str = "none"):
    """Runs the all-stages bundle; returns int32[4]: calls of instantiate, prepare, initialize
    and execute seen by this call site's state. ``panic_in`` / ``fail_in`` name a stage that
    panics / returns an error."""
    register()
    call = jax.ffi.ffi_call(STAGES_TARGET, jax.ShapeDtypeStruct((4,), jnp.int32))
    return call(panic_in=panic_in, fail_in=fail_in)


def context_probe():
    """int32[4]: XLA's thread-pool size, device ordinal, run id, and 1 if a task scheduled on
    XLA's thread pool ran."""
    register()
    call = jax.ffi.ffi_call(CONTEXT_TARGET, jax.ShapeDtypeStruct((4,), jnp.int32))
    return call()


def describe_attributes(size: int = 4096, **attributes) -> str:
    """How the Rust decoding layer reads ``attributes`` as XLA encodes them: ``name=kind:value``
    entries sorted by name, separated by ``;``, dictionaries in braces."""
    import numpy as np

    register()
    call = jax.ffi.ffi_call(ATTRS_TARGET, jax.ShapeDtypeStruct((size,), jnp.uint8))
    raw = np.asarray(jax.jit(lambda: call(**attributes))())
    return bytes(raw).rstrip(b"\0").decode()

"""Calls of the test fixtures' targets (``tests/fixtures/testing_bundles``, a library built on
the crate, registered with ``rmsnorm_ffi.register_library``; no user process has them).

They exist to prove the FFI layer against real XLA: every stage of a bundle running, panics
and errors in each stage coming back as Python exceptions, and the execution context.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import rmsnorm_ffi
from conftest import bundle_library


def register() -> tuple[str, ...]:
    """Builds (if needed) and registers the fixture library; returns its targets."""
    return rmsnorm_ffi.register_library(bundle_library("rmsnorm_ffi_testing"))

STAGES_TARGET = "rmsnorm_ffi_testing_stages"
CONTEXT_TARGET = "rmsnorm_ffi_testing_context"
ATTRS_TARGET = "rmsnorm_ffi_testing_attrs"
LISTS_TARGET = "rmsnorm_ffi_testing_lists"
STAGE_STATE_TARGET = "rmsnorm_ffi_testing_stage_state"
STAGES = ("instantiate", "prepare", "initialize", "execute")


def stage_counts(panic_in: str = "none", fail_in: str = "none"):
    """Runs the all-stages bundle; returns int32[4]: calls of instantiate, prepare, initialize
    and execute seen by this call site's state. ``panic_in`` / ``fail_in`` name a stage that
    panics / returns an error."""
    register()
    call = jax.ffi.ffi_call(STAGES_TARGET, jax.ShapeDtypeStruct((4,), jnp.int32))
    return call(panic_in=panic_in, fail_in=fail_in)


def context_probe():
    """int32[9]: XLA's thread-pool size, device ordinal, run id, 1 if a task scheduled on XLA's
    thread pool ran, the major and minor API version of the runtime that ran the handler, 1 if
    the runtime attached its collectives extension (API 0.5), the number of custom options it
    passed (-1 for a runtime older than 0.5), and the API minor version the library's handlers
    reported to the runtime at registration."""
    register()
    call = jax.ffi.ffi_call(CONTEXT_TARGET, jax.ShapeDtypeStruct((9,), jnp.int32))
    return call()


def ask_context(ask: str):
    """Asks XLA:CPU's context for ``ask`` ("user_data" or "prepare_state"), which it does not
    have: raises the call's error (int32[1] of 1 if it ever had it)."""
    register()
    call = jax.ffi.ffi_call(STAGE_STATE_TARGET, jax.ShapeDtypeStruct((1,), jnp.int32))
    return jax.jit(lambda: call(ask=ask))()


def describe_attributes(size: int = 4096, **attributes) -> str:
    """How the Rust decoding layer reads ``attributes`` as XLA encodes them: ``name=kind:value``
    entries sorted by name, separated by ``;``, dictionaries in braces."""
    import numpy as np

    register()
    call = jax.ffi.ffi_call(ATTRS_TARGET, jax.ShapeDtypeStruct((size,), jnp.uint8))
    raw = np.asarray(jax.jit(lambda: call(**attributes))())
    return bytes(raw).rstrip(b"\0").decode()


def lists(x, *more, results: int = 1, factor=np.float32(1.0), reduce=0):
    """The lists bundle: ``x``, then (if given) an optional bias and any number of remaining
    arguments; ``results`` float32 results, result ``k`` being ``reduce(x, rest) * factor + bias +
    k`` (``reduce``: 0 sum, 7 max), its attribute ``scaling={"factor": .., "reduce": ..}``."""
    register()
    call = jax.ffi.ffi_call(LISTS_TARGET, [jax.ShapeDtypeStruct(x.shape, jnp.float32)] * results)
    return call(x, *more, scaling={"factor": factor, "reduce": reduce})

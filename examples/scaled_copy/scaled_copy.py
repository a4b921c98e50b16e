"""The example stateful op of the `scaled_copy` library: a scaled copy with a table cached at
instantiation.

``scaled_copy(x, scale)`` returns ``x * scale / (j + 1)`` along the last axis ``j``. The Rust
bundle builds the table ``scale / (j + 1)`` once per call site, in the instantiate stage, and
every execution reuses it (see ``src/lib.rs`` next to this file). The library is built on
rmsnorm_ffi (`make bundles` puts it in target/bundles/) and registered with
``rmsnorm_ffi.register_library``; its states count in ``rmsnorm_ffi.stats()``.
"""

from __future__ import annotations

import math
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import rmsnorm_ffi

REPO = pathlib.Path(__file__).resolve().parents[2]
# Where `make bundles` puts it; SCALED_COPY_LIB overrides.
DEFAULT_LIB = REPO / "target" / "bundles" / "libscaled_copy.so"
TARGET = "scaled_copy"
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def load(path: str | os.PathLike | None = None) -> tuple[str, ...]:
    """Registers the library (once; again is a no-op) and returns its targets."""
    path = pathlib.Path(path or os.environ.get("SCALED_COPY_LIB") or DEFAULT_LIB)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: build it with `make bundles`")
    return rmsnorm_ffi.register_library(path)


def scaled_copy(x, scale: float = 1.0):
    """``x * scale / (j + 1)`` along the last axis, computed by the stateful Rust bundle."""
    x = jnp.asarray(x)
    if x.dtype not in [jnp.dtype(d) for d in _DTYPES]:
        raise TypeError(f"scaled_copy: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.ndim < 1:
        raise ValueError("scaled_copy: x must have at least one axis, got a scalar")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scaled_copy: scale must be a finite number, got {scale!r}")
    load()
    return _op(x, scale=np.float32(scale), row_len=np.int64(x.shape[-1]))


# The target as a JAX op: rows are independent (one core axis), so vmap folds into one call and
# a mesh runs each device's rows, with no gathers (rmsnorm_ffi.batched_ffi_op).
_op = rmsnorm_ffi.batched_ffi_op(
    TARGET, lambda x, **attrs: jax.ShapeDtypeStruct(x.shape, x.dtype), core_ndims=(1,)
)


def scaled_copy_reference(x, scale: float = 1.0):
    """The same computation in jnp, for tests."""
    x = jnp.asarray(x)
    table = scale / jnp.arange(1, x.shape[-1] + 1, dtype=jnp.float32)
    return (x.astype(jnp.float32) * table).astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# ema_update: an in-place update (the result is the average's own buffer)

EMA_TARGET = "ema_update"

# Rows are independent (elementwise: no core axes); result 0 is operand 0 updated in place.
_ema_op = rmsnorm_ffi.batched_ffi_op(
    EMA_TARGET, lambda average, x, **attrs: jax.ShapeDtypeStruct(average.shape, average.dtype),
    core_ndims=(0, 0), input_output_aliases={0: 0},
)


def ema_update(average, x, decay: float):
    """``decay * average + (1 - decay) * x`` (float32), computed by the Rust bundle over
    ``average``'s own buffer. Under ``jax.jit(..., donate_argnums=0)`` XLA updates the donated
    average without a copy; without donation it copies it first, and the result is the same."""
    average, x = jnp.asarray(average), jnp.asarray(x)
    for name, v in (("average", average), ("x", x)):
        if v.dtype != jnp.float32:
            raise TypeError(f"ema_update: {name} must be float32, got {v.dtype}")
    if average.shape != x.shape:
        raise ValueError(f"ema_update: x has shape {x.shape} but average has {average.shape}")
    if not isinstance(decay, (int, float)) or not 0.0 <= decay <= 1.0:
        raise ValueError(f"ema_update: decay must be a number in [0, 1], got {decay!r}")
    load()
    return _ema_op(average, x, decay=np.float32(decay))


def ema_update_reference(average, x, decay: float):
    """The same update in jnp, for tests."""
    return decay * jnp.asarray(average) + (1.0 - decay) * jnp.asarray(x)

"""The example stateful op: a scaled copy with a table cached at instantiation.

``scaled_copy(x, scale)`` returns ``x * scale / (j + 1)`` along the last axis ``j``. The Rust
bundle builds the table ``scale / (j + 1)`` once per call site, in the instantiate stage, and
every execution reuses it (see ``src/handlers/scaled_copy.rs``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from rmsnorm_ffi._registration import register

TARGET = "rmsnorm_ffi_scaled_copy"
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def scaled_copy(x, scale: float = 1.0):
    """``x * scale / (j + 1)`` along the last axis, computed by the stateful Rust bundle."""
    x = jnp.asarray(x)
    if x.dtype not in [jnp.dtype(d) for d in _DTYPES]:
        raise TypeError(f"scaled_copy: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.ndim < 1:
        raise ValueError("scaled_copy: x must have at least one axis, got a scalar")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scaled_copy: scale must be a finite number, got {scale!r}")
    register()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="expand_dims")
    return call(x, scale=np.float32(scale), row_len=np.int64(x.shape[-1]))


def scaled_copy_reference(x, scale: float = 1.0):
    """The same computation in jnp, for tests."""
    x = jnp.asarray(x)
    table = scale / jnp.arange(1, x.shape[-1] + 1, dtype=jnp.float32)
    return (x.astype(jnp.float32) * table).astype(x.dtype)

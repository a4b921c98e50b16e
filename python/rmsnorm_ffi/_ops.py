"""RMS norm ops: `rms_norm` (differentiable), `rms_norm_fwd` and `rms_norm_bwd`.

Each op checks its inputs in Python (raising `TypeError`/`ValueError` that name the argument)
before anything is lowered, then calls the `rmsnorm_fwd` / `rmsnorm_bwd` FFI targets. The same
target names are registered for every platform this build supports, so XLA picks the
platform's implementation; the ops only check that the default backend is one of them.

Under `jax.vmap` the targets use `vmap_method="broadcast_all"`: a mapped weight arrives with
the batch dimensions in front, which the Rust handlers accept (one weight row per batch
element, and per-element weight gradients, which JAX sums when the weight was not mapped).
"""

from __future__ import annotations

import functools
import math
from numbers import Real

import jax
import jax.numpy as jnp
import numpy as np

from rmsnorm_ffi._registration import register

FORWARD_TARGET = "rmsnorm_fwd"
BACKWARD_TARGET = "rmsnorm_bwd"
_FLOATS = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16))
_FLOAT_NAMES = "float32, float64, bfloat16 or float16"


def _acc_dtype(dtype) -> jnp.dtype:
    """The dtype of rstd (and of accumulation): float64 for float64 input, else float32."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


MAX_ROW_LEN = 1 << 26  # the Rust handlers' limit on the normalized axis


def _check_array(op: str, name: str, value):
    # Always through jnp: a NumPy float64 array with x64 disabled becomes float32 here, so the
    # result specs agree with what XLA is handed.
    try:
        value = jnp.asarray(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{op}: {name} must be a {_FLOAT_NAMES} array, got {type(value).__name__} ({e})") from None
    if jnp.dtype(value.dtype) not in _FLOATS:
        raise TypeError(f"{op}: {name} must be a {_FLOAT_NAMES} array, got dtype {value.dtype}")
    return value


def _check_x(op: str, x):
    x = _check_array(op, "x", x)
    if x.ndim < 1:
        raise ValueError(f"{op}: x must have at least one axis (normalization is over the last), got a scalar")
    if x.shape[-1] > MAX_ROW_LEN:
        raise ValueError(f"{op}: x's last axis has {x.shape[-1]} elements; at most {MAX_ROW_LEN} are supported")
    return x


def _check_weight(op: str, x, weight):
    if weight is None:
        return None
    weight = _check_array(op, "weight", weight)
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"{op}: weight must have shape ({n},) to match x's last axis, got {tuple(weight.shape)}")
    if jnp.dtype(weight.dtype) not in (jnp.dtype(x.dtype), jnp.dtype(jnp.float32)):
        raise TypeError(f"{op}: weight must have x's dtype ({x.dtype}) or float32, got {weight.dtype}")
    return weight


def _check_eps(op: str, eps) -> float:
    if isinstance(eps, jax.core.Tracer):
        raise TypeError(f"{op}: eps must be a Python number (it is a compile-time attribute), got a traced value")
    if isinstance(eps, bool) or not isinstance(eps, (Real, np.floating, np.integer)):
        raise TypeError(f"{op}: eps must be a real number, got {type(eps).__name__}")
    eps = float(eps)
    # eps travels as a float32 attribute: it must be finite there too.
    if not math.isfinite(eps) or eps < 0 or eps > float(np.finfo(np.float32).max):
        raise ValueError(f"{op}: eps must be finite and >= 0 (as a float32), got {eps}")
    return eps


def _check_platform(op: str) -> None:
    platforms = register()
    backend = jax.default_backend()
    # JAX calls a CUDA backend "gpu"; its bundles are registered for platform "cuda".
    if backend == "gpu" and "cuda" in platforms:
        backend = "cuda"
    if backend not in platforms:
        raise NotImplementedError(
            f"{op}: no rmsnorm_ffi implementation for platform '{backend}' in this build "
            f"(available: {', '.join(platforms) or 'none'})"
        )


def _vma(*arrays) -> frozenset:
    """The manual mesh axes (inside `shard_map`) along which any of `arrays` varies."""
    axes: set = set()
    for a in arrays:
        if a is None:
            continue
        aval = jax.typeof(a)
        mat = getattr(aval, "mat", None)  # jax >= 0.10: ShapedArray.mat.varying
        varying = getattr(mat, "varying", None) if mat is not None else getattr(aval, "vma", None)
        axes |= set(varying or ())
    return frozenset(axes)


def _varying(out, axes: frozenset):
    """`out` typed as varying along `axes`. FFI results carry no such type, but inside
    `shard_map` an output varies wherever its inputs do (rows are independent)."""
    missing = tuple(sorted(axes - _vma(out)))
    return jax.lax.pcast(out, missing, to="varying") if missing else out


def _forward(x, weight, eps: float):
    n = x.shape[-1]
    call = jax.ffi.ffi_call(
        FORWARD_TARGET,
        (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape[:-1], _acc_dtype(x.dtype))),
        vmap_method="broadcast_all",
    )
    args = (x,) if weight is None else (x, weight)
    y, rstd = call(*args, eps=np.float32(eps), has_weight=weight is not None, row_len=np.int64(n))
    axes = _vma(x, weight)
    return _varying(y, axes), _varying(rstd, axes)


def _backward(x, weight, rstd, dy):
    n = x.shape[-1]
    results = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    if weight is not None:
        results.append(jax.ShapeDtypeStruct(weight.shape, weight.dtype))
    call = jax.ffi.ffi_call(BACKWARD_TARGET, tuple(results), vmap_method="broadcast_all")
    args = (x, rstd, dy) if weight is None else (x, weight, rstd, dy)
    out = call(*args, has_weight=weight is not None, row_len=np.int64(n))
    axes = _vma(x, weight, rstd, dy)
    dx = _varying(out[0], axes)
    return (dx, None) if weight is None else (dx, _varying(out[1], axes))


def rms_norm_fwd(x, weight=None, eps: float = 1e-5):
    """Forward pass: returns ``(y, rstd)`` with ``rstd.shape == x.shape[:-1]`` (float32, or
    float64 for float64 input) and ``y = x * rstd[..., None] * weight``."""
    op = "rms_norm_fwd"
    x = _check_x(op, x)
    weight = _check_weight(op, x, weight)
    eps = _check_eps(op, eps)
    _check_platform(op)
    return _forward(x, weight, eps)


def rms_norm_bwd(x, weight, rstd, dy):
    """Backward pass: returns ``(dx, dweight)``; ``dweight`` is None when ``weight`` is None."""
    op = "rms_norm_bwd"
    x = _check_x(op, x)
    weight = _check_weight(op, x, weight)
    rstd = _check_array(op, "rstd", rstd)
    dy = _check_array(op, "dy", dy)
    acc = _acc_dtype(x.dtype)
    if rstd.shape != x.shape[:-1] or jnp.dtype(rstd.dtype) != acc:
        raise ValueError(
            f"{op}: rstd must have shape {tuple(x.shape[:-1])} and dtype {acc}, got {tuple(rstd.shape)} {rstd.dtype}"
        )
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(f"{op}: dy must have x's shape {tuple(x.shape)} and dtype {x.dtype}, got {tuple(dy.shape)} {dy.dtype}")
    _check_platform(op)
    return _backward(x, weight, rstd, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm_weighted(x, weight, eps):
    return _forward(x, weight, eps)[0]


def _weighted_fwd(x, weight, eps):
    y, rstd = _forward(x, weight, eps)
    return y, (x, weight, rstd)


def _weighted_bwd(eps, residuals, dy):
    x, weight, rstd = residuals
    dx, dweight = _backward(x, weight, rstd, dy)
    # Inside `shard_map`, a weight shared by the shards gets the sum of their gradients.
    shared = tuple(sorted(_vma(dweight) - _vma(weight)))
    if shared:
        dweight = jax.lax.psum(dweight, shared)
    return dx, dweight


_rms_norm_weighted.defvjp(_weighted_fwd, _weighted_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _rms_norm_plain(x, eps):
    return _forward(x, None, eps)[0]


def _plain_fwd(x, eps):
    y, rstd = _forward(x, None, eps)
    return y, (x, rstd)


def _plain_bwd(eps, residuals, dy):
    x, rstd = residuals
    return (_backward(x, None, rstd, dy)[0],)


_rms_norm_plain.defvjp(_plain_fwd, _plain_bwd)


def rms_norm(x, weight=None, eps: float = 1e-5):
    """RMS norm over the last axis: ``x / sqrt(mean(x**2, -1) + eps) * weight``.

    ``weight``, when given, has shape ``(x.shape[-1],)`` and x's dtype or float32. Returns an
    array of x's shape and dtype. Differentiable in ``x`` and ``weight``; works under ``jit``,
    ``vmap`` and ``grad``. Accumulates in float32 (float64 for float64 input).
    """
    op = "rms_norm"
    x = _check_x(op, x)
    weight = _check_weight(op, x, weight)
    eps = _check_eps(op, eps)
    _check_platform(op)
    if weight is None:
        return _rms_norm_plain(x, eps)
    return _rms_norm_weighted(x, weight, eps)


def rms_norm_reference(x, weight=None, eps: float = 1e-5):
    """The same computation in jnp (float32 accumulation; float64 for float64), for tests and
    benchmarks."""
    x = jnp.asarray(x)
    acc = _acc_dtype(x.dtype)
    xf = x.astype(acc)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + jnp.asarray(eps, acc))
    if weight is not None:
        y = y * jnp.asarray(weight).astype(acc)
    return y.astype(x.dtype)

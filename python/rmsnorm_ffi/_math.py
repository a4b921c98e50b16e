"""The RMS norm's math in jnp, for the derivatives the Rust kernels do not compute.

First-order reverse mode never runs this: it is the fused Rust backward. What runs here:

- the forward-mode tangent (`tangent`), which `jvp`, `linearize` evaluated forwards, `jacfwd`
  and `hessian` need;
- derivatives of the backward itself (`backward` under `jax.jvp`), for second order: the
  backward's primal value still comes from Rust, only its tangent is jnp.

Every function takes the primitives' layout: x ``(*wb, *rest, n)``, a weight ``(*wb, n)`` (``wb``
the weight's batch dimensions, a prefix of x's leading ones, often empty) or None, rstd
``x.shape[:-1]``; all sums in float32 (float64 for float64 input), as the kernels do. With a
scale ``offset`` the weight applied is ``offset + w``, taken in that dtype (the kernels' rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def acc_dtype(dtype) -> jnp.dtype:
    """The dtype of rstd and of accumulation: float64 for float64 input, else float32."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def _rows(weight, x_ndim: int, acc, offset: float = 0.0):
    """`offset + weight` in `acc`, shaped to broadcast against x: ``(*wb, 1, ..., 1, n)``."""
    if weight is None:
        return None
    w = weight.astype(acc)
    if offset:
        w = jnp.asarray(offset, acc) + w
    missing = x_ndim - w.ndim
    return w.reshape(w.shape[:-1] + (1,) * missing + w.shape[-1:])


def tangent(x, weight, rstd, tx, tw, offset: float = 0.0):
    """The tangents ``(ty, trstd)`` of ``(y, rstd) = forward(x, weight)`` along ``(tx, tw)``.

    With ``r = rstd``: ``dr = -r**3 * mean(x * tx)`` and
    ``dy = w * (tx * r + x * dr) + x * r * tw`` (``w`` being ``offset + weight``). Linear in
    ``(tx, tw)``.
    """
    acc = acc_dtype(x.dtype)
    xf, txf = x.astype(acc), tx.astype(acc)
    r = rstd.astype(acc)[..., None]
    dr = -(r**3) * jnp.mean(xf * txf, axis=-1, keepdims=True)
    ty = txf * r + xf * dr
    w = _rows(weight, x.ndim, acc, offset)
    if w is not None:
        ty = ty * w
        if tw is not None:
            ty = ty + xf * r * _rows(tw, x.ndim, acc)
    return ty.astype(x.dtype), dr[..., 0].astype(rstd.dtype)


def backward(x, weight, rstd, dy, offset: float = 0.0, dh=None):
    """``(dx, dweight)`` of the forward, as the Rust backward computes them (``dweight`` None
    without weight): ``g = dy * (offset + w)``, ``dx = r * (g - x * r**2 * mean(g * x))``,
    plus ``dh`` (the fused residual's other gradient) before dx is rounded,
    ``dweight = sum over rows of dy * x * r`` (per weight row when the weight is batched)."""
    acc = acc_dtype(x.dtype)
    xf, dyf = x.astype(acc), dy.astype(acc)
    r = rstd.astype(acc)[..., None]
    w = _rows(weight, x.ndim, acc, offset)
    g = dyf if w is None else dyf * w
    dx = r * (g - xf * r**2 * jnp.mean(g * xf, axis=-1, keepdims=True))
    if dh is not None:
        dx = dx + dh.astype(acc)
    if weight is None:
        return dx.astype(x.dtype), None
    summed = tuple(range(weight.ndim - 1, x.ndim - 1))
    dw = jnp.sum(dyf * xf * r, axis=summed)
    return dx.astype(x.dtype), dw.astype(weight.dtype)


def rstd_cotangent(x, rstd, ct_rstd):
    """The cotangent of x from a cotangent of rstd: ``-r**3 / n * x * ct``."""
    acc = acc_dtype(x.dtype)
    r = rstd.astype(acc)
    scale = -(r**3) * ct_rstd.astype(acc) / x.shape[-1]
    return (x.astype(acc) * scale[..., None]).astype(x.dtype)


def reference(x, weight=None, eps: float = 1e-5, offset: float = 0.0):
    """The forward in jnp (float32 accumulation; float64 for float64), for tests and benchmarks."""
    x = jnp.asarray(x)
    acc = acc_dtype(x.dtype)
    xf = x.astype(acc)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + jnp.asarray(eps, acc))
    if weight is not None:
        y = y * _rows(jnp.asarray(weight), x.ndim, acc, offset)
    return y.astype(x.dtype)

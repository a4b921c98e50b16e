"""The norms' math in jnp, for the derivatives the Rust kernels do not compute.

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


def stats_names(norm: str) -> tuple:
    """A norm's per-row statistics, in the order the forward returns them (after y, and h)
    and the backward takes them (src/handlers/contract.rs, `Norm::statistics`)."""
    return ("mean", "rstd") if norm == "layer" else ("rstd",)


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
    r = rstd.astype(acc)[..., None]
    ty, dr = _scaled_tangent(x.astype(acc), tx.astype(acc), r, weight, tw, offset)
    return ty.astype(x.dtype), dr[..., 0].astype(rstd.dtype)


def _scaled_tangent(c, tc, r, weight, tw, offset):
    """The tangent of ``c * r * w`` (in `c`'s dtype) along ``(tc, tw)`` with ``r = 1 /
    sqrt(mean(c**2) + eps)``: ``dr = -r**3 * mean(c * tc)``, ``(tc * r + c * dr) * w + c * r *
    tw``; with ``dr``. Both norms' tangent: ``c`` is x for the RMS norm, ``x - mean`` for
    LayerNorm."""
    dr = -(r**3) * jnp.mean(c * tc, axis=-1, keepdims=True)
    ty = tc * r + c * dr
    w = _rows(weight, c.ndim, c.dtype, offset)
    if w is not None:
        ty = ty * w
        if tw is not None:
            ty = ty + c * r * _rows(tw, c.ndim, c.dtype)
    return ty, dr


def _grad_inputs(x, weight, rstd, dy, offset):
    """The backward's inputs in the accumulation dtype: ``(acc, dy, r, g = dy * (offset + w))``."""
    acc = acc_dtype(x.dtype)
    dyf = dy.astype(acc)
    w = _rows(weight, x.ndim, acc, offset)
    return acc, dyf, rstd.astype(acc)[..., None], dyf if w is None else dyf * w


def backward(x, weight, rstd, dy, offset: float = 0.0, dh=None):
    """``(dx, dweight)`` of the forward, as the Rust backward computes them (``dweight`` None
    without weight): ``g = dy * (offset + w)``, ``dx = r * (g - x * r**2 * mean(g * x))``,
    plus ``dh`` (the fused residual's other gradient) before dx is rounded,
    ``dweight = sum over rows of dy * x * r`` (per weight row when the weight is batched)."""
    acc, dyf, r, g = _grad_inputs(x, weight, rstd, dy, offset)
    xf = x.astype(acc)
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


# ---------------------------------------------------------------------------------------------
# LayerNorm: y = (x - mean) * rstd * (offset + w) + b


def _centred(xf, mean):
    """``x - mean(x)`` from the float32 (or float64) mean the kernels return: ``x - m``, less
    the mean of that (the part of the true mean a rounded ``m`` cannot hold), as the kernels
    centre a row (src/handlers/math/layer.rs). Depends on x alone, whatever ``m`` is."""
    c = xf - mean.astype(xf.dtype)[..., None]
    return c - jnp.mean(c, axis=-1, keepdims=True)


def _summed(value, param_ndim: int, x_ndim: int):
    """`value` (x's shape) summed over the rows a parameter of `param_ndim` dims is shared by."""
    return jnp.sum(value, axis=tuple(range(param_ndim - 1, x_ndim - 1)))


def layer_tangent(x, weight, bias, mean, rstd, tx, tw, tb, offset: float = 0.0):
    """The tangents ``(ty, tmean, trstd)`` of LayerNorm's forward along ``(tx, tw, tb)``: with
    ``c = x - mean``, ``tc = tx - mean(tx)``, ``dr = -r**3 * mean(c * tc)``,
    ``ty = (tc * r + c * dr) * w + c * r * tw + tb``. Linear in the tangents."""
    acc = acc_dtype(x.dtype)
    txf = tx.astype(acc)
    tm = jnp.mean(txf, axis=-1, keepdims=True)
    r = rstd.astype(acc)[..., None]
    ty, dr = _scaled_tangent(_centred(x.astype(acc), mean), txf - tm, r, weight, tw, offset)
    if tb is not None:
        ty = ty + _rows(tb, x.ndim, acc)
    return ty.astype(x.dtype), tm[..., 0].astype(mean.dtype), dr[..., 0].astype(rstd.dtype)


def layer_backward(x, weight, bias, mean, rstd, dy, offset: float = 0.0, dh=None):
    """``(dx, dweight, dbias)`` of LayerNorm's forward, as the Rust backward computes them
    (None for a parameter the call has not): ``g = dy * (offset + w)``, ``xhat = c * r``,
    ``dx = r * (g - mean(g) - xhat * mean(g * xhat))`` plus ``dh`` before dx is rounded,
    ``dweight = sum of dy * xhat``, ``dbias = sum of dy`` over the rows each is shared by."""
    acc, dyf, r, g = _grad_inputs(x, weight, rstd, dy, offset)
    xhat = _centred(x.astype(acc), mean) * r
    dx = r * (g - jnp.mean(g, axis=-1, keepdims=True) - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
    if dh is not None:
        dx = dx + dh.astype(acc)
    dw = None if weight is None else _summed(dyf * xhat, weight.ndim, x.ndim).astype(weight.dtype)
    db = None if bias is None else _summed(dyf, bias.ndim, x.ndim).astype(bias.dtype)
    return dx.astype(x.dtype), dw, db


def stats_cotangent(norm: str, x, stats: tuple, cts: tuple):
    """The cotangent of x from cotangents of the statistics (None where there is none): the
    RMS norm's rstd (`rstd_cotangent`); LayerNorm's mean, ``ct / n`` for every element, and
    rstd, ``-r**3 / n * (x - mean) * ct``."""
    if norm == "rms":
        (ct,), (rstd,) = cts, stats
        return None if ct is None else rstd_cotangent(x, rstd, ct)
    acc = acc_dtype(x.dtype)
    (ct_mean, ct_rstd), (mean, rstd) = cts, stats
    n = x.shape[-1]
    out = jnp.zeros(x.shape, acc)
    if ct_mean is not None:
        out = out + (ct_mean.astype(acc) / n)[..., None]
    if ct_rstd is not None:
        r = rstd.astype(acc)
        out = out + _centred(x.astype(acc), mean) * (-(r**3) * ct_rstd.astype(acc) / n)[..., None]
    return out.astype(x.dtype)


def layer_reference(x, weight=None, bias=None, eps: float = 1e-5, offset: float = 0.0):
    """LayerNorm's forward in jnp as Flax computes it (float32 accumulation; float64 for
    float64): ``mean``, ``var = mean((x - mean)**2)``, ``(x - mean) * rsqrt(var + eps) * w + b``."""
    x = jnp.asarray(x)
    acc = acc_dtype(x.dtype)
    xf = x.astype(acc)
    c = xf - jnp.mean(xf, axis=-1, keepdims=True)
    y = c * jax.lax.rsqrt(jnp.mean(c * c, axis=-1, keepdims=True) + jnp.asarray(eps, acc))
    if weight is not None:
        y = y * _rows(jnp.asarray(weight), x.ndim, acc, offset)
    if bias is not None:
        y = y + _rows(jnp.asarray(bias), x.ndim, acc)
    return y.astype(x.dtype)

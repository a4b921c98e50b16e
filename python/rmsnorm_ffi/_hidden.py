"""Both norms of rows split over devices, as jnp: the CUDA path (whose kernels take whole rows)
for x's last (normalized) axis sharded over mesh axes. On the CPU, both norms run the targets'
split passes instead (`_split`).

`_partitioning` runs these per shard when x's last axis is sharded over mesh axes ``H``
(tensor-parallel activations) and divides evenly over them, on a platform other than the CPU. No device then holds a whole row,
and the Rust kernels take whole rows: running them would mean gathering the activations
(rows x n elements to every device of ``H``). Instead each device reduces its own slice to one
number per row, the devices of ``H`` add those numbers up (one all-reduce of rows floats, never
the activations), and everything else is elementwise on the device's own slice of x and of the
weight. (It was the CPU's path too, until the targets gained their split passes: in a trainer
on a 2x2 mesh with a model axis, 5 of 9 norms then never reached the kernels.)

The arithmetic follows the kernels' (src/handlers/math.rs), operation for operation where jnp
allows: sums in the accumulation dtype (float32, float64 for float64 x), ``eps`` as the
float32 the kernels get, the weight applied as ``offset + w`` in the accumulation dtype
(`_math._rows`), ``y = x * r * w``, ``c = r * sum(g * x) / n``, ``dx = r * (g - x * r * c)``
(plus ``dh`` before the one rounding), ``dweight = sum over rows of dy * (x * r)``. The
kernels total their row sums in float64 with compensation; here the local sums and the
all-reduce are in the accumulation dtype, which differs from them in the last bits only.

LayerNorm (`layer_forward`, `layer_backward`) as the kernels take it (src/handlers/math/layer.rs):
the mean ``m`` from one all-reduce of the row sums, then the shift ``d = mean(x - m)`` and the
variance ``mean((x - m)^2) - d^2`` from a second of two floats per row (never ``E[x^2] -
E[x]^2``), ``y = ((x - m) - d) * r * w + b``; the backward, given ``m`` and ``r``, one
all-reduce of three floats per row (``sum(x - m)``, ``sum(g)``, ``sum(g (x - m))``), ``dx = r *
(g - mean(g) - xhat * mean(g xhat))``, ``dweight = sum dy * xhat``, ``dbias = sum dy``.

Shapes: x ``(*rows, n_local)``, a weight ``(*wb, n_local)`` (``wb`` the weight's batch
dimensions, a prefix of the rows) or None, rstd ``rows``. ``axes`` are the mesh axes of ``H``
and ``n`` the global row length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rmsnorm_ffi._math import _rows, acc_dtype


def _widen(v, acc):
    """`v` in the accumulation dtype, holding exactly the values of `v`'s own dtype. The
    kernels read their operands as stored; XLA, allowed excess precision (its default), may
    fuse a narrow operand's producer into this code and drop the rounding to the narrow dtype
    (h of the fused residual, seen 1 bfloat16 ulp off in y and dx), so the rounding is made
    explicit: `reduce_precision`, which XLA keeps, and a no-op on values already rounded."""
    if v is None:
        return None
    wide = v.astype(acc)
    info = jnp.finfo(v.dtype)
    if info.bits >= jnp.finfo(acc).bits:
        return wide
    return jax.lax.reduce_precision(wide, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _rstd(sum_sq, n: int, eps, acc):
    """``1 / sqrt(sum_sq / n + eps)``, eps rounded to float32 first as the kernels take it."""
    return jax.lax.rsqrt(sum_sq / jnp.asarray(n, acc) + jnp.asarray(np.float32(eps), acc))


def forward(x, weight, eps, offset: float, axes: tuple, n: int, residual=None):
    """``(y, rstd)``, or with a residual ``(y, h, rstd)`` of ``h = x + residual`` (rounded to
    x's dtype as the fused kernel and jnp round it): one psum over ``axes`` of each row's sum
    of squares. y is this device's slice; rstd is the whole row's, the same on every device
    of ``axes``."""
    acc = acc_dtype(x.dtype)
    h = x if residual is None else x + residual
    hf = _widen(h, acc)
    rstd = _rstd(jax.lax.psum(jnp.sum(hf * hf, axis=-1), axes), n, eps, acc)
    y = hf * rstd[..., None]
    w = _rows(_widen(weight, acc), x.ndim, acc, offset)
    if w is not None:
        y = y * w
    y = y.astype(x.dtype)
    return (y, rstd) if residual is None else (y, h, rstd)


def backward(x, weight, rstd, dy, eps, offset: float, axes: tuple, n: int, row_axes: tuple, dh=None):
    """``(dx, dweight)`` of this device's slice (``dweight`` None without weight).

    With ``eps`` (the VJP's promise that rstd is the forward's of x with that eps), rstd is
    taken from x itself, as the CPU kernel takes it: each row's sum of squares travels in the
    same all-reduce as its dot product (rows x 2 floats), so a program that only wants
    gradients needs no forward and still has one all-reduce. With ``eps`` None, the given
    rstd is read and the all-reduce carries the dot products alone.

    ``dweight`` is summed over the rows this device holds, then over ``row_axes`` (the mesh
    axes that shard the rows beyond the weight's batch dimensions) in the accumulation dtype,
    and rounded once to the weight's dtype: it stays this device's slice of the weight's last
    axis (sharded over ``axes`` like x's).
    """
    acc = acc_dtype(x.dtype)
    xf, dyf = _widen(x, acc), _widen(dy, acc)
    w = _rows(_widen(weight, acc), x.ndim, acc, offset)
    g = dyf if w is None else dyf * w
    dot = jnp.sum(g * xf, axis=-1)
    if eps is None:
        r = rstd.astype(acc)
        dot = jax.lax.psum(dot, axes)
    else:
        sums = jax.lax.psum(jnp.stack([dot, jnp.sum(xf * xf, axis=-1)], axis=-1), axes)
        dot, sum_sq = sums[..., 0], sums[..., 1]
        r = _rstd(sum_sq, n, eps, acc)
    r = r[..., None]
    c = dot[..., None] / jnp.asarray(n, acc) * r
    xhat = xf * r
    dx = r * (g - xhat * c)
    if dh is not None:
        dx = dx + _widen(dh, acc)
    if weight is None:
        return dx.astype(x.dtype), None
    return dx.astype(x.dtype), _param_grad(dyf * xhat, weight, x.ndim, row_axes)


def _param_grad(grad, param, x_ndim: int, row_axes: tuple):
    """A weight-shaped gradient: summed over the rows this device holds beyond the parameter's
    batch dimensions, then over ``row_axes``, rounded once to the parameter's dtype."""
    grad = jnp.sum(grad, axis=tuple(range(param.ndim - 1, x_ndim - 1)))
    if row_axes:
        grad = jax.lax.psum(grad, row_axes)
    return grad.astype(param.dtype)


def layer_forward(x, weight, bias, eps, offset: float, axes: tuple, n: int, residual=None):
    """LayerNorm's ``(y, mean, rstd)``, or with a residual ``(y, h, mean, rstd)``: two
    all-reduces over ``axes``, of one and of two floats per row."""
    acc = acc_dtype(x.dtype)
    h = x if residual is None else x + residual
    hf = _widen(h, acc)
    nf = jnp.asarray(n, acc)
    mean = jax.lax.psum(jnp.sum(hf, axis=-1), axes) / nf
    c = hf - mean[..., None]
    sums = jax.lax.psum(jnp.stack([jnp.sum(c, axis=-1), jnp.sum(c * c, axis=-1)], axis=-1), axes)
    d = sums[..., 0] / nf
    var = jnp.maximum(sums[..., 1] / nf - d * d, jnp.zeros((), acc))
    rstd = jax.lax.rsqrt(var + jnp.asarray(np.float32(eps), acc))
    y = (c - d[..., None]) * rstd[..., None]
    w = _rows(_widen(weight, acc), x.ndim, acc, offset)
    if w is not None:
        y = y * w
    b = _rows(_widen(bias, acc), x.ndim, acc, 0.0)
    if b is not None:
        y = y + b
    y = y.astype(x.dtype)
    return (y, mean, rstd) if residual is None else (y, h, mean, rstd)


def layer_backward(x, weight, bias, mean, rstd, dy, offset: float, axes: tuple, n: int,
                   row_axes: dict, dh=None):
    """LayerNorm's ``(dx, dweight, dbias)`` of this device's slice, given the forward's mean and
    rstd (None for the gradients the call has not: no weight, no bias): one all-reduce over
    ``axes`` of three floats per row. ``row_axes`` maps ``"w"`` and ``"b"`` to the mesh axes
    their gradients are summed over (see `backward`)."""
    acc = acc_dtype(x.dtype)
    xf, dyf = _widen(x, acc), _widen(dy, acc)
    w = _rows(_widen(weight, acc), x.ndim, acc, offset)
    g = dyf if w is None else dyf * w
    m, r = mean.astype(acc)[..., None], rstd.astype(acc)[..., None]
    c = xf - m
    sums = jax.lax.psum(
        jnp.stack([jnp.sum(c, axis=-1), jnp.sum(g, axis=-1), jnp.sum(g * c, axis=-1)], axis=-1), axes
    )
    nf = jnp.asarray(n, acc)
    d = (sums[..., 0] / nf)[..., None]
    c1 = (sums[..., 1] / nf)[..., None]
    c2 = ((sums[..., 2] - d[..., 0] * sums[..., 1]) / nf)[..., None] * r
    xhat = (c - d) * r
    dx = r * (g - c1 - xhat * c2)
    if dh is not None:
        dx = dx + _widen(dh, acc)
    dw = None if weight is None else _param_grad(dyf * xhat, weight, x.ndim, row_axes.get("w", ()))
    db = None if bias is None else _param_grad(dyf, bias, x.ndim, row_axes.get("b", ()))
    return dx.astype(x.dtype), dw, db

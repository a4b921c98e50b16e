"""Both norms over rows split across devices, in the kernels: x's last (normalized) axis sharded
over mesh axes ``H`` (tensor-parallel activations).

No device holds a whole row, and gathering the rows would move the activations (rows x n
elements to every device of ``H``). Instead each device runs the targets' split passes
(``split``, src/handlers/contract.rs): a sums pass over its slice of every row, an all-reduce
over ``H`` of those few floats per row (never the activations), then an apply pass over its
slice given the whole row's sums:

- the RMS norm's forward: ``sum(x^2)``, one all-reduce of rows floats;
- LayerNorm's forward: ``sum(x)``, all-reduced, gives the row's mean ``m``; then
  ``sum(x - m)`` and ``sum((x - m)^2)``, all-reduced (rows x 2 floats): the shifted two-pass
  variance of the whole-row kernel, which ``E[x^2] - E[x]^2`` in one all-reduce would not be
  (it loses every digit in float32 when the mean is large against the spread, the very rows
  the kernel is built for), so two all-reduces of rows x 3 floats in all;
- the backward: ``sum(g * x)`` (the RMS norm; with ``eps``, rstd from x, ``sum(x^2)`` in the
  same all-reduce) or ``sum(x - m), sum(g), sum(g * (x - m))`` (LayerNorm, given the forward's
  statistics), one all-reduce; the weight and bias gradients come back as this device's rows'
  sums in the accumulation dtype, summed over ``row_axes`` (the mesh axes that shard the rows
  beyond a batched weight's own batch dimensions) and rounded once to the parameter's dtype.

The weight and bias stay split like x's last axis. CPU only (the CUDA kernels take whole rows:
`_hidden` runs the RMS norm's split rows as jnp there). Shapes: x ``(*rows, n_local)``,
a weight or bias ``(*wb, n_local)`` (``wb`` a prefix of the rows) or None; ``n`` is the whole
row's length.
"""

from __future__ import annotations

import jax
import numpy as np

from rmsnorm_ffi import _native
from rmsnorm_ffi._math import acc_dtype, stats_names

_CONTRACT = _native.contract()
FORWARD_TARGET, BACKWARD_TARGET = _CONTRACT["forward_target"], _CONTRACT["backward_target"]
# The passes' values (contract::Split).
SUMS, CENTRED_SUMS, APPLY = (_CONTRACT["splits"][name] for name in ("Sums", "CentredSums", "Apply"))


def _rows_of(x, k=None):
    """A per-row result of x's accumulation dtype: ``x.shape[:-1]``, or with ``k`` sums
    ``x.shape[:-1] + (k,)``."""
    shape = x.shape[:-1] if k is None else x.shape[:-1] + (k,)
    return jax.ShapeDtypeStruct(shape, acc_dtype(x.dtype))


def _attrs(x, n: int, norm_attrs: dict, split: int, **more) -> dict:
    return dict(row_len=np.int64(x.shape[-1]), full_len=np.int64(n), split=np.int64(split), **norm_attrs, **more)


def forward(x, weight, bias, eps, offset_attrs: dict, norm_attrs: dict, norm: str, axes: tuple, n: int,
            residual=None):
    """``(y, *stats)``, or with a residual ``(y, h, *stats)`` of ``h = x + residual`` (rounded to
    x's dtype, as the fused kernel rounds it): y and h this device's slices, the statistics the
    whole rows' (the same on every device of ``axes``)."""
    h = x if residual is None else x + residual
    eps = np.float32(eps)
    # The sums passes read x alone (no weight, no bias).
    plain = {k: v for k, v in norm_attrs.items() if k != "has_bias"}

    def sums(split, k, *extra):
        call = jax.ffi.ffi_call(FORWARD_TARGET, _rows_of(h, k))
        out = call(h, *extra, **_attrs(h, n, plain, split, has_weight=False, eps=eps))
        return jax.lax.psum(out, axes)

    first = sums(SUMS, 1)
    if norm == "layer":
        mean = (first[..., 0] / np.asarray(n, first.dtype)).astype(first.dtype)
        given, totals = (mean,), sums(CENTRED_SUMS, 2, mean)
    else:
        given, totals = (), first
    params = tuple(p for p in (weight, bias) if p is not None)
    results = (jax.ShapeDtypeStruct(h.shape, h.dtype),) + (_rows_of(h),) * len(stats_names(norm))
    call = jax.ffi.ffi_call(FORWARD_TARGET, results)
    out = tuple(
        call(h, *params, *given, totals,
             **_attrs(h, n, norm_attrs, APPLY, has_weight=weight is not None, eps=eps, **offset_attrs))
    )
    return out if residual is None else (out[0], h, *out[1:])


def backward(x, weight, bias, stats, dy, eps, offset_attrs: dict, norm_attrs: dict, norm: str, axes: tuple,
             n: int, row_axes: dict, dh=None):
    """``(dx, dweight, dbias)`` of this device's slice (None for a gradient the call has not):
    dx rounded once (``dh`` added before), the gradients summed over the rows and over
    ``row_axes[role]`` (role "w", "b") in the accumulation dtype, then rounded to the
    parameter's dtype. ``eps`` (the RMS norm: rstd taken from x, as the whole-row CPU kernel
    takes it) or the given ``stats``; LayerNorm always reads its statistics."""
    from_x = norm == "rms" and eps is not None
    k = 3 if norm == "layer" else 1 + from_x
    acc = acc_dtype(x.dtype)
    attrs = dict(has_weight=weight is not None, **offset_attrs)
    if from_x:
        attrs["eps"] = np.float32(eps)
    w = () if weight is None else (weight,)
    args = (x, *w, *(() if from_x else stats), dy)
    call = jax.ffi.ffi_call(BACKWARD_TARGET, _rows_of(x, k))
    totals = jax.lax.psum(call(*args, **_attrs(x, n, norm_attrs, SUMS, **attrs)), axes)
    params = [(role, p) for role, p in (("w", weight), ("b", bias)) if p is not None]
    results = (jax.ShapeDtypeStruct(x.shape, x.dtype),) + tuple(jax.ShapeDtypeStruct(p.shape, acc) for _, p in params)
    if dh is not None:
        attrs["has_dh"] = True
    call = jax.ffi.ffi_call(BACKWARD_TARGET, results)
    dx, *grads = call(*args, *(() if dh is None else (dh,)), totals, **_attrs(x, n, norm_attrs, APPLY, **attrs))
    out = {}
    for (role, p), g in zip(params, grads):
        if row_axes.get(role):
            g = jax.lax.psum(g, row_axes[role])
        out[role] = g.astype(p.dtype)
    return dx, out.get("w"), out.get("b")

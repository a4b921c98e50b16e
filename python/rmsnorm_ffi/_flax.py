"""`rmsnorm_ffi.RMSNorm`: a drop-in for `flax.linen.RMSNorm` whose math runs in the Rust bundle.

Importing this module imports flax; `rmsnorm_ffi` itself only imports it when `RMSNorm` is first
looked up (see `rmsnorm_ffi.__getattr__`), so flax stays an optional dependency
(`pip install rmsnorm_ffi[flax]`).

The class subclasses `flax.linen.RMSNorm`, so it has exactly flax's fields and defaults
(`epsilon=1e-6`, `dtype`, `param_dtype`, `use_scale`, `scale_init`, ...), the same parameter
(`scale`, shape `(features,)`, `param_dtype`) and the same auto-generated name. Only `__call__`
differs. The dtypes follow flax's rules:

- statistics in at least float32 (`promote_types(dtype or x.dtype, float32)`), which is what the
  Rust op does (float32 sums; float64 for float64);
- the result dtype is `dtype` if given, else the promotion of x's dtype and the scale's
  (so bfloat16 input with the default float32 `param_dtype` gives a float32 result, as in flax).

Flax multiplies x by `rsqrt(var + eps) * scale` in float32 and casts once to the result dtype.
To get the same rounding, the op runs in the wider of x's dtype and the result dtype (x is cast
up first, which is exact), and the result is cast down if the requested `dtype` is narrower.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx
from flax.linen import dtypes as flax_dtypes

from rmsnorm_ffi._ops import rms_norm

_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _last_axis_only(name: str, axes, ndim: int) -> None:
    """Raises ValueError unless `axes` names exactly the last axis of an `ndim`-array."""
    items = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
    ok = all(isinstance(a, int) and -ndim <= a < ndim for a in items)
    if not ok or {a % ndim for a in items} != {ndim - 1}:
        raise ValueError(
            f"rmsnorm_ffi.RMSNorm: {name} must be the last axis (-1 or {ndim - 1} for a "
            f"{ndim}-d input), got {axes!r}; the Rust op normalizes over the last axis only "
            "(use flax.linen.RMSNorm for other axes)"
        )


def _check_options(module, x, mask):
    """The options both modules support: last axis only, no cross-device statistics, no mask."""
    if x.ndim < 1:
        raise ValueError("rmsnorm_ffi.RMSNorm: x must have at least one axis, got a scalar")
    _last_axis_only("reduction_axes", module.reduction_axes, x.ndim)
    _last_axis_only("feature_axes", module.feature_axes, x.ndim)
    if module.axis_name is not None or module.axis_index_groups is not None:
        raise ValueError(
            "rmsnorm_ffi.RMSNorm: axis_name/axis_index_groups (statistics across devices) are "
            "not supported; to normalize sharded rows per device, call the module inside shard_map"
        )
    if mask is not None:
        raise ValueError("rmsnorm_ffi.RMSNorm: mask is not supported (use flax's RMSNorm)")


class RMSNorm(nn.RMSNorm):
    """`flax.linen.RMSNorm` with the normalization computed by `rmsnorm_ffi.rms_norm`.

    Same fields, parameter and results as flax's module (see the module docstring for the dtype
    rules). Supported: `reduction_axes` and `feature_axes` equal to the last axis (the default),
    no `axis_name`/`axis_index_groups`, no `mask`, `force_float32_reductions=True`.
    `use_fast_variance` is accepted and has no effect (RMS norm has no mean to subtract).
    Anything else raises `ValueError`.
    """

    @nn.compact
    def __call__(self, x, *, mask=None):
        x = jnp.asarray(x)
        _check_options(self, x, mask)
        if not self.force_float32_reductions:
            raise ValueError(
                "rmsnorm_ffi.RMSNorm: force_float32_reductions=False is not supported; the op "
                "always reduces in float32 (float64 for float64 input)"
            )

        scale = None
        if self.use_scale:
            scale = self.param("scale", self.scale_init, (x.shape[-1],), self.param_dtype)
        out_dtype = jnp.dtype(flax_dtypes.canonicalize_dtype(x, scale, dtype=self.dtype))
        stats_dtype = jnp.promote_types(self.dtype or x.dtype, jnp.float32)
        # The op's dtype: wide enough for x (the cast up is exact) and for the result, and
        # float64 whenever flax would take the statistics in float64.
        compute = jnp.promote_types(x.dtype, out_dtype)
        if stats_dtype == jnp.float64:
            compute = jnp.dtype(jnp.float64)
        weight = None
        if scale is not None:
            # The op takes a weight of x's dtype or float32. Half-precision and float32 scales
            # are exact in float32; flax multiplies in (at least) float32 too.
            weight = scale.astype(jnp.float32 if compute in _HALF else compute)
        y = rms_norm(x.astype(compute), weight, self.epsilon)
        return y.astype(out_dtype)


class NnxRMSNorm(nnx.RMSNorm):
    """`flax.nnx.RMSNorm` with the normalization computed by `rmsnorm_ffi.rms_norm`; exported
    as `rmsnorm_ffi.nnx.RMSNorm`.

    Same constructor, parameter and results as flax's class, whose dtype rule is simpler than
    Linen's: x and the scale are first cast to one dtype (`dtype`, else their promotion, via
    `promote_dtype`), which is also the result dtype; the statistics are at least float32.
    Supported options as for the Linen module.
    """

    def __call__(self, x, mask=None):
        x = jnp.asarray(x)
        _check_options(self, x, mask)
        scale = self.scale[...] if self.scale else None
        x, scale = self.promote_dtype((x, scale), dtype=self.dtype)
        # The weight now has x's dtype, which the op accepts; it sums in float32 (float64 for
        # float64), as flax's statistics do.
        return rms_norm(x, scale, self.epsilon)

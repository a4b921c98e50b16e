"""`rmsnorm_ffi.RMSNorm` and `rmsnorm_ffi.LayerNorm`: drop-ins for `flax.linen.RMSNorm` and
`flax.linen.LayerNorm` whose math runs in the Rust bundle (and `NnxRMSNorm`, `NnxLayerNorm`,
exported as `rmsnorm_ffi.nnx.RMSNorm` and `.LayerNorm`, the same for `flax.nnx`'s).

LayerNorm follows the same rules as the RMS norm below, with flax's `use_mean=True`
statistics and a bias: the bias joins the scale in the promotion (`canonicalize_dtype(x,
scale, bias)`, the multiply dtype), is cast with the scale and added inside the op before its
one rounding. `use_fast_variance` is accepted and has no effect: the op's variance is always
the two-pass one (flax's fast `E[x^2] - E[x]^2` loses the digits of rows whose mean is large
against their spread; the op's result is then closer to the exact one than flax's).

Importing this module imports flax; `rmsnorm_ffi` itself only imports it when `RMSNorm` is first
looked up (see `rmsnorm_ffi.__getattr__`), so flax stays an optional dependency
(`pip install rmsnorm_ffi[flax]`).

The classes subclass flax's, so they have exactly flax's fields, constructor arguments and
defaults (`epsilon=1e-6`, `dtype`, `param_dtype`, `use_scale`, `scale_init`, nnx's
`promote_dtype`, ...), the same parameter (`scale`, shape `(features,)`, `param_dtype`) and the
same auto-generated names. Only `__call__` differs.

Flax's dtype rules (`_compute_stats(use_mean=False)` and `_normalize` in flax's
`normalization.py`), for x and scale as the normalization sees them (Linen: the input and the
parameter; nnx: what `promote_dtype((x, scale), dtype=dtype)` returned, whatever it does):

- the statistics are computed in `S = promote_types(dtype or x.dtype, float32)`: x is cast to S,
  `rsqrt(mean(x**2) + epsilon)` is computed in S;
- that is multiplied by the scale in `promote_types(S, scale.dtype)`, and x by the product in
  `M = promote_types(x.dtype, S, scale.dtype)` (float32 or float64);
- the result is cast once to `dtype` if given, else to `result_type(x, scale)` (so bfloat16 x
  with the default float32 `param_dtype` gives float32, and float16 x with a bfloat16 scale
  gives float32, as in flax).

`_normalize` maps every case onto `rms_norm`, which takes x of any float dtype, a weight of x's
dtype or float32, sums in float32 (float64 for float64 x) and rounds once to x's dtype: it runs
the op in M (x and the scale cast up, which is exact) and casts the result to the result dtype,
or, when M is float32 and x already has the result dtype, on x itself (the op computes in
float32 and rounds once, as flax does). The result dtype is always flax's; the values equal
flax's up to float32 rounding, not bit for bit. Measured over the dtype matrix of
tests/python/test_flax.py (rows of 96 and of 1024), in ulps of the result dtype:

- bfloat16 and float16 results: at most 1 ulp (the same float32 value rounded once more);
- float32 results: at most 5 ulp for rows of 96 (3 without a scale), 6 for rows of 1024. The op
  computes `(x * rstd) * scale` with `rstd = 1 / sqrt(mean + eps)`, flax
  `x * (rsqrt(mean + eps) * scale)`, and both sum in their own order; each is within about
  2.5 ulp of the exact result. For long rows of half-precision values the op's float32 sums
  drift further (16 ulp from flax for bfloat16 rows of 16384; float32 rows stay within 4);
- float64 results: at most 8 float64 ulp (sums in another order);
- where flax takes the statistics in float32 but multiplies in float64 (a float64 scale, or
  float64 x with a narrower `dtype`), the op takes them in float64 (flax's float32 cast of
  float64 x for the statistics is not reproduced): float32 and narrower results are within the
  bounds above (3 ulp for float32), a float64 result within 2.3 float32 ulp of flax's;
- epsilon reaches the op as a float32 (flax adds it in the statistics dtype).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from flax import nnx
from flax.linen import dtypes as flax_dtypes

from rmsnorm_ffi._ops import _trailing_axes, layer_norm, layer_norm_residual, rms_norm, rms_norm_residual

_F32 = jnp.dtype(jnp.float32)
_F64 = jnp.dtype(jnp.float64)


def _name(module) -> str:
    """The module as errors name it: `rmsnorm_ffi.RMSNorm` or `rmsnorm_ffi.LayerNorm`."""
    return "rmsnorm_ffi." + ("LayerNorm" if isinstance(module, (LayerNorm, NnxLayerNorm)) else "RMSNorm")


def _axes(module, x) -> tuple[int, tuple[bool, ...]]:
    """The number k of trailing axes the module normalizes over, and which of them are feature
    axes (the scale's; along the others it broadcasts, as in flax's `_normalize`). `reduction_axes` must name the last k axes of x (the Rust op
    normalizes rows made of them); `feature_axes` must be among those."""
    name = _name(module)
    try:
        k = _trailing_axes(name, module.reduction_axes, x.ndim)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{name}: reduction_axes must name trailing axes of x ({e}); the Rust op normalizes "
            f"over the last axes only (use flax.linen.{name.split('.')[1]} for others)"
        ) from None
    trailing = range(x.ndim - k, x.ndim)
    items = tuple(module.feature_axes) if isinstance(module.feature_axes, (tuple, list)) else (module.feature_axes,)
    ok = items and all(isinstance(a, int) and not isinstance(a, bool) and -x.ndim <= a < x.ndim for a in items)
    features = {a % x.ndim for a in items} if ok else set()
    if not ok or not features <= set(trailing):
        raise ValueError(
            f"{name}: feature_axes must be among the normalized axes {tuple(a - x.ndim for a in trailing)} "
            f"of a {x.ndim}-d input, got {module.feature_axes!r} (a scale that varies along another "
            f"axis is not one weight row; use flax.linen.{name.split('.')[1]} for that)"
        )
    return k, tuple(a in features for a in trailing)


def _check_options(module, x, mask) -> tuple[int, tuple[bool, ...]]:
    """The options both modules support: trailing axes (see `_axes`, whose result this
    returns), no cross-device statistics, no mask."""
    name = _name(module)
    if x.ndim < 1:
        raise ValueError(f"{name}: x must have at least one axis, got a scalar")
    axes = _axes(module, x)
    if module.axis_name is not None or module.axis_index_groups is not None:
        raise ValueError(
            f"{name}: axis_name/axis_index_groups (statistics across devices) are "
            "not supported; to normalize sharded rows per device, call the module inside shard_map"
        )
    if mask is not None:
        raise ValueError(f"{name}: mask is not supported (use flax's {name.split('.')[1]})")
    if not getattr(module, "force_float32_reductions", True):
        raise ValueError(
            f"{name}: force_float32_reductions=False is not supported; the op "
            "always reduces in float32 (float64 for float64 input)"
        )
    return axes


def _normalize(x, scale, dtype, epsilon, residual=None, axes=(1, (True,)), offset=0.0, bias=None, norm="rms"):
    """flax's normalization of `x` (an array) by `scale` (an array or None) with flax's dtype
    rules (see the module docstring), computed by `rms_norm` (or with ``norm="layer"``,
    `layer_norm`, adding `bias`). With a `residual` (x's shape and dtype), the normalization of
    ``h = x + residual`` instead, and ``(y, h)`` is returned: the fused residual op when the op
    runs in x's dtype, else the add then the norm. `axes`: `_axes`'s (k trailing axes, and which
    are the scale's: it broadcasts along the others). `offset`: the scale applied is
    ``offset + scale`` (added in the op's accumulation dtype)."""
    name = "rmsnorm_ffi." + ("LayerNorm" if norm == "layer" else "RMSNorm")
    if residual is not None:
        residual = jnp.asarray(residual)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"{name}: residual must have x's shape {tuple(x.shape)} and dtype "
                f"{x.dtype} (h = x + residual is rounded to x's dtype), got "
                f"{tuple(residual.shape)} {residual.dtype}"
            )
    # The result dtype, and flax's error for a non-float `dtype`.
    out_dtype = jnp.dtype(flax_dtypes.canonicalize_dtype(x, scale, bias, dtype=dtype))
    stats_dtype = jnp.promote_types(x.dtype if dtype is None else dtype, _F32)
    mul_dtype = jnp.promote_types(x.dtype, stats_dtype)
    for param in (scale, bias):
        if param is not None:
            mul_dtype = jnp.promote_types(mul_dtype, param.dtype)
    if mul_dtype not in (_F32, _F64):
        raise TypeError(
            f"{name}: x ({x.dtype}) and scale "
            f"({None if scale is None else scale.dtype}) must be real floats or integers; "
            f"flax would compute in {mul_dtype}, which the Rust op does not support"
        )
    # The op's input dtype: x's own when the op's float32 arithmetic and single rounding are
    # flax's (x has the result dtype, flax multiplies in float32); else flax's multiply dtype,
    # to which x and the scale are cast exactly, the result being cast to the result dtype.
    op_dtype = x.dtype if (mul_dtype == _F32 and x.dtype == out_dtype) else mul_dtype
    k, features = axes
    axis = tuple(range(-k, 0))
    # The op takes a weight (and a bias, of the weight's dtype) of x's dtype or float32; either
    # holds the scale exactly (a float64 scale makes the op's dtype float64). Both have the
    # normalized axes' shape: the scale broadcasts along the reduced axes that are not feature
    # axes (its gradient sums over them).
    param_shape = tuple(d if f else 1 for d, f in zip(x.shape[x.ndim - k:], features))
    param_dtype = None
    for param in (scale, bias):
        if param is not None and param.dtype != op_dtype:
            param_dtype = _F64 if op_dtype == _F64 else _F32
    weight, bias = (
        None if p is None else jnp.broadcast_to(p.astype(param_dtype or op_dtype).reshape(param_shape), x.shape[x.ndim - k:])
        for p in (scale, bias)
    )
    if offset and weight is None:
        raise ValueError(f"{name}: scale_offset needs use_scale=True (it offsets the scale)")
    opts = dict(axis=axis, scale_offset=offset)
    if norm == "layer":
        plain = lambda v: layer_norm(v, weight, bias, epsilon, **opts)  # noqa: E731
        fused = lambda: layer_norm_residual(x, residual, weight, bias, epsilon, **opts)  # noqa: E731
    else:
        plain = lambda v: rms_norm(v, weight, epsilon, **opts)  # noqa: E731
        fused = lambda: rms_norm_residual(x, residual, weight, epsilon, **opts)  # noqa: E731
    if residual is None:
        return plain(x.astype(op_dtype)).astype(out_dtype)
    if op_dtype == x.dtype:
        y, h = fused()
        return y.astype(out_dtype), h
    h = x + residual
    return plain(h.astype(op_dtype)).astype(out_dtype), h


def _linen_call(module, x, residual, mask, norm: str):
    """Both Linen modules' `__call__`: the options checked, the parameters made as flax makes
    them (shape: the feature axes' lengths, in axis order), then `_normalize`."""
    x = jnp.asarray(x)
    axes = _check_options(module, x, mask)
    k, features = axes
    shape = tuple(d for d, f in zip(x.shape[x.ndim - k:], features) if f)
    scale = jnp.asarray(module.param("scale", module.scale_init, shape, module.param_dtype)) if module.use_scale else None
    bias = None
    if norm == "layer" and module.use_bias:
        bias = jnp.asarray(module.param("bias", module.bias_init, shape, module.param_dtype))
    return _normalize(x, scale, module.dtype, module.epsilon, residual, axes, module.scale_offset, bias, norm)


def _nnx_call(module, x, residual, mask, norm: str):
    """Both nnx modules' `__call__`: x and the parameters through the module's
    `promote_dtype` as flax passes them, the residual cast to x's dtype where that is exact,
    then `_normalize`."""
    scale = module.scale[...] if module.scale else None
    if norm == "layer":
        bias = module.bias[...] if module.bias else None
        x, scale, bias = module.promote_dtype((x, scale, bias), dtype=module.dtype)
    else:
        bias = None
        x, scale = module.promote_dtype((x, scale), dtype=module.dtype)
    x = jnp.asarray(x)
    if residual is not None:
        residual = jnp.asarray(residual)
        if jnp.promote_types(residual.dtype, x.dtype) == x.dtype:
            residual = residual.astype(x.dtype)
    scale, bias = (None if p is None else jnp.asarray(p) for p in (scale, bias))
    axes = _check_options(module, x, mask)
    return _normalize(x, scale, module.dtype, module.epsilon, residual, axes, module.scale_offset, bias, norm)


class RMSNorm(nn.RMSNorm):
    """`flax.linen.RMSNorm` with the normalization computed by `rmsnorm_ffi.rms_norm`.

    Same fields, parameter, dtype rules and result dtypes as flax's module; values equal flax's
    up to float32 rounding, not bit for bit (measured: half-precision results within 1 ulp,
    float32 within 5-6 ulp, float64 within 8 ulp, or 2.3 float32 ulp where flax's statistics
    are float32; see the module docstring). Supported: `reduction_axes` naming the last axis (the
    default) or the last k axes (e.g. `(-2, -1)`), `feature_axes` among them (the scale then
    broadcasts along the others, as in flax), no `axis_name`/`axis_index_groups`, no `mask`,
    `force_float32_reductions=True`.
    `use_fast_variance` is accepted and has no effect (RMS norm has no mean to subtract).
    Anything else raises `ValueError`.

    One field flax's module lacks: `scale_offset` (default 0.0), the scale applied being
    ``scale_offset + scale`` (zero-centred gamma, as Gemma's RMSNorm with ``scale_init`` zeros
    and an offset of 1), added inside the op in float32.
    """

    scale_offset: float = 0.0

    @nn.compact
    def __call__(self, x, residual=None, *, mask=None):
        """The norm of `x`; with `residual` (x's shape and dtype), ``(norm(h), h)`` for
        ``h = x + residual``, the add fused with the norm where the dtypes allow."""
        return _linen_call(self, x, residual, mask, "rms")


class NnxRMSNorm(nnx.RMSNorm):
    """`flax.nnx.RMSNorm` with the normalization computed by `rmsnorm_ffi.rms_norm`; exported
    as `rmsnorm_ffi.nnx.RMSNorm`.

    Same constructor, parameter, dtype rules and result dtypes as flax's class: x and the scale
    go through `promote_dtype((x, scale), dtype=dtype)` first (by default both are cast to
    `dtype`, else to their promotion; a custom function may return anything, the identity
    included), then the rules of the Linen module apply to what it returned. Values and
    supported options as for the Linen module, `scale_offset` included (a keyword of the
    constructor).
    """

    def __init__(self, *args, scale_offset: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale_offset = scale_offset

    def __call__(self, x, mask=None, *, residual=None):
        """The norm of `x`; with `residual`, ``(norm(h), h)`` for ``h = x + residual``, the
        residual cast to the dtype `promote_dtype` gave x when that cast is exact."""
        return _nnx_call(self, x, residual, mask, "rms")




class LayerNorm(nn.LayerNorm):
    """`flax.linen.LayerNorm` with the normalization computed by `rmsnorm_ffi.layer_norm`.

    Same fields, parameters (`scale`, `bias`), dtype rules and result dtypes as flax's module,
    and the options of `rmsnorm_ffi.RMSNorm` (trailing `reduction_axes`, `feature_axes` among
    them, no `axis_name`, no `mask`, a `residual` argument, a `scale_offset` field).
    `use_fast_variance` is accepted and has no effect (see the module docstring). CPU only in
    this build.
    """

    scale_offset: float = 0.0

    @nn.compact
    def __call__(self, x, residual=None, *, mask=None):
        """The norm of `x`; with `residual` (x's shape and dtype), ``(norm(h), h)`` for
        ``h = x + residual``, the add fused with the norm where the dtypes allow."""
        return _linen_call(self, x, residual, mask, "layer")


class NnxLayerNorm(nnx.LayerNorm):
    """`flax.nnx.LayerNorm` with the normalization computed by `rmsnorm_ffi.layer_norm`;
    exported as `rmsnorm_ffi.nnx.LayerNorm`. As `NnxRMSNorm`: x, the scale and the bias go
    through `promote_dtype` first, then the Linen module's rules apply."""

    def __init__(self, *args, scale_offset: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale_offset = scale_offset

    def __call__(self, x, *, mask=None, residual=None):
        """The norm of `x`; with `residual`, ``(norm(h), h)`` for ``h = x + residual``."""
        return _nnx_call(self, x, residual, mask, "layer")

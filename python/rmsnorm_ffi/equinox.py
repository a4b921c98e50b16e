"""`rmsnorm_ffi.equinox.RMSNorm`: a drop-in for `equinox.nn.RMSNorm` whose normalization runs in
the Rust bundle. Importing this module imports equinox, an optional dependency
(`pip install 'rmsnorm_ffi[equinox]'`).

The class subclasses equinox's, so it has exactly its fields, constructor (`shape`, `eps`,
`use_weight`, `use_bias`, `dtype`), parameters (`weight`, `bias`) and tree structure: a model
built with one loads the other's parameters. Only `__call__` differs. As in equinox, the module
normalizes one example over all of `shape` (`x.shape == shape`, else `ValueError`; batch with
`jax.vmap`, which becomes one call of the op over all the rows), and equinox's dtype rules hold:
the math runs in `result_type(x, float32)` (float32, float64 for float64 x), the weight and the
bias are cast to it, and the result is cast back to x's dtype once. The op computes
`(x * rstd) * weight` and rounds once to x's dtype; with a bias it computes in that dtype, adds
the bias there and rounds once (as equinox does), so results equal equinox's up to the float32
rounding of a different summation order, not bit for bit.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from rmsnorm_ffi._ops import layer_norm, rms_norm

_SENTINEL = object()


def _checked(module, x, name: str):
    """x as an array of the module's shape, and equinox's compute dtype for it
    (`result_type(x, float32)`)."""
    x = jnp.asarray(x)
    if x.shape != module.shape:
        raise ValueError(
            f"rmsnorm_ffi.equinox.{name}: x must have the module's shape (`shape == x.shape`), "
            f"got shape={module.shape} and x.shape={x.shape}; for a batch, use jax.vmap(norm)(x)"
        )
    if x.ndim == 0:
        raise ValueError(f"rmsnorm_ffi.equinox.{name}: shape () normalizes nothing; give x at least one axis")
    with jax.numpy_dtype_promotion("standard"):
        return x, jnp.result_type(x.dtype, jnp.float32)


class RMSNorm(eqx.nn.RMSNorm):
    """`equinox.nn.RMSNorm` with the normalization computed by `rmsnorm_ffi.rms_norm` over all of
    `shape` (its trailing axes; see the module docstring)."""

    def __call__(self, x, state=_SENTINEL, *, key=None):
        """The norm of `x` (shape `self.shape`); with `state`, ``(y, state)``, the state passed
        through unchanged (equinox's BatchNorm-compatible form). `key` is ignored."""
        x, dtype = _checked(self, x, "RMSNorm")
        orig_dtype = x.dtype
        weight = self.weight.astype(dtype) if self.use_weight else None
        axis = tuple(range(-x.ndim, 0))
        if self.use_bias:
            # equinox adds the bias before its one rounding: the op runs in the compute dtype.
            out = (rms_norm(x.astype(dtype), weight, self.eps, axis=axis) + self.bias.astype(dtype)).astype(orig_dtype)
        else:
            # The op takes x in its own dtype, computes in float32 (float64) and rounds once.
            out = rms_norm(x, weight, self.eps, axis=axis)
        if state is _SENTINEL:
            return out
        return out, state


class LayerNorm(eqx.nn.LayerNorm):
    """`equinox.nn.LayerNorm` with the normalization computed by `rmsnorm_ffi.layer_norm` over
    all of `shape`: equinox's fields, parameters and dtype rules (the math in
    `result_type(x, float32)`, the weight and bias cast to it, the result cast back to x's
    dtype once), the bias added inside the op before that rounding. CPU only in this build."""

    def __call__(self, x, state=_SENTINEL, *, key=None):
        """The norm of `x` (shape `self.shape`); with `state`, ``(y, state)``."""
        x, dtype = _checked(self, x, "LayerNorm")
        weight = self.weight.astype(dtype) if self.use_weight else None
        bias = self.bias.astype(dtype) if self.use_bias else None
        axis = tuple(range(-x.ndim, 0))
        # The op computes in float32 (float64 for float64 x) and rounds once to x's dtype, as
        # equinox's one cast back: x in its own dtype, the weight and bias in the compute dtype.
        source = x if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(dtype)
        out = layer_norm(source, weight, bias, self.eps, axis=axis).astype(x.dtype)
        return out if state is _SENTINEL else (out, state)


__all__ = ["LayerNorm", "RMSNorm"]

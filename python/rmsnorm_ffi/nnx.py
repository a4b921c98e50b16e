"""`rmsnorm_ffi.nnx.LayerNorm` (for `flax.nnx.LayerNorm`, with `rmsnorm_ffi.layer_norm`) and
`rmsnorm_ffi.nnx.RMSNorm`: a drop-in for `flax.nnx.RMSNorm` (the Linen one is
`rmsnorm_ffi.RMSNorm`): the same constructor, `scale` parameter and dtype rules, with any
`promote_dtype` (flax's default, the identity, any other), so always flax's result dtype;
values equal to flax's up to float32 rounding (see `rmsnorm_ffi._flax` for the measured ulps).
Importing this module imports flax, an optional dependency."""

from rmsnorm_ffi import _flax_module

RMSNorm = _flax_module("rmsnorm_ffi.nnx").NnxRMSNorm
LayerNorm = _flax_module("rmsnorm_ffi.nnx").NnxLayerNorm

__all__ = ["LayerNorm", "RMSNorm"]

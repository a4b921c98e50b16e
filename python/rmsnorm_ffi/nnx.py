"""`rmsnorm_ffi.nnx.RMSNorm`: a drop-in for `flax.nnx.RMSNorm` (the Linen one is
`rmsnorm_ffi.RMSNorm`). Importing this module imports flax, an optional dependency."""

from rmsnorm_ffi import _flax_module

RMSNorm = _flax_module("rmsnorm_ffi.nnx").NnxRMSNorm

__all__ = ["RMSNorm"]

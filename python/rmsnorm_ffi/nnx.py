"""`rmsnorm_ffi.nnx.RMSNorm`: a drop-in for `flax.nnx.RMSNorm` (the Linen one is
`rmsnorm_ffi.RMSNorm`). Importing this module imports flax, an optional dependency."""

try:
    from rmsnorm_ffi._flax import NnxRMSNorm as RMSNorm
except ModuleNotFoundError as e:
    if e.name is None or e.name.split(".")[0] != "flax":
        raise
    raise ImportError(
        "rmsnorm_ffi.nnx needs flax, which is not installed: pip install 'rmsnorm_ffi[flax]'"
    ) from e

__all__ = ["RMSNorm"]

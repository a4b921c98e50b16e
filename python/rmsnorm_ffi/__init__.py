"""rmsnorm_ffi: stateful XLA FFI handler bundles written in Rust, for JAX.

Importing the package registers nothing; the ops call :func:`register` on first use (it is
idempotent and thread-safe), :func:`register_library` registers the bundles of a shared library
built on this crate, and :func:`stats` reports the live-state registry (theirs included).
"""

from rmsnorm_ffi._batched import batched_ffi_op
from rmsnorm_ffi._export import deserialize, export, export_checks
from rmsnorm_ffi._ops import (
    layer_norm,
    layer_norm_bwd,
    layer_norm_fwd,
    layer_norm_reference,
    layer_norm_residual,
    rms_norm,
    rms_norm_bwd,
    rms_norm_fwd,
    rms_norm_reference,
    rms_norm_residual,
)
from rmsnorm_ffi._registration import register, register_library, registered_libraries, registered_platforms
from rmsnorm_ffi._stats import stats

__all__ = [
    "batched_ffi_op",
    "deserialize",
    "export",
    "export_checks",
    "layer_norm",
    "layer_norm_bwd",
    "layer_norm_fwd",
    "layer_norm_reference",
    "layer_norm_residual",
    "register",
    "register_library",
    "registered_libraries",
    "registered_platforms",
    "rms_norm",
    "rms_norm_bwd",
    "rms_norm_fwd",
    "rms_norm_reference",
    "rms_norm_residual",
    "stats",
]
__version__ = "0.1.0"


def _flax_module(what: str):
    """`rmsnorm_ffi._flax`, which imports flax (an optional dependency); an ImportError that says
    what to install when flax is missing, naming `what` needed it."""
    try:
        from rmsnorm_ffi import _flax
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] != "flax":
            raise
        raise ImportError(f"{what} needs flax, which is not installed: pip install 'rmsnorm_ffi[flax]'") from e
    return _flax


def __getattr__(name: str):
    """`RMSNorm` and `LayerNorm` (the Flax modules) are imported on first use, so that flax stays optional and
    `import rmsnorm_ffi` does not import it."""
    if name in ("RMSNorm", "LayerNorm"):
        return getattr(_flax_module(f"rmsnorm_ffi.{name}"), name)
    raise AttributeError(f"module 'rmsnorm_ffi' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "LayerNorm", "RMSNorm"])

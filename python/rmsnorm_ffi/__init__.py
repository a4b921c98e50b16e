"""rmsnorm_ffi: stateful XLA FFI handler bundles written in Rust, for JAX.

Importing the package registers nothing; the ops call :func:`register` on first use (it is
idempotent and thread-safe), and :func:`stats` reports the live-state registry.
"""

from rmsnorm_ffi._ops import rms_norm, rms_norm_bwd, rms_norm_fwd, rms_norm_reference
from rmsnorm_ffi._registration import register, registered_platforms
from rmsnorm_ffi._stats import stats

__all__ = [
    "register",
    "registered_platforms",
    "rms_norm",
    "rms_norm_bwd",
    "rms_norm_fwd",
    "rms_norm_reference",
    "stats",
]
__version__ = "0.1.0"

"""Registration of the extension's state types and handler bundles with XLA.

Order matters, and this module owns it:

1. The backend must exist first. Registering a state type and then a stateful bundle before
   the backend is initialized fails later, at backend start ("Types used by FFI handlers must
   be registered before the handler registration"), so ``register`` starts it.
2. State types before bundles: XLA asks each handler for its state type id when the bundle is
   registered, and the id exists only once the type is registered.
"""

from __future__ import annotations

import threading

from rmsnorm_ffi import _native

_lock = threading.Lock()
_registered: tuple[str, ...] | None = None
_targets: dict[str, frozenset[str]] = {}


def _available_platforms() -> list[str]:
    """The platforms of this build whose JAX backend can start (starting it)."""
    import jax

    available = []
    for platform in _native.platforms():
        try:
            jax.devices(platform)
        except RuntimeError:
            continue
        available.append(platform)
    return available


def register() -> tuple[str, ...]:
    """Registers state types, then handler bundles, for every available platform.

    Idempotent and thread-safe: the first call registers, later calls return at once. Works
    whether or not the JAX backend was started before. Returns the platforms registered.
    """
    global _registered
    if _registered is not None:
        return _registered
    with _lock:
        if _registered is not None:
            return _registered
        import jax

        platforms = _available_platforms()
        for platform in platforms:
            for name, registration in _native.state_types(platform).items():
                jax.ffi.register_ffi_type(name, registration, platform=platform)
            bundles = _native.registrations(platform)
            for target, stages in bundles.items():
                jax.ffi.register_ffi_target(target, stages, platform=platform)
            _targets[platform] = frozenset(bundles)
        _registered = tuple(platforms)
        return _registered


def registered_targets(platform: str) -> frozenset[str]:
    """The FFI targets registered for `platform` (empty before :func:`register`)."""
    return _targets.get(platform, frozenset())


def registered_platforms() -> tuple[str, ...]:
    """The platforms registered so far (empty before the first :func:`register`)."""
    return _registered or ()

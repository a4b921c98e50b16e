"""Registration of state types and handler bundles with XLA: the extension's own
(:func:`register`) and those of any shared library built on this crate
(:func:`register_library`), read from the same kind of table and registered by the same code.

Order matters, and this module owns it:

1. The backend must exist first. Registering a state type and then a stateful bundle before
   the backend is initialized fails later, at backend start ("Types used by FFI handlers must
   be registered before the handler registration"), so registration starts it.
2. State types before bundles, per platform: XLA asks each handler for its state type id when
   the bundle is registered, and the id exists only once the type is.

XLA keeps one registry of targets (per platform) and one of state type names for the whole
process, and refuses a second, different registration of a name. So this module remembers who
registered each name (the extension, or a library by its path) and refuses a library whose
names someone else holds before it touches XLA, naming both; a name registered outside
rmsnorm_ffi is found by XLA itself, whose error is passed on with the same explanation.
"""

from __future__ import annotations

import os
import pathlib
import threading

from rmsnorm_ffi import _native

_PRODUCT = "rmsnorm_ffi"

_lock = threading.RLock()
_registered: tuple[str, ...] | None = None
# canonical library path -> the target names register_library returned
_libraries: dict[str, tuple[str, ...]] = {}
# ("type", name) or ("target", platform, name) -> who registered it (_PRODUCT or a path)
_owners: dict[tuple[str, ...], str] = {}
# platform -> the extension's own targets registered there (not the libraries')
_targets: dict[str, frozenset[str]] = {}


def _platform_available(platform: str) -> bool:
    """Whether JAX has a backend for `platform` (starting it)."""
    import jax

    try:
        jax.devices(platform)
    except RuntimeError:
        return False
    return True


def _available_platforms() -> list[str]:
    """The platforms of this build whose JAX backend can start (starting it)."""
    return [p for p in _native.platforms() if _platform_available(p)]


def _keys(description: dict) -> list[tuple[tuple[str, ...], str]]:
    """Every name a description would register, with how to say it in a message."""
    keys = [(("type", name), f"state type `{name}`") for name in description["state_types"]]
    keys += [
        (("target", b["platform"], b["target"]), f"target `{b['target']}` (platform {b['platform']})")
        for b in description["bundles"]
    ]
    return keys


def _reserve_product() -> None:
    """The extension's names belong to it from the start, registered or not: a library may not
    take them (and make a later :func:`register` fail)."""
    if not any(owner == _PRODUCT for owner in _owners.values()):
        for key, _ in _keys(_native.product()):
            _owners.setdefault(key, _PRODUCT)


# XLA's names of this build's platforms, as jax's registration functions key them: they map
# "cpu" (and "gpu") themselves, but take any other name as XLA's, and XLA's CUDA platform is
# "CUDA". Registered as "cuda", the handlers waited in jax's pending list for a platform of that
# name, which never comes: every call on an H200 failed with "No FFI handler registered for
# rmsnorm_fwd on a platform CUDA" (jax 0.11.2, the first run on a device).
_XLA_PLATFORMS = {"cpu": "cpu", "cuda": "CUDA", "rocm": "ROCM"}


def _register(description: dict, owner: str, platforms: list[str]) -> tuple[str, ...]:
    """Registers the description's state types, then its targets, for each of `platforms` in
    turn; records each name as `owner`'s once XLA took it. Returns the targets registered."""
    import jax

    where = "rmsnorm_ffi.register()" if owner == _PRODUCT else f"register_library({owner!r})"
    targets: list[str] = []
    # Types no bundle has as its state: the prepare- and initialize-stage states and user data
    # that bundles declare. The table does not say whose they are, so every platform the
    # library has bundles on gets them (XLA keeps the id a first registration assigned).
    named = {b["state_type"] for b in description["bundles"]}
    unnamed = [name for name in description["state_types"] if name not in named]
    for platform in platforms:
        bundles = [b for b in description["bundles"] if b["platform"] == platform]
        types = [b["state_type"] for b in bundles if b["state_type"] is not None]
        types = list(dict.fromkeys(types + (unnamed if bundles else [])))
        steps = [("type", name, description["state_types"][name]) for name in types]
        steps += [("target", b["target"], b["stages"]) for b in bundles]
        for kind, name, registration in steps:
            xla_platform = _XLA_PLATFORMS.get(platform, platform)
            try:
                if kind == "type":
                    jax.ffi.register_ffi_type(name, registration, platform=xla_platform)
                else:
                    jax.ffi.register_ffi_target(name, registration, platform=xla_platform)
            except Exception as e:  # XLA's own refusal: a name registered outside rmsnorm_ffi
                what = f"state type `{name}`" if kind == "type" else f"target `{name}` (platform {platform})"
                raise ValueError(
                    f"{where}: XLA refused {what}, probably registered already by someone else in this "
                    f"process ({type(e).__name__}: {e}); names are process-wide, so namespace them "
                    f"(`mylib.State`, `mylib_op`)"
                ) from e
            _owners[("type", name) if kind == "type" else ("target", platform, name)] = owner
            if kind == "target" and name not in targets:
                targets.append(name)
    return tuple(targets)


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
        _reserve_product()
        platforms = _available_platforms()
        product = _native.product()
        _register(product, _PRODUCT, platforms)
        for platform in platforms:
            _targets[platform] = frozenset(b["target"] for b in product["bundles"] if b["platform"] == platform)
        _registered = tuple(platforms)
        return _registered


def register_library(path: str | os.PathLike) -> tuple[str, ...]:
    """Registers every bundle and state type of the shared library at ``path``, a library built
    on rmsnorm_ffi that exports them with ``rmsnorm_ffi::export_library!``.

    Reads the library's table, makes the library report its states into this process's
    registry (so :func:`rmsnorm_ffi.stats` counts them), and registers, for each platform its
    bundles name that JAX has here, the state types and then the targets (bundles for other
    platforms are skipped). Returns the names of the targets registered. Idempotent (the same
    file again returns the same names) and thread-safe.

    Raises FileNotFoundError if there is no such file, and ValueError if it is not a bundle
    library, was built against an incompatible version of rmsnorm_ffi, or names a target or
    state type that the extension or another library already registered.
    """
    given = os.fspath(path)
    file = pathlib.Path(given)
    if not file.is_file():
        raise FileNotFoundError(f"register_library: no such file: {given}")
    key = str(file.resolve())
    with _lock:
        if key in _libraries:
            return _libraries[key]
        description = _native.load_library(key)
        _reserve_product()
        taken = [
            f"{what} by {'rmsnorm_ffi itself' if _owners[k] == _PRODUCT else _owners[k]}"
            for k, what in _keys(description)
            if _owners.get(k, key) != key
        ]
        if taken:
            raise ValueError(
                f"register_library({key!r}): already registered by someone else: {'; '.join(taken)}. "
                f"XLA takes each target and state type name once per process, so a library namespaces "
                f"its names (`mylib.State`, `mylib_op`)"
            )
        named = list(dict.fromkeys(b["platform"] for b in description["bundles"]))
        names = _register(description, key, [p for p in named if _platform_available(p)])
        _libraries[key] = names
        return names


def registered_targets(platform: str) -> frozenset[str]:
    """The FFI targets registered for `platform` (empty before :func:`register`)."""
    return _targets.get(platform, frozenset())


def registered_platforms() -> tuple[str, ...]:
    """The platforms registered so far (empty before the first :func:`register`)."""
    return _registered or ()


def registered_libraries() -> dict[str, tuple[str, ...]]:
    """The libraries registered so far: canonical path -> target names."""
    with _lock:
        return dict(_libraries)

"""`jax.export` with this package's custom calls.

JAX refuses to export a custom call unless told it is stable: `export_checks()` says so for
every target of this package. A serialized artifact holds target names, not code, so the
process that runs it must have the targets registered first: `deserialize` registers, then
deserializes (calling `rmsnorm_ffi.register()` before `jax.export.deserialize` does the same).

What exports: programs on one device, programs on an explicit mesh (the norm is lowered as a
`shard_map` there), and `shard_map` bodies. A program on an automatic mesh over several devices
does not: its partitioning is a `custom_partitioning` callback, which `jax.export` cannot
serialize; lowering it for export raises a ValueError saying so.
"""

from __future__ import annotations

from rmsnorm_ffi._partitioning import BACKWARD_TARGET, FORWARD_TARGET, RESIDUAL_TARGET
from rmsnorm_ffi._registration import register

TARGETS = (FORWARD_TARGET, BACKWARD_TARGET, RESIDUAL_TARGET)


def export_checks() -> list:
    """The `jax.export.DisabledSafetyCheck`s that allow this package's custom calls: pass them
    as ``jax.export.export(fn, disabled_checks=rmsnorm_ffi.export_checks())``."""
    from jax import export

    return [export.DisabledSafetyCheck.custom_call(name) for name in TARGETS]


def export(fn, **kwargs):
    """`jax.export.export(fn, ...)` with :func:`export_checks` added to ``disabled_checks``."""
    from jax import export as jax_export

    checks = [*export_checks(), *kwargs.pop("disabled_checks", ())]
    return jax_export.export(fn, disabled_checks=checks, **kwargs)


def deserialize(blob):
    """Registers this package's targets (:func:`rmsnorm_ffi.register`), then returns
    ``jax.export.deserialize(blob)``, ready to ``.call``."""
    from jax import export as jax_export

    register()
    return jax_export.deserialize(blob)

"""The live-state registry, as Python sees it."""

from __future__ import annotations

from typing import Any

from rmsnorm_ffi import _native


def stats() -> dict[str, Any]:
    """A snapshot of the live-state registry, all targets and platforms together.

    Keys: ``live_states``, ``created_states``, ``destroyed_states`` (ints); ``executions``
    ({target: int}); ``workspace_bytes`` (held now) and ``workspace_allocations`` (total so far);
    ``states`` (a list of {"id", "target", "type", "executions"} for each live state).
    """
    return _native.stats()

"""The live-state registry, as Python sees it."""

from __future__ import annotations

from typing import Any

from rmsnorm_ffi import _native


def stats() -> dict[str, Any]:
    """A snapshot of the live-state registry, all targets and platforms together.

    Keys: ``live_states``, ``created_states``, ``destroyed_states`` (ints); ``executions``
    ({target: int}); ``workspace_bytes`` (held now) and ``workspace_allocations`` (total so far);
    ``states`` (a list of {"id", "target", "type", "executions", "details"} for each live
    state; a GPU state's details say, per CUDA device, in which stage its resources were loaded
    and how many scratch bytes it holds); ``gpu_modules_loaded`` (CUDA modules loaded in this
    process: one per device, shared by every state).
    """
    return _native.stats()

import gc
import os
import subprocess
import sys

import jax
import pytest

import rmsnorm_ffi


@pytest.fixture
def fresh_caches():
    """Drops every compiled executable before and after the test, so states die."""
    jax.clear_caches()
    gc.collect()
    yield
    jax.clear_caches()
    gc.collect()


def live_states_of(target):
    return [s for s in rmsnorm_ffi.stats()["states"] if s["target"] == target]


def run_python(code, env=None, timeout=300):
    """Runs `code` in a fresh interpreter; returns the CompletedProcess (never raises)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )

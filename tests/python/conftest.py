import functools
import gc
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import pytest

import rmsnorm_ffi

REPO = pathlib.Path(__file__).resolve().parents[2]
BUNDLES_DIR = REPO / "target" / "bundles"
# The scaled_copy example's Python module (examples/scaled_copy/scaled_copy.py).
sys.path.insert(0, str(REPO / "examples" / "scaled_copy"))


@functools.cache
def bundle_library(package: str) -> pathlib.Path:
    """The shared library of the workspace's bundle crate `package` (`make bundles` builds them
    all into target/bundles/), built here first if cargo is available (a no-op when up to
    date), so that running pytest alone works too."""
    if shutil.which("cargo"):
        build = subprocess.run(
            ["cargo", "build", "--profile", "bundles", "--quiet", "-p", package],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert build.returncode == 0, build.stderr
    path = BUNDLES_DIR / f"lib{package}.so"
    assert path.exists(), f"{path} is missing: run `make bundles`"
    return path


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


@pytest.fixture(scope="session")
def scaled_copy_registered():
    """The scaled_copy example library, built and registered."""
    import scaled_copy

    return scaled_copy.load(bundle_library("scaled_copy"))

"""The stateful example bundle (the scaled_copy example library, registered with
`rmsnorm_ffi.register_library`) against real XLA: one state per call site per executable,
reused by every execution, freed with the executable, all seen in `rmsnorm_ffi.stats()`."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import live_states_of

import rmsnorm_ffi
from scaled_copy import TARGET, scaled_copy, scaled_copy_reference

pytestmark = pytest.mark.usefixtures("scaled_copy_registered")


def test_instantiate_once_per_call_site_and_reuse(fresh_caches):
    before = rmsnorm_ffi.stats()
    f = jax.jit(lambda x: scaled_copy(x, 2.0))
    x = jnp.arange(24, dtype=jnp.float32).reshape(4, 6)
    for _ in range(5):
        y = f(x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(scaled_copy_reference(x, 2.0)), rtol=1e-6)
    after = rmsnorm_ffi.stats()
    assert after["created_states"] - before["created_states"] == 1
    assert after["executions"][TARGET] - before["executions"].get(TARGET, 0) == 5
    (state,) = live_states_of(TARGET)
    assert state["executions"] == 5
    assert state["type"] == "scaled_copy.ScaledCopyState"


def test_each_call_site_and_executable_gets_its_own_state(fresh_caches):
    before = rmsnorm_ffi.stats()["created_states"]
    two_sites = jax.jit(lambda x: scaled_copy(x, 1.0) + scaled_copy(x, 3.0))
    x = jnp.ones((3, 5), jnp.float32)
    for _ in range(3):
        np.testing.assert_allclose(
            np.asarray(two_sites(x)), 4.0 / np.arange(1, 6) * np.ones((3, 5)), rtol=1e-6
        )
    assert rmsnorm_ffi.stats()["created_states"] - before == 2
    states = live_states_of(TARGET)
    assert sorted(s["executions"] for s in states) == [3, 3]
    # A new shape is a new executable, with its own state.
    two_sites(jnp.ones((2, 7), jnp.float32))
    assert rmsnorm_ffi.stats()["created_states"] - before == 4


def test_state_is_freed_with_the_executable(fresh_caches):
    f = jax.jit(lambda x: scaled_copy(x, 2.0))
    f(jnp.ones((2, 8), jnp.bfloat16)).block_until_ready()
    s = rmsnorm_ffi.stats()
    assert s["live_states"] >= 1
    assert s["workspace_bytes"] > 0, "the bf16 path holds a pooled f32 row"
    del f
    jax.clear_caches()
    gc.collect()
    s = rmsnorm_ffi.stats()
    assert s["live_states"] == 0, s
    assert s["created_states"] == s["destroyed_states"]
    assert s["workspace_bytes"] == 0, "workspaces are freed with their state"


@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2), (jnp.float16, 1e-3)])
def test_dtypes_and_vmap(dtype, rtol):
    x = jax.random.normal(jax.random.key(0), (3, 4, 9)).astype(dtype)
    got = jax.jit(jax.vmap(lambda r: scaled_copy(r, 0.5)))(x)
    want = scaled_copy_reference(x, 0.5)
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=rtol)


def test_workspaces_do_not_grow_in_steady_state(fresh_caches):
    f = jax.jit(lambda x: scaled_copy(x, 2.0))
    x = jnp.ones((16, 128), jnp.bfloat16)
    f(x).block_until_ready()
    allocations = rmsnorm_ffi.stats()["workspace_allocations"]
    for _ in range(200):
        f(x)
    jax.block_until_ready(f(x))
    assert rmsnorm_ffi.stats()["workspace_allocations"] == allocations


def test_python_side_validation():
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16, got int32"):
        scaled_copy(jnp.ones((2,), jnp.int32))
    with pytest.raises(ValueError, match="at least one axis"):
        scaled_copy(jnp.float32(1.0))
    with pytest.raises(ValueError, match="scale must be a finite number"):
        scaled_copy(jnp.ones((2,)), float("nan"))

"""Errors from Rust reach Python as exceptions with clear messages; panics never crash."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import testing_bundles as testing
from scaled_copy import TARGET, load, scaled_copy

pytestmark = pytest.mark.usefixtures("scaled_copy_registered")

XlaError = jax.errors.JaxRuntimeError


def raw_scaled_copy(x, **attrs):
    """Calls the target without the Python-side checks, to reach the Rust diagnostics."""
    load()
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))(x, **attrs)


def test_wrong_dtype_is_diagnosed_in_rust():
    with pytest.raises(XlaError, match=r"wrong dtype for argument 0: expected one of F32, BF16, F16, got S32"):
        raw_scaled_copy(jnp.ones((2, 3), jnp.int32), scale=np.float32(1), row_len=np.int64(3))


def test_wrong_attribute_type_missing_and_unexpected_are_reported_together():
    with pytest.raises(XlaError) as info:
        raw_scaled_copy(jnp.ones((2, 3), jnp.float32), scale=0.1, extra=np.int32(1))
    message = str(info.value)
    assert "[instantiate] failed to decode the call frame" in message
    # A Python float that F32 cannot hold exactly (one that it can is taken: test_register_library).
    assert ("wrong type for attribute `scale`: expected F32 scalar, got F64 scalar 0.1, which F32 cannot "
            "hold exactly: pass np.float32(0.1)") in message
    assert "missing attribute `row_len` (S64 scalar)" in message
    assert "unexpected attribute `extra`" in message


def test_invalid_attribute_value():
    with pytest.raises(XlaError, match=r"invalid attribute `scale`: must be finite, got inf"):
        raw_scaled_copy(jnp.ones((2, 3), jnp.float32), scale=np.float32(np.inf), row_len=np.int64(3))
    with pytest.raises(XlaError, match=r"invalid attribute `row_len`: must be in 1..="):
        raw_scaled_copy(jnp.ones((2, 3), jnp.float32), scale=np.float32(1), row_len=np.int64(-2))


def test_shape_that_disagrees_with_the_instantiated_row_length():
    with pytest.raises(XlaError, match=r"last axis has 3 elements but the call site was instantiated for row_len=4"):
        raw_scaled_copy(jnp.ones((2, 3), jnp.float32), scale=np.float32(1), row_len=np.int64(4))


@pytest.mark.parametrize("stage", ["instantiate", "execute"])
def test_panic_becomes_an_exception_and_the_process_lives_on(stage):
    with pytest.raises(XlaError, match=rf"panic in rmsnorm_ffi_testing_stages \[{stage}\]: deliberate panic"):
        jax.jit(lambda: testing.stage_counts(panic_in=stage))().block_until_ready()
    # The process goes on: the same target and another one still work.
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda: testing.stage_counts())()), [1, 0, 0, 1])
    y = jax.jit(lambda x: scaled_copy(x, 1.0))(jnp.ones((1, 2), jnp.float32))
    np.testing.assert_allclose(np.asarray(y), [[1.0, 0.5]])


@pytest.mark.parametrize("stage", ["instantiate", "execute"])
def test_error_in_a_stage_becomes_an_exception(stage):
    with pytest.raises(XlaError, match=rf"deliberate error in the {stage} stage"):
        jax.jit(lambda: testing.stage_counts(fail_in=stage))().block_until_ready()


def test_unknown_stage_name_is_reported():
    with pytest.raises(XlaError, match=r"unknown stage `sometimes`"):
        jax.jit(lambda: testing.stage_counts(panic_in="sometimes"))().block_until_ready()

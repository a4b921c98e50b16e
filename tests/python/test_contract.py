"""The op contract is defined once, in Rust (`src/handlers/contract.rs`), and read by the Python
checks through `_native.contract()`: these tests hold both sides to it. Every listed (x, weight)
pair runs and matches the jnp reference in its accumulation dtype; every float pair not listed
is refused by the Python check and, called around it, by the Rust handler (no fallback to a
neighbouring kernel); the target names and the row limit are the ones the ops use."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rmsnorm_ffi
from rmsnorm_ffi import _math, _native, _ops, _partitioning, rms_norm_bwd, rms_norm_fwd, rms_norm_reference

CONTRACT = _native.contract()
PAIRS = [(p["x"], p["weight"], p["accumulation"]) for p in CONTRACT["dtype_pairs"]]
FLOATS = ["float32", "float64", "bfloat16", "float16"]
TOLERANCE = {"float64": 1e-12, "float32": 2e-5, "float16": 4e-3, "bfloat16": 2e-2}


@pytest.fixture(autouse=True)
def x64():
    # float64 pairs need x64; restored afterwards so other tests see the default.
    with jax.enable_x64(True):
        yield


def test_the_contract_is_what_the_ops_use():
    assert (CONTRACT["forward_target"], CONTRACT["backward_target"], CONTRACT["residual_target"]) == (
        _partitioning.FORWARD_TARGET,
        _partitioning.BACKWARD_TARGET,
        _partitioning.RESIDUAL_TARGET,
    )
    assert _ops.MAX_ROW_LEN == CONTRACT["max_row_len"] == 1 << 26
    assert len(PAIRS) == len({(x, w) for x, w, _ in PAIRS}) == 16
    # rstd's dtype as the primitives type it (_math) is the contract's accumulation dtype.
    for x, _, acc in PAIRS:
        assert _math.acc_dtype(x) == jnp.dtype(acc), x
    assert {x for x, _, _ in PAIRS} == set(FLOATS)


@pytest.mark.parametrize("x_dtype,w_dtype,acc", PAIRS, ids=[f"{x}-w{w}" for x, w, _ in PAIRS])
def test_every_listed_pair_runs_and_matches_the_reference(x_dtype, w_dtype, acc):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((6, 40)), x_dtype)
    w = jnp.asarray(rng.uniform(0.5, 1.5, 40), w_dtype)
    y, rstd = jax.jit(rms_norm_fwd)(x, w)
    assert y.dtype == jnp.dtype(x_dtype) and rstd.dtype == jnp.dtype(acc)
    want = rms_norm_reference(x, w)
    tol = TOLERANCE[x_dtype]
    np.testing.assert_allclose(np.asarray(y, np.float64), np.asarray(want, np.float64), rtol=tol, atol=tol)
    dx, dw = jax.jit(rms_norm_bwd)(x, w, rstd, jnp.ones_like(x))
    assert dx.dtype == jnp.dtype(x_dtype) and dw.dtype == jnp.dtype(w_dtype)


def test_every_float_x_pairs_with_every_float_weight():
    assert {(x, w) for x, w, _ in PAIRS} == set(itertools.product(FLOATS, FLOATS))


UNLISTED = [(x, w) for x, w in itertools.product(FLOATS, ["int32", "int8"])]


@pytest.mark.parametrize("x_dtype,w_dtype", UNLISTED, ids=[f"{x}-w{w}" for x, w in UNLISTED])
def test_every_unlisted_pair_is_refused_on_both_sides(x_dtype, w_dtype):
    x = jnp.ones((2, 8), x_dtype)
    w = jnp.ones((8,), w_dtype)
    with pytest.raises(TypeError, match=rf"weight must be a float32.*got dtype {w_dtype}"):
        rmsnorm_ffi.rms_norm(x, w)
    # Around the Python check, straight to the target: the Rust handler refuses it too.
    rmsnorm_ffi.register()
    acc = _ops._acc_dtype(x_dtype)
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape[:-1], acc))
    call = jax.ffi.ffi_call(CONTRACT["forward_target"], out)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"wrong dtype for argument 1: expected .*got"):
        jax.jit(lambda x, w: call(x, w, eps=np.float32(1e-5), has_weight=True, row_len=np.int64(8)))(x, w)


def test_an_x_dtype_outside_the_contract_is_refused_naming_the_listed_ones():
    with pytest.raises(TypeError, match="x must be a float32, float64, bfloat16 or float16 array, got dtype int8"):
        rmsnorm_ffi.rms_norm(jnp.ones((2, 4), jnp.int8))

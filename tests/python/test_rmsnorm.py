"""rms_norm on CPU against a float64 NumPy reference: shapes, dtypes, weights, eps, grads,
vmap, special values, input checks, and no allocation in steady state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import rmsnorm_ffi
from rmsnorm_ffi import rms_norm, rms_norm_bwd, rms_norm_fwd, rms_norm_reference

# Tolerances (relative to 1 + |reference|) per dtype: the output is rounded to the dtype.
TOL = {"float32": 2e-6, "float64": 1e-12, "bfloat16": 1.6e-2, "float16": 2e-3}
DTYPES = ["float32", "float64", "bfloat16", "float16"]
SHAPES = [(7,), (1,), (3, 128), (5, 4097), (2, 65536), (0, 16), (2, 3, 4, 7), (2, 0, 3, 1)]


def np_reference(x, w, eps):
    """float64 (y, rstd) from arrays already rounded to their dtypes."""
    x = np.asarray(x, np.float64)
    ms = np.mean(x * x, axis=-1, keepdims=True) if x.shape[-1] else np.full(x.shape[:-1] + (1,), np.nan)
    rstd = 1.0 / np.sqrt(ms + eps)
    y = x * rstd
    if w is not None:
        y = y * np.asarray(w, np.float64)
    return y, rstd[..., 0]


def np_reference_bwd(x, w, dy, eps):
    x = np.asarray(x, np.float64)
    dy = np.asarray(dy, np.float64)
    n = x.shape[-1]
    wf = np.ones(n) if w is None else np.asarray(w, np.float64)
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    xhat = x * rstd
    g = dy * wf
    dx = rstd * (g - xhat * np.mean(g * xhat, axis=-1, keepdims=True))
    dw = (dy * xhat).reshape(-1, n).sum(axis=0)
    return dx, dw


def assert_close(got, want, tol, what):
    got = np.asarray(got, np.float64)
    err = np.abs(got - want) / (1.0 + np.abs(want))
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert err.size == 0 or np.nanmax(err) <= tol, f"{what}: max error {np.nanmax(err)} > {tol}"


def make(shape, dtype, seed=0, scale=1.0):
    return (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale).astype(dtype)


def x64(dtype):
    return jax.enable_x64(dtype == "float64")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("weight", ["none", "same", "float32"])
def test_forward_matches_float64_reference(shape, dtype, weight):
    with x64(dtype):
        x = make(shape, dtype)
        w = None
        if weight != "none":
            wdtype = dtype if weight == "same" else "float32"
            w = (1.0 + 0.5 * make(shape[-1:], "float32", seed=1)).astype(wdtype)
        y, rstd = jax.jit(lambda x, w: rms_norm_fwd(x, w, eps=1e-5))(x, w)
        assert y.dtype == x.dtype and y.shape == x.shape
        assert rstd.shape == x.shape[:-1]
        assert rstd.dtype == (jnp.float64 if dtype == "float64" else jnp.float32)
        want_y, want_rstd = np_reference(x, w, 1e-5)
        assert_close(y, want_y, TOL[dtype], "y")
        assert_close(rstd, want_rstd, 1e-12 if dtype == "float64" else 2e-6, "rstd")
        np.testing.assert_array_equal(np.asarray(rms_norm(x, w, eps=1e-5)), np.asarray(y))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7,), (3, 128), (5, 4097), (2, 3, 4, 7), (0, 5)], ids=str)
@pytest.mark.parametrize("with_weight", [True, False])
def test_backward_matches_float64_reference(shape, dtype, with_weight):
    with x64(dtype):
        x = make(shape, dtype)
        dy = make(shape, dtype, seed=2)
        w = (1.0 + 0.5 * make(shape[-1:], "float32", seed=1)).astype(dtype) if with_weight else None
        _, rstd = rms_norm_fwd(x, w)
        dx, dw = jax.jit(rms_norm_bwd)(x, w, rstd, dy)
        want_dx, want_dw = np_reference_bwd(x, w, dy, 1e-5)
        assert_close(dx, want_dx, TOL[dtype] * 4, "dx")
        if with_weight:
            rows = max(1, int(np.prod(shape[:-1])))
            assert dw.dtype == w.dtype
            assert_close(dw, want_dw, TOL[dtype] * 4 * rows, "dweight")
        else:
            assert dw is None


@pytest.mark.parametrize("eps", [0.0, 1e-6, 1e-2, 3.0])
def test_eps_values(eps):
    x = make((4, 33), "float32")
    assert_close(rms_norm(x, eps=eps), np_reference(x, None, eps)[0], 2e-6, f"eps={eps}")


def test_gradients_in_float64():
    with jax.enable_x64(True):
        x = make((3, 5, 9), "float64")
        w = 1.0 + 0.3 * make((9,), "float64", seed=3)
        check_grads(lambda x, w: rms_norm(x, w, eps=1e-5), (x, w), order=1, modes=["rev"])
        check_grads(lambda x: rms_norm(x, eps=1e-3), (x,), order=1, modes=["rev"])


def test_gradients_agree_with_the_jnp_reference():
    x = make((6, 40), "float32")
    w = 1.0 + 0.3 * make((40,), "float32", seed=3)
    loss = lambda f: (lambda x, w: jnp.sum(jnp.sin(f(x, w))))  # noqa: E731
    got = jax.jit(jax.grad(loss(rms_norm), argnums=(0, 1)))(x, w)
    want = jax.grad(loss(rms_norm_reference), argnums=(0, 1))(x, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("axis", [0, 1], ids=["leading", "middle"])
def test_vmap_over_leading_and_middle_axes(axis):
    x = make((3, 4, 16), "float32")
    w = 1.0 + 0.3 * make((16,), "float32", seed=3)
    got = jax.jit(jax.vmap(lambda x: rms_norm(x, w), in_axes=axis, out_axes=axis))(x)
    assert_close(got, np_reference(x, w, 1e-5)[0], 2e-6, "vmap")
    # Per-example weight gradients (weight not mapped) and gradients through vmap.
    f = lambda x, w: jnp.sum(rms_norm(x, w) ** 2 * jnp.arange(16.0))  # noqa: E731
    g = lambda x, w: jnp.sum(rms_norm_reference(x, w) ** 2 * jnp.arange(16.0))  # noqa: E731
    per_example = jax.vmap(jax.grad(f, argnums=1), in_axes=(axis, None))(x, w)
    want = jax.vmap(jax.grad(g, argnums=1), in_axes=(axis, None))(x, w)
    np.testing.assert_allclose(np.asarray(per_example), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_vmap_with_a_mapped_weight():
    x = make((3, 4, 16), "float32")
    w = 1.0 + 0.3 * make((3, 16), "float32", seed=3)
    got = jax.vmap(rms_norm)(x, w)
    want = np.stack([np_reference(x[i], w[i], 1e-5)[0] for i in range(3)])
    assert_close(got, want, 2e-6, "mapped weight")
    f = lambda x, w: jnp.sum(rms_norm(x, w) * jnp.arange(16.0))  # noqa: E731
    g = lambda x, w: jnp.sum(rms_norm_reference(x, w) * jnp.arange(16.0))  # noqa: E731
    for a, b in zip(jax.vmap(jax.grad(f, (0, 1)))(x, w), jax.vmap(jax.grad(g, (0, 1)))(x, w)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_rows_of_zeros():
    x = jnp.zeros((3, 8), jnp.float32)
    y, rstd = rms_norm_fwd(x, eps=1e-5)
    np.testing.assert_array_equal(np.asarray(y), 0.0)
    np.testing.assert_allclose(np.asarray(rstd), 1.0 / np.sqrt(1e-5), rtol=1e-6)
    dx = jax.grad(lambda x: jnp.sum(rms_norm(x) * 2.0))(x)
    assert np.all(np.isfinite(np.asarray(dx)))


@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_special_values_propagate_like_jnp(value):
    x = np.array(make((3, 6), "float32"))
    x[1, 2] = value
    got = np.asarray(rms_norm(jnp.asarray(x)))
    want = np.asarray(rms_norm_reference(jnp.asarray(x)))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[~np.isnan(got)], want[~np.isnan(want)], rtol=1e-6)


def test_input_checks_name_the_argument():
    x = jnp.ones((2, 4), jnp.float32)
    cases = [
        (TypeError, "x must be a float32, float64, bfloat16 or float16 array, got dtype int32", lambda: rms_norm(jnp.ones((2, 4), jnp.int32))),
        (ValueError, "x must have at least one axis", lambda: rms_norm(jnp.float32(1.0))),
        (ValueError, r"weight must have shape \(4,\)", lambda: rms_norm(x, jnp.ones((3,)))),
        (ValueError, r"weight must have shape \(4,\)", lambda: rms_norm(x, jnp.ones((1, 4)))),
        (ValueError, "scale_offset=1.0 applies to a weight", lambda: rms_norm(x, scale_offset=1.0)),
        (ValueError, "scale_offset must be finite", lambda: rms_norm(x, jnp.ones((4,)), scale_offset=float("nan"))),
        (ValueError, "scale_offset must be finite", lambda: rms_norm(x, jnp.ones((4,)), scale_offset=1e39)),
        (TypeError, "scale_offset must be a real number", lambda: rms_norm(x, jnp.ones((4,)), scale_offset="one")),
        (TypeError, "scale_offset must be a Python number", lambda: jax.jit(lambda o: rms_norm(x, jnp.ones((4,)), scale_offset=o))(1.0)),
        (TypeError, "weight must be a", lambda: rms_norm(x, jnp.ones((4,), jnp.int32))),
        (ValueError, r"eps must be finite and >= 0 \(as a float32\), got -1.0", lambda: rms_norm(x, eps=-1.0)),
        (ValueError, "eps must be finite and >= 0.*got nan", lambda: rms_norm(x, eps=float("nan"))),
        (ValueError, "eps must be finite and >= 0.*got inf", lambda: rms_norm(x, eps=float("inf"))),
        (ValueError, "eps must be finite and >= 0.*got 1e\\+39", lambda: rms_norm(x, eps=1e39)),
        (TypeError, "eps must be a real number", lambda: rms_norm(x, eps="small")),
        (TypeError, "eps must be a Python number", lambda: jax.jit(lambda e: rms_norm(x, eps=e))(1e-5)),
        (ValueError, r"rstd must have shape \(2,\)", lambda: rms_norm_bwd(x, None, jnp.ones((3,)), x)),
        (ValueError, "dy must have x's shape", lambda: rms_norm_bwd(x, None, jnp.ones((2,)), jnp.ones((2, 5)))),
    ]
    for exc, match, call in cases:
        with pytest.raises(exc, match=match):
            call()


def test_no_workspace_allocation_in_steady_state():
    x = make((64, 256), "bfloat16")
    w = jnp.ones((256,), jnp.bfloat16)
    step = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(rms_norm(x, w).astype(jnp.float32)), argnums=(0, 1)))
    jax.block_until_ready(step(x, w))
    before = rmsnorm_ffi.stats()
    for _ in range(1000):
        out = step(x, w)
    jax.block_until_ready(out)
    after = rmsnorm_ffi.stats()
    assert after["workspace_allocations"] == before["workspace_allocations"]
    assert after["executions"]["rmsnorm_fwd"] - before["executions"]["rmsnorm_fwd"] == 1000
    assert after["executions"]["rmsnorm_bwd"] - before["executions"]["rmsnorm_bwd"] == 1000


def test_weight_gradient_is_bitwise_reproducible():
    x = make((512, 384), "float32")
    w = 1.0 + 0.3 * make((384,), "float32", seed=3)
    grad = jax.jit(jax.grad(lambda w: jnp.sum(rms_norm(x, w) * x)))
    first = np.asarray(grad(w))
    for _ in range(20):
        np.testing.assert_array_equal(np.asarray(grad(w)), first)

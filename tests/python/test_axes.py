"""Normalizing over several trailing axes (`axis=(-2, -1)`, as Flax's `reduction_axes` and
Haiku's `axis` take them): values, rstd and gradients against a float64 NumPy reference that
reduces over those axes itself, the four ops, transformations, and the errors for axes that are
not trailing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rmsnorm_ffi import rms_norm, rms_norm_bwd, rms_norm_fwd, rms_norm_reference, rms_norm_residual

TOL = {"float32": 3e-6, "bfloat16": 1.6e-2}


def np_norm(x, w, eps, axes):
    """float64 y and rstd over `axes` (a tuple of trailing axes), from arrays in their dtypes."""
    x = np.asarray(x, np.float64)
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + eps)
    y = x * rstd
    if w is not None:
        y = y * np.asarray(w, np.float64)
    return y, rstd.reshape(rstd.shape[: x.ndim - len(axes)])


def np_grads(x, w, dy, eps, axes):
    """float64 (dx, dw) of sum(y * dy) over `axes`."""
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    k = len(axes)
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + eps)
    xhat = x * rstd
    g = dy * (1.0 if w is None else np.asarray(w, np.float64))
    c = np.mean(g * xhat, axis=axes, keepdims=True)
    dx = rstd * (g - xhat * c)
    dw = None if w is None else (dy * xhat).reshape((-1,) + x.shape[x.ndim - k:]).sum(axis=0)
    return dx, dw


def close(got, want, dtype):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    np.testing.assert_array_less(np.abs(got - want), TOL[dtype] * (1 + np.abs(want)) + 1e-30)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "shape, axis",
    [
        ((4, 6, 16), (-2, -1)),  # Flax's reduction_axes=(-2, -1)
        ((3, 2, 5, 7), (1, 2, 3)),  # Haiku's axis as positive indices, odd lengths
        ((2, 3, 1, 64), (-2, -1)),  # a trailing axis of length 1
        ((5, 8), (-1,)),  # a tuple of one is the last axis
    ],
)
@pytest.mark.parametrize("weighted", [True, False])
def test_values_rstd_and_gradients_over_trailing_axes(shape, axis, dtype, weighted):
    k = len(axis)
    x = jax.random.normal(jax.random.key(0), shape, dtype)
    w = (1 + 0.1 * jax.random.normal(jax.random.key(1), shape[len(shape) - k:])).astype(dtype) if weighted else None
    dy = jax.random.normal(jax.random.key(2), shape, dtype)
    axes = tuple(range(len(shape) - k, len(shape)))
    want_y, want_rstd = np_norm(x, w, 1e-5, axes)
    close(rms_norm(x, w, axis=axis), want_y, dtype)
    close(jax.jit(lambda x, w: rms_norm(x, w, axis=axis))(x, w), want_y, dtype)
    y, rstd = rms_norm_fwd(x, w, axis=axis)
    assert y.shape == x.shape and rstd.shape == shape[: len(shape) - k]
    np.testing.assert_allclose(np.asarray(rstd, np.float64), want_rstd, rtol=2e-6)
    want_dx, want_dw = np_grads(x, w, dy, 1e-5, axes)
    dx, dw = rms_norm_bwd(x, w, rstd, dy, axis=axis)
    close(dx, want_dx, dtype)
    # Through the VJP as users take it: grad of sum(y * dy).
    if weighted:
        gx, gw = jax.grad(lambda x, w: jnp.sum(rms_norm(x, w, axis=axis).astype(jnp.float32) * dy.astype(jnp.float32)), (0, 1))(x, w)
        assert gw.shape == w.shape and dw.shape == w.shape
        scale = 1 + np.abs(want_dw).max()
        for got in (dw, gw):
            np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - want_dw), 4 * TOL[dtype] * scale * np.sqrt(x.size / w.size))
    else:
        gx = jax.grad(lambda x: jnp.sum(rms_norm(x, axis=axis).astype(jnp.float32) * dy.astype(jnp.float32)))(x)
        assert dw is None
    close(gx, want_dx, dtype)


def test_the_residual_and_vmap_over_trailing_axes():
    x = jax.random.normal(jax.random.key(0), (3, 4, 6, 32))
    r = jax.random.normal(jax.random.key(1), x.shape)
    w = 1 + 0.1 * jax.random.normal(jax.random.key(2), (6, 32))
    y, h = rms_norm_residual(x, r, w, axis=(-2, -1))
    np.testing.assert_array_equal(h, x + r)
    np.testing.assert_array_equal(y, rms_norm(h, w, axis=(-2, -1)))
    # vmap over a leading axis: the same bits as the whole batch at once.
    np.testing.assert_array_equal(jax.vmap(lambda x: rms_norm(x, w, axis=(-2, -1)))(x), rms_norm(x, w, axis=(-2, -1)))
    # The reference takes the same axes.
    np.testing.assert_allclose(rms_norm_reference(x, w, axis=(-2, -1)), rms_norm(x, w, axis=(-2, -1)), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize(
    "axis, error, message",
    [
        ((0, -1), ValueError, r"axis must name trailing axes \(the last 2 of x's 3\), got \(0, -1\): axis 0 is not trailing; move it last"),
        ((-2,), ValueError, r"the last 1 of x's 3\), got \(-2,\): axis 1 is not trailing"),
        (3, ValueError, r"axis 3 is out of range for x with 3 axes"),
        ((-1, 2), ValueError, r"names an axis twice"),
        ((), TypeError, r"axis must be an int or a tuple of ints, got \(\)"),
        (1.0, TypeError, r"axis must be an int or a tuple of ints, got 1.0"),
        (True, TypeError, r"axis must be an int or a tuple of ints, got True"),
    ],
)
def test_axes_that_are_not_trailing_raise_naming_them(axis, error, message):
    x = jnp.ones((2, 3, 4))
    for call in (lambda: rms_norm(x, axis=axis), lambda: rms_norm_fwd(x, axis=axis)):
        with pytest.raises(error, match=message):
            call()


def test_several_axes_that_are_not_trailing_are_all_named():
    with pytest.raises(ValueError, match=r"the last 2 of x's 4\), got \(0, 1\): axes 0, 1 are not trailing; move them last"):
        rms_norm(jnp.ones((2, 3, 4, 5)), axis=(0, 1))


def test_the_weight_has_the_shape_of_the_normalized_axes():
    x = jnp.ones((2, 3, 4))
    with pytest.raises(ValueError, match=r"weight must have shape \(3, 4\) to match x's last 2 axes, got \(4,\)"):
        rms_norm(x, jnp.ones(4), axis=(-2, -1))
    with pytest.raises(ValueError, match=r"rstd must have shape \(2,\)"):
        rms_norm_bwd(x, None, jnp.ones((2, 3)), x, axis=(-2, -1))


_MESH_CODE = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import flax.linen as nn
import rmsnorm_ffi
from rmsnorm_ffi import rms_norm

x = jax.random.normal(jax.random.key(0), (8, 6, 32))
w = 1 + 0.1 * jax.random.normal(jax.random.key(1), (6, 32))
cot = jax.random.normal(jax.random.key(2), x.shape)

def loss(x, w):
    return jnp.sum(rms_norm(x, w, axis=(-2, -1)) * cot)

want = (rms_norm(x, w, axis=(-2, -1)), *jax.grad(loss, (0, 1))(x, w))
flax_norm = rmsnorm_ffi.RMSNorm(reduction_axes=(-2, -1), feature_axes=-1)
flax_vars = flax_norm.init(jax.random.key(3), x)
flax_want = flax_norm.apply(flax_vars, x)
try:
    import rmsnorm_ffi.equinox as reqx
    eqx_norm = reqx.RMSNorm((6, 32))
    eqx_want = jax.vmap(eqx_norm)(x)
except ImportError:
    eqx_norm = None

results = []
for kind in (AxisType.Explicit, AxisType.Auto):
    mesh = jax.make_mesh((2,), ("data",), axis_types=(kind,))
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        ws = jax.device_put(w, NamedSharding(mesh, P()))
        step = jax.jit(lambda x, w: (rms_norm(x, w, axis=(-2, -1)), *jax.grad(loss, (0, 1))(x, w)))
        got = step(xs, ws)
        hlo = step.lower(xs, ws).compile().as_text()
        diffs = [float(jnp.max(jnp.abs(g - v))) for g, v in zip(got, want)]
        fl = jax.jit(flax_norm.apply)
        diffs.append(float(jnp.max(jnp.abs(fl(flax_vars, xs) - flax_want))))
        if eqx_norm is not None:
            diffs.append(float(jnp.max(jnp.abs(jax.jit(jax.vmap(eqx_norm))(xs) - eqx_want))))
        results.append({"kind": str(kind), "diffs": diffs, "gathers": hlo.count("all-gather"),
                        "y_sharding": str(got[0].sharding.spec)})
print("RESULTS" + json.dumps(results))
"""


def test_trailing_axes_on_explicit_and_automatic_meshes():
    """Rows sharded over 2 devices (`jax.make_mesh` + `jax.set_mesh`, explicit and automatic):
    the op over trailing axes, its gradients, the Flax module with trailing reduction_axes and
    the Equinox module (vmapped) give the unsharded values, and nothing is all-gathered."""
    import json

    from conftest import run_python

    result = run_python(_MESH_CODE, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(l for l in result.stdout.splitlines() if l.startswith("RESULTS"))
    for r in json.loads(line[len("RESULTS"):]):
        assert r["gathers"] == 0, r
        assert max(r["diffs"]) < 1e-5, r
        assert "data" in r["y_sharding"], r

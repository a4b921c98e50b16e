"""The fused residual add, `rms_norm_residual(x, residual, weight) -> (y, h)`: h is exactly
jnp's `x + residual` and y exactly `rms_norm(h)`, in one FFI call; gradients of y and h both
reach x and the residual through one fused backward; vmap, jvp, explicit and automatic meshes
(no gathers), export, and the Flax modules' residual argument."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_python

import rmsnorm_ffi
from rmsnorm_ffi import rms_norm, rms_norm_reference, rms_norm_residual


def _data(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(shape) + 0.3, dtype) for _ in range(2)] + [
        jnp.asarray(1 + 0.1 * rng.standard_normal(shape[-1]), dtype)
    ]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64])
@pytest.mark.parametrize("weight", [True, False], ids=["weight", "plain"])
def test_values_are_the_add_then_the_norm_bit_for_bit(dtype, weight):
    with jax.enable_x64(dtype == jnp.float64):
        x, r, w = _data((5, 3, 96), dtype)
        w = w if weight else None
        y, h = jax.jit(rms_norm_residual)(x, r, w)
        assert h.dtype == y.dtype == x.dtype and h.shape == x.shape
        np.testing.assert_array_equal(np.asarray(h, np.float64), np.asarray(x + r, np.float64))
        np.testing.assert_array_equal(np.asarray(y, np.float64), np.asarray(rms_norm(x + r, w), np.float64))
        eqns = [e.primitive.name for e in jax.make_jaxpr(rms_norm_residual)(x, r, w).jaxpr.eqns]
        assert eqns == ["rmsnorm_residual_fwd"]


def _loss(fused):
    c = jnp.linspace(-1.0, 2.0, 64)

    def loss(x, r, w):
        y, h = fused(x, r, w)
        return jnp.sum(jnp.sin(y) * c) + jnp.sum(h * h * c)

    return loss


OURS = _loss(rms_norm_residual)
REF = _loss(lambda x, r, w: (rms_norm_reference(x + r, w), x + r))


def test_gradients_of_y_and_h_reach_x_and_the_residual():
    with jax.enable_x64(True):
        x, r, w = _data((6, 64), jnp.float64)
        got = jax.grad(OURS, (0, 1, 2))(x, r, w)
        want = jax.grad(REF, (0, 1, 2))(x, r, w)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)
        np.testing.assert_array_equal(got[0], got[1])  # dx == dresidual
        names = [e.primitive.name for e in jax.make_jaxpr(jax.grad(OURS, (0, 1, 2)))(x, r, w).jaxpr.eqns]
        assert names.count("rmsnorm_residual_fwd") == 1 and names.count("rmsnorm_bwd") == 1, names
        from jax.test_util import check_grads

        check_grads(OURS, (x, r, w), order=2, modes=("fwd", "rev"))


def test_vmap_is_one_call_and_matches():
    x, r, w = _data((4, 5, 64), jnp.float32)
    ws = jnp.stack([w * (1 + i) for i in range(4)])
    f = jax.vmap(rms_norm_residual)
    names = [e.primitive.name for e in jax.make_jaxpr(f)(x, r, ws).jaxpr.eqns]
    assert names == ["rmsnorm_residual_fwd"]
    y, h = f(x, r, ws)
    np.testing.assert_allclose(y, jax.vmap(rms_norm_reference)(x + r, ws), rtol=1e-5, atol=1e-5)
    per_example = jax.vmap(jax.grad(OURS, 2), (0, 0, None))(x, r, w)
    want = jax.vmap(jax.grad(REF, 2), (0, 0, None))(x, r, w)
    np.testing.assert_allclose(per_example, want, rtol=1e-4, atol=1e-4)


def test_bad_residual_is_refused_by_name():
    x, r, w = _data((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        rms_norm_residual(x, r[:, :4], w)
    with pytest.raises(ValueError, match="residual must have x's shape .* and dtype float32"):
        rms_norm_residual(x, r.astype(jnp.bfloat16), w)


def test_flax_modules_take_a_residual():
    import flax.linen as nn
    from flax import nnx

    x, r, _ = _data((4, 64), jnp.bfloat16)
    norm = rmsnorm_ffi.RMSNorm(dtype=jnp.bfloat16)
    params = norm.init(jax.random.key(0), x)
    y, h = norm.apply(params, x, r)
    want = nn.RMSNorm(dtype=jnp.bfloat16).apply(params, x + r)
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(x + r, np.float32))
    assert y.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2)
    from rmsnorm_ffi import nnx as ffi_nnx

    mine = ffi_nnx.RMSNorm(64, rngs=nnx.Rngs(0))
    theirs = nnx.RMSNorm(64, rngs=nnx.Rngs(0))
    y, h = mine(x, residual=r)
    assert y.dtype == theirs(x + r).dtype
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(theirs(x + r), np.float32), rtol=1e-2, atol=1e-2)


SHARDED = textwrap.dedent(
    """
    import re
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import rmsnorm_ffi
    from rmsnorm_ffi import rms_norm_residual, rms_norm_reference
    rng = np.random.default_rng(0)
    x, r = (jnp.asarray(rng.standard_normal((16, 64)) + 0.3, jnp.float32) for _ in range(2))
    w = jnp.linspace(0.5, 1.5, 64)
    c = jnp.linspace(-1.0, 2.0, 64)
    def loss(fused):
        def f(x, r, w):
            y, h = fused(x, r, w)
            return jnp.sum(jnp.sin(y) * c) + jnp.sum(h * h * c)
        return f
    want = jax.grad(loss(lambda x, r, w: (rms_norm_reference(x + r, w), x + r)), (0, 1, 2))(x, r, w)
    for kind in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((4,), ("data",), axis_types=(kind,))
        with jax.set_mesh(mesh):
            put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data", None)))
            step = jax.jit(jax.grad(loss(rms_norm_residual), (0, 1, 2)))
            got = step(put(x), put(r), w)
            hlo = step.lower(put(x), put(r), w).compile().as_text()
            assert not re.findall(r"all-gather(-start)?\\(", hlo), kind
            for a, b in zip(got, want):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
            if kind == AxisType.Explicit:
                assert str(jax.typeof(got[0])) == "float32[16@data,64]", jax.typeof(got[0])
                exported = rmsnorm_ffi.export(jax.jit(rms_norm_residual))(put(x), put(r), w)
                assert exported.nr_devices == 4
    print("ok")
    """
)


def test_sharded_like_the_plain_op():
    result = run_python(SHARDED, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["ok"]

"""`rmsnorm_ffi.equinox.RMSNorm` against `equinox.nn.RMSNorm`: the same tree (parameters load
across), values and gradients within the dtypes' rounding over equinox's options (weight, bias,
dtype, several axes), its shape invariant, its state pass-through, vmap and filter_jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

eqx = pytest.importorskip("equinox")

from rmsnorm_ffi.equinox import RMSNorm  # noqa: E402

# Relative-and-absolute tolerances of the result dtype: half precision within 1 ulp of a float32
# value rounded once more, float32 within a few ulp (sums in another order).
TOL = {jnp.dtype(jnp.float32): 3e-6, jnp.dtype(jnp.bfloat16): 1.6e-2, jnp.dtype(jnp.float16): 2e-3}


def _pair(shape, **kwargs):
    """Ours and equinox's with the same random weight and bias (equinox's init is ones/zeros)."""
    theirs = eqx.nn.RMSNorm(shape, **kwargs)
    ours = RMSNorm(shape, **kwargs)
    leaves, tree = jax.tree.flatten(theirs)
    keys = jax.random.split(jax.random.key(7), max(len(leaves), 1))
    randomized = [(l + 0.1 * jax.random.normal(k, l.shape)).astype(l.dtype) for l, k in zip(leaves, keys)]
    theirs = jax.tree.unflatten(tree, randomized)
    # Our module is equinox's class with another __call__: equinox's parameters load into it.
    ours = jax.tree.unflatten(jax.tree.structure(ours), randomized)
    return ours, theirs


def _close(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOL[jnp.dtype(got.dtype)]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", [(96,), (6, 32), (7,)])
@pytest.mark.parametrize("use_weight, use_bias", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("param_dtype", [None, jnp.bfloat16])
def test_values_and_gradients_match_equinox(x_dtype, shape, use_weight, use_bias, param_dtype):
    ours, theirs = _pair(shape, use_weight=use_weight, use_bias=use_bias, dtype=param_dtype)
    x = (2 * jax.random.normal(jax.random.key(0), (4,) + shape) + 0.5).astype(x_dtype)
    _close(jax.vmap(ours)(x), jax.vmap(theirs)(x))
    cotangent = jax.random.normal(jax.random.key(1), x.shape)

    def grads(module):
        def loss(module, x):
            return jnp.sum(jax.vmap(module)(x).astype(jnp.float32) * cotangent)

        return eqx.filter_grad(loss)(module, x), jax.grad(lambda x: loss(module, x))(x)

    (dm_got, dx_got), (dm_want, dx_want) = grads(ours), grads(theirs)
    _close(dx_got, dx_want)
    for got, want in zip(jax.tree.leaves(dm_got), jax.tree.leaves(dm_want)):
        # Parameter gradients sum over the 4 examples: their rounding grows with them.
        assert got.dtype == want.dtype and got.shape == want.shape
        tol = 8 * TOL[jnp.dtype(got.dtype)] * (1 + float(jnp.abs(want.astype(jnp.float32)).max()))
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


def test_the_module_is_equinox_s_with_its_fields():
    ours = RMSNorm((3, 4), eps=1e-3, use_bias=False)
    assert isinstance(ours, eqx.nn.RMSNorm)
    assert ours.shape == (3, 4) and ours.eps == 1e-3 and ours.bias is None and ours.weight.shape == (3, 4)
    theirs = eqx.nn.RMSNorm((3, 4), eps=1e-3, use_bias=False)
    assert [l.shape for l in jax.tree.leaves(ours)] == [l.shape for l in jax.tree.leaves(theirs)]


def test_state_is_passed_through_and_key_ignored():
    ours, theirs = _pair(16)
    x = jax.random.normal(jax.random.key(0), (16,))
    state = {"anything": jnp.arange(3)}
    y, out_state = ours(x, state, key=jax.random.key(1))
    assert out_state is state
    _close(y, theirs(x))


def test_the_shape_invariant_raises_as_equinox_does():
    ours = RMSNorm(16)
    with pytest.raises(ValueError, match=r"x must have the module's shape .*got shape=\(16,\) and x.shape=\(2, 16\); for a batch, use jax.vmap"):
        ours(jnp.ones((2, 16)))


def test_under_filter_jit_a_batch_is_one_call_of_the_op():
    ours, theirs = _pair((8, 64))
    x = jax.random.normal(jax.random.key(0), (5, 8, 64))
    f = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    _close(f(ours, x), f(theirs, x))
    hlo = jax.jit(lambda x: jax.vmap(ours)(x)).lower(x).as_text()
    assert hlo.count("rmsnorm_fwd") >= 1 and "while" not in hlo

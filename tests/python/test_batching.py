"""vmap folds mapped axes into rows: one FFI call per op whatever the nesting, an unmapped weight
stays one weight row (not broadcast per example), a mapped weight becomes a batched weight (still
one call), and vmap(grad) gives per-example weight gradients (not their sum)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rmsnorm_ffi
from rmsnorm_ffi import rms_norm, rms_norm_reference


def _eqns(fn, *args):
    return [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name.startswith("rmsnorm_")]


def _x(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) + 0.5, jnp.float32)


def test_vmap_over_4096_with_an_unmapped_weight_is_one_call_each_way(fresh_caches):
    x, w = _x((4096, 8, 64)), jnp.linspace(0.5, 1.5, 64)
    loss = lambda x, w: jnp.sum(jax.vmap(rms_norm, (0, None))(x, w) ** 2)
    eqns = _eqns(jax.grad(loss, (0, 1)), x, w)
    assert [e.primitive.name for e in eqns] == ["rmsnorm_fwd", "rmsnorm_bwd"]
    for e in eqns:  # x folded to (4096, 8, 64); the weight still (64,)
        assert [v.aval.shape for v in e.invars][:2] == [(4096, 8, 64), (64,)]
    step = jax.jit(jax.grad(loss, (0, 1)))
    jax.block_until_ready(step(x, w))
    before = rmsnorm_ffi.stats()["executions"]
    gx, gw = jax.block_until_ready(step(x, w))
    after = rmsnorm_ffi.stats()["executions"]
    assert after["rmsnorm_fwd"] - before["rmsnorm_fwd"] == 1
    assert after["rmsnorm_bwd"] - before["rmsnorm_bwd"] == 1
    rx, rw = jax.grad(lambda x, w: jnp.sum(rms_norm_reference(x, w) ** 2), (0, 1))(x, w)
    np.testing.assert_allclose(gx, rx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gw, rw, rtol=1e-4)


@pytest.mark.parametrize("in_axes", [(0, None), (1, None), (0, 0), (1, 0)])
def test_nested_vmap_is_one_call(in_axes):
    # Outer vmap over axis 2 of x; inner over `in_axes`.
    x = _x((3, 4, 5, 32))
    w = jnp.linspace(0.5, 1.5, 32)
    inner_w = w if in_axes[1] is None else jnp.stack([w * (1 + i) for i in range(x.shape[in_axes[0]])])
    inner = jax.vmap(rms_norm, in_axes)
    outer = jax.vmap(lambda x: inner(x, inner_w), 2, 2)
    ref = jax.vmap(jax.vmap(rms_norm_reference, in_axes), (2, None), 2)
    names = [e.primitive.name for e in _eqns(outer, x)]
    assert names == ["rmsnorm_fwd"]
    np.testing.assert_allclose(outer(x), ref(x, inner_w), rtol=1e-6, atol=1e-6)
    loss = lambda f: (lambda x: jnp.sum(f(x) ** 3))
    names = [e.primitive.name for e in _eqns(jax.grad(loss(outer)), x)]
    assert names == ["rmsnorm_fwd", "rmsnorm_bwd"]
    # Both sides are float32 evaluations (of different formulas): agreement to ~1e-4 relative.
    np.testing.assert_allclose(jax.grad(loss(outer))(x), jax.grad(loss(lambda x: ref(x, inner_w)))(x), rtol=1e-3, atol=1e-4)


def test_mapped_weight_is_a_batched_weight_in_one_call():
    x, ws = _x((6, 4, 32)), jnp.stack([jnp.linspace(0.5, 1.5, 32) * (1 + i) for i in range(6)])
    eqns = _eqns(jax.vmap(rms_norm), x, ws)
    assert len(eqns) == 1 and [v.aval.shape for v in eqns[0].invars] == [(6, 4, 32), (6, 32)]
    np.testing.assert_allclose(jax.vmap(rms_norm)(x, ws), jax.vmap(rms_norm_reference)(x, ws), rtol=1e-6, atol=1e-6)


def test_vmap_of_grad_gives_per_example_weight_gradients():
    x, w = _x((5, 4, 32)), jnp.linspace(0.5, 1.5, 32)
    loss = lambda norm: (lambda x, w: jnp.sum(norm(x, w) ** 2 * jnp.arange(32.0)))
    per_example = jax.vmap(jax.grad(loss(rms_norm), 1), (0, None))(x, w)
    want = jax.vmap(jax.grad(loss(rms_norm_reference), 1), (0, None))(x, w)
    assert per_example.shape == (5, 32)
    np.testing.assert_allclose(per_example, want, rtol=1e-4, atol=1e-4)
    # Not their sum: the examples' gradients differ.
    assert float(jnp.abs(per_example[0] - per_example[1]).max()) > 1e-3
    eqns = _eqns(jax.vmap(jax.grad(loss(rms_norm), 1), (0, None)), x, w)
    assert [e.primitive.name for e in eqns] == ["rmsnorm_fwd", "rmsnorm_bwd"]

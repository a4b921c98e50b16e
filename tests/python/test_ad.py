"""Every kind of differentiation flax's jnp RMSNorm supports, against the jnp reference in
float64: jvp, linearize, jacfwd, jacrev, hessian, grad-of-grad, Hessian-vector products and
`check_grads(order=2)` in both modes, for x and the weight. First-order reverse mode stays on
the fused Rust backward: one `rmsnorm_bwd` per norm, counted in the jaxpr and in `stats()`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import rmsnorm_ffi
from rmsnorm_ffi import rms_norm, rms_norm_fwd, rms_norm_reference


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _inputs(shape=(4, 16), weight=True, seed=0):
    # Well-conditioned rows (mean square ~1.25): the jnp reference itself fails check_grads on
    # a near-zero row.
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape) + 0.5, jnp.float64)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(shape[-1]), jnp.float64) if weight else None
    return x, w


def _loss(norm):
    c = jnp.linspace(-1.0, 2.0, 16)
    return lambda x, w: jnp.sum(jnp.sin(norm(x, w)) * c)


OURS, REF = _loss(rms_norm), _loss(rms_norm_reference)


def _close(a, b, tol=1e-10):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert u.shape == v.shape and u.dtype == v.dtype
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=tol, atol=tol)


@pytest.mark.parametrize("weight", [True, False], ids=["weight", "plain"])
def test_check_grads_order_2_both_modes(weight):
    x, w = _inputs(weight=weight)
    if weight:
        check_grads(OURS, (x, w), order=2, modes=("fwd", "rev"))
    else:
        check_grads(lambda x: OURS(x, None), (x,), order=2, modes=("fwd", "rev"))


def test_jvp_and_linearize():
    x, w = _inputs()
    tangents = _inputs(seed=1)
    _close(jax.jvp(OURS, (x, w), tangents), jax.jvp(REF, (x, w), tangents))
    y, lin = jax.linearize(OURS, x, w)
    y2, lin2 = jax.linearize(REF, x, w)
    _close((y, lin(*tangents)), (y2, lin2(*tangents)))
    # The tangent of rstd too (rms_norm_fwd's second result).
    f = lambda x: rms_norm_fwd(x, w)[1]
    g = lambda x: jax.lax.rsqrt(jnp.mean(x * x, -1) + 1e-5)
    _close(jax.jvp(f, (x,), (tangents[0],)), jax.jvp(g, (x,), (tangents[0],)))
    _close(jax.grad(lambda x: jnp.sum(f(x) ** 2))(x), jax.grad(lambda x: jnp.sum(g(x) ** 2))(x))


@pytest.mark.parametrize("argnum", [0, 1], ids=["x", "weight"])
def test_jacobians_and_hessians(argnum):
    x, w = _inputs(shape=(3, 16))
    norm = lambda x, w: rms_norm(x, w)
    ref = lambda x, w: rms_norm_reference(x, w)
    _close(jax.jacfwd(norm, argnum)(x, w), jax.jacfwd(ref, argnum)(x, w))
    _close(jax.jacrev(norm, argnum)(x, w), jax.jacrev(ref, argnum)(x, w))
    _close(jax.hessian(OURS, argnum)(x, w), jax.hessian(REF, argnum)(x, w), tol=1e-9)


def test_grad_of_grad_and_hvp():
    x, w = _inputs()
    gg = lambda loss: jax.grad(lambda x, w: jnp.sum(jax.grad(loss, (0, 1))(x, w)[0] ** 2), (0, 1))
    _close(gg(OURS)(x, w), gg(REF)(x, w), tol=1e-9)
    v = _inputs(seed=2)

    def hvp(loss):
        return jax.jvp(jax.grad(loss, (0, 1)), (x, w), v)[1]

    _close(hvp(OURS), hvp(REF), tol=1e-9)
    # Reverse-over-reverse HVP.
    rr = lambda loss: jax.grad(lambda x, w: jnp.vdot(jnp.concatenate([g.ravel() for g in jax.grad(loss, (0, 1))(x, w)]),
                                                       jnp.concatenate([t.ravel() for t in v])), (0, 1))(x, w)
    _close(rr(OURS), rr(REF), tol=1e-9)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_first_order_reverse_mode_is_the_fused_rust_backward(dtype, fresh_caches):
    x, w = _inputs(shape=(8, 128))
    x, w = x.astype(dtype), w.astype(dtype)
    loss = lambda x, w: jnp.sum(rms_norm(x, w).astype(jnp.float32) ** 2)
    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, w).jaxpr
    names = [e.primitive.name for e in jaxpr.eqns]
    assert names.count("rmsnorm_fwd") == 1 and names.count("rmsnorm_bwd") == 1, names
    assert "rmsnorm_tangent" not in names, names
    step = jax.jit(jax.grad(loss, (0, 1)))
    jax.block_until_ready(step(x, w))
    before = rmsnorm_ffi.stats()["executions"]
    for _ in range(3):
        jax.block_until_ready(step(x, w))
    after = rmsnorm_ffi.stats()["executions"]
    assert after["rmsnorm_fwd"] - before["rmsnorm_fwd"] == 3
    assert after["rmsnorm_bwd"] - before["rmsnorm_bwd"] == 3


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64])
@pytest.mark.parametrize("weight", ["same", "float32", None])  # x's dtype, float32, none
def test_a_gradient_that_does_not_read_y_runs_the_backward_alone(dtype, weight, fresh_caches):
    # jax.vjp's pullback alone (and any loss linear in y) never reads y, and the CPU backward
    # the VJP lowers to takes rstd from x itself, bit for bit the forward's: XLA drops the
    # forward. Its results are those of rms_norm_bwd given the forward's rstd.
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((37, 160)) + 0.5, dtype)
    dy = jnp.asarray(rng.standard_normal((37, 160)), dtype)
    w = None if weight is None else jnp.asarray(1 + 0.1 * rng.standard_normal(160), dtype if weight == "same" else jnp.float32)
    args = (x,) if w is None else (x, w)
    pullback = jax.jit(lambda dy, *a: jax.vjp(lambda *a: rms_norm(*a, eps=1e-3), *a)[1](dy))
    hlo = pullback.lower(dy, *args).compile().as_text()
    assert "rmsnorm_bwd" in hlo and "rmsnorm_fwd" not in hlo
    got = jax.block_until_ready(pullback(dy, *args))
    before = rmsnorm_ffi.stats()["executions"]
    jax.block_until_ready(pullback(dy, *args))
    after = rmsnorm_ffi.stats()["executions"]
    assert after.get("rmsnorm_fwd", 0) == before.get("rmsnorm_fwd", 0)
    assert after["rmsnorm_bwd"] - before["rmsnorm_bwd"] == 1
    _, rstd = rms_norm_fwd(x, w, eps=1e-3)
    want = rmsnorm_ffi.rms_norm_bwd(x, w, rstd, dy)
    for g, v in zip(got, want):
        assert g.dtype == v.dtype and np.array_equal(np.asarray(g), np.asarray(v))
    # vmap'd (a batched weight: the grouped backward), the same bits as the calls one by one.
    xs, dys = x.reshape(1, 37, 160), dy.reshape(1, 37, 160)
    batched = jax.jit(jax.vmap(lambda dy, *a: jax.vjp(lambda *a: rms_norm(*a, eps=1e-3), *a)[1](dy),
                               in_axes=(0, 0) + ((None,) if w is not None else ())))
    assert "rmsnorm_fwd" not in batched.lower(dys, xs, *args[1:]).compile().as_text()
    for g, v in zip(batched(dys, xs, *args[1:]), want):
        assert np.array_equal(np.asarray(g[0]), np.asarray(v))


def test_second_order_derivatives_of_half_precision_match_in_float32():
    # Higher orders are jnp math on the Rust results; half precision takes the same path.
    x, w = _inputs(shape=(4, 64))
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.float32)
    loss = lambda norm: lambda x: jnp.sum(norm(x, wb).astype(jnp.float32) ** 3)
    h = jax.jvp(jax.grad(loss(rms_norm)), (xb,), (jnp.ones_like(xb),))[1]
    h2 = jax.jvp(jax.grad(loss(rms_norm_reference)), (xb,), (jnp.ones_like(xb),))[1]
    assert h.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(h2, np.float32), rtol=0.05, atol=0.05)

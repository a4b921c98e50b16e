"""LayerNorm (`rmsnorm_ffi.layer_norm` and its forms): accuracy against float64 (rows whose mean
is 1e4 and 1e6 times their spread included, and a planted ``E[x^2] - E[x]^2`` that the same
checks catch), gradients against jnp in both modes and to second order, the transformations,
meshes with the rows sharded, jax.export, bad input, and the matrix of peers' test suites
(TransformerEngine's zero-centred gamma, Liger's and Quack's shapes and dtypes)."""

import json
import math
import re
import textwrap
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_python
from test_sharding import PRELUDE

import rmsnorm_ffi
from rmsnorm_ffi import layer_norm, layer_norm_bwd, layer_norm_fwd, layer_norm_reference, layer_norm_residual


def _truth(x, w=None, b=None, eps=1e-5, offset=0.0):
    """float64 NumPy: y, mean, rstd of the rows of x as stored."""
    x = np.asarray(x, np.float64)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    r = 1 / np.sqrt(var + np.float64(np.float32(eps)))
    y = (x - mean) * r
    if w is not None:
        y = y * (offset + np.asarray(w, np.float64))
    if b is not None:
        y = y + np.asarray(b, np.float64)
    return y, mean[..., 0], r[..., 0]


def _ulps(got, want, dtype):
    """The largest error of `got` in units of `dtype`'s eps at each row's largest |want| (the
    result's scale: a normalized row is O(1), so this is the error relative to it)."""
    got = np.asarray(got, np.float64)
    scale = np.max(np.abs(want), axis=-1, keepdims=True)
    return float(np.max(np.abs(got - want) / (scale * float(jnp.finfo(dtype).eps))))


def _rows(shape, centre, spread, seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (centre + spread * rng.standard_normal(shape)).astype(dtype)


def _naive(x, eps=1e-5):
    """The planted fault: the variance as ``E[x^2] - E[x]^2`` in float32."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, -1, keepdims=True)
    var = jnp.maximum(jnp.mean(xf * xf, -1, keepdims=True) - mean * mean, 0.0)
    return ((xf - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)


# float32 errors measured (in eps of the result's scale): at most 3.1 over these rows, large
# means included; jnp (Flax's math) reaches 9.8e4 at a mean of 1e6.
BOUND = 6.0


@pytest.mark.parametrize("n", [1, 2, 63, 1024, 4097, 1 << 16, 1 << 20])
@pytest.mark.parametrize("centre", [0.0, 1.0, 1e4, 1e6])
def test_float32_is_within_a_few_ulps_of_float64(n, centre):
    rows = max(1, min(8, (1 << 20) // n))
    x = _rows((rows, n), centre, 1.0, n)
    w = _rows((n,), 1.0, 0.5, 1)
    b = _rows((n,), 0.0, 0.5, 2)
    y, mean, rstd = layer_norm_fwd(x, w, b)
    want, want_mean, want_rstd = _truth(x, w, b)
    if n == 1:
        np.testing.assert_array_equal(np.asarray(y), np.broadcast_to(b, y.shape))
        return
    assert _ulps(y, want, jnp.float32) <= BOUND
    assert np.max(np.abs(np.asarray(rstd, np.float64) / want_rstd - 1)) <= 4 * np.finfo(np.float32).eps
    assert np.max(np.abs(np.asarray(mean, np.float64) - want_mean)) <= (abs(centre) + 1) * np.finfo(np.float32).eps


def test_a_planted_naive_variance_fails_the_same_check():
    x = _rows((8, 4096), 1e4, 1.0, 3)
    want = _truth(x)[0]
    assert _ulps(layer_norm(x), want, jnp.float32) <= BOUND
    assert _ulps(_naive(jnp.asarray(x)), want, jnp.float32) > 100 * BOUND
    # jnp's two-pass math (Flax's use_fast_variance=False) loses the mean's rounding instead.
    assert _ulps(layer_norm_reference(_rows((8, 4096), 1e6, 1.0, 3)), _truth(_rows((8, 4096), 1e6, 1.0, 3))[0], jnp.float32) > 100 * BOUND


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("centre", [0.0, 100.0])
def test_half_precision_is_within_one_ulp_of_the_correctly_rounded_result(dtype, centre):
    x = jnp.asarray(_rows((16, 1000), centre, 1.0, 4)).astype(dtype)
    w = jnp.asarray(_rows((1000,), 1.0, 0.5, 5)).astype(dtype)
    b = jnp.asarray(_rows((1000,), 0.0, 0.5, 6)).astype(dtype)
    want = _truth(np.asarray(x, np.float64), np.asarray(w, np.float64), np.asarray(b, np.float64))[0]
    rounded = np.asarray(jnp.asarray(want, jnp.float32).astype(dtype), np.float64)
    got = np.asarray(layer_norm(x, w, b), np.float64)
    # One ulp of each element's own magnitude (its binade).
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(rounded), float(jnp.finfo(dtype).tiny))))) * float(jnp.finfo(dtype).eps)
    assert np.all(np.abs(got - rounded) <= ulp)


def test_float64_input_accumulates_in_float64():
    jax.config.update("jax_enable_x64", True)
    try:
        x = _rows((4, 3000), 1e6, 1.0, 7, np.float64)
        y, mean, rstd = layer_norm_fwd(x)
        assert y.dtype == jnp.float64 and mean.dtype == jnp.float64 and rstd.dtype == jnp.float64
        # The truth in exact rationals: no float64 holds the mean of these rows to better than
        # half a unit of 1e6 (1e-10 of the spread), and the op keeps the part it cannot hold.
        want = []
        for row in x:
            mean_q = sum(map(Fraction, row)) / len(row)
            centred = [float(Fraction(v) - mean_q) for v in row]
            var = math.fsum(c * c for c in centred) / len(row)
            want.append(np.asarray(centred) / math.sqrt(var + float(np.float32(1e-5))))
        assert _ulps(y, np.asarray(want), jnp.float64) <= 8
    finally:
        jax.config.update("jax_enable_x64", False)


# ---------------------------------------------------------------------------------------------
# Gradients and transformations


def _params(n, dtype=jnp.float32, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    x = (jax.random.normal(k[0], (6, n)) * 2 + 3).astype(dtype)
    w = (jax.random.normal(k[1], (n,)) * 0.5 + 1).astype(dtype)
    b = (jax.random.normal(k[2], (n,)) * 0.5).astype(dtype)
    return x, w, b


def _targets(fn, *args):
    """The custom calls of the compiled program, by target."""
    return re.findall(r'custom_call_target="(rmsnorm_\w+)"', fn.lower(*args).compile().as_text())


def _close(a, b, tol):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        assert np.max(np.abs(u - v)) <= tol * (1 + np.max(np.abs(v))), (np.max(np.abs(u - v)), tol)


# (parameters, scale offset): an offset applies to a weight only.
@pytest.mark.parametrize("form,offset", [("wb", 0.0), ("w", 0.0), ("b", 0.0), ("", 0.0), ("wb", 1.0), ("w", 1.0)])
def test_gradients_match_jnp(form, offset):
    x, w, b = _params(96)
    w = w if "w" in form else None
    b = b if "b" in form else None
    loss = lambda f: lambda x, w, b: jnp.sum(jnp.sin(f(x, w, b, scale_offset=offset)) * jnp.arange(96.0))  # noqa: E731
    args = (x, w, b)
    argnums = tuple(i for i, a in enumerate(args) if a is not None)
    ours = jax.jit(jax.grad(loss(layer_norm), argnums))(*args)
    theirs = jax.grad(loss(layer_norm_reference), argnums)(*args)
    _close(ours, theirs, 2e-5)
    # First-order reverse mode is one fused Rust backward (and no other custom call).
    assert sorted(_targets(jax.jit(jax.grad(loss(layer_norm), argnums)), *args)) == ["rmsnorm_bwd", "rmsnorm_fwd"]
    # A loss linear in y does not read y: the backward alone (it takes the statistics from x).
    linear = jax.jit(jax.grad(lambda *a: jnp.sum(layer_norm(*a, scale_offset=offset) * jnp.arange(96.0)), argnums))
    assert _targets(linear, *args) == ["rmsnorm_bwd"]


def test_layer_norm_bwd_is_the_vjp():
    x, w, b = _params(128)
    y, mean, rstd = layer_norm_fwd(x, w, b)
    dy = jnp.cos(y)
    dx, dw, db = layer_norm_bwd(x, w, mean, rstd, dy, has_bias=True)
    _, vjp = jax.vjp(layer_norm_reference, x, w, b)
    _close((dx, dw, db), vjp(dy), 2e-5)
    dx2, dw2, db2 = layer_norm_bwd(x, None, mean, rstd, dy)
    assert dw2 is None and db2 is None
    _close(dx2, jax.vjp(lambda x: layer_norm_reference(x), x)[1](dy), 2e-5)


def test_forward_mode_second_order_and_vmap():
    x, w, b = _params(16)
    t = jnp.cos(x)
    _close(jax.jvp(lambda x, w, b: layer_norm(x, w, b), (x, w, b), (t, w * 0.1, b))[1],
           jax.jvp(lambda x, w, b: layer_norm_reference(x, w, b), (x, w, b), (t, w * 0.1, b))[1], 2e-5)
    f = lambda norm: lambda v: jnp.sum(jnp.sin(norm(v.reshape(2, 16), w, b)))  # noqa: E731
    _close(jax.hessian(f(layer_norm))(x[:2].reshape(-1)), jax.hessian(f(layer_norm_reference))(x[:2].reshape(-1)), 5e-5)
    # vmap, nested: one call of the op over every row.
    xs = x.reshape(2, 3, 16)
    nested = jax.jit(jax.vmap(jax.vmap(lambda v: layer_norm(v, w, b))))
    _close(nested(xs), layer_norm_reference(xs, w, b), 2e-6)
    assert _targets(nested, xs) == ["rmsnorm_fwd"]
    # Per-example parameter gradients: summed over each example's rows only.
    per = lambda norm: jax.vmap(jax.grad(lambda w, b, v: jnp.sum(norm(v, w, b) ** 2), (0, 1)), (None, None, 0))  # noqa: E731
    _close(per(layer_norm)(w, b, xs), per(layer_norm_reference)(w, b, xs), 2e-5)


def test_remat_and_scan():
    x, w, b = _params(64)

    def model(norm):
        def step(h, _):
            return norm(jnp.tanh(h), w, b) * 0.5 + h, None

        return lambda h: jnp.sum(jax.lax.scan(jax.checkpoint(step), h, None, length=3)[0] ** 2)

    _close(jax.jit(jax.grad(model(layer_norm)))(x), jax.grad(model(layer_norm_reference))(x), 5e-5)


def test_fused_residual_is_the_add_then_the_norm():
    x, w, b = _params(96, jnp.bfloat16)
    res = jnp.flip(x, -1)
    y, h = layer_norm_residual(x, res, w, b)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(x + res))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(layer_norm(x + res, w, b)))
    def loss(f):
        def run(x, r, w, b):
            y, h = f(x, r, w, b)
            return jnp.sum(jnp.sin(y.astype(jnp.float32)) + h.astype(jnp.float32) ** 2)

        return run

    ref = lambda x, r, w, b: (layer_norm_reference(x + r, w, b), x + r)  # noqa: E731
    g = jax.jit(jax.grad(loss(layer_norm_residual), (0, 1, 2, 3)))(x, res, w, b)
    gr = jax.grad(loss(ref), (0, 1, 2, 3))(x, res, w, b)
    _close(g, gr, 3e-2)  # bfloat16 results
    fused = _targets(jax.jit(jax.grad(loss(layer_norm_residual), (0, 1, 2, 3))), x, res, w, b)
    assert sorted(fused) == ["rmsnorm_bwd", "rmsnorm_residual_fwd"]


# TransformerEngine's LayerNorm rows (hidden sizes, zero-centred gamma), Liger's and Quack's
# shapes and dtypes: every (x, weight) pair the contract lists.
PEER_SHAPES = [(2, 128), (16, 768), (4, 1024 + 1), (2, 4096), (1, 8192), (3, 5120), (1, 14336)]


@pytest.mark.parametrize("shape", PEER_SHAPES)
@pytest.mark.parametrize("dtype,wdtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float32), (jnp.float16, jnp.float16), (jnp.float16, jnp.float32)])
@pytest.mark.parametrize("zero_centred", [False, True])
def test_peer_matrix(shape, dtype, wdtype, zero_centred):
    rng = np.random.default_rng(sum(shape))
    x = jnp.asarray(rng.standard_normal(shape) * 3 + 0.5).astype(dtype)
    w = jnp.asarray(rng.standard_normal(shape[-1]) * (0.1 if zero_centred else 1)).astype(wdtype)
    b = jnp.asarray(rng.standard_normal(shape[-1]) * 0.1).astype(wdtype)
    offset = 1.0 if zero_centred else 0.0
    dy = jnp.asarray(rng.standard_normal(shape)).astype(dtype)
    y, mean, rstd = layer_norm_fwd(x, w, b, scale_offset=offset)
    ref, vjp = jax.vjp(lambda x, w, b: layer_norm_reference(x, w, b, scale_offset=offset), x, w, b)
    tol = 2e-5 if dtype == jnp.float32 else 1e-2
    _close(y, ref, tol)
    _close(layer_norm_bwd(x, w, mean, rstd, dy, has_bias=True, scale_offset=offset), vjp(dy), tol * 4)


# ---------------------------------------------------------------------------------------------
# Bad input, export, modules


def test_bad_input_is_named():
    x, w, b = _params(8)
    with pytest.raises(ValueError, match=r"layer_norm: bias must have shape \(8,\)"):
        layer_norm(x, w, b[:4])
    with pytest.raises(TypeError, match="layer_norm: bias must have the weight's dtype float32, got bfloat16"):
        layer_norm(x, w, b.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="layer_norm: bias must be a float32, float64, bfloat16 or float16 array, got dtype int32"):
        layer_norm(x, None, b.astype(jnp.int32))
    with pytest.raises(ValueError, match="layer_norm: eps must be finite"):
        layer_norm(x, w, b, eps=-1.0)
    with pytest.raises(ValueError, match="layer_norm_fwd: axis must name trailing axes"):
        layer_norm_fwd(x.reshape(2, 3, 8), w, b, axis=(0, 2))
    y, mean, rstd = layer_norm_fwd(x, w, b)
    with pytest.raises(ValueError, match=r"layer_norm_bwd: mean must have shape \(6,\) and dtype float32"):
        layer_norm_bwd(x, w, mean[:3], rstd, y)
    with pytest.raises(ValueError, match="scale_offset=1.0 applies to a weight"):
        layer_norm(x, None, b, scale_offset=1.0)


def test_export_round_trip():
    x, w, b = _params(32)
    exported = rmsnorm_ffi.export(jax.jit(jax.grad(lambda x, w, b: jnp.sum(layer_norm(x, w, b) ** 2), (0, 1, 2))))(x, w, b)
    restored = rmsnorm_ffi.deserialize(exported.serialize())
    _close(restored.call(x, w, b), jax.grad(lambda x, w, b: jnp.sum(layer_norm_reference(x, w, b) ** 2), (0, 1, 2))(x, w, b), 2e-5)


def test_flax_nnx_and_equinox_modules_match_the_originals():
    flax_nn = pytest.importorskip("flax.linen")
    from flax import nnx

    eqx = pytest.importorskip("equinox")
    from rmsnorm_ffi import equinox as req
    from rmsnorm_ffi import nnx as rnnx

    x = jax.random.normal(jax.random.key(0), (4, 8, 96)) * 3 + 1
    for kw in [{}, dict(use_bias=False), dict(use_scale=False), dict(dtype=jnp.bfloat16),
               dict(param_dtype=jnp.bfloat16), dict(reduction_axes=(-2, -1), feature_axes=-1),
               dict(use_fast_variance=False), dict(epsilon=1e-3)]:
        theirs, ours = flax_nn.LayerNorm(**kw), rmsnorm_ffi.LayerNorm(**kw)
        p = theirs.init(jax.random.key(1), x)
        p = jax.tree.map(lambda a: a + 0.1 * jax.random.normal(jax.random.key(2), a.shape, a.dtype), p)
        assert jax.tree.structure(p) == jax.tree.structure(ours.init(jax.random.key(1), x))
        a, o = theirs.apply(p, x), ours.apply(p, x)
        assert a.dtype == o.dtype, kw
        _close(o, a, 1e-2 if a.dtype == jnp.bfloat16 else 2e-6)
        grad = lambda m: jax.grad(lambda p: jnp.sum(jnp.sin(m.apply(p, x).astype(jnp.float32))))(p)  # noqa: E731
        _close(grad(ours), grad(theirs), 5e-5)
    a, o = nnx.LayerNorm(96, rngs=nnx.Rngs(0)), rnnx.LayerNorm(96, rngs=nnx.Rngs(0))
    _close(o(x), a(x), 2e-6)
    for dtype in (jnp.float32, jnp.bfloat16):
        e1, e2 = eqx.nn.LayerNorm(96), req.LayerNorm(96)
        xd = x.astype(dtype)
        run = lambda m: jax.vmap(jax.vmap(m))(xd)  # noqa: E731
        assert run(e2).dtype == run(e1).dtype
        _close(run(e2), run(e1), 2e-6 if dtype == jnp.float32 else 1e-2)
        g = lambda m: jax.grad(lambda m: jnp.sum(jnp.sin(run(m).astype(jnp.float32))))(m)  # noqa: E731
        _close((g(e2).weight, g(e2).bias), (g(e1).weight, g(e1).bias), 5e-5 if dtype == jnp.float32 else 5e-2)


# ---------------------------------------------------------------------------------------------
# Meshes: rows sharded (explicit and automatic), the hidden axis sharded

# test_sharding's prelude: its imports and `collectives` (every collective of a compiled HLO).
MESHES = PRELUDE + textwrap.dedent(
    r"""
    from rmsnorm_ffi import layer_norm

    out = []
    for kind in (AxisType.Explicit, AxisType.Auto):
        tag = "explicit" if kind == AxisType.Explicit else "auto"
        m1 = jax.make_mesh((4,), ("data",), axis_types=(kind,))
        m2 = jax.make_mesh((2, 2), ("data", "model"), axis_types=(kind, kind))
        for name, mesh, xspec in ((f"{tag} rows", m1, P("data", None)), (f"{tag} 2x2 rows", m2, P(("data", "model"), None)),
                                  (f"{tag} hidden", m2, P("data", "model"))):
            with jax.set_mesh(mesh):
                rng = np.random.default_rng(0)
                xn = (rng.standard_normal((16, 128)) + 1e4).astype(np.float32)
                wn = np.linspace(0.5, 1.5, 128).astype(np.float32)
                bn = np.linspace(-1, 1, 128).astype(np.float32)
                x = jax.device_put(xn, NamedSharding(mesh, xspec))
                w = jax.device_put(wn, NamedSharding(mesh, P()))
                b = jax.device_put(bn, NamedSharding(mesh, P()))
                c = (np.arange(128) / 128 + 1).astype(np.float32)
                fwd = jax.jit(lambda x, w, b: layer_norm(x, w, b))
                loss = lambda y: jnp.sum(y * c + y ** 2)  # noqa: E731
                grad = jax.jit(jax.grad(lambda x, w, b: loss(layer_norm(x, w, b)), (0, 1, 2)))
                y = fwd(x, w, b)
                g = grad(x, w, b)
            # The gradients of the same op on one device (jnp's would be off by 1e-3 at rows of
            # mean 1e4: its mean is rounded to float32).
            g_ref = grad(jnp.asarray(xn), jnp.asarray(wn), jnp.asarray(bn))
            with jax.set_mesh(mesh):
                x64 = xn.astype(np.float64)
                t = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + np.float64(np.float32(1e-5))) * wn + bn
                out.append(dict(name=name, y_err=float(np.max(np.abs(np.asarray(y, np.float64) - t))),
                                g_err=max(float(np.max(np.abs(np.asarray(a) - np.asarray(r))) / (1 + np.max(np.abs(np.asarray(r))))) for a, r in zip(g, g_ref)),
                                y_spec=str(tuple(y.sharding.spec)), fwd=collectives(fwd, x, w, b), grad=collectives(grad, x, w, b)))

    # The CUDA path of split rows (`_hidden`'s jnp; on the CPU the split passes run instead),
    # called per shard here: x (16, 128) over P("data", "model"), against the kernels on whole
    # rows, rows of mean 1e4.
    from rmsnorm_ffi import _hidden, layer_norm_bwd, layer_norm_fwd
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    rng = np.random.default_rng(1)
    xn = (rng.standard_normal((16, 128)) + 1e4).astype(np.float32)
    dyn = rng.standard_normal((16, 128)).astype(np.float32)
    wn = np.linspace(0.5, 1.5, 128).astype(np.float32)
    bn = np.linspace(-1, 1, 128).astype(np.float32)
    y_ref, m_ref, r_ref = layer_norm_fwd(xn, wn, bn, scale_offset=0.5)
    g_ref = layer_norm_bwd(xn, wn, m_ref, r_ref, dyn, has_bias=True, scale_offset=0.5)
    X, R, W = P("data", "model"), P("data"), P("model")
    with jax.set_mesh(mesh):
        fwd = jax.jit(jax.shard_map(lambda x, w, b: _hidden.layer_forward(x, w, b, 1e-5, 0.5, ("model",), 128),
                                    in_specs=(X, W, W), out_specs=(X, R, R)))
        bwd = jax.jit(jax.shard_map(
            lambda x, w, b, m, r, dy: _hidden.layer_backward(x, w, b, m, r, dy, 0.5, ("model",), 128, {"w": ("data",), "b": ("data",)}),
            in_specs=(X, W, W, R, R, X), out_specs=(X, W, W)))
        put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
        y, m, r = fwd(put(xn, X), put(wn, W), put(bn, W))
        g = bwd(put(xn, X), put(wn, W), put(bn, W), put(np.asarray(m_ref), R), put(np.asarray(r_ref), R), put(dyn, X))
    rel = lambda a, b: float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))) / (1 + np.max(np.abs(np.asarray(b, np.float64)))))  # noqa: E731
    out.append(dict(name="hidden jnp", y_err=rel(y, y_ref), m_err=rel(m, m_ref), r_err=rel(r, r_ref),
                    g_err=max(rel(a, b) for a, b in zip(g, g_ref)), fwd=[], grad=[]))
    print("RESULTS" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def meshes():
    result = run_python(MESHES, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(l for l in result.stdout.splitlines() if l.startswith("RESULTS"))
    return {r["name"]: r for r in json.loads(line[len("RESULTS"):])}


@pytest.mark.parametrize("tag", ["explicit", "auto"])
@pytest.mark.parametrize("case", ["rows", "2x2 rows"])
def test_sharded_rows_run_per_shard(meshes, tag, case):
    r = meshes[f"{tag} {case}"]
    # Values: mean 1e4 rows, within float32 rounding of the result's scale.
    assert r["y_err"] < 1e-5 and r["g_err"] < 1e-4, r
    # No collective forward; backward: only the parameter gradients' sums (weight and bias, 128
    # elements each, maybe combined into one all-reduce), nothing gathered.
    assert r["fwd"] == [], r
    assert all(kind == "all-reduce" and size in (128, 256) for kind, size in r["grad"]), r
    assert 1 <= len(r["grad"]) <= 2, r


@pytest.mark.parametrize("tag", ["explicit", "auto"])
def test_sharded_hidden_axis_runs_the_split_passes(meshes, tag):
    # x (16, 128) over P("data", "model"): 8 rows of 64 per device, no whole row anywhere.
    r = meshes[f"{tag} hidden"]
    # Rows of mean 1e4: the split passes keep the shifted two-pass variance across devices.
    assert r["y_err"] < 1e-5 and r["g_err"] < 1e-4, r
    # Forward: sum(x) (8 floats), then sum(x - m) and sum((x - m)^2) (8 x 2): never x.
    assert sorted(r["fwd"]) == [["all-reduce", 8], ["all-reduce", 16]], r
    # The gradient: the forward's two, the backward's sums (8 x 3), dweight and dbias summed
    # over the rows' axis (64 each, or one all-reduce of both, listed by its first operand);
    # the replicated weight and bias were sliced, so their gradients' slices are gathered back
    # (128 each), and nothing else is.
    reduces = sorted(size for kind, size in r["grad"] if kind == "all-reduce")
    assert reduces in ([8, 16, 24, 64, 64], [8, 16, 24, 64]), r
    gathers = [size for kind, size in r["grad"] if kind == "all-gather"]
    assert gathers in ([128, 128], [256]), r
    assert {kind for kind, _ in r["grad"]} == {"all-reduce", "all-gather"}, r


def test_the_cuda_split_rows_jnp_matches_the_kernels(meshes):
    # `_hidden.layer_forward` / `layer_backward` (what CUDA runs for a sharded normalized axis)
    # per shard on a 2x2 mesh, against the kernels on whole rows: rows of mean 1e4, a scale
    # offset, weight and bias. Measured (relative to 1 + the largest value): y 1.3e-7, mean
    # 9.8e-8 (one float32 unit at 1e4: jnp sums in float32, the kernels in float64), rstd 5.7e-8,
    # gradients 8.8e-8; without the shift d the forward's y is off by 3.9e-4, without mean(g) dx
    # by 4.4e-2.
    r = meshes["hidden jnp"]
    assert r["y_err"] < 1e-6 and r["m_err"] < 4e-7 and r["r_err"] < 1e-6 and r["g_err"] < 1e-6, r

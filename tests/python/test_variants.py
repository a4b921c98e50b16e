"""The drop-in variants real models use, against a float64 reference written here in NumPy.

Grids written anew in the spirit of the public suites the variants come from: Quack's
shape/dtype grids (odd row lengths, weight in x's dtype, float32, bfloat16 or none), Liger's and
TransformerEngine's value + dx + dweight checks with a zero-centred gamma (``scale_offset``),
TE's fused residual with gradients through both outputs, Gemma's rows of length 1.

Errors are measured in units in the last place (ulp) of the result's dtype at the reference
value (`ulps`), or, for gradients whose terms cancel, against the row's largest reference value.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from rmsnorm_ffi import rms_norm, rms_norm_fwd, rms_norm_residual

FLOATS = ["float32", "bfloat16", "float16", "float64"]
MANTISSA = {"float64": 52, "float32": 23, "bfloat16": 7, "float16": 10}
# Quack-like rows: odd lengths, a Gemma row of one element, a vector multiple, and a long one.
SHAPES = [(1, 1), (5, 1), (7, 3), (37, 229), (16, 1024), (3, 4100)]
EPS = 1e-6


@pytest.fixture(autouse=True)
def x64():
    # float64 pairs need x64; restored afterwards so other tests see the default.
    with jax.enable_x64(True):
        yield


def as64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float64))


def ulps(got, want64: np.ndarray, dtype: str) -> np.ndarray:
    """|got - want| in ulps of `dtype` at |want| (subnormals' ulp below the smallest normal)."""
    info = ml_dtypes.finfo(dtype) if dtype == "bfloat16" else np.finfo(dtype)
    tiny = float(info.tiny)
    exponent = np.floor(np.log2(np.maximum(np.abs(want64), tiny)))
    return np.abs(as64(got) - want64) / np.exp2(exponent - MANTISSA[dtype])


def data(shape, x_dtype, w_dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape) * 2.0, x_dtype)
    w = None if w_dtype is None else jnp.asarray(rng.standard_normal(shape[-1:]) * 0.3, w_dtype)
    dy = jnp.asarray(rng.standard_normal(shape), x_dtype)
    return x, w, dy


def reference(x, w, dy, offset=0.0, dh=None):
    """y, dx, dweight in float64 from the given (rounded) inputs. dx's magnitude is measured by
    `dx_scale` (its terms' largest, `r * g` per row), since its terms cancel (a row of one
    element has dx near 0)."""
    x64, dy64 = as64(x), as64(dy)
    n = x64.shape[-1]
    r = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + np.float64(np.float32(EPS)))
    scale = 1.0 if w is None else offset + as64(w)
    y = x64 * r * scale
    g = dy64 * scale
    dx = r * (g - x64 * r * r * np.sum(g * x64, axis=-1, keepdims=True) / n)
    if dh is not None:
        dx = dx + as64(dh)
    dw = None if w is None else np.sum(dy64 * x64 * r, axis=tuple(range(x64.ndim - 1)))
    global dx_scale
    dx_scale = np.max(np.abs(r * g), axis=-1, keepdims=True)
    return y, dx, dw


def half_ulp_bound(dtype):
    # Results computed in float32 (float64 for float64 x) and rounded once: within half an ulp
    # of the exact value plus float32's own error, so within one ulp for half precision; a few
    # float32 ulps for float32 (rstd and the products each round once).
    return {"bfloat16": 1.0, "float16": 1.0, "float32": 4.0, "float64": 4.0}[dtype]


def close_by_row(got, want64, dtype, rel, scale=None):
    """Each element within `rel` of its row's largest reference magnitude, or of `scale` (the
    terms' magnitude, where they cancel)."""
    if scale is None:
        scale = np.max(np.abs(want64), axis=-1, keepdims=True)
    scale = scale + 1e-30
    err = np.max(np.abs(as64(got) - want64) / scale)
    assert err <= rel, f"{dtype}: {err:.3g} of the row's largest value > {rel:.3g}"
    return err


ROW_REL = {"float64": 1e-13, "float32": 2e-6, "bfloat16": 1.6e-2, "float16": 2e-3}


# -----------------------------------------------------------------------------------------------
# Every float x with every float weight


PAIRS = list(itertools.product(FLOATS, FLOATS + [None]))


@pytest.mark.parametrize("x_dtype,w_dtype", PAIRS, ids=[f"{x}-w{w}" for x, w in PAIRS])
def test_every_weight_dtype_with_every_x_matches_float64(x_dtype, w_dtype):
    worst = {}
    for shape in SHAPES:
        x, w, dy = data(shape, x_dtype, w_dtype)
        y, rstd = jax.jit(lambda x, w: rms_norm_fwd(x, w, EPS))(x, w)
        assert y.dtype == jnp.dtype(x_dtype)
        assert rstd.dtype == jnp.dtype("float64" if x_dtype == "float64" else "float32")
        (dx, dw) = jax.jit(jax.grad(lambda x, w: jnp.vdot(rms_norm(x, w, EPS), dy).real, (0, 1)))(x, w) if w is not None else (
            jax.jit(jax.grad(lambda x: jnp.vdot(rms_norm(x, None, EPS), dy).real))(x), None)
        ry, rdx, rdw = reference(x, w, dy)
        worst["y"] = max(worst.get("y", 0), float(np.max(ulps(y, ry, x_dtype))))
        assert worst["y"] <= half_ulp_bound(x_dtype), (shape, worst)
        worst["dx"] = max(worst.get("dx", 0), close_by_row(dx, rdx, x_dtype, ROW_REL[x_dtype], dx_scale))
        if w is not None:
            assert dw.dtype == jnp.dtype(w_dtype)
            # dweight sums a term per row in float64 (compensated for float64 x) and rounds
            # once to w's dtype; its terms carry x's rounding of nothing (exact inputs), so it
            # is within an ulp of w's dtype plus float32's error in each term.
            tol = max(ROW_REL[w_dtype], ROW_REL["float32"] if x_dtype != "float64" else 1e-13)
            worst["dw"] = max(worst.get("dw", 0), close_by_row(dw, rdw, w_dtype, tol))


# -----------------------------------------------------------------------------------------------
# Scale offset (zero-centred gamma)

OFFSET_CASES = [(x, w, off) for x in FLOATS for w in ["float32", "bfloat16"] for off in (1.0, -0.5)]


@pytest.mark.parametrize("x_dtype,w_dtype,offset", OFFSET_CASES, ids=[f"{x}-w{w}-{o}" for x, w, o in OFFSET_CASES])
def test_scale_offset_values_and_gradients_match_float64(x_dtype, w_dtype, offset):
    for shape in SHAPES:
        x, w, dy = data(shape, x_dtype, w_dtype, seed=1)
        f = lambda x, w: rms_norm(x, w, EPS, scale_offset=offset)
        y = jax.jit(f)(x, w)
        dx, dw = jax.jit(jax.grad(lambda x, w: jnp.vdot(f(x, w), dy).real, (0, 1)))(x, w)
        ry, rdx, rdw = reference(x, w, dy, offset)
        assert np.max(ulps(y, ry, x_dtype)) <= half_ulp_bound(x_dtype), shape
        close_by_row(dx, rdx, x_dtype, ROW_REL[x_dtype], dx_scale)
        # The gradient is with respect to w: the offset does not appear in it.
        tol = max(ROW_REL[w_dtype], ROW_REL["float32"] if x_dtype != "float64" else 1e-13)
        close_by_row(dw, rdw, w_dtype, tol)


def test_offset_inside_the_kernel_keeps_the_bits_that_adding_it_outside_loses():
    # Gemma keeps bfloat16 parameters near 0 and applies 1 + w: rounded to bfloat16 first,
    # 1 + w loses w's low bits (bfloat16 has 8 significant bits), which the offset inside the
    # kernel (added in float32) keeps.
    x, _, _ = data((64, 256), "float32", None, seed=2)
    w = jnp.asarray(np.random.default_rng(3).standard_normal(256) * 0.01, jnp.bfloat16)
    inside = rms_norm(x, w, EPS, scale_offset=1.0)
    outside = rms_norm(x, (1 + w).astype(jnp.bfloat16), EPS)
    want = reference(x, w, x, 1.0)[0]
    assert np.max(ulps(inside, want, "float32")) <= 4
    assert np.max(ulps(outside, want, "float32")) > 1000


def test_scale_offset_on_the_fused_residual_and_under_vmap():
    x, w, dy = data((6, 40), "bfloat16", "float32", seed=4)
    res = jnp.asarray(np.random.default_rng(5).standard_normal((6, 40)), jnp.bfloat16)
    y, h = rms_norm_residual(x, res, w, EPS, scale_offset=1.0)
    assert np.array_equal(as64(h), as64((x + res).astype(jnp.bfloat16)))
    assert np.max(ulps(y, reference(h, w, dy, 1.0)[0], "bfloat16")) <= 1
    # Per-example weights (a vmapped weight is a batched operand of one call).
    ws = jnp.stack([w, 2 * w, -w])
    xs = jnp.stack([x, x, x])
    ys = jax.vmap(lambda x, w: rms_norm(x, w, EPS, scale_offset=1.0))(xs, ws)
    for i in range(3):
        assert np.max(ulps(ys[i], reference(x, ws[i], dy, 1.0)[0], "bfloat16")) <= 1


# -----------------------------------------------------------------------------------------------
# The fused residual's backward rounds dx once

# TransformerEngine's fused add + RMS norm test shapes (rows x hidden), the largest left out
# for time (they add nothing to a per-element bound).
TE_SHAPES = [(71, 229), (29, 541), (768, 1024), (512, 3072)]


def residual_grads(x, res, w, ct_y, ct_h, offset):
    f = lambda x, res, w: rms_norm_residual(x, res, w, EPS, scale_offset=offset)
    (y, h), vjp = jax.vjp(f, x, res, w)
    return (y, h), vjp((ct_y, ct_h))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_fused_residual_backward_rounds_dx_once(dtype, offset):
    worst, two_roundings_worst = 0.0, 0.0
    for i, shape in enumerate(TE_SHAPES):
        rng = np.random.default_rng(10 + i)
        x = jnp.asarray(rng.standard_normal(shape), dtype)
        res = jnp.asarray(rng.standard_normal(shape), dtype)
        w = jnp.asarray(rng.standard_normal(shape[-1]) * 0.3, dtype)
        ct_y = jnp.asarray(rng.standard_normal(shape), dtype)
        ct_h = jnp.asarray(rng.standard_normal(shape), dtype)
        (y, h), (dx, dres, dw) = jax.jit(residual_grads, static_argnums=5)(x, res, w, ct_y, ct_h, offset)
        # Both inputs of the add get the same gradient.
        assert np.array_equal(as64(dx), as64(dres))
        _, norm_dx, rdw = reference(h, w, ct_y, offset)
        want = norm_dx + as64(ct_h)
        # One ulp of the correctly rounded result: half an ulp from the one rounding, and
        # float32's error in the norm's part far below half an ulp of a half-precision result
        # except where the two gradients cancel: there the bound is float32's error of the terms.
        # (The norm's gradient itself cancels: its float32 error is relative to its terms,
        # `dx_scale`; 2**-19 of them is 16 float32 ulps, far below a half-precision ulp.)
        terms = dx_scale + np.abs(as64(ct_h))
        f32_err = terms * 2.0**-19
        err = ulps(dx, want, dtype) - f32_err / (np.exp2(np.floor(np.log2(np.maximum(np.abs(want), 1e-30))) - MANTISSA[dtype]))
        worst = max(worst, float(np.max(err)))
        # What rounding twice gives (the norm's gradient rounded to x's dtype, then added and
        # rounded again): the check above tells the two apart.
        twice = (jnp.asarray(norm_dx, dtype).astype(jnp.float32) + ct_h.astype(jnp.float32)).astype(dtype)
        two_roundings_worst = max(two_roundings_worst, float(np.max(ulps(twice, want, dtype))))
        close_by_row(dw, rdw, dtype, ROW_REL[dtype])
    assert worst <= 1.0, worst
    if dtype != "float32":
        assert two_roundings_worst > 1.0, two_roundings_worst


def test_fused_residual_backward_is_one_backward_call():
    x, w, _ = data((8, 64), "bfloat16", "bfloat16")
    hlo = jax.jit(jax.grad(lambda x, r, w: jnp.sum(jnp.concatenate(rms_norm_residual(x, r, w)).astype(jnp.float32) ** 2), (0, 1, 2))).lower(x, x, w).as_text()
    assert hlo.count('custom_call_target="rmsnorm_bwd"') + hlo.count("@rmsnorm_bwd") >= 1
    assert hlo.count("has_dh = true") == 1, hlo.count("has_dh")

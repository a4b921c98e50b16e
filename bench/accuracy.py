"""Accuracy against a high-precision truth, for `make bench` (row lengths to 2^26, ours and the
jnp reference side by side) and `tests/python/test_accuracy.py` (the same measure, to 2^24, as
pass/fail bounds).

The error of a result is max |got - truth| / max |truth| in units of the input dtype's eps
(bfloat16 and float16: units in the last place of the correctly rounded truth, elementwise).
The truth is taken in long double (80-bit on x86): NumPy sums along axis 0 one row after
another, which in float64 would itself be off by more than the float64 results it judges. It
is computed in blocks of about 2^22 elements.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Elements per block of the truth's computation.
_BLOCK = 1 << 22

# `make bench`: float32 rows x row length to one row of 2^26 (the op's longest), and the weight
# gradient over 2^20 rows; float64 at a long row and over many rows.
SWEEP = [
    ("float32", 8, 4096), ("float32", 8, 1 << 16), ("float32", 8, 1 << 20), ("float32", 2, 1 << 22),
    ("float32", 1, 1 << 24), ("float32", 1, 1 << 26), ("float32", 1 << 20, 64),
    ("float64", 4, 1 << 20), ("float64", 1 << 16, 64),
]
QUICK_SWEEP = [("float32", 8, 4096), ("float32", 2, 1 << 16), ("float32", 1 << 12, 64)]


def inputs(rows, n, dtype, seed=0):
    """x ~ N(0.5, 1), weight 1 + 0.1 N(0, 1), dy ~ N(0, 1), in `dtype`."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, n)) + 0.5).astype(dtype)
    w = (1 + 0.1 * rng.standard_normal(n)).astype(dtype)
    dy = rng.standard_normal((rows, n)).astype(dtype)
    return x, w, dy


def truth(x, w, dy, eps):
    """y, dx and dweight of `x * rstd * w` in long double, rstd = 1 / sqrt(mean(x^2) + eps)."""
    rows, n = x.shape
    ld = np.longdouble
    w = np.asarray(w, ld)
    y, dx = np.empty((rows, n), ld), np.empty((rows, n), ld)
    dw = np.zeros(n, ld)
    step = max(1, _BLOCK // n)
    cols = [slice(c, c + _BLOCK) for c in range(0, n, _BLOCK)]
    for r0 in range(0, rows, step):
        part = slice(r0, r0 + step)
        # Two passes over the row's column blocks: its sums, then the results.
        sum_sq = sum_gx = 0
        for c in cols:
            xc, gc = np.asarray(x[part, c], ld), np.asarray(dy[part, c], ld) * w[c]
            sum_sq = sum_sq + np.sum(xc * xc, -1)
            sum_gx = sum_gx + np.sum(gc * xc, -1)
        r = (1 / np.sqrt(sum_sq / n + eps))[:, None]
        mean_gx = (sum_gx / n)[:, None]
        for c in cols:
            xc, dc = np.asarray(x[part, c], ld), np.asarray(dy[part, c], ld)
            y[part, c] = xc * r * w[c]
            dx[part, c] = r * (dc * w[c] - xc * r * r * mean_gx)
            dw[c] += np.sum(dc * xc * r, axis=0)
    return y, dx, dw


def vjp_step(norm, eps):
    """jit of (y, dx, dw) of `norm(x, w, eps)` with cotangent dy."""
    def step(x, w, dy):
        y, pullback = jax.vjp(lambda x, w: norm(x, w, eps), x, w)
        return (y, *pullback(dy))

    return jax.jit(step)


def errors(norm, rows, n, dtype, eps=1e-5):
    """[forward, dx, dweight] errors of `norm` in eps of `dtype` (float32 or float64; for
    float64 call it inside `jax.enable_x64(True)`)."""
    # eps travels as a float32 attribute (README, known limits): the truth, and the norm (jnp's
    # would otherwise add a different eps in float64), use that value.
    eps = float(np.float32(eps))
    x, w, dy = inputs(rows, n, dtype)
    got = [np.asarray(a) for a in vjp_step(norm, eps)(x, w, dy)]
    want = truth(x, w, dy, eps)
    unit = float(np.finfo(dtype).eps)
    return [_max_abs_diff(g, t) / _max_abs_diff(t, 0) / unit for g, t in zip(got, want)]


def _max_abs_diff(got, want) -> float:
    """max |got - want| in long double (`want` an array, or 0), in blocks: a long-double
    temporary of 2^26 elements is 1 GB."""
    want = np.broadcast_to(want, got.shape).reshape(-1)
    got = got.reshape(-1)
    return max(float(np.max(np.abs(np.asarray(got[i:i + _BLOCK], np.longdouble) - want[i:i + _BLOCK])))
               for i in range(0, got.size, _BLOCK))


def ulps(got, truth, dtype):
    """|got - rn(truth)| in units of the last place of rn(truth), elementwise (rn: the
    correctly rounded value in `dtype`)."""
    rounded = truth.astype(np.float32).astype(dtype).astype(np.float64)
    info = jnp.finfo(dtype)
    exponent = np.floor(np.log2(np.maximum(np.abs(rounded), float(info.tiny))))
    ulp = np.exp2(exponent) * float(info.eps)
    return np.abs(got - rounded) / ulp


def report(norms: dict, quick: bool) -> list[dict]:
    """Prints and returns the errors of each of `norms` (name: function) over the sweep."""
    print("\naccuracy against a long-double truth: max |got - truth| / max |truth| in eps of the dtype "
          "(x ~ N(0.5, 1), weight 1 + 0.1 N(0, 1))")
    print(f"{'dtype':>8} {'rows x n':>12} | " + " | ".join(f"{name + ': fwd':>10} {'dx':>6} {'dw':>6}" for name in norms))
    rows = []
    for dtype, r, n in QUICK_SWEEP if quick else SWEEP:
        with jax.enable_x64(dtype == "float64"):
            errs = {name: errors(norm, r, n, np.dtype(dtype)) for name, norm in norms.items()}
        rows.append({"dtype": dtype, "rows": r, "n": n, **errs})
        shape = f"{r}x{n}" if n < 1 << 16 else f"{r}x2^{n.bit_length() - 1}"
        print(f"{dtype:>8} {shape:>12} | " + " | ".join(f"{e[0]:10.2f} {e[1]:6.2f} {e[2]:6.2f}" for e in errs.values()),
              flush=True)
    return rows

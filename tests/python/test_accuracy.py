"""Accuracy against a long-double truth, independent of the row length: the error (max |ours -
truth| / max |truth|) in float32 eps for the forward, dx and dweight over a sweep of row lengths
to 2^24 and for dweight over 2^20 rows of 64; float64 in float64 eps; bfloat16 and float16
within one unit in the last place of the correctly rounded result. Sums along a row are taken in
two levels (see src/handlers/math.rs): a float32 sum along the row was off by thousands of eps
at 2^24 elements."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rmsnorm_ffi import rms_norm

# The measure and the truth are the benchmark's (bench/accuracy.py), which sweeps to 2^26.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from accuracy import errors, inputs, truth, ulps  # noqa: E402


def _errors(rows, n, dtype):
    return errors(rms_norm, rows, n, dtype)


# Rows x row length: 8 rows up to 2^20, then fewer (the largest is one row of 2^24, 64 MiB).
# (A row of one element is left out for dx: there dx = r * g * (1 - x^2 r^2) cancels to
# r * g * eps * r^2, which no float32 evaluation of the formula gets to 2 eps; see below.)
SWEEP = [(8, 2), (8, 7), (8, 255), (8, 4096), (8, 65536), (8, 1 << 20), (2, 1 << 22), (1, 1 << 24)]


@pytest.mark.parametrize("rows,n", SWEEP, ids=[f"{r}x{n}" for r, n in SWEEP])
def test_float32_within_two_eps_at_every_row_length(rows, n):
    fwd, dx, dw = _errors(rows, n, np.float32)
    assert fwd <= 2 and dx <= 2 and dw <= 2, (fwd, dx, dw)


def test_float32_rows_of_one_element():
    # The forward and the weight gradient; dx cancels there (see SWEEP).
    fwd, _, dw = _errors(8, 1, np.float32)
    assert fwd <= 2 and dw <= 2, (fwd, dw)


def test_float32_weight_gradient_over_many_rows():
    fwd, dx, dw = _errors(1 << 20, 64, np.float32)
    assert fwd <= 2 and dx <= 2 and dw <= 2, (fwd, dx, dw)


@pytest.mark.parametrize("rows,n", [(8, 4096), (4, 1 << 20), (1 << 16, 64)])
def test_float64_within_two_eps(rows, n):
    with jax.enable_x64(True):
        fwd, dx, dw = _errors(rows, n, np.float64)
    assert fwd <= 2 and dx <= 2 and dw <= 2, (fwd, dx, dw)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("n", [64, 4096, 1 << 16])
def test_half_precision_within_one_ulp_of_the_rounded_truth(dtype, n):
    x, w, dy = inputs(16, n, dtype)
    y = np.asarray(jax.jit(lambda x, w: rms_norm(x, w))(x, w), np.float64)
    ty = np.asarray(truth(x, w, dy, float(np.float32(1e-5)))[0], np.float64)
    assert float(np.max(ulps(y, ty, dtype))) <= 1

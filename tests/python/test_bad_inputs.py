"""The bad-input matrix: every case runs in its own interpreter, so that a crash or a hang is
seen as one (a signal, a non-zero exit, a timeout) rather than taking the test run with it.

Each case must end either in a Python exception whose type and message name the problem, or
in a correct result (the case's own code checks it against the jnp reference).
"""

import textwrap

import pytest

from conftest import run_python

PRELUDE = """
import threading, gc
import jax, jax.numpy as jnp, numpy as np
import rmsnorm_ffi
from rmsnorm_ffi import rms_norm, rms_norm_fwd, rms_norm_bwd, rms_norm_reference

def close(got, want, tol=1e-5):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)

def raw_forward(x, *args, **attrs):
    # The FFI target without the Python checks, to reach the Rust diagnostics.
    rmsnorm_ffi.register()
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32))
    return jax.jit(lambda *a: jax.ffi.ffi_call("rmsnorm_fwd", out)(*a, **attrs))(x, *args)

rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
w = jnp.linspace(0.5, 1.5, 64, dtype=jnp.float32)
y, rstd = rms_norm_fwd(x, w)
"""

RUNNER = """
try:
{body}
    print("RESULT ok")
except Exception as e:
    print(f"RESULT {{type(e).__name__}}: {{e}}".replace("\\n", " "))
"""

OK = ("ok", "")
XLA = "JaxRuntimeError"

# (id, code, (expected exception type or "ok", regex the message must match))
CASES = [
    # --- dtypes -----------------------------------------------------------------------------
    ("x_int32", "rms_norm(jnp.arange(12).reshape(3, 4))", ("TypeError", r"rms_norm: x must be a float32.*got dtype int32")),
    ("x_bool", "rms_norm(jnp.ones((3, 4), bool))", ("TypeError", r"x must be .*got dtype bool")),
    ("x_complex", "rms_norm(jnp.ones((3, 4), jnp.complex64))", ("TypeError", r"x must be .*got dtype complex64")),
    ("x_numpy_uint8", "rms_norm(np.ones((3, 4), np.uint8))", ("TypeError", r"x must be .*got dtype uint8")),
    ("x_string", "rms_norm('abc')", ("TypeError", r"rms_norm: x must be a float32.* array, got str")),
    ("x_object_list", "rms_norm([[1.0, 'a']])", ("TypeError", r"rms_norm: x must be a float32.* array, got list")),
    ("weight_int", "rms_norm(x, jnp.ones(64, jnp.int32))", ("TypeError", r"weight must be .*got dtype int32")),
    (
        "mixed_bf16_x_f16_weight_is_fine",
        "close(rms_norm(x.astype(jnp.bfloat16), w.astype(jnp.float16)), rms_norm_reference(x.astype(jnp.bfloat16), w.astype(jnp.float16)), 1e-2)",
        OK,
    ),
    (
        "x64_f32_x_f64_weight_is_fine",
        "jax.config.update('jax_enable_x64', True)\nclose(rms_norm(x, jnp.asarray(w, jnp.float64)), rms_norm_reference(x, w))",
        OK,
    ),
    ("scale_offset_without_weight", "rms_norm(x, scale_offset=1.0)", ("ValueError", r"scale_offset=1.0 applies to a weight")),
    ("scale_offset_array", "close(rms_norm(x, w, scale_offset=np.float32(1.0)), rms_norm_reference(x, w, scale_offset=1.0))", OK),
    ("scale_offset_inf", "rms_norm(x, w, scale_offset=float('inf'))", ("ValueError", r"scale_offset must be finite")),
    ("f16_x_f32_weight_is_fine", "close(rms_norm(x.astype(jnp.float16), w), rms_norm_reference(x.astype(jnp.float16), w), 2e-3)", OK),
    ("f64_x_without_x64_becomes_f32", "close(rms_norm(np.asarray(x, np.float64), w), rms_norm_reference(x, w))", OK),
    ("python_list_x", "close(rms_norm([[1.0, 2.0], [3.0, 4.0]]), rms_norm_reference(jnp.asarray([[1.0, 2.0], [3.0, 4.0]])))", OK),
    # --- shapes -----------------------------------------------------------------------------
    ("x_scalar", "rms_norm(jnp.float32(2.0))", ("ValueError", r"x must have at least one axis")),
    ("weight_too_long", "rms_norm(x, jnp.ones(65))", ("ValueError", r"weight must have shape \(64,\) to match x's last axis, got \(65,\)")),
    ("weight_too_short", "rms_norm(x, jnp.ones(63))", ("ValueError", r"weight must have shape \(64,\).*got \(63,\)")),
    ("weight_rank_2", "rms_norm(x, jnp.ones((1, 64)))", ("ValueError", r"weight must have shape \(64,\).*got \(1, 64\)")),
    ("weight_scalar", "rms_norm(x, jnp.float32(1.0))", ("ValueError", r"weight must have shape \(64,\).*got \(\)")),
    ("bwd_dy_shape", "rms_norm_bwd(x, w, rstd, jnp.ones((8, 63)))", ("ValueError", r"rms_norm_bwd: dy must have x's shape \(8, 64\)")),
    ("bwd_dy_dtype", "rms_norm_bwd(x, w, rstd, jnp.ones((8, 64), jnp.bfloat16))", ("ValueError", r"dy must have x's shape \(8, 64\) and dtype float32, got \(8, 64\) bfloat16")),
    ("bwd_rstd_shape", "rms_norm_bwd(x, w, rstd[:4], x)", ("ValueError", r"rstd must have shape \(8,\) and dtype float32, got \(4,\)")),
    ("bwd_rstd_dtype", "rms_norm_bwd(x, w, rstd.astype(jnp.bfloat16), x)", ("ValueError", r"rstd must have shape \(8,\) and dtype float32, got \(8,\) bfloat16")),
    ("bwd_weight_shape", "rms_norm_bwd(x, jnp.ones(3), rstd, x)", ("ValueError", r"rms_norm_bwd: weight must have shape \(64,\)")),
    (
        "vmap_weight_wrong_shape",
        "jax.vmap(rms_norm)(jnp.ones((2, 4, 8)), jnp.ones((2, 7)))",
        ("ValueError", r"weight must have shape \(8,\).*got \(7,\)"),
    ),
    (
        "vmap_over_an_empty_batch_with_mapped_weight",
        "xs, ws = jnp.ones((0, 4, 8)), jnp.ones((0, 8))\n"
        "dx, dw = jax.grad(lambda a, v: jax.vmap(rms_norm)(a, v).sum(), (0, 1))(xs, ws)\n"
        "assert dx.shape == (0, 4, 8) and dw.shape == (0, 8)",
        OK,
    ),
    # --- attributes -------------------------------------------------------------------------
    ("eps_negative", "rms_norm(x, eps=-1e-5)", ("ValueError", r"eps must be finite and >= 0 .*got -1e-05")),
    ("eps_nan", "rms_norm(x, eps=float('nan'))", ("ValueError", r"eps must be finite and >= 0 .*got nan")),
    ("eps_inf", "rms_norm(x, eps=float('inf'))", ("ValueError", r"eps must be finite and >= 0 .*got inf")),
    ("eps_beyond_float32", "rms_norm(x, eps=1e39)", ("ValueError", r"eps must be finite and >= 0 \(as a float32\)")),
    ("eps_string", "rms_norm(x, eps='1e-5')", ("TypeError", r"eps must be a real number, got str")),
    ("eps_bool", "rms_norm(x, eps=True)", ("TypeError", r"eps must be a real number, got bool")),
    ("eps_traced", "jax.jit(lambda x, e: rms_norm(x, eps=e))(x, 1e-5)", ("TypeError", r"eps must be a Python number .* traced")),
    ("eps_large_is_fine", "close(rms_norm(x, w, eps=1e30), rms_norm_reference(x, w, eps=1e30))", OK),
    ("eps_zero_is_fine", "close(rms_norm(x, w, eps=0.0), rms_norm_reference(x, w, eps=0.0))", OK),
    # eps kept as an array (penzai's parameters, configs): concrete 0-d arrays are the number they hold.
    ("eps_numpy_scalar_is_fine", "close(rms_norm(x, w, eps=np.float32(0.5)), rms_norm_reference(x, w, eps=0.5))", OK),
    ("eps_numpy_0d_is_fine", "close(rms_norm(x, w, eps=np.array(0.5)), rms_norm_reference(x, w, eps=0.5))", OK),
    ("eps_jax_0d_is_fine", "close(rms_norm(x, w, eps=jnp.asarray(0.5, jnp.bfloat16)), rms_norm_reference(x, w, eps=0.5))", OK),
    ("eps_int_0d_is_fine", "close(rms_norm(x, w, eps=np.array(1)), rms_norm_reference(x, w, eps=1.0))", OK),
    ("eps_1d_array", "rms_norm(x, eps=np.array([1e-5]))", ("ValueError", r"eps must be a scalar \(a 0-d array at most\), got an array of shape \(1,\)")),
    ("eps_bool_0d", "rms_norm(x, eps=np.array(True))", ("TypeError", r"eps must be a real number, got a 0-d array of dtype bool")),
    ("eps_nan_0d", "rms_norm(x, eps=jnp.asarray(jnp.nan))", ("ValueError", r"eps must be finite and >= 0 .*got nan")),
    # --- empty arrays and extreme sizes -----------------------------------------------------
    (
        "empty_rows",
        "e = jnp.ones((0, 64))\nclose(rms_norm(e, w), e)\nclose(jax.grad(lambda a: rms_norm(a, w).sum())(e), e)",
        OK,
    ),
    (
        "empty_last_axis",
        "e = jnp.ones((4, 0))\nassert rms_norm(e).shape == (4, 0)\nassert jax.grad(lambda a: rms_norm(a).sum())(e).shape == (4, 0)",
        OK,
    ),
    (
        "row_too_long",
        "jax.jit(rms_norm).lower(jax.ShapeDtypeStruct((1, 2**26 + 1), jnp.float32))",
        ("ValueError", r"x's last axis has 67108865 elements; at most 67108864 are supported"),
    ),
    ("many_rows_of_one", "a = jnp.asarray(rng.standard_normal((1 << 16, 1)), jnp.float32)\nclose(rms_norm(a), rms_norm_reference(a))", OK),
    (
        "one_long_row",
        "a = jnp.asarray(rng.standard_normal((1, 1 << 20)), jnp.float32)\nv = jnp.ones(1 << 20)\n"
        "close(rms_norm(a, v), rms_norm_reference(a, v))\n"
        "close(jax.grad(lambda a: rms_norm(a, v).sum())(a), jax.grad(lambda a: rms_norm_reference(a, v).sum())(a), 1e-4)",
        OK,
    ),
    (
        "nan_and_inf_in_x",
        "a = x.at[1, 3].set(jnp.nan).at[2, 5].set(jnp.inf)\n"
        "got, want = np.asarray(rms_norm(a, w)), np.asarray(rms_norm_reference(a, w))\n"
        "np.testing.assert_array_equal(np.isnan(got), np.isnan(want))\nclose(got[3:], want[3:])",
        OK,
    ),
    # --- layouts ----------------------------------------------------------------------------
    ("jnp_transpose", "t = x.T.T\nclose(rms_norm(x.T, w[:8]), rms_norm_reference(x.T, w[:8]))", OK),
    ("numpy_strided_view", "a = np.asarray(x)[:, ::2]\nclose(rms_norm(a), rms_norm_reference(jnp.asarray(a)))", OK),
    ("numpy_fortran_order", "a = np.asfortranarray(np.asarray(x))\nclose(rms_norm(a, w), rms_norm_reference(x, w))", OK),
    (
        "transpose_inside_grad",
        "f = lambda f: jax.grad(lambda a: (f(a.T, w[:8]) ** 2).sum())(x)\nclose(f(rms_norm), f(rms_norm_reference), 1e-4)",
        OK,
    ),
    # --- lifecycle and registration ---------------------------------------------------------
    (
        "calls_across_clear_caches",
        "f = jax.jit(lambda a: rms_norm(a, w))\nclose(f(x), rms_norm_reference(x, w))\n"
        "jax.clear_caches(); gc.collect()\nassert rmsnorm_ffi.stats()['live_states'] == 0, rmsnorm_ffi.stats()\n"
        "close(f(x), rms_norm_reference(x, w))\nassert rmsnorm_ffi.stats()['live_states'] == 1, rmsnorm_ffi.stats()",
        OK,
    ),
    (
        "clear_caches_before_first_use",
        "jax.clear_caches()\nclose(jax.jit(rms_norm)(x), rms_norm_reference(x))",
        OK,
    ),
    ("register_twice", "assert rmsnorm_ffi.register() == rmsnorm_ffi.register() == ('cpu',)", OK),
]

# Registration racing from two threads needs a process in which nothing registered yet, so it
# does not use the prelude (which calls the ops).
FRESH_CASES = [
    (
        "register_from_two_threads",
        "import threading, jax.numpy as jnp, numpy as np, rmsnorm_ffi\n"
        "got = []\nbarrier = threading.Barrier(2)\n"
        "def go():\n    barrier.wait()\n    got.append(rmsnorm_ffi.register())\n"
        "ts = [threading.Thread(target=go) for _ in range(2)]\n[t.start() for t in ts]\n[t.join() for t in ts]\n"
        "assert got == [('cpu',), ('cpu',)], got\n"
        "a = jnp.ones((2, 8))\nnp.testing.assert_allclose(rmsnorm_ffi.rms_norm(a), rmsnorm_ffi.rms_norm_reference(a))",
        OK,
    ),
    (
        "ops_from_two_threads_before_registration",
        "import threading, jax.numpy as jnp, numpy as np, rmsnorm_ffi\n"
        "a = jnp.ones((2, 8)); out = []\n"
        "ts = [threading.Thread(target=lambda: out.append(np.asarray(rmsnorm_ffi.rms_norm(a)))) for _ in range(4)]\n"
        "[t.start() for t in ts]\n[t.join() for t in ts]\nassert len(out) == 4\n"
        "[np.testing.assert_allclose(o, rmsnorm_ffi.rms_norm_reference(a)) for o in out]",
        OK,
    ),
]

# The Rust layer's own diagnostics, reached through jax.ffi.ffi_call without the Python checks.
RAW_CASES = [
    ("rust_wrong_dtype", "raw_forward(jnp.ones((2, 4), jnp.int32), eps=np.float32(1e-5), has_weight=False, row_len=np.int64(4))",
     (XLA, r"wrong dtype for argument 0: expected one of F32, F64, BF16, F16, got S32")),
    ("rust_missing_attribute", "raw_forward(x, eps=np.float32(1e-5), has_weight=False)", (XLA, r"\[instantiate\] .*missing attribute `row_len` \(S64 scalar\)")),
    ("rust_attribute_type", "raw_forward(x, eps=1e-5, has_weight=False, row_len=np.int64(64))", (XLA, r"wrong type for attribute `eps`: expected F32 scalar, got F64 scalar")),
    ("rust_negative_eps", "raw_forward(x, eps=np.float32(-1), has_weight=False, row_len=np.int64(64))", (XLA, r"invalid attribute `eps`: must be finite and >= 0")),
    ("rust_row_len_disagrees", "raw_forward(x, eps=np.float32(1e-5), has_weight=False, row_len=np.int64(32))",
     (XLA, r"last axis has 64 elements but the call site was instantiated for row_len=32")),
    ("rust_weight_missing", "raw_forward(x, eps=np.float32(1e-5), has_weight=True, row_len=np.int64(64))", (XLA, r"wrong number of arguments: expected 2, got 1")),
]


def run_case(code, prelude=PRELUDE):
    body = textwrap.indent(code, "    ")
    result = run_python(prelude + RUNNER.format(body=body), timeout=240)
    assert result.returncode == 0, f"crashed (exit {result.returncode}):\n{result.stderr[-3000:]}"
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, result.stdout + result.stderr[-3000:]
    return lines[0][len("RESULT "):]


def check(outcome, expected):
    kind, pattern = expected
    if kind == "ok":
        assert outcome == "ok", outcome
        return
    import re

    exc_type, _, message = outcome.partition(": ")
    assert exc_type == kind, outcome
    assert re.search(pattern, message), f"{pattern!r} not in {message!r}"


@pytest.mark.parametrize("code, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_public_api(code, expected):
    check(run_case(code), expected)


@pytest.mark.parametrize("code, expected", [c[1:] for c in FRESH_CASES], ids=[c[0] for c in FRESH_CASES])
def test_fresh_process(code, expected):
    check(run_case(code, prelude=""), expected)


@pytest.mark.parametrize("code, expected", [c[1:] for c in RAW_CASES], ids=[c[0] for c in RAW_CASES])
def test_rust_diagnostics(code, expected):
    check(run_case(code), expected)


"""`rmsnorm_ffi.RMSNorm` and `rmsnorm_ffi.nnx.RMSNorm` against flax's: parameters, outputs (the
whole dtype matrix, custom `promote_dtype` included), gradients, errors."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_python

import flax.linen as nn  # noqa: E402  (a dev requirement: the tests must not skip)

import rmsnorm_ffi  # noqa: E402

# (rtol, atol) per result dtype. float32: the two differ only in the order of the float32
# products (x * rstd * scale vs x * (rstd * scale)). Half precision: that difference can flip
# the final rounding, one ulp (2**-8 relative for bfloat16, 2**-11 for float16); gradients go
# through more half-precision roundings (the cotangent and dx are half precision).
TOLERANCES = {
    jnp.dtype(jnp.float32): (2e-5, 2e-5),
    jnp.dtype(jnp.bfloat16): (1.6e-2, 1.6e-2),
    jnp.dtype(jnp.float16): (2e-3, 2e-3),
}

# (x dtype, param_dtype, dtype): flax's result dtype is `dtype`, else promote(x, param).
CONFIGS = [
    (jnp.float32, jnp.float32, None),
    (jnp.bfloat16, jnp.float32, None),  # float32 result, as in flax
    (jnp.bfloat16, jnp.bfloat16, None),
    (jnp.bfloat16, jnp.float32, jnp.bfloat16),
    (jnp.float16, jnp.float16, None),
    (jnp.float16, jnp.float32, jnp.float16),
    (jnp.float32, jnp.bfloat16, None),
    (jnp.float32, jnp.float32, jnp.bfloat16),  # result narrower than x
]


def _name(config):
    return "-".join("none" if d is None else jnp.dtype(d).name for d in config)


def _tolerance(*dtypes):
    """The loosest tolerance among the dtypes involved."""
    return max(TOLERANCES[jnp.dtype(d)] for d in dtypes if d is not None)


def _pair(**kwargs):
    return rmsnorm_ffi.RMSNorm(**kwargs), nn.RMSNorm(**kwargs)


def _input(dtype, shape=(3, 5, 96)):
    x = 2.0 * jax.random.normal(jax.random.key(0), shape, jnp.float32) + 0.5
    return x.astype(dtype)


def _assert_close(got, want, rtol, atol):
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=rtol, atol=atol)


@pytest.mark.parametrize("config", CONFIGS, ids=_name)
def test_parameters_and_outputs_match_flax(config):
    x_dtype, param_dtype, dtype = config
    ours, theirs = _pair(param_dtype=param_dtype, dtype=dtype, scale_init=nn.initializers.normal(1.0))
    x = _input(x_dtype)
    variables = theirs.init(jax.random.key(1), x)
    # Same name, shape, dtype and initial values: the module is a drop-in.
    ours_variables = ours.init(jax.random.key(1), x)
    assert jax.tree.structure(ours_variables) == jax.tree.structure(variables)
    for a, b in zip(jax.tree.leaves(ours_variables), jax.tree.leaves(variables)):
        assert a.dtype == b.dtype == jnp.dtype(param_dtype)
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    want = theirs.apply(variables, x)
    got = jax.jit(ours.apply)(variables, x)
    _assert_close(got, want, *_tolerance(want.dtype, x_dtype))


@pytest.mark.parametrize("config", CONFIGS, ids=_name)
def test_gradients_match_flax(config):
    x_dtype, param_dtype, dtype = config
    ours, theirs = _pair(param_dtype=param_dtype, dtype=dtype, scale_init=nn.initializers.normal(1.0))
    x = _input(x_dtype)
    variables = theirs.init(jax.random.key(1), x)
    out_dtype = theirs.apply(variables, x).dtype
    cotangent = jax.random.normal(jax.random.key(2), x.shape, jnp.float32).astype(out_dtype)

    def loss(module):
        def f(variables, x):
            y = module.apply(variables, x)
            return jnp.sum(y.astype(jnp.float32) * cotangent.astype(jnp.float32))

        return jax.jit(jax.grad(f, argnums=(0, 1)))

    (dv_got, dx_got), (dv_want, dx_want) = loss(ours)(variables, x), loss(theirs)(variables, x)
    rtol, atol = _tolerance(out_dtype, x_dtype, param_dtype)
    _assert_close(dx_got, dx_want, rtol, atol)
    ds_got, ds_want = dv_got["params"]["scale"], dv_want["params"]["scale"]
    # The scale gradient sums 15 rows: scale the tolerance by the sum's magnitude.
    _assert_close(ds_got, ds_want, rtol, atol * 15)


def test_without_scale_matches_flax():
    ours, theirs = _pair(use_scale=False)
    x = _input(jnp.bfloat16)
    variables = theirs.init(jax.random.key(1), x)
    assert variables == {} and ours.init(jax.random.key(1), x) == {}
    want = theirs.apply({}, x)
    got = ours.apply({}, x)
    _assert_close(got, want, *TOLERANCES[jnp.dtype(jnp.bfloat16)])
    dx_got = jax.grad(lambda x: ours.apply({}, x).astype(jnp.float32).sum())(x)
    dx_want = jax.grad(lambda x: theirs.apply({}, x).astype(jnp.float32).sum())(x)
    _assert_close(dx_got, dx_want, *TOLERANCES[jnp.dtype(jnp.bfloat16)])


def test_epsilon_is_used():
    # A row of zeros is normalized to zeros whatever eps; a tiny row shows eps: x / sqrt(x^2 + eps).
    x = jnp.full((1, 8), 1e-3, jnp.float32)
    for eps in (1e-6, 1e-2):
        ours, theirs = _pair(epsilon=eps)
        variables = theirs.init(jax.random.key(0), x)
        _assert_close(ours.apply(variables, x), theirs.apply(variables, x), 1e-5, 1e-6)
    assert not np.allclose(
        rmsnorm_ffi.RMSNorm(epsilon=1e-6).apply(variables, x), rmsnorm_ffi.RMSNorm(epsilon=1e-2).apply(variables, x)
    )


def test_default_epsilon_is_flaxs():
    assert rmsnorm_ffi.RMSNorm().epsilon == nn.RMSNorm().epsilon == 1e-6


def test_inside_a_model_under_jit_and_vmap():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(32)(rmsnorm_ffi.RMSNorm()(x))

    x = _input(jnp.float32, (4, 7, 32))
    block = Block()
    variables = block.init(jax.random.key(0), x)
    assert variables["params"]["RMSNorm_0"]["scale"].shape == (32,)
    y = jax.jit(block.apply)(variables, x)
    per_example = jax.vmap(block.apply, in_axes=(None, 0))(variables, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(per_example), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("axes", [0, (0, 1), (-2,), (0, 2), 3, -4])
def test_reduction_axes_that_are_not_trailing_are_rejected(axes):
    x = _input(jnp.float32)
    with pytest.raises(ValueError, match="reduction_axes must name trailing axes of x"):
        rmsnorm_ffi.RMSNorm(reduction_axes=axes).init(jax.random.key(0), x)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "reduction_axes, feature_axes, scale_shape",
    [
        ((1, 2), (1, 2), (5, 96)),  # a scale over both normalized axes
        ((-2, -1), -1, (96,)),  # a scale along the last, broadcast along the other
        ((1, 2), (1,), (5,)),  # ... or along the first
    ],
)
def test_trailing_reduction_axes_match_flax(reduction_axes, feature_axes, scale_shape, dtype):
    x = _input(dtype)
    kwargs = dict(reduction_axes=reduction_axes, feature_axes=feature_axes, param_dtype=dtype)
    ours, theirs = rmsnorm_ffi.RMSNorm(**kwargs), nn.RMSNorm(**kwargs)
    variables = theirs.init(jax.random.key(0), x)
    assert ours.init(jax.random.key(0), x)["params"]["scale"].shape == scale_shape
    variables = jax.tree.map(lambda s: s * (1 + 0.1 * jax.random.normal(jax.random.key(3), s.shape)).astype(s.dtype), variables)
    rtol, atol = TOLERANCES[jnp.dtype(dtype)]
    _assert_close(ours.apply(variables, x), theirs.apply(variables, x), rtol, atol)
    cotangent = jax.random.normal(jax.random.key(4), x.shape, jnp.float32)

    def grads(module):
        return jax.grad(lambda v, x: jnp.sum(module.apply(v, x).astype(jnp.float32) * cotangent), (0, 1))(variables, x)

    (dv_got, dx_got), (dv_want, dx_want) = grads(ours), grads(theirs)
    _assert_close(dx_got, dx_want, rtol, atol)
    # The scale's gradient sums over 15 rows (and over the broadcast axis): its rounding grows.
    _assert_close(dv_got["params"]["scale"], dv_want["params"]["scale"], rtol, atol * 100)


@pytest.mark.parametrize("axes", [-1, 2, (-1,), [2]])
def test_last_axis_spelled_any_way_is_accepted(axes):
    x = _input(jnp.float32)
    ours = rmsnorm_ffi.RMSNorm(reduction_axes=axes, feature_axes=axes)
    theirs = nn.RMSNorm(reduction_axes=axes, feature_axes=axes)
    variables = theirs.init(jax.random.key(0), x)
    _assert_close(ours.apply(variables, x), theirs.apply(variables, x), *TOLERANCES[jnp.dtype(jnp.float32)])


@pytest.mark.parametrize(
    "kwargs, call_kwargs, message",
    [
        ({"feature_axes": 0}, {}, r"feature_axes must be among the normalized axes \(-1,\)"),
        ({"reduction_axes": (-2, -1), "feature_axes": (0, -1)}, {}, r"feature_axes must be among the normalized axes \(-2, -1\)"),
        ({"axis_name": "batch"}, {}, "axis_name"),
        ({"force_float32_reductions": False}, {}, "force_float32_reductions"),
        ({}, {"mask": jnp.ones((3, 5, 96), bool)}, "mask"),
    ],
)
def test_unsupported_options_raise(kwargs, call_kwargs, message):
    x = _input(jnp.float32)
    with pytest.raises(ValueError, match=message):
        rmsnorm_ffi.RMSNorm(**kwargs).init(jax.random.key(0), x, **call_kwargs)


def test_import_does_not_import_flax():
    result = run_python(
        "import sys, rmsnorm_ffi\n"
        "assert 'flax' not in sys.modules, 'import rmsnorm_ffi imported flax'\n"
        "rmsnorm_ffi.RMSNorm\n"
        "assert 'flax' in sys.modules\n"
        "print('ok')\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_missing_flax_gives_a_clear_import_error():
    # A meta-path finder that hides flax, as if it were not installed.
    result = run_python(
        "import sys, importlib.abc\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'flax' or name.startswith('flax.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "import rmsnorm_ffi\n"
        "try:\n"
        "    rmsnorm_ffi.RMSNorm\n"
        "except ImportError as e:\n"
        "    print(e)\n"
        "else:\n"
        "    raise SystemExit('no ImportError')\n"
        "try:\n"
        "    import rmsnorm_ffi.nnx\n"
        "except ImportError as e:\n"
        "    print(e)\n"
        "else:\n"
        "    raise SystemExit('no ImportError from rmsnorm_ffi.nnx')\n"
    )
    assert result.returncode == 0, result.stderr
    assert "rmsnorm_ffi.RMSNorm needs flax" in result.stdout
    assert "rmsnorm_ffi.nnx needs flax" in result.stdout
    assert result.stdout.count("pip install 'rmsnorm_ffi[flax]'") == 2


def test_unknown_attribute_still_raises_attribute_error():
    with pytest.raises(AttributeError, match="no_such_thing"):
        rmsnorm_ffi.no_such_thing  # noqa: B018


# --- flax.nnx ---------------------------------------------------------------------------------


def _nnx_pair(features, **kwargs):
    from flax import nnx

    import rmsnorm_ffi.nnx

    ours = rmsnorm_ffi.nnx.RMSNorm(features, rngs=nnx.Rngs(1), **kwargs)
    theirs = nnx.RMSNorm(features, rngs=nnx.Rngs(1), **kwargs)
    if theirs.scale is not None:
        # Same initial parameter: the comparisons below are with identical params.
        assert ours.scale[...].dtype == theirs.scale[...].dtype
        np.testing.assert_array_equal(np.asarray(ours.scale[...], np.float64), np.asarray(theirs.scale[...], np.float64))
    return ours, theirs


def _nnx_grads(module, x, cotangent):
    from flax import nnx

    graphdef, state = nnx.split(module)

    def f(state, x):
        y = nnx.merge(graphdef, state)(x)
        return jnp.sum(y.astype(jnp.float32) * cotangent.astype(jnp.float32))

    dstate, dx = jax.jit(jax.grad(f, argnums=(0, 1)))(state, x)
    return dstate["scale"][...], dx


@pytest.mark.parametrize("config", CONFIGS, ids=_name)
def test_nnx_outputs_and_gradients_match_flax(config):
    from flax import nnx

    x_dtype, param_dtype, dtype = config
    x = _input(x_dtype)
    ours, theirs = _nnx_pair(x.shape[-1], param_dtype=param_dtype, dtype=dtype, scale_init=nnx.initializers.normal(1.0))
    assert ours.scale[...].dtype == jnp.dtype(param_dtype)
    want = theirs(x)
    got = ours(x)
    rtol, atol = _tolerance(want.dtype, x_dtype, param_dtype)
    _assert_close(got, want, rtol, atol)
    cotangent = jax.random.normal(jax.random.key(2), x.shape, jnp.float32).astype(want.dtype)
    (ds_got, dx_got), (ds_want, dx_want) = _nnx_grads(ours, x, cotangent), _nnx_grads(theirs, x, cotangent)
    _assert_close(dx_got, dx_want, rtol, atol)
    _assert_close(ds_got, ds_want, rtol, atol * 15)


def test_nnx_without_scale_and_bad_axes():
    x = _input(jnp.float32)
    ours, theirs = _nnx_pair(x.shape[-1], use_scale=False)
    _assert_close(ours(x), theirs(x), *TOLERANCES[jnp.dtype(jnp.float32)])
    bad, _ = _nnx_pair(x.shape[-1], reduction_axes=(0, 2))
    with pytest.raises(ValueError, match="reduction_axes must name trailing axes of x"):
        bad(x)
    # Trailing reduction axes, the scale along the last (nnx's scale has num_features).
    ours, theirs = _nnx_pair(x.shape[-1], reduction_axes=(1, 2))
    _assert_close(ours(x), theirs(x), *TOLERANCES[jnp.dtype(jnp.float32)])


def _identity_promote(args, dtype=None):
    """No promotion at all (flax's own nnx/Linen equivalence tests pass such a function): x and
    the scale reach the normalization in their own dtypes."""
    return args


def _bfloat16_promote(args, dtype=None):
    """Casts x and the scale to bfloat16, whatever `dtype` says."""
    return tuple(None if a is None else jnp.asarray(a, jnp.bfloat16) for a in args)


@pytest.mark.parametrize(
    "promote, config",
    [
        # The two reported bugs: a float32 result where flax gives bfloat16, and a TypeError
        # for a half-precision scale with float32 x.
        (_identity_promote, (jnp.float32, jnp.float32, jnp.bfloat16)),
        (_identity_promote, (jnp.float32, jnp.bfloat16, None)),
        (_identity_promote, (jnp.float32, jnp.float16, None)),
        (_identity_promote, (jnp.bfloat16, jnp.float16, None)),  # float32 result
        (_identity_promote, (jnp.float16, jnp.float32, jnp.float16)),
        (_bfloat16_promote, (jnp.float32, jnp.float32, None)),
        (_bfloat16_promote, (jnp.float32, jnp.float32, jnp.float32)),
    ],
    ids=lambda v: _name(v) if isinstance(v, tuple) else v.__name__.strip("_"),
)
def test_nnx_custom_promote_outputs_and_gradients_match_flax(promote, config):
    x_dtype, param_dtype, dtype = config
    x = _input(x_dtype)
    ours, theirs = _nnx_pair(
        x.shape[-1], param_dtype=param_dtype, dtype=dtype, promote_dtype=promote, scale_init=nn.initializers.normal(1.0)
    )
    want = theirs(x)
    got = jax.jit(lambda x: ours(x))(x)
    # The gradients go through the promoted dtypes too (bfloat16 for _bfloat16_promote).
    promoted = [a.dtype for a in promote((x, theirs.scale[...]), dtype=dtype)]
    rtol, atol = _tolerance(want.dtype, x_dtype, param_dtype, *promoted)
    _assert_close(got, want, rtol, atol)
    cotangent = jax.random.normal(jax.random.key(2), x.shape, jnp.float32).astype(want.dtype)
    (ds_got, dx_got), (ds_want, dx_want) = _nnx_grads(ours, x, cotangent), _nnx_grads(theirs, x, cotangent)
    _assert_close(dx_got, dx_want, rtol, atol)
    _assert_close(ds_got, ds_want, rtol, atol * 15)


# --- the dtype matrix -------------------------------------------------------------------------
#
# Every x dtype x param_dtype x dtype (None or each float) x promote_dtype (nnx: flax's default,
# the identity, a fixed cast to bfloat16; Linen has no promote_dtype) x use_scale, for both
# modules, against flax's module with identical parameters: the result dtype must be flax's,
# the values within ULPS of flax's.

FLOATS = (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16)
PROMOTE = {"default": None, "identity": _identity_promote, "to_bfloat16": _bfloat16_promote}
MATRIX_SHAPE = (4, 96)

# Allowed difference in ulps of the result dtype; in parentheses the largest difference
# measured over this matrix with 341 rows of 96 and 32 rows of 1024, three seeds each. The op
# computes (x * rstd) * scale with rstd = 1 / sqrt(mean + eps), flax x * (rsqrt(mean + eps) *
# scale), and both sum in their own order: each is within about 2.5 ulp of the exact float32
# result, in either direction. A half-precision result is the same float32 (float64) value
# rounded once more, so the two differ by at most one final rounding.
ULPS = {
    jnp.dtype(jnp.float32): 6,  # (5 with rows of 96, 6 with rows of 1024)
    jnp.dtype(jnp.bfloat16): 1,  # (1)
    jnp.dtype(jnp.float16): 1,  # (1)
    jnp.dtype(jnp.float64): 16,  # (7, 8): float64 sums in another order
}
# Where flax takes the statistics in float32 but multiplies in float64 (a float64 scale or
# float64 x with a narrower `dtype`), the op takes them in float64: a float64 result differs
# from flax's by float32 rounding. Allowed: this many float32 ulps (measured 2.3).
F64_RESULT_FROM_F32_STATS_ULPS = 3


def _matrix(kind):
    cases = []
    promotes = ["-"] if kind == "linen" else list(PROMOTE)
    for x_dtype, param_dtype, dtype, promote, use_scale in itertools.product(
        FLOATS, FLOATS, (None, *FLOATS), promotes, (True, False)
    ):
        if not use_scale and param_dtype != jnp.float32:
            continue  # param_dtype is unused without a scale
        name = f"{kind}-x_{_name((x_dtype,))}-param_{_name((param_dtype,))}-dtype_{_name((dtype,))}"
        name += ("" if kind == "linen" else f"-promote_{promote}") + ("" if use_scale else "-noscale")
        cases.append(pytest.param(kind, x_dtype, param_dtype, dtype, promote, use_scale, id=name))
    return cases


def _ulps(got, want, unit):
    """max |got - want| in ulps of `want` as a `unit` number (subnormal spacing near zero)."""
    info = jnp.finfo(unit)
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    _, exponent = np.frexp(np.abs(want))
    ulp = np.maximum(np.ldexp(1.0, exponent - 1 - info.nmant), np.ldexp(1.0, info.minexp - info.nmant))
    return float(np.max(np.abs(got - want) / ulp))


@pytest.mark.parametrize("kind, x_dtype, param_dtype, dtype, promote, use_scale", _matrix("linen") + _matrix("nnx"))
def test_dtype_matrix_matches_flax(kind, x_dtype, param_dtype, dtype, promote, use_scale):
    from flax import nnx

    uses_f64 = any(d is jnp.float64 for d in (x_dtype, param_dtype, dtype))
    kwargs = dict(param_dtype=param_dtype, dtype=dtype, use_scale=use_scale, scale_init=nn.initializers.normal(1.0))
    with jax.enable_x64(uses_f64):
        x = _input(x_dtype, MATRIX_SHAPE)
        if kind == "linen":
            ours, theirs = _pair(**kwargs)
            variables = theirs.init(jax.random.key(1), x)
            want, got = theirs.apply(variables, x), ours.apply(variables, x)
            x_seen = x  # what flax's normalization sees
        else:
            if PROMOTE[promote] is not None:
                kwargs["promote_dtype"] = PROMOTE[promote]
            ours, theirs = _nnx_pair(x.shape[-1], **kwargs)
            want, got = theirs(x), ours(x)
            assert isinstance(ours, nnx.RMSNorm)
            x_seen, _ = theirs.promote_dtype((x, theirs.scale[...] if use_scale else None), dtype=dtype)
    assert got.dtype == want.dtype, f"result dtype {got.dtype}, flax's {want.dtype}"
    assert got.shape == want.shape
    stats_dtype = jnp.promote_types(x_seen.dtype if dtype is None else dtype, jnp.float32)
    if want.dtype == jnp.float64 and stats_dtype == jnp.float32:
        unit, limit = jnp.float32, F64_RESULT_FROM_F32_STATS_ULPS
    else:
        unit, limit = want.dtype, ULPS[jnp.dtype(want.dtype)]
    ulps = _ulps(got, want, unit)
    assert ulps <= limit, f"{ulps} {jnp.dtype(unit).name} ulps from flax's result (allowed {limit})"


def test_nnx_with_identity_promote_is_linen():
    """As for flax's modules: nnx's RMSNorm with the identity promote_dtype is Linen's, here
    bit for bit (one code path)."""
    from flax import nnx

    import rmsnorm_ffi.nnx

    x_dtypes = (jnp.float32, jnp.bfloat16, jnp.float16)
    for x_dtype, param_dtype, dtype in itertools.product(x_dtypes, x_dtypes, (None, *x_dtypes)):
        x = _input(x_dtype, MATRIX_SHAPE)
        kwargs = dict(param_dtype=param_dtype, dtype=dtype, scale_init=nn.initializers.normal(1.0))
        nnx_norm = rmsnorm_ffi.nnx.RMSNorm(x.shape[-1], promote_dtype=_identity_promote, rngs=nnx.Rngs(1), **kwargs)
        linen = rmsnorm_ffi.RMSNorm(**kwargs).apply({"params": {"scale": nnx_norm.scale[...]}}, x)
        got = nnx_norm(x)
        assert got.dtype == linen.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(linen, np.float64))


def test_integer_input_as_flax_and_complex_rejected():
    # flax computes an integer input in float32 (a float32 result); complex input it supports,
    # the op does not.
    x = jnp.arange(-20, 28, dtype=jnp.int32).reshape(3, 16)
    ours, theirs = _pair(scale_init=nn.initializers.normal(1.0))
    variables = theirs.init(jax.random.key(1), x)
    _assert_close(ours.apply(variables, x), theirs.apply(variables, x), *TOLERANCES[jnp.dtype(jnp.float32)])
    nnx_ours, nnx_theirs = _nnx_pair(16)
    _assert_close(nnx_ours(x), nnx_theirs(x), *TOLERANCES[jnp.dtype(jnp.float32)])
    with pytest.raises(TypeError, match=r"rmsnorm_ffi.RMSNorm: x \(complex64\)"):
        ours.apply(variables, x.astype(jnp.complex64))


@pytest.mark.parametrize("config", CONFIGS[:4], ids=_name)
def test_scale_offset_is_flaxs_norm_with_the_scale_shifted(config):
    # Gemma's zero-centred gamma: a scale s applied as (1 + s) is flax's RMSNorm with scale
    # 1 + s, and the gradient with respect to s is flax's with respect to its scale.
    from flax import nnx

    import rmsnorm_ffi.nnx

    x_dtype, param_dtype, dtype = config
    x = _input(x_dtype)
    shifted = jax.random.normal(jax.random.key(3), (x.shape[-1],), jnp.float32).astype(param_dtype) * 0.1
    ours = rmsnorm_ffi.RMSNorm(scale_offset=1.0, param_dtype=param_dtype, dtype=dtype)
    theirs = nn.RMSNorm(param_dtype=param_dtype, dtype=dtype)
    p_ours = {"params": {"scale": shifted}}
    p_theirs = {"params": {"scale": (1.0 + shifted.astype(jnp.float32)).astype(jnp.float32)}}
    theirs_f = lambda p, x: nn.RMSNorm(param_dtype=jnp.float32, dtype=dtype).apply(p, x)
    want = theirs_f(p_theirs, x).astype(theirs.apply({"params": {"scale": shifted}}, x).dtype)
    got = ours.apply(p_ours, x)
    rtol, atol = _tolerance(want.dtype, x_dtype, param_dtype)
    _assert_close(got, want, rtol, atol)
    cot = jax.random.normal(jax.random.key(4), x.shape, jnp.float32).astype(got.dtype)
    g_ours = jax.grad(lambda p: jnp.vdot(ours.apply(p, x).astype(jnp.float32), cot.astype(jnp.float32)))(p_ours)
    g_theirs = jax.grad(lambda p: jnp.vdot(theirs_f(p, x).astype(jnp.float32), cot.astype(jnp.float32)))(p_theirs)
    np.testing.assert_allclose(
        np.asarray(g_ours["params"]["scale"], np.float32), np.asarray(g_theirs["params"]["scale"], np.float32), rtol=rtol, atol=atol * 15
    )
    # nnx: the same module through the constructor keyword (its promote_dtype may cast the
    # scale to `dtype` first, as flax's nnx module does).
    m = rmsnorm_ffi.nnx.RMSNorm(x.shape[-1], scale_offset=1.0, param_dtype=param_dtype, dtype=dtype, rngs=nnx.Rngs(0))
    m.scale[...] = shifted
    _assert_close(m(x), want, rtol, atol)
    with pytest.raises(ValueError, match="scale_offset needs use_scale=True"):
        rmsnorm_ffi.RMSNorm(scale_offset=1.0, use_scale=False).init(jax.random.key(0), x)

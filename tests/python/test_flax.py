"""`rmsnorm_ffi.RMSNorm` against `flax.linen.RMSNorm`: parameters, outputs, gradients, errors."""

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


@pytest.mark.parametrize("axes", [0, (0, 1), (-2,), (1, 2), 3, -4])
def test_reduction_axes_other_than_last_are_rejected(axes):
    x = _input(jnp.float32)
    with pytest.raises(ValueError, match="reduction_axes must be the last axis"):
        rmsnorm_ffi.RMSNorm(reduction_axes=axes).init(jax.random.key(0), x)


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
        ({"feature_axes": 0}, {}, "feature_axes must be the last axis"),
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

    return rmsnorm_ffi.nnx.RMSNorm(features, rngs=nnx.Rngs(1), **kwargs), nnx.RMSNorm(features, rngs=nnx.Rngs(1), **kwargs)


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
    assert ours.scale[...].dtype == theirs.scale[...].dtype == jnp.dtype(param_dtype)
    np.testing.assert_array_equal(np.asarray(ours.scale[...], np.float32), np.asarray(theirs.scale[...], np.float32))
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
    bad, _ = _nnx_pair(x.shape[-1], reduction_axes=(1, 2))
    with pytest.raises(ValueError, match="reduction_axes must be the last axis"):
        bad(x)

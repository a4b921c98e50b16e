"""Every attribute kind, as real XLA encodes it, read back by the Rust decoding layer."""

import numpy as np
import pytest
import ml_dtypes

import jax
import jax.numpy as jnp

from testing_bundles import describe_attributes, lists


@pytest.mark.parametrize(
    "value,expected",
    [
        (True, "PRED:true"),
        (np.int8(-8), "S8:-8"),
        (np.int16(-16), "S16:-16"),
        (np.int32(-32), "S32:-32"),
        (np.int64(-64), "S64:-64"),
        (np.uint8(8), "U8:8"),
        (np.uint16(16), "U16:16"),
        (np.uint32(32), "U32:32"),
        (np.uint64(2**40), "U64:1099511627776"),
        (np.float32(1.5), "F32:1.5"),
        (2.5, "F64:2.5"),
        (7, "S64:7"),
        ("hello", "string:hello"),
        ("", "string:"),
        (np.array([1, 2, 3], np.int32), "S32[3]:1,2,3"),
        (np.array([1.5, -2.0], np.float32), "F32[2]:1.5,-2"),
        (np.array([2**40], np.int64), "S64[1]:1099511627776"),
        (np.array([], np.float64), "F64[0]:"),
    ],
    ids=lambda v: type(v).__name__,
)
def test_scalar_array_and_string_attributes(value, expected):
    assert describe_attributes(a=value) == f"a={expected}"


def test_attributes_arrive_sorted_by_name_with_dictionaries():
    # jax's ffi_call accepts one level of dictionary holding scalars and strings (nested dicts
    # and arrays inside a dict are not hashable params);
    # deeper nesting is covered by the Rust tests against the fake runtime.
    got = describe_attributes(
        zeta=np.int32(1),
        alpha={"s": "x", "b": np.float32(2.0), "n": np.uint8(7)},
        mid=np.array([4, 5], np.int64),
    )
    assert got == "alpha=dict:{b=F32:2;n=U8:7;s=string:x};mid=S64[2]:4,5;zeta=S32:1"


@pytest.mark.parametrize("value", [np.float16(0.5), ml_dtypes.bfloat16(0.25)], ids=["f16", "bf16"])
def test_half_precision_scalar_attributes_are_refused_by_xla(value):
    # A fact about jaxlib 0.10.2, not a limit of this crate (which decodes F16/BF16 scalars, see
    # the Rust tests): XLA rejects them before any handler runs. Pass float32 instead.
    import jax

    with pytest.raises(jax.errors.JaxRuntimeError, match="Unsupported float attribute bit width"):
        describe_attributes(a=value)


def test_no_attributes():
    assert describe_attributes() == ""


def test_optional_and_remaining_arguments_any_number_of_results_through_xla():
    # Typed decoding of real frames: (Buffer, Option<Buffer>, RemainingArgs) -> ResultList, with a
    # nested dictionary attribute decoded into a struct holding an integer enum.
    x = jnp.arange(4, dtype=jnp.float32)
    bias = jnp.full(4, 0.5, jnp.float32)
    rest = [jnp.full(4, float(k), jnp.float32) for k in (1, 2, 3)]
    (only,) = jax.jit(lambda x: lists(x, factor=np.float32(2.0)))(x)
    np.testing.assert_array_equal(only, 2.0 * np.arange(4))
    out = jax.jit(lambda *a: lists(*a, results=3, factor=np.float32(2.0)))(x, bias, *rest)
    for k, r in enumerate(out):
        np.testing.assert_array_equal(r, (np.arange(4) + 6.0) * 2.0 + 0.5 + k)
    # The enum's value as a Python int (S64) or np.int32 (S32): Max.
    for seven in (7, np.int32(7)):
        (m,) = jax.jit(lambda *a: lists(*a, reduce=seven))(x, bias, *rest)
        np.testing.assert_array_equal(m, np.maximum(np.arange(4), 3.0) + 0.5)
    # Any number of results: 100 (more than the 64 a list tracks inline).
    many = jax.jit(lambda x: lists(x, results=100))(x)
    assert len(many) == 100
    np.testing.assert_array_equal(np.stack(many)[:, 0], np.arange(100))


def test_list_and_nested_attribute_errors_come_back_named():
    x = jnp.ones(4, jnp.float32)
    with pytest.raises(Exception, match=r"`reduce`: expected one of 0 \(Sum\), 7 \(Max\) \(integer\), got S64 scalar 3"):
        jax.block_until_ready(jax.jit(lambda x: lists(x, reduce=3))(x))
    with pytest.raises(Exception, match=r"wrong number of arguments: expected at least 1, got 0"):
        from testing_bundles import LISTS_TARGET, register

        register()
        call = jax.ffi.ffi_call(LISTS_TARGET, jax.ShapeDtypeStruct((4,), jnp.float32))
        jax.block_until_ready(jax.jit(lambda: call(scaling={"factor": np.float32(1), "reduce": 0}))())
    with pytest.raises(Exception, match=r"attribute `scaling`: in the dictionary: missing attribute `factor`"):
        from testing_bundles import LISTS_TARGET

        call = jax.ffi.ffi_call(LISTS_TARGET, jax.ShapeDtypeStruct((4,), jnp.float32))
        jax.block_until_ready(jax.jit(lambda x: call(x, scaling={"reduce": 0}))(x))
    with pytest.raises(Exception, match=r"wrong dtype for argument 2: expected F32, got S32"):
        jax.block_until_ready(jax.jit(lambda x: lists(x, x, jnp.ones(4, jnp.int32)))(x))

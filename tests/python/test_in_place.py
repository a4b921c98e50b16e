"""In-place updates through real XLA: the scaled_copy library's `ema_update` target, whose result
is its first operand's buffer (`InPlaceBuffer<f32, 0>` over an `AliasedArg` in Rust,
``input_output_aliases={0: 0}`` in `batched_ffi_op`). With the operand donated under `jit`, the
compiled HLO has no copy and the output is the input's buffer; kept, XLA copies it first and the
result is the same; a call site that does not alias the pair, or a bundle that does not declare
it, gets an error naming the fix. On 4 forced host devices (a subprocess), the update runs per
shard on an explicit and an automatic mesh, in place."""

import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, bundle_library, run_python

EXAMPLE = REPO / "examples" / "scaled_copy"


@pytest.fixture(scope="module")
def ema():
    import scaled_copy

    scaled_copy.load(bundle_library("scaled_copy"))
    return scaled_copy


def values(shape=(8, 64), seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal(shape), jnp.float32),
            jnp.asarray(rng.standard_normal(shape), jnp.float32))


def copies(hlo: str) -> list[str]:
    """The copy instructions of a compiled module's text."""
    return re.findall(r"= [a-z0-9\[\]{},:]+ copy\(", hlo)


def test_the_update_is_right_with_and_without_donation(ema):
    average, x = values()
    expected = np.asarray(ema.ema_update_reference(average, x, 0.9))
    kept = jax.jit(lambda a, v: ema.ema_update(a, v, 0.9))
    np.testing.assert_allclose(kept(average, x), expected, rtol=1e-6, atol=1e-7)
    # Kept: the input is still there and unchanged (XLA updated a copy).
    np.testing.assert_array_equal(average, values()[0])
    donated = jax.jit(lambda a, v: ema.ema_update(a, v, 0.9), donate_argnums=0)
    out = donated(jnp.array(average), x)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7)
    # Eager and vmapped (one call on the mapped rows) give the same.
    np.testing.assert_allclose(ema.ema_update(average, x, 0.9), expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(jax.vmap(lambda a, v: ema.ema_update(a, v, 0.9))(average, x), expected,
                               rtol=1e-6, atol=1e-7)


def test_a_donated_operand_is_updated_without_a_copy(ema):
    average, x = values((16, 256))
    fn = lambda a, v: ema.ema_update(a, v, 0.5)  # noqa: E731
    donated = jax.jit(fn, donate_argnums=0).lower(average, x).compile().as_text()
    kept = jax.jit(fn).lower(average, x).compile().as_text()
    # Both ask XLA to alias the custom call's output with its operand 0.
    for hlo in (donated, kept):
        assert 'custom_call_target="ema_update"' in hlo
        assert "output_to_operand_aliasing={{}: (0, {})}" in hlo, hlo
    # Donated: the parameter is the output buffer, no copy; kept: XLA copies it first.
    assert copies(donated) == [], donated
    assert len(copies(kept)) == 1, kept
    # Donated: the module's parameter 0 is its output; kept: no such alias.
    assert "input_output_alias={ {}: (0, {}, may-alias) }" in donated, donated
    assert "input_output_alias" not in kept, kept
    arg = jnp.array(average)
    pointer = arg.unsafe_buffer_pointer()
    out = jax.jit(fn, donate_argnums=0)(arg, x)
    assert out.unsafe_buffer_pointer() == pointer
    assert arg.is_deleted()


def test_an_in_place_chain_updates_one_buffer(ema):
    # A training-loop shape: the average threaded through a scan, updated in place each step.
    average, _ = values((4, 32))
    xs = jnp.asarray(np.random.default_rng(1).standard_normal((5, 4, 32)), jnp.float32)

    def run(a, xs):
        return jax.lax.scan(lambda a, v: (ema.ema_update(a, v, 0.8), None), a, xs)[0]

    expected = average
    for v in xs:
        expected = ema.ema_update_reference(expected, v, 0.8)
    np.testing.assert_allclose(jax.jit(run, donate_argnums=0)(jnp.array(average), xs), expected, rtol=1e-5, atol=1e-6)


def test_a_call_site_that_does_not_alias_the_pair_gets_the_fix(ema):
    average, x = values((2, 8))
    plain = jax.ffi.ffi_call(ema.EMA_TARGET, jax.ShapeDtypeStruct(average.shape, average.dtype))
    with pytest.raises(Exception, match=r"declared in place over argument 0, but the call site passes two separate "
                                        r"buffers.*input_output_aliases=\{0: 0\}"):
        jax.block_until_ready(jax.jit(lambda a, v: plain(a, v, decay=np.float32(0.5)))(average, x))


def test_a_bundle_that_does_not_declare_the_pair_names_the_fix(ema):
    # scaled_copy takes a plain result: aliased with its operand by the call site, it refuses.
    x = jnp.ones((2, 8), jnp.float32)
    call = jax.ffi.ffi_call("scaled_copy", jax.ShapeDtypeStruct(x.shape, x.dtype), input_output_aliases={0: 0})
    with pytest.raises(Exception, match=r"result 0 is argument 0's buffer.*InPlace<0>.*AliasedArg"):
        jax.block_until_ready(jax.jit(lambda a: call(a, scale=np.float32(2.0), row_len=np.int64(8)),
                                      donate_argnums=0)(x))


def test_bad_aliases_are_named_before_lowering(ema):
    import rmsnorm_ffi

    struct = lambda a, **k: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    with pytest.raises(ValueError, match="operand 1 is unbatched"):
        rmsnorm_ffi.batched_ffi_op("ema_update", struct, core_ndims=(0, None), input_output_aliases={1: 0})
    with pytest.raises(ValueError, match="operand 2 does not exist"):
        rmsnorm_ffi.batched_ffi_op("ema_update", struct, core_ndims=(0, 0), input_output_aliases={2: 0})
    with pytest.raises(ValueError, match="a result aliases two operands"):
        rmsnorm_ffi.batched_ffi_op("ema_update", struct, core_ndims=(0, 0), input_output_aliases={0: 0, 1: 0})
    with pytest.raises(TypeError, match="expected a dict"):
        rmsnorm_ffi.batched_ffi_op("ema_update", struct, core_ndims=(0, 0), input_output_aliases=[(0, 0)])
    wrong = rmsnorm_ffi.batched_ffi_op(
        "ema_update", lambda a, v, **k: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16), core_ndims=(0, 0),
        input_output_aliases={0: 0})
    with pytest.raises(ValueError, match=r"result 0 is operand 0 updated in place .* must have its shape and dtype"):
        wrong(*values((2, 4)), decay=np.float32(0.5))
    with pytest.raises(ValueError, match="decay must be a number in"):
        ema.ema_update(*values((2, 4)), 1.5)


def test_in_place_per_shard_on_explicit_and_automatic_meshes():
    out = run_python(
        textwrap.dedent(
            f"""
            import os, re, sys
            os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
            sys.path.insert(0, {str(EXAMPLE)!r})
            import jax, jax.numpy as jnp, numpy as np
            from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
            import scaled_copy
            scaled_copy.load({str(bundle_library("scaled_copy"))!r})
            rng = np.random.default_rng(0)
            a = rng.standard_normal((8, 16)).astype(np.float32)
            x = rng.standard_normal((8, 16)).astype(np.float32)
            expected = 0.25 * a + 0.75 * x
            fn = lambda a, v: scaled_copy.ema_update(a, v, 0.25)
            for kind in (AxisType.Explicit, AxisType.Auto):
                mesh = jax.make_mesh((4,), ("rows",), axis_types=(kind,))
                s = NamedSharding(mesh, P("rows", None))
                with jax.set_mesh(mesh):
                    da, dx = jax.device_put(a, s), jax.device_put(x, s)
                    f = jax.jit(fn, donate_argnums=0)
                    hlo = f.lower(da, dx).compile().as_text()
                    out = f(da, dx)
                np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-6, atol=1e-7)
                assert out.sharding.spec[0] == "rows", out.sharding
                copies = re.findall(r"= [a-z0-9\\[\\]{{}},:]+ copy\\(", hlo)
                gathers = hlo.count("all-gather")
                print(kind.name, "ema_update" in hlo, len(copies), gathers)
            """
        )
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["Explicit True 0 0", "Auto True 0 0"], out.stdout

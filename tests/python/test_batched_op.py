"""`rmsnorm_ffi.batched_ffi_op`: a third-party target (the scaled_copy example library, and our
own forward target wrapped as a user would, for an unbatched operand) as a JAX op: input checks,
`vmap` as one call, and on 4 forced host devices, explicit and automatic meshes, the call per
shard with no all-gather in the compiled HLO. The meshes run in a subprocess: the device count
must be set before JAX starts."""

import json
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import bundle_library, run_python

import rmsnorm_ffi


@pytest.fixture(scope="module")
def scaled_copy():
    import scaled_copy

    scaled_copy.load(bundle_library("scaled_copy"))
    return scaled_copy


def targets(fn, *args):
    return re.findall(r'custom_call_target="([a-z_]+)"', jax.jit(fn).lower(*args).compile().as_text())


def test_values_under_jit_on_any_leading_axes(scaled_copy):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5, 64)), jnp.float32)
    for arr in (x, x[0], x[0, 0]):
        np.testing.assert_allclose(jax.jit(lambda a: scaled_copy.scaled_copy(a, 2.0))(arr),
                                   scaled_copy.scaled_copy_reference(arr, 2.0), rtol=1e-6)


def test_vmap_is_one_call(scaled_copy):
    x = jnp.ones((4, 3, 64), jnp.float32)
    f = jax.vmap(jax.vmap(lambda r: scaled_copy.scaled_copy(r, 3.0)))
    np.testing.assert_allclose(f(x), scaled_copy.scaled_copy_reference(x, 3.0), rtol=1e-6)
    assert targets(f, x) == ["scaled_copy"]
    hlo = jax.jit(f).lower(x).compile().as_text()
    assert " while(" not in hlo and "while " not in hlo.split("ENTRY", 1)[1]


def test_an_unbatched_operand_stays_whole_and_a_mapped_one_runs_per_element():
    op = _norm_op()
    x = jnp.asarray(np.random.default_rng(1).standard_normal((6, 32)), jnp.float32)
    w = jnp.linspace(0.5, 1.5, 32, dtype=jnp.float32)
    y, rstd = jax.jit(lambda x, w: op(x, w, **_NORM_ATTRS(x)))(x, w)
    np.testing.assert_allclose(y, rmsnorm_ffi.rms_norm_reference(x, w), rtol=1e-5, atol=1e-6)
    assert rstd.shape == (6,)
    # vmap over x alone: one call; over the weight too (per-example weights): one call each.
    xs = jnp.stack([x, 2 * x])
    assert targets(jax.vmap(lambda x: op(x, w, **_NORM_ATTRS(x))), xs) == ["rmsnorm_fwd"]
    ws = jnp.stack([w, w[::-1]])
    ys, _ = jax.vmap(lambda x, w: op(x, w, **_NORM_ATTRS(x)))(xs, ws)
    for k in range(2):
        np.testing.assert_allclose(ys[k], rmsnorm_ffi.rms_norm_reference(xs[k], ws[k]), rtol=1e-5, atol=1e-6)


def test_bad_operands_are_named():
    op = _norm_op()
    x, w = jnp.ones((4, 8)), jnp.ones((8,))
    with pytest.raises(TypeError, match=r"rmsnorm_fwd: expected 2 operands \(core_ndims has 2\), got 1"):
        op(x)
    two = rmsnorm_ffi.batched_ffi_op("rmsnorm_fwd", lambda a, b, **k: a, core_ndims=(1, 1))
    with pytest.raises(ValueError, match=r"operand 1 has batch shape \(3,\) but operand 0 has \(4,\)"):
        two(x, jnp.ones((3, 8)))
    with pytest.raises(ValueError, match=r"operand 0 has shape \(\), fewer than its 1 core axes"):
        op(jnp.float32(1), w)
    bad = rmsnorm_ffi.batched_ffi_op("rmsnorm_fwd", lambda x, w, **k: jax.ShapeDtypeStruct((2,), x.dtype),
                                     core_ndims=(1, None))
    with pytest.raises(ValueError, match=r"result 0 has shape \(2,\), which does not start with the batch shape \(4,\)"):
        bad(x, w)
    with pytest.raises(ValueError, match=r"core_ndims\[0\]: expected an int >= 0 or None"):
        rmsnorm_ffi.batched_ffi_op("rmsnorm_fwd", lambda x: x, core_ndims=(-1,))
    with pytest.raises(ValueError, match="at least one operand must be batched"):
        rmsnorm_ffi.batched_ffi_op("rmsnorm_fwd", lambda x: x, core_ndims=(None,))


def _norm_results(x, w, **attrs):
    return jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32)


def _NORM_ATTRS(x):
    return dict(eps=np.float32(1e-5), has_weight=True, row_len=np.int64(x.shape[-1]))


def _norm_op():
    rmsnorm_ffi.register()
    return rmsnorm_ffi.batched_ffi_op("rmsnorm_fwd", _norm_results, core_ndims=(1, None))


MESHES = textwrap.dedent(
    r"""
    import json, re, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
    sys.path.insert(0, "examples/scaled_copy")
    import rmsnorm_ffi, scaled_copy
    scaled_copy.load(sys.argv[1] if len(sys.argv) > 1 else None)
    rmsnorm_ffi.register()  # the norm's forward target, wrapped below as a library's would be

    def spec_of(a):
        # The partition spec's entries, trailing unsharded axes dropped (printed as jax does).
        entries = [None if e is None else str(e) for e in a.sharding.spec]
        while entries and entries[-1] is None:
            entries.pop()
        return entries

    def collectives(hlo):
        return re.findall(r" (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(", hlo)

    norm = rmsnorm_ffi.batched_ffi_op(
        "rmsnorm_fwd",
        lambda x, w, **a: (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32)),
        core_ndims=(1, None))
    attrs = lambda x: dict(eps=np.float32(1e-5), has_weight=True, row_len=np.int64(x.shape[-1]))
    rng = np.random.default_rng(0)
    xn = rng.standard_normal((16, 8, 128)).astype(np.float32)
    wn = np.linspace(0.5, 1.5, 128).astype(np.float32)
    out = {}
    for kind in ("explicit", "automatic"):
        if kind == "explicit":
            mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Explicit,))
        else:
            mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
        for name, spec in (("rows", P("d")), ("second axis", P(None, "d"))):
            with jax.set_mesh(mesh):
                x = jax.device_put(xn, NamedSharding(mesh, spec))
                w = jax.device_put(wn, NamedSharding(mesh, P()))
                f = jax.jit(lambda x: scaled_copy.scaled_copy(x, 2.0))
                g = jax.jit(lambda x, w: norm(x, w, **attrs(x)))
                y = f(x)
                yn, rstd = g(x, w)
                hlo = f.lower(x).compile().as_text() + g.lower(x, w).compile().as_text()
                ref = xn * (2.0 / np.arange(1, 129, dtype=np.float32))
                truth = xn / np.sqrt(np.mean(xn.astype(np.float64) ** 2, -1, keepdims=True) + 1e-5) * wn
                out[f"{kind} {name}"] = dict(
                    collectives=collectives(hlo),
                    calls=len(re.findall(r'custom_call_target="(scaled_copy|rmsnorm_fwd)"', hlo)),
                    error=float(max(np.max(np.abs(np.asarray(y) - ref)), np.max(np.abs(np.asarray(yn) - truth)))),
                    sharding=spec_of(y), norm_sharding=spec_of(yn),
                    shard_rows=[s.data.shape[0] for s in y.addressable_shards],
                )
    print(json.dumps(out))
    """
)


def test_four_devices_explicit_and_automatic_meshes_without_gathers():
    library = bundle_library("scaled_copy")
    result = run_python(
        MESHES.replace("sys.argv[1] if len(sys.argv) > 1 else None", repr(str(library))),
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps(found, indent=1))
    for name, case in found.items():
        assert case["collectives"] == [], (name, case)
        assert case["error"] < 1e-4, (name, case)
        assert case["calls"] == 2, (name, case)  # one call of each op, per shard
    # The results keep the batch sharding of x, on both kinds of mesh, and each device ran its rows.
    for kind in ("explicit", "automatic"):
        assert found[f"{kind} rows"]["sharding"] == found[f"{kind} rows"]["norm_sharding"] == ["d"]
        assert found[f"{kind} second axis"]["sharding"] == found[f"{kind} second axis"]["norm_sharding"] == [None, "d"]
        assert found[f"{kind} rows"]["shard_rows"] == [4, 4, 4, 4]

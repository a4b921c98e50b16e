"""rms_norm on meshes as users build them today: explicit meshes (`jax.make_mesh`'s default, with
`jax.set_mesh`) and automatic ones, over 1, 2 and 4 forced host devices and a 2x2 mesh. Each
case checks the result types, the values against a float64 NumPy reference, and the collectives
in the compiled HLO (no all-gather of x, y, dy or dx; one all-reduce, or a reduce-scatter, for
the weight gradient). Each device count runs in a subprocess: it must be set before JAX starts."""

import json
import textwrap

import pytest
from conftest import run_python

PRELUDE = textwrap.dedent(
    r"""
    import json, re
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from rmsnorm_ffi import rms_norm, rms_norm_reference

    def collectives(fn, *args):
        # Every collective of the compiled HLO: (kind, number of elements of its result).
        hlo = fn.lower(*args).compile().as_text()
        found = []
        for m in re.finditer(r"= \(?([a-z0-9]+)\[([0-9,]*)\][^=]*? (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-start)?\(", hlo):
            dims = [int(d) for d in m.group(2).split(",") if d]
            found.append((m.group(3), int(np.prod(dims)) if dims else 1))
        return found

    def targets(fn, *args):
        # The custom calls of the compiled HLO, by target.
        return re.findall(r'custom_call_target="(rmsnorm_\w+)"', fn.lower(*args).compile().as_text())

    def count(found, kind):
        return sum(1 for k, _ in found if k == kind)

    def truth(x, w, eps, linear=False):
        # float64 NumPy: y, and the gradients of loss = sum(y**2 * c) (linear: sum(y * c)).
        x = np.asarray(x, np.float64); w = np.asarray(w, np.float64)
        n = x.shape[-1]
        r = 1 / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
        y = x * r * w
        c = np.arange(n) / n + 1
        dy = np.broadcast_to(c, y.shape) if linear else 2 * y * c
        g = dy * w
        dx = r * (g - x * r * r * np.mean(g * x, -1, keepdims=True))
        dw = np.sum(dy * x * r, axis=tuple(range(x.ndim - 1)))
        return y, dx, dw

    def rel(a, b):
        a = np.asarray(a, np.float64)
        return float(np.max(np.abs(a - b)) / (1 + np.max(np.abs(b))))

    def case(name, mesh, xshape, xspec, wspec, eps=1e-5, cut=None):
        # cut: rows kept inside the jitted function (uneven shards, automatic meshes only).
        out = {"name": name}
        with jax.set_mesh(mesh):
            rng = np.random.default_rng(0)
            xn = (rng.standard_normal(xshape) + 0.5).astype(np.float32)
            wn = np.linspace(0.5, 1.5, xshape[-1]).astype(np.float32)
            x = jax.device_put(xn, NamedSharding(mesh, xspec))
            w = jax.device_put(wn, NamedSharding(mesh, wspec))
            c = jnp.arange(xshape[-1]) / xshape[-1] + 1
            take = (lambda v: v) if cut is None else (
                lambda v: jax.lax.with_sharding_constraint(v[:cut], NamedSharding(mesh, xspec)))
            fwd = jax.jit(lambda x, w: rms_norm(take(x), w, eps))
            grad = jax.jit(jax.grad(lambda x, w: jnp.sum(rms_norm(take(x), w, eps) ** 2 * c), (0, 1)))
            y = fwd(x, w)
            dx, dw = grad(x, w)
            xt = xn if cut is None else xn[:cut]
            ty, tdx, tdw = truth(xt, wn, eps)
            if cut is not None:
                tdx = np.concatenate([tdx, np.zeros_like(xn[cut:])])
            out.update(
                y_type=str(jax.typeof(y)), x_type=str(jax.typeof(x)),
                dx_type=str(jax.typeof(dx)), dw_type=str(jax.typeof(dw)), w_type=str(jax.typeof(w)),
                y_err=rel(y, ty), dx_err=rel(dx, tdx), dw_err=rel(dw, tdw),
                dx_spec=str(tuple(dx.sharding.spec)), x_spec=str(tuple(x.sharding.spec)),
                fwd=collectives(fwd, x, w), grad=collectives(grad, x, w),
            )
            # A loss linear in y: its gradient does not read y, so XLA drops the forward.
            linear = lambda norm: jax.jit(jax.grad(lambda x, w: jnp.sum(norm(take(x), w, eps) * c), (0, 1)))
            gx, gw = linear(rms_norm)(x, w)
            _, tgx, tgw = truth(xt, wn, eps, linear=True)
            if cut is not None:
                tgx = np.concatenate([tgx, np.zeros_like(xn[cut:])])
            out.update(linear_targets=targets(linear(rms_norm), x, w),
                       linear_err=max(rel(gx, tgx), rel(gw, tgw)), grad_targets=targets(grad, x, w))
            jnp_grad = jax.jit(jax.grad(lambda x, w: jnp.sum(rms_norm_reference(take(x), w, eps) ** 2 * c), (0, 1)))
            if mesh.axis_types[0] == AxisType.Auto:
                out["jnp_grad"] = collectives(jnp_grad, x, w)
        return out
    """
)

FOUR = PRELUDE + textwrap.dedent(
    """
    results = []
    for kind in (AxisType.Explicit, AxisType.Auto):
        m1 = jax.make_mesh((4,), ("data",), axis_types=(kind,))
        m2 = jax.make_mesh((2, 2), ("data", "model"), axis_types=(kind, kind))
        tag = "explicit" if kind == AxisType.Explicit else "auto"
        results += [
            case(f"{tag} rows", m1, (64, 256), P("data", None), P()),
            case(f"{tag} 3-d rows", m2, (8, 8, 128), P("data", "model", None), P()),
            case(f"{tag} 2x2 rows over both", m2, (16, 128), P(("data", "model"), None), P()),
            case(f"{tag} 2x2 rows over data", m2, (16, 128), P("data", None), P()),
            case(f"{tag} 2x2 weight over model", m2, (16, 128), P("data", None), P("model")),
            case(f"{tag} fsdp", m1, (16, 128), P("data", None), P("data")),
            case(f"{tag} last axis sharded", m1, (16, 128), P(None, "data"), P()),
        ]
        if kind == AxisType.Auto:
            results.append(case("auto uneven rows eps=0", m1, (16, 128), P("data", None), P(), eps=0.0, cut=14))
    print("RESULTS" + json.dumps(results))
    """
)


def _results(code, devices):
    result = run_python(code, env={"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(l for l in result.stdout.splitlines() if l.startswith("RESULTS"))
    return {r["name"]: r for r in json.loads(line[len("RESULTS") :])}


@pytest.fixture(scope="module")
def four():
    return _results(FOUR, 4)


def _gathers(found, n=None):
    """The all-gathers of a compiled HLO; with `n`, only those whose result is not n elements
    (a gathered weight or weight gradient is allowed; a gathered x, y, dy or dx is not)."""
    return [size for kind, size in found if kind == "all-gather" and (n is None or size != n)]


def _values_ok(r):
    assert r["y_err"] < 2e-6 and r["dx_err"] < 2e-6 and r["dw_err"] < 2e-6, r
    assert r["linear_err"] < 2e-6, r


def _forward_dropped_when_y_is_unused(r):
    # A gradient that does not read y compiles to the backward alone (its CPU call takes rstd
    # from x); one that reads y keeps the forward.
    assert r["linear_targets"] == ["rmsnorm_bwd"], r
    assert sorted(r["grad_targets"]) == ["rmsnorm_bwd", "rmsnorm_fwd"], r


@pytest.mark.parametrize("tag", ["explicit", "auto"])
def test_rows_sharded_run_per_shard(four, tag):
    r = four[f"{tag} rows"]
    _values_ok(r)
    _forward_dropped_when_y_is_unused(r)
    assert _gathers(r["fwd"]) == [] and _gathers(r["grad"]) == [], r
    # The weight gradient: one all-reduce of n elements.
    assert [c for c in r["grad"] if c[0] == "all-reduce"] == [["all-reduce", 256]], r
    assert r["dx_spec"] == r["x_spec"] == "('data', None)"
    if tag == "explicit":
        assert r["y_type"] == r["x_type"] == r["dx_type"] == "float32[64@data,256]", r
        assert r["dw_type"] == r["w_type"] == "float32[256]", r
    else:
        # The jnp norm compiles to the same collectives.
        assert _gathers(r["jnp_grad"]) == [], r


@pytest.mark.parametrize("tag", ["explicit", "auto"])
@pytest.mark.parametrize("name", ["3-d rows", "2x2 rows over both", "2x2 rows over data"])
def test_two_axis_meshes(four, tag, name):
    r = four[f"{tag} {name}"]
    _values_ok(r)  # rows over data only: dweight summed over data, not over model too
    assert _gathers(r["fwd"]) == [] and _gathers(r["grad"]) == [], r
    assert [c[0] for c in r["grad"]].count("all-reduce") == 1, r
    if tag == "explicit":
        assert r["y_type"] == r["x_type"] == r["dx_type"], r


@pytest.mark.parametrize("tag", ["explicit", "auto"])
def test_sharded_weight_is_gathered_and_its_gradient_reduce_scattered(four, tag):
    fsdp = four[f"{tag} fsdp"]
    _values_ok(fsdp)
    assert _gathers(fsdp["fwd"], n=128) == [] and _gathers(fsdp["grad"], n=128) == [], fsdp
    assert [c[0] for c in fsdp["grad"]].count("reduce-scatter") == 1, fsdp
    assert [c[0] for c in fsdp["grad"]].count("all-reduce") == 0, fsdp
    other = four[f"{tag} 2x2 weight over model"]
    _values_ok(other)
    assert _gathers(other["grad"], n=128) == [], other
    if tag == "explicit":
        assert fsdp["dw_type"] == fsdp["w_type"] == "float32[128@data]", fsdp
        assert other["dw_type"] == other["w_type"] == "float32[128@model]", other


@pytest.mark.parametrize("tag", ["explicit", "auto"])
def test_sharded_last_axis_runs_per_shard_without_gathering_rows(four, tag):
    r = four[f"{tag} last axis sharded"]
    _values_ok(r)
    # Rows split over 4 devices (tests/python/test_hidden_sharding.py has the rest): nothing of
    # x, y, dy or dx is gathered, only the replicated weight's gradient (128 elements); the
    # all-reduces carry one or two floats per row.
    assert _gathers(r["fwd"]) == [] and _gathers(r["grad"], n=128) == [], r
    assert {size for kind, size in r["fwd"] + r["grad"] if kind == "all-reduce"} <= {16, 32}, r
    if tag == "explicit":
        assert r["y_type"] == r["x_type"] == r["dx_type"] == "float32[16,128@data]", r


def test_uneven_rows_keep_padding_out_of_the_weight_gradient(four):
    # 14 rows over 4 devices: XLA pads to 16; with eps=0 a padded zero row has rstd = inf.
    r = four["auto uneven rows eps=0"]
    _values_ok(r)
    # The padded shards' backward reads the masked rstd, so the forward stays.
    assert sorted(r["linear_targets"]) == ["rmsnorm_bwd", "rmsnorm_fwd"], r


SMALL = PRELUDE + textwrap.dedent(
    """
    import sys
    devices = len(jax.devices())
    results = []
    for kind in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((devices,), ("data",), axis_types=(kind,))
        tag = "explicit" if kind == AxisType.Explicit else "auto"
        results.append(case(f"{tag} rows", mesh, (8, 64), P("data", None), P()))
    # Explicit meshes under the transformations a trainer uses: value_and_grad, scan, checkpoint.
    mesh = jax.make_mesh((devices,), ("data",))
    with jax.set_mesh(mesh):
        xs = jax.device_put(jnp.asarray(np.random.default_rng(1).standard_normal((3, 8, 64)) + 0.5, jnp.float32),
                            NamedSharding(mesh, P(None, "data", None)))
        w = jnp.linspace(0.5, 1.5, 64)
        def loss(norm):
            def step(carry, xi):
                h = jax.checkpoint(lambda a, w: norm(a, w))(xi + carry, w)
                return carry + 0.1 * h, jnp.sum(h * h)
            return lambda xs, w: jnp.sum(jax.lax.scan(step, jnp.zeros_like(xs[0]), xs)[1])
        (v, (gx, gw)) = jax.jit(jax.value_and_grad(loss(rms_norm), (0, 1)))(xs, w)
        (v2, (gx2, gw2)) = jax.jit(jax.value_and_grad(loss(rms_norm_reference), (0, 1)))(xs, w)
        results.append({"name": "scan", "v": rel(v, np.asarray(v2, np.float64)), "gx": rel(gx, np.asarray(gx2, np.float64)),
                        "gw": rel(gw, np.asarray(gw2, np.float64)), "gx_type": str(jax.typeof(gx)), "gw_type": str(jax.typeof(gw))})
    print("RESULTS" + json.dumps(results))
    """
)


@pytest.mark.parametrize("devices", [1, 2])
def test_one_and_two_devices(devices):
    results = _results(SMALL, devices)
    for tag in ("explicit", "auto"):
        r = results[f"{tag} rows"]
        _values_ok(r)
        assert _gathers(r["fwd"]) == [] and _gathers(r["grad"]) == [], r
        assert [c[0] for c in r["grad"]].count("all-reduce") == (devices > 1), r
        _forward_dropped_when_y_is_unused(r)
    assert results["explicit rows"]["y_type"] == "float32[8@data,64]"
    scan = results["scan"]
    assert scan["v"] < 1e-6 and scan["gx"] < 1e-5 and scan["gw"] < 1e-5, scan
    assert scan["gx_type"] == "float32[3,8@data,64]" and scan["gw_type"] == "float32[64]", scan

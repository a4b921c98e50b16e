"""The normalized (last) axis sharded over mesh axes (tensor-parallel activations), without
gathering rows: each device sums the squares of its slice, one all-reduce of a float or two
per row crosses the devices that split the rows, and each device normalizes its own slice
with its own slice of the weight (the targets' split passes, `rmsnorm_ffi._split`; sums
shaped (*rows, k)).

On a 1-D mesh (rows split over 2 devices) and a 2x2 mesh (rows sharded over one axis, split
over the other), explicit (`jax.make_mesh` + `jax.set_mesh`) and automatic (jit + NamedSharding),
float32 and bfloat16, without weight, with one, with ``scale_offset=1.0``, and the fused
residual with gradients through both outputs: values and gradients against the same op
unsharded (whole rows, the Rust kernels), and the collectives of the compiled HLO: no
all-gather at all, all-reduces of per-row shapes only (the forward's sums of squares; the
backward's dot products, with the sums of squares beside them when it takes rstd from x), and
on the 2x2 mesh the weight gradient's sum over the row axis. Everything runs in one
subprocess with 4 forced host devices (the count must be set before JAX starts)."""

import json
import textwrap

import pytest
from conftest import run_python

CODE = textwrap.dedent(
    r"""
    import json, re, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from rmsnorm_ffi import rms_norm, rms_norm_bwd, rms_norm_fwd, rms_norm_residual

    if "--gspmd" in sys.argv:
        jax.config.update("jax_use_shardy_partitioner", False)

    GROUPS = {"{{0,1},{2,3}}": "model", "{{0,2},{1,3}}": "data", "{{0,1,2,3}}": "data,model", "{{0,1}}": "model"}

    def mesh_axes(line):
        # The mesh axes a collective runs over, from its replica groups: jax 0.12's HLO names
        # them (mesh['data'=2,'model'=2] {'model'}); 0.10's lists device ids (on these meshes,
        # devices 0-3 in order: model varies fastest).
        m = re.search(r"replica_groups=mesh\[[^\]]*\] \{([^}]*)\}", line)
        if m:
            return ",".join(sorted(a.strip(" '") for a in m.group(1).split(",")))
        m = re.search(r"replica_groups=(\{\{[0-9,{}]*\}\})", line)
        return GROUPS.get(m.group(1), m.group(1)) if m else ""

    def collectives(fn, *args):
        # Every collective of the compiled HLO: [kind, [[dtype, dims], ...], mesh axes].
        hlo = fn.lower(*args).compile().as_text()
        found = []
        for line in hlo.splitlines():
            m = re.search(r"= (.*?) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(", line)
            if m:
                shapes = [[d, [int(s) for s in dims.split(",") if s]]
                          for d, dims in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", m.group(1))]
                found.append([m.group(2), shapes, mesh_axes(line)])
        return found

    def diff(got, want):
        # (max |got - want|, the same over max |want|, the most units in the last place of
        # want's dtype at want that any element is off), in float64.
        info = jnp.finfo(jnp.asarray(want).dtype)
        got, want = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (got, want))
        d = float(np.max(np.abs(got - want)))
        ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(want), float(info.tiny))))) * float(info.eps)
        return [d, d / max(float(np.max(np.abs(want))), 1e-30), float(np.max(np.abs(got - want) / ulp))]

    def data(shape, dtype, offset):
        rng = np.random.default_rng(0)
        n = shape[-1]
        x = (rng.standard_normal(shape) + 0.3).astype(np.float32)
        r = rng.standard_normal(shape).astype(np.float32)
        # With an offset the weight is near 0 (Gemma's zero-centred scale); else near 1.
        w = (np.linspace(-0.5, 0.5, n) if offset else np.linspace(0.5, 1.5, n)).astype(np.float32)
        c = (np.arange(n) / n + 1).astype(np.float32)
        c2 = np.linspace(-1, 2, n).astype(np.float32)
        return [jnp.asarray(a, dtype) for a in (x, r, w)] + [jnp.asarray(c), jnp.asarray(c2)]

    def functions(variant, eps=1e-5):
        # (forward, gradient, gradient of a loss linear in y) of the variant, over (x, r, w).
        weighted = variant != "plain" and variant != "residual plain"
        offset = 1.0 if "offset" in variant else 0.0
        wt = lambda w: w if weighted else None
        f32 = lambda a: a.astype(jnp.float32)
        if variant.startswith("residual"):
            fwd = lambda x, r, w: rms_norm_residual(x, r, wt(w), eps, scale_offset=offset)
            loss = lambda x, r, w, c, c2: (lambda y, h: jnp.sum(f32(y) ** 2 * c) + jnp.sum(f32(h) * c2))(*fwd(x, r, w))
            linear = lambda x, r, w, c, c2: (lambda y, h: jnp.sum(f32(y) * c) + jnp.sum(f32(h) * c2))(*fwd(x, r, w))
            wrt = (0, 1, 2) if weighted else (0, 1)
        else:
            fwd = lambda x, r, w: rms_norm(x, wt(w), eps, scale_offset=offset)
            loss = lambda x, r, w, c, c2: jnp.sum(f32(fwd(x, r, w)) ** 2 * c)
            linear = lambda x, r, w, c, c2: jnp.sum(f32(fwd(x, r, w)) * c)
            wrt = (0, 2) if weighted else (0,)
        return jax.jit(fwd), jax.jit(jax.grad(loss, wrt)), jax.jit(jax.grad(linear, wrt))

    VARIANTS = ("plain", "weight", "offset", "residual offset", "residual plain")
    unsharded = {}

    def case(name, mesh, shape, xspec, wspec, dtype, variant, eps=1e-5, cut=None):
        # cut: (rows, row length) kept inside the jitted functions (shapes that do not divide
        # over the devices, which only an automatic mesh takes: XLA pads them).
        x, r, w, c, c2 = data(shape, dtype, "offset" in variant)
        out = {"name": name}
        fwd, grad, linear = functions(variant, eps)

        def take(f, sharded):
            if cut is None:
                return f
            # Slices inside the function, kept sharded like x: rows ([:cut]) or the row itself.
            keep = lambda v: jax.lax.with_sharding_constraint(v, NamedSharding(mesh, xspec)) if sharded else v
            rows, cols = cut

            def cut_f(x, r, w, *a):
                return f(keep(x[:rows, :cols]), keep(r[:rows, :cols]), w[:cols], *(v[:cols] for v in a))

            return jax.jit(cut_f)

        fwd_c, grad_c, linear_c = (take(f, True) for f in (fwd, grad, linear))
        key = (shape, dtype, variant, eps, cut)
        if key not in unsharded:
            args = (x, r, w, c, c2)
            fwd_u, grad_u, linear_u = (take(f, False) for f in (fwd, grad, linear))
            unsharded[key] = [fwd_u(*args[:3]), grad_u(*args), linear_u(*args)]
        want = unsharded[key]
        with jax.set_mesh(mesh):
            put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
            args = (put(x, xspec), put(r, xspec), put(w, wspec), c, c2)
            got = [fwd_c(*args[:3]), grad_c(*args), linear_c(*args)]
            leaves = lambda t: jax.tree_util.tree_leaves(t)
            out["y"] = [diff(a, b) for a, b in zip(leaves(got[0]), leaves(want[0]))]
            out["grad"] = [diff(a, b) for a, b in zip(got[1], want[1])]
            out["linear"] = [diff(a, b) for a, b in zip(got[2], want[2])]
            out["types"] = [str(jax.typeof(a)) for a in leaves(got[0]) + list(got[1])]
            out["x_type"], out["w_type"] = str(jax.typeof(args[0])), str(jax.typeof(args[2]))
            out["specs"] = [str(tuple(a.sharding.spec)) for a in leaves(got[0]) + list(got[1])]
            out["fwd_hlo"] = collectives(fwd_c, *args[:3])
            out["grad_hlo"] = collectives(grad_c, *args)
            out["linear_hlo"] = collectives(linear_c, *args)
        return out

    results = []
    devices = jax.devices()
    gspmd = "--gspmd" in sys.argv  # a few cases again, partitioned by GSPMD (automatic meshes)
    for kind in (AxisType.Auto,) if gspmd else (AxisType.Explicit, AxisType.Auto):
        tag = "explicit" if kind == AxisType.Explicit else "auto"
        m1 = jax.make_mesh((2,), ("model",), axis_types=(kind,), devices=devices[:2])
        m2 = jax.make_mesh((2, 2), ("data", "model"), axis_types=(kind, kind))
        for dtype in ("float32", "bfloat16"):
            for variant in ("plain", "offset", "residual offset") if gspmd else VARIANTS:
                if not gspmd:
                    results.append(case(f"{tag} 1d {dtype} {variant}", m1, (4, 6, 64),
                                        P(None, None, "model"), P("model"), dtype, variant))
                results.append(case(f"{tag} 2d {dtype} {variant}", m2, (16, 128),
                                    P("data", "model"), P("model"), dtype, variant))
        if gspmd:
            continue
        # A replicated weight is sliced, not moved; its gradient comes back replicated.
        results.append(case(f"{tag} 2d replicated weight", m2, (16, 128), P("data", "model"), P(),
                            "float32", "offset"))
        # x's last axis split over both axes of the 2x2 mesh (4 devices), no row axis sharded.
        results.append(case(f"{tag} 2d hidden over both", m2, (8, 256), P(None, ("data", "model")),
                            P(("data", "model")), "float32", "residual offset"))
    if gspmd:
        print("RESULTS" + json.dumps(results))
        sys.exit(0)
    auto2 = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    # 13 rows over 2 devices are padded to 14, eps=0: the padding's rstd is inf, masked.
    results.append(case("auto 2d uneven rows eps=0", auto2, (16, 128), P("data", "model"), P("model"),
                        "float32", "offset", eps=0.0, cut=(13, 128)))
    # A row of 66 over 4 devices does not divide: gathered, as before.
    results.append(case("auto uneven row", auto2, (8, 68), P(None, ("data", "model")), P(),
                        "float32", "weight", cut=(8, 66)))
    print("RESULTS" + json.dumps(results))
    """
)

EXTRA = textwrap.dedent(
    r"""
    # rms_norm_bwd called directly (eps unknown: rstd read, one float per row all-reduced) and
    # a vmapped norm with per-example weights (a batched weight, split like x's last axis).
    m2 = jax.make_mesh((2, 2), ("data", "model"))
    extra = []
    rng = np.random.default_rng(1)
    x, _, w, c, _ = data((16, 128), "float32", True)
    dy = jnp.asarray(rng.standard_normal((16, 128)), jnp.float32)
    bwd = jax.jit(lambda x, w, dy: rms_norm_bwd(x, w, rms_norm_fwd(x, w, scale_offset=1.0)[1], dy, scale_offset=1.0))
    want = bwd(x, w, dy)
    with jax.set_mesh(m2):
        put = lambda a, s: jax.device_put(a, NamedSharding(m2, s))
        args = (put(x, P("data", "model")), put(w, P("model")), put(dy, P("data", "model")))
        got = bwd(*args)
        extra.append({"name": "explicit rms_norm_bwd", "grad": [diff(a, b) for a, b in zip(got, want)],
                      "types": [str(jax.typeof(a)) for a in got], "hlo": collectives(bwd, *args)})
    auto2 = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    xb = jnp.asarray(rng.standard_normal((4, 8, 64)) + 0.3, jnp.float32)
    wb = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    loss = lambda x, w: jnp.sum(jax.vmap(lambda x, w: rms_norm(x, w, scale_offset=1.0))(x, w) ** 2 * c[:64])
    g = jax.jit(jax.grad(loss, (0, 1)))
    want = g(xb, wb)
    with jax.set_mesh(auto2):
        args = (jax.device_put(xb, NamedSharding(auto2, P("data", None, "model"))),
                jax.device_put(wb, NamedSharding(auto2, P("data", "model"))))
        got = g(*args)
        extra.append({"name": "auto vmap batched weight", "grad": [diff(a, b) for a, b in zip(got, want)],
                      "hlo": collectives(g, *args)})
    print("EXTRA" + json.dumps(extra))
    """
)


def _run(args=""):
    code = CODE + EXTRA
    if args:
        code = "import sys; sys.argv += " + repr(args.split()) + "\n" + code
    result = run_python(code, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    found = {}
    for line in result.stdout.splitlines():
        for prefix in ("RESULTS", "EXTRA"):
            if line.startswith(prefix):
                found.update({r["name"]: r for r in json.loads(line[len(prefix):])})
    return found


@pytest.fixture(scope="module")
def found():
    return _run()


def _kinds(hlo):
    return [kind for kind, _, _ in hlo]


def _reduces(hlo):
    """The all-reduces' operand shapes, e.g. [[8, 1], [8, 2], [64]] (several for a combined one)."""
    return [dims for kind, shapes, _ in hlo if kind == "all-reduce" for _, dims in shapes]


# float32: max |sharded - unsharded| / max |unsharded| per output. Measured (jax 0.10.2 and
# 0.12.0.1): at most 9.5e-7 (dx without weight, where the row's terms cancel; y 1.7e-7): each
# device's sums are rounded to float32 before the all-reduce adds them, where the whole-row
# kernel rounds its float64 total once. bfloat16: at most 1 ulp of each element (the same
# float32 differences put a few elements on the other side of a bfloat16 rounding boundary:
# with jnp's split rows, which matched the kernels' arithmetic operation for operation, 1 ulp
# at small magnitudes only; with the split passes, 1 ulp anywhere, 2.2e-4 of the largest).
TOL = {"float32": 1.5e-6}
ULPS = {"bfloat16": 1.0}

VARIANTS = ("plain", "weight", "offset", "residual offset", "residual plain")


def _close(r, dtype):
    for what in ("y", "grad", "linear"):
        for _, rel, ulps in r[what]:
            if dtype in ULPS:
                assert ulps <= ULPS[dtype], (what, r[what], r["name"])
            else:
                assert rel <= TOL[dtype], (what, r[what], r["name"])


def _check(r, tag, mesh, dtype, variant):
    """Values, collectives and result shardings of one case of the main matrix."""
    _close(r, dtype)
    weighted = variant not in ("plain", "residual plain")
    # One float per local row: (4, 6) rows whole on each of 2 devices, or 8 of 16 rows.
    rows = [4, 6] if mesh == "1d" else [8]
    n_local = 32 if mesh == "1d" else 64
    for hlo in (r["fwd_hlo"], r["grad_hlo"], r["linear_hlo"]):
        # Nothing gathered (not x, y, dy, dx, nor the weight or its gradient), nothing else.
        assert set(_kinds(hlo)) <= {"all-reduce"}, r
    # The forward: one all-reduce, of each row's sum of squares.
    assert _reduces(r["fwd_hlo"]) == [rows + [1]], r
    # A loss that reads y: the forward's, then the backward's dot products with the sums of
    # squares beside them (rows x 2); on the 2x2 mesh, the weight gradient's local slice
    # summed over the rows' axis (data).
    dweight = [[n_local]] if weighted and mesh == "2d" else []
    assert sorted(_reduces(r["grad_hlo"])) == sorted([rows + [1], rows + [2]] + dweight), r
    assert len(r["grad_hlo"]) == 2 + len(dweight), r
    # A loss linear in y: the backward alone (rstd from x), one all-reduce for the rows.
    assert sorted(_reduces(r["linear_hlo"])) == sorted([rows + [2]] + dweight), r
    # Row sums cross the devices that split the rows (model), the weight gradient those that
    # shard them (data).
    for _, shapes, axes in r["fwd_hlo"] + r["grad_hlo"] + r["linear_hlo"]:
        assert axes == ("data" if shapes[0][1] == [n_local] and mesh == "2d" else "model"), r
    # y, h, dx, d residual sharded like x; dweight like the weight (its slices, over model).
    x_spec = "(None, None, 'model')" if mesh == "1d" else "('data', 'model')"
    x_like = len(r["specs"]) - weighted
    assert r["specs"][:x_like] == [x_spec] * x_like, r
    if weighted:
        assert r["specs"][-1] == "('model',)", r
    if tag == "explicit":
        assert r["types"][:x_like] == [r["x_type"]] * x_like, r
        assert r["x_type"].endswith("64@model]" if mesh == "1d" else "128@model]"), r
        if weighted:
            assert r["types"][-1] == r["w_type"], r


@pytest.mark.parametrize("tag", ["explicit", "auto"])
@pytest.mark.parametrize("mesh", ["1d", "2d"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_values_gradients_and_collectives(found, tag, mesh, dtype, variant):
    _check(found[f"{tag} {mesh} {dtype} {variant}"], tag, mesh, dtype, variant)


def test_replicated_weight_is_sliced_and_only_its_gradient_gathered(found):
    for tag in ("explicit", "auto"):
        r = found[f"{tag} 2d replicated weight"]
        _close(r, "float32")
        assert _kinds(r["fwd_hlo"]) == ["all-reduce"], r
        # The gradient comes back replicated, like the weight: its two 64-element slices are
        # gathered (128 elements), nothing else.
        gathers = [shapes for kind, shapes, _ in r["grad_hlo"] + r["linear_hlo"] if kind == "all-gather"]
        assert gathers == [[["f32", [128]]]] * 2, r
        assert sorted(_reduces(r["grad_hlo"])) == [[8, 1], [8, 2], [64]], r


def test_rows_split_over_both_axes_of_a_2x2_mesh(found):
    for tag in ("explicit", "auto"):
        r = found[f"{tag} 2d hidden over both"]
        _close(r, "float32")
        assert set(_kinds(r["fwd_hlo"] + r["grad_hlo"])) == {"all-reduce"}, r
        assert _reduces(r["fwd_hlo"]) == [[8, 1]], r
        assert sorted(_reduces(r["grad_hlo"])) == [[8, 1], [8, 2]], r
        assert all(axes == "data,model" for _, _, axes in r["grad_hlo"]), r
        assert r["specs"][-1] == "(('data', 'model'),)", r


def test_rows_that_do_not_divide_are_masked(found):
    # 13 rows over data: padded to 14; eps=0 makes the padding row's rstd inf.
    r = found["auto 2d uneven rows eps=0"]
    _close(r, "float32")
    # The padded shards' backward reads the forward's (masked) rstd: one float per row each.
    assert sorted(_reduces(r["grad_hlo"])) == [[7, 1], [7, 1], [64]], r
    # XLA moves whole rows to realign the 13 (a permute, and a gather of the result's rows
    # for its output layout): never the split row axis.
    for kind, shapes, _ in r["fwd_hlo"] + r["grad_hlo"]:
        if kind != "all-reduce":
            assert shapes[0][1][-1] == 64, r


def test_a_row_that_does_not_divide_is_gathered(found):
    # 66 over 4 devices: gathered and normalized whole, as before the split path.
    r = found["auto uneven row"]
    _close(r, "float32")
    assert "all-gather" in _kinds(r["fwd_hlo"]), r


def test_direct_backward_and_a_batched_weight(found):
    r = found["explicit rms_norm_bwd"]
    assert all(rel <= TOL["float32"] for _, rel, _ in r["grad"]), r
    assert r["types"] == ["float32[16@data,128@model]", "float32[128@model]"], r
    # rms_norm_bwd's rstd is given (not known to be the forward's of x): its forward's sums of
    # squares, then its own dot products alone, and dweight over data.
    assert set(_kinds(r["hlo"])) == {"all-reduce"}, r
    assert sorted(_reduces(r["hlo"])) == [[8, 1], [8, 1], [64]], r
    # vmap over (x, weight): a batched weight (4, 64) split over model like x's rows.
    r = found["auto vmap batched weight"]
    assert all(rel <= TOL["float32"] for _, rel, _ in r["grad"]), r
    assert set(_kinds(r["hlo"])) == {"all-reduce"}, r
    assert sorted(_reduces(r["hlo"])) == [[2, 8, 1], [2, 8, 2]], r


def test_gspmd_partitioner():
    """The automatic 2x2 cases again with Shardy off: GSPMD's `infer_sharding_from_operands`."""
    found = _run("--gspmd")
    assert len(found) == 6, sorted(found)
    for name, r in found.items():
        tag, mesh, dtype, variant = name.split(" ", 3)
        _check(r, tag, mesh, dtype, variant)

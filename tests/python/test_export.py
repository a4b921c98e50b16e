"""jax.export round trips: exported with `rmsnorm_ffi.export_checks()`, serialized, and run by a
fresh process that registers the targets with `rmsnorm_ffi.deserialize`; a fresh process that
does not register gets XLA's "No FFI handler" error, as the README says. A program sharded on an
explicit mesh exports; one on an automatic mesh raises a ValueError saying why it cannot."""

import textwrap

from conftest import run_python

EXPORT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import rmsnorm_ffi
    from rmsnorm_ffi import rms_norm
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 64)) + 0.5, jnp.float32)
    w = jnp.linspace(0.5, 1.5, 64)
    loss = lambda x, w: jnp.sum(rms_norm(x, w) ** 2 * jnp.arange(64.0))
    step = jax.jit(jax.value_and_grad(loss, (0, 1)))
    exp = rmsnorm_ffi.export(step)(x, w)
    open(sys.argv[1], "wb").write(exp.serialize())
    np.save(sys.argv[1] + ".want.npy", np.concatenate([np.ravel(a) for a in jax.tree.leaves(step(x, w))]))
    # The same through jax.export directly, with the checks from export_checks().
    jax.export.export(step, disabled_checks=rmsnorm_ffi.export_checks())(x, w)
    mesh = jax.make_mesh((4,), ("data",))  # Explicit axes by default
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
        sharded = rmsnorm_ffi.export(jax.jit(jax.grad(loss, (0, 1))))(xs, w)
        assert sharded.nr_devices == 4
        open(sys.argv[1] + ".sharded", "wb").write(sharded.serialize())
    auto = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(auto):
        xa = jax.device_put(x, NamedSharding(auto, P("data", None)))
        try:
            rmsnorm_ffi.export(jax.jit(rms_norm))(xa, jnp.linspace(0.5, 1.5, 64))
        except ValueError as e:
            assert "custom_partitioning" in str(e) and "explicit mesh" in str(e), e
            print("auto: refused")
    print("exported")
    """
)

RUN = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import rmsnorm_ffi
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 64)) + 0.5, jnp.float32)
    w = jnp.linspace(0.5, 1.5, 64)
    blob = open(sys.argv[1], "rb").read()
    if sys.argv[2] == "plain":
        jax.export.deserialize(blob).call(x, w)  # nothing registered: fails
    exp = rmsnorm_ffi.deserialize(blob)
    got = np.concatenate([np.ravel(a) for a in jax.tree.leaves(exp.call(x, w))])
    assert np.array_equal(got, np.load(sys.argv[1] + ".want.npy")), "results differ"
    from jax.sharding import NamedSharding, PartitionSpec as P
    sharded = rmsnorm_ffi.deserialize(open(sys.argv[1] + ".sharded", "rb").read())
    mesh = jax.make_mesh((4,), ("data",))
    with jax.set_mesh(mesh):
        gx, gw = sharded.call(jax.device_put(x, NamedSharding(mesh, P("data", None))), w)
    np.testing.assert_allclose(np.concatenate([np.ravel(gx), np.ravel(gw)]), got[1:], rtol=1e-5, atol=1e-5)
    print("ran", rmsnorm_ffi.stats()["executions"])
    """
)

DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}


def _run(code, *args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, **DEVICES})


def test_export_round_trip_in_a_fresh_process(tmp_path):
    path = str(tmp_path / "step.bin")
    made = _run(EXPORT, path)
    assert made.returncode == 0, made.stderr[-3000:]
    assert made.stdout.split() == ["auto:", "refused", "exported"]
    ran = _run(RUN, path, "registered")
    assert ran.returncode == 0, ran.stderr[-3000:]
    # One call on one device, then one per device of the sharded program.
    assert "'rmsnorm_bwd': 5" in ran.stdout, ran.stdout
    plain = _run(RUN, path, "plain")
    assert plain.returncode != 0 and "rmsnorm_fwd" in plain.stderr, plain.stderr[-2000:]


def test_gradient_only_programs_export_for_one_platform_or_several():
    # The VJP's backward is platform-dependent (CPU takes rstd from x; CUDA reads it): exported
    # for the CPU alone, a gradient-only program holds the backward alone; exported for CPU
    # and CUDA, it holds both forms behind JAX's platform switch. Both run here, with the bits
    # of the program jitted here, and so does rms_norm_bwd's form, which reads rstd.
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np

    import rmsnorm_ffi

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((8, 64)) + 0.5, jnp.float32)
    w, dy = jnp.linspace(0.5, 1.5, 64), jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
    pullback = jax.jit(lambda x, w, dy: jax.vjp(rmsnorm_ffi.rms_norm, x, w)[1](dy))
    want = pullback(x, w, dy)
    for platforms, targets in ((("cpu",), ["rmsnorm_bwd"]), (("cpu", "cuda"), ["rmsnorm_bwd", "rmsnorm_fwd"])):
        exp = rmsnorm_ffi.export(pullback, platforms=platforms)(x, w, dy)
        assert sorted(set(re.findall(r"@(rmsnorm_\w+)", exp.mlir_module()))) == targets, platforms
        got = rmsnorm_ffi.deserialize(exp.serialize()).call(x, w, dy)
        assert all(np.array_equal(np.asarray(g), np.asarray(v)) for g, v in zip(got, want)), platforms
    _, rstd = rmsnorm_ffi.rms_norm_fwd(x, w)
    given = rmsnorm_ffi.export(jax.jit(rmsnorm_ffi.rms_norm_bwd))(x, w, rstd, dy)
    got = rmsnorm_ffi.deserialize(given.serialize()).call(x, w, rstd, dy)
    assert all(np.array_equal(np.asarray(g), np.asarray(v)) for g, v in zip(got, want))

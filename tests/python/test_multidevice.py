"""rms_norm across 4 forced host devices: shard_map (forward and gradients, the shared weight's
gradient summed over shards), pmap, and jit with a sharded input. Runs in a subprocess: the
device count must be set before JAX starts."""

import textwrap

from conftest import run_python

CODE = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import rmsnorm_ffi
    from rmsnorm_ffi import rms_norm, rms_norm_reference
    assert len(jax.devices()) == 4
    mesh = Mesh(np.array(jax.devices()), ("d",))
    x = jax.device_put(jax.random.normal(jax.random.key(0), (64, 256)), NamedSharding(mesh, P("d")))
    w = jnp.linspace(0.5, 1.5, 256)
    sm = lambda f: jax.shard_map(f, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"))
    close = lambda a, b: float(jnp.abs(a - b).max() / (1 + jnp.abs(b).max()))
    want = rms_norm_reference(x, w)
    f = jax.jit(sm(rms_norm))
    for _ in range(20):
        assert close(f(x, w), want) < 1e-6
    weights = jnp.arange(256.0)
    loss = lambda x, w: jnp.sum(sm(rms_norm)(x, w) ** 2 * weights)
    ref = lambda x, w: jnp.sum(rms_norm_reference(x, w) ** 2 * weights)
    got, exp = jax.jit(jax.grad(loss, (0, 1)))(x, w), jax.grad(ref, (0, 1))(x, w)
    assert all(close(a, b) < 1e-5 for a, b in zip(got, exp)), [close(a, b) for a, b in zip(got, exp)]
    xs = x.reshape(4, 16, 256)
    assert close(jax.pmap(lambda x: rms_norm(x, w))(xs), rms_norm_reference(xs, w)) < 1e-6
    assert close(jax.jit(rms_norm)(x, w), want) < 1e-6
    g = jax.jit(jax.grad(lambda x, w: jnp.sum(rms_norm(x, w) ** 2 * weights), (0, 1)))(x, w)
    assert all(close(a, b) < 1e-5 for a, b in zip(g, exp))
    del f
    jax.clear_caches()
    import gc; gc.collect()
    print("ok", rmsnorm_ffi.stats()["executions"]["rmsnorm_fwd"] >= 80)
    """
)


def test_multi_device_host():
    result = run_python(CODE, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["ok", "True"]

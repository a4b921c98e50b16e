"""Registration: lazy, idempotent, thread-safe, independent of when the backend starts, and of
the product only (examples and test fixtures are libraries a user process never registers)."""

import textwrap

import pytest

from conftest import bundle_library, run_python

import rmsnorm_ffi
from rmsnorm_ffi import _native


def check_in_subprocess(code):
    result = run_python(textwrap.dedent(code))
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


def test_import_registers_nothing():
    out = check_in_subprocess(
        """
        import rmsnorm_ffi
        from rmsnorm_ffi import _native
        print(rmsnorm_ffi.registered_platforms(), sorted(set(_native.type_ids().values())))
        """
    )
    assert out.strip() == "() [0]"


@pytest.mark.parametrize("backend_first", [True, False], ids=["backend-started-first", "register-first"])
@pytest.mark.parametrize("library_first", [True, False], ids=["library-first", "extension-first"])
def test_register_works_whether_or_not_backend_started(backend_first, library_first):
    # Both stateful: the extension's rms_norm and the scaled_copy library's target, registered
    # in either order, before or after the backend started.
    start = "jax.devices()" if backend_first else "pass"
    steps = ["print(rmsnorm_ffi.register_library(LIB))", "print(rmsnorm_ffi.register())"]
    first, second = steps if library_first else steps[::-1]
    out = check_in_subprocess(
        f"""
        import jax, jax.numpy as jnp, numpy as np
        {start}
        import rmsnorm_ffi
        LIB = {str(bundle_library("scaled_copy"))!r}
        {first}
        {second}
        call = jax.ffi.ffi_call("scaled_copy", jax.ShapeDtypeStruct((2, 3), jnp.float32))
        y = jax.jit(lambda x: call(x, scale=np.float32(3.0), row_len=np.int64(3)))(jnp.ones((2, 3), jnp.float32))
        np.testing.assert_allclose(np.asarray(y), np.tile([3.0, 1.5, 1.0], (2, 1)), rtol=1e-6)
        x = jnp.ones((2, 3), jnp.float32)
        np.testing.assert_allclose(np.asarray(rmsnorm_ffi.rms_norm(x)), np.asarray(rmsnorm_ffi.rms_norm_reference(x)), rtol=1e-6)
        print("ok")
        """
    )
    expected = ["('scaled_copy', 'ema_update')", "('cpu',)"]
    assert out.splitlines() == (expected if library_first else expected[::-1]) + ["ok"]


def test_register_is_idempotent_and_thread_safe():
    out = check_in_subprocess(
        """
        import threading
        import rmsnorm_ffi
        from rmsnorm_ffi import _native
        barrier = threading.Barrier(8)
        results, errors = [], []
        def go():
            barrier.wait()
            try:
                results.append(rmsnorm_ffi.register())
            except Exception as e:
                errors.append(e)
        threads = [threading.Thread(target=go) for _ in range(8)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert not errors, errors
        assert set(results) == {("cpu",)}, results
        ids = _native.type_ids()
        assert all(v > 0 for v in ids.values()), ids
        assert rmsnorm_ffi.register() == ("cpu",)
        assert _native.type_ids() == ids
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_a_user_process_registers_only_the_products_targets():
    contract = _native.contract()
    # Every platform has a bundle for every target of the contract.
    targets = {contract[k] for k in ("forward_target", "backward_target", "residual_target")}
    for platform in ("cpu", "cuda"):
        regs = _native.registrations(platform)
        assert set(regs) == targets, platform
        for stages in regs.values():
            assert "instantiate" in stages and "execute" in stages
            for capsule in stages.values():
                assert type(capsule).__name__ == "PyCapsule"
    assert set(_native.state_types("cpu")) == {"rmsnorm_ffi.RmsNormForwardState", "rmsnorm_ffi.RmsNormBackwardState"}
    for entry in _native.state_types("cpu").values():
        assert set(entry) == {"type_id", "type_info"}
    # The table register() reads has the same bundles, one per target and platform.
    product = _native.product()
    assert sorted((b["platform"], b["target"]) for b in product["bundles"]) == sorted(
        (p, t) for p in ("cpu", "cuda") for t in targets
    )
    # And in a fresh process, after register(), XLA knows no fixture or example target.
    out = check_in_subprocess(
        """
        import rmsnorm_ffi
        from jax._src.lib import xla_client
        rmsnorm_ffi.register()
        print(sorted(t for t in xla_client.custom_call_targets("cpu") if "rmsnorm" in t))
        """
    )
    assert out.strip() == str(sorted(targets))


def test_unknown_platform_is_a_clear_error():
    with pytest.raises(ValueError, match="unsupported platform `tpu`"):
        _native.registrations("tpu")


def test_stats_has_the_contract_keys():
    rmsnorm_ffi.register()
    s = rmsnorm_ffi.stats()
    for key in ("live_states", "created_states", "destroyed_states", "workspace_bytes", "workspace_allocations"):
        assert isinstance(s[key], int), key
    assert isinstance(s["executions"], dict)
    assert s["live_states"] == s["created_states"] - s["destroyed_states"]


def test_cuda_bundles_are_registered_under_xlas_platform_name():
    # jax keys its registration handlers by XLA's platform names ("CUDA"); a handler registered
    # under any other name ("cuda") waits in jax's pending list for a platform that never comes.
    # The first run on an H200 failed that way on every call ("No FFI handler registered for
    # rmsnorm_fwd on a platform CUDA"). Here, with the CUDA backend taken as available (this
    # machine has none, so nothing leaves the pending list), every CUDA state type and target
    # must wait under "CUDA".
    code = """
from jax._src.lib import xla_client
from rmsnorm_ffi import _native, _registration
assert 'cuda' in _native.platforms(), _native.platforms()
_registration._platform_available = lambda platform: True
assert 'cuda' in _registration.register()
targets = {k: [n for n, *_ in v] for k, v in xla_client._custom_callback.items()}
types = {k: [n for n, *_ in v] for k, v in xla_client._custom_type_id.items()}
assert 'cuda' not in targets and 'cuda' not in types, (targets, types)
assert {'rmsnorm_fwd', 'rmsnorm_bwd', 'rmsnorm_residual_fwd'} <= set(targets.get('CUDA', [])), targets
assert any('Gpu' in name for name in types.get('CUDA', [])), types
print('ok')
"""
    result = run_python(code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]

"""Registration: lazy, idempotent, thread-safe, and independent of when the backend starts."""

import textwrap

import pytest

from conftest import run_python

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
def test_register_works_whether_or_not_backend_started(backend_first):
    start = "jax.devices()" if backend_first else "pass"
    out = check_in_subprocess(
        f"""
        import jax, jax.numpy as jnp, numpy as np
        {start}
        import rmsnorm_ffi
        from rmsnorm_ffi.examples import scaled_copy
        print(rmsnorm_ffi.register())
        y = jax.jit(lambda x: scaled_copy(x, 3.0))(jnp.ones((2, 3), jnp.float32))
        np.testing.assert_allclose(np.asarray(y), np.tile([3.0, 1.5, 1.0], (2, 1)), rtol=1e-6)
        print("ok")
        """
    )
    assert out.split() == ["('cpu',)", "ok"]


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


def test_registrations_expose_every_stage_as_capsules():
    regs = _native.registrations("cpu")
    assert set(regs["rmsnorm_ffi_scaled_copy"]) == {"instantiate", "execute"}
    assert set(regs["rmsnorm_ffi_testing_stages"]) == {"instantiate", "prepare", "initialize", "execute"}
    assert set(regs["rmsnorm_ffi_testing_context"]) == {"execute"}
    for stages in regs.values():
        for capsule in stages.values():
            assert type(capsule).__name__ == "PyCapsule"
    types = _native.state_types("cpu")
    assert "rmsnorm_ffi.ScaledCopyState" in types
    for entry in types.values():
        assert set(entry) == {"type_id", "type_info"}


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

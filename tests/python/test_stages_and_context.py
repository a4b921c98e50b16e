"""Which stages XLA:CPU runs, and what the execution context offers, seen from real XLA through
the test fixtures' library (registered with `rmsnorm_ffi.register_library`)."""

import pathlib
import re
import textwrap

import jax
import numpy as np
import pytest

from rmsnorm_ffi import _native, rms_norm, rms_norm_reference

import testing_bundles as testing
from conftest import run_python


def test_stage_counts_on_cpu(fresh_caches):
    f = jax.jit(lambda: testing.stage_counts())
    counts = [np.asarray(f()).tolist() for _ in range(3)]
    # Instantiate ran once for the call site; execute once per call. XLA:CPU (jaxlib 0.10.2)
    # does not run the prepare and initialize stages; a runtime that does would count here.
    assert [c[0] for c in counts] == [1, 1, 1]
    assert [c[3] for c in counts] == [1, 2, 3]
    assert counts[-1][1] in (0, 3) and counts[-1][2] in (0, 3)


def test_context_probe():
    num_threads, device_ordinal, run_id, task_ran, *_ = np.asarray(jax.jit(testing.context_probe)()).tolist()
    assert num_threads >= 1
    assert device_ordinal == 0
    assert task_ran == 1, "a task scheduled on XLA's thread pool ran"
    assert run_id >= 0


def header_api_version() -> tuple[int, int]:
    """The XLA FFI API version of the installed jaxlib's header."""
    header = (pathlib.Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h").read_text()
    major, minor = (int(re.search(rf"#define XLA_FFI_API_{part} (\d+)", header).group(1)) for part in ("MAJOR", "MINOR"))
    return major, minor


def test_the_installed_runtime_runs_our_handlers_at_the_newest_api_both_speak():
    # Our handlers report at registration (the metadata answer) the newest API both they and
    # the runtime speak: 0.3 to jax 0.10.2's runtime, 0.5 to jax 0.12's (make python-test-new),
    # which would refuse a newer one. The runtime accepted them, ran the library's handler and
    # the extension's, and says which it is. _native.XLA_FFI_API_VERSION is the oldest the
    # handlers run on.
    assert _native.XLA_FFI_API_VERSION == (0, 3)
    probe = np.asarray(jax.jit(testing.context_probe)()).tolist()
    runtime, reported = tuple(probe[4:6]), probe[8]
    assert runtime == header_api_version(), (runtime, jax.__version__)
    assert runtime[0] == 0 and runtime[1] >= 3
    assert reported == (5 if runtime[1] >= 5 else 3), (reported, runtime)
    x = np.linspace(-2, 2, 24, dtype=np.float32).reshape(3, 8)
    np.testing.assert_allclose(np.asarray(jax.jit(rms_norm)(x)), np.asarray(rms_norm_reference(x)), rtol=1e-6)


def test_what_api_0_5_offers_a_handler_on_cpu(tmp_path):
    # A 0.5 runtime (jax 0.12.0.1) answers the extension lookup and the custom options: JAX
    # passes no options (an empty dictionary), and XLA:CPU attaches no collectives extension
    # (129), on one device or on each of two under shard_map; a 0.3 runtime has neither (-1).
    # If a later jaxlib attaches one on CPU, this test says so and the note in
    # crates/xla-ffi-bundles/src/ffi/collectives.rs must change with it.
    out = run_python(
        textwrap.dedent(
            """
            import os, sys
            os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
            sys.path.insert(0, %r)
            import jax, jax.numpy as jnp, numpy as np
            from jax.sharding import PartitionSpec as P
            import testing_bundles as testing
            one = np.asarray(jax.jit(testing.context_probe)()).tolist()
            mesh = jax.make_mesh((2,), ("d",))
            per_shard = jax.jit(jax.shard_map(lambda: testing.context_probe(), mesh=mesh, in_specs=(),
                                              out_specs=P("d")))
            both = np.asarray(per_shard()).reshape(2, 9).tolist()
            print(one[5], [one[6:8]] + [row[6:8] for row in both])
            """
        ) % str(pathlib.Path(__file__).parent)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    minor, seen = out.stdout.strip().split(" ", 1)
    expected = [0, 0] if int(minor) >= 5 else [0, -1]
    assert seen == str([expected] * 3), out.stdout


def test_user_data_on_cpu_is_xla_s_not_found_for_a_registered_type():
    # The library declares its user-data type (`.user_data::<T>()`), so register_library gave
    # it to XLA with an id (else the context's "not registered" error would come first); JAX
    # attaches no user data a handler can name, so XLA's own lookup answers "not found", as an
    # error of the call, and the process lives on.
    with pytest.raises(Exception) as failure:
        np.asarray(testing.ask_context("user_data"))
    message = str(failure.value)
    assert "rmsnorm_ffi_testing_stage_state: [execute] no user data of type `rmsnorm_ffi.testing.ProbeUserData`" in message
    assert re.search(r"User data with type id [1-9]\d* not found in execution context", message), message
    assert "not registered" not in message


def test_a_prepare_stage_state_is_refused_on_cpu_not_a_crash():
    # XLA:CPU keeps no prepare- or initialize-stage state; its State_Get for them dereferences
    # a null pointer (SIGSEGV, docs/xla-runtime.md). The context refuses first.
    with pytest.raises(Exception) as failure:
        np.asarray(testing.ask_context("prepare_state"))
    message = str(failure.value)
    assert "cannot get the prepare-stage state: XLA keeps none for this bundle (XLA:CPU runs no prepare or initialize stage" in message, message
    # The process is fine: the extension's own op still runs.
    x = np.linspace(-2, 2, 24, dtype=np.float32).reshape(3, 8)
    np.testing.assert_allclose(np.asarray(jax.jit(rms_norm)(x)), np.asarray(rms_norm_reference(x)), rtol=1e-6)

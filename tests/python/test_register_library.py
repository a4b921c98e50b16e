"""`rmsnorm_ffi.register_library(path)`: its errors, idempotence and thread safety.

The happy paths run on the libraries this repo builds on the crate (the counter example in
test_example_bundle.py; the test fixtures, with several bundles, in test_stages_and_context.py
and elsewhere). The refusals need libraries that are wrong in one way each; the ones that are
not Rust are small C files compiled here: one without the symbol, one whose table comes from
another version of the crate, and tables whose names collide with names already taken (their
handlers are never called: the collision is found before XLA is asked).
"""

import shutil
import subprocess
import textwrap

import pytest

from conftest import bundle_library, run_python

import rmsnorm_ffi
from rmsnorm_ffi import _native


def compile_c(tmp_path, name: str, source: str):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("a C compiler is needed (the ABI test needs one too)")
    src = tmp_path / f"{name}.c"
    src.write_text(textwrap.dedent(source))
    out = tmp_path / f"lib{name}.so"
    build = subprocess.run([cc, "-shared", "-fPIC", "-std=c11", "-Wall", "-Werror", str(src), "-o", str(out)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return out


# The layout of `rmsnorm_ffi::ffi::export::LibraryExport` (repr(C)), written out in C.
TABLE_C = """
#include <stddef.h>
#include <stdint.h>
typedef struct {{ uint8_t magic[8]; uint32_t abi_version; uint32_t struct_size; const char* crate_version; }} Header;
typedef void* (*Handler)(void*);
typedef struct {{ Handler instantiate, prepare, initialize, execute; }} Handlers;
typedef struct {{ const char* target; const char* platform; uint32_t traits; Handlers handlers; int64_t state_type; }} Bundle;
typedef struct {{ const char* name; int64_t* type_id; const void* type_info; }} StateType;
typedef struct {{
    Header header; const char* error; int32_t xla_api_major, xla_api_minor;
    const Bundle* bundles; size_t bundle_count; const StateType* state_types; size_t state_type_count;
    const char* (*attach_registry)(const void*);
}} Table;
static void* never_called(void* frame) {{ (void)frame; return 0; }}
static const char* attach(const void* hooks) {{ (void)hooks; return 0; }}
static int64_t type_id = 0;
static const struct {{ size_t struct_size; void* extension_start; void* deleter; }} type_info = {{ 24, 0, 0 }};
static const StateType types[] = {{ {{ "{state_type}", &type_id, &type_info }} }};
static const Bundle bundles[] = {{
    {{ "{target}", "cpu", 0, {{ {instantiate}, 0, 0, never_called }}, {state_index} }},
}};
static const Table table = {{
    {{ {{'R','M','S','N','F','F','I',0}}, {abi_version}, sizeof(Table), "{crate_version}" }},
    0, 0, 3, bundles, 1, types, {state_count}, attach,
}};
const Table* xla_ffi_bundles_library(void) {{ return &table; }}
"""


def table_library(tmp_path, name, *, target, state_type=None, abi_version=None, crate_version="0.1.0"):
    return compile_c(
        tmp_path,
        name,
        TABLE_C.format(
            target=target,
            state_type=state_type or "unused",
            instantiate="never_called" if state_type else "0",
            state_index=0 if state_type else -1,
            state_count=1 if state_type else 0,
            abi_version=_native.LIBRARY_ABI_VERSION if abi_version is None else abi_version,
            crate_version=crate_version,
        ),
    )


def test_a_missing_file_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"register_library: no such file: .*nothing\.so"):
        rmsnorm_ffi.register_library(tmp_path / "nothing.so")


def test_a_file_that_is_no_shared_library_is_refused(tmp_path):
    text = tmp_path / "notes.so"
    text.write_text("not an ELF file")
    with pytest.raises(ValueError, match=r"notes\.so cannot be loaded as a shared library"):
        rmsnorm_ffi.register_library(text)


def test_a_library_without_the_table_is_not_a_bundle_library(tmp_path):
    lib = compile_c(tmp_path, "plain", "int answer(void) { return 42; }\n")
    with pytest.raises(ValueError, match=r"libplain\.so is not a bundle library: it exports no `xla_ffi_bundles_library`"):
        rmsnorm_ffi.register_library(lib)


def test_a_library_built_against_another_version_is_refused_naming_both(tmp_path):
    lib = table_library(tmp_path, "future", target="future_op", abi_version=999, crate_version="9.0.0")
    ours = _native.FRAMEWORK_VERSION
    with pytest.raises(ValueError) as info:
        rmsnorm_ffi.register_library(lib)
    message = str(info.value)
    assert f"was built against xla-ffi-bundles 9.0.0 (library table version 999)" in message
    assert f"this xla-ffi-bundles {ours} (table version {_native.LIBRARY_ABI_VERSION}) cannot read" in message
    assert f"rebuild the library against xla-ffi-bundles {ours}" in message


def test_a_target_of_the_extension_cannot_be_taken(tmp_path):
    lib = table_library(tmp_path, "squatter", target=_native.contract()["forward_target"])
    with pytest.raises(ValueError, match=r"already registered by someone else: target `rmsnorm_fwd` \(platform cpu\) by rmsnorm_ffi itself"):
        rmsnorm_ffi.register_library(lib)
    # The extension's own registration is untouched.
    assert rmsnorm_ffi.register() == ("cpu",)


def test_a_state_type_name_of_another_library_cannot_be_taken(tmp_path):
    counter = bundle_library("counter_bundle")
    rmsnorm_ffi.register_library(counter)
    lib = table_library(tmp_path, "clash", target="clash_unique_target", state_type="counter_bundle.CounterState")
    with pytest.raises(ValueError) as info:
        rmsnorm_ffi.register_library(lib)
    message = str(info.value)
    assert f"state type `counter_bundle.CounterState` by {counter.resolve()}" in message
    assert "clash_unique_target" not in message, "its target is free"
    assert "namespaces its names" in message


def test_a_copy_of_a_registered_library_collides_on_every_name(tmp_path):
    counter = bundle_library("counter_bundle")
    rmsnorm_ffi.register_library(counter)
    copy = tmp_path / "libcounter_copy.so"
    shutil.copy(counter, copy)
    with pytest.raises(ValueError) as info:
        rmsnorm_ffi.register_library(copy)
    message = str(info.value)
    assert f"state type `counter_bundle.CounterState` by {counter.resolve()}" in message
    assert f"target `counter_bundle_counter` (platform cpu) by {counter.resolve()}" in message


def test_a_name_registered_outside_rmsnorm_ffi_is_refused_by_xla_and_explained():
    # A fresh process, where someone registered the counter's state type name with jax.ffi
    # directly: rmsnorm_ffi does not know, XLA does, and its error comes back explained.
    result = run_python(
        textwrap.dedent(
            f"""
            import ctypes, jax, rmsnorm_ffi
            jax.devices()
            cell = ctypes.c_int64(0)
            jax.ffi.register_ffi_type("counter_bundle.CounterState", {{"type_id": jax.ffi.pycapsule(ctypes.addressof(cell))}}, platform="cpu")
            try:
                rmsnorm_ffi.register_library({str(bundle_library("counter_bundle"))!r})
            except ValueError as e:
                print("REFUSED", e)
            """
        )
    )
    assert result.returncode == 0, result.stderr
    assert "REFUSED" in result.stdout, result.stdout
    assert "XLA refused state type `counter_bundle.CounterState`" in result.stdout
    assert "already registered with type id" in result.stdout


def test_registration_from_many_threads_at_once_registers_once():
    result = run_python(
        textwrap.dedent(
            f"""
            import threading, jax, rmsnorm_ffi
            path = {str(bundle_library("counter_bundle"))!r}
            barrier = threading.Barrier(8)
            results, errors = [], []
            def go():
                barrier.wait()
                try:
                    results.append(rmsnorm_ffi.register_library(path))
                except Exception as e:
                    errors.append(e)
            threads = [threading.Thread(target=go) for _ in range(8)]
            [t.start() for t in threads]
            [t.join() for t in threads]
            assert not errors, errors
            assert set(results) == {{("counter_bundle_counter",)}}, results
            assert list(rmsnorm_ffi.registered_libraries().values()) == [("counter_bundle_counter",)]
            print("ok")
            """
        )
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "ok"


def test_stats_counts_every_library_with_one_id_sequence(fresh_caches):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import testing_bundles
    from conftest import live_states_of

    counter_path = bundle_library("counter_bundle")
    counter_target = rmsnorm_ffi.register_library(counter_path)[0]
    scaled = rmsnorm_ffi.register_library(bundle_library("scaled_copy"))[0]
    testing_bundles.register()
    counter = jax.ffi.ffi_call(counter_target, jax.ShapeDtypeStruct((), jnp.int64), has_side_effect=True)
    copy = jax.ffi.ffi_call(scaled, jax.ShapeDtypeStruct((2, 4), jnp.float32))

    @jax.jit
    def three_libraries_and_the_extension(x):
        c = counter(start=np.int64(0), step=np.int64(1))
        y = copy(x, scale=np.float32(2.0), row_len=np.int64(4))
        return c, y, testing_bundles.stage_counts(), rmsnorm_ffi.rms_norm(x)

    before = rmsnorm_ffi.stats()
    for _ in range(3):
        jax.block_until_ready(three_libraries_and_the_extension(jnp.ones((2, 4), jnp.float32)))
    after = rmsnorm_ffi.stats()
    targets = [counter_target, scaled, "rmsnorm_ffi_testing_stages", "rmsnorm_fwd"]
    for target in targets:
        assert after["executions"][target] - before["executions"].get(target, 0) == 3, target
        assert [s["executions"] for s in live_states_of(target)] == [3], target
    ids = [s["id"] for s in after["states"]]
    assert len(ids) == len(set(ids)) == after["live_states"] >= 4
    assert after["created_states"] - before["created_states"] == 4
    del three_libraries_and_the_extension
    jax.clear_caches()
    import gc

    gc.collect()
    final = rmsnorm_ffi.stats()
    assert final["live_states"] == 0, final["states"]
    assert final["created_states"] == final["destroyed_states"]


def test_a_library_state_takes_a_python_float_shows_its_details_and_tags_its_errors(fresh_caches):
    """Issue 44's newcomer: a Python float for an `f32` attribute (exact ones are taken, others
    refused naming the fix), `LiveState::set_detail` of a library's state in `stats()`, and an
    error a library's stage returns tagged with the stage like decode errors."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import testing_bundles
    from conftest import live_states_of

    testing_bundles.register()
    target = "rmsnorm_ffi_testing_reverse"
    x = jnp.arange(8, dtype=jnp.float32).reshape(2, 4)

    def reverse(x, scale, row_len=4):
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))
        return call(x, row_len=np.int64(row_len), scale=scale, variant="pooled")

    half = jax.jit(lambda x: reverse(x, 0.5))  # a Python float: an F64 attribute
    np.testing.assert_array_equal(half(x), 0.5 * np.asarray(x)[:, ::-1])
    [state] = live_states_of(target)  # alive while `half`'s executable is
    assert state["details"] == {"variant": "pooled", "scale": "0.5"}
    del half

    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        jax.jit(lambda x: reverse(x, 0.1))(x)
    assert "expected F32 scalar, got F64 scalar 0.1, which F32 cannot hold exactly: pass np.float32(0.1)" \
        in str(info.value)

    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        jax.block_until_ready(jax.jit(lambda x: reverse(x, np.float32(2), row_len=3))(x))
    assert f"{target}: [execute] argument 0: expected a last axis of 3" in str(info.value)

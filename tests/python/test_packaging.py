"""The framework and the extension as a user outside this repository gets them.

1. ``cargo package -p xla-ffi-bundles`` makes the crate that would be published; a new bundle
   crate, copied from ``templates/bundle-crate`` into a temporary directory outside the
   workspace, depends on the *unpacked package* (not the workspace path) and builds.
2. The abi3 wheel (``make wheel``, target/wheels/) installs into a fresh virtual environment
   whose PATH has no cargo or rustc, and there ``rms_norm`` runs under ``jit`` and ``grad``,
   ``stats()`` answers, and ``register_library`` registers the library built in 1 (one cargo
   build for both), whose target runs under ``jit`` and whose state ``stats()`` counts.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import textwrap
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "templates" / "bundle-crate"
FRAMEWORK = "xla-ffi-bundles"
TEMPLATE_DEPENDENCY = f'{FRAMEWORK} = {{ path = "../../crates/{FRAMEWORK}" }}'


def run(args, **kwargs):
    result = subprocess.run(args, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, args))}:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def framework_version():
    for line in (REPO / "crates" / FRAMEWORK / "Cargo.toml").read_text().splitlines():
        if line.startswith("version = "):
            return line.split('"')[1]
    raise AssertionError("no version in the framework's Cargo.toml")


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """A directory outside the workspace (pytest's temporary directories are under /tmp)."""
    path = tmp_path_factory.mktemp("outside")
    assert REPO not in path.resolve().parents
    return path


@pytest.fixture(scope="module")
def template_library(outside):
    """The template crate built against the packaged framework; the path of its library."""
    if shutil.which("cargo") is None:
        pytest.fail("cargo is needed to package the framework and build the template")
    package_dir = outside / "package"
    # --no-verify: the template's build below is the verification (a build of the unpacked
    # package as a dependency), and --allow-dirty lets a working tree with changes run it.
    run(["cargo", "package", "-p", FRAMEWORK, "--allow-dirty", "--no-verify", "--quiet",
         "--target-dir", str(package_dir)], cwd=REPO, timeout=600)
    crate_file = package_dir / "package" / f"{FRAMEWORK}-{framework_version()}.crate"
    assert crate_file.is_file(), sorted(p.name for p in (package_dir / "package").iterdir())
    with tarfile.open(crate_file) as archive:
        archive.extractall(outside / "unpacked", filter="data")
    unpacked = outside / "unpacked" / f"{FRAMEWORK}-{framework_version()}"
    assert (unpacked / "Cargo.toml").is_file() and (unpacked / "src" / "lib.rs").is_file()
    # What was packaged: the framework alone, with its licence and front page.
    assert (unpacked / "README.md").is_file() and (unpacked / "LICENSE").is_file()
    assert not (unpacked / "tests" / "cuda_emulator").exists()

    crate = outside / "my_ops"
    shutil.copytree(TEMPLATE, crate)
    manifest = crate / "Cargo.toml"
    text = manifest.read_text()
    # The form the template ships (a path into a checkout, which the copy no longer sits in),
    # rewritten as the docs tell a user to: a path to the unpacked package.
    assert TEMPLATE_DEPENDENCY in text and "\n[workspace]\n" in text
    manifest.write_text(text.replace(TEMPLATE_DEPENDENCY, f'{FRAMEWORK} = {{ path = "{unpacked}" }}'))
    # The workspace's lock file pins the same versions of the framework's dependencies that
    # the repository was tested with (and that cargo has fetched already).
    shutil.copy(REPO / "Cargo.lock", crate / "Cargo.lock")
    start = time.monotonic()
    # --offline: the lock file pins what the workspace built with, already in cargo's cache.
    run(["cargo", "build", "--release", "--quiet", "--offline"], cwd=crate, timeout=900,
        env=dict(os.environ, CARGO_TARGET_DIR=str(crate / "target")))
    print(f"template crate built in {time.monotonic() - start:.0f} s")
    library = crate / "target" / "release" / "libmy_ops.so"
    assert library.is_file()
    return library


def test_no_doc_tells_an_outside_crate_to_depend_on_a_registry_version():
    # The crate is on no registry yet: `xla-ffi-bundles = "0.x"` would fail for a newcomer
    # (issue 44). Every dependency line shown is a path or git form.
    docs = [REPO / "crates" / FRAMEWORK / "README.md", REPO / "docs" / "bundles.md", TEMPLATE / "Cargo.toml",
            REPO / "README.md"]
    for doc in docs:
        for line in doc.read_text().splitlines():
            text = line.lstrip("# ")
            if text.startswith(f"{FRAMEWORK} = "):
                assert "path =" in text or "git =" in text, f"{doc}: {line}"
    # The template's own form builds where it is: it points at this checkout's framework.
    assert (TEMPLATE / TEMPLATE_DEPENDENCY.split('"')[1] / "Cargo.toml").resolve() == \
        REPO / "crates" / FRAMEWORK / "Cargo.toml"


def wheel_file():
    wheels = sorted((REPO / "target" / "wheels").glob("rmsnorm_ffi-*-abi3-*.whl"))
    assert wheels, "no abi3 wheel in target/wheels: run `make wheel`"
    return wheels[-1]


def test_the_template_builds_outside_the_workspace_against_the_packaged_crate(template_library):
    # Its table names the framework's version; the symbol is the framework's.
    symbols = run(["nm", "-D", "--defined-only", str(template_library)]).stdout
    assert "xla_ffi_bundles_library" in symbols


# The user's session in the fresh environment: nothing from this repository but the wheel and
# the library built from the template.
USER_SCRIPT = textwrap.dedent("""
    import gc, shutil, sys
    import jax, jax.numpy as jnp, numpy as np
    import rmsnorm_ffi

    assert shutil.which("cargo") is None and shutil.which("rustc") is None, "Rust on PATH"
    assert "site-packages" in rmsnorm_ffi.__file__, rmsnorm_ffi.__file__

    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 128)), jnp.float32)
    w = jnp.linspace(0.5, 1.5, 128, dtype=jnp.float32)
    def reference(x, w):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * w
    y = jax.jit(rmsnorm_ffi.rms_norm)(x, w)
    np.testing.assert_allclose(y, reference(x, w), rtol=1e-5, atol=1e-5)
    loss = lambda f: (lambda x, w: jnp.sum(jnp.sin(f(x, w))))
    g = jax.jit(jax.grad(loss(rmsnorm_ffi.rms_norm), argnums=(0, 1)))(x, w)
    want = jax.grad(loss(reference), argnums=(0, 1))(x, w)
    for a, b in zip(g, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)

    print("registered", rmsnorm_ffi.register_library(sys.argv[1]))
    call = jax.ffi.ffi_call("my_ops_scale", jax.ShapeDtypeStruct(x.shape, x.dtype))
    scale = jax.jit(lambda x: call(x, scale=np.float32(2.0), row_len=np.int64(x.shape[-1])))
    np.testing.assert_allclose(scale(x), x * (2.0 / np.arange(1, 129, dtype=np.float32)), rtol=1e-6)
    scale(x)
    stats = rmsnorm_ffi.stats()
    mine = [s for s in stats["states"] if s["target"] == "my_ops_scale"]
    assert len(mine) == 1 and mine[0]["type"] == "my_ops.ScaleState", stats["states"]
    assert stats["executions"]["my_ops_scale"] == 2, stats["executions"]
    assert stats["executions"]["rmsnorm_fwd"] >= 2
    assert mine[0]["details"] == {"row_len": "128"}, mine  # a library state's set_detail
    del scale; jax.clear_caches(); gc.collect()
    assert not [s for s in rmsnorm_ffi.stats()["states"] if s["target"] == "my_ops_scale"]

    # The template's buffers are typed with their rank: a rank-3 x is refused at decode, naming
    # the argument (a Python float for its f32 scale is taken: 2.0 is exact in F32).
    cube = jax.ffi.ffi_call("my_ops_scale", jax.ShapeDtypeStruct((2, 4, 128), x.dtype))
    try:
        jax.block_until_ready(cube(x.reshape(2, 4, 128), scale=2.0, row_len=np.int64(128)))
        raise AssertionError("a rank-3 argument was taken")
    except jax.errors.JaxRuntimeError as e:
        assert ("my_ops_scale: [execute] failed to decode the call frame: argument 0: expected F32 buffer "
                "of rank 2, got F32 buffer of rank 3") in str(e), e

    # The in-place target: acc updated over its own buffer; donated, the output is acc's buffer.
    add = jax.ffi.ffi_call("my_ops_scale_add", jax.ShapeDtypeStruct(x.shape, x.dtype), input_output_aliases={0: 0})
    step = jax.jit(lambda acc, x: add(acc, x, scale=2.0, row_len=np.int64(128)), donate_argnums=0)
    acc = jnp.ones_like(x)
    pointer = acc.unsafe_buffer_pointer()
    out = step(acc, x)
    assert out.unsafe_buffer_pointer() == pointer
    np.testing.assert_allclose(out, 1.0 + x * (2.0 / np.arange(1, 129, dtype=np.float32)), rtol=1e-6)
    print("OK")
""")


def test_the_wheel_installs_and_runs_without_rust(template_library, outside):
    wheel = wheel_file()
    venv = outside / "venv"
    start = time.monotonic()
    run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    python = venv / "bin" / "python"
    # The wheel and its dependencies as a user's pip resolves them (jax at the version this
    # environment tests, from pip's cache when it has it).
    import jax

    run([str(python), "-m", "pip", "install", "--quiet", str(wheel), f"jax=={jax.__version__}"], timeout=900)
    installed = time.monotonic() - start
    # No Rust toolchain on PATH: the venv, and the system's directories (cargo lives in ~/.cargo).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CARGO", "RUSTUP", "PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), "/usr/local/bin", "/usr/bin", "/bin"])
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run([str(python), "-c", USER_SCRIPT, str(template_library)], capture_output=True,
                            text=True, timeout=600, env=env, cwd=outside)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-5000:]
    assert "registered ('my_ops_scale', 'my_ops_scale_add')" in result.stdout and result.stdout.strip().endswith("OK"), result.stdout
    print(f"wheel {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB): venv and install {installed:.0f} s, "
          f"the session {time.monotonic() - start - installed:.0f} s")

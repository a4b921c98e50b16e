# The two commands of the README: `make demo` and `make test`. Both set everything up in .venv/
# from a fresh clone and are safe to run again; `make test` also sets up .venv-new/ (below).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEPS := $(VENV)/.deps-installed

# Both ends of the supported jax range: .venv/ has the oldest (requirements-dev.txt: jax 0.10.2 on
# Python 3.11), .venv-new/ the newest (requirements-new.txt: jax 0.12.0.1, which needs Python 3.12).
# PYTHON_NEW is pyenv's 3.12 (`pyenv prefix 3.12`, else $(PYENV_ROOT)/versions/3.12*, else a
# python3.12 on PATH that runs; pyenv's shim does not unless 3.12 is selected); override it with
# `make test PYTHON_NEW=/path/to/python3.12`.
PYENV_ROOT ?= $(HOME)/.pyenv
PYTHON_NEW ?= $(shell for py in \
	"$$( ($$(command -v pyenv || echo $(PYENV_ROOT)/bin/pyenv) prefix 3.12) 2>/dev/null | head -1)/bin/python3.12" \
	$(PYENV_ROOT)/versions/3.12*/bin/python3.12 python3.12; do \
	"$$py" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { command -v "$$py"; break; }; done)
VENV_NEW := .venv-new
PY_NEW := $(VENV_NEW)/bin/python
DEPS_NEW := $(VENV_NEW)/.deps-installed
# `make wheel`: the abi3 wheel (one file for every CPython >= 3.11 on this platform), which
# installs without Rust; python-test-new and tests/python/test_packaging.py install it.
WHEEL_DIR := target/wheels

.PHONY: demo stateful-demo bundles counter-bundle sanitize loom memcheck test bench develop wheel \
	rust-test python-test python-test-new gpu-emulate gpu-sanitize gpu-traffic gpu-traffic-docs clean

$(DEPS): requirements-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $(DEPS)

$(DEPS_NEW): requirements-new.txt pyproject.toml
	@test -x $(PY_NEW) || test -n "$(PYTHON_NEW)" || { echo "$(VENV_NEW): no Python 3.12 found" \
		"(tried pyenv prefix 3.12, $(PYENV_ROOT)/versions/3.12*/bin/python3.12, python3.12 on PATH);" \
		"install one (pyenv install 3.12) or pass PYTHON_NEW=/path/to/python3.12" >&2; exit 1; }
	test -x $(PY_NEW) || $(PYTHON_NEW) -m venv $(VENV_NEW)
	$(PY_NEW) -m pip install --quiet --upgrade pip
	$(PY_NEW) -m pip install --quiet -r requirements-new.txt
	touch $(DEPS_NEW)

# Builds the Rust extension (release) into .venv; cargo makes this quick when nothing changed.
develop: $(DEPS)
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --release --quiet

# Teaches a small transformer 3-digit addition with rmsnorm_ffi.RMSNorm and with flax's jnp norm,
# on one device and data-parallel on 2 forced host devices (explicit mesh); prints held-out answers,
# accuracies, losses, speed, the state story and the norm's time, and writes the loss and accuracy
# curves to DEMO_PLOT (matplotlib, installed here as `make bench` does). Training takes 100-170 s
# on a shared 2-core machine.
DEMO_PLOT ?= target/demo/train.png
demo: develop
	$(PY) -m pip install --quiet matplotlib
	$(PY) examples/train.py --devices 2 --plot $(DEMO_PLOT)

# The scaled_copy example library end to end: states per call site, threads, no allocation after
# warm-up.
stateful-demo: develop bundles
	$(PY) examples/scaled_copy/demo.py

# The shared libraries built on the crate that this repo ships, workspace members registered with
# rmsnorm_ffi.register_library: the two examples of bundles in crates of their own and the test
# fixtures (tests/fixtures/testing_bundles, which no user process registers). Built in the
# `bundles` profile, so they land in target/bundles/: building them also builds this crate's
# cdylib without the `python` feature, which in target/release would replace the extension that
# `maturin develop` copies from there.
BUNDLE_PACKAGES := counter_bundle scaled_copy rmsnorm_ffi_testing
bundles:
	cargo build --profile bundles --quiet $(addprefix -p ,$(BUNDLE_PACKAGES))

counter-bundle: bundles

# RMSNORM_FFI_SITE_PACKAGES: where pip put nvidia-cuda-nvrtc/-nvcc, for tests/gpu_kernels.rs and
# tests/gpu_emulated.rs (NVRTC compiles the real kernels there too).
# XLA_FFI_INCLUDE_DIRS: the XLA FFI headers of both ends of the jax range (API 0.3 and 0.5), for
# tests/abi_layout.rs.
# (`make test` makes .venv-new/ first; `make rust-test` alone checks the headers that exist.)
# `cargo test` here means the framework and the op (default-members); then the framework's docs
# must build without a warning (its front page is a doctest; `#![deny(missing_docs)]`).
# tests/gpu_emulated.rs (left out of a plain `cargo test`, see Cargo.toml) runs beside the rest,
# its output printed after theirs: it is mostly one core for 6-8 minutes, the rest (NVRTC's
# compiles, the fuzzed frames) use the other. Both are built first, with both cores.
SITE_PACKAGES = RMSNORM_FFI_SITE_PACKAGES="$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rust-test: $(DEPS)
	cargo test --features fake-runtime --no-run --quiet
	cargo test --features fake-runtime --test gpu_emulated --no-run --quiet
	@mkdir -p target; \
	$(SITE_PACKAGES) cargo test --features fake-runtime --test gpu_emulated > target/gpu_emulated.log 2>&1 & \
	emulated=$$!; \
	XLA_FFI_INCLUDE_DIRS="$$($(PY) -c 'import jax.ffi; print(jax.ffi.include_dir())')$$(test -x $(PY_NEW) && \
		$(PY_NEW) -c 'import jax.ffi; print(":" + jax.ffi.include_dir())')" \
	$(SITE_PACKAGES) cargo test --features fake-runtime; status=$$?; \
	wait $$emulated || status=1; \
	echo "== tests/gpu_emulated.rs (ran beside the tests above)"; cat target/gpu_emulated.log; \
	exit $$status
	RUSTDOCFLAGS="-D warnings" cargo doc --quiet --no-deps -p xla-ffi-bundles --features python,fake-runtime

# The CUDA path without a GPU, alone (rust-test runs it too): the real GPU bundles through the
# fake XLA runtime, the product's driver layer loading the fake libcuda of tests/cuda_emulator,
# NVRTC from pip compiling the kernels, the kernels themselves (rmsnorm.cu as host C++) on the
# CPU emulator; the planted bugs; the fake's checks. 6-8 minutes on 2 cores (both norms; measured
# 376-470 s on this VM in stop 53, 509 s beside the rest of rust-test in stop 54).
gpu-emulate: $(DEPS)
	$(SITE_PACKAGES) cargo test --features fake-runtime --test gpu_emulated

# The emulated kernels under AddressSanitizer+UBSan (full sweep) and ThreadSanitizer (a subset,
# and a planted race it must report), in a standalone C++ harness: TSan cannot see through the
# uninstrumented Rust host; LayerNorm's kernels a sample. Two lanes at once (each build and run
# is one process): 267 s in a fresh clone's make test on this VM in stop 54 (the sweep's lane
# 223 s, the other 266 s; 684 s one lane at a time in stop 53).
gpu-sanitize:
	tests/cuda_emulator/sanitize.sh target/gpu-sanitize

# Every kernel's memory traffic, sector efficiency, access widths, ptxas registers and
# occupancy, measured on the emulator (a standalone g++ build, no cargo), and the predicted
# fraction of an H200's bandwidth (docs/gpu-traffic.md: the table and the model). Fails when a
# kernel misses a target, and checks that three planted regressions fail it. 60-90 s on 2
# cores. gpu-traffic-docs writes the tables into docs/ (commit docs/gpu-traffic-plans.txt with
# any launch-plan change: plan.rs's unit test reads it).
gpu-traffic: $(DEPS)
	$(PY) tests/cuda_emulator/traffic.py --out target/gpu-traffic

gpu-traffic-docs: $(DEPS)
	$(PY) tests/cuda_emulator/traffic.py --out target/gpu-traffic --update-docs

# AddressSanitizer with LeakSanitizer on the unit tests, the fuzzed call frames, the fixtures'
# and the registry hooks' tests: an invalid read or write that happens not to crash, a use after
# free, a leak. Needs nightly Rust (part of these machines' image; Rust's sanitizers are
# nightly-only); its instrumented build lives in target/x86_64-unknown-linux-gnu/ and never
# replaces the normal one. Fewer fuzzed cases than the plain run, which does 3000 per property.
# Skipped, saying so, without a nightly toolchain. Threads get 8 MiB stacks (Rust's test threads
# have 2): in this unoptimized, instrumented build the AVX-512 forward, whose loops are all
# `#[inline(always)]` into one closure, takes a frame of about 2.3 MB (every inlined temporary
# its own slot with redzones); release builds share those slots.
SANITIZE_TESTS := -p rmsnorm_ffi -p xla-ffi-bundles --lib --test fuzz_frames --test fixture_bundles --test registry_hooks
sanitize:
	@if ! cargo +nightly --version >/dev/null 2>&1; then \
		echo "sanitize: no nightly Rust toolchain (rustup toolchain install nightly), skipped"; exit 0; fi; \
	RUST_MIN_STACK=8388608 RUSTFLAGS=-Zsanitizer=address ASAN_OPTIONS=detect_leaks=1 PROPTEST_CASES=1000 \
		cargo +nightly test --quiet --target x86_64-unknown-linux-gnu --features fake-runtime $(SANITIZE_TESTS)

# Model checking of ffi::parallel's job slots with loom (feature `loom`: its models of the atomics,
# the fence, Arc and UnsafeCell replace std's in that module, for these tests only; the tests say
# what they prove and what they do not). ThreadSanitizer would be the other tool, and Rust's does
# not run here (it needs an instrumented std).
loom:
	cargo test --quiet -p xla-ffi-bundles --features fake-runtime,loom --lib loom_tests

# The fuzzed call frames again under valgrind's memcheck (fewer cases: it runs ~50x slower), for
# what AddressSanitizer cannot see: a branch or a copy that depends on uninitialised memory (ASan
# checks addresses, not whether the bytes there were ever written). Leaks are LeakSanitizer's
# (`make sanitize`). Skipped, saying so, where valgrind is not installed.
memcheck: $(DEPS)
	@if ! command -v valgrind >/dev/null; then echo "memcheck: valgrind not installed, skipped"; exit 0; fi; \
	bin=$$(cargo test --features fake-runtime --test fuzz_frames --no-run 2>&1 | grep -o 'target/[a-z]*/deps/fuzz_frames-[0-9a-f]*' | head -1); \
	test -n "$$bin" || { echo "memcheck: no fuzz_frames test binary"; exit 1; }; \
	PROPTEST_CASES=150 valgrind --quiet --leak-check=no --undef-value-errors=yes --error-exitcode=99 $$bin --test-threads=1

# The abi3 wheel, built with .venv's interpreter after `maturin develop` (same features and
# profile: cargo has nothing left to compile).
wheel: develop
	rm -rf $(WHEEL_DIR)
	$(VENV)/bin/maturin build --release --quiet --interpreter $(PY) --out $(WHEEL_DIR)

python-test: develop bundles wheel
	$(PY) -m pytest -q tests/python

# The tests that ask the newest jax something the oldest could answer differently, run in
# .venv-new/ (1038 tests in 203 s here on 2 cores): the op, its contract and its Flax modules,
# registration of the extension and of libraries built on the crate (the FFI runtime is API 0.5
# there, our handlers report 0.3), in-place updates (test_in_place.py), errors and the bad-input matrix, the stage and state contract, threads, devices,
# and every file on sharding, AD, export or distributed running, present and future (the globs).
# The general stress harness's API tests too (about 40 s: it AOT-compiles, clears JAX's caches
# under other threads and reads JAX's errors, which each jax may do its own way). Left to .venv/
# alone: the README, demo, bench and our norm's stress runs (minutes, and about our scripts
# rather than jax). The extension is the abi3 wheel built with .venv's interpreter: `maturin
# develop` for a 3.12 venv would rebuild pyo3 and the crate (about 25 s, and again for .venv after
# it); this way cargo has nothing to do. The bundle libraries need no Python: the same files.
NEW_STACK_TESTS = $(sort $(wildcard $(addprefix tests/python/, test_rmsnorm.py test_flax.py \
	test_contract.py test_variants.py test_axes.py test_equinox.py test_layer_norm.py test_multidevice.py test_errors.py test_bad_inputs.py test_registration.py \
	test_register_library.py test_example_bundle.py test_attributes.py test_batched_op.py test_in_place.py \
	test_stages_and_context.py test_stateful.py test_concurrency.py test_stress_api.py test_batching.py test_*sharding*.py test_ad*.py \
	test_*_ad.py test_*_ad_*.py test_*export*.py test_*distributed*.py)))

python-test-new: $(DEPS) $(DEPS_NEW) bundles wheel
	$(PY_NEW) -m pip install --quiet --no-deps --force-reinstall $(WHEEL_DIR)/*.whl
	$(PY_NEW) -m pytest -q $(NEW_STACK_TESTS)

test: $(DEPS_NEW) rust-test gpu-sanitize gpu-traffic sanitize loom memcheck python-test python-test-new

# The benchmark suite: a table of times and ratios, the accuracy sweep to rows of 2^26 (about 6 GB,
# 2.5 minutes; BENCH_ARGS=--no-accuracy skips it), bench/out/results.json and a PNG plot.
# BENCH_ARGS passes options to bench/bench.py (the README test uses `--quick --out DIR`).
bench: develop
	$(PY) -m pip install --quiet matplotlib
	$(PY) bench/bench.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VENV_NEW) target

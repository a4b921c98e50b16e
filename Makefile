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
WHEEL_NEW := target/wheel-new

.PHONY: demo stateful-demo counter-bundle memcheck test bench develop rust-test python-test \
	python-test-new gpu-emulate gpu-sanitize clean

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

# The scaled_copy bundle end to end: states per call site, threads, no allocation after warm-up.
stateful-demo: develop
	$(PY) examples/stateful_demo.py

# The example of a bundle in a crate of its own (examples/counter_bundle). Its own target folder:
# building it there also builds this crate's cdylib without the `python` feature, and in target/
# that file would replace the extension `maturin develop` copies from target/release.
counter-bundle:
	CARGO_TARGET_DIR=target/counter_bundle cargo build --release --quiet --manifest-path examples/counter_bundle/Cargo.toml

# RMSNORM_FFI_SITE_PACKAGES: where pip put nvidia-cuda-nvrtc/-nvcc, for tests/gpu_kernels.rs and
# tests/gpu_emulated.rs (NVRTC compiles the real kernels there too).
SITE_PACKAGES = RMSNORM_FFI_SITE_PACKAGES="$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rust-test: $(DEPS)
	XLA_FFI_INCLUDE_DIR="$$($(PY) -c 'import jax.ffi; print(jax.ffi.include_dir())')" \
	$(SITE_PACKAGES) cargo test --features fake-runtime

# The CUDA path without a GPU, alone (rust-test runs it too): the real GPU bundles through the
# fake XLA runtime, the product's driver layer loading the fake libcuda of tests/cuda_emulator,
# NVRTC from pip compiling the kernels, the kernels themselves (rmsnorm.cu as host C++) on the
# CPU emulator; the planted bugs; the fake's checks. About 2 minutes on 2 cores.
gpu-emulate: $(DEPS)
	$(SITE_PACKAGES) cargo test --features fake-runtime --test gpu_emulated

# The emulated kernels under AddressSanitizer+UBSan (full sweep) and ThreadSanitizer (a subset,
# and a planted race it must report), in a standalone C++ harness: TSan cannot see through the
# uninstrumented Rust host. About 3 minutes on 2 cores.
gpu-sanitize:
	tests/cuda_emulator/sanitize.sh target/gpu-sanitize

# The fuzzed call frames again under valgrind's memcheck (fewer cases: it runs ~50x slower), so
# an invalid read or write that happens not to crash still fails the run. Skipped, saying so,
# where valgrind is not installed.
memcheck: $(DEPS)
	@if ! command -v valgrind >/dev/null; then echo "memcheck: valgrind not installed, skipped"; exit 0; fi; \
	bin=$$(cargo test --features fake-runtime --test fuzz_frames --no-run 2>&1 | grep -o 'target/[a-z]*/deps/fuzz_frames-[0-9a-f]*' | head -1); \
	test -n "$$bin" || { echo "memcheck: no fuzz_frames test binary"; exit 1; }; \
	PROPTEST_CASES=150 valgrind --quiet --error-exitcode=99 $$bin --test-threads=1

python-test: develop counter-bundle
	$(PY) -m pytest -q tests/python

# The tests that ask the newest jax something the oldest could answer differently, run in
# .venv-new/ (about 80 s): the op and its Flax modules, registration, errors and the bad-input
# matrix (the FFI runtime is API 0.5 there), the stage and state contract, threads, devices, and
# every file on sharding, AD, export or distributed running, present and future (the globs).
# Left to .venv/ alone: the README, demo, bench and stress tests (minutes, and about our scripts
# rather than jax) and the counter_bundle example (a cargo build of its own). The extension is the
# abi3 wheel built with .venv's interpreter: `maturin develop` for a 3.12 venv would rebuild pyo3
# and the crate (about 25 s, and again for .venv after it); this way cargo has nothing to do.
NEW_STACK_TESTS = $(sort $(wildcard $(addprefix tests/python/, test_rmsnorm.py test_flax.py \
	test_multidevice.py test_errors.py test_bad_inputs.py test_registration.py test_attributes.py \
	test_stages_and_context.py test_stateful.py test_concurrency.py test_batching.py test_*sharding*.py test_ad*.py \
	test_*_ad.py test_*_ad_*.py test_*export*.py test_*distributed*.py)))

python-test-new: $(DEPS) $(DEPS_NEW)
	rm -rf $(WHEEL_NEW)
	$(VENV)/bin/maturin build --release --quiet --interpreter $(PY) --out $(WHEEL_NEW)
	$(PY_NEW) -m pip install --quiet --no-deps --force-reinstall $(WHEEL_NEW)/*.whl
	$(PY_NEW) -m pytest -q $(NEW_STACK_TESTS)

test: rust-test gpu-sanitize memcheck python-test python-test-new

# The benchmark suite: a table of times and ratios, bench/out/results.json and a PNG plot.
# BENCH_ARGS passes options to bench/bench.py (the README test uses `--quick --out DIR`).
bench: develop
	$(PY) -m pip install --quiet matplotlib
	$(PY) bench/bench.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VENV_NEW) target

# The two commands of the README: `make demo` and `make test`. Both set everything up in .venv/
# from a fresh clone and are safe to run again.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEPS := $(VENV)/.deps-installed

.PHONY: demo stateful-demo counter-bundle memcheck test bench develop rust-test python-test clean

$(DEPS): requirements-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $(DEPS)

# Builds the Rust extension (release) into .venv; cargo makes this quick when nothing changed.
develop: $(DEPS)
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --release --quiet

# Trains a small character-level transformer with rmsnorm_ffi.RMSNorm, then with flax's jnp norm,
# and compares losses, speed and what the live-state registry saw (about a minute on 2 cores).
demo: develop
	$(PY) examples/train.py

# The scaled_copy bundle end to end: states per call site, threads, no allocation after warm-up.
stateful-demo: develop
	$(PY) examples/stateful_demo.py

# The example of a bundle in a crate of its own (examples/counter_bundle). Its own target folder:
# building it there also builds this crate's cdylib without the `python` feature, and in target/
# that file would replace the extension `maturin develop` copies from target/release.
counter-bundle:
	CARGO_TARGET_DIR=target/counter_bundle cargo build --release --quiet --manifest-path examples/counter_bundle/Cargo.toml

# RMSNORM_FFI_SITE_PACKAGES: where pip put nvidia-cuda-nvrtc/-nvcc, for tests/gpu_kernels.rs.
rust-test: $(DEPS)
	XLA_FFI_INCLUDE_DIR="$$($(PY) -c 'import jax.ffi; print(jax.ffi.include_dir())')" \
	RMSNORM_FFI_SITE_PACKAGES="$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
		cargo test --features fake-runtime

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

test: rust-test memcheck python-test

# The benchmark suite: a table of times and ratios, bench/out/results.json and a PNG plot.
# BENCH_ARGS passes options to bench/bench.py (the README test uses `--quick --out DIR`).
bench: develop
	$(PY) -m pip install --quiet matplotlib
	$(PY) bench/bench.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) target

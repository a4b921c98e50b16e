#!/usr/bin/env bash
# `make gpu-sanitize`: the emulated kernels under the sanitizers, in the standalone harness
# (cpp/harness.cpp), built with the same shim, scheduler and kernel source as the tests.
# - AddressSanitizer + UndefinedBehaviorSanitizer (aborting on the first report): the full sweep,
#   with the backward split across clusters of 2 and 4 blocks (its `_c` kernels); then the quick
#   subset with a kernel variant's defines (src/handlers/gpu/variant.rs).
# - ThreadSanitizer: the quick subset (TSan's cost grows with the fibers alive: a block of 512
#   CUDA threads is 512 TSan fibers), then a self-check: with team_sum's first barrier removed,
#   TSan must report a data race, so a clean run means something.
# Every build (g++) and every run is one process on one core: the script runs two lanes at
# once (the full sweep's build and run in one, everything else in the other), each step timed,
# each lane's output printed whole when it ends.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
src="$here/../../src/handlers/gpu/rmsnorm.cu"
out="${1:-$here/../../target/gpu-sanitize}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"  # absolute: the compiler resolves quoted includes from the source
CXX="${CXX:-g++}"
cpp="$here/cpp"
common=(-std=c++17 -g -fno-omit-frame-pointer -fno-strict-aliasing -Wno-unknown-pragmas -I"$cpp")

# The ThreadSanitizer runs (quick, one) take float32 x with float32 weights and bfloat16 x with
# float32 weights: their builds stamp only those (EMU_PAIRS in rmsnorm.cu), a third of the time
# of all 16 pairs.
tsan_pairs="STAMP(f32, float, f32, float) STAMP(bf16, bf16_t, f32, float) FINALIZE_ENTRY(f32, float, f32, float)"
# The pairs of harness.cpp's LayerNorm sample (`layer_pairs` there).
layer_pairs="STAMP(f32, float, f32, float) STAMP(bf16, bf16_t, f32, float) STAMP(bf16, bf16_t, bf16, bf16_t) \
STAMP(f64, double, f64, double) STAMP(f16, f16_t, f16, f16_t) FINALIZE_ENTRY(f32, float, f32, float) \
FINALIZE_ENTRY(f32, float, bf16, bf16_t) FINALIZE_ENTRY(f64, double, f64, double) FINALIZE_ENTRY(f32, float, f16, f16_t)"

build() {  # name source flags...
  local name=$1 source=$2
  shift 2
  # The kernel table, as build.rs makes it: every entry point the build stamps, with its
  # launch bounds.
  "$CXX" -std=c++17 -x c++ -E -DEMU_EXPAND "$@" -include "$cpp/cuda_shim.h" "$source" \
    | grep -o 'EMU_LAUNCH_BOUNDS([^)]*) *[A-Za-z0-9_]*' \
    | sed -E 's/EMU_LAUNCH_BOUNDS\(([0-9]+)(, *([0-9]+))?\) *([A-Za-z0-9_]+)/EMU_KERNEL(\4, \1, 0\3)/' \
    > "$out/$name-kernel_table.inc"
  test -s "$out/$name-kernel_table.inc"
  "$CXX" "${common[@]}" "$@" -include "$cpp/cuda_shim.h" \
    -DEMU_KERNEL_SOURCE="\"$source\"" -DEMU_KERNEL_TABLE="\"$out/$name-kernel_table.inc\"" \
    -c "$cpp/kernels.cpp" -o "$out/$name-kernels.o"
  "$CXX" "${common[@]}" "$@" -c "$cpp/fibers.cpp" -o "$out/$name-fibers.o"
  "$CXX" "${common[@]}" "$@" -c "$cpp/harness.cpp" -o "$out/$name-harness.o"
  "$CXX" "$@" "$out/$name-kernels.o" "$out/$name-fibers.o" "$out/$name-harness.o" -o "$out/$name"
}

t0=$(date +%s)

# Runs "$@" and prints how long it took: `step NAME command...`.
step() {
  local name=$1 start
  shift
  start=$(date +%s)
  "$@"
  echo "   ($name: $(( $(date +%s) - start )) s)"
}

asan() {  # binary [mode]
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 "$@"
}

sweep_lane() {
  echo "== AddressSanitizer + UndefinedBehaviorSanitizer: the full sweep (the RMS norm's kernels)"
  step build build harness-asan "$src" -O1 -fsanitize=address,undefined -fno-sanitize-recover=all \
    -DKERNEL_NORMS=1
  step run asan "$out/harness-asan"
}

other_lane() {
  echo "== AddressSanitizer + UndefinedBehaviorSanitizer: LayerNorm's kernels, a sample (the same"
  echo "   code with a mean: its pairs only, not the whole sweep again)"
  step build build harness-asan-layer "$src" -O1 -fsanitize=address,undefined \
    -fno-sanitize-recover=all -DKERNEL_NORMS=2 -DEMU_PAIRS="$layer_pairs"
  step run asan "$out/harness-asan-layer" layer

  echo "== AddressSanitizer + UndefinedBehaviorSanitizer: a kernel variant (RMSNORM_FFI_GPU_PLAN's"
  echo "   fwd_vpt=8,fwd_weight_early=1 defines: folds between cached vectors, weight packs read"
  echo "   before the reduction), the quick subset, the RMS norm's kernels (the forward code the"
  echo "   defines change is the one both norms share)"
  step build build harness-asan-variant "$src" -O1 -fsanitize=address,undefined \
    -fno-sanitize-recover=all -DFWD_VPT=8 -DFWD_WEIGHT_EARLY=1 -DEMU_PAIRS="$tsan_pairs" \
    -DKERNEL_NORMS=1
  step run asan "$out/harness-asan-variant" quick

  echo "== ThreadSanitizer: the quick subset"
  step build build harness-tsan "$src" -O1 -fsanitize=thread -DEMU_PAIRS="$tsan_pairs"
  step run env TSAN_OPTIONS=halt_on_error=1 "$out/harness-tsan" quick

  echo "== ThreadSanitizer self-check: a missing barrier must be reported"
  python3 - "$src" "$out/missing-barrier.cu" <<'PY'
import sys
s = open(sys.argv[1]).read()
find = "    if ((threadIdx.x & 31) == 0) red[warp] = v;\n    __syncthreads();\n"
assert s.count(find) == 1, "the self-check's pattern no longer matches rmsnorm.cu: update sanitize.sh"
open(sys.argv[2], "w").write(s.replace(find, "    if ((threadIdx.x & 31) == 0) red[warp] = v;\n"))
PY
  step build build harness-tsan-bug "$out/missing-barrier.cu" -O1 -fsanitize=thread \
    -DEMU_PAIRS="$tsan_pairs" -DKERNEL_NORMS=1
  if TSAN_OPTIONS=halt_on_error=1 "$out/harness-tsan-bug" one > "$out/tsan-bug.log" 2>&1; then
    echo "ThreadSanitizer did not report the planted race" >&2
    return 1
  fi
  grep -q "WARNING: ThreadSanitizer: data race" "$out/tsan-bug.log" || {
    cat "$out/tsan-bug.log" >&2
    echo "the planted race failed the run, but not as a ThreadSanitizer report" >&2
    return 1
  }
  echo "reported: $(grep -m1 'SUMMARY: ThreadSanitizer' "$out/tsan-bug.log")"
}

# The lanes run in subshells with errexit: the first failing command ends its lane.
( set -e; sweep_lane ) > "$out/lane-sweep.log" 2>&1 &
sweep=$!
( set -e; other_lane ) > "$out/lane-other.log" 2>&1 &
other=$!
status=0
wait "$other" || status=1
cat "$out/lane-other.log"
wait "$sweep" || status=1
cat "$out/lane-sweep.log"
if [ "$status" -ne 0 ]; then
  echo "gpu-sanitize: FAILED (the lane logs above; each stops at its first failure)" >&2
  exit 1
fi
echo "gpu-sanitize: clean ($(( $(date +%s) - t0 )) s)"

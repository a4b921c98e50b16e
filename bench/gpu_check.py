"""The device check of the CUDA RMS norm: one command of at most about 5 minutes on a lent GPU.

Run on the GPU machine (no Rust there: install the abi3 wheel built elsewhere):

    pip install --no-deps rmsnorm_ffi-*.whl
    OUT=/some/dir python bench/gpu_check.py [--budget SECONDS] [--quick]

Sections, in order, each written to $OUT/gpu_check.jsonl as soon as it has a result (so a
timeout still returns data), each in a try block of its own:

 1. smoke: libcuda and NVRTC (path, version), the devices, one forward call.
 2. correctness: forward and backward (and grad) for float32/bfloat16/float16/float64, weights
    of x's dtype and float32, odd rows (scalar path), zero rows, long rows (streaming path), a
    batched weight, against float64 NumPy and against the CPU bundle on the same inputs;
    dweight bitwise reproducible run to run.
 3. residual: the fused rms_norm_residual (CUDA target rmsnorm_residual_fwd): h bitwise equal to
    jnp's x + residual on the GPU and to the CPU bundle's h, y bitwise equal to the plain forward
    at h, y against float64, over the dtypes, weight kinds and the cached, scalar and streaming
    paths; its gradient against jnp's.
 3b. variants: every x dtype with every weight dtype, with and without scale_offset, against
    float64 and the CPU bundle; the fused residual's gradient (dh added before dx's one
    rounding) against float64.
 4. initialize: stats() says each GPU state's resources were loaded in the initialize stage.
 5. graphs: a step of 6+ ops around the norms under XLA command buffers (custom calls included)
    in a child process: the first execution is captured, later ones replay (the handler runs
    fewer times than the step), new input buffers re-record, and the results are bitwise equal
    to a child without command buffers.
 6. concurrency: two threads make the first call of a fresh executable at once.
 7. big: more than 2^31 elements (bfloat16), forward and backward, sampled rows vs float64.
 8. growth: 50 call sites compiled, run and dropped: live states back to the baseline, XLA's
    bytes in use back, one module per device.
 9. bandwidth: GB/s of forward and backward against a device copy, against jnp, against the
    Pallas RMS norm jax ships (if importable) and tokamax's layer_norm with subtract_mean=False
    (if tokamax is installed), and of the fused residual forward against jnp's x + r then jnp's
    norm, each next to the traffic model's prediction (docs/gpu-traffic.json, from `make
    gpu-traffic`: its predicted fraction of peak times this device's measured copy; `~` where
    the shape is not the model's and its row length's sweep shape stands in), M in {4096, 16384} x N in {1024, 4096, 8192, 16384}, bfloat16 and
    float32; each timing runs k independent calls in one executable on k
    distinct buffers, k chosen so that k buffers exceed 4x the L2 (read off the device), so
    small shapes are not timed from cache, then 2k calls on 2k buffers: the difference over k
    is the time per call, without the executable's dispatch and sync (dy and the residual are
    the next buffer of the rotation). bfloat16 first; stops early to leave 200 s to:
 9b. profile: Nsight Compute (if ncu is there) on one forward each of ours and jnp's at
    16384x4096, bfloat16 and float32 (speed of light, memory, occupancy, warp states): the
    report in $OUT/ncu.txt, for what the traffic model missed on the first H200 run (a diagnosis:
    never a failure);
10. sanitizer: compute-sanitizer memcheck, racecheck and synccheck on a small sweep in child
    processes (kernels compiled with -lineinfo), if compute-sanitizer is on PATH or in
    /usr/local/cuda/bin.

A table prints last (and goes to $OUT/table.txt). Exit status 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

ARGS = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ARGS.add_argument("--budget", type=float, default=290.0, help="seconds for the whole run")
ARGS.add_argument("--quick", action="store_true", help="fewer shapes everywhere")
ARGS.add_argument("--child", choices=["graphs", "nographs", "sanitize", "profile"], help=argparse.SUPPRESS)
ARGS.add_argument("--child-out", help=argparse.SUPPRESS)
OPTS = ARGS.parse_args()

if OPTS.child == "graphs":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
    )
if OPTS.child == "nographs":
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
if OPTS.child in ("sanitize", "profile"):
    os.environ["RMSNORM_FFI_NVRTC_LINEINFO"] = "1"
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import rmsnorm_ffi  # noqa: E402
from rmsnorm_ffi import _native  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_common  # noqa: E402
from gpu_common import TOL, err, ref_np, timed  # noqa: E402

if not OPTS.child and not any(d.platform == "gpu" for d in jax.devices()):
    print(f"gpu_check: no GPU here (jax sees {jax.devices()}); gpu_info: {_native.gpu_info()}")
    sys.exit(2)

OUT = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "out")
OUT.mkdir(parents=True, exist_ok=True)
LOG = OUT / ("gpu_check.jsonl" if not OPTS.child else f"child_{OPTS.child}.jsonl")
RUN = gpu_common.Log(LOG, OPTS.budget)
left, record, section = RUN.left, RUN.record, RUN.section


def gpu():
    return jax.devices("gpu")[0]


def on(dev, x):
    return jax.device_put(x, dev)


# ---------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# Children (graphs, sanitizer)
# ---------------------------------------------------------------------------------------------


def step_fn(x, w, dy):
    """A step of several ops around the norms (what a model's layer does)."""

    def loss(x, w):
        h = jnp.tanh(x) * 1.5 + 0.25
        y = rmsnorm_ffi.rms_norm(h, w)
        z = rmsnorm_ffi.rms_norm(y * y + h, w)
        return jnp.sum(z * dy)

    value, (gx, gw) = jax.value_and_grad(loss, (0, 1))(x, w)
    return value, gx * 0.5, gw + 1.0


def child_graphs(out: str) -> None:
    dev = gpu()
    rng = np.random.default_rng(7)
    f = jax.jit(step_fn)
    runs = []
    for seed in range(3):  # three sets of buffers: the second and third re-record
        x = on(dev, jnp.asarray(rng.standard_normal((256, 1024)), jnp.float32))
        w = on(dev, jnp.asarray(rng.uniform(0.5, 1.5, 1024), jnp.float32))
        dy = on(dev, jnp.asarray(rng.standard_normal((256, 1024)), jnp.float32))
        for _ in range(5):
            res = jax.block_until_ready(f(x, w, dy))
        runs.append([np.asarray(r) for r in res])
    s = rmsnorm_ffi.stats()
    np.savez(out, *[a for r in runs for a in r])
    with open(out + ".json", "w") as fh:
        json.dump({"executions": s["executions"], "xla_flags": os.environ.get("XLA_FLAGS", ""),
                   "details": [st.get("details", {}) for st in s["states"]]}, fh)


def child_sanitize() -> None:
    dev = gpu()
    rng = np.random.default_rng(3)
    for dt in (jnp.float32, jnp.bfloat16):
        for shape in ((3, 67), (37, 256), (2, 4096), (2, 20000), (2, 3, 64)):
            x = on(dev, jnp.asarray(rng.standard_normal(shape), dt))
            w = on(dev, jnp.asarray(rng.uniform(0.5, 1.5, shape[-1]), dt))
            if len(shape) == 3:
                w = on(dev, jnp.asarray(rng.uniform(0.5, 1.5, (shape[0], shape[-1])), dt))
                y, r = jax.vmap(rmsnorm_ffi.rms_norm_fwd)(x, w)
                jax.block_until_ready(jax.vmap(rmsnorm_ffi.rms_norm_bwd)(x, w, r, x))
                continue
            y, r = jax.jit(rmsnorm_ffi.rms_norm_fwd)(x, w)
            jax.block_until_ready(jax.jit(rmsnorm_ffi.rms_norm_bwd)(x, w, r, x))
            jax.block_until_ready(jax.jit(rmsnorm_ffi.rms_norm_residual)(x, y, w))
    print("sanitize child done", flush=True)


if OPTS.child in ("graphs", "nographs"):
    child_graphs(OPTS.child_out)
    sys.exit(0)
if OPTS.child == "sanitize":
    child_sanitize()
    sys.exit(0)


def child_profile() -> None:
    """One forward each of ours and jnp's, bfloat16 then float32, at 16384x4096: the kernels
    Nsight Compute profiles (the first H200 run left the bfloat16 forward at 54-81% of a copy
    where the traffic model said ~100%, and jnp ahead of it)."""
    dev = gpu()
    for dt in (jnp.bfloat16, jnp.float32):
        x = jax.jit(lambda k: jax.random.normal(k, (16384, 4096), dt))(jax.random.key(0))  # on the GPU
        w = on(dev, jnp.ones((4096,), dt))
        ours = jax.jit(lambda x, w: rmsnorm_ffi.rms_norm_fwd(x, w)[0])
        ref = jax.jit(rmsnorm_ffi.rms_norm_reference)
        for f in (ours, ref):
            jax.block_until_ready(f(x, w))
    print("profile child done", flush=True)


if OPTS.child == "profile":
    child_profile()
    sys.exit(0)


def run_child(kind: str, timeout: float, prefix: list[str] | None = None, out: str | None = None):
    cmd = (prefix or []) + [sys.executable, __file__, "--child", kind]
    if out:
        cmd += ["--child-out", out]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
    return p.returncode, p.stdout[-4000:] + p.stderr[-8000:]


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


@section("smoke", needs=20)
def smoke():
    info = dict(_native.gpu_info())
    record("smoke", jax=jax.__version__, backend=jax.default_backend(), devices=str(jax.devices()),
           gpu_info=info, registered=rmsnorm_ffi.register())
    dev = gpu()
    x = on(dev, jnp.ones((8, 128), jnp.float32))
    y = np.asarray(rmsnorm_ffi.rms_norm(x))
    ok = np.allclose(y, 1.0, atol=1e-5) and "libcuda" in info and "nvrtc" in info
    return ok, f"libcuda {info.get('libcuda')}, NVRTC {info.get('nvrtc_version')} from {info.get('nvrtc')}"


@section("correctness", needs=40)
def correctness():
    dev, cpu = gpu(), jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    bad = []
    checks = 0
    shapes = [(3, 8), (5, 1000), (7, 1003), (64, 4096), (9, 16384), (4, 40000), (0, 16), (2, 3, 512)]
    if OPTS.quick:
        shapes = shapes[:4]
    for dt in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64):
        name = jnp.dtype(dt).name
        tol = TOL[name]
        for shape in shapes:
            for wkind in (None, "same", "f32"):
                if wkind == "f32" and dt == jnp.float32:
                    continue
                xh = np.asarray(jnp.asarray(rng.standard_normal(shape), dt))
                dyh = np.asarray(jnp.asarray(rng.standard_normal(shape), dt))
                n = shape[-1]
                wh = None
                if wkind:
                    wh = np.asarray(jnp.asarray(rng.uniform(0.5, 1.5, n), dt if wkind == "same" else jnp.float32))
                y, r, dx, dw = ref_np(xh, wh, dyh)
                res = {}
                for where, d in (("gpu", dev), ("cpu", cpu)):
                    x, dy = on(d, xh), on(d, dyh)
                    w = None if wh is None else on(d, wh)
                    gy, gr = jax.jit(rmsnorm_ffi.rms_norm_fwd)(x, w)
                    gdx, gdw = jax.jit(rmsnorm_ffi.rms_norm_bwd)(x, w, gr, dy)
                    res[where] = (gy, gr, gdx, gdw)
                tag = f"{name} {shape} w={wkind}"
                gy, gr, gdx, gdw = res["gpu"]
                rows = max(1, int(np.prod(shape[:-1])))
                pairs = [("y", gy, y, tol), ("rstd", gr, r, tol), ("dx", gdx, dx, 4 * tol),
                         ("y~cpu", gy, res["cpu"][0], 2 * tol), ("dx~cpu", gdx, res["cpu"][2], 8 * tol)]
                if wh is not None:
                    wtol = 4 * max(tol, TOL["float32"] if wkind == "f32" else tol)
                    pairs += [("dw", gdw, dw, wtol * np.sqrt(rows)),
                              ("dw~cpu", gdw, res["cpu"][3], 2 * wtol * np.sqrt(rows))]
                for what, got, want, t in pairs:
                    checks += 1
                    e = err(got, want)
                    if not e <= t:
                        bad.append(f"{what} {tag}: {e:.2e} > {t:.0e}")
    # Non-finite input in half precision: the bfloat16 kernels round pairs with the hardware's
    # cvt.rn.bf16x2.f32 and fall back to the bit arithmetic for a pack holding a NaN (the CPU
    # emulator runs a software twin of the instruction, never the instruction). A row with a
    # NaN or an infinity is NaN where the CPU's is, infinite where it is, and the finite rows
    # match.
    for dt in (jnp.bfloat16, jnp.float16):
        xh = rng.standard_normal((6, 1024)).astype(np.float32)
        xh[1, 5], xh[2, 7], xh[3, 9] = np.nan, np.inf, -np.inf
        xh[4] *= 1e30 if dt == jnp.bfloat16 else 1e4  # bfloat16: squares overflow float32
        xh = np.asarray(jnp.asarray(xh, dt))
        wh = np.asarray(jnp.asarray(rng.uniform(0.5, 1.5, 1024), dt))
        ys = {}
        for where, d in (("gpu", dev), ("cpu", cpu)):
            ys[where] = np.asarray(jax.jit(rmsnorm_ffi.rms_norm)(on(d, xh), on(d, wh))).astype(np.float32)
        g, c = ys["gpu"], ys["cpu"]
        checks += 1
        same_kind = (np.array_equal(np.isnan(g), np.isnan(c)) and np.array_equal(np.isinf(g), np.isinf(c))
                     and np.array_equal(g[np.isinf(g)], c[np.isinf(c)]))
        fin = np.isfinite(c)
        if not same_kind or not err(g[fin], c[fin]) <= 2 * TOL[jnp.dtype(dt).name]:
            bad.append(f"non-finite {jnp.dtype(dt).name}: NaN/inf positions or finite values differ from the CPU's")
    # A batched (vmapped) weight, and grad through the op.
    x = on(dev, jnp.asarray(rng.standard_normal((4, 32, 256)), jnp.float32))
    w = on(dev, jnp.asarray(rng.uniform(0.5, 1.5, (4, 256)), jnp.float32))
    y, _, dx, dw = ref_np(np.asarray(x), np.asarray(w), np.ones(x.shape))
    f = jax.vmap(rmsnorm_ffi.rms_norm)
    gx, gw = jax.jit(jax.grad(lambda x, w: f(x, w).sum(), (0, 1)))(x, w)
    for what, got, want, t in (("vmap y", jax.jit(f)(x, w), y, 2e-5), ("vmap dx", gx, dx, 1e-4),
                               ("vmap dw", gw, dw, 1e-4)):
        checks += 1
        if not err(got, want, scale=6.0) <= t:
            bad.append(f"{what}: {err(got, want, 6.0):.2e}")
    # dweight bitwise reproducible.
    x = on(dev, jnp.asarray(rng.standard_normal((4096, 4096)), jnp.bfloat16))
    w = on(dev, jnp.ones(4096, jnp.bfloat16))
    _, r = rmsnorm_ffi.rms_norm_fwd(x, w)
    a = np.asarray(rmsnorm_ffi.rms_norm_bwd(x, w, r, x)[1].astype(jnp.float32))
    b = np.asarray(rmsnorm_ffi.rms_norm_bwd(x, w, r, x)[1].astype(jnp.float32))
    checks += 1
    if not np.array_equal(a, b):
        bad.append("dweight not bitwise reproducible")
    record("correctness", checks=checks, failures=bad[:50])
    return not bad, f"{checks} checks, {len(bad)} failed" + (f": {bad[:3]}" if bad else "")


@section("residual", needs=25)
def residual():
    dev, cpu = gpu(), jax.devices("cpu")[0]
    rng = np.random.default_rng(7)
    bad = []
    checks = 0
    shapes = [(5, 1000), (7, 1003), (64, 4096), (4, 40000), (0, 16), (2, 3, 512)]
    if OPTS.quick:
        shapes = shapes[:3]
    fused = jax.jit(rmsnorm_ffi.rms_norm_residual)
    add = jax.jit(lambda x, r: x + r)
    plain = jax.jit(rmsnorm_ffi.rms_norm)
    for dt in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64):
        name = jnp.dtype(dt).name
        tol = TOL[name]
        for shape in shapes:
            for wkind in (None, "same", "f32"):
                if wkind == "f32" and dt == jnp.float32:
                    continue
                xh = np.asarray(jnp.asarray(rng.standard_normal(shape), dt))
                rh = np.asarray(jnp.asarray(rng.standard_normal(shape), dt))
                wh = None
                if wkind:
                    wdt = dt if wkind == "same" else jnp.float32
                    wh = np.asarray(jnp.asarray(rng.uniform(0.5, 1.5, shape[-1]), wdt))
                res = {}
                for where, d in (("gpu", dev), ("cpu", cpu)):
                    x, r = on(d, xh), on(d, rh)
                    w = None if wh is None else on(d, wh)
                    res[where] = (*fused(x, r, w), add(x, r), x, r, w)
                gy, gh, jh, x, r, w = res["gpu"]
                cy, ch = res["cpu"][:2]
                y_ref = ref_np(np.asarray(jnp.asarray(gh).astype(jnp.float64)), wh, np.zeros(shape))[0]
                tag = f"{name} {shape} w={wkind}"
                as_bits = lambda a: np.asarray(a).view(np.uint8)  # noqa: E731
                for what, same in (("h == jnp x + r", np.array_equal(as_bits(gh), as_bits(jh))),
                                   ("h == CPU h", np.array_equal(as_bits(gh), as_bits(ch))),
                                   ("y == rms_norm(h)", np.array_equal(as_bits(gy), as_bits(plain(gh, w))))):
                    checks += 1
                    if not same:
                        bad.append(f"{what} {tag}")
                for what, got, want, t in (("y", gy, y_ref, tol), ("y~cpu", gy, cy, 2 * tol)):
                    checks += 1
                    e = err(got, want)
                    if not e <= t:
                        bad.append(f"{what} {tag}: {e:.2e} > {t:.0e}")
    # The gradients of y and h both reach x and the residual, as jnp's add then jnp's norm.
    x = on(dev, jnp.asarray(rng.standard_normal((64, 1024)), jnp.float32))
    r = on(dev, jnp.asarray(rng.standard_normal((64, 1024)), jnp.float32))
    w = on(dev, jnp.asarray(rng.uniform(0.5, 1.5, 1024), jnp.float32))

    def loss(op):
        def f(x, r, w):
            y, h = op(x, r, w)
            return jnp.sum(y * jnp.cos(h)) + jnp.sum(h * h)
        return jax.jit(jax.grad(f, (0, 1, 2)))

    ref = lambda x, r, w: (rmsnorm_ffi.rms_norm_reference(x + r, w), x + r)  # noqa: E731
    for what, got, want in zip(("dx", "dresidual", "dw"), loss(rmsnorm_ffi.rms_norm_residual)(x, r, w),
                               loss(ref)(x, r, w)):
        checks += 1
        e = err(got, want, scale=float(np.max(np.abs(np.asarray(want)))))
        if not e <= 1e-5:
            bad.append(f"grad {what}: {e:.2e}")
    record("residual", checks=checks, failures=bad[:50])
    return not bad, f"{checks} checks, {len(bad)} failed" + (f": {bad[:3]}" if bad else "")


@section("variants", needs=25)
def variants():
    """Issue 31's variants on the device: every x dtype with every weight dtype (16 pairs), with
    and without scale_offset, forward and backward against float64 and the CPU bundle; and the
    fused residual's gradient (dh added before dx's one rounding) against float64."""
    dev, cpu = gpu(), jax.devices("cpu")[0]
    rng = np.random.default_rng(11)
    bad, checks = [], 0
    floats = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)
    shapes = [(7, 1003), (64, 4096)] if not OPTS.quick else [(7, 1003)]
    for dt in floats:
        tol = TOL[jnp.dtype(dt).name]
        for wdt in floats:
            for offset in (0.0, 1.0):
                for shape in shapes:
                    xh = np.asarray(jnp.asarray(rng.standard_normal(shape), dt))
                    dyh = np.asarray(jnp.asarray(rng.standard_normal(shape), dt))
                    wh = np.asarray(jnp.asarray(rng.standard_normal(shape[-1]) * 0.3, wdt))
                    w64 = np.asarray(jnp.asarray(wh).astype(jnp.float64))
                    y, _, dx, dw = ref_np(xh, offset + w64, dyh)
                    res = {}
                    for where, d in (("gpu", dev), ("cpu", cpu)):
                        x, dy, w = on(d, xh), on(d, dyh), on(d, wh)
                        gy, gr = jax.jit(lambda x, w: rmsnorm_ffi.rms_norm_fwd(x, w, scale_offset=offset))(x, w)
                        gdx, gdw = jax.jit(lambda *a: rmsnorm_ffi.rms_norm_bwd(*a, scale_offset=offset))(x, w, gr, dy)
                        res[where] = (gy, gdx, gdw)
                    gy, gdx, gdw = res["gpu"]
                    tag = f"{jnp.dtype(dt).name} w{jnp.dtype(wdt).name} off={offset} {shape}"
                    wtol = 4 * max(tol, TOL[jnp.dtype(wdt).name]) * np.sqrt(shape[0])
                    for what, got, want, t in (("y", gy, y, tol), ("dx", gdx, dx, 4 * tol), ("dw", gdw, dw, wtol),
                                               ("y~cpu", gy, res["cpu"][0], 2 * tol),
                                               ("dx~cpu", gdx, res["cpu"][1], 8 * tol)):
                        checks += 1
                        e = err(got, want)
                        if not e <= t:
                            bad.append(f"{what} {tag}: {e:.2e} > {t:.0e}")
    # The fused residual's gradient: dx = the norm's gradient + dh, rounded once.
    for dt in (jnp.bfloat16, jnp.float16, jnp.float32):
        name = jnp.dtype(dt).name
        shape = (71, 229) if OPTS.quick else (512, 3072)
        xh, rh, cyh, chh = (np.asarray(jnp.asarray(rng.standard_normal(shape), dt)) for _ in range(4))
        wh = np.asarray(jnp.asarray(rng.standard_normal(shape[-1]) * 0.3, dt))
        f = lambda x, r, w: rmsnorm_ffi.rms_norm_residual(x, r, w, scale_offset=1.0)  # noqa: E731
        (gy, gh), vjp = jax.vjp(f, on(dev, xh), on(dev, rh), on(dev, wh))
        gdx, gdr, _ = jax.jit(vjp)((on(dev, cyh), on(dev, chh)))
        h64 = np.asarray(jnp.asarray(gh).astype(jnp.float64))
        w64 = 1.0 + np.asarray(jnp.asarray(wh).astype(jnp.float64))
        _, r64, ndx, _ = ref_np(h64, w64, cyh.astype(np.float64))
        want = ndx + chh.astype(np.float64)
        # One rounding of x's dtype (at most half an ulp: 2**-8 of the value for bfloat16, 2**-11
        # for float16, 2**-24 for float32) plus float32's error of the terms, which for the
        # norm's gradient is relative to its uncancelled term r * g (the row's largest).
        ulp = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24}[name]
        rg = np.abs(r64[..., None] * cyh.astype(np.float64) * w64).max(-1, keepdims=True)
        terms = rg + np.abs(chh.astype(np.float64))
        e = float(np.max(np.abs(np.asarray(jnp.asarray(gdx).astype(jnp.float64)) - want) / (ulp * np.abs(want) + terms * 2.0**-19 + 1e-30)))
        checks += 2
        if not e <= 1.0:
            bad.append(f"residual dx {name}: {e:.2f} of the one-rounding bound")
        if not np.array_equal(np.asarray(gdx).view(np.uint8), np.asarray(gdr).view(np.uint8)):
            bad.append(f"residual dx != dresidual {name}")
    record("variants", checks=checks, failures=bad[:50])
    return not bad, f"{checks} checks, {len(bad)} failed" + (f": {bad[:3]}" if bad else "")


@section("initialize", needs=5)
def initialize_ran():
    details = [s.get("details", {}) for s in rmsnorm_ffi.stats()["states"]
               if "Gpu" in s.get("type", "")]
    stages = [v for d in details for v in d.values()]
    record("initialize", details=details[:20])
    in_init = sum("loaded in initialize" in v for v in stages)
    in_exec = sum("loaded in execute" in v for v in stages)
    return bool(stages) and in_exec == 0, f"{in_init} device resources loaded in initialize, {in_exec} in execute"


@section("graphs", needs=60)
def graphs():
    a, b = str(OUT / "graphs.npz"), str(OUT / "nographs.npz")
    rc1, log1 = run_child("graphs", timeout=min(120, left()), out=a)
    rc2, log2 = run_child("nographs", timeout=min(120, left()), out=b)
    if rc1 or rc2:
        record("graphs", graphs_log=log1, nographs_log=log2)
        return False, f"children failed ({rc1}, {rc2})"
    ga, gb = np.load(a), np.load(b)
    equal = all(np.array_equal(ga[k], gb[k]) for k in ga.files)
    ja = json.load(open(a + ".json"))
    jb = json.load(open(b + ".json"))
    fwd_g = ja["executions"].get("rmsnorm_fwd", 0)
    fwd_n = jb["executions"].get("rmsnorm_fwd", 0)
    record("graphs", executions_with_graphs=ja["executions"], executions_without=jb["executions"],
           details=ja["details"], bitwise_equal=equal)
    # Without graphs: 2 forward calls per step, 15 steps. With: recorded once per buffer set.
    replayed = fwd_g < fwd_n
    return equal and replayed, (f"bitwise equal: {equal}; forward handler ran {fwd_g} times with "
                                f"command buffers, {fwd_n} without (replay: {replayed})")


@section("concurrency", needs=15)
def concurrency():
    dev = gpu()
    x = on(dev, jnp.asarray(np.random.default_rng(5).standard_normal((512, 2048)), jnp.bfloat16))
    f = jax.jit(lambda x: rmsnorm_ffi.rms_norm(x * 1.0001))
    f.lower(x).compile()
    results, errors = [None, None], []
    barrier = threading.Barrier(2)

    def go(i):
        try:
            barrier.wait()
            results[i] = np.asarray(f(x).astype(jnp.float32))
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = ref_np(np.asarray(x.astype(jnp.float32)) * 1.0001, None, np.zeros(x.shape))[0]
    ok = not errors and all(r is not None and err(r, want) < 2e-2 for r in results)
    return ok, f"errors {errors}" if errors else "both first calls correct"


@section("big", needs=40)
def big():
    dev = gpu()
    n = 4096
    rows = (1 << 31) // n + 3  # 2^31 + 3 * 4096 elements
    key = jax.random.key(0)
    x = jax.jit(lambda k: jax.random.normal(k, (rows, n), jnp.bfloat16))(key)  # on the GPU
    w = on(dev, jnp.full((n,), 1.25, jnp.bfloat16))
    y, r = jax.jit(rmsnorm_ffi.rms_norm_fwd)(x, w)
    dx, dw = jax.jit(rmsnorm_ffi.rms_norm_bwd)(x, w, r, x)
    sample = np.array([0, 1, rows // 2, rows - 2, rows - 1])
    xs = np.asarray(x[sample].astype(jnp.float32))
    ys, rs, dxs, _ = ref_np(xs, np.asarray(w.astype(jnp.float32)), xs)
    e = max(err(y[sample], ys), err(r[sample], rs), err(dx[sample], dxs, scale=1.0))
    dw_ref = jax.jit(lambda x, r: jnp.sum(x.astype(jnp.float32) ** 2 * r[:, None], 0))(x, r)
    edw = err(dw, np.asarray(dw_ref), scale=float(np.sqrt(rows)))
    del x, y, dx
    ok = e < 3e-2 and edw < 3e-2
    return ok, f"{rows * n} elements: sampled rows rel.err {e:.1e}, dweight {edw:.1e}"


@section("growth", needs=40)
def growth():
    import gc

    dev = gpu()
    jax.clear_caches()
    gc.collect()
    base = rmsnorm_ffi.stats()["live_states"]
    mem0 = dev.memory_stats().get("bytes_in_use", 0) if dev.memory_stats() else 0
    x = on(dev, jnp.ones((64, 1024), jnp.float32))
    w = on(dev, jnp.ones((1024,), jnp.float32))
    fns = []
    for i in range(50):  # 50 call sites: distinct eps, each its own executable
        eps = 1e-6 * (i + 1)
        f = jax.jit(jax.grad(lambda x, w, eps=eps: rmsnorm_ffi.rms_norm(x, w, eps).sum(), (0, 1)))
        jax.block_until_ready(f(x, w))
        fns.append(f)
    mid = rmsnorm_ffi.stats()
    scratch = sum(int(v.split(", ")[1].split()[0]) for s in mid["states"]
                  for v in s.get("details", {}).values() if "scratch" in v)
    del fns, f
    jax.clear_caches()
    gc.collect()
    end = rmsnorm_ffi.stats()
    mem1 = dev.memory_stats().get("bytes_in_use", 0) if dev.memory_stats() else 0
    modules = _native.gpu_info()["gpu_modules_loaded"]
    record("growth", live_before=base, live_with_50=mid["live_states"], live_after=end["live_states"],
           scratch_bytes_with_50=scratch, xla_bytes_before=mem0, xla_bytes_after=mem1, modules=modules)
    ok = end["live_states"] <= base and modules <= len(jax.devices("gpu")) and mem1 <= mem0 + (1 << 20)
    return ok, (f"live states {base} -> {mid['live_states']} -> {end['live_states']}, scratch of 50 "
                f"backward sites {scratch} bytes, XLA bytes {mem0} -> {mem1}, modules {modules}")


TABLE: list[tuple] = []

# The traffic model's predictions (docs/gpu-traffic.md), keyed by (call, dtype, n, rows).
try:
    MODEL = {(c["kind"], c["dtype"], c["n"], c["rows"]): c for c in json.loads(
        (Path(__file__).resolve().parent.parent / "docs/gpu-traffic.json").read_text())["calls"]}
except (OSError, ValueError, KeyError):
    MODEL = {}


def predicted_gbs(kind: str, dtype: str, M: int, N: int, counted: int, copy_gbs: float):
    """The model's GB/s for this call in this table's units (`counted` bytes per call), scaled
    to this device's copy: (text, value or None)."""
    short = {"bfloat16": "bf16", "float32": "f32"}.get(dtype, dtype)
    m = MODEL.get((kind, short, N, M))
    mark = ""
    if m is None:
        near = [c for (k, d, n, _), c in MODEL.items() if (k, d, n) == (kind, short, N)]
        if not near:
            return "-", None
        m, mark = near[0], "~"
    # The call moves its minimum bytes at predicted_fraction of the peak, where a copy gets the
    # peak: in this table's units (the row arrays only, a hair under the minimum) the same.
    value = m["predicted_fraction"] * copy_gbs * min(1.0, counted / m["minimum_bytes"] * m["rows"]
                                                     * m["n"] / (M * N))
    return f"{mark}{value:.0f}", value


@section("bandwidth", needs=60)
def bandwidth():
    dev = gpu()
    info = _native.gpu_info()
    l2 = gpu_common.l2_bytes(info)
    others = gpu_common.optional_norms()
    for name, found in others.items():
        if isinstance(found, str):
            record("bandwidth", **{name: found})
    pallas, tokamax_norm = (f if callable(f) else None for f in (others["pallas"], others["tokamax"]))
    Ms = (4096,) if OPTS.quick else (4096, 16384)
    Ns = (1024, 4096) if OPTS.quick else (1024, 4096, 8192, 16384)
    for dt in (jnp.bfloat16, jnp.float32):
        for M in Ms:
            for N in Ns:
                if left() < 200:  # the rest is the profile's and the sanitizer's
                    record("bandwidth", stopped="time")
                    return True, f"{len(TABLE)} shapes (stopped for time)"
                nbytes = M * N * jnp.dtype(dt).itemsize
                k = int(min(64, max(1, -(-4 * l2 // nbytes))))
                # 2k buffers: timed() runs k of them, then all of them.
                keys = jax.random.split(jax.random.key(1), 2 * k)
                make = jax.jit(lambda kk: jax.random.normal(kk, (M, N), dt))  # on the GPU
                xs = [make(kk) for kk in keys]
                w = on(dev, jnp.ones((N,), dt))
                c = jnp.asarray(1.0001, dt)
                rs = [rmsnorm_ffi.rms_norm_fwd(x, w)[1] for x in xs]
                row = {"dtype": jnp.dtype(dt).name, "M": M, "N": N, "k": k}
                # dy and the residual: the next buffer of the rotation (dy = x would let XLA's
                # fused jnp backward read one array for both).
                nxt = [xs[(i + 1) % len(xs)] for i in range(len(xs))]
                ones = [(x,) for x in xs]
                pairs = list(zip(xs, nxt))
                ref = rmsnorm_ffi.rms_norm_reference
                vjp_at = lambda f: lambda x, dy: jax.vjp(f, x)[1](dy)[0]  # noqa: E731
                jobs = {
                    "copy": (lambda x: x * c, ones),
                    "fwd": (lambda x: rmsnorm_ffi.rms_norm_fwd(x, w)[0], ones),
                    "bwd": (lambda x, r, dy: rmsnorm_ffi.rms_norm_bwd(x, w, r, dy)[0],
                            list(zip(xs, rs, nxt))),
                    "res": (lambda x, r: rmsnorm_ffi.rms_norm_residual(x, r, w), pairs),
                    "jnp_res": (lambda x, r: (ref(x + r, w), x + r), pairs),
                    "jnp_fwd": (lambda x: ref(x, w), ones),
                    "jnp_bwd": (vjp_at(lambda x: ref(x, w)), pairs),
                }
                if pallas is not None:
                    pf = lambda x: pallas(x, w)  # noqa: E731
                    jobs["pallas_fwd"] = (pf, ones)
                    jobs["pallas_bwd"] = (vjp_at(pf), pairs)
                if tokamax_norm is not None:  # RMS norm: no mean subtracted, no offset
                    tf = lambda x: tokamax_norm(x, w)  # noqa: E731
                    jobs["tokamax_fwd"] = (tf, ones)
                    jobs["tokamax_bwd"] = (vjp_at(tf), pairs)
                for name, (fn, args) in jobs.items():
                    try:
                        row[name], row[f"{name}_whole"] = timed(fn, args, k)
                    except Exception as e:  # noqa: BLE001 - ours must time; the others may not run
                        if not name.startswith(("pallas", "tokamax")):
                            raise
                        row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
                gb = lambda t, reads: reads * nbytes / t / 1e9  # noqa: E731
                row["copy_GBs"] = gb(row["copy"], 2)
                row["fwd_GBs"] = gb(row["fwd"], 2)
                row["bwd_GBs"] = gb(row["bwd"], 3)
                row["res_GBs"] = gb(row["res"], 4)  # reads x and r, writes h and y
                for kind, reads in (("fwd", 2), ("bwd", 3), ("res", 4)):
                    text, value = predicted_gbs(kind, row["dtype"], M, N, reads * nbytes,
                                                row["copy_GBs"])
                    row[f"model_{kind}"] = text
                    if value is not None:
                        row[f"model_{kind}_GBs"] = value
                record("bandwidth", **row)
                TABLE.append(row)
                del xs, rs, nxt, ones, pairs, jobs
    return True, f"{len(TABLE)} shapes timed"


@section("profile", needs=150)
def profile():
    """Nsight Compute on the profile child (if ncu is there): its report in $OUT/ncu.txt. A
    diagnosis for the traffic model, not a check: a profiler that cannot read the counters here
    is reported, not failed."""
    tool = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not os.path.exists(tool):
        record("profile", status="absent")
        return True, "ncu not found: not run"
    log = OUT / "ncu.txt"
    prefix = [tool, "--target-processes", "all", "--launch-count", "24", "--section", "SpeedOfLight",
              "--section", "MemoryWorkloadAnalysis", "--section", "Occupancy", "--section",
              "LaunchStats", "--section", "WarpStateStats", "--section", "SchedulerStats",
              # Executed instructions per kernel: against the bytes it moves, the dynamic count
              # of what tests/cuda_emulator/sass.py reads statically (instructions per pack).
              "--section", "InstructionStats", "--log-file", str(log)]
    try:
        rc, out = run_child("profile", timeout=min(120, left() - 100), prefix=prefix)
    except subprocess.TimeoutExpired:
        return True, "ncu: timeout (not a failure)"
    record("profile", rc=rc, log=out[-3000:])
    return True, f"ncu rc {rc}, report in {log.name}" + ("" if rc == 0 else " (not a failure)")


@section("sanitizer", needs=90)
def sanitizer():
    tool = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(tool):
        record("sanitizer", status="absent")
        return True, "compute-sanitizer not found: not run"
    results = {}
    for check in ("memcheck", "racecheck", "synccheck"):
        if left() < 30:
            results[check] = "skipped (time)"
            continue
        prefix = [tool, "--tool", check, "--error-exitcode", "99", "--kernel-name", "kns=rmsnorm"]
        try:
            rc, log = run_child("sanitize", timeout=min(100, left() - 10), prefix=prefix)
            results[check] = "clean" if rc == 0 else f"rc {rc}"
            record("sanitizer", tool=check, rc=rc, log=log[-3000:])
        except subprocess.TimeoutExpired:
            results[check] = "timeout"
    ok = all(v in ("clean", "skipped (time)") for v in results.values())
    return ok, ", ".join(f"{k}: {v}" for k, v in results.items())


def table() -> str:
    lines = RUN.summary_lines()
    if TABLE:
        lines += ["", f"{'dtype':9s} {'M':>6s} {'N':>6s} {'copy GB/s':>9s} {'fwd GB/s':>8s} {'model':>6s} "
                  f"{'/copy':>6s} {'jnp/fwd':>7s} {'pal/fwd':>7s} {'tok/fwd':>7s} {'bwd GB/s':>8s} {'model':>6s} "
                  f"{'/copy':>6s} {'jnp/bwd':>7s} {'pal/bwd':>7s} {'tok/bwd':>7s} {'res GB/s':>8s} {'model':>6s} "
                  f"{'/copy':>6s} {'jnp/res':>7s}"]

        def ratio(r, key, ours):
            return f"{r[key] / r[ours]:7.2f}" if key in r else "      -"

        for r in TABLE:
            lines.append(
                f"{r['dtype']:9s} {r['M']:6d} {r['N']:6d} {r['copy_GBs']:9.0f} {r['fwd_GBs']:8.0f} "
                f"{r.get('model_fwd', '-'):>6s} {r['fwd_GBs'] / r['copy_GBs']:6.1%} {r['jnp_fwd'] / r['fwd']:7.2f} "
                f"{ratio(r, 'pallas_fwd', 'fwd')} {ratio(r, 'tokamax_fwd', 'fwd')} "
                f"{r['bwd_GBs']:8.0f} {r.get('model_bwd', '-'):>6s} {r['bwd_GBs'] / r['copy_GBs']:6.1%} "
                f"{r['jnp_bwd'] / r['bwd']:7.2f} {ratio(r, 'pallas_bwd', 'bwd')} {ratio(r, 'tokamax_bwd', 'bwd')} "
                f"{r['res_GBs']:8.0f} {r.get('model_res', '-'):>6s} {r['res_GBs'] / r['copy_GBs']:6.1%} "
                f"{r['jnp_res'] / r['res']:7.2f}")
        lines.append("(times: what each further call in one executable adds, without its dispatch and sync; "
                     "ratios jnp/ours, pallas/ours and tok(amax)/ours > 1: ours faster; bwd counts x, dy, dx; "
                     "res counts x, r, h, y against jnp's x + r then jnp's norm; model: docs/gpu-traffic.md's "
                     "prediction scaled to the measured copy, ~ from the sweep's shape of that row length)")
    return "\n".join(lines)


RUN.finish(table(), OUT)

"""GPU check for the CUDA RMS norm: correctness against a float64 reference, then timings.

Run on a machine with an NVIDIA GPU and jax with a CUDA plugin (no Rust needed):

    pip install --no-deps dist/rmsnorm_ffi-*.whl   # the abi3 wheel built elsewhere
    python bench/gpu_check.py [--quick]

1. Correctness: rms_norm_fwd / rms_norm_bwd / grad of rms_norm for float32, bfloat16, float16
   and float64 (x64 on), with and without a weight (x's dtype and float32), odd row lengths
   (scalar path), short and long rows, a vmapped (batched) weight, against numpy float64.
2. Timings, per iteration of a jitted fori_loop (so dispatch does not count), for
   M in {4096, 16384} x N in {1024, 4096, 8192, 16384}, bfloat16 and float32: forward and
   backward (with weight) against a device copy (y = x * c, same bytes in and out) and against
   jnp. GB/s counts the bytes an op must move: forward x + y, backward x + dy + dx.
   Targets (H200): forward bf16, N >= 4096, >= 90% of copy bandwidth; backward >= 85%; both
   faster than jnp. The table prints last.
"""

from __future__ import annotations

import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import rmsnorm_ffi  # noqa: E402

QUICK = "--quick" in sys.argv


def ref_np(x, w, eps, dy):
    x = np.asarray(x, np.float64)
    dy = np.asarray(dy, np.float64)
    n = x.shape[-1]
    r = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    wf = np.ones(n) if w is None else np.asarray(w, np.float64)
    y = x * r * wf
    g = dy * wf
    dx = r * g - x * r**3 / n * (g * x).sum(-1, keepdims=True)
    lead = x.shape[:-1]
    if w is not None and np.asarray(w).ndim > 1:
        dw = (dy * x * r).reshape(np.asarray(w).shape[:-1] + (-1, n)).sum(-2)
    else:
        dw = (dy * x * r).reshape(-1, n).sum(0)
    return y, r[..., 0], dx, dw, lead


TOL = {jnp.float32: 2e-5, jnp.float64: 1e-12, jnp.bfloat16: 2e-2, jnp.float16: 2e-3}


def close(name, got, want, tol, scale=1.0):
    got = np.asarray(jnp.asarray(got).astype(jnp.float64))
    want = np.asarray(want, np.float64)
    err = np.max(np.abs(got - want) / (np.abs(want) + scale)) if want.size else 0.0
    ok = bool(err <= tol) and got.shape == want.shape
    print(f"  {'ok ' if ok else 'BAD'} {name:60s} rel.err {err:.2e} (tol {tol:.0e})")
    return ok


def correctness() -> bool:
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
    print("registered platforms:", rmsnorm_ffi.register())
    rng = np.random.default_rng(0)
    ok = True
    shapes = [(3, 8), (5, 1000), (7, 1003), (64, 4096), (9, 16384), (4, 40000), (0, 16), (2, 3, 512)]
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64):
        tol = TOL[dtype]
        for shape in shapes:
            for wkind in (None, "same", "f32"):
                if wkind == "f32" and dtype == jnp.float32:
                    continue
                x = jnp.asarray(rng.standard_normal(shape), dtype)
                dy = jnp.asarray(rng.standard_normal(shape), dtype)
                n = shape[-1]
                w = None
                if wkind:
                    wd = dtype if wkind == "same" else jnp.float32
                    w = jnp.asarray(rng.uniform(0.5, 1.5, n), wd)
                y, r, dx, dw, _ = ref_np(x, w, 1e-5, dy)
                tag = f"{jnp.dtype(dtype).name} {shape} w={wkind}"
                gy, gr = jax.jit(lambda x, w: rmsnorm_ffi.rms_norm_fwd(x, w, 1e-5))(x, w)
                ok &= close(f"fwd y    {tag}", gy, y, tol)
                ok &= close(f"fwd rstd {tag}", gr, r, tol)
                gdx, gdw = jax.jit(rmsnorm_ffi.rms_norm_bwd)(x, w, gr, dy)
                ok &= close(f"bwd dx   {tag}", gdx, dx, tol * 4)
                if w is not None:
                    rows = max(1, int(np.prod(shape[:-1])))
                    wtol = max(tol, TOL[jnp.float32]) if wkind == "f32" else tol  # dw has w's dtype
                    ok &= close(f"bwd dw   {tag}", gdw, dw, wtol * 4, scale=np.sqrt(rows))
    # grad through custom_vjp, and a batched (vmapped) weight.
    x = jnp.asarray(rng.standard_normal((4, 32, 256)), jnp.float32)
    w = jnp.asarray(rng.uniform(0.5, 1.5, (4, 256)), jnp.float32)
    dy = jnp.ones_like(x)
    y, _, dx, dw, _ = ref_np(x, w[:, None, :], 1e-5, dy)
    f = jax.vmap(lambda x, w: rmsnorm_ffi.rms_norm(x, w))
    ok &= close("vmap fwd batched weight", jax.jit(f)(x, w), y, 2e-5)
    gx, gw = jax.jit(jax.grad(lambda x, w: f(x, w).sum(), argnums=(0, 1)))(x, w)
    ok &= close("vmap grad dx batched weight", gx, dx, 1e-4)
    dw_ref = (np.asarray(dy, np.float64) * np.asarray(x, np.float64) * (1 / np.sqrt((np.asarray(x, np.float64) ** 2).mean(-1, keepdims=True) + 1e-5))).sum(1)
    ok &= close("vmap grad dw batched weight", gw, dw_ref, 1e-4, scale=6.0)
    # Determinism of the weight gradient.
    x = jnp.asarray(rng.standard_normal((4096, 4096)), jnp.bfloat16)
    w = jnp.ones(4096, jnp.bfloat16)
    _, r = rmsnorm_ffi.rms_norm_fwd(x, w)
    a = np.asarray(rmsnorm_ffi.rms_norm_bwd(x, w, r, x)[1].astype(jnp.float32))
    b = np.asarray(rmsnorm_ffi.rms_norm_bwd(x, w, r, x)[1].astype(jnp.float32))
    same = bool(np.array_equal(a, b))
    print(f"  {'ok ' if same else 'BAD'} weight gradient bitwise reproducible")
    ok &= same
    print("stats:", {k: v for k, v in rmsnorm_ffi.stats().items() if k != "states"})
    return ok


def per_iter(step, init, iters):
    """Seconds per iteration of `step` chained `iters` times in one jitted loop (best of 5)."""
    loop = jax.jit(lambda c: jax.lax.fori_loop(0, iters, lambda i, c: step(c), c))
    jax.block_until_ready(loop(init))
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(loop(init))
        best = min(best, time.perf_counter() - t)
    return best / iters


def timings():
    rows = []
    Ms = (4096,) if QUICK else (4096, 16384)
    Ns = (1024, 4096) if QUICK else (1024, 4096, 8192, 16384)
    for dtype in (jnp.bfloat16, jnp.float32):
        for M in Ms:
            for N in Ns:
                key = jax.random.PRNGKey(0)
                x = jax.random.normal(key, (M, N), dtype)
                w = jnp.ones(N, dtype)
                c = jnp.asarray(1.0001, dtype)
                nbytes = M * N * jnp.dtype(dtype).itemsize
                iters = max(10, min(200, int(2e10 / max(nbytes, 1) / 100)))
                t_copy = per_iter(lambda x: x * c, x, iters)
                t_fwd = per_iter(lambda x: rmsnorm_ffi.rms_norm_fwd(x, w)[0], x, iters)
                t_jfwd = per_iter(lambda x: rmsnorm_ffi._ops.rms_norm_reference(x, w), x, iters)
                _, r = rmsnorm_ffi.rms_norm_fwd(x, w)

                def bwd(dy):
                    return rmsnorm_ffi.rms_norm_bwd(x, w, r, dy)[0]

                def jbwd(dy):
                    _, vjp = jax.vjp(lambda x, w: rmsnorm_ffi._ops.rms_norm_reference(x, w), x, w)
                    return vjp(dy)[0]

                t_bwd = per_iter(bwd, x, iters)
                t_jbwd = per_iter(jbwd, x, iters)
                copy_bw = 2 * nbytes / t_copy / 1e9
                fwd_bw = 2 * nbytes / t_fwd / 1e9
                bwd_bw = 3 * nbytes / t_bwd / 1e9
                rows.append((jnp.dtype(dtype).name, M, N, copy_bw, fwd_bw, fwd_bw / copy_bw, t_jfwd / t_fwd,
                             bwd_bw, bwd_bw / copy_bw, t_jbwd / t_bwd))
                print(rows[-1], flush=True)
    print()
    print(f"{'dtype':8s} {'M':>6s} {'N':>6s} {'copy GB/s':>10s} {'fwd GB/s':>9s} {'fwd/copy':>8s} {'jnp/fwd':>8s}"
          f" {'bwd GB/s':>9s} {'bwd/copy':>8s} {'jnp/bwd':>8s}")
    for d, M, N, cb, fb, fr, fj, bb, br, bj in rows:
        print(f"{d:8s} {M:6d} {N:6d} {cb:10.0f} {fb:9.0f} {fr:8.1%} {fj:8.2f} {bb:9.0f} {br:8.1%} {bj:8.2f}")
    print("(targets: bf16 N>=4096 fwd/copy >= 90%, bwd/copy >= 85%, jnp/fwd and jnp/bwd > 1)")


if __name__ == "__main__":
    good = correctness()
    print("CORRECTNESS:", "PASS" if good else "FAIL", flush=True)
    timings()
    sys.exit(0 if good else 1)

"""RMS norm benchmark suite: ours against the floor and the jnp reference, measured side by
side in one run, reported as ratios.

For each shape and dtype it times (best of --reps after warm-up, variants interleaved in a shuffled
order so that drift and cache state hit them alike):
  forward:          ours `rms_norm(x, w)`, floor `x * c`, jnp reference;
  forward+backward: ours `jax.vjp(rms_norm, x, w)` then the pullback, floor `x * dy * c`,
                    jnp reference the same way.
The order of the variants is shuffled every round. The floor moves the same bytes with the same
output allocation; a forward pass cannot beat it by much. Prints a table and writes a PNG plot (needs matplotlib; `make bench` installs it).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import rmsnorm_ffi
from rmsnorm_ffi import rms_norm, rms_norm_reference

SHAPES = [(256, 4096), (64, 16384), (4096, 4096), (16384, 1024), (8, 128)]
DTYPES = ["float32", "bfloat16"]


def variants(dtype):
    c = jnp.asarray(1.0001, dtype)

    def vjp_of(f):
        def run(x, w, dy):
            _, pullback = jax.vjp(f, x, w)
            return pullback(dy)

        return jax.jit(run)

    return {
        "fwd ours": (jax.jit(lambda x, w, dy: rms_norm(x, w)), "x,w,dy"),
        "fwd floor": (jax.jit(lambda x, w, dy: x * c), "x,w,dy"),
        "fwd jnp": (jax.jit(lambda x, w, dy: rms_norm_reference(x, w)), "x,w,dy"),
        "fwd+bwd ours": (vjp_of(rms_norm), "x,w,dy"),
        "fwd+bwd floor": (jax.jit(lambda x, w, dy: x * dy * c), "x,w,dy"),
        "fwd+bwd jnp": (vjp_of(rms_norm_reference), "x,w,dy"),
    }


def measure(shape, dtype, reps):
    key = jax.random.key(0)
    x = jax.random.normal(key, shape, jnp.float32).astype(dtype)
    dy = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(dtype)
    w = (1.0 + 0.1 * jax.random.normal(jax.random.key(2), shape[-1:], jnp.float32)).astype(dtype)
    fns = variants(dtype)
    for fn, _ in fns.values():  # compile and warm up
        for _ in range(3):
            jax.block_until_ready(fn(x, w, dy))
    best = {name: float("inf") for name in fns}
    if np.prod(shape) <= 1 << 16:
        reps *= 10  # small shapes: cheap, and dispatch noise needs more samples
    order = list(fns.items())
    rng = np.random.default_rng(0)
    for _ in range(reps):
        # A new order each round: every variant follows every other one, so none is always
        # timed after a cache-thrashing neighbour.
        rng.shuffle(order)
        for name, (fn, _) in order:
            start = time.perf_counter()
            jax.block_until_ready(fn(x, w, dy))
            best[name] = min(best[name], time.perf_counter() - start)
    return {k: v * 1e3 for k, v in best.items()}  # ms


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=30, help="timed runs per variant (best is kept)")
    parser.add_argument("--out", default="bench/out", help="folder for results.json and rmsnorm_cpu.png")
    parser.add_argument("--quick", action="store_true", help="small shapes only, few reps (smoke test)")
    args = parser.parse_args()
    shapes = [(8, 128), (64, 256)] if args.quick else SHAPES
    reps = 3 if args.quick else args.reps
    os.makedirs(args.out, exist_ok=True)

    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} cores, best of {reps}")
    header = (
        f"{'shape':>12} {'dtype':>9} | {'fwd ms':>8} {'/floor':>7} {'/jnp':>6} | "
        f"{'f+b ms':>8} {'/floor':>7} {'/jnp':>6} | {'floor f':>8} {'jnp f':>8} {'floor fb':>8} {'jnp fb':>8}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for dtype in DTYPES:
        for shape in shapes:
            t = measure(shape, dtype, reps)
            row = {
                "shape": list(shape),
                "dtype": dtype,
                **t,
                "fwd / floor": t["fwd ours"] / t["fwd floor"],
                "fwd / jnp": t["fwd ours"] / t["fwd jnp"],
                "fwd+bwd / floor": t["fwd+bwd ours"] / t["fwd+bwd floor"],
                "fwd+bwd / jnp": t["fwd+bwd ours"] / t["fwd+bwd jnp"],
            }
            rows.append(row)
            print(
                f"{'x'.join(map(str, shape)):>12} {dtype:>9} | {t['fwd ours']:8.3f} {row['fwd / floor']:6.2f}x "
                f"{row['fwd / jnp']:5.2f}x | {t['fwd+bwd ours']:8.3f} {row['fwd+bwd / floor']:6.2f}x "
                f"{row['fwd+bwd / jnp']:5.2f}x | {t['fwd floor']:8.3f} {t['fwd jnp']:8.3f} "
                f"{t['fwd+bwd floor']:8.3f} {t['fwd+bwd jnp']:8.3f}",
                flush=True,
            )
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"jax": jax.__version__, "reps": reps, "rows": rows, "stats": rmsnorm_ffi.stats()["executions"]}, f, indent=1)
    plot(rows, os.path.join(args.out, "rmsnorm_cpu.png"))


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    labels = [f"{'x'.join(map(str, r['shape']))}\n{r['dtype']}" for r in rows]
    series = [
        ("fwd: ours / floor", "fwd / floor"),
        ("fwd: jnp / floor", None),
        ("fwd+bwd: ours / floor", "fwd+bwd / floor"),
        ("fwd+bwd: jnp / floor", None),
    ]
    values = {
        "fwd: ours / floor": [r["fwd / floor"] for r in rows],
        "fwd: jnp / floor": [r["fwd jnp"] / r["fwd floor"] for r in rows],
        "fwd+bwd: ours / floor": [r["fwd+bwd / floor"] for r in rows],
        "fwd+bwd: jnp / floor": [r["fwd+bwd jnp"] / r["fwd+bwd floor"] for r in rows],
    }
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 1.1), 4.5))
    width = 0.2
    xs = np.arange(len(rows))
    for i, (name, _) in enumerate(series):
        ax.bar(xs + (i - 1.5) * width, values[name], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_ylabel("time / floor (lower is better)")
    ax.set_yscale("log")
    ax.set_title(f"rmsnorm_ffi on CPU ({os.cpu_count()} cores), jax {jax.__version__}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()

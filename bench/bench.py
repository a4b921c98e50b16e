"""RMS norm benchmark suite: ours against the floor and the jnp reference, measured side by
side in one run, reported as ratios.

For each shape and dtype it times --reps rounds after warm-up (more at the small and the
cache-resident shapes: see `rounds_for`), each round timing every variant once in a new
shuffled order, so that drift and cache state hit them alike:
  forward:          ours `rms_norm(x, w)`, floor `x * c`, jnp reference;
  forward+backward: ours `jax.vjp(rms_norm, x, w)` then the pullback, floor `x * dy * c`,
                    jnp reference the same way.
Times are medians over the rounds; a ratio is the median over rounds of that round's ratio, printed
with its 25th-75th percentile spread (the statistic the speed targets are stated in). The floor
moves the same bytes, into outputs of the same sizes (where they land differs: see "Output
buffers" below); a forward pass cannot beat it by much. Prints a table and writes a PNG plot (needs matplotlib; `make bench` installs it).

Output buffers (what moves the ratios at the cache-resident shapes): every variant allocates its
outputs with malloc, and a 4 MiB output that reuses a block another variant just freed starts
with its lines in cache, where a new block must fetch them. XLA's CPU client runs a computation
it estimates at under 1000 flops inline, on the calling thread, and a lone custom call counts as
unknown (-1) flops; so our jitted calls allocate on the Python thread (glibc's main arena),
while `x * c`, jnp's norm and the add-then-our-norm run on XLA's executor threads and allocate
from those threads' arena. Each group recycles cache-warm blocks within the group only, so the
floor's "same output allocation" holds for the bytes but not for where they land. Timed right
after each other variant (40 rounds, 256x4096 and 64x16384 float32), our forward took 0.99-1.34x
the floor's time after a variant that ran on XLA's threads and 0.93-1.03x after one that ran
inline. --one-arena sets glibc's malloc to one arena (`mallopt(M_ARENA_MAX, 1)`, before JAX
starts its threads), so that all variants draw on one pool: there, 0.82-1.12x and 0.74-0.92x.
It is not the default because it is not neutral either: it tends to slow XLA's asynchronous
runs, which flatters ours (the 8x128 float32 floor: a median 0.056 ms over 7 runs with one arena,
0.023-0.071, against 0.012 ms over 7 without, 0.011-0.073).
--evict adds 1 to a buffer of twice the L3 cache (at least 64 MiB) before every timed call, so
that every variant starts from memory whichever ran before it: the kernels compared with nothing
recycled warm. Not the default either: the targets at 256x4096 and 64x16384 are about shapes
whose data stays in cache from call to call, and eviction takes that from every variant. One run
(all shapes and dtypes, 2-core VM): float32 forward 0.90x and 0.84x the floor there, bfloat16
0.91x and 0.86x, forward+backward 1.00-1.06x, the large shapes' forward 0.99-1.07x.

Then the accuracy sweep of `accuracy.py`: the errors of ours and of the jnp reference against a
long-double truth, float32 rows to one row of 2^26 and the weight gradient over 2^20 rows,
float64 at rows of 2^20 and over 2^16 rows (--quick: three small shapes; --no-accuracy skips it).

Then a sharded case, in a subprocess with --sharded-devices (default 4) forced host devices (the
device count is fixed when JAX starts): the training-step shape of the norm, `jax.grad` in x and
w of `sum(norm(x, w) * dy)`, rows sharded P("data") over a mesh of all the devices (explicit and
automatic), ours against the jnp reference on the same mesh. What it reports, per variant:
  wall ms:   the wall time of one sharded step on all the devices (not a per-device time), best
             of the reps;
  /1dev:     wall over the same step on the whole batch on one device, timed in the same loop.
             The forced devices share this machine's cores, so split rows cost about what one
             device does (less where smaller per-device buffers fault and cache better);
  repl ms:   the same step with x replicated instead of sharded, so that every device does every
             row: what replicated work costs, measured rather than inferred (a step that all-
             gathered its rows would cost about this);
  gathers:   all-gather ops in the compiled sharded program (0: no operand is gathered);
  ours/jnp:  our sharded wall time over the jnp reference's on the same mesh.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time


def one_malloc_arena() -> bool:
    """Sets glibc's malloc to one arena (--one-arena: see "Output buffers" above); false where
    this is not glibc, or where it refused."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_arena_max = -8  # glibc's malloc.h
    return mallopt(ctypes.c_int(m_arena_max), ctypes.c_int(1)) == 1


# Before jax is imported, so before XLA's threads first allocate (a thread keeps its arena).
ONE_ARENA = "--one-arena" in sys.argv and one_malloc_arena()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import accuracy  # noqa: E402
import rmsnorm_ffi  # noqa: E402
from rmsnorm_ffi import layer_norm, rms_norm, rms_norm_reference, rms_norm_residual  # noqa: E402

# Narrow rows too: the demo's activations (1408x64), and rows of a head's width (64-128) over
# many tokens x heads, as per-head query/key norms take them.
SHAPES = [(256, 4096), (64, 16384), (4096, 4096), (16384, 1024), (8, 128),
          (1408, 64), (8192, 64), (16384, 128)]
DTYPES = ["float32", "bfloat16", "float16"]
SHARDED_SHAPES = [(1024, 4096), (16384, 1024)]  # float32; rows divisible by the devices
SHARDED_QUICK = [(256, 1024)]


def flax_layer_norm(x, w, b, eps=1e-5):
    """`flax.linen.LayerNorm(epsilon=eps)` applied with scale `w` and bias `b`: Flax itself where
    it is installed, else its default math in jnp (statistics in float32, the one-pass
    variance, the result in the promotion of x and the parameters)."""
    try:
        import flax.linen as nn
    except ImportError:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, -1, keepdims=True)
        var = jnp.maximum(jnp.mean(xf * xf, -1, keepdims=True) - mean * mean, 0.0)
        y = (xf - mean) * (jax.lax.rsqrt(var + eps) * w) + b
        return y.astype(jnp.result_type(x, w, b))
    return nn.LayerNorm(epsilon=eps).apply({"params": {"scale": w, "bias": b}}, x)


def variants(dtype):
    # Not 1 in any dtype: 1.0001 rounds to 1 in bfloat16, and XLA folds `x * 1` into a copy,
    # which made the bfloat16 forward floor a copy rather than a pass that multiplies.
    c = jnp.asarray(1.25, dtype)

    def vjp_of(f):
        def run(x, w, dy):
            _, pullback = jax.vjp(f, x, w)
            return pullback(dy)

        return jax.jit(run)

    # The drop-in variants, beside the plain op: a scale offset (Gemma's 1 + w), a weight of the
    # other dtype (float32 x with a bfloat16 weight, bfloat16 x with a float32 one: `wo`, made
    # outside the timed program, as a model holds its parameters; a cast inside it made XLA run
    # the program on its threads rather than inline, 1.2-1.4x at 256x4096 and 64x16384), and the
    # fused residual's gradient (through y and h, dx rounded once) against the add then the norm.
    offset = lambda x, w: rms_norm(x, w, scale_offset=1.0)  # noqa: E731

    def residual_grad(fused):
        def f(x, r, w):
            return rms_norm_residual(x, r, w) if fused else (rms_norm(x + r, w), x + r)

        # The outputs are returned too, as a training step's next layer reads them: otherwise
        # XLA drops the unfused norm's forward (its backward takes eps), not the fused one's (h).
        def run(x, w, dy):
            out, pullback = jax.vjp(f, x, dy, w)
            return out, pullback((dy, dy))

        return jax.jit(run)

    # LayerNorm against flax.linen.LayerNorm under jit (its default math: the one-pass
    # `E[x^2] - E[x]^2` variance), weight and bias, the gradient in all three.
    def vjp3(f):
        def run(x, w, b, dy):
            _, pullback = jax.vjp(f, x, w, b)
            return pullback(dy)

        return jax.jit(run)

    return {
        "ln fwd ours": (jax.jit(lambda x, w, b: layer_norm(x, w, b)), "x,w,b"),
        "ln fwd jnp": (jax.jit(flax_layer_norm), "x,w,b"),
        "ln fwd+bwd ours": (vjp3(layer_norm), "x,w,b,dy"),
        "ln fwd+bwd jnp": (vjp3(flax_layer_norm), "x,w,b,dy"),
        "fwd ours": (jax.jit(lambda x, w, dy: rms_norm(x, w)), "x,w,dy"),
        "fwd floor": (jax.jit(lambda x, w, dy: x * c), "x,w,dy"),
        "fwd jnp": (jax.jit(lambda x, w, dy: rms_norm_reference(x, w)), "x,w,dy"),
        "fwd+bwd ours": (vjp_of(rms_norm), "x,w,dy"),
        "fwd+bwd floor": (jax.jit(lambda x, w, dy: x * dy * c), "x,w,dy"),
        "fwd+bwd jnp": (vjp_of(rms_norm_reference), "x,w,dy"),
        # The residual add of a pre-norm block (dy stands in for the residual): fused, the
        # add then our norm, the add then jnp's norm. Each returns (y, h).
        "res fused": (jax.jit(lambda x, w, dy: rms_norm_residual(x, dy, w)), "x,w,dy"),
        "res unfused": (jax.jit(lambda x, w, dy: (rms_norm(x + dy, w), x + dy)), "x,w,dy"),
        "res jnp": (jax.jit(lambda x, w, dy: (rms_norm_reference(x + dy, w), x + dy)), "x,w,dy"),
        "fwd offset": (jax.jit(lambda x, w, dy: offset(x, w)), "x,w,dy"),
        "fwd+bwd offset": (vjp_of(offset), "x,w,dy"),
        "fwd mixed": (jax.jit(lambda x, wo, dy: rms_norm(x, wo)), "x,wo,dy"),
        "fwd+bwd mixed": (vjp_of(rms_norm), "x,wo,dy"),
        "res grad fused": (residual_grad(True), "x,w,dy"),
        "res grad unfused": (residual_grad(False), "x,w,dy"),
    }


def rounds_for(shape, reps: int) -> int:
    """Rounds for one shape: `reps`, times 10 up to 64K elements and times 5 up to 1M. A round
    of the small and of the cache-resident shapes (where the speed targets are stated) takes
    about 0.1 and 10 ms, and their per-round ratios spread widest: at 256x4096 float32 a
    25th-75th percentile of about 0.8-1.5x (forward) and 1.6-3.4x (forward+backward), so at 30
    rounds the median's standard error was about 0.12x and 0.25x; 150 rounds cut that by sqrt(5).
    (Runs of 150 rounds of the same build still differ by more than that: part of the noise
    moves whole runs.) The large shapes keep `reps`: a round takes about 0.3 s there."""
    elements = int(np.prod(shape))
    if elements <= 1 << 16:
        return reps * 10
    if elements <= 1 << 20:
        return reps * 5
    return reps


def eviction_buffer(evict: bool):
    """With --evict, a float32 buffer of twice the L3 cache this machine reports (at least 64
    MiB), which `measure` adds 1 to before every timed call; else None. The add reads and writes
    every line with ordinary loads and stores (a fill might not: glibc's memset streams past the
    caches above a threshold it derives from the L3 size, which differs by version and CPU), so
    whatever x, the weight and the output blocks held in cache is gone, and every variant starts
    from memory whichever ran before it."""
    if not evict:
        return None
    try:
        l3 = os.sysconf("SC_LEVEL3_CACHE_SIZE")
    except (ValueError, OSError):
        l3 = 0
    return np.zeros(max(2 * max(l3, 0), 64 << 20) // 4, np.float32)


def measure(shape, dtype, reps, evict=None):
    """Per variant, its wall time (ms) in each of `rounds_for(shape, reps)` rounds; every
    round times every variant once, in a new shuffled order. With `evict` (an
    `eviction_buffer`), every timed call starts with the caches evicted."""
    key = jax.random.key(0)
    x = jax.random.normal(key, shape, jnp.float32).astype(dtype)
    dy = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(dtype)
    w = (1.0 + 0.1 * jax.random.normal(jax.random.key(2), shape[-1:], jnp.float32)).astype(dtype)
    other = jnp.bfloat16 if jnp.dtype(dtype) == jnp.float32 else jnp.float32
    b = (0.1 * jax.random.normal(jax.random.key(3), shape[-1:], jnp.float32)).astype(dtype)
    values = {"x": x, "w": w, "b": b, "dy": dy, "wo": w.astype(other)}
    # Each variant's arguments, as its spec names them.
    fns = {name: (fn, [values[a] for a in spec.split(",")]) for name, (fn, spec) in variants(dtype).items()}
    for fn, args in fns.values():  # compile and warm up
        for _ in range(3):
            jax.block_until_ready(fn(*args))
    times = {name: [] for name in fns}
    order = list(fns.items())
    rng = np.random.default_rng(0)
    for _ in range(rounds_for(shape, reps)):
        # A new order each round: every variant follows every other one, so none is always
        # timed after a cache-thrashing neighbour.
        rng.shuffle(order)
        for name, (fn, args) in order:
            if evict is not None:
                np.add(evict, 1, out=evict)
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def ratio(times: dict, num: str, den: str) -> tuple[float, float, float]:
    """The median over rounds of the per-round ratio num/den, with its 25th and 75th
    percentiles: each round times both variants back to back, so the ratio cancels the drift
    that moves both (a best-of ratio takes its two times from different rounds)."""
    r = np.asarray(times[num]) / np.asarray(times[den])
    return float(np.median(r)), float(np.percentile(r, 25)), float(np.percentile(r, 75))


def best_times(fns: dict, args: dict, reps: int) -> dict:
    """Best wall time (ms) of each `fns[name](*args[name])`, the order shuffled every round."""
    for name, fn in fns.items():
        for _ in range(3):
            jax.block_until_ready(fn(*args[name]))
    best = {name: float("inf") for name in fns}
    order = list(fns)
    rng = np.random.default_rng(0)
    for _ in range(reps):
        rng.shuffle(order)
        for name in order:
            start = time.perf_counter()
            jax.block_until_ready(fns[name](*args[name]))
            best[name] = min(best[name], time.perf_counter() - start)
    return {k: v * 1e3 for k, v in best.items()}


def all_gathers(hlo: str) -> int:
    return len(re.findall(r"\ball-gather(-start)?\(", hlo))


def sharded_worker(devices: int, shapes, reps: int) -> list[dict]:
    """The sharded case (runs in the subprocess that has `devices` host devices): one dict per
    shape and mesh kind, times in ms."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    assert jax.device_count() == devices, (jax.device_count(), devices)
    norms = {"ours": rms_norm, "jnp": rms_norm_reference}

    def step(norm):
        return jax.jit(jax.grad(lambda x, w, dy: jnp.sum(norm(x, w) * dy), argnums=(0, 1)))

    rows = []
    for shape in shapes:
        x = jax.random.normal(jax.random.key(0), shape, jnp.float32)
        dy = jax.random.normal(jax.random.key(1), shape, jnp.float32)
        w = 1.0 + 0.1 * jax.random.normal(jax.random.key(2), shape[-1:], jnp.float32)
        # Every variant of this shape is timed in one shuffled loop, so drift hits them alike:
        # the whole batch on one device, then per mesh kind sharded and replicated x.
        one = [jax.device_put(a, jax.devices()[0]) for a in (x, w, dy)]
        fns = {(impl, "one device"): step(norm).lower(*one).compile() for impl, norm in norms.items()}
        fn_args = {key: one for key in fns}
        gathers = {}
        for kind, axis_type in (("explicit", AxisType.Explicit), ("auto", AxisType.Auto)):
            mesh = jax.make_mesh((devices,), ("data",), axis_types=(axis_type,))
            with jax.set_mesh(mesh):
                put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))  # noqa: E731
                operands = {"sharded": [put(x, "data"), put(w), put(dy, "data")], "replicated": [put(x), put(w), put(dy)]}
                for impl, norm in norms.items():
                    for variant, args in operands.items():
                        compiled = step(norm).lower(*args).compile()
                        fns[impl, kind, variant], fn_args[impl, kind, variant] = compiled, args
                        if variant == "sharded":
                            gathers[impl, kind] = all_gathers(compiled.as_text())
        t = best_times(fns, fn_args, reps)
        for kind in ("explicit", "auto"):
            for impl in norms:
                rows.append({
                    "shape": list(shape), "mesh": kind, "impl": impl, "devices": devices,
                    "wall ms": t[impl, kind, "sharded"], "one device ms": t[impl, "one device"],
                    "replicated ms": t[impl, kind, "replicated"], "all_gathers": gathers[impl, kind],
                    **({"jnp wall ms": t["jnp", kind, "sharded"]} if impl == "ours" else {}),
                })
    return rows


def run_sharded(devices: int, quick: bool, reps: int) -> list[dict]:
    """Runs `sharded_worker` in a fresh interpreter with `devices` forced host devices and
    prints its lines; returns its rows."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip())
    command = [sys.executable, os.path.abspath(__file__), "--sharded-worker", str(devices), "--reps", str(reps)]
    if quick:
        command.append("--quick")
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"sharded benchmark failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    print()
    print(f"sharded fwd+bwd (jax.grad of sum(norm(x, w) * dy) in x and w), float32, {devices} host devices, "
          f"rows sharded P('data'), best of {reps}")
    print(f"  wall = wall time of one step on all {devices} devices (not per device; they share this machine's "
          f"{os.cpu_count()} cores); /1dev = wall / the same step on one device (whole batch); "
          f"repl = x replicated instead, so every device does every row: replicated work costs that")
    for row in rows:
        print(
            f"  {'x'.join(map(str, row['shape'])):>11} {row['mesh']:>8} {row['impl']:>4} | "
            f"wall {row['wall ms']:8.3f} ms  /1dev {row['wall ms'] / row['one device ms']:5.2f}x "
            f"(1dev {row['one device ms']:8.3f} ms)  repl {row['replicated ms']:8.3f} ms | "
            f"all-gathers {row['all_gathers']}"
            + (f" | ours/jnp {row['wall ms'] / row['jnp wall ms']:5.2f}x" if "jnp wall ms" in row else ""),
            flush=True,
        )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=30, help="timed rounds (every variant once per round)")
    parser.add_argument("--out", default="bench/out", help="folder for results.json and rmsnorm_cpu.png")
    parser.add_argument("--quick", action="store_true", help="small shapes only, few reps (smoke test)")
    parser.add_argument("--shapes", help="comma-separated ROWSxN shapes instead of the suite's (e.g. 256x4096,64x16384)")
    parser.add_argument("--dtypes", help="comma-separated dtypes instead of the suite's (e.g. float32,bfloat16)")
    parser.add_argument("--no-accuracy", action="store_true", help="skip the accuracy sweep (about 2.5 minutes; a row of 2^26 takes about 6 GB of memory)")
    parser.add_argument("--sharded-devices", type=int, default=4,
                        help="host devices for the sharded case (default 4; 0 skips it)")
    parser.add_argument("--one-arena", action="store_true",
                        help="set glibc's malloc to one arena first (a diagnosis: see 'Output buffers' above)")
    parser.add_argument("--evict", action="store_true",
                        help="evict the caches before every timed call (a diagnosis: see 'Output buffers' above)")
    parser.add_argument("--sharded-worker", type=int, metavar="DEVICES", help=argparse.SUPPRESS)
    args = parser.parse_args()
    reps = 3 if args.quick else args.reps
    if args.one_arena and not ONE_ARENA:
        print("--one-arena: mallopt(M_ARENA_MAX, 1) is not available here; malloc keeps its arenas", file=sys.stderr)
    if args.sharded_worker:
        rows = sharded_worker(args.sharded_worker, SHARDED_QUICK if args.quick else SHARDED_SHAPES, reps)
        print(json.dumps(rows))
        return
    shapes = [(8, 128), (64, 256)] if args.quick else SHAPES
    if args.shapes:
        shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    dtypes = args.dtypes.split(",") if args.dtypes else DTYPES
    os.makedirs(args.out, exist_ok=True)

    evict = eviction_buffer(args.evict)
    by_rounds = {}
    for shape in shapes:
        by_rounds.setdefault(rounds_for(shape, reps), []).append("x".join(map(str, shape)))
    rounds = "; ".join(f"{n} at {', '.join(names)}" for n, names in by_rounds.items())
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} cores; rounds: {rounds}; "
        "ms: median; ratios: median of per-round ratios [25th-75th percentile]; malloc: "
        + ("one arena" if ONE_ARENA else "per-thread arenas")
        + "; caches: "
        + (f"evicted before every timed call ({evict.nbytes >> 20} MiB written)" if evict is not None
           else "as the variant before left them")
    )
    header = (
        f"{'shape':>12} {'dtype':>9} | {'fwd ms':>8} {'/floor':>17} {'/jnp':>6} | "
        f"{'f+b ms':>8} {'/floor':>17} {'/jnp':>6} | {'floor f':>8} {'jnp f':>8} {'floor fb':>8} {'jnp fb':>8}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for dtype in dtypes:
        for shape in shapes:
            times = measure(shape, dtype, reps, evict)
            t = {name: float(np.median(v)) for name, v in times.items()}
            fwd, fb = ratio(times, "fwd ours", "fwd floor"), ratio(times, "fwd+bwd ours", "fwd+bwd floor")
            row = {
                "shape": list(shape),
                "dtype": dtype,
                "rounds": rounds_for(shape, reps),
                **t,
                "fwd / floor": fwd[0],
                "fwd / floor spread": fwd[1:],
                "fwd / jnp": ratio(times, "fwd ours", "fwd jnp")[0],
                "fwd+bwd / floor": fb[0],
                "fwd+bwd / floor spread": fb[1:],
                "fwd+bwd / jnp": ratio(times, "fwd+bwd ours", "fwd+bwd jnp")[0],
                "residual fused / unfused": ratio(times, "res fused", "res unfused")[0],
                "residual fused / jnp": ratio(times, "res fused", "res jnp")[0],
                "offset / plain fwd": ratio(times, "fwd offset", "fwd ours")[0],
                "offset / plain fwd+bwd": ratio(times, "fwd+bwd offset", "fwd+bwd ours")[0],
                "mixed / plain fwd": ratio(times, "fwd mixed", "fwd ours")[0],
                "mixed / plain fwd+bwd": ratio(times, "fwd+bwd mixed", "fwd+bwd ours")[0],
                "residual grad fused / unfused": ratio(times, "res grad fused", "res grad unfused")[0],
                "layer fwd / jnp": ratio(times, "ln fwd ours", "ln fwd jnp"),
                "layer fwd+bwd / jnp": ratio(times, "ln fwd+bwd ours", "ln fwd+bwd jnp"),
            }
            rows.append(row)
            spread = lambda r: f"{r[0]:5.2f}x [{r[1]:4.2f}-{r[2]:4.2f}]"  # noqa: E731
            print(
                f"{'x'.join(map(str, shape)):>12} {dtype:>9} | {t['fwd ours']:8.3f} {spread(fwd):>17} "
                f"{row['fwd / jnp']:5.2f}x | {t['fwd+bwd ours']:8.3f} {spread(fb):>17} "
                f"{row['fwd+bwd / jnp']:5.2f}x | {t['fwd floor']:8.3f} {t['fwd jnp']:8.3f} "
                f"{t['fwd+bwd floor']:8.3f} {t['fwd+bwd jnp']:8.3f}",
                flush=True,
            )
    print("\nresidual add + norm, (y, h) = (norm(x + r), x + r): fused rms_norm_residual against the add then")
    print("our norm, and the add then jnp's norm (median ms; ratios: median of per-round ratios)")
    for row in rows:
        print(
            f"{'x'.join(map(str, row['shape'])):>12} {row['dtype']:>9} | fused {row['res fused']:8.3f} ms | "
            f"add+ours {row['res unfused']:8.3f} ms ({row['residual fused / unfused']:4.2f}x) | "
            f"add+jnp {row['res jnp']:8.3f} ms ({row['residual fused / jnp']:4.2f}x)"
        )
    print("\nvariants against the plain op (ratios: median of per-round ratios; 1.00 = no cost): scale_offset=1,")
    print("a weight of the other dtype, and the fused residual's gradient (dx rounded once) against add then norm")
    for row in rows:
        print(
            f"{'x'.join(map(str, row['shape'])):>12} {row['dtype']:>9} | offset fwd {row['offset / plain fwd']:4.2f}x "
            f"f+b {row['offset / plain fwd+bwd']:4.2f}x | mixed weight fwd {row['mixed / plain fwd']:4.2f}x "
            f"f+b {row['mixed / plain fwd+bwd']:4.2f}x | residual grad fused/unfused "
            f"{row['residual grad fused / unfused']:4.2f}x ({row['res grad fused']:8.3f} ms)"
        )
    print("\nLayerNorm with weight and bias: ours (layer_norm) against flax.linen.LayerNorm under jit (median ms;")
    print("ratios: median of per-round ratios [25th-75th percentile]); fwd+bwd: the gradient in x, weight and bias")
    for row in rows:
        lf, lb = row["layer fwd / jnp"], row["layer fwd+bwd / jnp"]
        print(
            f"{'x'.join(map(str, row['shape'])):>12} {row['dtype']:>9} | fwd {row['ln fwd ours']:8.3f} ms "
            f"flax {row['ln fwd jnp']:8.3f} ms {lf[0]:5.2f}x [{lf[1]:4.2f}-{lf[2]:4.2f}] | fwd+bwd "
            f"{row['ln fwd+bwd ours']:8.3f} ms flax {row['ln fwd+bwd jnp']:8.3f} ms {lb[0]:5.2f}x [{lb[1]:4.2f}-{lb[2]:4.2f}]"
        )
    errors = [] if args.no_accuracy else accuracy.report({"ours": rms_norm, "jnp": rms_norm_reference}, args.quick)
    sharded = run_sharded(args.sharded_devices, args.quick, reps) if args.sharded_devices > 0 else []
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"jax": jax.__version__, "reps": reps, "one_malloc_arena": ONE_ARENA,
                   "evicted_bytes": 0 if evict is None else evict.nbytes,
                   # Every element counts the evictions: one per timed call.
                   "evictions": 0 if evict is None else int(evict[0]),
                   "rows": rows, "accuracy": errors, "sharded": sharded,
                   "stats": rmsnorm_ffi.stats()["executions"]}, f, indent=1)
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

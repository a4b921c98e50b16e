"""Stress harness for the stateful RMS-norm custom calls: ``python -m rmsnorm_ffi.stress``.

T threads each run K compiled executables (different shapes, dtypes, with and without weight,
forward and ``jax.grad``) over and over, checking every result against the jnp reference,
while a churn thread compiles, runs and drops fresh executables so that states are created
and destroyed under the workers' feet. At the end it drops every executable, clears JAX's
caches and checks that every state created during the run was destroyed.

Exit status 0 only when no result mismatched, no call raised, and no state leaked.

With ``--devices D`` (CPU only) the host is split into D XLA devices and every executable runs
its custom calls under ``shard_map``: one state then serves D devices at once. With ``--mesh
explicit`` the executables instead take arrays placed with ``NamedSharding`` on an explicit mesh
(``jax.make_mesh``, rows sharded over its axis, the weight replicated) and are compiled under
``jax.set_mesh``, so the primitives' own sharding rules partition the calls; the summary counts
the all-gathers in the compiled programs (rows run per shard: there should be none).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import resource
import sys
import threading
import time
from typing import Any, Callable

# dtype name -> (rtol, atol) against the jnp reference, forward and gradients alike. Both sides
# accumulate in float32; the half-precision bounds cover one rounding of the output.
TOLERANCES = {
    "float32": (2e-5, 2e-5),
    "bfloat16": (2e-2, 2e-2),
    "float16": (4e-3, 4e-3),
}
# Small shapes stress the call path; the last two span several parallel chunks, so their
# backward uses the pooled weight-gradient partials.
SHAPES = [(1, 128), (7, 96), (16, 1000), (32, 256), (64, 512), (8, 4096), (128, 64), (4, 2048),
          (64, 4096), (512, 384)]
KINDS = ("fwd", "fwd+w", "grad", "grad+w")
EPS_CHOICES = (1e-6, 1e-5, 1e-3)
MISMATCH_EXAMPLES = 5


@dataclasses.dataclass(frozen=True)
class Case:
    """One executable: what it computes and on what."""

    rows: int
    cols: int
    dtype: str
    weighted: bool
    grad: bool
    eps: float
    seed: int

    def describe(self) -> str:
        kind = "grad" if self.grad else "fwd"
        weight = "+w" if self.weighted else ""
        return f"{kind}{weight} {self.dtype}[{self.rows},{self.cols}] eps={self.eps:g}"


def random_case(rng: random.Random, args: argparse.Namespace) -> Case:
    """A case drawn from the shapes, dtypes and kinds the options allow."""
    rows, cols = rng.choice(args.shapes)
    rows = max(args.devices, rows - rows % args.devices)  # rows divisible by devices (shard_map)
    kind = rng.choice(args.kinds)
    return Case(
        rows=rows,
        cols=cols,
        dtype=rng.choice(args.dtypes),
        weighted=kind.endswith("+w"),
        grad=kind.startswith("grad"),
        eps=rng.choice(EPS_CHOICES),
        seed=rng.randrange(1 << 30),
    )


def is_explicit(mesh) -> bool:
    """Whether `mesh` (None, or the run's mesh) is an explicit one (`--mesh explicit`)."""
    import jax

    return mesh is not None and all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def count_all_gathers(hlo: str) -> int:
    import re

    return len(re.findall(r"\ball-gather(-start)?\(", hlo))


class Executable:
    """A compiled executable for one case, its inputs, and the reference results. With a mesh:
    under `shard_map` on it, or (an explicit mesh) jitted under `jax.set_mesh` on arrays that
    carry their shardings."""

    def __init__(self, case: Case, mesh):
        import contextlib

        import jax
        import jax.numpy as jnp
        import numpy as np

        import rmsnorm_ffi

        self.case = case
        dtype = jnp.dtype(case.dtype)
        # NumPy draws the inputs: jax.random would compile a kernel for every new shape.
        rng = np.random.default_rng(case.seed)
        x = jnp.asarray(rng.standard_normal((case.rows, case.cols), np.float32), dtype)
        w = jnp.asarray(1.0 + 0.5 * rng.standard_normal(case.cols, np.float32), dtype)
        g = jnp.asarray(rng.standard_normal((case.rows, case.cols), np.float32))
        eps = case.eps
        explicit = is_explicit(mesh)

        def make(norm: Callable, mesh) -> Callable:
            def fwd(x, w):
                return norm(x, w if case.weighted else None, eps)

            if mesh is not None and not explicit:
                from jax.sharding import PartitionSpec as P

                # Rows split over the devices, the weight whole on each: one call per device.
                fwd = jax.shard_map(fwd, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"))
            if not case.grad:
                return fwd

            def loss(x, w):
                return jnp.sum(fwd(x, w).astype(jnp.float32) * g)

            return jax.grad(loss, argnums=(0, 1) if case.weighted else 0)

        if mesh is not None:
            from jax.sharding import NamedSharding
            from jax.sharding import PartitionSpec as P

            x = jax.device_put(x, NamedSharding(mesh, P("d")))
            w = jax.device_put(w, NamedSharding(mesh, P()))
            g = jax.device_put(g, NamedSharding(mesh, P("d")))
        self.args = (x, w)
        # Explicit: the shardings are in the arrays' types, the mesh in the context.
        with jax.set_mesh(mesh) if explicit else contextlib.nullcontext():
            self.compiled = jax.jit(make(rmsnorm_ffi.rms_norm, mesh)).lower(x, w).compile()
        self.want = numpy_reference(case, np.asarray(x), np.asarray(w), np.asarray(g))
        self.tolerance = TOLERANCES[case.dtype]

    def run_and_check(self) -> str | None:
        """Runs once; returns None when every output matches, else a description."""
        import numpy as np

        got = _as_tuple(self.compiled(*self.args))
        rtol, atol = self.tolerance
        for index, (out, want) in enumerate(zip(got, self.want)):
            out = np.asarray(out, np.float32)
            if out.shape != want.shape or not np.allclose(out, want, rtol=rtol, atol=atol * max(1.0, float(np.abs(want).max(initial=0)))):
                error = float(np.nanmax(np.abs(out - want))) if out.shape == want.shape else float("nan")
                return f"{self.case.describe()}: output {index} differs from jnp by {error:.3g}"
        return None


def numpy_reference(case: Case, x, w, g) -> list:
    """The expected outputs in float64 NumPy, independent of JAX: ``y``, or the gradients of
    ``sum(y.astype(float32) * g)`` (``dx``, and ``dweight`` with a weight)."""
    import numpy as np

    xf = x.astype(np.float64)
    wf = w.astype(np.float64) if case.weighted else np.ones(case.cols)
    rstd = 1.0 / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + np.float32(case.eps))
    if not case.grad:
        return [xf * rstd * wf]
    dy = g.astype(x.dtype).astype(np.float64)  # the cast to float32 hands back g in x's dtype
    wdy = wf * dy
    dx = rstd * wdy - xf * rstd**3 * np.mean(xf * wdy, axis=-1, keepdims=True)
    if not case.weighted:
        return [dx]
    return [dx, np.sum(xf * rstd * dy, axis=0)]


def _as_tuple(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def current_rss_bytes() -> int:
    """The resident set size now (Linux /proc; elsewhere the peak, the best there is)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


@dataclasses.dataclass
class Counters:
    """Per-thread tallies (each thread writes only its own; the reader sums)."""

    calls: int = 0
    mismatches: int = 0
    errors: int = 0


class Run:
    """One stress run: workers, churn, progress, summary."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.examples: list[str] = []
        self.worker_counters = [Counters() for _ in range(args.threads)]
        self.churn_counters = Counters()
        self.churn_cycles = 0
        self.churn_rss: list[int] = []

    def note(self, message: str) -> None:
        with self.lock:
            if len(self.examples) < MISMATCH_EXAMPLES:
                self.examples.append(message)

    def check(self, executable: Executable, counters: Counters) -> None:
        try:
            problem = executable.run_and_check()
        except Exception as e:  # a failed call is a finding, not the end of the run
            counters.errors += 1
            self.note(f"{executable.case.describe()}: {type(e).__name__}: {e}")
        else:
            if problem is not None:
                counters.mismatches += 1
                self.note(problem)
        counters.calls += 1

    def worker(self, index: int, executables: list[Executable], deadline: float | None, barrier) -> None:
        counters = self.worker_counters[index]
        order = list(executables)
        rng = random.Random(self.args.seed * 1000 + index)
        barrier.wait()
        rounds = 0
        while not self.stop.is_set():
            if deadline is None and rounds >= self.args.calls:
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
            rng.shuffle(order)
            for executable in order:
                self.check(executable, counters)
            rounds += 1

    def churn(self, mesh, workers_done: threading.Event) -> None:
        """Compiles, runs and drops executables until the workers are done and at least
        ``--churn-cycles`` cycles ran. RSS is sampled after every cycle."""
        import jax

        rng = random.Random(self.args.seed + 7)
        while not self.stop.is_set():
            if workers_done.is_set() and self.churn_cycles >= self.args.churn_cycles:
                break
            try:
                executable = Executable(random_case(rng, self.args), mesh)
            except Exception as e:
                self.churn_counters.errors += 1
                self.note(f"churn compile: {type(e).__name__}: {e}")
                continue
            for _ in range(rng.randint(1, 3)):
                self.check(executable, self.churn_counters)
            del executable
            self.churn_cycles += 1
            if self.churn_cycles % 25 == 0:
                gc.collect()
                jax.clear_caches()  # drops the reference computations' executables too
            self.churn_rss.append(current_rss_bytes())

    def total(self) -> Counters:
        total = Counters()
        for c in [*self.worker_counters, self.churn_counters]:
            total.calls += c.calls
            total.mismatches += c.mismatches
            total.errors += c.errors
        return total

    def progress(self, fraction: float, final: bool = False) -> None:
        if self.args.quiet:
            return
        total = self.total()
        width = 30
        filled = int(width * min(1.0, fraction))
        bar = "#" * filled + "." * (width - filled)
        line = (
            f"[{bar}] {100 * min(1.0, fraction):5.1f}%  calls {total.calls}  "
            f"mismatches {total.mismatches}  errors {total.errors}  churn {self.churn_cycles}"
        )
        if sys.stderr.isatty():
            sys.stderr.write("\r" + line + ("\n" if final else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def execute(self) -> dict[str, Any]:
        import jax
        import numpy as np

        import rmsnorm_ffi

        args = self.args
        rmsnorm_ffi.register()
        mesh = None
        if args.devices > 1 or args.mesh == "explicit":
            from jax.sharding import AxisType, Mesh

            devices = jax.devices()
            if len(devices) < args.devices:
                raise SystemExit(
                    f"--devices {args.devices}: JAX has {len(devices)} devices; the count is set when "
                    "JAX's backend starts, so run the harness in a fresh process"
                )
            if args.mesh == "explicit":
                mesh = jax.make_mesh((args.devices,), ("d",), axis_types=(AxisType.Explicit,),
                                     devices=devices[: args.devices])
            else:
                mesh = Mesh(np.array(devices[: args.devices]), ("d",))

        before = rmsnorm_ffi.stats()
        live_before = {s["id"] for s in before["states"]}
        cases = [random_case(self.rng, args) for _ in range(args.executables)]
        executables = [Executable(case, mesh) for case in cases]
        all_gathers = sum(count_all_gathers(e.compiled.as_text()) for e in executables) if mesh is not None else 0
        for executable in executables:  # warm-up: the pools grow to what one call needs
            self.check(executable, self.churn_counters)
        del executable  # the loop variable would keep the last executable (and its states) alive
        warm = rmsnorm_ffi.stats()

        deadline = None if args.seconds is None else time.monotonic() + args.seconds
        barrier = threading.Barrier(args.threads + 1)
        workers = [
            threading.Thread(target=self.worker, args=(i, executables, deadline, barrier), daemon=True)
            for i in range(args.threads)
        ]
        workers_done = threading.Event()
        churn = threading.Thread(target=self.churn, args=(mesh, workers_done), daemon=True)
        for t in workers:
            t.start()
        barrier.wait()
        start = time.monotonic()
        if args.churn:
            churn.start()
        planned = args.threads * args.executables * (args.calls or 0)
        last = 0.0
        while any(t.is_alive() for t in workers) or (args.churn and churn.is_alive()):
            time.sleep(0.05)
            if not workers_done.is_set() and not any(t.is_alive() for t in workers):
                workers_done.set()
            now = time.monotonic()
            if now - last >= (0.2 if sys.stderr.isatty() else 5.0):
                last = now
                if deadline is not None:
                    fraction = (now - start) / args.seconds
                else:
                    done = sum(c.calls for c in self.worker_counters)
                    fraction = done / planned if planned else 1.0
                if args.churn and args.churn_cycles:
                    fraction = min(fraction, self.churn_cycles / args.churn_cycles)
                self.progress(fraction)
        workers_done.set()
        elapsed = time.monotonic() - start
        self.progress(1.0, final=True)
        during = rmsnorm_ffi.stats()

        # Drop everything, then every state made during the run must be gone.
        del executables
        jax.clear_caches()
        gc.collect()
        after = rmsnorm_ffi.stats()
        leaked = [s for s in after["states"] if s["id"] not in live_before]
        total = self.total()
        churn_rss = self.churn_rss
        # RSS growth over the churn, after a warm-up tenth of it (allocators and caches settle).
        settle = churn_rss[len(churn_rss) // 10] if churn_rss else 0
        summary = {
            "threads": args.threads,
            "executables": args.executables,
            "devices": args.devices,
            "mesh": args.mesh if mesh is not None else None,
            "all_gathers": all_gathers,
            "seconds": round(elapsed, 3),
            "calls": total.calls,
            "calls_per_second": round(total.calls / elapsed, 1) if elapsed > 0 else None,
            "mismatches": total.mismatches,
            "errors": total.errors,
            "churn_cycles": self.churn_cycles,
            "states_created": after["created_states"] - before["created_states"],
            "states_destroyed": after["destroyed_states"] - before["destroyed_states"],
            "states_live_during_run": during["live_states"],
            "states_leaked": len(leaked),
            "executions": {
                target: count - before["executions"].get(target, 0)
                for target, count in after["executions"].items()
                if count != before["executions"].get(target, 0)
            },
            "workspace_bytes": during["workspace_bytes"],
            "workspace_allocations_after_warmup": during["workspace_allocations"] - warm["workspace_allocations"],
            "peak_rss_mb": round(peak_rss_bytes() / 2**20, 1),
            "churn_rss_growth_mb": round((churn_rss[-1] - settle) / 2**20, 1) if churn_rss else 0.0,
            "examples": self.examples,
        }
        summary["ok"] = total.mismatches == 0 and total.errors == 0 and not leaked
        return summary


def print_summary(summary: dict[str, Any], out=None) -> None:
    out = out or sys.stdout  # looked up now: tests and callers may have replaced it
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(
        f"calls: {summary['calls']} in {summary['seconds']:.1f} s ({summary['calls_per_second']} calls/s) "
        f"from {summary['threads']} threads x {summary['executables']} executables"
        + (f" on {summary['devices']} devices" if summary["devices"] > 1 else "")
        + (f" ({summary['mesh']} mesh)" if summary.get("mesh") == "explicit" else "")
    )
    if summary.get("mesh"):
        p(f"all-gathers in the {summary['executables']} compiled programs: {summary['all_gathers']}")
    p(f"mismatches: {summary['mismatches']}  errors: {summary['errors']}")
    p(f"churn: {summary['churn_cycles']} executables compiled, run and dropped; "
      f"RSS growth over the churn {summary['churn_rss_growth_mb']} MB")
    p(
        f"states: created {summary['states_created']}, destroyed {summary['states_destroyed']}, "
        f"live during the run {summary['states_live_during_run']}, leaked {summary['states_leaked']}"
    )
    p(
        f"workspace bytes held: {summary['workspace_bytes']}; allocations after warm-up: "
        f"{summary['workspace_allocations_after_warmup']}"
    )
    p(f"peak RSS: {summary['peak_rss_mb']} MB")
    for example in summary["examples"]:
        p(f"  problem: {example}")
    p("OK" if summary["ok"] else "FAILED")


def _choices(allowed) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"expected some of {', '.join(allowed)}, got {text!r}")
        return values

    return parse


def _shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        try:
            rows, cols = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"shapes are ROWSxCOLS, got {item!r}") from None
        if rows < 1 or cols < 1:
            raise argparse.ArgumentTypeError(f"shapes must be positive, got {item!r}")
        shapes.append((rows, cols))
    return shapes


def parser() -> argparse.ArgumentParser:
    cores = os.cpu_count() or 1
    p = argparse.ArgumentParser(
        prog="python -m rmsnorm_ffi.stress",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--threads", "-t", type=int, default=2 * cores,
                   help=f"worker threads calling at once (default: 2 x cores = {2 * cores})")
    p.add_argument("--executables", "-k", type=int, default=6,
                   help="distinct compiled executables every worker runs, shared by all workers (default: 6)")
    limit = p.add_mutually_exclusive_group()
    limit.add_argument("--calls", "-n", type=int, default=None,
                       help="rounds per worker: each round runs every executable once (default: use --seconds)")
    limit.add_argument("--seconds", "-s", type=float, default=None,
                       help="run the workers for this long (default: 10 s when --calls is not given)")
    p.add_argument("--churn-cycles", type=int, default=0,
                   help="compile/run/drop cycles the churn thread does at least; it keeps going while "
                        "workers run (default: 0, i.e. only while workers run)")
    p.add_argument("--no-churn", dest="churn", action="store_false", help="no churn thread")
    p.add_argument("--devices", type=int, default=1,
                   help="split the CPU into this many XLA devices and run under shard_map, or under an "
                        "explicit mesh with --mesh explicit (default: 1)")
    p.add_argument("--mesh", choices=("shard_map", "explicit"), default="shard_map",
                   help="with --devices: shard_map (rms_norm inside jax.shard_map over the devices), or "
                        "explicit (rows-sharded NamedSharding arrays on a jax.make_mesh explicit mesh, "
                        "compiled under jax.set_mesh) (default: shard_map)")
    p.add_argument("--dtypes", type=_choices(TOLERANCES), default=sorted(TOLERANCES),
                   help="comma-separated dtypes to draw from (default: %(default)s)")
    p.add_argument("--kinds", type=_choices(KINDS), default=list(KINDS),
                   help="comma-separated kinds to draw from: fwd, fwd+w, grad, grad+w (default: all)")
    p.add_argument("--shapes", type=_shapes, default=SHAPES,
                   help="comma-separated ROWSxCOLS shapes to draw from (default: a mix from 1x128 to 64x4096)")
    p.add_argument("--seed", type=int, default=0, help="seed for the cases, inputs and schedules (default: 0)")
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON to PATH")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.calls is None and args.seconds is None:
        args.seconds = 10.0
    for name in ("threads", "executables"):
        if getattr(args, name) < 1:
            parser().error(f"--{name} must be at least 1")
    if args.devices < 1:
        parser().error("--devices must be at least 1")
    if args.devices > 1:
        # Read when the backend starts, which has not happened yet in a fresh process (if it
        # has, the device count check in Run.execute says so).
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    summary = Run(args).execute()
    print_summary(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

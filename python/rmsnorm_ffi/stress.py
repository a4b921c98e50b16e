"""Stress harness for stateful custom calls: ``rmsnorm_ffi.stress.run(...)`` and
``python -m rmsnorm_ffi.stress``.

It proves, for any JAX function ``fn`` that calls one or more FFI targets (ours, or those of a
library registered with :func:`rmsnorm_ffi.register_library`), that the targets survive many
concurrent executions, churn and teardown:

1. ``cases(index, rng)`` gives the inputs: ``index`` picks an executable's shapes, dtypes and
   static values (deterministically), the NumPy ``rng`` the values. K executables (indices 0 to
   K-1) are AOT compiled, each with a few input sets of the same signature (so that threads
   running one executable at once run it on different data, and cross-talk between concurrent
   executions shows), and every result is checked against ``reference`` (NumPy, independent of
   JAX) or, when there is no reference, by the property ``check``.
2. T threads each run every executable over and over (``calls`` rounds or ``seconds``), while a
   churn thread compiles, runs and drops fresh executables (indices K, K+1, ...), clearing
   JAX's caches every ``clear_every`` cycles, so that states are created and destroyed under
   the workers' feet.
3. A steady phase (no churn) runs ``steady_rounds`` more rounds on every thread: workspace
   allocations there are the pools still growing after warm-up.
4. At the end every executable is dropped, caches cleared, and every state created during the
   run must have been destroyed (:func:`rmsnorm_ffi.stats`, which counts registered libraries'
   states too). The growth over the churn of RSS and of glibc's heap in use is compared with
   a jnp-only control run of as many cycles, both sampled settled (at each clear of the caches,
   with the workers parked between calls, the garbage collected and glibc's free heap
   returned; see :func:`settled_sample`). The heap in use is the sharp test for a leak through
   malloc: it is blind to the allocator's settling (arenas that keep what threads freed), which
   moves RSS by several MB from run to run without growing with the cycles.

What the checks cannot see: a state that does not register itself in the live-state registry
(``LiveState``) is invisible to the leak check; scratch memory that does not come from a
``WorkspacePool`` is invisible to the allocation count (a leak of it shows in the heap in use
when it comes from malloc, and in the RSS growth only, if large enough, when it does not); a race whose window the schedules of this machine never hit stays
unseen (a broken bundle is caught every time only when concurrent executions overlap in its
window); a target whose result depends on its execution history passes when ``check`` allows
it (the counter example is such a target, checked by a property).

Errors that JAX raises itself (e.g. while caches are cleared under another thread's trace) are
counted as the harness's (``jax_errors``), not blamed on the bundle; an error raised while
running a compiled executable, or naming one of its custom-call targets, is the bundle's.

Exit status of the command line: 0 when everything passed, 1 when a check failed (a mismatch,
an error from a target, a leaked state, RSS or workspace growth), 3 when only JAX's own errors
were seen (the run proves less than asked, but nothing points at the bundle).

Our RMS norm is one spec among others (:func:`rms_norm_spec`, the command line's default):
shapes, dtypes, with and without weight, forward and ``jax.grad`` (with y). With ``--devices D`` (CPU
only) the host is split into D XLA devices and every executable runs its custom calls under
``shard_map``: one state then serves D devices at once. With ``--mesh explicit`` the
executables instead take arrays placed with ``NamedSharding`` on an explicit mesh
(``jax.make_mesh``, sharded as the spec's ``in_specs`` say: for the RMS norm rows over the
mesh's axis, the weight replicated) and are compiled under ``jax.set_mesh``, so the primitives'
own sharding rules partition the calls; the summary counts the all-gathers in the compiled
programs (for the RMS norm rows run per shard: there should be none).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import dataclasses
import functools
import gc
import importlib
import importlib.util
import inspect
import json
import os
import pathlib
import random
import re
import resource
import statistics
import sys
import threading
import time
from typing import Any, Callable, Sequence

MISMATCH_EXAMPLES = 5
# Distinct input sets per executable, at most (threads share them round robin).
INPUT_SETS = 4
EXIT_OK, EXIT_FAILED, EXIT_HARNESS = 0, 1, 3


# ---------------------------------------------------------------------------------------------
# What a spec is made of
# ---------------------------------------------------------------------------------------------


class Inputs:
    """What ``cases`` returns when ``fn`` takes static values besides its arrays:
    ``Inputs(*arrays, **static)``. The arrays (NumPy, or anything ``numpy.asarray`` takes) are
    the executable's arguments; the static values (hashable) are bound to ``fn``,
    ``reference`` and ``check`` as keyword arguments and compiled into the executable."""

    def __init__(self, *args, **static):
        self.args = tuple(args)
        self.static = dict(static)

    def __repr__(self) -> str:
        return f"Inputs({', '.join(_describe_array(a) for a in self.args)}{_describe_static(self.static)})"


@dataclasses.dataclass
class Spec:
    """Everything the harness needs to know about a target: ``fn``, ``cases`` and how to check
    results (``reference`` and/or ``check``), the tolerance, how inputs shard over a mesh
    (``in_specs``) and the jnp-only ``control`` for the RSS comparison. See :func:`run` for
    each; ``Spec.run(**options)`` runs it. ``python -m rmsnorm_ffi.stress --spec MODULE:NAME``
    takes a ``Spec`` (or a function of no arguments returning one)."""

    fn: Callable
    cases: Callable
    reference: Callable | None = None
    check: Callable | None = None
    tolerance: tuple[float, float] | Callable = (1e-5, 1e-5)
    in_specs: Sequence | Callable | None = None
    control: Callable | None = None
    name: str = ""

    def run(self, **options) -> "Report":
        """Runs the harness on this spec; ``options`` are :func:`run`'s (``threads``,
        ``calls``, ...), and may override the spec's own fields."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["name"] = self.name or _name_of(self.fn)
        return run(**(fields | options))


@dataclasses.dataclass
class Report:
    """What a run found. ``ok`` is True only when every check passed; ``failures`` says which
    did not, in words; ``examples`` are the first bundle problems seen, ``jax_examples`` the
    first of JAX's own errors. ``as_dict()`` is what ``--json`` writes."""

    name: str
    threads: int
    executables: int
    devices: int
    mesh: str | None
    all_gathers: int
    targets: list[str]
    seconds: float
    calls: int
    calls_per_second: float | None
    mismatches: int
    errors: int
    jax_errors: int
    churn_cycles: int
    states_created: int
    states_destroyed: int
    states_live_during_run: int
    states_leaked: int
    leaked_states: list[dict]
    executions: dict[str, int]
    workspace_bytes: int
    workspace_allocations_during_run: int
    workspace_allocations_after_warmup: int
    steady_calls: int
    peak_rss_mb: float
    churn_rss_growth_mb: float | None
    control_cycles: int
    control_seconds: float
    control_rss_growth_mb: float | None
    rss_slack_mb: float
    #: False when the churn's or the control's RSS trend rests on fewer than
    #: ``RSS_TREND_MIN_SAMPLES`` settled samples: the figures are reported, not compared.
    rss_judged: bool
    churn_heap_growth_mb: float | None
    control_heap_growth_mb: float | None
    heap_slack_mb: float
    churn_samples: list[dict]
    control_samples: list[dict]
    examples: list[str]
    jax_examples: list[str]
    failures: list[str]
    ok: bool
    exit_status: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        import io

        out = io.StringIO()
        print_summary(self.as_dict(), out)
        return out.getvalue()


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def _name_of(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _accepts(fn, name: str) -> bool:
    """Whether `fn` takes a keyword argument `name` (explicitly, not through **kwargs)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    p = parameters.get(name)
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


def _describe_array(a) -> str:
    import numpy as np

    a = np.asarray(a)
    return f"{a.dtype}[{','.join(map(str, a.shape))}]"


def _describe_static(static: dict) -> str:
    return "".join(f", {k}={v!r}" for k, v in sorted(static.items()))


def is_explicit(mesh) -> bool:
    """Whether `mesh` (None, or the run's mesh) is an explicit one (``mesh="explicit"``)."""
    import jax

    return mesh is not None and all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def count_all_gathers(hlo: str) -> int:
    return len(re.findall(r"\ball-gather(-start)?\(", hlo))


def custom_call_targets(hlo: str) -> set[str]:
    """The custom-call targets a compiled program calls."""
    return set(re.findall(r'custom_call_target="([^"]+)"', hlo))


def current_rss_bytes() -> int:
    """The resident set size now (Linux /proc; elsewhere the peak, the best there is)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


@functools.cache
def _malloc_trim() -> Callable[[], None] | None:
    """glibc's ``malloc_trim(0)``, or None where the C library has none (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _mallinfo2() -> Callable[[], "_MallInfo2"] | None:
    """glibc's ``mallinfo2`` (2.33+; summed over every arena), or None where there is none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        info = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    info.argtypes = []
    info.restype = _MallInfo2
    return info


def heap_bytes() -> tuple[int, int] | None:
    """What glibc's malloc says of itself: ``(in use, held from the system)`` in bytes, every
    arena and every mmapped chunk included; None without ``mallinfo2``. Memory in use is what
    the process asked for and has not freed, so a leak through malloc grows it however the
    allocator's free lists and arenas settle; what it holds is what RSS can see of the heap."""
    info = _mallinfo2()
    if info is None:
        return None
    m = info()
    return m.uordblks + m.hblkhd, m.arena + m.hblkhd


def settled_rss_bytes() -> int:
    """The resident set size with the garbage collected, JAX's caches cleared, and glibc's free
    heap pages handed back to the system: the memory still in use, which is what a leak grows.

    Why each: JAX's caches hold every executable compiled since they were last cleared (a
    sample between clears lands somewhere on that sawtooth); and during the churn the worker
    threads allocate concurrently, so glibc spreads their allocations over per-thread arenas
    and keeps what they free. That retention (tens of MB with 8 threads, differing from run to
    run) showed as churn growth that the single-threaded control never has."""
    import jax

    gc.collect()
    jax.clear_caches()  # drops the reference computations' executables too
    trim = _malloc_trim()
    if trim is not None:
        trim()
    return current_rss_bytes()


def settled_sample(cycle: int) -> dict[str, Any]:
    """One settled memory sample after churn cycle ``cycle``: RSS (:func:`settled_rss_bytes`),
    the heap in use and held (:func:`heap_bytes`, None without glibc), the live states and
    workspace bytes of :func:`rmsnorm_ffi.stats`, and the arrays JAX holds. A leak shows as
    growth of one of them with the cycles; an allocator settling grows RSS or the heap held
    but not the heap in use."""
    import jax

    import rmsnorm_ffi

    rss = settled_rss_bytes()
    heap = heap_bytes()
    stats = rmsnorm_ffi.stats()
    return dict(
        cycle=cycle,
        rss=rss,
        heap_in_use=None if heap is None else heap[0],
        heap_held=None if heap is None else heap[1],
        live_states=stats["live_states"],
        workspace_bytes=stats["workspace_bytes"],
        live_arrays=len(jax.live_arrays()),
    )


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _growth_mb(samples: list[dict[str, Any]], key: str = "rss") -> float | None:
    """Growth of ``key`` (``"rss"``, ``"heap_in_use"``, ...) over a churn, in MB, from its
    settled samples (:func:`settled_sample`, taken at every clear of the caches and once after
    the last cycle): the least-squares trend per cycle through the samples from the first after
    a warm-up tenth of the cycles (allocators and JAX's own tables settle), times the cycles
    from that sample to the last. None when no sample precedes the last one (a churn shorter
    than ``clear_every`` cycles) or the figure is missing (no glibc).

    Why a trend and not last minus first: a leak grows with every cycle, while settled samples
    scatter around their level, and a difference of two samples carries both scatters (it read
    16.2 MB of RSS once where such runs read 2-4).

    Why the samples of one worker phase: while the workers run (parked or not) their arrays,
    thread states and arenas are in every sample, and in none after they stop (3-4 MB of heap
    with 16 threads). A trend across that step would read their end as a shrinking heap and
    hide a leak as large, so the trend is taken through the larger of the two groups (the
    samples with the workers running, or those after they stopped), or through all samples
    when neither group has two."""
    if len(samples) < 2 or samples[-1][key] is None:
        return None
    after, group = _trend_samples(samples)
    span = after[-1]["cycle"] - after[0]["cycle"]
    if span == 0:
        return round((after[-1][key] - after[0][key]) / 2**20, 1)
    slope = statistics.linear_regression([s["cycle"] for s in group], [s[key] for s in group]).slope
    return round(slope * span / 2**20, 1)


def _trend_samples(samples: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The samples after the warm-up tenth, and the group among them that :func:`_growth_mb`'s
    trend goes through."""
    after = [s for s in samples if s["cycle"] >= samples[-1]["cycle"] // 10]
    stopped = [s for s in after if s.get("workers_running", 0) == 0]
    running = [s for s in after if s.get("workers_running", 0) != 0]
    group = stopped if len(stopped) >= len(running) else running
    if len({s["cycle"] for s in group}) < 2:
        group = after
    return after, group


#: The fewest settled samples (distinct cycles) an RSS trend is judged from. Through two it is a
#: difference of two samples, each scattered by the allocator's settling: short runs (the
#: README's 5 s, ~55 cycles: samples at cycles 25 and 50) read 4-18 MB here and 26.6 MB once on
#: the 2-core CI against a control's -8.6, where runs of 500-8000 cycles read 4-6 MB in all.
#: The heap in use, blind to that settling (0.2 MB in the same runs), is judged from two.
RSS_TREND_MIN_SAMPLES = 3


def _trend_points(samples: list[dict[str, Any]]) -> int:
    """How many settled samples (distinct cycles) :func:`_growth_mb`'s figure rests on."""
    if len(samples) < 2:
        return len(samples)
    return len({s["cycle"] for s in _trend_samples(samples)[1]})


def _is_jax_runtime_error(e: BaseException) -> bool:
    return type(e).__name__ in ("XlaRuntimeError", "JaxRuntimeError")


# ---------------------------------------------------------------------------------------------
# Executables
# ---------------------------------------------------------------------------------------------


class Executable:
    """One compiled executable: ``fn`` for the signature of ``cases(index, ...)``, its input
    sets (placed on the mesh, if any) and their expected results. With a mesh: under
    `shard_map` on it (unless ``fn`` takes the mesh and shards itself), or (an explicit mesh)
    jitted under `jax.set_mesh` on arrays that carry their shardings."""

    def __init__(self, harness: "_Harness", index: int, sets: int, control: bool = False):
        import contextlib

        import jax
        import numpy as np

        self.index = index
        first = None
        self.inputs: list[Inputs] = []
        for k in range(sets):
            inputs = harness.draw(index, k)
            signature = (tuple((np.asarray(a).shape, np.asarray(a).dtype) for a in inputs.args),
                         _describe_static(inputs.static))
            if first is None:
                first = signature
            elif signature != first:
                raise ValueError(
                    f"cases({index}, rng) returned {inputs!r} for input set {k} but {self.inputs[0]!r} for "
                    "set 0: the index must fix the shapes, dtypes and static values, the rng only the values"
                )
            self.inputs.append(inputs)
        self.name = f"#{index} {self.inputs[0]!r}"
        static = self.inputs[0].static
        mesh = harness.mesh
        explicit = is_explicit(mesh)
        if control:
            f = harness.control_fn(static, self.inputs[0].args)
        else:
            f = functools.partial(harness.fn, **static)
            if _accepts(harness.fn, "mesh"):
                f = functools.partial(f, mesh=mesh)
            elif mesh is not None and not explicit:
                from jax.sharding import PartitionSpec as P

                plain = f
                f = jax.shard_map(f, mesh=mesh, in_specs=harness.specs(self.inputs[0]), out_specs=P(mesh.axis_names[0]))
                abstract = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in self.inputs[0].args]
                want = [s.shape for s in jax.tree.leaves(jax.eval_shape(plain, *abstract))]
                got = [s.shape for s in jax.tree.leaves(jax.eval_shape(f, *abstract))]
                if want != got:
                    raise ValueError(
                        f"{self.name}: under shard_map over {harness.o['devices']} devices fn's outputs have shapes "
                        f"{got}, without it {want}: the harness runs fn per shard and shards its outputs along their "
                        "leading axis, so the inputs' leading axes must divide over the devices (cases gets the count "
                        "if it takes a keyword `devices`); or take a keyword `mesh` in fn and shard yourself"
                    )
        self.args = [harness.place(inputs) for inputs in self.inputs]
        with jax.set_mesh(mesh) if explicit else contextlib.nullcontext():
            self.compiled = jax.jit(f).lower(*self.args[0]).compile()
        self.hlo = self.compiled.as_text()
        self.targets = custom_call_targets(self.hlo)
        self.harness = harness
        self.control = control
        # The expected results (reference), computed once per input set.
        self.expected = None
        if harness.reference is not None and not control:
            self.expected = [
                [np.asarray(v) for v in jax.tree.leaves(harness.reference(*[np.asarray(a) for a in i.args], **i.static))]
                for i in self.inputs
            ]
        self.tolerances = [harness.tolerance_for(i) for i in self.inputs]

    def run_and_check(self, which: int = 0) -> str | None:
        """Runs on input set `which` (modulo the sets); returns None when the result passes, else
        a description. Exceptions from the call propagate; an exception in ``check`` other than
        an AssertionError is raised as a _CheckError."""
        import jax
        import numpy as np

        which %= len(self.inputs)
        out = self.compiled(*self.args[which])
        leaves = [np.asarray(v) for v in jax.tree.leaves(out)]
        if self.control:
            return None
        inputs = self.inputs[which]
        if self.expected is not None:
            want = self.expected[which]
            if len(leaves) != len(want):
                return f"{self.name}: {len(leaves)} outputs, the reference has {len(want)}"
            rtol, atol = self.tolerances[which]
            for i, (got, exp) in enumerate(zip(leaves, want)):
                problem = _compare(got, exp, rtol, atol)
                if problem is not None:
                    return f"{self.name} (input set {which}): output {i} {problem}"
        if self.harness.check is not None:
            outputs = jax.tree.map(np.asarray, out)
            try:
                verdict = self.harness.check(outputs, *[np.asarray(a) for a in inputs.args], **inputs.static)
            except AssertionError as e:
                verdict = str(e) or "check failed (AssertionError)"
            except Exception as e:
                raise _CheckError(f"check raised {type(e).__name__}: {e}") from e
            if verdict is False:
                verdict = "check returned False"
            if isinstance(verdict, str) and verdict:
                return f"{self.name} (input set {which}): {verdict}"
        return None


class _CheckError(Exception):
    """The spec's own check failed to run: a harness error, not the bundle's."""


def _compare(got, want, rtol: float, atol: float) -> str | None:
    import numpy as np

    if got.shape != want.shape:
        return f"has shape {got.shape}, the reference {want.shape}"
    if np.issubdtype(want.dtype, np.integer) or np.issubdtype(want.dtype, np.bool_):
        if np.array_equal(got, want):
            return None
        bad = int(np.count_nonzero(got != want))
        return f"differs from the reference in {bad} of {want.size} elements"
    g = got.astype(np.float64)
    w = want.astype(np.float64)
    scale = max(1.0, float(np.abs(w).max(initial=0)))
    if np.allclose(g, w, rtol=rtol, atol=atol * scale):
        return None
    error = float(np.nanmax(np.abs(g - w))) if g.size else float("nan")
    return f"differs from the reference by {error:.3g}"


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Counters:
    """Per-thread tallies (each thread writes only its own; the reader sums)."""

    calls: int = 0
    mismatches: int = 0
    errors: int = 0
    jax_errors: int = 0


class _Harness:
    def __init__(self, fn, cases, reference, check, tolerance, in_specs, control, opts):
        self.fn = fn
        self.cases = cases
        self.reference = reference
        self.check = check
        self.tolerance = tolerance
        self.in_specs = in_specs
        self.control = control
        self.o = opts
        self.mesh = None
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.examples: list[str] = []
        self.jax_examples: list[str] = []
        self.worker_counters = [Counters() for _ in range(opts["threads"])]
        self.churn_counters = Counters()
        self.churn_cycles = 0
        self.churn_rss: list[dict[str, Any]] = []
        self.worker_threads: list[threading.Thread] = []
        # Workers park here between calls while the churn thread takes a settled sample.
        self.pause = threading.Condition()
        self.paused = False
        self.parked = 0
        self.next_index = opts["executables"]
        self.cases_takes_devices = _accepts(cases, "devices")

    # -- inputs ------------------------------------------------------------------------------

    def draw(self, index: int, which: int) -> Inputs:
        import numpy as np

        rng = np.random.default_rng([self.o["seed"], index, which])
        kwargs = {"devices": self.o["devices"]} if self.cases_takes_devices else {}
        got = self.cases(index, rng, **kwargs)
        if isinstance(got, Inputs):
            return got
        if isinstance(got, (tuple, list)):
            return Inputs(*got)
        raise TypeError(
            f"cases({index}, rng) returned {type(got).__name__}: expected a tuple of arrays or stress.Inputs(*arrays, **static)"
        )

    def tolerance_for(self, inputs: Inputs) -> tuple[float, float]:
        t = self.tolerance
        if callable(t):
            t = t(*inputs.args, **inputs.static)
        try:
            rtol, atol = (float(v) for v in t)
        except (TypeError, ValueError):
            raise TypeError(f"tolerance: expected (rtol, atol) or a function returning it, got {t!r}") from None
        return rtol, atol

    def specs(self, inputs: Inputs) -> tuple:
        """Each argument's PartitionSpec on the mesh: the spec's ``in_specs``, else the leading
        axis over the mesh's axis when it divides, replicated otherwise."""
        import numpy as np
        from jax.sharding import PartitionSpec as P

        if self.in_specs is not None:
            specs = self.in_specs(*inputs.args, **inputs.static) if callable(self.in_specs) else self.in_specs
            specs = tuple(specs)
            if len(specs) != len(inputs.args):
                raise ValueError(f"in_specs: {len(specs)} specs for {len(inputs.args)} arguments")
            return specs
        axis = self.mesh.axis_names[0]
        d = self.o["devices"]
        return tuple(
            P(axis) if np.ndim(a) >= 1 and np.shape(a)[0] % d == 0 else P() for a in inputs.args
        )

    def place(self, inputs: Inputs) -> list:
        import jax
        import jax.numpy as jnp

        if self.mesh is None:
            return [jnp.asarray(a) for a in inputs.args]
        from jax.sharding import NamedSharding

        return [
            jax.device_put(jnp.asarray(a), NamedSharding(self.mesh, spec))
            for a, spec in zip(inputs.args, self.specs(inputs))
        ]

    def control_fn(self, static: dict, args) -> Callable:
        """The jnp-only stand-in for the control run: the spec's ``control``, else a function of
        the same inputs returning arrays of fn's output shapes and dtypes (no custom call)."""
        import jax
        import jax.numpy as jnp

        if self.control is not None:
            return functools.partial(self.control, **static)
        f = functools.partial(self.fn, **static)
        if _accepts(self.fn, "mesh"):
            f = functools.partial(f, mesh=None)
        shapes = jax.eval_shape(f, *[jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in args])

        def control(*xs):
            total = sum((jnp.sum(x.astype(jnp.float32)) for x in xs), jnp.float32(0))
            return jax.tree.map(
                lambda s: (jnp.zeros(s.shape, jnp.float32) + total).astype(jax.dtypes.canonicalize_dtype(s.dtype)),
                shapes)

        return control

    # -- calls -------------------------------------------------------------------------------

    def note(self, message: str, jax_error: bool = False) -> None:
        with self.lock:
            examples = self.jax_examples if jax_error else self.examples
            if len(examples) < MISMATCH_EXAMPLES:
                examples.append(message)

    def blame(self, e: BaseException, targets: set[str], running: bool) -> bool:
        """True when the error is the bundle's: raised by XLA while running a compiled
        executable, or naming one of its custom-call targets. Other errors (JAX's own, e.g.
        while caches are cleared under another thread's trace) are the harness's."""
        if isinstance(e, _CheckError):
            return False
        text = str(e)
        if any(t in text for t in targets):
            return True
        return running and _is_jax_runtime_error(e)

    def error(self, counters: Counters, where: str, e: BaseException, bundle: bool) -> None:
        message = f"{where}: {type(e).__name__}: {str(e)[:2000]}"
        if bundle:
            counters.errors += 1
            self.note(message)
        else:
            counters.jax_errors += 1
            self.note(message, jax_error=True)

    def call(self, executable: Executable, counters: Counters, which: int) -> None:
        try:
            problem = executable.run_and_check(which)
        except Exception as e:  # a failed call is a finding, not the end of the run
            self.error(counters, executable.name, e, self.blame(e, executable.targets, running=True))
        else:
            if problem is not None:
                counters.mismatches += 1
                self.note(problem)
        counters.calls += 1

    def worker(self, index: int, executables: list[Executable], rounds: int | None, deadline: float | None,
               barrier) -> None:
        counters = self.worker_counters[index]
        order = list(executables)
        rng = random.Random(self.o["seed"] * 1000 + index)
        barrier.wait()
        done = 0
        while not self.stop.is_set():
            if rounds is not None and done >= rounds:
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
            rng.shuffle(order)
            for executable in order:
                self.checkpoint()
                self.call(executable, counters, index)
            done += 1

    def checkpoint(self) -> None:
        """A worker, between calls: parks while a sample is being taken."""
        with self.pause:
            if not self.paused:
                return
            self.parked += 1
            self.pause.notify_all()
            while self.paused:
                self.pause.wait()
            self.parked -= 1

    def quiet_sample(self, cycle: int) -> dict[str, Any]:
        """A settled sample (:func:`settled_sample`) with every worker parked between calls, so
        that no call is in flight while it is taken. Samples taken while 16 workers ran scattered
        by several MB of RSS and heap (their arrays and per-thread arenas in use), which is noise
        to a trend that looks for a few KB per cycle."""
        with self.pause:
            self.paused = True
            # A worker that has left its loop never parks: wait for it to end instead.
            while self.parked < sum(t.is_alive() for t in self.worker_threads):
                self.pause.wait(timeout=0.01)
        try:
            return settled_sample(cycle) | {"workers_running": sum(t.is_alive() for t in self.worker_threads)}
        finally:
            with self.pause:
                self.paused = False
                self.pause.notify_all()

    def fresh_index(self) -> int:
        with self.lock:
            index = self.next_index
            self.next_index += 1
            return index

    def churn_cycle(
        self, rng: random.Random, counters: Counters, rss: list[dict[str, Any]], control: bool, cycle: int,
    ) -> None:
        """Cycle number ``cycle`` (from 1): compiles, runs and drops one executable; every
        ``clear_every`` cycles clears the caches and appends a settled RSS sample to ``rss``."""
        index = self.fresh_index()
        try:
            executable = Executable(self, index, 1, control=control)
        except Exception as e:
            self.error(counters, f"churn compile #{index}", e, self.blame(e, self.known_targets, running=False))
            return
        for _ in range(rng.randint(1, 3)):
            self.call(executable, counters, 0)
        del executable
        if cycle % self.o["clear_every"] == 0:
            rss.append(self.quiet_sample(cycle))

    def churn(self, workers_done: threading.Event) -> None:
        """Compiles, runs and drops executables until the workers are done and at least
        ``churn_cycles`` cycles ran; the last RSS sample is taken after the workers stopped."""
        rng = random.Random(self.o["seed"] + 7)
        while not self.stop.is_set():
            if workers_done.is_set() and self.churn_cycles >= self.o["churn_cycles"]:
                break
            self.churn_cycles += 1
            self.churn_cycle(rng, self.churn_counters, self.churn_rss, control=False, cycle=self.churn_cycles)
        if self.churn_cycles:
            self.churn_rss.append(settled_sample(self.churn_cycles) | {"workers_running": 0})

    def total(self) -> Counters:
        total = Counters()
        for c in [*self.worker_counters, self.churn_counters]:
            total.calls += c.calls
            total.mismatches += c.mismatches
            total.errors += c.errors
            total.jax_errors += c.jax_errors
        return total

    def progress(self, fraction: float, final: bool = False) -> None:
        if not self.o["progress"]:
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

    def run_workers(self, executables, rounds, seconds, churn: bool, show: bool = True) -> float:
        """Runs the workers (and the churn thread); returns the seconds they took. `show`: print
        the progress bar meanwhile."""
        o = self.o
        # One clock for the deadline and the elapsed time, so a run given `seconds` reports at
        # least that many (taking `start` after the threads started read short by their start-up).
        start = time.monotonic()
        deadline = None if seconds is None else start + seconds
        barrier = threading.Barrier(o["threads"] + 1)
        workers = self.worker_threads = [
            threading.Thread(target=self.worker, args=(i, executables, rounds, deadline, barrier), daemon=True)
            for i in range(o["threads"])
        ]
        workers_done = threading.Event()
        churner = threading.Thread(target=self.churn, args=(workers_done,), daemon=True)
        for t in workers:
            t.start()
        barrier.wait()
        if churn:
            churner.start()
        planned = o["threads"] * len(executables) * (rounds or 0)
        calls_before = sum(c.calls for c in self.worker_counters)
        last = 0.0
        while any(t.is_alive() for t in workers) or (churn and churner.is_alive()):
            time.sleep(0.05)
            if not workers_done.is_set() and not any(t.is_alive() for t in workers):
                workers_done.set()
            now = time.monotonic()
            if show and now - last >= (0.2 if sys.stderr.isatty() else 5.0):
                last = now
                if deadline is not None:
                    fraction = (now - start) / seconds
                else:
                    done = sum(c.calls for c in self.worker_counters) - calls_before
                    fraction = done / planned if planned else 1.0
                if churn and o["churn_cycles"]:
                    fraction = min(fraction, self.churn_cycles / o["churn_cycles"])
                self.progress(fraction)
        workers_done.set()
        return time.monotonic() - start

    def execute(self) -> Report:
        import jax
        import numpy as np

        import rmsnorm_ffi

        o = self.o
        rmsnorm_ffi.register()
        self.known_targets: set[str] = set()
        if o["mesh"] is not None:
            from jax.sharding import AxisType, Mesh

            devices = jax.devices()
            if len(devices) < o["devices"]:
                raise ValueError(
                    f"devices={o['devices']}: JAX has {len(devices)} devices; the count is set when JAX's backend "
                    f"starts: set XLA_FLAGS=--xla_force_host_platform_device_count={o['devices']} before that (the "
                    "command line's --devices does), or run in a fresh process"
                )
            if o["mesh"] == "explicit":
                self.mesh = jax.make_mesh((o["devices"],), ("d",), axis_types=(AxisType.Explicit,),
                                          devices=devices[: o["devices"]])
            else:
                self.mesh = Mesh(np.array(devices[: o["devices"]]), ("d",))

        before = rmsnorm_ffi.stats()
        live_before = {s["id"] for s in before["states"]}
        sets = max(1, min(o["threads"], INPUT_SETS))
        executables = [Executable(self, i, sets) for i in range(o["executables"])]
        # No loop variables here: one would keep the last executable (and its states) alive.
        self.known_targets = set().union(*(e.targets for e in executables))
        all_gathers = sum(count_all_gathers(e.hlo) for e in executables) if self.mesh is not None else 0
        # Warm-up: the pools grow to what one call needs.
        any(self.call(e, self.churn_counters, 0) for e in executables)
        warm = rmsnorm_ffi.stats()

        elapsed = self.run_workers(executables, o["calls"], o["seconds"], o["churn"])
        self.progress(1.0, final=True)
        during = rmsnorm_ffi.stats()

        # Steady state: no churn, the pools have grown to the concurrency they saw.
        steady_before = sum(c.calls for c in self.worker_counters)
        steady_stats = rmsnorm_ffi.stats()
        if o["steady_rounds"]:
            self.run_workers(executables, o["steady_rounds"], None, churn=False, show=False)
        steady_after = rmsnorm_ffi.stats()
        steady_calls = sum(c.calls for c in self.worker_counters) - steady_before
        steady_allocations = steady_after["workspace_allocations"] - steady_stats["workspace_allocations"]

        # Drop everything, then every state made during the run must be gone.
        del executables
        jax.clear_caches()
        gc.collect()
        after = rmsnorm_ffi.stats()
        leaked = [s for s in after["states"] if s["id"] not in live_before]

        # The control: as many churn cycles of a jnp-only function, for the RSS comparison.
        control_rss: list[dict[str, Any]] = []
        control_cycles = min(self.churn_cycles, o["control_cycles"]) if o["churn"] and o["control"] else 0
        control_counters = Counters()
        control_start = time.monotonic()
        if control_cycles:
            rng = random.Random(o["seed"] + 11)
            for cycle in range(1, control_cycles + 1):
                self.churn_cycle(rng, control_counters, control_rss, control=True, cycle=cycle)
            control_rss.append(settled_sample(control_cycles))
        control_seconds = time.monotonic() - control_start
        # The control calls no custom call: whatever it raised is not the bundle's.
        self.churn_counters.jax_errors += control_counters.jax_errors + control_counters.errors

        total = self.total()
        churn_growth = _growth_mb(self.churn_rss)
        control_growth = _growth_mb(control_rss)
        churn_heap = _growth_mb(self.churn_rss, "heap_in_use")
        control_heap = _growth_mb(control_rss, "heap_in_use")
        failures = []
        if total.mismatches:
            failures.append(f"{total.mismatches} results did not pass")
        if total.errors:
            failures.append(f"{total.errors} calls raised errors from the bundle")
        if leaked:
            failures.append(
                f"{len(leaked)} states created during the run are still registered after every executable was "
                f"dropped (targets: {', '.join(sorted({s['target'] for s in leaked}))})"
            )
        rss_judged = min(_trend_points(self.churn_rss), _trend_points(control_rss)) >= RSS_TREND_MIN_SAMPLES
        if None not in (churn_growth, control_growth) and rss_judged and churn_growth > control_growth + o["rss_slack_mb"]:
            failures.append(
                f"RSS grew by {churn_growth} MB over {self.churn_cycles} churn cycles, the jnp-only control by "
                f"{control_growth} MB (allowed: {o['rss_slack_mb']} MB more)"
            )
        if None not in (churn_heap, control_heap) and churn_heap > control_heap + o["heap_slack_mb"]:
            failures.append(
                f"the heap in use grew by {churn_heap} MB over {self.churn_cycles} churn cycles, the jnp-only control's "
                f"by {control_heap} MB (allowed: {o['heap_slack_mb']} MB more)"
            )
        if steady_calls and steady_allocations * 2 > steady_calls:
            failures.append(
                f"{steady_allocations} workspace allocations in {steady_calls} calls after warm-up: the pools "
                "still allocate in steady state"
            )
        bundle_failed = bool(failures)
        if total.jax_errors:
            failures.append(f"{total.jax_errors} errors raised by JAX itself (not blamed on the bundle)")
        status = EXIT_FAILED if bundle_failed else (EXIT_HARNESS if total.jax_errors else EXIT_OK)
        return Report(
            name=o["name"],
            threads=o["threads"],
            executables=o["executables"],
            devices=o["devices"],
            mesh=o["mesh"] if self.mesh is not None else None,
            all_gathers=all_gathers,
            targets=sorted(self.known_targets),
            seconds=round(elapsed, 3),
            calls=total.calls,
            calls_per_second=round((total.calls - steady_calls) / elapsed, 1) if elapsed > 0 else None,
            mismatches=total.mismatches,
            errors=total.errors,
            jax_errors=total.jax_errors,
            churn_cycles=self.churn_cycles,
            states_created=after["created_states"] - before["created_states"],
            # Of those: the process's other states may die meanwhile (the caches are cleared).
            states_destroyed=after["created_states"] - before["created_states"] - len(leaked),
            states_live_during_run=during["live_states"],
            states_leaked=len(leaked),
            leaked_states=[{"id": s["id"], "target": s["target"], "type": s["type"]} for s in leaked],
            executions={
                target: count - before["executions"].get(target, 0)
                for target, count in after["executions"].items()
                if count != before["executions"].get(target, 0)
            },
            workspace_bytes=during["workspace_bytes"],
            workspace_allocations_during_run=during["workspace_allocations"] - warm["workspace_allocations"],
            workspace_allocations_after_warmup=steady_allocations,
            steady_calls=steady_calls,
            peak_rss_mb=round(peak_rss_bytes() / 2**20, 1),
            churn_rss_growth_mb=churn_growth,
            control_cycles=control_cycles,
            control_seconds=round(control_seconds, 3),
            control_rss_growth_mb=control_growth,
            rss_slack_mb=o["rss_slack_mb"],
            rss_judged=rss_judged,
            churn_heap_growth_mb=churn_heap,
            control_heap_growth_mb=control_heap,
            heap_slack_mb=o["heap_slack_mb"],
            churn_samples=self.churn_rss,
            control_samples=control_rss,
            examples=self.examples,
            jax_examples=self.jax_examples,
            failures=failures,
            ok=status == EXIT_OK,
            exit_status=status,
        )


def run(
    fn: Callable,
    cases: Callable,
    *,
    reference: Callable | None = None,
    check: Callable | None = None,
    tolerance: tuple[float, float] | Callable = (1e-5, 1e-5),
    threads: int | None = None,
    executables: int = 4,
    seconds: float | None = None,
    calls: int | None = None,
    churn: bool = True,
    churn_cycles: int = 0,
    clear_every: int = 25,
    steady_rounds: int = 3,
    devices: int = 1,
    mesh: str | None = None,
    in_specs: Sequence | Callable | None = None,
    control: Callable | None | bool = None,
    rss_slack_mb: float = 32.0,
    heap_slack_mb: float = 8.0,
    control_cycles: int = 100,
    seed: int = 0,
    progress: bool = True,
    summary: bool = True,
    name: str | None = None,
) -> Report:
    """Stresses ``fn`` (any JAX function, typically calling FFI targets); returns a
    :class:`Report`, after printing a progress bar (stderr, unless ``progress=False``) and the
    summary (stdout, unless ``summary=False``).

    - ``cases(index, rng)`` -> a tuple of arrays, or ``Inputs(*arrays, **static)``: the inputs
      of executable ``index`` (its shapes, dtypes and static values must depend on ``index``
      only; ``rng``, a ``numpy.random.Generator``, draws the values). If ``cases`` takes a
      keyword ``devices``, it gets the run's device count (e.g. to make rows divisible).
    - ``reference(*arrays, **static)`` -> the expected outputs (a pytree of NumPy arrays in the
      order of ``fn``'s), computed without JAX; compared with ``tolerance``, ``(rtol, atol)``
      or a function of the inputs returning it (``atol`` scales with the largest expected
      magnitude; integer outputs must be equal).
    - ``check(outputs, *arrays, **static)``: a property check, with or instead of a reference;
      returns None/True when the outputs (NumPy) pass, else a description or False (an
      AssertionError counts as a failed check with its message).
    - ``threads`` workers (default 2 x cores) each run ``executables`` executables, ``calls``
      rounds each or for ``seconds`` (default 10 s when neither is given).
    - ``churn``: a thread compiles, runs and drops fresh executables meanwhile, at least
      ``churn_cycles`` of them, clearing JAX's caches every ``clear_every`` cycles.
    - ``steady_rounds`` more rounds per thread after the churn: the workspace allocations
      there (the pools still growing after warm-up) must stay under one per two calls.
    - ``devices`` > 1 (or ``mesh="explicit"``): a mesh of that many devices (forced host
      devices on CPU: set ``XLA_FLAGS=--xla_force_host_platform_device_count=D`` before JAX
      starts); ``mesh="shard_map"`` (default) runs ``fn`` per shard under ``jax.shard_map``
      (outputs sharded along their leading axis; ``fn`` must then work row by row) unless
      ``fn`` takes a keyword ``mesh`` and shards itself; ``mesh="explicit"`` places the inputs
      with ``NamedSharding`` on an explicit mesh and compiles under ``jax.set_mesh``.
      ``in_specs``: each argument's ``PartitionSpec`` (or a function of the inputs returning
      them); default: the leading axis over the mesh when it divides, else replicated.
    - ``control``: the jnp-only function of the control run (same inputs and static values);
      default: one returning zeros of ``fn``'s output shapes plus the inputs' sum; ``False``
      for no control run. The churn's RSS growth may exceed the control's by ``rss_slack_mb``,
      and its growth of the heap in use (glibc's ``mallinfo2``; not checked elsewhere) the
      control's by ``heap_slack_mb``. Growth is the trend through settled samples
      (:func:`settled_sample`, taken with the workers parked between calls), times the cycles.
      The RSS comparison is made only when both trends rest on ``RSS_TREND_MIN_SAMPLES``
      samples or more (``rss_judged``): a shorter churn (under ``3 * clear_every`` cycles
      or so) reports its RSS figures without judging them; the heap check still holds.

    Raises ValueError/TypeError for bad options, naming the option.
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a function, got {type(fn).__name__}")
    if not callable(cases):
        raise TypeError(f"cases: expected a function cases(index, rng), got {type(cases).__name__}")
    if reference is None and check is None:
        raise ValueError("pass reference= (expected outputs, computed without JAX) or check= (a property of the outputs)")
    for label, value in (("reference", reference), ("check", check)):
        if value is not None and not callable(value):
            raise TypeError(f"{label}: expected a function, got {type(value).__name__}")
    threads = 2 * (os.cpu_count() or 1) if threads is None else threads
    for label, value, least in (("threads", threads, 1), ("executables", executables, 1), ("devices", devices, 1),
                                ("churn_cycles", churn_cycles, 0), ("clear_every", clear_every, 1),
                                ("steady_rounds", steady_rounds, 0), ("control_cycles", control_cycles, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{label}: expected an int >= {least}, got {value!r}")
    if calls is not None and seconds is not None:
        raise ValueError("pass calls= or seconds=, not both")
    if calls is not None and (isinstance(calls, bool) or not isinstance(calls, int) or calls < 1):
        raise ValueError(f"calls: expected an int >= 1, got {calls!r}")
    if seconds is not None and not (isinstance(seconds, (int, float)) and seconds > 0):
        raise ValueError(f"seconds: expected a positive number, got {seconds!r}")
    if calls is None and seconds is None:
        seconds = 10.0
    if mesh not in (None, "shard_map", "explicit"):
        raise ValueError(f"mesh: expected None, 'shard_map' or 'explicit', got {mesh!r}")
    if mesh is None and devices > 1:
        mesh = "shard_map"
    opts = dict(
        threads=threads, executables=executables, seconds=seconds, calls=calls, churn=bool(churn),
        churn_cycles=churn_cycles, clear_every=clear_every, steady_rounds=steady_rounds, devices=devices,
        mesh=mesh, control=control is not False, rss_slack_mb=float(rss_slack_mb), heap_slack_mb=float(heap_slack_mb),
        control_cycles=control_cycles,
        seed=int(seed),
        progress=bool(progress), name=name or _name_of(fn),
    )
    harness = _Harness(fn, cases, reference, check, tolerance, in_specs,
                       None if control in (None, False, True) else control, opts)
    report = harness.execute()
    if summary:
        print_summary(report.as_dict())
    return report


def print_summary(summary: dict[str, Any], out=None) -> None:
    out = out or sys.stdout  # looked up now: tests and callers may have replaced it
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"stress: {summary['name']} (targets: {', '.join(summary['targets']) or 'none'})")
    p(
        f"calls: {summary['calls']} in {summary['seconds']:.1f} s ({summary['calls_per_second']} calls/s) "
        f"from {summary['threads']} threads x {summary['executables']} executables"
        + (f" on {summary['devices']} devices" if summary["devices"] > 1 else "")
        + (f" ({summary['mesh']} mesh)" if summary.get("mesh") == "explicit" else "")
    )
    if summary.get("mesh"):
        p(f"all-gathers in the {summary['executables']} compiled programs: {summary['all_gathers']}")
    p(f"mismatches: {summary['mismatches']}  errors: {summary['errors']}  "
      f"JAX's own errors (not the bundle's): {summary['jax_errors']}")
    control = (f", the jnp-only control's {summary['control_rss_growth_mb']} MB over {summary['control_cycles']}"
               if summary["control_rss_growth_mb"] is not None else "")
    growth = (f"{summary['churn_rss_growth_mb']} MB" if summary["churn_rss_growth_mb"] is not None
              else "not measured (the caches were never cleared before the end)")
    judged = ("" if summary["rss_judged"] or summary["churn_rss_growth_mb"] is None else
              f" (not compared: fewer than {RSS_TREND_MIN_SAMPLES} settled samples; lower --clear-every or run longer)")
    p(f"churn: {summary['churn_cycles']} executables compiled, run and dropped; "
      f"RSS growth over the churn {growth}{control}{judged}")
    if summary["churn_heap_growth_mb"] is not None:
        heap_control = (f", the control's {summary['control_heap_growth_mb']} MB"
                        if summary["control_heap_growth_mb"] is not None else "")
        p(f"heap in use (malloc): growth over the churn {summary['churn_heap_growth_mb']} MB{heap_control}")
    p(
        f"states: created {summary['states_created']}, destroyed {summary['states_destroyed']}, "
        f"live during the run {summary['states_live_during_run']}, leaked {summary['states_leaked']}"
    )
    p(
        f"workspace bytes held: {summary['workspace_bytes']}; allocations during the run: "
        f"{summary['workspace_allocations_during_run']}, after warm-up: "
        f"{summary['workspace_allocations_after_warmup']} in {summary['steady_calls']} calls"
    )
    p(f"peak RSS: {summary['peak_rss_mb']} MB")
    for example in summary["examples"]:
        p(f"  problem: {example}")
    for example in summary["jax_examples"]:
        p(f"  JAX's own error: {example}")
    for failure in summary["failures"]:
        p(f"  failed: {failure}")
    p("OK" if summary["ok"] else ("FAILED" if summary["exit_status"] == EXIT_FAILED else "INCONCLUSIVE (JAX's own errors)"))


# ---------------------------------------------------------------------------------------------
# Our RMS norm, as one spec among others
# ---------------------------------------------------------------------------------------------

# dtype name -> (rtol, atol) against the reference, forward and gradients alike. Both sides
# accumulate in float32; the half-precision bounds cover one rounding of the output.
TOLERANCES = {
    "float32": (2e-5, 2e-5),
    "bfloat16": (2e-2, 2e-2),
    "float16": (4e-3, 4e-3),
}
# Small shapes stress the call path; the last two span several parallel chunks of the backward
# (256K elements each), so their weight gradients are summed over pooled partial rows.
SHAPES = [(1, 128), (7, 96), (16, 1000), (32, 256), (64, 512), (8, 4096), (128, 64), (4, 2048),
          (128, 4096), (1024, 384)]
KINDS = ("fwd", "fwd+w", "grad", "grad+w")
EPS_CHOICES = (1e-6, 1e-5, 1e-3)


def numpy_reference(x, w, g, *, kind: str, eps: float) -> list:
    """The expected outputs in float64 NumPy, independent of JAX: ``y``, then for the gradient
    kinds the gradients of ``sum(y.astype(float32) * g)`` (``dx``, and ``dweight`` with a
    weight)."""
    import numpy as np

    weighted = kind.endswith("+w")
    xf = x.astype(np.float64)
    wf = w.astype(np.float64) if weighted else np.ones(x.shape[-1])
    rstd = 1.0 / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + np.float32(eps))
    y = xf * rstd * wf
    if not kind.startswith("grad"):
        return [y]
    dy = g.astype(x.dtype).astype(np.float64)  # the cast to float32 hands back g in x's dtype
    wdy = wf * dy
    dx = rstd * wdy - xf * rstd**3 * np.mean(xf * wdy, axis=-1, keepdims=True)
    if not weighted:
        return [y, dx]
    return [y, dx, np.sum(xf * rstd * dy, axis=0)]


def rms_norm_spec(dtypes: Sequence[str] = tuple(sorted(TOLERANCES)), kinds: Sequence[str] = KINDS,
                  shapes: Sequence[tuple[int, int]] = tuple(SHAPES)) -> Spec:
    """Our RMS norm as a spec: each index draws a shape, dtype, kind (forward, or y and its
    ``jax.grad``, with or without weight) and eps; inputs ``(x, weight, g)`` with ``g`` the cotangent of the
    gradient kinds; the float64 NumPy reference. Under a ``shard_map`` mesh the forward runs per
    shard inside the gradient (rows over the devices, the weight whole on each)."""
    import numpy as np

    for label, values, allowed in (("dtypes", dtypes, TOLERANCES), ("kinds", kinds, KINDS)):
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise ValueError(f"{label}: expected some of {', '.join(allowed)}, got {list(values)!r}")

    def cases(index: int, rng, devices: int = 1) -> Inputs:
        import jax.numpy as jnp

        pick = random.Random(index)
        rows, cols = pick.choice(list(shapes))
        rows = max(devices, rows - rows % devices)  # rows divisible by devices (shard_map)
        kind = pick.choice(list(kinds))
        dtype = pick.choice(list(dtypes))
        eps = pick.choice(EPS_CHOICES)
        x = np.asarray(rng.standard_normal((rows, cols), np.float32)).astype(jnp.dtype(dtype))
        w = (1.0 + 0.5 * rng.standard_normal(cols, np.float32)).astype(jnp.dtype(dtype))
        g = rng.standard_normal((rows, cols), np.float32)
        return Inputs(x, w, g, kind=kind, eps=eps)

    def fn(x, w, g, *, kind: str, eps: float, mesh=None):
        import jax
        import jax.numpy as jnp

        import rmsnorm_ffi

        weighted = kind.endswith("+w")

        def fwd(x, w):
            return rmsnorm_ffi.rms_norm(x, w if weighted else None, eps)

        if mesh is not None and not is_explicit(mesh):
            from jax.sharding import PartitionSpec as P

            # Rows split over the devices, the weight whole on each: one call per device.
            fwd = jax.shard_map(fwd, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"))
        if not kind.startswith("grad"):
            return fwd(x, w)

        # y and the gradients, from one program: y is one of its outputs, so it runs both call
        # sites (a gradient alone would not: its CPU backward takes rstd from x, and XLA drops
        # the forward).
        def loss(x, w):
            y = fwd(x, w)
            return jnp.sum(y.astype(jnp.float32) * g), y

        (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1) if weighted else 0, has_aux=True)(x, w)
        return (y, *grads) if weighted else (y, grads)

    def tolerance(x, w, g, *, kind, eps):
        return TOLERANCES[str(x.dtype)]

    def in_specs(x, w, g, *, kind, eps):
        from jax.sharding import PartitionSpec as P

        return (P("d"), P(), P("d"))

    def control(x, w, g, *, kind, eps):
        import jax
        import jax.numpy as jnp

        # The forward's math in jnp: the control's executables are about the size of ours.
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * w.astype(jnp.float32)
        return y.astype(x.dtype)

    return Spec(fn=fn, cases=cases, reference=numpy_reference, tolerance=tolerance, in_specs=in_specs,
                control=control, name="rmsnorm_ffi.rms_norm")


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def load_spec(text: str, factory_kwargs: dict | None = None) -> Spec:
    """``MODULE:NAME`` -> the Spec: MODULE is a dotted module name (importable, the current
    directory included) or a path to a ``.py`` file; NAME a Spec or a function of no arguments
    returning one."""
    module_name, sep, attr = text.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--spec: expected MODULE:NAME (a module or .py path, and a Spec in it), got {text!r}")
    if module_name.endswith(".py") or os.sep in module_name:
        path = pathlib.Path(module_name)
        if not path.is_file():
            raise ValueError(f"--spec {text}: no such file: {module_name}")
        spec = importlib.util.spec_from_file_location(f"_stress_spec_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.resolve().parent))
        spec.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"--spec {text}: cannot import {module_name}: {e}") from e
    if not hasattr(module, attr):
        raise ValueError(f"--spec {text}: {module_name} has no {attr}")
    found = getattr(module, attr)
    if not isinstance(found, Spec) and callable(found):
        found = found(**(factory_kwargs or {}))
    if not isinstance(found, Spec):
        raise ValueError(f"--spec {text}: expected a rmsnorm_ffi.stress.Spec (or a function returning one), got "
                         f"{type(found).__name__}")
    if not found.name:
        found.name = text
    return found


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
    p.add_argument("--library", metavar="PATH", action="append", default=[],
                   help="register this bundle library (rmsnorm_ffi.register_library) before loading the spec; "
                        "may be given more than once")
    p.add_argument("--spec", metavar="MODULE:NAME", default=None,
                   help="the spec to run: a rmsnorm_ffi.stress.Spec (or a function returning one) in a module "
                        "or .py file (default: our RMS norm, rmsnorm_ffi.stress:rms_norm_spec)")
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
    p.add_argument("--clear-every", type=int, default=25,
                   help="clear JAX's caches every this many churn cycles (default: 25)")
    p.add_argument("--steady-rounds", type=int, default=3,
                   help="rounds per worker after the churn, counting workspace allocations (default: 3)")
    p.add_argument("--no-control", dest="control", action="store_false",
                   help="no jnp-only control run for the RSS comparison")
    p.add_argument("--control-cycles", type=int, default=100,
                   help="cycles of the control run: as many as the churn did, up to this (default: 100)")
    p.add_argument("--rss-slack-mb", type=float, default=32.0,
                   help="how much more the churn's RSS may grow than the control's (default: 32)")
    p.add_argument("--heap-slack-mb", type=float, default=8.0,
                   help="how much more the churn's heap in use (glibc's mallinfo2) may grow than the control's "
                        "(default: 8)")
    p.add_argument("--devices", type=int, default=1,
                   help="split the CPU into this many XLA devices and run under shard_map, or under an "
                        "explicit mesh with --mesh explicit (default: 1)")
    p.add_argument("--mesh", choices=("shard_map", "explicit"), default="shard_map",
                   help="with --devices: shard_map (the spec's calls inside jax.shard_map over the devices), or "
                        "explicit (NamedSharding arrays, sharded as the spec's in_specs say, on a jax.make_mesh "
                        "explicit mesh, compiled under jax.set_mesh) (default: shard_map)")
    rms = p.add_argument_group("the built-in RMS norm spec (without --spec)")
    rms.add_argument("--dtypes", type=_choices(TOLERANCES), default=None,
                     help=f"comma-separated dtypes to draw from (default: {','.join(sorted(TOLERANCES))})")
    rms.add_argument("--kinds", type=_choices(KINDS), default=None,
                     help="comma-separated kinds to draw from: fwd, fwd+w, grad, grad+w (default: all)")
    rms.add_argument("--shapes", type=_shapes, default=None,
                     help="comma-separated ROWSxCOLS shapes to draw from (default: a mix from 1x128 to 128x4096)")
    p.add_argument("--seed", type=int, default=0, help="seed for the inputs and schedules (default: 0)")
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON to PATH")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    for name in ("threads", "executables", "devices", "clear_every", "control_cycles"):
        if getattr(args, name) < 1:
            parser().error(f"--{name.replace('_', '-')} must be at least 1")
    rms_options = {k: v for k, v in (("dtypes", args.dtypes), ("kinds", args.kinds), ("shapes", args.shapes))
                   if v is not None}
    if args.spec is not None and rms_options:
        parser().error(f"--{', --'.join(rms_options)}: only for the built-in RMS norm spec, not with --spec")
    if args.devices > 1:
        # Read when the backend starts, which has not happened yet in a fresh process (if it
        # has, the device count check in run says so).
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import rmsnorm_ffi

    for library in args.library:
        try:
            rmsnorm_ffi.register_library(library)
        except (OSError, ValueError) as e:
            parser().error(f"--library {library}: {e}")
    try:
        spec = load_spec(args.spec) if args.spec is not None else rms_norm_spec(**rms_options)
    except ValueError as e:
        parser().error(str(e))
    options = {} if args.control else {"control": False}
    report = spec.run(
        threads=args.threads, executables=args.executables, seconds=args.seconds, calls=args.calls,
        churn=args.churn, churn_cycles=args.churn_cycles, clear_every=args.clear_every,
        steady_rounds=args.steady_rounds, devices=args.devices,
        mesh=args.mesh if (args.devices > 1 or args.mesh == "explicit") else None,
        rss_slack_mb=args.rss_slack_mb, heap_slack_mb=args.heap_slack_mb, control_cycles=args.control_cycles, seed=args.seed, progress=not args.quiet, summary=True, **options,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.as_dict(), f, indent=2)
    return report.exit_status


if __name__ == "__main__":
    # Run as `python -m`, this file is `__main__`; specs built with `rmsnorm_ffi.stress.Spec`
    # must meet that module's classes, not copies of them.
    from rmsnorm_ffi import stress as _stress

    sys.exit(_stress.main())

"""What bench/gpu_check.py and bench/gpu_sweep.py share: the JSON-lines log with its budgeted
sections, the float64 references, the error measure, the "k calls against 2k calls" timing and
the optional competitors jax's ecosystem ships (the Pallas RMS norm, tokamax's layer norm).

Import it after the environment the caller needs is set (XLA_FLAGS, JAX_PLATFORMS, ...): it
imports jax.
"""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

EPS = 1e-5
XPROF_ABSENT = False  # set when tokamax was imported with xprof's modules standing in
TOL = {"float32": 2e-5, "float64": 1e-12, "bfloat16": 2e-2, "float16": 2e-3}


class Log:
    """Results as JSON lines, each appended and flushed at once (a run killed at its timeout
    still leaves what it measured), and sections that run only when their estimate fits the
    budget left. `extra` goes into every record (the sweep's dry run marks them all
    `"stand_in": "cpu"`)."""

    def __init__(self, path: Path, budget: float, extra: dict | None = None):
        self.path = Path(path)
        self.budget = budget
        self.extra = dict(extra or {})
        self.start = time.monotonic()
        self.summary: list[tuple[str, str, str]] = []  # (section, status, detail)
        self.failed = False

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)

    def record(self, section: str, **data) -> None:
        data = {"section": section, "t": round(time.monotonic() - self.start, 2), **self.extra, **data}
        line = json.dumps(data, default=str)
        with self.path.open("a") as f:
            f.write(line + "\n")
            f.flush()
        print(line, flush=True)

    def section(self, name: str, needs: float):
        """A decorator that runs the section at once if `needs` seconds are left; records
        pass/FAIL/skipped and turns any exception into a failure (every failure is data here).
        The section returns (ok, detail)."""

        def wrap(fn):
            if self.left() < needs:
                self.skip(name, f"time: {self.left():.0f} s left, needs ~{needs:.0f}")
                return fn
            t = time.monotonic()
            try:
                ok, detail = fn()
            except Exception as e:  # noqa: BLE001
                ok, detail = False, f"{type(e).__name__}: {e}"
            status = "pass" if ok else "FAIL"
            self.failed |= not ok
            self.summary.append((name, status, f"{detail} ({time.monotonic() - t:.0f} s)"))
            self.record(name, status=status, detail=detail)
            return fn

        return wrap

    def skip(self, name: str, why: str) -> None:
        self.summary.append((name, "skipped", why))
        self.record(name, status="skipped", reason=why)

    def finish(self, table: str, out: Path) -> None:
        """Writes the table to out/table.txt and prints it last (a device call's reply holds the
        end of the output); exits 1 if a section failed, else 0."""
        (Path(out) / "table.txt").write_text(table + "\n")
        print()
        print(table)
        print(f"\ntotal {self.budget - self.left():.0f} s of {self.budget:.0f}; results in {self.path}")
        sys.exit(1 if self.failed else 0)

    def summary_lines(self) -> list[str]:
        lines = [f"{'section':12s} {'status':8s} detail", "-" * 100]
        return lines + [f"{s:12s} {st:8s} {d}" for s, st, d in self.summary]


def ref_np(x, w, dy, eps=EPS):
    """float64 y, rstd, dx, dw (dw per weight row for a batched weight)."""
    x = np.asarray(x, np.float64)
    dy = np.asarray(dy, np.float64)
    n = x.shape[-1]
    eps = float(np.float32(eps))  # eps travels as a float32 attribute
    r = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    wf = np.ones(n) if w is None else np.asarray(w, np.float64)
    if wf.ndim > 1:
        wf = wf.reshape(wf.shape[:-1] + (1,) * (x.ndim - wf.ndim) + (n,))
    y = x * r * wf
    g = dy * wf
    dx = r * g - x * r**3 / n * (g * x).sum(-1, keepdims=True)
    if w is not None and np.asarray(w).ndim > 1:
        dw = (dy * x * r).reshape(np.asarray(w).shape[:-1] + (-1, n)).sum(-2)
    else:
        dw = (dy * x * r).reshape(-1, n).sum(0)
    return y, r[..., 0], dx, dw


def err(got, want, scale=1.0):
    """The largest |got - want| / (|want| + scale), in float64; inf when the shapes differ."""
    got = np.asarray(jnp.asarray(got).astype(jnp.float64))
    want = np.asarray(want, np.float64)
    if got.shape != want.shape:
        return float("inf")
    if want.size == 0:
        return 0.0
    return float(np.max(np.abs(got - want) / (np.abs(want) + scale)))


def timed(fn, args, k):
    """Seconds per op: `fn` applied to each of k argument sets in one executable, best of 5,
    and the same over all 2k sets: the difference over k is the time each further call adds,
    without the executable's dispatch and final sync (about 170 us on the first H200 run, most
    of a call's time at small shapes). Returns (marginal, whole executable of k / k)."""

    def best_of_5(sets):
        many = jax.jit(lambda sets: [fn(*a) for a in sets])
        jax.block_until_ready(many(sets))
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            jax.block_until_ready(many(sets))
            best = min(best, time.perf_counter() - t)
        return best

    one, two = best_of_5(args[:k]), best_of_5(args)
    return max(two - one, 1e-9) / k, one / k


def l2_bytes(gpu_info: dict) -> int:
    """The first device's L2 size as the extension reads it (50 MiB when unknown: an H100's)."""
    return next((d.get("l2_bytes", 0) for d in gpu_info.get("devices", [])), 0) or (50 << 20)


def _without_xprof() -> None:
    """tokamax imports xprof at start for its benchmarking helpers alone, which nothing here
    uses; xprof's wheel (31 MB) and its dependencies (duckdb, google-cloud-storage, ...) do not
    fit the 64 MiB a device call carries. Modules that fail on first use stand in for the names
    it imports, so that tokamax's layer_norm can be timed without them."""

    class Absent(types.ModuleType):
        def __getattr__(self, name):
            raise AttributeError(f"{self.__name__}.{name}: xprof is not installed (not needed for layer_norm)")

    global XPROF_ABSENT
    XPROF_ABSENT = True
    names = ("xprof", "xprof.cli", "xprof.cli.tools", "xprof.cli.tools.get_kernel_stats_tool")
    for parent, name in zip((None,) + names, names):
        module = sys.modules.setdefault(name, Absent(name))
        if parent:
            setattr(sys.modules[parent], name.rsplit(".", 1)[1], module)


def optional_norms() -> dict:
    """The RMS norms jax's ecosystem ships, each as f(x2d, w) -> y where importable, else the
    reason as a string: the Pallas RMS norm in jax (deprecated in 0.12) and tokamax's
    layer_norm with subtract_mean=False (an RMS norm: no mean, no offset)."""
    found: dict = {}
    try:
        from jax.experimental.pallas.ops.gpu import rms_norm as pallas_mod

        def pallas(x, w):  # 3-D input, a bias; its eps defaults to EPS (a custom_vjp's nondiff arg)
            return pallas_mod.rms_norm(x[None], w, jnp.zeros_like(w))[0]

        found["pallas"] = pallas
    except Exception as e:  # noqa: BLE001
        found["pallas"] = f"absent: {type(e).__name__}: {e}"
    try:
        try:
            import tokamax
        except ModuleNotFoundError as e:
            if not (e.name or "").startswith("xprof"):
                raise
            _without_xprof()
            import tokamax

        def tokamax_norm(x, w, eps=EPS):
            return tokamax.layer_norm(x, w, None, epsilon=eps, subtract_mean=False)

        found["tokamax"] = tokamax_norm
    except Exception as e:  # noqa: BLE001
        found["tokamax"] = f"absent: {type(e).__name__}: {e}"
    return found

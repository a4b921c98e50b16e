"""Does the stress harness's churn leak, or does the allocator settle? The same churn at
several lengths, every memory figure the harness samples, and the trend of each per cycle.

    .venv/bin/python bench/churn_memory.py                 # 500, 2000 and 8000 cycles (~25 min)
    .venv/bin/python bench/churn_memory.py --cycles 100 400 --threads 4

Each length runs ``python -m rmsnorm_ffi.stress`` in a fresh process (4 forced host devices, 16
threads over 4 executables, as ``tests/python/test_stress.py`` does), with a jnp-only control
churn of the same length, and reads the settled samples that ``--json`` writes (one every
``clear_every`` cycles, with the caches cleared, the garbage collected and glibc's free heap
returned): RSS, glibc's heap in use and held (``mallinfo2``, every arena), live states,
workspace bytes and the arrays JAX holds.

How to read it: a leak grows with every cycle, so its growth per 1000 cycles is the same at
every length, and its total grows with the length. An allocator settling (arenas that hold
freed memory, fragmentation after the worker threads stop) grows RSS or the heap held by an
amount that does not grow with the length, so its per-1000-cycle figure shrinks as the runs
get longer. The heap in use is what the process asked malloc for and has not freed: it is
blind to the allocator's settling, and so the sharpest test for a leak through malloc.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

MB = 2**20


def trend_per_cycle(samples: list[dict], key: str, start: int) -> float | None:
    """Least-squares slope of ``key`` (bytes per cycle) over the samples from cycle ``start``."""
    kept = [(s["cycle"], s[key]) for s in samples if s["cycle"] >= start and s[key] is not None]
    if len({c for c, _ in kept}) < 2:
        return None
    return statistics.linear_regression([c for c, _ in kept], [v for _, v in kept]).slope


def run_once(cycles: int, threads: int, devices: int, control_cycles: int, out: pathlib.Path) -> dict:
    args = [
        sys.executable, "-m", "rmsnorm_ffi.stress", "--quiet", "--json", str(out), "--devices", str(devices),
        "-t", str(threads), "-k", "4", "-n", "200", "--churn-cycles", str(cycles),
        "--control-cycles", str(control_cycles),
    ]
    start = time.monotonic()
    result = subprocess.run(args, capture_output=True, text=True)
    if not out.exists():
        sys.exit(f"no summary from {' '.join(args)}:\n{result.stdout}\n{result.stderr[-3000:]}")
    summary = json.loads(out.read_text())
    summary["wall_seconds"] = round(time.monotonic() - start, 1)
    return summary


def describe(summary: dict) -> dict:
    churn, control = summary["churn_samples"], summary["control_samples"]
    cycles = summary["churn_cycles"]
    # From the first sample with every worker stopped and a tenth of the cycles done: the
    # workers' own allocations are not part of the churn's trend.
    quiet = [s["cycle"] for s in churn if s.get("workers_running") == 0]
    start = max(cycles // 10, min(quiet, default=0))
    row = {"cycles": cycles, "from_cycle": start, "seconds": summary["wall_seconds"]}
    for key in ("rss", "heap_in_use", "heap_held"):
        slope = trend_per_cycle(churn, key, start)
        row[f"{key}_kb_per_1000"] = None if slope is None else round(slope * 1000 / 1024, 1)
        row[f"{key}_first_last_mb"] = [round(s[key] / MB, 1) for s in (churn[0], churn[-1])]
        cslope = trend_per_cycle(control, key, summary["control_cycles"] // 10)
        row[f"control_{key}_kb_per_1000"] = None if cslope is None else round(cslope * 1000 / 1024, 1)
    row["live_states"] = sorted({s["live_states"] for s in churn if s["cycle"] >= start})
    row["live_arrays"] = sorted({s["live_arrays"] for s in churn if s["cycle"] >= start})
    row["workspace_bytes"] = sorted({s["workspace_bytes"] for s in churn if s["cycle"] >= start})
    row["harness_rss_growth_mb"] = summary["churn_rss_growth_mb"]
    row["ok"] = summary["ok"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, nargs="+", default=[500, 2000, 8000])
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--control-cycles", type=int, default=2000,
                   help="the jnp-only control's cycles, at most (default 2000)")
    p.add_argument("--out", type=pathlib.Path, default=None, help="write the rows and raw samples as JSON here")
    args = p.parse_args(argv)
    rows, raw = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, cycles in enumerate(args.cycles):
            summary = run_once(cycles, args.threads, args.devices, min(cycles, args.control_cycles),
                               pathlib.Path(tmp) / f"run{i}.json")
            raw.append(summary)
            row = describe(summary)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print("cycles | seconds | KB per 1000 cycles: RSS, heap in use, heap held | control (jnp only): RSS, heap in use"
          " | live states | live arrays")
    for r in rows:
        print(f"{r['cycles']} | {r['seconds']} | {r['rss_kb_per_1000']}, {r['heap_in_use_kb_per_1000']}, "
              f"{r['heap_held_kb_per_1000']} | {r['control_rss_kb_per_1000']}, "
              f"{r['control_heap_in_use_kb_per_1000']} | {r['live_states']} | {r['live_arrays']}")
    if args.out is not None:
        args.out.write_text(json.dumps({"rows": rows, "runs": raw}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`make gpu-traffic`: what decides the CUDA kernels' speed, measured without a GPU.

1. Builds the emulator with EMU_TRAFFIC (cpp/traffic.cpp: every global access the kernels
   make is recorded) and runs forward, backward (+ the dweight finalize) and the fused residual
   forward, bfloat16 and float32 with a weight of x's dtype, over row lengths 64..65536 (2^24
   elements each) and 8192x128, the same for LayerNorm (lnf, lnb + the dweight and dbias
   finalizes, lnres; with a weight and a bias), and the backward with the fused residual's dh and a scale
   offset (bwdh: bfloat16, three shapes), with the launch plans of src/handlers/gpu/plan.rs (re-derived
   in traffic.cpp; every plan run is written to docs/gpu-traffic-plans.txt, which plan.rs's
   unit test checks against the Rust functions, and this script checks the fresh plans
   against that file).
2. Compiles rmsnorm.cu with NVRTC from pip (the product's options) for compute_80/compute_90,
   assembles it with ptxas -v for sm_80/sm_90: registers, spills, static shared memory per
   kernel, and the widths of the PTX's global loads and stores.
3. The model (docs/gpu-traffic.md says it and its limits): occupancy from ptxas and the launch,
   bytes in flight per SM from the emulated loads, Little's law against an H200's 4.8 TB/s and
   700 ns, the waves of the grid, DRAM bytes from the distinct sectors each launch touches.
4. Checks the targets (exit 1 on a miss): traffic ratio <= 1.05, sector efficiency >= 95%,
   16-byte accesses to every row array, wherever the row allows vectors (n a multiple of 16
   bytes); no spills; predicted >= 90% of peak for the forward and >= 85% for the backward at
   rows >= 1024 in bfloat16. Then the self-check: three planted regressions (an uncoalesced
   forward, in the code both norms share; scalar accesses in the RMS norm's and in LayerNorm's
   vector forward) must each fail the checks of the norms they touch.

Writes OUT/table.md, OUT/traffic.json; with --update-docs also the table in docs/gpu-traffic.md
(between its markers), docs/gpu-traffic.json (bench/gpu_check.py prints its predictions next
to measured bandwidth) and docs/gpu-traffic-plans.txt.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SOURCE = ROOT / "src/handlers/gpu/rmsnorm.cu"
DOC = ROOT / "docs/gpu-traffic.md"
DOC_JSON = ROOT / "docs/gpu-traffic.json"
DOC_PLANS = ROOT / "docs/gpu-traffic-plans.txt"

# --- the machine (docs/gpu-traffic.md: "The model") -----------------------------------------
SMS = 132
PEAK = 4.8e12  # B/s, HBM3e, datasheet
COPY = 4.3e12  # B/s, a device-to-device copy measured on an H200 here (KINDS.md)
LATENCY = 700e-9  # s, an HBM load under load
L2_LATENCY = 300e-9  # s, an L2 hit under load (the finalize's partials)
SYNC = 200e-9  # s a cached kernel spends per batch of loads on its reduction (no loads then)
# s more per row for a backward split across a cluster (rmsnorm.cu's cluster_dot): the slot's
# store reaching L2 before the barrier releases, the barrier, the slots' loads from L2. An
# assumption (cluster barriers are hardware, ~200 ns is what is published for an H100's);
# only a device measures it.
CLUSTER_SYNC = 200e-9 + 2 * L2_LATENCY
LAUNCH = 2e-6  # s per launch in the "with launches" column (ramp-up, drain, launch gap)
FINALIZE_LOADS = 4  # partials a finalize thread loads before adding them (rmsnorm.cu)
MAX_THREADS, MAX_WARPS, MAX_BLOCKS = 2048, 64, 32
REGS, SMEM, SMEM_RESERVED = 65536, 233472, 1024
NEEDED = PEAK * LATENCY / SMS  # bytes in flight per SM for the peak

TARGET_RATIO, TARGET_SECTORS = 1.05, 0.95
TARGET_FWD, TARGET_BWD = 0.90, 0.85

SIZES = [64 << i for i in range(11)]  # 64 .. 65536
TOTAL = 1 << 24  # elements per shape of the sweep
EXTRA = [(128, 8192)]  # (n, rows) beyond the sweep (4096x4096 and 16384x1024 are in it)
# Misses the kernels are known to have (docs/gpu-traffic.md, "Left"). Reported, not failed; any
# other miss fails, and a known one that stops missing is said. The RMS norm has none since the
# backward of few rows of 32768 and 65536 bfloat16 split its rows across clusters (it missed at
# 67% and 50%); LayerNorm's backward (first measured in stop 54) misses where the RMS norm's
# did before: rows of one team per block write their two partial rows (dweight's, dbias's) from
# registers, 8-byte values 32 bytes apart (25% of each sector: 78% and 75% predicted at 4096 and
# 8192), rows past 8192 bfloat16 elements stream, reading x and dy twice (no cluster kernels
# for LayerNorm: 67%, 50%, 33%); and at n = 64 the per-row mean and rstd, each a 4-byte value
# per 32-byte sector per warp, bring the sector efficiency to 92% (8 rows share a sector in
# DRAM: its traffic ratio is 1.001).
KNOWN_MISSES: set[str] = {
    "lnb bf16 262144x64: sector efficiency",
    "lnb bf16 4096x4096: predicted",
    "lnb bf16 2048x8192: predicted",
    "lnb bf16 1024x16384: predicted",
    "lnb bf16 512x32768: predicted",
    "lnb bf16 256x65536: predicted",
}

KINDS = ["fwd", "bwd", "res"]
# LayerNorm's calls (the same kernels with a mean; a weight and a bias of x's dtype): forward,
# fused residual forward, backward (+ the dweight and dbias finalizes), over the same shapes.
LAYER_KINDS = ["lnf", "lnres", "lnb"]
BACKWARD_KINDS = ("bwd", "bwdh", "lnb")
DTYPES = ["bf16", "f32"]
SIZE_OF = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8}
# The backward with dh (the fused residual add's: one more row array read, added to dx before its
# one rounding) and a scale offset, whose targets are the backward's: (dtype, n, rows).
DH_CALLS = [("bf16", 1024, TOTAL // 1024), ("bf16", 16384, TOTAL // 16384), ("bf16", 128, 8192)]
CTYPE = {"f32": "float", "bf16": "bf16_t", "f16": "f16_t", "f64": "double"}
# The kernels these runs launch, the only ones the builds stamp (EMU_PAIRS in rmsnorm.cu: a
# third of the compile time of all 16 pairs; the kernels are the same code either way).
PAIRS = " ".join(
    [f"STAMP({d}, {CTYPE[d]}, {d}, {CTYPE[d]})" for d in DTYPES]
    + [f"FINALIZE_ENTRY({'f64' if d == 'f64' else 'f32'}, {'double' if d == 'f64' else 'float'}, "
       f"{d}, {CTYPE[d]})" for d in DTYPES])

# --- build -----------------------------------------------------------------------------------


def build(source: Path, out: Path, name: str) -> Path:
    cpp = HERE / "cpp"
    out.mkdir(parents=True, exist_ok=True)
    table = out / f"{name}-kernel_table.inc"
    pre = subprocess.run(
        ["g++", "-std=c++17", "-x", "c++", "-E", "-DEMU_EXPAND", f"-DEMU_PAIRS={PAIRS}", "-include",
         str(cpp / "cuda_shim.h"), str(source)],
        check=True, capture_output=True, text=True).stdout
    entries = re.findall(r"EMU_LAUNCH_BOUNDS\(([0-9]+)(?:, *([0-9]+))?\) *([A-Za-z0-9_]+)", pre)
    assert entries, "no kernels in the preprocessed source"
    table.write_text("".join(f"EMU_KERNEL({k}, {a}, 0{b})\n" for a, b, k in entries))
    common = ["g++", "-std=c++17", "-O2", "-fno-strict-aliasing", "-Wno-unknown-pragmas",
              "-DEMU_TRAFFIC", f"-DEMU_PAIRS={PAIRS}", f"-I{cpp}"]
    jobs = [
        common + ["-include", str(cpp / "cuda_shim.h"), f'-DEMU_KERNEL_SOURCE="{source}"',
                  f'-DEMU_KERNEL_TABLE="{table}"', "-c", str(cpp / "kernels.cpp"), "-o",
                  str(out / f"{name}-kernels.o")],
        common + ["-c", str(cpp / "fibers.cpp"), "-o", str(out / f"{name}-fibers.o")],
        common + ["-c", str(cpp / "traffic.cpp"), "-o", str(out / f"{name}-traffic.o")],
    ]
    procs = [subprocess.Popen(j) for j in jobs]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit(f"gpu-traffic: building {name} failed")
    exe = out / name
    subprocess.run(["g++", *(str(out / f"{name}-{o}.o") for o in ("kernels", "fibers", "traffic")),
                    "-o", str(exe)], check=True)
    return exe


def shapes() -> list[tuple[int, int]]:
    return [(n, TOTAL // n) for n in SIZES] + EXTRA


def emulate(exe: Path, max_blocks: int, forward_min_team: int = 1,
            kinds: list[str] | None = None) -> list[dict]:
    """The calls of `kinds` (default: all of them, and the backward with dh)."""
    lines = "".join(f"{k} {d} {n} {rows}\n" for d in DTYPES for k in kinds or KINDS + LAYER_KINDS
                    for n, rows in shapes())
    if kinds is None:
        lines += "".join(f"bwdh {d} {n} {rows}\n" for d, n, rows in DH_CALLS)
    out = subprocess.run([str(exe), str(max_blocks), str(forward_min_team)], input=lines,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"gpu-traffic: the emulated run failed:\n{out.stderr}")
    return [json.loads(line) for line in out.stdout.splitlines()]


# --- ptxas -----------------------------------------------------------------------------------


def site_packages() -> list[Path]:
    paths = [Path(sysconfig.get_paths()["purelib"])]
    env = os.environ.get("RMSNORM_FFI_SITE_PACKAGES")
    if env:
        paths = [Path(p) for p in env.split(os.pathsep)] + paths
    return paths


def nvrtc_ptx(arch: str, source: Path = SOURCE) -> str:
    """rmsnorm.cu compiled by NVRTC with the product's options (driver/nvrtc.rs), stamping the
    kernels the runs launch (PAIRS; tests/gpu_kernels.rs assembles all of them)."""
    lib = next((p / "nvidia/cuda_nvrtc/lib/libnvrtc.so.12" for p in site_packages()
                if (p / "nvidia/cuda_nvrtc/lib/libnvrtc.so.12").exists()), None)
    if lib is None:
        raise SystemExit("gpu-traffic: no nvidia/cuda_nvrtc under site-packages (make's DEPS)")
    nv = ctypes.CDLL(str(lib))
    prog = ctypes.c_void_p()
    src = source.read_bytes()
    assert nv.nvrtcCreateProgram(ctypes.byref(prog), src, b"rmsnorm.cu", 0, None, None) == 0
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", b"-default-device",
            f"-DEMU_PAIRS={PAIRS}".encode(), b"-DKERNEL_NORMS=3"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nv.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nv.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        raise SystemExit(f"gpu-traffic: NVRTC failed for {arch}:\n{log.value.decode()}")
    nv.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nv.nvrtcGetPTX(prog, ptx)
    nv.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.value.decode()


def ptx_widths(ptx: str) -> dict[str, dict[str, list[int]]]:
    """Per entry, the bit widths of its global loads and stores (ld.global/st.global)."""
    out: dict[str, dict[str, list[int]]] = {}
    for m in re.finditer(r"\.entry (\w+)\((.*?)\n}\n", ptx, re.S):
        widths: dict[str, set[int]] = {"ld": set(), "st": set()}
        for op, vec, bits in re.findall(
                r"\b(ld|st)\.global(?:\.nc)?(?:\.v(\d))?\.[busf](\d+)\b", m.group(2)):
            widths[op].add(int(vec or 1) * int(bits))
        out[m.group(1)] = {k: sorted(v) for k, v in widths.items()}
    return out


def ptxas_usage(out: Path, source: Path = SOURCE) -> dict:
    ptxas = next((p / "nvidia/cuda_nvcc/bin/ptxas" for p in site_packages()
                  if (p / "nvidia/cuda_nvcc/bin/ptxas").exists()), None)
    if ptxas is None:
        raise SystemExit("gpu-traffic: no nvidia/cuda_nvcc/bin/ptxas under site-packages")
    usage: dict = {}
    for cc in (80, 90):
        ptx = nvrtc_ptx(f"compute_{cc}", source)
        path = out / f"rmsnorm_{cc}.ptx"
        path.write_text(ptx)
        res = subprocess.run([str(ptxas), "-v", f"-arch=sm_{cc}", str(path), "-o",
                              str(out / f"rmsnorm_{cc}.cubin")], capture_output=True, text=True)
        text = res.stdout + res.stderr
        if res.returncode != 0:
            raise SystemExit(f"gpu-traffic: ptxas failed for sm_{cc}:\n{text}")
        widths = ptx_widths(ptx)
        cur = None
        for line in text.splitlines():
            m = re.search(r"Compiling entry function '(\w+)'", line)
            if m:
                cur = usage.setdefault(m.group(1), {})[f"sm_{cc}"] = {
                    "ptx_widths": widths.get(m.group(1), {})}
                continue
            if cur is None:
                continue
            if m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
                cur["spill_stores"], cur["spill_loads"] = int(m.group(1)), int(m.group(2))
            if m := re.search(r"Used (\d+) registers", line):
                cur["registers"] = int(m.group(1))
                s = re.search(r"(\d+) bytes smem", line)
                cur["smem"] = int(s.group(1)) if s else 0
    return usage


# --- the model -------------------------------------------------------------------------------


def occupancy(regs: int, threads: int, smem: int) -> dict:
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(regs * 32 / 256) * 256
    by_regs = (REGS // regs_per_warp) // warps if regs_per_warp else MAX_BLOCKS
    by_threads = MAX_THREADS // threads
    by_smem = SMEM // (smem + SMEM_RESERVED)
    blocks = min(by_regs, by_threads, by_smem, MAX_BLOCKS)
    limit = min((by_regs, "registers"), (by_threads, "threads"), (by_smem, "shared memory"),
                (MAX_BLOCKS, "blocks"))[1]
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * warps, "limit": limit}


def minimum_bytes(kind: str, dtype: str, n: int, rows: int) -> int:
    """Bytes a call must move: its row arrays once, its weight (and LayerNorm's bias) and their
    gradients once, its per-row statistics (rstd, LayerNorm's mean too) once."""
    e, acc = SIZE_OF[dtype], 8 if dtype == "f64" else 4
    row = rows * n * e
    rows_moved = {"fwd": 2, "res": 4, "bwd": 3, "bwdh": 4, "lnf": 2, "lnres": 4, "lnb": 3}[kind]
    # RMS: w (and dw); LayerNorm: w and b (and dw, db).
    vectors = {"bwd": 2, "bwdh": 2, "lnf": 2, "lnres": 2, "lnb": 3}.get(kind, 1)
    statistics = 2 if kind in LAYER_KINDS else 1
    return rows_moved * row + vectors * n * e + statistics * rows * acc


def launch_model(launch: dict, usage: dict) -> dict:
    """One launch: DRAM (or L2) bytes, occupancy, bytes in flight, time."""
    u = usage[launch["kernel"]]["sm_90"]
    threads = launch["block"][0] * launch["block"][1]
    occ = occupancy(u["registers"], threads, u["smem"] + launch["shared"])
    bufs = {b["name"]: b for b in launch["buffers"]}
    dram_read = dram_write = l2_read = 0
    for name, b in bufs.items():
        if name in ("partial", "partial_b", "dots"):
            # The weight-gradient partials: written by this call's backward (each sector reaches
            # DRAM once, written back from L2), read back from L2 (the backward's own folds,
            # then the finalize right after it; the scratch is a few MB of a 50 MB L2).
            l2_read += b["read"]["unique"]
        else:
            dram_read += b["read"]["unique"]
        dram_write += b["write"]["unique"]
    grid = launch["grid"]
    per_block = (dram_read + dram_write + l2_read) / grid
    # Loads a block has in flight at once: the cached paths issue a row's loads before the
    # reduction (measured: load bytes between two syncs); the streaming paths the row loads of
    # one iteration of their loops (measured: rmsnorm.cu marks each iteration, EMU_STEP; in the
    # sm_90 SASS, read with nvdisasm, an iteration's loads are issued together and used before
    # the next iteration's); the finalize FINALIZE_LOADS partials at a time (its source's order).
    finalize = "finalize" in launch["kernel"]
    if launch["cached"]:
        inflight_block = launch["load_bytes_per_block_per_sync"]
    elif finalize:
        loads = min(FINALIZE_LOADS, math.ceil(launch["load_bytes_per_block_per_sync"] / threads / 8))
        inflight_block = threads * 8 * loads
    else:
        inflight_block = launch["row_load_bytes_per_block_per_step"]
    reads = dram_read + l2_read
    amplify = (dram_read + dram_write + l2_read) / reads if reads else 1.0
    latency = (L2_LATENCY if finalize else LATENCY) + (SYNC if launch["cached"] else 0.0)
    if launch.get("cluster", 1) > 1:
        latency += CLUSTER_SYNC
    per_wave = SMS * occ["blocks_per_sm"]
    time_s, left, waves = 0.0, grid, 0
    while left > 0:
        active = min(left, per_wave)
        rate = min(PEAK, active * inflight_block * amplify / latency)
        time_s += active * per_block / rate
        left -= active
        waves += 1
    resident = min(occ["blocks_per_sm"], math.ceil(grid / SMS))
    return {
        "kernel": launch["kernel"], "grid": grid, "cluster": launch.get("cluster", 1),
        "block": launch["block"],
        "team": launch["team"], "shared": launch["shared"], "chunk": launch["chunk"],
        "registers": u["registers"], "spills": u.get("spill_stores", 0) + u.get("spill_loads", 0),
        **occ, "waves": grid / per_wave,
        "inflight_per_sm": resident * inflight_block,
        "dram_bytes": dram_read + dram_write, "l2_bytes": l2_read, "time_s": time_s,
    }


def call_model(call: dict, usage: dict) -> dict:
    kind, dtype, n, rows = call["kind"], call["dtype"], call["n"], call["rows"]
    launches = [launch_model(lc, usage) for lc in call["launches"]]
    minimum = minimum_bytes(kind, dtype, n, rows)
    moved = sum(lm["dram_bytes"] for lm in launches)
    scratch = sum(b["write"]["unique"] for lc in call["launches"] for b in lc["buffers"]
                  if b["name"] in ("partial", "partial_b"))
    # The design's scratch: one partial row of n Wide values per backward block, or of n float32
    # (narrow partials: one team per block, chunks of at most FOLD_ROWS = 8 rows, float32 sums).
    first = call["launches"][0]
    narrow = dtype != "f64" and first["team"] == first["block"][0] and first["chunk"] <= 8
    wide = 16 if dtype == "f64" else 4 if narrow else 8
    units = first["grid"] // first.get("cluster", 1)  # a row per cluster, or block
    grad_rows = 2 if kind == "lnb" else 1  # LayerNorm's bias has partial rows too
    scratch_design = grad_rows * units * n * wide if kind in BACKWARD_KINDS else 0
    useful = sectors = s_useful = s_sectors = 0
    row_widths: set[int] = set()
    for lc in call["launches"]:
        for b in lc["buffers"]:
            for d in ("read", "write"):
                if b["name"] == "dots":  # a cluster's dot slots: a few KB, read as broadcasts
                    continue
                if b["name"] in ("partial", "partial_b"):
                    s_useful += b[d]["useful"]
                    s_sectors += 32 * b[d]["sectors"]
                    continue
                useful += b[d]["useful"]
                sectors += 32 * b[d]["sectors"]
                if b["name"] in ("x", "y", "dy", "dh", "dx", "residual", "h", "w", "b"):
                    row_widths |= {int(w) for w, c in b[d]["widths"].items() if c}
    passes = sum(b["read"]["requested"] for lc in call["launches"] for b in lc["buffers"]
                 if b["name"] == "x") / (rows * n * SIZE_OF[dtype])
    t = sum(lm["time_s"] for lm in launches)
    main = launches[0]
    return {
        "kind": kind, "dtype": dtype, "n": n, "rows": rows,
        "vectorizable": n * SIZE_OF[dtype] % 16 == 0,
        "minimum_bytes": minimum, "moved_bytes": moved, "traffic_ratio": moved / minimum,
        "rows_traffic_ratio": (moved - scratch) / minimum,
        "scratch_bytes": scratch, "scratch_design_bytes": scratch_design,
        "sector_efficiency": useful / sectors if sectors else 1.0,
        "scratch_sector_efficiency": s_useful / s_sectors if s_sectors else None,
        "row_widths": sorted(row_widths), "x_passes": passes,
        "launches": launches, "predicted_fraction": minimum / PEAK / t,
        "predicted_fraction_with_launches": minimum / PEAK / (t + LAUNCH * len(launches)),
        "predicted_gbs": minimum / PEAK / t * COPY / 1e9,
        "inflight_margin": main["inflight_per_sm"] / NEEDED,
    }


def check(models: list[dict], usage: dict) -> list[str]:
    misses = []
    for m in models:
        tag = f"{m['kind']} {m['dtype']} {m['rows']}x{m['n']}"
        if m["scratch_bytes"] != m["scratch_design_bytes"]:
            misses.append(f"{tag}: {m['scratch_bytes']} B of weight-gradient partials reach DRAM, "
                          f"the design writes {m['scratch_design_bytes']} (a row per block)")
        if m["vectorizable"]:
            if m["rows_traffic_ratio"] > TARGET_RATIO:
                misses.append(f"{tag}: traffic ratio {m['rows_traffic_ratio']:.3f} > "
                              f"{TARGET_RATIO} (without the weight-gradient partials)")
            if m["sector_efficiency"] < TARGET_SECTORS:
                misses.append(f"{tag}: sector efficiency {m['sector_efficiency']:.1%} < 95%")
            if m["row_widths"] != [16]:
                misses.append(f"{tag}: row arrays accessed {m['row_widths']} bytes wide, not 16")
        if m["dtype"] == "bf16" and m["n"] >= 1024:
            want = TARGET_BWD if m["kind"] in BACKWARD_KINDS else TARGET_FWD
            if m["predicted_fraction"] < want:
                misses.append(f"{tag}: predicted {m['predicted_fraction']:.1%} of peak < "
                              f"{want:.0%}")
    return misses


def spills(usage: dict) -> list[str]:
    """Kernels that spill (reported, not failed: tests/gpu_kernels.rs holds the budget)."""
    return [f"{name} {arch}: spills {u['spill_stores']} B stores, {u['spill_loads']} B loads"
            for name, archs in usage.items() for arch, u in archs.items()
            if u.get("spill_stores", 0) or u.get("spill_loads", 0)]


# --- output ----------------------------------------------------------------------------------


def table(models: list[dict]) -> str:
    head = ("| call | dtype | rows x n | launch (grid x block, team) | traffic | sectors | "
            "widths | regs | blocks/SM (warps) | KB in flight/SM | waves | predicted | "
            "with launches |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for m in models:
        lm = m["launches"][0]
        launch = f"{lm['grid']} x {lm['block'][0]}, {lm['team']}"
        if lm["cluster"] > 1:
            launch = f"{lm['grid']} x {lm['block'][0]} in clusters of {lm['cluster']}, {lm['team']}"
        if m["kind"] in BACKWARD_KINDS:
            launch += "".join(f" (+{f['grid']} x 256)" for f in m["launches"][1:])
        regs = "/".join(str(x["registers"]) for x in m["launches"])
        occ = "/".join(f"{x['blocks_per_sm']} ({x['warps_per_sm']})" for x in m["launches"])
        kb = f"{lm['inflight_per_sm'] / 1024:.0f}"
        widths = ",".join(str(w) for w in m["row_widths"])
        if m["x_passes"] > 1.01:
            widths += f"; x {m['x_passes']:.0f}x"
        traffic = f"{m['traffic_ratio']:.3f}"
        sectors = f"{m['sector_efficiency']:.1%}"
        if m["scratch_bytes"]:
            traffic += f" ({m['rows_traffic_ratio']:.3f})"
            sectors += f" ({m['scratch_sector_efficiency']:.0%})"
        lines.append(
            f"| {m['kind']} | {m['dtype']} | {m['rows']}x{m['n']} | {launch} | "
            f"{traffic} | {sectors} | {widths} | {regs} | "
            f"{occ} | {kb} | {lm['waves']:.2f} | {m['predicted_fraction']:.0%} | "
            f"{m['predicted_fraction_with_launches']:.0%} |")
    return head + "\n".join(lines) + "\n"


def ptxas_table(usage: dict) -> str:
    out = ["| kernel | sm_80 regs | sm_90 regs | spills (B) | smem (B) | PTX global ld/st bits |",
           "|---|---|---|---|---|---|"]
    for name, a in usage.items():
        if not (name.startswith(tuple(f"{norm}_{k}_{d}_w{d}" for norm in ("rmsnorm", "layernorm")
                                      for k in ("fwd", "bwd", "residual_fwd")
                                      for d in ("bf16", "f32")) + ("rmsnorm_bwd_finalize_f32",))):
            continue
        s8, s9 = a["sm_80"], a["sm_90"]
        spills = max(s8.get("spill_stores", 0) + s8.get("spill_loads", 0),
                     s9.get("spill_stores", 0) + s9.get("spill_loads", 0))
        w = s9["ptx_widths"]
        out.append(f"| {name} | {s8['registers']} | {s9['registers']} | {spills} | {s9['smem']} | "
                   f"{','.join(map(str, w.get('ld', [])))} / {','.join(map(str, w.get('st', [])))} |")
    return "\n".join(out) + "\n"


def plans(calls: list[dict]) -> str:
    """The launch plans run (bwdh's are the backward's: not listed again)."""
    return "".join(c["plan"] + "\n" for c in calls if c["kind"] != "bwdh")


def run_all(source: Path, out: Path, name: str, max_blocks: int, usage: dict,
            forward_min_team: int = 1, kinds: list[str] | None = None):
    exe = build(source, out, name)
    calls = emulate(exe, max_blocks, forward_min_team, kinds)
    models = [call_model(c, usage) for c in calls]
    return calls, models


def planted(out: Path, max_blocks: int, usage: dict) -> list[str]:
    """Each planted regression must fail the traffic checks (ptxas figures: the real kernels'),
    in every norm whose kernels it changes."""
    text = SOURCE.read_text()
    bugs = {
        # Each thread takes VPT consecutive vectors instead of every team-th: a warp's 16-byte
        # accesses land 64 bytes apart. The forward code both norms share.
        "uncoalesced": ("        const int v = lane + k * team;\n"
                        "        if (valid && v < nv) {\n"
                        "          cache[k] = load_input",
                        "        const int v = lane * VPT + k;\n"
                        "        if (valid && v < nv) {\n"
                        "          cache[k] = load_input",
                        ["fwd", "lnf"]),
        # The RMS norm's vector kernels stamped with scalar accesses.
        "scalar": ("  FWD_ENTRY(rmsnorm_fwd_##XN##_w##WN##_v, T, W, (16 / sizeof(T)), FWD_VPT)",
                   "  FWD_ENTRY(rmsnorm_fwd_##XN##_w##WN##_v, T, W, 1, FWD_VPT)",
                   ["fwd"]),
        # LayerNorm's vector forward stamped with scalar accesses.
        "layer-scalar": ("  LN_FWD_ENTRY(layernorm_fwd_##XN##_w##WN##_v, T, W, (16 / sizeof(T)), FWD_VPT)",
                         "  LN_FWD_ENTRY(layernorm_fwd_##XN##_w##WN##_v, T, W, 1, FWD_VPT)",
                         ["lnf"]),
    }
    results = []
    for bug, (find, replace, kinds) in bugs.items():
        assert text.count(find) == 1, f"planted bug {bug}: its pattern no longer matches rmsnorm.cu"
        path = out / f"planted-{bug}.cu"
        path.write_text(text.replace(find, replace))
        _, models = run_all(path, out, f"traffic-{bug}", 2, usage, kinds=kinds)
        for kind in kinds:
            misses = [m for m in check([m for m in models if m["kind"] == kind], usage)
                      if "traffic" in m or "sector" in m or "wide" in m]
            if not misses:
                raise SystemExit(f"gpu-traffic self-check: the planted regression '{bug}' passed "
                                 f"the checks of {kind}: they cannot fail")
            results.append(f"planted '{bug}': fails {kind} as it must ({len(misses)} misses, "
                           f"e.g. {misses[0]})")
    return results


def update_doc(tab: str, ptab: str) -> None:
    doc = DOC.read_text()
    for marker, body in (("table", tab), ("ptxas", ptab)):
        start, end = f"<!-- {marker}:begin -->\n", f"<!-- {marker}:end -->"
        i, j = doc.index(start) + len(start), doc.index(end)
        doc = doc[:i] + body + doc[j:]
    DOC.write_text(doc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "target/gpu-traffic"))
    ap.add_argument("--max-blocks", type=int, default=16,
                    help="blocks emulated per launch besides the last (scaled to the grid)")
    ap.add_argument("--update-docs", action="store_true")
    ap.add_argument("--no-self-check", action="store_true")
    opts = ap.parse_args()
    out = Path(opts.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    usage = ptxas_usage(out)
    calls, models = run_all(SOURCE, out, "traffic", opts.max_blocks, usage)
    tab, ptab = table(models), ptxas_table(usage)
    print(tab)
    print(ptab)
    (out / "table.md").write_text(tab + "\n" + ptab)
    summary = {"model": {"sms": SMS, "peak": PEAK, "copy": COPY, "latency": LATENCY,
                         "l2_latency": L2_LATENCY, "launch": LAUNCH, "cluster_sync": CLUSTER_SYNC,
                         "needed_inflight_per_sm": NEEDED},
               "calls": models, "ptxas": usage}
    (out / "traffic.json").write_text(json.dumps(summary, indent=1))
    fresh = plans(calls)
    if opts.update_docs:
        DOC_PLANS.write_text(fresh)
        update_doc(tab, ptab)
        DOC_JSON.write_text(json.dumps(
            {"model": summary["model"],
             "calls": [{k: m[k] for k in ("kind", "dtype", "n", "rows", "traffic_ratio",
                                          "sector_efficiency", "predicted_fraction",
                                          "predicted_gbs", "minimum_bytes")}
                       for m in models]}, indent=1) + "\n")
    status = 0
    if DOC_PLANS.read_text() != fresh:
        print("gpu-traffic: the plans run differ from docs/gpu-traffic-plans.txt (which plan.rs's "
              "test checks): run `make gpu-traffic-docs` and commit", file=sys.stderr)
        status = 1
    for line in spills(usage):
        print("SPILL (target: none; not failed)", line)
    misses = check(models, usage)
    known = [m for m in misses if any(m.startswith(k) for k in KNOWN_MISSES)]
    misses = [m for m in misses if m not in known]
    for m in known:
        print("KNOWN MISS (not failed)", m)
    for k in sorted(KNOWN_MISSES):
        if not any(m.startswith(k) for m in known):
            print(f"no longer missed: {k} (drop it from KNOWN_MISSES)")
    for m in misses:
        print("MISS", m)
    if misses:
        status = 1
    if not opts.no_self_check:
        for line in planted(out, opts.max_blocks, usage):
            print(line)
    print(f"gpu-traffic: {len(models)} calls, {len(misses)} misses ({time.time() - t0:.0f} s)")
    return status


if __name__ == "__main__":
    sys.exit(main())

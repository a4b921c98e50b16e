"""Instructions per pack in the CUDA kernels' machine code (SASS), read without a GPU.

The H200 run said the bfloat16 kernels issued too many instructions per byte to keep up with
memory (docs/gpu-traffic.md, "instruction issue"). This counts them where the device runs them:
rmsnorm.cu compiled and assembled for sm_90 as `make gpu-traffic` does (NVRTC and ptxas from
pip), disassembled with nvdisasm (PyPI's `nvidia-cuda-nvdisasm`, not a test dependency:
`pip install nvidia-cuda-nvdisasm==13.5.37`; it reads the cubins of pip's ptxas 12.9).

Per vector kernel, the instructions along the path a pack of finite values takes through the
cached vector path, from one 16-byte store of a row array (STG.E.128) to the next:
conditional branches not taken (in these kernels: the element in range, the weight present, no
NaN in the pack), unconditional ones followed. The repeated lengths are the per-pack costs: the
forward's store section (load w, scale, round, store y), the fused residual's h section (load x
and the residual, round, store h, squares) and its y section, the backward's dx section (load w,
form dx and the weight-gradient terms, round, store). A walk that reaches EXIT or a return is
not a pack's and is left out. This is a
reading of static code along one path, not a dynamic count: the per-row work (reduction, rstd)
comes on top, and only a device (Nsight Compute) measures issue.

    python tests/cuda_emulator/sass.py [--rev GIT_REV]   # --rev: the same for rmsnorm.cu at REV
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import traffic  # noqa: E402  (the NVRTC + ptxas build of `make gpu-traffic`)

KERNELS = [f"rmsnorm_{k}_{d}_w{d}_v" for d in ("bf16", "f32") for k in ("fwd", "residual_fwd", "bwd")]


def nvdisasm() -> Path:
    for p in traffic.site_packages():
        for cand in sorted(p.glob("nvidia/cu*/bin/nvdisasm")):
            return cand
    raise SystemExit("sass.py: no nvdisasm under site-packages: "
                     "pip install nvidia-cuda-nvdisasm==13.5.37")


def kernels_sass(cubin: Path) -> dict[str, list[str]]:
    text = subprocess.run([str(nvdisasm()), "-c", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    out: dict[str, list[str]] = {}
    cur = None
    for line in text.splitlines():
        if m := re.match(r"^\.text\.(\w+):", line):
            cur = out.setdefault(m.group(1), [])
        elif cur is not None:
            cur.append(re.sub(r"^\s*/\*[0-9a-f]+\*/\s*", "", line).strip())
    return out


def is_label(line: str) -> bool:
    return bool(re.match(r"^[.$][\w$.]*:$", line))


def walk(lines: list[str], start: int, stop: str, labels: dict[str, int]) -> int | None:
    """Instructions from lines[start] to the first one matching `stop` (counted), taking no
    conditional branch and following unconditional ones; None past EXIT/RET or 600 steps."""
    i, n = start, 0
    for _ in range(600):
        if i >= len(lines):
            return None
        line = lines[i]
        if not line or is_label(line) or line.startswith(("//", ".")):
            i += 1
            continue
        n += 1
        op = re.sub(r"^@!?U?P\w+\s+", "", line).split()[0]
        if re.search(stop, line):
            return n
        if op.startswith(("EXIT", "RET")) and not line.startswith("@"):
            return None
        if op == "BRA" and not line.startswith("@"):
            i = labels[re.search(r"`\((\S+?)\)", line).group(1)]
            continue
        i += 1
    return None


def sections(lines: list[str], marker: str) -> list[int]:
    labels = {ln[:-1]: i for i, ln in enumerate(lines) if is_label(ln)}
    starts = [i + 1 for i, ln in enumerate(lines) if marker in ln]
    return [n for s in starts if (n := walk(lines, s, re.escape(marker), labels)) is not None]


def measure(source: Path, out: Path) -> dict[str, dict]:
    out.mkdir(parents=True, exist_ok=True)
    traffic.ptxas_usage(out, source)
    sass = kernels_sass(out / "rmsnorm_90.cubin")
    return {k: {"sections": collections.Counter(sections(sass[k], "STG.E.128")).most_common(3),
                "total": sum(1 for ln in sass[k]
                             if ln and not is_label(ln) and not ln.startswith(("//", ".")))}
            for k in KERNELS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rev", help="also measure src/handlers/gpu/rmsnorm.cu at this git revision")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"now": measure(traffic.SOURCE, Path(tmp) / "now")}
        if args.rev:
            src = Path(tmp) / "rev.cu"
            src.write_text(subprocess.run(["git", "show", f"{args.rev}:src/handlers/gpu/rmsnorm.cu"],
                                          cwd=traffic.ROOT, capture_output=True, text=True,
                                          check=True).stdout)
            runs = {args.rev: measure(src, Path(tmp) / "rev"), **runs}
    print("sm_90 SASS: instructions from one 16-byte store of a row array to the next along the\n"
          "finite path, as length x how many such walks (the three most common), and the\n"
          "kernel's whole length")
    for name, r in runs.items():
        print(f"-- rmsnorm.cu {name}")
        for k in KERNELS:
            secs = "  ".join(f"{n} x{c}" for n, c in r[k]["sections"])
            print(f"{k:34s} {secs:28s} total {r[k]['total']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Instructions a weight byte in the CUDA W4A16 decode kernel's K loop, read from its SASS: no
GPU needed, only nvcc and cuobjdump (``--cuobjdump``; Triton ships one, and pip's
``nvidia-cuda-cuobjdump``).

The count of one pass of the K loop (one chunk of 128 K values per warp) over the warp's weight
bytes (``ROWS`` x 64) says what a change does to the loop, not to the time: the kernel's time
also follows how its copies touch the caches, so a change is judged by a same-run A/B
(``w4a16_decode_grid.py --baseline``; ``bench/INT4_DECODE_LEVERS.md`` lists those made). For
each library (``--config SPLIT,SLICES,STAGES``, the launch's warps and cluster do not change the
code) and each n8 tile count (M <= 8: 1, M = 9-16: 2), the K loop is the smallest loop that
multiplies (``HMMA``) and either copies (``LDGSTS``) or waits on a stage's barrier (``SYNCS``,
where another warp fills the stages); its opcodes are counted as the SASS lists them. The
kernel counted is the build for whole 64-row blocks (``FULL``: N a multiple of 64, the scales
16-byte aligned, a group of at most 128), which every projection of the suites takes (group
128).

    python bench/w4a16_sass.py --config k,2,4 --config k,4,2 --flags='-DGEMV_MIN_CTAS=3 -DGEMV_MAX_WARPS=8'
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from tuner.candidates import cuda_library, cuda_w4a16

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BACK_BRANCH = re.compile(r"BRA (0x[0-9a-f]+)")
REGISTERS = re.compile(r"REG:(\d+)")


def default_cuobjdump() -> str:
    """cuobjdump on PATH, else the one Triton ships for its own listings, else the bare name."""
    if found := shutil.which("cuobjdump"):
        return found
    try:
        import triton.backends.nvidia
    except ImportError:
        return "cuobjdump"
    bundled = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
    return str(bundled) if bundled.is_file() else "cuobjdump"


def kernel_name(f16: bool, groups: int, tiles: int) -> str:
    """The mangled name of ``w4a16_gemv_kernel<F16, NG, NT, true, false>``: the FULL build of one
    row block a CTA."""
    return f"_Z17w4a16_gemv_kernelILb{int(f16)}ELi{groups}ELi{tiles}ELb1ELb0EEv6Params"


def opcode(text: str) -> str:
    """``@!P0 LDGSTS.E.BYPASS.128 [...]`` -> ``LDGSTS``."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def k_loop(sass: str) -> list[str]:
    """The instructions of the smallest loop (a backward branch's span) that multiplies and
    copies or waits for a stage: the loops around it hold it whole."""
    code = [(int(a, 16), t) for a, t in LINE.findall(sass)]
    loops = []
    for at, text in code:
        if (found := BACK_BRANCH.search(text)) and int(found.group(1), 16) < at:
            body = [t for a, t in code if int(found.group(1), 16) <= a <= at]
            ops = {opcode(t) for t in body}
            if "HMMA" in ops and ops & {"LDGSTS", "SYNCS"}:
                loops.append(body)
    if not loops:
        raise ValueError("no loop with HMMA and LDGSTS or SYNCS in the SASS")
    return min(loops, key=len)


def count(
    config: tuple[str, int, int] | tuple[str, int, int, bool], flags: list[str], cuobjdump: str,
    groups: int,
) -> list[dict]:  # fmt: skip
    """One row per n8 tile count: the K loop's instructions, a weight KB's share, the opcodes,
    and the kernel's registers a thread (which bound the warps an SM holds)."""
    split, slices, stages, *stagger = config
    lib = cuda_w4a16.Library(split, slices, stages, *stagger)
    nvcc_flags = [f for f in lib.flags() if f not in ("-shared", "-Xcompiler", "-fPIC")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        subprocess.run(["nvcc", *nvcc_flags, *flags, "-cubin", "-o", str(cubin),
                        str(cuda_w4a16.SOURCE)], check=True, capture_output=True, text=True)  # fmt: skip
        for tiles in (1, 2):
            name = kernel_name(False, groups, tiles)

            def dump(what: str, name: str = name) -> str:
                return subprocess.run([cuobjdump, what, "-fun", name, str(cubin)], check=True,
                                      capture_output=True, text=True).stdout  # fmt: skip

            body = k_loop(dump("-sass"))
            registers = int(REGISTERS.search(dump("-res-usage")).group(1))
            ops = collections.Counter(opcode(t) for t in body)
            weight_kb = 16 * slices * 64 / 1024
            label = ",".join(map(str, (split, slices, stages, *map(int, stagger))))
            rows.append({"config": label, "tiles": tiles,
                         "instructions": len(body), "per_weight_kb": round(len(body) / weight_kb, 1),
                         "registers": registers, "opcodes": dict(ops.most_common())})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", default=[], metavar="SPLIT,SLICES,STAGES[,STAGGER]",
                    help="a library to count, STAGGER 0 or 1 (default: those of the decode "
                         "shortlist)")  # fmt: skip
    ap.add_argument(
        "--flags", default="", help="extra nvcc flags, one string: --flags='-DA=1 -DB=2'"
    )
    ap.add_argument("--group", type=int, default=128, choices=cuda_w4a16.GROUP_SIZES)
    ap.add_argument("--cuobjdump", default=default_cuobjdump(),
                    help="default: on PATH, else the one Triton ships")  # fmt: skip
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    configs = []
    shortlists = cuda_w4a16.SHORTLIST + cuda_w4a16.WIDE_SHORTLIST
    libraries = {",".join(map(str, (*c[:3], int(c[5])))) for c in shortlists}
    for text in args.config or sorted(libraries):
        split, *numbers = text.split(",")
        if (
            split not in cuda_w4a16.SPLITS
            or len(numbers) not in (2, 3)
            or not all(map(str.isdigit, numbers))
            or numbers[2:] not in ([], ["0"], ["1"])
        ):
            ap.error(f"--config {text!r}: expected SPLIT,SLICES,STAGES[,STAGGER] with STAGGER 0 "
                     "or 1, e.g. k,2,4 or k,4,2,1")  # fmt: skip
        slices, stages = map(int, numbers[:2])
        if slices not in cuda_w4a16.SLICES or stages not in cuda_w4a16.STAGES:
            ap.error(f"--config {text!r}: slices in {cuda_w4a16.SLICES}, stages 2 to 8")
        configs.append((split, slices, stages, *(n == "1" for n in numbers[2:])))
    if shutil.which("nvcc") is None:
        ap.error("nvcc: not found on PATH (the CUDA toolkit builds the libraries counted)")
    if shutil.which(args.cuobjdump) is None:
        ap.error(f"--cuobjdump {args.cuobjdump!r}: not found (pip install nvidia-cuda-cuobjdump)")
    groups = max(1, cuda_w4a16.CHUNK // args.group)
    flags = shlex.split(args.flags)
    try:
        rows = [row for config in configs for row in count(config, flags, args.cuobjdump, groups)]
    except subprocess.CalledProcessError as e:
        ap.error(
            f"{' '.join(map(str, e.cmd[:1]))} failed (flags {flags}): {e.stderr or ''}"[-2000:]
        )
    except ValueError as e:
        ap.error(str(e))
    for r in rows:
        top = ", ".join(f"{op} {n}" for op, n in list(r["opcodes"].items())[:8])
        print(f"{r['config']:8s} n8 tiles {r['tiles']}: {r['instructions']:4d} instructions a "
              f"chunk, {r['per_weight_kb']:6.1f} a weight KB, {r['registers']} registers ({top})")  # fmt: skip
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "nvcc": cuda_library.toolkit(),
                    "arch": cuda_library.ARCH,
                    "flags": flags,
                    "rows": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()

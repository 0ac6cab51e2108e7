"""Bench-only twins of the product's CUDA libraries: a library's own nvcc command with extra
flags (a trace, a launch variant), or built from another version of its source, written outside
the product's cache, so an A/B never serves or overwrites what users run.

    commands = {path: twin_command(lib, path, ["-DGEMV_TRACE=1"])}
    build(commands)
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
from pathlib import Path

from tuner.candidates import cuda_library, nvcc_build


def parse_variant(spec: str, taken: set[str]) -> tuple[str, list[str]]:
    """``"name=-DFLAG=0 -DOTHER=1"`` as (name, flags); ValueError naming the spec unless the
    name is a new identifier and there is a flag."""
    name, sep, flags = spec.partition("=")
    if not (sep and name.isidentifier() and flags.split()) or name in taken:
        raise ValueError(f"--variant {spec!r}: expected NAME=FLAGS with a new NAME (not one of "
                         f"{sorted(taken)}), e.g. plain=-DGEMV_EMPTY=1")  # fmt: skip
    return name, flags.split()


def take_variants(
    ap: argparse.ArgumentParser, specs: list[str], variants: dict[str, list[str]]
) -> tuple[str, ...]:
    """The names of ``--variant`` ``specs``, each added to ``variants`` (name -> flags); a
    malformed or taken one ends the command with ``ap.error`` naming it."""
    names = []
    for spec in specs:
        try:
            name, flags = parse_variant(spec, set(variants))
        except ValueError as e:
            ap.error(str(e))
        variants[name] = flags
        names.append(name)
    return tuple(names)


def tag(name: str, flags: list[str]) -> str:
    """A twin's name in file names: the variant's name and its flags' digest, so a name given
    other flags in a later run builds anew instead of timing the old library."""
    return f"{name}-{hashlib.sha256(' '.join(flags).encode()).hexdigest()[:8]}"


def twin_command(
    lib: cuda_library.CudaLibrary, out: Path, flags: list[str], source: Path | None = None
) -> list[str]:
    """``lib``'s nvcc command writing ``out``, with ``flags`` before the source; ``source``:
    another version of the kernel, which takes the headers next to it first, else the kernel
    folder's."""
    nvcc = nvcc_build.nvcc_path()
    if nvcc is None:
        raise RuntimeError(cuda_library.cannot_compile())
    cmd = lib.nvcc_command(nvcc, out)
    if source is None:
        return [*cmd[:-1], *flags, cmd[-1]]
    return [*cmd[:-1], *flags, f"-I{cuda_library.KERNELS}", str(source)]


def build(commands: dict[Path, list[str]]) -> None:
    """Runs the commands whose output does not exist yet, in parallel; RuntimeError with nvcc's
    message for the first that fails."""
    procs = {}
    for path, cmd in commands.items():
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            procs[path] = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for path, proc in procs.items():
        _, err = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"nvcc {path.name}: {err[-2000:]}")

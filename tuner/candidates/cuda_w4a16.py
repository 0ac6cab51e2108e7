"""A hand-written CUDA W4A16 decode kernel (``cuda_kernels/w4a16_gemv.cu``) for INT4 keys, M <= 16.

GEMV-style: a warp owns 16, 32 or 64 weight rows, a CTA a run of K, and a cluster of CTAs that
split K sums through distributed shared memory (each rank pushes the others' shares of its sums
into their inboxes). The CTA's warps split either K (``split`` "k": a row block is one warp's
rows, each of its warps takes every ``warps / teams``-th 128-value chunk of the run from its own
copy ring, and they sum in shared memory) or rows (``split`` "rows": the CTA owns ``warps`` x its
warp's rows, every warp takes every chunk from one ring the CTA shares, so each chunk of x is
copied once per CTA, not once per warp). x's slabs come through the L1, where the other CTAs
on an SM find them, while the weight streams past it. No partial ever goes through global
memory, so there is no workspace and no second pass, and the sum order is fixed
(deterministic). x's rows are one n8 tile of the tensor cores' mma (M <= 8) or two (M = 9-16,
each dequantized weight fragment feeding both). Launched as a plain grid: behind a kernel that
does not let its dependents start early (a model's norms and activations), a programmatic
dependent launch's CTAs waiting on the SMs cost more than they save. It reads our packed layout
(``tuner.quant.int4``) as the Triton kernel does.

A config is the library's compile-time part (``split``, ``slices`` of 16 rows per warp,
``stages`` of each copy ring, ``stagger``: whether CTAs start their K chunks at staggered
rounds, so that they do not all read the same x lines at once: a ``Library``) and its launch
part (``warps`` per CTA, ``cluster`` CTAs splitting K, ``teams``: row blocks a CTA when warps
split K without a cluster, each taken by ``warps / teams`` of its warps as a CTA of its own would
be, so that a wide projection's grid is handed out a CTA an SM and its warps start together,
``carveout``: the percent of the SM's most shared memory its unified L1 / shared memory gives
shared memory, or None for the driver's choice, which makes room for the most CTAs an SM and can
leave x's lines too little L1 to be shared in).
Each library (the CUDA runtime linked in statically) serves every shape and is built, stored and
loaded as ``cuda_library`` says.

As a candidate source (``CudaW4A16``) its runners take torch's packed weight, as the baseline
does, and read our layout of it (``int4_torch.ours``: made once per weight, memoised).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from tuner.candidates import cuda_library, int4_operands, operand_guard
from tuner.candidates import gemm_operands as ops
from tuner.candidates.base import Params, Runner
from tuner.candidates.cuda_library import Launcher, LibrarySource, choice
from tuner.candidates.triton_kernels.w4a16 import check_inputs
from tuner.core.keys import GemmKey
from tuner.quant import int4_torch
from tuner.quant.int4 import CHUNK, GROUP_SIZES

SOURCE = cuda_library.KERNELS / "w4a16_gemv.cu"
SPLITS, SLICES, STAGES = ("k", "rows"), (1, 2, 4), range(2, 9)
MAX_M = 16  # two n8 tiles of activations
NARROW_M = 8  # one n8 tile
WIDE_MAX_WARPS = 8  # 64-row warps over two n8 tiles: their registers
MAX_WARPS = 16
CLUSTERS = (1, 2, 4, 8)  # CTAs splitting K: a power of two, which the kernel divides by as shifts
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one CTA may take on sm_90
ACT_DTYPES = ("bf16", "f16")
ALIGN = 16  # bytes: x's rows and the weight are copied in 16-byte pieces
# bytes: a (scale, zero) pair is one word (copied so; 16 bytes at a time where they are 16-byte
# aligned, N a multiple of 64 and a group at most 128)
SZ_ALIGN = 4
MAX_X_STRIDE = 2**31 // (2 * MAX_WARPS)  # x's row stride, elements: copy rounds use 32-bit steps
BUILDER = "tuner.candidates.cuda_w4a16"  # this module, also when it runs as __main__

Config = dict[str, Any]
CONFIG_KEYS = ("split", "slices", "stages", "warps", "cluster", "stagger", "teams", "carveout")
# configs stored before ``stagger``, ``teams`` or ``carveout`` existed lack them: they ran
# unstaggered, a row block a CTA, with the driver's carveout
DEFAULTS = {"stagger": False, "teams": 1, "carveout": None}
# percent of sm_90's most shared memory (228 KB): 164 KB an SM, leaving the L1 92 KB
ROOMY_L1 = 72
# teams are timed only where a grid of a row block a CTA would hold this many CTAs a team or
# more (a wide projection: several CTAs an SM to hand out); on a narrow one, a grid of a few
# row blocks a CTA would leave most SMs empty
MIN_BLOCKS_A_TEAM = 64


def check_config(config: Config, m: int, n: int, k: int, group: int) -> None:
    """ValueError naming the field unless ``config`` can run the (M, N, K, group) problem."""
    cuda_library.check_keys(config, CONFIG_KEYS)
    choice(config, "split", SPLITS)
    choice(config, "slices", SLICES)
    choice(config, "stages", STAGES)
    choice(config, "warps", range(1, MAX_WARPS + 1))
    cluster = choice(config, "cluster", CLUSTERS)
    full = {**DEFAULTS, **config}
    choice(full, "stagger", (False, True))
    if not 1 <= m <= MAX_M:
        raise ValueError(f"M={m}: allowed 1 to {MAX_M} (two n8 tiles of activations)")
    teams = choice(full, "teams", range(1, MAX_WARPS + 1))
    carveout = full["carveout"]
    if carveout is not None and (type(carveout) is not int or not 0 <= carveout <= 100):
        raise ValueError(f"config['carveout']={carveout!r}: allowed None (the driver's choice) or "
                         "a whole percent 0 to 100 of the SM's most shared memory")  # fmt: skip
    if config["warps"] % teams:
        raise ValueError(f"config['teams']={teams}: must divide config['warps']={config['warps']}")
    if teams > 1 and (config["split"] != "k" or cluster > 1):
        raise ValueError(f"config['teams']={teams}: more than one team needs config['split']='k' "
                         f"and config['cluster']=1, not {config['split']!r} and {cluster}")  # fmt: skip
    if teams > 1 and m > NARROW_M:
        raise ValueError(f"config['teams']={teams}: more than one team at M <= {NARROW_M} only "
                         f"(one n8 tile of activations), not M={m}")  # fmt: skip
    if config["slices"] == 4 and m > NARROW_M and config["warps"] > WIDE_MAX_WARPS:
        raise ValueError(f"config['warps']={config['warps']}: allowed 1 to {WIDE_MAX_WARPS} for "
                         f"64-row warps (config['slices']=4) at M={m} > {NARROW_M}")  # fmt: skip
    if k % CHUNK or k < CHUNK * cluster:
        raise ValueError(f"K={k}: must be whole chunks of {CHUNK}, at least one per CTA of "
                         f"config['cluster']={cluster}")  # fmt: skip
    if group not in GROUP_SIZES or k % group:
        raise ValueError(f"group_size={group}: allowed {GROUP_SIZES}, dividing K={k}")
    if n < 1:
        raise ValueError(f"N={n}: must be at least 1")
    if smem_bytes(config, m, group) > SMEM_LIMIT:
        raise ValueError(f"config {config}: {smem_bytes(config, m, group)} bytes of shared memory "
                         f"at M={m}, more than a CTA's {SMEM_LIMIT}")  # fmt: skip


def smem_bytes(config: Config, m: int, group: int) -> int:
    """Shared memory of one CTA (as the launcher computes it): the copy rings (one per warp,
    where warps splitting K leave their partials and their sum, or the CTA's one when warps
    split rows), or the CTA's sums [rows, M] after them if larger; then, in a cluster, the
    inbox: an 8-byte mbarrier and, from each rank, its sums of this rank's share of the
    outputs."""
    rows, warps, by_rows = 16 * config["slices"], config["warps"], config["split"] == "rows"
    groups = CHUNK // group if group < CHUNK else 1
    parts = (warps if by_rows else 1) * (rows * 64 + rows * 4 * groups)
    stage = -(-(parts + m * (2 * CHUNK + 16)) // 128) * 128
    rings, sums = (1, warps * rows * m * 4) if by_rows else (warps, 0)
    outputs, cluster = rows * (warps if by_rows else 1) * m, config["cluster"]
    inbox = 8 + cluster * -(-outputs // cluster) * 4 if cluster > 1 else 0
    return max(rings * config["stages"] * stage, sums) + inbox


@dataclass(frozen=True)
class Library(cuda_library.CudaLibrary):
    """A config's compile-time part: one shared library."""

    kind: ClassVar[str] = "cuda_w4a16"
    source: ClassVar[Path] = SOURCE
    builder: ClassVar[str] = BUILDER

    split: str
    slices: int
    stages: int
    stagger: bool = False

    def defines(self) -> list[str]:
        return [f"-DGEMV_SPLIT_ROWS={int(self.split == 'rows')}", f"-DGEMV_SLICES={self.slices}",
                f"-DGEMV_STAGES={self.stages}", f"-DGEMV_STAGGER={int(self.stagger)}"]  # fmt: skip


def library(config: Config) -> Library:
    return Library(config["split"], config["slices"], config["stages"],
                   config.get("stagger", DEFAULTS["stagger"]))  # fmt: skip


def compile_all(configs: Iterable[Config]) -> dict[Library, str | None]:
    """The libraries of ``configs`` installed from the artifact store, or compiled in parallel
    child processes (then published): library -> None or why it is missing."""
    return cuda_library.compile_all(map(library, configs))


ENTRY = "w4a16_gemv"
ARGTYPES = (*[ctypes.c_void_p] * 4, *[ctypes.c_int] * 4, *[ctypes.c_longlong] * 2,
            *[ctypes.c_int] * 5, ctypes.c_void_p)  # fmt: skip
DRIVER_CARVEOUT = -1  # the entry point's carveout for the driver's choice


def load(path: Path) -> Launcher:
    """The `w4a16_gemv` entry point of the library at ``path`` (loaded once)."""
    return cuda_library.load(path, ENTRY, ARGTYPES)


def launcher(config: Config) -> Launcher:
    """The ``w4a16_gemv`` entry point of ``config``'s library: installed from the artifact store,
    else compiled here, unless it failed before (RuntimeError with the error)."""
    return cuda_library.built(library(config), ENTRY, ARGTYPES)


def check_operands(
    x: torch.Tensor, weight: torch.Tensor, scales_and_zeros: torch.Tensor, group: int,
    out: torch.Tensor | None,
) -> tuple[int, int, int]:  # fmt: skip
    """(M, N, K), or a ValueError naming the operand that the kernel's entry point would refuse
    (or read or write out of bounds); ``out`` None: one is made after."""
    m, n, k = check_inputs(x, weight, scales_and_zeros, group)
    if not 1 <= m <= MAX_M:
        raise ValueError(f"x.shape={tuple(x.shape)}: M={m}, allowed 1 to {MAX_M}")
    if x.data_ptr() % ALIGN or x.stride(0) * x.element_size() % ALIGN:
        raise ValueError(f"x: rows must start on {ALIGN}-byte boundaries (data_ptr "
                         f"{x.data_ptr():#x}, strides {x.stride()})")  # fmt: skip
    if x.stride(0) >= MAX_X_STRIDE:
        raise ValueError(f"x.stride()={x.stride()}: rows at most {MAX_X_STRIDE - 1} elements apart")
    if weight.data_ptr() % ALIGN:
        raise ValueError(f"weight: must be {ALIGN}-byte aligned, data_ptr {weight.data_ptr():#x}")
    if scales_and_zeros.data_ptr() % SZ_ALIGN:
        raise ValueError(f"scales_and_zeros: must be {SZ_ALIGN}-byte aligned (a (scale, zero) "
                         f"pair is one word), data_ptr {scales_and_zeros.data_ptr():#x}")  # fmt: skip
    if out is not None:
        int4_operands.check_out(out, m, n, x)
    if not x.is_cuda:
        raise ValueError(f"x.device={x.device}: must be a CUDA device")
    return m, n, k


def run(fn: Launcher, config: Config, x: torch.Tensor, weight: torch.Tensor,
        scales_and_zeros: torch.Tensor, group: int, out: torch.Tensor, stream: int) -> None:  # fmt: skip
    """``out = x @ dequant(weight).T`` through ``fn`` (``launcher(config)``) on ``stream``; the
    operands already checked (``check_operands``)."""
    m, k = x.shape
    carveout = config.get("carveout", DEFAULTS["carveout"])
    err = fn(x.data_ptr(), weight.data_ptr(), scales_and_zeros.data_ptr(), out.data_ptr(), m,
             weight.shape[0], k, group, x.stride(0), out.stride(0),
             int(x.dtype == torch.float16), config["warps"], config["cluster"],
             config.get("teams", DEFAULTS["teams"]),
             DRIVER_CARVEOUT if carveout is None else carveout, stream)  # fmt: skip
    if err:
        raise RuntimeError(f"w4a16_gemv launch failed: CUDA error {err}")


# Decode shortlists (split, slices, stages, warps, cluster, stagger, teams, carveout), the
# likeliest first. Warps splitting K: 32-row CTAs over all of K, one per SM. Streaming, a warp is
# busy issuing instructions, not waiting on its copies, so 16 warps a CTA with a 2-stage ring lead
# on the narrow projections; 8 warps of 4 stages win the wide ones, or there 64-row warps over
# all of K, whose x fragments serve four slices (where the kernel's instructions, not the weight
# stream, set the pace). Where x's [M, 128] slab weighs most (M near 8, copied per CTA and chunk
# beside the CTA's weight), 64-row warps over half of K (a cluster of 2: x copied once per 64
# rows), or 8 warps of 32 rows sharing each chunk's slab with K over a cluster of 8. Three 64-row
# warps a CTA fit five CTAs an SM: a wide projection's row blocks then run in one round (not a
# second one on part of the SMs), each warp streaming more chunks for its one ramp. Where a
# one-round grid of 64-row CTAs leaves some SMs a CTA more than the others, four-warp CTAs of 32
# rows share the rows out more evenly, at more instructions a weight byte. Such a grid is handed
# out a CTA an SM at a time, and the CTAs handed out last end last: four row blocks a CTA (teams
# of three warps) start them together. No staggered config: with x's lines through the L1, an
# SM's CTAs at one chunk likely share its lines there, and staggered ones sit at different chunks.
SHORTLIST = (("k", 2, 2, 16, 1, False, 1, None), ("k", 2, 4, 8, 1, False, 1, None),
             ("k", 4, 2, 8, 1, False, 1, None), ("k", 4, 2, 3, 1, False, 1, None),
             ("k", 2, 2, 4, 1, False, 1, None), ("k", 2, 3, 16, 1, False, 1, None),
             ("k", 2, 3, 12, 1, False, 1, None), ("rows", 2, 4, 8, 8, False, 1, None),
             ("k", 4, 2, 8, 2, False, 1, None), ("k", 4, 2, 12, 1, False, 4, None))  # fmt: skip
# M = 9-16 (two n8 tiles): x's slab is twice the weight's bytes per 32 rows, so 64-row warps,
# which copy the least x per weight byte: over half of K (a cluster of 2) on the narrow
# projections; on the wide ones (hundreds of row blocks) CTAs of 2 or 4 such warps over all of K,
# several an SM (their registers allow 12 warps an SM, one 8-warp CTA's rings only 8), so the grid
# runs in about one round with more warps a scheduler. Wider clusters (4, 8) cost more than the
# warps they add. The driver gives 2-warp CTAs the most shared memory (room for six an SM), so x's
# lines, which an SM's CTAs at one chunk share, find 28 KB of L1: four an SM with a roomy L1 can
# be faster.
WIDE_SHORTLIST = (("k", 4, 2, 8, 2, False, 1, None), ("k", 4, 2, 4, 1, False, 1, None),
                  ("k", 4, 2, 2, 1, False, 1, None), ("k", 4, 2, 2, 1, False, 1, ROOMY_L1))  # fmt: skip


def shortlist(m: int) -> tuple[tuple, ...]:
    """The shortlist for M: one n8 tile of x (M <= 8) or two."""
    return SHORTLIST if m <= NARROW_M else WIDE_SHORTLIST


def configs(m: int, n: int, k: int, group: int) -> list[Config]:
    """Configs worth timing for a decode problem (M <= ``MAX_M``), those that fit it. A config
    with the driver's carveout leaves the field out: its candidate keeps the name (and the
    measured history) it had before the field, and a host whose code predates it runs it."""
    fit = cuda_library.fitting(shortlist(m), CONFIG_KEYS, lambda c: check_config(c, m, n, k, group))
    return [without_default_carveout(c) for c in fit if teams_worth_timing(c, n)]


def without_default_carveout(config: Config) -> Config:
    if config.get("carveout", DEFAULTS["carveout"]) is None:
        return {key: v for key, v in config.items() if key != "carveout"}
    return config


def teams_worth_timing(config: Config, n: int) -> bool:
    """Whether ``config``'s teams are timed on N weight rows (``MIN_BLOCKS_A_TEAM``); a row block
    a CTA always is."""
    blocks = -(-n // (16 * config["slices"]))
    return config["teams"] == 1 or blocks >= MIN_BLOCKS_A_TEAM * config["teams"]


def unsupported_reason(key: GemmKey) -> str | None:
    if key.wdtype != "int4":
        return "int4 weights only"
    if key.m > MAX_M:
        return f"m={key.m}: offered for decode at M <= {MAX_M} (two n8 tiles of activations)"
    if key.dtype not in ACT_DTYPES:
        return f"dtype={key.dtype}: bf16 or f16 activations only"
    if key.k % CHUNK:
        return f"k={key.k}: our layout packs K in whole chunks of {CHUNK}"
    if key.align < ALIGN:
        return f"align={key.align}: x's rows are copied in {ALIGN}-byte pieces"
    if not configs(key.m, key.n, key.k, key.group):
        return f"no config fits m={key.m}, n={key.n}, k={key.k}, group={key.group}"
    return None


class CudaW4A16(LibrarySource):
    name = "cuda_w4a16"
    library = staticmethod(library)

    def libraries(self) -> Iterable[Library]:
        entries = dict.fromkeys(SHORTLIST + WIDE_SHORTLIST)
        return (library(dict(zip(CONFIG_KEYS, e, strict=True))) for e in entries)

    def configs(self, key: GemmKey) -> list[Params]:
        return configs(key.m, key.n, key.k, key.group)

    def unsupported(self, key: GemmKey) -> str | None:
        return unsupported_reason(key)

    def build(self, key: GemmKey, params: Params) -> Runner:
        check_config(params, key.m, key.n, key.k, key.group)
        config, group, fn = dict(params), key.group, launcher(params)
        device = torch.device("cuda", torch.cuda.current_device())
        stream = ops.stream_getter(device)

        def check(x: torch.Tensor, weight: torch.Tensor, scales_and_zeros: torch.Tensor,
                  out: torch.Tensor | None) -> None:  # fmt: skip
            mnk = check_operands(x, weight, scales_and_zeros, group, out)
            int4_operands.check_shape(mnk, key, x, weight)
            if x.device != device:
                raise ValueError(f"x.device={x.device}: this runner is built for {device}")

        checked = operand_guard.CheckedOnce(check)

        def runner(
            x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
            out: torch.Tensor | None = None,
        ) -> torch.Tensor:  # fmt: skip
            weight = int4_torch.ours(packed)
            checked(x, weight, scales_and_zeros, out)
            if out is None:
                out = torch.empty(key.m, key.n, dtype=x.dtype, device=device)
            run(fn, config, x, weight, scales_and_zeros, group, out, stream())
            return out

        return runner


if __name__ == "__main__":
    sys.exit(cuda_library.builder_main(Library, sys.argv[1:]))

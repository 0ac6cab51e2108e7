"""CUTLASS 3 SM90 mixed-input GEMMs for INT4 weight-only keys: int4 weight x bf16/f16 activations,
per-group scale and zero point, built as shared libraries of their own.

cutlass_cppgen cannot build these (its argument structures have no scale or zero pointers), so
this source uses the layer under it: cutlass_library's SM90 mixed-dtype generator lists the
kernels and its emitter writes one as C++ (``MixedInputMode.ScaleWithZeroPoint``: A's element is
``cute::tuple<int4b_t, T, T>``); a small extern "C" wrapper around ``GemmUniversalAdapter``
(workspace size, run on a stream) makes it a shared library that nvcc builds in a child process of
``nvcc_build.compile_all`` and ctypes loads. Only the compile needs nvcc and cutlass_library (the
headers); the library is an artifact (``kernel_artifacts``), so other hosts load it without them.

The problem, in CUTLASS's terms: A = the weight [N, K] (K-major, the narrow operand, which must be
A), B = x [M, K] (K-major), D = W x^T [N, M] column-major, which is out [M, N] row-major. The
params' ``tile`` is CUTLASS's: [rows of W, rows of x, K] per CTA. ScaleWithZeroPoint computes
``q_s * scale + zero`` with q_s = q - 8 in -8..7 (q: torch's 0..15), which is torch's
``(q - 8) * scale + zero``; so A holds q ^ 8 as signed nibbles, two per byte, the even k in the
low nibble. Scales and zeros are two [K / group, N] tensors (N contiguous): torch's interleaved
[K / group, N, 2] is split once per tensor.

Both conversions are made at a runner's first call on a weight and memoised per tensor (and per
in-place version), as ``int4_torch.ours`` is: N * K / 2 extra bytes per weight (besides our
layout, from which the nibbles come), and as many as the scales take.

``a_layout="reordered"`` builds the kernel for CUTLASS's reordered ("shuffled") A: each thread's
eight nibbles of an MMA fragment lie in one 32-bit word, in the order the interleaved converter
takes, so the mainloop loads A from shared memory in words and converts it with fewer
instructions. ``reorder`` makes that layout from A's bytes with one permute (the kernel's own
reorder atom is defined in the wrapper: CUTLASS keeps it in a utility header that needs
cuRAND's); it is memoised apart from the row-major bytes, N * K / 2 bytes per weight for each
layout a runner has read. Not offered: group size 32 (groups must be a multiple of the tile's K).

``kernel="ws_streamk"`` is the generator's ws kernel (one consumer warpgroup, 64-row tiles) made
persistent and stream-K (``cuda_kernels/cutlass_w4a16_streamk.hpp``): one CTA an SM shares out
every tile's K steps, so a narrow projection, whose tiles are fewer than the SMs, still fills the
GPU. CUTLASS offers stream-K only on its cooperative kernel, whose 128-row tiles halve the tiles
again. A cluster's CTAs run the same steps on adjacent tiles (x's tile multicast to them). How the
steps are shared out among the CTAs is the runtime param ``share`` (``stream_k_share``). Its
workspace (a flag per tile, the share-out, a partial tile per CTA) is zeroed, and the share-out
written, once, when a launcher makes it.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import hashlib
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import torch

from tuner.candidates import cutlass_env as env
from tuner.candidates import cutlass_gemm, nvcc_build, stream_k_share
from tuner.candidates import gemm_operands as ops
from tuner.candidates.base import Params
from tuner.core.keys import DTYPES, GemmKey
from tuner.core.tensor_memo import TensorMemo
from tuner.measure import timing
from tuner.quant import int4_torch

TILE_K = 64  # 16-bit activations: 128 bytes of K per tile, the generator's only choice
GROUPS = (64, 128, 256)  # the key's groups that are multiples of TILE_K
KERNELS = ("ws", "coop", "pingpong", "ws_streamk")  # the generator's TMA mainloops, and ours
# ws_streamk's spec.kernel (a name CUTLASS does not use): the ws kernel's code, made stream-K
STREAM_K_KERNEL = "TmaWarpSpecializedStreamK1"
STREAM_K_HEADER = Path(__file__).parent / "cuda_kernels" / "cutlass_w4a16_streamk.hpp"
STREAM_K_TILE = [64, 256, 64]  # the ws tile whose partial an owner gathers in its idle stages
# no cluster of 4 CTAs: its CTAs are likely not all resident at once (timings: bench/NOTES.md)
STREAM_K_CLUSTERS = [[1, 1], [2, 1]]
# its epilogue's C: beta is 0, and with no C in shared memory CUTLASS's epilogue issues each
# subtile's TMA store after the next subtile's writes instead of waiting on it
STREAM_K_C = "void"
ALIGN = 16  # bytes: every operand goes through TMA
SMALL_M, MEDIUM_M = 128, 512  # shortlist classes by M (the activations' rows)
GENERATOR_CUDA = "13.0"  # the toolkit the generator lists kernels for: the GPU image's nvcc
# Operand pointer sets a launcher keeps initialized kernel params for: more than the input
# sets a timing rotation cycles through (``timing.MAX_SETS``), with outputs. A model whose
# layers of one shape cycle through more sets than this initializes on every call: host time
# lost, never a wrong result.
PLAN_ENTRIES = 2 * timing.MAX_SETS
# The tile scheduler's runtime arguments besides the swizzle (no new kernel): how a stream-K
# kernel shares out K ("decomposition": CUTLASS's DecompositionMode, with "splits" K splits per
# output tile for "splitk") and the raster order of a persistent kernel's tiles ("weight": along
# CUTLASS's M, the weight's rows; "x": along x's rows). Names in the order of CUTLASS's enums.
# Partial tiles are always summed in CUTLASS's deterministic order (its default ReductionMode).
DECOMPOSITIONS = ("heuristic", "dataparallel", "splitk", "streamk")
RASTERS = ("heuristic", "weight", "x")
MOST_SPLITS = 16
SCHEDULER_PARAMS = ("splits", "decomposition", "raster")
A_LAYOUTS = ("reordered",)  # the param 'a_layout' where A is not row-major


class Scheduler(NamedTuple):
    """A launcher's tile scheduler arguments, as the library's C entry points take them."""

    swizzle: int
    splits: int
    decomposition: int
    raster: int


def scheduler_args(params: Params) -> Scheduler:
    """The scheduler arguments ``params`` name (absent ones at CUTLASS's defaults); ValueError
    naming a bad one, or one the kernel has no use for."""
    splits = params.get("splits", 1)
    decomposition = params.get("decomposition", "heuristic")
    raster = params.get("raster", "heuristic")
    if type(splits) is not int or not 1 <= splits <= MOST_SPLITS:
        raise ValueError(
            f"cutlass_w4a16 param 'splits' must be an int in 1..{MOST_SPLITS}, got {splits!r}"
        )
    if decomposition not in DECOMPOSITIONS:
        raise ValueError(
            f"cutlass_w4a16 param 'decomposition' must be one of {list(DECOMPOSITIONS)}, got "
            f"{decomposition!r}"
        )
    if raster not in RASTERS:
        raise ValueError(
            f"cutlass_w4a16 param 'raster' must be one of {list(RASTERS)}, got {raster!r}"
        )
    if (splits > 1) != (decomposition == "splitk"):
        raise ValueError(
            f"cutlass_w4a16 params 'splits'={splits} and 'decomposition'={decomposition!r}: "
            "'splitk' takes 2 or more splits, the other decompositions 1"
        )
    if decomposition != "heuristic" and params.get("scheduler") != "streamk":
        raise ValueError(
            f"cutlass_w4a16 param 'decomposition'={decomposition!r} needs scheduler 'streamk', "
            f"got {params.get('scheduler')!r}"
        )
    if raster != "heuristic" and params.get("kernel") == "ws":
        raise ValueError(
            f"cutlass_w4a16 param 'raster'={raster!r}: the 'ws' kernel is not persistent (one CTA "
            "per tile, no raster order); allowed there: 'heuristic'"
        )
    if raster != "heuristic" and params.get("kernel") == "ws_streamk":
        raise ValueError(
            f"cutlass_w4a16 param 'raster'={raster!r}: the 'ws_streamk' kernel takes the steps "
            "in its own order; allowed there: 'heuristic'"
        )
    return Scheduler(
        int(params.get("swizzle", 1)), splits, DECOMPOSITIONS.index(decomposition),
        RASTERS.index(raster),
    )  # fmt: skip


class Options(NamedTuple):
    """What a launcher takes besides its library: the tile scheduler's arguments, whether the
    kernel reads A reordered, and the stream-K ws kernel's share-out (``stream_k_share``)."""

    scheduler: Scheduler
    reordered: bool
    share: str | None = None


def launch_options(params: Params) -> Options:
    streamk = params.get("kernel") == "ws_streamk"
    share = params.get("share", stream_k_share.DEFAULT) if streamk else None
    return Options(scheduler_args(params), params.get("a_layout") == "reordered", share)


def _p(
    tw: int,
    tx: int,
    cluster: tuple[int, int],
    kernel: str,
    scheduler: str = "default",
    **runtime: Any,
) -> Params:
    return {"tile": [tw, tx, TILE_K], "cluster": list(cluster), "kernel": kernel,
            "epilogue": "tma", "scheduler": scheduler, "swizzle": 1, "a_layout": "reordered",
            **runtime}  # fmt: skip


def row_major(params: Params) -> Params:
    """``params`` on the row-major A layout (for N that is not in the reordered atom's 16s)."""
    return {k: v for k, v in params.items() if k != "a_layout"}


# Every config reads A reordered (loaded in words and converted with fewer instructions than
# row-major bytes; timings: bench/NOTES.md); row-major where N is not in 16s.
# M <= 128 fits one 128-row tile of x: clusters pair CTAs along the weight's rows (sharing x's
# tile), stream-K spreads K over the SMs when N alone gives few tiles. The generator has no
# tile narrower than 128 rows of x.
SMALL = [
    _p(64, 128, (2, 1), "ws"),
    _p(64, 128, (2, 1), "pingpong"),
    _p(128, 128, (2, 1), "coop", "streamk"),
    _p(128, 128, (2, 1), "coop"),
]
# M up to MEDIUM_M. A mixed-input CTA spends most of its time dequantizing its weight tile, so
# the list opens with 64 weight rows by 256 rows of x (each weight element dequantized once up
# to M = 256) on the one-consumer mainloop (a second consumer would have no second tile on the
# narrow projections); then 64 x 128 pingpong (twice the tiles, for N that leaves SMs idle),
# cooperative stream-K (K spread over the SMs where the tiles are few) and our stream-K ws
# kernel (the same 64 x 256 CTAs as ws, every SM busy however few the tiles; at both clusters:
# pairs share x's reads, single CTAs share the steps out finer; under each of its share-outs,
# which win on different shapes). Splitting K over CTAs of CUTLASS's kernels (the scheduler's
# "splitk" decomposition) costs each extra unit more than the K steps it saves at these sizes,
# so no such variant is listed. The tuner times them all: the list is not filtered by N.
MEDIUM = [
    _p(64, 256, (2, 1), "ws"),
    _p(64, 128, (2, 1), "pingpong"),
    _p(128, 256, (2, 1), "coop", "streamk"),
    _p(128, 128, (2, 1), "coop", "streamk"),
    *(
        _p(64, 256, c, "ws_streamk", share=s)
        for s in stream_k_share.SHARES
        for c in ((2, 1), (1, 1))
    ),
]
LARGE = [
    _p(128, 256, (1, 2), "coop"),
    _p(256, 128, (2, 1), "coop"),
    _p(128, 128, (1, 2), "pingpong"),
    _p(128, 256, (2, 1), "coop", "streamk"),
]


def shortlist(key: GemmKey) -> list[Params]:
    listed = SMALL if key.m <= SMALL_M else MEDIUM if key.m <= MEDIUM_M else LARGE
    return [row_major(p) for p in listed] if key.n % 16 else listed


def unsupported_reason(key: GemmKey) -> str | None:
    if key.wdtype != "int4":
        return "int4 weights only"
    if key.group not in GROUPS:
        return (
            f"group={key.group}: CUTLASS needs groups that are multiples of its tile's K "
            f"({TILE_K}): {list(GROUPS)}"
        )
    if key.align < ALIGN:
        return f"align={key.align}: CUTLASS mixed-input kernels load x through TMA (16 bytes)"
    return None  # N % 8 and K % group, which TMA and the scales need, every int4 key has


def check_stream_k(params: Params) -> None:
    """What ``ws_streamk`` takes besides the ws kernel's params; ValueError naming the field."""
    for name, allowed in (
        ("tile", [STREAM_K_TILE]),
        ("cluster", STREAM_K_CLUSTERS),
        ("scheduler", ["default"]),  # it shares its steps out itself
        ("swizzle", [1]),
        ("share", list(stream_k_share.SHARES)),
    ):
        value = params.get(name, stream_k_share.DEFAULT if name == "share" else 1)
        value = list(value) if isinstance(value, list | tuple) else value
        if value not in allowed:
            raise ValueError(
                f"cutlass_w4a16 param {name!r} must be one of {allowed} for kernel 'ws_streamk', "
                f"got {params.get(name)!r}"
            )


def kernel_spec(key: GemmKey, params: Params) -> env.KernelSpec:
    """The compiled kernel ``params`` name for the INT4 ``key``; ValueError naming a bad param."""
    own = (*SCHEDULER_PARAMS, "a_layout", "share")
    unknown = set(params) - {*cutlass_gemm.PARAM_NAMES, *own}
    if unknown:
        raise ValueError(
            f"unknown cutlass_w4a16 params {sorted(unknown)}; allowed: "
            f"{[*cutlass_gemm.PARAM_NAMES, *own]}"
        )
    if "kernel" in params and params["kernel"] not in KERNELS:
        raise ValueError(
            f"cutlass_w4a16 param 'kernel' must be one of {list(KERNELS)}, got {params['kernel']!r}"
        )
    streamk = params.get("kernel") == "ws_streamk"
    generated = {k: v for k, v in params.items() if k not in own}
    cutlass_gemm.check_params({**generated, "kernel": "ws"} if streamk else generated)
    if streamk:
        check_stream_k(params)
    elif "share" in params:
        raise ValueError(
            f"cutlass_w4a16 param 'share' is the 'ws_streamk' kernel's, got kernel "
            f"{params.get('kernel')!r}"
        )
    a_layout = params.get("a_layout", "")
    if a_layout and a_layout not in A_LAYOUTS:
        raise ValueError(
            f"cutlass_w4a16 param 'a_layout' must be one of {list(A_LAYOUTS)} (or absent: "
            f"row-major), got {a_layout!r}"
        )
    if a_layout and key.n % 16:
        raise ValueError(
            f"cutlass_w4a16 param 'a_layout'={a_layout!r} needs N in 16s (its atoms), got N={key.n}"
        )
    scheduler_args(params)
    if params["epilogue"] != "tma":
        raise ValueError(
            f"cutlass_w4a16 param 'epilogue' must be 'tma' (the generator's only one), got "
            f"{params['epilogue']!r}"
        )
    return env.KernelSpec(
        dtype=key.dtype,
        layout=key.layout,
        align_ab=ALIGN // key.itemsize,
        align_c=ALIGN // key.itemsize,
        tile=tuple(params["tile"]),
        cluster=tuple(params["cluster"]),
        kernel=STREAM_K_KERNEL if streamk else cutlass_gemm.KERNELS[params["kernel"]],
        epilogue="tma",
        scheduler=cutlass_gemm.SCHEDULERS[params["scheduler"]],
        wdtype="int4",
        a_layout=a_layout,
    )


# --- the kernel's C++ ------------------------------------------------------------------------


@functools.cache
def _operations() -> tuple[Any, ...]:
    """cutlass_library's SM90 s4 x 16-bit ScaleWithZeroPoint GEMMs (A row-major or reordered)."""
    import cutlass_library as cl
    from cutlass_library import generator, manifest

    args = generator.define_parser().parse_args(["--kernels=all"])
    found = manifest.Manifest(args)
    generator.GenerateSM90_TensorOp_mixed_dtype_WGMMA_gemm(found, GENERATOR_CUDA)
    return tuple(
        op
        for group in found.operations[cl.OperationKind.Gemm][env.SM].values()
        for op in group
        if op.A.element == cl.DataType.s4
        and op.mixed_input_mode == cl.MixedInputMode.ScaleWithZeroPoint
    )


def operation(spec: env.KernelSpec) -> Any:
    """cutlass_library's operation for ``spec``; LookupError if the generator lists none. A
    stream-K spec's is the ws kernel's of its tile, whatever the listed cluster, set to its own."""
    import cutlass_library as cl

    element = {"bf16": cl.DataType.bf16, "f16": cl.DataType.f16}.get(spec.dtype)
    streamk = spec.kernel == STREAM_K_KERNEL
    schedule = cutlass_gemm.KERNELS["ws"] if streamk else spec.kernel
    for op in _operations():
        td = op.tile_description
        if (
            op.B.element == element
            and tuple(td.threadblock_shape) == spec.tile
            and (streamk or tuple(td.cluster_shape)[:2] == spec.cluster)
            and op.kernel_schedule.name == schedule
            and op.tile_scheduler.name == spec.scheduler
            and op.B.alignment == spec.align_ab
            and op.C.alignment == spec.align_c
            and op.mixed_input_shuffle == (spec.a_layout == "reordered")
        ):
            if streamk:
                op = copy.deepcopy(op)
                op.tile_description.cluster_shape = [*spec.cluster, 1]
                op.C = copy.copy(op.C)
                op.C.element = getattr(cl.DataType, STREAM_K_C)
                op.__dict__.pop("_procedural_name", None)  # cached from the listed cluster
            return op
    raise LookupError(f"cutlass_library {env.version()} lists no SM90 int4 GEMM for {spec}")


def in_library(spec: env.KernelSpec) -> bool:
    return env.offers(spec, operation)


# The host side: CUTLASS's problem is (N, M, K) with the weight as A; every pointer and size is
# a call argument, so one library serves every shape. A plan (one per launcher: a shape, its
# workspace and device) keeps the initialized kernel params of its last PLAN_ENTRIES operand
# pointer sets: the params (TMA descriptors included) are a function of the pointers, sizes,
# workspace and device alone, so a call with a known pointer set only re-zeroes the workspace
# as ``initialize`` would (stream-K's barriers) and launches; a new set runs can_implement and
# initialize first. ``tuner_host_us`` times those steps apart (bench/cutlass_w4a16_host.py).
_WRAPPER = """
#include <chrono>
#include <cstdint>
#include <mutex>
#include <vector>
#include <cuda_runtime.h>
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/util/packed_stride.hpp"
${kernel}
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<${name}>;
using Kernel = Gemm::GemmKernel;

// Stream-K schedulers' K decomposition; nothing for the schedulers that have none.
template <class S>
static auto decompose(S& s, int splits, int mode, int) -> decltype(s.splits, void()) {
  s.splits = splits;
  s.decomposition_mode = static_cast<decltype(s.decomposition_mode)>(mode);
}
template <class S>
static void decompose(S&, int, int, long) {}

struct Sched {
  int swizzle, splits, decomposition, raster;
};

static Gemm::Arguments arguments(void const* w, void const* x, void const* scale,
                                 void const* zero, void* out, int m, int n, int k, int group,
                                 Sched sched, int device, int sms) {
  Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {n, m, k, 1};
  auto& ml = args.mainloop;
  ml.ptr_A = reinterpret_cast<decltype(ml.ptr_A)>(w);
  ml.dA = cutlass::make_cute_packed_stride(Kernel::StrideA{}, cute::make_shape(n, k, 1));
  ml.ptr_B = reinterpret_cast<decltype(ml.ptr_B)>(x);
  ml.dB = cutlass::make_cute_packed_stride(Kernel::StrideB{}, cute::make_shape(m, k, 1));
  ml.ptr_S = reinterpret_cast<decltype(ml.ptr_S)>(scale);
  ml.dS = cutlass::make_cute_packed_stride(decltype(ml.dS){}, cute::make_shape(n, k / group, 1));
  ml.group_size = group;
  ml.ptr_Z = reinterpret_cast<decltype(ml.ptr_Z)>(zero);
  auto& ep = args.epilogue;
  ep.thread.alpha = 1.0f;
  ep.thread.beta = 0.0f;
  ep.ptr_C = reinterpret_cast<decltype(ep.ptr_C)>(out);
  ep.dC = cutlass::make_cute_packed_stride(Kernel::StrideC{}, cute::make_shape(n, m, 1));
  ep.ptr_D = reinterpret_cast<decltype(ep.ptr_D)>(out);
  ep.dD = cutlass::make_cute_packed_stride(Kernel::StrideD{}, cute::make_shape(n, m, 1));
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sms;
  args.scheduler.max_swizzle_size = sched.swizzle;
  args.scheduler.raster_order = static_cast<decltype(args.scheduler.raster_order)>(sched.raster);
  decompose(args.scheduler, sched.splits, sched.decomposition, 0);
  return args;
}

static int code(cutlass::Status status) {  // 0, or 1000 + a cutlass::Status, or a cudaError_t
  if (status != cutlass::Status::kSuccess) return 1000 + static_cast<int>(status);
  return static_cast<int>(cudaGetLastError());
}

constexpr int kOperands = 5;  // w, x, scale, zero, out

struct Entry {
  void const* ptrs[kOperands];
  uint64_t used;
  Kernel::Params params;
};

struct Shape {
  int m, n, k, group;
  Sched sched;
  int device, sms, entries;
  void* workspace;
};

struct Plan {
  Shape s;
  std::mutex lock;
  uint64_t clock = 0;
  std::vector<Entry> known;

  explicit Plan(Shape shape) : s(shape) { known.reserve(s.entries); }

  Gemm::Arguments args(void const* const* p) const {
    return arguments(p[0], p[1], p[2], p[3], const_cast<void*>(p[4]), s.m, s.n, s.k, s.group,
                     s.sched, s.device, s.sms);
  }

  // The entry of the pointer set p, made (can_implement, initialize) if new; null on failure.
  Entry* find(void const* const* p, cudaStream_t stream, cutlass::Status* status) {
    Entry* oldest = nullptr;
    for (auto& e : known) {
      bool same = true;
      for (int i = 0; i < kOperands; ++i) same = same && e.ptrs[i] == p[i];
      if (same) {
        e.used = ++clock;
        *status = Kernel::initialize_workspace(args(p), s.workspace, stream);
        return &e;
      }
      if (oldest == nullptr || e.used < oldest->used) oldest = &e;
    }
    auto a = args(p);
    Gemm gemm;
    *status = gemm.can_implement(a);
    if (*status == cutlass::Status::kSuccess) *status = gemm.initialize(a, s.workspace, stream);
    if (*status != cutlass::Status::kSuccess) return nullptr;
    if (static_cast<int>(known.size()) < s.entries) oldest = &known.emplace_back();
    for (int i = 0; i < kOperands; ++i) oldest->ptrs[i] = p[i];
    oldest->used = ++clock;
    oldest->params = gemm.params();
    return oldest;
  }

  int run(void const* const* p, cudaStream_t stream) {
    std::lock_guard<std::mutex> hold(lock);
    cutlass::Status status;
    Entry* e = find(p, stream, &status);
    if (e != nullptr && status == cutlass::Status::kSuccess) status = Gemm::run(e->params, stream);
    return code(status);
  }
};

template <class F>
static double host_us(int reps, F&& f) {
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) f();
  std::chrono::duration<double, std::micro> spent = std::chrono::steady_clock::now() - t0;
  return spent.count() / reps;
}

extern "C" {

int tuner_workspace_size(int m, int n, int k, int group, int swizzle, int splits,
                         int decomposition, int raster, int device, int sms, size_t* bytes) {
  Sched sched{swizzle, splits, decomposition, raster};
  auto args = arguments(nullptr, nullptr, nullptr, nullptr, nullptr, m, n, k, group, sched,
                        device, sms);
  *bytes = Gemm::get_workspace_size(args);
  return 0;
}

void* tuner_plan_create(int m, int n, int k, int group, int swizzle, int splits,
                        int decomposition, int raster, int device, int sms, int entries,
                        void* workspace) {
  Sched sched{swizzle, splits, decomposition, raster};
  return new Plan(Shape{m, n, k, group, sched, device, sms, entries, workspace});
}

void tuner_plan_destroy(void* plan) { delete static_cast<Plan*>(plan); }

// 0, or 1000 + a cutlass::Status, or a cudaError_t
int tuner_plan_run(void* plan, void const* w, void const* x, void const* scale, void const* zero,
                   void* out, void* stream) {
  void const* p[kOperands] = {w, x, scale, zero, out};
  return static_cast<Plan*>(plan)->run(p, static_cast<cudaStream_t>(stream));
}

// Host microseconds per call, over reps calls each, on the pointer set p: us[0] arguments and
// can_implement, us[1] initialize, us[2] initialize and launch (each launch after its own
// initialize: stream-K's barriers must be zeroed before every launch), us[3] a plan call that
// finds p known. Launches 2 * reps + 1 kernels; a code as tuner_plan_run's.
int tuner_host_us(void* plan, void const* const* p, void* stream, int reps, double* us) {
  auto* pl = static_cast<Plan*>(plan);
  auto st = static_cast<cudaStream_t>(stream);
  Gemm gemm;
  cutlass::Status status = cutlass::Status::kSuccess;
  auto initialize = [&] {
    if (status != cutlass::Status::kSuccess) return;
    status = gemm.initialize(pl->args(p), pl->s.workspace, st);
  };
  us[0] = host_us(reps, [&] { status = gemm.can_implement(pl->args(p)); });
  us[1] = host_us(reps, initialize);
  us[2] = host_us(reps, [&] {
    initialize();
    if (status == cutlass::Status::kSuccess) status = gemm.run(st);
  });
  if (status != cutlass::Status::kSuccess) return code(status);
  int err = pl->run(p, st);
  us[3] = host_us(reps, [&] { err = err ? err : pl->run(p, st); });
  return err ? err : code(status);
}

}
"""


# A reordered kernel's code names CUTLASS's reorder atom (``compute_memory_reordering_atom``, in
# tools/util's mixed_dtype_utils.hpp, whose includes need cuRAND's headers): defined here before
# the kernel, as that header defines it. After the kernel, the wrapper's one call that makes A's
# stride makes the reordered layout instead: the kernel takes that layout where a stride would be.
_REORDER_ATOM = """
#include "cute/arch/mma_sm90.hpp"
namespace cutlass {
// The layout of an SM90 register-sourced MMA's A tile in which each thread's values are
// contiguous, repeated atom_layout times along K, values permuted by val_layout.
template <class ElementMma, class AtomLayout = cute::Layout<cute::_1>,
          class ValLayout = cute::Layout<cute::_1>>
constexpr auto compute_memory_reordering_atom(AtomLayout atom_layout = {},
                                              ValLayout val_layout = {}) {
  using namespace cute;
  using Mma = decltype(SM90::GMMA::rs_op_selector<ElementMma, ElementMma, float,
                                                  Shape<_64, _16, _32>>());
  using Traits = MMA_Traits<Mma>;
  auto tv = typename Traits::ALayout{};  // (thread, value) -> (m, k) of the whole MMA
  auto warp_tv = make_layout_like(composition(tv, make_shape(Int<32>{}, size<1>(tv))));
  auto warps = size(typename Traits::ThrID{}) / Int<32>{};  // A is split over warps along M
  auto warp_mk = right_inverse(warp_tv).with_shape(
      shape_div(select<0, 2>(typename Traits::Shape_MNK{}), warps));
  auto target_mk = blocked_product(warp_mk, atom_layout);
  auto val_offset = logical_product(val_layout, size<1>(tv) / size(val_layout) * size(atom_layout));
  auto tv_offset = select<1, 0>(logical_product(val_offset, make_layout(size<0>(warp_tv))));
  return composition(tv_offset, target_mk);
}
}  // namespace cutlass
"""
_REORDERED_STRIDE = """
namespace cutlass {
inline ${name}_LayoutNarrowReordered make_cute_packed_stride(${name}_LayoutNarrowReordered,
                                                             cute::Shape<int, int, int> nk1) {
  return cute::tile_to_shape(${name}_LayoutAtomQuant{}, nk1);
}
}  // namespace cutlass
"""
# The stream-K ws library's one more entry point: where its share-out goes in the workspace.
_STREAM_K_LAYOUT = """
extern "C" int tuner_streamk_layout(int m, int n, int k, int group, int sms, int64_t* out) {
  Kernel::layout(arguments(nullptr, nullptr, nullptr, nullptr, nullptr, m, n, k, group,
                           Sched{1, 1, 0, 0}, 0, sms), out);
  return 0;
}
"""
# in the kernel specs' digests
WRAPPER_DIGEST = hashlib.sha1(_WRAPPER.encode()).hexdigest()[:12]
REORDERED_DIGEST = hashlib.sha1((_REORDER_ATOM + _REORDERED_STRIDE).encode()).hexdigest()[:12]


def wrapper_fields(spec: env.KernelSpec) -> dict[str, str]:
    """The digests of the C++ besides cutlass_library's that ``spec``'s library is built with."""
    fields = {"wrapper": WRAPPER_DIGEST}
    if spec.a_layout:
        fields["reordered"] = REORDERED_DIGEST
    if spec.kernel == STREAM_K_KERNEL:
        streamk = STREAM_K_HEADER.read_bytes() + _STREAM_K_LAYOUT.encode()
        fields["streamk"] = hashlib.sha1(streamk).hexdigest()[:12]
        fields["streamk_c"] = STREAM_K_C
    return fields


def source(spec: env.KernelSpec) -> str:
    """The C++ of ``spec``'s shared library: cutlass_library's kernel and our host wrapper."""
    from cutlass_library.gemm_operation import EmitGemmUniversal3xInstance

    op = operation(spec)
    emitter = EmitGemmUniversal3xInstance()
    kernel = "".join(f'#include "{h}"\n' for h in emitter.includes)
    emitted = emitter.emit(op)
    if spec.kernel == STREAM_K_KERNEL:
        kernel += STREAM_K_HEADER.read_text()
        universal = "cutlass::gemm::kernel::GemmUniversal<"
        if emitted.count(universal) != 1:
            raise LookupError(f"cutlass_library {env.version()} emits no one {universal}...> to "
                              "build the stream-K kernel on")  # fmt: skip
        emitted = emitted.replace(universal, "tuner::GemmStreamK1<")
    if spec.a_layout:
        kernel += _REORDER_ATOM + emitted + _REORDERED_STRIDE
    else:
        kernel += emitted
    wrapped = _WRAPPER + (_STREAM_K_LAYOUT if spec.kernel == STREAM_K_KERNEL else "")
    return wrapped.replace("${kernel}", kernel).replace("${name}", op.procedural_name())


def nvcc_command(spec: env.KernelSpec, src: Path, out: Path) -> list[str]:
    import cutlass_library

    root = Path(cutlass_library.source_path)
    return [
        nvcc_build.nvcc_path() or "nvcc",
        "-std=c++17", "--expt-relaxed-constexpr", "-O3", "-DNDEBUG",
        "-Xcudafe", "--diag_suppress=esa_on_defaulted_function_ignored",
        f"-gencode=arch=compute_{env.SM}a,code=sm_{env.SM}a",
        "-shared", "-Xcompiler", "-fPIC",
        "-I", str(root / "include"), "-I", str(root / "tools" / "util" / "include"),
        "-o", str(out), str(src),
    ]  # fmt: skip


def compile_library(spec: env.KernelSpec) -> dict[str, Any]:
    """Child-process body of ``compile_all``: build ``spec``'s library into the cache; a verdict
    in ``nvcc_build``'s form (a spec the generator does not list fails for good)."""
    try:
        text = source(spec)
    except (LookupError, ImportError) as e:
        return {"ok": False, "permanent": isinstance(e, LookupError), "error": f"{e}"}
    work = nvcc_build.work_dir()
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"{spec.digest}.cu"
    src.write_text(text)
    name = operation(spec).procedural_name()
    return nvcc_build.build_library(spec, lambda out: nvcc_command(spec, src, out), {"name": name})


# --- operands --------------------------------------------------------------------------------


def to_cutlass(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 (torch's q) -> A's bytes, uint8 [N, K / 2]: q ^ 8 (q - 8 as a signed
    nibble), k = 2j in the low and 2j + 1 in the high nibble of byte j."""
    if q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"q.shape={tuple(q.shape)}: expected [N, K] with K even")
    s = q.to(torch.uint8) ^ 8
    return s[:, 0::2] | (s[:, 1::2] << 4)


def from_cutlass(packed: torch.Tensor) -> torch.Tensor:
    """A's bytes -> the [N, K] values 0..15 they stand for (``to_cutlass`` undone)."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(
            f"packed: expected a uint8 [N, K / 2] tensor, got {packed.dtype} {tuple(packed.shape)}"
        )
    pairs = torch.stack([packed & 15, packed >> 4], dim=2)
    return pairs.reshape(packed.shape[0], -1) ^ 8


def reorder(a: torch.Tensor) -> torch.Tensor:
    """A's bytes [N, K / 2] (``to_cutlass``) -> the same nibbles in CUTLASS's reordered layout,
    the ``tile_to_shape`` of its 16 x 16 reorder atom over [N, K] (atoms along N first): with
    m = 16 mt + 8 m1 + m0 and k = 16 kt + 8 k2 + 2 k1 + k0, nibble (m, k) goes to
    256 (N / 16) kt + 256 mt + 32 m0 + 8 k1 + 4 k0 + 2 k2 + m1."""
    if a.dtype != torch.uint8 or a.dim() != 2:
        raise ValueError(f"a: expected a uint8 [N, K / 2] tensor, got {a.dtype} {tuple(a.shape)}")
    n, k = a.shape[0], 2 * a.shape[1]
    if n % 16 or k % 16:
        raise ValueError(f"a: the reordered layout needs N and K in 16s, got N={n}, K={k}")
    nibbles = torch.stack([a & 15, a >> 4], dim=2).view(n // 16, 2, 8, k // 16, 2, 4, 2)
    flat = nibbles.permute(3, 0, 2, 5, 6, 4, 1).reshape(-1)
    return (flat[0::2] | (flat[1::2] << 4)).view(n, k // 2)


def unreorder(a: torch.Tensor) -> torch.Tensor:
    """``reorder`` undone: reordered bytes -> A's row-major bytes [N, K / 2]."""
    n, k = a.shape[0], 2 * a.shape[1]
    nibbles = torch.stack([a & 15, a >> 4], dim=2).view(k // 16, n // 16, 8, 4, 2, 2, 2)
    rows = nibbles.permute(1, 6, 2, 0, 5, 3, 4).reshape(n, k)
    return rows[:, 0::2] | (rows[:, 1::2] << 4)


def split_scales(scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's [K / group, N, 2] -> contiguous (scale, zero), each [K / group, N]."""
    if scales_and_zeros.dim() != 3 or scales_and_zeros.shape[2] != 2:
        raise ValueError(
            f"scales_and_zeros.shape={tuple(scales_and_zeros.shape)}: expected [K / group, N, 2]"
        )
    return scales_and_zeros[..., 0].contiguous(), scales_and_zeros[..., 1].contiguous()


# A's bytes of torch's packed weight, row-major and reordered; (scale, zero) of torch's
# scales_and_zeros
weight: TensorMemo[torch.Tensor] = TensorMemo(lambda t: to_cutlass(int4_torch.nibbles(t)))
reordered_weight: TensorMemo[torch.Tensor] = TensorMemo(
    lambda t: reorder(to_cutlass(int4_torch.nibbles(t)))
)
scales: TensorMemo[tuple[torch.Tensor, torch.Tensor]] = TensorMemo(split_scales)


# --- the runner ------------------------------------------------------------------------------


class W4A16Launcher:
    """``(x, packed, scales_and_zeros, out=None)`` through one compiled library for one key."""

    def __init__(
        self,
        library: Path,
        key: GemmKey,
        options: Options,
        device: torch.device,
        sms: int | None = None,
        runs: Callable[[stream_k_share.Layout], list[int]] | None = None,
    ) -> None:
        """``sms``: the SMs a persistent kernel's grid fills (default: the device's); ``runs``:
        the stream-K ws kernel's share-out, instead of the one ``options.share`` names."""
        lib = ctypes.CDLL(str(library))
        lib.tuner_plan_create.restype = ctypes.c_void_p
        lib.tuner_plan_create.argtypes = [ctypes.c_int] * 11 + [ctypes.c_void_p]
        lib.tuner_plan_destroy.argtypes = [ctypes.c_void_p]
        self.run = lib.tuner_plan_run
        self.run.restype = ctypes.c_int
        self.run.argtypes = [ctypes.c_void_p] * 7
        self.host_us = lib.tuner_host_us
        self.host_us.restype = ctypes.c_int
        self.host_us.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_void_p]
        size = ctypes.c_size_t()
        self.lib, self.key, self.device, self.scheduler = lib, key, device, options.scheduler
        self.weight = reordered_weight if options.reordered else weight
        every = torch.cuda.get_device_properties(device).multi_processor_count
        if sms is not None and not 0 < sms <= every:
            raise ValueError(f"sms={sms}: the device has {every} SMs; allowed: 1..{every}")
        self.sms = sms or every
        self.problem = (key.m, key.n, key.k, key.group, *self.scheduler, device.index, self.sms)
        lib.tuner_workspace_size(*self.problem, ctypes.byref(size))
        self.workspace_bytes = max(size.value, 1)
        share = runs or (stream_k_share.SHARES[options.share] if options.share else None)
        self.share_out = None if share is None else self._share_out(share)
        self.dtype = DTYPES[key.dtype]
        self.x_shape = torch.Size((key.m, key.k))
        self.w_shape = torch.Size((key.n, key.k // 2))  # A's bytes
        self.scale_shape = torch.Size((key.k // key.group, key.n))
        self.out_shape = (key.m, key.n)
        self.stream = ops.stream_getter(device)
        self.plans: dict[int, tuple[int, torch.Tensor]] = {}  # stream -> (plan, its workspace)
        self.making = threading.Lock()

    def plan(self, stream: int) -> int:
        """``stream``'s own plan and workspace, made on it at its first call: calls of two
        threads on their streams run at once, and must not share stream-K's flags and partial
        tiles (a plan's mutex orders enqueues, not the kernels)."""
        held = self.plans.get(stream)
        if held is None:
            with self.making:
                held = self.plans.get(stream)
                if held is None:
                    # zeroed: a stream-K kernel's flags start at zero, and its owners reset them
                    ws = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=self.device)
                    if self.share_out is not None:  # a device-to-device copy: capturable
                        offset, words = self.share_out
                        ws[offset : offset + words.numel() * 8].copy_(words.view(torch.uint8))
                    made = self.lib.tuner_plan_create(*self.problem, PLAN_ENTRIES, ws.data_ptr())
                    weakref.finalize(ws, self.lib.tuner_plan_destroy, made)
                    held = self.plans[stream] = (made, ws)
        return held[0]

    def _share_out(
        self, share: Callable[[stream_k_share.Layout], list[int]]
    ) -> tuple[int, torch.Tensor]:
        """Where the stream-K ws kernel's share-out goes in its workspace, and what it is."""
        out = (ctypes.c_int64 * len(stream_k_share.Layout._fields))()
        self.lib.tuner_streamk_layout.argtypes = [ctypes.c_int] * 5 + [ctypes.c_void_p]
        k = self.key
        self.lib.tuner_streamk_layout(k.m, k.n, k.k, k.group, self.sms, out)
        layout = stream_k_share.Layout(*out)
        words = stream_k_share.workspace_words(share(layout), layout)
        return layout.offset, torch.tensor(words, dtype=torch.int64, device=self.device)

    def _check(self, x: torch.Tensor) -> None:
        if (
            x.shape == self.x_shape
            and x.dtype == self.dtype
            and x.device == self.device
            and x.is_contiguous()
            and not x.data_ptr() % ALIGN
        ):
            return  # one test per property on every call; the reason below only for a bad x
        k = self.key
        if x.shape != self.x_shape or x.dtype != self.dtype or x.device != self.device:
            raise ValueError(
                f"x: expected {self.dtype} [{k.m}, {k.k}] on {self.device}, got {x.dtype} "
                f"{list(x.shape)} on {x.device}"
            )
        raise ValueError(
            f"x: must be contiguous and {ALIGN}-byte aligned, got strides {x.stride()} at "
            f"{x.data_ptr():#x}"
        )

    def _fresh(self) -> torch.Tensor:  # a shape as ints parses faster than as a tuple
        return torch.empty(*self.out_shape, dtype=self.dtype, device=self.device)

    def operands(
        self, x: Any, packed: Any, scales_and_zeros: Any, out: Any = None
    ) -> tuple[list[int], torch.Tensor, Any]:
        """The kernel's five operand pointers (w, x, scale, zero, out), the buffer it writes and
        the caller's ``out``."""
        self._check(x)
        w = self.weight(packed)
        scale, zero = scales(scales_and_zeros)
        if w.shape != self.w_shape or scale.shape != self.scale_shape:
            k = self.key
            n, k2 = w.shape
            raise ValueError(
                f"packed / scales_and_zeros: a weight of N={n}, K={2 * k2} with scales "
                f"{list(scale.shape)}, for a key of N={k.n}, K={k.k}, group={k.group}"
            )
        if out is None:
            c, user_out = self._fresh(), None
        else:
            c, user_out = ops.output_for(self.key, x, out, ALIGN)
            if c.stride(0) != self.key.n:  # the kernel writes packed rows
                c = self._fresh()
        ptrs = [w.data_ptr(), x.data_ptr(), scale.data_ptr(), zero.data_ptr(), c.data_ptr()]
        return ptrs, c, user_out

    def __call__(self, x: Any, packed: Any, scales_and_zeros: Any, out: Any = None) -> Any:
        (w, xp, scale, zero, cp), c, user_out = self.operands(x, packed, scales_and_zeros, out)
        ops.bind_context(self.device)  # before the library encodes TMA descriptors
        stream = self.stream()
        err = self.run(self.plan(stream), w, xp, scale, zero, cp, stream)
        if err:
            raise RuntimeError(f"CUTLASS int4 GEMM failed: code {err} (1000 + cutlass::Status, "
                               "else cudaError_t)")  # fmt: skip
        return ops.finish(c, user_out, _same)

    def step_times_us(self, ptrs: list[int], reps: int) -> dict[str, float]:
        """Host microseconds per call of each step of a launch on ``ptrs`` (``operands``), timed
        in the library: can_implement, initialize, initialize and launch (a call with no
        initialized params kept), and a plan call of a known set."""
        us = (ctypes.c_double * 4)()
        args = (ctypes.c_void_p * 5)(*ptrs)
        stream = ops.current_stream(self.device)
        if err := self.host_us(self.plan(stream), args, stream, reps, us):
            raise RuntimeError(f"CUTLASS int4 GEMM failed: code {err}")
        names = ("can_implement", "initialize", "initialize_and_launch", "known_call")
        return dict(zip(names, us, strict=True))


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class CutlassW4A16(cutlass_gemm.CutlassGemm):
    name = "cutlass_w4a16"
    builds_kernels = True
    launcher: ClassVar[Any] = W4A16Launcher

    def unsupported(self, key: GemmKey) -> str | None:
        return unsupported_reason(key)

    def kernel_spec(self, key: GemmKey, params: Params) -> env.KernelSpec:
        return kernel_spec(key, params)

    def offered(self, key: GemmKey) -> dict[env.KernelSpec, Params]:
        pairs = ((kernel_spec(key, p), p) for p in shortlist(key))
        return cutlass_gemm.compilable(pairs, in_library)

    def candidates(self, key: GemmKey, device: str) -> list[Params]:
        """Every shortlisted config whose kernel can run here: the configs that share a kernel
        (scheduler arguments apart) all stay."""
        usable = {self.kernel_spec(key, p) for p in super().candidates(key, device)}
        return [p for p in shortlist(key) if self.kernel_spec(key, p) in usable]

    def launch_options(self, params: Params) -> Options:
        return launch_options(params)

    def prepare(self, key: GemmKey, shortlist: list[Params]) -> None:
        """Nothing: these kernels load as shared libraries of their own, without cutlass_cppgen."""

    def load(self, spec: env.KernelSpec) -> Path:
        """The compiled library of ``spec`` (what the launcher and the artifact store take)."""
        return nvcc_build.library_path(spec)


def _main(argv: list[str]) -> int:
    return nvcc_build.child_main(argv, lambda text: compile_library(env.KernelSpec.from_json(text)))


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

// INT4 weight-only decode GEMM (W4A16, M <= 16): out[M, N] = x[M, K] @ dequant(w)[N, K]^T.
//
// GEMV-style: a warp owns ROWS = 16 * SLICES weight rows. A CTA owns a contiguous run of K (all
// of it, or 1 / C of it in a cluster of C CTAs), and its warps split either
// - K (GEMV_SPLIT_ROWS=0): the CTA's rows are one warp's; its warps take interleaved 128-value
//   chunks of the run, each from its own copy ring, and their [ROWS, M] partials are summed in
//   shared memory in warp order. Without a cluster the CTA may hold several such row blocks
//   (`teams`, a launch argument), each taken by warps / teams of its warps exactly as a CTA of
//   its own would: the block scheduler then hands out a wide projection's grid in one CTA an SM,
//   so its warps start together instead of a CTA an SM at a time (the CTAs handed out last end
//   last, by as long as the hand-out took); or
// - rows (GEMV_SPLIT_ROWS=1): the CTA's rows are `warps` x ROWS, every warp takes every chunk
//   of the run from one ring the CTA shares, so x's [M, 128] slab of a chunk is copied once per
//   CTA instead of once per warp (x's bytes per weight byte: 4 M / (warps x ROWS), not 4 M / ROWS).
// In a cluster each rank owns a share of the outputs: it pushes the other ranks' shares of its
// sums into their inboxes (past their rings) with asynchronous stores to distributed shared
// memory that count their bytes on the inbox's mbarrier, waits there for theirs, adds them in
// rank order and stores its share: no cluster-wide barrier after the stream, no remote reads,
// no fences. No CTA waits on another's partial in global memory: the result is deterministic,
// with no workspace, no arrival counter and no second pass.
//
// Launched as a plain grid, not as a programmatic dependent launch: after a kernel that does not
// trigger its dependents early (a model's norms and activations), waiting on the SMs for it
// costs more than the early start saves. It lets the next kernel launch once its loads are done
// (griddepcontrol.launch_dependents), for one that is a programmatic dependent launch.
//
// The weight is our packed layout (tuner/quant/int4.py): 64-row blocks, a block's K chunk one
// contiguous [r rows x 64 bytes] run, and in each row's 64 bytes the 16 at 16 t hold the 32
// values lane t of a quad owns in mma.m16n8k16's A fragment (k = 16 j + 2 t + {0, 1, 8, 9} for
// the eight k16 blocks j: word j % 4, low nibbles for j < 4, high ones above; in a word, bytes
// 0 and 2 hold k and k + 1, bytes 1 and 3 k + 8 and k + 9).
// So a warp's 16-row slice of a chunk is 1 KB, and lane (g, t) needs the 16 bytes of rows g and
// g + 8 at 16 t: the same bytes it copies. Scales and zeros: torch's [K / group, N, 2].
//
// A ring of STAGES chunks in shared memory (per warp, or per CTA when warps split rows) filled
// by cp.async (weight slices, the chunk's (scale, zero) words, x's [M, 128] slab), STAGES - 1 in
// flight while one is computed; the weight streams past the L1, x's slab through it (read by
// every CTA, so the CTAs an SM holds share its lines).
// A nibble q becomes a 16-bit float by the magic-number trick (q | magic = magic + q, exact),
// which the tensor cores take as it is; a group's scale and zero apply to its dot after, in
// fp32 (`compute`), so no weight value is rounded on the way. x is the mma's B operand
// (ldmatrix from the slab; rows past M read row M - 1 and only produce output columns that are
// never stored).
//
// x's M rows are one n8 tile of the mma (M <= 8) or two (M = 9-16): each dequantized A fragment
// then feeds two mma, so a second tile costs x's copies and mma, not the dequant.
//
// Staggered (GEMV_STAGGER=1): every CTA steps through K at once, so without it each chunk's x
// lines are asked for by every CTA together; staggered, a CTA starts at round `row block %
// rounds` and wraps to round 0 (the same chunks a warp, in another fixed order), at a few more
// instructions a chunk. With x through the L1, CTAs of an SM at the same chunk share its lines
// there, so staggering has little to spread and costs its instructions: the decode shortlist has
// none.
//
// One shared library per (SPLIT_ROWS, SLICES, STAGES, STAGGER): -DGEMV_SPLIT_ROWS=0|1 (warps
// split K or rows), -DGEMV_SLICES=1|2|4 (16-row slices per warp), -DGEMV_STAGES=2..8,
// -DGEMV_STAGGER=0|1; warps per CTA, the cluster size (1, 2, 4 or 8 CTAs), the row blocks a
// CTA (teams, each build of them its own kernel instance) and the shared-memory carveout are
// launch arguments. The driver sizes shared memory for the most CTAs an SM, which can leave x's
// lines an L1 too small for the CTAs to share them; a carveout trades CTAs for L1.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cluster_launch.cuh"

#ifndef GEMV_SPLIT_ROWS
#define GEMV_SPLIT_ROWS 0
#endif
#ifndef GEMV_SLICES
#define GEMV_SLICES 1
#endif
#ifndef GEMV_STAGES
#define GEMV_STAGES 4
#endif
#ifndef GEMV_MAX_WARPS
#define GEMV_MAX_WARPS 16
#endif
// bench A/B only: -DGEMV_MIN_CTAS=c (with GEMV_MAX_WARPS) caps registers for c CTAs an SM
#ifdef GEMV_MIN_CTAS
#define GEMV_LAUNCH_BOUNDS(threads) __launch_bounds__(threads, GEMV_MIN_CTAS)
#else
#define GEMV_LAUNCH_BOUNDS(threads) __launch_bounds__(threads)
#endif
#ifndef GEMV_TRACE
#define GEMV_TRACE 0  // bench builds only: per-CTA timestamps (w4a16_gemv_trace)
#endif
#ifndef GEMV_STAGGER
#define GEMV_STAGGER 0
#endif
// bench A/B only, the output left wrong: -DGEMV_COPIES_ONLY=1 streams the rings as the kernel
// does but computes nothing (one word of each chunk read back): what the copies alone cost;
// -DGEMV_EMPTY=1 returns at once: what launching the grid (its CTAs, shared memory) costs;
// with it, -DGEMV_AB_LAUNCH_SMEM=b launches with b bytes of dynamic shared memory instead;
// -DGEMV_AB_X_ONCE=1 copies x's slab for a warp's first chunk only (the later chunks read what
// their stage's slab holds; the output is wrong): what x's copies cost; -DGEMV_AB_NO_XSUM=1
// leaves out x's group sums (the mma with ones; the zeros' term is then wrong): what they cost
#ifndef GEMV_COPIES_ONLY
#define GEMV_COPIES_ONLY 0
#endif
#ifndef GEMV_EMPTY
#define GEMV_EMPTY 0
#endif
#ifndef GEMV_AB_X_ONCE
#define GEMV_AB_X_ONCE 0
#endif
#ifndef GEMV_AB_NO_XSUM
#define GEMV_AB_NO_XSUM 0
#endif
#if defined(GEMV_AB_LAUNCH_SMEM) && !GEMV_EMPTY
#error "GEMV_AB_LAUNCH_SMEM only for an empty build"
#endif

namespace cg = cooperative_groups;

constexpr bool SPLIT_ROWS = GEMV_SPLIT_ROWS;
constexpr int SLICES = GEMV_SLICES;
constexpr int STAGES = GEMV_STAGES;
constexpr int ROWS = 16 * SLICES;
constexpr int CHUNK = 128;          // K values per chunk
constexpr int XROW = 2 * CHUNK + 16;  // bytes per x row in a stage: padded so ldmatrix's 8 rows hit 8 bank groups
constexpr int MAX_M = 16;  // two n8 tiles
// a column of a warp's partials (splitting K): padded, so that a store of the 32 lanes, whose
// quads' 4 lanes write 4 columns of one row, hits 32 banks
constexpr int PROW = ROWS + 4;
constexpr int MAX_WARPS = GEMV_MAX_WARPS;
static_assert(SLICES == 1 || SLICES == 2 || SLICES == 4, "a warp's rows lie in one 64-row block");
static_assert(STAGES >= 2 && STAGES <= 8, "2..8 stages");

// Trace (GEMV_TRACE=1): per CTA, [smid, globaltimer at start and end, clock64 at start, after
// its setup, when warp 0's first chunk landed, once the warps' partials are in shared memory, at
// the end, then each warp's clock64 when its last chunk was computed].
#if GEMV_TRACE
constexpr int TRACE_CTAS = 1024, TRACE_FIELDS = 8 + MAX_WARPS;
__device__ unsigned long long g_trace[TRACE_CTAS * TRACE_FIELDS];
#endif

enum Stamp { SM_ID, GLOBAL_NS, CLOCK };

// Records `what` now as the CTA's trace field `field` (nothing unless GEMV_TRACE).
__device__ __forceinline__ void stamp(int field, Stamp what) {
#if GEMV_TRACE
  unsigned long long v;
  if (what == SM_ID) {
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    v = s;
  } else if (what == GLOBAL_NS) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(v));
  } else {
    v = clock64();
  }
  if (blockIdx.x < TRACE_CTAS) g_trace[blockIdx.x * TRACE_FIELDS + field] = v;
#endif
}

struct Params {
  const uint16_t* x;
  const uint8_t* w;
  const uint32_t* sz;  // (scale, zero) pairs as one word each
  uint16_t* out;
  long long ldx, ldo;
  int m, n, k;
  int group_shift;  // log2(group size)
  int stage_bytes;  // one warp's stage: weight, (scale, zero) words, x's slab
  int inbox_at;     // (a cluster) the inbox: an mbarrier, then [ranks][a share of the outputs]
  int rank_shift;   // log2 of the cluster's size (1, 2, 4 or 8 CTAs)
  int teams;        // row blocks a CTA (warps splitting K, no cluster; else 1)
  int team_warps;   // warps a team: warps / teams
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// bench A/B only: -DGEMV_AB_L2_PREFETCH=64|128|256 asks the L2 to fetch that many bytes around
// each 16-byte copy (cp.async's prefetch-size hint)
#ifdef GEMV_AB_L2_PREFETCH
#define GEMV_STR2(x) #x
#define GEMV_STR(x) GEMV_STR2(x)
#define GEMV_COPY16 "cp.async.cg.shared.global.L2::" GEMV_STR(GEMV_AB_L2_PREFETCH) "B"
#else
#define GEMV_COPY16 "cp.async.cg.shared.global"
#endif

__device__ __forceinline__ void copy16(uint32_t dst, const void* src, bool valid) {
  asm volatile(GEMV_COPY16 " [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

// x's slab: 16 bytes through the L1 (the weight's copies bypass it), where the SM's other CTAs
// and a CTA's other teams, at the same chunks, find its lines instead of asking the L2 again
__device__ __forceinline__ void copy16_x(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

__device__ __forceinline__ void copy4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }

__device__ __forceinline__ void bar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}

// Waits until the barrier's phase of parity `parity` is complete, acquiring at cluster scope
// (the bytes other CTAs stored into this one and counted on it).
__device__ __forceinline__ void bar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// One arrival on the barrier at `bar`, and `bytes` more that its phase waits for.
__device__ __forceinline__ void bar_expect(uint32_t bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// The address of `addr` (this CTA's shared memory) in the cluster's CTA `rank`.
__device__ __forceinline__ uint32_t at_rank(uint32_t addr, int rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
  return remote;
}

// Stores `v` at `remote` (another CTA's shared memory), counting its 4 bytes on the barrier at
// `remote_bar` there.
__device__ __forceinline__ void store_at(uint32_t remote, float v, uint32_t remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(
                   remote),
               "r"(__float_as_uint(v)), "r"(remote_bar)
               : "memory");
}

// The cluster's size, a power of two: the prologue and the epilogue divide by it several times
// a CTA, as shifts (a division by a runtime value costs tens of instructions).
struct Ranks {
  int n, shift;  // n = 2^shift
  __device__ __forceinline__ int div(int a) const { return a >> shift; }
  // Where rank `r`'s share of a CTA's `outputs` begins (each rank stores its share).
  __device__ __forceinline__ int share_begin(int r, int outputs) const { return div(r * outputs); }
};

template <int PENDING>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

// A warp's part of a stage: its weight slices [ROWS][64 bytes], then the chunk's (scale, zero)
// words [NG][ROWS]; x's slab follows (after the one warp's part, or after every warp's).
template <int NG>
__host__ __device__ constexpr int warp_bytes() {
  return ROWS * 64 + ROWS * 4 * NG;
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}

__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}

__device__ __forceinline__ void ldmatrix4(uint32_t (&d)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(addr));
}

__device__ __forceinline__ uint32_t lop_or_magic(uint32_t v, uint32_t magic) {
  uint32_t d;  // (v & 0x000f000f) | magic
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(d) : "r"(v), "n"(0x000f000f), "r"(magic));
  return d;
}

template <bool F16>
struct Half2Ops;

template <>
struct Half2Ops<false> {  // bf16
  static constexpr uint32_t MAGIC = 0x43004300u;  // 128: magic | q = 128 + q
  static constexpr uint32_t ONES = 0x3f803f80u;
  static constexpr float BIAS = 136.f;  // magic + 8
  __device__ static __forceinline__ float lo(uint32_t v) { return __uint_as_float(v << 16); }
  __device__ static __forceinline__ float hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }
  __device__ static __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ static __forceinline__ uint16_t round(float v) {
    __nv_bfloat16 h = __float2bfloat16_rn(v);
    return *reinterpret_cast<uint16_t*>(&h);
  }
};

template <>
struct Half2Ops<true> {  // fp16
  static constexpr uint32_t MAGIC = 0x64006400u;  // 1024: magic | q = 1024 + q
  static constexpr uint32_t ONES = 0x3c003c00u;
  static constexpr float BIAS = 1032.f;  // magic + 8
  __device__ static __forceinline__ float lo(uint32_t v) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(v & 0xffffu)));
  }
  __device__ static __forceinline__ float hi(uint32_t v) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(v >> 16)));
  }
  __device__ static __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ static __forceinline__ uint16_t round(float v) {
    __half h = __float2half_rn(v);
    return *reinterpret_cast<uint16_t*>(&h);
  }
};

// One lane's share of a ring's copies, chunk after chunk: built once (the addresses that do
// not move, which rows exist), then each `issue` copies the current chunk into a stage and
// moves on by `step` chunks (the warps of its team when they split K, else 1). Each lane copies
// the weight bytes it reads back itself (rows g and g + 8 of each of its warp's slices at 16 t);
// its warp's (scale, zero) words of the chunk's NG groups ([NG][ROWS] words) are shared out over
// the warp, and x's [M, 128] slab (16-byte pieces) over the `x_threads` threads that fill the
// ring.
// FULL: every 64-row block of the weight is whole (N a multiple of 64), the (scale, zero)
// words 16-byte aligned and a group at most a chunk, so every copy has its bytes: one base
// address and fixed offsets for the weight, the words in 16-byte pieces at a fixed step from one
// chunk to the next, none of the per-copy choices (and registers) of a partial last block.
template <int NG, int NT, bool FULL>
struct Copier {
  static constexpr int SZ_COPIES = FULL ? (ROWS * NG / 4 + 31) / 32 : (ROWS * NG + 31) / 32;
  static constexpr int X_COPIES = 8 * NT * 16 / 32;  // rounds when one warp copies the slab
  const uint8_t* w;      // this lane's first weight byte of the current chunk
  int w_step;            // bytes to the next chunk
  const uint32_t* sz;    // this lane's first (scale, zero) word of group 0
  uint32_t n;            // (scale, zero) words per group (the entry point keeps N x groups < 2^31)
  const uint16_t* x;     // this thread's first x piece of the current chunk
  int x_round;           // x elements between two copy rounds (x_threads / 16 rows)
  // FULL (groups of at most a chunk): the lane's first (scale, zero) word of the current chunk,
  // moved by a fixed step; else found from the chunk's index (chunk_shift: log2(group / CHUNK)
  // for groups past a chunk)
  const uint32_t* words;
  long long words_step;  // 64-bit: step x NG x n (or mine x that) can pass 2^31 when a team
                         // has more warps than K has chunks
  int chunk, chunk_step, chunk_shift;
  uint32_t w_valid, sz_valid;           // bit per copy: its rows exist
  int x_rounds;                         // x's copy rounds the thread has a piece in
  bool x_rows_past_one;                 // M needs more than one round (of x_threads / 16 rows)
  uint32_t sz_slots;                    // bit per copy: its word (FULL: piece) lies in the part
  uint32_t lane_w, lane_sz, lane_x;     // this thread's offsets in a stage
  uint32_t w_lane;                      // this lane's bytes into its warp's run of a chunk
  uint32_t x_round_bytes;               // stage bytes between two copy rounds of x
  int left, x_rewind, chunk_rewind;  // (GEMV_STAGGER) copies before the wrap, its moves
  long long w_rewind, words_rewind;   // (bytes: K x 32 for 64-row warps; words)

  // rows, offset: the warp's 64-row block (rows in it) and its first row there; n0: its first
  // row in N; w_at, x_at: its slices' and the slab's offsets in a stage; x_thread of x_threads.
  // (GEMV_STAGGER) mine: its chunks; start: the round it copies first, wrapping to round 0.
  __device__ __forceinline__ Copier(const Params& p, const uint8_t* block, int rows, int offset,
                                    int n0, int first, int step, int mine, int start, int lane,
                                    uint32_t w_at, uint32_t x_at, int x_thread, int x_threads) {
    const int g = lane >> 2, t = lane & 3;
    w_lane = g * 64 + t * 16;
    lane_w = w_at + w_lane;
    w = block + 64ll * (static_cast<long long>(first) * rows + offset) + w_lane;
    w_step = 64 * step * rows;
    w_valid = 0;
#pragma unroll
    for (int h = 0; h < 2 * SLICES; ++h)
      if (offset + 8 * h + g < rows) w_valid |= 1u << h;
    n = static_cast<uint32_t>(p.n);
    sz_valid = sz_slots = 0;
    if constexpr (FULL) {
      // piece q: words 4 q .. 4 q + 3 of the part's [NG][ROWS], group 4 q / ROWS
      sz = p.sz + n0 + 4 * lane % ROWS + static_cast<long long>(4 * lane / ROWS) * p.n;
      lane_sz = w_at + ROWS * 64 + lane * 16;
#pragma unroll
      for (int it = 0; it < SZ_COPIES; ++it)
        if (32 * it + lane < ROWS * NG / 4) sz_slots |= 1u << it;
    } else {
      sz = p.sz + n0 + lane % ROWS + static_cast<long long>(lane / ROWS) * p.n;
      lane_sz = w_at + ROWS * 64 + lane * 4;
#pragma unroll
      for (int it = 0; it < SZ_COPIES; ++it) {
        if (32 * it + lane < ROWS * NG) sz_slots |= 1u << it;
        if (32 * it + lane < ROWS * NG && offset + lane % ROWS + 32 * it % ROWS < rows)
          sz_valid |= 1u << it;
      }
    }
    const int x_row = x_thread >> 4, x_rows = x_threads >> 4;
    x = p.x + x_row * p.ldx + (x_thread & 15) * 8 + static_cast<long long>(first) * CHUNK;
    x_round = x_rows * static_cast<int>(p.ldx);
    lane_x = x_at + x_row * XROW + (x_thread & 15) * 16;
    x_round_bytes = x_rows * XROW;
    x_rounds = x_row < p.m ? (p.m - x_row + x_rows - 1) / x_rows : 0;
    x_rows_past_one = p.m > x_rows;
    chunk = first;
    chunk_step = step;
    chunk_shift = p.group_shift > 7 ? p.group_shift - 7 : 0;
    words = sz + static_cast<long long>(first) * NG * n;
    words_step = static_cast<long long>(step) * NG * n;
    if (GEMV_STAGGER) {
      words_rewind = mine * words_step;
      words += start * words_step;
      w_rewind = static_cast<long long>(mine) * w_step;
      x_rewind = mine * step * CHUNK;
      chunk_rewind = mine * step;
      left = mine - start;
      w += static_cast<long long>(start) * w_step;
      x += start * step * CHUNK;
      chunk += start * step;
    }
  }

  __device__ __forceinline__ void issue(uint32_t stage) {
    const uint32_t* at = FULL ? words : sz + static_cast<uint32_t>((chunk >> chunk_shift) * NG) * n;
    if constexpr (FULL) {
#pragma unroll
      for (int h = 0; h < 2 * SLICES; ++h) copy16(stage + lane_w + h * 512, w + h * 512, true);
#pragma unroll
      for (int it = 0; it < SZ_COPIES; ++it)
        if (!(ROWS * NG / 4 % 32) || sz_slots >> it & 1)
          copy16(stage + lane_sz + it * 512, at + (128 * it / ROWS) * n + 128 * it % ROWS, true);
    } else {
#pragma unroll
      for (int h = 0; h < 2 * SLICES; ++h) {
        const bool valid = w_valid >> h & 1;
        copy16(stage + lane_w + h * 512, valid ? w + h * 512 : w - w_lane, valid);
      }
      // a copy of no bytes still zero-fills its 4: a lane past the part's words (16 rows of
      // one group: lanes 16-31) must not issue one, or it clears the bytes after the part (the
      // next warp's first weight row, or x's slab) while their own copies land
#pragma unroll
      for (int it = 0; it < SZ_COPIES; ++it) {
        if (ROWS * NG % 32 && !(sz_slots >> it & 1)) continue;
        const bool valid = sz_valid >> it & 1;
        copy4(stage + lane_sz + it * 128,
              valid ? at + (32 * it / ROWS) * n + 32 * it % ROWS : sz, valid);
      }
    }
    if (x_rounds > 0) copy16_x(stage + lane_x, x);
    // taken alike by every thread: M past one round of rows (M > 8 always, with two n8 tiles)
    if (NT > 1 || x_rows_past_one) {
      const uint16_t* piece = x;
#pragma unroll
      for (int it = 1; it < X_COPIES; ++it)
        if (piece += x_round, it < x_rounds)
          copy16_x(stage + lane_x + it * x_round_bytes, piece);
    }
    if constexpr (GEMV_AB_X_ONCE) x_rounds = 0;
    w += w_step;
    x += chunk_step * CHUNK;
    words += words_step;
    chunk += chunk_step;
    if (GEMV_STAGGER && --left == 0) {  // past the last round: on to round 0
      w -= w_rewind;
      x -= x_rewind;
      words -= words_rewind;
      chunk -= chunk_rewind;
    }
  }
};

// Adds the chunk of a stage (the warp's part at `part`, x's slab at `x_at`) to the lane's
// accumulators. The tensor cores take the raw magic + q (exact), group by group, and the
// group's scale and zero apply to the dot after it:
// s * (dot - (magic + 8) * X) + z * X = s * dot + (z - (magic + 8) * s) * X, in fp32, where X
// (x's sum over the group) comes from the same B fragments times ones.
//
// A quad's lane t takes, in k16 block j (k = 16 j + ...), the byte pairs (0, 2) and (1, 3) of
// its word j % 4 as the A pairs (2 t, 2 t + 1) and (2 t + 8, 2 t + 9): one lop3 makes a pair
// (the nibbles at bits 0 and 16) in k order, so x's fragments are ldmatrix's as they load.
template <bool F16, int NG, int NT>
__device__ __forceinline__ void compute(const Params& p, uint32_t part, uint32_t x_at, int lane,
                                        float (&acc)[SLICES][NT][4]) {
  if constexpr (GEMV_COPIES_ONLY) {
    acc[0][0][0] += __uint_as_float(lds32(part + lane * 16));
    return;
  }
  using Ops = Half2Ops<F16>;
  constexpr int BLOCKS = 8 / NG;  // k16 blocks per group
  const int g = lane >> 2, t = lane & 3;
  const uint32_t sz_at = part + ROWS * 64;
  // x's B fragments for the chunk's eight k16 blocks, per n8 tile: ldmatrix x4 gives two
  // blocks; lane i points at row i % 8 (of the tile) of matrix i / 8 (block j + i / 16, its k
  // half (i / 8) % 2), so the four registers are blocks j and j + 1's (x[2 t, 2 t + 1],
  // x[2 t + 8, 2 t + 9]) of row g
  uint32_t b[NT][8][2];
  const int mat = lane >> 3;
#pragma unroll
  for (int n8 = 0; n8 < NT; ++n8) {
    const int row = min(8 * n8 + (lane & 7), p.m - 1);
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      uint32_t d[4];
      ldmatrix4(d, x_at + row * XROW + (16 * (j + (mat >> 1)) + 8 * (mat & 1)) * 2);
      b[n8][j][0] = d[0];
      b[n8][j][1] = d[1];
      b[n8][j + 1][0] = d[2];
      b[n8][j + 1][1] = d[3];
    }
  }
  // X: x's sum over each group, for the columns 2 t, 2 t + 1 of each n8 tile
  float xsum[NG][NT][2];
  const uint32_t ones[4] = {Ops::ONES, Ops::ONES, Ops::ONES, Ops::ONES};
#pragma unroll
  for (int i = 0; i < NG; ++i)
#pragma unroll
    for (int n8 = 0; n8 < NT; ++n8) {
      float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = i * BLOCKS; j < (i + 1) * BLOCKS; ++j)
        if constexpr (!GEMV_AB_NO_XSUM) Ops::mma(c, ones, b[n8][j][0], b[n8][j][1]);
      xsum[i][n8][0] = c[0];
      xsum[i][n8][1] = c[1];
    }
#pragma unroll
  for (int s = 0; s < SLICES; ++s) {
    const uint4 lo = lds128(part + (16 * s + g) * 64 + t * 16);      // row g
    const uint4 hi = lds128(part + (16 * s + g + 8) * 64 + t * 16);  // row g + 8
    const uint32_t wl[4] = {lo.x, lo.y, lo.z, lo.w};
    const uint32_t wh[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int i = 0; i < NG; ++i) {
      const uint32_t zs_g = lds32(sz_at + (i * ROWS + 16 * s + g) * 4);
      const uint32_t zs_h = lds32(sz_at + (i * ROWS + 16 * s + g + 8) * 4);
      const float sc[2] = {Ops::lo(zs_g), Ops::lo(zs_h)};  // rows g, g + 8
      const float zc[2] = {fmaf(-Ops::BIAS, sc[0], Ops::hi(zs_g)),
                           fmaf(-Ops::BIAS, sc[1], Ops::hi(zs_h))};
      float dot[NT][4] = {};
#pragma unroll
      for (int j = i * BLOCKS; j < (i + 1) * BLOCKS; ++j) {
        const int shift = j < 4 ? 0 : 4;
        const uint32_t vl = wl[j & 3] >> shift;
        const uint32_t vh = wh[j & 3] >> shift;
        uint32_t a[4];
        a[0] = lop_or_magic(vl, Ops::MAGIC);          // row g: bytes 0, 2
        a[1] = lop_or_magic(vh, Ops::MAGIC);          // row g + 8
        a[2] = lop_or_magic(vl >> 8, Ops::MAGIC);  // row g: bytes 1, 3
        a[3] = lop_or_magic(vh >> 8, Ops::MAGIC);
#pragma unroll
        for (int n8 = 0; n8 < NT; ++n8) Ops::mma(dot[n8], a, b[n8][j][0], b[n8][j][1]);
      }
#pragma unroll
      for (int n8 = 0; n8 < NT; ++n8)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float v = fmaf(sc[e >> 1], dot[n8][e], acc[s][n8][e]);
          acc[s][n8][e] = fmaf(zc[e >> 1], xsum[i][n8][e & 1], v);
        }
    }
  }
}

// 64-row warps over two n8 tiles need more than 128 registers a thread: at most 8 warps a CTA
// (bench A/B only: -DGEMV_WIDE_WARPS=w, up to w such warps, their registers capped to fit)
#ifndef GEMV_WIDE_WARPS
#define GEMV_WIDE_WARPS 8
#endif
template <int NT>
constexpr int max_warps() {
  return SLICES * NT > 4 && MAX_WARPS > GEMV_WIDE_WARPS ? GEMV_WIDE_WARPS : MAX_WARPS;
}

// TEAMED: the build for more than one row block a CTA (its own instance, so that the build for
// one computes nothing of teams)
template <bool F16, int NG, int NT, bool FULL, bool TEAMED>
__global__ void GEMV_LAUNCH_BOUNDS(max_warps<NT>() * 32) w4a16_gemv_kernel(Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  if constexpr (GEMV_EMPTY) return;
  if (threadIdx.x == 0) {
    stamp(3, CLOCK);
    stamp(1, GLOBAL_NS);
    stamp(0, SM_ID);
  }
  cg::cluster_group cluster = cg::this_cluster();
  const Ranks ranks_of{static_cast<int>(cluster.num_blocks()), p.rank_shift};
  const int ranks = ranks_of.n;
  const int rank = static_cast<int>(cluster.block_rank());
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // (a cluster) the inbox's barrier waits for the other ranks' sums of this rank's share
  if (ranks > 1) {
    if (threadIdx.x == 0) {
      const int outputs = (SPLIT_ROWS ? warps * ROWS : ROWS) * p.m;
      const int mine =
          ranks_of.share_begin(rank + 1, outputs) - ranks_of.share_begin(rank, outputs);
      bar_init(smem_addr(smem) + p.inbox_at, 1);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
      bar_expect(smem_addr(smem) + p.inbox_at, (ranks - 1) * mine * 4);
    }
    // waited for only before the pushes, long after
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::);
  }

  const int cta_rows = SPLIT_ROWS ? warps * ROWS : ROWS;
  // the warp's team (its row block) and its place among the team's kwarps warps
  const int kwarps = TEAMED ? p.team_warps : warps, teams = TEAMED ? p.teams : 1;
  const int team = TEAMED ? warp / kwarps : 0, kwarp = warp - team * kwarps;
  const int first_block = ranks_of.div(blockIdx.x) * teams;
  const int row_block = first_block + team;
  const int n0 = row_block * cta_rows;
  // the warp's first row; a warp of the last CTA may lie wholly past N: its copies read in
  // bounds (row 0's bytes; none at all in the build for partial blocks) and nothing of it is
  // stored (a team wholly past N copies nothing)
  const int warp_n0 = SPLIT_ROWS ? n0 + warp * ROWS : n0;
  const bool live = warp_n0 < p.n;
  const int first_row = live ? warp_n0 / 64 * 64 : 0;  // of the warp's 64-row block
  const int rows = live ? min(64, p.n - first_row) : 0;
  const int offset = live ? warp_n0 - first_row : 0;
  const uint8_t* block = p.w + static_cast<long long>(first_row) * (p.k / 2);

  const int chunks = p.k / CHUNK;
  const int c_lo = ranks_of.div(rank * chunks), c_hi = ranks_of.div((rank + 1) * chunks);
  // splitting K, the warp takes chunks c_lo + kwarp, + kwarps, ... (its place in its team, the
  // team's warps); splitting rows, all of them
  const int first = SPLIT_ROWS ? c_lo : c_lo + kwarp, step = SPLIT_ROWS ? 1 : kwarps;
  const bool idle = TEAMED && !live;
  const int mine = !idle && first < c_hi ? (c_hi - first + step - 1) / step : 0;

  // a ring per warp (its part, then x's slab), or one per CTA (every warp's part, then the slab)
  const uint32_t ring = smem_addr(smem) + (SPLIT_ROWS ? 0 : warp * STAGES * p.stage_bytes);
  const uint32_t part_at = SPLIT_ROWS ? warp * warp_bytes<NG>() : 0;
  const uint32_t x_at = (SPLIT_ROWS ? warps : 1) * warp_bytes<NG>();
  // (GEMV_STAGGER) CTAs of neighbouring row blocks start at different rounds, so they do not all
  // ask the L2 for the same x lines at once
  const int start = GEMV_STAGGER && mine > 0 ? row_block % mine : 0;
  Copier<NG, NT, FULL> copier(p, block, rows, offset, first_row + offset, first, step, mine,
                              start, lane, part_at, x_at, SPLIT_ROWS ? threadIdx.x : lane,
                              SPLIT_ROWS ? blockDim.x : 32);
  float acc[SLICES][NT][4] = {};
  if (threadIdx.x == 0) stamp(4, CLOCK);
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < mine) copier.issue(ring + i * p.stage_bytes);
    commit();
  }
  int slot = 0, next = STAGES - 1;  // the stage computed, the stage filled
  for (int i = 0; i < mine; ++i) {
    const uint32_t stage = ring + slot * p.stage_bytes;
    if constexpr (SPLIT_ROWS) {
      // the slab is copied by other warps: one barrier a chunk, after this thread's copies of
      // chunk i landed, both publishes chunk i and frees the stage chunk i - 1 took
      wait_copies<STAGES - 2>();
      __syncthreads();
      if (i + STAGES - 1 < mine) copier.issue(ring + next * p.stage_bytes);
      commit();
      if (i == 0 && threadIdx.x == 0) stamp(5, CLOCK);
      compute<F16, NG, NT>(p, stage + part_at, stage + x_at, lane, acc);
    } else {
      if (i + STAGES - 1 < mine) copier.issue(ring + next * p.stage_bytes);
      commit();
      wait_copies<STAGES - 1>();
      __syncwarp();
      if (i == 0 && threadIdx.x == 0) stamp(5, CLOCK);
      compute<F16, NG, NT>(p, stage, stage + x_at, lane, acc);
      __syncwarp();
    }
    if constexpr (STAGES == 2) {  // the two stages trade places
      slot ^= 1;
      next ^= 1;
    } else {
      slot = slot + 1 == STAGES ? 0 : slot + 1;
      next = next + 1 == STAGES ? 0 : next + 1;
    }
  }
  if (lane == 0) stamp(8 + warp, CLOCK);
  asm volatile("cp.async.wait_all;\n" ::);
  // the next kernel may launch once every CTA got here (it waits for this grid's writes itself)
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

  // Splitting K, each warp's partials [M][PROW] lie in its own ring, which no other warp reads:
  // a warp done early stores them while the others still stream. They are summed in warp order
  // (a team's warps next to each other), a team's into its row block's outputs (or, in a
  // cluster, into the CTA's sums [M][ROWS], past warp 0's partials). Splitting rows, the ring is
  // the CTA's: once every warp is done with it, each warp's rows of the sums [M][cta_rows].
  if constexpr (SPLIT_ROWS) __syncthreads();
  const int g = lane >> 2, t = lane & 3, m = p.m;
  const int outputs = cta_rows * m;
  const auto part_of = [&](int w) {
    return reinterpret_cast<float*>(smem + w * STAGES * p.stage_bytes);
  };
  // (a warp's ring, two stages of at least ROWS x 64 + M x 272 bytes, holds its partials and
  // the sums: 4 M (PROW + ROWS) bytes, M <= 16)
  float* sums = SPLIT_ROWS ? reinterpret_cast<float*>(smem) : part_of(0) + m * PROW;
  float* mine_at = SPLIT_ROWS ? sums + warp * ROWS : part_of(warp);
  const int col_stride = SPLIT_ROWS ? cta_rows : PROW;
#pragma unroll
  for (int s = 0; s < SLICES; ++s)
#pragma unroll
    for (int n8 = 0; n8 < NT; ++n8)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = 16 * s + g + 8 * (e >> 1), col = 8 * n8 + 2 * t + (e & 1);
        if (col < m) mine_at[col * col_stride + row] = acc[s][n8][e];
      }
  // output q of a row block's [M][cta_rows], the block's first row at `base`
  const auto store = [&](int q, float v, int base) {
    const int col = q / cta_rows, row = q % cta_rows;
    if (base + row < p.n) p.out[col * p.ldo + base + row] = Half2Ops<F16>::round(v);
  };
  // splitting K without a cluster, an output is stored as soon as its warps' partials are summed
  // (each team's, in warp order). 64-row warps: by the team's own warps, four outputs a thread
  // at a time; 32-row ones one output a thread over the CTA's (the four-at-a-time code there
  // costs the K loop registers, which ptxas then rebuilds each chunk: more than it saves)
  const bool stored_here = !SPLIT_ROWS && ranks == 1;
  if constexpr (!SPLIT_ROWS) {
    __syncthreads();
    if (threadIdx.x == 0) stamp(6, CLOCK);
  }
  if constexpr (!SPLIT_ROWS && SLICES < 4) {
    for (int tq = threadIdx.x; tq < teams * outputs; tq += blockDim.x) {
      const int t = TEAMED ? tq / outputs : 0, q = tq - t * outputs;
      float v = 0.f;
      for (int w = 0; w < kwarps; ++w) v += part_of(t * kwarps + w)[q / ROWS * PROW + q % ROWS];
      if (stored_here)
        store(q, v, (first_block + t) * cta_rows);
      else
        sums[q] = v;
    }
  } else if constexpr (!SPLIT_ROWS) {
    // outputs q .. q + 3 (one column's rows: a row block's rows are a multiple of 16), as one
    // 8-byte store where `out` and its row stride allow
    const bool out_by_8 = reinterpret_cast<uintptr_t>(p.out) % 8 == 0 && p.ldo % 4 == 0;
    const auto store4 = [&](int q, float4 v, int base) {
      const int col = q / cta_rows, n = base + q % cta_rows;
      uint16_t* at = p.out + col * p.ldo + n;
      const uint16_t h[4] = {Half2Ops<F16>::round(v.x), Half2Ops<F16>::round(v.y),
                             Half2Ops<F16>::round(v.z), Half2Ops<F16>::round(v.w)};
      if (out_by_8 && n + 3 < p.n) {
        *reinterpret_cast<uint2*>(at) = make_uint2(h[0] | static_cast<uint32_t>(h[1]) << 16,
                                                   h[2] | static_cast<uint32_t>(h[3]) << 16);
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if (n + i < p.n) at[i] = h[i];
      }
    };
    const int quads = outputs / 4;
    for (int qq = kwarp * 32 + lane; qq < quads; qq += kwarps * 32) {
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      const int at = qq / (ROWS / 4) * PROW + qq % (ROWS / 4) * 4;  // of a warp's partials
      for (int w = 0; w < kwarps; ++w) {
        const float4 u = *reinterpret_cast<const float4*>(part_of(team * kwarps + w) + at);
        v.x += u.x;
        v.y += u.y;
        v.z += u.z;
        v.w += u.w;
      }
      if (stored_here)
        store4(4 * qq, v, (first_block + team) * cta_rows);
      else
        reinterpret_cast<float4*>(sums)[qq] = v;
    }
  }
  if (!stored_here) {
    __syncthreads();  // the CTA's sums written
    if (SPLIT_ROWS && threadIdx.x == 0) stamp(6, CLOCK);
    const uint32_t inbox_bar = smem_addr(smem) + p.inbox_at;
    float* inbox = reinterpret_cast<float*>(smem + p.inbox_at + 8);  // [sender][share]
    const int share = ranks_of.div(outputs + ranks - 1);
    const auto q_lo = [&](int r) { return ranks_of.share_begin(r, outputs); };
    if (ranks > 1) {
      asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");  // every inbox made
      for (int r = 0; r < ranks; ++r) {
        if (r == rank) continue;
        const uint32_t to = at_rank(smem_addr(inbox + rank * share - q_lo(r)), r);
        const uint32_t bar = at_rank(inbox_bar, r);
        for (int q = q_lo(r) + threadIdx.x; q < q_lo(r + 1); q += blockDim.x)
          store_at(to + q * 4, sums[q], bar);
      }
      bar_wait(inbox_bar, 0);
    }
    for (int q = q_lo(rank) + threadIdx.x; q < q_lo(rank + 1); q += blockDim.x) {
      float v = 0.f;
      for (int r = 0; r < ranks; ++r) v += r == rank ? sums[q] : inbox[r * share + q - q_lo(rank)];
      store(q, v, n0);
    }
  }
  if (threadIdx.x == 0) {
    stamp(7, CLOCK);
    stamp(2, GLOBAL_NS);
  }
}

namespace {

// One stage of a ring: the warps' parts (one, or all `warps` when they split rows), x's slab.
int stage_bytes(int m, int group, int warps) {
  const int ng = group < CHUNK ? CHUNK / group : 1;
  const int bytes = (SPLIT_ROWS ? warps : 1) * (ROWS * 64 + ROWS * 4 * ng) + m * XROW;
  return (bytes + 127) / 128 * 128;
}

// The rings (one per warp, or the CTA's): splitting K, the warps' partials and their sum lie in
// them; splitting rows, the sums (warps x ROWS x M floats) after them where larger.
int inbox_at(int m, int group, int warps) {
  const int ring = (SPLIT_ROWS ? 1 : warps) * STAGES * stage_bytes(m, group, warps);
  const int reduce = SPLIT_ROWS ? warps * ROWS * m * 4 : 0;
  return ring > reduce ? ring : reduce;
}

// Then, in a cluster, the inbox: an mbarrier and a share of the outputs from each rank.
int smem_bytes(int m, int group, int warps, int cluster) {
  const int outputs = (SPLIT_ROWS ? warps * ROWS : ROWS) * m;
  const int inbox = cluster > 1 ? 8 + cluster * ((outputs + cluster - 1) / cluster) * 4 : 0;
  return inbox_at(m, group, warps) + inbox;
}

template <bool F16, int NG, int NT, bool FULL, bool TEAMED>
cudaError_t launch(const Params& p, int warps, int cluster, int carveout, cudaStream_t stream) {
  if (warps > max_warps<NT>()) return cudaErrorInvalidValue;
#ifdef GEMV_AB_LAUNCH_SMEM
  const int smem = GEMV_AB_LAUNCH_SMEM;
#else
  const int smem = smem_bytes(p.m, CHUNK / NG, warps, cluster);
#endif
  const int cta_rows = SPLIT_ROWS ? warps * ROWS : ROWS;
  const int blocks = (p.n + cta_rows - 1) / cta_rows;
  const unsigned ctas = static_cast<unsigned>((blocks + p.teams - 1) / p.teams * cluster);
  return gemv::launch_carved<w4a16_gemv_kernel<F16, NG, NT, FULL, TEAMED>, false>(
      ctas, static_cast<unsigned>(warps * 32), smem, cluster, carveout, stream, p);
}

// FULL where every 64-row block is whole, the (scale, zero) words can be copied 16 bytes at a
// time and a chunk's words follow the last chunk's at a fixed step (a group of at most a chunk)
template <bool F16, int NG, int NT, bool TEAMED>
cudaError_t launch_blocks(const Params& p, int warps, int cluster, int carveout, cudaStream_t s) {
  const bool full = p.n % 64 == 0 && reinterpret_cast<uintptr_t>(p.sz) % 16 == 0 &&
                    p.group_shift <= 7;
  return full ? launch<F16, NG, NT, true, TEAMED>(p, warps, cluster, carveout, s)
              : launch<F16, NG, NT, false, TEAMED>(p, warps, cluster, carveout, s);
}

template <bool F16, int NT, bool TEAMED = false>
cudaError_t launch_group(const Params& p, int group, int warps, int cluster, int carveout,
                         cudaStream_t s) {
  if (group == 32) return launch_blocks<F16, 4, NT, TEAMED>(p, warps, cluster, carveout, s);
  if (group == 64) return launch_blocks<F16, 2, NT, TEAMED>(p, warps, cluster, carveout, s);
  return launch_blocks<F16, 1, NT, TEAMED>(p, warps, cluster, carveout, s);
}

// teams (the entry point allows them at M <= 8, warps splitting K) have a build of one n8 tile
template <bool F16>
cudaError_t launch_tiles(const Params& p, int group, int warps, int cluster, int carveout,
                         cudaStream_t s) {
  if constexpr (!SPLIT_ROWS)
    if (p.teams > 1) return launch_group<F16, 1, true>(p, group, warps, cluster, carveout, s);
  return p.m > 8 ? launch_group<F16, 2>(p, group, warps, cluster, carveout, s)
                 : launch_group<F16, 1>(p, group, warps, cluster, carveout, s);
}

}  // namespace

extern "C" {

// This library's compile-time config: warps split rows (1) or K (0), slices (16-row) per warp,
// stages, staggered starts (1) or not (0).
void w4a16_gemv_config(int* split_rows, int* slices, int* stages, int* stagger) {
  *split_rows = SPLIT_ROWS;
  *slices = SLICES;
  *stages = STAGES;
  *stagger = GEMV_STAGGER;
}

// Shared memory one launch takes (bytes), for a caller that checks the device's limit first.
int w4a16_gemv_smem(int m, int group, int warps, int cluster) {
  return smem_bytes(m, group, warps, cluster);
}

// out[m, ldo] (x's dtype) = x[m, ldx] @ dequant(w, sz).T; returns a cudaError_t. The caller
// checks the operands (tuner/candidates/cuda_w4a16.py); this refuses what would read or write
// out of bounds: m outside 1..MAX_M, K not whole chunks, a group size other than 32, 64,
// 128, 256 that divides K, N x K / group (scale, zero) words past 32-bit indices, warps outside
// 1..MAX_WARPS (1..8 for 64-row warps at M > 8), a cluster other than 1, 2, 4 or 8, or one
// wider than K's chunks, teams that do not divide the warps (or more than one team where warps
// split rows, a cluster splits K or M > 8), a carveout other than -1 (the driver's) or a
// percent 0..100 of the SM's most shared memory, x's row stride past 32-bit offsets between
// copy rounds, x or w not 16-byte aligned.
int w4a16_gemv(const void* x, const void* w, const void* sz, void* out, int m, int n, int k,
               int group, long long ldx, long long ldo, int f16, int warps, int cluster,
               int teams, int carveout, void* stream) {
  const bool group_ok = (group == 32 || group == 64 || group == 128 || group == 256) && k % group == 0;
  const bool words_ok = group_ok && static_cast<long long>(n) * (k / group) < (1ll << 31);
  if (m < 1 || m > MAX_M || n < 1 || k < CHUNK || k % CHUNK || !words_ok || warps < 1 ||
      warps > MAX_WARPS || cluster < 1 || cluster > 8 || cluster & (cluster - 1) ||
      cluster > k / CHUNK || ldx % 8 || teams < 1 || warps % teams ||
      (teams > 1 && (SPLIT_ROWS || cluster > 1 || m > 8)) || carveout < -1 || carveout > 100 ||
      ldx >= (1ll << 31) / (2 * MAX_WARPS) ||
      ldo < n || reinterpret_cast<uintptr_t>(x) % 16 || reinterpret_cast<uintptr_t>(w) % 16 ||
      reinterpret_cast<uintptr_t>(sz) % 4)
    return static_cast<int>(cudaErrorInvalidValue);
  Params p;
  p.x = static_cast<const uint16_t*>(x);
  p.w = static_cast<const uint8_t*>(w);
  p.sz = static_cast<const uint32_t*>(sz);
  p.out = static_cast<uint16_t*>(out);
  p.ldx = ldx;
  p.ldo = ldo;
  p.m = m;
  p.n = n;
  p.k = k;
  p.group_shift = __builtin_ctz(static_cast<unsigned>(group));
  p.stage_bytes = stage_bytes(m, group, warps);
  p.inbox_at = inbox_at(m, group, warps);
  p.rank_shift = __builtin_ctz(static_cast<unsigned>(cluster));
  p.teams = teams;
  p.team_warps = warps / teams;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return static_cast<int>(f16 ? launch_tiles<true>(p, group, warps, cluster, carveout, s)
                              : launch_tiles<false>(p, group, warps, cluster, carveout, s));
}

#if GEMV_TRACE
// The trace's shape (CTAs, fields a CTA), then its words of the last launch copied to `host`.
void w4a16_gemv_trace_shape(int* ctas, int* fields) {
  *ctas = TRACE_CTAS;
  *fields = TRACE_FIELDS;
}

int w4a16_gemv_trace(void* host) {
  return static_cast<int>(cudaMemcpyFromSymbol(host, g_trace, sizeof(g_trace)));
}
#endif

}  // extern "C"

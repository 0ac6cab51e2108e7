// INT4 weight-only decode GEMM (W4A16, M <= 16): out[M, N] = x[M, K] @ dequant(w)[N, K]^T.
//
// GEMV-style: a warp owns ROWS = 16 * SLICES weight rows. Three modes (one per library):
// - K (GEMV_SPLIT_ROWS=0), M <= 8: a CTA owns one warp's rows and a run of K (all of it, or 1 / C
//   of it in a cluster of C CTAs); its warps take interleaved 128-value chunks of the run, each
//   from its own copy ring in shared memory, and their [ROWS, M] partials are summed in shared
//   memory in warp order;
// - rows (GEMV_SPLIT_ROWS=1), M <= 8: the CTA's rows are `warps` x ROWS, every warp takes every
//   chunk of the run from one ring the CTA shares, so x's [M, 128] slab of a chunk is copied once
//   per CTA instead of once per warp (x's bytes per weight byte: 4 M / (warps x ROWS));
//   in a cluster, the CTAs' sums are read through distributed shared memory in rank order;
// - registers (GEMV_REGS=1), M <= 16: a CTA owns `groups` x ROWS rows and 1 / `splits` of K; x's
//   [M, K / splits] run is copied into shared memory once, at the start; the warps split the rows
//   into `groups` and K into warps / groups interleaved chunks, and each lane loads the weight
//   bytes and (scale, zero) words it uses straight into registers, STAGES chunks ahead (a ring
//   of registers: no shared memory, no copy instructions per chunk besides the loads). The
//   warps' partials are summed in shared memory in warp order; with splits > 1 each CTA writes
//   its fp32 sums to a workspace, and the last CTA of a row block to arrive (an arrival count
//   per row block) sums them in split order, stores the output and sets the count back to zero
//   for the next launch (no memset per call: a CUDA graph replays it as is).
// Every sum is in a fixed order: the result is deterministic.
//
// The weight is our packed layout (tuner/quant/int4.py): 64-row blocks, a block's K chunk one
// contiguous [r rows x 64 bytes] run, and in each row's 64 bytes the 16 at 16 t hold the 32
// values lane t of a quad owns in mma.m16n8k16's A fragment (k = 16 j + 2 t + {0, 1, 8, 9} for
// the eight k16 blocks j: byte pairs of word j % 4, low nibbles for j < 4, high ones above).
// So a warp's 16-row slice of a chunk is 1 KB, and lane (g, t) needs the 16 bytes of rows g and
// g + 8 at 16 t: the same bytes it copies (or loads). Scales and zeros: torch's [K / group, N, 2].
//
// K and rows modes: a ring of STAGES chunks in shared memory (per warp, or per CTA when warps
// split rows) filled by cp.async (weight slices, the chunk's (scale, zero) words, x's [M, 128]
// slab), STAGES - 1 in flight while one is computed.
// A nibble q becomes a 16-bit float by the magic-number trick (q | magic = magic + q, exact),
// then (v - (magic + 8)) * scale + zero (one exact subtract, one rounding fma), the same values
// as the Triton kernel; x is the mma's B operand (ldmatrix from the slab; rows past M read row
// M - 1 and only produce output columns that are never stored).
//
// x's M rows are one n8 tile of the mma (M <= 8), or two (registers mode, M <= 16).
//
// One shared library per (mode, SLICES, STAGES): -DGEMV_SPLIT_ROWS=0|1 (warps split K or rows),
// -DGEMV_REGS=1 (registers mode), -DGEMV_SLICES=1|2|4 (16-row slices per warp),
// -DGEMV_STAGES=2..8; warps per CTA, the cluster size, row groups and K splits are launch
// arguments.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#ifndef GEMV_SPLIT_ROWS
#define GEMV_SPLIT_ROWS 0
#endif
#ifndef GEMV_REGS
#define GEMV_REGS 0
#endif
#ifndef GEMV_SLICES
#define GEMV_SLICES 1
#endif
#ifndef GEMV_STAGES
#define GEMV_STAGES 4
#endif

namespace cg = cooperative_groups;

constexpr bool SPLIT_ROWS = GEMV_SPLIT_ROWS;
constexpr bool REGS = GEMV_REGS;
constexpr int SLICES = GEMV_SLICES;
constexpr int STAGES = GEMV_STAGES;
constexpr int ROWS = 16 * SLICES;
constexpr int CHUNK = 128;          // K values per chunk
constexpr int XROW = 2 * CHUNK + 16;  // bytes per x row in a stage: padded so ldmatrix's 8 rows hit 8 bank groups
constexpr int SLAB_M = 8;  // K and rows modes: one n8 tile
constexpr int MAX_M = REGS ? 16 : SLAB_M;
constexpr int MAX_WARPS = 16;
constexpr int MAX_SPLITS = 16;
constexpr int MAX_DEVICES = 64;
static_assert(SLICES == 1 || SLICES == 2 || SLICES == 4, "a warp's rows lie in one 64-row block");
static_assert(STAGES >= 2 && STAGES <= 8, "2..8 stages");
static_assert(!(REGS && SPLIT_ROWS), "the registers mode splits K over a CTA's warps");

struct Params {
  const uint16_t* x;
  const uint8_t* w;
  const uint32_t* sz;  // (scale, zero) pairs as one word each
  uint16_t* out;
  long long ldx, ldo;
  int m, n, k;
  int group_shift;  // log2(group size)
  int stage_bytes;  // one warp's stage: weight, (scale, zero) words, x's slab
  int groups;       // registers mode: row groups of ROWS rows per CTA
  float* ws;        // registers mode, splits > 1: [splits][row blocks][M][groups * ROWS] sums
  int* counts;      // registers mode, splits > 1: arrivals per row block, zero between launches
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void copy16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void copy4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }

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

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
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
// moves on by `step` chunks (the warps when they split K, else 1). Each lane copies the weight
// bytes it reads back itself (rows g and g + 8 of each of its warp's slices at 16 t); its warp's
// (scale, zero) words of the chunk's NG groups ([NG][ROWS] words) are shared out over the warp,
// and x's [M, 128] slab (16-byte pieces) over the `x_threads` threads that fill the ring.
template <int NG>
struct Copier {
  static constexpr int SZ_COPIES = (ROWS * NG + 31) / 32;
  static constexpr int X_COPIES = SLAB_M * 16 / 32;  // rounds when one warp copies the slab
  const uint8_t* w;      // this lane's first weight byte of the current chunk
  long long w_step;      // bytes to the next chunk
  const uint32_t* sz;    // this lane's first (scale, zero) word of the chunk's first group
  long long n;           // (scale, zero) words per group
  const uint16_t* x;     // this thread's first x piece of the current chunk
  long long x_round;     // x elements between two copy rounds (x_threads / 16 rows)
  int chunk, chunk_step, group_shift;
  uint32_t w_valid, sz_valid, x_valid;  // bit per copy: its rows exist
  uint32_t sz_slots;                    // bit per copy: its word lies in the part (lane < ROWS * NG)
  uint32_t lane_w, lane_sz, lane_x;     // this thread's offsets in a stage
  uint32_t w_lane;                      // this lane's bytes into its warp's run of a chunk
  uint32_t x_round_bytes;               // stage bytes between two copy rounds of x

  // rows, offset: the warp's 64-row block (rows in it) and its first row there; n0: its first
  // row in N; w_at, x_at: its slices' and the slab's offsets in a stage; x_thread of x_threads.
  __device__ __forceinline__ Copier(const Params& p, const uint8_t* block, int rows, int offset,
                                    int n0, int first, int step, int lane, uint32_t w_at,
                                    uint32_t x_at, int x_thread, int x_threads) {
    const int g = lane >> 2, t = lane & 3;
    w_lane = g * 64 + t * 16;
    lane_w = w_at + w_lane;
    w = block + 64ll * (static_cast<long long>(first) * rows + offset) + w_lane;
    w_step = 64ll * step * rows;
    w_valid = 0;
#pragma unroll
    for (int h = 0; h < 2 * SLICES; ++h)
      if (offset + 8 * h + g < rows) w_valid |= 1u << h;
    n = p.n;
    sz = p.sz + n0 + lane % ROWS + static_cast<long long>(lane / ROWS) * p.n;
    lane_sz = w_at + ROWS * 64 + lane * 4;
    sz_valid = sz_slots = 0;
#pragma unroll
    for (int it = 0; it < SZ_COPIES; ++it) {
      if (32 * it + lane < ROWS * NG) sz_slots |= 1u << it;
      if (32 * it + lane < ROWS * NG && offset + lane % ROWS + 32 * it % ROWS < rows)
        sz_valid |= 1u << it;
    }
    const int x_row = x_thread >> 4, x_rows = x_threads >> 4;
    x = p.x + x_row * p.ldx + (x_thread & 15) * 8 + static_cast<long long>(first) * CHUNK;
    x_round = x_rows * p.ldx;
    lane_x = x_at + x_row * XROW + (x_thread & 15) * 16;
    x_round_bytes = x_rows * XROW;
    x_valid = 0;
#pragma unroll
    for (int it = 0; it < X_COPIES; ++it)
      if (x_row + it * x_rows < p.m) x_valid |= 1u << it;
    chunk = first;
    chunk_step = step;
    group_shift = p.group_shift;
  }

  __device__ __forceinline__ void issue(uint32_t stage) {
#pragma unroll
    for (int h = 0; h < 2 * SLICES; ++h) {
      const bool valid = w_valid >> h & 1;
      copy16(stage + lane_w + h * 512, valid ? w + h * 512 : w - w_lane, valid);
    }
    const uint32_t* words = sz + ((static_cast<long long>(chunk) * CHUNK) >> group_shift) * n;
    // a copy of no bytes still zero-fills its 4: a lane past the part's words (16 rows of one
    // group: lanes 16-31) must not issue one, or it clears the bytes after the part (the next
    // warp's first weight row, or x's slab) while their own copies land
#pragma unroll
    for (int it = 0; it < SZ_COPIES; ++it) {
      if (ROWS * NG % 32 && !(sz_slots >> it & 1)) continue;
      const bool valid = sz_valid >> it & 1;
      copy4(stage + lane_sz + it * 128, valid ? words + (32 * it / ROWS) * n + 32 * it % ROWS : sz,
            valid);
    }
#pragma unroll
    for (int it = 0; it < X_COPIES; ++it)
      if (x_valid >> it & 1) copy16(stage + lane_x + it * x_round_bytes, x + it * x_round, true);
    w += w_step;
    x += chunk_step * CHUNK;
    chunk += chunk_step;
  }
};

// Adds the chunk of a stage (the warp's part at `part`, x's slab at `x_at`) to the lane's
// accumulators. The tensor cores take the raw magic + q (exact), group by group, and the
// group's scale and zero apply to the dot after it:
// s * (dot - (magic + 8) * X) + z * X = s * dot + (z - (magic + 8) * s) * X, in fp32, where X
// (x's sum over the group) comes from the same B fragments times ones.
//
// Which mma k label holds which value: a quad's lane t takes, in k16 block j (k = 16 j + ...),
// the byte pairs (0, 2) and (1, 3) of its word j % 4 as the A pairs (2 t, 2 t + 1) and
// (2 t + 8, 2 t + 9), i.e. true k (2 t, 2 t + 8) and (2 t + 1, 2 t + 9): one lop3 makes a pair
// (the nibbles at bits 0 and 16), with no byte permute. x's fragments, loaded by ldmatrix in
// true order, are permuted to match (two prmt a block, shared by every slice).
template <bool F16, int NG>
__device__ __forceinline__ void compute(const Params& p, uint32_t part, uint32_t x_at, int lane,
                                        float (&acc)[SLICES][4]) {
  using Ops = Half2Ops<F16>;
  constexpr int BLOCKS = 8 / NG;  // k16 blocks per group
  const int g = lane >> 2, t = lane & 3;
  const uint32_t sz_at = part + ROWS * 64;
  // x's B fragments for the chunk's eight k16 blocks: ldmatrix x4 gives two blocks; lane i
  // points at row i % 8 (of the n8 tile) of matrix i / 8 (block 2 * (i / 16) + its half)
  uint32_t b[8][2];
  const int row = min(lane & 7, p.m - 1);
  const int mat = lane >> 3;
#pragma unroll
  for (int j = 0; j < 8; j += 2) {
    uint32_t d[4];
    ldmatrix4(d, x_at + row * XROW + (16 * (j + (mat >> 1)) + 8 * (mat & 1)) * 2);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      b[j + h][0] = prmt(d[2 * h], d[2 * h + 1], 0x5410);  // x[2 t], x[2 t + 8]
      b[j + h][1] = prmt(d[2 * h], d[2 * h + 1], 0x7632);  // x[2 t + 1], x[2 t + 9]
    }
  }
  // X: x's sum over each group, for the columns 2 t, 2 t + 1 of the n8 tile
  float xsum[NG][2];
  const uint32_t ones[4] = {Ops::ONES, Ops::ONES, Ops::ONES, Ops::ONES};
#pragma unroll
  for (int i = 0; i < NG; ++i) {
    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = i * BLOCKS; j < (i + 1) * BLOCKS; ++j) Ops::mma(c, ones, b[j][0], b[j][1]);
    xsum[i][0] = c[0];
    xsum[i][1] = c[1];
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
      float dot[4] = {};
#pragma unroll
      for (int j = i * BLOCKS; j < (i + 1) * BLOCKS; ++j) {
        const int shift = j < 4 ? 0 : 4;
        const uint32_t vl = wl[j & 3] >> shift, vh = wh[j & 3] >> shift;
        uint32_t a[4];
        a[0] = lop_or_magic(vl, Ops::MAGIC);       // row g: bytes 0, 2
        a[1] = lop_or_magic(vh, Ops::MAGIC);       // row g + 8
        a[2] = lop_or_magic(vl >> 8, Ops::MAGIC);  // row g: bytes 1, 3
        a[3] = lop_or_magic(vh >> 8, Ops::MAGIC);
        Ops::mma(dot, a, b[j][0], b[j][1]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = fmaf(sc[e >> 1], dot[e], acc[s][e]);
        acc[s][e] = fmaf(zc[e >> 1], xsum[i][e & 1], v);
      }
    }
  }
}

template <bool F16, int NG>
__global__ void __launch_bounds__(MAX_WARPS * 32) w4a16_gemv_kernel(Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  cg::cluster_group cluster = cg::this_cluster();
  const int ranks = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  const int cta_rows = SPLIT_ROWS ? warps * ROWS : ROWS;
  const int n0 = (blockIdx.x / ranks) * cta_rows;
  // the warp's first row; a warp of the last CTA may lie wholly past N: it copies nothing
  // (no rows), from addresses in bounds (those of row 0)
  const int warp_n0 = SPLIT_ROWS ? n0 + warp * ROWS : n0;
  const bool live = warp_n0 < p.n;
  const int first_row = live ? warp_n0 / 64 * 64 : 0;  // of the warp's 64-row block
  const int rows = live ? min(64, p.n - first_row) : 0;
  const int offset = live ? warp_n0 - first_row : 0;
  const uint8_t* block = p.w + static_cast<long long>(first_row) * (p.k / 2);

  const int chunks = p.k / CHUNK;
  const int c_lo = static_cast<int>(static_cast<long long>(rank) * chunks / ranks);
  const int c_hi = static_cast<int>(static_cast<long long>(rank + 1) * chunks / ranks);
  // splitting K, the warp takes chunks c_lo + warp, + warps, ...; splitting rows, all of them
  const int first = SPLIT_ROWS ? c_lo : c_lo + warp, step = SPLIT_ROWS ? 1 : warps;
  const int mine = first < c_hi ? (c_hi - first + step - 1) / step : 0;

  // a ring per warp (its part, then x's slab), or one per CTA (every warp's part, then the slab)
  const uint32_t ring = smem_addr(smem) + (SPLIT_ROWS ? 0 : warp * STAGES * p.stage_bytes);
  const uint32_t part_at = SPLIT_ROWS ? warp * warp_bytes<NG>() : 0;
  const uint32_t x_at = (SPLIT_ROWS ? warps : 1) * warp_bytes<NG>();
  Copier<NG> copier(p, block, rows, offset, first_row + offset, first, step, lane, part_at, x_at,
                    SPLIT_ROWS ? threadIdx.x : lane, SPLIT_ROWS ? blockDim.x : 32);
  float acc[SLICES][4] = {};
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
      compute<F16, NG>(p, stage + part_at, stage + x_at, lane, acc);
    } else {
      if (i + STAGES - 1 < mine) copier.issue(ring + next * p.stage_bytes);
      commit();
      wait_copies<STAGES - 1>();
      __syncwarp();
      compute<F16, NG>(p, stage, stage + x_at, lane, acc);
      __syncwarp();
    }
    slot = slot + 1 == STAGES ? 0 : slot + 1;
    next = next + 1 == STAGES ? 0 : next + 1;
  }
  asm volatile("cp.async.wait_all;\n" ::);

  // (after the ring is done with) splitting K, the warps' partials [warps][M][ROWS], summed in
  // warp order into the CTA's sums [M][ROWS]; splitting rows, each warp's rows of the sums
  // [M][cta_rows]
  __syncthreads();
  const int g = lane >> 2, t = lane & 3, m = p.m;
  const int outputs = cta_rows * m;
  float* part = reinterpret_cast<float*>(smem);
  float* sums = SPLIT_ROWS ? part : part + warps * outputs;
  float* mine_at = SPLIT_ROWS ? part + warp * ROWS : part + warp * outputs;
#pragma unroll
  for (int s = 0; s < SLICES; ++s)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = 16 * s + g + 8 * (e >> 1), col = 2 * t + (e & 1);
      if (col < m) mine_at[col * cta_rows + row] = acc[s][e];
    }
  if constexpr (!SPLIT_ROWS) {
    __syncthreads();
    for (int q = threadIdx.x; q < outputs; q += blockDim.x) {
      float v = 0.f;
      for (int w = 0; w < warps; ++w) v += part[w * outputs + q];
      sums[q] = v;
    }
  }
  if (ranks > 1) cluster.sync();  // every rank's sums written
  const int q_lo = ranks > 1 ? rank * outputs / ranks : 0;
  const int q_hi = ranks > 1 ? (rank + 1) * outputs / ranks : outputs;
  if (ranks == 1) __syncthreads();
  for (int q = q_lo + threadIdx.x; q < q_hi; q += blockDim.x) {
    float v = sums[q];
    if (ranks > 1) {
      v = 0.f;
      for (int r = 0; r < ranks; ++r) v += cluster.map_shared_rank(sums, r)[q];
    }
    const int col = q / cta_rows, row = q % cta_rows;
    if (n0 + row < p.n) p.out[col * p.ldo + n0 + row] = Half2Ops<F16>::round(v);
  }
  if (ranks > 1) cluster.sync();  // no rank leaves while another reads its sums
}

// Registers mode (GEMV_REGS=1): below.
constexpr int REGS_WARPS = 8;  // at most 8 warps a CTA: a lane may hold up to 255 registers

__device__ __forceinline__ uint4 ldg128(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t ldg32(const void* p) {
  uint32_t v;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// One chunk in a lane's registers: the 16 bytes of rows g and g + 8 of each slice it uses, and
// those rows' (scale, zero) words for each of the chunk's NG groups.
template <int NG>
struct Slot {
  uint4 w[SLICES][2];
  uint32_t zs[NG][SLICES][2];
};

// A lane's loads of a chunk into a Slot: its rows (those past N read the warp's first row, which
// exists, and only produce outputs never stored).
template <int NG>
struct RegLoader {
  const uint8_t* w;        // the warp's 64-row block, plus this lane's bytes of chunk 0
  long long chunk_bytes;   // one chunk of the block: rows x 64
  int row[SLICES][2];      // the lane's rows in the block
  const uint32_t* sz;      // (scale, zero) words of the block's first row
  long long n;
  int group_shift;

  __device__ __forceinline__ RegLoader(const Params& p, int first_row, int rows, int offset,
                                       int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int s = 0; s < SLICES; ++s)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = offset + 16 * s + 8 * h + g;
        row[s][h] = r < rows ? r : offset;
      }
    w = p.w + static_cast<long long>(first_row) * (p.k / 2) + t * 16;
    chunk_bytes = 64ll * rows;
    sz = p.sz + first_row;
    n = p.n;
    group_shift = p.group_shift;
  }

  __device__ __forceinline__ void load(Slot<NG>& slot, int chunk) const {
    const uint8_t* run = w + chunk * chunk_bytes;
#pragma unroll
    for (int s = 0; s < SLICES; ++s)
#pragma unroll
      for (int h = 0; h < 2; ++h) slot.w[s][h] = ldg128(run + row[s][h] * 64);
    const uint32_t* words = sz + ((static_cast<long long>(chunk) * CHUNK) >> group_shift) * n;
#pragma unroll
    for (int i = 0; i < NG; ++i)
#pragma unroll
      for (int s = 0; s < SLICES; ++s)
#pragma unroll
        for (int h = 0; h < 2; ++h) slot.zs[i][s][h] = ldg32(words + i * n + row[s][h]);
  }
};

// compute() of the registers mode: the chunk's weight and words from a Slot, x's [M, 128] slab
// at `x_at` (NT n8 tiles of rows), k16 blocks two at a time so that only their B fragments live.
template <bool F16, int NG, int NT>
__device__ __forceinline__ void compute_regs(const Slot<NG>& w, uint32_t x_at, int m, int lane,
                                             float (&acc)[SLICES][NT][4]) {
  using Ops = Half2Ops<F16>;
  constexpr int BLOCKS = 8 / NG;  // k16 blocks per group: 2, 4 or 8
  const uint32_t ones[4] = {Ops::ONES, Ops::ONES, Ops::ONES, Ops::ONES};
  // ldmatrix x4 of blocks (j, j + 1): lane i points at row i % 8 of matrix i / 8 (block
  // j + i / 16, its half (i / 8) % 2)
  const int mat = lane >> 3;
  uint32_t row_at[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
    row_at[nt] = x_at + min(8 * nt + (lane & 7), m - 1) * XROW + (16 * (mat >> 1) + 8 * (mat & 1)) * 2;
#pragma unroll
  for (int i = 0; i < NG; ++i) {
    float dot[SLICES][NT][4] = {};
    float xsum[NT][4] = {};  // X, x's sum over the group: columns 2 t, 2 t + 1 in [0], [1]
#pragma unroll
    for (int j = i * BLOCKS; j < (i + 1) * BLOCKS; j += 2) {
      uint32_t b[NT][2][2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        uint32_t d[4];
        ldmatrix4(d, row_at[nt] + j * 32);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          b[nt][h][0] = prmt(d[2 * h], d[2 * h + 1], 0x5410);  // x[2 t], x[2 t + 8]
          b[nt][h][1] = prmt(d[2 * h], d[2 * h + 1], 0x7632);  // x[2 t + 1], x[2 t + 9]
          Ops::mma(xsum[nt], ones, b[nt][h][0], b[nt][h][1]);
        }
      }
#pragma unroll
      for (int s = 0; s < SLICES; ++s)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int jj = j + h, shift = jj < 4 ? 0 : 4;
          const uint32_t vl = word(w.w[s][0], jj & 3) >> shift;
          const uint32_t vh = word(w.w[s][1], jj & 3) >> shift;
          uint32_t a[4];
          a[0] = lop_or_magic(vl, Ops::MAGIC);       // row g: bytes 0, 2
          a[1] = lop_or_magic(vh, Ops::MAGIC);       // row g + 8
          a[2] = lop_or_magic(vl >> 8, Ops::MAGIC);  // row g: bytes 1, 3
          a[3] = lop_or_magic(vh >> 8, Ops::MAGIC);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) Ops::mma(dot[s][nt], a, b[nt][h][0], b[nt][h][1]);
        }
    }
#pragma unroll
    for (int s = 0; s < SLICES; ++s) {
      const float sc[2] = {Ops::lo(w.zs[i][s][0]), Ops::lo(w.zs[i][s][1])};  // rows g, g + 8
      const float zc[2] = {fmaf(-Ops::BIAS, sc[0], Ops::hi(w.zs[i][s][0])),
                           fmaf(-Ops::BIAS, sc[1], Ops::hi(w.zs[i][s][1]))};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float v = fmaf(sc[e >> 1], dot[s][nt][e], acc[s][nt][e]);
          acc[s][nt][e] = fmaf(zc[e >> 1], xsum[nt][e & 1], v);
        }
    }
  }
}

template <bool F16, int NG, int NT>
__global__ void __launch_bounds__(REGS_WARPS * 32) w4a16_gemv_regs_kernel(Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int groups = p.groups, kwarps = warps / groups;
  const int cta_rows = groups * ROWS, n0 = blockIdx.x * cta_rows;
  // warp = kw * groups + its row group; a warp wholly past N loads nothing
  const int warp_n0 = n0 + (warp % groups) * ROWS, kw = warp / groups;
  const bool live = warp_n0 < p.n;
  const int first_row = live ? warp_n0 / 64 * 64 : 0;
  const int rows = live ? min(64, p.n - first_row) : 0;
  const int offset = live ? warp_n0 - first_row : 0;

  const int chunks = p.k / CHUNK, splits = gridDim.y, split = blockIdx.y;
  const int c_lo = static_cast<int>(static_cast<long long>(split) * chunks / splits);
  const int c_hi = static_cast<int>(static_cast<long long>(split + 1) * chunks / splits);
  const int first = c_lo + kw;  // the warp's chunks: first, first + kwarps, ...
  const int mine = live && first < c_hi ? (c_hi - first + kwarps - 1) / kwarps : 0;

  // the first STAGES chunks' loads go out before anything waits
  const RegLoader<NG> loader(p, first_row, rows, offset, lane);
  Slot<NG> ring[STAGES];
#pragma unroll
  for (int d = 0; d < STAGES; ++d)
    if (d < mine) loader.load(ring[d], first + d * kwarps);
  // x's run of the CTA's chunks, [chunk][M rows][XROW bytes], copied by every thread
  const uint32_t xs = smem_addr(smem);
  const int m = p.m, pieces = (c_hi - c_lo) * 16;
  for (int r = 0; r < m; ++r) {
    const uint16_t* src = p.x + r * p.ldx + static_cast<long long>(c_lo) * CHUNK;
    for (int q = threadIdx.x; q < pieces; q += blockDim.x)
      copy16(xs + (q >> 4) * m * XROW + r * XROW + (q & 15) * 16, src + q * 8, true);
  }
  commit();
  wait_copies<0>();
  __syncthreads();

  float acc[SLICES][NT][4] = {};
  for (int base = 0; base < mine; base += STAGES) {
#pragma unroll
    for (int d = 0; d < STAGES; ++d) {
      const int i = base + d;
      if (i < mine) {
        const Slot<NG> cur = ring[d];
        if (i + STAGES < mine) loader.load(ring[d], first + (i + STAGES) * kwarps);
        compute_regs<F16, NG, NT>(cur, xs + (kw + i * kwarps) * m * XROW, m, lane, acc);
      }
    }
  }

  // (x's run done with) the warps' partials [warps][M][ROWS], summed over each row group's
  // warps in warp order
  __syncthreads();
  const int g = lane >> 2, t = lane & 3;
  float* part = reinterpret_cast<float*>(smem);
  float* mine_at = part + warp * ROWS * m;
#pragma unroll
  for (int s = 0; s < SLICES; ++s)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = 16 * s + g + 8 * (e >> 1), col = 8 * nt + 2 * t + (e & 1);
        if (col < m) mine_at[col * ROWS + row] = acc[s][nt][e];
      }
  __syncthreads();
  const int outputs = cta_rows * m;
  float* ws = p.ws + (static_cast<long long>(split) * gridDim.x + blockIdx.x) * outputs;
  for (int q = threadIdx.x; q < outputs; q += blockDim.x) {
    const int col = q / cta_rows, row = q % cta_rows;
    const float* at = part + col * ROWS + row % ROWS;
    float v = 0.f;
    for (int w = row / ROWS; w < warps; w += groups) v += at[w * ROWS * m];
    if (splits == 1) {
      if (n0 + row < p.n) p.out[col * p.ldo + n0 + row] = Half2Ops<F16>::round(v);
    } else {
      ws[q] = v;
    }
  }
  if (splits == 1) return;
  // the last CTA of the row block to arrive sums the splits' sums in split order
  __threadfence();
  const bool last =
      __syncthreads_or(threadIdx.x == 0 && atomicAdd(p.counts + blockIdx.x, 1) == splits - 1);
  if (!last) return;
  __threadfence();
  const float* sums = p.ws + static_cast<long long>(blockIdx.x) * outputs;
  const long long plane = static_cast<long long>(gridDim.x) * outputs;
  for (int q = threadIdx.x; q < outputs; q += blockDim.x) {
    float v = 0.f;
    for (int sp = 0; sp < splits; ++sp) v += __ldcg(sums + sp * plane + q);
    const int col = q / cta_rows, row = q % cta_rows;
    if (n0 + row < p.n) p.out[col * p.ldo + n0 + row] = Half2Ops<F16>::round(v);
  }
  if (threadIdx.x == 0) p.counts[blockIdx.x] = 0;  // for the next launch
}

namespace {

// One stage of a ring: the warps' parts (one, or all `warps` when they split rows), x's slab.
int stage_bytes(int m, int group, int warps) {
  const int ng = group < CHUNK ? CHUNK / group : 1;
  const int bytes = (SPLIT_ROWS ? warps : 1) * (ROWS * 64 + ROWS * 4 * ng) + m * XROW;
  return (bytes + 127) / 128 * 128;
}

// K and rows modes: the rings (one per warp, or the CTA's), or the sums after them if larger:
// splitting K, the warps' partials and their sum ((warps + 1) x ROWS x M floats); splitting rows,
// warps x ROWS x M. Registers mode: x's run of the longest split ([chunks][M][XROW bytes]), or
// the warps' partials (warps x ROWS x M floats) if larger.
int smem_bytes(int m, int k, int group, int warps, int splits) {
  if (REGS) {
    const int run = (k / CHUNK + splits - 1) / splits * m * XROW;
    const int reduce = warps * ROWS * m * 4;
    return run > reduce ? run : reduce;
  }
  const int ring = (SPLIT_ROWS ? 1 : warps) * STAGES * stage_bytes(m, group, warps);
  const int reduce = (SPLIT_ROWS ? warps : warps + 1) * ROWS * m * 4;
  return ring > reduce ? ring : reduce;
}

template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, int smem, int (&allowed)[MAX_DEVICES]) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  if (device >= MAX_DEVICES) return cudaErrorInvalidDevice;
  if (smem > 48 * 1024 && smem > allowed[device]) {
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    allowed[device] = smem;
  }
  return cudaSuccess;
}

template <bool F16, int NG>
cudaError_t launch(const Params& p, int warps, int cluster, cudaStream_t stream) {
  const int smem = smem_bytes(p.m, p.k, CHUNK / NG, warps, 1);
  static int allowed[MAX_DEVICES] = {};  // per device: raised once to the most asked
  cudaError_t e = allow_smem(w4a16_gemv_kernel<F16, NG>, smem, allowed);
  if (e != cudaSuccess) return e;
  cudaLaunchConfig_t config = {};
  const int cta_rows = SPLIT_ROWS ? warps * ROWS : ROWS;
  config.gridDim = dim3(static_cast<unsigned>((p.n + cta_rows - 1) / cta_rows * cluster));
  config.blockDim = dim3(static_cast<unsigned>(warps * 32));
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, w4a16_gemv_kernel<F16, NG>, p);
}

template <bool F16, int NG, int NT>
cudaError_t launch_regs(const Params& p, int warps, int splits, cudaStream_t stream) {
  const int smem = smem_bytes(p.m, p.k, CHUNK / NG, warps, splits);
  static int allowed[MAX_DEVICES] = {};
  cudaError_t e = allow_smem(w4a16_gemv_regs_kernel<F16, NG, NT>, smem, allowed);
  if (e != cudaSuccess) return e;
  const int cta_rows = p.groups * ROWS;
  const dim3 grid(static_cast<unsigned>((p.n + cta_rows - 1) / cta_rows),
                  static_cast<unsigned>(splits));
  w4a16_gemv_regs_kernel<F16, NG, NT><<<grid, warps * 32, smem, stream>>>(p);
  return cudaGetLastError();
}

template <bool F16, int NG>
cudaError_t launch_mode(const Params& p, int warps, int cluster, int splits, cudaStream_t s) {
  if constexpr (REGS) {
    return p.m > 8 ? launch_regs<F16, NG, 2>(p, warps, splits, s)
                   : launch_regs<F16, NG, 1>(p, warps, splits, s);
  } else {
    return launch<F16, NG>(p, warps, cluster, s);
  }
}

template <bool F16>
cudaError_t launch_group(const Params& p, int group, int warps, int cluster, int splits,
                         cudaStream_t s) {
  if (group == 32) return launch_mode<F16, 4>(p, warps, cluster, splits, s);
  if (group == 64) return launch_mode<F16, 2>(p, warps, cluster, splits, s);
  return launch_mode<F16, 1>(p, warps, cluster, splits, s);
}

}  // namespace

extern "C" {

// This library's compile-time config: warps split rows (1) or K (0), registers mode (1 or 0),
// slices (16-row) per warp, stages.
void w4a16_gemv_config(int* split_rows, int* regs, int* slices, int* stages) {
  *split_rows = SPLIT_ROWS;
  *regs = REGS;
  *slices = SLICES;
  *stages = STAGES;
}

// Shared memory one launch takes (bytes), for a caller that checks the device's limit first.
int w4a16_gemv_smem(int m, int k, int group, int warps, int splits) {
  return smem_bytes(m, k, group, warps, splits);
}

// out[m, ldo] (x's dtype) = x[m, ldx] @ dequant(w, sz).T; returns a cudaError_t. The caller
// checks the operands (tuner/candidates/cuda_w4a16.py); this refuses what would read or write
// out of bounds: m outside 1..MAX_M, K not whole chunks, a group size other than 32, 64,
// 128, 256 that divides K, x or w not 16-byte aligned; in the K and rows modes warps outside
// 1..16, a cluster outside 1..8 or wider than K's chunks, groups or splits other than 1; in the
// registers mode warps outside 1..8, a cluster other than 1, groups not dividing warps, splits
// outside 1..16 or more than K's chunks, and with splits > 1 no workspace or arrival counts
// (ws: splits x ceil(n / (groups x ROWS)) x groups x ROWS x m floats; counts: one int per row
// block, zero, left zero by every launch).
int w4a16_gemv(const void* x, const void* w, const void* sz, void* out, int m, int n, int k,
               int group, long long ldx, long long ldo, int f16, int warps, int cluster,
               int groups, int splits, void* ws, void* counts, void* stream) {
  const bool group_ok = (group == 32 || group == 64 || group == 128 || group == 256) && k % group == 0;
  const bool launch_ok =
      REGS ? warps >= 1 && warps <= REGS_WARPS && cluster == 1 && groups >= 1 &&
                 warps % groups == 0 && splits >= 1 && splits <= MAX_SPLITS &&
                 splits <= k / CHUNK && (splits == 1 || (ws != nullptr && counts != nullptr))
           : warps >= 1 && warps <= MAX_WARPS && cluster >= 1 && cluster <= 8 &&
                 cluster <= k / CHUNK && groups == 1 && splits == 1;
  if (m < 1 || m > MAX_M || n < 1 || k < CHUNK || k % CHUNK || !group_ok || !launch_ok ||
      ldx % 8 || ldo < n || reinterpret_cast<uintptr_t>(x) % 16 ||
      reinterpret_cast<uintptr_t>(w) % 16 || reinterpret_cast<uintptr_t>(sz) % 4)
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
  p.groups = groups;
  p.ws = static_cast<float*>(ws);
  p.counts = static_cast<int*>(counts);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return static_cast<int>(f16 ? launch_group<true>(p, group, warps, cluster, splits, s)
                              : launch_group<false>(p, group, warps, cluster, splits, s));
}

}  // extern "C"

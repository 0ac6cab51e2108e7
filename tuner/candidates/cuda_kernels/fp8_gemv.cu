// FP8 scaled decode GEMM (M <= 16): out[M, N] = (a[M, K] @ b[N, K]^T) * scale_a * scale_b, what
// torch._scaled_mm(a, b.T, scale_a, scale_b) computes; a and b e4m3 or e5m2 (not both e5m2),
// scales float32, tensorwise (one each) or rowwise (scale_a [M], scale_b [N]).
//
// GEMV-style: a warp owns ROWS = 16 * SLICES rows of b (the weight), a CTA a contiguous run of
// K (all of it, or 1 / C of it in a cluster of C CTAs) and its warps take interleaved
// 128-value chunks of the run, each from its own copy ring; their [ROWS, M] partials are summed
// in shared memory in warp order, and a cluster's ranks sum theirs through distributed shared
// memory (gemv_cluster.cuh). No partial goes through global memory: no workspace, no second
// pass, a fixed sum order. Launched with programmatic dependent launch.
//
// The tensor cores take b's rows as mma.m16n8k32's A (16 rows a slice) and a's rows as its B
// (one n8 tile for M <= 8, two above), both in their fp8 format. A dot product does not depend
// on the order of K, so each lane takes contiguous bytes: in each 128-byte run of a row, lane
// (g, t) of a quad holds the 16 bytes at 16 t and the 16 at 64 + 16 t (eight words), of rows g
// and g + 8 of a slice and of a's row g of an n8 tile; the mma of k32 block j takes words 2 j and
// 2 j + 1 as the fragment's two k halves (a0 / a2 of rows g, a1 / a3 of rows g + 8, b0 / b1),
// so both operands see the same permutation of K. The copies read whole 128-byte lines (eight
// lanes a row) and write each piece where the lane that reads it finds its words in order
// (slot [piece][lane] x 16 bytes: conflict-free 16-byte shared loads).
//
// A chunk is CHUNK bytes of K (-DGEMV_CHUNK=128|256|512): the longer, the longer each row's run of
// DRAM addresses a warp reads at once.
//
// Accumulation: each 128 bytes' four mma (128 products) start from zero and their sum is added to
// the fp32 accumulator, as _scaled_mm's non-fast kernels promote their partial sums; the scales
// apply once, to the final sum.
//
// One shared library per (SLICES, STAGES, CHUNK): -DGEMV_SLICES=1|2|4 (16-row slices per warp),
// -DGEMV_STAGES=2..8, -DGEMV_CHUNK; warps per CTA and the cluster size are launch arguments.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "gemv_cluster.cuh"

#ifndef GEMV_SLICES
#define GEMV_SLICES 2
#endif
#ifndef GEMV_STAGES
#define GEMV_STAGES 3
#endif
#ifndef GEMV_CHUNK
#define GEMV_CHUNK 128
#endif

namespace cg = cooperative_groups;
using namespace gemv;

constexpr int SLICES = GEMV_SLICES;
constexpr int STAGES = GEMV_STAGES;
constexpr int ROWS = 16 * SLICES;
constexpr int CHUNK = GEMV_CHUNK;  // K values (bytes) a warp takes at a time
constexpr int MAX_M = 16;   // two n8 tiles
constexpr int MAX_WARPS = 16;
constexpr int SLICE_BYTES = 16 * CHUNK;  // a slice's chunk: per 128-byte run, 4 slots x 32 lanes x 16 bytes
constexpr int TILE_BYTES = 8 * CHUNK;    // an n8 tile of a's chunk: per run, 2 slots x 32 lanes x 16 bytes
static_assert(CHUNK == 128 || CHUNK == 256 || CHUNK == 512, "chunks of 128, 256 or 512 bytes");
static_assert(SLICES == 1 || SLICES == 2 || SLICES == 4, "16, 32 or 64 rows a warp");
static_assert(STAGES >= 2 && STAGES <= 8, "2..8 stages");

enum Out { OUT_BF16, OUT_F16, OUT_F32 };

struct Params {
  const uint8_t* a;  // [M, K], rows lda bytes apart
  const uint8_t* b;  // [N, K], rows ldb bytes apart
  const float* scale_a;
  const float* scale_b;
  void* out;  // [M, N], rows ldo elements apart
  long long lda, ldb, ldo;
  int m, n, k;
  int rowwise;
  int stage_bytes;  // one warp's stage: its slices of b, then a's n8 tiles
  int inbox_at;     // (a cluster) the inbox: an mbarrier, then [ranks][a share of the outputs]
};

// A quad lane's slot for byte `piece` x 16 of a 128-byte run of row `r` of eight (16 t and
// 64 + 16 t are lane t's): [piece / 4][lane 4 r + piece % 4].
__device__ __forceinline__ uint32_t slot_of(int r, int piece) {
  return ((piece >> 2) * 32 + 4 * r + (piece & 3)) * 16;
}

// Where the 16 bytes at 16 `piece` of a chunk's row `row` land in a stage's part of 8 (a's n8
// tile) or 16 rows (a weight slice): 128-byte runs one after the other (RUN_BYTES for a slice's
// 16 rows, half that for 8), and in a run, rows 8 and up after the first eight.
__device__ __forceinline__ uint32_t place(int row, int piece, int rows) {
  return (piece >> 3) * rows * 128 + (row >> 3) * 1024 + slot_of(row & 7, piece & 7);
}

// One lane's copies of the chunks of its warp's ring: whole rows of a chunk per PIECES lanes
// (16 bytes each), COPY_ROWS rows an instruction, of each 16-row slice of the weight and of a's
// n8 tiles; rows past N or M are zero-filled.
template <int NT>
struct Copier {
  static constexpr int PIECES = CHUNK / 16;  // a row's 16-byte pieces in a chunk
  static constexpr int COPY_ROWS = 32 / PIECES;
  static constexpr int B_COPIES = 16 / COPY_ROWS;  // a slice's copies
  static constexpr int A_COPIES = 8 / COPY_ROWS;   // an n8 tile's copies
  const uint8_t* b;  // this lane's first piece of the current chunk
  const uint8_t* a;
  const uint8_t* b_base;  // read by copies of no bytes (rows past N or M)
  const uint8_t* a_base;
  long long b_round, a_round;  // bytes between the lane's rows of two copies (COPY_ROWS rows)
  uint64_t b_valid;            // bit per copy: its row exists
  uint32_t a_valid;
  int r, piece;
  int step;  // bytes to the lane's next chunk

  __device__ __forceinline__ Copier(const Params& p, int n0, int first, int chunk_step, int lane) {
    r = lane / PIECES;
    piece = lane % PIECES;
    const long long k0 = static_cast<long long>(first) * CHUNK + piece * 16;
    b = p.b + (n0 + r) * p.ldb + k0;
    a = p.a + r * p.lda + k0;
    b_base = p.b;
    a_base = p.a;
    b_round = COPY_ROWS * p.ldb;
    a_round = COPY_ROWS * p.lda;
    b_valid = a_valid = 0;
#pragma unroll
    for (int s = 0; s < SLICES; ++s)
#pragma unroll
      for (int i = 0; i < B_COPIES; ++i)
        if (n0 + 16 * s + r + COPY_ROWS * i < p.n) b_valid |= 1ull << (B_COPIES * s + i);
#pragma unroll
    for (int n8 = 0; n8 < NT; ++n8)
#pragma unroll
      for (int i = 0; i < A_COPIES; ++i)
        if (8 * n8 + r + COPY_ROWS * i < p.m) a_valid |= 1u << (A_COPIES * n8 + i);
    step = chunk_step * CHUNK;
  }

  __device__ __forceinline__ void issue(uint32_t stage) {
#pragma unroll
    for (int s = 0; s < SLICES; ++s)
#pragma unroll
      for (int i = 0; i < B_COPIES; ++i) {
        const int at = B_COPIES * s + i;  // row r + COPY_ROWS at of the warp's rows
        const bool valid = b_valid >> at & 1;
        copy16(stage + s * SLICE_BYTES + place(r + COPY_ROWS * i, piece, 16),
               valid ? b + at * b_round : b_base, valid);
      }
    const uint32_t x_at = stage + SLICES * SLICE_BYTES;
#pragma unroll
    for (int n8 = 0; n8 < NT; ++n8)
#pragma unroll
      for (int i = 0; i < A_COPIES; ++i) {
        const int at = A_COPIES * n8 + i;
        const bool valid = a_valid >> at & 1;
        copy16(x_at + n8 * TILE_BYTES + place(r + COPY_ROWS * i, piece, 8),
               valid ? a + at * a_round : a_base, valid);
      }
    b += step;
    a += step;
  }
};

// mma.m16n8k32 with fp8 operands of formats W (A: the weight) and X (B: the activations), 0
// e4m3 or 1 e5m2, f32 accumulators.
template <int W, int X>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
#define GEMV_FP8_MMA(TA, TB)                                                                     \
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32." TA "." TB                                \
               ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"        \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
  if constexpr (W == 0 && X == 0)
    GEMV_FP8_MMA("e4m3", "e4m3");
  else if constexpr (W == 0)
    GEMV_FP8_MMA("e4m3", "e5m2");
  else
    GEMV_FP8_MMA("e5m2", "e4m3");
#undef GEMV_FP8_MMA
}

// Adds the stage's chunk to the lane's accumulators (b's rows as A, a's as B: see the top),
// 128 bytes of K at a time.
template <int FA, int FB, int NT>
__device__ __forceinline__ void compute(uint32_t stage, int lane, float (&acc)[SLICES][NT][4]) {
#pragma unroll
  for (int run = 0; run < CHUNK / 128; ++run) {
    uint32_t x[NT][8];
#pragma unroll
    for (int n8 = 0; n8 < NT; ++n8)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 v = lds128(stage + SLICES * SLICE_BYTES + n8 * TILE_BYTES + run * 1024 +
                               (h * 32 + lane) * 16);
        x[n8][4 * h] = v.x, x[n8][4 * h + 1] = v.y, x[n8][4 * h + 2] = v.z, x[n8][4 * h + 3] = v.w;
      }
#pragma unroll
    for (int s = 0; s < SLICES; ++s) {
      uint32_t w[2][8];  // rows g, g + 8
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint4 v = lds128(stage + s * SLICE_BYTES + run * 2048 +
                                 ((2 * half + h) * 32 + lane) * 16);
          w[half][4 * h] = v.x, w[half][4 * h + 1] = v.y, w[half][4 * h + 2] = v.z,
          w[half][4 * h + 3] = v.w;
        }
#pragma unroll
      for (int n8 = 0; n8 < NT; ++n8) {
        float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t frag[4] = {w[0][2 * j], w[1][2 * j], w[0][2 * j + 1], w[1][2 * j + 1]};
          mma<FB, FA>(c, frag, x[n8][2 * j], x[n8][2 * j + 1]);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[s][n8][e] += c[e];
      }
    }
  }
}

// 32- and 64-row warps over two n8 tiles need more than 128 registers a thread: at most 8 warps
template <int NT>
constexpr int max_warps() {
  return NT > 1 && SLICES > 1 ? 8 : MAX_WARPS;
}

template <int FA, int FB, int NT, int OUT>
__global__ void __launch_bounds__(max_warps<NT>() * 32, 1) fp8_gemv_kernel(Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  cg::cluster_group cluster = cg::this_cluster();
  const int ranks = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int outputs = ROWS * p.m;
  open_inbox(smem + p.inbox_at, outputs, rank, ranks);

  const int n0 = (blockIdx.x / ranks) * ROWS;
  const int chunks = p.k / CHUNK;
  const int c_lo = static_cast<int>(static_cast<long long>(rank) * chunks / ranks);
  const int c_hi = static_cast<int>(static_cast<long long>(rank + 1) * chunks / ranks);
  const int first = c_lo + warp;
  const int mine = first < c_hi ? (c_hi - first + warps - 1) / warps : 0;
  const uint32_t ring = smem_addr(smem) + warp * STAGES * p.stage_bytes;
  Copier<NT> copier(p, n0, first, warps, lane);
  float acc[SLICES][NT][4] = {};
  wait_for_previous_grid();  // its writes of a (and reads of out)
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < mine) copier.issue(ring + i * p.stage_bytes);
    commit();
  }
  int slot = 0, next = STAGES - 1;  // the stage computed, the stage filled
  for (int i = 0; i < mine; ++i) {
    if (i + STAGES - 1 < mine) copier.issue(ring + next * p.stage_bytes);
    commit();
    wait_copies<STAGES - 1>();
    __syncwarp();
    compute<FA, FB, NT>(ring + slot * p.stage_bytes, lane, acc);
    __syncwarp();
    slot = slot + 1 == STAGES ? 0 : slot + 1;
    next = next + 1 == STAGES ? 0 : next + 1;
  }
  asm volatile("cp.async.wait_all;\n" ::);
  let_next_grid_launch();

  // (after the rings are done with) the warps' partials [warps][M][ROWS], summed in warp order
  // into the CTA's sums [M][ROWS]
  __syncthreads();
  const int g = lane >> 2, t = lane & 3, m = p.m;
  float* part = reinterpret_cast<float*>(smem);
  float* sums = part + warps * outputs;
#pragma unroll
  for (int s = 0; s < SLICES; ++s)
#pragma unroll
    for (int n8 = 0; n8 < NT; ++n8)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = 16 * s + g + 8 * (e >> 1), col = 8 * n8 + 2 * t + (e & 1);
        if (col < m) part[warp * outputs + col * ROWS + row] = acc[s][n8][e];
      }
  const auto store = [&](int q, float v) {  // output q of the CTA's [M][ROWS]
    const int col = q / ROWS, n = n0 + q % ROWS;
    if (n >= p.n) return;
    v *= p.rowwise ? p.scale_a[col] * p.scale_b[n] : p.scale_a[0] * p.scale_b[0];
    const long long at = col * p.ldo + n;
    if constexpr (OUT == OUT_BF16)
      static_cast<__nv_bfloat16*>(p.out)[at] = __float2bfloat16_rn(v);
    else if constexpr (OUT == OUT_F16)
      static_cast<__half*>(p.out)[at] = __float2half_rn(v);
    else
      static_cast<float*>(p.out)[at] = v;
  };
  __syncthreads();
  for (int q = threadIdx.x; q < outputs; q += blockDim.x) {
    float v = 0.f;
    for (int w = 0; w < warps; ++w) v += part[w * outputs + q];
    if (ranks == 1)
      store(q, v);
    else
      sums[q] = v;
  }
  if (ranks > 1) {
    __syncthreads();  // the CTA's sums written
    cluster_sum(sums, smem + p.inbox_at, outputs, rank, ranks, store);
  }
}

namespace {

// One warp's stage: its slices of b, then a's n8 tiles.
int stage_bytes(int m) { return SLICES * SLICE_BYTES + (m > 8 ? 2 : 1) * TILE_BYTES; }

// The rings, or the sums after them if larger (the warps' partials and their sum).
int inbox_at(int m, int warps) {
  const int rings = warps * STAGES * stage_bytes(m), sums = (warps + 1) * ROWS * m * 4;
  return rings > sums ? rings : sums;
}

// Then, in a cluster, the inbox.
int smem_bytes(int m, int warps, int cluster) {
  return inbox_at(m, warps) + inbox_bytes(ROWS * m, cluster);
}

template <int FA, int FB, int NT>
cudaError_t launch_out(const Params& p, int out, int warps, int cluster, cudaStream_t s) {
  if (warps > max_warps<NT>()) return cudaErrorInvalidValue;
  const int ctas = (p.n + ROWS - 1) / ROWS * cluster, smem = smem_bytes(p.m, warps, cluster);
  if (out == OUT_BF16)
    return launch_cluster<Params, fp8_gemv_kernel<FA, FB, NT, OUT_BF16>>(p, ctas, warps * 32, smem,
                                                                         cluster, s);
  if (out == OUT_F16)
    return launch_cluster<Params, fp8_gemv_kernel<FA, FB, NT, OUT_F16>>(p, ctas, warps * 32, smem,
                                                                        cluster, s);
  return launch_cluster<Params, fp8_gemv_kernel<FA, FB, NT, OUT_F32>>(p, ctas, warps * 32, smem,
                                                                      cluster, s);
}

template <int FA, int FB>
cudaError_t launch_tiles(const Params& p, int out, int warps, int cluster, cudaStream_t s) {
  return p.m > 8 ? launch_out<FA, FB, 2>(p, out, warps, cluster, s)
                 : launch_out<FA, FB, 1>(p, out, warps, cluster, s);
}

}  // namespace

extern "C" {

// This library's compile-time config: 16-row slices per warp, stages, chunk bytes.
void fp8_gemv_config(int* slices, int* stages, int* chunk) {
  *slices = SLICES;
  *stages = STAGES;
  *chunk = CHUNK;
}

// Shared memory one launch takes (bytes), for a caller that checks the device's limit first.
int fp8_gemv_smem(int m, int warps, int cluster) { return smem_bytes(m, warps, cluster); }

// out[m, ldo] = (a[m, lda] @ b[n, ldb].T) * scale_a * scale_b; a_fmt, b_fmt 0 (e4m3) or 1
// (e5m2), out_kind 0 (bf16), 1 (f16), 2 (f32), rowwise: scale_a [m] and scale_b [n], else one
// each. Returns a cudaError_t. The caller checks the operands (tuner/candidates/cuda_fp8.py);
// this refuses what would read or write out of bounds: m outside 1..MAX_M, K not whole chunks
// or fewer than one per CTA of the cluster, warps outside 1..MAX_WARPS (1..8 for 32- or 64-row
// warps at M > 8), a cluster outside 1..8,
// rows or bases not 16-byte aligned, ldo < n, two e5m2 operands.
int fp8_gemv(const void* a, const void* b, const void* scale_a, const void* scale_b, void* out,
             int m, int n, int k, long long lda, long long ldb, long long ldo, int a_fmt,
             int b_fmt, int out_kind, int rowwise, int warps, int cluster, void* stream) {
  const bool formats_ok = (a_fmt == 0 || a_fmt == 1) && (b_fmt == 0 || b_fmt == 1) &&
                          !(a_fmt == 1 && b_fmt == 1);
  if (m < 1 || m > MAX_M || n < 1 || k < CHUNK || k % CHUNK || warps < 1 || warps > MAX_WARPS ||
      cluster < 1 || cluster > 8 || cluster > k / CHUNK || lda % 16 || ldb % 16 || ldo < n ||
      !formats_ok || out_kind < 0 || out_kind > 2 || reinterpret_cast<uintptr_t>(a) % 16 ||
      reinterpret_cast<uintptr_t>(b) % 16)
    return static_cast<int>(cudaErrorInvalidValue);
  Params p;
  p.a = static_cast<const uint8_t*>(a);
  p.b = static_cast<const uint8_t*>(b);
  p.scale_a = static_cast<const float*>(scale_a);
  p.scale_b = static_cast<const float*>(scale_b);
  p.out = out;
  p.lda = lda;
  p.ldb = ldb;
  p.ldo = ldo;
  p.m = m;
  p.n = n;
  p.k = k;
  p.rowwise = rowwise;
  p.stage_bytes = stage_bytes(m);
  p.inbox_at = inbox_at(m, warps);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (a_fmt == 1) return static_cast<int>(launch_tiles<1, 0>(p, out_kind, warps, cluster, s));
  if (b_fmt == 1) return static_cast<int>(launch_tiles<0, 1>(p, out_kind, warps, cluster, s));
  return static_cast<int>(launch_tiles<0, 0>(p, out_kind, warps, cluster, s));
}

}  // extern "C"

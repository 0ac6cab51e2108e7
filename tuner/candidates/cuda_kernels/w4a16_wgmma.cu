// INT4 weight-only decode GEMM (W4A16, M <= 16) on Hopper's wgmma:
// out[M, N] = x[M, K] @ dequant(w)[N, K]^T, x bf16 or f16, groups of 128, our packed layout
// (tuner/quant/int4.py), torch's [K / 128, N, 2] scales and zeros.
//
// The FP8 decode kernel's shape (fp8_gemv.cu) with the weight dequantized in registers: one
// warpgroup a CTA owns GROUPS (1 or 2: two chunks' fragments of more would not fit its
// registers) 64-row blocks of the weight (wgmma's m, one m64 wgmma each) and a
// run of K; a cluster of 1, 2, 4 or 8 CTAs splits K and sums through distributed shared memory
// (cluster_sum.cuh). A stage is one chunk of 128 K values (one group): x's [NB rows x 128] in the
// 128-byte swizzle wgmma's K-major descriptors read (8-row atoms of 1 KB, 16-byte piece c of row
// r at ((c ^ r % 8) * 16)), each block's [64 rows x 64 bytes] (one 4 KB run of our layout) and
// its 64 (scale, zero) words, filled by cp.async from all 128 threads.
//
// Each warp takes its 16 rows of a block as 16 bytes a lane, which our layout orders as wgmma's
// register A fragments (those of mma.m16n8k16): one masked OR a pair makes magic + q (exact) in
// k order. x is wgmma's B from shared memory. The group's scale and zero apply after the chunk's
// eight k16 wgmma (while the next chunk lands and is dequantized): s * (dot - (magic + 8) X) + z X = s dot + (z - (magic + 8) s) X in fp32,
// where X (x's sum over the group) comes from x's fragments (ldmatrix) times ones on mma.sync,
// whose A operand, unlike wgmma's, takes one register quad for every call. A block's wgmma run
// while the next block is dequantized. Launched with programmatic dependent launch: nothing is
// read before the kernel before it has written.
//
// Compile-time: W4_WG_STAGES (2-16); the activation dtype, x's n8 tiles, the blocks a CTA and
// the cluster are template arguments chosen at launch. sm_90a only.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "cluster_launch.cuh"
#include "cluster_sum.cuh"
#include "int4_ops.cuh"

#ifndef W4_WG_STAGES
#define W4_WG_STAGES 8
#endif

namespace cg = cooperative_groups;
using gemv::smem_addr;

constexpr int STAGES = W4_WG_STAGES;
constexpr int BLOCK = 64;                  // weight rows a block: wgmma's m
constexpr int CHUNK = 128;                 // K values a stage: one group
constexpr int W_BYTES = BLOCK * CHUNK / 2;  // a block's chunk in our layout
constexpr int X_ATOM = 128;                // bytes of an x row in one swizzle atom: 64 values
constexpr int MAX_M = 16;
static_assert(STAGES >= 2 && STAGES <= 16, "2..16 stages");

struct Params {
  const uint16_t* x;   // [M, K], rows ldx elements apart
  const uint8_t* w;    // our packed layout of [N, K]
  const uint32_t* sz;  // [K / 128, N] (scale, zero) pairs, one word each
  void* out;           // [M, N], rows ldo apart, x's dtype
  long long ldx, ldo;
  int m, n, k, f16;
  int stage_bytes;
  int inbox_at;  // (a cluster) the inbox: cluster_sum.cuh
};

__device__ __forceinline__ void copy16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void copy4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 4 : 0));
}

// Where the 16 bytes at 16 c of row r land in a 128-byte-swizzled K-major tile.
__device__ __forceinline__ uint32_t swizzled(int r, int c) {
  return (r >> 3) * 1024 + (r & 7) * 128 + ((c ^ (r & 7)) << 4);
}

// A K-major, 128-byte-swizzled wgmma descriptor of the tile at `addr` (1 KB aligned, plus a K
// offset within the 128-byte rows): 8-row atoms 1 KB apart.
__device__ __forceinline__ uint64_t descriptor(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) |
         (1ull << 62);
}

// d (+)= A (registers) x B (descriptor): m64 nNB k16, fp32 accumulators.
template <bool F16, int NB>
__device__ __forceinline__ void wgmma(float (&d)[NB / 2], const uint32_t (&a)[4], uint64_t db,
                                      int accumulate) {
  if constexpr (NB == 8) {
    if constexpr (F16)
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, "
          "{%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
    else
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, "
          "{%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
  } else {
    if constexpr (F16)
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, "
          "%7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
            "+f"(d[7])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
    else
      asm volatile(
          "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, "
          "%7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
            "+f"(d[7])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
  }
}

// Keeps the compiler from moving reads of wgmma's accumulators above the wait that completes
// them (it sees the wait touch memory, not these registers).
template <int GROUPS, int N>
__device__ __forceinline__ void fence_operands(float (&d)[GROUPS][N]) {
#pragma unroll
  for (int b = 0; b < GROUPS; ++b)
#pragma unroll
    for (int e = 0; e < N; ++e) asm volatile("" : "+f"(d[b][e])::"memory");
}

template <bool F16, int NB, int GROUPS, int RANKS>
__global__ void __launch_bounds__(128) w4a16_wgmma(Params p) {
  using H = Half2Ops<F16>;
  constexpr int ROWS = BLOCK * GROUPS;               // weight rows a CTA
  constexpr int X_BYTES = NB * X_ATOM * 2;           // a stage: x's two atoms,
  constexpr int SZ_AT = X_BYTES + GROUPS * W_BYTES;  // the blocks' chunks, their scales
  extern __shared__ __align__(1024) unsigned char smem[];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const gemv::ClusterSum<ROWS, RANKS> sum(smem + p.inbox_at, rank, p.m);
  sum.open(tid);

  const int n0 = (blockIdx.x / RANKS) * ROWS;
  const int chunks = p.k / CHUNK;
  const int c_lo = rank * chunks / RANKS, mine = (rank + 1) * chunks / RANKS - c_lo;
  // the swizzle atoms want 1 KB alignment: the ring starts at the first 1 KB boundary
  const uint32_t ring = (smem_addr(smem) + 1023) & ~1023u;

  // this thread's pieces: of each block's chunk the 16 bytes at 16 q for q = tid, tid + 128
  // (row q / 4; the last block of the weight holds the rows left, its chunks that many rows
  // long); x's 16 bytes c16 = q % 16 of row q / 16 for q = tid (+ 128 at NB = 16)
  const uint8_t* w_src[GROUPS];
  long long w_step[GROUPS];
  bool w_valid[GROUPS][2];
#pragma unroll
  for (int b = 0; b < GROUPS; ++b) {
    const int b0 = min(n0 + BLOCK * b, p.n), rows = min(BLOCK, p.n - b0);
    w_step[b] = static_cast<long long>(rows) * 64;
    w_valid[b][0] = tid / 4 < rows;
    w_valid[b][1] = 32 + tid / 4 < rows;
    w_src[b] = p.w + static_cast<long long>(b0) * (p.k / 2) + c_lo * w_step[b] + tid * 16;
  }
  const int xr = tid >> 4, xc = tid & 15;
  const uint16_t* x_src = p.x + (xr < p.m ? xr * p.ldx : 0) + c_lo * CHUNK + xc * 8;
  const uint16_t* x_src2 = p.x + (xr + 8 < p.m ? (xr + 8) * p.ldx : 0) + c_lo * CHUNK + xc * 8;
  const uint32_t x_dst = (xc >> 3) * NB * X_ATOM + swizzled(xr, xc & 7);
  const uint32_t x_dst2 = (xc >> 3) * NB * X_ATOM + swizzled(xr + 8, xc & 7);
  constexpr int SZ_COPIES = (ROWS + 127) / 128;  // scale words a thread: rows tid + 128 i
  bool sz_valid[SZ_COPIES];
  const uint32_t* sz_src[SZ_COPIES];
#pragma unroll
  for (int i = 0; i < SZ_COPIES; ++i) {
    const int row = n0 + tid + 128 * i;
    sz_valid[i] = tid + 128 * i < ROWS && row < p.n;
    sz_src[i] = p.sz + static_cast<long long>(c_lo) * p.n + (sz_valid[i] ? row : 0);
  }
  const auto issue = [&](uint32_t stage) {
#pragma unroll
    for (int b = 0; b < GROUPS; ++b) {
      const uint32_t at = stage + X_BYTES + b * W_BYTES + tid * 16;
      copy16(at, w_valid[b][0] ? w_src[b] : p.w, w_valid[b][0]);
      copy16(at + 2048, w_valid[b][1] ? w_src[b] + 2048 : p.w, w_valid[b][1]);
      w_src[b] += w_step[b];
    }
    copy16(stage + x_dst, x_src, xr < p.m);
    if constexpr (NB == 16) copy16(stage + x_dst2, x_src2, xr + 8 < p.m);
#pragma unroll
    for (int i = 0; i < SZ_COPIES; ++i) {
      if (tid + 128 * i < ROWS) copy4(stage + SZ_AT + (tid + 128 * i) * 4, sz_src[i], sz_valid[i]);
      sz_src[i] += p.n;
    }
    x_src += CHUNK;
    x_src2 += CHUNK;
  };

  float acc[GROUPS][NB / 2] = {};
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  const int stage_bytes = p.stage_bytes;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < mine) issue(ring + s * stage_bytes);
    asm volatile("cp.async.commit_group;\n" ::);
  }
  const uint32_t ones[4] = {H::ONES, H::ONES, H::ONES, H::ONES};
  const int row_g = 16 * warp + g;
  // x's fragments by ldmatrix: lane i points at row i % 8 (+ 8 n8) of matrix i / 8 (k16 block
  // j + i / 16, its k half (i / 8) % 2); block j is the 32 bytes at 32 (j % 4) of atom j / 4
  const int mat = lane >> 3;
  int slot = 0, next = STAGES - 1;  // the stage landed last, the stage filled next
  // The next chunk landed (this thread's copies), visible to wgmma's async proxy, then
  // everyone's; the barrier also means every warp's wgmma of the chunk before are done (each
  // waits for its own before it gets here): its stage is refilled. Its stage's address.
  const auto land = [&](int i) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    if (i + STAGES - 1 < mine) issue(ring + next * stage_bytes);
    asm volatile("cp.async.commit_group;\n" ::);
    const uint32_t stage = ring + slot * stage_bytes;
    slot = slot + 1 == STAGES ? 0 : slot + 1;
    next = next + 1 == STAGES ? 0 : next + 1;
    return stage;
  };
  // a chunk's A fragments and scales in buffer B (two chunks in flight: one in the wgmma, the
  // next one dequantized meanwhile)
  uint32_t a[2][GROUPS][8][4], zs[2][GROUPS][2];
  const auto dequant = [&](auto buffer, uint32_t stage) {
    constexpr int B = decltype(buffer)::value;
#pragma unroll
    for (int b = 0; b < GROUPS; ++b) {
      const uint32_t w_at = stage + X_BYTES + b * W_BYTES;
      const uint4 lo = lds128(w_at + row_g * 64 + t * 16);        // row g
      const uint4 hi = lds128(w_at + (row_g + 8) * 64 + t * 16);  // row g + 8
      zs[B][b][0] = lds32(stage + SZ_AT + (BLOCK * b + row_g) * 4);
      zs[B][b][1] = lds32(stage + SZ_AT + (BLOCK * b + row_g + 8) * 4);
      const uint32_t wl[4] = {lo.x, lo.y, lo.z, lo.w}, wh[4] = {hi.x, hi.y, hi.z, hi.w};
      // k16 block j: word j % 4, low nibbles for j < 4, high ones above; in a word, bytes 0
      // and 2 are the pair (2 t, 2 t + 1), bytes 1 and 3 the pair (2 t + 8, 2 t + 9)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t vl = wl[j & 3] >> (j < 4 ? 0 : 4), vh = wh[j & 3] >> (j < 4 ? 0 : 4);
        a[B][b][j][0] = lop_or_magic(vl, H::MAGIC);       // row g
        a[B][b][j][1] = lop_or_magic(vh, H::MAGIC);       // row g + 8
        a[B][b][j][2] = lop_or_magic(vl >> 8, H::MAGIC);  // row g, k + 8
        a[B][b][j][3] = lop_or_magic(vh >> 8, H::MAGIC);  // row g + 8, k + 8
      }
    }
  };
  // chunk i (its fragments in buffer B, its x at `stage`): its wgmma, X; meanwhile the next
  // chunk lands and is dequantized into the other buffer; then chunk i's sums scaled. Returns
  // the next chunk's stage.
  const auto step = [&](auto buffer, int i, uint32_t stage) {
    constexpr int B = decltype(buffer)::value;
    float dot[GROUPS][NB / 2];
    const uint64_t x_desc = descriptor(stage);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int b = 0; b < GROUPS; ++b)
#pragma unroll
      for (int j = 0; j < 8; ++j)  // block j's x: its atom and 32-byte column (>> 4: the field)
        wgmma<F16, NB>(dot[b], a[B][b][j],
                       x_desc + (((j >> 2) * NB * X_ATOM + 32 * (j & 3)) >> 4), j);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    // X for this lane's columns 2 t, 2 t + 1 of each n8 tile
    float xsum[NB / 8][4] = {};
#pragma unroll
    for (int n8 = 0; n8 < NB / 8; ++n8)
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        const int blk = j + (mat >> 1), c = 2 * (blk & 3) + (mat & 1);
        uint32_t d[4];
        ldmatrix4(d, stage + (blk >> 2) * NB * X_ATOM + swizzled(8 * n8 + (lane & 7), c));
        H::mma(xsum[n8], ones, d[0], d[1]);
        H::mma(xsum[n8], ones, d[2], d[3]);
      }
    uint32_t following = 0;
    if (i + 1 < mine) {
      following = land(i + 1);
      dequant(std::integral_constant<int, 1 - B>(), following);
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    fence_operands(dot);
#pragma unroll
    for (int b = 0; b < GROUPS; ++b) {
      const float sc[2] = {H::lo(zs[B][b][0]), H::lo(zs[B][b][1])};
      const float zc[2] = {fmaf(-H::BIAS, sc[0], H::hi(zs[B][b][0])),
                           fmaf(-H::BIAS, sc[1], H::hi(zs[B][b][1]))};
#pragma unroll
      for (int e = 0; e < NB / 2; ++e) {
        const int h = (e >> 1) & 1;  // wgmma's D: rows g (e % 4 < 2) and g + 8
        acc[b][e] = fmaf(zc[h], xsum[e >> 2][e & 1], fmaf(sc[h], dot[b][e], acc[b][e]));
      }
    }
    return following;
  };
  if (mine > 0) {
    uint32_t stage = land(0);
    dequant(std::integral_constant<int, 0>(), stage);
    int i = 0;
    for (; i + 1 < mine; i += 2) {
      stage = step(std::integral_constant<int, 0>(), i, stage);
      stage = step(std::integral_constant<int, 1>(), i + 1, stage);
    }
    if (i < mine) step(std::integral_constant<int, 0>(), i, stage);
  }
  asm volatile("cp.async.wait_all;\n" ::);
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

  // the CTA's partial [M][ROWS] (wgmma's D: warp w's rows 16 w + g (+ 8) of each block,
  // columns 2 t (+ 1), + 8 for the second n8 half)
  __syncthreads();
  float* sums = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int b = 0; b < GROUPS; ++b)
#pragma unroll
    for (int e = 0; e < NB / 2; ++e) {
      const int row = BLOCK * b + row_g + 8 * ((e >> 1) & 1);
      const int col = 8 * (e >> 2) + 2 * t + (e & 1);
      if (col < p.m) sums[col * ROWS + row] = acc[b][e];
    }
  __syncthreads();
  sum.exchange(sums, tid, blockDim.x);
  const gemv::Out out{p.out, p.ldo, p.n, F16 ? gemv::OUT_F16 : gemv::OUT_BF16};
  sum.store(sums, out, n0, tid, blockDim.x, [](int, int, float(&)[4]) {});
}

namespace {

int stage_bytes(int m, int groups) {  // x's atoms, the blocks' chunks, their scales; 1 KB aligned
  const int bytes = (m > 8 ? 16 : 8) * X_ATOM * 2 + groups * (W_BYTES + BLOCK * 4);
  return (bytes + 1023) & ~1023;
}

int smem_bytes(int m, int groups, int cluster, int* inbox_at) {
  const int rows = BLOCK * groups;
  const int rings = 1024 + STAGES * stage_bytes(m, groups), sums = rows * m * 4;  // + alignment
  *inbox_at = rings > sums ? rings : sums;
  return *inbox_at + gemv::inbox_bytes(rows * m, cluster);
}

template <bool F16, int NB, int GROUPS, int RANKS>
cudaError_t launch(const Params& p, int smem, cudaStream_t stream) {
  constexpr int ROWS = BLOCK * GROUPS;
  const unsigned ctas = static_cast<unsigned>((p.n + ROWS - 1) / ROWS * RANKS);
  return gemv::launch_in_clusters<w4a16_wgmma<F16, NB, GROUPS, RANKS>>(ctas, 128, smem, RANKS,
                                                                         stream, p);
}

template <bool F16, int NB>
cudaError_t by_cluster(const Params& p, int smem, int groups, int cluster, cudaStream_t s) {
  const auto at = [&](auto blocks) {
    constexpr int GROUPS = decltype(blocks)::value;
    switch (cluster) {
      case 1: return launch<F16, NB, GROUPS, 1>(p, smem, s);
      case 2: return launch<F16, NB, GROUPS, 2>(p, smem, s);
      case 4: return launch<F16, NB, GROUPS, 4>(p, smem, s);
      default: return launch<F16, NB, GROUPS, 8>(p, smem, s);
    }
  };
  return groups == 2 ? at(std::integral_constant<int, 2>()) : at(std::integral_constant<int, 1>());
}

template <bool F16>
cudaError_t by_shape(const Params& p, int smem, int groups, int cluster, cudaStream_t s) {
  return p.m > 8 ? by_cluster<F16, 16>(p, smem, groups, cluster, s)
                 : by_cluster<F16, 8>(p, smem, groups, cluster, s);
}

}  // namespace

extern "C" {

// out[m, ldo] = x[m, ldx] @ dequant(w)[n, k].T with scales_and_zeros [k / 128, n, 2], x, the
// scales and out bf16 (f16 = 0) or f16, on CTAs of `groups` 64-row blocks (1 or 2) in clusters
// of `cluster` (1, 2, 4 or 8); a CUDA error code. The caller checks the operands
// (x's rows and base and w 16-byte aligned, scales_and_zeros 4-byte aligned and contiguous).
int w4a16_wgmma(const void* x, const void* w, const void* scales_and_zeros, void* out, int m,
                int n, int k, long long ldx, long long ldo, int f16, int groups, int cluster,
                void* stream) {
  if (m < 1 || m > MAX_M || n < 1 || k % CHUNK || k < CHUNK * cluster ||
      (groups != 1 && groups != 2) ||
      (cluster != 1 && cluster != 2 && cluster != 4 && cluster != 8) ||
      ldx % 8 || ldo < n)
    return static_cast<int>(cudaErrorInvalidValue);
  Params p;
  p.x = static_cast<const uint16_t*>(x);
  p.w = static_cast<const uint8_t*>(w);
  p.sz = static_cast<const uint32_t*>(scales_and_zeros);
  p.out = out;
  p.ldx = ldx;
  p.ldo = ldo;
  p.m = m;
  p.n = n;
  p.k = k;
  p.f16 = f16;
  p.stage_bytes = stage_bytes(m, groups);
  const int smem = smem_bytes(m, groups, cluster, &p.inbox_at);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return static_cast<int>(f16 ? by_shape<true>(p, smem, groups, cluster, s)
                              : by_shape<false>(p, smem, groups, cluster, s));
}

}  // extern "C"

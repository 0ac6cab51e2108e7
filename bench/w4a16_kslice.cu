// Bench-only prototype: a W4A16 decode GEMM (M <= 16, bf16, group 128) whose warps stream the
// weight straight into registers, x the mma's A operand: out[M, N] = x[M, K] @ dequant(w)[N, K]^T.
//
// Why another design: the product's kernel (tuner/candidates/cuda_kernels/w4a16_gemv.cu) takes the
// weight as the mma's A operand and x as B, one n8 tile of x's rows per mma, so at M = 9-16 every
// dequantized fragment feeds two mma and x's [M, 128] slab is copied per warp and chunk (as many
// bytes as the warp's weight at M = 16). Here x is A (m16: M <= 16 rows in one mma) and the
// weight B (n8 x k16 fragments): one mma per dequantized fragment at any M <= 16.
//
// - A CTA owns R = G x T tiles of 8 output columns and a run of K (all of it, or 1 / C of it in a
//   cluster of C CTAs). x's [16, run] block is copied into shared memory once, by bulk copies that
//   count their bytes on one mbarrier per 128-value slice (rows past M are zeros).
// - Warp (h, u) of its G x H warps takes tile group u's T tiles over the h-th of H shares of the
//   run's slices. Per slice it loads x's eight A fragments (ldmatrix) and x's row sums over the
//   slice (an mma with ones a k16 block), then per tile dequantizes 16 bytes a lane of the weight
//   (our layout: [K / 128][N / 8][32 lanes][16 bytes], lane (g, t) holding column 8 tile + g at
//   k = 16 b + 2 t + {0, 1, 8, 9} of the slice's eight k16 blocks b, word b / 2, nibbles at bits
//   4 p: p = 0, 4 (b even, k 2t, 2t+1), 1, 5 (b even, 2t+8, 2t+9), 2, 6 and 3, 7 (b odd)), read
//   AHEAD slices ahead with plain loads beside the tiles' (scale, zero) pairs (torch's [K / 128,
//   N, 2]).
// - A nibble q becomes bf16 128 + q (q | 0x4300); a tile's slice dot d = sum (128 + q) x, then
//   y += s d + (zero - 136 s) X with X x's row sum. The warps' y go to shared memory, are summed
//   over the H shares in order, and in a cluster rank r sums the ranks' of its share of the
//   columns (distributed shared memory) and stores them: deterministic, no atomics.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#ifndef KS_TILES
#define KS_TILES 4
#endif
#ifndef KS_AHEAD
#define KS_AHEAD 2
#endif
#ifndef KS_WARPS
#define KS_WARPS 16
#endif
#ifndef KS_MIN_CTAS
#define KS_MIN_CTAS 1
#endif
#ifndef KS_RING
#define KS_RING 0  // 1: the weight and its pairs through a per-warp cp.async ring in shared memory
#endif
#ifndef KS_XGROUP
#define KS_XGROUP 1  // slices of x a bulk copy (and an mbarrier)
#endif

namespace cg = cooperative_groups;

constexpr int TILES = KS_TILES;  // T: tiles a warp
constexpr int AHEAD = KS_AHEAD;  // slices of weight in flight a warp
constexpr int WARPS = KS_WARPS;  // the most a CTA takes
constexpr int SLICE = 128;
constexpr int XPAD = 8;  // bf16 past a row of x's block: rows 16 bytes apart mod 128 (ldmatrix)
constexpr uint32_t MAGIC = 0x43004300u;  // bf16 128.0 in both halves
constexpr uint32_t ONES = 0x3f803f80u;   // bf16 1.0 in both halves

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t nib(uint32_t w) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(r) : "r"(w), "n"(0x000f000f), "n"(MAGIC));
  return r;  // (w & mask) | magic
}

__device__ __forceinline__ void mbar_wait(uint32_t bar) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n"
      " @!p bra WAIT_%=;\n}\n" ::"r"(bar));
}

// bench knobs: -DKS_LOAD=0 ld.global.nc.L1::no_allocate (default), 1 ld.global.nc, 2 ld.global;
// -DKS_COPIES_ONLY=1 streams the weight and computes nothing (the output wrong)
#ifndef KS_LOAD
#define KS_LOAD 0
#endif
#ifndef KS_COPIES_ONLY
#define KS_COPIES_ONLY 0
#endif
#if KS_LOAD == 0
#define KS_LD "ld.global.nc.L1::no_allocate.v4.u32"
#elif KS_LOAD == 1
#define KS_LD "ld.global.nc.v4.u32"
#else
#define KS_LD "ld.global.v4.u32"
#endif

__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
  uint4 v;
  asm volatile(KS_LD " {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ uint2 ldg_pair(const uint2* p) {
  uint2 v;
  asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// a ring stage of a warp: T tiles of 16 weight bytes a lane, then T of 8 (scale, zero) bytes
constexpr int STAGE_BYTES = TILES * 32 * 24;
constexpr int RING_STAGES = AHEAD + 1;
// a warp's own shared memory: its ring (if any), then, once streamed, its [16][8 T] sums
constexpr int AREA = KS_RING ? RING_STAGES * STAGE_BYTES : 16 * 8 * TILES * 4;

__global__ void __launch_bounds__(WARPS * 32, KS_MIN_CTAS)
    kslice_gemv(const __nv_bfloat16* __restrict__ x, const uint4* __restrict__ w,
                const uint2* __restrict__ sz, __nv_bfloat16* __restrict__ out, int M, int N, int K,
                int G, int C) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int NT = N / 8, Sc = K / SLICE / C, Kc = Sc * SLICE, R = G * TILES;
  const int H = blockDim.x / 32 / G;
  const int rank = blockIdx.x % C, block = blockIdx.x / C;
  const int t0 = block * R, Rn = min(R, NT - t0);
  const int xrow = Kc + XPAD, srow = 8 * R + 8;
  __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem);
  float* parts = reinterpret_cast<float*>(smem + 16 * xrow * 2);  // [warp][AREA / 4]
  float* sums = parts + (blockDim.x / 32) * (AREA / 4);             // [16][8 R + 8]
  uint64_t* bars = reinterpret_cast<uint64_t*>(sums + 16 * srow);
  unsigned char* ring = reinterpret_cast<unsigned char*>(parts + (threadIdx.x >> 5) * (AREA / 4));
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;

  // x's rows past M are left as they are: they only make output rows that are never stored
  const int XG = KS_XGROUP, groups = (Sc + XG - 1) / XG;
  for (int i = tid; i < groups; i += blockDim.x)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_addr(bars + i)));
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  __syncthreads();
  if (warp == 0) {  // x's block, XG slices at a time: lane m copies row m's 256 XG bytes
    for (int gi = 0; gi < groups; ++gi) {
      const uint32_t bar = smem_addr(bars + gi);
      const int bytes = min(XG, Sc - gi * XG) * SLICE * 2;
      if (lane == 0)
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
                     "r"(M * bytes));
      __syncwarp();
      if (lane < M) {
        const __nv_bfloat16* src =
            x + static_cast<size_t>(lane) * K + (rank * Sc + gi * XG) * SLICE;
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
            "[%3];\n" ::"r"(smem_addr(xs + lane * xrow + gi * XG * SLICE)),
            "l"(src), "r"(bytes), "r"(bar)
            : "memory");
      }
    }
  }

  const int u = warp % G, h = warp / G;
  const int j0 = Sc * h / H, j1 = Sc * (h + 1) / H;  // this warp's slices of the run
  const int tile0 = t0 + u * TILES;
  const bool active = u * TILES < Rn;
  float y[TILES][4] = {};
  if (active) {
    // tile group u's weight and (scale, zero) pairs at slice j0; a slice further: + NT tiles
    const uint4* wp = w + (static_cast<size_t>(rank * Sc + j0) * NT + tile0) * 32 + lane;
    const uint2* sp = sz + (static_cast<size_t>(rank * Sc + j0) * N + 8 * tile0 + 2 * t) / 2;
    const size_t w_step = static_cast<size_t>(NT) * 32, s_step = N / 2;
#if KS_RING
    auto fetch = [&](int j, int stage) {  // slice j's T tiles and pairs into a ring stage
      const size_t ahead = static_cast<size_t>(j - j0);
      const uint32_t base = smem_addr(ring + stage * STAGE_BYTES);
#pragma unroll
      for (int v = 0; v < TILES; ++v) {
        cp_async16(base + (v * 32 + lane) * 16, wp + ahead * w_step + v * 32);
        cp_async8(base + TILES * 512 + (v * 32 + lane) * 8, sp + ahead * s_step + v * 4);
      }
    };
#pragma unroll
    for (int a = 0; a < AHEAD; ++a) {
      if (j0 + a < j1) fetch(j0 + a, a);
      cp_async_commit();
    }
    for (int j = j0; j < j1; ++j) {
      {
        cp_async_wait<AHEAD - 1>();
        const unsigned char* stage = ring + ((j - j0) % RING_STAGES) * STAGE_BYTES;
        uint4 wq[TILES];
        uint2 sq[TILES];
#pragma unroll
        for (int v = 0; v < TILES; ++v) {
          wq[v] = *reinterpret_cast<const uint4*>(stage + (v * 32 + lane) * 16);
          sq[v] = *reinterpret_cast<const uint2*>(stage + TILES * 512 + (v * 32 + lane) * 8);
        }
        if (j + AHEAD < j1) fetch(j + AHEAD, (j - j0 + AHEAD) % RING_STAGES);
        cp_async_commit();
#define WQ(v) wq[v]
#define SQ(v) sq[v]
#else
    uint4 wbuf[AHEAD][TILES];
    uint2 sbuf[AHEAD][TILES];
#pragma unroll
    for (int a = 0; a < AHEAD; ++a)
#pragma unroll
      for (int v = 0; v < TILES; ++v)
        if (j0 + a < j1) {
          wbuf[a][v] = ldg_stream(wp + a * w_step + v * 32);
          sbuf[a][v] = ldg_pair(sp + a * s_step + v * 4);
        }
    for (int jb = j0; jb < j1; jb += AHEAD) {
#pragma unroll
      for (int a = 0; a < AHEAD; ++a) {
        const int j = jb + a;
        if (j >= j1) break;
#define WQ(v) wbuf[a][v]
#define SQ(v) sbuf[a][v]
#endif
        mbar_wait(smem_addr(bars + j / XG));
        uint32_t xa[8][4];
#pragma unroll
        for (int b = 0; b < 8; ++b) {
          const uint32_t p =
              smem_addr(xs + (lane & 15) * xrow + j * SLICE + 16 * b + 8 * (lane >> 4));
          asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                       : "=r"(xa[b][0]), "=r"(xa[b][1]), "=r"(xa[b][2]), "=r"(xa[b][3])
                       : "r"(p));
        }
        // the tiles' dots and x's row sums: T + 1 chains of 8 mma, interleaved k16 block by block
        float d[TILES + 1][4] = {};
#if KS_COPIES_ONLY
#pragma unroll
        for (int v = 0; v < TILES; ++v)
          d[v][0] = __uint_as_float(WQ(v).x ^ WQ(v).y ^ WQ(v).z ^ WQ(v).w);
#pragma unroll
        for (int b = 0; b < 0; ++b) {
#else
#pragma unroll
        for (int b = 0; b < 8; ++b) {
#endif
#pragma unroll
          for (int v = 0; v < TILES; ++v) {
            const uint4 q = WQ(v);
            const uint32_t word = b < 2 ? q.x : b < 4 ? q.y : b < 6 ? q.z : q.w;
            const int shift = 8 * (b & 1);
            mma(d[v], xa[b], nib(word >> shift), nib(word >> (shift + 4)));
          }
          mma(d[TILES], xa[b], ONES, ONES);
        }
#if !KS_RING
        const bool more = j + AHEAD < j1;
        const size_t ahead = static_cast<size_t>(j + AHEAD - j0);
#endif
#pragma unroll
        for (int v = 0; v < TILES; ++v) {
          const uint2 s = SQ(v);
#if !KS_RING
          if (more) {
            wbuf[a][v] = ldg_stream(wp + ahead * w_step + v * 32);
            sbuf[a][v] = ldg_pair(sp + ahead * s_step + v * 4);
          }
#endif
          const float s0 = __uint_as_float(s.x << 16), z0 = __uint_as_float(s.x & 0xffff0000u);
          const float s1 = __uint_as_float(s.y << 16), z1 = __uint_as_float(s.y & 0xffff0000u);
          const float c0 = fmaf(-136.f, s0, z0), c1 = fmaf(-136.f, s1, z1);
          const float xg = d[TILES][0], xg8 = d[TILES][2];  // x's row sums, rows g and g + 8
          y[v][0] = fmaf(s0, d[v][0], fmaf(c0, xg, y[v][0]));
          y[v][1] = fmaf(s1, d[v][1], fmaf(c1, xg, y[v][1]));
          y[v][2] = fmaf(s0, d[v][2], fmaf(c0, xg8, y[v][2]));
          y[v][3] = fmaf(s1, d[v][3], fmaf(c1, xg8, y[v][3]));
        }
      }
    }
  }
  __syncwarp();  // the lanes are past their last reads of the ring the sums now take
  float* mine = parts + warp * (AREA / 4);  // [16][8 T]
#pragma unroll
  for (int v = 0; v < TILES; ++v) {
    *reinterpret_cast<float2*>(mine + g * 8 * TILES + 8 * v + 2 * t) = make_float2(y[v][0], y[v][1]);
    *reinterpret_cast<float2*>(mine + (g + 8) * 8 * TILES + 8 * v + 2 * t) =
        make_float2(y[v][2], y[v][3]);
  }
  __syncthreads();
  const int cols = 8 * Rn;
  for (int e = tid; e < M * cols; e += blockDim.x) {  // the H shares of each tile group, in order
    const int m = e / cols, c = e % cols, group = c / (8 * TILES), cc = c % (8 * TILES);
    float v = 0.f;
    for (int hh = 0; hh < H; ++hh) v += parts[(hh * G + group) * (AREA / 4) + m * 8 * TILES + cc];
    if (C == 1)
      out[static_cast<size_t>(m) * N + 8 * t0 + c] = __float2bfloat16(v);
    else
      sums[m * srow + c] = v;
  }
  if (C == 1) return;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  const int share = (cols + C - 1) / C;
  const int c_lo = min(cols, rank * share), width = min(cols, c_lo + share) - c_lo;
  for (int e = tid; e < M * width; e += blockDim.x) {
    const int m = e / width, c = c_lo + e % width;
    float v = 0.f;
    for (int r = 0; r < C; ++r) v += cluster.map_shared_rank(sums, r)[m * srow + c];
    out[static_cast<size_t>(m) * N + 8 * t0 + c] = __float2bfloat16(v);
  }
  cluster.sync();
}

// out = x @ dequant(w).T for x [M, K] bf16 (row-major, contiguous), w our layout, sz torch's
// [K / 128, N, 2] bf16; CTAs of `warps` warps (G tile groups of TILES tiles, warps / G shares of
// K), in clusters of C along K; 0 or a CUDA error.
extern "C" int kslice_gemv_launch(const void* x, const void* w, const void* sz, void* out, int M,
                                  int N, int K, int G, int warps, int C, cudaStream_t stream) {
  if (M < 1 || M > 16 || N % 8 || K % SLICE || (K / SLICE) % C || warps > WARPS || warps % G)
    return cudaErrorInvalidValue;
  const int Sc = K / SLICE / C, NT = N / 8, R = G * TILES, blocks = (NT + R - 1) / R;
  const int smem = 16 * (Sc * SLICE + XPAD) * 2 + warps * AREA + 16 * (8 * R + 8) * 4 + Sc * 8;
  cudaError_t e =
      cudaFuncSetAttribute(kslice_gemv, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return e;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks * C);
  config.blockDim = dim3(warps * 32);
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(C);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  e = cudaLaunchKernelEx(&config, kslice_gemv, static_cast<const __nv_bfloat16*>(x),
                         static_cast<const uint4*>(w), static_cast<const uint2*>(sz),
                         static_cast<__nv_bfloat16*>(out), M, N, K, G, C);
  return e == cudaSuccess ? cudaGetLastError() : e;
}

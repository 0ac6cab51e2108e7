// An FP8 decode GEMM on Hopper's native FP8 tensor-core path (wgmma), M <= 16:
// out[M, N] = (a[M, K] @ b[N, K]^T) * scale_a * scale_b, e4m3 operands, fp32 scales (one each,
// or a's per row and b's per row: "rowwise"), out bf16, f16 or f32.
//
// One warpgroup a CTA owns 64 rows of the weight b (wgmma's A, K-major) and a run of K; a's M
// rows are wgmma's B (n = 8 or 16, K-major). A cluster of 1, 2 or 4 CTAs splits K and sums its
// partials through distributed shared memory (each rank pushes the others' shares of its sums
// into their inboxes), so no partial goes through global memory: no workspace, no second pass,
// a fixed sum order. wgmma takes e4m3 as it is (sm_90's mma.sync would convert it to f16 first,
// twice the instructions a byte).
//
// A stage holds ATOMS runs of 128 K bytes: b's 64 rows of each (8 KB), then a's NB rows, all in
// the 128-byte swizzle wgmma's K-major descriptors read (8-row atoms of 1 KB, 16-byte piece c
// of row r at ((c ^ r % 8) * 16)), filled by cp.async from all 128 threads. An atom's four
// m64nNk32 wgmma (128 products) start from zero and are added to the fp32 sums apart: partial
// sums promoted to fp32 every 128 products, as _scaled_mm does without use_fast_accum. The
// scales the stores take are copied in with the first stage, so nothing waits on them until
// the end. Launched as a plain grid, as the W4A16 kernel is: after a kernel that does not
// trigger its dependents early (a model's norms and activations), waiting on the SMs for it
// costs more than the early start saves.
//
// Compile-time: FP8_GEMV_STAGES (3-12), FP8_GEMV_ATOMS (1-2); bench builds only:
// FP8_GEMV_TRACE=1 (per-CTA stamps of the last launch, fp8_gemv_trace), FP8_GEMV_DEPENDENT=1
// (a programmatic dependent launch that waits with griddepcontrol.wait before any global
// access). sm_90a only.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

#include "cluster_launch.cuh"

#ifndef FP8_GEMV_STAGES
#define FP8_GEMV_STAGES 6
#endif
#ifndef FP8_GEMV_ATOMS
#define FP8_GEMV_ATOMS 2
#endif
#ifndef FP8_GEMV_TRACE
#define FP8_GEMV_TRACE 0
#endif
#ifndef FP8_GEMV_DEPENDENT
#define FP8_GEMV_DEPENDENT 0
#endif

namespace cg = cooperative_groups;

constexpr int STAGES = FP8_GEMV_STAGES;
constexpr int ROWS = 64;      // weight rows a CTA
constexpr int ATOM = 128;     // K bytes of a swizzle atom's rows
constexpr int ATOMS = FP8_GEMV_ATOMS;  // atoms a stage (each its own 128 products, summed apart)
constexpr int CHUNK = ATOM * ATOMS;  // K bytes a stage
constexpr int A_BYTES = ROWS * CHUNK;  // the weight's atoms, ROWS * ATOM bytes each, then x's
constexpr int MAX_M = 16;
static_assert(STAGES >= 3 && STAGES <= 12, "3..12 stages");
static_assert(ATOMS == 1 || ATOMS == 2, "one or two atoms a stage");

// Trace: per CTA [smid, globaltimer at start and end, clock64 at start, after the wait, when the
// first chunk landed, when the loop ended, when the cluster's sums were in, at the end].
enum Field { SMID, G_START, G_END, C_START, C_WAITED, C_FIRST, C_LOOP, C_SUMMED, C_END, FIELDS };
#if FP8_GEMV_TRACE
constexpr int TRACE_CTAS = 1024;
__device__ unsigned long long g_trace[TRACE_CTAS * FIELDS];
#endif

__device__ __forceinline__ void stamp(Field field) {
#if FP8_GEMV_TRACE
  if (threadIdx.x != 0 || blockIdx.x >= TRACE_CTAS) return;
  unsigned long long v;
  if (field == SMID) {
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    v = s;
  } else if (field == G_START || field == G_END) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(v));
  } else {
    v = clock64();
  }
  g_trace[blockIdx.x * FIELDS + field] = v;
#endif
}

struct Params {
  const uint8_t* a;  // [M, K] activations
  const uint8_t* b;  // [N, K] weight
  const float* scale_a;
  const float* scale_b;
  void* out;  // [M, N], rows ldo apart, of out_kind
  long long lda, ldb, ldo;
  int m, n, k, rowwise, out_kind;
  int stage_bytes;
  int inbox_at;  // (a cluster) an mbarrier, then [ranks][a share of the outputs]
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void copy16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void copy4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
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

enum OutKind { OUT_BF16, OUT_F16, OUT_F32 };

__device__ __forceinline__ void store(const Params& p, long long at, float v) {
  if (p.out_kind == OUT_BF16)
    static_cast<__nv_bfloat16*>(p.out)[at] = __float2bfloat16_rn(v);
  else if (p.out_kind == OUT_F16)
    static_cast<__half*>(p.out)[at] = __float2half_rn(v);
  else
    static_cast<float*>(p.out)[at] = v;
}

// Two pairs of 16-bit outputs as the 8 bytes one store writes.
template <typename Pair>
__device__ __forceinline__ uint2 as_bits(Pair lo, Pair hi) {
  return make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                    *reinterpret_cast<const uint32_t*>(&hi));
}

// Four outputs at `at` (a multiple of 4 elements into a 16-byte aligned out): one store.
__device__ __forceinline__ void store4(const Params& p, long long at, const float (&v)[4]) {
  if (p.out_kind == OUT_F32) {
    reinterpret_cast<float4*>(static_cast<float*>(p.out) + at)[0] =
        make_float4(v[0], v[1], v[2], v[3]);
    return;
  }
  const uint2 bits =
      p.out_kind == OUT_BF16
          ? as_bits(__floats2bfloat162_rn(v[0], v[1]), __floats2bfloat162_rn(v[2], v[3]))
          : as_bits(__floats2half2_rn(v[0], v[1]), __floats2half2_rn(v[2], v[3]));
  reinterpret_cast<uint2*>(static_cast<uint16_t*>(p.out) + at)[0] = bits;
}

template <int NB>
__device__ __forceinline__ void wgmma(float (&d)[NB / 2], uint64_t da, uint64_t db, int accumulate);

template <>
__device__ __forceinline__ void wgmma<8>(float (&d)[4], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, %4, %5, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(da), "l"(db), "r"(accumulate));
}

template <>
__device__ __forceinline__ void wgmma<16>(float (&d)[8], uint64_t da, uint64_t db,
                                          int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, "
      "%8, %9, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7])
      : "l"(da), "l"(db), "r"(accumulate));
}

template <int NB, int RANKS>
__global__ void __launch_bounds__(128, 1) fp8_gemv(Params p) {
  extern __shared__ __align__(1024) unsigned char smem[];
  stamp(G_START);
  stamp(C_START);
  stamp(SMID);
  cg::cluster_group cluster = cg::this_cluster();
  constexpr int ranks = RANKS;  // the cluster's size, a power of two: its divisions are shifts
  // each rank's share of the M x 64 outputs is whole runs of four: a run of a thread never
  // crosses a share or an x row, and the shares' sizes are exact
  static_assert(ROWS % (4 * RANKS) == 0, "a rank's share must be whole runs of four outputs");
  const int rank = static_cast<int>(cluster.block_rank());
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int outputs = ROWS * p.m;
  const uint32_t inbox_bar = smem_addr(smem + p.inbox_at);
  float* inbox = reinterpret_cast<float*>(smem + p.inbox_at + 16);  // 16-byte aligned rows
  if constexpr (ranks > 1) {
    if (tid == 0) {
      const int mine_q = (rank + 1) * outputs / ranks - rank * outputs / ranks;
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(inbox_bar));
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(inbox_bar),
                   "r"((ranks - 1) * mine_q * 4)
                   : "memory");
    }
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::);
  }

  const int n0 = (blockIdx.x / ranks) * ROWS;
  // the outputs rank r sums and stores: [q_lo(r), q_lo(r + 1)) of the CTA's M x 64
  const auto q_lo = [&](int r) { return r * outputs / ranks; };
  const int chunks = p.k / CHUNK;
  const int c_lo = static_cast<int>(static_cast<long long>(rank) * chunks / ranks);
  const int c_hi = static_cast<int>(static_cast<long long>(rank + 1) * chunks / ranks);
  const int mine = c_hi - c_lo;
  // the swizzle atoms want 1 KB alignment: the ring starts at the first 1 KB boundary
  const uint32_t ring = (smem_addr(smem) + 1023) & ~1023u;

  // this thread's pieces: four of b's 64 rows (row q / 8, piece q % 8 for q = tid + 128 i) and
  // one of a's (tid < 8 NB); addresses made once, moved on by a chunk a copy
  const int r0 = tid >> 3, c = tid & 7;
  const uint8_t* b_src = p.b + (n0 + r0) * p.ldb + static_cast<long long>(c_lo) * CHUNK + c * 16;
  const long long b_rows16 = 16 * p.ldb;  // rows q / 8 of q = tid + 128 i: 16 i rows on
  uint32_t b_valid = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    if (n0 + r0 + 16 * i < p.n) b_valid |= 1u << i;
  const bool a_copies = tid < 8 * NB, a_valid = r0 < p.m;
  const uint8_t* a_src = p.a + (a_valid ? r0 * p.lda : 0) + static_cast<long long>(c_lo) * CHUNK + c * 16;
  const uint32_t b_dst = swizzled(r0, c), a_dst = A_BYTES + swizzled(r0, c);  // + 1 KB x 2 i
  const auto issue = [&](uint32_t stage) {
#pragma unroll
    for (int at = 0; at < ATOMS; ++at) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const bool valid = b_valid >> i & 1;
        copy16(stage + at * ROWS * ATOM + b_dst + 2048 * i,
               valid ? b_src + at * ATOM + i * b_rows16 : p.b, valid);
      }
      if (a_copies) copy16(stage + at * NB * ATOM + a_dst, a_src + at * ATOM, a_valid);
    }
    b_src += CHUNK;
    a_src += CHUNK;
  };

  float acc[NB / 2] = {};
  if constexpr (FP8_GEMV_DEPENDENT) asm volatile("griddepcontrol.wait;\n" ::: "memory");
  stamp(C_WAITED);
  const int stage_bytes = p.stage_bytes;
  // the scales the stores take, copied with the first chunk (a load into a register would
  // hold the thread until it lands, behind the prologue's copies)
  __shared__ float x_scale[MAX_M], w_scale[ROWS];
  if (tid < p.m) copy4(smem_addr(x_scale + tid), p.scale_a + (p.rowwise ? tid : 0));
  if (tid < ROWS)
    copy4(smem_addr(w_scale + tid), p.scale_b + (p.rowwise && n0 + tid < p.n ? n0 + tid : 0));
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < mine) issue(ring + s * stage_bytes);
    asm volatile("cp.async.commit_group;\n" ::);
  }
  int slot = 0, next = STAGES - 1;  // the stage computed, the stage filled
  for (int i = 0; i < mine; ++i) {
    // chunk i landed (this thread's copies), visible to wgmma's async proxy, then everyone's;
    // the barrier also frees the stage chunk i - 1 took, which the next copy overwrites
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    if (i == 0) stamp(C_FIRST);
    if (i + STAGES - 1 < mine) issue(ring + next * stage_bytes);
    asm volatile("cp.async.commit_group;\n" ::);
    const uint32_t stage = ring + slot * stage_bytes;
    slot = slot + 1 == STAGES ? 0 : slot + 1;
    next = next + 1 == STAGES ? 0 : next + 1;
    float part[ATOMS][NB / 2];
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int at = 0; at < ATOMS; ++at)
        wgmma<NB>(part[at], descriptor(stage + at * ROWS * ATOM + 32 * j),
                  descriptor(stage + A_BYTES + at * NB * ATOM + 32 * j), j);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
    for (int at = 0; at < ATOMS; ++at)
#pragma unroll
      for (int e = 0; e < NB / 2; ++e) acc[e] += part[at][e];
  }
  stamp(C_LOOP);
  asm volatile("cp.async.wait_all;\n" ::);
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

  // the CTA's partial [M][64] (wgmma's D: warp w's rows 16 w + g (+ 8), columns 2 t (+ 1),
  // + 8 for the second n8 half)
  __syncthreads();
  float* sums = reinterpret_cast<float*>(smem);
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int e = 0; e < NB / 2; ++e) {
    const int row = 16 * warp + g + 8 * ((e >> 1) & 1), col = 8 * (e >> 2) + 2 * t + (e & 1);
    if (col < p.m) sums[col * ROWS + row] = acc[e];
  }
  __syncthreads();
  const int share = (outputs + ranks - 1) / ranks;
  if constexpr (ranks > 1) {
    asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
#pragma unroll
    for (int r = 0; r < ranks; ++r) {
      if (r == rank) continue;
      uint32_t to, bar;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
                   : "=r"(to)
                   : "r"(smem_addr(inbox + rank * share - q_lo(r))), "r"(r));
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(bar) : "r"(inbox_bar), "r"(r));
      // four outputs a thread, one 16-byte store (a share is a multiple of 4 outputs)
      for (int q = q_lo(r) + 4 * tid; q < q_lo(r + 1); q += 4 * blockDim.x) {
        const float4 v = *reinterpret_cast<const float4*>(sums + q);
        asm volatile(
            "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, "
            "%4}, [%5];\n" ::"r"(to + q * 4),
            "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(__float_as_uint(v.z)),
            "r"(__float_as_uint(v.w)), "r"(bar)
            : "memory");
      }
    }
    asm volatile(
        "{\n.reg .pred done;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], 0;\n"
        "@!done bra WAIT_%=;\n}\n" ::"r"(inbox_bar)
        : "memory");
  }
  stamp(C_SUMMED);
  // four consecutive outputs a thread: one weight row run of one x row, summed in rank order
  const bool wide_stores = p.ldo % 4 == 0 && reinterpret_cast<uintptr_t>(p.out) % 16 == 0;
  for (int q = q_lo(rank) + 4 * tid; q < q_lo(rank + 1); q += 4 * blockDim.x) {
    float v[4] = {};
#pragma unroll
    for (int r = 0; r < ranks; ++r) {
      const float4 part = *reinterpret_cast<const float4*>(
          r == rank ? sums + q : inbox + r * share + q - q_lo(rank));
      v[0] += part.x;
      v[1] += part.y;
      v[2] += part.z;
      v[3] += part.w;
    }
    const int col = q / ROWS, row = q % ROWS;
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] *= x_scale[col] * w_scale[row + i];
    const long long at = col * p.ldo + n0 + row;
    if (wide_stores && n0 + row + 3 < p.n) {
      store4(p, at, v);
    } else {
      for (int i = 0; i < 4 && n0 + row + i < p.n; ++i) store(p, at + i, v[i]);
    }
  }
  stamp(C_END);
  stamp(G_END);
}

namespace {

int stage_bytes(int m) { return A_BYTES + (m > 8 ? 16 : 8) * CHUNK; }

int smem_bytes(int m, int cluster, int* inbox_at) {
  const int rings = 1024 + STAGES * stage_bytes(m), sums = ROWS * m * 4;  // + the alignment
  *inbox_at = rings > sums ? rings : sums;
  const int outputs = ROWS * m;
  return *inbox_at + (cluster > 1 ? 16 + cluster * ((outputs + cluster - 1) / cluster) * 4 : 0);
}

template <int NB, int RANKS>
cudaError_t launch(const Params& p, int smem, cudaStream_t stream) {
  const unsigned ctas = static_cast<unsigned>((p.n + ROWS - 1) / ROWS * RANKS);
  return gemv::launch_in_clusters<fp8_gemv<NB, RANKS>, FP8_GEMV_DEPENDENT>(ctas, 128, smem, RANKS,
                                                                           stream, p);
}

}  // namespace

extern "C" {

// e4m3 x e4m3: out[m, ldo] = (a[m, lda] @ b[n, ldb].T) * scale_a * scale_b, out of out_kind
// (0 bf16, 1 f16, 2 f32); a CUDA error code. The caller checks the operands (16-byte aligned
// rows and bases, 4-byte aligned contiguous scales, K whole stages, M <= 16).
int fp8_gemv(const void* a, const void* b, const void* scale_a, const void* scale_b, void* out,
             int m, int n, int k, long long lda, long long ldb, long long ldo, int rowwise,
             int out_kind, int cluster, void* stream) {
  if (m < 1 || m > MAX_M || n < 1 || k % CHUNK || k < CHUNK * cluster ||
      (cluster != 1 && cluster != 2 && cluster != 4) || lda % 16 || ldb % 16 || ldo < n ||
      out_kind < OUT_BF16 || out_kind > OUT_F32)
    return static_cast<int>(cudaErrorInvalidValue);
  Params p;
  p.a = static_cast<const uint8_t*>(a);
  p.b = static_cast<const uint8_t*>(b);
  p.scale_a = static_cast<const float*>(scale_a);
  p.scale_b = static_cast<const float*>(scale_b);
  p.out = out;
  p.out_kind = out_kind;
  p.lda = lda;
  p.ldb = ldb;
  p.ldo = ldo;
  p.m = m;
  p.n = n;
  p.k = k;
  p.rowwise = rowwise;
  p.stage_bytes = stage_bytes(m);
  const int smem = smem_bytes(m, cluster, &p.inbox_at);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const auto by_cluster = [&](auto nb) {
    constexpr int NB = decltype(nb)::value;
    switch (cluster) {
      case 1: return launch<NB, 1>(p, smem, s);
      case 2: return launch<NB, 2>(p, smem, s);
      default: return launch<NB, 4>(p, smem, s);
    }
  };
  return static_cast<int>(m > 8 ? by_cluster(std::integral_constant<int, 16>())
                                : by_cluster(std::integral_constant<int, 8>()));
}

// The stamps fp8_gemv_trace copies out: CTAs (0 unless FP8_GEMV_TRACE) x fields.
void fp8_gemv_trace_shape(int* ctas, int* fields) {
#if FP8_GEMV_TRACE
  *ctas = TRACE_CTAS;
#else
  *ctas = 0;
#endif
  *fields = FIELDS;
}

// The stamps of the last traced launch (an error unless FP8_GEMV_TRACE).
int fp8_gemv_trace(unsigned long long* out) {
#if FP8_GEMV_TRACE
  return static_cast<int>(cudaMemcpyFromSymbol(out, g_trace, sizeof(g_trace)));
#else
  (void)out;
  return static_cast<int>(cudaErrorInvalidValue);
#endif
}

}  // extern "C"

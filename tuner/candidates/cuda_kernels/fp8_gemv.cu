// FP8 decode GEMM (M <= 16): out[M, N] = (x[M, K] @ w[N, K]^T) * scale_x * scale_w, what
// torch._scaled_mm(x, w.T, scale_x, scale_w) computes, with x and w in e4m3 / e5m2.
//
// A memory-bound stream: each weight byte is read once, straight from global memory into the
// registers that the tensor cores' mma.m16n8k32 takes as its A operand, with no shared-memory
// ring, no dequantization and no layout of our own. In a dot product the order of K does not
// matter as long as both operands follow it, so lane (g, t) of a warp takes the 16 bytes at 16 t
// of a 64-byte span of K from weight rows g and g + 8 (one 16-byte load each) and the same 16
// bytes of x's row g: bytes 0-7 of each feed one mma (its k-slots 4t..4t+3 and 16+4t..16+4t+3),
// bytes 8-15 a second. x is the B operand (its rows past M read row M - 1 and only produce
// output columns that are never stored); M <= 8 is one n8 tile of the mma, M = 9-16 two.
//
// A warp owns ROWS = 16 x FP8_SLICES weight rows (x's fragment serves every slice), a CTA the
// same rows, and its warps split K: warp w takes batches w, w + warps, ... of FP8_UNROLL spans,
// so that the warps of a CTA read adjacent runs of each row at about the same time. A warp holds
// two batches in registers and issues the loads of the next before it multiplies the current
// one (the compiler would otherwise place each span's mma right after its own loads, and the
// warp would wait on every load in turn). The warps'
// [ROWS, M] partials are summed in shared memory in warp order (deterministic), scaled and
// stored. Each span's two mma start from zero and are added into the fp32 sums: the tensor
// cores' partial-precision FP8 accumulation never runs over more than 64 products of K.
//
// Launched with programmatic dependent launch: the grid may start while the kernel before it on
// the stream finishes; it waits (griddepcontrol.wait) for that kernel's writes before it loads
// x, w or the scales, and lets the next kernel launch once its loads are done.
//
// One shared library per (FP8_SLICES, FP8_UNROLL); warps per CTA are a launch argument.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#ifndef FP8_SLICES
#define FP8_SLICES 1
#endif
#ifndef FP8_UNROLL
#define FP8_UNROLL 1
#endif
#ifndef FP8_STAGES
#define FP8_STAGES 4
#endif

namespace {

constexpr int SLICES = FP8_SLICES;
constexpr int UNROLL = FP8_UNROLL;
constexpr int STAGES = FP8_STAGES;
constexpr int ROWS = 16 * SLICES;
constexpr int SPAN = 64;  // bytes of K per lane-quad load: 16 per lane
constexpr int MAX_M = 16;
constexpr int MAX_WARPS = 16;
constexpr int SMEM_LIMIT = 227 * 1024;  // a CTA's shared memory on sm_90
constexpr int MAX_DEVICES = 64;
static_assert(SLICES == 1 || SLICES == 2 || SLICES == 4, "16, 32 or 64 rows a warp");
static_assert(UNROLL >= 1 && UNROLL <= 4, "1..4 spans a batch");
static_assert(STAGES >= 2 && STAGES <= 8, "2..8 stages");

enum Fp8 { E4M3, E5M2 };
enum Out { BF16, F16, F32 };

struct Params {
  const uint8_t* x;
  const uint8_t* w;
  const float* sx;  // [M] (rowwise) or [1]
  const float* sw;  // [N] (rowwise) or [1]
  void* out;
  long long ldx, ldw, ldo;
  int m, n, k;
  int rowwise;
};

// d = A (16 x 32, weight rows) x B (32 x 8, x's rows) in fp32, from zero.
template <Fp8 W, Fp8 X>
__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1) {
  const float z = 0.f;
#define FP8_MMA(WT, XT)                                                                   \
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32." WT "." XT ".f32 "                 \
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};\n"    \
               : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                             \
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(z))
  if constexpr (W == E4M3 && X == E4M3) FP8_MMA("e4m3", "e4m3");
  else if constexpr (W == E4M3) FP8_MMA("e4m3", "e5m2");
  else if constexpr (X == E4M3) FP8_MMA("e5m2", "e4m3");
  else FP8_MMA("e5m2", "e5m2");
#undef FP8_MMA
}

// A warp's stage of its ring: UNROLL spans, each [2 SLICES + NT pieces][32 lanes][16 bytes]
// (each weight row pair's, then each x tile's): a lane copies, then reads, only its own bytes.
template <int NT>
__host__ __device__ constexpr int stage_bytes() {
  return UNROLL * (2 * SLICES + NT) * 32 * 16;
}

__device__ __forceinline__ void copy16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}

// Copies the batch whose first byte of K is `at0` into the stage at `stage` (this lane's bytes;
// lanes past K, and whole batches past it, get zeros), as one commit group.
template <int NT>
__device__ __forceinline__ void issue(uint32_t stage, const uint8_t* const (&wrow)[SLICES][2],
                                      const uint8_t* const (&xrow)[NT], long long at0, int lane_k,
                                      int k) {
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const long long at = at0 + u * SPAN;
    const bool valid = at + lane_k < k;
    const uint32_t span = stage + u * (2 * SLICES + NT) * 512;
#pragma unroll
    for (int s = 0; s < SLICES; ++s)
#pragma unroll
      for (int h = 0; h < 2; ++h) copy16(span + (2 * s + h) * 512, wrow[s][h] + (valid ? at : 0), valid);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      copy16(span + (2 * SLICES + nt) * 512, xrow[nt] + (valid ? at : 0), valid);
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

// acc += the products of the stage at `stage` (this lane's bytes), each span's two mma summed
// from zero first.
template <Fp8 W, Fp8 X, int NT>
__device__ __forceinline__ void compute(uint32_t stage, float (&acc)[SLICES][NT][4]) {
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const uint32_t span = stage + u * (2 * SLICES + NT) * 512;
    uint4 x[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) x[nt] = lds128(span + (2 * SLICES + nt) * 512);
#pragma unroll
    for (int s = 0; s < SLICES; ++s) {
      const uint4 r0 = lds128(span + 2 * s * 512), r8 = lds128(span + (2 * s + 1) * 512);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        float lo[4], hi[4];
        mma<W, X>(lo, r0.x, r8.x, r0.y, r8.y, x[nt].x, x[nt].y);
        mma<W, X>(hi, r0.z, r8.z, r0.w, r8.w, x[nt].z, x[nt].w);
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[s][nt][e] += lo[e] + hi[e];
      }
    }
  }
}

template <typename T>
__device__ __forceinline__ T convert(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 convert(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half convert(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ float convert(float v) {
  return v;
}

template <Fp8 W, Fp8 X, int NT, typename T>
__global__ void __launch_bounds__(MAX_WARPS * 32) fp8_gemv_kernel(const Params p) {
  // the warps' rings, then their partials [warps][NT * 8 tokens][ROWS]
  extern __shared__ __align__(16) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3, lane_k = 16 * t;
  const int row0 = blockIdx.x * ROWS;
  const uint8_t* wrow[SLICES][2];
#pragma unroll
  for (int s = 0; s < SLICES; ++s)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = min(row0 + 16 * s + 8 * h + g, p.n - 1);  // rows past N: never stored
      wrow[s][h] = p.w + r * p.ldw + lane_k;
    }
  const uint8_t* xrow[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) xrow[nt] = p.x + min(8 * nt + g, p.m - 1) * p.ldx + lane_k;
  const int batches = (p.k + UNROLL * SPAN - 1) / (UNROLL * SPAN);
  const long long step = static_cast<long long>(warps) * UNROLL * SPAN;  // K bytes a turn
  float acc[SLICES][NT][4] = {};
  // the kernel before this one on the stream has written x (and read out) once this returns
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  // a ring of STAGES batches a warp, STAGES - 1 of them in flight while one is multiplied
  const uint32_t ring = static_cast<uint32_t>(__cvta_generic_to_shared(smem)) +
                        (warp * STAGES * stage_bytes<NT>() + lane * 16);
  const int mine = warp < batches ? (batches - warp + warps - 1) / warps : 0;
  long long at = static_cast<long long>(warp) * UNROLL * SPAN;
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) issue(ring + i * stage_bytes<NT>(), wrow, xrow, at + i * step, lane_k, p.k);
  int slot = 0;
  for (int i = 0; i < mine; ++i, at += step) {
    // the stage this lane read a turn ago is free: its reads fed that turn's mma
    const int fill = slot == 0 ? STAGES - 1 : slot - 1;
    issue(ring + fill * stage_bytes<NT>(), wrow, xrow, at + (STAGES - 1) * step, lane_k, p.k);
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 1));
    compute<W, X, NT>(ring + slot * stage_bytes<NT>(), acc);
    slot = slot + 1 == STAGES ? 0 : slot + 1;
  }
  asm volatile("cp.async.wait_all;\n" ::);
  // the next kernel may launch once every CTA got here (it waits for this grid's writes itself)
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

  float* part = reinterpret_cast<float*>(smem + warps * STAGES * stage_bytes<NT>());
  float* own = part + warp * NT * 8 * ROWS;
#pragma unroll
  for (int s = 0; s < SLICES; ++s)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        own[(8 * nt + 2 * t + (e & 1)) * ROWS + 16 * s + g + 8 * (e >> 1)] = acc[s][nt][e];
  __syncthreads();
  for (int i = threadIdx.x; i < p.m * ROWS; i += blockDim.x) {
    const int token = i / ROWS, r = i % ROWS, n = row0 + r;
    if (n >= p.n) continue;
    float sum = 0.f;
    for (int w = 0; w < warps; ++w) sum += part[(w * NT * 8 + token) * ROWS + r];
    sum *= p.sx[p.rowwise ? token : 0] * p.sw[p.rowwise ? n : 0];
    static_cast<T*>(p.out)[token * p.ldo + n] = convert<T>(sum);
  }
}

int smem_bytes(int m, int warps) {
  const int tiles = m > 8 ? 2 : 1;
  return warps * (STAGES * UNROLL * (2 * SLICES + tiles) * 512 + tiles * 8 * ROWS * 4);
}

template <Fp8 W, Fp8 X, int NT, typename T>
cudaError_t launch(const Params& p, int warps, cudaStream_t stream) {
  const int smem = smem_bytes(p.m, warps);
  static int allowed[MAX_DEVICES] = {};  // per device: raised once to the most asked
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  if (device >= MAX_DEVICES) return cudaErrorInvalidDevice;
  if (smem > 48 * 1024 && smem > allowed[device]) {
    e = cudaFuncSetAttribute(fp8_gemv_kernel<W, X, NT, T>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    allowed[device] = smem;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>((p.n + ROWS - 1) / ROWS));
  config.blockDim = dim3(static_cast<unsigned>(warps * 32));
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, fp8_gemv_kernel<W, X, NT, T>, p);
}

template <Fp8 W, Fp8 X, int NT>
cudaError_t launch_out(const Params& p, int out, int warps, cudaStream_t s) {
  if (out == F32) return launch<W, X, NT, float>(p, warps, s);
  if (out == F16) return launch<W, X, NT, __half>(p, warps, s);
  return launch<W, X, NT, __nv_bfloat16>(p, warps, s);
}

template <Fp8 W, Fp8 X>
cudaError_t launch_tiles(const Params& p, int out, int warps, cudaStream_t s) {
  return p.m > 8 ? launch_out<W, X, 2>(p, out, warps, s) : launch_out<W, X, 1>(p, out, warps, s);
}

}  // namespace

extern "C" {

// This library's compile-time config: 16-row slices per warp, spans (64 bytes of K) a batch.
void fp8_gemv_config(int* slices, int* unroll) {
  *slices = SLICES;
  *unroll = UNROLL;
}

// out[m, ldo] (bf16, f16 or f32: out_dtype 0, 1, 2) = (x[m, ldx] @ w[n, ldw].T) * sx * sw, x and
// w e4m3 (0) or e5m2 (1), not both e5m2; sx [m] and sw [n] when rowwise, else one float each.
// Returns a cudaError_t. The caller checks the operands (tuner/candidates/cuda_fp8.py); this
// refuses what would read or write out of bounds: m outside 1..MAX_M, K not a multiple of 16,
// x, w or their rows not 16-byte aligned, warps outside 1..MAX_WARPS, or partials over 48 KB.
int fp8_gemv(const void* x, const void* w, const void* sx, const void* sw, void* out, int m,
             int n, int k, long long ldx, long long ldw, long long ldo, int x_fmt, int w_fmt,
             int out_dtype, int rowwise, int warps, void* stream) {
  if (m < 1 || m > MAX_M || n < 1 || k < 16 || k % 16 || ldx < k || ldw < k || ldo < n ||
      ldx % 16 || ldw % 16 || reinterpret_cast<uintptr_t>(x) % 16 ||
      reinterpret_cast<uintptr_t>(w) % 16 || warps < 1 || warps > MAX_WARPS || x_fmt < 0 ||
      x_fmt > 1 || w_fmt < 0 || w_fmt > 1 || (x_fmt == E5M2 && w_fmt == E5M2) || out_dtype < 0 ||
      out_dtype > 2 || smem_bytes(m, warps) > SMEM_LIMIT)
    return static_cast<int>(cudaErrorInvalidValue);
  Params p{static_cast<const uint8_t*>(x), static_cast<const uint8_t*>(w),
           static_cast<const float*>(sx), static_cast<const float*>(sw), out, ldx, ldw, ldo, m,
           n, k, rowwise};
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t e;
  if (w_fmt == E4M3 && x_fmt == E4M3) e = launch_tiles<E4M3, E4M3>(p, out_dtype, warps, s);
  else if (w_fmt == E4M3) e = launch_tiles<E4M3, E5M2>(p, out_dtype, warps, s);
  else e = launch_tiles<E5M2, E4M3>(p, out_dtype, warps, s);
  return static_cast<int>(e);
}

}  // extern "C"

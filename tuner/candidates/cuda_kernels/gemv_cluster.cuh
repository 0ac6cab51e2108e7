// What our decode GEMV kernels (w4a16_gemv.cu, fp8_gemv.cu) share: the PTX they copy, wait and
// signal with, the sum of a cluster's partials through distributed shared memory, and the
// launch (a cluster of CTAs, programmatic dependent launch).
//
// The cluster sum: each rank of a cluster of CTAs that split K owns a share of the CTA's outputs.
// It pushes the other ranks' shares of its sums into their inboxes with asynchronous stores to
// distributed shared memory that count their bytes on the inbox's mbarrier, waits there for
// theirs, adds them in rank order and stores its share: no cluster-wide barrier after the
// stream, no remote reads, no fences, no partial in global memory (deterministic, no workspace).
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace gemv {

constexpr int MAX_DEVICES = 64;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes from `src` to shared `dst`, or 16 zero bytes unless `valid`.
__device__ __forceinline__ void copy16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int PENDING>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

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

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}

// The kernel before this one on the stream has written its outputs once this returns.
__device__ __forceinline__ void wait_for_previous_grid() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

// The next kernel on the stream may launch once every CTA got here (it waits for this grid's
// writes itself).
__device__ __forceinline__ void let_next_grid_launch() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// Where rank `r`'s share of a CTA's `outputs` begins (in a cluster of `ranks`, each rank stores
// its share).
__device__ __forceinline__ int share_begin(int r, int outputs, int ranks) {
  return r * outputs / ranks;
}

// Shared memory of the inbox (in a cluster of `ranks`): an mbarrier, then a share of the CTA's
// `outputs` from each rank.
__host__ __device__ constexpr int inbox_bytes(int outputs, int ranks) {
  return ranks > 1 ? 8 + ranks * ((outputs + ranks - 1) / ranks) * 4 : 0;
}

// (a cluster, at the kernel's start) makes the inbox at `inbox` wait for the other ranks' sums of
// this rank's share of `outputs`, and arrives on the cluster barrier that `cluster_sum` waits on.
__device__ __forceinline__ void open_inbox(unsigned char* inbox, int outputs, int rank, int ranks) {
  if (ranks == 1) return;
  if (threadIdx.x == 0) {
    const int mine = share_begin(rank + 1, outputs, ranks) - share_begin(rank, outputs, ranks);
    bar_init(smem_addr(inbox), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    bar_expect(smem_addr(inbox), (ranks - 1) * mine * 4);
  }
  // waited for only before the pushes, long after
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::);
}

// The cluster's sum of each of this rank's share of the CTA's `outputs` (`sums` in this CTA's
// shared memory, the inbox opened by `open_inbox`), each passed to `store(q, v)` (output q).
template <typename Store>
__device__ __forceinline__ void cluster_sum(const float* sums, unsigned char* inbox, int outputs,
                                            int rank, int ranks, Store store) {
  const uint32_t inbox_bar = smem_addr(inbox);
  const float* inbox_sums = reinterpret_cast<const float*>(inbox + 8);  // [sender][share]
  const int share = (outputs + ranks - 1) / ranks;
  const auto q_lo = [&](int r) { return share_begin(r, outputs, ranks); };
  if (ranks > 1) {
    asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");  // every inbox made
    for (int r = 0; r < ranks; ++r) {
      if (r == rank) continue;
      const uint32_t to = at_rank(smem_addr(inbox_sums + rank * share - q_lo(r)), r);
      const uint32_t bar = at_rank(inbox_bar, r);
      for (int q = q_lo(r) + threadIdx.x; q < q_lo(r + 1); q += blockDim.x)
        store_at(to + q * 4, sums[q], bar);
    }
    bar_wait(inbox_bar, 0);
  }
  for (int q = q_lo(rank) + threadIdx.x; q < q_lo(rank + 1); q += blockDim.x) {
    float v = 0.f;
    for (int r = 0; r < ranks; ++r)
      v += r == rank ? sums[q] : inbox_sums[r * share + q - q_lo(rank)];
    store(q, v);
  }
}

// Launches `kernel(p)` on `ctas` CTAs of `threads` in clusters of `cluster` with `smem` bytes of
// dynamic shared memory each, allowed to start while the kernel before it on `stream` finishes.
template <typename Params, void (*kernel)(Params)>
cudaError_t launch_cluster(const Params& p, int ctas, int threads, int smem, int cluster,
                           cudaStream_t stream) {
  static int allowed[MAX_DEVICES] = {};  // per kernel and device: raised once to the most asked
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  if (device >= MAX_DEVICES) return cudaErrorInvalidDevice;
  if (smem > 48 * 1024 && smem > allowed[device]) {
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    allowed[device] = smem;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(ctas));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = 2;
  return cudaLaunchKernelEx(&config, kernel, p);
}

}  // namespace gemv

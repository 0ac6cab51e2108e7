// How our wgmma decode kernels (fp8_gemv.cu, w4a16_wgmma.cu) end: a cluster of RANKS CTAs
// splits K, each CTA holds its [M][ROWS] fp32 partial in shared memory, and rank r sums and
// stores outputs [q_lo(r), q_lo(r + 1)) of the M x ROWS. Every other rank pushes its partial of
// that share into r's inbox with asynchronous stores to distributed shared memory that count
// their bytes on r's mbarrier: no cluster-wide barrier after the stream, no remote reads, no
// fences, and a fixed (rank) order of the sum. Each thread takes runs of four consecutive
// outputs: one 16-byte push a remote share, float4 reads, one 8- or 16-byte store where out's
// rows and base allow it, else one by one.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace gemv {

enum OutKind { OUT_BF16, OUT_F16, OUT_F32 };

// Where the outputs go: [M, n] rows `ld` elements apart, of `kind`.
struct Out {
  void* ptr;
  long long ld;
  int n, kind;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void store(const Out& o, long long at, float v) {
  if (o.kind == OUT_BF16)
    static_cast<__nv_bfloat16*>(o.ptr)[at] = __float2bfloat16_rn(v);
  else if (o.kind == OUT_F16)
    static_cast<__half*>(o.ptr)[at] = __float2half_rn(v);
  else
    static_cast<float*>(o.ptr)[at] = v;
}

// Two pairs of 16-bit outputs as the 8 bytes one store writes.
template <typename Pair>
__device__ __forceinline__ uint2 as_bits(Pair lo, Pair hi) {
  return make_uint2(*reinterpret_cast<const uint32_t*>(&lo),
                    *reinterpret_cast<const uint32_t*>(&hi));
}

// Four outputs at `at` (a multiple of 4 elements into a 16-byte aligned out): one store.
__device__ __forceinline__ void store4(const Out& o, long long at, const float (&v)[4]) {
  if (o.kind == OUT_F32) {
    reinterpret_cast<float4*>(static_cast<float*>(o.ptr) + at)[0] =
        make_float4(v[0], v[1], v[2], v[3]);
    return;
  }
  const uint2 bits =
      o.kind == OUT_BF16
          ? as_bits(__floats2bfloat162_rn(v[0], v[1]), __floats2bfloat162_rn(v[2], v[3]))
          : as_bits(__floats2half2_rn(v[0], v[1]), __floats2half2_rn(v[2], v[3]));
  reinterpret_cast<uint2*>(static_cast<uint16_t*>(o.ptr) + at)[0] = bits;
}

// Bytes of the inbox past a CTA's ring: an mbarrier in 16 bytes (the sums after it read as
// float4), then each rank's partial of this rank's share; none without a cluster.
inline int inbox_bytes(int outputs, int ranks) {
  return ranks > 1 ? 16 + ranks * ((outputs + ranks - 1) / ranks) * 4 : 0;
}

template <int ROWS, int RANKS>
struct ClusterSum {
  // each rank's share of the M x ROWS outputs is whole runs of four: a run of a thread never
  // crosses a share or an x row, and the shares' sizes are exact
  static_assert(ROWS % (4 * RANKS) == 0, "a rank's share must be whole runs of four outputs");

  int rank, outputs, share;
  uint32_t bar;
  float* inbox;

  // `inbox_at`: the inbox in this CTA's shared memory (16-byte aligned); `m` x's rows.
  __device__ ClusterSum(unsigned char* inbox_at, int rank_, int m)
      : rank(rank_),
        outputs(ROWS * m),
        share(ROWS * m / RANKS),
        bar(smem_addr(inbox_at)),
        inbox(reinterpret_cast<float*>(inbox_at + 16)) {}

  __device__ int q_lo(int r) const { return r * outputs / RANKS; }

  // At the kernel's start: the inbox's mbarrier armed for the bytes the others will push, and
  // this CTA's arrival on the cluster barrier that `exchange` waits on (so that no rank pushes
  // into an inbox before it is armed).
  __device__ void open(int tid) const {
    if constexpr (RANKS > 1) {
      if (tid == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar));
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
                     "r"((RANKS - 1) * share * 4)
                     : "memory");
      }
      asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::);
    }
  }

  // Pushes the other ranks' shares of this CTA's `sums` ([M][ROWS], complete in shared memory)
  // into their inboxes, then waits until the others' pushes into this one are in.
  __device__ void exchange(const float* sums, int tid, int threads) const {
    if constexpr (RANKS > 1) {
      asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
#pragma unroll
      for (int r = 0; r < RANKS; ++r) {
        if (r == rank) continue;
        uint32_t to, remote_bar;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
                     : "=r"(to)
                     : "r"(smem_addr(inbox + rank * share - q_lo(r))), "r"(r));
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
                     : "=r"(remote_bar)
                     : "r"(bar), "r"(r));
        for (int q = q_lo(r) + 4 * tid; q < q_lo(r + 1); q += 4 * threads) {
          const float4 v = *reinterpret_cast<const float4*>(sums + q);
          asm volatile(
              "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, "
              "%4}, [%5];\n" ::"r"(to + q * 4),
              "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(__float_as_uint(v.z)),
              "r"(__float_as_uint(v.w)), "r"(remote_bar)
              : "memory");
        }
      }
      asm volatile(
          "{\n.reg .pred done;\nWAIT_%=:\n"
          "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], 0;\n"
          "@!done bra WAIT_%=;\n}\n" ::"r"(bar)
          : "memory");
    }
  }

  // This rank's share summed in rank order, each run of four outputs (x row `col`, weight rows
  // `row`..`row` + 3 of the CTA's, which start at n0) scaled by `scale(col, row, v)`, stored.
  template <typename Scale>
  __device__ void store(const float* sums, const Out& out, int n0, int tid, int threads,
                        Scale scale) const {
    const bool wide = out.ld % 4 == 0 && reinterpret_cast<uintptr_t>(out.ptr) % 16 == 0;
    for (int q = q_lo(rank) + 4 * tid; q < q_lo(rank + 1); q += 4 * threads) {
      float v[4] = {};
#pragma unroll
      for (int r = 0; r < RANKS; ++r) {
        const float4 part = *reinterpret_cast<const float4*>(
            r == rank ? sums + q : inbox + r * share + q - q_lo(rank));
        v[0] += part.x;
        v[1] += part.y;
        v[2] += part.z;
        v[3] += part.w;
      }
      const int col = q / ROWS, row = q % ROWS;
      scale(col, row, v);
      const long long at = col * out.ld + n0 + row;
      if (wide && n0 + row + 3 < out.n) {
        store4(out, at, v);
      } else {
        for (int i = 0; i < 4 && n0 + row + i < out.n; ++i) gemv::store(out, at + i, v[i]);
      }
    }
  }
};

}  // namespace gemv

// How our decode GEMV kernels (w4a16_gemv.cu, fp8_gemv.cu) are launched: in clusters of CTAs
// along x that split K, optionally as a programmatic dependent launch (the kernel then waits for
// the one before it with griddepcontrol.wait, so its launch and setup overlap that kernel's end)
// and with a shared-memory carveout (launch attributes, which a CUDA graph captures with the
// launch), with the dynamic shared memory it asks for raised once per device.
#pragma once

#include <cuda_runtime.h>

namespace gemv {

constexpr int MAX_DEVICES = 64;

// Lets KERNEL take `smem` bytes of dynamic shared memory on the current device: raised once per
// device to the most asked, whatever the size (a kernel's static shared memory counts against
// the 48 KB a launch may take without the raise).
template <auto KERNEL>
cudaError_t allow_smem(int smem) {
  static int allowed[MAX_DEVICES] = {};
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  if (device >= MAX_DEVICES) return cudaErrorInvalidDevice;
  if (smem <= allowed[device]) return cudaSuccess;
  e = cudaFuncSetAttribute(KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e == cudaSuccess) allowed[device] = smem;
  return e;
}

// KERNEL(args...) on `ctas` CTAs of `threads` threads, `cluster` CTAs a cluster along x, with
// `smem` bytes of dynamic shared memory, launched on `stream`, the SM's unified L1 / shared memory
// split as `carveout` percent of its most shared memory (-1: as the driver sizes it, room for the
// most CTAs an SM, whatever L1 that leaves); DEPENDENT: as a programmatic dependent launch (KERNEL
// must then wait with griddepcontrol.wait before it reads what the kernel before it wrote).
template <auto KERNEL, bool DEPENDENT, typename... Args>
cudaError_t launch_carved(unsigned ctas, unsigned threads, int smem, int cluster, int carveout,
                          cudaStream_t stream, Args... args) {
  const cudaError_t e = allow_smem<KERNEL>(smem);
  if (e != cudaSuccess) return e;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(ctas);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  cudaLaunchAttribute attr[3];
  unsigned n = 0;
  attr[n].id = cudaLaunchAttributeClusterDimension;
  attr[n].val.clusterDim.x = static_cast<unsigned>(cluster);
  attr[n].val.clusterDim.y = 1;
  attr[n++].val.clusterDim.z = 1;
  if constexpr (DEPENDENT) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (carveout >= 0) {
    attr[n].id = cudaLaunchAttributePreferredSharedMemoryCarveout;
    attr[n++].val.sharedMemCarveout = static_cast<unsigned>(carveout);
  }
  config.attrs = attr;
  config.numAttrs = n;
  return cudaLaunchKernelEx(&config, KERNEL, args...);
}

// The same with the driver's carveout. Our kernels pass DEPENDENT false; true stays the default
// because the kernel sources a bench builds as baselines call this without the argument and
// wait as it expects.
template <auto KERNEL, bool DEPENDENT = true, typename... Args>
cudaError_t launch_in_clusters(unsigned ctas, unsigned threads, int smem, int cluster,
                               cudaStream_t stream, Args... args) {
  return launch_carved<KERNEL, DEPENDENT>(ctas, threads, smem, cluster, -1, stream, args...);
}

}  // namespace gemv

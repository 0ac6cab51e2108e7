// CUTLASS's SM90 mixed-input warp-specialized GEMM (KernelTmaWarpSpecialized: one CTA per output
// tile, a producer warpgroup feeding the mainloop by TMA) with two consumer warpgroups that split
// the tile's K between them instead of one that takes all of it.
//
// Why: on a narrow projection (few tiles of weight rows) a mixed-input CTA is bound by the one
// consumer warpgroup that dequantizes its weight tile and issues its wgmmas; CUTLASS's second
// warpgroup (the cooperative kernel) takes other rows, so the tiles halve, and its split-K
// schedules pay a fixup in global memory. Here warpgroup w takes the K tiles w, w + 2, ... of the
// same tile in the stages the producer fills in order (each stage is released by the one
// warpgroup that read it), then warpgroup 1 hands its accumulators to warpgroup 0 through shared
// memory (the mainloop's stages, idle by then) and warpgroup 0 runs the epilogue alone: no extra
// CTA, no workspace, and the sum is in a fixed order.
//
// Built from the generator's ws kernel: the emitted `GemmUniversal<...>` is renamed
// `tuner::GemmSplitK2<...>` (same template arguments); only the device entry point differs.

#pragma once

#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace tuner {

// The mixed-input mainloop's consumer side, taking every `stride`-th K tile from `smem_pipe_read`
// on (CUTLASS's mma / mma_tail with each advance of a pipeline state by `stride`).
template <class Base>
struct StridedMixedInputMainloop : Base {
  using Utils = cutlass::gemm::collective::detail::MixedInputUtils<Base>;
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::TiledMma;

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors,
                          Params const& mainloop_params, int stride) {
    using namespace cute;
    using SmemLayoutA = typename Base::SmemLayoutA;
    using SmemLayoutB = typename Base::SmemLayoutB;
    static_assert(is_rmem<FrgTensorC>::value, "C tensor must be rmem resident.");

    [[maybe_unused]] int warp_group_thread_idx = thread_idx % 128;
    Tensor sA_ = make_tensor(make_smem_ptr(shared_tensors.smem_A.begin()), SmemLayoutA{});
    Tensor sA = as_position_independent_swizzle_tensor(sA_);
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.begin()), SmemLayoutB{});

    constexpr int MmaWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    Layout warp_group_thread_layout =
        make_layout(Int<MmaWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    int warp_group_idx = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);

    TiledMma tiled_mma;
    auto mma_thread_slice = tiled_mma.get_thread_slice(thread_idx);
    Tensor tCsA = mma_thread_slice.partition_A(sA);
    auto mma_warpgroup_slice = tiled_mma.get_slice(warp_group_thread_layout(warp_group_idx));
    Tensor tCrA_mma = mma_thread_slice.partition_fragment_A(sA(_, _, Int<0>{}));
    Tensor tCrA_load = [&] {
      if constexpr (not is_layout<typename Base::SwappedStrideA>::value) {
        return make_fragment_like<typename Base::RealSwappedElementA>(tCrA_mma);
      } else {
        return make_tensor_like<typename Base::RealSwappedElementA>(tCsA(_, _, _, Int<0>{}));
      }
    }();
    Tensor tCsB = mma_warpgroup_slice.partition_B(sB);
    Tensor tCrB = mma_warpgroup_slice.make_fragment_B(tCsB);

    auto smem_tiled_copy_A = make_tiled_copy_A(typename Base::SwappedSmemCopyAtomA{}, tiled_mma);
    auto smem_thr_copy_A = smem_tiled_copy_A.get_thread_slice(warp_group_thread_idx);
    Tensor tCrA_copy_view = smem_thr_copy_A.retile_D(tCrA_load);
    auto partitioned_extra_info = Utils::partition_extra_mma_info(mma_thread_slice, shared_tensors);
    auto copy_partitions_extra_info =
        Utils::retile_extra_mma_info(tiled_mma, partitioned_extra_info, warp_group_thread_idx);

    auto copy_a = [&](int k_block, int stage) {
      Utils::copy_tensors_MK(smem_tiled_copy_A, tCsA, tCrA_copy_view, partitioned_extra_info,
                             copy_partitions_extra_info, k_block, stage);
    };
    auto dequantize = [&](int k_block) {
      Utils::dequantize_A_kblock(tCrA_load, tCrA_mma, partitioned_extra_info, k_block);
    };

    PipelineState smem_pipe_release = smem_pipe_read;
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    warpgroup_fence_operand(accum);

    constexpr int K_BLOCK_MAX = size<2>(tCrA_load);
    constexpr int K_WAIT_MAX = cute::min(K_BLOCK_MAX - 1, 7);
    static_assert(K_BLOCK_MAX >= 4, "Consider increasing TileShapeK");

    cutlass::ConsumerToken barrier_token = {cutlass::BarrierStatus::WaitAgain};
    {  // the first K tile
      barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
      pipeline.consumer_wait(smem_pipe_read, barrier_token);
      int read_stage = smem_pipe_read.index();
      smem_pipe_read.advance(stride);
      barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
      copy_a(0, read_stage);
      copy_a(1, read_stage);
      dequantize(0);
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = 0; k_block < K_BLOCK_MAX; ++k_block) {
        warpgroup_arrive();
        cute::gemm(tiled_mma, tCrA_mma(_, _, k_block), tCrB(_, _, k_block, read_stage), accum);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        warpgroup_commit_batch();
        if (k_block < K_BLOCK_MAX - 2) copy_a(k_block + 2, read_stage);
        if (k_block < K_BLOCK_MAX - 1) dequantize(k_block + 1);
      }
      --k_tile_count;
      if (k_tile_count > 0) {
        pipeline.consumer_wait(smem_pipe_read, barrier_token);
        copy_a(0, smem_pipe_read.index());
        copy_a(1, smem_pipe_read.index());
        warpgroup_wait<K_WAIT_MAX>();
        dequantize(0);
      }
    }
    if (k_tile_count == 0) return;

    warpgroup_fence_operand(accum);
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 1; --k_tile_count) {
      int read_stage = smem_pipe_read.index();
      smem_pipe_read.advance(stride);
      warpgroup_fence_operand(accum);
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = 0; k_block < K_BLOCK_MAX; ++k_block) {
        warpgroup_arrive();
        cute::gemm(tiled_mma, tCrA_mma(_, _, k_block), tCrB(_, _, k_block, read_stage), accum);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        warpgroup_commit_batch();
        warpgroup_wait<K_WAIT_MAX>();
        if (k_block == K_BLOCK_MAX - 1) {
          pipeline.consumer_release(smem_pipe_release);
          smem_pipe_release.advance(stride);
        }
        if (k_block == 0) barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
        if (k_block == K_BLOCK_MAX - 1) {
          pipeline.consumer_wait(smem_pipe_read, barrier_token);
          copy_a(0, smem_pipe_read.index());
          copy_a(1, smem_pipe_read.index());
          dequantize(0);
        } else {
          if (k_block < K_BLOCK_MAX - 2) copy_a(k_block + 2, read_stage);
          dequantize(k_block + 1);
        }
      }
      warpgroup_fence_operand(accum);
    }
    warpgroup_fence_operand(accum);
    {  // the last K tile
      int read_stage = smem_pipe_read.index();
      warpgroup_fence_operand(accum);
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = 0; k_block < K_BLOCK_MAX; ++k_block) {
        warpgroup_arrive();
        cute::gemm(tiled_mma, tCrA_mma(_, _, k_block), tCrB(_, _, k_block, read_stage), accum);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        warpgroup_commit_batch();
        warpgroup_wait<K_WAIT_MAX>();
        if (k_block == K_BLOCK_MAX - 1) {
          pipeline.consumer_release(smem_pipe_release);
          smem_pipe_release.advance(stride);
        }
        if (k_block < K_BLOCK_MAX - 2) copy_a(k_block + 2, read_stage);
        if (k_block < K_BLOCK_MAX - 1) dequantize(k_block + 1);
      }
    }
    warpgroup_fence_operand(accum);
  }

  // Waits for the last wgmmas and releases the stage of the last of `k_tile_count` K tiles.
  CUTLASS_DEVICE void mma_tail(MainloopPipeline pipeline, PipelineState smem_pipe_release,
                               int k_tile_count, int stride) {
    smem_pipe_release.advance((k_tile_count - 1) * stride);
    cute::warpgroup_wait<0>();
    pipeline.consumer_release(smem_pipe_release);
  }
};

template <class ProblemShape_, class CollectiveMainloop_, class CollectiveEpilogue_,
          class TileScheduler_ = void>
class GemmSplitK2 : public cutlass::gemm::kernel::GemmUniversal<
                        ProblemShape_, CollectiveMainloop_, CollectiveEpilogue_, TileScheduler_> {
  using Base = cutlass::gemm::kernel::GemmUniversal<ProblemShape_, CollectiveMainloop_,
                                                    CollectiveEpilogue_, TileScheduler_>;

 public:
  using typename Base::ClusterShape;
  using typename Base::CollectiveEpilogue;
  using typename Base::CollectiveMainloop;
  using typename Base::Params;
  using typename Base::SharedStorage;
  using typename Base::StrideA;
  using typename Base::TileShape;
  using typename Base::TiledMma;
  static_assert(cute::is_same_v<typename CollectiveMainloop::DispatchPolicy::Schedule,
                                cutlass::gemm::KernelTmaWarpSpecialized>,
                "GemmSplitK2 is the one-tile-per-CTA warp-specialized kernel");
  static_assert(CUTE_STATIC_V(cute::size(TiledMma{})) == cutlass::NumThreadsPerWarpGroup,
                "each consumer warpgroup takes the whole tile");

  static constexpr uint32_t NumMmaWarpGroups = 2;
  static constexpr uint32_t MaxThreadsPerBlock = (1 + NumMmaWarpGroups) * cutlass::NumThreadsPerWarpGroup;
  static constexpr uint32_t MinBlocksPerMultiprocessor = 1;
  // as CUTLASS's cooperative kernel shares registers between its warpgroups
  static constexpr uint32_t LoadRegisterRequirement = 40;
  static constexpr uint32_t MmaRegisterRequirement = 232;

  static dim3 get_block_shape() { return dim3(MaxThreadsPerBlock, 1, 1); }

  CUTLASS_DEVICE
  void operator()(Params const& params, char* smem_buf) {
    using namespace cute;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int kThreads = cutlass::NumThreadsPerWarpGroup;
    // named barriers of this kernel (after CUTLASS's reserved ones)
    constexpr uint32_t kBothDone = 0, kHandedOver = 1, kSummed = 2;

    SharedStorage& shared_storage = *reinterpret_cast<SharedStorage*>(smem_buf);
    int thread_idx = int(threadIdx.x);
    int lane_idx = cutlass::canonical_lane_idx();
    int warp_idx = cutlass::canonical_warp_idx_sync();
    int warp_group_thread_idx = thread_idx % kThreads;
    int warp_group = cutlass::canonical_warp_group_idx();  // 0 producer, 1 and 2 consumers
    bool mainloop_producer = warp_group == 0 && warp_idx % cutlass::NumWarpsPerWarpGroup == 0;
    int lane_predicate = cute::elect_one_sync();
    uint32_t block_rank_in_cluster = cute::block_rank_in_cluster();

    if ((warp_idx == 0) && lane_predicate) {
      CollectiveMainloop::prefetch_tma_descriptors(params.mainloop);
      CollectiveEpilogue::prefetch_tma_descriptors(params.epilogue);
    }

    using MainloopPipeline = typename CollectiveMainloop::MainloopPipeline;
    typename MainloopPipeline::Params mainloop_pipeline_params;
    if (mainloop_producer) mainloop_pipeline_params.role = MainloopPipeline::ThreadCategory::Producer;
    if (warp_group > 0) mainloop_pipeline_params.role = MainloopPipeline::ThreadCategory::Consumer;
    mainloop_pipeline_params.is_leader = warp_group_thread_idx == 0;
    mainloop_pipeline_params.num_consumers = kThreads;  // one warpgroup reads each stage
    mainloop_pipeline_params.transaction_bytes = params.mainloop.tma_transaction_bytes;
    MainloopPipeline mainloop_pipeline(shared_storage.pipelines.mainloop, mainloop_pipeline_params,
                                       ClusterShape{});

    using EpiLoadPipeline = typename CollectiveEpilogue::LoadPipeline;
    typename EpiLoadPipeline::Params epi_load_pipeline_params;
    if (mainloop_producer) epi_load_pipeline_params.role = EpiLoadPipeline::ThreadCategory::Producer;
    if (warp_group == 1) epi_load_pipeline_params.role = EpiLoadPipeline::ThreadCategory::Consumer;
    epi_load_pipeline_params.dst_blockid = cute::block_rank_in_cluster();
    epi_load_pipeline_params.producer_arv_count = cutlass::NumThreadsPerWarp;
    epi_load_pipeline_params.consumer_arv_count = kThreads;
    if constexpr (CollectiveEpilogue::RequiresTransactionBytes) {
      epi_load_pipeline_params.transaction_bytes = params.epilogue.tma_transaction_bytes;
    }
    EpiLoadPipeline epi_load_pipeline(shared_storage.pipelines.epi_load, epi_load_pipeline_params);

    using EpiStorePipeline = typename CollectiveEpilogue::StorePipeline;
    typename EpiStorePipeline::Params epi_store_pipeline_params;
    epi_store_pipeline_params.always_wait = true;
    EpiStorePipeline epi_store_pipeline(epi_store_pipeline_params);

    typename CollectiveMainloop::PipelineState mainloop_pipe_consumer_state;
    typename CollectiveEpilogue::LoadPipelineState epi_load_pipe_consumer_state;
    cutlass::PipelineState mainloop_pipe_producer_state =
        cutlass::make_producer_start_state<MainloopPipeline>();
    cutlass::PipelineState epi_load_pipe_producer_state =
        cutlass::make_producer_start_state<EpiLoadPipeline>();
    cutlass::PipelineState epi_store_pipe_producer_state =
        cutlass::make_producer_start_state<EpiStorePipeline>();

    if constexpr (size(ClusterShape{}) > 1) {
      cute::cluster_arrive_relaxed();
    } else {
      __syncthreads();
    }

    auto blk_shape = TileShape{};
    TiledMma tiled_mma;
    auto problem_shape_MNKL = append<4>(params.problem_shape, cute::Int<1>{});
    StridedMixedInputMainloop<CollectiveMainloop> collective_mainloop;
    CollectiveEpilogue collective_epilogue(params.epilogue, shared_storage.tensors.epilogue);
    auto load_inputs = collective_mainloop.load_init(problem_shape_MNKL, params.mainloop);
    Tensor gA_mkl = get<0>(load_inputs);
    Tensor gB_nkl = get<1>(load_inputs);
    auto m_coord = idx2crd(int(blockIdx.x), shape<2>(gA_mkl));
    auto n_coord = idx2crd(int(blockIdx.y), shape<2>(gB_nkl));
    auto l_coord = idx2crd(int(blockIdx.z), shape<4>(gB_nkl));
    auto blk_coord = make_coord(m_coord, n_coord, _, l_coord);
    auto k_tile_iter = cute::make_coord_iterator(shape<3>(gA_mkl));
    int k_tile_count = size<3>(gA_mkl);

    if constexpr (size(ClusterShape{}) > 1) cute::cluster_wait();

    if (warp_group == 0) {
      cutlass::arch::warpgroup_reg_dealloc<LoadRegisterRequirement>();
      if (mainloop_producer) {
        cutlass::arch::wait_on_dependent_grids();
        collective_mainloop.load(params.mainloop, mainloop_pipeline, mainloop_pipe_producer_state,
                                 load_inputs, blk_coord, k_tile_iter, k_tile_count, lane_idx,
                                 block_rank_in_cluster, shared_storage.tensors.mainloop);
        mainloop_pipe_producer_state.advance(k_tile_count);
        collective_mainloop.load_tail(mainloop_pipeline, mainloop_pipe_producer_state);
        if (collective_epilogue.is_producer_load_needed()) {
          __syncwarp();
          epi_load_pipe_producer_state = collective_epilogue.load(
              epi_load_pipeline, epi_load_pipe_producer_state, problem_shape_MNKL, blk_shape,
              blk_coord, tiled_mma, lane_idx, shared_storage.tensors.epilogue);
          collective_epilogue.load_tail(epi_load_pipeline, epi_load_pipe_producer_state);
        }
      }
      return;
    }

    cutlass::arch::warpgroup_reg_alloc<MmaRegisterRequirement>();
    int consumer = warp_group - 1;
    Tensor accumulators = partition_fragment_C(tiled_mma, take<0, 2>(blk_shape));
    int my_k_tiles = (k_tile_count + NumMmaWarpGroups - 1 - consumer) / NumMmaWarpGroups;
    auto my_state = mainloop_pipe_consumer_state;
    my_state.advance(consumer);
    if (my_k_tiles > 0) {
      collective_mainloop.mma(mainloop_pipeline, my_state, accumulators, my_k_tiles,
                              warp_group_thread_idx, shared_storage.tensors.mainloop,
                              params.mainloop, NumMmaWarpGroups);
      collective_mainloop.mma_tail(mainloop_pipeline, my_state, my_k_tiles, NumMmaWarpGroups);
    } else {
      clear(accumulators);
    }

    // Warpgroup 1's partial sums to warpgroup 0 through the mainloop's stages, which neither
    // reads any longer once both are past this barrier (every stage is filled before it is read).
    constexpr int kValues = decltype(size(accumulators))::value;
    static_assert(sizeof(shared_storage.tensors.mainloop) >= sizeof(float) * kValues * kThreads,
                  "the mainloop's stages hold a warpgroup's accumulators");
    float* handover = reinterpret_cast<float*>(&shared_storage.tensors.mainloop);
    cutlass::arch::NamedBarrier::sync(NumMmaWarpGroups * kThreads, kBothDone);
    if (consumer == 1) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kValues; ++i) handover[i * kThreads + warp_group_thread_idx] = accumulators(i);
    }
    cutlass::arch::NamedBarrier::sync(NumMmaWarpGroups * kThreads, kHandedOver);
    if (consumer == 1) return;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kValues; ++i) accumulators(i) += handover[i * kThreads + warp_group_thread_idx];
    // the epilogue's shared memory overlaps the handover
    cutlass::arch::NamedBarrier::sync(kThreads, kSummed);

    cutlass::arch::launch_dependent_grids();
    auto [epi_load_pipe_consumer_state_next, epi_store_pipe_producer_state_next] =
        collective_epilogue.store(epi_load_pipeline, epi_load_pipe_consumer_state,
                                  epi_store_pipeline, epi_store_pipe_producer_state,
                                  problem_shape_MNKL, blk_shape, blk_coord, accumulators,
                                  tiled_mma, warp_group_thread_idx, shared_storage.tensors.epilogue);
    collective_epilogue.store_tail(epi_load_pipeline, epi_load_pipe_consumer_state_next,
                                   epi_store_pipeline, epi_store_pipe_producer_state_next);
#else
    printf("ERROR : GemmSplitK2 needs sm90a. Aborting.\n");
#endif
  }
};

}  // namespace tuner

// CUTLASS's SM90 mixed-input warp-specialized GEMM (KernelTmaWarpSpecialized: a producer warp
// feeding one consumer warpgroup by TMA) made persistent and stream-K: a grid of at most one CTA
// an SM shares out the (tile, K tile) steps of the whole problem, each cluster of CTAs a
// contiguous run of them (evenly, or as the caller says), which crosses tiles wherever the tiles
// do not divide among the clusters.
//
// Why: a narrow projection has fewer tiles of weight rows than the GPU has SMs, and CUTLASS's
// stream-K schedulers come only with its cooperative kernel, whose two consumer warpgroups need
// 128-row tiles (half the tiles again); the one-consumer kernel keeps 64-row tiles and still
// fills every SM.
//
// A tile split between CTAs is summed by the CTA that runs its last K tile (the owner); each
// other one writes its f32 partial to its own slot of the workspace and counts itself on the
// tile's flag. A CTA runs its segments last to first, so a tile's head (the end of a lower CTA's
// run) is done first there and its tail (the start of a higher CTA's run) last: an owner rarely
// waits, and only on lower CTAs, which start first. The owner has the TMA unit copy each partial
// whole into its mainloop stages (idle by then) and adds them in CTA order (a fixed order: the
// result does not depend on timing), and resets the flag for the next call; the workspace must
// be zero before the first one.
//
// How the steps are shared out is the caller's: the runs' first steps and each run's helpers
// (of the tile it owns, if it starts inside one), written once into the workspace
// (`share_offset`); a workspace without them (entry `clusters` is not the step count) gets the
// even share-out.
//
// A cluster of C x 1 CTAs runs as one: its CTAs take C adjacent tiles of weight rows through the
// same steps, so that x's tile of a step is read from L2 once for all of them (multicast) as in
// the ws kernel.
//
// Built from the generator's ws kernel: the emitted `GemmUniversal<...>` is renamed
// `tuner::GemmStreamK1<...>` (same template arguments).

#pragma once

#include "cute/arch/copy_sm90_tma.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace tuner {

template <class ProblemShape_, class CollectiveMainloop_, class CollectiveEpilogue_,
          class TileScheduler_ = void>
class GemmStreamK1 : public cutlass::gemm::kernel::GemmUniversal<
                         ProblemShape_, CollectiveMainloop_, CollectiveEpilogue_, TileScheduler_> {
  using Base = cutlass::gemm::kernel::GemmUniversal<ProblemShape_, CollectiveMainloop_,
                                                    CollectiveEpilogue_, TileScheduler_>;

 public:
  using typename Base::Arguments;
  using typename Base::ClusterShape;
  using typename Base::CollectiveEpilogue;
  using typename Base::CollectiveMainloop;
  using typename Base::TileShape;
  using typename Base::TiledMma;
  static_assert(cute::is_same_v<typename CollectiveMainloop::DispatchPolicy::Schedule,
                                cutlass::gemm::KernelTmaWarpSpecialized>,
                "GemmStreamK1 is built on the one-consumer warp-specialized kernel");
  static constexpr int kCluster = CUTE_STATIC_V(cute::size<0>(ClusterShape{}));
  static_assert(CUTE_STATIC_V(cute::size<1>(ClusterShape{})) == 1,
                "a cluster's CTAs share x's tile: they lie along the weight's rows");

  static constexpr int kThreads = cutlass::NumThreadsPerWarpGroup;  // the consumer warpgroup
  static constexpr int kTileValues = CUTE_STATIC_V(cute::size<0>(TileShape{})) *
                                     CUTE_STATIC_V(cute::size<1>(TileShape{}));
  static constexpr size_t kSlotBytes = sizeof(float) * kTileValues;

  // The mainloop's stages and the epilogue's buffers apart (the ws kernel overlays them: it
  // stores once, after its only mainloop); the builder's stage count leaves room for both.
  struct SharedStorage {
    struct PipelineStorage : cute::aligned_struct<16, cute::_1> {
      alignas(16) typename CollectiveMainloop::PipelineStorage mainloop;
      alignas(16) typename CollectiveEpilogue::PipelineStorage epi_load;
      alignas(8) uint64_t gather;  // an owner's bulk copies of its helpers' partials
    } pipelines;
    struct TensorStorage : cute::aligned_struct<128, cute::_1> {
      typename CollectiveEpilogue::TensorStorage epilogue;
      typename CollectiveMainloop::TensorStorage mainloop;
    } tensors;
  };
  static constexpr int SharedStorageSize = sizeof(SharedStorage);

  struct Params {
    typename Base::Params gemm;
    int clusters;
    int* flags;            // per tile: partials written
    // if share[clusters] == steps: cluster c runs steps [share[c], share[c + 1]) and the tile it
    // owns has share[clusters + 1 + c] helpers
    int64_t const* share;
    float* slots;  // per CTA: the partial of its last segment, [values / 4][threads] of float4
  };

  // A step is (cluster tile, K tile); a cluster tile is kCluster tiles of weight rows (those
  // past the weight's last row read zeros and store nothing, as in the ws kernel's grid).
  struct Work {
    int tiles_m, tiles, k_tiles;  // tiles_m in cluster tiles
    int64_t steps;
  };

  template <class Shape>
  CUTLASS_HOST_DEVICE static Work work_of(Shape const& mnkl) {
    int rows = int(cute::ceil_div(cute::get<0>(mnkl), cute::size<0>(TileShape{})));
    int tiles_m = (rows + kCluster - 1) / kCluster;
    int tiles_n = int(cute::ceil_div(cute::get<1>(mnkl), cute::size<1>(TileShape{})));
    int k_tiles = int(cute::ceil_div(cute::get<2>(mnkl), cute::size<2>(TileShape{})));
    int tiles = tiles_m * tiles_n;
    return {tiles_m, tiles, k_tiles, int64_t(tiles) * k_tiles};
  }

  static int clusters_of(Arguments const& args) {
    auto mnkl = cute::append<4>(args.problem_shape, cute::Int<1>{});
    int64_t fit = cute::max(1, args.hw_info.sm_count / kCluster);
    return int(cute::max(int64_t(1), cute::min(fit, work_of(mnkl).steps)));
  }

  static size_t flag_bytes(Arguments const& args) {
    auto mnkl = cute::append<4>(args.problem_shape, cute::Int<1>{});
    return cute::round_up(sizeof(int) * kCluster * work_of(mnkl).tiles, size_t(128));
  }

  // The workspace: flags, then the share-out (clusters + 1 first steps, clusters helpers), then
  // the slots.
  static size_t share_offset(Arguments const& args) { return flag_bytes(args); }

  static size_t slot_offset(Arguments const& args) {
    return share_offset(args) +
           cute::round_up(sizeof(int64_t) * (2 * clusters_of(args) + 1), size_t(128));
  }

  static size_t get_workspace_size(Arguments const& args) {
    return slot_offset(args) + kSlotBytes * kCluster * clusters_of(args);
  }

  // What a caller needs to write a share-out: {clusters, steps, k_tiles, tiles, share_offset}.
  static void layout(Arguments const& args, int64_t* out) {
    Work work = work_of(cute::append<4>(args.problem_shape, cute::Int<1>{}));
    out[0] = clusters_of(args);
    out[1] = work.steps;
    out[2] = work.k_tiles;
    out[3] = work.tiles;
    out[4] = int64_t(share_offset(args));
  }

  // Nothing per call: owners reset their flags; the caller zeroes the workspace once.
  static cutlass::Status initialize_workspace(Arguments const&, void* = nullptr,
                                              cudaStream_t = nullptr,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  static bool can_implement(Arguments const& args) {
    return args.hw_info.sm_count > 0 && Base::can_implement(args);
  }

  static Params to_underlying_arguments(Arguments const& args, void* workspace) {
    auto* bytes = static_cast<uint8_t*>(workspace);
    return {Base::to_underlying_arguments(args, workspace), clusters_of(args),
            reinterpret_cast<int*>(bytes),
            reinterpret_cast<int64_t const*>(bytes + share_offset(args)),
            reinterpret_cast<float*>(bytes + slot_offset(args))};
  }

  static dim3 get_grid_shape(Params const& params) {
    return dim3(params.clusters * kCluster, 1, 1);
  }

  CUTLASS_DEVICE
  void operator()(Params const& params, char* smem_buf) {
    using namespace cute;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr uint32_t kConsumerSync = 0;  // a named barrier of the consumer warpgroup
    // the consumer's partial written (it arrives) -> the signaling warp counts it (it waits)
    constexpr uint32_t kPartialWritten = 1;
    constexpr uint32_t kSignaler = 1;  // the producer warpgroup's warp that signals for it
    SharedStorage& shared_storage = *reinterpret_cast<SharedStorage*>(smem_buf);
    int thread_idx = int(threadIdx.x);
    int lane_idx = cutlass::canonical_lane_idx();
    int warp_idx = cutlass::canonical_warp_idx_sync();
    int warp_group_thread_idx = thread_idx % kThreads;
    bool consumer = cutlass::canonical_warp_group_idx() == 1;
    bool mainloop_producer = !consumer && warp_idx % cutlass::NumWarpsPerWarpGroup == 0;
    uint32_t rank = cute::block_rank_in_cluster();

    if (warp_idx == 0 && cute::elect_one_sync()) {
      CollectiveMainloop::prefetch_tma_descriptors(params.gemm.mainloop);
      CollectiveEpilogue::prefetch_tma_descriptors(params.gemm.epilogue);
      cutlass::arch::ClusterBarrier::init(&shared_storage.pipelines.gather, 1);
      cutlass::arch::fence_barrier_init();
    }

    using MainloopPipeline = typename CollectiveMainloop::MainloopPipeline;
    typename MainloopPipeline::Params mainloop_pipeline_params;
    if (mainloop_producer) mainloop_pipeline_params.role = MainloopPipeline::ThreadCategory::Producer;
    if (consumer) mainloop_pipeline_params.role = MainloopPipeline::ThreadCategory::Consumer;
    mainloop_pipeline_params.is_leader = warp_group_thread_idx == 0;
    mainloop_pipeline_params.num_consumers = kThreads;
    mainloop_pipeline_params.transaction_bytes = params.gemm.mainloop.tma_transaction_bytes;
    MainloopPipeline mainloop_pipeline(shared_storage.pipelines.mainloop, mainloop_pipeline_params,
                                       ClusterShape{});

    using EpiLoadPipeline = typename CollectiveEpilogue::LoadPipeline;
    typename EpiLoadPipeline::Params epi_load_pipeline_params;
    if (mainloop_producer) epi_load_pipeline_params.role = EpiLoadPipeline::ThreadCategory::Producer;
    if (consumer) epi_load_pipeline_params.role = EpiLoadPipeline::ThreadCategory::Consumer;
    epi_load_pipeline_params.dst_blockid = cute::block_rank_in_cluster();
    epi_load_pipeline_params.producer_arv_count = cutlass::NumThreadsPerWarp;
    epi_load_pipeline_params.consumer_arv_count = kThreads;
    if constexpr (CollectiveEpilogue::RequiresTransactionBytes) {
      epi_load_pipeline_params.transaction_bytes = params.gemm.epilogue.tma_transaction_bytes;
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
    // every CTA of the cluster sees the pipelines' barriers initialized
    if constexpr (kCluster > 1) {
      cute::cluster_arrive_relaxed();
    } else {
      __syncthreads();
    }

    auto blk_shape = TileShape{};
    TiledMma tiled_mma;
    auto problem_shape_MNKL = append<4>(params.gemm.problem_shape, cute::Int<1>{});
    CollectiveMainloop collective_mainloop;
    CollectiveEpilogue collective_epilogue(params.gemm.epilogue, shared_storage.tensors.epilogue);
    auto load_inputs = collective_mainloop.load_init(problem_shape_MNKL, params.gemm.mainloop);
    Tensor gA_mkl = get<0>(load_inputs);
    Tensor gB_nkl = get<1>(load_inputs);

    // This cluster's steps [first, last) and the helpers of the tile it owns (if it starts in one).
    Work work = work_of(problem_shape_MNKL);
    int cluster = int(blockIdx.x) / kCluster;
    // the caller's share-out (its loads in flight at once), else the even one
    int64_t const* share = params.share;
    int64_t written = share[params.clusters], first = share[cluster], last = share[cluster + 1];
    int64_t owner_helpers = share[params.clusters + 1 + cluster];
    if (written != work.steps) {
      auto start = [&](int c) { return int64_t(c) * work.steps / params.clusters; };
      first = start(cluster);
      last = start(cluster + 1);
      int64_t tile_first = first - first % work.k_tiles;
      int c = int(tile_first * params.clusters / work.steps);  // the cluster that runs tile_first
      while (c + 1 < params.clusters && start(c + 1) <= tile_first) ++c;
      owner_helpers = cluster - c;
    }

    // Segment s of this CTA's run, counted from its end: (tile, first K tile, K tiles).
    struct Segment {
      int tile, k_begin, k_count;
    };
    auto segment_before = [&](int64_t end) {
      int tile = int((end - 1) / work.k_tiles);
      int64_t begin = cute::max(first, int64_t(tile) * work.k_tiles);
      return Segment{tile, int(begin - int64_t(tile) * work.k_tiles), int(end - begin)};
    };
    auto blk_coord_of = [&](int tile) {
      auto m_coord = idx2crd(int(tile % work.tiles_m * kCluster + rank), shape<2>(gA_mkl));
      auto n_coord = idx2crd(tile / work.tiles_m, shape<2>(gB_nkl));
      return make_coord(m_coord, n_coord, _, idx2crd(0, shape<4>(gB_nkl)));
    };
    auto k_iter_of = [&](Segment const& s) {
      return cute::make_coord_iterator(idx2crd(s.k_begin, shape<3>(gA_mkl)), shape<3>(gA_mkl));
    };
    auto stores = [&](Segment const& s) { return s.k_begin + s.k_count == work.k_tiles; };

    if constexpr (kCluster > 1) cute::cluster_wait();
    if (mainloop_producer) {
      cutlass::arch::wait_on_dependent_grids();
      for (int64_t end = last; end > first;) {
        Segment s = segment_before(end);
        collective_mainloop.load(params.gemm.mainloop, mainloop_pipeline,
                                 mainloop_pipe_producer_state, load_inputs, blk_coord_of(s.tile),
                                 k_iter_of(s), s.k_count, lane_idx, rank,
                                 shared_storage.tensors.mainloop);
        mainloop_pipe_producer_state.advance(s.k_count);
        end -= s.k_count;
      }
      collective_mainloop.load_tail(mainloop_pipeline, mainloop_pipe_producer_state);
      if (collective_epilogue.is_producer_load_needed()) {
        __syncwarp();
        for (int64_t end = last; end > first;) {
          Segment s = segment_before(end);
          if (stores(s)) {
            epi_load_pipe_producer_state = collective_epilogue.load(
                epi_load_pipeline, epi_load_pipe_producer_state, problem_shape_MNKL, blk_shape,
                blk_coord_of(s.tile), tiled_mma, lane_idx, shared_storage.tensors.epilogue);
          }
          end -= s.k_count;
        }
        collective_epilogue.load_tail(epi_load_pipeline, epi_load_pipe_producer_state);
      }
      return;
    }
    // A run that ends inside a tile helps that tile's owner: the signaling warp publishes the
    // consumer's partial (fence, then the count) while the consumer goes on with its next
    // segment, instead of the consumer's first thread stalling the warpgroup on the fence.
    if (!consumer) {
      bool helps = last > first && last % work.k_tiles != 0;
      if (warp_idx % cutlass::NumWarpsPerWarpGroup == kSignaler && helps) {
        cutlass::arch::NamedBarrier::sync(kThreads + cutlass::NumThreadsPerWarp, kPartialWritten);
        if (lane_idx == 0) {
          int* flag = params.flags + segment_before(last).tile * kCluster + rank;
          asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
          asm volatile("red.relaxed.gpu.global.add.s32 [%0], 1;\n" ::"l"(flag) : "memory");
        }
      }
      return;
    }

    cutlass::arch::wait_on_dependent_grids();  // the previous call's owners are done with slots
    bool stored = false;
    uint32_t gather_phase = 0;
    // a slot holds a thread's values 4 at a time: [values / 4][threads] of float4
    float4* my_slot = reinterpret_cast<float4*>(params.slots + int64_t(blockIdx.x) * kTileValues);
    for (int64_t end = last; end > first;) {
      Segment s = segment_before(end);
      end -= s.k_count;
      Tensor accumulators = partition_fragment_C(tiled_mma, take<0, 2>(blk_shape));
      constexpr int kValues = decltype(size(accumulators))::value;
      collective_mainloop.mma(mainloop_pipeline, mainloop_pipe_consumer_state, accumulators,
                              s.k_count, warp_group_thread_idx, shared_storage.tensors.mainloop,
                              params.gemm.mainloop);
      collective_mainloop.mma_tail(mainloop_pipeline, mainloop_pipe_consumer_state, s.k_count);
      mainloop_pipe_consumer_state.advance(s.k_count);

      int* flag = params.flags + s.tile * kCluster + rank;
      if (!stores(s)) {  // a tile's head: its partial for the owner
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < kValues; i += 4) {
          my_slot[i / 4 * kThreads + warp_group_thread_idx] =
              make_float4(accumulators(i), accumulators(i + 1), accumulators(i + 2), accumulators(i + 3));
        }
        cutlass::arch::NamedBarrier::arrive(kThreads + cutlass::NumThreadsPerWarp, kPartialWritten);
        continue;
      }
      // a stored segment that starts inside its tile starts the run: the tile this run owns
      int helpers = s.k_begin == 0 ? 0 : int(owner_helpers);
      if (helpers > 0) {
        // The helpers' partials in CTA order, each copied whole into the mainloop's stages (idle:
        // a segment with helpers is the CTA's last) by the TMA unit, then read from there: one
        // bulk copy in flight instead of a thread's loads, each waiting out L2's latency.
        static_assert(sizeof(shared_storage.tensors.mainloop) >= kSlotBytes,
                      "the mainloop's stages hold a partial tile");
        constexpr int kChunk = 16384;  // bytes a bulk copy
        uint64_t* gather = &shared_storage.pipelines.gather;
        auto* stage = reinterpret_cast<float4*>(&shared_storage.tensors.mainloop);
        static_assert(kSlotBytes % kChunk == 0, "a partial is whole chunks");
        int64_t helper_cta = int64_t(cluster - helpers) * kCluster + rank;
        // every thread's reads of the stages done before the TMA unit writes them
        cutlass::arch::NamedBarrier::sync(kThreads, kConsumerSync);
        if (warp_group_thread_idx == 0) {
          while (atomicCAS(flag, helpers, 0) != helpers) {
          }
          asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
          asm volatile("fence.proxy.async.global;\n" ::: "memory");  // the TMA unit reads them
        }
        for (int c = 0; c < helpers; ++c) {
          if (warp_group_thread_idx == 0) {
            auto const* slot = reinterpret_cast<uint8_t const*>(
                params.slots + (helper_cta + int64_t(c) * kCluster) * kTileValues);
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // after the reads
            cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(gather, kSlotBytes);
            for (int off = 0; off < int(kSlotBytes); off += kChunk) {
              cute::SM90_BULK_COPY_G2S::copy(slot + off, gather,
                                             reinterpret_cast<uint8_t*>(stage) + off, kChunk);
            }
          }
          cutlass::arch::ClusterBarrier::wait(gather, gather_phase);
          gather_phase ^= 1;
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < kValues; i += 4) {
            float4 v = stage[i / 4 * kThreads + warp_group_thread_idx];
            accumulators(i) += v.x;
            accumulators(i + 1) += v.y;
            accumulators(i + 2) += v.z;
            accumulators(i + 3) += v.w;
          }
          cutlass::arch::NamedBarrier::sync(kThreads, kConsumerSync);  // read before it is refilled
        }
      }
      if (end == first) cutlass::arch::launch_dependent_grids();
      auto [epi_load_next, epi_store_next] = collective_epilogue.store(
          epi_load_pipeline, epi_load_pipe_consumer_state, epi_store_pipeline,
          epi_store_pipe_producer_state, problem_shape_MNKL, blk_shape, blk_coord_of(s.tile),
          accumulators, tiled_mma, warp_group_thread_idx, shared_storage.tensors.epilogue);
      epi_load_pipe_consumer_state = epi_load_next;
      epi_store_pipe_producer_state = epi_store_next;
      stored = true;
    }
    if (stored) {
      collective_epilogue.store_tail(epi_load_pipeline, epi_load_pipe_consumer_state,
                                     epi_store_pipeline, epi_store_pipe_producer_state);
    }
#else
    printf("ERROR : GemmStreamK1 needs sm90a. Aborting.\n");
#endif
  }
};

}  // namespace tuner

/*
 * moe_fused_gemm_sm90.cu -- factor 2 (moe_fused_gemm) for Hopper (sm_90a only): prefill through
 * CUTLASS 3.x grouped GEMMs (wgmma + TMA, warp-specialised, persistent), everything else through
 * the portable implementation in moe_fused_gemm.cuh.
 *
 * Same name, id, version and contract as factors/moe_fused_gemm.cu (manifests/moe_fused_gemm.yaml);
 * priority 10, so the registry prefers this plugin where it loads. ex_get_factor returns NULL
 * unless compute capability is exactly 9.0 (the library carries sm_90a code only).
 *
 *   kernel           rows per expert T*K/G >= kSm90MinRowsPerExpert (64; environment override
 *                    EX_MOE_SM90_MIN_ROWS_PER_EXPERT), H % 8 == 0, I % 8 == 0,
 *                    16-byte aligned tensors: the CUTLASS path below. Any other shape: the
 *                    portable fast path (mma.sync) of moe_fused_gemm.cuh, unchanged.
 *   kernel_fallback  the portable scalar fallback (any H, I).
 *
 * CUTLASS path: five or six launches on the caller's stream (one more for the routing when
 * T*K > 2048 slots, one more for silu*up when I % 128 != 0), no host sync,
 * nothing on the host depends
 * on device values (CUDA-graph capturable). The grouped GEMMs get E groups whose problem sizes
 * and pointer arrays are written on the device; the host passes host_problem_shapes = nullptr
 * (the persistent group scheduler launches one CTA per SM and skips groups with M = 0: a group
 * with M = 0 has ceil(0/BM) = 0 tiles, so no CTA ever builds a TMA descriptor for it).
 *   1. launch_route (moe_fused_gemm.cuh: one block, or two multi-block launches for T*K > 2048)
 *      sorted_slots grouped by expert, status bit 0 for an
 *      id outside [0, E), meta[1] = valid rows, expert_off[e] = first sorted row of expert e,
 *      slot_pos[slot] = its sorted row (the inverse permutation; written for placed slots only).
 *   2. sm90_prepare_kernel  threads 0..E-1: problem shapes, pointers and strides of both GEMMs;
 *      a warp per (token t, span of 32 * vpl 16-byte vectors of its row; vpl = 8, halved down
 *      to 1 while the spans make fewer than 16 warps per SM): the span of hidden_states read
 *      once and written to xs[slot_pos[t*K+k]] for each k whose slot was placed (the routing's
 *      test).
 *      EX_MOE_SM90_GATHER_BY_TOKEN=0 (at load): a warp per sorted row r < meta[1], xs[r] =
 *      hidden_states[sorted[r] / K], which reads each row K times at scattered moments (H200,
 *      2026-12-02: this kernel 245.8 -> 164.3 us at qwen3-30b T = 16384, 54.4 -> 37.5 at 4096).
 *   3. GEMM1 (grouped, TN)  I % 128 == 0 (every model of moe_models.yaml): GatedGemm1, act_e
 *                           (M_e x I) = dtype(silu(dtype(g)) * dtype(u)) with g, u the gate and
 *                           up halves of xs_e . w13[e]^T, computed in the epilogue (B stages hold
 *                           128 gate rows and the matching 128 up rows; see GatedMainloop);
 *                           else gu_e (M_e x 2I) = xs_e (M_e x H, row-major) . w13[e]^T
 *                           (w13[e] is 2I x H row-major = K-major B, CUTLASS ColumnMajor) and
 *   4. sm90_silu_mul_kernel act[r] = dtype(silu(gu[r, :I]) * gu[r, I:]), rows r < meta[1]
 *                           (EX_MOE_SM90_SILU_IN_GEMM1=0 at load time: always this way, for A/B)
 *   5. GEMM2 (grouped, TN)  ys_e (M_e x H) = act_e (M_e x I) . w2[e]^T (under Tile128 with
 *                           I <= 1024 on 128 x 128 ping-pong tiles, Tile128N128)
 *   In both GEMMs, in an expert of one M-tile, a multicast slice of A that lies past the
 *   expert's rows is not copied (EmptyASlices; EX_MOE_SM90_SKIP_EMPTY_A=0 at load copies it).
 *   6. sm90_combine_kernel  out[t] = dtype(sum_k [id valid] topk_weights[t,k] * ys[slot_pos[t*K+k]])
 *                           in fp32, fixed k order: deterministic, no atomics, rounded once.
 *   Numerics: gu is rounded to the dtype by GEMM1's epilogue before silu (as vLLM's
 *   intermediate_cache1), act rounded to the dtype (the contract), ys rounded to the dtype. The
 *   gated epilogue's silu uses __expf and __fdividef (a few fp32 ulps from the ungated kernel's
 *   before act's rounding; on the H200 the outputs of six models at T = 4096 came out identical).
 *
 * GEMM kernel (one type per dtype and tiling for GEMM2 and the ungated GEMM1, plus GatedGemm1 per
 * dtype and tiling, which shares its tile, schedule and mainloop and swaps the B load and the
 * epilogue; GEMM2 also on Tile128N128, see below). Three tilings: Tile64 (64 x 256 x 64,
 * ping-pong: each consumer warpgroup on its own tile) only where dims[7] = 7 (tuned data) or
 * EX_MOE_SM90_TILE64_MAX_ROWS asks for it; else
 * Tile128: KernelPtrArrayTmaWarpSpecializedCooperative,
 * tile 128 x 256 x 64, cluster 1 x 2 x 1 (A multicast to the two CTAs of a pair of N tiles;
 * clustering along N, not M, because M-tiles are rounded up to the cluster size per group and the
 * groups are small), stages from StageCountAutoCarveout, epilogue
 * PtrArrayTmaWarpSpecializedCooperative with no source C (beta = 0), fp32 accumulation. GEMM2 under
 * Tile128 with a short reduction (I <= kSm90Gemm2PingpongMaxI) runs on Tile128N128 (128 x 128 x 64,
 * ping-pong, same cluster) instead. The gated GEMM1 under Tile128 runs in clusters of 2 x 1 CTAs
 * (Tile128M2: the weights multicast to a pair of M-tiles) where I / 128 is odd and the call has
 * T*K/G >= kSm90ClusterM2Rows rows per expert (sm90_gated_m2_for). Where dims[7] = 8 (tuned data: "narrow") both GEMMs run on
 * Tile128N128 (the gated GEMM1 with gate and up boxes of 64 rows): twice the tiles of Tile128,
 * for shapes whose 128 x 256 tiles leave the last round of the persistent grid mostly idle (granite
 * at T = 384..1024: ~160 tiles of GEMM1 on 132 SMs). Where dims[7] = 10 (tuned data: "chunked")
 * both GEMMs run on kernels of our own (moe_chunked_sm90.cuh: a CTA takes up to 256 of an expert's
 * rows against one weight tile, MMAs on the 64-row sub-tiles that hold rows, or with swap AB the
 * chunk's rows as the MMA's N where the last sub-tile would be at most half full, on one band of
 * chunk sizes per launch; the two CTAs of a cluster multicasting the chunk's A, or, where dims[7]
 * = 11 ("chunked_nomc"), each CTA copying its own; chunks of up to 128 rows, one CTA each, with a
 * deeper ring, where the call's rows per expert are at most 104 on average; where dims[7] = 12
 * ("chunked_tail"), chunked's kernels (multicast too) on 256-row chunks whose last takes up to 32
 * rows more as a swap-AB piece, so that an expert of 257..288 rows streams its weights once) where sm90_chunked_for
 * allows (GEMM1 gated, H % 128 == 0, H and I <= 2^23, E <= 4096), else as dims[7] = 4; for experts of a little over
 * 128 rows (mixtral T = 512).
 *
 * Workspace (a pure function of dims; sections 256-byte aligned):
 *   [0, 256)   status word (int32 at byte 0), as the portable path
 *   route_hist int32[B, E] at byte 256, as the portable layout (launch_route's multi-block
 *              routing finds it there: kRouteHistOffset)
 *   meta, tiles, sorted_slots         as the portable layout (the router writes them)
 *   expert_off int32[E+1], slot_pos int32[T*K]
 *   per GEMM g in {1, 2}: shapes[E] (int M,N,K), ptr_A[E], ptr_B[E], ptr_D[E], stride_A/B/D[E]
 *   cutlass    GemmKernel::get_workspace_size for kSm90MaxSms SMs (per-SM TMA descriptors)
 *   bufA       dtype[T*K, max(H, I)]   xs (GEMM1's A); later ys (gated) or act (ungated)
 *   bufB       dtype[T*K, max(2I, H)]  act (gated GEMM1's D); or gu, later ys (ungated)
 *   No launch reads and writes the same buffer (the gated GEMM1 writes act while it still reads xs).
 * workspace_size = max(portable layout, this layout) where this path can be chosen for the dims,
 * else the portable layout.
 */
#define EX_PLUGIN_FILE "moe_fused_gemm_sm90.so"  // names this library in its messages (ex_plugin.cuh)
// GMMA's N in every multiple of 8 (cute's "extended" shapes: m64n160k16 and the like), before any
// cute header: the chunked kernels' swap-AB bands multiply a chunk's rows as N = 32, 96, 160 or 224,
// and without them cute's selector takes the largest standard N that divides the tile (160 -> five
// m64n32k16 instructions, each reading the weights again). The CUTLASS tiles here (N = 64, 128,
// 256) get the same ops either way.
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED

#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cute/tensor.hpp"
#include "cutlass/device_kernel.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include <algorithm>
#include <mutex>
#include <atomic>
#include <cstdlib>
#include <cstring>

// after CUTLASS: its templates must not see the portable code's names (namespace exmoe anyway)
#include "moe_fused_gemm.cuh"
#include "moe_chunked_sm90.cuh"

#if !defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED) || !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "moe_fused_gemm_sm90.cu needs CUDA >= 12.3 and CUTLASS >= 3.5 (TMA descriptor updates on sm_90)"
#endif

EX_DEFINE_ABI_VERSION();

namespace exmoe {

// ------------------------------------------------------------------------------------------
// Thresholds
// ------------------------------------------------------------------------------------------

// The CUTLASS path serves T*K/G >= this many rows per expert (qwen3-30b: T >= 1024; mixtral,
// phi-3.5-moe: T >= 256 and 512). Below, M-tiles of 128 rows would be mostly padding and the
// portable mma.sync kernels (BM 16/64) are as fast: the weights' bytes bound both.
// The environment variable EX_MOE_SM90_MIN_ROWS_PER_EXPERT (a decimal integer >= 0, read by
// ex_get_factor) overrides it, for tuning and tests: 0 sends every aligned shape to CUTLASS.
constexpr int64_t kSm90MinRowsPerExpert = 64;
// Below this many rows per expert the CUTLASS path runs 64-row tiles (sm90::Tile64), from it on
// 128-row tiles (Tile128). 0: Tile64 only where dims[7] = 7 (tuned data) asks for it: on the H200
// (2026-12-01, tune_moe over T = 256..4096, seven models) Tile64 lost to Tile128 at nearly every
// T where the CUTLASS path is the kernel's own choice (e.g. qwen3-30b T = 2048: 577 vs 485 us;
// granite T = 768 the exception, within 3%; its two consumer warpgroups on two tiles load 1.7x
// the smem bytes per FLOP), and won only at 32-50 rows per expert (qwen3-30b T = 512: 341 vs
// 351 us for the best portable tile). Environment override EX_MOE_SM90_TILE64_MAX_ROWS
// (decimal >= 0).
constexpr int64_t kSm90Tile64MaxRows = 0;
// Under Tile128, GEMM2 (reduction over I) runs on 128 x 128 ping-pong tiles (sm90::Tile128N128)
// where I <= this, else on Tile128 as GEMM1. H200, 2026-12-01, per-kernel GEMM2 times at
// T = 4096, two rounds each: ping-pong 2-4.5% faster at I = 512, 768, 1024 (granite 106.0 vs
// 108.5 us, qwen3-30b 219.0 vs 228.8, olmoe 239.0 vs 243.7), slower from I = 1408 on (deepseek
// 261.0 vs 253.9, phi-3.5 I = 6400 765 vs 643, mixtral I = 14336 1692 vs 1444), where the
// epilogue is a small share of a tile's time and the 128 x 256 tile's operand reuse wins.
constexpr int64_t kSm90Gemm2PingpongMaxI = 1024;
// Under Tile128, rows per expert (T*K/G) from which the gated GEMM1 runs in clusters of 2 x 1 CTAs
// where I / 128 is odd (sm90::Tile128M2, sm90_gated_m2_for; measurements there).
constexpr int64_t kSm90ClusterM2Rows = 1024;
// SM count the CUTLASS workspace (one TMA descriptor per SM and tensor) is sized for; the
// launch uses min(multiprocessor_count, this).
constexpr int kSm90MaxSms = 256;
constexpr int kPrepThreads = 256;

// ------------------------------------------------------------------------------------------
// The grouped GEMM types (per element type and tiling; GEMM2 has a third tiling, Tile128N128)
// ------------------------------------------------------------------------------------------

namespace sm90 {
using namespace cute;

// Three tilings of the same grouped GEMM. Tile128: 128 x 256 x 64 CTA tiles, both consumer
// warpgroups on one tile (cooperative), for many rows per expert. Tile64: 64 x 256 x 64 tiles,
// each consumer warpgroup on its own tile, the two alternating between MMA and epilogue
// (ping-pong): half the M padding per expert (an expert with 136 rows needs 3 x 64 rows, not
// 2 x 128), for the middle range of rows per expert. Under Tile128, GEMM2 with a short
// reduction runs on a third, Tile128N128 (below), which the narrow configuration uses for both.
// Each in clusters of 1 x 2 CTAs (A multicast to a pair of N-tiles); the gated GEMM1 also on Tile128M2.
struct Tile128 {
    using TileShape = Shape<_128, _256, _64>;
    using ClusterShape = Shape<_1, _2, _1>;
    using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
    using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
// Tile128 in clusters of 2 x 1 CTAs: the weights (B) multicast to a pair of M-tiles of one expert
// and N-tile, A loaded by each CTA (torch._grouped_mm's choice), for the gated GEMM1 where an
// expert has an odd number of N-tiles (sm90_gated_m2_for). CUTLASS's group scheduler rounds each
// group's tiles up to the cluster's shape (sm90_tile_scheduler_group.hpp, get_tiled_cta_shape_mnl):
// in 1 x 2 pairs deepseek-v2-lite's 11 N-tiles (I / 128) run as 12, the twelfth multiplying the
// first up rows and zero fill and storing nothing (8.3% of the MMAs); in 2 x 1 pairs the N-tiles
// run as they are and the M-tiles are rounded up to pairs instead (13 run as 14, the last all zero
// fill), which costs less only where an expert has many M-tiles. H100, 2026-12-06 (RESULTS.md,
// session forty-seven): deepseek T = 16384 (1536 rows an expert) gated GEMM1 1858 -> 1663 us, the
// call 3.5-7% faster; at 96-384 rows an expert 0.5-10% slower; with an even I / 128 (qwen3-235b,
// qwen3-30b, olmoe, granite, phi-3.5 at 1024-3277 rows) within -1.7% to +0.8% of the pairs.
// (One CTA per cluster instead, without any multicast, was no faster: 1.7x the DRAM reads.)
struct Tile128M2 : Tile128 {
    using ClusterShape = Shape<_2, _1, _1>;
};
struct Tile64 {
    using TileShape = Shape<_64, _256, _64>;
    using ClusterShape = Shape<_1, _2, _1>;
    using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
    using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};
// GEMM2 under Tile128 where I <= kSm90Gemm2PingpongMaxI: 128 x 128 x 64 tiles, ping-pong (one
// consumer warpgroup's epilogue runs while the other's MMAs do). With a short reduction (I = 768:
// 12 k-steps per tile) the cooperative tile's epilogue, not hidden, is a large share of its time.
// Also both GEMMs of the "narrow" configuration (dims[7] = 8); each consumer warpgroup's tile is
// then 128 rows, two MMAs along M (the gated epilogue handles both).
struct Tile128N128 {
    using TileShape = Shape<_128, _128, _64>;
    using ClusterShape = Shape<_1, _2, _1>;
    using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
    using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// Set at load (EX_MOE_SM90_SKIP_EMPTY_A=0 turns it off): the GEMMs' producers leave out the TMA
// copy of a multicast slice of A whose rows all lie past the group's M (EmptyASlices).
static bool g_skip_empty_a = true;

// A's tile is multicast in cluster_y slices of BM / cluster_y rows, CTA y of a cluster row loading
// slice y to all of them (cute's multicast TMA splits the box along its outermost mode, M). Where
// the tile's valid rows (the group's M past m_coord * BM) end before a slice begins, that slice is
// all zero fill: its CTA issues no copy, and every CTA completes the slice's bytes on its own
// stage barrier instead (the same elected lane that armed it, within the same phase). The MMA then
// reads that slice's stale rows of the stage, which give output rows >= M only: the epilogues
// store rows < M (the gated one by its row test, the TMA store by the group's D extent). Both CTAs
// of a 1 x 2 cluster work on the same M-tile of the same group (A is multicast between them); in a
// 2 x 1 cluster (Tile128M2) each CTA loads its own M-tile's A as one slice, which is left out
// where that tile lies wholly past the group's M (the pair's rounding of an expert of one M-tile).
template <class TileShape, class ClusterShape, class ElementA>
struct EmptyASlices {
    static constexpr int kSlices = cute::size<1>(ClusterShape{});
    static constexpr int kBM = cute::size<0>(TileShape{});
    static constexpr int kSliceRows = kBM / kSlices;
    static constexpr uint32_t kSliceBytes = uint32_t(kSliceRows * cute::size<2>(TileShape{}) * sizeof(ElementA));
    static_assert(kBM % kSlices == 0, "whole slices");
    // the split is along M only while a stage is one 64-column (128-byte swizzle) block of K
    static_assert(cute::size<2>(TileShape{}) * sizeof(ElementA) == 128, "A stage: 128-byte rows");
    int count = 0;      // empty slices of this tile
    bool mine = false;  // this CTA's slice is one of them
    // Only in groups of one M-tile: where an expert has more, its last tile runs in step with the
    // others over the same weight tiles (L2 reuse), and a lighter last tile measured slower
    // (H200, both GEMMs skipping: mixtral T = 512 1031.5 vs 1012.1 us, phi-3.5 T = 1024 935.4 vs
    // 923.6, every round; ab_skip_empty_a2_h200_2026-12-02.json).
    CUTLASS_DEVICE EmptyASlices(bool on, int group_m, int m_coord, int slice) {
        if (!on || group_m > kBM) return;
        const int m_valid = group_m - m_coord * kBM;
        for (int sl = 0; sl < kSlices; ++sl) count += (sl * kSliceRows >= m_valid) ? 1 : 0;
        mine = slice * kSliceRows >= m_valid;
    }
    template <class Barrier>
    CUTLASS_DEVICE void complete(Barrier* bar) const {
        if (count)
            cutlass::arch::ClusterTransactionBarrier::complete_transaction(bar, cute::block_rank_in_cluster(),
                                                                           count * kSliceBytes, 1);
    }
};

// CUTLASS's ptr-array mainloop with EmptyASlices in its producer (GEMM2 and the ungated GEMM1):
// load_init and tensors_perform_update (which the kernels call where a tile's group differs from
// the previous tile's, the first tile included) carry the group's M to load.
template <class Base>
struct SkipAMainloop : Base {
    using typename Base::TileShape;
    using typename Base::InternalElementA;
    using typename Base::SmemLayoutA;
    using typename Base::SmemLayoutB;
    using typename Base::MainloopPipeline;
    using typename Base::TensorStorage;
    using typename Base::Arguments;
    using DispatchPolicy = typename Base::DispatchPolicy;
    using Slices = EmptyASlices<TileShape, typename DispatchPolicy::ClusterShape, InternalElementA>;

    struct Params : Base::Params {
        int skip_empty_a;
    };
    template <class ProblemShape>
    static Params to_underlying_arguments(ProblemShape problem_shapes, Arguments const& args, void* workspace) {
        return Params{Base::to_underlying_arguments(problem_shapes, args, workspace), g_skip_empty_a ? 1 : 0};
    }
    template <class ProblemShape_MNKL>
    CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL, Params const& p) const {
        auto t = Base::load_init(problem_shape_MNKL, p);
        return cute::make_tuple(get<0>(t), get<1>(t), int32_t(get<0>(problem_shape_MNKL)));
    }
    template <class InputTensors, class ProblemShape_MNKL>
    CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const& in, Params const&,
                                                       ProblemShape_MNKL problem_shape_mnkl, int32_t) {
        return cute::make_tuple(get<0>(in), get<1>(in), int32_t(get<0>(problem_shape_mnkl)));
    }
    // Base::load with the A copy of an empty slice left out
    template <class TensorA, class TensorB, class TensorMapA, class TensorMapB, class KTileIterator,
              class BlockCoord>
    CUTLASS_DEVICE void load(Params const& p, MainloopPipeline pipeline,
                             typename Base::PipelineState smem_pipe_write,
                             cute::tuple<TensorA, TensorB, int32_t> const& load_inputs,
                             cute::tuple<TensorMapA, TensorMapB> const& input_tensormaps,
                             BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                             int thread_idx, uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
        int lane_predicate = cute::elect_one_sync();
        if (lane_predicate) {
            Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (BM,BK,PIPE)
            Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (BN,BK,PIPE)
            constexpr uint32_t cluster_shape_x = get<0>(typename DispatchPolicy::ClusterShape());
            uint2 cluster_local_block_id = {block_rank_in_cluster % cluster_shape_x,
                                            block_rank_in_cluster / cluster_shape_x};
            Tensor gA_mkl = get<0>(load_inputs);
            Tensor gB_nkl = get<1>(load_inputs);
            auto block_tma_a = p.tma_load_a.get_slice(cluster_local_block_id.y);
            auto block_tma_b = p.tma_load_b.get_slice(cluster_local_block_id.x);
            auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
            Tensor gA = gA_mkl(_, _, m_coord, _, l_coord);
            Tensor gB = gB_nkl(_, _, n_coord, _, l_coord);
            Tensor tAgA = block_tma_a.partition_S(gA);
            Tensor tAsA = block_tma_a.partition_D(sA);
            Tensor tBgB = block_tma_b.partition_S(gB);
            Tensor tBsB = block_tma_b.partition_D(sB);
            uint16_t mcast_mask_a = 0, mcast_mask_b = 0;
            if constexpr (cute::is_same_v<typename Base::GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>) {
                auto block_layout = Layout<typename DispatchPolicy::ClusterShape>{};
                for (int n = 0; n < size<1>(block_layout); ++n)
                    mcast_mask_a |= (uint16_t(1) << block_layout(cluster_local_block_id.x, n, Int<0>{}));
            }
            if constexpr (cute::is_same_v<typename Base::GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
                auto block_layout = Layout<typename DispatchPolicy::ClusterShape>{};
                for (int m = 0; m < size<0>(block_layout); ++m)
                    mcast_mask_b |= (uint16_t(1) << block_layout(m, cluster_local_block_id.y, Int<0>{}));
            }
            const Slices empty(p.skip_empty_a != 0, get<2>(load_inputs), int(m_coord), int(cluster_local_block_id.y));
            CUTLASS_PRAGMA_NO_UNROLL
            for (; k_tile_count > 0; --k_tile_count) {
                pipeline.producer_acquire(smem_pipe_write);
                using BarrierType = typename MainloopPipeline::ProducerBarrierType;
                BarrierType* tma_barrier = pipeline.producer_get_barrier(smem_pipe_write);
                const int write_stage = smem_pipe_write.index();
                if (!empty.mine)
                    copy(p.tma_load_a.with(get<0>(input_tensormaps), *tma_barrier, mcast_mask_a),
                         tAgA(_, _, _, *k_tile_iter), tAsA(_, _, _, write_stage));
                empty.complete(tma_barrier);
                copy(p.tma_load_b.with(get<1>(input_tensormaps), *tma_barrier, mcast_mask_b),
                     tBgB(_, _, _, *k_tile_iter), tBsB(_, _, _, write_stage));
                ++k_tile_iter;
                ++smem_pipe_write;
            }
        }
    }
};

template <typename ElementT, class Tile = Tile128>  // ElementT: cutlass::bfloat16_t or cutlass::half_t
struct GroupedGemmKernel {
    using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
    using TileShape = typename Tile::TileShape;
    using ClusterShape = typename Tile::ClusterShape;
    using LayoutA = cutlass::layout::RowMajor;     // M x K, K contiguous
    using LayoutB = cutlass::layout::ColumnMajor;  // K x N with K contiguous = weights [N][K]
    using LayoutD = cutlass::layout::RowMajor;     // M x N, N contiguous
    static constexpr int kAlign = 128 / cutlass::sizeof_bits<ElementT>::value;  // 8: 16 bytes

    using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
        cutlass::epilogue::collective::EpilogueTileAuto, float, float,
        void, LayoutD*, kAlign,         // no source C
        ElementT, LayoutD*, kAlign,
        typename Tile::EpilogueSchedule,
        cutlass::epilogue::fusion::LinearCombination<ElementT, float, void, float>>::CollectiveOp;

    using CollectiveMainloop = SkipAMainloop<typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
        ElementT, LayoutA*, kAlign, ElementT, LayoutB*, kAlign, float,
        TileShape, ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<
            static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
        typename Tile::KernelSchedule>::CollectiveOp>;

    using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
};

// The names the host code reads of a kernel type K (GroupedGemmKernel, GatedGemm1Kernel).
template <class K>
struct GemmTypes : K {
    using typename K::Kernel;
    using Shape3 = typename K::ProblemShape::UnderlyingProblemShape;
    using StrideA = typename Kernel::InternalStrideA;
    using StrideB = typename Kernel::InternalStrideB;
    using StrideD = typename Kernel::InternalStrideD;
    using EA = typename Kernel::ElementA;
    using EB = typename Kernel::ElementB;
    using ED = typename Kernel::ElementD;
    static constexpr int kStages = K::CollectiveMainloop::DispatchPolicy::Stages;
    static constexpr int kClusterX = size<0>(typename K::ClusterShape{});
    static constexpr int kClusterY = size<1>(typename K::ClusterShape{});
};

template <typename ElementT, class Tile = Tile128>
using GroupedGemm = GemmTypes<GroupedGemmKernel<ElementT, Tile>>;

// The device-written arguments of one grouped GEMM (E entries each, in the workspace).
template <class G>
struct GroupArrays {
    typename G::Shape3* shapes;
    const typename G::EA** a;
    const typename G::EB** b;
    typename G::ED** d;
    typename G::StrideA* sa;
    typename G::StrideB* sb;
    typename G::StrideD* sd;
};

template <typename T> struct CutlassType;
template <> struct CutlassType<__nv_bfloat16> { using type = cutlass::bfloat16_t; };
template <> struct CutlassType<__half> { using type = cutlass::half_t; };
template <class G> struct IsGated : std::false_type {};

// ------------------------------------------------------------------------------------------
// GEMM1 with silu(gate) * up in its epilogue (needs I % 128 == 0)
//
// The CTA tile is 128 x 256 as above, but its 256 B rows are two boxes of 128 weight rows:
// w13[e] rows [128 j, 128 j + 128) (gate) land in smem rows 0..127 and rows [I + 128 j, ...)
// (up) in rows 128..255 of the same stage, so accumulator columns c and c + 128 of the tile are
// gate and up of act column 128 j + c. The problem shape stays (M, 2I, H): the scheduler makes
// 2I / 256 = I / 128 N-tiles per expert, j = the tile's N index. B's smem stage (256 x 64,
// 128-byte swizzle atoms of 8 x 64 stacked along N) is, element for element, two consecutive
// 128 x 64 stages, so the TMA writes a (128, 64, 2 * Stages) view of the same buffer and the MMA
// reads it unchanged. The epilogue (no smem, direct stores) rounds gate and up to the dtype
// first, as the unfused path's GEMM1 epilogue does, so act is bit-identical to it.
// ------------------------------------------------------------------------------------------

template <class Base>
struct GatedMainloop : Base {
    using typename Base::TileShape;
    using typename Base::InternalElementA;
    using typename Base::InternalElementB;
    using typename Base::InternalStrideA;
    using typename Base::InternalStrideB;
    using typename Base::SmemLayoutA;
    using typename Base::SmemLayoutB;
    using typename Base::SmemLayoutAtomB;
    using typename Base::MainloopPipeline;
    using typename Base::TensorStorage;
    using typename Base::TensorMapStorage;
    using typename Base::Arguments;
    using DispatchPolicy = typename Base::DispatchPolicy;
    static constexpr int kStages = DispatchPolicy::Stages;
    using HalfN = Int<decltype(size<1>(TileShape{}))::value / 2>;
    using BK = Int<decltype(size<2>(TileShape{}))::value>;
    using TileShapeH = Shape<Int<decltype(size<0>(TileShape{}))::value>, HalfN, BK>;
    // the B stages as 2 * Stages stages of half the rows (same bytes, same swizzle)
    using SmemLayoutBH = decltype(tile_to_shape(SmemLayoutAtomB{}, make_shape(HalfN{}, BK{}, Int<2 * kStages>{}),
                                                Step<_1, _2, _3>{}));
    // In clusters of 2 x 1 (Tile128M2) the two CTAs share the N-tile: CTA x = 0 copies the gate
    // box, x = 1 the up box, each multicast to both (the whole box: a TMA of cluster size 1)
    static constexpr int kClusterM = cute::size<0>(typename DispatchPolicy::ClusterShape{});
    static_assert(kClusterM == 1 || kClusterM == 2, "B multicast over at most a pair of M-tiles");
    using BCopyOp = cute::conditional_t<kClusterM == 1, SM90_TMA_LOAD, SM90_TMA_LOAD_MULTICAST>;
    static_assert(cute::is_same_v<typename Base::GmemTiledCopyB, BCopyOp>, "B multicast iff cluster M = 2");
    static_assert(!cutlass::gemm::detail::is_major<0, InternalStrideB>(), "B K-major");
    static_assert(cosize(SmemLayoutBH{}) == cosize(SmemLayoutB{}), "same B buffer");
    using TMA_BH = decltype(make_tma_copy(
        BCopyOp{},
        make_tensor(static_cast<InternalElementB const*>(nullptr), repeat_like(InternalStrideB{}, int32_t(0)),
                    InternalStrideB{}),
        SmemLayoutBH{}(_, _, cute::Int<0>{}), make_shape(HalfN{}, BK{}), _1{}));

    struct Params : Base::Params {
        TMA_BH tma_load_bh;
        int skip_empty_a;
    };

    template <class ProblemShape>
    static Params to_underlying_arguments(ProblemShape problem_shapes, Arguments const& args, void* workspace) {
        auto init_shape = repeat_like(typename ProblemShape::UnderlyingProblemShape{}, int32_t(1));
        InternalElementB const* ptr_B_first = reinterpret_cast<InternalElementB const*>(
            reinterpret_cast<uint64_t>(args.ptr_B) & 0xFFFFFFFFFFFFFFF0);
        Tensor tensor_b = make_tensor(ptr_B_first, make_layout(make_shape(get<1>(init_shape), get<2>(init_shape),
                                                                          int32_t(1)),
                                                               InternalStrideB{}));
        TMA_BH bh = make_tma_copy(BCopyOp{}, tensor_b, SmemLayoutBH{}(_, _, cute::Int<0>{}),
                                  make_shape(HalfN{}, BK{}), _1{});
        return Params{Base::to_underlying_arguments(problem_shapes, args, workspace), bh, g_skip_empty_a ? 1 : 0};
    }

    template <class ProblemShape_MNKL>
    CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL, Params const& p) const {
        using X = Underscore;
        auto [M, N, K, L] = problem_shape_MNKL;
        Tensor mA_mkl = p.tma_load_a.get_tma_tensor(make_shape(M, K, int32_t(1)));
        Tensor mB_nkl = p.tma_load_bh.get_tma_tensor(make_shape(N, K, int32_t(1)));
        Tensor gA_mkl = local_tile(mA_mkl, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{});   // (BM,BK,m,k,l)
        Tensor gB_nkl = local_tile(mB_nkl, TileShapeH{}, make_coord(_, _, _), Step<X, _1, _1>{});  // (BN/2,BK,n,k,l)
        return cute::make_tuple(gA_mkl, gB_nkl, int32_t(M));  // M: the group's rows (load's empty slices)
    }

    // the kernel calls this where a tile's group differs from the previous tile's: its M
    template <class InputTensors, class ProblemShape_MNKL>
    CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const& in, Params const&,
                                                       ProblemShape_MNKL problem_shape_mnkl, int32_t) {
        return cute::make_tuple(get<0>(in), get<1>(in), int32_t(get<0>(problem_shape_mnkl)));
    }

    template <class TensorA, class TensorB, class TensorMapA, class TensorMapB, class KTileIterator,
              class BlockCoord>
    CUTLASS_DEVICE void load(Params const& p, MainloopPipeline pipeline,
                             typename Base::PipelineState smem_pipe_write,
                             cute::tuple<TensorA, TensorB, int32_t> const& load_inputs,
                             cute::tuple<TensorMapA, TensorMapB> const& input_tensormaps,
                             BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                             int thread_idx, uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
        int lane_predicate = cute::elect_one_sync();
        if (lane_predicate) {
            Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});    // (BM,BK,PIPE)
            Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutBH{});   // (BN/2,BK,2*PIPE)
            constexpr uint32_t cluster_shape_x = get<0>(typename DispatchPolicy::ClusterShape());
            uint2 cluster_local_block_id = {block_rank_in_cluster % cluster_shape_x,
                                            block_rank_in_cluster / cluster_shape_x};
            Tensor gA_mkl = get<0>(load_inputs);
            Tensor gB_nkl = get<1>(load_inputs);
            auto block_tma_a = p.tma_load_a.get_slice(cluster_local_block_id.y);
            auto block_tma_b = p.tma_load_bh.get_slice(0);
            auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
            const int n_up = int(size<2>(gB_nkl)) / 2;  // I / 128 half-tiles of gate rows precede the up rows
            Tensor gA = gA_mkl(_, _, m_coord, _, l_coord);
            Tensor gBg = gB_nkl(_, _, n_coord, _, l_coord);
            Tensor gBu = gB_nkl(_, _, n_coord + n_up, _, l_coord);
            Tensor tAgA = block_tma_a.partition_S(gA);
            Tensor tAsA = block_tma_a.partition_D(sA);
            Tensor tBgBg = block_tma_b.partition_S(gBg);
            Tensor tBgBu = block_tma_b.partition_S(gBu);
            Tensor tBsB = block_tma_b.partition_D(sB);
            uint16_t mcast_mask_a = 0, mcast_mask_b = 0;
            if constexpr (cute::is_same_v<typename Base::GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>) {
                auto block_layout = Layout<typename DispatchPolicy::ClusterShape>{};
                for (int n = 0; n < size<1>(block_layout); ++n)
                    mcast_mask_a |= (uint16_t(1) << block_layout(cluster_local_block_id.x, n, Int<0>{}));
            }
            if constexpr (kClusterM == 2) {
                auto block_layout = Layout<typename DispatchPolicy::ClusterShape>{};
                for (int m = 0; m < kClusterM; ++m)
                    mcast_mask_b |= (uint16_t(1) << block_layout(m, cluster_local_block_id.y, Int<0>{}));
            }
            // A's multicast slices past the group's rows: not copied (EmptyASlices)
            const EmptyASlices<TileShape, typename DispatchPolicy::ClusterShape, InternalElementA> empty(
                p.skip_empty_a != 0, get<2>(load_inputs), int(m_coord), int(cluster_local_block_id.y));
            CUTLASS_PRAGMA_NO_UNROLL
            for (; k_tile_count > 0; --k_tile_count) {
                pipeline.producer_acquire(smem_pipe_write);
                using BarrierType = typename MainloopPipeline::ProducerBarrierType;
                BarrierType* tma_barrier = pipeline.producer_get_barrier(smem_pipe_write);
                const int write_stage = smem_pipe_write.index();
                if (!empty.mine)
                    copy(p.tma_load_a.with(get<0>(input_tensormaps), *tma_barrier, mcast_mask_a),
                         tAgA(_, _, _, *k_tile_iter), tAsA(_, _, _, write_stage));
                empty.complete(tma_barrier);
                if constexpr (kClusterM == 1) {
                    copy(p.tma_load_bh.with(get<1>(input_tensormaps), *tma_barrier, 0),
                         tBgBg(_, _, _, *k_tile_iter), tBsB(_, _, _, 2 * write_stage));
                    copy(p.tma_load_bh.with(get<1>(input_tensormaps), *tma_barrier, 0),
                         tBgBu(_, _, _, *k_tile_iter), tBsB(_, _, _, 2 * write_stage + 1));
                } else if (cluster_local_block_id.x == 0) {
                    copy(p.tma_load_bh.with(get<1>(input_tensormaps), *tma_barrier, mcast_mask_b),
                         tBgBg(_, _, _, *k_tile_iter), tBsB(_, _, _, 2 * write_stage));
                } else {
                    copy(p.tma_load_bh.with(get<1>(input_tensormaps), *tma_barrier, mcast_mask_b),
                         tBgBu(_, _, _, *k_tile_iter), tBsB(_, _, _, 2 * write_stage + 1));
                }
                ++k_tile_iter;
                ++smem_pipe_write;
            }
        }
    }

    CUTLASS_DEVICE auto tensormaps_init(Params const& p, TensorMapStorage& shared_tensormaps, int32_t sm_count,
                                        int32_t sm_idx) {
        cute::TmaDescriptor* gmem_tensormap = reinterpret_cast<cute::TmaDescriptor*>(p.tensormaps);
        cute::TmaDescriptor* tma_desc_a = &gmem_tensormap[sm_idx];
        cute::TmaDescriptor* tma_desc_b = &gmem_tensormap[sm_idx + sm_count];
        if (cute::elect_one_sync()) {
            Tensor pA = make_tensor(p.tma_load_a.get_tma_descriptor(), Int<1>{}, Int<1>{});
            Tensor sA = make_tensor(make_smem_ptr(&shared_tensormaps.smem_tensormap_A), Int<1>{}, Int<1>{});
            Tensor pB = make_tensor(p.tma_load_bh.get_tma_descriptor(), Int<1>{}, Int<1>{});
            Tensor sB = make_tensor(make_smem_ptr(&shared_tensormaps.smem_tensormap_B), Int<1>{}, Int<1>{});
            copy(recast<uint128_t>(pA), recast<uint128_t>(sA));
            copy(recast<uint128_t>(pB), recast<uint128_t>(sB));
        }
        __syncwarp();
        return cute::make_tuple(tma_desc_a, tma_desc_b);
    }

    template <class ProblemShape_MNKL>
    CUTLASS_DEVICE void tensormaps_replace_global_tensor_properties(TensorMapStorage& shared_tensormaps,
                                                                    Params const& p, int32_t next_group,
                                                                    ProblemShape_MNKL problem_shape_mnkl) {
        const uint32_t M = get<0>(problem_shape_mnkl);
        const uint32_t N = get<1>(problem_shape_mnkl);
        const uint32_t K = get<2>(problem_shape_mnkl);
        cute::array<uint32_t, 5> shape_A = {1, 1, 1, 1, 1};
        cute::array<uint64_t, 5> stride_A = {0, 0, 0, 0, 0};
        cute::array<uint32_t, 5> shape_B = {1, 1, 1, 1, 1};
        cute::array<uint64_t, 5> stride_B = {0, 0, 0, 0, 0};
        InternalElementA const* ptr_A = nullptr;
        Tensor tensor_a = make_tensor(ptr_A, make_shape(M, K, Int<1>{}), p.dA[next_group]);
        InternalElementB const* ptr_B = nullptr;
        Tensor tensor_b = make_tensor(ptr_B, make_shape(N, K, Int<1>{}), p.dB[next_group]);
        cute::detail::fill_tma_gmem_shape_stride(p.tma_load_a, tensor_a, shape_A, stride_A);
        cute::detail::fill_tma_gmem_shape_stride(p.tma_load_bh, tensor_b, shape_B, stride_B);
        for (uint64_t& st : stride_A) st = (st * sizeof_bits_v<InternalElementA>) / 8;
        for (uint64_t& st : stride_B) st = (st * sizeof_bits_v<InternalElementB>) / 8;
        cute::tma_descriptor_replace_dims_strides_in_shared_mem(shared_tensormaps.smem_tensormap_A, shape_A, stride_A);
        cute::tma_descriptor_replace_dims_strides_in_shared_mem(shared_tensormaps.smem_tensormap_B, shape_B, stride_B);
    }

    template <class TensorMapA, class TensorMapB, class ProblemShape_MNKL>
    CUTLASS_DEVICE void tensormaps_perform_update(TensorMapStorage& shared_tensormaps, Params const& p,
                                                  cute::tuple<TensorMapA, TensorMapB> const& input_tensormaps,
                                                  ProblemShape_MNKL problem_shape_mnkl, int32_t next_batch) {
        if (cute::elect_one_sync()) {
            this->tensormaps_replace_global_address(shared_tensormaps, p, next_batch);
            tensormaps_replace_global_tensor_properties(shared_tensormaps, p, next_batch, problem_shape_mnkl);
        }
    }
};

// silu with the hardware's approximate exp2 and reciprocal (2 MUFU operations): within a few
// float ulps of g / (1 + expf(-g)); -inf as exp's result gives 0, as it should.
__device__ __forceinline__ float silu_fast(float g) { return __fdividef(g, 1.0f + __expf(-g)); }

// Operator-style epilogue (wrapped by Sm90TmaWarpSpecializedAdapter): act[row, 128 j + c] =
// dtype(silu(dtype(acc[row, c])) * dtype(acc[row, 128 + c])), c < 128, for rows < M and act
// columns < N / 2 = I. ptr_D / dD: act of the group (GEMM2's A pointers and strides).
template <typename ElementT, typename TNative>
struct GatedEpilogueOp {
    using EpilogueSchedule = cutlass::epilogue::PtrArrayNoSmemWarpSpecialized;
    using DispatchPolicy = EpilogueSchedule;
    using ElementOutput = ElementT;
    using ElementAccumulator = float;
    using ElementCompute = float;
    using ElementScalar = float;
    using ElementC = ElementT;
    using ElementD = ElementT;
    using InternalStrideC = cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>;
    using InternalStrideD = InternalStrideC;
    using StrideC = InternalStrideC*;
    using StrideD = InternalStrideD*;
    using GmemTiledCopyC = void;
    using GmemTiledCopyD = void;
    struct SharedStorage {};
    using TensorMapStorage = SharedStorage;
    struct Arguments {
        ElementD** ptr_D = nullptr;
        StrideD dD = nullptr;
    };
    using Params = Arguments;

    template <class ProblemShape>
    static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) { return args; }
    template <class ProblemShape>
    static size_t get_workspace_size(ProblemShape const&, Arguments const&, int) { return 0; }
    template <class ProblemShape>
    static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                                cutlass::CudaHostAdapter* = nullptr) {
        return cutlass::Status::kSuccess;
    }
    template <class ProblemShape>
    static bool can_implement(ProblemShape const&, Arguments const& args) { return args.ptr_D != nullptr; }

    CUTLASS_HOST_DEVICE GatedEpilogueOp(Params const& p) : params(p) {}
    CUTLASS_DEVICE bool is_source_needed() { return false; }

    template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
              class TiledMma, class ResidueMNK>
    CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                   BlockCoordMNKL blk_coord_mnkl,
                                   cute::Tensor<FrgEngine, FrgLayout> const& accumulators, TiledMma tiled_mma,
                                   ResidueMNK, int thread_idx, char*) {
        using E2 = typename Elem<TNative>::T2;
        constexpr int BM = size<0>(BlockShapeMNK{});
        constexpr int BN = size<1>(BlockShapeMNK{});
        // fragment of one thread: ((2 cols, 2 rows, BN/8 column blocks), MM, 1): MM = 1 where a
        // warpgroup's tile is 64 rows (cooperative 128-row tiles, 64-row ping-pong), 2 where it is
        // 128 (128 x 128 ping-pong: rows mm * 64 + ...); block b + BN/16 holds the columns BN/2
        // to the right of block b
        static_assert(is_static<FrgLayout>::value, "static accumulator layout");
        constexpr int MM = size<1>(FrgLayout{});
        static_assert(rank(FrgLayout{}) == 3 && (MM == 1 || MM == 2) && size<2>(FrgLayout{}) == 1,
                      "one or two MMAs along M per warpgroup tile");
        static_assert(size<0, 0>(FrgLayout{}) == 2 && size<0, 1>(FrgLayout{}) == 2 &&
                      size<0, 2>(FrgLayout{}) == BN / 8, "wgmma m64nNk16 accumulator fragment");
        constexpr int NB2 = BN / 16;
        const int M = get<0>(problem_shape_mnkl);
        const int I = get<1>(problem_shape_mnkl) / 2;
        auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;
        const int64_t ld = get<0>(params.dD[l_coord]);
        const int row0 = int(m_coord) * BM;
        const int col0 = int(n_coord) * (BN / 2);
        TNative* D = reinterpret_cast<TNative*>(params.ptr_D[l_coord]);
        Tensor cD = make_identity_tensor(make_shape(Int<BM>{}, Int<BN>{}));
        auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
        Tensor tCcD = thr_mma.partition_C(cD);
#if defined(EX_SM90_EPI_ACCURATE)
        CUTLASS_PRAGMA_UNROLL
        for (int mm = 0; mm < MM; ++mm)
        CUTLASS_PRAGMA_UNROLL
        for (int b = 0; b < NB2; ++b) {
            CUTLASS_PRAGMA_UNROLL
            for (int h = 0; h < 2; ++h) {
                const auto crd = tCcD(make_coord(make_coord(0, h, b), mm, 0));
                const int r = row0 + int(get<0>(crd));
                const int c = col0 + int(get<1>(crd));
                const float2 g = Elem<TNative>::unpack(Elem<TNative>::pack(
                    accumulators(make_coord(make_coord(0, h, b), mm, 0)),
                    accumulators(make_coord(make_coord(1, h, b), mm, 0))));
                const float2 u = Elem<TNative>::unpack(Elem<TNative>::pack(
                    accumulators(make_coord(make_coord(0, h, b + NB2), mm, 0)),
                    accumulators(make_coord(make_coord(1, h, b + NB2), mm, 0))));
                if (r < M && c < I)
                    *reinterpret_cast<E2*>(D + (int64_t)r * ld + c) =
                        Elem<TNative>::pack(silu_f(g.x) * u.x, silu_f(g.y) * u.y);
            }
        }
#else
        // The 4 threads of a quad hold the same two rows, columns 8 b + 2 q + {0, 1} of every
        // 8-column block b (q = lane & 3). Per row and group of 4 blocks, a 4 x 4 transpose of
        // the packed pairs in the quad (2 shuffle rounds) gives thread q block 4 g + q whole:
        // one 16-byte store instead of four 4-byte ones.
        static_assert(NB2 % 4 == 0, "groups of 4 column blocks");
        if (col0 >= I) return;  // the N-tile past the last (cluster padding): I % (BN/2) == 0
        const int q = int(threadIdx.x) & 3;
        const bool q_hi = (q & 2) != 0, q_odd = (q & 1) != 0;
        CUTLASS_PRAGMA_UNROLL
        for (int mm = 0; mm < MM; ++mm)
        CUTLASS_PRAGMA_UNROLL
        for (int h = 0; h < 2; ++h) {
            const int r = row0 + int(get<0>(tCcD(make_coord(make_coord(0, h, 0), mm, 0))));
            TNative* drow = D + (int64_t)r * ld + col0;
            CUTLASS_PRAGMA_UNROLL
            for (int gi = 0; gi < NB2 / 4; ++gi) {
                uint32_t a[4];
                CUTLASS_PRAGMA_UNROLL
                for (int j = 0; j < 4; ++j) {
                    const int b = 4 * gi + j;
                    const float2 g = Elem<TNative>::unpack(Elem<TNative>::pack(
                        accumulators(make_coord(make_coord(0, h, b), mm, 0)),
                        accumulators(make_coord(make_coord(1, h, b), mm, 0))));
                    const float2 u = Elem<TNative>::unpack(Elem<TNative>::pack(
                        accumulators(make_coord(make_coord(0, h, b + NB2), mm, 0)),
                        accumulators(make_coord(make_coord(1, h, b + NB2), mm, 0))));
                    const E2 v = Elem<TNative>::pack(silu_fast(g.x) * u.x, silu_fast(g.y) * u.y);
                    a[j] = *reinterpret_cast<const uint32_t*>(&v);
                }
                // round 1 (lanes q, q ^ 2), round 2 (q, q ^ 1): a[p] ends as thread p's pair of block 4 gi + q
                uint32_t r0 = __shfl_xor_sync(0xffffffffu, q_hi ? a[0] : a[2], 2);
                uint32_t r1 = __shfl_xor_sync(0xffffffffu, q_hi ? a[1] : a[3], 2);
                if (q_hi) { a[0] = r0; a[1] = r1; } else { a[2] = r0; a[3] = r1; }
                r0 = __shfl_xor_sync(0xffffffffu, q_odd ? a[0] : a[1], 1);
                r1 = __shfl_xor_sync(0xffffffffu, q_odd ? a[2] : a[3], 1);
                if (q_odd) { a[0] = r0; a[2] = r1; } else { a[1] = r0; a[3] = r1; }
                if (r < M)
                    *reinterpret_cast<uint4*>(drow + 8 * (4 * gi + q)) = make_uint4(a[0], a[1], a[2], a[3]);
            }
        }
#endif
    }

    Params params;
};

template <typename ElementT, typename TNative, class Tile = Tile128>
struct GatedGemm1Kernel {
    using Base = GroupedGemmKernel<ElementT, Tile>;
    using ProblemShape = typename Base::ProblemShape;
    using TileShape = typename Base::TileShape;
    using ClusterShape = typename Base::ClusterShape;
    using CollectiveEpilogue =
        cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<GatedEpilogueOp<ElementT, TNative>>;
    using CollectiveMainloop = GatedMainloop<typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
        ElementT, typename Base::LayoutA*, Base::kAlign, ElementT, typename Base::LayoutB*, Base::kAlign, float,
        TileShape, ClusterShape,
        cutlass::gemm::collective::StageCountAutoCarveout<
            static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
        typename Tile::KernelSchedule>::CollectiveOp>;
    using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
};

template <typename ElementT, typename TNative, class Tile = Tile128>
using GatedGemm1 = GemmTypes<GatedGemm1Kernel<ElementT, TNative, Tile>>;

template <typename ElementT, typename TNative, class Tile>
struct IsGated<GemmTypes<GatedGemm1Kernel<ElementT, TNative, Tile>>> : std::true_type {};

}  // namespace sm90

// The strides are cute::Stride<int64_t, _1, _0> (leading dimension, unit, no batch); checked so
// that writing get<0> is all a stride needs.
static_assert(std::is_same<sm90::GroupedGemm<cutlass::bfloat16_t>::StrideA,
                           cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>>::value, "StrideA");
static_assert(std::is_same<sm90::GroupedGemm<cutlass::bfloat16_t>::StrideB,
                           cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>>::value, "StrideB");
static_assert(std::is_same<sm90::GroupedGemm<cutlass::bfloat16_t>::StrideD,
                           cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>>::value, "StrideD");

// ------------------------------------------------------------------------------------------
// Kernel 2: group arguments of both GEMMs + gather of the hidden states into expert order
// ------------------------------------------------------------------------------------------

template <typename T, class G>
__global__ void __launch_bounds__(kPrepThreads)
sm90_prepare_kernel(const T* __restrict__ x, T* __restrict__ xs, const int* __restrict__ sorted,
                    const int* __restrict__ meta, const int* __restrict__ expert_off,
                    const int* __restrict__ slot_pos, const int* __restrict__ ids, const ExpertMap em,
                    const T* __restrict__ w13, const T* __restrict__ w2, T* __restrict__ gu,
                    T* __restrict__ act, T* __restrict__ ys, int T_, int H, int I, int E, int K,
                    bool by_token, int vpl, int spread, sm90::GroupArrays<G> g1, sm90::GroupArrays<G> g2) {
    using EA = typename G::EA;
    using EB = typename G::EB;
    using ED = typename G::ED;
    const long long gtid = (long long)blockIdx.x * kPrepThreads + threadIdx.x;
    const long long nthreads = (long long)gridDim.x * kPrepThreads;
    const int lane = threadIdx.x & 31;
    const int HV = H >> 3;
    // gather by token: a warp's first span of hidden_states is loaded before the wait for the
    // routing (launched with PDL, s_sm90_pdl): x is the call's input, final before the routing's
    // first launch (a plain one) began
    const int span = 32 * vpl;
    const long long spans = (HV + span - 1) / span;
    const long long item0 = gtid >> 5;
    uint4 v[8];
    auto load_span = [&](long long item) {
        const long long t = item / spans;
        const int c0 = (int)(item - t * spans) * span;
        const uint4* src = reinterpret_cast<const uint4*>(x + t * H);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int c = c0 + j * 32 + lane;
            if (j < vpl && c < HV) v[j] = __ldg(src + c);
        }
    };
    if (by_token && item0 < T_ * spans) load_span(item0);
    explugin::pdl_wait();  // the routing's outputs (expert_off, slot_pos, sorted, meta) are final
    // the chunked GEMM1 (launched with PDL) may be scheduled as this grid's blocks exit; it reads
    // expert_off before its own wait, so this comes after ours
    explugin::pdl_launch_dependents();

    // per-expert problem sizes, pointers and strides (an empty expert gets M = 0: no tiles), group
    // g holding expert spread_expert(g) (the group scheduler runs the groups in index order:
    // experts of neighbouring ids, hot together under a skew, do not run back to back); the
    // routing's outputs through L2 (__ldcg): written by the grid this one waited for
    for (long long g = gtid; g < E; g += nthreads) {
        const long long e = spread_expert((int)g, E, spread);
        const long long off = __ldcg(expert_off + e);
        const int m = __ldcg(expert_off + e + 1) - (int)off;
        g1.shapes[g] = typename G::Shape3(m, 2 * I, H);
        g1.a[g] = reinterpret_cast<const EA*>(xs + off * H);
        g1.b[g] = reinterpret_cast<const EB*>(w13 + e * 2LL * I * H);
        g1.d[g] = reinterpret_cast<ED*>(gu + off * 2LL * I);
        typename G::StrideA sa1{}; cute::get<0>(sa1) = H;       // A: M x H, row-major
        typename G::StrideB sb1{}; cute::get<0>(sb1) = H;       // B: 2I rows of H
        typename G::StrideD sd1{}; cute::get<0>(sd1) = 2LL * I; // D: M x 2I, row-major
        g1.sa[g] = sa1; g1.sb[g] = sb1; g1.sd[g] = sd1;

        g2.shapes[g] = typename G::Shape3(m, H, I);
        g2.a[g] = reinterpret_cast<const EA*>(act + off * I);
        g2.b[g] = reinterpret_cast<const EB*>(w2 + e * (long long)H * I);
        g2.d[g] = reinterpret_cast<ED*>(ys + off * H);
        typename G::StrideA sa2{}; cute::get<0>(sa2) = I;
        typename G::StrideB sb2{}; cute::get<0>(sb2) = I;
        typename G::StrideD sd2{}; cute::get<0>(sd2) = H;
        g2.sa[g] = sa2; g2.sb[g] = sb2; g2.sd[g] = sd2;
    }

    if (by_token) {
        // gather by token: one warp per token reads its row of hidden_states once and writes it
        // to the sorted rows of its valid slots (slot_pos, from the routing). Read by sorted row
        // instead, each row is fetched K times at scattered times: at T = 16384 hidden_states
        // (67 MB at H = 2048) does not stay in L2 and those reads went to DRAM.
        // Work item: (token, span of 32 * vpl vectors of its row); vpl (1, 2, 4 or 8 vectors per
        // lane) is chosen on the host so that few tokens still make enough warps.
        for (long long item = item0; item < T_ * spans; item += nthreads >> 5) {
            const long long t = item / spans;
            const int c0 = (int)(item - t * spans) * span;
            if (item != item0) load_span(item);  // the first was loaded before the wait
            for (int kb = 0; kb < K; kb += 32) {  // 32 slots of the token at a time
                int r = -1;  // lane j: sorted row of slot t*K + kb + j, -1 if it goes nowhere
                if (kb + lane < K) {
                    const long long slot = t * K + kb + lane;
                    int unused = 0;
                    if (local_expert(em, __ldg(ids + slot), E, unused) >= 0) r = __ldcg(slot_pos + slot);
                }
                const int nk = K - kb < 32 ? K - kb : 32;
                for (int j2 = 0; j2 < nk; ++j2) {
                    const int rr = __shfl_sync(0xffffffffu, r, j2);
                    if (rr < 0) continue;  // warp-uniform
                    uint4* dst = reinterpret_cast<uint4*>(xs + (long long)rr * H);
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        const int c = c0 + j * 32 + lane;
                        if (j < vpl && c < HV) dst[c] = v[j];
                    }
                }
            }
        }
        return;
    }
    // gather by sorted row (EX_MOE_SM90_GATHER_BY_TOKEN=0): one warp per row, 4 copies in flight
    const int rows = __ldcg(meta + 1);
    for (long long r = gtid >> 5; r < rows; r += nthreads >> 5) {
        const int slot = __ldcg(sorted + r);
        const uint4* src = reinterpret_cast<const uint4*>(x + (long long)(slot / K) * H);
        uint4* dst = reinterpret_cast<uint4*>(xs + r * H);
        int c = lane;
        for (; c + 96 < HV; c += 128) {
            const uint4 v0 = __ldg(src + c), v1 = __ldg(src + c + 32), v2 = __ldg(src + c + 64),
                        v3 = __ldg(src + c + 96);
            dst[c] = v0; dst[c + 32] = v1; dst[c + 64] = v2; dst[c + 96] = v3;
        }
        for (; c < HV; c += 32) dst[c] = __ldg(src + c);
    }
}

// ------------------------------------------------------------------------------------------
// Kernel 4: act[r, i] = dtype(silu(gu[r, i]) * gu[r, I + i]) for the valid rows, 8 per thread
// ------------------------------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kSimpleThreads)
sm90_silu_mul_kernel(T* __restrict__ act, const T* __restrict__ gu, const int* __restrict__ meta, int I) {
    using E2 = typename Elem<T>::T2;
    const int IV = I >> 3;
    const long long total = (long long)meta[1] * IV;
    for (long long i = (long long)blockIdx.x * kSimpleThreads + threadIdx.x; i < total;
         i += (long long)gridDim.x * kSimpleThreads) {
        const long long r = i / IV;
        const int c = (int)(i - r * IV);
        const T* grow = gu + r * 2LL * I + (long long)c * 8;
        const uint4 graw = __ldg(reinterpret_cast<const uint4*>(grow));
        const uint4 uraw = __ldg(reinterpret_cast<const uint4*>(grow + I));
        const E2* g2 = reinterpret_cast<const E2*>(&graw);
        const E2* u2 = reinterpret_cast<const E2*>(&uraw);
        uint4 res;
        E2* r2 = reinterpret_cast<E2*>(&res);
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            const float2 g = Elem<T>::unpack(g2[v]);
            const float2 u = Elem<T>::unpack(u2[v]);
            r2[v] = Elem<T>::pack(silu_f(g.x) * u.x, silu_f(g.y) * u.y);
        }
        *reinterpret_cast<uint4*>(act + r * I + (long long)c * 8) = res;
    }
}

// ------------------------------------------------------------------------------------------
// Kernel 6: out[t, 8 cols] = dtype(sum_k [id valid] w[t,k] * ys[slot_pos[t*K+k], 8 cols]), fp32,
// k in order (deterministic); four rows' loads in flight per thread.
// ------------------------------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kSimpleThreads)
sm90_combine_kernel(T* __restrict__ out, const T* __restrict__ ys, const int* __restrict__ slot_pos,
                    const float* __restrict__ tw, const int* __restrict__ ids, const ExpertMap em,
                    int T_, int H, int E, int K) {
    using E2 = typename Elem<T>::T2;
    const int HV = H >> 3;
    const long long total = (long long)T_ * HV;
    explugin::pdl_wait();  // launched with PDL (s_sm90_pdl): GEMM2 is done and ys visible
    for (long long i = (long long)blockIdx.x * kSimpleThreads + threadIdx.x; i < total;
         i += (long long)gridDim.x * kSimpleThreads) {
        const long long t = i / HV;
        const int hv = (int)(i - t * HV);
        float acc[8];
#pragma unroll
        for (int v = 0; v < 8; ++v) acc[v] = 0.0f;
        for (int k0 = 0; k0 < K; k0 += 4) {
            uint4 raw[4];
            float w[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int k = k0 + j;
                w[j] = 0.0f;
                raw[j] = make_uint4(0u, 0u, 0u, 0u);
                if (k < K) {
                    const long long slot = t * K + k;
                    int unused = 0;
                    if (local_expert(em, __ldg(ids + slot), E, unused) >= 0) {  // else: nothing
                        w[j] = __ldg(tw + slot);
                        const long long r = __ldg(slot_pos + slot);
                        // ys through L2 (__ldcg): GEMM2's output, this grid waited for it
                        raw[j] = __ldcg(reinterpret_cast<const uint4*>(ys + r * H) + hv);
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (k0 + j >= K) break;
                const E2* v2 = reinterpret_cast<const E2*>(&raw[j]);
#pragma unroll
                for (int v = 0; v < 4; ++v) {
                    const float2 f = Elem<T>::unpack(v2[v]);
                    acc[2 * v] = fmaf(w[j], f.x, acc[2 * v]);
                    acc[2 * v + 1] = fmaf(w[j], f.y, acc[2 * v + 1]);
                }
            }
        }
        uint4 res;
        E2* r2 = reinterpret_cast<E2*>(&res);
#pragma unroll
        for (int v = 0; v < 4; ++v) r2[v] = Elem<T>::pack(acc[2 * v], acc[2 * v + 1]);
        *reinterpret_cast<uint4*>(out + t * H + (long long)hv * 8) = res;
    }
}

// ------------------------------------------------------------------------------------------
// Host: state, workspace layout, path choice
// ------------------------------------------------------------------------------------------

static bool s_sm90_enabled = false;  // set by ex_get_factor: the CUTLASS kernel fits this hardware
static int64_t s_sm90_min_rows = kSm90MinRowsPerExpert;  // set by ex_get_factor
static int64_t s_sm90_tile64_max_rows = kSm90Tile64MaxRows;  // set by ex_get_factor
// set by ex_get_factor: the grouped GEMMs' persistent tile order (CUTLASS's group scheduler:
// raster along M, swizzle 1 by default; EX_MOE_SM90_RASTER_N=1 rasters along N,
// EX_MOE_SM90_SWIZZLE=1|2|4|8 sets max_swizzle_size), for comparisons. On the H200 (2026-12-01,
// ab_raster_h200_2026-12-01.json, T = 4096 of six models, 3 rounds) no setting won everywhere:
// swizzle 4 was 0.6-3% faster on five models and 2% slower on olmoe; the default stays.
static bool s_sm90_raster_n = false;
static int s_sm90_swizzle = 1;
// set by ex_get_factor: GEMM1 computes silu(g) * u in its epilogue where I % 128 == 0
// (EX_MOE_SM90_SILU_IN_GEMM1=0: the separate silu_mul launch, for comparison)
static bool s_sm90_gated = true;
// set by ex_get_factor: under Tile128, GEMM2 runs on Tile128N128 where I <= kSm90Gemm2PingpongMaxI
// (EX_MOE_SM90_GEMM2_PINGPONG=0: always on Tile128 as GEMM1, for comparison)
static bool s_sm90_gemm2_pp = true;
// set by ex_get_factor: kSm90ClusterM2Rows, or EX_MOE_SM90_CLUSTER_M2_ROWS (0: never)
static int64_t s_sm90_cluster_m2_rows = kSm90ClusterM2Rows;
// set by ex_get_factor: the gather of hidden_states into expert order runs a warp per token (its
// row read once, written to its slots' sorted rows); EX_MOE_SM90_GATHER_BY_TOKEN=0: a warp per
// sorted row (each row read K times), for comparison
static bool s_sm90_gather_by_token = true;
// set by ex_get_factor: both GEMMs of the CUTLASS tilings run the experts' groups in their spread
// order (route_spread; EX_MOE_SM90_EXPERT_ORDER=id: in id order). Not the chunked kernels' items:
// that order was 0.8-2.4% slower there (T = 512, H100, RESULTS.md session fifty)
static bool s_sm90_spread = true;
// set by ex_get_factor: the chunked kernels (chunked, chunked_tail) in clusters of two CTAs
// multicasting A (where the N-tiles pair up); EX_MOE_SM90_CHUNKED_MULTICAST=0: one CTA per item,
// each loading its own A
static bool s_sm90_chunked_mc = true;
// set by ex_get_factor: the chunked kernels' swap AB (a chunk's rows as the GMMA's N instead of
// 64-row sub-tiles; the weights' 64-row halves as M) on the chunks of one band of sizes, 64j + 1 ..
// 64j + 32 rows, the band nearest the call's rows per expert (chunked::swap_band, swap_pays);
// EX_MOE_SM90_CHUNKED_SWAP_AB=0: never, for comparison
static bool s_sm90_chunked_swap = true;
// set by ex_get_factor: the chunked kernels deal the items of hot experts (skewed routing: more
// than chunked::kHotMeanRatio times the mean rows and two chunks or more) alternately with the
// others' (chunked::Args::hot_rows); EX_MOE_SM90_CHUNKED_INTERLEAVE=0: every item in expert order
static bool s_sm90_chunked_interleave = true;
// set by ex_get_factor (cc >= 9.0 and EX_MOE_SM90_PDL not 0): programmatic dependent launch of the
// gather (it loads its first hidden_states before it waits for the routing), of the chunked GEMMs
// (each copies its first weight stages before it waits for the previous grid) and of the combine
// (its blocks get resident as GEMM2's CTAs exit)
static bool s_sm90_pdl = true;
// set by ex_get_factor: sub-tiles per chunk of the chunked kernels, EX_MOE_SM90_CHUNK_ROWS = auto
// (0, the default: chunked::chunk_subs of the call's rows per expert), 256 (4) or 128 (2)
static int s_sm90_chunk_subs = 0;

using GemmBf16 = sm90::GroupedGemm<cutlass::bfloat16_t>;
using GemmF16 = sm90::GroupedGemm<cutlass::half_t>;
using GatedBf16 = sm90::GatedGemm1<cutlass::bfloat16_t, __nv_bfloat16>;
using GatedF16 = sm90::GatedGemm1<cutlass::half_t, __half>;
using Gemm64Bf16 = sm90::GroupedGemm<cutlass::bfloat16_t, sm90::Tile64>;
using Gemm64F16 = sm90::GroupedGemm<cutlass::half_t, sm90::Tile64>;
using Gated64Bf16 = sm90::GatedGemm1<cutlass::bfloat16_t, __nv_bfloat16, sm90::Tile64>;
using Gated64F16 = sm90::GatedGemm1<cutlass::half_t, __half, sm90::Tile64>;
using GemmPpBf16 = sm90::GroupedGemm<cutlass::bfloat16_t, sm90::Tile128N128>;
using GemmPpF16 = sm90::GroupedGemm<cutlass::half_t, sm90::Tile128N128>;
using GatedPpBf16 = sm90::GatedGemm1<cutlass::bfloat16_t, __nv_bfloat16, sm90::Tile128N128>;
using GatedPpF16 = sm90::GatedGemm1<cutlass::half_t, __half, sm90::Tile128N128>;
using GatedM2Bf16 = sm90::GatedGemm1<cutlass::bfloat16_t, __nv_bfloat16, sm90::Tile128M2>;
using GatedM2F16 = sm90::GatedGemm1<cutlass::half_t, __half, sm90::Tile128M2>;

// CUTLASS workspace bytes (per-SM TMA descriptors) for kSm90MaxSms SMs of one kernel type.
template <class G> static int64_t cutlass_ws_bytes_for() {
    typename G::Kernel::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = typename G::ProblemShape{1, nullptr, nullptr};
    args.hw_info.sm_count = kSm90MaxSms;
    return (int64_t)G::Kernel::get_workspace_size(args);
}

// Every CUTLASS kernel type the plugin launches (two element types x three tilings, gated GEMM1
// or not; the ungated 128 x 128 type is GEMM2's under Tile128 too; the gated GEMM1 of Tile128 also
// in 2 x 1 clusters, Tile128M2); the workspace, smem and
// block-shape figures are taken over all of them.
template <class G0, class... Gs>
struct KernelSet {
    static constexpr int kThreads = (int)G0::Kernel::MaxThreadsPerBlock;
    static_assert(((kThreads == (int)Gs::Kernel::MaxThreadsPerBlock) && ...), "one block shape");
    static constexpr int kSmem = std::max({(int)G0::Kernel::SharedStorageSize, (int)Gs::Kernel::SharedStorageSize...});
    // the largest CUTLASS workspace; a function of the kernel types only, computed once
    static int64_t ws_bytes() {
        static const int64_t bytes = std::max({cutlass_ws_bytes_for<G0>(), cutlass_ws_bytes_for<Gs>()...});
        return bytes;
    }
};
using AllKernels = KernelSet<GemmBf16, GemmF16, GatedBf16, GatedF16, Gemm64Bf16, Gemm64F16, Gated64Bf16, Gated64F16,
                             GemmPpBf16, GemmPpF16, GatedPpBf16, GatedPpF16, GatedM2Bf16, GatedM2F16>;
static int64_t cutlass_ws_bytes() { return AllKernels::ws_bytes(); }

struct Sm90Layout {
    int64_t meta, tiles, sorted, expert_off, slot_pos;
    int64_t grp[2][7];  // shapes, a, b, d, sa, sb, sd
    int64_t cutlass, cutlass_bytes, bufA, bufB, total;
    int64_t bufC = 0;  // diagnostic builds (EX_MOE_DIAG) only: ys apart from xs, see launch_sm90
};

static Sm90Layout sm90_layout(const Problem& P) {
    Sm90Layout L;
    int64_t off = 256;  // [0, 256): status word
    off += route_hist_bytes(P);  // multi-block routing's hist at kRouteHistOffset, as ws_layout
    L.meta = off;
    off += 256;
    L.tiles = off;  // the router's tile list, sized as in the portable layout
    off += align256(max_tiles_for(P.TK, P.E, kSmallBM) * 16);
    L.sorted = off;
    off += align256(P.TK * 4);
    L.expert_off = off;
    off += align256((P.E + 1) * 4);
    L.slot_pos = off;
    off += align256(P.TK * 4);
    static_assert(sizeof(GemmBf16::Shape3) == 12 && sizeof(GemmF16::Shape3) == 12, "shape (M,N,K) of int");
    static_assert(sizeof(GemmBf16::StrideA) == 8 && sizeof(GemmBf16::StrideB) == 8 &&
                  sizeof(GemmBf16::StrideD) == 8, "strides of one int64");
    for (int g = 0; g < 2; ++g) {
        L.grp[g][0] = off;
        off += align256(P.E * 12);
        for (int j = 1; j < 7; ++j) {
            L.grp[g][j] = off;
            off += align256(P.E * 8);
        }
    }
    L.cutlass = off;
    L.cutlass_bytes = align256(cutlass_ws_bytes());
    off += L.cutlass_bytes;
    L.bufA = off;
    off += align256(P.TK * (P.H > P.I ? P.H : P.I) * 2);
    L.bufB = off;
    off += align256(P.TK * (2 * P.I > P.H ? 2 * P.I : P.H) * 2);
#if defined(EX_MOE_DIAG)
    L.bufC = off;
    off += align256(P.TK * P.H * 2);
#endif
    L.total = off;
    return L;
}

// Whether a tuned configuration names the chunked kernels (10 chunked, 11 chunked_nomc, 12 chunked_tail)
static bool chunked_config(int64_t config) {
    return config == kTileConfigChunked || config == kTileConfigChunkedNomc || config == kTileConfigChunkedTail;
}

// Whether the dims take the CUTLASS path (given 16-byte aligned tensors); a function of dims
// and of the hardware seen by ex_get_factor.
static bool sm90_path_for(const Problem& P) {
    if (!(s_sm90_enabled && P.T > 0 && P.H % 8 == 0 && P.I % 8 == 0)) return false;
    if (P.config >= 0)  // tuned choice (dims[7])
        return P.config == kTileConfigGrouped || P.config == kTileConfigGrouped64 ||
               P.config == kTileConfigNarrow || chunked_config(P.config);
    return P.TK / P.G >= s_sm90_min_rows;  // floor(T*K/G) >= n  <=>  T*K >= n*G (rows per expert)
}

// Of the CUTLASS path's 128 x 256 and 64 x 256 tilings (narrow is chosen before this), whether
// the dims take the 64-row one (Tile64): a tuned
// choice (dims[7] = 7 Tile64, 4 Tile128), else fewer than s_sm90_tile64_max_rows rows per expert.
static bool sm90_tile64_for(const Problem& P) {
    if (P.config >= 0) return P.config == kTileConfigGrouped64;
    return P.TK / P.G < s_sm90_tile64_max_rows;
}

// Whether both GEMMs run on chunks of up to 256 (or 128) of an expert's rows (moe_chunked_sm90.cuh): a tuned
// choice (dims[7] = 10, or 11: without the multicast) on shapes it takes: the gated GEMM1 (I % 128
// == 0, and not turned off by EX_MOE_SM90_SILU_IN_GEMM1=0), H % 128 == 0, E <= chunked::kMaxE and
// its shared memory (the 256-row chunks', the smaller need; launch_sm90 falls back to them where
// the 128-row chunks' does not fit); else such a call runs on the 128-row tiling as dims[7] = 4 (grouped) does.
static bool sm90_chunked_for(const Problem& P) {
    return chunked_config(P.config) && s_sm90_gated && P.I % 128 == 0 &&
           chunked::supports(P.H, P.I, P.E) && chunked::smem_bytes_for(chunked::kMaxSub, P.E) <= s_smem_optin;
}

// Under the 128-row tiling, whether GEMM2 runs on Tile128N128 (short reduction over I).
static bool sm90_gemm2_pingpong_for(const Problem& P) {
    return s_sm90_gemm2_pp && P.I <= kSm90Gemm2PingpongMaxI;
}

// Under the 128 x 256 tiling, whether the gated GEMM1 runs in clusters of 2 x 1 (Tile128M2): an
// odd number of N-tiles per expert (I / 128), which 1 x 2 pairs round up, and from
// s_sm90_cluster_m2_rows rows per expert on (floor(T*K/G), as sm90_path_for), where the M-tiles
// that 2 x 1 pairs round up instead are few against an expert's.
static bool sm90_gated_m2_for(const Problem& P) {
    return s_sm90_cluster_m2_rows > 0 && (P.I / 128) % 2 == 1 && P.TK / P.G >= s_sm90_cluster_m2_rows;
}

static int64_t sm90_workspace_size(const int64_t dims[], int n_dims) {
    const int64_t portable = moe_workspace_size(dims, n_dims);
    if (dims == nullptr || n_dims < 6) return portable;
    Problem P;
    char msg[256];
    if (!read_dims(dims, n_dims, &P, msg, sizeof msg)) return portable;  // the kernel rejects these
    if (!sm90_path_for(P)) return portable;
    const int64_t mine = sm90_layout(P).total;
    return mine > portable ? mine : portable;
}

// ------------------------------------------------------------------------------------------
// Host: one grouped GEMM launch
// ------------------------------------------------------------------------------------------

// Calls of ex_get_factor so far: part of every cached Params' key, since the Params hold settings
// read at load (the tile order, EmptyASlices' switch) and two registries share this library.
static std::atomic<int64_t> s_sm90_loads{0};

// Params of the last launch per (GEMM, element type, thread): to_underlying_arguments builds
// three TMA descriptors on the host (driver entry point + cuTensorMapEncodeTiled) whose contents
// depend only on the workspace address, the dims and the settings read at load (the key's load
// count), so an identical call reuses them.
template <class G, int WHICH>
struct ParamsCache {
    bool valid = false;
    int64_t key[9] = {};
    typename G::Kernel::Params params;
};

template <class G, int WHICH, class GA>
static int run_grouped_gemm(const sm90::GroupArrays<GA>& ga_in, int E, void* cutlass_ws,
                            const int64_t key[9], cudaStream_t stream, void* gated_d = nullptr,
                            void* gated_sd = nullptr) {
    using GK = typename G::Kernel;
    static_assert(std::is_same<typename G::Shape3, typename GA::Shape3>::value &&
                  std::is_same<typename G::EA, typename GA::EA>::value &&
                  std::is_same<typename G::StrideA, typename GA::StrideA>::value &&
                  std::is_same<typename G::StrideB, typename GA::StrideB>::value &&
                  std::is_same<typename G::StrideD, typename GA::StrideD>::value, "same arrays");
    const sm90::GroupArrays<G>& ga = reinterpret_cast<const sm90::GroupArrays<G>&>(ga_in);
    static thread_local ParamsCache<G, WHICH> cache;
    if (!cache.valid || std::memcmp(cache.key, key, sizeof cache.key) != 0) {
        typename GK::Arguments args{};
        args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
        args.problem_shape = typename G::ProblemShape{E, ga.shapes, nullptr};  // no host shapes
        args.mainloop.ptr_A = ga.a;
        args.mainloop.dA = ga.sa;
        args.mainloop.ptr_B = ga.b;
        args.mainloop.dB = ga.sb;
        if constexpr (sm90::IsGated<G>::value) {
            args.epilogue.ptr_D = reinterpret_cast<typename G::ED**>(gated_d);
            args.epilogue.dD = reinterpret_cast<typename G::StrideD*>(gated_sd);
        } else {
            args.epilogue.thread.alpha = 1.0f;
            args.epilogue.thread.beta = 0.0f;
            args.epilogue.ptr_C = nullptr;
            args.epilogue.dC = nullptr;
            args.epilogue.ptr_D = ga.d;
            args.epilogue.dD = ga.sd;
        }
        using Raster = decltype(args.scheduler.raster_order);
        args.scheduler.raster_order = s_sm90_raster_n ? Raster::AlongN : Raster::AlongM;
        args.scheduler.max_swizzle_size = s_sm90_swizzle;
        args.hw_info.device_id = 0;  // unused: sm_count is given
        args.hw_info.sm_count = s_num_sms < kSm90MaxSms ? s_num_sms : kSm90MaxSms;
        args.hw_info.max_active_clusters = 0;
        if (!GK::can_implement(args))
            return set_error(EX_ERR_INTERNAL, "moe_fused_gemm_sm90: CUTLASS can_implement failed");
        if ((size_t)GK::get_workspace_size(args) > (size_t)cutlass_ws_bytes())
            return set_error(EX_ERR_INTERNAL, "moe_fused_gemm_sm90: CUTLASS workspace larger than reserved");
        if (GK::initialize_workspace(args, cutlass_ws, stream) != cutlass::Status::kSuccess)
            return set_error(EX_ERR_INTERNAL, "moe_fused_gemm_sm90: CUTLASS initialize_workspace failed");
        cache.params = GK::to_underlying_arguments(args, cutlass_ws);
        std::memcpy(cache.key, key, sizeof cache.key);
        cache.valid = true;
    }
    const int smem = GK::SharedStorageSize;
    static const cudaError_t attr_err = [] {
        cudaError_t e = cudaFuncSetAttribute(cutlass::device_kernel<GK>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, GK::SharedStorageSize);
        return e;
    }();
    if (attr_err != cudaSuccess) return cuda_error(attr_err);

    const dim3 grid = GK::get_grid_shape(cache.params);
    const dim3 block = GK::get_block_shape();
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = G::kClusterX;
    attr[0].val.clusterDim.y = G::kClusterY;
    attr[0].val.clusterDim.z = 1;
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = (size_t)smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    const cudaError_t err = cudaLaunchKernelEx(&cfg, cutlass::device_kernel<GK>, cache.params);
    if (err != cudaSuccess) {
        cache.valid = false;
        return cuda_error(err);
    }
    return EX_OK;
}

// ------------------------------------------------------------------------------------------
// Host: the CUTLASS path
// ------------------------------------------------------------------------------------------

template <typename T, class Tile>
static int launch_sm90(const Problem& P, void* out, const void* x, const void* w13, const void* w2,
                       const float* tw, const int* ids, char* ws, cudaStream_t stream) {
    // the group arrays' types (shapes, pointers, strides) are the same for every tiling
    using CT = typename sm90::CutlassType<T>::type;
    using G = sm90::GroupedGemm<CT>;
    using GT = sm90::GroupedGemm<CT, Tile>;
    const Sm90Layout L = sm90_layout(P);
    int* status = reinterpret_cast<int*>(ws);
    int* meta = reinterpret_cast<int*>(ws + L.meta);
    int4* tiles = reinterpret_cast<int4*>(ws + L.tiles);
    int* sorted = reinterpret_cast<int*>(ws + L.sorted);
    int* expert_off = reinterpret_cast<int*>(ws + L.expert_off);
    int* slot_pos = reinterpret_cast<int*>(ws + L.slot_pos);
    sm90::GroupArrays<G> ga[2];
    for (int g = 0; g < 2; ++g) {
        ga[g].shapes = reinterpret_cast<typename G::Shape3*>(ws + L.grp[g][0]);
        ga[g].a = reinterpret_cast<const typename G::EA**>(ws + L.grp[g][1]);
        ga[g].b = reinterpret_cast<const typename G::EB**>(ws + L.grp[g][2]);
        ga[g].d = reinterpret_cast<typename G::ED**>(ws + L.grp[g][3]);
        ga[g].sa = reinterpret_cast<typename G::StrideA*>(ws + L.grp[g][4]);
        ga[g].sb = reinterpret_cast<typename G::StrideB*>(ws + L.grp[g][5]);
        ga[g].sd = reinterpret_cast<typename G::StrideD*>(ws + L.grp[g][6]);
    }
    void* cutlass_ws = ws + L.cutlass;
    // xs is GEMM1's A; GEMM1 writes gu (then silu_mul act) or, gated, act; GEMM2 reads act and
    // writes ys. A buffer is never read and written by the same launch: xs, act, ys in bufA, bufB,
    // bufA when gated (GEMM1 still reads xs while its epilogue writes act), else xs/act in bufA,
    // gu/ys in bufB.
    const bool gated = s_sm90_gated && P.I % 128 == 0;
    const bool use_chunked = sm90_chunked_for(P);
    T* bufA = reinterpret_cast<T*>(ws + L.bufA);
    T* bufB = reinterpret_cast<T*>(ws + L.bufB);
    T* xs = bufA;
    T* gu = bufB;
    T* act = gated ? bufB : bufA;
    T* ys = gated ? bufA : bufB;
#if defined(EX_MOE_DIAG)
    // the gather's knock-out: ys in a buffer of its own, so that xs keeps the rows of the call that
    // gathered (in bufA GEMM2 overwrote them with ys, and the next calls multiplied ever smaller
    // values: near zero, the card held 1850 MHz against ~1500 on real rows at its power limit and
    // the call read 15-25% faster at T = 4096, H200, 2026-12-04); gated only (ungated, act
    // overwrites xs in bufA)
    if ((s_diag_skip & 1) && gated) ys = reinterpret_cast<T*>(ws + L.bufC);
#endif

    const int H = (int)P.H, E = (int)P.E, I = (int)P.I, K = (int)P.K;

    // 1. routing (one block, or two launches of many blocks for large T*K), also writing expert_off
    const int rs = launch_route(P, 128, status, meta, tiles, sorted, expert_off, ids, stream,
                                false, slot_pos);
    if (rs != EX_OK) return rs;  // EX_FALLBACK: absurd E

    // 2. group arguments + gather (a warp per span of a token's row, or per sorted row; grid
    //    capped, grid-stride). By token: vpl vectors per lane, halved from 8 while the spans make
    //    fewer than 16 warps per SM (T = 512 at H = 2048: 1 vector, 4096 warps of 512 bytes)
    int vpl = 8;
    const int64_t HV = P.H / 8;
    auto spans = [&](int v) { return (HV + 32 * v - 1) / (32 * v); };
    while (vpl > 1 && P.T * spans(vpl) < 16LL * s_num_sms) vpl /= 2;
    // (a diagnostic build's knock-out, s_diag_skip & 1: one block, T_ = 0, no rows copied; still
    // launched, as the chunked GEMM1 reads expert_off before its PDL wait, safe only after this
    // grid's own wait for the routing. The first call on a workspace and dims gathers, so that
    // the later calls' GEMM1 multiplies real rows, kept in xs by ys's own buffer above)
    bool skip_gather = false;
#if defined(EX_MOE_DIAG)
    {
        static std::mutex m;
        static int64_t last[6] = {};
        const int64_t now[6] = {(int64_t)(uintptr_t)ws, P.T, P.H, P.E, P.I, P.K};
        std::lock_guard<std::mutex> lock(m);
        skip_gather = (s_diag_skip & 1) != 0 && gated && std::equal(now, now + 6, last);
        std::copy(now, now + 6, last);
    }
#endif
    // the experts' order in the CUTLASS tilings' groups: spread unless EX_MOE_SM90_EXPERT_ORDER=id
    const int spread = s_sm90_spread ? route_spread(E) : 0;
    const int64_t gather_warps = skip_gather ? 1 : s_sm90_gather_by_token ? P.T * spans(vpl) : P.TK;
    cudaError_t err = explugin::launch_kernel(
        sm90_prepare_kernel<T, G>, dim3(capped_blocks(gather_warps * 32, kPrepThreads, 8)), dim3(kPrepThreads), 0,
        stream, s_sm90_pdl, static_cast<const T*>(x), xs, (const int*)sorted, (const int*)meta,
        (const int*)expert_off, (const int*)slot_pos, ids, P.em(), static_cast<const T*>(w13),
        static_cast<const T*>(w2), gu, act, ys, skip_gather ? 0 : (int)P.T, H, I, E, K,
        skip_gather || s_sm90_gather_by_token, vpl, spread, ga[0], ga[1]);
    if (err == cudaSuccess) err = cudaGetLastError();
    if (err != cudaSuccess) return cuda_error(err);

    // 3. GEMM1: act = silu(g) * u straight from the epilogue (I % 128 == 0), else gu = xs . w13[e]^T
    //    and 4. act = silu(g) * u (valid rows only; the bound on the grid is from dims)
    const int64_t key[9] = {(int64_t)(uintptr_t)ws, P.T, P.H, P.E, P.I, P.K, P.dtype, s_num_sms,
                            s_sm90_loads.load(std::memory_order_acquire)};
    int st;
    // (the gather's group arrays for the CUTLASS GEMMs are written also where the chunked kernels
    // run instead: the same launch, a few KB)
    if (use_chunked) {  // both GEMMs (each multicasts A where its N-tiles pair up, unless chunked_nomc)
        const bool mc = s_sm90_chunked_mc && (P.config == kTileConfigChunked || P.config == kTileConfigChunkedTail);
        // hot: more rows than kHotMeanRatio times the mean, T*K / E (under an expert map, an upper
        // bound on the local rows' mean: fewer experts count as hot)
        const int hot_rows = s_sm90_chunked_interleave
                                 ? (int)std::min<int64_t>(INT32_MAX, std::max<int64_t>(1, chunked::kHotMeanRatio * P.TK / E))
                                 : 0;
        const chunked::Args a1{expert_off, act, I, I, H, E, hot_rows};
        chunked::Args a2{expert_off, ys, H, H, I, E, hot_rows};
#if defined(EX_MOE_DIAG)
        a2.diag_skip = s_diag_skip;  // 4: GEMM2's A copies skip the wait for GEMM1 (a bound)
#endif
        // chunks of 128 rows (7 stages, one CTA per item) where the rows per expert fit them and
        // their shared memory fits (E <= 739), else 256 (EX_MOE_SM90_CHUNK_ROWS forces one)
        const int64_t rows_per_expert = P.TK / P.G;
        // chunked_tail: 256-row chunks whose last takes up to 32 rows more (where its shared
        // memory fits, E <= 751; else plain 256-row chunks)
        const bool tail = P.config == kTileConfigChunkedTail;
        int subs = tail ? chunked::kMaxSub
                        : s_sm90_chunk_subs > 0 ? s_sm90_chunk_subs : chunked::chunk_subs(rows_per_expert);
        if (chunked::smem_bytes_for(subs, E) > s_smem_optin) subs = chunked::kMaxSub;
        const bool extra = tail && chunked::smem_bytes<chunked::kMaxSub, chunked::kXRows>(E) <= s_smem_optin;
        // swap AB on one band of chunk sizes, the one nearest the rows per expert (T*K/G)
        const int band = s_sm90_chunked_swap && !extra ? chunked::swap_band(rows_per_expert, subs) : 0;
        err = chunked::launch<T, true>(xs, (int)P.TK, static_cast<const T*>(w13), 2 * I, a1, mc,
                                       band, subs, s_num_sms, s_smem_optin, s_sm90_pdl, stream, extra);
        if (err == cudaSuccess)
            err = chunked::launch<T, false>(act, (int)P.TK, static_cast<const T*>(w2), H, a2, mc,
                                            band, subs, s_num_sms, s_smem_optin, s_sm90_pdl, stream, extra);
        if (err != cudaSuccess) return cuda_error(err);
    } else if (gated) {
        auto gemm1 = [&](auto tiling) {  // the gated GEMM1 on a tiling (its act and strides from ga[1])
            return run_grouped_gemm<sm90::GatedGemm1<CT, T, decltype(tiling)>, 1>(
                ga[0], E, cutlass_ws, key, stream, (void*)ga[1].a, (void*)ga[1].sa);
        };
        st = std::is_same<Tile, sm90::Tile128>::value && sm90_gated_m2_for(P) ? gemm1(sm90::Tile128M2{}) : gemm1(Tile{});
        if (st != EX_OK) return st;
    } else {
        st = run_grouped_gemm<GT, 1>(ga[0], E, cutlass_ws, key, stream);
        if (st != EX_OK) return st;
        sm90_silu_mul_kernel<T><<<capped_blocks(P.TK * (P.I / 8), kSimpleThreads, 16), kSimpleThreads, 0,
                                  stream>>>(act, gu, meta, I);
    }

    // 5. GEMM2: ys = act . w2[e]^T per expert (the chunked kernels ran both above)
    if (!use_chunked) {
        if (std::is_same<Tile, sm90::Tile128>::value && sm90_gemm2_pingpong_for(P))
            st = run_grouped_gemm<sm90::GroupedGemm<CT, sm90::Tile128N128>, 2>(ga[1], E, cutlass_ws, key, stream);
        else
            st = run_grouped_gemm<GT, 2>(ga[1], E, cutlass_ws, key, stream);
        if (st != EX_OK) return st;
    }

    // 6. weighted combine in fp32 (not in a diagnostic build's knock-out, s_diag_skip & 2)
    if (s_diag_skip & 2) return EX_OK;
    err = explugin::launch_kernel(sm90_combine_kernel<T>, dim3(capped_blocks(P.T * (P.H / 8), kSimpleThreads, 16)),
                                  dim3(kSimpleThreads), 0, stream, s_sm90_pdl, static_cast<T*>(out), (const T*)ys,
                                  (const int*)slot_pos, tw, ids, P.em(), (int)P.T, H, E, K);
    if (err == cudaSuccess) err = cudaGetLastError();
    if (err != cudaSuccess) return cuda_error(err);
    return EX_OK;
}

// The CUTLASS path in the tiling the dims take (sm90_tile64_for).
template <typename T>
static int launch_sm90_tiled(const Problem& P, void* out, const void* x, const void* w13, const void* w2,
                             const float* tw, const int* ids, char* ws, cudaStream_t stream) {
    if (P.config == kTileConfigNarrow)  // tuned data only: both GEMMs on 128 x 128 ping-pong tiles
        return launch_sm90<T, sm90::Tile128N128>(P, out, x, w13, w2, tw, ids, ws, stream);
    return sm90_tile64_for(P) ? launch_sm90<T, sm90::Tile64>(P, out, x, w13, w2, tw, ids, ws, stream)
                              : launch_sm90<T, sm90::Tile128>(P, out, x, w13, w2, tw, ids, ws, stream);
}

static int sm90_kernel(void* output, const void* input, const void* aux_inputs[], int n_aux,
                       const int64_t dims[], int n_dims, void* stream) {
    Problem P;
    bool done;
    const int st = check_args(output, input, aux_inputs, n_aux, dims, n_dims, &P, &done);
    if (st != EX_OK || done) return st;
    const bool aligned = aligned16(output) && aligned16(input) && aligned16(aux_inputs[1]) &&
                         aligned16(aux_inputs[2]) && aligned16(aux_inputs[5]) &&
                         !(reinterpret_cast<uintptr_t>(aux_inputs[3]) & 3) &&
                         !(reinterpret_cast<uintptr_t>(aux_inputs[4]) & 3);
    if (!aligned || !sm90_path_for(P))  // decode, small or unaligned shapes: the portable path
        return moe_kernel(output, input, aux_inputs, n_aux, dims, n_dims, stream);
    const float* tw = static_cast<const float*>(aux_inputs[3]);
    const int* ids = static_cast<const int*>(aux_inputs[4]);
    char* ws = static_cast<char*>(const_cast<void*>(aux_inputs[5]));
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int rc = P.dtype == EX_DTYPE_BFLOAT16
                       ? launch_sm90_tiled<__nv_bfloat16>(P, output, input, aux_inputs[1], aux_inputs[2], tw, ids, ws, s)
                       : launch_sm90_tiled<__half>(P, output, input, aux_inputs[1], aux_inputs[2], tw, ids, ws, s);
    if (rc == EX_FALLBACK)  // declined before launching anything (absurd E): portable path
        return moe_kernel(output, input, aux_inputs, n_aux, dims, n_dims, stream);
    return rc;
}

// ------------------------------------------------------------------------------------------
// Entry point
// ------------------------------------------------------------------------------------------

static ex_factor_t s_factor;

}  // namespace exmoe

extern "C" EX_EXPORT ex_factor_t* ex_get_factor(const ex_hardware_t* hw) {
    using namespace exmoe;
    // sm_90a machine code only: exactly compute capability 9.0 (not 9.x > 0, not 10.x)
    if (hw == nullptr || hw->cc_major != 9 || hw->cc_minor != 0) return nullptr;
    ex_tuning_t tuning;
    if (!moe_portable_init(hw, &tuning)) return nullptr;
    constexpr int kSmem = AllKernels::kSmem;
    constexpr int kThreads = AllKernels::kThreads;
    s_sm90_enabled = kSmem <= hw->shared_mem_per_block_optin && kThreads <= hw->max_threads_per_block &&
                     hw->warp_size == 32;
    s_sm90_min_rows = explugin::env_count("EX_MOE_SM90_MIN_ROWS_PER_EXPERT", kSm90MinRowsPerExpert);
    s_sm90_tile64_max_rows = explugin::env_count("EX_MOE_SM90_TILE64_MAX_ROWS", kSm90Tile64MaxRows);
    s_sm90_gated = explugin::env_switch("EX_MOE_SM90_SILU_IN_GEMM1");
    s_sm90_gemm2_pp = explugin::env_switch("EX_MOE_SM90_GEMM2_PINGPONG");
    s_sm90_cluster_m2_rows = explugin::env_count("EX_MOE_SM90_CLUSTER_M2_ROWS", kSm90ClusterM2Rows);
    static const char* const kOffOn[] = {"0", "1"};  // a switch that is off unless set to 1
    s_sm90_raster_n = explugin::env_choice("EX_MOE_SM90_RASTER_N", kOffOn, 2, 0) == 1;
    s_sm90_gather_by_token = explugin::env_switch("EX_MOE_SM90_GATHER_BY_TOKEN");
    static const char* const kOrders[] = {"id", "spread"};
    s_sm90_spread = explugin::env_choice("EX_MOE_SM90_EXPERT_ORDER", kOrders, 2, 1) == 1;
    sm90::g_skip_empty_a = explugin::env_switch("EX_MOE_SM90_SKIP_EMPTY_A");
    s_sm90_chunked_mc = explugin::env_switch("EX_MOE_SM90_CHUNKED_MULTICAST");
    s_sm90_chunked_swap = explugin::env_switch("EX_MOE_SM90_CHUNKED_SWAP_AB");
    s_sm90_chunked_interleave = explugin::env_switch("EX_MOE_SM90_CHUNKED_INTERLEAVE");
    s_sm90_pdl = hw->cc_major >= 9 && explugin::env_switch("EX_MOE_SM90_PDL");
    static const char* const kChunkRowsNames[] = {"auto", "256", "128"};
    static const int kChunkSubs[] = {0, 4, 2};
    s_sm90_chunk_subs = kChunkSubs[explugin::env_choice("EX_MOE_SM90_CHUNK_ROWS", kChunkRowsNames, 3, 0)];
    static const char* const kSwizzles[] = {"1", "2", "4", "8"};
    s_sm90_swizzle = 1 << explugin::env_choice("EX_MOE_SM90_SWIZZLE", kSwizzles, 4, 0);
    // last, after every setting the cached Params (run_grouped_gemm) hold: a call that reads the
    // new count (acquire) builds its Params from the new settings
    s_sm90_loads.fetch_add(1, std::memory_order_release);
    if (s_sm90_enabled) {
        // Tuning reported: the grouped GEMM (one producer + two consumer warpgroups, its smem
        // and pipeline depth); the other launches are the portable kernels' (its tuning) and
        // 256-thread elementwise kernels.
        tuning.threads_per_block = kThreads;
        tuning.num_warps = kThreads / hw->warp_size;
        tuning.vec_size = 8;
        tuning.items_per_thread = 1;
        if (kSmem > tuning.shared_mem_bytes) tuning.shared_mem_bytes = kSmem;
        tuning.num_stages = GemmBf16::kStages;
    }
    s_factor.abi_version = EX_ABI_VERSION;
    s_factor.factor_id = EX_FACTOR_MOE_FUSED_GEMM;
    s_factor.name = "moe_fused_gemm";
    s_factor.version = MOE_FUSED_GEMM_VERSION;
    s_factor.tuning = tuning;
    s_factor.kernel = sm90_kernel;
    s_factor.kernel_fallback = moe_kernel_fallback;
    s_factor.workspace_size = sm90_workspace_size;
    s_factor.last_error = explugin::last_error;
    s_factor.priority = 10;
    s_factor.reserved_i32 = 0;
    s_factor.description =
        "routed MoE experts, Hopper: CUTLASS wgmma/TMA grouped GEMMs for prefill (T*K/G >= 64), "
        "portable mma.sync path below";
    return &s_factor;
}

/*
 * moe_gemm2_ra_sm90.cuh -- GEMM2 of the Hopper path with its rows of act resident in shared
 * memory ("RA"): ys[r, :] = act[r, :] . w2[e]^T for the sorted rows r of expert e, on wgmma with
 * TMA, for few rows per expert and a short reduction (I <= 1024).
 *
 * Why: at T = 512 and 32-64 rows per expert the grouped GEMM2 re-reads its tile's rows of act
 * from L2 for every N-tile; session eleven's stream microbenchmark (benchmarks/RESULTS.md, "What
 * the weight stream reaches") measured that A bytes read beside the weights at a quarter of their
 * size cut the weight rate from 4.20 to 3.51 TB/s. Here a CTA loads its 64-row tile of act once
 * (TMA, 64 x I, 128-byte swizzle) and then streams w2 for as many 256-column N-tiles as its share
 * of the work holds, through a ring of 256 x 64 TMA stages; so the L2 carries the weights and
 * little else.
 *
 * Work: an item is (M-tile of 64 rows of one expert, N-tile of 256 of H's columns); items are
 * ordered M-tile-major and each of the grid's CTAs takes one contiguous range of them (the counts
 * differ by at most one), so a CTA reloads its rows of act only where its range crosses into the
 * next M-tile. The M-tiles come from expert_off (device-written by the routing); the grid is at
 * most one CTA per SM, fixed on the host, the item count read on the device.
 *
 * Roles (384 threads, one CTA per SM): warp 0 issues the TMA copies (one elected lane); warps 4-11
 * (two consumer warpgroups) each multiply the 64 rows by 128 of the N-tile's 256 columns
 * (SM90 64 x 128 x 16 GMMA, fp32 accumulators) and store their rows < the tile's valid count as
 * the element type (bf16x2 / half2 stores). Barriers: full/empty per ring stage, full/empty for
 * the resident A (empty: the eight consumer warps, once per M-tile, after their last MMA on it).
 *
 * Math: the same per-expert product as the grouped GEMM2 (fp32 accumulation over I in k-steps of
 * 16, rounded once to the element type); the sum order within a k-step is the tensor core's, so
 * results match the CUTLASS GEMM2 to rounding, not bit for bit.
 */
#pragma once

#include "cute/tensor.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/atom/copy_traits_sm90_tma.hpp"
#include "cute/atom/mma_traits_sm90_gmma.hpp"
#include "cutlass/arch/barrier.h"

namespace ra2 {
using namespace cute;

constexpr int kBM = 64;           // rows of act per M-tile (one GMMA M)
constexpr int kBN = 256;          // columns of H per N-tile (two consumer warpgroups x 128)
constexpr int kBK = 64;           // reduction columns per TMA box / ring stage (128 bytes)
constexpr int kMaxKBlocks = 16;   // I <= 1024
constexpr int kMaxStages = 8;
constexpr int kThreads = 384;
constexpr int kStageBytes = kBN * kBK * 2;

template <typename T> struct Elem;  // the CUTLASS element type of a CUDA one
template <> struct Elem<__nv_bfloat16> { using type = cutlass::bfloat16_t; };
template <> struct Elem<__half> { using type = cutlass::half_t; };

template <typename T>
struct Types {
    using E = typename Elem<T>::type;
    using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E>{},
                                               Shape<Int<kBM>, Int<kBK>, Int<kMaxKBlocks>>{}));
    using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E>{},
                                               Shape<Int<kBN>, Int<kBK>, Int<kMaxStages>>{}));
    using MmaOp = decltype(GMMA::ss_op_selector<E, E, float, Shape<Int<kBM>, Int<kBN / 2>, Int<kBK>>,
                                                 GMMA::Major::K, GMMA::Major::K>());
    using TiledMma = decltype(make_tiled_mma(MmaOp{}, Layout<Shape<_1, _2, _1>>{}));
};

// Dynamic shared memory: [A: KB blocks of 64 x 64][B: stages of 256 x 64][barriers][tile prefix]
struct SmemPlan {
    int a_bytes, b_bytes, bar_off, pre_off, total;
};
__host__ __device__ inline SmemPlan smem_plan(int I, int stages, int E) {
    SmemPlan s;
    s.a_bytes = kBM * I * 2;
    s.b_bytes = stages * kStageBytes;
    s.bar_off = s.a_bytes + s.b_bytes;                  // 1024-aligned (A, B multiples of 8 KB)
    s.pre_off = s.bar_off + (2 * kMaxStages + 2) * 8;
    s.total = s.pre_off + (E + 1) * 4;
    return s;
}
// Ring stages that fit next to the resident A; 0 where fewer than 3 would
inline int stages_for(int I, int E, int smem_optin) {
    for (int st = kMaxStages; st >= 3; --st)
        if (smem_plan(I, st, E).total <= smem_optin) return st;
    return 0;
}

struct Args {
    const int* expert_off;  // E + 1 entries (routing output): rows of expert e are [off[e], off[e+1])
    void* ys;               // (rows, H) element type
    const void* w2;         // (E, H, I) element type: prefetched to L2 before the dependency wait
    int H, I, E, stages;
};

template <typename T, class TmaA, class TmaB>
__global__ void __launch_bounds__(kThreads, 1)
gemm2_ra_kernel(const __grid_constant__ TmaA tma_a, const __grid_constant__ TmaB tma_b, const Args p,
                int rows_cap) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(CUTE_ARCH_MMA_SM90A_ENABLED)
    using Ty = Types<T>;
    extern __shared__ __align__(1024) unsigned char smem[];
    const SmemPlan plan = smem_plan(p.I, p.stages, p.E);
    using E = typename Ty::E;
    E* sa_ptr = reinterpret_cast<E*>(smem);
    E* sb_ptr = reinterpret_cast<E*>(smem + plan.a_bytes);
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + plan.bar_off);
    uint64_t* empty = full + kMaxStages;
    uint64_t* a_full = empty + kMaxStages;
    uint64_t* a_empty = a_full + 1;
    int* s_pre = reinterpret_cast<int*>(smem + plan.pre_off);  // first M-tile of expert e; [E] = total

    Tensor sA = make_tensor(make_smem_ptr(sa_ptr), typename Ty::SmemLayoutA{});  // (64, 64, KB)
    Tensor sB = make_tensor(make_smem_ptr(sb_ptr), typename Ty::SmemLayoutB{});  // (256, 64, STAGES)

    const int tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;
    const int KB = p.I / kBK;
    const int NT = p.H / kBN;

    if (tid == 0) {
        for (int s = 0; s < p.stages; ++s) {
            cutlass::arch::ClusterTransactionBarrier::init(&full[s], 1);
            cutlass::arch::ClusterBarrier::init(&empty[s], 8);
        }
        cutlass::arch::ClusterTransactionBarrier::init(a_full, 1);
        cutlass::arch::ClusterBarrier::init(a_empty, 8);
        cutlass::arch::fence_barrier_init();
    }
    // Launched with programmatic dependent launch, this grid may start while GEMM1 (its
    // predecessor, which triggers at its start) still runs: expert_off (the routing's, complete
    // before GEMM1 started) and w2 (a constant) may be read now; act only after griddepcontrol.wait
    // (the producer's, before its first A load; the consumers write ys, GEMM1's xs buffer, only
    // after MMAs on that A).
    // M-tiles per expert, exclusive prefix (warp 1; E <= a few thousand)
    if (warp == 1) {
        int carry = 0;
        for (int base = 0; base < p.E; base += 32) {
            const int e = base + lane;
            int m = 0;
            if (e < p.E) m = __ldg(p.expert_off + e + 1) - __ldg(p.expert_off + e);
            const int nt = (m + kBM - 1) / kBM;
            int inc = nt;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int v = __shfl_up_sync(0xffffffffu, inc, o);
                if (lane >= o) inc += v;
            }
            if (e < p.E) s_pre[e] = carry + inc - nt;
            carry += __shfl_sync(0xffffffffu, inc, 31);
        }
        if (lane == 0) s_pre[p.E] = carry;
    }
    __syncthreads();

    const long long n_items = (long long)s_pre[p.E] * NT;
    const long long it0 = n_items * blockIdx.x / gridDim.x;
    const long long it1 = n_items * (blockIdx.x + 1) / gridDim.x;
    if (it0 >= it1) return;

    // M-tile j -> (expert, first row, valid rows): binary search over s_pre
    auto tile_of = [&](int j, int& e, int& m0, int& mv) {
        int lo = 0, hi = p.E - 1;  // last e with s_pre[e] <= j (and a tile: s_pre[e+1] > j)
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (s_pre[mid] <= j) lo = mid; else hi = mid - 1;
        }
        // (an expert without tiles shares s_pre with the next one, so the last e wins: j < total
        // makes s_pre[e + 1] > j there)
        e = lo;
        const int off = __ldg(p.expert_off + e);
        const int m = __ldg(p.expert_off + e + 1) - off;
        const int r = (j - s_pre[e]) * kBM;
        m0 = off + r;
        mv = m - r < kBM ? m - r : kBM;
    };

    if (warp == 0) {
        // ------------------------------ producer ------------------------------
        if (cute::elect_one_sync()) {
            Tensor mA = tma_a.get_tma_tensor(make_shape(rows_cap, p.I));          // (rows, I)
            Tensor mB = tma_b.get_tma_tensor(make_shape(p.H, p.I, p.E));          // (H, I, E)
            Tensor gB = local_tile(mB, Shape<Int<kBN>, Int<kBK>>{}, make_coord(_, _, _));  // (256,64,n,k,e)
            auto [tBgB, tBsB] = tma_partition(tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB),
                                              group_modes<0, 2>(gB));  // (TMA,n,k,e), (TMA,stage)
            int stage = 0, phase = 1;  // empty barriers: a fresh one passes parity 1
            int cur = -1, a_phase = 0;
            int e = 0, m0 = 0, mv = 0;
            // before the wait: the first item's weights (ring stages, then L2 for the rest)
            const int j0 = (int)(it0 / NT), nt0 = (int)(it0 % NT);
            tile_of(j0, e, m0, mv);
            const int pre = KB < p.stages ? KB : p.stages;
            for (int kb = 0; kb < pre; ++kb) {
                cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&full[kb], kStageBytes);
                copy(tma_b.with(full[kb]), tBgB(_, nt0, kb, e), tBsB(_, kb));
            }
            stage = pre % p.stages;
            if (stage == 0) phase ^= 1;
            {
                const char* w = static_cast<const char*>(p.w2) +
                                ((long long)e * p.H + (long long)nt0 * kBN) * p.I * 2;
                const long long bytes = (long long)kBN * p.I * 2;
                for (long long o = 0; o < bytes; o += 65536) {
                    const long long n = bytes - o < 65536 ? bytes - o : 65536;
                    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(w + o), "r"((int)n)
                                 : "memory");
                }
            }
            asm volatile("griddepcontrol.wait;\n" ::: "memory");
            for (long long it = it0; it < it1; ++it) {
                const int j = (int)(it / NT), nt = (int)(it % NT);
                if (j != cur) {
                    if (cur >= 0) {
                        cutlass::arch::ClusterBarrier::wait(a_empty, a_phase);
                        a_phase ^= 1;
                    }
                    tile_of(j, e, m0, mv);
                    cur = j;
                    Tensor gA = local_tile(domain_offset(make_coord(m0, 0), mA),
                                           Shape<Int<kBM>, Int<kBK>>{}, make_coord(0, _));  // (64,64,KB)
                    auto [tAgA, tAsA] = tma_partition(tma_a, Int<0>{}, Layout<_1>{},
                                                      group_modes<0, 2>(sA), group_modes<0, 2>(gA));
                    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(a_full, kBM * p.I * 2);
                    for (int kb = 0; kb < KB; ++kb) copy(tma_a.with(*a_full), tAgA(_, kb), tAsA(_, kb));
                }
                for (int kb = (it == it0 ? pre : 0); kb < KB; ++kb) {
                    cutlass::arch::ClusterBarrier::wait(&empty[stage], phase);
                    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&full[stage], kStageBytes);
                    copy(tma_b.with(full[stage]), tBgB(_, nt, kb, e), tBsB(_, stage));
                    if (++stage == p.stages) { stage = 0; phase ^= 1; }
                }
            }
        }
        return;
    }
    if (warp < 4) return;  // warps 1-3 of the producer warpgroup: nothing more to do

    // ------------------------------ consumers ------------------------------
    const int ct = tid - 128;  // 0..255
    typename Ty::TiledMma mma;
    auto thr = mma.get_thread_slice(ct);
    Tensor tCsA = thr.partition_A(sA);  // (MMA, MMA_M, MMA_K, KB)
    Tensor tCsB = thr.partition_B(sB);  // (MMA, MMA_N, MMA_K, STAGES)
    Tensor tCrA = thr.make_fragment_A(tCsA);
    Tensor tCrB = thr.make_fragment_B(tCsB);
    Tensor acc = partition_fragment_C(mma, Shape<Int<kBM>, Int<kBN>>{});  // (MMA, MMA_M, MMA_N)
    Tensor cC = make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{});
    Tensor tCcC = thr.partition_C(cC);

    int stage = 0, phase = 0;
    int cur = -1, a_phase = 0;
    int e = 0, m0 = 0, mv = 0;
    T* ys = static_cast<T*>(p.ys);
    for (long long it = it0; it < it1; ++it) {
        const int j = (int)(it / NT), nt = (int)(it % NT);
        if (j != cur) {
            tile_of(j, e, m0, mv);
            cur = j;
            cutlass::arch::ClusterBarrier::wait(a_full, a_phase);
            a_phase ^= 1;
        }
        mma.accumulate_ = GMMA::ScaleOut::Zero;
        for (int kb = 0; kb < KB; ++kb) {
            cutlass::arch::ClusterBarrier::wait(&full[stage], phase);
            warpgroup_fence_operand(acc);
            warpgroup_arrive();
            CUTLASS_PRAGMA_UNROLL
            for (int k = 0; k < size<2>(tCrA); ++k) {
                cute::gemm(mma, tCrA(_, _, k, kb), tCrB(_, _, k, stage), acc);
                mma.accumulate_ = GMMA::ScaleOut::One;
            }
            warpgroup_commit_batch();
            warpgroup_wait<0>();
            warpgroup_fence_operand(acc);
            __syncwarp();
            if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&empty[stage]);
            if (++stage == p.stages) { stage = 0; phase ^= 1; }
        }
        // the last item of this M-tile in the CTA's range: the producer may reload A
        const bool last_of_tile = (it + 1 >= it1) || ((int)((it + 1) / NT) != j);
        if (last_of_tile && it + 1 < it1) {
            __syncwarp();
            if (lane == 0) cutlass::arch::ClusterBarrier::arrive(a_empty);
        }
        // epilogue: rows < mv of ys[m0.., nt*256..], pairs of adjacent columns per thread
        T* out = ys + (long long)m0 * p.H + (long long)nt * kBN;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(acc); i += 2) {
            const int r = get<0>(tCcC(i)), c = get<1>(tCcC(i));
            if (r < mv) {
                std::conditional_t<std::is_same<T, __half>::value, __half2, __nv_bfloat162> v;
                if constexpr (std::is_same<T, __half>::value) v = __floats2half2_rn(acc(i), acc(i + 1));
                else v = __floats2bfloat162_rn(acc(i), acc(i + 1));
                *reinterpret_cast<decltype(v)*>(out + (long long)r * p.H + c) = v;
            }
        }
    }
#endif
}

// Host: TMA descriptors for (act, w2) and the launch; the descriptors depend only on the two
// pointers and the dims, so an identical call reuses them (cuTensorMapEncodeTiled is host work).
template <typename T>
struct Launcher {
    using Ty = Types<T>;
    using E = typename Ty::E;
    static auto make_a(const E* act, int rows_cap, int I) {
        Tensor m = make_tensor(make_gmem_ptr(act), make_layout(make_shape(rows_cap, I), make_stride(I, _1{})));
        return make_tma_atom(SM90_TMA_LOAD{}, m, typename Ty::SmemLayoutA{}(_, _, 0),
                             Shape<Int<kBM>, Int<kBK>>{});
    }
    static auto make_b(const E* w2, int H, int I, int G) {
        Tensor m = make_tensor(make_gmem_ptr(w2), make_layout(make_shape(H, I, G),
                                                              make_stride((int64_t)I, _1{}, (int64_t)H * I)));
        return make_tma_atom(SM90_TMA_LOAD{}, m, typename Ty::SmemLayoutB{}(_, _, 0),
                             Shape<Int<kBN>, Int<kBK>>{});
    }
    using TmaA = decltype(make_a(nullptr, 1, 64));
    using TmaB = decltype(make_b(nullptr, 256, 64, 1));

    // grid: CTAs (<= SMs); returns a cudaError_t
    static cudaError_t run(const T* act, int rows_cap, const T* w2, const Args& a, int grid,
                           int smem_optin, bool pdl, cudaStream_t stream) {
        struct Cache {
            bool valid = false;
            const void* act = nullptr;
            const void* w2 = nullptr;
            int rows = 0, H = 0, I = 0, E = 0;
            TmaA ta;
            TmaB tb;
        };
        static thread_local Cache c;
        if (!c.valid || c.act != act || c.w2 != w2 || c.rows != rows_cap || c.H != a.H || c.I != a.I ||
            c.E != a.E) {
            c.ta = make_a(reinterpret_cast<const E*>(act), rows_cap, a.I);
            c.tb = make_b(reinterpret_cast<const E*>(w2), a.H, a.I, a.E);
            c.act = act; c.w2 = w2; c.rows = rows_cap; c.H = a.H; c.I = a.I; c.E = a.E;
            c.valid = true;
        }
        const int smem = smem_plan(a.I, a.stages, a.E).total;
        auto kern = gemm2_ra_kernel<T, TmaA, TmaB>;
        static const cudaError_t set = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                            smem_optin);
        if (set != cudaSuccess) return set;
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.gridDim = dim3(grid);
        cfg.blockDim = dim3(kThreads);
        cfg.dynamicSmemBytes = (size_t)smem;
        cfg.stream = stream;
        cfg.attrs = attr;
        cfg.numAttrs = pdl ? 1 : 0;
        return cudaLaunchKernelEx(&cfg, kern, c.ta, c.tb, a, rows_cap);
    }
};

}  // namespace ra2

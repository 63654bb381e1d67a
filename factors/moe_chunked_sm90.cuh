/*
 * moe_chunked_sm90.cuh -- the Hopper path's two grouped GEMMs on chunks of up to 256 of an expert's
 * rows (dims[7] = 10, "chunked", or 11, "chunked_nomc": the same without kMc's multicast, or 12,
 * "chunked_tail": chunked_nomc with up to 32 rows more in an expert's last chunk; a tuned choice):
 *   GEMM1 (gated): act[r, n] = dtype(silu(dtype(g)) * dtype(u)), g = xs[r] . w13[e, n],
 *                  u = xs[r] . w13[e, I + n]   (w13 as (E, 2I, H), gate rows first: vLLM's layout)
 *   GEMM2:         ys[r, h]  = dtype(act[r] . w2[e, h])   (w2 as (E, H, I))
 * for the sorted rows r of expert e (rows [expert_off[e], expert_off[e+1]) of xs / act / ys).
 *
 * Why: the CUTLASS tilings pad every expert's rows to 128-row M-tiles, and each M-tile streams
 * the expert's weights again. Where an expert has a little over 128 rows (mixtral T = 512:
 * 128 +- 11 rows) half the experts run a second, nearly empty M-tile: the tensor cores multiply
 * 1536 padded rows for 1024 real ones, and its weights are read twice. Here one CTA takes up to
 * 256 of an expert's rows (a "chunk", in sub-tiles of 64 rows) against one weight tile in shared
 * memory: the weights stream once per chunk and the MMAs run only on sub-tiles that hold rows
 * (padding to 64 rows, not 128). Where the rows per expert fit (chunk_subs: at most 104 on
 * average), the chunks hold up to 128 rows instead, with a ring of 7 stages instead of 4 (Geo)
 * and one CTA per item.
 *
 * Work: an item is (expert e, chunk q, N-tile n); per expert the items run N-tile-major (the
 * chunks of one N-tile side by side, so a second chunk's weight reads hit L2). The grid is
 * persistent (at most one CTA per SM, sized on the host), items dealt round-robin; the item
 * count comes from expert_off on the device. Under skewed routing the hot experts' items (more
 * than twice the mean rows) are dealt alternately with the others' (item_of; RESULTS.md session
 * fifty-one: skewed rows 0.7-6.9% faster on an H100, uniform rows in the same order as before).
 * By default (kMc) CTAs run in clusters of two on the two N-tiles of a pair and multicast the
 * chunk's A sub-tiles (each CTA copies half to both).
 *
 * Measured (H200, benchmarks/RESULTS.md "Chunked", "Swap AB" and "Swap AB by band"): mixtral
 * T = 512 875 µs against 1006 on the 128 x 256 tiling; swap AB by band 873.7 against 928.5 without
 * (same run); the tuning file picks it where it wins (a little over 64j to 256 rows per expert);
 * slower with short reductions and many rows (qwen3-30b T = 4096).
 *
 * Roles (384 threads): warp 0 (one elected lane) issues the TMA copies of a ring of stages (warps
 * 1-3 hand their registers to the consumers and leave), each
 * the B tile (128 weight rows x 64 of the reduction: two 64 x 64 boxes; GEMM1: 64 gate rows and
 * the 64 up rows I below them) and the chunk's A sub-tiles (64 x 64 boxes, only those with rows);
 * warps 4-11 are two consumer warpgroups: warpgroup w multiplies sub-tiles w and w + 2 (where they
 * hold rows) by the whole B tile (SM90 64 x 128 x 16 GMMA, fp32 accumulators), then stores its
 * rows straight from registers.
 *
 * Swap AB (kBand, the default; EX_MOE_SM90_CHUNKED_SWAP_AB=0 turns it off): a launch takes one
 * band of chunk sizes, 64j + 1 .. 64j + 32 rows (swap_band: the band nearest the call's rows per
 * expert); a chunk in it, whose last sub-tile would be at most half full, runs with its rows as
 * the GMMA's N instead, N = 64j + 32 (64 x N x 16; 160 and 224 are cute's extended shapes), and
 * warpgroup w's M is the B tile's rows 64w .. 64w + 63: a chunk of 140 rows multiplies 160, not
 * 192. One N per kernel keeps its code small (see band_n). For GEMM1 the producer then loads the
 * weight tile through a second tensor map (tma_b_gu) as 8 groups of 8 gate rows each followed by
 * the same columns' 8 up rows, so that GMMA's C gives a thread a gate (row r) and its up (row
 * r + 8). The epilogue stores one
 * element at a time (a thread holds 2 weight rows x 2 chunk rows per block of 8 chunk rows). The
 * outputs are bit-identical to the sub-tiles' (tests/test_gpu.py).
 *
 * Tail (kX = kXRows, dims[7] = 12, "chunked_tail": 256-row chunks in pairs multicasting A as the
 * plain 256-row chunks do, the extra box too (EX_MOE_SM90_CHUNKED_MULTICAST=0: one CTA per item),
 * no swap band):
 * the last of an expert's chunks takes up to 32 rows more, multiplied as a swap-AB piece (64 weight
 * rows of the warpgroup's half x 32 rows) from a fifth A box per stage (4 stages of 56 KB), so that
 * an expert of 257..288 rows is one item and streams its weights once. Without it such an expert
 * runs a second chunk of a few rows that streams the weight tile again, and the persistent grid's
 * CTAs, their items of unequal times, no longer read it while L2 still holds it (qwen3-30b T = 4096,
 * Nsight Compute: the chunked GEMM1 moved 1.44 GB from DRAM where 0.99 is the least, CUTLASS 1.07).
 * GEMM1's weight tile is then always the interleaved one (tma_b_gu), so the sub-tiles' epilogue
 * takes a gate from column block 2j and its up from block 2j + 1. Measured (H200, benchmarks/
 * RESULTS.md "chunked_tail"): 0.6-18% faster than the tuned choice at ~256 rows per expert (mixtral
 * T = 1024 1398.4 against 1617.7 µs), slower at 128 or 512.
 *
 * Launch (pdl, the default on the Hopper path; EX_MOE_SM90_PDL=0 turns it off): programmatic
 * dependent launch. A kernel lets the next grid launch at its start (that grid's CTAs get resident
 * as this one's exit) and its producer copies the weight tiles of its first item's first stages
 * before it waits for the previous grid (the gather or GEMM1, which write A), their A sub-tiles
 * after the wait (benchmarks/RESULTS.md "Programmatic dependent launch").
 *
 * Math: fp32 accumulation over the reduction in k-steps of 16, rounded once to the dtype (GEMM1
 * rounds g and u to the dtype before silu, as the CUTLASS path's gated epilogue and vLLM do).
 */
#pragma once

#include <cuda.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/atom/mma_traits_sm90_gmma.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cuda_host_adapter.hpp"
#if !defined(CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED)
#error "moe_chunked_sm90.cuh needs CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED defined before any cute header"
#endif
// needs exmoe::Elem (and, with EX_SM90_EPI_ACCURATE, exmoe::silu_f) from moe_fused_gemm.cuh

namespace exmoe {
namespace chunked {
using namespace cute;

constexpr int kSub = 64;      // rows per sub-tile (one GMMA M)
constexpr int kMaxSub = 4;    // sub-tiles of the largest chunk (256 rows)
constexpr int kBN = 128;      // weight rows per B tile (GEMM1: 64 gate + 64 up -> 64 act columns)
constexpr int kBK = 64;       // reduction columns per stage (128 bytes: the swizzle's width)
constexpr int kThreads = 384;
// Registers a thread after setmaxnreg: the producer warpgroup gives up what the two consumer
// warpgroups take (kLaunchRegs at launch: 65536 / 384, rounded down to 8, 168): 56 / 224, not
// CUTLASS's 40 / 232, at which ptxas spills the producer of every multicast kernel (12-28 bytes of
// stores; none spills at 56 / 224, the consumers included). Measured on an H200 (RESULTS.md session
// fifty-four): chunked_tail multicasting A 1-3% faster at 56 / 224 than at 40 / 232. A build with
// -DEX_MOE_CHUNKED_PRODUCER_REGS=N gives N / the rest, for comparison (multiples of 8)
#if defined(EX_MOE_CHUNKED_PRODUCER_REGS)
constexpr int kProducerRegs = EX_MOE_CHUNKED_PRODUCER_REGS;
#else
constexpr int kProducerRegs = 56;
#endif
constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
constexpr int kConsumerRegs = kLaunchRegs + (kLaunchRegs - kProducerRegs) / 2;
static_assert(kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0 && kProducerRegs >= 24 && kConsumerRegs <= 256,
              "setmaxnreg takes multiples of 8 in 24..256");
constexpr int kBoxBytes = kSub * kBK * 2;                 // 8 KB
constexpr int kBBytes = kBN * kBK * 2;                    // 16 KB per stage
// Chunk geometry of a kernel whose chunks hold up to kSubs sub-tiles (kSubs * 64 rows: 4 or 2). A
// stage holds kSubs A boxes and the B tile; the smaller chunks leave room for a deeper ring: 4
// stages of 48 KB (256-row chunks) or 7 of 32 KB (128), so that an SM keeps 112 KB of weights in
// flight instead of 64 where an expert's rows fit the smaller chunk (chunk_subs). Measured
// (H200, benchmarks/RESULTS.md "Chunks of 128 rows"): 1-4% faster wherever the rows per expert
// fit, e.g. granite T = 512 86.5 against 89.7 µs; chunks of 64 rows at 9 stages were no faster
// than 128 at 7 (and lost where an expert overflows them), so they are not built.
// kX (0 or kXRows): a chunk of the last of an expert's chunks may hold kX rows past its kSubs * 64,
// multiplied as a swap-AB piece (N = kX) from one more A box per stage (256-row chunks only:
// 4 stages of 56 KB)
constexpr int kXRows = 32;
template <int kSubs, int kX = 0>
struct Geo {
    static_assert(kSubs == 2 || kSubs == 4, "chunks of 128 or 256 rows");
    static_assert(kX == 0 || (kX == kXRows && kSubs == 4), "extra rows on 256-row chunks only");
    static constexpr int kRows = kSub * kSubs;
    static constexpr int kABoxes = kSubs + (kX > 0 ? 1 : 0);  // A boxes per stage
    static constexpr int kABytes = kABoxes * kBoxBytes;
    static constexpr int kStages = kSubs == 4 ? 4 : 7;
    static constexpr int kBarOff = kStages * (kABytes + kBBytes);  // 196,608 / 229,376 / 229,376
    static constexpr int kPreOff = kBarOff + 2 * kStages * 8;
};
// Chunks of an expert of m rows: ceil(m / kRows), or with kX the last chunk taking up to kX rows
// more (an expert of 257..288 rows is one chunk)
template <int kSubs, int kX>
__host__ __device__ inline int chunks_of(int m) {
    constexpr int R = Geo<kSubs, kX>::kRows;
    if constexpr (kX == 0) {
        return (m + R - 1) / R;
    } else {
        if (m <= 0) return 0;
        const int c = (m - kX + R - 1) / R;
        return c < 1 ? 1 : c;
    }
}
// The 64-row sub-tiles of a chunk of mv rows that hold rows (with kX, rows past kSubs * 64 go to
// the extra box, not a sub-tile)
template <int kSubs, int kX>
__device__ inline int subtiles_of(int mv) {
    if constexpr (kX > 0) return min(kSubs, (mv + kSub - 1) / kSub);
    else return (mv + kSub - 1) / kSub;
}
// Whether GEMM1's weight tile is loaded as interleaved groups of 8 gate and 8 up rows (tma_b_gu):
// wherever a swap-AB piece may read it (its C gives a thread a gate row and its up row)
template <bool kGated, int kBand, int kX>
constexpr bool gate_up_tile() { return kGated && (kBand > 0 || kX > 0); }
// The chunk size for rows_per_expert = T*K/G on average: 128-row chunks (2 sub-tiles) up to 104
// rows per expert, else 256. 104 is where an expert of the mean plus ~2.4 standard deviations of
// uniform routing (a count near Poisson: sqrt of the mean) still fits one chunk (an expert past it
// runs a second chunk and reads its weights again), chosen to take granite T = 512 (102.4 rows).
// Measured (H200, one process): at 102 rows (granite T = 512) 86.5 against 89.7 µs on 256-row
// chunks; at 128 (olmoe T = 1024) 369.1 against 300.7; nothing measured between 104 and 128.
constexpr int64_t kSmallChunkMaxRowsPerExpert = 104;
inline int chunk_subs(int64_t rows_per_expert) { return rows_per_expert <= kSmallChunkMaxRowsPerExpert ? 2 : kMaxSub; }
// Shared memory of a kernel: the ring, its barriers and the per-expert chunk prefix (E + 1 ints),
// with interleave (Args::hot_rows) a second prefix of the hot experts' chunks
template <int kSubs, int kX = 0>
inline int64_t smem_bytes(int64_t E, bool interleave = false) {
    return Geo<kSubs, kX>::kPreOff + (interleave ? 2 : 1) * (E + 1) * 4;
}
inline int64_t smem_bytes_for(int subs, int64_t E) { return subs == 2 ? smem_bytes<2>(E) : smem_bytes<4>(E); }
// Swap AB by band (kBand, 1..4; 0: none): a kernel of band b runs swap AB on the chunks of
// 64(b-1) + 1 .. 64(b-1) + 32 rows, with N = band_n(b) = 64(b-1) + 32 (32, 96, 160, 224), and the
// other chunks on the sub-tiles. Measured per MMA row, swap AB is slower than the sub-tiles (every
// chunk on it, mixtral T = 448, chunks of 100-128 rows: 884 vs 829 µs), so it pays only where it
// leaves out at least half a sub-tile. One N per kernel, not every N a chunk could take: kernels
// that held swap AB at eight N (16 .. 224; 207 KB of code against 52 KB without) ran their
// sub-tile chunks slower where the reductions are short, with the same instructions (deepseek
// T = 512 at Nsight Compute's clock: GEMM1 209.3 against 200.2 µs; both GEMMs, eager: 299.1
// against 288.0, and 288.3 with only N = 16 and 32, 64 KB; 3-4% of the whole call): the
// instruction cache's cost of the code size (benchmarks/RESULTS.md "Swap AB by band"). The host
// picks the band from the rows per expert (swap_band).
__host__ __device__ constexpr int band_n(int band) { return kSub * (band - 1) + kSub / 2; }
__host__ __device__ constexpr bool swap_pays(int m, int band) {
    return band > 0 && m > kSub * (band - 1) && m <= band_n(band);
}
// The band for experts of rows_per_expert rows on average (T*K/G; chunks of up to 256 rows): the
// one whose rows (64j + 1 .. 64j + 32, centre 64j + 16.5) lie nearest the average's remainder r
// past the full chunks, j = round((r - 16.5) / 64), and past 240 band 1 again (the centre
// 256 + 16.5: about half such experts have a second chunk of a few rows). Mixtral T = 512, 128
// rows: band 3 (129-160); phi-3.5 T = 512, 64: band 2; deepseek T = 2048, 192: band 4.
// Chunks of subs sub-tiles (64 * subs rows): the same rule on that chunk size (bands 1..subs;
// past 112 rows of a 128-row chunk, band 1).
inline int swap_band(int64_t rows_per_expert, int subs = kMaxSub) {
    const int64_t r = (rows_per_expert < 0 ? 0 : rows_per_expert) % (kSub * subs);
    return (int)(((r + 15) / kSub) % subs) + 1;
}
// N-tiles of a GEMM (GEMM1: I / 64 of act's columns; GEMM2: H / 128); the multicast variant
// takes them in pairs, so it runs only where their count is even (run() checks)
__host__ __device__ constexpr int64_t n_tiles(bool gated, int64_t N) { return gated ? N / (kBN / 2) : N / kBN; }

template <typename T> struct CuteElem;
template <> struct CuteElem<__nv_bfloat16> { using type = cutlass::bfloat16_t; };
template <> struct CuteElem<__half> { using type = cutlass::half_t; };

template <typename T, int kSubs, int kX = 0>
struct Types {
    using G = Geo<kSubs, kX>;
    using E = typename CuteElem<T>::type;
    using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E>{},
                                               Shape<Int<kSub>, Int<kBK>, Int<G::kABoxes * G::kStages>>{}));
    using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E>{},
                                               Shape<Int<kBN>, Int<kBK>, Int<G::kStages>>{}));
    using MmaOp = decltype(GMMA::ss_op_selector<E, E, float, Shape<Int<kSub>, Int<kBN>, Int<kBK>>,
                                                 GMMA::Major::K, GMMA::Major::K>());
    using TiledMma = decltype(make_tiled_mma(MmaOp{}));  // one warpgroup
};

// An expert is hot (Args::hot_rows) where it has more than kHotMeanRatio times the mean rows per
// expert (T*K / E) and at least two chunks: skewed routing, not uniform routing's spread (at
// T = 4096 an expert of qwen3-235b has 256 +- 16 rows)
constexpr int kHotMeanRatio = 2;

struct Args {
    const int* expert_off;  // E + 1 (routing output)
    void* out;              // act (rows, I) for GEMM1, ys (rows, H) for GEMM2
    int ld_out;             // I or H
    int N;                  // GEMM1: I (act columns); GEMM2: H
    int Kdim;               // reduction: H or I
    int E;
    // > 0: the items of hot experts (more rows than this, kHotMeanRatio * T*K / E from the host,
    // and two chunks or more) dealt alternately with the others' (see item_of); 0: every item in
    // expert order. run() clears it where the second prefix does not fit the shared memory
    int hot_rows = 0;
#if defined(EX_MOE_DIAG)
    int diag_skip = 0;  // diagnostic build: EX_MOE_DIAG_SKIP's bits (4: GEMM2's A copies do not wait for GEMM1)
#endif
};

// silu as the CUTLASS path's gated epilogue computes it (its EX_SM90_EPI_ACCURATE build: expf)
#if defined(EX_SM90_EPI_ACCURATE)
__device__ __forceinline__ float silu_epi(float g) { return silu_f(g); }
#else
// __fdividef(g, 1 + __expf(-g)) with ex2's flush-to-zero form (one instruction less, no branch):
// the same bits, since ex2 of an argument under -126 (a subnormal result) adds nothing to 1
__device__ __forceinline__ float silu_epi(float g) {
    float e;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(g * -1.4426950408889634f));
    return __fdividef(g, 1.0f + e);
}
#endif

// The swap-AB epilogue of NN chunk rows (GMMA's C fragment ((2 chunk rows, 2 weight rows r / r + 8,
// NN / 8 blocks of 8 chunk rows), 1, 1), tCc its coordinates): each value computed and its store
// predicated on t < mv (rows past the chunk are never stored), at obase + t * ld (32-bit: t < NN <= 224
// (kX's obase is past chunk_rows), ld <= 2^23: < 2^31). GEMM1: rows r, r + 8 give one act column; GEMM2: cols
// r and r + 8. Written for little code per element (the code size is what the swap band bounds).
template <typename T, bool kGated, int NN, class Acc, class Coords>
__device__ __forceinline__ void store_swap(const Acc& acc, const Coords& tCc, T* obase, int ld, int mv) {
    CUTLASS_PRAGMA_UNROLL
    for (int b = 0; b < NN / 8; ++b) {
        CUTLASS_PRAGMA_UNROLL
        for (int x = 0; x < 2; ++x) {
            const int t = int(get<1>(tCc(make_coord(make_coord(x, 0, b), 0, 0))));
            const float v0 = acc(make_coord(make_coord(x, 0, b), 0, 0));
            const float v1 = acc(make_coord(make_coord(x, 1, b), 0, 0));
            T* o = obase + t * ld;
            if constexpr (kGated) {
                const float2 gu = Elem<T>::unpack(Elem<T>::pack(v0, v1));
                const T a = Elem<T>::from_f(silu_epi(gu.x) * gu.y);
                if (t < mv) o[0] = a;
            } else {
                const T a = Elem<T>::from_f(v0), c = Elem<T>::from_f(v1);
                if (t < mv) { o[0] = a; o[8] = c; }
            }
        }
    }
}

// kMc: launched in clusters of two CTAs that take the two N-tiles of a pair for the same chunk;
// each copies half of the chunk's A sub-tiles (s % 2 == its rank) to both CTAs' shared memory (TMA
// multicast), so A crosses from L2 once per pair; a stage is refilled only after both CTAs'
// consumers released it (empty barriers count 16 arrivals, one per consumer warp of either CTA).
// kSubs: sub-tiles per chunk (Geo); kBand <= kSubs.
template <typename T, bool kGated, bool kMc, int kBand, int kSubs, int kX>
__global__ void __launch_bounds__(kThreads, 1)
chunked_gemm_kernel(const __grid_constant__ CUtensorMap tma_a, const __grid_constant__ CUtensorMap tma_b,
                    const __grid_constant__ CUtensorMap tma_b_gu, const Args p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(CUTE_ARCH_MMA_SM90A_ENABLED)
    static_assert(kBand <= kSubs, "a swap band's N fits the chunk");
    static_assert(kX == 0 || kBand == 0, "extra rows: no swap band");
    using G = Geo<kSubs, kX>;
    constexpr int kStages = G::kStages, kABytes = G::kABytes, kABoxes = G::kABoxes;
    constexpr int kBarOff = G::kBarOff, kPreOff = G::kPreOff;
    constexpr bool kGu = gate_up_tile<kGated, kBand, kX>();
    using Ty = Types<T, kSubs, kX>;
    using E = typename Ty::E;
    extern __shared__ __align__(1024) unsigned char smem[];
    E* sa_ptr = reinterpret_cast<E*>(smem);
    E* sb_ptr = reinterpret_cast<E*>(smem + kStages * kABytes);
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + kBarOff);
    uint64_t* empty = full + kStages;
    int* s_pre = reinterpret_cast<int*>(smem + kPreOff);  // chunks before expert e; [E] = total
    int* s_preh = s_pre + (p.E + 1);  // (p.hot_rows > 0 only) hot experts' chunks before expert e

    const int tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;
    const int KB = p.Kdim / kBK;
    // launched with PDL (run's pdl): the next grid's CTAs may be scheduled now (as this grid's
    // CTAs exit: it holds at most one CTA per SM, each an SM's registers and shared memory)
    explugin::pdl_launch_dependents();
    constexpr int kCtas = kMc ? 2 : 1;
    // items per chunk: its N-tiles, or (kMc) their pairs; run() refuses an odd count for kMc
    const int NT = (int)n_tiles(kGated, p.N) / kCtas;
    constexpr int chunk_rows = G::kRows;
    const int rank = kMc ? (int)cute::block_rank_in_cluster() : 0;
    const int cid = blockIdx.x / kCtas, n_clusters = gridDim.x / kCtas;

    if (tid == 0) {
        for (int s = 0; s < kStages; ++s) {
            cutlass::arch::ClusterTransactionBarrier::init(&full[s], 1);
            cutlass::arch::ClusterBarrier::init(&empty[s], 8 * kCtas);
        }
        cutlass::arch::fence_barrier_init();
    }
    if (warp == 1) {  // chunks per expert, exclusive prefix (and, interleaved, the hot experts')
        const bool il = p.hot_rows > 0;
        int carry = 0, carry_h = 0;
        for (int base = 0; base < p.E; base += 32) {
            const int e = base + lane;
            int m = 0;
            if (e < p.E) m = __ldg(p.expert_off + e + 1) - __ldg(p.expert_off + e);
            const int nc = chunks_of<kSubs, kX>(m);
            const int nh = (il && nc >= 2 && m > p.hot_rows) ? nc : 0;
            int inc = nc, inh = nh;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int v = __shfl_up_sync(0xffffffffu, inc, o);
                const int vh = __shfl_up_sync(0xffffffffu, inh, o);
                if (lane >= o) { inc += v; inh += vh; }
            }
            if (e < p.E) {
                s_pre[e] = carry + inc - nc;
                if (il) s_preh[e] = carry_h + inh - nh;
            }
            carry += __shfl_sync(0xffffffffu, inc, 31);
            carry_h += __shfl_sync(0xffffffffu, inh, 31);
        }
        if (lane == 0) {
            s_pre[p.E] = carry;
            if (il) s_preh[p.E] = carry_h;
        }
    }
    if constexpr (kMc)
        cute::cluster_sync();  // the peer's barriers are initialized before any multicast or remote arrival
    else
        __syncthreads();
    const int n_items = s_pre[p.E] * NT;
    // interleaved: the hot experts' items (n_hot) and the others' (n_cold), each stream in expert
    // order; else one stream, every item in expert order
    const int n_hot = p.hot_rows > 0 ? s_preh[p.E] * NT : 0, n_cold = n_items - n_hot;
    const bool mix = n_hot > 0 && n_cold > 0;

    // item -> expert, first row of the chunk, its rows (1..chunk_rows), N-tile.
    // Mixed (skewed routing): item it is CTA (cluster) it % n_clusters's (it / n_clusters)-th, and
    // takes the next of the hot stream where that CTA's index plus that round is even, else the
    // next of the cold stream (once a stream is used up, the other's next), so that in every round
    // half the CTAs multiply a hot expert's chunks (MMA-bound: its weight tile serves many rows)
    // and half stream a cold expert's weights (memory-bound), and every CTA alternates. In expert
    // order such a call ran the hot experts' items first and the cold ones' after, the tensor cores
    // then the memory idle in turn (qwen3-235b T = 4096, skewed: 22% over uniform routing). Other
    // deals measured slower (RESULTS.md session fifty-two): the hot items spread evenly over the
    // call, or on 2 of 3 or 1 of 3 positions, all within 3% of the expert order's time at skewed
    // qwen3-235b T = 4096; only 1:1 deals, where every CTA alternates hot and cold items, gained.
    auto item_of = [&](int it, int& e, int& m0, int& mv, int& n) {
        int idx = it, hot = 0;
        if (mix) {
            const int k = it / n_clusters, x = it - k * n_clusters;
            // positions before it whose pattern is hot: rounds j < k take (n+1)/2 (j even) or n/2
            const int hc = ((k + 1) / 2) * ((n_clusters + 1) / 2) + (k / 2) * (n_clusters / 2) +
                           ((k & 1) ? x / 2 : (x + 1) / 2);
            const int cc = it - hc;
            if (hc < n_hot && cc < n_cold) {
                hot = ((x + k) & 1) == 0;
                idx = hot ? hc : cc;
            } else if (hc >= n_hot) {
                idx = it - n_hot;  // the hot stream is used up: the cold stream's next
            } else {
                hot = 1;
                idx = it - n_cold;
            }
        }
        // the stream's chunk prefix: every expert's (one stream), the hot experts', or the others'
        auto pre = [&](int j) { return !mix ? s_pre[j] : hot ? s_preh[j] : s_pre[j] - s_preh[j]; };
        const int c = idx / NT;  // items of expert e are [pre(e)*NT, pre(e+1)*NT): idx / NT finds e
        int lo = 0, hi = p.E - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (pre(mid) <= c) lo = mid; else hi = mid - 1;
        }
        e = lo;
        const int nc = pre(e + 1) - pre(e);
        const int local = idx - pre(e) * NT;  // n-major within the expert
        n = local / nc;
        const int q = local - n * nc;
        const int off = __ldg(p.expert_off + e);
        const int m = __ldg(p.expert_off + e + 1) - off;
        m0 = off + q * chunk_rows;
        // (kX: the last chunk holds up to kX rows more)
        mv = kX > 0 ? (q == nc - 1 ? m - q * chunk_rows : chunk_rows) : min(chunk_rows, m - q * chunk_rows);
    };

    if (warp < 4) {
        // ------------------------------ producer ------------------------------
        // registers: kProducerRegs (56) a thread here, kConsumerRegs (224) for the consumers (128
        // of their accumulators); the whole warpgroup executes it
        cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
        if (warp != 0) return;
        if (cute::elect_one_sync()) {
            int stage = 0, phase = 1;  // a fresh empty barrier passes parity 1
            const uint64_t hint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
            // PDL: the weights (inputs) of the first item's first stages are copied before the
            // wait for the previous grid (the gather or GEMM1, which write A); their A copies
            // follow the wait. expert_off is the routing's, final before the previous grid began
            // (that one was launched plainly, or waited before it let this grid launch). Without
            // PDL the wait returns at once.
            bool early = true;
            for (int it = cid; it < n_items; it += n_clusters) {
                int e, m0, mv, n;
                item_of(it, e, m0, mv, n);
                n = n * kCtas + rank;
                const int nsub = subtiles_of<kSubs, kX>(mv);
                const int nx = (kX > 0 && mv > chunk_rows) ? 1 : 0;  // the extra rows' box
                const bool swap = swap_pays(mv, kBand);
                const int b0 = kGated ? n * (kBN / 2) : n * kBN;
                const int b1 = kGated ? p.N + n * (kBN / 2) : n * kBN + kBN / 2;
                auto copy_a = [&](int st, int kb) {
                    unsigned char* sa = reinterpret_cast<unsigned char*>(sa_ptr) + st * kABytes;
                    if constexpr (kMc) {
                        for (int s = rank; s < nsub; s += 2)
                            SM90_TMA_LOAD_MULTICAST_2D::copy(&tma_a, &full[st], (uint16_t)0x3, hint,
                                                             sa + s * kBoxBytes, kb * kBK, m0 + s * kSub);
                        // (kX) the extra rows' box, by the CTA whose turn follows the sub-tiles'
                        if (nx && rank == (nsub & 1))
                            SM90_TMA_LOAD_MULTICAST_2D::copy(&tma_a, &full[st], (uint16_t)0x3, hint,
                                                             sa + kSubs * kBoxBytes, kb * kBK, m0 + chunk_rows);
                    } else {
                        for (int s = 0; s < nsub; ++s)
                            SM90_TMA_LOAD_2D::copy(&tma_a, &full[st], hint, sa + s * kBoxBytes, kb * kBK,
                                                   m0 + s * kSub);
                        if (nx)  // rows chunk_rows .. chunk_rows + 63 (past the expert: not stored)
                            SM90_TMA_LOAD_2D::copy(&tma_a, &full[st], hint, sa + kSubs * kBoxBytes, kb * kBK,
                                                   m0 + chunk_rows);
                    }
                };
                // stages of this item whose A is owed (the first item's first stages: 0 .. pre-1)
                const int pre = early ? min(KB, kStages) : 0;
                auto pay = [&]() {
#if defined(EX_MOE_DIAG)
                    if (!(p.diag_skip & 4))
#endif
                    explugin::pdl_wait();
                    for (int j = 0; j < pre; ++j) copy_a(j, j);
                    early = false;
                };
                for (int kb = 0; kb < KB; ++kb) {
                    if (early && kb == pre) pay();
                    cutlass::arch::ClusterBarrier::wait(&empty[stage], phase);
                    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(
                        &full[stage], kBBytes + (nsub + nx) * kBoxBytes);
                    unsigned char* sb = reinterpret_cast<unsigned char*>(sb_ptr) + stage * kBBytes;
                    if (kGu && (kX > 0 || swap)) {
                        // one box of the interleaved view (tma_b_gu): groups of 8 gate rows, each
                        // followed by its 8 up rows (64 act columns: 8 groups)
                        SM90_TMA_LOAD_5D::copy(&tma_b_gu, &full[stage], hint, sb, kb * kBK, 0, 0, n * 8, e);
                    } else {
                        SM90_TMA_LOAD_3D::copy(&tma_b, &full[stage], hint, sb, kb * kBK, b0, e);
                        SM90_TMA_LOAD_3D::copy(&tma_b, &full[stage], hint, sb + kBoxBytes, kb * kBK, b1, e);
                    }
                    if (!early) copy_a(stage, kb);
                    if (++stage == kStages) { stage = 0; phase ^= 1; }
                }
                if (early) pay();  // KB <= kStages: every stage of the item was owed
            }
            // a CTA without items waits too: this grid's end must imply the previous grid's (the
            // next grid waits for this one only)
#if defined(EX_MOE_DIAG)
            if (p.diag_skip & 4) early = true;  // the knock-out's wait, at the end only
#endif
            if (early) explugin::pdl_wait();
            // kMc tail: wait until every stage is released once more, so that this CTA does not
            // exit while its peer's consumers may still arrive on its barriers
            if constexpr (kMc) {
                for (int i = 0; i < kStages; ++i) {
                    cutlass::arch::ClusterBarrier::wait(&empty[stage], phase);
                    if (++stage == kStages) { stage = 0; phase ^= 1; }
                }
            }
        }
        return;
    }

    // ------------------------------ consumers ------------------------------
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    const int ct = tid - 128;
    // warp-uniform by construction (a shuffle's broadcast), so that ptxas sees the MMA branches
    // below as non-divergent and keeps the wgmmas asynchronous (else warning C7520)
    const int wg = __shfl_sync(0xffffffffu, ct / 128, 0);  // 0, 1
    const int wt = ct % 128;   // thread in its warpgroup
    typename Ty::TiledMma mma;
    auto thr = mma.get_thread_slice(wt);
    Tensor sA = make_tensor(make_smem_ptr(sa_ptr), typename Ty::SmemLayoutA{});  // (64, 64, kSubs*STAGES)
    Tensor sB = make_tensor(make_smem_ptr(sb_ptr), typename Ty::SmemLayoutB{});  // (128, 64, STAGES)
    Tensor tCsA = thr.partition_A(sA);
    Tensor tCsB = thr.partition_B(sB);
    Tensor tCrA = thr.make_fragment_A(tCsA);  // (MMA, 1, 4, kSubs*STAGES)
    Tensor tCrB = thr.make_fragment_B(tCsB);  // (MMA, 1, 4, STAGES)
    Tensor cC = make_identity_tensor(Shape<Int<kSub>, Int<kBN>>{});
    Tensor tCcC = thr.partition_C(cC);

    int stage = 0, phase = 0;
    T* out = static_cast<T*>(p.out);
    using E2 = typename Elem<T>::T2;
    for (int it = cid; it < n_items; it += n_clusters) {
        int e, m0, mv, n;
        item_of(it, e, m0, mv, n);
        n = n * kCtas + rank;
        const int nsub = __shfl_sync(0xffffffffu, subtiles_of<kSubs, kX>(mv), 0);
        const bool do0 = wg < nsub, do1 = kSubs > 2 && wg + 2 < nsub;
        // the k-loop for NS of this warpgroup's sub-tiles (0, 1, 2), one MMA batch in flight:
        // batch kb is issued before batch kb - 1 is waited for, then kb - 1's stage is released
        auto release = [&](int s) {  // each consumer warp's arrival on stage s's empty barrier(s)
            __syncwarp();
            if (lane == 0) {
                cutlass::arch::ClusterBarrier::arrive(&empty[s]);
                if constexpr (kMc) cutlass::arch::ClusterBarrier::arrive(&empty[s], (uint32_t)(rank ^ 1), 1u);
            }
        };
        if constexpr (kBand > 0) {
          if (__shfl_sync(0xffffffffu, swap_pays(mv, kBand), 0)) {
            // swap AB: D^T (64 weight rows of this warpgroup x NN of the chunk's rows) = W . X^T;
            // NN = band_n(kBand), so a chunk of 140 rows multiplies 160 (192 on the sub-tiles)
            {
                constexpr int NN = band_n(kBand);
                using MmaT = decltype(GMMA::ss_op_selector<E, E, float, Shape<Int<kSub>, Int<NN>, Int<kBK>>,
                                                           GMMA::Major::K, GMMA::Major::K>());
                static_assert(size<1>(typename MMA_Traits<MmaT>::Shape_MNK{}) == NN,
                              "one GMMA of the chunk's whole N per k-step of 16");
                auto mma_t = make_tiled_mma(MmaT{});
                auto thr_t = mma_t.get_thread_slice(wt);
                // weights: the stage's 128-row tile as two 64-row halves, half wg for this warpgroup
                using LayoutW = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E>{},
                                                       Shape<Int<kSub>, Int<kBK>, Int<2 * kStages>>{}));
                using LayoutX = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E>{}, Shape<Int<NN>, Int<kBK>>{}));
                Tensor sW = make_tensor(make_smem_ptr(sb_ptr), LayoutW{});
                Tensor tWr = thr_t.make_fragment_A(thr_t.partition_A(sW));  // (MMA, 1, 4, 2*STAGES)
                // the chunk's rows: stage 0's descriptors, moved to stage s by s * kABytes (in the
                // descriptor's 16-byte units)
                Tensor tXr0 = thr_t.make_fragment_B(thr_t.partition_B(make_tensor(make_smem_ptr(sa_ptr), LayoutX{})));
                Tensor acc = partition_fragment_C(mma_t, Shape<Int<kSub>, Int<NN>>{});
                int prev = -1;
                for (int kb = 0; kb < KB; ++kb) {
                    cutlass::arch::ClusterBarrier::wait(&full[stage], phase);
                    Tensor tXr = make_tensor(tXr0.data() + stage * (kABytes / 16), tXr0.layout());  // (MMA, 1, 4)
                    warpgroup_fence_operand(acc);
                    warpgroup_arrive();
                    CUTLASS_PRAGMA_UNROLL
                    for (int k = 0; k < size<2>(tWr); ++k) {
                        mma_t.accumulate_ = (kb == 0 && k == 0) ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
                        cute::gemm(mma_t, tWr(_, _, k, stage * 2 + wg), tXr(_, _, k), acc);
                    }
                    warpgroup_commit_batch();
                    warpgroup_wait<1>();
                    warpgroup_fence_operand(acc);
                    if (prev >= 0) release(prev);
                    prev = stage;
                    if (++stage == kStages) { stage = 0; phase ^= 1; }
                }
                warpgroup_wait<0>();
                warpgroup_fence_operand(acc);
                if (prev >= 0) release(prev);
                // epilogue (store_swap); this thread's weight row r = warp * 16 + lane / 4 (GMMA's C)
                Tensor cC = make_identity_tensor(Shape<Int<kSub>, Int<NN>>{});
                Tensor tCc = thr_t.partition_C(cC);
                const int r = int(get<0>(tCc(make_coord(make_coord(0, 0, 0), 0, 0))));
                const int ld = p.ld_out;
                // GEMM1: rows r (gate) and r + 8 (up) give act column (r / 16) * 8 + r % 8 of this
                // warpgroup's 32 (the interleaved weight tile); GEMM2: columns r and r + 8
                T* obase = out + (int64_t)m0 * ld +
                           (kGated ? n * (kBN / 2) + wg * 32 + (r / 16) * 8 + (r % 8) : n * kBN + wg * kSub + r);
                store_swap<T, kGated, NN>(acc, tCc, obase, ld, mv);
            }
            continue;
          }
        }
        Tensor acc0 = partition_fragment_C(mma, Shape<Int<kSub>, Int<kBN>>{});  // sub-tile wg
        Tensor acc1 = partition_fragment_C(mma, Shape<Int<kSub>, Int<kBN>>{});  // sub-tile wg + 2
        // the k-loop of NS sub-tiles; extra (chunked_tail's rows past the sub-tiles, see below) is
        // a hook that fences its accumulators (extra(stage, -1, sc)) or issues its MMA of k-step k
        // after the sub-tiles' (extra(stage, k, sc)); no_extra for every other chunk
        auto no_extra = [](int, int, GMMA::ScaleOut) {};
        auto mainloop = [&](auto ns_tag, auto&& extra) {
            constexpr int NS = decltype(ns_tag)::value;
            int prev = -1;
            for (int kb = 0; kb < KB; ++kb) {
                cutlass::arch::ClusterBarrier::wait(&full[stage], phase);
                if constexpr (NS > 0) {
                    warpgroup_fence_operand(acc0);
                    if constexpr (NS > 1) warpgroup_fence_operand(acc1);
                    extra(stage, -1, GMMA::ScaleOut::One);
                    warpgroup_arrive();
                    CUTLASS_PRAGMA_UNROLL
                    for (int k = 0; k < size<2>(tCrA); ++k) {
                        const auto sc = (kb == 0 && k == 0) ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
                        mma.accumulate_ = sc;
                        cute::gemm(mma, tCrA(_, _, k, stage * kABoxes + wg), tCrB(_, _, k, stage), acc0);
                        if constexpr (NS > 1)
                            cute::gemm(mma, tCrA(_, _, k, stage * kABoxes + wg + 2), tCrB(_, _, k, stage), acc1);
                        extra(stage, k, sc);
                    }
                    warpgroup_commit_batch();
                    warpgroup_wait<1>();
                    warpgroup_fence_operand(acc0);
                    if constexpr (NS > 1) warpgroup_fence_operand(acc1);
                    extra(stage, -1, GMMA::ScaleOut::One);
                }
                if (prev >= 0) release(prev);
                prev = stage;
                if (++stage == kStages) { stage = 0; phase ^= 1; }
            }
            if constexpr (NS > 0) {
                warpgroup_wait<0>();
                warpgroup_fence_operand(acc0);
                if constexpr (NS > 1) warpgroup_fence_operand(acc1);
                extra(stage, -1, GMMA::ScaleOut::One);
            }
            if (prev >= 0) release(prev);
        };
        // epilogue: fragment ((2 cols, 2 rows, 16 column blocks of 8), 1, 1)
        auto store = [&](auto& acc, int s) {
            const int rbase = s * kSub;
            CUTLASS_PRAGMA_UNROLL
            for (int h = 0; h < 2; ++h) {
                const int r = rbase + int(get<0>(tCcC(make_coord(make_coord(0, h, 0), 0, 0))));
                if (r >= mv) continue;
                T* orow = out + (int64_t)(m0 + r) * p.ld_out;
                if constexpr (kGated && kX > 0) {
                    // the interleaved weight tile: column block 2j holds the gates of act columns
                    // 8j .. 8j + 7, block 2j + 1 their ups
                    CUTLASS_PRAGMA_UNROLL
                    for (int j = 0; j < 8; ++j) {
                        const int c = int(get<1>(tCcC(make_coord(make_coord(0, h, 2 * j), 0, 0))));
                        const float2 g = Elem<T>::unpack(Elem<T>::pack(acc(make_coord(make_coord(0, h, 2 * j), 0, 0)),
                                                                       acc(make_coord(make_coord(1, h, 2 * j), 0, 0))));
                        const float2 u = Elem<T>::unpack(Elem<T>::pack(acc(make_coord(make_coord(0, h, 2 * j + 1), 0, 0)),
                                                                       acc(make_coord(make_coord(1, h, 2 * j + 1), 0, 0))));
                        *reinterpret_cast<E2*>(orow + n * (kBN / 2) + j * 8 + (c % 8)) =
                            Elem<T>::pack(silu_epi(g.x) * u.x, silu_epi(g.y) * u.y);
                    }
                } else if constexpr (kGated) {
                    CUTLASS_PRAGMA_UNROLL
                    for (int b = 0; b < 8; ++b) {
                        const int c = int(get<1>(tCcC(make_coord(make_coord(0, h, b), 0, 0))));
                        const float2 g = Elem<T>::unpack(Elem<T>::pack(acc(make_coord(make_coord(0, h, b), 0, 0)),
                                                                       acc(make_coord(make_coord(1, h, b), 0, 0))));
                        const float2 u = Elem<T>::unpack(Elem<T>::pack(acc(make_coord(make_coord(0, h, b + 8), 0, 0)),
                                                                       acc(make_coord(make_coord(1, h, b + 8), 0, 0))));
                        *reinterpret_cast<E2*>(orow + n * (kBN / 2) + c) =
                            Elem<T>::pack(silu_epi(g.x) * u.x, silu_epi(g.y) * u.y);
                    }
                } else {
                    CUTLASS_PRAGMA_UNROLL
                    for (int b = 0; b < 16; ++b) {
                        const int c = int(get<1>(tCcC(make_coord(make_coord(0, h, b), 0, 0))));
                        *reinterpret_cast<E2*>(orow + n * kBN + c) =
                            Elem<T>::pack(acc(make_coord(make_coord(0, h, b), 0, 0)),
                                          acc(make_coord(make_coord(1, h, b), 0, 0)));
                    }
                }
            }
        };
        if constexpr (kX > 0) {
          if (__shfl_sync(0xffffffffu, (int)(mv > chunk_rows), 0)) {
            // a chunk of chunk_rows + 1 .. chunk_rows + kX rows: the kSubs sub-tiles as always, and
            // the rows past them as a swap-AB piece: D^T (64 weight rows of this warpgroup's half x
            // kX rows) = W . X^T, X the stage's extra A box
            using MmaX = decltype(GMMA::ss_op_selector<E, E, float, Shape<Int<kSub>, Int<kX>, Int<kBK>>,
                                                       GMMA::Major::K, GMMA::Major::K>());
            auto mma_x = make_tiled_mma(MmaX{});
            auto thr_x = mma_x.get_thread_slice(wt);
            using LayoutW = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E>{},
                                                   Shape<Int<kSub>, Int<kBK>, Int<2 * kStages>>{}));
            using LayoutX = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E>{}, Shape<Int<kX>, Int<kBK>>{}));
            Tensor tWr = thr_x.make_fragment_A(thr_x.partition_A(make_tensor(make_smem_ptr(sb_ptr), LayoutW{})));
            Tensor tXr0 = thr_x.make_fragment_B(
                thr_x.partition_B(make_tensor(make_smem_ptr(sa_ptr + kSubs * kSub * kBK), LayoutX{})));
            Tensor accx = partition_fragment_C(mma_x, Shape<Int<kSub>, Int<kX>>{});
            mainloop(Int<2>{}, [&](int s, int k, GMMA::ScaleOut sc) {
                if (k < 0) {
                    warpgroup_fence_operand(accx);
                    return;
                }
                Tensor tXr = make_tensor(tXr0.data() + s * (kABytes / 16), tXr0.layout());
                mma_x.accumulate_ = sc;
                cute::gemm(mma_x, tWr(_, _, k, s * 2 + wg), tXr(_, _, k), accx);
            });
            store(acc0, wg);
            store(acc1, wg + 2);
            // the extra rows, as the swap-AB epilogue (rows r / r + 8 of this warpgroup's weight half)
            Tensor cCx = make_identity_tensor(Shape<Int<kSub>, Int<kX>>{});
            Tensor tCcx = thr_x.partition_C(cCx);
            const int r = int(get<0>(tCcx(make_coord(make_coord(0, 0, 0), 0, 0))));
            const int ld = p.ld_out;
            T* obase = out + (int64_t)(m0 + chunk_rows) * ld +
                       (kGated ? n * (kBN / 2) + wg * 32 + (r / 16) * 8 + (r % 8) : n * kBN + wg * kSub + r);
            store_swap<T, kGated, kX>(accx, tCcx, obase, ld, mv - chunk_rows);
            continue;
          }
        }
        // (do1 is false where chunks hold two sub-tiles, one per warpgroup: no 2-sub-tile loop there)
        if (do1) mainloop(Int<(kSubs > 2 ? 2 : 1)>{}, no_extra);
        else if (do0) mainloop(Int<1>{}, no_extra);
        else mainloop(Int<0>{}, no_extra);
        if (do0) store(acc0, wg);
        if (do1) store(acc1, wg + 2);
    }
#elif defined(__CUDA_ARCH__)
    __trap();  // built without sm_90a's wgmma/TMA: fail loudly, never leave act / ys unwritten
#endif
}

// Host: a 2D (A: rows x K) or 3D (B: E x rows x K) tensor map of 64 x 64 boxes, 128-byte swizzle
inline bool encode_map(CUtensorMap* map, const void* base, bool bf16, int rank, uint64_t K, uint64_t rows,
                       uint64_t E) {
    const cuuint64_t dims[3] = {K, rows, E};
    const cuuint64_t strides[2] = {K * 2, K * rows * 2};
    const cuuint32_t box[3] = {kBK, kSub, 1};
    const cuuint32_t estr[3] = {1, 1, 1};
    const CUresult r = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
        map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, rank,
        const_cast<void*>(base), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS;
}

// Host (kBand > 0, GEMM1): w13 (E, 2I, H) seen as (E, I / 8, 2, 8, H) with the gate/up mode inside the
// 8-row group mode, so that one 128 x 64 box holds 8 groups of 8 gate rows each followed by the
// same 8 columns' up rows (GMMA's C gives a thread rows r and r + 8: a gate and its up)
inline bool encode_map_gate_up(CUtensorMap* map, const void* base, bool bf16, uint64_t K, uint64_t I, uint64_t E) {
    const cuuint64_t dims[5] = {K, 8, 2, I / 8, E};
    const cuuint64_t strides[4] = {K * 2, I * K * 2, 8 * K * 2, 2 * I * K * 2};
    const cuuint32_t box[5] = {kBK, 8, 2, kBN / 16, 1};
    const cuuint32_t estr[5] = {1, 1, 1, 1, 1};
    const CUresult r = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
        map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 5,
        const_cast<void*>(base), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS;
}

// Shapes the kernels take: H % 128 == 0 (GEMM2's N-tiles, GEMM1's k-steps) and I % 64 == 0
// (GEMM1's N-tiles of 64 act columns, GEMM2's k-steps); the caller adds its own conditions (the
// gated path: I % 128 == 0) and E <= kMaxE (the per-expert prefix in shared memory).
// H and I up to 2^23: the swap-AB epilogue's 32-bit row offsets (t * ld, t < 224) stay in range.
constexpr int64_t kMaxE = 4096;
constexpr int64_t kMaxDim = int64_t(1) << 23;
inline bool supports(int64_t H, int64_t I, int64_t E) {
    return H % kBN == 0 && I % kBK == 0 && H >= kBN && I >= kBK && H <= kMaxDim && I <= kMaxDim && E >= 1 &&
           E <= kMaxE;
}

// Clusters of two CTAs of kern (one per SM's worth of shared memory) the device holds at once;
// 0 where the query fails
template <class Kernel>
int max_active_clusters(Kernel kern, int num_sms, int smem_optin, cudaStream_t stream) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 2;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.gridDim = dim3(2 * (unsigned)std::max(1, num_sms / 2));
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = (size_t)smem_optin;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int n = 0;
    return cudaOccupancyMaxActiveClusters(&n, kern, &cfg) == cudaSuccess ? std::max(1, n) : 0;
}

// One launch: a = xs or act (rows_cap x Kdim), b = w13 or w2 (E x N_rows x Kdim)
// work_max: an upper bound on the (chunk, N-tile) items; the grid is persistent: at most one CTA
// per SM (kMc: as many clusters of two as the device holds at once, cudaOccupancyMaxActiveClusters)
// and no more than the items (a CTA past the item count, which the device reads from expert_off,
// returns at once); smem_optin: the device's opt-in shared memory per block (the kernel's
// attribute, set once per process, as the CUTLASS launches do). The three tensor maps are cached for the last
// (pointers, shapes) only: an eager call on another layer's weights encodes them again (host work,
// a few µs, beside GEMMs of hundreds of µs where this tiling is chosen).
template <typename T, bool kGated, bool kMc, int kBand, int kSubs, int kX>
cudaError_t run(const T* a, int rows_cap, const T* b, int b_rows, const Args& args, int64_t work_max, int num_sms,
                int smem_optin, bool pdl, cudaStream_t stream) {
    struct Cache {
        bool valid = false;
        const void* a = nullptr;
        const void* b = nullptr;
        int rows = 0, b_rows = 0, K = 0, E = 0;
        CUtensorMap ta, tb, tb_gu;
    };
    static thread_local Cache c;
    const bool bf16 = std::is_same<T, __nv_bfloat16>::value;
    if (!c.valid || c.a != a || c.b != b || c.rows != rows_cap || c.b_rows != b_rows || c.K != args.Kdim ||
        c.E != args.E) {
        c.valid = false;
        if (!encode_map(&c.ta, a, bf16, 2, args.Kdim, rows_cap, 1) ||
            !encode_map(&c.tb, b, bf16, 3, args.Kdim, b_rows, args.E) ||
            (gate_up_tile<kGated, kBand, kX>() &&
             !encode_map_gate_up(&c.tb_gu, b, bf16, args.Kdim, b_rows / 2, args.E)))
            return cudaErrorInvalidValue;
        if (!gate_up_tile<kGated, kBand, kX>()) c.tb_gu = c.tb;  // a parameter the kernel does not read
        c.a = a; c.b = b; c.rows = rows_cap; c.b_rows = b_rows; c.K = args.Kdim; c.E = args.E;
        c.valid = true;
    }
    if (kMc && n_tiles(kGated, args.N) % 2 != 0) return cudaErrorInvalidValue;  // an N-tile would be left out
    auto kern = chunked_gemm_kernel<T, kGated, kMc, kBand, kSubs, kX>;
    if (smem_bytes<kSubs, kX>(args.E) > smem_optin) return cudaErrorInvalidValue;  // the caller checks smem_bytes_for first
    Args a_ = args;  // the interleave only where its second prefix fits
    if (a_.hot_rows > 0 && smem_bytes<kSubs, kX>(args.E, true) > smem_optin) a_.hot_rows = 0;
    const int smem = (int)smem_bytes<kSubs, kX>(args.E, a_.hot_rows > 0);
    static const cudaError_t set = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                        smem_optin);
    if (set != cudaSuccess) return set;
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[2];
    int na = 0;
    if (kMc) {
        attr[na].id = cudaLaunchAttributeClusterDimension;
        attr[na].val.clusterDim.x = 2;
        attr[na].val.clusterDim.y = 1;
        attr[na].val.clusterDim.z = 1;
        ++na;
    }
    if (pdl) {  // programmatic dependent launch: see the producer's first stages
        attr[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[na].val.programmaticStreamSerializationAllowed = 1;
        ++na;
    }
    cfg.blockDim = dim3(kThreads);
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = (unsigned)na;
    int64_t grid = std::min<int64_t>(num_sms, std::max<int64_t>(work_max, 1));
    if constexpr (kMc) {
        // once per process (one device's figure, as the attribute; thread-safe static init)
        static const int max_clusters = max_active_clusters(kern, num_sms, smem_optin, stream);
        if (max_clusters == 0) {
            (void)cudaGetLastError();
            return cudaErrorInvalidConfiguration;
        }
        const int64_t clusters = std::min<int64_t>(std::min<int64_t>(max_clusters, std::max(1, num_sms / 2)),
                                                   (std::max<int64_t>(work_max, 1) + 1) / 2);
        grid = 2 * clusters;
    }
    cfg.gridDim = dim3((unsigned)grid);
    cfg.dynamicSmemBytes = (size_t)smem;
    const cudaError_t err = cudaLaunchKernelEx(&cfg, kern, c.ta, c.tb, c.tb_gu, a_);
    if (err != cudaSuccess) (void)cudaGetLastError();  // reported here, not again by the next check
    return err;
}

// One GEMM on the chunked kernels: rows_max = T*K (an upper bound on the sorted rows; the chunk
// count is at most rows_max / (64 * kSubs) + E), multicast where asked, the GEMM's N-tiles pair
// up and the chunks are of 256 rows (the smaller chunks' kernels run one CTA per item).
// (kX > 0, chunked_tail: its chunks are no more than the plain ones)
template <typename T, bool kGated, int kBand, int kSubs, int kX = 0>
cudaError_t launch_mc(const T* a, int rows_max, const T* b, int b_rows, const Args& args, bool multicast,
                      int num_sms, int smem_optin, bool pdl, cudaStream_t stream) {
    const int64_t work = ((int64_t)rows_max / Geo<kSubs>::kRows + args.E) * n_tiles(kGated, args.N);
    if constexpr (kSubs == kMaxSub) {
        if (multicast && n_tiles(kGated, args.N) % 2 == 0)
            return run<T, kGated, true, kBand, kSubs, kX>(a, rows_max, b, b_rows, args, work, num_sms, smem_optin,
                                                          pdl, stream);
    }
    return run<T, kGated, false, kBand, kSubs, kX>(a, rows_max, b, b_rows, args, work, num_sms, smem_optin, pdl,
                                                   stream);
}
// band: swap AB on the chunks of that band (swap_pays; the caller's swap_band, or 0: every chunk on
// 64-row sub-tiles); subs: sub-tiles per chunk (4 or 2: chunks of 256 or 128 rows; the caller
// checks smem_bytes_for(subs, E) against the opt-in shared memory); a band outside 0..subs or
// another subs is refused. pdl: programmatic dependent launch (sm_90's griddepcontrol): the
// caller's previous launch in the stream must be one that let this grid launch only once
// expert_off was final (see the producer's first stages). extra (chunked_tail): 256-row chunks whose
// last takes up to kXRows rows more (subs 4, band 0, multicast as the plain 256-row chunks; the
// caller checks smem_bytes<kMaxSub, kXRows>(E) against the opt-in shared memory)
template <typename T, bool kGated>
cudaError_t launch(const T* a, int rows_max, const T* b, int b_rows, const Args& args, bool multicast, int band,
                   int subs, int num_sms, int smem_optin, bool pdl, cudaStream_t stream, bool extra = false) {
    if (extra) {  // 256-row chunks whose last takes up to kXRows more rows; no swap band
        if (subs != kMaxSub || band != 0) return cudaErrorInvalidValue;
        return launch_mc<T, kGated, 0, kMaxSub, kXRows>(a, rows_max, b, b_rows, args, multicast, num_sms,
                                                         smem_optin, pdl, stream);
    }
#define EX_CHUNKED_LAUNCH(B, S) \
    launch_mc<T, kGated, B, S>(a, rows_max, b, b_rows, args, multicast, num_sms, smem_optin, pdl, stream)
    if (subs == 4) {
        switch (band) {
            case 0: return EX_CHUNKED_LAUNCH(0, 4);
            case 1: return EX_CHUNKED_LAUNCH(1, 4);
            case 2: return EX_CHUNKED_LAUNCH(2, 4);
            case 3: return EX_CHUNKED_LAUNCH(3, 4);
            case 4: return EX_CHUNKED_LAUNCH(4, 4);
            default: return cudaErrorInvalidValue;
        }
    }
    if (subs == 2) {
        switch (band) {
            case 0: return EX_CHUNKED_LAUNCH(0, 2);
            case 1: return EX_CHUNKED_LAUNCH(1, 2);
            case 2: return EX_CHUNKED_LAUNCH(2, 2);
            default: return cudaErrorInvalidValue;
        }
    }
#undef EX_CHUNKED_LAUNCH
    return cudaErrorInvalidValue;
}

}  // namespace chunked
}  // namespace exmoe

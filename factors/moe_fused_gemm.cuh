/*
 * moe_fused_gemm.cuh -- factor 2, the routed experts of an MoE layer: the portable
 * implementation (sm_80+), shared by two plugins:
 *   factors/moe_fused_gemm.cu       this code only (sm_90a + sm_80 + compute_80 PTX)
 *   factors/moe_fused_gemm_sm90.cu  Hopper: a CUTLASS wgmma grouped-GEMM prefill path, and this
 *                                   code for decode/small shapes and as its kernel_fallback
 * Everything here is static or inline: each plugin is one translation unit that includes it
 * once and adds its own EX_DEFINE_ABI_VERSION() and ex_get_factor.
 *
 *   out[t] = sum_k topk_weights[t,k] * w2[e] @ (silu(g) * u),   [g; u] = w13[e] @ x[t],
 *   e = topk_ids[t,k],  silu(g) = g / (1 + exp(-g)).
 *   fp32 accumulation; act = silu(g)*u is rounded to the input dtype before the second GEMM
 *   (as vLLM's fused_experts does). A slot whose id is outside [0, E) contributes nothing and
 *   sets bit 0 of the int32 at workspace byte 0 (never cleared here: whoever reads it clears it).
 *
 * Shapes and dtypes (contract: manifests/moe_fused_gemm.yaml), dims = {T, H, E, I, K, dtype, G,
 * config} (G, the number of global experts, may be left out: G = E; config, the tile
 * configuration, may be left out or -1: chosen from T*K/G as below, else kTileConfig*):
 *   output  out            (T, H)       fp16 | bf16 (same as hidden_states)
 *   input   hidden_states  (T, H)       fp16 | bf16, row-major, contiguous
 *   aux[0]  router_logits  (T, G)       optional, unused
 *   aux[1]  w13            (E, 2I, H)   rows 0..I-1 of w13[e] are gate, I..2I-1 up
 *   aux[2]  w2             (E, H, I)
 *   aux[3]  topk_weights   (T, K)       fp32
 *   aux[4]  topk_ids       (T, K)       int32
 *   aux[5]  workspace      workspace_size(dims) bytes, 256-byte aligned
 *   aux[6]  expert_map     (G,)         int32, optional (expert parallelism): topk_ids are global
 *                          ids in [0, G); expert_map[id] is the local expert in [0, E) that w13/w2
 *                          hold, or -1 for an expert on another rank: that slot contributes
 *                          nothing and is never routed to a GEMM tile. Without it G must equal E.
 *                          A map value outside [-1, E) sets status bit 1 (the slot is skipped).
 *
 *
 * Variants:
 *   kernel           fast path, H % 8 == 0, I % 8 == 0, 16-byte aligned pointers, T*K < 2^31.
 *                    Four launches (five with the multi-block routing, three with the fused
 *                    routing below), all on the caller's stream, no host sync (graph-capturable):
 *                      1. moe_route_kernel     one block (128 threads for T*K <= 2048, else
 *                         1024): histogram of ids per expert (smem
 *                         atomics), cub::BlockScan exclusive sums (rows and BM-row tiles per
 *                         expert), tile list {expert, first row, end row}, placement of every
 *                         valid slot into sorted_slots (grouped by expert), status bit;
 *                         optionally (the Hopper plugin) slot_pos, each placed slot's row.
 *                         T*K > 2048 (kRouteMultiBlockSlots; EX_MOE_ROUTE_MULTIBLOCK_SLOTS, read
 *                         at init, overrides it, 0 = always): two launches of B = min(64,
 *                         ceil(T*K/2048)) blocks of 512 threads, block b owning a contiguous
 *                         range of slots: moe_route_hist_kernel (per-block histogram ->
 *                         route_hist[b][e], status bit), then moe_route_place_kernel
 *                         (programmatic dependent launch: reads its ids, waits; every block sums
 *                         route_hist over blocks and scans over experts itself, block 0 writes
 *                         meta, all share the tile list, each places its own slots from cursors
 *                         starting after the rows of the blocks before it). Same outputs (the
 *                         order inside an expert aside, which no output depends on).
 *                      2. moe_gemm_kernel<GATED> one block per (M-tile, N-tile): A rows
 *                         gathered from hidden_states[sorted_slots[r] / K] by cp.async (zero
 *                         fill past the ends), B = gate rows and the matching up rows of w13[e],
 *                         ldmatrix + mma.sync m16n8k16 (fp32 accumulators), STAGES-deep cp.async
 *                         pipeline; epilogue silu(g)*u -> act (sorted order, dtype).
 *                      3. moe_gemm_kernel<!GATED> A = act rows, B = w2[e]; optional split over
 *                         I (grid z) when few tiles; epilogue * topk_weights[slot] -> y[z][slot]
 *                         (dtype, scattered back to slot order).
 *                      4. moe_combine_kernel   out[t] = sum_k sum_z y[z][t*K+k] in fp32, 16-byte
 *                         vectors, 8 (k, z) loads in flight per thread, invalid slots skipped;
 *                         rounded once. No atomics: the same
 *                         inputs give bit-identical outputs.
 *                         At T = 1 on sm_90+ where GEMM2 has at most 3 blocks per SM (K <= 8, S = 1):
 *                         no such launch; GEMM2 runs in clusters of the token's K blocks of an
 *                         N-tile, whose rank 0 sums their rows in the same order from distributed
 *                         shared memory (cluster_combine; bit-identical; EX_MOE_CLUSTER_COMBINE=0: off).
 *                    Surplus GEMM blocks (the grid is an upper bound computed from dims) read the
 *                    tile count the router wrote and exit.
 *                    T*K <= 32 with the BM=16 configs (tiny, decode, decode4): no routing
 *                    launch; every GEMM1 block routes the slots itself in one warp (ballots,
 *                    shuffles: the same tile list), and so does every GEMM2 block, which issues
 *                    the cp.async of its first STAGES-1 weight tiles before its
 *                    griddepcontrol.wait (topk_ids and w2 are inputs that GEMM1 already waited
 *                    for), then waits and loads act.
 *                    With more slots, the routing launch's tile list is final before GEMM1
 *                    starts, and GEMM2 reads it (through L2) and streams its first weight
 *                    stages before its wait as well. GEMM1 and GEMM2 let the next grid launch
 *                    right after their own wait: its blocks become resident once this grid's
 *                    last blocks have started, fill the SM slots its last wave leaves free and
 *                    stream w2 during GEMM1's tail (EX_MOE_DECODE_CONFIG=onewave: only grids
 *                    that fit in one wave launch early, and GEMM2 routes itself only then; late:
 *                    GEMM2 reads the routing GEMM1's block 0 wrote, launches after main loops;
 *                    unfused: separate routing launch).
 *   kernel_fallback  any H, I, alignment (of the element type): warp per (slot, i) for act, warp
 *                    per (t, h) for out; scalar loads, fp32, no tensor cores. Same status rule.
 *
 * Configs (chosen on the host from rows per expert = T*K/G; table kCfg below; dims[7] >= 0 forces one;
 * a config whose smem exceeds hw->shared_mem_per_block_optin is replaced by a smaller one):
 *   tiny    BM=16,  BN1=16(x2 gate+up), BN2=32,  BK=64, 2 warps (1x2), 8 stages    decode, when
 *           its GEMM1 grid (upper bound) fits 4 blocks per SM (T=1 on qwen3/olmoe/granite/deepseek)
 *   decode  BM=16,  BN1=32(x2 gate+up), BN2=64,  BK=64, 4 warps (1x4), 6 stages    rows/e < 12
 *           and H < kDecode4MinH (rows/e <= 24, any H, under EX_MOE_DECODE_CONFIG=old); 3 blocks
 *           per SM
 *   decode4 BM=16,  BN1=32(x2 gate+up), BN2=64,  BK=64, 4 warps (1x4), 5 stages    decode's
 *           tile at 4 blocks per SM (dims[7] = 9): the kernel's choice in place of decode where
 *           H >= kDecode4MinH and four of its blocks fit on an SM (a grid of up to 528 blocks in
 *           one wave on 132 SMs: qwen3-235b and phi-3.5 at T = 1, 384 and 400 blocks)
 *   mid     BM=64,  BN1=64(x2),         BN2=128, BK=64, 4 warps (2x2), 4 stages    rows/e <= 128
 *   mid32   BM=32,  BN1=64(x2),         BN2=128, BK=64, 4 warps (1x4), 5 stages    rows/e in
 *           12..28 (kMid32MinRows..kMid32MaxRows, in place of decode or mid), or dims[7] = 5:
 *           no half-empty BM=64 tile, no second BM=16 tile per expert
 *   mid48   BM=48,  BN1=64(x2),         BN2=128, BK=64, 4 warps (1x4), 5 stages    tuned data
 *           only (dims[7] = 6): 29-48 rows per expert in one M-tile
 *   prefill BM=128, BN1=64(x2),         BN2=128, BK=64, 8 warps (2x4), 3 stages    rows/e >  128
 * EX_MOE_DECODE_CONFIG (read per call; decode_mode() below): old = no tiny config, N-tile-fastest
 * block order, plain launches, a routing launch (the choices before tiny existed); nopdl = tiny,
 * GEMM1's fused routing for T*K <= 32 on the BM=16 configs, and M-tile-fastest block order for
 * the BM<=48 configs (tiny, decode, decode4, mid32, mid48) while the grid's A tiles fit in a
 * quarter of L2 (an expert's M-tiles then stream the same weight rows at the same time: one DRAM
 * read instead of one per M-tile, e.g. mixtral T=64 where ~45% of the experts get 17-32 rows);
 * late = nopdl + programmatic dependent launch of GEMM1, GEMM2 and combine on sm_90+ (each
 * launch overlaps the previous kernel's tail; each kernel waits for its predecessor before its
 * first global access);
 * onewave = late + the early launches (grids that fit in one wave) and GEMM2's own routing and
 * weight prefetch above; new (default; an unknown value is named on stderr and runs new) =
 * onewave + early launches of GEMM1's and GEMM2's successors whatever their wave count, GEMM2's
 * weight prefetch before its wait also after a routing launch (T*K > 32), and there GEMM2's blocks
 * waiting for their own tile's act (per-tile counters GEMM1's blocks add to) instead of for GEMM1's
 * whole grid, both GEMMs expert by expert (GemmParams::ready), the experts in a spread order
 * (route_spread); gridwait = new without the per-tile waits;
 * unfused = late's launches with the separate routing launch (no fused routing, no early launches).
 *
 * y is kept in the input dtype, not fp32: it halves the bytes of the largest intermediate
 * (T*K*H) written by GEMM2 and read by the combine, which matters at prefill (qwen3-30b, T=4096:
 * 134 MB vs 268 MB, ~30 us of the 393 us floor), and it matches vLLM's numerics
 * (intermediate_cache3 in the activation dtype, moe_sum in fp32).
 *
 * Napkin math (H200: 4.23 TB/s copy, 787 TFLOP/s bf16 matmul; PERF.md):
 *   bytes = experts hit * 3*H*I*2 (+ activations), FLOPs = 2*T*K*3*H*I.
 *   qwen3-30b-a3b (H=2048, I=768, E=128, K=8): T=1: 8 experts * 9.4 MB = 75.5 MB -> 17.9 us;
 *   T=4096: 309 GFLOP -> 393 us. Crossover near T*K/E ~ 200 rows per expert. mma.sync tops out
 *   well below wgmma's 787 TFLOP/s on Hopper, so this version is aimed at the decode rows first.
 *
 * Workspace (all sections 256-byte aligned; a pure function of dims):
 *   [0, 256)        status word (int32 at byte 0) and reserved
 *   route_hist      int32[B, min(E, 16384)] (B = route_mb_blocks(T*K) <= 64): the multi-block
 *                   routing's per-block histograms; at byte 256 (kRouteHistOffset) in both
 *                   plugins' layouts, reserved whichever routing runs
 *   meta            int32[2]: number of tiles, number of valid rows
 *   tiles           int4[max_tiles(BM=16)]: {expert, first row, end row, 0}
 *   ready           int32[max_tiles(BM=16)]: GEMM1 blocks done per tile (new decode mode, zeroed
 *                   by the routing launch)
 *   sorted_slots    int32[T*K]
 *   act             dtype[T*K, I]   (fast path: sorted order; fallback: slot order)
 *   y               dtype[S_cap, T*K, H]   (S_cap = 8 if T*K <= 32, else 1)
 *
 * Errors: cheap host checks only (NULL pointers, dims, dtype; a NULL workspace is
 * EX_ERR_WORKSPACE); after the launches cudaGetLastError -> EX_ERR_CUDA with last_error() set.
 * cudaFuncSetAttribute (smem opt-in) runs once per kernel instantiation, host-only.
 */
#ifndef EX_MOE_FUSED_GEMM_CUH
#define EX_MOE_FUSED_GEMM_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cooperative_groups.h>
#include <cub/block/block_scan.cuh>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <numeric>
#include <type_traits>

#include "ex_engine.h"
#include "ex_plugin.cuh"

// Everything below lives in namespace exmoe, so that a plugin can include other libraries'
// headers (CUTLASS/CuTe define cp_async_wait and friends too) in the same translation unit.
namespace exmoe {


// ------------------------------------------------------------------------------------------
// Configs
// ------------------------------------------------------------------------------------------

template <int BM_, int BN1_, int BN2_, int WARPS_M_, int WARPS_N_, int STAGES_, int MINB_>
struct MoeCfg {
    static constexpr int BM = BM_;        // rows (slots) per M-tile
    static constexpr int BN1 = BN1_;      // act columns per GEMM1 block (gate BN1 + up BN1 rows)
    static constexpr int BN2 = BN2_;      // output columns per GEMM2 block
    static constexpr int BK = 64;         // reduction step: 128-byte smem rows, 8 x 16B chunks
    static constexpr int WARPS_M = WARPS_M_;
    static constexpr int WARPS_N = WARPS_N_;
    static constexpr int THREADS = 32 * WARPS_M_ * WARPS_N_;
    static constexpr int STAGES = STAGES_;
    static constexpr int MINB = MINB_;    // __launch_bounds__ min blocks per SM
    static constexpr int smem_bytes(bool gated) {
        return STAGES * (BM + (gated ? 2 * BN1 : BN2)) * BK * 2;
    }
    static constexpr int smem_max() {
        return smem_bytes(true) > smem_bytes(false) ? smem_bytes(true) : smem_bytes(false);
    }
};

//                    BM  BN1  BN2 WM WN STAGES MINB
using CfgDecode = MoeCfg<16, 32, 64, 1, 4, 6, 3>;     // T*K/G < 12 (old: <= 24), H < kDecode4MinH  (61,440 B)
// The decode tile at 4 blocks per SM, one stage less (dims[7] = 9; the kernel's choice in place of
// CfgDecode where H >= kDecode4MinH and four blocks fit on an SM). H200, ab_moe, one process
// (ab_decode4_h200_2026-12-02.json): qwen3-235b T = 1 81.4 -> 78.0 us (384 blocks: one wave either
// way, 528 slots instead of 396), phi-3.5 T = 1 92.0 -> 80.8 (400 blocks: 1.01 waves of
// CfgDecode), mostly 0-3% faster at T = 16..128 on the H = 2048 and 4096 models (at most 0.4%
// slower on three rows), 1-5% slower on granite (H = 1536) at T = 16..48 and 2% on phi-3.5 at T = 8.
using CfgDecode4 = MoeCfg<16, 32, 64, 1, 4, 5, 4>;    // (51,200 B smem)
using CfgMid = MoeCfg<64, 64, 128, 2, 2, 4, 2>;       // T*K/E <= 128  (98,304 B smem)
// Half-height mid tile (the kernel's choice at 12..28 rows per expert, or dims[7] = 5): such
// experts fill a BM=64 tile half; BM=32 halves the wasted mma work, and an expert with more rows
// gets M-tiles that run side by side (M-tile-fastest order) and share its weight rows through L2.
using CfgMid32 = MoeCfg<32, 64, 128, 1, 4, 5, 2>;     // (102,400 B smem)
// Three-quarter mid tile (tuned data only, dims[7] = 6): 29-48 rows per expert (qwen3-30b,
// deepseek, qwen3-235b at T = 512) in one M-tile, a third less padding than BM=64 and no second
// tile (and second weight read) per expert as with BM=32.
using CfgMid48 = MoeCfg<48, 64, 128, 1, 4, 5, 2>;     // (112,640 B smem)
using CfgPrefill = MoeCfg<128, 64, 128, 2, 4, 3, 2>;  // T*K/E >  128  (98,304 B smem)
// Tiny decode (EX_MOE_DECODE_CONFIG != old): chosen instead of CfgDecode when its whole grid fits
// in one wave of 4 blocks per SM (qwen3/olmoe/granite/deepseek at T=1). Twice the blocks of
// CfgDecode, 8 stages: about 2x the weight bytes in flight per SM, and the last wave is full.
using CfgTiny = MoeCfg<16, 16, 32, 1, 2, 8, 4>;       // (49,152 B smem, 64 threads)

enum { CFG_DECODE = 0, CFG_MID = 1, CFG_PREFILL = 2, CFG_COUNT = 3 };
// Values of dims[7] (the manifest's `config` dim; manifests/tuning/*.yaml hold tuned ones).
enum {
    kTileConfigAuto = -1,
    kTileConfigTiny = 0,
    kTileConfigDecode = 1,   // = CFG_DECODE + 1
    kTileConfigMid = 2,
    kTileConfigPrefill = 3,
    kTileConfigGrouped = 4,  // moe_fused_gemm_sm90.so's CUTLASS grouped GEMM (else: auto)
    kTileConfigMid32 = 5,    // CfgMid32
    kTileConfigMid48 = 6,    // CfgMid48
    kTileConfigGrouped64 = 7,  // moe_fused_gemm_sm90.so's grouped GEMM on 64-row tiles (else: auto)
    kTileConfigNarrow = 8,  // moe_fused_gemm_sm90.so's grouped GEMM on 128 x 128 tiles (else: auto)
    kTileConfigDecode4 = 9,  // CfgDecode4
    kTileConfigChunked = 10,  // moe_fused_gemm_sm90.so's GEMMs on chunks of up to 256 rows (else: auto)
    kTileConfigChunkedNomc = 11,  // the same, each CTA copying its own chunk's A (no cluster multicast)
    kTileConfigChunkedTail = 12,  // chunked on 256-row chunks whose last takes up to 32 rows more
    kTileConfigMax = 12,
};

// What the host needs of each config: when to pick it and what it launches with.
struct CfgInfo {
    int max_rows_per_expert;  // picked while T*K/E <= this
    int smem;                 // largest dynamic smem of its two GEMMs
    int threads, stages;
    int items;                // 16-byte chunks each thread copies per GEMM1 stage
};
template <class C> constexpr CfgInfo cfg_info(int max_rows) {
    return CfgInfo{max_rows, C::smem_max(), C::THREADS, C::STAGES,
                   (C::BM + 2 * C::BN1) * (C::BK / 8) / C::THREADS};
}
static constexpr CfgInfo kCfg[CFG_COUNT] = {cfg_info<CfgDecode>(24), cfg_info<CfgMid>(128),
                                            cfg_info<CfgPrefill>(0x7fffffff)};
static constexpr CfgInfo kCfgTiny = cfg_info<CfgTiny>(24);
constexpr int kTinyBlocksPerSm = 4;  // CfgTiny's grid must fit in this many blocks per SM
// Rows per expert where the kernel's own choice is CfgMid32 (H200, tune_moe, seven models:
// mid32 beat decode and mid by 4-26% at 16, 24 and 25 rows per expert, lost at 8 and 32)
constexpr int64_t kMid32MinRows = 12;
constexpr int64_t kMid32MaxRows = 28;
// Hidden size from which the kernel's decode choice is CfgDecode4 rather than CfgDecode (above)
constexpr int64_t kDecode4MinH = 2048;

constexpr int kRouteThreads = 1024;      // router block for many slots
constexpr int kRouteThreadsSmall = 128;  // ... for at most kRouteSmallSlots slots (decode: a
constexpr int kRouteSmallSlots = 2048;   // shorter scan and cheaper barriers, ~2 us less)
constexpr int kSmallBM = 16;      // the smallest BM of any config: bounds the tile list
static_assert(CfgDecode::BM == kSmallBM && CfgDecode4::BM == kSmallBM && CfgMid::BM >= kSmallBM &&
                  CfgMid32::BM >= kSmallBM &&
                  CfgMid48::BM >= kSmallBM &&
                  CfgPrefill::BM >= kSmallBM && CfgTiny::BM == kSmallBM,
              "the workspace's tile list is sized for the smallest BM");
constexpr int kMaxSplits = 8;     // GEMM2 split over I, only for T*K <= kSplitMaxSlots
constexpr int kSplitMaxSlots = 32;
constexpr int kSimpleThreads = 256;  // combine and fallback kernels

// The factor's version: both plugins report the same one, so the registry's tie-break between
// them is the priority (the Hopper plugin's 10 over this one's 0).
#define MOE_FUSED_GEMM_VERSION "0.1.0"

// ------------------------------------------------------------------------------------------
// Device helpers
// ------------------------------------------------------------------------------------------

template <typename T> struct Elem;
template <> struct Elem<__half> {
    using T2 = __half2;
    static __device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
    static __device__ __forceinline__ __half from_f(float v) { return __float2half_rn(v); }
    static __device__ __forceinline__ T2 pack(float a, float b) { return __floats2half2_rn(a, b); }
    static __device__ __forceinline__ float2 unpack(T2 v) { return __half22float2(v); }
};
template <> struct Elem<__nv_bfloat16> {
    using T2 = __nv_bfloat162;
    static __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
    static __device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16_rn(v); }
    static __device__ __forceinline__ T2 pack(float a, float b) { return __floats2bfloat162_rn(a, b); }
    static __device__ __forceinline__ float2 unpack(T2 v) { return __bfloat1622float2(v); }
};

__device__ __forceinline__ float silu_f(float g) { return g / (1.0f + expf(-g)); }

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; src_bytes = 0 writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                            uint32_t& r3, uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t& r0, uint32_t& r1, uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r0), "=r"(r1)
                 : "r"(addr));
}

// D = A(16x16, row) * B(16x8, col) + D, fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[2]) {
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
}

// Programmatic dependent launch: ex_plugin.cuh
using explugin::pdl_wait;
using explugin::pdl_launch_dependents;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Expert parallelism: topk_ids hold global ids in [0, G); an optional expert map (G,) int32
// gives each one's local index in [0, E), or -1 for an expert that lives on another rank.
// Without a map, G == E and ids are local.
struct ExpertMap {
    const int* map;  // (G,) int32 or nullptr
    int G;           // number of global experts
};

// Local expert of topk id `id`, or -1 when the slot contributes nothing. Sets bits of `bad`:
// 1 = id outside [0, G); 2 = map value outside [-1, E) (both slots contribute nothing).
__device__ __forceinline__ int local_expert(const ExpertMap& m, int id, int E, int& bad) {
    if ((unsigned)id >= (unsigned)m.G) {
        bad |= 1;
        return -1;
    }
    if (m.map == nullptr) return id;
    const int l = __ldg(m.map + id);
    if ((unsigned)l < (unsigned)E) return l;
    if (l != -1) bad |= 2;
    return -1;
}

// ------------------------------------------------------------------------------------------
// The routing kernels' shared steps (moe_route_kernel below, and the multi-block pair after it).
// Each is run by all NT threads of a block; slots are walked U at a time per thread (independent
// loads in flight).
// ------------------------------------------------------------------------------------------

// s_cnt[l] += rows of local expert l among slots [lo, hi); bad collects the status bits
template <int NT, int U>
__device__ __forceinline__ void route_count(const int* __restrict__ topk_ids, const ExpertMap& em,
                                            int E, long long lo, long long hi, int* s_cnt, int& bad) {
    for (long long s0 = lo + threadIdx.x; s0 < hi; s0 += (long long)NT * U) {
        int ev[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const long long s = s0 + (long long)u * NT;
            ev[u] = (s < hi) ? __ldg(topk_ids + s) : 0;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (s0 + (long long)u * NT < hi) {
                const int l = local_expert(em, ev[u], E, bad);
                if (l >= 0) atomicAdd(&s_cnt[l], 1);
            }
        }
    }
}

// The expert at position p of the experts' spread order of stride s (route_spread; s = 0: the id
// order, p itself): p * s mod E in 32 bits (route_spread gives s > 0 only for E <= 65535, so
// p * s < E^2 < 2^32). The decode routing's tile list and the Hopper path's CUTLASS groups run
// the experts in this order.
__host__ __device__ __forceinline__ int spread_expert(int p, int E, int s) {
    return s > 0 ? (int)((unsigned)p * (unsigned)s % (unsigned)E) : p;
}

// Exclusive sums over the E experts, in chunks of NT, of their rows (s_cnt) and of their BM-row
// tiles: s_row0[e] (first sorted row), s_toff[e] (first tile; s_toff[E] = all tiles) and the
// placement cursor s_cur[e] = s_row0[e] (kAddCursor: s_cur[e] += s_row0[e], the rows of e that
// other blocks place first already in it). meta ([0] tiles, [1] valid rows) and expert_off
// (E + 1 entries) are written where not NULL. Returns the tile count (in every thread); ends
// with __syncthreads.
template <int NT, bool kAddCursor>
__device__ __forceinline__ int route_prefix(typename cub::BlockScan<int, NT>::TempStorage& scan_tmp,
                                            int E, int BM, const int* s_cnt, int* s_row0, int* s_cur,
                                            int* s_toff, int* __restrict__ meta,
                                            int* __restrict__ expert_off, int spread = 0) {
    using Scan = cub::BlockScan<int, NT>;
    const int tid = threadIdx.x;
    int row_carry = 0, tile_carry = 0;
    for (int base = 0; base < E; base += NT) {
        const int e = base + tid;
        const int c = (e < E) ? s_cnt[e] : 0;
        // spread > 0: s_toff in the experts' spread order (position e holds expert
        // spread_expert(e)), the rows in id order
        const int ct = e < E ? s_cnt[spread_expert(e, E, spread)] : 0;
        const int nt = (ct + BM - 1) / BM;
        int rex, ragg, tex, tagg;
        Scan(scan_tmp).ExclusiveSum(c, rex, ragg);
        __syncthreads();  // scan_tmp reused
        Scan(scan_tmp).ExclusiveSum(nt, tex, tagg);
        __syncthreads();
        if (e < E) {
            s_row0[e] = row_carry + rex;
            if constexpr (kAddCursor) s_cur[e] += row_carry + rex;
            else s_cur[e] = row_carry + rex;
            s_toff[e] = tile_carry + tex;
            if (expert_off != nullptr) expert_off[e] = row_carry + rex;
        }
        row_carry += ragg;  // the aggregates reach every thread
        tile_carry += tagg;
    }
    if (tid == 0) {
        s_toff[E] = tile_carry;
        if (meta != nullptr) {
            meta[0] = tile_carry;
            meta[1] = row_carry;
        }
        if (expert_off != nullptr) expert_off[E] = row_carry;
    }
    __syncthreads();
    return tile_carry;
}

// Tile list entries i = i0, i0 + stride, ... below n_tiles: {e, first row, end row, first tile of
// e}, tile i belonging to the largest e with s_toff[e] <= i (necessarily non-empty; its tiles are
// s_toff[e] .. s_toff[e] + ceil(rows / BM) - 1, which the expert-major order of GemmParams::ready reads)
// spread > 0 (route_spread): s_toff is indexed by position p in the experts' spread order, expert
// spread_expert(p), and tile i belongs to the expert at the largest such p.
__device__ __forceinline__ void route_tiles(long long i0, long long stride, int n_tiles, int E,
                                            int BM, const int* s_toff, const int* s_row0,
                                            const int* s_cnt, int4* __restrict__ tiles,
                                            int spread = 0) {
    for (long long i = i0; i < n_tiles; i += stride) {
        int lo = 0, hi = E - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (s_toff[mid] <= i) lo = mid;
            else hi = mid - 1;
        }
        const int e = spread_expert(lo, E, spread);
        const int r0 = s_row0[e] + ((int)i - s_toff[lo]) * BM;
        tiles[i] = make_int4(e, r0, s_row0[e] + s_cnt[e], s_toff[lo]);
    }
}

// Slot s of local expert l >= 0 takes the next sorted row of its expert
__device__ __forceinline__ void route_place_one(int l, long long s, int* s_cur,
                                                int* __restrict__ sorted_slots,
                                                int* __restrict__ slot_pos) {
    const int pos = atomicAdd(&s_cur[l], 1);
    sorted_slots[pos] = (int)s;
    if (slot_pos != nullptr) slot_pos[s] = pos;
}

// Places slots s_first, s_first + NT, ... below hi (s_first: this thread's first; the order inside
// an expert is arbitrary: every row is computed independently, so the outputs do not depend on it)
template <int NT, int U>
__device__ __forceinline__ void route_place(const int* __restrict__ topk_ids, const ExpertMap& em,
                                            int E, long long s_first, long long hi, int* s_cur,
                                            int* __restrict__ sorted_slots,
                                            int* __restrict__ slot_pos) {
    for (long long s0 = s_first; s0 < hi; s0 += (long long)NT * U) {
        int ev[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const long long s = s0 + (long long)u * NT;
            ev[u] = (s < hi) ? __ldg(topk_ids + s) : -1;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const long long s = s0 + (long long)u * NT;
            int unused = 0;
            const int l = (s < hi) ? local_expert(em, ev[u], E, unused) : -1;
            if (l >= 0) route_place_one(l, s, s_cur, sorted_slots, slot_pos);
        }
    }
}

// ------------------------------------------------------------------------------------------
// Kernel 1: routing. One block. Dynamic smem: 4*E + 1 ints.
//   cnt[e]   rows of expert e           row0[e]  exclusive prefix of cnt (first sorted row)
//   cur[e]   placement cursor           toff[e]  exclusive prefix of ceil(cnt/BM), toff[E]=total
// ------------------------------------------------------------------------------------------

template <int kRouteThreads>
__global__ void __launch_bounds__(kRouteThreads)
moe_route_kernel(const int* __restrict__ topk_ids, const ExpertMap em, int TK, int E, int BM,
                 int* __restrict__ status,        // workspace byte 0
                 int* __restrict__ meta,          // [0] tiles, [1] valid rows
                 int4* __restrict__ tiles,        // {e, first row, end row, e's first tile}
                 int* __restrict__ sorted_slots,  // (T*K,) slot of each sorted row
                 int* __restrict__ expert_off,    // optional (E+1,): first sorted row of each
                                                  // expert, [E] = valid rows (NULL: not written)
                 int* __restrict__ slot_pos,      // optional (T*K,): sorted row of each placed
                                                  // slot (the inverse of sorted_slots; NULL: not
                                                  // written; a slot not placed keeps its old value)
                 int* __restrict__ ready = nullptr,  // optional (n_ready,): GEMM1's per-tile
                 int n_ready = 0,                 // counters (EX_MOE_DECODE_CONFIG=new), zeroed
                 int spread = 0)                  // > 0: the tile list in the experts' spread
                                                  // order (route_spread), not their id order
{
    using Scan = cub::BlockScan<int, kRouteThreads>;
    __shared__ typename Scan::TempStorage scan_tmp;
    extern __shared__ int route_smem[];
    int* s_cnt = route_smem;
    int* s_row0 = s_cnt + E;
    int* s_cur = s_row0 + E;
    int* s_toff = s_cur + E;  // E + 1 entries

    const int tid = threadIdx.x;
    pdl_wait();               // launched with PDL: the previous kernel (topk_softmax, say) is done
    pdl_launch_dependents();  // GEMM1 blocks may get resident; they wait for this grid's end
    for (int e = tid; e < E; e += kRouteThreads) s_cnt[e] = 0;
    for (int i = tid; i < n_ready; i += kRouteThreads) ready[i] = 0;  // read after GEMM1's wait
    __syncthreads();

    // 1. histogram; four independent loads in flight per thread
    constexpr int U = 4;
    int bad = 0;
    route_count<kRouteThreads, U>(topk_ids, em, E, 0, TK, s_cnt, bad);
    if (bad) atomicOr(status, bad);  // rare (bad input): one atomic per thread that saw it
    __syncthreads();                 // the histogram is complete

    // 2. exclusive sums of rows and tiles per expert; meta and expert_off
    const int n_tiles = route_prefix<kRouteThreads, false>(scan_tmp, E, BM, s_cnt, s_row0, s_cur,
                                                           s_toff, meta, expert_off, spread);

    // 3. tile list
    route_tiles(tid, kRouteThreads, n_tiles, E, BM, s_toff, s_row0, s_cnt, tiles, spread);

    // 4. placement
    route_place<kRouteThreads, U>(topk_ids, em, E, tid, TK, s_cur, sorted_slots, slot_pos);
}

// ------------------------------------------------------------------------------------------
// Kernel 1, multi-block (T*K > s_route_mb_slots): two launches over the same B blocks, block b
// owning the contiguous slots [b*S, min((b+1)*S, T*K)) (S, B: route_mb_span/route_mb_blocks,
// functions of T*K only). The outputs are those of moe_route_kernel (the same meta, tiles,
// expert_off; sorted_slots holds the same slots per expert, in another order inside an expert).
//   1a. moe_route_hist_kernel   per-block histogram (smem atomics) -> hist[b][e] (plain stores
//       of every entry: nothing to zero), status bits of invalid ids.
//   1b. moe_route_place_kernel  (programmatic dependent launch: its blocks read their ids while
//       1a runs, then wait) every block reads all of hist: tot[e] = sum over blocks, pre[e] = sum
//       over the blocks before it; the exclusive sums over experts as moe_route_kernel (each
//       block computes them, no third launch), cursor[e] = row0[e] + pre[e]; block 0 writes meta
//       and expert_off, the blocks share the tile list (grid-stride), each places its own slots.
// ------------------------------------------------------------------------------------------

constexpr int kRouteMbThreads = 512;         // threads of both multi-block routing kernels
constexpr int kRouteMbUnroll = 4;            // slots per thread per pass (independent loads)
constexpr int kRouteMbSlotsPerBlock = kRouteMbThreads * kRouteMbUnroll;  // 2048: one pass
constexpr int kRouteMbMaxBlocks = 64;        // beyond 64 * 2048 slots, blocks take more passes
constexpr int64_t kRouteMbMaxExperts = 16384;  // more local experts: the single-block launch
                                               // (whose smem check declines them anyway)
constexpr int64_t kRouteHistOffset = 256;    // hist's byte offset in both workspace layouts

template <int NT>
__global__ void __launch_bounds__(NT)
moe_route_hist_kernel(const int* __restrict__ topk_ids, const ExpertMap em, int TK, int E, int S,
                      int* __restrict__ status,  // workspace byte 0
                      int* __restrict__ hist)    // (B, E): rows of expert e among block b's slots
{
    extern __shared__ int route_smem[];
    int* s_cnt = route_smem;  // E entries
    const int tid = threadIdx.x;
    pdl_wait();  // launched with PDL: the previous kernel (topk_softmax, say) is done
    // the placement launch's blocks may get resident now: they read their ids (final: this grid
    // has waited for their writer), then wait for this grid's end before they read hist
    pdl_launch_dependents();
    for (int e = tid; e < E; e += NT) s_cnt[e] = 0;
    __syncthreads();

    const long long lo = (long long)blockIdx.x * S;
    const long long hi = lo + S < TK ? lo + S : TK;
    int bad = 0;
    route_count<NT, kRouteMbUnroll>(topk_ids, em, E, lo, hi, s_cnt, bad);
    if (bad) atomicOr(status, bad);
    __syncthreads();
    int* row = hist + (long long)blockIdx.x * E;
    for (int e = tid; e < E; e += NT) row[e] = s_cnt[e];
}

template <int NT>
__global__ void __launch_bounds__(NT)
moe_route_place_kernel(const int* __restrict__ topk_ids, const ExpertMap em, int TK, int E, int BM,
                       int S,
                       const int* __restrict__ hist,    // (gridDim.x, E), from moe_route_hist_kernel
                       int* __restrict__ meta, int4* __restrict__ tiles,
                       int* __restrict__ sorted_slots, int* __restrict__ expert_off,
                       int* __restrict__ slot_pos)  // optional, as moe_route_kernel's
{
    using Scan = cub::BlockScan<int, NT>;
    __shared__ typename Scan::TempStorage scan_tmp;
    extern __shared__ int route_smem[];
    int* s_cnt = route_smem;      // rows of expert e over all blocks
    int* s_row0 = s_cnt + E;      // first sorted row of expert e
    int* s_cur = s_row0 + E;      // pre[e] (rows of e in the blocks before this one), then cursor
    int* s_toff = s_cur + E;      // E + 1 entries: first tile of expert e

    const int tid = threadIdx.x;
    const int b = blockIdx.x, B = gridDim.x;
    pdl_launch_dependents();  // GEMM1 blocks may get resident; they wait for this grid's end
    for (int e = tid; e < E; e += NT) {
        s_cnt[e] = 0;
        s_cur[e] = 0;
    }

    // this block's first pass of slots, before the wait: topk_ids and the expert map are inputs,
    // final once the histogram launch has passed its own griddepcontrol.wait, and this grid
    // launches only once every block of that one has passed it (its launch_dependents follows)
    const long long lo = (long long)b * S;
    const long long hi = lo + S < TK ? lo + S : TK;
    constexpr int U = kRouteMbUnroll;
    int first[U];
    {
        int ev[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const long long s = lo + tid + (long long)u * NT;
            ev[u] = (s < hi) ? __ldg(topk_ids + s) : -1;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int unused = 0;
            first[u] = (lo + tid + (long long)u * NT < hi) ? local_expert(em, ev[u], E, unused) : -1;
        }
    }
    __syncthreads();  // counters zeroed
    pdl_wait();       // hist is the previous grid's output

    // 1. totals and prefix over blocks: every (block, expert) entry once, 8 loads in flight
    //    (L2 only: written by the previous grid)
    const int n = B * E;
    for (int i0 = tid; i0 < n; i0 += NT * 8) {
        int h[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int i = i0 + u * NT;
            h[u] = (i < n) ? __ldcg(hist + i) : 0;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int i = i0 + u * NT;
            if (i < n && h[u] != 0) {
                const int e = i % E;
                atomicAdd(&s_cnt[e], h[u]);
                if (i / E < b) atomicAdd(&s_cur[e], h[u]);
            }
        }
    }
    __syncthreads();

    // 2. exclusive sums of rows and tiles per expert (as moe_route_kernel; in every block), the
    //    cursor row0[e] + pre[e]; block 0 writes meta and expert_off
    const int n_tiles = route_prefix<NT, true>(scan_tmp, E, BM, s_cnt, s_row0, s_cur, s_toff,
                                               b == 0 ? meta : nullptr, b == 0 ? expert_off : nullptr);

    // 3. tile list, shared by the blocks
    route_tiles((long long)b * NT + tid, (long long)B * NT, n_tiles, E, BM, s_toff, s_row0, s_cnt,
                tiles);

    // 4. placement of this block's slots: the first pass from registers, then the others
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (first[u] >= 0) route_place_one(first[u], lo + tid + (long long)u * NT, s_cur, sorted_slots, slot_pos);
    route_place<NT, U>(topk_ids, em, E, lo + tid + (long long)NT * U, hi, s_cur, sorted_slots, slot_pos);
}

// ------------------------------------------------------------------------------------------
// Kernels 2 and 3: grouped GEMM over the tile list.
//   GATED (GEMM1): C[r, n] = silu(A[r] . w13[e][n]) * (A[r] . w13[e][I+n]),
//                  A[r] = hidden_states[sorted_slots[r] / K], N = I, Kd = H, C = act (sorted).
//   !GATED (GEMM2): y[z][slot(r), n] = topk_weights[slot(r)] * (act[r] . w2[e][n]) over the
//                  z-th range of k-tiles, N = H, Kd = I.
// Smem tiles are [rows][BK=64] with the 16-byte chunk index XOR-swizzled by (row & 7), so both
// the cp.async stores and the ldmatrix reads (8 rows, same logical chunk) are conflict-free.
// ------------------------------------------------------------------------------------------

struct GemmParams {
    const void* a;             // GATED: hidden_states (T, H); else act (T*K, I)
    const void* b;             // GATED: w13 (E, 2I, H);       else w2 (E, H, I)
    void* c;                   // GATED: act (T*K, I);         else y (S, T*K, H)
    const int* sorted_slots;   // (T*K,)
    const int4* tiles;         // tile list
    const int* meta;           // meta[0] = number of tiles
    const float* topk_weights; // (T*K,)
    int N;                     // output columns: I (GATED) or H
    int Kd;                    // reduction length: H (GATED) or I
    int topk;                  // K
    int n_tiles_n;             // ceil(N / BN)
    int kt_per_split;          // k-tiles per grid-z slice
    long long split_stride;    // elements between y slices: T*K*H
    int m_tiles;               // > 0: block order M-tile fastest (blockIdx.x = ntile * m_tiles +
                               // tile), so the M-tiles of one expert read the same weight rows
                               // at the same time (L2 hits); 0: N-tile fastest
    // Fused routing (BM = 16 configs, T*K <= kFusedRouteSlots): route_ids != nullptr means
    // there was no routing launch: each block routes the T*K slots itself in one warp. GEMM1's
    // block 0 writes meta, tiles, sorted_slots (w_*) and the status bits (for a GEMM2 that does
    // not route itself). A GEMM2 that routes itself reads topk_ids and w2 before its
    // griddepcontrol.wait: GEMM1 waited for every earlier kernel before it let GEMM2 launch,
    // so those inputs are final; only act (GEMM1's output) is read after the wait.
    const int* route_ids;      // topk_ids (T*K,)
    ExpertMap em;
    int E;                     // local experts
    int TK;
    int* status;
    int* w_meta;
    int4* w_tiles;
    int* w_sorted;
    int early;                 // 1: launch_dependents right after the wait (the next grid's blocks
                               // take the SM slots this grid leaves free and prefetch; they become
                               // resident only once this grid's last blocks have started, so they
                               // never delay its blocks)
    void* cluster_out;         // GEMM2 at T = 1 (cluster combine, see cluster_combine): out (1, H);
                               // launched in clusters of the m_tiles blocks of one N-tile, whose
                               // rank 0 sums their rows in the combine's order; no y, no combine
    int pre_ws;                // GEMM2 (EX_MOE_DECODE_CONFIG=new): the routing launch wrote meta,
                               // tiles and sorted_slots before GEMM1 started, so they are final:
                               // read them (through L2) and stream the first weight stages before
                               // the wait, as a GEMM2 that routes itself does
    int* ready;                // EX_MOE_DECODE_CONFIG=new (with pre_ws): per-tile counters, zeroed
                               // by the routing launch: GEMM1's block adds 1 to its tile's once its
                               // act columns are stored; GEMM2's blocks wait for ready_target there
                               // instead of for GEMM1's whole grid (griddepcontrol.wait).
                               // Set (both GEMMs; m_tiles == 0, a routing launch's tiles), it also
                               // orders the blocks expert by expert ("expert-major"): by expert,
                               // then N-tile, then the expert's M-tiles: the blocks of an expert
                               // are those of N-tile-fastest order (its tiles complete in turn, for
                               // the ready waits), and its M-tiles of one N-tile run side by side
                               // (one read of those weight rows, the rest L2 hits: a hot expert of
                               // many tiles)
    int ready_target;          // GEMM2: GEMM1's N-tiles per tile
};

constexpr int kFusedRouteSlots = 32;  // one warp routes them with ballots and shuffles

// An int read with acquire semantics at GPU scope (the reads after it see the writes that came
// before the release it reads from: GEMM1's act before its atomicAdd, after its fence)
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Routing of at most 32 slots by one warp (lane = slot), the same result as moe_route_kernel
// up to the order of slots inside an expert (here: by slot index): s_sorted[r] = slot of sorted
// row r, s_tiles[i] = {expert, first row, end row, 0}; returns the tile count in every lane,
// the valid row count in *n_rows. bad: the status bits of the lane's slot.
template <int BM>
__device__ __forceinline__ int warp_route(const GemmParams& p, int lane, int* s_e, int* s_sorted,
                                          int4* s_tiles, int* n_rows, int& bad) {
    constexpr unsigned kAll = 0xffffffffu;
    const int l = lane < p.TK ? local_expert(p.em, __ldg(p.route_ids + lane), p.E, bad) : -1;
    int rank = 0;  // position of (l, lane) among the valid slots, ordered by expert then slot
    for (int j = 0; j < p.TK; ++j) {  // lanes >= T*K hold no slot (l = -1)
        const int lj = __shfl_sync(kAll, l, j);
        rank += (lj >= 0 && (lj < l || (lj == l && j < lane))) ? 1 : 0;
    }
    const int nvalid = __popc(__ballot_sync(kAll, l >= 0));
    if (l >= 0) {
        s_e[rank] = l;
        s_sorted[rank] = lane;
    }
    __syncwarp();
    const bool in = lane < nvalid;  // lane = sorted row from here on
    const int er = in ? s_e[lane] : -1;
    const unsigned estart = __ballot_sync(kAll, in && (lane == 0 || s_e[lane - 1] != er));
    const unsigned upto = kAll >> (31 - lane);  // bits 0..lane
    const int first = in ? 31 - __clz(estart & upto) : 0;
    const bool tstart = in && ((lane - first) % BM == 0);
    const unsigned tmask = __ballot_sync(kAll, tstart);
    if (tstart) {
        const unsigned later = estart & ~upto;  // expert starts after this row
        const int eend = later ? __ffs(later) - 1 : nvalid;
        s_tiles[__popc(tmask & (upto >> 1))] = make_int4(er, lane, min(lane + BM, eend), 0);
    }
    __syncwarp();
    *n_rows = nvalid;
    return __popc(tmask);
}

// The cluster combine of GEMM2 at T = 1 (p.cluster_out): each block of a cluster (the m_tiles
// M-tiles of one N-tile: the token's experts) has put its rows' y = dtype(w * acc) for the
// N-tile's BN columns in shared memory (x_val, BM x BN), their slots (x_slot) and row count
// (x_cnt: 0 for a block without a tile); rank 0 sums, for each column, the rows of slots 0..K-1
// in that order in fp32 from its peers' shared memory (distributed shared memory), as
// moe_combine_kernel sums y (k-major; S = 1), and writes out. The second cluster barrier keeps
// every peer's shared memory alive until rank 0 has read it. sm_90+ only (the host asks for it
// only there).
template <typename T, int BM, int BN, int NT>
__device__ __forceinline__ void cluster_combine(const GemmParams& p, unsigned char* smem, int n0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    namespace cg = cooperative_groups;
    cg::cluster_group cl = cg::this_cluster();
    int* x_cnt = reinterpret_cast<int*>(smem);
    int* x_slot = x_cnt + 1;
    T* x_val = reinterpret_cast<T*>(smem + 128);
    int* where = reinterpret_cast<int*>(smem + 128 + BM * BN * sizeof(T));  // [K]: rank*BM+row, or -1
    cl.sync();   // every block's rows are in its shared memory
    if (cl.block_rank() == 0) {
        const int K = p.topk, cs = (int)cl.num_blocks();
        for (int k = threadIdx.x; k < K; k += NT) where[k] = -1;
        __syncthreads();
        for (int r = threadIdx.x; r < cs; r += NT) {   // each peer's slots, read once
            const int cnt = *cl.map_shared_rank(x_cnt, (unsigned)r);
            const int* sl = cl.map_shared_rank(x_slot, (unsigned)r);
            for (int row = 0; row < cnt; ++row) where[sl[row]] = r * BM + row;
        }
        __syncthreads();
        T* out = static_cast<T*>(p.cluster_out);
        for (int c = threadIdx.x; c < BN; c += NT) {
            const int n = n0 + c;
            if (n >= p.N) continue;
            float acc = 0.0f;
            for (int k = 0; k < K; ++k) {   // slot order: the combine's
                const int w = where[k];
                if (w < 0) continue;   // an invalid id (or another rank's expert): nothing
                const T* v = cl.map_shared_rank(x_val, (unsigned)(w / BM));
                acc += Elem<T>::to_f(v[(w % BM) * BN + c]);
            }
            out[n] = Elem<T>::from_f(acc);
        }
    }
    cl.sync();   // rank 0 has read every peer's shared memory
#endif
}

template <typename T, class C, bool GATED>
__global__ void __launch_bounds__(C::THREADS, C::MINB) moe_gemm_kernel(const GemmParams p) {
    constexpr int BM = C::BM, BK = C::BK, STAGES = C::STAGES, NT = C::THREADS;
    constexpr int BN = GATED ? C::BN1 : C::BN2;
    constexpr int NB = GATED ? 2 : 1;  // B row groups: gate and up
    constexpr int BNB = NB * BN;       // B rows in smem
    constexpr int WARPS_N = C::WARPS_N;
    constexpr int WM = BM / C::WARPS_M, WN = BN / WARPS_N;
    constexpr int MI = WM / 16, NI = WN / 8, NF = NB * NI;
    constexpr int CPR = BK / 8;  // 16-byte chunks per smem row
    constexpr int A_CHUNKS = BM * CPR, B_CHUNKS = BNB * CPR;
    constexpr int A_ITERS = (A_CHUNKS + NT - 1) / NT, B_ITERS = (B_CHUNKS + NT - 1) / NT;
    constexpr int A_STAGE = BM * BK, B_STAGE = BNB * BK;  // elements
    static_assert(BK == 64, "swizzle assumes 8 chunks per row");
    static_assert(BM % (16 * C::WARPS_M) == 0 && BN % (8 * WARPS_N) == 0, "warp tiling");
    static_assert(NT % CPR == 0, "a thread keeps one chunk column");
    static_assert(STAGES >= 2, "pipeline");

    extern __shared__ __align__(128) unsigned char gemm_smem[];
    T* sA = reinterpret_cast<T*>(gemm_smem);
    T* sB = sA + STAGES * A_STAGE;

    const int tid = threadIdx.x;
    // fused routing: scratch at the start of the pipeline's smem, read before the prologue
    int* r_e = reinterpret_cast<int*>(gemm_smem);
    int* r_sorted = r_e + kFusedRouteSlots;
    int4* r_tiles = reinterpret_cast<int4*>(r_sorted + kFusedRouteSlots);
    int* r_count = reinterpret_cast<int*>(r_tiles + kFusedRouteSlots);
    const bool fused = BM == kSmallBM && p.route_ids != nullptr;
    // GEMM2 routing itself: topk_ids and w2 are read before the wait (see GemmParams)
    const bool pre = !GATED && (fused || p.pre_ws);
    if (!pre) {
        pdl_wait();  // before any global access (meta, tiles, A: the previous grids' outputs)
        if (p.early) pdl_launch_dependents();
    }
    const bool m_fast = p.m_tiles > 0;
    int tile = m_fast ? (int)(blockIdx.x % (unsigned)p.m_tiles)
                      : (int)(blockIdx.x / (unsigned)p.n_tiles_n);
    int ntile = m_fast ? (int)(blockIdx.x / (unsigned)p.m_tiles)
                       : (int)(blockIdx.x % (unsigned)p.n_tiles_n);
    int n_tiles;
    if (fused) {
        if (tid < 32) {
            int bad = 0, n_rows;
            const int nt = warp_route<BM>(p, tid, r_e, r_sorted, r_tiles, &n_rows, bad);
            if (tid == 0) r_count[0] = nt;
            if (GATED && blockIdx.x == 0 && blockIdx.z == 0) {  // the routing GEMM2 and combine read
                if (bad) atomicOr(p.status, bad);
                if (tid < nt) p.w_tiles[tid] = r_tiles[tid];
                if (tid < n_rows) p.w_sorted[tid] = r_sorted[tid];
                if (tid == 0) {
                    p.w_meta[0] = nt;
                    p.w_meta[1] = n_rows;
                }
            }
        }
        __syncthreads();
        n_tiles = r_count[0];
    } else {
        n_tiles = __ldcg(p.meta);
    }
    int4 td_first = make_int4(0, 0, 0, 0);  // expert-major: the tile read to place this block
    bool reuse_first = false;                 // ... which is this block's own tile
    if (p.ready != nullptr && tile < n_tiles) {   // expert-major order (see GemmParams::ready)
        const int t0 = tile;
        // blocks [first * NN, (first + c) * NN) are expert e's (NN N-tiles, c = its M-tiles, the
        // same blocks as in N-tile-fastest order): the tile this block had there is e's too
        td_first = __ldcg(p.tiles + tile);
        const int first = td_first.w;
        const int c = (td_first.z - (td_first.y - (tile - first) * BM) + BM - 1) / BM;
        const int local = (int)blockIdx.x - first * p.n_tiles_n;
        ntile = local / c;
        tile = first + local % c;
        reuse_first = tile == t0;
    }
    if (tile >= n_tiles) {  // surplus block: the whole block leaves before any barrier
        // A GEMM2 that routes itself (pre) has not waited yet: where no block of the grid has a
        // tile (every id invalid, or on another rank), every block waits here, so that this
        // grid's end still implies GEMM1's (whose block 0 may still write meta and the status
        // word) for the launches after it, which wait for this grid only
        if (pre && n_tiles == 0) pdl_wait();
        if constexpr (!GATED) {
            if (p.cluster_out != nullptr) {   // but a cluster's barriers count it: no rows
                if (tid == 0) reinterpret_cast<int*>(gemm_smem)[0] = 0;
                cluster_combine<T, BM, BN, NT>(p, gemm_smem, ntile * BN);
            }
        }
        return;
    }
    const int4 td = fused ? r_tiles[tile] : reuse_first ? td_first : __ldcg(p.tiles + tile);
    const int e = td.x, row0 = td.y, row_end = td.z;
    const int n0 = ntile * BN;
    const int KT = (p.Kd + BK - 1) / BK;
    const int kt0 = blockIdx.z * p.kt_per_split;
    const int kt1 = min(KT, kt0 + p.kt_per_split);
    const int nkt = kt1 - kt0;  // >= 1: the host picks the split count so that no slice is empty

    const T* A = static_cast<const T*>(p.a);
    const T* B = static_cast<const T*>(p.b);

    // Row sources of the chunks this thread copies (constant over k); nullptr = zero fill.
    const T* a_src[A_ITERS];
#pragma unroll
    for (int j = 0; j < A_ITERS; ++j) {
        const int idx = tid + j * NT;
        const int r = idx / CPR;
        a_src[j] = nullptr;
        if (idx < A_CHUNKS && row0 + r < row_end) {
            if constexpr (GATED) {
                const int slot = fused ? r_sorted[row0 + r] : p.sorted_slots[row0 + r];
                a_src[j] = A + (long long)(slot / p.topk) * p.Kd;
            } else {
                a_src[j] = A + (long long)(row0 + r) * p.Kd;
            }
        }
    }
    const T* b_src[B_ITERS];
#pragma unroll
    for (int j = 0; j < B_ITERS; ++j) {
        const int idx = tid + j * NT;
        const int r = idx / CPR;
        b_src[j] = nullptr;
        if (idx < B_CHUNKS) {
            const int n = n0 + ((GATED && r >= BN) ? r - BN : r);
            if (n < p.N) {
                // w13[e] rows: gate n, up I + n;  w2[e] rows: n
                const long long grow = (GATED && r >= BN) ? (long long)p.N + n : (long long)n;
                b_src[j] = B + ((long long)e * NB * p.N + grow) * p.Kd;
            }
        }
    }
    const int chunk = tid % CPR;  // the same for every j since NT % CPR == 0

    auto load_a = [&](int slot, int kt) {
        const int col = kt * BK + chunk * 8;
        const bool col_ok = col < p.Kd;  // Kd % 8 == 0: a chunk is all in or all out
        const uint32_t dA = smem_u32(sA + slot * A_STAGE);
#pragma unroll
        for (int j = 0; j < A_ITERS; ++j) {
            const int idx = tid + j * NT;
            if (A_CHUNKS % NT == 0 || idx < A_CHUNKS) {
                const int r = idx / CPR;
                const bool v = col_ok && a_src[j] != nullptr;
                const void* src = v ? static_cast<const void*>(a_src[j] + col) : p.a;
                cp_async16(dA + (uint32_t)(r * BK + ((chunk ^ (r & 7)) << 3)) * 2u, src, v);
            }
        }
    };
    auto load_b = [&](int slot, int kt) {
        const int col = kt * BK + chunk * 8;
        const bool col_ok = col < p.Kd;
        const uint32_t dB = smem_u32(sB + slot * B_STAGE);
#pragma unroll
        for (int j = 0; j < B_ITERS; ++j) {
            const int idx = tid + j * NT;
            if (B_CHUNKS % NT == 0 || idx < B_CHUNKS) {
                const int r = idx / CPR;
                const bool v = col_ok && b_src[j] != nullptr;
                const void* src = v ? static_cast<const void*>(b_src[j] + col) : p.b;
                cp_async16(dB + (uint32_t)(r * BK + ((chunk ^ (r & 7)) << 3)) * 2u, src, v);
            }
        }
    };
    auto load_stage = [&](int slot, int kt) {
        load_a(slot, kt);
        load_b(slot, kt);
    };

    const int warp = tid >> 5, lane = tid & 31;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;

    float acc[MI][NF][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int f = 0; f < NF; ++f)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[mi][f][q] = 0.0f;

    // first smem row of B fragment f (8 rows): gate frags 0..NI-1, then up frags NI..2NI-1
    auto b_frag_row = [&](int f) {
        return (GATED && f >= NI) ? BN + wn * WN + (f - NI) * 8 : wn * WN + f * 8;
    };

    // GEMM2's epilogue rows -> slots, read now (the fused routing's scratch is about to go)
    int ep_slot[GATED ? 1 : MI][2];
    if constexpr (!GATED) {
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int grow = row0 + wm * WM + mi * 16 + (lane >> 2) + h * 8;
                ep_slot[mi][h] = grow < row_end ? (fused ? r_sorted[grow] : __ldcg(p.sorted_slots + grow)) : 0;
            }
    }
    if (fused) __syncthreads();  // routing scratch read by all: the pipeline may reuse it
    // Prologue: STAGES-1 stages in flight. One commit per stage, empty or not, so that
    // wait_group<STAGES-2> below always means "the stage about to be used has landed".
    if (pre) {
        // the weights of the prologue's stages first, before the wait: they join group 0,
        // which every later wait_group covers
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s)
            if (s < nkt) load_b(s, kt0 + s);
        if (p.ready != nullptr) {   // this tile's act only (GEMM1's blocks all started)
            if (tid == 0)
                while (ld_acquire_gpu(p.ready + tile) < p.ready_target) __nanosleep(64);
            __syncthreads();
        } else {
            pdl_wait();  // act is GEMM1's output
        }
        if (p.early) pdl_launch_dependents();
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < nkt) load_a(s, kt0 + s);
            cp_async_commit();
        }
    } else {
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < nkt) load_stage(s, kt0 + s);
            cp_async_commit();
        }
    }

    for (int it = 0; it < nkt; ++it) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // stage it visible to all; stage it-1 fully consumed by all
        {
            const int nxt = it + STAGES - 1;
            if (nxt < nkt) load_stage(nxt % STAGES, kt0 + nxt);  // overwrites stage it-1
            cp_async_commit();
        }
        const int slot = it % STAGES;
        const uint32_t cA = smem_u32(sA + slot * A_STAGE);
        const uint32_t cB = smem_u32(sB + slot * B_STAGE);
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            uint32_t af[MI][4];
            uint32_t bf[NF][2];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
                // matrices: rows 0-7/8-15 x k 0-7/8-15 -> a0, a1, a2, a3
                const int r = wm * WM + mi * 16 + (lane & 15);
                const int c = kk * 2 + (lane >> 4);
                ldmatrix_x4(af[mi][0], af[mi][1], af[mi][2], af[mi][3],
                            cA + (uint32_t)(r * BK + ((c ^ (r & 7)) << 3)) * 2u);
            }
#pragma unroll
            for (int f = 0; f < NF; f += 2) {
                // matrices: frag f k 0-7, frag f k 8-15, frag f+1 k 0-7, frag f+1 k 8-15
                const int c = kk * 2 + ((lane >> 3) & 1);
                if (f + 1 < NF) {
                    const int r = b_frag_row(f + (lane >> 4)) + (lane & 7);
                    ldmatrix_x4(bf[f][0], bf[f][1], bf[f + 1][0], bf[f + 1][1],
                                cB + (uint32_t)(r * BK + ((c ^ (r & 7)) << 3)) * 2u);
                } else {
                    const int r = b_frag_row(f) + (lane & 7);
                    ldmatrix_x2(bf[f][0], bf[f][1],
                                cB + (uint32_t)(r * BK + ((c ^ (r & 7)) << 3)) * 2u);
                }
            }
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int f = 0; f < NF; ++f) mma_16816<T>(acc[mi][f], af[mi], bf[f]);
        }
    }
    cp_async_wait<0>();  // only empty groups can remain; leave nothing in flight
    if (!p.early) pdl_launch_dependents();

    // Epilogue. Accumulator fragment: c0,c1 at (row g, cols 2q, 2q+1), c2,c3 at row g + 8.
    using E2 = typename Elem<T>::T2;
    const int g = lane >> 2, q = lane & 3;
    const bool to_cluster = !GATED && p.cluster_out != nullptr;
    if (to_cluster) {
        __syncthreads();   // every warp is done with the pipeline's shared memory
        if (tid == 0) reinterpret_cast<int*>(gemm_smem)[0] = row_end - row0;
    }
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int grow = row0 + wm * WM + mi * 16 + g + h * 8;
            if (grow >= row_end) continue;
            if constexpr (GATED) {
                T* crow = static_cast<T*>(p.c) + (long long)grow * p.N;
#pragma unroll
                for (int j = 0; j < NI; ++j) {
                    const int n = n0 + wn * WN + j * 8 + 2 * q;  // even; N % 8 == 0
                    if (n < p.N) {
                        const float a0 = silu_f(acc[mi][j][2 * h]) * acc[mi][NI + j][2 * h];
                        const float a1 =
                            silu_f(acc[mi][j][2 * h + 1]) * acc[mi][NI + j][2 * h + 1];
                        *reinterpret_cast<E2*>(crow + n) = Elem<T>::pack(a0, a1);
                    }
                }
            } else if (p.cluster_out != nullptr) {   // the row to shared memory (cluster_combine)
                const int slot = ep_slot[mi][h];
                const float w = p.topk_weights[slot];
                const int lr = grow - row0;
                if (wn == 0 && q == 0) reinterpret_cast<int*>(gemm_smem)[1 + lr] = slot;
                T* xrow = reinterpret_cast<T*>(gemm_smem + 128) + lr * BN;
#pragma unroll
                for (int j = 0; j < NI; ++j) {
                    const int nl = wn * WN + j * 8 + 2 * q;
                    *reinterpret_cast<E2*>(xrow + nl) =
                        Elem<T>::pack(w * acc[mi][j][2 * h], w * acc[mi][j][2 * h + 1]);
                }
            } else {
                const int slot = ep_slot[mi][h];
                const float w = p.topk_weights[slot];
                T* crow = static_cast<T*>(p.c) + (long long)blockIdx.z * p.split_stride +
                          (long long)slot * p.N;
#pragma unroll
                for (int j = 0; j < NI; ++j) {
                    const int n = n0 + wn * WN + j * 8 + 2 * q;
                    if (n < p.N)
                        *reinterpret_cast<E2*>(crow + n) =
                            Elem<T>::pack(w * acc[mi][j][2 * h], w * acc[mi][j][2 * h + 1]);
                }
            }
        }
    }
    if (to_cluster) cluster_combine<T, BM, BN, NT>(p, gemm_smem, n0);
    if (GATED && p.ready != nullptr) {   // this block's act columns of the tile are stored
        __threadfence();
        __syncthreads();
        if (tid == 0) atomicAdd(p.ready + tile, 1);
    }
}

// ------------------------------------------------------------------------------------------
// Kernel 4: combine. out[t, h8*8 .. +8] = sum_k [id valid] sum_z y[z][t*K+k, ...], fp32,
// fixed order (deterministic), one 16-byte store.
// ------------------------------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kSimpleThreads)
moe_combine_kernel(T* __restrict__ out, const T* __restrict__ y, const int* __restrict__ ids,
                   const ExpertMap em, int T_, int H, int E, int K, int S, long long split_stride) {
    using E2 = typename Elem<T>::T2;
    constexpr int R = 8;  // (k, z) terms whose loads are in flight together
    pdl_wait();
    const int HV = H / 8;
    const int n_terms = K * S;  // summed k-major, z-minor (the same order in every chunk size)
    const long long total = (long long)T_ * HV;
    for (long long i = (long long)blockIdx.x * kSimpleThreads + threadIdx.x; i < total;
         i += (long long)gridDim.x * kSimpleThreads) {
        const long long t = i / HV;
        const int hv = (int)(i - t * HV);
        float acc[8];
#pragma unroll
        for (int v = 0; v < 8; ++v) acc[v] = 0.0f;
        // decode has few tokens and many terms (K up to 8+, S up to kMaxSplits): issuing R loads
        // at once instead of one after the other is most of this kernel's latency
        for (int p0 = 0; p0 < n_terms; p0 += R) {
            uint4 raw[R];
            bool use[R];
#pragma unroll
            for (int j = 0; j < R; ++j) {
                const int p = p0 + j;
                use[j] = false;
                if (p < n_terms) {
                    const int k = p / S, z = p - k * S;
                    const long long slot = t * K + k;
                    int unused = 0;
                    if (local_expert(em, __ldg(ids + slot), E, unused) >= 0) {  // else nothing
                        raw[j] = __ldg(reinterpret_cast<const uint4*>(
                            y + slot * H + (long long)hv * 8 + z * split_stride));
                        use[j] = true;
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < R; ++j) {
                if (!use[j]) continue;
                const E2* v2 = reinterpret_cast<const E2*>(&raw[j]);
#pragma unroll
                for (int v = 0; v < 4; ++v) {
                    const float2 f = Elem<T>::unpack(v2[v]);
                    acc[2 * v] += f.x;
                    acc[2 * v + 1] += f.y;
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
// Fallback kernels: any H, I; scalar loads; a warp per dot product; fp32; no atomics on data.
// ------------------------------------------------------------------------------------------

// act[slot, i] = dtype(silu(x[t] . w13[e][i]) * (x[t] . w13[e][I+i])), 0 for an invalid id.
template <typename T>
__global__ void __launch_bounds__(kSimpleThreads)
moe_fallback_act_kernel(T* __restrict__ act, const T* __restrict__ x, const T* __restrict__ w13,
                        const int* __restrict__ ids, const ExpertMap em, int* __restrict__ status,
                        long long TK, int H, int E, int I, int K) {
    const int lane = threadIdx.x & 31;
    const long long n_warps = TK * I;
    const long long stride = ((long long)gridDim.x * kSimpleThreads) >> 5;
    for (long long w = ((long long)blockIdx.x * kSimpleThreads + threadIdx.x) >> 5; w < n_warps;
         w += stride) {
        const long long slot = w / I;
        const int i = (int)(w - slot * I);
        int bad = 0;
        const int e = local_expert(em, __ldg(ids + slot), E, bad);
        float r = 0.0f;
        if (e >= 0) {
            const T* xr = x + (slot / K) * H;
            const T* gr = w13 + ((long long)e * 2 * I + i) * H;
            const T* ur = gr + (long long)I * H;
            float gs = 0.0f, us = 0.0f;
            for (int h = lane; h < H; h += 32) {
                const float xv = Elem<T>::to_f(xr[h]);
                gs += xv * Elem<T>::to_f(gr[h]);
                us += xv * Elem<T>::to_f(ur[h]);
            }
            gs = warp_sum(gs);
            us = warp_sum(us);
            r = silu_f(gs) * us;
        } else if (bad && lane == 0 && i == 0) {
            atomicOr(status, bad);
        }
        if (lane == 0) act[w] = Elem<T>::from_f(r);  // w == slot * I + i
    }
}

// out[t, h] = dtype(sum_k [id valid] topk_weights[t,k] * (w2[e][h] . act[t*K+k])).
template <typename T>
__global__ void __launch_bounds__(kSimpleThreads)
moe_fallback_out_kernel(T* __restrict__ out, const T* __restrict__ act, const T* __restrict__ w2,
                        const float* __restrict__ topk_weights, const int* __restrict__ ids,
                        const ExpertMap em, long long T_, int H, int E, int I, int K) {
    const int lane = threadIdx.x & 31;
    const long long n_warps = T_ * H;
    const long long stride = ((long long)gridDim.x * kSimpleThreads) >> 5;
    for (long long w = ((long long)blockIdx.x * kSimpleThreads + threadIdx.x) >> 5; w < n_warps;
         w += stride) {
        const long long t = w / H;
        const int h = (int)(w - t * H);
        float acc = 0.0f;
        for (int k = 0; k < K; ++k) {
            const long long slot = t * K + k;
            int unused = 0;
            const int e = local_expert(em, __ldg(ids + slot), E, unused);
            if (e < 0) continue;
            const T* wr = w2 + ((long long)e * H + h) * I;
            const T* ar = act + slot * I;
            float d = 0.0f;
            for (int i = lane; i < I; i += 32) d += Elem<T>::to_f(wr[i]) * Elem<T>::to_f(ar[i]);
            acc += __ldg(topk_weights + slot) * warp_sum(d);
        }
        if (lane == 0) out[w] = Elem<T>::from_f(acc);  // w == t * H + h
    }
}

// ------------------------------------------------------------------------------------------
// Host side: state, errors, workspace layout, argument checks
// ------------------------------------------------------------------------------------------

static int s_num_sms = 132;
static int s_smem_optin = 232448;
static bool s_cfg_allowed[CFG_COUNT] = {true, true, true};
static bool s_pdl_ok = false;  // cc >= 9.0: programmatic dependent launch
// ... and the code run has griddepcontrol (explugin::pdl_code_ok: not PTX for compute_80 JIT-
// compiled on a newer GPU, where pdl_wait is compiled out)
static bool pdl_ok() { return s_pdl_ok && explugin::pdl_code_ok(); }
// cc >= 9.0 and EX_MOE_CLUSTER_COMBINE not 0 (read at load): GEMM2 at T = 1 sums the token's
// rows in clusters (cluster_combine) instead of a combine launch
static bool s_cluster_combine = false;
// ... where GEMM2's grid holds at most this many blocks per SM. H200, ab_moe, one process, two
// runs (benchmarks/RESULTS.md, session 33): granite T = 1 (384 blocks) 17.8 -> 16.9 and 17.2 ->
// 16.6 us, deepseek (384) 32.0 -> 31.7, mixtral and phi-3.5 (K = 2) within 0.6%; but qwen3-30b
// and olmoe (512 blocks) 26.3 -> 29.0 and 31.5 -> 34.8, qwen3-235b (512 of decode4) 78.9 -> 89.0:
// a cluster's blocks must be resident on one GPC together, and where GEMM2 needs (nearly) every
// slot GEMM1's tail frees, its clusters start later (inferred, not measured).
constexpr int kClusterCombineBlocksPerSm = 3;
// Whether CfgDecode4 fits a block and its MINB blocks are resident on one SM (its shared memory,
// with the 1 KB the runtime reserves per block, and its threads): the kernel chooses it only then
// (an A100's 164 KB per SM holds three, and decode4 would be decode with a stage less)
static bool s_decode4_resident = false;
static int64_t s_l2_bytes = 50LL << 20;
// Routing of more than this many slots (T*K) takes the multi-block launches (kernel 1,
// multi-block), fewer the single-block moe_route_kernel. moe_portable_init sets it from
// EX_MOE_ROUTE_MULTIBLOCK_SLOTS (decimal >= 0; 0: multi-block whenever a routing launch runs).
// 2048 (was 8192 until 2026-12-01): on the H200 the multi-block routing was faster at 8192 slots
// (qwen3-30b T = 1024: 374.6 -> 368.7 us a call, olmoe T = 1024: 317.6 -> 313.4) and no slower
// at 2048-4096 (within 0.6%, ab_route_h200_2026-12-01.json).
constexpr int64_t kRouteMultiBlockSlots = 2048;
static int64_t s_route_mb_slots = kRouteMultiBlockSlots;
// Diagnostic knock-out, compiled only with -DEX_MOE_DIAG (never in a shipped build): a bit mask
// read from EX_MOE_DIAG_SKIP at load, of stages not run: 1 the Hopper path's gather after the
// first call on a workspace and dims (its launch stays, one block that writes the group arrays
// and copies no rows: GEMM1 reads the first call's rows, which GEMM2 leaves, writing ys to a
// buffer of its own in such a build's larger workspace), 2 the combine (both paths), 4 the chunked
// GEMM2's wait for GEMM1 before it copies A (moe_chunked_sm90.cuh; it waits at its end). The output
// is then wrong (benchmarks/ab_moe.py --unchecked times such a build): the time bounds what
// folding that stage into a neighbour could save in a call (benchmarks/RESULTS.md, session 31).
#if defined(EX_MOE_DIAG)
static int s_diag_skip = 0;
#else
constexpr int s_diag_skip = 0;
#endif

// Decode choices, read per call from EX_MOE_DECODE_CONFIG (so one process can compare them):
//   old    the previous choices: CfgDecode for T*K/E <= 24, N-tile-fastest block order, plain
//          launches
//   nopdl  new tiling: CfgTiny when its grid fits in one wave, M-tile-fastest block order for
//          the BM <= 48 configs; plain launches
//   late   nopdl's tiling, and GEMM1, GEMM2, combine launched with programmatic dependent
//          launch on sm_90+ (each lets the next launch after its main loop, and waits for the
//          previous one before touching memory); GEMM2 reads the routing GEMM1 wrote
//   onewave  late, and with T*K <= 32 on a BM=16 config: a grid that fits in one wave lets the
//          next one launch as soon as it has waited, and GEMM2 routes itself and streams its
//          first weight stages before it waits for GEMM1 (so w2's bytes flow while GEMM1's tail
//          runs) (the default until 2026-12-01, session nine)
//   new    (default, anything else) onewave, and every config's GEMM1 and GEMM2 let the next
//          grid launch as soon as they have waited, whatever their wave count (the next grid's
//          blocks become resident only once this grid's last blocks have started, so they
//          take the slots its last wave leaves free); GEMM2 streams its first weight stages
//          before its wait also after a routing launch (T*K > 32: meta, tiles and sorted_slots
//          were final before GEMM1 started; read through L2) or routes itself (T*K <= 32).
//          H200, 2026-12-01, shipped plugin: 0.1-4.5% faster than onewave on 15 of 18 rows at
//          T = 1..512 (qwen3-30b T = 8 127.7 -> 124.4 us, granite T = 8 53.8 -> 51.3), 0.4-1.0%
//          slower on qwen3-30b T = 1 and 256 and granite T = 1 (ab_decode_wide_h200_2026-12-01.json)
//          And after a routing launch (T*K > 32, single-block routing) GEMM2's blocks wait for
//          their own tile's act, not for GEMM1's whole grid: per-tile counters in the workspace,
//          zeroed by the routing, to which each GEMM1 block adds 1 once its act columns are stored
//          (fence, then atomicAdd; GEMM2 reads them with ld.acquire). Both GEMMs then run their
//          blocks expert by expert (GemmParams::ready: an expert's N-tiles in turn, its
//          M-tiles of one N-tile side by side), so that tiles complete in turn and GEMM2's blocks
//          of the first tiles stream their weights during GEMM1's last wave. (Plain N-tile-fastest
//          order, e322d0e, read a hot expert's weight rows once per M-tile: under skewed routing
//          on an H100 phi-3.5 T = 64 895.8 against gridwait's 840.1 us, qwen3-30b T = 128 412.1
//          against 386.0, ab_skew_tile_waits_h100_2026-12-06.json. Expert by expert, H100, 6 rounds,
//          ab_expert_major_h100_2026-12-06.json, new / N-tile fastest / gridwait: skewed phi-3.5
//          T = 64 820.4 / 870.0 / 841.0, mixtral T = 32 949.4 / 1015.5 / 966.7, 1.3-1.7% faster
//          than both on three more skewed rows (granite's tied), but qwen3-30b T = 128 405.2 /
//          413.4 / 388.4; on six
//          uniform rows equal to N-tile fastest (phi-3.5 T = 64 1.8% faster), 1.6-3.1% ahead of
//          gridwait.) The routing lists the experts' tiles in a spread order (route_spread:
//          experts of neighbouring ids far apart), so that hot experts with neighbouring ids do
//          not fill a wave with blocks that share few weight streams. H100, ab_moe 6 rounds,
//          against the id order (ab_spread_scan_h100_2026-12-06.json): skewed qwen3-30b T = 128
//          414.4 -> 388.0 us, five more skewed rows 0.2-1.0% faster (mixtral T = 32 0.1%
//          slower), nine uniform rows from 0.3% faster (granite T = 64) to 0.35% slower (olmoe
//          T = 64 278.3 -> 279.3). No deadlock: GEMM2's blocks
//          launch only once every GEMM1 block has started (it lets them launch after its own
//          wait). H100, ab_moe 6 rounds each (ab_decode_tile_waits_h100_2026-12-06.json): 0-3.9%
//          faster on 20 rows of T = 8..128, faster in every round on 18 (granite T = 8 66.8 ->
//          64.2 us, deepseek T = 64 389.9 -> 375.5, qwen3-30b T = 8 173.2 -> 169.3), bit-identical
//   unfused  late's launches with the separate routing launch (and no fused routing anywhere)
//   gridwait  new without those per-tile waits (GEMM2 waits for GEMM1's whole grid; M-tile-fastest
//          order while the A tiles fit a quarter of L2), for comparison
enum { MODE_OLD = 0, MODE_NOPDL = 1, MODE_NEW = 2, MODE_UNFUSED = 3, MODE_LATE = 4, MODE_ONEWAVE = 5, MODE_GRIDWAIT = 6 };
static int decode_mode() {
    static const char* const kNames[] = {"old", "nopdl", "new", "unfused", "late", "onewave", "gridwait"};  // MODE_* order
    return explugin::env_choice("EX_MOE_DECODE_CONFIG", kNames, 7, MODE_NEW);
}

// A launch, with the programmatic-stream-serialization attribute when pdl is set (ex_plugin.cuh).
template <typename... KArgs, typename... Args>
static cudaError_t launch_k(void (*kern)(KArgs...), dim3 grid, dim3 block, size_t smem,
                            cudaStream_t stream, bool pdl, Args... args) {
    return explugin::launch_kernel(kern, grid, block, smem, stream, pdl, args...);
}

// the last-error text is ex_plugin.cuh's (ex_factor_t.last_error = explugin::last_error)
static int set_error(int status, const char* msg) {
    return explugin::fail(static_cast<ex_status_t>(status), "%s", msg);
}
static int cuda_error(cudaError_t err) {
    return explugin::fail(EX_ERR_CUDA, "%s: %s", cudaGetErrorName(err), cudaGetErrorString(err));
}

static int64_t align256(int64_t v) { return (v + 255) & ~(int64_t)255; }

// Blocks of a grid-stride launch: enough for `items` at `per_block` each, at most `per_sm` blocks
// on each SM, at least 1.
static unsigned capped_blocks(int64_t items, int64_t per_block, int64_t per_sm) {
    int64_t blocks = (items + per_block - 1) / per_block;
    const int64_t cap = (int64_t)s_num_sms * per_sm;
    if (blocks > cap) blocks = cap;
    return blocks < 1 ? 1u : (unsigned)blocks;
}

struct Problem {
    int64_t T, H, E, I, K, dtype;
    int64_t G;                 // global experts (dims[6]; E when absent)
    int64_t config;            // dims[7], tile configuration: -1 (absent) = chosen here from
                               // T*K/G; 0 tiny, 1 decode, 2 mid, 3 prefill, 4 Hopper grouped GEMM,
                               // 5 mid32, 6 mid48, 7 Hopper grouped GEMM on 64-row tiles,
                               // 8 Hopper grouped GEMMs on 128 x 128 tiles, 9 decode4,
                               // 10 Hopper GEMMs on chunks of up to 256 of an expert's rows,
                               // 11 the same without the multicast of A (chunked_nomc),
                               // 12 chunked on 256-row chunks, the last of an expert's
                               // taking up to 32 rows more (chunked_tail)
                               // (kTileConfig*; the registry passes tuned values,
                               // manifests/tuning; below -1: read_dims rejects the call; above
                               // kTileConfigMax, a later plugin's value: read as -1)
    int64_t TK;
    const int* expert_map;     // aux[6]: (G,) int32 global -> local id or -1; nullptr: none
    ExpertMap em() const { return ExpertMap{expert_map, (int)G}; }
};

constexpr int64_t kMaxHI = int64_t(1) << 24;   // the largest H and I a call may have

// Reads dims {T, H, E, I, K, dtype[, G]} into *P and checks their ranges. Returns false if the
// kernel must reject them (the message is in msg).
static bool read_dims(const int64_t dims[], int n_dims, Problem* P, char* msg, size_t n) {
    P->T = dims[0]; P->H = dims[1]; P->E = dims[2]; P->I = dims[3]; P->K = dims[4];
    P->dtype = dims[5];
    P->G = n_dims >= 7 ? dims[6] : P->E;
    P->config = n_dims >= 8 ? dims[7] : -1;
    P->expert_map = nullptr;
    const int64_t lim = 0x7fffffff;
    // H, I <= 2^24 (kMaxHI, as the manifest's constraints): the kernels count columns, k-tiles
    // and 2I in int32 (a fallback's loop over H, ceil(I / BK), CUTLASS's N = 2I); near 2^31
    // those wrapped (H or I within 63 of it: GEMM2 never ran, out all zero; a static review,
    // session 33). Real layers have H, I < 2^17. T, E and G are at most 2^31 - 1 (int32 in the
    // kernels; the manifest refuses E and G past it by name): the message says so, since a G of
    // 2^31 (an 8 GiB expert_map) was refused as "expected ... E, G >= 1", which it was (session 39)
    if (P->T < 0 || P->H < 1 || P->E < 1 || P->I < 1 || P->K < 1 || P->G < 1 || P->K > P->G ||
        P->T > lim || P->H > kMaxHI || P->E > lim || P->I > kMaxHI || P->G > lim) {
        snprintf(msg, n,
                 "moe_fused_gemm: expected 0 <= T <= %lld, 1 <= H, I <= %lld, 1 <= E, G <= %lld, 1 <= K <= G; "
                 "got T=%lld H=%lld E=%lld I=%lld K=%lld G=%lld",
                 (long long)lim, (long long)kMaxHI, (long long)lim, (long long)P->T, (long long)P->H,
                 (long long)P->E, (long long)P->I, (long long)P->K, (long long)P->G);
        return false;
    }
    P->TK = P->T * P->K;
    if (P->TK > lim - 4096) {
        snprintf(msg, n, "moe_fused_gemm: expected T*K < 2^31 - 4096, got %lld", (long long)P->TK);
        return false;
    }
    if (P->config < kTileConfigAuto) {
        snprintf(msg, n, "moe_fused_gemm: expected config (dims[7]) >= -1, got %lld",
                 (long long)P->config);
        return false;
    }
    // a configuration newer than this build (tuning data written for a later plugin): a launch
    // hint, not part of the math, so this build chooses its own instead of refusing the call
    if (P->config > kTileConfigMax) P->config = kTileConfigAuto;
    return true;
}

struct WsLayout {
    int64_t route, meta, tiles, ready, sorted, act, y, total;
    int split_cap;
};

// Multi-block routing: slots per block (S) and blocks (B), functions of T*K only.
static int64_t route_mb_span(int64_t TK) {
    const int64_t per_block = (TK + kRouteMbMaxBlocks - 1) / kRouteMbMaxBlocks;
    return per_block > kRouteMbSlotsPerBlock ? per_block : kRouteMbSlotsPerBlock;
}
static int64_t route_mb_blocks(int64_t TK) {
    const int64_t S = route_mb_span(TK);
    const int64_t B = (TK + S - 1) / S;
    return B < 1 ? 1 : B;
}
// Bytes of the multi-block routing's hist (B, E) int32 section, at byte kRouteHistOffset of the
// workspace in both layouts (ws_layout, and sm90_layout in moe_fused_gemm_sm90.cu): reserved
// for every T*K (a function of dims, whatever the environment picks), at most 64 * E * 4 bytes.
static int64_t route_hist_bytes(const Problem& P) {
    const int64_t E = P.E < kRouteMbMaxExperts ? P.E : kRouteMbMaxExperts;
    return align256(route_mb_blocks(P.TK) * E * 4);
}

static int64_t max_tiles_for(int64_t TK, int64_t E, int64_t BM) {
    // sum_e ceil(n_e / BM) <= floor(TK / BM) + (number of non-empty experts), and <= TK
    const int64_t nonempty = E < TK ? E : TK;
    const int64_t bound = TK / BM + nonempty;
    return bound < TK ? bound : TK;
}

static WsLayout ws_layout(const Problem& P) {
    WsLayout L;
    int64_t off = 256;  // [0, 256): status word
    L.route = off;      // = kRouteHistOffset: launch_route finds it there
    off += route_hist_bytes(P);
    L.meta = off;
    off += 256;
    L.tiles = off;
    off += align256(max_tiles_for(P.TK, P.E, kSmallBM) * 16);
    L.ready = off;   // int32 per tile: GEMM1's act stored (EX_MOE_DECODE_CONFIG=new, see decode_mode)
    off += align256(max_tiles_for(P.TK, P.E, kSmallBM) * 4);
    L.sorted = off;
    off += align256(P.TK * 4);
    L.act = off;
    off += align256(P.TK * P.I * 2);
    L.split_cap = (P.TK <= kSplitMaxSlots) ? kMaxSplits : 1;
    L.y = off;
    off += align256((int64_t)L.split_cap * P.TK * P.H * 2);
    L.total = off;
    return L;
}

// Checks shared by both paths. Returns EX_OK to go on, or a status (with the message set);
// *done = true for T == 0 (nothing to do).
static int check_args(void* output, const void* input, const void* aux[], int n_aux,
                      const int64_t dims[], int n_dims, Problem* P, bool* done) {
    *done = false;
    explugin::clear_error();
    char msg[256];
    if (aux == nullptr || dims == nullptr)
        return set_error(EX_ERR_INVALID_ARGUMENT, "moe_fused_gemm: aux_inputs and dims must not be NULL");
    if (n_aux < 6) {
        snprintf(msg, sizeof msg, "moe_fused_gemm: expected n_aux >= 6, got %d", n_aux);
        return set_error(EX_ERR_INVALID_ARGUMENT, msg);
    }
    if (n_dims < 6) {
        snprintf(msg, sizeof msg, "moe_fused_gemm: expected n_dims >= 6 (T,H,E,I,K,dtype), got %d", n_dims);
        return set_error(EX_ERR_INVALID_ARGUMENT, msg);
    }
    const bool dims_ok = read_dims(dims, n_dims, P, msg, sizeof msg);
    if (P->dtype != EX_DTYPE_FLOAT16 && P->dtype != EX_DTYPE_BFLOAT16) {
        snprintf(msg, sizeof msg, "moe_fused_gemm: expected dtype float16 (1) or bfloat16 (2), got %lld",
                 (long long)P->dtype);
        return set_error(EX_ERR_UNSUPPORTED_DTYPE, msg);
    }
    if (!dims_ok) return set_error(EX_ERR_SHAPE, msg);
    P->expert_map = n_aux >= 7 ? static_cast<const int*>(aux[6]) : nullptr;
    if (P->expert_map == nullptr && P->G != P->E) {
        snprintf(msg, sizeof msg,
                 "moe_fused_gemm: expected G == E without an expert_map (aux[6]); got G=%lld E=%lld",
                 (long long)P->G, (long long)P->E);
        return set_error(EX_ERR_SHAPE, msg);
    }
    if (reinterpret_cast<uintptr_t>(P->expert_map) & 3)
        return set_error(EX_ERR_ALIGNMENT, "moe_fused_gemm: expert_map (aux[6]) must be 4-byte aligned");
    if (P->T == 0) {
        *done = true;  // nothing to write; pointers of empty tensors may be NULL
        return EX_OK;
    }
    if (output == nullptr || input == nullptr || aux[1] == nullptr || aux[2] == nullptr ||
        aux[3] == nullptr || aux[4] == nullptr)
        return set_error(EX_ERR_INVALID_ARGUMENT,
                         "moe_fused_gemm: out, hidden_states, w13, w2, topk_weights, topk_ids must not be NULL");
    if (aux[5] == nullptr)
        return set_error(EX_ERR_WORKSPACE, "moe_fused_gemm: workspace (aux[5]) must not be NULL");
    return EX_OK;
}

static int64_t moe_workspace_size(const int64_t dims[], int n_dims) {
    if (dims == nullptr || n_dims < 6) return 256;
    Problem P;
    char msg[256];
    if (!read_dims(dims, n_dims, &P, msg, sizeof msg)) return 256;  // the kernel rejects these dims
    return ws_layout(P).total;
}

// ------------------------------------------------------------------------------------------
// Launchers
// ------------------------------------------------------------------------------------------

static int pick_config(const Problem& P) {
    const int64_t rows_per_expert = P.TK / P.G;  // per local expert, also under an expert map
    int c = 0;
    while (c + 1 < CFG_COUNT && rows_per_expert > kCfg[c].max_rows_per_expert) ++c;
    while (c > 0 && !s_cfg_allowed[c]) --c;  // smaller tiles when the big ones do not fit
    return s_cfg_allowed[c] ? c : -1;
}

template <typename T, class C, bool GATED>
static cudaError_t gemm_smem_opt_in() {
    // once per instantiation (host-only, capture-safe); thread-safe static initialisation
    static const cudaError_t err = cudaFuncSetAttribute(
        moe_gemm_kernel<T, C, GATED>, cudaFuncAttributeMaxDynamicSharedMemorySize,
        C::smem_bytes(GATED));
    return err;
}

// The stride of the experts' spread order (spread_expert): the integer nearest above 0.618 E
// that is coprime to E, so that p -> p * stride mod E is a permutation that places experts of
// neighbouring ids far apart (E = 128: 79; expert e at position 47 e mod 128); 0 (the id order)
// past E = 65535. Used with the decode GEMMs' expert-major order: where the hot experts have
// neighbouring ids (a benchmark's experts 0 .. E/16 - 1, or a placement that groups popular
// experts), the tile list in id order gives a wave of GEMM1 blocks mostly the hot experts', whose
// M-tiles share each weight stream, and few streams in flight (RESULTS.md, sessions forty-nine
// and fifty). The Hopper path's CUTLASS groups use it too (moe_fused_gemm_sm90.cu).
static int route_spread(int E) {
    if (E > 65535) return 0;
    int s = std::max(1, (int)(0.618 * E));
    while (std::gcd(s, E) != 1) ++s;
    return s;
}

// The routing launch (kernel 1): a small block when there are few slots. Returns EX_OK,
// EX_FALLBACK (E so large that its counters do not fit in shared memory: the callers' scalar
// paths need no routing) or EX_ERR_CUDA. expert_off may be nullptr.
template <int NT>
static int launch_route_nt(const Problem& P, int BM, int* status, int* meta, int4* tiles,
                           int* sorted, int* expert_off, int* slot_pos, const int* topk_ids,
                           cudaStream_t stream, bool pdl, int* ready = nullptr, int n_ready = 0) {
    const size_t scan_bytes = sizeof(typename cub::BlockScan<int, NT>::TempStorage);
    const size_t route_smem = (size_t)(4 * P.E + 1) * sizeof(int);
    if (route_smem + scan_bytes + 1024 > (size_t)s_smem_optin) return EX_FALLBACK;
    if (route_smem > 48 * 1024) {
        static const cudaError_t err =
            cudaFuncSetAttribute(moe_route_kernel<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 s_smem_optin - (int)scan_bytes - 1024);
        if (err != cudaSuccess) return cuda_error(err);
    }
    // with the per-tile counters (the decode GEMMs' expert-major order): the tiles in spread order
    const cudaError_t err = launch_k(moe_route_kernel<NT>, dim3(1), dim3(NT), route_smem, stream, pdl,
                                     topk_ids, P.em(), (int)P.TK, (int)P.E, BM, status, meta, tiles,
                                     sorted, expert_off, slot_pos, ready, n_ready,
                                     ready != nullptr ? route_spread((int)P.E) : 0);
    return err == cudaSuccess ? EX_OK : cuda_error(err);
}

// The multi-block routing: the histogram launch (with PDL when pdl is set, as the single-block
// routing: it waits before it reads), then the placement launch (programmatic dependent launch on
// sm_90+). Same returns as launch_route_nt (the same smem rule: its placement kernel holds the
// same 4*E+1 counters).
static int launch_route_mb(const Problem& P, int BM, int* status, int* meta, int4* tiles,
                           int* sorted, int* expert_off, int* slot_pos, const int* topk_ids,
                           cudaStream_t stream, bool pdl) {
    constexpr int NT = kRouteMbThreads;
    const size_t scan_bytes = sizeof(cub::BlockScan<int, NT>::TempStorage);
    const size_t place_smem = (size_t)(4 * P.E + 1) * sizeof(int);
    const size_t hist_smem = (size_t)P.E * sizeof(int);
    if (place_smem + scan_bytes + 1024 > (size_t)s_smem_optin) return EX_FALLBACK;
    if (hist_smem > 48 * 1024) {
        static const cudaError_t err =
            cudaFuncSetAttribute(moe_route_hist_kernel<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 s_smem_optin - 1024);
        if (err != cudaSuccess) return cuda_error(err);
    }
    if (place_smem > 48 * 1024) {
        static const cudaError_t err =
            cudaFuncSetAttribute(moe_route_place_kernel<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 s_smem_optin - (int)scan_bytes - 1024);
        if (err != cudaSuccess) return cuda_error(err);
    }
    const int S = (int)route_mb_span(P.TK);
    const unsigned B = (unsigned)route_mb_blocks(P.TK);
    int* hist = reinterpret_cast<int*>(reinterpret_cast<char*>(status) + kRouteHistOffset);
    cudaError_t err = launch_k(moe_route_hist_kernel<NT>, dim3(B), dim3(NT), hist_smem, stream, pdl,
                               topk_ids, P.em(), (int)P.TK, (int)P.E, S, status, hist);
    if (err != cudaSuccess) return cuda_error(err);
    err =
        launch_k(moe_route_place_kernel<NT>, dim3(B), dim3(NT), place_smem, stream, pdl_ok(),
                 topk_ids, P.em(), (int)P.TK, (int)P.E, BM, S, (const int*)hist, meta, tiles,
                 sorted, expert_off, slot_pos);
    if (err != cudaSuccess) return cuda_error(err);
    return EX_OK;
}

// The routing of both paths (the portable GEMMs and the Hopper plugin's CUTLASS path).
// status is the workspace's first byte (both layouts: the status word, then the multi-block
// routing's hist section at kRouteHistOffset). T*K > s_route_mb_slots: the multi-block launches;
// else one block (a small one for few slots).
static int launch_route(const Problem& P, int BM, int* status, int* meta, int4* tiles,
                        int* sorted, int* expert_off, const int* topk_ids, cudaStream_t stream,
                        bool pdl = false, int* slot_pos = nullptr, int* ready = nullptr, int n_ready = 0) {
    if (P.TK > s_route_mb_slots && P.E <= kRouteMbMaxExperts)
        return launch_route_mb(P, BM, status, meta, tiles, sorted, expert_off, slot_pos, topk_ids,
                               stream, pdl);
    if (P.TK <= kRouteSmallSlots)
        return launch_route_nt<kRouteThreadsSmall>(P, BM, status, meta, tiles, sorted, expert_off,
                                                   slot_pos, topk_ids, stream, pdl, ready, n_ready);
    return launch_route_nt<kRouteThreads>(P, BM, status, meta, tiles, sorted, expert_off, slot_pos,
                                          topk_ids, stream, pdl, ready, n_ready);
}

// Whether GEMM2 of (T, C) can run the cluster combine here, asked once per process: the code
// the device runs was compiled for sm_90+ (cluster_combine is compiled out below: PTX for
// compute_80 JIT-compiled on a newer GPU would launch, sum nothing and leave out unwritten),
// and a cluster of 8 of its blocks can be resident (cudaOccupancyMaxActiveClusters: not on
// a partition of a GPU that cannot hold one), so that no launch, eager or captured in a graph,
// depends on a cluster launch succeeding. Needs the kernel's shared-memory opt-in done.
template <typename T, class C>
static bool cluster_combine_ready() {
    static const bool ok = [] {
        cudaFuncAttributes a;
        if (cudaFuncGetAttributes(&a, moe_gemm_kernel<T, C, false>) != cudaSuccess) {
            (void)cudaGetLastError();
            return false;
        }
        if (a.ptxVersion < 90 || a.binaryVersion < 90) return false;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(8);
        cfg.blockDim = dim3(C::THREADS);
        cfg.dynamicSmemBytes = C::smem_bytes(false);
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = 8;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        int n = 0;
        if (cudaOccupancyMaxActiveClusters(&n, moe_gemm_kernel<T, C, false>, &cfg) != cudaSuccess) {
            (void)cudaGetLastError();
            return false;
        }
        return n >= 1;
    }();
    return ok;
}

template <typename T, class C>
static int launch_fast(const Problem& P, void* out, const void* x, const void* w13,
                       const void* w2, const float* topk_weights, const int* topk_ids,
                       char* ws, cudaStream_t stream, int mode) {
    const WsLayout L = ws_layout(P);
    const bool pdl = mode != MODE_OLD && mode != MODE_NOPDL && pdl_ok();  // the PDL modes
    // decode with a handful of slots: GEMM1 routes them itself (no routing launch to wait for)
    const bool fused_route = C::BM == kSmallBM && P.TK <= kFusedRouteSlots &&
                             mode != MODE_OLD && mode != MODE_UNFUSED;
    // ... and GEMM2 too, prefetching weights before its wait; early launches of the next grid
    // where this one fits in one wave (MINB blocks per SM: the launch bounds guarantee them)
    const bool early = fused_route && pdl && (mode == MODE_NEW || mode == MODE_ONEWAVE || mode == MODE_GRIDWAIT);
    // new (and gridwait): early launches whatever the wave count (see decode_mode)
    const bool wide = pdl && (mode == MODE_NEW || mode == MODE_GRIDWAIT);
    // new: GEMM2's blocks wait for their tile's counter, after a single-block routing launch
    // (which zeroes the counters; GEMM2 reads its tile list before its wait only after one)
    const bool tile_waits = pdl && mode == MODE_NEW && !fused_route && P.TK <= s_route_mb_slots;
    const int64_t wave = (int64_t)C::MINB * s_num_sms;
    int* status = reinterpret_cast<int*>(ws);
    int* meta = reinterpret_cast<int*>(ws + L.meta);
    int4* tiles = reinterpret_cast<int4*>(ws + L.tiles);
    int* sorted = reinterpret_cast<int*>(ws + L.sorted);
    T* act = reinterpret_cast<T*>(ws + L.act);
    T* y = reinterpret_cast<T*>(ws + L.y);

    const int H = (int)P.H, E = (int)P.E, I = (int)P.I, K = (int)P.K;
    const int64_t max_tiles = max_tiles_for(P.TK, P.E, C::BM);
    const int n_tiles_n1 = (I + C::BN1 - 1) / C::BN1;
    const int n_tiles_n2 = (H + C::BN2 - 1) / C::BN2;
    const int64_t blocks1 = max_tiles * n_tiles_n1, blocks2 = max_tiles * n_tiles_n2;
    if (blocks1 > 0x7fffffff || blocks2 > 0x7fffffff) return EX_FALLBACK;

    // GEMM2 split over I when the grid would leave SMs idle (few tokens, few experts)
    const int KT2 = (I + C::BK - 1) / C::BK;
    int S = 1;
    while (S < L.split_cap && blocks2 * S < 2LL * s_num_sms && KT2 / (2 * S) >= 4) S *= 2;
    const int kt_per_split = (KT2 + S - 1) / S;
    S = (KT2 + kt_per_split - 1) / kt_per_split;  // no empty slice

    cudaError_t err;
    if ((err = gemm_smem_opt_in<T, C, true>()) != cudaSuccess) return cuda_error(err);
    if ((err = gemm_smem_opt_in<T, C, false>()) != cudaSuccess) return cuda_error(err);

    // routing (EX_FALLBACK for an absurd E: the scalar fallback needs no routing)
    int* ready = tile_waits ? reinterpret_cast<int*>(ws + L.ready) : nullptr;
    if (!fused_route) {
        const int rs = launch_route(P, C::BM, status, meta, tiles, sorted, nullptr, topk_ids, stream, pdl,
                                    nullptr, ready, tile_waits ? (int)max_tiles : 0);
        if (rs != EX_OK) return rs;
    }

    GemmParams p1;
    p1.a = x; p1.b = w13; p1.c = act;
    p1.sorted_slots = sorted; p1.tiles = tiles; p1.meta = meta; p1.topk_weights = topk_weights;
    p1.N = I; p1.Kd = H; p1.topk = K; p1.n_tiles_n = n_tiles_n1;
    p1.kt_per_split = (H + C::BK - 1) / C::BK; p1.split_stride = 0;
    p1.route_ids = fused_route ? topk_ids : nullptr;
    p1.em = P.em(); p1.E = E; p1.TK = (int)P.TK;
    p1.status = status; p1.w_meta = meta; p1.w_tiles = tiles; p1.w_sorted = sorted;
    p1.early = (early && blocks1 <= wave) || wide;
    p1.pre_ws = 0;
    p1.cluster_out = nullptr;
    // M-tile-fastest order only while every A tile of the grid (re-read once per N-tile) stays
    // well inside L2; otherwise the old order, which reuses one A tile over consecutive blocks
    const bool m_fast_ok = mode != MODE_OLD && C::BM <= 48;  // decode(4), tiny, mid32, mid48
    const int64_t a_bytes1 = max_tiles * C::BM * P.H * 2, a_bytes2 = max_tiles * C::BM * P.I * 2;
    p1.m_tiles = (!tile_waits && m_fast_ok && a_bytes1 <= s_l2_bytes / 4) ? (int)max_tiles : 0;
    p1.ready = ready;   // also: expert-major order (m_tiles is 0 there; the routing launch wrote tiles)
    p1.ready_target = 0;
    if ((err = launch_k(moe_gemm_kernel<T, C, true>, dim3((unsigned)blocks1, 1, 1),
                        dim3(C::THREADS), C::smem_bytes(true), stream, pdl, p1)) != cudaSuccess)
        return cuda_error(err);

    GemmParams p2 = p1;
    p2.a = act; p2.b = w2; p2.c = y;
    // GEMM2 routes itself (fused routing) wherever its blocks can start during GEMM1: under new
    // always, under onewave where GEMM1 fits in a wave (elsewhere, T = 4 on qwen3-30b say, reading
    // the routing GEMM1 wrote measured ~1 us faster without early launches)
    p2.route_ids = p1.early && fused_route ? topk_ids : nullptr;  // else the routing GEMM1 (or the router) wrote
    p2.pre_ws = wide && !fused_route;
    p2.early = (early && blocks2 * S <= wave) || wide;
    p2.N = H; p2.Kd = I; p2.n_tiles_n = n_tiles_n2;
    p2.kt_per_split = kt_per_split; p2.split_stride = P.TK * P.H;
    p2.m_tiles = (!tile_waits && m_fast_ok && a_bytes2 <= s_l2_bytes / 4) ? (int)max_tiles : 0;
    p2.ready = ready;   // (set only with a routing launch under new: then pre_ws is set too)
    p2.ready_target = n_tiles_n1;
    // T = 1: GEMM2 in clusters of the token's K blocks of an N-tile, which sum its rows
    // themselves (cluster_combine): no y, no combine launch (EX_MOE_CLUSTER_COMBINE=0 at load:
    // off), where GEMM2 has at most kClusterCombineBlocksPerSm blocks per SM (see there)
    const bool cluster = s_cluster_combine && pdl && C::BM == kSmallBM && P.T == 1 && S == 1 &&
                         p2.m_tiles == (int)max_tiles && max_tiles == K && K <= 8 && K >= 1 &&
                         blocks2 <= (int64_t)kClusterCombineBlocksPerSm * s_num_sms &&
                         cluster_combine_ready<T, C>();
    if (cluster) {
        p2.cluster_out = out;
        err = explugin::launch_kernel_cluster(moe_gemm_kernel<T, C, false>, dim3((unsigned)blocks2, 1, 1),
                                              dim3(C::THREADS), C::smem_bytes(false), stream, pdl,
                                              (unsigned)max_tiles, p2);
        if (err == cudaSuccess) {
            if ((err = cudaGetLastError()) != cudaSuccess) return cuda_error(err);
            return EX_OK;
        }
        // a cluster launch the device refuses (its clusters cannot be resident: a partition
        // of a GPU, say): nothing ran; the plain GEMM2 and the combine launch below instead
        (void)cudaGetLastError();
        p2.cluster_out = nullptr;
    }
    if ((err = launch_k(moe_gemm_kernel<T, C, false>, dim3((unsigned)blocks2, 1, (unsigned)S),
                        dim3(C::THREADS), C::smem_bytes(false), stream, pdl, p2)) != cudaSuccess)
        return cuda_error(err);

    const unsigned cblocks = capped_blocks(P.T * (P.H / 8), kSimpleThreads, 16);
    if (!(s_diag_skip & 2) &&
        (err = launch_k(moe_combine_kernel<T>, dim3(cblocks), dim3(kSimpleThreads), 0,
                        stream, pdl, static_cast<T*>(out), static_cast<const T*>(y), topk_ids,
                        P.em(), (int)P.T, H, E, K, S, (long long)(P.TK * P.H))) != cudaSuccess)
        return cuda_error(err);

    if ((err = cudaGetLastError()) != cudaSuccess) return cuda_error(err);
    return EX_OK;
}

template <typename T>
static int dispatch_fast(const Problem& P, void* out, const void* x, const void* w13,
                         const void* w2, const float* tw, const int* ids, char* ws,
                         cudaStream_t stream) {
    const int mode = decode_mode();
    // a configuration named by dims[7] (tuned data), when this hardware can run it
    if (P.config == kTileConfigTiny && kCfgTiny.smem <= s_smem_optin)
        return launch_fast<T, CfgTiny>(P, out, x, w13, w2, tw, ids, ws, stream, mode);
    if (P.config == kTileConfigMid32 && CfgMid32::smem_max() <= s_smem_optin)
        return launch_fast<T, CfgMid32>(P, out, x, w13, w2, tw, ids, ws, stream, mode);
    if (P.config == kTileConfigMid48 && CfgMid48::smem_max() <= s_smem_optin)
        return launch_fast<T, CfgMid48>(P, out, x, w13, w2, tw, ids, ws, stream, mode);
    if (P.config == kTileConfigDecode4 && CfgDecode4::smem_max() <= s_smem_optin)
        return launch_fast<T, CfgDecode4>(P, out, x, w13, w2, tw, ids, ws, stream, mode);
    switch (P.config >= kTileConfigDecode && P.config <= kTileConfigPrefill &&
                    s_cfg_allowed[P.config - kTileConfigDecode]
                ? (int)P.config : -1) {
        case kTileConfigDecode: return launch_fast<T, CfgDecode>(P, out, x, w13, w2, tw, ids, ws, stream, mode);
        case kTileConfigMid: return launch_fast<T, CfgMid>(P, out, x, w13, w2, tw, ids, ws, stream, mode);
        case kTileConfigPrefill: return launch_fast<T, CfgPrefill>(P, out, x, w13, w2, tw, ids, ws, stream, mode);
        default: break;  // -1, 4, 7, 8, 10, 11 (not this path's) or one this hardware cannot run: choose here
    }
    const int c = pick_config(P);
    const int64_t rows_per_expert = P.TK / P.G;
    if ((c == CFG_DECODE || c == CFG_MID) && mode != MODE_OLD && rows_per_expert >= kMid32MinRows &&
        rows_per_expert <= kMid32MaxRows && CfgMid32::smem_max() <= s_smem_optin)
        return launch_fast<T, CfgMid32>(P, out, x, w13, w2, tw, ids, ws, stream, mode);
    if (c == CFG_DECODE && mode != MODE_OLD && kCfgTiny.smem <= s_smem_optin) {
        // tiny T*K: CfgTiny when all its GEMM1 blocks are resident at once
        const int64_t blocks_tiny =
            max_tiles_for(P.TK, P.E, CfgTiny::BM) * ((P.I + CfgTiny::BN1 - 1) / CfgTiny::BN1);
        if (blocks_tiny <= (int64_t)kTinyBlocksPerSm * s_num_sms)
            return launch_fast<T, CfgTiny>(P, out, x, w13, w2, tw, ids, ws, stream, mode);
    }
    if (c == CFG_DECODE && mode != MODE_OLD && P.H >= kDecode4MinH && s_decode4_resident)
        return launch_fast<T, CfgDecode4>(P, out, x, w13, w2, tw, ids, ws, stream, mode);
    switch (c) {
        case CFG_DECODE: return launch_fast<T, CfgDecode>(P, out, x, w13, w2, tw, ids, ws, stream, mode);
        case CFG_MID: return launch_fast<T, CfgMid>(P, out, x, w13, w2, tw, ids, ws, stream, mode);
        case CFG_PREFILL: return launch_fast<T, CfgPrefill>(P, out, x, w13, w2, tw, ids, ws, stream, mode);
        default: return EX_FALLBACK;
    }
}

static bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

static int moe_kernel(void* output, const void* input, const void* aux_inputs[], int n_aux,
                      const int64_t dims[], int n_dims, void* stream) {
    Problem P;
    bool done;
    const int st = check_args(output, input, aux_inputs, n_aux, dims, n_dims, &P, &done);
    if (st != EX_OK || done) return st;
    // fast path: 16-byte rows and 16-byte aligned tensors
    if (P.H % 8 != 0 || P.I % 8 != 0) return EX_FALLBACK;
    if (!aligned16(output) || !aligned16(input) || !aligned16(aux_inputs[1]) ||
        !aligned16(aux_inputs[2]) || !aligned16(aux_inputs[5]) ||
        (reinterpret_cast<uintptr_t>(aux_inputs[3]) & 3) || (reinterpret_cast<uintptr_t>(aux_inputs[4]) & 3))
        return EX_FALLBACK;
    const float* tw = static_cast<const float*>(aux_inputs[3]);
    const int* ids = static_cast<const int*>(aux_inputs[4]);
    char* ws = static_cast<char*>(const_cast<void*>(aux_inputs[5]));
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (P.dtype == EX_DTYPE_BFLOAT16)
        return dispatch_fast<__nv_bfloat16>(P, output, input, aux_inputs[1], aux_inputs[2], tw,
                                            ids, ws, s);
    return dispatch_fast<__half>(P, output, input, aux_inputs[1], aux_inputs[2], tw, ids, ws, s);
}

template <typename T>
static int launch_fallback(const Problem& P, void* out, const void* x, const void* w13,
                           const void* w2, const float* tw, const int* ids, char* ws,
                           cudaStream_t stream) {
    const WsLayout L = ws_layout(P);
    int* status = reinterpret_cast<int*>(ws);
    T* act = reinterpret_cast<T*>(ws + L.act);
    const int64_t warps_per_block = kSimpleThreads / 32;  // a warp per dot product
    const unsigned b1 = capped_blocks(P.TK * P.I, warps_per_block, 64);
    const unsigned b2 = capped_blocks(P.T * P.H, warps_per_block, 64);
    moe_fallback_act_kernel<T><<<b1, kSimpleThreads, 0, stream>>>(
        act, static_cast<const T*>(x), static_cast<const T*>(w13), ids, P.em(), status, P.TK, (int)P.H,
        (int)P.E, (int)P.I, (int)P.K);
    moe_fallback_out_kernel<T><<<b2, kSimpleThreads, 0, stream>>>(
        static_cast<T*>(out), act, static_cast<const T*>(w2), tw, ids, P.em(), P.T, (int)P.H, (int)P.E,
        (int)P.I, (int)P.K);
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? EX_OK : cuda_error(err);
}

static int moe_kernel_fallback(void* output, const void* input, const void* aux_inputs[],
                               int n_aux, const int64_t dims[], int n_dims, void* stream) {
    Problem P;
    bool done;
    const int st = check_args(output, input, aux_inputs, n_aux, dims, n_dims, &P, &done);
    if (st != EX_OK || done) return st;
    // element alignment only (2 bytes for the 16-bit tensors, 4 for the int32/fp32 ones)
    if ((reinterpret_cast<uintptr_t>(output) | reinterpret_cast<uintptr_t>(input) |
         reinterpret_cast<uintptr_t>(aux_inputs[1]) | reinterpret_cast<uintptr_t>(aux_inputs[2])) & 1 ||
        (reinterpret_cast<uintptr_t>(aux_inputs[3]) | reinterpret_cast<uintptr_t>(aux_inputs[4]) |
         reinterpret_cast<uintptr_t>(aux_inputs[5])) & 3)
        return set_error(EX_ERR_ALIGNMENT,
                         "moe_fused_gemm: expected 2-byte aligned fp16/bf16 tensors and 4-byte "
                         "aligned topk_weights, topk_ids, workspace");
    const float* tw = static_cast<const float*>(aux_inputs[3]);
    const int* ids = static_cast<const int*>(aux_inputs[4]);
    char* ws = static_cast<char*>(const_cast<void*>(aux_inputs[5]));
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (P.dtype == EX_DTYPE_BFLOAT16)
        return launch_fallback<__nv_bfloat16>(P, output, input, aux_inputs[1], aux_inputs[2], tw,
                                              ids, ws, s);
    return launch_fallback<__half>(P, output, input, aux_inputs[1], aux_inputs[2], tw, ids, ws, s);
}

// ------------------------------------------------------------------------------------------
// Hardware check and tuning of the portable path (called from ex_get_factor; no CUDA calls)
// ------------------------------------------------------------------------------------------

// Returns false if the portable path cannot serve `hw`; otherwise records what the launchers
// need of it (SM count, smem opt-in limit, configs that fit) and fills *tuning with what the
// portable GEMMs launch with: the largest config this hardware runs; shared_mem_bytes is the most
// dynamic smem any GEMM launch requests. Not in it: the router, one block of kRouteThreads
// threads with 16*E+4 bytes of dynamic smem (multi-block: up to 64 blocks of kRouteMbThreads,
// the same smem at most); combine and fallback, 256 threads, no smem.
static bool moe_portable_init(const ex_hardware_t* hw, ex_tuning_t* tuning) {
    if (hw == nullptr || hw->cc_major < 8) return false;  // bf16 mma.sync, cp.async: sm_80+
    if (hw->warp_size != 32) return false;               // mma fragments assume 32 lanes
    if (hw->max_threads_per_block < kRouteThreads) return false;
    bool allowed[CFG_COUNT];
    int largest = -1;  // the largest config that fits: its tuning is the one reported
    for (int c = 0; c < CFG_COUNT; ++c) {
        allowed[c] = kCfg[c].smem <= hw->shared_mem_per_block_optin;
        if (allowed[c]) largest = c;
    }
    if (!allowed[CFG_DECODE]) return false;
    for (int c = 0; c < CFG_COUNT; ++c) s_cfg_allowed[c] = allowed[c];
    s_num_sms = hw->multiprocessor_count > 0 ? hw->multiprocessor_count : 1;
    s_pdl_ok = hw->cc_major >= 9;
    s_cluster_combine = hw->cc_major >= 9 && explugin::env_switch("EX_MOE_CLUSTER_COMBINE");   // an on/off switch (README)
    s_route_mb_slots = explugin::env_count("EX_MOE_ROUTE_MULTIBLOCK_SLOTS", kRouteMultiBlockSlots);
#if defined(EX_MOE_DIAG)
    s_diag_skip = (int)explugin::env_count("EX_MOE_DIAG_SKIP", 0);
#endif
    if (hw->l2_cache_bytes > 0) s_l2_bytes = hw->l2_cache_bytes;
    s_smem_optin = (int)(hw->shared_mem_per_block_optin < 0x7fffffff ? hw->shared_mem_per_block_optin
                                                                      : 0x7fffffff);
    s_decode4_resident =
        CfgDecode4::smem_max() <= s_smem_optin &&
        (int64_t)CfgDecode4::MINB * (CfgDecode4::smem_max() + 1024) <= hw->shared_mem_per_multiprocessor &&
        (int64_t)CfgDecode4::MINB * CfgDecode4::THREADS <= hw->max_threads_per_multiprocessor;
    int smem = 0;
    for (int c = 0; c < CFG_COUNT; ++c)
        if (allowed[c] && kCfg[c].smem > smem) smem = kCfg[c].smem;
    tuning->threads_per_block = kCfg[largest].threads;
    tuning->num_warps = kCfg[largest].threads / hw->warp_size;
    tuning->vec_size = 8;  // 16-byte cp.async / vector accesses of 16-bit elements
    tuning->items_per_thread = kCfg[largest].items;
    tuning->shared_mem_bytes = smem;
    tuning->num_stages = kCfg[largest].stages;
    return true;
}

}  // namespace exmoe

#endif  // EX_MOE_FUSED_GEMM_CUH

/*
 * topk_softmax.cu -- factor 0: the MoE router (manifests/topk_softmax.yaml).
 *
 *   p[t, e]            = exp(l[t, e] - m[t]) / sum_j exp(l[t, j] - m[t]),  m[t] = max_j l[t, j]  (fp32)
 *   topk_ids[t, :]     = the K experts of largest l[t, e], ties to the lowest index, distinct
 *   topk_weights[t, k] = p[t, topk_ids[t, k]]   (/ sum_k of them when renormalize), rank order
 *
 *   NaN ranks as -inf (the ids stay valid experts), and a row holding a NaN logit gets NaN
 *   for all its K weights (a corrupted router shows in the layer's output, as it does in
 *   torch's softmax); if m = +inf the +inf entries share 1 equally; if every logit of a row is
 *   -inf, p = 1/E for every expert (ids 0..K-1).
 *
 * Shapes and dtypes
 *   output  topk_weights (T, K) float32          input  router_logits (T, E) contiguous,
 *   aux[0]  topk_ids     (T, K) int32                   float32 | float16 | bfloat16
 *   dims    {T, E, K, renormalize (0|1), dtype}   1 <= K <= E
 *
 * Build: make factors/topk_softmax.so  (sm_90a, sm_80, compute_80 PTX; warp-level reductions
 * use redux.sync, so sm_80 is the oldest target).
 *
 * Variants
 *   topk_softmax_kernel<T, G, NV, D, RP, KC>   the fast path, E <= 1024.  A group of G lanes owns
 *       a row (32/G rows per warp).  Lane g owns the EPL = NV * 16/sizeof(T) experts
 *       g*EPL .. g*EPL+EPL-1, loaded once with NV 16-byte vectors and held in registers as fp32
 *       (NaN -> -inf), so lane order is expert order.  One pass over them keeps the lane's D
 *       best (value desc, expert asc) in a sorted cache: fp32 compares and selects, ~10-14
 *       instructions a logit; one more pass sums exp(l - m).  Each of the K rounds is then one
 *       32-bit group max (redux.sync; RP = 2: two full-warp ones for G = 16, whose masked
 *       redux was slower; shuffles below 16 lanes) of the cached best's order-preserving key
 *       (-0 -> +0), a ballot of the lanes holding it (the lowest holds the lowest expert: ties),
 *       one shuffle of the winner's expert to the round's owner lane, and a predicated pop of
 *       the winner's cache.  A lane that gives up all D with rounds to go finds its next best
 *       by a scan of its registers (rare: D = 4 where a lane holds 1/8 of the row).  KC = 8:
 *       K fixed at 8 and the rounds unrolled (the common router; other K run a loop).
 *   topk_softmax_pkey_kernel<T, G, NV, D, KC, RL, MB>   G = 16 / 32, K < G, K < E, 16-byte rows
 *       (E = 129..512 with renormalize; see "Packed-key kernel" below).  Same registers, but each element
 *       becomes one 32-bit key: its order-preserving key with the low B = log2 G + log2 EPL bits
 *       replaced by its (lane, slot) position, reversed, so keys are unique in a row and a lane's
 *       D best are kept by unsigned min/max alone (~9 instructions an element instead of ~10-14).
 *       A round is one group max + a predicated pop (~15 SASS instructions instead of ~30: no
 *       ballot, no shuffle, no slot bookkeeping).  K+1 rounds, then e_1..e_{K+1} are checked in
 *       exact arithmetic (fp32 values reloaded, 16-bit values exact in the key); a warp with a
 *       row that fails a check, holds a NaN logit, or whose row max is non-finite or above 2^16,
 *       recomputes with the exact path above (exact_rows).  With renormalize the softmax sum is skipped (it
 *       cancels).  SASS count, fp32 E=384 K=8 renormalize, G=32: ~390 instructions a row on the
 *       fast path against ~520 for topk_softmax_kernel<float, 32, 3, 3> (not a timing).
 *   topk_softmax_generic_kernel<T>    kernel_fallback, any E: one warp per row, K passes over
 *       the row in global memory (cached), the same keys and the same probability rule.
 *   The fast kernel returns EX_FALLBACK (-1) for E > 1024 and the runtime calls the generic one.
 *
 * Napkin math (H200, 4.2 TB/s): T=16384, E=128, K=8, fp32 reads 8.4 MB of logits and writes
 * 1.0 MB of weights and ids: 2.2 us of memory traffic.  E=384: 26.2 MB, 6.2 us.  Target
 * max(2 x bytes time, 8 us).  The kernel is bound by instructions, not bytes: ~15-20 per logit
 * (cache, exp sum, conversion) and ~35 per round per warp.  Measured (H200, graph replay, fp32
 * logits, K=8): T=16384 E=128 7.5 us (the old two-reduction kernel 14.7), E=384 12.7 us
 * (bench_router_norm; 12.3 by the variant tuner's timer) with the packed-key kernel (13.9-14.2
 * before it; 23.6 for the old kernel; the 12.4 us target is met by one timer, missed by ~2% by
 * the other), T=4096 E=64 3.5 us, E=128 4.3 us.  The NaN handling of d7ed4ed (a per-element
 * check in load_lane, the flag live through the packed-key rounds) made E=384 12.6-12.8 against
 * 12.14 us before it, one run of each in one process (benchmarks/RESULTS.md, session 35).
 */
#define EX_PLUGIN_FILE "topk_softmax.so"  // names this library in its messages (ex_plugin.cuh)

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "ex_engine.h"
#include "ex_plugin.cuh"

EX_DEFINE_ABI_VERSION();

namespace {

constexpr int kMaxThreads = 256;      // threads per block the kernels are built for (8 warps)
constexpr int kMaxFastExperts = 1024; // largest E of the register-resident fast path

// ------------------------------------------------------------------------------------------
// Ordered keys
// ------------------------------------------------------------------------------------------

// An unsigned key that orders like the float, with NaN as -inf and -0 as +0.
__device__ __forceinline__ uint32_t ordered_key(float f) {
    f = fmaxf(f, -INFINITY);  // fmaxf returns the non-NaN operand: NaN -> -inf
    f = f + 0.0f;             // -0 + +0 = +0 under round-to-nearest
    const uint32_t u = __float_as_uint(f);
    return u ^ ((uint32_t)((int32_t)u >> 31) | 0x80000000u);
}

// The float bits whose ordered_key is k (the inverse of the flip above).
__device__ __forceinline__ uint32_t key_to_bits(uint32_t k) {
    return (k & 0x80000000u) ? (k ^ 0x80000000u) : ~k;
}

// Per element type: the 32-bit word of two (or one) -inf elements, the fp32 value of element i
// of a 32-bit word (i < 32 / bits per element), and of a 16-bit pattern.
template <typename T>
struct Elem;

template <>
struct Elem<float> {
    static constexpr uint32_t kNegInfWord = 0xFF800000u;
    __device__ static float word_elem(uint32_t w, int) { return __uint_as_float(w); }
    __device__ static float bits16(uint32_t) { return 0.0f; }
};

template <>
struct Elem<__nv_bfloat16> {
    static constexpr uint32_t kNegInfWord = 0xFF80FF80u;
    __device__ static float word_elem(uint32_t w, int i) {
        return __uint_as_float(i ? (w & 0xFFFF0000u) : (w << 16));
    }
    __device__ static float bits16(uint32_t b) { return __uint_as_float(b << 16); }
};

template <>
struct Elem<__half> {
    static constexpr uint32_t kNegInfWord = 0xFC00FC00u;
    __device__ static float word_elem(uint32_t w, int i) {
        return __half2float(__ushort_as_half((unsigned short)(i ? (w >> 16) : (w & 0xFFFFu))));
    }
    __device__ static float bits16(uint32_t b) { return __half2float(__ushort_as_half((unsigned short)b)); }
};

// ------------------------------------------------------------------------------------------
// Group reductions: G consecutive lanes (G a power of two) own one row
// ------------------------------------------------------------------------------------------

template <int G>
__device__ __forceinline__ uint32_t group_mask(int lane) {
    if constexpr (G == 32) return 0xFFFFFFFFu;
    else return ((1u << G) - 1u) << (lane & ~(G - 1));
}

// Every lane of the warp must call these (uniform control flow).  RP picks how a group of
// G >= 16 lanes reduces: 0 redux.sync with the group's mask, 1 xor shuffles, 2 (G = 16 only)
// one full-warp redux.sync per half-warp.  Below 16 lanes: xor shuffles.
template <int G, int RP, bool kMax>
__device__ __forceinline__ uint32_t group_reduce(uint32_t v, int lane) {
    if constexpr (G == 1) {
        return v;
    } else if constexpr (G == 32 && RP != 1) {
        return kMax ? __reduce_max_sync(0xFFFFFFFFu, v) : __reduce_min_sync(0xFFFFFFFFu, v);
    } else if constexpr (G == 16 && RP == 2) {
        const bool upper = lane >= 16;
        const uint32_t none = kMax ? 0u : 0xFFFFFFFFu;
        const uint32_t lo = kMax ? __reduce_max_sync(0xFFFFFFFFu, upper ? none : v)
                                 : __reduce_min_sync(0xFFFFFFFFu, upper ? none : v);
        const uint32_t hi = kMax ? __reduce_max_sync(0xFFFFFFFFu, upper ? v : none)
                                 : __reduce_min_sync(0xFFFFFFFFu, upper ? v : none);
        return upper ? hi : lo;
    } else if constexpr (G >= 16 && RP == 0) {
        return kMax ? __reduce_max_sync(group_mask<G>(lane), v) : __reduce_min_sync(group_mask<G>(lane), v);
    } else {
#pragma unroll
        for (int o = G / 2; o > 0; o >>= 1) {
            const uint32_t w = __shfl_xor_sync(0xFFFFFFFFu, v, o);
            v = kMax ? max(v, w) : min(v, w);
        }
        return v;
    }
}

template <int G, int RP = 0>
__device__ __forceinline__ uint32_t group_max(uint32_t v, int lane) { return group_reduce<G, RP, true>(v, lane); }

// Butterfly sum: every lane of the group ends with the same value (same tree, commutative adds).
template <int G>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
}

__device__ __forceinline__ uint64_t warp_max_u64(uint64_t v) {
    const uint32_t vhi = (uint32_t)(v >> 32);
    const uint32_t hi = __reduce_max_sync(0xFFFFFFFFu, vhi);
    const uint32_t lo = __reduce_max_sync(0xFFFFFFFFu, vhi == hi ? (uint32_t)v : 0u);
    return ((uint64_t)hi << 32) | lo;
}

// ------------------------------------------------------------------------------------------
// Probability of one logit given the row's max m and normaliser S (see the header rule)
// ------------------------------------------------------------------------------------------

// exp(d) for d <= 0 (or -inf -> 0): ex2.approx with results below 2^-126 flushed to 0, which
// the weights (>= 1e-7 absolute tolerance) cannot see.
__device__ __forceinline__ float exp_nonpos(float d) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(d * 1.4426950408889634f));
    return y;
}

// Unnormalised weight u(l): exp(l - m) for finite m (NaN -> 0); for m = +inf, 1 on +inf
// entries and 0 elsewhere; for m = -inf (all -inf or NaN), 1 everywhere.  S = sum of u.
__device__ __forceinline__ float unnormalised(float l, float m) {
    if (isfinite(m)) return exp_nonpos(fmaxf(l - m, -INFINITY));  // NaN - m = NaN -> -inf -> 0
    if (m > 0.0f) return l == INFINITY ? 1.0f : 0.0f;
    return 1.0f;
}

// ------------------------------------------------------------------------------------------
// The lane's cache: its D best elements (value desc, slot asc) as fp32 values and slots (the
// lane's element numbers, ascending with the expert index).  Elements arrive in ascending
// slot order, so strict compares keep the earlier one first on ties.
// ------------------------------------------------------------------------------------------

// Order-preserving key of a NaN-free float, -0 as +0; every key is > 0 (0 marks "empty").
__device__ __forceinline__ uint32_t value_key(float f) {
    const uint32_t u = __float_as_uint(f + 0.0f);
    return u ^ ((uint32_t)((int32_t)u >> 31) | 0x80000000u);
}

constexpr uint32_t kNoSlot = 0xFFFFu;  // an empty cache entry (slots are < kMaxFastExperts)

template <int D>
struct TopD {
    float v[D];
    uint32_t sl[D];

    // x arrives after every element held.  SPARSE: entries may be empty (below everything).
    template <bool SPARSE>
    __device__ __forceinline__ void insert(float x, uint32_t s) {
        bool p[D];
#pragma unroll
        for (int i = 0; i < D; ++i) p[i] = (SPARSE && sl[i] == kNoSlot) || x > v[i];
#pragma unroll
        for (int i = D - 1; i > 0; --i) {
            v[i] = p[i - 1] ? v[i - 1] : (p[i] ? x : v[i]);
            sl[i] = p[i - 1] ? sl[i - 1] : (p[i] ? s : sl[i]);
        }
        v[0] = p[0] ? x : v[0];
        sl[0] = p[0] ? s : sl[0];
    }
    template <int EPL>
    __device__ __forceinline__ void build(const float (&x)[EPL]) {
#pragma unroll
        for (int i = 0; i < D; ++i) {
            v[i] = -INFINITY;
            sl[i] = kNoSlot;
        }
#pragma unroll
        for (int k = 0; k < EPL; ++k) {
            if (k < D) insert<true>(x[k], (uint32_t)k);
            else insert<false>(x[k], (uint32_t)k);
        }
    }
    __device__ __forceinline__ bool empty() const { return sl[0] == kNoSlot; }
    __device__ __forceinline__ uint32_t key() const { return empty() ? 0u : value_key(v[0]); }
    // drop the best if `on` (predicated, no branch)
    __device__ __forceinline__ void pop_if(bool on) {
#pragma unroll
        for (int i = 0; i + 1 < D; ++i) {
            v[i] = on ? v[i + 1] : v[i];
            sl[i] = on ? sl[i + 1] : sl[i];
        }
        v[D - 1] = on ? -INFINITY : v[D - 1];
        sl[D - 1] = on ? kNoSlot : sl[D - 1];
    }
    // the cache ran out: hold the best element ranked below (pv, ps), the one just given up
    // (empty if none is left).  Rare: the lane gave up D elements with rounds to go.
    template <int EPL>
    __device__ __forceinline__ void refill(const float (&x)[EPL], float pv, uint32_t ps) {
        float bv = -INFINITY;
        uint32_t bs = kNoSlot;
#pragma unroll
        for (int k = 0; k < EPL; ++k) {
            const bool below = x[k] < pv || (x[k] == pv && (uint32_t)k > ps);
            const bool take = below && (bs == kNoSlot || x[k] > bv);
            bv = take ? x[k] : bv;
            bs = take ? (uint32_t)k : bs;
        }
        v[0] = bv;
        sl[0] = bs;
    }
};

// ------------------------------------------------------------------------------------------
// Row loads: lane g of a group holds experts g*EPL .. g*EPL+EPL-1 of its row as fp32, NaN -> -inf
// (experts >= E, and rows past the end, read as -inf)
// ------------------------------------------------------------------------------------------

// Loads through the non-coherent path; AGAIN: volatile asm, so a reload of the same row is not
// merged with the first load (which would keep the first values live in registers).
template <bool AGAIN>
__device__ __forceinline__ uint4 ld_v4(const uint4* p) {
    if constexpr (!AGAIN) return __ldg(p);
    uint4 q;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(q.x), "=r"(q.y), "=r"(q.z), "=r"(q.w) : "l"(p));
    return q;
}
template <bool AGAIN>
__device__ __forceinline__ uint32_t ld_u32(const uint32_t* p) {
    if constexpr (!AGAIN) return __ldg(p);
    uint32_t v;
    asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
template <bool AGAIN>
__device__ __forceinline__ uint32_t ld_u16(const unsigned short* p) {
    if constexpr (!AGAIN) return __ldg(p);
    unsigned short v;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

// VONLY: the caller guarantees vec_ok (the packed-key kernel runs only on 16-byte rows).
// has_nan: whether any of the lane's logits is NaN (before NaN -> -inf), for the row's weights
template <typename T, int NV, bool AGAIN = false, bool VONLY = false>
__device__ __forceinline__ void load_lane(const T* __restrict__ logits, int64_t t, bool row_ok, int E,
                                          int gbase, int vec_ok, float (&x)[NV * 16 / (int)sizeof(T)],
                                          bool& has_nan) {
    constexpr int V = 16 / (int)sizeof(T);  // elements per 16-byte vector
    constexpr int EPL = V * NV;             // elements per lane
    constexpr int WORDS = NV * 4;           // 32-bit registers holding the lane's raw logits
    constexpr int EPW = 4 / (int)sizeof(T); // elements per 32-bit word
    using El = Elem<T>;
    uint32_t raw[WORDS];
    const int lim = row_ok ? E : 0;
    const T* row = logits + (row_ok ? t : 0) * (int64_t)E;
    if (VONLY || vec_ok) {  // E * sizeof(T) a multiple of 16: a vector is all in or all out
        const uint4* rv = reinterpret_cast<const uint4*>(row + gbase);
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            uint4 q = make_uint4(El::kNegInfWord, El::kNegInfWord, El::kNegInfWord, El::kNegInfWord);
            if (gbase + j * V < lim) q = ld_v4<AGAIN>(rv + j);
            raw[4 * j + 0] = q.x;
            raw[4 * j + 1] = q.y;
            raw[4 * j + 2] = q.z;
            raw[4 * j + 3] = q.w;
        }
    } else {
#pragma unroll
        for (int w = 0; w < WORDS; ++w) raw[w] = El::kNegInfWord;
#pragma unroll
        for (int k = 0; k < EPL; ++k) {
            if (gbase + k < lim) {
                if constexpr (EPW == 2) {
                    const uint32_t b = ld_u16<AGAIN>(reinterpret_cast<const unsigned short*>(row) + gbase + k);
                    const int sh = 16 * (k & 1);
                    raw[k / 2] = (raw[k / 2] & ~(0xFFFFu << sh)) | (b << sh);
                } else {
                    raw[k] = ld_u32<AGAIN>(reinterpret_cast<const uint32_t*>(row) + gbase + k);
                }
            }
        }
    }
    bool nan = false;
#pragma unroll
    for (int k = 0; k < EPL; ++k) {
        const float v = El::word_elem(raw[k / EPW], k % EPW);
        nan = nan || v != v;
        x[k] = fmaxf(v, -INFINITY);
    }
    has_nan = nan;
}

// ------------------------------------------------------------------------------------------
// Exact top-K of the R rows of a warp from the lanes' registers: the lane's D best in a sorted
// fp32 cache, K rounds of group max + ballot + shuffle (see the header).  Every lane of the warp
// calls it (uniform control flow); it writes the outputs of its rows.
// ------------------------------------------------------------------------------------------

// nan: this lane's logits hold a NaN (load_lane): the row's S, and so its every weight, is NaN
template <int G, int EPL, int D, int RP, int KC>
__device__ __forceinline__ void exact_rows(const float (&x)[EPL], float* __restrict__ out_w,
                                           int32_t* __restrict__ out_id, int64_t t, bool row_ok,
                                           int E, int K_, int renormalize, int lane, bool nan) {
    const int K = KC > 0 ? KC : K_;  // KC > 0: K is KC, and the rounds unroll
    const int g = lane & (G - 1);   // lane within the row's group
    const int gfirst = lane & ~(G - 1);
    const int gbase = g * EPL;
    TopD<D> c;
    c.build(x);

    // ---- row max (round 0's winner) and the softmax normaliser -------------------------------
    uint32_t key = c.key();
    uint32_t hi = group_max<G, RP>(key, lane);
    const float m = __uint_as_float(key_to_bits(hi));  // -inf if all -inf / NaN
    float s = 0.0f;
    if (isfinite(m)) {
#pragma unroll
        for (int k = 0; k < EPL; ++k) s += exp_nonpos(x[k] - m);
    } else if (m > 0.0f) {
#pragma unroll
        for (int k = 0; k < EPL; ++k) s += x[k] == INFINITY ? 1.0f : 0.0f;
    } else {
        s = g == 0 ? (float)E : 0.0f;
    }
    s = group_sum<G>(nan ? __int_as_float(0x7FC00000) : s);  // every lane of the group holds S (NaN: a NaN logit)

    // ---- K rounds: the group's max key; its lowest holder gives up its best ------------------
    uint32_t mine_key = 0;  // K <= G: lane g keeps the winner of round g
    uint32_t mine_id = 0;
    float psum_l = 0.0f;    // K > G: sum of the weights this lane wrote
#pragma unroll
    for (int r = 0; r < K; ++r) {
        uint32_t held = __ballot_sync(0xFFFFFFFFu, key == hi);
        if constexpr (G < 32) held = (held >> gfirst) & ((1u << G) - 1u);
        const int w = __ffs(held) - 1;  // the winning lane of the group
        const uint32_t id = __shfl_sync(0xFFFFFFFFu, c.sl[0] + (uint32_t)gbase, gfirst + w);
        if (K <= G) {
            mine_key = g == r ? hi : mine_key;
            mine_id = g == r ? id : mine_id;
        } else if (g == (r & (G - 1))) {
            const float p = __fdividef(unnormalised(__uint_as_float(key_to_bits(hi)), m), s);
            psum_l += p;
            if (row_ok) {
                out_w[t * K + r] = p;
                out_id[t * K + r] = (int)id;
            }
        }
        const bool popped = g == w;
        const float pv = c.v[0];
        const uint32_t ps = c.sl[0];
        c.pop_if(popped);
        if (r + 1 < K) {
            if (popped && c.empty()) c.refill(x, pv, ps);
            key = c.key();
            hi = group_max<G, RP>(key, lane);
        }
    }

    // ---- weights out --------------------------------------------------------------------------
    if (K <= G) {
        const float p = g < K ? __fdividef(unnormalised(__uint_as_float(key_to_bits(mine_key)), m), s) : 0.0f;
        const float psum = renormalize ? group_sum<G>(p) : 1.0f;
        if (row_ok && g < K) {
            out_w[t * K + g] = renormalize ? __fdividef(p, psum) : p;
            out_id[t * K + g] = (int)mine_id;
        }
    } else if (renormalize) {
        const float psum = group_sum<G>(psum_l);
        if (row_ok) {
            for (int r = g; r < K; r += G) out_w[t * K + r] = __fdividef(out_w[t * K + r], psum);  // own writes
        }
    }
}

#ifdef TOPK_TUNE_COUNTERS
__device__ unsigned long long g_tune_exact_warps;  // tuner builds only: warps sent to exact_rows
#endif

// ------------------------------------------------------------------------------------------
// Fast kernel: G lanes per row, NV 16-byte vectors per lane, rows in registers (exact rounds)
// ------------------------------------------------------------------------------------------

template <typename T, int G, int NV, int D = 3, int RP = 2, int KC = 0>
__global__ void __launch_bounds__(kMaxThreads)
topk_softmax_kernel(float* __restrict__ out_w,          // (T, K)
                    int32_t* __restrict__ out_id,       // (T, K)
                    const T* __restrict__ logits,       // (T, E)
                    int64_t n_rows, int E, int K_, int renormalize, int vec_ok) {
    explugin::pdl_wait();  // launched with PDL: the previous kernel's writes are visible
    explugin::pdl_launch_dependents();
    constexpr int EPL = 16 / (int)sizeof(T) * NV;  // elements per lane
    constexpr int R = 32 / G;                      // rows per warp
    static_assert(G >= 1 && G <= 32 && (G & (G - 1)) == 0, "G must be a power of two <= 32");
    static_assert(D >= 1 && D <= EPL, "cache deeper than the lane's elements");

    const int lane = threadIdx.x & 31;
    const int sub = lane / G;  // row within the warp
    const int warps_per_block = blockDim.x >> 5;
    const int64_t warp_stride = (int64_t)gridDim.x * warps_per_block;
    const int64_t n_tasks = (n_rows + R - 1) / R;  // a task: the R rows of one warp
    // Lane g owns experts [g * EPL, (g + 1) * EPL) (its slots 0..EPL-1), so lane order is
    // expert order: among lanes holding equal values the lowest lane holds the lowest expert.
    const int gbase = (lane & (G - 1)) * EPL;

    for (int64_t task = (int64_t)blockIdx.x * warps_per_block + (threadIdx.x >> 5); task < n_tasks;
         task += warp_stride) {  // warp-uniform
        const int64_t t = task * R + sub;
        const bool row_ok = t < n_rows;
        float x[EPL];
        bool nan;
        load_lane<T, NV>(logits, t, row_ok, E, gbase, vec_ok, x, nan);
        exact_rows<G, EPL, D, RP, KC>(x, out_w, out_id, t, row_ok, E, K_, renormalize, lane, nan);
    }
}

// ------------------------------------------------------------------------------------------
// Packed-key kernel (G = 16 or 32, K < G, K < E, rows of whole aligned 16-byte vectors): the
// rounds on one 32-bit key per element.  H200, fp32 T=16384 E=384 K=8: 12.7 us in bench_router_norm (the
// sorted-cache kernel: 13.9-14.2 us).
//
//   P = (ordered_key(l) with its low B bits replaced by the element's position, reversed)
//
// where the position is (G-1-g, lane field of log2 G bits) : (2^KB-1-slot, KB bits), so P is
// unique in its row and P order is (truncated key desc, expert asc).  A lane keeps its D best P
// by unsigned min/max (no slot bookkeeping); each round is one group max (its low bits name the
// winner: no ballot, no shuffle) and a predicated pop where the key matches.  K+1 rounds give
// e_1..e_{K+1} in P order.  P order differs from the exact order only (i) between elements of
// equal truncated key and (ii) between +0 and -0 (keys one apart), so the top K by P are the
// exact top K, in exact order, when: e_1..e_{K+1} are in exact order pairwise (values reloaded
// / decoded exactly), e_K is not 0 or denormal, and e_K, e_{K+1} differ in truncated key or the
// row has no element with low B mantissa bits set (always so for fp16 / bf16 logits, B <= 13).
// The weights use m' (the upper end of the top key's truncation bucket, >= m, within 2^B ulps)
// as the softmax shift: the same shift in numerator and normaliser, exact in real arithmetic.
// Without renormalize the normaliser is summed per lane against the lane's max, then scaled
// by exp(lane max - m').  A lane that gives up its D cached keys with rounds to go refills with
// its D best keys below the one it gave up (rare for D = 3).  A warp where any row fails a
// check, holds a NaN logit, or has a non-finite or large (> 2^16) m', recomputes its rows with exact_rows (ties,
// +-0 and special values follow that code's rules).  The checks were validated against a
// float64 reference with a bit-level Python model (benchmarks/topk_variants/model.py; ~130k rows of near ties, special values,
// +-0 mixes), then on the H200 by scripts/gpu_router_norm_selftest.py and the GPU tests.
// ------------------------------------------------------------------------------------------

constexpr int ceil_log2(int n) { return n <= 1 ? 0 : 1 + ceil_log2((n + 1) / 2); }

// exp2(a) for a <= ~0 (ex2.approx, results below 2^-126 flushed to 0)
__device__ __forceinline__ float ex2_approx(float a) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(a));
    return y;
}

// (l & i) | (~l & ~i & q): one LOP3 (the compiler splits the C form into three)
__device__ __forceinline__ uint32_t pk_merge(uint32_t q, uint32_t l, uint32_t i) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0x98;" : "=r"(r) : "r"(q), "r"(l), "r"(i));
    return r;
}

template <int D>
__device__ __forceinline__ void pk_insert(uint32_t (&c)[D], uint32_t p) {
#pragma unroll
    for (int i = 0; i + 1 < D; ++i) {
        const uint32_t hi = max(c[i], p);
        p = min(c[i], p);
        c[i] = hi;
    }
    c[D - 1] = max(c[D - 1], p);
}

// The lane's packed key of its element k (x = its value, NaN already -inf); lreg: the lane's
// position bits (lane field G-1-g, slot field all ones).
template <int LB, int KB>
__device__ __forceinline__ uint32_t pk_key(float x, int k, uint32_t lreg) {
    const uint32_t u = __float_as_uint(x);
    const uint32_t q = u ^ ((uint32_t)((int32_t)u >> 31) | 0x80000000u);  // ordered_key, -0 below +0
    // imm: lane field all ones, slot field 2^KB-1-k.  Where lreg and imm are both 0 (the high
    // bits) the key passes; elsewhere one of them is all ones and the other supplies the field.
    const uint32_t imm = (((1u << LB) - 1u) << KB) | ((1u << KB) - 1u - (uint32_t)k);
    return pk_merge(q, lreg, imm);
}

// RL: the refill and the exact path reload the lane's logits (L1 / L2) instead of keeping them
// in registers through the rounds.  MB: min blocks per SM for the register allocation.
template <typename T, int G, int NV, int D = 3, int KC = 0, bool RL = true, int MB = 1>
__global__ void __launch_bounds__(kMaxThreads, MB)
topk_softmax_pkey_kernel(float* __restrict__ out_w, int32_t* __restrict__ out_id,
                         const T* __restrict__ logits, int64_t n_rows, int E, int K_,
                         int renormalize, int vec_ok) {
    explugin::pdl_wait();  // launched with PDL: the previous kernel's writes are visible
    explugin::pdl_launch_dependents();
    const int K = KC > 0 ? KC : K_;
    constexpr int EPL = 16 / (int)sizeof(T) * NV;  // elements per lane
    constexpr int R = 32 / G;                      // rows per warp
    constexpr int RP = 2;                          // G = 16: two full-warp redux
    constexpr int LB = ceil_log2(G);               // lane field bits
    constexpr int KB = ceil_log2(EPL);             // slot field bits
    constexpr int B = LB + KB;                     // truncated key bits
    constexpr uint32_t MASK = (1u << B) - 1u;
    constexpr uint32_t KMASK = (1u << KB) - 1u;
    constexpr float kLog2e = 1.4426950408889634f;
    static_assert(G == 16 || G == 32, "packed keys: 16 or 32 lanes per row");
    static_assert(B <= 13, "fp16 / bf16 logits must keep exact keys (13 zero mantissa bits in fp32)");
    static_assert(D >= 1 && D <= EPL, "cache deeper than the lane's elements");

    const int lane = threadIdx.x & 31;
    const int g = lane & (G - 1);
    const int sub = lane / G;
    const int warps_per_block = blockDim.x >> 5;
    const int64_t warp_stride = (int64_t)gridDim.x * warps_per_block;
    const int64_t n_tasks = (n_rows + R - 1) / R;
    const int gbase = g * EPL;
    const uint32_t lreg = ((uint32_t)(G - 1 - g) << KB) | KMASK;

    for (int64_t task = (int64_t)blockIdx.x * warps_per_block + (threadIdx.x >> 5); task < n_tasks;
         task += warp_stride) {  // warp-uniform
        const int64_t t = task * R + sub;
        const bool row_ok = t < n_rows;
        float x[EPL];
        bool nan;
        load_lane<T, NV, false, true>(logits, t, row_ok, E, gbase, 1, x, nan);

        // ---- packed keys, the lane's D best; without renormalize the lane's exp sum ------------
        uint32_t c[D];
#pragma unroll
        for (int i = 0; i < D; ++i) c[i] = 0u;  // 0: empty, below every key
        uint32_t bits_or = 0u;                   // fp32: OR of the values' bits (low B bits: dirty)
#pragma unroll
        for (int k = 0; k < EPL; ++k) {
            if constexpr (sizeof(T) == 4) bits_or |= __float_as_uint(x[k]);
            pk_insert<D>(c, pk_key<LB, KB>(x[k], k, lreg));
        }
        float xmax = -INFINITY, s_lane = 0.0f;  // sum of exp(x - xmax) over the lane
        if (!renormalize) {  // with renormalize the normaliser cancels
#pragma unroll
            for (int k = 0; k < EPL; ++k) xmax = fmaxf(xmax, x[k]);
#pragma unroll
            for (int k = 0; k < EPL; ++k) s_lane += exp_nonpos(fmaxf(x[k] - xmax, -INFINITY));
        }

        uint32_t hi = group_max<G, RP>(c[0], lane);
        // m': the largest value of the top key's bucket (the +inf bucket holds +inf alone)
        const float mval = __uint_as_float(key_to_bits(min(hi | MASK, 0xFF800000u)));
        bool bad = !(fabsf(mval) <= 65536.0f) || nan;  // non-finite or large, or a NaN: exact_rows
        const float mL = mval * kLog2e;
        bool any_bad = __any_sync(0xFFFFFFFFu, bad);

        uint32_t mine = 0u;  // lane g <= K: the key of round g's winner
        if (!any_bad) {
            // ---- K + 1 rounds ------------------------------------------------------------------
#pragma unroll
            for (int r = 0; r <= K; ++r) {
                if (r > 0) hi = group_max<G, RP>(c[0], lane);
                mine = g == r ? hi : mine;
                if (r < K) {
                    const bool pop = c[0] == hi;  // keys are unique: the winner alone
#pragma unroll
                    for (int i = 0; i + 1 < D; ++i) c[i] = pop ? c[i + 1] : c[i];
                    c[D - 1] = pop ? 0u : c[D - 1];
                    if (pop && c[0] == 0u) {  // rare: the lane gave up its D best; next D below hi
                        if constexpr (RL) {
                            float y[EPL];
                            bool ynan;  // (the row's NaN flag is nan's: no NaN reaches these rounds)
                            load_lane<T, NV, true, true>(logits, t, row_ok, E, gbase, 1, y, ynan);
#pragma unroll
                            for (int k = 0; k < EPL; ++k) {
                                const uint32_t p = pk_key<LB, KB>(y[k], k, lreg);
                                pk_insert<D>(c, p < hi ? p : 0u);
                            }
                        } else {
#pragma unroll
                            for (int k = 0; k < EPL; ++k) {
                                const uint32_t p = pk_key<LB, KB>(x[k], k, lreg);
                                pk_insert<D>(c, p < hi ? p : 0u);
                            }
                        }
                    }
                }
            }

            // ---- e_1..e_{K+1}: exact values, checks ----------------------------------------------
            const uint32_t pos = mine & MASK;
            const int idx = (int)((G - 1) - (pos >> KB)) * EPL + (int)(KMASK - (pos & KMASK));
            float xv = -INFINITY;
            if constexpr (sizeof(T) == 4) {
                if (g <= K && row_ok) xv = fmaxf(__ldg(reinterpret_cast<const float*>(logits) + t * (int64_t)E + idx), -INFINITY);
            } else {  // 16-bit logits: the key is exact (its low B bits are the fill of the value)
                xv = __uint_as_float(key_to_bits(mine >= 0x80000000u ? (mine & ~MASK) : (mine | MASK)));
            }
            const float nx = __shfl_down_sync(0xFFFFFFFFu, xv, 1);
            const int nidx = __shfl_down_sync(0xFFFFFFFFu, idx, 1);
            const uint32_t nmine = __shfl_down_sync(0xFFFFFFFFu, mine, 1);
            bool same_bucket = false;
            if (g < K) {
                if (!(xv > nx || (xv == nx && idx < nidx))) bad = true;  // not in exact order
                if (g == K - 1) {
                    if (fabsf(xv) < 1e-30f) bad = true;                // +-0 may straddle e_K
                    same_bucket = (mine ^ nmine) <= MASK;
                }
            }
            if constexpr (sizeof(T) == 4) {
                // e_K and e_{K+1} share a bucket: an element after e_{K+1} in that bucket could
                // be exactly above e_K unless no element of the row has low bits set
                if (__any_sync(0xFFFFFFFFu, same_bucket)) {
                    uint32_t dirty = __ballot_sync(0xFFFFFFFFu, (bits_or & MASK) != 0u);
                    if constexpr (G < 32) dirty = (dirty >> (lane & ~(G - 1))) & ((1u << G) - 1u);
                    if (same_bucket && dirty != 0u) bad = true;
                }
            }
            any_bad = __any_sync(0xFFFFFFFFu, bad);
            if (!any_bad) {
                // ---- weights out ---------------------------------------------------------------
                const float u = g < K ? ex2_approx(fmaf(xv, kLog2e, -mL)) : 0.0f;
                float den;
                if (renormalize) {
                    den = group_sum<G>(u);
                } else {  // sum over lanes of s_lane * exp(xmax - m'); an all -inf lane adds 0
                    den = group_sum<G>(xmax == -INFINITY ? 0.0f : s_lane * ex2_approx(fmaf(xmax, kLog2e, -mL)));
                }
                if (row_ok && g < K) {
                    out_w[t * K + g] = __fdividef(u, den);
                    out_id[t * K + g] = idx;
                }
            }
        }
        if (any_bad) {
#ifdef TOPK_TUNE_COUNTERS
            if (lane == 0) atomicAdd(&g_tune_exact_warps, 1ull);
#endif
            if constexpr (RL) {
                float y[EPL];
                bool ynan;
                load_lane<T, NV, true, true>(logits, t, row_ok, E, gbase, 1, y, ynan);
                exact_rows<G, EPL, 3, RP, KC>(y, out_w, out_id, t, row_ok, E, K_, renormalize, lane, ynan);
            } else {
                exact_rows<G, EPL, 3, RP, KC>(x, out_w, out_id, t, row_ok, E, K_, renormalize, lane, nan);
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// Generic kernel (kernel_fallback): any E, one warp per row, K passes over global memory
// ------------------------------------------------------------------------------------------

__device__ __forceinline__ uint64_t composite64(float f, uint32_t idx) {
    return ((uint64_t)ordered_key(f) << 32) | (uint64_t)(0xFFFFFFFFu - idx);
}

template <typename T>
__device__ __forceinline__ float load_float(const T* p) {
    if constexpr (sizeof(T) == 4) return __ldg(reinterpret_cast<const float*>(p));
    else {
        const uint32_t b = __ldg(reinterpret_cast<const unsigned short*>(p));
        return Elem<T>::bits16(b);
    }
}

template <typename T>
__global__ void __launch_bounds__(kMaxThreads)
topk_softmax_generic_kernel(float* __restrict__ out_w, int32_t* __restrict__ out_id,
                            const T* __restrict__ logits, int64_t n_rows, int E, int K,
                            int renormalize) {
    explugin::pdl_wait();  // launched with PDL: the previous kernel's writes are visible
    explugin::pdl_launch_dependents();
    const int lane = threadIdx.x & 31;
    const int warps_per_block = blockDim.x >> 5;
    for (int64_t t = (int64_t)blockIdx.x * warps_per_block + (threadIdx.x >> 5); t < n_rows;
         t += (int64_t)gridDim.x * warps_per_block) {
        const T* row = logits + t * (int64_t)E;
        uint64_t bound = ~0ull;  // every composite is below it
        float m = 0.0f, s = 1.0f, psum = 0.0f;
        for (int r = 0; r < K; ++r) {
            uint64_t best = 0;
            for (int e = lane; e < E; e += 32) {
                const uint64_t c = composite64(load_float(row + e), (uint32_t)e);
                if (c < bound && c > best) best = c;
            }
            const uint64_t w = warp_max_u64(best);
            bound = w;
            const float l = __uint_as_float(key_to_bits((uint32_t)(w >> 32)));
            if (r == 0) {
                m = l;
                float acc = 0.0f;
                bool nan = false;
                for (int e = lane; e < E; e += 32) {
                    const float v = load_float(row + e);
                    nan = nan || v != v;
                    acc += unnormalised(v, m);
                }
                s = group_sum<32>(nan ? __int_as_float(0x7FC00000) : acc);  // NaN: a NaN logit, NaN weights
            }
            const float p = unnormalised(l, m) / s;
            psum += p;  // identical in every lane
            if (lane == (r & 31)) {
                out_w[t * K + r] = p;
                out_id[t * K + r] = (int32_t)(0xFFFFFFFFu - (uint32_t)w);
            }
        }
        if (renormalize) {
            for (int r = lane; r < K; r += 32) out_w[t * K + r] = out_w[t * K + r] / psum;  // own writes
        }
    }
}

// ------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------

ex_factor_t g_factor;
int g_threads = kMaxThreads;  // threads per block, set from the hardware by ex_get_factor
using explugin::check_launch;
using explugin::fail;

unsigned grid_for(int64_t n_rows, int64_t rows_per_block) {
    const int64_t blocks = (n_rows + rows_per_block - 1) / rows_per_block;
    return (unsigned)(blocks < INT_MAX ? blocks : INT_MAX);  // the kernels stride over the rest
}

struct Args {
    float* w;
    int32_t* id;
    const void* logits;
    int64_t T;
    int E, K, renormalize;
    cudaStream_t stream;
};

template <typename T, int G, int NV, int D = 3, int RP = 2, int KC = 0>
ex_status_t launch_fast(const Args& a, bool vec_ok) {
    static_assert(G * (16 / (int)sizeof(T)) * NV <= kMaxFastExperts, "capacity above the fast range");
    const int threads = g_threads;
    const int64_t rows_per_block = (int64_t)(threads / 32) * (32 / G);
    (void)explugin::launch_kernel(topk_softmax_kernel<T, G, NV, D, RP, KC>, grid_for(a.T, rows_per_block),
                                  threads, 0, a.stream, explugin::pdl_enabled(), a.w, a.id,
                                  static_cast<const T*>(a.logits), a.T, a.E, a.K, a.renormalize, vec_ok ? 1 : 0);
    return check_launch();
}

inline bool vectorisable(const Args& a, size_t elem_bytes) {
    return (reinterpret_cast<uintptr_t>(a.logits) % 16 == 0) && ((int64_t)a.E * (int64_t)elem_bytes) % 16 == 0;
}

// K = 8 (the common router) gets kernels with the rounds unrolled; other K a runtime loop.
template <typename T, int G, int NV, int D>
ex_status_t launch_k(const Args& a, bool vec_ok) {
    return a.K == 8 ? launch_fast<T, G, NV, D, 2, 8>(a, vec_ok) : launch_fast<T, G, NV, D, 2, 0>(a, vec_ok);
}

template <typename T, int G, int NV, int D, int KC, bool RL = true, int MB = 1>
ex_status_t launch_pkey(const Args& a, bool vec_ok) {
    static_assert(G * (16 / (int)sizeof(T)) * NV <= kMaxFastExperts, "capacity above the fast range");
    const int threads = g_threads;
    const int64_t rows_per_block = (int64_t)(threads / 32) * (32 / G);
    (void)explugin::launch_kernel(topk_softmax_pkey_kernel<T, G, NV, D, KC, RL, MB>,
                                  grid_for(a.T, rows_per_block), threads, 0, a.stream,
                                  explugin::pdl_enabled(), a.w, a.id, static_cast<const T*>(a.logits),
                                  a.T, a.E, a.K, a.renormalize, vec_ok ? 1 : 0);
    return check_launch();
}

// The packed-key kernel <G, NV, DP, RL, MB> where it applies and was timed faster: renormalize
// (without it the per-lane softmax sum made it 1-5% slower than the exact kernel at E = 384),
// K < G lanes per row, K < E, rows of whole 16-byte vectors at a 16-byte aligned base; else the
// exact kernel <GX, NVX, DX>.
template <typename T, int G, int NV, int DP, int GX, int NVX, int DX, bool RL = true, int MB = 1>
ex_status_t launch_pk(const Args& a, bool vec_ok) {
    if (vec_ok && a.renormalize && a.K < G && a.K < a.E)
        return a.K == 8 ? launch_pkey<T, G, NV, DP, 8, RL, MB>(a, vec_ok)
                        : launch_pkey<T, G, NV, DP, 0, RL, MB>(a, vec_ok);
    return launch_k<T, GX, NVX, DX>(a, vec_ok);
}

// Group width G, vectors per lane NV and cache depth D for each E (capacity G * V * NV >= E,
// V = 16 / sizeof(T)), from H200 graph-replay timings of every candidate at T = 16384, K = 8
// (benchmarks/topk_variants/, not in the build): 4 rows to a warp (G = 8, a lane holds 1/8 of the row and
// keeps its 4 best) up to 128 (fp32) / 256 (16-bit) experts, 16 or 32 lanes per row beyond.
// E in 129..512 goes to the packed-key kernel where it applies (launch_pk), with the variant
// the same tuner timed fastest on the H200 (renormalize, K = 8, T = 16384, graph replay, µs,
// exact kernel -> packed-key): fp32 E=256 11.13 -> 10.38, E=384 13.57 -> 12.36, E=512 15.98 ->
// 14.68; bf16 E=256 10.54 -> 8.99, E=384 12.92 -> 11.39, E=512 15.36 -> 12.42.
template <typename T>
ex_status_t dispatch_fast(const Args& a) {
    const bool vec_ok = vectorisable(a, sizeof(T));
    const int E = a.E;
    if constexpr (sizeof(T) == 2) {  // 8 logits per vector
        if (E <= 8) return launch_k<T, 1, 1, 3>(a, vec_ok);
        if (E <= 16) return launch_k<T, 2, 1, 3>(a, vec_ok);
        if (E <= 32) return launch_k<T, 4, 1, 3>(a, vec_ok);
        if (E <= 64) return launch_k<T, 8, 1, 4>(a, vec_ok);
        if (E <= 128) return launch_k<T, 8, 2, 4>(a, vec_ok);
        if (E <= 256) return launch_pk<T, 16, 2, 3, 8, 4, 4>(a, vec_ok);
        if (E <= 384) return launch_pk<T, 16, 3, 3, 16, 3, 3, true, 4>(a, vec_ok);
        if (E <= 512) return launch_pk<T, 32, 2, 3, 32, 2, 3>(a, vec_ok);
        if (E <= 1024) return launch_k<T, 32, 4, 3>(a, vec_ok);
    } else {  // 4 logits per vector
        if (E <= 4) return launch_k<T, 1, 1, 3>(a, vec_ok);
        if (E <= 8) return launch_k<T, 2, 1, 3>(a, vec_ok);
        if (E <= 16) return launch_k<T, 4, 1, 3>(a, vec_ok);
        if (E <= 32) return launch_k<T, 8, 1, 3>(a, vec_ok);
        if (E <= 64) return launch_k<T, 8, 2, 4>(a, vec_ok);
        if (E <= 128) return launch_k<T, 8, 4, 4>(a, vec_ok);
        if (E <= 256) return launch_pk<T, 32, 2, 3, 16, 4, 3>(a, vec_ok);
        if (E <= 384) return launch_pk<T, 32, 3, 3, 32, 3, 3, false, 5>(a, vec_ok);
        if (E <= 512) return launch_pk<T, 32, 4, 3, 32, 4, 3>(a, vec_ok);
        if (E <= 1024) return launch_k<T, 32, 8, 3>(a, vec_ok);
    }
    return fail(EX_FALLBACK, "topk_softmax: fast path holds E <= %d in registers, got E=%d",
                kMaxFastExperts, E);
}

template <typename T>
ex_status_t launch_generic(const Args& a) {
    const int threads = g_threads;
    (void)explugin::launch_kernel(topk_softmax_generic_kernel<T>, grid_for(a.T, threads / 32), threads, 0,
                                  a.stream, explugin::pdl_enabled(), a.w, a.id,
                                  static_cast<const T*>(a.logits), a.T, a.E, a.K, a.renormalize);
    return check_launch();
}

// Shared argument checks.  Returns EX_OK and fills `a` when the call should launch; T == 0
// yields a status of EX_OK with a.T == 0 (nothing to do, pointers not required).
ex_status_t parse_args(void* output, const void* input, const void* aux_inputs[], int n_aux,
                       const int64_t dims[], int n_dims, void* stream, Args& a, int& dtype) {
    explugin::clear_error();
    if (dims == nullptr || n_dims < 5)                   // {T, E, K, renormalize, dtype}
        return fail(EX_ERR_INVALID_ARGUMENT, "topk_softmax: expected 5 dims {T, E, K, renormalize, dtype}, got %d", n_dims);
    if (aux_inputs == nullptr || n_aux < 1)              // aux[0] = topk_ids (T, K) int32
        return fail(EX_ERR_INVALID_ARGUMENT, "topk_softmax: expected 1 aux input (topk_ids), got %d", n_aux);
    const int64_t T = dims[0], E = dims[1], K = dims[2], renorm = dims[3], dt = dims[4];
    if (T < 0 || E < 0 || K < 0)
        return fail(EX_ERR_INVALID_ARGUMENT, "topk_softmax: dims must be >= 0, got T=%lld E=%lld K=%lld",
                    (long long)T, (long long)E, (long long)K);
    if (renorm != 0 && renorm != 1)
        return fail(EX_ERR_INVALID_ARGUMENT, "topk_softmax: renormalize must be 0 or 1, got %lld", (long long)renorm);
    if (dt != EX_DTYPE_FLOAT32 && dt != EX_DTYPE_FLOAT16 && dt != EX_DTYPE_BFLOAT16)
        return fail(EX_ERR_UNSUPPORTED_DTYPE, "topk_softmax: router_logits dtype must be float32, float16 or bfloat16 (0, 1, 2), got %lld", (long long)dt);
    // E <= 2^24 (the manifest's constraint): the generic kernel's lanes step over E in int32,
    // which wrapped for E within 31 of 2^31 (reads before the row; a static review, session 33)
    if (E < 1 || E > (int64_t(1) << 24))                 // 1 <= E <= 2^24
        return fail(EX_ERR_SHAPE, "topk_softmax: expected 1 <= E <= %lld, got E=%lld",
                    (long long)(int64_t(1) << 24), (long long)E);
    if (K < 1 || K > E)                                  // 1 <= K <= E
        return fail(EX_ERR_SHAPE, "topk_softmax: expected 1 <= K <= E, got K=%lld, E=%lld", (long long)K, (long long)E);
    a = Args{static_cast<float*>(output), nullptr, input, T, (int)E, (int)K, (int)renorm,
             static_cast<cudaStream_t>(stream)};
    dtype = (int)dt;
    if (T == 0) return EX_OK;
    if (output == nullptr || input == nullptr || aux_inputs[0] == nullptr)
        return fail(EX_ERR_INVALID_ARGUMENT, "topk_softmax: topk_weights, router_logits and topk_ids must not be NULL");
    a.id = static_cast<int32_t*>(const_cast<void*>(aux_inputs[0]));
    return EX_OK;
}

// Parses the call, then runs launch(T{}, args) with T the element type named in dims.
template <typename Launch>
int run_for_dtype(void* output, const void* input, const void* aux_inputs[], int n_aux,
                  const int64_t dims[], int n_dims, void* stream, Launch launch) {
    Args a;
    int dtype = 0;
    const ex_status_t st = parse_args(output, input, aux_inputs, n_aux, dims, n_dims, stream, a, dtype);
    if (st != EX_OK || a.T == 0) return st;
    return explugin::launch_for_dtype(dtype, a, launch);
}

int topk_softmax(void* output, const void* input, const void* aux_inputs[], int n_aux,
                 const int64_t dims[], int n_dims, void* stream) {
    return run_for_dtype(output, input, aux_inputs, n_aux, dims, n_dims, stream,
                         [](auto t, const Args& a) { return dispatch_fast<decltype(t)>(a); });
}

int topk_softmax_generic(void* output, const void* input, const void* aux_inputs[], int n_aux,
                         const int64_t dims[], int n_dims, void* stream) {
    return run_for_dtype(output, input, aux_inputs, n_aux, dims, n_dims, stream,
                         [](auto t, const Args& a) { return launch_generic<decltype(t)>(a); });
}

}  // namespace

// The kernels are written for 32-lane warps (group masks, redux.sync, 32 / G rows per warp):
// on hardware with another warp size (the BI-V100 schedules 64) the factor declines (NULL).
extern "C" EX_EXPORT ex_factor_t* ex_get_factor(const ex_hardware_t* hw) {
    if (hw == nullptr || hw->warp_size != 32 || hw->max_threads_per_block < 32) return nullptr;
    const int threads = explugin::block_threads(hw, kMaxThreads);
    g_threads = threads;
    explugin::g_pdl_hw = hw->cc_major >= 9;
    g_factor.abi_version = EX_ABI_VERSION;
    g_factor.factor_id = EX_FACTOR_TOPK_SOFTMAX;
    g_factor.name = "topk_softmax";
    g_factor.version = "0.1.0";
    g_factor.tuning.threads_per_block = threads;
    g_factor.tuning.items_per_thread = 32;  // at most 32 logits per lane held in registers
    g_factor.tuning.vec_size = 8;           // 16-byte loads of 16-bit logits (4 for float32)
    g_factor.tuning.shared_mem_bytes = 0;
    g_factor.tuning.num_warps = threads / 32;
    g_factor.tuning.num_stages = 1;
    g_factor.kernel = topk_softmax;
    g_factor.kernel_fallback = topk_softmax_generic;
    g_factor.workspace_size = nullptr;
    g_factor.last_error = explugin::last_error;
    g_factor.priority = 0;
    g_factor.reserved_i32 = 0;
    g_factor.description =
        "router: fp32 softmax over E logits, top-K from per-lane register caches by group reductions (E <= 1024; any E via fallback)";
    return &g_factor;
}

/*
 * topk_softmax.cu -- factor 0: the MoE router (manifests/topk_softmax.yaml).
 *
 *   p[t, e]            = exp(l[t, e] - m[t]) / sum_j exp(l[t, j] - m[t]),  m[t] = max_j l[t, j]  (fp32)
 *   topk_ids[t, :]     = the K experts of largest l[t, e], ties to the lowest index, distinct
 *   topk_weights[t, k] = p[t, topk_ids[t, k]]   (/ sum_k of them when renormalize), rank order
 *
 *   NaN ranks as -inf and gets p = 0; if m = +inf the +inf entries share 1 equally; if every
 *   logit of a row is -inf or NaN, p = 1/E for every expert (ids 0..K-1).
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
 *   topk_softmax_kernel<T, G, NV>     the fast path, E <= 1024.  A group of G lanes owns a row
 *       (32/G rows per warp); each lane loads NV 16-byte vectors of the row once and keeps them
 *       in registers.  Every element becomes one unsigned "composite" key that orders like
 *       (logit desc, index asc) with NaN -> -inf and -0 -> +0, so a single max finds the winner
 *       and its index at once: bf16 keeps 16 value bits above 16 index bits, fp16 19 above 13
 *       (the bits an fp16 value uses in fp32), fp32 a 64-bit key.  Each lane caches the top 3
 *       keys it holds; the K rounds are a group-wide max (redux.sync for G >= 16, xor shuffles
 *       below), the owning lane pops its cache, and only a lane that runs out of cache rescans
 *       its registers (for keys below the one it just gave up).
 *   topk_softmax_generic_kernel<T>    kernel_fallback, any E: one warp per row, K passes over
 *       the row in global memory (cached), the same keys and the same probability rule.
 *   The fast kernel returns EX_FALLBACK (-1) for E > 1024 and the runtime calls the generic one.
 *
 * Napkin math (H200, 4.2 TB/s): T=16384, E=128, K=8, bf16 reads 4.2 MB of logits and writes
 * 1.0 MB of weights and ids: 1.25 us of memory traffic.  E=384: 13.6 MB, 3.2 us.  The work is
 * the K rounds (one group max each) and one exp per logit; target max(2 x bytes time, 8 us).
 */
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include <climits>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "ex_engine.h"

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

// Per element type: how a logit is stored in the raw registers, and its composite key.
// A composite is > 0 for every real element; 0 marks "none".
template <typename T>
struct Logit;

template <>
struct Logit<float> {
    using Comp = uint64_t;
    static constexpr int kElemsPerWord = 1;
    static constexpr uint32_t kNegInfBits = 0xFF800000u;
    __device__ static float to_float(uint32_t bits) { return __uint_as_float(bits); }
    __device__ static Comp make(float f, uint32_t idx) {
        return ((uint64_t)ordered_key(f) << 32) | (uint64_t)(0xFFFFFFFFu - idx);
    }
    __device__ static float value(Comp c) { return __uint_as_float(key_to_bits((uint32_t)(c >> 32))); }
    __device__ static int index(Comp c) { return (int)(0xFFFFFFFFu - (uint32_t)c); }
};

// 16-bit types: the value occupies the top (32 - kLowBits) bits of its fp32 ordered key
// (exactly: conversion to fp32 is exact and leaves the low kLowBits bits of the float zero),
// and the low kLowBits bits hold (2^kLowBits - 1 - index).  kLowBits >= 13 > log2(1024).
template <int kLowBits, uint32_t kNegInf16>
struct Logit16 {
    using Comp = uint32_t;
    static constexpr int kElemsPerWord = 2;
    static constexpr uint32_t kNegInfBits = kNegInf16;
    static constexpr uint32_t kLowMax = (1u << kLowBits) - 1u;
    static constexpr uint32_t kHighMask = ~kLowMax;
    __device__ static Comp make(float f, uint32_t idx) {
        return (ordered_key(f) & kHighMask) | (kLowMax - idx);
    }
    __device__ static float value(Comp c) {
        return __uint_as_float(key_to_bits(c & kHighMask) & kHighMask);
    }
    __device__ static int index(Comp c) { return (int)(kLowMax - (c & kLowMax)); }
};

template <>
struct Logit<__nv_bfloat16> : Logit16<16, 0xFF80u> {
    __device__ static float to_float(uint32_t bits16) { return __uint_as_float(bits16 << 16); }
};

template <>
struct Logit<__half> : Logit16<13, 0xFC00u> {
    __device__ static float to_float(uint32_t bits16) {
        return __half2float(__ushort_as_half((unsigned short)bits16));
    }
};

// ------------------------------------------------------------------------------------------
// Group reductions: G consecutive lanes (G a power of two) own one row
// ------------------------------------------------------------------------------------------

template <int G>
__device__ __forceinline__ uint32_t group_mask(int lane) {
    if constexpr (G == 32) return 0xFFFFFFFFu;
    else return ((1u << G) - 1u) << (lane & ~(G - 1));
}

// Every lane of the warp must call these (uniform control flow).
template <int G>
__device__ __forceinline__ uint32_t group_max(uint32_t v, int lane) {
    if constexpr (G == 1) {
        return v;
    } else if constexpr (G >= 16) {
        return __reduce_max_sync(group_mask<G>(lane), v);
    } else {
#pragma unroll
        for (int o = G / 2; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
        return v;
    }
}

template <int G>
__device__ __forceinline__ uint64_t group_max(uint64_t v, int lane) {
    if constexpr (G == 1) {
        return v;
    } else if constexpr (G >= 16) {
        const uint32_t mask = group_mask<G>(lane);
        const uint32_t vhi = (uint32_t)(v >> 32);
        const uint32_t hi = __reduce_max_sync(mask, vhi);
        const uint32_t lo = __reduce_max_sync(mask, vhi == hi ? (uint32_t)v : 0u);
        return ((uint64_t)hi << 32) | lo;
    } else {
#pragma unroll
        for (int o = G / 2; o > 0; o >>= 1) {
            const uint64_t w = __shfl_xor_sync(0xFFFFFFFFu, v, o);
            v = w > v ? w : v;
        }
        return v;
    }
}

// Butterfly sum: every lane of the group ends with the same value (same tree, commutative adds).
template <int G>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
}

__device__ __forceinline__ uint64_t warp_max_u64(uint64_t v) { return group_max<32>(v, 0); }

// ------------------------------------------------------------------------------------------
// Probability of one logit given the row's max m and normaliser S (see the header rule)
// ------------------------------------------------------------------------------------------

// Unnormalised weight u(l): exp(l - m) for finite m (NaN -> 0); for m = +inf, 1 on +inf
// entries and 0 elsewhere; for m = -inf (all -inf or NaN), 1 everywhere.  S = sum of u.
__device__ __forceinline__ float unnormalised(float l, float m) {
    if (isfinite(m)) return __expf(fmaxf(l - m, -INFINITY));  // NaN - m = NaN -> -inf -> 0
    if (m > 0.0f) return l == INFINITY ? 1.0f : 0.0f;
    return 1.0f;
}

// Keep the three largest composites a >= b >= c (duplicates never occur but 0 may).
template <typename Comp>
__device__ __forceinline__ void insert3(Comp x, Comp& a, Comp& b, Comp& c) {
    const Comp a2 = x > a ? x : a;
    const Comp x1 = x > a ? a : x;
    const Comp b2 = x1 > b ? x1 : b;
    const Comp x2 = x1 > b ? b : x1;
    a = a2;
    b = b2;
    c = x2 > c ? x2 : c;
}

// ------------------------------------------------------------------------------------------
// Fast kernel: G lanes per row, NV 16-byte vectors per lane, rows in registers
// ------------------------------------------------------------------------------------------

template <typename T, int G, int NV>
__global__ void __launch_bounds__(kMaxThreads)
topk_softmax_kernel(float* __restrict__ out_w,          // (T, K)
                    int32_t* __restrict__ out_id,       // (T, K)
                    const T* __restrict__ logits,       // (T, E)
                    int64_t n_rows, int E, int K, int renormalize, int vec_ok) {
    using L = Logit<T>;
    using Comp = typename L::Comp;
    constexpr int V = 16 / (int)sizeof(T);  // elements per 16-byte vector
    constexpr int EPL = V * NV;             // elements per lane
    constexpr int R = 32 / G;               // rows per warp
    constexpr int WORDS = NV * 4;           // 32-bit registers holding the lane's raw logits
    constexpr int EPW = L::kElemsPerWord;
    static_assert(G >= 1 && G <= 32 && (G & (G - 1)) == 0, "G must be a power of two <= 32");

    const int lane = threadIdx.x & 31;
    const int g = lane & (G - 1);  // lane within the row's group
    const int sub = lane / G;      // row within the warp
    const int warps_per_block = blockDim.x >> 5;
    const int64_t warp_stride = (int64_t)gridDim.x * warps_per_block;

    // Element k of a lane (k = j * V + v, vector j, slot v) is expert j*G*V + g*V + v.
    const int gbase = g * V;

    for (int64_t wr = (int64_t)blockIdx.x * warps_per_block + (threadIdx.x >> 5); wr * R < n_rows;
         wr += warp_stride) {
        const int64_t t = wr * R + sub;
        const bool row_ok = t < n_rows;
        const int lim = row_ok ? E : 0;  // experts below lim are real

        // ---- load the lane's logits once (invalid slots read as -inf) -----------------------
        uint32_t raw[WORDS];
        const uint32_t fill = EPW == 2 ? (L::kNegInfBits | (L::kNegInfBits << 16)) : L::kNegInfBits;
        if (vec_ok) {
            const uint4* row = reinterpret_cast<const uint4*>(logits + (row_ok ? t : 0) * (int64_t)E);
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                uint4 q = make_uint4(fill, fill, fill, fill);
                if (j * G * V + gbase < lim) q = __ldg(row + (j * G * V + gbase) / V);
                raw[4 * j + 0] = q.x;
                raw[4 * j + 1] = q.y;
                raw[4 * j + 2] = q.z;
                raw[4 * j + 3] = q.w;
            }
        } else {
            const T* row = logits + (row_ok ? t : 0) * (int64_t)E;
#pragma unroll
            for (int w = 0; w < WORDS; ++w) raw[w] = 0;
#pragma unroll
            for (int k = 0; k < EPL; ++k) {
                const int idx = (k / V) * G * V + gbase + (k % V);
                uint32_t bits;
                if constexpr (EPW == 2) {
                    bits = idx < lim ? (uint32_t)__ldg(reinterpret_cast<const unsigned short*>(row) + idx)
                                     : L::kNegInfBits;
                    raw[k / 2] |= bits << (16 * (k & 1));
                } else {
                    bits = idx < lim ? __ldg(reinterpret_cast<const uint32_t*>(row) + idx) : L::kNegInfBits;
                    raw[k] = bits;
                }
            }
        }

        auto elem = [&](int k) -> float {  // k is a compile-time constant in every unrolled use
            if constexpr (EPW == 2) return L::to_float((raw[k / 2] >> (16 * (k & 1))) & 0xFFFFu);
            else return L::to_float(raw[k]);
        };
        auto elem_idx = [&](int k) -> int { return (k / V) * G * V + gbase + (k % V); };

        // ---- the lane's three largest composites ----------------------------------------------
        Comp c0 = 0, c1 = 0, c2 = 0;
#pragma unroll
        for (int k = 0; k < EPL; ++k) {
            const int idx = elem_idx(k);
            if (idx < lim) insert3(L::make(elem(k), (uint32_t)idx), c0, c1, c2);
        }

        // ---- row max (NaN ignored) and the softmax normaliser --------------------------------
        const Comp w0 = group_max<G>(c0, lane);
        const float m = L::value(w0);  // decoded from the top key: -inf if all -inf / NaN
        float s = 0.0f;
        if (isfinite(m)) {
#pragma unroll
            for (int k = 0; k < EPL; ++k) s += __expf(fmaxf(elem(k) - m, -INFINITY));
        } else if (m > 0.0f) {
#pragma unroll
            for (int k = 0; k < EPL; ++k) s += elem(k) == INFINITY ? 1.0f : 0.0f;
        } else {
            s = g == 0 ? (float)E : 0.0f;
        }
        s = group_sum<G>(s);  // every lane of the group holds S

        // ---- K rounds of group-wide argmax ---------------------------------------------------
        Comp mine = 0;        // K <= G: lane g keeps the winner of round g
        float psum_l = 0.0f;  // K > G: sum of the weights this lane wrote
        Comp w = w0;
        for (int r = 0; r < K; ++r) {
            if (r > 0) w = group_max<G>(c0, lane);
            if (w != 0 && c0 == w) {  // this lane holds the winner: pop it
                c0 = c1;
                c1 = c2;
                c2 = 0;
                if (c0 == 0 && r + 1 < K) {  // cache empty: refill from keys below the winner
#pragma unroll
                    for (int k = 0; k < EPL; ++k) {
                        const int idx = elem_idx(k);
                        const Comp x = L::make(elem(k), (uint32_t)idx);
                        if (idx < lim && x < w) insert3(x, c0, c1, c2);
                    }
                }
            }
            if (K <= G) {
                if (g == r) mine = w;
            } else if (g == (r & (G - 1))) {
                const float p = unnormalised(L::value(w), m) / s;
                psum_l += p;
                if (row_ok) {
                    out_w[t * K + r] = p;
                    out_id[t * K + r] = L::index(w);
                }
            }
        }

        // ---- weights out -----------------------------------------------------------------------
        if (K <= G) {
            const float p = g < K ? unnormalised(L::value(mine), m) / s : 0.0f;
            const float psum = renormalize ? group_sum<G>(p) : 1.0f;
            if (row_ok && g < K) {
                out_w[t * K + g] = renormalize ? p / psum : p;
                out_id[t * K + g] = L::index(mine);
            }
        } else if (renormalize) {
            const float psum = group_sum<G>(psum_l);
            if (row_ok) {
                for (int r = g; r < K; r += G) out_w[t * K + r] = out_w[t * K + r] / psum;  // own writes
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
        return Logit<T>::to_float(b);
    }
}

template <typename T>
__global__ void __launch_bounds__(kMaxThreads)
topk_softmax_generic_kernel(float* __restrict__ out_w, int32_t* __restrict__ out_id,
                            const T* __restrict__ logits, int64_t n_rows, int E, int K,
                            int renormalize) {
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
                for (int e = lane; e < E; e += 32) acc += unnormalised(load_float(row + e), m);
                s = group_sum<32>(acc);
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

thread_local char g_last_error[256] = "";
ex_factor_t g_factor;
int g_threads = kMaxThreads;  // threads per block, set from the hardware by ex_get_factor

ex_status_t fail(ex_status_t st, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
ex_status_t fail(ex_status_t st, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_last_error, sizeof g_last_error, fmt, ap);
    va_end(ap);
    return st;
}

ex_status_t check_launch() {
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
        return fail(EX_ERR_CUDA, "%s: %s", cudaGetErrorName(err), cudaGetErrorString(err));
    return EX_OK;
}

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

template <typename T, int G, int NV>
ex_status_t launch_fast(const Args& a, bool vec_ok) {
    static_assert(G * (16 / (int)sizeof(T)) * NV <= kMaxFastExperts, "capacity above the fast range");
    const int threads = g_threads;
    const int64_t rows_per_block = (int64_t)(threads / 32) * (32 / G);
    topk_softmax_kernel<T, G, NV><<<grid_for(a.T, rows_per_block), threads, 0, a.stream>>>(
        a.w, a.id, static_cast<const T*>(a.logits), a.T, a.E, a.K, a.renormalize, vec_ok ? 1 : 0);
    return check_launch();
}

// Group width G and vectors per lane NV for each E: about 16..32 logits per lane, and rows
// packed several to a warp when E is small.  Capacity G * (16 / sizeof(T)) * NV >= E.
template <typename T>
ex_status_t dispatch_fast(const Args& a) {
    const bool vec_ok = (reinterpret_cast<uintptr_t>(a.logits) % 16 == 0) &&
                        ((int64_t)a.E * (int64_t)sizeof(T)) % 16 == 0;
    const int E = a.E;
    if constexpr (sizeof(T) == 2) {  // 8 logits per vector
        if (E <= 8) return launch_fast<T, 1, 1>(a, vec_ok);
        if (E <= 16) return launch_fast<T, 1, 2>(a, vec_ok);
        if (E <= 32) return launch_fast<T, 2, 2>(a, vec_ok);
        if (E <= 64) return launch_fast<T, 4, 2>(a, vec_ok);
        if (E <= 128) return launch_fast<T, 8, 2>(a, vec_ok);
        if (E <= 256) return launch_fast<T, 16, 2>(a, vec_ok);
        if (E <= 384) return launch_fast<T, 16, 3>(a, vec_ok);
        if (E <= 512) return launch_fast<T, 16, 4>(a, vec_ok);
        if (E <= 1024) return launch_fast<T, 32, 4>(a, vec_ok);
    } else {  // 4 logits per vector
        if (E <= 4) return launch_fast<T, 1, 1>(a, vec_ok);
        if (E <= 8) return launch_fast<T, 1, 2>(a, vec_ok);
        if (E <= 16) return launch_fast<T, 2, 2>(a, vec_ok);
        if (E <= 32) return launch_fast<T, 4, 2>(a, vec_ok);
        if (E <= 64) return launch_fast<T, 8, 2>(a, vec_ok);
        if (E <= 128) return launch_fast<T, 16, 2>(a, vec_ok);
        if (E <= 256) return launch_fast<T, 16, 4>(a, vec_ok);
        if (E <= 512) return launch_fast<T, 32, 4>(a, vec_ok);
        if (E <= 1024) return launch_fast<T, 32, 8>(a, vec_ok);
    }
    return fail(EX_FALLBACK, "topk_softmax: fast path holds E <= %d in registers, got E=%d",
                kMaxFastExperts, E);
}

template <typename T>
ex_status_t launch_generic(const Args& a) {
    const int threads = g_threads;
    topk_softmax_generic_kernel<T><<<grid_for(a.T, threads / 32), threads, 0, a.stream>>>(
        a.w, a.id, static_cast<const T*>(a.logits), a.T, a.E, a.K, a.renormalize);
    return check_launch();
}

// Shared argument checks.  Returns EX_OK and fills `a` when the call should launch; T == 0
// yields a status of EX_OK with a.T == 0 (nothing to do, pointers not required).
ex_status_t parse_args(void* output, const void* input, const void* aux_inputs[], int n_aux,
                       const int64_t dims[], int n_dims, void* stream, Args& a, int& dtype) {
    g_last_error[0] = '\0';
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
    if (E < 1 || E > INT_MAX)                            // 1 <= E
        return fail(EX_ERR_SHAPE, "topk_softmax: expected 1 <= E <= %d, got E=%lld", INT_MAX, (long long)E);
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
    switch (dtype) {
        case EX_DTYPE_FLOAT32: return launch(float{}, a);
        case EX_DTYPE_FLOAT16: return launch(__half{}, a);
        default: return launch(__nv_bfloat16{}, a);
    }
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

const char* topk_softmax_last_error() { return g_last_error; }

}  // namespace

// The kernels are written for 32-lane warps (group masks, redux.sync, 32 / G rows per warp):
// on hardware with another warp size (the BI-V100 schedules 64) the factor declines (NULL).
extern "C" EX_EXPORT ex_factor_t* ex_get_factor(const ex_hardware_t* hw) {
    if (hw == nullptr || hw->warp_size != 32 || hw->max_threads_per_block < 32) return nullptr;
    const int threads = hw->max_threads_per_block >= kMaxThreads ? kMaxThreads
                                                                 : (hw->max_threads_per_block / 32) * 32;
    g_threads = threads;
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
    g_factor.last_error = topk_softmax_last_error;
    g_factor.priority = 0;
    g_factor.reserved_i32 = 0;
    g_factor.description =
        "router: fp32 softmax over E logits, top-K by group-wide argmax in registers (E <= 1024; any E via fallback)";
    return &g_factor;
}

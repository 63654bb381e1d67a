// Variant tuner for topk_softmax (not part of the build): includes the factor source and exposes
// one launcher per (kernel, G, NV, D) so one device call can time and check them all.
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a
//        -Xcompiler -fPIC -shared -Iinclude -Ifactors -o benchmarks/topk_variants/tune.so \
//        benchmarks/topk_variants/tune.cu        (from the repository root; run_tune.py runs it)
#define TOPK_TUNE_COUNTERS 1
#include "topk_softmax.cu"

namespace {

template <typename T, int G, int NV, int D, bool RL, int MB>
int v_old(const Args& a) {
    const bool vec_ok = vectorisable(a, sizeof(T));
    return launch_k<T, G, NV, D>(a, vec_ok);
}

template <typename T, int G, int NV, int D, bool RL, int MB>
int v_pk(const Args& a) {
    const bool vec_ok = vectorisable(a, sizeof(T));
    if (!(vec_ok && a.K < G && a.K < a.E)) return launch_k<T, G, NV, 3>(a, vec_ok);
    return a.K == 8 ? launch_pkey<T, G, NV, D, 8, RL, MB>(a, vec_ok) : launch_pkey<T, G, NV, D, 0, RL, MB>(a, vec_ok);
}

template <typename T, int G, int NV, int D, bool RL, int MB>
int r_old() {
    cudaFuncAttributes at;
    if (cudaFuncGetAttributes(&at, topk_softmax_kernel<T, G, NV, D, 2, 8>) != cudaSuccess) return -1;
    return at.numRegs;
}

template <typename T, int G, int NV, int D, bool RL, int MB>
int r_pk() {
    cudaFuncAttributes at;
    if (cudaFuncGetAttributes(&at, topk_softmax_pkey_kernel<T, G, NV, D, 8, RL, MB>) != cudaSuccess) return -1;
    return at.numRegs;
}

// capacity G * 16/sizeof(T) * NV must be >= E (the caller checks)
// id, kind, G, NV, D, RL (reload for refill / exact path), MB (min blocks per SM)
#define VARIANTS_F32(X)                  \
    X(0, old, 32, 3, 3, true, 1)         \
    X(1, old, 16, 6, 3, true, 1)         \
    X(2, pk, 32, 3, 3, true, 1)          \
    X(3, pk, 32, 3, 2, true, 1)          \
    X(4, pk, 16, 6, 3, true, 1)          \
    X(5, pk, 16, 6, 2, true, 1)          \
    X(6, pk, 32, 3, 3, false, 1)         \
    X(7, pk, 32, 3, 3, false, 5)         \
    X(8, pk, 32, 3, 3, true, 6)          \
    X(9, pk, 32, 3, 2, true, 8)          \
    X(10, old, 8, 4, 4, true, 1)         \
    X(11, pk, 16, 2, 3, true, 1)         \
    X(12, pk, 16, 2, 2, true, 1)         \
    X(13, pk, 32, 1, 2, true, 1)         \
    X(20, old, 8, 2, 4, true, 1)         \
    X(21, pk, 16, 1, 2, true, 1)         \
    X(22, pk, 16, 1, 3, true, 1)         \
    X(30, old, 16, 4, 3, true, 1)        \
    X(31, pk, 16, 4, 3, true, 1)         \
    X(32, pk, 32, 2, 3, true, 1)         \
    X(33, pk, 32, 2, 2, true, 1)         \
    X(40, old, 32, 4, 3, true, 1)        \
    X(41, pk, 32, 4, 3, true, 1)         \
    X(42, pk, 32, 4, 2, true, 1)

#define VARIANTS_16(X)                   \
    X(50, old, 16, 3, 3, true, 1)        \
    X(51, pk, 16, 3, 3, true, 1)         \
    X(52, pk, 16, 3, 2, true, 1)         \
    X(53, pk, 32, 2, 2, true, 1)         \
    X(54, pk, 32, 2, 3, true, 1)         \
    X(55, pk, 16, 3, 3, false, 1)        \
    X(56, pk, 16, 3, 3, true, 4)         \
    X(60, old, 8, 2, 4, true, 1)         \
    X(61, pk, 16, 1, 2, true, 1)         \
    X(62, pk, 16, 1, 3, true, 1)         \
    X(70, old, 8, 4, 4, true, 1)         \
    X(71, pk, 16, 2, 3, true, 1)         \
    X(72, pk, 32, 1, 3, true, 1)         \
    X(73, pk, 32, 1, 2, true, 1)         \
    X(80, old, 32, 2, 3, true, 1)        \
    X(81, pk, 32, 2, 3, true, 1)         \
    X(82, pk, 32, 2, 2, true, 1)

#define LAUNCH(id, kind, G, NV, D, RL, MB) \
    case id: return v_##kind<T, G, NV, D, RL, MB>(a);
#define REGS(id, kind, G, NV, D, RL, MB) \
    case id: return r_##kind<T, G, NV, D, RL, MB>();

// variant v of the table for T's size (only that table is instantiated); -100: no such variant
template <typename T>
int run(int v, const Args& a) {
    if constexpr (sizeof(T) == 4) {
        switch (v) { VARIANTS_F32(LAUNCH) }
    } else {
        switch (v) { VARIANTS_16(LAUNCH) }
    }
    return -100;
}

template <typename T>
int regs(int v) {
    if constexpr (sizeof(T) == 4) {
        switch (v) { VARIANTS_F32(REGS) }
    } else {
        switch (v) { VARIANTS_16(REGS) }
    }
    return -100;
}
#undef LAUNCH
#undef REGS

}  // namespace

// dtype 0 fp32 (variants < 50), 1 fp16 / 2 bf16 (variants >= 50).  Returns EX_OK or an error.
extern "C" EX_EXPORT int tune_launch(int v, int dtype, void* w, void* ids, const void* logits, long long T,
                                     int E, int K, int renorm, void* stream) {
    Args a{static_cast<float*>(w), static_cast<int32_t*>(ids), logits, (int64_t)T, E, K, renorm,
           static_cast<cudaStream_t>(stream)};
    g_threads = kMaxThreads;
    if (dtype == 0) return run<float>(v, a);
    if (dtype == 1) return run<__half>(v, a);
    return run<__nv_bfloat16>(v, a);
}

extern "C" EX_EXPORT int tune_regs(int v, int dtype) {
    if (dtype == 0) return regs<float>(v);
    if (dtype == 1) return regs<__half>(v);
    return regs<__nv_bfloat16>(v);
}

extern "C" EX_EXPORT unsigned long long tune_exact_warps(int reset) {
    unsigned long long n = 0;
    cudaMemcpyFromSymbol(&n, g_tune_exact_warps, sizeof n);
    if (reset) {
        const unsigned long long z = 0;
        cudaMemcpyToSymbol(g_tune_exact_warps, &z, sizeof z);
    }
    return n;
}

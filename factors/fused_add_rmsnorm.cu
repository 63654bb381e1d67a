/*
 * fused_add_rmsnorm.cu -- factor 1 (manifests/fused_add_rmsnorm.yaml), in place:
 *
 *   r           = residual[t] + x[t]                               (fp32)
 *   residual[t] = round(r)                                         (to the tensors' dtype)
 *   x[t]        = round(residual[t] * rsqrt(sum_h residual[t,h]^2 / H + eps) * weight)
 *
 *   The normalised value is the residual as rounded to its dtype (as vLLM's
 *   fused_add_rms_norm); sum, rsqrt and products in fp32, one rounding at the end.
 *   A row whose sum of squares overflows fp32 (|r| past ~1.8e19 / sqrt(H); float32 and bfloat16
 *   reach it) while every r is finite gets the same rsqrt computed on r / max|r| (rescued_inv_rms),
 *   not zeros; a row holding an inf or NaN keeps the plain formula's IEEE result.
 *
 * Shapes and dtypes (x, residual, weight all one dtype: float32 | float16 | bfloat16)
 *   output = input = x  (T, H), rows x_row_stride elements apart   (read and written)
 *   aux[0]  residual    (T, H), rows residual_row_stride apart       (read and written)
 *   aux[1]  weight      (H)
 *   dims    {T, H, dtype, eps_bits (the IEEE-754 double's bits), x_row_stride, residual_row_stride}
 *   Strides >= H.  Elements past H in a row are never touched.
 *
 * Build: make factors/fused_add_rmsnorm.so
 *
 * Variants
 *   fused_add_rmsnorm_kernel<T, VEC, VPT, NT>  the fast path: one block of NT threads per row,
 *       each thread owns VPT packs of VEC elements.  VEC = 16 bytes / element when H * elem, both strides and all
 *       base pointers are 16-byte aligned, VEC = 1 otherwise.  The row's x, residual and weight
 *       are loaded once (all loads in flight before the first use), the rounded residual stays in
 *       registers through the block reduction (one barrier per row), then x is written.
 *       NT is a template parameter so that the VPT offsets fold into the loads' immediates.
 *       Holds H <= 2048 * VEC (vector) or H <= 4096 (scalar) with 256 threads; beyond that it
 *       returns EX_FALLBACK (-1).
 *   fused_add_rmsnorm_generic_kernel<T>    kernel_fallback: any H, any alignment; one block per
 *       row, two passes over global memory (the residual it wrote is read back).
 *
 * Napkin math (H200, 4.2 TB/s): bytes = T * H * elem * 4 (read x, residual; write both), the
 * weight comes from L2 or L1.  T=16384, H=4096 bf16: 537 MB -> 128 us; T=4096, H=2048: 67 MB -> 16 us.
 * Target >= 85% of the copy bandwidth for T=16384, H=2048..8192 bf16.
 */
#define EX_PLUGIN_FILE "fused_add_rmsnorm.so"  // names this library in its messages (ex_plugin.cuh)

#include <cuda_runtime.h>
#include <cfloat>
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

constexpr int kMaxThreads = 256;  // threads per block the kernels are built for

// ------------------------------------------------------------------------------------------
// Element conversions: VEC elements <-> VEC floats (pairs for the 16-bit types)
// ------------------------------------------------------------------------------------------

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
    T v[VEC];
};

template <typename T>
struct Num;

template <>
struct Num<float> {
    __device__ static float to_f(float v) { return v; }
    __device__ static float from_f(float v) { return v; }
};

template <>
struct Num<__half> {
    using T2 = __half2;
    __device__ static float to_f(__half v) { return __half2float(v); }
    __device__ static __half from_f(float v) { return __float2half_rn(v); }
    __device__ static float2 to_f2(T2 v) { return __half22float2(v); }
    __device__ static T2 from_f2(float a, float b) { return __floats2half2_rn(a, b); }
};

// bf16 -> fp32 by moving the bits up (exact).  The header's conversion goes through cvt.f32.bf16
// on sm_90, whose unpacking into 16-bit registers cost ptxas ~40 more registers per thread here.
template <>
struct Num<__nv_bfloat16> {
    using T2 = __nv_bfloat162;
    __device__ static float to_f(__nv_bfloat16 v) {
        return __uint_as_float((uint32_t)__bfloat16_as_ushort(v) << 16);
    }
    __device__ static __nv_bfloat16 from_f(float v) { return __float2bfloat16_rn(v); }
    __device__ static float2 to_f2(T2 v) {
        uint32_t u;
        memcpy(&u, &v, sizeof u);
        return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xFFFF0000u));
    }
    __device__ static T2 from_f2(float a, float b) { return __floats2bfloat162_rn(a, b); }
};

template <typename T, int VEC>
__device__ __forceinline__ void to_float(const Pack<T, VEC>& p, float (&f)[VEC]) {
    if constexpr (sizeof(T) == 2 && VEC % 2 == 0) {
        using T2 = typename Num<T>::T2;
        const T2* p2 = reinterpret_cast<const T2*>(p.v);
#pragma unroll
        for (int i = 0; i < VEC / 2; ++i) {
            const float2 q = Num<T>::to_f2(p2[i]);
            f[2 * i] = q.x;
            f[2 * i + 1] = q.y;
        }
    } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) f[i] = Num<T>::to_f(p.v[i]);
    }
}

template <typename T, int VEC>
__device__ __forceinline__ void from_float(const float (&f)[VEC], Pack<T, VEC>& p) {
    if constexpr (sizeof(T) == 2 && VEC % 2 == 0) {
        using T2 = typename Num<T>::T2;
        T2* p2 = reinterpret_cast<T2*>(p.v);
#pragma unroll
        for (int i = 0; i < VEC / 2; ++i) p2[i] = Num<T>::from_f2(f[2 * i], f[2 * i + 1]);
    } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) p.v[i] = Num<T>::from_f(f[i]);
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
}

// Sum of `v` over the block, the same value in every thread (fixed order: deterministic).
// `buf` alternates between two halves from one call to the next, so one barrier per call
// suffices: a warp can only overwrite a half after every warp passed the next call's barrier,
// that is after every thread finished reading it.
__device__ __forceinline__ float block_sum(float v, float (&buf)[2][32], int parity) {
    v = warp_sum(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    if (lane == 0) buf[parity][warp] = v;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < nwarps; ++w) total += buf[parity][w];
    return total;
}

// A block reduction (sum, or max with kMax) with a barrier before and after, so that it may
// reuse buf[parity] right after block_sum's read of it, and the next row's block_sum may reuse
// it right after: for the rare path below only (three barriers).
template <bool kMax>
__device__ __forceinline__ float block_reduce_fenced(float v, float (&buf)[2][32], int parity) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float u = __shfl_xor_sync(0xFFFFFFFFu, v, o);
        v = kMax ? fmaxf(v, u) : v + u;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    __syncthreads();  // every thread has read buf[parity] of the reduction before
    if (lane == 0) buf[parity][warp] = v;
    __syncthreads();
    float r = 0.0f;
    for (int w = 0; w < nwarps; ++w) r = kMax ? fmaxf(r, buf[parity][w]) : r + buf[parity][w];
    __syncthreads();  // every thread has read it before the next reduction writes
    return r;
}

// |v| for the row's largest magnitude, NaN as +inf (so that a NaN row is not rescued)
__device__ __forceinline__ float mag(float v) { return v == v ? fabsf(v) : INFINITY; }

// The sum of squares overflowed fp32 (|r| past ~1.8e19 / sqrt(H)) or a value is inf or NaN.
// Where every value is finite, rsqrt(sum r^2 / H + eps) is computed again on the row scaled by
// its largest magnitude amax: rsqrt(sum (r / amax)^2 / H + eps / amax^2) / amax; else (an inf
// or NaN in the row) the result of the plain formula stands, as IEEE arithmetic gives it.
// Block-uniform (total is the same in every thread); rare: no cost on rows in range.
// each_r(f): calls f(r) on every value r of the row that this thread holds (its part of the
// row, in its own order); called twice, for the largest mag() and for the sum of (r / amax)^2.
template <class EachR>
__device__ __forceinline__ float rescued_inv_rms(float inv_rms, float total, int H, float eps, float (&buf)[2][32],
                                                 int parity, EachR each_r) {
    if (total <= FLT_MAX) return inv_rms;  // finite: nothing overflowed
    float m = 0.0f;
    each_r([&](float r) { m = fmaxf(m, mag(r)); });
    const float amax = block_reduce_fenced<true>(m, buf, parity);
    if (!(amax <= FLT_MAX) || amax == 0.0f) return inv_rms;  // an inf or NaN in the row
    const float scale = 1.0f / amax;
    float q = 0.0f;
    each_r([&](float r) { q = fmaf(r * scale, r * scale, q); });
    const float s2 = block_reduce_fenced<false>(q, buf, parity);
    return rsqrtf(s2 / (float)H + eps / amax / amax) / amax;
}

// ------------------------------------------------------------------------------------------
// Fast kernel: one block per row, the row in registers
// ------------------------------------------------------------------------------------------

template <typename T, int VEC, int VPT, int NT>
__global__ void __launch_bounds__(NT)
fused_add_rmsnorm_kernel(T* x_out,                      // (T, H) stride x_stride, may equal x_in
                         const T* x_in,                 // (T, H) stride x_stride
                         T* residual,                   // (T, H) stride r_stride
                         const T* __restrict__ weight,  // (H)
                         int64_t n_rows, int H, int64_t x_stride, int64_t r_stride, float eps) {
    explugin::pdl_wait();  // launched with PDL: the previous kernel's writes are visible
    explugin::pdl_launch_dependents();
    using P = Pack<T, VEC>;
    __shared__ float red[2][32];
    const int npack = H / VEC;  // H % VEC == 0 on this path
    const int tid = threadIdx.x;
    const P* wrow = reinterpret_cast<const P*>(weight);
    int parity = 0;
    for (int64_t row = blockIdx.x; row < n_rows; row += gridDim.x, parity ^= 1) {
        const P* xin = reinterpret_cast<const P*>(x_in + row * x_stride);
        P* xout = reinterpret_cast<P*>(x_out + row * x_stride);
        P* res = reinterpret_cast<P*>(residual + row * r_stride);

        P xv[VPT], rv[VPT], wv[VPT];
#pragma unroll
        for (int k = 0; k < VPT; ++k) {  // every load of the row issued before any use
            const int i = tid + k * NT;  // NT constant: the offsets fold into the loads
            if (i < npack) {
                xv[k] = xin[i];
                rv[k] = res[i];
                wv[k] = wrow[i];
            }
        }

        float ss = 0.0f;
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            const int i = tid + k * NT;  // NT constant: the offsets fold into the loads
            if (i < npack) {
                float a[VEC], b[VEC];
                to_float(xv[k], a);
                to_float(rv[k], b);
#pragma unroll
                for (int e = 0; e < VEC; ++e) a[e] += b[e];
                from_float(a, rv[k]);  // the residual, rounded to T
                res[i] = rv[k];
                to_float(rv[k], b);
#pragma unroll
                for (int e = 0; e < VEC; ++e) ss = fmaf(b[e], b[e], ss);
            }
        }

        const float total = block_sum(ss, red, parity);
        const float inv_rms = rescued_inv_rms(
            rsqrtf(total / (float)H + eps), total, H, eps, red, parity,
            [&](auto&& f) {
#pragma unroll
                for (int k = 0; k < VPT; ++k) {
                    if (tid + k * NT < npack) {
                        float b[VEC];
                        to_float(rv[k], b);
#pragma unroll
                        for (int e = 0; e < VEC; ++e) f(b[e]);
                    }
                }
            });

#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            const int i = tid + k * NT;  // NT constant: the offsets fold into the loads
            if (i < npack) {
                float a[VEC], b[VEC];
                to_float(rv[k], a);
                to_float(wv[k], b);
#pragma unroll
                for (int e = 0; e < VEC; ++e) a[e] = a[e] * inv_rms * b[e];
                P o;
                from_float(a, o);
                xout[i] = o;
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// Generic kernel (kernel_fallback): any H, any alignment, two passes over global memory
// ------------------------------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kMaxThreads)
fused_add_rmsnorm_generic_kernel(T* x_out, const T* x_in, T* residual, const T* __restrict__ weight,
                                 int64_t n_rows, int H, int64_t x_stride, int64_t r_stride,
                                 float eps) {
    explugin::pdl_wait();  // launched with PDL: the previous kernel's writes are visible
    explugin::pdl_launch_dependents();
    __shared__ float red[2][32];
    int parity = 0;
    for (int64_t row = blockIdx.x; row < n_rows; row += gridDim.x, parity ^= 1) {
        const T* xin = x_in + row * x_stride;
        T* xout = x_out + row * x_stride;
        T* res = residual + row * r_stride;
        float ss = 0.0f;
        for (int h = threadIdx.x; h < H; h += blockDim.x) {
            const T rr = Num<T>::from_f(Num<T>::to_f(xin[h]) + Num<T>::to_f(res[h]));
            res[h] = rr;
            const float f = Num<T>::to_f(rr);
            ss = fmaf(f, f, ss);
        }
        const float total = block_sum(ss, red, parity);
        const float inv_rms = rescued_inv_rms(
            rsqrtf(total / (float)H + eps), total, H, eps, red, parity,
            [&](auto&& f) {  // (reads back this thread's own writes, as below)
                for (int h = threadIdx.x; h < H; h += blockDim.x) f(Num<T>::to_f(res[h]));
            });
        for (int h = threadIdx.x; h < H; h += blockDim.x)  // reads back this thread's own writes
            xout[h] = Num<T>::from_f(Num<T>::to_f(res[h]) * inv_rms * Num<T>::to_f(weight[h]));
    }
}

// ------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------

ex_factor_t g_factor;
int g_threads = kMaxThreads;  // most threads per block, set from the hardware by ex_get_factor
using explugin::check_launch;
using explugin::fail;

struct Args {
    void* x_out;
    const void* x_in;
    void* residual;
    const void* weight;
    int64_t T;
    int H;
    int64_t x_stride, r_stride;
    float eps;
    cudaStream_t stream;
};

unsigned grid_for(int64_t n_rows) { return (unsigned)(n_rows < INT_MAX ? n_rows : INT_MAX); }

template <typename T, int VEC, int VPT, int NT>
ex_status_t launch_fast(const Args& a) {
    (void)explugin::launch_kernel(fused_add_rmsnorm_kernel<T, VEC, VPT, NT>, grid_for(a.T), NT, 0, a.stream,
                                  explugin::pdl_enabled(), static_cast<T*>(a.x_out),
                                  static_cast<const T*>(a.x_in), static_cast<T*>(a.residual),
                                  static_cast<const T*>(a.weight), a.T, a.H, a.x_stride, a.r_stride, a.eps);
    return check_launch();
}

// Block size NT and packs per thread VPT by the row's pack count (NT * VPT >= packs):
//   vector (16-byte packs; bf16 H=2048: 256 packs, 4096: 512, 7168: 896, 8192: 1024)
//   scalar (one element per pack: odd H, strides or pointers not 16-byte aligned)
// ptxas -v (sm_90a, bf16): VPT 1: 32 registers, 2: 46, 4: 70, 8: 124; scalar VPT 16: 76.  A scalar
// VPT of 32 took 200 (one block per SM), so longer unaligned rows go to the generic kernel.
template <typename T, int VEC>
ex_status_t dispatch_packs(const Args& a) {
    const int n = a.H / VEC;
    if (g_threads < kMaxThreads)  // hardware with smaller blocks: the generic kernel adapts
        return fail(EX_FALLBACK, "fused_add_rmsnorm: fast path needs %d threads per block, have %d",
                    kMaxThreads, g_threads);
    if (n <= 64) return launch_fast<T, VEC, 1, 64>(a);
    if (n <= 128) return launch_fast<T, VEC, 1, 128>(a);
    if (n <= 256) return launch_fast<T, VEC, 1, 256>(a);
    if constexpr (VEC > 1) {
        if (n <= 512) return launch_fast<T, VEC, 2, 256>(a);
        if (n <= 1024) return launch_fast<T, VEC, 4, 256>(a);
        if (n <= 2048) return launch_fast<T, VEC, 8, 256>(a);
    } else {
        if (n <= 1024) return launch_fast<T, VEC, 4, 256>(a);
        if (n <= 4096) return launch_fast<T, VEC, 16, 256>(a);
    }
    return fail(EX_FALLBACK, "fused_add_rmsnorm: fast path holds %d packs of %d per row in registers, got H=%d",
                VEC > 1 ? 2048 : 4096, VEC, a.H);
}

template <typename T>
ex_status_t dispatch_fast(const Args& a) {
    constexpr int kVec = 16 / (int)sizeof(T);
    const int64_t esz = (int64_t)sizeof(T);
    const bool vec_ok = (a.H * esz) % 16 == 0 && (a.x_stride * esz) % 16 == 0 &&
                        (a.r_stride * esz) % 16 == 0 &&
                        reinterpret_cast<uintptr_t>(a.x_out) % 16 == 0 &&
                        reinterpret_cast<uintptr_t>(a.x_in) % 16 == 0 &&
                        reinterpret_cast<uintptr_t>(a.residual) % 16 == 0 &&
                        reinterpret_cast<uintptr_t>(a.weight) % 16 == 0;
    return vec_ok ? dispatch_packs<T, kVec>(a) : dispatch_packs<T, 1>(a);
}

template <typename T>
ex_status_t launch_generic(const Args& a) {
    (void)explugin::launch_kernel(fused_add_rmsnorm_generic_kernel<T>, grid_for(a.T), g_threads, 0, a.stream,
                                  explugin::pdl_enabled(), static_cast<T*>(a.x_out),
                                  static_cast<const T*>(a.x_in), static_cast<T*>(a.residual),
                                  static_cast<const T*>(a.weight), a.T, a.H, a.x_stride, a.r_stride, a.eps);
    return check_launch();
}

// Shared argument checks.  Returns EX_OK with a.T == 0 when there is nothing to do.
ex_status_t parse_args(void* output, const void* input, const void* aux_inputs[], int n_aux,
                       const int64_t dims[], int n_dims, void* stream, Args& a, int& dtype) {
    explugin::clear_error();
    if (dims == nullptr || n_dims < 6)  // {T, H, dtype, eps_bits, x_row_stride, residual_row_stride}
        return fail(EX_ERR_INVALID_ARGUMENT,
                    "fused_add_rmsnorm: expected 6 dims {T, H, dtype, eps_bits, x_row_stride, residual_row_stride}, got %d",
                    n_dims);
    if (aux_inputs == nullptr || n_aux < 2)  // aux = {residual (T, H), weight (H)}
        return fail(EX_ERR_INVALID_ARGUMENT, "fused_add_rmsnorm: expected 2 aux inputs (residual, weight), got %d", n_aux);
    const int64_t T = dims[0], H = dims[1], dt = dims[2], xs = dims[4], rs = dims[5];
    if (T < 0 || H < 0 || xs < 0 || rs < 0)
        return fail(EX_ERR_INVALID_ARGUMENT,
                    "fused_add_rmsnorm: dims must be >= 0, got T=%lld H=%lld x_row_stride=%lld residual_row_stride=%lld",
                    (long long)T, (long long)H, (long long)xs, (long long)rs);
    if (dt != EX_DTYPE_FLOAT32 && dt != EX_DTYPE_FLOAT16 && dt != EX_DTYPE_BFLOAT16)
        return fail(EX_ERR_UNSUPPORTED_DTYPE,
                    "fused_add_rmsnorm: dtype must be float32, float16 or bfloat16 (0, 1, 2), got %lld", (long long)dt);
    // H <= 2^24 (the manifest's constraint): the generic kernel's threads step over H in int32,
    // which wrapped for H within a block of 2^31 (writes before the row; a static review, session 33)
    if (H < 1 || H > (int64_t(1) << 24))  // 1 <= H <= 2^24
        return fail(EX_ERR_SHAPE, "fused_add_rmsnorm: expected 1 <= H <= %lld, got H=%lld",
                    (long long)(int64_t(1) << 24), (long long)H);
    if (xs < H || rs < H)  // rows may not overlap
        return fail(EX_ERR_SHAPE,
                    "fused_add_rmsnorm: row strides must be >= H=%lld, got x_row_stride=%lld residual_row_stride=%lld",
                    (long long)H, (long long)xs, (long long)rs);
    double eps;
    const uint64_t eps_bits = (uint64_t)dims[3];
    memcpy(&eps, &eps_bits, sizeof eps);
    a = Args{output, input, nullptr, nullptr, T, (int)H, xs, rs, (float)eps, static_cast<cudaStream_t>(stream)};
    dtype = (int)dt;
    if (T == 0) return EX_OK;
    if (output == nullptr || input == nullptr || aux_inputs[0] == nullptr || aux_inputs[1] == nullptr)
        return fail(EX_ERR_INVALID_ARGUMENT, "fused_add_rmsnorm: x, residual and weight must not be NULL");
    a.residual = const_cast<void*>(aux_inputs[0]);
    a.weight = aux_inputs[1];
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

int fused_add_rmsnorm(void* output, const void* input, const void* aux_inputs[], int n_aux,
                      const int64_t dims[], int n_dims, void* stream) {
    return run_for_dtype(output, input, aux_inputs, n_aux, dims, n_dims, stream,
                         [](auto t, const Args& a) { return dispatch_fast<decltype(t)>(a); });
}

int fused_add_rmsnorm_generic(void* output, const void* input, const void* aux_inputs[], int n_aux,
                              const int64_t dims[], int n_dims, void* stream) {
    return run_for_dtype(output, input, aux_inputs, n_aux, dims, n_dims, stream,
                         [](auto t, const Args& a) { return launch_generic<decltype(t)>(a); });
}

}  // namespace

// Written for 32-lane warps (warp_sum, 32 warp slots in the reduction buffer): on hardware
// with another warp size (the BI-V100 schedules 64) the factor declines (NULL).
extern "C" EX_EXPORT ex_factor_t* ex_get_factor(const ex_hardware_t* hw) {
    if (hw == nullptr || hw->warp_size != 32 || hw->max_threads_per_block < 32) return nullptr;
    const int threads = explugin::block_threads(hw, kMaxThreads);
    g_threads = threads;
    explugin::g_pdl_hw = hw->cc_major >= 9;
    g_factor.abi_version = EX_ABI_VERSION;
    g_factor.factor_id = EX_FACTOR_FUSED_ADD_RMSNORM;
    g_factor.name = "fused_add_rmsnorm";
    g_factor.version = "0.1.0";
    g_factor.tuning.threads_per_block = threads;  // the most a launch uses; fewer for small H
    g_factor.tuning.items_per_thread = 8;          // up to 8 packs of 16 bytes per thread
    g_factor.tuning.vec_size = 8;                  // 16-byte accesses of 16-bit elements (4 for float32)
    g_factor.tuning.shared_mem_bytes = 0;          // 256 bytes of static shared memory only
    g_factor.tuning.num_warps = threads / 32;
    g_factor.tuning.num_stages = 1;
    g_factor.kernel = fused_add_rmsnorm;
    g_factor.kernel_fallback = fused_add_rmsnorm_generic;
    g_factor.workspace_size = nullptr;
    g_factor.last_error = explugin::last_error;
    g_factor.priority = 0;
    g_factor.reserved_i32 = 0;
    g_factor.description =
        "residual += x; x = rmsnorm(residual) * weight, in place, one block per row held in registers";
    return &g_factor;
}

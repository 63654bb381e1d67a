/*
 * my_op.cu -- TEMPLATE of an ex_engine factor: copy to factors/<name>.cu, rename, edit.
 *
 * Computes: out[i] = silu(x[i]) = x[i] / (1 + exp(-x[i]))   (fp32 inside)
 * Shapes:   x (N,), out (N,)     dtypes: float32, float16, bfloat16 (the same for both)
 * dims:     {N, dtype}           (order fixed by my_op.yaml)
 * Variants: one grid-stride kernel; vectorise / tune as your factor needs.
 * Floor:    2 * N * sizeof(T) bytes / ~4.2 TB/s on an H200.
 *
 * Build: make factors/my_op.so, or ex-engine build my_op  (nvcc, sm_90a + sm_80 + PTX; no GPU
 *        needed to build; a bare `make` builds every factor)
 * Python fallback: docs/template/my_op_fallback.py; copy it into a module on your PYTHONPATH and
 *                  name it in the manifest's `fallback` (e.g. myfactors.my_op:silu)
 * Contract: docs/factor-contract.md
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "ex_engine.h"

EX_DEFINE_ABI_VERSION();  // lets the runtime read the ABI version before running any code

// ---------------------------------------------------------------------------- kernels
__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T>
__global__ void silu_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float v = to_f32(x[i]);
        out[i] = from_f32<T>(v / (1.0f + __expf(-v)));
    }
}

// ---------------------------------------------------------------------------- launcher
static ex_factor_t s_factor;      // filled by ex_get_factor, lives as long as the library
static int s_sm_count = 1;
static thread_local const char* s_last_error = "";

template <typename T>
static int launch(void* out, const void* x, int64_t n, cudaStream_t stream) {
    const int tpb = s_factor.tuning.threads_per_block;
    int64_t blocks = (n + tpb - 1) / tpb;
    int64_t cap = 8LL * s_sm_count;
    silu_kernel<T><<<(unsigned)(blocks < cap ? blocks : cap), tpb, 0, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(x), n);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) { s_last_error = cudaGetErrorString(err); return EX_ERR_CUDA; }
    return EX_OK;
}

static int my_op_kernel(void* output, const void* input, const void* aux[], int n_aux,
                        const int64_t dims[], int n_dims, void* stream) {
    (void)aux; (void)n_aux;
    if (output == nullptr || input == nullptr || dims == nullptr || n_dims < 2) return EX_ERR_INVALID_ARGUMENT;
    const int64_t n = dims[0];
    if (n < 0) return EX_ERR_SHAPE;
    if (n == 0) return EX_OK;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (dims[1]) {
        case EX_DTYPE_FLOAT32: return launch<float>(output, input, n, s);
        case EX_DTYPE_FLOAT16: return launch<__half>(output, input, n, s);
        case EX_DTYPE_BFLOAT16: return launch<__nv_bfloat16>(output, input, n, s);
        default: return EX_ERR_UNSUPPORTED_DTYPE;
    }
}

static const char* my_op_last_error(void) { return s_last_error; }

// ---------------------------------------------------------------------------- entry point
// Must not call CUDA: it also runs on machines without a GPU, against hardware profiles.
extern "C" EX_EXPORT ex_factor_t* ex_get_factor(const ex_hardware_t* hw) {
    if (hw == nullptr || hw->warp_size <= 0) return nullptr;
    s_sm_count = hw->multiprocessor_count > 0 ? hw->multiprocessor_count : 1;
    int tpb = 8 * hw->warp_size;
    if (tpb > hw->max_threads_per_block) tpb = hw->max_threads_per_block / hw->warp_size * hw->warp_size;
    s_factor.abi_version = EX_ABI_VERSION;
    s_factor.factor_id = EX_FACTOR_USER_FIRST + 0;  // pick a free id >= 1024
    s_factor.name = "my_op";                        // = file stem = manifest name
    s_factor.version = "0.1.0";
    s_factor.tuning = ex_tuning_t{tpb, 1, 1, 0, tpb / hw->warp_size, 1};
    s_factor.kernel = my_op_kernel;
    s_factor.kernel_fallback = nullptr;
    s_factor.workspace_size = nullptr;
    s_factor.last_error = my_op_last_error;
    s_factor.priority = 0;
    s_factor.description = "template: out = silu(x)";  // one line: `ex-engine list-factors --json`
    return &s_factor;
}

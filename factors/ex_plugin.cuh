/*
 * ex_plugin.cuh -- host-side plumbing shared by the built-in factors (included by each plugin's
 * one translation unit; every .so stays self-contained): the thread-local last-error text behind
 * ex_factor_t.last_error, printf-style failure, the CUDA launch check, the block size a piece of
 * hardware allows, and the switch from an ex_dtype_t code to the element type of a launch.
 */
#ifndef EX_PLUGIN_CUH
#define EX_PLUGIN_CUH

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include <cstdarg>
#include <cstdio>

#include "ex_engine.h"

namespace explugin {

// The message of the last failing call on this thread (what ex_factor_t.last_error returns).
static thread_local char g_last_error[256] = "";

static const char* last_error() { return g_last_error; }

static void clear_error() { g_last_error[0] = '\0'; }

// Records the message (printf format) and returns st.
static ex_status_t fail(ex_status_t st, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static ex_status_t fail(ex_status_t st, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_last_error, sizeof g_last_error, fmt, ap);
    va_end(ap);
    return st;
}

// EX_ERR_CUDA with the CUDA error's name and text if the launches before it failed, else EX_OK.
static ex_status_t check_launch() {
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
        return fail(EX_ERR_CUDA, "%s: %s", cudaGetErrorName(err), cudaGetErrorString(err));
    return EX_OK;
}

// The most threads per block a launch may use on hw: max_threads, or fewer whole warps of 32.
static int block_threads(const ex_hardware_t* hw, int max_threads) {
    return hw->max_threads_per_block >= max_threads ? max_threads
                                                    : (hw->max_threads_per_block / 32) * 32;
}

// launch(T{}, args) with T the element type of an ex_dtype_t code (fp32, fp16, else bf16: the
// callers have checked the code against what their manifest allows).
template <typename Args, typename Launch>
static int launch_for_dtype(int dtype, const Args& a, Launch launch) {
    switch (dtype) {
        case EX_DTYPE_FLOAT32: return launch(float{}, a);
        case EX_DTYPE_FLOAT16: return launch(__half{}, a);
        default: return launch(__nv_bfloat16{}, a);
    }
}

}  // namespace explugin

#endif  // EX_PLUGIN_CUH

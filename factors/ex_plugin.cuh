/*
 * ex_plugin.cuh -- host-side plumbing shared by the built-in factors (included by each plugin's
 * one translation unit; every .so stays self-contained): the thread-local last-error text behind
 * ex_factor_t.last_error, printf-style failure, the CUDA launch check, the block size a piece of
 * hardware allows, the switch from an ex_dtype_t code to the element type of a launch, and
 * programmatic dependent launch (device side and host side).
 */
#ifndef EX_PLUGIN_CUH
#define EX_PLUGIN_CUH

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "ex_engine.h"

// The file name that a plugin's messages on stderr start with, so that two plugins reading the
// same variable say which one speaks (each plugin's .cu defines it before its includes).
#ifndef EX_PLUGIN_FILE
#define EX_PLUGIN_FILE "an ex_engine plugin"
#endif

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

// A decimal integer >= 0 from the environment variable `name` (a tuning or comparison switch read
// when the plugin loads), else `fallback`; a set but malformed value ("abc", "-1", "8192 ", " 12",
// "+12", or one beyond a long long, "99999999999999999999") is reported on stderr and the
// fallback kept.
static long long env_count(const char* name, long long fallback) {
    const char* v = std::getenv(name);
    if (v == nullptr) return fallback;
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(v, &end, 10);
    // (strtoll also takes leading blanks and a sign: refused, as the trailing blank is)
    if (v[0] >= '0' && v[0] <= '9' && *end == '\0' && errno == 0) return n;
    std::fprintf(stderr, "[ex_engine] " EX_PLUGIN_FILE ": %s='%s' ignored: expected a decimal integer >= 0; using %lld\n",
                 name, v, fallback);
    return fallback;
}

// An on/off switch from the environment: unset or anything but "0" = on ("0" = off); a value
// other than "0" or "1" is reported on stderr (and counts as on).
static bool env_switch(const char* name) {
    const char* v = std::getenv(name);
    if (v == nullptr) return true;
    if (std::strcmp(v, "0") == 0) return false;
    if (std::strcmp(v, "1") != 0) {
        static thread_local const char* warned = nullptr;  // once per variable in a row
        if (warned != name)
            std::fprintf(stderr, "[ex_engine] " EX_PLUGIN_FILE ": %s='%s' ignored: expected 0 (off) or 1 (on); using 1 (on, the default)\n",
                         name, v);
        warned = name;
    }
    return true;
}

// One of n named choices from the environment variable `name`: the index of its value in
// names[], `fallback` when unset; any other value is reported on stderr (once per value in a
// row, so a switch read per call does not flood) and gives `fallback`.
static int env_choice(const char* name, const char* const names[], int n, int fallback) {
    const char* v = std::getenv(name);
    if (v == nullptr) return fallback;
    for (int i = 0; i < n; ++i)
        if (std::strcmp(v, names[i]) == 0) return i;
    static thread_local char warned[96] = "";
    char key[96];
    std::snprintf(key, sizeof key, "%s=%s", name, v);
    if (std::strcmp(key, warned) != 0) {
        std::fprintf(stderr, "[ex_engine] " EX_PLUGIN_FILE ": %s='%s' ignored: expected ", name, v);
        for (int i = 0; i < n; ++i)
            std::fprintf(stderr, "%s%s", names[i], i + 2 < n ? ", " : (i + 1 < n ? " or " : ""));
        std::fprintf(stderr, "; using %s\n", names[fallback]);
        std::snprintf(warned, sizeof warned, "%s", key);
    }
    return fallback;
}

// Programmatic dependent launch (sm_90+; no-ops elsewhere and when the grid was launched without
// the attribute). wait: block until the preceding grid has completed and its writes are visible;
// every kernel launched with the attribute calls it before its first global access.
// launch_dependents: let the next grid's blocks be scheduled now (they still wait for our end).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Whether the code the device runs for this library was compiled from PTX for sm_90 or newer, so
// that pdl_wait is a griddepcontrol.wait and not compiled out: a portable library's compute_80
// PTX, JIT-compiled on a GPU newer than its SASS (cc 10.x, 12.x), has none, and a launch with
// the programmatic-stream-serialization attribute would then read the previous kernel's output
// with nothing ordering it. Asked once per library (its kernels share one set of targets), at
// the first launch that asks; false where the query fails (no device).
__global__ void pdl_code_probe() {}
static bool pdl_code_ok() {
    static const bool ok = [] {
        cudaFuncAttributes a;
        if (cudaFuncGetAttributes(&a, pdl_code_probe) != cudaSuccess) {
            (void)cudaGetLastError();
            return false;
        }
        return a.ptxVersion >= 90;
    }();
    return ok;
}

// Whether the launches of topk_softmax and fused_add_rmsnorm carry the programmatic-stream-
// serialization attribute: the hardware has it (g_pdl_hw, set by ex_get_factor: cc >= 9.0), the
// code run has griddepcontrol (pdl_code_ok) and the environment variable EX_PDL is not "0" (read
// per call, so one process can compare). With it, a launch's blocks may be scheduled while the
// previous kernel in the stream finishes; they wait for it (pdl_wait) before touching what an
// earlier kernel writes (a few read inputs that no earlier kernel of the call writes, weights
// say, before it), so only the launch latency and those reads overlap.
static bool g_pdl_hw = false;
static bool pdl_enabled() { return g_pdl_hw && env_switch("EX_PDL") && pdl_code_ok(); }

// A kernel launch, with the programmatic-stream-serialization attribute when pdl is set, and in
// clusters of cluster_x blocks along x when cluster_x > 0 (cudaLaunchAttributeClusterDimension;
// sm_90+). Returns the launch's error (a plain <<<>>> launch: cudaSuccess, errors reach
// cudaGetLastError).
template <typename... KArgs, typename... Args>
static cudaError_t launch_kernel_cluster(void (*kern)(KArgs...), dim3 grid, dim3 block, size_t smem,
                                         cudaStream_t stream, bool pdl, unsigned cluster_x, Args... args) {
    if (!pdl && cluster_x == 0) {
        kern<<<grid, block, smem, stream>>>(args...);
        return cudaSuccess;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[2];
    unsigned n = 0;
    if (cluster_x > 0) {
        attr[n].id = cudaLaunchAttributeClusterDimension;
        attr[n].val.clusterDim.x = cluster_x;
        attr[n].val.clusterDim.y = 1;
        attr[n].val.clusterDim.z = 1;
        ++n;
    }
    if (pdl) {
        attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[n].val.programmaticStreamSerializationAllowed = 1;
        ++n;
    }
    cfg.attrs = attr;
    cfg.numAttrs = n;
    return cudaLaunchKernelEx(&cfg, kern, static_cast<KArgs>(args)...);
}

// launch_kernel_cluster without clusters
template <typename... KArgs, typename... Args>
static cudaError_t launch_kernel(void (*kern)(KArgs...), dim3 grid, dim3 block, size_t smem,
                                 cudaStream_t stream, bool pdl, Args... args) {
    return launch_kernel_cluster(kern, grid, block, smem, stream, pdl, 0u, args...);
}

}  // namespace explugin

#endif  // EX_PLUGIN_CUH

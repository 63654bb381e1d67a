/*
 * ex_engine.h -- the C ABI between ex_engine and its factor plugins.
 *
 * A factor is one shared library that exports, with C linkage:
 *
 *     const uint32_t ex_abi_version;                       (= EX_ABI_VERSION)
 *     ex_factor_t*   ex_get_factor(const ex_hardware_t* hw);
 *
 * The runtime reads `ex_abi_version` from the file's dynamic symbol table before it opens the
 * library, and refuses a library whose major version differs from its own with none of its
 * code run (where the file does not say, it reads the symbol after dlopen, which has run the
 * library's static constructors by then: keep them side-effect free).  It then calls
 * `ex_get_factor` with the hardware it targets (once per registry that loads the library; a
 * process holds one copy of the library, so keep no state there that a second call for other
 * hardware would break), checks the returned tuning against that hardware, and afterwards
 * calls `kernel` (then `kernel_fallback`, then its Python fallback) on device pointers.
 *
 * This header is a specification: types, constants and comments, no logic.  The Python
 * binding (ex_engine/abi.py) mirrors it; tests/test_abi.py checks that both agree byte for
 * byte.  See docs/factor-contract.md for the rules a plugin must follow.
 */
#ifndef EX_ENGINE_H
#define EX_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------- */
/* Versioning                                                                               */
/* ---------------------------------------------------------------------------------------- */

/* Major: any layout or semantic change; a library of another major version is never called.
 * Minor: additions that old plugins can ignore (new status codes, new factor ids). A runtime
 * loads a library of its major and any minor; one built against a newer minor than the
 * runtime's gets a warning check ("abi version"), and the additions it may use (a status
 * code this runtime does not know) are reported by number.                                */
#define EX_ABI_VERSION_MAJOR 1
#define EX_ABI_VERSION_MINOR 0
#define EX_ABI_VERSION ((uint32_t)((EX_ABI_VERSION_MAJOR << 16) | EX_ABI_VERSION_MINOR))

#if defined(_WIN32)
#define EX_EXPORT __declspec(dllexport)
#else
#define EX_EXPORT __attribute__((visibility("default")))
#endif

/* Every plugin writes this once, at file scope, so the runtime can read the version the
 * library was built against without running any of its code.  It must stay what this macro
 * makes it, a constant 4-byte data object: the registry refuses a function of that name, a
 * symbol of another size, and a value the library's own code changes when it is opened.    */
#ifdef __cplusplus
#define EX_DEFINE_ABI_VERSION() \
    extern "C" EX_EXPORT const uint32_t ex_abi_version = EX_ABI_VERSION
#else
#define EX_DEFINE_ABI_VERSION() \
    EX_EXPORT const uint32_t ex_abi_version = EX_ABI_VERSION
#endif

/* ---------------------------------------------------------------------------------------- */
/* Status codes returned by kernels                                                         */
/* ---------------------------------------------------------------------------------------- */

typedef enum ex_status {
    EX_OK = 0,                      /* done: every output element written                     */
    EX_FALLBACK = -1,               /* not handled (shape, dtype, arch): try the next path    */
    EX_ERR_INVALID_ARGUMENT = 1,    /* a NULL pointer, a negative dim, n_aux/n_dims too small  */
    EX_ERR_UNSUPPORTED_DTYPE = 2,   /* dtype code not one this factor implements              */
    EX_ERR_SHAPE = 3,               /* dims inconsistent (e.g. K > E, H not a multiple of ...) */
    EX_ERR_ALIGNMENT = 4,           /* a pointer not aligned as the factor requires           */
    EX_ERR_WORKSPACE = 5,           /* workspace missing or smaller than workspace_size()     */
    EX_ERR_CUDA = 6,                /* a CUDA call or launch failed (runtime reads the error) */
    EX_ERR_INTERNAL = 7             /* anything else                                          */
} ex_status_t;

/* ---------------------------------------------------------------------------------------- */
/* Element types, as passed in dims[] where a factor's manifest asks for a dtype entry      */
/* ---------------------------------------------------------------------------------------- */

typedef enum ex_dtype {
    EX_DTYPE_FLOAT32 = 0,
    EX_DTYPE_FLOAT16 = 1,
    EX_DTYPE_BFLOAT16 = 2,
    EX_DTYPE_INT32 = 3,
    EX_DTYPE_INT64 = 4
} ex_dtype_t;

/* ---------------------------------------------------------------------------------------- */
/* Factor ids                                                                               */
/* ---------------------------------------------------------------------------------------- */

typedef enum ex_factor_id {
    EX_FACTOR_TOPK_SOFTMAX = 0,      /* router: softmax over E, top-k, optional renormalise   */
    EX_FACTOR_FUSED_ADD_RMSNORM = 1, /* residual += x; x = rmsnorm(residual) * weight          */
    EX_FACTOR_MOE_FUSED_GEMM = 2,    /* routed experts of an MoE layer                         */
    EX_FACTOR_BUILTIN_LAST = 1023,   /* ids 0..1023 are reserved for ex_engine's own factors  */
    EX_FACTOR_USER_FIRST = 1024      /* third-party factors take ids from here on             */
} ex_factor_id_t;

/* ---------------------------------------------------------------------------------------- */
/* Hardware description: filled by the runtime from the live device or from a profile      */
/* ---------------------------------------------------------------------------------------- */

typedef struct ex_hardware {
    char name[256];                       /* device name, NUL-terminated ("NVIDIA H200")      */
    int32_t cc_major;                     /* compute capability, major (9 for Hopper)          */
    int32_t cc_minor;                     /* compute capability, minor                         */
    int32_t multiprocessor_count;         /* streaming multiprocessors                         */
    int32_t warp_size;                    /* threads per warp (32 on NVIDIA)                   */
    int32_t max_threads_per_block;        /* launch limit on blockDim.x*y*z                    */
    int32_t max_threads_per_multiprocessor;
    int32_t regs_per_block;               /* 32-bit registers available to one block           */
    int32_t regs_per_multiprocessor;      /* 32-bit registers per SM                           */
    int64_t shared_mem_per_block;         /* bytes, default limit without opt-in               */
    int64_t shared_mem_per_block_optin;   /* bytes, limit after cudaFuncSetAttribute opt-in    */
    int64_t shared_mem_per_multiprocessor;/* bytes                                             */
    int64_t l2_cache_bytes;               /* bytes                                             */
    int64_t global_mem_bytes;             /* bytes of device memory                            */
} ex_hardware_t;

/* ---------------------------------------------------------------------------------------- */
/* Tuning a factor chose for the hardware; the runtime checks it before any call            */
/* ---------------------------------------------------------------------------------------- */

typedef struct ex_tuning {
    int32_t threads_per_block;  /* <= max_threads_per_block, a multiple of warp_size         */
    int32_t items_per_thread;   /* >= 1: elements (or rows) each thread owns per step        */
    int32_t vec_size;           /* elements per vector access; vec_size * element bytes <= 16 */
    int32_t shared_mem_bytes;   /* dynamic shared memory per block, <= shared_mem_per_block_optin */
    int32_t num_warps;          /* threads_per_block / warp_size                             */
    int32_t num_stages;         /* software-pipeline depth, >= 1                              */
} ex_tuning_t;

/* ---------------------------------------------------------------------------------------- */
/* The factor                                                                               */
/* ---------------------------------------------------------------------------------------- */

/* output, input: device pointers (see the factor's manifest for what each one is); host
 * pointers, and stream NULL, for a manifest with `memory: host` (work done during the call).
 * aux_inputs[n_aux]: further device pointers in the manifest's order; an optional one is NULL.
 * dims[n_dims]: int64 values in the manifest's order (sizes, dtype codes, flags, strides).
 * stream: a cudaStream_t; all work is enqueued on it, never on the legacy default stream.
 * Returns an ex_status_t.  Must not synchronise the host, allocate device memory, print or
 * exit; must not write outside the outputs and workspace the manifest names.               */
typedef int (*ex_kernel_fn)(void* output, const void* input, const void* aux_inputs[],
                            int n_aux, const int64_t dims[], int n_dims, void* stream);

/* Bytes of device workspace the kernel needs for these dims (0: none).  The runtime passes
 * a buffer of at least that size, 256-byte aligned, as the aux input the manifest marks
 * `role: workspace`.  Must be a pure function of dims, returning 0..2^40 (anything else is
 * reported, below 0 as this function's bug, above 2^40 as dims too large for the factor or a
 * bug, and the kernel is not called).  NULL means no workspace.
 * The two go together: the registry refuses a library whose workspace_size is set while its
 * manifest has no `role: workspace` entry, or NULL while its manifest has one.             */
typedef int64_t (*ex_workspace_fn)(const int64_t dims[], int n_dims);

/* A NUL-terminated description of the last error this library's kernel returned on the
 * calling thread (for EX_ERR_CUDA: "cudaErrorInvalidValue: invalid argument"), or "" if none.
 * The runtime calls it only right after a kernel returned a status other than 0 or -1, or
 * one (whatever it returned) wrote to the const dims array it was passed.                   */
typedef const char* (*ex_error_string_fn)(void);

typedef struct ex_factor {
    uint32_t abi_version;          /* EX_ABI_VERSION the library was built with              */
    int32_t factor_id;             /* an ex_factor_id_t, or >= EX_FACTOR_USER_FIRST; never < 0 */
    const char* name;              /* equals its manifest's name (and, by convention, the
                                    * library's file stem: a renamed file loads, with a note) */
    const char* version;           /* the factor's own version, "MAJOR.MINOR.PATCH" (each
                                    * number 1 to 18 digits; a name: at most 250 characters) */
    ex_tuning_t tuning;            /* what the kernel launches with on this hardware         */
    ex_kernel_fn kernel;           /* the fast path; must not be NULL                        */
    ex_kernel_fn kernel_fallback;  /* a simpler C/CUDA path tried when kernel returns -1; may be NULL */
    ex_workspace_fn workspace_size;/* may be NULL: no workspace                               */
    ex_error_string_fn last_error; /* may be NULL                                             */
    int32_t priority;              /* breaks ties between plugins of the same name and version; higher wins */
    int32_t reserved_i32;          /* zero (the registry refuses another value)               */
    const char* description;       /* one line, shown by `ex-engine list-factors --why` and
                                    * --json; may be NULL.  Control characters in it (and in
                                    * name and version, which refuse them) are shown escaped  */
} ex_factor_t;

/* The one entry point.  Returns a pointer to storage that lives as long as the library is
 * loaded, or NULL if the factor cannot serve this hardware at all.                          */
typedef ex_factor_t* (*ex_get_factor_fn)(const ex_hardware_t* hw);

EX_EXPORT ex_factor_t* ex_get_factor(const ex_hardware_t* hw);

#ifdef __cplusplus
}
#endif

#endif /* EX_ENGINE_H */

/* A host-memory test plugin, built by the tests with gcc in many variants (-D flags):
 *   out[i] = alpha * in[i] (float32), alpha from aux[0][0]; dims = {N}.
 * BEHAVIOUR: 0 returns EX_OK, 1 returns EX_FALLBACK (with kernel_fallback doubling instead),
 * 2 returns EX_FALLBACK with no kernel_fallback, 3 returns EX_ERR_SHAPE, 4 returns EX_OK with a
 * wrong result (alpha * in + 1: what `verify` must catch).
 * Other knobs: ABI_OVERRIDE, ABI_VERSIONED, ABI_IN_BSS, RETURN_NULL, NULL_NAME, NULL_KERNEL, NO_GET_FACTOR, TPB, VERSION,
 * NAME, FACTOR_ID, PRIORITY, STRUCT_ABI (the struct's abi_version), CRASH (ex_get_factor dereferences NULL), HANG (ex_get_factor
 * never returns), EXIT_IN_GET (ex_get_factor calls exit(N)), BAD_DESCRIPTION (a wild description
 * pointer), OOB (writes OOB floats past the output's end), CRASH_IN_KERNEL (the kernel writes to
 * that address, e.g. 8: SIGSEGV; with CRASH_IF_N only when N is that), FORK_IN_KERNEL (the
 * kernel forks a child that spins forever), SETSID_IN_KERNEL (the kernel forks a child that calls
 * setsid() and forks a chain of SETSID_CHAIN more (default 1), all sleeping forever), HANG_IN_KERNEL (the kernel never returns), EXIT_IN_KERNEL (the kernel calls exit(N)),
 * PRINT_IN_KERNEL (the kernel prints a line that looks like a verify report to stdout),
 * STDERR_IN_KERNEL (the kernel writes a line that is not UTF-8 to stderr), CTOR_STDERR (a
 * constructor writes a line that is not UTF-8 to stderr when the library is opened), STDERR_FLOOD
 * (the kernel writes that many 64 KB blocks to stderr), MUTATE_HW (ex_get_factor writes that value to
 * hw->warp_size through its const pointer), DIMS_WRITE (the kernel sets dims[0] to that value
 * through its const pointer, then behaves as BEHAVIOUR says), HELPER (the kernel calls helper_alpha() from a separate library), WORKSPACE
 * (aux[1] is a runtime workspace: the product goes through scratch memory there, and a negative
 * alpha sets bit 0 of its status word; manifest tests/plugins/host_scale_ws.yaml), ENV_SWITCH (a
 * variable name: ex_get_factor reads it, as the shipped factors read their EX_* switches at
 * load, and "1" selects a path that adds 1 to every output: a configuration verify must check). */
#include "ex_engine.h"
#include <stdint.h>
#include <stdlib.h>
#if defined(PRINT_IN_KERNEL) || defined(STDERR_IN_KERNEL) || defined(STDERR_FLOOD)
#include <stdio.h>
#include <string.h>
#endif
#if defined(FORK_IN_KERNEL) || defined(SETSID_IN_KERNEL)
#include <unistd.h>
#endif

#ifndef BEHAVIOUR
#define BEHAVIOUR 0
#endif
#ifndef TPB
#define TPB 256
#endif
#ifndef VERSION
#define VERSION "1.0.0"
#endif
#ifndef NAME
#define NAME "host_scale"
#endif
#ifndef FACTOR_ID
#define FACTOR_ID 1100
#endif
#ifndef PRIORITY
#define PRIORITY 0
#endif

#ifdef HELPER
float helper_alpha(float a);   /* from libexhelper.so, linked by the test */
#define ALPHA(a) helper_alpha(a)
#else
#define ALPHA(a) (a)
#endif

#if defined(ABI_VERSIONED)
/* two versions of the symbol (link with a version script defining V0 and V1): dlsym takes the
 * default one, @@V1; the file's first entry is the hidden 2.0 */
EX_EXPORT const uint32_t abi_old = 0x20000;
EX_EXPORT const uint32_t abi_new = EX_ABI_VERSION;
__asm__(".symver abi_old,ex_abi_version@V0");
__asm__(".symver abi_new,ex_abi_version@@V1");
#elif defined(ABI_IN_BSS)
/* zero in the file, set by a constructor: only the loaded library knows its value */
EX_EXPORT uint32_t ex_abi_version;
__attribute__((constructor)) static void set_abi_version(void) { ex_abi_version = EX_ABI_VERSION; }
#elif defined(ABI_OVERRIDE)
EX_EXPORT const uint32_t ex_abi_version = ABI_OVERRIDE;
#else
EX_DEFINE_ABI_VERSION();
#endif

#ifdef CTOR_STDERR
#include <stdio.h>
__attribute__((constructor)) static void ctor_stderr(void) { fprintf(stderr, "ctor: \xff\xfe\n"); }
#endif

static const char* g_err = "";
static float g_env_plus = 0.0f;   /* ENV_SWITCH's path (set by ex_get_factor) */
#ifdef NULL_ERROR_TEXT
static const char* last_error(void) { return NULL; }   /* a plugin bug the runtime must survive */
#else
static const char* last_error(void) { return g_err; }
#endif

static int scale(void* output, const void* input, const void* aux[], int n_aux,
                 const int64_t dims[], int n_dims, void* stream) {
    (void)stream;
    if (n_aux < 1 || n_dims < 1) return EX_ERR_INVALID_ARGUMENT;
    float alpha = ALPHA(((const float*)aux[0])[0]);
    float plus = (BEHAVIOUR == 4 ? 1.0f : 0.0f) + g_env_plus;
#ifdef STDERR_IN_KERNEL
    fprintf(stderr, "warnung: Gr\xf6\xdf" "e\n");   /* not UTF-8 */
    fflush(stderr);
#endif
#ifdef CRASH_IN_KERNEL
#ifdef CRASH_IF_N
    if (dims[0] == CRASH_IF_N)
#endif
    *(volatile int*)(uintptr_t)CRASH_IN_KERNEL = 1;   /* a write far out of any array: SIGSEGV */
#endif
#ifdef FORK_IN_KERNEL
    if (fork() == 0) { for (volatile int spin = 1; spin;) {} }   /* a process left behind */
#endif
#ifdef SETSID_IN_KERNEL
#ifndef SETSID_CHAIN
#define SETSID_CHAIN 1
#endif
    if (fork() == 0) {   /* a process that leaves the session, then a chain of SETSID_CHAIN more */
        setsid();
        for (int i = 0; i < SETSID_CHAIN; ++i)
            if (fork() != 0) break;   /* the parent stays; the child goes on forking */
        for (volatile int spin = 1; spin;) { sleep(1); }
    }
#endif
#ifdef STDERR_FLOOD
    { static char buf[1 << 16]; memset(buf, 'x', sizeof buf);
      for (long i = 0; i < STDERR_FLOOD; ++i) fwrite(buf, 1, sizeof buf, stderr); }
#endif
#ifdef HANG_IN_KERNEL
    for (volatile int spin = 1; spin;) {}
#endif
#ifdef PRINT_IN_KERNEL
    printf("CASE {\"factor\": \"host_scale\", \"case\": \"N=1\", \"dtype\": \"float32\", \"status\": \"pass\"}\n");
    fflush(stdout);
#endif
#ifdef EXIT_IN_KERNEL
    exit(EXIT_IN_KERNEL);   /* ends whatever process runs the kernel */
#endif
#ifdef WORKSPACE
    if (n_aux < 2 || aux[1] == NULL) return EX_ERR_WORKSPACE;
    if ((uintptr_t)aux[1] % 256 != 0) return EX_ERR_ALIGNMENT;   /* rule 11: 256-byte aligned */
    if (alpha < 0.0f) *(int32_t*)aux[1] |= 1;
    float* scratch = (float*)((char*)aux[1] + 256);   /* shared scratch would be overwritten */
    for (int64_t i = 0; i < dims[0]; ++i) scratch[i] = alpha * ((const float*)input)[i] + plus;
    for (int64_t i = 0; i < dims[0]; ++i) ((float*)output)[i] = scratch[i];
#else
#ifndef OOB
#define OOB 0
#endif
    for (int64_t i = 0; i < dims[0]; ++i) ((float*)output)[i] = alpha * ((const float*)input)[i] + plus;
    for (int64_t i = dims[0]; i < dims[0] + OOB; ++i) ((float*)output)[i] = 0.0f;   /* out of bounds */
#endif
    return EX_OK;
}

#ifdef WORKSPACE
static int64_t workspace_size(const int64_t dims[], int n_dims) {
#ifdef WS_BYTES
    (void)dims; (void)n_dims;
    return WS_BYTES;
#else
    return n_dims < 1 ? 0 : 256 + 4 * dims[0];
#endif
}
#endif

static int kernel(void* output, const void* input, const void* aux[], int n_aux,
                  const int64_t dims[], int n_dims, void* stream) {
#ifdef DIMS_WRITE
    ((int64_t*)dims)[0] = DIMS_WRITE;   /* writes through its const dims: a plugin bug */
#endif
    if (BEHAVIOUR == 1 || BEHAVIOUR == 2) return EX_FALLBACK;
    if (BEHAVIOUR == 3) { g_err = "N must be even"; return EX_ERR_SHAPE; }
    return scale(output, input, aux, n_aux, dims, n_dims, stream);
}

static int kernel_fallback(void* output, const void* input, const void* aux[], int n_aux,
                           const int64_t dims[], int n_dims, void* stream) {
    (void)aux; (void)n_aux; (void)n_dims; (void)stream;
    for (int64_t i = 0; i < dims[0]; ++i) ((float*)output)[i] = 2.0f * ((const float*)input)[i];
    return EX_OK;
}

#ifndef NO_GET_FACTOR
static ex_factor_t s_factor;
EX_EXPORT ex_factor_t* ex_get_factor(const ex_hardware_t* hw) {
#ifdef CRASH
    *(volatile int*)0 = 1;
#endif
#ifdef HANG
    for (volatile int spin = 1; spin;) {}
#endif
#ifdef EXIT_IN_GET
    exit(EXIT_IN_GET);   /* ends the caller's process: the probe must refuse it */
#endif
#ifdef ENV_SWITCH
    { const char* v = getenv(ENV_SWITCH); g_env_plus = (v != NULL && v[0] == '1' && v[1] == 0) ? 1.0f : 0.0f; }
#endif
#ifdef MUTATE_HW
    ((ex_hardware_t*)hw)->warp_size = MUTATE_HW;   /* a write through the const pointer */
#endif
#ifdef RETURN_NULL
    (void)hw;
    return NULL;
#else
#ifdef STRUCT_ABI
    s_factor.abi_version = STRUCT_ABI;
#else
    s_factor.abi_version = EX_ABI_VERSION;
#endif
    s_factor.factor_id = FACTOR_ID;
#ifdef NULL_NAME
    s_factor.name = NULL;
#else
    s_factor.name = NAME;
#endif
    s_factor.version = VERSION;
    s_factor.tuning.threads_per_block = TPB;
    s_factor.tuning.items_per_thread = 1;
    s_factor.tuning.vec_size = 4;
    s_factor.tuning.shared_mem_bytes = 0;
    s_factor.tuning.num_warps = TPB / hw->warp_size;
    s_factor.tuning.num_stages = 1;
#ifdef NULL_KERNEL
    s_factor.kernel = NULL;
#else
    s_factor.kernel = kernel;
#endif
    s_factor.kernel_fallback = BEHAVIOUR == 1 ? kernel_fallback : NULL;
#ifdef WORKSPACE
    s_factor.workspace_size = workspace_size;
#else
    s_factor.workspace_size = NULL;
#endif
    s_factor.last_error = last_error;
    s_factor.priority = PRIORITY;
#ifdef BAD_DESCRIPTION
    s_factor.description = (const char*)0x10;   /* a pointer the runtime must not follow in-process */
#else
    s_factor.description = "test: out = alpha * in on host memory";
#endif
    return &s_factor;
#endif
}
#endif

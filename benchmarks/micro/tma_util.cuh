// Helpers shared by the TMA microbenchmarks of this folder: error checks, mbarrier and bulk
// tensor copy wrappers (raw PTX, sm_90), and a 2D tensor map over a [rows, cols] uint16 matrix
// with boxes of 64 columns x box_rows rows and the 128-byte swizzle the GEMMs use.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
#define CU(x) do { CUresult e = (x); if (e != CUDA_SUCCESS) { const char* s; cuGetErrorString(e, &s); printf("CU %s at %d: %s\n", #x, __LINE__, s); exit(1);} } while (0)

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t* b, int n) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_u32(b)), "r"(n)); }
__device__ __forceinline__ void mbar_expect(uint64_t* b, int bytes) { asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_u32(b)), "r"(bytes)); }
__device__ __forceinline__ void mbar_arrive(uint64_t* b) { asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_u32(b))); }
__device__ __forceinline__ void mbar_wait(uint64_t* b, int parity) {
    asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}" :: "r"(smem_u32(b)), "r"(parity));
}
__device__ __forceinline__ void tma2d(void* dst, const CUtensorMap* m, int c0, int c1, uint64_t* bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(smem_u32(dst)), "l"(m), "r"(c0), "r"(c1), "r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void bulk(void* dst, const void* src, int bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}

// Thread 0 initialises a ring of `stages` full/empty barrier pairs (one arrival each); the block syncs.
__device__ __forceinline__ void init_ring(uint64_t* full, uint64_t* empty, int stages) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) { mbar_init(&full[s], 1); mbar_init(&empty[s], 1); }
        asm volatile("fence.mbarrier_init.release.cluster;");
    }
    __syncthreads();
}

// The consumer warp of a ring: `count` stages in order, each waited for, touched (a word per
// lane), optionally held `spin` clocks (standing in for the MMAs), then released.
__device__ __forceinline__ void consume_ring(uint64_t* full, uint64_t* empty, int stages, long long count,
                                             const uint8_t* base, int stage_bytes, int spin,
                                             unsigned long long* sink) {
    const int lane = threadIdx.x % 32;
    int s = 0, ph = 0;
    unsigned long long acc = 0;
    for (long long i = 0; i < count; ++i) {
        if (lane == 0) mbar_wait(&full[s], ph);
        __syncwarp();
        acc += ((const uint32_t*)(base + (size_t)s * stage_bytes))[lane];
        if (spin) { long long t0 = clock64(); while (clock64() - t0 < spin) {} }
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[s]);
        if (++s == stages) { s = 0; ph ^= 1; }
    }
    if (acc == 42) sink[0] = acc;   // keeps the loads
}

// Tiles t = blockIdx.x, blockIdx.x + gridDim.x, ... below n_tiles: how many this block gets.
__device__ __forceinline__ long long strided_tiles(long long n_tiles) {
    return blockIdx.x < n_tiles ? (n_tiles - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
}

// The best of `reps` runs of launch() (milliseconds, CUDA events around each; the host waits).
template <class F>
static float best_ms(int reps, F launch) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    float best = 1e30f;
    for (int rep = 0; rep < reps; ++rep) {
        cudaEventRecord(e0);
        launch();
        cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
        float ms; cudaEventElapsedTime(&ms, e0, e1); best = ms < best ? ms : best;
    }
    cudaEventDestroy(e0); cudaEventDestroy(e1);
    return best;
}

static CUtensorMap make_map(void* p, uint64_t cols, uint64_t rows, uint32_t box_rows) {
    CUtensorMap m;
    cuuint64_t dims[2] = {cols, rows};
    cuuint64_t strides[1] = {cols * 2};
    cuuint32_t box[2] = {64, box_rows};
    cuuint32_t es[2] = {1, 1};
    CU(cuTensorMapEncodeTiled(&m, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, p, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
    return m;
}

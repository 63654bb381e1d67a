// GEMM1's weight stream through TMA with the chunked kernels' two loads of a 128-row tile of w13
// (E, 2I, H): (0) two 64-row boxes, gate rows then up rows (the sub-tiles' load); (1) one 5-D box
// of the gate/up-interleaved view (E, I/8, 2, 8, H) (swap AB's load); (2) sixteen 8-row boxes
// giving the same interleave. Does the 5-D box stream slower? 132 CTAs, a producer thread and a
// consumer warp that only releases stages (no MMA), mixtral's shape (E = 8, I = 14336, H = 4096).
// Build and run on an H100/H200 (needs the driver library for cuTensorMapEncodeTiled):
//   nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o gustream gustream.cu -lcuda && ./gustream
// Results: benchmarks/RESULTS.md, section "Swap AB on the chunks that pad most".
#include "tma_util.cuh"
#include <cstdio>
#include <cstdint>

constexpr int E = 8, I = 14336, H = 4096, STAGE = 16384;

__device__ __forceinline__ void tma5d(void* dst, const CUtensorMap* m, int c0, int c1, int c2, int c3, int c4, uint64_t* bar) {
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, %6}], [%7];"
                 :: "r"(smem_u32(dst)), "l"(m), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(smem_u32(bar)) : "memory");
}

__global__ void __launch_bounds__(64) gustream(const __grid_constant__ CUtensorMap m64, const __grid_constant__ CUtensorMap m8,
                                               const __grid_constant__ CUtensorMap m5, int variant, int stages,
                                               unsigned long long* sink) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    uint8_t* base = (uint8_t*)(((uintptr_t)smem_raw + 1023) & ~uintptr_t(1023));
    __shared__ uint64_t full[8], empty[8];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    init_ring(full, empty, stages);
    const int n_items = E * (I / 64), KB = H / 64;
    if (warp == 0 && lane == 0) {
        int s = 0, ph = 0;
        for (int it = blockIdx.x; it < n_items; it += gridDim.x) {
            const int e = it / (I / 64), n = it % (I / 64);
            for (int kb = 0; kb < KB; ++kb) {
                mbar_wait(&empty[s], ph ^ 1);
                mbar_expect(&full[s], STAGE);
                uint8_t* d = base + s * STAGE;
                if (variant == 0) {
                    tma2d(d, &m64, kb * 64, e * 2 * I + n * 64, &full[s]);
                    tma2d(d + 8192, &m64, kb * 64, e * 2 * I + I + n * 64, &full[s]);
                } else if (variant == 1) {
                    tma5d(d, &m5, kb * 64, 0, 0, n * 8, e, &full[s]);
                } else {
                    for (int g = 0; g < 8; ++g) {
                        tma2d(d + g * 2048, &m8, kb * 64, e * 2 * I + n * 64 + g * 8, &full[s]);
                        tma2d(d + g * 2048 + 1024, &m8, kb * 64, e * 2 * I + I + n * 64 + g * 8, &full[s]);
                    }
                }
                if (++s == stages) { s = 0; ph ^= 1; }
            }
        }
    } else if (warp == 1) {
        consume_ring(full, empty, stages, strided_tiles(n_items) * KB, base, STAGE, 0, sink);
    }
}

int main() {
    const size_t elems = (size_t)E * 2 * I * H, bytes = elems * 2;
    void* w; CK(cudaMalloc(&w, bytes)); CK(cudaMemset(w, 1, bytes));
    unsigned long long* sink; CK(cudaMalloc(&sink, 8));
    CUtensorMap m64 = make_map(w, H, (uint64_t)E * 2 * I, 64), m8 = make_map(w, H, (uint64_t)E * 2 * I, 8), m5;
    {
        cuuint64_t dims[5] = {H, 8, 2, I / 8, E};
        cuuint64_t strides[4] = {(cuuint64_t)H * 2, (cuuint64_t)I * H * 2, (cuuint64_t)8 * H * 2, (cuuint64_t)2 * I * H * 2};
        cuuint32_t box[5] = {64, 8, 2, 8, 1}, es[5] = {1, 1, 1, 1, 1};
        CU(cuTensorMapEncodeTiled(&m5, CU_TENSOR_MAP_DATA_TYPE_UINT16, 5, w, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
    }
    const int smem = 8 * STAGE + 1024;
    CK(cudaFuncSetAttribute(gustream, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const char* names[3] = {"two 64-row boxes (sub-tiles)", "one 5-D box (swap AB)", "sixteen 8-row boxes"};
    printf("w13 stream, E=%d I=%d H=%d (%.2f GB), 132 CTAs, best of 5\n", E, I, H, bytes / 1e9);
    for (int stages : {4, 8})
        for (int v = 0; v < 3; ++v) {
            float ms = best_ms(5, [&] { gustream<<<132, 64, smem>>>(m64, m8, m5, v, stages, sink); });
            CK(cudaGetLastError());
            printf("  stages %d  %-30s %8.1f us  %7.0f GB/s\n", stages, names[v], ms * 1e3, bytes / (ms * 1e-3) / 1e9);
        }
    return 0;
}

// Microbenchmark: does a per-row 2D TMA (box 64 x 1, SWIZZLE_128B) land rows in the same
// swizzled smem layout as one 128 x 64 box, and how fast can a producer warp issue them?
// Build and run on an H100/H200 (needs the driver library for cuTensorMapEncodeTiled):
//   nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o tma_rowgather tma_rowgather.cu -lcuda && ./tma_rowgather
// Results: benchmarks/RESULTS.md, section "What bounds the memory-bound GEMMs".
#include "tma_util.cuh"
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <random>


constexpr int H = 2048, T = 4096, K = 8, SLOTS = T * K, BM = 128, BK = 64, STAGES = 4;
constexpr int A_BYTES = BM * BK * 2, B_BYTES = 256 * BK * 2;


// correctness: tile mt, k-tile kt, rows gathered per row (mode 1) or by box from xs (mode 0)
__global__ void check_kernel(const __grid_constant__ CUtensorMap row_map, const __grid_constant__ CUtensorMap xs_map,
                             const int* rows, int mt, int kt, int mode, uint16_t* out) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    uint8_t* sA = (uint8_t*)(((uintptr_t)smem_raw + 1023) & ~uintptr_t(1023));
    __shared__ uint64_t bar;
    if (threadIdx.x == 0) { mbar_init(&bar, 1); asm volatile("fence.mbarrier_init.release.cluster;"); }
    __syncthreads();
    if (threadIdx.x == 0) mbar_expect(&bar, A_BYTES);
    __syncthreads();
    if (mode == 0) {
        if (threadIdx.x == 0) tma2d(sA, &xs_map, kt * BK, mt * BM, &bar);
    } else {
        for (int r = threadIdx.x; r < BM; r += blockDim.x) tma2d(sA + r * 128, &row_map, kt * BK, rows[mt * BM + r], &bar);
    }
    mbar_wait(&bar, 0);
    for (int i = threadIdx.x; i < A_BYTES / 2; i += blockDim.x) out[i] = ((uint16_t*)sA)[i];
}

// throughput: warp 0 producer, warp 1 consumer (no math, optional spin)
__global__ void __launch_bounds__(64) stream_kernel(const __grid_constant__ CUtensorMap row_map, const __grid_constant__ CUtensorMap xs_map,
                              const __grid_constant__ CUtensorMap w_map, const int* rows, int n_tiles, int mode, int with_b, int spin,
                              unsigned long long* sink) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    uint8_t* base = (uint8_t*)(((uintptr_t)smem_raw + 1023) & ~uintptr_t(1023));
    uint8_t* sA = base;                         // STAGES x 16 KB
    uint8_t* sB = base + STAGES * A_BYTES;      // STAGES x 32 KB
    __shared__ uint64_t full[STAGES], empty[STAGES];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    init_ring(full, empty, STAGES);
    const int MT = SLOTS / BM, KT = H / BK, NB = 1536 * 128 / 256;
    const int bytes = A_BYTES + (with_b ? B_BYTES : 0);
    if (warp == 0) {
        int s = 0, ph = 0;
        for (int t = blockIdx.x; t < n_tiles; t += gridDim.x) {
            int mt = t % MT, nb = (t / MT * 7 + t) % NB;
            int r0 = rows[mt * BM + lane], r1 = rows[mt * BM + 32 + lane], r2 = rows[mt * BM + 64 + lane], r3 = rows[mt * BM + 96 + lane];
            for (int kt = 0; kt < KT; ++kt) {
                if (lane == 0) { mbar_wait(&empty[s], ph ^ 1); mbar_expect(&full[s], bytes); }
                __syncwarp();
                uint8_t* a = sA + s * A_BYTES;
                if (mode == 0) {
                    if (lane == 0) tma2d(a, &xs_map, kt * BK, mt * BM, &full[s]);
                } else if (mode == 1) {
                    if (lane == 0) for (int r = 0; r < BM; ++r) tma2d(a + r * 128, &row_map, kt * BK, rows[mt * BM + r], &full[s]);
                } else {
                    tma2d(a + lane * 128, &row_map, kt * BK, r0, &full[s]);
                    tma2d(a + (32 + lane) * 128, &row_map, kt * BK, r1, &full[s]);
                    tma2d(a + (64 + lane) * 128, &row_map, kt * BK, r2, &full[s]);
                    tma2d(a + (96 + lane) * 128, &row_map, kt * BK, r3, &full[s]);
                }
                if (with_b && lane == 0) {
                    tma2d(sB + s * B_BYTES, &w_map, kt * BK, nb * 256, &full[s]);
                    tma2d(sB + s * B_BYTES + B_BYTES / 2, &w_map, kt * BK, nb * 256 + 128, &full[s]);
                }
                if (++s == STAGES) { s = 0; ph ^= 1; }
            }
        }
    } else if (warp == 1) {
        consume_ring(full, empty, STAGES, strided_tiles(n_tiles) * (H / BK), sA, A_BYTES, spin, sink);
    }
}


// Tile64-like stream: A = 64 rows (box) from an L2-sized xs, B = 256 rows of the weights,
// S stages; at each new tile the producer optionally idles `bubble` clocks (a TMA descriptor
// update's fence) before its first load.
__global__ void __launch_bounds__(64) stream64_kernel(const __grid_constant__ CUtensorMap xs64_map,
                              const __grid_constant__ CUtensorMap w_map, int n_tiles, int stages, int spin, int bubble,
                              int drain, unsigned long long* sink) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    uint8_t* base = (uint8_t*)(((uintptr_t)smem_raw + 1023) & ~uintptr_t(1023));
    constexpr int A64 = 64 * BK * 2, STG = A64 + B_BYTES;
    __shared__ uint64_t full[8], empty[8];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    init_ring(full, empty, stages);
    const int MT = 4096 * 8 / 8 / 64, KT = H / BK, NB = 1536 * 128 / 256;   // T=512: 4096 rows / 64
    if (warp == 0) {
        int s = 0, ph = 0, issued = 0;
        for (int t = blockIdx.x; t < n_tiles; t += gridDim.x) {
            int mt = t % MT, nb = t % NB;
            if (lane == 0 && drain) {  // wait until every stage issued so far was consumed
                int s2 = s, ph2 = ph;
                for (int i = 0; i < min(issued, stages); ++i) { if (s2 == 0) { s2 = stages; ph2 ^= 1; } --s2; }
                // simplest: wait on the empty barrier of the stage before the current one
                if (issued) { int sp = (s + stages - 1) % stages; int php = (s == 0) ? ph ^ 1 : ph; mbar_wait(&empty[sp], php); }
            }
            if (lane == 0 && bubble) { long long t0 = clock64(); while (clock64() - t0 < bubble) {} }
            for (int kt = 0; kt < KT; ++kt) {
                if (lane == 0) {
                    mbar_wait(&empty[s], ph ^ 1); mbar_expect(&full[s], STG);
                    uint8_t* a = base + s * STG;
                    tma2d(a, &xs64_map, kt * BK, (mt * 64) % 4096, &full[s]);
                    tma2d(a + A64, &w_map, kt * BK, nb * 256, &full[s]);
                    tma2d(a + A64 + B_BYTES / 2, &w_map, kt * BK, nb * 256 + 128, &full[s]);
                }
                ++issued;
                if (++s == stages) { s = 0; ph ^= 1; }
            }
        }
    } else if (warp == 1) {
        consume_ring(full, empty, stages, strided_tiles(n_tiles) * (H / BK), base, STG, spin, sink);
    }
}


static uint16_t val(int r, int c) { return (uint16_t)(((uint32_t)(r * H + c) * 2654435761u) >> 16); }

int main() {
    int nsm; CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
    std::vector<uint16_t> hsrc((size_t)T * H);
    for (int r = 0; r < T; ++r) for (int c = 0; c < H; ++c) hsrc[(size_t)r * H + c] = val(r, c);
    std::mt19937 g(1);
    std::vector<int> hrows(SLOTS);
    for (int i = 0; i < SLOTS; ++i) hrows[i] = g() % T;
    hrows[5] = T;  // out of bounds -> zeros
    std::vector<uint16_t> hxs((size_t)SLOTS * H);
    for (int i = 0; i < SLOTS; ++i) for (int c = 0; c < H; ++c) hxs[(size_t)i * H + c] = hrows[i] < T ? hsrc[(size_t)hrows[i] * H + c] : 0;
    uint16_t *src, *xs, *w, *out; int* rows; unsigned long long* sink;
    size_t wrows = (size_t)1536 * 128;
    CK(cudaMalloc(&src, hsrc.size() * 2)); CK(cudaMalloc(&xs, hxs.size() * 2)); CK(cudaMalloc(&w, wrows * H * 2));
    CK(cudaMalloc(&out, A_BYTES)); CK(cudaMalloc(&rows, SLOTS * 4)); CK(cudaMalloc(&sink, 8));
    CK(cudaMemcpy(src, hsrc.data(), hsrc.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(xs, hxs.data(), hxs.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemset(w, 1, wrows * H * 2));
    CK(cudaMemcpy(rows, hrows.data(), SLOTS * 4, cudaMemcpyHostToDevice));
    CUtensorMap row_map = make_map(src, H, T, 1), xs_map = make_map(xs, H, SLOTS, BM), w_map = make_map(w, H, wrows, 128);
    // --- correctness
    std::vector<uint16_t> o0(A_BYTES / 2), o1(A_BYTES / 2);
    int bad = 0, badf = 0;
    for (int mt : {0, 7, 255}) for (int kt : {0, 5, 31}) {
        CK(cudaFuncSetAttribute(check_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 32768));
        check_kernel<<<1, 128, A_BYTES + 1024>>>(row_map, xs_map, rows, mt, kt, 0, out); CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(o0.data(), out, A_BYTES, cudaMemcpyDeviceToHost));
        check_kernel<<<1, 128, A_BYTES + 1024>>>(row_map, xs_map, rows, mt, kt, 1, out); CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(o1.data(), out, A_BYTES, cudaMemcpyDeviceToHost));
        for (int i = 0; i < A_BYTES / 2; ++i) bad += o0[i] != o1[i];
        for (int r = 0; r < BM; ++r) for (int c = 0; c < BK; ++c) {
            int off = r * 64 + (((c / 8) ^ (r % 8)) * 8) + c % 8;
            int gr = hrows[mt * BM + r];
            uint16_t e = gr < T ? val(gr, kt * BK + c) : 0;
            badf += o1[off] != e;
        }
    }
    printf("check: per-row vs box mismatches %d, vs swizzle formula %d (of %d elements)\n", bad, badf, 9 * A_BYTES / 2);
    // --- throughput
    int smem = STAGES * (A_BYTES + B_BYTES) + 1024;
    CK(cudaFuncSetAttribute(stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const int n_tiles = 1920;  // qwen3-30b T = 4096 GEMM1 tile count
    const char* names[3] = {"box from xs", "per-row, 1 thread", "per-row, 32 lanes"};
    for (int with_b : {0, 1}) for (int spin : {0, 1400}) for (int mode : {0, 1, 2}) {
        const float best = best_ms(4, [&] { stream_kernel<<<nsm, 64, smem>>>(row_map, xs_map, w_map, rows, n_tiles, mode, with_b, spin, sink); });
        double stages = (double)n_tiles * (H / BK);
        double bytes = stages * (A_BYTES + (with_b ? B_BYTES : 0));
        printf("B %-3s spin %4d  %-18s %8.1f us  %6.3f us/stage/SM  %6.2f TB/s into smem\n", with_b ? "yes" : "no", spin, names[mode],
               best * 1e3, best * 1e3 / (stages / nsm), bytes / (best * 1e-3) / 1e12);
    }

    {
        CUtensorMap xs64_map = make_map(xs, H, 4096, 64);   // T = 512 x K = 8 rows: 16.8 MB, L2-resident
        const int n64 = 128 * 6 + 40;                      // qwen3-30b T = 512 GEMM1 tiles (approx.)
        for (int stages : {3, 5}) {
            int sm64 = stages * (64 * BK * 2 + B_BYTES) + 1024;
            CK(cudaFuncSetAttribute(stream64_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, sm64));
            for (int spin : {0, 600}) for (int drain : {0, 1}) for (int bubble : {0, 2000, 6000}) {
                if (drain == 0 && bubble) continue;
                const float best = best_ms(3, [&] { stream64_kernel<<<nsm, 64, sm64>>>(xs64_map, w_map, n64, stages, spin, bubble, drain, sink); });
                double wbytes = (double)n64 * 256 * H * 2;
                printf("tile64 stages %d spin %4d drain %d bubble %5d: %8.1f us, weights %5.2f TB/s\n", stages, spin, drain,
                       bubble, best * 1e3, wbytes / (best * 1e-3) / 1e12);
            }
        }
    }
    CK(cudaGetLastError());
    return 0;
}

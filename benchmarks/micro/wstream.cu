// Weight streaming through TMA: does the shape of a stage (rows x bytes per row) change the
// DRAM rate? 132 CTAs, a producer warp, a consumer warp that only releases stages.
// Build and run on an H100/H200 (needs the driver library for cuTensorMapEncodeTiled):
//   nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o wstream wstream.cu -lcuda && ./wstream
// ONLY_GEMMLIKE=1 skips the stage-shape sweep (for Nsight Compute: ncu -k regex:gstream ./wstream).
// Results: benchmarks/RESULTS.md, section "What bounds the memory-bound GEMMs".
#include "tma_util.cuh"
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <algorithm>


constexpr int H = 2048, STAGE = 32768;

// pattern p: a tile is R = 256 >> p rows x all H columns; a stage is R rows x (64 << p) columns
// (boxes of 64 columns x min(R, 128) rows); p = 4: contiguous 32 KB bulk copies.
__global__ void __launch_bounds__(64) wstream(const __grid_constant__ CUtensorMap m128, const __grid_constant__ CUtensorMap m64,
                                              const __grid_constant__ CUtensorMap m32, const uint8_t* w, long long rows, int p,
                                              int stages, int order, unsigned long long* sink, long long row0 = 0) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    uint8_t* base = (uint8_t*)(((uintptr_t)smem_raw + 1023) & ~uintptr_t(1023));
    __shared__ uint64_t full[8], empty[8];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    init_ring(full, empty, stages);
    const int R = p < 4 ? 256 >> p : 8, C = p < 4 ? 64 << p : 2048;  // p = 4: 8 rows x 4 KB contiguous
    const long long n_tiles = rows / R;
    const int kt_n = H / C;
    const CUtensorMap* m = R >= 128 ? &m128 : R == 64 ? &m64 : &m32;
    const int box_rows = R >= 128 ? 128 : R;
    if (warp == 0 && lane == 0) {
        int s = 0, ph = 0;
        for (long long i = 0;; ++i) {
            long long t = order ? (long long)blockIdx.x * ((n_tiles + gridDim.x - 1) / gridDim.x) + i : blockIdx.x + i * gridDim.x;
            if (order ? (i >= (n_tiles + gridDim.x - 1) / gridDim.x || t >= n_tiles) : t >= n_tiles) break;
            for (int kt = 0; kt < kt_n; ++kt) {
                mbar_wait(&empty[s], ph ^ 1);
                mbar_expect(&full[s], STAGE);
                uint8_t* d = base + s * STAGE;
                if (p == 4) {
                    bulk(d, w + (row0 + t * (long long)R) * H * 2, STAGE, &full[s]);
                } else {
                    int nb = 0;
                    for (int c = 0; c < C; c += 64)
                        for (int r = 0; r < R; r += box_rows, ++nb)
                            tma2d(d + nb * box_rows * 128, m, kt * C + c, (int)(row0 + t * R + r), &full[s]);
                }
                if (++s == stages) { s = 0; ph ^= 1; }
            }
        }
    } else if (warp == 1) {
        consume_ring(full, empty, stages, order ? max(0LL, min((n_tiles + gridDim.x - 1) / gridDim.x, n_tiles - (long long)blockIdx.x * ((n_tiles + gridDim.x - 1) / gridDim.x))) * kt_n : strided_tiles(n_tiles) * kt_n, base, STAGE, 0, sink);
    }
}


// GEMM-like stage: 256 weight rows x 128 B (tile t: rows 256 t .. of w, all H columns) plus
// a_rows rows x 128 B of A from rows [0, a_region) of a (L2-resident when a_region is small).
__global__ void __launch_bounds__(64) gstream(const __grid_constant__ CUtensorMap mw, const __grid_constant__ CUtensorMap ma,
                                              int n_tiles, int a_rows, int a_region, int stages, unsigned long long* sink) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    uint8_t* base = (uint8_t*)(((uintptr_t)smem_raw + 1023) & ~uintptr_t(1023));
    __shared__ uint64_t full[8], empty[8];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int stage_bytes = STAGE + a_rows * 128;
    init_ring(full, empty, stages);
    if (warp == 0 && lane == 0) {
        int s = 0, ph = 0;
        for (int t = blockIdx.x; t < n_tiles; t += gridDim.x)
            for (int kt = 0; kt < H / 64; ++kt) {
                mbar_wait(&empty[s], ph ^ 1);
                mbar_expect(&full[s], stage_bytes);
                uint8_t* d = base + s * stage_bytes;
                tma2d(d, &mw, kt * 64, t * 256, &full[s]);
                tma2d(d + 16384, &mw, kt * 64, t * 256 + 128, &full[s]);
                // a_region < 0: the A box lies past the tensor's last row (the TMA zero-fills it)
                if (a_rows) tma2d(d + STAGE, &ma, kt * 64, a_region < 0 ? 32768 + (t * a_rows) % 4096 : (t * a_rows) % a_region, &full[s]);
                if (++s == stages) { s = 0; ph ^= 1; }
            }
    } else if (warp == 1) {
        consume_ring(full, empty, stages, strided_tiles(n_tiles) * (H / 64), base, stage_bytes, 0, sink);
    }
}


int main() {
    int nsm; CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
    const long long rows = 1536LL * 128 * 2;   // 1.6 GB: twice qwen3-30b's w13, no L2 reuse between runs
    uint8_t* w; unsigned long long* sink;
    CK(cudaMalloc(&w, rows * H * 2)); CK(cudaMalloc(&sink, 8));
    CK(cudaMemset(w, 1, rows * H * 2));
    CUtensorMap mw_all = make_map(w, H, rows, 128); CUtensorMap m128 = make_map(w, H, rows, 128), m64 = make_map(w, H, rows, 64), m32 = make_map(w, H, rows, 32);
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    const char* names[5] = {"256 rows x 128 B", "128 rows x 256 B", " 64 rows x 512 B", " 32 rows x 1 KB ", "contiguous 32 KB"};
    if (const char* sizes = getenv("SIZES_MB")) {   // short streams: decode-sized weight reads
        const int stages = 5, smem = stages * STAGE + 1024;
        CK(cudaFuncSetAttribute(wstream, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        for (const char* q = sizes; *q;) {
            char* end;
            const double mb = strtod(q, &end);
            if (end == q) break;
            q = end;
            const long long n = (long long)(mb * 1e6 / (H * 2)) / 256 * 256;   // rows, whole tiles
            for (int p : {0, 4}) {
                float t[21];
                for (int i = 0; i < 21; ++i) {   // each launch reads another range (no L2 reuse)
                    const long long row0 = (i * 7919LL * 256) % (rows - n) / 256 * 256;
                    cudaEventRecord(e0);
                    wstream<<<nsm, 64, smem>>>(m128, m64, m32, w, n, p, stages, 0, sink, row0);
                    cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
                    cudaEventElapsedTime(&t[i], e0, e1);
                }
                std::sort(t + 1, t + 21);
                printf("one launch, %6.1f MB, stage %s: median %6.2f us (%4.2f TB/s), min %6.2f us\n", n * H * 2 / 1e6,
                       names[p], t[10] * 1e3, n * H * 2 / (t[10] * 1e-3) / 1e12, t[1] * 1e3);
            }
        }
        return 0;
    }
    for (int stages : {5}) if (getenv("ONLY_GEMMLIKE") == nullptr)
        for (int order : {0})
            for (int p = 0; p < 5; ++p) {
                int smem = stages * STAGE + 1024;
                CK(cudaFuncSetAttribute(wstream, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                const float best = best_ms(3, [&] { wstream<<<nsm, 64, smem>>>(m128, m64, m32, w, rows, p, stages, order, sink); });
                printf("stages %d  %s  stage %s  %8.1f us  %5.2f TB/s\n", stages, order ? "blocked tiles   " : "interleaved tiles",
                       names[p], best * 1e3, rows * H * 2 / (best * 1e-3) / 1e12);
            }

    {
        uint8_t* a; CK(cudaMalloc(&a, 32768LL * H * 2)); CK(cudaMemset(a, 2, 32768LL * H * 2));
        CUtensorMap ma16 = make_map(a, H, 32768, 16), ma32 = make_map(a, H, 32768, 32), ma64 = make_map(a, H, 32768, 64),
                    ma128 = make_map(a, H, 32768, 128);
        // 768: qwen3-30b's gated GEMM1 at T = 512 on 64-row tiles (32 rows per expert; a 1 x 2
        // cluster multicasting A: ~16 A rows per CTA and stage)
        for (int n_tiles : {768, 808, 792, 1584, 1600})
            for (int a_rows : {0, 16, 32, 64, 128})
                for (int a_region : {4096, 32768, -1}) {
                    if (!a_rows && a_region != 4096) continue;
                    int stages = a_rows == 128 ? 4 : 5;
                    int smem = stages * (STAGE + a_rows * 128) + 1024;
                    CK(cudaFuncSetAttribute(gstream, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                    const CUtensorMap& ma = a_rows == 128 ? ma128 : a_rows == 64 ? ma64 : a_rows == 32 ? ma32 : ma16;
                    const float best = best_ms(3, [&] { gstream<<<nsm, 64, smem>>>(mw_all, ma, n_tiles, a_rows, a_region, stages, sink); });
                    char from[32];
                    if (a_region < 0) snprintf(from, sizeof from, "past the end");
                    else snprintf(from, sizeof from, "from %5d rows", a_region);
                    printf("gemm-like: %4d tiles (%5.2f per SM), A %3d rows %s, %d stages: %8.1f us, weights %5.2f TB/s\n",
                           n_tiles, n_tiles / (double)nsm, a_rows, from, stages, best * 1e3,
                           n_tiles * 256.0 * H * 2 / (best * 1e-3) / 1e12);
                }
    }
    CK(cudaGetLastError());
    return 0;
}

"""How fast the GPU reads a weight matrix in the pattern the GEMMs stream it (CuPy, one GPU).

    python3 benchmarks/dram_rows_probe.py [--mb 805] [--row-bytes 4096] [--rows 128] [--repeat 20]

Every GEMM of moe_fused_gemm streams its weights as a CTA's tile of rows (an N-tile: 64-256 rows
of w13 or w2) walked along the reduction in stages of 64 elements: 128 bytes of each row per stage
(TMA boxes of 64 rows x 128 bytes on the Hopper path, 16-byte cp.async chunks on the portable
one). Consecutive requests of a stage hit rows row_bytes apart, so each touches a different DRAM
page. This probe asks whether that costs bandwidth: a read-only kernel walks the same matrix in
tiles of --rows rows, reading W bytes of every row of its tile per step, for W = 128, 256, 512,
1024 (those that divide a row) and a whole row (the rows one after the other: plain sequential),
and W = 256 and 512 again as 128-byte boxes one after the other (every row's first 128 bytes,
then every row's next: two TMA boxes of a stage along the reduction), and reports GB/s of
each beside a device copy (cupy.copyto, read + write bytes) in the same process. Loads are
16-byte streaming loads (ld.global.cs), four per thread in flight per step, 256 threads a block,
as many blocks as the tiles.

The result bounds what a different box shape (more bytes of a row per request) could give the
memory-bound GEMMs (T <= 512): if W = 128 reads as fast as a whole row, DRAM page locality is not
what holds their weight streams at 75-90% of the copy ceiling (benchmarks/RESULTS.md).
"""
from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import run_meta, write_json  # noqa: E402  (date, device, commit: RESULTS.md's rule)
_scripts = runpy.run_path(str(Path(__file__).resolve().parents[1] / "ex_engine" / "_scripts.py"))  # stdlib only

KERNEL = r"""
extern "C" __global__ void __launch_bounds__(256)
rows_read(const uint4* __restrict__ w, int rows, long long row_u4, int step_u4, int boxed,
          unsigned int* __restrict__ sink) {
    // block b owns rows [b * rows, (b + 1) * rows); step s reads step_u4 16-byte chunks of each
    // of them, from chunk s * step_u4 on: consecutive threads take consecutive chunks of a row,
    // then the next row (the order of a TMA box's or a cp.async stage's requests); boxed: in
    // boxes of 128 bytes a row, every row's first 128 bytes, then every row's next (as TMA boxes
    // of 128-byte rows issued one after the other)
    const uint4* base = w + (long long)blockIdx.x * rows * row_u4;
    const int per_step = rows * step_u4;
    const long long steps = row_u4 / step_u4;
    unsigned int acc = 0;
    for (long long s = 0; s < steps; ++s) {
#pragma unroll 4
        for (int i = threadIdx.x; i < per_step; i += blockDim.x) {
            int r, c;
            if (boxed) {
                const int b = i / (rows * 8);
                r = (i / 8) % rows;
                c = b * 8 + (i & 7);
            } else {
                r = i / step_u4;
                c = i - r * step_u4;
            }
            const uint4 v = __ldcs(base + (long long)r * row_u4 + s * step_u4 + c);
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;   // keeps the loads; (almost) never true
}
"""


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--mb", type=_scripts["number"], default=805.0,
                    help="matrix size in MB (default 805: olmoe's w13 or qwen3-30b's)")
    ap.add_argument("--row-bytes", type=_scripts["integer"], default=4096,
                    help="bytes of one row (the reduction: H = 2048 bf16 is 4096; default)")
    ap.add_argument("--rows", type=_scripts["integer"], default=128, help="rows of a tile (one CTA's; default 128)")
    ap.add_argument("--repeat", type=_scripts["integer"], default=20, help="timed reads of each pattern (default 20)")
    ap.add_argument("--json", metavar="FILE", help="write the results here as JSON")
    a = ap.parse_args(argv)
    if not 0 < a.mb < float("inf") or a.repeat < 1 or a.rows < 1:   # (nan fails the first test too)
        ap.error(f"--mb must be a finite number > 0, --repeat and --rows >= 1; got {a.mb}, {a.repeat}, {a.rows}")
    if a.row_bytes < 128 or a.row_bytes % 128:
        ap.error(f"--row-bytes: expected a multiple of 128 (>= 128), got {a.row_bytes}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ex_engine._scripts import output_file_problem, report_problems
    if report_problems("dram_rows_probe.py", [output_file_problem("--json", a.json, (".json",))]):
        return 2   # before the GPU work, whose figures would be lost at the end
    try:
        import cupy as cp
        if cp.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as exc:   # ImportError, CUDA errors: a GPU is what this probe measures
        print(f"dram_rows_probe.py: needs a GPU with CuPy ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    tile_bytes = a.rows * a.row_bytes
    tiles = max(1, int(a.mb * 1e6) // tile_bytes)
    nbytes = tiles * tile_bytes
    w = cp.random.randint(0, 2**31 - 1, size=nbytes // 4, dtype=cp.int32)
    dst = cp.empty_like(w)
    sink = cp.zeros(1, cp.uint32)
    kern = cp.RawKernel(KERNEL, "rows_read")
    row_u4 = a.row_bytes // 16
    start, stop = cp.cuda.Event(), cp.cuda.Event()

    def timed(fn) -> float:
        fn()
        cp.cuda.Device().synchronize()
        start.record()
        for _ in range(a.repeat):
            fn()
        stop.record()
        stop.synchronize()
        return cp.cuda.get_elapsed_time(start, stop) * 1e-3 / a.repeat   # s per read

    name = cp.cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    print(f"{name}: {nbytes / 1e6:.0f} MB in {tiles} tiles of {a.rows} rows x {a.row_bytes} B", flush=True)
    results = {}
    t = timed(lambda: cp.copyto(dst, w))
    results["copy"] = 2 * nbytes / t / 1e9
    print(f"  {'device copy (read + write)':<44s} {results['copy']:8.1f} GB/s", flush=True)
    # (widths that divide a row: a step never runs past it)
    patterns = [(wb, 0) for wb in (128, 256, 512, 1024) if wb < a.row_bytes and a.row_bytes % wb == 0]
    patterns += [(wb, 1) for wb in (256, 512) if wb < a.row_bytes and a.row_bytes % wb == 0]
    for wb, boxed in patterns + [(a.row_bytes, 0)]:
        args = (w, cp.int32(a.rows), cp.int64(row_u4), cp.int32(wb // 16), cp.int32(boxed), sink)
        t = timed(lambda: kern((tiles,), (256,), args))
        key = ("whole rows (sequential)" if wb == a.row_bytes else
               f"{wb} B of each row per step" + (" in 128 B boxes" if boxed else ""))
        results[key] = nbytes / t / 1e9
        print(f"  {key:<44s} {results[key]:8.1f} GB/s", flush=True)
    if a.json:
        write_json(a.json, {**run_meta(device=name), "bytes": nbytes, "rows": a.rows,
                            "row_bytes": a.row_bytes, "repeat": a.repeat, "GB/s": results})
    return 0


if __name__ == "__main__":
    _scripts["exit_quietly_on_broken_pipe"](main)   # `| head`, Ctrl-C, `> /dev/full`: one line, no traceback

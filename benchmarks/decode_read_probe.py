#!/usr/bin/env python3
"""How fast can any kernel read the weights a decode call of an MoE layer needs? (one GPU)

    python3 benchmarks/decode_read_probe.py [--models all] [--tokens 1 8 64] [--json F]

Issue 3 asks, at T <= 64, for a call within 1.10x of the floor: the bytes of the experts the
call's tokens hit (3*H*I*2 bytes each, bf16) at the copy ceiling of ../shared/PERF.md (4.23
TB/s). At T = 1 those are a few tens of MB, which a GPU does not stream at its full rate: the
first DRAM round trip, the ramp of the requests and a kernel boundary are not free. This probe
measures what a kernel that does nothing but read those bytes takes, under the benchmark's own
conditions (CUDA-graph replay of calls rotating over 4 input sets, each set with its own copy of
w13 and w2 and its own routing, drawn as benchmarks/bench_moe.py draws them), so that the gap of
moe_fused_gemm to the floor can be split into what reading alone costs and what is ours:

- one launch: one kernel reads every hit expert's w13 slice (2I x H) and w2 slice (H x I);
- two launches: the w13 slices, then the w2 slices (the boundary between GEMM1 and GEMM2);
- three launches: those two and a one-block kernel (the combine's launch).

Each launch is tried with 132, 264, 528 and 1056 blocks of 256 threads (a block reads one
contiguous span of the slices, 16-byte streaming loads, 8 in flight per thread); the fastest
is reported. Also timed: graphs of 1, 2 and 3 empty launches (one block each) a call. No launch
overlaps the one before (no programmatic dependent launch), so a probe is what a plain
kernel sequence reaches, not a bound on what overlap could reach. Figures are µs per call
(median of 20 replays after 200 ms of warm replay), and their ratio to the floor.

Needs PyTorch and CuPy with a CUDA GPU (the probe kernel is CuPy's, launched on torch's stream
inside torch's graph capture); --help needs neither. Exit status: 0 done; 2 bad arguments, or
no GPU.
"""
from __future__ import annotations

import argparse
import itertools
import runpy
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the scripts' helpers, standard library only, loaded by path (--help needs no numpy)
_scripts = runpy.run_path(str(HERE.parent / "ex_engine" / "_scripts.py"))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

KERNEL = r"""
extern "C" __global__ void __launch_bounds__(256)
slices_read(const unsigned long long* __restrict__ base, const long long* __restrict__ pre, int R,
            long long chunk, unsigned int* __restrict__ sink) {
    // regions r = 0..R-1 are laid end to end in one index space of 16-byte words:
    // region r is [pre[r], pre[r+1]) and starts at address base[r]; block b reads the words
    // [b * chunk, (b + 1) * chunk) of that space
    const long long lo = (long long)blockIdx.x * chunk;
    const long long hi = min(lo + chunk, pre[R]);
    unsigned int acc = 0;
    for (int r = 0; r < R; ++r) {
        const long long a = max(lo, pre[r]), b = min(hi, pre[r + 1]);
        if (a >= b) continue;
        const uint4* p = reinterpret_cast<const uint4*>(base[r]) - pre[r];
        long long i = a + threadIdx.x;
        const long long step = blockDim.x;
        for (; i + 7 * step < b; i += 8 * step) {
            uint4 v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) v[u] = __ldcs(p + i + u * step);
#pragma unroll
            for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        }
        for (; i < b; i += step) {
            const uint4 v = __ldcs(p + i);
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;   // keeps the loads; (almost) never true
}

extern "C" __global__ void empty_kernel(unsigned int* __restrict__ sink) {
    if (threadIdx.x == 1024) sink[0] = 1;   // never true: a launch that does nothing
}
"""
BLOCKS = (132, 264, 528, 1056)
SETS = 4
COPY_TBPS = 4.23   # ../shared/PERF.md's copy ceiling, the floor's


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--models", nargs="+", default=["all"], metavar="MODEL",
                    help="models of manifests/moe_models.yaml, or 'all' (default)")
    ap.add_argument("--tokens", nargs="+", type=_scripts["integer"], default=[1, 8, 64], metavar="T",
                    help="token counts (default 1 8 64; each 1..4096)")
    ap.add_argument("--seed", type=_scripts["integer"], default=0, help="seed of the routing, >= 0 (default 0)")
    ap.add_argument("--json", metavar="FILE", help="write the results here as JSON")
    a = ap.parse_args(argv)
    bad = [t for t in a.tokens if not 1 <= t <= 4096]
    if bad:
        ap.error(f"--tokens: expected counts from 1 to 4096, got {' '.join(map(str, bad))}")
    if a.seed < 0:   # torch's manual_seed takes no negative seed
        ap.error(f"--seed: expected an integer >= 0, got {a.seed}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    from ex_engine.moe_layer import models_tokens_json_or_exit
    shapes, names = models_tokens_json_or_exit("decode_read_probe.py", a.models, a.tokens, a.json)
    models = [(m, shapes[m]) for m in names]
    try:
        import cupy as cp
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
    except Exception as exc:   # ImportError, CUDA errors: a GPU is what this probe measures
        print(f"decode_read_probe.py: needs a GPU with PyTorch and CuPy ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return 2
    from _timing import graph_us, run_meta, write_json
    from bench_moe import routing

    mod = cp.RawModule(code=KERNEL)
    read_k, empty_k = mod.get_function("slices_read"), mod.get_function("empty_kernel")
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")

    def launch(kern, grid, args):
        with warnings.catch_warnings():   # (CuPy 14 calls ExternalStream deprecated; it is what ran)
            warnings.simplefilter("ignore", DeprecationWarning)
            stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        with stream:
            kern((grid,), (256,), args)

    def reader(regions, blocks):
        """A zero-argument callable reading ``regions`` [(address, 16-byte words)] in ``blocks``."""
        pre = [0, *itertools.accumulate(n for _, n in regions)]
        base_t = torch.tensor([p for p, _ in regions], dtype=torch.int64, device="cuda")
        pre_t = torch.tensor(pre, dtype=torch.int64, device="cuda")
        chunk = -(-pre[-1] // blocks)
        chunk = -(-chunk // 2048) * 2048   # whole rounds of 8 loads of 256 threads
        grid = -(-pre[-1] // chunk)
        args = (cp.uint64(base_t.data_ptr()), cp.uint64(pre_t.data_ptr()), cp.int32(len(regions)),
                cp.int64(chunk), cp.uint64(sink.data_ptr()))
        keep = (base_t, pre_t)

        def run():
            launch(read_k, grid, args)
            return keep
        return run

    def empty():
        launch(empty_k, 1, (cp.uint64(sink.data_ptr()),))

    results = []
    meta = run_meta(sets=SETS, blocks=list(BLOCKS), copy_tbps=COPY_TBPS)
    print(f"{meta['device']}: read-only probes of the hit experts' weights; µs a call, ratio to "
          f"the floor (weights at {COPY_TBPS} TB/s)", flush=True)
    empties = {n: graph_us([lambda n=n: [empty() for _ in range(n)]], warm_ms=200.0) for n in (1, 2, 3)}
    print("  empty launches a call: " + ", ".join(f"{n}: {us:.2f} µs" for n, us in empties.items()), flush=True)
    gen = torch.Generator(device="cuda")
    esize = torch.tensor([], dtype=torch.bfloat16).element_size()
    for name, s in models:
        w13_words, w2_words = 2 * s.I * s.H * esize // 16, s.H * s.I * esize // 16
        copies = []
        for _ in range(SETS):   # each set its own copy, as bench_moe: nothing left in L2
            w13 = torch.empty(s.E, 2 * s.I, s.H, dtype=torch.bfloat16, device="cuda")
            w2 = torch.empty(s.E, s.H, s.I, dtype=torch.bfloat16, device="cuda")
            w13.view(torch.int16).random_(-32768, 32767)
            w2.view(torch.int16).random_(-32768, 32767)
            copies.append((w13, w2))
        for T in a.tokens:
            gen.manual_seed(a.seed)
            hit = []
            for _ in range(SETS):
                _, ids = routing(T, s.E, s.K, s.renormalize, False, gen)
                hit.append(sorted(set(ids.flatten().tolist())))
            experts_hit = sum(len(h) for h in hit) / SETS
            wbytes = experts_hit * 3 * s.H * s.I * esize
            floor_us = wbytes / (COPY_TBPS * 1e12) * 1e6
            row = {"model": name, "T": T, "experts_hit": experts_hit,
                   "weight_bytes": wbytes, "floor_us": floor_us}
            # each set's regions (address, 16-byte words): its hit experts' w13 and w2 slices
            slices = [([(w13[e].data_ptr(), w13_words) for e in h], [(w2[e].data_ptr(), w2_words) for e in h])
                      for (w13, w2), h in zip(copies, hit)]
            for variant, n_launch in (("one launch", 1), ("two launches", 2), ("three launches", 3)):
                best = None
                for blocks in BLOCKS:
                    fns = []
                    for r13, r2 in slices:
                        if n_launch == 1:
                            parts = [reader(r13 + r2, blocks)]
                        else:
                            parts = [reader(r13, blocks), reader(r2, blocks)]
                        if n_launch == 3:
                            parts.append(empty)
                        fns.append(lambda parts=parts: [p() for p in parts])
                    us = graph_us(fns, warm_ms=200.0)
                    if best is None or us < best[0]:
                        best = (us, blocks)
                row[variant] = {"us": best[0], "blocks": best[1], "x_floor": best[0] / floor_us}
            results.append(row)
            print(f"  {name:<22s} T={T:<4d} experts {row['experts_hit']:5.1f}  floor {floor_us:7.2f}  " +
                  "  ".join(f"{v} {row[v]['us']:7.2f} ({row[v]['x_floor']:.2f}x, {row[v]['blocks']} blocks)"
                            for v in ("one launch", "two launches", "three launches")), flush=True)
            if a.json:
                write_json(a.json, {**meta, "empty_launches_us": empties, "rows": results})
        del copies
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    # its --help and table print 'µs': escaped, not an error, under an ASCII locale; `| head`,
    # Ctrl-C, `> /dev/full`: one line, no traceback
    _scripts["exit_quietly_on_broken_pipe"](main)

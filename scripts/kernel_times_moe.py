#!/usr/bin/env python3
"""Per-kernel GPU times of moe_fused_gemm calls, from PyTorch's profiler (CUPTI kernel trace).

    python3 scripts/kernel_times_moe.py --cases qwen3-30b-a3b:512 olmoe-1b-7b:4096 [--calls 8]

For each case (model of moe_models.yaml : T): builds the layer (N(0, 0.02) weights, bf16 by
default), three independently routed input sets (as benchmarks/bench_moe.py), three warm-up
calls, then --calls eager calls under torch.profiler; prints, per kernel name, the mean µs per
call, its share of the summed kernel time, and the wall time from the first kernel's start to
the last kernel's end per call. Kernels launched with programmatic dependent launch overlap
their neighbours, so the per-kernel times add up to more than the wall time; the wall time of
eager calls also includes launch gaps that a CUDA graph removes. Needs no hardware counters
(works where Nsight Compute cannot read them). Environment variables such as
EX_MOE_SM90_MIN_ROWS_PER_EXPERT apply as for any call (read when the plugin loads).

--graph: the calls run as benchmarks/bench_moe.py and ab_moe.py time them instead, in a CUDA
graph of --calls calls cycling over the three sets, replayed back to back (1 s of warm-up, then
5 profiled replays): per-kernel µs per call under sustained load, the graph's µs per call, the
profiled replays' time with no kernel running (idle gaps, charged to the kernel after each; kernels
that overlap under programmatic dependent launch count once), and the SM clock and board power
sampled (NVML) in the warm-up's second half. The eager calls above
are synchronised one by one, so the card idles between them and holds higher clocks than in a
graph: on the power-limited H200, qwen3-30b T = 4096 read 699 µs a call eager and 729-795 in
graph replay (RESULTS.md, session thirty-one).

--json FILE: also writes the run (date, device, commit) and, per case, the model's shape, the
path, µs per call of each kernel, with --graph the graph's µs per call, its clocks and the
profiled replays' first kernel start to last end (span_us) and busy time (busy_us) per call,
without --graph the median wall time of a call (wall_us, launch gaps included), and the
routing's rows: T*K slots and the rows that 128-row tiles compute (each expert's rows rounded up
to a multiple of 128, the mean over the three sets); written before the first case (with
--ceilings' rates) and after every case; benchmarks/gap_moe.py reads it. --ceilings: first
measures the card's bf16 matmul, copy and write rates in this process
(benchmarks/_timing.ceilings), prints them and, with --json, records them in the JSON.

Needs PyTorch with a CUDA GPU (its profiler) and the built plugins; --help needs neither. Every
argument problem is listed before any work (exit status 2).
"""
from __future__ import annotations

import argparse
import re
import runpy
import sys
import time
from collections import defaultdict
from pathlib import Path

try:
    import torch
except ImportError:  # --help works without it
    torch = None

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
# standard library only, loaded by path: --help answers where the package (numpy) does not import
_scripts = runpy.run_path(str(ROOT / "ex_engine" / "_scripts.py"))
exit_quietly_on_broken_pipe = _scripts["exit_quietly_on_broken_pipe"]


# the Hopper plugin's grouped GEMM tilings (TileShape M, N, K) other than the 128 x 256 default
CUTLASS_TILE_LABELS = {("64", "256", "64"): "<64-row tiles>", ("128", "128", "64"): "<128 x 128 tiles>"}


def short_name(name: str) -> str:
    """A readable kernel name: CUTLASS's device_kernel<...> as cutlass_gemm, templates dropped."""
    if "cutlass" in name and "device_kernel" in name:  # the gated GEMM1 has its own mainloop type
        if "GatedMainloop" in name:
            return "cutlass_grouped_gemm<gated GEMM1>"
        # the TileShape among the name's (C<a>, C<b>, C<c>) triples (cluster shapes are others)
        for tile in re.findall(r"C<(\d+)>,\s*cute::C<(\d+)>,\s*cute::C<(\d+)>", name):
            if tile in CUTLASS_TILE_LABELS:
                return "cutlass_grouped_gemm" + CUTLASS_TILE_LABELS[tile]
        return "cutlass_grouped_gemm"
    name = re.sub(r"^void ", "", name)
    base = name.split("<", 1)[0].split("(", 1)[0]
    if base.endswith("moe_gemm_kernel"):  # GATED is the third template argument
        return "moe_gemm_kernel<GEMM1>" if re.search(r",\s*true\s*>", name) else "moe_gemm_kernel<GEMM2>"
    if base.endswith("chunked_gemm_kernel") and "<" in name:  # <T, kGated, kMc, kBand, kSubs>: kGated second
        args = [a.strip() for a in name.split("<", 1)[1].split(">", 1)[0].split(",")]
        gated = args[1] if len(args) > 1 else ""   # true/false, or 1/0 (Nsight Compute's names)
        if gated in ("true", "1", "false", "0"):
            return "chunked_gemm_kernel<GEMM1>" if gated in ("true", "1") else "chunked_gemm_kernel<GEMM2>"
    return base.rsplit("::", 1)[-1]


def idle_gaps(spans):
    """(first start to last end, time some kernel ran, {kernel name: idle µs before it}) of
    profiled kernel spans (start µs, end µs, name); overlapping kernels (programmatic dependent
    launch) count once in the busy time, and a kernel that starts before the running ones end
    has no idle time before it."""
    spans = sorted(spans)
    idle = defaultdict(float)
    if not spans:
        return 0.0, 0.0, idle
    busy, end = 0.0, spans[0][0]
    for a, b, name in spans:
        if a > end:
            idle[name] += a - end
            busy += b - a
        else:
            busy += max(0.0, b - end)
        end = max(end, b)
    return end - spans[0][0], busy, idle


def median_wall(spans) -> tuple:
    """(median µs per call, calls seen) of profiled kernel spans (start µs, end µs, name) of
    eager calls synchronised one by one: kernels grouped into calls by the idle gaps between them
    (more than 20 µs: the next call); (0.0, 0) for no spans."""
    walls, cur = [], None
    for a, b, _ in sorted(spans):
        if cur is None or a > cur[1] + 20:
            if cur:
                walls.append(cur[1] - cur[0])
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    if cur:
        walls.append(cur[1] - cur[0])
    walls.sort()
    return (walls[len(walls) // 2] if walls else 0.0), len(walls)


def routing_rows(sets, E: int, tile: int = 128) -> dict:
    """{"slots": T*K, "tile_rows": the rows that ``tile``-row tiles compute (each expert's rows
    rounded up to a multiple of ``tile``), "experts_hit": experts with a row; each the mean over
    ``sets``} of input sets whose last item is topk_ids (T, K); ids outside 0..E-1 go nowhere
    (counted in none)."""
    slots, tiled, hit = 0.0, 0.0, 0.0
    for a in sets:
        ids = a[-1].reshape(-1).long()
        ids = ids[(ids >= 0) & (ids < E)]
        counts = torch.bincount(ids, minlength=E)
        slots += float(counts.sum())
        tiled += float(((counts + tile - 1) // tile * tile).sum())
        hit += float((counts > 0).sum())
    n = len(sets)
    return {"slots": slots / n, "tile_rows": tiled / n, "tile": tile, "experts_hit": hit / n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_scripts["HelpFormatter"])
    ap.add_argument("--cases", nargs="+", required=True, metavar="MODEL:T[:skewed]",
                    help="model:T pairs, T >= 1, models of manifests/moe_models.yaml, e.g. qwen3-30b-a3b:512; "
                         "a trailing :skewed draws skewed routing (a few hot experts), as bench_moe.py --skew")
    ap.add_argument("--calls", type=_scripts["integer"], default=8, help="profiled calls per case (>= 1)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                    help="activation and weight dtype")
    ap.add_argument("--factors", default=None, metavar="FOLDER", help="plugin folder (default: factors/)")
    ap.add_argument("--config", default=None, help=_scripts["CONFIG_HELP"])
    ap.add_argument("--graph", action="store_true",
                    help="time the kernels inside CUDA-graph replay (sustained, as the benchmarks time "
                         "calls) and report the SM clock and power it ran at")
    ap.add_argument("--json", default=None, metavar="FILE",
                    help="write the run and every case's kernel times here, after every case "
                         "(benchmarks/gap_moe.py reads it); not written by default")
    ap.add_argument("--ceilings", action="store_true",
                    help="measure the card's matmul, copy and write rates first, in this process, "
                         "print them and, with --json, record them in the JSON")
    args = ap.parse_args()
    from ex_engine import FactorError, FactorRegistry, moe_fused_gemm
    from ex_engine.moe_layer import load_models_or_exit, parse_cases, report_problems

    models = load_models_or_exit("kernel_times_moe")
    cases, problems = parse_cases(models, args.cases, skewed_ok=True)   # every problem at once, before any work
    problems += _scripts["config_problems"](args.config)
    if args.factors is not None:
        problems.append(_scripts["plugin_folder_problem"]("--factors", args.factors))
    if args.calls < 1:
        problems.append(f"--calls: expected >= 1, got {args.calls}")
    problem = _scripts["output_file_problem"]("--json", args.json, (".json",))
    if problem:
        problems.append(problem)
    if torch is None or not torch.cuda.is_available():
        problems.append("needs PyTorch and a CUDA GPU")
    if report_problems("kernel_times_moe", problems):
        return 2
    from torch.profiler import ProfilerActivity, profile

    from bench_moe import input_sets, layer_weights
    from _timing import ClockSampler, _capture, ceilings, run_meta, write_json

    dt = getattr(torch, args.dtype)
    try:
        reg = FactorRegistry.load(args.factors)
    except FactorError as exc:
        print(f"kernel_times_moe: --factors: {exc}", file=sys.stderr)
        return 2
    if args.config is not None:
        _scripts["force_config"](reg, args.config)
    gen = torch.Generator(device="cuda").manual_seed(0)
    meta = run_meta(dtype=args.dtype, graph=args.graph, factors=args.factors or "factors/", config=args.config)
    if args.ceilings:
        print("measuring the card's ceilings here (matmul, copy, write) ...", file=sys.stderr, flush=True)
        meta["ceilings_here"] = ceilings()
        print("ceilings here: " + ", ".join(f"{k} {v:.1f}" for k, v in meta["ceilings_here"].items()), flush=True)
    rows = []
    if args.json:   # the rates are kept even if the first case fails
        write_json(args.json, {"meta": meta, "rows": rows})
    for i, (m, T, skew) in enumerate(cases):
        label = f"{m} T={T}{' skewed' if skew else ''}"
        print(f"[{i + 1}/{len(cases)}] {label} ...", file=sys.stderr, flush=True)
        s = models[m]
        w13, w2 = layer_weights(s, dt, gen)
        sets = input_sets(s, T, 3, w13, w2, dt, gen, skew=skew)
        row = {"model": m, "T": T, "skewed": skew, "H": s.H, "I": s.I, "E": s.E, "K": s.K, **routing_rows(sets, s.E)}
        for a in sets:
            moe_fused_gemm(*a, registry=reg)
        torch.cuda.synchronize()
        if args.graph:
            fns = [lambda a=a: moe_fused_gemm(*a, registry=reg) for a in sets]
            calls = max(args.calls, len(fns))
            graph = _capture(fns, calls)
            # 1 s of replays, 4 queued at a time (no idle gap), the clock sampled in the last half
            # (NVML's power reading lags: sampled from the start, 0.3 s read 94-247 W)
            def replay_for(seconds):
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < seconds:
                    for _ in range(4):
                        graph.replay()
                    torch.cuda.synchronize()
            replay_for(0.5)
            with ClockSampler(torch.cuda.current_device()) as clocks:
                replay_for(0.5)
            replays = 5
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record()
            for _ in range(replays):
                graph.replay()
            ev[1].record()
            ev[1].synchronize()
            graph_us = ev[0].elapsed_time(ev[1]) * 1000.0 / (replays * calls)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(replays):
                    graph.replay()
                torch.cuda.synchronize()
            del graph
            ncalls = replays * calls
        else:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for j in range(args.calls):
                    moe_fused_gemm(*sets[j % 3], registry=reg)
                    torch.cuda.synchronize()
            ncalls = args.calls
        per = defaultdict(float)
        spans = []
        for ev in prof.events():
            if ev.device_type != torch.autograd.DeviceType.CUDA or ev.name.startswith("Memcpy") \
                    or ev.name.startswith("Memset"):
                continue
            per[short_name(ev.name)] += ev.time_range.end - ev.time_range.start
            spans.append((ev.time_range.start, ev.time_range.end, short_name(ev.name)))
        total = sum(per.values())
        path = reg.last_path.get("moe_fused_gemm")
        row.update(path=path, calls=ncalls, kernels_us={k: v / ncalls for k, v in per.items()})
        if args.graph:
            span_us, busy_us, idle_before = idle_gaps(spans)
            row.update(graph_us=graph_us, clocks=clocks.summary(), span_us=span_us / ncalls,
                       busy_us=busy_us / ncalls)
        else:
            wall, n_walls = median_wall(spans)
            row["wall_us"] = wall
        rows.append(row)
        if args.json:
            write_json(args.json, {"meta": meta, "rows": rows})
        if args.graph:
            print(f"{label} ({path}, CUDA graph of {calls} calls, {replays} replays): kernels "
                  f"{total / ncalls:.1f} µs per call, graph {graph_us:.1f} µs per call; warm-up at "
                  f"{clocks.summary()}", flush=True)
            for k, v in sorted(per.items(), key=lambda kv: -kv[1]):
                print(f"    {k:<36}{v / ncalls:>9.1f} µs {100 * v / total:>5.1f}%", flush=True)
            print(f"  profiled replays: first kernel start to last end {span_us / ncalls:.1f} µs per "
                  f"call, some kernel running {busy_us / ncalls:.1f}, none running "
                  f"{(span_us - busy_us) / ncalls:.1f}; idle before each kernel (µs per call):", flush=True)
            for k, v in sorted(idle_before.items(), key=lambda kv: -kv[1]):
                print(f"    {k:<36}{v / ncalls:>9.1f} µs", flush=True)
            del w13, w2, sets, fns
            torch.cuda.empty_cache()
            continue
        print(f"{label} ({path}): kernels {total / args.calls:.1f} µs per call, wall {wall:.1f} µs "
              f"(median of {n_walls} calls)", flush=True)
        for k, v in sorted(per.items(), key=lambda kv: -kv[1]):
            print(f"    {k:<36}{v / args.calls:>9.1f} µs {100 * v / total:>5.1f}%", flush=True)
        del w13, w2, sets
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    exit_quietly_on_broken_pipe(main)

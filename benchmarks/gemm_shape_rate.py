#!/usr/bin/env python3
"""What cuBLAS and torch._grouped_mm reach at the shapes of moe_fused_gemm's two GEMMs (one GPU).

    python3 benchmarks/gemm_shape_rate.py [--models all] [--tokens 4096 16384] [--json F]
    ncu --profile-from-start off python3 benchmarks/gemm_shape_rate.py --profile --models M --tokens T

A call of moe_fused_gemm at T tokens runs two grouped GEMMs over its T*K routed rows: GEMM1
(M = T*K, N = 2I, K = H; hidden_states times w13) and GEMM2 (M = T*K, N = H, K = I; act times
w2). benchmarks/gap_moe.py sets each against the card's matmul rate on 8192^3, which no GEMM
with a reduction of 512-2048 (GEMM2 at I <= 2048) or with every expert's weights to stream may
reach. This tool measures, for each model and T, two references at those very shapes:

- dense: one torch.matmul (cuBLAS) of (M x K) by one expert's (K x N): the same FLOPs, no
  grouping, the weights L2-resident: what the card's GEMM library reaches at that reduction;
- grouped: torch._grouped_mm over E groups of the model's real weight bytes (E experts of
  N x K), the M rows split evenly (M / E each, the remainder spread): the same FLOPs and
  weight bytes as the MoE GEMM with no padding and no routing skew.

Each is timed as the benchmarks time calls (CUDA-graph replay, benchmarks/_timing.graph_us,
median of 20 replays after warm replay); TFLOP/s count 2*M*N*K. --json also records the card's
matmul, copy and write rates measured in the same process (_timing.ceilings). --profile runs
each op once per shape inside a CUDA profiler range instead (for Nsight Compute, as above), and
times nothing.

Inputs: N(0, 1) rows, N(0, 0.02) weights, bfloat16. A model or T given twice is measured once.
Needs PyTorch with a CUDA GPU and torch._grouped_mm (a Hopper-class card for its kernels); --help
needs neither. Exit status: 0 done; 2 bad arguments (T*K above 2^31 - 1 too), no GPU, or shapes
whose tensors do not fit in its memory (the shapes measured before are in --json).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def parse_args(argv=None):
    from ex_engine._scripts import HelpFormatter, integer
    from ex_engine.moe_layer import models_help
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--models", nargs="+", default=["all"], metavar="MODEL",
                    help=f"models of manifests/moe_models.yaml: {models_help(all_ok=True)}")
    ap.add_argument("--tokens", nargs="+", type=integer, default=[4096, 16384], metavar="T", help="token counts, each >= 1")
    ap.add_argument("--json", metavar="FILE", help="write the results here as JSON (after every shape)")
    ap.add_argument("--profile", action="store_true",
                    help="run each op once per shape inside a CUDA profiler range (for ncu); no timing")
    return ap.parse_args(argv)


def gemm_shapes(s, T: int) -> dict:
    """{"GEMM1": (M, N, K), "GEMM2": (M, N, K)} of a moe_fused_gemm call of model shape ``s``
    (an ex_engine.moe_layer.MoEShape) at ``T`` tokens: M = T*K routed rows."""
    M = T * s.K
    return {"GEMM1": (M, 2 * s.I, s.H), "GEMM2": (M, s.H, s.I)}


def even_groups(M: int, E: int) -> list:
    """M rows in E groups as even as they go (the first M % E groups one row more)."""
    base, rem = divmod(M, E)
    return [base + (1 if e < rem else 0) for e in range(E)]


def main(argv=None) -> int:
    a = parse_args(argv)
    from ex_engine._scripts import report_problems
    from ex_engine.moe_layer import models_tokens_json_or_exit
    shapes, models = models_tokens_json_or_exit("gemm_shape_rate.py", a.models, a.tokens, a.json)
    models, tokens = list(dict.fromkeys(models)), list(dict.fromkeys(a.tokens))   # each shape once
    # torch._grouped_mm's offsets are int32: M = T*K rows must fit
    if report_problems("gemm_shape_rate.py", [f"--tokens: T = {T} gives {m} T*K = {T * shapes[m].K} rows, above "
                                              f"2^31 - 1 (torch._grouped_mm's int32 offsets)"
                                              for m in models for T in tokens if T * shapes[m].K > 2 ** 31 - 1]):
        return 2
    try:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        if not hasattr(torch, "_grouped_mm"):
            raise RuntimeError(f"torch {torch.__version__} has no torch._grouped_mm")
    except Exception as exc:   # ImportError, CUDA errors: a GPU is what this tool measures
        print(f"gemm_shape_rate.py: needs a GPU with PyTorch ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    from _timing import ceilings, graph_us, run_meta, write_json

    def ops(s, M, N, Kd):
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, Kd, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(s.E, N, Kd, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        offs = torch.tensor(even_groups(M, s.E), device="cuda").cumsum(0).to(torch.int32)
        w0 = w[0]
        return (lambda: torch.matmul(x, w0.t(), out=out)), (lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs))

    meta = run_meta(tool="gemm_shape_rate")
    if not a.profile:
        print("measuring the card's ceilings here (matmul, copy, write) ...", file=sys.stderr, flush=True)
        meta["ceilings_here"] = ceilings()
        print("ceilings here: " + ", ".join(f"{k} {v:.1f}" for k, v in meta["ceilings_here"].items()), flush=True)
    rows = []
    cases = [(m, T, g) for m in models for T in tokens for g in ("GEMM1", "GEMM2")]
    for i, (m, T, which) in enumerate(cases, 1):
        s = shapes[m]
        M, N, Kd = gemm_shapes(s, T)[which]
        dense, grouped = ops(s, M, N, Kd)
        if a.profile:
            for _ in range(3):
                dense(), grouped()
            torch.cuda.synchronize()
            print(f"[{i}/{len(cases)}] {m} T={T} {which} (M={M} N={N} K={Kd}): dense, then grouped, profiled",
                  flush=True)
            torch.cuda.profiler.start()
            dense(), grouped()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
        else:
            flop = 2.0 * M * N * Kd
            td, tg = graph_us([dense], calls=4), graph_us([grouped], calls=4)
            rows.append({"model": m, "T": T, "gemm": which, "M": M, "N": N, "K": Kd, "E": s.E,
                         "dense_us": td, "dense_tflops": flop / td / 1e6,
                         "grouped_us": tg, "grouped_tflops": flop / tg / 1e6})
            print(f"[{i}/{len(cases)}] {m:22s} T={T:5d} {which} M={M} N={N} K={Kd}: dense {td:8.1f} µs "
                  f"{flop / td / 1e6:6.1f} TFLOP/s | grouped {tg:8.1f} µs {flop / tg / 1e6:6.1f} TFLOP/s", flush=True)
            if a.json:
                write_json(a.json, {"meta": meta, "rows": rows})
        del dense, grouped
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    from ex_engine._scripts import exit_quietly_on_broken_pipe
    exit_quietly_on_broken_pipe(main)

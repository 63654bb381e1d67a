"""Run one moe_fused_gemm call per (model, T) inside a CUDA profiler range, for Nsight Compute.

    ncu --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes_read.sum \\
        python3 scripts/profile_moe.py --models qwen3-30b-a3b olmoe-1b-7b --tokens 1

--config forces a tile configuration by name (as kernel_times_moe.py's), e.g. `--config chunked`
to profile the chunked kernels on a row the tuning file gives to another tiling. --skew draws
benchmarks/bench_moe.py's skewed routing instead (a few hot experts take most tokens; its weights
and inputs, seed 0; needs PyTorch), as bench_moe.py --skew and ab_moe.py's MODEL:T:skewed time it.

Each case: build the layer (N(0, 0.02) bf16 weights), route, three warm-up calls outside the
range, then one call inside it, so the profile shows that call's kernels only (serialised by
ncu: the per-kernel durations add up to more than the overlapped PDL launch).

Needs CuPy with a CUDA GPU and the built plugins; run it under Nsight Compute (ncu, as above; ncu
needs access to the GPU's performance counters): run alone it only makes the calls and profiles
nothing. Where ncu cannot read the counters, scripts/kernel_times_moe.py gives per-kernel times
from PyTorch's profiler instead.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ex_engine import FactorRegistry, moe_fused_gemm, topk_softmax  # noqa: E402
from ex_engine._scripts import CONFIG_HELP, HelpFormatter, config_problems, cupy_with_gpu, force_config, integer  # noqa: E402
from ex_engine.moe_layer import (MoELayer, case_problems, load_models_or_exit, models_help,  # noqa: E402
                                 report_problems)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen3-30b-a3b"], metavar="MODEL",
                    help=f"models of manifests/moe_models.yaml: {models_help()}")
    ap.add_argument("--tokens", type=integer, nargs="+", default=[1], metavar="T", help="token counts T, each >= 1")
    ap.add_argument("--factors", default=None, metavar="FOLDER", help="plugin folder (default: factors/)")
    ap.add_argument("--config", default=None, help=CONFIG_HELP)
    ap.add_argument("--skew", action="store_true",
                    help="bench_moe.py's skewed routing and inputs (a few hot experts take most tokens; "
                         "needs PyTorch) instead of the layer's router")
    args = ap.parse_args()
    models = load_models_or_exit("profile_moe")
    problems = case_problems(models, args.models, args.tokens, args.factors) + config_problems(args.config)
    if report_problems("profile_moe", problems):
        return 2
    cupy, why = cupy_with_gpu()
    if cupy is None:     # CuPy without a usable device: this line, not a CUDARuntimeError traceback
        print(f"profile_moe: needs CuPy and a CUDA GPU: {why}", file=sys.stderr)
        return 2
    reg = FactorRegistry.load(args.factors)
    if args.config is not None:
        force_config(reg, args.config)
    if args.skew:
        try:
            import torch
        except ImportError as e:
            print(f"profile_moe: --skew needs PyTorch: {e}", file=sys.stderr)
            return 2
        if not torch.cuda.is_available():
            print(f"profile_moe: --skew needs PyTorch with CUDA (torch {torch.__version__} sees no CUDA device)",
                  file=sys.stderr)
            return 2
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
        from bench_moe import input_sets, layer_weights

    for m in args.models:
        s = models[m]
        layer = None if args.skew else MoELayer(s, "bfloat16", cupy, seed=1)
        if args.skew:   # the weights once per model; each T's inputs from the generator as it left them
            gen = torch.Generator(device="cuda").manual_seed(0)
            w13, w2 = layer_weights(s, torch.bfloat16, gen)
            after_weights = gen.get_state()
        for T in args.tokens:
            if args.skew:   # (hidden_states, w13, w2, topk_weights, topk_ids), as bench_moe's first set
                gen.set_state(after_weights)
                call = input_sets(s, T, 1, w13, w2, torch.bfloat16, gen, skew=True)[0]
            else:
                x = layer.hidden_states(T)
                w, ids = topk_softmax(layer.router_logits(x), s.K, s.renormalize, registry=reg)
                call = (x, layer.w13, layer.w2, w, ids)
            for _ in range(3):
                moe_fused_gemm(*call, registry=reg)
            cupy.cuda.runtime.deviceSynchronize()
            print(f"[profile_moe] {m} T={T}{' skewed' if args.skew else ''}: profiled call follows", flush=True)
            cupy.cuda.runtime.profilerStart()
            moe_fused_gemm(*call, registry=reg)
            cupy.cuda.runtime.deviceSynchronize()
            cupy.cuda.runtime.profilerStop()
    return 0


if __name__ == "__main__":
    from ex_engine.cli import exit_quietly_on_broken_pipe
    exit_quietly_on_broken_pipe(main)

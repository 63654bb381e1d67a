"""Where the host time of one eager moe_fused_gemm call goes, stage by stage (torch, one GPU).

    python3 benchmarks/host_moe.py --models qwen3-30b-a3b granite-3.0-3b-a800m --tokens 1

Issue 3 asks one eager call at T = 1 (validation, dispatch, launches) to cost under 50 µs of
host time. bench_moe.py reports the whole call; this tool times its parts on the same inputs
(bf16 torch tensors, the model's shapes, random routing), each as the median over several short
runs of back-to-back calls (benchmarks/_timing.host_us), so the device work overlaps as it does
in an engine:

  call           ex_engine.moe_fused_gemm(...), out allocated by the call
  call, out=     the same with a preallocated out
  dispatch       registry.dispatch with the arrays as given (no ops wrapper)
  describe x6    TensorRef.of on the six arrays given (router_logits and expert_map are None)
  plugin         the registry's C call alone (stream, workspace lookup, cffi, the launches)
  launches       the plugin's kernel entry point through cffi with prepared arguments
  cffi no-op     workspace_size through cffi (the price of one crossing into C)
  torch.empty    allocating out with torch.empty(shape, dtype=, device=)
  new_empty      the same with hidden_states.new_empty(shape) (what the call does)

With --profile, cProfile's top functions (by own time) over a few thousand calls follow.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import host_us, run_meta, torch, write_json  # noqa: E402

from ex_engine import FactorRegistry, abi, moe_fused_gemm  # noqa: E402
from ex_engine._scripts import HelpFormatter, integer  # noqa: E402
from ex_engine.arrays import TensorRef  # noqa: E402
from ex_engine.moe_layer import (case_problems, load_models_or_exit, models_help, output_file_problem,  # noqa: E402
                                 report_problems)

NAMES = ("hidden_states", "w13", "w2", "topk_weights", "topk_ids")


def inputs(s, T: int, gen):
    """Random bf16 layer and routing at shape ``s``: (hidden_states, w13, w2, topk_weights,
    topk_ids), outputs O(1) as in bench_moe.py."""
    dt = torch.bfloat16
    x = torch.randn(T, s.H, device="cuda", generator=gen).to(dt)
    w13 = (torch.randn(s.E, 2 * s.I, s.H, device="cuda", generator=gen) * s.H ** -0.5).to(dt)
    w2 = (torch.randn(s.E, s.H, s.I, device="cuda", generator=gen) * s.I ** -0.5).to(dt)
    logits = torch.randn(T, s.E, device="cuda", generator=gen)
    w, ids = torch.topk(torch.softmax(logits, -1), s.K, dim=-1)
    return x, w13, w2, w.float().contiguous(), ids.int().contiguous()


def stages(reg: FactorRegistry, args5) -> dict:
    """name -> zero-argument callable, one per stage of the call (see the module docstring)."""
    x, w13, w2, w, ids = args5
    out = torch.empty_like(x)
    arrays = {"hidden_states": x, "out": out, "router_logits": None, "w13": w13, "w2": w2,
              "topk_weights": w, "topk_ids": ids, "expert_map": None}
    present = {k: v for k, v in arrays.items() if v is not None}
    plugin = reg.get("moe_fused_gemm")
    m = plugin.manifest
    reg.dispatch("moe_fused_gemm", arrays)   # fills the bind cache
    refs_by_name = {k: TensorRef.of(v, k) for k, v in present.items()}
    refs, dims, _, _, _ = m.bind(refs_by_name, None, reg.tuning.value)
    dims_c = abi.ffi.new("int64_t[]", dims)
    kernel, _ = reg._entry_points(plugin)
    stream = torch.cuda.current_stream().cuda_stream
    ws = reg._workspace(plugin, dims, reg.hardware.device_id, stream)
    aux = [0 if r is None else r.ptr for r in refs[2:]] or [0]
    if m.workspace_index is not None:
        aux[m.workspace_index] = ws.data.ptr
    n_aux, n_dims, o, i = len(m.aux), len(dims), refs[0].ptr, refs[1].ptr
    ws_fn = plugin.factor.workspace_size
    return {
        "call": lambda: moe_fused_gemm(x, w13, w2, w, ids, registry=reg),
        "call, out=": lambda: moe_fused_gemm(x, w13, w2, w, ids, out=out, registry=reg),
        "dispatch": lambda: reg.dispatch("moe_fused_gemm", arrays),
        "describe x6": lambda: [TensorRef.of(v, k) for k, v in present.items()],
        "plugin": lambda: reg._call_plugin(plugin, m, refs, dims, dims_c=dims_c),
        "launches": lambda: kernel(o, i, aux, n_aux, dims_c, n_dims, stream),
        "cffi no-op": lambda: ws_fn(dims_c, n_dims),
        "torch.empty": lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device),
        "new_empty": lambda: x.new_empty(x.shape),
    }


def profile_text(fn, calls: int, top: int) -> str:
    """cProfile's ``top`` functions by own time over ``calls`` calls of ``fn``."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main() -> int:
    # the whole docstring (its table of stages), as written, and each option's default
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter,
                                 epilog="Prints one line per stage; --json writes them too. Needs PyTorch, a "
                                        "CUDA GPU and the built plugins; every argument is checked first. "
                                        "Exit status: 0 every stage timed; 2 bad arguments, or what it needs "
                                        "is missing.")
    ap.add_argument("--models", nargs="+", default=["qwen3-30b-a3b"], metavar="MODEL",
                    help=f"models of manifests/moe_models.yaml: {models_help()}")
    ap.add_argument("--tokens", type=integer, nargs="+", default=[1], metavar="T", help="token counts T, each >= 1")
    ap.add_argument("--factors", default=None, metavar="FOLDER", help="plugin folder (default: factors/)")
    ap.add_argument("--rounds", type=integer, default=3, metavar="N",
                    help="rounds over all stages, >= 1 (alternating; the median is reported)")
    ap.add_argument("--profile", action="store_true", help="also print cProfile's top functions")
    ap.add_argument("--json", default=None, metavar="FILE",
                    help="write the run's date, device and commit, and the results, to this file")
    args = ap.parse_args()
    models = load_models_or_exit("host_moe")
    problems = case_problems(models, args.models, args.tokens, args.factors)
    if args.rounds < 1:
        problems.append(f"--rounds: expected >= 1, got {args.rounds}")
    problems.append(output_file_problem("--json", args.json, (".json",)))
    if torch is None or not torch.cuda.is_available():
        problems.append("needs PyTorch with a CUDA GPU")
    if report_problems("host_moe", problems):
        return 2
    reg = FactorRegistry.load(args.factors)
    if reg.get("moe_fused_gemm") is None:
        print("host_moe: no ready moe_fused_gemm plugin in the folder (build it: make)", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for mname in args.models:
        for T in args.tokens:
            print(f"[{mname} T={T}] timing {args.rounds} rounds ...", file=sys.stderr, flush=True)
            fns = stages(reg, inputs(models[mname], T, gen))
            times = {k: [] for k in fns}
            for _ in range(args.rounds):
                for k, fn in fns.items():
                    times[k].append(host_us(fn))
            row = {"model": mname, "T": T, "plugin": reg.get("moe_fused_gemm").path.name,
                   "us": {k: sorted(v)[len(v) // 2] for k, v in times.items()}}
            results.append(row)
            print(f"{mname} T={T} ({row['plugin']}), host µs per call, median of {args.rounds} rounds:")
            for k, v in row["us"].items():
                print(f"  {k:<14}{v:8.1f}")
            if args.profile:
                print(profile_text(fns["call"], 3000, 25))
    if args.json:
        write_json(args.json, {"meta": run_meta(rounds=args.rounds), "rows": results})
    return 0


if __name__ == "__main__":
    from ex_engine.cli import exit_quietly_on_broken_pipe
    exit_quietly_on_broken_pipe(main)

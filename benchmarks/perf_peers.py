"""vLLM 0.33.0 fused-MoE times on the H200 (CUDA-graph replay, µs), copied from ../shared/PERF.md
(the project's shared reference beside the checkout, not in it; measured 2026-11-29 in another
process: compare ratios with care; vLLM is not installed on the lent machine, so it cannot run
side by side). This file carries those times for the scripts here.

A table, not a benchmark: it measures nothing. table_moe.py and plot_moe.py put these times
beside bench_moe.py's. `python benchmarks/perf_peers.py` prints the table (--json: as JSON)."""
VLLM_US = {
    ("qwen3-30b-a3b", 1): 30.2, ("qwen3-30b-a3b", 8): 132.4, ("qwen3-30b-a3b", 64): 300.2,
    ("qwen3-30b-a3b", 512): 334.7, ("qwen3-30b-a3b", 4096): 889.4, ("qwen3-30b-a3b", 16384): 2868,
    ("mixtral-8x7b", 1): 182.1, ("mixtral-8x7b", 64): 664.1, ("mixtral-8x7b", 512): 996.1,
    ("mixtral-8x7b", 4096): 5549, ("mixtral-8x7b", 16384): 20818,
    ("deepseek-v2-lite", 1): 37.2, ("deepseek-v2-lite", 64): 288.3, ("deepseek-v2-lite", 512): 310.7,
    ("deepseek-v2-lite", 4096): 1134, ("deepseek-v2-lite", 16384): 4037,
    ("olmoe-1b-7b", 1): 36.2, ("olmoe-1b-7b", 64): 219.4, ("olmoe-1b-7b", 512): 263.8,
    ("olmoe-1b-7b", 4096): 1092, ("olmoe-1b-7b", 16384): 3909,
}


def main(argv=None) -> int:
    import argparse
    import json
    ap = argparse.ArgumentParser(
        prog="perf_peers.py",
        description="Print vLLM 0.33.0's fused-MoE times on the H200 (µs per call, CUDA-graph "
                    "replay), copied from ../shared/PERF.md (the project's shared reference "
                    "beside the checkout, not in it; measured 2026-11-29 in another "
                    "process), carried in this file. This script measures nothing: it is the "
                    "table that table_moe.py and plot_moe.py show beside bench_moe.py's times.")
    ap.add_argument("--json", action="store_true",
                    help="print JSON rows {model, T, vllm_us} instead of a table")
    args = ap.parse_args(argv)
    rows = [{"model": m, "T": t, "vllm_us": us} for (m, t), us in sorted(VLLM_US.items())]
    if args.json:
        text = json.dumps(rows, indent=1)
    else:
        text = "\n".join([f"{'model':<18} {'T':>6} {'vLLM (µs)':>10}"] +
                         [f"{r['model']:<18} {r['T']:>6} {r['vllm_us']:>10.1f}" for r in rows])
    print(text)
    return 0


if __name__ == "__main__":
    import runpy
    from pathlib import Path
    # 'µs' in its table and --help, escaped under an ASCII locale; `| head`, `> /dev/full`: one
    # line, no traceback (the helper loaded by path: standard library only, as table_moe.py does)
    _scripts = runpy.run_path(str(Path(__file__).resolve().parents[1] / "ex_engine" / "_scripts.py"))
    _scripts["exit_quietly_on_broken_pipe"](main)

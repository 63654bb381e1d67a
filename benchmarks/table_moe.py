#!/usr/bin/env python3
"""Markdown table of bench_moe.py's JSON, with PERF.md's vLLM times beside ours.
    python3 benchmarks/table_moe.py bench_moe.json"""
import argparse
import json
import sys
from pathlib import Path

from perf_peers import VLLM_US


def main(path):
    try:
        d = json.load(open(path))
        m = d["meta"]
        d["rows"], m["device"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"table_moe: {path}: expected the JSON that bench_moe.py --json writes (meta and rows): "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(f"{m['device']}, {m['date']}, commit {m['commit']}, {m['dtype']}, torch {m['torch']}; "
          "µs per call, CUDA-graph replay over 4 independently routed input sets\n")
    print("| model | T | routing | floor | ours | ours/floor | TFLOP/s | GB/s | gmm | gmm/ours | vLLM (PERF.md) | vLLM/ours | fallback |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in d["rows"]:
        if "ours_us" not in r:
            print(f"| {r['model']} | {r['T']} | | | FAILED: {r.get('error')} |")
            continue
        v = VLLM_US.get((r["model"], r["T"])) if not r["skewed"] else None
        g = r.get("gmm_us")
        ours = r["ours_us"]
        vl = f"{v:,.1f}" if v else "-"
        vr = f"{v / ours:.2f}" if v else "-"
        fb = f"{r['fallback_us']:,.0f}" if r.get("fallback_us") else "-"
        route = "skewed" if r["skewed"] else "uniform"
        print(f"| {r['model']} | {r['T']} | {route} | {r['floor_us']:.1f} | {ours:.1f} | "
              f"{r['x_floor']:.2f} | {r['tflops']:.0f} | {r['gbs']:.0f} | {g:.1f} | {g / ours:.2f} | "
              f"{vl} | {vr} | {fb} |")

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", help="the --json output of benchmarks/bench_moe.py")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's ex_engine
    from ex_engine.cli import exit_quietly_on_broken_pipe
    exit_quietly_on_broken_pipe(main, ap.parse_args().json)

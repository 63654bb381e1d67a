"""Tune moe_fused_gemm's tile configuration per shape and T on this GPU; write it as data.

For each model of manifests/moe_models.yaml and each T, forces every tile configuration the
kernels know (tiny, decode, mid, mid32, mid48, prefill and, with the Hopper plugin, grouped,
grouped64 and narrow), checks each
output against a float32 reference, times it (CUDA-graph replay over rotated input sets, as
bench_moe.py), and writes the fastest per (H, I, G, K, T) to a tuning file that the registry
reads (manifests/tuning/<device>.yaml; ex_engine/tuning.py documents the format). Entries of
shapes not tuned in this run are kept. Needs PyTorch and a CUDA GPU.

    python3 benchmarks/tune_moe.py --models qwen3-30b-a3b --tokens 1 64 4096 --out my.yaml
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    import torch  # noqa: E402
except ImportError:  # --help works without it; a run says it needs it
    torch = None
import yaml  # noqa: E402

from _timing import graph_us  # noqa: E402
from bench_moe import input_sets, layer_weights, reference, rel  # noqa: E402
from ex_engine import FactorRegistry, _yaml, moe_fused_gemm  # noqa: E402
from ex_engine.moe_layer import case_problems, load_models_or_exit, output_file_problem, report_problems  # noqa: E402
from ex_engine.tuning import tuning_dir  # noqa: E402

CONFIGS = {"tiny": 0, "decode": 1, "mid": 2, "prefill": 3, "grouped": 4, "mid32": 5, "mid48": 6,
           "grouped64": 7, "narrow": 8}
VALUES = {"auto": -1, **CONFIGS}   # auto: the kernel's own choice from T*K/G
KEY = ["H", "I", "G", "K"]


def candidates(rows_per_expert: float, grouped: bool) -> list:
    """Configurations worth timing at this many rows per expert (the others lose by far)."""
    out = []
    if rows_per_expert <= 64:
        out += ["tiny", "decode"]
    if rows_per_expert >= 2:
        out += ["mid"]
    if 8 <= rows_per_expert <= 128:
        out += ["mid32"]
    if 16 <= rows_per_expert <= 128:
        out += ["mid48"]
    if rows_per_expert >= 16:
        out += ["prefill"] + (["grouped", "grouped64", "narrow"] if grouped else [])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["all"], help="model names or 'all'")
    ap.add_argument("--tokens", type=int, nargs="+",
                    default=[1, 8, 32, 64, 128, 512, 1024, 4096, 16384], help="T values to tune")
    ap.add_argument("--sets", type=int, default=4, help="routed input sets rotated per graph")
    ap.add_argument("--margin", type=float, default=0.03,
                    help="record a configuration only if it beats the kernel's own choice by this "
                         "fraction (default 0.03); else record 'auto'")
    ap.add_argument("--out", default=None,
                    help="tuning file to write (default manifests/tuning/<profile>.yaml for this GPU)")
    args = ap.parse_args()
    models = load_models_or_exit("tune_moe")
    # every argument checked before any work (the tuning file is written after the whole run)
    problems = case_problems(models, [m for m in args.models if m != "all"], args.tokens, all_ok=True)
    if args.sets < 1 or args.margin < 0:
        problems.append(f"--sets and --margin: expected >= 1 and >= 0, got {args.sets} and {args.margin}")
    problems.append(output_file_problem("--out", args.out))
    if report_problems("tune_moe", problems):
        return 2
    if torch is None or not torch.cuda.is_available():
        print("tune_moe: needs PyTorch and a CUDA GPU (README: 'On a GPU machine')", file=sys.stderr)
        return 2
    reg = FactorRegistry.load()
    plugin = reg.get("moe_fused_gemm")
    if plugin is None:
        print("moe_fused_gemm: no ready plugin on this GPU: nothing to tune", file=sys.stderr)
        return 2
    grouped = "sm90" in plugin.path.name
    device = torch.cuda.get_device_name()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = Path(args.out) if args.out else tuning_dir() / (
        "h200.yaml" if (device, sms) == ("NVIDIA H200", 132)
        else re.sub(r"\W+", "_", device.lower()).strip("_") + f"_{sms}sm.yaml")
    text = out.read_text() if out.exists() else ""
    data = _yaml.load(text) if text else None   # read as the registry reads it (YAML 1.2 floats)
    notes = []                     # the merged file's own comment lines, kept below the new header
    if not isinstance(data, dict) or (data.get("device"), data.get("multiprocessor_count")) != (device, sms):
        data = {}                  # another device's (or no) table: start a new one, merge nothing
    else:
        for line in text.splitlines():
            if not line.startswith("#"):
                break
            notes.append(line)
    data.update({"device": device, "multiprocessor_count": sms})
    table = data.setdefault("moe_fused_gemm", {})
    table.update({"dim": "config", "key": KEY, "values": VALUES})
    shapes = {tuple(e[k] for k in KEY): e for e in table.get("shapes") or []}

    names = sorted(models) if args.models == ["all"] else args.models
    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    cases = [(m, T) for m in names for T in args.tokens]
    print(f"# tuning moe_fused_gemm with {plugin.path.name} on {device} ({sms} SMs)", flush=True)
    print(f"{'model':<22}{'T':>6}  " + "".join(f"{c:>10}" for c in ["auto", *CONFIGS]) + "  best")
    cur, failed = None, 0
    for i, (m, T) in enumerate(cases):
        s = models[m]
        print(f"[{i + 1}/{len(cases)}] {m} T={T} ...", file=sys.stderr, flush=True)
        if m != cur:
            torch.cuda.empty_cache()
            w13, w2 = layer_weights(s, dt, gen)
            cur = m
        sets = input_sets(s, T, args.sets, w13, w2, dt, gen)
        ref = reference(*sets[0])
        times = {}
        names = []
        for name in ["auto", *candidates(T * s.K / s.E, grouped)]:
            reg.set_tuning("moe_fused_gemm", lambda sizes, v=VALUES[name]: v)
            err = rel(moe_fused_gemm(*sets[0], registry=reg), ref)
            if err > 1e-2:
                print(f"  {name}: rel err {err:.2e} > 1e-2, not timed", flush=True)
                failed += 1
            else:
                names.append(name)
        # two rounds in opposite orders, best of both: clocks and caches favour no position
        for name in names + names[::-1]:
            reg.set_tuning("moe_fused_gemm", lambda sizes, v=VALUES[name]: v)
            t = graph_us([lambda a=a: moe_fused_gemm(*a, registry=reg) for a in sets])
            times[name] = min(t, times.get(name, t))
        reg.set_tuning("moe_fused_gemm", None)
        tuned = {k: v for k, v in times.items() if k != "auto"}
        if not tuned or "auto" not in times:
            continue
        best = min(tuned, key=tuned.get)
        if tuned[best] > times["auto"] * (1 - args.margin):
            best = "auto"              # no configuration is clearly better than the default
        print(f"{m:<22}{T:>6}  " + "".join(f"{times[c]:>10.1f}" if c in times else f"{'-':>10}"
                                           for c in ["auto", *CONFIGS]) + f"  {best}", flush=True)
        key = (s.H, s.I, s.E, s.K)
        entry = shapes.setdefault(key, {"H": s.H, "I": s.I, "G": s.E, "K": s.K, "model": m, "by_T": []})
        rows = {r[0]: r for r in entry["by_T"]}
        rows[T] = [T, best, round(times[best], 1), round(times["auto"], 1)]
        entry["by_T"] = [rows[t] for t in sorted(rows)]
    table["shapes"] = [shapes[k] for k in sorted(shapes)]
    commit = os.environ.get("EX_COMMIT", "?")
    header = (f"# Tuned tile configurations of moe_fused_gemm on {device} (written by "
              f"benchmarks/tune_moe.py, {datetime.date.today().isoformat()}, commit {commit}).\n"
              "# by_T rows: [T, configuration, its µs, µs of the kernel's own choice ('auto')]; a\n"
              f"# configuration is recorded where it beat auto by more than {args.margin:.0%}. A call\n"
              "# uses the row of the largest T not above its own. Format: ex_engine/tuning.py.\n")
    if notes:                      # what the merged file said of its earlier rows
        header += "# Earlier header of this file (its rows not re-tuned here keep its provenance):\n"
        header += "".join(n + "\n" for n in notes)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(header + yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100))
    print(f"# wrote {out}; {failed} configuration(s) failed their check", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    from ex_engine.cli import exit_quietly_on_broken_pipe
    exit_quietly_on_broken_pipe(main)

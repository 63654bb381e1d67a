#!/usr/bin/env python3
"""A/B timing of moe_fused_gemm builds or settings in one process (CUDA-graph replay, rotated inputs).

    python3 benchmarks/ab_moe.py --cases qwen3-30b-a3b:512 mixtral-8x7b:64 \
        --configs on=factors:EX_MOE_PERSIST=1 off=factors:EX_MOE_PERSIST=0 old=/tmp/old_factors

Each config is NAME=FOLDER[:VAR=VALUE,VAR=VALUE]: a folder of plugin libraries (loaded once,
each with its own handle) and environment variables set while that config runs (variables
that a plugin reads when it loads, such as EX_MOE_SM90_MIN_ROWS_PER_EXPERT, are set while its
folder loads, so give such a config its own folder). Every config's output on the first input
set is compared with the first config's (max abs difference, relative difference) and the
first config's with a float32 reference (unless --no-ref); a config more than 2e-2 off the
first is not timed. Timing: --rounds rounds, the config order reversed every other round (the
power-limited card drifts by up to 12% within a minute); a row reports, per config, the median
over rounds of graph_us (benchmarks/_timing.py). Progress on stderr; --json writes every round.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

try:
    import torch
except ImportError:  # --help works without it
    torch = None

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from ex_engine import FactorRegistry, moe_fused_gemm  # noqa: E402
from ex_engine.moe_layer import load_models  # noqa: E402
from _timing import graph_us  # noqa: E402
from bench_moe import reference, rel, routing  # noqa: E402

ENV_KEYS: set = set()  # every variable any config sets: unset before each config's own


def parse_cfg(c):
    name, rest = c.split("=", 1)
    folder, _, envs = rest.partition(":")
    env = {}
    for kv in filter(None, envs.split(",")):
        k, sep, v = kv.partition("=")
        if not sep or not k:
            raise SystemExit(f"ab_moe: config {c!r}: expected NAME=FOLDER[:VAR=VALUE,...]")
        env[k] = v
    ENV_KEYS.update(env)
    return name, folder, env


def set_env(env):
    for k in ENV_KEYS:
        os.environ.pop(k, None)
    os.environ.update(env)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", nargs="+", required=True, help="model:T pairs (models of moe_models.yaml)")
    ap.add_argument("--configs", nargs="+", required=True, help="NAME=FOLDER[:VAR=VALUE,...], two or more")
    ap.add_argument("--sets", type=int, default=3, help="independently routed input sets rotated per graph")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--json", default=None, help="write every row (with each round's times) here")
    ap.add_argument("--no-ref", action="store_true", help="skip the float32 reference check")
    ap.add_argument("--rounds", type=int, default=2, help="timing rounds, config order reversed every other round")
    args = ap.parse_args()
    if torch is None or not torch.cuda.is_available():
        print("ab_moe: needs PyTorch and a CUDA GPU", file=sys.stderr)
        return 2
    dt = getattr(torch, args.dtype)
    models = load_models()
    cfgs = [parse_cfg(c) for c in args.configs]
    for case in args.cases:
        m, _, t = case.partition(":")
        if m not in models or not t.isdigit():
            print(f"ab_moe: case {case!r}: expected model:T, model one of {', '.join(sorted(models))}",
                  file=sys.stderr)
            return 2
    regs = {}
    for _, folder, env in cfgs:
        if folder not in regs:
            set_env(env)  # ex_get_factor reads some variables at load time
            regs[folder] = FactorRegistry.load(folder)
            p = regs[folder].get("moe_fused_gemm")
            print(f"# {folder}: {p.path if p else None}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    layer_key, layer = None, None
    print(f"{'model':<22}{'T':>6} " + "".join(f"{n:>12}" for n, _, _ in cfgs), flush=True)
    for ci, case in enumerate(args.cases):
        print(f"[{ci + 1}/{len(args.cases)}] {case} ...", file=sys.stderr, flush=True)
        m, T = case.split(":")
        T = int(T)
        s = models[m]
        if layer_key != m:
            layer = None
            torch.cuda.empty_cache()
            w13 = (torch.randn(s.E, 2 * s.I, s.H, device="cuda", generator=gen) * 0.02).to(dt)
            w2 = (torch.randn(s.E, s.H, s.I, device="cuda", generator=gen) * 0.02).to(dt)
            layer, layer_key = (w13, w2), m
        w13, w2 = layer
        sets = []
        for _ in range(args.sets):
            x = torch.randn(T, s.H, device="cuda", generator=gen).to(dt)
            w, ids = routing(T, s.E, s.K, s.renormalize, False, gen)
            sets.append((x, w13, w2, w, ids))
        outs, checks = [], {}
        for name, folder, env in cfgs:
            set_env(env)
            reg = regs[folder]
            o = moe_fused_gemm(*sets[0], registry=reg)
            torch.cuda.synchronize()
            reg.check_device_errors() if hasattr(reg, "check_device_errors") else None
            outs.append(o.clone())
            checks[name] = {"path": reg.last_path.get("moe_fused_gemm")}
        if not args.no_ref:
            ref = reference(*sets[0])
            checks[cfgs[0][0]]["rel_ref"] = rel(outs[0], ref)
            del ref
        for (name, _, _), o in zip(cfgs, outs):
            d = (o.float() - outs[0].float()).abs().max().item()
            checks[name]["maxdiff_vs_first"] = d
            checks[name]["rel_vs_first"] = rel(o, outs[0].float())
        times = {n: [] for n, _, _ in cfgs}
        for rnd in range(args.rounds):
            order = cfgs if rnd % 2 == 0 else cfgs[::-1]
            for name, folder, env in order:
                if checks[name]["rel_vs_first"] > 2e-2:
                    continue
                set_env(env)
                reg = regs[folder]
                times[name].append(graph_us([lambda a=a, reg=reg: moe_fused_gemm(*a, registry=reg) for a in sets]))
        row = {"model": m, "T": T, "checks": checks,
               "us": {n: (sorted(v)[len(v) // 2] if v else None) for n, v in times.items()}, "raw": times}
        rows.append(row)
        print(f"{m:<22}{T:>6} " + "".join(
            f"{row['us'][n]:>12.1f}" if row["us"][n] else f"{'FAIL':>12}" for n, _, _ in cfgs), flush=True)
        print("   checks: " + "; ".join(
            f"{n}: d={c['maxdiff_vs_first']:.2e} r={c['rel_vs_first']:.1e}" + (f" ref={c['rel_ref']:.1e}" if "rel_ref" in c else "")
            + f" {c['path']}" for n, c in checks.items()), flush=True)
        del outs
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    set_env({})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


    return 0


if __name__ == "__main__":
    sys.exit(main())

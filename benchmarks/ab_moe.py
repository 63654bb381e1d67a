#!/usr/bin/env python3
r"""A/B timing of moe_fused_gemm builds or settings in one process (CUDA-graph replay, rotated inputs).

    cp -r factors /tmp/one_block        # a copy (not a link): its own handle, its own settings
    python3 benchmarks/ab_moe.py --cases qwen3-30b-a3b:4096 olmoe-1b-7b:4096 \
        --configs new=factors one=/tmp/one_block:EX_MOE_ROUTE_MULTIBLOCK_SLOTS=1000000000 \
                  nopdl=factors:EX_MOE_DECODE_CONFIG=nopdl old=/tmp/old_factors

Each config is NAME=FOLDER[:VAR=VALUE,VAR=VALUE]: a folder of plugin libraries (loaded once,
each with its own handle) and environment variables set while that config runs; the pseudo-variable
config=NAME forces one of benchmarks/tune_moe.py's tile configurations (dims[7], as the tuner does)
instead, e.g. `t64=factors:config=grouped64 t128=factors:config=grouped` (variables
that a plugin reads when it loads, such as EX_MOE_SM90_MIN_ROWS_PER_EXPERT, are set while its
folder loads, so give such a config its own folder). Every config's output on the first input
set is compared with the first config's (max abs difference, relative difference) and the
first config's with a float32 reference (skipped with --no-ref; a first config more than 1e-2
off that reference, or NaN, fails its row, which is then not timed); a config more than 2e-2 off
the first (or NaN) is not timed, unless --unchecked names it (a diagnostic build whose output is wrong by design,
e.g. one built with -DEX_MOE_DIAG that skips a stage: its time bounds what removing that stage
could save; such a row is marked "unchecked" in the output and the JSON). Timing: --rounds
rounds, the config order reversed every other round (the power-limited card drifts by up to 12%
within a minute); a row reports, per config, the median over rounds of graph_us
(benchmarks/_timing.py). Progress on stderr; --json writes every round, and each config's plugin
file and its SHA-256. A case MODEL:T:skewed draws bench_moe.py's skewed routing (a few hot experts
take most tokens) instead of the uniform one. Exit status: 0 every row checked; 1 a row failed its reference check; 2
bad arguments.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from statistics import median
from pathlib import Path

try:
    import torch
except ImportError:  # --help works without it
    torch = None

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from ex_engine import FactorError, FactorRegistry, moe_fused_gemm  # noqa: E402
from ex_engine._scripts import HelpFormatter, integer, plugin_folder_problem  # noqa: E402
from ex_engine.moe_layer import (load_models_or_exit, models_help, output_file_problem,  # noqa: E402
                                 parse_cases, report_problems)
from _timing import graph_us, run_meta, write_json  # noqa: E402
from bench_moe import input_sets, layer_weights, reference, rel  # noqa: E402

LOAD_TIME = ("at load", "when a registry loads")   # the table's 'read' of a folder's settings
ENV_KEYS: set = set()  # every variable any config sets: unset before each config's own


def readme_variables(readme=ROOT / "README.md"):
    """{name: when} for every EX_ variable of README.md's environment table ('per call', 'at
    load', 'when a registry loads'): the one list of what the plugins and the registry read, so
    a variable added to a plugin without its row cannot be compared here by mistake."""
    found = {}
    for line in readme.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]  # not \|
        if len(cells) >= 3 and cells[0].startswith("`EX_"):
            for name in re.findall(r"EX_[A-Z0-9_]+", cells[0]):
                found[name] = cells[1]
    return found


def variable_problems(cfgs, variables, readme_text=None):
    """Problems with the configs' variables: an EX_ name that README.md does not mention
    (misspelt: it would change nothing), and two configs on the same folder that differ in a
    variable of the table not read per call (the folder's plugins and registry load once, so
    the second config would run with the first's setting). Other variables (CUDA_LAUNCH_BLOCKING,
    ...) are the caller's business."""
    text = readme_text if readme_text is not None else (ROOT / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"EX_[A-Z0-9_]+", text))   # whole names: EX_MOE_SM90_RASTER is none
    problems = []
    for n, folder, env in cfgs:
        for k in sorted(env):
            if k.upper().startswith("EX_") and k not in variables and k not in named:
                problems.append(f"config {n}: {k} is no variable README.md names (misspelt? the "
                                f"environment table lists {', '.join(sorted(variables))})")
    for i, (n, folder, env) in enumerate(cfgs):
        for n2, folder2, env2 in cfgs[i + 1:]:
            diff = {k for k in set(env) | set(env2)
                    if variables.get(k) in LOAD_TIME and env.get(k) != env2.get(k)}
            same = Path(folder).resolve() == Path(folder2).resolve()  # ./factors is factors/
            if same and diff:
                problems.append(f"configs {n} and {n2} load the same folder {folder} but differ in "
                                f"{', '.join(sorted(diff))}, read when the folder loads: copy the folder "
                                f"(cp -r {folder} /tmp/{n2}) and give {n2} the copy")
    return problems


def parse_cfg(c, problems=None):
    """(name, folder, env) of a config NAME=FOLDER[:VAR=VALUE,...] (config=NAME: a tile
    configuration of tune_moe.py's). A malformed one is appended to ``problems`` (None is
    returned), so that main lists every bad config at once; without a list it is printed and
    SystemExit(2) raised."""
    name, sep, rest = c.partition("=")
    folder, _, envs = rest.partition(":")
    pairs = [kv.partition("=") for kv in filter(None, envs.split(","))]
    problem = ""
    if not sep or not name or not folder or any(not k or not s for k, s, _ in pairs):
        problem = f"config {c!r}: expected NAME=FOLDER[:VAR=VALUE,...]"
    env = {k: v for k, _, v in pairs}
    if not problem and "config" in env:
        from ex_engine._scripts import VALUES
        if env["config"] not in VALUES:
            problem = f"config {c!r}: config={env['config']}: expected one of {', '.join(VALUES)}"
    if problem:
        if problems is None:
            report_problems("ab_moe", [problem])
            raise SystemExit(2)
        problems.append(problem)
        return None
    ENV_KEYS.update(k for k in env if k != "config")
    return name, folder, env


def set_env(env, reg=None):
    """Set a config's environment variables (unsetting every other config's) and, given its
    registry, its forced tile configuration (config=NAME; else the tuning data's)."""
    for k in ENV_KEYS:
        os.environ.pop(k, None)
    os.environ.update({k: v for k, v in env.items() if k != "config"})
    if reg is not None:
        if "config" in env:
            from ex_engine._scripts import force_config
            force_config(reg, env["config"])
        else:
            reg.set_tuning("moe_fused_gemm", None)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--cases", nargs="+", required=True, metavar="MODEL:T[:skewed]",
                    help=f"model:T pairs, T >= 1, models of moe_models.yaml: {models_help()}; "
                         "a trailing :skewed draws skewed routing (a few hot experts)")
    ap.add_argument("--configs", nargs="+", required=True, metavar="NAME=FOLDER[:VAR=VALUE,...]",
                    help="two or more, distinct names: a folder of plugin libraries and the environment "
                         "variables (README.md's table) set while the config runs; config=NAME forces "
                         "a tile configuration of tune_moe.py (e.g. t64=factors:config=grouped64)")
    ap.add_argument("--sets", type=integer, default=3, help="independently routed input sets rotated per graph")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                    help="activation and weight dtype")
    ap.add_argument("--json", default=None, metavar="FILE",
                    help="write the run's date, device, commit and configs, and every row (with each round's "
                         "times) here, after every row; not written by default")
    ap.add_argument("--no-ref", action="store_true", help="skip the float32 reference check")
    ap.add_argument("--rounds", type=integer, default=2, help="timing rounds, config order reversed every other round")
    ap.add_argument("--unchecked", nargs="+", default=[], metavar="NAME",
                    help="configs timed whatever their output (diagnostic knock-out builds, "
                         "-DEX_MOE_DIAG: wrong by design); their checks are still reported")
    args = ap.parse_args()
    models = load_models_or_exit("ab_moe")
    problems = []                       # every one at once, before any work
    cfgs = [cfg for cfg in (parse_cfg(c, problems) for c in args.configs) if cfg]
    names = [n for n, _, _ in cfgs]
    if len(args.configs) < 2 or len(set(names)) != len(names):
        problems.append(f"--configs: expected two or more configs with distinct names, got {names}")
    for n in args.unchecked:
        if n not in names:
            problems.append(f"--unchecked: {n!r} is no config name; expected some of {names}")
    if cfgs and cfgs[0][0] in args.unchecked:
        problems.append(f"--unchecked: the first config ({cfgs[0][0]}) is the one the others are checked "
                        "against; put a checked config first")
    problems += variable_problems(cfgs, readme_variables())
    problems += [plugin_folder_problem(f"config {n}", folder) for n, folder, env in cfgs]
    cases, case_problems = parse_cases(models, args.cases, skewed_ok=True)
    problems += case_problems
    problems.append(output_file_problem("--json", args.json, (".json",)))
    if args.rounds < 1 or args.sets < 1:
        problems.append(f"--rounds and --sets: expected >= 1, got {args.rounds} and {args.sets}")
    if report_problems("ab_moe", problems):
        return 2
    if torch is None or not torch.cuda.is_available():
        print("ab_moe: needs PyTorch and a CUDA GPU", file=sys.stderr)
        return 2
    dt = getattr(torch, args.dtype)
    regs, libs = {}, {}
    for n, folder, env in cfgs:
        if folder not in regs:
            set_env(env)  # ex_get_factor reads some variables at load time
            try:
                regs[folder] = FactorRegistry.load(folder)
            except FactorError as exc:
                print(f"ab_moe: config {n}: {exc}", file=sys.stderr)
                return 2
            p = regs[folder].get("moe_fused_gemm")
            if p is None:
                print(f"ab_moe: config {n}: no ready moe_fused_gemm plugin in {folder}", file=sys.stderr)
                return 2
            print(f"# {folder}: {p.path}", flush=True)
            libs[folder] = {"plugin": str(p.path), "plugin_sha256": p.sha256}   # (the bytes the registry checked)
    gen = torch.Generator(device="cuda").manual_seed(0)
    meta = run_meta(dtype=args.dtype, sets=args.sets, rounds=args.rounds,
                    configs={n: {"folder": folder, "env": env, "unchecked": n in args.unchecked, **libs[folder]}
                             for n, folder, env in cfgs})
    rows = []
    layer_key, layer = None, None
    print(f"{'model':<22}{'T':>6} " + "".join(f"{n:>12}" for n, _, _ in cfgs), flush=True)
    for ci, (case, (m, T, skew)) in enumerate(zip(args.cases, cases)):
        print(f"[{ci + 1}/{len(cases)}] {case} ...", file=sys.stderr, flush=True)
        head = f"{m:<22}{T:>6}{'s' if skew else ' '}"   # a row's first columns
        s = models[m]
        if layer_key != m:
            layer = None
            torch.cuda.empty_cache()
            layer, layer_key = layer_weights(s, dt, gen), m
        w13, w2 = layer
        sets = input_sets(s, T, args.sets, w13, w2, dt, gen, skew=skew)
        outs, checks = [], {}
        for name, folder, env in cfgs:
            reg = regs[folder]
            set_env(env, reg)
            o = moe_fused_gemm(*sets[0], registry=reg)
            torch.cuda.synchronize()
            reg.check_device_errors() if hasattr(reg, "check_device_errors") else None
            outs.append(o.clone())
            checks[name] = {"path": reg.last_path.get("moe_fused_gemm")}
        if not args.no_ref:
            ref = reference(*sets[0])
            checks[cfgs[0][0]]["rel_ref"] = rel(outs[0], ref)
            del ref
            if not checks[cfgs[0][0]]["rel_ref"] <= 1e-2:   # the baseline itself wrong (NaN included)
                print(f"{head}FAILED CHECK: {cfgs[0][0]} rel err {checks[cfgs[0][0]]['rel_ref']:.2e} "
                      "against the float32 reference (> 1e-2): the row is not timed", flush=True)
                rows.append({"model": m, "T": T, "skewed": skew, "checks": checks, "error": "first config failed its reference check"})
                del outs
                if args.json:
                    write_json(args.json, {"meta": meta, "rows": rows})
                continue
        for (name, _, _), o in zip(cfgs, outs):
            d = (o.float() - outs[0].float()).abs().max().item()
            checks[name]["maxdiff_vs_first"] = d
            checks[name]["rel_vs_first"] = rel(o, outs[0].float())
            if name in args.unchecked:
                checks[name]["unchecked"] = True
        times = {n: [] for n, _, _ in cfgs}
        for rnd in range(args.rounds):
            order = cfgs if rnd % 2 == 0 else cfgs[::-1]
            for name, folder, env in order:
                if not checks[name]["rel_vs_first"] <= 2e-2 and name not in args.unchecked:   # NaN too
                    continue
                reg = regs[folder]
                set_env(env, reg)
                times[name].append(graph_us([lambda a=a, reg=reg: moe_fused_gemm(*a, registry=reg) for a in sets]))
        row = {"model": m, "T": T, "skewed": skew, "checks": checks,
               "us": {n: (median(v) if v else None) for n, v in times.items()}, "raw": times}
        rows.append(row)
        print(head + "".join(
            f"{row['us'][n]:>12.1f}" if row["us"][n] else f"{'FAIL':>12}" for n, _, _ in cfgs), flush=True)
        print("   checks: " + "; ".join(
            f"{n}: d={c['maxdiff_vs_first']:.2e} r={c['rel_vs_first']:.1e}" + (f" ref={c['rel_ref']:.1e}" if "rel_ref" in c else "")
            + f" {c['path']}" + (" unchecked" if c.get("unchecked") else "") for n, c in checks.items()),
            flush=True)
        del outs
        if args.json:   # after every row: a run cut short still leaves what it measured
            write_json(args.json, {"meta": meta, "rows": rows})
    set_env({})
    if args.json:
        write_json(args.json, {"meta": meta, "rows": rows})
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    from ex_engine.cli import exit_quietly_on_broken_pipe
    exit_quietly_on_broken_pipe(main)

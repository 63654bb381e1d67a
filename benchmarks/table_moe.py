#!/usr/bin/env python3
"""Markdown table of bench_moe.py's JSON, with vLLM's times (../shared/PERF.md) beside ours.

    python3 benchmarks/table_moe.py bench_moe.json > table.md

One row per bench_moe row: floor, our time and its ratio to the floor, TFLOP/s and GB/s, the
torch._grouped_mm pipeline ('gmm'), vLLM's time (column 'vLLM (PERF.md)': from ../shared/PERF.md,
the project's shared reference beside the checkout, not in it; its vLLM times are carried in
benchmarks/perf_peers.py; uniform routing only; measured in another process; shown only beside
an H200 run in bfloat16, as they were measured) and the Python
fallback. Where the JSON has the ratio against the ceilings measured during the run (bench_moe's
'x_floor_here', newer files), an 'x here' column follows 'ours/floor'. '-' is a time not
measured (a gmm peer that could not be captured, a T beyond --fallback-max-t, no vLLM time); a
row whose check failed says so in its 'ours' cell.

Needs only the standard library (no numpy, no torch). Exit status: 0 a table; 141 the reader left
early (`| head`); 2 a file that is not bench_moe.py's JSON, or one without rows.
"""
import argparse
import json
import math
import re
import runpy
from pathlib import Path

from perf_peers import VLLM_US

# standard library only, loaded by path: importing the package would pull numpy for one helper
_scripts = runpy.run_path(str(Path(__file__).resolve().parents[1] / "ex_engine" / "_scripts.py"))

NUMBERS = ("floor_us", "ours_us", "x_floor", "tflops", "gbs")   # what a timed row must have
ROUTINGS = ("uniform", "skewed", "balanced")   # bench_moe's 'routing' values


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _time(v) -> bool:
    """Whether ``v`` can be a time (µs) or a rate: a finite number > 0 (not NaN, inf, 0, a bool)."""
    return _number(v) and math.isfinite(v) and v > 0


def vllm_comparable(m: dict) -> bool:
    """Whether ../shared/PERF.md's vLLM times (an H200, bfloat16) may sit beside a run whose meta is ``m``:
    its device is an H200 and its dtype bfloat16 (a file without a dtype is an early bfloat16
    one). An H100 or float16 run against them would compare two cards or two dtypes."""
    device = str(m.get("device"))   # the H200 itself: not a GH200, not an H200 NVL (another power limit)
    return (re.search(r"(?<![A-Za-z0-9])H200(?![A-Za-z0-9])", device) is not None and "NVL" not in device
            and m.get("dtype", "bfloat16") == "bfloat16")


def vllm_note(m: dict) -> str:
    """The line that says why the vLLM times are left out ('' where they are not)."""
    if vllm_comparable(m):
        return ""
    return (f"vLLM's times left out: ../shared/PERF.md measured them on an H200 in bfloat16, this run is "
            f"{m.get('device') or 'on an unrecorded device'}, {m.get('dtype') or 'dtype not recorded'}")


def shape_problem(d) -> str:
    """'' if ``d`` has bench_moe.py's top level (a mapping with 'meta', a mapping, and 'rows', a
    list), else what is wrong (plot_moe.py's check too)."""
    if not isinstance(d, dict) or not isinstance(d.get("meta"), dict) or not isinstance(d.get("rows"), list):
        return "expected a mapping with 'meta' (a mapping) and 'rows' (a list)"
    return ""


def file_problem(d: dict) -> str:
    """Why ``d`` (a mapping with meta and rows) is not bench_moe.py's JSON ('' if it may be):
    bench_moe writes 'floor_us' in every row and 'ours_us' (timed) or 'error' (failed) beside it;
    ab_moe.py's rows have 'us' and its meta 'configs', host_moe.py's rows 'us' and 'plugin'."""
    rows = [r for r in d["rows"] if isinstance(r, dict)]
    keys = sorted({k for r in rows for k in r})
    if {"floor_us", "ours_us", "error"} & set(keys) or not set(keys) - {"model", "T"}:
        return ""   # bench_moe's, or too little to tell: row_problem names what is missing
    whose = ("ab_moe.py's JSON?" if "configs" in d["meta"] else
             "host_moe.py's JSON?" if "plugin" in keys else "another tool's JSON?")
    shown = ", ".join(keys[:8]) + (", ..." if len(keys) > 8 else "")
    return (f"expected bench_moe.py's JSON (rows with 'floor_us', and 'ours_us' or 'error'), "
            f"got rows with {shown} and no 'floor_us' ({whose})")


def row_problem(i: int, r) -> str:
    """What keeps row ``i`` out of the table and the chart ('' if nothing; plot_moe.py's check
    too): not a mapping, no model, a T that is not an integer > 0 (``true`` is no T), no
    floor_us, a timed row (one with ours_us) without one of NUMBERS, an untimed row without the
    'error' bench_moe writes for it; a time, ratio or rate (NUMBERS, gmm_us, fallback_us,
    x_floor_here) that is not a finite number > 0 (the optional ones may be null); a 'routing'
    other than ROUTINGS or a 'skewed' that is not a bool."""
    if not isinstance(r, dict):
        return f"row {i}: expected a mapping, got {type(r).__name__}"
    T = r.get("T")
    if not isinstance(r.get("model"), str) or not _number(T) or not isinstance(T, int) or T < 1:
        return (f"row {i}: expected 'model' (a name) and 'T' (an integer > 0), "
                f"got {r.get('model')!r} and {T!r}")
    where = f"row {i} ({r['model']} T={T})"
    need = NUMBERS if "ours_us" in r else ("floor_us",)
    for k in need:
        if not _number(r.get(k)):
            return f"{where}: '{k}': expected a number, got {r.get(k, 'nothing')!r}"
        if not _time(r[k]):   # the ratios divide by the times; a rate <= 0 or NaN is no rate
            return f"{where}: '{k}': expected a finite number > 0, got {r[k]!r}"
    if r.get("routing") is not None and r["routing"] not in ROUTINGS:
        return f"{where}: 'routing': expected one of {', '.join(ROUTINGS)}, got {r['routing']!r}"
    if r.get("skewed") is not None and not isinstance(r["skewed"], bool):
        return f"{where}: 'skewed': expected true or false, got {r['skewed']!r}"
    if "ours_us" not in r and not isinstance(r.get("error"), str):
        return (f"{where}: expected 'ours_us' (a timed row) or 'error' (a failed one), "
                f"got neither")
    for k in ("gmm_us", "fallback_us", "x_floor_here"):
        if r.get(k) is not None and not _time(r[k]):
            return f"{where}: '{k}': expected a finite number > 0 or null, got {r[k]!r}"
    return ""


def meta_problem(m: dict) -> str:
    """What keeps the meta out of the header ('' if nothing): a 'warm_ms' or 'sets' that is
    neither a number nor null (the header formats them as numbers)."""
    for k in ("warm_ms", "sets"):
        if m.get(k) is not None and not _number(m[k]):
            return f"meta: '{k}': expected a number or null, got {m[k]!r}"
    return ""


def header(m: dict, here: bool) -> str:
    """The line above the table: what the meta records, and only that."""
    known = lambda k: m.get(k) if m.get(k) not in (None, "") else "?"
    sets = m.get("sets")
    over = (f"over {sets} independently routed input sets" if sets else
            "over independently routed input sets (how many: not recorded)")
    text = (f"{known('device')}, {known('date')}, commit {known('commit')}, {known('dtype')}, "
            f"torch {known('torch')}; µs per call, CUDA-graph replay {over}")
    if m.get("warm_ms") is not None:
        text += f", each graph replayed {m['warm_ms']:g} ms before timing"
    c = m.get("ceilings_here")
    if here and isinstance(c, dict) and _number(c.get("matmul_tflops")) and _number(c.get("copy_gbs")):
        text += (f"; 'x here': ours over the floor at the ceilings measured in this run "
                 f"({c['matmul_tflops']:.0f} TFLOP/s, {c['copy_gbs']:.0f} GB/s)")
    elif here:
        text += "; 'x here': ours over the floor at the ceilings measured in this run"
    return text


def route_of(r: dict) -> str:
    """Row ``r``'s routing: 'uniform', 'skewed' or 'balanced' (files written before
    bench_moe.py --balanced have 'skewed' only)."""
    return r.get("routing") or ("skewed" if r.get("skewed") else "uniform")


def cells(r: dict, here: bool, vllm: bool = True) -> list:
    """The row's cells, as many as the header has (vLLM's '-' where ``vllm`` is False)."""
    route = route_of(r)
    floor = f"{r['floor_us']:.1f}" if r.get("floor_us") is not None else "-"
    width = 14 if here else 13
    if "ours_us" not in r:
        why = str(r.get("error") or "not timed").replace("|", "\\|")
        return [r["model"], str(r["T"]), route, floor, f"FAILED: {why}"] + ["-"] * (width - 5)
    ours = r["ours_us"]
    v = VLLM_US.get((r["model"], r["T"])) if route == "uniform" and vllm else None
    g = r.get("gmm_us")
    out = [r["model"], str(r["T"]), route, floor, f"{ours:.1f}", f"{r['x_floor']:.2f}"]
    if here:
        out.append(f"{r['x_floor_here']:.2f}" if r.get("x_floor_here") is not None else "-")
    out += [f"{r['tflops']:.0f}", f"{r['gbs']:.0f}",
            f"{g:.1f}" if g else "-", f"{g / ours:.2f}" if g else "-",
            f"{v:,.1f}" if v else "-", f"{v / ours:.2f}" if v else "-",
            f"{r['fallback_us']:,.0f}" if r.get("fallback_us") else "-"]
    return out


def main(path) -> int:
    problem = ""
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        if shape_problem(d):
            raise ValueError(shape_problem(d))
    except (OSError, ValueError) as exc:
        problem = (f"{path}: expected the JSON that bench_moe.py --json writes (meta and rows): "
                   f"{type(exc).__name__}: {exc}")
    else:
        problems = [p for p in [file_problem(d), meta_problem(d["meta"])] if p] or \
            [p for p in (row_problem(i, r) for i, r in enumerate(d["rows"])) if p]
        if problems:
            problem = f"{path}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
        elif not d["rows"]:
            problem = f"{path}: no rows to tabulate"
    if problem:
        _scripts["report_problems"]("table_moe", [problem])
        return 2
    rows, m = d["rows"], d["meta"]
    here = any("x_floor_here" in r for r in rows)
    names = ["model", "T", "routing", "floor", "ours", "ours/floor"] + (["x here"] if here else []) + \
        ["TFLOP/s", "GB/s", "gmm", "gmm/ours", "vLLM (PERF.md)", "vLLM/ours", "fallback"]
    print(header(m, here) + "\n")
    print("| " + " | ".join(names) + " |")
    print("| " + " | ".join("---" if n in ("model", "routing") else "---:" for n in names) + " |")
    vllm, note = vllm_comparable(m), vllm_note(m)
    for r in rows:
        print("| " + " | ".join(cells(r, here, vllm)) + " |")
    skipped = {}
    for r in rows:
        if "ours_us" in r and not r.get("gmm_us") and r.get("gmm_skipped"):
            skipped[r["gmm_skipped"]] = skipped.get(r["gmm_skipped"], 0) + 1
    for why, n in skipped.items():
        print(f"\ngmm '-' ({n} row{'s' if n > 1 else ''}): {why}")
    if note:
        print(f"\n{note}")
    return 0


if __name__ == "__main__":
    # its table and --help hold 'µs', '×': escaped under an ASCII locale (the helper's
    # tolerant_stdio); --help's text is written inside the helper, so that a stdout that cannot be
    # written is one line, status 2, for it too
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", help="the --json output of benchmarks/bench_moe.py")
    _scripts["exit_quietly_on_broken_pipe"](lambda: main(ap.parse_args().json))

#!/usr/bin/env python3
"""Chart of bench_moe.py's JSON: time over floor against T, one line per implementation (ours,
the torch._grouped_mm pipeline, vLLM's fused_moe, the Python fallback), one panel per model
(uniform routing; vLLM's times are ../shared/PERF.md's (carried in perf_peers.py), measured in another process on the same inputs).

    python3 benchmarks/plot_moe.py bench_moe.json -o benchmarks/moe_vs_floor.png

Needs matplotlib (--help does not). Exit status: 0 written; 2 a problem with the JSON or the
output file, or no matplotlib (every problem is listed before any drawing).
"""
import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from perf_peers import VLLM_US  # noqa: E402
# one check of bench_moe's JSON; and table_moe's _scripts (standard library only, loaded by
# path: --help works without numpy, the package's __init__), not a second load of it
from table_moe import _number, _scripts, file_problem, route_of, shape_problem  # noqa: E402
output_file_problem, report_problems = _scripts["output_file_problem"], _scripts["report_problems"]

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: E402
except ImportError:  # --help works without it; a run says it needs it
    plt = None


META = ("dtype", "device", "date", "commit")   # what the chart's title reads


def uniform(r: dict) -> bool:
    """Whether row ``r`` was timed on uniform routing (the chart's): not --skew's or --balanced's."""
    return route_of(r) == "uniform"


def data_problem(data) -> str:
    """What keeps bench_moe.py's JSON ``data`` out of the chart ('' if nothing), in table_moe.py's
    words (its shape_problem; its row_problem asks for columns the chart does not draw): not a
    mapping with 'meta' (a mapping) and 'rows' (a list) (a bare KeyError: 'rows' before), rows
    of another tool (ab_moe.py's, host_moe.py's: table_moe.py's file_problem), a meta
    without the dtype, device, date and commit of the title, a row that is not a mapping, and in
    each row drawn (timed, uniform routing) no 'model' and 'T', a time that is not a number, or
    a floor_us not > 0."""
    problem = shape_problem(data) or file_problem(data)   # (another tool's JSON named as table_moe names it)
    if problem:
        return problem
    missing = [k for k in META if k not in data["meta"]]
    if missing:
        return f"meta: expected the keys {list(META)}, missing {missing}"
    for i, r in enumerate(data["rows"]):
        if not isinstance(r, dict):
            return f"row {i}: expected a mapping, got {type(r).__name__}"
        if not uniform(r) or "ours_us" not in r:   # not drawn
            continue
        if not isinstance(r.get("model"), str) or not isinstance(r.get("T"), int):
            return f"row {i}: expected 'model' (a name) and 'T' (an integer), got {r.get('model')!r} and {r.get('T')!r}"
        where = f"row {i} ({r['model']} T={r['T']})"
        for k in ("ours_us", "floor_us", "gmm_us", "fallback_us"):
            if (r.get(k) is not None or k in ("ours_us", "floor_us")) and not _number(r.get(k)):
                return f"{where}: '{k}': expected a number, got {r.get(k, 'nothing')!r}"
        if not r["floor_us"] > 0:
            return f"{where}: floor_us must be > 0, got {r['floor_us']!r}"
    return ""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", help="the --json output of benchmarks/bench_moe.py")
    ap.add_argument("-o", "--output", default=str(HERE / "moe_vs_floor.png"),
                    help=".png, .pdf or .svg file to write, overwritten if it exists (default: "
                         "moe_vs_floor.png in this script's folder, benchmarks/, wherever it is run from)")
    a = ap.parse_args()
    problems = [output_file_problem("--output", a.output)]
    if not problems[0] and Path(a.output).suffix.lower() not in (".png", ".pdf", ".svg"):
        # matplotlib appends .png to a name without a suffix and refuses others after all the work
        problems.append(f"--output: expected a .png, .pdf or .svg file name, got {a.output}")
    rows, data = [], None
    try:
        with open(a.json, encoding="utf-8") as f:
            data = json.load(f)
        problem = data_problem(data)
    except (OSError, ValueError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        problems.append(f"{a.json}: expected the JSON that bench_moe.py --json writes (meta and rows): {problem}")
    else:
        rows = [r for r in data["rows"] if uniform(r) and "ours_us" in r]
        if not rows:
            problems.append(f"{a.json}: no timed uniform-routing rows to plot")
    if plt is None:   # reported with the other problems, not after installing it
        problems.append("needs matplotlib (pip install matplotlib)")
    if report_problems("plot_moe", problems):
        return 2
    by_model = defaultdict(list)
    for r in rows:
        by_model[r["model"]].append(r)
    n = len(by_model)
    cols = min(4, n)
    fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(4.2 * cols, 3.4 * ((n + cols - 1) // cols)),
                             squeeze=False, sharey=True)
    for ax, (model, rs) in zip(axes.flat, sorted(by_model.items())):
        rs.sort(key=lambda r: r["T"])
        T = [r["T"] for r in rs]
        ax.plot(T, [r["ours_us"] / r["floor_us"] for r in rs], "o-", color="C0", label="ex_engine")
        g = [(r["T"], r["gmm_us"] / r["floor_us"]) for r in rs if r.get("gmm_us")]
        if g:
            ax.plot(*zip(*g), "s--", color="C1", label="torch._grouped_mm pipeline")
        v = [(r["T"], VLLM_US[(model, r["T"])] / r["floor_us"]) for r in rs if (model, r["T"]) in VLLM_US]
        if v:
            ax.plot(*zip(*v), "^:", color="C2", label="vLLM fused_moe (PERF.md)")
        f = [(r["T"], r["fallback_us"] / r["floor_us"]) for r in rs if r.get("fallback_us")]
        if f:
            ax.plot(*zip(*f), "x:", color="C3", label="Python fallback")
        # issue 3's targets by T (../shared/PERF.md): 1.10 up to T = 64, 1.15 at T = 512, 1.35 from 4096
        ax.plot(T, [1.10 if t <= 64 else 1.15 if t <= 512 else 1.35 for t in T], "-", color="0.6", lw=1.0,
                drawstyle="steps-mid", label="target (PERF.md)")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
            lambda y, _: f"{y:g}" if y in (1.5, 2, 3, 5) else ""))
        ax.set_title(model, fontsize=10)
        ax.set_xlabel("tokens T")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes.flat[n:]:
        ax.axis("off")
    # the floor counts bytes at the copy ceiling (4.23 TB/s, read + written): pure reads reach ~4.3,
    # so a weight-bound row can read a little under 1
    axes[0][0].set_ylabel("time / PERF.md's floor (1 = the floor)")
    for ax in axes.flat[:n]:  # the first panel with every line carries the legend
        if len(ax.get_lines()) > len(axes[0][0].get_lines()):
            ax.legend(fontsize=7)
            break
    else:
        axes[0][0].legend(fontsize=7)
    m = data["meta"]
    fig.suptitle(f"MoE layer time over the H200 floor, {m['dtype']}, CUDA-graph replay "
                 f"({m['device']}, {m['date']}, commit {m['commit']})", fontsize=11)
    fig.tight_layout()
    try:
        fig.savefig(a.output, dpi=110)
    except OSError as exc:   # checked before drawing, but a disk can fill or a folder go meanwhile
        report_problems("plot_moe", [f"--output: cannot write {a.output}: {exc.strerror or exc}"])
        return 2
    print("wrote", a.output)


if __name__ == "__main__":
    _scripts["tolerant_stdio"]()   # an ASCII locale: text it cannot print is escaped, not an error
    sys.exit(main())

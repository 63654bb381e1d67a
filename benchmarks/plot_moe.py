#!/usr/bin/env python3
"""Chart of bench_moe.py's JSON: time over floor against T, one line per implementation (ours,
the torch._grouped_mm pipeline, vLLM's fused_moe), one panel per model (uniform routing; vLLM's
times are ../shared/PERF.md's (carried in perf_peers.py), measured in another process on the same
inputs, on an H200 in bfloat16: drawn only over a run of that card and dtype). The Python
fallback, 10-1000 times the floor, would squash the others into the bottom of a shared log
axis: each panel names its range in a line of text, and --fallback draws it as a line.

    python3 benchmarks/plot_moe.py bench_moe.json                    # bench_moe.png, here
    python3 benchmarks/plot_moe.py small.json large.json -o chart.png  # one run in two files

Rows whose check failed are not drawn: the panel says so in red, and so does stderr.
Needs matplotlib (pip install matplotlib, or the package's [plot] extra; --help does not).
Exit status: 0 written; 2 a problem with the JSON or the output file, or no matplotlib (every
problem is listed before any drawing).
"""
import argparse
import json
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from perf_peers import VLLM_US  # noqa: E402
# one check of bench_moe's JSON; and table_moe's _scripts (standard library only, loaded by
# path: --help works without numpy, the package's __init__), not a second load of it
from table_moe import (_scripts, file_problem, route_of, row_problem, shape_problem,  # noqa: E402
                       vllm_comparable, vllm_note)
output_file_problem, report_problems = _scripts["output_file_problem"], _scripts["report_problems"]

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: E402
    if "text.parse_math" in matplotlib.rcParams:   # a '$' in a model name or commit is text, not TeX
        matplotlib.rcParams["text.parse_math"] = False
except ImportError:  # --help works without it; a run says it needs it
    plt = None


META = ("dtype", "device", "date", "commit")   # what the chart's title reads


def uniform(r: dict) -> bool:
    """Whether row ``r`` was timed on uniform routing (the chart's): not --skew's or --balanced's."""
    return route_of(r) == "uniform"


def data_problem(data) -> str:
    """What keeps bench_moe.py's JSON ``data`` out of the chart ('' if nothing), in table_moe.py's
    words and by its checks (shape_problem, file_problem, row_problem: one check for both
    tools): not a mapping with 'meta' (a mapping) and 'rows' (a list), rows of another tool
    (ab_moe.py's, host_moe.py's), a meta without the dtype, device, date and commit of the
    title, a row that is not a mapping, or a row without 'model' and a T > 0, or with a time
    that is not a finite number > 0."""
    problem = shape_problem(data) or file_problem(data)   # (another tool's JSON named as table_moe names it)
    if problem:
        return problem
    missing = [k for k in META if k not in data["meta"]]
    if missing:
        return f"meta: expected the keys {list(META)}, missing {missing}"
    for i, r in enumerate(data["rows"]):
        problem = row_problem(i, r)
        if problem:
            return problem
    return ""


def failed(r: dict) -> bool:
    """Whether row ``r`` is a uniform-routing row bench_moe did not time (its check failed)."""
    return uniform(r) and "ours_us" not in r


def failed_text(bad: list, most: int = 0) -> str:
    """The failed rows ``bad`` as 'model T=..: error; ...' (the first ``most`` of them and '...'
    where ``most`` is set and there are more)."""
    shown = bad[:most] if most else bad
    return "; ".join(f"{r['model']} T={r['T']}: {r.get('error', 'not timed')}" for r in shown) + \
        ("; ..." if len(shown) < len(bad) else "")


def target(t: int) -> float:
    """Issue 3's target at T = ``t`` (../shared/PERF.md): 1.10 up to T = 64, 1.15 at T = 512,
    1.35 from 4096."""
    return 1.10 if t <= 64 else 1.15 if t <= 512 else 1.35


def fallback_text(rs: list) -> str:
    """The line a panel carries for the Python fallback's times over the floor ('' if none)."""
    f = [r["fallback_us"] / r["floor_us"] for r in rs if r.get("fallback_us")]
    if not f:
        return ""
    lo, hi = (f"{v:,.0f}" if v >= 10 else f"{v:.2g}" for v in (min(f), max(f)))
    span = f"{lo}x" if lo == hi else f"{lo}-{hi}x"
    return f"Python fallback: {span} the floor (--fallback draws it)"


def merged_meta(files) -> tuple:
    """(problem, meta) of the (path, data) of several bench_moe.py files drawn as one chart:
    they must share device and dtype (one card, one dtype per chart); dates and commits that
    differ are joined with ' / ' for the title."""
    metas = [d["meta"] for _, d in files]
    for k in ("device", "dtype"):
        values = sorted({str(mm[k]) for mm in metas})
        if len(values) > 1:
            return (f"{', '.join(p for p, _ in files)}: expected one {k} in a chart, got {' and '.join(values)}",
                    {})
    merged = dict(metas[0])
    for k in ("date", "commit"):
        merged[k] = " / ".join(dict.fromkeys(str(mm[k]) for mm in metas))
    return "", merged


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+",
                    help="the --json output of benchmarks/bench_moe.py; several files (one run split "
                         "in parts, e.g. T <= 512 and T >= 4096) make one chart, where they share "
                         "device and dtype and no (model, T) is in two")
    ap.add_argument("-o", "--output",
                    help=".png, .pdf or .svg file to write, overwritten if it exists (default: the "
                         "first JSON's name with .png, in the current folder: never a chart the "
                         "repository ships, unless named)")
    ap.add_argument("--fallback", action="store_true",
                    help="draw the Python fallback as a line (its times stretch the shared log "
                         "axis to 1000x the floor); without it, each panel names its range in text")
    a = ap.parse_args()
    problems, flag = [], "--output"
    if a.output is None:   # the first JSON's name with .png, in the current folder
        flag = "--output (not given: the JSON's name with .png, in the current folder)"
        name = Path(a.json[0]).name
        if not Path(name).stem:   # '.', '/', '': no name to take
            problems.append(f"--output: {a.json[0]!r} gives no file name for the chart; name one with -o")
            a.output = "plot_moe_output.png"
        else:
            a.output = str(Path(name).with_suffix(".png"))
    problems.append(output_file_problem(flag, a.output))
    if any(Path(a.output).resolve() == Path(j).resolve() for j in a.json):   # a JSON named *.png
        problems = [f"--output: {a.output} is one of the JSON files read; name another file with -o"]
    problems = [p for p in problems if p]
    if not problems and Path(a.output).suffix.lower() not in (".png", ".pdf", ".svg"):
        # matplotlib appends .png to a name without a suffix and refuses others after all the work
        problems.append(f"--output: expected a .png, .pdf or .svg file name, got {a.output}")
    files = []
    for path in a.json:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            problem = data_problem(data)
        except (OSError, ValueError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if problem:
            problems.append(f"{path}: expected the JSON that bench_moe.py --json writes (meta and rows): {problem}")
        else:
            files.append((path, data))
    rows, m = [], {}
    named = [str(Path(j).resolve()) for j in a.json]
    if len(set(named)) < len(named):
        problems.append(f"{', '.join(a.json)}: expected each file once, got one named twice")
    elif len(files) == len(a.json):
        problem, m = merged_meta(files)
        if problem:
            problems.append(problem)
        seen, twice = {}, []
        for path, data in files:
            for r in data["rows"]:
                if not uniform(r):
                    continue
                key = (r["model"], r["T"])
                if seen.get(key, path) != path:   # repeats within one file (--tokens 64 64) are drawn
                    twice.append(f"{r['model']} T={r['T']} in {seen[key]} and {path}")
                seen.setdefault(key, path)
                rows.append(r)
        if twice:   # one line, however many
            problems.append(f"expected each (model, T) in one file only, got {len(twice)} in two, "
                            f"the first: {twice[0]}")
        if not any("ours_us" in r for r in rows):
            bad = [r for r in rows if failed(r)]
            why = f" ({len(bad)} failed their check: {failed_text(bad, 3)})" if bad else ""
            problems.append(f"{', '.join(a.json)}: no timed uniform-routing rows to plot{why}")
    if plt is None:   # reported with the other problems, not after installing it
        problems.append("needs matplotlib (pip install matplotlib, or the package's [plot] extra)")
    if report_problems("plot_moe", problems):
        return 2
    by_model = defaultdict(list)
    for r in rows:
        by_model[r["model"]].append(r)
    bad = [r for r in rows if failed(r)]
    if bad:   # not drawn: said here and in the panel, never left out in silence
        print(f"plot_moe: {len(bad)} row(s) not drawn, their check failed: {failed_text(bad)}", file=sys.stderr)
    vllm, note = vllm_comparable(m), vllm_note(m)
    if note:
        print(f"plot_moe: {note}", file=sys.stderr)
    n = len(by_model)
    cols = min(4, n)
    width = max(4.2 * cols, 7.0)   # one panel: room for the title
    fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(width, 3.4 * ((n + cols - 1) // cols) + 0.4),
                             squeeze=False, sharey=True)
    for ax, (model, rs) in zip(axes.flat, sorted(by_model.items())):
        rs.sort(key=lambda r: r["T"])
        timed = [r for r in rs if "ours_us" in r]
        T = [r["T"] for r in timed]
        if timed:
            ax.plot(T, [r["ours_us"] / r["floor_us"] for r in timed], "o-", color="C0", label="ex_engine")
        g = [(r["T"], r["gmm_us"] / r["floor_us"]) for r in timed if r.get("gmm_us")]
        if g:
            ax.plot(*zip(*g), "s--", color="C1", label="torch._grouped_mm pipeline")
        v = [(r["T"], VLLM_US[(model, r["T"])] / r["floor_us"]) for r in timed if vllm and (model, r["T"]) in VLLM_US]
        if v:
            ax.plot(*zip(*v), "^:", color="C2", label="vLLM fused_moe (PERF.md)")
        f = [(r["T"], r["fallback_us"] / r["floor_us"]) for r in timed if r.get("fallback_us")]
        if f and a.fallback:
            ax.plot(*zip(*f), "x:", color="C3", label="Python fallback")
        notes = [(fallback_text(timed), "0.3")] if f and not a.fallback else []
        fails = [r["T"] for r in rs if "ours_us" not in r]
        if fails:
            notes.append((f"check failed, not drawn: T = {', '.join(map(str, fails))}", "red"))
        for k, (text, color) in enumerate(notes):
            ax.text(0.02, 0.97 - 0.08 * k, text, transform=ax.transAxes, fontsize=7, color=color, va="top")
        Tt = T or [r["T"] for r in rs]
        # a single T draws a step line of no length: a dash marks it
        ax.plot(Tt, [target(t) for t in Tt], "-", color="0.6", lw=1.0, drawstyle="steps-mid",
                marker="_" if len(Tt) == 1 else None, markersize=16, label="target (PERF.md)")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        # the log axis labels its ticks 2^n in TeX by default, which text.parse_math = False (set
        # above, for a '$' in a model name) drew as raw "$\\mathdefault{2^{12}}$": plain T instead
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:.0f}" if x >= 1 else f"{x:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
            lambda y, _: f"{y:g}" if y in (1.2, 1.5, 2, 3, 5) else ""))
        ax.set_title(model, fontsize=10)
        ax.set_xlabel("tokens T")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes.flat[n:]:
        ax.axis("off")
    # the floor counts bytes at the copy ceiling (4.23 TB/s, read + written): pure reads reach ~4.3,
    # so a weight-bound row can read a little under 1
    axes[0][0].set_ylabel("time / PERF.md's floor (1 = the floor)")
    # the legend of the panel with the most lines: in the first empty slot of the grid where
    # there is one (over no data), else in that panel
    full = max(axes.flat[:n], key=lambda ax: len(ax.get_legend_handles_labels()[0]))
    handles, labels = full.get_legend_handles_labels()
    if len(axes.flat) > n:
        axes.flat[n].legend(handles, labels, loc="center", fontsize=9, frameon=False)
    else:
        full.legend(handles, labels, fontsize=7)
    title = (f"MoE layer time over the H200 floor, {m['dtype']}, CUDA-graph replay "
             f"({m['device']}, {m['date']}, commit {m['commit']})")
    if note:
        title += f". {note}"
    fig.suptitle("\n".join(textwrap.wrap(title, int(width * 11))), fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(a.output, dpi=110)
    except OSError as exc:   # checked before drawing, but a disk can fill or a folder go meanwhile
        report_problems("plot_moe", [f"--output: cannot write {a.output}: {exc.strerror or exc}"])
        return 2
    print("wrote", a.output)


if __name__ == "__main__":
    # an ASCII locale: text it cannot print is escaped, not an error; `> /dev/full`: one line
    _scripts["exit_quietly_on_broken_pipe"](main)

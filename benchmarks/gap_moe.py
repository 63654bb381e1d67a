#!/usr/bin/env python3
"""Where a moe_fused_gemm call's time goes, kernel by kernel, against the card's own rates.

    python3 scripts/kernel_times_moe.py --graph --ceilings --json kt.json --cases qwen3-30b-a3b:4096 ...
    python3 benchmarks/gap_moe.py kt.json [--matmul-tflops 690 --copy-gbs 4060 --write-gbs 3180]

Reads the JSON of `scripts/kernel_times_moe.py --json` (per case: µs per call of each kernel, the
routing's slots and the rows its 128-row tiles compute) and prints, per case:

- the call (with --graph: first kernel start to last kernel end of the profiled replays, per call,
  the replays the kernel times come from; else the graph's µs per call; without --graph the
  median wall time of an eager call, launch gaps included; else the kernels' sum, which counts
  twice the time kernels overlap under programmatic dependent launch) over the floor of
  ../shared/PERF.md (787 TFLOP/s, 4.23 TB/s; FLOPs 6*T*K*H*I, bytes of the hit experts' weights
  and of the activations, as benchmarks/bench_moe.py counts them);
- each GEMM's useful TFLOP/s (slots) and its rate on the rows its tiles compute (tile_rows: each
  expert's rows rounded up to the tile), as a share of the matmul rate;
- the gather's rate against the write rate (it writes T*K rows of H and reads T rows: bound by
  its writes; on the H200 a fill ran 3.18 TB/s against a 4.06 TB/s copy, RESULTS.md, session
  forty-four) and the combine's against the copy rate (it reads T*K rows and writes T);
- two bounds of the call over the floor under the present structure (routing, gather, two
  grouped GEMMs, combine, one after another), each pass at the card's rate: (a) the GEMMs'
  useful FLOPs at the matmul rate, the gather's writes at the write rate, the combine's bytes at
  the copy rate, the routing as measured; (b) the same with the GEMMs on tile_rows. What the
  measured call exceeds (b) by is the GEMMs' and the passes' own shortfall; what (b) exceeds (a)
  by is the tiles' padding; what (a) exceeds 1.00 by is the card (its sustained matmul rate
  under the power limit), the gather and combine passes, and the routing's and other kernels'
  measured time.

The rates are those given here (--matmul-tflops, --copy-gbs, --write-gbs), else the JSON's
`ceilings_here` (kernel_times_moe.py --ceilings: measured in the same process), else PERF.md's
(787 TFLOP/s, 4.23 TB/s copy; no write rate: the gather's share and bound (a)/(b) then read '-').
Kernels are told apart by name (GEMM1, GEMM2, gather, combine, routing; anything else is 'other'
and counts in the bounds as measured; where GEMM1 has no name of its own, as an ungated GEMM1
under GEMM2's CUTLASS name, the GEMM2 column reads 'both': the two GEMMs together).

Reads only the JSON (no GPU, no PyTorch), and checks all of it before it prints anything: an
object with 'meta' (an object; its ceilings_here, where given, rates > 0) and 'rows' (at least
one case; T, H, I, K whole numbers >= 1, slots between 0 and T*K, tile_rows at least slots,
experts_hit >= 0, every kernel's µs and span_us/graph_us/wall_us finite and >= 0). A case with no
call time (no kernel, or every kernel at 0 µs) reads '-' over the floor. Exit status: 0 done;
2 a rate given here that is not a finite number > 0, a missing or unreadable file, or a file
that is not such a JSON (the first thing wrong, named with what it expected and what came).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from ex_engine._scripts import HelpFormatter, exit_quietly_on_broken_pipe, number  # noqa: E402

PEAK_TFLOPS = 787.0   # ../shared/PERF.md: the floor's matmul ceiling
PEAK_GBS = 4230.0     # ../shared/PERF.md: the floor's copy ceiling
ROLES = ("GEMM1", "GEMM2", "gather", "combine", "routing", "other")
NEED = ("model", "T", "H", "I", "K", "slots", "tile_rows", "experts_hit", "kernels_us")
RATE_KEYS = ("matmul_tflops", "copy_gbs", "write_gbs")


class BadInput(ValueError):
    """What is wrong with the JSON, as 'where: expected ..., got ...'."""


def shown(v) -> str:
    """A JSON value as an error message shows it: JSON's words for null, booleans and the
    non-finite numbers, the kind of a list or an object, a long value cut short."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    text = repr(v) if isinstance(v, str) else str(v)
    return text if len(text) <= 24 else text[:20] + f"... ({len(text)} characters)"


def kind(v) -> str:
    """What sort of JSON value ``v`` is, in words."""
    if v is None:
        return "null"
    for t, words in ((bool, "a boolean"), ((int, float), "a number"), (str, "a string"), (list, "a list"),
                     (dict, "an object")):
        if isinstance(v, t):
            return words
    return type(v).__name__


def _finite(v):
    """``v`` as a finite float, or None where it is no such number (bool, str, null, NaN, too big)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def check_rate(where: str, v) -> None:
    """Refuses a rate (TFLOP/s or GB/s) that is not a finite number > 0."""
    f = _finite(v)
    if f is None or f <= 0:
        raise BadInput(f"{where}: expected a rate > 0, got {shown(v)}")


def check(data) -> None:
    """Raises BadInput for the first thing in ``data`` (the parsed JSON) that analyse() and the
    table cannot use, named with what was expected and what came; returns None where all is well."""
    if not isinstance(data, dict):
        raise BadInput(f"expected an object with 'meta' and 'rows', got {kind(data)}")
    for k in ("meta", "rows"):
        if k not in data:
            raise BadInput(f"expected an object with 'meta' and 'rows', got one with no '{k}'")
    meta, rows = data["meta"], data["rows"]
    if not isinstance(meta, dict):
        raise BadInput(f"meta: expected an object, got {shown(meta)}")
    here = meta.get("ceilings_here")
    if here is not None:
        if not isinstance(here, dict):
            raise BadInput(f"meta.ceilings_here: expected an object of {', '.join(RATE_KEYS)}, "
                           f"got {shown(here)}")
        for k in RATE_KEYS:
            if here.get(k) is not None:
                check_rate(f"meta.ceilings_here.{k}", here[k])
    if not isinstance(rows, list):
        raise BadInput(f"rows: expected a list of cases, got {kind(rows)}")
    if not rows:
        raise BadInput("rows: expected at least one case, got none")
    for i, r in enumerate(rows):
        at = f"rows[{i}]"
        if not isinstance(r, dict):
            raise BadInput(f"{at}: expected an object, got {shown(r)}")
        missing = [k for k in NEED if k not in r]
        if missing:
            whose = ("bench_moe.py's JSON, not kernel_times_moe.py's?" if "floor_us" in r else
                     "ab_moe.py's JSON, not kernel_times_moe.py's?" if "configs" in meta else
                     "an older kernel_times_moe.py, or another tool's JSON?")
            raise BadInput(f"{at}: lacks {', '.join(missing)} (of {', '.join(NEED)}; {whose})")
        if not isinstance(r["model"], str):
            raise BadInput(f"{at}.model: expected a name, got {shown(r['model'])}")
        for k in ("T", "H", "I", "K"):
            v = r[k]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or _finite(v) is None:
                raise BadInput(f"{at}.{k}: expected a whole number >= 1, got {shown(v)}")
        for k in ("slots", "tile_rows", "experts_hit"):
            f = _finite(r[k])
            if f is None or f < 0:
                raise BadInput(f"{at}.{k}: expected a number >= 0, got {shown(r[k])}")
        tk = r["T"] * r["K"]
        if r["slots"] > tk:
            raise BadInput(f"{at}.slots: expected at most T*K = {tk}, got {shown(r['slots'])}")
        if r["tile_rows"] < r["slots"]:
            raise BadInput(f"{at}.tile_rows: expected at least slots ({shown(r['slots'])}), "
                           f"got {shown(r['tile_rows'])}")
        if _finite(6.0 * tk * r["H"] * r["I"]) is None:
            raise BadInput(f"{at}: expected sizes whose FLOPs fit a float, got T*K*H*I = "
                           f"{shown(tk * r['H'] * r['I'])}")
        if not isinstance(r["kernels_us"], dict):
            raise BadInput(f"{at}.kernels_us: expected an object of kernel name: µs, "
                           f"got {shown(r['kernels_us'])}")
        for name, us in r["kernels_us"].items():
            f = _finite(us)
            if f is None or f < 0:
                raise BadInput(f"{at}.kernels_us[{name!r}]: expected a time >= 0 µs, got {shown(us)}")
        for k in ("span_us", "graph_us", "wall_us"):
            if r.get(k) is not None:
                f = _finite(r[k])
                if f is None or f < 0:
                    raise BadInput(f"{at}.{k}: expected a time >= 0 µs, got {shown(r[k])}")


def role(name: str) -> str:
    """The stage a kernel of kernel_times_moe.py's short names does."""
    if name.endswith("GEMM1>"):
        return "GEMM1"
    if name.endswith("<GEMM2>") or name.startswith("cutlass_grouped_gemm"):
        return "GEMM2"
    if name == "sm90_prepare_kernel" or "gather" in name:
        return "gather"
    if "combine" in name:
        return "combine"
    if name.startswith("moe_route") or name.startswith("topk"):
        return "routing"
    return "other"


def analyse(row: dict, rates: dict) -> dict:
    """The figures gap_moe prints for one kernel_times_moe.py row, given rates {"matmul_tflops",
    "copy_gbs", "write_gbs" (None: unknown)}; times in µs, rates in TFLOP/s and GB/s; a figure
    that would divide by a time of 0 µs is None (x_floor where the call has no time)."""
    T, H, I, K = row["T"], row["H"], row["I"], row["K"]
    slots, tile_rows = row["slots"], row["tile_rows"]
    by = {r: 0.0 for r in ROLES}
    for name, us in row["kernels_us"].items():
        by[role(name)] += us
    # the profiled replays' span (the replays the kernel times come from; the graph's own timing
    # ran earlier, at the power-limited card's clocks of that moment: 2507 against 2233 µs at
    # qwen3-30b T = 16384, H200, session forty-four), else the graph's, else an eager call's wall
    # time, else the kernels' sum
    call = row.get("span_us") or row.get("graph_us") or row.get("wall_us") or sum(by.values())
    # the floor as benchmarks/bench_moe.py counts it: FLOPs 6*T*K*H*I (not the slots: where ids
    # fall outside the layer's experts, the same case reads the same ratio in both tools)
    bytes_ = row["experts_hit"] * 3 * H * I * 2 + 2 * T * H * 2 + T * K * 8
    floor = max(6.0 * T * K * H * I / PEAK_TFLOPS / 1e6, bytes_ / PEAK_GBS / 1e3)
    flops = 6.0 * slots * H * I      # useful FLOPs: the bounds' and the GEMMs' rates
    mm, cp, wr = rates["matmul_tflops"], rates["copy_gbs"], rates.get("write_gbs")
    out = {"call_us": call, "x_floor": call / floor if call > 0 else None, "floor_us": floor, "us": by}
    # 2*rows*H*2I and 2*rows*I*H; where GEMM1 has no name of its own (an ungated GEMM1 shares
    # GEMM2's CUTLASS name, and its silu runs apart), both GEMMs count under GEMM2
    # (told by the names, not the times: a GEMM1 recorded at 0 µs is still a GEMM1 of its own)
    both = not any(role(n) == "GEMM1" for n in row["kernels_us"]) and by["GEMM2"] > 0
    for g, share in (("GEMM1", 4.0), ("GEMM2", 6.0 if both else 2.0)):
        us = by[g]
        out[g] = None if us <= 0 else {
            "tflops": share * slots * H * I / us / 1e6, "tile_tflops": share * tile_rows * H * I / us / 1e6,
            "both": both and g == "GEMM2"}
    gather_w = slots * H * 2                     # its writes; it also reads T rows
    combine_b = (slots + T) * H * 2              # reads T*K rows, writes T
    out["gather_gbs"] = (gather_w + T * H * 2) / by["gather"] / 1e3 if by["gather"] > 0 else None
    out["gather_write_gbs"] = gather_w / by["gather"] / 1e3 if by["gather"] > 0 else None
    out["combine_gbs"] = combine_b / by["combine"] / 1e3 if by["combine"] > 0 else None
    rest = by["routing"] + by["other"]
    if wr:
        passes = gather_w / wr / 1e3 + combine_b / cp / 1e3 + rest
        out["bound_a"] = (flops / mm / 1e6 + passes) / floor
        out["bound_b"] = (6.0 * tile_rows * H * I / mm / 1e6 + passes) / floor
    else:
        out["bound_a"] = out["bound_b"] = None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("json_file", metavar="JSON", help="the output of scripts/kernel_times_moe.py --json")
    ap.add_argument("--matmul-tflops", type=number, default=None, help="the card's bf16 matmul rate "
                    "(default: the JSON's ceilings_here, else ../shared/PERF.md's 787)")
    ap.add_argument("--copy-gbs", type=number, default=None, help="the card's copy rate, bytes read + "
                    "written (default: the JSON's ceilings_here, else PERF.md's 4230)")
    ap.add_argument("--write-gbs", type=number, default=None, help="the card's write-only rate "
                    "(default: the JSON's ceilings_here, else unknown)")
    args = ap.parse_args(argv)
    rates = {"matmul_tflops": args.matmul_tflops, "copy_gbs": args.copy_gbs, "write_gbs": args.write_gbs}
    for v, flag in ((args.matmul_tflops, "--matmul-tflops"), (args.copy_gbs, "--copy-gbs"),
                    (args.write_gbs, "--write-gbs")):
        if v is not None and not (math.isfinite(v) and v > 0):   # float() takes 'inf' and 'nan'
            print(f"gap_moe: {flag}: expected a finite rate > 0, got {v:g}", file=sys.stderr)
            return 2
    try:
        data = json.loads(Path(args.json_file).read_text(encoding="utf-8"))
        check(data)
        meta, rows = data["meta"], data["rows"]
        here = meta.get("ceilings_here") or {}
        defaults = {"matmul_tflops": PEAK_TFLOPS, "copy_gbs": PEAK_GBS, "write_gbs": None}
        for k in rates:
            if rates[k] is None:
                rates[k] = here.get(k) or defaults[k]
        figures = []
        for i, r in enumerate(rows):   # every case before any line, so that a refusal prints none
            a = analyse(r, rates)
            nums = [a["call_us"], a["x_floor"], a["floor_us"], a["gather_gbs"], a["gather_write_gbs"], a["combine_gbs"],
                    a["bound_a"], a["bound_b"], *a["us"].values()]
            nums += [a[g][k] for g in ("GEMM1", "GEMM2") if a[g] for k in ("tflops", "tile_tflops")]
            if any(x is not None and not math.isfinite(x) for x in nums):
                raise BadInput(f"rows[{i}]: a figure overflows (a time too small or a size too big "
                               "for a float); expected a kernel_times_moe.py case")
            figures.append(a)
    except (OSError, ValueError) as exc:   # BadInput, json's errors and UnicodeDecodeError are ValueErrors
        print(f"gap_moe: {args.json_file}: expected the JSON of scripts/kernel_times_moe.py --json: {exc}",
              file=sys.stderr)
        return 2
    wr = rates["write_gbs"]
    unknown = lambda k: meta.get(k) or "?"
    print(f"# {unknown('date')} {unknown('device')} commit {unknown('commit')}; rates: matmul "
          f"{rates['matmul_tflops']:.0f} TFLOP/s, copy {rates['copy_gbs']:.0f} GB/s, write "
          f"{'-' if not wr else f'{wr:.0f} GB/s'}; GEMMs: useful TFLOP/s / on the tiles' rows "
          f"(% of matmul); gather: GB/s (its writes' % of the write rate); combine: GB/s (% of copy)")
    pct = lambda x, base: f"{100 * x / base:.0f}%"
    fmt = lambda v: "-" if v is None else f"{v:.2f}"
    table = [("model", "T", "call µs", "x floor", "GEMM1", "GEMM2", "gather", "combine", "route", "(b)", "(a)")]
    for r, a in zip(rows, figures):
        gem = []
        for g in ("GEMM1", "GEMM2"):
            x = a[g]
            gem.append("-" if x is None else ("both " if x["both"] else "") + f"{x['tflops']:.0f}/"
                       f"{x['tile_tflops']:.0f} ({pct(x['tile_tflops'], rates['matmul_tflops'])})")
        if a["gather_gbs"] is None:
            gath = "-"
        else:
            gath = f"{a['gather_gbs']:.0f}" + (f" ({pct(a['gather_write_gbs'], wr)})" if wr else "")
        comb = "-" if a["combine_gbs"] is None else f"{a['combine_gbs']:.0f} ({pct(a['combine_gbs'], rates['copy_gbs'])})"
        table.append((r["model"], str(r["T"]), f"{a['call_us']:.1f}", fmt(a["x_floor"]), *gem, gath, comb,
                      f"{a['us']['routing']:.1f}", fmt(a["bound_b"]), fmt(a["bound_a"])))
    # each column as wide as its widest cell, two spaces between columns: no cell runs into the next
    widths = [max(len(line[c]) for line in table) for c in range(len(table[0]))]
    left = (True, False, False, False, True, True, True, True, False, False, False)
    for line in table:
        print("  ".join(cell.ljust(w) if lft else cell.rjust(w)
                        for cell, w, lft in zip(line, widths, left)).rstrip())
    return 0


if __name__ == "__main__":
    exit_quietly_on_broken_pipe(main)

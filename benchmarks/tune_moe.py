"""Tune moe_fused_gemm's tile configuration per shape and T on this GPU; write it as data.

For each model of manifests/moe_models.yaml and each T, forces each tile configuration the
kernels know that candidates() offers at its rows per expert (tiny, decode, decode4, mid, mid32,
mid48, prefill and, with the Hopper plugin, grouped, grouped64, narrow, chunked, chunked_nomc and
chunked_tail), checks each output against a float32 reference, times it (CUDA-graph
replay over rotated input sets, as bench_moe.py), and writes the fastest per (H, I, G, K, T) to a
tuning file that the registry reads (ex_engine/tuning.py documents the format). Needs PyTorch, a
CUDA GPU and the built plugins.

The file (--out; by default this GPU's: manifests/tuning/h200.yaml on an H200 with 132 SMs, else
manifests/tuning/<device>_<SMs>sm.yaml, e.g. nvidia_a100_sxm4_80gb_108sm.yaml) is merged into
when it is this GPU's tuning file: rows of shapes and T not tuned in this run are kept, and so is
its comment header, below the new one. The file is read for that when the run ends, under a lock
on its folder, so that tuners running at once (one per GPU of a host) keep each other's rows. A
file that cannot be merged (another GPU's or SM count's tuning file, a file that is no tuning
file, malformed YAML or a malformed table) is refused before any work (exit status 2; for another
GPU's file, once the GPU is known) unless --replace is given, which writes a new table over it
(over the file as it was when the run started: rows another tuner writes there during the run
are merged). A row records the fastest configuration where it beats auto by more than --margin;
else, under a row of a configuration, that row's choice or else the row below's where it ran
faster than auto ('# kept:' line); else auto. After writing, '# gap:' and '# unchecked:' lines
name the ranges around the tuned rows where a call runs a choice that lost, or was never timed,
at the neighbouring row's T, each with a T between them to tune next. With --follow-gaps
MINUTES the tuner tunes those T itself, round after round, until no line names one (ranges
narrower than 2% of their T are left: their lines are printed) or its time is spent (the rows
asked for always run; the file is still written once, at the end). Exit
status: 0 written; 1 written, but a configuration failed its check; 2 bad arguments or a file it
will not replace.

    python3 benchmarks/tune_moe.py --models qwen3-30b-a3b --tokens 1 64 4096 --out my.yaml
    python3 benchmarks/tune_moe.py --models olmoe-1b-7b --tokens 1774 2217 --follow-gaps 3
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import math
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    import torch  # noqa: E402
except ImportError:  # --help works without it; a run says it needs it
    torch = None
import yaml  # noqa: E402

from _timing import graph_us, run_meta  # noqa: E402
from bench_moe import input_sets, layer_weights, reference, rel  # noqa: E402
from ex_engine import FactorError, FactorRegistry, moe_fused_gemm  # noqa: E402
from ex_engine._scripts import HelpFormatter, integer, number  # noqa: E402
from ex_engine.trust import replace_file  # noqa: E402
from ex_engine.moe_layer import (case_problems, load_models_or_exit, models_help,  # noqa: E402
                                 output_file_problem, report_problems)
from ex_engine._paths import TUNING_SUFFIXES  # noqa: E402
from ex_engine.tuning import _NUMERIC_DEVICE, FactorTuning, TuningTable, tuning_dir  # noqa: E402

from ex_engine._scripts import CONFIGS, VALUES, force_config  # noqa: E402,F401  (tests import CONFIGS, VALUES from here)

KEY = ["H", "I", "G", "K"]


def _width(name: str) -> int:
    """Column width of a configuration in the printed table: 10, or its name and a space."""
    return max(10, len(name) + 1)


def candidates(rows_per_expert: float, grouped: bool, H: int = 0, I: int = 0) -> list:
    """Configurations worth timing at this many rows per expert (the others lose by far); chunked
    from 8 rows per expert (on 128-row chunks it beat the tuned choice by 1-9% at 16-24 rows per
    expert in an A/B of session 26: qwen3-30b T = 384 315.6 against 345.0 µs, granite T = 96
    64.3 against 70.5) and only on shapes its kernels take (H and I multiples of 128: elsewhere
    the plugin runs grouped for it, which would be recorded under chunked's name); chunked_nomc
    (the same kernels without the multicast of A) wherever chunked is offered, and chunked_tail
    (256-row chunks whose last takes up to 32 rows more) there from 128 rows per expert (it
    gained 0.6-18% at ~256 rows per expert in session 28's A/B, e.g. mixtral T = 1024 1398.4 against
    1617.7 µs, and lost 7% at 128: qwen3-30b T = 2048)."""
    out = []
    if rows_per_expert <= 64:
        out += ["tiny", "decode", "decode4"]
    if rows_per_expert >= 2:
        out += ["mid"]
    if 8 <= rows_per_expert <= 128:
        out += ["mid32"]
    if 16 <= rows_per_expert <= 128:
        out += ["mid48"]
    if rows_per_expert >= 16:
        out += ["prefill"] + (["grouped", "grouped64", "narrow"] if grouped else [])
    if rows_per_expert >= 8 and grouped and H % 128 == 0 and I % 128 == 0 and H > 0 and I > 0:
        out += ["chunked", "chunked_nomc"] + (["chunked_tail"] if rows_per_expert >= 128 else [])
    return out


def default_out(device: str, sms: int) -> Path:
    """This GPU's tuning file: manifests/tuning/h200.yaml for the H200 (132 SMs), else
    <device name, lower case, non-word runs as '_'>_<SMs>sm.yaml beside it."""
    if (device, sms) == ("NVIDIA H200", 132):
        return tuning_dir() / "h200.yaml"
    return tuning_dir() / (re.sub(r"\W+", "_", device.lower()).strip("_") + f"_{sms}sm.yaml")


EARLIER = "# Earlier header of this file (its rows not re-tuned here keep its provenance):"


def merged_header(header: str, notes: list) -> str:
    """The comment header of a merged tuning file: this run's ``header`` (lines ending in a
    newline), then, under one EARLIER line, the merged file's leading comment lines (``notes``,
    existing_table()) that this header does not already say. Without that, every merge into a
    file nested its whole header again: one tuning run a model into one file repeated the same
    five lines seven times (session forty-two). A line of the notes that this header does not say
    is kept each time it comes: two earlier runs' paragraphs may open with the same line (a
    date and a session), and dropping the second dropped that run's provenance (session
    fifty-four)."""
    said = set(header.splitlines())
    kept = [n for n in notes if n != EARLIER and n not in said]
    return header + (EARLIER + "\n" + "".join(n + "\n" for n in kept) if kept else "")


def existing_table(out: Path, device: str | None = None, sms: int | None = None):
    """(data, notes) of the tuning file ``out`` to merge into: its mapping, read and checked as
    the registry reads it (YAML 1.2, device, the moe_fused_gemm table with key [H, I, G, K]), and
    its leading comment lines; ({}, []) where there is no file or an empty one. With ``device``
    and ``sms``: the file must be that GPU's. Raises FactorError saying why it cannot be merged
    (main refuses to replace such a file unless --replace)."""
    try:
        if not out.exists() or not out.read_text(encoding="utf-8").strip():
            return {}, []
    except (OSError, UnicodeDecodeError):
        pass                       # _read says what is wrong with it
    data = TuningTable._read(out)  # unreadable, not YAML, not a mapping, no device
    data.pop(_NUMERIC_DEVICE, None)
    if "moe_fused_gemm" not in data:
        raise FactorError(f"tuning file {out}: no moe_fused_gemm table (top-level keys "
                          f"{sorted(map(str, data))}): not a tuning file of this tuner")
    table = FactorTuning("moe_fused_gemm", data["moe_fused_gemm"], str(out))   # every entry checked
    if table.key != KEY:
        raise FactorError(f"tuning file {out}: moe_fused_gemm: key {table.key}, expected {KEY}")
    if device is not None and (data["device"], data.get("multiprocessor_count")) != (device, sms):
        raise FactorError(f"tuning file {out}: the table of {data['device']} "
                          f"({data.get('multiprocessor_count', '?')} SMs), not of this GPU, {device} "
                          f"({sms} SMs): merging would drop every row of it")
    notes = []
    for line in out.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        notes.append(line)
    return data, notes


def _refusal(exc: FactorError) -> str:
    """Why --out is not written over, from existing_table's FactorError, and what to do."""
    return f"--out: will not replace it: {exc}; give --replace to write a new table over it"


def merge_problem(out, replace: bool, device=None, sms=None) -> str:
    """'' when ``out`` can be merged into (or --replace), else why not and what to do."""
    if replace or out is None:
        return ""
    try:
        existing_table(Path(out), device, sms)
    except FactorError as exc:
        return _refusal(exc)
    return ""


def _key(s) -> tuple:
    """(H, I, G, K) of a model's shape (moe_models.yaml: G is its E)."""
    return s.H, s.I, s.E, s.K


def _entries_by_key(table: dict) -> dict:
    """(H, I, G, K) -> shapes entry of a factor's table (its own dicts)."""
    return {tuple(e[k] for k in KEY): e for e in table.get("shapes") or []}


def merge_rows(data: dict, tuned: dict, device: str, sms: int) -> dict:
    """``data`` (existing_table's mapping, {} for a new table) with this run's rows merged in:
    ``tuned`` maps (H, I, G, K) to (model, {T: [T, configuration, its µs, auto's µs]}); a row
    of the same shape and T replaces the file's, the file's other rows stay. Returns ``data``."""
    data.update({"device": device, "multiprocessor_count": sms})
    table = data.setdefault("moe_fused_gemm", {})
    table.update({"dim": "config", "key": KEY, "values": VALUES})
    shapes = _entries_by_key(table)
    for key, (model, new) in tuned.items():
        entry = shapes.setdefault(key, {**dict(zip(KEY, key)), "model": model, "by_T": []})
        rows = {r[0]: r for r in entry["by_T"]}
        rows.update(new)
        entry["by_T"] = [rows[t] for t in sorted(rows)]
    table["shapes"] = [shapes[k] for k in sorted(shapes)]
    return data


_NAMES = {v: k for k, v in VALUES.items()}


def _choice(c) -> str:
    """A row's configuration as its name (a file may give its value, an int, instead)."""
    return c if isinstance(c, str) else _NAMES.get(c, str(c))


def _rows_by_T(data: dict) -> dict:
    """(H, I, G, K) -> {T: row} of the merged table ``data``; the rows are the table's own lists."""
    return {key: {r[0]: r for r in e.get("by_T") or []}
            for key, e in _entries_by_key(data.get("moe_fused_gemm", {})).items()}


def _between(lo: int, hi: int) -> int:
    """A T strictly between lo and hi (hi - lo >= 2): their geometric mean, clamped."""
    return min(max(round((max(lo, 0) * hi) ** 0.5), lo + 1), hi - 1)


def keep_neighbour_choices(data: dict, timed: dict) -> list:
    """Rows of this run that record auto (no configuration beat it by more than the margin), in
    the merged table ``data``, under a row that chose a configuration and above another row:
    the row records instead the row above's choice where it ran faster than auto at this row's
    T (it is then the faster at both ends of the range this row covers); else the row below's,
    where that is a configuration that ran faster than auto here (inside the margin, or it would
    have been this row's choice) and, where the row above was tuned in this run too, ran no
    slower than auto there. So such a range does not flip to auto and back. On an H100
    phi-3.5's T = 384 row recorded auto (870.6 µs; T = 512's chunked ran 850.0 there) under a
    chunked row at 512, and T = 384..511 then ran auto, 10% slower than chunked at 512;
    phi-3.5's T = 1906 auto (1212.3 µs; chunked_tail 1202.2) under chunked_tail rows ran 11%
    slower at T = 1923 (RESULTS.md, session fifty-eight). Where the row above records auto (or
    there is none), auto stays: there the lower choice may be near the row count it stops
    winning at (mixtral T = 1133: T = 1024's chunked_tail ran 1.5% faster than auto, and 30%
    slower at 1254, whose row is auto). Faster means by 0.1 µs or more, as the row records µs.
    ``timed`` maps (H, I, G, K, T) of each row tuned in this run to (model, {configuration:
    µs}). Changes ``data``'s rows in place, highest T first (so that the row above is settled
    before the row it may lend its choice to); returns a line for each row changed."""
    rows_of = _rows_by_T(data)
    out = []
    for (*key, T), (model, times) in sorted(timed.items(), reverse=True):
        rows = rows_of.get(tuple(key), {})
        below, above = [t for t in rows if t < T], [t for t in rows if t > T]
        if T not in rows or _choice(rows[T][1]) != "auto" or not below or not above or "auto" not in times:
            continue
        lo, hi = max(below), min(above)
        upper, lower = _choice(rows[hi][1]), _choice(rows[lo][1])
        if upper == "auto":
            continue
        at_hi = timed.get(tuple(key) + (hi,), (None, None))[1]   # the row above's timings, if this run's
        lower_ok = at_hi is None or (lower in at_hi and "auto" in at_hi and at_hi[lower] <= at_hi["auto"])
        for t, cfg in ((hi, upper), (lo, lower) if lower_ok else (lo, "auto")):
            if cfg != "auto" and cfg in times and round(times[cfg], 1) < round(times["auto"], 1):
                rows[T][1:3] = [cfg, round(times[cfg], 1)]
                out.append(f"# kept: {model} T = {T} records the T = {t} row's {cfg} ({times[cfg]:.1f} µs), "
                           f"within the margin of auto ({times['auto']:.1f}) but faster here, between the "
                           f"T = {lo} row's {lower} and the T = {hi} row's {upper}")
                break
    return out


def _gap_items(data: dict, timed: dict, margin: float, out: str | None = None) -> list:
    """Lines naming the gaps around the rows tuned in this run, in the merged table ``data``
    (merge_rows's result; a call uses the row of the largest tuned T not above its own).
    ``timed`` maps (H, I, G, K, T) of each row tuned in this run to (model, {configuration:
    µs}). Below a row at T: where the row just below chose another configuration and it ran
    here more than ``margin`` slower than this row's choice, every call from that row's T to T -
    1 runs it, and it loses that much at T (measured at T only). Above it, where the next row up
    (U) was not tuned in this run and chose otherwise: calls from T to U - 1 run this row's
    choice; if that is auto, U's row says what auto lost there; else it was never timed at U and
    the line says so. Each line names a T between the two to tune next (with ``--out out`` where
    the run was given one, so that the next run merges into the same file). On an H100 such gaps cost
    up to 36% (RESULTS.md, session fifty-eight: olmoe T = 2266 ran T = 1024's chunked_nomc,
    806.5 against auto's 591.4 µs). Returns (line, model, the T to tune, lo, hi) for each, lo..hi - 1
    the range the line names.
    gap_notes gives the lines; --follow-gaps tunes the T."""
    rows_of = _rows_by_T(data)
    to = f" --out {out}" if out else ""
    lines = []
    for (*key, T), (model, times) in sorted(timed.items(), key=lambda kv: (kv[1][0], kv[0][-1])):
        rows = rows_of.get(tuple(key), {})
        if T not in rows:
            continue
        chosen = _choice(rows[T][1])
        below = [t for t in rows if t < T]
        if below and T - max(below) >= 2:
            lo = max(below)
            cfg = _choice(rows[lo][1])
            if cfg != chosen and cfg in times and times.get(chosen, 0) > 0:
                loss = times[cfg] / times[chosen] - 1
                if loss > margin:
                    nxt = _between(lo, T)
                    lines.append((f"# gap: {model} T = {lo}..{T - 1} runs the T = {lo} row's {cfg}, {loss:.0%} "
                               f"slower at T = {T} ({times[cfg]:.1f} µs) than this row's {chosen} "
                               f"({times[chosen]:.1f}); tune a T between them (e.g. --models {model} "
                               f"--tokens {nxt}{to}) to find where the choice changes", model, nxt, lo, T))
        above = [t for t in rows if t > T]
        if not above or min(above) - T < 2 or tuple(key) + (min(above),) in timed:
            continue      # (a row above tuned in this run: its own check below it covers the range)
        hi = min(above)
        up = rows[hi]
        cfg = _choice(up[1])
        if cfg == chosen:
            continue
        nxt = _between(T, hi)
        hint = f"tune a T between them (e.g. --models {model} --tokens {nxt}{to})"
        if chosen == "auto":
            figures = len(up) >= 4 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                           for v in up[2:4])   # (a file's row may give no µs, or a note)
            if cfg != "auto" and figures and up[2] > 0 and up[3] / up[2] - 1 > margin:
                lines.append((f"# gap: {model} T = {T}..{hi - 1} runs this row's auto, {up[3] / up[2] - 1:.0%} "
                              f"slower at T = {hi} ({up[3]} µs, that row's figures) than the T = {hi} "
                              f"row's {cfg} ({up[2]}); {hint} to find where the choice changes", model, nxt, T, hi))
        else:
            lines.append((f"# unchecked: {model} T = {T}..{hi - 1} runs this row's {chosen}, never timed at "
                          f"T = {hi}, whose row chose {cfg}; {hint} to check it", model, nxt, T, hi))
    return lines


def gap_notes(data: dict, timed: dict, margin: float, out: str | None = None) -> list:
    """The '# gap:' and '# unchecked:' lines of _gap_items (which says what they check)."""
    return [item[0] for item in _gap_items(data, timed, margin, out)]


FOLLOW_SPAN = 0.02   # --follow-gaps leaves a range narrower than this fraction of its top T


def follow_cases(start: dict, new_rows: dict, timed: dict, margin: float, device: str, sms: int,
                 tried=()) -> list:
    """The (model, T) that the gap and unchecked lines would name if the run ended now: this
    run's rows (``new_rows``, as merge_rows takes them; ``timed`` as gap_notes takes it) merged
    into a copy of ``start`` (the file's table as the run found it, {} for a new one) with the
    neighbours' choices kept, as the file will be written. In order of the lines, each once,
    leaving out a T this run timed already or ``tried`` ((model, T) pairs: a T whose every
    configuration failed its check has no row, and the same line would name it round after
    round) and ranges narrower than FOLLOW_SPAN of their top T
    (the line is still printed): where a cliff lies to within 2% of T matters less than the
    other gaps the time could go to, and the routing's spread of rows per expert blurs it
    anyway. --follow-gaps tunes them, round after round: on an H100 six rounds by hand took the
    largest gap from 32% to 7% (RESULTS.md, session fifty-eight)."""
    data = merge_rows(copy.deepcopy(start), copy.deepcopy(new_rows), device, sms)
    keep_neighbour_choices(data, timed)
    done = {(model, key[-1]) for key, (model, _) in timed.items()} | set(tried)
    out = []
    for _, model, T, lo, hi in _gap_items(data, timed, margin):
        if hi - lo >= FOLLOW_SPAN * hi and (model, T) not in done and (model, T) not in out:
            out.append((model, T))
    return out


def _file_state(path: Path):
    """(device, inode, size, mtime in ns) of the file at ``path``, None where there is none: a
    tuner that wrote it meanwhile (replace_file: a new inode) changed it."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@contextlib.contextmanager
def _folder_locked(folder: Path):
    """Hold an exclusive flock on ``folder`` while a run reads, merges and writes its tuning file
    there, so that tuners finishing at once (one per GPU of a host, each tuning other models into
    the same file) do not drop each other's rows. Best effort: where the folder cannot be opened
    or locked (a file system without flock), the update runs unlocked."""
    import fcntl
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)   # (releases the lock)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--models", nargs="+", default=["all"], metavar="MODEL",
                    help=f"models of manifests/moe_models.yaml, or all (alone: every model): "
                         f"{models_help(all_ok=True)}")
    ap.add_argument("--tokens", type=integer, nargs="+", metavar="T",
                    default=[1, 8, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 16384],
                    help="T values to tune, each >= 1 (a call uses the row of the largest tuned T not "
                         "above its own, so a gap runs the lower row's choice: on an H100, granite T = "
                         "1536 ran the T = 1024 row's chunked_nomc, 26%% slower than auto there, and "
                         "olmoe and phi-3.5 T = 2048 ran it 27%% slower than chunked_tail; RESULTS.md, "
                         "session fifty-eight)")
    ap.add_argument("--sets", type=integer, default=4, help="routed input sets rotated per graph (>= 1)")
    ap.add_argument("--warm-ms", type=number, default=200.0,
                    help="replay each graph this many ms before timing it, 0..60000, as bench_moe.py does: "
                         "configurations are chosen at the clocks of sustained load, which the power-"
                         "limited card reaches within ~0.1 s (at 20 ms a T = 4096 row read ~10%% faster "
                         "than under the table's sustained load)")
    ap.add_argument("--margin", type=number, default=0.03,
                    help="record a configuration only if it beats the kernel's own choice by this "
                         "fraction; else, under a row of a configuration, that row's choice or else the "
                         "row below's where it ran faster than auto at this T; else 'auto'. Also "
                         "the loss over which a "
                         "'# gap:' line is printed (>= 0)")
    ap.add_argument("--follow-gaps", type=number, default=0.0, metavar="MINUTES",
                    help="after the T asked for, tune the T that the '# gap:' and '# unchecked:' lines "
                         "would name, round after round (a round's rows may name more), until none is "
                         "named (a range narrower than 2%% of its T is left; its line is printed) or "
                         "the next row would end more than MINUTES after the run started, at "
                         "the mean pace so far; the file is written once, at the end, and the lines "
                         "left are printed (0, the default: off; on an H100 six rounds by hand took "
                         "the largest gap from 32%% to 7%%)")
    ap.add_argument("--out", default=None, metavar="FILE",
                    help="tuning file to merge into or write (default: this GPU's, "
                         "manifests/tuning/h200.yaml on an H200, else manifests/tuning/<device>_<SMs>sm.yaml); "
                         "one that cannot be merged is refused unless --replace")
    ap.add_argument("--replace", action="store_true",
                    help="write a new table over --out's file, keeping none of its rows, where it cannot "
                         "be merged (another GPU's tuning file, no tuning file, malformed); rows another "
                         "tuner writes there during the run are kept")
    args = ap.parse_args()
    models = load_models_or_exit("tune_moe")
    # every argument checked before any work (the tuning file is written after the whole run)
    problems = case_problems(models, args.models, args.tokens, all_ok=True)
    if args.sets < 1:
        problems.append(f"--sets: expected >= 1, got {args.sets}")
    if not 0 <= args.warm_ms <= 60000:   # (nan fails both)
        problems.append(f"--warm-ms: expected 0..60000 ms, got {args.warm_ms}")
    if not (math.isfinite(args.follow_gaps) and args.follow_gaps >= 0):
        problems.append(f"--follow-gaps: expected finite minutes >= 0, got {args.follow_gaps}")
    if not (math.isfinite(args.margin) and args.margin >= 0):   # nan passed `< 0`: no margin test
        problems.append(f"--margin: expected a finite fraction >= 0, got {args.margin}")
    problems.append(output_file_problem("--out", args.out, TUNING_SUFFIXES))
    if not problems[-1]:
        problems.append(merge_problem(args.out, args.replace))
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
    out = Path(args.out) if args.out else default_out(device, sms)
    try:   # (read once more now that this GPU is known: the file must be its table)
        # (the table as found: --follow-gaps judges each round's gaps against it and the rows so far)
        start = {} if args.replace else existing_table(out, device, sms)[0]
    except FactorError as exc:
        report_problems("tune_moe", [_refusal(exc)])
        return 2
    # --replace replaces the file as it is now; one another tuner writes during the run is merged
    replaced = _file_state(out)
    # this run's rows: (H, I, G, K) -> (model, {T: row}), merged into the file as it is when the
    # run ends (read then, under a lock: another tuner may have written it meanwhile; the rows
    # it added were dropped when the file read before this run's minutes of work was written back)
    new_rows = {}
    timed = {}   # (H, I, G, K, T) -> (model, {configuration: µs}) of each row timed: gap_notes

    names = sorted(models) if args.models == ["all"] else args.models
    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    cases = [(m, T) for m in names for T in args.tokens]
    print(f"# tuning moe_fused_gemm with {plugin.path.name} on {device} ({sms} SMs)", flush=True)
    print(f"{'model':<22}{'T':>6}  " + "".join(f"{c:>{_width(c)}}" for c in ["auto", *CONFIGS]) + "  best")
    cur, failed = None, 0
    started = time.monotonic()
    asked = len(cases)   # the rows asked for; those after them come from gap lines (--follow-gaps)
    round_of, rounds, i = {}, 0, 0   # (model, T) -> the gap round that named it
    while True:
        while i < len(cases):
            m, T = cases[i]
            s = models[m]
            spent = time.monotonic() - started
            # (the rows left at the mean pace so far: T and the model change a row's time, ~10 s on an H100)
            if i < asked:
                left = "" if i == 0 else f" (about {spent / i * (asked - i) / 60:.0f} min left)"
            elif spent + spent / i > args.follow_gaps * 60:   # the next row would end past the budget
                print(f"# --follow-gaps: {args.follow_gaps:g} min spent; the lines below name what is "
                      f"left", flush=True)
                break
            else:
                left = f" (gap round {rounds}; stops starting rows {args.follow_gaps - spent / 60:.1f} min from now)"
            print(f"[{i + 1}/{len(cases)}] {m} T={T} ...{left}", file=sys.stderr, flush=True)
            i += 1
            if m != cur:
                torch.cuda.empty_cache()
                w13, w2 = layer_weights(s, dt, gen)
                cur = m
            sets = input_sets(s, T, args.sets, w13, w2, dt, gen)
            ref = reference(*sets[0])
            times = {}
            passed = []
            for name in ["auto", *candidates(T * s.K / s.E, grouped, s.H, s.I)]:
                force_config(reg, name)
                err = rel(moe_fused_gemm(*sets[0], registry=reg), ref)
                if not err <= 1e-2:   # (NaN never passes)
                    print(f"  {name}: rel err {err:.2e} > 1e-2, not timed", flush=True)
                    failed += 1
                else:
                    passed.append(name)
            # two rounds in opposite orders, best of both: clocks and caches favour no position
            for name in passed + passed[::-1]:
                force_config(reg, name)
                t = graph_us([lambda a=a: moe_fused_gemm(*a, registry=reg) for a in sets], warm_ms=args.warm_ms)
                times[name] = min(t, times.get(name, t))
            reg.set_tuning("moe_fused_gemm", None)
            tuned = {k: v for k, v in times.items() if k != "auto"}
            if not tuned or "auto" not in times:
                continue
            best = min(tuned, key=tuned.get)
            if tuned[best] > times["auto"] * (1 - args.margin):
                best = "auto"              # no configuration is clearly better than the default
            print(f"{m:<22}{T:>6}  " + "".join(f"{times[c]:>{_width(c)}.1f}" if c in times else f"{'-':>{_width(c)}}"
                                               for c in ["auto", *CONFIGS]) + f"  {best}", flush=True)
            new_rows.setdefault(_key(s), (m, {}))[1][T] = [
                T, best, round(times[best], 1), round(times["auto"], 1)]
            timed[(*_key(s), T)] = (m, dict(times))
        if i < len(cases) or not args.follow_gaps:
            break
        # the T the gap lines would name now, none tried before: the next round (by model, so
        # weights load once each)
        nxt = sorted(follow_cases(start, new_rows, timed, args.margin, device, sms, tried=cases),
                     key=lambda c: (names.index(c[0]), c[1]))
        if not nxt:
            break
        rounds += 1
        cases += nxt
        round_of.update((c, rounds) for c in nxt)
    # the header names the rows the gap rounds wrote: not those the budget left unstarted, nor a
    # T whose every configuration failed its check (no row); a review, session 59
    wrote = [(m, T) for m, T in cases[asked:i] if (*_key(models[m]), T) in timed]
    followed = {}
    for m, T in wrote:
        followed.setdefault(m, []).append(T)
    commit = run_meta()["commit"]   # EX_COMMIT, else git describe of this checkout
    header = (f"# Tuned tile configurations of moe_fused_gemm on {device} (written by "
              f"benchmarks/tune_moe.py, {datetime.date.today().isoformat()}, commit {commit}).\n"
              f"# This run: {', '.join(sorted({m for m, _ in cases}))} at T = "
              f"{' '.join(map(str, sorted(set(args.tokens))))}"
              + (f"; then, in {max(round_of[c] for c in wrote)} round(s) of its gap lines (--follow-gaps), "
                 + "; ".join(f"{m} T = {' '.join(map(str, sorted(ts)))}" for m, ts in sorted(followed.items()))
                 if followed else "") + ".\n"
              "# by_T rows: [T, configuration, its µs, µs of the kernel's own choice ('auto')]; a\n"
              f"# configuration is recorded where it beat auto by more than {args.margin:.0%}; else,\n"
              "# under a row of a configuration, that row's or else the row below's where it ran faster\n"
              "# than auto; else auto. A call uses the row of the largest T not above its own. Format:\n"
              "# ex_engine/tuning.py.\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    with _folder_locked(out.parent):
        try:   # (with --replace: unless another tuner wrote the file during this run)
            data, notes = ({}, []) if args.replace and _file_state(out) == replaced else \
                existing_table(out, device, sms)
        except FactorError as exc:   # replaced during the run by a file it cannot merge into
            if not args.replace:
                report_problems("tune_moe", [_refusal(exc)])
                return 2
            data, notes = {}, []
        merge_rows(data, new_rows, device, sms)
        kept = keep_neighbour_choices(data, timed)
        header = merged_header(header, notes)
        # atomically: an interrupted write left a truncated table, which the registry set aside as
        # malformed and the next run would not merge into (only --replace, dropping every row)
        replace_file(out, header + yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100))
    print(f"# wrote {out}; {failed} configuration(s) failed their check", flush=True)
    for line in kept + gap_notes(data, timed, args.margin, args.out):
        print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    from ex_engine.cli import exit_quietly_on_broken_pipe
    exit_quietly_on_broken_pipe(main)

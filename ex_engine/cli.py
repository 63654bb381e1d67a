"""The ``ex-engine`` command line: list-factors, hardware, run moe, verify, lock, build.

Every command has --help. Exit status: 0 success, 1 a check failed (`list-factors`: no plugin
is ready), 2 bad usage or error (an output that cannot be written, such as a full disk or a
closed stdout, among them), 3 `verify --strict` skipped a factor, its plugin declined every
case or a library was refused at load, 130 interrupted (Ctrl-C), 141 the reader of stdout left
early (`ex-engine list-factors | head -1`: the status of a writer that SIGPIPE ends), 143
terminated (SIGTERM).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import unicodedata
import warnings
from pathlib import Path

from . import _paths
from ._scripts import (MAX_TOKENS, StdoutGuard, _reader_left, exit_quietly_on_broken_pipe,  # noqa: F401 (the scripts' import)
                       output_lost, tolerant_stdio)
from .errors import FactorError
from .hardware import Hardware, list_profiles, profiles_problem, resolve
from .trust import CHILD_TIMEOUT_S, LIBRARY_LIMIT


def _int_at_least(v: str, low: int) -> int:
    """``v`` as an integer >= low, else argparse's ArgumentTypeError (a word included)."""
    try:
        n = int(v)
    except ValueError:
        n = low - 1
    if n < low:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {v!r}")
    return n


def token_count(v: str) -> int:
    """argparse type: an integer >= 0 (a token count T, a seed)."""
    return _int_at_least(v, 0)


def positive_count(v: str) -> int:
    """argparse type: an integer >= 1 (--repeat); refused like any argument error, with
    the usage line (was a bare message after parsing)."""
    return _int_at_least(v, 1)


MAX_JOBS = 256   # make's jobserver puts N - 1 tokens in a pipe: at N >= ~65537 it blocked for ever


def job_count(v: str) -> int:
    """argparse type: --jobs, 1 <= N <= MAX_JOBS (a fresh user's trial: `build -j 70000` hung in
    make, which could not write its jobserver's tokens into a 64 KiB pipe; each nvcc job of the
    Hopper plugin takes gigabytes of memory, so more than a few dozen never pays)."""
    n = _int_at_least(v, 1)
    if n > MAX_JOBS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_JOBS} parallel jobs, got {v!r}")
    return n


def nonempty(v: str) -> str:
    """argparse type: a non-empty string (a folder, a file, a profile). An empty one was read
    differently by each option: --dir '' as the default folder (list-factors) or the current
    one (lock), --profile '' as not given, --hardware '' as an error."""
    if not v:
        raise argparse.ArgumentTypeError("expected a non-empty value, got ''")
    return v


def tokens_arg(v: str) -> int:
    """argparse type: a token count T, 1 <= T <= MAX_TOKENS (T = 0, an empty batch, would build
    the layer's weights to check nothing)."""
    n = _int_at_least(v, 1)
    if n > MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_TOKENS} tokens, got {v!r}")
    return n


def seconds(v: str) -> float:
    """argparse type: a finite number of seconds > 0."""
    try:
        x = float(v)
    except ValueError:
        x = -1.0
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {v!r}")
    return x


def _prefer(items) -> dict:
    """{'name': 'file.so'} from ['name=file.so', ...]. Raises FactorError on a bad item, or on a
    factor named twice (the last one won, silently)."""
    out = {}
    for item in items or []:
        name, sep, lib = item.partition("=")
        if not sep or not name or not lib:
            raise FactorError(f"--prefer: expected NAME=FILE (e.g. moe_fused_gemm=moe_fused_gemm.so), got {item!r}")
        if name in out:
            raise FactorError(f"--prefer: factor {name!r}: expected one FILE per factor, got two "
                              f"({name}={out[name]} and {item})")
        out[name] = lib
    return out


def _check_lock_arg(lock, folder) -> None:
    """Raise FactorError if --lock names a folder (the registry read it as a file and said
    'not readable JSON ([Errno 21] Is a directory ...)'): a lock file was expected; the message
    names the one in that folder if there is one, else how to write one for ``folder`` (--dir)."""
    if lock is None or not Path(lock).is_dir():
        return
    from .trust import LOCK_NAME
    inside = Path(lock) / LOCK_NAME
    hint = (f"; did you mean --lock {inside}?" if inside.is_file() else
            f"; `ex-engine lock --dir {folder}` writes one ({Path(folder) / LOCK_NAME})")
    raise FactorError(f"--lock {lock}: is a folder; expected a lock file (the JSON {{file name: "
                      f"sha256}} written by `ex-engine lock`){hint}")


def _registry(args, verify: bool = False):
    """The registry of list-factors, verify and run moe, from their common options. Raises
    FactorError for options that mean nothing without another: --lock-warn without --lock,
    --probe-timeout without probing (--no-probe; run moe: no --probe)."""
    from .registry import FactorRegistry
    if args.lock_warn and not args.lock:
        raise FactorError("--lock-warn: expected together with --lock FILE (it says what to do "
                          "with a library the lock does not match), got no --lock")
    if args.probe_timeout is not None and not args.probe:   # it was ignored without a word
        raise FactorError("--probe-timeout: expected together with --probe (it limits the probe's "
                          "child process), got " + ("no --probe" if args.command == "run" else "--no-probe"))
    _check_lock_arg(args.lock, args.dir)
    timeout = {} if args.probe_timeout is None else {"probe_timeout": args.probe_timeout}
    # the registry's load warnings (lock_mode=warn, a library shared with another registry) are
    # also its notes, which every command prints: print each once
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reg = FactorRegistry.load(args.dir, hardware=args.hardware, prefer=_prefer(args.prefer),
                                  lock=args.lock, lock_mode="warn" if args.lock_warn else "refuse",
                                  probe="subprocess" if args.probe else None,
                                  verify=verify, **timeout)
    for w in caught:
        detail = str(w.message).split(": ", 1)[-1]
        if not any(detail in n for n in reg.notes):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return reg


def _print_notes(reg) -> None:
    """The registry's load notes (no GPU, a --prefer that names no ready plugin, a malformed
    manifest or tuning file), one 'note:' line each on stdout."""
    for note in ([reg.no_gpu_note] if reg.no_gpu_note else []) + reg.notes:
        print(f"note: {note}")


def _note_refused(reg) -> list:
    """A 'note: FILE refused: REASON' line on stderr for each library the registry rejected,
    as list-factors' rows say; returns those refused for a reason other than this GPU
    (Plugin.broken), which `verify --strict` counts as not verified."""
    from .registry import _printable
    for p in reg.plugins:
        if p.status == "rejected":
            print(f"note: {_printable(p.path.name)} refused: {_printable(p.reason)}", file=sys.stderr)
    return [p for p in reg.plugins if p.broken]


def _none_ready(reg, folder) -> int:
    """list-factors' exit status: 0 if a plugin is ready, else 1 with a line on stderr saying so
    (a script checking a folder learns that nothing in it will serve a call)."""
    if any(p.status == "ready" for p in reg.plugins):
        return 0
    sys.stdout.flush()
    what = ("no *.so in the folder" if not reg.plugins else "its only library rejected"
            if len(reg.plugins) == 1 else f"all {len(reg.plugins)} libraries rejected")
    print(f"ex-engine list-factors: no plugin is ready in {folder} ({what}): exit status 1",
          file=sys.stderr)
    return 1


def _not_detected(reg) -> str:
    """What the first line of list-factors and verify says of a registry's hardware that is a
    profile, not a live GPU ('profile h200' alone read as if an H200 had been detected): no
    GPU seen, so the default profile; or the profile of --hardware."""
    if reg.no_gpu_note:
        return f"no GPU here: {reg.hardware.source}"
    return f"{reg.hardware.source} from --hardware, not a detected GPU"


def cmd_list_factors(args) -> int:
    reg = _registry(args)
    if args.json:
        print(json.dumps({"hardware": reg.hardware.as_dict(), "note": reg.no_gpu_note,
                          "tuning_file": reg.tuning.in_use, "notes": reg.notes,
                          "plugins": [p.as_dict() for p in reg.plugins]}, indent=2))
        return _none_ready(reg, args.dir)
    hw = reg.hardware
    if hw.live:
        print(f"hardware: {hw.name} (sm_{hw.cc_major}{hw.cc_minor}, {hw.multiprocessor_count} SMs, "
              f"warp {hw.warp_size}; {hw.source})")
    else:
        print(f"hardware: {hw.name} ({_not_detected(reg)}; sm_{hw.cc_major}{hw.cc_minor}, "
              f"{hw.multiprocessor_count} SMs, warp {hw.warp_size})")
    if reg.tuning.in_use:
        print(f"tuning: {reg.tuning.in_use}")
    elif reg.tuning.path:   # read, but check() set every table of it aside (the notes say why)
        print(f"tuning: {reg.tuning.path} (for {hw.name}): none of its tables is used (see the "
              "notes): tuned dims take the kernels' defaults")
    elif reg.tuning.folder_problem:   # not listed at all: "no file" would be untrue
        print(f"tuning: the folder {reg.tuning.folder} cannot be read (see the note): tuned dims take "
              "the kernels' defaults")
    elif reg.tuning.set_aside:   # the file is there: it said "no file" above the note saying why
        print(f"tuning: {', '.join(reg.tuning.set_aside)} (for {hw.name}) set aside as malformed (see "
              "the note): tuned dims take the kernels' defaults")
    else:
        skipped = [f"{len(files)} {word} file(s)" for files, word in
                   ((reg.tuning.unreadable, "unreadable"), (reg.tuning.malformed, "malformed")) if files]
        print(f"tuning: no file for {hw.name} ({hw.multiprocessor_count} SMs) in {reg.tuning.folder}"
              + (f" ({' and '.join(skipped)} set aside, see the notes)" if skipped else "")
              + ": tuned dims take the kernels' defaults")
    _print_notes(reg)
    if not reg.plugins:
        print(f"no plugins (*.so) in {args.dir}; build them with `make` or `ex-engine build`")
        return _none_ready(reg, args.dir)
    from .registry import _printable   # one row per plugin: no cell may hold a newline
    rows = [("id", "name", "version", "status", "tuning (tpb/ipt/vec/smem/warps/stages)", "file", "reason")]
    for p in reg.plugins:
        t = p.tuning
        tun = "/".join(str(t[k]) for k in ("threads_per_block", "items_per_thread", "vec_size",
                                            "shared_mem_bytes", "num_warps", "num_stages")) if t else "-"
        rows.append(tuple(_printable(c) for c in (str(p.factor_id) if p.name else "-", p.name or "?",
                                                  p.version or "-", p.status, tun, p.path.name, p.reason)))
    widths = [max(_width(r[i]) for r in rows) for i in range(6)]
    for r in rows:
        print("  ".join(c + " " * (w - _width(c)) for c, w in zip(r[:6], widths))
              + ("  " + r[6] if r[6] else ""))
    if args.why:
        for p in reg.plugins:
            print(f"\n{_printable(p.path.name)}: {p.status}" + (f" ({p.reason})" if p.status == "shadowed" else ""))
            if p.description:   # the library's one line about itself (ex_factor_t.description)
                print(f"  description: {p.description}")
            print(f"  sha256 {p.sha256 or '-'}")
            for c in p.checks:
                print(f"  [{c.label}] {c.name}: {c.detail}" if c.detail else f"  [{c.label}] {c.name}")
    return _none_ready(reg, args.dir)


def cmd_hardware(args) -> int:
    hw = resolve(args.profile) if args.profile else Hardware.detect()
    if hw is None:
        # with --json, stdout holds the JSON alone (null: no GPU); the remark goes to stderr
        note = sys.stderr if args.json else sys.stdout
        profiles = list_profiles()
        from . import hardware as _hw
        why = _hw.no_device_reason or "no GPU visible to CuPy"
        if profiles:
            print(f"{why}; profiles available: " + ", ".join(profiles), file=note)
            print(f"show one with: ex-engine hardware --profile {profiles[0]}", file=note)
        else:
            print(f"{why}; and no hardware profiles: {profiles_problem()}", file=note)
        if args.json:
            print(json.dumps(None))
        return 0
    if args.json:
        print(json.dumps(hw.as_dict(), indent=2))
        return 0
    for k, v in hw.as_dict().items():
        print(f"  {k:<32} {v}")
    return 0


def _progress(line: str) -> None:
    """A progress line on stderr (stdout flushed first, so that the two keep their order on a
    terminal): before a step a user would otherwise wait on in silence."""
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)


def _width(text: str) -> int:
    """Columns ``text`` takes in a terminal: 0 for a combining mark ('u' + U+0308 is one
    column), 2 for an East Asian wide or full-width character, else 1 (a table padded by len()
    misaligned on a library named with such characters)."""
    return sum(0 if unicodedata.combining(c) or unicodedata.category(c) in ("Mn", "Me")
               else 2 if unicodedata.east_asian_width(c) in ("W", "F") else 1 for c in text)


def cmd_run_moe(args) -> int:
    from .moe_layer import load_models, run_moe
    # the model list and --model before any plugin loads (FactorError: main's one-line error)
    known = sorted(load_models())
    if args.model == "all":
        models = known
    elif args.model in known:
        models = [args.model]
    else:   # 'all' is a valid --model too (the error listed the models alone)
        near = [m for m in ["all"] + known if m.lower() == args.model.lower()]
        raise FactorError(f"model '{args.model}': unknown; expected one of {known} or 'all' (every "
                          "model)" + (f"; did you mean '{near[0]}'? (names are case-sensitive)" if near else ""))
    reg = _registry(args)
    sys.stdout.flush()
    for note in reg.notes:   # e.g. a --prefer that names no ready plugin (it was silent)
        print(f"note: {note}", file=sys.stderr)
    _note_refused(reg)   # (--probe's crash or hang in ex_get_factor was refused without a word)
    for name in ("topk_softmax", "moe_fused_gemm"):   # (it printed PASS without a word)
        if reg.get(name) is None:
            reg.manifest(name)   # no manifest, no fallback either: FactorNotFoundError, before any work
            print(f"note: no ready plugin for {name} in {args.dir or 'factors/'}"
                  + (f" (none of the {len(reg.plugins)} *.so there is a ready one for it; "
                     "`ex-engine list-factors --why` says why)" if reg.plugins else " (no *.so there)")
                  + ": the Python fallback serves it", file=sys.stderr)
    ok = True
    runs = [(m, T) for m in models for T in args.tokens]
    # a model's weights are built once and reused for each of its T (they were built per T);
    # run_moe empties `layers` before building the next model's: one model's weights at a time
    layers: dict = {}
    for i, (m, T) in enumerate(runs):
        if len(runs) > 1:
            print(f"[{i + 1}/{len(runs)}] ", end="")
        try:
            res = run_moe(m, T, dtype=args.dtype, seed=args.seed, repeat=args.repeat, registry=reg,
                          progress=_progress, layers=layers)
        except MemoryError as exc:   # NumPy's and CuPy's out-of-memory errors are MemoryErrors
            print(f"ex-engine run moe: --tokens {T}: the {m} layer's arrays do not fit in memory "
                  f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'})",
                  file=sys.stderr)
            return 2
        ok &= res["ok"]
    print("stats:", json.dumps(reg.stats()))
    return 0 if ok else 1


def cmd_verify(args) -> int:
    from . import verify
    if args.in_process and args.timeout is not None:
        raise FactorError("--timeout: applies to the child processes; not with --in-process")
    reg = _registry(args)
    hw = reg.hardware
    print(f"hardware: {hw.name} ({hw.source if hw.live else _not_detected(reg)})")
    _print_notes(reg)
    sys.stdout.flush()
    refused = _note_refused(reg)   # (verify named none of them: --strict passed on a folder
    if not hw.live:                # holding a truncated library beside a good one)
        print("note: no live GPU: device factors cannot be run here; checking host factors only")
    chosen = sorted((reg.get(n) for n in {p.name for p in reg.plugins if reg.get(p.name)}),
                    key=lambda p: p.name)
    if not chosen:
        print(f"no ready plugins in {args.dir}: nothing verified (list-factors --why says why)", file=sys.stderr)
        return 1
    results = []
    # what a kernel starts with setsid() is handed to this command and killed with its child;
    # only as the command itself (main() reading sys.argv): a program calling main([...]) keeps
    # its own children and setting
    adopted = verify.adopt_orphans() if getattr(args, "command_process", False) and not args.in_process else None
    # SIGTERM (timeout(1), kill) ends this command through an exception, so each child's session
    # and report file are cleaned up as on Ctrl-C (not SystemExit: verify turns a fallback's
    # SystemExit into that case's FAIL)
    main_thread = threading.current_thread() is threading.main_thread()   # signal.signal needs it
    old_term = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main_thread else None
    try:
        for p in chosen:
            why = verify.cannot_run(reg, p)
            print(f"skipping {p.name} ({p.path.name}): {why}" if why else
                  f"verifying {p.name} ({p.path.name}) ...", flush=True)
            results += verify.verify_plugin(reg, p, seed=args.seed, isolate=not args.in_process,
                                            timeout=args.timeout or CHILD_TIMEOUT_S)
    finally:
        verify.stop_adopting(adopted)
        if main_thread:
            signal.signal(signal.SIGTERM, old_term)
    print(verify.format_table(results))
    n = {s: sum(r.status == s for r in results) for s in ("pass", "FAIL", "declined", "skipped")}
    print(f"verify: {n['pass']} passed, {n['FAIL']} failed, {n['declined']} declined by the plugin "
          f"(the Python fallback serves those), {n['skipped']} factor(s) skipped")
    print("stats:", json.dumps(reg.stats()))
    # a factor whose plugin declined every case: none of its kernel's results was compared (a
    # kernel that always says EX_FALLBACK passed, exit 0): a warning, under --strict a failure
    by_factor: dict = {}
    for r in results:
        by_factor.setdefault(r.factor, []).append(r.status)
    all_declined = sorted(f for f, st in by_factor.items() if st and all(s == "declined" for s in st))
    sys.stdout.flush()
    for f in all_declined:
        k = len(by_factor[f])
        print(f"{'verify --strict: error' if args.strict else 'warning'}: {f}: its plugin declined every "
              f"case ({k} of {k} returned EX_FALLBACK), so none of its results was checked; the Python "
              "fallback serves these shapes"
              + ("" if args.strict else " (verify --strict fails on this)"), file=sys.stderr)
    if n["FAIL"]:
        return 1
    if refused:
        print(f"{'verify --strict: error' if args.strict else 'warning'}: "
              f"{len(refused)} librar{'y' if len(refused) == 1 else 'ies'} refused at load, not verified: "
              f"{', '.join(p.path.name for p in refused)} (the notes above say why"
              + (")" if args.strict else "; verify --strict fails on this)"), file=sys.stderr)
    if args.strict and (n["skipped"] or all_declined or refused):
        what = [f"{n['skipped']} factor(s) skipped, not run"] if n["skipped"] else []
        what += [f"{len(all_declined)} factor(s) whose plugin declined every case"] if all_declined else []
        what += [f"{len(refused)} library(ies) refused at load"] if refused else []
        print(f"verify --strict: {' and '.join(what)} (exit status 3)", file=sys.stderr)
        return 3
    return 0


class Terminated(BaseException):
    """SIGTERM arrived during `ex-engine verify` (main() exits with status 143)."""


def _exit_on_sigterm(signum, frame):
    # the first SIGTERM ends the command through its cleanup; later ones are ignored: a second
    # one a millisecond later, raised again on the way into the cleanup (before _kill_session
    # held the handlers), cut it short and left the child running (seen under CI's load)
    signal.signal(signal.SIGTERM, _ignore_signal)
    raise Terminated()


def _ignore_signal(signum, frame):
    """SIGTERM while the command already ends through Terminated."""


LOCK_MAX_BYTES = _paths.TEXT_FILE_LIMIT   # a lock file larger than this is not one `ex-engine lock` wrote
                                         # (and read_lock would not read it)


def _left_out_of_lock(folder, locked) -> list:
    """(name, why) of each entry of ``folder`` named *.so that is not in ``locked`` (the digests
    trust.write_lock wrote: it locks regular files only; the registry rejects the rest)."""
    out = []
    for p in sorted(Path(folder).glob("*.so")):
        if p.name in locked:
            continue
        if not p.exists():   # a link to nothing (or a loop of links)
            try:
                why = f"a dangling symbolic link (to {p.readlink()})"
            except OSError:
                why = "a dangling symbolic link"
        elif p.is_file():   # (trust.lock_digests left it out for its size)
            why = (f"{_paths.bytes_text(p.stat().st_size)}, over the limit of "
                   f"{_paths.bytes_text(LIBRARY_LIMIT)} for a library")
        else:
            mode = p.stat().st_mode
            kinds = ((stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                     (stat.S_ISCHR, "device"), (stat.S_ISBLK, "device"))
            kind = next((k for test, k in kinds if test(mode)), None)
            why = ("not a regular file" if kind is None else
                   f"a link to a {kind}" if p.is_symlink() else f"a {kind}")
        out.append((p.name, why))
    return out


def _check_lock_output(folder, output) -> None:
    """Raise FactorError if the lock file would be written over something it must not be: a
    name ending in .so (the registry reads such a file as a library: the lock would destroy the
    library and record the hash of what it destroyed), one of the libraries being locked (by
    any name: a link to one), a folder or another non-regular file, or an existing file that is
    not a lock file (JSON {file name: sha256}). An existing lock file, or an empty file, is
    replaced."""
    from .trust import LOCK_NAME, read_lock
    out = Path(output) if output else Path(folder) / LOCK_NAME
    where = f"--output {output}" if output else f"the default lock file {out}"
    for lib in Path(folder).glob("*.so") if out.exists() and Path(folder).is_dir() else ():
        try:
            same = lib.is_file() and out.samefile(lib)
        except OSError:
            same = False
        if same:
            raise FactorError(f"lock: {where}: is the library {lib} (one of those being locked); "
                              "expected a lock file name: writing the lock there would destroy it")
    if out.name.endswith(".so"):
        raise FactorError(f"lock: {where}: expected a lock file name, got a library's (*.so): the "
                          "registry reads every *.so as a plugin, and the file may be one (leave "
                          f"--output out for <dir>/{LOCK_NAME})")
    if not (out.exists() or out.is_symlink()):
        return
    if not out.exists():   # a link to nothing: writing would create its target, somewhere else
        raise FactorError(f"lock: {where}: is a symbolic link to nothing that exists; expected a "
                          "new file or an existing lock file")
    if out.is_dir():
        raise FactorError(f"lock: {where}: is a folder; expected a file name (e.g. {out / LOCK_NAME})")
    if not out.is_file():
        raise FactorError(f"lock: {where}: is not a regular file (a FIFO, a socket or a device); "
                          "expected a new file or an existing lock file")
    size = out.stat().st_size
    if size == 0:
        return
    if size > LOCK_MAX_BYTES:
        why = f"{size} bytes, more than a lock file holds"
    else:
        try:
            read_lock(out)
            return
        except FactorError as exc:
            why = str(exc).removeprefix(f"lock file {out}: ")
    raise FactorError(f"lock: {where}: exists and is not a lock file ({why}); expected a new file "
                      "or a lock file `ex-engine lock` wrote, which it replaces: remove that file "
                      "or give another --output")


def cmd_lock(args) -> int:
    from .trust import write_lock
    to_stdout = args.output == "-"   # the JSON on stdout; the lines about it on stderr
    if to_stdout and sys.stdout is None:   # (write_lock read None as "the default file")
        raise FactorError("lock: --output -: expected a standard output to write the lock to, got none "
                          "(it is closed); give a file name")
    if to_stdout:   # (it wrote a file named '-')
        path, digests = write_lock(args.dir, sys.stdout)
        sys.stdout.flush()
        say = sys.stderr
    else:
        _check_lock_output(args.dir, args.output)
        # write_lock names the file it cannot write (a folder that does not exist, a full disk)
        path, digests = write_lock(args.dir, args.output)
        say = sys.stdout
    from .registry import _printable   # one line per library, as list-factors: a file name
    for name, digest in digests.items():   # may hold a newline or an escape sequence
        print(f"  {digest}  {_printable(name)}", file=say)
    print(f"wrote {'the lock to stdout' if to_stdout else _printable(str(path))} ({len(digests)} "
          f"librar{'y' if len(digests) == 1 else 'ies'}; JSON {{file name: sha256}})", file=say)
    for name, why in _left_out_of_lock(args.dir, digests):   # (it left them out without a word)
        rule = ("a lock lists libraries up to that size only" if why.endswith("for a library") else
                "a lock lists regular files only")
        print(f"note: {_printable(name)} left out: {_printable(why)}; {rule} (the registry refuses "
              "anything else)", file=say)
    if not digests:
        print(f"note: no *.so in {_printable(str(args.dir))}: every library will be refused under "
              "this lock", file=say)
    return 0


def cmd_build(args) -> int:
    if not (_paths.ROOT / "Makefile").is_file():
        print(f"ex-engine build: no Makefile in {_paths.ROOT}: "
              f"{_paths.not_a_checkout(building=True)}",
              file=sys.stderr)
        return 2
    # NAME...: one make target per factor, factors/<name>.so (a file stem of factors/*.cu, *.c
    # or *.cpp, as the Makefile builds them); a bare `build` is make's `all`
    folder = _paths.ROOT / "factors"
    known = sorted({p.stem for ext in ("cu", "c", "cpp") for p in folder.glob(f"*.{ext}")})
    targets = []
    for name in args.names:
        stem = name[:-3] if name.endswith(".so") else name
        if stem not in known:
            print(f"ex-engine build: no factor source for '{name}' in {folder}: known are "
                  f"{', '.join(known) or 'none'} (the file stems of factors/*.cu, *.c and *.cpp)",
                  file=sys.stderr)
            return 2
        targets.append(f"factors/{stem}.so")
    # PYTHON: the Makefile finds CUTLASS's headers through this interpreter (any venv's name)
    cmd = ["make", "--no-print-directory", "-C", str(_paths.ROOT), f"-j{args.jobs}", f"PYTHON={sys.executable}"]
    if args.archs is not None:
        # other targets: the Makefile's flag stamps rebuild each library whose own flags change
        # (-B rebuilt every library named, or all of them, the CUTLASS plugin included, whose
        # targets ARCHS does not set)
        cmd += [f"ARCHS={args.archs}"]
    cmd += targets

    def built():  # the libraries' modification times: none changed means make had nothing to do
        return {p.name: p.stat().st_mtime_ns for p in folder.glob("*.so")}

    print("running:", " ".join(cmd), flush=True)
    try:
        before = built()
        rc = _run_make(cmd)
    except FileNotFoundError:
        print("ex-engine build: needs `make` (and nvcc, CUDA 12.4+) on PATH; found no make", file=sys.stderr)
        return 2
    if rc == 0 and before and built() == before:  # make itself says nothing then
        print(f"ex-engine build: {', '.join(targets) or 'every factor'} up to date", flush=True)
    return rc


def _run_make(cmd: list) -> int:
    """Run make in a process group of its own; Ctrl-C (KeyboardInterrupt) or SIGTERM to this
    command is passed to the whole group, and the command waits for make, which stops its
    compilers and deletes the targets it had begun, before it ends (raising KeyboardInterrupt
    or Terminated: main's exit statuses 130 and 143). subprocess.call killed make alone with
    SIGKILL on an interrupt, and ignored SIGTERM: nvcc, cicc and cudafe++ went on, reparented
    to init, writing factors/*.so (a new user's trial, session 35). A second interrupt while
    make stops kills the group."""
    proc = subprocess.Popen(cmd, start_new_session=True)
    main_thread = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main_thread else None
    try:
        return proc.wait()
    except (KeyboardInterrupt, Terminated):
        sig = signal.SIGTERM if sys.exc_info()[0] is Terminated else signal.SIGINT
        try:
            os.killpg(proc.pid, sig)
            proc.wait()
        except (KeyboardInterrupt, Terminated):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
        raise
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old_term)


def _profiles_help() -> str:
    """The profile names for --help, or why there are none (escaped for argparse's %)."""
    text = ", ".join(list_profiles()) or f"none: {profiles_problem()}"
    return text.replace("%", "%%")


def _version() -> str:
    """'ex-engine <package version> (plugin ABI <major>.<minor>)': --version's line."""
    from . import __version__, abi
    return f"ex-engine {__version__} (plugin ABI {abi.ABI_VERSION_MAJOR}.{abi.ABI_VERSION_MINOR})"


def build_parser() -> argparse.ArgumentParser:
    profiles = _profiles_help()
    # --version on a usage line of its own, as it takes no command (in the first one it read as
    # an option of every command)
    ap = argparse.ArgumentParser(prog="ex-engine", description="Load, check and run ex_engine factor plugins.",
                                 usage="%(prog)s [-h] COMMAND ...\n       %(prog)s --version",
                                 epilog="Exit status: 0 success; 1 a check failed (list-factors: no plugin is "
                                        "ready); 2 bad usage or an error (an output that cannot be written "
                                        "among them); 3 verify --strict skipped a factor, its plugin "
                                        "declined every case or a library was refused at load; 130 Ctrl-C; 141 the reader of stdout left "
                                        "early (| head); 143 SIGTERM.")
    ap.add_argument("--version", action="version", version=_version(),
                    help="print the package version and the plugin ABI version it loads, and exit")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", prog="ex-engine")   # (not the usage)

    def common(p, probe: bool):
        p.add_argument("--dir", type=nonempty, default=str(_paths.factors_dir()),
                       help="folder of plugin libraries (default: %(default)s)")
        p.add_argument("--hardware", type=nonempty, default=None, metavar="PROFILE",
                       help=f"check against a hardware profile ({profiles}) "
                            "instead of the live GPU")
        p.add_argument("--lock", type=nonempty, default=None, metavar="FILE",
                       help="refuse libraries whose SHA-256 differs from this lock file (ex-engine lock)")
        p.add_argument("--lock-warn", action="store_true",
                       help="with --lock: load mismatching libraries, with a warning check")
        if probe:   # the diagnostic commands: a library that crashes or hangs is a rejected row
            p.add_argument("--probe", action=argparse.BooleanOptionalAction, default=True,
                           help="open each library in a child process first and refuse one that "
                                "crashes or hangs (default); --no-probe opens them in this process "
                                "(faster: loading the shipped factors takes about 0.5 s instead of 2 s on "
                                "2 cores without a GPU (0.8 s instead of 3 s with PyTorch installed), "
                                "1.0 s instead of 3.6 s on an H200, as measured with "
                                "list-factors; but such a library ends the command: a crash with a fault "
                                "traceback, a library's exit() with its own status, even 0, and nothing printed)")
        else:       # run: in-process for speed
            p.add_argument("--probe", action="store_true",
                           help="open each library in a child process first; refuse one that crashes "
                                "or hangs, naming it in a 'note: FILE refused: REASON' line on "
                                "stderr, as every refused library is (without it such a library "
                                "ends the command with a fault traceback)")
        p.add_argument("--probe-timeout", type=seconds, default=None, metavar="S",
                       help="seconds a probed library may take to open and answer ex_get_factor "
                            "before it is refused as hanging (default: 10; a slow host that starts "
                            "CUDA in each child may need more); "
                            + ("an error with --no-probe" if probe else "only with --probe"))
        p.add_argument("--prefer", action="append", default=[], metavar="NAME=FILE",
                       help="this library wins for factor NAME whatever its version or priority (repeatable)")

    p = sub.add_parser("list-factors", help="every plugin found: id, name, version, tuning, status and reason",
                       description="Load every plugin in the folder, check it against the hardware, "
                                   "and print what loaded, what was rejected and why. Exit status 0 "
                                   "if at least one plugin is ready, 1 if none is (an empty folder, "
                                   "or every library rejected), 2 on bad usage or an error (with --no-probe, a "
                                   "library that ends the process sets it: see --no-probe).")
    common(p, probe=True)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--why", action="store_true", help="also print the checks each plugin went through, up to its "
                                                          "first failure (and its description)")
    p.set_defaults(fn=cmd_list_factors, command_parser=p)

    p = sub.add_parser("hardware", help="what the runtime sees: the live GPU or a profile",
                       description="Print the ex_hardware_t the runtime fills from the live GPU or a profile. "
                                   "With no GPU visible and no --profile it says so and lists the profiles "
                                   "(exit status 0: an answer, not an error).")
    p.add_argument("--profile", type=nonempty, default=None, help=f"a profile name ({profiles}) or YAML path")
    p.add_argument("--json", action="store_true", help="print JSON (null where no GPU is visible and no "
                                                       "--profile is given; the reason then goes to stderr)")
    p.set_defaults(fn=cmd_hardware, command_parser=p)

    p = sub.add_parser("run", help="run a job through the registry (see: ex-engine run moe --help)",
                       description="Run a job through the registry.")
    rsub = p.add_subparsers(dest="job", metavar="JOB")
    q = rsub.add_parser("moe", help="an MoE layer of a public model: router + routed experts, checked and timed",
                        description="Build a model's MoE layer (router + routed experts, random weights "
                                    "at the model's scale), run it through the registry, check it "
                                    "against the reference, and print which path served each factor. "
                                    "Libraries are opened in this process; if one crashes or hangs "
                                    "there, --probe finds and refuses it.")
    common(q, probe=False)
    from .moe_layer import models_help
    q.add_argument("--model", default="qwen3-30b-a3b",
                   help=f"a model of manifests/moe_models.yaml ({models_help(all_ok=True)}; 'all': "
                        "every one) (default: %(default)s)")
    q.add_argument("--tokens", type=tokens_arg, nargs="+", default=[64], metavar="T",
                   help=f"token counts T, 1..{MAX_TOKENS} (default: 64)")
    q.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16",
                   help="activation and weight dtype (default: %(default)s)")
    q.add_argument("--seed", type=token_count, default=0, metavar="N", help="random seed >= 0 (default: %(default)s)")
    q.add_argument("--repeat", type=positive_count, default=10, metavar="N",
                   help="timed calls per factor on a GPU (default: %(default)s)")
    q.set_defaults(fn=cmd_run_moe, command_parser=q)
    # `ex-engine run` without a job: run's usage and argparse's error line on stderr, SystemExit(2)
    # as for any usage error (it printed the whole help with no 'error:' line); bind p now: p is
    # rebound below. (Not required=True: `run --x` would then say JOB, not the unknown --x.)
    p.set_defaults(fn=lambda a, run_parser=p: run_parser.error("the following arguments are required: JOB"),
                   command_parser=p)

    p = sub.add_parser("verify", help="run every ready factor against its Python fallback on its test shapes",
                       description="Run every ready factor against its Python fallback on the test "
                                   "shapes of its manifest (each dtype of its main input, random "
                                   "inputs as the manifest's `values` say) and print a pass/fail "
                                   "table and the call counters. Each plugin's checks run in a "
                                   "child process (a kernel that crashes or hangs is a FAIL row). "
                                   "Without a GPU only host factors "
                                   "run. Exit status 1 if a case failed (or no plugin was ready to verify); with --strict, 3 if "
                                   "a factor was skipped (e.g. no GPU), its plugin declined every "
                                   "case (EX_FALLBACK: nothing of its kernel was compared) or a library "
                                   "in the folder was refused at load (see --strict), so that a "
                                   "check that checked nothing does not pass; without --strict the "
                                   "latter two are warnings on stderr and the exit status stays 0.")
    common(p, probe=True)
    p.add_argument("--seed", type=token_count, default=0, metavar="N", help="random seed >= 0 (default: %(default)s)")
    p.add_argument("--strict", action="store_true",
                   help="exit status 3 when any ready factor was skipped (a device factor without "
                        "a live GPU) or its plugin declined every case, or a library in the folder "
                        "was refused at load for a reason other than this GPU (no code for its "
                        "architecture, or its ex_get_factor declining the hardware, are notes "
                        "only): every one must have been run and compared")
    p.add_argument("--in-process", action="store_true",
                   help="run the checks in this process (default: each plugin's in a child process, "
                        "so that a kernel that crashes, exits or hangs is a FAIL row and the others "
                        "still run); a kernel that crashes or calls exit() then ends the command, "
                        "with no table and the library's exit status")
    p.add_argument("--timeout", type=seconds, default=None, metavar="S",
                   help=f"seconds for one plugin's checks in its child process, its start-up (about a "
                        f"second) included (default: {CHILD_TIMEOUT_S:g})")
    p.set_defaults(fn=cmd_verify, command_parser=p)

    p = sub.add_parser("lock", help="write the SHA-256 of every plugin library to a lock file",
                       description="Write a lock file, JSON {file name: sha256}, of every *.so file in "
                                   "the folder (an entry named *.so that is not a regular file, such as "
                                   "a folder or a link to nothing, is left out, with a 'note:' line "
                                   "saying why). FactorRegistry.load(lock=...) and `list-factors --lock` "
                                   "then refuse any library that differs or is not listed, before "
                                   "opening it. It prints one line per library, a name's control "
                                   "characters escaped as list-factors does ('\\n'); the file keeps "
                                   "the names as they are.")
    p.add_argument("--dir", type=nonempty, default=str(_paths.factors_dir()),
                   help="folder of plugin libraries (default: %(default)s)")
    p.add_argument("--output", type=nonempty, default=None, metavar="FILE",
                   help="lock file to write (default: <dir>/ex_engine.lock); not a *.so name, and "
                        "an existing file only if it is a lock file (or empty), which is replaced "
                        "atomically (a new file renamed over it); '-': write the JSON to stdout, "
                        "and the lines about it to stderr (a file named '-': ./-)")
    p.set_defaults(fn=cmd_lock, command_parser=p)

    p = sub.add_parser("build", help="compile factors/*.cu (nvcc) and host factors' *.c, *.cpp into .so files (runs make)",
                       description="Run `make` in the project root: one factors/<name>.so per factors/<name>.cu "
                                   "(nvcc), or per factors/<name>.c / .cpp (a host factor: the host "
                                   "compiler). With NAMEs, only those factors (make factors/<name>.so ...).")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="factors to build, by file stem (e.g. topk_softmax; moe_fused_gemm_sm90 is a "
                        "factor file of its own); default: every one")
    p.add_argument("--archs", type=nonempty, default=None, metavar="FLAGS",
                   help="nvcc -gencode flags for the portable plugins, written with '=' because they start "
                        "with '-': --archs='-gencode=arch=compute_80,code=sm_80' (default: the Makefile's "
                        "sm_90a + sm_80 + PTX); rebuilds every plugin built (the NAMEs given, or all)")
    p.add_argument("-j", "--jobs", type=job_count, default=2, metavar="N",
                   help=f"parallel nvcc jobs, 1..{MAX_JOBS} (default: %(default)s)")
    p.set_defaults(fn=cmd_build, command_parser=p)
    return ap


def _output_lost(exc: OSError, command: bool = True) -> int:
    """After an error writing stdout: one line on stderr, status 2 (_scripts.output_lost)."""
    return output_lost(exc, "ex-engine", command)


def _os_error(exc: OSError) -> str:
    """An OSError a command did not turn into a FactorError, in one line: the file(s) it names
    and the system's reason ('/srv/locks/ex_engine.lock: Permission denied')."""
    why = exc.strerror or str(exc) or "no detail"
    from .errors import printable   # (a file name may hold a newline: one line kept)
    names = [printable(os.fsdecode(n) if isinstance(n, (bytes, os.PathLike)) else str(n))
             for n in (exc.filename, exc.filename2) if n is not None]
    if not names:
        return f"{why} ({type(exc).__name__})"
    return f"{' -> '.join(names)}: {why}"


def main(argv=None) -> int:
    """Run the ex-engine command line; the entry point of ``ex-engine`` and ``python -m ex_engine``.

    argv: the arguments after the program name, a list of str (e.g. ``["list-factors",
    "--json"]``), or None for ``sys.argv[1:]``: the command itself, which also makes its stdio
    tolerant of text the locale cannot encode and enables faulthandler (a program passing a
    list keeps its own stdio).

    Returns the exit status, an int: 0 success; 1 a check failed; 2 an error (a FactorError or
    an OSError, its message on stderr as 'ex-engine: error: ...', or an output that cannot be
    written); 3 verify --strict's checks left something unchecked; 130 Ctrl-C; 141 the reader of
    stdout left early; 143 SIGTERM (the epilog of ``ex-engine --help``). As argparse does,
    --help and --version raise SystemExit(0) after printing, and a usage error (an unknown
    option, a bad value, a missing argument) raises SystemExit(2) after printing the usage and
    an 'error:' line on stderr; where stdout cannot be written then, it returns 2 or 141
    instead."""
    if argv is None and sys.stderr is None:
        # the command started with stderr closed (2>&-): Python sets sys.stderr to None, so
        # faulthandler.enable() raised RuntimeError (exit 1, nothing printed) and print(...,
        # file=sys.stderr) would write to stdout; its lines go to /dev/null instead
        sys.stderr = open(os.devnull, "w", encoding="utf-8")
    if argv is None:   # the command itself: 'µs' under an ASCII locale is escaped, not a traceback
        tolerant_stdio()
    if sys.stdout is None:   # no stdout at all (>&-, a daemon's): print() writes nothing
        return _main(argv, None)
    out = sys.stdout = StdoutGuard(sys.stdout)   # remembers an error writing stdout
    try:
        return _main(argv, out)
    finally:
        if sys.stdout is out:
            sys.stdout = out.stream


def _main(argv, out) -> int:
    command = argv is None   # the ex-engine command (or python -m ex_engine) itself
    lost = lambda: out.lost if out is not None else None   # an error writing stdout, if any
    try:
        ap = build_parser()
        try:
            args, extra = ap.parse_known_args(argv)
            if extra:   # reported with the usage of the (sub)command they were given to, not the top's
                getattr(args, "command_parser", ap).error(f"unrecognized arguments: {' '.join(extra)}")
        except SystemExit:   # --help, --version (their text on stdout) or a usage error
            if out is not None:
                try:
                    out.flush()
                except BrokenPipeError:   # `ex-engine --help | head -1`
                    return _reader_left()
                except OSError:   # recorded in out.lost
                    pass
                if out.lost is not None:
                    return _output_lost(out.lost, command)
            raise
        args.command_process = command
        if out is None and command and args.fn in (cmd_list_factors, cmd_hardware):
            # their output is what they are for (list-factors > /dev/full was status 2 already)
            print("ex-engine: error: cannot write the output: standard output is closed",
                  file=sys.stderr)
            return 2
        if args.command_process and not faulthandler.is_enabled():
            # a library that crashes in this process (run moe, or --no-probe) prints a traceback of
            # where, not only the shell's "Segmentation fault"
            faulthandler.enable()
        if not getattr(args, "fn", None):
            ap.print_help()
            code = 2
        else:
            code = args.fn(args)
        if out is not None:
            out.flush()   # inside the try: an output that cannot be written is an error too
    except FactorError as exc:
        print(f"ex-engine: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:        # Ctrl-C: one line, not a traceback
        print("ex-engine: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("ex-engine: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    except BrokenPipeError:          # `ex-engine list-factors | head`: the reader left early
        return _reader_left()
    except OSError as exc:           # stdout that cannot be written (a full disk), or a file a
        if lost() is not None:       # command reads (a folder it cannot enter)
            return _output_lost(lost(), command)
        print(f"ex-engine: error: {_os_error(exc)}", file=sys.stderr)
        return 2
    if lost() is not None:           # an error writing stdout that code swallowed
        return _output_lost(lost(), command)
    return code


if __name__ == "__main__":
    sys.exit(main())

"""Helpers of the command-line scripts (benchmarks/, scripts/, examples/) that need nothing but
the standard library, so that a script can use them where numpy, CuPy or cffi are missing:
table_moe.py runs, and --help answers, on a bare Python (/usr/bin/python3 without numpy).

Where a script imports the package anyway, it imports these as ``ex_engine._scripts`` (cli.py and
moe_layer.py re-export the ones they used to define). A script that must not import the package
(ex_engine/__init__.py pulls numpy; the GPU self-tests run before cffi is installed) loads this
file by path: ``runpy.run_path(ROOT / "ex_engine" / "_scripts.py")`` is a dict of its names.
So this module imports nothing of ex_engine, nor anything outside the standard library at import
time; keep it that way.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help with each option's default appended ('(default: ...)'; a list as its values, an
    empty one as 'none'; None and a flag's default left out (a store_false flag's True read as
    on by default), and a help text that names its default itself kept as it is) and the
    description printed as written (a script's docstring: usage lines, paragraphs)."""

    def _get_help_string(self, action):
        d, text = action.default, action.help or ""
        if d is None or d is False or d is argparse.SUPPRESS or action.nargs == 0 or "default" in text:
            return text
        if isinstance(d, (list, tuple)) and "%" not in text:   # an empty list: none, not ''
            return f"{text} (default: {' '.join(map(str, d)) or 'none'})"
        return super()._get_help_string(action)


def _escape_unencodable(exc):
    """The error handler tolerant_stdio gives a surrogateescape stream: a lone surrogate (a file
    name's undecodable byte) is written back as that byte, as before; any other character the
    encoding lacks as a backslash escape ('\\xb5'), where it raised UnicodeEncodeError."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    c = exc.object[exc.start]
    if 0xDC80 <= ord(c) <= 0xDCFF:
        return bytes([ord(c) - 0xDC00]), exc.start + 1
    return c.encode("ascii", "backslashreplace").decode("ascii"), exc.start + 1


def tolerant_stdio() -> None:
    """Make sys.stdout and sys.stderr print any text: under an ASCII locale with Python's UTF-8
    mode off (LC_ALL=C PYTHONUTF8=0 PYTHONCOERCECLOCALE=0) printing 'µs', '×' or '≥' (a table's
    header, a --help) raised UnicodeEncodeError. Where a stream's encoding is not a UTF one and
    its errors are 'strict' or 'surrogateescape' (those that raise for such a character), a
    character it cannot encode is now written as a backslash escape ('\\xb5s'). A UTF-8 stream,
    or one whose errors were chosen otherwise (PYTHONIOENCODING=ascii:replace), is left as it is.
    The tools (benchmarks/, scripts/, examples/, the ex-engine command) call it at their entry
    point; exit_quietly_on_broken_pipe does for the scripts it runs."""
    import codecs
    codecs.register_error("ex_engine_escape", _escape_unencodable)
    for stream in (sys.stdout, sys.stderr):
        try:
            name = codecs.lookup(stream.encoding).name
        except (AttributeError, LookupError, TypeError):   # None, or not a text stream
            continue
        errors = {"strict": "backslashreplace", "surrogateescape": "ex_engine_escape"}.get(
            getattr(stream, "errors", None))
        if errors and not name.startswith("utf") and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors=errors)


# The largest token count T a tool takes (16.8 M: far beyond a layer's batch; moe_models.yaml tops
# at 16384), the `ex-engine run moe` bound and the benchmarks' (case_problems).
MAX_TOKENS = 1 << 24


def integer(v: str) -> int:
    """argparse type: an integer, its bounds checked by the tool with its other arguments (every
    problem listed at once); a word or a fraction is refused naming what came ('expected an
    integer, got 'abc''), not argparse's 'invalid int value'."""
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {v!r}") from None


def number(v: str) -> float:
    """argparse type: a number, its bounds checked by the tool as ``integer``'s (each tool's range
    check refuses nan and inf with what that argument takes: 'a finite rate > 0', '0..60000 ms');
    a word is refused naming what came."""
    try:
        return float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {v!r}") from None


def report_problems(tool: str, problems) -> bool:
    """Print each non-empty problem as '<tool>: <problem>' on stderr; True if there was any (the
    tool then exits with status 2 before any work)."""
    problems = [p for p in problems if p]
    for p in problems:
        print(f"{tool}: {p}", file=sys.stderr)
    return bool(problems)


def plugin_folder_problem(flag: str, path) -> str:
    """What keeps ``path`` from being the plugin folder ``flag`` names ('' if nothing): a file in
    its place, or nothing there."""
    if not str(path):   # Path('') is the current folder: an empty value is a slip, not '.'
        return f"{flag}: expected a plugin folder, got ''"
    p = Path(path)
    if p.is_dir():
        return ""
    if p.exists():
        return f"{flag}: {str(path)!r} is a file, not a folder; expected a plugin folder"
    return f"{flag}: folder {str(path)!r} does not exist"


def output_file_problem(flag: str, path, suffixes=()) -> str:
    """What stops a tool from writing its output file ``path`` ('' if nothing): a folder in its
    place, a parent folder that does not exist, or a file that cannot be opened for writing (no
    permission, a read-only or virtual file system such as /proc or /sys, where root's
    permission bits say nothing). Tools check it before any work, so a bad destination never
    loses a run's measurements at the end.

    ``suffixes`` (lower case, e.g. ``(".json",)``): the file names the tool writes. A name with
    another suffix is refused (``--json bench_moe.py``, a slip of tab completion, would have
    replaced the script); so is a path that exists and is no regular file (``/dev/null``, a
    pipe: the tools replace their file whole, which such a path refuses at the end, after the
    measurements); and where ".json" is among them an existing file that does not parse as JSON,
    or cannot be read, is refused rather than replaced (a file of another kind under a .json
    name).

    The check opens the file for writing, without truncating it: a file that did not exist is
    created and removed again; an existing one is left as it was (a FIFO without a reader is
    refused rather than waited on)."""
    if path is None:
        return ""
    if not str(path):   # Path('') is '.', a folder: an empty value is its own mistake
        return f"{flag}: expected a file path, got an empty value"
    p = Path(path)
    if p.is_dir():
        return f"{flag}: {path} is a folder; expected a file path"
    target = p.resolve()   # a link (dangling too: writing creates its target) is checked there
    if not target.parent.is_dir():
        parent = p.parent if target == p.absolute() else target.parent
        if parent.exists():   # a file where the folder would be (--json /etc/passwd/x.json)
            return f"{flag}: {parent} is not a folder"
        return f"{flag}: folder {parent} does not exist"
    p = target
    existed = p.exists()
    if suffixes:
        if existed and not p.is_file():
            return (f"{flag}: {path} is not a regular file (a device or a pipe); expected a "
                    f"{' or '.join(suffixes)} file the tool can replace")
        if Path(path).suffix.lower() not in suffixes or not Path(path).stem:
            return f"{flag}: expected a {' or '.join(suffixes)} file name, got {path}"
        why = _json_file(p) if existed and ".json" in suffixes else ""
        if why:
            return f"{flag}: {path} {why}: refusing to replace it (remove it, or name another file)"
    flags = os.O_WRONLY | os.O_NONBLOCK | (0 if existed else os.O_CREAT | os.O_EXCL)
    try:
        os.close(os.open(p, flags, 0o666))
    except OSError as exc:
        what = f"{path} is not writable" if existed else f"cannot create {path}"
        return f"{flag}: {what} ({exc.strerror or exc})"
    if not existed:
        try:
            p.unlink()
        except OSError:
            pass
    return ""


_JSON_PARSE_MAX = 64 << 20   # bytes: a larger file is judged by its first character


def _json_file(p: Path) -> str:
    """'' if the regular file ``p`` is empty or JSON, else why not: it cannot be read, or is not
    JSON (a file over 64 MiB by its first non-blank character, '{' or '[', not parsed whole)."""
    import json
    try:
        with open(p, "rb") as f:
            big = p.stat().st_size > _JSON_PARSE_MAX
            data = f.read(4096) if big else f.read()
    except OSError as exc:
        return f"exists and cannot be read ({exc.strerror or exc})"
    text = data.decode("utf-8", errors="replace").lstrip("\ufeff \t\r\n")
    if not text:
        return ""
    if big:
        return "" if text[0] in "{[" else "exists and is not JSON"
    try:
        json.loads(text)
    except ValueError:
        return "exists and is not JSON"
    return ""


def cupy_with_gpu():
    """(the cupy module, '') when CuPy imports and sees a usable CUDA device, else (None, why):
    CuPy missing, or present but no device it can use (no GPU, no driver, or a driver older than
    CuPy's runtime: cudaErrorInsufficientDriver), so a GPU script can say so in one line instead of
    a CUDARuntimeError traceback at its first CUDA call."""
    try:
        import cupy
    except ImportError as exc:
        return None, f"CuPy is not installed ({exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError: no driver, an older driver, ...
        return None, f"CuPy sees no usable CUDA device ({exc})"
    if n < 1:
        return None, "CuPy sees no CUDA device"
    return cupy, ""


# The exit status after the reader of stdout left early: 128 + SIGPIPE, what a shell reports for a
# writer that SIGPIPE ends (it was 1, which `list-factors` also returns for "no plugin is ready":
# `set -o pipefail; ex-engine list-factors --json | head -1` read as that)
READER_LEFT_STATUS = 141


def _reader_left() -> int:
    """After a BrokenPipeError on stdout (`... | head`: the reader left early): stdout goes to
    /dev/null, so that Python's flush at exit raises nothing more; returns READER_LEFT_STATUS."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return READER_LEFT_STATUS


def out_of_memory(exc: BaseException) -> bool:
    """``exc`` says memory ran out: a MemoryError (NumPy's), or an OutOfMemoryError (CuPy's,
    torch's CUDA one; told by name, so that neither need be importable)."""
    return isinstance(exc, MemoryError) or any(c.__name__ == "OutOfMemoryError" for c in type(exc).__mro__)


def _allocation_failed(exc: BaseException) -> bool:
    """out_of_memory, or the RuntimeError of torch's CPU allocator ("can't allocate memory")."""
    return out_of_memory(exc) or isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


class StdoutGuard:
    """sys.stdout while a command runs: the stream itself, except that it remembers the first
    error writing to it (a full disk, /dev/full; not BrokenPipeError, a reader that left, which
    the callers handle on their own): argparse swallows such an error (`--help > /dev/full`
    exited 0, its text lost), and a command's can surface in any print of it (a traceback, exit
    status 1). ex-engine's main() and exit_quietly_on_broken_pipe use it."""

    def __init__(self, stream):
        self.stream = stream
        self.lost = None

    def _guard(self, call, *args):
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            if self.lost is None:
                self.lost = exc
            raise

    def write(self, text):
        return self._guard(self.stream.write, text)

    def writelines(self, lines):
        return self._guard(self.stream.writelines, lines)

    def flush(self):
        return self._guard(self.stream.flush)

    def __getattr__(self, name):   # fileno, isatty, encoding, buffer, ...
        return getattr(self.stream, name)


def output_lost(exc: OSError, tool: str, command: bool = True) -> int:
    """After an error writing stdout: '<tool>: error: cannot write the output: <why>' on stderr;
    status 2. In a command's own process (``command``), stdout goes to /dev/null too (what is
    still buffered would fail again at exit, with Python's 'Exception ignored' lines); a function
    called by a program (ex-engine's main(argv)) leaves that program's stdout alone."""
    fd = None
    try:
        if command:
            fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):   # not a file (a program's own stream)
        fd = None
    if fd is not None:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    print(f"{tool}: error: cannot write the output: {exc.strerror or exc}", file=sys.stderr)
    return 2


def exit_quietly_on_broken_pipe(script_main, *args) -> None:
    """``sys.exit(script_main(*args))`` for the scripts in benchmarks/, scripts/ and examples/,
    ending as ex-engine's own commands do, with one line on stderr instead of a traceback:
    - a reader that leaves early (`bench_moe.py | head`): READER_LEFT_STATUS (141), no line;
    - Ctrl-C: '<script>: interrupted', status 130;
    - an allocation that fails (sizes asked for that do not fit: `--tokens 1000000000000`):
      '<script>: out of memory: <the allocator's words>', status 2;
    - stdout that cannot be written (`> /dev/full`, a full disk; --help's text too, which
      argparse lost with status 0): '<script>: error: cannot write the output: <why>', status 2;
    and text its streams cannot encode (an ASCII locale) is escaped, not an error (tolerant_stdio).
    Never returns."""
    tool = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "script"
    tolerant_stdio()
    out = None
    if sys.stdout is not None and not isinstance(sys.stdout, StdoutGuard):
        out = sys.stdout = StdoutGuard(sys.stdout)
    try:
        try:
            code = script_main(*args)
        except SystemExit as exc:   # argparse's --help and usage errors, a script's own exit
            code = exc.code
            if code is not None and not isinstance(code, int):   # sys.exit("why"): said now, as
                print(code, file=sys.stderr)                       # Python would, whatever follows
                code = 1
        if sys.stdout is not None:   # none at all (>&-, a daemon's): nothing to flush
            sys.stdout.flush()
    except BrokenPipeError:
        code = _reader_left()
    except KeyboardInterrupt:
        print(f"{tool}: interrupted", file=sys.stderr)
        code = 130
    except OSError:
        if out is None or out.lost is None:   # not stdout's: left as it is
            raise
    except (MemoryError, RuntimeError) as exc:
        if not _allocation_failed(exc):
            raise
        words = " ".join(str(exc).split())[:300] or type(exc).__name__
        print(f"{tool}: out of memory: {words} (the sizes asked for do not fit: ask for fewer "
              "tokens or a smaller shape)", file=sys.stderr)
        code = 2
    finally:
        if out is not None and sys.stdout is out:   # a caller in the same process gets its stream back
            sys.stdout = out.stream
    if out is not None and out.lost is not None:   # also where the script caught the error itself
        code = output_lost(out.lost, tool)
    sys.exit(code)


# The tile configurations of moe_fused_gemm (dims[7]) by name (benchmarks/tune_moe.py, ab_moe.py,
# scripts/kernel_times_moe.py, profile_moe.py force them through force_config)
CONFIGS = {"tiny": 0, "decode": 1, "mid": 2, "prefill": 3, "grouped": 4, "mid32": 5, "mid48": 6,
           "grouped64": 7, "narrow": 8, "decode4": 9, "chunked": 10, "chunked_nomc": 11,
           "chunked_tail": 12}
VALUES = {"auto": -1, **CONFIGS}   # auto: the kernel's own choice from T*K/G
# The --config option of the scripts that force one configuration (kernel_times_moe, profile_moe)
CONFIG_HELP = ("force a tile configuration by name: auto (the kernel's own choice, ignoring the tuning file) "
               "or one of benchmarks/tune_moe.py's CONFIGS (tiny, decode, decode4, mid, ..., grouped, "
               "grouped64, narrow, chunked, chunked_nomc, chunked_tail); default: tuned data, else auto")


def config_problems(name) -> list:
    """[] where ``name`` (a --config value) is None or a VALUES key, else its one problem line."""
    if name is None or name in VALUES:
        return []
    return [f"--config: expected one of {', '.join(VALUES)}, got {name!r}"]


def force_config(reg, name) -> None:
    """Make ``reg``'s moe_fused_gemm run tile configuration ``name`` (a VALUES key) on every call,
    whatever its tuning data says."""
    reg.set_tuning("moe_fused_gemm", lambda sizes, v=VALUES[name]: v)

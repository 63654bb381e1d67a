"""Checks made before a plugin's code runs in this process: lock files and the probe.

Lock file (``ex-engine lock``): JSON, ``{"<file name>.so": "<sha256 hex>", ...}`` for every
``*.so`` of a folder, sorted by name. ``FactorRegistry.load(..., lock=path)`` compares each
library's digest with it before ``dlopen``.

Probe (``FactorRegistry.load(..., probe="subprocess")``): a child Python process, with the same
``sys.path``, opens the library and calls its ``ex_get_factor`` with the same hardware. A
library that crashes or hangs there is reported and never opened in this process.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from . import _paths
from .errors import FactorError

LOCK_NAME = "ex_engine.lock"
# the largest library the registry reads (it holds the whole file in memory to check it): a
# larger *.so (`truncate -s 40G`) is refused unread; no plugin library is near this
LIBRARY_LIMIT = 2 << 30


def sha256_hex(data: bytes) -> str:
    """The SHA-256 digest of ``data`` as 64 hex digits."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path, limit: int = LIBRARY_LIMIT) -> str:
    """The SHA-256 digest of the regular file ``path`` as 64 hex digits, read in chunks (not
    held in memory whole). Raises OSError as _paths.read_chunks does (FileRefused for a file
    that is not a regular one, or larger than ``limit``)."""
    h = hashlib.sha256()
    for chunk in _paths.read_chunks(path, limit):
        h.update(chunk)
    return h.hexdigest()


def lock_digests(folder) -> dict:
    """file name -> sha256 of every regular ``*.so`` file in ``folder`` (sorted by name; a
    folder, FIFO or device named *.so is left out, as is a file over LIBRARY_LIMIT: the
    registry refuses those anyway). Raises FactorError naming a library that cannot be read."""
    out = {}
    for p in sorted(Path(folder).glob("*.so")):
        try:
            if not p.is_file() or p.stat().st_size > LIBRARY_LIMIT:
                continue
            out[p.name] = sha256_file(p)
        except OSError as exc:
            raise FactorError(f"lock: cannot read library {p}: {exc}") from exc
    return out


def write_lock(folder, output=None) -> tuple:
    """Write the lock file of ``folder`` (default ``folder/ex_engine.lock``); ``output`` may also
    be a text stream (``sys.stdout``: `ex-engine lock --output -`), which gets the JSON.

    A file is replaced atomically (replace_file): a reader sees the old lock or the new one,
    never a part, and a write that fails (a full disk) leaves the old one as it was (it left an
    empty file in its place). Returns (path written, or the stream; {file name: sha256}).
    Raises FactorError if ``folder`` is not a directory, or naming the lock file it cannot
    write and why."""
    folder = Path(folder)
    if not folder.is_dir():
        hint = _paths.not_a_checkout() if folder == _paths.factors_dir() else ""
        raise FactorError(f"lock: factor folder '{folder}': "
                          + ("not a directory" if folder.exists() else "does not exist")
                          + (f" ({hint})" if hint else ""))
    if output is not None and not hasattr(output, "write") and not str(output):
        raise FactorError("lock: --output: expected a file name, got '' (leave it out for "
                          f"<folder>/{LOCK_NAME})")
    digests = lock_digests(folder)
    text = json.dumps(digests, indent=2, sort_keys=True) + "\n"
    if hasattr(output, "write"):
        output.write(text)
        return output, digests
    out = Path(output) if output else folder / LOCK_NAME
    try:
        replace_file(out, text, mode=0o644)
    except OSError as exc:
        raise FactorError(f"lock: cannot write the lock file {out}: {_write_failure(exc, out)}") from exc
    return out, digests


def _write_failure(exc: OSError, dest) -> str:
    """Why replace_file could not write ``dest``, short: the error's text, and where it arose
    where that is not ``dest`` itself (creating the temporary file in its folder)."""
    why = exc.strerror or str(exc) or type(exc).__name__
    name = exc.filename
    if name is None or os.path.realpath(os.fsdecode(name)) == os.path.realpath(dest):
        return why
    name = os.fsdecode(name)
    folder = os.path.dirname(os.path.realpath(dest))
    if os.path.dirname(name) == folder:
        if isinstance(exc, FileNotFoundError) and not os.path.isdir(folder):
            return f"its folder {folder} does not exist"
        return f"{why} (creating a file in its folder {folder})"
    return f"{why} ({name})"


def replace_file(dest, text: str, mode: int = 0o644, fsync: bool = True) -> None:
    """Write ``text`` to ``dest`` atomically: into a new temporary file of a unique name in the
    same folder (the destination of a symbolic link: the link keeps pointing at the new file),
    flushed to disk (``fsync``), then renamed over ``dest`` (os.replace). The file gets the mode
    of the file it replaces, or ``mode`` less the process's umask for a new one. On any failure
    the temporary file is removed and ``dest`` is left as it was; raises the OSError (one from
    the rename names ``dest``). Where no file may be created in the folder but ``dest`` exists
    and may be written (a lock file made writable in a folder that is not), it is rewritten in
    place instead, as before: not atomic, but not refused. A ``dest`` (or a link's target) that
    exists and is not a regular file (a device, a FIFO, a socket; a folder) is left alone:
    OSError(EEXIST, 'not a regular file (...); not replaced', dest)."""
    import errno
    import stat
    named, dest = dest, Path(os.path.realpath(dest))
    try:
        st = os.stat(dest)
        keep = stat.S_IMODE(st.st_mode)
    except FileNotFoundError:
        st = keep = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        # a device, a FIFO or a socket (verified.json -> /dev/null, a common way to switch a
        # cache off) was renamed over: run as root, /dev/null or /dev/zero became a JSON file
        kind = next((what for test, what in _paths._KINDS if test(st.st_mode)),
                    "a folder" if stat.S_ISDIR(st.st_mode) else "not a file")
        link = f"a link to {dest}, " if os.fspath(named) != os.fspath(dest) else ""
        raise OSError(errno.EEXIST, f"{link}not a regular file ({kind}); not replaced", str(named))

    def write(fh):   # the text, flushed (and synced) before anyone renames or reads it
        fh.write(text.encode())
        fh.flush()
        if fsync:
            os.fsync(fh.fileno())

    try:
        fd, tmp = _create_beside(dest, mode)
    except PermissionError:
        if keep is None or not os.access(dest, os.W_OK):
            raise
        with open(dest, "r+b") as fh:   # in place (the folder refuses a new file)
            fh.truncate(0)
            write(fh)
        return
    try:
        with os.fdopen(fd, "wb") as fh:
            if keep is not None:   # if the file system lets it (else ``mode`` less the umask)
                with contextlib.suppress(OSError):
                    os.fchmod(fh.fileno(), keep)
            write(fh)
        try:
            os.replace(tmp, dest)
        except OSError as exc:   # the rename over dest refused (another user's file in a sticky folder)
            raise OSError(exc.errno, exc.strerror, str(dest)) from exc
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:   # the rename itself, best effort (a folder may refuse to be opened or synced)
        try:
            dfd = os.open(dest.parent, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(dfd)
        except OSError:
            pass
        finally:
            os.close(dfd)


def _create_beside(dest: Path, mode: int) -> tuple:
    """(fd, path) of a new file named '.<dest's name>.<random>.tmp' in ``dest``'s folder, opened
    for writing, created with ``mode`` (the kernel applies the umask, as for any new file; a
    name taken already is tried again with another)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = dest.parent / f".{dest.name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, flags, mode), tmp
        except FileExistsError:
            continue
    import errno
    raise FileExistsError(errno.EEXIST, "no unused temporary file name", str(dest.parent))


class _DuplicateKey(ValueError):
    """A JSON object that gives one key twice (json keeps the last silently)."""


def _unique_pairs(pairs: list) -> dict:
    """json's object_pairs_hook: the object as a dict, refusing a key given twice."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(f"found duplicate key {k!r}: expected each library once (a lock "
                                "file that names one twice was edited by hand; which digest holds?)")
        out[k] = v
    return out


def read_lock(path) -> dict:
    """{file name: sha256} from a lock file. Raises FactorError if missing or malformed (a key
    given twice too, as ex_engine's YAML files refuse one), or, before reading it, if it is not
    a regular file (a FIFO blocked the read forever) or larger than _paths.TEXT_FILE_LIMIT (its
    size named)."""
    path = Path(path)
    try:
        data = json.loads(_paths.read_small(path).decode(), object_pairs_hook=_unique_pairs)
    except _DuplicateKey as exc:
        raise FactorError(f"lock file {path}: {exc}") from None
    except FileNotFoundError:
        raise FactorError(f"lock file {path}: not found; write one with `ex-engine lock`") from None
    except _paths.FileRefused as exc:
        raise FactorError(f"lock file {path}: {exc}") from None
    except (OSError, ValueError, RecursionError) as exc:   # (nesting past the recursion limit)
        raise FactorError(f"lock file {path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise FactorError(f"lock file {path}: expected a JSON object {{file name: sha256}}, "
                          f"got {type(data).__name__}")
    for k, v in data.items():
        if not isinstance(v, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", v):
            raise FactorError(f"lock file {path}: entry {k!r}: expected a SHA-256 digest "
                              f"(64 hex digits, as `ex-engine lock` writes), got {v!r}")
    return {k: v.lower() for k, v in data.items()}


# ------------------------------------------------------------------------------------ probe
# The child reports its stages ("dlopen", "opened", "ex_get_factor", "reading the factor it
# returned", "done ...") on a pipe of its
# own (the fd in argv[4]), each line starting with a random token it reads from stdin before the
# library is opened: what a library prints (stdout is /dev/null here; "stage done" then _exit(0) passed
# the probe when stages were read from stdout) cannot pass for a report, and a child that ends
# without the final "done" line is a failure whatever its status. This guards against accidents,
# not against a library written to deceive the probe: its code runs in the child and can reach
# the child's Python (and so the token and the pipe); the lock file is the check of what is loaded.
_CHILD = r"""
import json, os, sys
sys.path[:] = json.loads(sys.argv[3])
_fd, _token = int(sys.argv[4]), sys.stdin.readline().strip()


def stage(what):
    os.write(_fd, (_token + " " + what + "\n").encode())


def main():
    from ex_engine import abi
    from ex_engine.hardware import Hardware
    stage("dlopen")
    lib = abi.dlopen(sys.argv[1])
    stage("opened")
    try:
        version = int(lib.ex_abi_version)
    except Exception:
        return "no ex_abi_version"
    if version >> 16 != abi.ABI_VERSION_MAJOR:
        return "other ABI"                            # never call a library of another ABI
    hw = Hardware(**json.loads(sys.argv[2])).to_c(abi.ffi)
    try:
        get = lib.ex_get_factor                       # a lookup: no code of the library runs
    except Exception:
        return "no ex_get_factor"
    stage("ex_get_factor")
    f = get(hw)
    if f == abi.ffi.NULL:
        return "NULL"
    # ex_get_factor returned: a crash from here on is in what it returned (a wild pointer), not
    # in its code, and the probe's reason says so
    stage("reading the factor it returned")
    # every field the in-process load reads, read here first (a bad pointer crashes the child)
    for name in ("name", "version", "description"):
        p = getattr(f, name)
        if p != abi.ffi.NULL:
            abi.ffi.string(p)
    for k in abi.TUNING_FIELDS:
        int(getattr(f.tuning, k))
    return ""


try:
    what = main()
except Exception as exc:   # a Python-level error: the in-process checks report it
    what = f"python error {type(exc).__name__}"
stage(("done: " + what) if what else "done")
"""

# what the child's final "done: <what>" says happened (it did not crash; the probe passes), for
# the probe check's detail: only "done" and "done: NULL" mean ex_get_factor was called
_DONE = {
    "": "child process: opened the library and called ex_get_factor without crashing",
    "NULL": "child process: opened the library and called ex_get_factor without crashing (it returned NULL)",
    "no ex_abi_version": ("child process: did not crash; it opened the library, found no ex_abi_version "
                          "and called nothing (the checks below say why)"),
    "other ABI": ("child process: did not crash; it opened the library and called nothing: its "
                  "ex_abi_version is of another ABI major (the checks below say why)"),
    "no ex_get_factor": ("child process: did not crash; it opened the library, found no ex_get_factor "
                         "and called nothing (the checks below say why)"),
}


def _done_detail(what: str, before: str) -> str:
    """The probe's detail for a child that finished: ``what`` follows "done" in its last report
    ('' for none), ``before`` is the stage it reported before that ("dlopen", "opened",
    "ex_get_factor"; a Python error before "dlopen" or at "opened" is _unprobed's, not this)."""
    if what in _DONE:
        return _DONE[what]
    error = what[len("python error "):] if what.startswith("python error ") else what
    if before == "dlopen":
        return (f"child process: did not crash; it stopped at dlopen with a Python error ({error}): "
                "it could not open the library (the checks below say why)")
    return (f"child process: did not crash; it stopped at {before} with a Python error ({error}) "
            "(the checks below say why)")


def _unprobed(what: str, before: str) -> str:
    """Why a child that finished without crashing still leaves the library unprobed ('' if it
    does not): a Python error before dlopen (importing ex_engine) or between opening the library
    and calling ex_get_factor (reading the hardware): the child never called it, so the
    in-process load would be the first to run the library's code."""
    if not what.startswith("python error ") or before not in ("", "opened"):
        return ""
    where = "before opening the library" if before == "" else \
        "between opening the library and calling ex_get_factor"
    return (f"the probe's child process stopped {where} with a Python error "
            f"({what[len('python error '):]}); not opened unprobed")


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _read_reports(fd: int, token: str) -> list:
    """The stages the child wrote on its pipe (lines that start with the run's token), read
    without waiting: a process the library started may hold the pipe open."""
    os.set_blocking(fd, False)
    data = b""
    while len(data) < 1 << 16:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    head = token + " "
    return [ln[len(head):] for ln in data.decode(errors="replace").splitlines() if ln.startswith(head)]


def run_reporting_child(args: list, timeout: float) -> tuple:
    """Run ``python -c args[0] args[1:]... FD`` in a session of its own, FD the write end of a
    pipe whose lines the child marks with a random token it reads from stdin (_read_reports: what
    the child's code prints elsewhere does not count); wait ``timeout`` seconds, then kill the
    child and what it started. Returns (status: None if it timed out, negative for a signal;
    the token-marked reports in order; the last line of its stderr, '' if none). The library
    probe here and the registry's fallback-import probe run their children so."""
    token = secrets.token_hex(16)
    r, w = os.pipe()
    try:
        cmd = [sys.executable, "-c", *args, str(w)]
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err,
                                    pass_fds=(w,), start_new_session=True)
            os.close(w)
            w = -1
            try:
                proc.stdin.write((token + "\n").encode())
                proc.stdin.close()
            except OSError:   # the child already ended: its status says how
                pass
            try:
                rc = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                rc = None
            finally:          # the child and what it started (its own session)
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
            stages = _read_reports(r, token)
            err.seek(max(0, err.seek(0, os.SEEK_END) - 4096))
            last = (err.read().decode(errors="replace").strip().splitlines() or [""])[-1]
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    return rc, stages, last


def probe_library(path, hardware, timeout: float = 10.0) -> tuple:
    """Open ``path`` in a child process and call its ex_get_factor with ``hardware``.

    Returns (ok, detail). Not ok: the child died of a signal ("crashed in ex_get_factor:
    signal SIGSEGV"), ran past ``timeout`` seconds ("timed out after 10 s in
    ex_get_factor"), or ended without reporting that it finished ("exited with status 0 in
    ex_get_factor": exit() in a constructor or in ex_get_factor would end the caller's process
    too), also where it could not start or reach the library at all (the probe did not run:
    the library is not opened unprobed). The child reports its stages on a pipe of its own,
    marked with a random token (_CHILD), so nothing the library prints counts (a library
    written to deceive the probe could still reach the child's Python: it is a guard against
    faults, not a sandbox; ``lock=`` checks which bytes are loaded). It reads every
    field of the factor struct the in-process load reads. A Python error in the child (an
    unloadable file, a missing symbol) is ok here: the in-process checks report it without
    running the library's code. The ok detail says how far the child got: "child process:
    opened the library and called ex_get_factor without crashing" only when it did; else e.g.
    "child process: did not crash; it stopped at dlopen with a Python error (OSError): it could
    not open the library (the checks below say why)" or "...; it opened the library, found no
    ex_get_factor and called nothing (...)".
    """
    rc, stages, last = run_reporting_child(
        [_CHILD, str(Path(path).absolute()), json.dumps(hardware.as_dict()), json.dumps(child_sys_path())],
        timeout)
    said = _stderr_line(last)   # the cause where the child's stderr gives it (ld.so's message)
    stage = stages[-1] if stages else "start-up"
    if rc is None:
        return False, f"timed out after {timeout:g} s in {stage}"
    if rc < 0:
        return False, f"crashed in {stage}: signal {_signal_name(-rc)}"
    if stage.startswith("done") and rc == 0:
        what = stage[len("done: "):] if stage.startswith("done: ") else ""
        before = stages[-2] if len(stages) >= 2 else ""   # '': it ended before its first stage
        why = _unprobed(what, before)
        if why:
            return False, why
        return True, _done_detail(what, before)
    said_in = f"; last stderr line: {said}" if said else ""
    if not stages:   # the child never reached the library: the probe did not run
        return False, (f"the probe's child process ended with status {rc} before opening the library "
                       f"(last stderr line: {said or 'no message'}); not opened unprobed")
    if stage.startswith("done"):   # its checks done, the child then ended with a status of its own
        return False, (f"exited with status {rc} after ex_get_factor returned (at exit: a destructor "
                       f"or atexit handler of the library ended the child process{said_in})")
    if stage == "dlopen":   # ld.so ends a process on a corrupt library ("Inconsistency detected
        # by ld.so: ...", status 127) before any of its code runs; or exit() in a constructor
        return False, (f"exited with status {rc} in dlopen (the dynamic loader, or the library's "
                       f"initialisation code, ended the child process{said_in})")
    # the library ended the process itself (exit() in ex_get_factor)
    return False, f"exited with status {rc} in {stage} (the library ended the child process{said_in})"


STDERR_LINE_LIMIT = 300   # characters of a child's last stderr line kept in a probe's message


def _stderr_line(line: str, limit: int = STDERR_LINE_LIMIT) -> str:
    """A child's last stderr line for a message: every character that is not printable (a
    control character, an escape sequence's ESC) written as a Python escape ('\\x1b'), so that
    it stays one line and cannot drive a terminal, then cut to ``limit`` characters, the cut
    said: '... (N more characters)'. '' for none."""
    from .errors import cut_text
    return cut_text(line.strip(), limit)


CHILD_TIMEOUT_S = 120.0   # default for one plugin's verify cases in a child process (seconds)


def child_sys_path(extra=()) -> list:
    """sys.path for a child process: ``extra`` folders first, then this process's entries as
    absolute paths (an entry '' or a relative one means this process's current folder, which a
    child started later from another folder would read otherwise); entries that are not paths
    (which imports ignore) dropped; last, where this ex_engine was imported from (so that the
    child finds it), after the process's own entries: first, its folder's packages (a checkout's
    tests/, scripts/) shadowed the user's of the same name in the child only, so the probe
    imported another module than the process would (an operations engineer's trial)."""
    import os
    out = [str(p) for p in extra]
    for p in sys.path:
        p = os.fspath(p) if isinstance(p, os.PathLike) else p
        if isinstance(p, str):
            out.append(os.path.abspath(p or "."))
    root = str(Path(__file__).resolve().parents[1])   # where this ex_engine was imported from
    if root not in out:
        out.append(root)
    return out

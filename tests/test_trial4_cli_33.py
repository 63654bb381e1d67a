"""Findings 6, 7, 8, 9, 10 and 13 of the fourth user trial (an operations engineer), mended in
session thirty-three: an output that cannot be written (a full disk, /dev/full) was a traceback
with exit status 1 (`--help` exited 0 with its text lost), and an OSError of a command (a path
inside a folder the user cannot enter) a traceback; `lock` wrote its file in place (an empty
file left on a full disk, the error naming no file) and wrote `--output -` to a file named '-';
the library probe dropped the child's last stderr line (ld.so's reason for status 127); writers
of verify's cache in threads of one process shared one temporary file; no `ex-engine --version`."""
import errno
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

import ex_engine
from ex_engine import FactorRegistry, abi, cli, trust, verify
from ex_engine.cli import main
from ex_engine.hardware import resolve
from tests.conftest import ROOT, build_plugin, child_env

ENOSPC = os.strerror(errno.ENOSPC)   # 'No space left on device'
LOST = f"ex-engine: error: cannot write the output: {ENOSPC}\n"


def _ex_engine(args, cwd, **kw):
    return subprocess.run([sys.executable, "-m", "ex_engine", *args], cwd=cwd, env=child_env(),
                          text=True, timeout=300, **kw)


# ------------------------------------------------- 6. an output that cannot be written
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("argv", [
    ["--help"],
    ["--version"],
    ["hardware", "--profile", "h200"],
    ["hardware", "--profile", "h200", "--json"],
    ["list-factors", "--dir", "{d}", "--hardware", "h200", "--no-probe"],
    ["list-factors", "--dir", "{d}", "--hardware", "h200", "--no-probe", "--json", "--why"],
    ["lock", "--dir", "{d}", "--output", "{d}/x.lock"],
    ["lock", "--dir", "{d}", "--output", "-"],
    ["verify", "--dir", "{d}", "--hardware", "h200", "--no-probe", "--in-process"],
    # (["run"] printed run's help on stdout; now a usage error on stderr, stdout untouched)
])
def test_a_full_stdout_is_one_error_line_and_status_2(tmp_path, argv):
    """`ex-engine list-factors > /dev/full` was a traceback and exit status 1 (the status of a
    failed check); `--help > /dev/full` exited 0 with its text lost."""
    build_plugin(tmp_path / "lib")
    argv = [a.replace("{d}", str(tmp_path / "lib")) for a in argv]
    with open("/dev/full", "w") as full:
        r = _ex_engine(argv, tmp_path, stdout=full, stderr=subprocess.PIPE)
    assert (r.returncode, r.stderr) == (2, LOST), (argv, r.returncode, r.stderr)


class _FullStream(io.StringIO):
    """A stdout on a full disk: every write fails."""

    def write(self, text):
        raise OSError(errno.ENOSPC, ENOSPC)


@pytest.mark.parametrize("argv", [["--help"], ["lock", "--help"], ["hardware", "--profile", "h200"], []])
def test_a_full_stdout_in_process(monkeypatch, capsys, argv):
    """main() of a program: the same line and status; argparse's own printing (--help, the usage
    of a bare `ex-engine`) swallowed the error, and main() returned or exited 0."""
    monkeypatch.setattr(sys, "stdout", _FullStream())
    assert main(argv) == 2
    assert capsys.readouterr().err == LOST
    assert isinstance(sys.stdout, _FullStream)   # main() put the program's stdout back


def test_a_large_output_that_fails_halfway_is_reported(tmp_path, monkeypatch, capsys):
    """An error in the middle of a command's printing (the buffer full before main's flush)."""
    class HalfFull(io.StringIO):
        def write(self, text):
            if self.tell() + len(text) > 200:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return super().write(text)
    build_plugin(tmp_path)
    monkeypatch.setattr(sys, "stdout", HalfFull())
    assert main(["list-factors", "--dir", str(tmp_path), "--hardware", "h200", "--no-probe", "--why"]) == 2
    assert capsys.readouterr().err == f"ex-engine: error: cannot write the output: {os.strerror(errno.EIO)}\n"


def test_an_oserror_of_a_command_is_one_line_naming_the_file(monkeypatch, capsys):
    """A PermissionError from a path inside a folder the user cannot enter (Python 3.11's
    Path.is_dir raises EACCES) was a traceback; any OSError a command lets out is now one line
    with the file it names (escaped) and the system's reason, exit status 2."""
    def denied(args):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/srv/locked\nx/ex_engine.lock")
    monkeypatch.setattr(cli, "cmd_hardware", denied)
    assert main(["hardware"]) == 2
    assert capsys.readouterr().err == ("ex-engine: error: /srv/locked\\nx/ex_engine.lock: "
                                       f"{os.strerror(errno.EACCES)}\n")


def test_a_lock_path_inside_a_folder_that_cannot_be_entered(tmp_path, monkeypatch, capsys):
    """`list-factors --lock D/ex_engine.lock` with D mode 700 of another user: root passes any
    permission check, so Path.is_dir's PermissionError is simulated."""
    lock = tmp_path / "private" / "ex_engine.lock"
    is_dir = Path.is_dir

    def is_dir_denied(self):
        if str(self).startswith(str(lock.parent)):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return is_dir(self)
    monkeypatch.setattr(Path, "is_dir", is_dir_denied)
    assert main(["list-factors", "--dir", str(tmp_path), "--hardware", "h200", "--lock", str(lock)]) == 2
    assert capsys.readouterr().err == f"ex-engine: error: {lock}: {os.strerror(errno.EACCES)}\n"


def test_other_failures_keep_their_handling(monkeypatch, capsys):
    """FactorError (one line, 2) and Ctrl-C (130) as before; neither is taken for a lost output."""
    def stop(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "cmd_hardware", stop)
    assert main(["hardware"]) == 130
    assert capsys.readouterr().err == "ex-engine: interrupted\n"
    monkeypatch.undo()
    assert main(["hardware", "--profile", "no-such"]) == 2
    assert capsys.readouterr().err.startswith("ex-engine: error: hardware profile 'no-such'")


# ------------------------------------------------- 7. the lock written atomically
def _digests(folder):
    return {p.name: trust.sha256_hex(p.read_bytes()) for p in sorted(folder.glob("*.so"))}


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


def test_lock_replaces_its_file_atomically_keeping_its_mode(tmp_path, capsys):
    """The lock was written in place: a reader could see part of it. Now a new file is renamed
    over the old one (a reader holding the old one keeps it whole), with the old one's mode."""
    build_plugin(tmp_path)
    lock = tmp_path / "ex_engine.lock"
    assert main(["lock", "--dir", str(tmp_path)]) == 0
    old_text = lock.read_text(encoding="utf-8")
    lock.chmod(0o600)
    with open(lock, encoding="utf-8") as held:
        build_plugin(tmp_path, "second", manifest=False)
        assert main(["lock", "--dir", str(tmp_path)]) == 0
        assert held.read() == old_text                      # the old file, whole
    assert json.loads(lock.read_text(encoding="utf-8")) == _digests(tmp_path) and len(_digests(tmp_path)) == 2
    assert oct(lock.stat().st_mode & 0o777) == oct(0o600)
    assert _leftovers(tmp_path) == []
    capsys.readouterr()


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600)])
def test_a_new_lock_file_is_0644_less_the_umask(tmp_path, umask, mode):
    build_plugin(tmp_path)
    old = os.umask(umask)
    try:
        path, _ = trust.write_lock(tmp_path)
    finally:
        os.umask(old)
    assert oct(path.stat().st_mode & 0o777) == oct(mode)


def test_lock_through_a_link_replaces_the_links_target(tmp_path, capsys):
    build_plugin(tmp_path / "lib")
    (tmp_path / "real.lock").write_text("{}\n")
    (tmp_path / "link.lock").symlink_to(tmp_path / "real.lock")
    assert main(["lock", "--dir", str(tmp_path / "lib"), "--output", str(tmp_path / "link.lock")]) == 0
    assert (tmp_path / "link.lock").is_symlink()
    assert json.loads((tmp_path / "real.lock").read_text(encoding="utf-8")) == _digests(tmp_path / "lib")
    capsys.readouterr()


def test_a_lock_that_cannot_be_written_leaves_the_old_one_and_names_the_file(tmp_path):
    """On a full disk `lock` left a 0-byte (or part-written) lock file, and the error named no
    file. A file size limit (RLIMIT_FSIZE, which binds root too) stands in for the full disk:
    the new lock is larger than the limit, the old one was written without it."""
    resource = pytest.importorskip("resource")
    build_plugin(tmp_path)
    lock = tmp_path / "ex_engine.lock"
    trust.write_lock(tmp_path)
    old_text = lock.read_text(encoding="utf-8")
    build_plugin(tmp_path, "second", manifest=False)

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (40, 40))
    r = _ex_engine(["lock", "--dir", str(tmp_path)], tmp_path, capture_output=True, preexec_fn=limit)
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert r.stderr == (f"ex-engine: error: lock: cannot write the lock file {lock}: "
                        f"{os.strerror(errno.EFBIG)}\n"), r.stderr
    assert lock.read_text(encoding="utf-8") == old_text
    assert _leftovers(tmp_path) == []


def test_a_failure_at_the_rename_removes_the_temporary_file(tmp_path, monkeypatch):
    build_plugin(tmp_path)
    lock = tmp_path / "ex_engine.lock"
    lock.write_text("{}\n")

    def no_replace(src, dst):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(trust.os, "replace", no_replace)
    with pytest.raises(ex_engine.FactorError) as e:
        trust.write_lock(tmp_path)
    assert str(e.value) == f"lock: cannot write the lock file {lock}: {os.strerror(errno.EIO)}"
    assert lock.read_text(encoding="utf-8") == "{}\n" and _leftovers(tmp_path) == []


@pytest.mark.skipif(not Path("/proc/version").is_file(), reason="needs procfs")
def test_lock_onto_a_proc_file_names_it(tmp_path, capsys):
    """`--output /proc/version` (a file that reports 0 bytes) said '[Errno 5] Input/output
    error' with no path."""
    build_plugin(tmp_path)
    assert main(["lock", "--dir", str(tmp_path), "--output", "/proc/version"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ex-engine: error: lock: cannot write the lock file /proc/version: "), err
    assert err.count("\n") == 1


def test_lock_into_a_folder_that_does_not_exist_names_the_folder(tmp_path, capsys):
    build_plugin(tmp_path)
    out = tmp_path / "no" / "x.lock"
    assert main(["lock", "--dir", str(tmp_path), "--output", str(out)]) == 2
    assert capsys.readouterr().err == (f"ex-engine: error: lock: cannot write the lock file {out}: "
                                       f"its folder {out.parent} does not exist\n")


# ------------------------------------------------- 8. lock --output -
def test_lock_output_dash_is_stdout(tmp_path, monkeypatch, capsys):
    """`--output -` wrote a file named '-'. Now the JSON alone goes to stdout, the lines about
    it to stderr."""
    build_plugin(tmp_path / "lib")
    monkeypatch.chdir(tmp_path)
    assert main(["lock", "--dir", str(tmp_path / "lib"), "--output", "-"]) == 0
    out, err = capsys.readouterr()
    digests = _digests(tmp_path / "lib")
    assert json.loads(out) == digests and out.endswith("}\n")
    (name, digest), = digests.items()
    assert err == (f"  {digest}  {name}\n"
                   "wrote the lock to stdout (1 library; JSON {file name: sha256})\n")
    assert not (tmp_path / "-").exists() and not (tmp_path / "lib" / "ex_engine.lock").exists()


def test_lock_output_dash_of_an_empty_folder_says_so_on_stderr(tmp_path, capsys):
    assert main(["lock", "--dir", str(tmp_path), "--output", "-"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {} and "note: no *.so in" in err


def test_lock_help_documents_output_dash(capsys):
    with pytest.raises(SystemExit):
        main(["lock", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "'-': write the JSON to stdout, and the lines about it to stderr" in text, text


def test_the_readme_documents_version_and_output_dash():
    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert "`lock --output -` writes the JSON to stdout" in text
    assert "`ex-engine --version`" in text


# ------------------------------------------------- 9. the probe's last stderr line
_DIES_IN_DLOPEN = r"""
#include "ex_engine.h"
#include <stdio.h>
#include <unistd.h>
EX_DEFINE_ABI_VERSION();
/* as ld.so ends a process on a corrupt library: a line on stderr, status 127 */
__attribute__((constructor)) static void die(void) {
    fputs("noise before\n", stderr);
    fputs("Inconsistency detected by ld.so: dl-reloc.c: 1: fake: Assertion `\x1b[31m' failed!\n\n", stderr);
    fflush(stderr);
    _exit(127);
}
"""


def test_probe_names_the_childs_last_stderr_line_when_dlopen_ends_it(tmp_path):
    """A corrupt library: `exited with status 127 in dlopen (the library ended the child
    process)`, while the cause, ld.so's 'Inconsistency detected' line, was on the child's
    stderr. Now that line is in the reason, escaped."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc not available")
    (tmp_path / "dies.c").write_text(_DIES_IN_DLOPEN, encoding="utf-8")
    subprocess.run(["gcc", "-shared", "-fPIC", "-fvisibility=hidden", f"-I{ROOT / 'include'}", "-o",
                    str(tmp_path / "dies.so"), str(tmp_path / "dies.c")], check=True)
    reg = FactorRegistry.load(tmp_path, hardware="h200", probe="subprocess")
    p, = reg.plugins
    assert p.status == "rejected" and p.lib is None
    assert p.reason == ("probe (child process): exited with status 127 in dlopen (the dynamic loader, "
                        "or the library's initialisation code, ended the child process; last stderr "
                        "line: Inconsistency detected by ld.so: dl-reloc.c: 1: fake: Assertion "
                        "`\\x1b[31m' failed!)"), p.reason


@pytest.mark.parametrize("stages,rc,says", [
    (["dlopen"], 127, "exited with status 127 in dlopen (the dynamic loader, or the library's "
                      "initialisation code, ended the child process; last stderr line: "),
    (["dlopen", "opened", "ex_get_factor"], 3,
     "exited with status 3 in ex_get_factor (the library ended the child process; last stderr line: "),
    (["dlopen", "opened", "ex_get_factor", "done"], 4,
     "exited with status 4 after ex_get_factor returned (at exit: a destructor or atexit handler of "
     "the library ended the child process; last stderr line: "),
    ([], 1, "the probe's child process ended with status 1 before opening the library (last stderr line: "),
])
def test_probe_messages_carry_the_last_stderr_line_escaped_and_cut(monkeypatch, stages, rc, says):
    line = "cause:\x07 " + "x" * 400
    monkeypatch.setattr(trust, "run_reporting_child", lambda args, timeout: (rc, stages, line))
    ok, detail = trust.probe_library("/nowhere.so", resolve("h200"))
    assert not ok and detail.startswith(says), detail
    shown = detail[len(says):]
    assert shown.startswith("cause:\\x07 xxx") and "... (111 more characters)" in shown, shown
    assert shown.index("...") == 300 and detail.isprintable()


@pytest.mark.parametrize("stages,rc,detail", [
    (["dlopen", "opened", "ex_get_factor"], 0,
     "exited with status 0 in ex_get_factor (the library ended the child process)"),
    (["dlopen"], 127, "exited with status 127 in dlopen (the dynamic loader, or the library's "
                      "initialisation code, ended the child process)"),
    ([], 1, "the probe's child process ended with status 1 before opening the library (last stderr "
            "line: no message); not opened unprobed"),
])
def test_probe_messages_without_stderr_stay_as_they_were(monkeypatch, stages, rc, detail):
    monkeypatch.setattr(trust, "run_reporting_child", lambda args, timeout: (rc, stages, ""))
    assert trust.probe_library("/nowhere.so", resolve("h200")) == (False, detail)


# ------------------------------------------------- 10. verify's cache from threads
def test_cache_writers_in_threads_do_not_share_a_temporary_file(tmp_path, monkeypatch):
    """8 threads x 30 _write_cache: 107 of 240 failed ('verified.json: No such file or
    directory'): each thread wrote and renamed the same '.tmp<pid>'. The threads meet at each
    write here (between the JSON and the file), so that the writes overlap every time."""
    monkeypatch.setenv("EX_ENGINE_CACHE", str(tmp_path / "cache"))
    n, rounds = 8, 20
    meet = threading.Barrier(n, timeout=30)

    def dumps(data, **kw):
        meet.wait()
        return json.dumps(data, **kw)
    monkeypatch.setattr(verify, "json", types.SimpleNamespace(dumps=dumps, loads=json.loads))
    results = []

    def writer(i):
        for k in range(rounds):
            results.append(verify._write_cache({"writer": i, "round": k}))
    threads = [threading.Thread(target=writer, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [""] * (n * rounds), sorted(set(results))
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["verified.json"]
    assert json.loads((tmp_path / "cache" / "verified.json").read_text(encoding="utf-8"))["round"] == rounds - 1


def test_cache_write_failure_still_names_the_cache_file(tmp_path, monkeypatch):
    monkeypatch.setenv("EX_ENGINE_CACHE", str(tmp_path))

    def no_replace(src, dst):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
    monkeypatch.setattr(verify.os, "replace", no_replace)
    assert verify._write_cache({}) == f"{tmp_path / 'verified.json'}: {os.strerror(errno.EXDEV)}"
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------- 13. --version
def test_version_prints_the_package_and_abi_versions(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == (f"ex-engine {ex_engine.__version__} (plugin ABI "
                                       f"{abi.ABI_VERSION_MAJOR}.{abi.ABI_VERSION_MINOR})\n")


def test_version_of_the_command(tmp_path):
    r = _ex_engine(["--version"], tmp_path, capture_output=True)
    assert (r.returncode, r.stderr) == (0, "") and r.stdout.startswith(f"ex-engine {ex_engine.__version__} ")


# ------------------------------------------------- a review's findings (session 33)
def test_lock_output_dash_with_stdout_closed_writes_no_file(tmp_path, monkeypatch, capsys):
    """`lock --output -` with stdout closed (sys.stdout None) wrote <dir>/ex_engine.lock over
    whatever was there (write_lock read None as its default)."""
    from ex_engine import cli
    (tmp_path / "ex_engine.lock").write_text('{"keep": "me"}')
    monkeypatch.setattr(sys, "stdout", None)
    assert cli.main(["lock", "--dir", str(tmp_path), "--output", "-"]) == 2
    assert (tmp_path / "ex_engine.lock").read_text(encoding="utf-8") == '{"keep": "me"}'
    assert "expected a standard output to write the lock to" in capsys.readouterr().err


def test_main_called_by_a_program_leaves_its_stdout_descriptor_alone(monkeypatch):
    """_output_lost pointed fd 1 at /dev/null even when main(argv) was called as a function."""
    from ex_engine import cli
    calls = []
    monkeypatch.setattr(os, "dup2", lambda a, b: calls.append((a, b)))
    assert cli._output_lost(OSError(28, "No space left on device"), command=False) == 2
    assert calls == []


def test_a_refused_rename_names_the_lock_file_not_its_folder(tmp_path, monkeypatch):
    from ex_engine import trust
    real = os.replace

    def refuse(a, b):
        if str(b).endswith("ex_engine.lock"):
            raise PermissionError(1, "Operation not permitted", str(a), None, str(b))
        return real(a, b)
    monkeypatch.setattr(os, "replace", refuse)
    (tmp_path / "x.so").write_bytes(b"\x7fELF")
    with pytest.raises(ex_engine.FactorError) as e:
        trust.write_lock(tmp_path)
    assert str(e.value) == f"lock: cannot write the lock file {tmp_path / 'ex_engine.lock'}: Operation not permitted"
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_a_writable_lock_in_a_folder_that_refuses_new_files_is_rewritten_in_place(tmp_path, monkeypatch):
    from ex_engine import trust
    (tmp_path / "x.so").write_bytes(b"\x7fELF")
    lock = tmp_path / "ex_engine.lock"
    lock.write_text("{}")
    real = os.open

    def no_new_files(path, flags, *a):
        if flags & os.O_CREAT and str(path).endswith(".tmp"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, flags, *a)
    monkeypatch.setattr(os, "open", no_new_files)
    ino = lock.stat().st_ino
    trust.write_lock(tmp_path)
    assert "x.so" in lock.read_text(encoding="utf-8") and lock.stat().st_ino == ino

"""Session forty-three's trial (a): a plugin's strings in unreadable memory. Each test failed
before its mend. CPU only: host plugins built with gcc (tests/plugins/host_scale.c through
test_trial42f's host_scale_with)."""
from __future__ import annotations

import ctypes
import json
import mmap
import re
import subprocess
import sys

import pytest

from ex_engine import _cstring, abi
from ex_engine.registry import PLUGIN_STRING_BYTES, _c_text

from .conftest import ROOT, build_plugin, child_env
from .test_trial42f import host_scale_with

# edge(HOW): 0 the last 100 bytes of a page, none of them NUL, then an unmapped page; 1 the same
# before a PROT_NONE page; 2 a PROT_NONE page itself; 3 the address 16. Made when called.
EDGE = r"""#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
static const char* edge(int how) {
    if (how == 3) return (const char*)16;
    long ps = sysconf(_SC_PAGESIZE);
    char* m = mmap(NULL, 2 * ps, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) abort();
    memset(m, 'Z', 2 * ps);
    if (how == 0) munmap(m + ps, ps); else mprotect(m + ps, ps, PROT_NONE);
    return how == 2 ? m + ps : m + ps - 100;
}
"""

# the child: loads the folder twice (process_vm_readv where this kernel lets it, then the pipe
# fallback forced), calls both plugins, prints what it saw; a SIGSEGV shows as its exit status
CHILD = r"""
import json, sys
import numpy as np
from ex_engine import FactorRegistry, _cstring

def once():
    reg = FactorRegistry.load(sys.argv[1], hardware="h200")
    seen = {"plugins": sorted([q.path.name, q.status, q.name, q.description, q.reason] for q in reg.plugins)}
    for name in ("host_scale", "host_good"):
        x = np.arange(7, dtype=np.float32)
        try:
            seen[name] = reg.dispatch(name, {"x": x, "out": np.empty_like(x), "alpha": np.array([2.0], np.float32)})
        except Exception as exc:
            seen[name] = f"{type(exc).__name__}: {exc}"
    return seen

first = once()
used = "process_vm_readv" if _cstring._readv is not None else "pipe"
_cstring._readv = None
print(json.dumps({"readv": first, "pipe": once(), "used": used}))
"""

PAGE_END = r"Z{100}\.\.\. \(unreadable memory at 0x[0-9a-f]*000 before a NUL; the rest not read\)"
UNREADABLE = {0: PAGE_END, 1: PAGE_END, 2: r"\(unreadable string at 0x[0-9a-f]*000\)",
              3: r"\(unreadable string at 0x10\)"}


def _load_in_child(folder) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True,
                       env=child_env(), cwd=ROOT, timeout=120)
    assert r.returncode == 0, f"the child ended with status {r.returncode}:\n{r.stderr[-3000:]}"
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["pipe"] == out["readv"] or _masked(out["pipe"]) == _masked(out["readv"]), out
    return out["readv"]


def _masked(seen) -> str:
    """``seen`` with its addresses hidden (each load maps new pages)."""
    return re.sub(r"0x[0-9a-f]+", "0x?", json.dumps(seen))


def _folder(tmp_path, **exprs):
    folder = host_scale_with(tmp_path, EDGE, **exprs)
    build_plugin(folder, "good", {"NAME": '"host_good"', "FACTOR_ID": 1109})
    return folder


@pytest.mark.parametrize("how", [0, 1, 2, 3])
def test_a_last_error_in_unreadable_memory_is_reported_not_a_crash(tmp_path, how):
    """A last_error() that returned the last 100 bytes of a page with no NUL before an unmapped
    (or PROT_NONE) page, a PROT_NONE page, or (const char*)16 crashed the process (SIGSEGV in
    cffi's string()) as the registry read it for the KernelError: now the error names the
    status, the text read up to the fault and where reading stopped; the process goes on."""
    seen = _load_in_child(_folder(tmp_path, last_error=f"edge({how})"))
    assert re.fullmatch(r"KernelError: host_scale: kernel returned EX_ERR_SHAPE \(3\): " + UNREADABLE[how],
                        seen["host_scale"]), seen
    assert seen["host_good"] == "plugin"


@pytest.mark.parametrize("how", [0, 1, 2, 3])
@pytest.mark.parametrize("field", ["description", "name"])
def test_a_name_or_description_in_unreadable_memory_is_refused_not_a_crash(tmp_path, field, how):
    """A description (or name) as above crashed FactorRegistry.load (SIGSEGV): no plugin of the
    folder loaded. Now that library is refused, saying which string is unreadable and where,
    and the folder's other plugin loads and runs."""
    seen = _load_in_child(_folder(tmp_path, **{field: f"edge({how})"}))
    (row,) = [q for q in seen["plugins"] if q[0] == "host_scale.so"]
    assert row[1] == "rejected", row
    text = UNREADABLE[how].replace("Z{100}", "Z{60}")
    assert re.fullmatch(r"strings readable: expected NUL-terminated strings in readable memory, got "
                        f"{field} {text}", row[4]), row
    assert re.fullmatch(UNREADABLE[how], row[2 if field == "name" else 3]), row
    assert seen["host_good"] == "plugin"
    # (a library refused before its manifest is read gets no manifest fallback: host_scale is unknown,
    # and where its name was read, the error says why)
    assert seen["host_scale"].startswith("FactorNotFoundError: no factor named 'host_scale'" + (
        " (host_scale.so: strings readable: expected NUL" if field == "description" else ": known are")), seen


def _mapped(data: bytes) -> tuple:
    """(mmap, address) of two readable pages holding ``data`` at their start."""
    mm = mmap.mmap(-1, 2 * mmap.PAGESIZE)
    mm[:len(data)] = data
    return mm, ctypes.addressof(ctypes.c_char.from_buffer(mm))


@pytest.mark.parametrize("reader", ["process_vm_readv", "pipe"])
def test_the_reader_reads_across_pages_and_stops_at_nul_or_limit(monkeypatch, reader):
    """Readable strings read as before: across a page boundary, up to the NUL, at most the limit."""
    if reader == "pipe":
        monkeypatch.setattr(_cstring, "_readv", None)
    elif _cstring._readv is None:
        pytest.skip("no process_vm_readv here")
    page = mmap.PAGESIZE
    mm, base = _mapped(b"a" * (page - 3) + b"bcdef\0gh\0")
    assert _cstring.read(base + page - 10, 100) == (b"aaaaaaabcdef", None)
    assert _cstring.read(base + page - 10, 5) == (b"aaaaa", None)
    assert _cstring.read(base + page - 10, 0) == (b"", None)
    assert _cstring.read(base, 3 * page) == (b"a" * (page - 3) + b"bcdef", None)
    assert _c_text(abi.ffi.cast("char*", base + page + 3)) == ("gh", "")
    del mm


def test_c_text_of_a_string_past_the_limit_says_so():
    s = abi.ffi.new("char[]", b"x" * (PLUGIN_STRING_BYTES + 5))
    text, cut = _c_text(s)
    assert text == "x" * PLUGIN_STRING_BYTES and cut == f"more than {PLUGIN_STRING_BYTES} bytes; the rest not read"
    assert _c_text(abi.ffi.NULL) == ("", "")


def test_a_process_vm_readv_refused_by_seccomp_turns_to_the_pipe(monkeypatch):
    """Where a seccomp filter answers process_vm_readv with EPERM (or a kernel without it with
    ENOSYS), strings are read through the pipe from then on, not reported unreadable."""
    calls = []

    def refused(*args):
        calls.append(args)
        ctypes.set_errno(1)   # EPERM
        return -1
    monkeypatch.setattr(_cstring, "_readv", refused)
    mm, base = _mapped(b"plugin name\0")
    assert _cstring.read(base, 100) == (b"plugin name", None)
    assert _cstring.read(base + 7, 100) == (b"name", None)
    assert len(calls) == 1 and _cstring._readv is None
    del mm

"""Reading a NUL-terminated string at an address a plugin handed over, without trusting it.

cffi's ``ffi.string(ptr, n)`` reads byte by byte up to a NUL or n bytes: a plugin whose name,
version, description or last_error() text had no NUL before an unmapped or PROT_NONE page, or
was a wild pointer ((const char*)16), crashed the whole process with SIGSEGV, where a bad
plugin is to be reported and skipped. read() has the kernel copy the bytes instead, one chunk
within one page at a time (a page is readable whole or not at all), so unreadable memory comes
back as an error (EFAULT), not a signal: process_vm_readv(2) on this process, or, where that is
not permitted (ENOSYS, EPERM: a seccomp filter, a kernel without it, not Linux), write(2) of the
chunk into a pipe, read back.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os

PAGE = mmap.PAGESIZE


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_write = _libc.write
_write.argtypes, _write.restype = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_ssize_t
_readv = getattr(_libc, "process_vm_readv", None)   # None: the pipe (set so where it is refused)
if _readv is not None:
    _readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                       ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]
    _readv.restype = ctypes.c_ssize_t


def _copy(addr: int, size: int) -> bytes:
    """The ``size`` bytes at ``addr`` (all in one page), or b'' where they are unreadable."""
    global _readv
    buf = ctypes.create_string_buffer(size)
    readv = _readv
    if readv is not None:
        got = readv(os.getpid(), _IOVec(ctypes.addressof(buf), size), 1, _IOVec(addr, size), 1, 0)
        if got >= 0:
            return buf.raw[:got]
        if ctypes.get_errno() == errno.EFAULT:
            return b""
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
            _readv = None   # not permitted in this process: the pipe from now on
    r, w = os.pipe()   # (one chunk <= PIPE_BUF: written whole or not at all)
    try:
        return os.read(r, size) if _write(w, addr, size) == size else b""
    finally:
        os.close(r)
        os.close(w)


def read(addr: int, limit: int) -> tuple:
    """(data, fault): the bytes at ``addr`` up to the first NUL (not included) or ``limit`` bytes,
    and None; or, where unreadable memory comes first, the bytes before it and its address."""
    out, n = [], 0
    while n < limit:
        size = min(PAGE - (addr + n) % PAGE, limit - n)
        chunk = _copy(addr + n, size)
        end = chunk.find(b"\0")
        if end >= 0:
            out.append(chunk[:end])
            break
        out.append(chunk)
        n += len(chunk)
        if len(chunk) < size:
            return b"".join(out), addr + n
    return b"".join(out), None

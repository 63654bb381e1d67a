"""The factor registry: loads plugins, checks them against the hardware, dispatches calls.

``FactorRegistry.load("factors/")`` checks every ``*.so`` in the folder before running any
of its code (its SHA-256 against a lock file, if given; the GPU code embedded in it against the
hardware's compute capability; optionally a probe in a child process), opens it with its own
cffi handle, reads the ABI version it was built with, calls its ``ex_get_factor`` with the
hardware, checks the tuning it returns (optionally runs it against its Python fallback), and
keeps each plugin as ready, shadowed or rejected with the reason. ``dispatch`` validates a call
against the factor's manifest and runs kernel -> kernel_fallback -> Python fallback, counting
which path served.
"""
from __future__ import annotations

import copy
import json
import os
import re
import sys
import threading
import warnings
import weakref
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import _cstring, _paths, abi, errors, fatbin, trust
from ._fork import renew_after_fork
# imported with the registry, not at the first fallback call (_poison_outputs): a child forked
# while another thread was inside that first import waited forever on its module lock
from . import verify as _verify   # (verify imports no registry at its top)
from ._scripts import out_of_memory
from .arrays import _KINDS, _NAME_CACHE, _TORCH_DTYPES, Bits16, TensorRef, _cupy_importable, _kind_of, no_cupy_error
from .errors import (ArgumentError, DeviceError, DeviceSideError, FactorError,
                     FactorNotFoundError, KernelError, LayoutError, one_line)
from .hardware import Hardware, resolve
from .manifest import Manifest, bool_like, fallback_problem, load_search_path, why_not_found
from .tuning import TuningTable

PATHS = ("plugin", "kernel_fallback", "python_fallback")


@dataclass
class Check:
    """One check a plugin went through: name, passed or not, and what was expected/found.

    warn: passed only because the user asked for warnings (``lock_mode="warn"``)."""
    name: str
    ok: bool
    detail: str = ""
    warn: bool = False

    @property
    def label(self) -> str:
        """'ok', 'WARN' or 'FAIL', as ``list-factors --why`` prints it."""
        return "FAIL" if not self.ok else "WARN" if self.warn else "ok"


# the checks whose failure means "not for this GPU" (no code for its architecture, or the
# library's ex_get_factor declined the hardware), not a broken library
CUDA_CODE_CHECK, HARDWARE_CHECK = "cuda code", "ex_get_factor(hw)"
HARDWARE_CHECKS = (CUDA_CODE_CHECK, HARDWARE_CHECK)


@dataclass
class Plugin:
    """A plugin library as the registry saw it. status: 'ready', 'rejected' or 'shadowed'."""
    path: Path
    status: str = "rejected"
    reason: str = ""
    name: str = ""
    factor_id: int = -1
    version: str = ""
    abi_version: int = 0
    tuning: dict = field(default_factory=dict)
    priority: int = 0
    description: str = ""
    sha256: str = ""
    cuda_code: dict | None = None   # {'sass': ['sm_90a', ...], 'ptx': ['compute_80']}; None: no fatbin
    code_known: bool = False        # the library's GPU code was read (cuda_code, or no fatbin at all)
    checks: list = field(default_factory=list)
    manifest: Manifest | None = None
    lib: object = None
    factor: object = None
    hw_c: object = None             # the ex_hardware_t* its ex_get_factor was given (its own copy)
    ident: tuple | None = None      # _file_identity of the file whose bytes were checked (None: not read)

    def check(self, name: str, ok: bool, detail: str = "", warn: bool = False) -> bool:
        """Record a check whose detail describes the outcome either way; returns ok."""
        self.checks.append(Check(name, ok, detail, warn))
        if not ok:
            self.reason = self.reason or f"{name}: {detail}"
        return ok

    def require(self, name: str, ok: bool, failure: str, passed: str = "") -> bool:
        """Record a check whose detail is only meant for a failure (``passed`` otherwise)."""
        return self.check(name, ok, passed if ok else failure)

    @property
    def broken(self) -> bool:
        """Rejected for a reason other than this GPU: some failed check is not one of
        HARDWARE_CHECKS (no code for its architecture, ex_get_factor declining the hardware)."""
        return self.status == "rejected" and not all(c.name in HARDWARE_CHECKS for c in self.checks if not c.ok)

    def version_key(self) -> tuple:
        """The version "MAJOR.MINOR.PATCH" as a tuple of ints for ordering (a part that is not
        a number counts as 0)."""
        parts = []
        for p in self.version.split("."):
            parts.append(int(p) if p.isdecimal() else 0)
        return tuple(parts)

    def as_dict(self) -> dict:
        """Everything known of this library, JSON-ready (``list-factors --json``)."""
        return {"path": str(self.path), "name": self.name, "id": self.factor_id,
                "version": self.version, "abi": abi.version_str(self.abi_version) if self.abi_version else "",
                "status": self.status, "reason": self.reason, "tuning": self.tuning,
                "priority": self.priority, "description": self.description, "sha256": self.sha256,
                "cuda_code": self.cuda_code, "checks": [c.__dict__ for c in self.checks]}


def check_tuning(t: dict, hw: Hardware, min_elem_bytes: int = 2) -> list:
    """Every check of a tuning against the hardware: a list of Check, expected vs found."""
    ws, out = hw.warp_size, []
    tpb = t["threads_per_block"]
    out.append(Check("threads_per_block <= max_threads_per_block", 1 <= tpb <= hw.max_threads_per_block,
                     f"expected 1..{hw.max_threads_per_block}, got {tpb}"))
    out.append(Check("threads_per_block multiple of warp_size", tpb % ws == 0,
                     f"expected a multiple of {ws}, got {tpb}"))
    out.append(Check("num_warps * warp_size == threads_per_block", t["num_warps"] * ws == tpb,
                     f"expected {tpb}, got {t['num_warps']} * {ws} = {t['num_warps'] * ws}"))
    out.append(Check("threads_per_block <= max_threads_per_multiprocessor",
                     tpb <= hw.max_threads_per_multiprocessor,
                     f"expected <= {hw.max_threads_per_multiprocessor} (one block must fit an SM), got {tpb}"))
    out.append(Check("shared_mem_bytes <= shared_mem_per_block_optin",
                     0 <= t["shared_mem_bytes"] <= hw.shared_mem_per_block_optin,
                     f"expected 0..{hw.shared_mem_per_block_optin}, got {t['shared_mem_bytes']}"))
    vb = t["vec_size"] * min_elem_bytes
    out.append(Check("vec_size * element bytes <= 16", t["vec_size"] in (1, 2, 4, 8, 16) and vb <= 16,
                     f"expected a power of two with vec_size * {min_elem_bytes} B <= 16 B, "
                     f"got {t['vec_size']} ({vb} B)"))
    out.append(Check("items_per_thread >= 1", t["items_per_thread"] >= 1,
                     f"expected >= 1, got {t['items_per_thread']}"))
    out.append(Check("num_stages >= 1", t["num_stages"] >= 1, f"expected >= 1, got {t['num_stages']}"))
    return out


_current_stream = {}   # 'torch' / 'cupy' -> fn(device) -> the current stream's handle (int)


def _stream_getter(kind: str):
    fn = _current_stream.get(kind)
    if fn is None:
        if kind == "torch":
            import torch
            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # fast path, no Stream object
            fn = raw if raw is not None else (lambda d: torch.cuda.current_stream(d).cuda_stream)
        else:
            import cupy
            fn = lambda d: cupy.cuda.get_current_stream().ptr  # noqa: E731 (CuPy's current device)
        _current_stream[kind] = fn
    return fn


def _stream_for(refs, device):
    """The caller's current stream: torch's if any array is a torch tensor, else CuPy's."""
    for r in refs:
        if r is not None and r.kind == "torch":
            return _stream_getter("torch")(device)
    return _stream_getter("cupy")(device)


# The kernels' C type with every pointer as intptr_t (the same calling convention on the
# 64-bit platforms plugins are built for), so a call passes Python ints without casts.
_KERNEL_INT_T = "int(*)(intptr_t, intptr_t, intptr_t *, int, int64_t *, int, intptr_t)"


def _is_capturing(stream: int) -> bool:
    """True if ``stream`` is capturing a CUDA graph (or the query itself is refused, which
    happens for the legacy stream while another stream captures)."""
    try:
        from cupy.cuda import runtime
        return bool(runtime.streamIsCapturing(stream))
    except Exception:
        return True


def _writable(obj) -> bool:
    """False for a NumPy array (or a Bits16 wrapping one) flagged read-only."""
    flags = getattr(getattr(obj, "bits", obj), "flags", None)
    return getattr(flags, "writeable", True) is not False


def _byte_spans(refs_by_name: dict) -> dict:
    """name -> (first, end) byte offsets from the array's pointer that it covers (strides may be
    any sign); arrays with no element are left out. A function of shapes and strides only, so a
    call signature's spans are computed once (the bind cache keeps them)."""
    spans = {}
    for k, r in refs_by_name.items():
        lo, hi = 0, r.itemsize
        for n, st in zip(r.shape, r.strides):
            if n == 0:
                break
            step = (n - 1) * int(st) * r.itemsize
            if step < 0:
                lo += step
            else:
                hi += step
        else:
            spans[k] = (lo, hi)
    return spans


def _check_no_overlap(factor: str, written, refs_by_name: dict, spans: dict) -> None:
    """Raises LayoutError when an array the factor writes shares memory with another argument
    (``out`` is ``hidden_states``, ``x`` is ``residual``): the kernels read and write them as
    distinct arrays, so the result would be silently wrong. Exact: the byte ranges the arrays'
    shapes and strides span first (cheap, every call), then, only where two ranges meet,
    whether a byte is really shared (views of one wider buffer need not share one)."""
    for w in written:
        sw = spans.get(w)
        if sw is None:
            continue
        rw = refs_by_name[w]
        w0, w1 = rw.ptr + sw[0], rw.ptr + sw[1]
        for k, sk in spans.items():
            if k != w:
                rk = refs_by_name[k]
                if (rw.device == rk.device and rk.ptr + sk[0] < w1 and w0 < rk.ptr + sk[1]
                        and _share_memory(rw, rk)):
                    raise LayoutError(factor, w, "memory", f"an array of its own (the factor writes it), "
                                      f"sharing no memory with '{k}'", f"one that overlaps '{k}'")


def check_writes(factor: str, m: Manifest, refs_by_name: dict, spans: dict | None = None,
                 device: int = 0, writable: dict | None = None) -> None:
    """What a factor's writes need beyond its manifest's shapes and dtypes: no written array
    shares memory with another argument (_check_no_overlap), and no written array is marked
    read-only (a promise the call must keep): on the host (device < 0) a NumPy array's flag,
    on a device a __cuda_array_interface__'s read-only data flag (TensorRef.readonly).
    ``spans``: _byte_spans(refs_by_name), when the caller has them already; ``writable``: name ->
    _writable(array) read once by the caller (else read here). Raises LayoutError."""
    _check_no_overlap(factor, m.written_names, refs_by_name,
                      _byte_spans(refs_by_name) if spans is None else spans)
    for w in m.written_names:
        r = refs_by_name.get(w)
        if r is not None and (r.readonly or device < 0 and not (
                _writable(r.obj) if writable is None else writable[w])):
            raise LayoutError(factor, w, "writable", "a writable array (the factor writes it)",
                              "a read-only array")


def _params_key(params) -> tuple:
    """The parameters of a call as part of a cache key: names, types and values (1.0 and True
    compare equal to 1 but are checked differently)."""
    return tuple((k, type(v), v) for k, v in params.items()) if params else ()


def _sealed_key(parts: list, params) -> tuple:
    """``parts`` and the parameters as one key; raises TypeError if a value is unhashable."""
    key = (*parts, _params_key(params))
    hash(key)
    return key


def _fast_key(name: str, arrays, params):
    """(key, pointers) of a call for dispatch's short path, read straight from the arrays, or
    None where it does not apply (an array of another kind, a Bits16, a dtype not seen yet, an
    unhashable parameter, anything odd: the full path then checks and reports it). The key
    holds, per non-None array, its name, kind and everything of it that the full checks read
    except the pointer (dtype name, shape, strides, device; host writability; all fields of a
    TensorRef given as such), in the form _validated_key builds from the checked description,
    so a call with an equal key differs from a checked one in its pointers only."""
    parts = [name]
    ptrs = []
    try:
        for k, v in arrays.items():
            if v is None:
                continue
            kind = _KINDS.get(type(v)) or _kind_of(v)
            if kind == "torch":
                # is_neg: a negated view of the same signature reads un-negated memory; the full
                # checks refuse it (TensorRef.of)
                parts.append((k, "torch", _TORCH_DTYPES[v.dtype][0], v.shape, v.stride(), v.get_device(),
                              v.is_neg()))
                ptrs.append(v.data_ptr())
            elif type(v) is TensorRef:
                parts.append((k, "ref", v.kind, v.dtype, v.shape, v.strides, v.device, v.contiguous,
                               v.itemsize, not v.readonly if v.device >= 0 else _writable(v.obj)))
                ptrs.append(v.ptr)
            elif kind == "numpy":
                parts.append((k, "numpy", _NAME_CACHE[v.dtype], v.shape, v.strides, v.flags.writeable))
                ptrs.append(v.__array_interface__["data"][0])
            elif kind == "cupy":
                parts.append((k, "cupy", _NAME_CACHE[v.dtype], v.shape, v.strides, v.device.id))
                ptrs.append(v.data.ptr)
            else:
                return None
        if not all(ptrs) and any(not p and (_has_elements(v) or getattr(v, "is_meta", False)) for p, v in
                                 zip(ptrs, (v for v in arrays.values() if v is not None))):
            return None   # a NULL pointer with elements behind it (fake tensors), or meta: in full
        key = _sealed_key(parts, params)
    except Exception:   # not a dict, an unseen dtype, an unhashable parameter, an odd array
        return None
    return key, ptrs


def _has_elements(v) -> bool:
    """Whether array ``v`` (NumPy, CuPy, torch or a TensorRef) holds at least one element."""
    return all(v.shape)   # a 0-d array () holds one


def null_pointer_error(factor: str, refs_by_name: dict):
    """A DeviceError naming the first array with elements but a NULL data pointer (a torch
    FakeTensor or a wrapper subclass without storage, as torch.compile traces with; a
    __cuda_array_interface__ of address 0), or None. A kernel given it would crash or fault."""
    for k, r in refs_by_name.items():
        if not r.ptr and _has_elements(r):
            return DeviceError(factor, k, "memory", "an array with memory behind its data pointer",
                               f"a NULL data pointer for an array of shape {tuple(r.shape)} (a fake "
                               "or traced tensor?)")
    return None


def _check_name(caller: str, name) -> None:
    """Raise ArgumentError naming ``caller``'s argument 'name' unless it is a str (a list
    raised a bare TypeError, unhashable; None was looked up as the factor 'None')."""
    if not isinstance(name, str):
        raise ArgumentError(caller, "name", "type", "a factor name (str)",
                            f"{type(name).__name__} {name!r:.80}")


def _validated_key(name: str, refs_by_name: dict, given_refs, writable: dict | None, params):
    """The _fast_key of a call, built from the descriptions its full checks read (not from the
    arrays again: one that changed meanwhile must not file an unchecked signature). None where
    the short path does not apply. ``given_refs``: names passed as TensorRefs; ``writable``:
    the host writability the checks read (None on a device)."""
    parts = [name]
    try:
        for k, r in refs_by_name.items():
            if k in given_refs:
                parts.append((k, "ref", r.kind, r.dtype, r.shape, r.strides, r.device, r.contiguous,
                              r.itemsize, not r.readonly if r.device >= 0 else writable[k]))
            elif isinstance(r.obj, Bits16):
                return None
            elif r.kind == "torch":
                parts.append((k, "torch", r.dtype, r.shape, r.strides, r.device, False))  # is_neg refused
            elif r.kind in ("numpy", "cupy"):
                byte_strides = tuple(st * r.itemsize for st in r.strides)
                parts.append((k, r.kind, r.dtype, r.shape, byte_strides,
                              writable[k] if r.kind == "numpy" else r.device))
            else:
                return None
        return _sealed_key(parts, params)
    except Exception:
        return None


class _FastCall:
    """What dispatch's short path needs of a checked call (FactorRegistry._remember_fast):
    abi_index maps ABI positions to the key's arrays (-1: absent or the workspace); align:
    (array, itemsize) pairs; overlap: per written array (index, span lo, hi, other arrays'
    (index, lo, hi)), byte offsets from the pointers."""
    __slots__ = ("plugin", "m", "kernel", "kernel_fallback", "abi_index", "align", "overlap", "dims",
                 "dims_c", "n_dims", "n_aux", "ws_index", "device", "host", "stream_kind",
                 "sizes", "pvals")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)


_MAX_WORKSPACE = 1 << 40   # bytes: a workspace_size beyond this (or below 0) is a plugin bug


def _dims_text(dims) -> str:
    """A dims array for a message: its first 16 values, then ', ...]' where there are more."""
    shown = list(dims)
    return f"{shown[:16]}"[:-1] + ", ...]" if len(shown) > 16 else f"{shown}"


class WorkspaceSizeError(KernelError):
    """A plugin's workspace_size returned a size outside 0..2**40 bytes, before its kernel ran:
    below 0 the plugin's bug; above 2**40 (1 TiB, more than a device holds) either that or dims
    too large for the factor (moe_fused_gemm's legal T = 2**20, H = 4096, E = K = 128, I = 768
    asks 1.3 TB: its per-slot intermediates). A KernelError (status EX_ERR_WORKSPACE, for
    callers that catch those) whose message names workspace_size's answer, not a status the
    kernel never returned."""

    def __init__(self, factor: str, need: int, dims):
        self.factor, self.status = factor, abi.EX_ERR_WORKSPACE
        self.status_name, self.need = abi.status_name(abi.EX_ERR_WORKSPACE), need
        why = ("a bug of the plugin's workspace_size" if need < 0 else
               "more scratch memory than a device holds: dims too large for this factor (or a bug "
               "of the plugin's workspace_size)")
        self.detail = (f"workspace_size returned {need} bytes for dims {_dims_text(dims)}: expected 0.."
                       f"{_MAX_WORKSPACE} (2**40); {why}, so its kernel was not called")
        RuntimeError.__init__(self, f"{factor}: {self.detail}")


class WorkspaceAllocationError(FactorError, MemoryError):
    """A workspace_size inside 0..2**40 bytes that could not be allocated (host memory, or the
    GPU's): the message names the factor, the size asked and the dims it was asked for. A
    MemoryError too, for callers that catch those."""

    def __init__(self, factor: str, need: int, dims, where: str, cause: BaseException):
        self.factor, self.need = factor, need
        super().__init__(f"{factor}: cannot allocate its workspace: workspace_size returned {need} bytes "
                         f"({_paths.bytes_text(need)}) for dims {_dims_text(dims)}; expected a size {where} can hold, "
                         f"got {type(cause).__name__}: {one_line(cause)}")


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# (\d took any script's digits: "١.٠.٠"); 1 to 18 digits each: PLUGIN_VERSION_DIGITS
_SEMVER = re.compile(r"[0-9]{1,18}\.[0-9]{1,18}\.[0-9]{1,18}")
# ex_engine's own factors, from the ABI's ex_factor_id_t (whatever manifests folder is loaded)
_BUILTIN_IDS = {v: k[len("EX_FACTOR_"):].lower() for k, v in abi.ffi.typeof("ex_factor_id_t").relements.items()
                if v <= abi.FACTOR_BUILTIN_LAST and k != "EX_FACTOR_BUILTIN_LAST"}


# The libraries this process's registries opened: address of the loaded copy's ex_get_factor ->
# {registry: what its ex_get_factor call saw (the hardware description and the EX_* environment)}. A process holds
# one copy of a library, so the settings a library keeps from ex_get_factor (and the EX_*
# variables it reads at load) are those of the last registry that opened it (_note_shared).
_OPENED: dict = {}
_OPENED_LOCK = threading.Lock()
# The copies of libraries opened in this process: address of the copy's ex_get_factor -> (the
# sha256 of the file it was opened from, or None where that is not known: the file changed
# while it was loaded; the cffi library, kept so that the copy is never closed and its address
# never reused by another). dlopen hands a path it opened before that same copy even after the
# file was replaced (a rebuild: a new inode), so a later load compares the bytes it checked
# with the copy's (_check_copy).
_COPIES: dict = {}
renew_after_fork(sys.modules[__name__], "_OPENED_LOCK")   # (and each registry's: __init__)


def _file_identity(st: os.stat_result) -> tuple:
    """What tells one file (and one version of it) from another: device, inode, size, mtime,
    and ctime, which no user can set: a rewrite in place of the same size that put the mtime
    back (os.utime, `touch -r`) passed as the file checked, so that bytes the lock and the
    checks never saw were run."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _resolved(path: Path) -> Path:
    """``path`` with its links followed, or ``path`` itself (absolute) where that cannot be
    done: a symlink loop (RuntimeError before Python 3.13, OSError after) or another OS error.
    Reading the file then fails with the reason, which the caller reports (a rejected row)."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return path.absolute()


def _path_arg(arg: str, value, what: str) -> Path:
    """``value`` as a Path, or FactorError naming ``arg`` when it is not a str or os.PathLike
    (Path() would raise a bare TypeError)."""
    if not isinstance(value, (str, os.PathLike)):
        raise FactorError(f"{arg}: expected {what}, got {type(value).__name__} {value!r:.80}")
    return Path(value)


# the most bytes of a string a library hands over (name, version, description, last_error())
# read: a 100 MB last_error was copied (twice: bytes, then str) at each error, the process's
# peak memory +290 MB for a message that keeps 500 characters of it
PLUGIN_STRING_BYTES = 1 << 16


# why _c_text stopped reading a string that went on past PLUGIN_STRING_BYTES
_NOT_READ = f"more than {PLUGIN_STRING_BYTES} bytes; the rest not read"


def _c_text(ptr) -> tuple:
    """(text, cut) of a NUL-terminated string of a library (UTF-8, undecodable bytes replaced;
    '' for NULL): at most PLUGIN_STRING_BYTES bytes of it are read, through _cstring.read, so
    that a string running into unreadable memory (or a wild pointer) is reported, not a SIGSEGV
    of the process. ``cut`` is '' where the whole string was read, else why reading stopped:
    _NOT_READ (it went on past the limit; the rest is never read), or 'unreadable string at
    0x...' / 'unreadable memory at 0x... before a NUL; the rest not read'."""
    if ptr == abi.ffi.NULL:
        return "", ""
    addr = int(abi.ffi.cast("uintptr_t", ptr))
    raw, fault = _cstring.read(addr, PLUGIN_STRING_BYTES + 1)
    if fault is not None:
        cut = (f"unreadable memory at {fault:#x} before a NUL; the rest not read" if raw
               else f"unreadable string at {addr:#x}")
    else:
        cut = _NOT_READ if len(raw) > PLUGIN_STRING_BYTES else ""
    return raw[:PLUGIN_STRING_BYTES].decode(errors="replace"), cut


_printable = errors.printable   # (the name the rest of the package imports)


PLUGIN_TEXT_LIMIT = 500   # characters of a plugin's last_error() text (and description) kept
PLUGIN_NAME_LIMIT = 250   # characters of a factor's name: '<name>.yaml' fits a file name (255 bytes)
PLUGIN_VERSION_DIGITS = 18   # digits of each number of a version (what an int64 prints)


def _plugin_text(text: str, limit: int = PLUGIN_TEXT_LIMIT, cut: str = "") -> str:
    """A plugin's free text (its last_error(), name, version, description) for a message or a
    table: printable (no raw escape sequence reaches a terminal), then cut to ``limit``
    characters, the cut said: '... (N more characters)' (errors.cut_text), or, for a string
    _c_text stopped reading (``cut``), '... (<why>)' ('(<why>)' where nothing was read)."""
    if not cut:
        return errors.cut_text(text, limit)
    return f"{_printable(text)[:limit]}... ({cut})" if text else f"({cut})"


def _last_error_text(plugin: Plugin) -> str:
    """The plugin's last_error() text ('' where it has no last_error): plugin-controlled text,
    read up to PLUGIN_STRING_BYTES, escaped and cut to length like its name and description."""
    f = plugin.factor
    if f.last_error == abi.ffi.NULL:
        return ""
    text, cut = _c_text(f.last_error())
    return _plugin_text(text, cut=cut)


def _caller_stacklevel() -> int:
    """warnings.warn's stacklevel that names the first frame outside ex_engine (the user's
    call), whatever path inside the package led to the warning."""
    f, level = sys._getframe(1), 1
    while f is not None and f.f_globals.get("__name__", "").startswith("ex_engine"):
        f, level = f.f_back, level + 1
    return level


def _load_context(hw_c) -> tuple:
    """What one ex_get_factor call depends on, for comparing two loads of one library."""
    return bytes(abi.ffi.buffer(hw_c)), _paths.plugin_env()


def _hardware_changes(before, after) -> list:
    """'field: before -> after' for each field of the ex_hardware_t ``after`` that differs from
    ``before`` (the copy a library's ex_get_factor was given, and what it was made from)."""
    out = []
    for k, _ in abi.ffi.typeof(before[0]).fields:
        a, b = getattr(before, k), getattr(after, k)
        if k == "name":
            a, b = abi.ffi.string(a), abi.ffi.string(b)   # (up to the NUL: what a reader sees)
        if a != b:
            out.append(f"{k}: {a!r} -> {b!r}")
    return out


class _Span:
    """Carries an __array_interface__ (read-only: never written, never read)."""

    def __init__(self, interface: dict):
        self.__array_interface__ = interface


def _share_memory(a, b) -> bool:
    """Whether two arrays whose byte ranges intersect really share a byte (interleaved row views
    of one wider buffer, a small array inside another's strided span, need not): NumPy's exact
    test on stand-in arrays that carry only the pointers, shapes and strides (device pointers
    too: shares_memory never reads memory). Too hard to decide: assumed shared."""
    def standin(r):
        return np.asarray(_Span({
            "data": (r.ptr, True), "shape": tuple(r.shape), "typestr": f"|V{r.itemsize}",
            "strides": tuple(int(st) * r.itemsize for st in r.strides), "version": 3}))
    try:
        return bool(np.shares_memory(standin(a), standin(b), max_work=10 ** 6))
    except getattr(np, "exceptions", np).TooHardError:   # np.TooHardError before NumPy 1.25
        return True


# The fallback module's import in a child process (probe="subprocess"): as trust's library
# probe, the child reports "done" on a pipe of its own, marked with a token read from stdin, once
# the import returned or raised; a child that ended without that line (os._exit(7) at import time,
# a crash in an extension module) or hung took the module's import down with it, and would have
# taken this process: the plugin is refused and the module never imported here.
_IMPORT_CHILD = r"""
import importlib, json, os, sys
sys.path[:] = json.loads(sys.argv[2])
_fd, _token = int(sys.argv[3]), sys.stdin.readline().strip()
try:
    importlib.import_module(sys.argv[1])
    what = "done"
except BaseException as exc:   # SystemExit too: the in-process import reports it, it ends nothing
    what = "done: " + type(exc).__name__
os.write(_fd, (_token + " " + what + "\n").encode())
os._exit(0)   # not the module's atexit handlers or threads: its import is what was probed
"""


def probe_fallback_import(module: str, timeout: float = 10.0) -> tuple:
    """Import the Python module ``module`` (a manifest's fallback 'module:function') in a child
    process with this process's sys.path. Returns (ok, detail): not ok when the child died of
    a signal, ran past ``timeout`` seconds or ended without reporting that the import returned
    (``os._exit(7)`` at import time ends the importing process, which no except clause sees).
    An import that raises, SystemExit included, is ok here: Manifest.fallback_fn reports it in
    this process without ending it."""
    rc, stages, last = trust.run_reporting_child(
        [_IMPORT_CHILD, module, json.dumps(trust.child_sys_path())], timeout)
    if stages and stages[-1].startswith("done"):
        raised = stages[-1][len("done: "):] if stages[-1].startswith("done: ") else ""
        return True, (f"child process: importing module {module!r} raised {raised} (reported below)"
                      if raised else f"child process: imported module {module!r}")
    if rc is None:
        why = f"timed out after {timeout:g} s importing it"
    elif rc < 0:
        why = f"crashed importing it: signal {trust._signal_name(-rc)}"
    else:
        why = (f"the child process ended with status {rc} while importing it (os._exit() or a "
               "C-level exit at import time" + (f"; last stderr line: {last[:300]})" if last else ")"))
    return False, (f"fallback module {module!r}: {why}; not imported in this process (it would "
                   "have ended it)")


def _mark_written(m: Manifest, arrays: dict) -> None:
    """Bump torch's version counter of each torch tensor among ``arrays`` that the call wrote
    (the manifest's outputs and inouts; torch.autograd.graph.increment_version), as torch's own
    in-place ops do: a tensor that autograd saved for a backward pass and that a factor then
    overwrote makes that backward pass raise ('modified by an inplace operation') instead of
    computing gradients from the new values. Nothing where torch is not imported."""
    if "torch" not in sys.modules:
        return
    for n in m.written_names:
        a = arrays.get(n)
        if type(a) is TensorRef:
            a = a.obj
        if a is not None and (_KINDS.get(type(a)) or _kind_of(a)) == "torch":
            _increment_version(a)


_BUMP: list = []   # [torch.autograd.graph.increment_version or None], looked up once


def _increment_version(t) -> None:
    """torch.autograd.graph.increment_version(t) (a no-op on an inference tensor), where this
    torch has it (2.1+); the function is looked up at the first call (a hot path)."""
    if not _BUMP:
        _BUMP.append(getattr(getattr(sys.modules["torch"].autograd, "graph", None), "increment_version", None))
    if _BUMP[0] is not None:
        _BUMP[0](t)


def _poison_outputs(m: Manifest, refs_by_name: dict) -> list:
    """Fill each pure output among ``refs_by_name`` (role output: not an inout array, nor an
    output that is the input, in place, whose values are the call's input) with verify's poison
    (verify.POISON_BITS: a quiet NaN with a payload for floats, 0xA5.. for integers: the int32
    topk_ids read -1515870811, outside any [0, E)), so that an element a Python fallback does
    not write is visibly wrong instead of whatever the memory held (a fallback that wrote
    nothing handed back weights 1.0 and ids 1065353216 from np.empty). Returns [(name, the
    output's bits as a signed-integer view, the pattern)] for _unwritten. Only the Python
    fallback path pays for it (one fill per output)."""
    POISON_BITS, POISON_WIDTH, poison_pattern = _verify.POISON_BITS, _verify.POISON_WIDTH, _verify.poison_pattern
    out = []
    for spec in m.tensors:
        if spec.role != "output" or (spec is m.output and m.input.same_as_output):
            continue
        ref = refs_by_name.get(spec.name)
        if ref is None or ref.dtype not in POISON_BITS or ref.size == 0:
            continue
        raw = ref.raw()
        width = POISON_WIDTH[ref.dtype]
        if raw.dtype.itemsize * 8 != width:   # a raw view of another width than the dtype's (not expected)
            continue
        view = raw.view(f"int{width}")
        view[...] = pattern = poison_pattern(ref.dtype)
        out.append((spec.name, view, pattern))
    return out


def _unwritten(poisoned: list) -> list:
    """[(name, elements still holding the poison, elements)] of the outputs _poison_outputs
    filled, for those a fallback left (partly) unwritten."""
    left = []
    for name, view, pattern in poisoned:
        n = int((view == pattern).sum())
        if n:
            left.append((name, n, view.size))
    return left


class FactorRegistry:
    """Plugins found in folders, the one chosen per factor name, and the dispatch to them.

    hardware: a Hardware, a profile name ('h200') or path, or None for the live GPU (when there
    is no GPU, the 'h200' profile, so plugins are still checked; kernels are then never called;
    a visible GPU whose properties no profile could hold raises FactorError: pass a profile).
    manifests_dir: where factor manifests live (default $EX_ENGINE_MANIFESTS, else manifests/):
    a folder, or several joined with os.pathsep, searched in order (manifest.load_search_path:
    <name>.yaml is preferred to a copy of another name in any folder, the first folder's among
    equals; tuning/ from the first folder with a hardware/ folder, else the first); a manifest
    beside a library (<name>.yaml in its folder) takes precedence. The attribute
    ``manifests_dir`` is that folder, or the folders found joined with os.pathsep.
    prefer, lock, lock_mode, probe, probe_timeout, verify, verify_timeout: see ``load``.
    The constructor loads no library (``load`` / ``load_folder`` do). Raises FactorError,
    naming the argument, for: hardware of another type, a profile that does not exist or a
    visible GPU no profile can hold; lock_mode not 'refuse'/'warn', or 'warn' without lock;
    lock not a path, True or None; probe not None/'subprocess'; verify not a bool (or 0/1);
    probe_timeout or verify_timeout not a finite number of seconds > 0; prefer not a
    {str: str or path} mapping; manifests_dir not a path, or none of its folders there (one
    that is missing, of several, is a note and skipped, as in $EX_ENGINE_MANIFESTS; with none
    of the variable's folders there, that is the error too, before any hardware profile).
    """

    def __init__(self, hardware=None, manifests_dir=None, *, prefer=None, lock=None,
                 lock_mode: str = "refuse", probe=None, probe_timeout: float = 10.0,
                 verify: bool = False, verify_timeout: float = trust.CHILD_TIMEOUT_S):
        # the manifests search path first: with none of its folders there, a hardware profile
        # looked for in it (the 'h200' of a machine without a GPU) is not the problem to name.
        # manifests_dir= and $EX_ENGINE_MANIFESTS follow one rule (_paths.usable_folders): an
        # entry that is no folder is a note and skipped; no folder at all is an error.
        if manifests_dir is not None:
            _path_arg("manifests_dir", manifests_dir, "a directory path or None")
        if manifests_dir:
            dirs, path_notes = _paths.usable_folders(manifests_dir, "manifests_dir")
        elif env := _paths.env_value("EX_ENGINE_MANIFESTS"):
            dirs, path_notes = _paths.usable_folders(env, "EX_ENGINE_MANIFESTS")
        else:
            dirs, path_notes = _paths.manifests_dirs(), []
        hw = resolve(hardware)
        self.no_gpu_note = ""
        if hw is None:
            hw = Hardware.from_profile("h200")
            from . import hardware as _hw
            why = _hw.no_device_reason if _hw.no_device_reason.startswith(_hw.NO_CUPY) else "no GPU visible"
            self.no_gpu_note = f"{why}: plugins checked against profile h200, calls use the Python fallbacks"
        if lock_mode not in ("refuse", "warn"):
            raise FactorError(f"lock_mode: expected 'refuse' or 'warn', got {lock_mode!r}")
        if lock_mode == "warn" and not lock:
            raise FactorError("lock_mode='warn': expected together with lock= (a lock file, or True), "
                              f"got lock={lock!r}")
        if probe not in (None, "subprocess"):
            raise FactorError(f"probe: expected None or 'subprocess', got {probe!r}")
        # True/False, 0/1 or a NumPy bool, as a manifest's bool parameter ('no' is truthy: it
        # would have switched verification on)
        if not bool_like(verify):
            raise FactorError(f"verify: expected True or False, got {verify!r}")
        verify = bool(verify)
        for arg, val in (("probe_timeout", probe_timeout), ("verify_timeout", verify_timeout)):
            if isinstance(val, bool) or not isinstance(val, (int, float)) or not 0 < val < float("inf"):
                raise FactorError(f"{arg}: expected a number of seconds > 0, got {val!r}")
        if not (lock is None or isinstance(lock, bool) or (isinstance(lock, (str, os.PathLike)) and str(lock))):
            raise FactorError(f"lock: expected a lock file path, True (<folder>/{trust.LOCK_NAME}) or None, "
                              f"got {lock!r}")
        if prefer is not None and not (isinstance(prefer, dict) and all(
                isinstance(k, str) and isinstance(v, (str, os.PathLike)) for k, v in prefer.items())):
            raise FactorError(f"prefer: expected a mapping {{factor name: library file name or path}}, "
                              f"got {prefer!r}")
        self.hardware: Hardware = hw
        # a malformed manifest rejects only the plugins that need it (see _find_manifest)
        self.manifest_errors: dict = {}  # file stem -> message
        # a search path (manifest.load_search_path: <name>.yaml preferred, then folder order)
        self.manifests_dirs: list = [d.absolute() for d in dirs]   # (those that are folders)
        self.manifests_dir = Path(os.pathsep.join(map(str, self.manifests_dirs)))
        self._manifest_notes: list = []   # stray copies that name a factor (load_search_path)
        self.manifests: dict = load_search_path(self.manifests_dirs, self.manifest_errors,
                                                self._manifest_notes)
        self.plugins: list = []
        self._by_path: dict = {}        # resolved library path -> its Plugin (loaded once)
        self.notes: list = []           # registry-wide remarks (e.g. a prefer= that matched nothing)
        self.prefer: dict = dict(prefer or {})
        self.lock = lock                # None, True (ex_engine.lock beside each library) or a path
        self.lock_mode = lock_mode
        self.probe = probe
        self.probe_timeout = probe_timeout
        self.verify = verify
        self.verify_timeout = verify_timeout
        self._locks: dict = {}
        self._chosen: dict = {}
        self._stats: dict = defaultdict(Counter)
        self._lock = threading.Lock()
        self._workspaces: dict = {}     # (factor, device, stream or host thread) -> buffer
        self._ws_lock = threading.Lock()
        self._retired: list = []         # grown-out-of device workspaces, dropped after a sync
        # loads into this registry run one at a time (load_folder, load_library): two threads'
        # choices (_choose) could otherwise land in either order, the later made from a plugin
        # list without the other's library. Dispatch never takes it.
        self._load_lock = threading.Lock()
        renew_after_fork(self, "_lock", "_ws_lock", "_load_lock")   # (fresh locks in a forked child)
        self._flags: dict = defaultdict(Counter)
        self._fallbacks: dict = {}
        self._fallback_checks: dict = {}   # factor name -> (fn, fallback_problem(fn)): the last one
        self._fallback_probes: dict = {}   # fallback module -> probe_fallback_import's (ok, detail)
        self._bind_cache: dict = {}     # call signature -> what bind() returned, ready for the C call
        self._fast_calls: dict = {}     # _fast_key of a valid plugin call -> _FastCall (dispatch)
        self._entries: dict = {}        # id(plugin) -> (plugin, kernel, kernel_fallback) as _KERNEL_INT_T
        # tuned launch choices: <manifests>/tuning/<device>.yaml (a malformed file is skipped)
        self.tuning: TuningTable = TuningTable.for_hardware(
            hw, _paths.home_dir(self.manifests_dirs) / "tuning", report=False)
        self.notes.extend(path_notes)   # the search path's entries that are no folder
        # the other folders' tuning files, which are not read (a user's trial: silently ignored)
        self.notes.extend(_paths.unread_tuning(self.manifests_dirs))
        self.notes.extend(f"tuning: {msg}; skipped" for msg in self.tuning.problems)
        self._tuning_notes: list = []   # the notes _note_unused_tuning made last (it redoes them)
        self._note_unused_tuning()
        self.notes.extend(f"{msg}; skipped" for msg in self.manifest_errors.values())
        self.notes.extend(self._manifest_notes)
        self.last_path: dict = {}
        self._hw_c = hw.to_c(abi.ffi)

    def __reduce_ex__(self, protocol):
        """A registry cannot be pickled (nor copied): it holds the libraries this process
        opened and their entry points. Passed to a multiprocessing worker (Pool.apply(f, (reg,)),
        'spawn' or 'fork'), it failed with "cannot pickle 're.Match' object", which named
        nothing of the registry."""
        raise TypeError("a FactorRegistry cannot be pickled or copied: it holds the plugin libraries "
                        "this process opened; load one in each process (FactorRegistry.load(...) in "
                        "the worker; a child made by fork may use its parent's)")

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, folder=None, hardware=None, manifests_dir=None, *, prefer=None, lock=None,
             lock_mode: str = "refuse", probe=None, probe_timeout: float = 10.0,
             verify: bool = False, verify_timeout: float = trust.CHILD_TIMEOUT_S) -> "FactorRegistry":
        """A registry with every ``*.so`` of ``folder`` (default: factors/) loaded and checked.

        prefer: {factor name: file name or path} -- that library wins over other ready plugins
            of the same name, whatever their version and priority.
        lock: a lock file path (``ex-engine lock``), or True for ``<folder>/ex_engine.lock``:
            a library whose SHA-256 differs from the lock, or that the lock does not list, is
            rejected before it is opened. lock_mode="warn" loads it with a warning check.
        probe: "subprocess" -- open each library and call its ex_get_factor in a child process
            first (``probe_timeout`` seconds); one that crashes or hangs there is rejected.
            Its manifest's fallback module, unless already imported (or ex_engine's own), is
            imported in a child process too (probe_fallback_import): one that ends the process
            at import (os._exit, a crash) rejects the plugin; without the probe it would end
            this one (sys.exit() at import time is caught either way: Manifest.fallback_fn).
            With verify=True the verification runs in a child process too, within
            ``verify_timeout`` seconds per library (a crash, an exit or a hang there rejects it).
            Without a probe, probe_timeout and verify_timeout are checked but not used (the CLI,
            whose --probe-timeout has no default, refuses it without --probe).
        verify: run each ready plugin against its Python fallback on its manifest's test
            shapes (device factors need a live GPU); a pass per (library sha256, GPU name) is
            remembered in $EX_ENGINE_CACHE/verified.json (default ~/.cache/ex_engine); where
            that cannot be written, the verify check says "not cached: <why>" and the next
            load verifies again.
        Raises FactorError if ``folder`` is not a directory (or not a path), the lock file is
        unreadable, or any argument is one the constructor refuses (see FactorRegistry: bad
        hardware, lock_mode, lock, probe, verify, timeouts, prefer, manifests_dir). A library
        that fails a check raises nothing: it is kept as rejected, with the reason.
        """
        folder = _paths.factors_dir() if folder is None or folder == "" else _path_arg(
            "folder", folder, "a directory path")
        if lock is True:
            lock = folder / trust.LOCK_NAME
        reg = cls(hardware=hardware, manifests_dir=manifests_dir, prefer=prefer, lock=lock,
                  lock_mode=lock_mode, probe=probe, probe_timeout=probe_timeout, verify=verify,
                  verify_timeout=verify_timeout)
        reg.load_folder(folder)
        return reg

    def load_folder(self, folder) -> list:
        """Load every ``*.so`` in ``folder`` (sorted by name); returns the new Plugin records.
        Raises FactorError if ``folder`` is not a directory (or not a path at all) or cannot be
        read (no permission to list it), or if the registry has a lock and the one that applies
        to ``folder`` is missing or malformed (also where the folder holds no library). Loads
        from several threads into one registry run one after another; dispatch meanwhile serves
        from the plugins chosen before the load, then from those chosen after it."""
        folder = _path_arg("folder", folder, "a directory path")
        if not _paths.is_dir(folder):
            problem = _paths.folder_problem(folder)
            if problem.startswith("cannot be reached"):
                raise FactorError(f"factor folder '{folder}': {problem}")
            hint = _paths.not_a_checkout() if folder == _paths.factors_dir() else ""
            where = f" (= {folder.absolute()})" if not folder.is_absolute() else ""
            if _paths.env_value("EX_ENGINE_FACTORS") and folder == _paths.factors_dir():
                where += " (from EX_ENGINE_FACTORS)"
            raise FactorError(f"factor folder '{folder}'{where}: "
                              + ("not a directory" if folder.exists() else "does not exist")
                              + (f" ({hint})" if hint else ""))
        try:   # (glob alone reads an unreadable folder as an empty one)
            with os.scandir(folder) as it:
                files = sorted(folder / e.name for e in it if e.name.endswith(".so"))
        except OSError as exc:
            raise FactorError(f"factor folder '{folder}': cannot be read ({exc.strerror or exc})") from None
        with self._load_lock:
            # the lock that applies to the folder (any file of it names the lock), read before any
            # library: a missing or malformed one raises FactorError, also for a folder without one
            lock = self._lock_for(folder / "_")
            new = [self._load_one(p) for p in files]
            self._note_missing_locked(folder, lock, {p.name for p in files})
            self._choose()
        return new

    def _note_missing_locked(self, folder: Path, lock, present: set) -> None:
        """A note per library the folder's lock (``lock``: _lock_for's (path, digests), or None)
        lists but the folder lacks (deleted or renamed since `ex-engine lock`: nothing runs from
        it, but the lock no longer describes the folder). Only for a lock that sits in
        ``folder``: a lock given by path may list several folders' files."""
        if lock is None or _resolved(lock[0].parent) != _resolved(folder):
            return
        lock_path, digests = lock
        for name in sorted(set(digests) - present):
            note = (f"lock: {_resolved(lock_path)} lists {name}, which {_resolved(folder)} does not have "
                    "(deleted or renamed since the lock was written)")
            if note not in self.notes:
                self.notes.append(note)

    def load_library(self, path) -> Plugin:
        """Load one library file; returns its Plugin record (ready or rejected, never raises
        except for an unreadable lock file, or FactorError for a ``path`` that is not a path).
        Runs one at a time with the registry's other loads (load_folder)."""
        path = _path_arg("path", path, "a library file path")
        with self._load_lock:
            p = self._load_one(path)
            self._choose()
        return p

    def _find_manifest(self, name: str, folder: Path):
        """(Manifest or None, why none): the one beside the library, else the manifests folder's."""
        beside = folder / f"{name}.yaml"
        # a link that leads nowhere (dangling, or a loop: exists() says False) is a broken
        # manifest beside the library, reported as such, not one to look past
        if beside.exists() or beside.is_symlink():
            try:
                return Manifest.load(beside), ""
            except FactorError as exc:
                return None, str(exc)
        m = self.manifests.get(name)
        if m is None and name in self.manifest_errors:
            return None, self.manifest_errors[name]
        if m is None:   # <name>.yaml may be there and say why it is no manifest of name
            files = [d / f"{name}.yaml" for d in self.manifests_dirs]
            return None, why_not_found(next((f for f in files if f.exists()), files[0]), name)
        return m, ""

    def _lock_path(self, folder: Path):
        """The lock file that applies to the libraries of ``folder``, or None (no lock)."""
        if self.lock is None or self.lock is False:
            return None
        return folder / trust.LOCK_NAME if self.lock is True else Path(self.lock)

    def _lock_for(self, path: Path):
        """(lock file path, {file name: sha256}) that applies to ``path``, or None."""
        lock_path = self._lock_path(path.parent)
        if lock_path is None:
            return None
        if lock_path not in self._locks:
            self._locks[lock_path] = trust.read_lock(lock_path)
        return lock_path, self._locks[lock_path]

    def _check_lock(self, p: Plugin) -> bool:
        lock = self._lock_for(p.path)
        if lock is None:
            return True
        lock_path, digests = lock
        want = digests.get(p.path.name)
        if want == p.sha256:
            return p.check("sha256 lock", True, f"matches {lock_path}")
        detail = (f"sha256 mismatch: lock has {want}, file has {p.sha256}" if want else
                  f"not listed in the lock (no entry for '{_printable(p.path.name)}'), file has {p.sha256}")
        detail += f" (lock {lock_path})"
        if self.lock_mode == "warn":
            self.notes.append(f"lock: {p.path.name}: {detail}; loaded anyway (lock_mode=warn)")
            warnings.warn(f"{p.path}: {detail}; loaded anyway (lock_mode=warn)", stacklevel=_caller_stacklevel())
            return p.check("sha256 lock", True, "warning: " + detail + "; loaded anyway (lock_mode=warn)",
                           warn=True)
        return p.check("sha256 lock", False, detail + "; not opened")

    def _check_cuda_code(self, p: Plugin, data: bytes) -> bool:
        """The CPU the library is built for vs this process's (check 'elf'), and the GPU code
        embedded in it vs the hardware's compute capability (no code runs)."""
        hw = self.hardware
        try:
            fatbin.check_machine(data)
        except fatbin.FatbinError as exc:   # (dlopen's own words: 'No such file or directory')
            return p.check("elf", False, f"{exc}; not opened")
        try:
            fatbin.check_segments(data)
            entries = fatbin.library_code(data)
        except fatbin.TruncatedElfError as exc:  # dlopen would map pages past the end: SIGBUS
            return p.check("elf", False, f"{exc}; not opened (dlopen of a truncated or corrupt "
                                         "library crashes the process when it touches pages past the file's end)")
        except fatbin.FatbinError as exc:
            p.check(CUDA_CODE_CHECK, True, f"not checked: {exc} (dlopen decides)")
            return True
        p.code_known = True
        if entries is None:
            return p.check(CUDA_CODE_CHECK, True, "no .nv_fatbin section (a host-only library): check skipped")
        p.cuda_code = {"sass": [e.name for e in entries if e.kind == "sass"],
                       "ptx": [e.name for e in entries if e.kind == "ptx"]}
        ok, detail = fatbin.check_code(entries, hw.cc_major, hw.cc_minor)
        return p.check(CUDA_CODE_CHECK, ok, f"{detail} ({hw.name}, cc {hw.cc_major}.{hw.cc_minor})")

    @staticmethod
    def _check_unchanged(p: Plugin, path: Path, ident: tuple) -> bool:
        """After dlopen: the file at ``path`` is still the one whose bytes were checked
        (``ident``: _file_identity when it was read), or one of the same bytes (a deploy that
        replaced it by an identical copy meanwhile). A file replaced or rewritten in between by
        other bytes (while the probe child ran, say) was opened unchecked: refused (its
        constructors ran, nothing else of it runs), and its copy marked unknown, so that later
        loads by this path, which dlopen hands the same copy, are refused too (_check_copy).
        A rewrite in place that keeps the inode, the size, the mtime and the ctime (within the
        file system's granularity) is not seen; one whose mtime was set back is (its ctime)."""
        try:
            now = _file_identity(os.stat(path))
        except OSError as exc:
            now = str(exc)
        if now == ident:
            return True
        try:   # other metadata: the same bytes again? (whichever file dlopen opened, they match)
            same = isinstance(now, tuple) and now[2] == ident[2] and trust.sha256_file(path) == p.sha256
        except OSError:
            same = False
        if same:
            return p.check("file unchanged", True, "replaced by a file of the same bytes while it was loaded")
        try:
            key = int(abi.ffi.cast("uintptr_t", p.lib.ex_get_factor))
        except (AttributeError, OSError, KeyError):
            key = None
        if key is not None:
            with _OPENED_LOCK:
                _COPIES.setdefault(key, (None, p.lib))
        return p.check("file unchanged", False,
                       f"the file changed on disk between its checks (sha256 {p.sha256}) and dlopen "
                       f"(device, inode, size, mtime or ctime differ: {ident} then {now}, and its bytes): what was "
                       "opened is not what was checked, so none of it is used (its constructors ran); this "
                       "process holds that copy by this path now: restart it to load the file")

    @staticmethod
    def _check_copy(p: Plugin, entry) -> bool:
        """The copy dlopen handed back (``entry``: its ex_get_factor) holds the bytes checked
        (p.sha256). A path opened before gives its first copy again, even after the file was
        replaced (a rebuild): running that while reporting the new file's sha256 (and passing
        its lock) would be a lie, so such a load is refused; a copy opened from the same bytes
        (a file replaced by an identical one, a hard link) is the same code and passes."""
        key = int(abi.ffi.cast("uintptr_t", entry))
        with _OPENED_LOCK:
            have = _COPIES.setdefault(key, (p.sha256, p.lib))[0]
        if have == p.sha256:
            return p.check("loaded copy", True, "this file's bytes")
        held = (f"one opened earlier from sha256 {have}" if have else
                "one of unknown bytes (its file changed while it was loaded)")
        return p.check("loaded copy", False,
                       f"this process already holds a copy of {_printable(p.path.name)} by this path, {held}, "
                       f"and dlopen handed back that copy, not this file (sha256 {p.sha256}): the file "
                       "was replaced since that copy was opened (a rebuild?); a process cannot load a "
                       "second copy by the same path: restart it to load the new build")

    def _note_shared(self, p: Plugin, entry) -> None:
        """Before ex_get_factor: if another live registry of this process opened the same file
        (``entry``: its ex_get_factor, whose address names the loaded copy) with another
        hardware description or other EX_* variables, say so (a warning check, a note, a Python
        warning): the library is one copy per process, so this call may change the settings
        that registry's calls run with (README: variables read "at load")."""
        # the loaded copy itself: dlopen hands a path it loaded before the same copy even if the
        # file was replaced since (a rebuild), and a hard link the copy of its inode
        key = int(abi.ffi.cast("uintptr_t", entry))
        mine = _load_context(self._hw_c)
        with _OPENED_LOCK:
            users = _OPENED.setdefault(key, weakref.WeakKeyDictionary())
            found = next(((r, ctx) for r, ctx in list(users.items()) if r is not self and ctx != mine), None)
            users[self] = mine
        if found is None:
            return
        other, theirs = found
        if theirs[0] != mine[0]:
            what = f"other hardware ({other.hardware.name}, {other.hardware.source})"
        else:
            a, b = dict(theirs[1]), dict(mine[1])
            diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            what = "other EX_* variables (" + ", ".join(
                f"{k}={a.get(k, '(unset)')} there, {b.get(k, '(unset)')} here" for k in diff) + ")"
        detail = (f"warning: {p.path.name} is already open in this process by another registry, "
                  f"loaded for {what}; a process holds one copy of a library, so this load's "
                  "ex_get_factor call may change the settings that registry's calls run with "
                  "(variables a library reads at load: README's table; load each registry from its "
                  "own copy of the folder to keep them apart)")
        p.check("shared library", True, detail, warn=True)
        self.notes.append(f"{p.path.name}: {detail}")
        warnings.warn(f"{p.path}: {detail}", stacklevel=_caller_stacklevel())

    def _check_abi_in_file(self, p: Plugin, data: bytes) -> bool:
        """ex_abi_version read from the file's dynamic symbol table, before dlopen runs any of
        the library's code (its static constructors): a library that does not export it (one
        of another project) or was built against another ABI major is refused unopened. Where
        the file does not say (no section table, an odd symbol) dlopen and the symbol decide."""
        try:
            found = fatbin.exported_u32(data, "ex_abi_version")
        except fatbin.FatbinError as exc:
            found, why = None, str(exc)
        else:
            why = "the file's dynamic symbol table does not give it"
        if found is None:
            return p.check("abi version (file)", True, f"not read before opening: {why} (read after dlopen)")
        if found == "absent":
            return p.check("symbol ex_abi_version", False,
                           "not exported (not defined in the library's own dynamic symbol table); not opened, "
                           "so none of its code ran; build with EX_DEFINE_ABI_VERSION() from "
                           "include/ex_engine.h")
        if isinstance(found, fatbin.SymbolProblem):
            return p.check("symbol ex_abi_version", False,
                           f"expected a 4-byte data object (const uint32_t ex_abi_version, as "
                           f"EX_DEFINE_ABI_VERSION() from include/ex_engine.h defines it), got {found}; not "
                           "opened, so none of its code ran")
        p.abi_version = found
        return self._require_abi_major(p, " (read from the file; not opened, so none of its code ran)",
                                       " (read from the file, before opening)")

    @staticmethod
    def _require_abi_major(p: Plugin, failed: str = "", passed: str = "") -> bool:
        """The 'abi version' check of p.abi_version's major against the runtime's; ``failed``
        and ``passed`` say where the version was read."""
        v = abi.version_str(p.abi_version)
        if p.abi_version >> 16 == abi.ABI_VERSION_MAJOR and p.abi_version & 0xFFFF > abi.ABI_VERSION & 0xFFFF:
            # a newer minor: loaded (a minor only adds), with a warning check: what it added (a
            # status code, a factor id) this runtime does not know, and names as unknown
            return p.check("abi version", True,
                           f"warning: {v}{passed}, newer than this runtime's ABI {abi.version_str(abi.ABI_VERSION)}: "
                           f"loaded (same major); what {v} added (status codes, factor ids) is unknown "
                           "here and is reported by number", warn=True)
        return p.require("abi version", p.abi_version >> 16 == abi.ABI_VERSION_MAJOR,
                         f"expected major {abi.ABI_VERSION_MAJOR} (runtime ABI "
                         f"{abi.version_str(abi.ABI_VERSION)}), library built against {v}{failed}",
                         v + passed)

    @staticmethod
    def _dlopen_reason(exc: OSError, path: Path) -> str:
        """Why dlopen failed, from its message: a missing dependency, an unresolved symbol,
        or not a loadable shared library."""
        text = str(exc)   # dlerror's words (abi.dlopen)
        m = re.search(r"([^\s:'\"]+): cannot open shared object file", text)
        if m and Path(m.group(1)).name != path.name:
            return f"missing dependency {m.group(1)} (needed by {path.name}; check `ldd {path}`): {text}"
        m = re.search(r"undefined symbol: (\S+)", text)
        if m:
            return f"unresolved symbol {m.group(1)} (a dependency missing or of another version): {text}"
        if "the path is not valid UTF-8" in text:   # abi.dlopen's own refusal, before any dlopen
            return text
        return f"not a loadable shared library: {text}"

    @staticmethod
    def _same_bytes(where: Path, p: Plugin, now) -> bool:
        """The file at ``where`` (identity ``now``) still holds the bytes ``p`` was checked with
        (p.sha256): its mtime or inode changed but not its bytes (a `touch`, or a redeploy of
        the same build by copy and rename), which needs no restart. p.ident then becomes ``now``,
        so the file is hashed again only when it changes again."""
        if now is None or now[2] != p.ident[2]:
            return False
        try:
            same = trust.sha256_file(where) == p.sha256
        except OSError:
            return False
        if same:
            p.ident = now
        return same

    def _load_one(self, path: Path) -> Plugin:
        # the same file again (load_folder twice, say): its record, not a duplicate; a process
        # holds one copy of a library, so opening it again could not see a rebuilt file anyway.
        # Absolute (not resolved: a link's own name stays), so a later chdir changes nothing
        path = Path(path).absolute()
        where = _resolved(path)   # a symlink loop stays as named: its read fails below, reported
        slot = None
        if where in self._by_path:
            first = self._by_path[where]
            try:
                now = _file_identity(os.stat(where))
            except OSError:
                now = None
            if first.lib is None and now is not None and now != first.ident:
                # refused before it was opened (cut short while it was being copied, say) and
                # changed since: nothing of it is held, so the file as it is now is checked again
                # (its first refusal stuck, naming a file that was no longer there)
                slot = self.plugins.index(first)
                del self._by_path[where]
            else:
                if first.path != path:   # another name of that file (a link): one row, and a note
                    note = (f"{_printable(path.name)}: the same file as {_printable(first.path.name)} "
                            f"({where}); listed and loaded once, as {_printable(first.path.name)}")
                    if note not in self.notes:
                        self.notes.append(note)
                if first.lib is not None and (now or ())[:4] != (first.ident or ())[:4] \
                        and not self._same_bytes(where, first, now):   # (not ctime: a chmod)
                    note = (f"{_printable(first.path.name)}: the file changed on disk since this registry "
                            f"opened it (sha256 {first.sha256}); it keeps the copy it opened (a process "
                            "holds one copy per path): restart the process to load the new file")
                    if note not in self.notes:
                        self.notes.append(note)
                return first
        p = self._by_path[where] = Plugin(path=path)
        if slot is None:
            self.plugins.append(p)
        else:
            self.plugins[slot] = p
        if path.exists() and not path.is_file():   # a FIFO would block the read, /dev/zero never end it
            p.check("read", False, "not a regular file (a folder, a FIFO, a device or a link to one)")
            return p
        try:
            with open(path, "rb") as fh:   # the identity of the file whose bytes are checked
                st = os.fstat(fh.fileno())
                ident = p.ident = _file_identity(st)
                if st.st_size > trust.LIBRARY_LIMIT:   # (fh.read() of a 40 GB file: MemoryError)
                    p.check("read", False, _paths.too_large(st.st_size, trust.LIBRARY_LIMIT, "plugin library"))
                    return p
                data = fh.read()
        except OSError as exc:
            p.check("read", False, str(exc))
            return p
        except MemoryError:   # under the limit, but more than this process can hold
            p.check("read", False, f"{_paths.bytes_text(ident[2])} ({ident[2]} bytes): more than this process "
                    "can hold in memory to check it (MemoryError)")
            return p
        p.sha256 = trust.sha256_hex(data)
        # --- before any code of the library runs
        if not self._check_lock(p):
            return p
        if not self._check_cuda_code(p, data):
            return p
        if not self._check_abi_in_file(p, data):
            return p
        if self.probe == "subprocess":
            ok, detail = trust.probe_library(path, self.hardware, self.probe_timeout)
            if not p.check("probe (child process)", ok, detail):
                return p
        # --- open it
        try:
            p.lib = abi.dlopen(path)
        except OSError as exc:
            p.check("dlopen", False, self._dlopen_reason(exc, path))
            return p
        p.check("dlopen", True, "opened with its own handle (RTLD_LOCAL)")
        if not self._check_unchanged(p, path, ident):
            return p
        from_file = p.abi_version      # read before opening (_check_abi_in_file), or 0
        try:
            p.abi_version = int(p.lib.ex_abi_version)
        except (AttributeError, OSError, KeyError) as exc:  # cffi: KeyError for a missing variable
            p.check("symbol ex_abi_version", False,
                    f"not exported ({exc}); build with EX_DEFINE_ABI_VERSION() from include/ex_engine.h")
            return p
        if from_file and p.abi_version != from_file:
            try:
                same = trust.sha256_file(path) == p.sha256
            except OSError:
                same = False
            why = ("the file on disk is unchanged, so the library's own code (a static constructor, "
                   "run by dlopen) changed it: ex_abi_version must be a constant, EX_DEFINE_ABI_VERSION()"
                   if same else "the file changed on disk between the checks and dlopen")
            p.require("abi version (loaded)", False, f"the loaded library says {abi.version_str(p.abi_version)}, "
                      f"its file said {abi.version_str(from_file)}: {why}")
            return p
        if not from_file and not self._require_abi_major(p):
            return p
        try:
            get = p.lib.ex_get_factor
        except (AttributeError, OSError, KeyError) as exc:
            p.check("symbol ex_get_factor", False, f"not exported ({exc})")
            return p
        if not self._check_copy(p, get):
            return p
        self._note_shared(p, get)
        # its own copy of the hardware description: one library that writes through its const
        # pointer made the next ones see other hardware (and decline); kept with the plugin, as
        # a library may keep the pointer
        p.hw_c = abi.ffi.new("ex_hardware_t*", self._hw_c[0])
        f = get(p.hw_c)
        changed = _hardware_changes(self._hw_c, p.hw_c)
        if not p.require("hardware unchanged", not changed,
                         "ex_get_factor wrote to the hardware description it was given (a const "
                         f"ex_hardware_t*): {', '.join(changed)}; a library must only read it"):
            return p
        if not p.require(HARDWARE_CHECK, f != abi.ffi.NULL,
                       f"returned NULL for {self.hardware.name} ({self.hardware.source}): "
                       "the factor declines this hardware"):
            return p
        p.factor = f
        if not p.require("struct abi_version", f.abi_version == p.abi_version,
                       f"expected {abi.version_str(p.abi_version)} (the library's ex_abi_version), got "
                       f"{abi.version_str(f.abi_version)} in the struct ex_get_factor returned"):
            return p
        if not p.require("name", f.name != abi.ffi.NULL, "expected a name, got NULL"):
            return p
        # the library's strings as read (checked below), and as kept for tables and messages:
        # control characters escaped (a raw newline in version broke list-factors' table), cut
        # to length (a 1 MB name made list-factors print 10 MB, every row padded to it)
        (name, name_cut), (version, version_cut) = _c_text(f.name), _c_text(f.version)
        p.name = _plugin_text(name, PLUGIN_NAME_LIMIT, name_cut)
        p.version = _plugin_text(version, PLUGIN_VERSION_DIGITS * 3 + 2, version_cut)
        description, description_cut = _c_text(f.description)
        p.description = _plugin_text(description, cut=description_cut)
        p.factor_id = int(f.factor_id)
        p.priority = int(f.priority)
        p.tuning = {k: int(getattr(f.tuning, k)) for k in abi.TUNING_FIELDS}
        unreadable = [f"{what} {_plugin_text(text, 60, cut)}" for what, text, cut in (
            ("name", name, name_cut), ("version", version, version_cut),
            ("description", description, description_cut)) if cut and cut != _NOT_READ]
        if not p.require("strings readable", not unreadable, "expected NUL-terminated strings in readable "
                         f"memory, got {'; '.join(unreadable)}"):
            return p
        if not p.require("kernel", f.kernel != abi.ffi.NULL, "expected a kernel function, got NULL"):
            return p
        if not p.require("reserved_i32", int(f.reserved_i32) == 0,
                         f"expected 0 (include/ex_engine.h: reserved, zero), got {int(f.reserved_i32)}"):
            return p
        if not p.require("version", bool(version), "expected a version string, got NULL/empty"):
            return p
        # the header's rules on names and versions: a name is also the manifest's file stem, so
        # '../x' or '/tmp/x' would pick a manifest outside the folders; versions order plugins
        # a name past PLUGIN_NAME_LIMIT made '<name>.yaml' too long a file name (OSError out of
        # load, the whole folder unloaded); a number of 4301 digits in a version made int()
        # raise ValueError out of load where it was compared with another plugin's
        if not p.require("name is an identifier",
                         not name_cut and len(name) <= PLUGIN_NAME_LIMIT and _IDENT.fullmatch(name) is not None,
                         f"expected letters, digits and _ (the manifest's file stem), at most "
                         f"{PLUGIN_NAME_LIMIT} characters, got "
                         + (_plugin_text(repr(name), 100, name_cut) if name_cut or len(name) > PLUGIN_NAME_LIMIT
                            else repr(name))):
            return p
        if not p.require("version is MAJOR.MINOR.PATCH", not version_cut and _SEMVER.fullmatch(version) is not None,
                         f"expected three dot-separated numbers of 1 to {PLUGIN_VERSION_DIGITS} digits "
                         f"(e.g. 1.0.0), got {_plugin_text(repr(version), 100, version_cut)}"):
            return p
        p.check("name matches file stem", True,  # informative: a renamed drop-in still loads
                "yes" if p.name == path.stem
                else f"note: name '{p.name}' differs from file '{_printable(path.name)}'")
        # a negative id: the library's own struct field is wrong, whatever manifest it has (one
        # of a matching id: -5 is itself malformed, and its message would name the manifest)
        id_rule = (f"expected an id >= 0 (0-{abi.FACTOR_BUILTIN_LAST} ex_engine's own factors, "
                   f"{abi.FACTOR_BUILTIN_LAST + 1} and up third-party ones), got {p.factor_id}: ")
        if p.factor_id < 0:
            p.require("factor id", False, id_rule + "negative ids are invalid")
            return p
        m, why = self._find_manifest(p.name, path.parent)
        # the folders searched, named (a fresh user's trial: "the manifests folder" left them to guess)
        dirs = [_printable(str(d)) for d in self.manifests_dirs]
        if not p.require("manifest", m is not None,
                       why or f"expected {p.name}.yaml beside the library (in {_printable(str(path.parent))}) "
                              f"or in the manifests folder{'s' if len(dirs) > 1 else ''} {', '.join(dirs)}, "
                              "found none",
                       str(m.path) if m is not None else ""):
            return p
        if not p.require("manifest name", m.name == p.name,
                         f"{m.path} names '{m.name}', the library '{p.name}': the manifest must "
                         "name its factor as the library does"):
            return p
        p.manifest = m
        if not p.require("manifest id", m.id == p.factor_id,
                       f"expected id {m.id} (from {m.path}), library says {p.factor_id}"):
            return p
        # ids 0..EX_FACTOR_BUILTIN_LAST are ex_engine's own: a library of another name cannot take
        # one that a built-in manifest owns (it would shadow the built-in by version or priority)
        owner = _BUILTIN_IDS.get(p.factor_id) or next(
            (q.name for q in self.manifests.values() if q.id == p.factor_id), None)
        if not p.require("factor id", p.factor_id > abi.FACTOR_BUILTIN_LAST or owner == p.name,
                         f"expected an id of {abi.FACTOR_BUILTIN_LAST + 1} or more for a factor named "
                         f"'{p.name}' (ids 0-{abi.FACTOR_BUILTIN_LAST} are ex_engine's own factors), got "
                         f"{p.factor_id}: " + (f"id {p.factor_id} is reserved for ex_engine's '{owner}'" if owner
                                               else f"id {p.factor_id} is in ex_engine's reserved range")):
            return p
        gpu_code = bool(p.cuda_code and (p.cuda_code.get("sass") or p.cuda_code.get("ptx")))
        if not p.require("memory", not (m.memory == "host" and gpu_code),
                       f"manifest {m.path} says memory: host (host pointers) but the library carries GPU "
                       "code: a host factor's library must not be a CUDA one"):
            return p
        # the two sides of a workspace (include/ex_engine.h: the runtime passes workspace_size()
        # bytes as the aux input the manifest marks role: workspace; NULL means no workspace):
        # one without the other gave the kernel no workspace, or NULL where it expected one
        ws = m.aux[m.workspace_index].name if m.workspace_index is not None else None
        has_fn = f.workspace_size != abi.ffi.NULL
        if not p.require("workspace", has_fn == (ws is not None),
                         f"the library's workspace_size is set but manifest {m.path} has no aux entry "
                         "with role: workspace, so the kernel would get no workspace; add one (e.g. "
                         "{name: workspace, role: workspace}) or set workspace_size to NULL" if has_fn else
                         f"manifest {m.path} declares a workspace ('{ws}', role: workspace) but the "
                         "library's workspace_size is NULL (no workspace), so the kernel would get NULL "
                         "there; export a workspace_size or remove the entry",
                         f"'{ws}', sized by the library's workspace_size" if has_fn else
                         "none (workspace_size NULL, no role: workspace entry)"):
            return p
        if m.memory != "host" and not gpu_code and p.code_known:
            # allowed (its kernels may live in a library it links, or be loaded at run time), said
            # a warning and a note: a host factor whose manifest left out memory: host loads as
            # a device factor, and on a GPU its C kernel would be handed device pointers
            detail = ("warning: none in the library itself although the manifest says memory: device (the "
                      "default): its kernels must come from a library it links or loads (not checked); a "
                      "kernel that reads host memory needs memory: host in its manifest")
            p.check("gpu code", True, detail, warn=True)
            self.notes.append(f"{_printable(p.path.name)}: gpu code: {detail} ({m.path})")
        if m.fallback:
            mod = m.fallback.partition(":")[0]
            if self.probe == "subprocess" and mod not in sys.modules and mod.partition(".")[0] != "ex_engine":
                # a module that ends the process at import (os._exit) cannot be caught here: its
                # import is tried in a child first (once per module; ex_engine's own are known)
                hit = self._fallback_probes.get(mod)
                if hit is None:
                    hit = self._fallback_probes[mod] = probe_fallback_import(mod, self.probe_timeout)
                ok, detail = hit
                # an import that raised is the next check's failure: here a warning, not an ok
                if not p.check("python fallback probe (child process)", ok, detail,
                               warn=ok and detail.endswith("(reported below)")):
                    return p
            try:
                problem = fallback_problem(m.fallback_fn())
                ok, detail = (False, f"manifest {m.path}: fallback: {m.fallback!r}: {problem}") if problem \
                    else (True, m.fallback)
            except FactorError as exc:
                ok, detail = False, str(exc)
            if not p.require("python fallback", ok, detail):
                return p
        elem = min((abi.DTYPE_BYTES.get(d, 4) for d in (m.input.dtypes or ["float32"])), default=4)
        for c in check_tuning(p.tuning, self.hardware, elem):
            p.check(c.name, c.ok, c.detail)  # "expected <= limit, got value": informative either way
        if any(not c.ok for c in p.checks):
            return p
        if self.verify:
            from .verify import verify_at_load
            try:
                ok, detail = verify_at_load(self, p)
            except Exception as exc:  # a manifest's test_shapes or tolerance it cannot use, say
                ok, detail = False, f"could not run: {type(exc).__name__}: {exc} (manifest {m.path})"
            if not p.check("verify", ok, detail):
                return p
        p.status, p.reason = "ready", ""
        return p

    def _preferred(self, p: Plugin) -> bool:
        """True if the user's ``prefer`` names this library (by file name or path) for its factor."""
        want = self.prefer.get(p.name)
        if not want:
            return False
        want = Path(want)
        if want.name != p.path.name:
            return False
        return len(want.parts) == 1 or _resolved(want) == _resolved(p.path)

    @staticmethod
    def _win_rule(win: Plugin, q: Plugin, prefer_text: str) -> str:
        """Why ``win`` beats ``q``: the user's choice, then version, then priority, then file name,
        then the order of loading."""
        if prefer_text:
            return f"the user's choice (prefer={prefer_text}) overrides version and priority"
        if win.version_key() != q.version_key():
            return f"higher version wins: {win.version} over {q.version}"
        if win.priority != q.priority:
            return f"same version {win.version}, higher priority wins: {win.priority} over {q.priority}"
        if win.path.name != q.path.name:
            return (f"same version {win.version} and priority {win.priority}: the file name that sorts "
                    f"last wins ({win.path.name} after {q.path.name})")
        return (f"same version {win.version}, priority {win.priority} and file name: the one loaded last "
                f"wins ({win.path} over {q.path})")

    def _note_unused_tuning(self) -> None:
        """Notes for the tuning file's tables that can never apply, against every manifest known
        so far (the manifests folder's and those found beside libraries); recomputed after each
        load, so a table for a plugin whose manifest sits beside it is not called unused. With
        them the tuning's remarks, which TuningTable.check redoes with the file that serves (a
        file for this GPU none of whose tables can be used is passed over for the next): the
        notes say which file serves as check() last decided, not as it was first read."""
        made = set(self._tuning_notes)
        self.notes = [n for n in self.notes if n not in made]
        known = dict(self.manifests)
        # (a rejected library serves nothing: its manifest makes no table usable, so a file whose only
        # table is for it does not displace the next file: a review of the file choice, session 59)
        known.update({p.name: p.manifest for p in self.plugins
                      if p.manifest is not None and p.status != "rejected"})
        before = (self.tuning.path, set(self.tuning.refused))
        unused = self.tuning.check(known)
        self._tuning_notes = [f"tuning: {msg}" for msg in (*self.tuning.remarks, *unused)]
        self.notes.extend(self._tuning_notes)
        if (self.tuning.path, set(self.tuning.refused)) != before:   # calls remembered with a tuned
            self._forget_calls()   # dim from a table now set aside (or back in use, or of another file) bind again

    def _choose(self) -> None:
        """Pick one ready plugin per name: the user's ``prefer``, else highest version, then
        priority, then file name. Then one plugin per factor id. Losers say who won and why.
        A change of the chosen plugins drops the calls remembered for the old ones (their dims
        came from the old plugin's manifest). The choice is made in a dict of its own and
        replaces ``_chosen`` whole: threads dispatching meanwhile see the old choice or the new
        one, never an empty or half-filled one (they raised FactorNotFoundError, or took the
        Python fallback, for a factor whose plugin stayed loaded and ready)."""
        self._note_unused_tuning()
        before = dict(self._chosen)
        self.notes = [n for n in self.notes if not n.startswith("prefer:")]
        by_name = defaultdict(list)
        for p in self.plugins:
            if p.status in ("ready", "shadowed"):
                p.status = "ready"
                by_name[p.name].append(p)
        chosen = {}
        # last tie-break: the one loaded last (a later load_folder's copy of the same file name,
        # a hot reload into a new folder; by the full path, 'v9' beat 'v11' and a folder
        # reloaded since kept serving: a leak trial, session sixty-three)
        loaded = {id(p): i for i, p in enumerate(self.plugins)}
        rank = lambda q: (self._preferred(q), q.version_key(), q.priority, q.path.name, loaded[id(q)])  # noqa: E731
        for name, ps in by_name.items():
            ps.sort(key=rank, reverse=True)
            win = ps[0]
            chosen[name] = win
            pref = f"{{{name!r}: {str(self.prefer[name])!r}}}" if self._preferred(win) else ""
            for q in ps[1:]:
                q.status = "shadowed"
                q.reason = (f"another plugin of '{name}' wins: {win.path.name} (version {win.version}, "
                            f"priority {win.priority}) over this one (version {q.version}, priority "
                            f"{q.priority}); rule: {self._win_rule(win, q, pref)}")
        known = set(self.manifests) | {p.name for p in self.plugins if isinstance(p.name, str)}
        for name, want in self.prefer.items():
            win = chosen.get(name)
            if win is None and name not in known:   # a misspelt name, say
                self.notes.append(f"prefer: {name} -> {want}: no factor named {name!r} (known: "
                                  f"{', '.join(sorted(known)) or 'none'})")
            elif win is None or not self._preferred(win):
                self.notes.append(f"prefer: {name} -> {want}: no ready plugin of that name from that file; "
                                  + (f"chose {win.path.name} by version/priority" if win else
                                     f"no plugin of {name!r} is ready"))
        ids = defaultdict(list)
        for p in chosen.values():
            ids[p.factor_id].append(p)
        for fid, ps in ids.items():
            if len(ps) > 1:
                ps.sort(key=rank)
                win = ps[-1]
                for q in ps[:-1]:
                    pref = (f"{{{win.name!r}: {str(self.prefer[win.name])!r}}}"
                            if self._preferred(win) and not self._preferred(q) else "")
                    rule = "both claim it; " + self._win_rule(win, q, pref)
                    q.status = "rejected"
                    q.reason = f"factor id {fid} already taken by '{win.name}' ({win.path.name}); rule: {rule}"
                    del chosen[q.name]
                    # two factors of different names on one id: one of them is lost, which only its
                    # own row said (list-factors exits 0 on the other); a note names both
                    # (kept across later loads: the loser stays rejected, and _choose no longer sees it)
                    note = (f"factor id {fid}: claimed by '{win.name}' ({win.path.name}) and '{q.name}' "
                            f"({q.path.name}); '{q.name}' is rejected ({rule}): give each factor its own id "
                            "(its manifest's id and the library's)")
                    if note not in self.notes:
                        self.notes.append(note)
        self._chosen = chosen
        if any(chosen.get(n) is not p for n, p in before.items()):   # (a new name: nothing to drop)
            self._forget_calls()
        self._note_unserved()

    def _note_unserved(self) -> None:
        """A note per factor whose manifest is known (the manifests folder's) and whose every
        library was rejected: its calls go to the Python fallback, or raise without one, and
        nothing else said so before a call's stats (a plugin author's trial, session 32). A
        fallback that a library's load found cannot be loaded (a module that does not import,
        a function of another signature) is no fallback: its calls raise, and the note says so
        (it said they went to it). Recomputed after each load, so a library loaded later that
        is ready drops it."""
        marker = "no ready plugin"
        self.notes = [n for n in self.notes if not (n.startswith("fallback:") and marker in n)]
        seen = set()
        for p in self.plugins:
            name = p.name or p.path.stem   # (refused unopened: no name read; its stem)
            if p.status != "rejected" or name in seen or name in self._chosen or name not in self.manifests:
                continue
            seen.add(name)
            m = self.manifests[name]
            broken = next((c.detail for q in self.plugins if q.name == name and q.manifest is not None
                           and q.manifest.fallback == m.fallback for c in q.checks
                           if not c.ok and c.name.startswith("python fallback")), None) if m.fallback else None
            if broken is not None:
                why = "" if broken in p.reason else f" ({broken})"
                fb = (f"its Python fallback {m.fallback} cannot be loaded{why}, so its calls raise "
                      "FactorError unless set_fallback gives it a Python fallback")
            elif m.fallback:
                # whether it imports is known only where a library's load got to its check
                # (ex_engine's own fallbacks are known to import, as the load's probe takes them)
                tried = m.fallback.partition(":")[0].partition(".")[0] == "ex_engine" or any(
                    q.name == name and q.manifest is not None and q.manifest.fallback == m.fallback
                    and any(c.name == "python fallback" for c in q.checks) for q in self.plugins)
                fb = f"its calls go to the Python fallback {m.fallback}" + (
                    "" if tried else " if it imports (not checked: the library was rejected before that check)")
            else:
                fb = "its calls raise FactorError unless set_fallback gives it a Python fallback"
            # every library of that name that was rejected (a user's trial: of two, one was named)
            rej = [q for q in self.plugins if q.status == "rejected" and (q.name or q.path.stem) == name]
            which = (f"{_printable(p.path.name)} was rejected ({p.reason})" if len(rej) < 2 else
                     f"{len(rej)} libraries were rejected ("
                     + "; ".join(f"{_printable(q.path.name)}: {q.reason}" for q in rej) + ")")
            self.notes.append(f"fallback: {name}: {marker}: {which}; {fb}; see list-factors --why")

    def _forget_calls(self) -> None:
        """Drop every remembered call (bind cache, short path): what they hold (dims, the tuned
        ones included; the plugin) was derived from a state that changed."""
        self._bind_cache.clear()
        self._fast_calls.clear()

    # ------------------------------------------------------------------ queries
    def get(self, name: str) -> Plugin | None:
        """The chosen ready plugin for factor ``name`` (a str), or None. Raises ArgumentError
        naming the argument 'name' if it is not a str."""
        if type(name) is not str:
            _check_name("get", name)
        return self._chosen.get(name)

    def manifest(self, name: str) -> Manifest:
        """The manifest of factor ``name`` (a str). Raises FactorNotFoundError for an unknown
        name, ArgumentError naming the argument 'name' for one that is not a str."""
        return self._manifest(name, "manifest")

    def _manifest(self, name, caller: str) -> Manifest:
        """manifest(), its ArgumentError for a name that is no str naming ``caller``."""
        if type(name) is not str:
            _check_name(caller, name)
        p = self._chosen.get(name)
        if p is not None and p.manifest is not None:
            return p.manifest
        if name in self.manifests:
            return self.manifests[name]
        why = self.manifest_errors.get(name)   # its manifest refused (malformed, or claimed twice)
        if not why:   # a library of that name set aside for want of its manifest (a manifests
            why = next((f"{_printable(p.path.name)}: {p.reason}" for p in self.plugins   # folder
                        if p.name == name and p.manifest is None and p.reason), "")       # without it)
        if not why:   # a library for that name rejected at load (its id, its fallback, ABI 2.0, ...):
            why = next((f"{_printable(p.path.name)} was rejected: {p.reason}; see list-factors --why"
                        for p in self.plugins if p.status == "rejected" and p.reason   # (unopened or
                        and (p.name == name or (not p.name and p.path.stem == name))), "")  # nameless: its stem)
        raise FactorNotFoundError(f"no factor named '{name}'" + (f" ({why})" if why else "") +
                                  f": known are {sorted(set(self.manifests) | set(self._chosen))}")

    def stats(self) -> dict:
        """name -> {'plugin': n, 'kernel_fallback': n, 'python_fallback': n, 'errors': n}: the
        calls each path served, and the calls that raised instead (an argument refused, a
        kernel's error status, no path that took the call, a Python fallback that failed)."""
        with self._lock:
            return {n: {k: c.get(k, 0) for k in (*PATHS, "errors")} for n, c in self._stats.items()}

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, name: str, arrays: dict, params: dict | None = None) -> str:
        """Validate and run factor ``name`` on ``arrays`` (names as in its manifest).

        arrays: {argument name: NumPy/CuPy array, torch tensor, __cuda_array_interface__
        object, Bits16 or TensorRef, or None for an absent optional one}; params: {parameter
        name: value} or None (the manifest's defaults).
        Returns the path that served: 'plugin', 'kernel_fallback' or 'python_fallback'.
        A low-level call: it writes the outputs through their pointers and applies none of
        torch's in-place rules (a leaf that requires grad, an inference tensor outside
        torch.inference_mode()); the ops in ex_engine.ops refuse those as torch does.
        Raises, each naming the factor (and the argument where one is at fault):
        FactorNotFoundError for an unknown ``name`` (ArgumentError if it is not a str);
        before any C call, an ArgumentError subclass (DTypeError, ShapeError, LayoutError,
        DeviceError) if an argument breaks the manifest (also: an unknown argument name,
        ``arrays`` not a dict, ``params`` not a dict or None, a tuned dim's value from
        set_tuning outside the manifest's allowed values), DeviceError for arrays on another
        device than the registry's or in device memory for a host factor; KernelError if a
        kernel returns an error status (named); FactorError when no path took the call (no
        ready plugin or both C paths declined, and no Python fallback) or the Python fallback
        raised or returned something other than its flags (its own FactorError or MemoryError
        passes as it is), or left an output (partly) unwritten. Every
        one counts in stats()' 'errors' but FactorNotFoundError and the ArgumentError for a
        name that is not a str (neither names a factor to count it under).

        Host time: a call whose arrays have the dtypes, shapes, strides, devices (and, on the
        host, writability) of an earlier valid call to the same plugin, with equal parameters,
        takes a short path (_fast_key, _dispatch_fast) that reads only what can differ
        (pointers: alignment, overlap) straight from the arrays; anything else is checked in
        full (_dispatch_full) and raised from there.
        """
        got = _fast_key(name, arrays, params)
        if got is not None:
            e = self._fast_calls.get(got[0])
            if e is not None and self._chosen.get(name) is e.plugin:
                path = self._dispatch_fast(e, name, arrays, got[1])
                if path is not None:
                    return path
        return self._dispatch_full(name, arrays, params)

    def _dispatch_fast(self, e: "_FastCall", name: str, arrays: dict, ptrs: list) -> str | None:
        """Run a call whose signature matched ``e``: None (nothing run) when a pointer breaks a
        rule (misaligned, overlapping an array the factor writes) or a None-valued name is not
        an argument, so that _dispatch_full checks it all again and raises the error."""
        if len(arrays) != len(ptrs) and not e.m.user_names.issuperset(arrays):
            return None
        for i, itemsize in e.align:
            if ptrs[i] % itemsize:
                return None
        for wi, lo, hi, others in e.overlap:
            w0, w1 = ptrs[wi] + lo, ptrs[wi] + hi
            for ki, klo, khi in others:
                p = ptrs[ki]
                if p + klo < w1 and w0 < p + khi:
                    return None   # ranges meet: whether a byte is shared is decided in full
        at = [ptrs[j] if j >= 0 else 0 for j in e.abi_index]
        aux = at[2:] or [0]
        plugin, device = e.plugin, e.device
        if e.host:
            stream = 0
        else:
            stream = _stream_getter(e.stream_kind)(device)
        if e.ws_index is not None:   # workspace_size asked on every call, as on the full path
            buf = self._workspace(plugin, e.dims, device, threading.get_ident() if e.host else stream)
            aux[e.ws_index] = 0 if buf is None else (buf.ctypes.data if e.host else buf.data.ptr)
        path = self._invoke(plugin, e.kernel, e.kernel_fallback, at[0], at[1], aux, e.n_aux, e.dims_c,
                            e.n_dims, stream)
        if path is None:   # both C paths declined: the Python fallback, on the arrays described
            refs_by_name = {k: v if type(v) is TensorRef else TensorRef.of(v, k)
                            for k, v in arrays.items() if v is not None}
            path = self._python_fallback(name, e.m, plugin, refs_by_name, e.sizes, e.pvals, device)
        _mark_written(e.m, arrays)
        self._count(name, path)
        self.last_path[name] = path
        return path

    def _dispatch_full(self, name: str, arrays: dict, params) -> str:
        """dispatch with every argument checked (a first call, or one whose signature or
        pointers the short path did not take); a valid call to a plugin is remembered under
        the _validated_key of what was checked, for the short path."""
        m = self._manifest(name, "dispatch")
        try:
            refs_by_name = self._describe(name, m, arrays, params)
        except FactorError:
            self._count(name, "errors")
            raise
        # A call with the same dtypes, shapes, strides, device and params (values and types) as
        # an earlier valid one needs only its pointers checked: the bound dims are reused (host
        # overhead); anything else is bound, i.e. checked in full, again.
        sig = (name, tuple((k, r.dtype, r.shape, r.strides, r.device, r.contiguous)
                           for k, r in refs_by_name.items()),
               _params_key(params))
        try:
            hit = self._bind_cache.get(sig)
            cacheable = True
        except TypeError:  # an unhashable parameter value (a 0-d array, a list): bound, not cached
            hit, cacheable = None, False
        dims_c = None
        try:
            # a misspelt array name would otherwise be dropped silently (on a cache hit every
            # non-None name is known already: only None values need the check)
            if (hit is None or len(arrays) != len(refs_by_name)) and not m.user_names.issuperset(arrays):
                raise self._unknown_argument(m, arrays)
            if hit is None:
                refs, dims, sizes, pvals, device = m.bind(refs_by_name, params, self._tuned_value(m))
                if len(self._bind_cache) > 4096:
                    self._bind_cache.clear()
                tensors = m.tensors
                dims_c = abi.ffi.new("int64_t[]", dims)
                spans = _byte_spans(refs_by_name)
                if cacheable:
                    self._bind_cache[sig] = ([s.name if not s.same_as_output else m.output.name
                                          for s in tensors], [s.name for s in tensors],
                                         m.workspace_index, dims, sizes, pvals, device, dims_c, spans)
            else:
                order, names, ws, dims, sizes, pvals, device, dims_c, spans = hit
                refs = [refs_by_name.get(n) for n in order]
                for r, spec_name in zip(refs, names):
                    if r is not None and r.ptr % r.itemsize:
                        m.check_alignment(spec_name, r)   # raises the LayoutError
                if ws is not None:
                    refs[2 + ws] = None
            writable = self._check_memory(name, m, refs_by_name, spans, device)
        except FactorError:
            self._count(name, "errors")
            raise
        plugin = self._chosen.get(name)
        path = None
        if plugin is not None and m.memory == "host":
            if device >= 0:
                self._count(name, "errors")
                raise DeviceError(name, m.tensors[0].name, "device", "host memory (a host factor)",
                                  f"cuda:{device}")
        elif plugin is not None and device >= 0 and self.hardware.live:
            if device != self.hardware.device_id:
                self._count(name, "errors")
                raise DeviceError(name, m.tensors[0].name, "device", f"cuda:{self.hardware.device_id} "
                                  "(the registry's device)", f"cuda:{device}")
        else:
            plugin = None   # the Python fallback serves
        if plugin is not None:
            key = _validated_key(name, refs_by_name, {k for k, v in arrays.items() if type(v) is TensorRef},
                                 writable, params) if cacheable else None
            if key is not None:
                self._remember_fast(key, plugin, m, refs_by_name, dims, dims_c, sizes, pvals, device, spans)
            path = self._call_plugin(plugin, m, refs, dims, host=m.memory == "host", dims_c=dims_c)
        if path is None:
            path = self._python_fallback(name, m, self._chosen.get(name), refs_by_name, sizes, pvals,
                                         device)
        _mark_written(m, arrays)
        self._count(name, path)
        self.last_path[name] = path
        return path

    def _python_fallback(self, name: str, m: Manifest, plugin, refs_by_name: dict, sizes: dict,
                         pvals: dict, device: int) -> str:
        """Run ``name``'s Python fallback (set_fallback's, else the manifest's) on checked
        arrays; returns 'python_fallback'. Raises FactorError (why no plugin took the call)
        when there is none, or one that cannot be loaded, or that raised (then naming the
        factor and the fallback; a FactorError or MemoryError of its own passes as it is), or
        that returned something other than None, a Counter of flag texts or a list of them, or
        that left an element of an output unwritten; each counts in stats()' errors. Each pure
        output is poisoned first (_poison_outputs)."""
        try:
            flags = self._run_python_fallback(name, m, plugin, refs_by_name, sizes, pvals, device)
        except (FactorError, MemoryError):
            self._count(name, "errors")
            raise
        if flags:
            with self._lock:
                self._flags[name].update(flags)
        return "python_fallback"

    def _run_python_fallback(self, name: str, m: Manifest, plugin, refs_by_name: dict, sizes: dict,
                             pvals: dict, device: int):
        """_python_fallback's work, uncounted: the fallback's device flags (a Counter or None)."""
        fn = self._fallbacks.get(name) or m.fallback_fn()
        if fn is None:
            if plugin is None:
                why = "no ready plugin of that name is loaded"
            elif m.memory != "host" and device < 0:
                why = ("the arrays are in host memory and its plugin runs on the GPU (pass device "
                       "arrays: CuPy or torch on cuda)")
            elif m.memory != "host" and not self.hardware.live:
                why = (f"the registry has no live GPU (plugins checked against the profile "
                       f"{self.hardware.name}) and so calls no device plugin")
            else:   # a plugin was called: it (and its kernel_fallback, where it has one) said EX_FALLBACK
                why = ("its plugin and kernel_fallback declined the call" if plugin.factor.kernel_fallback
                       != abi.ffi.NULL else "its plugin declined the call (EX_FALLBACK) and it has no kernel_fallback")
            raise FactorError(f"{name}: no plugin took the call ({why}) and the manifest names no "
                              "Python fallback")
        problem = self._fallback_problem(name, fn)
        if problem:   # the manifest's, where no plugin's load checked it (a manifest-only factor)
            raise FactorError(f"{name}: the Python fallback {self._fallback_label(name, m, fn)}: {problem}; "
                              "not called")
        if device >= 0 and not _cupy_importable():   # its views of device memory are CuPy's
            hit = next(((k, r) for k, r in refs_by_name.items() if r.on_device), None)
            if hit is not None:
                raise no_cupy_error(name, hit[0], hit[1].obj)
        poisoned = _poison_outputs(m, refs_by_name)   # an output it does not write stays visibly wrong
        try:
            flags = fn(refs_by_name, sizes, pvals)
        except (FactorError, MemoryError):   # its own error, naming the factor already; out of
            raise                            # memory (NumPy's, CuPy's OutOfMemoryError) stays what
        except (Exception, SystemExit) as exc:   # it is, for callers that catch it; sys.exit() in a
            # fallback is its error too, not the caller's exit (Ctrl-C, KeyboardInterrupt, stays itself)
            raise FactorError(f"{name}: the Python fallback {self._fallback_label(name, m, fn)} raised "
                              f"{type(exc).__name__}: {exc}") from exc
        if isinstance(flags, (list, tuple, set, frozenset)) and all(isinstance(f, str) for f in flags):
            flags = Counter(flags)   # flag texts, one slot each (Counter.update took them before)
        if flags is not None and not (isinstance(flags, Mapping) and all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for k, v in flags.items())):
            raise FactorError(f"{name}: the Python fallback {self._fallback_label(name, m, fn)} returned "
                              f"{type(flags).__name__} {flags!r:.80}; expected None, a Counter "
                              "{flag text: slots >= 0} or a list of flag texts")
        if poisoned:   # set_fallback's and the manifest's alike (a manifest's that left outputs
            left = _unwritten(poisoned)   # unwritten returned 'python_fallback', the poison in them)
            if left:
                raise FactorError(
                    f"{name}: the Python fallback {self._fallback_label(name, m, fn)} left "
                    + ", ".join(f"{k}: {n} of {size}" for k, n, size in left)
                    + " element(s) unwritten (still the poison the registry fills each output "
                    "with before a Python fallback runs: a NaN with a payload, 0xA5.. for "
                    "integers); a fallback must write every element of its outputs in place "
                    "(arrays[name].raw()[...] = ..., or .store(...)), not return them")
        return flags

    def _fallback_problem(self, name: str, fn) -> str:
        """fallback_problem(fn) for factor ``name``'s Python fallback, read once while ``fn``
        stays its fallback (one entry per factor: a registry given 5000 fallbacks in turn kept
        5000 entries and every function alive)."""
        hit = self._fallback_checks.get(name)
        if hit is None or hit[0] is not fn:
            hit = self._fallback_checks[name] = (fn, fallback_problem(fn))
        return hit[1]

    def _fallback_label(self, name: str, m: Manifest, fn) -> str:
        """The Python fallback ``fn`` of ``name`` as an error names it: set_fallback's (its
        qualified name), or the manifest's 'module:function' and file."""
        if self._fallbacks.get(name) is fn:
            return f"set with set_fallback ({getattr(fn, '__qualname__', type(fn).__name__)})"
        return f"{m.fallback!r} (manifest {m.path})"

    def _remember_fast(self, key, plugin: Plugin, m: Manifest, refs_by_name: dict, dims, dims_c,
                       sizes: dict, pvals: dict, device: int, spans: dict) -> None:
        """Keep what a call to ``plugin`` that passed the full checks needs again, under its
        _validated_key (dispatch)."""
        names = list(refs_by_name)
        pos = {k: i for i, k in enumerate(names)}
        abi_index = []
        for s in m.tensors:
            n = m.output.name if s.same_as_output else s.name
            abi_index.append(-1 if s.role == "workspace" else pos.get(n, -1))
        overlap = tuple((pos[w], spans[w][0], spans[w][1],
                         tuple((pos[k], sk[0], sk[1]) for k, sk in spans.items() if k != w))
                        for w in m.written_names if w in spans)
        kernel, kernel_fallback = self._entry_points(plugin)
        host = m.memory == "host"
        kinds = {r.kind for r in refs_by_name.values()}
        if len(self._fast_calls) > 4096:
            self._fast_calls.clear()
        self._fast_calls[key] = _FastCall(
            plugin=plugin, m=m, kernel=kernel, kernel_fallback=kernel_fallback,
            abi_index=tuple(abi_index),
            align=tuple((pos[k], r.itemsize) for k, r in refs_by_name.items() if r.itemsize > 1),
            overlap=overlap, dims=dims, dims_c=dims_c, n_dims=len(dims), n_aux=len(m.aux),
            ws_index=m.workspace_index,
            device=device, host=host, stream_kind="torch" if "torch" in kinds else "cupy",
            sizes=sizes, pvals=pvals)

    def _describe(self, name: str, m: Manifest, arrays, params) -> dict:
        """dispatch's first checks (and call_plugin's): ``params`` a dict or None, ``arrays`` a
        dict whose non-None values are arrays, described as {name: TensorRef} (TensorRefs given
        are copied, so that what is checked is what the short path's key records). Raises
        ArgumentError (its subclass from TensorRef.of, naming the factor; for an unknown
        argument name that one instead, since a misspelt name is the problem then), uncounted."""
        if params is not None and not isinstance(params, dict):
            raise ArgumentError(name, "params", "type", "a dict {parameter name: value} or None",
                                type(params).__name__)
        try:
            return {k: copy.copy(v) if type(v) is TensorRef else TensorRef.of(v, k, name)
                    for k, v in arrays.items() if v is not None}
        except AttributeError:
            if isinstance(arrays, dict):
                raise
            raise ArgumentError(name, "arrays", "type", "a dict {argument name: array}",
                                type(arrays).__name__) from None
        except ArgumentError:
            # a size or a misspelt name is the problem then, not the type of its value
            unknown = self._unknown_argument(m, arrays)
            if unknown is None:
                raise
            raise unknown from None

    @staticmethod
    def _check_memory(name: str, m: Manifest, refs_by_name: dict, spans, device: int):
        """dispatch's (and call_plugin's) checks after bind: NULL data pointers (a kernel or a
        fallback given NULL would crash), then written arrays (check_writes). Returns the host
        writability read ({name: bool}; None on a device), for the short path's key. Raises
        LayoutError or DeviceError, uncounted."""
        # after the names, dtypes and shapes (a misspelt name is the problem then), before any
        # path reads the memory (a kernel or a fallback given NULL would crash) and before the
        # overlap check (NumPy's stand-in arrays refuse a NULL pointer with elements)
        null = null_pointer_error(name, refs_by_name)
        if null is not None:
            raise null
        # host writability read once: for the check and for the short path's key
        writable = {k: _writable(r.obj) for k, r in refs_by_name.items()} if device < 0 else None
        check_writes(name, m, refs_by_name, spans, device, writable)
        return writable

    def _tuned_value(self, m: Manifest):
        """The ``tuned`` function bind takes for ``m``: the tuning table's value (set_tuning's
        override first), checked against the manifest's allowed values of the dim. Bind runs on
        dispatch's full path only: a value is checked once per call signature, then kept with
        the signature's dims (bind cache, short path). A table's values were checked when it was
        read; an override's are checked here: ArgumentError naming the factor, the dim, the
        allowed values and what came."""
        def tuned(factor, dim, sizes, default):
            v = self.tuning.value(factor, dim, sizes, default)
            ok, allowed = m.tuned_allowed(dim)
            if not ok(v):
                raise ArgumentError(factor, dim, "tuned dim (set_tuning's override or the tuning table)",
                                    f"a value in {allowed}", repr(v))
            return v
        return tuned

    @staticmethod
    def _unknown_argument(m: Manifest, arrays: dict):
        """The ArgumentError for the first name of ``arrays`` that is not one of ``m``'s
        arguments (saying so when it is a size or the runtime's workspace); None if all are."""
        unknown = sorted(set(arrays) - m.user_names)
        if not unknown:
            return None
        bad = unknown[0]
        ws = [t.name for t in m.tensors if t.role == "workspace"]
        why = ("unknown argument: a size, taken from the arrays' shapes" if bad in m.shape_symbols else
               "unknown argument: the runtime supplies the workspace" if bad in ws else "unknown argument")
        return ArgumentError(m.name, bad, why, f"one of {sorted(m.user_names)}", repr(bad))

    def _count(self, name, key):
        with self._lock:
            self._stats[name][key] += 1

    def set_tuning(self, name: str, fn) -> None:
        """Fill ``name``'s tuned dims with ``fn(sizes) -> int`` instead of the tuning table
        (benchmarks/tune_moe.py forces each choice this way); None restores the table.
        Raises FactorNotFoundError for an unknown factor, FactorError for an ``fn`` that is not
        callable or a factor without tuned dims (nothing would ever call ``fn``); None for any
        name is quiet (cleanup code may run before a factor is known). What ``fn`` returns is
        checked where a call binds (once per call signature): a value that is no integer is a
        FactorError, one outside the manifest's range/options for the dim an ArgumentError
        naming the factor and the dim (dispatch and call_plugin raise them). A ``name`` that is
        not a str is an ArgumentError naming set_tuning, with or without ``fn``."""
        if type(name) is not str:
            _check_name("set_tuning", name)
        if fn is not None:
            m = self._manifest(name, "set_tuning")
            if not callable(fn):
                raise FactorError(f"set_tuning: fn: expected a callable fn(sizes) -> int or None, "
                                  f"got {type(fn).__name__} {fn!r:.80}")
            if not m.tuned_dims:
                raise FactorError(f"set_tuning: {name}: expected a factor with tuned dims "
                                  "(dim_sources {tuned: DEFAULT}), got one with none: nothing would "
                                  "call fn")
        self.tuning.override(name, fn)
        self._forget_calls()

    def set_fallback(self, name: str, fn) -> None:
        """Use ``fn(arrays, sizes, params)`` as the Python fallback of ``name`` (over the
        manifest's); None restores the manifest's. Raises FactorNotFoundError for an unknown
        factor, FactorError for an ``fn`` that cannot be called so (fallback_problem); None for
        any name is quiet (cleanup code may run before a factor is known); a ``name`` that is
        not a str is an ArgumentError naming set_fallback, with or without ``fn``.

        ``fn`` writes the outputs in place (``arrays[name]`` are TensorRefs: ``.raw()[...] =``
        or ``.store()``) and returns None or its device flags. Before any Python fallback runs
        (this one or the manifest's), the registry fills each output the manifest gives the role
        output (not an inout array, nor an in-place output, which hold the call's input) with a
        poison: a quiet NaN with a payload for float dtypes, 0xA5A5.. for integers (int32
        -1515870811: no id in [0, E)), so that an element no fallback wrote is visibly wrong,
        never the memory's old contents (``lambda a, s, p: None`` handed back topk_softmax
        weights 1.0 and ids 1065353216). After ``fn`` returns, each such output is compared
        with the poison: an element still holding it makes the call a FactorError naming the
        factor, ``fn``, each output and how many of its elements were left (counted in
        stats()' errors). Only the Python fallback path pays for the fill and this check, which
        the manifest's fallbacks go through too."""
        if type(name) is not str:
            _check_name("set_fallback", name)
        if fn is None:
            self._fallbacks.pop(name, None)
            return
        self._manifest(name, "set_fallback")
        problem = fallback_problem(fn)
        if problem:
            raise FactorError(f"set_fallback: fn: {problem}")
        self._fallbacks[name] = fn

    def _workspace(self, plugin: Plugin, dims, device: int, stream: int):
        """A zeroed buffer of at least workspace_size(dims) bytes, kept per (factor, device, stream).

        One per stream, so calls on different streams (one per thread, say) never share scratch
        memory or a status word; host factors key by the calling thread instead. Allocated on
        first use and grown (status word carried over) under a lock; the hit path is one dict
        lookup."""
        fn = plugin.factor.workspace_size
        if fn == abi.ffi.NULL:
            return None
        need = int(fn(dims, len(dims)))
        if not 0 <= need <= _MAX_WORKSPACE:
            self._count(plugin.name, "errors")
            raise WorkspaceSizeError(plugin.name, need, dims)
        buf = self._workspaces.get((plugin.name, device, stream))
        if buf is not None and buf.nbytes >= need:
            return buf
        try:
            with self._ws_lock:
                return self._new_workspace((plugin.name, device, stream), need)
        except Exception as exc:   # counted as the other refused calls are
            self._count(plugin.name, "errors")
            if isinstance(exc, FactorError) or not out_of_memory(exc):
                raise
            where = "host memory" if device < 0 else f"cuda:{device}"
            raise WorkspaceAllocationError(plugin.name, need, dims, where, exc) from exc

    def _new_workspace(self, key, need: int):
        """Allocate (or grow) the workspace of ``key``; called under _ws_lock.

        Device buffers are zeroed (and a grown one gets the old status word) by async copies on
        the call's own stream, after the allocating CuPy stream's pending work. A replaced
        buffer is kept until the next check_device_errors (which synchronises), so a kernel
        still running on it never sees its memory reused."""
        name, device, stream = key
        old = self._workspaces.get(key)
        if old is not None and old.nbytes >= need:
            return old
        size = max(need, 256)
        if device < 0:
            # 256-byte aligned as rule 11 promises (NumPy aligns to 16 or 64 only)
            raw = np.zeros(size + 256, dtype=np.uint8)
            start = -raw.ctypes.data % 256
            buf = raw[start:start + size]
            if old is not None:
                buf[:256] = old[:256]
            self._workspaces[key] = buf
            return buf
        import cupy
        from cupy.cuda import runtime
        capturing = _is_capturing(stream)
        if capturing:
            # nothing should be allocated into a graph: use one made by an earlier call (warm-up)
            others = [b for (n, d, _), b in self._workspaces.items()
                      if n == name and d == device and b.nbytes >= need]
            if others:
                buf = max(others, key=lambda b: b.nbytes)
                self._workspaces[key] = buf
                return buf
        try:
            with cupy.cuda.Device(device):
                buf = cupy.empty(size, dtype=cupy.uint8)
                current = cupy.cuda.get_current_stream()
                if current.ptr != stream and not capturing:
                    ready = cupy.cuda.Event(disable_timing=True)
                    ready.record(current)
                    runtime.streamWaitEvent(stream, ready.ptr)
                runtime.memsetAsync(buf.data.ptr, 0, size, stream)
                if old is not None:
                    runtime.memcpyAsync(buf.data.ptr, old.data.ptr, 256, runtime.memcpyDeviceToDevice, stream)
                    self._retired.append(old)
        except Exception as exc:  # CUDARuntimeError, OutOfMemoryError
            if out_of_memory(exc):   # said by _workspace, with the size asked and the dims
                raise
            raise FactorError(f"{name}: cannot allocate a {size}-byte workspace on cuda:{device} "
                              f"(stream 0x{stream:x}): {exc}. During CUDA-graph capture, call "
                              "once with these shapes before capturing") from exc
        self._workspaces[key] = buf
        return buf

    def release_workspaces(self) -> None:
        """Drop every kept workspace; the next call allocates again. For engines that retire
        streams. First reads (and clears) their status words as check_device_errors does; the
        workspaces are released in any case. Raises, after releasing them, what
        check_device_errors raised: DeviceSideError for flags that calls since the last check
        set (reported once), or a CUDA error from synchronising a device."""
        try:
            self.check_device_errors()
        finally:
            with self._ws_lock:
                self._workspaces.clear()

    def call_plugin(self, plugin: Plugin, arrays: dict, params: dict | None = None,
                    count: bool = True) -> str | None:
        """Run one given loaded plugin (ready or shadowed: not necessarily the chosen one; or
        one being loaded, as verify does) on ``arrays`` (as dispatch takes them).

        Validates as ``dispatch`` does (the same checks: unknown argument names, arrays that
        are no arrays, the manifest's rules, written arrays, NULL pointers, tuned dims) and (if
        ``count``) counts the path or the error in ``stats()``, but never falls back to Python:
        returns 'plugin', 'kernel_fallback', or None when both C paths declined. Used by
        ``verify``. Raises ArgumentError ('plugin' not a loaded Plugin; and as dispatch:
        its subclasses, each naming the plugin's factor and the argument), DeviceError (also:
        device arrays for a host factor, or device arrays not on the registry's live GPU),
        KernelError."""
        if not isinstance(plugin, Plugin) or plugin.factor is None or plugin.manifest is None:
            got = (f"a plugin that was not loaded ({plugin.path.name}: {plugin.reason})"
                   if isinstance(plugin, Plugin) else f"{type(plugin).__name__} {plugin!r:.80}")
            raise ArgumentError("call_plugin", "plugin", "type", "a loaded Plugin (registry.get(name), "
                                "or one of registry.plugins that is ready or shadowed)", got)
        m, name = plugin.manifest, plugin.name
        try:
            refs_by_name = self._describe(name, m, arrays, params)
            unknown = self._unknown_argument(m, arrays)
            if unknown is not None:
                raise unknown
            refs, dims, _, _, device = m.bind(refs_by_name, params, self._tuned_value(m))
            self._check_memory(name, m, refs_by_name, None, device)
            host = m.memory == "host"
            if host and device >= 0:
                raise DeviceError(name, m.tensors[0].name, "device", "host memory (a host factor)",
                                  f"cuda:{device}")
            if not host and (not self.hardware.live or device != self.hardware.device_id):
                where = f"cuda:{self.hardware.device_id}" if self.hardware.live else "a live GPU"
                raise DeviceError(name, m.tensors[0].name, "device", f"arrays on {where}",
                                  "host memory" if device < 0 else f"cuda:{device}")
        except FactorError:
            if count:
                self._count(name, "errors")
            raise
        path = self._call_plugin(plugin, m, refs, dims, host=host)
        if count and path:
            self._count(name, path)
        return path

    def _entry_points(self, plugin: Plugin):
        """(kernel, kernel_fallback or None) of ``plugin`` as _KERNEL_INT_T, made once."""
        e = self._entries.get(id(plugin))
        if e is None or e[0] is not plugin:
            ffi, f = abi.ffi, plugin.factor
            fb = None if f.kernel_fallback == ffi.NULL else ffi.cast(_KERNEL_INT_T, f.kernel_fallback)
            e = self._entries[id(plugin)] = (plugin, ffi.cast(_KERNEL_INT_T, f.kernel), fb)
        return e[1], e[2]

    def _call_plugin(self, plugin: Plugin, m: Manifest, refs, dims, host: bool = False, dims_c=None):
        """Run ``plugin``'s kernel (then its kernel_fallback if it declines) on bound ``refs``
        (ABI order): 'plugin', 'kernel_fallback' or None when both declined (_invoke)."""
        kernel, kernel_fallback = self._entry_points(plugin)
        aux = [0 if ref is None else ref.ptr for ref in refs[2:]] or [0]   # NULL: absent
        ws_index = m.workspace_index
        stream = 0 if host else _stream_for(refs, self.hardware.device_id)
        if ws_index is not None:
            if host:
                ws = self._workspace(plugin, dims, -1, threading.get_ident())
            else:
                ws = self._workspace(plugin, dims, self.hardware.device_id, stream)
            aux[ws_index] = 0 if ws is None else (ws.ctypes.data if host else ws.data.ptr)
        if dims_c is None:
            dims_c = abi.ffi.new("int64_t[]", dims)
        return self._invoke(plugin, kernel, kernel_fallback, refs[0].ptr, refs[1].ptr, aux, len(m.aux),
                            dims_c, len(dims), stream)

    def _invoke(self, plugin: Plugin, kernel, kernel_fallback, out: int, inp: int, aux: list,
                n_aux: int, dims_c, n_dims: int, stream: int) -> str | None:
        """The C call: 'plugin' or 'kernel_fallback' for the path that returned EX_OK, None when
        both said EX_FALLBACK. Raises KernelError (counted) for an error status, with the
        plugin's last_error() text, and for a plugin that wrote to its const dims (the array is
        cached for the calls that follow: those would run on the changed sizes); the dims are
        restored first."""
        ffi = abi.ffi
        dims_before = ffi.buffer(dims_c)[:]
        status = kernel(out, inp, aux, n_aux, dims_c, n_dims, stream)
        self._dims_kept(plugin, dims_c, dims_before, "kernel", status)   # before kernel_fallback reads them
        if status == abi.EX_OK:
            return "plugin"
        if status == abi.EX_FALLBACK and kernel_fallback is not None:
            status = kernel_fallback(out, inp, aux, n_aux, dims_c, n_dims, stream)
            self._dims_kept(plugin, dims_c, dims_before, "kernel_fallback", status)
            if status == abi.EX_OK:
                return "kernel_fallback"
        if status == abi.EX_FALLBACK:
            return None
        self._count(plugin.name, "errors")
        raise KernelError(plugin.name, status, abi.status_name(status), _last_error_text(plugin))

    def _dims_kept(self, plugin: Plugin, dims_c, before: bytes, path: str, status: int) -> None:
        """Raise KernelError (counted) if the C path ``path`` wrote to its const dims array
        (``before``: its bytes before the call), after restoring them: the array is cached for
        the calls that follow, and a kernel_fallback called next would read the changed sizes
        (a write past the output). Names the path, its status and its last_error() text."""
        ffi = abi.ffi
        if ffi.buffer(dims_c)[:] == before:
            return
        ffi.memmove(dims_c, before, len(before))
        self._count(plugin.name, "errors")
        text = _last_error_text(plugin)
        raise KernelError(plugin.name, status, abi.status_name(status),
                          f"but its {path} wrote to the const dims array it was passed (restored; this "
                          "call's outputs are not to be trusted)" + (f"; its last_error: {text}" if text else ""))

    def check_device_errors(self) -> None:
        """Raise DeviceSideError if any call since the last check flagged bad input.

        Kernels set bits in the int32 at offset 0 of their workspace, each bit a text of the
        manifest's device_flags (moe_fused_gemm: bit 0, a topk_id outside [0, G), G the number
        of global experts with an expert_map, else E; bit 1, an expert_map value outside
        [-1, E)); the Python fallbacks report the same through counters. The error's message
        names each factor with its status word and flag texts.
        Reads the status word of every workspace (one per factor, device and stream) after
        synchronising each device, then clears them; call it outside graph capture. Reading and
        clearing a word are two steps, not one atomic exchange: call it where no other thread is
        launching this registry's calls, else a flag such a call sets between the two steps is
        cleared unreported, and two threads checking at once may both report the same flag.
        """
        problems = []
        with self._ws_lock:
            items = list(self._workspaces.items())
            retired, self._retired = self._retired, []
        seen, synced = set(), set()
        for (name, dev, _), buf in items:
            if id(buf) in seen:          # one buffer adopted by a capturing stream
                continue
            seen.add(id(buf))
            if dev < 0:
                word = int(buf[:4].view("int32")[0])
                if word:
                    buf[:4].fill(0)
            else:
                import cupy
                with cupy.cuda.Device(dev):
                    if dev not in synced:
                        cupy.cuda.runtime.deviceSynchronize()   # every stream's calls done
                        synced.add(dev)
                    word = int(buf[:4].view(cupy.int32).get()[0])
                    if word:
                        buf[:4].fill(0)
                        cupy.cuda.runtime.deviceSynchronize()
            if word:
                problems.append(f"{name}: device status word 0x{word & 0xFFFFFFFF:x} "
                                f"({self._flag_text(name, word)})")
        for buf in retired:             # freed only once no kernel can still be using them
            if buf.device.id not in synced:
                import cupy
                with cupy.cuda.Device(buf.device.id):
                    cupy.cuda.runtime.deviceSynchronize()
                synced.add(buf.device.id)
        del retired
        with self._lock:
            for name, c in self._flags.items():
                for k, n in c.items():
                    problems.append(f"{name}: {k} in {n} slot(s) (Python fallback)")
            self._flags.clear()
        if problems:
            raise DeviceSideError("; ".join(problems))

    def _flag_text(self, name, word) -> str:
        p = self._chosen.get(name)
        m = p.manifest if p is not None and p.manifest is not None else self.manifests.get(name)
        bits = (getattr(m, "device_flags", None) or {}) if m else {}
        texts = [bits.get(b, f"bit {b}") for b in range(32) if word >> b & 1]
        return ", ".join(texts)

"""The cffi binding of include/ex_engine.h (ABI mode: no compiler needed at run time).

The declarations below mirror the header by hand; tests/test_abi.py compiles the header with a
C compiler and checks that every size, offset and constant matches, so the two cannot drift.
Each plugin is opened with its own handle (``ffi.dlopen`` with RTLD_LOCAL), so every
library's ``ex_get_factor`` and ``ex_abi_version`` resolve to that library's own symbols.
"""
from __future__ import annotations

import ctypes
import os
import re
import sys
import threading
from pathlib import Path

from cffi import FFI

from ._fork import renew_after_fork

CDEF = r"""
typedef enum ex_status {
    EX_OK = 0, EX_FALLBACK = -1, EX_ERR_INVALID_ARGUMENT = 1, EX_ERR_UNSUPPORTED_DTYPE = 2,
    EX_ERR_SHAPE = 3, EX_ERR_ALIGNMENT = 4, EX_ERR_WORKSPACE = 5, EX_ERR_CUDA = 6,
    EX_ERR_INTERNAL = 7
} ex_status_t;
typedef enum ex_dtype {
    EX_DTYPE_FLOAT32 = 0, EX_DTYPE_FLOAT16 = 1, EX_DTYPE_BFLOAT16 = 2, EX_DTYPE_INT32 = 3,
    EX_DTYPE_INT64 = 4
} ex_dtype_t;
typedef enum ex_factor_id {
    EX_FACTOR_TOPK_SOFTMAX = 0, EX_FACTOR_FUSED_ADD_RMSNORM = 1, EX_FACTOR_MOE_FUSED_GEMM = 2,
    EX_FACTOR_BUILTIN_LAST = 1023, EX_FACTOR_USER_FIRST = 1024
} ex_factor_id_t;
typedef struct ex_hardware {
    char name[256];
    int32_t cc_major; int32_t cc_minor; int32_t multiprocessor_count; int32_t warp_size;
    int32_t max_threads_per_block; int32_t max_threads_per_multiprocessor;
    int32_t regs_per_block; int32_t regs_per_multiprocessor;
    int64_t shared_mem_per_block; int64_t shared_mem_per_block_optin;
    int64_t shared_mem_per_multiprocessor; int64_t l2_cache_bytes; int64_t global_mem_bytes;
} ex_hardware_t;
typedef struct ex_tuning {
    int32_t threads_per_block; int32_t items_per_thread; int32_t vec_size;
    int32_t shared_mem_bytes; int32_t num_warps; int32_t num_stages;
} ex_tuning_t;
typedef int (*ex_kernel_fn)(void* output, const void* input, const void* aux_inputs[],
                            int n_aux, const int64_t dims[], int n_dims, void* stream);
typedef int64_t (*ex_workspace_fn)(const int64_t dims[], int n_dims);
typedef const char* (*ex_error_string_fn)(void);
typedef struct ex_factor {
    uint32_t abi_version; int32_t factor_id; const char* name; const char* version;
    ex_tuning_t tuning; ex_kernel_fn kernel; ex_kernel_fn kernel_fallback;
    ex_workspace_fn workspace_size; ex_error_string_fn last_error; int32_t priority;
    int32_t reserved_i32; const char* description;
} ex_factor_t;
"""
# what each plugin library exports
LIB_CDEF = r"""
extern uint32_t ex_abi_version;
ex_factor_t* ex_get_factor(const ex_hardware_t* hw);
"""

ffi = FFI()
ffi.cdef(CDEF)
# EX_FACTOR_BUILTIN_LAST (1023): ids 0..it are ex_engine's own factors (from the cdef above)
FACTOR_BUILTIN_LAST = ffi.typeof("ex_factor_id_t").relements["EX_FACTOR_BUILTIN_LAST"]
# A second FFI that includes the types and adds the plugin's two symbols; kept apart so that
# opening a library that lacks one symbol fails on first access, not at dlopen.
lib_ffi = FFI()
lib_ffi.include(ffi)
lib_ffi.cdef(LIB_CDEF)

HEADER = Path(__file__).resolve().parents[1] / "include" / "ex_engine.h"

# The cffi library object of each path opened, for the life of the process. cffi's FFI.dlopen
# keeps every library object it makes (and the handle under it) in a list of the FFI's, so
# none is ever closed, and dlopen hands a path it has open its first copy again anyway: a
# server that loaded its plugins folder once per registry grew by ~12 KB per load for good
# (a new class, accessors and handle each time; 2000 loads of one library: +25 MB RSS).
_LIBRARIES: dict = {}
_LIBRARIES_LOCK = threading.Lock()
renew_after_fork(sys.modules[__name__], "_LIBRARIES_LOCK")


def _header_version() -> tuple[int, int]:
    """(major, minor) read from the header's #define lines; the header is the one truth."""
    if HEADER.exists():
        text = HEADER.read_text(encoding="utf-8")
        major = int(re.search(r"#define EX_ABI_VERSION_MAJOR (\d+)", text).group(1))
        minor = int(re.search(r"#define EX_ABI_VERSION_MINOR (\d+)", text).group(1))
        return major, minor
    return 1, 0  # installed without the source tree: the version this module was written for


ABI_VERSION_MAJOR, ABI_VERSION_MINOR = _header_version()
ABI_VERSION = (ABI_VERSION_MAJOR << 16) | ABI_VERSION_MINOR

STATUS_NAMES = {
    0: "EX_OK", -1: "EX_FALLBACK", 1: "EX_ERR_INVALID_ARGUMENT", 2: "EX_ERR_UNSUPPORTED_DTYPE",
    3: "EX_ERR_SHAPE", 4: "EX_ERR_ALIGNMENT", 5: "EX_ERR_WORKSPACE", 6: "EX_ERR_CUDA",
    7: "EX_ERR_INTERNAL",
}
EX_OK, EX_FALLBACK, EX_ERR_WORKSPACE = 0, -1, 5

# ex_dtype_t codes by the dtype names ex_engine uses everywhere
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2, "int32": 3, "int64": 4}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8}

TUNING_FIELDS = ("threads_per_block", "items_per_thread", "vec_size", "shared_mem_bytes",
                 "num_warps", "num_stages")


def status_name(code: int) -> str:
    """Name of a kernel status code ("EX_ERR_SHAPE"), or "unknown status N"."""
    return STATUS_NAMES.get(code, f"unknown status {code}")


def version_str(v: int) -> str:
    """'MAJOR.MINOR' of a packed ABI version."""
    return f"{v >> 16}.{v & 0xFFFF}"


def dlopen(path: str):
    """Open one plugin file with its own handle (RTLD_NOW | RTLD_LOCAL). Raises OSError.

    One path is opened once per process: a later call for it returns the library object the
    first call made (_LIBRARIES), the copy dlopen itself would hand back for that path, without
    a new cffi object that cffi would keep forever (a long-lived process loading its plugins
    again and again grew without bound). A dlopen that failed is tried again next time.

    The path is made absolute first: dlopen reads a name without a '/' ('topk_softmax.so', as
    a listing of the folder '.' gives) as a library to search for on LD_LIBRARY_PATH and the
    system paths, i.e. possibly another file than the one whose bytes were checked. Only the
    current folder is prepended (Path.absolute), never '..' folded away as os.path.abspath
    does: through a symlinked folder 'link/../x.so' is another file than 'x.so' beside 'link',
    and the kernel resolves the path dlopen gets as it resolved the one the bytes were read from."""
    full = str(Path(path).absolute())
    try:
        full.encode("utf-8")
    except UnicodeEncodeError:   # a name that is not UTF-8 decodes to surrogates: cffi cannot pass it
        raise OSError(f"{os.fsencode(full).decode('utf-8', 'backslashreplace')}: the path is not valid UTF-8, "
                      "which the loader (cffi) cannot open; rename the file or its folder") from None
    with _LIBRARIES_LOCK:
        lib = _LIBRARIES.get(full)
        if lib is None:
            # opened through ctypes first, the same flags (one handle: dlopen counts the second
            # open of a path), so that a file the loader refuses fails here with dlerror's words.
            # cffi's dlopen, on a failure, asks ctypes.util.find_library for the name, which
            # starts ldconfig, gcc and ld (three child processes, ~36 ms a file, on every load of
            # a folder that holds it) and keeps the first error in a frame cycle that held the
            # registry and the file's bytes until the cyclic GC ran (a leak trial, session
            # sixty-three). ctypes never closes a handle, as cffi does not.
            flags = lib_ffi.RTLD_NOW | lib_ffi.RTLD_LOCAL
            try:
                ctypes.CDLL(full, mode=flags)
            except OSError as exc:
                raise OSError(str(exc)) from None
            lib = _LIBRARIES[full] = lib_ffi.dlopen(full, flags)
    return lib

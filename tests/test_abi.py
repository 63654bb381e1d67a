"""The cffi declarations in ex_engine/abi.py equal the header as a C compiler lays it out."""
import re
import shutil
import subprocess

import pytest

from ex_engine import abi
from tests.conftest import ROOT

STRUCTS = {
    "ex_hardware_t": ["name", "cc_major", "cc_minor", "multiprocessor_count", "warp_size",
                      "max_threads_per_block", "max_threads_per_multiprocessor", "regs_per_block",
                      "regs_per_multiprocessor", "shared_mem_per_block", "shared_mem_per_block_optin",
                      "shared_mem_per_multiprocessor", "l2_cache_bytes", "global_mem_bytes"],
    "ex_tuning_t": list(abi.TUNING_FIELDS),
    "ex_factor_t": ["abi_version", "factor_id", "name", "version", "tuning", "kernel",
                    "kernel_fallback", "workspace_size", "last_error", "priority", "reserved_i32",
                    "description"],
}
ENUMS = ["EX_OK", "EX_FALLBACK", "EX_ERR_INVALID_ARGUMENT", "EX_ERR_UNSUPPORTED_DTYPE",
         "EX_ERR_SHAPE", "EX_ERR_ALIGNMENT", "EX_ERR_WORKSPACE", "EX_ERR_CUDA", "EX_ERR_INTERNAL",
         "EX_DTYPE_FLOAT32", "EX_DTYPE_FLOAT16", "EX_DTYPE_BFLOAT16", "EX_DTYPE_INT32",
         "EX_DTYPE_INT64", "EX_FACTOR_TOPK_SOFTMAX", "EX_FACTOR_FUSED_ADD_RMSNORM",
         "EX_FACTOR_MOE_FUSED_GEMM", "EX_FACTOR_BUILTIN_LAST", "EX_FACTOR_USER_FIRST"]


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("gcc not available")
    d = tmp_path_factory.mktemp("abi")
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "ex_engine.h"', "int main(void){"]
    for s, fields in STRUCTS.items():
        lines.append(f'printf("sizeof {s} %zu\\n", sizeof({s}));')
        for f in fields:
            lines.append(f'printf("offsetof {s} {f} %zu\\n", offsetof({s}, {f}));')
    for e in ENUMS:
        lines.append(f'printf("enum {e} %d\\n", (int){e});')
    lines.append('printf("abi version %u\\n", (unsigned)EX_ABI_VERSION);')
    lines.append("return 0;}")
    (d / "layout.c").write_text("\n".join(lines), encoding="utf-8")
    subprocess.run(["gcc", f"-I{ROOT / 'include'}", "-o", str(d / "layout"), str(d / "layout.c")], check=True)
    out = subprocess.run([str(d / "layout")], capture_output=True, text=True, check=True).stdout
    return dict(re.findall(r"^(\S+ \S+(?: \S+)?) (-?\d+)$", out, re.M))


def test_struct_sizes_match(c_layout):
    for s in STRUCTS:
        assert abi.ffi.sizeof(s) == int(c_layout[f"sizeof {s}"]), s


def test_field_offsets_match(c_layout):
    for s, fields in STRUCTS.items():
        for f in fields:
            assert abi.ffi.offsetof(s, f) == int(c_layout[f"offsetof {s} {f}"]), f"{s}.{f}"


def test_every_header_field_is_checked():
    """A field added to the header but not to this test (or to abi.py) fails here."""
    text = (ROOT / "include" / "ex_engine.h").read_text(encoding="utf-8")
    for s, fields in STRUCTS.items():
        body = re.search(r"typedef struct \w+ \{([^}]*)\}\s*" + s, text).group(1)
        body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
        declared = re.findall(r"(\w+)\s*(?:\[\d+\])?;", body)
        assert declared == fields, s


def test_enum_values_match(c_layout):
    values = {}
    for t in ("ex_status_t", "ex_dtype_t", "ex_factor_id_t"):
        values.update(abi.ffi.typeof(t).relements)
    for e in ENUMS:
        assert values[e] == int(c_layout[f"enum {e}"]), e
    for name, code in abi.DTYPE_CODES.items():
        assert values[f"EX_DTYPE_{name.upper()}"] == code


def test_version_matches_header(c_layout):
    assert abi.ABI_VERSION == int(c_layout["abi version"])
    for name, value in abi.ffi.typeof("ex_status_t").relements.items():
        assert abi.STATUS_NAMES[value] == name

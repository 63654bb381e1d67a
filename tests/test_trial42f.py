"""Session forty-two's operations trial (bad plugins, long life): each test failed before its
mend. CPU only: host plugins built with gcc (tests/plugins/host_scale.c, and a few lines of C
of their own where host_scale.c has no knob)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ex_engine import FactorRegistry, KernelError, abi

from .conftest import PLUGIN_SRC, build_plugin


def _x(n: int = 7) -> dict:
    x = np.arange(n, dtype=np.float32)
    return {"x": x, "out": np.empty_like(x), "alpha": np.array([2.0], np.float32)}


def test_loading_a_library_again_keeps_one_cffi_library_object(tmp_path):
    """cffi's FFI.dlopen keeps every library object it makes: a server that loaded its plugins
    folder once per registry grew ~12 KB per load for good (2000 loads: +25 MB RSS)."""
    build_plugin(tmp_path)
    FactorRegistry.load(tmp_path, hardware="h200")
    kept = getattr(abi.lib_ffi, "_libraries", None)
    if kept is None:
        pytest.skip("this cffi keeps no list of its libraries")
    before = len(kept)
    for _ in range(20):
        reg = FactorRegistry.load(tmp_path, hardware="h200")
        assert reg.dispatch("host_scale", _x()) == "plugin"
    assert len(abi.lib_ffi._libraries) == before
    assert abi.dlopen(tmp_path / "host_scale.so") is abi.dlopen(str(tmp_path / "host_scale.so"))


def host_scale_with(tmp_path, helper: str, last_error: str = "", description: str = "",
                    name: str = "") -> Path:
    """Build tmp_path/p/host_scale.so: host_scale.c (BEHAVIOUR 3: EX_ERR_SHAPE) whose last_error()
    text, description and name are C expressions of ``helper``'s functions where given ('' keeps
    its own), evaluated at run time (a name of its own: no manifest). Returns the folder."""
    text = PLUGIN_SRC.read_text(encoding="utf-8")
    for old, expr in (('"N must be even"', last_error), ('"test: out = alpha * in on host memory"', description),
                      ("s_factor.name = NAME;", name and f"s_factor.name = {name};")):
        assert old in text
        if expr:
            text = text.replace(old, expr)
    src = tmp_path / "src" / "host_scale.c"
    src.parent.mkdir(parents=True)
    src.write_text(text.replace('#include "ex_engine.h"\n', '#include "ex_engine.h"\n#include <stdlib.h>\n' + helper, 1), encoding="utf-8")
    build_plugin(tmp_path / "p", defines={"BEHAVIOUR": 3}, src=src, manifest=not name)
    return tmp_path / "p"


def _with_big_strings(tmp_path, last_error: int = 0, description: int = 0):
    """host_scale.c (BEHAVIOUR 3: EX_ERR_SHAPE) whose last_error() and description are strings
    of that many bytes (0: its own), made at run time."""
    helper = ('#include <string.h>\nstatic const char* big(long n, char c) { char* b = malloc(n + 1); '
              'memset(b, c, n); b[n] = 0; return b; }\n')
    folder = host_scale_with(tmp_path, helper, last_error and f"big({last_error}, 'E')",
                             description and f"big({description}, 'd')")
    return FactorRegistry.load(folder, hardware="h200")


def test_a_name_too_long_for_a_file_name_is_refused_and_the_folder_still_loads(tmp_path):
    """A library whose name was an identifier of 300 characters made FactorRegistry.load raise
    OSError (ENAMETOOLONG, looking for '<name>.yaml' beside it): no plugin of the folder loaded
    (list-factors: a traceback)."""
    build_plugin(tmp_path)
    build_plugin(tmp_path, "long", {"NAME": '"' + "a" * 300 + '"'}, manifest=False)
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    assert reg.dispatch("host_scale", _x()) == "plugin"
    (p,) = [q for q in reg.plugins if q.path.name == "long.so"]
    assert p.status == "rejected"
    assert p.reason.startswith("name is an identifier: expected letters, digits and _ (the manifest's file "
                               "stem), at most 250 characters, got 'aaa"), p.reason
    assert p.reason.endswith("... (202 more characters)") and len(p.reason) < 300, p.reason
    assert len(p.name) < 300 and p.name.endswith("... (50 more characters)")


def test_a_version_number_past_python_ints_digit_limit_is_refused_and_the_other_plugin_wins(tmp_path):
    """A version '1.0.<5000 digits>' (a valid MAJOR.MINOR.PATCH then) made load raise ValueError
    (Python's limit of 4300 digits for int()) as it was compared with another plugin of the
    name: the good one did not load either."""
    build_plugin(tmp_path)
    build_plugin(tmp_path, "host_scale_v", {"VERSION": '"1.0.' + "9" * 5000 + '"'}, manifest=False)
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    assert reg.get("host_scale").path.name == "host_scale.so"
    (p,) = [q for q in reg.plugins if q.path.name == "host_scale_v.so"]
    assert p.status == "rejected" and p.reason.startswith(
        "version is MAJOR.MINOR.PATCH: expected three dot-separated numbers of 1 to 18 digits (e.g. 1.0.0), "
        "got '1.0.999"), p.reason
    assert len(p.reason) < 300 and len(p.version) < 100, (p.reason, p.version)
    # 18 digits still load (and order as numbers)
    build_plugin(tmp_path / "b", "host_scale", {"VERSION": '"1.0.' + "9" * 18 + '"'})
    assert FactorRegistry.load(tmp_path / "b", hardware="h200").get("host_scale") is not None


def test_a_huge_description_and_last_error_are_read_in_part(tmp_path):
    """A 2 MB description was kept whole (list-factors --why printed a 2 MB line), a 2 MB
    last_error copied whole into every error (the message kept 500 characters of it)."""
    reg = _with_big_strings(tmp_path, last_error=2 << 20, description=2 << 20)
    p = reg.get("host_scale")
    assert p.description == "d" * 500 + "... (more than 65536 bytes; the rest not read)"
    with pytest.raises(KernelError) as e:
        reg.dispatch("host_scale", _x())
    assert str(e.value) == ("host_scale: kernel returned EX_ERR_SHAPE (3): " + "E" * 500
                            + "... (more than 65536 bytes; the rest not read)")


def test_a_library_built_for_another_cpu_is_named_so_not_no_such_file(tmp_path):
    """An AArch64 build (a GH200's) copied to an x86-64 server was refused as 'dlopen: not a
    loadable shared library: ... cannot open shared object file: No such file or directory',
    naming a file that is there."""
    from ex_engine import fatbin
    own = fatbin.process_machine()
    if own is None:
        pytest.skip("this process's executable says no ELF machine")
    lib = build_plugin(tmp_path)
    other = 62 if own != 62 else 183
    data = bytearray(lib.read_bytes())
    data[18:20] = other.to_bytes(2, "little")
    lib.write_bytes(bytes(data))
    (p,) = FactorRegistry.load(tmp_path, hardware="h200").plugins
    assert p.status == "rejected"
    assert p.reason == (f"elf: expected a library for this process's CPU, {fatbin.machine_name(own)}, got one "
                        f"built for {fatbin.machine_name(other)}; not opened"), p.reason
    assert [c.name for c in p.checks if c.name == "dlopen"] == []

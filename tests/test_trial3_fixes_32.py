"""Defects a third trial (a plugin author writing my_relu / my_silu) found (session thirty-two):
a tuning table for a factor without size T accepted silently and never applied; a plugin's
last_error text put raw (escape sequences, any length) into KernelError; a legal 2**40-byte
workspace ending in NumPy's bare MemoryError, uncounted; dispatch of a factor whose library was
rejected at load not saying so."""
import shutil
import subprocess
import sys

import numpy as np
import pytest

from ex_engine import FactorNotFoundError, FactorRegistry, KernelError
from ex_engine.arrays import TensorRef
from tests.conftest import PLUGIN_SRC, ROOT, build_plugin, child_env
from tests.test_tuning import _registry_with_tuning, TABLE


def _x(n=7):
    x = np.arange(n, dtype=np.float32)
    return {"x": x, "out": np.empty_like(x), "alpha": np.array([2.0], np.float32)}


# ------------------------------------------------- 1. a tuning table for a factor without T
def _tuned_host_scale(tmp_path, table):
    """host_scale with a tuned dim blk (range -1..1, default -1) and no size T, beside its
    library; the tuning file holds ``table`` for it."""
    reg = _registry_with_tuning(tmp_path, {**TABLE, "host_scale": table})
    build_plugin(tmp_path / "plugins")
    y = tmp_path / "plugins" / "host_scale.yaml"
    y.write_text(y.read_text(encoding="utf-8").replace("dims: [N]", "dims: [N, blk]\ndim_sources:\n  blk: {tuned: -1, range: [-1, 1]}"), encoding="utf-8")
    reg.load_folder(tmp_path / "plugins")
    notes = [n for n in reg.notes if n.startswith("tuning:") and "host_scale" in n]
    m = reg.manifest("host_scale")
    _, dims, _, _, _ = m.bind({k: TensorRef.of(v, k) for k, v in _x(4).items()}, None, reg.tuning.value)
    return reg, notes, dims


def _table(key=("N",), ts=(1,), shape=None):
    return {"dim": "blk", "key": list(key), "values": {"auto": -1, "small": 0, "big": 1},
            "shapes": [{**(shape or {"N": 4}), "model": "none", "by_T": [[t, "big"] for t in ts]}]}


def test_a_table_for_a_factor_without_T_whose_rows_lie_above_T0_is_noted_and_set_aside(tmp_path):
    """Every call of a factor without T looks up T = 0: rows at T >= 1 never apply. The table
    was accepted with no note and the kernel got the default silently."""
    reg, notes, dims = _tuned_host_scale(tmp_path, _table(ts=(1, 64)))
    path = tmp_path / "m" / "tuning" / "h200.yaml"
    assert notes == [f"tuning: tuning file {path}: host_scale: by_T: host_scale's calls have no size T "
                     "(its sizes: ['N']), so every call looks up T = 0; expected a row at T = 0, got rows "
                     "at T = [1, 64]; its table is never used"], reg.notes
    assert "host_scale" in reg.tuning.refused and dims[1] == -1
    assert reg.dispatch("host_scale", _x(4)) == "plugin"


def test_a_table_for_a_factor_without_T_with_a_row_at_T0_applies(tmp_path):
    reg, notes, dims = _tuned_host_scale(tmp_path, _table(ts=(0,)))
    assert notes == [] and "host_scale" not in reg.tuning.refused and dims[1] == 1


def test_T_in_the_key_of_a_factor_without_T_is_no_size_of_its_calls(tmp_path):
    """T was let through the key check whatever the factor (the table then never matched)."""
    reg, notes, dims = _tuned_host_scale(tmp_path, _table(key=("N", "T"), ts=(0,), shape={"N": 4, "T": 1}))
    assert len(notes) == 1 and "host_scale: key: ['T'] no size of host_scale's calls" in notes[0], notes
    assert "never used" in notes[0] and dims[1] == -1


# ------------------------------------------------- 2. last_error text escaped and cut to length
def _erroring_plugin(tmp_path, c_text):
    src = tmp_path / "src" / "host_scale.c"
    src.parent.mkdir(parents=True)
    text = PLUGIN_SRC.read_text(encoding="utf-8")
    assert '"N must be even"' in text
    src.write_text(text.replace('"N must be even"', c_text), encoding="utf-8")
    build_plugin(tmp_path / "p", defines={"BEHAVIOUR": 3}, src=src)
    return FactorRegistry.load(tmp_path / "p", hardware="h200")


def test_last_error_control_characters_are_escaped_in_the_kernel_error(tmp_path):
    """A terminal escape sequence in last_error reached the terminal raw (verify's table red)."""
    reg = _erroring_plugin(tmp_path, r'"bad \xff\xfe bytes \x1b[31mred\nnext"')
    with pytest.raises(KernelError) as e:
        reg.dispatch("host_scale", _x())
    msg = str(e.value)
    assert "\x1b" not in msg and "\n" not in msg, repr(msg)
    assert msg == "host_scale: kernel returned EX_ERR_SHAPE (3): bad \ufffd\ufffd bytes \\x1b[31mred\\nnext", repr(msg)
    assert reg.stats()["host_scale"]["errors"] == 1


def test_a_long_last_error_is_cut_to_500_characters(tmp_path):
    """An 8 KB last_error went whole into the message (and into every verify row)."""
    reg = _erroring_plugin(tmp_path, '"' + "E" * 8000 + '"')
    with pytest.raises(KernelError) as e:
        reg.dispatch("host_scale", _x())
    assert str(e.value) == "host_scale: kernel returned EX_ERR_SHAPE (3): " + "E" * 500 + "... (7500 more characters)"
    assert e.value.detail.endswith("... (7500 more characters)")


# ------------------------------------------------- 3. a workspace of 2**40 bytes that cannot be had
WS_CHILD = r"""
import resource, sys
import numpy as np
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))   # 1 TiB can never be had
from ex_engine import FactorError, FactorRegistry
reg = FactorRegistry.load(sys.argv[1], hardware="h200")
x = np.arange(7, dtype=np.float32)
for _ in range(2):   # the full path, then the short one
    try:
        reg.dispatch("host_scale_ws", {"x": x, "out": np.empty_like(x), "alpha": np.array([2.0], np.float32)})
    except FactorError as e:
        print(type(e).__name__, isinstance(e, MemoryError), e)
print(reg.stats())
"""


def test_a_legal_workspace_that_cannot_be_allocated_names_the_factor_and_is_counted(tmp_path):
    """workspace_size = 2**40 (allowed) ended in NumPy's bare 'Unable to allocate 1.00 TiB',
    naming no factor, and stats() stayed {}."""
    folder = tmp_path / "w"
    build_plugin(folder, "host_scale_ws", defines={"WORKSPACE": True, "NAME": '"host_scale_ws"',
                                                   "FACTOR_ID": 1107, "WS_BYTES": "(1LL << 40)"}, manifest=False)
    shutil.copy(ROOT / "tests" / "plugins" / "host_scale_ws.yaml", folder / "host_scale_ws.yaml")
    r = subprocess.run([sys.executable, "-c", WS_CHILD, str(folder)], capture_output=True, text=True,
                       timeout=120, env=child_env())
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 3, (r.stdout, r.stderr)
    for line in lines[:2]:
        assert line.startswith("WorkspaceAllocationError True host_scale_ws: cannot allocate its workspace: "
                               "workspace_size returned 1099511627776 bytes (1.00 TiB) for dims [7]; "
                               "expected a size host memory can hold, got MemoryError: "), line
    assert lines[2] == "{'host_scale_ws': {'plugin': 0, 'kernel_fallback': 0, 'python_fallback': 0, 'errors': 2}}"


def test_cupys_out_of_memory_is_told_by_name(tmp_path, monkeypatch):
    """CuPy's OutOfMemoryError (CuPy need not be importable: told by its class name)."""
    from ex_engine.registry import WorkspaceAllocationError
    folder = tmp_path / "w"
    build_plugin(folder, "host_scale_ws", defines={"WORKSPACE": True, "NAME": '"host_scale_ws"',
                                                   "FACTOR_ID": 1107}, manifest=False)
    shutil.copy(ROOT / "tests" / "plugins" / "host_scale_ws.yaml", folder / "host_scale_ws.yaml")
    reg = FactorRegistry.load(folder, hardware="h200")

    class OutOfMemoryError(Exception):
        pass

    def oom(self, key, need):
        raise OutOfMemoryError(f"Out of memory allocating {need} bytes")

    monkeypatch.setattr(FactorRegistry, "_new_workspace", oom)
    with pytest.raises(WorkspaceAllocationError, match=r"^host_scale_ws: cannot allocate its workspace: "
                       r"workspace_size returned 284 bytes \(284 B\) for dims \[7\]; .* got OutOfMemoryError: "
                       r"Out of memory allocating 284 bytes$"):
        reg.dispatch("host_scale_ws", _x())
    assert reg.stats()["host_scale_ws"]["errors"] == 1


# ------------------------------------------------- 4. dispatch names a library rejected at load
@pytest.mark.parametrize("defines,why", [
    ({"FACTOR_ID": 1101}, "manifest id: expected id 1100 (from {p}), library says 1101"),
    ({"RETURN_NULL": True}, "ex_get_factor(hw): returned NULL"),
    ({"ABI_OVERRIDE": "0x20000"}, "abi version: expected major 1"),
])
def test_dispatch_of_a_factor_whose_library_was_rejected_says_why(tmp_path, defines, why):
    """The message was only "no factor named 'host_scale': known are [...]"."""
    build_plugin(tmp_path, defines=defines)
    y = tmp_path / "host_scale.yaml"
    y.write_text(y.read_text(encoding="utf-8").replace("id: 1101", "id: 1100"), encoding="utf-8")   # the manifest keeps its id
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    with pytest.raises(FactorNotFoundError) as e:
        reg.dispatch("host_scale", _x())
    msg = str(e.value)
    assert msg.startswith("no factor named 'host_scale' (host_scale.so was rejected: "
                          + why.format(p=y)), msg
    assert "; see list-factors --why): known are [" in msg, msg
    with pytest.raises(FactorNotFoundError) as e:
        reg.dispatch("other", _x())
    assert "rejected" not in str(e.value)

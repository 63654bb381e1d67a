"""Three nits a plugin author's trial (session thirty-two) left open, mended in session
thirty-three: the workspace's error classes (and TensorLayoutError, NoDeviceError) not importable
from ex_engine; a library built against a newer ABI minor loaded with no remark (and the struct's
version mismatch not saying where the expected one came from); a factor whose manifest sits in
the manifests folder and whose library was rejected served by its Python fallback with no note."""
import shutil

import numpy as np
import pytest

import ex_engine
from ex_engine import FactorError, FactorRegistry, _paths
from ex_engine import errors, hardware, registry
from tests.conftest import ROOT, build_plugin


def _x(n=7):
    x = np.arange(n, dtype=np.float32)
    return {"x": x, "out": np.empty_like(x), "alpha": np.array([2.0], np.float32)}


# ------------------------------------------------- 1. every error class from the package
@pytest.mark.parametrize("name,where,also", [
    ("WorkspaceAllocationError", registry, MemoryError),
    ("WorkspaceSizeError", registry, RuntimeError),
    ("TensorLayoutError", errors, TypeError),
    ("NoDeviceError", hardware, FactorError),
])
def test_every_error_class_is_importable_from_the_package(name, where, also):
    cls = getattr(ex_engine, name)
    assert cls is getattr(where, name) and name in ex_engine.__all__
    assert issubclass(cls, FactorError) and issubclass(cls, also)


def test_every_factor_error_class_of_the_package_is_exported():
    """No FactorError subclass of ex_engine's modules is left out of ex_engine.__all__ (the
    nit: WorkspaceAllocationError was reachable only as ex_engine.registry's)."""
    import inspect
    mods = [errors, hardware, registry]
    found = {n for m in mods for n, c in inspect.getmembers(m, inspect.isclass)
             if issubclass(c, FactorError) and c.__module__ == m.__name__}
    assert found and found <= set(ex_engine.__all__), found - set(ex_engine.__all__)


def test_readme_lists_every_exported_error_class():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in ex_engine.__all__:
        if name.endswith("Error"):
            assert f"`{name}`" in text, name


# ------------------------------------------------- 2. a newer ABI minor
def _abi_check(p, name="abi version"):
    return [c for c in p.checks if c.name == name]


def test_a_library_of_a_newer_abi_minor_loads_with_a_warning_check(tmp_path):
    """0x10001 (1.1) on the 1.0 runtime was `[ok] abi version: 1.1`, no remark."""
    build_plugin(tmp_path, defines={"ABI_OVERRIDE": "0x10001", "STRUCT_ABI": "0x10001"})
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    p = reg.get("host_scale")
    assert p is not None and p.status == "ready", [str(c) for q in reg.plugins for c in q.checks]
    (c,) = _abi_check(p)
    assert c.ok and c.warn, c
    assert c.detail.startswith("warning: 1.1 (read from the file, before opening), newer than this "
                               "runtime's ABI 1.0: loaded (same major); what 1.1 added"), c.detail
    assert reg.dispatch("host_scale", _x()) == "plugin"


def test_the_runtimes_own_minor_gets_a_plain_check(tmp_path):
    build_plugin(tmp_path)
    p = FactorRegistry.load(tmp_path, hardware="h200").get("host_scale")
    (c,) = _abi_check(p)
    assert c.ok and not c.warn and c.detail == "1.0 (read from the file, before opening)", c


def test_another_major_is_still_refused(tmp_path):
    build_plugin(tmp_path, defines={"ABI_OVERRIDE": "0x20001"})
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    (p,) = reg.plugins
    assert p.status == "rejected" and "expected major 1" in p.reason, p.reason


def test_the_structs_version_mismatch_says_where_the_expected_one_came_from(tmp_path):
    build_plugin(tmp_path, defines={"ABI_OVERRIDE": "0x10001"})   # the struct keeps 1.0
    (p,) = FactorRegistry.load(tmp_path, hardware="h200").plugins
    assert p.status == "rejected"
    assert ("struct abi_version: expected 1.1 (the library's ex_abi_version), got 1.0 in the struct "
            "ex_get_factor returned") in p.reason, p.reason


# ------------------------------------------------- 3. a rejected library, its manifest elsewhere
def _manifests_with_host_scale(tmp_path, fallback=True):
    m = tmp_path / "m"
    shutil.copytree(_paths.manifests_dir(), m)
    text = (ROOT / "tests" / "plugins" / "host_scale.yaml").read_text(encoding="utf-8")
    if not fallback:
        text = "\n".join(line for line in text.splitlines() if not line.startswith("fallback:")) + "\n"
    (m / "host_scale.yaml").write_text(text, encoding="utf-8")
    return m


def test_a_rejected_library_whose_manifest_is_in_the_manifests_folder_gets_a_note(tmp_path):
    """The trial's repro: the manifest in EX_ENGINE_MANIFESTS, the library rejected for its id;
    NumPy calls were served by python_fallback with reg.notes == []."""
    m = _manifests_with_host_scale(tmp_path)
    build_plugin(tmp_path / "lib", defines={"FACTOR_ID": 1101}, manifest=False)
    reg = FactorRegistry.load(tmp_path / "lib", hardware="h200", manifests_dir=m)
    (p,) = reg.plugins
    assert p.status == "rejected"
    notes = [n for n in reg.notes if n.startswith("fallback:")]
    assert notes == [f"fallback: host_scale: no ready plugin: host_scale.so was rejected ({p.reason}); its "
                     "calls go to the Python fallback tests.plugins.host_scale_fallback:scale if it imports "
                     "(not checked: the library was rejected before that check); see "
                     "list-factors --why"], reg.notes
    assert reg.dispatch("host_scale", _x()) == "python_fallback"


def test_the_note_says_when_there_is_no_fallback_and_goes_when_a_ready_library_comes(tmp_path):
    m = _manifests_with_host_scale(tmp_path, fallback=False)
    build_plugin(tmp_path / "bad", defines={"RETURN_NULL": True}, manifest=False)
    reg = FactorRegistry.load(tmp_path / "bad", hardware="h200", manifests_dir=m)
    (note,) = [n for n in reg.notes if n.startswith("fallback:")]
    assert note.endswith("its calls raise FactorError unless set_fallback gives it a Python fallback; "
                         "see list-factors --why"), note
    assert "ex_get_factor(hw): returned NULL" in note
    build_plugin(tmp_path / "good", manifest=False)
    reg.load_folder(tmp_path / "good")
    assert reg.get("host_scale") is not None
    assert not [n for n in reg.notes if n.startswith("fallback:")], reg.notes


def test_no_note_where_another_library_of_the_name_is_ready(tmp_path):
    """A rejected second library of a served factor (the sm90 plugin on another GPU) is no news."""
    m = _manifests_with_host_scale(tmp_path)
    build_plugin(tmp_path / "lib", manifest=False)
    build_plugin(tmp_path / "lib", stem="host_scale_v2", defines={"RETURN_NULL": True}, manifest=False)
    reg = FactorRegistry.load(tmp_path / "lib", hardware="h200", manifests_dir=m)
    assert sorted(p.status for p in reg.plugins) == ["ready", "rejected"]
    assert not [n for n in reg.notes if n.startswith("fallback:")], reg.notes

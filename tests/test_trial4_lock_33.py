"""The lock's promise held against two ways a trial (an operations engineer's, session 33)
defeated it: the file replaced between its checks and dlopen (while the probe child ran), and a
library rebuilt after this process first opened it, whose old copy dlopen handed back while the
registry reported the new file's sha256 and "lock matches"."""
import os
import shutil

import numpy as np
import pytest

from ex_engine import FactorRegistry, abi, registry, trust
from tests.conftest import build_plugin


def _x():
    x = np.arange(4, dtype=np.float32)
    return {"x": x, "out": np.empty_like(x), "alpha": np.array([2.0], np.float32)}


def _v2(folder, name="host_scale"):
    """Another build of host_scale (version 2.0.0, out = alpha*x + 1) at folder/v2/."""
    return build_plugin(folder / "v2", defines={"VERSION": '"2.0.0"', "BEHAVIOUR": 4})


def test_a_file_replaced_between_its_checks_and_dlopen_is_refused(tmp_path, monkeypatch):
    """The trial swapped the file while the probe child ran: the lock had matched the old
    bytes, and the new ones ran. Here the swap happens just before dlopen."""
    build_plugin(tmp_path / "lib")
    trust.write_lock(tmp_path / "lib")
    v2 = _v2(tmp_path)
    real = abi.dlopen

    def swap_then_open(path):
        if os.path.basename(str(path)) == "host_scale.so":
            os.replace(v2, path)
        return real(path)

    monkeypatch.setattr(abi, "dlopen", swap_then_open)
    reg = FactorRegistry.load(tmp_path / "lib", hardware="h200", lock=True)
    (p,) = reg.plugins
    assert p.status == "rejected", [str(c) for c in p.checks]
    assert [c.name for c in p.checks if not c.ok] == ["file unchanged"]
    assert p.reason.startswith(f"file unchanged: the file changed on disk between its checks (sha256 {p.sha256}) "
                               "and dlopen"), p.reason
    assert "none of it is used" in p.reason and "restart it to load the file" in p.reason
    assert reg.get("host_scale") is None
    # the process holds that copy by this path: a later load is refused too, saying why
    monkeypatch.setattr(abi, "dlopen", real)
    (q,) = FactorRegistry.load(tmp_path / "lib", hardware="h200").plugins
    assert q.status == "rejected" and "one of unknown bytes" in q.reason, q.reason


def test_a_file_replaced_by_the_same_bytes_while_it_loads_passes(tmp_path, monkeypatch):
    """A deploy that puts an identical copy in place (rsync, cp then mv) during the load: the
    bytes opened are the bytes checked, whichever file dlopen opened."""
    lib = build_plugin(tmp_path / "lib")
    shutil.copy(lib, tmp_path / "same.so")
    real = abi.dlopen

    def swap_then_open(path):
        if os.path.basename(str(path)) == "host_scale.so":
            os.replace(tmp_path / "same.so", path)
        return real(path)

    monkeypatch.setattr(abi, "dlopen", swap_then_open)
    reg = FactorRegistry.load(tmp_path / "lib", hardware="h200")
    p = reg.get("host_scale")
    assert p is not None, [str(c) for q in reg.plugins for c in q.checks]
    assert ("file unchanged", True, "replaced by a file of the same bytes while it was loaded") in [
        (c.name, c.ok, c.detail) for c in p.checks]


def test_a_library_rebuilt_after_this_process_opened_it_is_refused_with_the_reason(tmp_path):
    """The trial: load, replace the file with another build, lock again, load: the registry said
    version 1.0.0 with the new file's sha256 and ran the old code."""
    folder = tmp_path / "lib"
    build_plugin(folder)
    first = FactorRegistry.load(folder, hardware="h200")
    assert first.dispatch("host_scale", _x()) == "plugin"
    old = first.get("host_scale").sha256
    os.replace(_v2(tmp_path), folder / "host_scale.so")
    trust.write_lock(folder)
    second = FactorRegistry.load(folder, hardware="h200", lock=True)
    (p,) = second.plugins
    assert p.status == "rejected" and p.sha256 != old
    assert [c.name for c in p.checks if not c.ok] == ["loaded copy"], [str(c) for c in p.checks]
    assert (f"loaded copy: this process already holds a copy of host_scale.so by this path, one opened "
            f"earlier from sha256 {old}, and dlopen handed back that copy, not this file (sha256 {p.sha256})"
            ) in p.reason, p.reason
    assert "restart it to load the new build" in p.reason
    assert [c.name for c in p.checks if c.name == "sha256 lock" and c.ok]   # the lock matched the file
    # the first registry keeps working on its copy
    assert first.dispatch("host_scale", _x()) == "plugin"
    del first


def test_the_same_bytes_under_a_new_inode_are_the_same_copy(tmp_path):
    """A file replaced by an identical one (a no-op rebuild, a copy back) passes: same code."""
    folder = tmp_path / "lib"
    build_plugin(folder)
    first = FactorRegistry.load(folder, hardware="h200")
    shutil.copy(folder / "host_scale.so", tmp_path / "same.tmp")
    os.replace(tmp_path / "same.tmp", folder / "host_scale.so")
    second = FactorRegistry.load(folder, hardware="h200")
    p = second.get("host_scale")
    assert p is not None and ("loaded copy", True) in [(c.name, c.ok) for c in p.checks]
    assert second.dispatch("host_scale", _x()) == "plugin"
    del first


def test_a_copy_is_kept_open_for_the_process(tmp_path):
    """The copies are never closed (so a copy's address, the key of what it holds, is never
    another library's): the registry that opened it may be gone."""
    build_plugin(tmp_path)
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    key = int(abi.ffi.cast("uintptr_t", reg.get("host_scale").lib.ex_get_factor))
    sha = reg.get("host_scale").sha256
    del reg
    import gc
    gc.collect()
    assert registry._COPIES[key][0] == sha


def test_the_import_probe_child_finds_the_users_package_before_the_checkouts(tmp_path, monkeypatch):
    """child_sys_path put the checkout root (with its own tests/) first: a user's package named
    tests, on the path of this process, was shadowed in the probe's child only, so a fallback
    module that ends the process at import passed the probe (the child did not find it) and
    then ended the process that imported it."""
    user = tmp_path / "user"
    (user / "tests").mkdir(parents=True)
    (user / "tests" / "__init__.py").write_text("")
    (user / "tests" / "myfb_33.py").write_text("import os\nos._exit(7)\n")
    monkeypatch.syspath_prepend(str(user))
    ok, detail = registry.probe_fallback_import("tests.myfb_33")
    assert not ok and "ended with status 7 while importing it" in detail, detail
    paths = trust.child_sys_path()
    root = str(registry.Path(registry.__file__).resolve().parents[1])
    assert paths.index(str(user)) < paths.index(root)


# ------------------------------------------------- paths that cannot be reached or listed
def _deny(monkeypatch, target):
    """os.scandir of ``target`` (and Path.stat below it) raise PermissionError, as for a user
    without the folder's permissions (this suite runs as root, whom chmod does not stop)."""
    real_scandir = os.scandir

    def scandir(path="."):
        if os.path.abspath(os.fspath(path)) == str(target):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)
    monkeypatch.setattr(os, "scandir", scandir)


def test_an_unreadable_tuning_folder_is_a_note_not_no_file(tmp_path, monkeypatch):
    import warnings
    from ex_engine import _paths
    m = tmp_path / "m"
    shutil.copytree(_paths.manifests_dir(), m)
    _deny(monkeypatch, m / "tuning")
    (tmp_path / "none").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a note, not also a warning
        reg = FactorRegistry.load(tmp_path / "none", hardware="h200", manifests_dir=m)
    assert reg.tuning.folder_problem and reg.tuning.factors == {}
    assert [n for n in reg.notes if n.startswith("tuning:")] == [
        f"tuning: tuning folder {m / 'tuning'}: cannot be read (Permission denied): none of its files read; "
        "skipped"], reg.notes
    from ex_engine.tuning import TuningTable, TuningWarning
    with pytest.warns(TuningWarning, match="cannot be read"):
        TuningTable.for_hardware("h200", m / "tuning")


def _deny_below(monkeypatch, folder):
    """Path.is_dir of anything below ``folder`` raises PermissionError, as Python 3.11's does for
    a user who may not enter it (this suite runs as root)."""
    from pathlib import Path
    real = Path.is_dir

    def is_dir(self):
        if str(self).startswith(str(folder) + "/"):
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)
    monkeypatch.setattr(Path, "is_dir", is_dir)


def test_a_factor_folder_that_cannot_be_reached_is_a_factor_error(tmp_path, monkeypatch):
    from ex_engine import FactorError
    target = tmp_path / "locked" / "sub"
    _deny_below(monkeypatch, tmp_path / "locked")
    with pytest.raises(FactorError, match=rf"^factor folder '{target}': cannot be reached \(Permission denied\)$"):
        FactorRegistry.load(target, hardware="h200")


def test_a_hardware_profile_path_that_cannot_be_reached_is_a_factor_error(tmp_path, monkeypatch):
    from ex_engine import FactorError, Hardware
    from pathlib import Path
    real = Path.exists
    target = tmp_path / "locked" / "x.yaml"

    def exists(self, *a, **k):
        if str(self) == str(target):
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **k)
    monkeypatch.setattr(Path, "exists", exists)
    with pytest.raises(FactorError, match=r"^hardware profile '.*x.yaml': cannot be reached \(Permission denied: "):
        Hardware.from_profile(str(target))


def test_a_manifests_folder_that_cannot_be_reached_is_named(tmp_path, monkeypatch):
    from ex_engine import FactorError
    target = tmp_path / "locked" / "manifests"
    _deny_below(monkeypatch, tmp_path / "locked")
    (tmp_path / "none").mkdir()
    with pytest.raises(FactorError, match=rf"^manifests_dir '{target}': cannot be reached \(Permission denied\); "
                                          "expected a folder of factor manifests"):
        FactorRegistry.load(tmp_path / "none", hardware="h200", manifests_dir=target)
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", str(target))
    with pytest.raises(FactorError, match=rf"EX_ENGINE_MANIFESTS={target}: {target} cannot be reached"):
        FactorRegistry.load(tmp_path / "none", hardware="h200")


def test_a_library_reached_by_two_names_gets_a_note(tmp_path):
    """alias.so -> host_scale.so: one row (alias.so), and host_scale.so vanished without a word."""
    build_plugin(tmp_path)
    (tmp_path / "alias.so").symlink_to("host_scale.so")
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    assert [p.path.name for p in reg.plugins] == ["alias.so"]
    assert (f"host_scale.so: the same file as alias.so ({tmp_path / 'host_scale.so'}); listed and loaded "
            "once, as alias.so") in reg.notes, reg.notes
    reg.load_folder(tmp_path)   # loading the folder again adds no second note
    assert sum("the same file as" in n for n in reg.notes) == 1


def test_list_factors_says_the_tuning_folder_cannot_be_read(tmp_path, monkeypatch, capsys):
    from ex_engine import _paths, cli
    m = tmp_path / "m"
    shutil.copytree(_paths.manifests_dir(), m)
    _deny(monkeypatch, m / "tuning")
    monkeypatch.setenv("EX_ENGINE_MANIFESTS", str(m))
    (tmp_path / "none").mkdir()
    cli.main(["list-factors", "--dir", str(tmp_path / "none"), "--hardware", "h200"])
    out = capsys.readouterr().out
    assert (f"tuning: the folder {m / 'tuning'} cannot be read (see the note): tuned dims take the kernels' "
            "defaults") in out, out
    assert f"tuning folder {m / 'tuning'}: cannot be read (Permission denied)" in out, out

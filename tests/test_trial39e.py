"""Review of session 39's changes (trial 39e), mended with tests:

- a cached verify pass was keyed on every EX_* variable, EX_COMMIT too, which only names the
  commit a benchmark records: a new EX_COMMIT verified every library again (and the registry's
  shared-library check warned of 'other EX_* variables' for it);
- load_folder noted an opened library as 'changed on disk ... restart the process to load the
  new file' after a `touch` or a redeploy of the same bytes (copy and rename), whose bytes were
  the ones it runs;
- a child forked while a thread of the parent held verify's cache lock kept that flock (its copy
  of the descriptor) for as long as it lived: every later cache update, of any process, waited
  CACHE_LOCK_WAIT_S and then wrote without the lock;
- verify's cached-pass context names the factor's tuning rows, which no test checked.
"""
import os
import shutil
import threading
import time
import warnings

import pytest

from ex_engine import FactorRegistry, verify
from tests.conftest import build_plugin


def _verify_detail(reg):
    return next(c for c in reg.get("host_scale").checks if c.name == "verify").detail


def test_ex_commit_neither_voids_a_cached_pass_nor_counts_as_a_library_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("EX_ENGINE_CACHE", str(tmp_path / "cache"))
    build_plugin(tmp_path / "lib")
    monkeypatch.setenv("EX_COMMIT", "aaaa")
    first = FactorRegistry.load(tmp_path / "lib", hardware="h200", verify=True)
    assert _verify_detail(first).startswith("1 cases passed"), _verify_detail(first)
    monkeypatch.setenv("EX_COMMIT", "bbbb")
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no 'shared library' warning for EX_COMMIT
        again = FactorRegistry.load(tmp_path / "lib", hardware="h200", verify=True)
    assert _verify_detail(again).startswith("passed before"), _verify_detail(again)
    assert not any(c.name == "shared library" for c in again.plugins[0].checks)


def test_an_opened_library_touched_or_redeployed_unchanged_gets_no_note(tmp_path):
    lib = build_plugin(tmp_path / "lib")
    reg = FactorRegistry.load(tmp_path / "lib", hardware="h200")
    (p,) = reg.plugins
    os.chmod(lib, 0o700)                                     # ctime only
    assert reg.load_folder(tmp_path / "lib") == [p] and reg.notes == []
    time.sleep(0.02)
    os.utime(lib)                                            # `touch`: mtime
    assert reg.load_folder(tmp_path / "lib") == [p] and reg.notes == [], reg.notes
    shutil.copy(lib, tmp_path / "lib" / ".tmp")              # the same build again: a new inode
    os.replace(tmp_path / "lib" / ".tmp", lib)
    assert reg.load_folder(tmp_path / "lib") == [p] and reg.notes == [], reg.notes
    assert p.status == "ready"
    build_plugin(tmp_path / "new", defines={"VERSION": '"1.0.9"'})   # other bytes: noted
    os.replace(tmp_path / "new" / "host_scale.so", lib)
    reg.load_folder(tmp_path / "lib")
    assert len(reg.notes) == 1 and reg.notes[0].startswith("host_scale.so: the file changed on disk"), reg.notes


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_during_a_cache_update_does_not_keep_the_cache_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("EX_ENGINE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    monkeypatch.setattr(verify, "CACHE_LOCK_WAIT_S", 3.0)
    inside, done = threading.Event(), threading.Event()

    def update():   # a thread of the parent inside a cache update at the fork
        with verify._cache_locked():
            inside.set()
            done.wait(10)
    t = threading.Thread(target=update)
    t.start()
    assert inside.wait(10)
    pid = os.fork()
    if pid == 0:   # a long-lived worker
        time.sleep(20)
        os._exit(0)
    try:
        done.set()
        t.join(10)
        t0 = time.monotonic()
        with verify._cache_locked():   # another update: a descriptor of its own
            waited = time.monotonic() - t0
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert waited < 1.0, f"the update waited {waited:.1f} s on the lock the forked child kept"

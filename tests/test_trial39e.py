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
- a child forked while another thread made the first call (which imported ex_engine.verify and
  numpy.ma) waited forever on that import's module lock;
- verify's cached-pass context names the factor's tuning rows, which no test checked.
"""
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings

import pytest

from ex_engine import FactorRegistry, verify
from tests.conftest import ROOT, build_plugin, child_env


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


_FORK_IN_FIRST_IMPORT = r"""
import os, signal, sys, threading
from importlib import _bootstrap
import numpy as np
from ex_engine import FactorRegistry, topk_softmax
reg = FactorRegistry.load(sys.argv[1], hardware="h200")
logits = np.random.default_rng(0).standard_normal((4, 16), dtype=np.float32)
for name in ("ex_engine.verify", "numpy.ma"):   # first imported by the first call, until now
    held, go = threading.Event(), threading.Event()
    def importing():   # another thread inside that first import at the fork
        lock = _bootstrap._get_module_lock(name)
        lock.acquire(); held.set(); go.wait(); lock.release()
    t = threading.Thread(target=importing); t.start(); held.wait()
    pid = os.fork()
    if pid == 0:
        signal.alarm(5)
        topk_softmax(logits, 2, registry=reg)
        os._exit(0)
    go.set(); t.join()
    _, st = os.waitpid(pid, 0)
    print(name, "ok" if os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0 else f"hung or failed ({st})")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_a_thread_makes_the_first_call_does_not_hang():
    """The first fallback call imported ex_engine.verify (_poison_outputs) and numpy.ma
    (arrays._kind_of's np.ma): a child forked while another thread held such an import's
    module lock waited forever on its own first call (1 of the first forks in most runs of
    three calling threads and a loading one)."""
    r = subprocess.run([sys.executable, "-c", _FORK_IN_FIRST_IMPORT, str(ROOT / "factors")],
                       capture_output=True, text=True, timeout=120, env=child_env())
    assert r.stdout.split("\n")[:2] == ["ex_engine.verify ok", "numpy.ma ok"], (r.stdout, r.stderr[-2000:])


def test_a_cached_pass_is_keyed_on_the_factors_tuning_rows():
    reg = FactorRegistry("h200")

    class P:   # what _context_digest reads of a plugin
        name = "moe_fused_gemm"
    table = reg.tuning.factors["moe_fused_gemm"]
    before = verify._context_digest(reg, P)
    shape, (ts, vs) = next(iter(table.table.items()))
    table.table[shape] = (ts, [v + 1 for v in vs])
    assert verify._context_digest(reg, P) != before
    table.table[shape] = (ts, vs)
    assert verify._context_digest(reg, P) == before

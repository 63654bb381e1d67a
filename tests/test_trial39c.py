"""An operations engineer's trial (trial 39c: a multi-threaded server with forked workers, a
shared verify cache, plugin folders that change while it runs), mended with tests:

- verify's cache: a FIFO at verified.json hung load(verify=True) forever, a link to /dev/zero
  read until MemoryError and rejected the plugin, a corrupt / empty / non-UTF-8 / non-object file
  was dropped without a word; writing followed a link at verified.json and renamed the JSON over
  whatever it pointed at (run as root, /dev/zero became a JSON file); processes verifying at once
  dropped each other's entries while each said 'cached'; EX_ENGINE_CACHE of whitespace made a
  folder named so; a pass was reused under other EX_* variables (another code path of the
  library, never checked);
- a child made by fork waited forever on a lock another thread of the parent held at the fork;
- a registry given to a multiprocessing worker failed with "cannot pickle 're.Match' object";
- a library refused unopened (cut short while it was copied) stayed refused after the copy
  finished and the folder was loaded again; a library replaced on disk after it was opened was
  kept by a later load_folder without a word.
"""
import json
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest

from ex_engine import FactorRegistry, topk_softmax, trust, verify
from tests.conftest import ROOT, build_plugin, child_env


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EX_ENGINE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "verified.json"


def _load_in_thread(folder, timeout=60.0):
    """FactorRegistry.load(folder, verify=True) in a daemon thread; the registry, or None if it
    did not return within ``timeout`` seconds (a read blocked on a FIFO)."""
    out = []
    t = threading.Thread(target=lambda: out.append(
        FactorRegistry.load(folder, hardware="h200", verify=True)), daemon=True)
    t.start()
    t.join(timeout)
    return out[0] if out else None


def _verify_check(reg):
    return next(c for c in reg.get("host_scale").checks if c.name == "verify")


# ------------------------------------------------------------------ the verify cache
def test_a_fifo_at_the_cache_path_is_ignored_not_waited_on(tmp_path, cache):
    build_plugin(tmp_path / "lib")
    cache.parent.mkdir()
    os.mkfifo(cache)
    reg = _load_in_thread(tmp_path / "lib")
    assert reg is not None, "load(verify=True) blocked reading a FIFO at verified.json"
    detail = _verify_check(reg).detail
    assert detail.startswith("1 cases passed") and "not a regular file (a FIFO)" in detail, detail
    assert any(n.startswith(f"verify cache {cache}: not a regular file (a FIFO)") for n in reg.notes), reg.notes


def test_a_link_to_a_fifo_is_neither_read_nor_replaced(tmp_path, cache):
    """Writing resolved the link and renamed the JSON over its target: a device or a FIFO
    (verified.json -> /dev/null, to switch the cache off) was replaced by a regular file."""
    build_plugin(tmp_path / "lib")
    (tmp_path / "elsewhere").mkdir()
    target = tmp_path / "elsewhere" / "pipe"
    os.mkfifo(target)
    cache.parent.mkdir()
    cache.symlink_to(target)
    reg = _load_in_thread(tmp_path / "lib")
    assert reg is not None and reg.get("host_scale") is not None
    assert stat.S_ISFIFO(os.stat(target).st_mode), "the link's target was replaced"
    assert cache.is_symlink()
    detail = _verify_check(reg).detail
    assert f"not cached: {cache}: a link to {target}, not a regular file (a FIFO); not replaced" in detail, detail


def test_replace_file_leaves_what_is_not_a_regular_file(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "link").symlink_to(tmp_path / "pipe")
    for dest in (tmp_path / "pipe", tmp_path / "link"):
        with pytest.raises(OSError, match=r"not a regular file \(a FIFO\); not replaced"):
            trust.replace_file(dest, "{}")
    assert stat.S_ISFIFO(os.stat(tmp_path / "pipe").st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "pipe"]   # no temporary left
    (tmp_path / "real").write_text("old")
    (tmp_path / "link2").symlink_to(tmp_path / "real")
    trust.replace_file(tmp_path / "link2", "new")   # a link to a regular file: as before
    assert (tmp_path / "real").read_text(encoding="utf-8") == "new" and (tmp_path / "link2").is_symlink()


@pytest.mark.parametrize("content, why", [
    (b'{"a": ', "not valid JSON (Expecting value"),
    (b"", "not valid JSON (empty file)"),
    (b"\xff\xfe{}", "not UTF-8 text"),
    (b"[1, 2]", "expected a JSON object {key: entry}, got list"),
])
def test_a_bad_cache_file_is_named_when_it_is_ignored(tmp_path, cache, content, why):
    build_plugin(tmp_path / "lib")
    cache.parent.mkdir()
    cache.write_bytes(content)
    reg = FactorRegistry.load(tmp_path / "lib", hardware="h200", verify=True)
    detail = _verify_check(reg).detail
    assert detail.startswith(f"1 cases passed against the Python fallback (cached in {cache}; "
                             f"the cache file found was ignored ({cache}: {why}"), detail
    assert any(n.startswith(f"verify cache {cache}: {why}") and n.endswith(": ignored") for n in reg.notes)
    assert f"{reg.get('host_scale').sha256}|host" in json.loads(cache.read_text(encoding="utf-8"))   # replaced by a good one
    again = FactorRegistry.load(tmp_path / "lib", hardware="h200", verify=True)
    assert _verify_check(again).detail.startswith("passed before") and not any("verify cache" in n for n in again.notes)


def test_a_cache_file_over_the_limit_is_not_read(tmp_path, cache, monkeypatch):
    build_plugin(tmp_path / "lib")
    cache.parent.mkdir()
    cache.write_text(json.dumps({"x": "y" * 200}), encoding="utf-8")
    monkeypatch.setattr(verify, "CACHE_LIMIT", 100)
    reg = FactorRegistry.load(tmp_path / "lib", hardware="h200", verify=True)
    assert "over the limit of 100 B: not read" in _verify_check(reg).detail, _verify_check(reg).detail


def test_whitespace_ex_engine_cache_counts_as_unset(tmp_path, monkeypatch):
    monkeypatch.setenv("EX_ENGINE_CACHE", "   ")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert verify.cache_file() == tmp_path / ".cache" / "ex_engine" / "verified.json"


_WRITER = r"""
import sys, warnings
warnings.simplefilter("ignore")
from ex_engine import FactorRegistry
reg = FactorRegistry.load(sys.argv[1], hardware="h200", verify=True)
check = next(c for c in reg.get("host_scale").checks if c.name == "verify")
print(reg.get("host_scale").sha256, check.detail)
"""


def test_processes_verifying_at_once_keep_every_entry(tmp_path, cache):
    """Each process read the file, added its entry and replaced it: of 12 at once, 4 to 6
    entries were lost (each saying 'cached in ...')."""
    n = 8
    for i in range(n):
        build_plugin(tmp_path / f"lib{i}", defines={"VERSION": f'"1.0.{i}"'})
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path / f"lib{i}")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=child_env()) for i in range(n)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
    shas = {o[0].split()[0] for o in outs}
    assert all("cached in" in o[0] for o in outs), outs
    assert shas <= {k.split("|")[0] for k in json.loads(cache.read_text(encoding="utf-8"))}, "entries lost"


def test_a_pass_is_not_reused_under_other_ex_variables(tmp_path, cache, monkeypatch):
    """The library reads EX_TEST_HOST_SCALE_PATH at load, as the shipped factors read their EX_*
    switches; '1' selects a wrong path. A pass with it unset was reused with it set."""
    build_plugin(tmp_path / "lib", defines={"ENV_SWITCH": '"EX_TEST_HOST_SCALE_PATH"'})
    monkeypatch.delenv("EX_TEST_HOST_SCALE_PATH", raising=False)
    reg = FactorRegistry.load(tmp_path / "lib", hardware="h200", verify=True)
    assert _verify_check(reg).detail.startswith("1 cases passed")
    assert _verify_check(FactorRegistry.load(tmp_path / "lib", hardware="h200", verify=True)
                         ).detail.startswith("passed before")
    monkeypatch.setenv("EX_TEST_HOST_SCALE_PATH", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # (the shared-library warning: other EX_* variables)
        other = FactorRegistry.load(tmp_path / "lib", hardware="h200", verify=True)
    (p,) = other.plugins
    assert p.status == "rejected" and "failed against the Python fallback" in p.reason, p.reason


# ------------------------------------------------------------------ fork, pickle
def _child_status(fn) -> int:
    pid = os.fork()
    if pid == 0:   # the child: a call, with an alarm against a wait that never ends
        code = 1
        try:
            signal.alarm(20)
            fn()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_wait_on_a_lock_held_at_the_fork():
    """Another thread of the parent inside stats() or a call's count at the fork left the
    registry's lock held in the child forever (15 of 100 forks beside three calling threads)."""
    reg = FactorRegistry.load(ROOT / "factors", hardware="h200")
    logits = np.random.default_rng(0).standard_normal((4, 16), dtype=np.float32)
    want = topk_softmax(logits, 2, registry=reg)[1]
    from ex_engine import ops, registry as registry_mod

    def use():
        ids = topk_softmax(logits, 2, registry=reg)[1]
        assert np.array_equal(ids, want) and reg.stats()["topk_softmax"]["python_fallback"] == 2
        reg.check_device_errors()
        reg.tuning.value("moe_fused_gemm", "config", {"H": 8, "I": 8, "G": 8, "K": 1, "T": 1}, -1)
        reg.tuning.override("moe_fused_gemm", None)   # (value() above takes no lock without a GPU)
        with registry_mod._OPENED_LOCK, ops._default_lock:
            pass
    held = [reg._lock, reg._ws_lock, reg.tuning._lock, registry_mod._OPENED_LOCK, ops._default_lock]
    for lock in held:
        lock.acquire()
    try:
        status = _child_status(use)
    finally:
        for lock in held:
            lock.release()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_a_registry_cannot_be_pickled_and_says_so():
    reg = FactorRegistry("h200")
    with pytest.raises(TypeError, match="a FactorRegistry cannot be pickled or copied: it holds the plugin "
                                        "libraries this process opened; load one in each process"):
        pickle.dumps(reg)


# ------------------------------------------------------------------ a folder that changes
def test_a_library_refused_unopened_is_checked_again_once_it_changed(tmp_path):
    lib = build_plugin(tmp_path / "src")
    folder = tmp_path / "plugins"
    folder.mkdir()
    shutil.copy(tmp_path / "src" / "host_scale.yaml", folder)
    (folder / "host_scale.so").write_bytes(lib.read_bytes()[:3000])   # a copy caught half-way
    reg = FactorRegistry.load(folder, hardware="h200")
    (p,) = reg.plugins
    assert p.status == "rejected" and p.reason.startswith("elf: "), p.reason
    assert reg.load_folder(folder)[0] is p   # unchanged: its record, not read again
    shutil.copy(lib, folder / ".host_scale.so.tmp")
    os.replace(folder / ".host_scale.so.tmp", folder / "host_scale.so")
    (q,) = reg.load_folder(folder)
    assert q.status == "ready" and reg.plugins == [q], q.reason
    x, out = np.arange(4, dtype=np.float32), np.zeros(4, np.float32)
    assert reg.dispatch("host_scale", {"out": out, "x": x, "alpha": np.array([2], np.float32)}) == "plugin"
    assert out.tolist() == [0, 2, 4, 6]


def test_an_opened_library_replaced_on_disk_is_kept_with_a_note(tmp_path):
    build_plugin(tmp_path / "lib")
    reg = FactorRegistry.load(tmp_path / "lib", hardware="h200")
    (p,) = reg.plugins
    build_plugin(tmp_path / "new", defines={"VERSION": '"1.0.9"'})
    os.replace(tmp_path / "new" / "host_scale.so", tmp_path / "lib" / "host_scale.so")
    assert reg.load_folder(tmp_path / "lib") == [p] and p.status == "ready"
    assert any(n.startswith("host_scale.so: the file changed on disk since this registry opened it "
                            f"(sha256 {p.sha256}); it keeps the copy it opened") for n in reg.notes), reg.notes


def test_a_rewrite_in_place_with_its_mtime_set_back_is_seen(tmp_path, monkeypatch):
    """A writer that rewrote the library in place (same inode, same size) and put its mtime back,
    between the registry's read (hash, lock) and its dlopen: the identity (device, inode, size,
    mtime) matched, so the lock passed and the other bytes ran (out = 2x + 1). ctime, which no
    user can set, now tells it."""
    from ex_engine import abi
    lib = build_plugin(tmp_path / "lib")
    wrong = build_plugin(tmp_path / "wrong", defines={"BEHAVIOUR": 4}, manifest=False)
    assert wrong.stat().st_size == lib.stat().st_size
    trust.write_lock(tmp_path / "lib")
    real = abi.dlopen

    def racing_dlopen(path):
        st = os.stat(path)
        time.sleep(0.05)   # past the file system's coarse timestamp tick (a few ms)
        with open(path, "r+b") as fh:
            fh.write(wrong.read_bytes())
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        return real(path)
    monkeypatch.setattr(abi, "dlopen", racing_dlopen)
    reg = FactorRegistry.load(tmp_path / "lib", hardware="h200", lock=True)
    (p,) = reg.plugins
    assert p.status == "rejected" and p.reason.startswith("file unchanged: the file changed on disk"), p.reason

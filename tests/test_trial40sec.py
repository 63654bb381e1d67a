"""Session forty's security trial of the plugin trust chain (lock files, the verify cache): each
test failed before its fix."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ex_engine import trust, verify
from ex_engine.errors import FactorError
from ex_engine.registry import FactorRegistry

from .conftest import ROOT, build_plugin, child_env

DEEP = 100_000   # nesting levels: under the 4 MiB lock limit, far past Python's recursion limit


def _deep_json(path, prefix="") -> None:
    """A file of ``prefix`` and DEEP opening brackets: JSON nested past any recursion limit."""
    path.write_text(prefix + "[" * DEEP, encoding="utf-8")


def test_deeply_nested_lock_file_is_a_factor_error(tmp_path):
    """A lock file of nested brackets raised RecursionError (json's decoder) out of read_lock,
    FactorRegistry.load and `list-factors --lock` (a traceback), where a malformed lock is a
    FactorError naming the file."""
    lock = tmp_path / "deep.lock"
    _deep_json(lock)
    with pytest.raises(FactorError, match="not readable JSON"):
        trust.read_lock(lock)
    folder = tmp_path / "lib"
    build_plugin(folder)
    with pytest.raises(FactorError, match="deep.lock"):
        FactorRegistry.load(folder, hardware="h200", lock=lock)


def test_deeply_nested_lock_file_cli(tmp_path):
    """`ex-engine list-factors --lock FILE` on such a file: an error line naming it, no traceback."""
    lock = tmp_path / "deep.lock"
    _deep_json(lock)
    folder = tmp_path / "lib"
    build_plugin(folder)
    r = subprocess.run([sys.executable, "-m", "ex_engine", "list-factors", "--dir", str(folder),
                        "--hardware", "h200", "--no-probe", "--lock", str(lock)],
                       capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=120)
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "RecursionError" not in r.stderr
    assert "deep.lock" in r.stderr
    assert r.returncode != 0


def test_deeply_nested_verify_cache_is_ignored(tmp_path, monkeypatch):
    """A verified.json of nested brackets raised RecursionError out of _load_cache ("never
    raises") and so out of FactorRegistry.load(verify=True): anyone who can write the cache
    folder stopped every verified load. It is a corrupt cache now: ignored, named, replaced."""
    cache = tmp_path / "cache"
    cache.mkdir()
    _deep_json(cache / "verified.json", '{"x": ')
    monkeypatch.setenv("EX_ENGINE_CACHE", str(cache))
    entries, why = verify._load_cache()
    assert entries == {} and "not valid JSON" in why
    folder = tmp_path / "lib"
    build_plugin(folder)
    reg = FactorRegistry.load(folder, hardware="h200", verify=True)
    assert reg.get("host_scale").status == "ready", reg.get("host_scale").reason
    assert any("verified.json" in n and "ignored" in n for n in reg.notes), reg.notes
    assert os.path.getsize(cache / "verified.json") < 10_000   # replaced by a real cache

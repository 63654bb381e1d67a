"""Session 43's packaging trial: ex_engine built into an sdist and a wheel and used from another
folder, not from an editable checkout.

- The wheel carried the package alone: no hardware profile, tuning file, model list or factor
  manifest, so every command failed (`list-factors --dir <checkout>/factors` too: 'no profiles
  to choose from'), and so did FactorRegistry.load(folder) without a GPU. It now carries
  manifests/ as ex_engine/manifests, the default where no checkout's manifests/ is beside the
  package; the missing plugin folder is what the first error names.
- The sdist held the package and a partial tests/ (no conftest.py, reference.py or plugins/):
  no Makefile, factors/*.cu, include/ or manifests/, so nothing could be built from it.
- `python -m build` left dist/ untracked in the checkout.

The build tests run setuptools (build_py, sdist) in a copy of the checkout, not pip: a few
seconds, no network, no `wheel` package needed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

setuptools = pytest.importorskip("setuptools")

MANIFEST_FILES = sorted(str(p.relative_to(ROOT / "manifests")) for p in (ROOT / "manifests").rglob("*.yaml"))


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory):
    """A copy of the checkout's source (no .venv, build outputs or plugin libraries), where
    setuptools may write its build/ and egg-info without touching the checkout."""
    dst = tmp_path_factory.mktemp("src") / "ex_engine_src"
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.so", ".hypothesis",
        ".pytest_cache", ".whl", ".gpu", "gpu_out", "*.png"))
    return dst


def _setup(cwd: Path, *args) -> None:
    r = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", *args],
                       cwd=cwd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.fixture(scope="module")
def built_package(source_copy, tmp_path_factory):
    """What the wheel installs into site-packages: setuptools' build_py output (bdist_wheel
    copies this folder as it is)."""
    out = tmp_path_factory.mktemp("site-packages")
    _setup(source_copy, "-q", "build_py", "--build-lib", str(out))
    return out


def test_the_wheel_carries_every_manifest_profile_tuning_file_and_the_model_list(built_package):
    got = sorted(str(p.relative_to(built_package / "ex_engine" / "manifests"))
                 for p in (built_package / "ex_engine" / "manifests").rglob("*.yaml"))
    assert got == MANIFEST_FILES
    assert "moe_models.yaml" in got and "hardware/h200.yaml" in got and "tuning/h200.yaml" in got
    assert not (built_package / "manifests").exists()     # nothing at the top of site-packages


def _installed(built_package: Path, cwd: Path, *code_or_args, module=False):
    env = {k: v for k, v in os.environ.items() if not k.startswith("EX_ENGINE_") or k == "EX_ENGINE_CACHE"}
    env["PYTHONPATH"] = os.pathsep.join([str(built_package)] + [
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT])
    cmd = [sys.executable, "-m", "ex_engine", *code_or_args] if module else [sys.executable, "-c", *code_or_args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_an_installed_wheel_finds_its_own_manifests_and_names_the_missing_plugin_folder(built_package, tmp_path):
    """Run from another folder with the built package on PYTHONPATH (as site-packages is):
    the profiles, tuning and model list come from the package; a folder of plugins given
    explicitly loads; no folder given is one clear error (exit status 2, no traceback) that
    says to name the plugins' folder."""
    r = _installed(built_package, tmp_path, "import ex_engine, ex_engine._paths as p; "
                   "print(ex_engine.__file__); print(p.manifests_dir())")
    assert r.returncode == 0, r.stderr
    file, manifests = r.stdout.split()
    assert Path(file).is_relative_to(built_package), file     # the built copy, not the checkout
    assert Path(manifests) == built_package / "ex_engine" / "manifests"
    r = _installed(built_package, tmp_path, "hardware", "--profile", "h100", module=True)
    assert r.returncode == 0 and "profile h100" in r.stdout, r.stderr
    r = _installed(built_package, tmp_path, "from ex_engine.moe_layer import load_models; "
                   "print(sorted(load_models()))")
    assert r.returncode == 0 and "qwen3-30b-a3b" in r.stdout, r.stderr
    empty = tmp_path / "plugins"
    empty.mkdir()
    r = _installed(built_package, tmp_path, "list-factors", "--dir", str(empty), "--hardware", "h200", module=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr    # nothing ready: 1, as in a checkout
    assert f"tuning: {built_package / 'ex_engine' / 'manifests' / 'tuning' / 'h200.yaml'}" in r.stdout
    r = _installed(built_package, tmp_path, "import numpy as np; from ex_engine import FactorRegistry, "
                   f"topk_softmax; reg = FactorRegistry.load({str(empty)!r}); "
                   "w, ids = topk_softmax(np.ones((2, 8), np.float32), top_k=2, registry=reg); "
                   "print(ids.shape, reg.stats()['topk_softmax']['python_fallback'])")
    assert r.returncode == 0 and r.stdout.split() == ["(2,", "2)", "1"], r.stderr
    for args in (["list-factors"], ["run", "moe", "--tokens", "1"], ["lock"]):
        r = _installed(built_package, tmp_path, *args, module=True)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr)
        assert "no factors/ beside the package" in r.stderr and "EX_ENGINE_FACTORS=<checkout>/factors" in r.stderr
        assert "--dir" in r.stderr and "EX_ENGINE_MANIFESTS" not in r.stderr, (args, r.stderr)
    r = _installed(built_package, tmp_path, "build", module=True)
    assert r.returncode == 2 and "no Makefile beside the package" in r.stderr, r.stderr


def test_the_rule_in_process_a_wheel_layout_without_the_checkout(tmp_path, monkeypatch):
    """The same rule without a build: ROOT without manifests/, the package's copy present."""
    from ex_engine import FactorRegistry, _paths
    from ex_engine.errors import FactorError
    from ex_engine.hardware import Hardware
    monkeypatch.setattr(_paths, "ROOT", tmp_path / "site-packages")
    monkeypatch.setattr(_paths, "PACKAGE_MANIFESTS", ROOT / "manifests")
    monkeypatch.delenv("EX_ENGINE_MANIFESTS", raising=False)
    monkeypatch.delenv("EX_ENGINE_FACTORS", raising=False)
    assert _paths.manifests_dir() == ROOT / "manifests"
    assert Hardware.from_profile("h200").multiprocessor_count == 132
    with pytest.raises(FactorError, match=r"no factors/ beside the package.*--dir.*EX_ENGINE_FACTORS"):
        FactorRegistry.load(hardware="h200")
    # a copy of the package alone (no manifests anywhere) keeps its own words
    monkeypatch.setattr(_paths, "PACKAGE_MANIFESTS", tmp_path / "none")
    assert "EX_ENGINE_MANIFESTS=<checkout>/manifests" in _paths.not_a_checkout()


def test_the_sdist_holds_what_make_builds_the_factors_from_and_the_tests(source_copy, tmp_path):
    (source_copy / "factors" / "built.so").write_bytes(b"\x7fELF")        # built, not source
    (source_copy / "factors" / "ex_engine.lock").write_text("{}\n")
    _setup(source_copy, "-q", "sdist", "--dist-dir", str(tmp_path))
    (sdist,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    tracked = ["Makefile", "include/ex_engine.h", "tests/conftest.py", "tests/reference.py",
               "tests/plugins/host_scale.c", "docs/factor-contract.md", "scripts/test.sh"]
    tracked += [str(p.relative_to(ROOT)) for ext in ("cu", "cuh") for p in (ROOT / "factors").glob(f"*.{ext}")]
    tracked += [f"manifests/{m}" for m in MANIFEST_FILES]
    missing = [t for t in tracked if t not in names]
    assert not missing, missing
    assert not [n for n in names if n.endswith((".so", ".pyc", ".lock"))]
    # one version: the metadata's is ex_engine.__version__ (pyproject reads it, no second copy)
    import ex_engine
    assert sdist.name == f"ex_engine-{ex_engine.__version__}.tar.gz"
    with tarfile.open(sdist) as tar:
        info = tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("/PKG-INFO"))).read().decode()
    assert f"\nVersion: {ex_engine.__version__}\n" in info
    assert 'version = "' not in (ROOT / "pyproject.toml").read_text(encoding="utf-8")


def test_build_outputs_are_ignored_by_git():
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    r = subprocess.run(["git", "check-ignore", "-q", "dist/ex_engine-0.1.0-py3-none-any.whl"], cwd=ROOT)
    assert r.returncode == 0, "dist/ (python -m build's output) is not in .gitignore"

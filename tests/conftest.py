"""Shared test helpers: building small plugins with gcc, GPU detection, references."""
from __future__ import annotations

import os
import shutil
import subprocess
import weakref
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_SRC = ROOT / "tests" / "plugins" / "host_scale.c"


def child_env(*extra) -> dict:
    """os.environ for a child Python that imports this checkout: PYTHONPATH = ROOT, then
    ``extra`` folders, then what PYTHONPATH held (where cffi may have been installed: on the lent
    GPU machines it travels as wheels into a folder on PYTHONPATH, and a child that lost it
    could not import ex_engine)."""
    parts = [str(ROOT), *map(str, extra)] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(parts))


# The documented defaults for the whole run, children included: the suite tests this checkout's
# plugins as shipped, but variables left in the shell changed what it tested. EX_ENGINE_FACTORS /
# EX_ENGINE_MANIFESTS (README: a pip-installed copy's setting) redirected every default load, and
# a folder that is not there failed collection of test_gpu.py, test_gpu_ep.py and
# test_trial_fixes_32.py; a plugin's EX_* variable (README's table, e.g.
# EX_MOE_SM90_MIN_ROWS_PER_EXPERT) changed the plugins (test_hopper_moe_plugin_workspace). Dropped
# before collection (module-level code reads them); a test that means to set one uses
# monkeypatch, as the GPU tests of the variables do.
_saved_env: dict = {}


def pytest_configure(config):
    # Hypothesis's example database and constants cache in the checkout's .hypothesis/ (git
    # ignores it), wherever pytest runs: its default, <cwd>/.hypothesis, put it in the folder
    # a run started from (`cd /tmp && pytest <checkout>/tests`: /tmp/.hypothesis)
    if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        try:
            from hypothesis.configuration import set_hypothesis_home_dir
        except ImportError:
            pass
        else:
            set_hypothesis_home_dir(ROOT / ".hypothesis")
    # read before the loop below drops every EX_* variable (a plugin's), this one included
    _no_memory_pool(os.environ.get("EX_TEST_NO_MEMORY_POOL") == "1", os.environ.get("EX_TEST_MEMORY_LOG"))
    from ex_engine._paths import plugin_env
    for var in ("EX_ENGINE_FACTORS", "EX_ENGINE_MANIFESTS", *(k for k, _ in plugin_env())):
        if var in os.environ:
            _saved_env[var] = os.environ.pop(var)


# the registries made while EX_TEST_NO_MEMORY_POOL=1 (none otherwise): their workspaces are
# released after each test
_registries: "weakref.WeakSet" = weakref.WeakSet()
# with the pool off and EX_TEST_MEMORY_LOG set: the file each test's line (its id, the device
# memory free after it) is appended to, so that a run that ends in "out of memory" tells a leak
# (free memory falling test after test) from one test too large for the tool
_memory_log: list = []


def _no_memory_pool(on: bool, memory_log: str | None = None) -> None:
    """Under compute-sanitizer (scripts/gpu_sanitize.py, EX_TEST_NO_MEMORY_POOL=1): every CuPy
    array its own cudaMalloc, so a write past one is an access outside any allocation, not into
    a pooled neighbour's bytes; and every registry made from now on noted, so that
    _workspaces_released_after_each_test makes each test's first workspace a new allocation of
    the size that call asked for (a registry keeps and grows one, so a later test's overrun
    would land in a larger, older buffer). Said on stdout (pytest -q prints no report header),
    which the script checks."""
    if not on:
        return
    try:
        import cupy
    except ImportError:
        return
    cupy.cuda.set_allocator(None)
    cupy.cuda.set_pinned_memory_allocator(None)
    from ex_engine.registry import FactorRegistry
    init = FactorRegistry.__init__

    def noted_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _registries.add(self)

    FactorRegistry.__init__ = noted_init
    if memory_log:
        _memory_log.append(memory_log)
    print("ex_engine tests: CuPy memory pool off (EX_TEST_NO_MEMORY_POOL=1)", flush=True)


@pytest.fixture(autouse=True)
def _workspaces_released_after_each_test(request):
    yield
    for r in list(_registries):
        try:
            r.release_workspaces()
        except Exception:   # noqa: BLE001 - a device flag the test left (its own check reports it)
            pass
    if _memory_log:
        _note_free_memory(_memory_log[0], request.node.nodeid)


def _note_free_memory(path: str, test: str) -> None:
    """Append '<test> free <MiB> of <MiB> MiB' (cudaMemGetInfo after the test) to ``path``."""
    import cupy
    try:
        free, total = cupy.cuda.runtime.memGetInfo()
        line = f"{test} free {free >> 20} of {total >> 20} MiB\n"
    except Exception as exc:   # noqa: BLE001 - a device left unusable: said in the line
        line = f"{test} free unknown ({type(exc).__name__}: {exc})\n"
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line)


def pytest_report_header(config):
    # said, not silent: a variable set on purpose (a mode to try) does not reach this run
    if _saved_env:
        return [f"ex_engine: the suite runs on the documented defaults; not passed to it: "
                f"{', '.join(f'{k}={v}' for k, v in sorted(_saved_env.items()))}"]
    return []


def pytest_unconfigure(config):
    os.environ.update(_saved_env)
    _saved_env.clear()


@pytest.fixture(autouse=True, scope="session")
def _private_verify_cache(tmp_path_factory):
    """The whole run's verify cache (EX_ENGINE_CACHE) in a temporary folder, children included:
    a test that loads with verify=True and sets no cache of its own wrote the user's
    ~/.cache/ex_engine/verified.json (test_loader's manifest cross-reference test did). A test
    that sets its own (monkeypatch.setenv) still gets it."""
    old = os.environ.get("EX_ENGINE_CACHE")
    os.environ["EX_ENGINE_CACHE"] = str(tmp_path_factory.mktemp("ex_engine_cache"))
    yield
    if old is None:
        os.environ.pop("EX_ENGINE_CACHE", None)
    else:
        os.environ["EX_ENGINE_CACHE"] = old


def have_gpu() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if have_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def build_plugin(folder: Path, stem: str = "host_scale", defines: dict | None = None,
                 manifest: bool = True, src: Path = PLUGIN_SRC, link: list | None = None) -> Path:
    """Compile tests/plugins/host_scale.c with gcc into folder/<stem>.so (+ its manifest).

    link: extra gcc arguments after the source (e.g. ["-L/dir", "-lexhelper"])."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc not available")
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{stem}.so"
    flags = []
    for k, v in (defines or {}).items():   # as UTF-8 bytes: a non-ASCII value reaches gcc under an ASCII locale too
        flags.append((f"-D{k}" if v is True else f"-D{k}={v}").encode("utf-8"))
    subprocess.run(["gcc", "-shared", "-fPIC", "-fvisibility=hidden", "-O1", f"-I{ROOT / 'include'}",
                    *flags, "-o", str(out), str(src), *(link or [])], check=True)
    if manifest:
        name = (defines or {}).get("NAME", '"host_scale"').strip('"')
        text = (ROOT / "tests" / "plugins" / "host_scale.yaml").read_text(encoding="utf-8")
        if name != "host_scale":
            text = text.replace("name: host_scale", f"name: {name}")
        fid = (defines or {}).get("FACTOR_ID")
        if fid is not None:
            text = text.replace("id: 1100", f"id: {fid}")
        (folder / f"{name}.yaml").write_text(text, encoding="utf-8")
    return out


def build_helper(folder: Path) -> Path:
    """folder/libexhelper.so exporting ``float helper_alpha(float)`` (identity), for a plugin
    built with ``defines={"HELPER": True}, link=["-L<folder>", "-lexhelper"]``."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc not available")
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "exhelper.c"
    src.write_text("float helper_alpha(float a) { return a; }\n")
    out = folder / "libexhelper.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return out


# tests that load the shipped libraries again for another profile in the same process on purpose: the
# registry's warning that a library is already open for other hardware is expected here
OTHER_PROFILE_LOAD = pytest.mark.filterwarnings(
    "ignore:.*is already open in this process by another registry:UserWarning")

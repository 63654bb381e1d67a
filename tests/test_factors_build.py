"""Every factors/*.cu compiles (nvcc, no GPU needed) and the built plugins pass the registry's
checks against hardware profiles."""
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from ex_engine import FactorRegistry, abi
from ex_engine.hardware import Hardware
from tests.conftest import OTHER_PROFILE_LOAD, ROOT

BUILTIN = {"topk_softmax": 0, "fused_add_rmsnorm": 1, "moe_fused_gemm": 2}
# Hopper-only plugins of a built-in factor (same name, id and version, higher priority): the one
# the registry chooses on the h200 profile
HOPPER = {"moe_fused_gemm": "moe_fused_gemm_sm90"}
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")


@pytest.fixture(scope="module")
def built():
    """Run `make` (a no-op when the .so files are up to date, as after .ci/run's build step)."""
    # PYTHON: the interpreter running the tests finds CUTLASS's headers (pip nvidia-cutlass)
    r = subprocess.run(["make", "-C", str(ROOT), f"PYTHON={sys.executable}"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return ROOT / "factors"


@needs_nvcc
def test_every_factor_source_has_a_plugin(built):
    sources = sorted(p.stem for p in built.glob("*.cu"))
    assert set(BUILTIN) <= set(sources)
    for stem in sources:
        so = built / f"{stem}.so"
        assert so.exists() and so.stat().st_mtime >= (built / f"{stem}.cu").stat().st_mtime
        syms = subprocess.run(["nm", "-D", "--defined-only", str(so)], capture_output=True, text=True).stdout
        assert " ex_get_factor" in syms and " ex_abi_version" in syms, stem


@needs_nvcc
@OTHER_PROFILE_LOAD
@pytest.mark.parametrize("profile", ["h200", "a100"])
def test_builtin_factors_ready_on_profile(built, profile):
    reg = FactorRegistry.load(built, hardware=profile)
    for name, fid in BUILTIN.items():
        p = reg.get(name)
        assert p is not None, [(q.path.name, q.reason) for q in reg.plugins]
        stem = HOPPER.get(name, name) if profile == "h200" else name
        assert p.factor_id == fid and p.status == "ready" and p.path.stem == stem, (p.path, p.reason)
        assert p.tuning["num_warps"] * 32 == p.tuning["threads_per_block"]


@OTHER_PROFILE_LOAD
@needs_nvcc
def test_hopper_moe_plugin_chosen_on_h200_portable_elsewhere(built):
    reg = FactorRegistry.load(built, hardware="h200")
    win = reg.get("moe_fused_gemm")
    portable = next(q for q in reg.plugins if q.path.stem == "moe_fused_gemm")
    assert win.path.stem == "moe_fused_gemm_sm90" and win.priority == 10 and portable.priority == 0
    assert win.version == portable.version and win.factor_id == portable.factor_id == 2
    assert portable.status == "shadowed" and "moe_fused_gemm_sm90.so" in portable.reason
    t = win.tuning  # the CUTLASS kernel: a producer and two consumer warpgroups, one block per SM
    assert t["threads_per_block"] == 384 and t["num_warps"] == 12 and t["num_stages"] >= 3
    assert 0 < t["shared_mem_bytes"] <= reg.hardware.shared_mem_per_block_optin
    reg = FactorRegistry.load(built, hardware="a100")
    sm90 = next(q for q in reg.plugins if q.path.stem == "moe_fused_gemm_sm90")
    # refused: by the registry's check of the embedded code (sm_90a only) or by ex_get_factor
    assert sm90.status == "rejected" and ("returned NULL" in sm90.reason or "no SASS or PTX" in sm90.reason)
    assert reg.get("moe_fused_gemm").path.stem == "moe_fused_gemm"


@needs_nvcc
def test_hopper_moe_plugin_serves_cc_9_0_only(built):
    """ex_get_factor itself (called directly, no registry checks first) declines all but cc 9.0."""
    lib = abi.dlopen(built / "moe_fused_gemm_sm90.so")
    h200 = Hardware.from_profile("h200")
    for major, minor, ok in [(9, 0, True), (8, 0, False), (8, 9, False), (9, 1, False), (10, 0, False),
                             (12, 0, False)]:
        hw = dataclasses.replace(h200, cc_major=major, cc_minor=minor)
        f = lib.ex_get_factor(hw.to_c(abi.ffi))
        assert (f != abi.ffi.NULL) == ok, (major, minor)
    a100 = Hardware.from_profile("a100")
    assert lib.ex_get_factor(a100.to_c(abi.ffi)) == abi.ffi.NULL


@needs_nvcc
def test_hopper_moe_plugin_workspace(built):
    """workspace_size: the portable layout's where the portable path runs (decode), more where the
    CUTLASS path runs (T*K/E >= 64: sorted copies of x and the GEMM intermediates)."""
    reg = FactorRegistry.load(built, hardware="h200")
    win = reg.get("moe_fused_gemm")
    portable = next(q for q in reg.plugins if q.path.stem == "moe_fused_gemm")

    def ws(p, dims):
        arr = abi.ffi.new("int64_t[]", dims)
        return int(p.factor.workspace_size(arr, len(dims)))

    for T, H, E, I, K in [(1, 2048, 128, 768, 8), (64, 2048, 64, 1024, 8), (3, 111, 40, 67, 8)]:
        d = [T, H, E, I, K, 2]
        assert ws(win, d) == ws(portable, d), d                     # portable path only
    for T, H, E, I, K in [(4096, 2048, 128, 768, 8), (4096, 4096, 8, 14336, 2), (1000, 512, 40, 256, 6)]:
        d = [T, H, E, I, K, 2]
        TK = T * K
        need = TK * (max(H, I) + max(2 * I, H)) * 2                 # xs/act and gate_up/ys
        assert ws(win, d) >= max(ws(portable, d), need), d
        assert ws(win, d) < need + ws(portable, d) + (8 << 20), d   # nothing unexpected
    assert ws(win, [0, 2048, 128, 768, 8, 2]) == ws(portable, [0, 2048, 128, 768, 8, 2])


@needs_nvcc
def test_bi_v100_profile_is_refused_with_reasons(built):
    """The seed's target has 64-thread warps and no bf16 tensor cores: no factor may pretend."""
    reg = FactorRegistry.load(built, hardware="bi-v100")
    for name in BUILTIN:
        p = next(q for q in reg.plugins if q.path.stem == name)
        assert p.status == "rejected" and p.reason, name


@needs_nvcc
def test_ptx_and_sm90a_code_are_embedded(built):
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump not installed")
    out = subprocess.run([cuobjdump, "--list-elf", "--list-ptx", str(built / "moe_fused_gemm.so")],
                         capture_output=True, text=True).stdout
    assert "sm_90a" in out and "sm_80" in out and ".ptx" in out


@pytest.fixture(scope="module")
def template_plugin(tmp_path_factory):
    """docs/template/my_op.cu built into a folder no code knows, with its manifest beside it."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed")
    d = tmp_path_factory.mktemp("dropin")
    subprocess.run(["nvcc", "-O2", "-std=c++17", "-gencode=arch=compute_80,code=sm_80",
                    "-gencode=arch=compute_80,code=compute_80", "-Xcompiler", "-fPIC,-fvisibility=hidden",
                    "-shared", f"-I{ROOT / 'include'}", "-o", str(d / "my_op.so"),
                    str(ROOT / "docs" / "template" / "my_op.cu")], check=True)
    shutil.copy(ROOT / "docs" / "template" / "my_op.yaml", d / "my_op.yaml")
    return d


def test_template_factor_drops_in(template_plugin):
    reg = FactorRegistry.load(template_plugin, hardware="h200")
    p = reg.get("my_op")
    assert p is not None and p.status == "ready" and p.factor_id == 1024
    assert p.manifest.path.endswith("my_op.yaml") and str(template_plugin) in p.manifest.path


def _template_manifest_with_fallback(folder, monkeypatch):
    """docs/template/my_op.yaml naming docs/template/my_op_fallback.py's silu, in ``folder``."""
    monkeypatch.syspath_prepend(str(ROOT / "docs" / "template"))
    text = (ROOT / "docs" / "template" / "my_op.yaml").read_text(encoding="utf-8")
    assert "\nfallback: null\n" in text
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "my_op.yaml").write_text(text.replace("\nfallback: null\n", "\nfallback: my_op_fallback:silu\n"), encoding="utf-8")


def test_template_fallback_serves_host_arrays_from_the_manifest_alone(tmp_path, monkeypatch):
    """The template's Python fallback (docs/template/my_op_fallback.py, named in the manifest as
    the docs say) computes silu in every dtype the manifest allows; with the manifest alone, no
    library, a call on NumPy arrays runs it."""
    import numpy as np
    ml_dtypes = pytest.importorskip("ml_dtypes")
    _template_manifest_with_fallback(tmp_path / "m", monkeypatch)
    (tmp_path / "none").mkdir()
    reg = FactorRegistry.load(tmp_path / "none", hardware="h200", manifests_dir=tmp_path / "m")
    tol = reg.manifest("my_op").tolerance
    x64 = np.random.default_rng(0).standard_normal(1001)
    for dt, name in ((np.float32, "float32"), (np.float16, "float16"), (ml_dtypes.bfloat16, "bfloat16")):
        x = x64.astype(dt)
        out = np.full_like(x, np.nan)
        assert reg.dispatch("my_op", {"x": x, "out": out}) == "python_fallback"
        xf = x.astype(np.float64)
        ref = xf / (1 + np.exp(-xf))
        err = np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref)
        assert err < tol[name], (name, err)


def test_template_factor_with_its_fallback_loads_ready(template_plugin, tmp_path, monkeypatch):
    shutil.copy(template_plugin / "my_op.so", tmp_path / "my_op.so")
    _template_manifest_with_fallback(tmp_path, monkeypatch)
    reg = FactorRegistry.load(tmp_path, hardware="h200")
    p = reg.get("my_op")
    assert p is not None and p.status == "ready", [(q.path.name, q.reason) for q in reg.plugins]
    assert any(c.name == "python fallback" and c.ok for c in p.checks), [c.__dict__ for c in p.checks]


@pytest.mark.gpu
def test_template_factor_dispatches_on_gpu(template_plugin):
    import cupy as cp
    reg = FactorRegistry.load(template_plugin)
    x = cp.random.standard_normal(1000003, dtype=cp.float32)
    out = cp.full_like(x, cp.nan)
    assert reg.dispatch("my_op", {"x": x, "out": out}) == "plugin"
    ref = x.astype(cp.float64) / (1 + cp.exp(-x.astype(cp.float64)))
    assert float(cp.linalg.norm(out - ref) / cp.linalg.norm(ref)) < 1e-6


# what a plugin says of an on/off switch set to neither 0 nor 1 (explugin::env_switch)
SWITCH_SAYS = "ignored: expected 0 (off) or 1 (on); using 1 (on, the default)"


@needs_nvcc
@pytest.mark.parametrize("var,value,says", [
    ("EX_MOE_ROUTE_MULTIBLOCK_SLOTS", "abc", "ignored: expected a decimal integer >= 0; using 2048"),
    ("EX_MOE_SM90_MIN_ROWS_PER_EXPERT", "-1", "ignored: expected a decimal integer >= 0; using 64"),
    ("EX_MOE_SM90_TILE64_MAX_ROWS", "1e3", "ignored: expected a decimal integer >= 0; using 0"),
    ("EX_MOE_SM90_CLUSTER_M2_ROWS", "x", "ignored: expected a decimal integer >= 0; using 1024"),
    ("EX_MOE_SM90_MIN_ROWS_PER_EXPERT", "99999999999999999999",    # beyond a long long: was
     "ignored: expected a decimal integer >= 0; using 64"),          # taken as LLONG_MAX
    ("EX_MOE_SM90_SWIZZLE", "3", "ignored: expected 1, 2, 4 or 8; using 1"),
    # a new user's trial: taken as on, silently (read as a count, not a switch)
    ("EX_MOE_SM90_RASTER_N", "2", "ignored: expected 0 or 1; using 0"),
    # strtoll takes leading blanks and a sign; the trailing blank was refused, these passed
    ("EX_MOE_SM90_TILE64_MAX_ROWS", " 12", "ignored: expected a decimal integer >= 0; using 0"),
    ("EX_MOE_SM90_MIN_ROWS_PER_EXPERT", "+12", "ignored: expected a decimal integer >= 0; using 64"),
    ("EX_MOE_SM90_SILU_IN_GEMM1", "off", SWITCH_SAYS),
    ("EX_MOE_SM90_GEMM2_PINGPONG", "no", SWITCH_SAYS),
    ("EX_MOE_SM90_GATHER_BY_TOKEN", "yes", SWITCH_SAYS),
    ("EX_MOE_SM90_SKIP_EMPTY_A", "no", SWITCH_SAYS),
    ("EX_MOE_SM90_CHUNKED_MULTICAST", "off", SWITCH_SAYS),
    ("EX_MOE_SM90_CHUNKED_SWAP_AB", "false", SWITCH_SAYS),
    ("EX_MOE_SM90_CHUNKED_INTERLEAVE", "2", SWITCH_SAYS),
    ("EX_MOE_SM90_PDL", "garbage", SWITCH_SAYS),
])
def test_a_malformed_switch_is_reported_when_the_plugins_load(built, var, value, says):
    """The moe plugins read these switches in ex_get_factor (host code: a hardware profile is
    enough); a value they cannot use is named on stderr, the default kept, the plugin still loads."""
    code = ("from ex_engine import FactorRegistry; from ex_engine.hardware import Hardware; "
            "r = FactorRegistry.load(hardware=Hardware.from_profile('h200')); "
            "print(r.get('moe_fused_gemm').path.name)")
    env = {**__import__("os").environ, var: value}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "moe_fused_gemm_sm90.so"
    text = f"{var}='{value}' {says}" if "ignored" in says else f"{var}='{value}': {says}"
    # each plugin that reads the variable says so once, under its own file name (the two moe
    # plugins both read EX_MOE_ROUTE_MULTIBLOCK_SLOTS: two lines that looked the same)
    lines = [ln for ln in p.stderr.splitlines() if text in ln]
    assert lines, p.stderr[-2000:]
    assert all(re.match(r"\[ex_engine\] (moe_fused_gemm|moe_fused_gemm_sm90)\.so: ", ln) for ln in lines), lines
    assert len(set(lines)) == len(lines), lines


def _project_copy(tmp_path):
    """The Makefile and include/ in a folder of their own, with an empty factors/ (the tests
    do not write into the checkout's factors/)."""
    (tmp_path / "factors").mkdir()
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    shutil.copytree(ROOT / "include", tmp_path / "include")
    return tmp_path


@pytest.mark.parametrize("ext,compiler", [("c", "cc"), ("cpp", "c++")])
def test_a_host_factor_builds_with_make_and_loads_ready(tmp_path, ext, compiler):
    """A host factor (manifest memory: host) could not be built with the project's make: nvcc
    embeds a .nv_fatbin even without kernels, and the registry refuses GPU code in a host
    factor's library. factors/<name>.c and .cpp are built with the host compiler, no nvcc."""
    import numpy as np
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} not installed")
    proj = _project_copy(tmp_path)
    shutil.copy(ROOT / "tests" / "plugins" / "host_scale.c", proj / "factors" / f"host_scale.{ext}")
    shutil.copy(ROOT / "tests" / "plugins" / "host_scale.yaml", proj / "factors" / "host_scale.yaml")
    # NVCC names no program: the host rule must not need it (`make` builds every factor: here one)
    r = subprocess.run(["make", "-C", str(proj), "NVCC=/nonexistent/nvcc"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "host factor: no GPU code" in r.stdout and "built factors/host_scale.so" in r.stdout, r.stdout
    reg = FactorRegistry.load(proj / "factors", hardware="h200")
    p = reg.get("host_scale")
    assert p is not None and p.status == "ready", [(q.path.name, q.status, q.reason) for q in reg.plugins]
    assert p.manifest.memory == "host"
    x, out = np.arange(7, dtype=np.float32), np.zeros(7, np.float32)
    assert reg.dispatch("host_scale", {"x": x, "alpha": np.array([3.0], np.float32), "out": out}) == "plugin"
    assert (out == 3 * x).all()
    r = subprocess.run(["make", "-s", "list"], cwd=proj, capture_output=True, text=True)
    assert r.stdout.split() == ["factors/host_scale.so"]


def test_two_sources_of_one_factor_name_are_refused(tmp_path):
    """factors/x.cu beside factors/x.c: make would build one and ignore the other."""
    proj = _project_copy(tmp_path)
    shutil.copy(ROOT / "tests" / "plugins" / "host_scale.c", proj / "factors" / "host_scale.c")
    (proj / "factors" / "host_scale.cu").write_text("// another source of the same name\n")
    r = subprocess.run(["make", "-C", str(proj), "factors/host_scale.so"], capture_output=True, text=True)
    assert r.returncode != 0
    assert "more than one source for host_scale" in r.stderr, r.stderr
    assert not (proj / "factors" / "host_scale.so").exists()


def test_a_build_with_other_flags_is_rebuilt_by_the_next_plain_make(tmp_path):
    """`ex-engine build --archs=sm_80 x` then `ex-engine build x`: the second kept the sm_80-only
    library (file dates alone), which the registry then refused on the H200. The flags of the
    last build are kept per library in build/flags/<name>.so.txt, its rule's prerequisite."""
    if shutil.which("cc") is None:
        pytest.skip("cc not installed")
    proj = _project_copy(tmp_path)
    shutil.copy(ROOT / "tests" / "plugins" / "host_scale.c", proj / "factors" / "host_scale.c")

    def make(*args):
        r = subprocess.run(["make", "-C", str(proj), "NVCC=/nonexistent/nvcc", *args],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return "built factors/host_scale.so" in r.stdout

    assert make()
    assert not make()                                   # nothing changed: nothing rebuilt
    assert make("HOST_CFLAGS=-O1 -Wall")                # other flags: rebuilt
    assert not make("HOST_CFLAGS=-O1 -Wall")
    assert make()                                       # back to the defaults: rebuilt again
    assert "-O2 -Wall" in (proj / "build" / "flags" / "host_scale.so.txt").read_text(encoding="utf-8")


def test_each_library_is_rebuilt_only_for_a_change_of_its_own_rule_s_flags(tmp_path):
    """A stamp of every flag rebuilt the CUTLASS plugin for HOST_CFLAGS or ARCHS, neither of
    which its rule uses; and `make clean all` without build/ stopped on the missing stamp
    folder. (nvcc faked: it writes the -o file; CUTLASS_INC a folder with cutlass/cutlass.h.)"""
    if shutil.which("cc") is None:
        pytest.skip("cc not installed")
    (tmp_path / "p").mkdir()
    proj = _project_copy(tmp_path / "p")
    nvcc = tmp_path / "nvcc"
    nvcc.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n')
    nvcc.chmod(0o755)
    (tmp_path / "inc" / "cutlass").mkdir(parents=True)
    (tmp_path / "inc" / "cutlass" / "cutlass.h").write_text("")
    shutil.copy(ROOT / "tests" / "plugins" / "host_scale.c", proj / "factors" / "a.c")
    for name in ("g.cu", "g_sm90.cu"):
        (proj / "factors" / name).write_text("// a GPU factor\n")

    def make(*args):
        r = subprocess.run(["make", "-C", str(proj), f"NVCC={nvcc}", f"CUTLASS_INC={tmp_path / 'inc'}", *args],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return {n for n in ("a", "g", "g_sm90") if f"built factors/{n}.so" in r.stdout}

    assert make() == {"a", "g", "g_sm90"}
    assert make("HOST_CFLAGS=-O1 -Wall") == {"a"}
    assert make("HOST_CFLAGS=-O1 -Wall", "ARCHS=-gencode=arch=compute_80,code=sm_80") == {"g"}
    assert make("HOST_CFLAGS=-O1 -Wall", "SM90_NVCCFLAGS=-O2") == {"g", "g_sm90"}
    # a dry run lists what other flags would rebuild, and leaves the stamps as they were
    other = ("HOST_CFLAGS=-O2 -Wall", "SM90_NVCCFLAGS=-O2", "ARCHS=-gencode=arch=compute_80,code=sm_80")
    assert make("-n", *other) == {"a", "g"}
    assert make("-n", *other) == {"a", "g"}
    assert make(*other) == {"a", "g"}
    shutil.rmtree(proj / "build")
    assert make("clean", "all") == {"a", "g", "g_sm90"}
    assert make() == set()
    # clean among the goals: a library it builds with other flags is rebuilt by a plain make
    # (its stamp had been left as it was)
    assert make("clean", "all", "ARCHS=-gencode=arch=compute_90a,code=sm_90a") == {"a", "g", "g_sm90"}
    assert make() == {"g"}
    # a build that fails, and make -q, write no stamp: the next plain make rebuilds nothing
    r = subprocess.run(["make", "-C", str(proj), "NVCC=/nonexistent/nvcc", "factors/g.so"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "nvcc not found" in r.stderr, r.stderr
    subprocess.run(["make", "-C", str(proj), f"NVCC={nvcc}", "-q", "HOST_CFLAGS=-O3"], capture_output=True)
    assert make() == set()


def test_a_build_of_one_library_with_other_flags_rebuilds_only_that_one(tmp_path):
    """`ex-engine build --archs=... my_op`, then `make`: one stamp for every library made the
    plain build recompile all of them (the CUTLASS plugin's minutes included), though only
    my_op had been built with other flags."""
    if shutil.which("cc") is None:
        pytest.skip("cc not installed")
    proj = _project_copy(tmp_path)
    for name in ("host_a", "host_b"):
        shutil.copy(ROOT / "tests" / "plugins" / "host_scale.c", proj / "factors" / f"{name}.c")

    def make(*args):
        r = subprocess.run(["make", "-C", str(proj), "NVCC=/nonexistent/nvcc", *args],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return {n for n in ("host_a", "host_b") if f"built factors/{n}.so" in r.stdout}

    assert make() == {"host_a", "host_b"}
    assert make("HOST_CFLAGS=-O1 -Wall", "factors/host_a.so") == {"host_a"}
    assert make() == {"host_a"}                         # host_b was built with these flags
    assert make() == set()
    assert make("HOST_CFLAGS=-O1 -Wall", "all") == {"host_a", "host_b"}   # `all` named: every one


@pytest.mark.parametrize("archs, named", [
    ("-gencode=arch=compute_70,code=sm_70", "compute_70 sm_70"),
    ("-gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_75,code=sm_75", "compute_75 sm_75"),
])
def test_targets_older_than_sm80_are_refused_before_nvcc(tmp_path, archs, named):
    """ARCHS naming a target older than sm_80 stopped inside nvcc ("Unsupported gpu
    architecture", or an error deep in a kernel); the Makefile now names those targets itself
    and runs no nvcc. sm_80 and later (sm_90a, sm_100, sm_120) pass. (nvcc faked: it logs its
    calls and writes the -o file.)"""
    (tmp_path / "p").mkdir()
    proj = _project_copy(tmp_path / "p")
    log = tmp_path / "nvcc.log"
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(f'#!/bin/sh\necho "$@" >> {log}\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n', encoding="utf-8")
    nvcc.chmod(0o755)
    (proj / "factors" / "g.cu").write_text("// a GPU factor\n")

    def make(a):
        return subprocess.run(["make", "-C", str(proj), f"NVCC={nvcc}", f"ARCHS={a}", "factors/g.so"],
                              capture_output=True, text=True)
    r = make(archs)
    assert r.returncode != 0
    assert f"ARCHS names targets older than sm_80 ({named})" in r.stderr, r.stderr[-2000:]
    assert not log.exists()
    ok = "-gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_100,code=sm_100 -gencode=arch=compute_120,code=sm_120"
    r = make(ok)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "built factors/g.so" in r.stdout and log.exists()


def test_a_gpu_library_is_rebuilt_for_its_own_headers_only(tmp_path):
    """Every factors/*.so depended on every factors/*.cuh: an edit of the Hopper plugin's header
    rebuilt topk_softmax.so (minutes). nvcc now lists each library's headers (-MMD, in
    build/deps/<name>.so.d) and a library is rebuilt for those; one without that list yet
    depends on every header, as before. (nvcc faked: it writes the -o file and, given -MF, a
    dependency file naming the headers its source lists on a '// headers:' line, with -MP's
    empty rule for each.)"""
    (tmp_path / "p").mkdir()
    proj = _project_copy(tmp_path / "p")
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("""#!/bin/sh
out=; mf=; mt=; mp=; src=
while [ $# -gt 0 ]; do
  case "$1" in -o) out=$2; shift;; -MF) mf=$2; shift;; -MT) mt=$2; shift;; -MP) mp=1;; *.cu) src=$1;; esac; shift
done
: > "$out"
if [ -n "$mf" ] && ! grep -q nodeps "$src"; then
  hdrs=$(sed -n 's|^// headers: ||p' "$src")
  echo "$mt : $src $hdrs" > "$mf"
  if [ -n "$mp" ]; then for h in $hdrs; do printf '\n%s:\n' "$h" >> "$mf"; done; fi
fi
""")
    nvcc.chmod(0o755)
    f = proj / "factors"
    (f / "a.cuh").write_text("// a\n")
    (f / "b.cuh").write_text("// b\n")
    (f / "g.cu").write_text("// headers: factors/a.cuh\n")
    (f / "h.cu").write_text("// headers: factors/b.cuh\n")
    (f / "k.cu").write_text("// nodeps: nvcc writes no list for it\n")

    def make(*args):
        r = subprocess.run(["make", "-C", str(proj), f"NVCC={nvcc}", *args], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return {n for n in ("g", "h", "k") if f"built factors/{n}.so" in r.stdout}

    def touch(name):   # the header newer than every library, whatever the clock's grain
        now = time.time()
        for p in [*f.iterdir(), *(proj / "include").iterdir()]:   # sources 20 s old, libraries 10 s
            t = now - (10 if p.suffix == ".so" else 20)
            os.utime(p, (t, t))
        os.utime(f / name, (now, now))

    assert make() == {"g", "h", "k"}
    assert (proj / "build" / "deps" / "g.so.d").is_file()
    assert make() == set()
    touch("b.cuh")
    assert make() == {"h", "k"}            # g's list does not name b.cuh; k has no list
    touch("a.cuh")
    assert make() == {"g", "k"}
    (f / "b.cuh").unlink()                 # a header gone from the tree: -MP keeps make going
    (f / "h.cu").write_text("// headers: factors/a.cuh\n")
    assert make() == {"h"}

"""Every factors/*.cu compiles (nvcc, no GPU needed) and the built plugins pass the registry's
checks against hardware profiles."""
import shutil
import subprocess

import pytest

from ex_engine import FactorRegistry
from tests.conftest import ROOT

BUILTIN = {"topk_softmax": 0, "fused_add_rmsnorm": 1, "moe_fused_gemm": 2}
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")


@pytest.fixture(scope="module")
def built():
    """Run `make` (a no-op when the .so files are up to date, as after .ci/run's build step)."""
    r = subprocess.run(["make", "-C", str(ROOT)], capture_output=True, text=True)
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
@pytest.mark.parametrize("profile", ["h200", "a100"])
def test_builtin_factors_ready_on_profile(built, profile):
    reg = FactorRegistry.load(built, hardware=profile)
    for name, fid in BUILTIN.items():
        p = reg.get(name)
        assert p is not None, [(q.path.name, q.reason) for q in reg.plugins]
        assert p.factor_id == fid and p.status == "ready" and p.path.stem == name
        assert p.tuning["num_warps"] * 32 == p.tuning["threads_per_block"]


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


@pytest.mark.gpu
def test_template_factor_dispatches_on_gpu(template_plugin):
    import cupy as cp
    reg = FactorRegistry.load(template_plugin)
    x = cp.random.standard_normal(1000003, dtype=cp.float32)
    out = cp.full_like(x, cp.nan)
    assert reg.dispatch("my_op", {"x": x, "out": out}) == "plugin"
    ref = x.astype(cp.float64) / (1 + cp.exp(-x.astype(cp.float64)))
    assert float(cp.linalg.norm(out - ref) / cp.linalg.norm(ref)) < 1e-6

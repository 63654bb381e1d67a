"""Every tile configuration of moe_fused_gemm, forced, on awkward shapes, on both plugins.

The tuning file may give any shape any configuration (dims[7]), so each must be right wherever
it lands, not only on the shapes the tuner chose it for. Each configuration is forced through
``set_tuning`` (as the tuner times them) and checked against the float64 reference with a
NaN-poisoned output (run_moe_check: every element written, none NaN), then the device status
word is read (no flag set). The portable plugin (moe_fused_gemm.so) runs its own configurations
(tiny, decode, mid, prefill, mid32, mid48, decode4); the Hopper plugin (moe_fused_gemm_sm90.so)
runs those (its portable code) and its Hopper tilings (grouped, grouped64, narrow, chunked,
chunked_nomc, chunked_tail). A configuration that does not take a shape runs what the plugin
documents for it (the chunked ones: the 128-row tiling where the GEMM1 is ungated or H % 128
!= 0; see factors/moe_fused_gemm.cu's header).

These small shapes are also what scripts/gpu_sanitize.py runs under compute-sanitizer (each
configuration's accesses checked for bounds, shared-memory races, barrier misuse and
uninitialised reads, as far as each tool sees them: that script's docstring says where not).

The forced cases are marked `gpu`: skipped where CuPy or a GPU is missing; a plugin not built or
not ready on this GPU skips its cases. The check of the configuration list runs everywhere.
"""
import re

import pytest

from ex_engine._scripts import CONFIGS
from tests.test_gpu import kind_case, registry_preferring, run_moe_check

PORTABLE = {n: v for n, v in CONFIGS.items() if n in ("tiny", "decode", "mid", "prefill", "mid32", "mid48", "decode4")}
HOPPER = {n: v for n, v in CONFIGS.items() if n not in PORTABLE}
CASES = [("moe_fused_gemm.so", n) for n in PORTABLE] + [("moe_fused_gemm_sm90.so", n) for n in CONFIGS]

# (T, H, E, I, K): each small enough for the sanitizer's pace; kind_case's routings ("one expert":
# every slot on expert 3; "empty experts": experts 4-7 and 32-63 never chosen, T = 2048;
# "repeated ids": rows that give one expert several slots)
SHAPES = {"T=1": (1, 1024, 64, 512, 8), "T=3 E=40": (3, 256, 40, 128, 8), "E=40": (1000, 512, 40, 256, 6),
          "E=40 fp16": (300, 512, 40, 256, 6), "one expert": (600, 512, 16, 384, 1),
          "empty experts": (2048, 256, 64, 128, 4), "H=200": (700, 200, 16, 256, 4),
          "I=1408": (300, 256, 8, 1408, 2), "ungated I=200": (500, 512, 8, 200, 2),
          "repeated ids": (400, 512, 40, 256, 8)}
# (a case's id spells its kind with "_" for "=" and " ": "T_3_E_40", "one_expert", for pytest -k)


def test_the_configurations_are_the_tuners():
    """Every value the tuning file may hold (ex_engine/_scripts.py's CONFIGS, which tune_moe.py
    and the tuning loader use) is forced below, on the plugin that runs it."""
    assert set(PORTABLE) | set(HOPPER) == set(CONFIGS)
    assert sorted(CONFIGS.values()) == list(range(13))
    assert len(PORTABLE) == 7 and {"tiny", "decode4"} <= set(PORTABLE)


@pytest.fixture(scope="module")
def regs():
    """library file name -> a registry preferring it (loaded once), or the pytest.skip message."""
    out = {}
    for lib in ("moe_fused_gemm.so", "moe_fused_gemm_sm90.so"):
        try:
            out[lib] = registry_preferring(lib)
        except pytest.skip.Exception as exc:
            out[lib] = str(exc)
    yield out
    for r in out.values():
        if not isinstance(r, str):
            r.set_tuning("moe_fused_gemm", None)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(SHAPES), ids=lambda k: re.sub(r"\W", "_", k))
@pytest.mark.parametrize("library,config", CASES, ids=[f"{lib.split('.')[0]}-{n}" for lib, n in CASES])
def test_moe_every_config_on_awkward_shapes(regs, library, config, kind, cp):
    r = regs[library]
    if isinstance(r, str):
        pytest.skip(r)
    value = CONFIGS[config]
    r.set_tuning("moe_fused_gemm", lambda sizes: value)
    case, dtype = kind_case(cp, SHAPES, kind)
    run_moe_check(r, cp, case, dtype)
    r.check_device_errors()


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy

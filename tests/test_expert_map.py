"""moe_fused_gemm's optional expert_map (expert parallelism): global topk ids, local experts.

CPU tests run the Python fallback (NumPy) in CI; the `gpu` ones run every plugin path on CuPy
(portable decode tiles, the Hopper grouped GEMM at prefill sizes, the scalar kernel_fallback)
against a float64 reference of the same math.
"""
import math

import numpy as np
import pytest

from ex_engine import DeviceSideError, FactorRegistry, moe_fused_gemm
from ex_engine.arrays import Bits16, TensorRef, f32_to_bf16_bits
from ex_engine.errors import ShapeError
from ex_engine.fallbacks import apply_expert_map, moe_fused_gemm_math
from tests.conftest import ROOT
from tests.reference import rel_err


def _case(xp, T, H, G, I, K, dtype, seed=0):
    """Inputs of a layer with G global experts: x, w13 (G,2I,H), w2 (G,H,I), w, global ids."""
    rng = xp.random.default_rng(seed)

    def cast(v):
        return Bits16(f32_to_bf16_bits(xp, v)) if dtype == "bfloat16" else v.astype(dtype)
    x = cast(rng.standard_normal((T, H), dtype=xp.float32))
    w13 = cast(rng.standard_normal((G, 2 * I, H), dtype=xp.float32) / xp.float32(math.sqrt(H)))
    w2 = cast(rng.standard_normal((G, H, I), dtype=xp.float32) / xp.float32(math.sqrt(I)))
    ids = xp.argsort(rng.standard_normal((T, G), dtype=xp.float32), axis=1)[:, :K].astype(xp.int32)
    w = (rng.random((T, K), dtype=xp.float32) + xp.float32(0.1)).astype(xp.float32)
    return x, w13, w2, w, ids


def _local(xp, a, experts):
    """Rows `experts` of a (G, ...) weight, as a new contiguous array (Bits16 kept)."""
    if isinstance(a, Bits16):
        return Bits16(xp.ascontiguousarray(a.bits[experts]), a.dtype)
    return xp.ascontiguousarray(a[experts])


def _rank_map(xp, G, experts):
    emap = np.full(G, -1, np.int32)
    emap[np.asarray(experts)] = np.arange(len(experts), dtype=np.int32)
    return xp.asarray(emap)


def _reference(xp, x, w13, w2, w, ids, emap, E):
    """float64 out of the local experts only (slots mapped to -1 contribute nothing)."""
    local, _, _ = apply_expert_map(xp, ids, emap, E)
    r13, r2 = TensorRef.of(w13), TensorRef.of(w2)
    f = lambda r, e: TensorRef.of(Bits16(r.raw()[e]) if r.dtype == "bfloat16" else r.raw()[e]).load_f32()
    out, _ = moe_fused_gemm_math(xp, TensorRef.of(x).load_f32().astype(xp.float64),
                                 lambda e: f(r13, e), lambda e: f(r2, e), w.astype(xp.float64),
                                 local, E, None, accum=xp.float64)
    return out


def _rel(xp, out, ref):
    return rel_err(TensorRef.of(out).load_f32().astype(xp.float64), ref, xp)


def _poison(xp, like):
    T, H = TensorRef.of(like).shape
    if isinstance(like, Bits16):
        return Bits16(xp.full((T, H), 0x7fc0, xp.uint16), "bfloat16")
    return xp.full((T, H), xp.nan, like.dtype)


def _check_split(xp, reg, T, H, G, I, K, dtype, n_ranks, want_paths, tol):
    """Each simulated rank's output equals its reference; their sum equals the full layer."""
    x, w13, w2, w, ids = _case(xp, T, H, G, I, K, dtype, seed=T + G)
    parts = np.array_split(np.arange(G), n_ranks)
    total = None
    for experts in parts:
        emap = _rank_map(xp, G, experts)
        out = _poison(xp, x)
        moe_fused_gemm(x, _local(xp, w13, experts), _local(xp, w2, experts), w, ids,
                       expert_map=emap, out=out, registry=reg)
        assert reg.last_path["moe_fused_gemm"] in want_paths, reg.last_path
        ref = _reference(xp, x, _local(xp, w13, experts), _local(xp, w2, experts), w, ids, emap,
                         len(experts))
        if float(xp.linalg.norm(ref)) > 0:
            assert _rel(xp, out, ref) < tol
        o = TensorRef.of(out).load_f32().astype(xp.float64)
        total = o if total is None else total + o
    full = _reference(xp, x, w13, w2, w, ids, None, G)
    assert float(xp.linalg.norm(total - full) / xp.linalg.norm(full)) < tol
    reg.check_device_errors()


# ------------------------------------------------------------------------------ CPU (fallback)
@pytest.fixture(scope="module")
def cpu_reg(tmp_path_factory):
    return FactorRegistry.load(tmp_path_factory.mktemp("none"), hardware="h200")


@pytest.mark.parametrize("n_ranks", [1, 2, 3])
def test_ranks_sum_to_the_full_layer_on_the_fallback(cpu_reg, n_ranks):
    _check_split(np, cpu_reg, 13, 24, 8, 16, 2, "float16", n_ranks, ("python_fallback",), 5e-3)


def test_top_k_may_exceed_the_local_experts(cpu_reg):
    """Mixtral on 8 ranks: one local expert, K = 2 <= G = 8."""
    _check_split(np, cpu_reg, 9, 16, 8, 8, 2, "float16", 8, ("python_fallback",), 5e-3)


def test_global_experts_differ_from_local_without_a_map_is_refused(cpu_reg):
    x, w13, w2, w, ids = _case(np, 4, 16, 6, 8, 2, "float16")
    logits = np.zeros((4, 6), np.float32)
    with pytest.raises(ShapeError, match=r"'router_logits'.*G=3 from w13, as E: expert_map not given"):
        moe_fused_gemm(x, w13[:3], w2[:3], w, ids, router_logits=logits, registry=cpu_reg)
    with pytest.raises(ShapeError, match=r"expected 5 \(G=5 from expert_map\), got 6"):   # map of the wrong length
        moe_fused_gemm(x, w13, w2, w, ids, router_logits=logits,
                       expert_map=np.arange(5, dtype=np.int32), registry=cpu_reg)
    with pytest.raises(ShapeError, match="K <= G"):
        moe_fused_gemm(x, w13[:1], w2[:1], w, ids, expert_map=np.zeros(1, np.int32), registry=cpu_reg)


def test_bad_map_values_and_ids_are_skipped_and_reported(cpu_reg):
    x, w13, w2, w, ids = _case(np, 6, 16, 4, 8, 2, "float16")
    emap = np.array([0, -1, 7, 1], np.int32)           # 7: not a local expert (E = 2)
    ids[0, 0] = 9                                      # outside [0, G)
    ids[1] = [2, 3]                                    # expert 2 maps to 7: at least one such slot
    cpu_reg.check_device_errors()
    out = moe_fused_gemm(x, w13[:2], w2[:2], w, ids, expert_map=emap, registry=cpu_reg)
    ref = _reference(np, x, w13[:2], w2[:2], w, ids, emap, 2)
    assert _rel(np, out, ref) < 5e-3 if float(np.linalg.norm(ref)) > 0 else True
    # both flags (an alternation let invalid_topk_ids alone satisfy it: a fallback that stopped
    # flagging bad map values passed, test_mutation_gaps_36)
    with pytest.raises(DeviceSideError, match=r"(?s)(?=.*invalid_expert_map)(?=.*invalid_topk_ids)"):
        cpu_reg.check_device_errors()


def test_apply_expert_map_semantics():
    ids = np.array([[0, 3], [5, -1], [2, 1]], np.int32)
    emap = np.array([1, -1, 0, 4], np.int32)           # E = 2: value 4 is bad
    local, n_ids, n_map = apply_expert_map(np, ids, emap, 2)
    assert local.tolist() == [[1, -1], [-1, -1], [0, -1]] and (n_ids, n_map) == (2, 1)
    local, n_ids, n_map = apply_expert_map(np, ids, None, 4)
    assert local.tolist() == [[0, 3], [-1, -1], [2, 1]] and (n_ids, n_map) == (2, 0)


# ------------------------------------------------------------------------------ GPU (plugins)
@pytest.fixture(scope="module")
def gpu():
    import cupy
    reg = FactorRegistry.load(ROOT / "factors")
    assert reg.hardware.live
    return cupy, reg


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("T,H,G,I,K,n_ranks", [
    (1, 2048, 128, 768, 8, 2),      # qwen3-30b decode: tiny tiles
    (64, 4096, 8, 14336, 2, 2),     # mixtral T=64
    (64, 4096, 8, 14336, 2, 8),     # mixtral over 8 ranks: one local expert, K > E
    (1000, 512, 40, 256, 6, 3),     # E = 40 over 3 ranks (14/13/13)
    (4096, 2048, 128, 768, 8, 2),   # qwen3-30b prefill: Hopper grouped GEMM where present
])
def test_plugin_ranks_sum_to_the_full_layer(gpu, T, H, G, I, K, n_ranks, dtype):
    cp, reg = gpu
    tol = reg.manifest("moe_fused_gemm").tolerance[dtype]
    _check_split(cp, reg, T, H, G, I, K, dtype, n_ranks, ("plugin",), tol)


@pytest.mark.gpu
def test_kernel_fallback_honours_the_map(gpu):
    cp, reg = gpu
    _check_split(cp, reg, 37, 111, 10, 67, 3, "bfloat16", 2, ("kernel_fallback",), 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [5, 4096])
def test_plugin_reports_bad_map_values(gpu, T):
    cp, reg = gpu
    x, w13, w2, w, ids = _case(cp, T, 2048, 8, 768, 2, "bfloat16")
    emap = cp.asarray(np.array([0, 1, 2, 3, -1, -1, 9, -1], np.int32))   # 9: outside [-1, 4)
    ids[:, 0] = 6
    reg.check_device_errors()
    out = _poison(cp, x)
    moe_fused_gemm(x, _local(cp, w13, [0, 1, 2, 3]), _local(cp, w2, [0, 1, 2, 3]), w, ids,
                   expert_map=emap, out=out, registry=reg)
    ref = _reference(cp, x, _local(cp, w13, [0, 1, 2, 3]), _local(cp, w2, [0, 1, 2, 3]), w, ids, emap, 4)
    assert _rel(cp, out, ref) < 1e-2
    with pytest.raises(DeviceSideError, match="expert_map value outside"):
        reg.check_device_errors()

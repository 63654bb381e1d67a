"""Expert parallelism on GPUs: simulated ranks on one GPU (each with its expert map and its slice
of the weights, through the moe_fused_gemm plugin) sum to the full factor; two real ranks on one
GPU over gloo (CUDA tensors: forward's first-call check of the group, its all-reduce, and the
refusal of ranks built wrong, where only one GPU is lent); with >= 2 GPUs, the real thing
(torchrun + NCCL, examples/ep_moe.py --check and a short --bench).

Marked `gpu`: skipped where CuPy or a GPU is missing; the torch cases also need torch, the
torchrun cases at least 2 GPUs. Outputs are poisoned (NaN) before every call.
"""
import json
import math
import os
import subprocess
import sys

import pytest

from ex_engine import moe_fused_gemm
from ex_engine.arrays import Bits16, TensorRef, f32_to_bf16_bits
from ex_engine.distributed import ExpertParallelMoE, expert_owner, expert_partition, make_expert_map
from ex_engine.fallbacks import moe_fused_gemm_math
from tests.conftest import ROOT
from tests.ranks import run_ranks
from tests.reference import rel_err

pytestmark = pytest.mark.gpu

# (H, I, E, K): Qwen3-30B-A3B's routed experts as they are; Mixtral-8x7B's with I / 4
SHAPES = {"qwen3": (2048, 768, 128, 8), "mixtral-ish": (4096, 3584, 8, 2)}


from tests.test_gpu import cp, reg  # noqa: E402,F401  (the GPU tests' fixtures: CuPy, the built factors)


def gpu_count() -> int:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def f64(a):
    return TensorRef.of(a).load_f32().astype("float64")


def rel(cp, out64, ref64) -> float:
    return rel_err(out64, ref64, cp)   # the whole array's relative error, or the worst row's


def cupy_case(cp, T, H, I, E, K, seed):
    """bf16 (Bits16) x (T,H), w13 (E,2I,H), w2 (E,H,I); fp32 weights (T,K); distinct int32 ids."""
    rs = cp.random.RandomState(seed)
    bf = lambda v: Bits16(f32_to_bf16_bits(cp, v))                      # noqa: E731
    x = bf(rs.standard_normal((T, H), dtype=cp.float32))
    w13 = bf(rs.standard_normal((E, 2 * I, H), dtype=cp.float32) / math.sqrt(H))
    w2 = bf(rs.standard_normal((E, H, I), dtype=cp.float32) / math.sqrt(I))
    ids = cp.argsort(rs.standard_normal((T, E), dtype=cp.float32), axis=1)[:, :K].astype(cp.int32)
    w = rs.uniform(0.1, 1.0, (T, K)).astype(cp.float32)
    return x, w13, w2, (w / w.sum(1, keepdims=True)).astype(cp.float32), ids


def float64_reference(cp, x, w13, w2, w, ids):
    E = TensorRef.of(w13).shape[0]
    b13, b2 = TensorRef.of(w13).raw(), TensorRef.of(w2).raw()
    conv = lambda bits: TensorRef.of(Bits16(bits)).load_f32()           # noqa: E731
    out, _ = moe_fused_gemm_math(cp, f64(x), lambda e: conv(b13[e]), lambda e: conv(b2[e]),
                                 w.astype(cp.float64), ids, E, None, accum=cp.float64)
    return out


def poisoned(cp, T, H):
    return Bits16(cp.full((T, H), 0x7FC0, cp.uint16))                    # bf16 NaN


# ------------------------------------------------------------------------------ one GPU, simulated ranks
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("T", [1, 64, 1000])
@pytest.mark.parametrize("N", [2, 3])
def test_simulated_ranks_sum_to_the_full_factor_cupy(reg, cp, shape, T, N):
    H, I, E, K = SHAPES[shape]
    x, w13, w2, w, ids = cupy_case(cp, T, H, I, E, K, seed=T * 10 + N)
    full = poisoned(cp, T, H)
    moe_fused_gemm(x, w13, w2, w, ids, out=full, registry=reg)
    assert reg.last_path["moe_fused_gemm"] == "plugin"
    owner = cp.asarray(expert_owner(E, N))
    total = cp.zeros((T, H), cp.float64)
    for r in range(N):
        layer = ExpertParallelMoE.from_global(w13, w2, rank=r, world_size=N, registry=reg)
        assert (layer.first, layer.count) == expert_partition(E, N, r)
        assert layer.expert_map.dtype == cp.int32 and layer.expert_map.get().tolist() == \
            make_expert_map(E, N, r).tolist()
        out = poisoned(cp, T, H)
        layer.forward_local(x, w, ids, out=out)
        assert reg.last_path["moe_fused_gemm"] == "plugin", "the expert map must not push the call off the plugin"
        o = f64(out)
        assert not bool(cp.isnan(o).any()), f"rank {r}: out not fully written"
        idle = ~(owner[ids] == r).any(axis=1)                            # no local expert: exact zeros
        assert bool((o[idle] == 0).all())
        total += o
    reg.check_device_errors()
    tol = reg.manifest("moe_fused_gemm").tolerance["bfloat16"]
    assert rel(cp, total, f64(full)) < tol
    assert rel(cp, total, float64_reference(cp, x, w13, w2, w, ids)) < tol


def test_rank_without_experts_on_gpu(reg, cp):
    x, w13, w2, w, ids = cupy_case(cp, 16, 256, 64, 2, 2, seed=1)
    layer = ExpertParallelMoE.from_global(w13, w2, rank=2, world_size=3, registry=reg)
    assert layer.count == 0
    out = layer.forward_local(x, w, ids, out=poisoned(cp, 16, 256))
    assert bool((out.bits == 0).all())


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def torch_case(torch, T, H, I, E, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, generator=g, device="cuda").to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, H, generator=g, device="cuda") / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g, device="cuda") / I ** 0.5).to(torch.bfloat16)
    ids = torch.rand(T, E, generator=g, device="cuda").argsort(dim=1)[:, :K].to(torch.int32).contiguous()
    w = torch.rand(T, K, generator=g, device="cuda") + 0.1
    return x, w13, w2, (w / w.sum(1, keepdim=True)).contiguous(), ids


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("T", [1, 64, 1000])
@pytest.mark.parametrize("N", [2, 3])
def test_simulated_ranks_sum_to_the_full_factor_torch(reg, torch, shape, T, N):
    H, I, E, K = SHAPES[shape]
    x, w13, w2, w, ids = torch_case(torch, T, H, I, E, K, seed=T + N)
    full = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    moe_fused_gemm(x, w13, w2, w, ids, out=full, registry=reg)
    total = torch.zeros(T, H, dtype=torch.float64, device="cuda")
    for r in range(N):
        layer = ExpertParallelMoE.from_global(w13, w2, rank=r, world_size=N, registry=reg)
        assert isinstance(layer.expert_map, torch.Tensor) and layer.expert_map.device == x.device
        assert layer.w13.is_contiguous() and layer.w13.data_ptr() != w13.data_ptr()
        out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda")
        got = layer.forward_local(x, w, ids, out=out)
        assert got is out and reg.last_path["moe_fused_gemm"] == "plugin"
        assert not bool(torch.isnan(out).any())
        total += out.double()
    reg.check_device_errors()
    err = rel_err(total, full.double(), torch)   # the whole array, and its worst row
    assert err < reg.manifest("moe_fused_gemm").tolerance["bfloat16"], err


def test_forward_local_in_a_torch_cuda_graph(reg, torch):
    """forward_local of a simulated rank (its expert map) captured in a torch CUDA graph replays
    to the eager result, bit for bit; new routing written into the captured inputs is used."""
    H, I, E, K = SHAPES["qwen3"]
    x, w13, w2, w, ids = torch_case(torch, 64, H, I, E, K, seed=5)
    layer = ExpertParallelMoE.from_global(w13, w2, rank=1, world_size=3, registry=reg)
    eager = layer.forward_local(x, w, ids)
    out = torch.full_like(x, float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer.forward_local(x, w, ids, out=out)                       # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        layer.forward_local(x, w, ids, out=out)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
    x2, _, _, w_2, ids2 = torch_case(torch, 64, H, I, E, K, seed=6)
    x.copy_(x2), w.copy_(w_2), ids.copy_(ids2)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), layer.forward_local(x, w, ids).view(torch.int16))


# ------------------------------------------------------------------------------ >= 2 GPUs: torchrun + NCCL
def torchrun(args, nproc=2, timeout=1200):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "TORCHELASTIC"))}
    env["NCCL_NVLS_ENABLE"] = "0"
    env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "examples" / "ep_moe.py"), *args]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout + r.stderr


needs_2_gpus = pytest.mark.skipif(gpu_count() < 2, reason="needs >= 2 GPUs")


@needs_2_gpus
def test_torchrun_two_gpus_check(torch):
    rc, text = torchrun(["--check", "--tokens", "64", "4096"])
    print(text)
    assert rc == 0, text[-6000:]
    assert "PASS" in text and "FAIL" not in text, text[-6000:]
    assert text.count(": PASS") == 4, text[-6000:]          # 2 models x 2 token counts


@needs_2_gpus
def test_torchrun_two_gpus_bench_smoke(torch, tmp_path):
    path = tmp_path / "ep.json"
    rc, text = torchrun(["--bench", "--models", "qwen3-30b-a3b", "--tokens", "64", "--replays", "5",
                         "--json", str(path)])
    print(text)
    assert rc == 0, text[-6000:]
    res = json.loads(path.read_text(encoding="utf-8"))
    (case,) = res["bench"]
    assert case["world_size"] == 2 and case["timing"] in ("graph", "eager")
    assert case["total_us"] > 0 and case["allreduce_us"] > 0 and case["world1_us"] > 0
    assert case["allreduce_bytes"] == 64 * 2048 * 2
    assert sum(case["slots_per_rank"]) == 64 * 8


# ------------------------------------------------------------------------------ one GPU, two real ranks (gloo)
def test_two_gloo_ranks_on_one_gpu(torch):
    """forward over a real process group on CUDA tensors: the first call's check (its ten integers
    all-reduced from the GPU and read back), the sum of the ranks' plugin outputs equal to the full
    factor, and a rank built for another rank refused on both ranks (neither left waiting)."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is unavailable")
    run_ranks(__file__, "gloo_one_gpu", timeout=300.0, gpu=True)


def _rank_gloo_one_gpu() -> None:
    """One rank of test_two_gloo_ranks_on_one_gpu (run as a script)."""
    import torch
    from ex_engine import FactorRegistry
    from ex_engine.distributed import init_from_env, shutdown
    from ex_engine.errors import FactorError
    info = init_from_env(backend="gloo")                 # a CPU process group: binds no GPU
    torch.cuda.set_device(0)
    reg = FactorRegistry.load(ROOT / "factors")
    H, I, E, K = SHAPES["qwen3"]
    x, w13, w2, w, ids = torch_case(torch, 64, H, I, E, K, seed=41)   # the same on every rank
    full = torch.full((64, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    moe_fused_gemm(x, w13, w2, w, ids, out=full, registry=reg)
    tol = reg.manifest("moe_fused_gemm").tolerance["bfloat16"]
    layer = ExpertParallelMoE.from_global(w13, w2, registry=reg)
    assert (layer.rank, layer.world_size) == (info.rank, info.world_size) == (info.rank, 2)
    for _ in range(2):                                   # the first call checks; the second does not
        out = torch.full((64, H), float("nan"), dtype=torch.bfloat16, device="cuda")
        got = layer(x, w, ids, out=out)
        assert got is out and reg.last_path["moe_fused_gemm"] == "plugin"
        assert not bool(torch.isnan(out).any())
        err = rel_err(out.double(), full.double(), torch)
        assert err < tol, err
    wrong = ExpertParallelMoE.from_global(w13, w2, rank=0, world_size=2, registry=reg)
    try:
        wrong(x, w, ids)
    except FactorError as e:
        want = ("built for rank 0 of 2, the process group is rank 1 of 2" if info.rank
                else "another rank's layer was built for a rank or world size other than its own")
        assert want in str(e), str(e)
    else:
        raise AssertionError("a rank built for rank 0 on both ranks was not refused")
    reg.check_device_errors()
    shutdown()
    print("OK gloo_one_gpu", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] != ["gloo_one_gpu"]:
        sys.exit("usage: python tests/test_gpu_ep.py gloo_one_gpu   (one rank; run by test_two_gloo_ranks_on_one_gpu)")
    _rank_gloo_one_gpu()

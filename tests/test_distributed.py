"""Expert parallelism on the CPU (no torch needed): the partition and expert-map math, and the
sum over simulated ranks of the expert-parallel outputs (NumPy, Python fallback of
moe_fused_gemm with an expert map) against the full layer."""
import os
import subprocess
import sys
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from ex_engine import (ArgumentError, DTypeError, FactorError, FactorRegistry, LayoutError, ShapeError,
                       moe_fused_gemm)
from ex_engine.distributed import (ExpertParallelMoE, expert_owner, expert_partition,
                                   make_expert_map)
from tests.conftest import ROOT
from tests.reference import moe_ref, random_routing, rel_err

NP = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


@pytest.fixture(scope="module")
def reg(tmp_path_factory):
    """A registry with no plugins: every call takes the Python fallback."""
    return FactorRegistry.load(tmp_path_factory.mktemp("empty"), hardware="h200")


# ------------------------------------------------------------------------------ partition / map
@pytest.mark.parametrize("E", [8, 60, 128, 2, 1])
@pytest.mark.parametrize("N", [1, 2, 3, 8])
def test_partition_owns_every_expert_once(E, N):
    parts = [expert_partition(E, N, r) for r in range(N)]
    owned = np.zeros(E, int)
    nxt = 0
    for r, (first, count) in enumerate(parts):
        assert first == nxt, "contiguous blocks in rank order"
        assert count == E // N + (1 if r < E % N else 0), "the first E % N ranks get one more"
        owned[first:first + count] += 1
        nxt = first + count
    assert nxt == E and (owned == 1).all()
    assert max(c for _, c in parts) - min(c for _, c in parts) <= 1
    owner = expert_owner(E, N)
    assert owner.dtype == np.int32 and owner.shape == (E,)
    for r, (first, count) in enumerate(parts):
        assert (owner[first:first + count] == r).all()


@pytest.mark.parametrize("E", [8, 60, 128, 2])
@pytest.mark.parametrize("N", [1, 2, 3, 8])
def test_expert_maps_are_consistent(E, N):
    maps = np.stack([make_expert_map(E, N, r) for r in range(N)])
    assert maps.dtype == np.int32 and maps.shape == (N, E) and maps[0].flags.c_contiguous
    assert ((maps >= -1)).all()
    assert ((maps >= 0).sum(axis=0) == 1).all(), "each global expert is local on exactly one rank"
    owner = expert_owner(E, N)
    for r in range(N):
        first, count = expert_partition(E, N, r)
        m = maps[r]
        assert (m[first:first + count] == np.arange(count)).all()
        assert (np.delete(m, np.arange(first, first + count)) == -1).all()
        assert ((m >= 0) == (owner == r)).all()
        assert m.max(initial=-1) < count, "values in [-1, E_local)"
    if N == 1:
        assert (maps[0] == np.arange(E)).all()


def test_partition_examples():
    assert [expert_partition(60, 8, r) for r in range(8)] == \
        [(0, 8), (8, 8), (16, 8), (24, 8), (32, 7), (39, 7), (46, 7), (53, 7)]
    assert [expert_partition(8, 3, r) for r in range(3)] == [(0, 3), (3, 3), (6, 2)]
    assert expert_partition(2, 3, 2) == (2, 0)
    assert make_expert_map(2, 3, 2).tolist() == [-1, -1]


@pytest.mark.parametrize("args,argument", [((0, 2, 0), "num_experts"), ((8, 0, 0), "world_size"),
                                           ((8, 2, 2), "rank"), ((8, 2, -1), "rank"),
                                           ((8.0, 2, 0), "num_experts"), ((8, 2, True), "rank")])
def test_partition_errors_name_the_argument(args, argument):
    with pytest.raises(ArgumentError, match=f"argument '{argument}'"):
        expert_partition(*args)
    with pytest.raises(ArgumentError, match=f"argument '{argument}'"):
        make_expert_map(*args)


def test_import_does_not_need_torch():
    code = "import sys, ex_engine.distributed; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------------------ the math, plain
@pytest.mark.parametrize("E,K,N", [(8, 2, 3), (60, 4, 8), (5, 2, 8)])
def test_ranks_sum_to_the_full_layer_float64(E, K, N):
    """The identity the scheme rests on, on the float64 reference with no factor involved:
    remapping ids through each rank's map (-1: skipped) and summing over ranks gives the layer."""
    rng = np.random.default_rng(E * 100 + N)
    T, H, I = 13, 24, 10
    x = rng.standard_normal((T, H))
    w13 = rng.standard_normal((E, 2 * I, H)) / H ** 0.5
    w2 = rng.standard_normal((E, H, I)) / I ** 0.5
    w, ids = random_routing(rng, T, E, K)
    full = moe_ref(x, w13, w2, w, ids)
    total = np.zeros_like(full)
    for r in range(N):
        first, count = expert_partition(E, N, r)
        local_ids = make_expert_map(E, N, r)[ids]
        total += moe_ref(x, w13[first:first + count], w2[first:first + count], w, local_ids)
    np.testing.assert_allclose(total, full, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------ through the fallback
def _layer(rng, T, H, I, E, K, dtype):
    npdt = NP[dtype]
    x = rng.standard_normal((T, H)).astype(npdt)
    w13 = (rng.standard_normal((E, 2 * I, H)) / H ** 0.5).astype(npdt)
    w2 = (rng.standard_normal((E, H, I)) / I ** 0.5).astype(npdt)
    w, ids = random_routing(rng, T, E, K)
    return x, w13, w2, w, ids


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("E,K", [(8, 2), (60, 4), (128, 8)])
@pytest.mark.parametrize("N", [1, 2, 3, 8])
def test_simulated_ranks_sum_to_the_full_factor(reg, dtype, E, K, N):
    rng = np.random.default_rng(E + 1000 * N)
    T, H, I = 19, 64, 32
    x, w13, w2, w, ids = _layer(rng, T, H, I, E, K, dtype)
    full = moe_fused_gemm(x, w13, w2, w, ids, registry=reg).astype(np.float64)
    ref = moe_ref(x, w13, w2, w, ids)
    total = np.zeros((T, H))
    owner = expert_owner(E, N)
    for r in range(N):
        layer = ExpertParallelMoE.from_global(w13, w2, rank=r, world_size=N, registry=reg)
        assert (layer.first, layer.count) == expert_partition(E, N, r)
        out = np.full((T, H), np.nan, NP[dtype])                 # poisoned: fully written
        got = layer.forward_local(x, w, ids, out=out)
        assert got is out and not np.isnan(out.astype(np.float32)).any()
        # a token none of whose experts live here gets exact zeros
        idle = ~(owner[ids] == r).any(axis=1)
        assert (out[idle].astype(np.float32) == 0).all()
        # ... and it is what the factor gives with this rank's map and weights, called directly
        if layer.count:
            direct = moe_fused_gemm(x, layer.w13, layer.w2, w, ids, registry=reg,
                                    expert_map=make_expert_map(E, N, r))
            assert direct.astype(np.float32).tobytes() == out.astype(np.float32).tobytes()
        total += out.astype(np.float64)
    tol = reg.manifest("moe_fused_gemm").tolerance[dtype]
    assert rel_err(total, full) < tol
    assert rel_err(total, ref) < tol
    if N == 1:   # one rank: the factor itself
        assert rel_err(total, full) == 0.0


def test_forward_with_one_rank_is_the_factor(reg):
    rng = np.random.default_rng(7)
    x, w13, w2, w, ids = _layer(rng, 5, 32, 16, 8, 2, "bfloat16")
    layer = ExpertParallelMoE.from_global(w13, w2, rank=0, world_size=1, registry=reg)
    assert layer.count == 8 and layer.expert_map.tolist() == list(range(8))
    out = layer(x, w, ids)
    full = moe_fused_gemm(x, w13, w2, w, ids, registry=reg)
    assert out.tobytes() == full.tobytes()


def test_rank_without_experts_writes_zeros(reg):
    rng = np.random.default_rng(3)
    x, w13, w2, w, ids = _layer(rng, 4, 32, 16, 2, 2, "bfloat16")
    layer = ExpertParallelMoE.from_global(w13, w2, rank=2, world_size=3, registry=reg)
    assert layer.count == 0 and layer.w13.shape == (0, 32, 32)
    out = layer.forward_local(x, w, ids, out=np.full((4, 32), np.nan, ml_dtypes.bfloat16))
    assert (out.astype(np.float32) == 0).all()
    # nothing to launch there, but the same argument checks as on the ranks with experts
    with pytest.raises(ShapeError, match="'out'"):
        layer.forward_local(x, w, ids, out=np.zeros((3, 3), ml_dtypes.bfloat16))
    with pytest.raises(DTypeError, match="'topk_ids'"):
        layer.forward_local(x, w, ids.astype(np.int64))
    with pytest.raises(DTypeError, match="'topk_weights'"):
        layer.forward_local(x, w.astype(np.float64), ids)
    # out=hidden_states: refused before any write, as on the ranks with experts (it zeroed x)
    before = x.copy()
    with pytest.raises(LayoutError, match="argument 'out': memory: .*overlaps 'hidden_states'"):
        layer.forward_local(x, w, ids, out=x)
    assert x.tobytes() == before.tobytes()
    ro = np.full((4, 32), np.nan, ml_dtypes.bfloat16)
    ro.flags.writeable = False
    with pytest.raises(LayoutError, match="argument 'out': writable"):
        layer.forward_local(x, w, ids, out=ro)


def test_from_global_copies_or_views(reg):
    rng = np.random.default_rng(4)
    _, w13, w2, _, _ = _layer(rng, 1, 32, 16, 8, 2, "bfloat16")
    a = ExpertParallelMoE.from_global(w13, w2, rank=1, world_size=3, registry=reg)
    b = ExpertParallelMoE.from_global(w13, w2, rank=1, world_size=3, registry=reg, copy=False)
    assert (a.first, a.count) == (3, 3)
    assert not np.shares_memory(a.w13, w13) and np.shares_memory(b.w13, w13)
    assert a.w13.tobytes() == w13[3:6].tobytes() and a.w2.tobytes() == w2[3:6].tobytes()
    assert a.w13.flags.c_contiguous and b.w13.flags.c_contiguous


def test_layer_errors_name_the_argument(reg):
    rng = np.random.default_rng(5)
    x, w13, w2, w, ids = _layer(rng, 3, 32, 16, 8, 2, "bfloat16")
    with pytest.raises(ShapeError, match=r"argument 'w13': experts of rank 1 of 2 .*expected w13.shape\[0\] == 4, got 3"):
        ExpertParallelMoE(w13[:3], w2[:3], 8, rank=1, world_size=2)
    with pytest.raises(ShapeError, match=r"argument 'w2': shape"):
        ExpertParallelMoE(w13[:4], w2[:4, :, :8], 8, rank=1, world_size=2)
    with pytest.raises(ArgumentError, match=r"argument 'rank'"):
        ExpertParallelMoE.from_global(w13, w2, rank=2, world_size=2)
    with pytest.raises(ArgumentError, match=r"argument 'w2': same dtype as w13"):
        ExpertParallelMoE(w13[:4], w2[:4].astype(np.float16), 8, rank=0, world_size=2)
    layer = ExpertParallelMoE.from_global(w13, w2, rank=0, world_size=2, registry=reg)
    with pytest.raises(ShapeError, match=r"argument 'hidden_states': shape: expected \(T, 32\)"):
        layer.forward_local(x[:, :16], w, ids)
    with pytest.raises(FactorError, match=r"needs torch tensors"):
        layer.forward(x, w, ids)       # world_size 2 on NumPy: no collective possible


# ------------------------------------------------------------------------------ real ranks (CPU)
@pytest.mark.parametrize("nproc,E", [(2, 8), (3, 8), (3, 2)])
def test_forward_all_reduce_over_gloo(nproc, E):
    """init_from_env + ExpertParallelMoE.forward in real processes (torchrun, gloo, torch CPU
    tensors through the Python fallback): every rank ends with the full layer. Needs torch
    (skipped in CI, which does not install it)."""
    pytest.importorskip("torch.distributed.run")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                      "MASTER_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    # CPU ranks: gloo binds no GPU; hiding the GPUs of a GPU host also keeps each rank's registry
    # from opening GPU plugins that CPU tensors never use (this test is about gloo on the CPU)
    env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={nproc}", str(ROOT / "tests" / "ep_gloo_worker.py"),
                        str(E), "13", "32", "16", "2"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-4000:]
    assert text.count("PASS") == nproc and "FAIL" not in text, text[-4000:]


def test_from_global_needs_rank_and_world_size_together(reg):
    rng = np.random.default_rng(5)
    _, w13, w2, _, _ = _layer(rng, 2, 32, 16, 4, 2, "bfloat16")
    with pytest.raises(ArgumentError, match="'world_size'.*both rank and world_size"):
        ExpertParallelMoE.from_global(w13, w2, rank=1, registry=reg)
    with pytest.raises(ArgumentError, match="'rank'"):
        ExpertParallelMoE.from_global(w13, w2, world_size=2, registry=reg)
    # and so does the constructor (world_size alone once became rank 0 quietly)
    with pytest.raises(ArgumentError, match="ExpertParallelMoE: argument 'rank': given with world_size"):
        ExpertParallelMoE(w13[:2], w2[:2], 4, world_size=2, registry=reg)
    with pytest.raises(ArgumentError, match="ExpertParallelMoE: argument 'world_size': given with rank"):
        ExpertParallelMoE(w13[:2], w2[:2], 4, rank=1, registry=reg)


def test_init_from_env_names_a_bad_world_size(monkeypatch):
    pytest.importorskip("torch")
    from ex_engine.distributed import init_from_env
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "0")
    with pytest.raises(ArgumentError, match="'WORLD_SIZE'"):
        init_from_env(backend="gloo")


class _Bound(list):
    """The devices init_from_env bound (set_device calls), with .inits: its init_process_group calls."""


def _fake_torch(monkeypatch, gpus=1, group=None):
    """init_from_env's torch, faked: ``gpus`` CUDA devices (set_device calls recorded in the
    returned list), a process group (rank, world_size) already initialised or none."""
    import ex_engine.distributed as d
    bound = _Bound()
    fake_torch = SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: gpus > 0,
                                                      device_count=lambda: gpus, set_device=bound.append))
    inits = []
    fake_dist = SimpleNamespace(is_available=lambda: True, is_initialized=lambda: group is not None,
                                get_rank=lambda: group[0] if group else inits[-1][1]["rank"],
                                get_world_size=lambda: group[1] if group else inits[-1][1]["world_size"],
                                init_process_group=lambda backend, **kw: inits.append((backend, kw)))
    fake_torch.device = lambda kind, index: f"{kind}:{index}"
    bound.inits = inits
    monkeypatch.setattr(d, "_import_torch_distributed", lambda fn: (fake_torch, fake_dist))
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")                # init_from_env sets these two
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)
    return bound


@pytest.mark.parametrize("present,missing", [("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")])
def test_init_from_env_refuses_half_of_torchruns_environment(monkeypatch, present, missing):
    """One of RANK and WORLD_SIZE without the other was taken as a one-process job (rank 0 of 1):
    every process kept every expert and skipped the all-reduce. A process group that already
    exists is used as it is, whatever the variables say (torch faked, no GPU)."""
    from ex_engine.distributed import init_from_env
    _fake_torch(monkeypatch, gpus=0)
    monkeypatch.setenv(present, "1")
    with pytest.raises(ArgumentError, match=rf"argument '{missing}': .*set together with {present}"):
        init_from_env(backend="gloo")
    _fake_torch(monkeypatch, gpus=0, group=(1, 2))
    monkeypatch.setenv(present, "1")
    assert tuple(init_from_env(backend="gloo")) == (1, 2, 0)


@pytest.mark.parametrize("backend,binds", [("gloo", False), ("GLOO", False), ("nccl", True),
                                           ("cpu:gloo,cuda:nccl", True)])
def test_init_from_env_binds_a_gpu_unless_the_backend_is_gloo_alone(monkeypatch, backend, binds):
    """gloo is a CPU process group: on a host with one GPU a rank with LOCAL_RANK 1 (more CPU
    ranks than GPUs, `ep_moe.py --device cpu`) ran into 'expected 0 <= LOCAL_RANK < 1'. A backend
    with nccl in it still binds the GPU and refuses a LOCAL_RANK with none (torch faked: one GPU,
    no process group)."""
    from ex_engine.distributed import init_from_env
    bound = _fake_torch(monkeypatch, gpus=1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    if binds:
        with pytest.raises(ArgumentError, match=r"argument 'LOCAL_RANK': .*0 <= LOCAL_RANK < 1, got 1"):
            init_from_env(backend=backend)
    else:
        assert tuple(init_from_env(backend=backend)) == (0, 1, 1)
    assert bound == []


@pytest.mark.parametrize("group", [None, (1, 2)])
def test_init_from_env_refuses_a_job_of_several_processes_without_local_rank(monkeypatch, group):
    """RANK and WORLD_SIZE without LOCAL_RANK (a launcher other than torchrun) bound every rank to
    GPU 0, and NCCL failed later with a duplicate-GPU error; with a process group of several
    ranks already made, the same. Refused now, naming LOCAL_RANK, before any GPU is bound (torch
    faked: two GPUs)."""
    from ex_engine.distributed import init_from_env
    bound = _fake_torch(monkeypatch, gpus=2, group=group)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ArgumentError, match=r"argument 'LOCAL_RANK': .*set in a job of several processes .*got unset"):
        init_from_env(backend="nccl")
    assert bound == [] and bound.inits == []


def test_init_from_env_without_local_rank_where_that_is_fine(monkeypatch):
    """No LOCAL_RANK is GPU 0 in a job of one process, and no GPU at all under gloo alone (the
    variable is then reported as 0); a negative LOCAL_RANK is refused; the backend's name is
    taken whatever its case and blanks, and NCCL binds its communicator to the rank's GPU."""
    from ex_engine.distributed import init_from_env
    bound = _fake_torch(monkeypatch, gpus=2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert tuple(init_from_env(backend=" NCCL ")) == (0, 1, 0)
    assert bound == [0] and bound.inits == [("nccl", {"rank": 0, "world_size": 1, "device_id": "cuda:0"})]
    bound = _fake_torch(monkeypatch, gpus=2)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert tuple(init_from_env(backend="gloo")) == (1, 2, 0)
    assert bound == [] and bound.inits == [("gloo", {"rank": 1, "world_size": 2})]
    monkeypatch.setenv("LOCAL_RANK", "-1")
    with pytest.raises(ArgumentError, match=r"argument 'LOCAL_RANK': .*an integer >= 0, got -1"):
        init_from_env(backend="gloo")


def test_expert_partition_returns_plain_ints_for_numpy_integers():
    first, count = expert_partition(np.int64(8), 2, np.int32(1))
    assert (first, count) == (4, 4) and type(first) is int and type(count) is int


# ------------------------------------------------------------------------------ audit: argument checks
def test_partition_refuses_rank_none_and_names_the_function_called(reg):
    with pytest.raises(ArgumentError, match=r"expert_partition: argument 'rank': type: expected an int, got NoneType"):
        expert_partition(8, 2, None)
    with pytest.raises(ArgumentError, match=r"^make_expert_map: argument 'rank'"):
        make_expert_map(8, 3, 5)
    rng = np.random.default_rng(6)
    _, w13, w2, _, _ = _layer(rng, 1, 16, 9, 8, 2, "float16")
    with pytest.raises(ArgumentError, match=r"^ExpertParallelMoE.from_global: argument 'rank': 0 <= rank < world_size"):
        ExpertParallelMoE.from_global(w13, w2, rank=5, world_size=3, registry=reg)
    with pytest.raises(ArgumentError, match=r"^ExpertParallelMoE: argument 'rank'"):
        ExpertParallelMoE(w13, w2, 8, rank=5, world_size=3, registry=reg)


def test_from_global_reports_the_shapes_given_and_wants_a_bool_copy(reg):
    rng = np.random.default_rng(7)
    _, w13, w2, _, _ = _layer(rng, 1, 16, 8, 8, 2, "float16")
    bad_w2 = np.zeros((8, 16, 9), np.float16)
    with pytest.raises(ShapeError, match=r"^ExpertParallelMoE.from_global: argument 'w2'.*expected \(8, 16, 8\), got \(8, 16, 9\)"):
        ExpertParallelMoE.from_global(w13, bad_w2, rank=0, world_size=2, registry=reg)
    with pytest.raises(ShapeError, match=r"^ExpertParallelMoE.from_global: argument 'w13'"):
        ExpertParallelMoE.from_global(w13[:, :15], w2, rank=0, world_size=2, registry=reg)
    with pytest.raises(ArgumentError, match=r"^ExpertParallelMoE.from_global: argument 'copy'.*True or False, got 'no'"):
        ExpertParallelMoE.from_global(w13, w2, rank=0, world_size=2, registry=reg, copy="no")
    # an error of the constructor reached through from_global names from_global
    with pytest.raises(DTypeError, match=r"^ExpertParallelMoE.from_global: argument 'w13': dtype"):
        ExpertParallelMoE.from_global(w13.astype(np.float32), w2.astype(np.float32), rank=0, world_size=2,
                                      registry=reg)


def test_tensor_ref_errors_name_the_distributed_function(reg):
    rng = np.random.default_rng(8)
    x, w13, w2, w, ids = _layer(rng, 2, 16, 8, 8, 2, "float16")
    with pytest.raises(DTypeError, match=r"^ExpertParallelMoE.from_global: argument 'w13': type"):
        ExpertParallelMoE.from_global(w13.tolist(), w2, rank=0, world_size=2, registry=reg)
    with pytest.raises(DTypeError, match=r"^ExpertParallelMoE: argument 'w2': type"):
        ExpertParallelMoE(w13[:4], None, 8, rank=0, world_size=2, registry=reg)
    layer = ExpertParallelMoE.from_global(w13, w2, rank=0, world_size=2, registry=reg)
    with pytest.raises(DTypeError, match=r"^ExpertParallelMoE: argument 'hidden_states': type"):
        layer.forward_local(x.tolist(), w, ids)
    empty = ExpertParallelMoE(w13[:0], w2[:0], 8, rank=9, world_size=10, registry=reg)
    with pytest.raises(DTypeError, match=r"^ExpertParallelMoE: argument 'topk_ids': type"):
        empty.forward_local(x, w, ids.tolist())


def test_registry_for_device_checks_the_index(monkeypatch):
    import types
    import ex_engine.ops
    from ex_engine.distributed import registry_for_device
    from ex_engine.hardware import NoDeviceError
    for bad in ("x", None, 1.5, True, -2):
        with pytest.raises(ArgumentError, match=r"registry_for_device: argument 'device'.*an int >= 0, or -1"):
            registry_for_device(bad)
    # a wrong GPU index names the index and the devices there are (a mocked CuPy with 2 GPUs)
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 2, getDeviceProperties=lambda i: {})
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cupy.cuda)
    stub = types.SimpleNamespace(hardware=types.SimpleNamespace(live=False, device_id=-1))
    monkeypatch.setattr(ex_engine.ops, "default_registry", lambda: stub)
    with pytest.raises(NoDeviceError, match=r"CUDA device 7: no such device; CuPy sees 2"):
        registry_for_device(7)
    assert registry_for_device(-1) is stub


def test_init_from_env_and_shutdown_without_torch_say_what_to_install(monkeypatch):
    from ex_engine.distributed import init_from_env, shutdown
    monkeypatch.setitem(sys.modules, "torch", None)          # import torch -> ImportError
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    for fn, name in ((init_from_env, "init_from_env"), (shutdown, "shutdown")):
        with pytest.raises(FactorError, match=rf"^{name}: needs PyTorch.*pip install"):
            fn()

"""Expert parallelism as a user runs it (trial 40ep): ExpertParallelMoE over real gloo ranks (CPU
tensors, the Python fallback) and its misuse. The tests that need several processes run this file
as a script, one process per rank (RANK/WORLD_SIZE/MASTER_* as torchrun sets them), under a
timeout: ``python tests/test_trial40ep.py SCENARIO`` prints ``OK SCENARIO`` on each rank that
saw what it should.
"""
import os
import socket
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ex_engine.errors import FactorError  # noqa: E402
from tests.ranks import run_ranks  # noqa: E402

G, H, I, T, K = 4, 16, 8, 3, 2


def _layer_inputs(torch, G=G, H=H):
    """x, w13, w2, topk_weights, topk_ids: the same on every rank (seeded)."""
    gen = torch.Generator().manual_seed(40)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(G, 2 * I, H, generator=gen) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(G, H, I, generator=gen) / I ** 0.5).to(torch.bfloat16)
    w = torch.rand(T, K, generator=gen) * 0.9 + 0.1
    ids = torch.tensor([[0, G - 1], [1, 2 % G], [G - 1, 0]], dtype=torch.int32)
    return x, w13, w2, w, ids


def _run_ranks(scenario: str, nproc: int = 2, timeout: float = 120.0) -> None:
    """Run ``scenario`` in ``nproc`` CPU processes of this file (tests/ranks.py)."""
    run_ranks(__file__, scenario, nproc, timeout)


# ------------------------------------------------------------------------------ scenarios (one rank)
def _scenario_reinit(torch, dist, reg, rank):
    """forward after shutdown() says so (it raised torch's ValueError from inside the all-reduce,
    after the local compute); in a new process group of another size the layer is checked again
    (the check was cached: the layer built for rank 0 of 2 all-reduced in a world of one and
    returned rank 0's partial output as the layer's, silently)."""
    from ex_engine.distributed import ExpertParallelMoE, init_from_env, shutdown
    init_from_env(backend="gloo")
    x, w13, w2, w, ids = _layer_inputs(torch)
    layer = ExpertParallelMoE.from_global(w13, w2, registry=reg)
    layer(x, w, ids)
    shutdown()
    with pytest.raises(FactorError, match="not initialised"):
        layer(x, w, ids)
    if rank == 0:
        dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        try:
            with pytest.raises(FactorError, match="built for rank 0 of 2, the process group is rank 0 of 1"):
                layer(x, w, ids)
        finally:
            dist.destroy_process_group()


def test_forward_after_shutdown_and_in_a_new_process_group():
    _run_ranks("reinit")


def _scenario_numpy_out(torch, dist, reg, rank):
    """A NumPy out beside torch CPU tensors (the factor takes it on the host) is refused by name
    before the compute: torch.distributed's all-reduce raised its own TypeError about a
    parameter 'tensor' after the local compute. The layer then runs as usual."""
    from ex_engine.distributed import ExpertParallelMoE, init_from_env
    from ex_engine.errors import DeviceError
    init_from_env(backend="gloo")
    x, w13, w2, w, ids = _layer_inputs(torch)
    layer = ExpertParallelMoE.from_global(w13, w2, registry=reg)
    import ml_dtypes
    out = np.zeros((T, H), ml_dtypes.bfloat16)
    with pytest.raises(DeviceError, match=r"ExpertParallelMoE.forward: argument 'out': .*expected a torch "
                                          r"tensor, like the weights, got a numpy array"):
        layer(x, w, ids, out=out)
    assert not out.astype(np.float32).any()           # refused before the local compute wrote it
    full = layer(x, w, ids)
    assert full.shape == (T, H) and bool(full.float().abs().sum() > 0)


def test_forward_refuses_an_out_that_is_not_a_torch_tensor():
    pytest.importorskip("ml_dtypes")
    _run_ranks("numpy_out")


def _scenario_foreign_group(torch, dist, reg, rank):
    """A group without this process is named as 'group' (the constructor reported torch's -1 as
    "argument 'world_size': expected >= 1, got -1", an argument not given), in the constructor
    and in forward; so is an object that is no group (torch's ValueError named nothing)."""
    from ex_engine.distributed import ExpertParallelMoE, init_from_env
    from ex_engine.errors import ArgumentError
    init_from_env(backend="gloo")
    x, w13, w2, w, ids = _layer_inputs(torch)
    sub = dist.new_group([0])                       # every rank creates it; rank 1 is not in it
    for group in ("foo", 3):
        with pytest.raises(ArgumentError, match=r"from_global: argument 'group': .*process group"):
            ExpertParallelMoE.from_global(w13, w2, group=group, registry=reg)
    if rank == 0:
        assert ExpertParallelMoE.from_global(w13, w2, group=sub, registry=reg).world_size == 1
        return
    with pytest.raises(ArgumentError, match=r"from_global: argument 'group': .*without it \(this is rank 1"):
        ExpertParallelMoE.from_global(w13, w2, group=sub, registry=reg)
    with pytest.raises(ArgumentError, match=r"^ExpertParallelMoE: argument 'group'"):
        ExpertParallelMoE(w13[2:].contiguous(), w2[2:].contiguous(), G, group=sub, registry=reg)
    layer = ExpertParallelMoE.from_global(w13, w2, rank=1, world_size=2, group=sub, registry=reg)
    with pytest.raises(ArgumentError, match=r"forward: argument 'group': .*without it"):
        layer(x, w, ids)


def test_a_group_without_this_process_is_named():
    _run_ranks("foreign_group")


def _scenario_layer_mismatch(torch, dist, reg, rank):
    """Ranks whose layers differ are refused on every rank at the first forward: num_experts 4 on
    rank 0 and 6 on rank 1 summed partial outputs of two different partitions into a wrong layer,
    silently; a different H (or I) aborted the gloo processes (SIGABRT) in the all-reduce. Then a
    rank built for another rank than its own: it raised alone and left the other waiting in the
    all-reduce; now both raise. A consistent layer still runs afterwards."""
    from ex_engine.distributed import ExpertParallelMoE, init_from_env
    init_from_env(backend="gloo")
    x, w13, w2, w, ids = _layer_inputs(torch, G=4 if rank == 0 else 6)
    with pytest.raises(FactorError, match=r"different layers \(num_experts from 4 to 6 across the ranks; "
                                          rf"this rank: num_experts {4 if rank == 0 else 6}, H 16"):
        ExpertParallelMoE.from_global(w13, w2, registry=reg)(x, w, ids)
    Hr = 16 if rank == 0 else 8
    x, w13, w2, w, ids = _layer_inputs(torch, H=Hr)
    with pytest.raises(FactorError, match=r"different layers \(H from 8 to 16 across"):
        ExpertParallelMoE.from_global(w13, w2, registry=reg)(x, w, ids)
    x, w13, w2, w, ids = _layer_inputs(torch)
    wrong = ExpertParallelMoE.from_global(w13, w2, rank=0, world_size=2, registry=reg)
    with pytest.raises(FactorError, match="built for rank 0 of 2, the process group is rank 1 of 2" if rank
                       else "another rank's layer was built for a rank or world size other than its own"):
        wrong(x, w, ids)
    layer = ExpertParallelMoE.from_global(w13, w2, registry=reg)
    out = layer(x, w, ids)
    full = ExpertParallelMoE.from_global(w13, w2, rank=0, world_size=1, registry=reg).forward_local(x, w, ids)
    assert float((out.double() - full.double()).norm() / full.double().norm()) < 1e-2


def test_ranks_holding_different_layers_are_refused_on_every_rank():
    _run_ranks("layer_mismatch")


# ------------------------------------------------------------------------------ one process
@pytest.mark.parametrize("backend,got", [(123, "got int"), (b"gloo", "got bytes"), ("", "got ''"),
                                         ("foo", "got 'foo'"), ("gloo,", "got 'gloo,'"),
                                         ("cpu:glo", "got 'cpu:glo'")])
def test_init_from_env_names_a_bad_backend(monkeypatch, backend, got):
    """A backend that is no str or names no torch.distributed backend is an ArgumentError naming
    'backend': torch raised "Backend constructor parameter must be string-ish" (ValueError) or
    "Unknown backend type" (an AssertionError, gone under python -O), naming no argument."""
    pytest.importorskip("torch.distributed")
    import torch.distributed as dist
    from ex_engine.distributed import init_from_env
    from ex_engine.errors import ArgumentError
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable or already initialised")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    try:
        with pytest.raises(ArgumentError, match=rf"init_from_env: argument 'backend': .*{got}"):
            init_from_env(backend=backend)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    for k in ("RANK", "WORLD_SIZE"):                # no process group to create: still checked
        monkeypatch.delenv(k)
    with pytest.raises(ArgumentError, match="argument 'backend'"):
        init_from_env(backend=backend)


def test_init_from_env_takes_the_backends_torch_knows(monkeypatch):
    """Upper case, spaces, device:backend pairs and None (torch's default) still pass."""
    pytest.importorskip("torch.distributed")
    from ex_engine.distributed import init_from_env
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    for backend in (" GLOO ", "cpu:gloo,cuda:nccl", None, "nccl"):
        assert tuple(init_from_env(backend=backend)) == (0, 1, 0)


@pytest.mark.parametrize("name,value", [("WORLD_SIZE", "1_6"), ("RANK", "0_0"), ("WORLD_SIZE", "\u0662"),
                                        ("LOCAL_RANK", "\u0661"), ("LOCAL_RANK", "1__")])
def test_init_from_env_takes_only_decimal_integers(monkeypatch, name, value):
    """RANK/WORLD_SIZE/LOCAL_RANK are read as ASCII decimal integers: int() took '1_6' as 16 (a
    world of 16 to wait for, from a mistyped 16 or 1) and Arabic-Indic digits, silently."""
    pytest.importorskip("torch.distributed")
    from ex_engine.distributed import init_from_env
    from ex_engine.errors import ArgumentError
    for k in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(name, value)
    with pytest.raises(ArgumentError, match=rf"argument '{name}': environment variable: expected an integer, "
                                            rf"got '{value}'"):
        init_from_env(backend="gloo")
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("LOCAL_RANK", " +1 ")                       # blanks and a sign: still fine
    assert tuple(init_from_env(backend="gloo")) == (0, 1, 1)


def _main(scenario: str) -> int:
    import torch
    import torch.distributed as dist
    from ex_engine import FactorRegistry
    reg = FactorRegistry.load(tempfile.mkdtemp(), hardware="h200")     # no plugins: the fallback
    rank = int(os.environ["RANK"])
    try:
        globals()["_scenario_" + scenario](torch, dist, reg, rank)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    print(f"OK {scenario}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))

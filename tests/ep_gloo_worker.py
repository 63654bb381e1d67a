"""One rank of a CPU expert-parallel run (torchrun + gloo, torch CPU tensors, Python fallback of
moe_fused_gemm): ExpertParallelMoE.forward's all-reduce against the full layer. Launched by
tests/test_distributed.py::test_forward_all_reduce_over_gloo; not a test module itself.

    python -m torch.distributed.run --standalone --nproc_per_node=3 tests/ep_gloo_worker.py E T H I K
"""
import math
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from ex_engine import FactorRegistry, moe_fused_gemm  # noqa: E402
from ex_engine.distributed import ExpertParallelMoE, expert_partition, init_from_env, shutdown  # noqa: E402


def main() -> int:
    E, T, H, I, K = map(int, sys.argv[1:6])
    rank, world, _ = init_from_env(backend="gloo")
    reg = FactorRegistry.load(tempfile.mkdtemp(), hardware="h200")     # no plugins: the fallback
    g = torch.Generator().manual_seed(1234)                             # the same on every rank
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K, generator=g) * 0.9 + 0.1
    ep = ExpertParallelMoE.from_global(w13, w2, registry=reg)
    assert (ep.rank, ep.world_size) == (rank, world)
    assert (ep.first, ep.count) == expert_partition(E, world, rank)
    out = torch.full((T, H), math.nan, dtype=torch.bfloat16)
    got = ep(x, w, ids, out=out)
    assert got is out
    full = moe_fused_gemm(x, w13, w2, w, ids, registry=reg).double()
    err = float((out.double() - full).norm() / full.norm())
    ok = not bool(torch.isnan(out).any()) and err < 1e-2
    print(f"rank {rank}/{world}: experts {ep.first}..{ep.first + ep.count - 1}, rel err {err:.2e}: "
          f"{'PASS' if ok else 'FAIL'}", flush=True)
    shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Review of session forty's change (topk_softmax / moe_fused_gemm refusing a non-contiguous
input before allocating its outputs): defects found by comparing with the code before it, each
test failing before its fix."""
import numpy as np
import pytest

from ex_engine import FactorNotFoundError, FactorRegistry, LayoutError, moe_fused_gemm, topk_softmax
from ex_engine import ops


@pytest.fixture(scope="module")
def reg():
    return FactorRegistry.load(hardware="h200")


def _moe_args(xp_from=lambda a: a, T=4, H=64, I=32, E=8, K=2):
    """(w13, w2, topk_weights, topk_ids) of a small layer, converted by ``xp_from``."""
    return tuple(xp_from(a) for a in (np.zeros((E, 2 * I, H), np.float16), np.zeros((E, H, I), np.float16),
                                      np.zeros((T, K), np.float32), np.zeros((T, K), np.int32)))


def test_contiguous_input_builds_no_refusal_arguments(reg, monkeypatch):
    """The check before allocating built its arguments (a memoryless TensorRef per output to be
    allocated, a dict of every argument) on every call that allocates an output, contiguous
    inputs included: ~1.4 us of host time on each topk_softmax call (any array kind) and each
    NumPy/CuPy moe_fused_gemm call, for a check that only a non-contiguous input needs."""
    def built(*args, **kwargs):
        raise AssertionError("the refusal's arguments were built for a contiguous input")
    monkeypatch.setattr(ops, "_no_memory", built)
    monkeypatch.setattr(ops, "_refuse_before_allocating", built)
    w, ids = topk_softmax(np.zeros((4, 8), np.float32), 2, registry=reg)
    assert w.shape == ids.shape == (4, 2)
    topk_softmax(np.zeros((4, 8), np.float32), 2, topk_ids=np.zeros((4, 2), np.int32), registry=reg)
    out = moe_fused_gemm(np.zeros((4, 64), np.float16), *_moe_args(), registry=reg)
    assert out.shape == (4, 64)
    torch = pytest.importorskip("torch")
    topk_softmax(torch.zeros(4, 8), 2, registry=reg)
    moe_fused_gemm(torch.zeros(4, 64, dtype=torch.float16), *_moe_args(torch.from_numpy), registry=reg)


def test_unknown_factor_is_not_counted_for_a_non_contiguous_input(tmp_path):
    """dispatch counts no FactorNotFoundError (there is no factor to count it under); the check
    before allocating counted one for a non-contiguous input, so that stats() of a registry
    without the factor listed it with errors 1 (a contiguous input: nothing)."""
    reg = FactorRegistry(hardware="h200", manifests_dir=tmp_path)
    with pytest.raises(FactorNotFoundError, match="no factor named 'topk_softmax'"):
        topk_softmax(np.zeros((4, 16), np.float32)[:, ::2], 2, registry=reg)
    with pytest.raises(FactorNotFoundError, match="no factor named 'moe_fused_gemm'"):
        moe_fused_gemm(np.zeros((4, 128), np.float16)[:, ::2], *_moe_args(), registry=reg)
    assert reg.stats() == {}


@pytest.mark.filterwarnings("ignore:Sparse .* support is in beta")
@pytest.mark.parametrize("layout", ["sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc"])
def test_sparse_compressed_hidden_states_is_a_layout_error(reg, layout):
    """moe_fused_gemm's torch fast path now asks hidden_states.is_contiguous(), which a sparse
    compressed tensor does not have: torch's RuntimeError 'Sparse CSR tensors do not have
    is_contiguous' (uncounted) instead of the TensorLayoutError naming hidden_states that CSR
    and CSC got before (BSR and BSC failed in new_empty already)."""
    torch = pytest.importorskip("torch")
    topk_softmax(torch.zeros(1, 2), 1, registry=reg)   # torch's tensor type known (_KINDS): its fast path
    dense = torch.zeros(4, 64)
    hs = getattr(dense, f"to_{layout}")(*(((2, 2),) if "bs" in layout else ()))
    before = reg.stats().get("moe_fused_gemm", {}).get("errors", 0)
    with pytest.raises(LayoutError, match=f"^moe_fused_gemm: argument 'hidden_states': layout: expected a dense "
                                          f"\\(strided\\) torch tensor, got layout {layout}"):
        moe_fused_gemm(hs, *_moe_args(torch.from_numpy), registry=reg)
    assert reg.stats()["moe_fused_gemm"]["errors"] == before + 1


def test_bench_moe_graph_errors_out_arg_writes_into_buffers_made_before_the_capture(monkeypatch):
    """The CPU part of graph_errors(out_arg=True), which only a GPU test exercised: each set's
    callable is given out= one buffer like the set's first tensor, made before graph_outputs
    runs (captures) the callables and the same at every call, so that the poison graph_outputs
    fills it with stays where a call leaves an element unwritten (a stand-in that runs each
    callable, poisons what it returned and runs it again, as capture, fill and replay do)."""
    torch = pytest.importorskip("torch")
    from tests.test_bench_tools import import_tool
    bench = import_tool("benchmarks", "bench_moe")

    def graph_outputs(fns):
        outs = [fn() for fn in fns]
        for o in outs:
            o.fill_(float("nan"))
        return [fn() for fn in fns]

    monkeypatch.setattr(bench, "graph_outputs", graph_outputs)
    sets = [(torch.randn(8, 4),) for _ in range(3)]
    refs = [2 * a[0] for a in sets]

    def all_but_one(x, out=None):
        assert out is not None and out.shape == x.shape and out.dtype == x.dtype
        out.view(-1)[1:] = 2 * x.view(-1)[1:]
        return out

    assert bench.graph_errors(all_but_one, sets, refs, out_arg=True) == [float("inf")] * 3
    assert bench.graph_failure(bench.graph_errors(lambda x, out=None: torch.mul(x, 2, out=out), sets, refs,
                                                  out_arg=True)) is None

"""Trial 39f (torch CPU user): in-place writes into a non-leaf that requires grad (a silently
wrong gradient), torch.jit.trace (a trace that silently drops the factor) and torch.compile
(bfloat16 failed inside the Python fallback's NumPy code) over the ops."""
import warnings

import pytest

torch = pytest.importorskip("torch")

from ex_engine import FactorRegistry, fused_add_rmsnorm, moe_fused_gemm, topk_softmax  # noqa: E402
from ex_engine.errors import ArgumentError, FactorError  # noqa: E402


@pytest.fixture(scope="module")
def reg():
    return FactorRegistry.load(hardware="h200")


def _moe_args(dtype=torch.bfloat16, T=6, H=32, I=16, E=4, K=2, reg=None):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / 6).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / 4).to(dtype)
    tw, ids = topk_softmax(torch.randn(T, E, generator=g), K, True, registry=reg)
    return x, w13, w2, tw, ids


def test_non_leaf_requiring_grad_written_in_place_is_refused(reg):
    """x = leaf * 2 written by fused_add_rmsnorm kept grad_fn MulBackward: x.sum().backward()
    gave leaf.grad = 2, the gradient of the old values (silently wrong); moe_fused_gemm's out and
    topk_softmax's outputs likewise. Refused under grad mode now, naming the argument."""
    leaf = torch.randn(4, 16, requires_grad=True)
    act = leaf * 2
    with pytest.raises(ArgumentError, match="^fused_add_rmsnorm: argument 'x': autograd.*non-leaf"):
        fused_add_rmsnorm(act, torch.randn(4, 16), torch.ones(16), registry=reg)
    res = leaf * 1.0
    with pytest.raises(ArgumentError, match="^fused_add_rmsnorm: argument 'residual': autograd"):
        fused_add_rmsnorm(torch.randn(4, 16), res, torch.ones(16), registry=reg)
    x, w13, w2, tw, ids = _moe_args(reg=reg)
    out = torch.zeros(x.shape, dtype=x.dtype, requires_grad=True) * 1
    with pytest.raises(ArgumentError, match="^moe_fused_gemm: argument 'out': autograd.*non-leaf"):
        moe_fused_gemm(x, w13, w2, tw, ids, out=out, registry=reg)
    w = torch.zeros(6, 2, requires_grad=True) * 1
    with pytest.raises(ArgumentError, match="^topk_softmax: argument 'topk_weights': autograd"):
        topk_softmax(torch.randn(6, 4), 2, topk_weights=w, registry=reg)
    # under no_grad all of them run (the documented way), inputs requiring grad are fine
    with torch.no_grad():
        fused_add_rmsnorm(act, torch.randn(4, 16), torch.ones(16), registry=reg)
        moe_fused_gemm(x, w13, w2, tw, ids, out=out, registry=reg)
    got = moe_fused_gemm(x.clone().requires_grad_(), w13, w2, tw, ids, registry=reg)
    assert not got.requires_grad


@pytest.mark.parametrize("op", ["topk_softmax", "fused_add_rmsnorm", "moe_fused_gemm"])
def test_jit_trace_is_refused_by_name(reg, op):
    """torch.jit.trace over fused_add_rmsnorm recorded nothing: replaying the trace left x and
    residual unchanged (silently); over topk_softmax torch raised an INTERNAL ASSERT, over
    moe_fused_gemm the fallback a TypeError about numpy and Tensor. A FactorError naming the op."""
    if op == "topk_softmax":
        fn, args = (lambda lg: topk_softmax(lg, 2, registry=reg)), (torch.randn(5, 8),)
    elif op == "fused_add_rmsnorm":
        fn = lambda x, r, w: fused_add_rmsnorm(x, r, w, registry=reg)   # noqa: E731
        args = (torch.randn(3, 8), torch.randn(3, 8), torch.ones(8))
    else:
        x, w13, w2, tw, ids = _moe_args(torch.float16, reg=reg)
        fn, args = (lambda x, tw, ids: moe_fused_gemm(x, w13, w2, tw, ids, registry=reg)), (x, tw, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(FactorError, match=f"^{op}: cannot be recorded by torch.jit.trace"):
            torch.jit.trace(fn, args, check_trace=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_compile_breaks_the_graph_and_matches_eager(reg, dtype):
    """torch.compile (backend 'eager') over topk_softmax with bfloat16 logits raised FactorError
    '... raised TorchRuntimeError: RuntimeError when making fake tensor call' (TorchDynamo traced
    the fallback's NumPy bit tricks); a patched HF model in bf16 failed the same way. The ops
    now run eagerly at a graph break: results equal the eager call's, stats count them."""
    torch._dynamo.reset()
    x, w13, w2, _, _ = _moe_args(dtype, reg=reg)
    logits = torch.randn(x.shape[0], 4).to(dtype)

    def layer(x, logits, res, weight):
        tw, ids = topk_softmax(logits, 2, True, registry=reg)
        fused_add_rmsnorm(x, res, weight, registry=reg)
        return moe_fused_gemm(x, w13, w2, tw, ids, registry=reg) * 2

    args = lambda: (x.clone(), logits, torch.zeros_like(x), torch.ones(x.shape[1], dtype=dtype))  # noqa: E731
    want = layer(*args())
    before = reg.stats()["moe_fused_gemm"]["python_fallback"]
    got = torch.compile(layer, backend="eager")(*args())
    assert torch.equal(got, want)
    assert reg.stats()["moe_fused_gemm"]["python_fallback"] == before + 1
    torch._dynamo.reset()


def test_torch_compile_over_a_patched_bf16_hf_block(reg):
    """The HF integration under torch.compile: the patched Qwen3-MoE block (bf16) compiles with
    graph breaks at the factors and returns what the patched eager block returns."""
    transformers = pytest.importorskip("transformers")
    from ex_engine.integrations.transformers import patch_moe
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=16, intermediate_size=64,
                                      moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                      norm_topk_prob=True, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, 64, (2, 5))
    with patch_moe(model, reg), torch.no_grad():
        want = model(ids).logits
        torch._dynamo.reset()
        got = torch.compile(model, backend="eager")(ids).logits
    torch._dynamo.reset()
    assert torch.equal(got, want)


def test_non_strict_export_refuses_the_fake_tensor_by_name(reg):
    """torch.export's non-strict tracing keeps torch.compiler.is_compiling() true while the op
    runs: the op's eager path must not ask again and recurse (a RecursionError during this
    change); it reaches the FakeTensor and refuses it by name, as before."""
    from ex_engine.errors import DeviceError

    class Router(torch.nn.Module):
        def forward(self, lg):
            return topk_softmax(lg, 2, True, registry=reg)

    with pytest.raises(DeviceError, match="^topk_softmax: argument 'router_logits'.*FakeTensor"):
        torch.export.export(Router(), (torch.randn(5, 8).to(torch.bfloat16),), strict=False)

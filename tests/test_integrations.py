"""ex_engine.integrations.transformers: transformers MoE models on ex_engine's factors.

Tiny Qwen3-MoE, OLMoE and Mixtral models (H 64, 8 experts, top-2, I 32, 2 layers, vocab 128,
bf16, weights initialised by transformers). CPU part: the patched model runs its routers and
experts through ex_engine's Python fallbacks (NumPy on the tensors' memory) and matches the
stock model; undo restores everything. GPU part (marked ``gpu``): the same on CUDA through the
plugins, greedy generation, and a CUDA-graph decode step. Skipped where torch or transformers
is missing (CI installs ex_engine[test] only: see README, "PyTorch and transformers").
"""
import warnings
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ex_engine import FactorRegistry  # noqa: E402
from ex_engine.integrations import transformers as hf  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

FAMILIES = ["qwen3_moe", "olmoe", "mixtral"]
V, H, E, K, I, LAYERS = 128, 64, 8, 2, 32, 2


# The layer-level checks scale the experts' weights by this after transformers' initialisation
# (std 0.02): at H 64 and I 32 an expert then returns O(0.1-1), as a full-size layer's does at
# that std; unscaled it returned ~0.003, under the logits' bf16 noise, so that a gate/up swap or
# a zero expert output passed the model-level comparison (a helper's trial, session 35). The
# model-level tests keep the unscaled model: with experts that large a rounding difference in
# one layer flips a near-tie of the next layer's router, and whole-model logits diverge.
EXPERTS_SCALE = 8.0


def tiny_model(family, device="cpu", seed=0, experts_scale=1.0, **over):
    """A tiny bf16 model of ``family``, weights drawn by transformers' own initialisation, the
    experts' (gate_up_proj, down_proj) then multiplied by ``experts_scale``."""
    common = dict(vocab_size=V, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, num_experts_per_tok=K,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**{**common, "norm_topk_prob": True, **over}, head_dim=16,
                                          intermediate_size=4 * I, moe_intermediate_size=I,
                                          num_experts=E)
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "olmoe":
        cfg = transformers.OlmoeConfig(**{**common, **over}, intermediate_size=I, num_experts=E)
        cls = transformers.OlmoeForCausalLM
    else:
        cfg = transformers.MixtralConfig(**{**common, **over}, intermediate_size=I, num_local_experts=E)
        cls = transformers.MixtralForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.mul_(experts_scale)
    model = model.to(torch.bfloat16).eval()
    model.set_experts_implementation("eager")     # the stock reference: transformers' expert loop
    return model


@pytest.fixture(scope="module")
def reg():
    return FactorRegistry.load(ROOT / "factors")


def prompt(device="cpu", n=8, seed=1):
    return torch.randint(0, V, (1, n), generator=torch.Generator().manual_seed(seed)).to(device)


def logits_of(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def assert_logits_close(got, ref, what=""):
    """Within bf16 noise: 2% of the largest logit (the expert outputs are rounded differently)."""
    err = float((got - ref).abs().max())
    tol = 2e-2 * float(ref.abs().max()) + 1e-3
    assert err <= tol, f"{what}: max |logit diff| {err:.4g} > {tol:.4g}"
    return err


def check_greedy(ref_logits, toks_ref, toks_got, tol):
    """Tokens equal; a flip is accepted only at a near-tie of the stock logits (top two within
    ``tol``), and is reported in the assertion message otherwise."""
    for s, (a, b) in enumerate(zip(toks_ref, toks_got)):
        if a != b:
            row = ref_logits[s]
            gap = float(row[a] - row[b])
            assert gap <= tol, f"token {s}: stock {a}, ex_engine {b}, stock logit gap {gap:.4g} > {tol:.4g}"
            return s
    return None


# ------------------------------------------------------------------------------ CPU
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_matches_stock_on_cpu(reg, family):
    m = tiny_model(family)
    ids = prompt()
    ref = logits_of(m, ids)
    before = dict(reg.stats().get("moe_fused_gemm", {}))
    with hf.patch_moe(m, registry=reg) as handle:
        assert handle.families == [family] and len(handle.blocks) == LAYERS
        assert handle.repacked_bytes == 0
        got = logits_of(m, ids)
        s = handle.stats()
    assert s["moe_fused_gemm"]["python_fallback"] - before.get("python_fallback", 0) == LAYERS
    assert s["topk_softmax"]["python_fallback"] >= LAYERS
    assert_logits_close(got, ref, family)
    assert torch.equal(logits_of(m, ids), ref)         # undone: stock again, bit for bit


def test_grad_mode_runs_the_stock_forwards_so_gradients_flow(reg):
    """The factors have no backward: under grad mode with parameters that require grad the
    patched forwards hand the call to the stock ones (a warning says so) and every parameter
    gets its gradient, as unpatched; under no_grad the factors serve."""
    m = tiny_model("qwen3_moe")
    ids = prompt()
    m.zero_grad()
    m(ids).logits.float().sum().backward()
    want = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    with hf.patch_moe(m, registry=reg) as handle:
        served = lambda: sum(handle.stats()["moe_fused_gemm"].values())   # every path's calls
        before = served()
        hf._GRAD_WARNED.clear()
        with pytest.warns(UserWarning, match="grad mode .* the stock forward runs"):
            m(ids).logits.float().sum().backward()
        assert served() == before                                           # the factors did not run
        got = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
        assert got.keys() == want.keys() and any("gate" in n for n in got)
        for n in want:
            assert torch.equal(got[n], want[n]), n
        logits_of(m, ids)                                                   # no_grad: the factors
        assert served() == before + LAYERS


def test_bad_arguments_of_the_integration_are_named(reg):
    from ex_engine.errors import FactorError
    with pytest.raises(hf.UnsupportedModelError, match="model: expected a torch.nn.Module .* got str"):
        hf.patch_moe("model", registry=reg)
    m = tiny_model("qwen3_moe")
    with pytest.raises(FactorError, match="registry: expected a FactorRegistry or None, got str"):
        hf.patch_moe(m, registry="x")
    assert not any(hasattr(mod, hf._MARK) for mod in m.modules())     # nothing patched
    for kw in ({"batch_size": 0}, {"max_len": -5}, {"batch_size": 1.5}):
        with pytest.raises(ValueError, match="StaticDecoder: (batch_size|max_len): expected an int >= 1"):
            hf.StaticDecoder(m, **kw)
    d = hf.StaticDecoder(m, batch_size=2, max_len=16)
    d.prefill(torch.zeros(2, 3, dtype=torch.long))
    for bad in (torch.tensor([1, 2, 3]), torch.tensor([1.5, 2.0])):
        with pytest.raises(ValueError, match="^StaticDecoder.step: argument 'tokens': (shape|dtype): expected "):
            d.step(bad)


@pytest.mark.parametrize("family", FAMILIES)
def test_undo_restores_forwards_and_leaves_parameters_untouched(reg, family):
    m = tiny_model(family)
    params = {n: (p.data_ptr(), p.clone()) for n, p in m.named_parameters()}
    blocks = hf.find_moe_blocks(m)
    assert len(blocks) == LAYERS
    handle = hf.patch_moe(m, registry=reg)
    for _, blk, _ in blocks:
        assert "forward" in vars(blk.gate) and "forward" in vars(blk.experts)
        assert "forward" not in vars(blk)                  # the block's own forward stays stock
    with torch.no_grad():
        m(prompt())
    handle.undo()
    handle.undo()                                          # idempotent
    assert not handle.active and "undone" in repr(handle)
    for _, blk, _ in blocks:
        assert "forward" not in vars(blk.gate) and "forward" not in vars(blk.experts)
        assert not hasattr(blk.experts, hf._MARK)
        assert type(blk.experts).forward is blk.experts.forward.__func__
    for n, p in m.named_parameters():
        ptr, val = params[n]
        assert p.data_ptr() == ptr and torch.equal(p, val), n


@pytest.mark.parametrize("family,norm", [("qwen3_moe", True), ("qwen3_moe", False), ("olmoe", False),
                                         ("olmoe", True), ("mixtral", True)])
def test_router_keeps_each_familys_semantics(reg, family, norm):
    over = {} if family == "mixtral" else {"norm_topk_prob": norm}
    m = tiny_model(family, **over)
    router = m.model.layers[0].mlp.gate
    x = torch.randn(20, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        l0, w0, i0 = router(x)
        with hf.patch_moe(m, registry=reg):
            l1, w1, i1 = router(x)
    assert torch.equal(l0, l1)
    assert i1.dtype == torch.int32 and w1.dtype == torch.float32
    # the same experts with the same weights. bf16 logits of a tiny model tie often: the order
    # among tied experts is free, and at a tie across the top-k boundary ex_engine takes the
    # lower index where torch.topk on the CPU may not (such rows are skipped, and counted)
    top = l0.float().sort(-1, descending=True).values
    boundary_tie = top[:, K - 1] == top[:, K]
    assert int(boundary_tie.sum()) <= 2
    keep = ~boundary_tie
    i0s, o0 = i0[keep].sort(-1)
    i1s, o1 = i1[keep].long().sort(-1)
    assert torch.equal(i0s, i1s)
    torch.testing.assert_close(w1[keep].gather(1, o1), w0[keep].float().gather(1, o0), rtol=1e-2, atol=1e-3)
    if family != "mixtral":
        assert w0.dtype == torch.bfloat16                     # the stock router rounds to bf16 ...
        assert torch.equal(w1, w1.to(torch.bfloat16).float())  # ... and so does the patched one
    sums = w1.sum(-1)
    if norm:
        torch.testing.assert_close(sums, torch.ones_like(sums), rtol=1e-2, atol=1e-2)
    else:
        assert bool((sums < 0.99).all())                    # K=2 of 8: not renormalised


def layer_error(mlp, x, w, tk, ref):
    """||experts(x) - ref|| / ||ref|| for the block's (possibly patched) experts on router outputs w, tk."""
    with torch.no_grad():
        got = mlp.experts(x, tk, w).float()
    return float((got - ref).norm() / ref.norm())


@pytest.mark.parametrize("family", FAMILIES)
def test_the_layer_check_fails_on_a_wrong_expert_result(reg, family, monkeypatch):
    """The layer-level check (stock router outputs into stock and patched experts, experts scaled
    by EXPERTS_SCALE) passes the factor's result and fails the experts with gate and up swapped
    and the experts returning zeros (unscaled, such results passed every comparison here)."""
    m = tiny_model(family, experts_scale=EXPERTS_SCALE)
    mlp = m.model.layers[0].mlp
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.no_grad():
        _, w, tk = mlp.gate(x)
        ref = mlp.experts(x, tk, w).float()
    assert float(ref.abs().max()) > 0.1    # O(0.1-1), not bf16 noise
    real = hf.moe_fused_gemm

    def swapped(x, w13, w2, w, ids, **kw):
        i = w13.shape[1] // 2
        return real(x, torch.cat([w13[:, i:], w13[:, :i]], 1).contiguous(), w2, w, ids, **kw)

    def zeros(x, w13, w2, w, ids, out=None, **kw):
        return (torch.empty_like(x) if out is None else out).zero_()

    with hf.patch_moe(m, registry=reg):
        assert layer_error(mlp, x, w, tk, ref) <= 2e-2
        for wrong in (swapped, zeros):
            monkeypatch.setattr(hf, "moe_fused_gemm", wrong)
            assert layer_error(mlp, x, w, tk, ref) > 0.2, wrong.__name__
        monkeypatch.setattr(hf, "moe_fused_gemm", real)


def test_experts_accept_stock_router_outputs(reg):
    """The patched experts also take what the stock router returns (int64 ids, bf16 weights)."""
    m = tiny_model("qwen3_moe", experts_scale=EXPERTS_SCALE)
    mlp = m.model.layers[0].mlp
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.no_grad():
        _, w, ids = mlp.gate(x)
        ref = mlp.experts(x, ids, w).float()
        with hf.patch_moe(m, registry=reg):
            got = mlp.experts(x, ids, w)
    assert got.dtype == torch.bfloat16
    assert float(ref.abs().max()) > 0.1                   # O(0.1-1): not under the tolerance
    assert float((got.float() - ref).norm() / ref.norm()) <= 2e-2


def test_static_decoder_matches_full_forward(reg):
    m = tiny_model("qwen3_moe")
    ids = prompt()
    with hf.patch_moe(m, registry=reg):
        d = hf.StaticDecoder(m, batch_size=1, max_len=32)
        steps = [d.prefill(ids)]
        seq = ids[0].tolist()
        for _ in range(6):
            t = steps[-1].argmax(-1)
            seq.append(int(t))
            steps.append(d.step(t))
        full = logits_of(m, torch.tensor([seq]))[0, ids.shape[1] - 1:]
    # the same math; only the fallback's matmul batching (T=1 vs T=14) differs: bf16 noise
    assert_logits_close(torch.stack([s[0].float() for s in steps]), full, "static decoder")


def test_static_decoder_passes_the_cache_by_the_models_own_keyword(reg, recwarn):
    """transformers 5.24 renamed forward's past_key_values to cache (deprecated, to go in 5.40):
    every StaticDecoder call warned, and 5.40 would break it inside the allowed range."""
    import inspect
    m = tiny_model("qwen3_moe")
    d = hf.StaticDecoder(m, batch_size=1, max_len=16)
    new_name = "cache" in inspect.signature(m.forward).parameters
    assert d._cache_kw == ("cache" if new_name else "past_key_values")
    with hf.patch_moe(m, registry=reg):
        d.step(d.prefill(prompt()).argmax(-1))
    assert not [w for w in recwarn if "past_key_values" in str(w.message)]


def test_greedy_generate_on_cpu(reg):
    m = tiny_model("mixtral")
    ids = prompt()
    with torch.no_grad():
        ref = m.generate(ids, max_new_tokens=8, do_sample=False)
        ref_logits = logits_of(m, ref)[0, ids.shape[1] - 1:]
        with hf.patch_moe(m, registry=reg):
            got = m.generate(ids, max_new_tokens=8, do_sample=False)
    tol = 2e-2 * float(ref_logits.abs().max())
    check_greedy(ref_logits, ref[0, 8:].tolist(), got[0, 8:].tolist(), tol)


def test_unsupported_models_are_refused_before_anything_is_patched(reg):
    m = tiny_model("qwen3_moe").float()                  # fp32 experts: not a factor dtype
    with pytest.raises(hf.UnsupportedModelError, match="float16 or bfloat16"):
        hf.patch_moe(m, registry=reg)
    assert all("forward" not in vars(mod) for mod in m.modules())
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=1, num_attention_heads=4))
    with pytest.raises(hf.UnsupportedModelError, match="no sparse-MoE block"):
        hf.patch_moe(dense, registry=reg)
    with pytest.raises(hf.UnsupportedModelError, match="no sparse-MoE block"):
        hf.patch_moe(tiny_model("olmoe"), registry=reg, families=["mixtral"])


def test_patching_twice_is_refused(reg):
    m = tiny_model("olmoe")
    with hf.patch_moe(m, registry=reg):
        with pytest.raises(hf.UnsupportedModelError, match="already has an instance-level forward"):
            hf.patch_moe(m, registry=reg)
    hf.patch_moe(m, registry=reg).undo()                 # fine again after undo


def test_a_new_family_by_adapter_with_repack(reg):
    """register_adapter: a subclass is matched along the MRO; a repack copy is made once and
    freed by undo."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as q

    class MyBlock(q.Qwen3MoeSparseMoeBlock):
        pass

    m = tiny_model("qwen3_moe")
    for layer in m.model.layers:
        old = layer.mlp
        layer.mlp = MyBlock(m.config)
        layer.mlp.load_state_dict(old.state_dict())
    m = m.to(torch.bfloat16)
    ids = prompt()
    ref = logits_of(m, ids)
    calls = []

    def repack(experts):
        calls.append(1)
        return experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()

    hf.register_adapter(hf.MoEAdapter("my_block", ("MyBlock",), renormalize=lambda b, r: True,
                                      repack=repack))
    try:
        with hf.patch_moe(m, registry=reg) as handle:
            assert handle.families == ["my_block"]       # the subclass's adapter wins
            assert len(calls) == LAYERS
            assert handle.repacked_bytes == LAYERS * 3 * E * I * H * 2
            assert_logits_close(logits_of(m, ids), ref, "repacked")
            assert len(calls) == LAYERS                  # once, at patch time
        assert handle.repacked_bytes == 0
    finally:
        hf.ADAPTERS.pop("my_block")


# ------------------------------------------------------------------------------ GPU
@pytest.fixture(scope="module")
def greg():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    r = FactorRegistry.load(ROOT / "factors")
    assert r.hardware.live
    return r


def served_on_gpu(stats_before, stats_after):
    for name in ("topk_softmax", "moe_fused_gemm"):
        a, b = stats_before.get(name, {}), stats_after[name]
        gpu = sum(b.get(k, 0) - a.get(k, 0) for k in ("plugin", "kernel_fallback"))
        assert gpu > 0, (name, b)
        assert b.get("python_fallback", 0) == a.get("python_fallback", 0), (name, b)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_patched_model_logits_and_greedy_tokens(greg, family):
    m = tiny_model(family, device="cuda")
    ids = prompt("cuda")
    with torch.no_grad():
        ref = m.generate(ids, max_new_tokens=16, do_sample=False)
    ref_logits = logits_of(m, ref)
    before = {k: dict(v) for k, v in greg.stats().items()}
    params = {n: p.data_ptr() for n, p in m.named_parameters()}
    with hf.patch_moe(m, registry=greg) as handle:
        got_logits = logits_of(m, ref)                   # teacher-forced on the stock tokens
        with torch.no_grad():
            got = m.generate(ids, max_new_tokens=16, do_sample=False)
        served_on_gpu(before, handle.stats())
    assert {n: p.data_ptr() for n, p in m.named_parameters()} == params
    err = assert_logits_close(got_logits, ref_logits, family)
    check_greedy(ref_logits[0, 7:], ref[0, 8:].tolist(), got[0, 8:].tolist(), 4 * err + 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_decode_step_captured_in_a_cuda_graph(greg, family):
    """One decode step of the patched model (attention, StaticCache update, router and experts
    through the plugins) captured once and replayed: same tokens and logits as eager steps."""
    m = tiny_model(family, device="cuda")
    ids = prompt("cuda")
    runs = {}
    with hf.patch_moe(m, registry=greg):
        for graph in (False, True):
            d = hf.StaticDecoder(m, batch_size=1, max_len=40, graph=graph)
            logits = d.prefill(ids)
            toks, rows = [], []
            for _ in range(16):
                rows.append(logits[0].float())           # the logits that choose this token
                t = logits.argmax(-1)
                toks.append(int(t))
                logits = d.step(t)
            runs[graph] = (toks, torch.stack(rows))
            if graph:
                assert d.graph is not None
    (toks_g, rows_g), (toks_e, rows_e) = runs[True], runs[False]
    if toks_g == toks_e:        # same kernels, same inputs: the logits agree (bitwise if deterministic)
        assert_logits_close(rows_g, rows_e, "graph vs eager")
    else:
        check_greedy(rows_e, toks_e, toks_g, 1e-2)


@pytest.mark.gpu
def test_gpu_patch_warms_up_so_capture_needs_no_allocation(greg):
    """After patch_moe (warm-up at 1 token), a bare router+experts call of 1 token captures."""
    m = tiny_model("qwen3_moe", device="cuda", seed=3)
    mlp = m.model.layers[0].mlp
    x = torch.randn(1, 1, H, device="cuda", dtype=torch.bfloat16)
    a = torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    (a @ a).sum().item()                             # cuBLAS initialised outside capture
    with hf.patch_moe(m, registry=greg), torch.no_grad():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):                    # no eager call of the block before
            out = mlp(x)
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), mlp(x).float(), rtol=1e-2, atol=1e-3)


def test_adapter_families_and_warmup_arguments_are_checked(reg):
    m = tiny_model("qwen3_moe")
    with pytest.raises(hf.UnsupportedModelError, match=r"families: \['x'\] not registered"):
        hf.patch_moe(m, registry=reg, families="qwen3_moe,x")
    assert len(hf.find_moe_blocks(m, "qwen3_moe")) == LAYERS           # a string: one name, not a substring
    with pytest.raises(ValueError, match="block_classes: expected a tuple of class names"):
        hf.register_adapter(hf.MoEAdapter("strs", "Qwen3MoeSparseMoeBlock", renormalize=lambda b, r: True))
    with pytest.raises(ValueError, match="warmup: tokens: expected an iterable of ints >= 1"):
        hf.patch_moe(m, registry=reg, warmup_tokens=5)
    assert not any(hasattr(mod, hf._MARK) for mod in m.modules())     # undone


@pytest.mark.parametrize("family", FAMILIES)
def test_training_only_the_experts_through_a_patched_model(reg, family):
    """Router frozen, experts trainable (fine-tuning the experts): the router runs the factor,
    the experts the stock forward, which gets the stock router's types (int64 ids: it crashed in
    one_hot on int32); every gradient equals the unpatched model's."""
    m = tiny_model(family)
    for n, p in m.named_parameters():
        p.requires_grad = "experts" in n
    ids = prompt()
    m(ids).logits.float().sum().backward()
    want = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert want and all("experts" in n for n in want)
    m.zero_grad()
    with hf.patch_moe(m, registry=reg):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")           # the grad-mode note
            m(ids).logits.float().sum().backward()
    got = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=2e-2, atol=1e-3, msg=n)


def test_static_decoder_checks_input_ids_and_capture_mode(reg):
    """prefill(float ids) reached torch's embedding (RuntimeError), a 1-D prompt failed to
    unpack, a list raised AttributeError, as did step([1]); a bogus capture_error_mode was kept."""
    from ex_engine.errors import ArgumentError
    m = tiny_model("qwen3_moe")
    d = hf.StaticDecoder(m, batch_size=1, max_len=16)
    ids = torch.zeros(1, 3, dtype=torch.long)
    cases = [(ids.float(), r"'input_ids': dtype: expected integer token ids.*got torch.float32"),
             (ids.bool(), r"'input_ids': dtype: .*got torch.bool"),
             (ids[0], r"'input_ids': shape: expected 2-D \(batch, seq\), got \(3,\)"),
             ([[1, 2]], r"'input_ids': type: expected a torch integer tensor.*got list"),
             (torch.zeros(1, 0, dtype=torch.long), r"'input_ids': shape \(batch_size, P\)"),
             (torch.zeros(1, 16, dtype=torch.long), r"'input_ids': shape \(batch_size, P\)")]
    for bad, msg in cases:
        with pytest.raises(ArgumentError, match=r"^StaticDecoder.prefill: argument " + msg):
            d.prefill(bad)
    d.prefill(ids)
    with pytest.raises(ArgumentError, match=r"^StaticDecoder.step: argument 'tokens': type: .*got list"):
        d.step([1])
    with pytest.raises(ArgumentError, match=r"StaticDecoder: argument 'capture_error_mode'.*'relaxed'.*got 'bogus'"):
        hf.StaticDecoder(m, capture_error_mode="bogus")
    assert hf.StaticDecoder(m, capture_error_mode="relaxed").capture_error_mode == "relaxed"


def test_families_and_adapters_are_checked_when_given(reg):
    from ex_engine.errors import ArgumentError
    m = tiny_model("qwen3_moe")
    with pytest.raises(ArgumentError, match=r"^find_moe_blocks: argument 'families': type: .*int 5"):
        hf.find_moe_blocks(m, families=5)
    with pytest.raises(ArgumentError, match=r"^patch_moe: argument 'families': type: .*int 5"):
        hf.patch_moe(m, registry=reg, families=5)
    with pytest.raises(ArgumentError, match=r"argument 'families'"):
        hf.find_moe_blocks(m, families=["qwen3_moe", 3])
    assert len(hf.find_moe_blocks(m, families=("qwen3_moe",))) == LAYERS
    for kw, msg in (({"renormalize": True}, r"'adapter.renormalize': type: expected a callable.*bool True"),
                    ({"renormalize": lambda b, r: True, "weights": None}, r"'adapter.weights'"),
                    ({"renormalize": lambda b, r: True, "repack": 3}, r"'adapter.repack'"),
                    ({"renormalize": lambda b, r: True, "router_attr": ""}, r"'adapter.router_attr'")):
        with pytest.raises(ArgumentError, match=r"^register_adapter: argument " + msg):
            hf.register_adapter(hf.MoEAdapter("xx", ("Foo",), **kw))
    assert "xx" not in hf.ADAPTERS
    with pytest.raises(ArgumentError, match=r"^register_adapter: argument 'adapter'"):
        hf.register_adapter("qwen3_moe")

"""Hugging Face transformers MoE models served through ex_engine's factors.

    from ex_engine.integrations.transformers import patch_moe
    handle = patch_moe(model)          # routers -> topk_softmax, routed experts -> moe_fused_gemm
    out = model.generate(...)          # or model(...), or a CUDA-graph decode loop (StaticDecoder)
    print(handle.stats())              # which path served each factor
    handle.undo()                      # stock forwards back; also: ``with patch_moe(model): ...``

What is patched. transformers 5.x (read against 5.17.0) keeps the routed experts of Qwen3-MoE,
OLMoE and Mixtral in one module with fused 3-D parameters, ``experts.gate_up_proj`` (E, 2I, H)
whose rows 0..I-1 are the gate and rows I..2I-1 the up projection (the stock forward does
``linear(x, gate_up_proj[e]).chunk(2, dim=-1)``) and ``experts.down_proj`` (E, H, I). That is
exactly ex_engine's w13 / w2 layout, so the factor receives the parameters themselves: no copy,
no repack. In every sparse-MoE block of a supported family, the router module (``block.gate``)
and the experts module (``block.experts``) get an instance-level ``forward``; the block's own
forward (reshape of (batch, seq, H) to a (T, H) view, Mixtral's training-only jitter),
attention, norms and the LM head stay stock, and so do forward hooks and the router-logit
recording (the patched router still returns ``(router_logits, weights, ids)``).

Router semantics kept per family (stock code of 5.17):
  Qwen3-MoE  logits = h @ W^T (model dtype); p = softmax(logits) in fp32; top-k of p; divided by
             their sum if ``config.norm_topk_prob`` (True in Qwen3-30B-A3B's config, False by the
             config class's default); the weights are then cast to the logits' dtype.
  OLMoE      the same code; ``norm_topk_prob`` is False for OLMoE-1B-7B (no renormalisation).
  Mixtral    softmax over all E in fp32, top-k, always renormalised (== softmax over the top-k
             logits), weights kept in fp32.
ex_engine's topk_softmax computes the same thing (fp32 softmax of the logits, top-k, optional
renormalisation); where the stock router casts the weights to the logits' dtype, the patched one
rounds them the same way. One difference: when two router logits are exactly equal at the top-k
boundary, ex_engine takes the lower expert index; ``torch.topk`` leaves the choice unspecified
(the CPU kernel often takes another one).

The experts: moe_fused_gemm accumulates in fp32 and rounds silu(g)*u to the model dtype between
the GEMMs; the stock eager loop rounds each expert's contribution to the model dtype and sums them
in that dtype, so outputs differ by bf16 rounding (not by more). Inference only: the factors
have no backward, so under grad mode with tensors that require grad (training) the patched
forwards hand the call to the stock ones, with a warning once per module class.

CUDA graphs. Nothing in the patched forwards synchronises, reads a device value on the host, or
allocates outside torch's allocator (outputs come from ``torch.empty``); the factors run on
torch's current stream. The one exception is the first call of a shape: the registry allocates
the factor's workspace (CuPy) then. ``patch_moe`` therefore runs both factors once per block
shape at ``warmup_tokens`` (default: 1 token, a decode step of batch 1) on CUDA models, so a
decode step can be captured right away; before capturing a step of T > 1 tokens call
``handle.warmup(tokens=(T,))`` (or run that step once eagerly, as torch's own capture recipe
does). ``StaticDecoder`` below is a decode loop with a StaticCache that captures one step.

Adding a model family: if its experts module uses the fused (E, 2I, H) / (E, H, I) layout with
SiLU gating (transformers' ``@use_experts_implementation`` with the defaults) and its router is a
module returning ``(logits, weights, ids)`` with softmax-then-top-k semantics, one
``register_adapter(MoEAdapter(family=..., block_classes=(...,), renormalize=..., weights_dtype=...))``
is enough. A layout no view can express (interleaved gate/up, transposed experts) takes a
``repack`` function: it runs once at patch time and undo() frees the copies. None of the three
supported families needs one; gpt-oss (interleaved, transposed, with biases and a clamped SwiGLU)
is not expressible by moe_fused_gemm at all. Qwen2-MoE / DeepSeek (shared experts, grouped
top-k) are not supported.
"""
from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Callable

try:
    import torch
    import torch.nn.functional as F
except ImportError as _exc:   # say what to install instead of a bare "No module named 'torch'"
    raise ImportError("ex_engine.integrations.transformers needs PyTorch and transformers: "
                      "pip install -e '.[hf]'") from _exc

from ..errors import ArgumentError, FactorError
from ..ops import moe_fused_gemm, resolve_registry, topk_softmax
from ..registry import FactorRegistry

__all__ = ["MoEAdapter", "MoEPatch", "StaticDecoder", "UnsupportedModelError", "ADAPTERS",
           "register_adapter", "patch_moe", "find_moe_blocks"]

_MARK = "_ex_engine_moe_patch"
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


class UnsupportedModelError(FactorError, ValueError):
    """The model (or one of its MoE blocks) cannot be served by ex_engine's factors; the message
    names the block and what did not fit. A FactorError, as every ex_engine error is, and a
    ValueError (what it was before it was a FactorError)."""


def _stock_weights(experts):
    return experts.gate_up_proj, experts.down_proj


@dataclass(frozen=True)
class MoEAdapter:
    """How the sparse-MoE block of one model family maps onto ex_engine's factors.

    family: a short name ('qwen3_moe').
    block_classes: class names of the family's sparse-MoE block (matched along the MRO, so
        subclasses count).
    renormalize(block, router) -> bool: whether the top-k weights are divided by their sum.
    weights_dtype: 'logits' when the stock router casts the top-k weights to the logits' dtype
        before the experts use them (Qwen3-MoE, OLMoE); 'float32' when it keeps fp32 (Mixtral).
    router_attr, experts_attr: the block's attributes holding the router and the experts.
    weights(experts) -> (w13 (E, 2I, H), w2 (E, H, I)): views of the experts' parameters in
        ex_engine's layout (gate rows first), read on every call, so a model moved with .to()
        after patching stays correct.
    repack(experts) -> (w13, w2): for a layout no view can express; called once at patch time
        instead of ``weights``, the copies are kept by the handle and freed by undo().
    """
    family: str
    block_classes: tuple
    renormalize: Callable
    weights_dtype: str = "logits"
    router_attr: str = "gate"
    experts_attr: str = "experts"
    weights: Callable = _stock_weights
    repack: Callable | None = None


ADAPTERS: dict = {}


def register_adapter(adapter: MoEAdapter) -> MoEAdapter:
    """Make ``patch_moe`` recognise ``adapter.block_classes`` (replaces an adapter of the same
    family). Raises ValueError for a weights_dtype other than 'logits' or 'float32', or
    block_classes that is not a tuple of class names (a bare string would match by substring);
    ArgumentError (a ValueError and a FactorError) for an adapter that is not a MoEAdapter, a
    family or router_attr/experts_attr that is not a non-empty str, a renormalize or weights
    that is not callable, or a repack that is neither None nor callable (each would fail only
    when a model is patched)."""
    fn = "register_adapter"
    if not isinstance(adapter, MoEAdapter):
        raise ArgumentError(fn, "adapter", "type", "a MoEAdapter", type(adapter).__name__)
    for name in ("family", "router_attr", "experts_attr"):
        v = getattr(adapter, name)
        if not isinstance(v, str) or not v:
            raise ArgumentError(fn, f"adapter.{name}", "type", "a non-empty str", repr(v))
    for name in ("renormalize", "weights"):
        v = getattr(adapter, name)
        if not callable(v):
            raise ArgumentError(fn, f"adapter.{name}", "type", "a callable", f"{type(v).__name__} {v!r}")
    if adapter.repack is not None and not callable(adapter.repack):
        raise ArgumentError(fn, "adapter.repack", "type", "None or a callable",
                            f"{type(adapter.repack).__name__} {adapter.repack!r}")
    if not isinstance(adapter.block_classes, tuple) or not all(isinstance(c, str) for c in adapter.block_classes):
        raise ValueError(f"MoEAdapter {adapter.family}: block_classes: expected a tuple of class names, "
                         f"got {adapter.block_classes!r}")
    if adapter.weights_dtype not in ("logits", "float32"):
        raise ValueError(f"MoEAdapter {adapter.family}: weights_dtype: expected 'logits' or 'float32', "
                         f"got {adapter.weights_dtype!r}")
    ADAPTERS[adapter.family] = adapter
    return adapter


register_adapter(MoEAdapter("qwen3_moe", ("Qwen3MoeSparseMoeBlock",),
                            renormalize=lambda block, router: bool(router.norm_topk_prob),
                            weights_dtype="logits"))
register_adapter(MoEAdapter("olmoe", ("OlmoeSparseMoeBlock",),
                            renormalize=lambda block, router: bool(router.norm_topk_prob),
                            weights_dtype="logits"))
register_adapter(MoEAdapter("mixtral", ("MixtralSparseMoeBlock",),
                            renormalize=lambda block, router: True,
                            weights_dtype="float32"))


def _adapter_for(module, families=None):
    """The adapter of the most derived class of ``module`` that one names (so an adapter for a
    subclass wins over its parent's)."""
    for cls in type(module).__mro__:
        for a in ADAPTERS.values():
            if (families is None or a.family in families) and cls.__name__ in a.block_classes:
                return a
    return None


def _families(fn: str, families):
    """None, or the list of family names ``families`` gives (a str: comma-separated names).
    Raises ArgumentError naming ``fn`` for anything that is not a str or an iterable of str."""
    if families is None:
        return None
    if isinstance(families, str):      # 'qwen3_moe,x' would match by substring
        return [f.strip() for f in families.split(",")]
    try:
        out = list(families)
    except TypeError:
        out = None
    if out is None or not all(isinstance(f, str) for f in out):
        raise ArgumentError(fn, "families", "type", "None, a family name (comma-separated names) "
                            "or an iterable of family names (str)", f"{type(families).__name__} {families!r}")
    return out


def find_moe_blocks(model, families=None) -> list:
    """[(qualified name, block, adapter)] for every sparse-MoE block of a registered family.
    families: None (all registered), a str of comma-separated family names, or an iterable of
    names. Raises ArgumentError for another type, UnsupportedModelError for a name not
    registered."""
    out = []
    families = _families("find_moe_blocks", families)
    if families is not None:
        unknown = sorted(set(families) - set(ADAPTERS))
        if unknown:
            raise UnsupportedModelError(f"families: {unknown} not registered; expected some of "
                                        f"{sorted(ADAPTERS)} (see register_adapter)")
    for name, mod in model.named_modules():
        a = _adapter_for(mod, families)
        if a is not None:
            out.append((name, mod, a))
    return out


@dataclass
class _Block:
    """One patched block: its modules, dims and what undo() must put back."""
    name: str
    family: str
    router: object
    experts: object
    E: int
    H: int
    I: int
    K: int
    renormalize: bool
    round_weights: bool
    repacked: tuple | None = None


def _check_block(name, block, a: MoEAdapter) -> _Block:
    """Everything the factors need from one block, or UnsupportedModelError saying what differs."""
    def fail(msg):
        raise UnsupportedModelError(f"{name} ({type(block).__name__}, family {a.family}): {msg}")

    router = getattr(block, a.router_attr, None)
    experts = getattr(block, a.experts_attr, None)
    if router is None or experts is None:
        fail(f"expected submodules '{a.router_attr}' and '{a.experts_attr}'")
    for mod, what in ((router, "router"), (experts, "experts")):
        if "forward" in vars(mod):
            ours = hasattr(mod, _MARK)   # advice for what it is: a second patch, or a hook
            fail(f"the {what} module already has an instance-level forward "
                 f"({'patched by ex_engine' if ours else 'e.g. an accelerate hook'}); "
                 + ("patch each model once (undo() its handle to patch it again)" if ours else
                    "patch a model that is fully on one device, without accelerate's hooks"))
    W = getattr(router, "weight", None)
    K = getattr(router, "top_k", None)
    if not isinstance(W, torch.Tensor) or W.dim() != 2 or K is None:
        fail("expected a router module with 'weight' (E, H) and 'top_k' (transformers >= 5.0; "
             "4.x kept per-expert nn.Linear layers, which would need a repack adapter)")
    if getattr(router, "bias", None) is not None:
        fail("router bias is not supported")
    if getattr(experts, "has_bias", False) or not getattr(experts, "has_gate", True):
        fail("experts with biases or without a gate are not supported by moe_fused_gemm")
    act = getattr(getattr(experts, "config", None), "hidden_act", "silu")
    if act not in ("silu", "swish"):
        fail(f"hidden_act: expected 'silu', got {act!r} (moe_fused_gemm computes silu(gate) * up)")
    repacked = None
    if a.repack is not None:
        w13, w2 = repacked = tuple(t.contiguous() for t in a.repack(experts))
    else:
        if getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True):
            fail("experts stored transposed or with gate/up interleaved: register an adapter with "
                 "a repack function")
        try:
            w13, w2 = a.weights(experts)
        except AttributeError as exc:
            fail(f"expected fused expert weights gate_up_proj (E, 2I, H) and down_proj (E, H, I): {exc}")
    if w13.dim() != 3 or w2.dim() != 3:
        fail(f"expected 3-D expert weights, got w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    E, two_i, H = w13.shape
    I = two_i // 2
    if two_i % 2 or tuple(w2.shape) != (E, H, I):
        fail(f"expected w13 (E, 2I, H) and w2 (E, H, I), got {tuple(w13.shape)} and {tuple(w2.shape)}")
    if tuple(W.shape) != (E, H):
        fail(f"router weight: expected ({E}, {H}), got {tuple(W.shape)}")
    if not 1 <= int(K) <= E:
        fail(f"top_k: expected 1..{E}, got {K}")
    if w13.dtype not in _SUPPORTED_DTYPES or w2.dtype != w13.dtype:
        fail(f"expert weights: expected float16 or bfloat16 (both the same), got {w13.dtype} and "
             f"{w2.dtype}; load the model in bf16/fp16")
    if not (w13.is_contiguous() and w2.is_contiguous()):
        fail("expert weights are not contiguous (a view with strides): register a repack adapter")
    if not (w13.device == w2.device == W.device):
        fail(f"router and experts on different devices ({W.device}, {w13.device}, {w2.device})")
    return _Block(name, a.family, router, experts, E, H, I, int(K),
                  bool(a.renormalize(block, router)), a.weights_dtype == "logits", repacked)


_GRAD_WARNED: set = set()


def _needs_grad(module, *tensors) -> bool:
    """True under grad mode when an input or a parameter of ``module`` requires grad: the
    factors have no backward, so the patched forward hands the call to the stock one (with a
    warning once per module class), and training through a patched model stays correct."""
    if not torch.is_grad_enabled():
        return False
    if not (any(t.requires_grad for t in tensors) or any(p.requires_grad for p in module.parameters())):
        return False
    key = type(module).__name__
    if key not in _GRAD_WARNED:
        _GRAD_WARNED.add(key)
        warnings.warn(f"ex_engine.patch_moe: {key} called under grad mode with tensors that require "
                      "grad: the stock forward runs there (ex_engine's factors have no backward); "
                      "use torch.no_grad() or torch.inference_mode() for the factors", stacklevel=3)
    return True


def _router_forward(b: _Block, reg: FactorRegistry):
    router, K, renorm, round_w = b.router, b.K, b.renormalize, b.round_weights
    stock = type(router).forward

    def forward(hidden_states):
        if _needs_grad(router, hidden_states):
            return stock(router, hidden_states)
        h = hidden_states.reshape(-1, router.weight.shape[-1])
        logits = F.linear(h, router.weight)                         # (T, E), model dtype
        w, ids = topk_softmax(logits, K, renorm, registry=reg)      # fp32 (T, K), int32 (T, K)
        if round_w and logits.dtype != torch.float32:
            w = w.to(logits.dtype).float()      # the stock router hands the experts rounded weights
        return logits, w, ids
    return forward


def _experts_forward(b: _Block, adapter: MoEAdapter, reg: FactorRegistry):
    experts = b.experts
    if b.repacked is not None:
        fixed = b.repacked

        def weights():
            return fixed
    else:
        def weights():
            return adapter.weights(experts)

    stock = type(experts).forward

    def forward(hidden_states, top_k_index, top_k_weights):
        if _needs_grad(experts, hidden_states, top_k_weights):
            # the router may have run the factor (frozen, input without grad): the stock experts
            # want the stock router's types, int64 ids and (where it casts them) weights of the
            # model's dtype; no-ops after a stock router
            tw = top_k_weights.to(hidden_states.dtype) if b.round_weights else top_k_weights
            return stock(experts, hidden_states, top_k_index.long(), tw)
        w13, w2 = weights()
        if w13.dtype not in (torch.float16, torch.bfloat16):
            # the model was cast after patching (model.float()): name the block and the remedy,
            # not moe_fused_gemm's internal argument
            raise UnsupportedModelError(
                f"{b.name}: its experts' weights are {str(w13.dtype).replace('torch.', '')} now (the model was "
                f"cast after patch_moe); expected float16 or bfloat16, which moe_fused_gemm takes: undo() the "
                f"patch before casting the model, or cast it back")
        x = hidden_states if hidden_states.dtype == w13.dtype else hidden_states.to(w13.dtype)
        x = x.contiguous()                                          # no-op for the stock (T, H) view
        if top_k_index.dtype == torch.int32:
            ids = top_k_index
        else:
            # a stock router's int64 ids: clamped to -1..E before narrowing, so that an id out of
            # range stays out of range (flagged by check_device_errors) instead of wrapping
            # modulo 2^32 onto a valid expert
            ids = top_k_index.clamp(-1, w13.shape[0]).to(torch.int32)
        tw = top_k_weights if top_k_weights.dtype == torch.float32 else top_k_weights.float()
        out = moe_fused_gemm(x, w13, w2, tw.contiguous(), ids.contiguous(), registry=reg)
        return out if out.dtype == hidden_states.dtype else out.to(hidden_states.dtype)
    return forward


class MoEPatch:
    """What ``patch_moe`` did to a model; ``undo()`` (or leaving the ``with`` block) reverts it.

    blocks: qualified names of the patched MoE blocks.  families: the adapter families used.
    registry: the FactorRegistry the patched forwards call.  repacked_bytes: bytes of weight
    copies made at patch time (0 for Qwen3-MoE, OLMoE, Mixtral: they are served from views).
    """

    def __init__(self, model, registry: FactorRegistry, records: list, notes: list):
        self.model = model
        self.registry = registry
        self._records = records
        self.notes = notes
        self.active = True

    @property
    def blocks(self) -> list:
        return [r.name for r in self._records]

    @property
    def families(self) -> list:
        return sorted({r.family for r in self._records})

    @property
    def repacked_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for r in self._records if r.repacked for t in r.repacked)

    def shapes(self) -> list:
        """Distinct (E, H, I, K, renormalize, dtype, device) of the patched blocks."""
        seen = []
        for r in self._records:
            w13, _ = r.repacked or (r.experts.gate_up_proj, None)
            key = (r.E, r.H, r.I, r.K, r.renormalize, w13.dtype, w13.device)
            if key not in seen:
                seen.append(key)
        return seen

    def warmup(self, tokens=(1,)) -> None:
        """Run topk_softmax and moe_fused_gemm once per block shape and token count in ``tokens``
        on zeros, on the current stream, then synchronise: the registry allocates each factor's
        workspace now (CuPy), so later calls can be captured in a CUDA graph. The workspace is
        sized by the largest T; capturing more tokens than warmed up fails with a FactorError
        that says so. No-op for CPU models. tokens: an iterable of ints >= 1. Raises
        RuntimeError when called during capture, ValueError for tokens that are not ints >= 1."""
        given = tokens
        try:
            tokens = tuple(tokens)          # once: a generator would be used up by the check
        except TypeError:
            tokens = None
        if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 1
                                     for t in tokens):
            raise ValueError(f"MoEPatch.warmup: tokens: expected an iterable of ints >= 1 (e.g. (1, 64)), "
                             f"got {given!r}")
        devices = set()
        for r in self._records:
            w13, w2 = r.repacked or (r.experts.gate_up_proj, r.experts.down_proj)
            if w13.device.type != "cuda":
                continue
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("MoEPatch.warmup: called during CUDA-graph capture; warm up before capturing")
            devices.add(w13.device)
        if not devices:
            return
        done = set()
        with torch.no_grad():
            for r in self._records:
                w13, w2 = r.repacked or (r.experts.gate_up_proj, r.experts.down_proj)
                for T in sorted(set(int(t) for t in tokens)):
                    key = (r.E, r.H, r.I, r.K, r.renormalize, w13.dtype, w13.device, T)
                    if key in done or w13.device.type != "cuda":
                        continue
                    done.add(key)
                    logits = torch.zeros(T, r.E, dtype=w13.dtype, device=w13.device)
                    w, ids = topk_softmax(logits, r.K, r.renormalize, registry=self.registry)
                    x = torch.zeros(T, r.H, dtype=w13.dtype, device=w13.device)
                    moe_fused_gemm(x, w13, w2, w, ids, registry=self.registry)
        for d in devices:
            torch.cuda.synchronize(d)

    def stats(self) -> dict:
        """The registry's path counters for the two factors (plugin / kernel_fallback /
        python_fallback / errors). Graph replays do not go through the registry and are not counted."""
        s = self.registry.stats()
        return {k: s.get(k, {}) for k in ("topk_softmax", "moe_fused_gemm")}

    def undo(self) -> None:
        """Put the stock forwards back and drop repacked copies (idempotent). Parameters were
        never touched: they are the same tensors, at the same addresses, as before patching.
        Not while a forward runs in another thread: a block whose router ran patched before the
        undo hands the stock experts int32 ids, which they refuse (torch's one_hot: 'only
        applicable to index tensor of type LongTensor')."""
        if not self.active:
            return
        for r in self._records:
            for mod in (r.router, r.experts):
                vars(mod).pop("forward", None)
                if hasattr(mod, _MARK):
                    delattr(mod, _MARK)
            r.repacked = None
        self.active = False

    def __enter__(self) -> "MoEPatch":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        return (f"MoEPatch({state}, {len(self._records)} blocks, families={self.families}, "
                f"repacked_bytes={self.repacked_bytes})")


def patch_moe(model, registry: FactorRegistry | None = None, *, families=None,
              warmup_tokens=(1,)) -> MoEPatch:
    """Serve every sparse-MoE block of ``model`` through ex_engine: the router through
    topk_softmax, the routed experts through moe_fused_gemm, on the model's own parameters.

    registry: the FactorRegistry to call (None: ex_engine's process-wide default, loaded now).
    families: restrict to these adapter families (default: all registered: qwen3_moe, olmoe, mixtral):
        a str of comma-separated names or an iterable of names (ArgumentError otherwise).
    warmup_tokens: token counts to warm the factors up with on CUDA models (see MoEPatch.warmup);
        () or None to skip.
    Returns a MoEPatch (``undo()``, context manager). Raises UnsupportedModelError if the model
    has no supported MoE block or a block does not fit (all blocks are checked before any is
    patched).
    """
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedModelError(f"model: expected a torch.nn.Module (a transformers model), "
                                    f"got {type(model).__name__}")
    blocks = find_moe_blocks(model, _families("patch_moe", families))
    if not blocks:
        known = sorted(c for a in ADAPTERS.values() for c in a.block_classes)
        raise UnsupportedModelError(f"{type(model).__name__}: no sparse-MoE block of a supported family "
                                    f"found (known blocks: {known}); see register_adapter")
    records = [(_check_block(name, blk, a), a) for name, blk, a in blocks]
    reg = resolve_registry(registry)
    notes = []
    devs = {(r.repacked[0] if r.repacked else r.experts.gate_up_proj).device for r, _ in records}
    for d in devs:
        if d.type == "cuda":
            hw = reg.hardware
            if not hw.live:
                notes.append(f"{d}: the registry sees no live GPU ({reg.no_gpu_note or hw.source}); "
                             "calls will take the Python fallbacks (CuPy)")
            elif (d.index or 0) != hw.device_id:
                raise UnsupportedModelError(f"model on {d}, registry for cuda:{hw.device_id}: load the "
                                            "registry on the model's device")
        elif d.type != "cpu":
            raise UnsupportedModelError(f"model on {d}: expected a CUDA device or the CPU")
    for n in notes:
        warnings.warn("ex_engine.patch_moe: " + n, stacklevel=2)
    for r, a in records:
        r.router.forward = _router_forward(r, reg)
        r.experts.forward = _experts_forward(r, a, reg)
        setattr(r.router, _MARK, True)
        setattr(r.experts, _MARK, True)
    handle = MoEPatch(model, reg, [r for r, _ in records], notes)
    if warmup_tokens:
        try:
            handle.warmup(warmup_tokens)
        except BaseException:
            handle.undo()
            raise
    return handle


CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")   # torch.cuda.graph's capture_error_mode


def _token_ids(fn: str, name: str, x, ndim: int, shape_text: str):
    """Raise ArgumentError unless ``x`` is a torch integer tensor (not bool) of ``ndim`` dims."""
    if not isinstance(x, torch.Tensor):
        raise ArgumentError(fn, name, "type", f"a torch integer tensor {shape_text}",
                            f"{type(x).__name__}")
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise ArgumentError(fn, name, "dtype", f"integer token ids {shape_text} (e.g. torch.long)",
                            str(x.dtype))
    if x.dim() != ndim:
        raise ArgumentError(fn, name, "shape", f"{ndim}-D {shape_text}", tuple(x.shape))


class StaticDecoder:
    """Greedy decoding of a transformers causal LM with a StaticCache, one token per ``step``,
    eagerly or (``graph=True``) by replaying one captured CUDA graph of the whole decode step.

    The step reads its inputs from static tensors (token ids, position), computes the 4-D
    attention mask from the position inside the step (so transformers' mask builder is skipped),
    and the StaticCache writes at its own device-side counter: nothing in the step depends on a
    host value, so one graph serves every step. The first graph step runs eagerly on a side
    stream (warm-up: cuBLAS, ex_engine workspaces) and is captured after it.

    model: a causal LM (patched or not) on one device, sdpa or eager attention.
    batch_size, max_len: the static shapes, ints >= 1 (prompt + generated tokens <= max_len).
    Raises ValueError for batch_size or max_len < 1, an attention implementation other than sdpa
    or eager, or graph=True on a model that is not on a CUDA device; prefill and step raise
    ValueError for input ids of another batch size (or a prompt of max_len or more), float ids,
    and a step past max_len. capture_error_mode: torch.cuda.graph's, one of 'global',
    'thread_local', 'relaxed'. The argument errors are ArgumentError (a ValueError and an
    ex_engine FactorError) naming the method and the argument.
    """

    def __init__(self, model, batch_size: int = 1, max_len: int = 256, graph: bool = False,
                 capture_error_mode: str = "global"):
        from transformers import StaticCache
        for name, v in (("batch_size", batch_size), ("max_len", max_len)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"StaticDecoder: {name}: expected an int >= 1, got {v!r}")
        p = next(model.parameters())
        self.model, self.device, self.dtype = model, p.device, p.dtype
        self.batch_size, self.max_len = batch_size, max_len
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        # the cache's keyword: `cache` where forward takes it (transformers renamed it; 5.24 warns
        # that past_key_values goes in 5.40), else past_key_values (5.0 ..)
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.ids = torch.zeros(batch_size, 1, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(batch_size, 1, dtype=torch.long, device=self.device)
        self.kv = torch.arange(max_len, device=self.device).view(1, 1, 1, max_len)
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise ArgumentError("StaticDecoder", "capture_error_mode", "torch.cuda.graph's modes",
                                f"one of {', '.join(map(repr, CAPTURE_ERROR_MODES))}", repr(capture_error_mode))
        impl = getattr(model.config, "_attn_implementation", "sdpa")
        if impl not in ("sdpa", "eager"):
            raise ValueError(f"StaticDecoder: attention implementation {impl!r}: expected 'sdpa' or 'eager'")
        self.float_mask = impl == "eager"
        self.use_graph = graph
        if graph and self.device.type != "cuda":
            raise ValueError("StaticDecoder(graph=True) needs a CUDA model")
        self.capture_error_mode = capture_error_mode
        self.graph = None
        self.out = None
        self.next_pos = 0

    def _mask(self):
        m = self.kv <= self.pos.view(-1, 1, 1, 1)            # (B, 1, 1, L): slots 0..pos
        if self.float_mask:
            m = torch.zeros(m.shape, dtype=self.dtype, device=self.device).masked_fill_(
                ~m, torch.finfo(self.dtype).min)
        return m

    def _forward(self):
        out = self.model(input_ids=self.ids, position_ids=self.pos, attention_mask=self._mask(),
                         use_cache=True, **{self._cache_kw: self.cache})
        return out.logits[:, -1, :]

    @torch.no_grad()
    def prefill(self, input_ids):
        """Run the prompt (B, P) eagerly into the cache; returns the last position's logits (B, V).
        input_ids: a torch integer tensor (B, P), B = batch_size, 1 <= P < max_len. Raises
        ArgumentError (a ValueError) naming input_ids otherwise (a list, float or bool ids, 1-D)."""
        _token_ids("StaticDecoder.prefill", "input_ids", input_ids, 2, "(batch, seq)")
        B, P = input_ids.shape
        if B != self.batch_size or not 1 <= P < self.max_len:
            raise ArgumentError("StaticDecoder.prefill", "input_ids", "shape (batch_size, P), 1 <= P < max_len",
                                f"({self.batch_size}, 1 .. {self.max_len - 1})", tuple(input_ids.shape))
        pos = torch.arange(P, device=self.device).unsqueeze(0).expand(B, P)
        out = self.model(input_ids=input_ids.to(self.device), position_ids=pos,
                         use_cache=True, **{self._cache_kw: self.cache})
        self.next_pos = P
        return out.logits[:, -1, :]

    @torch.no_grad()
    def step(self, tokens):
        """Feed ``tokens`` (B,) at the next position; returns that position's logits (B, V) (a copy).
        tokens: a torch integer tensor (not bool, as prefill) of batch_size ids (ArgumentError, a
        ValueError, naming tokens otherwise); ValueError past max_len."""
        want = f"a torch integer tensor of {self.batch_size} token ids"
        if not isinstance(tokens, torch.Tensor):
            raise ArgumentError("StaticDecoder.step", "tokens", "type", want, type(tokens).__name__)
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise ArgumentError("StaticDecoder.step", "tokens", "dtype",
                                "integer token ids (e.g. torch.long)", str(tokens.dtype))
        if tokens.numel() != self.batch_size:
            raise ArgumentError("StaticDecoder.step", "tokens", "shape", f"{self.batch_size} token ids "
                                f"(batch_size)", tuple(tokens.shape))
        if self.next_pos >= self.max_len:
            raise ValueError(f"step: the static cache holds {self.max_len} positions, all used")
        self.ids.copy_(tokens.view(-1, 1))
        self.pos.fill_(self.next_pos)
        if not self.use_graph:
            logits = self._forward()
        elif self.graph is None:
            logits = self._capture()
        else:
            self.graph.replay()
            logits = self.out.clone()
        self.next_pos += 1
        return logits

    def _capture(self):
        cur = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            logits = self._forward()       # this step, for real: warms up everything it calls
        cur.wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode=self.capture_error_mode):
            self.out = self._forward()     # recorded, not run: the cache counter is not advanced
        self.graph = g
        return logits

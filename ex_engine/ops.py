"""Typed functions, one per built-in factor: what an inference engine calls every step.

Each accepts NumPy arrays, CuPy arrays or torch tensors (zero-copy; device arrays run on the
caller's current stream), validates them against the factor's manifest and runs the chosen
plugin, falling back to Python when no plugin takes the call. ``registry=None`` uses a
process-wide registry loaded lazily from factors/ on first use.
"""
from __future__ import annotations

import functools
import operator
import sys
import threading
from contextlib import contextmanager

from ._fork import renew_after_fork
from .arrays import _KINDS, _NP_NAMES, Bits16, TensorRef, _cupy_importable, _kind_of, data_ptr, no_cupy_error
from .errors import ArgumentError, DeviceError, DTypeError, FactorError, ShapeError
from .registry import FactorRegistry

_default: FactorRegistry | None = None
_default_lock = threading.Lock()


renew_after_fork(sys.modules[__name__], "_default_lock")   # (a fresh lock in a forked child)


def default_registry() -> FactorRegistry:
    """The process-wide registry: FactorRegistry.load() of factors/, created on first use.
    Raises FactorError where that load does (factors/ not a directory, e.g. an installed
    package without a checkout; a visible GPU whose properties no hardware profile can hold);
    nothing is kept then, so the next call tries again."""
    global _default
    with _default_lock:
        if _default is None:
            _default = FactorRegistry.load()
        return _default


def resolve_registry(registry) -> FactorRegistry:
    """``registry`` itself, or the process-wide one for None. Raises FactorError for anything
    else (a string, say, that would fail later as an AttributeError deep in a call)."""
    if registry is None:
        return default_registry()
    if not isinstance(registry, FactorRegistry):
        raise FactorError(f"registry: expected a FactorRegistry or None, got {type(registry).__name__} "
                          f"{registry!r:.80}")
    return registry


def set_default_registry(registry: FactorRegistry | None) -> None:
    """Replace the process-wide registry (None: load again on next use). Raises FactorError
    for anything else (a string was accepted, and every later call failed on it)."""
    global _default
    if registry is not None and not isinstance(registry, FactorRegistry):
        raise FactorError(f"registry: expected a FactorRegistry or None, got {type(registry).__name__} "
                          f"{registry!r:.80}")
    with _default_lock:
        _default = registry


@contextmanager
def _counted_refusal(reg: FactorRegistry, name: str):
    """Count a FactorError that an op raises before it calls dispatch (an argument it checks
    itself) in ``reg.stats()[name]['errors']``, as dispatch counts the arguments it refuses."""
    try:
        yield
    except FactorError:
        reg._count(name, "errors")
        raise


def _empty(ref: TensorRef, shape, dtype: str, factor: str, name: str, reg: FactorRegistry | None = None,
           expected: str = "a numeric dtype in native byte order"):
    """An uninitialised array of ``shape``/``dtype`` from the same library and device as ``ref``
    (argument ``name`` of ``factor``). Raises DeviceError for a device array where CuPy cannot
    be imported (no_cupy_error; counted in ``reg``'s errors, as dispatch counts a refusal) or
    cannot use the device (CuPy's CUDARuntimeError, e.g. a CuPy for another CUDA than the
    driver's; counted likewise), and
    DTypeError (counted likewise) for a dtype no array can be made of, e.g. float16 in
    non-native byte order or a structured dtype (the argument's own dtype, which dispatch would
    have refused by name: np.empty's TypeError named neither)."""
    like = ref.obj
    if ref.kind == "torch":
        import torch
        return like.new_empty(shape, dtype=getattr(torch, dtype))   # its device (host time: no kwargs)
    problem = None
    if dtype not in _NP_NAMES:   # (the names np.empty takes)
        problem = DTypeError(factor, name, "dtype", expected, dtype)
    elif ref.on_device and not _cupy_importable():
        problem = no_cupy_error(factor, name, like)
    if problem is not None:
        if reg is not None:
            reg._count(factor, "errors")
        raise problem
    if ref.on_device:
        import cupy
        try:
            with cupy.cuda.Device(ref.device):
                if dtype == "bfloat16" and isinstance(like, Bits16):
                    return Bits16(cupy.empty(shape, dtype=cupy.uint16), "bfloat16")
                return cupy.empty(shape, dtype=_np_dtype(dtype))
        except MemoryError:   # (CuPy's OutOfMemoryError: says what it needed)
            raise
        except Exception as exc:
            if not type(exc).__module__.startswith("cupy"):
                raise
            # CuPy imports but cannot use the device: a CuPy built for another CUDA than the
            # driver's (cudaErrorInsufficientDriver), no driver, a device gone; its bare
            # CUDARuntimeError named neither the factor nor the argument (a user's trial, session 59)
            if reg is not None:
                reg._count(factor, "errors")
            raise DeviceError(factor, name, "device", "a CUDA device that CuPy can use, to allocate the "
                              "outputs of an array in device memory (a CuPy built for this driver's CUDA: "
                              "cupy-cuda13x, or cupy-cuda12x for CUDA 12)",
                              f"a {type(like).__name__} on device {ref.device}, and CuPy failed: "
                              f"{type(exc).__name__}: {exc}") from exc
    if dtype == "bfloat16" and isinstance(like, Bits16):
        import numpy as np
        return Bits16(np.empty(shape, dtype=np.uint16), "bfloat16")
    import numpy as np
    return np.empty(shape, dtype=_np_dtype(dtype))


def _refuse_before_allocating(reg: FactorRegistry, name: str, ref: TensorRef, arrays: dict, params=None) -> None:
    """Raise what dispatch would raise for a call whose input ``ref`` (router_logits,
    hidden_states: its shape sizes the outputs the op allocates) is not C-contiguous, before
    anything is allocated: a broadcast view (0 strides) of a shape too large to hold made NumPy
    or torch raise its own MemoryError / RuntimeError ('Unable to allocate 11.6 TiB') instead of
    the LayoutError naming the argument. ``arrays``: dispatch's arrays, each output still to be
    allocated a TensorRef without memory (_no_memory). Counted in ``reg``'s errors, as
    dispatch counts a refusal (not a FactorNotFoundError, from a registry without the factor:
    dispatch counts none). Called only for a non-contiguous input (host time: a contiguous
    input, an engine's every call, builds nothing); an empty one needs no check."""
    if ref.size == 0:
        return
    m = reg.manifest(name)   # (outside the count: a FactorNotFoundError names no factor to count)
    with _counted_refusal(reg, name):
        m.bind(reg._describe(name, m, arrays, params), params, reg._tuned_value(m))


def _no_memory(ref: TensorRef, shape, dtype: str, itemsize: int) -> TensorRef:
    """An output of ``shape``/``dtype`` not allocated yet, on ``ref``'s device and library, as
    _refuse_before_allocating binds it (TensorRef.without_memory)."""
    return TensorRef.without_memory(ref.kind, shape, dtype, itemsize, ref.device)


def _float32_of(arr):
    """The float32 dtype of ``arr``'s library (torch.float32 or numpy's, which CuPy takes)."""
    if _is_torch(arr):
        import torch
        return torch.float32
    import numpy as np
    return np.float32


def _np_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return dtype


def _is_torch(a) -> bool:
    """Whether ``a`` is a torch tensor (its type's kind, cached in _KINDS)."""
    return (_KINDS.get(type(a)) or _kind_of(a)) == "torch"


def _torch_write_suspect(a) -> bool:
    """Whether ``a`` is a torch tensor that _refuse_torch_writes must look at: it requires grad,
    or it is an inference tensor while inference mode is off (inside inference mode, where an
    engine serving under torch.inference_mode() makes every call, nothing is refused: two
    attribute reads and one mode query, on the hot path of every call)."""
    return _is_torch(a) and (
        a.requires_grad or (a.is_inference() and not sys.modules["torch"].is_inference_mode_enabled()))


def _refuse_torch_writes(fn: str, written: dict) -> None:
    """Raise ArgumentError naming the first of ``written`` (torch tensors written in place by
    ``fn``) that torch's own in-place ops refuse:
    - an inference tensor (made under torch.inference_mode()) outside inference mode: torch
      raises 'Inplace update to inference tensor outside InferenceMode';
    - while grad mode is on, any tensor that requires grad: a leaf or a view of one (x =
      leaf[:, :H], a row-strided view this op takes), which would change behind autograd (torch
      refuses in-place ops there too), and a non-leaf (an activation): ``fn`` records no
      autograd graph, so the tensor would keep its old grad_fn and a backward pass through it
      would return the gradient of the values it held before the call, silently wrong."""
    torch = sys.modules["torch"]
    for name, a in written.items():
        if a.is_inference() and not torch.is_inference_mode_enabled():
            raise ArgumentError(fn, name, "inference mode", "a tensor it may write in place (an "
                                "inference tensor only inside torch.inference_mode(), as torch's "
                                "in-place ops require; else pass a clone)",
                                "an inference tensor outside inference mode")
    if not torch.is_grad_enabled():
        return
    for name, a in written.items():
        if not getattr(a, "requires_grad", False):
            continue
        base = None if a.is_leaf else a._base
        raise ArgumentError(fn, name, "autograd", "a tensor it may write in place (none that requires "
                            "grad while grad mode is on: the write is recorded in no autograd graph; "
                            "call under torch.no_grad() or torch.inference_mode(), or pass .detach())",
                            "a leaf tensor with requires_grad=True" if a.is_leaf else
                            "a view of a leaf tensor with requires_grad=True"
                            if base is not None and base.is_leaf and base.requires_grad else
                            "a non-leaf tensor with requires_grad=True (its grad_fn would stay that "
                            "of its old values)")


_EAGER: dict = {}   # op -> torch.compiler.disable(op), made on first use under torch.compile
_PROBES: tuple = (None, None, None)   # (torch module, its is_compiling, its _get_tracing_state)


def _tracer() -> str | None:
    """'compile' while torch.compile (TorchDynamo) traces the caller, 'trace' under
    torch.jit.trace, else None (torch not imported, or eager: two cheap calls per op)."""
    global _PROBES
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if _PROBES[0] is not torch:   # found once per torch module (either may be missing: torch < 2.3)
        _PROBES = (torch, getattr(getattr(torch, "compiler", None), "is_compiling", None),
                   getattr(getattr(torch, "_C", None), "_get_tracing_state", None))
    _, is_compiling, tracing_state = _PROBES
    if is_compiling is not None and is_compiling():
        return "compile"
    return "trace" if tracing_state is not None and tracing_state() is not None else None


def _untraced(mode: str, op):
    """What an op runs under a tracer (``mode`` from _tracer): under torch.compile, its body
    ``op`` (the function _eager_under_tracers decorates: calling the decorated op would ask
    _tracer again, and recurse where is_compiling() stays true when it runs, as in
    torch.export's non-strict tracing, whose FakeTensors the body then refuses by name) wrapped
    in torch.compiler.disable, so that TorchDynamo breaks the graph there and runs it eagerly on
    real tensors (it had traced the Python fallback's NumPy code into the graph, which failed
    for bfloat16 with an error about uint32 fake tensors); under torch.jit.trace, a
    FactorError: the factors run outside torch's operators, so a trace records only the
    allocation of their outputs and its replay returns them unwritten (or, for fused_add_rmsnorm,
    leaves x and residual as they were), a silently wrong result."""
    if mode == "trace":
        raise FactorError(f"{op.__name__}: cannot be recorded by torch.jit.trace (the factor runs "
                          "outside torch's operators: the trace would replay without it and return "
                          "unwritten outputs); trace the model without ex_engine (MoEPatch.undo() "
                          "first), or use torch.compile, which runs the factor eagerly at a graph break")
    fn = _EAGER.get(op)
    if fn is None:
        fn = _EAGER[op] = sys.modules["torch"].compiler.disable(op)
    return fn


def _eager_under_tracers(op):
    """The op ``op`` as it is called: ``op`` itself where no tracer runs (_tracer() is None),
    else what _untraced gives for the tracer (a graph break under torch.compile, a FactorError
    under torch.jit.trace). Keeps op's name, docstring and signature (functools.wraps)."""
    @functools.wraps(op)
    def call(*args, **kwargs):
        mode = _tracer()
        if mode is None:
            return op(*args, **kwargs)
        return _untraced(mode, op)(*args, **kwargs)
    return call


@_eager_under_tracers
def topk_softmax(router_logits, top_k: int, renormalize: bool = False, *, topk_weights=None,
                 topk_ids=None, registry: FactorRegistry | None = None):
    """Router: softmax over the E experts of each token, then its top-k.

    p = softmax(router_logits[t]) in fp32 (stable: max subtracted); topk_ids[t] = the top_k
    experts by logit, ties to the lowest index, distinct; topk_weights[t,k] = p of that
    expert, divided by the sum over k when ``renormalize``. A NaN logit ranks as -inf (below
    every number; among -inf and NaN logits the lower index ranks first), so the ids stay valid
    experts, and its row's K weights are all NaN (a corrupted router shows in the layer's
    output, as in torch's softmax, instead of passing as a finite routing); +inf logits share
    probability 1; a row whose logits are all -inf is uniform (p = 1/E, ids 0..K-1). (Source:
    vLLM csrc/moe/topk_softmax_kernels.cu; Shazeer et al. 2017.)
    An inference op: no autograd graph is recorded (torch outputs do not require grad, and no
    gradient flows back to router_logits).

    router_logits: (T, E) float32, float16 or bfloat16, contiguous.
    top_k: K, 1 <= K <= E.  renormalize: bool.
    topk_weights, topk_ids: optional outputs (T, K) float32 / int32; allocated if None.
    Returns (topk_weights, topk_ids). Raises ArgumentError (top_k not an int >= 1, renormalize
    not a bool or 0/1), DTypeError (also: an argument that is no array),
    ShapeError (K > E, naming top_k; an output given whose width is not top_k, naming that
    output), LayoutError (also: an output sharing memory with router_logits or with the other
    output, or marked read-only; a sparse, mkldnn or nested torch tensor), DeviceError, KernelError,
    ArgumentError (an output given that is a torch tensor requiring grad (a leaf, a view of one
    or a non-leaf) under grad mode; or an inference tensor outside torch.inference_mode()).
    Each names topk_softmax and the argument. A torch output given is written in place: its
    version counter is bumped, as torch's in-place ops do.
    Under torch.compile it runs eagerly at a graph break; under torch.jit.trace it raises
    FactorError (a trace would not record it).
    """
    reg = resolve_registry(registry)
    with _counted_refusal(reg, "topk_softmax"):
        try:
            if isinstance(top_k, bool):
                raise TypeError
            top_k = operator.index(top_k)
        except TypeError:
            raise ArgumentError("topk_softmax", "top_k", "type", "an int >= 1", repr(top_k)) from None
        if top_k < 1:
            raise ArgumentError("topk_softmax", "top_k", "value", "an int >= 1", top_k)
        # outputs given: described once here, checked against top_k, and handed to dispatch as refs
        given = {name: TensorRef.of(arr, name, "topk_softmax")
                 for name, arr in (("topk_weights", topk_weights), ("topk_ids", topk_ids)) if arr is not None}
        suspects = {name: r.obj for name, r in given.items() if _torch_write_suspect(r.obj)}
        if suspects:
            _refuse_torch_writes("topk_softmax", suspects)
        for name, r in given.items():
            if len(r.shape) == 2 and r.shape[1] != top_k:
                raise ShapeError("topk_softmax", name, "shape[1] = K", f"top_k = {top_k} columns",
                                 f"{r.shape[1]} (its shape {tuple(r.shape)})")
        ref = TensorRef.of(router_logits, "router_logits", "topk_softmax")
        if len(ref.shape) == 2 and ref.shape[1] == 0:
            raise ShapeError("topk_softmax", "router_logits", "shape[1] = E", "E >= 1 experts",
                             f"0 (its shape {tuple(ref.shape)})")
        if len(ref.shape) == 2 and top_k > ref.shape[1]:
            raise ShapeError("topk_softmax", "top_k", "K <= E", f"at most E = {ref.shape[1]} (router_logits' "
                             f"width)", top_k)
    T = ref.shape[0] if len(ref.shape) == 2 else 0
    w_arg, ids_arg = given.get("topk_weights"), given.get("topk_ids")
    if (w_arg is None or ids_arg is None) and not ref.is_contiguous():   # (host time: tested first)
        _refuse_before_allocating(reg, "topk_softmax", ref, {
            "router_logits": router_logits,
            "topk_weights": _no_memory(ref, (T, top_k), "float32", 4) if w_arg is None else w_arg,
            "topk_ids": _no_memory(ref, (T, top_k), "int32", 4) if ids_arg is None else ids_arg},
            {"renormalize": renormalize})
    if topk_weights is None and topk_ids is None:
        # one allocation for both outputs (host time per call): ids in [0], weights in [1];
        # described here as what they are (C-contiguous (T, K), 4-byte elements, one base
        # address) instead of being read back from the arrays; dispatch validates them as usual
        both = _empty(ref, (2, T, top_k), "int32", "topk_softmax", "router_logits", reg)
        topk_ids = both[0]
        topk_weights = both[1].view(_float32_of(both))
        base, kind = data_ptr(both), "cupy" if ref.kind == "cai" else ref.kind
        ids_arg = TensorRef(topk_ids, kind, base, (T, top_k), (top_k, 1), "int32", 4, ref.device, True)
        w_arg = TensorRef(topk_weights, kind, base + 4 * T * top_k, (T, top_k), (top_k, 1), "float32", 4,
                          ref.device, True)
    if topk_weights is None:
        topk_weights = _empty(ref, (T, top_k), "float32", "topk_softmax", "router_logits", reg)
    if topk_ids is None:
        topk_ids = _empty(ref, (T, top_k), "int32", "topk_softmax", "router_logits", reg)
    reg.dispatch(
        "topk_softmax", {"router_logits": ref, "topk_weights": w_arg or topk_weights,
                         "topk_ids": ids_arg or topk_ids}, {"renormalize": renormalize})
    return topk_weights, topk_ids


@_eager_under_tracers
def fused_add_rmsnorm(x, residual, weight, eps: float = 1e-6, *,
                      registry: FactorRegistry | None = None):
    """In place: residual += x; x = residual * rsqrt(mean(residual**2) + eps) * weight.

    fp32 inside; the normalised value uses residual as rounded to its dtype (as vLLM's
    fused_add_rms_norm). (Source: Zhang & Sennrich 2019, "Root Mean Square Layer
    Normalization"; vLLM csrc/layernorm_kernels.cu.)
    An inference op: the in-place writes are recorded in no autograd graph (no gradient flows
    through it). A torch tensor that requires grad (a leaf, a view of one, or a non-leaf, whose
    grad_fn would stay that of its old values) is refused as x or residual while grad mode is on
    (torch.is_grad_enabled()); call it under torch.no_grad() / torch.inference_mode(). Their
    version counters are bumped (as torch's in-place ops do), so a backward pass through a graph
    that saved x or residual before this call raises instead of using the new values.

    x, residual: (T, H), the same dtype (float16, bfloat16 or float32); rows may be views into
    wider buffers (unit stride along H). weight: (H,) same dtype. eps: a float > 0 that rounds
    to a normal float32 (from ~1.18e-38 to ~3.4e38: 1e-60 would be 0 in float32 and is
    refused).
    Range: the sum of squares is fp32 (as vLLM's kernel); a row whose values are finite but
    overflow it (|values| past ~1.8e19 / sqrt(H), in float32 or bfloat16) is normalised by the
    same formula on the row divided by its largest magnitude, not returned as zeros. A row
    holding an inf or NaN gives IEEE's result (NaN where inf * 0 arises).
    Returns (x, residual), both written in place. Raises DTypeError, ShapeError (a T or H of
    residual or weight that differs from x's names that argument: x's sizes are the reference),
    LayoutError (also: x and residual, or either and weight, sharing memory; views of one wider
    buffer that share no byte are fine; x or residual marked read-only; a sparse, mkldnn or
    nested torch tensor), ArgumentError (eps not a finite number > 0 or not a normal float32;
    x or residual a torch tensor that requires grad under grad mode, or an inference tensor outside
    torch.inference_mode()), DeviceError, KernelError.
    Each names fused_add_rmsnorm and the argument.
    """
    reg = resolve_registry(registry)
    if _torch_write_suspect(x) or _torch_write_suspect(residual):
        with _counted_refusal(reg, "fused_add_rmsnorm"):
            _refuse_torch_writes("fused_add_rmsnorm", {name: a for name, a in (("x", x), ("residual", residual))
                                                       if _is_torch(a)})
    reg.dispatch(
        "fused_add_rmsnorm", {"x": x, "residual": residual, "weight": weight}, {"eps": eps})
    return x, residual


@_eager_under_tracers
def moe_fused_gemm(hidden_states, w13, w2, topk_weights, topk_ids, *, router_logits=None,
                   expert_map=None, out=None, registry: FactorRegistry | None = None):
    """Routed experts of an MoE layer.

    out[t] = sum_k topk_weights[t,k] * w2[e] @ (silu(g) * u), [g; u] = w13[e] @ hidden_states[t],
    e = topk_ids[t,k]; rows 0..I-1 of w13[e] are the gate g, rows I..2I-1 the up projection u.
    fp32 accumulation; silu(g)*u rounded to the input dtype between the GEMMs. A slot whose id
    is outside [0, G) contributes nothing and is reported by
    ``registry.check_device_errors()``. topk_weights are not checked: a NaN or inf weight
    propagates into its token's out row (NaN/inf there), as in the reference math.
    (Source: Shazeer et al. 2017; vLLM fused_moe.)
    An inference op: no autograd graph is recorded (a torch out does not require grad, and no
    gradient flows back to the inputs or the weights).

    Expert parallelism: with ``expert_map`` (G,) int32, topk_ids are global ids in [0, G) and
    w13/w2 hold only this rank's E local experts; e = expert_map[id] in [0, E), or -1 for an
    expert on another rank, whose slots contribute nothing and cost no GEMM work. out is
    written for every token (zero where no slot is local), so the sum over ranks whose maps
    partition the experts is the full layer (see ex_engine.distributed). Without a map G = E.
    (Source: vLLM FusedMoE expert_map; Lepikhin et al. 2020, GShard.)

    hidden_states: (T, H) float16 or bfloat16.  w13: (E, 2I, H), w2: (E, H, I), same dtype.
    topk_weights: (T, K) float32.  topk_ids: (T, K) int32, 1 <= K <= G.  expert_map: optional
    (G,) int32, values in [-1, E).  router_logits: optional (T, G) float32, float16 or
    bfloat16, unused by the computation (part of the ABI).  out: optional, of hidden_states'
    shape (T, H) and dtype, its own memory (no overlap with another argument), writable;
    allocated like hidden_states if None.
    All contiguous, on one device (or all on the host: Python fallback).
    Range: silu(g)*u and out are rounded to the input dtype, so in float16 an activation beyond
    65504 becomes inf (NaN downstream) and values below ~6e-5 lose digits (subnormals): inputs
    must be scaled as a model's are (activations O(1)); bfloat16 has float32's range.
    Returns out. Raises DTypeError (also: an argument that is no array), ShapeError,
    LayoutError (also: out sharing memory with another argument, e.g. out=hidden_states, or
    marked read-only; a sparse, mkldnn or nested torch tensor), DeviceError, KernelError,
    ArgumentError (out a torch tensor requiring grad under grad mode, or an
    inference tensor outside torch.inference_mode()); each names
    moe_fused_gemm and the argument. A torch out given is written in place: its version counter is
    bumped, as torch's in-place ops do.
    """
    reg = resolve_registry(registry)
    if out is not None and _torch_write_suspect(out):
        with _counted_refusal(reg, "moe_fused_gemm"):
            _refuse_torch_writes("moe_fused_gemm", {"out": out})
    if out is None:
        try:   # host time: a contiguous torch tensor needs no description
            fast = _KINDS.get(type(hidden_states)) == "torch" and hidden_states.is_contiguous()
        except RuntimeError:   # a sparse CSR/CSC/BSR/BSC tensor has no is_contiguous: refused by name below
            fast = False
        if fast:
            out = hidden_states.new_empty(hidden_states.shape)
        else:
            with _counted_refusal(reg, "moe_fused_gemm"):
                ref = TensorRef.of(hidden_states, "hidden_states", "moe_fused_gemm")
            if not ref.is_contiguous():   # (host time: tested before the arguments are built)
                _refuse_before_allocating(reg, "moe_fused_gemm", ref, {
                    "hidden_states": hidden_states, "out": _no_memory(ref, ref.shape, ref.dtype, ref.itemsize),
                    "router_logits": router_logits, "w13": w13, "w2": w2, "topk_weights": topk_weights,
                    "topk_ids": topk_ids, "expert_map": expert_map})
            out = _empty(ref, ref.shape, ref.dtype, "moe_fused_gemm", "hidden_states", reg,
                         expected="float16 or bfloat16")
    reg.dispatch(
        "moe_fused_gemm", {"hidden_states": hidden_states, "out": out, "router_logits": router_logits,
                           "w13": w13, "w2": w2, "topk_weights": topk_weights,
                           "topk_ids": topk_ids, "expert_map": expert_map})
    return out

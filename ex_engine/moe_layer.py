"""A real MoE layer (router + routed experts) at a public model's shapes, run through ex_engine.

This is the main job behind ``ex-engine run moe``: it builds the layer with random weights at
the model's scale (N(0, 0.02), as benchmarks/bench_moe.py draws them), routes with
topk_softmax, runs the experts with moe_fused_gemm, and checks both against references (the router against the
fallback's float32 semantics, the experts against float64).
"""
from __future__ import annotations

import functools
import os
import time
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from . import _paths, _yaml
from ._scripts import MAX_TOKENS, output_file_problem, plugin_folder_problem, report_problems  # noqa: F401 (the scripts' import)
from .arrays import Bits16, TensorRef, bf16_bits_to_f32, f32_to_bf16_bits
from .errors import ArgumentError, DTypeError, FactorError, ShapeError, is_integer, one_line
from .fallbacks import moe_fused_gemm_math, topk_softmax_math
from .manifest import bool_like
from .ops import moe_fused_gemm, resolve_registry, topk_softmax
from .verify import ROW_SLACK, row_error


@dataclass(frozen=True)
class MoEShape:
    """Routed-expert shape of one model: hidden H, per-expert intermediate I, E experts, top-K."""
    model: str
    H: int
    I: int
    E: int
    K: int
    renormalize: bool


MODEL_DIMS = ("H", "I", "E", "K")
MODEL_FIELDS = MODEL_DIMS + ("renormalize",)   # renormalize is optional (default false)
MODELS_FILE_KEYS = ("models", "token_counts")  # token_counts is optional


def _positive_int(v) -> bool:
    """An int >= 1, and not a bool (YAML's true is an int to Python)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _check_models(data) -> None:
    """Raise ValueError naming the model and field that break moe_models.yaml's rules: a mapping
    with a non-empty 'models' mapping (name -> {H, I, E, K: integers >= 1, K <= E, renormalize:
    true or false}) and an optional 'token_counts' list of integers >= 1; no other keys."""
    if not isinstance(data, dict):
        raise ValueError("expected a mapping with a 'models' key, got "
                         + ("an empty file" if data is None else f"a {type(data).__name__}"))
    extra = sorted(map(str, set(data) - set(MODELS_FILE_KEYS)))
    if extra:
        raise ValueError(f"unknown key(s) {extra}; expected {list(MODELS_FILE_KEYS)}")
    if "models" not in data:
        raise ValueError("models: missing; expected a mapping of model name -> {H, I, E, K, renormalize}")
    models = data["models"]
    if not isinstance(models, dict) or not models:
        raise ValueError("models: expected at least one model (name -> {H, I, E, K, renormalize}), "
                         f"got {models!r}")
    for name, m in models.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"models: model name {name!r}: expected a non-empty string")
        if name == "all":   # `run moe --model all`, the tools' `--models all`: every model
            raise ValueError("models: model name 'all': expected another name ('all' stands for every "
                             "model in `ex-engine run moe --model all` and the tools' --models all)")
        where = f"model '{name}'"
        if not isinstance(m, dict):
            raise ValueError(f"{where}: expected a mapping {{H, I, E, K, renormalize}}, got {m!r}")
        extra = sorted(map(str, set(m) - set(MODEL_FIELDS)))
        if extra:
            raise ValueError(f"{where}: unknown field(s) {extra}; expected {list(MODEL_FIELDS)}")
        for f in MODEL_DIMS:
            if f not in m:
                raise ValueError(f"{where}: {f}: missing; expected an integer >= 1")
            if not _positive_int(m[f]):
                raise ValueError(f"{where}: {f}: expected an integer >= 1, got {m[f]!r}")
        if m["K"] > m["E"]:
            raise ValueError(f"{where}: K: expected at most E = {m['E']} (experts per token out of "
                             f"E experts), got {m['K']}")
        if "renormalize" in m and not isinstance(m["renormalize"], bool):
            raise ValueError(f"{where}: renormalize: expected true or false, got {m['renormalize']!r}")
    if "token_counts" in data:
        tc = data["token_counts"]
        if not isinstance(tc, list) or not tc or not all(_positive_int(t) for t in tc):
            raise ValueError(f"token_counts: expected a non-empty list of integers >= 1, got {tc!r}")


def load_models(path=None) -> dict:
    """model name -> MoEShape, from manifests/moe_models.yaml (copied from shared/).
    Raises FactorError naming the file (and the model and field) if it cannot be read or breaks
    a rule: a non-empty ``models`` mapping, H, I, E, K integers >= 1 with K <= E, renormalize
    true or false (default false), an optional ``token_counts`` list of integers >= 1.
    path: None (the default file), a str or an os.PathLike; anything else (an int would be
    opened as a file descriptor) or an empty str (not the default file: None is) raises
    ArgumentError."""
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise ArgumentError("load_models", "path", "type", "None, a str or an os.PathLike",
                            f"{type(path).__name__} {path!r}")
    if isinstance(path, str) and not path:
        raise ArgumentError("load_models", "path", "a file", "None (the default file) or a non-empty path",
                            repr(path))
    default = path is None
    env = _paths.env_value("EX_ENGINE_MANIFESTS") if default else ""
    if env:
        # none of the variable's folders there: say that first (FactorError), as the registry
        # does, rather than that moe_models.yaml inside it cannot be opened
        _paths.usable_folders(env, "EX_ENGINE_MANIFESTS")
    path = _paths.manifests_dir() / "moe_models.yaml" if default else path
    try:
        data = _yaml.load(_paths.read_small(path).decode(), name=path)   # (a FIFO: refused, not waited on)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        hint = _paths.not_a_checkout() if default and isinstance(exc, FileNotFoundError) else ""
        what = ("missing" if isinstance(exc, FileNotFoundError) else "unreadable" if isinstance(exc, OSError)
                else "malformed")   # (a missing file read 'malformed or unreadable': session 39's trial)
        raise FactorError(f"model list {path}: {what} "
                          f"({type(exc).__name__}: {one_line(exc)})" + (f"; {hint}" if hint else "")) from None
    try:
        _check_models(data)
    except ValueError as exc:
        raise FactorError(f"model list {path}: {exc}") from None
    return {name: MoEShape(name, m["H"], m["I"], m["E"], m["K"], m.get("renormalize", False))
            for name, m in data["models"].items()}


def case_problems(models: dict, names, tokens, factors=None, all_ok: bool = False) -> list:
    """What is wrong with a benchmark tool's --models / --tokens / --factors (strings; [] if
    nothing): models not in ``models`` (``all_ok``: 'all' is a choice too, standing alone: 'all'
    beside names is refused, not read as a model called 'all'), T < 1 or above MAX_TOKENS (the
    CLI's bound), a plugin folder that does not exist (or ''). Checked before any work, so a
    mistake loses no measurement."""
    choices = (["all"] if all_ok else []) + sorted(models)
    out = []
    if all_ok and "all" in names:
        if len(names) > 1:
            out.append(f"--models: 'all' (every model) stands alone; give it or model names, not both, "
                       f"got {' '.join(names)}")
        names = [m for m in names if m != "all"]
    out += [f"--models: {m!r} is not one of {', '.join(choices)}" for m in names if m not in models]
    if not tokens:
        out.append("--tokens: expected at least one T")
    elif min(tokens) < 1 or max(tokens) > MAX_TOKENS:
        out.append(f"--tokens: expected T from 1 to {MAX_TOKENS}, got {' '.join(map(str, tokens))}")
    folder = plugin_folder_problem("--factors", factors) if factors is not None else ""
    if folder:
        out.append(folder)
    return out


def parse_cases(models: dict, cases, skewed_ok: bool = False) -> tuple:
    """([(model, T)], problems) of a benchmark tool's --cases, 'model:T' strings: one problem per
    case that names no model of ``models`` or no T from 1 to MAX_TOKENS, every one listed (not the
    first alone), each quoting the case as given. With ``skewed_ok`` a case may also end in
    ':skewed' (benchmarks/bench_moe.py's skewed routing: a few hot experts take most tokens), and
    the list holds (model, T, skewed) triples."""
    form = "model:T or model:T:skewed" if skewed_ok else "model:T"
    out, problems = [], []
    for c in cases:
        skewed = skewed_ok and c.endswith(":skewed")
        m, _, t = (c[: -len(":skewed")] if skewed else c).partition(":")
        if m not in models or not (t.isascii() and t.isdecimal()) or not 1 <= int(t) <= MAX_TOKENS:
            problems.append(f"case {c!r}: expected {form} with T from 1 to {MAX_TOKENS} and a model of "
                            f"moe_models.yaml ({', '.join(sorted(models))})")
        else:
            out.append((m, int(t), skewed) if skewed_ok else (m, int(t)))
    return out, problems


def models_help(all_ok: bool = False) -> str:
    """The model names of manifests/moe_models.yaml for a --help text ('all, ' first with
    ``all_ok``), or, where the list cannot be read, why (--help answers all the same)."""
    try:
        names = sorted(load_models())
    except FactorError as exc:
        return f"none readable: {exc}"
    return ", ".join((["all"] if all_ok else []) + names)


def load_models_or_exit(tool: str) -> dict:
    """load_models() for a script: a model list it cannot use is '<tool>: <why>' on stderr and
    exit status 2 (SystemExit), not a traceback."""
    try:
        return load_models()
    except FactorError as exc:
        report_problems(tool, [str(exc)])
        raise SystemExit(2) from None


def models_tokens_json_or_exit(tool: str, models, tokens, json_path) -> tuple:
    """(model name -> MoEShape of every model, [the chosen names]) for a script's --models ('all'
    standing alone: every model, sorted), --tokens and --json, checked before any GPU work, whose
    figures would otherwise be lost: every problem '<tool>: <why>' on stderr and exit status 2
    (SystemExit), as load_models_or_exit and case_problems."""
    shapes = load_models_or_exit(tool)
    problems = case_problems(shapes, models, tokens, all_ok=True) + [output_file_problem("--json", json_path, (".json",))]
    if report_problems(tool, problems):
        raise SystemExit(2)
    return shapes, sorted(shapes) if list(models) == ["all"] else list(models)


def model_shape(name: str) -> MoEShape:
    """The MoEShape of ``name``. Raises FactorError listing the known models."""
    models = load_models()
    if not isinstance(name, str) or name not in models:   # a list is no key (unhashable)
        raise FactorError(f"model {name!r}: unknown; expected one of {sorted(models)}")
    return models[name]


RANDOM_DTYPES = ("bfloat16", "float16", "float32")
LAYER_DTYPES = ("bfloat16", "float16")


def random_array(xp, rng, shape, dtype: str, std: float = 1.0):
    """N(0, std^2) values of ``dtype`` on NumPy or CuPy; bfloat16 comes as a Bits16.

    Drawn one leading slice at a time (one expert of a weight tensor), so the float32
    temporaries stay small. dtype: 'bfloat16', 'float16' or 'float32' (RANDOM_DTYPES); any
    other value raises DTypeError (an integer dtype would hold truncated draws, float64 would
    not be N(0, 1) draws of float64 precision)."""
    if not isinstance(dtype, str) or dtype not in RANDOM_DTYPES:
        raise DTypeError("random_array", "dtype", "a dtype name", " or ".join(map(repr, RANDOM_DTYPES)),
                         repr(dtype))
    out = xp.empty(shape, dtype=xp.uint16 if dtype == "bfloat16" else dtype)
    for i in range(shape[0] if len(shape) == 3 else 1):
        dst = out[i] if len(shape) == 3 else out
        v = rng.standard_normal(dst.shape, dtype=xp.float32) * xp.float32(std)
        dst[...] = f32_to_bf16_bits(xp, v) if dtype == "bfloat16" else v
    return Bits16(out, "bfloat16") if dtype == "bfloat16" else out


def _check_int(fn: str, name: str, v, lo: int) -> None:
    """Raise ArgumentError unless ``v`` is an int (not a bool; NumPy integers count) >= lo."""
    if not is_integer(v) or v < lo:
        raise ArgumentError(fn, name, "an integer", f"an int >= {lo}", repr(v))


class MoELayer:
    """Router weight (E, H) fp32, w13 (E, 2I, H) and w2 (E, H, I) of ``dtype`` on NumPy or CuPy
    (xp), drawn N(0, 0.02^2) from ``seed`` (as benchmarks/bench_moe.py draws its weights).
    bfloat16 arrays come as Bits16.
    shape: an MoEShape (model_shape(name)) with H, I, E, K ints >= 1, K <= E, renormalize a
    bool (or 0/1); dtype: 'bfloat16' or 'float16'; xp: the module numpy or cupy; seed: an
    int >= 0. Raises ArgumentError (DTypeError for dtype) naming the argument otherwise, before
    any array is drawn."""

    def __init__(self, shape: MoEShape, dtype: str = "bfloat16", xp=np, seed: int = 0):
        fn = "MoELayer"
        if not isinstance(shape, MoEShape):
            raise ArgumentError(fn, "shape", "type", "an MoEShape (model_shape(name))",
                                type(shape).__name__)
        for f in MODEL_DIMS:
            _check_int(fn, f"shape.{f}", getattr(shape, f), 1)
        if shape.K > shape.E:
            raise ArgumentError(fn, "shape.K", "K <= E", f"at most E = {shape.E}", shape.K)
        if not bool_like(shape.renormalize):
            # (checked here, before the weights are drawn: forward raised it later, after building
            # them, as topk_softmax's argument 'renormalize', an argument the caller never gave)
            raise ArgumentError(fn, "shape.renormalize", "type", "a bool (or 0/1)", repr(shape.renormalize))
        if not isinstance(dtype, str) or dtype not in LAYER_DTYPES:
            raise DTypeError(fn, "dtype", "the weights' dtype", "'bfloat16' or 'float16'", repr(dtype))
        if xp is not np and getattr(xp, "__name__", None) != "cupy":
            # (torch failed as "module 'torch.random' has no attribute 'default_rng'", a string
            # as "'str' object has no attribute 'random'")
            raise ArgumentError(fn, "xp", "array module", "the module numpy or cupy",
                                f"the module {xp.__name__}" if isinstance(xp, types.ModuleType) else
                                f"{type(xp).__name__} {xp!r:.80}")
        _check_int(fn, "seed", seed, 0)
        self.shape, self.dtype, self.xp = shape, dtype, xp
        rng = xp.random.default_rng(seed)
        s = shape
        self.router_weight = rng.standard_normal((s.E, s.H), dtype=xp.float32) * xp.float32(0.02)
        self.w13 = random_array(xp, rng, (s.E, 2 * s.I, s.H), dtype, 0.02)
        self.w2 = random_array(xp, rng, (s.E, s.H, s.I), dtype, 0.02)
        self._rng = rng

    def hidden_states(self, T: int):
        """Fresh N(0, 1) activations (T, H) of the layer's dtype (bfloat16 as a Bits16).
        T: an int >= 0; anything else raises ArgumentError."""
        _check_int("MoELayer.hidden_states", "T", T, 0)
        return random_array(self.xp, self._rng, (T, self.shape.H), self.dtype, 1.0)

    def router_logits(self, hidden_states):
        """(T, E) float32 = hidden_states @ router_weight.T (computed in fp32).
        hidden_states: (T, H) of the layer's dtype (bfloat16 as a Bits16), on the layer's
        library. Raises DTypeError / ShapeError naming hidden_states otherwise."""
        return self._activations("MoELayer.router_logits", hidden_states).load_f32() @ self.router_weight.T

    def _activations(self, fn: str, hidden_states) -> TensorRef:
        """TensorRef of hidden_states after checking it is (T, H) of the layer's dtype."""
        ref = TensorRef.of(hidden_states, "hidden_states", fn)
        if ref.dtype != self.dtype:
            raise DTypeError(fn, "hidden_states", "the layer's dtype", self.dtype, ref.dtype)
        if len(ref.shape) != 2 or ref.shape[1] != self.shape.H:
            raise ShapeError(fn, "hidden_states", "shape (T, H)", f"(T, {self.shape.H})", ref.shape)
        return ref

    def forward(self, hidden_states, registry=None):
        """(out (T, H) of the layer's dtype, topk_weights (T, K) float32, topk_ids (T, K) int32,
        router_logits (T, E) float32) through ex_engine's factors (``registry``: None for the
        default). hidden_states: (T, H) of the layer's dtype; DTypeError / ShapeError naming it
        otherwise (fn 'MoELayer.forward'); else raises what topk_softmax and moe_fused_gemm raise."""
        logits = self._activations("MoELayer.forward", hidden_states).load_f32() @ self.router_weight.T
        w, ids = topk_softmax(logits, self.shape.K, self.shape.renormalize, registry=registry)
        out = moe_fused_gemm(hidden_states, self.w13, self.w2, w, ids, router_logits=logits,
                             registry=registry)
        return out, w, ids, logits

    def reference(self, hidden_states, topk_weights, topk_ids):
        """(T, H) float64 reference of the experts (activation not rounded), on the same
        device: moe_fused_gemm_math in float64 on the layer's weights.

        hidden_states: (T, H) of the layer's dtype; topk_weights (T, K) float; topk_ids (T, K)
        integer expert ids in [0, E). An id outside [0, E) would contribute nothing to the
        reference (as in the kernel, which flags it as a device-side error), so it raises
        ArgumentError naming topk_ids and the number of such slots instead of a silently
        smaller reference; a wrong hidden_states raises DTypeError / ShapeError, and so do
        topk_weights / topk_ids that are not arrays (ArgumentError), not float / integer
        (DTypeError) or not (T, K) (ShapeError)."""
        fn = "MoELayer.reference"
        x = self._activations(fn, hidden_states)
        xp = self.xp
        T, K = x.shape[0], self.shape.K
        for name, a, kinds, what in (("topk_weights", topk_weights, "f", "float weights"),
                                     ("topk_ids", topk_ids, "iu", "integer expert ids")):
            if not all(hasattr(a, k) for k in ("dtype", "shape", "astype")):
                raise ArgumentError(fn, name, "type", f"an array of {xp.__name__} (T, K)", type(a).__name__)
            if getattr(a.dtype, "kind", "") not in kinds:
                raise DTypeError(fn, name, "dtype", what, str(a.dtype))
            if tuple(a.shape) != (T, K):
                raise ShapeError(fn, name, "shape (T, K)", f"({T}, {K})", tuple(a.shape))
        w13 = TensorRef.of(self.w13).raw()
        w2 = TensorRef.of(self.w2).raw()
        conv = (lambda a: TensorRef.of(Bits16(a)).load_f32()) if self.dtype == "bfloat16" \
            else (lambda a: a.astype(xp.float32))
        out, n_invalid = moe_fused_gemm_math(xp, x.load_f32().astype(xp.float64),
                                     lambda e: conv(w13[e]), lambda e: conv(w2[e]),
                                     topk_weights.astype(xp.float64), topk_ids, self.shape.E,
                                     None, accum=xp.float64)
        if n_invalid:
            raise ArgumentError("MoELayer.reference", "topk_ids", "expert ids in [0, E)",
                                f"every id in [0, {self.shape.E})",
                                f"{n_invalid} slot(s) outside of {int(topk_ids.size)}")
        return out


def _values(a, name: str):
    """``a`` (argument ``name`` of rel_error) as a NumPy/CuPy array: itself where it is one
    (ml_dtypes' bfloat16 too), else the values of a Bits16 (MoELayer's bfloat16 outputs; read
    exactly from its bits) or of a torch tensor. Raises DTypeError naming it for anything else
    (a list or None failed as an AttributeError about 'shape', a Bits16 about 'astype')."""
    if hasattr(a, "astype") and hasattr(a, "shape"):
        return a
    r = TensorRef.of(a, name, "rel_error")
    raw = r.raw()
    return bf16_bits_to_f32(r.xp(), raw) if r.dtype == "bfloat16" else raw


def rel_error(xp, out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 over all elements (out and ref of one shape, e.g.
    (T, H)); inf if out has a NaN or ref is zero; 0 for an empty output (T = 0: nothing to
    compare). out, ref: NumPy/CuPy arrays, torch tensors or Bits16 (bfloat16, as MoELayer's
    forward returns it); DTypeError naming the argument for anything else. Raises ShapeError
    when the shapes differ (no broadcasting)."""
    out, ref = _values(out, "out"), _values(ref, "ref")
    if tuple(out.shape) != tuple(ref.shape):
        raise ShapeError("rel_error", "ref", "same shape as out", tuple(out.shape), tuple(ref.shape))
    o = out.astype(xp.float64)
    if o.size == 0:
        return 0.0
    if bool(xp.isnan(o).any()):
        return float("inf")
    den = float(xp.linalg.norm(ref))
    return float(xp.linalg.norm(o - ref)) / den if den > 0 else float("inf")


def _sync(xp):
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def time_call(xp, fn, repeat: int) -> float:
    """Median wall time of ``fn()`` in µs over ``repeat`` calls, synchronising after each.
    repeat: an int >= 1 (ArgumentError otherwise: no median of no calls)."""
    _check_int("time_call", "repeat", repeat, 1)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(xp)
        times.append((time.perf_counter() - t0) * 1e6)
    return float(np.median(times))


def token_bytes(shape, tokens: int) -> int:
    """Bytes run_moe allocates beyond the weights at T = ``tokens`` (an estimate that errs high):
    per token, hidden_states and out of 2 bytes, the fallback's float32 and the reference's
    float64 copies of both (40 bytes an H element in all), the router's logits and softmax
    (float32 and float64 temporaries of E) and the routing; per expert, the rows it is given
    (twice the mean, for routing's spread) times its float64 intermediates (2I + I + H)."""
    per_token = shape.H * 40 + shape.E * 24 + shape.K * 24
    rows = 2 * tokens * shape.K / max(shape.E, 1) + 64
    return int(tokens * per_token + rows * (3 * shape.I + shape.H) * 8 * 2)


def _gemm_flops_per_s(dtype, n: int = 384) -> float:
    """NumPy's matmul rate here in ``dtype``: the best of three n x n products (~1-10 ms)."""
    a = np.random.default_rng(0).standard_normal((n, n)).astype(dtype)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / max(best, 1e-9)


@functools.lru_cache(maxsize=None)
def numpy_speeds(dtype: str) -> tuple:
    """NumPy's speed here, measured on small samples (~30 ms, once per dtype and process: a run
    over several T asks again for each): seconds to draw one element of ``dtype``
    (random_array) and to convert one to float32 (TensorRef.load_f32), each the better of two
    runs of 2^18 elements; float32 and float64 matmul rates (FLOP/s, 384^3)."""
    n = 1 << 18
    rng = np.random.default_rng(0)
    draw = conv = float("inf")
    for _ in range(2):   # the second of each is warm
        t0 = time.perf_counter()
        a = random_array(np, rng, (n,), dtype)
        draw = min(draw, (time.perf_counter() - t0) / n)
        t0 = time.perf_counter()
        TensorRef.of(a).load_f32()
        conv = min(conv, (time.perf_counter() - t0) / n)
    return draw, conv, _gemm_flops_per_s(np.float32), _gemm_flops_per_s(np.float64)


def cpu_seconds(shape, tokens: int, dtype: str, build: bool = True, speeds=None) -> float:
    """Rough wall time (s) of run_moe on the CPU at T = ``tokens``: drawing the weights (where
    ``build``), two calls of the fallback (the checked one and the timed one) and the float64
    reference, at ``speeds`` (numpy_speeds(dtype) where None). Each call converts the weights
    of the experts it hits (min(E, T*K) of E; the reference 1.5 times as much, to float64) and
    does 2*T*K*3*H*I FLOPs.
    On an idle 2-core x86 host a whole `ex-engine run moe` (its start and the registry's load
    included) took 1.3-1.7x this (qwen3-30b-a3b at T = 1, 512, 4096: 7, 9, 13 s estimated, 10.7,
    12.4, 19.8 s taken; granite T = 4096: 4 and 6.7 s); a busy CPU takes longer."""
    draw, conv, r32, r64 = speeds if speeds is not None else numpy_speeds(dtype)
    elems = shape.E * 3 * shape.I * shape.H
    hit = min(shape.E, tokens * shape.K) / max(shape.E, 1)
    flops = 2.0 * tokens * shape.K * 3 * shape.H * shape.I
    one_call = hit * elems * conv + flops / r32
    reference = 1.5 * hit * elems * conv + flops / r64
    return (elems * draw if build else 0.0) + 2 * one_call + reference


def available_bytes(xp) -> int | None:
    """Bytes this process could still allocate: the GPU's free memory (CuPy), else the host's
    MemAvailable (/proc/meminfo); None where neither can be read."""
    try:
        if xp is not np:
            return int(xp.cuda.runtime.memGetInfo()[0])
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except Exception:   # unreadable, malformed, or a CUDA runtime error from CuPy: no figure, no failure
        pass
    return None


def run_moe(model: str, tokens: int, dtype: str = "bfloat16", seed: int = 0, repeat: int = 10,
            registry=None, echo=print, progress=None, layers=None) -> dict:
    """Build ``model``'s MoE layer, run it through ``registry`` at T=``tokens``, check, time.

    Runs on the GPU (CuPy) when the registry's hardware is a live device, else on NumPy with the
    Python fallbacks. model: a name of manifests/moe_models.yaml; tokens: T >= 1 (an empty
    batch would check nothing); dtype: 'bfloat16' or 'float16'; seed >= 0; repeat >= 1 timed
    calls. ``echo`` prints the header and the table; ``progress`` (None: quiet), if given, is
    called with a line before each step that can take long (building the weights: 5 GB and most
    of a minute for qwen3-235b-a22b on a CPU; running the layer; the float64 reference; the
    timed calls). ``layers``: None (the weights are built for this call alone) or a dict the
    caller keeps across calls (start with {}): the layer built is kept there and a later call for
    the same model shape, dtype, seed and array library reuses its weights instead of building
    them again (`ex-engine run moe --tokens 1 64`: once, not once per T); a call for another one
    empties the dict before building its own, so it holds one layer's weights at most. A reused
    layer draws the next activations from its generator, so T's activations differ from those
    of a call that builds the layer (the weights are the same). Returns a dict with the paths
    that served, the errors and the times; 'ok' is False if a check failed: the router's ids
    differ from the fallback's, its weights are off by 1e-5 or more, the experts' output is off
    the float64 reference by the dtype's tolerance or more (rel_err), or its worst token row by
    more than verify.ROW_SLACK times it (worst_row_err, verify.row_error). Raises FactorError
    for an unknown model, another registry type, or an argument out of those ranges; MemoryError
    ("about N GB needed at T=..., M GB available on the GPU / this host") where the weights
    (unless reused) and T's arrays need more than the free memory of the GPU or host that would
    hold them, checked before anything is drawn (an allocation that fails later raises CuPy's or
    NumPy's MemoryError subclass).
    """
    step = progress or (lambda line: None)
    for name, v, lo in (("tokens", tokens, 1), ("seed", seed, 0), ("repeat", repeat, 1)):
        if not is_integer(v) or v < lo:   # NumPy integers count, as in MoELayer; bools do not
            raise FactorError(f"run_moe: {name}: expected an int >= {lo}, got {v!r}")
    tokens, seed, repeat = int(tokens), int(seed), int(repeat)
    if dtype not in ("bfloat16", "float16"):
        raise FactorError(f"run_moe: dtype: expected 'bfloat16' or 'float16', got {dtype!r}")
    if layers is not None and not isinstance(layers, dict):
        raise FactorError(f"run_moe: layers: expected None or a dict (kept across calls), "
                          f"got {type(layers).__name__}")
    reg = resolve_registry(registry)
    shape = model_shape(model)
    if reg.hardware.live:
        import cupy as xp
    else:
        xp = np
    tol = reg.manifest("moe_fused_gemm").tolerance.get(dtype, 1e-2)
    where = f"{reg.hardware.name} ({reg.hardware.source})" if reg.hardware.live else "the CPU (NumPy)"
    echo(f"MoE layer {model}: T={tokens} H={shape.H} I={shape.I} E={shape.E} K={shape.K} "
         f"renormalize={shape.renormalize} {dtype}, on {where}")
    if reg.no_gpu_note:
        echo(f"  note: {reg.no_gpu_note}")
    size = shape.E * 3 * shape.I * shape.H * 2 + shape.E * shape.H * 4   # w13, w2; router fp32
    key = (shape, dtype, seed, xp.__name__)
    layer = layers.get(key) if layers is not None else None
    # what T adds, checked against what is free before anything is drawn (a T of millions on
    # the CPU grew past the host's memory while the weights were built: the kernel's OOM
    # killer ended the process without a word)
    flops = 2.0 * tokens * shape.K * 3 * shape.H * shape.I
    need = token_bytes(shape, tokens) + (0 if layer is not None else size)
    free = available_bytes(xp)
    if free is not None and need > free:
        raise MemoryError(f"about {need / 1e9:.1f} GB needed at T={tokens} (weights and arrays), "
                          f"{free / 1e9:.1f} GB available on {'the GPU' if xp is not np else 'this host'}")
    if xp is np and progress is not None:
        secs = cpu_seconds(shape, tokens, dtype, build=layer is None)
        step(f"  on the CPU: about {need / 1e9:.1f} GB, and about "
             f"{'1 s or less' if secs < 1.5 else f'{secs:.0f} s'} (from NumPy's speed on this host; a busy "
             "CPU takes longer)")
    if layer is not None:
        step(f"  reusing the layer's weights ({size / 1e9:.2f} GB), built for an earlier T")
    else:
        if layers is not None:
            layers.clear()   # the previous layer's weights go before this one's are drawn
        step(f"  building the layer's weights ({size / 1e9:.2f} GB: w13, w2 of {dtype}, the router) ...")
        layer = MoELayer(shape, dtype, xp, seed)
        if layers is not None:
            layers[key] = layer
    x = layer.hidden_states(tokens)
    step(f"  running the layer (router + experts) at T={tokens} ...")
    before = reg.stats()
    out, w, ids, logits = layer.forward(x, reg)
    paths = {}
    after = reg.stats()
    for name in ("topk_softmax", "moe_fused_gemm"):
        diff = {k: after[name][k] - before.get(name, {}).get(k, 0) for k in after[name]}
        paths[name] = next((k for k, v in diff.items() if v and k != "errors"), "?")
    reg.check_device_errors()
    # router: ids must equal the fallback semantics; weights close in fp32
    w_ref, ids_ref = topk_softmax_math(xp, logits, shape.K, shape.renormalize)
    ids_ok = bool((ids == ids_ref).all())
    w_err = rel_error(xp, w, w_ref.astype(xp.float64))
    # experts: float64 reference on the routing actually used
    step("  computing the float64 reference of the experts ...")
    ref = layer.reference(x, w, ids)
    out64 = TensorRef.of(out).load_f32().astype(xp.float64)
    err = rel_error(xp, out64, ref)
    # (err inf: a NaN in out or a zero reference, already a FAIL; no row to name)
    row_err, row = row_error(xp, out64, ref) if err < float("inf") else (0.0, -1)
    reps = repeat if reg.hardware.live else 1
    step(f"  timing each factor ({reps} call{'s' if reps > 1 else ''}) ...")
    t_router = time_call(xp, lambda: topk_softmax(logits, shape.K, shape.renormalize, registry=reg), reps)
    t_moe = time_call(xp, lambda: moe_fused_gemm(x, layer.w13, layer.w2, w, ids, registry=reg), reps)
    ok = ids_ok and w_err < 1e-5 and err < tol and row_err <= ROW_SLACK * tol
    echo(f"  {'factor':<15} {'served by':<16} {'time (µs)':>11}  check")
    echo(f"  {'topk_softmax':<15} {paths['topk_softmax']:<16} {t_router:>11.1f}  ids "
         f"{'equal' if ids_ok else 'DIFFER'}, weights rel err {w_err:.1e} (tol 1e-5)")
    rate = flops / t_moe / 1e6  # TFLOP/s
    rate = f"{rate:.1f} TFLOP/s" if rate >= 0.1 else f"{rate * 1e3:.2f} GFLOP/s"
    echo(f"  {'moe_fused_gemm':<15} {paths['moe_fused_gemm']:<16} {t_moe:>11.1f}  rel err vs float64 "
         f"{err:.2e} (tol {tol:g}); {rate} (eager, host-timed)")
    if not row_err <= ROW_SLACK * tol:
        echo(f"  {'':<15} {'':<16} {'':>11}  token row {row} is off by {row_err:.2e} of the rows' "
             f"RMS norm, over {ROW_SLACK:g} x the tolerance")
    echo("  PASS" if ok else "  FAIL")
    return {"model": model, "tokens": tokens, "dtype": dtype, "paths": paths, "ids_equal": ids_ok,
            "router_weight_err": w_err, "rel_err": err, "worst_row_err": row_err, "tolerance": tol,
            "time_us": {"topk_softmax": t_router, "moe_fused_gemm": t_moe}, "ok": ok}

"""Does a plugin compute what its Python fallback computes? Run both on the manifest's test shapes.

One place for the test inputs (``make_inputs``), shared by ``ex-engine verify``,
``FactorRegistry.load(..., verify=True)`` and the tests. For each test shape of the manifest
(``test_shapes``: sizes and parameters) and each dtype of its main input, draw random inputs
as the manifest's ``values`` say (default N(0, 1) floats, ints in [0, 8); ``{normal: STD}``
with STD a number or ``1/sqrt(SYM)``, ``{uniform: [LO, HI]}``, ``{ids_below: SYM, distinct:
true}`` for ids distinct within each row), poison the outputs (a NaN with a payload, 0xA5..
integers), run the plugin on one copy and the Python fallback on another, check that each wrote
every output element, and compare every output: integer outputs exactly,
float outputs by ||got - want|| / ||want|| against the manifest's tolerance for that dtype
(manifest.DEFAULT_TOLERANCE, 1e-5, for a dtype it does not name: the table says "(default)"),
and their worst row against ROW_SLACK times it (row_error: one wrong row of many fails).

Device factors need a live GPU (CuPy); host factors (``memory: host``) run anywhere.
A pass is remembered per (library sha256, GPU name) in ``$EX_ENGINE_CACHE/verified.json``
(default ``~/.cache/ex_engine/verified.json``), so ``load(verify=True)`` does not repeat it;
where that file cannot be written, the verify check says so ("not cached: ...") and the next
load verifies again.
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import math
import numbers
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import _paths
from .arrays import Bits16, TensorRef, f32_to_bf16_bits
from .errors import ArgumentError, FactorError, is_integer
from .trust import CHILD_TIMEOUT_S, _signal_name, child_sys_path, replace_file, sha256_file, sha256_hex

_RSQRT = re.compile(r"^\s*1\s*/\s*sqrt\(\s*(\w+)\s*\)\s*$")


@dataclass
class CaseResult:
    """One test shape x dtype. status: 'pass', 'FAIL', 'declined' (no C path took it: the Python
    fallback would serve) or 'skipped'. error: the largest relative error over float outputs."""
    factor: str
    case: str
    dtype: str
    status: str
    path: str = "-"
    error: float | None = None
    tol: float | None = None
    detail: str = ""
    tol_default: bool = False   # tol is DEFAULT_TOLERANCE: the manifest names no tolerance for dtype

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"


# ------------------------------------------------------------------------------------ inputs
def case_dtypes(m) -> list:
    """The dtypes a test case iterates over: those of the manifest's main input."""
    spec = m.output if m.input.same_as_output else m.input
    return list(spec.dtypes) or ["float32"]


def split_case(m, case: dict) -> tuple:
    """(sizes, params) of one ``test_shapes`` entry: keys that are parameters go to params."""
    sizes = {k: int(v) for k, v in case.items() if k not in m.params}
    params = {k: v for k, v in case.items() if k in m.params}
    return sizes, params


def case_label(case: dict) -> str:
    """'T=1 H=2048 ...': a test shape as the verify table prints it."""
    return " ".join(f"{k}={v}" for k, v in case.items())


def tensor_dtype(m, spec, dtype: str) -> str:
    """The dtype ``spec`` gets in a case whose main input has ``dtype``."""
    main = m.output if m.input.same_as_output else m.input
    if spec is main or spec.name == main.name:
        return dtype
    if spec.same_dtype_as:
        other = next(t for t in m.tensors if t.name == spec.same_dtype_as and not t.same_as_output)
        return tensor_dtype(m, other, dtype)
    if dtype in spec.dtypes:
        return dtype
    return spec.dtypes[0] if spec.dtypes else "float32"


def _shape(spec, sizes) -> tuple:
    return tuple(c if s is None else c * sizes[s] for c, s in spec.parsed)


def _scalar(v, sizes) -> float:
    """A number, or 'SYM' / '1/sqrt(SYM)' resolved with the case's sizes."""
    if isinstance(v, (int, float)):
        return float(v)
    m = _RSQRT.match(str(v))
    if m:
        return 1.0 / math.sqrt(max(sizes[m.group(1)], 1))
    return float(sizes[str(v)]) if str(v) in sizes else float(v)


def _to_dtype(xp, values_f32, dtype: str):
    """An array of ``dtype`` (bfloat16 as Bits16) from float32 values."""
    if dtype == "bfloat16":
        return Bits16(f32_to_bf16_bits(xp, values_f32))
    return values_f32.astype(dtype)


def _draw(xp, rng, hrng, spec, shape, dtype: str, sizes):
    """Random values for one input array, as its manifest ``values`` say (``rng``: xp's
    generator for large float arrays; ``hrng``: NumPy's for ids and small draws)."""
    v = spec.values or {}
    if "ids_below" in v:
        n = int(_scalar(v["ids_below"], sizes))
        k = shape[-1] if shape else 1
        rows = int(np.prod(shape)) // k if k else 0
        if v.get("distinct"):
            if k > n:
                raise FactorError(f"{spec.name}: {k} distinct ids per row asked, only {n} exist")
            ids = np.argsort(hrng.random((rows, n)), axis=1)[:, :k]
        else:
            ids = hrng.integers(0, max(n, 1), (rows, k))
        return xp.asarray(ids.reshape(shape).astype(dtype))
    if dtype.startswith("int"):
        lo, hi = v.get("uniform", [0, 8])
        return xp.asarray(hrng.integers(int(lo), int(hi), size=shape).astype(dtype))
    if "uniform" in v:
        lo, hi = (_scalar(x, sizes) for x in v["uniform"])
        f = xp.asarray((hrng.random(shape) * (hi - lo) + lo).astype(np.float32))
    else:
        f = _normal(xp, rng, shape, _scalar(v.get("normal", 1.0), sizes))
    return _to_dtype(xp, f, dtype)


def _normal(xp, rng, shape, std: float):
    """N(0, std^2) float32, drawn one leading slice at a time (weights can be large)."""
    out = xp.empty(shape, dtype=xp.float32)
    if len(shape) == 3:
        for i in range(shape[0]):
            out[i] = rng.standard_normal(shape[1:], dtype=xp.float32) * xp.float32(std)
    else:
        out[...] = rng.standard_normal(shape, dtype=xp.float32) * xp.float32(std)
    return out


# What an output holds before a call writes it, as bit patterns no computation yields by chance:
# a quiet NaN with a payload (arithmetic gives the canonical NaN) and 0xA5.. for integers, so an
# element still holding it afterwards was not written (unwritten_count), whoever's output it is.
POISON_BITS = {"float32": 0x7FC05A5A, "float16": 0x7E5A, "bfloat16": 0x7FDA,
               "int32": 0xA5A5A5A5, "int64": 0xA5A5A5A5A5A5A5A5}
POISON_WIDTH = {"float32": 32, "float16": 16, "bfloat16": 16, "int32": 32, "int64": 64}


def poison_pattern(dtype: str) -> int:
    """POISON_BITS of ``dtype`` as a signed integer of its width (CuPy fills and compares C
    longs: 0xA5A5A5A5A5A5A5A5 does not fit one); its width is POISONPOISON_WIDTH[dtype]."""
    bits, w = POISON_BITS[dtype], POISON_WIDTH[dtype]
    return bits - (1 << w) if bits >> (w - 1) else bits


def _poison(xp, shape, dtype: str):
    bits = POISON_BITS.get(dtype)
    if bits is None:   # a dtype without a pattern: NaN or -7 (not told apart from a value)
        if dtype.startswith("int"):
            return xp.full(shape, -7, dtype=dtype)
        return _to_dtype(xp, xp.full(shape, xp.nan, dtype=xp.float32), dtype)
    raw = xp.full(shape, poison_pattern(dtype), dtype=f"int{POISON_WIDTH[dtype]}")
    return Bits16(raw.view(xp.uint16)) if dtype == "bfloat16" else raw.view(dtype)


def unwritten_count(a) -> int:
    """How many elements of array ``a`` (NumPy/CuPy, or a Bits16) still hold verify's poison
    (POISON_BITS of its dtype; 0 for a dtype without a pattern)."""
    raw = a.bits if isinstance(a, Bits16) else a
    dtype = a.dtype if isinstance(a, Bits16) else str(raw.dtype)
    if dtype not in POISON_BITS or raw.size == 0 or raw.dtype.itemsize * 8 != POISON_WIDTH[dtype]:
        return 0
    return int((raw.view(f"int{POISON_WIDTH[dtype]}") == poison_pattern(dtype)).sum())


def poisoned_names(m) -> list:
    """Names of the arrays make_inputs poisons: the outputs a call must write in full (not an
    inout or in-place one, which holds input values)."""
    return [spec.name for spec in m.user_tensors if not spec.optional and not (
        spec.role in ("input", "inout") or (spec is m.output and m.input.same_as_output))]


def make_inputs(m, case: dict, dtype: str, xp=np, seed: int = 0) -> tuple:
    """(arrays, params) for one test case: every array the caller passes, by manifest name.

    Inputs (role input/inout, and an in-place output) are random as the manifest's ``values``
    say; outputs are poisoned (POISON_BITS: a NaN with a payload, 0xA5.. integers); optional
    inputs are None; the workspace
    is left to the registry. ``xp``: numpy or cupy (arrays are made on its current device).
    case: a mapping of size name -> int >= 0 (and parameters). Raises ArgumentError for a case
    that is not a mapping or a size that is not an int >= 0; FactorError if the case lacks a size
    the shapes need."""
    if not isinstance(case, dict):
        raise ArgumentError("make_inputs", "case", "type", "a mapping of size name -> int (a test shape)",
                            f"{type(case).__name__} {case!r}")
    for k, v in case.items():
        if k not in m.params and (not is_integer(v) or v < 0):
            raise ArgumentError("make_inputs", f"case[{k!r}]", "a size", "an int >= 0", repr(v))
    sizes, params = split_case(m, case)
    rng, hrng = xp.random.default_rng(seed), np.random.default_rng(seed)
    arrays = {}
    for spec in m.user_tensors:
        if spec.optional:
            arrays[spec.name] = None
            continue
        try:
            shape = _shape(spec, sizes)
        except KeyError as exc:
            raise FactorError(f"{m.name}: test shape {case}: no size for {exc} (needed by '{spec.name}')") from None
        dt = tensor_dtype(m, spec, dtype)
        is_input = spec.role in ("input", "inout") or (spec is m.output and m.input.same_as_output)
        arrays[spec.name] = _draw(xp, rng, hrng, spec, shape, dt, sizes) if is_input else _poison(xp, shape, dt)
    return arrays, params


def clone(arrays: dict) -> dict:
    """Deep copies of every array (Bits16 kept as Bits16)."""
    out = {}
    for k, a in arrays.items():
        if a is None:
            out[k] = None
        elif isinstance(a, Bits16):
            out[k] = Bits16(a.bits.copy(), a.dtype)
        else:
            out[k] = a.copy()
    return out


# ------------------------------------------------------------------------------------ compare
def output_names(m) -> list:
    """Names of the arrays a call writes: the output and every aux of role output/inout."""
    return [m.output.name] + [a.name for a in m.aux if a.role in ("output", "inout")]


# How far the worst row of an output may be from the reference, in units of the tolerance (see
# row_error): a correct kernel's rows err like the whole array does, scaled by the row's own
# norm (at most a few times the rows' RMS norm); one dropped top-k slot or a zeroed token row
# reads O(1/sqrt(K)) to 1, while it moves the whole array's relative error by O(1/sqrt(rows)) only.
# A row's figure is at most sqrt(rows) times the whole array's, so the check adds something only
# above 64 rows (moe_fused_gemm's test_shapes have a T = 1024 case for it).
ROW_SLACK = 8.0


def row_error(xp, got, want) -> tuple:
    """(err, row): the worst row's error, max_t ||got[t] - want[t]|| / (||want|| / sqrt(R)),
    over the R rows of two float64 arrays of one shape (axis 0 = rows, the other axes of a row
    flattened), and that row's index; (0.0, -1) where there are fewer than two rows or both are
    all zero, and (inf, that row) where want is all zero but got is not. The denominator is the
    rows' RMS norm, not the row's own, so a row that is legitimately near zero does not blow the
    figure up.

    Why: ||got - want|| / ||want|| over a (T, H) output averages one wrong row away: a zeroed
    token at T = 20000 reads 7e-3, one dropped slot of T = 4096, K = 8 reads 5e-3, both inside
    a bfloat16 tolerance of 1e-2. Here they read 1 and ~0.35. Compare err with ROW_SLACK x the
    tolerance (verify.compare, the main job's check)."""
    shape = tuple(got.shape)
    if len(shape) < 2 or shape[0] < 2:
        return 0.0, -1
    R = shape[0]
    d = (got - want).reshape(R, -1)
    rows = xp.sqrt((d * d).sum(axis=1))
    den = float(xp.linalg.norm(want)) / math.sqrt(R)
    worst = int(rows.argmax())
    top = float(rows[worst])
    if den > 0:
        return top / den, worst
    return (math.inf, worst) if top > 0 else (0.0, -1)


def compare(m, got: dict, want: dict, dtype: str) -> tuple:
    """(ok, largest relative error, detail) over the outputs of one case.

    Integer outputs must be equal. Float outputs (in float64): NaN exactly where the reference
    has NaN and infinities equal to the reference's; over the other elements, ||got - want|| /
    ||want|| within the manifest's tolerance for ``dtype`` (Manifest.tolerance_for:
    DEFAULT_TOLERANCE where the manifest names none), and the worst row (row_error) within
    ROW_SLACK x that tolerance, so that one wrong row of many fails too."""
    tol, default = m.tolerance_for(dtype)
    where = (", the default: the manifest's tolerance names no such dtype)" if default else ")")
    worst, problems = 0.0, []
    for name in output_names(m):
        g, w = TensorRef.of(got[name], name), TensorRef.of(want[name], name)
        if g.dtype.startswith("int"):
            a, b = g.raw(), w.raw()
            bad = int((a != b).sum())
            if bad:
                problems.append(f"{name}: {bad} of {b.size} values differ (must be equal)")
            continue
        xp = g.xp()
        a, b = g.load_f32().astype(xp.float64), w.load_f32().astype(xp.float64)
        nan_a, nan_b = xp.isnan(a), xp.isnan(b)
        extra, missing = int((nan_a & ~nan_b).sum()), int((nan_b & ~nan_a).sum())
        inf_a, inf_b = xp.isinf(a), xp.isinf(b)
        inf_bad = int(((inf_a | inf_b) & ~(nan_a | nan_b) & (a != b)).sum())
        if extra or missing or inf_bad:
            parts = []
            if extra:
                parts.append(f"{extra} NaN where the fallback has a number (an element not written?)")
            if missing:
                parts.append(f"{missing} numbers where the fallback has NaN")
            if inf_bad:
                parts.append(f"{inf_bad} infinities that differ from the fallback's value")
            problems.append(f"{name}: " + "; ".join(parts))
            worst = math.inf
            continue
        same = nan_a | (inf_a & (a == b))     # NaN on both sides, or the same infinity
        a, b = xp.where(same, 0, a), xp.where(same, 0, b)
        den = float(xp.linalg.norm(b)) if b.size else 0.0
        err = float(xp.linalg.norm(a - b)) / den if den > 0 else \
            (float(xp.abs(a - b).max()) if b.size else 0.0)
        # (an all-zero reference: the absolute error above decides, and row_error's inf would not)
        row, t = row_error(xp, a, b) if den > 0 else (0.0, -1)
        worst = max(worst, err)
        if not err <= tol:
            problems.append(f"{name}: relative error {err:.2e} > tolerance {tol:g} ({dtype}" + where)
        elif not row <= ROW_SLACK * tol:
            worst = max(worst, row / ROW_SLACK)
            problems.append(f"{name}: row {t} is off by {row:.2e} of the rows' RMS norm, over "
                            f"{ROW_SLACK:g} x the tolerance {tol:g} ({dtype}" + where
                            + f" (the whole array's relative error, {err:.2e}, is within it)")
    return not problems, worst, "; ".join(problems)


# ------------------------------------------------------------------------------------ running
def cannot_run(registry, plugin) -> str:
    """Why ``plugin`` cannot be verified here ('' if it can)."""
    m = plugin.manifest
    if m is None:
        return "no manifest"
    if m.memory != "host" and not registry.hardware.live:
        return f"a device factor and no live GPU (checked against {registry.hardware.source} only)"
    if not (registry._fallbacks.get(m.name) or m.fallback):
        return "the manifest names no Python fallback to compare with"
    if not m.test_shapes:
        return "the manifest declares no test_shapes"
    return ""


def _check_plugin(fn: str, plugin) -> None:
    """Raise ArgumentError unless ``plugin`` is a loaded plugin with a manifest."""
    from .registry import Plugin
    if not isinstance(plugin, Plugin):
        raise ArgumentError(fn, "plugin", "type", "a loaded Plugin (registry.get(name), registry.plugins)",
                            f"{type(plugin).__name__} {plugin!r}")
    if plugin.manifest is None:
        raise ArgumentError(fn, "plugin", "a plugin with a manifest", "a plugin whose factor has a "
                            "manifest", f"plugin {plugin.name!r} without one")


def _check_call(fn: str, registry, seed, timeout=None, **flags) -> tuple:
    """(seed as a Python int, timeout as a float or None) after raising ArgumentError naming
    ``fn`` and the argument unless ``registry`` is a FactorRegistry, ``seed`` an int >= 0 (NumPy's
    too), ``timeout`` (where given) a finite real number of seconds > 0 (NumPy's too) and each of
    ``flags`` True or False (a seed of -1 or a timeout of -1 had become a FAIL row blaming the
    plugin, a seed of None a TypeError from deep inside). The seed is made a Python int: a NumPy
    one wrapped around in ``seed * 1000 + k`` and is no JSON for the child process."""
    from .manifest import bool_like
    from .registry import FactorRegistry
    if not isinstance(registry, FactorRegistry):
        raise ArgumentError(fn, "registry", "type", "a FactorRegistry",
                            f"{type(registry).__name__} {registry!r:.80}")
    if not is_integer(seed) or seed < 0:
        raise ArgumentError(fn, "seed", "value", "an int >= 0", repr(seed))
    if timeout is not None:
        if (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                or not 0 < timeout < math.inf):
            raise ArgumentError(fn, "timeout", "value", "a number of seconds > 0", repr(timeout))
        timeout = float(timeout)
    for name, v in flags.items():
        if not bool_like(v):
            raise ArgumentError(fn, name, "type", "True or False", repr(v))
    return int(seed), timeout


def run_case(registry, plugin, case: dict, dtype: str, seed: int = 0, count: bool = True) -> CaseResult:
    """Run ``plugin`` and its Python fallback on one test case and compare.

    registry: a FactorRegistry, seed: an int >= 0, count: a bool (ArgumentError otherwise).
    plugin: a loaded Plugin with a manifest (ArgumentError otherwise). A device factor needs a
    registry on a live GPU (and CuPy): without one it raises FactorError naming the plugin
    (verify_plugin skips it instead, see cannot_run). Errors of the case itself (a plugin
    refusing it, a shape that cannot be drawn) are a FAIL result, not an exception."""
    _check_plugin("run_case", plugin)
    seed, _ = _check_call("run_case", registry, seed, count=count)
    if plugin.manifest.memory != "host":
        if not registry.hardware.live:
            raise FactorError(f"run_case: plugin '{plugin.name}': a device factor ({plugin.manifest.name}) "
                              f"needs a live GPU; the registry has {registry.hardware.source} only")
        try:
            import cupy  # noqa: F401
        except ImportError as exc:
            raise FactorError(f"run_case: plugin '{plugin.name}': a device factor needs CuPy, which "
                              f"cannot be imported ({exc}); pip install -e '.[gpu]'") from exc
    res = _run_case_at(registry, plugin, case, dtype, seed, count)
    res.tol_default = plugin.manifest.tolerance_for(dtype)[1]
    return res


def _run_case_at(registry, plugin, case: dict, dtype: str, seed: int, count: bool) -> CaseResult:
    """run_case on the device the registry has (for a device factor)."""
    m = plugin.manifest
    label = case_label(case)
    tol = m.tolerance_for(dtype)[0]
    device = m.memory != "host"
    xp = np
    if device:
        import cupy as xp
    try:
        if device:
            with xp.cuda.Device(registry.hardware.device_id):
                return _run_case(registry, plugin, m, case, dtype, seed, count, xp, label, tol)
        return _run_case(registry, plugin, m, case, dtype, seed, count, xp, label, tol)
    except FactorError as exc:
        return CaseResult(m.name, label, dtype, "FAIL", "-", None, tol, f"{type(exc).__name__}: {exc}")
    except Exception as exc:   # e.g. a manifest test shape or `values` that cannot be drawn
        return CaseResult(m.name, label, dtype, "FAIL", "-", None, tol,
                          f"could not run this case: {type(exc).__name__}: {exc}")


_GUARD_BYTES = 4096
_GUARD_FILL = 0xA5


def _guarded(xp, a, name: str):
    """(a copy of ``a`` inside a buffer with _GUARD_BYTES of a fill pattern on each side, a
    function returning what the kernel wrote outside it: '' if nothing)."""
    base = a.bits if isinstance(a, Bits16) else a
    n = base.nbytes
    buf = xp.full(n + 2 * _GUARD_BYTES, _GUARD_FILL, dtype=xp.uint8)
    # at _GUARD_BYTES by construction: a slice buf[G:G] of an empty array points at buf's start
    # (NumPy), so a write at an empty output's pointer read as one "before its start"
    if xp is np:
        view = np.ndarray(base.shape, base.dtype, buffer=buf, offset=_GUARD_BYTES)
    else:
        view = xp.ndarray(base.shape, base.dtype, memptr=buf.data + _GUARD_BYTES)
    view[...] = base

    def outside() -> str:
        before = int((buf[:_GUARD_BYTES] != _GUARD_FILL).sum())
        after = int((buf[_GUARD_BYTES + n:] != _GUARD_FILL).sum())
        where = []
        if n == 0:   # no element: every byte written is outside it
            if after:
                where.append(f"{after} byte(s) at or after its pointer")
            if before:
                where.append(f"{before} byte(s) before its pointer")
            return (f"{name}: the kernel wrote {' and '.join(where)}, although the array is empty "
                    f"(shape {tuple(base.shape)}: no element to write)") if where else ""
        if after:
            where.append(f"{after} byte(s) past its end")
        if before:
            where.append(f"{before} byte(s) before its start")
        return f"{name}: the kernel wrote {' and '.join(where)}" if where else ""
    return (Bits16(view, a.dtype) if isinstance(a, Bits16) else view), outside


def _host_status_word(registry, key, value=None) -> int:
    """The status word (int32 at offset 0) of the host workspace ``key`` of ``registry`` (0
    where there is none); with ``value``, set to it first."""
    buf = registry._workspaces.get(key)
    if buf is None:
        return 0
    word = buf[:4].view("int32")
    if value is not None:
        word[0] = value
    return int(word[0])


def _run_case(registry, plugin, m, case, dtype, seed, count, xp, label, tol) -> CaseResult:
    arrays, params = make_inputs(m, case, dtype, xp, seed)
    ref = clone(arrays)
    # every array the kernel writes sits between guard bytes: a write out of bounds fails the
    # case (a small overrun passed before, and a host one corrupted the heap)
    guards = []
    for name in output_names(m):
        if arrays.get(name) is not None:
            arrays[name], outside = _guarded(xp, arrays[name], name)
            guards.append(outside)
    # a host factor's kernel flags bad input in the calling thread's workspace, which the
    # registry's own calls in this thread share: the word is put back as it was, so that a flag
    # this case's random input set (a negative alpha) is not reported by the engine's next
    # check_device_errors() as one of its calls (load(verify=True) left one there). A device
    # factor's workspace is its stream's, where other threads' kernels may flag too: left alone.
    ws_key = (plugin.name, -1, threading.get_ident()) if m.memory == "host" else None
    before = _host_status_word(registry, ws_key) if ws_key else 0
    try:
        path = registry.call_plugin(plugin, arrays, params, count=count)
    finally:
        if ws_key:
            _host_status_word(registry, ws_key, before)
    if xp is not np:
        try:
            xp.cuda.get_current_stream().synchronize()
        except Exception as exc:   # CUDARuntimeError raised by an asynchronous fault
            return CaseResult(m.name, label, dtype, "FAIL", path or "-", None, tol,
                              f"CUDA error after the kernel: {exc}")
    overrun = "; ".join(g for g in (check() for check in guards) if g)
    if overrun:
        return CaseResult(m.name, label, dtype, "FAIL", path or "-", None, tol, overrun)
    if path is None:
        return CaseResult(m.name, label, dtype, "declined", "-", None, tol,
                          "both C paths declined: the Python fallback would serve this call")
    refs = {k: TensorRef.of(v, k) for k, v in ref.items() if v is not None}
    _, _, sizes, pvals, _ = m.bind(refs, params)
    fn = registry._fallbacks.get(m.name) or m.fallback_fn()
    try:
        fn(refs, sizes, pvals)
    except (Exception, SystemExit) as exc:   # a broken fallback (even sys.exit) fails this case, not verify
        return CaseResult(m.name, label, dtype, "FAIL", path, None, tol,
                          f"the Python fallback raised {type(exc).__name__}: {exc} (expected "
                          "fn(arrays, sizes, params), docs/factor-contract.md)")
    unwritten = []
    for name in poisoned_names(m):
        for who, got in (("the Python fallback", ref), ("the plugin", arrays)):
            k = unwritten_count(got[name]) if got.get(name) is not None else 0
            if k:
                size = int(np.prod((got[name].bits if isinstance(got[name], Bits16) else got[name]).shape))
                unwritten.append(f"{name}: {who} left {k} of {size} element(s) unwritten (still "
                                 "holding the poison verify filled them with)" +
                                 ("; a fallback must write every output element, so the plugin "
                                  "cannot be checked there" if who != "the plugin" else
                                  f"; {path} returned EX_OK, which promises every output element written"))
    if unwritten:
        return CaseResult(m.name, label, dtype, "FAIL", path, None, tol, "; ".join(unwritten))
    ok, err, detail = compare(m, arrays, ref, dtype)
    return CaseResult(m.name, label, dtype, "pass" if ok else "FAIL", path, err, tol, detail)


CHILD_FILE_LIMIT = 1 << 30   # bytes any file written by the child may reach (its stderr: a kernel
                             # printing without end would fill the temporary folder)


def plugin_cases(plugin) -> list:
    """(case, dtype, seed offset) of every check of ``plugin``, in order."""
    m = plugin.manifest
    return [(case, dt, i * 10 + j) for i, case in enumerate(m.test_shapes)
            for j, dt in enumerate(case_dtypes(m))]


def verify_plugin(registry, plugin, seed: int = 0, count: bool = True, isolate: bool = False,
                  timeout: float = CHILD_TIMEOUT_S) -> list:
    """Every (test shape, dtype) case of ``plugin``; a single 'skipped' result if it cannot run.

    isolate: run the cases in a child process (``timeout`` seconds for all of them; None or left
    out: CHILD_TIMEOUT_S), so that a kernel that crashes (a far out-of-bounds write, an abort),
    ends the process or hangs is a FAIL row naming the case it was running, the cases before it
    keep their results, and this process goes on; the child's calls are added to
    ``registry.stats()`` when ``count``. A fallback set with ``registry.set_fallback`` or named in
    ``__main__`` exists in this process only: such a plugin runs here. Raises ArgumentError
    when ``plugin`` is not a loaded Plugin (e.g. a factor name: pass registry.get(name)),
    ``registry`` not a FactorRegistry, ``seed`` not an int >= 0, ``timeout`` not a number of
    seconds > 0, or ``count`` or ``isolate`` not True or False."""
    _check_plugin("verify_plugin", plugin)
    seed, timeout = _check_call("verify_plugin", registry, seed, timeout, count=count, isolate=isolate)
    if timeout is None:   # (the check passes None: in the child's wait it was a TypeError)
        timeout = CHILD_TIMEOUT_S
    why = cannot_run(registry, plugin)
    if why:
        return [CaseResult(plugin.name, "-", "-", "skipped", detail=why)]
    # a fallback the child could not import (set_fallback, or defined in __main__): run here
    here = plugin.name in registry._fallbacks or (plugin.manifest.fallback or "").startswith("__main__:")
    if isolate and not here:
        return _verify_in_child(registry, plugin, seed, count, timeout)
    return [run_case(registry, plugin, case, dt, seed=seed * 1000 + k, count=count)
            for case, dt, k in plugin_cases(plugin)]


# ------------------------------------------------------------------------------------ child
# The child: dies with its parent (Linux), loads only the plugin's library, checks it is the
# file the parent loaded, then writes "START <case>" before and "CASE <result>" after each case
# and "STATS <calls>" at the end to its own report file (not stdout, where a library may print
# anything), so a crash names the case it happened in.
_CHILD = r"""
import dataclasses, json, os, signal, sys
sys.path[:] = json.loads(sys.argv[1])
a = json.loads(sys.argv[2])
report = open(a["report"], "w", encoding="utf-8")
try:
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)    # PR_SET_PDEATHSIG: end with the parent
except Exception:
    pass
if os.getppid() != a["parent"]:
    sys.exit(3)                                    # the parent already ended
try:   # no file this process writes (its stderr's among them) grows past the limit: SIGXFSZ
    import resource
    resource.setrlimit(resource.RLIMIT_FSIZE, (a["file_limit"], a["file_limit"]))
except (ImportError, ValueError, OSError):
    pass
from ex_engine.hardware import Hardware
from ex_engine.registry import FactorRegistry
from ex_engine.verify import CaseResult, _manifest_digest, case_label, plugin_cases, run_case


def say(tag, obj):
    report.write(tag + " " + json.dumps(obj) + "\n")
    report.flush()


reg = FactorRegistry(hardware=Hardware(**a["hardware"]), manifests_dir=a["manifests_dir"])
p = reg.load_library(a["path"])
if p.sha256 != a["sha256"]:   # the file changed after the parent checked it (and its lock)
    say("CASE", dataclasses.asdict(CaseResult(p.name, "-", "-", "FAIL", detail="the library file "
        f"changed after it was loaded (sha256 {a['sha256'][:12]}... then, {str(p.sha256)[:12]}... now)")))
elif p.manifest is not None and _manifest_digest(p.manifest) != a["manifest_sha256"]:
    say("CASE", dataclasses.asdict(CaseResult(p.name, "-", "-", "FAIL", detail="its manifest "
        f"{p.manifest.path} changed after it was loaded")))
elif p.status != "ready":
    say("CASE", dataclasses.asdict(CaseResult(p.name, "-", "-", "FAIL",
                                              detail=f"not ready in the child process: {p.reason}")))
else:
    for case, dt, k in plugin_cases(p):
        say("START", [case_label(case), dt])
        say("CASE", dataclasses.asdict(run_case(reg, p, case, dt, seed=a["seed"] * 1000 + k)))
        say("STATS", reg.stats().get(p.name, {}))     # so far: kept if a later case crashes
say("DONE", 0)
report.close()
sys.stderr.flush()
os._exit(0)   # the checks are done: a library's teardown (destructors, CUDA) is not verify's to wait for
"""


def _verify_in_child(registry, plugin, seed: int, count: bool, timeout: float) -> list:
    """verify_plugin's cases in a child process that loads only ``plugin``'s library (same
    hardware, same manifests); a crash, a hang or an exit there is a FAIL row for the case it
    was running. The child reports to a file and its stderr goes to one, not to pipes, so a
    process the kernel forked cannot hold the parent; stdin is /dev/null; the child's session
    is killed at the end (also when this process is interrupted)."""
    def fail(case, dtype, detail):
        return CaseResult(plugin.name, case, dtype, "FAIL", detail=detail)
    with contextlib.ExitStack() as stack:
        try:
            out = stack.enter_context(tempfile.NamedTemporaryFile(
                "r", prefix="ex_engine_verify_", suffix=".txt", encoding="utf-8", errors="replace"))
            err = stack.enter_context(tempfile.NamedTemporaryFile("w+b", prefix="ex_engine_verify_", suffix=".err"))
        except OSError as exc:
            return [fail("-", "-", f"could not start verify's child process: no writable temporary folder ({exc})")]
        args = {"hardware": registry.hardware.as_dict(), "manifests_dir": str(registry.manifests_dir),
                "path": str(plugin.path), "sha256": plugin.sha256, "seed": seed, "parent": os.getpid(),
                "manifest_sha256": _manifest_digest(plugin.manifest), "report": out.name,
                "file_limit": CHILD_FILE_LIMIT}
        cmd = [sys.executable, "-c", _CHILD, json.dumps(child_sys_path(_fallback_roots(plugin.manifest))),
               json.dumps(args)]
        before = frozenset(_children()) if _adopting else frozenset()
        proc = None
        try:
            # a signal during Popen (after its fork) would leave a started child unnamed here:
            # it waits until proc is set, then ends this through the finally below (in another
            # thread no handler raises there, and a blocked mask would pass to the child)
            with _signals_held(block_in_thread=False):
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                        start_new_session=True)
            rc, how = _wait_unreaped(proc, timeout), ""
            if rc is None:
                how = f"timed out after {timeout:g} s"
        finally:                       # also on Ctrl-C or SIGTERM: leave no child behind
            if proc is not None:
                _kill_session(proc, before)
        lines = out.read().splitlines()
        err.seek(max(0, err.seek(0, os.SEEK_END) - 4096))   # only the tail: a kernel may print GBs
        last = (err.read().decode(errors="replace").strip().splitlines() or ["no message"])[-1]
    # the report, checked against the cases: START and CASE of each case in order, then DONE
    expected = [[case_label(c), dt] for c, dt, _ in plugin_cases(plugin)]
    results, running, stats, done, garbled = [], None, {}, False, False
    for ln in lines:
        tag, _, body = ln.partition(" ")
        try:
            obj = json.loads(body)
        except ValueError:
            garbled = garbled or ln != lines[-1]   # only the last line may be cut short by a crash
            continue
        if tag == "START" and running is None and len(results) < len(expected) and obj == expected[len(results)]:
            running = obj
        elif tag == "CASE" and isinstance(obj, dict) and (running is None and not results and obj.get("case") == "-"
                                                          or running == [obj.get("case"), obj.get("dtype")]):
            try:
                results.append(CaseResult(**{**obj, "factor": plugin.name}))
            except TypeError:
                garbled = True
            running = None
        elif tag == "STATS" and isinstance(obj, dict):
            stats = obj
        elif tag == "DONE":
            done = True
        else:
            garbled = True
    if count and any(stats.values()):
        with registry._lock:
            registry._stats[plugin.name].update({k: v for k, v in stats.items() if isinstance(v, int) and v})
    if garbled:
        return [fail("-", "-", "the report of verify's child process does not match the plugin's cases "
                          "(something else wrote to it)")]
    if rc is not None and rc < 0:
        how = f"crashed: {_signal_name(-rc)}" + (f"; last stderr line: {last}" if last != "no message" else "")
    elif rc is not None and (rc != 0 or not done):
        how = f"ended with status {rc}: {last}"
    if not how:
        return results
    case, dtype = running if running else ("-", "-")
    where = "in this case" if running else ("after its cases" if results else "before its cases")
    left = len(expected) - len(results) - (1 if running else 0)
    return results + [fail(case, dtype, f"{how} ({where}; verify's child process"
                           + (f"; {left} later case(s) not run)" if left > 0 else ")"))]


def _fallback_roots(m) -> list:
    """The folders the manifest's Python fallback was imported from in this process (its top
    package's parent, or a module's own folder), for the child's sys.path: this process may have
    found it through '' or a relative entry before a chdir, or by another import mechanism."""
    if m is None or not m.fallback:
        return []
    top = m.fallback.partition(":")[0].split(".")[0]
    mod = sys.modules.get(top)
    f = getattr(mod, "__file__", None)
    if not f:
        return []
    p = Path(f).resolve()
    return [str(p.parent.parent if p.name == "__init__.py" else p.parent)]


def _wait_unreaped(proc, timeout: float):
    """The child's exit status (negative: the signal), or None after ``timeout`` seconds,
    leaving it unreaped (a zombie keeps its process group's id from being reused before
    _kill_session kills the group)."""
    end = time.monotonic() + timeout
    delay = 0.001
    while True:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None and info.si_pid == proc.pid:
            return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        if _adopting:
            _reap_adopted_zombies(proc.pid)
        if time.monotonic() >= end:
            return None
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


@contextlib.contextmanager
def _signals_held(block_in_thread: bool = True):
    """Ctrl-C and SIGTERM wait until the block is done, then take effect: in the main thread
    their Python handlers are held (a signal may reach any thread of the process, and Python
    runs its handler in the main thread whichever it was) and the signals raised again after;
    in another thread, where handlers cannot be set, they are blocked there (unless not
    ``block_in_thread``: around a fork, whose child would inherit the blocked mask)."""
    held, caught, blocked = {}, [], None
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) is not None:      # None: not installed from Python
                held[sig] = signal.signal(sig, lambda signum, frame: caught.append(signum))
    elif block_in_thread:
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)
        if blocked is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for sig in dict.fromkeys(caught):              # now, as if they came after the block
            signal.raise_signal(sig)


def _kill_session(proc, before=frozenset()) -> None:
    """Kill the child and whatever it started (its own session), then reap it; while adopting
    (adopt_orphans), also what left that session (setsid) and was handed to this process: its
    children that were not its children (``before``) when the child started. Ctrl-C and SIGTERM
    wait until this is done (_signals_held: a second SIGTERM cut the cleanup short)."""
    with _signals_held():
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        if _adopting:
            _kill_adopted(before)


_adopting = False   # between adopt_orphans and stop_adopting (the ex-engine verify command)


def _prctl(*args) -> int:
    import ctypes
    return ctypes.CDLL(None, use_errno=True).prctl(*args)


def adopt_orphans():
    """Make this process the subreaper of its descendants (Linux PR_SET_CHILD_SUBREAPER) until
    stop_adopting: a process a kernel in verify's child starts in a new session (setsid), which
    the session kill misses, is handed to this process when the child ends, and _kill_session
    kills it. For the `ex-engine verify` command (a library's process keeps its own setting).
    Returns the previous setting for stop_adopting, or None where it did not take effect."""
    global _adopting
    try:
        import ctypes
        prev = ctypes.c_int(0)
        if _prctl(37, ctypes.byref(prev), 0, 0, 0) != 0 or _prctl(36, 1, 0, 0, 0) != 0:  # GET/SET
            return None
    except (OSError, AttributeError):
        return None
    _adopting = True
    return prev.value


def stop_adopting(prev) -> None:
    """Undo adopt_orphans (``prev``: what it returned)."""
    global _adopting
    if prev is not None:
        _adopting = False
        with contextlib.suppress(OSError, AttributeError):
            _prctl(36, prev, 0, 0, 0)


def _children() -> list:
    """Pids whose parent is this process (from /proc; [] where there is none)."""
    me, out = os.getpid(), []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for d in entries:
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(b")") + 2:].split()   # after the name, which may hold spaces
            if len(fields) > 1 and int(fields[1]) == me:
                out.append(int(d))
    return out


def _kill_adopted(before=frozenset(), budget_s: float = 10.0) -> None:
    """Kill and reap the children of this process that are not in ``before`` (adopted orphans
    of verify's child), each with its process group (a chain of processes under one setsid goes
    at once); what they leave behind is handed over and taken in the next round, for up to
    ``budget_s`` seconds."""
    end = time.monotonic() + budget_s
    while time.monotonic() < end:
        pids = [p for p in _children() if p not in before]
        if not pids:
            return
        for pid in pids:
            for kill in (os.killpg, os.kill):   # its group (when it leads one), then itself
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    kill(pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _reap_adopted_zombies(child_pid: int) -> None:
    """While adopting: reap adopted orphans that have exited (a process that forks and exits
    over and over left thousands of zombies until the child ended), leaving ``child_pid`` (the
    verify child, reaped by _kill_session) and stopping at it."""
    for _ in range(10000):
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid in (0, child_pid):
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(info.si_pid, 0)


# ------------------------------------------------------------------------------------ cache
def cache_file() -> Path:
    """$EX_ENGINE_CACHE/verified.json, default ~/.cache/ex_engine/verified.json ($EX_ENGINE_CACHE
    empty or only whitespace counts as unset, as EX_ENGINE_FACTORS and EX_ENGINE_MANIFESTS do:
    '  ' made a folder of two spaces in the current folder)."""
    base = _paths.env_value("EX_ENGINE_CACHE") or Path.home() / ".cache" / "ex_engine"
    return Path(base) / "verified.json"


# the most bytes of verified.json read (an entry is ~400 bytes: this holds ~150,000 of them); a
# larger file, a FIFO (a read blocked load(verify=True) forever) or a device (/dev/zero filled
# memory, and the MemoryError rejected the plugin being verified) is ignored unread
CACHE_LIMIT = 64 << 20
# how long a cache update waits for another process's (or thread's) update before it writes
# without the lock
CACHE_LOCK_WAIT_S = 10.0
# the descriptors of the cache folder that _cache_locked holds open now (in any thread)
_CACHE_FDS: set = set()


def _close_cache_fds_after_fork() -> None:
    """In a child made by os.fork: close the cache folder's descriptors that the parent's
    threads held at the fork. A flock belongs to the open file description, which the child's
    copy kept alive: the lock stayed held after the parent's update released it, for as long as
    the child lived, and every later update (of any process) waited CACHE_LOCK_WAIT_S and then
    wrote unlocked."""
    for fd in list(_CACHE_FDS):
        _CACHE_FDS.discard(fd)
        try:
            os.close(fd)
        except OSError:
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_cache_fds_after_fork)


def _load_cache() -> tuple:
    """(entries of cache_file(), why the file was ignored: '' where it was read or is absent).
    Never raises: a file that is corrupt, truncated, empty, not UTF-8, not a JSON object, not a
    regular file or larger than CACHE_LIMIT counts as no entries, and the reason says which (it
    was ignored silently, and then overwritten)."""
    path = cache_file()
    try:
        raw = _paths.read_small(path, CACHE_LIMIT)
    except (FileNotFoundError, NotADirectoryError):   # no cache yet (or no folder: said at write)
        return {}, ""
    except _paths.FileRefused as exc:
        return {}, f"{path}: {exc}"
    except OSError as exc:
        return {}, f"{path}: not readable ({exc.strerror or type(exc).__name__})"
    try:
        data = json.loads(raw.decode())
    except UnicodeDecodeError:
        return {}, f"{path}: not UTF-8 text"
    except (ValueError, RecursionError) as exc:   # (RecursionError: nesting past the recursion limit)
        return {}, f"{path}: not valid JSON ({'empty file' if not raw.strip() else exc})"
    if not isinstance(data, dict):
        return {}, f"{path}: expected a JSON object {{key: entry}}, got {type(data).__name__}"
    return data, ""


@contextlib.contextmanager
def _cache_locked():
    """Hold an exclusive flock on the cache's folder (no file of its own) while an update reads,
    merges and writes verified.json, so that processes (and threads) verifying at once do not
    drop each other's entries (each read the file, added its entry and replaced it: of 12 loads
    at once, 4 to 6 entries were lost while each said 'cached'). Best effort: where the folder
    cannot be opened or locked, or another holder keeps it past CACHE_LOCK_WAIT_S, the update
    runs unlocked."""
    import fcntl
    try:
        fd = os.open(cache_file().parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        yield
        return
    _CACHE_FDS.add(fd)
    try:
        deadline = time.monotonic() + CACHE_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            except OSError:   # a file system without flock
                break
        yield
    finally:
        if fd in _CACHE_FDS:   # (not where a fork's child closed it: _close_cache_fds_after_fork)
            _CACHE_FDS.discard(fd)
            os.close(fd)   # (releases the lock)


def _update_cache(key: str, entry: dict) -> tuple:
    """Add ``entry`` under ``key`` to cache_file(), under _cache_locked: the file is read again
    there, so that entries other processes wrote meanwhile are kept. Returns (why it was not
    written, '' when it was; why the file found was ignored, '' when it was read or absent)."""
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:   # a file (or a link to one) where the folder should be
        return f"{path.parent} is not a folder", ""
    except OSError as exc:
        return _os_error(exc, exc.filename or path.parent), ""
    with _cache_locked():
        cache, ignored = _load_cache()
        cache[key] = entry
        return _write_cache(cache), ignored


def _note_ignored(registry, ignored: str) -> str:
    """The words for a cache file _load_cache ignored, also kept as a registry note (once)."""
    if not ignored:
        return ""
    note = f"verify cache {ignored}: ignored"
    if note not in registry.notes:
        registry.notes.append(note)
    return f"; the cache file found was ignored ({ignored})"


def _write_cache(data: dict) -> str:
    """Write ``data`` to cache_file(). Returns '' when written, else why not, short (e.g.
    "/etc/passwd is not a folder", "/ro/verified.json: Permission denied"): a read-only home is
    no error, verification is simply repeated next time.

    The file is written under a temporary name of its own in the same folder and renamed into
    place (trust.replace_file): writers in threads of one process shared one name ('.tmp<pid>')
    and removed or replaced each other's file, so that some of them failed."""
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:   # a file (or a link to one) where the folder should be
        return f"{path.parent} is not a folder"
    except OSError as exc:
        return _os_error(exc, exc.filename or path.parent)
    try:
        replace_file(path, json.dumps(data, indent=1, sort_keys=True), mode=0o644, fsync=False)
    except OSError as exc:
        return _os_error(exc, path)   # the cache file, not the temporary one beside it
    return ""


def _os_error(exc: OSError, where) -> str:
    """'<where>: <strerror>' of an OSError, short."""
    return f"{where}: {exc.strerror or type(exc).__name__}"


def _cache_key(registry, plugin) -> str:
    where = "host" if plugin.manifest.memory == "host" else registry.hardware.name
    return f"{plugin.sha256}|{where}"


def _context_digest(registry, plugin) -> str:
    """SHA-256 of what a library's code path depends on besides its bytes, so that a pass under
    one is not reused under another: the EX_* variables a plugin may read at load
    (_paths.plugin_env, which the registry's shared-library check compares too),
    and the tuning table rows that fill its tuned dims. A pass with EX_MOE_DECODE_CONFIG unset
    was reused with it set, a configuration that was never checked."""
    env = _paths.plugin_env()
    table = getattr(getattr(registry, "tuning", None), "factors", {}).get(plugin.name)
    rows = sorted((k, tuple(ts), tuple(vs)) for k, (ts, vs) in table.table.items()) if table is not None else []
    text = json.dumps({"env": env, "tuning": [getattr(table, "dim", None), rows]}, default=str)
    return sha256_hex(text.encode(errors="surrogateescape"))


# What a cached pass was checked with besides the library: bump VERIFY_RULES when verify's own
# checks change (2: guard zones around written arrays, fallbacks that raise SystemExit; 3: every
# output element written, by the plugin and by the fallback; 4: the worst row of each float
# output too, row_error), so a pass under weaker checks is not reused.
VERIFY_RULES = 4


def _manifest_digest(m) -> str:
    """SHA-256 of the manifest's file as it was loaded (Manifest.sha256; '' for none)."""
    return m.sha256 if m is not None else ""


_DIGEST_MAX_FILES = 2000


def _fallback_digest(registry, m) -> str:
    """SHA-256 over the sources of the Python fallback verify compares with ('' if its own file
    is unknown or unreadable: then no pass is reused, see verify_at_load): its own file and every
    .py file of its top-level package (the helpers it imports from there, e.g. ex_engine.arrays
    for ex_engine.fallbacks), so a pass against a fallback or helper since changed is not
    reused. A file of the package that cannot be read counts by its path and the error's name;
    code outside that package (NumPy, say) is not covered, nor a package of more than
    _DIGEST_MAX_FILES files (then the fallback's file alone)."""
    try:
        fn = registry._fallbacks.get(m.name) or m.fallback_fn()
        own = Path(inspect.getsourcefile(fn)).resolve()
        parts = [f"{own}\0{sha256_file(own)}"]
    except (FactorError, OSError, TypeError, RuntimeError):   # RuntimeError: a symlink loop
        return ""
    tree = set()
    root = sys.modules.get((getattr(fn, "__module__", None) or "").split(".")[0])
    try:
        for folder in getattr(root, "__path__", None) or ():   # a package: its whole tree
            tree.update(itertools.islice(Path(folder).rglob("*.py"), _DIGEST_MAX_FILES + 1))
    except (OSError, RuntimeError):
        tree = set()
    if len(tree) > _DIGEST_MAX_FILES:                           # a huge namespace: the file alone
        tree = set()
    for f in sorted(str(q) for q in tree):
        try:
            digest = sha256_file(f)   # (a FIFO named x.py: refused, not waited on)
        except (OSError, RuntimeError) as exc:   # unreadable, a folder named x.py, a dangling link
            digest = f"unreadable: {type(exc).__name__}"
        parts.append(f"{f}\0{digest}")
    return sha256_hex("\n".join(parts).encode())


def verify_at_load(registry, plugin) -> tuple:
    """(ok, detail) for ``FactorRegistry.load(..., verify=True)``: a cached pass, a fresh run
    (remembered when it passes: "N cases passed ... (cached in PATH)", or "(not cached: WHY;
    it is verified again at the next load)" when the cache cannot be written), or a skip that
    keeps the plugin (no GPU, no fallback)."""
    why = cannot_run(registry, plugin)
    if why:
        return True, f"skipped: {why}"
    key, (cache, ignored) = _cache_key(registry, plugin), _load_cache()
    with_what = {"manifest_sha256": _manifest_digest(plugin.manifest),
                 "fallback_sha256": _fallback_digest(registry, plugin.manifest), "rules": VERIFY_RULES,
                 "context_sha256": _context_digest(registry, plugin)}
    hit = cache.get(key)
    if (isinstance(hit, dict) and with_what["fallback_sha256"]   # an unknown fallback: run again
            and all(hit.get(k) == v for k, v in with_what.items())):
        return True, (f"passed before ({hit.get('cases')} cases on {key.split('|', 1)[1]}, "
                      f"{hit.get('when')}; cache {cache_file()})")
    results = verify_plugin(registry, plugin, count=False, isolate=registry.probe == "subprocess",
                            timeout=registry.verify_timeout)
    failed = [r for r in results if r.failed and r.case != "-"]
    other = [r for r in results if r.failed and r.case == "-"]   # the child itself, not one case
    if failed or other:
        n = len(plugin_cases(plugin))   # a crash leaves later cases without a row
        text = "; ".join([f"{r.case} {r.dtype}: {r.detail}" for r in failed[:3]] + [r.detail for r in other])
        head = f"{len(failed)} of {n} cases failed against the Python fallback" if failed else "could not check it"
        return False, f"{head}: {text}"
    declined = sum(r.status == "declined" for r in results)
    unwritten, ignored_now = _update_cache(key, {
        "factor": plugin.name, "file": plugin.path.name, "cases": len(results),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"), **with_what})
    where = (f"not cached: {unwritten}; it is verified again at the next load" if unwritten
             else f"cached in {cache_file()}") + _note_ignored(registry, ignored_now or ignored)
    return True, (f"{len(results) - declined} cases passed against the Python fallback"
                  + (f", {declined} declined by the plugin" if declined else "") + f" ({where})")


# ------------------------------------------------------------------------------------ report
def format_table(results: list) -> str:
    """A fixed-width table: factor, dtype, case, path, error, tolerance, result (+ detail).
    results: a list of CaseResult (verify_plugin's); ArgumentError naming 'results' otherwise."""
    if not isinstance(results, (list, tuple)) or not all(isinstance(r, CaseResult) for r in results):
        raise ArgumentError("format_table", "results", "type", "a list of CaseResult (verify_plugin's rows)",
                            f"{type(results).__name__} {results!r:.80}")
    rows = [("factor", "dtype", "case", "served by", "rel err", "tol", "result")]
    for r in results:
        err = "-" if r.error is None else f"{r.error:.2e}"
        tol = "-" if r.tol is None or r.status == "skipped" else f"{r.tol:g}" + (" (default)" if r.tol_default else "")
        rows.append((r.factor, r.dtype, r.case, r.path, err, tol, r.status))
    widths = [max(len(row[i]) for row in rows) for i in range(7)]
    lines = []
    for row, r in zip(rows, [None, *results]):   # (a tuple too, as the check allows)
        line = "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
        if r is not None and r.detail and r.status != "pass":
            line += f"  {r.detail}"
        lines.append(line)
    return "\n".join(lines)

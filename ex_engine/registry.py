"""The factor registry: loads plugins, checks them against the hardware, dispatches calls.

``FactorRegistry.load("factors/")`` opens every ``*.so`` in the folder with its own cffi
handle, reads the ABI version it was built with (before running any of its code), calls its
``ex_get_factor`` with the hardware, checks the tuning it returns, and keeps each plugin as
ready or rejected with the reason. ``dispatch`` validates a call against the factor's manifest
and runs kernel -> kernel_fallback -> Python fallback, counting which path served.
"""
from __future__ import annotations

import hashlib
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from . import _paths, abi
from .arrays import TensorRef
from .errors import (DeviceError, DeviceSideError, FactorError, FactorNotFoundError,
                     KernelError)
from .hardware import Hardware, resolve
from .manifest import Manifest, load_all

PATHS = ("plugin", "kernel_fallback", "python_fallback")


@dataclass
class Check:
    """One check a plugin went through: name, passed or not, and what was expected/found."""
    name: str
    ok: bool
    detail: str = ""


@dataclass
class Plugin:
    """A plugin library as the registry saw it. status: 'ready', 'rejected' or 'shadowed'."""
    path: Path
    status: str = "rejected"
    reason: str = ""
    name: str = ""
    factor_id: int = -1
    version: str = ""
    abi_version: int = 0
    tuning: dict = field(default_factory=dict)
    priority: int = 0
    description: str = ""
    sha256: str = ""
    checks: list = field(default_factory=list)
    manifest: Manifest | None = None
    lib: object = None
    factor: object = None

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, ok, detail))
        if not ok and self.status != "rejected_final":
            self.reason = self.reason or f"{name}: {detail}"
        return ok

    def version_key(self) -> tuple:
        parts = []
        for p in self.version.split("."):
            parts.append(int(p) if p.isdigit() else 0)
        return tuple(parts)

    def as_dict(self) -> dict:
        return {"path": str(self.path), "name": self.name, "id": self.factor_id,
                "version": self.version, "abi": abi.version_str(self.abi_version) if self.abi_version else "",
                "status": self.status, "reason": self.reason, "tuning": self.tuning,
                "priority": self.priority, "description": self.description, "sha256": self.sha256,
                "checks": [c.__dict__ for c in self.checks]}


def check_tuning(t: dict, hw: Hardware, min_elem_bytes: int = 2) -> list:
    """Every check of a tuning against the hardware: a list of Check, expected vs found."""
    ws, out = hw.warp_size, []
    tpb = t["threads_per_block"]
    out.append(Check("threads_per_block <= max_threads_per_block", 1 <= tpb <= hw.max_threads_per_block,
                     f"expected 1..{hw.max_threads_per_block}, got {tpb}"))
    out.append(Check("threads_per_block multiple of warp_size", tpb % ws == 0,
                     f"expected a multiple of {ws}, got {tpb}"))
    out.append(Check("num_warps * warp_size == threads_per_block", t["num_warps"] * ws == tpb,
                     f"expected {tpb}, got {t['num_warps']} * {ws} = {t['num_warps'] * ws}"))
    out.append(Check("shared_mem_bytes <= shared_mem_per_block_optin",
                     0 <= t["shared_mem_bytes"] <= hw.shared_mem_per_block_optin,
                     f"expected <= {hw.shared_mem_per_block_optin}, got {t['shared_mem_bytes']}"))
    vb = t["vec_size"] * min_elem_bytes
    out.append(Check("vec_size * element bytes <= 16", t["vec_size"] in (1, 2, 4, 8, 16) and vb <= 16,
                     f"expected a power of two with vec_size * {min_elem_bytes} B <= 16 B, "
                     f"got {t['vec_size']} ({vb} B)"))
    out.append(Check("items_per_thread >= 1", t["items_per_thread"] >= 1,
                     f"expected >= 1, got {t['items_per_thread']}"))
    out.append(Check("num_stages >= 1", t["num_stages"] >= 1, f"expected >= 1, got {t['num_stages']}"))
    return out


def _stream_for(refs, device):
    """The caller's current stream: torch's if any array is a torch tensor, else CuPy's."""
    for r in refs:
        if r is not None and r.kind == "torch":
            import torch
            return torch.cuda.current_stream(device).cuda_stream
    import cupy
    return cupy.cuda.get_current_stream().ptr


class FactorRegistry:
    """Plugins found in folders, the one chosen per factor name, and the dispatch to them.

    hardware: a Hardware, a profile name ('h200'), or None for the live GPU (when there is no
    GPU, the 'h200' profile, so plugins are still checked; kernels are then never called).
    manifests_dir: where factor manifests live (default manifests/); a manifest beside a
    library (<name>.yaml in its folder) takes precedence.
    """

    def __init__(self, hardware=None, manifests_dir=None):
        hw = resolve(hardware)
        self.no_gpu_note = ""
        if hw is None:
            hw = Hardware.from_profile("h200")
            self.no_gpu_note = "no GPU visible: plugins checked against profile h200, calls use the Python fallbacks"
        self.hardware: Hardware = hw
        self.manifests: dict = load_all(manifests_dir or _paths.manifests_dir())
        self.plugins: list = []
        self._chosen: dict = {}
        self._stats: dict = defaultdict(Counter)
        self._lock = threading.Lock()
        self._workspaces: dict = {}
        self._flags: dict = defaultdict(Counter)
        self._fallbacks: dict = {}
        self._bind_cache: dict = {}
        self.last_path: dict = {}
        self._hw_c = hw.to_c(abi.ffi)

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, folder=None, hardware=None, manifests_dir=None) -> "FactorRegistry":
        """A registry with every ``*.so`` of ``folder`` (default: factors/) loaded and checked."""
        reg = cls(hardware=hardware, manifests_dir=manifests_dir)
        reg.load_folder(folder or _paths.factors_dir())
        return reg

    def load_folder(self, folder) -> list:
        """Load every ``*.so`` in ``folder`` (sorted by name); returns the new Plugin records."""
        folder = Path(folder)
        if not folder.is_dir():
            raise FactorError(f"factor folder '{folder}': not a directory")
        new = [self._load_one(p) for p in sorted(folder.glob("*.so"))]
        self._choose()
        return new

    def load_library(self, path) -> Plugin:
        """Load one library file; returns its Plugin record (ready or rejected, never raises)."""
        p = self._load_one(Path(path))
        self._choose()
        return p

    def _find_manifest(self, name: str, folder: Path):
        beside = folder / f"{name}.yaml"
        if beside.exists():
            return Manifest.load(beside)
        return self.manifests.get(name)

    def _load_one(self, path: Path) -> Plugin:
        p = Plugin(path=path)
        self.plugins.append(p)
        try:
            p.sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as exc:
            p.check("read", False, str(exc))
            return p
        try:
            p.lib = abi.dlopen(path)
        except OSError as exc:
            p.check("dlopen", False, f"not a loadable shared library: {exc}")
            return p
        p.check("dlopen", True, "opened with its own handle (RTLD_LOCAL)")
        try:
            p.abi_version = int(p.lib.ex_abi_version)
        except (AttributeError, OSError) as exc:
            p.check("symbol ex_abi_version", False,
                    f"not exported ({exc}); build with EX_DEFINE_ABI_VERSION() from include/ex_engine.h")
            return p
        major = p.abi_version >> 16
        if not p.check("abi version", major == abi.ABI_VERSION_MAJOR,
                       f"expected major {abi.ABI_VERSION_MAJOR} (runtime ABI "
                       f"{abi.version_str(abi.ABI_VERSION)}), library built against "
                       f"{abi.version_str(p.abi_version)}"):
            return p
        try:
            get = p.lib.ex_get_factor
        except (AttributeError, OSError) as exc:
            p.check("symbol ex_get_factor", False, f"not exported ({exc})")
            return p
        f = get(self._hw_c)
        if not p.check("ex_get_factor(hw)", f != abi.ffi.NULL,
                       f"returned NULL for {self.hardware.name} ({self.hardware.source}): "
                       "the factor declines this hardware"):
            return p
        p.factor = f
        if not p.check("struct abi_version", f.abi_version == p.abi_version,
                       f"expected {abi.version_str(p.abi_version)}, got {abi.version_str(f.abi_version)}"):
            return p
        if not p.check("name", f.name != abi.ffi.NULL, "expected a name, got NULL"):
            return p
        p.name = abi.ffi.string(f.name).decode(errors="replace")
        p.factor_id = int(f.factor_id)
        p.version = abi.ffi.string(f.version).decode(errors="replace") if f.version != abi.ffi.NULL else ""
        p.priority = int(f.priority)
        p.description = abi.ffi.string(f.description).decode(errors="replace") if f.description != abi.ffi.NULL else ""
        p.tuning = {k: int(getattr(f.tuning, k)) for k in abi.TUNING_FIELDS}
        if not p.check("kernel", f.kernel != abi.ffi.NULL, "expected a kernel function, got NULL"):
            return p
        if not p.check("version", bool(p.version), "expected a version string, got NULL/empty"):
            return p
        p.check("name matches file stem", True,  # informative: a renamed drop-in still loads
                "yes" if p.name == path.stem else f"note: name '{p.name}' differs from file '{path.name}'")
        m = self._find_manifest(p.name, path.parent)
        if not p.check("manifest", m is not None,
                       f"expected {p.name}.yaml beside the library or in the manifests folder, found none"):
            return p
        p.manifest = m
        if not p.check("manifest id", m.id == p.factor_id,
                       f"expected id {m.id} (from {m.path}), library says {p.factor_id}"):
            return p
        elem = min((abi.DTYPE_BYTES.get(d, 4) for d in (m.input.dtypes or ["float32"])), default=4)
        for c in check_tuning(p.tuning, self.hardware, elem):
            p.check(c.name, c.ok, c.detail)
        if any(not c.ok for c in p.checks):
            return p
        p.status, p.reason = "ready", ""
        return p

    def _choose(self) -> None:
        """Pick one ready plugin per name: highest version, then priority, then file name."""
        by_name = defaultdict(list)
        for p in self.plugins:
            if p.status in ("ready", "shadowed"):
                p.status = "ready"
                by_name[p.name].append(p)
        self._chosen = {}
        for name, ps in by_name.items():
            ps.sort(key=lambda q: (q.version_key(), q.priority, str(q.path)), reverse=True)
            win = ps[0]
            self._chosen[name] = win
            for q in ps[1:]:
                q.status = "shadowed"
                q.reason = (f"another plugin of '{name}' wins: {win.path.name} (version {win.version}, "
                            f"priority {win.priority}) over version {q.version}, priority {q.priority}")
        ids = defaultdict(list)
        for p in self._chosen.values():
            ids[p.factor_id].append(p)
        for fid, ps in ids.items():
            if len(ps) > 1:
                ps.sort(key=lambda q: (q.manifest is not None and q.manifest.id == fid, str(q.path)))
                for q in ps[:-1]:
                    q.status = "rejected"
                    q.reason = f"factor id {fid} already taken by '{ps[-1].name}' ({ps[-1].path.name})"
                    del self._chosen[q.name]

    # ------------------------------------------------------------------ queries
    def get(self, name: str) -> Plugin | None:
        """The chosen ready plugin for ``name``, or None."""
        return self._chosen.get(name)

    def manifest(self, name: str) -> Manifest:
        """The manifest of factor ``name``. Raises FactorNotFoundError."""
        p = self._chosen.get(name)
        if p is not None and p.manifest is not None:
            return p.manifest
        if name in self.manifests:
            return self.manifests[name]
        raise FactorNotFoundError(f"no factor named '{name}': known are {sorted(set(self.manifests) | set(self._chosen))}")

    def stats(self) -> dict:
        """name -> {'plugin': n, 'kernel_fallback': n, 'python_fallback': n, 'errors': n}."""
        with self._lock:
            return {n: {k: c.get(k, 0) for k in (*PATHS, "errors")} for n, c in self._stats.items()}

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, name: str, arrays: dict, params: dict | None = None) -> str:
        """Validate and run factor ``name`` on ``arrays`` (names as in its manifest).

        Returns the path that served: 'plugin', 'kernel_fallback' or 'python_fallback'.
        Raises an ArgumentError subclass before any C call if an argument breaks the
        manifest; KernelError if a kernel returns an error status (named).
        """
        m = self.manifest(name)
        refs_by_name = {k: TensorRef.of(v, k) for k, v in arrays.items() if v is not None}
        # A call with the same dtypes, shapes, strides, device and params as an earlier valid
        # one needs only its pointers checked: the bound dims are reused (host overhead).
        sig = (name, tuple((k, r.dtype, r.shape, r.strides, r.device, r.contiguous)
                           for k, r in refs_by_name.items()),
               tuple(sorted(params.items())) if params else ())
        hit = self._bind_cache.get(sig)
        try:
            if hit is None:
                refs, dims, sizes, pvals, device = m.bind(refs_by_name, params)
                if len(self._bind_cache) > 4096:
                    self._bind_cache.clear()
                self._bind_cache[sig] = ([s.name if not s.same_as_output else m.output.name
                                          for s in m.tensors], dims, sizes, pvals, device)
            else:
                order, dims, sizes, pvals, device = hit
                refs = [refs_by_name.get(n) for n in order]
                for i, spec in enumerate(m.tensors):
                    if refs[i] is not None and spec.role != "workspace":
                        m.check_alignment(spec.name, refs[i])
                if m.workspace_index is not None:
                    refs[2 + m.workspace_index] = None
        except FactorError:
            self._count(name, "errors")
            raise
        plugin = self._chosen.get(name)
        path = None
        if plugin is not None and m.memory == "host":
            if device >= 0:
                self._count(name, "errors")
                raise DeviceError(name, m.tensors[0].name, "device", "host memory (a host factor)",
                                  f"cuda:{device}")
            path = self._call_plugin(plugin, m, refs, dims, host=True)
        elif plugin is not None and device >= 0 and self.hardware.live:
            if device != self.hardware.device_id:
                self._count(name, "errors")
                raise DeviceError(name, m.tensors[0].name, "device", f"cuda:{self.hardware.device_id} "
                                  "(the registry's device)", f"cuda:{device}")
            path = self._call_plugin(plugin, m, refs, dims)
        if path is None:
            fn = self._fallbacks.get(name) or m.fallback_fn()
            if fn is None:
                self._count(name, "errors")
                raise FactorError(f"{name}: no plugin took the call and the manifest names no Python fallback")
            flags = fn(refs_by_name, sizes, pvals)
            if flags:
                with self._lock:
                    self._flags[name].update(flags)
            path = "python_fallback"
        self._count(name, path)
        self.last_path[name] = path
        return path

    def _count(self, name, key):
        with self._lock:
            self._stats[name][key] += 1

    def set_fallback(self, name: str, fn) -> None:
        """Use ``fn(arrays, sizes, params)`` as the Python fallback of ``name`` (over the manifest's)."""
        self._fallbacks[name] = fn

    def _workspace(self, plugin: Plugin, dims, device: int):
        """A zeroed buffer of at least workspace_size(dims) bytes, kept and grown per (factor, device)."""
        fn = plugin.factor.workspace_size
        if fn == abi.ffi.NULL:
            return None
        need = int(fn(dims, len(dims)))
        key = (plugin.name, device)
        buf = self._workspaces.get(key)
        if buf is None or buf.nbytes < need:
            if device < 0:
                import numpy
                buf = numpy.zeros(max(need, 256), dtype=numpy.uint8)
            else:
                import cupy
                with cupy.cuda.Device(device):
                    buf = cupy.zeros(max(need, 256), dtype=cupy.uint8)
            self._workspaces[key] = buf
        return buf

    def _call_plugin(self, plugin: Plugin, m: Manifest, refs, dims, host: bool = False):
        ffi = abi.ffi
        f = plugin.factor
        aux = ffi.new("const void*[]", max(len(m.aux), 1))
        ws_index = m.workspace_index
        for i, ref in enumerate(refs[2:]):
            aux[i] = ffi.NULL if ref is None else ffi.cast("const void*", ref.ptr)
        if ws_index is not None:
            ws = self._workspace(plugin, dims, -1 if host else self.hardware.device_id)
            ptr = 0 if ws is None else (ws.ctypes.data if host else ws.data.ptr)
            aux[ws_index] = ffi.cast("const void*", ptr)
        dims_c = ffi.new("int64_t[]", dims)
        stream = ffi.cast("void*", 0 if host else _stream_for(refs, self.hardware.device_id))
        out = ffi.cast("void*", refs[0].ptr)
        inp = ffi.cast("const void*", refs[1].ptr)
        status = f.kernel(out, inp, aux, len(m.aux), dims_c, len(dims), stream)
        if status == abi.EX_OK:
            return "plugin"
        if status == abi.EX_FALLBACK and f.kernel_fallback != ffi.NULL:
            status = f.kernel_fallback(out, inp, aux, len(m.aux), dims_c, len(dims), stream)
            if status == abi.EX_OK:
                return "kernel_fallback"
        if status == abi.EX_FALLBACK:
            return None
        detail = ""
        if f.last_error != ffi.NULL:
            detail = ffi.string(f.last_error()).decode(errors="replace")
        self._count(plugin.name, "errors")
        raise KernelError(plugin.name, status, abi.status_name(status), detail)

    def check_device_errors(self) -> None:
        """Raise DeviceSideError if any call since the last check flagged bad input.

        Kernels set bits in the int32 at offset 0 of their workspace (moe_fused_gemm: bit 0,
        a topk_id outside [0, E)); the Python fallbacks report the same through counters.
        Reading the device word synchronises with the device; call it outside graph capture.
        """
        problems = []
        for (name, dev), buf in self._workspaces.items():
            if dev < 0:
                word = int(buf[:4].view("int32")[0])
            else:
                import cupy
                with cupy.cuda.Device(dev):
                    word = int(buf[:4].view(cupy.int32).get()[0])
            if word:
                buf[:4].fill(0)
                problems.append(f"{name}: device status word 0x{word:x} "
                                f"({self._flag_text(name, word)})")
        with self._lock:
            for name, c in self._flags.items():
                for k, n in c.items():
                    problems.append(f"{name}: {k} in {n} slot(s) (Python fallback)")
            self._flags.clear()
        if problems:
            raise DeviceSideError("; ".join(problems))

    def _flag_text(self, name, word) -> str:
        m = self.manifests.get(name)
        bits = (getattr(m, "device_flags", None) or {}) if m else {}
        texts = [bits.get(b, f"bit {b}") for b in range(32) if word >> b & 1]
        return ", ".join(texts)

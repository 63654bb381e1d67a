"""The hardware a factor is checked against: the live GPU (CuPy) or a named profile.

A profile is a YAML file in manifests/hardware/ whose keys are the fields of ex_hardware_t
(include/ex_engine.h), each once, and no other key (an unknown one is refused with the nearest
field, as a manifest's are). ``Hardware.detect()`` reads the live device when CuPy and a GPU are
present; otherwise the registry uses a profile and never calls a kernel.
"""
from __future__ import annotations

import dataclasses
import numbers
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from . import _paths, _yaml
from ._yaml import brief
from .errors import FactorError, is_integer, one_line

NO_CUPY = "CuPy cannot be imported"   # how from_device's message starts when CuPy is missing

FIELDS = ("cc_major", "cc_minor", "multiprocessor_count", "warp_size", "max_threads_per_block",
          "max_threads_per_multiprocessor", "regs_per_block", "regs_per_multiprocessor",
          "shared_mem_per_block", "shared_mem_per_block_optin", "shared_mem_per_multiprocessor",
          "l2_cache_bytes", "global_mem_bytes")

_INT32_MAX, _INT64_MAX = 2 ** 31 - 1, 2 ** 63 - 1
# {field: (least value, greatest value)}: the widths of ex_hardware_t's fields (int32_t for the
# compute capability, counts and registers; int64_t for bytes); a count of 0 means nothing (a
# warp of no threads, a GPU of no SMs), so those start at 1
LIMITS = {f: (0 if f in ("cc_major", "cc_minor") else 1, _INT32_MAX) for f in FIELDS[:8]}
LIMITS.update({f: (0, _INT64_MAX) for f in FIELDS[8:12]})
LIMITS["global_mem_bytes"] = (1, _INT64_MAX)
# Plausible values, tighter than the C types (cc_minor 99 showed as sm_999, warp_size 7 or
# max_threads_per_block 1 made every plugin "decline this hardware" without a reason):
# - cc_minor 0..9: an architecture is named sm_<major><minor> with one digit of minor (a fatbin's
#   arch is 10 * major + minor), so 10 and above read as another architecture;
# - cc_major 1..20: CUDA's compute capabilities run 1.x .. 12.x today; 20 leaves room for future
#   generations and refuses a typo such as 99 (sm_990);
# - warp_size 32 or 64: NVIDIA's warps are 32 threads, AMD's (HIP) and Iluvatar's 64; the kernels'
#   warp-level code is written for those two;
# - max_threads_per_block 32..4096 and a multiple of warp_size: a block holds whole warps, at
#   least one; CUDA's and HIP's limit is 1024 today (4096 leaves room).
LIMITS.update({"cc_major": (1, 20), "cc_minor": (0, 9), "max_threads_per_block": (32, 4096)})
CHOICES = {"warp_size": (32, 64)}
_WHY = {"cc_major": "CUDA's compute capabilities are 1.x .. 12.x today",
        "cc_minor": "one digit: the architecture is sm_<major><minor>",
        "max_threads_per_block": "whole warps, CUDA's and HIP's limit is 1024"}


def device_name(v):
    """A device name as YAML may give it: a number (name: 4090) as its text; anything else as
    it is (check_fields judges it)."""
    return str(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else v


def check_fields(values: dict, where: str) -> None:
    """Raise FactorError unless ``values`` holds a non-empty string ``name`` and, for each of
    FIELDS, an integer (not a bool, not a float) that fits its ex_hardware_t field.

    ``where`` starts the message, e.g. "hardware profile manifests/hardware/h200.yaml".
    """
    name = device_name(values.get("name"))
    if not isinstance(name, str) or not name.strip():
        raise FactorError(f"{where}: name: expected a non-empty string (the device name), got {brief(name)}")
    for f in FIELDS:
        v = values.get(f)
        lo, hi = LIMITS[f]
        not_int = not is_integer(v)
        if f in CHOICES:
            if not_int or v not in CHOICES[f]:
                raise FactorError(f"{where}: {f}: expected {' or '.join(map(str, CHOICES[f]))} (NVIDIA's "
                                  f"warps are 32 threads, AMD's and Iluvatar's 64), got {brief(v)}")
            continue
        if not_int or not lo <= v <= hi:
            why = _WHY.get(f) or ("int32_t" if hi == _INT32_MAX else "int64_t")
            raise FactorError(f"{where}: {f}: expected an integer >= {lo}, at most {hi} ({why}), "
                              f"got {brief(v)}")
    tpb, warp = values.get("max_threads_per_block"), values.get("warp_size")
    if tpb % warp:
        raise FactorError(f"{where}: max_threads_per_block: expected a multiple of warp_size {warp} "
                          f"(a block holds whole warps), got {tpb}")


class NoDeviceError(FactorError):
    """No CUDA device is visible (no CuPy, no GPU, no driver): Hardware.detect() answers None."""


@dataclass(frozen=True)
class Hardware:
    """One device's limits (units: threads, registers, bytes), as in ex_hardware_t.

    ``source`` says where they came from ("device 0" or "profile h200"); ``live`` is True only
    for a GPU in this process, the one case in which kernels can be called; ``device_id`` is the
    CUDA device index (an int >= 0), or -1 for a profile. Raises FactorError naming the field for
    a value that breaks these rules (live must be a bool, device_id an int >= -1, source a
    string) or check_fields'.
    """
    name: str
    cc_major: int
    cc_minor: int
    multiprocessor_count: int
    warp_size: int
    max_threads_per_block: int
    max_threads_per_multiprocessor: int
    regs_per_block: int
    regs_per_multiprocessor: int
    shared_mem_per_block: int
    shared_mem_per_block_optin: int
    shared_mem_per_multiprocessor: int
    l2_cache_bytes: int
    global_mem_bytes: int
    source: str = "profile"
    live: bool = False
    device_id: int = -1

    def __post_init__(self):
        # a Hardware built by hand (or by Hardware(**d)) is held to a profile's rules: to_c
        # could not fill ex_hardware_t with the rest, and a plugin would decline a warp of 0
        check_fields(dataclasses.asdict(self), f"Hardware ({self.source})")
        if not isinstance(self.source, str):
            raise FactorError(f"Hardware: source: expected a string (e.g. 'device 0', 'profile h200'), "
                              f"got {self.source!r}")
        if not isinstance(self.live, bool):
            raise FactorError(f"Hardware ({self.source}): live: expected True or False, got {self.live!r}")
        d = self.device_id
        if not is_integer(d) or d < -1:
            raise FactorError(f"Hardware ({self.source}): device_id: expected an int >= 0 (a CUDA "
                              f"device) or -1 (a profile), got {d!r}")
        if self.live and d < 0:
            raise FactorError(f"Hardware ({self.source}): device_id: expected an int >= 0 for a live "
                              f"device (live=True), got {d!r}")
        object.__setattr__(self, "device_id", int(d))
        object.__setattr__(self, "name", device_name(self.name))   # 4090 -> '4090'

    @property
    def compute_capability(self) -> int:
        """10 * major + minor, e.g. 90 for Hopper."""
        return 10 * self.cc_major + self.cc_minor

    def as_dict(self) -> dict:
        """The fields as a plain dict (JSON-ready; ``Hardware(**d)`` rebuilds it)."""
        return dataclasses.asdict(self)

    def to_c(self, ffi):
        """A new ``ex_hardware_t*`` (owned by the returned cdata) with these values."""
        hw = ffi.new("ex_hardware_t*")
        hw.name = self.name.encode()[:255]
        for f in FIELDS:
            setattr(hw, f, int(getattr(self, f)))
        return hw

    @classmethod
    def from_profile(cls, name_or_path) -> "Hardware":
        """Load a profile by name ('h200', 'a100', 'bi-v100'; 'h200.yaml' too) or by path to a
        YAML file (any suffix, or none).

        A bare name (no folder, no suffix) is a profile of manifests/hardware/ first; otherwise
        an existing file is read as such, and a name ending .yaml/.yml with no folder that is
        not a file here names a profile of manifests/hardware/ (case-insensitive). Raises
        FactorError naming the known profiles and what was looked for if neither exists, and
        naming the field if the file is empty, lacks a field, gives an unknown key (with the
        nearest field), or holds a value that is not an integer within its ex_hardware_t
        field's range (see LIMITS).
        """
        if not isinstance(name_or_path, (str, os.PathLike)):
            raise FactorError(f"hardware profile: expected a profile name or a path (str or "
                              f"os.PathLike), got {type(name_or_path).__name__} {name_or_path!r}")
        text = os.fspath(name_or_path)
        if isinstance(text, bytes):   # an os.PathLike may give bytes
            text = os.fsdecode(text)
        if not text.strip():
            raise FactorError(f"hardware profile: expected a profile name ({', '.join(list_profiles())}) "
                              f"or a path to a YAML file, got {text!r}")
        given = Path(text)
        folder = profiles_dir()
        shipped = None      # where a profile of this name would lie in manifests/hardware/
        if len(given.parts) == 1 and given.suffix.lower() in ("", ".yaml", ".yml"):
            stem = given.name[: len(given.name) - len(given.suffix)] or given.name
            shipped = folder / f"{stem.lower()}.yaml"
        try:   # (Python 3.11's is_file and exists raise where a folder above cannot be entered)
            if shipped is not None and not given.suffix and shipped.is_file():
                path = shipped
            elif given.exists():
                path = given
            elif shipped is not None and shipped.is_file():
                path = shipped
            else:
                path = None
        except OSError as exc:
            raise FactorError(f"hardware profile '{text}': cannot be reached ({exc.strerror or exc}: "
                              f"{exc.filename}); expected a profile name or a readable YAML file") from None
        if path is None:
            looked = f"the file {given}" + (f" and {shipped}" if shipped is not None else "")
            problem = profiles_problem()
            if problem:   # no profile at all: the cause leads (it said "expected one of []" first)
                raise FactorError(f"hardware profile '{text}': no profiles to choose from: {problem}; "
                                  f"expected a folder of profiles there, or a path to a YAML file "
                                  f"(looked for {looked})")
            raise FactorError(f"hardware profile '{text}': no such profile; expected one of "
                              f"{list_profiles()} or a path to a YAML file (looked for {looked})")
        if _paths.is_dir(path):
            raise FactorError(f"hardware profile {path}: a directory; expected a YAML file")
        try:
            data = _yaml.load(_paths.read_small(path).decode(), name=path)
        except _paths.FileRefused as exc:   # a FIFO, a device, a file of gigabytes: not read
            raise FactorError(f"hardware profile {path}: {exc}; expected a YAML file") from None
        except (OSError, ValueError, yaml.YAMLError) as exc:
            raise FactorError(f"hardware profile {path}: malformed ({type(exc).__name__}: {one_line(exc)})") from None
        if data is None:
            raise FactorError(f"hardware profile {path}: empty profile; expected a mapping of name "
                              f"and the {len(FIELDS)} fields of ex_hardware_t ({FIELDS[0]} .. {FIELDS[-1]})")
        if not isinstance(data, dict):
            raise FactorError(f"hardware profile {path}: expected a mapping of fields, got {type(data).__name__}")
        # strict as a manifest: a misspelt field (warpsize:) was ignored, the real one reported
        # missing at best; a field meant for another tool was accepted without a word
        # (source, live, device_id: what `ex-engine hardware --json` adds; a profile saved from
        # it loads, those three read as this profile's own: a file is no live device)
        problem = _yaml.unknown_keys("", data, ("name",) + FIELDS + ("source", "live", "device_id"))
        if problem:
            raise FactorError(f"hardware profile {path}: {problem}")
        missing = [f for f in ("name",) + FIELDS if f not in data]
        if missing:
            raise FactorError(f"hardware profile {path}: missing fields {missing}")
        check_fields(data, f"hardware profile {path}")
        return cls(name=data["name"], **{f: int(data[f]) for f in FIELDS},
                   source=f"profile {path.stem}")

    @classmethod
    def from_device(cls, device_id: int | None = None) -> "Hardware":
        """Read the live device through CuPy. device_id: an int >= 0, or None for CuPy's current
        device. Raises FactorError for another type or a negative index; NoDeviceError (a
        FactorError) if CuPy or the GPU is absent, or if there is no device ``device_id`` (the
        message names the index and how many devices CuPy sees)."""
        if device_id is not None and (not is_integer(device_id) or device_id < 0):
            raise FactorError(f"Hardware.from_device: device_id: expected an int >= 0 (a CUDA "
                              f"device index) or None (the current device), got {device_id!r}")
        try:
            import cupy
            from cupy.cuda import runtime
        except ImportError as exc:   # not "no GPU": on a GPU machine the gpu extra is missing
            raise NoDeviceError(f"{NO_CUPY} ({exc}), so no GPU can be seen (on a GPU "
                                "machine: pip install -e '.[gpu]', cupy-cuda13x; cupy-cuda12x for CUDA 12)") from exc
        try:
            n = runtime.getDeviceCount()
        except Exception as exc:  # CUDARuntimeError: no driver or no GPU here
            raise NoDeviceError(f"no CUDA device visible to CuPy: {exc}") from exc
        if device_id is not None and device_id >= n:
            raise NoDeviceError(f"CUDA device {device_id}: no such device; CuPy sees {n} "
                                + (f"(indices 0 .. {n - 1})" if n else "(no GPU)"))
        try:
            if device_id is None:
                device_id = cupy.cuda.Device().id
            device_id = int(device_id)
            p = runtime.getDeviceProperties(device_id)
        except Exception as exc:  # CUDARuntimeError: the device cannot be read
            raise NoDeviceError(f"CUDA device {device_id if device_id is not None else '(current)'}: "
                                f"cannot read its properties through CuPy ({n} device(s) visible): "
                                f"{exc}") from exc
        name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
        return cls(
            name=name, cc_major=p["major"], cc_minor=p["minor"],
            multiprocessor_count=p["multiProcessorCount"], warp_size=p["warpSize"],
            max_threads_per_block=p["maxThreadsPerBlock"],
            max_threads_per_multiprocessor=p["maxThreadsPerMultiProcessor"],
            regs_per_block=p["regsPerBlock"],
            regs_per_multiprocessor=p.get("regsPerMultiprocessor", p["regsPerBlock"]),
            shared_mem_per_block=p["sharedMemPerBlock"],
            shared_mem_per_block_optin=p.get("sharedMemPerBlockOptin", p["sharedMemPerBlock"]),
            shared_mem_per_multiprocessor=p.get("sharedMemPerMultiprocessor", p["sharedMemPerBlock"]),
            l2_cache_bytes=p.get("l2CacheSize", 0), global_mem_bytes=p["totalGlobalMem"],
            source=f"device {device_id}", live=True, device_id=device_id)

    @classmethod
    def detect(cls) -> "Hardware | None":
        """The live device, or None when there is no CuPy or no GPU (why: ``no_device_reason``).
        A device whose properties break a profile's rules (check_fields) raises FactorError: it
        is there, and calling it "no GPU" would send every call to the Python fallbacks without
        a word (a registry can still be loaded with a profile: hardware='h200')."""
        global no_device_reason
        try:
            hw = cls.from_device()
        except NoDeviceError as exc:
            no_device_reason = str(exc)
            return None
        no_device_reason = ""
        return hw


# why the last Hardware.detect() saw no device ('' when it saw one): CuPy missing (it starts
# with NO_CUPY), or no GPU
no_device_reason = ""


def profiles_dir() -> Path:
    """The folder of hardware profiles: <manifests>/hardware (see EX_ENGINE_MANIFESTS)."""
    return _paths.manifests_dir() / "hardware"


def list_profiles() -> list[str]:
    """Names of the profiles in manifests/hardware/."""
    return sorted(p.stem for p in profiles_dir().glob("*.yaml"))


def profiles_problem() -> str:
    """Why there are no profiles, naming the folder ('' when there are some)."""
    folder = profiles_dir()
    if list_profiles():
        return ""
    hint = _paths.not_a_checkout()
    if hint:
        return hint
    env = _paths.env_value("EX_ENGINE_MANIFESTS")
    folders = _paths.search_path(env) if env else []
    missing = [str(d) for d in folders if not _paths.is_dir(d)]
    gone = (f"; of its folders, {', '.join(missing)} {'does' if len(missing) == 1 else 'do'} not exist"
            if missing and len(folders) > 1 and not _paths.separator_hint(env) else "")
    via = f" (EX_ENGINE_MANIFESTS={env}{_paths.separator_hint(env)}{gone})" if env else ""
    problem = _paths.folder_problem(folder)
    if problem:
        return f"the profiles folder {folder} {problem}{via}"
    if not os.access(folder, os.R_OK | os.X_OK):
        return f"the profiles folder {folder} cannot be listed (no read permission){via}"
    return f"the profiles folder {folder} has no *.yaml{via}"


def resolve(hardware) -> Hardware | None:
    """Hardware from a Hardware, a profile name or path (str or os.PathLike), 'auto' or None
    (the live device, if any). Raises FactorError for any other type."""
    if isinstance(hardware, Hardware):
        return hardware
    if hardware is None or (isinstance(hardware, str) and hardware in ("auto", "device")):
        return Hardware.detect()
    if not isinstance(hardware, (str, os.PathLike)):
        raise FactorError(f"hardware: expected a Hardware, a profile name or path (str or "
                          f"os.PathLike), 'auto' or None, got {type(hardware).__name__} {hardware!r}")
    return Hardware.from_profile(hardware)

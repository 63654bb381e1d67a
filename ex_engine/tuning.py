"""Tuned launch choices kept as data: manifests/tuning/<profile>.yaml, one file per device.

A factor whose manifest has a dim with ``dim_sources: {NAME: {tuned: DEFAULT}}`` gets that
dim from this table: the entry for the call's shape (the keys the file lists, e.g. H, I, G, K)
and the largest tuned T not above the call's T (a T below every tuned T runs on DEFAULT, quietly:
a row tuned at T = 4096 says nothing of T = 1; a factor whose calls have no size T looks up
T = 0, so its table needs a row at T = 0, else it is noted as never used). A shape the file does not list runs on DEFAULT (the kernel's own heuristic) and, on a live GPU, a TuningWarning
says so once per shape, naming the file and the tuner (benchmarks/tune_moe.py) that fills it.
A table holds dim, key, values and shapes, and a shapes entry the sizes its key names, model
(the model it was tuned for, a note) and by_T, nothing else: another key (`kee: 1`, `Z: 3` in an
entry) sets the file aside as malformed, as an unknown top-level key does (a note naming the
file and the key; its shapes run on DEFAULT).
Where the dim's manifest entry gives ``range: [LO, HI]`` or ``options: [...]``, a table whose
rows use a value outside is set aside (a registry note, and on a live GPU a warning, name the
file, the values and the allowed ones; its shapes run on DEFAULT).
Of several files for one device the first by name that has a table in use serves: a file none of
whose tables can be used (each set aside as above, or none there) is passed over for the next, as
a malformed one is (a remark names it and why), and serves only where no file for the device has
a table that can be used (its notes then say why none is used).

File format (written by benchmarks/tune_moe.py)::

    device: NVIDIA H200            # matched against Hardware.name
    multiprocessor_count: 132      # and its SM count
    moe_fused_gemm:
      dim: config                  # the manifest dim this table fills
      key: [H, I, G, K]            # sizes that select a shape entry
      values: {auto: -1, tiny: 0, decode: 1, mid: 2, prefill: 3, grouped: 4, mid32: 5, mid48: 6,
               grouped64: 7, narrow: 8, decode4: 9, chunked: 10, chunked_nomc: 11,
               chunked_tail: 12}
      shapes:
        - {H: 2048, I: 768, G: 128, K: 8, model: qwen3-30b-a3b,
           by_T: [[1, tiny, 30.1, 31.0], [64, decode, 80.2, 80.9], [4096, grouped, 790.0, 792.3]]}
"""
from __future__ import annotations

import bisect
import os
import threading
import warnings
from pathlib import Path

import yaml

from . import _paths, _yaml
from ._fork import renew_after_fork
from .errors import ArgumentError, FactorError, one_line
from .hardware import Hardware, device_name


class TuningWarning(UserWarning):
    """A call ran on a default launch choice: no tuned entry for its shape on this device."""


class _Unreadable(FactorError):
    """A tuning file that cannot be read from disk (TuningTable.unreadable), as against one
    read but malformed."""


_NUMERIC_DEVICE = object()   # _read's mark (a key no YAML file can hold): the device was a number
BELOW = object()  # lookup(): the shape is tuned, but only for larger T (the default applies, quietly)


def tuning_dir() -> Path:
    """manifests/tuning/ (one YAML file per device)."""
    return _paths.manifests_dir() / "tuning"


TABLE_KEYS = ("dim", "key", "values", "shapes")   # a factor's table holds these, nothing else
SHAPE_KEYS = ("model", "by_T")   # a shapes entry: the sizes its table's key names, and these


def _int(v, what: str, lo: int | None = None) -> int:
    """An int (not a bool or a float) >= lo, else ValueError naming ``what``."""
    if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo):
        raise ValueError(f"{what}: expected an integer{f' >= {lo}' if lo is not None else ''}, got {v!r}")
    return v


class FactorTuning:
    """One factor's table: shape key -> sorted [(T, value)]."""

    def __init__(self, factor: str, data, path: str):
        try:
            self.factor, self.path = factor, path
            if not isinstance(data, dict):
                raise TypeError(f"expected a mapping, got {type(data).__name__}")
            problem = _yaml.unknown_keys("", data, TABLE_KEYS)   # (`kee: 1` passed unread)
            if problem:
                raise ValueError(problem)
            if not isinstance(data["dim"], str) or not data["dim"]:   # (str() made [config] "['config']")
                raise TypeError(f"dim: expected the name of the manifest's tuned dim (e.g. config), "
                                f"got {type(data['dim']).__name__} {_yaml.brief(data['dim'])}")
            self.dim = data["dim"]
            key = data["key"]
            if not isinstance(key, list) or not key or not all(isinstance(k, str) for k in key):
                raise TypeError(f"key: expected a non-empty list of size names (e.g. [H, I, G, K]), got {key!r}")
            twice = next((k for k in key if key.count(k) > 1), None)
            if twice is not None:   # ([H, H] for [H, I]: every entry held H to itself)
                raise ValueError(f"key: expected each size once, got {twice!r} {key.count(twice)} times")
            self.key = key
            if not isinstance(data["values"], dict) or not data["values"]:
                raise TypeError("values: expected a mapping of choice names to integers")
            # -1: the kernel's own choice; below that no kernel accepts a value (moe_fused_gemm
            # refuses the call), so the file is refused here instead
            # names are strings: a row names one as written (str() made YAML's booleans of
            # `on: 1, off: 0` the names 'True' and 'False', which no row `[1, on]` could name,
            # and folded `1: 2` and '1': 3 into one name, the last kept without a word)
            for k in data["values"]:
                if not isinstance(k, str):
                    hint = (" (YAML reads unquoted on/off/yes/no/true/false as booleans: quote the "
                            "name)" if isinstance(k, bool) else " (quote it)")
                    raise TypeError(f"values: expected choice names (strings), got "
                                    f"{type(k).__name__} {_yaml.brief(k)}{hint}")
            self.values = {k: _int(v, f"values.{k}", -1) for k, v in data["values"].items()}
            # two names for one code: rows naming either run that code. An alias is harmless,
            # a slip (tiny: 1 beside decode: 1) is not: said in a remark, the table kept
            self.remarks: list = []
            seen: dict = {}
            for k, v in self.values.items():
                if v in seen:
                    a, b = sorted((seen[v], k))
                    self.remarks.append(f"values: {a!r} and {b!r} both give {v}: rows naming "
                                        f"either run configuration {v}")
                seen.setdefault(v, k)
            if not isinstance(data["shapes"], list):
                raise TypeError("shapes: expected a list")
            self.table: dict = {}
            for i, entry in enumerate(data["shapes"]):
                if not isinstance(entry, dict):
                    raise TypeError(f"shapes[{i}]: expected a mapping {{<key sizes>, by_T}}, got {entry!r}")
                missing = [k for k in self.key if k not in entry]
                if missing:
                    raise ValueError(f"shapes[{i}]: no {missing[0]!r}, a size the key {self.key} names "
                                     f"(the entry has {sorted(map(str, entry))})")
                known = [*self.key, *SHAPE_KEYS]
                problem = _yaml.unknown_keys(f"shapes[{i}]: ", entry, known)
                if problem:   # (`Z: 3` beside the key sizes passed unread)
                    # (a key shortened by hand, [H, I, G] for [H, I, G, K], left every entry's K
                    # unknown: the message names the key it is checked against)
                    unk = next(k for k in entry if k not in known)
                    if isinstance(unk, str) and unk.isidentifier() and unk.isupper():
                        problem += f" (a size of the entry must be in the file's key, {self.key}: {unk} is not)"
                    raise ValueError(problem)
                shape = tuple(_int(entry[k], f"shapes[{i}].{k}", 1) for k in self.key)
                if shape in self.table:
                    raise ValueError(f"shapes[{i}]: {dict(zip(self.key, shape))} listed twice")
                # rows [T, choice, ...]: anything after the choice (measured µs) is a note
                if not isinstance(entry.get("by_T"), list):
                    raise TypeError(f"shapes[{i}].by_T: expected a list of rows [T, configuration, its µs, "
                                    f"auto's µs], got {entry.get('by_T')!r}")
                for j, r in enumerate(entry["by_T"]):
                    if not isinstance(r, list) or len(r) < 2:
                        raise ValueError(f"shapes[{i}].by_T[{j}]: expected a row [T, configuration, its µs, "
                                         f"auto's µs] (the µs optional), got {r!r}")
                rows = []
                for j, r in enumerate(entry["by_T"]):
                    t = _int(r[0], f"shapes[{i}].by_T T", 0)
                    try:
                        choice = self._value(r[1])
                    except (TypeError, ValueError) as exc:   # (which row: a fresh user's trial)
                        raise type(exc)(f"shapes[{i}].by_T[{j}]: {exc}") from None
                    rows.append((t, choice))
                rows.sort()
                if not rows or len({t for t, _ in rows}) != len(rows):
                    raise ValueError(f"shapes[{i}].by_T: expected rows [T, choice] with distinct T")
                self.table[shape] = ([t for t, _ in rows], [v for _, v in rows])
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            # (a fresh user's trial: the README said "under `factors:`", a level the format
            # does not have; the message says where the tables go)
            hint = ("; each factor's table is a top-level key of its own (e.g. `my_op:` beside "
                    "device), not an entry under `factors:`" if factor == "factors" else "")
            raise FactorError(f"tuning file {path}: {factor}: malformed ({type(exc).__name__}: {exc}); "
                              "expected dim, key, values, shapes[{<key sizes>, by_T: [[T, choice]]}]"
                              + hint) from exc

    def _value(self, v) -> int:
        """A choice: one of the names in values, or one of their integers."""
        if isinstance(v, str):
            if v not in self.values:
                raise ValueError(f"choice {v!r} not in values {sorted(self.values)}")
            return self.values[v]
        if _int(v, "choice") not in self.values.values():
            raise ValueError(f"choice {v!r} not in values {sorted(self.values.values())}")
        return v

    def lookup(self, sizes: dict) -> int | None:
        """The tuned value for these sizes; None when the shape has no entry, BELOW when its rows
        all lie above the call's T."""
        try:
            shape = tuple(sizes[k] for k in self.key)
        except KeyError:
            return None
        hit = self.table.get(shape)
        if hit is None:
            return None
        ts, vs = hit
        i = bisect.bisect_right(ts, sizes.get("T", 0)) - 1
        return vs[i] if i >= 0 else BELOW  # below every tuned T: the default, not the first row


def _serves(factors: dict, refused: dict) -> bool:
    """Whether a file whose tables are ``factors`` has one in use: one check() did not set aside
    (``refused``: factor -> why)."""
    return any(name not in refused for name in factors)


class TuningTable:
    """Every factor's tuned choices for one device (empty when no file matches it)."""

    def __init__(self, factors: dict | None = None, path: str | None = None, warn: bool = False,
                 problems: list | None = None, folder=None, remarks: list | None = None, *,
                 candidates: list | None = None, device: str | None = None):
        # the file that serves, its tables, and those of them check() set aside (factor -> why):
        # one tuple, which check() replaces whole and value() reads once (check() may pass to
        # another file: its tables read with the other file's refusals would hand a kernel a
        # value its manifest does not allow). path, factors and refused read and set its parts.
        self._served: tuple = (path, factors or {}, {})
        # the well-formed files for this device, [(path, factors)] in name order: check() serves
        # the first with a table that can be used (before any check(), the first)
        self.candidates: list = candidates if candidates is not None else (
            [(path, self.factors)] if path is not None else [])
        self.device = device                   # the GPU's name the files were matched against
        self.folder = Path(folder) if folder else tuning_dir()   # where the files were looked for
        self.warn = warn
        self.problems: list = problems or []   # files skipped, unreadable or malformed (message each)
        # well-formed files not used, and why; two names for one code in a table (message
        # each): those said on reading, and those on which file serves (check() redoes these)
        self._read_remarks: list = list(remarks or [])
        self.remarks: list = self._read_remarks + self._choice_remarks(0, {})
        self._warned: set = set()
        self._lock = threading.Lock()
        renew_after_fork(self, "_lock")        # (a fresh lock in a forked child)
        self._overrides: dict = {}
        self.set_aside: list = []              # files for this device skipped as malformed
        # files for this device passed over by check(): well-formed, but none of their tables
        # can be used (the remarks say why)
        self.unused_files: list = []
        # the files of ``problems``, by what was wrong: ``unreadable``, not read from disk at
        # all (no permission, a dangling link, a folder); ``malformed``, read but wrong (not
        # text, not YAML, not a tuning file's form: an empty file, multiprocessor_count: many)
        self.unreadable: list = []
        self.malformed: list = []
        # why the folder itself could not be listed ('' when it could, or is not there): its
        # files were not read at all (an operations engineer's trial: an unreadable tuning/
        # folder read as "no file for this device", with no note)
        self.folder_problem: str = ""

    @property
    def path(self) -> str | None:
        """The file that serves (None: no file for this device)."""
        return self._served[0]

    @path.setter
    def path(self, value) -> None:
        self._served = (value, *self._served[1:])

    @property
    def factors(self) -> dict:
        """The tables of ``path``: factor -> FactorTuning."""
        return self._served[1]

    @factors.setter
    def factors(self, value) -> None:
        path, _, refused = self._served
        self._served = (path, value, refused)

    @property
    def refused(self) -> dict:
        """Factor -> why check() set its table (of ``path``) aside."""
        return self._served[2]

    @refused.setter
    def refused(self, value) -> None:
        self._served = (*self._served[:2], value)

    @property
    def in_use(self) -> str | None:
        """The file whose tables serve calls: ``path`` while check() has left at least one of
        its tables in use; None when there is no file, or none of its tables can apply (each
        set aside by check(): a dim no manifest has, say; ``path`` still names the file read)."""
        path, factors, refused = self._served
        if path is None or not _serves(factors, refused):
            return None
        return path

    @classmethod
    def for_hardware(cls, hardware, folder=None, report: bool = True) -> "TuningTable":
        """The table of the file in ``folder`` (manifests/tuning/*.yaml or *.yml) whose device
        and SM count match ``hardware``; warnings on defaults only for a live GPU.

        Every file is read. A malformed one is skipped (an entry in ``problems`` says why, and
        with ``report`` a TuningWarning; a registry passes report=False and lists ``problems`` in
        its notes): like a bad plugin, it never stops the registry; its shapes run on the
        kernels' defaults. Of several files for this device the first by name is used (until
        check() passes over one none of whose tables can be used: see check) and the others are
        named in ``remarks``, as is a file for this GPU's name in other letter case or for
        another SM count, and a table that gives one configuration code two names (kept: rows
        naming either run that code).

        hardware: a Hardware (or any object with ``name``, ``multiprocessor_count`` and
        ``live``), a profile name or path (str or os.PathLike: Hardware.from_profile), or None
        (no table). Raises FactorError for another type or an unknown profile."""
        if isinstance(hardware, (str, os.PathLike)):
            hardware = Hardware.from_profile(hardware)
        elif hardware is not None and not (isinstance(getattr(hardware, "name", None), str)
                                           and hasattr(hardware, "multiprocessor_count")):
            raise ArgumentError("TuningTable.for_hardware", "hardware", "type",
                                "a Hardware, a profile name or path, or None", type(hardware).__name__)
        folder = Path(folder) if folder else tuning_dir()
        warn = bool(getattr(hardware, "live", False))
        if hardware is None:
            return cls(warn=warn, folder=folder)
        try:
            with os.scandir(folder) as it:
                files = sorted(folder / e.name for e in it if e.name.endswith(_paths.TUNING_SUFFIXES))
        except (FileNotFoundError, NotADirectoryError):
            return cls(warn=warn, folder=folder)
        except OSError as exc:   # there, but not to be listed (or a folder above not entered)
            why = f"tuning folder {folder}: cannot be read ({exc.strerror or exc}): none of its files read"
            if report:
                warnings.warn(f"{why} (tuned dims take the kernels' defaults)", TuningWarning, stacklevel=2)
            t = cls(warn=warn, problems=[why], folder=folder)
            t.folder_problem, t.unreadable = why, [str(folder)]
            return t
        problems, remarks, cands, set_aside, unreadable, malformed = [], [], [], [], [], []
        for p in files:
            device = None
            try:
                data = cls._read_device(p)   # (a file that names this device and is malformed
                device = data["device"]      # further on is this device's file, set aside)
                cls._check_top(p, data)
                sms = data.get("multiprocessor_count")
                if device != hardware.name:
                    if device.lower() == hardware.name.lower():
                        remarks.append(f"tuning file {p}: device {device!r} is not this GPU's name "
                                       f"{hardware.name!r} (letter case differs): not used")
                    elif data.get(_NUMERIC_DEVICE):   # device: 5 was skipped without a word
                        remarks.append(f"tuning file {p}: device: {device} is a number; expected the "
                                       f"name of the GPU it was tuned on as `ex-engine hardware` prints "
                                       f"it (this one: {hardware.name!r}): not used")
                    continue
                if sms is not None and sms != hardware.multiprocessor_count:
                    remarks.append(f"tuning file {p}: for {device} with {sms} SMs; this one has "
                                   f"{hardware.multiprocessor_count}: not used")
                    continue
                factors = {k: FactorTuning(k, v, str(p)) for k, v in data.items()
                           if k not in ("device", "multiprocessor_count", _NUMERIC_DEVICE)}
                remarks += [f"tuning file {p}: {k}: {r}" for k, f in factors.items() for r in f.remarks]
                cands.append((str(p), factors))   # (which serves: the remarks on it, __init__)
            except FactorError as exc:
                problems.append(str(exc))
                (unreadable if isinstance(exc, _Unreadable) else malformed).append(str(p))
                if device == hardware.name:   # this device's file, set aside
                    set_aside.append(str(p))
                if report:
                    warnings.warn(f"{exc}; skipped (its shapes run on the kernels' defaults)",
                                  TuningWarning, stacklevel=2)
        if not cands:
            t = cls(warn=warn, problems=problems, folder=folder, remarks=remarks, device=hardware.name)
        else:
            t = cls(cands[0][1], cands[0][0], warn, problems, folder, remarks, candidates=cands,
                    device=hardware.name)
        t.set_aside, t.unreadable, t.malformed = set_aside, unreadable, malformed
        return t

    @staticmethod
    def _read(p: Path) -> dict:
        """The file's mapping, its device and SM count checked. Raises FactorError."""
        data = TuningTable._read_device(p)
        TuningTable._check_top(p, data)
        return data

    @staticmethod
    def _read_device(p: Path) -> dict:
        """The file's mapping, its device checked (a name; a number made a name). Raises
        FactorError: _Unreadable where the file cannot be read from disk."""
        try:
            text = _paths.read_small(p).decode()
        except _paths.FileRefused as exc:   # a FIFO, a device, a file of gigabytes: not read
            raise _Unreadable(f"tuning file {p}: {exc}") from exc
        except OSError as exc:   # a dangling link, a folder, no permission
            raise _Unreadable(f"tuning file {p}: not readable ({type(exc).__name__}: {exc})") from exc
        except UnicodeDecodeError as exc:   # binary data: read, but it is no text
            raise FactorError(f"tuning file {p}: malformed ({type(exc).__name__}: {exc}); expected "
                              "UTF-8 text") from exc
        try:
            data = _yaml.load(text, name=p)
        except yaml.YAMLError as exc:
            raise FactorError(f"tuning file {p}: not readable YAML ({type(exc).__name__}: {one_line(exc)})") from exc
        if not isinstance(data, dict):
            raise FactorError(f"tuning file {p}: expected a mapping with device, "
                              f"multiprocessor_count and one table per factor, got {type(data).__name__}")
        raw = data.get("device")
        dev = device_name(raw)   # 4090 -> '4090', as profiles
        if not isinstance(dev, str) or not dev:
            # no key at all: most likely another file (a benchmark's JSON), named as such
            keys = sorted(map(str, data))
            got = (f"got {raw!r}" if "device" in data else
                   f"got no 'device' key (top-level keys {', '.join(keys[:8])}{', ...' if len(keys) > 8 else ''}: "
                   "not a tuning file?)")
            raise FactorError(f"tuning file {p}: device: expected the name of the GPU it was "
                              f"tuned on (as `ex-engine hardware` prints it), {got}")
        data["device"] = dev
        data[_NUMERIC_DEVICE] = dev is not raw
        return data

    @staticmethod
    def _check_top(p: Path, data: dict) -> None:
        """Raise FactorError unless the top level of _read_device's ``data`` is a tuning file's:
        an SM count (an integer >= 1, or none) and a mapping per factor."""
        sms = data.get("multiprocessor_count")
        try:
            if sms is not None:
                _int(sms, "multiprocessor_count", 1)
        except ValueError as exc:
            raise FactorError(f"tuning file {p}: {exc}") from exc
        for k, v in data.items():
            if k not in ("device", "multiprocessor_count", _NUMERIC_DEVICE) and not isinstance(v, dict):
                raise FactorError(f"tuning file {p}: top-level key {k!r}: expected a factor's table "
                                  f"(a mapping with dim, key, values, shapes) or device / "
                                  f"multiprocessor_count, got {type(v).__name__}")

    def unused(self, manifests: dict) -> list:
        """Why parts of the loaded file can never apply (one message each; empty if none): a
        table for a factor no manifest names, a dim that is not one of that factor's tuned dims,
        a key that is no size of its calls (T included, for a factor whose calls have no T),
        rows that all lie above T = 0 for a factor without T (its calls look up T = 0), a value its rows use outside what the manifest allows
        for the dim (range / options). Such a table never matches a call (its shapes run on the
        defaults; check() sets it aside), so a misspelt name would otherwise pass unnoticed."""
        path, factors, _ = self._served
        return self._unused(path, factors, manifests)

    @staticmethod
    def _unused(path, factors: dict, manifests: dict) -> list:
        """unused() for the file ``path`` whose tables are ``factors``."""
        out = []
        for name, ft in sorted(factors.items()):
            m = manifests.get(name)
            if m is None:
                out.append(f"tuning file {path}: {name}: no factor of that name has a manifest "
                           f"(known: {', '.join(sorted(manifests)) or 'none'}); its table is never used")
                continue
            first = len(out)
            if ft.dim not in m.tuned_dims:
                out.append(f"tuning file {path}: {name}: dim: expected one of {name}'s tuned dims "
                           f"{m.tuned_dims}, got {ft.dim!r}; its table is never used")
            bad = [k for k in ft.key if k not in m.size_names]   # (T too, for a factor without T)
            if bad:
                out.append(f"tuning file {path}: {name}: key: {bad} no size of {name}'s calls "
                           f"(expected some of {sorted(m.size_names)}); its table is never used")
            if "T" not in m.size_names and len(out) == first:   # (a wrong dim or key said first)
                # lookup() reads a call's T as 0 when the factor has none: only rows at T = 0 apply
                if not any(rows[0] == 0 for rows, _ in ft.table.values()):
                    ts = sorted({t for rows, _ in ft.table.values() for t in rows})
                    out.append(f"tuning file {path}: {name}: by_T: {name}'s calls have no size T "
                               f"(its sizes: {sorted(m.size_names)}), so every call looks up T = 0; "
                               f"expected a row at T = 0, got rows at T = {ts}; its table is never used")
            if ft.dim in m.tuned_dims:
                # the choices its rows use (a name in values that no row uses reaches no kernel)
                ok, allowed = m.tuned_allowed(ft.dim)
                used = {v for _, vs in ft.table.values() for v in vs}
                bad = {k: v for k, v in ft.values.items() if v in used and not ok(v)}
                if bad:
                    out.append(f"tuning file {path}: {name}: values: "
                               f"{', '.join(f'{k}: {v}' for k, v in bad.items())} outside what {m.path} "
                               f"allows for {ft.dim} ({allowed}); its table is never used")
        return out

    def check(self, manifests: dict) -> list:
        """unused(manifests), and the tables it names are set aside: value() no longer reads
        them (a table whose values the manifest does not allow would otherwise hand the kernel
        a choice it refuses). Called again with more manifests, it decides again: the new
        decision replaces ``refused`` whole, so that value() in another thread meanwhile reads the
        old one or the new one (it read an empty one while it was refilled, and handed calls the
        value of a table set aside: a registry loading more plugins while serving refused those
        calls for a tuned value outside the manifest's range).

        Which file serves is decided here too: of the files for this device (``candidates``, in
        name order) the first with a table that can be used, so that a well-formed file whose
        every table is set aside (or that has none) no longer shadows the next one, the shipped
        file, say (a user's trial: a file whose only table used a value outside the manifest's
        range served nothing, and every row of the shipped file was dropped for it, while a
        malformed file in its place was skipped). Such a file is passed over (``unused_files``;
        a remark names it and why); where no file has a table that can be used, the first serves
        and the returned messages say why none of its tables is used. ``path``, its tables and
        their refusals change together (see _served); ``remarks`` is redone to say which file
        serves."""
        path, factors, _ = self._served
        # the file serving now is judged by the tables value() reads (``factors``)
        cands = [(p, factors if p == path else f) for p, f in self.candidates] or [(path, factors)]
        judged: dict = {}   # index in cands -> (messages, refused)
        served = 0
        for i, (p, f) in enumerate(cands):
            out = self._unused(p, f, manifests)
            refused = {}
            for name in f:
                why = [m for m in out if m.startswith(f"tuning file {p}: {name}: ")]
                if why:
                    refused[name] = "; ".join(why)
            judged[i] = (out, refused)
            if _serves(f, refused):
                served = i
                break
        out, refused = judged[served]
        p, f = cands[served]
        # (the files judged before the one that serves had no table in use; where none has, all
        # were judged and the first serves)
        self.unused_files = [cands[i][0] for i in judged if i != served]
        self.remarks = self._read_remarks + self._choice_remarks(served, judged, cands)
        self._served = (p, f, refused)
        return out

    def _choice_remarks(self, served: int, judged: dict, cands: list | None = None) -> list:
        """The remarks on the files for this device other than the one that serves, cands[served]
        (cands: ``candidates``): one check() passed over, none of whose tables can be used (its
        reasons, from judged: index -> (unused messages, refused)), and one after the one that
        serves ("also for"). Before any check(), judged is empty: every file taken as usable."""
        cands = self.candidates if cands is None else cands
        if len(cands) < 2:
            return []
        device = self.device or "this GPU"
        first = cands[served][0]

        def usable(i):   # a table of it in use (not judged: not checked yet, taken as usable)
            return i not in judged or _serves(cands[i][1], judged[i][1])

        out = []
        for i, (p, _) in enumerate(cands):
            if i == served:
                continue
            if not usable(i):
                head, tail = f"tuning file {p}: ", "; its table is never used"
                why = "; ".join(m[len(head):].removesuffix(tail) if m.startswith(head) else m
                                for m in judged[i][0]) or "it has no table"
                then = (f"{first} (the first file for {device} by name with a table that can be "
                        f"used) is used instead" if usable(served) else
                        f"no file for {device} has a table that can be used")
                out.append(f"tuning file {p}: for {device}, but none of its tables can be used "
                           f"({why}): set aside; {then}")
            else:
                which = "first by name" if served == 0 else "first by name with a table that can be used"
                out.append(f"tuning file {p}: also for {device}; {first} ({which}) is used, this one is not")
        return out

    def override(self, factor: str, fn) -> None:
        """Use ``fn(sizes) -> int`` for ``factor``'s tuned dim (the tuner forces each choice);
        None removes the override. factor: a str; fn: a callable or None. Raises ArgumentError
        naming the argument otherwise (here, not at the next dispatch)."""
        if not isinstance(factor, str):
            raise ArgumentError("TuningTable.override", "factor", "type", "a factor name (str)",
                                type(factor).__name__)
        if fn is not None and not callable(fn):
            raise ArgumentError("TuningTable.override", "fn", "type",
                                "a callable fn(sizes) -> int, or None", f"{type(fn).__name__} {fn!r}")
        with self._lock:
            if fn is None:
                self._overrides.pop(factor, None)
            else:
                self._overrides[factor] = fn

    def value(self, factor: str, dim: str, sizes: dict, default: int) -> int:
        """The value of ``factor``'s tuned dim ``dim`` for ``sizes``; ``default`` (with a
        TuningWarning once per shape on a live GPU) when the table has no entry."""
        fn = self._overrides.get(factor)
        if fn is not None:
            v = fn(sizes)
            # an integer (NumPy's too), not a bool or a float that int() would quietly truncate
            if isinstance(v, bool) or not hasattr(v, "__index__"):
                raise FactorError(f"{factor}: the tuning override for dim {dim!r} returned "
                                  f"{v!r} ({type(v).__name__}); expected an integer")
            return int(v)
        # read once: check() in another thread may replace it meanwhile (another file's tables,
        # or the same ones with other refusals)
        path, factors, refused = self._served
        ft = factors.get(factor) if factor not in refused else None
        v = ft.lookup(sizes) if ft is not None and ft.dim == dim else None
        if v is BELOW:
            return default
        if v is not None:
            return v
        if self.warn:
            key = ft.key if ft is not None else sorted(k for k in sizes if k != "T")
            shape = tuple((k, sizes.get(k)) for k in key)
            with self._lock:
                new = (factor, shape) not in self._warned
                self._warned.add((factor, shape))
            if new and factor in refused:
                warnings.warn(f"{factor}: running on the kernel's default choice of {dim}: "
                              f"{refused[factor]}", TuningWarning, stacklevel=4)
            elif new:
                how = ("unreadable or malformed" if self.unreadable and self.malformed
                       else "unreadable" if self.unreadable else "malformed")
                where = path or (f"{self.folder} (this device's file set aside as malformed: "
                                 f"{'; '.join(self.problems)})" if self.set_aside else
                                 f"{self.folder} (no file for this device; skipped as "
                                 f"{how}: {'; '.join(self.problems)})" if self.problems
                                 else f"{self.folder} (no file for this device)")
                warnings.warn(
                    f"{factor}: no tuned {dim} for {', '.join(f'{k}={v}' for k, v in shape)} in "
                    f"{where}; running on the kernel's default choice. Run benchmarks/tune_moe.py "
                    "on this GPU to tune it.", TuningWarning, stacklevel=4)
        return default

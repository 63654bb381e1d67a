"""Where ex_engine finds its factors, manifests and hardware profiles.

The project root is the folder above this package (an editable install, or PYTHONPATH set to
a checkout). A wheel (``pip install .``, ``python -m build``) carries a copy of manifests/ in
the package (ex_engine/manifests: pyproject's package-dir), used where the root has none, and no
plugin libraries (they are built in the checkout). EX_ENGINE_FACTORS and EX_ENGINE_MANIFESTS
override the two folders; set to an empty string they count as unset (as EX_ENGINE_CACHE
does), so the defaults apply.

EX_ENGINE_MANIFESTS may name several folders joined with os.pathsep (':' on Linux), searched in
order, as PATH is: a factor's manifest is taken from the first folder that has one of its name;
the hardware profiles (hardware/), the tuning files (tuning/) and the model list
(moe_models.yaml) come from one folder, the first of the list that has a hardware/ folder (so
``EX_ENGINE_MANIFESTS=$HOME/my_manifests:<checkout>/manifests`` keeps the shipped profiles,
tuning and factors' manifests beside the author's); another folder's tuning/ files are not read,
and the registry notes so (unread_tuning). An entry that is no folder is skipped, with a
note; none being a folder is an error naming the variable, its value and what each entry is
(usable_folders: the registry checks it first, before any hardware profile is looked for in
it). The registry's manifests_dir= takes the same form, by the same rule.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from .errors import FactorError

ROOT = Path(__file__).resolve().parents[1]
# the copy of manifests/ an installed wheel carries (absent in a checkout: see pyproject.toml)
PACKAGE_MANIFESTS = Path(__file__).resolve().parent / "manifests"

# the most bytes read of a manifest, lock file, hardware profile or tuning file (the shipped
# ones are a few KiB; a file above this is no such file: a core dump, a disk image)
TEXT_FILE_LIMIT = 4 << 20


class FileRefused(OSError):
    """A file read_small refuses before reading it: not a regular file, or over its size limit
    (the message says which, without the file's name: the caller names it)."""


def bytes_text(n: int) -> str:
    """1099511627776 -> '1.00 TiB' (a size for a message)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def too_large(size: int, limit: int, what: str = "such file") -> str:
    """FileRefused's words for a file of ``size`` bytes over ``limit`` (``what`` is never that
    large)."""
    return (f"{bytes_text(size)} ({size} bytes), over the limit of {bytes_text(limit)}: not read "
            f"(no {what} is that large)")


def read_chunks(path, limit: int, size: int = 1 << 20):
    """The bytes of the regular file ``path`` (links followed), in chunks of up to ``size``
    bytes (a generator: nothing is opened before the first chunk is asked for). The file must
    not exceed ``limit`` bytes. Raises FileRefused, before reading anything, for what is not a
    regular file (a FIFO blocked a read forever; /dev/zero filled memory) or a file over
    ``limit`` (its size named; one that grows past it while read is refused too);
    IsADirectoryError for a folder (as reading one raises); another OSError where the file
    cannot be opened or read. The file is opened non-blocking, so a FIFO is refused, not waited
    on."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fsdecode(path))
        if not stat.S_ISREG(st.st_mode):
            kind = next((what for test, what in _KINDS if test(st.st_mode)), "not a file")
            raise FileRefused(f"not a regular file ({kind}): not read")
        if st.st_size > limit:
            raise FileRefused(too_large(st.st_size, limit))
        n = 0
        while True:
            chunk = os.read(fd, size)
            if not chunk:
                return
            n += len(chunk)
            if n > limit:
                raise FileRefused(f"over the limit of {bytes_text(limit)} (it grew while read): not used")
            yield chunk
    finally:
        os.close(fd)


def read_small(path, limit: int = TEXT_FILE_LIMIT) -> bytes:
    """The bytes of the regular file ``path``, of at most ``limit`` bytes (a manifest, a lock
    file, a hardware profile, a tuning file). Raises as read_chunks does."""
    return b"".join(read_chunks(path, limit))


def env_value(var: str) -> str:
    """$var, or '' where it is unset, empty or only whitespace: such a value is unset (Path('')
    is '.', the current folder, and '  ' a folder of two spaces, which nobody means)."""
    v = os.environ.get(var) or ""
    return v if v.strip() else ""


# EX_* variables that no plugin library reads: the runtime's own folders (EX_ENGINE_*) and the
# commit a benchmark records in its result (EX_COMMIT, benchmarks/_timing.run_meta)
_NOT_PLUGIN_ENV = ("EX_COMMIT",)


def plugin_env() -> tuple:
    """The EX_* variables a plugin library may read at load (README's table), sorted (name,
    value) pairs; the runtime's own EX_ENGINE_* folders and EX_COMMIT (a benchmark's metadata)
    change nothing in a library. What two loads of one library (registry._load_context) and a
    cached verify pass (verify._context_digest) are compared on."""
    return tuple(sorted((k, v) for k, v in os.environ.items()
                        if k.startswith("EX_") and not k.startswith("EX_ENGINE_")
                        and k not in _NOT_PLUGIN_ENV))


def _from_env(var: str, default: Path) -> Path:
    return Path(env_value(var) or default)


def factors_dir() -> Path:
    """Default folder of plugin libraries: $EX_ENGINE_FACTORS (when set and not only
    whitespace: env_value) or <root>/factors."""
    return _from_env("EX_ENGINE_FACTORS", ROOT / "factors")


def search_path(value) -> list[Path]:
    """The folders of ``value`` (a str or os.PathLike): split at os.pathsep, empty entries
    dropped; a value that is itself an existing directory is that one folder (a folder's name
    may hold the separator)."""
    text = os.fspath(value)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text or os.path.isdir(text):
        return [Path(text)] if text else []
    return [Path(part) for part in text.split(os.pathsep) if part]


def separator_hint(value) -> str:
    """' (folders are joined with ':' here, not ';')' where a search path that names no folder
    holds the other platform's separator, else ''."""
    other = ";" if os.pathsep == ":" else ":"
    text = os.fsdecode(os.fspath(value)) if value else ""
    if other in text and not any(p.is_dir() for p in search_path(text)):
        return f" (folders are joined with {os.pathsep!r} here, not {other!r})"
    return ""


def is_dir(path) -> bool:
    """Path.is_dir that answers False where the path cannot be reached (a folder above it that
    this user may not enter): Python 3.11's raises PermissionError there."""
    try:
        return Path(path).is_dir()
    except OSError:
        return False


def folder_problem(path) -> str:
    """Why ``path`` is no folder, in a few words ('' when it is one): 'does not exist' (a
    dangling link says so), 'is a file, not a folder', 'is not a folder' (a socket, say), or
    'cannot be reached (Permission denied)' (a folder above it this user may not enter)."""
    p = Path(path)
    try:
        if p.is_dir():
            return ""
        if not p.exists():
            return "does not exist" + (" (a link to nothing)" if p.is_symlink() else "")
        return "is a file, not a folder" if p.is_file() else "is not a folder"
    except OSError as exc:
        return f"cannot be reached ({exc.strerror or exc})"


def usable_folders(value, what: str) -> tuple[list[Path], list[str]]:
    """The folders of the search path ``value`` (see search_path) that exist, and a note for
    each entry that is no folder ("manifests folder X (of the search path V) does not exist;
    skipped"): one rule for $EX_ENGINE_MANIFESTS and the registry's manifests_dir=, which takes
    the same form. Raises FactorError when no entry is a folder (or there is none), naming
    ``what`` ("EX_ENGINE_MANIFESTS" or "manifests_dir"), the value, each entry and what it is
    instead: a missing folder is then the first thing the user reads, not a consequence of it
    (a hardware profile that cannot be found in it, say)."""
    text = os.fsdecode(os.fspath(value))
    dirs = search_path(text)
    usable = [d for d in dirs if is_dir(d)]
    if not usable:
        env = what.startswith("EX_ENGINE_")
        head = f"{what}={text}" if env else f"{what} '{text}'"
        if env and is_dir(default_manifests()):
            tail = f"; unset it to use {default_manifests()}"
        else:
            tail = ""
        tail = separator_hint(text) + tail
        if not dirs:
            raise FactorError(f"{head}: names no folder; expected a folder of factor manifests, "
                              f"or several joined with {os.pathsep!r}{tail}")
        if len(dirs) == 1:
            problem = folder_problem(dirs[0])
            if env:   # the value is shown as given: say which folder the words are about
                problem = f"{'the folder ' if problem.startswith('does not') else ''}{dirs[0]} {problem}"
            raise FactorError(f"{head}: {problem}; expected a folder of factor manifests{tail}")
        entries = "; ".join(f"{d} {folder_problem(d)}" for d in dirs)
        raise FactorError(f"{head}: none of its {len(dirs)} folders is there ({entries}); "
                          f"expected at least one folder of factor manifests{tail}")
    notes = [f"manifests folder {d} (of the search path {text}) {folder_problem(d)}; skipped"
             for d in dirs if d not in usable]
    return usable, notes


def default_manifests() -> Path:
    """<root>/manifests (a checkout); where there is none, the copy an installed wheel carries
    in the package (PACKAGE_MANIFESTS); where neither is there, <root>/manifests (what the
    errors name)."""
    checkout = ROOT / "manifests"
    return PACKAGE_MANIFESTS if not is_dir(checkout) and is_dir(PACKAGE_MANIFESTS) else checkout


def manifests_dirs() -> list[Path]:
    """The manifests search path: the folders of $EX_ENGINE_MANIFESTS (see search_path; when
    set and not only whitespace: env_value) or [default_manifests()]."""
    return search_path(env_value("EX_ENGINE_MANIFESTS")) or [default_manifests()]


def home_dir(dirs) -> Path:
    """Of the manifests folders ``dirs`` (a non-empty list), the one whose hardware/, tuning/
    and moe_models.yaml are used: the first with a hardware/ folder, else the first."""
    return next((d for d in dirs if is_dir(d / "hardware")), dirs[0])


TUNING_SUFFIXES = (".yaml", ".yml")   # the names of tuning files (tuning/*.yaml, *.yml)


def unread_tuning(dirs) -> list[str]:
    """A note for each folder of the manifests search path ``dirs`` (those that are folders)
    other than home_dir's whose tuning/ holds *.yaml or *.yml files: they are not read (a new
    user's trial: a tuning file in their own folder, listed before the shipped one, was
    silently ignored). Only a listing of each tuning/ folder; one that cannot be listed says
    nothing."""
    if len(dirs) < 2:
        return []
    home = home_dir(dirs)
    why = ("the first folder of the search path with a hardware/ folder" if is_dir(home / "hardware")
           else "the first folder of the search path: none has a hardware/ folder")

    def real(d):   # (a folder reached through a symlink is the folder: a review, session 59)
        try:
            return os.path.realpath(d)
        except (OSError, ValueError):
            return str(d)

    out, seen = [], {real(home)}
    for d in dirs:   # (a folder listed twice, or under two names: one note, or none for home's)
        r = real(d)
        if r in seen:
            continue
        seen.add(r)
        try:
            with os.scandir(d / "tuning") as it:
                n = sum(e.name.endswith(TUNING_SUFFIXES) for e in it)
        except OSError:   # no tuning/ there (or not to be listed)
            continue
        if n:
            out.append(f"tuning: tuning folder {d / 'tuning'}: not read ({n} *.yaml/*.yml file(s)): "
                       f"tuning files come from {home / 'tuning'} only ({home} is {why}); "
                       "to use them, put them there")
    return out


def manifests_dir() -> Path:
    """The folder of hardware/ profiles, tuning/ and moe_models.yaml: $EX_ENGINE_MANIFESTS
    (when set and not empty; of several folders, the first with a hardware/ folder, see
    home_dir) or default_manifests(). Factor manifests are searched in all of manifests_dirs()."""
    return home_dir(manifests_dirs())


def not_a_checkout(building: bool = False) -> str:
    """Why the default folders are missing, for error messages ('' where they are not): a
    non-editable install (``pip install .``, a wheel) copies the package and its manifests
    (PACKAGE_MANIFESTS) into site-packages, and the factors and Makefile stay in the checkout
    (a copy of the package alone lacks the manifests too). building: for ``ex-engine build``,
    which needs the checkout's Makefile itself (the folder variables do not help it): the text
    then names make in the checkout, and is given whatever the variables say."""
    if not building and (env_value("EX_ENGINE_MANIFESTS") or (ROOT / "manifests").is_dir()):
        return ""
    wheel = is_dir(PACKAGE_MANIFESTS)     # an installed wheel: the manifests came with it
    if building:
        missing = "no Makefile" if wheel or (ROOT / "manifests").is_dir() else "no manifests/"
    else:
        missing = "no factors/" if wheel else "no manifests/"
    what = ("an installed wheel carries the package and its manifests, not the Makefile, the "
            "sources or the plugin libraries" if wheel else "a plain `pip install .` copies the package alone")
    why = f"ex_engine at {ROOT} is not in a checkout of its repository ({missing} beside the package: {what})"
    if building:
        return (f"{why}; build in the checkout (`make -C <checkout>`), or install it with "
                "`pip install -e <checkout>` and run `ex-engine build` again")
    if wheel:
        return (f"{why}; build the plugins in the checkout (`make -C <checkout>`), then name their "
                "folder (--dir, FactorRegistry.load(folder)) or set EX_ENGINE_FACTORS=<checkout>/factors")
    return (f"{why}; install it with `pip install -e <checkout>`, or set "
            "EX_ENGINE_MANIFESTS=<checkout>/manifests and EX_ENGINE_FACTORS=<checkout>/factors")


"""Which GPUs a plugin library can run on, read from its embedded CUDA fatbin (no code runs).

nvcc puts the device code of a shared library into the ELF section ``.nv_fatbin``: one or more
fatbin containers, each a 16-byte header followed by entries, each entry a header and a
payload (a cubin, i.e. SASS for one sm_XY, or PTX for one compute_XY). This module reads the
section headers of the ELF file with ``struct`` and walks those headers; it never decompresses
or loads anything, and needs neither cuobjdump nor a GPU.

Layouts (little endian; as written by nvcc, see CUDA's fatbinary_section.h for the section
name, and public fatbin readers for the headers):

    container header (16 B): u32 magic 0xBA55ED50, u16 version, u16 header_size, u64 fat_size
    entry header (>= 64 B):  u16 kind (1 PTX, 2 ELF/cubin), u16 version, u32 header_size,
                             u64 payload_size, u32 compressed_size, u32 -, u16 minor,
                             u16 major, u32 arch (e.g. 80, 90, 100), u32 name_offset,
                             u32 name_len, u64 flags, ...
    flags: 0x100000 an arch-specific target (sm_90a / compute_90a),
           0x200000 a family-specific target (sm_100f / compute_100f)

Rule (CUDA's compatibility rules): SASS for sm_XY runs on devices of compute capability X.y
with y >= Y; sm_XYa only on exactly X.Y; PTX compute_XY is JIT-compiled for any cc >= X.Y;
compute_XYa only for exactly X.Y; the family variants (f) stay within major X with y >= Y.
"""
from __future__ import annotations

import functools
import struct
import sys
from dataclasses import dataclass

FATBIN_SECTION = ".nv_fatbin"
FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2
FLAG_ARCH_SPECIFIC = 0x100000     # the 'a' suffix
FLAG_FAMILY_SPECIFIC = 0x200000   # the 'f' suffix

_CONTAINER = struct.Struct("<IHHQ")
_ENTRY = struct.Struct("<HHIQIIHHIIIQ")   # up to and including flags: 48 bytes


class FatbinError(ValueError):
    """The file is not an ELF64 little-endian library, or its fatbin is malformed."""


class TruncatedElfError(FatbinError):
    """An ELF64 file whose section table or loadable segments reach past its end: opening it
    with dlopen maps pages beyond the end of the file, and touching them kills the process
    with SIGBUS (an interrupted copy or build leaves such a file; so do overwritten headers,
    whose offsets and sizes then name impossible ranges)."""


_PHDR = struct.Struct("<IIQQQQQQ")  # Elf64_Phdr: type, flags, offset, vaddr, paddr, filesz, memsz, align
PT_LOAD = 1


def check_segments(data: bytes) -> None:
    """Raise TruncatedElfError if a PT_LOAD segment of the ELF64 little-endian ``data`` lies
    (partly) beyond its end; return quietly for anything else (elf_sections judges the rest)."""
    if data[:4] != b"\x7fELF" or len(data) < 0x40 or data[4] != 2 or data[5] != 1:
        return
    e_phoff, = struct.unpack_from("<Q", data, 0x20)
    e_phentsize, e_phnum = struct.unpack_from("<HH", data, 0x36)
    if e_phoff == 0 or e_phnum == 0:
        return
    if e_phentsize < _PHDR.size or e_phoff + e_phnum * e_phentsize > len(data):
        raise TruncatedElfError(f"program header table ({e_phnum} x {e_phentsize} B at {e_phoff}) "
                                f"beyond the end of the file ({len(data)} B): truncated or corrupt")
    for i in range(e_phnum):
        p_type, _, p_offset, _, _, p_filesz, _, _ = _PHDR.unpack_from(data, e_phoff + i * e_phentsize)
        if p_type == PT_LOAD and p_offset + p_filesz > len(data):
            raise TruncatedElfError(f"loadable segment {i} (bytes {p_offset}..{p_offset + p_filesz}) "
                                    f"beyond the end of the file ({len(data)} B): truncated or corrupt")


# ELF e_machine values a plugin may be built for, by name (others are named by number)
MACHINE_NAMES = {3: "x86", 40: "ARM", 21: "PowerPC64", 22: "S/390", 62: "x86-64", 183: "AArch64", 243: "RISC-V"}


def elf_machine(data: bytes):
    """The e_machine field of an ELF file's header (the CPU its code is for: 62 x86-64, 183
    AArch64), or None for ``data`` that is no ELF file or too short to say."""
    if data[:4] != b"\x7fELF" or len(data) < 20 or data[5] not in (1, 2):
        return None
    return int.from_bytes(data[18:20], "little" if data[5] == 1 else "big")


def machine_name(machine: int) -> str:
    """'AArch64 (e_machine 183)': an e_machine value for a message."""
    return f"{MACHINE_NAMES.get(machine, 'a CPU')} (e_machine {machine})"


@functools.cache
def process_machine():
    """The e_machine of this process's own executable (/proc/self/exe, else sys.executable): the
    CPU a library must be built for to be opened here; None where it cannot be read. Read once."""
    for exe in ("/proc/self/exe", sys.executable):
        try:
            with open(exe, "rb") as fh:
                found = elf_machine(fh.read(64))
        except (OSError, TypeError):
            continue
        if found is not None:
            return found
    return None


def check_machine(data: bytes) -> None:
    """Raise FatbinError if the ELF file ``data`` is built for another CPU than this process's
    (an AArch64 build, a GH200's, copied to an x86-64 server): dlopen refuses it with 'cannot
    open shared object file: No such file or directory', naming a file that is there. Quiet
    for anything else (no ELF file, an unknown own machine)."""
    own, machine = process_machine(), elf_machine(data)
    if own is not None and machine is not None and machine != own:
        raise FatbinError(f"expected a library for this process's CPU, {machine_name(own)}, got one built "
                          f"for {machine_name(machine)}")


@dataclass(frozen=True)
class CodeEntry:
    """One entry of a fatbin: kind 'sass' or 'ptx', arch as an integer (90), suffix '', 'a', 'f'."""
    kind: str
    arch: int
    suffix: str = ""

    @property
    def name(self) -> str:
        """'sm_90a' for SASS, 'compute_80' for PTX."""
        return f"{'sm' if self.kind == 'sass' else 'compute'}_{self.arch}{self.suffix}"

    def runs_on(self, cc_major: int, cc_minor: int) -> bool:
        """True if this code can run on a device of compute capability cc_major.cc_minor."""
        major, minor = divmod(self.arch, 10)
        if self.suffix == "a":
            return (major, minor) == (cc_major, cc_minor)
        if self.kind == "sass" or self.suffix == "f":
            return major == cc_major and minor <= cc_minor
        return (major, minor) <= (cc_major, cc_minor)   # plain PTX: JIT to any newer device


def elf_sections(data: bytes) -> dict:
    """name -> (offset, size) of every section of an ELF64 little-endian file.

    Raises FatbinError if ``data`` is not such a file or its section table lies outside it
    (a truncated library)."""
    return {h[0]: (h[3], h[4]) for h in _section_heads(data)}


def _section_heads(data: bytes) -> list:
    """(name, type, addr, offset, size, link, entsize) of every section of an ELF64
    little-endian file, in table order ([] without a section table). Raises FatbinError."""
    if data[:4] != b"\x7fELF":
        raise FatbinError("not an ELF file")
    if len(data) < 0x40:
        raise TruncatedElfError(f"ELF header cut short ({len(data)} of 64 B): truncated")
    if data[4] != 2 or data[5] != 1:
        raise FatbinError(f"not a 64-bit little-endian ELF (class {data[4]}, data {data[5]})")
    try:
        e_shoff, = struct.unpack_from("<Q", data, 0x28)
        e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", data, 0x3A)
        sh = struct.Struct("<IIQQQQIIQQ")
        if e_shoff == 0:
            return {}
        if e_shnum == 0:   # extended numbering: the count is in section 0's sh_size
            e_shnum = sh.unpack_from(data, e_shoff)[5]
        if e_shentsize < sh.size or e_shoff + e_shnum * e_shentsize > len(data):
            raise TruncatedElfError(f"section table ({e_shnum} x {e_shentsize} B at {e_shoff}) "
                                    f"beyond the end of the file ({len(data)} B): truncated or corrupt")
        heads = [sh.unpack_from(data, e_shoff + i * e_shentsize) for i in range(e_shnum)]
        str_off, str_size = heads[e_shstrndx][4], heads[e_shstrndx][5]
        names = data[str_off:str_off + str_size]
        out = []
        for h in heads:   # (sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, ..., sh_entsize)
            end = names.find(b"\0", h[0])
            out.append((names[h[0]:end].decode(errors="replace"), h[1], h[3], h[4], h[5], h[6], h[9]))
        return out
    except (struct.error, IndexError) as exc:
        raise FatbinError(f"malformed ELF header or section table: {exc}") from None


_SHT_DYNSYM, _SHT_NOBITS = 11, 8
_STT_OBJECT = 1
_STT_NAMES = {0: "STT_NOTYPE", 1: "STT_OBJECT", 2: "STT_FUNC", 3: "STT_SECTION", 4: "STT_FILE",
              5: "STT_COMMON", 6: "STT_TLS", 10: "STT_GNU_IFUNC"}


class SymbolProblem(str):
    """exported_u32's answer for a symbol that is defined once but is no 4-byte data object
    (a function, a 1-byte variable, a thread-local one): what is wrong with it, in words."""


_SYM = struct.Struct("<IBBHQQ")   # Elf64_Sym: st_name, st_info, st_other, st_shndx, st_value, st_size


def exported_u32(data: bytes, name: str):
    """The value of the 4-byte data object ``name`` that a shared library exports (its
    initial value in the file; no code runs), "absent" if the library's own dynamic symbol
    table does not define that name (dlsym on its handle would also search the libraries it
    links; the plugin contract asks the plugin itself to export it), or None where the file
    does not say for sure:
    no section table or .dynsym, a table that does not look like the System V ABI's (entries
    not 24 bytes, a string table outside the file), the name defined more than once (symbol
    versions: dlsym picks the default one), or one in .bss (its value is set at run time).
    A SymbolProblem (a str saying what is wrong) for a symbol defined once that is not a data
    object (STT_OBJECT: a function's machine code was read as the value) or not 4 bytes (4
    bytes were read whatever its size). The dynamic loader reads none of these tables (program
    headers only), so any other doubt is left to dlopen. Reads ELF64 .dynsym/.dynstr (Elf64_Sym)."""
    heads = _section_heads(data)
    dynsym = next((h for h in heads if h[1] == _SHT_DYNSYM), None)
    if dynsym is None:
        return None
    try:
        _, _, _, off, size, link, entsize = dynsym
        if entsize not in (0, _SYM.size) or off + size > len(data) or link >= len(heads):
            return None
        str_off, str_size = heads[link][3], heads[link][4]
        if str_off + str_size > len(data):
            return None
        names = data[str_off:str_off + str_size]
        want = name.encode() + b"\0"
        found = []
        for at in range(off, off + size - _SYM.size + 1, _SYM.size):
            st_name, st_info, _, shndx, value, st_size = _SYM.unpack_from(data, at)
            if shndx != 0 and names.startswith(want, st_name):   # defined here, this name
                found.append((shndx, value, st_size, st_info & 0xF))
        if not found:
            return "absent"
        if len(found) > 1:
            return None
        shndx, value, st_size, stype_ = found[0]
        if stype_ != _STT_OBJECT:
            kind = _STT_NAMES.get(stype_, f"symbol type {stype_}")
            return SymbolProblem(
                f"a function ({kind}), not a data object: its machine code would be read as the version"
                if kind in ("STT_FUNC", "STT_GNU_IFUNC") else f"of type {kind}, not a data object (STT_OBJECT)")
        if st_size != 4:
            return SymbolProblem(f"a {st_size}-byte data object, not a 4-byte uint32_t: 4 bytes would be read "
                                 "whatever its size")
        if shndx >= len(heads):
            return None
        _, stype, addr, soff, ssize, _, _ = heads[shndx]
        pos = soff + (value - addr)
        if stype == _SHT_NOBITS or not (soff <= pos and pos + 4 <= soff + ssize <= len(data)):
            return None
        return struct.unpack_from("<I", data, pos)[0]
    except (struct.error, IndexError) as exc:
        raise FatbinError(f"malformed dynamic symbol table: {exc}") from None


def fatbin_entries(blob: bytes) -> list:
    """Every CodeEntry of the fatbin containers in ``blob`` (the .nv_fatbin section's bytes).

    Containers may be separated by alignment padding. Raises FatbinError on a malformed
    header (sizes pointing outside the blob)."""
    out, pos = [], 0
    magic = struct.pack("<I", FATBIN_MAGIC)
    while True:
        pos = blob.find(magic, pos)
        if pos < 0 or pos + _CONTAINER.size > len(blob):
            return out
        _, _, hsize, fat_size = _CONTAINER.unpack_from(blob, pos)
        p, end = pos + hsize, pos + hsize + fat_size
        if hsize < _CONTAINER.size or end > len(blob):
            raise FatbinError(f"fatbin container at {pos}: size {fat_size} beyond the section")
        while p + _ENTRY.size <= end:
            kind, _, ehsize, psize, _, _, _, _, arch, _, _, flags = _ENTRY.unpack_from(blob, p)
            if ehsize < _ENTRY.size or p + ehsize + psize > end:
                raise FatbinError(f"fatbin entry at {p}: header {ehsize} B, payload {psize} B "
                                  "beyond its container")
            suffix = "a" if flags & FLAG_ARCH_SPECIFIC else "f" if flags & FLAG_FAMILY_SPECIFIC else ""
            if kind in (KIND_PTX, KIND_ELF):
                out.append(CodeEntry("ptx" if kind == KIND_PTX else "sass", arch, suffix))
            p += ehsize + psize
        pos = end


def library_code(data: bytes) -> list | None:
    """The CodeEntry list of a library's bytes (deduplicated, highest arch first), or None if
    it has no .nv_fatbin section (a host-only library). Raises FatbinError."""
    sections = elf_sections(data)
    if FATBIN_SECTION not in sections:
        return None
    off, size = sections[FATBIN_SECTION]
    if off + size > len(data):
        raise TruncatedElfError(f"section {FATBIN_SECTION} beyond the end of the file: truncated or corrupt")
    entries = set(fatbin_entries(data[off:off + size]))
    return sorted(entries, key=lambda e: (e.kind != "sass", -e.arch, e.suffix != "a", e.suffix))


def describe(entries: list) -> str:
    """'sm_90a, sm_80 SASS and compute_80 PTX' (or '... and no PTX', 'no SASS and ...')."""
    sass = [e.name for e in entries if e.kind == "sass"]
    ptx = [e.name for e in entries if e.kind == "ptx"]
    return (f"{', '.join(sass) + ' SASS' if sass else 'no SASS'} and "
            f"{', '.join(ptx) + ' PTX' if ptx else 'no PTX'}")


def check_code(entries: list, cc_major: int, cc_minor: int) -> tuple:
    """(ok, detail): can a device of cc_major.cc_minor run one of ``entries``?

    SASS that runs natively is preferred over PTX that needs JIT compilation."""
    target = f"sm_{cc_major}{cc_minor}"
    for kind in ("sass", "ptx"):
        for e in entries:
            if e.kind == kind and e.runs_on(cc_major, cc_minor):
                how = "SASS" if kind == "sass" else "PTX, JIT-compiled by the driver at first use"
                return True, f"{target}: ok via {e.name} ({how}); library has {describe(entries)}"
    return False, f"no SASS or PTX for {target}: library has {describe(entries)}"

"""Session 64's mutation test of ex_engine/_yaml.py and ex_engine/fatbin.py: each test fails on one
small change of the code (named in its docstring) that the rest of the suite let pass. CPU only."""
import struct
import sys

import pytest
import yaml

from ex_engine import _yaml, fatbin


@pytest.fixture(autouse=True)
def _empty_cache():
    _yaml._cache.clear()
    yield
    _yaml._cache.clear()


def _count_parses(monkeypatch):
    calls = []
    parse = _yaml._parse
    monkeypatch.setattr(_yaml, "_parse", lambda text, name: calls.append(text) or parse(text, name))
    return calls


# ------------------------------------------------------------------------------------ _yaml
def test_an_octal_prefix_with_a_non_octal_digit_is_a_string():
    """Mutant: _INT_12's octal branch ``0o[0-7]+`` widened to ``0o[0-9]+`` (``0o8`` resolved as
    an integer, then refused as a malformed file)."""
    assert _yaml.load("a: 0o8\nb: 0o17\n") == {"a": "0o8", "b": 15}


def test_a_float_that_starts_with_a_dot_follows_yaml_1_2():
    """Mutant: '.' dropped from the float resolver's first characters (so '.' kept YAML 1.1's
    pattern, under which ``.5e3`` is a string and ``._5`` a float)."""
    assert _yaml.load("a: .5e3\nb: .5\nc: ._5\nd: .inf\n") == {"a": 500.0, "b": 0.5, "c": "._5",
                                                             "d": float("inf")}


def test_brief_prints_an_integer_of_up_to_128_bits_as_it_is():
    """Mutant: _Brief.repr_int's ``bits <= 128`` lowered (an ordinary id printed as '<an integer
    of N digits>')."""
    assert _yaml.brief(5000) == "5000"
    assert _yaml.brief(2 ** 128 - 1) == str(2 ** 128 - 1)
    assert _yaml.brief(2 ** 128) == "<an integer of 39 digits>"


def test_brief_keeps_a_text_of_exactly_its_width_and_cuts_a_longer_one_to_it():
    """Mutants: brief's ``len(text) <= BRIEF_WIDTH`` made ``<`` (a text of exactly the width cut),
    and the cut made ``text[:BRIEF_WIDTH]`` (longer than BRIEF_WIDTH with its '...')."""
    v = ["x" * 20, "y" * 20, "z" * 20, "w" * 24]          # repr: 3 * 22 + 26 + 3 * 2 + 2 = 100
    assert len(_yaml._BRIEF.repr(v)) == _yaml.BRIEF_WIDTH
    assert _yaml.brief(v) == _yaml._BRIEF.repr(v)
    long = ["x" * 50, "y" * 50]
    assert len(_yaml._BRIEF.repr(long)) > _yaml.BRIEF_WIDTH
    cut = _yaml.brief(long)
    assert len(cut) == _yaml.BRIEF_WIDTH and cut.endswith("...")


def test_only_the_nodes_aliases_add_count_against_the_alias_limit(monkeypatch):
    """Mutants: _check_expansion's ``extra = size - len(size)`` made ``size`` (every written node
    counted: a large plain file refused as an alias bomb), and ``extra > MAX_ALIAS_NODES`` made
    ``>=`` (an expansion of exactly the limit refused)."""
    monkeypatch.setattr(_yaml, "MAX_ALIAS_NODES", 3)
    assert _yaml.load("[1, 2, 3, 4, 5, 6, 7, 8]\n") == [1, 2, 3, 4, 5, 6, 7, 8]
    assert _yaml.load("a: &x [1, 2]\nb: *x\n") == {"a": [1, 2], "b": [1, 2]}   # adds 3 nodes
    with pytest.raises(yaml.YAMLError, match="aliases would expand the document by 4 nodes"):
        _yaml.load("a: &x [1, 2, 3]\nb: *x\n")


def test_a_text_of_exactly_cache_max_len_is_kept(monkeypatch):
    """Mutant: load's ``len(text) > CACHE_MAX_LEN`` made ``>=`` (a text of exactly the limit
    parsed each time)."""
    text = "key: value\n"
    monkeypatch.setattr(_yaml, "CACHE_MAX_LEN", len(text))
    calls = _count_parses(monkeypatch)
    assert _yaml.load(text) == _yaml.load(text) == {"key": "value"}
    assert calls == [text]


def test_the_cache_drops_the_least_recently_used_document():
    """Mutant: load's ``_cache.move_to_end(text)`` on a hit dropped (the cache evicted by first
    insertion, so a file read on every registry load fell out behind once-read ones)."""
    _yaml.load("hot: 1\n")
    for i in range(_yaml.CACHE_ENTRIES - 1):
        _yaml.load(f"k: {i}\n")
    _yaml.load("hot: 1\n")            # a hit: now the most recently used
    _yaml.load("new: 1\n")            # one over: evicts the least recently used
    assert "hot: 1\n" in _yaml._cache and "k: 0\n" not in _yaml._cache


def test_bytes_are_kept_parsed_as_str_is(monkeypatch):
    """Mutants: load caching ``str`` only (``isinstance(text, str)``), and the cache looked up
    for str only: bytes parsed on every call."""
    calls = _count_parses(monkeypatch)
    assert _yaml.load(b"a: 1\n") == _yaml.load(b"a: 1\n") == {"a": 1}
    assert calls == [b"a: 1\n"]


def test_an_unhashable_key_is_named_by_pyyaml_at_its_line():
    """Mutant: construct_mapping's ``except TypeError: continue`` made ``raise`` (the base class's
    'found unhashable key' at its line became 'TypeError: unhashable type' with no line)."""
    with pytest.raises(yaml.constructor.ConstructorError, match=r"found unhashable key\n.*line 2"):
        _yaml.load("a: 1\n? [1]\n: 2\n")


# ----------------------------------------------------------------------------------- fatbin
SH = struct.Struct("<IIQQQQIIQQ")
DATA_ADDR = 0x4000


def _elf(sections=(), phdrs=(), machine=62, ident=(2, 1), shentsize=64, phentsize=56,
         extended=False):
    """A synthetic ELF64 file: header, program headers, section bodies, .shstrtab, then the section
    table (null section first, .shstrtab last). sections: (name, sh_type, addr, body, link,
    entsize), section i of the list being index i + 1; phdrs: (p_type, offset, filesz)."""
    names, name_at = b"\0", []
    for s in sections:
        name_at.append(len(names))
        names += s[0].encode() + b"\0"
    shstr_name = len(names)
    names += b".shstrtab\0"
    body_at = 64 + phentsize * len(phdrs)
    blob, offsets = b"", []
    for s in sections:
        offsets.append(body_at + len(blob))
        blob += s[3] + b"\0" * (-len(s[3]) % 8)
    shstr_at = body_at + len(blob)
    blob += names + b"\0" * (-len(names) % 8)
    shoff = body_at + len(blob)
    shnum = len(sections) + 2
    pad = b"\0" * (shentsize - SH.size)
    table = SH.pack(0, 0, 0, 0, 0, shnum if extended else 0, 0, 0, 0, 0) + pad
    for (_, typ, addr, body, link, entsize), name, off in zip(sections, name_at, offsets):
        table += SH.pack(name, typ, 2, addr, off, len(body), link, 0, 8, entsize) + pad
    table += SH.pack(shstr_name, 3, 0, 0, shstr_at, len(names), 0, 0, 1, 0) + pad
    head = (b"\x7fELF" + bytes([ident[0], ident[1], 1]) + bytes(9)
            + struct.pack("<HHIQQQIHHHHHH", 3, machine, 1, 0, 64 if phdrs else 0, shoff, 0, 64,
                          phentsize, len(phdrs), shentsize, 0 if extended else shnum, shnum - 1))
    ph = b"".join(struct.pack("<IIQQQQQQ", t, 5, o, 0, 0, n, n, 0x1000) + b"\0" * (phentsize - 56)
                  for t, o, n in phdrs)
    return head + ph + blob + table


def _sym(name_at, shndx, value, size=4, stype=1, bind=1):
    return struct.pack("<IBBHQQ", name_at, bind << 4 | stype, 0, shndx, value, size)


def _lib(syms=None, strtab=b"\0ex_abi_version\0", data=struct.pack("<I", 7), dynsym_entsize=24):
    """An ELF with .dynstr (1), .dynsym (2, linking 1) and .data (3, at DATA_ADDR) whose
    .dynsym defines ex_abi_version = 7 (or ``syms``)."""
    if syms is None:
        syms = [_sym(1, 3, DATA_ADDR)]
    return _elf([(".dynstr", 3, 0, strtab, 0, 0),
                 (".dynsym", 11, 0, bytes(24) + b"".join(syms), 1, dynsym_entsize),
                 (".data", 1, DATA_ADDR, data, 0, 0)])


def _set_section_field(data, index, field_offset, value, fmt="<Q"):
    data = bytearray(data)
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, = struct.unpack_from("<H", data, 0x3A)
    struct.pack_into(fmt, data, shoff + index * shentsize + field_offset, value)
    return bytes(data)


def test_synthetic_library_reads_as_built():
    """(The builder the tests below use: a plain library reads its ex_abi_version.)"""
    lib = _lib()
    assert fatbin.exported_u32(lib, "ex_abi_version") == 7
    assert set(fatbin.elf_sections(lib)) == {"", ".dynstr", ".dynsym", ".data", ".shstrtab"}


def test_check_segments_reads_only_elf64_little_endian():
    """Mutant: check_segments' class/data test (``data[4] != 2 or data[5] != 1``) dropped: a
    32-bit or big-endian header was read as ELF64 LE and refused as truncated."""
    for ident in ((1, 1), (2, 2)):
        head = b"\x7fELF" + bytes(ident) + b"\1" + b"\xff" * 57
        fatbin.check_segments(head)        # quiet: not for this reader (elf_sections says so)


def test_check_segments_without_program_headers_is_quiet():
    """Mutant: ``e_phoff == 0 or e_phnum == 0`` made ``and`` (a file with no program headers
    judged by a stale e_phoff)."""
    data = bytearray(_elf())
    struct.pack_into("<Q", data, 0x20, 10 ** 9)        # e_phoff far away, e_phnum 0
    fatbin.check_segments(bytes(data))


def test_check_segments_refuses_program_headers_smaller_than_elf64s():
    """Mutant: the ``e_phentsize < _PHDR.size`` test dropped (entries of 0 bytes read at one
    offset, the table never past the end)."""
    data = bytearray(_elf(phdrs=[(1, 0, 64)]))
    struct.pack_into("<H", data, 0x36, 0)              # e_phentsize
    with pytest.raises(fatbin.TruncatedElfError, match="program header table"):
        fatbin.check_segments(bytes(data))


def test_a_segment_and_a_table_that_end_exactly_at_the_files_end_pass():
    """Mutants: check_segments' ``e_phoff + e_phnum * e_phentsize > len(data)`` and
    ``p_offset + p_filesz > len(data)`` made ``>=`` (a file whose last byte is in the table or
    a segment refused as truncated)."""
    n = 64 + 56
    data = _elf(phdrs=[(1, 0, n)])[:n]                 # header and one PT_LOAD of the whole file
    fatbin.check_segments(data)


def test_a_segment_other_than_pt_load_may_lie_beyond_the_end():
    """Mutant: check_segments' ``p_type == PT_LOAD`` test dropped (a PT_NOTE or PT_GNU_STACK
    beyond the file is not mapped, yet it was refused)."""
    fatbin.check_segments(_elf(phdrs=[(4, 10 ** 6, 100), (1, 0, 64)]))


def test_program_headers_are_stepped_by_e_phentsize():
    """Mutant: check_segments stepping by _PHDR.size (56) instead of e_phentsize: with 64-byte
    entries the second PT_LOAD, beyond the end, was not seen."""
    data = _elf(phdrs=[(1, 0, 64), (1, 10 ** 6, 100)], phentsize=64)
    with pytest.raises(fatbin.TruncatedElfError, match="loadable segment 1"):
        fatbin.check_segments(data)


def test_elf_machine_needs_the_whole_field_and_reads_big_endian_files_so():
    """Mutants: elf_machine's ``len(data) < 20`` made ``< 19`` (half a field read), and its
    byte order fixed to little endian (a big-endian PowerPC64 file read as 5376)."""
    little = _elf(machine=183)
    assert fatbin.elf_machine(little) == 183 and fatbin.elf_machine(little[:19]) is None
    big = bytearray(little)
    big[5] = 2
    big[18:20] = (21).to_bytes(2, "big")
    assert fatbin.elf_machine(bytes(big)) == 21


def test_check_machine_is_quiet_where_this_process_machine_is_unknown(monkeypatch):
    """Mutant: check_machine's ``own is not None`` dropped (every library refused as built for
    another CPU than 'None')."""
    monkeypatch.setattr(fatbin, "process_machine", lambda: None)
    fatbin.check_machine(_elf(machine=183))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/exe")
def test_process_machine_reads_this_interpreters_elf_header():
    """Mutant: process_machine reading 19 bytes of the executable (too few: None, so every
    library of another CPU passed and test_trial42f's check of it skipped)."""
    with open("/proc/self/exe", "rb") as fh:
        want = fatbin.elf_machine(fh.read(64))
    assert want is not None and fatbin.process_machine.__wrapped__() == want


def test_family_ptx_stays_within_its_major_and_plain_ptx_runs_on_its_own_cc():
    """Mutants: runs_on's ``or self.suffix == "f"`` dropped (compute_100f JIT-compiled for cc
    12.0), and plain PTX's ``<=`` made ``<`` (compute_80 refused on cc 8.0)."""
    ok = lambda kind, arch, suffix, cc: fatbin.CodeEntry(kind, arch, suffix).runs_on(*cc)
    assert ok("ptx", 100, "f", (10, 3)) and not ok("ptx", 100, "f", (12, 0))
    assert ok("ptx", 80, "", (8, 0))


def test_extended_section_numbering_reads_the_count_from_section_0():
    """Mutant: elf_sections' extended numbering (e_shnum 0: the count in section 0's sh_size)
    dropped."""
    data = _elf([(".dynstr", 3, 0, b"\0", 0, 0), (".data", 1, DATA_ADDR, b"1234", 0, 0)], extended=True)
    assert struct.unpack_from("<H", data, 0x3C) == (0,)           # e_shnum
    assert fatbin.elf_sections(data)[".data"][1] == 4


def test_section_headers_smaller_than_elf64s_are_refused():
    """Mutant: elf_sections' ``e_shentsize < sh.size`` test dropped."""
    data = bytearray(_lib())
    struct.pack_into("<H", data, 0x3A, 0)              # e_shentsize
    with pytest.raises(fatbin.TruncatedElfError, match="section table"):
        fatbin.elf_sections(bytes(data))


def test_a_string_table_index_outside_the_table_is_a_fatbin_error():
    """Mutant: elf_sections' ``except (struct.error, IndexError)`` without IndexError (an
    e_shstrndx past the table escaped as IndexError)."""
    data = bytearray(_lib())
    struct.pack_into("<H", data, 0x3E, 200)            # e_shstrndx
    with pytest.raises(fatbin.FatbinError, match="malformed ELF header or section table"):
        fatbin.elf_sections(bytes(data))


def test_section_headers_are_stepped_by_e_shentsize():
    """Mutant: elf_sections stepping by sh.size (64) instead of e_shentsize."""
    lib = _elf([(".dynstr", 3, 0, b"\0ex_abi_version\0", 0, 0),
                (".dynsym", 11, 0, bytes(24) + _sym(1, 3, DATA_ADDR), 1, 24),
                (".data", 1, DATA_ADDR, struct.pack("<I", 7), 0, 0)], shentsize=80)
    assert set(fatbin.elf_sections(lib)) == {"", ".dynstr", ".dynsym", ".data", ".shstrtab"}
    assert fatbin.exported_u32(lib, "ex_abi_version") == 7


def test_elf_sections_without_a_section_table_is_empty():
    """Mutant: elf_sections' ``e_shoff == 0`` answer made a made-up null section."""
    data = bytearray(_lib())
    struct.pack_into("<Q", data, 0x28, 0)
    assert fatbin.elf_sections(bytes(data)) == {}


def test_a_dynsym_of_entry_size_0_is_read():
    """Mutant: exported_u32's ``entsize not in (0, _SYM.size)`` made ``!= _SYM.size`` (sh_entsize
    0, 'no fixed size', refused)."""
    assert fatbin.exported_u32(_lib(dynsym_entsize=0), "ex_abi_version") == 7


def test_a_dynsym_or_its_links_outside_the_file_say_nothing_for_sure():
    """Mutants: exported_u32's ``off + size > len(data)`` dropped, ``link >= len(heads)`` made
    ``>``, and ``shndx >= len(heads)`` made ``>`` (each an escape as FatbinError, not None)."""
    lib = _lib()
    assert fatbin.exported_u32(_set_section_field(lib, 2, 32, 10 ** 6), "ex_abi_version") is None
    assert fatbin.exported_u32(_set_section_field(lib, 2, 40, 5, "<I"), "ex_abi_version") is None
    assert fatbin.exported_u32(_lib(syms=[_sym(1, 5, DATA_ADDR)]), "ex_abi_version") is None


def test_an_undefined_or_longer_named_symbol_is_absent():
    """Mutants: exported_u32's ``shndx != 0`` dropped (an undefined reference counted as a
    definition), and the name compared without its terminating NUL (``ex_abi_version_2``
    taken for ``ex_abi_version``)."""
    undefined = _lib(syms=[_sym(1, 0, 0)])
    assert fatbin.exported_u32(undefined, "ex_abi_version") == "absent"
    longer = _lib(syms=[_sym(1, 3, DATA_ADDR)], strtab=b"\0ex_abi_version_2\0")
    assert fatbin.exported_u32(longer, "ex_abi_version") == "absent"


def test_a_larger_or_untyped_symbol_is_a_symbol_problem():
    """Mutants: exported_u32's ``st_size != 4`` made ``< 4`` (an 8-byte object read as 4
    bytes), and STT_NOTYPE taken for STT_OBJECT."""
    big = fatbin.exported_u32(_lib(syms=[_sym(1, 3, DATA_ADDR, size=8)], data=bytes(8)), "ex_abi_version")
    assert isinstance(big, fatbin.SymbolProblem) and "8-byte data object" in big
    untyped = fatbin.exported_u32(_lib(syms=[_sym(1, 3, DATA_ADDR, stype=0)]), "ex_abi_version")
    assert isinstance(untyped, fatbin.SymbolProblem) and "STT_NOTYPE" in untyped


def test_a_value_outside_its_section_or_the_file_says_nothing_for_sure():
    """Mutants: exported_u32's ``soff <= pos`` dropped (a value below its section's address read
    from the bytes before it), and ``soff + ssize <= len(data)`` dropped (a section past the end
    of a truncated file trusted)."""
    below = _lib(syms=[_sym(1, 3, DATA_ADDR - 8)])
    assert fatbin.exported_u32(below, "ex_abi_version") is None
    past_end = _set_section_field(_lib(), 3, 32, 10 ** 6)      # .data's sh_size
    assert fatbin.exported_u32(past_end, "ex_abi_version") is None


def _entry(kind, arch, flags=0, payload=b"\0" * 8, header=64):
    head = struct.pack("<HHIQIIHHIIIQ", kind, 0x101, header, len(payload), 0, 0, 0, 0, arch, 0, 0, flags)
    return head + b"\0" * (header - len(head)) + payload


def _container(entries, header=16):
    return struct.pack("<IHHQ", fatbin.FATBIN_MAGIC, 1, header, len(entries)) + b"\0" * (header - 16) + entries


def test_a_container_header_at_the_very_end_whose_size_points_past_it_is_malformed():
    """Mutant: fatbin_entries' ``pos + _CONTAINER.size > len(blob)`` made ``>=`` (a 16-byte
    header at the end claiming 64 bytes taken as the end of the blob)."""
    with pytest.raises(fatbin.FatbinError, match="beyond the section"):
        fatbin.fatbin_entries(struct.pack("<IHHQ", fatbin.FATBIN_MAGIC, 1, 16, 64))


def test_a_container_header_size_below_16_or_above_it():
    """Mutants: fatbin_entries' ``hsize < _CONTAINER.size`` test dropped, and entries read from
    ``pos + _CONTAINER.size`` instead of ``pos + header_size``."""
    with pytest.raises(fatbin.FatbinError, match="beyond the section"):
        fatbin.fatbin_entries(struct.pack("<IHHQ", fatbin.FATBIN_MAGIC, 1, 8, 0))
    assert fatbin.fatbin_entries(_container(_entry(2, 80), header=32)) == [fatbin.CodeEntry("sass", 80)]


def test_an_entry_of_a_48_byte_header_and_no_payload_is_read():
    """Mutant: fatbin_entries' ``p + _ENTRY.size <= end`` made ``<`` (the last entry of exactly 48
    bytes left out)."""
    blob = _container(_entry(2, 90, payload=b"", header=48))
    assert fatbin.fatbin_entries(blob) == [fatbin.CodeEntry("sass", 90)]


def test_an_entry_header_below_48_bytes_is_malformed():
    """Mutant: fatbin_entries' ``ehsize < _ENTRY.size`` test dropped."""
    head = struct.pack("<HHIQIIHHIIIQ", 2, 0x101, 16, 0, 0, 0, 0, 0, 90, 0, 0, 0)
    with pytest.raises(fatbin.FatbinError, match="header 16 B"):
        fatbin.fatbin_entries(_container(head))


def test_both_target_flags_read_as_arch_specific_and_unknown_kinds_are_skipped():
    """Mutants: the suffix test giving FLAG_FAMILY_SPECIFIC precedence, and fatbin_entries'
    ``kind in (KIND_PTX, KIND_ELF)`` dropped (an entry of another kind listed as SASS)."""
    blob = _container(_entry(2, 100, flags=0x300000) + _entry(3, 120) + _entry(1, 80))
    assert [e.name for e in fatbin.fatbin_entries(blob)] == ["sm_100a", "compute_80"]


def test_the_magic_inside_a_payload_is_not_a_container():
    """Mutant: fatbin_entries going on at ``pos + 16`` instead of the container's end (a payload
    holding the magic read as a container of its own)."""
    inner = _container(_entry(2, 70))
    blob = _container(_entry(2, 90, payload=inner))
    assert fatbin.fatbin_entries(blob) == [fatbin.CodeEntry("sass", 90)]


def _fat_lib(blob):
    return _elf([(".nv_fatbin", 1, 0, blob, 0, 0)])


def test_a_fatbin_section_past_the_end_of_the_file_is_truncated():
    """Mutant: library_code's ``off + size > len(data)`` test dropped (the section cut by the
    file's end read as far as it goes)."""
    lib = _set_section_field(_fat_lib(_container(_entry(2, 90))), 1, 32, 10 ** 6)
    with pytest.raises(fatbin.TruncatedElfError, match="section .nv_fatbin beyond the end"):
        fatbin.library_code(lib)


def test_library_code_lists_sm_xya_then_sm_xy_then_sm_xyf():
    """Mutant: library_code's sort key without ``e.suffix != "a"`` (sm_100 listed before
    sm_100a)."""
    blob = _container(_entry(2, 100, 0x200000) + _entry(2, 100) + _entry(2, 100, 0x100000))
    assert [e.name for e in fatbin.library_code(_fat_lib(blob))] == ["sm_100a", "sm_100", "sm_100f"]


def test_describe_says_no_sass():
    """Mutant: describe's 'no SASS' made 'no PTX'."""
    assert fatbin.describe([fatbin.CodeEntry("ptx", 80)]) == "no SASS and compute_80 PTX"
    assert fatbin.describe([fatbin.CodeEntry("sass", 80)]) == "sm_80 SASS and no PTX"


# ---------------------------------------------------- found by this run: a refusal with no line
@pytest.mark.parametrize("text, needle", [
    ("a: 1\nwhen: 2024-13-01\n", "month must be in 1..12"),
    (b"a: 1\nid: !!int x\n", "invalid integer 'x'"),
    ("a: 1\nb: {c: [1, !!int 0b1]}\n", "invalid integer '0b1'"),
])
def test_a_scalar_its_constructor_refuses_is_named_at_its_file_and_line(text, needle):
    """Not a mutant: the run's one finding. A scalar refused by a ValueError of its constructor
    (an integer YAML 1.2 does not allow under ``!!int``, a date out of range) raised
    "ConstructorError: ValueError: ..." with no file and no line; now marked at the scalar, as
    the ``!!bool`` / ``!!float`` / ``!!timestamp`` refusals were."""
    with pytest.raises(yaml.constructor.ConstructorError) as info:
        _yaml.load(text, name="f.yaml")
    assert needle in str(info.value) and 'in "f.yaml", line 2' in str(info.value), str(info.value)

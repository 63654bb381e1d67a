"""YAML reading for ex_engine's files (manifests, tuning files, hardware profiles, the model list).

PyYAML resolves plain scalars by YAML 1.1's rules, under which a float needs a dot and a signed
exponent: ``1e-5``, ``1.0e5`` and ``3E8`` are strings, not numbers; YAML 1.2 (and most people
writing a tolerance or an eps) read them as floats. ``load`` is ``yaml.safe_load`` plus YAML
1.2's core-schema float pattern ``[-+]?(.[0-9]+|[0-9]+(.[0-9]*)?)([eE][-+]?[0-9]+)?``, tried
after PyYAML's own resolvers (integers stay integers), so ``tolerance: {float32: 1e-5}`` means
1e-05 everywhere ex_engine reads YAML. A mapping that gives a key twice is a
yaml.constructor.ConstructorError naming the key and both lines (PyYAML kept the last).

Integers follow YAML 1.2's core schema too: ``[-+]?[0-9]+`` is decimal even with leading zeros
(``id: 02260`` is 2260; YAML 1.1 read it as the octal 1200), ``0o17`` octal, ``0x1F`` hex
(unsigned); 1.1's ``0b101``, ``1_000`` and sexagesimal ``1:30`` are strings (the field's own check
names them), as are its floats ``1_000.5`` and ``1:30.5``.

Pathological input is a yaml.YAMLError like any malformed file, so each reader reports the file
and goes on: nesting deeper than MAX_DEPTH levels (``[[[[...]]]]`` of a few hundred levels raised
RecursionError out of the composer), and aliases that would expand the document by more than
MAX_ALIAS_NODES nodes (a 1 KB "billion laughs" of nested ``&a``/``*a`` anchors: every later walk
or repr of the value ran for minutes and took GBs) or that refer to themselves (``&a [*a]``).
Anchors, aliases and merge keys (``<<: *base``) of ordinary size keep working.
"""
from __future__ import annotations

import collections
import copy
import difflib
import os
import re
import reprlib
import threading

import yaml
from yaml.composer import ComposerError

MAX_DEPTH = 100            # nesting levels, as written or as aliases expand them
MAX_ALIAS_NODES = 100_000  # nodes the aliases may add to a document beyond those written
CACHE_ENTRIES = 32         # documents load keeps parsed, by their text (see load)
CACHE_MAX_LEN = 1 << 20    # characters (or bytes): a longer text is parsed each time, not kept
_cache: collections.OrderedDict = collections.OrderedDict()   # text -> parsed document
_cache_lock = threading.Lock()


def _refused(node, problem: str) -> yaml.constructor.ConstructorError:
    """A scalar its (explicit) tag's constructor cannot read, marked at the scalar."""
    return yaml.constructor.ConstructorError(None, None, problem, node.start_mark)


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2's floats (1e-5, 1.0e5, 3E8) as floats, and refuses a
    mapping that gives one key twice (PyYAML keeps the last silently: a manifest's second
    ``name:`` replaced the first)."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        # PyYAML's composer recurses once per level: refuse a deep file before Python's stack
        # runs out (a RecursionError escaped every reader)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels; expected "
                                    f"at most {MAX_DEPTH}", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_document(self, node):
        _check_expansion(node)
        return super().construct_document(node)

    def construct_object(self, node, deep=False):
        # a constructor's refusal (``!!int x``, the date 2024-13-01: ValueError) marked at its
        # node, so the error names the file and line as a malformed file's does (it said only
        # "ValueError: month must be in 1..12"); the innermost node's mark is the one kept
        try:
            return super().construct_object(node, deep)
        except (ValueError, LookupError, AttributeError, TypeError) as exc:
            raise _refused(node, f"{type(exc).__name__}: {exc}") from exc

    def construct_yaml_int(self, node):
        """YAML 1.2 core schema: decimal (leading zeros too, a sign), 0o octal, 0x hex (no sign;
        an explicit ``!!int`` scalar is held to the same forms)."""
        text = self.construct_scalar(node)
        if not _INT_12.match(text):
            raise ValueError(f"invalid integer {brief(text)}: expected [-+]digits, 0o octal or 0x hex "
                             "(YAML 1.2)")
        if text[:2] in ("0o", "0x"):
            return int(text[2:], 8 if text[1] == "o" else 16)
        return int(text, 10)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":   # '<<: *anchor' (may repeat)
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:      # an unhashable key: the base class says so
                    continue
                if first is not None:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found duplicate key {key!r} (first given on line {first + 1}): expected "
                        "each key once", key_node.start_mark)
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)

    # PyYAML's own constructors for an explicit tag on a scalar they cannot read raise what no
    # reader catches: ``!!bool maybe`` KeyError, ``!!timestamp abc`` AttributeError, an empty
    # ``!!float`` IndexError (each escaped the registry as a traceback); refused by name here
    def construct_yaml_bool(self, node):
        text = self.construct_scalar(node)
        if not isinstance(text, str) or text.lower() not in self.bool_values:
            raise _refused(node, f"invalid boolean {brief(text)}: expected true or false")
        return super().construct_yaml_bool(node)

    def construct_yaml_float(self, node):
        text = self.construct_scalar(node)
        if not isinstance(text, str) or not text.replace("_", "").strip():
            raise _refused(node, f"invalid float {brief(text)}: expected a number such as 1.0e-5")
        return super().construct_yaml_float(node)

    def construct_yaml_timestamp(self, node):
        text = self.construct_scalar(node)
        if not isinstance(text, str) or not self.timestamp_regexp.match(text):
            raise _refused(node, f"invalid timestamp {brief(text)}: expected a date such as 2024-01-31")
        return super().construct_yaml_timestamp(node)


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
_Loader.add_constructor("tag:yaml.org,2002:bool", _Loader.construct_yaml_bool)
_Loader.add_constructor("tag:yaml.org,2002:float", _Loader.construct_yaml_float)
_Loader.add_constructor("tag:yaml.org,2002:timestamp", _Loader.construct_yaml_timestamp)

def _resolve_as_yaml_12(tag: str, pattern, first: str, in_place: bool) -> None:
    """Give _Loader YAML 1.2's implicit resolver ``pattern`` for ``tag`` in place of PyYAML's 1.1
    one (add_implicit_resolver gives _Loader its own copy of the table, so SafeLoader keeps its
    own): ``in_place``, where 1.1's stood; else last, after the other resolvers of a character."""
    _Loader.add_implicit_resolver(tag, pattern, list(first))
    for resolvers in _Loader.yaml_implicit_resolvers.values():
        ours = [r for r in resolvers if r[0] == tag]
        if len(ours) == 2:          # PyYAML's 1.1 pattern, then ours (appended)
            if in_place:
                resolvers[resolvers.index(ours[0])] = resolvers.pop()
            else:
                resolvers.remove(ours[0])


# integers in place of 1.1's (octal 0NNN, 0b, underscores, sexagesimal)
_INT_12 = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_resolve_as_yaml_12("tag:yaml.org,2002:int", _INT_12, "-+0123456789", in_place=True)
# floats after the integers (1.2's pattern also matches plain digits): 1e-5 is a float (1.1
# wanted a dot), and 1.1's 1_000.5 and sexagesimal 1:30.5 are strings
_FLOAT_12 = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                       r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
_resolve_as_yaml_12("tag:yaml.org,2002:float", _FLOAT_12, "-+0123456789.", in_place=False)


class _Brief(reprlib.Repr):
    """reprlib with small limits; an integer too long to print (Python refuses to turn one of
    over 4300 digits into text: ValueError) is described by its length."""

    def __init__(self):
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother, self.maxlong = 2, 60, 60, 40
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = 4

    def repr_int(self, x, level):
        bits = x.bit_length()
        if bits <= 128:            # up to 39 digits: as it is
            return super().repr_int(x, level)
        digits = str(len(str(abs(x)))) if bits < 14000 else f"about {int(bits * 0.30103) + 1}"
        return f"{'-' if x < 0 else ''}<an integer of {digits} digits>"


_BRIEF = _Brief()
BRIEF_WIDTH = 100


def brief(v) -> str:
    """``v``'s repr in bounded length (BRIEF_WIDTH) and time, for an error message: containers
    cut after a few items and two levels, strings after 60 characters, a long integer described
    by its number of digits. (``f"{v!r:.80}"`` built the whole text first: an aliased list of
    10**9 items ran for minutes, and repr(10**5000) raises ValueError.)"""
    try:
        text = _BRIEF.repr(v)
    except Exception:   # an object whose __repr__ fails (reprlib catches most)
        text = f"<{type(v).__name__} object>"
    return text if len(text) <= BRIEF_WIDTH else text[:BRIEF_WIDTH - 3] + "..."


def unknown_keys(where: str, d: dict, known) -> str:
    """'' if every key of the mapping ``d`` is in ``known``, else what is wrong with the first
    that is not, with the likely intended key where one is close (difflib): "``where``unknown
    key 'falback' (did you mean 'fallback'?); expected some of ..."."""
    for k in d:
        if k not in known:
            close = difflib.get_close_matches(str(k), known, n=1) if isinstance(k, str) else []
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            return f"{where}unknown key {brief(k)}{hint}; expected some of {', '.join(known)}"
    return ""


def _children(node):
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return ()


def _check_expansion(root) -> None:
    """Raise ComposerError if the node graph ``root`` (aliases share nodes) refers to itself, or
    would expand, every alias replaced by a copy of its anchor's value, by more than
    MAX_ALIAS_NODES nodes or to more than MAX_DEPTH levels. Iterative, each node once: cheap
    however large the expansion would be."""
    size: dict = {}       # id(node) -> nodes of its expansion
    depth: dict = {}      # id(node) -> levels of its expansion
    on_path: set = set()
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        k = id(node)
        if done:
            on_path.discard(k)
            kids = _children(node)
            size[k] = 1 + sum(size[id(c)] for c in kids)
            depth[k] = 1 + max((depth[id(c)] for c in kids), default=0)
            continue
        if k in size:
            continue
        on_path.add(k)
        stack.append((node, True))
        for c in _children(node):
            if id(c) in on_path:
                raise ComposerError(None, None, "found an alias inside its own anchor's value (a "
                                    "structure that contains itself); expected none", c.start_mark)
            if id(c) not in size:
                stack.append((c, False))
    extra = size[id(root)] - len(size)
    if extra > MAX_ALIAS_NODES:
        raise ComposerError(None, None, f"aliases would expand the document by {extra} nodes; "
                            f"expected at most {MAX_ALIAS_NODES} (an alias bomb?)", root.start_mark)
    if depth[id(root)] > MAX_DEPTH:
        raise ComposerError(None, None, f"aliases would nest the document {depth[id(root)]} levels "
                            f"deep; expected at most {MAX_DEPTH}", root.start_mark)


def load(text, name=None):
    """The YAML document in ``text`` (str, bytes or a text file) as Python objects, by
    yaml.safe_load's rules plus YAML 1.2's floats and integers. Raises yaml.YAMLError on
    malformed YAML, also where PyYAML's own constructors raise ValueError (a timestamp such as
    2024-13-01), for nesting deeper than MAX_DEPTH, for aliases that would expand the document
    by more than MAX_ALIAS_NODES nodes or contain themselves, and where Python's stack runs out
    (RecursionError) anyway.

    name: the file ``text`` was read from (a str or os.PathLike), named by the error's marks
    ('in "/path/x.yaml", line 1, column 7'); without it PyYAML names a str "<unicode string>"
    (bytes "<byte string>"; a file object its own name).

    The last CACHE_ENTRIES documents read from a str or bytes (of at most CACHE_MAX_LEN
    characters or bytes) are kept parsed, keyed by the text
    itself (so an edited file is parsed again), and each call returns its own deep copy: a
    registry built again in one process read its two tuning files and its manifests again
    (about 0.1 s of its 0.16 s). Text that fails is not kept: it raises the same error each
    time, naming the ``name`` of that call."""
    if not isinstance(text, (str, bytes)) or len(text) > CACHE_MAX_LEN:
        return _parse(text, name)
    with _cache_lock:
        hit = _cache.get(text)
        if hit is not None:
            _cache.move_to_end(text)
    if hit is not None:
        return copy.deepcopy(hit[0])
    data = _parse(text, name)
    with _cache_lock:
        _cache[text] = (copy.deepcopy(data),)
        while len(_cache) > CACHE_ENTRIES:
            _cache.popitem(last=False)
    return data


def _parse(text, name):
    """load's parse, uncached (see load)."""
    name = None if name is None else os.fsdecode(os.fspath(name))
    try:
        loader = _Loader(text)
    except yaml.reader.ReaderError as exc:   # a character YAML refuses, found on reading a str
        if name is not None:
            exc.name = name
        raise
    if name is not None:   # (PyYAML's Reader names every mark after this attribute)
        loader.name = name
    try:
        return loader.get_single_data()
    except (ValueError, LookupError, AttributeError, TypeError) as exc:
        # (_Loader.construct_object marks a constructor's refusal at its node: this is only for
        # a slip outside any one node's construction, malformed input all the same)
        raise yaml.constructor.ConstructorError(None, None, f"{type(exc).__name__}: {exc}") from exc
    except RecursionError:      # (MAX_DEPTH keeps PyYAML from it; another path must not escape)
        raise yaml.YAMLError(f"nested too deeply to read (RecursionError); expected at most "
                             f"{MAX_DEPTH} levels") from None
    finally:
        loader.dispose()

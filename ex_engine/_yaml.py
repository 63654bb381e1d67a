"""YAML reading for ex_engine's files (manifests, tuning files, hardware profiles, the model list).

PyYAML resolves plain scalars by YAML 1.1's rules, under which a float needs a dot and a signed
exponent: ``1e-5``, ``1.0e5`` and ``3E8`` are strings, not numbers; YAML 1.2 (and most people
writing a tolerance or an eps) read them as floats. ``load`` is ``yaml.safe_load`` plus YAML
1.2's core-schema float pattern ``[-+]?(.[0-9]+|[0-9]+(.[0-9]*)?)([eE][-+]?[0-9]+)?``, tried
after PyYAML's own resolvers (integers stay integers), so ``tolerance: {float32: 1e-5}`` means
1e-05 everywhere ex_engine reads YAML. A mapping that gives a key twice is a
yaml.constructor.ConstructorError naming the key and both lines (PyYAML kept the last).
"""
from __future__ import annotations

import re

import yaml


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2's floats (1e-5, 1.0e5, 3E8) as floats, and refuses a
    mapping that gives one key twice (PyYAML keeps the last silently: a manifest's second
    ``name:`` replaced the first)."""

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


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$"),
    list("-+0123456789."))


def load(text):
    """The YAML document in ``text`` (str or bytes) as Python objects, by yaml.safe_load's rules
    plus YAML 1.2's floats. Raises yaml.YAMLError on malformed YAML, also where PyYAML's own
    constructors raise ValueError (a timestamp such as 2024-13-01)."""
    try:
        return yaml.load(text, Loader=_Loader)
    except ValueError as exc:   # a scalar its resolver matched but its constructor refused
        raise yaml.constructor.ConstructorError(None, None, f"{type(exc).__name__}: {exc}") from exc
